"""Every Python code block of the README and docs/ runs; the migration table
covers every argument of optax.contrib.muon and every MuonConfig field."""

import inspect
import re

import optax
import pytest

import optax_muon as om
from conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks(path):
  return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


BLOCKS = [(path, number, block) for path in DOCS
          for number, block in enumerate(_blocks(path))]


# one test per block, so that the slow ones run in parallel
@pytest.mark.parametrize("path, number, block", BLOCKS,
                         ids=[f"{p.name}[{n}]" for p, n, _ in BLOCKS])
def test_code_block_runs(path, number, block):
  try:
    exec(compile(block, f"{path.name}[{number}]", "exec"), {})
  except Exception as error:  # pylint: disable=broad-except
    pytest.fail(f"{path.name} block {number} raised {error!r}:\n{block}")


def test_migration_tables_cover_every_argument_and_field():
  guide = (ROOT / "docs" / "guide.md").read_text()
  for name in inspect.signature(optax.contrib.muon).parameters:
    assert f"`{name}`" in guide, name
  for name in om.MuonConfig.field_names():
    assert f"| `{name}` |" in guide, name


def test_readme_links_the_docs_and_the_notebook():
  readme = (ROOT / "README.md").read_text()
  for target in ("docs/guide.md", "docs/troubleshooting.md",
                 "colab.research.google.com", "notebooks/muon_quickstart.ipynb"):
    assert target in readme, target
