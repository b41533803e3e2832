"""What a planner of a tensor-parallel mode is given: the Muon leaves inside
``shard_map`` (``Leaf``) and the ways their matrices may be solved
(``Solves``); it returns ``waves.Task``s, which name their leaves
(``owners``) and their solve."""

import dataclasses
import functools
from typing import NamedTuple

import jax

from optax_muon._src.kernels import batched
from optax_muon._src.parallel.tensor_parallel import TensorParallel
from optax_muon._src.parallel.waves import Solve
from optax_muon._src.views import layout


@dataclasses.dataclass
class Leaf:
  """A Muon leaf inside ``shard_map``, as the planners see it.

  Attributes:
    x: the local block's shape and dtype once its matrix axes over other
      mesh axes are made whole (``fsdp.whole_shape``): a planner reads
      these; its tasks' inputs are set by the caller.
    view: its ``MatrixView`` (global shape).
    tp_dim: the matrix axis split over the tensor-parallel axis, or None.
    index: its place among the leaves (a task's ``owners``).
    replicated: whether its batch axes are replicated over
      ``distribute_over`` (the layer-wise split applies).
  """

  x: jax.ShapeDtypeStruct
  view: layout.MatrixView
  tp_dim: int | None
  index: int
  replicated: bool

  def solve(self, solves: "Solves", prenormalized: bool = False) -> Solve:
    """Its stacks split over ``tp.distribute_over`` where its batch axes
    are replicated there (and that axis is set), else solved here; for
    matrices normalized before (``duplicated``) with ``prenormalized``."""
    if self.replicated:
      return (
        solves.replicated_prenormalized if prenormalized else solves.replicated
      )
    return solves.local_prenormalized if prenormalized else solves.local


class Solves(NamedTuple):
  """The solves of one orthogonalization under ``tp``, built once, so that
  the tasks of one wave that share one run together.

  Attributes:
    solver: how each matrix is solved.
    local: stacks of whole matrices, here.
    replicated: the same, the stacks split over ``tp.distribute_over``
      (``local`` without it).
    distributed: matrices whose columns are split over ``tp.axis``.
    local_prenormalized, replicated_prenormalized: ``local`` and
      ``replicated`` for matrices normalized before (``duplicated``).
  """

  solver: batched.Solver
  local: Solve
  replicated: Solve
  distributed: Solve
  local_prenormalized: Solve
  replicated_prenormalized: Solve

  @classmethod
  def of(cls, solver: batched.Solver, tp: TensorParallel) -> "Solves":
    stacks = functools.partial(batched.orthogonalize_matrices, solver=solver)
    over = tp.distribute_over
    prenormalized = functools.partial(
      batched.orthogonalize_matrices, solver=solver.prenormalized()
    )
    return cls(
      solver,
      stacks,
      functools.partial(stacks, distribute_axis=over) if over else stacks,
      functools.partial(
        batched.orthogonalize_split_columns, solver=solver, axis_name=tp.axis
      ),
      prenormalized,
      functools.partial(prenormalized, distribute_axis=over)
      if over
      else prenormalized,
    )
