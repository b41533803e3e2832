"""Dion2 and NorDion2: orthogonalize only a selected fraction of each matrix.

For each matrix ``M`` (``fan_in × fan_out``) of a Muon leaf, as
microsoft/dion's ``Dion2`` computes it::

  M ← M + g                                  # accumulate, no decay
  idx = top-k slices of M by L1 norm         # along the shorter axis
  U = M[idx];  M[idx] ← ef_decay · M[idx]    # error feedback
  O = zeros;  O[idx] = newton_schulz(U)
  update = scale_factor(fan_out, fan_in) · extra · O

with ``k = max(1, ⌈fraction · n⌉)`` of the ``n`` slices. Only the selected
rows (or columns) are orthogonalized and updated; the others keep
accumulating until they are large enough to be selected. ``fraction=1``
with ``ef_decay=β`` is Muon with plain (``"sgd"``-style, non-Nesterov)
momentum. NorDion2 selects output neurons (``fan_out`` slices) always,
with ``ef_decay`` its momentum ``β``, and normalizes each selected neuron
by a running second moment (NorMuon's), keeping ``‖O[idx]‖_F``.

The selection scope is the whole matrix (microsoft/dion's ``"global"``):
the result does not depend on how the matrix is sharded.
"""

import math
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_muon._src.base import checks as _checks
from optax_muon._src.base import types
from optax_muon._src.optimizers import settings
from optax_muon._src.optimizers.route import route
from optax_muon._src.transforms import orthogonalize as orthogonalize_lib
from optax_muon._src.transforms import scaling
from optax_muon._src.transforms.momentum import canonical_dtype
from optax_muon._src.transforms.scaling import resolve_extra_scale_factor
from optax_muon._src.views import layout as layout_lib
from optax_muon._src.views.layout import from_layout

# microsoft/dion's NorMuon normalization: ``U / (√v + 1e-8)``, and the floor
# of the Frobenius norm it rescales by
_NORMUON_EPS = 1e-8


class Dion2State(NamedTuple):
  """Per leaf, the momentum (the leaf's shape); for NorDion2 also, per
  matrix piece, the output neurons' second moment ``(matrices, 1, fan_out)``
  in float32 (``None`` for Dion2)."""

  momentum: Any
  variance: Any


def explicit_sharding(x):
  """The explicit ``NamedSharding`` of ``x`` (``None`` when it has none:
  no mesh, or Auto axes, where XLA's partitioner places the selection)."""
  sharding = jax.typeof(x).sharding
  spec = getattr(sharding, "spec", None)
  explicit = spec is not None and any(a is not None for a in spec)
  return sharding if explicit else None


def replicated(x):
  """``x`` replicated when it is explicitly sharded: the top-k and its
  gather and scatter read whole matrices (the selection is global)."""
  if explicit_sharding(x) is None:
    return x
  return jax.sharding.reshard(
    x, NamedSharding(jax.typeof(x).sharding.mesh, P())
  )


def resharded(x, sharding):
  return x if sharding is None else jax.sharding.reshard(x, sharding)


def selected_count(fraction: float, slices: int) -> int:
  """``max(1, ⌈fraction · slices⌉)``: how many slices a step orthogonalizes."""
  return max(1, math.ceil(fraction * slices))


def selection_axis(fan_in: int, fan_out: int, neurons: bool) -> int:
  """The axis of a ``(matrices, fan_in, fan_out)`` stack whose slices are
  selected: output neurons (``-1``) for NorDion2; for Dion2 the shorter
  axis, output neurons on a tie (microsoft/dion's rows of ``(out, in)``)."""
  return -1 if neurons or fan_out <= fan_in else -2


def _select(m: jax.Array, count: int, axis: int):
  """The ``count`` slices of ``m`` along ``axis`` of largest L1 norm: their
  indices ``(matrices, count)`` and the submatrices."""
  norms = jnp.sum(jnp.abs(m.astype(jnp.float32)), axis=-1 if axis == -2 else -2)
  _, index = jax.lax.top_k(norms, count)
  expand = index[:, None, :] if axis == -1 else index[:, :, None]
  return index, jnp.take_along_axis(m, expand, axis=axis)


def _scatter(shape, index, selected, axis):
  """A zero array of ``shape`` holding ``selected`` at ``index`` along
  ``axis`` (the inverse of ``_select`` off the selected slices)."""
  batch = jnp.arange(shape[0])[:, None]
  out = jnp.zeros(shape, selected.dtype)
  if axis == -1:  # out[b, :, index[b, j]] = selected[b, :, j]
    return out.at[batch, :, index].set(jnp.swapaxes(selected, -1, -2))
  return out.at[batch, index, :].set(selected)


def _selected_mask(n: int, index: jax.Array, axis: int) -> jax.Array:
  """Booleans ``(matrices, n, 1)`` or ``(matrices, 1, n)``: the selected."""
  chosen = jnp.zeros(index.shape[:1] + (n,), bool)
  chosen = chosen.at[jnp.arange(index.shape[0])[:, None], index].set(True)
  return chosen[:, None, :] if axis == -1 else chosen[:, :, None]


def _normalize_neurons(o, v, index, beta2):
  """NorMuon's step on the selected neurons ``o`` ``(matrices, fan_in, k)``:
  their second moments (taken from ``v`` at ``index``) move toward the mean
  square over ``fan_in``; ``o`` is divided by their root and rescaled to its
  Frobenius norm. Returns ``(normalized o, v with those moments written)``."""
  o = o.astype(jnp.float32)
  moment = jnp.take_along_axis(v, index[:, None, :], axis=-1)
  moment = moment + (1 - beta2) * (
    jnp.mean(jnp.square(o), axis=-2, keepdims=True) - moment
  )
  normalized = o / (jnp.sqrt(moment) + _NORMUON_EPS)
  norm = lambda x: jnp.sqrt(
    jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True)
  )
  normalized = normalized * (
    norm(o) / jnp.maximum(norm(normalized), _NORMUON_EPS)
  )
  batch = jnp.arange(v.shape[0])[:, None]
  v = v.at[batch, 0, index].set(moment[:, 0, :])
  return normalized, v


def scale_by_dion2(
  *,
  fraction: types.Numeric = 0.25,
  ef_decay: types.Numeric = 0.95,
  normalize_neurons: bool = False,
  beta2: types.Numeric = 0.95,
  mu_dtype: types.MomentumDtype = None,
  coefficients: types.Coefficients = "polar_express_dion",
  steps: types.Steps = 5,
  precision: types.Precision = "highest",
  method: types.Method = "standard",
  scale_mode: types.ScaleMode = "unit_rms_norm",
  extra_scale_factor: types.Numeric | None = None,
  match_adamw_update_rms: bool = False,
  adamw_beta1: types.Numeric = 0.9,
  dimension_numbers: types.PerLeaf = None,
  split_qkv: types.PerLeaf = None,
  split_gate_up: types.PerLeaf = None,
  preconditioning: types.Preconditioning = "frobenius",
  layout: Any = None,
  memory_budget: int | None = None,
) -> optax.GradientTransformation:
  r"""Dion2's direction (NorDion2's with ``normalize_neurons``): see the
  module docstring for the update.

  ``mu_dtype``, ``coefficients``, ``steps``, ``precision``, ``method``,
  ``preconditioning``, ``memory_budget``, ``extra_scale_factor``,
  ``match_adamw_update_rms``, ``dimension_numbers``, ``split_qkv``,
  ``split_gate_up`` and ``layout`` are ``scale_by_muon``'s; the defaults of
  ``coefficients`` (Polar Express as microsoft/dion ships it) and
  ``scale_mode`` (``"unit_rms_norm"``: its ``adjust_lr="spectral_norm"``,
  ``√(fan_out/fan_in)`` of the whole matrix) are microsoft/dion's.
  ``beta``, ``nesterov`` and ``momentum_style`` do not apply: the momentum
  is a plain sum whose selected slices decay by ``ef_decay``; nor does
  ``sharding`` yet (see ``dion2``).

  Args:
    fraction: the share of slices orthogonalized per step, in ``(0, 1]``.
    ef_decay: the error-feedback decay of the selected slices, in
      ``[0, 1]``.
    normalize_neurons: NorDion2: select output neurons and normalize them
      by a running second moment.
    beta2: that second moment's decay, in ``[0, 1)``.

  Returns:
    An ``optax.GradientTransformation`` whose state is a ``Dion2State``.

  References:
    Ahn et al., `Dion2 <https://arxiv.org/abs/2512.16928>`_, 2025;
    microsoft/dion ``dion/dion2.py``, ``dion/nordion2.py``
  """
  if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
    raise ValueError(
      f"fraction={fraction!r} is not accepted; accepted values: a number "
      "in (0, 1]"
    )
  if not 0 < fraction <= 1:
    raise ValueError(
      f"fraction={fraction!r} is not accepted; accepted values: (0, 1]"
    )
  _checks.check_range("ef_decay", ef_decay, 0.0, 1.0 + 1e-12)
  _checks.check_range("beta2", beta2, 0.0, 1.0)
  _checks.check_choice("scale_mode", scale_mode, scaling.SCALE_MODES)
  mu_dtype = canonical_dtype("mu_dtype", mu_dtype)
  _, dimension_numbers = from_layout(layout, None, dimension_numbers)
  extra = resolve_extra_scale_factor(
    extra_scale_factor, match_adamw_update_rms, adamw_beta1
  )
  arguments = dict(locals(), layout=None)
  # the selected submatrices are whole matrices of their own: a stack
  # (matrices, fan_in or k, k or fan_out) each, its leading axis a batch
  orthogonalize = orthogonalize_lib.orthogonalize(
    **settings.forward(
      orthogonalize_lib.orthogonalize,
      arguments,
      dimension_numbers="leading",
      split_qkv=None,
      split_gate_up=None,
    )
  )
  resolve_views = layout_lib.view_resolver(
    dimension_numbers, split_qkv, split_gate_up
  )

  def init_fn(params):
    momentum = jax.tree.map(
      lambda p: jnp.zeros_like(p, dtype=mu_dtype or jnp.result_type(p)), params
    )
    if not normalize_neurons:
      return Dion2State(momentum, None)
    variance = [
      tuple(
        jnp.zeros_like(piece[:, :1, :], jnp.float32)
        for piece in view.to_matrices(replicated(leaf))
      )
      for _, leaf, view in resolve_views(params)
    ]
    treedef = jax.tree.structure(params)
    return Dion2State(momentum, jax.tree.unflatten(treedef, variance))

  def update_fn(updates, state, params=None):
    del params
    treedef = jax.tree.structure(updates)
    specs = [
      explicit_sharding(m) for m in treedef.flatten_up_to(state.momentum)
    ]
    momenta = jax.tree.map(
      lambda m, g: replicated(m + g.astype(m.dtype)), state.momentum, updates
    )
    views = resolve_views(momenta)
    variances = (
      treedef.flatten_up_to(state.variance)
      if normalize_neurons
      else [None] * len(views)
    )
    selections, submatrices = [], []
    for _, m, view in views:
      for piece in view.to_matrices(m):
        axis = selection_axis(
          piece.shape[-2], piece.shape[-1], normalize_neurons
        )
        count = selected_count(fraction, piece.shape[axis])
        index, sub = _select(piece, count, axis)
        selections.append((piece, index, axis))
        submatrices.append(sub)
    orthogonal, _ = orthogonalize.update(submatrices, optax.EmptyState())
    results = iter(zip(selections, orthogonal))
    directions, new_momenta, new_variances = [], [], []
    for (_, m, view), leaf_variance, spec in zip(views, variances, specs):
      pieces, decayed, moments = [], [], []
      for i, _ in enumerate(view.matrix_shapes):
        (piece, index, axis), o = next(results)
        if normalize_neurons:
          o, v = _normalize_neurons(o, leaf_variance[i], index, beta2)
          moments.append(v)
        pieces.append(_scatter(piece.shape, index, o.astype(piece.dtype), axis))
        chosen = _selected_mask(piece.shape[axis], index, axis)
        decay = jnp.asarray(ef_decay, piece.dtype)
        decayed.append(jnp.where(chosen, decay * piece, piece))
      directions.append(resharded(view.from_matrices(pieces), spec))
      new_momenta.append(resharded(view.from_matrices(decayed), spec))
      new_variances.append(tuple(moments))
    variance = (
      jax.tree.unflatten(treedef, new_variances) if normalize_neurons else None
    )
    direction = jax.tree.unflatten(treedef, directions)
    direction, _ = shape.update(direction, shape.init(direction))
    direction = jax.tree.map(lambda d: d * extra, direction)
    return direction, Dion2State(
      jax.tree.unflatten(treedef, new_momenta), variance
    )

  shape = scaling.scale_by_shape(
    scale_mode, **settings.forward(scaling.scale_by_shape, arguments)
  )
  return optax.GradientTransformation(init_fn, update_fn)


def dion2(
  learning_rate: optax.ScalarOrSchedule,
  *,
  fraction: types.Numeric = 0.25,
  ef_decay: types.Numeric = 0.95,
  mu_dtype: types.MomentumDtype = None,
  coefficients: types.Coefficients = "polar_express_dion",
  steps: types.Steps = 5,
  precision: types.Precision = "highest",
  method: types.Method = "standard",
  scale_mode: types.ScaleMode = "unit_rms_norm",
  extra_scale_factor: types.Numeric | None = None,
  match_adamw_update_rms: bool = False,
  dimension_numbers: types.PerLeaf = None,
  split_qkv: types.PerLeaf = None,
  split_gate_up: types.PerLeaf = None,
  preconditioning: types.Preconditioning = "frobenius",
  layout: Any = None,
  memory_budget: int | None = None,
  weight_decay: types.Numeric = 0.0,
  weight_decay_mask: types.PerLeaf = None,
  labels: types.PerLeaf = None,
  state_memory_kind: types.MemoryKind | None = None,
  **scalar_kwargs,
) -> optax.GradientTransformation:
  r"""Dion2 for the matrices, AdamW for the rest: ``om.muon``'s routing with
  ``scale_by_dion2`` as the direction;
  ``p ← p − lr · (scale_by_dion2(g) + weight_decay · p)`` (the decay on
  every weight, the step on the selected slices only).

  ``beta``, ``nesterov`` and ``momentum_style`` do not apply (the momentum
  is a sum, decayed by ``ef_decay`` where selected); ``sharding`` does not
  either yet: sharded params are partitioned by XLA under ``jax.jit``, and
  the selection is the whole matrix's, so the update does not depend on the
  sharding. The defaults of ``coefficients`` and ``scale_mode`` are
  microsoft/dion's (see ``scale_by_dion2``); ``weight_decay`` is the
  family's 0 (microsoft/dion's is 0.01).

  Args:
    learning_rate: a float or an optax schedule.
    fraction: the share of each matrix's slices orthogonalized per step.
    ef_decay: the error-feedback decay of the selected slices.
    **scalar_kwargs: ``om.muon``'s ``scalar_optimizer`` and ``adam_*``
      arguments, for the leaves that are not matrices.

  Returns:
    An ``optax.GradientTransformation``.

  Example:
    >>> import jax.numpy as jnp, optax_muon as om
    >>> params = {"hidden": jnp.ones((16, 32)), "bias": jnp.zeros(32)}
    >>> tx = om.dion2(0.01, fraction=0.25)
    >>> updates, _ = tx.update(params, tx.init(params), params)
    >>> # the shorter axis is fan_in's 16 rows: ⌈0.25 · 16⌉ = 4 are updated
    >>> int((jnp.abs(updates["hidden"]).sum(1) > 0).sum())
    4

  References:
    Ahn et al., `Dion2 <https://arxiv.org/abs/2512.16928>`_, 2025
  """
  labels, dimension_numbers = from_layout(layout, labels, dimension_numbers)
  arguments = dict(locals(), layout=None)
  direction = scale_by_dion2(**settings.forward(scale_by_dion2, arguments))
  return route(
    direction,
    learning_rate,
    **settings.forward(route, arguments),
    **scalar_kwargs,
  )


def nordion2(
  learning_rate: optax.ScalarOrSchedule,
  *,
  fraction: types.Numeric = 0.25,
  beta: types.Numeric = 0.95,
  beta2: types.Numeric = 0.95,
  mu_dtype: types.MomentumDtype = None,
  coefficients: types.Coefficients = "polar_express_dion",
  steps: types.Steps = 5,
  precision: types.Precision = "highest",
  method: types.Method = "standard",
  scale_mode: types.ScaleMode = "unit_rms_norm",
  extra_scale_factor: types.Numeric | None = None,
  match_adamw_update_rms: bool = False,
  dimension_numbers: types.PerLeaf = None,
  split_qkv: types.PerLeaf = None,
  split_gate_up: types.PerLeaf = None,
  preconditioning: types.Preconditioning = "frobenius",
  layout: Any = None,
  memory_budget: int | None = None,
  weight_decay: types.Numeric = 0.0,
  weight_decay_mask: types.PerLeaf = None,
  labels: types.PerLeaf = None,
  state_memory_kind: types.MemoryKind | None = None,
  **scalar_kwargs,
) -> optax.GradientTransformation:
  r"""NorDion2 for the matrices, AdamW for the rest: ``dion2`` selecting
  output neurons, with ``ef_decay = beta``, each selected neuron divided by
  the root of its running mean square (decay ``beta2``) and the selection
  rescaled to its Frobenius norm (NorMuon's normalization).

  ``nesterov`` and ``momentum_style`` do not apply, nor ``sharding`` yet
  (see ``dion2``); the other arguments are ``dion2``'s.

  Args:
    learning_rate: a float or an optax schedule.
    fraction: the share of each matrix's output neurons updated per step.
    beta: the momentum: the selected neurons' error-feedback decay.
    beta2: the second moment's decay.
    **scalar_kwargs: ``om.muon``'s ``scalar_optimizer`` and ``adam_*``.

  Returns:
    An ``optax.GradientTransformation``.

  References:
    microsoft/dion ``dion/nordion2.py``; Li et al., `NorMuon
    <https://arxiv.org/abs/2510.05491>`_, 2025
  """
  labels, dimension_numbers = from_layout(layout, labels, dimension_numbers)
  arguments = dict(locals(), layout=None)
  direction = scale_by_dion2(
    **settings.forward(
      scale_by_dion2, arguments, ef_decay=beta, normalize_neurons=True
    )
  )
  return route(
    direction,
    learning_rate,
    **settings.forward(route, arguments),
    **scalar_kwargs,
  )
