"""Timing helpers: interleaved rounds, medians, JSON lines.

Every figure a benchmark reports is a ratio of two things timed in the same
process, round by round, so that the drift of a shared machine cancels.
"""

import json
import statistics
import sys
import time

import jax


def time_once(fn, *args) -> float:
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - start


def interleaved(candidates: dict, rounds: int = 7, warmup: int = 2) -> dict:
  """Median seconds of each ``name: (fn, args)``, timed in alternation."""
  for fn, args in candidates.values():
    for _ in range(warmup):
      jax.block_until_ready(fn(*args))
  samples = {name: [] for name in candidates}
  for _ in range(rounds):
    for name, (fn, args) in candidates.items():
      samples[name].append(time_once(fn, *args))
  return {name: statistics.median(times) for name, times in samples.items()}


def ns_flops(m: int, n: int, steps: int, cubic: bool = False) -> float:
  """``T·(4m²n + 2m³)`` for an m×n matrix, m ≤ n: ``X Xᵀ`` and ``B X`` take
  ``2m²n`` each, ``A A`` ``2m³``, which a cubic schedule (c = 0) skips."""
  m, n = min(m, n), max(m, n)
  return steps * (4 * m * m * n + (0 if cubic else 2 * m**3))


def emit(record: dict) -> None:
  print(json.dumps(record), flush=True)


def quick_flag() -> bool:
  return "--quick" in sys.argv[1:]
