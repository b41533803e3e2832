"""Each data rank's Newton–Schulz load under FSDP homes, as ``om.describe``
shows it, planned for the trees of ``at_scale.py`` (nothing is compiled or
allocated: an ``AbstractMesh`` of the chips' shape)::

    python benchmarks/homes_balance.py [--json]

Cases: Llama-3-70B stacked, MaxText's FSDP (each kernel's other matrix axis
over ``data``) with TP 8 on 64 chips (data 8) and 512 (data 64); and
DeepSeek-V3 on v5p-64 with EP 8 × TP 8 (its routed experts sharded over
``data``, the expert-parallel axis; attention and dense kernels replicated
over it). Prints per case ``max ÷ mean`` of each data rank's FLOPs on real
(not padding) matrices and the share of the homed slots that are padding
(every rank runs its slots, padding included), or that no stack is homed.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from at_scale import deepseek_tree  # noqa: E402
from at_scale import llama_tree  # noqa: E402
from at_scale import nest  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_muon as om  # noqa: E402
from optax_muon._src.parallel import balance  # noqa: E402
from optax_muon._src.views import layout  # noqa: E402

CASES = {
  "llama3-70b, 64 chips (FSDP 8 × TP 8)": ("llama3-70b", (8, 8)),
  "llama3-70b, 512 chips (FSDP 64 × TP 8)": ("llama3-70b", (64, 8)),
  "deepseek-v3, v5p-64 (EP 8 × TP 8)": ("deepseek-v3", (8, 8)),
}


def loads(model: str, mesh_shape) -> list[balance.RankLoads]:
  """``balance.rank_loads`` of the Muon leaves of ``model``'s tree."""
  flat = (
    deepseek_tree()
    if model == "deepseek-v3"
    else llama_tree(model, True, fsdp="matrix")
  )
  muon = {k: v for k, v in flat.items() if v[1] == "muon"}
  params = nest(
    {k: jax.ShapeDtypeStruct(s, jnp.bfloat16) for k, (s, _, _) in muon.items()}
  )
  dims = nest(
    {
      k: optax.contrib.MuonDimensionNumbers(len(s) - 2, len(s) - 1)
      for k, (s, _, _) in muon.items()
    }
  )
  mesh = jax.sharding.AbstractMesh(mesh_shape, ("data", "model"))
  tp = om.TensorParallel(
    mesh,
    "model",
    "allgather",
    specs=nest({k: P(*v[2]) for k, v in muon.items()}),
  )
  views = [view for _, _, view in layout.view_resolver(dims)(params)]
  return balance.rank_loads(tp, views, tp.leaf_specs(params), 5)


def main(argv):
  records = {}
  for name, (model, mesh_shape) in CASES.items():
    found = loads(model, mesh_shape)
    records[name] = [
      {
        "axis": load.axis,
        "ranks": len(load.real),
        "max_over_mean": round(load.imbalance, 4),
        "padding": round(load.padding, 4),
      }
      for load in found
    ]
    if "--json" not in argv:
      lines = [load.line() for load in found] or ["no stack is homed"]
      print(f"{name}: " + "; ".join(lines))
  if "--json" in argv:
    print(json.dumps(records, indent=1))


if __name__ == "__main__":
  main(sys.argv[1:])
