"""PolarGrad: the polar factor scaled by the momentum's nuclear norm, as
NVIDIA emerging-optimizers' ``PolarGrad`` computes it.

For each matrix of a Muon leaf::

  u = momentum(g);  O = newton_schulz(u) ≈ U Vᵀ
  update = ⟨O, u⟩ · extra · O            # ⟨O, u⟩ ≈ ‖u‖_* (nuclear norm)

that is steepest descent under the spectral norm, where Muon (no scale) is
its linear-minimization form. No shape scale.
"""

from typing import Any
from typing import NamedTuple
from typing import Unpack

import jax
import jax.numpy as jnp
import optax

from optax_muon._src.base import checks as _checks
from optax_muon._src.base import types
from optax_muon._src.optimizers import settings
from optax_muon._src.optimizers.route import route
from optax_muon._src.parallel.tensor_parallel import TensorParallel
from optax_muon._src.views.layout import from_layout


class PolarGradState(NamedTuple):
  momentum: Any


def scale_by_polargrad(
  *,
  beta: types.Numeric = 0.95,
  nesterov: bool = False,
  momentum_style: types.MomentumStyle = "ema",
  mu_dtype: types.MomentumDtype = None,
  coefficients: types.Coefficients = "quintic",
  steps: types.Steps = 5,
  precision: types.Precision = "highest",
  extra_scale_factor: types.Numeric | None = 1.0,
  dimension_numbers: types.PerLeaf = None,
  layout: Any = None,
  memory_budget: int | None = None,
  method: types.Method = "standard",
  preconditioning: types.Preconditioning = "frobenius",
  split_qkv: types.PerLeaf = None,
  split_gate_up: types.PerLeaf = None,
  sharding: TensorParallel | None = None,
) -> optax.GradientTransformation:
  r"""PolarGrad's direction: ``⟨O, u⟩ · extra · O`` per matrix (see the
  module docstring).

  ``beta``, ``nesterov``, ``momentum_style``, ``mu_dtype``,
  ``coefficients``, ``steps``, ``precision``, ``method``,
  ``preconditioning``, ``dimension_numbers``, ``split_qkv``,
  ``split_gate_up``, ``sharding``, ``layout`` and ``memory_budget`` are as
  in ``scale_by_muon`` (``nesterov`` defaults to EO's ``False``).
  ``scale_mode`` and ``match_adamw_update_rms`` do not apply: the length of
  each matrix's update is ``⟨O, u⟩``, not a function of its shape.

  Args:
    extra_scale_factor: a factor on the update, > 0.

  Returns:
    An ``optax.GradientTransformation``.

  References:
    Lau et al., `PolarGrad <https://arxiv.org/abs/2505.21799>`_, 2025
  """
  return _scale_by_polargrad(
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
    extra_scale_factor,
  )


def _scale_by_polargrad(
  momentum_settings: settings.Momentum,
  orthogonalization: settings.Orthogonalization,
  extra_scale_factor: types.Numeric | None,
) -> optax.GradientTransformation:
  """``scale_by_polargrad`` of its settings objects (built and checked once
  by it or ``polargrad``)."""
  _checks.check_positive("extra_scale_factor", extra_scale_factor)
  momentum = momentum_settings.transform(orthogonalization.execution)
  orthogonalize = orthogonalization.orthogonalize()
  views = orthogonalization.views

  def init_fn(params):
    orthogonalize.init(params)
    return PolarGradState(momentum.init(params))

  def update_fn(updates, state, params=None):
    del params
    directions, momentum_state = momentum.update(updates, state.momentum)
    orthogonal, _ = orthogonalize.update(directions, optax.EmptyState())
    treedef = jax.tree.structure(updates)
    scaled = []
    for (_, o, view), u in zip(
      views(orthogonal), treedef.flatten_up_to(directions)
    ):
      pieces = []  # a split leaf's matrices (Q, K, V; gate, up) one by one
      for o_matrices, u_matrices in zip(
        view.to_matrices(o), view.to_matrices(u)
      ):
        scale = jnp.sum(
          o_matrices.astype(jnp.float32) * u_matrices.astype(jnp.float32),
          axis=(-2, -1),
          keepdims=True,
        )
        pieces.append((o_matrices * scale * extra_scale_factor).astype(o.dtype))
      scaled.append(view.from_matrices(pieces, like=o))
    return (jax.tree.unflatten(treedef, scaled), PolarGradState(momentum_state))

  return optax.GradientTransformation(init_fn, update_fn)


def polargrad(
  learning_rate: optax.ScalarOrSchedule,
  *,
  beta: types.Numeric = 0.95,
  nesterov: bool = False,
  momentum_style: types.MomentumStyle = "ema",
  mu_dtype: types.MomentumDtype = None,
  coefficients: types.Coefficients = "quintic",
  steps: types.Steps = 5,
  precision: types.Precision = "highest",
  extra_scale_factor: types.Numeric | None = 1.0,
  dimension_numbers: types.PerLeaf = None,
  layout: Any = None,
  weight_decay: types.Numeric = 0.0,
  weight_decay_mask: types.PerLeaf = None,
  labels: types.PerLeaf = None,
  memory_budget: int | None = None,
  state_memory_kind: types.MemoryKind | None = None,
  method: types.Method = "standard",
  preconditioning: types.Preconditioning = "frobenius",
  split_qkv: types.PerLeaf = None,
  split_gate_up: types.PerLeaf = None,
  sharding: TensorParallel | None = None,
  **scalar_kwargs: Unpack[settings.ScalarOptimizerOptions],
) -> optax.GradientTransformation:
  r"""PolarGrad for the matrices, AdamW for the rest: ``om.muon``'s routing
  with ``scale_by_polargrad`` as the direction;
  ``p ← p − lr · (scale_by_polargrad(g) + weight_decay · p)``.

  Unlike Muon's, the step grows with the gradients (``⟨O, u⟩`` is about the
  momentum's nuclear norm), so Muon's learning rate is not a safe start:
  tune ``learning_rate`` for the model and the loss's scale.

  The other arguments are ``scale_by_polargrad``'s and ``om.muon``'s
  (``scale_mode`` and ``match_adamw_update_rms`` do not apply; see
  ``scale_by_polargrad``).

  Args:
    learning_rate: a float or an optax schedule.
    **scalar_kwargs: ``om.muon``'s ``scalar_optimizer`` and ``adam_*``
      arguments, for the leaves that are not matrices.

  Returns:
    An ``optax.GradientTransformation``.

  Example:
    >>> import jax, jax.numpy as jnp, optax_muon as om
    >>> params = {"hidden": jnp.ones((16, 32))}
    >>> tx = om.polargrad(0.02)
    >>> updates, _ = tx.update(params, tx.init(params), params)
    >>> updates["hidden"].dtype == params["hidden"].dtype
    True
  """
  labels, dimension_numbers = from_layout(layout, labels, dimension_numbers)
  direction = _scale_by_polargrad(
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
    extra_scale_factor,
  )
  return route(
    direction,
    learning_rate,
    weight_decay=weight_decay,
    weight_decay_mask=weight_decay_mask,
    labels=labels,
    state_memory_kind=state_memory_kind,
    **settings.scalar_options(scalar_kwargs),
  )
