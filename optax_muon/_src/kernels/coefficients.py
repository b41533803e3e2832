"""Named Newton–Schulz coefficient schedules and their iteration modes.

Each step of the iteration is ``X <- a X + b (X Xᵀ) X + c (X Xᵀ)² X``. A
schedule is a list of ``(a, b, c)`` tuples plus a mode saying which tuple step
``i`` uses when the number of steps differs from the list's length:

* ``"cycle"``: step ``i`` uses ``tuples[i % len(tuples)]``;
* ``"repeat_last"``: step ``i`` uses ``tuples[min(i, len(tuples) - 1)]``.

The values are those of NVIDIA emerging-optimizers 0.3.0 (the implementation
behind Megatron-Core and verl), copied here so that a clone needs nothing else.
"""

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from optax_muon._src.base import checks as _checks


class CoefficientSet(NamedTuple):
  """A named schedule: its ``(a, b, c)`` tuples, mode and origin."""

  tuples: tuple[tuple[float, float, float], ...]
  mode: str
  source: str


_SIMPLE = (3.4445, -4.775, 2.0315)

COEFFICIENT_SETS: dict[str, CoefficientSet] = {
  "simple": CoefficientSet(
    (_SIMPLE,),
    "cycle",
    "Keller Jordan Muon; optax 'standard'; emerging-optimizers 'simple'",
  ),
  "quintic": CoefficientSet(
    (
      (4.0848, -6.8946, 2.927),
      (3.9505, -6.3029, 2.6377),
      (3.7418, -5.5913, 2.3037),
      (2.8769, -3.1427, 1.2046),
      (2.8366, -3.0525, 1.2012),
    ),
    "cycle",
    "You Jiacheng / leloykun; emerging-optimizers default; optax 'dion'",
  ),
  "polar_express": CoefficientSet(
    (
      (8.2051, -22.9019, 16.4607),
      (4.0664, -2.8612, 0.5184),
      (3.9096, -2.8234, 0.525),
      (3.2856, -2.4153, 0.4853),
      (2.2779, -1.6198, 0.3985),
      (1.8726, -1.2307, 0.3585),
      (1.8564, -1.2132, 0.3568),
      (1.875, -1.25, 0.375),
    ),
    "repeat_last",
    "Amsel et al. 2025 (arXiv 2505.16932), safety factor 1.01 folded in",
  ),
  "polar_express_dion": CoefficientSet(
    (
      # the first tuple carries microsoft/dion's X / (1.02 ‖X‖_F) safety
      # factor: (a / 1.02, b / 1.02³, c / 1.02⁵) of its (8.156554524902461, -22.48329292557795, 15.878769915207462)
      (7.996622083237707, -21.18650907793566, 14.381891134403759),
      (4.042929935166739, -2.808917465908714, 0.5000178451051316),
      (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
      (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
      (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
    ),
    "repeat_last",
    "microsoft/dion polar_express.py (Dion2's default; 5 steps)",
  ),
  "cans": CoefficientSet(
    (
      (8.4703, -25.1081, 18.6293),
      (4.1828, -3.1087, 0.5806),
      (3.9619, -2.9541, 0.563),
      (3.2866, -2.4647, 0.5074),
      (2.2737, -1.6447, 0.4162),
    ),
    "repeat_last",
    "Grishina et al. 2025 (arXiv 2506.10935)",
  ),
  "aol": CoefficientSet(
    (
      (4.0098, -7.0585, 2.4635),
      (3.4585, -5.5479, 2.5959),
      (2.7573, -3.2939, 1.4254),
      (2.7215, -3.0494, 1.3169),
    ),
    "cycle",
    "Turbo-Muon coefficients as shipped by emerging-optimizers",
  ),
  "deepseekv4": CoefficientSet(
    (_SIMPLE,) * 8 + ((2.0, -1.5, 0.5),) * 2,
    "repeat_last",
    "DeepSeek-V4; at 5 steps identical to 'simple'",
  ),
  "cubic5": CoefficientSet(
    (
      (3.3656576, -3.3420992, 0.0),
      (2.5744352, -1.4957376, 0.0),
      (2.5368962, -1.431257, 0.0),
      (2.4418906, -1.276404, 0.0),
      (2.2230472, -0.963065, 0.0),
    ),
    "cycle",
    "relaxed cubic (arXiv 2606.00371); c = 0 skips the A·A product",
  ),
}

DEFAULT_COEFFICIENTS = "quintic"
SCHEDULE_MODES = ("cycle", "repeat_last")

Coefficients = str | Sequence[Sequence[float]] | Sequence[float] | np.ndarray


def resolve_coefficients(coefficients: Coefficients) -> tuple[np.ndarray, str]:
  """Returns the ``(k, 3)`` table of a schedule and its mode.

  Args:
    coefficients: a name from ``COEFFICIENT_SETS``, a single ``(a, b, c)``
      tuple or a list of them (a custom schedule, which cycles).

  Returns:
    ``(table, mode)`` with ``table`` a float64 array of shape ``(k, 3)``.

  Raises:
    ValueError: for an unknown name or a table that is not ``(k, 3)``.
  """
  if isinstance(coefficients, str):
    if coefficients not in COEFFICIENT_SETS:
      raise ValueError(
        f"coefficients={coefficients!r} is not a known schedule; accepted "
        f"names: {sorted(COEFFICIENT_SETS)}, or a list of (a, b, c) tuples."
      )
    named = COEFFICIENT_SETS[coefficients]
    return np.asarray(named.tuples, np.float64), named.mode
  try:
    table = np.asarray(coefficients, np.float64)
  except (TypeError, ValueError) as error:
    raise ValueError(
      f"coefficients must be a name in {sorted(COEFFICIENT_SETS)} or a list "
      f"of (a, b, c) tuples, got {coefficients!r}"
    ) from error
  if table.ndim == 1:
    table = table[None]
  if table.ndim != 2 or table.shape[1] != 3 or table.shape[0] == 0:
    raise ValueError(
      "coefficients as a custom schedule must be (a, b, c) or a non-empty "
      f"list of (a, b, c) tuples, got shape {np.shape(coefficients)}"
    )
  if not np.all(np.isfinite(table)):
    raise ValueError(f"coefficients must be finite, got {table.tolist()}")
  return table, "cycle"


def schedule_index(step, length: int, mode: str, xp=np):
  """Which row of a ``length``-row table step ``step`` uses.

  ``xp`` is ``numpy`` or ``jax.numpy``: the latter for a traced step count.
  """
  if mode == "cycle":
    return step % length
  return xp.minimum(step, length - 1)


def coefficient_schedule(coefficients: Coefficients, steps: int) -> np.ndarray:
  """The ``(steps, 3)`` coefficients each Newton–Schulz step uses.

  Args:
    coefficients: a name from ``COEFFICIENT_SETS`` or a custom list of tuples.
    steps: the number of Newton–Schulz steps, at least 1.

  Returns:
    A float64 array of shape ``(steps, 3)`` with the schedule's mode applied.
  """
  table, mode = resolve_coefficients(coefficients)
  _checks.check_int("steps", steps, minimum=1)
  return table[schedule_index(np.arange(int(steps)), len(table), mode)]
