"""The public API is what tests/data/public_api.json recorded: the names of
``optax_muon`` and ``optax_muon.compat`` and every public callable's
signature (names, kinds, defaults; the order of the positional ones). A
user's call keeps working: a signature may only gain keyword-only
parameters with defaults (issue 34: a family member taking a shared setting
it lacked), and its keyword-only ones may be reordered (issue 59). Any other change is a
change users see; rerun ``python tests/test_public_api.py`` to record one on
purpose."""

import inspect
import json
import pathlib

import optax_muon as om
from optax_muon import compat

SNAPSHOT = pathlib.Path(__file__).parent / "data" / "public_api.json"


def _signature(obj) -> list | str:
  if not callable(obj):
    return type(obj).__name__
  try:
    signature = inspect.signature(obj)
  except (TypeError, ValueError):
    return "no signature"
  return [
    f"{parameter.kind.name} {name}"
    + (
      ""
      if parameter.default is inspect.Parameter.empty
      else f" = {parameter.default!r}"
    )
    for name, parameter in signature.parameters.items()
  ]


def public_api() -> dict:
  return {
    "optax_muon": {
      name: _signature(getattr(om, name))
      for name in sorted(om.__all__)
      if name != "compat"
    },
    "optax_muon.compat": {
      name: _signature(getattr(compat, name)) for name in sorted(compat.__all__)
    },
    "optax_muon.__all__": sorted(om.__all__),
    "optax_muon.compat.__all__": sorted(compat.__all__),
  }


def test_the_public_api_is_the_recorded_one():
  recorded = json.loads(SNAPSHOT.read_text())
  current = public_api()
  for module in ("optax_muon.__all__", "optax_muon.compat.__all__"):
    assert current[module] == recorded[module], module
  for module in ("optax_muon", "optax_muon.compat"):
    for name, signature in recorded[module].items():
      now = current[module][name]
      assert _breaks_a_call(signature, now) == [], f"{module}.{name}"


def _breaks_a_call(recorded, now) -> list[str]:
  """What in ``now`` breaks a call written against ``recorded``: a parameter
  gone, changed or (a positional one) moved, or a new one that is not
  keyword-only with a default. Keyword-only parameters compare as a set: a
  call names them, so their order is not part of it."""
  if isinstance(recorded, str) or isinstance(now, str):
    return [] if recorded == now else [f"{recorded} is now {now}"]
  by_name = lambda entry: entry.startswith(("KEYWORD_ONLY ", "VAR_KEYWORD "))
  problems = []
  positional = [entry for entry in recorded if not by_name(entry)]
  if [entry for entry in now if entry in positional] != positional:
    problems.append("a recorded positional parameter is gone, moved or changed")
  gone = {entry for entry in recorded if by_name(entry)} - set(now)
  if gone:
    problems.append(f"gone or changed: {sorted(gone)}")
  for entry in now:
    if entry not in recorded and not (
      entry.startswith("KEYWORD_ONLY ") and " = " in entry
    ):
      problems.append(f"added {entry}")
  return problems


def test_only_an_added_keyword_with_a_default_keeps_calls_working():
  recorded = ["POSITIONAL_OR_KEYWORD lr", "KEYWORD_ONLY beta = 0.95"]
  added = [*recorded, "KEYWORD_ONLY method = 'standard'"]
  assert _breaks_a_call(recorded, added) == []
  keywords = ["KEYWORD_ONLY a = 1", "KEYWORD_ONLY b = 2"]
  # keyword-only parameters are named by a call: their order is free
  assert _breaks_a_call(recorded + keywords, recorded + keywords[::-1]) == []
  two = ["POSITIONAL_OR_KEYWORD lr", "POSITIONAL_OR_KEYWORD b1 = 0.9"]
  assert _breaks_a_call(two, two[::-1]) != []  # positional: order matters
  for broken in (
    [*recorded, "KEYWORD_ONLY method"],  # required
    [*recorded, "POSITIONAL_OR_KEYWORD method = 1"],  # positional
    [recorded[0], "KEYWORD_ONLY beta = 0.9"],  # another default
    recorded[:1],  # removed
  ):
    assert _breaks_a_call(recorded, broken) != [], broken


def test_nothing_but_the_public_names_is_a_package_attribute():
  # modules are private (optax_muon._src); compat is the one public module
  # and integrations the public package of the trainers' adapters (an
  # attribute once imported)
  attributes = {
    name
    for name in vars(om)
    if not name.startswith("_") and inspect.ismodule(getattr(om, name))
  }
  assert attributes <= {"compat", "integrations"}, sorted(attributes)


if __name__ == "__main__":
  SNAPSHOT.write_text(json.dumps(public_api(), indent=1) + "\n")
