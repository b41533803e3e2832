"""Muon on JAX's multi-process runtime: 2 local processes × 4 CPU devices
forming one (2, 4) mesh with gloo collectives, against one process with 8."""

import chex
import jax
import numpy as np
import pytest

import multiprocess
import multiprocess_cases as cases
import optax_muon as om


@pytest.fixture(scope="module")
def two_process_updates():
  return multiprocess.run("multiprocess_cases:tp_modes")


@pytest.mark.parametrize("layout", ["data_across", "model_across"])
@pytest.mark.parametrize("mode", cases.MODES)
def test_every_mode_across_processes_equals_one_process(two_process_updates,
                                                        layout, mode):
  first, second = two_process_updates
  chex.assert_trees_all_equal(first[(layout, mode)], second[(layout, mode)])
  one_process = cases.update(cases.mesh(layout), mode)
  chex.assert_trees_all_close(first[(layout, mode)], one_process, atol=1e-5)
  if mode != "blockwise":  # the full-matrix modes: the unsharded update too
    params, _ = cases.tree()
    plain = om.scale_by_muon(split_qkv={"qkv": cases.SPLIT})
    expected, _ = plain.update(params, plain.init(params))
    chex.assert_trees_all_close(first[(layout, mode)],
                                jax.tree.map(np.asarray, expected), atol=1e-5)


def test_distribute_over_data_across_processes(two_process_updates):
  params, _ = cases.tree()
  plain = om.scale_by_muon(split_qkv={"qkv": cases.SPLIT})
  expected, _ = plain.update(params, plain.init(params))
  for result in two_process_updates:
    chex.assert_trees_all_close(result[("data_across", "distribute_over")],
                                jax.tree.map(np.asarray, expected), atol=1e-5)


def test_zero1_state_split_across_processes_takes_two_exact_steps():
  (outs, splits), _ = multiprocess.run("multiprocess_cases:zero1_two_steps")
  assert splits["w0"] == jax.sharding.PartitionSpec("data", "model")
  params, _ = cases.tree()
  plain = om.scale_by_muon(split_qkv={"qkv": cases.SPLIT})
  state = plain.init(params)
  for t, got in enumerate(outs):
    grads = jax.tree.map(lambda x, t=t: np.cos(x * (t + 1.0)), params)
    expected, state = plain.update(grads, state)
    chex.assert_trees_all_close(got, jax.tree.map(np.asarray, expected),
                                atol=1e-5)


def test_only_process_zero_logs():
  assert multiprocess.run("multiprocess_cases:logging_process") == [1, 0]
