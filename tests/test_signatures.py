"""The family's public signatures are written out in full, each held to the
keyword group it takes (declared once: ``base/signatures.py``, the groups
and ``MEMBER_GROUPS`` in ``optimizers/settings.py``): a keyword added to a
group is reported, by name, for every member that lacks it; and every
Newton–Schulz keyword a member (or a MuonConfig field) is given reaches
the solver that runs it."""

import dataclasses
import functools
import inspect
import re
from typing import Annotated
from typing import TypedDict
from typing import Unpack

import pytest

import optax_muon as om
from optax_muon._src.base import signatures
from optax_muon._src.base.signatures import Default
from optax_muon._src.kernels import batched
from optax_muon._src.optimizers import settings


def _scalar_rest(name):
  return (
    settings.ScalarOptimizerOptions if name in settings.SCALAR_KWARGS else None
  )


@pytest.mark.parametrize("name", sorted(settings.MEMBER_GROUPS))
def test_every_member_writes_its_groups_keywords_out(name):
  member = getattr(om, name)
  assert (
    signatures.disagreements(
      member,
      settings.MEMBER_GROUPS[name],
      rest=_scalar_rest(name),
      may_differ=settings.DIFFERENT_DEFAULTS.get(name, {}),
    )
    == []
  )
  # the signature is the def's own (none generated at run time), so a type
  # checker reads what users call, every keyword annotated
  raw = inspect.unwrap(member)
  assert "__signature__" not in vars(raw)
  assert inspect.signature(member) == inspect.signature(raw)
  keywords = [
    p.name
    for p in inspect.signature(raw).parameters.values()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
  ]
  assert set(keywords) <= set(raw.__annotations__)
  # and its docstring explains each of them, or names a member (or the
  # scalar optimizer) whose docstring does
  assert [k for k in keywords if not _explained(k, name)] == []


def _explained(keyword, name, seen=()) -> bool:
  doc = inspect.unwrap(getattr(om, name)).__doc__ or ""
  if re.search(rf"(?<![\w.]){keyword}(?!\w)", doc):
    return True
  return any(
    f"``{other}``" in doc or f"``om.{other}``" in doc
    for other in settings.MEMBER_GROUPS
    if other not in (name, *seen) and _explained(keyword, other, (*seen, name))
  )


class Solving(TypedDict, total=False):
  steps: Annotated[int, Default(5)]
  precision: Annotated[str, Default("highest")]


class SolvingGrown(Solving, total=False):
  ns_dtype: Annotated[str | None, Default(None)]


class Scalars(TypedDict, total=False):
  adam_b1: Annotated[float, Default(0.9)]


def _member(learning_rate, *, precision: str = "highest", steps: int = 5):
  return learning_rate, precision, steps


def _with_rest(
  learning_rate,
  *,
  precision: str = "highest",
  steps: int = 2,
  **rest: Unpack[Scalars],
):
  return learning_rate


def test_a_keyword_added_to_a_group_is_reported_for_a_member_without_it():
  assert signatures.disagreements(_member, Solving) == []
  assert signatures.disagreements(_member, SolvingGrown) == [
    "ns_dtype: not a keyword-only parameter"
  ]


def test_a_member_default_a_wrong_type_and_a_rest_parameter():
  assert signatures.disagreements(_with_rest, Solving) == [
    "steps: default 2",
    "**rest: takes any keyword",
  ]
  assert (
    signatures.disagreements(
      _with_rest, Solving, rest=Scalars, may_differ={"steps"}
    )
    == []
  )

  def wrong(learning_rate, *, precision: int = 0, steps: int = 5):
    return learning_rate

  assert signatures.disagreements(wrong, Solving, rest=Scalars) == [
    "precision: annotated <class 'int'>",
    "precision: default 0",
    "no **parameter annotated Unpack[Scalars]",
  ]


def test_a_call_binds_as_python_binds_it():
  with pytest.raises(
    TypeError, match=r"^muon\(\) got an unexpected .* 'bogus'"
  ):
    om.muon(0.1, bogus=1)
  with pytest.raises(TypeError):
    om.muon(0.1, 0.95)  # keyword-only
  # a keyword that is none of dion2's falls in **scalar_kwargs: refused
  with pytest.raises(TypeError, match="memory_budgett"):
    om.dion2(0.1, memory_budgett=1)
  # one of the AdamW group's is taken there
  tx = om.dion2(0.1, adam_b1=0.5)
  assert om._src.base.built.built(tx).arguments["scalar_kwargs"] == {
    "adam_b1": 0.5
  }


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
