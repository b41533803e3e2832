"""``duplicated``: each rank all-gathers the shard, orthogonalizes the full
matrix and keeps its own chunk (one all-gather per matrix, after two scalar
all-reduces: its normalization from the shards)."""

import jax

from optax_muon._src.kernels import newton_schulz as ns
from optax_muon._src.kernels.matrices import working_dtype
from optax_muon._src.parallel import waves
from optax_muon._src.parallel.leaves import Leaf
from optax_muon._src.parallel.leaves import Solves
from optax_muon._src.parallel.tensor_parallel import TensorParallel
from optax_muon._src.parallel.tensor_parallel import local_view
from optax_muon._src.parallel.tensor_parallel import own_chunk


def task(leaf: Leaf, tp: TensorParallel, solves: Solves) -> waves.Task:
  """Gather the shard, orthogonalize the full matrix, keep this chunk.

  Where the solver's normalization can be computed from blocks, it is: the
  largest magnitude and the norm of each matrix are reduced from the shards
  as scalars before the gather, and the gathered matrix is only scaled, so
  it is used once (a compiler short of memory otherwise re-gathers it for
  each of the normalization's reductions: XLA's GPU rematerialization did,
  3× the bytes at Llama-3-70B on 8 H100s).
  """
  x, view, tp_dim = leaf.x, leaf.view, leaf.tp_dim
  assert tp_dim is not None, "a duplicated leaf is split over the TP axis"
  full_shape = list(x.shape)
  full_shape[tp_dim] *= tp.size
  # the solver whose normalization is done here, from the shards, or None
  solver = solves.solver
  normalizing = (
    solver if solver.normalizes_from_blocks and not view.widths else None
  )

  def prepare(inputs):
    if normalizing is not None:
      (block,) = local_view(view, inputs[0].shape).to_matrices(inputs[0])
      block = block.astype(working_dtype(block.dtype))
      peak, norm = ns.frobenius_divisors(block, normalizing.eps, tp.axis)
    full = jax.lax.all_gather(inputs[0], tp.axis, axis=tp_dim, tiled=True)
    full_view = local_view(view, full.shape)
    matrices = full_view.to_matrices(full)
    if normalizing is not None:
      (matrix,) = matrices
      matrices = [matrix.astype(working_dtype(matrix.dtype)) / peak / norm]
    return matrices, full_view

  def restore(matrices, full_view):
    out = own_chunk(full_view.from_matrices(matrices), tp.axis, tp_dim)
    return [out.astype(x.dtype)]

  return waves.Task(
    [x],
    prepare,
    restore,
    leaf.solve(solves, prenormalized=normalizing is not None),
    waves.view_bytes(local_view(view, full_shape), x.dtype.itemsize),
    waves.split_axis(view, x.shape),
    owners=(leaf.index,),
  )


def plan(
  leaves: list[Leaf],
  tp: TensorParallel,
  budget: int,
  solves: Solves,
) -> list[waves.Task]:
  """One task per leaf."""
  del budget
  return [task(leaf, tp, solves) for leaf in leaves]
