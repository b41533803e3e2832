"""The layers of ``optax_muon/_src/`` import downward only; no module imports
another module's private names, reads a private attribute through an object
(``sharding._explicit()``), or imports itself.

Layers, bottom-up: ``base`` (checks, paths) → ``kernels`` (Newton–Schulz and
the math on matrices and their shapes) → ``views`` (leaves as matrices,
labels) → ``inference`` (layouts read from programs, the routing table; it
needs no optimizer, so it sits below them) → ``parallel`` (tensor
parallelism, the memory budget, offload) → ``transforms`` (one
GradientTransformation each) → ``optimizers`` (routing and the family) →
``config`` (MuonConfig, ``describe``). A module may import its own layer and
those below.
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
  "inference",
  "parallel",
  "transforms",
  "optimizers",
  "config",
)
# A NamedTuple's own API is underscored so it cannot clash with its fields.
NAMEDTUPLE_API = ("_replace", "_asdict", "_fields", "_make")


def _imports(tree: ast.AST):
  """``(module, names)`` of each ``optax_muon`` import in ``tree``."""
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


def _private_attributes(tree: ast.AST):
  """``(line, text)`` of each ``obj._name`` whose ``obj`` is not ``self`` or
  ``cls`` (a NamedTuple's ``_replace`` and kin are public)."""
  for node in ast.walk(tree):
    if not isinstance(node, ast.Attribute):
      continue
    name = node.attr
    if not name.startswith("_") or name.startswith("__"):
      continue
    owner = node.value
    if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
      continue
    if name not in NAMEDTUPLE_API:
      yield node.lineno, ast.unparse(node)


def _module_name(src: pathlib.Path, path: pathlib.Path) -> str:
  parts = path.relative_to(src).with_suffix("").parts
  return ".".join(("optax_muon", "_src") + parts)


def violations(src: pathlib.Path = SRC) -> list[str]:
  found = []
  for path in sorted(src.rglob("*.py")):
    layer = path.relative_to(src).parts[0]
    if layer not in LAYERS:
      continue
    tree = ast.parse(path.read_text())
    where = f"{layer}/{path.name}"
    for line, text in _private_attributes(tree):
      found.append(f"{where}:{line}: reads private {text}")
    itself = _module_name(src, path)
    for module, names in _imports(tree):
      if itself in (module, *(f"{module}.{name}" for name in names)):
        found.append(f"{where}: imports itself")
      target = _layer(module)
      if target is None:
        found.append(f"{path.name}: imports {module} (only _src modules)")
        continue
      if LAYERS.index(target) > LAYERS.index(layer):
        found.append(f"{where}: imports {module}, a higher layer")
      for name in names:
        if name.startswith("_"):
          found.append(f"{where}: imports private {name}")
  return found


def test_every_module_sits_in_a_layer():
  folders = {
    p.name for p in SRC.iterdir() if p.is_dir() and p.name != "__pycache__"
  }
  assert folders == set(LAYERS)


def test_the_layers_import_downward_and_nothing_private():
  assert violations() == []


@pytest.mark.parametrize(
  "module, planted",
  [
    # a kernel importing up
    ("kernels/gram.py", "from optax_muon._src.optimizers import route\n"),
    (
      "kernels/gram.py",
      "from optax_muon._src.kernels.newton_schulz import _all_reduce\n",
    ),
    # a private method called through an object
    ("kernels/gram.py", "def f(sharding):\n  return sharding._explicit()\n"),
    # a module importing itself, both ways
    ("kernels/gram.py", "from optax_muon._src.kernels import gram\n"),
    ("kernels/gram.py", "from optax_muon._src.kernels.gram import gram\n"),
    # layout inference needs no optimizer
    ("inference/infer.py", "from optax_muon._src.optimizers import muon\n"),
    ("inference/infer.py", "from optax_muon._src.parallel import waves\n"),
  ],
)
def test_a_planted_violation_is_caught(tmp_path, module, planted):
  copy = tmp_path / "_src"
  for path in SRC.rglob("*.py"):
    target = copy / path.relative_to(SRC)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(path.read_text())
  target = copy / module
  target.write_text(planted + target.read_text())
  assert len(violations(copy)) == 1, violations(copy)


def _frames_to_the_newton_schulz_loop(tx, params, monkeypatch):
  """The calls from ``tx.update`` to ``newton_schulz.iterate`` (the loop),
  as (function, file) pairs, outermost first; jax's own (``shard_map``'s
  machinery, which differs between jax versions) left out."""
  import inspect

  from optax_muon._src.kernels import newton_schulz

  iterate = newton_schulz.iterate
  seen = []

  def spy(*args, **kwargs):
    seen.append(inspect.stack()[1:])
    return iterate(*args, **kwargs)

  monkeypatch.setattr(newton_schulz, "iterate", spy)
  state = tx.init(params)

  def update():  # the frame the count starts below
    return tx.update(params, state, params)

  update()
  (stack,) = seen[:1]
  names = [frame.function for frame in stack]
  return [
    (frame.function, pathlib.Path(frame.filename).name)
    for frame in reversed(stack[: names.index("update")])
    if "jax" not in pathlib.Path(frame.filename).parts
  ]


# the sharded path's two more: the shard_map it enters and its body; the
# streamed momentum (8-bit, or offloaded) one more: the transform that
# computes each leaf's momentum in its wave
@pytest.mark.parametrize(
  "mode, quantized, calls",
  [(None, False, 8), ("allgather", False, 10), (None, True, 9)],
)
def test_tx_update_reaches_the_newton_schulz_loop_in_eight_calls(
  mode, quantized, calls, monkeypatch
):
  # every call between is a frame in each trace and each traceback a user
  # reads (issue 59): optax's partition and mask, the muon chain, the
  # direction, the orthogonalization, the waves, the batched stacks, the
  # preconditioning; a planted wrapper anywhere on the way fails this
  import jax
  import jax.numpy as jnp

  import optax_muon as om

  sharding = None
  if mode is not None:
    mesh = jax.make_mesh((8,), ("model",), devices=jax.devices()[:8])
    sharding = om.TensorParallel(mesh, axis="model", mode=mode)
  params = {"w": jnp.ones((16, 32)), "b": jnp.ones(32)}
  mu_dtype = om.QuantizedMomentum() if quantized else None
  frames = _frames_to_the_newton_schulz_loop(
    om.muon(0.02, sharding=sharding, mu_dtype=mu_dtype), params, monkeypatch
  )
  assert frames[0] == ("update_fn", "_combining.py"), frames  # optax's
  assert len(frames) <= calls, frames
