"""The examples in the optimizers' and ``infer_layout``'s docstrings run and
print what they show."""

import doctest

import pytest

import optax_muon as om
from optax_muon import compat

DOCUMENTED = [
  om.muon,
  om.adaptive_muon,
  om.muon_hyperball,
  om.polargrad,
  om.scion,
  om.muon_bp,
  compat.torch_muon,
  om.infer_layout,
  om.parse_fields,
  om.dion,
]


@pytest.mark.parametrize("function", DOCUMENTED, ids=lambda f: f.__name__)
def test_the_docstring_example_runs(function):
  tests = doctest.DocTestFinder().find(function, globs={})
  assert tests and tests[0].examples, f"{function.__name__} has no example"
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
  for test in tests:
    runner.run(test)
  assert runner.failures == 0, f"{function.__name__}: see the output above"
