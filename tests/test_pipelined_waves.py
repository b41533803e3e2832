"""``allgather``'s parts of a split stack are pipelined: the collective of
one loop iteration (the next part's all-to-all and the last part's one back,
as one) does not depend on the Newton–Schulz of the part in between, nor it
on the collective, so a scheduler with asynchronous collectives (GPU, TPU)
can hide it under it. Exactness against one wave is
tests/test_memory_budget.py's."""

import sys

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.extend import core as jcore
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_muon as om
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import _hlo  # noqa: E402

COLLECTIVES = {"all_gather", "all_to_all"}
MATMULS = {"dot_general"}


def _inner_jaxprs(eqn):
  for value in eqn.params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(item, jcore.ClosedJaxpr):
        yield item.jaxpr
      elif isinstance(item, jcore.Jaxpr):
        yield item


def _primitives(eqn) -> set:
  """The primitives ``eqn`` runs, those of the programs inside it too."""
  found = {eqn.primitive.name}
  for inner in _inner_jaxprs(eqn):
    for e in inner.eqns:
      found |= _primitives(e)
  return found


def _loops(jaxpr):
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("while", "scan"):
      yield (eqn.params.get("body_jaxpr") or eqn.params["jaxpr"]).jaxpr
    for inner in _inner_jaxprs(eqn):
      yield from _loops(inner)


def _ancestors(body) -> list[set]:
  """Per equation of ``body``, the indices of the equations it reads from,
  directly or not."""
  made_by = {}
  ancestors: list[set] = []
  for index, eqn in enumerate(body.eqns):
    mine: set = set()
    for var in eqn.invars:
      if isinstance(var, jcore.Var) and var in made_by:
        parent = made_by[var]
        mine |= {parent} | ancestors[parent]
    ancestors.append(mine)
    for var in eqn.outvars:
      made_by[var] = index
  return ancestors


def _parts_loop(mode: str, layers: int):
  """The loop over the parts of a stack of ``layers`` (64, 256) matrices,
  column-parallel over 8 ranks, under a budget that splits it: the loop
  whose body has both collectives and matmuls."""
  mesh = jax.make_mesh((8,), ("model",), axis_types=(AxisType.Auto,))
  spec = P(None, None, "model")
  params = {
    "stack": jax.ShapeDtypeStruct(
      (layers, 64, 256), jnp.float32, sharding=NamedSharding(mesh, spec)
    )
  }
  tx = om.orthogonalize(
    dimension_numbers="leading",
    sharding=om.TensorParallel(mesh, mode=mode, specs={"stack": spec}),
    memory_budget=1,
  )
  jaxpr = jax.make_jaxpr(tx.update)(params, optax.EmptyState()).jaxpr
  (loop,) = [
    body
    for body in _loops(jaxpr)
    if any(_primitives(e) & COLLECTIVES for e in body.eqns)
    and any(_primitives(e) & MATMULS for e in body.eqns)
  ]
  return loop


# allgather's parts hold 8 layers (one a rank): 32 layers are 4 parts
def test_no_collective_of_a_part_waits_on_newton_schulz_nor_it_on_them():
  mode = "allgather"
  body = _parts_loop(mode, 32)
  ancestors = _ancestors(body)
  kinds = [_primitives(e) for e in body.eqns]
  collectives = [i for i, k in enumerate(kinds) if k & COLLECTIVES]
  matmuls = [i for i, k in enumerate(kinds) if k & MATMULS]
  assert collectives and matmuls
  for c in collectives:
    for m in matmuls:
      assert m not in ancestors[c], (mode, body.eqns[c].primitive)
      assert c not in ancestors[m], (mode, body.eqns[m].primitive)
  # one all-to-all carries the next part's shards and the last part's
  # back (a GPU schedules one collective at a time beside a loop): two
  # parts of 8 layers' local (64, 256 / 8) shards
  (exchange,) = collectives
  (payload,) = body.eqns[exchange].invars
  assert payload.aval.size * payload.aval.dtype.itemsize == 2 * 8 * 64 * 32 * 4


def _all_to_alls_over(eqns, axis: str) -> list:
  """Every ``all_to_all`` over mesh axis ``axis`` among ``eqns``, those of
  the programs inside them included."""
  found = []
  for eqn in eqns:
    names = eqn.params.get("axis_name", ())
    names = names if isinstance(names, tuple) else (names,)
    if eqn.primitive.name == "all_to_all" and axis in names:
      found.append(eqn)
    for inner in _inner_jaxprs(eqn):
      found += _all_to_alls_over(inner.eqns, axis)
  return found


def test_fsdp_homes_move_a_part_at_a_time_beside_newton_schulz():
  # a stack whose input axis is sharded over data (FSDP) is homed over
  # data, 16 of its 32 layers a rank; the memory budget splits it into
  # parts, and each part is moved home (and back) in the parts' loop, never
  # the whole stack at once: its moves stay within the budget and run
  # beside the Newton–Schulz of another part
  mesh = jax.make_mesh(
    (2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2
  )
  spec = P(None, "data", "model")
  params = {
    "stack": jax.ShapeDtypeStruct(
      (32, 64, 256), jnp.float32, sharding=NamedSharding(mesh, spec)
    )
  }
  tx = om.orthogonalize(
    dimension_numbers="leading",
    sharding=om.TensorParallel(mesh, mode="allgather", specs={"stack": spec}),
    memory_budget=1,
  )
  jaxpr = jax.make_jaxpr(tx.update)(params, optax.EmptyState()).jaxpr
  local_stack = 32 * 32 * 64 * 4  # bytes of a device's shard
  moves = _all_to_alls_over(jaxpr.eqns, "data")
  assert moves
  for eqn in moves:
    (payload,) = eqn.invars
    assert payload.aval.size * payload.aval.dtype.itemsize <= local_stack / 4
  (body,) = [b for b in _loops(jaxpr) if _all_to_alls_over(b.eqns, "data")]
  ancestors = _ancestors(body)
  kinds = [_primitives(e) for e in body.eqns]
  matmuls = [i for i, k in enumerate(kinds) if k & MATMULS]
  homes = [i for i, e in enumerate(body.eqns) if _all_to_alls_over([e], "data")]
  assert len(homes) == 2 and matmuls  # the next part home, the last back
  for c in homes:
    for m in matmuls:
      assert m not in ancestors[c] and c not in ancestors[m]


def test_duplicated_gathers_then_solves_each_part():
  # the GPU compiler kept duplicated's gathers exposed when pipelined and
  # copied whole stacks for it (Llama-3-70B, h100-8: temp 6.3 -> 16.4 GiB),
  # so its parts stay in order: each part's matrices wait on its gather
  body = _parts_loop("duplicated", 8)
  ancestors = _ancestors(body)
  kinds = [_primitives(e) for e in body.eqns]
  (gather,) = [i for i, k in enumerate(kinds) if k & COLLECTIVES]
  matmuls = [i for i, k in enumerate(kinds) if k & MATMULS]
  assert matmuls and all(gather in ancestors[m] for m in matmuls)


@pytest.mark.xla_optimized  # two programs compared to 1e-6
@pytest.mark.parametrize(
  "mesh_shape, spec, layers",
  [
    # 33 layers, a part of 8 (one a rank): 4 parts pipelined, 1 after
    ((8,), P(None, None, "model"), 33),
    # FSDP × TP: 34 layers homed over data (17 a rank), parts of 4 layers
    # over model, each moved home in its part: 4 parts pipelined, 1 after
    ((2, 4), P(None, "data", "model"), 34),
    # 34 layers over 4 data ranks, padded to 36 (9 a rank), parts of 2
    ((4, 2), P(None, "data", "model"), 34),
    # 10 layers (5 a rank), too few for allgather to split: homed before
    # the waves
    ((2, 4), P(None, "data", "model"), 10),
  ],
)
def test_pipelined_parts_equal_one_wave_with_the_momentum_in_them(
  mesh_shape, spec, layers
):
  names = ("model",) if len(mesh_shape) == 1 else ("data", "model")
  mesh = jax.make_mesh(
    mesh_shape, names, axis_types=(AxisType.Auto,) * len(names)
  )
  keys = jax.random.split(jax.random.key(1), 2)
  sharding = NamedSharding(mesh, spec)
  params = {"stack": jax.device_put(jnp.zeros((layers, 64, 256)), sharding)}
  grads = [
    {"stack": jax.device_put(jax.random.normal(k, (layers, 64, 256)), sharding)}
    for k in keys
  ]

  def run(budget):
    tx = om.muon(
      0.02,
      dimension_numbers="leading",
      sharding=om.TensorParallel(mesh, mode="allgather", specs={"stack": spec}),
      memory_budget=budget,
    )
    state = tx.init(params)
    update = jax.jit(tx.update)
    for g in grads:  # the second step reads the first's momentum
      out, state = update(g, state, params)
    return out["stack"]

  pipelined, one_wave = run(1), run(1 << 40)
  scale = float(jnp.max(jnp.abs(one_wave)))
  assert float(jnp.max(jnp.abs(pipelined - one_wave))) <= 1e-6 * scale
  assert pipelined.sharding.is_equivalent_to(sharding, 3)


# a scheduled module, as the GPU compiler writes one: an asynchronous
# all-to-all around a loop of 5 matmuls, a synchronous one after it, the
# whole inside a loop run 3 times
SCHEDULED = """HloModule pipelined, is_scheduled=true

%ns_body (p: (s32[], f32[64,128])) -> (s32[], f32[64,128]) {
  %p = (s32[], f32[64,128]{1,0}) parameter(0)
  %x = f32[64,128]{1,0} get-tuple-element(%p), index=1
  %d = f32[64,64]{1,0} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  ROOT %t = (s32[], f32[64,128]{1,0}) tuple(%i, %x)
}

%ns_cond (p: (s32[], f32[64,128])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

%part (q: (s32[], f32[8,1024])) -> (s32[], f32[8,1024]) {
  %q = (s32[], f32[8,1024]{1,0}) parameter(0)
  %y = f32[8,1024]{1,0} get-tuple-element(%q), index=1
  %start = ((f32[8,1024]{1,0}), f32[8,1024]{1,0}) all-to-all-start(%y), dimensions={0}
  %w = (s32[], f32[64,128]{1,0}) while(%u), condition=%ns_cond, body=%ns_body, backend_config={"known_trip_count":{"n":"5"}}
  %done = f32[8,1024]{1,0} all-to-all-done(%start)
  %sync = f32[8,1024]{1,0} all-to-all(%done), dimensions={0}
  ROOT %r = (s32[], f32[8,1024]{1,0}) tuple(%j, %sync)
}

%part_cond (q: (s32[], f32[8,1024])) -> pred[] {
  ROOT %c2 = pred[] constant(true)
}

ENTRY %main (a: f32[8,1024]) -> f32[8,1024] {
  %a = f32[8,1024]{1,0} parameter(0)
  %loop = (s32[], f32[8,1024]{1,0}) while(%v), condition=%part_cond, body=%part, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = f32[8,1024]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_the_schedule_reader_hides_a_collective_under_the_matmuls_inside_it():
  # each all-to-all: 8·1024 float32 = 32768 bytes, one second at 32768
  # bytes/s; the loop between the asynchronous one's start and done: 5 dots
  # of 2·64·64·128 FLOPs, half a second at 2·5·2·64·64·128 FLOP/s
  matmuls = 5 * 2 * 64 * 64 * 128
  seen = _hlo.overlap(SCHEDULED, 2 * matmuls, 32768)
  assert seen["collectives"] == 6 and seen["asynchronous"] == 3
  assert seen["collective_s"] == pytest.approx(6.0)
  assert seen["overlapped_s"] == pytest.approx(1.5)
  assert seen["exposed_s"] == pytest.approx(4.5)
  # a faster link: the asynchronous one hidden whole
  seen = _hlo.overlap(SCHEDULED, 2 * matmuls, 4 * 32768)
  assert seen["overlapped_s"] == pytest.approx(0.75)
  assert seen["exposed_s"] == pytest.approx(0.75)


def test_the_schedule_reader_reads_each_form_of_replica_groups():
  groups = _hlo.replica_groups
  assert groups("x = f32[8] all-gather(y), replica_groups={{0,2},{1,3}}") == [
    [0, 2],
    [1, 3],
  ]
  # an iota: 0..7 as [2, 4], transposed, read as 4 groups of 2
  line = "x = f32[8] all-to-all(y), replica_groups=[4,2]<=[2,4]T(1,0), d={0}"
  assert groups(line) == [[0, 4], [1, 5], [2, 6], [3, 7]]
  assert groups("x = f32[8] all-reduce(y), replica_groups=[2,4]<=[8]") == [
    [0, 1, 2, 3],
    [4, 5, 6, 7],
  ]
  named = "replica_groups=mesh['data'=2,'model'=4] {'data'}, dimensions={0}"
  assert groups("x = f32[8] all-to-all(y), " + named) == [
    [0, 4],
    [1, 5],
    [2, 6],
    [3, 7],
  ]
  pairs = "x = f32[8] collective-permute(y), source_target_pairs={{0,1},{1,0}}"
  assert groups(pairs) == [[0, 1], [1, 0]]
  assert groups("x = f32[8] all-reduce(y), replica_groups={}") is None
  assert _hlo.sent_fraction("all-reduce", 4) == 1.5
  assert _hlo.sent_fraction("all-gather", 4) == 0.75
  assert _hlo.sent_fraction("reduce-scatter", 4) == 3


def test_the_schedule_reader_prices_a_group_across_nodes_at_the_network():
  # SCHEDULED's synchronous all-to-all given groups; eight devices on two
  # nodes of four. Inside a node: 3/4 of its 32768 bytes at the link;
  # across (pairs {i, i + 4}): half of them at the network, 1/8 as fast
  matmuls = 5 * 2 * 64 * 64 * 128
  nodes = [0] * 4 + [1] * 4
  sync = "all-to-all(%done), dimensions={0}"
  for groups, at_link, across in (
    ("{{0,1,2,3},{4,5,6,7}}", 0.75, False),
    ("[4,2]<=[2,4]T(1,0)", 0.5, True),
  ):
    hlo = SCHEDULED.replace(sync, sync + f", replica_groups={groups}")
    seconds = at_link * 8 if across else at_link
    seen = _hlo.overlap(hlo, 2 * matmuls, 32768, 32768 / 8, nodes)
    # 3 runs: the asynchronous one (no groups named) 1 s, 0.5 s hidden
    assert seen["collective_s"] == pytest.approx(3 * (1 + seconds))
    assert seen["exposed_s"] == pytest.approx(3 * (0.5 + seconds))
    assert seen["network_s"] == pytest.approx(3 * seconds * across)
    # without the nodes, every group at the link's rate
    alone = _hlo.overlap(hlo, 2 * matmuls, 32768)
    assert alone["network_s"] == 0
    assert alone["collective_s"] == pytest.approx(3 * (1 + at_link))


@pytest.mark.parametrize(
  "kind, pipelined",
  [("NVIDIA H100 80GB HBM3", True), ("cpu", True), ("TPU v5p", False)],
)
def test_parts_are_pipelined_but_on_tpus(kind, pipelined):
  # the TPU compiler runs these collectives synchronously and took minutes
  # over the pipelined loop (see allgather.pipelines)
  import types

  import numpy as np

  from optax_muon._src.parallel import allgather

  device = types.SimpleNamespace(device_kind=kind)
  tp = types.SimpleNamespace(
    mesh=types.SimpleNamespace(devices=np.array([device]))
  )
  assert allgather.pipelines(tp) is pipelined


def test_the_matmul_reader_counts_dots_convolutions_and_loops():
  # a GPU/CPU dot, a TPU compiler's batched matmul written as a
  # convolution (its batch as a dilated window, its contraction the
  # kernel's input features "i"), and a dot in a loop of 5 trips
  hlo = "\n".join(
    [
      "%body (p: f32[4,8]) -> f32[4,8] {",
      "  %p = f32[4,8]{1,0} parameter(0)",
      "  %m = f32[8,8]{1,0} parameter(1)",
      "  ROOT %d = f32[4,8]{1,0} dot(%p, %m), lhs_contracting_dims={1}, "
      "rhs_contracting_dims={0}",
      "}",
      "ENTRY %main (a: f32[2,8,16]) -> f32[2,8,32] {",
      "  %a = f32[2,8,16]{2,1,0} parameter(0)",
      "  %b = f32[2,16,32]{2,1,0} parameter(1)",
      "  %k = f32[2,32,16]{2,1,0} parameter(2)",
      "  %c = f32[2,8,32]{2,1,0} convolution(%a, %b), window={size=2 "
      "lhs_dilate=2}, dim_labels=0bf_0io->0bf",
      "  %e = f32[2,8,32]{2,1,0} convolution(%a, %k), window={size=2 "
      "lhs_dilate=2}, dim_labels=0bf_0oi->0bf",
      "  %w = f32[4,8]{1,0} while(%x), condition=%cond, body=%body, "
      'backend_config={"known_trip_count":{"n":"5"}}',
      "  ROOT %r = f32[2,8,32]{2,1,0} add(%c, %e)",
      "}",
    ]
  )
  convolution = 2 * (2 * 8 * 32) * 16
  assert _hlo.matmul_flops(hlo) == 2 * convolution + 5 * (2 * 4 * 8 * 8)
