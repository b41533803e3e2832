"""The family's public signatures are generated from keyword groups declared
once (``base/signatures.py``, the groups in ``optimizers/settings.py``): a
keyword added to a group reaches every member that takes the group, last
and with its default, so no call written before breaks; and every
Newton–Schulz keyword a member (or a MuonConfig field) is given reaches
the solver that runs it."""

import dataclasses
import functools
import inspect
from typing import Annotated
from typing import TypedDict
from typing import Unpack

import pytest

import optax_muon as om
from optax_muon._src.base.signatures import Default
from optax_muon._src.base.signatures import with_signature
from optax_muon._src.kernels import batched


class Solving(TypedDict, total=False):
  steps: Annotated[int, Default(5)]
  precision: Annotated[str, Default("highest")]


class SolvingGrown(Solving, total=False):
  ns_dtype: Annotated[str | None, Default(None)]


class Scalars(TypedDict, total=False):
  adam_b1: Annotated[float, Default(0.9)]


class SolvingAndScalars(Solving, Scalars, total=False):
  pass


def _member(group, order="precision own steps", **defaults):
  @with_signature(order, **defaults)
  def member(learning_rate, *, own: int = 1, **options: Unpack[group]):  # type: ignore[valid-type]
    return learning_rate, own, options

  return member


def _listed(function) -> list[str]:
  return [
    f"{p.kind.name} {name} = {p.default!r}"
    for name, p in inspect.signature(function).parameters.items()
  ]


def test_the_signature_follows_the_order_with_the_groups_defaults():
  member = _member(Solving)
  assert _listed(member) == [
    "POSITIONAL_OR_KEYWORD learning_rate = <class 'inspect._empty'>",
    "KEYWORD_ONLY precision = 'highest'",
    "KEYWORD_ONLY own = 1",
    "KEYWORD_ONLY steps = 5",
  ]
  # the member receives every keyword, defaults filled in
  assert member(0.1, steps=3) == (0.1, 1, {"steps": 3, "precision": "highest"})


def test_a_keyword_added_to_a_group_comes_last_and_reaches_the_member():
  before, after = _member(Solving), _member(SolvingGrown)
  assert _listed(after) == [*_listed(before), "KEYWORD_ONLY ns_dtype = None"]
  assert after(0.1, ns_dtype="bfloat16")[2]["ns_dtype"] == "bfloat16"
  assert after(0.1)[2]["ns_dtype"] is None


def test_a_member_default_and_a_rest_parameter():
  member = _member(SolvingAndScalars, rest=("scalar_kwargs", Scalars), steps=2)
  assert _listed(member)[1:] == [
    "KEYWORD_ONLY precision = 'highest'",
    "KEYWORD_ONLY own = 1",
    "KEYWORD_ONLY steps = 2",
    "VAR_KEYWORD scalar_kwargs = <class 'inspect._empty'>",
  ]
  # the rest's keywords are taken when given, without defaults
  assert member(0.1, adam_b1=0.5)[2] == {
    "precision": "highest",
    "steps": 2,
    "adam_b1": 0.5,
  }
  assert "adam_b1" not in member(0.1)[2]


def test_a_call_binds_as_python_binds_it():
  member = _member(Solving)
  with pytest.raises(TypeError, match="bogus"):
    member(0.1, bogus=1)
  with pytest.raises(TypeError):
    member(0.1, "highest")  # keyword-only
  with pytest.raises(
    TypeError, match=r"^muon\(\) got an unexpected .* 'bogus'"
  ):
    om.muon(0.1, bogus=1)
  with pytest.raises(TypeError, match="memory_budgett"):
    om.dion2(0.1, memory_budgett=1)


@pytest.mark.parametrize(
  "order, defaults, problem",
  [
    ("precision own steps stepz", {}, "neither its own nor its group's"),
    ("precision steps", {}, "its own but not in the order"),
    ("precision own steps", {"beta": 0.9}, "a default for no keyword"),
  ],
)
def test_a_wrong_declaration_is_refused_when_the_member_is_defined(
  order, defaults, problem
):
  with pytest.raises(TypeError, match=problem):
    _member(Solving, order, **defaults)


NEWTON_SCHULZ = {
  "coefficients": "polar_express",
  "steps": 3,
  "method": "gram",
  "preconditioning": "aol",
  "precision": "high",
}


@pytest.fixture
def solvers(monkeypatch):
  """The settings of every ``batched.Solver`` built while the test runs."""
  built = []

  class Recorded(batched.Solver):
    def __post_init__(self):
      built.append({name: getattr(self, name) for name in NEWTON_SCHULZ})
      super().__post_init__()

  monkeypatch.setattr(batched, "Solver", Recorded)
  return built


def _directions():
  return {
    "scale_by_muon": om.scale_by_muon,
    "scale_by_muon/8-bit": functools.partial(
      om.scale_by_muon, mu_dtype=om.QuantizedMomentum(8)
    ),
    "scale_by_adaptive_muon": om.scale_by_adaptive_muon,
    "scale_by_polargrad": om.scale_by_polargrad,
    "scale_by_dion2": om.scale_by_dion2,
  }


def _optimizers():
  return {
    name: functools.partial(getattr(om, name), 0.01)
    for name in (
      "muon",
      "adaptive_muon",
      "polargrad",
      "dion2",
      "nordion2",
      "muon_bp",
      "scion",
      "muon_hyperball",
    )
  }


@pytest.mark.parametrize(
  "name", [*_directions(), *_optimizers()], ids=lambda name: name
)
def test_every_newton_schulz_keyword_reaches_the_solver(name, solvers):
  # the solvers are built with the transform (a bad setting raises there)
  {**_directions(), **_optimizers()}[name](**NEWTON_SCHULZ)
  assert solvers and all(solver == NEWTON_SCHULZ for solver in solvers)


@dataclasses.dataclass(frozen=True)
class ConfigWithMoreFields(om.MuonConfig):
  # what a new keyword's MuonConfig field looks like: ``muon_<keyword>``
  muon_method: str = "gram"
  muon_preconditioning: str = "aol"


@pytest.mark.parametrize("optimizer", ["muon", "adaptive_muon", "dion2"])
def test_a_config_field_named_for_a_keyword_reaches_the_solver(
  optimizer, solvers
):
  ConfigWithMoreFields(optimizer=optimizer, muon_num_ns_steps=3).build(0.01)
  assert solvers
  for solver in solvers:
    assert (solver["method"], solver["preconditioning"], solver["steps"]) == (
      "gram",
      "aol",
      3,
    )
