"""Every benchmark runs in --quick mode and prints finite ratios (the targets
themselves live in the README, measured by the full runs)."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[1]
RATIOS = {
    "ns_roofline.py": ["ratio"],
    "update_vs_optax.py": ["ours_over_optax", "ours_over_adamw", "max_abs_diff"],
    "memory.py": ["state_ours_over_adamw", "temp_ours_over_optax"],
    "train_step.py": ["muon_over_adamw"],
    "sharding.py": ["bytes_over_optax", "time_over_optax"],
}


def _numbers(value):
  if isinstance(value, dict):
    return [x for v in value.values() for x in _numbers(v)]
  return [value]


@pytest.mark.parametrize("script", sorted(RATIOS))
def test_benchmark_prints_finite_ratios(script):
  env = dict(os.environ, XLA_FLAGS="")  # sharding.py sets its own devices
  result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script),
                           "--quick"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
  assert result.returncode == 0, result.stderr[-2000:]
  records = [json.loads(line) for line in result.stdout.splitlines()]
  assert records
  for record in records:
    for key in RATIOS[script]:
      for number in _numbers(record[key]):
        assert math.isfinite(number) and number >= 0, (key, record)
  if script == "update_vs_optax.py":  # like for like: the same update
    assert all(r["max_abs_diff"] < 1e-4 for r in records)


def test_gpu_script_runs_on_cpu_in_quick_mode(tmp_path):
  result = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"),
                           str(tmp_path), "--quick"], capture_output=True,
                          text=True, cwd=ROOT, timeout=900,
                          env=dict(os.environ, XLA_FLAGS="",
                                   PYTHON=sys.executable))
  assert result.returncode == 0, result.stderr[-2000:]
  for name in ("ns_roofline", "update_vs_optax", "memory", "train_step"):
    lines = (tmp_path / f"{name}.jsonl").read_text().splitlines()
    assert lines and all(json.loads(l)["benchmark"] == name for l in lines)
