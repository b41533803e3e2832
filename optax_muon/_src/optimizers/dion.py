"""Dion: orthonormalize a low-rank approximation of the momentum.

For each matrix of a Muon leaf, seen as ``B`` on its tall side (``fan_in ×
fan_out`` or its transpose, rows ≥ columns), with ``Q`` (``columns × r``)
kept from the last step, as microsoft/dion's ``dion_reference.py``::

  B ← M + g                          # accumulate
  P = orth(B Q);  R = Bᵀ P           # one power iteration (``power_iters``)
  M ← B − (1 − ef_decay) · P Rᵀ      # error feedback: keep what P missed
  Q ← R / (‖R‖_columns + ε)
  update = scale_factor(fan_out, fan_in) · extra · P Qᵀ

``orth`` is a QR's orthonormal factor; the update does not depend on its
column signs (a sign flips ``P``'s column and ``R``'s alike), so
Householder QR here gives dion's randomized Cholesky QR's update. The rank
is ``r = min(⌈rank_fraction · n / rank_multiple_of⌉ · rank_multiple_of, n)``
of the shorter side ``n``; the first ``Q`` is Gaussian (``seed``).

Under SPMD the momentum is the global one (JAX averages gradients before
the update), so dion's compressed data-parallel all-reduce of ``P`` and
``R`` and its ``synchronize_for_checkpoint`` have nothing to do: every
device holds the same state, and a checkpoint is exact as saved.
"""

import math
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_muon._src.base import checks as _checks
from optax_muon._src.base import types
from optax_muon._src.base.trees import pieces_structure
from optax_muon._src.kernels import matrices
from optax_muon._src.kernels import shape_scale
from optax_muon._src.optimizers import settings
from optax_muon._src.optimizers.dion2_selection import explicit_sharding
from optax_muon._src.optimizers.dion2_selection import replicated
from optax_muon._src.optimizers.dion2_selection import resharded
from optax_muon._src.optimizers.route import route
from optax_muon._src.parallel import waves
from optax_muon._src.transforms import scaling
from optax_muon._src.transforms.momentum import canonical_dtype
from optax_muon._src.transforms.scaling import resolve_extra_scale_factor
from optax_muon._src.views import layout as layout_lib
from optax_muon._src.views.layout import from_layout


class DionState(NamedTuple):
  """Per leaf, the momentum (the leaf's shape) and, per matrix piece, the
  power iteration's ``Q`` ``(matrices, n, r)`` in the momentum's dtype
  (microsoft/dion's default: the param's), ``n`` the shorter side."""

  momentum: Any
  q: Any


def dion_rank(rank_fraction: float, rank_multiple_of: int, shape) -> int:
  """The rank ``r`` of a ``(rows, columns)`` matrix: microsoft/dion's
  ``rank_fraction · min`` rounded up to ``rank_multiple_of``, at most the
  shorter side."""
  shorter = min(shape)
  r = rank_multiple_of * math.ceil(rank_fraction * shorter / rank_multiple_of)
  return min(r, shorter)


def _tall(piece: jax.Array) -> tuple[jax.Array, bool]:
  """``piece`` ``(matrices, fan_in, fan_out)`` on its tall side, and whether
  it was turned: ``(fan_out, fan_in)`` unless ``fan_in`` is longer
  (microsoft/dion's ``(out, in)``, transposed when wide)."""
  turned = piece.shape[-2] <= piece.shape[-1]
  return (jnp.swapaxes(piece, -1, -2) if turned else piece), turned


def _untall(x: jax.Array, turned: bool) -> jax.Array:
  return jnp.swapaxes(x, -1, -2) if turned else x


QR_METHODS = ("qr", "rcqr")
# microsoft/dion's rcqr_oversample: the sketch has ⌈1.25 r / 128⌉ · 128 rows
_OVERSAMPLE = 1.25


def sketch_rows(r: int) -> int:
  """The rows of rcqr's random sketch for rank ``r``."""
  return 128 * math.ceil(_OVERSAMPLE * r / 128)


def _householder(p: jax.Array) -> jax.Array:
  """An orthonormal basis of ``p``'s columns: its QR's ``Q`` (float32)."""
  return jnp.linalg.qr(p.astype(jnp.float32), mode="reduced")[0]


def _times_inverse(x: jax.Array, triangle: jax.Array, lower: bool):
  """``x · triangle⁻¹`` as a product with the small inverse, so that a
  row-sharded ``x`` stays sharded."""
  eye = jnp.broadcast_to(jnp.eye(triangle.shape[-1]), triangle.shape)
  inverse = jax.scipy.linalg.solve_triangular(triangle, eye, lower=lower)
  return matrices.matmul(x, inverse, "highest")


def _sketched_cholesky(p: jax.Array, key: jax.Array) -> jax.Array:
  """microsoft/dion's randomized Cholesky QR (``rcqr``) of the tall ``p``:
  ``R`` from the QR of the small sketch ``S p`` (``sketch_rows(r) × r``),
  ``p R⁻¹``, then one Cholesky QR round. Only ``S p`` and an ``r × r``
  Gram cross a sharded row axis, and the basis is QR's (its ``R`` upper
  triangular), so the step is ``"qr"``'s up to rounding; a rank-deficient
  ``p`` gives NaN, zeroed by the caller (as dion does)."""
  p = p.astype(jnp.float32)
  rows, r = p.shape[-2:]
  count = sketch_rows(r)
  sketch = jax.random.normal(key, (count, rows)) / math.sqrt(count)
  upper = jnp.linalg.qr(matrices.matmul(sketch, p, "highest"), mode="r")
  p = _times_inverse(p, upper, lower=False)
  gram = matrices.matmul(jnp.swapaxes(p, -1, -2), p, "highest")
  lower = jnp.linalg.cholesky(gram)  # gram = L Lᵀ: p L⁻ᵀ is orthonormal
  return _times_inverse(p, jnp.swapaxes(lower, -1, -2), lower=False)


def dion_step(
  b, q, *, ef_decay, power_iters, epsilon, precision, sketch_key=None
):
  """One Dion step on a tall stack ``b`` ``(matrices, rows, n)`` from ``q``
  ``(matrices, n, r)``: ``(direction P Qᵀ, new momentum, new Q)``, float32.

  ``P`` is orthonormalized by Householder QR, or by dion's randomized
  Cholesky QR with ``sketch_key``. A zero matrix gives a zero direction and
  keeps its ``q`` (microsoft/dion's ``fix_all_zero_or_nan``)."""
  b = b.astype(jnp.float32)
  transposed = jnp.swapaxes(b, -1, -2)
  r = q
  for _ in range(power_iters):
    p = matrices.matmul(b, r, precision)
    p = (
      _householder(p)
      if sketch_key is None
      else _sketched_cholesky(p, sketch_key)
    )
    r = matrices.matmul(transposed, p, precision)
  zero = jnp.all(b == 0, axis=(-2, -1), keepdims=True)
  p = jnp.where(zero, 0.0, jnp.nan_to_num(p))
  r = jnp.where(zero, q, jnp.nan_to_num(r))
  captured = matrices.matmul(p, jnp.swapaxes(r, -1, -2), precision)
  momentum = b - (1 - ef_decay) * captured
  q = r / (jnp.sqrt(jnp.sum(jnp.square(r), axis=-2, keepdims=True)) + epsilon)
  direction = matrices.matmul(p, jnp.swapaxes(q, -1, -2), precision)
  return direction, momentum, q


def wave_bytes(rows: int, n: int, r: int) -> int:
  """The float32 bytes one matrix's step keeps live, whole: ``B``, its
  captured part and the direction (``rows × n`` each), ``P`` and the QR's
  workspace (``rows × r``), ``Q`` and ``R`` (``n × r``), rcqr's sketch."""
  sketch = sketch_rows(r) * rows
  return 4 * (3 * rows * n + 3 * rows * r + 3 * n * r + sketch)


def _in_waves(step, tall, q, budget: int):
  """``step`` over the stack ``(tall, q)`` in parts of at most ``budget``
  bytes (``wave_bytes``), one part after another (``lax.map``): a 70B
  model's scanned stack in float32 at once is hundreds of GiB."""
  count, rows, n = tall.shape
  per_matrix = wave_bytes(rows, n, q.shape[-1])
  part = max(1, min(count, budget // per_matrix))
  if part >= count:
    return step(tall, q)
  return jax.lax.map(lambda x: step(*x), (tall, q), batch_size=part)


def scale_by_dion(
  *,
  rank_fraction: types.Numeric = 1.0,
  rank_multiple_of: int = 1,
  ef_decay: types.Numeric = 0.95,
  power_iters: int = 1,
  qr_method: str = "qr",
  epsilon: types.Numeric = 1e-8,
  seed: int = 0,
  mu_dtype: types.MomentumDtype = None,
  precision: types.Precision = "highest",
  memory_budget: int | None = None,
  scale_mode: types.ScaleMode = "unit_rms_norm",
  extra_scale_factor: types.Numeric | None = None,
  match_adamw_update_rms: bool = False,
  adamw_beta1: types.Numeric = 0.9,
  dimension_numbers: types.PerLeaf = None,
  split_qkv: types.PerLeaf = None,
  split_gate_up: types.PerLeaf = None,
  layout: Any = None,
) -> optax.GradientTransformation:
  r"""Dion's direction: see the module docstring for the update.

  ``mu_dtype``, ``precision`` (of the power iteration's products; the QR is
  float32), ``memory_budget`` (the bytes per device of a wave: a stack's
  matrices run in parts whose float32 working set, ``wave_bytes``, fits
  it), ``extra_scale_factor``, ``match_adamw_update_rms``,
  ``dimension_numbers``, ``split_qkv``, ``split_gate_up`` and ``layout``
  are ``scale_by_muon``'s; ``scale_mode`` defaults to microsoft/dion's
  ``√(fan_out/fan_in)`` (``"unit_rms_norm"``). ``beta``, ``nesterov`` and
  ``momentum_style`` do not apply: the momentum is a sum whose captured
  part decays by ``ef_decay``; nor do ``coefficients``, ``steps``,
  ``method`` and ``preconditioning``: there is no
  Newton–Schulz iteration, only a QR of the ``rows × r`` product; nor does
  ``sharding`` yet (see ``dion``).

  Args:
    rank_fraction: ``r`` as a share of the shorter side, in ``(0, 1]``.
    rank_multiple_of: ``r`` rounded up to a multiple of this, ``≥ 1``.
    ef_decay: the error-feedback decay of the captured part (microsoft/
      dion's ``mu``), in ``[0, 1]``.
    power_iters: power iterations per step, ``≥ 1``.
    qr_method: how ``P`` is orthonormalized: ``"qr"`` (Householder, in
      float32; any rank) or ``"rcqr"`` (microsoft/dion's randomized
      Cholesky QR, its default: matrix products and ``r × r`` factors
      only, so a sharded ``P`` is not gathered; a rank-deficient ``P``
      loses the columns after its first dependent one, as in dion).
    epsilon: the floor added to ``R``'s column norms.
    seed: the seed of the first ``Q`` (the same on every device).

  Returns:
    An ``optax.GradientTransformation`` whose state is a ``DionState``.

  References:
    Ahn et al., `Dion: Distributed Orthonormalized Updates
    <https://arxiv.org/abs/2504.05295>`_, 2025; microsoft/dion
    ``dion/dion_reference.py``
  """
  if isinstance(rank_fraction, bool) or not isinstance(
    rank_fraction, (int, float)
  ):
    raise ValueError(
      f"rank_fraction={rank_fraction!r} is not accepted; accepted values: "
      "a number in (0, 1]"
    )
  if not 0 < rank_fraction <= 1:
    raise ValueError(
      f"rank_fraction={rank_fraction!r} is not accepted; accepted values: "
      "(0, 1]"
    )
  for name, value in (
    ("rank_multiple_of", rank_multiple_of),
    ("power_iters", power_iters),
  ):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(
        f"{name}={value!r} is not accepted; accepted values: an int >= 1"
      )
  if isinstance(seed, bool) or not isinstance(seed, int):
    raise ValueError(f"seed={seed!r} is not accepted; accepted values: an int")
  _checks.check_choice("qr_method", qr_method, QR_METHODS)
  _checks.check_range("ef_decay", ef_decay, 0.0, 1.0 + 1e-12)
  _checks.check_range("epsilon", epsilon, 0.0, float("inf"))
  _checks.check_choice("precision", precision, matrices.PRECISIONS)
  _checks.check_choice("scale_mode", scale_mode, shape_scale.SCALE_MODES)
  mu_dtype = canonical_dtype("mu_dtype", mu_dtype)
  budget = waves.resolve(memory_budget)
  _, dimension_numbers = from_layout(layout, None, dimension_numbers)
  extra = resolve_extra_scale_factor(
    extra_scale_factor, match_adamw_update_rms, adamw_beta1
  )
  arguments = dict(locals(), layout=None)
  resolve_views = layout_lib.view_resolver(
    dimension_numbers, split_qkv, split_gate_up
  )

  def init_fn(params):
    momentum = jax.tree.map(
      lambda p: jnp.zeros_like(p, dtype=mu_dtype or jnp.result_type(p)), params
    )
    key = jax.random.key(seed)
    qs, count = [], 0
    for _, leaf, view in resolve_views(params):
      pieces = []
      batch = math.prod(view.batch_shape)
      dtype = mu_dtype or jnp.result_type(leaf)
      for fan_in, fan_out in view.matrix_shapes:
        r = dion_rank(rank_fraction, rank_multiple_of, (fan_in, fan_out))
        shape = (batch, min(fan_in, fan_out), r)
        q = jax.random.normal(jax.random.fold_in(key, count), shape)
        pieces.append(q.astype(dtype))
        count += 1
      qs.append(tuple(pieces))
    return DionState(momentum, jax.tree.unflatten(pieces_structure(params), qs))

  def update_fn(updates, state, params=None):
    del params
    sketch_key = (
      jax.random.fold_in(jax.random.key(seed), 2**31 - 1)
      if qr_method == "rcqr"
      else None
    )
    treedef = jax.tree.structure(updates)
    shardings = [
      explicit_sharding(m) for m in treedef.flatten_up_to(state.momentum)
    ]
    sums = jax.tree.map(
      lambda m, g: replicated(m + g.astype(m.dtype)), state.momentum, updates
    )
    directions, momenta, qs = [], [], []
    for (_, b, view), leaf_qs, sharding in zip(
      resolve_views(sums),
      pieces_structure(updates).flatten_up_to(state.q),
      shardings,
    ):
      pieces, kept, new_qs = [], [], []
      # by position: flax's nnx.Optimizer hands a tuple back as a mapping
      # from positions
      for i, piece in enumerate(view.to_matrices(b)):
        tall, turned = _tall(piece)
        q_dtype = leaf_qs[i].dtype

        def step(tall, q, dtype=piece.dtype, q_dtype=q_dtype):
          direction, momentum, q = dion_step(
            tall,
            q.astype(jnp.float32),
            ef_decay=ef_decay,
            power_iters=power_iters,
            epsilon=epsilon,
            precision=precision,
            sketch_key=sketch_key,
          )
          return (
            direction.astype(dtype),
            momentum.astype(dtype),
            q.astype(q_dtype),
          )

        direction, momentum, q = _in_waves(step, tall, leaf_qs[i], budget)
        pieces.append(_untall(direction, turned))
        kept.append(_untall(momentum, turned))
        new_qs.append(q)
      directions.append(resharded(view.from_matrices(pieces), sharding))
      momenta.append(resharded(view.from_matrices(kept), sharding))
      qs.append(tuple(new_qs))
    direction = jax.tree.unflatten(treedef, directions)
    direction, _ = shape.update(direction, shape.init(direction))
    direction = jax.tree.map(lambda d: d * extra, direction)
    return direction, DionState(
      jax.tree.unflatten(treedef, momenta),
      jax.tree.unflatten(pieces_structure(updates), qs),
    )

  shape = scaling.scale_by_shape(
    scale_mode, **settings.forward(scaling.scale_by_shape, arguments)
  )
  return optax.GradientTransformation(init_fn, update_fn)


def dion(
  learning_rate: optax.ScalarOrSchedule,
  *,
  rank_fraction: types.Numeric = 1.0,
  rank_multiple_of: int = 1,
  ef_decay: types.Numeric = 0.95,
  power_iters: int = 1,
  qr_method: str = "qr",
  epsilon: types.Numeric = 1e-8,
  seed: int = 0,
  mu_dtype: types.MomentumDtype = None,
  precision: types.Precision = "highest",
  memory_budget: int | None = None,
  scale_mode: types.ScaleMode = "unit_rms_norm",
  extra_scale_factor: types.Numeric | None = None,
  match_adamw_update_rms: bool = False,
  dimension_numbers: types.PerLeaf = None,
  split_qkv: types.PerLeaf = None,
  split_gate_up: types.PerLeaf = None,
  layout: Any = None,
  weight_decay: types.Numeric = 0.0,
  weight_decay_mask: types.PerLeaf = None,
  labels: types.PerLeaf = None,
  state_memory_kind: types.MemoryKind | None = None,
  **scalar_kwargs,
) -> optax.GradientTransformation:
  r"""Dion for the matrices, AdamW for the rest: ``om.muon``'s routing with
  ``scale_by_dion`` as the direction;
  ``p ← p − lr · (scale_by_dion(g) + weight_decay · p)``.

  ``beta``, ``nesterov`` and ``momentum_style`` do not apply (the momentum
  is a sum; ``ef_decay`` decays what the low-rank step captured); nor do
  ``coefficients``, ``steps``, ``method`` and ``preconditioning`` (no
  Newton–Schulz: a QR); nor ``sharding`` yet: sharded
  params are partitioned by XLA under ``jax.jit`` (a row-sharded ``B``
  gives a row-sharded ``B Q`` and an all-reduced ``Bᵀ P``: Dion's own
  traffic), and explicitly sharded ones are gathered for the step.
  ``rank_fraction`` defaults to microsoft/dion's 1 (the paper's large runs
  use ¼ or less); ``weight_decay`` is the family's 0 (microsoft/dion's is
  0.01).

  Args:
    learning_rate: a float or an optax schedule.
    rank_fraction: the low rank as a share of each matrix's shorter side.
    rank_multiple_of: the rank rounded up to a multiple of this.
    ef_decay: the error-feedback decay (microsoft/dion's ``mu``).
    power_iters: power iterations per step.
    qr_method: ``"qr"`` (Householder) or ``"rcqr"`` (dion's randomized
      Cholesky QR, for sharded matrices; see ``scale_by_dion``).
    epsilon: the floor of ``R``'s column norms.
    seed: the seed of the first ``Q``.
    **scalar_kwargs: ``om.muon``'s ``scalar_optimizer`` and ``adam_*``
      arguments, for the leaves that are not matrices.

  Returns:
    An ``optax.GradientTransformation``.

  Example:
    >>> import jax, jax.numpy as jnp, optax_muon as om
    >>> params = {"hidden": jnp.ones((16, 32)), "bias": jnp.zeros(32)}
    >>> grads = {"hidden": jax.random.normal(jax.random.key(0), (16, 32)),
    ...          "bias": jnp.ones(32)}
    >>> tx = om.dion(0.01, rank_fraction=0.25)
    >>> updates, _ = tx.update(grads, tx.init(params), params)
    >>> # a step of rank r = ⌈0.25 · 16⌉ = 4
    >>> int(jnp.linalg.matrix_rank(updates["hidden"]))
    4

  References:
    Ahn et al., `Dion: Distributed Orthonormalized Updates
    <https://arxiv.org/abs/2504.05295>`_, 2025
  """
  labels, dimension_numbers = from_layout(layout, labels, dimension_numbers)
  arguments = dict(locals(), layout=None)
  direction = scale_by_dion(**settings.forward(scale_by_dion, arguments))
  return route(
    direction,
    learning_rate,
    **settings.forward(route, arguments),
    **scalar_kwargs,
  )
