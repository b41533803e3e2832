"""Records torch.optim.Muon's numbers for tests/test_torch_muon.py.

Run once, with torch installed (the CPU wheel; the tests do not need torch)::

    pip install torch==2.13.0 numpy
    python tests/data/record_torch_muon.py

Three weights in torch's ``(out, in)`` order (64×128, 128×64, 96×96), five
steps on a fixed sequence of gradients, for four settings. Each setting runs
twice: as torch ships it (Newton–Schulz iterated in bfloat16) and with
torch's own Newton–Schulz re-run in float32 (the same operations, no cast),
the reference for ``precision="highest"``; the defaults a third time with
every bf16 sum rounded from its exact value (the spread of summation orders). Writes ``torch_muon.npz``
(inputs and final weights) and ``torch_muon.json`` (settings, versions)
beside this file.
"""

import json
import pathlib

import numpy as np
import torch
from torch.optim import _muon

HERE = pathlib.Path(__file__).parent
SHAPES = [(64, 128), (128, 64), (96, 96)]  # torch's (out, in)
STEPS = 5
SETTINGS = {
  "defaults": {},
  "match_rms_adamw": {"adjust_lr_fn": "match_rms_adamw"},
  "no_nesterov": {"nesterov": False},
  "lr_0.02": {"lr": 0.02, "weight_decay": 0.1},
}


def newton_schulz_fp32(grad, ns_coefficients, ns_steps, eps):
  """torch's ``_zeropower_via_newtonschulz`` with the iterate in float32."""
  a, b, c = ns_coefficients
  x = grad.float()
  if grad.size(0) > grad.size(1):
    x = x.T
  x = x / x.norm().clamp(min=eps)
  for _ in range(ns_steps):
    gram = x @ x.T
    x = torch.addmm(
      x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a
    )
  if grad.size(0) > grad.size(1):
    x = x.T
  return x


def newton_schulz_exact_sums(grad, ns_coefficients, ns_steps, eps):
  """torch's bf16 iteration with every matmul and sum rounded once from its
  exact value (float64): another summation order, to show how far torch's
  own bf16 result moves with the last bit of its fp32 sums."""
  a, b, c = ns_coefficients
  x = grad.bfloat16()
  if grad.size(0) > grad.size(1):
    x = x.T
  x = x.div(x.norm().clamp(min=eps))
  for _ in range(ns_steps):
    w = x.double()
    gram = (w @ w.T).bfloat16().double()
    w = a * w + (b * gram + c * (gram @ gram)).bfloat16().double() @ w
    x = w.bfloat16()
  if grad.size(0) > grad.size(1):
    x = x.T
  return x


ITERATES = {  # name: (Newton–Schulz, settings it runs for)
  "bf16": (None, SETTINGS),
  "fp32": (newton_schulz_fp32, SETTINGS),
  "bf16_exact_sums": (newton_schulz_exact_sums, ["defaults"]),
}


def run(weights, grads, settings, newton_schulz=None):
  params = [torch.nn.Parameter(torch.tensor(w)) for w in weights]
  optimizer = torch.optim.Muon(params, **settings)
  original = _muon._zeropower_via_newtonschulz
  if newton_schulz is not None:
    _muon._zeropower_via_newtonschulz = newton_schulz
  try:
    for step_grads in grads:
      for p, g in zip(params, step_grads):
        p.grad = torch.tensor(g)
      optimizer.step()
  finally:
    _muon._zeropower_via_newtonschulz = original
  return [p.detach().numpy().copy() for p in params]


def main():
  torch.use_deterministic_algorithms(True)
  rng = np.random.default_rng(20261201)
  weights = [
    (rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32) for s in SHAPES
  ]
  # gradients of varying scale, as a real run sees them
  grads = [
    [
      (rng.standard_normal(s) * 10.0 ** rng.uniform(-3, 0)).astype(np.float32)
      for s in SHAPES
    ]
    for _ in range(STEPS)
  ]
  arrays = {f"weight/{i}": w for i, w in enumerate(weights)}
  for step, step_grads in enumerate(grads):
    arrays.update({f"grad/{step}/{i}": g for i, g in enumerate(step_grads)})
  for iterate, (newton_schulz, names) in ITERATES.items():
    for name in names:
      final = run(weights, grads, SETTINGS[name], newton_schulz)
      arrays.update({f"{name}/{iterate}/{i}": w for i, w in enumerate(final)})
  np.savez_compressed(HERE / "torch_muon.npz", **arrays)
  (HERE / "torch_muon.json").write_text(
    json.dumps(
      {
        "torch": torch.__version__,
        "numpy": np.__version__,
        "shapes": SHAPES,
        "order": "torch's (out, in); a JAX (in, out) kernel is the transpose",
        "steps": STEPS,
        "settings": SETTINGS,
        "iterates": {
          "bf16": "torch.optim.Muon as shipped",
          "fp32": "torch's Newton-Schulz with the iterate in float32",
          "bf16_exact_sums": "torch's bf16 iteration, each sum rounded "
          "once from float64 (defaults only)",
        },
        "keys": "weight/i, grad/step/i, <setting>/<iterate>/i (after all steps)",
      },
      indent=2,
    )
    + "\n"
  )


if __name__ == "__main__":
  main()
