"""The ready-made chains: ``scale_by_muon`` and ``muon``."""

from typing import Any

import optax

from optax_muon._src.base import built
from optax_muon._src.base import checks as _checks
from optax_muon._src.base import types
from optax_muon._src.optimizers import registry
from optax_muon._src.optimizers import settings
from optax_muon._src.optimizers.route import route
from optax_muon._src.parallel.tensor_parallel import TensorParallel
from optax_muon._src.transforms import muon_direction
from optax_muon._src.views.layout import from_layout


@built.recorded
def scale_by_muon(
  *,
  beta: types.Numeric = 0.95,
  nesterov: bool = True,
  momentum_style: types.MomentumStyle = "ema",
  mu_dtype: types.MomentumDtype = None,
  coefficients: types.Coefficients = "quintic",
  steps: types.Steps = 5,
  precision: types.Precision = "highest",
  method: types.Method = "standard",
  scale_mode: types.ScaleMode = "spectral",
  extra_scale_factor: types.Numeric | None = None,
  match_adamw_update_rms: bool = False,
  adamw_beta1: types.Numeric = 0.9,
  dimension_numbers: types.PerLeaf = None,
  split_qkv: types.PerLeaf = None,
  sharding: TensorParallel | None = None,
  preconditioning: types.Preconditioning = "frobenius",
  layout: Any = None,
  split_gate_up: types.PerLeaf = None,
  memory_budget: int | None = None,
  state_memory_kind: types.MemoryKind | None = None,
) -> optax.GradientTransformation:
  r"""Muon's direction: momentum, orthogonalized, scaled by shape.

  For each matrix ``G`` (``fan_in × fan_out``) of each leaf::

    u = momentum(g)                         # see momentum()
    O = newton_schulz(u) ≈ U Vᵀ             # see orthogonalize()
    update = scale_factor(fan_out, fan_in, scale_mode) · extra · O

  with ``extra = extra_scale_factor`` (default 1.0) or, when
  ``match_adamw_update_rms``, ``√((1 − β₁)/(1 + β₁))`` from ``adamw_beta1``.
  This is ``optax.chain(momentum, orthogonalize, scale_by_shape,
  optax.scale(extra))`` (its state too); with an 8-bit momentum or
  ``state_memory_kind``, each leaf's momentum is computed inside the wave
  that orthogonalizes it (``transforms.muon_direction``), so its float32
  work and its transfers keep to the memory budget. Add weight decay and the
  learning rate (``muon``).

  Args:
    beta: momentum coefficient in ``[0, 1)``.
    nesterov: Nesterov momentum.
    momentum_style: ``"ema"`` or ``"sgd"``.
    mu_dtype: momentum dtype (``None``: the param's).
    coefficients: Newton–Schulz schedule name or list of ``(a, b, c)``.
    steps: Newton–Schulz steps.
    precision: ``"highest"``, ``"high"``, ``"medium"``, ``"fp16"`` or ``"bf16"``.
    method: ``"standard"`` or ``"gram"`` (see ``orthogonalize``).
    scale_mode: ``"spectral"``, ``"shape_scaling"`` or ``"unit_rms_norm"``.
    extra_scale_factor: factor after the shape scale, > 0; default 1.0.
    match_adamw_update_rms: derive the factor from ``adamw_beta1`` instead.
    adamw_beta1: AdamW's β₁ for ``match_adamw_update_rms``.
    dimension_numbers: ``MuonDimensionNumbers``, a tree of them or a function
      of the params; ``"leading"``: leading axes batch, last two ``(in, out)``.
      Without them a leaf of 3+ axes raises at ``init`` (2-axis leaves are
      ``(in, out)``).
    split_qkv: ``SplitQKV``, a tree of them or a callable.
    sharding: ``None`` or a ``TensorParallel``.
    preconditioning: ``"frobenius"``, ``"spectral"``, ``"aol"`` or
      ``"schatten"`` (see ``orthogonalize``).
    split_gate_up: ``SplitGateUp`` (fused gated-MLP kernels: gate and up
      orthogonalized and scaled apart), a tree of them or a callable.
    layout: an ``om.Layout`` (``om.infer_layout``): its dimension numbers,
      looked up by path (it may cover more leaves than this transform sees);
      not together with ``dimension_numbers``.
    memory_budget: bytes per device of orthogonalization work in flight
      (``None``: the default, 2 GiB; see ``orthogonalize``).
    state_memory_kind: ``"pinned_host"``: the momentum in host memory
      between steps, brought to the device a wave at a time.

  Returns:
    An ``optax.GradientTransformation``.

  References:
    Jordan et al., `Muon <https://kellerjordan.github.io/posts/muon/>`_, 2024

    Liu et al., `Muon is Scalable for LLM Training
    <https://arxiv.org/abs/2502.16982>`_, 2025
  """
  return _scale_by_muon(
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
      state_memory_kind=state_memory_kind,
    ),
    scale_mode,
    settings.extra_scale(
      scale_mode, extra_scale_factor, match_adamw_update_rms, adamw_beta1
    ),
  )


def _scale_by_muon(
  momentum: settings.Momentum,
  orthogonalization: settings.Orthogonalization,
  scale_mode: types.ScaleMode,
  extra: Any,
) -> optax.GradientTransformation:
  """``scale_by_muon`` of its settings objects, built (and checked) once by
  ``scale_by_muon`` or ``muon``: the pieces share them, so the plan they
  read (``parallel.plan``) is decided once per leaf."""
  execution = orthogonalization.execution
  streams = execution.streams(momentum.mu_dtype)
  if streams:  # momentum in its wave
    direction = muon_direction.momentum_orthogonalize(
      momentum.beta,
      nesterov=momentum.nesterov,
      style=momentum.momentum_style,
      dtype=momentum.mu_dtype,
      solver=orthogonalization.solver,
      views=orthogonalization.views,
      execution=execution,
    )
  else:
    accumulate = momentum.transform(execution)
    orthogonalize = orthogonalization.orthogonalizer()
  shape = orthogonalization.scale_by_shape(scale_mode)
  scale = optax.scale(extra)

  # optax.chain(momentum, orthogonalize, shape, scale)'s state, flat:
  # (MomentumState, EmptyState, EmptyState, EmptyState); the pieces are
  # called in turn rather than through nested chains, one frame each
  def init_fn(params):
    if streams:
      first = direction.init(params)
    else:
      first = (accumulate.init(params), orthogonalize.transform.init(params))
    return (*first, shape.init(params), scale.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    # MuonBP's block_steps reach the orthogonalization and the shape scale
    if streams:
      updates, first = direction.update(
        updates, state[:2], params, **extra_args
      )
    else:
      updates, mu = accumulate.update(updates, state[0], params)
      block_steps = extra_args.get("block_steps")
      updates, _ = orthogonalize.run(updates, block_steps=block_steps)
      first = (mu, state[1])
    updates, shaped = shape.update(updates, state[2], params, **extra_args)
    updates, scaled = scale.update(updates, state[3], params)
    return updates, (*first, shaped, scaled)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@built.recorded
def muon(
  learning_rate: optax.ScalarOrSchedule,
  *,
  beta: types.Numeric = 0.95,
  nesterov: bool = True,
  momentum_style: types.MomentumStyle = "ema",
  mu_dtype: types.MomentumDtype = None,
  coefficients: types.Coefficients = "quintic",
  steps: types.Steps = 5,
  precision: types.Precision = "highest",
  method: types.Method = "standard",
  scale_mode: types.ScaleMode = "spectral",
  extra_scale_factor: types.Numeric | None = None,
  match_adamw_update_rms: bool = False,
  dimension_numbers: types.PerLeaf = None,
  split_qkv: types.PerLeaf = None,
  sharding: TensorParallel | None = None,
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
  preconditioning: types.Preconditioning = "frobenius",
  layout: Any = None,
  split_gate_up: types.PerLeaf = None,
  memory_budget: int | None = None,
  state_memory_kind: types.MemoryKind | None = None,
) -> optax.GradientTransformation:
  r"""Muon for the matrices, AdamW (or Lion) for everything else.

  Muon leaves: ``p ← p − lr · (scale_by_muon(g) + weight_decay · p)``
  (decoupled decay, multiplied by the learning rate as in Megatron-Core).
  The other leaves get ``optax.adamw`` (or ``optax.lion``) with their own
  learning rate, betas, eps, weight decay and mask; ``"none"`` leaves (not
  floating point, or frozen) get a zero update (``optax.set_to_zero``) and no
  state. Every update leaf has its parameter's dtype. Routing is ``layout``
  (``om.infer_layout``'s labels and dimension numbers: the one path for
  models of 3+-axis kernels) or ``labels``: ``None`` uses
  ``default_labels``; a tree (by path, a prefix allowed) or function of
  ``"muon"`` / ``"adam"`` / ``"none"`` overrides it.

  ``beta``, ``nesterov``, ``momentum_style``, ``mu_dtype``,
  ``coefficients``, ``steps``, ``precision``, ``method``, ``scale_mode``,
  ``extra_scale_factor``, ``dimension_numbers``, ``split_qkv``,
  ``split_gate_up``, ``sharding``, ``preconditioning`` and
  ``memory_budget`` are ``scale_by_muon``'s.

  Args:
    learning_rate: Muon's learning rate, a float or an optax schedule.
    match_adamw_update_rms: scale Muon updates to AdamW's RMS using
      ``adam_b1``, so that ``learning_rate`` can be AdamW's.
    weight_decay: decoupled weight decay of the Muon leaves.
    weight_decay_mask: tree (by path) or callable of bools for it.
    labels: ``None``, a tree or a callable of ``"muon"`` / ``"adam"`` /
      ``"none"``.
    scalar_optimizer: ``"adam"`` (AdamW) or ``"lion"`` for the other leaves.
    adam_learning_rate: their learning rate (default: ``learning_rate``).
    adam_b1, adam_b2, adam_eps: their betas and eps.
    adam_weight_decay: their decoupled weight decay.
    adam_weight_decay_mask: tree (by path) or callable of bools for it;
      default: leaves of 2+ axes (not norm scales, biases, other vectors).
    layout: an ``om.Layout`` from ``om.infer_layout``: labels and dimension
      numbers, looked up by path (a whole model's layout serves an optimizer
      of a subset, e.g. ``wrt=nnx.LoRAParam``); not with ``labels`` or
      ``dimension_numbers``.
    state_memory_kind: ``None`` (device memory) or ``"pinned_host"``: the
      whole state (Muon's momentum, AdamW's moments) in host memory between
      steps, brought to the device inside each update
      (``offload_state`` of ``optax_muon._src.parallel.offload``; the
      numbers are unchanged).

  Returns:
    An ``optax.GradientTransformation`` (``optax.partition`` of the two).

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_muon as om
    >>> params = {"hidden": jnp.ones((16, 32)), "bias": jnp.zeros(32)}
    >>> grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(0), p.shape), params)
    >>> tx = om.muon(0.02, weight_decay=0.1)
    >>> updates, state = tx.update(grads, tx.init(params), params)
    >>> params = optax.apply_updates(params, updates)
    >>> sigma = jnp.linalg.svd(updates["hidden"], compute_uv=False)
    >>> bool(jnp.all(jnp.abs(sigma / sigma.max() - 1) < 0.35))  # orthogonalized
    True

  References:
    Jordan et al., `Muon <https://kellerjordan.github.io/posts/muon/>`_, 2024
  """
  # AdamW's beta1, checked under this function's name (it also sets the
  # RMS-matching factor, where scale_by_muon calls it adamw_beta1)
  _checks.check_range("adam_b1", adam_b1, 0.0, 1.0)
  labels, dimension_numbers = from_layout(layout, labels, dimension_numbers)
  direction = _scale_by_muon(
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
      state_memory_kind=state_memory_kind,
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
    direction_streams=True,
  )


def _from_config(config, learning_rate, **keywords):
  """``MuonConfig(optimizer="muon")``: ``muon`` with the config's keywords."""
  del config
  return muon(learning_rate, **keywords)


registry.register("muon", registry.ConfigMember(factory=_from_config))
