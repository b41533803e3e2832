"""The layers of ``optax_muon/_src/`` import downward only, and no module
imports another module's private names.

Layers, bottom-up: ``base`` (checks, paths) → ``kernels`` (Newton–Schulz and
the math on matrices) → ``views`` (leaves as matrices, labels) → ``parallel``
(tensor parallelism, the memory budget, offload) → ``transforms`` (one
GradientTransformation each) → ``optimizers`` (routing and the family) →
``inference`` (layouts read from programs, the routing table) → ``config``
(MuonConfig). A module may import its own layer and those below.
"""

import ast
import pathlib

import pytest

from conftest import ROOT

SRC = ROOT / "optax_muon" / "_src"
LAYERS = (
  "base",
  "kernels",
  "views",
  "parallel",
  "transforms",
  "optimizers",
  "inference",
  "config",
)


def _imports(path: pathlib.Path):
  """``(module, names)`` of each ``optax_muon`` import in ``path``."""
  tree = ast.parse(path.read_text())
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
      "optax_muon"
    ):
      yield node.module, [alias.name for alias in node.names]
    elif isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.startswith("optax_muon"):
          yield alias.name, []


def _layer(module: str) -> str | None:
  parts = module.split(".")
  return parts[2] if len(parts) > 2 and parts[1] == "_src" else None


def violations(src: pathlib.Path = SRC) -> list[str]:
  found = []
  for path in sorted(src.rglob("*.py")):
    layer = path.relative_to(src).parts[0]
    if layer not in LAYERS:
      continue
    for module, names in _imports(path):
      target = _layer(module)
      if target is None:
        found.append(f"{path.name}: imports {module} (only _src modules)")
        continue
      if LAYERS.index(target) > LAYERS.index(layer):
        found.append(f"{layer}/{path.name}: imports {module}, a higher layer")
      for name in names:
        if name.startswith("_"):
          found.append(f"{layer}/{path.name}: imports private {name}")
  return found


def test_every_module_sits_in_a_layer():
  folders = {
    p.name for p in SRC.iterdir() if p.is_dir() and p.name != "__pycache__"
  }
  assert folders == set(LAYERS)


def test_the_layers_import_downward_and_nothing_private():
  assert violations() == []


@pytest.mark.parametrize(
  "planted",
  [
    "from optax_muon._src.optimizers import route\n",  # a kernel importing up
    "from optax_muon._src.kernels.newton_schulz import _all_reduce\n",
  ],
)
def test_a_planted_violation_is_caught(tmp_path, planted):
  copy = tmp_path / "_src"
  for path in SRC.rglob("*.py"):
    target = copy / path.relative_to(SRC)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(path.read_text())
  gram = copy / "kernels" / "gram.py"
  gram.write_text(planted + gram.read_text())
  assert len(violations(copy)) == 1
