"""Spectral clipping: singular values clipped to a range, through the matrix
sign function (Newton–Schulz), as NVIDIA emerging-optimizers computes it.

For ``X = U Σ Vᵀ`` (each matrix of ``x``, in its wide orientation) and
``O = newton_schulz(X) ≈ U Vᵀ``::

  spectral_clip(X, σ_min, σ_max) = ½ [(σ_min + σ_max) O
                                    + sign(σ_min I − O Xᵀ)(σ_min O − X)
                                    − sign(σ_max I − O Xᵀ)(σ_max O − X)]
                                 ≈ U clip(Σ, σ_min, σ_max) Vᵀ
  spectral_hardcap(X, β) = ½ [β O + X − (β O − X) sign(β O − X)ᵀ O]
                         ≈ U min(Σ, β) Vᵀ

with ``sign`` 8 steps of the ``polar_express`` schedule. The decay
``(1 − c) X + c · spectral_hardcap(X, β)`` shrinks only the singular values
above ``β``.

References:
  Cesista, `Spectral clipping
  <https://leloykun.github.io/ponder/spectral-clipping/>`_, 2025
"""

import jax
import jax.numpy as jnp

from optax_muon._src.base import checks as _checks
from optax_muon._src.base import types
from optax_muon._src.kernels.matrices import from_wide
from optax_muon._src.kernels.matrices import matmul
from optax_muon._src.kernels.matrices import to_wide
from optax_muon._src.kernels.newton_schulz import newton_schulz

_SIGN_STEPS = 8
_SIGN_SCHEDULE = "polar_express"


def check_share(c) -> None:
  if not _checks.is_traced(c) and not 0.0 <= float(c) <= 1.0:
    raise ValueError(f"c must be in [0, 1], got {c!r}")


def _sign(x: jax.Array) -> jax.Array:
  return newton_schulz(x, coefficients=_SIGN_SCHEDULE, steps=_SIGN_STEPS)


def _mm(a: jax.Array, b: jax.Array) -> jax.Array:
  return matmul(a, b, "highest")


def _wide(fn):
  """Applies ``fn`` to each matrix of ``x`` (leading axes batch) in its wide
  orientation, in float32, and returns the input's orientation and dtype."""

  def wrapped(x, *args):
    x = jnp.asarray(x)
    work, tall = to_wide(x.astype(jnp.float32))
    return from_wide(fn(work, *args), tall).astype(x.dtype)

  return wrapped


@_wide
def _clip(x, sigma_min, sigma_max):
  o = _sign(x)
  eye = jnp.eye(x.shape[-2], dtype=x.dtype)
  gram = _mm(o, jnp.swapaxes(x, -1, -2))
  result = (sigma_min + sigma_max) * o
  for bound, sign in ((sigma_min, 1.0), (sigma_max, -1.0)):
    result = result + sign * _mm(_sign(bound * eye - gram), bound * o - x)
  return 0.5 * result


@_wide
def _hardcap(x, beta):
  o = _sign(x)
  gap = beta * o - x
  return 0.5 * (
    beta * o + x - _mm(_mm(gap, jnp.swapaxes(_sign(gap), -1, -2)), o)
  )


def spectral_clip(
  x: jax.Array, sigma_min: types.Numeric = -1.0, sigma_max: types.Numeric = 1.0
) -> jax.Array:
  """Each matrix of ``x`` (``(..., m, n)``) with its singular values clipped
  to ``[sigma_min, sigma_max]`` (see the module docstring).

  Args:
    x: an array of at least 2 axes; leading axes are independent matrices.
    sigma_min: the lower bound (EO's default -1: no lower clip).
    sigma_max: the upper bound.

  Returns:
    An array of ``x``'s shape and dtype.
  """
  if jnp.ndim(x) < 2:
    raise ValueError(f"spectral_clip needs a matrix, got shape {jnp.shape(x)}")
  if (
    not _checks.is_traced(sigma_min)
    and not _checks.is_traced(sigma_max)
    and (sigma_min > sigma_max)
  ):
    raise ValueError(
      f"sigma_min={sigma_min} must not exceed sigma_max={sigma_max}"
    )
  return _clip(x, sigma_min, sigma_max)


def spectral_hardcap(x: jax.Array, beta: types.Numeric = 1.0) -> jax.Array:
  """Each matrix of ``x`` with its singular values capped at ``beta``.

  Args:
    x: an array of at least 2 axes; leading axes are independent matrices.
    beta: the cap, > 0.

  Returns:
    An array of ``x``'s shape and dtype.
  """
  if jnp.ndim(x) < 2:
    raise ValueError(
      f"spectral_hardcap needs a matrix, got shape {jnp.shape(x)}"
    )
  _checks.check_positive("beta", beta)
  return _hardcap(x, beta)


def spectral_clipped_weight_decay(
  x: jax.Array, beta: types.Numeric = 1.0, c: types.Numeric = 0.5
) -> jax.Array:
  """``(1 − c) x + c · spectral_hardcap(x, beta)``: EO's spectral version of
  decoupled weight decay (only singular values above ``beta`` shrink)."""
  check_share(c)
  return (1 - c) * x + c * spectral_hardcap(x, beta)
