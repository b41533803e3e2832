"""The quick-start notebook runs top to bottom from its own folder, both
optimizers learn, and it prints the figures docs/update.md quotes from it."""

import json
import re

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


def _printed(cell) -> str:
  return "".join(o.get("text", "") for o in cell.outputs)


@pytest.mark.integration
def test_notebook_runs_from_its_folder_and_shows_what_the_readme_quotes(
  monkeypatch,
):
  monkeypatch.setenv("QUICKSTART_SMALL", "1")
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  # as `jupyter notebook notebooks/muon_quickstart.ipynb` starts it
  NotebookClient(
    notebook,
    timeout=600,
    kernel_name="python3",
    resources={"metadata": {"path": str(NOTEBOOK.parent)}},
  ).execute()
  # the docs site renders this execution (docs/conf.py): once per CI run
  rendered = ROOT / "docs" / "notebooks" / NOTEBOOK.name
  rendered.parent.mkdir(exist_ok=True)
  nbformat.write(notebook, rendered)
  summary = json.loads(_printed(notebook.cells[-1]).strip().splitlines()[-1])
  for name in ("muon", "adamw"):
    assert summary[name]["final"] < summary[name]["initial"], summary
  # the AdamW -> Muon learning-rate rule: docs/update.md quotes these three
  rms = dict(
    re.findall(
      r"^(.*?)\s+update RMS / lr = ([\d.]+)$",
      _printed(notebook.cells[10]),
      re.M,
    )
  )
  quoted = re.search(
    r"update RMS / lr is ([\d.]+) for AdamW, ([\d.]+) for\s+"
    r"matched Muon, ([\d.]+) for Muon at factor 1.0",
    (ROOT / "docs" / "update.md").read_text(),
  )
  assert [
    rms["adamw"],
    rms["muon (match_adamw_update_rms)"],
    rms["muon (extra_scale_factor=1.0)"],
  ] == list(quoted.groups())
  # sharded vs unsharded: the exact modes to 1e-5, blockwise differs by design
  sharding = _printed(notebook.cells[12])
  errors = dict(
    re.findall(r"^(\w+)\s+max \|sharded - unsharded\| = (\S+)", sharding, re.M)
  )
  assert set(errors) == {"blockwise", "duplicated", "distributed", "allgather"}
  for mode in ("duplicated", "distributed", "allgather"):
    assert float(errors[mode]) <= 1e-5, sharding
  assert float(errors["blockwise"]) > 1e-2, sharding
  assert sharding.count("sharding kept: True") == 4, sharding
