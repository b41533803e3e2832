"""The update compiled by XLA's GPU compiler for 8 H100s, with no GPU: runs
where the ``gpu-compile`` extra (``jax[cuda12]``) is installed, is skipped
elsewhere (CI installs it in neither run: 5.5 GB; see CONTRIBUTING.md)."""

import importlib.util
import json
import math
import sys

import pytest

from conftest import ROOT
from conftest import run_benchmark

pytestmark = [
  pytest.mark.integration,
  pytest.mark.skipif(
    importlib.util.find_spec("jax_cuda12_plugin") is None,
    reason="needs the gpu-compile extra (jax[cuda12]) for the H100 target",
  ),
]


def test_the_h100_compile_gathers_the_matrices_once():
  stdout = run_benchmark(
    "at_scale.py",
    "--quick",
    "--target",
    "h100-8",
    "--modes",
    "duplicated,allgather",
    "--json",
    timeout=900,
  )
  records = {r["mode"]: r for r in map(json.loads, stdout.splitlines())}
  sys.path.insert(0, str(ROOT / "benchmarks"))
  from at_scale import llama_tree  # the tree the script compiled

  matrices = sum(
    math.prod(shape) * 2  # bf16
    for shape, label, _ in llama_tree("tiny", False).values()
    if label == "muon"
  )
  duplicated = records["duplicated"]
  assert duplicated["compiled"] and duplicated["fits"]["80GB"]
  gathered = duplicated["collective_gib"]["all-gather"] * 2**30
  assert abs(gathered / matrices - 1) <= 0.05, (gathered, matrices)
  assert (
    records["allgather"]["collective_total_gib"]
    < (duplicated["collective_total_gib"])
  )
