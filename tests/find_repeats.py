"""Lists the fast-tier cases that repeat paths other fast cases run.

The fast tier (``-m "not integration and not slow"``) must keep reaching
every line and branch of ``optax_muon`` it reaches, in a few minutes. A
parametrized case is a *repeat* when every line and branch of the library it
reaches, the other fast cases reach too, and its test keeps another case in
the fast tier. This script finds them from per-test branch coverage, heaviest
first (each found repeat leaves the fast tier before the next is judged, so
the tier keeps every path), and prints the ones that take at least
``--min-seconds``; ``tests/repeats.txt`` holds the list conftest.py marks
``integration`` and ``repeat``. Run it again when a heavy parametrized case is added::

  pip install pytest-cov
  python -m pytest -n 2 -m "not integration and not slow" --durations=0 \
    --cov=optax_muon --cov-branch --cov-context=test --cov-report= \
    | tee durations.txt
  python tests/find_repeats.py .coverage durations.txt --min-seconds 2

Durations are best taken from a run without coverage (it adds little here:
the time is XLA's). Only the order and the threshold depend on them.
"""

import argparse
import collections
import re
import sqlite3


def arcs_by_test(coverage_file: str) -> dict[str, set]:
  """Each test's (file, from, to) arcs in coverage's SQLite data."""
  db = sqlite3.connect(coverage_file)
  contexts = dict(db.execute("select id, context from context"))
  files = dict(db.execute("select id, path from file"))
  arcs = collections.defaultdict(set)
  for file, context, start, end in db.execute(
    "select file_id, context_id, fromno, tono from arc"
  ):
    if contexts[context]:  # "" is import time, no test's
      test = contexts[context].rsplit("|", 1)[0]
      arcs[test].add((files[file], start, end))
  return arcs


def seconds_by_test(durations_file: str) -> dict[str, float]:
  """Setup, call and teardown seconds per test, from ``--durations=0``."""
  seconds: dict = collections.defaultdict(float)
  line = re.compile(r"\s*([\d.]+)s (?:setup|call|teardown)\s+(\S+)")
  with open(durations_file) as lines:
    for match in filter(None, map(line.match, lines)):
      seconds[match[2]] += float(match[1])
  return seconds


def repeats(arcs, seconds, min_seconds: float) -> list[str]:
  """The repeats of at least ``min_seconds``, heaviest first."""
  reached_by = collections.Counter(a for test in arcs.values() for a in test)
  function = lambda test: test.split("[", 1)[0]
  fast_cases = collections.Counter(function(test) for test in arcs)
  found = []
  for test in sorted(arcs, key=lambda t: (-seconds.get(t, 0.0), t)):
    if seconds.get(test, 0.0) < min_seconds:
      break
    if "[" not in test or fast_cases[function(test)] < 2:
      continue
    if all(reached_by[a] > 1 for a in arcs[test]):
      reached_by.subtract(arcs[test])
      fast_cases[function(test)] -= 1
      found.append(test)
  return found


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("coverage_file")
  parser.add_argument("durations_file")
  parser.add_argument("--min-seconds", type=float, default=2.0)
  args = parser.parse_args()
  seconds = seconds_by_test(args.durations_file)
  found = repeats(arcs_by_test(args.coverage_file), seconds, args.min_seconds)
  for test in sorted(found):
    print(test)
  total = sum(seconds[test] for test in found)
  print(f"# {len(found)} cases, {total:.0f} s of test time", flush=True)


if __name__ == "__main__":
  main()
