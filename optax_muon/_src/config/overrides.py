"""Dotted ``key=value`` overrides (verl / Hydra style) as typed dataclass
fields, parsed without ``eval``."""

import dataclasses
import types
import typing
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any


def split_overrides(overrides: Iterable[str]) -> dict[str, str]:
  """``["a.b=1", ...]`` as ``{"a.b": "1", ...}``."""
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
  allowed) to values or strings; an unknown name raises ``ValueError``."""
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
    fields[name] = coerce(name, value, hints[name])
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


def coerce(name: str, value: Any, hint, parse_strings: bool = True) -> Any:
  """``value`` as the field's type; strings are parsed (with
  ``parse_strings``; else a string is accepted only for a string field),
  other types checked."""
  origin = typing.get_origin(hint)
  if not parse_strings and isinstance(value, str) and not _holds_text(hint):
    raise ValueError(
      f"{name}={value!r} is a string; give a value of type "
      f"{getattr(hint, '__name__', hint)} (strings such as 'true' or "
      "'1e-3' are parsed by MuonConfig.from_overrides and from_dict)"
    )
  if origin in (typing.Union, types.UnionType) and type(
    None
  ) in typing.get_args(hint):
    if value is None or (
      parse_strings
      and isinstance(value, str)
      and value.lower() in ("none", "null", "")
    ):
      return None
    (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
    return coerce(name, value, inner, parse_strings)
  if hint is bool:
    if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
      return value.lower() in _TRUE
    if isinstance(value, bool):
      return value
    raise ValueError(f"{name}={value!r} is not a bool; accepted: true/false")
  if value is None or (
    isinstance(value, str) and value.lower() in ("none", "null")
  ):
    raise ValueError(
      f"{name}={value!r} is not accepted: {name} cannot be "
      f"unset; give a value of type {getattr(hint, '__name__', hint)}"
    )
  if hint in (int, float):
    whole = hint is int
    try:
      if isinstance(value, bool) or (
        whole and isinstance(value, float) and not value.is_integer()
      ):
        raise ValueError
      return hint(value)
    except (TypeError, ValueError):
      kind = "an integer" if whole else "a number"
      raise ValueError(f"{name}={value!r} is not {kind}") from None
  if origin is tuple:
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
  if typing.get_origin(hint) is typing.Literal:  # MuonConfig checks the choice
    hint = str
  if hint is str:
    if not isinstance(value, str):
      raise ValueError(f"{name}={value!r} is not a string")
    return value
  return value
