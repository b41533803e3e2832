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
* ``auto``: per leaf, the mode of least modeled time (``cost``: Newton–Schulz
  FLOPs at the device's matmul rate plus collective bytes at its link's
  bandwidth) among ``auto_modes``, the exact ones unless ``blockwise`` is
  allowed;
* ``allgather``: the matrices of the same shape once turned wide (each
  layer of a scanned stack, each expert, each per-layer leaf) are stacked
  and re-laid out with one all-to-all so that each rank holds whole
  matrices, orthogonalizes its share, and a second all-to-all puts them
  back: an 80-layer stack at TP 8 sends 10 layers to each rank. A group
  with fewer matrices than ranks is padded with zero matrices when that
  moves fewer bytes than gathering each one (3 or more), else it is
  ``duplicated`` (see ``shares_out``).

All of it runs in waves within ``memory_budget`` bytes per device
(``optax_muon._src.parallel.waves``): a stack is split along its batch axis into parts
(for ``allgather``, parts of whole matrices for every rank), and waves are
ordered in the program.

``distribute_over="data"`` (Megatron's layer-wise distributed optimizer)
further splits each group of same-shape matrices that is replicated over that
axis: each data-parallel rank orthogonalizes 1/N of them and the results are
all-gathered.
"""

import dataclasses
import math
import typing
from typing import Any
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from optax_muon._src.base import checks as _checks
from optax_muon._src.base import paths as _paths
from optax_muon._src.base import types
from optax_muon._src.parallel import rates as rates_lib
from optax_muon._src.views import layout

MODES = typing.get_args(types.TensorParallelMode)
# the modes that orthogonalize each whole matrix (blockwise does its shards)
EXACT_MODES = ("duplicated", "distributed", "allgather")


@dataclasses.dataclass(frozen=True)
class TensorParallel:
  """How Muon's orthogonalization runs over a ``jax.sharding.Mesh``.

  Attributes:
    mesh: the mesh the params are sharded over; ``None``: the mesh their
      types carry (jax's Explicit axes), read when the transform is applied
      (``bind``), with each leaf's spec and, when ``axis`` is not one of
      that mesh's axes, the axis that splits the most matrix elements.
    axis: the tensor-parallel mesh axis.
    mode: ``"blockwise"``, ``"duplicated"``, ``"distributed"``,
      ``"allgather"`` or ``"auto"`` (see the module docstring).
    specs: each param's ``PartitionSpec``: a tree like the params (a prefix
      allowed), a callable of the params (``flax.nnx.get_partition_spec``),
      or ``None`` to read each traced array's sharding (Explicit meshes).
    distribute_over: a data-parallel mesh axis to split the work over, or None.
    auto_modes: the modes ``"auto"`` chooses among (default: the exact
      ones; add ``"blockwise"`` to allow it).
    rates: the ``DeviceRates`` of ``"auto"``'s cost model; ``None``: those of
      the mesh's device kind (``om.KNOWN_RATES``).
    MODES: the accepted modes (a class attribute).
  """

  MODES: ClassVar[tuple[str, ...]] = MODES
  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None
  axis: str = "model"
  mode: types.TensorParallelMode = "duplicated"
  specs: Any = None
  distribute_over: str | None = None
  auto_modes: tuple[str, ...] = EXACT_MODES
  rates: rates_lib.DeviceRates | None = None

  def __post_init__(self):
    _checks.check_choice("sharding.mode", self.mode, MODES)
    if self.mesh is None:  # checked against the types' mesh by ``bind``
      self._check_auto()
      return
    if not isinstance(
      self.mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)
    ):
      raise ValueError(
        f"sharding.mesh must be a jax.sharding.Mesh, or None to read it "
        f"from the params' types, got {self.mesh!r}"
      )
    names = list(self.mesh.axis_names)
    if self.axis not in names:
      raise ValueError(
        f"sharding.axis={self.axis!r} is not a mesh axis; "
        f"accepted values: {names}"
      )
    if self.distribute_over is not None and (
      self.distribute_over not in names or self.distribute_over == self.axis
    ):
      raise ValueError(
        f"sharding.distribute_over={self.distribute_over!r} must be a mesh "
        f"axis other than {self.axis!r}; accepted values: "
        f"{[n for n in names if n != self.axis] + [None]}"
      )
    self._check_auto()

  def _check_auto(self) -> None:
    if self.mode != "auto":
      read_by_auto = [
        name
        for name, given in (
          ("auto_modes", self.auto_modes != EXACT_MODES),
          ("rates", self.rates is not None),
        )
        if given
      ]
      if read_by_auto:
        raise ValueError(
          f"sharding.{read_by_auto[0]} is read only by mode='auto', but "
          f"sharding.mode={self.mode!r}; accepted: mode='auto' with it, or "
          f"{read_by_auto[0]} left at its default"
        )
    choices = MODES[:-1]
    if (
      not isinstance(self.auto_modes, tuple)
      or not any(m in EXACT_MODES for m in self.auto_modes)
      or any(m not in choices for m in self.auto_modes)
      or len(set(self.auto_modes)) != len(self.auto_modes)
    ):
      raise ValueError(
        f"sharding.auto_modes={self.auto_modes!r} must be a tuple of distinct "
        f"modes from {list(choices)} with at least one exact mode "
        f"{list(EXACT_MODES)}"
      )
    if self.rates is not None and not isinstance(
      self.rates, rates_lib.DeviceRates
    ):
      raise ValueError(
        f"sharding.rates={self.rates!r} is not accepted; accepted values: "
        "None (the mesh's device kind) or optax_muon.DeviceRates(...)"
      )
    if (
      self.mode == "auto"
      and self.mesh is not None
      and self.resolved_rates() is None
    ):
      kind = rates_lib.device_kind(self.mesh)
      raise ValueError(
        f"sharding.mode='auto' models each mode's time at the device's "
        f"rates, and device kind {kind!r} has none in om.KNOWN_RATES "
        f"({list(rates_lib.KNOWN_RATES)}); pass "
        "sharding.rates=om.DeviceRates(bf16_flops=..., high_flops=..., "
        "highest_flops=..., link_bytes=...)"
      )

  def resolved_rates(self) -> rates_lib.DeviceRates | None:
    """``rates``, or the known rates of the mesh's device kind (or None)."""
    return self.rates or rates_lib.rates_of(self.mesh)

  @property
  def bound_mesh(self) -> jax.sharding.Mesh | jax.sharding.AbstractMesh:
    """``mesh``, once ``bind`` has read it from the types."""
    if self.mesh is None:
      raise ValueError(
        "this TensorParallel reads its mesh from the params' types; "
        "bind it to them first (TensorParallel.bind)"
      )
    return self.mesh

  @property
  def size(self) -> int:
    return self.bound_mesh.shape[self.axis]

  def knows_leaf_specs(self) -> bool:
    """Whether ``leaf_specs`` can answer: ``specs`` were given, or every mesh
    axis is Explicit (the arrays' types carry their specs)."""
    return self.specs is not None or (
      self.mesh is not None and _all_explicit(self.mesh)
    )

  def bind(self, leaves, views) -> "TensorParallel | None":
    """This setting with its mesh and axis read from ``leaves``' types when
    ``mesh`` is None (see ``from_types``); itself when it has a mesh."""
    if self.mesh is not None:
      return self
    return from_types(leaves, views, self)

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
      elif self.knows_leaf_specs():
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
        if name not in self.bound_mesh.axis_names:
          raise ValueError(
            f"sharding spec {spec} of {where} names {name!r}, "
            f"not an axis of the mesh {list(self.bound_mesh.axis_names)}"
          )
      parts = math.prod(self.bound_mesh.shape[a] for a in axes)
      if dim % parts:
        raise ValueError(
          f"{where}: dimension {dim} is sharded {parts} ways by "
          f"{axes} in spec {spec}, which does not divide it"
        )
      entries.append(axes)
    return tuple(entries)


def _all_explicit(mesh) -> bool:
  return all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)


def types_mesh(leaves) -> jax.sharding.AbstractMesh | None:
  """The mesh that ``leaves``' types carry (jax's Explicit sharding), or
  None when no leaf's type names a mesh axis.

  Raises:
    ValueError: leaves typed on two different meshes, or on a mesh whose
      axes are partly Auto (their shardings are not in the types).
  """
  meshes = []
  for mesh in map(layout.explicit_mesh, leaves):
    if mesh is not None and mesh not in meshes:
      meshes.append(mesh)
  if not meshes:
    return None
  if len(meshes) > 1:
    raise ValueError(
      f"the params' types carry {len(meshes)} different meshes "
      f"({', '.join(map(str, meshes))}); Muon reads one mesh from the types: "
      "place every param on the same mesh, or pass sharding="
      "om.TensorParallel(mesh, specs=...)"
    )
  (mesh,) = meshes
  if not _all_explicit(mesh):
    raise ValueError(
      f"the params' mesh {mesh} mixes Explicit and Auto axes, so the "
      "params' types do not say how they are split over its Auto axes; "
      "make every axis Explicit (jax.make_mesh(..., axis_types=...)) or "
      "pass sharding=om.TensorParallel(mesh, specs=...)"
    )
  return mesh


def from_types(
  leaves, views, template: "TensorParallel | None" = None
) -> "TensorParallel | None":
  """The ``TensorParallel`` the Muon ``leaves``' types describe, or None
  when they carry no Explicit mesh (each device then works on what it holds,
  as without a mesh).

  The mesh and each leaf's spec are the types'. The tensor-parallel axis is
  ``template.axis`` when that mesh has it (``"model"`` by default), else the
  mesh axis that splits a matrix axis (fan-in or fan-out) of the most
  elements, the later mesh axis on a tie (the innermost, as Megatron and
  MaxText lay out TP); every other axis splitting a matrix is gathered for
  Newton–Schulz as FSDP's data axis is. Without a ``template`` (the
  ``sharding=None`` default) the mode is ``"auto"`` over the exact modes, so
  the numbers equal the unsharded update's, or ``"duplicated"`` where the
  devices' kind has no known rates (``om.KNOWN_RATES``).
  """
  mesh = types_mesh(leaves)
  if mesh is None:
    return None
  if template is None:
    known = rates_lib.rates_of(mesh) is not None
    template = TensorParallel(mesh=None, mode="auto" if known else "duplicated")
  axis = template.axis
  if axis not in mesh.axis_names:
    split = dict.fromkeys(mesh.axis_names, 0)
    for leaf, view in zip(leaves, views):
      spec = tuple(jax.typeof(leaf).sharding.spec)
      for dim in view.reduction_axes + view.output_axes:
        entry = spec[dim] if dim < len(spec) else None
        for name in (entry,) if isinstance(entry, str) else entry or ():
          split[name] += math.prod(view.shape)
    axis = max(reversed(mesh.axis_names), key=lambda name: split[name])
  return dataclasses.replace(template, mesh=mesh, axis=axis)


def resolve(sharding: "TensorParallel | None", leaves, views):
  """The ``TensorParallel`` that runs ``leaves``: ``sharding`` bound to
  their types (``TensorParallel.bind``), or for ``None`` the one their types
  describe (``from_types``); None where neither names a mesh."""
  if sharding is None:
    return from_types(leaves, views)
  return sharding.bind(leaves, views)


def check_bound(member: str, sharding: "TensorParallel | None") -> None:
  """Raises for a ``sharding`` without a mesh given to ``member``, whose
  scheme places its own state on the mesh it is given."""
  if sharding is not None and not isinstance(sharding.mesh, jax.sharding.Mesh):
    raise ValueError(
      f"sharding.mesh={sharding.mesh!r} is not accepted for {member}; "
      "accepted values: "
      "a jax.sharding.Mesh, or sharding=None, which reads a mesh with "
      "Explicit axes from the params' types"
    )


def check_sharding(sharding) -> None:
  if sharding is not None and not isinstance(sharding, TensorParallel):
    raise ValueError(
      f"sharding={sharding!r} is not accepted; accepted "
      "values: None or optax_muon.TensorParallel(mesh, ...)"
    )


def placed_as(mesh, *pairs) -> list[jax.Array]:
  """Each ``(array, spec)``'s array split as ``spec`` on ``mesh``, for a
  ``shard_map`` with those ``in_specs``: on Explicit axes ``shard_map``
  takes only arrays typed so (a state restored, or built by ``init`` from
  unsharded params, is replicated); on Auto axes it places them itself."""
  if jax.sharding.AxisType.Explicit not in mesh.axis_types:
    return [x for x, _ in pairs]
  return [
    jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, spec))
    for x, spec in pairs
  ]


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


def check_blocks(tp: TensorParallel, viewed, specs) -> None:
  """Raises, naming the leaf, where ``tp.mode="blockwise"`` would have to cut
  a fused leaf's shard into pieces it does not hold whole (a ``[gate | up]``
  kernel split along its fan-out: no shard holds both halves)."""
  if tp.mode != "blockwise":
    return
  for (path, _, view), spec in zip(viewed, specs):
    tp_dim = tp_dim_of(view, spec, tp)
    if tp_dim is None or not view.widths:
      continue
    try:
      local_view(view, local_shape(view.shape, spec, tp))
    except ValueError as error:
      raise ValueError(
        f"leaf {_paths.path_string(path) or '<root>'}: {error} "
        "(MuonConfig: muon_tp_mode, or build(split_gate_up=/split_qkv=))"
      ) from None


def local_shape(shape, spec, tp: TensorParallel):
  """The shape of this rank's tensor-parallel shard (for blockwise scaling)."""
  return tuple(
    d // tp.size if tp.axis in axes else d for d, axes in zip(shape, spec)
  )


def tp_dim_of(view: layout.MatrixView, spec, tp: TensorParallel) -> int | None:
  """The matrix axis of a leaf split over the tensor-parallel axis, or None."""
  dims = [
    d for d in view.reduction_axes + view.output_axes if tp.axis in spec[d]
  ]
  return dims[0] if dims else None


def mode_for(mode: str, view: layout.MatrixView, tp_dim) -> str:
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


def own_chunk(x, axis_name, dim):
  """This rank's chunk of ``x`` along ``dim``, split over ``axis_name``."""
  size = x.shape[dim] // jax.lax.axis_size(axis_name)
  return jax.lax.dynamic_slice_in_dim(
    x, jax.lax.axis_index(axis_name) * size, size, axis=dim
  )
