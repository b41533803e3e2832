"""The sharded orthogonalization: every Muon leaf enters one
``jax.shard_map`` with its parameter's ``PartitionSpec`` and leaves with it.

Inside, matrix axes sharded over mesh axes other than the tensor-parallel
one (FSDP over ``data``) are made whole and re-split (``fsdp``: a stack
shared out over that axis, so no two of its ranks orthogonalize the same
matrix; a leaf without a stack gathered) by the task that orthogonalizes
them, in its wave and a part at a time where the waves split it
(``_moving_inside``); sharded batch axes stay sharded. Each leaf then goes
to the planner of its mode (its ``plan.LeafPlan``: ``blockwise``,
``duplicated``, ``distributed`` or ``allgather``, one module each), which
returns the leaf's tasks, and the tasks of all leaves run in waves within
the memory budget (``waves``).
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from optax_muon._src.kernels import batched
from optax_muon._src.parallel import allgather
from optax_muon._src.parallel import block_steps
from optax_muon._src.parallel import blockwise
from optax_muon._src.parallel import distributed
from optax_muon._src.parallel import duplicated
from optax_muon._src.parallel import fsdp
from optax_muon._src.parallel import plan
from optax_muon._src.parallel import waves
from optax_muon._src.parallel.execution import Execution
from optax_muon._src.parallel.leaves import Leaf
from optax_muon._src.parallel.leaves import Solves
from optax_muon._src.parallel.tensor_parallel import TensorParallel
from optax_muon._src.parallel.tensor_parallel import tp_dim_of

PLANNERS = {
  "blockwise": blockwise.plan,
  "duplicated": duplicated.plan,
  "distributed": distributed.plan,
  "allgather": allgather.plan,
}


def orthogonalize_sharded(
  leaves,
  views,
  tp: TensorParallel,
  specs,
  solver: batched.Solver,
  execution: Execution,
  states=None,
  step=None,
  block: block_steps.Bound | None = None,
):
  """Orthogonalizes ``leaves`` (global arrays) under ``tp``; see the module.

  With ``states`` (per leaf, its state arrays, sharded like it: the
  momentum, or an 8-bit one's values and scales) each leaf is first computed
  inside its task from its gradient and state, ``step(g, arrays) -> (input,
  new arrays)`` (``waves.with_state``): on the local block, before any
  gather, as the step is elementwise within a shard.

  Args:
    leaves: the Muon leaves.
    views: their ``MatrixView``s (global shapes).
    tp: the ``TensorParallel`` settings.
    specs: ``tp.leaf_specs`` of the leaves.
    solver: how each matrix is orthogonalized.
    execution: the waves' size (``wave_bytes``) and ``auto``'s limit
      (``auto_limit``).
    block: MuonBP's block steps (``block_steps.Bound``): each group of
      leaves within ``execution.wave_bytes`` under ``tp`` or under the
      block steps' sharding, as ``block.full_step`` says.

  Returns:
    The orthogonalized leaves, sharded like the inputs; with ``states``,
    ``(leaves, new states)``.
  """
  if block is not None:
    return _full_or_block(
      leaves, views, tp, specs, solver, execution, states, step, block
    )
  counts = [0] * len(leaves) if states is None else [len(a) for a in states]
  budget = execution.wave_bytes
  plans = plan.plan_leaves(
    tp,
    views,
    specs,
    [jnp.dtype(x.dtype).itemsize for x in leaves],
    solver.steps,
    solver.precision,
    solver.preconditioning,
    execution.auto_limit,
    execution.wave_bytes,
  )
  in_specs = tuple(PartitionSpec(*[a or None for a in spec]) for spec in specs)
  solves = Solves.of(solver, tp)

  def body(*local_leaves):
    local_states = iter(local_leaves[len(leaves) :])
    local_leaves = local_leaves[: len(leaves)]
    own_states = [[next(local_states) for _ in range(n)] for n in counts]
    moves = [fsdp.moves(v, s, tp) for v, s in zip(views, specs)]
    by_mode: dict[str, list[Leaf]] = {mode: [] for mode in PLANNERS}
    for index, (x, view, spec) in enumerate(zip(local_leaves, views, specs)):
      leaf = Leaf(
        # its shape for the planners; the arrays are read below
        jax.ShapeDtypeStruct(fsdp.whole_shape(x.shape, moves[index]), x.dtype),
        view,
        tp_dim_of(view, spec, tp),
        index,
        fsdp.splits_over_data(view, spec, tp),
      )
      by_mode[plans[index].runs].append(leaf)
    tasks = [
      task
      for mode, planner in PLANNERS.items()
      for task in planner(by_mode[mode], tp, budget, solves)
    ]
    # per leaf, how its task reads it: moved inside (an ``fsdp.InTask``)
    # or made whole before (None)
    inside: list[Any] = [None] * len(local_leaves)
    wholes: dict[int, jax.Array] = {}

    def whole(i):  # once, however many tasks read slices of it
      if i not in wholes:
        wholes[i] = fsdp.make_whole(local_leaves[i], moves[i])
      return wholes[i]

    part_sizes = waves.part_sizes(tasks, budget)
    for place, (task, part) in enumerate(zip(tasks, part_sizes)):
      owned = [moves[i] for i in task.owners]
      parts = task.count // part if part else 0
      in_task = fsdp.in_task(owned, task.axis, parts) if any(owned) else None
      if in_task is None or any(task.slices):
        tasks[place] = dataclasses.replace(
          task,
          inputs=[
            _sliced(task.slice_of(k), whole(i))
            for k, i in enumerate(task.owners)
          ],
        )
        continue
      tasks[place] = _moving_inside(
        task, in_task, [local_leaves[i] for i in task.owners]
      )
      for i, each in zip(task.owners, in_task):
        inside[i] = each
    if states is not None:
      read = [
        [
          fsdp.make_whole(a, moves[i])
          if inside[i] is None
          else inside[i].arrange(a)
          for a in own_states[i]
        ]
        for i in range(len(local_leaves))
      ]
      tasks = [
        waves.with_state(
          task,
          [
            [_sliced(task.slice_of(k), a) for a in read[i]]
            for k, i in enumerate(task.owners)
          ],
          step,
        )
        for task in tasks
      ]
    given = _by_leaf(tasks, waves.run(tasks, budget), counts)
    results: list[Any] = []
    new_states: list[Any] = []
    for index, pieces in enumerate(given):
      back = _back(inside[index], moves[index])
      out, arrays = _joined(pieces)
      results.append(back(out))
      new_states.append([back(a) for a in arrays])
    return tuple(results) + tuple(a for arrays in new_states for a in arrays)

  state_specs = tuple(
    spec for spec, n in zip(in_specs, counts) for _ in range(n)
  )
  flat_states = (
    [] if states is None else [a for arrays in states for a in arrays]
  )
  out = jax.shard_map(
    body,
    mesh=tp.mesh,
    in_specs=in_specs + state_specs,
    out_specs=in_specs + state_specs,
    check_vma=False,
  )(*leaves, *flat_states)
  if states is None:
    return out
  rest = iter(out[len(leaves) :])
  return list(out[: len(leaves)]), [
    [next(rest) for _ in range(n)] for n in counts
  ]


def _full_or_block(
  leaves, views, tp, specs, solver, execution, states, step, block
):
  """``orthogonalize_sharded`` of each group of leaves (``block_steps.groups``
  of a ``block_steps.GROUP_SHARE`` of the budget) in one ``lax.cond`` on
  ``block.full_step``.

  A group's inputs pass through an optimization barrier: without it XLA's
  conditional code motion (TPU compile of Llama-3-70B, TP 8) moved the
  momentum's multiply-add into both branches, passing its scalar broadcast
  to whole stacks as operands (17.5 GiB of temporaries in the step's half,
  9.6 with the barrier)."""
  sizes = [
    block_steps.local_bytes(x, spec, tp) for x, spec in zip(leaves, specs)
  ]
  outs: list[Any] = [None] * len(leaves)
  new_states: list[Any] = [None] * len(leaves)
  group_bytes = execution.wave_bytes // block_steps.GROUP_SHARE
  for group in block_steps.groups(sizes, group_bytes):
    pick = functools.partial(_pick, group)
    operands = jax.lax.optimization_barrier(
      (pick(leaves), None if states is None else pick(states))
    )

    def under(each_tp, each_specs, operands, pick=pick):
      group_leaves, group_states = operands
      return orthogonalize_sharded(
        group_leaves,
        pick(views),
        each_tp,
        pick(each_specs),
        solver,
        execution,
        group_states,
        step,
      )

    out = jax.lax.cond(
      block.full_step,
      functools.partial(under, tp, specs),
      functools.partial(under, block.tp, block.specs),
      operands,
    )
    if states is not None:
      out, own = out
      for i, arrays in zip(group, own):
        new_states[i] = arrays
    for i, leaf in zip(group, out):
      outs[i] = leaf
  return outs if states is None else (outs, new_states)


def _pick(indices, items) -> list[Any]:
  return [items[i] for i in indices]


def _by_leaf(tasks, outputs, counts) -> list[list[Any]]:
  """Per leaf, what the tasks that read it gave back: ``(slice, output,
  new state arrays)``, one entry unless it was read in slices."""
  given: list[list[Any]] = [[] for _ in counts]
  for task, out in zip(tasks, outputs):
    own, states = waves.split_states(out, [counts[i] for i in task.owners])
    for k, (index, o, arrays) in enumerate(zip(task.owners, own, states)):
      given[index].append((task.slice_of(k), o, arrays))
  return given


def _back(inside, moves):
  """How a leaf's result is laid out again as its input was: by its
  ``fsdp.InTask`` where its task moved it, else given back to its homes."""
  if inside is None:
    return lambda a: fsdp.give_back(a, moves)
  return inside.unarrange


def _sliced(where: waves.Slice | None, x: jax.Array) -> jax.Array:
  """The slice ``where`` of ``x``, or all of it."""
  return x if where is None else where.of(x)


def _joined(pieces) -> tuple[jax.Array, list[jax.Array]]:
  """A leaf's output and new state arrays from the ``(slice, output,
  state arrays)`` of the tasks that read it: their slices put together."""
  if len(pieces) == 1:
    _, out, arrays = pieces[0]
    return out, list(arrays)
  pieces = sorted(pieces, key=lambda piece: piece[0].start)
  axis = pieces[0][0].axis
  out = jnp.concatenate([o for _, o, _ in pieces], axis=axis)
  arrays = [
    jnp.concatenate(column, axis=axis)
    for column in zip(*(a for _, _, a in pieces))
  ]
  return out, arrays


def _moving_inside(
  task: waves.Task, in_task: list[fsdp.InTask], leaves
) -> waves.Task:
  """``task`` reading its ``leaves`` as they are sharded (laid out by
  ``in_task``'s ``arrange``), each made whole in its ``prepare`` and given
  back in its ``restore``: a part at a time where the waves split it, so
  that a pipelined task's FSDP all-to-alls run beside the Newton–Schulz
  too. Its outputs are laid out as its inputs."""

  def whole(inputs):
    return [m.make_whole(x) for m, x in zip(in_task, inputs)]

  def back(outputs):
    return [m.give_back(y) for m, y in zip(in_task, outputs)]

  def prepare(inputs):
    return task.prepare(whole(inputs))

  def restore(matrices, context):
    return back(task.restore(matrices, context))

  axis = task.axis
  if in_task[0].split_home is not None and axis is not None:
    axis += 1  # the slots' axis beside the ranks'
  return dataclasses.replace(
    task,
    inputs=[m.arrange(x) for m, x in zip(in_task, leaves)],
    prepare=prepare,
    restore=restore,
    axis=axis,
    # the next part's moves and the last one's as two chains (each
    # all-to-all over the data axis, then over the tensor-parallel one, or
    # back), not one fused tensor-parallel all-to-all between them: on an
    # H100-8 compile of Llama-3-70B, FSDP 2 x TP 4, 73.1 of 95.1 ms exposed
    # where the fused one left 75.8
    prepare_and_restore=None,
  )
