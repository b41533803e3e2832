"""``blockwise``: each rank orthogonalizes its local block as a matrix of its
own; no communication. Also every leaf not split over the tensor-parallel
axis, in any mode."""

from optax_muon._src.parallel import waves
from optax_muon._src.parallel.leaves import Leaf
from optax_muon._src.parallel.leaves import Solves
from optax_muon._src.parallel.tensor_parallel import TensorParallel
from optax_muon._src.parallel.tensor_parallel import local_view


def plan(
  leaves: list[Leaf], tp: TensorParallel, budget: int, solves: Solves
) -> list[waves.Task]:
  """One task per leaf: its local matrices, as they are."""
  del tp, budget
  return [
    waves.view_task(
      leaf.x,
      lambda shape, view=leaf.view: local_view(view, shape),
      leaf.solve(solves),
      leaf.index,
    )
    for leaf in leaves
  ]
