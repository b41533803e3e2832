"""``duplicated``: each rank all-gathers the shard, orthogonalizes the full
matrix and keeps its own chunk (one all-gather per matrix)."""

import jax

from optax_muon._src.parallel import waves
from optax_muon._src.parallel.tensor_parallel import Leaf
from optax_muon._src.parallel.tensor_parallel import TensorParallel
from optax_muon._src.parallel.tensor_parallel import local_view
from optax_muon._src.parallel.tensor_parallel import own_chunk


def task(leaf: Leaf, tp: TensorParallel) -> waves.Task:
  """Gather the shard, orthogonalize the full matrix, keep this chunk."""
  x, view, tp_dim = leaf.x, leaf.view, leaf.tp_dim
  assert tp_dim is not None, "a duplicated leaf is split over the TP axis"
  full_shape = list(x.shape)
  full_shape[tp_dim] *= tp.size

  def prepare(inputs):
    full = jax.lax.all_gather(inputs[0], tp.axis, axis=tp_dim, tiled=True)
    full_view = local_view(view, full.shape)
    return full_view.to_matrices(full), full_view

  return waves.Task(
    [x],
    prepare,
    lambda ms, v: [own_chunk(v.from_matrices(ms), tp.axis, tp_dim)],
    lambda outputs: leaf.finish(outputs[0]),
    leaf.solver(tp),
    waves.view_bytes(local_view(view, full_shape), x.dtype.itemsize),
    waves.split_axis(view, x.shape),
  )


def plan(
  leaves: list[Leaf], tp: TensorParallel, budget: int
) -> list[waves.Task]:
  """One task per leaf."""
  del budget
  return [task(leaf, tp) for leaf in leaves]
