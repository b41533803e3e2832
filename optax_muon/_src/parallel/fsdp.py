"""FSDP × TP: a matrix axis sharded over a mesh axis other than the
tensor-parallel one is made whole for Newton–Schulz and given back after.

A stack (scanned layers, experts) is shared out over that axis by one
all-to-all, so that each of its ranks orthogonalizes whole matrices of its
share of the stack and no two do the same matrix (Megatron's layer-wise
distributed optimizer, with FSDP); a leaf with no stack to share is
gathered, and every rank of the axis repeats its work (see ``FsdpMove``).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

from optax_muon._src.parallel.tensor_parallel import TensorParallel
from optax_muon._src.parallel.tensor_parallel import own_chunk
from optax_muon._src.views import layout


@dataclasses.dataclass(frozen=True)
class FsdpMove:
  """How a matrix axis sharded over a mesh axis other than the
  tensor-parallel one (FSDP) is made whole for Newton–Schulz.

  With a ``home`` (a batch axis: the layers of a scanned stack, the experts)
  one all-to-all over ``name`` trades the matrix axis's split for a split of
  the batch axis, so each rank of ``name`` holds whole matrices of 1/N of
  the stack, orthogonalizes only those, and a second all-to-all hands the
  results back: the bytes of the shard twice, not N−1 times, and 1/N of the
  work (over two ranks: twice a gather's bytes, for half the work). A stack
  that ``name`` does not divide is padded with zero matrices first (80
  layers over 64 ranks: two a rank, 3.2 shards moved where a gather moves
  63). Without a home (no batch axis, or one so short that sharing it would
  not cut the work or would move more than a gather) the axis is
  all-gathered and every rank of ``name`` repeats the work.

  Attributes:
    name: the mesh axis.
    dim: the matrix axis split over it.
    home: the batch axis the all-to-all splits instead, or None.
    length: the home's local length before the move.
    padded: that length padded to a multiple of the axis size.
  """

  name: str
  dim: int
  home: int | None = None
  length: int = 0
  padded: int = 0


def _home_for(local: list[int], batch_axes, size: int) -> int | None:
  """The batch axis to share out over ``size`` ranks (one the ranks divide,
  else the longest), or None: where sharing would not cut each rank's
  matrices, or its two all-to-alls (padding included) would move more than
  a gather's ``size − 1`` shards and more than two (the least they move)."""
  if not batch_axes:
    return None
  home = max(batch_axes, key=lambda b: (local[b] % size == 0, local[b]))
  length = local[home]
  padded = -(-length // size) * size
  fewer = padded // size < length
  moved = 2 * padded / length  # in shards
  return home if fewer and moved <= max(2, size - 1) else None


def moves(view: layout.MatrixView, spec, tp: TensorParallel) -> list:
  """Each ``FsdpMove`` of a leaf (global ``view``, normalized ``spec``), in
  the order they apply (see ``FsdpMove``: a batch axis the mesh axis
  divides is preferred, then the longest)."""
  local = [
    size // math.prod(tp.bound_mesh.shape[n] for n in names)
    for size, names in zip(view.shape, spec)
  ]
  moves = []
  for dim in view.reduction_axes + view.output_axes:
    for name in spec[dim]:
      if name == tp.axis:
        continue
      if len(spec[dim]) > 1:
        raise ValueError(
          f"a matrix axis sharded over {spec[dim]} together is not "
          "supported; shard it over the tensor-parallel axis alone"
        )
      size = tp.bound_mesh.shape[name]
      home = _home_for(local, view.batch_axes, size)
      if home is None:
        moves.append(FsdpMove(name, dim))
        continue
      padded = -(-local[home] // size) * size
      moves.append(FsdpMove(name, dim, home, local[home], padded))
      local[home] = padded // size
  return moves


def splits_over_data(view: layout.MatrixView, spec, tp: TensorParallel) -> bool:
  """Whether ``distribute_over`` splits the leaf's matrices: only a stack
  replicated over it (one sharded over it, or homed there by
  ``moves``, is split already)."""
  data = tp.distribute_over
  return (
    data is not None
    and not any(data in spec[d] for d in view.batch_axes)
    and not any(
      m.home is not None and m.name == data for m in moves(view, spec, tp)
    )
  )


def local_count(view: layout.MatrixView, spec, tp: TensorParallel) -> int:
  """The matrices of a leaf one device orthogonalizes once ``moves``
  applied (zero padding included)."""
  local = {
    a: view.shape[a] // math.prod(tp.bound_mesh.shape[n] for n in spec[a])
    for a in view.batch_axes
  }
  for move in moves(view, spec, tp):
    if move.home is not None:
      local[move.home] = move.padded // tp.bound_mesh.shape[move.name]
  return math.prod(local.values())


def make_whole(x, plan: list[FsdpMove]):
  """``x`` with its matrix axes whole over every mesh axis but the
  tensor-parallel one: an all-to-all onto a home, else an all-gather."""
  for move in plan:
    if move.home is None:
      x = jax.lax.all_gather(x, move.name, axis=move.dim, tiled=True)
      continue
    if move.padded > move.length:  # zero matrices: Newton–Schulz keeps 0
      pad = [(0, 0)] * x.ndim
      pad[move.home] = (0, move.padded - move.length)
      x = jnp.pad(x, pad)
    x = jax.lax.all_to_all(x, move.name, move.home, move.dim, tiled=True)
  return x


def give_back(x, plan: list[FsdpMove]):
  """``make_whole`` undone: each rank's own block of the result."""
  for move in reversed(plan):
    if move.home is None:
      x = own_chunk(x, move.name, move.dim)
      continue
    x = jax.lax.all_to_all(x, move.name, move.dim, move.home, tiled=True)
    x = jax.lax.slice_in_dim(x, 0, move.length, axis=move.home)
  return x
