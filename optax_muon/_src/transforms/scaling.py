"""Shape scale modes and AdamW-RMS matching."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_muon._src.base import checks as _checks
from optax_muon._src.base import types
from optax_muon._src.kernels import batched
from optax_muon._src.kernels import shape_scale
from optax_muon._src.kernels.shape_scale import SCALE_MODES
from optax_muon._src.parallel import plan
from optax_muon._src.parallel import tensor_parallel as sharding_lib
from optax_muon._src.parallel.execution import Execution
from optax_muon._src.parallel.tensor_parallel import TensorParallel
from optax_muon._src.views.matrix_views import Views


def scale_by_shape(
  mode: types.ScaleMode = "spectral",
  *,
  dimension_numbers: types.PerLeaf = None,
  split_qkv: types.PerLeaf = None,
  sharding: TensorParallel | None = None,
  split_gate_up: types.PerLeaf = None,
  steps: types.Steps = 5,
  precision: types.Precision = "highest",
  preconditioning: types.Preconditioning = "frobenius",
  memory_budget: int | None = None,
) -> optax.GradientTransformation:
  r"""Scales each matrix of the updates by ``scale_factor`` of its shape.

  Stacked leaves are scaled per matrix and split QKV pieces each by their own
  shape (see ``layout.matrix_view``).

  Args:
    mode: ``"spectral"``, ``"shape_scaling"`` or ``"unit_rms_norm"``.
    dimension_numbers: as in ``orthogonalize``.
    split_qkv, split_gate_up: as in ``orthogonalize``.
    sharding: ``None`` or a ``TensorParallel``: each matrix is scaled by
      the shape it was orthogonalized at (its leaf's ``plan.LeafPlan``):
      each shard's under ``blockwise`` (set, or ``auto``'s choice), the
      global shape otherwise.
    steps, precision, preconditioning, memory_budget: the orthogonalize's
      (the chains pass them), for ``sharding.mode="auto"``'s choice.

  Returns:
    A stateless ``optax.GradientTransformation``.
  """
  _checks.check_choice("mode", mode, SCALE_MODES)
  return shape_scaler(
    mode,
    Views(
      dimension_numbers=dimension_numbers,
      split_qkv=split_qkv,
      split_gate_up=split_gate_up,
    ),
    batched.Solver(
      steps=steps, precision=precision, preconditioning=preconditioning
    ),
    Execution(sharding=sharding, memory_budget=memory_budget),
  )


def shape_scaler(
  mode: types.ScaleMode,
  views: Views,
  solver: batched.Solver,
  execution: Execution,
) -> optax.GradientTransformation:
  """``scale_by_shape`` built from the settings objects of the
  orthogonalization it follows (the chains pass theirs): each matrix is
  scaled by the shape its leaf's ``plan.LeafPlan`` solved, planned from the
  same solver and execution, so ``auto`` chooses once for both."""
  _checks.check_choice("mode", mode, SCALE_MODES)

  def init_fn(params):
    views(params)
    return optax.EmptyState()

  def scale_leaf(leaf, view, factors, block_factors, full_step):
    def factor(i, dtype):
      full = jnp.asarray(factors[i], dtype)
      if block_factors is None or block_factors[i] == factors[i]:
        return full
      # MuonBP: the factor of the shape this step orthogonalized
      return jnp.where(full_step, full, jnp.asarray(block_factors[i], dtype))

    if len(set(factors)) == 1 and len(set(block_factors or factors)) == 1:
      return leaf * factor(0, leaf.dtype)
    pieces = view.to_matrices(leaf)
    return view.from_matrices(
      [p * factor(i, p.dtype) for i, p in enumerate(pieces)], like=leaf
    )

  def plans_under(tp, specs, leaves, leaf_views):
    if tp is None:
      return [plan.unsharded(view) for view in leaf_views]
    return plan.plan_leaves(
      tp,
      leaf_views,
      specs,
      [jnp.dtype(x.dtype).itemsize for x in leaves],
      solver.steps,
      solver.precision,
      solver.preconditioning,
      execution.auto_limit,
      execution.wave_bytes,
    )

  def update_fn(updates, state, params=None, *, block_steps=None, **extra):
    del params, extra
    leaf_views = [view for _, _, view in views(updates)]
    leaves = jax.tree.leaves(updates)
    tp = sharding_lib.resolve(execution.sharding, leaves, leaf_views)
    # each matrix scaled by the shape it was orthogonalized at
    specs = None if tp is None else tp.leaf_specs(updates)
    plans = plans_under(tp, specs, leaves, leaf_views)
    block_plans: list = [None] * len(leaves)
    full_step = None
    # MuonBP's block steps, bound as the orthogonalization binds them
    block = (
      None
      if block_steps is None or tp is None
      else block_steps.bind(leaves, leaf_views, updates)
    )
    if block is not None:
      block_plans = plans_under(block.tp, block.specs, leaves, leaf_views)
      full_step = block.full_step
    scaled = [
      scale_leaf(
        leaf,
        view,
        leaf_plan.scales(mode),
        None if block_plan is None else block_plan.scales(mode),
        full_step,
      )
      for leaf, view, leaf_plan, block_plan in zip(
        leaves, leaf_views, plans, block_plans
      )
    ]
    return jax.tree.unflatten(jax.tree.structure(updates), scaled), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


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
    factor = shape_scale.adamw_rms_match_factor(adamw_beta1)
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
