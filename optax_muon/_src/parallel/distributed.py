"""``distributed``: the shard stays; its sharded side becomes the columns,
so the Gram matrix ``X Xᵀ`` of each Newton–Schulz step is a sum over the
ranks (one all-reduce a step, plus the normalization's max and norm)."""

import math

import jax.numpy as jnp

from optax_muon._src.parallel import waves
from optax_muon._src.parallel.leaves import Leaf
from optax_muon._src.parallel.leaves import Solves
from optax_muon._src.parallel.tensor_parallel import TensorParallel
from optax_muon._src.parallel.tensor_parallel import local_view


def task(leaf: Leaf, tp: TensorParallel, solves: Solves) -> waves.Task:
  x, view, tp_dim = leaf.x, leaf.view, leaf.tp_dim
  fan_in_sharded = tp_dim in view.reduction_axes
  turn = lambda ms: [
    jnp.swapaxes(m, -1, -2) if fan_in_sharded else m for m in ms
  ]

  def prepare(inputs):
    part_view = local_view(view, inputs[0].shape)
    return turn(part_view.to_matrices(inputs[0])), part_view

  local = local_view(view, x.shape)
  count = math.prod(local.batch_shape)
  unsharded = local.fan_out if fan_in_sharded else local.fan_in
  return waves.Task(
    [x],
    prepare,
    lambda ms, v: [v.from_matrices(turn(ms))],
    solves.distributed,
    waves.newton_schulz_bytes(
      local.fan_in, local.fan_out, count, x.dtype.itemsize, unsharded
    ),
    waves.split_axis(view, x.shape),
    owners=(leaf.index,),
  )


def plan(
  leaves: list[Leaf], tp: TensorParallel, budget: int, solves: Solves
) -> list[waves.Task]:
  """One task per leaf."""
  del budget
  return [task(leaf, tp, solves) for leaf in leaves]
