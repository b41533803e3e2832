"""Per-matrix diagnostics: update RMS, orthogonality error, singular values.

Each works on the last two axes as one matrix and keeps leading axes, so a
stacked ``[L, in, out]`` leaf gives ``L`` numbers, one per matrix.
"""

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp

from optax_muon._src.kernels.matrices import matmul
from optax_muon._src.kernels.matrices import to_wide


def update_rms(updates: Any) -> Any:
  """Root mean square of each matrix of each leaf.

  Args:
    updates: a tree of arrays.

  Returns:
    A tree like ``updates``: for a leaf of shape ``(..., m, n)`` an array of
    shape ``(...)``; for a vector or scalar leaf a scalar.
  """

  def rms(x):
    x = jnp.asarray(x, jnp.float32)
    axes = (-2, -1) if x.ndim >= 2 else None
    return jnp.sqrt(jnp.mean(jnp.square(x), axis=axes))

  return jax.tree.map(rms, updates)


def _wide(x: jax.Array) -> jax.Array:
  x = jnp.asarray(x, jnp.float32)
  if x.ndim < 2:
    raise ValueError(f"expected an array of shape (..., m, n), got {x.shape}")
  return to_wide(x)[0]


def orthogonality_error(x: jax.Array) -> jax.Array:
  """``‖W Wᵀ − I‖_F / √k`` per matrix, ``W`` the wide orientation, ``k`` its rows.

  0 for a matrix with orthonormal rows (or columns, when tall); the RMS of
  ``σᵢ² − 1`` over the singular values in general.

  Args:
    x: array of shape ``(..., m, n)``.

  Returns:
    Array of shape ``(...)``.
  """
  w = _wide(x)
  k = w.shape[-2]
  gram = matmul(w, jnp.swapaxes(w, -1, -2), "highest")
  error = gram - jnp.eye(k, dtype=gram.dtype)
  return jnp.sqrt(jnp.sum(jnp.square(error), axis=(-2, -1)) / k)


class SingularValueSpread(NamedTuple):
  """Smallest and largest singular value of each matrix."""

  min: jax.Array
  max: jax.Array


def singular_value_spread(x: jax.Array) -> SingularValueSpread:
  """The extreme singular values of each matrix of ``x`` (shape ``(..., m, n)``).

  After Newton–Schulz every singular value lies near 1 (quintic: ≈ 0.7–1.2);
  a ``min`` near 0 flags a rank-deficient update (a degenerate thin matrix).

  Returns:
    ``SingularValueSpread(min, max)``, each of shape ``(...)``.
  """
  sigma = jnp.linalg.svd(_wide(x), compute_uv=False)
  return SingularValueSpread(min=sigma.min(axis=-1), max=sigma.max(axis=-1))
