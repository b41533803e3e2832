"""Muon on JAX's multi-process runtime: 2 local processes × 4 CPU devices
forming one (2, 4) mesh with gloo collectives, against one process with 8."""

import chex
import jax
import local_processes
import multiprocess_cases as cases
import numpy as np
import pytest

import optax_muon as om

pytestmark = pytest.mark.integration


def test_muon_across_two_processes_equals_one_process():
  # one launch for everything (a launch costs seconds): every tp mode on both
  # layouts, the data-axis split of the work, ZeRO-1, and logging
  first, second = local_processes.run("multiprocess_cases:everything")
  params, _ = cases.tree()
  plain = om.scale_by_muon(
    split_qkv={"qkv": cases.SPLIT}, dimension_numbers="leading"
  )
  unsharded = jax.tree.map(
    np.asarray, plain.update(params, plain.init(params))[0]
  )
  for layout in ("data_across", "model_across"):
    for mode in cases.MODES:
      got = first["tp_modes"][(layout, mode)]
      chex.assert_trees_all_equal(got, second["tp_modes"][(layout, mode)])
      one_process = cases.update(cases.mesh(layout), mode)
      chex.assert_trees_all_close(
        got, one_process, atol=1e-5, custom_message=f"{layout} {mode}"
      )
      if mode != "blockwise":  # the full-matrix modes: the unsharded update
        chex.assert_trees_all_close(
          got, unsharded, atol=1e-5, custom_message=f"{layout} {mode}"
        )
  for result in (first, second):
    chex.assert_trees_all_close(
      result["tp_modes"][("data_across", "distribute_over")],
      unsharded,
      atol=1e-5,
    )
    # FSDP x TP across processes: the stack homed per data rank
    for mode in cases.MODES[1:]:
      chex.assert_trees_all_close(
        result["tp_modes"][("data_across", "fsdp", mode)],
        unsharded,
        atol=1e-5,
        custom_message=f"fsdp {mode}",
      )
  # ZeRO-1: the momentum split over the data axis, which spans the processes;
  # two steps, the second reading it
  outs, splits = first["zero1"]
  assert splits["w0"] == jax.sharding.PartitionSpec("data", "model")
  state = plain.init(params)
  for t, got in enumerate(outs):
    grads = jax.tree.map(lambda x, t=t: np.cos(x * (t + 1.0)), params)
    expected, state = plain.update(grads, state)
    chex.assert_trees_all_close(
      got, jax.tree.map(np.asarray, expected), atol=1e-5
    )
  assert [first["log_records"], second["log_records"]] == [1, 0]


# -- the example across processes ---------------------------------------------

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

from conftest import ROOT  # noqa: E402
from examples.flax_lm import config as config_lib  # noqa: E402
from examples.flax_lm import distributed  # noqa: E402
from examples.flax_lm import launch_local  # noqa: E402
from examples.flax_lm import train as train_lib  # noqa: E402

RUN = [
  "model.n_layer=1",
  "model.n_embd=32",
  "model.n_head=4",
  "model.block_size=32",
  "train.batch_size=8",
  "train.warmup_steps=1",
  "train.eval_batches=2",
  "train.log_every=1",
  "train.progress=false",
  "train.max_bytes=200000",
]


def _launch(args, out, cache, **popen):
  env = dict(
    os.environ,
    JAX_COMPILATION_CACHE_DIR=str(cache),
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
  )
  return launch_local.start(
    2,
    ["--mesh", "data=2,model=4", *args, f"train.out_dir={out}"],
    cwd=ROOT,
    environ=env,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.PIPE,
    **popen,
  )


def _wait(processes, timeout=240):
  for process in processes:
    _, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err.decode()[-3000:]


def _val_curve(out):
  return [
    (r["step"], r["val_loss"])
    for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    if "val_loss" in r
  ]


def _kill_after_first_checkpoint_and_resume(
  tmp_path, steps, every, optimizer="muon", compare_one_process=True
):
  args = RUN + [
    f"optim.optimizer={optimizer}",
    f"train.steps={steps}",
    f"train.eval_every={every}",
    f"train.checkpoint_every={every}",
  ]
  # a compilation cache for each run: on jax 0.12.1 a run whose two
  # processes read the cache an earlier run wrote hung before its first step
  cache = tmp_path / "jax_cache"
  whole, broken = tmp_path / "whole", tmp_path / "broken"
  _wait(_launch(args, whole, cache / "whole"))
  # the same run, one process killed once the first checkpoint is written,
  # then the other (it waits in a collective), as a scheduler would
  processes = _launch(args, broken, cache / "broken")
  first = broken / "checkpoints" / str(every)
  deadline = time.time() + 240
  while (
    not (first / "_CHECKPOINT_METADATA").exists() and time.time() < deadline
  ):
    time.sleep(0.05)
  processes[1].send_signal(signal.SIGKILL)
  processes[1].wait()
  processes[0].send_signal(signal.SIGKILL)
  processes[0].wait()
  assert first.exists() and not (broken / "final.json").exists()
  _wait(_launch(args + ["--resume"], broken, cache / "resumed"))
  final = {
    name: json.loads((path / "final.json").read_text())
    for name, path in (("whole", whole), ("broken", broken))
  }
  assert final["broken"]["params_sha256"] == final["whole"]["params_sha256"]
  assert _val_curve(broken) == _val_curve(whole)
  if not compare_one_process:
    return
  # one process with all 8 devices: the same curve
  cfg = config_lib.run_config(args + [f"train.out_dir={tmp_path / 'one'}"])
  train_lib.train(cfg, mesh=distributed.parse_mesh("data=2,model=4"))
  for (step, two), (same_step, one) in zip(
    _val_curve(whole), _val_curve(tmp_path / "one")
  ):
    assert step == same_step and abs(two - one) <= 1e-5 * abs(one)


def test_two_process_training_resumes_exactly_after_a_kill(tmp_path):
  # the CI version (under a minute): AdamW, whose step compiles faster; the
  # slow one trains Muon and also compares one process with 8 devices (Muon
  # across processes is the test above; its resume, test_flax_lm's)
  _kill_after_first_checkpoint_and_resume(
    tmp_path, steps=4, every=2, optimizer="adam", compare_one_process=False
  )


@pytest.mark.slow
def test_two_process_training_resumes_exactly_after_a_kill_long(tmp_path):
  _kill_after_first_checkpoint_and_resume(tmp_path, steps=40, every=10)
