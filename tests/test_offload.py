"""Optimizer state in host memory between steps (state_memory_kind)."""

import re

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_muon as om
from conftest import normal
from optax_muon import compat
from optax_muon._src.base import built

HOST = "pinned_host"


def _kinds(state):
  return {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state)}


def _tree():
  keys = iter(jax.random.split(jax.random.key(0), 8))
  params = {
    "embed": normal(next(keys), (64, 32)),
    "col": normal(next(keys), (32, 64)),
    "row": normal(next(keys), (64, 32)),
    "stack": normal(next(keys), (4, 32, 64)),
    "bias": jnp.zeros(64),
  }
  specs = {
    "embed": P(),
    "col": P(None, "model"),
    "row": P("model", None),
    "stack": P(None, None, "model"),
    "bias": P(),
  }
  labels = {
    "embed": "adam",
    "col": "muon",
    "row": "muon",
    "stack": "muon",
    "bias": "adam",
  }
  dims = {
    "embed": None,
    "col": None,
    "row": None,
    "stack": om.MuonDimensionNumbers(1, 2),
    "bias": None,
  }
  return params, specs, labels, dims


def _steps(tx, params, steps=3):
  """``steps`` jitted updates; every state on the way is returned."""
  state = tx.init(params)
  states = [state]
  update = jax.jit(tx.update)
  for step in range(steps):
    grads = jax.tree.map(lambda x, s=step: jnp.cos(x * (s + 1.0)), params)
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
    states.append(state)
  return params, states


def test_the_state_lives_in_host_memory_after_init_and_every_update():
  params, _, labels, dims = _tree()
  tx = om.muon(
    0.02, labels=labels, dimension_numbers=dims, state_memory_kind=HOST
  )
  _, states = _steps(tx, params)
  for state in states:
    assert _kinds(state) == {HOST}


@pytest.mark.parametrize("mode", [None, *om.TensorParallel.MODES])
def test_offloaded_updates_are_bit_identical_in_every_mode(mode):
  params, specs, labels, dims = _tree()
  mesh = jax.make_mesh(
    (2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2
  )
  params = jax.tree.map(
    lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs
  )
  sharding = (
    None if mode is None else om.TensorParallel(mesh, mode=mode, specs=specs)
  )
  build = lambda kind: om.muon(
    0.02,
    labels=labels,
    dimension_numbers=dims,
    sharding=sharding,
    state_memory_kind=kind,
  )
  want, want_states = _steps(build(None), params)
  got, got_states = _steps(build(HOST), params)
  chex.assert_trees_all_equal(got, want)
  chex.assert_trees_all_equal(got_states[-1], want_states[-1])
  for state in got_states:
    assert _kinds(state) == {HOST}
  for leaf, like in zip(
    jax.tree.leaves(got_states[-1]), jax.tree.leaves(want_states[-1])
  ):
    assert leaf.sharding.spec == like.sharding.spec


def test_the_compiled_update_reads_and_writes_host_buffers():
  params, _, labels, dims = _tree()
  tx = om.muon(
    0.02, labels=labels, dimension_numbers=dims, state_memory_kind=HOST
  )
  state = tx.init(params)
  hlo = jax.jit(tx.update).lower(params, state, params).compile().as_text()
  layout = re.search(r"entry_computation_layout=\{\((.*)\)->(.*)\}", hlo)
  arguments, results = layout.groups()
  # S(5): the host memory space, one per state array in and out
  count = len(jax.tree.leaves(state))
  assert arguments.count("S(5)") == count
  assert results.count("S(5)") == count


def test_out_shardings_from_the_state_keep_its_memory_kind():
  params, _, labels, dims = _tree()
  tx = om.muon(
    0.02, labels=labels, dimension_numbers=dims, state_memory_kind=HOST
  )
  state = tx.init(params)
  shardings = jax.tree.map(lambda x: x.sharding, state)
  update = jax.jit(tx.update, out_shardings=(None, shardings))
  _, state = update(params, state, params)
  assert _kinds(state) == {HOST}


def test_8_bit_momentum_offloaded():
  params, _, labels, dims = _tree()
  build = lambda kind: om.muon(
    0.02,
    labels=labels,
    dimension_numbers=dims,
    mu_dtype=om.QuantizedMomentum(),
    state_memory_kind=kind,
  )
  want, _ = _steps(build(None), params)
  got, states = _steps(build(HOST), params)
  chex.assert_trees_all_equal(got, want)
  assert _kinds(states[-1]) == {HOST}
  assert jnp.dtype("int8") in {x.dtype for x in jax.tree.leaves(states[-1])}


@pytest.mark.parametrize(
  "make",
  [
    lambda kw: om.adaptive_muon(0.02, **kw),
    lambda kw: om.polargrad(0.02, **kw),
    lambda kw: om.muon_hyperball(0.02, **kw),
    lambda kw: om.scion(0.02, **kw),
    lambda kw: compat.torch_muon(0.02, **kw),
  ],
)
def test_the_family_offloads_its_state(make):
  params, _, labels, dims = _tree()
  params.pop("stack"), labels.pop("stack"), dims.pop("stack")
  kw = dict(labels=labels)
  want, _ = _steps(make(kw), params, steps=2)
  got, states = _steps(make(dict(kw, state_memory_kind=HOST)), params, 2)
  chex.assert_trees_all_equal(got, want)
  assert _kinds(states[-1]) == {HOST}


def test_compat_muon_offloads_optaxs_state():
  params = {"w": jnp.ones((16, 32)), "b": jnp.zeros(32)}
  want, _ = _steps(compat.muon(0.02), params, steps=2)
  got, states = _steps(compat.muon(0.02, state_memory_kind=HOST), params, 2)
  chex.assert_trees_all_equal(got, want)
  assert _kinds(states[-1]) == {HOST}


@pytest.mark.parametrize(
  "optimizer",
  ["muon", "adam", "adaptive_muon", "muon_bp", "dion", "dion2", "nordion2"],
)
def test_muon_config_optimizer_offload(optimizer):
  params = {
    "layer": {"kernel": normal(jax.random.key(0), (16, 32))},
    "bias": jnp.zeros(32),
  }
  offloaded = om.MuonConfig(optimizer=optimizer, optimizer_offload=True)
  tx = offloaded.build(1e-3)
  want, _ = _steps(om.MuonConfig(optimizer=optimizer).build(1e-3), params, 2)
  got, states = _steps(tx, params, steps=2)
  chex.assert_trees_all_equal(got, want)
  assert _kinds(states[-1]) == {HOST}
  # a family member that takes state_memory_kind is given it (its state then
  # comes to the device a wave at a time); optax's AdamW and MuonBP are
  # offloaded whole
  found = built.built(tx)
  if optimizer in ("adam", "muon_bp"):
    assert found is None or "state_memory_kind" not in found.arguments
  else:
    assert found.arguments["state_memory_kind"] == HOST


def test_a_bad_memory_kind_names_the_argument():
  with pytest.raises(ValueError, match="state_memory_kind"):
    om.muon(1e-3, state_memory_kind="host")
  with pytest.raises(ValueError, match="state_memory_kind"):
    compat.muon(1e-3, state_memory_kind="device_memory")
