"""The memory budget: the orthogonalization run in waves, in program order.

Orthogonalizing a whole tree at once keeps every matrix's gathered input,
Newton–Schulz workspace and result live together; for a 70B model with
scanned layers that is hundreds of GiB per device. So the work is cut into
**tasks** (a leaf, a slice of a stacked leaf, or a group of leaves that are
orthogonalized together), each with an estimate of the bytes it keeps live,
and the tasks run in **waves** of at most ``memory_budget`` bytes:

* tasks that fit are packed into waves, in order; inside a wave same-shape
  matrices still run as one batched Newton–Schulz (``solve``);
* a task over a stack (scanned layers, experts: a batch axis of the leaf)
  that does not fit is split along that axis into equal parts (and a
  shorter last one where none divides it), run by a ``fori_loop`` that
  writes each part's result in place; a ``pipelined`` task's loop gathers
  the next part and gives the last one back while the current one is in
  Newton–Schulz;
* waves are ordered in the program itself: each wave's inputs pass through
  one ``optimization_barrier`` with the previous wave's results and depend
  on one of them (``_one_after``), so that a scheduler cannot start a wave
  before the previous one is done — where the compiler keeps that tie: the
  CPU's does; XLA's GPU compiler folds it (see ``_one_after``), and there
  the waves' order is its scheduler's;
* a single matrix larger than the budget runs alone; a tree that fits the
  budget is one wave, as if there were no budget.
"""

import dataclasses
import math
import numbers
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_muon._src.views import layout

# Measured (benchmarks/at_scale.py, docs/scaling.md): at 2 GiB a
# Llama-3-70B update with scanned layers at TP 8 fits a v5p chip in every
# tp_mode, and the example GPT's update is one wave (no change in speed).
DEFAULT_MEMORY_BUDGET = 2 << 30


def check_memory_budget(memory_budget, name: str = "memory_budget") -> None:
  """``None`` (the default budget) or a positive int of bytes per device."""
  if memory_budget is None:
    return
  if (
    isinstance(memory_budget, (bool, np.bool_))
    or not isinstance(memory_budget, numbers.Integral)
    or memory_budget < 1
  ):
    raise ValueError(
      f"{name} must be None (the default, {DEFAULT_MEMORY_BUDGET} bytes) or "
      f"a positive int of bytes per device, got {memory_budget!r}"
    )


def newton_schulz_bytes(
  m: int, n: int, count: int = 1, itemsize=4, gram_side: int | None = None
) -> int:
  """Bytes live while Newton–Schulz runs on ``count`` m×n matrices: input and
  result in their own dtype (``itemsize``), three fp32 iterates of the wide
  shape (``X``, ``B X``, the next ``X``) and three of the Gram shape (``A``,
  ``A A``, ``B``), of the short side or, for columns split over ranks
  (``distributed``), of ``gram_side``."""
  side = min(m, n) if gram_side is None else gram_side
  return count * (2 * itemsize * m * n + 12 * m * n + 12 * side * side)


Solve = Callable[[list[jax.Array]], list[jax.Array]]


class Slice(NamedTuple):
  """The run ``[start, stop)`` of a leaf's batch axis ``axis`` that a task
  reads (and writes), its other axes whole."""

  axis: int
  start: int
  stop: int

  def of(self, x: jax.Array) -> jax.Array:
    return jax.lax.slice_in_dim(x, self.start, self.stop, axis=self.axis)


@dataclasses.dataclass
class Task:
  """Orthogonalization work that runs as one piece of a wave; ``run``
  returns its outputs.

  Attributes:
    inputs: the arrays the task reads (a planner's tasks hold their
      leaves' ``ShapeDtypeStruct``s, which ``sharded`` replaces).
    prepare: ``inputs -> (matrices, context)``: the ``(batch, m, n)``
      matrices to orthogonalize (gathers and all-to-alls happen here).
    restore: ``(matrices, context) -> outputs``, one per input, each of its
      input's shape.
    solve: ``matrices -> matrices``, how they are orthogonalized (e.g.
      ``functools.partial(batched.orthogonalize_matrices, solver=...)``):
      the matrices of the tasks of one wave with the same ``solve`` run
      together, as one batched solve.
    bytes: the bytes the task keeps live.
    axis: a batch axis of every input along which the task may be split
      into equal parts (``None``: it cannot be split).
    unit: part sizes along ``axis`` preferably multiples of this.
    owners: the caller's indices of the leaves the outputs belong to, one
      per output (``()``: the caller keeps its own account).
    pipelined: whether its parts, when split, run pipelined (see
      ``_pipelined_parts``): for tasks whose ``prepare`` and ``restore``
      hold collectives that a scheduler can hide under the Newton–Schulz
      beside them.
    prepare_and_restore: ``(inputs, matrices, context) -> ((matrices,
      context), outputs)``: ``prepare`` of one part and ``restore`` of
      another at once, with one collective for both (a scheduler that runs
      one collective at a time then hides both); ``None``: the two
      called in turn.
    slices: per owner, the ``Slice`` of its leaf that the input and output
      are, or None (or no entry): the whole leaf. A leaf may be read in
      slices by several tasks; the caller puts its outputs together.
  """

  inputs: Sequence[Any]
  prepare: Callable[[Sequence[jax.Array]], tuple[list, Any]]
  restore: Callable[[list, Any], Sequence[jax.Array]]
  solve: Solve
  bytes: int
  axis: int | None = None
  unit: int = 1
  owners: tuple[int, ...] = ()
  pipelined: bool = False
  prepare_and_restore: Callable | None = None
  slices: tuple[Slice | None, ...] = ()

  def slice_of(self, place: int) -> Slice | None:
    """The slice of its ``place``-th owner's leaf the task reads, if any."""
    return self.slices[place] if place < len(self.slices) else None

  @property
  def count(self) -> int:
    return 1 if self.axis is None else self.inputs[0].shape[self.axis]


def view_bytes(view: layout.MatrixView, itemsize: int) -> int:
  """``newton_schulz_bytes`` of every matrix of ``view``."""
  count = math.prod(view.batch_shape)
  return sum(
    newton_schulz_bytes(m, n, count, itemsize) for m, n in view.matrix_shapes
  )


def split_axis(view: layout.MatrixView, shape) -> int | None:
  """The batch axis a task over a leaf of ``shape`` may be split along: the
  longest one (``None``: no batch axis longer than one)."""
  axes = [a for a in view.batch_axes if shape[a] > 1]
  return max(axes, key=lambda a: shape[a]) if axes else None


def view_task(x, view_of, solve: Solve, owner: int) -> Task:
  """``x`` (the caller's leaf ``owner``) orthogonalized by ``solve`` as the
  matrices of ``view_of(shape)``, for the shape of ``x`` or of any part of
  it along its split axis."""
  view = view_of(tuple(x.shape))

  def prepare(inputs):
    part_view = view_of(tuple(inputs[0].shape))
    return part_view.to_matrices(inputs[0]), part_view

  return Task(
    [x],
    prepare,
    lambda ms, v: [v.from_matrices(ms)],
    solve,
    view_bytes(view, jnp.dtype(x.dtype).itemsize),
    split_axis(view, x.shape),
    owners=(owner,),
  )


def with_state(task: Task, states, step) -> Task:
  """``task`` that first computes its inputs, each from its leaf's gradient
  and state, inside its own wave (a part at a time when split):
  ``step(g, state_arrays) -> (input, new_state_arrays)``. So a leaf's state
  is read (from host memory, or 8 bits) only in its wave, never all at once.
  Its outputs are ``task``'s, then each input's new state arrays in order
  (``split_states``).

  Args:
    task: a task whose inputs are the leaves' gradients.
    states: per input of ``task``, its leaf's state arrays (of the leaf's
      shape, or differing in the last axis only).
    step: the state's update (the momentum's).
  """
  own = len(task.inputs)
  counts = [len(arrays) for arrays in states]
  flat = [array for arrays in states for array in arrays]

  def stepped(inputs):
    rest = iter(inputs[own:])
    pairs = [
      step(x, [next(rest) for _ in range(n)])
      for x, n in zip(inputs[:own], counts)
    ]
    return [u for u, _ in pairs], [a for _, new in pairs for a in new]

  def prepare(inputs):
    updates, new_states = stepped(inputs)
    matrices, context = task.prepare(updates)
    return matrices, (context, new_states)

  def restore(matrices, context_and_states):
    context, new_states = context_and_states
    return [*task.restore(matrices, context), *new_states]

  def prepare_and_restore(inputs, matrices, context_and_states):
    updates, next_states = stepped(inputs)
    context, new_states = context_and_states
    (next_matrices, next_context), outputs = task.prepare_and_restore(
      updates, matrices, context
    )
    prepared = (next_matrices, (next_context, next_states))
    return prepared, [*outputs, *new_states]

  axis = task.axis
  if axis is not None and any(
    a.ndim <= axis + 1 and a.shape != task.inputs[0].shape for a in flat
  ):
    axis = None  # a part must hold whole blocks of every state array
  # the state in and out, and the step's float32 temporaries
  extra = sum(2 * a.size * a.dtype.itemsize for a in flat) + sum(
    12 * x.size for x in task.inputs
  )
  return dataclasses.replace(
    task,
    inputs=[*task.inputs, *flat],
    prepare=prepare,
    restore=restore,
    bytes=task.bytes + extra,
    axis=axis,
    prepare_and_restore=prepare_and_restore
    if task.prepare_and_restore
    else None,
  )


def split_states(outputs, counts):
  """A ``with_state`` task's outputs: its own, and per input its new state
  arrays (``counts[i]`` of them)."""
  own = len(outputs) - sum(counts)
  rest = iter(outputs[own:])
  return list(outputs[:own]), [[next(rest) for _ in range(n)] for n in counts]


def _part_size(count: int, fit: int, unit: int) -> int:
  """How many slices each part of a stack of ``count`` holds when ``fit``
  slices fit the budget: a multiple of ``unit`` (at least one unit), a
  divisor of ``count`` when one is at least half that many, else that many
  and a shorter last part (``_solve_in_parts``), so that a prime count of
  layers is not cut into parts of one."""
  most = min(count, max(unit, fit - fit % unit))
  divisors = [d for d in range(unit, most + 1, unit) if count % d == 0]
  if divisors and 2 * divisors[-1] >= most:
    return divisors[-1]
  return most


def _split_part(
  size: int, count: int, unit: int, pipelined: bool, budget: int
) -> int:
  """The part size of a task of ``size`` bytes over ``count`` slices within
  ``budget``: ``count`` (whole) where it fits or has one slice."""
  if size <= budget or count < 2:
    return count
  per_slice = -(-size // count)
  fit = budget // per_slice
  if pipelined:
    # three parts in flight (``_solve_in_parts``): one in Newton–Schulz, the
    # next one's input and the last one's result, each at most half a
    # part's Newton–Schulz bytes (its input or result in ≤ 4-byte floats,
    # beside 12 bytes an entry of float32 iterates)
    fit = 2 * budget // (3 * per_slice)
  return _part_size(count, max(unit, fit), unit)


def parts_of(
  count: int, slice_bytes: int, budget: int, pipelined: bool = False
) -> int:
  """How many parts ``run`` cuts a stack of ``count`` slices of
  ``slice_bytes`` each into within ``budget`` (1: it runs whole)."""
  part = _split_part(count * slice_bytes, count, 1, pipelined, budget)
  return -(-count // part)


def plan(tasks: Sequence[Task], budget: int) -> list[tuple[list[Task], int]]:
  """Waves of tasks: ``(tasks, part)``, where ``part`` is ``0`` for a wave of
  whole tasks and, for a wave of one split task, the size of its parts. A
  split task runs as soon as it is met, before the whole tasks gathered for
  the next wave."""
  return [
    ([tasks[i] for i in wave], part) for wave, part in _waves(tasks, budget)
  ]


def part_sizes(tasks: Sequence[Task], budget: int) -> list[int]:
  """Per task, the size of the parts ``run`` splits it into, or 0 where it
  runs whole."""
  sizes = [0] * len(tasks)
  for places, part in _waves(tasks, budget):
    if part:
      sizes[places[0]] = part
  return sizes


def _waves(tasks: Sequence[Task], budget: int) -> list[tuple[list[int], int]]:
  """``plan``'s waves, as the tasks' places in ``tasks``."""
  if sum(t.bytes for t in tasks) <= budget:
    return [(list(range(len(tasks))), 0)] if tasks else []
  waves: list[tuple[list[int], int]] = []
  current: list[int] = []
  used = 0
  for index, task in enumerate(tasks):
    if task.axis is not None:
      part = _split_part(
        task.bytes, task.count, task.unit, task.pipelined, budget
      )
      if part < task.count:
        waves.append(([index], part))
        continue
    if current and used + task.bytes > budget:
      waves.append((current, 0))
      current, used = [], 0
    current.append(index)
    used += task.bytes
  if current:
    waves.append((current, 0))
  return waves


def _stages(task: Task):
  """A task's stages for a loop over its parts: ``gather`` (``prepare``:
  slices → matrices made whole, and the context), ``solve``
  (Newton–Schulz), ``give_back`` (``restore``) and
  ``gather_and_give_back`` (the first and the last at once). What a stage
  hands on is ``(arrays, static)``: the jax arrays, which a loop may carry,
  and the rest (views, shapes), the same for every part of one size,
  rejoined by ``_join``."""

  def gather(pieces):
    return _split(task.prepare(pieces))

  def solve(prepared):
    matrices, context = prepared
    return _split((task.solve(matrices), context))

  def gather_and_give_back(pieces, solved):
    if task.prepare_and_restore is None:
      return gather(pieces), task.restore(*_join(*solved))
    prepared, outputs = task.prepare_and_restore(pieces, *_join(*solved))
    return _split(prepared), outputs

  return gather, solve, task.restore, gather_and_give_back


def _split(tree):
  leaves, treedef = jax.tree.flatten(tree)
  is_array = [isinstance(x, jax.Array) for x in leaves]
  arrays = [x for x, a in zip(leaves, is_array) if a]
  static = [None if a else x for x, a in zip(leaves, is_array)]
  return arrays, (treedef, static)


def _join(arrays, static):
  treedef, leaves = static
  rest = iter(arrays)
  return jax.tree.unflatten(
    treedef, [next(rest) if x is None else x for x in leaves]
  )


def _solve_in_parts(task, inputs, part, one=None):
  """A split task's outputs: a loop over its parts along ``task.axis``
  (pipelined for a ``pipelined`` task, see ``_pipelined_parts``), and the
  last, shorter part after it when ``part`` does not divide the count.
  The loop carries the inputs and overwrites each part with its result once
  it is read (parts are disjoint), so the results need no buffer of their
  own. With ``one`` (``_one_after``) the loop starts at ``one - 1``: zero,
  known only once the previous wave is done."""
  axis = task.axis
  start = 0 if one is None else (one - 1).astype(jnp.int32)
  gather, solve, give_back, gather_and_give_back = _stages(task)

  def slices(carried, begin, size):
    return [jax.lax.dynamic_slice_in_dim(x, begin, size, axis) for x in carried]

  def read(carried, begin, size):
    return gather(slices(carried, begin, size))

  def put(carried, results, begin):
    return tuple(
      jax.lax.dynamic_update_slice_in_dim(x, r.astype(x.dtype), begin, axis)
      for x, r in zip(carried, results)
    )

  def write(carried, solved, begin):
    return put(carried, give_back(*_join(*solved)), begin)

  def read_and_write(carried, begin, solved, written):
    gathered, results = gather_and_give_back(
      slices(carried, begin, part), solved
    )
    return gathered, put(carried, results, written)

  def solve_part(carried, begin, size):
    return write(carried, solve(_join(*read(carried, begin, size))), begin)

  full, rest = divmod(task.count, part)
  carried = tuple(inputs)
  if task.pipelined and full > 1:
    at = lambda i: start + i * part
    carried = _pipelined_parts(
      carried,
      full,
      read=lambda c, i: read(c, at(i), part),
      solve=solve,
      write=lambda c, solved, i: write(c, solved, at(i)),
      read_and_write=lambda c, i, solved, j: read_and_write(
        c, at(i), solved, at(j)
      ),
    )
  else:
    carried = jax.lax.fori_loop(
      start, full, lambda i, c: solve_part(c, i * part, part), carried
    )
  if rest:
    carried = solve_part(carried, full * part, rest)
  return list(carried)


def _pipelined_parts(carried, count, read, solve, write, read_and_write):
  """``count`` ≥ 2 parts in a software pipeline: iteration ``i`` gathers
  part ``i + 1`` and gives part ``i − 1`` back (``read_and_write``: one
  collective where the task can) and runs Newton–Schulz on part ``i``
  (``solve``); the first two parts start before the loop and the last two
  finish after it. The collective of an iteration does not depend on its
  Newton–Schulz, nor it on the collective, so a scheduler that runs
  collectives asynchronously (GPU, TPU) can hide it under it; three parts
  are in flight (``plan`` sizes them for it)."""
  gathered, gathered_static = read(carried, 0)
  solved, solved_static = solve(_join(gathered, gathered_static))
  gathered, _ = read(carried, 1)

  def body(i, loop):
    carried, gathered, solved = loop
    (following, _), carried = read_and_write(
      carried, i + 1, (solved, solved_static), i - 1
    )
    now, _ = solve(_join(gathered, gathered_static))
    return carried, following, now

  carried, gathered, solved = jax.lax.fori_loop(
    1, count - 1, body, (carried, gathered, solved)
  )
  last = solve(_join(gathered, gathered_static))
  carried = write(carried, (solved, solved_static), count - 2)
  return write(carried, last, count - 1)


def _one_after(previous):
  """A one read off a result of the previous wave (``1 + 0·isfinite(r)``:
  exactly one whatever ``r`` holds, so multiplying by it changes no bit and
  passes no NaN on), or ``None`` for the first wave. XLA's CPU and GPU
  compilers drop ``optimization_barrier`` before they schedule; the CPU's
  keeps this data dependency. XLA's GPU compiler does not: it proves
  ``0·isfinite(r)`` zero and folds it (no ``is-finite`` is left in the
  scheduled HLO of Llama-3-70B's update on H100-8 and H100-64, jax
  0.12.0.1), so there the waves are ordered by its scheduler alone; the
  temps measured there stay within the budget's figures (docs/scaling.md).
  ``1 + 0·nan_to_num(r)`` survives it, but as the split parts' loop start
  it takes XLA's known trip count from their loops (what
  ``benchmarks/_hlo.py`` reads), so it is not used yet."""
  results = [x for x in jax.tree.leaves(previous) if x.size]
  if not results:
    return None
  last = results[-1].reshape(-1)[0]
  return 1.0 + 0.0 * jnp.isfinite(last).astype(jnp.float32)


def run(tasks: Sequence[Task], budget: int) -> list[Sequence[jax.Array]]:
  """Runs ``tasks`` in waves of at most ``budget`` bytes (see the module).

  Args:
    tasks: the work, in order.
    budget: bytes per device.

  Returns:
    Each task's outputs, in the order of ``tasks``.
  """
  waves = _waves(tasks, budget)
  results: list[Any] = [None] * len(tasks)
  previous: Any = ()
  for places, part in waves:
    wave = [tasks[i] for i in places]
    inputs = [list(task.inputs) for task in wave]
    one = None
    if len(waves) > 1:
      previous, inputs = jax.lax.optimization_barrier((previous, inputs))
      one = _one_after(previous)
    if part:
      outputs = [_solve_in_parts(wave[0], inputs[0], part, one)]
    else:
      if one is not None:
        inputs = jax.tree.map(lambda x: x * one.astype(x.dtype), inputs)
      # whole tasks, one call of each solve (inline: a frame fewer on the
      # way to the Newton–Schulz loop)
      prepared = [task.prepare(x) for task, x in zip(wave, inputs)]
      by_solve: dict[Solve, list[int]] = {}
      for index, task in enumerate(wave):
        by_solve.setdefault(task.solve, []).append(index)
      solved: list[Any] = [None] * len(wave)
      for solve, members in by_solve.items():
        solved_flat = iter(solve([m for i in members for m in prepared[i][0]]))
        for i in members:
          solved[i] = [next(solved_flat) for _ in prepared[i][0]]
      outputs = [
        task.restore(matrices, context)
        for task, matrices, (_, context) in zip(wave, solved, prepared)
      ]
    for i, out in zip(places, outputs):
      results[i] = out
    previous = outputs
  return results
