"""``allgather``: the matrices of one shape once turned wide (each layer of a
scanned stack, each expert, each per-layer leaf) are stacked and re-laid out
with one all-to-all so that each rank holds whole matrices, orthogonalizes
its share, and a second all-to-all puts them back: an 80-layer stack at TP 8
sends 10 layers to each rank. A group with fewer matrices than ranks is
padded with zero matrices when that moves fewer bytes than gathering each
one (3 or more), else it is ``duplicated`` (``shares_out``)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from optax_muon._src.parallel import duplicated
from optax_muon._src.parallel import rates as rates_lib
from optax_muon._src.parallel import waves
from optax_muon._src.parallel.leaves import Leaf
from optax_muon._src.parallel.leaves import Solves
from optax_muon._src.parallel.tensor_parallel import TensorParallel


def shares_out(members: int, ranks: int) -> bool:
  """Whether ``allgather`` sends a group through two all-to-alls.

  A group of ``k`` same-shape matrices is padded with zero matrices to a
  multiple ``P`` of the ``N`` ranks; per device, its two all-to-alls move
  ``2·P·S(N−1)/N²`` bytes for matrices of ``S`` bytes, all-gathering each
  member (``duplicated``) ``k·S(N−1)/N``, and each rank orthogonalizes
  ``P/N`` matrices instead of ``k``. So ``k ≥ N`` always shares out (no more
  bytes, less work), and a smaller group when it moves fewer bytes: ``2 < k``,
  three or more members.
  """
  return members >= min(ranks, 3)


@dataclasses.dataclass
class WideMember:
  """A leaf of an ``allgather`` group, seen with its axes ordered ``(batch,
  rows, columns)``, ``rows ≤ columns``, so that leaves whose matrices are
  each other's transposes (an MLP's up and down kernels) group together. The
  reordering is applied to each part a task reads, never to the whole leaf."""

  leaf: Leaf
  axis: int | None
  slice: waves.Slice | None = None  # of the leaf, where it is one

  def __post_init__(self):
    self.x, self.view, self.tp_dim = (
      self.leaf.x,
      self.leaf.view,
      self.leaf.tp_dim,
    )
    v = self.view
    rows, cols = v.reduction_axes, v.output_axes
    if v.fan_in > v.fan_out:
      rows, cols = cols, rows
    self.order = v.batch_axes + rows + cols
    self.rows = math.prod(self.x.shape[a] for a in rows)
    self.cols = math.prod(self.x.shape[a] for a in cols)
    self.wide_tp_dim = 1 + (self.tp_dim not in rows)  # of (items, rows, cols)
    # the sharded side of the whole matrix is tp.size times the local one
    self.items = math.prod(self.x.shape[a] for a in v.batch_axes)

  @property
  def key(self):
    return (self.rows, self.cols, self.x.dtype, self.wide_tp_dim)

  def whole_bytes(self, ranks: int, count: int = 1) -> int:
    """``newton_schulz_bytes`` of ``count`` whole matrices: the sharded
    side ``ranks`` times the local one."""
    rows, cols = self.rows, self.cols
    if self.wide_tp_dim == 1:
      rows *= ranks
    else:
      cols *= ranks
    return waves.newton_schulz_bytes(rows, cols, count, self.x.dtype.itemsize)

  def wide_items(self, part: jax.Array) -> jax.Array:
    """``part`` as ``(items, rows, cols)``."""
    return jnp.transpose(part, self.order).reshape(-1, self.rows, self.cols)

  def unwide(self, items: jax.Array, shape) -> jax.Array:
    """Inverse of ``wide_items`` for a part of ``shape``."""
    wide_shape = tuple(shape[a] for a in self.order)
    inverse = tuple(sorted(range(len(self.order)), key=self.order.__getitem__))
    return jnp.transpose(items.reshape(wide_shape), inverse)


def _pieces(items: int, ranks: int, free_size: int) -> int:
  """How many pieces each matrix is cut into along its free (not sharded)
  side for an all-to-all: two when each rank would receive a single matrix
  (the TPU compiler takes minutes over an all-to-all of one-item chunks, and
  under a second over two-item ones), else one."""
  return 2 if items == ranks and free_size % 2 == 0 else 1


def _split_free(x: jax.Array, free: int, pieces: int) -> jax.Array:
  """``(n, r, c)`` → ``(n·pieces, ...)``: each matrix cut along axis
  ``free`` (1 rows, 2 columns), its pieces consecutive."""
  if pieces == 1:
    return x
  n, r, c = x.shape
  if free == 1:
    return x.reshape(n * pieces, r // pieces, c)
  x = x.reshape(n, r, pieces, c // pieces).transpose(0, 2, 1, 3)
  return x.reshape(n * pieces, r, c // pieces)


def _join_free(x: jax.Array, free: int, pieces: int) -> jax.Array:
  """Inverse of ``_split_free``."""
  if pieces == 1:
    return x
  n, a, b = x.shape
  x = x.reshape(n // pieces, pieces, a, b)
  if free == 1:
    return x.reshape(n // pieces, pieces * a, b)
  return x.transpose(0, 2, 1, 3).reshape(n // pieces, a, pieces * b)


def _to_ranks(x: jax.Array, split_axis: int, ranks: int) -> jax.Array:
  """``x`` with axis ``split_axis`` cut into ``ranks`` chunks, the chunks
  along a new leading axis (a reshape, not copies of the chunks)."""
  shape = x.shape
  chunked = x.reshape(
    shape[:split_axis]
    + (ranks, shape[split_axis] // ranks)
    + shape[split_axis + 1 :]
  )
  return jnp.moveaxis(chunked, split_axis, 0)


def _from_ranks(received: jax.Array, concat_axis: int) -> jax.Array:
  """Inverse of ``_to_ranks`` for the chunks received from each rank,
  joined along ``concat_axis``."""
  merged = jnp.moveaxis(received, 0, concat_axis)
  out = list(merged.shape)
  out[concat_axis : concat_axis + 2] = [out[concat_axis] * out[concat_axis + 1]]
  return merged.reshape(out)


def _exchange(payloads: list[jax.Array], axis_name) -> list[jax.Array]:
  """Each ``(ranks, ...)`` payload's chunk ``j`` sent to rank ``j``, and
  what each rank sent received in its place: one all-to-all for all of them
  (flattened and put side by side) where they share a dtype.

  One all-to-all along a leading axis of the ranks, not the tiled form over
  the arrays' own axes: XLA's CPU compiler rejects that when one all-to-all
  moves blocks of differently laid out stacks (an MLP's up and down kernels
  under FSDP on a (4, 2) mesh: "operands with different shapes")."""
  if len(payloads) == 1:  # as it is: the TPU compiler takes minutes over
    # an all-to-all of one-item chunks (see ``_pieces``)
    return [jax.lax.all_to_all(payloads[0], axis_name, 0, 0)]
  if len({p.dtype for p in payloads}) > 1:
    return [_exchange([p], axis_name)[0] for p in payloads]
  flat = [p.reshape(p.shape[0], -1) for p in payloads]
  received = jax.lax.all_to_all(jnp.concatenate(flat, axis=1), axis_name, 0, 0)
  bounds = np.cumsum([f.shape[1] for f in flat])[:-1]
  return [
    r.reshape(p.shape)
    for r, p in zip(jnp.split(received, bounds, axis=1), payloads)
  ]


@dataclasses.dataclass(frozen=True)
class _Relayout:
  """A stack ``(P, r, c)`` of local shards, split along ``tp_dim`` (1 or 2)
  over the ``P`` ranks' matrices, re-laid out so that each rank holds its
  ``P/N`` whole matrices (``to_whole``), and back (``to_shards``): each one
  all-to-all, in two halves (``send_*``, ``receive_*``) so that one
  all-to-all may carry a part each way (``_exchange``)."""

  ranks: int
  tp_dim: int

  @property
  def free(self) -> int:
    return 3 - self.tp_dim

  def send_whole(self, stack: jax.Array) -> jax.Array:
    pieces = _pieces(stack.shape[0], self.ranks, stack.shape[self.free])
    return _to_ranks(_split_free(stack, self.free, pieces), 0, self.ranks)

  def receive_whole(self, received: jax.Array, count: int) -> jax.Array:
    """``count``: the stack's length (``P``)."""
    whole = _from_ranks(received, self.tp_dim)
    pieces = _pieces(count, self.ranks, whole.shape[self.free])
    return _join_free(whole, self.free, pieces)

  def send_shards(self, whole: jax.Array) -> jax.Array:
    pieces = self.pieces_back(whole)
    return _to_ranks(
      _split_free(whole, self.free, pieces), self.tp_dim, self.ranks
    )

  def receive_shards(self, received: jax.Array, pieces: int) -> jax.Array:
    return _join_free(_from_ranks(received, 0), self.free, pieces)

  def pieces_back(self, whole: jax.Array) -> int:
    return _pieces(
      whole.shape[0] * self.ranks, self.ranks, whole.shape[self.free]
    )


def pipelines(tp: TensorParallel) -> bool:
  """Whether a split stack's parts run pipelined (``waves``): a part's
  all-to-all and the last one's back, as one, under the Newton–Schulz
  between them. On an H100-8 compile of Llama-3-70B's stacks that hides 80 %
  of the all-to-alls' time, none before. Not on TPUs: the TPU compiler runs
  these collectives synchronously, so there is nothing to hide them under,
  and it took over 5 minutes over the pipelined loop of Llama-3-8B's stacks
  where it takes 6 s over the plain one (jax 0.12.0.1, v5p-8)."""
  return not rates_lib.device_kind(tp.mesh).startswith("TPU")


def _allgather_unit(member: WideMember, ranks: int) -> int:
  """Slices of the member's split axis whose matrices fill whole matrices for
  every rank (no zero padding in an all-to-all)."""
  if member.axis is None:
    return 1
  per_slice = member.items // member.x.shape[member.axis]
  return ranks // math.gcd(ranks, per_slice)


def _task(
  members: list[WideMember], tp: TensorParallel, solves: Solves, unit: int = 0
) -> waves.Task:
  """Local shards of ``members``' matrices stacked, re-laid out by one
  all-to-all so that each rank holds whole matrices, and sent back.
  ``unit``: 0 for a task that runs whole, else the waves may split it
  along its members' batch axis (the same axis, of the same length, in
  each) in parts of preferably a multiple of ``unit`` slices."""
  first = members[0]
  items = sum(m.items for m in members)
  per_rank = -(-items // tp.size)
  itemsize = first.x.dtype.itemsize

  relayout = _Relayout(tp.size, first.wide_tp_dim)

  def send(inputs):
    stack = jnp.concatenate([m.wide_items(x) for m, x in zip(members, inputs)])
    count = stack.shape[0]
    padded = -(-count // tp.size) * tp.size
    stack = jnp.pad(stack, ((0, padded - count), (0, 0), (0, 0)))
    context = (count, padded, [x.shape for x in inputs])
    return relayout.send_whole(stack), context

  def received(whole, context):
    return [relayout.receive_whole(whole, context[1])], context

  def restored(shards, pieces, context):
    count, _, shapes = context
    back = relayout.receive_shards(shards, pieces)[:count]
    outputs, start = [], 0
    for member, shape in zip(members, shapes):
      n = math.prod(shape[a] for a in member.view.batch_axes)
      outputs.append(member.unwide(back[start : start + n], shape))
      start += n
    return outputs

  def prepare(inputs):
    payload, context = send(inputs)
    (whole,) = _exchange([payload], tp.axis)
    return received(whole, context)

  def restore(ms, context):
    (done,) = ms
    (shards,) = _exchange([relayout.send_shards(done)], tp.axis)
    return restored(shards, relayout.pieces_back(done), context)

  def prepare_and_restore(inputs, ms, context):
    """The next part's all-to-all and the last one's back as one."""
    (done,) = ms
    payload, next_context = send(inputs)
    whole, shards = _exchange([payload, relayout.send_shards(done)], tp.axis)
    outputs = restored(shards, relayout.pieces_back(done), context)
    return received(whole, next_context), outputs

  return waves.Task(
    [m.x for m in members],
    prepare,
    restore,
    solves.replicated
    if all(m.leaf.replicated for m in members)
    else solves.local,
    first.whole_bytes(tp.size, per_rank)
    + 2 * itemsize * first.rows * first.cols * per_rank * tp.size,
    first.axis if unit else None,
    unit or 1,
    owners=tuple(m.leaf.index for m in members),
    pipelined=pipelines(tp),
    prepare_and_restore=prepare_and_restore,
    slices=tuple(m.slice for m in members),
  )


def _splits_alone(member: WideMember, quota: int) -> bool:
  """Whether a member is a stack the waves split alone: two parts of
  ``quota`` matrices or more."""
  return member.axis is not None and member.items >= 2 * quota


def _sliced(member: WideMember, axis: int, start: int, stop: int) -> WideMember:
  """Slices ``[start, stop)`` of a member stacked along ``axis``, as a
  member."""
  shape = list(member.x.shape)
  shape[axis] = stop - start
  leaf = dataclasses.replace(
    member.leaf, x=jax.ShapeDtypeStruct(tuple(shape), member.x.dtype)
  )
  return WideMember(leaf, axis, waves.Slice(axis, start, stop))


def head_and_rest(
  member: WideMember, ranks: int
) -> tuple[WideMember, WideMember] | None:
  """A stack that leaves a remainder over the ranks, cut into its head, the
  slices that fill whole matrices for every rank, and the rest; None where
  there is no such cut. Alone, 10 layers on 8 ranks are 2 matrices a rank,
  the second mostly zero padding; its head is 1 a rank, and the rests of a
  group's stacks are pooled (``_tasks``): three such stacks, 3 + 1."""
  axis = member.axis
  if axis is None or member.slice is not None:
    return None
  count = member.x.shape[axis]
  unit = _allgather_unit(member, ranks)
  head = count // unit * unit
  if head in (0, count):
    return None
  return _sliced(member, axis, 0, head), _sliced(member, axis, head, count)


def _tasks(
  members: list[WideMember], tp: TensorParallel, budget: int, solves: Solves
) -> list[waves.Task]:
  """One task for the group when it fits the budget; else each stack the
  waves split alone a task of its own; stacks too large to pool whole that
  leave a remainder over the ranks cut into their heads, each a task, and
  their rests (``head_and_rest``: where two or more are, so that the rests
  pool together); and the rest pooled, in tasks of about one budget's worth
  of whole matrices per rank.

  Compiled for Llama-3-70B at FSDP 8 × TP 8 (10 layers of the MLP's three
  stacks a data rank; jax 0.12.0.1, ``benchmarks/at_scale.py``), the
  program then runs the Newton–Schulz the cost model counts, 242.4 TFLOP a
  chip: on v5p-64, where each stack ran alone (2 matrices a rank), it ran
  330.4, at 4.35 GiB of temporaries, now 4.64; on H100-64, where the three
  were split together along their layers (2 + 2 a rank, pipelined), the
  temporaries fall 5.50 → 3.13 GiB (1 matrix a rank at a time)."""
  whole = _task(members, tp, solves)
  if whole.bytes <= budget:
    return [whole]
  per_matrix = members[0].whole_bytes(tp.size)
  quota = max(1, budget // per_matrix) * tp.size  # matrices per part
  cuts = {}
  for place, member in enumerate(members):
    if not _splits_alone(member, quota) and member.items > quota:
      cut = head_and_rest(member, tp.size)
      if cut is not None:
        cuts[place] = cut
  if len(cuts) < 2:  # a rest alone takes as many matrices a rank as before
    cuts = {}
  tasks: list[waves.Task] = []
  pool: list[WideMember] = []
  pooled = 0
  for place, member in enumerate(members):
    if _splits_alone(member, quota):
      unit = _allgather_unit(member, tp.size)
      tasks.append(_task([member], tp, solves, unit))
      continue
    if place in cuts:
      head, member = cuts[place]
      tasks.append(_task([head], tp, solves))
    if pool and pooled + member.items > quota:
      tasks.append(_task(pool, tp, solves))
      pool, pooled = [], 0
    pool.append(member)
    pooled += member.items
  if pool:
    tasks.append(_task(pool, tp, solves))
  return tasks


def plan(
  leaves: list[Leaf], tp: TensorParallel, budget: int, solves: Solves
) -> list[waves.Task]:
  """The leaves grouped by the shape of their matrices once turned wide; a
  group that shares out (``shares_out``) goes through the all-to-alls, in
  parts within ``budget``; the others are ``duplicated``."""
  groups: dict[tuple, list[WideMember]] = {}
  for leaf in leaves:
    member = WideMember(leaf, waves.split_axis(leaf.view, leaf.x.shape))
    groups.setdefault(member.key, []).append(member)
  tasks: list[waves.Task] = []
  for members in groups.values():
    if shares_out(sum(m.items for m in members), tp.size):
      tasks += _tasks(members, tp, budget, solves)
    else:
      tasks += [duplicated.task(m.leaf, tp, solves) for m in members]
  return tasks
