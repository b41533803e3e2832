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
(every rank runs its slots, padding included); where no stack is homed
over the axis but stacks are sharded over it (DeepSeek's experts), the
ranks' ``max ÷ mean`` alone.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import jax  # noqa: E402
from _update_time import muon_leaves  # noqa: E402
from at_scale import deepseek_tree  # noqa: E402
from at_scale import llama_tree  # noqa: E402

from optax_muon._src.parallel import balance  # noqa: E402

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
  mesh = jax.sharding.AbstractMesh(mesh_shape, ("data", "model"))
  views, specs, tp = muon_leaves(flat, mesh, mode="allgather")
  return balance.rank_loads(tp, views, specs, 5)


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
      lines = [load.line() for load in found] or ["nothing over a data axis"]
      print(f"{name}: " + "; ".join(lines))
  if "--json" in argv:
    print(json.dumps(records, indent=1))


if __name__ == "__main__":
  main(sys.argv[1:])
