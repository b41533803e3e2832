"""The cost model of ``tp_mode="auto"``: for each Muon leaf, each mode's
Newton–Schulz FLOPs and collective bytes per device, turned into seconds at
the device's rates (``rates.DeviceRates``)::

  seconds = FLOPs / matmul rate + bytes / link bandwidth + collectives · latency

each mesh axis's bytes at its own link's bandwidth: ``network_bytes``
where its groups of devices span nodes, ``link_bytes`` inside one
(``rates.crosses_nodes``). For one ``m × n`` matrix (``m ≤ n``), ``k``
steps and ``P`` tensor-parallel ranks, per device:

* Newton–Schulz: ``k (4 m² n + 2 m³)`` FLOPs (``A = X Xᵀ``, ``A A``, ``B X``);
* ``blockwise``: its shard's Newton–Schulz, no bytes (not exact);
* ``duplicated``: the whole matrix's Newton–Schulz; an all-gather receives
  ``(P−1)/P`` of the matrix;
* ``distributed`` (columns split): ``k (4 m² n / P + 2 m³)`` FLOPs; each
  step all-reduces the fp32 Gram matrix, ``2 (P−1)/P · 4 m²`` bytes;
* ``allgather``: a group of ``G`` same-shape matrices, ``⌈G/P⌉`` whole ones
  per rank; two all-to-alls send ``2 (P−1)/P · ⌈G/P⌉ · m n`` elements; a leaf
  carries its share of its group. Where the waves cut a stack into ``k ≥ 2``
  parts and pipeline them (not on TPUs: ``allgather.pipelines``), each
  part's transfers ``c`` (time over ``k``) run beside a neighbouring part's
  Newton–Schulz ``s``, as the scheduled program reads
  (``benchmarks/_hlo.py``): exposed ``c + 2 max(0, c/2 − s) + (k − 2)
  max(0, c − s)``, the first part's send and the last one's return.

Each leaf (with its group of same-shape leaves, which ``allgather`` stacks
together) takes the cheapest allowed mode; with a ``memory_budget`` given,
the cheapest whose smallest piece of work (one matrix, or one per rank)
fits it. Without one the default budget only orders the waves, as in every
fixed mode, where a matrix whose work exceeds it runs alone: at Llama-3-70B
the default 2 GiB is less than one whole MLP matrix's Newton–Schulz, and
ruling the whole-matrix modes out for it would double the modeled time. The
model compares modes; it does not predict a step's time (no kernel
efficiency, no overlap but the pipelined parts').
"""

import dataclasses
from collections.abc import Sequence

from optax_muon._src.parallel import allgather
from optax_muon._src.parallel import fsdp
from optax_muon._src.parallel import rates as rates_lib
from optax_muon._src.parallel import waves
from optax_muon._src.parallel.tensor_parallel import TensorParallel
from optax_muon._src.parallel.tensor_parallel import local_shape
from optax_muon._src.parallel.tensor_parallel import local_view
from optax_muon._src.parallel.tensor_parallel import mode_for
from optax_muon._src.parallel.tensor_parallel import tp_dim_of
from optax_muon._src.views import layout

# the Gram matrix of ``distributed`` is all-reduced in float32
_GRAM_ITEMSIZE = 4


@dataclasses.dataclass(frozen=True)
class ModeCost:
  """One mode's modeled cost for one leaf, per device.

  Attributes:
    mode: the mode asked for.
    runs: the mode that runs (``tensor_parallel.mode_for``: a short sharded
      side or split pieces gather, a small group is duplicated).
    flops: Newton–Schulz FLOPs.
    bytes: bytes sent over the link.
    collectives: collectives launched.
    seconds: the modeled time at the device's rates.
    piece_bytes: the bytes the smallest piece of this work keeps live.
  """

  mode: str
  runs: str
  flops: float
  bytes: float
  collectives: float
  seconds: float
  piece_bytes: int


@dataclasses.dataclass(frozen=True)
class Choice:
  """The mode ``auto`` chose for a leaf, and why.

  Attributes:
    mode: the mode that runs.
    costs: each allowed mode's cost, the cheapest first.
    reason: a line for ``describe``.
  """

  mode: str
  costs: tuple[ModeCost, ...]
  reason: str


def newton_schulz_flops(m: int, n: int, steps: int) -> float:
  """FLOPs of ``steps`` Newton–Schulz steps on one ``m × n`` matrix."""
  m, n = sorted((m, n))
  return steps * (4.0 * m * m * n + 2.0 * m**3)


def exposed_seconds(transfer: float, compute: float, parts: int) -> float:
  """Of ``transfer`` seconds of collectives, those no Newton–Schulz hides
  when ``parts`` pipelined parts share ``compute`` seconds of it
  (``waves._pipelined_parts``: part ``i + 1`` sent and part ``i − 1``
  returned beside part ``i``'s Newton–Schulz; the second part's send and
  the second-to-last's return beside the first's and last's). One part:
  all of it."""
  if parts < 2:
    return transfer
  c, s = transfer / parts, compute / parts
  return c + 2 * max(0.0, c / 2 - s) + (parts - 2) * max(0.0, c - s)


def _group_key(view: layout.MatrixView, spec, itemsize: int, tp):
  """Leaves ``allgather`` stacks together: one piece of the same shape once
  turned wide, sharded on the same side (``allgather.WideMember.key``)."""
  tp_dim = tp_dim_of(view, spec, tp)
  if tp_dim is None or view.widths:
    return None
  on_short = (tp_dim in view.reduction_axes) == (view.fan_in <= view.fan_out)
  return (*sorted((view.fan_in, view.fan_out)), itemsize, on_short)


def mode_costs(
  view: layout.MatrixView,
  spec,
  itemsize: int,
  tp: TensorParallel,
  steps: int,
  precision: str,
  group_items: int | None = None,
  modes: Sequence[str] | None = None,
  wave_bytes: int = waves.DEFAULT_MEMORY_BUDGET,
) -> list[ModeCost]:
  """Each of ``modes`` (default: ``tp.auto_modes``) for one leaf.

  Args:
    view: the leaf's ``MatrixView`` (global shape).
    spec: its spec (``TensorParallel.leaf_specs``).
    itemsize: bytes per element of the leaf.
    tp: the ``TensorParallel`` (its mesh, axis, rates).
    steps: Newton–Schulz steps.
    precision: the Newton–Schulz precision (which matmul rate).
    group_items: matrices per device in the leaf's ``allgather`` group
      (default: the leaf's own).
    modes: the modes to model (default: ``tp.auto_modes``).
    wave_bytes: the waves' size (``Execution.wave_bytes``), which sets
      how many parts a pipelined stack runs in.

  Returns:
    One ``ModeCost`` per mode, in the order given.
  """
  rates = tp.resolved_rates()
  if rates is None:
    raise ValueError(
      f"no DeviceRates for {rates_lib.device_kind(tp.mesh)!r}; pass "
      "TensorParallel(rates=om.DeviceRates(...))"
    )
  flop_rate = rates.matmul_flops(precision)
  ranks = tp.size
  tp_dim = tp_dim_of(view, spec, tp)
  count = fsdp.local_count(view, spec, tp)
  spread = (
    tp.bound_mesh.shape[tp.distribute_over]
    if fsdp.splits_over_data(view, spec, tp)
    else 1
  )
  pieces = view.matrix_shapes

  # each axis at its own link: inside a node, or across nodes
  tp_link = rates.link_for(rates_lib.crosses_nodes(tp.bound_mesh, tp.axis))
  data_link = rates.link_for(
    rates_lib.crosses_nodes(tp.bound_mesh, tp.distribute_over)
  )

  def cost(
    mode, runs, flops, moved, collectives, piece, spread_moved=0.0, parts=1
  ):
    """``moved`` bytes over the tensor-parallel axis (in ``parts``
    pipelined parts), ``spread_moved`` over ``distribute_over``."""
    compute = flops / flop_rate
    seconds = compute + exposed_seconds(moved / tp_link, compute, parts)
    seconds += spread_moved / data_link
    seconds += collectives * rates.latency
    total = moved + spread_moved
    return ModeCost(mode, runs, flops, total, collectives, seconds, piece)

  def whole(mode, runs) -> ModeCost:
    """Whole matrices on each rank (``duplicated``), split over
    ``distribute_over`` where that applies."""
    share = -(-count // spread)
    flops = share * sum(newton_schulz_flops(a, b, steps) for a, b in pieces)
    size = count * view.fan_in * view.fan_out
    moved = size * itemsize * (ranks - 1) / ranks
    # the results all-gathered over distribute_over
    spread_moved = size * 4 * (spread - 1) / spread
    piece = max(waves.newton_schulz_bytes(a, b, 1, itemsize) for a, b in pieces)
    return cost(mode, runs, flops, moved, 3 + (spread > 1), piece, spread_moved)

  costs = []
  for mode in tp.auto_modes if modes is None else modes:
    runs = mode_for(mode, view, tp_dim)
    if runs == "blockwise":
      try:
        local = local_view(view, local_shape(view.shape, spec, tp))
      except ValueError:  # fused pieces that do not split into whole ones
        continue
      share = -(-count // spread)
      flops = share * sum(
        newton_schulz_flops(a, b, steps) for a, b in local.matrix_shapes
      )
      piece = max(
        waves.newton_schulz_bytes(a, b, 1, itemsize)
        for a, b in local.matrix_shapes
      )
      costs.append(cost(mode, runs, flops, 0.0, 0, piece))
    elif runs == "duplicated":
      costs.append(whole(mode, runs))
    elif runs == "distributed":
      short, long = sorted((view.fan_in, view.fan_out))
      flops = (
        count * steps * (4.0 * short * short * long / ranks + 2.0 * short**3)
      )
      gram = short * short * _GRAM_ITEMSIZE
      moved = count * steps * 2 * gram * (ranks - 1) / ranks
      piece = waves.newton_schulz_bytes(
        short, long // ranks, 1, itemsize, short
      )
      costs.append(cost(mode, runs, flops, moved, steps + 2, piece))
    else:  # allgather
      items = count if group_items is None else group_items
      if not allgather.shares_out(items, ranks):
        costs.append(whole(mode, "duplicated"))
        continue
      per_rank = -(-items // ranks)
      part = count / items  # this leaf's part of its group's work
      m, n = view.fan_in, view.fan_out
      flops = part * per_rank * newton_schulz_flops(m, n, steps)
      moved = part * 2 * per_rank * m * n * itemsize * (ranks - 1) / ranks
      piece = (
        waves.newton_schulz_bytes(m, n, 1, itemsize) + 2 * itemsize * m * n
      )
      # a stack's own matrices a rank, in as many parts as the waves cut
      # them: a stack split into parts runs alone (``allgather``'s
      # ``head_and_rest``, ``_splits_alone``), its first send and last
      # return its own
      parts = (
        waves.parts_of(-(-count // ranks), piece, wave_bytes, pipelined=True)
        if view.batch_axes and allgather.pipelines(tp)
        else 1
      )
      costs.append(cost(mode, runs, flops, moved, 2 * part, piece, parts=parts))
  return costs


def choose(costs: Sequence[ModeCost], budget: int | None) -> Choice:
  """The cheapest of ``costs`` whose smallest piece fits ``budget`` (if none
  fits, the one with the smallest piece; ``None``: the cheapest)."""
  fitting = [c for c in costs if budget is None or c.piece_bytes <= budget]
  ranked = sorted(costs, key=lambda c: c.seconds)
  if fitting:
    best = min(fitting, key=lambda c: c.seconds)
    why = "modeled " + ", ".join(
      f"{c.mode} {c.seconds * 1e3:.3g} ms" for c in ranked
    )
    if best is not ranked[0]:
      why += f"; {ranked[0].mode}'s smallest piece exceeds the memory budget"
  else:
    best = min(costs, key=lambda c: c.piece_bytes)
    why = (
      "no allowed mode's smallest piece fits the memory budget; the smallest"
    )
  return Choice(best.runs, tuple(ranked), why)


def _allgather_groups(views, specs, itemsizes, tp):
  """The leaves ``allgather`` stacks together, as lists of leaf indices (a
  leaf in no group is one of its own), and per leaf the matrices per device
  of its group (None for a leaf in none)."""
  keys = [_group_key(v, s, i, tp) for v, s, i in zip(views, specs, itemsizes)]
  members: dict = {}
  for index, key in enumerate(keys):
    members.setdefault(index if key is None else key, []).append(index)
  counts = [fsdp.local_count(v, s, tp) for v, s in zip(views, specs)]
  items = [
    None if key is None else sum(counts[i] for i in members[key])
    for key in keys
  ]
  return list(members.values()), items


def group_items(views, specs, itemsizes, tp) -> list[int | None]:
  """Per leaf, the matrices per device of its ``allgather`` group (None for
  a leaf that is in none)."""
  return _allgather_groups(views, specs, itemsizes, tp)[1]


def choose_modes(
  views: Sequence[layout.MatrixView],
  specs: Sequence[tuple],
  itemsizes: Sequence[int],
  tp: TensorParallel,
  steps,
  precision: str,
  budget: int | None,
  exclude: Sequence[str] = (),
  wave_bytes: int = waves.DEFAULT_MEMORY_BUDGET,
) -> list[Choice]:
  """``tp_mode="auto"``: each leaf's ``Choice`` (see the module).

  Leaves that ``allgather`` would stack together (same shape once turned
  wide, sharded on the same side) decide together, on their summed costs,
  so that a group never splits over modes.

  Args:
    views, specs, itemsizes: per Muon leaf, its view, spec and element size.
    tp: the ``TensorParallel`` (``mode="auto"``).
    steps: Newton–Schulz steps (traced steps are modeled as 5).
    precision: the Newton–Schulz precision.
    budget: the memory budget the user gave, bytes per device, or None
      (the default budget: time alone decides).
    exclude: modes the solver cannot run (``distributed`` for the spectral
      preconditioning).
    wave_bytes: the waves' size (``Execution.wave_bytes``).
  """
  steps = steps if isinstance(steps, int) else 5
  modes = [m for m in tp.auto_modes if m not in exclude]
  groups, items = _allgather_groups(views, specs, itemsizes, tp)
  costs = [
    mode_costs(v, s, i, tp, steps, precision, g, modes, wave_bytes)
    for v, s, i, g in zip(views, specs, itemsizes, items)
  ]
  choices: list = [None] * len(views)
  for group in groups:
    summed = [
      dataclasses.replace(
        first,
        seconds=sum(costs[i][j].seconds for i in group),
      )
      for j, first in enumerate(costs[group[0]])
    ]
    picked = choose(summed, budget)
    reason = picked.reason
    if len(group) > 1:
      reason += f" (its {len(group)} same-shape leaves together)"
    for i in group:
      own = sorted(costs[i], key=lambda c: c.seconds)
      choices[i] = Choice(picked.mode, tuple(own), reason)
  return choices


def leaf_choices(
  tp: TensorParallel,
  views: Sequence[layout.MatrixView],
  specs: Sequence[tuple],
  itemsizes: Sequence[int],
  steps,
  precision: str,
  preconditioning: str,
  budget: int | None,
  wave_bytes: int = waves.DEFAULT_MEMORY_BUDGET,
) -> list[Choice]:
  """``choose_modes`` for a solver: ``auto`` never picks ``distributed``
  for the spectral preconditioning (an SVD needs each whole matrix)."""
  exclude = ("distributed",) if preconditioning == "spectral" else ()
  return choose_modes(
    views, specs, itemsizes, tp, steps, precision, budget, exclude, wave_bytes
  )
