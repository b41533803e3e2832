"""Tensor-parallel and data-parallel execution of Newton–Schulz (shard_map).

Every Muon leaf enters one ``jax.shard_map`` over the whole mesh with its
parameter's ``PartitionSpec`` and leaves with the same one. Inside, matrix
axes sharded over mesh axes other than the tensor-parallel one (FSDP over
``data``) are gathered first and re-split last; batch axes (stacked layers,
experts) stay sharded and their matrices local. The tensor-parallel axis is
handled by ``TensorParallel.mode`` (Megatron-Core's ``muon_tp_mode``):

* ``blockwise``: each shard is orthogonalized as a matrix of its own;
* ``duplicated``: all-gather the shard, orthogonalize the full matrix on every
  rank, keep this rank's chunk;
* ``distributed``: keep the shard; the sharded side is the columns, so the
  Gram matrix ``X Xᵀ`` is a sum over ranks (one all-reduce per step, plus the
  scalar max and norm of the normalization). When the sharded side is the
  short one the Gram matrix would be the large one, so such a leaf is
  gathered as in ``duplicated`` (one all-gather moves less);
* ``allgather``: the matrices of the same shape once turned wide (each
  layer of a scanned stack, each expert, each per-layer leaf) are stacked
  and re-laid out with one all-to-all so that each rank holds whole
  matrices, orthogonalizes its share, and a second all-to-all puts them
  back: an 80-layer stack at TP 8 sends 10 layers to each rank. A group
  with fewer matrices than ranks is padded with zero matrices when that
  moves fewer bytes than gathering each one (3 or more), else it is
  ``duplicated`` (see ``shares_out``).

All of it runs in waves within ``memory_budget`` bytes per device
(``optax_muon.waves``): a stack is split along its batch axis into parts
(for ``allgather``, parts of whole matrices for every rank), and waves are
ordered in the program.

``distribute_over="data"`` (Megatron's layer-wise distributed optimizer)
further splits each group of same-shape matrices that is replicated over that
axis: each data-parallel rank orthogonalizes 1/N of them and the results are
all-gathered.
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from optax_muon._src.base import checks as _checks
from optax_muon._src.base import paths as _paths
from optax_muon._src.kernels import batched
from optax_muon._src.kernels import quantize
from optax_muon._src.parallel import waves
from optax_muon._src.views import layout

MODES = ("blockwise", "duplicated", "distributed", "allgather")


@dataclasses.dataclass(frozen=True)
class TensorParallel:
  """How Muon's orthogonalization runs over a ``jax.sharding.Mesh``.

  Attributes:
    mesh: the mesh the params are sharded over.
    axis: the tensor-parallel mesh axis.
    mode: ``"blockwise"``, ``"duplicated"``, ``"distributed"`` or
      ``"allgather"`` (see the module docstring).
    specs: each param's ``PartitionSpec``: a tree like the params (a prefix
      allowed), a callable of the params (``flax.nnx.get_partition_spec``),
      or ``None`` to read each traced array's sharding (Explicit meshes).
    distribute_over: a data-parallel mesh axis to split the work over, or None.
    MODES: the accepted modes (a class attribute).
  """

  MODES: ClassVar[tuple[str, ...]] = MODES
  mesh: jax.sharding.Mesh
  axis: str = "model"
  mode: str = "duplicated"
  specs: Any = None
  distribute_over: str | None = None

  def __post_init__(self):
    if not isinstance(self.mesh, jax.sharding.Mesh):
      raise ValueError(
        f"sharding.mesh must be a jax.sharding.Mesh, got {self.mesh!r}"
      )
    names = list(self.mesh.axis_names)
    if self.axis not in names:
      raise ValueError(
        f"sharding.axis={self.axis!r} is not a mesh axis; "
        f"accepted values: {names}"
      )
    _checks.check_choice("sharding.mode", self.mode, MODES)
    if self.distribute_over is not None and (
      self.distribute_over not in names or self.distribute_over == self.axis
    ):
      raise ValueError(
        f"sharding.distribute_over={self.distribute_over!r} must be a mesh "
        f"axis other than {self.axis!r}; accepted values: "
        f"{[n for n in names if n != self.axis] + [None]}"
      )

  @property
  def size(self) -> int:
    return self.mesh.shape[self.axis]

  def _explicit(self) -> bool:
    return all(
      t == jax.sharding.AxisType.Explicit for t in self.mesh.axis_types
    )

  def leaf_specs(self, tree) -> list[tuple]:
    """Each leaf's spec as a tuple of mesh-axis tuples, one per array axis."""
    lookup = _paths.PathLookup("sharding.specs", self.specs, PartitionSpec)
    spec_of = lookup.resolve(tree) if self.specs is not None else None
    result = []
    for path, leaf in _paths.leaves_with_paths(tree)[0]:
      where = f"leaf {_paths.path_string(path) or '<root>'}"
      if spec_of is not None:
        spec = spec_of(path)
        if spec is None:
          raise ValueError(f"sharding.specs has no PartitionSpec for {where}")
      elif self._explicit():
        spec = jax.typeof(leaf).sharding.spec
      else:
        raise ValueError(
          f"sharding.specs is None but the mesh has Auto axes, so {where}'s "
          "sharding is unknown while tracing; pass specs= (a tree of "
          "PartitionSpec, or a callable such as nnx.get_partition_spec)"
        )
      result.append(self._normalize(spec, jnp.shape(leaf), where))
    return result

  def _normalize(self, spec, shape, where) -> tuple:
    if len(spec) > len(shape):
      raise ValueError(
        f"sharding spec {spec} of {where} has {len(spec)} "
        f"entries but the array has {len(shape)} axes"
      )
    entries = []
    for dim, entry in zip(
      shape, tuple(spec) + (None,) * (len(shape) - len(spec))
    ):
      axes = (
        ()
        if entry is None
        else (entry,)
        if isinstance(entry, str)
        else tuple(entry)
      )
      for name in axes:
        if name not in self.mesh.axis_names:
          raise ValueError(
            f"sharding spec {spec} of {where} names {name!r}, "
            f"not an axis of the mesh {list(self.mesh.axis_names)}"
          )
      parts = math.prod(self.mesh.shape[a] for a in axes)
      if dim % parts:
        raise ValueError(
          f"{where}: dimension {dim} is sharded {parts} ways by "
          f"{axes} in spec {spec}, which does not divide it"
        )
      entries.append(axes)
    return tuple(entries)


def check_sharding(sharding) -> None:
  if sharding is not None and not isinstance(sharding, TensorParallel):
    raise ValueError(
      f"sharding={sharding!r} is not accepted; accepted "
      "values: None or optax_muon.TensorParallel(mesh, ...)"
    )


def local_view(view: layout.MatrixView, shape) -> layout.MatrixView:
  """The view of a (partly) local block of shape ``shape``."""
  local = dataclasses.replace(view, shape=tuple(shape))
  if not view.widths:
    return local
  ratio = local.fan_out / view.fan_out
  groups = view.groups * ratio
  if groups != int(groups) or groups < 1:
    raise ValueError(
      f"{'split_qkv' if len(view.widths) == 3 else 'split_gate_up'} cannot "
      f"split an output-sharded fused shard of shape {tuple(shape)} into "
      f"whole pieces ({view.groups} groups); use SplitQKV(layout='grouped') "
      "with num_kv_heads divisible by the shards, SplitGateUp(groups=<the "
      "shards>), or mode='duplicated'"
    )
  return dataclasses.replace(local, groups=int(groups))


def _own_chunk(x, axis_name, dim):
  size = x.shape[dim] // jax.lax.axis_size(axis_name)
  return jax.lax.dynamic_slice_in_dim(
    x, jax.lax.axis_index(axis_name) * size, size, axis=dim
  )


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
class _WideMember:
  """A leaf of an ``allgather`` group, seen with its axes ordered ``(batch,
  rows, columns)``, ``rows ≤ columns``, so that leaves whose matrices are
  each other's transposes (an MLP's up and down kernels) group together. The
  reordering is applied to each part a task reads, never to the whole leaf."""

  x: jax.Array
  view: layout.MatrixView
  tp_dim: int
  finish: Callable
  replicated: bool
  axis: int | None

  def __post_init__(self):
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


def _shards_to_whole(stack: jax.Array, axis_name, tp_dim: int) -> jax.Array:
  """A stack ``(P, r, c)`` of local shards, split along ``tp_dim`` (1 or 2)
  over the ``P`` ranks' matrices, re-laid out so that each rank holds its
  ``P/N`` whole matrices: one all-to-all."""
  ranks = jax.lax.axis_size(axis_name)
  free = 3 - tp_dim
  pieces = _pieces(stack.shape[0], ranks, stack.shape[free])
  whole = jax.lax.all_to_all(
    _split_free(stack, free, pieces), axis_name, 0, tp_dim, tiled=True
  )
  return _join_free(whole, free, pieces)


def _whole_to_shards(whole: jax.Array, axis_name, tp_dim: int) -> jax.Array:
  """Inverse of ``_shards_to_whole``."""
  ranks = jax.lax.axis_size(axis_name)
  free = 3 - tp_dim
  pieces = _pieces(whole.shape[0] * ranks, ranks, whole.shape[free])
  shards = jax.lax.all_to_all(
    _split_free(whole, free, pieces), axis_name, tp_dim, 0, tiled=True
  )
  return _join_free(shards, free, pieces)


def _allgather_unit(member: _WideMember, ranks: int) -> int:
  """Slices of the member's split axis whose matrices fill whole matrices for
  every rank (no zero padding in an all-to-all)."""
  if member.axis is None:
    return 1
  per_slice = member.items // member.x.shape[member.axis]
  return ranks // math.gcd(ranks, per_slice)


def orthogonalize_sharded(
  leaves,
  views,
  tp: TensorParallel,
  specs,
  solver: batched.Solver,
  memory_budget: int | None = None,
):
  """Orthogonalizes ``leaves`` (global arrays) under ``tp``; see the module.

  The work runs in waves of at most ``memory_budget`` bytes per device
  (``waves``): stacked leaves are split along their batch axes, ``allgather``
  groups into parts of whole matrices per rank.

  Args:
    leaves: the Muon leaves.
    views: their ``MatrixView``s (global shapes).
    tp: the ``TensorParallel`` settings.
    specs: ``tp.leaf_specs`` of the leaves.
    solver: how each matrix is orthogonalized.
    memory_budget: bytes per device (``None``: the default budget).

  Returns:
    The orthogonalized leaves, sharded like the inputs.
  """
  budget = waves.resolve(memory_budget)
  in_specs = tuple(PartitionSpec(*[a or None for a in spec]) for spec in specs)
  solvers = {
    "local": lambda ms: batched.orthogonalize_matrices(ms, solver),
    "replicated": lambda ms: batched.orthogonalize_matrices(
      ms, solver, tp.distribute_over
    ),
    "distributed": lambda ms: batched.orthogonalize_split_columns(
      ms, solver, tp.axis
    ),
  }
  local_solver = lambda replicated: (
    "replicated" if replicated and tp.distribute_over else "local"
  )
  only = lambda finish: lambda outputs: finish(outputs[0])

  def local_task(x, view, finish, replicated) -> waves.Task:
    """Each (local) matrix orthogonalized as it is."""
    return waves.view_task(
      x, lambda shape: local_view(view, shape), finish, local_solver(replicated)
    )

  def duplicated_task(x, view, tp_dim, finish, replicated) -> waves.Task:
    """Gather the shard, orthogonalize the full matrix, keep this chunk."""
    full_shape = list(x.shape)
    full_shape[tp_dim] *= tp.size

    def prepare(inputs):
      full = jax.lax.all_gather(inputs[0], tp.axis, axis=tp_dim, tiled=True)
      full_view = local_view(view, full.shape)
      return full_view.to_matrices(full), full_view

    return waves.Task(
      [x],
      prepare,
      lambda ms, v: [_own_chunk(v.from_matrices(ms), tp.axis, tp_dim)],
      only(finish),
      local_solver(replicated),
      waves.view_bytes(local_view(view, full_shape), x.dtype.itemsize),
      waves.split_axis(view, x.shape),
    )

  def distributed_task(x, view, tp_dim, finish) -> waves.Task:
    """The shard stays; the sharded side becomes the columns, so X Xᵀ is a
    sum over the shards."""
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
      only(finish),
      "distributed",
      waves.newton_schulz_bytes(
        local.fan_in, local.fan_out, count, x.dtype.itemsize, unsharded
      ),
      waves.split_axis(view, x.shape),
    )

  def allgather_task(members: list[_WideMember], split: bool) -> waves.Task:
    """Local shards of ``members``' matrices stacked, re-laid out by one
    all-to-all so that each rank holds whole matrices, and sent back.
    ``split``: one member, whose task may be split along its batch axis."""
    first = members[0]
    items = sum(m.items for m in members)
    per_rank = -(-items // tp.size)
    itemsize = first.x.dtype.itemsize

    def prepare(inputs):
      stack = jnp.concatenate(
        [m.wide_items(x) for m, x in zip(members, inputs)]
      )
      count = stack.shape[0]
      padded = -(-count // tp.size) * tp.size
      stack = jnp.pad(stack, ((0, padded - count), (0, 0), (0, 0)))
      whole = _shards_to_whole(stack, tp.axis, first.wide_tp_dim)
      return [whole], (count, [x.shape for x in inputs])

    def restore(ms, context):
      count, shapes = context
      (done,) = ms
      back = _whole_to_shards(done, tp.axis, first.wide_tp_dim)[:count]
      outputs, start = [], 0
      for member, shape in zip(members, shapes):
        n = math.prod(shape[a] for a in member.view.batch_axes)
        outputs.append(member.unwide(back[start : start + n], shape))
        start += n
      return outputs

    def finish(outputs):
      for member, out in zip(members, outputs):
        member.finish(out)

    return waves.Task(
      [m.x for m in members],
      prepare,
      restore,
      finish,
      local_solver(all(m.replicated for m in members)),
      first.whole_bytes(tp.size, per_rank)
      + 2 * itemsize * first.rows * first.cols * per_rank * tp.size,
      first.axis if split else None,
      _allgather_unit(first, tp.size) if split else 1,
    )

  def allgather_tasks(members: list[_WideMember]) -> list[waves.Task]:
    """One task for the group when it fits the budget; else each stacked
    member alone (split by the waves) and the others in parts of about one
    budget's worth of whole matrices per rank."""
    whole = allgather_task(members, split=False)
    if whole.bytes <= budget:
      return [whole]
    per_matrix = members[0].whole_bytes(tp.size)
    quota = max(1, budget // per_matrix) * tp.size  # matrices per part
    tasks: list[waves.Task] = []
    pool: list[_WideMember] = []
    pooled = 0
    for member in members:
      if (
        member.axis is not None
        and member.items >= 2 * quota
        and member.x.shape[member.axis] % _allgather_unit(member, tp.size) == 0
      ):
        tasks.append(allgather_task([member], split=True))
        continue
      if pool and pooled + member.items > quota:
        tasks.append(allgather_task(pool, split=False))
        pool, pooled = [], 0
      pool.append(member)
      pooled += member.items
    if pool:
      tasks.append(allgather_task(pool, split=False))
    return tasks

  def body(*local_leaves):
    results: list[Any] = [None] * len(local_leaves)
    tasks: list[waves.Task] = []
    allgather_groups: dict[tuple, list[_WideMember]] = {}
    for index, (x, view, spec) in enumerate(zip(local_leaves, views, specs)):
      matrix_axes = view.reduction_axes + view.output_axes
      gathered = []  # re-split last, in reverse
      for dim in matrix_axes:
        for name in spec[dim]:
          if name != tp.axis:
            if len(spec[dim]) > 1:
              raise ValueError(
                f"a matrix axis sharded over {spec[dim]} together is not "
                "supported; shard it over the tensor-parallel axis alone"
              )
            x = jax.lax.all_gather(x, name, axis=dim, tiled=True)
            gathered.append((name, dim))
      replicated = not any(
        tp.distribute_over in spec[d] for d in view.batch_axes
      )
      tp_dims = [d for d in matrix_axes if tp.axis in spec[d]]
      tp_dim = tp_dims[0] if tp_dims else None

      def finish(out, gathered=tuple(gathered), index=index):
        for name, dim in reversed(gathered):
          out = _own_chunk(out, name, dim)
        results[index] = out

      mode = _mode_for(tp.mode, view, tp_dim)
      if mode == "blockwise":
        tasks.append(local_task(x, view, finish, replicated))
      elif mode == "duplicated":
        tasks.append(duplicated_task(x, view, tp_dim, finish, replicated))
      elif mode == "distributed":
        tasks.append(distributed_task(x, view, tp_dim, finish))
      else:
        member = _WideMember(
          x, view, tp_dim, finish, replicated, waves.split_axis(view, x.shape)
        )
        allgather_groups.setdefault(member.key, []).append(member)

    for members in allgather_groups.values():
      if shares_out(sum(m.items for m in members), tp.size):
        tasks += allgather_tasks(members)
      else:
        tasks += [
          duplicated_task(m.x, m.view, m.tp_dim, m.finish, m.replicated)
          for m in members
        ]
    waves.run(tasks, budget, solvers)
    return tuple(results)

  return jax.shard_map(
    body, mesh=tp.mesh, in_specs=in_specs, out_specs=in_specs, check_vma=False
  )(*leaves)


def _mode_for(mode: str, view: layout.MatrixView, tp_dim) -> str:
  """The mode a leaf runs in: ``blockwise`` when it is not sharded over the
  tensor-parallel axis; split QKV / gate-up pieces are gathered per leaf
  (``duplicated``) in ``distributed`` and ``allgather``; ``distributed``
  gathers a leaf whose sharded side is the short one (its Gram matrix would
  be of the long side: one gather moves less)."""
  if tp_dim is None:
    return "blockwise"
  if mode in ("distributed", "allgather") and view.widths:
    return "duplicated"
  if mode == "distributed":
    sharded_side = (
      view.fan_in if tp_dim in view.reduction_axes else view.fan_out
    )
    if sharded_side < max(view.fan_in, view.fan_out):
      return "duplicated"
  return mode


def local_shape(shape, spec, tp: TensorParallel):
  """The shape of this rank's tensor-parallel shard (for blockwise scaling)."""
  return tuple(
    d // tp.size if tp.axis in axes else d for d, axes in zip(shape, spec)
  )


def zero1_sharding(
  tree, mesh: jax.sharding.Mesh, axis: str = "data", specs=None
) -> Any:
  """ZeRO-1: ``NamedSharding``s that also split each leaf over ``axis``.

  Each leaf keeps its spec (from ``specs``, a tree like ``tree``, or
  replicated) and its first unsharded axis that ``axis`` divides is split
  over ``axis``, so optimizer state (Muon's momentum) takes 1/N of the memory
  per data-parallel rank. Use it for ``jax.device_put`` and ``out_shardings``.
  An 8-bit leaf (``om.QuantizedMomentum``) splits its values and scales on
  the same axis, one that both divide, so each shard holds whole blocks.

  Returns:
    A tree like ``tree`` of ``jax.sharding.NamedSharding``.
  """
  if axis not in mesh.axis_names:
    raise ValueError(
      f"axis={axis!r} is not a mesh axis; accepted values: "
      f"{list(mesh.axis_names)}"
    )
  lookup = _paths.PathLookup(
    "specs", specs, PartitionSpec, default=PartitionSpec()
  )
  spec_of = lookup.resolve(tree)
  ways = mesh.shape[axis]

  def split(path, shapes):
    """One sharding for arrays of ``shapes`` (a quantized leaf's values and
    scales differ only in their last axis): the first axis all divide."""
    given = spec_of(path)
    spec = list(given) + [None] * (len(shapes[0]) - len(given))
    for dim in range(len(spec)):
      sizes = [shape[dim] for shape in shapes]
      if spec[dim] is None and all(n % ways == 0 and n > 1 for n in sizes):
        spec[dim] = axis
        break
    return jax.sharding.NamedSharding(mesh, PartitionSpec(*spec))

  is_quantized = lambda x: isinstance(x, quantize.QuantizedArray)
  leaves, treedef = _paths.leaves_with_paths(tree, is_leaf=is_quantized)
  out: list[Any] = []
  for path, leaf in leaves:
    if is_quantized(leaf):
      shapes = [jnp.shape(leaf.values) or (1,), jnp.shape(leaf.scales)]
      both = split(path + ("values",), shapes)
      if not jnp.shape(leaf.values):
        both = jax.sharding.NamedSharding(mesh, PartitionSpec())
      out.append(quantize.QuantizedArray(both, both))
    else:
      out.append(split(path, [jnp.shape(leaf)]))
  return jax.tree.unflatten(treedef, out)
