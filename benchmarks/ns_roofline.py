"""Newton–Schulz time over the time its matmul FLOPs take at the measured rate.

    python benchmarks/ns_roofline.py [--quick]

Prints one JSON line per (shape, schedule, precision): ``ratio`` = NS time /
(``T·(4m²n + 2m³)`` / the FLOP rate of a square matmul timed in the same
process). 1.0 is the matmul limit.
"""

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import importlib  # noqa: E402

import jax  # noqa: E402

import optax_muon as om  # noqa: E402

gram = importlib.import_module("optax_muon._src.kernels.gram")
from _timing import emit  # noqa: E402
from _timing import interleaved  # noqa: E402
from _timing import ns_flops  # noqa: E402


def gram_record(x, precision, steps) -> dict:
  """Gram Newton–Schulz against the standard form: time ratio vs FLOP ratio."""
  m, n = x.shape
  forms = {
    method: jax.jit(
      lambda u, o=om.orthogonalize(steps=steps, precision=precision, method=method): (
        o.update({"w": u}, None)[0]["w"]
      )
    )
    for method in ("standard", "gram")
  }
  times = interleaved({k: (f, (x,)) for k, f in forms.items()}, rounds=5)
  flop_ratio = gram.gram_flops(m, n, steps) / ns_flops(m, n, steps)
  return {
    "benchmark": "gram",
    "shape": [m, n],
    "precision": precision,
    "time_ratio": times["gram"] / times["standard"],
    "flop_ratio": flop_ratio,
    "max_abs_diff": float(abs(forms["gram"](x) - forms["standard"](x)).max()),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--shapes", help="e.g. 1024x4096,8192x28672")
  parser.add_argument("--precisions", help="e.g. highest,medium")
  parser.add_argument(
    "--rate-size",
    type=int,
    help="side of the square matmul that measures the rate",
  )
  args = parser.parse_args()
  quick = args.quick
  shapes = (
    [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if args.shapes
    else [(128, 512)]
    if quick
    else [(512, 2048), (1024, 1024), (1024, 4096), (1024, 8192)]
  )
  schedules = (
    ["quintic", "cubic5"] if quick else ["quintic", "polar_express", "cubic5"]
  )
  precisions = (
    args.precisions.split(",")
    if args.precisions
    else ["highest"]
    if quick
    else ["highest", "medium"]
  )
  steps = 5
  for precision in precisions:
    side = args.rate_size or (256 if quick else 1024)
    level = {"highest": jax.lax.Precision.HIGHEST}.get(
      precision, jax.lax.Precision.DEFAULT
    )
    dtype = {"medium": "bfloat16", "bf16": "bfloat16", "fp16": "float16"}.get(
      precision, "float32"
    )
    square = jax.random.normal(jax.random.key(1), (side, side), dtype)
    matmul = jax.jit(lambda a: jax.numpy.matmul(a, a, precision=level))
    for m, n in shapes:
      x = jax.random.normal(jax.random.key(0), (m, n))
      for schedule in schedules:
        fn = jax.jit(
          functools.partial(
            om.newton_schulz,
            coefficients=schedule,
            steps=steps,
            precision=precision,
          )
        )
        # the rate is timed in the same rounds as NS, so drift cancels
        times = interleaved(
          {"ns": (fn, (x,)), "matmul": (matmul, (square,))},
          rounds=3 if quick else 7,
        )
        rate = 2 * side**3 / times["matmul"]
        flops = ns_flops(m, n, steps, cubic=schedule == "cubic5")
        emit(
          {
            "benchmark": "ns_roofline",
            "shape": [m, n],
            "schedule": schedule,
            "precision": precision,
            "seconds": times["ns"],
            "matmul_flops_per_s": rate,
            "roofline_seconds": flops / rate,
            "ratio": times["ns"] / (flops / rate),
            "device": jax.devices()[0].device_kind,
          }
        )
      # quintic, Gram vs standard (the Gram form has no bf16 iterate)
      if gram.gram_saves_flops(m, n) and precision != "bf16":
        emit(gram_record(x, precision, steps))


if __name__ == "__main__":
  main()
