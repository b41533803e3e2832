"""Dion's step on a stack of tall matrices: one power iteration from the
last ``Q``, its orthonormalization, the error feedback and ``Q``'s column
normalization (microsoft/dion's ``dion_reference.py``).

The stack may be whole or a block of it split across devices
(``Shards``): every sum over rows or columns that crosses a split is then
a ``psum`` over the mesh axes splitting it, so the same code reads
dion's ``dion_update_fsdp_tp``: ``P = B Q`` summed over the column axes,
``R = Bᵀ P`` over the row axes, ``Q``'s column norms over the column axes.
Only ``rows × r`` and ``n × r`` products travel.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

from optax_muon._src.kernels import matrices

QR_METHODS = ("qr", "rcqr")
# microsoft/dion's rcqr_oversample: the sketch has ⌈1.25 r / 128⌉ · 128 rows
_OVERSAMPLE = 1.25


@dataclasses.dataclass(frozen=True)
class Shards:
  """How a tall block ``(matrices, rows, n)`` is split inside a
  ``jax.shard_map``: the mesh axes splitting its rows and its columns.
  ``Shards()``: a whole stack (every sum is local)."""

  row_axes: tuple[str, ...] = ()
  column_axes: tuple[str, ...] = ()

  def over_rows(self, x: jax.Array) -> jax.Array:
    """``x``, a sum over this block's rows, summed over all rows."""
    return jax.lax.psum(x, self.row_axes) if self.row_axes else x

  def over_columns(self, x: jax.Array) -> jax.Array:
    """``x``, a sum over this block's columns, summed over all columns."""
    return jax.lax.psum(x, self.column_axes) if self.column_axes else x

  def whole_rows(self, x: jax.Array) -> jax.Array:
    """``x`` ``(..., rows of this block, k)`` with every block's rows."""
    if not self.row_axes:
      return x
    return jax.lax.all_gather(x, self.row_axes, axis=x.ndim - 2, tiled=True)

  def sketch(self, key: jax.Array, count: int, rows: int) -> jax.Array:
    """This block's columns of a Gaussian sketch ``count × all rows``: the
    whole one from ``key``, or on a split block its own from ``key`` and
    the block's index, so no device draws the others' columns (rcqr's
    basis does not depend on the sketch, only its rounding does)."""
    if self.row_axes:
      key = jax.random.fold_in(key, jax.lax.axis_index(self.row_axes))
    return jax.random.normal(key, (count, rows))

  def own_rows(self, x: jax.Array, size: int, axis: int) -> jax.Array:
    """This block's ``size`` rows of ``x`` along ``axis`` (all rows)."""
    if not self.row_axes:
      return x
    start = jax.lax.axis_index(self.row_axes) * size
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


WHOLE = Shards()


def dion_rank(rank_fraction: float, rank_multiple_of: int, shape) -> int:
  """The rank ``r`` of a ``(rows, columns)`` matrix: microsoft/dion's
  ``rank_fraction · min`` rounded up to ``rank_multiple_of``, at most the
  shorter side."""
  shorter = min(shape)
  r = rank_multiple_of * math.ceil(rank_fraction * shorter / rank_multiple_of)
  return min(r, shorter)


def is_turned(fan_in: int, fan_out: int) -> bool:
  """Whether a ``fan_in × fan_out`` matrix is turned to stand tall:
  microsoft/dion's ``(out, in)``, transposed when wide."""
  return fan_in <= fan_out


def tall(piece: jax.Array, turned: bool) -> jax.Array:
  """``piece`` ``(matrices, fan_in, fan_out)`` on its tall side."""
  return jnp.swapaxes(piece, -1, -2) if turned else piece


untall = tall  # a transpose is its own inverse


def sketch_rows(r: int) -> int:
  """The rows of rcqr's random sketch for rank ``r``."""
  return 128 * math.ceil(_OVERSAMPLE * r / 128)


def _householder(p: jax.Array, shards: Shards) -> jax.Array:
  """An orthonormal basis of ``p``'s columns: its QR's ``Q`` (float32); a
  row-split ``p`` is gathered (``rows × r``) and each block keeps its rows."""
  whole = shards.whole_rows(p.astype(jnp.float32))
  basis = jnp.linalg.qr(whole, mode="reduced")[0]
  return shards.own_rows(basis, p.shape[-2], axis=basis.ndim - 2)


def _times_inverse(x: jax.Array, triangle: jax.Array, lower: bool):
  """``x · triangle⁻¹`` as a product with the small inverse, so that a
  row-sharded ``x`` stays sharded."""
  eye = jnp.broadcast_to(jnp.eye(triangle.shape[-1]), triangle.shape)
  inverse = jax.scipy.linalg.solve_triangular(triangle, eye, lower=lower)
  return matrices.matmul(x, inverse, "highest")


def _sketched_cholesky(p: jax.Array, key: jax.Array, shards: Shards):
  """microsoft/dion's randomized Cholesky QR (``rcqr``) of the tall ``p``:
  ``R`` from the QR of the small sketch ``S p`` (``sketch_rows(r) × r``),
  ``p R⁻¹``, then one Cholesky QR round. Only ``S p`` and an ``r × r``
  Gram are summed over a split row axis (each block draws its own columns
  of the sketch), and the basis is QR's (its ``R`` upper triangular), so
  the step is ``"qr"``'s up to rounding; a rank-deficient ``p`` gives NaN,
  zeroed by the caller (as dion does)."""
  p = p.astype(jnp.float32)
  rows, r = p.shape[-2:]
  count = sketch_rows(r)
  sketch = shards.sketch(key, count, rows) / math.sqrt(count)
  sketched = shards.over_rows(matrices.matmul(sketch, p, "highest"))
  p = _times_inverse(p, jnp.linalg.qr(sketched, mode="r"), lower=False)
  gram = shards.over_rows(
    matrices.matmul(jnp.swapaxes(p, -1, -2), p, "highest")
  )
  lower = jnp.linalg.cholesky(gram)  # gram = L Lᵀ: p L⁻ᵀ is orthonormal
  return _times_inverse(p, jnp.swapaxes(lower, -1, -2), lower=False)


def _summed_product(a, b, precision, summed):
  """``a @ b`` (``matrices.matmul``) totalled across blocks by ``summed``;
  the partial products travel in the dtype the product is rounded to
  (bfloat16 at ``"medium"``: half the bytes, the unsharded product's
  rounding)."""
  product = matrices.matmul(a, b, precision)
  low = matrices.product_dtype(precision)
  return summed(product.astype(low)).astype(jnp.float32)


def dion_step(
  b,
  q,
  *,
  ef_decay,
  power_iters,
  epsilon,
  precision,
  sketch_key=None,
  shards: Shards = WHOLE,
):
  """One Dion step on a tall stack ``b`` ``(matrices, rows, n)`` from ``q``
  ``(matrices, n, r)``: ``(direction P Qᵀ, new momentum, new Q)``, float32;
  on a block of a split stack with its ``shards`` (``q`` then split as the
  columns).

  ``P`` is orthonormalized by Householder QR, or by dion's randomized
  Cholesky QR with ``sketch_key``. A zero matrix gives a zero direction and
  keeps its ``q`` (microsoft/dion's ``fix_all_zero_or_nan``)."""
  b = b.astype(jnp.float32)
  transposed = jnp.swapaxes(b, -1, -2)
  r = q
  for _ in range(power_iters):
    p = _summed_product(b, r, precision, shards.over_columns)
    p = (
      _householder(p, shards)
      if sketch_key is None
      else _sketched_cholesky(p, sketch_key, shards)
    )
    r = _summed_product(transposed, p, precision, shards.over_rows)
  size = shards.over_rows(
    shards.over_columns(jnp.sum(jnp.abs(b), axis=(-2, -1), keepdims=True))
  )
  zero = size == 0
  p = jnp.where(zero, 0.0, jnp.nan_to_num(p))
  r = jnp.where(zero, q, jnp.nan_to_num(r))
  captured = matrices.matmul(p, jnp.swapaxes(r, -1, -2), precision)
  momentum = b - (1 - ef_decay) * captured
  norms = jnp.sqrt(
    shards.over_columns(jnp.sum(jnp.square(r), axis=-2, keepdims=True))
  )
  q = r / (norms + epsilon)
  direction = matrices.matmul(p, jnp.swapaxes(q, -1, -2), precision)
  return direction, momentum, q


def wave_bytes(rows: int, n: int, r: int) -> int:
  """The float32 bytes one matrix's step keeps live, whole: ``B``, its
  captured part and the direction (``rows × n`` each), ``P`` and the QR's
  workspace (``rows × r``), ``Q`` and ``R`` (``n × r``), rcqr's sketch."""
  sketch = sketch_rows(r) * rows
  return 4 * (3 * rows * n + 3 * rows * r + 3 * n * r + sketch)


def in_waves(
  rank_step, tall_stack, q, budget: int, per_matrix: int, shards=WHOLE
):
  """``rank_step(tall, q, shards)`` over the stack ``(tall_stack, q)`` in
  parts of at most ``budget`` bytes (``per_matrix`` each), one part after
  another (``lax.map``): a 70B model's scanned stack in float32 at once is
  hundreds of GiB. ``Q`` is worked on in float32; the direction and
  momentum come back in the stack's dtype, ``Q`` in its own."""
  dtype, q_dtype = tall_stack.dtype, q.dtype

  def step(stack, q):
    direction, momentum, q = rank_step(stack, q.astype(jnp.float32), shards)
    return direction.astype(dtype), momentum.astype(dtype), q.astype(q_dtype)

  count = tall_stack.shape[0]
  part = max(1, min(count, budget // per_matrix))
  if part >= count:
    return step(tall_stack, q)
  return jax.lax.map(lambda x: step(*x), (tall_stack, q), batch_size=part)
