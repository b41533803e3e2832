"""The ready-made chains: ``scale_by_muon`` and ``muon``."""

import logging

import jax
import numpy as np
import optax

from optax_muon import _checks
from optax_muon import _paths
from optax_muon import labels as labels_lib
from optax_muon import momentum as momentum_lib
from optax_muon import offload
from optax_muon import orthogonalize as orthogonalize_lib
from optax_muon import scaling

SCALAR_OPTIMIZERS = ("adam", "lion")
_logger = logging.getLogger("optax_muon")
_logged_factors: set[float] = set()


def resolve_extra_scale_factor(
  extra_scale_factor, match_adamw_update_rms: bool, adamw_beta1
):
  """The factor applied after the shape scale (see ``scale_by_muon``).

  Raises:
    ValueError: both ``match_adamw_update_rms`` and ``extra_scale_factor`` set.
  """
  if not isinstance(match_adamw_update_rms, bool):
    raise TypeError(
      f"match_adamw_update_rms must be a bool, got {match_adamw_update_rms!r}"
    )
  if match_adamw_update_rms:
    if extra_scale_factor is not None:
      raise ValueError(
        "match_adamw_update_rms=True derives extra_scale_factor from AdamW's "
        f"beta1, but extra_scale_factor={extra_scale_factor!r} was also set; "
        "set exactly one of them"
      )
    factor = scaling.adamw_rms_match_factor(adamw_beta1)
    if (
      not _checks.is_traced(factor)
      and factor not in _logged_factors
      and (jax.process_index() == 0)
    ):
      _logged_factors.add(float(factor))
      _logger.info(
        "match_adamw_update_rms: extra_scale_factor resolved to "
        "%.6f from adamw beta1=%s",
        factor,
        float(np.asarray(adamw_beta1)),
      )
    return factor
  if extra_scale_factor is None:
    return 1.0
  _checks.check_positive("extra_scale_factor", extra_scale_factor)
  return extra_scale_factor


def scale_by_muon(
  *,
  beta=0.95,
  nesterov: bool = True,
  momentum_style: str = "ema",
  mu_dtype=None,
  coefficients="quintic",
  steps=5,
  precision: str = "highest",
  method: str = "standard",
  scale_mode: str = "spectral",
  extra_scale_factor=None,
  match_adamw_update_rms: bool = False,
  adamw_beta1=0.9,
  dimension_numbers=None,
  split_qkv=None,
  sharding=None,
  preconditioning: str = "frobenius",
  layout=None,
  split_gate_up=None,
  memory_budget: int | None = None,
) -> optax.GradientTransformation:
  r"""Muon's direction: momentum, orthogonalized, scaled by shape.

  For each matrix ``G`` (``fan_in × fan_out``) of each leaf::

    u = momentum(g)                         # see momentum()
    O = newton_schulz(u) ≈ U Vᵀ             # see orthogonalize()
    update = scale_factor(fan_out, fan_in, scale_mode) · extra · O

  with ``extra = extra_scale_factor`` (default 1.0) or, when
  ``match_adamw_update_rms``, ``√((1 − β₁)/(1 + β₁))`` from ``adamw_beta1``.
  This is ``optax.chain(momentum, orthogonalize, scale_by_shape,
  optax.scale(extra))``; add weight decay and the learning rate (``muon``).

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

  Returns:
    An ``optax.GradientTransformation``.

  References:
    Jordan et al., `Muon <https://kellerjordan.github.io/posts/muon/>`_, 2024

    Liu et al., `Muon is Scalable for LLM Training
    <https://arxiv.org/abs/2502.16982>`_, 2025
  """
  # Checked here under this function's names (momentum's ``style`` is our
  # ``momentum_style``), so that an error names the argument the user passed.
  _checks.check_choice(
    "momentum_style", momentum_style, momentum_lib.MOMENTUM_STYLES
  )
  _checks.check_choice("scale_mode", scale_mode, scaling.SCALE_MODES)
  momentum_lib.canonical_dtype("mu_dtype", mu_dtype, quantized=True)
  _, dimension_numbers = from_layout(layout, None, dimension_numbers)
  extra = resolve_extra_scale_factor(
    extra_scale_factor, match_adamw_update_rms, adamw_beta1
  )
  layout_args = dict(
    dimension_numbers=dimension_numbers,
    split_qkv=split_qkv,
    split_gate_up=split_gate_up,
    sharding=sharding,
  )
  return optax.chain(
    momentum_lib.momentum(
      beta,
      nesterov=nesterov,
      style=momentum_style,
      dtype=mu_dtype,
      memory_budget=memory_budget,
    ),
    orthogonalize_lib.orthogonalize(
      coefficients=coefficients,
      steps=steps,
      precision=precision,
      method=method,
      preconditioning=preconditioning,
      memory_budget=memory_budget,
      **layout_args,
    ),
    scaling.scale_by_shape(scale_mode, **layout_args),
    optax.scale(extra),
  )


def from_layout(layout, labels, dimension_numbers):
  """``(labels, dimension_numbers)`` from ``layout=``, or as given.

  Raises:
    ValueError: ``layout`` together with ``labels`` or ``dimension_numbers``.
    TypeError: a ``layout`` that is not an ``om.Layout``.
  """
  if layout is None:
    return labels, dimension_numbers
  given = [
    name
    for name, value in (
      ("labels", labels),
      ("dimension_numbers", dimension_numbers),
    )
    if value is not None
  ]
  if given:
    raise ValueError(
      f"layout= gives the labels and dimension numbers, but {given[0]}= was "
      "also set; pass layout= alone, or labels=/dimension_numbers= without "
      "layout="
    )
  if not (hasattr(layout, "labels") and hasattr(layout, "dimension_numbers")):
    raise TypeError(
      f"layout must be an om.Layout (from om.infer_layout), got "
      f"{type(layout).__name__}"
    )
  shapes = getattr(layout, "shapes", None)
  return (
    _paths.FromLayout(layout.labels, shapes),
    _paths.FromLayout(layout.dimension_numbers, shapes),
  )


def matrices_only(params):
  """The default weight-decay mask of the AdamW group: leaves of 2+ axes
  (embeddings, heads) decay; norm scales, biases and other vectors do not."""
  return jax.tree.map(lambda x: jax.numpy.ndim(x) >= 2, params)


def in_params_dtype(
  inner: optax.GradientTransformation,
) -> optax.GradientTransformation:
  """``inner`` with each update leaf cast to its parameter's dtype (Muon's
  float32 momentum would otherwise give float32 updates to bfloat16
  params); the state is ``inner``'s own, so checkpoints are unchanged."""

  def update_fn(updates, state, params=None):
    updates, state = inner.update(updates, state, params)
    if params is not None:
      updates = jax.tree.map(
        lambda u, p: u.astype(jax.numpy.result_type(p)), updates, params
      )
    return updates, state

  return optax.GradientTransformation(inner.init, update_fn)


def _mask_by_path(name, mask):
  """A weight-decay mask tree made readable on the partitioned (masked) tree."""
  if mask is None or callable(mask):
    return mask
  lookup = _paths.PathLookup(name, mask, (bool, np.bool_), default=False)

  def resolved(params):
    of = lookup.resolve(params)
    leaves, treedef = _paths.leaves_with_paths(params)
    return jax.tree.unflatten(treedef, [bool(of(path)) for path, _ in leaves])

  return resolved


def _check_learning_rate(name, value, optional=False):
  if value is None and not optional:
    raise ValueError(
      f"{name}=None is not accepted; accepted: a float >= 0 or "
      "an optax schedule"
    )
  if value is not None and not callable(value):
    _checks.check_range(name, value, 0.0, np.inf)


def muon(
  learning_rate,
  *,
  beta=0.95,
  nesterov: bool = True,
  momentum_style: str = "ema",
  mu_dtype=None,
  coefficients="quintic",
  steps=5,
  precision: str = "highest",
  method: str = "standard",
  scale_mode: str = "spectral",
  extra_scale_factor=None,
  match_adamw_update_rms: bool = False,
  dimension_numbers=None,
  split_qkv=None,
  sharding=None,
  weight_decay=0.0,
  weight_decay_mask=None,
  labels=None,
  scalar_optimizer: str = "adam",
  adam_learning_rate=None,
  adam_b1=0.9,
  adam_b2=0.999,
  adam_eps=1e-8,
  adam_weight_decay=0.0,
  adam_weight_decay_mask=None,
  preconditioning: str = "frobenius",
  layout=None,
  split_gate_up=None,
  memory_budget: int | None = None,
  state_memory_kind: str | None = None,
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
      steps, brought to the device inside each update (``om.offload``'s
      ``offload_state``; the numbers are unchanged).

  Returns:
    An ``optax.GradientTransformation`` (``optax.partition`` of the two).

  References:
    Jordan et al., `Muon <https://kellerjordan.github.io/posts/muon/>`_, 2024
  """
  # AdamW's beta1, checked under this function's name (it also sets the
  # RMS-matching factor, where scale_by_muon calls it adamw_beta1)
  _checks.check_range("adam_b1", adam_b1, 0.0, 1.0)
  labels, dimension_numbers = from_layout(layout, labels, dimension_numbers)
  direction = scale_by_muon(
    beta=beta,
    nesterov=nesterov,
    momentum_style=momentum_style,
    mu_dtype=mu_dtype,
    coefficients=coefficients,
    steps=steps,
    precision=precision,
    method=method,
    scale_mode=scale_mode,
    extra_scale_factor=extra_scale_factor,
    match_adamw_update_rms=match_adamw_update_rms,
    adamw_beta1=adam_b1,
    dimension_numbers=dimension_numbers,
    split_qkv=split_qkv,
    split_gate_up=split_gate_up,
    sharding=sharding,
    preconditioning=preconditioning,
    memory_budget=memory_budget,
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


def route(
  direction: optax.GradientTransformation,
  learning_rate,
  *,
  weight_decay=0.0,
  weight_decay_mask=None,
  labels=None,
  scalar_optimizer: str = "adam",
  adam_learning_rate=None,
  adam_b1=0.9,
  adam_b2=0.999,
  adam_eps=1e-8,
  adam_weight_decay=0.0,
  adam_weight_decay_mask=None,
  muon_step=None,
  state_memory_kind: str | None = None,
) -> optax.GradientTransformation:
  """A Muon-family ``direction`` for the ``"muon"`` leaves, with decoupled
  weight decay and the learning rate (or ``muon_step``, a transform that
  turns the direction into the step itself), beside AdamW (or Lion) for the
  ``"adam"`` leaves and nothing for the ``"none"`` ones, the whole state in
  ``state_memory_kind`` between steps (see ``muon``)."""
  offload.check_memory_kind(state_memory_kind)
  _check_learning_rate("learning_rate", learning_rate)
  _check_learning_rate("adam_learning_rate", adam_learning_rate, optional=True)
  _checks.check_choice("scalar_optimizer", scalar_optimizer, SCALAR_OPTIMIZERS)
  _checks.check_range("weight_decay", weight_decay, 0.0, np.inf)
  _checks.check_range("adam_weight_decay", adam_weight_decay, 0.0, np.inf)
  _checks.check_range("adam_b1", adam_b1, 0.0, 1.0)
  _checks.check_range("adam_b2", adam_b2, 0.0, 1.0)
  _checks.check_range("adam_eps", adam_eps, 0.0, np.inf)
  muon_chain = (
    optax.chain(direction, muon_step)
    if muon_step
    else (
      optax.chain(
        direction,
        optax.add_decayed_weights(
          weight_decay, _mask_by_path("weight_decay_mask", weight_decay_mask)
        ),
        optax.scale_by_learning_rate(learning_rate),
      )
    )
  )
  scalar_lr = (
    learning_rate if adam_learning_rate is None else adam_learning_rate
  )
  scalar_mask = (
    matrices_only
    if adam_weight_decay_mask is None
    else _mask_by_path("adam_weight_decay_mask", adam_weight_decay_mask)
  )
  if scalar_optimizer == "adam":
    scalar_chain = optax.adamw(
      scalar_lr,
      b1=adam_b1,
      b2=adam_b2,
      eps=adam_eps,
      weight_decay=adam_weight_decay,
      mask=scalar_mask,
    )
  else:
    scalar_chain = optax.lion(
      scalar_lr,
      b1=adam_b1,
      b2=adam_b2,
      weight_decay=adam_weight_decay,
      mask=scalar_mask,
    )
  routed = optax.partition(
    {
      labels_lib.MUON: in_params_dtype(muon_chain),
      labels_lib.ADAM: scalar_chain,
      labels_lib.NONE: optax.set_to_zero(),
    },
    labels_lib.label_fn(labels),
  )
  if state_memory_kind is None:
    return routed
  return offload.offload_state(routed, state_memory_kind)
