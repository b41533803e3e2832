"""Bytes moved by collectives per tensor-parallel mode, against optax under GSPMD.

    python benchmarks/sharding.py [--quick]
    python benchmarks/sharding.py --plan [--quick]   # docs/scaling.md's table

On 8 simulated CPU devices (a (2, 4) data × model mesh), a tree of kernels
sharded on their input dim (row-parallel) or output dim (column-parallel) gets
one jitted Muon update from each ``muon_tp_mode`` and from
``optax.contrib.muon`` (which has no sharding logic: XLA's GSPMD inserts the
collectives). Bytes are read from the compiled HLO: each collective's result
size, times the trip count of the loop it sits in. Step times are medians of
interleaved rounds.

``--plan`` prints the planning table of docs/scaling.md: for one decoder layer
of a 1B, 8B and 70B model (Megatron's tensor-parallel layout: QKV and the
MLP's gate and up column-parallel, the attention output and down projection
row-parallel) at TP 4 and 8, each mode's and optax's (GSPMD) collective
bytes per device for one optimizer step, read from the compiled HLO (compiled
from shapes alone, nothing is allocated), times the layer count; beside them
the bytes Megatron-Core's own algorithm for the mode moves, from its formulas.
"""

import os
import sys

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
sys.path.insert(0, os.path.dirname(__file__))
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _hlo import collective_bytes  # noqa: E402
from _timing import emit  # noqa: E402
from _timing import interleaved  # noqa: E402
from _timing import quick_flag  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_muon as om  # noqa: E402
from optax_muon._src.parallel.allgather import shares_out  # noqa: E402

# (d_model, d_ffn, query heads, kv heads, head dim, layers)
DECODERS = {
  "1B": (2048, 8192, 32, 8, 64, 16),
  "8B": (4096, 14336, 32, 8, 128, 32),
  "70B": (8192, 28672, 64, 8, 128, 80),
}
NS_STEPS = 5


def layer_shapes(d, ffn, heads, kv_heads, head_dim):
  """One layer's Muon matrices, each with its tensor-parallel spec."""
  qkv = (heads + 2 * kv_heads) * head_dim
  return {
    "qkv": ((d, qkv), P(None, "model")),
    "out": ((heads * head_dim, d), P("model", None)),
    "gate": ((d, ffn), P(None, "model")),
    "up": ((d, ffn), P(None, "model")),
    "down": ((ffn, d), P("model", None)),
  }


def expected_bytes(shapes, mode: str, tp: int) -> float:
  """Collective result bytes per device that each mode's algorithm implies
  (Megatron-Core's for ``duplicated`` and ``distributed``), in the HLO's
  convention: an all-gather counts the whole gathered matrix, an all-reduce
  its array, an all-to-all its result."""
  if mode == "duplicated":  # each sharded matrix gathered whole
    return sum(4 * a * b for (a, b), _ in shapes.values())
  if mode == "distributed":  # X Xᵀ of the short side, all-reduced a step
    return sum(NS_STEPS * 4 * min(a, b) ** 2 for (a, b), _ in shapes.values())
  if mode == "allgather":  # same wide shape: one group; see shares_out
    groups = {}
    for (a, b), _ in shapes.values():
      groups.setdefault((min(a, b), max(a, b)), []).append(4 * a * b)
    total = 0.0
    for sizes in groups.values():
      if shares_out(len(sizes), tp):
        padded = -(-len(sizes) // tp) * tp
        total += 2 * padded * sizes[0] / tp  # two all-to-alls of the stack
      else:
        total += sum(sizes)  # gathered as in duplicated
    return total
  return 0.0


def plan(quick: bool):
  """docs/scaling.md's planning table, as JSON lines and a markdown table."""
  rows = []
  models = {"tiny": (256, 1024, 8, 4, 32, 2)} if quick else DECODERS
  for name, (d, ffn, heads, kv, hd, layers) in models.items():
    for tp in (4, 8):
      mesh = jax.make_mesh(
        (8 // tp, tp), ("data", "model"), axis_types=(AxisType.Auto,) * 2
      )
      shapes = layer_shapes(d, ffn, heads, kv, hd)
      specs = {k: spec for k, (_, spec) in shapes.items()}
      abstract = {
        k: jax.ShapeDtypeStruct(
          shape, np.float32, sharding=NamedSharding(mesh, spec)
        )
        for k, (shape, spec) in shapes.items()
      }
      labels = {k: "muon" for k in shapes}
      row = {
        "model": name,
        "tp": tp,
        "layers": layers,
        "bytes": {},
        "expected_bytes": {},
      }
      optimizers = {
        mode: om.muon(
          0.02,
          labels=labels,
          sharding=om.TensorParallel(mesh, mode=mode, specs=specs),
        )
        for mode in om.TensorParallel.MODES
      }
      optimizers["optax.contrib.muon"] = optax.contrib.muon(0.02)
      for mode, tx in optimizers.items():
        state = jax.eval_shape(tx.init, abstract)
        hlo = (
          jax.jit(tx.update)
          .lower(abstract, state, abstract)
          .compile()
          .as_text()
        )
        row["bytes"][mode] = layers * sum(collective_bytes(hlo).values())
        if mode in om.TensorParallel.MODES:
          row["expected_bytes"][mode] = layers * expected_bytes(
            shapes, mode, tp
          )
      emit({"benchmark": "sharding_plan", **row})
      rows.append(row)
  gib = lambda x: f"{x / 2**30:.2f}"
  print(
    "| model | TP | "
    + " | ".join(f"{m} (expected)" for m in om.TensorParallel.MODES)
    + " | optax.contrib.muon "
    "(GSPMD) |"
  )
  print("|---|---|" + "---|" * (len(om.TensorParallel.MODES) + 1))
  for row in rows:
    cells = [
      f"{gib(row['bytes'][m])} ({gib(row['expected_bytes'][m])})"
      for m in om.TensorParallel.MODES
    ]
    print(
      f"| {row['model']} | {row['tp']} | "
      + " | ".join(cells)
      + f" | {gib(row['bytes']['optax.contrib.muon'])} |"
    )


def main():
  quick = quick_flag()
  if "--plan" in sys.argv[1:]:
    plan(quick)
    return
  mesh = jax.make_mesh(
    (2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2
  )
  size = (128, 512) if quick else (512, 2048)
  key = iter(jax.random.split(jax.random.key(0), 16))
  cases = {
    "input_dim_sharded": P("model", None),
    "output_dim_sharded": P(None, "model"),
  }
  for case, spec in cases.items():
    params = {f"w{i}": jax.random.normal(next(key), size) for i in range(4)}
    specs = {k: spec for k in params}
    sharded = {
      k: jax.device_put(v, NamedSharding(mesh, spec)) for k, v in params.items()
    }
    labels = {k: "muon" for k in params}
    optimizers = {
      mode: om.muon(
        0.02,
        labels=labels,
        sharding=om.TensorParallel(mesh, mode=mode, specs=specs),
      )
      for mode in om.TensorParallel.MODES
    }
    optimizers["optax.contrib.muon"] = optax.contrib.muon(
      0.02, ns_coeffs="dion"
    )
    record = {
      "benchmark": "sharding",
      "case": case,
      "leaf_shape": list(size),
      "leaves": len(params),
      "mesh": {"data": 2, "model": 4},
      "collective_bytes": {},
      "seconds": {},
    }
    candidates = {}
    for name, tx in optimizers.items():
      state = jax.jit(tx.init)(sharded)
      step = jax.jit(tx.update)
      hlo = step.lower(sharded, state, sharded).compile().as_text()
      record["collective_bytes"][name] = collective_bytes(hlo)
      candidates[name] = (step, (sharded, state, sharded))
    record["seconds"] = interleaved(
      candidates, rounds=3 if quick else 5, warmup=1
    )
    total = {k: sum(v.values()) for k, v in record["collective_bytes"].items()}
    record["total_bytes"] = total
    record["bytes_over_optax"] = {
      mode: total[mode] / max(total["optax.contrib.muon"], 1)
      for mode in om.TensorParallel.MODES
    }
    record["time_over_optax"] = {
      mode: record["seconds"][mode] / record["seconds"]["optax.contrib.muon"]
      for mode in om.TensorParallel.MODES
    }
    emit(record)


if __name__ == "__main__":
  main()
