"""How a leaf is viewed as a batch of matrices.

A Muon leaf of any rank is seen as ``(batch, fan_in, fan_out)`` through
``optax.contrib.MuonDimensionNumbers`` (reduction axes = fan-in, output axes =
fan-out, every other axis a batch axis). A fused QKV kernel is further split
along fan-out into its Q, K and V matrices (``SplitQKV``), each one a matrix
of its own for orthogonalization and scaling.
"""

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from optax.contrib import MuonDimensionNumbers

from optax_muon._src.base import paths as _paths

QKV_LAYOUTS = ("grouped", "concatenated")


@dataclasses.dataclass(frozen=True)
class SplitQKV:
  """Split a fused QKV kernel ``(in, G·(q + k + v))`` into Q, K and V.

  Q spans all heads (``num_heads · head_dim`` wide), K and V all query groups
  (``num_kv_heads · head_dim`` each), as Megatron-Core splits them: whole
  matrices, not per head.

  Attributes:
    num_heads: query heads ``H``.
    num_kv_heads: key/value heads, the query groups ``G`` (divides ``H``).
    head_dim: width of one head.
    layout: ``"grouped"`` (Megatron: per group ``[q_g | k_g | v_g]``, groups
      one after the other) or ``"concatenated"`` (``[Q | K | V]``).
    pattern: regex found in a leaf's path (lower-cased, ``/``-joined) that
      marks it as a fused QKV kernel, when ``SplitQKV`` is given for all leaves.
  """

  num_heads: int
  num_kv_heads: int
  head_dim: int
  layout: str = "grouped"
  pattern: str = "qkv"

  def __post_init__(self):
    for name in ("num_heads", "num_kv_heads", "head_dim"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
          f"split_qkv.{name} must be a positive int, got {value!r}"
        )
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"split_qkv.num_kv_heads={self.num_kv_heads} must divide "
        f"split_qkv.num_heads={self.num_heads}"
      )
    if self.layout not in QKV_LAYOUTS:
      raise ValueError(
        f"split_qkv.layout={self.layout!r} is not accepted; "
        f"accepted values: {list(QKV_LAYOUTS)}"
      )

  def groups_and_widths_for(self, fan_out: int):
    del fan_out  # the head counts fix the widths
    return self.groups_and_widths

  @property
  def groups_and_widths(self) -> tuple[int, tuple[int, int, int]]:
    """The fan-out axis as ``groups × (q, k, v)`` widths."""
    q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
    if self.layout == "concatenated":
      return 1, (q, kv, kv)
    group_q = self.num_heads // self.num_kv_heads * self.head_dim
    return self.num_kv_heads, (group_q, self.head_dim, self.head_dim)


@dataclasses.dataclass(frozen=True)
class SplitGateUp:
  """Split a fused gated-MLP kernel ``(in, 2·ffn)`` (SwiGLU, GeGLU) into its
  gate and up matrices, each orthogonalized and scaled on its own, as
  Megatron-Core does for a gated ``linear_fc1`` (``is_gated_fc1``).

  Attributes:
    groups: ``1``: the fan-out is ``[gate | up]``; ``G``: it is ``G`` groups
      of ``[gate_g | up_g]``, the layout of a kernel whose fan-out is
      sharded ``G`` ways with each shard holding its own gate and up halves
      (Megatron's ``partition_stride=2``), which ``blockwise`` needs.
    pattern: regex found in a leaf's path (lower-cased, ``/``-joined) that
      marks it as fused, when ``SplitGateUp`` is given for all leaves.
  """

  groups: int = 1
  pattern: str = "gate_up"

  def __post_init__(self):
    if (
      isinstance(self.groups, bool)
      or not isinstance(self.groups, int)
      or (self.groups < 1)
    ):
      raise ValueError(
        f"split_gate_up.groups must be a positive int, got {self.groups!r}"
      )

  def groups_and_widths_for(self, fan_out: int) -> tuple[int, tuple[int, int]]:
    half = fan_out // (2 * self.groups)
    return self.groups, (half, half)


@dataclasses.dataclass(frozen=True)
class MatrixView:
  """A leaf seen as ``(batch, fan_in, fan_out)``, maybe split along fan-out."""

  shape: tuple[int, ...]
  batch_axes: tuple[int, ...]
  reduction_axes: tuple[int, ...]
  output_axes: tuple[int, ...]
  groups: int = 1
  widths: tuple[int, ...] = ()

  @property
  def permutation(self) -> tuple[int, ...]:
    return self.batch_axes + self.reduction_axes + self.output_axes

  @property
  def batch_shape(self) -> tuple[int, ...]:
    return tuple(self.shape[a] for a in self.batch_axes)

  @property
  def fan_in(self) -> int:
    return math.prod(self.shape[a] for a in self.reduction_axes)

  @property
  def fan_out(self) -> int:
    return math.prod(self.shape[a] for a in self.output_axes)

  @property
  def matrix_shapes(self) -> list[tuple[int, int]]:
    """``(fan_in, fan_out)`` of each matrix piece."""
    widths = self.widths or (self.fan_out,)
    return [(self.fan_in, self.groups * w) for w in widths]

  def to_matrices(self, x: jax.Array) -> list[jax.Array]:
    """The leaf as pieces of shape ``(batch, fan_in, fan_out_i)``.

    A leaf typed as split over a mesh's Explicit axes is cut by XLA (jax's
    ``auto_axes``): its pieces keep the splits of its one batch, fan-in and
    fan-out axis where a piece's size divides by them
    (``piece_sharding``), so a fused kernel split along its fan-out is cut
    into its pieces with no error about an ambiguous sharding."""
    sharding = explicit_sharding(x)
    if sharding is None:
      return self._to_matrices(x)
    return jax.sharding.auto_axes(
      self._to_matrices,
      out_sharding=[
        self.piece_sharding(sharding, w) for _, w in self.matrix_shapes
      ],
    )(x)

  def piece_sharding(self, sharding, width: int):
    """The sharding of a ``(batch, fan_in, width)`` piece of a leaf sharded
    as ``sharding``: each of the leaf's batch, fan-in and fan-out axes that
    is alone (not merged with another) keeps its split where it divides the
    piece's size; the rest are whole."""
    spec = tuple(sharding.spec) + (None,) * (
      len(self.shape) - len(sharding.spec)
    )
    mesh = sharding.mesh
    entries = []
    for axes, size in (
      (self.batch_axes, math.prod(self.batch_shape)),
      (self.reduction_axes, self.fan_in),
      (self.output_axes, width),
    ):
      entry = spec[axes[0]] if len(axes) == 1 else None
      names = (entry,) if isinstance(entry, str) else tuple(entry or ())
      parts = math.prod(mesh.shape[n] for n in names)
      entries.append(entry if names and size % parts == 0 else None)
    return jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(*entries)
    )

  def _to_matrices(self, x: jax.Array) -> list[jax.Array]:
    batch = math.prod(self.batch_shape)
    flat = jnp.transpose(x, self.permutation).reshape(
      batch, self.fan_in, self.fan_out
    )
    if not self.widths:
      return [flat]
    grouped = flat.reshape(batch, self.fan_in, self.groups, sum(self.widths))
    starts = [sum(self.widths[:i]) for i in range(len(self.widths))]
    return [
      grouped[..., s : s + w].reshape(batch, self.fan_in, self.groups * w)
      for s, w in zip(starts, self.widths)
    ]

  def from_matrices(
    self, pieces: Sequence[jax.Array], like: jax.Array | None = None
  ) -> jax.Array:
    """Inverse of ``to_matrices``; pieces typed as split over a mesh's
    Explicit axes are put together by XLA as the leaf ``like`` is split (or,
    without it, as ``to_matrices`` split them)."""
    sharding = next(
      (s for s in map(explicit_sharding, pieces) if s is not None), None
    )
    if sharding is None:
      return self._from_matrices(pieces)
    out = explicit_sharding(like) if like is not None else None
    if out is None:
      out = self.leaf_sharding(sharding)
    return jax.sharding.auto_axes(self._from_matrices, out_sharding=out)(
      list(pieces)
    )

  def leaf_sharding(self, piece_sharding):
    """The leaf's sharding that ``piece_sharding`` came from (the inverse
    of ``piece_sharding``, where it split an axis)."""
    entries = [None] * len(self.shape)
    for axes, entry in zip(
      (self.batch_axes, self.reduction_axes, self.output_axes),
      tuple(piece_sharding.spec) + (None,) * 3,
    ):
      if len(axes) == 1:
        entries[axes[0]] = entry
    return jax.sharding.NamedSharding(
      piece_sharding.mesh, jax.sharding.PartitionSpec(*entries)
    )

  def _from_matrices(self, pieces: Sequence[jax.Array]) -> jax.Array:
    batch = math.prod(self.batch_shape)
    if self.widths:
      flat = jnp.concatenate(
        [
          p.reshape(batch, self.fan_in, self.groups, w)
          for p, w in zip(pieces, self.widths)
        ],
        axis=-1,
      ).reshape(batch, self.fan_in, self.fan_out)
    else:
      (flat,) = pieces
    permuted_shape = tuple(self.shape[a] for a in self.permutation)
    inverse = tuple(
      sorted(range(len(self.shape)), key=lambda i: self.permutation[i])
    )
    return jnp.transpose(flat.reshape(permuted_shape), inverse)


def explicit_mesh(x):
  """The mesh ``x``'s type places it on where that mesh has Explicit axes
  (jax's sharding in types), else None (no mesh, an Auto one, or inside
  ``shard_map``, where the axes are Manual)."""
  mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
  if (
    mesh is None
    or mesh.empty
    or jax.sharding.AxisType.Explicit not in mesh.axis_types
  ):
    return None
  return mesh


def explicit_sharding(x) -> jax.sharding.NamedSharding | None:
  """``x``'s sharding where its type splits it over a mesh's Explicit axes
  (``explicit_mesh``), else None."""
  if explicit_mesh(x) is None:
    return None
  sharding = jax.typeof(x).sharding
  if not any(entry is not None for entry in sharding.spec):
    return None
  return sharding


def torch_oriented(view: MatrixView) -> MatrixView:
  """``view`` with a square, unsplit matrix seen as ``(fan_out, fan_in)``:
  torch's Muon iterates a square weight as it holds it, ``(out, in)``, and
  a bf16 iteration's rounding depends on the orientation (the exact result
  does not). Other matrices are iterated wide either way: unchanged."""
  if view.widths or view.fan_in != view.fan_out:
    return view
  return dataclasses.replace(
    view, reduction_axes=view.output_axes, output_axes=view.reduction_axes
  )


def _normalize_axes(name: str, axes, ndim: int, where: str) -> tuple[int, ...]:
  axes = (axes,) if isinstance(axes, int) else tuple(axes)
  if not axes:
    raise ValueError(f"dimension_numbers.{name} of {where} is empty")
  for axis in axes:
    if (
      isinstance(axis, bool)
      or not isinstance(axis, int)
      or not (-ndim <= axis < ndim)
    ):
      raise ValueError(
        f"dimension_numbers.{name}={axes} of {where} names an axis outside "
        f"the array's {ndim} axes (accepted: ints in [{-ndim}, {ndim}))"
      )
  normalized = tuple(a % ndim for a in axes)
  if len(set(normalized)) != len(normalized):
    raise ValueError(
      f"dimension_numbers.{name}={axes} of {where} repeats an axis"
    )
  return normalized


LEADING = "leading"


def matrix_view(
  shape: Sequence[int],
  dimension_numbers: MuonDimensionNumbers | str | None = None,
  split_qkv: "SplitQKV | SplitGateUp | None" = None,
  where: str = "a leaf",
) -> MatrixView:
  """The ``MatrixView`` of a leaf of ``shape``.

  Args:
    shape: the leaf's shape, at least 2 axes.
    dimension_numbers: which axes are fan-in and fan-out; ``None``: a 2-axis
      leaf is ``(in, out)`` (Flax kernels); ``"leading"``: the last two axes
      are ``(in, out)`` and the rest batch axes.
    split_qkv: split fan-out into Q, K and V (``SplitQKV``) or into gate
      and up (``SplitGateUp``).
    where: how errors name the leaf (its path).

  Returns:
    The view.

  Raises:
    ValueError: a leaf with fewer than 2 axes, one with more and no
      dimension numbers, dimension numbers that overlap or miss the array,
      or a fused QKV width that the split does not give.
  """
  shape = tuple(int(d) for d in shape)
  ndim = len(shape)
  if ndim < 2:
    raise ValueError(
      f"{where} of shape {shape} has fewer than 2 axes and cannot be a Muon "
      "matrix; route it to the scalar optimizer (labels=...)"
    )
  if dimension_numbers is None and ndim > 2:
    raise ValueError(unviewed_message([(where, shape)]))
  reduction: tuple[int, ...]
  output: tuple[int, ...]
  if dimension_numbers is None or dimension_numbers == LEADING:
    reduction, output = (ndim - 2,), (ndim - 1,)
  elif isinstance(dimension_numbers, MuonDimensionNumbers):
    reduction = _normalize_axes(
      "reduction_axis", dimension_numbers.reduction_axis, ndim, where
    )
    output = _normalize_axes(
      "output_axis", dimension_numbers.output_axis, ndim, where
    )
    if set(reduction) & set(output):
      raise ValueError(
        f"dimension_numbers of {where}: reduction_axis {reduction} and "
        f"output_axis {output} overlap; they must be disjoint"
      )
  else:
    raise TypeError(
      f"dimension_numbers of {where} must be optax.contrib."
      f"MuonDimensionNumbers, {LEADING!r} or None, got {dimension_numbers!r}"
    )
  batch = tuple(a for a in range(ndim) if a not in reduction + output)
  view = MatrixView(shape, batch, reduction, output)
  if split_qkv is None:
    return view
  groups, widths = split_qkv.groups_and_widths_for(view.fan_out)
  if view.fan_out != groups * sum(widths):
    name = "split_qkv" if isinstance(split_qkv, SplitQKV) else "split_gate_up"
    raise ValueError(
      f"{name}={split_qkv} expects a fused fan-out of "
      f"{groups * sum(widths)} (= {groups} × {sum(widths)}), but {where} "
      f"of shape {shape} has fan-out {view.fan_out}"
    )
  return dataclasses.replace(view, groups=groups, widths=widths)


def unviewed_message(leaves) -> str:
  """The error for Muon leaves of 3+ axes without dimension numbers:
  ``leaves`` are ``(where, shape)`` pairs."""
  listed = "; ".join(f"{where} {shape}" for where, shape in leaves)
  return (
    f"{len(leaves)} Muon leaf/leaves with 3 or more axes and no dimension "
    f"numbers, so which axes form the matrices is unknown: {listed}. "
    "Read them from the model with layout=om.infer_layout(model, batch), "
    "give them by hand with dimension_numbers={path: optax.contrib."
    "MuonDimensionNumbers(reduction_axis=..., output_axis=...)}, opt in to "
    "leading axes as batch and the last two as (in, out) with "
    f"dimension_numbers={LEADING!r}, or route them to AdamW with labels="
  )


def view_resolver(dimension_numbers=None, split_qkv=None, split_gate_up=None):
  """A function ``tree -> [(path, leaf, MatrixView)]`` for the given settings.

  Args:
    dimension_numbers: ``None``, ``"leading"`` or one
      ``MuonDimensionNumbers`` for all leaves, a tree of them (a
      ``_paths.FromLayout`` tree may cover more leaves), or a function of the
      params returning such a tree.
    split_qkv: ``None``, one ``SplitQKV`` (applied to leaves whose path matches
      its ``pattern``), a tree of ``SplitQKV``, or a function.
    split_gate_up: the same with ``SplitGateUp``; a leaf may not have both.

  Returns:
    The resolver; it raises ``ValueError`` for leaves that cannot be viewed
    (all leaves of 3+ axes without dimension numbers in one error).
  """
  if isinstance(dimension_numbers, str) and dimension_numbers != LEADING:
    raise ValueError(
      f"dimension_numbers={dimension_numbers!r} is not accepted; accepted: "
      f"{LEADING!r}, an optax.contrib.MuonDimensionNumbers, a tree of them "
      "or a function of the params"
    )
  dims_lookup = _paths.PathLookup(
    "dimension_numbers",
    dimension_numbers,
    (MuonDimensionNumbers, str),
    type_name=f"an optax.contrib.MuonDimensionNumbers (or {LEADING!r})",
  )
  splits = [
    (_paths.PathLookup(name, spec, kind), isinstance(spec, kind))
    for name, spec, kind in (
      ("split_qkv", split_qkv, SplitQKV),
      ("split_gate_up", split_gate_up, SplitGateUp),
    )
  ]

  def resolve(tree):
    leaves, _ = _paths.leaves_with_paths(tree)
    dims_of = dims_lookup.resolve(tree)
    split_ofs = [
      (lookup.resolve(tree), is_pattern) for lookup, is_pattern in splits
    ]
    where = lambda path: f"leaf {_paths.path_string(path) or '<root>'}"
    unviewed = [
      (where(path), tuple(jnp.shape(leaf)))
      for path, leaf in leaves
      if jnp.ndim(leaf) > 2 and dims_of(path) is None
    ]
    if unviewed:
      raise ValueError(unviewed_message(unviewed))
    views = []
    for path, leaf in leaves:
      found = [
        split
        for split_of, is_pattern in split_ofs
        if (split := split_of(path)) is not None
        and not (is_pattern and not _paths.matches([split.pattern], path))
      ]
      if len(found) > 1:
        raise ValueError(
          f"{where(path)} gets both split_qkv and "
          "split_gate_up; a fused kernel is one or the other"
        )
      split = found[0] if found else None
      views.append(
        (
          path,
          leaf,
          matrix_view(jnp.shape(leaf), dims_of(path), split, where(path)),
        )
      )
    return views

  return resolve


def from_layout(layout, labels, dimension_numbers):
  """``(labels, dimension_numbers)`` from ``layout=``, or as given.

  Raises:
    ValueError: ``layout`` together with ``labels`` or ``dimension_numbers``.
    TypeError: a ``layout`` that is not an ``om.Layout``.
  """
  if layout is None:
    return labels, dimension_numbers
  given = [
    name
    for name, value in (
      ("labels", labels),
      ("dimension_numbers", dimension_numbers),
    )
    if value is not None
  ]
  if given:
    raise ValueError(
      f"layout= gives the labels and dimension numbers, but {given[0]}= was "
      "also set; pass layout= alone, or labels=/dimension_numbers= without "
      "layout="
    )
  if not (hasattr(layout, "labels") and hasattr(layout, "dimension_numbers")):
    raise TypeError(
      f"layout must be an om.Layout (from om.infer_layout), got "
      f"{type(layout).__name__}"
    )
  shapes = getattr(layout, "shapes", None)
  return (
    _paths.FromLayout(layout.labels, shapes),
    _paths.FromLayout(layout.dimension_numbers, shapes),
  )
