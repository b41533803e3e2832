"""``torch.optim.Muon``'s numbers in optax (``compat.torch_muon``)."""

from typing import Any
from typing import Literal
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import MuonDimensionNumbers

from optax_muon._src.base import built
from optax_muon._src.base import checks as _checks
from optax_muon._src.base import types
from optax_muon._src.kernels import batched
from optax_muon._src.optimizers.route import route
from optax_muon._src.parallel.execution import Execution
from optax_muon._src.parallel.tensor_parallel import TensorParallel
from optax_muon._src.transforms import scaling
from optax_muon._src.transforms.momentum import canonical_dtype
from optax_muon._src.transforms.orthogonalize import orthogonalizer
from optax_muon._src.views.layout import from_layout
from optax_muon._src.views.matrix_views import Views

ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
WEIGHT_ORDERS = ("in_out", "out_in")
# torch.optim.Muon's defaults (PyTorch 2.9 to 2.13), Keller Jordan's triple
TORCH_NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
# torch's "match_rms_adamw": lr · 0.2 · √max(A, B) (Moonlight's factor)
MATCH_RMS_ADAMW_FACTOR = 0.2


class TorchMomentumState(NamedTuple):
  """torch's ``momentum_buffer``, one per leaf."""

  mu: optax.Updates


def _lerp(start, end, weight):
  """``torch.lerp(start, end, weight)`` with torch's rounding: a weight below
  one half steps from ``start``, else back from ``end`` (one fused
  multiply-add either way, which XLA emits for ``a + w (b − a)``)."""
  weight = jnp.asarray(weight, jnp.float32)
  small = start + weight * (end - start)
  large = end + (weight - 1.0) * (end - start)
  if _checks.is_traced(weight):
    return jnp.where(jnp.abs(weight) < 0.5, small, large)
  return small if abs(float(weight)) < 0.5 else large


def torch_momentum(
  momentum=0.95, *, nesterov: bool = True, dtype=None
) -> optax.GradientTransformation:
  r"""torch's Muon momentum, rounded as torch rounds it::

    B ← lerp(B, g, 1 − μ) = μ B + (1 − μ) g
    u = lerp(g, B, μ) = (1 − μ) g + μ B   (Nesterov)   or   u = B

  the same EMA as ``om.momentum(style="ema")``, computed with ``torch.lerp``'s
  formulas: its bits are torch's on the CPU, which keeps a bf16
  Newton–Schulz (where one bit of input can move the result 0.2%) on
  torch's path.

  Args:
    momentum: ``μ`` in ``[0, 1)``; may be traced.
    nesterov: the Nesterov look-ahead.
    dtype: the buffer's dtype (``None``: the param's, as torch).

  Returns:
    An ``optax.GradientTransformation`` with state ``TorchMomentumState``.
  """
  dtype = canonical_dtype("mu_dtype", dtype)

  def init_fn(params):
    return TorchMomentumState(
      mu=jax.tree.map(lambda p: jnp.zeros_like(p, dtype=dtype), params)
    )

  def update_fn(updates, state, params=None):
    del params
    wide = lambda g, b: g.astype(jnp.result_type(g, b))
    updates = jax.tree.map(wide, updates, state.mu)
    mu = jax.tree.map(
      lambda g, b: _lerp(b.astype(g.dtype), g, 1.0 - momentum),
      updates,
      state.mu,
    )
    out = (
      jax.tree.map(lambda g, b: _lerp(g, b, momentum), updates, mu)
      if nesterov
      else mu
    )
    stored = jax.tree.map(lambda b, old: b.astype(old.dtype), mu, state.mu)
    return out, TorchMomentumState(mu=stored)

  return optax.GradientTransformation(init_fn, update_fn)


def _out_in(params):
  """torch's ``(out, in)`` for every 2-axis leaf; others need their own."""
  return jax.tree.map(
    lambda p: (
      MuonDimensionNumbers(reduction_axis=1, output_axis=0)
      if jnp.ndim(p) == 2
      else None
    ),
    params,
  )


def torch_scale(adjust_lr_fn) -> tuple[types.ScaleMode, float]:
  """``(scale_mode, extra_scale_factor)`` of torch's ``adjust_lr_fn``."""
  if adjust_lr_fn not in ADJUST_LR_FNS:
    raise ValueError(
      f"adjust_lr_fn={adjust_lr_fn!r} is not accepted; accepted: "
      f"{list(ADJUST_LR_FNS)}"
    )
  if adjust_lr_fn == "match_rms_adamw":
    return "spectral", MATCH_RMS_ADAMW_FACTOR
  return "shape_scaling", 1.0


def torch_dimension_numbers(weight_order, dimension_numbers):
  """The dimension numbers of ``weight_order`` (torch's ``(out, in)`` for
  ``"out_in"``), or the user's for ``"in_out"``."""
  _checks.check_choice("weight_order", weight_order, WEIGHT_ORDERS)
  if weight_order == "in_out":
    return dimension_numbers
  if dimension_numbers is not None:
    raise ValueError(
      "weight_order='out_in' gives every 2-axis leaf torch's (out, in) "
      "dimension numbers, but layout= or dimension_numbers= was also set; "
      "pass one of them (weight_order='in_out' with a layout)"
    )
  return _out_in


def _check_coefficients(ns_coefficients) -> tuple[float, float, float]:
  try:
    triple = tuple(float(c) for c in ns_coefficients)
  except (TypeError, ValueError) as error:
    raise ValueError(
      f"ns_coefficients={ns_coefficients!r} is not accepted; accepted: a "
      "tuple of three floats (a, b, c), as torch.optim.Muon takes"
    ) from error
  if len(triple) != 3 or not all(np.isfinite(triple)):
    raise ValueError(
      f"ns_coefficients={ns_coefficients!r} is not accepted; accepted: a "
      "tuple of three finite floats (a, b, c), as torch.optim.Muon takes"
    )
  return triple


@built.recorded
def torch_muon(
  lr: optax.ScalarOrSchedule = 1e-3,
  weight_decay: types.Numeric = 0.1,
  momentum: types.Numeric = 0.95,
  nesterov: bool = True,
  ns_coefficients: tuple[float, float, float] = TORCH_NS_COEFFICIENTS,
  eps: float = 1e-7,
  ns_steps: int = 5,
  adjust_lr_fn: Literal["original", "match_rms_adamw"] | None = None,
  *,
  weight_order: Literal["in_out", "out_in"] = "in_out",
  precision: Literal["bf16", "highest", "high", "medium", "fp16"] = "bf16",
  mu_dtype: types.MomentumDtype = None,
  labels: types.PerLeaf = None,
  layout: Any = None,
  dimension_numbers: types.PerLeaf = None,
  split_qkv: types.PerLeaf = None,
  split_gate_up: types.PerLeaf = None,
  sharding: TensorParallel | None = None,
  memory_budget: int | None = None,
  weight_decay_mask: types.PerLeaf = None,
  scalar_optimizer: Literal["adam", "lion"] = "adam",
  adam_learning_rate: optax.ScalarOrSchedule | None = None,
  adam_b1: types.Numeric = 0.9,
  adam_b2: types.Numeric = 0.999,
  adam_eps: types.Numeric = 1e-8,
  adam_weight_decay: types.Numeric = 0.01,
  adam_weight_decay_mask: types.PerLeaf = None,
  state_memory_kind: Literal["pinned_host"] | None = None,
) -> optax.GradientTransformation:
  r"""``torch.optim.Muon`` (PyTorch ≥ 2.9): its arguments, defaults and numbers.

  For each matrix ``W`` (``A × B`` in torch's ``(out, in)`` order)::

    B ← μ B + (1 − μ) g;   u = (1 − μ) g + μ B  (Nesterov)  or  u = B
    O = NS_{(a, b, c)}^{ns_steps}(u)   # iterate kept in bf16, as torch
    W ← W (1 − lr λ) − lr · s · O

  with ``s = √max(1, A/B)`` (``adjust_lr_fn=None`` or ``"original"``,
  Keller Jordan's) or ``0.2 √max(A, B)`` (``"match_rms_adamw"``,
  Moonlight's). torch's Muon takes 2-D params only, and a torch script
  gives the rest to a second optimizer, usually ``torch.optim.AdamW``: here
  the rest of the tree goes to AdamW with the ``adam_*`` settings, whose
  decay defaults to AdamW's ``0.01`` (``om.muon``'s is optax's 0.0), on
  that group's matrices (embeddings, the head) as ``om.muon`` masks it:
  biases and norms do not decay (``adam_weight_decay_mask`` changes it). Which
  leaves are the rest: with ``layout=om.infer_layout(model, batch)``, read
  from the model (the head is the layer whose output is the model's
  output, whatever its name); without it, by name as ``om.muon`` routes
  (``embed``, ``head``, ``lm_head``, norms, biases, vectors), so a last
  layer named otherwise (``fc2``, ``out``) goes to Muon. The keyword-only
  arguments are ``om.muon``'s; ``compat.describe_torch_muon`` prints where
  each leaf goes and its scale.

  Its weights stay within bf16's own rounding of torch's (the figures, and
  why no bf16 implementation with another summation order comes closer:
  docs/guide.md, "Migrating from torch.optim.Muon"); with
  ``precision="highest"`` it equals torch's algorithm re-run in fp32.
  One deliberate difference: the norm is floored at ``eps`` after scaling
  by a power of two, so a gradient of norm below ``eps`` is orthogonalized
  like any other (torch leaves it below unit norm).

  Args:
    lr: the learning rate, a float or an optax schedule.
    weight_decay: decoupled weight decay ``λ`` (times ``lr``, as torch).
    momentum: ``μ`` in ``[0, 1)``.
    nesterov: the Nesterov look-ahead.
    ns_coefficients: the Newton–Schulz triple ``(a, b, c)``.
    eps: floor of the norm before the iteration.
    ns_steps: Newton–Schulz steps.
    adjust_lr_fn: ``None`` / ``"original"`` or ``"match_rms_adamw"``.
    weight_order: ``"in_out"`` (JAX's kernels: Flax, Equinox, Haiku) or
      ``"out_in"`` (torch's ``nn.Linear.weight``, e.g. weights converted
      from a PyTorch checkpoint); leaves of 3+ axes need ``layout`` or
      ``dimension_numbers`` either way.
    precision: ``"bf16"`` (torch's), or another of ``om.newton_schulz``'s.
    mu_dtype: the momentum buffer's dtype (``None``: the param's, as torch).

  ``labels``, ``layout``, ``dimension_numbers``, ``split_qkv``,
  ``split_gate_up``, ``sharding``, ``memory_budget``, ``weight_decay_mask``,
  ``scalar_optimizer``, the ``adam_*`` settings and ``state_memory_kind``
  are as in ``om.muon``.

  Returns:
    An ``optax.GradientTransformation`` (``optax.partition`` of Muon, AdamW
    and nothing, as ``om.muon``).

  Example:
    >>> import jax, jax.numpy as jnp, optax_muon as om
    >>> weight = jax.random.normal(jax.random.key(0), (64, 128))  # (out, in)
    >>> tx = om.compat.torch_muon(lr=0.02, weight_order="out_in")
    >>> updates, _ = tx.update({"w": weight}, tx.init({"w": weight}), {"w": weight})
    >>> updates["w"].shape
    (64, 128)

  References:
    `torch.optim.Muon
    <https://docs.pytorch.org/docs/stable/generated/torch.optim.Muon.html>`_

    Jordan et al., `Muon <https://kellerjordan.github.io/posts/muon/>`_, 2024

    Liu et al., `Muon is Scalable for LLM Training
    <https://arxiv.org/abs/2502.16982>`_, 2025
  """
  _checks.check_range("momentum", momentum, 0.0, 1.0)
  _checks.check_range("eps", eps, 0.0, np.inf)
  _checks.check_int("ns_steps", ns_steps, minimum=1)
  _checks.check_range("adam_b1", adam_b1, 0.0, 1.0)
  if not isinstance(nesterov, bool):
    raise TypeError(f"nesterov must be a bool, got {nesterov!r}")
  triple = _check_coefficients(ns_coefficients)
  labels, dimension_numbers = from_layout(layout, labels, dimension_numbers)
  dimension_numbers = torch_dimension_numbers(weight_order, dimension_numbers)
  scale_mode, extra = torch_scale(adjust_lr_fn)
  solver = batched.Solver(
    coefficients=[triple], steps=ns_steps, precision=precision, eps=eps
  )
  views = Views(
    dimension_numbers=dimension_numbers,
    split_qkv=split_qkv,
    split_gate_up=split_gate_up,
    torch_orientation=True,
  )
  execution = Execution(sharding=sharding, memory_budget=memory_budget)
  direction = optax.chain(
    torch_momentum(momentum, nesterov=nesterov, dtype=mu_dtype),
    orthogonalizer(solver, views, execution).transform,
    scaling.shape_scaler(scale_mode, views, solver, execution),
    optax.scale(extra),
  )
  return route(
    direction,
    lr,
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
