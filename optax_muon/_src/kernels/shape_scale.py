"""The factor an orthogonalized update is scaled by, from its matrix's shape,
and the RMS of an AdamW update it can be matched to."""

import math
import typing

import jax
import jax.numpy as jnp
import numpy as np

from optax_muon._src.base import checks as _checks
from optax_muon._src.base import types

SCALE_MODES = typing.get_args(types.ScaleMode)


def scale_factor(
  fan_out: int, fan_in: int, mode: types.ScaleMode = "spectral"
) -> float:
  """The factor an orthogonalized ``fan_in × fan_out`` update is scaled by.

  * ``"spectral"``: ``√max(fan_out, fan_in)`` (Megatron-Core default; with
    ``extra_scale_factor`` 0.2 the update RMS is ≈ 0.2, Moonlight);
  * ``"shape_scaling"``: ``√max(1, fan_out / fan_in)`` (Keller Jordan);
  * ``"unit_rms_norm"``: ``√(fan_out / fan_in)`` (Bernstein's RMS→RMS norm).

  Args:
    fan_out: output dimension of the matrix.
    fan_in: input (reduction) dimension.
    mode: one of ``SCALE_MODES``.

  Returns:
    The factor, a Python float.
  """
  _checks.check_choice("mode", mode, SCALE_MODES)
  for name, value in (("fan_out", fan_out), ("fan_in", fan_in)):
    _checks.check_int(name, value, minimum=1)
  if mode == "spectral":
    return math.sqrt(max(fan_out, fan_in))
  if mode == "shape_scaling":
    return math.sqrt(max(1.0, fan_out / fan_in))
  return math.sqrt(fan_out / fan_in)


def adamw_rms_match_factor(beta1: float | jax.Array) -> float | jax.Array:
  r"""``√((1 − β₁) / (1 + β₁))``: the RMS of an AdamW update at steady state.

  Multiplying a spectral-scaled Muon update by it makes its RMS equal AdamW's,
  so an AdamW learning rate carries over (0.229416 at β₁ = 0.9).

  Args:
    beta1: AdamW's first-moment decay, in ``[0, 1)``; may be traced.

  Returns:
    A float, or an array when ``beta1`` is traced.

  References:
    Liu et al., `Muon is Scalable for LLM Training
    <https://arxiv.org/abs/2502.16982>`_, 2025
  """
  _checks.check_range("adamw_beta1", beta1, 0.0, 1.0)
  if _checks.is_traced(beta1):
    return jnp.sqrt((1 - beta1) / (1 + beta1))
  beta1 = float(np.asarray(beta1))
  return math.sqrt((1 - beta1) / (1 + beta1))
