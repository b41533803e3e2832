"""The Muon family's shared settings: declared once, forwarded one way.

``muon``, ``adaptive_muon``, ``polargrad``, ``dion``, ``dion2``,
``nordion2`` (and their ``scale_by_*`` directions) take the same keywords
for the same things. Each keyword is declared once, with its type and
default, in a ``TypedDict`` group below (``MomentumOptions``,
``NewtonSchulzOptions``, ...); ``MEMBER_GROUPS`` says which group each
member takes, and the member writes each of its keywords out in its
``def`` with the group's type and default (``signatures.disagreements``,
held by ``tests/test_signatures.py``: a keyword added to a group is
reported for every member that lacks it). This module also says
where a member's default differs or a setting does not apply to it, and
why; and ``forward(callee, arguments)`` hands on exactly the keywords a
callee takes. ``tests/test_family_settings.py`` holds every member to it:
each shared setting is accepted with ``scale_by_muon``'s (or ``muon``'s)
default and annotation, unless ``DIFFERENT_DEFAULTS`` or
``NOT_APPLICABLE`` says why not.
"""

import inspect
import typing
from collections.abc import Callable
from collections.abc import Mapping
from typing import Annotated
from typing import Any
from typing import NamedTuple
from typing import TypedDict
from typing import TypeVar

import optax

from optax_muon._src.base import checks as _checks
from optax_muon._src.base import signatures
from optax_muon._src.base import types
from optax_muon._src.base.signatures import Default
from optax_muon._src.kernels import batched
from optax_muon._src.kernels import shape_scale
from optax_muon._src.parallel.execution import Execution
from optax_muon._src.parallel.tensor_parallel import TensorParallel
from optax_muon._src.transforms import momentum as momentum_lib
from optax_muon._src.transforms import orthogonalize as orthogonalize_lib
from optax_muon._src.transforms import scaling
from optax_muon._src.views.layout import from_layout
from optax_muon._src.views.matrix_views import Views

Options = TypeVar("Options")


class MomentumOptions(TypedDict, total=False):
  """The momentum's keywords (``momentum``)."""

  beta: Annotated[types.Numeric, Default(0.95)]
  nesterov: Annotated[bool, Default(True)]
  momentum_style: Annotated[types.MomentumStyle, Default("ema")]


class MomentumDtypeOptions(TypedDict, total=False):
  """How the momentum is stored (Dion's and Dion2's sums too)."""

  mu_dtype: Annotated[types.MomentumDtype, Default(None)]


class NewtonSchulzOptions(TypedDict, total=False):
  """The Newton–Schulz iteration's keywords (``batched.Solver``)."""

  coefficients: Annotated[types.Coefficients, Default("quintic")]
  steps: Annotated[types.Steps, Default(5)]
  method: Annotated[types.Method, Default("standard")]
  preconditioning: Annotated[types.Preconditioning, Default("frobenius")]


class ExecutionOptions(TypedDict, total=False):
  """How and where the matrices are worked on (``Execution``; ``precision``
  also sets the solver's matmuls)."""

  precision: Annotated[types.Precision, Default("highest")]
  sharding: Annotated[TensorParallel | None, Default(None)]
  memory_budget: Annotated[int | None, Default(None)]


class ViewOptions(TypedDict, total=False):
  """How a leaf is seen as matrices (``Views``)."""

  dimension_numbers: Annotated[types.PerLeaf, Default(None)]
  split_qkv: Annotated[types.PerLeaf, Default(None)]
  split_gate_up: Annotated[types.PerLeaf, Default(None)]
  layout: Annotated[Any, Default(None)]


class ShapeScaleOptions(TypedDict, total=False):
  """The factor after the direction (``scale_by_shape``, ``extra``)."""

  scale_mode: Annotated[types.ScaleMode, Default("spectral")]
  extra_scale_factor: Annotated[types.Numeric | None, Default(None)]
  match_adamw_update_rms: Annotated[bool, Default(False)]


class RoutingOptions(TypedDict, total=False):
  """Which leaves, their decay, where the state lives (``route``)."""

  labels: Annotated[types.PerLeaf, Default(None)]
  weight_decay: Annotated[types.Numeric, Default(0.0)]
  weight_decay_mask: Annotated[types.PerLeaf, Default(None)]
  state_memory_kind: Annotated[types.MemoryKind | None, Default(None)]


class ScalarOptimizerOptions(TypedDict, total=False):
  """The AdamW (or Lion) group of the other leaves (``route``)."""

  scalar_optimizer: Annotated[types.ScalarOptimizer, Default("adam")]
  adam_learning_rate: Annotated[optax.ScalarOrSchedule | None, Default(None)]
  adam_b1: Annotated[types.Numeric, Default(0.9)]
  adam_b2: Annotated[types.Numeric, Default(0.999)]
  adam_eps: Annotated[types.Numeric, Default(1e-8)]
  adam_weight_decay: Annotated[types.Numeric, Default(0.0)]
  adam_weight_decay_mask: Annotated[types.PerLeaf, Default(None)]


# What each member takes: its group's keywords (and its own), written out in
# its signature (MEMBER_GROUPS).
class OrthogonalizedOptions(
  NewtonSchulzOptions, ExecutionOptions, ViewOptions, total=False
):
  """Newton–Schulz of each leaf's matrices."""


class MuonDirectionOptions(
  MomentumOptions,
  MomentumDtypeOptions,
  OrthogonalizedOptions,
  ShapeScaleOptions,
  total=False,
):
  """``scale_by_muon``'s and ``scale_by_adaptive_muon``'s."""


class MuonOptions(
  MuonDirectionOptions, RoutingOptions, ScalarOptimizerOptions, total=False
):
  """``muon``'s and ``adaptive_muon``'s."""


class PolarGradDirectionOptions(
  MomentumOptions, MomentumDtypeOptions, OrthogonalizedOptions, total=False
):
  """``scale_by_polargrad``'s (its length is ⟨O, u⟩: no shape scale)."""


class PolarGradOptions(
  PolarGradDirectionOptions, RoutingOptions, ScalarOptimizerOptions, total=False
):
  """``polargrad``'s."""


class Dion2DirectionOptions(
  MomentumDtypeOptions, OrthogonalizedOptions, ShapeScaleOptions, total=False
):
  """``scale_by_dion2``'s (its momentum is a sum: no momentum keywords)."""


class Dion2Options(
  Dion2DirectionOptions, RoutingOptions, ScalarOptimizerOptions, total=False
):
  """``dion2``'s and ``nordion2``'s."""


class DionDirectionOptions(
  MomentumDtypeOptions,
  ExecutionOptions,
  ViewOptions,
  ShapeScaleOptions,
  total=False,
):
  """``scale_by_dion``'s (a QR, no Newton–Schulz)."""


class DionOptions(
  DionDirectionOptions, RoutingOptions, ScalarOptimizerOptions, total=False
):
  """``dion``'s."""


# Each member's group: its ``def`` takes every keyword of it, with its type
# and default (or its own, DIFFERENT_DEFAULTS); the optimizers of the Dion
# family and PolarGrad take ScalarOptimizerOptions in ``**scalar_kwargs``
# (SCALAR_KWARGS).
MEMBER_GROUPS: dict[str, Any] = {
  "scale_by_muon": MuonDirectionOptions,
  "muon": MuonOptions,
  "scale_by_adaptive_muon": MuonDirectionOptions,
  "adaptive_muon": MuonOptions,
  "scale_by_polargrad": PolarGradDirectionOptions,
  "polargrad": PolarGradOptions,
  "scale_by_dion2": Dion2DirectionOptions,
  "dion2": Dion2Options,
  "nordion2": Dion2Options,
  "scale_by_dion": DionDirectionOptions,
  "dion": DionOptions,
  # the orthogonalization alone takes the iteration's keywords too
  "orthogonalize": NewtonSchulzOptions,
}
SCALAR_KWARGS = ("polargrad", "dion2", "nordion2", "dion")


def names(group: Any) -> tuple[str, ...]:
  """A group's keywords, in declaration order."""
  return tuple(signatures.declared(group))


def pick(group: type[Options], options: Mapping[str, Any]) -> Options:
  """The entries of ``options`` that ``group`` declares."""
  return typing.cast(
    Options, {name: options[name] for name in names(group) if name in options}
  )


MOMENTUM = names(MomentumOptions) + names(MomentumDtypeOptions)
NEWTON_SCHULZ = names(NewtonSchulzOptions)
VIEWS = names(ViewOptions)
SHAPE_SCALE = names(ShapeScaleOptions)
# the direction's keywords: scale_by_muon and its siblings take these
DIRECTION = names(MuonDirectionOptions)
# the routing's keywords: which leaves, the AdamW (or Lion) group, the
# decay, where the state lives (``route``)
ROUTING = names(RoutingOptions) + names(ScalarOptimizerOptions)

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
  **dict.fromkeys(NEWTON_SCHULZ, _NO_NEWTON_SCHULZ),
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
  """The Newton–Schulz solver a member's ``arguments`` describe: its
  ``NewtonSchulzOptions`` and ``precision`` (mypy holds each of the group's
  keywords to a ``Solver`` field)."""
  return batched.Solver(
    **pick(NewtonSchulzOptions, arguments), precision=arguments["precision"]
  )


def views_of(arguments: Mapping[str, Any]) -> Views:
  """The matrix views a member's ``arguments`` describe."""
  return Views(**forward(Views, arguments))


def execution_of(arguments: Mapping[str, Any], **overrides: Any) -> Execution:
  """Where and within which budget a member's ``arguments`` (then
  ``overrides``) run the orthogonalization."""
  return Execution(**forward(Execution, arguments, **overrides))


class Orthogonalization(NamedTuple):
  """The settings objects of a member's orthogonalization, built (and
  checked) once from its keywords; the orthogonalize and the shape scale
  after it both read them, so the plan of each leaf
  (``parallel.plan``) is decided once for both."""

  solver: batched.Solver
  views: Views
  execution: Execution

  def orthogonalize(self) -> optax.GradientTransformation:
    """The Newton–Schulz orthogonalization of each leaf's matrices."""
    return orthogonalize_lib.orthogonalizer(
      self.solver, self.views, self.execution
    ).transform

  def scale_by_shape(
    self, mode: types.ScaleMode
  ) -> optax.GradientTransformation:
    """Each matrix scaled by the shape it was orthogonalized at."""
    return scaling.shape_scaler(mode, self.views, self.solver, self.execution)


def orthogonalization_of(
  arguments: Mapping[str, Any], **overrides: Any
) -> Orthogonalization:
  """The orthogonalization a member's ``arguments`` (then ``overrides`` of
  its ``Execution``) describe."""
  return Orthogonalization(
    solver_of(arguments),
    views_of(arguments),
    execution_of(arguments, **overrides),
  )


def orthogonalize_of(
  arguments: Mapping[str, Any],
) -> optax.GradientTransformation:
  """The Newton–Schulz orthogonalization a member's ``arguments`` describe
  (on the device: its state, if any, is the momentum's business)."""
  return orthogonalization_of(arguments, state_memory_kind=None).orthogonalize()


def arguments_of(
  local_values: Mapping[str, Any], **overrides: Any
) -> dict[str, Any]:
  """A member's keywords as one mapping: its ``locals()`` (its
  ``**scalar_kwargs``, if any, among them: a keyword there that is not
  ``ScalarOptimizerOptions``' is a ``TypeError``, as Python's own), then
  ``overrides``."""
  values = dict(local_values)
  scalar = values.pop("scalar_kwargs", {})
  for name in scalar:
    if name not in names(ScalarOptimizerOptions):
      raise TypeError(
        f"got an unexpected keyword argument {name!r} (**scalar_kwargs "
        f"takes {', '.join(names(ScalarOptimizerOptions))})"
      )
  return {**values, **scalar, **overrides}


def adam_b1_of(arguments: Mapping[str, Any]) -> Any:
  """AdamW's β₁ among an optimizer-level member's keywords (given directly,
  or in ``**scalar_kwargs``): what ``match_adamw_update_rms`` matches."""
  given = arguments.get("scalar_kwargs") or {}
  return arguments.get("adam_b1", given.get("adam_b1", 0.9))


def routed_arguments(local_values: Mapping[str, Any]) -> dict[str, Any]:
  """An optimizer-level member's keywords (``arguments_of``), its
  ``layout`` read into the labels and dimension numbers it routes by."""
  arguments = arguments_of(local_values, layout=None)
  arguments["labels"], arguments["dimension_numbers"] = from_layout(
    local_values["layout"],
    arguments["labels"],
    arguments["dimension_numbers"],
  )
  return arguments


def direction_arguments(local_values: Mapping[str, Any]) -> dict[str, Any]:
  """A direction's keywords (``arguments_of``), its ``layout`` read into its
  dimension numbers."""
  arguments = arguments_of(local_values, layout=None)
  _, arguments["dimension_numbers"] = from_layout(
    local_values["layout"], None, arguments["dimension_numbers"]
  )
  return arguments


def scaled_direction_arguments(
  local_values: Mapping[str, Any],
) -> tuple[dict[str, Any], Any]:
  """A shape-scaled direction's keywords (``arguments_of``: Muon's,
  AdaptiveMuon's, Dion's, Dion2's), checked under the user's names, its
  ``layout`` read into its dimension numbers; and the factor after the
  shape scale (``extra_scale_factor``, or AdamW's RMS from
  ``adamw_beta1``)."""
  _checks.check_choice(
    "scale_mode", local_values["scale_mode"], shape_scale.SCALE_MODES
  )
  arguments = direction_arguments(local_values)
  extra = scaling.resolve_extra_scale_factor(
    arguments["extra_scale_factor"],
    arguments["match_adamw_update_rms"],
    arguments["adamw_beta1"],
  )
  return arguments, extra
