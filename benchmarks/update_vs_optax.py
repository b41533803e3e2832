"""Our ``muon`` update against ``optax.contrib.muon`` and AdamW, same settings.

    python benchmarks/update_vs_optax.py [--quick] [--trees gpt,wide,stacked]

Both run quintic × 5 (optax's ``"dion"`` preset), β = 0.95 EMA momentum,
Nesterov off, optax's ``√max(1, fan_out/fan_in)`` scale (our
``"shape_scaling"``), the same leaves to Muon (every 2-D one, as optax routes),
AdamW (eps 1e-8, no decay) for the rest. optax's bias correction scales the
momentum by a scalar, which Newton–Schulz ignores, so the updates agree; the
script checks they do (``max_abs_diff``) before it compares times. Ours runs
twice: the standard Newton–Schulz and ``method="gram"`` (the same polynomial
on the Gram matrix where a matrix is at least 2.5 times wider than tall).
Trees: (a) the example GPT's params, (b) 24 leaves of 1024×4096 / 4096×1024,
(c) a stacked [12, 512, 2048] leaf that optax is told to vmap over, (d) four
transformer layers with a 512-wide residual (qkv 512×1536, out 512×512, MLP
512×2048 and 2048×512, two norm scales each).

``optax_muon.compat.muon`` runs too, called exactly as optax is (the same
arguments, so the same numbers: ``compat_max_abs_diff``); ``compat_over_optax``
is its time over optax's.

Two limits: ``roofline``, the standard NS FLOPs at the rate of a square matmul
(1024², the machine's best), and ``matmuls_alone``, the same NS matmuls at the
tree's own shapes with nothing else (small matrices multiply slower than the
square one, so this limit is the one an update of the tree can reach).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _timing import emit  # noqa: E402
from _timing import interleaved  # noqa: E402
from _timing import ns_flops  # noqa: E402
from flax import nnx  # noqa: E402
from optax.contrib import MuonDimensionNumbers  # noqa: E402

import optax_muon as om  # noqa: E402
from examples.flax_lm.model import GPT  # noqa: E402
from examples.flax_lm.model import GPTConfig  # noqa: E402
from optax_muon import compat  # noqa: E402


def trees(quick: bool):
  key = iter(jax.random.split(jax.random.key(0), 64))
  normal = lambda shape: jax.random.normal(next(key), shape)
  gpt_cfg = (
    GPTConfig(n_layer=2, n_embd=64)
    if quick
    else GPTConfig(n_layer=4, n_embd=192, n_head=6)
  )
  gpt = nnx.to_pure_dict(nnx.state(GPT(gpt_cfg, nnx.Rngs(0)), nnx.Param))
  big = (256, 1024) if quick else (1024, 4096)
  count = 4 if quick else 24
  wide = {
    f"w{i:02d}": normal(big if i % 2 else big[::-1]) for i in range(count)
  }
  stacked = {"w": normal((4, 128, 512) if quick else (12, 512, 2048))}
  d = 128 if quick else 512
  layers = {
    f"layer{i}": {
      "qkv": normal((d, 3 * d)),
      "out": normal((d, d)),
      "up": normal((d, 4 * d)),
      "down": normal((4 * d, d)),
      "norm1": normal((d,)),
      "norm2": normal((d,)),
    }
    for i in range(4)
  }
  return {
    "gpt": (gpt, None),
    "wide": (wide, None),
    "stacked": (stacked, {"w": MuonDimensionNumbers(1, 2)}),
    "layers512": (layers, None),
  }


def is_muon_leaf(x, dims) -> bool:
  """optax's routing: every 2-D leaf, and ≥ 3-D ones when given dimensions."""
  return x.ndim >= 2 and (dims is not None or x.ndim == 2)


def optimizers(params, dims, nesterov: bool = False):
  labels = jax.tree.map(
    lambda x: "muon" if is_muon_leaf(x, dims) else "adam", params
  )
  ours = lambda method: om.muon(
    0.02,
    coefficients="quintic",
    steps=5,
    beta=0.95,
    nesterov=nesterov,
    scale_mode="shape_scaling",
    labels=labels,
    precision="highest",
    adam_eps=1e-8,
    method=method,
    # optax's dimension numbers where it is given them (the stacked tree)
    dimension_numbers=dims,
  )
  optax_settings = dict(
    ns_coeffs="dion",
    ns_steps=5,
    beta=0.95,
    nesterov=nesterov,
    muon_weight_dimension_numbers=dims,
  )
  theirs = optax.contrib.muon(0.02, **optax_settings)
  return {
    "optax_muon": ours("standard"),
    "optax_muon_gram": ours("gram"),
    "optax.contrib.muon": theirs,
    "compat": compat.muon(0.02, **optax_settings),
    "adamw": optax.adamw(0.02, eps=1e-8, weight_decay=0.0),
  }


def matmul_limit(matrices, steps: int):
  """The Newton–Schulz matmuls alone (``X Xᵀ``, ``A A``, ``B X`` a step), each
  matrix on its own in its wide orientation: the limit at these shapes."""
  wide = [
    x if x.shape[-2] <= x.shape[-1] else jnp.swapaxes(x, -1, -2)
    for x in matrices
  ]
  # Near-orthogonal inputs keep every product near 1 (no overflow, no
  # subnormals, which would slow the CPU down).
  wide = [om.newton_schulz(x, steps=steps) for x in wide]

  def run(xs):
    out = []
    for x in xs:
      for _ in range(steps):
        A = jnp.matmul(x, jnp.swapaxes(x, -1, -2))
        x = jnp.matmul(jnp.matmul(A, A), x)
      out.append(x)
    return out

  return jax.jit(run), (wide,)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--trees", default="gpt,wide,stacked,layers512")
  args = parser.parse_args()
  quick = args.quick
  for name, (params, dims) in trees(quick).items():
    if name not in args.trees.split(","):
      continue
    grads = jax.tree.map(
      lambda p: jax.random.normal(jax.random.key(1), p.shape), params
    )
    candidates, outputs = {}, {}
    for label, tx in optimizers(params, dims).items():
      state = tx.init(params)
      step = jax.jit(tx.update)
      candidates[label] = (step, (grads, state, params))
      outputs[label] = step(grads, state, params)[0]
    diff = {
      ours: max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(
          jax.tree.leaves(outputs[ours]),
          jax.tree.leaves(outputs["optax.contrib.muon"]),
        )
      )
      for ours in ("optax_muon", "optax_muon_gram")
    }
    matrices = [x for x in jax.tree.leaves(grads) if is_muon_leaf(x, dims)]
    candidates["matmuls_alone"] = matmul_limit(matrices, 5)
    side = 256 if quick else 1024  # the matmul limit, timed in the same rounds
    square = jax.random.normal(jax.random.key(2), (side, side))
    candidates["matmul"] = (
      jax.jit(lambda a: jnp.matmul(a, a, precision=jax.lax.Precision.HIGHEST)),
      (square,),
    )
    times = interleaved(candidates, rounds=2 if quick else 5, warmup=1)
    rate = 2 * side**3 / times.pop("matmul")
    flops = sum(
      ns_flops(*x.shape[-2:], 5) * np.prod(x.shape[:-2]) for x in matrices
    )
    emit(
      {
        "benchmark": "update_vs_optax",
        "tree": name,
        "leaves": len(jax.tree.leaves(params)),
        "params": int(sum(x.size for x in jax.tree.leaves(params))),
        "seconds": times,
        "max_abs_diff": diff,
        "compat_max_abs_diff": max(
          float(jnp.max(jnp.abs(a - b)))
          for a, b in zip(
            jax.tree.leaves(outputs["compat"]),
            jax.tree.leaves(outputs["optax.contrib.muon"]),
          )
        ),
        "compat_over_optax": times["compat"] / times["optax.contrib.muon"],
        # the floor of any standard-form update of this tree, over optax's
        "matmuls_alone_over_optax": (
          times["matmuls_alone"] / times["optax.contrib.muon"]
        ),
        "ours_over_optax": times["optax_muon"] / times["optax.contrib.muon"],
        "ours_gram_over_optax": (
          times["optax_muon_gram"] / times["optax.contrib.muon"]
        ),
        "ours_over_adamw": times["optax_muon"] / times["adamw"],
        "ns_flops": float(flops),
        "ours_over_roofline": times["optax_muon"] / (flops / rate),
        "ours_gram_over_roofline": times["optax_muon_gram"] / (flops / rate),
        "matmuls_alone_over_roofline": times["matmuls_alone"] / (flops / rate),
        "ours_over_matmuls_alone": (
          times["optax_muon"] / times["matmuls_alone"]
        ),
      }
    )


if __name__ == "__main__":
  main()
