"""The Muon family's shared settings: declared once, handed on by name.

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
why. A member hands its keywords on by name (as ``optax.contrib.muon``
does to its ``scale_by_muon``) and builds its settings objects
(``batched.Solver``, ``Views``, ``Execution``: ``Orthogonalization``) from
its own parameters, once. ``tests/test_family_settings.py`` holds every
member to it: each shared setting is accepted with ``scale_by_muon``'s (or
``muon``'s) default and annotation, unless ``DIFFERENT_DEFAULTS`` or
``NOT_APPLICABLE`` says why not, and reaches what checks it.
"""

import dataclasses
import typing
from collections.abc import Mapping
from typing import Annotated
from typing import Any
from typing import NamedTuple
from typing import TypedDict

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Momentum:
  """A member's momentum settings (``MomentumOptions``, ``mu_dtype``),
  checked when built, each under its keyword's name (momentum's ``style``
  is the family's ``momentum_style``)."""

  beta: types.Numeric
  nesterov: bool
  momentum_style: types.MomentumStyle
  mu_dtype: types.MomentumDtype

  def __post_init__(self):
    _checks.check_choice(
      "momentum_style", self.momentum_style, momentum_lib.MOMENTUM_STYLES
    )
    momentum_lib.canonical_dtype("mu_dtype", self.mu_dtype, quantized=True)

  def transform(self, execution: Execution) -> optax.GradientTransformation:
    """The momentum, its float32 work within ``execution``'s budget."""
    return momentum_lib.momentum(
      self.beta,
      nesterov=self.nesterov,
      style=self.momentum_style,
      dtype=self.mu_dtype,
      memory_budget=execution.memory_budget,
    )


class Orthogonalization(NamedTuple):
  """The settings objects of a member's orthogonalization, built (and
  checked) once from its keywords; the orthogonalize and the shape scale
  after it both read them, so the plan of each leaf
  (``parallel.plan``) is decided once for both."""

  solver: batched.Solver
  views: Views
  execution: Execution

  @classmethod
  def of(
    cls,
    *,
    coefficients: types.Coefficients,
    steps: types.Steps,
    precision: types.Precision,
    method: types.Method,
    preconditioning: types.Preconditioning,
    dimension_numbers: types.PerLeaf,
    split_qkv: types.PerLeaf,
    split_gate_up: types.PerLeaf,
    sharding: TensorParallel | None,
    memory_budget: int | None,
    state_memory_kind: types.MemoryKind | None = None,
  ) -> "Orthogonalization":
    """The three objects from a member's keywords, each keyword to the one
    object that takes it (``precision`` sets the solver's matmuls)."""
    return cls(
      batched.Solver(
        coefficients=coefficients,
        steps=steps,
        precision=precision,
        method=method,
        preconditioning=preconditioning,
      ),
      Views(
        dimension_numbers=dimension_numbers,
        split_qkv=split_qkv,
        split_gate_up=split_gate_up,
      ),
      Execution(
        sharding=sharding,
        memory_budget=memory_budget,
        state_memory_kind=state_memory_kind,
      ),
    )

  def orthogonalizer(self) -> orthogonalize_lib.Orthogonalizer:
    """The Newton–Schulz orthogonalization of each leaf's matrices: the
    transform and its ``run``."""
    return orthogonalize_lib.orthogonalizer(
      self.solver, self.views, self.execution
    )

  def orthogonalize(self) -> optax.GradientTransformation:
    """The Newton–Schulz orthogonalization of each leaf's matrices."""
    return self.orthogonalizer().transform

  def scale_by_shape(
    self, mode: types.ScaleMode
  ) -> optax.GradientTransformation:
    """Each matrix scaled by the shape it was orthogonalized at."""
    return scaling.shape_scaler(mode, self.views, self.solver, self.execution)


def layout_dimension_numbers(layout: Any, dimension_numbers: Any) -> Any:
  """A direction's dimension numbers: its ``dimension_numbers``, or those of
  its ``layout`` (``om.infer_layout``; not both)."""
  return from_layout(layout, None, dimension_numbers)[1]


def extra_scale(
  scale_mode: types.ScaleMode,
  extra_scale_factor: types.Numeric | None,
  match_adamw_update_rms: bool,
  adamw_beta1: types.Numeric,
) -> Any:
  """The factor after the shape scale (``extra_scale_factor``, or AdamW's
  RMS from ``adamw_beta1``), ``scale_mode`` checked under its name."""
  _checks.check_choice("scale_mode", scale_mode, shape_scale.SCALE_MODES)
  return scaling.resolve_extra_scale_factor(
    extra_scale_factor, match_adamw_update_rms, adamw_beta1
  )


def scalar_options(
  scalar_kwargs: Mapping[str, Any],
) -> ScalarOptimizerOptions:
  """A member's ``**scalar_kwargs``, checked (a keyword there that is not
  ``ScalarOptimizerOptions``' is a ``TypeError``, as Python's own), with
  the group's defaults for the keywords not given."""
  declared = signatures.declared(ScalarOptimizerOptions)
  for name in scalar_kwargs:
    if name not in declared:
      raise TypeError(
        f"got an unexpected keyword argument {name!r} (**scalar_kwargs "
        f"takes {', '.join(declared)})"
      )
  return typing.cast(
    ScalarOptimizerOptions,
    {
      name: scalar_kwargs.get(name, default)
      for name, (_, default) in declared.items()
    },
  )
