"""Bytes moved by collectives, read from a compiled HLO module's text."""

import math
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


def _runs(bodies: dict, entry: str) -> dict:
  """How many times each computation runs in one run of the module: loop
  bodies their trip count, nested loops the product."""
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

  return {name: runs_of(name) for name in bodies}


def _collective_of(line: str) -> tuple[str, str, int] | None:
  """``(kind, part, bytes)`` of a collective instruction (``part``: "" for
  a synchronous one, "-start" or "-done"), or None. An asynchronous pair is
  measured at its done, whose type is the results: a start's type also
  holds its operands (the GPU compiler writes ``((operands), results)`` or
  ``((operands), (results))``)."""
  for kind in COLLECTIVES:
    match = re.search(rf"= (.+?) {kind}(-start|-done)?\(", line)
    if match:
      part = match.group(2) or ""
      size = 0 if part == "-start" else _array_bytes(match.group(1))
      return kind, part, size
  return None


def collective_bytes(hlo: str) -> dict:
  """Bytes per collective kind of one run of the module: each computation's
  collectives times the number of times it runs (loop bodies their trip
  count, nested loops the product)."""
  bodies, entry = _computations(hlo)
  totals = {k: 0 for k in COLLECTIVES}
  if entry is None:
    return totals
  runs = _runs(bodies, entry)
  for name, lines in bodies.items():
    if not runs[name]:
      continue
    for line in lines:
      found = _collective_of(line)
      if found:
        totals[found[0]] += found[2] * runs[name]
  return totals


_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


def _dims(text: str) -> list[int]:
  match = _SHAPE.search(text)
  return [int(d) for d in match.group(2).split(",") if d] if match else []


_DEFINITION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) [\w\-]+\(")


def _types(bodies: dict) -> dict:
  """Each instruction's result type, by name (names are unique in a
  module; the optimized text names operands without their types)."""
  types = {}
  for lines in bodies.values():
    for line in lines:
      match = _DEFINITION.match(line)
      if match:
        types[match.group(1)] = match.group(2)
  return types


def _matmul_flops(line: str, types: dict) -> int:
  """FLOPs of a ``dot`` (or a TPU compiler's matmul written as a
  ``convolution``): twice the result's entries times the contracted length."""
  for op, contracted_of in (
    (" dot(", _dot_contracted),
    (" convolution(", _kernel_features),
  ):
    if op in line:
      result, _, rest = line.partition("=")[2].partition(op)
      return 2 * int(np.prod(_dims(result))) * contracted_of(rest, types)
  return 0


def _dot_contracted(rest: str, types: dict) -> int:
  """A ``dot``'s contracted length, read off its left operand's type (0
  where it cannot be read)."""
  operand = re.match(r"\s*(?:\w+\[[\d,]*\]\S*\s+)?%?([\w.\-]+)", rest)
  contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
  if not operand or not contracting:
    return 0
  lhs = _dims(types.get(operand.group(1), ""))
  axes = [int(a) for a in contracting.group(1).split(",") if a]
  if not lhs or any(a >= len(lhs) for a in axes):
    return 0
  return int(np.prod([lhs[a] for a in axes]))


def _kernel_features(rest: str, types: dict) -> int:
  """A matmul written as a ``convolution``: its kernel's input features
  (``i`` of its ``dim_labels``); the window is a batch trick, one tap an
  output."""
  operands = re.match(r"\s*%?([\w.\-]+),\s*%?([\w.\-]+)\)", rest)
  labels = re.search(r"dim_labels=\w+_(\w+)->", rest)
  if not operands or not labels:
    return 0
  kernel = _dims(types.get(operands.group(2), ""))
  at = labels.group(1).find("i")
  return kernel[at] if 0 <= at < len(kernel) else 0


def _flops(name: str, bodies: dict, types: dict, memo: dict) -> int:
  """Matmul FLOPs of one run of a computation, with what it calls (loop
  bodies times their trip counts)."""
  if name in memo:
    return memo[name]
  memo[name] = 0
  total = 0
  for line in bodies.get(name, []):
    total += _line_flops(line, bodies, types, memo)
  memo[name] = total
  return total


def matmul_flops(hlo: str) -> int:
  """Matmul FLOPs of one run of a compiled module, read from its text (loops
  times their trip counts): for the update, its Newton–Schulz work as the
  program does it, beside what the cost model counts."""
  bodies, entry = _computations(hlo)
  if entry is None:
    return 0
  return _flops(entry, bodies, _types(bodies), {})


def _line_flops(line: str, bodies: dict, types: dict, memo: dict) -> int:
  total = _matmul_flops(line, types)
  condition = re.search(r"condition=%?([\w.\-]+)", line)
  for kind, targets in _CALLEE.findall(line):
    if kind == "condition":
      continue
    times = 1
    if kind == "body" and condition:
      times = _trip_count(line, bodies, condition.group(1))
    for target in re.findall(r"%?([\w.\-]+)", targets):
      total += times * _flops(target, bodies, types, memo)
  return total


def replica_groups(line: str) -> list[list[int]] | None:
  """A collective's groups of devices, as places in the program's device
  assignment (the mesh's devices in order), in each of XLA's forms: explicit
  (``{{0,1},{2,3}}``), an iota (``[G,S]<=[dims]T(perm)``), the mesh axes it
  runs over (``mesh['data'=2,'model'=4] {'model'}``), a permute's
  ``source_target_pairs``; ``None`` where the line names none (``{}``: all
  devices, whose count the line does not say)."""
  named = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
  if named:
    axes = re.findall(r"'([^']+)'=(\d+)", named.group(1))
    over = re.findall(r"'([^']+)'", named.group(2))
    ids = np.arange(math.prod(int(n) for _, n in axes))
    ids = ids.reshape([int(n) for _, n in axes])
    inside = [i for i, (name, _) in enumerate(axes) if name in over]
    outside = [i for i in range(len(axes)) if i not in inside]
    size = math.prod(ids.shape[i] for i in inside)
    return ids.transpose(outside + inside).reshape(-1, size).tolist()
  text = re.search(
    r"(?:replica_groups|source_target_pairs)=(\S+?)(?:,\s|$)", line
  )
  if not text or text.group(1) == "{}":
    return None
  text = text.group(1)
  if text.startswith("{"):
    return [
      [int(i) for i in group.split(",") if i]
      for group in re.findall(r"\{([\d,]*)\}", text)
    ]
  shape, dims, perm = re.match(
    r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text
  ).groups()
  ids = np.arange(math.prod(int(d) for d in dims.split(",")))
  ids = ids.reshape([int(d) for d in dims.split(",")])
  if perm:
    ids = ids.transpose([int(p) for p in perm.split(",")])
  return ids.reshape([int(s) for s in shape.split(",")]).tolist()


def sent_fraction(kind: str, size: int) -> float:
  """Bytes a device sends per byte of a collective's result over a group of
  ``size`` as a ring runs it: (S−1)/S of a gather's or an all-to-all's
  result, twice that of an all-reduce's, S−1 times a reduce-scatter's
  shard, a permute's whole."""
  if size <= 1:
    return 0.0 if kind != "collective-permute" else 1.0
  return {
    "all-reduce": 2 * (size - 1) / size,
    "reduce-scatter": size - 1,
    "collective-permute": 1.0,
  }.get(kind, (size - 1) / size)


def _link_seconds(line, kind, size, rates) -> tuple[float, bool]:
  """Seconds one collective of ``size`` result bytes takes, and whether it
  crosses nodes: its ring's bytes (``sent_fraction`` of its groups' size;
  the whole result where the line names no groups) at the network's rate
  where a group spans nodes, else the link's."""
  link, network, nodes = rates
  groups = replica_groups(line)
  if not groups:
    return size / link, False
  fraction = sent_fraction(kind, max(len(g) for g in groups))
  crosses = nodes is not None and any(
    len({nodes[i] for i in group}) > 1 for group in groups
  )
  rate = network if crosses and network else link
  return size * fraction / rate, crosses


def overlap(
  hlo: str,
  flops_per_s: float,
  link_bytes_per_s: float,
  network_bytes_per_s: float | None = None,
  nodes=None,
) -> dict:
  """What of one run's collective time the schedule hides, read from a
  compiled module's text (the optimized module is scheduled: its text order
  is the order it runs in).

  A collective sends its ring's bytes (``sent_fraction``) over
  ``link_bytes_per_s``, or over ``network_bytes_per_s`` where one of its
  groups spans nodes (``nodes``: the node of each device of the program, in
  order); an asynchronous one (a ``-start`` and its ``-done``) is hidden up
  to the matmul time scheduled between the two (their FLOPs at
  ``flops_per_s``, loops inside counted by their trip counts); a
  synchronous one is exposed whole. A model at peak rates, not a profile.

  Returns:
    ``{"collective_s", "overlapped_s", "exposed_s", "collectives",
    "asynchronous", "network_s"}``: seconds per run and how many
    collectives run (each times its computation's runs), of them
    asynchronous; of the seconds, those across nodes.
  """
  rates = (link_bytes_per_s, network_bytes_per_s, nodes)
  bodies, entry = _computations(hlo)
  totals = dict.fromkeys(("collective_s", "overlapped_s", "exposed_s"), 0.0)
  totals.update(collectives=0, asynchronous=0, network_s=0.0)
  if entry is None:
    return totals
  runs = _runs(bodies, entry)
  types = _types(bodies)
  memo: dict = {}
  for name, lines in bodies.items():
    times = runs[name]
    if not times:
      continue
    open_starts: dict = {}  # start's name -> (FLOPs scheduled since, line)
    for line in lines:
      found = _collective_of(line)
      target = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) =", line)
      if found and found[1] == "-start" and target:
        open_starts[target.group(1)] = [0, line]
        continue
      flops = _line_flops(line, bodies, types, memo)
      for start in open_starts.values():
        start[0] += flops
      if not found:
        continue
      kind, part, size = found
      hidden, written = 0.0, line
      if part == "-done":
        operand = re.search(rf"{kind}-done\(\S*?%?([\w.\-]+)\)", line)
        between, written = (  # the groups are written on the start
          open_starts.pop(operand.group(1), (0, line)) if operand else (0, line)
        )
      seconds, crosses = _link_seconds(written, kind, size, rates)
      if part == "-done":
        hidden = min(seconds, between / flops_per_s)
        totals["asynchronous"] += times
      if crosses:
        totals["network_s"] += times * seconds
      totals["collectives"] += times
      totals["collective_s"] += times * seconds
      totals["overlapped_s"] += times * hidden
      totals["exposed_s"] += times * (seconds - hidden)
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
