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
* ``allgather``: leaves of the same shape once turned wide are stacked and
  re-laid out with one all-to-all so that each rank holds whole matrices,
  orthogonalizes its share, and a second all-to-all puts them back. A group
  with fewer leaves than ranks is padded with zero matrices when that moves
  fewer bytes than gathering each leaf (3 or more leaves), else it is
  ``duplicated`` (see ``shares_out``).

``distribute_over="data"`` (Megatron's layer-wise distributed optimizer)
further splits each group of same-shape matrices that is replicated over that
axis: each data-parallel rank orthogonalizes 1/N of them and the results are
all-gathered.
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from optax_muon import _checks
from optax_muon import _paths
from optax_muon import layout

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
  """

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
  """A leaf of an ``allgather`` group, its axes ordered ``(batch, rows,
  columns)`` with ``rows ≤ columns``, so that leaves whose matrices are each
  other's transposes (an MLP's up and down kernels) stack together."""

  x: jax.Array
  view: layout.MatrixView
  tp_dim: int
  finish: Callable
  replicated: bool

  def __post_init__(self):
    v = self.view
    rows, cols = v.reduction_axes, v.output_axes
    if v.fan_in > v.fan_out:
      rows, cols = cols, rows
    self.order = v.batch_axes + rows + cols
    self.counts = (len(v.batch_axes), len(rows))
    self.wide = jnp.transpose(self.x, self.order)
    self.wide_tp_dim = self.order.index(self.tp_dim)

  @property
  def key(self):
    return (self.wide.shape, self.wide.dtype, self.wide_tp_dim, self.counts)

  def wide_view(self, shape) -> layout.MatrixView:
    batch, rows = self.counts
    return layout.MatrixView(
      tuple(shape),
      tuple(range(batch)),
      tuple(range(batch, batch + rows)),
      tuple(range(batch + rows, len(shape))),
    )

  def unwide(self, wide: jax.Array) -> jax.Array:
    return jnp.transpose(
      wide, tuple(sorted(range(len(self.order)), key=self.order.__getitem__))
    )


@dataclasses.dataclass
class _Job:
  """Matrices to orthogonalize locally and how to put their result back."""

  matrices: list
  finish: Callable
  replicated: bool  # the same on every rank of the distribute_over axis


def orthogonalize_sharded(
  leaves,
  views,
  tp: TensorParallel,
  specs,
  orthogonalize_matrices,
  distributed_ns,
):
  """Orthogonalizes ``leaves`` (global arrays) under ``tp``; see the module.

  Args:
    leaves: the Muon leaves.
    views: their ``MatrixView``s (global shapes).
    tp: the ``TensorParallel`` settings.
    specs: ``tp.leaf_specs`` of the leaves.
    orthogonalize_matrices: ``(matrices, distribute_axis) -> matrices``, the
      grouped local Newton–Schulz.
    distributed_ns: ``(matrices, axis_name) -> matrices``, Newton–Schulz of
      matrices whose columns are split over ``axis_name``.

  Returns:
    The orthogonalized leaves, sharded like the inputs.
  """
  in_specs = tuple(PartitionSpec(*[a or None for a in spec]) for spec in specs)

  def duplicated_job(x, view, tp_dim, finish, replicated) -> _Job:
    """Gather the shard, orthogonalize the full matrix, keep this chunk."""
    full = jax.lax.all_gather(x, tp.axis, axis=tp_dim, tiled=True)
    full_view = local_view(view, full.shape)
    return _Job(
      full_view.to_matrices(full),
      lambda ms: finish(
        _own_chunk(full_view.from_matrices(ms), tp.axis, tp_dim)
      ),
      replicated,
    )

  def body(*local_leaves):
    results, jobs, allgather_groups = [None] * len(local_leaves), [], {}
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

      mode = tp.mode
      if (
        tp_dim is not None
        and mode in ("distributed", "allgather")
        and (view.widths)
      ):
        mode = "duplicated"  # split QKV pieces are gathered per leaf
      if mode == "distributed" and tp_dim is not None:
        sharded_side = (
          view.fan_in if tp_dim in view.reduction_axes else view.fan_out
        )
        if sharded_side < max(view.fan_in, view.fan_out):
          # the Gram matrix would be of the long side: one gather moves less
          mode = "duplicated"
      if tp_dim is None or mode == "blockwise":
        local = local_view(view, x.shape)
        jobs.append(
          _Job(
            local.to_matrices(x),
            lambda ms, v=local, f=finish: f(v.from_matrices(ms)),
            replicated,
          )
        )
      elif mode == "duplicated":
        jobs.append(duplicated_job(x, view, tp_dim, finish, replicated))
      elif mode == "distributed":
        local = local_view(view, x.shape)
        fan_in_sharded = tp_dim in view.reduction_axes
        # the sharded side becomes the columns: X Xᵀ sums over the shards
        matrices = [
          jnp.swapaxes(m, -1, -2) if fan_in_sharded else m
          for m in local.to_matrices(x)
        ]
        out = distributed_ns(matrices, tp.axis)
        finish(
          local.from_matrices(
            [jnp.swapaxes(m, -1, -2) if fan_in_sharded else m for m in out]
          )
        )
      else:
        member = _WideMember(x, view, tp_dim, finish, replicated)
        allgather_groups.setdefault(member.key, []).append(member)

    for members in allgather_groups.values():
      if not shares_out(len(members), tp.size):
        jobs += [
          duplicated_job(m.x, m.view, m.tp_dim, m.finish, m.replicated)
          for m in members
        ]
        continue
      count = len(members)
      padded = -(-count // tp.size) * tp.size
      first = members[0]
      stack = jnp.stack(
        [m.wide for m in members]
        + [jnp.zeros_like(first.wide)] * (padded - count)
      )
      wide_dim = first.wide_tp_dim + 1  # the stack axis comes first
      whole = jax.lax.all_to_all(stack, tp.axis, 0, wide_dim, tiled=True)
      full_view = first.wide_view(whole.shape[1:])
      pieces = [full_view.to_matrices(item) for item in whole]

      def put_back(ms, pieces=pieces, v=full_view, d=wide_dim, members=members):
        ms = iter(ms)
        done = jnp.stack(
          [v.from_matrices([next(ms) for _ in p]) for p in pieces]
        )
        back = jax.lax.all_to_all(done, tp.axis, d, 0, tiled=True)
        for member, wide in zip(members, back):
          member.finish(member.unwide(wide))

      jobs.append(
        _Job(
          [m for p in pieces for m in p],
          put_back,
          all(m.replicated for m in members),
        )
      )

    # one grouped Newton–Schulz for everything that is local now
    for replicated in (True, False):
      selected = [j for j in jobs if j.replicated == replicated]
      flat = [m for j in selected for m in j.matrices]
      if not flat:
        continue
      out = iter(
        orthogonalize_matrices(flat, tp.distribute_over if replicated else None)
      )
      for job in selected:
        job.finish([next(out) for _ in job.matrices])
    return tuple(results)

  return jax.shard_map(
    body, mesh=tp.mesh, in_specs=in_specs, out_specs=in_specs, check_vma=False
  )(*leaves)


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
  leaves, treedef = _paths.leaves_with_paths(tree)
  out = []
  for path, leaf in leaves:
    shape = jnp.shape(leaf)
    spec = list(spec_of(path)) + [None] * (len(shape) - len(spec_of(path)))
    for dim, size in enumerate(shape):
      if spec[dim] is None and size % mesh.shape[axis] == 0 and size > 1:
        spec[dim] = axis
        break
    out.append(jax.sharding.NamedSharding(mesh, PartitionSpec(*spec)))
  return jax.tree.unflatten(treedef, out)
