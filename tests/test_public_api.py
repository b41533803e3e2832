"""The public API is what tests/data/public_api.json recorded: the names of
``optax_muon`` and ``optax_muon.compat`` and every public callable's
signature (names, order, kinds, defaults). A change here is a change users
see; rerun ``python tests/test_public_api.py`` to record one on purpose."""

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
      assert current[module][name] == signature, f"{module}.{name}"


def test_nothing_but_the_public_names_is_a_package_attribute():
  # modules are private (optax_muon._src); compat is the one public module
  attributes = {
    name
    for name in vars(om)
    if not name.startswith("_") and inspect.ismodule(getattr(om, name))
  }
  assert attributes <= {"compat"}, sorted(attributes)


if __name__ == "__main__":
  SNAPSHOT.write_text(json.dumps(public_api(), indent=1) + "\n")
