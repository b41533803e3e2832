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
    ranks: the axis size.
  """

  name: str
  dim: int
  home: int | None = None
  length: int = 0
  padded: int = 0
  ranks: int = 1

  @property
  def slots(self) -> int:
    """The home's local length once moved."""
    return self.padded // self.ranks


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
        moves.append(FsdpMove(name, dim, ranks=size))
        continue
      padded = -(-local[home] // size) * size
      moves.append(FsdpMove(name, dim, home, local[home], padded, size))
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


def whole_shape(shape, plan: list[FsdpMove]) -> tuple[int, ...]:
  """The shape ``make_whole`` gives a local block of ``shape``."""
  shape = list(shape)
  for move in plan:
    shape[move.dim] *= move.ranks
    if move.home is not None:
      shape[move.home] = move.slots
  return tuple(shape)


def make_whole(x, plan: list[FsdpMove]):
  """``x`` with its matrix axes whole over every mesh axis but the
  tensor-parallel one: an all-to-all onto a home, else an all-gather."""
  for move in plan:
    if move.home is None:
      x = jax.lax.all_gather(x, move.name, axis=move.dim, tiled=True)
      continue
    x = _pad_home(x, move)
    x = jax.lax.all_to_all(x, move.name, move.home, move.dim, tiled=True)
  return x


def _pad_home(x, move: FsdpMove):
  """``x`` with its home axis padded to ``move.padded`` with zero matrices
  (Newton–Schulz keeps them 0)."""
  if move.home is None or move.padded == move.length:
    return x
  pad = [(0, 0)] * x.ndim
  pad[move.home] = (0, move.padded - move.length)
  return jnp.pad(x, pad)


def give_back(x, plan: list[FsdpMove]):
  """``make_whole`` undone: each rank's own block of the result."""
  for move in reversed(plan):
    if move.home is None:
      x = own_chunk(x, move.name, move.dim)
      continue
    x = jax.lax.all_to_all(x, move.name, move.dim, move.home, tiled=True)
    x = jax.lax.slice_in_dim(x, 0, move.length, axis=move.home)
  return x


@dataclasses.dataclass(frozen=True)
class InTask:
  """A leaf's ``FsdpMove``s made inside its task (``in_task``), a part at a
  time when the waves split it, so that a pipelined task moves the next
  part while the current one is in Newton–Schulz (and the moves stay
  within the memory budget). ``arrange`` lays a leaf-shaped array (the
  leaf, its state) out as the task reads it; ``unarrange`` undoes it.

  A task split along the home of its move reads the stack with its home
  axis cut into ``(ranks, slots)`` (``split_home``): part ``[a, a + p)`` of
  the slots is then every rank's share of those slots, one all-to-all."""

  plan: tuple[FsdpMove, ...]
  split_home: FsdpMove | None = None

  def arrange(self, x):
    move = self.split_home
    if move is None:
      return x
    shape = list(x.shape)
    shape[move.home : move.home + 1] = [move.ranks, move.slots]
    return _pad_home(x, move).reshape(shape)

  def unarrange(self, x):
    move = self.split_home
    if move is None:
      return x
    shape = list(x.shape)
    shape[move.home : move.home + 2] = [move.padded]
    return jax.lax.slice_in_dim(
      x.reshape(shape), 0, move.length, axis=move.home
    )

  def make_whole(self, x):
    move = self.split_home
    if move is None:
      return make_whole(x, list(self.plan))
    shape = list(x.shape)
    shape[move.home : move.home + 2] = [move.ranks * x.shape[move.home + 1]]
    return jax.lax.all_to_all(
      x.reshape(shape), move.name, move.home, move.dim, tiled=True
    )

  def give_back(self, x):
    move = self.split_home
    if move is None:
      return give_back(x, list(self.plan))
    x = jax.lax.all_to_all(x, move.name, move.dim, move.home, tiled=True)
    shape = list(x.shape)
    shape[move.home : move.home + 1] = [
      move.ranks,
      x.shape[move.home] // move.ranks,
    ]
    return x.reshape(shape)


def in_task(plans: list[list[FsdpMove]], split_axis: int | None, parts: int):
  """Each input's ``InTask`` for a task over leaves with ``plans`` (one per
  input) that the waves split into ``parts`` full parts along
  ``split_axis`` (0: run whole), or None where its leaves are made whole
  before the waves, as a whole stack.

  Only a task cut into two parts or more moves its leaves itself, a part at
  a time (a split along a home: ``split_home``, for a single input with
  that move alone), so that the budget bounds the moves too. A task run
  whole, or in one part and a shorter one, gains nothing from it: compiled
  so on an H100-64 (Llama-3-70B, FSDP 8 × TP 8, 10 layers a data rank)
  ``allgather``'s temp rose from 5.75 to 6.63 GiB."""
  if parts < 2:
    return None
  homes = [move for plan in plans for move in plan if move.home == split_axis]
  if not homes:
    return [InTask(tuple(plan)) for plan in plans]
  if len(plans) == 1 and plans[0] == homes:
    return [InTask(tuple(plans[0]), homes[0])]
  return None
