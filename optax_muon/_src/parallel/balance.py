"""How evenly the FSDP homes share out the Newton–Schulz work over a data
axis: each rank's load, for ``describe``; also over an axis that shards a
stack's layers or experts (expert parallelism), which homes nothing.

A stack homed over a data axis (``fsdp.FsdpMove``) is cut into equal
contiguous blocks of ``slots`` layers a rank, padded with zero matrices at
the end: 80 layers over 64 ranks is 2 slots a rank, both real on the first
40 ranks and both padding on the last 24. Every rank runs its slots,
padding included (one program for all: SPMD), so the time is set by the
slots; the real work is not even, and ``max ÷ mean`` of it says how much
of the slots' time is padding's.
"""

import dataclasses
from collections.abc import Sequence

from optax_muon._src.parallel import cost
from optax_muon._src.parallel import fsdp
from optax_muon._src.parallel.tensor_parallel import TensorParallel
from optax_muon._src.views import layout


@dataclasses.dataclass(frozen=True)
class RankLoads:
  """The Newton–Schulz work of each rank of one data axis.

  Attributes:
    axis: the mesh axis stacks are homed over.
    real: per rank, FLOPs of the matrices it orthogonalizes that are not
      padding (each whole matrix counted once for the rank's
      tensor-parallel group, however that group shares it).
    slots: per rank, FLOPs it runs, padding included (equal on every rank).
    padding: the share of the homed slots that are zero padding.
    homed: whether some stack is homed over ``axis`` (otherwise its
      stacks are sharded over it: each rank orthogonalizes its own layers
      or experts).
  """

  axis: str
  real: tuple[float, ...]
  slots: float
  padding: float
  homed: bool = True

  @property
  def imbalance(self) -> float:
    """``max ÷ mean`` of ``real`` (1.0: even)."""
    mean = sum(self.real) / len(self.real)
    return max(self.real) / mean if mean else 1.0

  def line(self) -> str:
    """One line for ``describe``."""
    if not self.homed:
      return (
        f"stacks sharded over {self.axis!r} ({len(self.real)} ranks), none "
        f"homed: each rank's Newton–Schulz FLOPs, max ÷ mean "
        f"{self.imbalance:.2f}"
      )
    return (
      f"homes over {self.axis!r} ({len(self.real)} ranks): each rank's "
      f"Newton–Schulz FLOPs on real matrices, max ÷ mean "
      f"{self.imbalance:.2f}; {self.padding:.0%} of the homed slots are "
      "zero padding (run as well)"
    )


def rank_loads(
  tp: TensorParallel,
  views: Sequence[layout.MatrixView],
  specs: Sequence,
  steps: int,
) -> list[RankLoads]:
  """Each data axis's ``RankLoads`` for Muon leaves of global ``views``
  with normalized ``specs`` (``TensorParallel.leaf_specs``), ``steps``
  Newton–Schulz steps; one entry per mesh axis other than the TP axis that
  some stack is homed over or has its layers (experts) sharded over, in
  mesh order. A leaf not homed over an axis gives each of its ranks the
  same work (its own shard of a sharded stack; repeated, or shared by
  ``distribute_over``)."""
  plans = [fsdp.moves(view, spec, tp) for view, spec in zip(views, specs)]
  homing = {m.name for plan in plans for m in plan if m.home is not None}
  axes = homing | {
    name
    for view, spec in zip(views, specs)
    for dim in view.batch_axes
    for name in spec[dim]
    if name != tp.axis
  }
  found = []
  for axis in (a for a in tp.bound_mesh.axis_names if a in axes):
    ranks = tp.bound_mesh.shape[axis]
    real = [0.0] * ranks
    slots = padded = homed = 0.0
    for view, spec, plan in zip(views, specs, plans):
      flops = sum(
        cost.newton_schulz_flops(m, n, steps) for m, n in view.matrix_shapes
      )
      count = fsdp.local_count(view, spec, tp)
      home = next(
        (m for m in plan if m.home is not None and m.name == axis), None
      )
      if home is None:
        share = (
          count / ranks if fsdp.splits_over_data(view, spec, tp) else count
        )
        real = [load + share * flops for load in real]
        slots += share * flops
        continue
      rest = count // home.slots  # the matrices of a slot
      for rank in range(ranks):
        mine = min(max(home.length - rank * home.slots, 0), home.slots)
        real[rank] += mine * rest * flops
      slots += count * flops
      padded += (home.padded - home.length) * rest
      homed += home.padded * rest
    found.append(
      RankLoads(
        axis,
        tuple(real),
        slots,
        padded / homed if homed else 0.0,
        homed=axis in homing,
      )
    )
  return found
