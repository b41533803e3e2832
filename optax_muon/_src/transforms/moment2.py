"""The second moment of AdaptiveMuon (NorMuon, AdaMuon, NAMO) on the raw
Newton–Schulz output; see ``optimizers.adaptive`` for the update."""

import functools
import typing
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_muon._src.base import checks as _checks
from optax_muon._src.base import types
from optax_muon._src.base.trees import pieces_structure
from optax_muon._src.kernels.matrices import frobenius
from optax_muon._src.views import layout as layout_lib
from optax_muon._src.views.layout import from_layout

MOMENT2_METHODS = typing.get_args(types.Moment2Method)


_TINY = 1e-30


class Moment2State(NamedTuple):
  """Per leaf, a tuple with one float32 second moment per matrix piece, of
  shape ``(matrices, rows, cols)``: ``(fan_in, fan_out)`` for ``adamuon``,
  ``(1, fan_out)`` or ``(fan_in, 1)`` for ``normuon`` (the longer axis kept),
  ``(1, 1)`` for ``namo``."""

  moment2: Any


def moment2_statistic(method: str, o: jax.Array, g: jax.Array) -> jax.Array:
  """What the second moment averages, per ``(matrices, rows, cols)`` stack:
  ``o²`` (adamuon), its mean over the shorter axis, the longer one kept
  (normuon, as EO does), ``‖g‖²_F`` (namo: ``g`` the raw gradient; the
  others do not read it)."""
  if method == "adamuon":
    return jnp.square(o)
  if method == "normuon":
    shorter = -2 if o.shape[-1] >= o.shape[-2] else -1
    return jnp.mean(jnp.square(o), axis=shorter, keepdims=True)
  return jnp.square(frobenius(g))


def moment2_shape(method: str, count: int, fan_in: int, fan_out: int):
  """The shape of the second moment kept for ``count`` matrices
  ``fan_in × fan_out`` (``moment2_statistic``'s, without computing it)."""
  stack = jax.ShapeDtypeStruct((count, fan_in, fan_out), jnp.float32)
  return jax.eval_shape(
    functools.partial(moment2_statistic, method), stack, stack
  ).shape


def scale_by_moment2(
  method: str = "adamuon",
  beta2: types.Numeric = 0.95,
  eps: types.Numeric = 1e-8,
  *,
  dimension_numbers: types.PerLeaf = None,
  split_qkv: types.PerLeaf = None,
  layout: Any = None,
  split_gate_up: types.PerLeaf = None,
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
  _, dimension_numbers = from_layout(layout, None, dimension_numbers)
  resolve_views = layout_lib.view_resolver(
    dimension_numbers, split_qkv, split_gate_up
  )

  def init_fn(params):
    # Zeros of the statistic of each matrix piece, not of its bare shape:
    # they take the sharding the update gives them (as zeros_like keeps a
    # momentum's), so a sharded state is not replicated at init and a
    # jitted update compiles once, not again at step 2.
    moments = []
    for _, leaf, view in resolve_views(params):
      moments.append(
        tuple(
          jnp.zeros_like(moment2_statistic(method, piece, piece), jnp.float32)
          for piece in view.to_matrices(leaf)
        )
      )
    return Moment2State(jax.tree.unflatten(pieces_structure(params), moments))

  def normalize(o, v, g=None, u=None):
    v = beta2 * v + (1 - beta2) * moment2_statistic(method, o, g)
    if method == "adamuon":
      return o / (jnp.sqrt(v) + eps), v
    if method == "normuon":
      normalized = o * jax.lax.rsqrt(jnp.maximum(v, eps))
      # NorMuon keeps the polar factor's Frobenius norm (EO 0.3.0 does)
      ratio = frobenius(o) / jnp.maximum(frobenius(normalized), _TINY)
      return normalized * ratio, v
    return o * (frobenius(u) / (jnp.sqrt(v) + eps)), v

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
    moments = pieces_structure(updates).flatten_up_to(state.moment2)
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
      new_leaves.append(view.from_matrices(outs, like=leaf))
      new_moments.append(tuple(vs))
    return (
      jax.tree.unflatten(treedef, new_leaves),
      Moment2State(jax.tree.unflatten(pieces_structure(updates), new_moments)),
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
