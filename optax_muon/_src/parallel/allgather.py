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


def _pipelines(tp: TensorParallel) -> bool:
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
    pipelined=_pipelines(tp),
    prepare_and_restore=prepare_and_restore,
  )


def merged_part(
  slice_items: int, count: int, ranks: int, peak: int
) -> tuple[int, int] | None:
  """How to split one task over stacks of ``count`` slices, ``slice_items``
  matrices in a slice of all of them: ``(part, per_rank)``, the part size
  (in slices; a shorter last part where it does not divide ``count``) that
  leaves each rank the fewest matrices to orthogonalize in all
  (``per_rank``), the largest such, with at most ``peak`` matrices a rank
  in any part; None where a single slice already exceeds ``peak``.

  Each part is padded to a multiple of the ranks, so stacks that each leave
  a remainder (10 layers on 8 ranks: 2 matrices a rank, one of them
  mostly padding) are better split together: three such stacks in parts of
  5 slices are 2 + 2 matrices a rank, where alone they are 2 + 2 + 2."""
  best = None
  for part in range(1, count + 1):
    per_part = -(-slice_items * part // ranks)
    if per_part > peak:
      break
    full, rest = divmod(count, part)
    total = full * per_part + -(-slice_items * rest // ranks)
    if best is None or total <= best[1]:
      best = (part, total)
  return best


def _splits_alone(member: WideMember, quota: int) -> bool:
  """Whether a member is a stack the waves split alone: two parts of
  ``quota`` matrices or more."""
  return member.axis is not None and member.items >= 2 * quota


def _merged(
  members: list[WideMember], quota: int, tp: TensorParallel, solves: Solves
) -> list[tuple[list[int], waves.Task]]:
  """Tasks over the stacked members that would each run whole (not
  ``_splits_alone``) split together along their common batch axis
  (``merged_part``), where that leaves each rank fewer matrices, no more at
  a time: each with its members' places in ``members``.

  Only where the parts are pipelined (``_pipelines``: not on TPUs).
  Compiled for Llama-3-70B at FSDP 8 × TP 8 (10 layers a data rank, the MLP's
  three stacks merged; jax 0.12.0.1), each chip's all-to-alls fall from
  10.33 to 8.58 GiB on H100-64 and on v5p-64 alike, and on H100-64 its
  Newton–Schulz from 330.4 to 242.4 TFLOP (read from the program) and its
  temporaries 5.75 → 5.50 GiB; on v5p-64 the temporaries rise 4.35 → 8.28
  GiB instead: its loop over the parts, not pipelined, keeps the three
  stacks' inputs and results live together, where each task alone holds
  only its own."""
  if not _pipelines(tp):
    return []
  stacks: dict[tuple[int, int], list[int]] = {}
  for place, member in enumerate(members):
    if member.axis is not None and not _splits_alone(member, quota):
      key = (member.axis, member.x.shape[member.axis])
      stacks.setdefault(key, []).append(place)
  tasks = []
  for (_, count), places in stacks.items():
    if len(places) < 2:
      continue
    group = [members[p] for p in places]
    alone = [-(-m.items // tp.size) for m in group]
    split = merged_part(
      sum(m.items // count for m in group), count, tp.size, max(alone)
    )
    if split and split[1] < sum(alone):
      tasks.append((places, _task(group, tp, solves, unit=split[0])))
  return tasks


def _tasks(
  members: list[WideMember], tp: TensorParallel, budget: int, solves: Solves
) -> list[waves.Task]:
  """One task for the group when it fits the budget; else each stacked
  member alone (split by the waves), stacks that would each run whole
  split together where that leaves each rank fewer matrices (``_merged``),
  and the others in parts of about one budget's worth of whole matrices
  per rank."""
  whole = _task(members, tp, solves)
  if whole.bytes <= budget:
    return [whole]
  per_matrix = members[0].whole_bytes(tp.size)
  quota = max(1, budget // per_matrix) * tp.size  # matrices per part
  merged = _merged(members, quota, tp, solves)
  first_of = {places[0]: task for places, task in merged}
  in_merged = {place for places, _ in merged for place in places}
  tasks: list[waves.Task] = []
  pool: list[WideMember] = []
  pooled = 0
  for place, member in enumerate(members):
    if place in first_of:
      tasks.append(first_of[place])
    if place in in_merged:
      continue
    if _splits_alone(member, quota):
      unit = _allgather_unit(member, tp.size)
      tasks.append(_task([member], tp, solves, unit))
      continue
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
