"""Dotted ``key=value`` overrides (verl / Hydra style) as typed dataclass
fields, parsed without ``eval``."""

import dataclasses
import types
import typing
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any


def split_overrides(overrides: Iterable[str]) -> dict[str, str]:
  """``["a.b=1", ...]`` as ``{"a.b": "1", ...}`` (for ``parse_fields``);
  an item without ``=`` or a key raises ``ValueError``."""
  if isinstance(overrides, (str, bytes)):
    raise TypeError(
      f"overrides must be a list of 'key=value' strings, got the "
      f"single string {overrides!r}; wrap it in a list"
    )
  values = {}
  for item in overrides:
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
      raise ValueError(f"override {item!r} is not of the form key=value")
    values[key.strip()] = value.strip()
  return values


def parse_fields(cls, values: Mapping[str, Any]) -> dict[str, Any]:
  """Typed field values of dataclass ``cls`` from names (dotted prefixes
  allowed) to values or strings; an unknown name raises ``ValueError``.

  The one parser of ``key=value`` settings: ``MuonConfig.from_overrides``
  uses it, and so can a run's own config dataclasses. Strings are read as
  the field's type (``int``, ``float``, ``bool`` from true/false, 1/0,
  yes/no or on/off, a ``tuple`` from ``[a,b]`` or ``a,b``, ``None`` from
  none/null for an optional field), never ``eval``'d; other values are
  type-checked. A field set under two prefixes raises.

  Example:
    >>> import dataclasses, optax_muon as om
    >>> @dataclasses.dataclass
    ... class Train:
    ...   steps: int = 100
    ...   progress: bool = True
    >>> om.parse_fields(Train, om.split_overrides(["train.steps=5",
    ...                                            "train.progress=off"]))
    {'steps': 5, 'progress': False}
  """
  hints = typing.get_type_hints(cls)
  known = [f.name for f in dataclasses.fields(cls)]
  fields: dict[str, Any] = {}
  keys: dict[str, str] = {}
  for key, value in _flatten(values).items():
    name = key.rsplit(".", 1)[-1]
    if name not in known:
      raise ValueError(f"unknown field {key!r}; accepted fields: {known}")
    if name in keys and keys[name] != key:
      raise ValueError(
        f"field {name!r} is set twice, as {keys[name]!r} and "
        f"{key!r}; set it once"
      )
    keys[name] = key
    fields[name] = coerce(key, value, hints[name])
  return fields


def _flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """``{"optim": {"lr": 1}}`` as ``{"optim.lr": 1}``."""
  flat = {}
  for key, value in values.items():
    if isinstance(value, Mapping):
      flat.update(_flatten(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _holds_text(hint) -> bool:
  """Whether a field of type ``hint`` holds a string: ``str``, a
  ``Literal``, or a union of those and ``None``."""
  if hint is str or typing.get_origin(hint) is typing.Literal:
    return True
  members = [a for a in typing.get_args(hint) if a is not type(None)]
  return (
    typing.get_origin(hint) in (typing.Union, types.UnionType)
    and bool(members)
    and all(_holds_text(a) for a in members)
  )


def _type_name(hint) -> str:
  return getattr(hint, "__name__", str(hint))


def _is_optional(hint) -> bool:
  return typing.get_origin(hint) in (
    typing.Union,
    types.UnionType,
  ) and type(None) in typing.get_args(hint)


def _unset(value, parse_strings: bool = True) -> bool:
  """Whether ``value`` says "no value": ``None``, or its text."""
  texts = ("none", "null", "") if parse_strings else ()
  return value is None or (isinstance(value, str) and value.lower() in texts)


def _boolean(name: str, value: Any) -> bool:
  if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
    return value.lower() in _TRUE
  if isinstance(value, bool):
    return value
  raise ValueError(
    f"{name}={value!r} is not a bool; accepted: true/false, 1/0, yes/no, on/off"
  )


def _number(name: str, value: Any, hint) -> int | float:
  whole = hint is int
  inexact = whole and isinstance(value, float) and not value.is_integer()
  try:
    if isinstance(value, bool) or inexact:
      raise ValueError
    return hint(value)
  except (TypeError, ValueError):
    kind = "an integer" if whole else "a number"
    raise ValueError(f"{name}={value!r} is not {kind}") from None


def _items(name: str, value: Any, hint, parse_strings: bool) -> tuple:
  """A ``tuple[...]`` field's value: ``[a,b]`` or ``a,b`` text, or a list."""
  if isinstance(value, str):
    value = [v for v in value.strip("[]() ").split(",") if v.strip()]
  args = typing.get_args(hint)
  if len(args) == 2 and args[1] is Ellipsis:  # tuple[int, ...]: any length
    if not isinstance(value, (list, tuple)) or not value:
      raise ValueError(
        f"{name}={value!r} must be one or more values, e.g. [1,2,3]"
      )
    args = (args[0],) * len(value)
  if not isinstance(value, (list, tuple)) or len(value) != len(args):
    raise ValueError(
      f"{name}={value!r} must be {len(args)} numbers, e.g. [0.9,0.999]"
    )
  return tuple(
    coerce(f"{name}[{i}]", v, t, parse_strings)
    for i, (v, t) in enumerate(zip(value, args))
  )


def _text(name: str, value: Any) -> str:
  if not isinstance(value, str):
    raise ValueError(f"{name}={value!r} is not a string")
  return value


def coerce(name: str, value: Any, hint, parse_strings: bool = True) -> Any:
  """``value`` as the field's type; strings are parsed (with
  ``parse_strings``; else a string is accepted only for a string field),
  other types checked."""
  if not parse_strings and isinstance(value, str) and not _holds_text(hint):
    raise ValueError(
      f"{name}={value!r} is a string; give a value of type "
      f"{_type_name(hint)} (strings such as 'true' or "
      "'1e-3' are parsed by MuonConfig.from_overrides and from_dict)"
    )
  if _is_optional(hint):
    if _unset(value, parse_strings):
      return None
    (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
    return coerce(name, value, inner, parse_strings)
  if hint is bool:
    return _boolean(name, value)
  if _unset(value) and value != "":
    raise ValueError(
      f"{name}={value!r} is not accepted: {name} cannot be "
      f"unset; give a value of type {_type_name(hint)}"
    )
  if hint in (int, float):
    return _number(name, value, hint)
  if typing.get_origin(hint) is tuple:
    return _items(name, value, hint, parse_strings)
  if hint is str or typing.get_origin(hint) is typing.Literal:
    return _text(name, value)  # MuonConfig checks a Literal's choice
  return value
