"""The settings a public optimizer was built with, kept beside what it
returned, so that ``om.describe(params, optimizer=tx)`` describes the
optimizer itself rather than settings restated by hand."""

import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any
from typing import NamedTuple
from typing import TypeVar

Builder = TypeVar("Builder", bound=Callable[..., Any])

# keyed by the returned transformation's update function: a NamedTuple
# cannot carry attributes, and its functions live as long as it does
_BUILT: "weakref.WeakKeyDictionary[Callable, Built]" = (
  weakref.WeakKeyDictionary()
)


class Built(NamedTuple):
  """Which public function built a transformation, with which arguments
  (every parameter of its signature, defaults filled in)."""

  member: str
  arguments: dict[str, Any]


def recorded(builder: Builder) -> Builder:
  """``builder`` that keeps, for what it returns, its name and arguments."""
  signature = inspect.signature(builder)

  @functools.wraps(builder)
  def build(*args, **kwargs):
    tx = builder(*args, **kwargs)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    _BUILT[tx.update] = Built(builder.__name__, dict(bound.arguments))
    return tx

  return build  # type: ignore[return-value]


def wrapped(tx, inner):
  """``tx``, a wrapper around ``inner`` that adds no routing or scale of its
  own (a clip before it, QK-clip after it, host offload), recorded as
  ``inner`` was built."""
  found = built(inner)
  if found is not None:
    _BUILT[tx.update] = found
  return tx


def built(tx) -> Built | None:
  """How ``tx`` was built, if a recorded builder built it."""
  update = getattr(tx, "update", None)
  if update is None:
    return None
  try:
    return _BUILT.get(update)
  except TypeError:  # not weak-referenceable: not one of ours
    return None
