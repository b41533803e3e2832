"""One plan per Muon leaf, decided once: its tensor-parallel mode and why,
and the matrices Newton–Schulz sees (each shard's under ``blockwise``).

The sharded orthogonalization runs each leaf in its plan's mode, the shape
scale scales by its plan's matrices, and ``om.describe`` shows both, so the
three cannot disagree. A plan is a function of static data (shapes, specs,
dtypes, the ``TensorParallel`` and the solver's settings); the same data
asked again in a trace (the orthogonalization, then the shape scale) gets
the same plans without running the cost model again.
"""

import dataclasses
import functools
from collections.abc import Sequence

from optax_muon._src.base import types
from optax_muon._src.kernels import shape_scale
from optax_muon._src.parallel import cost
from optax_muon._src.parallel.tensor_parallel import TensorParallel
from optax_muon._src.parallel.tensor_parallel import local_shape
from optax_muon._src.parallel.tensor_parallel import local_view
from optax_muon._src.parallel.tensor_parallel import mode_for
from optax_muon._src.parallel.tensor_parallel import tp_dim_of
from optax_muon._src.views import layout

NOT_SPLIT = "not sharded over the TP axis"


@dataclasses.dataclass(frozen=True)
class LeafPlan:
  """What the optimizer does with one Muon leaf.

  Attributes:
    view: the leaf as matrices (its global shape).
    mode: the tensor-parallel mode set or chosen for it (``auto``'s choice).
    runs: the mode its orthogonalization runs in
      (``tensor_parallel.mode_for``: a leaf not split over the TP axis runs
      ``blockwise``, split pieces and short sharded sides gather).
    reason: why ``mode``: ``"set"``, or ``auto``'s modeled times.
    solved: the matrices Newton–Schulz orthogonalizes, as a view: ``view``,
      or the shard's under ``blockwise``.
  """

  view: layout.MatrixView
  mode: str
  runs: str
  reason: str
  solved: layout.MatrixView

  def scales(self, scale_mode: types.ScaleMode) -> tuple[float, ...]:
    """The shape scale of each matrix piece, from what was orthogonalized."""
    return tuple(
      shape_scale.scale_factor(fan_out, fan_in, scale_mode)
      for fan_in, fan_out in self.solved.matrix_shapes
    )


def unsharded(view: layout.MatrixView) -> LeafPlan:
  """The plan of a leaf without tensor parallelism."""
  return LeafPlan(view, "—", "local", "—", view)


def plan_leaves(
  tp: TensorParallel,
  views: Sequence[layout.MatrixView],
  specs: Sequence[tuple],
  itemsizes: Sequence[int],
  steps,
  precision: str,
  preconditioning: str,
  auto_limit: int | None,
  wave_bytes: int,
) -> tuple[LeafPlan, ...]:
  """Each Muon leaf's plan under ``tp`` (specs as ``tp.leaf_specs`` gives
  them); ``auto`` chooses by the cost model, once for the same data, among
  the modes whose smallest piece fits ``auto_limit`` bytes
  (``Execution.auto_limit``; ``None``: any), the waves being
  ``wave_bytes`` (``Execution.wave_bytes``: how many parts a pipelined
  stack runs in, which sets what its collectives hide under)."""
  key = (
    dataclasses.replace(tp, specs=None),
    tuple(views),
    tuple(specs),
    tuple(itemsizes),
    steps,
    precision,
    preconditioning,
    auto_limit,
    wave_bytes,
  )
  try:
    hash(key)
  except TypeError:  # a traced step count: planned each time
    return _plan_leaves(*key)
  return _cached_plans(*key)


def _plan_leaves(tp, views, specs, itemsizes, *model) -> tuple[LeafPlan, ...]:
  """``model``: ``plan_leaves``' steps, precision, preconditioning,
  auto_limit and wave_bytes, in its order (``cost.leaf_choices``')."""
  tp_dims = [tp_dim_of(v, s, tp) for v, s in zip(views, specs)]
  if tp.mode == "auto":
    choices = cost.leaf_choices(tp, views, specs, itemsizes, *model)
    chosen = [
      (c.mode, NOT_SPLIT if d is None else c.reason)
      for c, d in zip(choices, tp_dims)
    ]
  else:
    chosen = [(tp.mode, "set")] * len(views)
  plans = []
  for view, spec, tp_dim, (mode, reason) in zip(views, specs, tp_dims, chosen):
    runs = mode_for(mode, view, tp_dim)
    solved = view
    if runs == "blockwise":  # each shard orthogonalized as a matrix
      solved = local_view(view, local_shape(view.shape, spec, tp))
    # a set mode is shown as it runs; auto's choice as chosen (its reason
    # names the modes it compared)
    shown = mode if tp.mode == "auto" else runs
    plans.append(LeafPlan(view, shown, runs, reason, solved))
  return tuple(plans)


_cached_plans = functools.lru_cache(maxsize=256)(_plan_leaves)
