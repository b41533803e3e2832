"""Public signatures generated from keyword groups declared once.

A family's shared keywords are declared once, in ``TypedDict`` groups whose
entries carry their type and default::

  class Momentum(TypedDict, total=False):
    beta: Annotated[Numeric, Default(0.95)]

A member is written ``def member(learning_rate, *, its_own=1, **options:
Unpack[Group])`` and decorated with ``with_signature(order)``: users see
(``inspect``, ``help``, the docs) its positional parameters, then its
keyword-only ones in ``order`` — its own from the ``def``, the shared ones
from the group — and last, in the group's order, any keyword of the group
that ``order`` does not name. So a keyword added to a group reaches every
member that takes the group, and a call written before still works (``order``
keeps each member's recorded order). A call binds as Python binds it (an
unknown keyword is a ``TypeError`` naming it), and the member receives every
keyword, its default filled in. A type checker reads the ``Unpack``: a
wrong type at a call is its error.
"""

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any
from typing import ParamSpec
from typing import TypeVar

Parameters = ParamSpec("Parameters")
Result = TypeVar("Result")

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


def _group_of(signature: inspect.Signature, name: str) -> Any:
  """The ``TypedDict`` of a function's ``**options: Unpack[...]``."""
  for parameter in signature.parameters.values():
    if parameter.kind is inspect.Parameter.VAR_KEYWORD:
      group = typing.get_args(parameter.annotation)
      if len(group) == 1:
        return group[0]
  raise TypeError(f"{name} takes no **options: Unpack[group]")


def with_signature(
  order: str, *, rest: tuple[str, Any] | None = None, **defaults: Any
) -> Callable[[Callable[Parameters, Result]], Callable[Parameters, Result]]:
  """The decorated member's public signature, generated (see the module).

  Args:
    order: the keyword-only parameters' names, space-separated, in the order
      users have seen them; each is the member's own or its group's.
    rest: ``(name, subgroup)``: the subgroup's keywords (part of the
      group) are shown as one last ``**name`` parameter (``**scalar_kwargs``:
      the AdamW group's), taken when given, without defaults; another
      keyword there is a ``TypeError``.
    **defaults: the member's own default for a group's keyword (its
      reference implementation's, said in ``settings.DIFFERENT_DEFAULTS``).

  Returns:
    A decorator; the function it returns has ``__signature__`` set.
  """

  def decorate(
    function: Callable[Parameters, Result],
  ) -> Callable[Parameters, Result]:
    own = inspect.signature(function)
    shared = declared(_group_of(own, function.__name__))
    handed_on = set(declared(rest[1])) if rest is not None else set()
    shared = {name: shared[name] for name in shared if name not in handed_on}
    keyword_only = {
      name: parameter
      for name, parameter in own.parameters.items()
      if parameter.kind is _KEYWORD_ONLY
    }
    names = order.split()
    problems = {
      "neither its own nor its group's": set(names) - {*keyword_only, *shared},
      "its own and its group's": set(keyword_only) & set(shared),
      "its own but not in the order": set(keyword_only) - set(names),
      "a default for no keyword of its group": set(defaults) - set(shared),
    }
    for problem, found in problems.items():
      if found:
        raise TypeError(f"{function.__name__}: {sorted(found)}: {problem}")
    names += [name for name in shared if name not in names]
    parameters = [
      parameter
      for parameter in own.parameters.values()
      if parameter.kind
      in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
      )
    ]
    for name in names:
      if name in keyword_only:
        parameters.append(keyword_only[name])
        continue
      annotation, default = shared[name]
      parameters.append(
        inspect.Parameter(
          name,
          _KEYWORD_ONLY,
          default=defaults.get(name, default),
          annotation=annotation,
        )
      )
    if rest is not None:
      parameters.append(
        inspect.Parameter(rest[0], inspect.Parameter.VAR_KEYWORD)
      )
    signature = own.replace(parameters=parameters)

    @functools.wraps(function)
    def member(*args: Any, **kwargs: Any) -> Result:
      try:
        bound = signature.bind(*args, **kwargs)
      except TypeError as error:  # named, as Python names a function's
        raise TypeError(f"{function.__name__}() {error}") from None
      if rest is not None:
        for name in set(bound.arguments.get(rest[0], {})) - handed_on:
          raise TypeError(
            f"{function.__name__}() got an unexpected keyword argument {name!r}"
          )
      bound.apply_defaults()
      return function(*bound.args, **bound.kwargs)

    member.__signature__ = signature  # type: ignore[attr-defined]
    return typing.cast(Callable[Parameters, Result], member)

  return decorate
