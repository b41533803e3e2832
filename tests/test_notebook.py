"""The quick-start notebook runs top to bottom and both optimizers learn."""

import json
import os

import nbformat
import pytest
from nbclient import NotebookClient
from conftest import ROOT

NOTEBOOK = ROOT / "notebooks" / "muon_quickstart.ipynb"


def test_notebook_has_no_stored_outputs():
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  for cell in notebook.cells:
    if cell.cell_type == "code":
      assert not cell.outputs and cell.execution_count is None


def test_notebook_runs_and_both_optimizers_learn(monkeypatch):
  monkeypatch.setenv("QUICKSTART_SMALL", "1")
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  NotebookClient(notebook, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": str(ROOT)}}).execute()
  text = "".join(o.get("text", "") for o in notebook.cells[-1].outputs)
  summary = json.loads(text.strip().splitlines()[-1])
  for name in ("muon", "adamw"):
    assert summary[name]["final"] < summary[name]["initial"], summary
  sharding_out = "".join(o.get("text", "") for o in notebook.cells[-2].outputs)
  assert sharding_out.count("sharding kept: True") == 4, sharding_out
