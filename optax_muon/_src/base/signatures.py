"""Keyword groups: the Muon family's shared keywords, declared once.

A family's shared keywords are declared in ``TypedDict`` groups whose
entries carry their type and default::

  class Momentum(TypedDict, total=False):
    beta: Annotated[Numeric, Default(0.95)]

and each member writes its signature out in full (so mypy, pyright, IDEs
and Sphinx read every keyword's type and default from the ``def``).
``disagreements`` says where a member's signature departs from its group:
``tests/test_signatures.py`` holds every member to its group, so a keyword
added to a group is reported, by name, for each member that lacks it.
"""

import dataclasses
import inspect
import typing
from typing import Any

_KEYWORD_ONLY = inspect.Parameter.KEYWORD_ONLY


@dataclasses.dataclass(frozen=True)
class Default:
  """A group entry's default: ``Annotated[type, Default(value)]``."""

  value: Any


def declared(group: Any) -> dict[str, tuple[Any, Any]]:
  """``{name: (annotation, default)}`` of a ``TypedDict`` group's keywords,
  in declaration order (a composite group: its bases' first)."""
  entries = {}
  # a TypedDict's __annotations__ holds its bases' too; read as written
  # (get_type_hints would evaluate optax's forward references)
  for name, hint in group.__annotations__.items():
    defaults = [
      mark
      for mark in getattr(hint, "__metadata__", ())
      if isinstance(mark, Default)
    ]
    if len(defaults) != 1:
      raise TypeError(
        f"{group.__name__}.{name} must be Annotated[type, Default(value)]"
      )
    entries[name] = (hint.__origin__, defaults[0].value)
  return entries


def disagreements(
  function: Any,
  group: Any,
  *,
  rest: Any = None,
  may_differ: typing.Collection[str] = (),
) -> list[str]:
  """Where ``function``'s signature departs from its keyword ``group``.

  Args:
    function: a member (a wrapper made with ``functools.wraps`` is read
      through to the ``def``).
    group: its ``TypedDict`` group.
    rest: a subgroup taken in a last ``**`` parameter annotated
      ``Unpack[rest]`` (the AdamW group's ``**scalar_kwargs``), or None.
    may_differ: keywords whose default is the member's own.

  Returns:
    One line per problem: a group keyword not taken keyword-only, taken
    with another annotation or default; a ``**`` parameter other than
    ``Unpack[rest]``; an empty list where the member agrees.
  """
  parameters = inspect.signature(function).parameters
  handed_on = set(declared(rest)) if rest is not None else set()
  problems = []
  for name, (annotation, default) in declared(group).items():
    if name in handed_on:
      continue
    parameter = parameters.get(name)
    if parameter is None or parameter.kind is not _KEYWORD_ONLY:
      problems.append(f"{name}: not a keyword-only parameter")
      continue
    if parameter.annotation != annotation:
      problems.append(f"{name}: annotated {parameter.annotation}")
    if parameter.default != default and name not in may_differ:
      problems.append(f"{name}: default {parameter.default!r}")
  var_keyword = [
    p for p in parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD
  ]
  if rest is None and var_keyword:
    problems.append(f"**{var_keyword[0].name}: takes any keyword")
  if rest is not None and (
    not var_keyword or typing.get_args(var_keyword[0].annotation) != (rest,)
  ):
    problems.append(f"no **parameter annotated Unpack[{rest.__name__}]")
  return problems
