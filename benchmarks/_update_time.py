"""The modeled time of one Muon update per tensor-parallel mode (at_scale.py):
the Newton–Schulz FLOPs by formula and as the compiler counts them, the
collectives' bytes, and the time at the target's rates (``om.KNOWN_RATES``).

It is a model, not a measurement: FLOPs at the part's peak matmul rate and
bytes at its link's peak bandwidth, nothing overlapped. ``cost_analysis()``
counts a loop's body once (XLA's HLO cost analysis does not multiply by the
trip count), so for Newton–Schulz's step loop and the memory budget's wave
loops it is a floor; the formula counts every step of every matrix.
"""

import jax
import optax
from jax.sharding import PartitionSpec as P

import optax_muon as om
from optax_muon._src.parallel import cost
from optax_muon._src.parallel.execution import Execution
from optax_muon._src.parallel.rates import rates_of  # noqa: F401 (re-exported)
from optax_muon._src.views import layout

STEPS = 5  # om.muon's default


def muon_leaves(flat: dict, mesh, distribute_over=None, mode="auto"):
  """The Muon leaves of an at_scale tree as the cost model sees them:
  ``(views, specs, tp)``, ``tp`` a ``TensorParallel`` in ``mode`` (``auto``
  needs the mesh's device rates; another mode plans on an ``AbstractMesh``
  too)."""
  muon = {k: v for k, v in flat.items() if v[1] == "muon"}
  tree = {
    k: jax.ShapeDtypeStruct(shape, "float32")
    for k, (shape, _, _) in muon.items()
  }
  specs = {k: P(*spec) for k, (_, _, spec) in muon.items()}
  dims = {
    k: optax.contrib.MuonDimensionNumbers(len(shape) - 2, len(shape) - 1)
    for k, (shape, _, _) in muon.items()
  }
  tp = om.TensorParallel(
    mesh, "model", mode, specs=specs, distribute_over=distribute_over
  )
  views = [v for _, _, v in layout.view_resolver(dims)(tree)]
  return views, tp.leaf_specs(tree), tp


def formula(
  flat, mesh, mode, itemsize, precision, budget=None, distribute_over=None
) -> dict:
  """The cost model summed over the Muon leaves for ``mode`` (``auto``: each
  leaf's choice): Newton–Schulz TFLOP, link GiB and modeled ms per device,
  and for ``auto`` how many leaves took each mode."""
  views, specs, tp = muon_leaves(flat, mesh, distribute_over)
  itemsizes = [itemsize] * len(views)
  wave_bytes = Execution(memory_budget=budget).wave_bytes
  chosen = None
  if mode == "auto":
    choices = cost.leaf_choices(
      tp,
      views,
      specs,
      itemsizes,
      STEPS,
      precision,
      "frobenius",
      budget,
      wave_bytes,
    )
    costs = [
      next(c for c in choice.costs if c.runs == choice.mode)
      for choice in choices
    ]
    chosen = {}
    for choice in choices:
      chosen[choice.mode] = chosen.get(choice.mode, 0) + 1
  else:
    groups = cost.group_items(views, specs, itemsizes, tp)
    costs = [
      cost.mode_costs(
        v, s, itemsize, tp, STEPS, precision, g, [mode], wave_bytes
      )[0]
      for v, s, g in zip(views, specs, groups)
    ]
  return {
    "ns_tflop": sum(c.flops for c in costs) / 1e12,
    "link_gib": sum(c.bytes for c in costs) / 2**30,
    "model_ms": sum(c.seconds for c in costs) * 1e3,
    "auto_chose": chosen,
  }
