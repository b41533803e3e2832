"""The update compiled by the TPU compiler (libtpu) for a v5p-8, with no
TPU: runs where the ``tpu-compile`` extra (``jax[tpu]``) is installed, is
skipped elsewhere (CI installs it in neither run; see CONTRIBUTING.md)."""

import importlib.util
import json
import re

import pytest

from conftest import run_benchmark

pytestmark = [
  pytest.mark.integration,
  pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="needs the tpu-compile extra (jax[tpu]) for the v5p target",
  ),
]


def _at_scale(*flags: str) -> list[dict]:
  stdout = run_benchmark(
    "at_scale.py", "--stacked", "--target", "tpu-v5p-8", "--json", *flags
  )
  return [json.loads(line) for line in stdout.splitlines()]


def _instruction(hlo: str, name: str) -> str:
  """The line that defines ``%name``."""
  (line,) = re.findall(rf"^\s*(?:ROOT )?%{re.escape(name)} = .*$", hlo, re.M)
  return line


def test_muon_bp_branches_take_no_broadcast_operands(tmp_path):
  # XLA's conditional code motion, left alone, moves the momentum's
  # multiply-add into both branches: the conditional then takes its scalars
  # broadcast to whole stacks as operands
  _at_scale("--quick", "--modes", "muon_bp", "--dump-hlo", str(tmp_path))
  hlo = (tmp_path / "muon_bp.hlo").read_text()
  conditionals = re.findall(
    r"^\s*%\S+ = .*? conditional\(%[^,]+, (%[^,]+), (%[^,)]+)\)", hlo, re.M
  )
  assert conditionals, "MuonBP compiled with no conditional"
  for operands in conditionals:
    for operand in set(operands):
      line = _instruction(hlo, operand[1:])
      for name in re.findall(r"%[\w.\-]+", line.split(" tuple(", 1)[-1]):
        assert " broadcast(" not in _instruction(hlo, name[1:]), name


def test_muon_bp_keeps_near_its_larger_program_at_8b():
  # a group's conditional holds its inputs and outputs whole (and the TPU
  # compiler may keep its outputs twice): groups of a quarter of the 2 GiB
  # budget keep the choice within half of it of the larger of the two
  # programs (one group of the whole budget needed 7.13 GiB)
  records = {r["mode"]: r for r in _at_scale("--modes", "muon_bp")}
  larger = max(
    records["allgather"]["temp_gib"], records["blockwise"]["temp_gib"]
  )
  assert records["muon_bp"]["temp_gib"] <= larger + 1.0, records["muon_bp"]
