"""The Muon family's shared settings: declared once, forwarded one way.

``muon``, ``adaptive_muon``, ``polargrad``, ``muon_hyperball`` and ``scion``
(and their ``scale_by_*`` directions) take the same keywords for the same
things. Each signature still lists its keywords, so that readers, type
checkers and completion see them; this module is where they are grouped,
where a member says which of them do not apply to it and why, and how they
are forwarded: ``forward(callee, arguments)`` hands on exactly the keywords
the callee takes, so a keyword added to a member's signature and to the
callee's reaches it without a forwarding line to write.
``tests/test_family_settings.py`` holds every member to it: each shared
setting is accepted with ``scale_by_muon``'s (or ``muon``'s) default and
annotation, unless ``DIFFERENT_DEFAULTS`` or ``NOT_APPLICABLE`` says why not.
"""

import inspect
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import optax

from optax_muon._src.kernels import batched
from optax_muon._src.parallel.execution import Execution
from optax_muon._src.transforms import momentum as momentum_lib
from optax_muon._src.transforms import orthogonalize as orthogonalize_lib
from optax_muon._src.views.matrix_views import Views

MOMENTUM = ("beta", "nesterov", "momentum_style", "mu_dtype")
NEWTON_SCHULZ = (
  "coefficients",
  "steps",
  "precision",
  "method",
  "preconditioning",
  "memory_budget",
)
# how a leaf is seen as matrices, and over which devices they are worked on
VIEWS = (
  "dimension_numbers",
  "split_qkv",
  "split_gate_up",
  "sharding",
  "layout",
)
SHAPE_SCALE = ("scale_mode", "extra_scale_factor", "match_adamw_update_rms")
# the direction's keywords: scale_by_muon and its siblings take these
DIRECTION = MOMENTUM + NEWTON_SCHULZ + VIEWS + SHAPE_SCALE
# the routing's keywords: which leaves, the AdamW (or Lion) group, the
# decay, where the state lives (``route``)
ROUTING = (
  "labels",
  "weight_decay",
  "weight_decay_mask",
  "scalar_optimizer",
  "adam_learning_rate",
  "adam_b1",
  "adam_b2",
  "adam_eps",
  "adam_weight_decay",
  "adam_weight_decay_mask",
  "state_memory_kind",
)

# A member's default that is not scale_by_muon's / muon's, kept because the
# reference implementation of that member (EO) has it.
DIFFERENT_DEFAULTS: dict[str, dict[str, str]] = {
  "polargrad": {
    "nesterov": "EO's PolarGrad defaults to plain momentum (False)",
    "extra_scale_factor": "a plain factor (1.0): no RMS matching to derive",
  },
}
DIFFERENT_DEFAULTS["scale_by_polargrad"] = DIFFERENT_DEFAULTS["polargrad"]
DIFFERENT_DEFAULTS["dion2"] = {
  "coefficients": "microsoft/dion's Polar Express (polar_express_dion)",
  "scale_mode": "microsoft/dion's adjust_lr='spectral_norm': unit_rms_norm",
}
for _name in ("nordion2", "scale_by_dion2"):
  DIFFERENT_DEFAULTS[_name] = DIFFERENT_DEFAULTS["dion2"]
for _name in ("dion", "scale_by_dion"):
  DIFFERENT_DEFAULTS[_name] = {
    "scale_mode": DIFFERENT_DEFAULTS["dion2"]["scale_mode"]
  }

# The shared settings a member does not take, and why (its docstring says so
# too). Everything else in DIRECTION (and, for the optimizers, ROUTING) it
# takes with the reference's meaning.
NOT_APPLICABLE: dict[str, dict[str, str]] = {
  "polargrad": {
    "scale_mode": "the length is ⟨O, u⟩ (the nuclear norm), not a shape",
    "match_adamw_update_rms": "the length is ⟨O, u⟩, so no RMS to match",
  },
  "scion": {
    "scale_mode": "Scion fixes it: unit_rms_norm",
    "extra_scale_factor": "Scion fixes it: spectral_radius",
    "match_adamw_update_rms": "Scion fixes the factor: spectral_radius",
    "nesterov": "Scion fixes it: plain EMA momentum",
    "weight_decay": "Scion fixes it: 1, the convex combination",
  },
  "muon_hyperball": {
    "weight_decay_mask": "the hyperball decays every Muon weight: its "
    "radius is measured after the decay",
  },
}
NOT_APPLICABLE["scale_by_polargrad"] = NOT_APPLICABLE["polargrad"]
NOT_APPLICABLE["dion2"] = {
  "beta": "the momentum is a sum; ef_decay decays the selected slices",
  "nesterov": "the momentum is a sum, orthogonalized as it is",
  "momentum_style": "the momentum is a sum (no 1 - beta on the gradient)",
}
NOT_APPLICABLE["scale_by_dion2"] = NOT_APPLICABLE["dion2"]
_NO_NEWTON_SCHULZ = "no Newton–Schulz iteration: a QR of the rows × r product"
NOT_APPLICABLE["dion"] = {
  "beta": "the momentum is a sum; ef_decay decays the part the step captured",
  "nesterov": "the momentum is a sum, approximated as it is",
  "momentum_style": "the momentum is a sum (no 1 - beta on the gradient)",
  **dict.fromkeys(
    ("coefficients", "steps", "method", "preconditioning"),
    _NO_NEWTON_SCHULZ,
  ),
  "sharding": "not yet: under jax.jit XLA partitions sharded params",
}
NOT_APPLICABLE["scale_by_dion"] = NOT_APPLICABLE["dion"]
NOT_APPLICABLE["nordion2"] = {
  name: NOT_APPLICABLE["dion2"][name] for name in ("nesterov", "momentum_style")
}


def forward(
  callee: Callable[..., Any], arguments: Mapping[str, Any], **overrides: Any
) -> dict[str, Any]:
  """The entries of ``arguments`` (then ``overrides``) that ``callee`` takes
  as keyword-only arguments: a member's ``locals()`` handed on to its
  direction or to ``route``, without a list of names to keep in step.
  Positional parameters are passed by the caller (a name like
  ``scale_by_moment2``'s ``method`` may mean something else there)."""
  taken = {
    name
    for name, parameter in inspect.signature(callee).parameters.items()
    if parameter.kind is inspect.Parameter.KEYWORD_ONLY
  }
  values = {**arguments, **overrides}
  return {name: value for name, value in values.items() if name in taken}


def momentum_of(arguments: Mapping[str, Any]) -> optax.GradientTransformation:
  """The momentum a member's ``arguments`` describe (its ``style`` and
  ``dtype`` are the family's ``momentum_style`` and ``mu_dtype``)."""
  return momentum_lib.momentum(
    arguments["beta"],
    nesterov=arguments["nesterov"],
    style=arguments["momentum_style"],
    dtype=arguments["mu_dtype"],
    memory_budget=arguments["memory_budget"],
  )


def solver_of(arguments: Mapping[str, Any]) -> batched.Solver:
  """The Newton–Schulz solver a member's ``arguments`` describe."""
  return batched.solver(**forward(batched.solver, arguments))


def views_of(arguments: Mapping[str, Any]) -> Views:
  """The matrix views a member's ``arguments`` describe."""
  return Views(**forward(Views, arguments))


def execution_of(arguments: Mapping[str, Any], **overrides: Any) -> Execution:
  """Where and within which budget a member's ``arguments`` (then
  ``overrides``) run the orthogonalization."""
  return Execution(**forward(Execution, arguments, **overrides))


def orthogonalize_of(
  arguments: Mapping[str, Any],
) -> optax.GradientTransformation:
  """The Newton–Schulz orthogonalization a member's ``arguments`` describe
  (on the device: its state, if any, is the momentum's business)."""
  return orthogonalize_lib.orthogonalizer(
    solver_of(arguments),
    views_of(arguments),
    execution_of(arguments, state_memory_kind=None),
  ).transform
