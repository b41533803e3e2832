"""``optax.contrib.muon`` (optax 0.2.8) on optax_muon's kernels; the public
module is ``optax_muon.compat``."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import MuonDimensionNumbers
from optax.contrib import MuonState

from optax_muon._src.base import checks as _checks
from optax_muon._src.base import paths as _paths
from optax_muon._src.base import types
from optax_muon._src.kernels import batched
from optax_muon._src.kernels import coefficients as coefficients_lib
from optax_muon._src.kernels.newton_schulz import PRECONDITIONINGS
from optax_muon._src.kernels.quantize import QuantizedMomentum
from optax_muon._src.parallel import offload
from optax_muon._src.parallel import tensor_parallel as sharding_lib
from optax_muon._src.transforms import scaling

# by name: the package's namespace binds these module names to functions
from optax_muon._src.transforms.momentum import BiasCorrectedMomentumState
from optax_muon._src.transforms.momentum import canonical_dtype
from optax_muon._src.transforms.momentum import momentum as momentum_transform
from optax_muon._src.transforms.orthogonalize import (
  orthogonalize as orthogonalize_transform,
)
from optax_muon._src.views import layout

OPTAX_VERSION = "0.2.8"

NS_COEFFS_PRESETS = {
  "standard": coefficients_lib.COEFFICIENT_SETS["simple"].tuples[0],
  "dion": coefficients_lib.COEFFICIENT_SETS["quintic"].tuples,
}
_DEFAULT_NS_COEFFS = NS_COEFFS_PRESETS["standard"]

__all__ = (
  "MuonDimensionNumbers",
  "MuonState",
  "muon",
  "orthogonalize_via_newton_schulz",
  "scale_by_muon",
  "scale_by_shape",
)

_is_dims = lambda x: isinstance(x, MuonDimensionNumbers)


def _coefficient_table(ns_coeffs):
  """``ns_coeffs`` as an fp32 ``(3,)`` or ``(n, 3)`` array (a traced one, from
  a state, as it is)."""
  rows = (
    ns_coeffs
    if _checks.is_traced(ns_coeffs)
    else np.asarray(ns_coeffs, np.float32)
  )
  if rows.ndim not in (1, 2) or rows.shape[-1] != 3:
    raise ValueError(
      f"ns_coeffs must have shape (3,) or (n, 3), got {rows.shape}; "
      f"accepted: one (a, b, c), a list of them, or a preset in "
      f"{sorted(NS_COEFFS_PRESETS)}"
    )
  return rows


def _coefficient_rows(ns_coeffs, ns_steps) -> tuple[np.ndarray, Any]:
  """``ns_coeffs`` as optax keeps them in its state, and the step count.

  One ``(a, b, c)`` runs ``ns_steps`` times; an ``(n, 3)`` table (``n ≤
  ns_steps``) runs its rows once each.
  """
  rows = _coefficient_table(ns_coeffs)
  if rows.ndim == 1:
    return rows, ns_steps
  _checks.check_int("ns_steps", ns_steps, minimum=1)
  if rows.shape[0] > ns_steps:
    raise ValueError(
      f"ns_coeffs has {rows.shape[0]} rows, more than "
      f"ns_steps={ns_steps}; give at most ns_steps rows"
    )
  return rows, rows.shape[0]


def _resolve(dims, tree):
  return dims(tree) if callable(dims) else dims


def _check_muon_leaves(dims, tree):
  """Without dimension numbers every Muon leaf must be a matrix (optax's
  rule), checked here at ``init`` rather than inside the traced update."""
  if dims is None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      if jnp.ndim(leaf) != 2:
        raise ValueError(
          f"leaf {jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)}; "
          "without weight_dimension_numbers every Muon leaf must be 2-D "
          "(give a MuonDimensionNumbers for it)"
        )


def orthogonalize_via_newton_schulz(
  x: jax.Array,
  ns_coeffs: jax.Array,
  ns_steps: types.Steps = 5,
  preconditioning: types.Preconditioning = "frobenius",
  eps: types.Numeric = 1e-8,
  dimension_numbers: MuonDimensionNumbers | None = None,
  *,
  method: types.Method = "standard",
  precision: types.Precision = "high",
) -> jax.Array:
  r"""``optax.contrib.orthogonalize_via_newton_schulz`` on optax_muon's kernel.

  Each matrix of ``x`` (``dimension_numbers`` say which axes; the others are
  batch axes) is turned wide, preconditioned (``X / (‖X‖_F + eps)`` for
  ``"frobenius"``) and iterated ``X ← a X + (b A + c A²) X``, ``A = X Xᴴ``.

  Args:
    x: an ``(m, n)`` matrix, or any array with ``dimension_numbers``.
    ns_coeffs: ``(3,)`` coefficients run ``ns_steps`` times, or ``(n, 3)``
      run once each.
    ns_steps: Newton–Schulz steps for ``(3,)`` coefficients.
    preconditioning: ``"frobenius"``, ``"spectral"``, ``"aol"`` or
      ``"schatten"``.
    eps: added to the norm (``"frobenius"``, ``"spectral"``), floor of the
      rescaling otherwise.
    dimension_numbers: a ``MuonDimensionNumbers``; required unless 2-D.
    method: ``"standard"`` or ``"gram"`` (extra, see ``orthogonalize``).
    precision: ``"highest"``, ``"high"`` (optax's) or ``"medium"`` (extra).

  Returns:
    An array of ``x.shape`` and ``x.dtype``.
  """
  if x.ndim != 2 and not _is_dims(dimension_numbers):
    raise ValueError(
      "Input must have shape (m, n) or weight dimension numbers must be "
      f"provided. Got shape={x.shape} and {dimension_numbers=}."
    )
  _checks.check_choice("preconditioning", preconditioning, PRECONDITIONINGS)
  rows = _coefficient_table(ns_coeffs)
  steps = ns_steps if rows.ndim == 1 else rows.shape[0]
  view = layout.matrix_view(x.shape, dimension_numbers if x.ndim != 2 else None)
  solver = batched.Solver(
    table=rows.reshape(-1, 3),
    steps=steps,
    precision=precision,
    eps=eps,
    preconditioning=preconditioning,
    add_eps=True,
    method=method,
  )
  out = batched.orthogonalize_matrices(view.to_matrices(x), solver)
  return view.from_matrices(out)


def scale_by_muon(
  ns_coeffs: Any = _DEFAULT_NS_COEFFS,
  ns_steps: types.Steps = 5,
  beta: types.Numeric = 0.95,
  eps: types.Numeric = 1e-8,
  mu_dtype: types.MomentumDtype = None,
  *,
  nesterov: bool = True,
  adaptive: bool = False,
  preconditioning: types.Preconditioning = "frobenius",
  weight_dimension_numbers: types.PerLeaf = None,
  sharding: sharding_lib.TensorParallel | None = None,
  method: types.Method = "standard",
  precision: types.Precision = "high",
  memory_budget: int | None = None,
) -> optax.GradientTransformation:
  r"""``optax.contrib.scale_by_muon``: bias-corrected momentum, orthogonalized.

  With ``β = beta`` and ``t`` the update count::

    m ← β m + (1 − β) g
    u = β m / (1 − βᵗ⁺¹) + (1 − β) g / (1 − βᵗ)   (Nesterov; else m / (1 − βᵗ))
    O = newton_schulz(u)
    update = ⟨u, O⟩ O  if adaptive  else  O

  Args:
    ns_coeffs: one ``(a, b, c)`` or a tuple of them (see
      ``orthogonalize_via_newton_schulz``).
    ns_steps: Newton–Schulz steps (ignored for a tuple of triples).
    beta: momentum decay.
    eps: added to the norm before the iteration.
    mu_dtype: momentum dtype (``None``: the param's); ``om.QuantizedMomentum()``
      stores it in 8 bits (extra).
    nesterov: Nesterov momentum.
    adaptive: scale by the dual norm ``⟨u, O⟩`` (Bernstein et al.).
    preconditioning: ``"frobenius"``, ``"spectral"``, ``"aol"`` or
      ``"schatten"``.
    weight_dimension_numbers: a tree (or callable of the params) of
      ``MuonDimensionNumbers``; ``None``: every leaf is a matrix.
    sharding: a ``TensorParallel`` (extra).
    method: ``"standard"`` or ``"gram"`` (extra).
    precision: ``"high"`` (optax's: the backend's default), ``"highest"`` or
      ``"medium"`` (extra).
    memory_budget: bytes per device of orthogonalization work in flight
      (extra; ``None``: 2 GiB; see ``om.orthogonalize``).

  Returns:
    An ``optax.GradientTransformation`` with optax's ``MuonState``.

  References:
    Jordan, `modded-nanogpt <https://github.com/KellerJordan/modded-nanogpt>`_,
    2024

    Bernstein et al., `Old Optimizer, New Norm: An Anthology
    <https://arxiv.org/abs/2409.20325>`_, 2024
  """
  rows, steps = _coefficient_rows(ns_coeffs, ns_steps)
  _checks.check_choice("preconditioning", preconditioning, PRECONDITIONINGS)
  canonical_dtype("mu_dtype", mu_dtype, quantized=True)
  if not isinstance(adaptive, bool):
    raise TypeError(f"adaptive must be a bool, got {adaptive!r}")
  momentum = momentum_transform(
    beta, nesterov=nesterov, dtype=mu_dtype, bias_correction=True
  )
  orthogonalize = orthogonalize_transform(
    coefficients=rows,
    steps=steps,
    precision=precision,
    method=method,
    dimension_numbers=weight_dimension_numbers,
    sharding=sharding,
    eps=eps,
    preconditioning=preconditioning,
    add_eps=True,
    memory_budget=memory_budget,
  )

  def init_fn(params):
    _check_muon_leaves(_resolve(weight_dimension_numbers, params), params)
    orthogonalize.init(params)
    state = momentum.init(params)
    return MuonState(
      count=state.count, mu=state.mu, ns_coeffs=jnp.asarray(rows)
    )

  def update_fn(updates, state, params=None):
    del params
    direction, moved = momentum.update(
      updates, BiasCorrectedMomentumState(state.count, state.mu)
    )
    out, _ = orthogonalize.update(direction, optax.EmptyState())
    if adaptive:
      out = jax.tree.map(lambda u, o: jnp.sum(u.conj() * o) * o, direction, out)
    return out, MuonState(
      count=moved.count, mu=moved.mu, ns_coeffs=state.ns_coeffs
    )

  return optax.GradientTransformation(init_fn, update_fn)


def scale_by_shape(
  weight_dimension_numbers: types.PerLeaf = None,
  consistent_rms: types.Numeric | None = None,
  *,
  sharding: sharding_lib.TensorParallel | None = None,
) -> optax.GradientTransformation:
  r"""``optax.contrib.scale_by_shape``: ``√max(1, fan_out/fan_in)``, or with
  ``consistent_rms = r``: ``r √max(fan_in, fan_out)`` (Liu et al.).

  Args:
    weight_dimension_numbers: a tree (or callable) of ``MuonDimensionNumbers``;
      ``None``: every leaf is a matrix.
    consistent_rms: ``None`` or the target RMS (0.2 matches AdamW's).
    sharding: a ``TensorParallel`` (extra; blockwise scales by the shard).

  Returns:
    A stateless ``optax.GradientTransformation``.
  """
  return _shape_scale(weight_dimension_numbers, consistent_rms, sharding)


def _shape_scale(
  weight_dimension_numbers, consistent_rms, sharding, **solver_settings
) -> optax.GradientTransformation:
  """``scale_by_shape`` with the orthogonalize's ``steps``, ``precision``,
  ``preconditioning`` and ``memory_budget`` (``tp_mode="auto"`` with
  ``blockwise`` allowed chooses by them which leaves scale by their shard)."""
  by_shape = scaling.scale_by_shape(
    "shape_scaling" if consistent_rms is None else "spectral",
    dimension_numbers=weight_dimension_numbers,
    sharding=sharding,
    **solver_settings,
  )

  def update_fn(updates, state, params=None):
    updates, state = by_shape.update(updates, state, params)
    if consistent_rms is not None:
      updates = jax.tree.map(lambda u: u * consistent_rms, updates)
    return updates, state

  return optax.GradientTransformation(by_shape.init, update_fn)


def _labels_and_dims(dims_or_fn):
  """optax's routing: ``param_labels(params)`` and the Muon group's dims.

  Without dimension numbers 2-D leaves go to Muon and the rest to Adam; with
  them (a tree, a prefix of the params' tree, or a callable), a
  ``MuonDimensionNumbers`` sends its subtree to Muon and ``None`` to Adam.
  The tree is read by path, as ``om.muon`` reads it: a plain dict names the
  leaves of an ``nnx.State`` (MaxText's dimension numbers against its NNX
  params), where optax needs the same pytree structure.
  """
  lookup = _paths.PathLookup(
    "muon_weight_dimension_numbers", dims_or_fn, MuonDimensionNumbers
  )

  def muon_dims(params):
    """One entry per leaf: its dims, or None (Adam). Inside the partition the
    Adam leaves are masked out, so only dims remain."""
    if dims_or_fn is None:
      return jax.tree.map(
        lambda x: MuonDimensionNumbers() if x.ndim == 2 else None, params
      )
    dims_of = lookup.resolve(params)
    pairs, treedef = _paths.leaves_with_paths(params)
    return jax.tree.unflatten(treedef, [dims_of(path) for path, _ in pairs])

  def labels(params):
    return jax.tree.map(
      lambda d: "adam" if d is None else "muon",
      muon_dims(params),
      is_leaf=lambda x: x is None or _is_dims(x),
    )

  return labels, muon_dims


def muon(
  learning_rate: optax.ScalarOrSchedule,
  ns_coeffs: Any = _DEFAULT_NS_COEFFS,
  ns_steps: types.Steps = 5,
  beta: types.Numeric = 0.95,
  eps: types.Numeric = 1e-8,
  weight_decay: types.Numeric = 0.0,
  weight_decay_mask: Any | Callable[[optax.Params], Any] | None = None,
  mu_dtype: types.MomentumDtype = None,
  *,
  nesterov: bool = True,
  adaptive: bool = False,
  preconditioning: types.Preconditioning = "frobenius",
  adam_b1: types.Numeric = 0.9,
  adam_b2: types.Numeric = 0.999,
  adam_eps_root: types.Numeric = 0.0,
  adam_weight_decay: types.Numeric = 0.0,
  adam_learning_rate: optax.ScalarOrSchedule | None = None,
  muon_weight_dimension_numbers: types.PerLeaf = None,
  consistent_rms: types.Numeric | None = None,
  sharding: sharding_lib.TensorParallel | None = None,
  method: types.Method = "standard",
  precision: types.Precision = "high",
  memory_budget: int | None = None,
  state_memory_kind: str | None = None,
) -> optax.GradientTransformation:
  r"""``optax.contrib.muon`` (optax 0.2.8), built on optax_muon.

  Muon leaves (2-D ones, or those ``muon_weight_dimension_numbers`` give
  dimension numbers)::

    p ← p − lr · (scale_by_shape(scale_by_muon(g)) + weight_decay · p)

  the others ``optax.adamw(adam_learning_rate or learning_rate, adam_b1,
  adam_b2, eps, adam_eps_root, adam_weight_decay, mu_dtype, nesterov)``.
  The state is optax's: ``optax.partition`` of ``{"muon": chain(MuonState,
  EmptyState, add_decayed_weights, scale_by_learning_rate), "adam": adamw}``.

  Args:
    learning_rate: Muon's learning rate, a float or a schedule.
    ns_coeffs: one ``(a, b, c)``, a tuple of them, or a preset:
      ``"standard"`` (Jordan's triple) or ``"dion"`` (five triples).
    ns_steps: Newton–Schulz steps (ignored for a tuple of triples).
    beta: momentum decay.
    eps: Muon's norm eps and Adam's eps.
    weight_decay: decoupled weight decay of the Muon leaves (times lr).
    weight_decay_mask: a tree or callable of bools for it.
    mu_dtype: momentum dtype for both groups; ``om.QuantizedMomentum()``
      (extra) stores the Muon leaves' momentum in 8 bits (int8 and a scale
      per block) and leaves Adam's in the param dtype.
    nesterov: Nesterov momentum for both groups.
    adaptive: scale Muon updates by the dual norm ``⟨u, O⟩``.
    preconditioning: ``"frobenius"``, ``"spectral"``, ``"aol"`` or
      ``"schatten"``.
    adam_b1, adam_b2, adam_eps_root: Adam's settings.
    adam_weight_decay: Adam's decoupled weight decay.
    adam_learning_rate: Adam's learning rate (``None``: ``learning_rate``).
    muon_weight_dimension_numbers: a tree (prefix allowed) or callable of
      ``MuonDimensionNumbers`` / ``None`` (``None``: Adam).
    consistent_rms: ``None`` (width scaling ``√max(1, fan_out/fan_in)``) or
      the target RMS of ``r √max(fan_in, fan_out)`` scaling.
    sharding: a ``TensorParallel`` to run the Muon leaves over a mesh (extra).
    method: ``"standard"`` or ``"gram"`` (extra).
    precision: ``"high"`` (optax's), ``"highest"`` or ``"medium"`` (extra).
    memory_budget: bytes per device of orthogonalization work in flight
      (extra; ``None``: 2 GiB; see ``om.orthogonalize``).
    state_memory_kind: ``"pinned_host"`` keeps the state in host memory
      between steps (extra; see ``om.muon``).

  Returns:
    An ``optax.GradientTransformation`` whose state is optax's.

  References:
    Jordan, `modded-nanogpt <https://github.com/KellerJordan/modded-nanogpt>`_,
    2024

    Liu et al., `Muon is Scalable for LLM Training
    <https://arxiv.org/abs/2502.16982>`_, 2025
  """
  if isinstance(ns_coeffs, str):
    if ns_coeffs not in NS_COEFFS_PRESETS:
      raise ValueError(
        f"ns_coeffs={ns_coeffs!r} is not a preset; accepted: "
        f"{sorted(NS_COEFFS_PRESETS)} or (a, b, c) tuples"
      )
    ns_coeffs = NS_COEFFS_PRESETS[ns_coeffs]
  for name, value in (
    ("learning_rate", learning_rate),
    ("adam_learning_rate", adam_learning_rate),
    ("weight_decay", weight_decay),
    ("adam_weight_decay", adam_weight_decay),
  ):
    if value is not None and not callable(value):
      _checks.check_range(name, value, 0.0, np.inf)  # NaN and < 0 raise
  if adam_learning_rate is None:
    adam_learning_rate = learning_rate
  labels, muon_dims = _labels_and_dims(muon_weight_dimension_numbers)
  offload.check_memory_kind(state_memory_kind)
  routed = optax.partition(
    transforms={
      "muon": optax.chain(
        scale_by_muon(
          ns_coeffs,
          ns_steps,
          beta,
          eps,
          mu_dtype,
          nesterov=nesterov,
          adaptive=adaptive,
          preconditioning=preconditioning,
          weight_dimension_numbers=muon_dims,
          sharding=sharding,
          method=method,
          precision=precision,
          memory_budget=memory_budget,
        ),
        _shape_scale(
          muon_dims,
          consistent_rms,
          sharding,
          steps=_coefficient_rows(ns_coeffs, ns_steps)[1],
          precision=precision,
          preconditioning=preconditioning,
          memory_budget=memory_budget,
        ),
        optax.add_decayed_weights(weight_decay, weight_decay_mask),
        optax.scale_by_learning_rate(learning_rate),
      ),
      "adam": optax.adamw(
        learning_rate=adam_learning_rate,
        b1=adam_b1,
        b2=adam_b2,
        eps=eps,
        eps_root=adam_eps_root,
        weight_decay=adam_weight_decay,
        # optax.adamw has no 8-bit buffer: its group keeps the param dtype
        mu_dtype=None if isinstance(mu_dtype, QuantizedMomentum) else mu_dtype,
        nesterov=nesterov,
      ),
    },
    param_labels=labels,
  )
  if state_memory_kind is None:
    return routed
  return offload.offload_state(routed, state_memory_kind)
