"""Dion2's ``"local"`` selection scope: each shard selects its own slices.

microsoft/dion's default on its sharded path. A matrix split over the
tensor-parallel axis into ``ranks`` shards along one of its axes is selected
along that axis (the rows of torch's ``(out, in)`` under FSDP2), each shard
on its own::

  idx_r = top-k slices of M_r by L1 norm,  k = max(1, ⌈fraction · n / ranks⌉)
  U = [M_0[idx_0]; …; M_{ranks-1}[idx_{ranks-1}]]   # ranks · k slices
  O = newton_schulz(U)                              # the sharding's mode
  M_r[idx_r] ← ef_decay · M_r[idx_r];   update_r[idx_r] = O_r

The selection, the error feedback and the scatter stay on each shard (a
``jax.shard_map``); only ``U`` and ``O`` travel, in the sharding's exact
mode (``allgather``: one all-to-all each way), so the bytes and the
Newton–Schulz FLOPs are ``fraction`` of a whole matrix's. It depends on the
sharding (each shard's best slices, not the matrix's); a matrix that is not
split over the axis is selected whole, as the ``"global"`` scope does.

NorDion2 selects output neurons, so its matrices must be split along
``fan_out`` (torch's rows, as microsoft/dion requires); each shard
normalizes its own selected neurons by their running second moments (its
slice of the variance) and rescales them to their Frobenius norm on that
shard, as dion does on each rank.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers

from optax_muon._src.kernels.dion2_selection import normalize_neurons
from optax_muon._src.kernels.dion2_selection import selected_count
from optax_muon._src.parallel.tensor_parallel import TensorParallel
from optax_muon._src.parallel.tensor_parallel import placed_as
from optax_muon._src.parallel.tensor_parallel import tp_dim_of
from optax_muon._src.views import layout as layout_lib


@dataclasses.dataclass(frozen=True)
class LocalLeaf:
  """How one leaf is selected: along leaf axis ``axis`` (``count`` slices
  per shard), the L1 norms summed over leaf axis ``other``."""

  spec: tuple  # per leaf axis, its mesh axes (TensorParallel.leaf_specs)
  axis: int
  other: int
  count: int

  @property
  def partition_spec(self) -> P:
    return P(*(axes or None for axes in self.spec))

  @property
  def index_spec(self) -> P:
    """The indices' spec: the same on every rank of the summed axis."""
    return P(
      *(
        None if d == self.other else axes or None
        for d, axes in enumerate(self.spec)
      )
    )

  def kinds(self, ndim: int) -> str:
    """Each axis: ``s`` selected, ``o`` the other matrix axis, ``b`` batch."""
    return "".join(
      "s" if d == self.axis else "o" if d == self.other else "b"
      for d in range(ndim)
    )

  @property
  def variance_spec(self) -> P:
    """NorDion2's ``(matrices, 1, fan_out)`` variance, split as the leaf's
    batch axis (at most one is split) and its selected ``fan_out``."""
    batch = [
      axes
      for d, axes in enumerate(self.spec)
      if d not in (self.axis, self.other)
    ]
    split = [axes for axes in batch if axes]
    return P(split[0] if split else None, None, self.spec[self.axis] or None)

  def dimension_numbers(self) -> MuonDimensionNumbers:
    return MuonDimensionNumbers(
      reduction_axis=min(self.axis, self.other),
      output_axis=max(self.axis, self.other),
    )


def plan(
  view: layout_lib.MatrixView,
  spec,
  tp: TensorParallel,
  fraction,
  neurons: bool = False,
) -> LocalLeaf | None:
  """The leaf's local selection, or ``None`` when it is not split over the
  tensor-parallel axis along a matrix axis (then local is global).
  ``neurons``: NorDion2's, which must be split along ``fan_out``."""
  tp_dim = tp_dim_of(view, spec, tp)
  if tp_dim is None:
    return None
  if neurons and tp_dim not in view.output_axes:
    raise ValueError(
      f"NorDion2's selection_scope='local' selects each shard's output "
      f"neurons, but a leaf of shape {view.shape} is split over the "
      f"tensor-parallel axis along its fan-in axis {tp_dim} (microsoft/dion "
      "refuses it too); accepted: leaves split along fan_out, or "
      "selection_scope='global' (MuonConfig: dion2_selection_scope='global')"
    )
  batch_split = [
    d
    for d, axes in enumerate(spec)
    if axes and d not in (*view.reduction_axes, *view.output_axes)
  ]
  if neurons and len(batch_split) > 1:
    raise ValueError(
      f"NorDion2's selection_scope='local' keeps one variance per matrix; a "
      f"leaf of shape {view.shape} has several split batch axes "
      f"{batch_split}; accepted: at most one, or selection_scope='global'"
    )
  if view.widths or len(view.reduction_axes) + len(view.output_axes) != 2:
    raise ValueError(
      f"selection_scope='local' selects each shard's slices of a leaf with one "
      f"fan-in and one fan-out axis; a leaf of shape {view.shape} seen with "
      f"reduction axes {view.reduction_axes}, output axes "
      f"{view.output_axes}{' and split pieces' if view.widths else ''} is "
      "split over the tensor-parallel axis; accepted: "
      "selection_scope='global' for such leaves' trees (MuonConfig: "
      "dion2_selection_scope='global'), or the leaf as one matrix (no "
      "split_qkv / split_gate_up)"
    )
  other = (
    view.output_axes[0]
    if tp_dim in view.reduction_axes
    else view.reduction_axes[0]
  )
  per_shard = view.shape[tp_dim] // tp.size
  count = selected_count(fraction, per_shard)
  return LocalLeaf(tuple(spec), tp_dim, other, count)


def _summed_over(norms, axes):
  return jax.lax.psum(norms, axes) if axes else norms


def _per_matrix(core, kinds: str):
  """``core(kinds, *arrays)`` on one matrix, mapped over the batch axes:
  ``kinds`` names each axis ``b`` (batch), ``s`` (selected) or ``o`` (the
  other matrix axis). Whole slices are gathered and scattered per index
  (a ``k``-long index per matrix), never an index per element."""
  if "b" not in kinds:
    return lambda *arrays: core(kinds, *arrays)
  axis = kinds.index("b")
  inner = _per_matrix(core, kinds[:axis] + kinds[axis + 1 :])
  return jax.vmap(inner, in_axes=axis, out_axes=axis)


def _take(kinds, m, index):
  return jnp.take(m, index.reshape(-1), axis=kinds.index("s"))


def _put(kinds, o, index, like):
  where = [slice(None)] * 2
  where[kinds.index("s")] = index.reshape(-1)
  return jnp.zeros(like.shape, o.dtype).at[tuple(where)].set(o)


def select(leaf: LocalLeaf, momentum, gradient, ef_decay, mesh):
  """Each shard's top slices of ``M = momentum + gradient``: ``(selected,
  M decayed where selected, indices)``, global arrays; ``selected`` has
  ``ranks · count`` slices along the selection axis, sharded as the
  momentum. The sum is taken on each shard, so no whole ``M`` is built
  beside the new momentum."""

  def body(m, g):
    m = m + g.astype(m.dtype)
    norms = jnp.sum(jnp.abs(m.astype(jnp.float32)), leaf.other, keepdims=True)
    norms = _summed_over(norms, leaf.spec[leaf.other])
    _, index = jax.lax.top_k(jnp.moveaxis(norms, leaf.axis, -1), leaf.count)
    chosen = jnp.any(
      jax.nn.one_hot(index, m.shape[leaf.axis], dtype=jnp.bool_), axis=-2
    )
    index = jnp.moveaxis(index, -1, leaf.axis)
    chosen = jnp.moveaxis(chosen, -1, leaf.axis)
    selected = _per_matrix(_take, leaf.kinds(m.ndim))(m, index)
    decayed = jnp.where(chosen, jnp.asarray(ef_decay, m.dtype) * m, m)
    return selected, decayed, index

  spec = leaf.partition_spec
  return jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(spec, spec),
    out_specs=(spec, spec, leaf.index_spec),
    check_vma=False,
  )(*placed_as(mesh, (momentum, spec), (gradient, spec)))


def _as_stack(x, kinds: str):
  """``x`` as ``(matrices, other, selected)`` (batch axes flattened, in
  order), and the function that puts such a stack back as ``x``."""
  order = [d for d, k in enumerate(kinds) if k == "b"]
  order += [kinds.index("o"), kinds.index("s")]
  moved = jnp.transpose(x, order)
  stack = moved.reshape((-1, *moved.shape[-2:]))

  def back(y):
    return jnp.transpose(y.reshape(moved.shape), np.argsort(order))

  return stack, back


def _normalized(leaf: LocalLeaf, mesh, o, index, variance, beta2):
  """NorDion2's normalization of one shard's selected neurons ``o``, their
  fan-in sums totalled over any mesh axis splitting ``fan_in``."""
  kinds = leaf.kinds(o.ndim)
  stack, back = _as_stack(o, kinds)
  indices, _ = _as_stack(index, kinds)
  axes = leaf.spec[leaf.other]
  normalized, variance = normalize_neurons(
    stack,
    variance,
    indices[:, 0, :],
    beta2,
    summed=lambda x: _summed_over(x, axes),
    shards=math.prod(mesh.shape[a] for a in axes),
  )
  return back(normalized), variance


def scatter(
  leaf: LocalLeaf,
  orthogonal,
  index,
  shape_like,
  mesh,
  scale,
  variance=None,
  beta2=None,
):
  """The update: zeros of ``shape_like``'s shape with ``scale`` of
  ``orthogonal``'s slices at ``index`` on each shard (scaled before they
  are put back: a scale after would build a second leaf-sized array). With
  NorDion2's ``variance``, the slices are first normalized on each shard;
  then ``(update, new variance)``."""
  kinds = leaf.kinds(shape_like.ndim)

  def body(o, i, like, *v):
    if v:
      o, new_variance = _normalized(leaf, mesh, o, i, v[0], beta2)
    put = _per_matrix(_put, kinds)(scale(o.astype(like.dtype)), i, like)
    return (put, new_variance) if v else put

  spec = leaf.partition_spec
  in_specs: tuple[P, ...] = (spec, leaf.index_spec, spec)
  out_specs: P | tuple[P, P] = spec
  operands: tuple = (orthogonal, index, shape_like)
  if variance is not None:
    in_specs += (leaf.variance_spec,)
    out_specs = (spec, leaf.variance_spec)
    operands += (variance,)
  return jax.shard_map(
    body,
    mesh=mesh,
    in_specs=in_specs,
    out_specs=out_specs,
    check_vma=False,
  )(*placed_as(mesh, *zip(operands, in_specs)))
