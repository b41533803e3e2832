"""Records microsoft/dion's Dion2 and NorDion2 numbers for tests/test_dion2.py.

Run once, with torch and a checkout of microsoft/dion (the tests need
neither)::

    pip install torch==2.13.0 numpy
    git clone https://github.com/microsoft/dion /tmp/dion_src
    python tests/data/record_dion2.py /tmp/dion_src

Three weights in torch's ``(out, in)`` order (64×128, 128×64, 96×96), five
steps of ``optimizer.step()`` on one device (no mesh: the "local" and
"global" selection scopes coincide) on a fixed sequence of gradients, for
two settings of each optimizer. Each runs twice: as microsoft/dion ships it
(the selected rows cast to bfloat16, Polar Express iterated in bfloat16) and
in float32: the modules' ``torch.bfloat16`` read as ``torch.float32`` and,
as ``newton_schulz_func``, dion's Polar Express (its own coefficients and
normalization) without the cast. Writes ``dion2.npz`` (inputs, final weights
and momenta) and ``dion2.json`` (settings, versions, the commit), and adds
``polar_express_dion`` to ``coefficients.json``: dion's coefficients with
its ``X / (1.02 ‖X‖_F)`` safety folded into the first tuple.
"""

import json
import os
import pathlib
import subprocess
import sys
import types

import numpy as np
import torch

HERE = pathlib.Path(__file__).parent
SHAPES = [(64, 128), (128, 64), (96, 96)]  # torch's (out, in)
STEPS = 5
SETTINGS = {
  "dion2/defaults": ("Dion2", {"lr": 0.01}),
  "dion2/other": (
    "Dion2",
    {
      "lr": 0.02,
      "fraction": 0.5,
      "ef_decay": 0.9,
      "weight_decay": 0.1,
      "adjust_lr": "rms_norm",
    },
  ),
  "nordion2/defaults": ("NorDion2", {"lr": 0.01}),
  "nordion2/other": (
    "NorDion2",
    {
      "lr": 0.02,
      "fraction": 0.5,
      "mu": 0.9,
      "muon_beta2": 0.99,
      "weight_decay": 0.1,
      "adjust_lr": "rms_norm",
    },
  ),
}


class _Float32ForBfloat16(types.ModuleType):
  """``torch`` as a module sees it, except that ``bfloat16`` is float32."""

  def __init__(self):
    super().__init__("torch")

  def __getattr__(self, name):
    return torch.float32 if name == "bfloat16" else getattr(torch, name)


def polar_express_fp32(coefficients):
  """dion's ``polar_express`` with the iterate kept in float32."""

  def run(G, epsilon=1e-6):
    X = G.float()
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.02 + epsilon)
    tall = G.size(-2) > G.size(-1)
    for a, b, c in coefficients:
      if tall:
        A = X.mT @ X
        X = a * X + X @ (b * A + c * (A @ A))
      else:
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    return X

  return run


def run(dion, name, kwargs, weights, grads, fp32):
  from dion import dion2 as dion2_module
  from dion import nordion2 as nordion2_module
  from dion import polar_express

  modules = (dion2_module, nordion2_module)
  saved = [module.torch for module in modules]
  if fp32:
    for module in modules:
      module.torch = _Float32ForBfloat16()
    kwargs = dict(
      kwargs,
      newton_schulz_func=polar_express_fp32(
        polar_express._POLAR_EXPRESS_COEFFS
      ),
    )
  try:
    params = [torch.nn.Parameter(torch.tensor(w)) for w in weights]
    optimizer = getattr(dion, name)(params, **kwargs)
    for step in range(STEPS):
      for p, g in zip(params, grads[step]):
        p.grad = torch.tensor(g)
      optimizer.step()
    momenta = [optimizer.state[p]["momentum"].numpy().copy() for p in params]
    return [p.detach().numpy().copy() for p in params], momenta
  finally:
    for module, original in zip(modules, saved):
      module.torch = original


def inputs():
  """The weights, the gradients of each step, and both as the arrays the
  recordings store (``weight_i``, ``grad_step_i``); fixed by seed 0."""
  rng = np.random.default_rng(0)
  weights = [
    (rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32) for s in SHAPES
  ]
  grads = [
    [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    for _ in range(STEPS)
  ]
  arrays = {}
  for i, w in enumerate(weights):
    arrays[f"weight_{i}"] = w
    for step in range(STEPS):
      arrays[f"grad_{step}_{i}"] = grads[step][i]
  return weights, grads, arrays


def eager(function=None, **options):
  """``torch.compile`` as the identity: dion's functions run as written (the
  same operations; no C++ compiler needed, and ``fullgraph=True`` does not
  fail where compiling is switched off)."""
  del options
  return function if function is not None else (lambda f: f)


def dion_commit(dion_path) -> str:
  """The checkout's commit (``$DION_COMMIT`` where it is no git clone)."""
  commit = subprocess.run(
    ["git", "-C", dion_path, "rev-parse", "HEAD"],
    capture_output=True,
    text=True,
  ).stdout.strip()
  return commit or os.environ.get("DION_COMMIT", "unknown")


def main(dion_path):
  torch.compile = eager
  sys.path.insert(0, dion_path)
  import dion
  from dion import polar_express

  weights, grads, arrays = inputs()
  for setting, (name, kwargs) in SETTINGS.items():
    for variant, fp32 in (("shipped", False), ("fp32", True)):
      finals, momenta = run(dion, name, kwargs, weights, grads, fp32)
      for i, (final, momentum) in enumerate(zip(finals, momenta)):
        arrays[f"{setting}/{variant}/final_{i}"] = final
        arrays[f"{setting}/{variant}/momentum_{i}"] = momentum
  np.savez_compressed(HERE / "dion2.npz", **arrays)
  about = {
    "conventions": (
      "weights and gradients in torch's (out, in) order; final_i and "
      "momentum_i after 5 optimizer.step() calls on one device; 'shipped' "
      "as microsoft/dion runs (bfloat16 selection and Polar Express), "
      "'fp32' with the bfloat16 casts read as float32 and Polar Express "
      "in float32"
    ),
    "shapes": SHAPES,
    "steps": STEPS,
    "settings": {k: {"optimizer": n, **kw} for k, (n, kw) in SETTINGS.items()},
    "torch": torch.__version__,
    "numpy": np.__version__,
    "dion_commit": dion_commit(dion_path),
  }
  (HERE / "dion2.json").write_text(json.dumps(about, indent=1) + "\n")
  coefficients_path = HERE / "coefficients.json"
  coefficients = json.loads(coefficients_path.read_text())
  (a, b, c), *rest = polar_express._POLAR_EXPRESS_COEFFS
  coefficients["sets"]["polar_express_dion"] = {
    "mode": "repeat_last",
    "tuples": [[a / 1.02, b / 1.02**3, c / 1.02**5], *map(list, rest)],
    "source": (
      "microsoft/dion polar_express.py; its X / (1.02 ||X||_F) "
      "normalization folded into the first tuple"
    ),
  }
  coefficients_path.write_text(json.dumps(coefficients, indent=1) + "\n")


if __name__ == "__main__":
  main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/dion_src")
