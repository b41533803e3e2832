"""AdaptiveMuon: a second moment on the orthogonalized update (NorMuon,
AdaMuon, NAMO), as NVIDIA emerging-optimizers' ``AdaptiveMuon`` computes it.

For each matrix ``G`` (``fan_in × fan_out``) of a Muon leaf::

  u = momentum(g)                 # as in scale_by_muon
  O = newton_schulz(u)            # the raw polar factor, no scale yet
  adamuon:  v ← β₂ v + (1−β₂) O²              O / (√v + ε)         (elementwise v)
  normuon:  v ← β₂ v + (1−β₂) mean(O², short) N = O · rsqrt(max(v, ε)),
                                              N · ‖O‖_F / ‖N‖_F    (v per row or column)
  namo:     v ← β₂ v + (1−β₂) ‖g‖²_F          O · ‖u‖_F / (√v + ε) (a scalar v)
  update = scale_factor(fan_out, fan_in, scale_mode) · extra · (the above)

``normuon`` averages ``O²`` over the matrix's shorter axis (over fan-in when
the matrix is square), keeping one value per entry of the longer one, as EO
0.3.0 does (its source comment says the opposite; its code does this).
``namo`` reads the raw gradient ``g`` and the momentum direction ``u``, which
``scale_by_adaptive_muon`` hands to ``scale_by_moment2`` as extra arguments.
Megatron-Core 0.19's wrapper applies the shape scale twice for ``normuon`` and
``namo``; this follows EO.
"""

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_muon import _checks
from optax_muon import alias
from optax_muon import layout as layout_lib
from optax_muon import scaling

# the functions by their own modules: the package's names are the functions
from optax_muon.momentum import MOMENTUM_STYLES
from optax_muon.momentum import canonical_dtype
from optax_muon.momentum import momentum as momentum_transform
from optax_muon.orthogonalize import orthogonalize as orthogonalize_transform

MOMENT2_METHODS = ("adamuon", "normuon", "namo")
_TINY = 1e-30


class Moment2State(NamedTuple):
  """Per leaf, a tuple with one float32 second moment per matrix piece, of
  shape ``(matrices, rows, cols)``: ``(fan_in, fan_out)`` for ``adamuon``,
  ``(1, fan_out)`` or ``(fan_in, 1)`` for ``normuon`` (the longer axis kept),
  ``(1, 1)`` for ``namo``."""

  moment2: Any


def moment2_shape(method: str, count: int, fan_in: int, fan_out: int):
  """The second moment kept for ``count`` matrices ``fan_in × fan_out``:
  elementwise (adamuon), one per unit of the longer axis, averaged over the
  shorter one (normuon, as EO does), or one scalar per matrix (namo)."""
  if method == "adamuon":
    return (count, fan_in, fan_out)
  if method == "normuon":
    return (count, 1, fan_out) if fan_out >= fan_in else (count, fan_in, 1)
  return (count, 1, 1)


def _frobenius(x: jax.Array) -> jax.Array:
  x = x.astype(jnp.float32)
  return jnp.sqrt(jnp.sum(x * x, axis=(-2, -1), keepdims=True))


def scale_by_moment2(
  method: str = "adamuon",
  beta2=0.95,
  eps=1e-8,
  *,
  dimension_numbers=None,
  split_qkv=None,
  layout=None,
  split_gate_up=None,
) -> optax.GradientTransformationExtraArgs:
  r"""Normalizes orthogonalized updates by a running second moment.

  Placed after ``orthogonalize`` and before ``scale_by_shape`` (EO's order;
  see the module docstring for the three formulas).

  Args:
    method: ``"adamuon"`` (elementwise), ``"normuon"`` (per row or column)
      or ``"namo"`` (one scalar per matrix).
    beta2: the second moment's decay, in ``[0, 1)``.
    eps: ``adamuon`` and ``namo`` add it to ``√v``; ``normuon`` floors ``v``.
    dimension_numbers, split_qkv, layout, split_gate_up: the matrix views,
      as in ``scale_by_muon``.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; with ``"namo"`` its update
    takes ``gradients=`` (the raw gradients) and ``directions=`` (the
    momentum directions before orthogonalization).

  References:
    Si et al., `AdaMuon <https://arxiv.org/abs/2507.11005>`_, 2025

    Li et al., `NorMuon <https://arxiv.org/abs/2510.05491>`_, 2025

    `NAMO <https://arxiv.org/abs/2602.17080>`_, 2026
  """
  _checks.check_choice("moment2_method", method, MOMENT2_METHODS)
  _checks.check_range("beta2", beta2, 0.0, 1.0)
  _checks.check_range("moment2_eps", eps, 0.0, np.inf)
  _, dimension_numbers = alias.from_layout(layout, None, dimension_numbers)
  resolve_views = layout_lib.view_resolver(
    dimension_numbers, split_qkv, split_gate_up
  )

  def init_fn(params):
    moments = []
    for _, _, view in resolve_views(params):
      count = int(np.prod(view.batch_shape))
      moments.append(
        tuple(
          jnp.zeros(moment2_shape(method, count, fan_in, fan_out), jnp.float32)
          for fan_in, fan_out in view.matrix_shapes
        )
      )
    return Moment2State(jax.tree.unflatten(jax.tree.structure(params), moments))

  def normalize(o, v, g=None, u=None):
    if method == "adamuon":
      v = beta2 * v + (1 - beta2) * jnp.square(o)
      return o / (jnp.sqrt(v) + eps), v
    if method == "normuon":
      shorter = -2 if v.shape[-2] == 1 else -1
      v = beta2 * v + (1 - beta2) * jnp.mean(
        jnp.square(o), axis=shorter, keepdims=True
      )
      normalized = o * jax.lax.rsqrt(jnp.maximum(v, eps))
      # NorMuon keeps the polar factor's Frobenius norm (EO 0.3.0 does)
      ratio = _frobenius(o) / jnp.maximum(_frobenius(normalized), _TINY)
      return normalized * ratio, v
    v = beta2 * v + (1 - beta2) * jnp.square(_frobenius(g))
    return o * (_frobenius(u) / (jnp.sqrt(v) + eps)), v

  def update_fn(
    updates,
    state,
    params=None,
    *,
    gradients=None,
    directions=None,
    **extra_args,
  ):
    del params, extra_args
    if method == "namo" and (gradients is None or directions is None):
      raise ValueError(
        "moment2_method='namo' needs update(..., gradients=, "
        "directions=): the raw gradients and the momentum "
        "directions (scale_by_adaptive_muon passes them)"
      )
    views = resolve_views(updates)
    treedef = jax.tree.structure(updates)
    moments = treedef.flatten_up_to(state.moment2)
    grads = (
      treedef.flatten_up_to(gradients)
      if gradients is not None
      else [None] * len(views)
    )
    dirs = (
      treedef.flatten_up_to(directions)
      if directions is not None
      else [None] * len(views)
    )
    new_leaves, new_moments = [], []
    for (_, leaf, view), leaf_moments, g, u in zip(views, moments, grads, dirs):
      pieces = view.to_matrices(leaf)
      g_pieces = view.to_matrices(g) if g is not None else [None] * len(pieces)
      u_pieces = view.to_matrices(u) if u is not None else [None] * len(pieces)
      outs, vs = [], []
      for o, v, g_piece, u_piece in zip(
        pieces, leaf_moments, g_pieces, u_pieces
      ):
        out, v = normalize(o.astype(jnp.float32), v, g_piece, u_piece)
        outs.append(out.astype(o.dtype))
        vs.append(v)
      new_leaves.append(view.from_matrices(outs))
      new_moments.append(tuple(vs))
    return (
      jax.tree.unflatten(treedef, new_leaves),
      Moment2State(jax.tree.unflatten(treedef, new_moments)),
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class AdaptiveMuonState(NamedTuple):
  momentum: Any
  moment2: Moment2State


def scale_by_adaptive_muon(
  *,
  moment2_method: str = "adamuon",
  beta2=0.95,
  moment2_eps=1e-8,
  beta=0.95,
  nesterov: bool = True,
  momentum_style: str = "ema",
  mu_dtype=None,
  coefficients="quintic",
  steps=5,
  precision: str = "highest",
  scale_mode: str = "spectral",
  extra_scale_factor=None,
  match_adamw_update_rms: bool = False,
  adamw_beta1=0.9,
  dimension_numbers=None,
  split_qkv=None,
  sharding=None,
  layout=None,
  split_gate_up=None,
  memory_budget: int | None = None,
) -> optax.GradientTransformation:
  r"""AdaptiveMuon's direction: momentum, raw Newton–Schulz, second moment,
  then the shape scale (EO's order)::

    u = momentum(g);  O = newton_schulz(u)
    update = scale_factor(fan_out, fan_in, scale_mode) · extra · N(O)

  with ``N`` the ``moment2_method`` normalization of ``scale_by_moment2``.
  The arguments not listed below are ``scale_by_muon``'s (``beta``,
  ``nesterov``, ``momentum_style``, ``mu_dtype``, ``coefficients``,
  ``steps``, ``precision``, ``scale_mode``, ``extra_scale_factor``,
  ``match_adamw_update_rms``, ``adamw_beta1``, ``dimension_numbers``,
  ``split_qkv``, ``layout``, ``split_gate_up``, ``memory_budget``).

  Args:
    moment2_method: ``"adamuon"``, ``"normuon"`` or ``"namo"``.
    beta2: the second moment's decay.
    moment2_eps: the second moment's eps (see ``scale_by_moment2``).
    sharding: as in ``scale_by_muon``: Newton–Schulz runs in its ``mode``
      and the second moment on the whole (GSPMD-sharded) matrices, the same
      statistics in every mode.

  Returns:
    An ``optax.GradientTransformation``.

  References:
    NVIDIA emerging-optimizers 0.3.0, ``AdaptiveMuon``
  """
  _checks.check_choice("momentum_style", momentum_style, MOMENTUM_STYLES)
  _checks.check_choice("scale_mode", scale_mode, scaling.SCALE_MODES)
  _, dimension_numbers = alias.from_layout(layout, None, dimension_numbers)
  extra = alias.resolve_extra_scale_factor(
    extra_scale_factor, match_adamw_update_rms, adamw_beta1
  )
  views = dict(
    dimension_numbers=dimension_numbers,
    split_qkv=split_qkv,
    split_gate_up=split_gate_up,
  )
  canonical_dtype("mu_dtype", mu_dtype, quantized=True)
  momentum = momentum_transform(
    beta,
    nesterov=nesterov,
    style=momentum_style,
    dtype=mu_dtype,
    memory_budget=memory_budget,
  )
  orthogonalize = orthogonalize_transform(
    coefficients=coefficients,
    steps=steps,
    precision=precision,
    sharding=sharding,
    memory_budget=memory_budget,
    **views,
  )
  moment2 = scale_by_moment2(moment2_method, beta2, moment2_eps, **views)
  shape = scaling.scale_by_shape(scale_mode, sharding=sharding, **views)

  def init_fn(params):
    orthogonalize.init(params)  # bad views, dtypes or specs raise here
    return AdaptiveMuonState(momentum.init(params), moment2.init(params))

  def update_fn(updates, state, params=None):
    del params
    directions, momentum_state = momentum.update(updates, state.momentum)
    orthogonal, _ = orthogonalize.update(directions, optax.EmptyState())
    normalized, moment2_state = moment2.update(
      orthogonal, state.moment2, gradients=updates, directions=directions
    )
    scaled, _ = shape.update(normalized, optax.EmptyState())
    scaled = jax.tree.map(lambda x: x * jnp.asarray(extra, x.dtype), scaled)
    return scaled, AdaptiveMuonState(momentum_state, moment2_state)

  return optax.GradientTransformation(init_fn, update_fn)


def adaptive_muon(
  learning_rate,
  *,
  moment2_method: str = "adamuon",
  beta2=0.95,
  moment2_eps=1e-8,
  beta=0.95,
  nesterov: bool = True,
  momentum_style: str = "ema",
  mu_dtype=None,
  coefficients="quintic",
  steps=5,
  precision: str = "highest",
  scale_mode: str = "spectral",
  extra_scale_factor=None,
  match_adamw_update_rms: bool = False,
  dimension_numbers=None,
  split_qkv=None,
  sharding=None,
  layout=None,
  split_gate_up=None,
  weight_decay=0.0,
  weight_decay_mask=None,
  labels=None,
  scalar_optimizer: str = "adam",
  adam_learning_rate=None,
  adam_b1=0.9,
  adam_b2=0.999,
  adam_eps=1e-8,
  adam_weight_decay=0.0,
  adam_weight_decay_mask=None,
  memory_budget: int | None = None,
  state_memory_kind: str | None = None,
) -> optax.GradientTransformation:
  r"""AdaptiveMuon (NorMuon, AdaMuon, NAMO) for the matrices, AdamW for the
  rest: ``om.muon`` with ``scale_by_adaptive_muon`` as the Muon direction
  (the same routing, layouts, weight decay, AdamW group and schedules).

  Muon leaves: ``p ← p − lr · (scale_by_adaptive_muon(g) + weight_decay · p)``,
  which is EO's decoupled decay applied before the step.

  The arguments not listed below are ``om.muon``'s; ``moment2_method``,
  ``beta2`` and ``moment2_eps`` are ``scale_by_adaptive_muon``'s.

  Args:
    learning_rate: a float or an optax schedule.

  Returns:
    An ``optax.GradientTransformation``.

  References:
    NVIDIA emerging-optimizers 0.3.0, ``AdaptiveMuon``;
    Megatron-Core ``optimizer="adaptive_muon"``
  """
  _checks.check_range("adam_b1", adam_b1, 0.0, 1.0)
  labels, dimension_numbers = alias.from_layout(
    layout, labels, dimension_numbers
  )
  direction = scale_by_adaptive_muon(
    moment2_method=moment2_method,
    beta2=beta2,
    moment2_eps=moment2_eps,
    beta=beta,
    nesterov=nesterov,
    momentum_style=momentum_style,
    mu_dtype=mu_dtype,
    coefficients=coefficients,
    steps=steps,
    precision=precision,
    scale_mode=scale_mode,
    extra_scale_factor=extra_scale_factor,
    match_adamw_update_rms=match_adamw_update_rms,
    adamw_beta1=adam_b1,
    dimension_numbers=dimension_numbers,
    split_qkv=split_qkv,
    split_gate_up=split_gate_up,
    sharding=sharding,
    memory_budget=memory_budget,
  )
  return alias.route(
    direction,
    learning_rate,
    weight_decay=weight_decay,
    weight_decay_mask=weight_decay_mask,
    labels=labels,
    scalar_optimizer=scalar_optimizer,
    adam_learning_rate=adam_learning_rate,
    adam_b1=adam_b1,
    adam_b2=adam_b2,
    adam_eps=adam_eps,
    adam_weight_decay=adam_weight_decay,
    adam_weight_decay_mask=adam_weight_decay_mask,
    state_memory_kind=state_memory_kind,
  )
