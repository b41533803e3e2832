"""Argument checks that read concrete values and let traced ones through.

``optax.inject_hyperparams`` turns every numeric argument into an array that is
traced inside ``jit``; such a value cannot be checked, only a concrete one can.
"""

import numbers
from typing import Any

import jax
import numpy as np


def is_traced(value: Any) -> bool:
  return isinstance(value, jax.core.Tracer)


def _as_number(name: str, value: Any) -> float:
  try:
    array = np.asarray(value)
  except Exception as error:  # pylint: disable=broad-except
    raise TypeError(f"{name} must be a number, got {value!r}") from error
  if array.shape != () or not np.issubdtype(array.dtype, np.number):
    raise TypeError(f"{name} must be a scalar number, got {value!r}")
  return float(array)


def check_range(name: str, value: Any, low: float, high: float) -> None:
  """Raises ValueError unless ``low <= value < high``."""
  if is_traced(value):
    return
  number = _as_number(name, value)
  if not low <= number < high:
    raise ValueError(f"{name} must be in [{low}, {high}), got {value!r}")


def check_positive(name: str, value: Any) -> None:
  """Raises ValueError unless ``0 < value < inf`` (traced: accepted)."""
  if is_traced(value):
    return
  number = _as_number(name, value)
  if not 0 < number < np.inf:
    raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def check_int(name: str, value: Any, *, minimum: int) -> None:
  """Raises unless ``value`` is an integer ``>= minimum`` (traced: accepted)."""
  if is_traced(value):
    return
  if isinstance(value, bool) or not (
    isinstance(value, numbers.Integral)
    or (
      hasattr(value, "dtype")
      and np.issubdtype(value.dtype, np.integer)
      and np.ndim(value) == 0
    )
  ):
    raise TypeError(f"{name} must be an integer >= {minimum}, got {value!r}")
  if int(value) < minimum:
    raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_choice(name: str, value: Any, choices) -> None:
  if not isinstance(value, str) or value not in choices:
    raise ValueError(
      f"{name}={value!r} is not accepted; accepted values: {list(choices)}"
    )


def check_fraction(name: str, value: Any) -> None:
  """Raises ValueError unless ``value`` is a number in ``(0, 1]`` (a share
  of rows, slices or rank; a bool is not one)."""
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise ValueError(
      f"{name}={value!r} is not accepted; accepted values: a number in (0, 1]"
    )
  if not 0 < value <= 1:
    raise ValueError(
      f"{name}={value!r} is not accepted; accepted values: (0, 1]"
    )
