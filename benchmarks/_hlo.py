"""Bytes moved by collectives, read from a compiled HLO module's text."""

import re

import numpy as np

COLLECTIVES = (
  "all-gather",
  "all-reduce",
  "all-to-all",
  "collective-permute",
  "reduce-scatter",
)
_BYTES = {
  "f64": 8,
  "s64": 8,
  "u64": 8,
  "f32": 4,
  "s32": 4,
  "u32": 4,
  "bf16": 2,
  "f16": 2,
  "s16": 2,
  "u16": 2,
  "s8": 1,
  "u8": 1,
  "pred": 1,
}
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
# the computations an instruction runs: loops, calls, reductions, and the
# branches of a conditional (the TPU compiler writes branch_computations=,
# the GPU compiler true_computation= / false_computation=)
_CALLEE = re.compile(
  r"(body|condition|calls|to_apply|branch_computations|true_computation"
  r"|false_computation)=(\{[^}]*\}|%?[\w.\-]+)"
)


def _array_bytes(shape_text: str) -> int:
  total = 0
  for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape_text):
    count = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
    total += _BYTES.get(dtype, 4) * count
  return total


def _computations(hlo: str) -> tuple[dict, str | None]:
  """``{name: [lines]}`` and the entry computation's name."""
  bodies: dict = {}
  entry, name = None, None
  for line in hlo.splitlines():
    header = _HEADER.match(line)
    if header:
      name = header.group(1)
      bodies[name] = []
      if line.startswith("ENTRY"):
        entry = name
    elif name is not None:
      bodies[name].append(line)
  return bodies, entry


def _trip_count(line: str, bodies: dict, condition: str) -> int:
  """A while loop's trip count: XLA's ``known_trip_count`` where the backend
  writes it (CPU, GPU), else the bound its condition compares against (the
  TPU compiler's text has no trip counts; loops here start at 0)."""
  known = re.search(r"known_trip_count\":\{\"n\":\"(\d+)\"", line)
  if known:
    return int(known.group(1))
  bounds = [
    int(c)
    for text in bodies.get(condition, [])
    for c in re.findall(r"= s32\[\]\S* constant\((\d+)\)", text)
  ]
  return max(bounds) if bounds else 1


def collective_bytes(hlo: str) -> dict:
  """Bytes per collective kind of one run of the module: each computation's
  collectives times the number of times it runs (loop bodies their trip
  count, nested loops the product)."""
  bodies, entry = _computations(hlo)
  if entry is None:
    return {k: 0 for k in COLLECTIVES}
  callers: dict = {}
  for name, lines in bodies.items():
    for line in lines:
      if " async-done(" in line:  # its start already runs what it wraps
        continue
      condition = re.search(r"condition=%?([\w.\-]+)", line)
      for kind, targets in _CALLEE.findall(line):
        for target in re.findall(r"%?([\w.\-]+)", targets):
          times = 1
          if kind == "body" and condition:
            times = _trip_count(line, bodies, condition.group(1))
          callers.setdefault(target, []).append((name, times))
  runs: dict = {entry: 1}

  def runs_of(name):  # the call graph is acyclic
    if name not in runs:
      runs[name] = 0
      runs[name] = sum(runs_of(c) * t for c, t in callers.get(name, []))
    return runs[name]

  totals = {k: 0 for k in COLLECTIVES}
  for name, lines in bodies.items():
    times = runs_of(name)
    if not times:
      continue
    for line in lines:
      for kind in COLLECTIVES:
        # an asynchronous pair is read once, from its done, whose type is
        # the results: a start's type also holds its operands (the GPU
        # compiler writes ``((operands), results)`` or ``((operands),
        # (results))``)
        match = re.search(rf"= (.+?) {kind}(-start|-done)?\(", line)
        if match and match.group(2) != "-start":
          totals[kind] += _array_bytes(match.group(1)) * times
  return totals


def host_bytes(hlo: str) -> tuple[int, int]:
  """Bytes of the entry computation's host-memory (``S(5)``) arguments and
  results, read off its ``entry_computation_layout`` (the CPU compiler's
  ``memory_analysis()`` does not split them out)."""
  start = hlo.find("entry_computation_layout={")
  if start < 0:
    return 0, 0
  start += len("entry_computation_layout={")
  depth, end = 1, start
  while depth:  # to the brace that closes the layout
    depth += {"{": 1, "}": -1}.get(hlo[end], 0)
    end += 1
  arguments, _, results = hlo[start : end - 1].partition(")->")
  host = lambda text: sum(
    _array_bytes(array)
    for array in re.findall(r"\w+\[[\d,]*\]\{[^}]*S\(5\)[^}]*\}", text)
  )
  return host(arguments), host(results)
