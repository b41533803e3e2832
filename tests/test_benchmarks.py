"""Every benchmark runs in --quick mode and prints finite ratios (the targets
themselves live in the README, measured by the full runs). gpu.sh --quick runs
the four single-device benchmarks on the CPU, as it will on a GPU machine."""

import functools
import importlib.metadata
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from conftest import benchmark_env as _env
from conftest import call_benchmark as _call
from conftest import run_benchmark as _run

pytestmark = pytest.mark.integration

RATIOS = {
  "ns_roofline": ["ratio", "time_ratio"],
  "update_vs_optax": [
    "ours_over_optax",
    "ours_gram_over_optax",
    "ours_over_adamw",
    "max_abs_diff",
    "ours_over_roofline",
    "ours_gram_over_roofline",
    "ours_over_matmuls_alone",
    "compat_over_optax",
    "compat_max_abs_diff",
  ],
  "memory": [
    "state_ours_over_adamw",
    "temp_ours_over_optax",
    "temp_ours_gram_over_optax",
  ],
  "train_step": ["muon_over_adamw"],
  "sharding": ["bytes_over_optax", "time_over_optax"],
}


def _numbers(value):
  if isinstance(value, dict):
    return [x for v in value.values() for x in _numbers(v)]
  return [value]


def _check(name, lines):
  records = [json.loads(line) for line in lines]
  assert records, name
  for record in records:
    keys = [key for key in RATIOS[name] if key in record]
    assert keys, record
    for key in keys:
      for number in _numbers(record[key]):
        assert math.isfinite(number) and number >= 0, (key, record)
  return records


@pytest.mark.slow  # two minutes; the next test runs the compat row alone
def test_gpu_script_runs_every_benchmark_on_cpu_in_quick_mode(tmp_path):
  result = subprocess.run(
    ["bash", str(ROOT / "benchmarks" / "gpu.sh"), str(tmp_path), "--quick"],
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=900,
    env=_env(),
  )
  assert result.returncode == 0, result.stderr[-2000:]
  for name in ("ns_roofline", "update_vs_optax", "memory", "train_step"):
    records = _check(
      name, (tmp_path / f"{name}.jsonl").read_text().splitlines()
    )
    assert {r["benchmark"] for r in records} <= {name, "gram"}
    if name == "update_vs_optax":  # like for like: the same update
      assert all(d < 1e-4 for r in records for d in r["max_abs_diff"].values())
      assert all(r["compat_max_abs_diff"] < 1e-5 for r in records)


def test_update_benchmark_times_compat_at_optax_numbers():
  stdout = _run("update_vs_optax.py", "--quick", "--trees", "layers512")
  (record,) = _check("update_vs_optax", stdout.splitlines())
  assert record["tree"] == "layers512"
  assert record["compat_max_abs_diff"] < 1e-5  # called as optax: its numbers
  assert record["compat_over_optax"] > 0


def test_sharding_benchmark_prints_bytes_per_mode():
  stdout = _run("sharding.py", "--quick")
  records = _check("sharding", stdout.splitlines())
  for record in records:
    assert record["total_bytes"]["blockwise"] == 0


def test_sharding_plan_measures_what_each_mode_should_move():
  stdout = _run("sharding.py", "--plan", "--quick")
  rows = [json.loads(l) for l in stdout.splitlines() if l.startswith("{")]
  assert {r["tp"] for r in rows} == {4, 8}
  for row in rows:
    measured, expected = row["bytes"], row["expected_bytes"]
    assert measured["blockwise"] == 0
    for mode in ("duplicated", "distributed", "allgather"):
      # the compiled collectives are the algorithm's, up to the norm scalars
      assert abs(measured[mode] - expected[mode]) <= 1e-4 * expected[mode], (
        mode,
        row,
      )
    assert measured["optax.contrib.muon"] > measured["duplicated"]
  assert "| tiny | 4 |" in stdout


def test_scaling_doc_table_is_the_plan_commands(monkeypatch):
  # the bracketed figures are the formulas' (no compile needed), and the
  # measured ones beside them must agree, as the --plan test checks on a
  # small layer
  monkeypatch.setenv("XLA_FLAGS", "")
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import sharding as bench  # pylint: disable=import-outside-toplevel

  text = (ROOT / "docs" / "scaling.md").read_text()
  gib = lambda x: f"{x / 2**30:.2f}"
  for name, (d, ffn, heads, kv, hd, layers) in bench.DECODERS.items():
    for tp in (4, 8):
      shapes = bench.layer_shapes(d, ffn, heads, kv, hd)
      cells = [
        f"({gib(layers * bench.expected_bytes(shapes, m, tp))})"
        for m in ("blockwise", "duplicated", "distributed", "allgather")
      ]
      row = next(
        l for l in text.splitlines() if l.startswith(f"| {name} | {tp} |")
      )
      for cell in cells:
        assert cell in row, (name, tp, cell, row)


@pytest.fixture
def at_scale(monkeypatch):
  """``benchmarks/at_scale.py`` imported in this process (a launch costs
  seconds), for what needs no compile: its import's change to
  ``XLA_FLAGS`` is undone after the test."""
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
  monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
  import at_scale  # noqa: PLC0415

  return at_scale


@pytest.fixture
def at_scale_exit(at_scale, capsys):
  """Calls ``at_scale.main`` in this process (these cases end before
  anything compiles) and returns its exit code and what it wrote to stderr.
  An exception other than the exit fails the test, as a traceback would."""

  def exit_of(*args):
    with pytest.raises(SystemExit) as exited:
      at_scale.main(list(args))
    return exited.value.code, capsys.readouterr().err

  return exit_of


@pytest.mark.parametrize(
  "args, flag",
  [
    (["--mesh", "8"], "--mesh"),
    (["--mesh", "2x2x2"], "--mesh"),
    (["--mesh", "ax8"], "--mesh"),
    (["--mesh", "0x8"], "--mesh"),
    (["--mesh", "4x4"], "--mesh"),  # 16 devices; the CPU target has 8
    (["--model", "llama3-13b"], "--model"),
    (["--layers", "0"], "--layers"),
    (["--modes", "dup"], "--modes"),
    (["--memory-budget", "-1"], "--memory-budget"),
    (["--fsdp", "layers"], "--fsdp"),  # a layer axis needs --stacked
    (["--fsdp", "rows"], "--fsdp"),
    (["--mfu", "0"], "--mfu"),
    (["--mfu", "40"], "--mfu"),  # a percentage, not a fraction
    (["--tokens", "0"], "--tokens"),
  ],
)
def test_at_scale_bad_arguments_exit_2_naming_them(args, flag, at_scale_exit):
  code, stderr = at_scale_exit("--quick", *args)
  assert code == 2, stderr[-2000:]
  assert f"argument {flag}:" in stderr, stderr[-2000:]
  assert "Traceback" not in stderr


MALFORMED_TREES = {
  "not a dict": [1, 2],
  "an empty tree": {},
  "a leaf without a shape": {"w": [[], "muon", []]},
  "a bad label": {"w": [[8, 8], "sgd", [None, "model"]]},
  "a spec naming no mesh axis": {"w": [[8, 8], "muon", [None, "tensor"]]},
  "a spec shorter than its shape": {"w": [[2, 8, 8], "muon", [None, "model"]]},
  "a Muon vector": {"w": [[8], "muon", [None]]},
  "an entry of two": {"w": [[8, 8], "muon"]},
}


@pytest.mark.parametrize("case", sorted(MALFORMED_TREES))
def test_at_scale_malformed_tree_exits_2_naming_the_leaf(
  case, tmp_path, at_scale_exit
):
  path = tmp_path / "tree.json"
  path.write_text(json.dumps(MALFORMED_TREES[case]))
  code, stderr = at_scale_exit("--model", str(path), "--modes", "blockwise")
  assert code == 2, (case, stderr[-2000:])
  assert "argument --model:" in stderr, stderr[-2000:]
  assert "Traceback" not in stderr
  if isinstance(MALFORMED_TREES[case], dict) and MALFORMED_TREES[case]:
    assert "leaf 'w'" in stderr, stderr[-2000:]


@pytest.mark.parametrize(
  "flags, flag",
  [
    (["--stacked"], "--stacked"),
    (["--layers", "2"], "--layers"),
    (["--fsdp", "matrix"], "--fsdp"),
  ],
)
@pytest.mark.parametrize("model", ["tree", "deepseek-v3:2"])
def test_at_scale_refuses_the_llama_flags_on_another_tree(
  model, flags, flag, tmp_path, at_scale_exit
):
  if model == "tree":
    model = str(tmp_path / "tree.json")
    pathlib.Path(model).write_text(
      json.dumps({"w": [[64, 64], "muon", [None, "model"]]})
    )
  code, stderr = at_scale_exit("--model", model, *flags)
  assert code == 2, stderr[-2000:]
  assert f"argument {flag}: applies to the Llama models" in stderr


def test_at_scale_with_nothing_left_to_measure_exits_2():
  # the command line itself, once (the cases above call its main): Dion2's
  # momentum is a float sum, so --momentum 8bit filters it out
  result = _call(
    "at_scale.py", "--quick", "--momentum", "8bit", "--modes", "dion2"
  )
  assert result.returncode == 2, result.stderr[-2000:]
  assert "argument --modes: none of ['dion2'] takes --momentum 8bit" in (
    result.stderr
  )
  assert "Traceback" not in result.stderr


def test_at_scale_reads_a_users_model_function_and_its_target_part(
  tmp_path, at_scale
):
  (tmp_path / "user_model.py").write_text(
    "import jax, jax.numpy as jnp\n"
    "from jax.sharding import PartitionSpec as P\n"
    "def abstract():\n"
    "  params = {'mlp': {'up': jax.ShapeDtypeStruct((64, 256), jnp.float32),\n"
    "                    'down': jax.ShapeDtypeStruct((256, 64), jnp.float32)},\n"
    "            'embed': jax.ShapeDtypeStruct((100, 64), jnp.float32)}\n"
    "  specs = {'mlp': {'up': P(None, 'model'), 'down': P('model')},\n"
    "           'embed': P()}\n"
    "  return params, specs\n"
  )
  result = _call(
    "at_scale.py",
    "--model",
    "user_model:abstract",
    "--modes",
    "duplicated",
    "--dtype",
    "fp32",
    "--json",
    cwd=tmp_path,
  )
  assert result.returncode == 0, result.stderr[-2000:]
  (record,) = [json.loads(line) for line in result.stdout.splitlines()]
  assert record["part"] == "80GB"
  # duplicated gathers the two Muon matrices whole, once (the embedding is
  # AdamW's, by om.default_labels)
  assert record["collective_gib"]["all-gather"] * 2**30 == 2 * 64 * 256 * 4
  parts = [
    at_scale.part_of(t)
    for t in ("tpu-v5p-8", "h100-8", "h200-64", "b200-8", "cpu")
  ]
  assert parts == ["95GB", "80GB", "141GB", "192GB", "80GB"]


def test_at_scale_table_has_the_json_numbers_and_says_what_is_counted():
  args = ("--quick", "--modes", "blockwise,duplicated")
  records = [
    json.loads(l) for l in _run("at_scale.py", *args, "--json").split("\n") if l
  ]
  text = _run("at_scale.py", *args)
  rows = [re.split(r"\s{2,}", line) for line in text.splitlines()[1:3]]
  for record, row in zip(records, rows):
    assert row[0] == record["mode"]
    for cell, key in zip(row[1:4], ("pgs_gib", "temp_gib", "resident_gib")):
      assert float(cell) == pytest.approx(record[key], rel=5e-3), (key, row)
    assert (row[4] == "yes") == record["fits"]["80GB"]
    # params + grads + device state + temp, as the JSON's parts add up
    assert record["resident_gib"] == pytest.approx(
      record["params_gib"]
      + record["grads_gib"]
      + record["state_device_gib"]
      + record["temp_gib"]
    )
  kinds = dict(part.rsplit(" ", 1) for part in rows[1][5].split(", "))
  gathered = float(kinds["all-gather"])
  assert gathered == pytest.approx(
    record["collective_gib"]["all-gather"], rel=5e-3
  )
  words = " ".join(text.split())
  assert "Not counted: activations, the forward and backward pass" in words
  assert "80 GB = 74.5 GiB" in words
  # what compiled them, in each record and under the table: figures of two
  # compiler releases differ (libtpu's temporaries did)
  installed = {d: importlib.metadata.version(d) for d in ("jax", "jaxlib")}
  for record in records:
    assert record["compiler"] == installed
    # the peak over the arguments: on XLA:CPU the outputs alone, as the
    # docstring says (its temporaries are not in its peak; a libtpu or GPU
    # peak has them)
    assert record["peak_over_arguments_gib"] == pytest.approx(
      record["output_gib"], rel=5e-3
    )
  built_by = f"jax {installed['jax']}, jaxlib {installed['jaxlib']}"
  assert f"Compiled by {built_by}." in words


def test_at_scale_reads_the_exposed_time_and_the_share_of_a_step():
  def records(*extra):
    out = _run(
      "at_scale.py", "--quick", "--modes", "duplicated", "--json", *extra
    )
    return [json.loads(line) for line in out.split("\n") if line]

  (base,) = records()
  (double,) = records("--tokens", str(2**21), "--mfu", "0.2")
  schedule = base["schedule"]
  # the CPU runs collectives synchronously: nothing hidden
  assert schedule["asynchronous"] == 0 and schedule["collectives"] > 0
  assert schedule["overlapped_ms"] == 0
  assert schedule["exposed_ms"] == pytest.approx(schedule["collective_ms"])
  # a ring's bytes over the 8 ranks at the CPU's 1e10 bytes/s: 7/8 of a
  # gather's result, twice that of an all-reduce's; one node, so none at
  # the network's rate
  kinds = {k: v * 2**30 for k, v in base["collective_gib"].items()}
  moved = 7 / 8 * (kinds.pop("all-gather") + 2 * kinds.pop("all-reduce", 0))
  assert not kinds  # duplicated gathers and all-reduces only
  assert schedule["collective_ms"] == pytest.approx(moved / 1e7)
  assert schedule["network_ms"] == 0
  # twice the tokens at half the MFU: the step's model 4x, the share 1/4
  assert double["train_model_ms"] == pytest.approx(4 * base["train_model_ms"])
  assert double["step_share"] == pytest.approx(base["step_share"] / 4)
  assert base["step_share"] == pytest.approx(
    base["optimizer_model_ms"] / base["train_model_ms"]
  )
  # the optimizer's time: the program's matmuls (read from its text) at the
  # CPU's 1e11 FLOP/s, and the exposed collectives
  assert base["optimizer_model_ms"] == pytest.approx(
    base["hlo_tflop"] * 1e12 / 1e11 * 1e3 + schedule["exposed_ms"]
  )


def test_at_scale_donate_compiles_the_optimizers_half_of_a_step():
  """--donate: the update applied to the params, params, gradients and state
  donated, so the program holds the params as a training step does; the
  update alone (Muon without weight decay does not read the params) has
  them pruned from its arguments."""

  def record(*extra):
    out = _run(
      "at_scale.py", "--quick", "--modes", "allgather", "--json", *extra
    )
    (only,) = [json.loads(line) for line in out.split("\n") if line]
    return only

  alone, step = record(), record("--donate")
  gib = functools.partial(pytest.approx, rel=1e-3)
  # (a few hundred bytes of scalars aside)
  assert alone["argument_gib"] == gib(alone["grads_gib"] + alone["state_gib"])
  assert step["argument_gib"] == gib(step["pgs_gib"])  # params, grads, state
  # new params and state, written into the donated buffers
  assert step["output_gib"] == gib(step["params_gib"] + step["state_gib"])
  assert step["alias_gib"] == gib(step["output_gib"])


def test_momentum_8bit_reports_the_gap_beside_the_spread():
  lines = [
    json.loads(l) for l in _run("momentum_8bit.py", "--quick").split("\n") if l
  ]
  *seeds, summary = lines
  assert len(seeds) == summary["seeds"] == 2
  finals = {
    k: [r[f"{k}_final_loss"] for r in seeds] for k in ("float32", "8bit")
  }
  assert summary["gap"] == pytest.approx(
    sum(finals["8bit"]) / 2 - sum(finals["float32"]) / 2
  )
  assert summary["float32_spread"] == pytest.approx(
    max(finals["float32"]) - min(finals["float32"])
  )
  # ten steps from the same start: the 8-bit run tracks float32's closely
  assert abs(summary["8bit_over_float32"] - 1) <= 0.05, summary


def test_at_scale_compiles_every_mode_on_abstract_shapes():
  # --quick: a tiny Llama of 8 stacked layers on 8 CPU devices; a 1-byte
  # budget splits every stack (the suite needs no libtpu)
  stdout = _run(
    "at_scale.py",
    "--quick",
    "--stacked",
    "--layers",
    "8",
    "--memory-budget",
    "1",
    "--json",
  )
  records = {r["mode"]: r for r in (json.loads(l) for l in stdout.splitlines())}
  assert set(records) == {
    "blockwise",
    "duplicated",
    "distributed",
    "allgather",
    "auto",
    "muon_bp",
    "dion2",
    "dion2_global",
    "dion",
    "dion_distributed",
    "optax.contrib.muon",
  }
  for record in records.values():
    assert record["compiled"], record
    assert record["temp_gib"] > 0 and record["params_gib"] > 0
    assert record["fits"]["80GB"]
  assert records["blockwise"]["collective_total_gib"] == 0
  # the formula's Newton–Schulz is the program's (its matmuls read from the
  # compiled text, loops times their trip counts) where nothing is padded
  for mode in ("blockwise", "duplicated", "distributed", "allgather"):
    record = records[mode]
    assert record["hlo_tflop"] == pytest.approx(record["ns_tflop"]), mode
  # a layer to each rank: 2 all-to-alls of 1/N of each matrix, 2/N of
  # duplicated's gathers (no zero padding: 8 layers over 8 ranks)
  # (duplicated's two scalar all-reduces a matrix, its max and norm, add
  # 4 bytes each: against its gathers alone the ratio is exact)
  gathers = records["duplicated"]["collective_gib"]["all-gather"]
  assert records["allgather"]["collective_total_gib"] / gathers == (
    pytest.approx(0.25)
  )
  # MuonBP's program holds both steps: its collectives are the full step's
  # (allgather's) and the block steps add none, so a step sends 1/period
  bp = records["muon_bp"]
  assert bp["collective_total_gib"] == pytest.approx(
    records["allgather"]["collective_total_gib"]
  )
  assert bp["per_step_over_allgather"] == pytest.approx(1 / bp["period"])


def test_at_scale_auto_models_no_more_time_than_the_best_exact_mode():
  """``auto`` picks each leaf's mode of least modeled time: summed over the
  tree, never more than the best single exact mode, by the formula and with
  the compiled program's bytes."""
  exact = ("duplicated", "distributed", "allgather")
  stdout = _run(
    "at_scale.py",
    "--quick",
    "--stacked",
    "--modes",
    ",".join((*exact, "auto")),
    "--json",
  )
  records = {r["mode"]: r for r in (json.loads(l) for l in stdout.splitlines())}
  auto = records["auto"]
  for key in ("model_ms", "modeled_ms"):
    best = min(records[m][key] for m in exact)
    assert auto[key] <= best * (1 + 1e-9), (key, auto[key], best)
  muon_leaves = 7  # q, k, v, o, gate, up, down: one stacked leaf each
  assert sum(auto["auto_chose"].values()) == muon_leaves
  assert all(records[m]["auto_chose"] is None for m in exact)


def test_at_scale_fsdp_on_the_matrix_axis_halves_each_devices_work():
  """--fsdp matrix on data 2 x model 4: each data rank orthogonalizes half
  the stack (its home), by the formula and by the compiler's count, where
  without FSDP both data ranks repeat all of it."""

  def run(fsdp):
    stdout = _run(
      "at_scale.py",
      "--quick",
      "--stacked",
      "--mesh",
      "2x4",
      "--fsdp",
      fsdp,
      "--modes",
      "duplicated",
      "--json",
    )
    (record,) = [json.loads(l) for l in stdout.splitlines()]
    assert record["fsdp"] == fsdp
    return record

  homed, replicated = run("matrix"), run("none")
  for key in ("ns_tflop", "cost_analysis_tflop"):
    assert homed[key] / replicated[key] == pytest.approx(0.5, rel=0.1), key


def test_homes_balance_reports_each_data_ranks_load():
  records = json.loads(_run("homes_balance.py", "--json"))
  # Llama-3-70B's 80 layers: 10 a rank over 8 data ranks; over 64, two slots
  # a rank, real on the first 40 (mean 80/64 = 1.25), 48 of 128 padding
  (at_64,) = records["llama3-70b, 64 chips (FSDP 8 × TP 8)"]
  (at_512,) = records["llama3-70b, 512 chips (FSDP 64 × TP 8)"]
  assert (at_64["ranks"], at_64["max_over_mean"], at_64["padding"]) == (
    8,
    1.0,
    0.0,
  )
  assert (at_512["ranks"], at_512["padding"]) == (64, 0.375)
  assert at_512["max_over_mean"] == pytest.approx(2 / 1.25)
  # the routed experts are sharded over the expert axis itself: no homes,
  # and every rank orthogonalizes its own 32 of 256 a layer
  assert records["deepseek-v3, v5p-64 (EP 8 × TP 8)"] == [
    {"axis": "data", "ranks": 8, "max_over_mean": 1.0, "padding": 0.0}
  ]
