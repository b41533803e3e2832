"""Records microsoft/dion's Dion (``dion_reference.py``) for tests/test_dion.py.

Run once, with torch and a checkout of microsoft/dion (the tests need
neither)::

    pip install torch==2.13.0 numpy
    git clone https://github.com/microsoft/dion /tmp/dion_src
    python tests/data/record_dion.py /tmp/dion_src

The weights and gradients of ``record_dion2.py`` (64×128, 128×64, 96×96 in
torch's ``(out, in)`` order, five steps on one device, no mesh), for two
settings, each run in float32 (as shipped: its randomized Cholesky QR) and
in float64 (the floor the float32 results are measured against). Dion's
update depends on its random initial ``Q`` (``torch.randn``), which JAX
cannot draw: the script records the ``Q`` each weight's first step was
given (``Q0_i``, ``(in, r)``, or ``(out, r)`` for a wide weight), and the
tests start from it. Writes ``dion.npz`` and ``dion.json``.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import torch
from record_dion2 import SHAPES
from record_dion2 import STEPS
from record_dion2 import eager
from record_dion2 import inputs

HERE = pathlib.Path(__file__).parent
SETTINGS = {
  "defaults": {"lr": 0.01},
  "other": {
    "lr": 0.02,
    "rank_fraction": 0.25,
    "mu": 0.9,
    "weight_decay": 0.1,
    "power_iters": 2,
  },
}


def run(reference, kwargs, weights, grads, dtype, start_q=None):
  """Five steps of ``reference.Dion``: the final weights, momenta and Qs,
  and the Q each weight's first step started from (``start_q[i]`` where
  given, in place of the one Dion drew)."""
  first_q = {}
  update = reference.dion_update
  torch.manual_seed(0)
  params = [torch.nn.Parameter(torch.tensor(w, dtype=dtype)) for w in weights]
  index = {id(p): i for i, p in enumerate(params)}

  def recording_update(**arguments):
    i = index[id(arguments["X"])]
    if i not in first_q:
      if start_q is not None:
        arguments["Q"] = torch.tensor(start_q[i], dtype=arguments["Q"].dtype)
      first_q[i] = arguments["Q"].clone()
    return update(**arguments)

  reference.dion_update = recording_update
  try:
    optimizer = reference.Dion(params, **kwargs)
    for step in range(STEPS):
      for p, g in zip(params, grads[step]):
        p.grad = torch.tensor(g, dtype=dtype)
      optimizer.step()
  finally:
    reference.dion_update = update
  state = [optimizer.state[p] for p in params]
  return {
    "final": [p.detach().numpy().copy() for p in params],
    "momentum": [s["momentum"].numpy().copy() for s in state],
    "q": [s["Q"].numpy().copy() for s in state],
    "q0": [first_q[i].numpy().copy() for i in range(len(params))],
  }


def main(dion_path):
  torch.compile = eager
  sys.path.insert(0, dion_path)
  from dion import dion_reference

  weights, grads, arrays = inputs()  # record_dion2.py's
  for setting, kwargs in SETTINGS.items():
    shipped = run(dion_reference, kwargs, weights, grads, torch.float32)
    exact = run(
      dion_reference, kwargs, weights, grads, torch.float64, shipped["q0"]
    )
    for variant, result in (("fp32", shipped), ("fp64", exact)):
      for key, values in result.items():
        for i, value in enumerate(values):
          arrays[f"{setting}/{variant}/{key}_{i}"] = value
  np.savez_compressed(HERE / "dion.npz", **arrays)
  commit = subprocess.run(
    ["git", "-C", dion_path, "rev-parse", "HEAD"],
    capture_output=True,
    text=True,
  ).stdout.strip()
  about = {
    "conventions": (
      "weights and gradients in torch's (out, in) order; final_i, "
      "momentum_i and q_i after 5 Dion.step() calls of dion_reference.py on "
      "one device; q0_i the Q its first step was given ((in, r), or "
      "(out, r) where out < in: dion runs on the tall side); 'fp32' as "
      "shipped (randomized Cholesky QR), 'fp64' the same in float64 from "
      "the float64 cast of q0"
    ),
    "shapes": SHAPES,
    "steps": STEPS,
    "settings": SETTINGS,
    "torch": torch.__version__,
    "numpy": np.__version__,
    "dion_commit": commit or os.environ.get("DION_COMMIT", "unknown"),
  }
  (HERE / "dion.json").write_text(json.dumps(about, indent=1) + "\n")


if __name__ == "__main__":
  main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/dion_src")
