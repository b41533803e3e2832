"""Wall seconds of the fast tier, its programs compiled unoptimized (what
tests/conftest.py sets) against optimized, run alternately.

    python benchmarks/fast_tier.py [--rounds N] [-- PYTEST ARGS...]

Each round runs ``python -m pytest -n 2 -m "not integration and not slow"``
twice from the repository root: with conftest's default (XLA's backend
optimizations off in the test processes) and with
``JAX_DISABLE_MOST_OPTIMIZATIONS=0`` (every program optimized, as before).
Prints one JSON line per run and, last, the median seconds of each and their
ratio (unoptimized / optimized). A run that fails is reported and stops the
benchmark: a time is only worth comparing for a tier that passed.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _timing import emit  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..")
FAST_TIER = ["-n", "2", "-m", "not integration and not slow", "-q"]
SETTINGS = {
  "unoptimized": {},  # conftest.py's default
  "optimized": {"JAX_DISABLE_MOST_OPTIMIZATIONS": "0"},
}


def run(setting: str, pytest_args: list[str]) -> float:
  """Seconds of one fast-tier run under ``setting``; exits if it failed."""
  environment = {
    name: value
    for name, value in os.environ.items()
    if name != "JAX_DISABLE_MOST_OPTIMIZATIONS"
  }
  environment.update(SETTINGS[setting])
  start = time.perf_counter()
  result = subprocess.run(
    [sys.executable, "-m", "pytest", *FAST_TIER, *pytest_args],
    cwd=ROOT,
    env=environment,
    capture_output=True,
    text=True,
  )
  seconds = time.perf_counter() - start
  summary = result.stdout.strip().splitlines()[-1:] or [result.stderr[-500:]]
  emit({"setting": setting, "seconds": round(seconds, 1), "pytest": summary[0]})
  if result.returncode != 0:
    sys.exit(f"the fast tier failed under {setting!r}: {summary[0]}")
  return seconds


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=1)
  parser.add_argument("pytest_args", nargs="*")
  args = parser.parse_args()
  seconds = {setting: [] for setting in SETTINGS}
  for _ in range(args.rounds):
    for setting in SETTINGS:
      seconds[setting].append(run(setting, args.pytest_args))
  medians = {s: statistics.median(t) for s, t in seconds.items()}
  emit(
    {
      "benchmark": "fast_tier",
      "rounds": args.rounds,
      **{f"{s}_seconds": round(t, 1) for s, t in medians.items()},
      "ratio": round(medians["unoptimized"] / medians["optimized"], 3),
    }
  )


if __name__ == "__main__":
  main()
