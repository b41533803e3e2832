"""Matrices as the Newton–Schulz kernels see them: the working dtype, the
wide orientation, products at a precision, an overflow-safe norm."""

import typing

import jax
import jax.numpy as jnp

from optax_muon._src.base import types

PRECISIONS = typing.get_args(types.Precision)
# the dtype each product is rounded to ("medium", "fp16") or the iterate is
# kept in between steps ("bf16")
_ROUNDED = {"medium": jnp.bfloat16, "fp16": jnp.float16, "bf16": jnp.bfloat16}


def working_dtype(dtype) -> jnp.dtype:
  """The iteration's dtype: complex64 for complex input, else float32."""
  if jnp.issubdtype(dtype, jnp.complexfloating):
    return jnp.dtype(jnp.complex64)
  return jnp.dtype(jnp.float32)


def product_dtype(precision: str) -> jnp.dtype:
  """The dtype ``matmul`` rounds its product to: bfloat16 at ``"medium"``,
  float16 at ``"fp16"``, else float32 (not rounded)."""
  rounded = precision in _ROUNDED and precision != "bf16"
  return jnp.dtype(_ROUNDED[precision] if rounded else jnp.float32)


def iterate_dtype(precision: str, dtype) -> jnp.dtype:
  """The dtype the iterate ``X`` is kept in between steps: bfloat16 at
  ``"bf16"``, else ``dtype`` (the working dtype)."""
  return jnp.dtype(jnp.bfloat16 if precision == "bf16" else dtype)


def check_precision_for(dtype, precision: str, where: str = "x") -> None:
  """Raises ValueError for complex input at ``"medium"``, ``"fp16"`` or
  ``"bf16"`` (no complex bf16 or fp16)."""
  if precision in _ROUNDED and jnp.issubdtype(dtype, jnp.complexfloating):
    raise ValueError(
      f"precision={precision!r} rounds every product to "
      f"{jnp.dtype(_ROUNDED[precision]).name}, which has no complex type, "
      f"but {where} is {jnp.dtype(dtype).name}; accepted precisions for "
      "complex matrices: ['highest', 'high']"
    )


def conj_transpose(x: jax.Array) -> jax.Array:
  """``xᴴ`` over the last two axes (``xᵀ`` for real ``x``)."""
  return jnp.conj(jnp.swapaxes(x, -1, -2))


def matmul(a: jax.Array, b: jax.Array, precision: str) -> jax.Array:
  """``a @ b`` over leading batch axes, at one of ``PRECISIONS``.

  ``"highest"``: fp32 at ``Precision.HIGHEST``; ``"high"``: fp32 at the
  backend's default (TF32 on GPUs); ``"medium"``: bf16 operands, fp32
  accumulation, the product rounded to bf16 (Megatron-Core's default);
  ``"fp16"``: the same in float16 (XLA's ``F16_F16_F32``): 3 more mantissa
  bits than bf16, and no overflow since the iteration's matrices are
  normalized in fp32 first (entries below ~10); ``"bf16"``: bf16 operands
  and the fp32 accumulation as it is (``iterate`` rounds each step's sums
  to bf16, as torch's ``addmm`` does).
  """
  if precision == "bf16":
    return jnp.matmul(
      a.astype(jnp.bfloat16),
      b.astype(jnp.bfloat16),
      preferred_element_type=jnp.float32,
    )
  if precision in _ROUNDED:
    low = _ROUNDED[precision]
    product = jnp.matmul(
      a.astype(low), b.astype(low), preferred_element_type=jnp.float32
    )
    return product.astype(low).astype(jnp.float32)
  level = (
    jax.lax.Precision.HIGHEST
    if precision == "highest" and jax.default_backend() != "cpu"
    else jax.lax.Precision.DEFAULT
  )
  # XLA:CPU multiplies fp32 in full precision at every level; its DEFAULT path
  # gave the same bits 5% faster (1024×4096, 2 cores), so "highest" uses it
  # there.
  return jnp.matmul(a, b, precision=level)


def to_wide(x: jax.Array) -> tuple[jax.Array, bool]:
  """``x`` turned so that each matrix is wide (rows ≤ columns), and whether
  it was turned (undo with ``from_wide``)."""
  tall = x.shape[-2] > x.shape[-1]
  return (jnp.swapaxes(x, -1, -2) if tall else x), tall


def from_wide(x: jax.Array, tall: bool) -> jax.Array:
  """Inverse of ``to_wide``."""
  return jnp.swapaxes(x, -1, -2) if tall else x


def frobenius(x: jax.Array, axis=(-2, -1), keepdims: bool = True) -> jax.Array:
  """``‖x‖_F`` over ``axis`` (``None``: the whole array), summed in float32.

  For the family's scale factors (NorMuon, NAMO, hyperball), whose inputs
  are momenta and Newton–Schulz outputs; no pre-scaling, so a sharded
  axis costs one all-reduce. The normalization before the iteration, which
  must hold over the whole fp32 range, pre-scales instead
  (``newton_schulz.normalize``).
  """
  x = x.astype(jnp.float32)
  return jnp.sqrt(
    jnp.sum(jnp.real(x * jnp.conj(x)), axis=axis, keepdims=keepdims)
  )
