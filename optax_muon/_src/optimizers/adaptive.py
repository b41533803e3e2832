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
import optax

from optax_muon._src.base import built
from optax_muon._src.base import checks as _checks
from optax_muon._src.base import types
from optax_muon._src.optimizers import registry
from optax_muon._src.optimizers import settings
from optax_muon._src.optimizers.route import route
from optax_muon._src.parallel.tensor_parallel import TensorParallel
from optax_muon._src.transforms.moment2 import Moment2State
from optax_muon._src.transforms.moment2 import scale_by_moment2
from optax_muon._src.views.layout import from_layout


class AdaptiveMuonState(NamedTuple):
  momentum: Any
  moment2: Moment2State


@built.recorded
def scale_by_adaptive_muon(
  *,
  moment2_method: types.Moment2Method = "adamuon",
  beta2: types.Numeric = 0.95,
  moment2_eps: types.Numeric = 1e-8,
  beta: types.Numeric = 0.95,
  nesterov: bool = True,
  momentum_style: types.MomentumStyle = "ema",
  mu_dtype: types.MomentumDtype = None,
  coefficients: types.Coefficients = "quintic",
  steps: types.Steps = 5,
  precision: types.Precision = "highest",
  scale_mode: types.ScaleMode = "spectral",
  extra_scale_factor: types.Numeric | None = None,
  match_adamw_update_rms: bool = False,
  adamw_beta1: types.Numeric = 0.9,
  dimension_numbers: types.PerLeaf = None,
  split_qkv: types.PerLeaf = None,
  sharding: TensorParallel | None = None,
  layout: Any = None,
  split_gate_up: types.PerLeaf = None,
  memory_budget: int | None = None,
  method: types.Method = "standard",
  preconditioning: types.Preconditioning = "frobenius",
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
  ``split_qkv``, ``layout``, ``split_gate_up``, ``memory_budget``,
  ``method``, ``preconditioning``).

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
  return _scale_by_adaptive_muon(
    moment2_method,
    beta2,
    moment2_eps,
    settings.Momentum(
      beta=beta,
      nesterov=nesterov,
      momentum_style=momentum_style,
      mu_dtype=mu_dtype,
    ),
    settings.Orthogonalization.of(
      coefficients=coefficients,
      steps=steps,
      precision=precision,
      method=method,
      preconditioning=preconditioning,
      dimension_numbers=settings.layout_dimension_numbers(
        layout, dimension_numbers
      ),
      split_qkv=split_qkv,
      split_gate_up=split_gate_up,
      sharding=sharding,
      memory_budget=memory_budget,
    ),
    scale_mode,
    settings.extra_scale(
      scale_mode, extra_scale_factor, match_adamw_update_rms, adamw_beta1
    ),
  )


def _scale_by_adaptive_muon(
  moment2_method: types.Moment2Method,
  beta2: types.Numeric,
  moment2_eps: types.Numeric,
  momentum_settings: settings.Momentum,
  orthogonalization: settings.Orthogonalization,
  scale_mode: types.ScaleMode,
  extra: Any,
) -> optax.GradientTransformation:
  """``scale_by_adaptive_muon`` of its settings objects (built and checked
  once by it or ``adaptive_muon``)."""
  momentum = momentum_settings.transform(orthogonalization.execution)
  orthogonalize = orthogonalization.orthogonalize()
  views = orthogonalization.views
  moment2 = scale_by_moment2(
    moment2_method,
    beta2,
    moment2_eps,
    dimension_numbers=views.dimension_numbers,
    split_qkv=views.split_qkv,
    split_gate_up=views.split_gate_up,
  )
  shape = orthogonalization.scale_by_shape(scale_mode)

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


@built.recorded
def adaptive_muon(
  learning_rate: optax.ScalarOrSchedule,
  *,
  moment2_method: types.Moment2Method = "adamuon",
  beta2: types.Numeric = 0.95,
  moment2_eps: types.Numeric = 1e-8,
  beta: types.Numeric = 0.95,
  nesterov: bool = True,
  momentum_style: types.MomentumStyle = "ema",
  mu_dtype: types.MomentumDtype = None,
  coefficients: types.Coefficients = "quintic",
  steps: types.Steps = 5,
  precision: types.Precision = "highest",
  scale_mode: types.ScaleMode = "spectral",
  extra_scale_factor: types.Numeric | None = None,
  match_adamw_update_rms: bool = False,
  dimension_numbers: types.PerLeaf = None,
  split_qkv: types.PerLeaf = None,
  sharding: TensorParallel | None = None,
  layout: Any = None,
  split_gate_up: types.PerLeaf = None,
  weight_decay: types.Numeric = 0.0,
  weight_decay_mask: types.PerLeaf = None,
  labels: types.PerLeaf = None,
  scalar_optimizer: types.ScalarOptimizer = "adam",
  adam_learning_rate: optax.ScalarOrSchedule | None = None,
  adam_b1: types.Numeric = 0.9,
  adam_b2: types.Numeric = 0.999,
  adam_eps: types.Numeric = 1e-8,
  adam_weight_decay: types.Numeric = 0.0,
  adam_weight_decay_mask: types.PerLeaf = None,
  memory_budget: int | None = None,
  state_memory_kind: types.MemoryKind | None = None,
  method: types.Method = "standard",
  preconditioning: types.Preconditioning = "frobenius",
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

  Example:
    >>> import jax, jax.numpy as jnp, optax_muon as om
    >>> params = {"hidden": jnp.ones((16, 32))}
    >>> tx = om.adaptive_muon(0.02, moment2_method="normuon")
    >>> state = tx.init(params)
    >>> updates, state = tx.update(params, state, params)
    >>> updates["hidden"].shape
    (16, 32)

  References:
    NVIDIA emerging-optimizers 0.3.0, ``AdaptiveMuon``;
    Megatron-Core ``optimizer="adaptive_muon"``
  """
  _checks.check_range("adam_b1", adam_b1, 0.0, 1.0)
  labels, dimension_numbers = from_layout(layout, labels, dimension_numbers)
  direction = _scale_by_adaptive_muon(
    moment2_method,
    beta2,
    moment2_eps,
    settings.Momentum(
      beta=beta,
      nesterov=nesterov,
      momentum_style=momentum_style,
      mu_dtype=mu_dtype,
    ),
    settings.Orthogonalization.of(
      coefficients=coefficients,
      steps=steps,
      precision=precision,
      method=method,
      preconditioning=preconditioning,
      dimension_numbers=dimension_numbers,
      split_qkv=split_qkv,
      split_gate_up=split_gate_up,
      sharding=sharding,
      memory_budget=memory_budget,
    ),
    scale_mode,
    settings.extra_scale(
      scale_mode, extra_scale_factor, match_adamw_update_rms, adam_b1
    ),
  )
  return route(
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


def _from_config(config, learning_rate, **keywords):
  """``MuonConfig(optimizer="adaptive_muon")``: Megatron-Core's name, with
  the ``adaptive_muon_*`` fields."""
  return adaptive_muon(
    learning_rate,
    moment2_method=config.adaptive_muon_moment2_method,
    beta2=config.adaptive_muon_beta2,
    moment2_eps=config.adaptive_muon_eps,
    **keywords,
  )


registry.register(
  "adaptive_muon",
  registry.ConfigMember(
    factory=_from_config, field_prefixes=("adaptive_muon_",)
  ),
)
