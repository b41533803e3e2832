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

The step itself is ``dion_power``'s. Without a ``sharding``, a matrix
split across devices is gathered for its step (or, on Auto meshes,
partitioned by XLA); with an ``om.TensorParallel`` in mode
``"distributed"`` each device keeps its block and only ``rows × r`` and
``n × r`` products travel (``dion_distributed``: microsoft/dion's
``dion_update_fsdp_tp``).

Under SPMD the momentum is the global one (JAX averages gradients before
the update), so dion's compressed data-parallel all-reduce of ``P`` and
``R`` and its ``synchronize_for_checkpoint`` have nothing to do: the state
is one global array per piece, and a checkpoint is exact as saved.
"""

import functools
import math
from typing import Any
from typing import NamedTuple
from typing import Unpack

import jax
import jax.numpy as jnp
import optax

from optax_muon._src.base import built
from optax_muon._src.base import checks as _checks
from optax_muon._src.base import types
from optax_muon._src.base.trees import pieces_structure
from optax_muon._src.kernels import dion_power
from optax_muon._src.kernels import matrices
from optax_muon._src.kernels.dion2_selection import explicit_sharding
from optax_muon._src.kernels.dion2_selection import replicated
from optax_muon._src.kernels.dion2_selection import resharded
from optax_muon._src.kernels.dion_power import QR_METHODS
from optax_muon._src.kernels.dion_power import dion_rank
from optax_muon._src.optimizers import registry
from optax_muon._src.optimizers import settings
from optax_muon._src.optimizers.route import route
from optax_muon._src.parallel import dion_distributed
from optax_muon._src.parallel import tensor_parallel as sharding_lib
from optax_muon._src.parallel.execution import Execution
from optax_muon._src.parallel.tensor_parallel import TensorParallel
from optax_muon._src.transforms import scaling
from optax_muon._src.transforms.momentum import canonical_dtype
from optax_muon._src.views.layout import from_layout
from optax_muon._src.views.matrix_views import Views


class DionState(NamedTuple):
  """Per leaf, the momentum (the leaf's shape) and, per matrix piece, the
  power iteration's ``Q`` ``(matrices, n, r)`` in the momentum's dtype
  (microsoft/dion's default: the param's), ``n`` the shorter side."""

  momentum: Any
  q: Any


def _check_settings(
  rank_fraction, rank_multiple_of, power_iters, seed, qr_method, sharding
) -> None:
  """Raises ``ValueError`` naming the first rank or sharding setting not
  accepted."""
  _checks.check_fraction("rank_fraction", rank_fraction)
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
  sharding_lib.check_sharding(sharding)
  sharding_lib.check_bound("Dion", sharding)
  if sharding is not None and sharding.mode != "distributed":
    raise ValueError(
      f"sharding.mode={sharding.mode!r} is not accepted for Dion; accepted "
      "values: ['distributed'] (Dion's own scheme: each device keeps its "
      "block, P and R are summed across blocks); for a gathered step pass "
      "sharding=None"
    )
  if sharding is not None and sharding.distribute_over is not None:
    raise ValueError(
      f"sharding.distribute_over={sharding.distribute_over!r} is not "
      "accepted for Dion; accepted values: [None] (no matrix is gathered, so "
      "there is no stack to share out)"
    )


def _plans(sharding, tree, views):
  """Per leaf of ``tree``, its ``dion_distributed.DistributedLeaf``
  (``None``: its step runs on whole matrices)."""
  if sharding is None:
    return [None] * len(views)
  return [
    dion_distributed.plan(view, spec, sharding)
    for (_, _, view), spec in zip(views, sharding.leaf_specs(tree))
  ]


@built.recorded
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
  sharding: TensorParallel | None = None,
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
  Newton–Schulz iteration, only a QR of the ``rows × r`` product.

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
    sharding: ``None`` (a matrix split across devices is gathered for its
      step when its mesh axes are Explicit, partitioned by XLA when Auto),
      or an ``optax_muon.TensorParallel`` with ``mode="distributed"``:
      Dion's own scheme (``dion_distributed``), every mesh axis of
      ``sharding.specs`` that splits a matrix kept split; ``axis`` singles
      none out.

  Returns:
    An ``optax.GradientTransformation`` whose state is a ``DionState``.

  References:
    Ahn et al., `Dion: Distributed Orthonormalized Updates
    <https://arxiv.org/abs/2504.05295>`_, 2025; microsoft/dion
    ``dion/dion_reference.py``
  """
  _check_settings(
    rank_fraction,
    rank_multiple_of,
    power_iters,
    seed,
    qr_method,
    sharding,
  )
  _checks.check_range("ef_decay", ef_decay, 0.0, 1.0 + 1e-12)
  _checks.check_range("epsilon", epsilon, 0.0, float("inf"))
  _checks.check_choice("precision", precision, matrices.PRECISIONS)
  extra = settings.extra_scale(
    scale_mode, extra_scale_factor, match_adamw_update_rms, adamw_beta1
  )
  mu_dtype = canonical_dtype("mu_dtype", mu_dtype)
  dimension_numbers = settings.layout_dimension_numbers(
    layout, dimension_numbers
  )
  budget = Execution(sharding=sharding, memory_budget=memory_budget).wave_bytes
  resolve_views = Views(
    dimension_numbers=dimension_numbers,
    split_qkv=split_qkv,
    split_gate_up=split_gate_up,
  )

  plans = functools.partial(_plans, sharding)

  def init_fn(params):
    momentum = jax.tree.map(
      lambda p: jnp.zeros_like(p, dtype=mu_dtype or jnp.result_type(p)), params
    )
    key = jax.random.key(seed)
    views = resolve_views(params)
    qs, count = [], 0
    for (_, leaf, view), plan in zip(views, plans(params, views)):
      pieces = []
      batch = math.prod(view.batch_shape)
      dtype = mu_dtype or jnp.result_type(leaf)
      for fan_in, fan_out in view.matrix_shapes:
        r = dion_rank(rank_fraction, rank_multiple_of, (fan_in, fan_out))
        shape = (batch, min(fan_in, fan_out), r)
        q = jax.random.normal(jax.random.fold_in(key, count), shape)
        q = q.astype(dtype)
        pieces.append(q if plan is None else plan.placed(q))
        count += 1
      qs.append(tuple(pieces))
    return DionState(momentum, jax.tree.unflatten(pieces_structure(params), qs))

  def rank_step(tall, q, shards=dion_power.WHOLE):
    return dion_power.dion_step(
      tall,
      q,
      ef_decay=ef_decay,
      power_iters=power_iters,
      epsilon=epsilon,
      precision=precision,
      sketch_key=(
        jax.random.fold_in(jax.random.key(seed), 2**31 - 1)
        if qr_method == "rcqr"
        else None
      ),
      shards=shards,
    )

  def whole_step(b, view, leaf_qs):
    """A leaf's step on its whole matrices: ``(direction, momentum, qs)``."""
    pieces, kept, new_qs = [], [], []
    for i, piece in enumerate(view.to_matrices(b)):
      turned = dion_power.is_turned(*piece.shape[-2:])
      stack = dion_power.tall(piece, turned)
      rows, n = stack.shape[-2:]
      # by position: flax's nnx.Optimizer hands a tuple back as a mapping
      # from positions
      per_matrix = dion_power.wave_bytes(rows, n, leaf_qs[i].shape[-1])
      direction, momentum, q = dion_power.in_waves(
        rank_step, stack, leaf_qs[i], budget, per_matrix
      )
      pieces.append(dion_power.untall(direction, turned))
      kept.append(dion_power.untall(momentum, turned))
      new_qs.append(q)
    return view.from_matrices(pieces), view.from_matrices(kept), new_qs

  def update_fn(updates, state, params=None):
    del params
    treedef = jax.tree.structure(updates)
    pieces = pieces_structure(updates)
    views = resolve_views(updates)
    directions, momenta, qs = [], [], []
    for (_, g, view), m, leaf_qs, plan in zip(
      views,
      treedef.flatten_up_to(state.momentum),
      pieces.flatten_up_to(state.q),
      plans(updates, views),
    ):
      if plan is not None:
        direction, momentum, q = dion_distributed.step(
          plan, m, g, leaf_qs[0], rank_step=rank_step, budget=budget
        )
        new_qs = [q]
      else:
        where = explicit_sharding(m)
        b = replicated(m + g.astype(m.dtype))
        direction, momentum, new_qs = whole_step(b, view, leaf_qs)
        direction = resharded(direction, where)
        momentum = resharded(momentum, where)
      directions.append(direction)
      momenta.append(momentum)
      qs.append(tuple(new_qs))
    direction = jax.tree.unflatten(treedef, directions)
    direction, _ = shape.update(direction, shape.init(direction))
    direction = jax.tree.map(lambda d: d * extra, direction)
    return direction, DionState(
      jax.tree.unflatten(treedef, momenta), jax.tree.unflatten(pieces, qs)
    )

  shape = scaling.scale_by_shape(
    scale_mode,
    dimension_numbers=dimension_numbers,
    split_qkv=split_qkv,
    sharding=sharding,
    split_gate_up=split_gate_up,
    precision=precision,
    memory_budget=memory_budget,
  )
  return optax.GradientTransformation(init_fn, update_fn)


@built.recorded
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
  sharding: TensorParallel | None = None,
  **scalar_kwargs: Unpack[settings.ScalarOptimizerOptions],
) -> optax.GradientTransformation:
  r"""Dion for the matrices, AdamW for the rest: ``om.muon``'s routing with
  ``scale_by_dion`` as the direction;
  ``p ← p − lr · (scale_by_dion(g) + weight_decay · p)``.

  ``beta``, ``nesterov`` and ``momentum_style`` do not apply (the momentum
  is a sum; ``ef_decay`` decays what the low-rank step captured); nor do
  ``coefficients``, ``steps``, ``method`` and ``preconditioning`` (no
  Newton–Schulz: a QR). Without ``sharding``, params sharded over Auto
  mesh axes are partitioned by XLA under ``jax.jit`` and explicitly
  sharded ones are gathered for the step; with
  ``sharding=om.TensorParallel(mesh, mode="distributed", specs=...)`` each
  device keeps its block of every matrix and only ``B Q`` and ``Bᵀ P``
  (``rows × r``, ``n × r``) are all-reduced: microsoft/dion's FSDP × TP
  scheme, ``Q`` split as each matrix's shorter side.
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
    sharding: ``None`` or an ``om.TensorParallel`` with
      ``mode="distributed"`` (see ``scale_by_dion``).
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
  routing = settings.scalar_options(scalar_kwargs)
  direction = scale_by_dion(
    rank_fraction=rank_fraction,
    rank_multiple_of=rank_multiple_of,
    ef_decay=ef_decay,
    power_iters=power_iters,
    qr_method=qr_method,
    epsilon=epsilon,
    seed=seed,
    mu_dtype=mu_dtype,
    precision=precision,
    memory_budget=memory_budget,
    scale_mode=scale_mode,
    extra_scale_factor=extra_scale_factor,
    match_adamw_update_rms=match_adamw_update_rms,
    adamw_beta1=routing["adam_b1"],
    dimension_numbers=dimension_numbers,
    split_qkv=split_qkv,
    split_gate_up=split_gate_up,
    sharding=sharding,
  )
  return route(
    direction,
    learning_rate,
    weight_decay=weight_decay,
    weight_decay_mask=weight_decay_mask,
    labels=labels,
    state_memory_kind=state_memory_kind,
    **routing,
  )


def _from_config(
  config, learning_rate, *, beta, nesterov, momentum_style, **keywords
):
  """``MuonConfig(optimizer="dion")`` with the ``dion_*`` fields:
  ``muon_momentum`` is its ``ef_decay``; the Newton–Schulz settings do not
  apply. ``sharding`` is set when ``muon_tp_mode="distributed"`` (Dion's
  own scheme)."""
  del nesterov, momentum_style
  return dion(
    learning_rate,
    rank_fraction=config.dion_rank_fraction,
    qr_method=config.dion_qr_method,
    ef_decay=beta,
    **{
      name: value
      for name, value in keywords.items()
      if name not in settings.NEWTON_SCHULZ
    },
  )


registry.register(
  "dion",
  registry.ConfigMember(
    factory=_from_config,
    field_prefixes=("dion_",),
    tp_modes=(None, "distributed"),
    tp_modes_why=(
      "None: a split matrix gathered for its step, or partitioned by XLA; "
      "'distributed': Dion's own scheme, each device keeps its block, P and "
      "R are all-reduced"
    ),
    own_scheme=True,
  ),
)
