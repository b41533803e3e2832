"""The momentum transform of Muon (no bias correction, no step count)."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_muon import _checks

MOMENTUM_STYLES = ("ema", "sgd")


class MomentumState(NamedTuple):
  """The momentum buffer, one per leaf."""
  mu: optax.Updates


def canonical_dtype(name: str, dtype):
  """``dtype`` as a ``jnp.dtype`` (or None); ``name`` is the argument's."""
  if dtype is None:
    return None
  try:
    dtype = jnp.dtype(dtype)
  except TypeError as error:
    raise ValueError(f"{name}={dtype!r} is not a dtype; accepted: None or a "
                     "floating dtype such as 'float32'") from error
  if not jnp.issubdtype(dtype, jnp.inexact):
    raise ValueError(f"{name}={dtype!r} is not a floating dtype; accepted: "
                     "None or a floating dtype such as 'float32'")
  return dtype


def _buffer_dtype(param_dtype, dtype):
  """The buffer's dtype: ``dtype`` (complex of that precision for a complex
  param, so the imaginary part is kept), or else the param's."""
  if dtype is None:
    return param_dtype
  if jnp.issubdtype(param_dtype, jnp.complexfloating):
    return jnp.result_type(dtype, jnp.complex64)
  return dtype


def momentum(beta=0.95, *, nesterov: bool = True, style: str = "ema",
             dtype=None) -> optax.GradientTransformation:
  r"""Accumulates gradients into a momentum buffer and returns its update.

  ``style="ema"`` (Megatron-Core, emerging-optimizers)::

    m ← β m + (1 − β) g;   u = (1 − β) g + β m  (Nesterov)  or  u = m

  ``style="sgd"`` (Moonlight, Dion)::

    m ← β m + g;           u = g + β m          (Nesterov)  or  u = m

  Args:
    beta: momentum coefficient in ``[0, 1)``; may be traced.
    nesterov: use the Nesterov look-ahead.
    style: ``"ema"`` or ``"sgd"``.
    dtype: dtype of the buffer; ``None`` keeps each param's dtype (use
      ``"float32"`` for bf16 params; a complex param gets the complex dtype
      of that precision).

  Returns:
    An ``optax.GradientTransformation`` with state ``MomentumState``.

  References:
    Jordan et al., `Muon <https://kellerjordan.github.io/posts/muon/>`_, 2024
  """
  _checks.check_range("beta", beta, 0.0, 1.0)
  _checks.check_choice("style", style, MOMENTUM_STYLES)
  if not isinstance(nesterov, bool):
    raise TypeError(f"nesterov must be a bool, got {nesterov!r}")
  dtype = canonical_dtype("dtype", dtype)
  gradient_weight = (lambda: 1.0 - beta) if style == "ema" else (lambda: 1.0)

  def init_fn(params):
    # zeros_like keeps each param's sharding
    return MomentumState(mu=jax.tree.map(
        lambda p: jnp.zeros_like(p, dtype=_buffer_dtype(jnp.result_type(p),
                                                         dtype)), params))

  def update_fn(updates, state, params=None):
    del params
    weight = gradient_weight()
    # Accumulate in the buffer's dtype: bf16 grads into an fp32 buffer stay fp32.
    grads = jax.tree.map(lambda g, m: g.astype(m.dtype), updates, state.mu)
    mu = jax.tree.map(lambda g, m: (beta * m + weight * g).astype(m.dtype),
                      grads, state.mu)
    if nesterov:
      out = jax.tree.map(lambda g, m: weight * g + beta * m, grads, mu)
    else:
      out = mu
    return out, MomentumState(mu=mu)

  return optax.GradientTransformation(init_fn, update_fn)
