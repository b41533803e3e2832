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
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1}


def _array_bytes(shape_text: str) -> int:
  total = 0
  for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape_text):
    count = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
    total += _BYTES.get(dtype, 4) * count
  return total


def collective_bytes(hlo: str) -> dict:
  """Bytes per collective kind, loop bodies counted trip-count times."""
  trips = {}
  for body, count in re.findall(
    r"while\(.*?body=%?([\w.\-]+).*?known_trip_count\":\{\"n\":\"(\d+)\"", hlo
  ):
    trips[body] = int(count)
  totals, computation = {k: 0 for k in COLLECTIVES}, None
  for line in hlo.splitlines():
    header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if header:
      computation = header.group(1)
    for kind in COLLECTIVES:
      match = re.search(rf"= (\([^)]*\)|\S+) {kind}(-start)?\(", line)
      if match:
        totals[kind] += _array_bytes(match.group(1)) * trips.get(computation, 1)
  return totals
