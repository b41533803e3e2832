"""Dion2 and NorDion2: orthogonalize only a selected fraction of each matrix.

For each matrix ``M`` (``fan_in × fan_out``) of a Muon leaf, as
microsoft/dion's ``Dion2`` computes it::

  M ← M + g                                  # accumulate, no decay
  idx = top-k slices of M by L1 norm         # along the shorter axis
  U = M[idx];  M[idx] ← ef_decay · M[idx]    # error feedback
  O = zeros;  O[idx] = newton_schulz(U)
  update = scale_factor(fan_out, fan_in) · extra · O

with ``k = max(1, ⌈fraction · n⌉)`` of the ``n`` slices. Only the selected
rows (or columns) are orthogonalized and updated; the others keep
accumulating until they are large enough to be selected. ``fraction=1``
with ``ef_decay=β`` is Muon with plain (``"sgd"``-style, non-Nesterov)
momentum. NorDion2 selects output neurons (``fan_out`` slices) always,
with ``ef_decay`` its momentum ``β``, and normalizes each selected neuron
by a running second moment (NorMuon's), keeping ``‖O[idx]‖_F``.

Without a ``sharding`` (and with ``selection_scope="global"``) the
selection is the whole matrix's (microsoft/dion's ``"global"`` scope,
``dion2_selection``): the result does not depend on how the matrix is
sharded. With an ``om.TensorParallel`` and ``"local"`` (dion's default)
each shard of a split matrix selects its own slices (``dion2_local``).
"""

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
from optax_muon._src.kernels import dion2_selection as selection
from optax_muon._src.optimizers import dion2_step
from optax_muon._src.optimizers import registry
from optax_muon._src.optimizers import settings
from optax_muon._src.optimizers.route import route
from optax_muon._src.parallel import tensor_parallel as sharding_lib
from optax_muon._src.parallel.tensor_parallel import EXACT_MODES
from optax_muon._src.parallel.tensor_parallel import TensorParallel
from optax_muon._src.transforms.momentum import canonical_dtype
from optax_muon._src.views.layout import from_layout

SELECTION_SCOPES = ("local", "global")


class Dion2State(NamedTuple):
  """Per leaf, the momentum (the leaf's shape); for NorDion2 also, per
  matrix piece, the output neurons' second moment ``(matrices, 1, fan_out)``
  in float32 (``None`` for Dion2)."""

  momentum: Any
  variance: Any


def _check_selection(fraction, ef_decay, sharding, selection_scope) -> None:
  """Raises ``ValueError`` naming the first selection setting not accepted."""
  _checks.check_fraction("fraction", fraction)
  _checks.check_range("ef_decay", ef_decay, 0.0, 1.0 + 1e-12)
  _checks.check_choice("selection_scope", selection_scope, SELECTION_SCOPES)
  sharding_lib.check_sharding(sharding)
  sharding_lib.check_bound("Dion2", sharding)
  if sharding is not None and (
    sharding.mode not in (*EXACT_MODES, "auto")
    or (sharding.mode == "auto" and "blockwise" in sharding.auto_modes)
  ):
    raise ValueError(
      f"sharding.mode={sharding.mode!r} (auto_modes={sharding.auto_modes}) "
      f"is not accepted for Dion2; accepted values: "
      f"{[*EXACT_MODES, 'auto']}, auto among exact modes only (the "
      "selection is orthogonalized whole)"
    )


@built.recorded
def scale_by_dion2(
  *,
  fraction: types.Numeric = 0.25,
  ef_decay: types.Numeric = 0.95,
  normalize_neurons: bool = False,
  beta2: types.Numeric = 0.95,
  mu_dtype: types.MomentumDtype = None,
  coefficients: types.Coefficients = "polar_express_dion",
  steps: types.Steps = 5,
  precision: types.Precision = "highest",
  method: types.Method = "standard",
  scale_mode: types.ScaleMode = "unit_rms_norm",
  extra_scale_factor: types.Numeric | None = None,
  match_adamw_update_rms: bool = False,
  adamw_beta1: types.Numeric = 0.9,
  dimension_numbers: types.PerLeaf = None,
  split_qkv: types.PerLeaf = None,
  split_gate_up: types.PerLeaf = None,
  preconditioning: types.Preconditioning = "frobenius",
  layout: Any = None,
  memory_budget: int | None = None,
  sharding: TensorParallel | None = None,
  selection_scope: str = "local",
) -> optax.GradientTransformation:
  r"""Dion2's direction (NorDion2's with ``normalize_neurons``): see the
  module docstring for the update.

  ``mu_dtype``, ``coefficients``, ``steps``, ``precision``, ``method``,
  ``preconditioning``, ``memory_budget``, ``extra_scale_factor``,
  ``match_adamw_update_rms``, ``dimension_numbers``, ``split_qkv``,
  ``split_gate_up`` and ``layout`` are ``scale_by_muon``'s; the defaults of
  ``coefficients`` (Polar Express as microsoft/dion ships it) and
  ``scale_mode`` (``"unit_rms_norm"``: its ``adjust_lr="spectral_norm"``,
  ``√(fan_out/fan_in)`` of the whole matrix) are microsoft/dion's.
  ``beta``, ``nesterov`` and ``momentum_style`` do not apply: the momentum
  is a plain sum whose selected slices decay by ``ef_decay``.

  Args:
    fraction: the share of slices orthogonalized per step, in ``(0, 1]``.
    ef_decay: the error-feedback decay of the selected slices, in
      ``[0, 1]``.
    normalize_neurons: NorDion2: select output neurons and normalize them
      by a running second moment.
    beta2: that second moment's decay, in ``[0, 1)``.
    sharding: ``None`` (XLA partitions the whole-matrix selection under
      ``jax.jit``), or an ``optax_muon.TensorParallel``: its mesh, axis,
      specs and exact mode run the orthogonalization of the selection.
    selection_scope: with ``sharding``, ``"local"`` (microsoft/dion's
      default: each shard of a matrix split over ``sharding.axis`` selects
      its own top slices along the split axis, and only they travel; see
      ``dion2_local``) or ``"global"`` (the whole matrix's top slices: the
      result does not depend on the sharding; each matrix is gathered).
      Without ``sharding`` the two are the same.

  Returns:
    An ``optax.GradientTransformation`` whose state is a ``Dion2State``.

  References:
    Ahn et al., `Dion2 <https://arxiv.org/abs/2512.16928>`_, 2025;
    microsoft/dion ``dion/dion2.py``, ``dion/nordion2.py``
  """
  return _scale_by_dion2(
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
    mu_dtype,
    scale_mode,
    settings.extra_scale(
      scale_mode, extra_scale_factor, match_adamw_update_rms, adamw_beta1
    ),
    fraction=fraction,
    ef_decay=ef_decay,
    normalize_neurons=normalize_neurons,
    beta2=beta2,
    selection_scope=selection_scope,
  )


def _scale_by_dion2(
  orthogonalization: settings.Orthogonalization,
  mu_dtype: types.MomentumDtype,
  scale_mode: types.ScaleMode,
  extra: Any,
  *,
  fraction: types.Numeric,
  ef_decay: types.Numeric,
  selection_scope: str,
  normalize_neurons: bool = False,
  beta2: types.Numeric = 0.95,
) -> optax.GradientTransformation:
  """``scale_by_dion2`` of its settings objects and its selection's
  settings (checked here), built by it, ``dion2`` or ``nordion2``
  (``normalize_neurons`` and ``beta2``: ``scale_by_dion2``'s defaults,
  NorDion2's alone)."""
  sharding = orthogonalization.execution.sharding
  _check_selection(fraction, ef_decay, sharding, selection_scope)
  _checks.check_range("beta2", beta2, 0.0, 1.0)
  mu_dtype = canonical_dtype("mu_dtype", mu_dtype)
  step = dion2_step.Dion2Step(
    fraction=fraction,
    ef_decay=ef_decay,
    normalize_neurons=normalize_neurons,
    beta2=beta2,
    scale_mode=scale_mode,
    extra=extra,
    sharding=None if selection_scope == "global" else sharding,
    solver=orthogonalization.solver,
    memory_budget=orthogonalization.execution.memory_budget,
  )
  resolve_views = orthogonalization.views

  def init_fn(params):
    momentum = jax.tree.map(
      lambda p: jnp.zeros_like(p, dtype=mu_dtype or jnp.result_type(p)), params
    )
    views = resolve_views(params)
    plans = step.plans(params, views)  # a leaf it cannot select raises
    if not normalize_neurons:
      return Dion2State(momentum, None)
    variance = [
      tuple(
        step.placed(jnp.zeros_like(piece[:, :1, :], jnp.float32), plan)
        for piece in view.to_matrices(selection.replicated(leaf))
      )
      for (_, leaf, view), plan in zip(views, plans)
    ]
    return Dion2State(
      momentum, jax.tree.unflatten(pieces_structure(params), variance)
    )

  def update_fn(updates, state, params=None):
    del params
    treedef = jax.tree.structure(updates)
    pieces = pieces_structure(updates)
    gradients = treedef.flatten_up_to(updates)
    resolved = resolve_views(updates)
    views = [view for _, _, view in resolved]
    variances = (
      pieces.flatten_up_to(state.variance)
      if normalize_neurons
      else [None] * len(gradients)
    )
    directions, momenta, new_variances = step(
      step.plans(updates, resolved),
      treedef.flatten_up_to(state.momentum),
      gradients,
      views,
      variances,
    )
    variance = (
      jax.tree.unflatten(pieces, new_variances) if normalize_neurons else None
    )
    return jax.tree.unflatten(treedef, directions), Dion2State(
      jax.tree.unflatten(treedef, momenta), variance
    )

  return optax.GradientTransformation(init_fn, update_fn)


@built.recorded
def dion2(
  learning_rate: optax.ScalarOrSchedule,
  *,
  fraction: types.Numeric = 0.25,
  ef_decay: types.Numeric = 0.95,
  mu_dtype: types.MomentumDtype = None,
  coefficients: types.Coefficients = "polar_express_dion",
  steps: types.Steps = 5,
  precision: types.Precision = "highest",
  method: types.Method = "standard",
  scale_mode: types.ScaleMode = "unit_rms_norm",
  extra_scale_factor: types.Numeric | None = None,
  match_adamw_update_rms: bool = False,
  dimension_numbers: types.PerLeaf = None,
  split_qkv: types.PerLeaf = None,
  split_gate_up: types.PerLeaf = None,
  preconditioning: types.Preconditioning = "frobenius",
  layout: Any = None,
  memory_budget: int | None = None,
  weight_decay: types.Numeric = 0.0,
  weight_decay_mask: types.PerLeaf = None,
  labels: types.PerLeaf = None,
  state_memory_kind: types.MemoryKind | None = None,
  sharding: TensorParallel | None = None,
  selection_scope: str = "local",
  **scalar_kwargs: Unpack[settings.ScalarOptimizerOptions],
) -> optax.GradientTransformation:
  r"""Dion2 for the matrices, AdamW for the rest: ``om.muon``'s routing with
  ``scale_by_dion2`` as the direction;
  ``p ← p − lr · (scale_by_dion2(g) + weight_decay · p)`` (the decay on
  every weight, the step on the selected slices only).

  ``beta``, ``nesterov`` and ``momentum_style`` do not apply (the momentum
  is a sum, decayed by ``ef_decay`` where selected). Without ``sharding``
  sharded params are partitioned by XLA under ``jax.jit`` and the selection
  is the whole matrix's; with an ``om.TensorParallel`` the selection is each
  shard's own (``selection_scope="local"``, microsoft/dion's default: only
  the selected slices travel) or the whole matrix's (``"global"``). The
  defaults of ``coefficients`` and ``scale_mode`` are microsoft/dion's (see
  ``scale_by_dion2``); ``weight_decay`` is the family's 0 (microsoft/dion's
  is 0.01).

  Args:
    learning_rate: a float or an optax schedule.
    fraction: the share of each matrix's slices orthogonalized per step.
    ef_decay: the error-feedback decay of the selected slices.
    sharding: ``None`` or an ``om.TensorParallel`` with an exact mode.
    selection_scope: ``"local"`` or ``"global"`` (see ``scale_by_dion2``).
    **scalar_kwargs: ``om.muon``'s ``scalar_optimizer`` and ``adam_*``
      arguments, for the leaves that are not matrices.

  Returns:
    An ``optax.GradientTransformation``.

  Example:
    >>> import jax.numpy as jnp, optax_muon as om
    >>> params = {"hidden": jnp.ones((16, 32)), "bias": jnp.zeros(32)}
    >>> tx = om.dion2(0.01, fraction=0.25)
    >>> updates, _ = tx.update(params, tx.init(params), params)
    >>> # the shorter axis is fan_in's 16 rows: ⌈0.25 · 16⌉ = 4 are updated
    >>> int((jnp.abs(updates["hidden"]).sum(1) > 0).sum())
    4

  References:
    Ahn et al., `Dion2 <https://arxiv.org/abs/2512.16928>`_, 2025
  """
  labels, dimension_numbers = from_layout(layout, labels, dimension_numbers)
  routing = settings.scalar_options(scalar_kwargs)
  direction = _scale_by_dion2(
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
    mu_dtype,
    scale_mode,
    settings.extra_scale(
      scale_mode,
      extra_scale_factor,
      match_adamw_update_rms,
      routing["adam_b1"],
    ),
    fraction=fraction,
    ef_decay=ef_decay,
    selection_scope=selection_scope,
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


@built.recorded
def nordion2(
  learning_rate: optax.ScalarOrSchedule,
  *,
  fraction: types.Numeric = 0.25,
  beta: types.Numeric = 0.95,
  beta2: types.Numeric = 0.95,
  mu_dtype: types.MomentumDtype = None,
  coefficients: types.Coefficients = "polar_express_dion",
  steps: types.Steps = 5,
  precision: types.Precision = "highest",
  method: types.Method = "standard",
  scale_mode: types.ScaleMode = "unit_rms_norm",
  extra_scale_factor: types.Numeric | None = None,
  match_adamw_update_rms: bool = False,
  dimension_numbers: types.PerLeaf = None,
  split_qkv: types.PerLeaf = None,
  split_gate_up: types.PerLeaf = None,
  preconditioning: types.Preconditioning = "frobenius",
  layout: Any = None,
  memory_budget: int | None = None,
  weight_decay: types.Numeric = 0.0,
  weight_decay_mask: types.PerLeaf = None,
  labels: types.PerLeaf = None,
  state_memory_kind: types.MemoryKind | None = None,
  sharding: TensorParallel | None = None,
  selection_scope: str = "local",
  **scalar_kwargs: Unpack[settings.ScalarOptimizerOptions],
) -> optax.GradientTransformation:
  r"""NorDion2 for the matrices, AdamW for the rest: ``dion2`` selecting
  output neurons, with ``ef_decay = beta``, each selected neuron divided by
  the root of its running mean square (decay ``beta2``) and the selection
  rescaled to its Frobenius norm (NorMuon's normalization).

  ``nesterov`` and ``momentum_style`` do not apply; the other arguments
  are ``dion2``'s. With ``sharding`` and ``selection_scope="local"`` (the
  default, microsoft/dion's) a matrix split along ``fan_out`` selects and
  normalizes each shard's own neurons; one split along ``fan_in`` is
  refused at ``init`` (as dion refuses it): use ``"global"`` there.

  Args:
    learning_rate: a float or an optax schedule.
    fraction: the share of each matrix's output neurons updated per step.
    beta: the momentum: the selected neurons' error-feedback decay.
    beta2: the second moment's decay.
    sharding: ``None`` or an ``om.TensorParallel`` with an exact mode.
    selection_scope: ``"local"`` or ``"global"`` (see ``scale_by_dion2``).
    **scalar_kwargs: ``om.muon``'s ``scalar_optimizer`` and ``adam_*``.

  Returns:
    An ``optax.GradientTransformation``.

  References:
    microsoft/dion ``dion/nordion2.py``; Li et al., `NorMuon
    <https://arxiv.org/abs/2510.05491>`_, 2025
  """
  # its beta is the selection's ef_decay: checked under the name given
  _checks.check_range("beta", beta, 0.0, 1.0 + 1e-12)
  labels, dimension_numbers = from_layout(layout, labels, dimension_numbers)
  routing = settings.scalar_options(scalar_kwargs)
  direction = _scale_by_dion2(
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
    mu_dtype,
    scale_mode,
    settings.extra_scale(
      scale_mode,
      extra_scale_factor,
      match_adamw_update_rms,
      routing["adam_b1"],
    ),
    fraction=fraction,
    ef_decay=beta,
    normalize_neurons=True,
    beta2=beta2,
    selection_scope=selection_scope,
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
  """``MuonConfig(optimizer="dion2" | "nordion2")`` with the ``dion2_*``
  fields (and NorDion2's ``nordion2_beta2``; its β is ``muon_momentum``);
  the momentum's other settings do not apply (a sum, decayed where
  selected). ``sharding`` is set when ``muon_tp_mode`` names an exact mode
  (each shard selects its own slices)."""
  del nesterov, momentum_style
  shared = dict(
    fraction=config.dion2_fraction,
    selection_scope=config.dion2_selection_scope,
    **keywords,
  )
  if config.optimizer == "dion2":
    return dion2(learning_rate, ef_decay=config.dion2_ef_decay, **shared)
  return nordion2(
    learning_rate, beta=beta, beta2=config.nordion2_beta2, **shared
  )


_SLICES_WHOLE = (
  "its selected slices are orthogonalized whole: None, the whole matrix's "
  "selection partitioned by XLA, or an exact mode, each shard selecting its "
  "own slices (microsoft/dion's local scope)"
)
for _name, _prefixes in (
  ("dion2", ("dion2_",)),
  ("nordion2", ("dion2_", "nordion2_")),
):
  registry.register(
    _name,
    registry.ConfigMember(
      factory=_from_config,
      field_prefixes=_prefixes,
      tp_modes=(None, *EXACT_MODES),
      tp_modes_why=_SLICES_WHOLE,
      own_scheme=True,
    ),
  )
