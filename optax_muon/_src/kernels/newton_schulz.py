"""The Newton–Schulz orthogonalization kernel, batched over leading axes."""

import typing
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from optax_muon._src.base import checks as _checks
from optax_muon._src.base import types
from optax_muon._src.kernels import coefficients as coefficients_lib
from optax_muon._src.kernels.matrices import PRECISIONS
from optax_muon._src.kernels.matrices import check_precision_for
from optax_muon._src.kernels.matrices import conj_transpose
from optax_muon._src.kernels.matrices import from_wide
from optax_muon._src.kernels.matrices import iterate_dtype
from optax_muon._src.kernels.matrices import matmul
from optax_muon._src.kernels.matrices import to_wide
from optax_muon._src.kernels.matrices import working_dtype

if TYPE_CHECKING:  # the solver's type only: batched builds on this module
  from optax_muon._src.kernels import batched


def _all_reduce(reduce, x, axis_name):
  return x if axis_name is None else reduce(x, axis_name)


def normalize(
  x: jax.Array,
  eps: float,
  axis_name=None,
  add_eps: bool = False,
  precision: types.Precision = "highest",
) -> jax.Array:
  """``x / max(‖x‖_F, eps)`` per matrix, safe over the whole fp32 range.

  Dividing by ``max|x|`` first keeps ``‖x‖²`` from overflowing (entries near
  1e30) or underflowing (near 1e-30), so the result is scale-invariant; a zero
  matrix stays exactly zero. ``add_eps`` gives ``x / (‖x‖_F + eps)`` instead,
  computed as ``optax.contrib.muon`` does (no pre-scaling). Inside
  ``shard_map``, ``axis_name`` names the mesh axis the columns of ``x`` are
  split over. At ``precision="bf16"`` the result is bf16, see
  ``_normalize_in_bf16``.
  """
  if precision == "bf16" and not add_eps:
    return _normalize_in_bf16(x, eps, axis_name)
  if add_eps:
    if axis_name is None:  # jnp's norm, for optax's bits
      norm = jnp.linalg.norm(x, axis=(-2, -1), keepdims=True)
    else:
      norm = jnp.sqrt(
        jax.lax.psum(
          jnp.sum(jnp.real(x * jnp.conj(x)), axis=(-2, -1), keepdims=True),
          axis_name,
        )
      )
    return x / (norm + eps).astype(x.dtype)
  peak, norm = frobenius_divisors(x, eps, axis_name)
  return x / peak / norm


def frobenius_divisors(x: jax.Array, eps: float, axis_name=None):
  """``(peak, norm)`` per matrix, ``normalize(x) = x / peak / norm``: the
  largest magnitude (1 for a zero matrix) and ``max(‖x / peak‖_F, eps)``.
  Inside ``shard_map`` with ``axis_name``, ``x`` is a block of each matrix
  and both are reduced over that axis (scalars), so a caller may gather the
  matrix after and use it once."""
  peak = _all_reduce(
    jax.lax.pmax, jnp.max(jnp.abs(x), axis=(-2, -1), keepdims=True), axis_name
  )
  peak = jnp.where(peak > 0, peak, 1.0)
  norm = jnp.sqrt(
    _all_reduce(
      jax.lax.psum,
      jnp.sum(jnp.square(jnp.abs(x / peak)), axis=(-2, -1), keepdims=True),
      axis_name,
    )
  )
  return peak, jnp.maximum(norm, eps)


def _normalize_in_bf16(x: jax.Array, eps: float, axis_name=None) -> jax.Array:
  """torch's ``X = bf16(G); X / max(bf16(‖X‖_F), eps)``, each step rounded to
  bf16, on ``x`` pre-scaled by a power of two near ``1 / max|x|``: exact, so
  the bits are torch's for any ``x`` whose norm is above torch's ``eps`` and
  the result is scale-invariant over the whole fp32 range. (The norm's bf16
  rounding moves it by up to 0.4%, which the Newton–Schulz polynomial does
  not undo: without it the result is 1.7% from torch's, with it 0.15%.)"""
  peak = _all_reduce(
    jax.lax.pmax, jnp.max(jnp.abs(x), axis=(-2, -1), keepdims=True), axis_name
  )
  _, exponent = jnp.frexp(peak)
  x = jnp.ldexp(x, -exponent).astype(jnp.bfloat16).astype(jnp.float32)
  norm = jnp.sqrt(
    _all_reduce(
      jax.lax.psum,
      jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True),
      axis_name,
    )
  )
  norm = norm.astype(jnp.bfloat16).astype(jnp.float32)
  return (x / jnp.maximum(norm, eps)).astype(jnp.bfloat16)


PRECONDITIONINGS = typing.get_args(types.Preconditioning)
# internal: the matrices come normalized (a sharded caller did it from the
# shards, ``frobenius_divisors``)
PRENORMALIZED = "prenormalized"
GRAM_RESCALINGS = ("aol", "schatten")  # scale X from A = X Xᴴ


def gram_rescale(
  X: jax.Array, A: jax.Array, preconditioning: str, eps: float
) -> tuple[jax.Array, jax.Array]:
  r"""``(S X, S A Sᴴ)`` for ``A = X Xᴴ``, with ``S`` read off ``A``.

  * ``"aol"``: ``S = diag(Σ_j |A_ij|)^{-1/2}`` (almost-orthogonal-layer
    rescaling, Boissin et al. 2025);
  * ``"schatten"``: ``S = ‖A‖_F^{-1/2}``, one over the Schatten-4 norm of
    ``X`` (Grishina et al. 2025).

  Both bound the spectral norm more tightly than Frobenius, so the iteration
  starts with larger singular values; the divisor is floored at ``eps``.
  """
  if preconditioning == "aol":
    s = jax.lax.rsqrt(jnp.maximum(jnp.sum(jnp.abs(A), axis=-1), eps))[..., None]
    s = s.astype(X.dtype)
    return X * s, A * s * jnp.swapaxes(s, -1, -2)
  s = jax.lax.rsqrt(
    jnp.maximum(jnp.linalg.norm(A, axis=(-2, -1), keepdims=True), eps)
  ).astype(X.dtype)
  return X * s, A * s**2


def precondition(
  x: jax.Array,
  preconditioning: str,
  eps: float,
  precision: types.Precision,
  axis_name=None,
  add_eps: bool = False,
) -> jax.Array:
  r"""Scales each matrix of ``x`` so that its singular values are ≤ 1.

  ``"frobenius"``: ``X / ‖X‖_F`` (``normalize``); ``"spectral"``:
  ``X / ‖X‖₂`` (an SVD); ``"aol"``, ``"schatten"``: see ``gram_rescale``
  (``iterate(rescale=...)`` does it within the first step instead, reusing
  its ``X Xᴴ``). ``eps`` floors the divisor; ``add_eps``: is added to the
  Frobenius or spectral norm, as in ``optax.contrib.muon``. Inside
  ``shard_map``, ``axis_name`` names the axis the columns are split over
  (not for ``"spectral"``).
  """
  if preconditioning == PRENORMALIZED:
    return x
  if preconditioning == "frobenius":
    return normalize(x, eps, axis_name, add_eps, precision)
  if preconditioning == "spectral":
    norm = jnp.linalg.norm(x, ord=2, axis=(-2, -1), keepdims=True)
    return x / ((norm + eps) if add_eps else jnp.maximum(norm, eps)).astype(
      x.dtype
    )
  A = _all_reduce(
    jax.lax.psum, matmul(x, conj_transpose(x), precision), axis_name
  )
  return gram_rescale(x, A, preconditioning, eps)[0]


def precondition_and_iterate(
  x: jax.Array, solver: "batched.Solver", axis_name=None
) -> jax.Array:
  """``iterate`` on ``x`` as ``solver`` says (its table, steps, precision,
  eps), preconditioned by its ``preconditioning``; AOL and Schatten scale
  ``x`` inside the first step, reusing its ``X Xᴴ``. With ``axis_name``
  (inside ``shard_map``) the columns of ``x`` are split over that axis."""
  s = solver
  if s.preconditioning in GRAM_RESCALINGS:
    return iterate(
      x,
      s.table,
      s.mode,
      s.steps,
      s.precision,
      axis_name,
      rescale=s.preconditioning,
      eps=s.eps,
    )
  return iterate(
    precondition(
      x, s.preconditioning, s.eps, s.precision, axis_name, s.add_eps
    ),
    s.table,
    s.mode,
    s.steps,
    s.precision,
    axis_name,
  )


def is_cubic(table) -> bool:
  """Whether every ``c`` is 0 (a traced table, from a state, is not known)."""
  return not _checks.is_traced(table) and bool(
    np.all(np.asarray(table)[:, 2] == 0)
  )


def iterate(
  x: jax.Array,
  table: np.ndarray,
  mode: str,
  steps,
  precision: types.Precision,
  axis_name=None,
  rescale: str | None = None,
  eps: float = 0.0,
) -> jax.Array:
  """Runs ``steps`` Newton–Schulz steps on normalized ``x``.

  ``x`` is wide (m ≤ n) for the fewest FLOPs, though any orientation gives the
  same polynomial of the singular values. ``steps`` may be traced
  (``optax.inject_hyperparams``): the loop then has a dynamic trip count and
  looks its coefficients up per step. Inside ``shard_map``, ``axis_name``
  names the mesh axis the columns of ``x`` are split over: the Gram matrix
  ``X Xᵀ`` is then the sum of the shards' (one all-reduce a step). Complex
  ``x`` uses ``X Xᴴ``. ``rescale`` (``"aol"`` or ``"schatten"``, floored at
  ``eps``) scales the unnormalized ``x`` within the first step, from its
  ``X Xᴴ`` (``gram_rescale``). At ``precision="bf16"`` ``A``, ``B`` and
  ``X`` are kept in bfloat16 (each rounded once, after its sum), as torch's
  Muon and Keller Jordan's reference iterate; the result is then bf16.
  """
  rows = jnp.asarray(table, jnp.float32)
  cubic = is_cubic(table)
  kept = iterate_dtype(precision, x.dtype)
  keep = lambda y: y.astype(kept)
  # c A A: torch scales the product (addmm's alpha), which rounds once
  quartic = (
    (lambda c, A: c * matmul(A, A, precision))
    if precision == "bf16"
    else (lambda c, A: matmul(c * A, A, precision))
  )

  def step(i, X, rescale=None):
    a, b, c = rows[coefficients_lib.schedule_index(i, len(table), mode, jnp)]
    A = keep(
      _all_reduce(
        jax.lax.psum, matmul(X, conj_transpose(X), precision), axis_name
      )
    )
    if rescale is not None:
      X, A = gram_rescale(X, A, rescale, eps)
    B = keep(b * A if cubic else b * A + quartic(c, A))
    return keep(a * X + matmul(B, X, precision))

  x = keep(x)
  if rescale is None:
    return jax.lax.fori_loop(0, steps, step, x)
  return jax.lax.fori_loop(1, steps, step, step(0, x, rescale))


def newton_schulz(
  x: jax.Array,
  *,
  coefficients: types.Coefficients = "quintic",
  steps: types.Steps = 5,
  precision: types.Precision = "highest",
  eps: float = 1e-30,
) -> jax.Array:
  r"""Approximately orthogonalizes each matrix of ``x`` (its polar factor).

  For each ``m × n`` matrix ``G`` (the last two axes; leading axes are
  independent matrices), on the wide orientation (``Gᵀ`` when ``m > n``)::

    X = G / max(‖G‖_F, eps)
    for (a, b, c) in schedule:  A = X Xᵀ;  B = b A + c A A;  X = a X + B X

  which drives every singular value of ``X`` towards 1, so ``X ≈ U Vᵀ`` for
  ``G = U Σ Vᵀ``. The iteration runs in fp32 whatever ``x.dtype``; a complex
  ``x`` runs in complex64 with ``X Xᴴ`` and gives ``U Vᴴ``.

  Args:
    x: array of shape ``(..., m, n)``.
    coefficients: a name in ``COEFFICIENT_SETS`` or a list of ``(a, b, c)``.
      ``"simple"`` is Keller Jordan's triple ``(3.4445, -4.775, 2.0315)``
      (``torch.optim.Muon``'s and ``optax.contrib.muon``'s default);
      ``"quintic"`` (the default) is emerging-optimizers' five-step schedule.
    steps: number of steps (an int ≥ 1; may be traced).
    precision: ``"highest"``, ``"high"``, ``"medium"``, ``"fp16"`` or
      ``"bf16"`` (see ``matmul``; only the first two for complex ``x``).
      ``"medium"`` rounds each product to bf16 but keeps the iterate in fp32
      (Megatron-Core); ``"bf16"`` keeps the iterate itself in bf16 between
      steps (torch's ``Muon``, Keller Jordan's reference).
    eps: floor of the Frobenius norm, reached only by the zero matrix.

  Returns:
    An array of ``x.shape`` and ``x.dtype``.

  References:
    Jordan et al., `Muon: An optimizer for hidden layers in neural networks
    <https://kellerjordan.github.io/posts/muon/>`_, 2024
  """
  table, mode = coefficients_lib.resolve_coefficients(coefficients)
  _checks.check_int("steps", steps, minimum=1)
  _checks.check_choice("precision", precision, PRECISIONS)
  _checks.check_range("eps", eps, 0.0, np.inf)
  if x.ndim < 2:
    raise ValueError(
      f"newton_schulz needs x of shape (..., m, n), got {x.shape}"
    )
  check_precision_for(x.dtype, precision)
  X, tall = to_wide(x.astype(working_dtype(x.dtype)))
  X = iterate(
    normalize(X, eps, precision=precision), table, mode, steps, precision
  )
  return from_wide(X, tall).astype(x.dtype)
