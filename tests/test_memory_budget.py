"""The memory budget: the orthogonalization in waves, stacks split over their
batch axes, waves ordered in the program; every mode exact against one wave."""

import dataclasses
import re
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers as Dims

import optax_muon as om
from conftest import ROOT
from conftest import normal
from optax_muon._src.parallel import waves

sys.path.insert(0, str(ROOT / "benchmarks"))
import _hlo  # noqa: E402

# many waves and one are two programs compared to 1e-6: to 17 float32 ulps
# of 1 (1.01e-6) when XLA does not fuse multiply-adds
pytestmark = pytest.mark.xla_optimized

TINY = 1  # bytes: every task over budget, so every stack is split
MODES = om.TensorParallel.MODES


def _mesh(shape=(2, 4)):
  names = ("model",) if len(shape) == 1 else ("data", "model")
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def _tree():
  """Stacked and per-layer kernels, column- and row-parallel, fused QKV and
  gate/up, experts, a replicated matrix."""
  keys = iter(jax.random.split(jax.random.key(0), 16))
  draw = lambda shape: normal(next(keys), shape)
  params = {
    "stack_col": draw((8, 32, 64)),
    "stack_row": draw((8, 64, 32)),
    "layer0": draw((32, 64)),
    "layer1": draw((32, 64)),
    "layer0_row": draw((64, 32)),
    "experts": draw((2, 4, 16, 32)),  # (layers, experts, in, out)
    "qkv": draw((32, 128)),
    "gate_up": draw((4, 32, 128)),
    "replicated": draw((24, 40)),
  }
  specs = {
    "stack_col": P(None, None, "model"),
    "stack_row": P(None, "model", None),
    "layer0": P(None, "model"),
    "layer1": P(None, "model"),
    "layer0_row": P("model", None),
    "experts": P(None, "model", None, None),  # expert-parallel batch axis
    "qkv": P(None, "model"),
    "gate_up": P(None, None, "model"),
    "replicated": P(),
  }
  dims = {
    k: Dims(v.ndim - 2, v.ndim - 1) if v.ndim > 2 else None
    for k, v in params.items()
  }
  return params, specs, dims


SPLITS = dict(
  split_qkv={"qkv": om.SplitQKV(num_heads=8, num_kv_heads=4, head_dim=8)},
  split_gate_up={"gate_up": om.SplitGateUp(groups=4)},
)


def _put(tree, specs, mesh):
  return jax.tree.map(
    lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs
  )


def _update(tx, params):
  state = tx.init(params)
  return jax.jit(tx.update)(params, state, params)[0]


def _close(actual, expected, tol=1e-6):
  """Each leaf within ``tol`` of the other, relative to its largest entry
  (Newton–Schulz entries are O(1/√n); a scaled update's O(scale))."""
  for key, want in expected.items():
    error = float(jnp.max(jnp.abs(actual[key] - want)))
    assert error <= tol * max(1.0, float(jnp.max(jnp.abs(want)))), (key, error)


def _matmul_flops(tx, *args) -> int:
  """Matmul FLOPs of the compiled ``tx.update(*args)``, loops times their
  trip counts."""
  return _hlo.matmul_flops(jax.jit(tx.update).lower(*args).compile().as_text())


def _largest(hlo: str, kind: str) -> int:
  """The largest result of a ``kind`` collective in the HLO."""
  return max(
    (
      _hlo._array_bytes(m)
      for m in re.findall(rf"= (\([^)]*\)|\S+) {kind}(?:-start)?\(", hlo)
    ),
    default=0,
  )


@pytest.mark.parametrize(
  "mesh_shape",
  [(2, 4), pytest.param((4, 2), marks=pytest.mark.integration)],
)
@pytest.mark.parametrize("mode", MODES)
def test_many_waves_equal_one_wave_in_every_mode(mode, mesh_shape):
  mesh = _mesh(mesh_shape)
  params, specs, dims = _tree()
  sharded = _put(params, specs, mesh)
  build = lambda budget: om.orthogonalize(
    dimension_numbers=dims,
    sharding=om.TensorParallel(mesh, mode=mode, specs=specs),
    memory_budget=budget,
    **SPLITS,
  )
  one_wave = _update(build(1 << 40), sharded)
  many = _update(build(TINY), sharded)
  _close(many, one_wave)
  for key, leaf in many.items():
    assert leaf.sharding.is_equivalent_to(
      NamedSharding(mesh, specs[key]), leaf.ndim
    ), key


def test_many_waves_equal_one_wave_unsharded_and_adaptive():
  params, _, dims = _tree()
  # adaptive_muon with NorMuon's row statistics: AdaMuon's first step is
  # sign-like (O / |O| elementwise), so entries near zero flip with any
  # rounding and no tolerance compares two exact computations of it.
  normuon = lambda **kw: om.scale_by_adaptive_muon(
    moment2_method="normuon", **kw
  )
  for make in (om.scale_by_muon, normuon):
    build = lambda budget, make=make: make(
      dimension_numbers=dims,
      scale_mode="shape_scaling",  # factors ≤ 2: the tolerance stays 1e-6
      memory_budget=budget,
      **SPLITS,
    )
    _close(_update(build(TINY), params), _update(build(1 << 40), params))


def test_adaptive_muon_sharded_many_waves_equal_one_wave():
  mesh = _mesh()
  params, specs, dims = _tree()
  sharded = _put(params, specs, mesh)
  build = lambda budget: om.adaptive_muon(
    0.02,
    moment2_method="normuon",
    scale_mode="shape_scaling",
    dimension_numbers=dims,
    labels=jax.tree.map(lambda _: "muon", params),
    sharding=om.TensorParallel(mesh, mode="allgather", specs=specs),
    memory_budget=budget,
    **SPLITS,
  )
  _close(_update(build(TINY), sharded), _update(build(1 << 40), sharded))


def _stack_program(mode, budget, layers=8, shape=(64, 256)):
  mesh = _mesh((8,))
  params = {"stack": jax.ShapeDtypeStruct((layers, *shape), jnp.float32)}
  specs = {"stack": P(None, None, "model")}
  params = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(mesh, s)
    ),
    params,
    specs,
  )
  tx = om.orthogonalize(
    dimension_numbers="leading",
    sharding=om.TensorParallel(mesh, mode=mode, specs=specs),
    memory_budget=budget,
  )
  return jax.jit(tx.update).lower(params, optax.EmptyState()).compile()


def test_a_stack_over_budget_is_gathered_one_part_at_a_time():
  # duplicated gathers each part of the stack in a loop, never the whole
  # stack; the gathered bytes over the whole loop are the same.
  whole = _stack_program("duplicated", 1 << 40).as_text()
  parts = _stack_program("duplicated", TINY).as_text()
  layer = 64 * 256 * 4
  assert _largest(whole, "all-gather") == 8 * layer
  assert _largest(parts, "all-gather") == layer
  assert "while" in parts
  assert _hlo.collective_bytes(parts)["all-gather"] == 8 * layer


def test_the_budget_bounds_the_compiled_temporaries():
  whole = _stack_program("duplicated", 1 << 40, layers=16, shape=(128, 512))
  one_layer = waves.newton_schulz_bytes(128, 512)
  budgeted = _stack_program(
    "duplicated", 2 * one_layer, layers=16, shape=(128, 512)
  )
  temp = lambda c: c.memory_analysis().temp_size_in_bytes
  assert temp(budgeted) <= 0.35 * temp(whole), (temp(budgeted), temp(whole))


def test_allgather_splits_a_stack_over_the_ranks():
  # each rank gets whole layers of the stack (no zero stacks): two
  # all-to-alls move 2/N of what gathering every layer whole moves.
  dup = _hlo.collective_bytes(_stack_program("duplicated", TINY).as_text())
  ag_hlo = _stack_program("allgather", TINY).as_text()
  ag = _hlo.collective_bytes(ag_hlo)
  assert ag["all-gather"] == 0
  assert ag["all-to-all"] == pytest.approx(dup["all-gather"] * 2 / 8)
  # one layer per rank per part: the all-to-all holds 8 local shards
  assert _largest(ag_hlo, "all-to-all") == 8 * 64 * 256 * 4 // 8


@pytest.mark.parametrize("mode", ["duplicated", "allgather"])
def test_a_stack_no_part_size_divides_runs_a_shorter_last_part(mode):
  # 9 layers on TP 4: allgather's parts hold whole layers for every rank
  # (multiples of 4), so 4 + 4 + 1 (the last padded with zero matrices);
  # before, a count no part divided ran as one task, the whole stack at once
  mesh = _mesh((2, 4))
  params = {"stack": normal(jax.random.key(3), (9, 64, 256))}
  specs = {"stack": P(None, None, "model")}
  sharded = _put(params, specs, mesh)
  build = lambda budget: om.orthogonalize(
    dimension_numbers="leading",
    sharding=om.TensorParallel(mesh, mode=mode, specs=specs),
    memory_budget=budget,
  )
  _close(_update(build(TINY), sharded), _update(build(1 << 40), sharded))
  hlo = jax.jit(build(TINY).update).lower(sharded, optax.EmptyState())
  text = hlo.compile().as_text()
  assert "while" in text
  layer = 64 * 256 * 4
  if mode == "allgather":  # a part of 4 layers' local shards, not 12
    assert _largest(text, "all-to-all") == 4 * layer // 4
  else:
    assert _largest(text, "all-gather") == layer


def test_per_layer_leaves_do_not_grow_the_temporaries_with_depth():
  mesh = _mesh((8,))

  def temp(layers):
    params = {
      f"layer{i}": jax.ShapeDtypeStruct(
        (128, 512),
        jnp.float32,
        sharding=NamedSharding(mesh, P(None, "model")),
      )
      for i in range(layers)
    }
    specs = {k: P(None, "model") for k in params}
    tx = om.orthogonalize(
      sharding=om.TensorParallel(mesh, mode="duplicated", specs=specs),
      memory_budget=waves.newton_schulz_bytes(128, 512),
    )
    compiled = jax.jit(tx.update).lower(params, optax.EmptyState()).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  assert temp(8) <= 1.2 * temp(2)


def test_a_tree_within_the_budget_is_one_wave():
  params, _, dims = _tree()
  tx = om.orthogonalize(dimension_numbers=dims)  # default budget
  text = jax.jit(tx.update).lower(params, optax.EmptyState()).as_text()
  assert "optimization_barrier" not in text
  tight = om.orthogonalize(dimension_numbers=dims, memory_budget=TINY)
  text = jax.jit(tight.update).lower(params, optax.EmptyState()).as_text()
  assert "optimization_barrier" in text


def _task(size, axis=None, count=1):
  x = jnp.zeros((count, 2, 2)) if axis is not None else jnp.zeros((2, 2))
  return waves.Task(
    [x],
    lambda i: ([], None),
    lambda m, c: [],
    lambda matrices: matrices,
    size,
    axis,
  )


def test_plan_packs_whole_tasks_and_splits_stacks_into_parts():
  tasks = [_task(40), _task(50), _task(30), _task(100, axis=0, count=10)]
  planned = waves.plan(tasks, budget=100)
  sizes = [([t.bytes for t in wave], part) for wave, part in planned]
  # 40 + 50 fit; 30 next, and the stack of 10 slices of 10 bytes in parts
  # of 10 (a divisor of 10 within the budget: the whole 100 fits, so it is
  # whole)
  assert sizes == [([40, 50], 0), ([30], 0), ([100], 0)]
  planned = waves.plan([_task(120, axis=0, count=12)], budget=35)
  assert planned[0][1] == 3  # 3 slices of 10 bytes (a divisor of 12)
  # pipelined parts: three in flight, two of them at half their bytes or
  # less, so 3 slices of 10 bytes take 45
  pipelined = dataclasses.replace(_task(120, axis=0, count=12), pipelined=True)
  assert waves.plan([pipelined], budget=45)[0][1] == 3
  assert waves.plan([pipelined], budget=44)[0][1] == 2
  # 13 slices (a prime count of layers): parts of 3 and a last one of 1,
  # not 13 parts of one
  planned = waves.plan([_task(130, axis=0, count=13)], budget=35)
  assert planned[0][1] == 3
  # a single matrix over the budget runs alone
  planned = waves.plan([_task(10), _task(500), _task(10)], budget=100)
  assert [[t.bytes for t in w] for w, _ in planned] == [[10], [500], [10]]
  # everything within the budget: one wave
  assert len(waves.plan([_task(10)] * 5, budget=100)) == 1


def test_run_returns_each_tasks_outputs_in_the_tasks_order():
  # a split stack runs as soon as it is met, before the whole tasks gathered
  # ahead of it; the outputs still come back in the tasks' order
  def task(value, size, count=None):
    x = jnp.full((count or 1, 2, 2), float(value))
    return waves.Task(
      [x],
      lambda inputs: ([], [inputs[0] + 1.0]),
      lambda matrices, outputs: outputs,
      lambda matrices: matrices,
      size,
      0 if count else None,
    )

  tasks = [task(0, 30), task(1, 100, count=10), task(2, 30), task(3, 30)]
  order = [[t.inputs[0][0, 0, 0] for t in w] for w, _ in waves.plan(tasks, 35)]
  assert [float(v) for wave in order for v in wave] == [1.0, 0.0, 2.0, 3.0]
  outputs = waves.run(tasks, 35)
  assert [float(out[0][0, 0, 0]) for out in outputs] == [1.0, 2.0, 3.0, 4.0]
  chex.assert_shape(outputs[1][0], (10, 2, 2))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2GiB"])
def test_bad_memory_budget_raises_naming_the_argument(bad):
  for build in (
    lambda: om.orthogonalize(memory_budget=bad),
    lambda: om.muon(0.1, memory_budget=bad),
    lambda: om.adaptive_muon(0.1, memory_budget=bad),
    lambda: om.polargrad(0.1, memory_budget=bad),
    lambda: om.muon_hyperball(0.1, memory_budget=bad),
    lambda: om.compat.muon(0.1, memory_budget=bad),
  ):
    with pytest.raises(ValueError, match="memory_budget"):
      build()
  with pytest.raises(ValueError, match="muon_memory_budget"):
    om.MuonConfig(optimizer="muon", muon_memory_budget=bad)


def test_muon_config_passes_the_budget_on():
  params, _, dims = _tree()
  config = om.MuonConfig.from_overrides(
    ["optimizer=muon", f"muon_memory_budget={TINY}", "muon_split_qkv=false"]
  )
  labels = jax.tree.map(lambda _: "muon", params)
  tx = config.build(0.02, dimension_numbers=dims, labels=labels)
  text = jax.jit(tx.update).lower(params, tx.init(params), params).as_text()
  assert "optimization_barrier" in text
  np.testing.assert_equal(config.muon_memory_budget, TINY)


@pytest.mark.parametrize(
  "count, fit, unit, part",
  [
    # by hand: the largest multiple of unit dividing count, when it is at
    # least half of what fits; else what fits (a shorter last part)
    (10, 4, 1, 2),  # 4 fit; 2 divides 10 and is half of 4
    (12, 5, 1, 4),  # 5 fit; 4 divides 12
    (16, 6, 2, 4),  # 6 fit; 4 is a multiple of 2 dividing 16
    (7, 3, 1, 3),  # 7 is prime: parts of 3, 3, 1
    (9, 20, 1, 9),  # all fit
    (6, 1, 2, 2),  # less than a unit fits: one unit
  ],
)
def test_a_stacks_part_divides_it_when_that_loses_at_most_half(
  count, fit, unit, part
):
  assert waves._part_size(count, fit, unit) == part


@pytest.mark.parametrize(
  "shape, ranks, cut",
  [
    # by hand: the head fills whole matrices for every rank
    ((10, 32, 64), 8, (8, 2)),  # 1 a rank, and 2
    ((5, 32, 64), 4, (4, 1)),
    ((8, 32, 64), 8, None),  # no remainder
    ((6, 32, 64), 8, None),  # no head
    # two matrices a slice (layers of 2 experts): 4 slices are 8
    # matrices, 1 a rank
    ((5, 2, 32, 64), 8, (4, 1)),
  ],
)
def test_a_stack_that_leaves_a_remainder_is_cut_into_its_head_and_rest(
  shape, ranks, cut
):
  from optax_muon._src.parallel import allgather
  from optax_muon._src.parallel.leaves import Leaf
  from optax_muon._src.views import layout

  view = layout.matrix_view(shape, "leading")
  x = jax.ShapeDtypeStruct(shape, jnp.float32)
  leaf = Leaf(x, view, len(shape) - 1, 0, False)
  member = allgather.WideMember(leaf, 0)
  got = allgather.head_and_rest(member, ranks)
  if cut is None:
    assert got is None
    return
  head, rest = got
  assert (head.x.shape[0], rest.x.shape[0]) == cut
  assert head.slice == waves.Slice(0, 0, cut[0])
  assert rest.slice == waves.Slice(0, cut[0], shape[0])
  assert head.items % ranks == 0  # whole matrices for every rank


@pytest.mark.parametrize("pipelined", [True, False])
def test_stacks_that_each_leave_a_remainder_pool_their_rests(
  pipelined, monkeypatch
):
  # three 5-layer stacks of one wide shape (an MLP's gate, up and down) on
  # TP 4, a budget of 1.5 matrices: alone each is ceil(5/4) = 2 matrices a
  # rank, 6 in all; cut into heads of 4 layers (1 a rank each) and rests
  # of 1, pooled (3 matrices: 1 a rank), 4 in all, as one wave of
  # everything: ceil(15/4) = 4. Where the parts are pipelined or not (TPUs).
  # Exact against one wave.
  from optax_muon._src.parallel import allgather

  monkeypatch.setattr(allgather, "pipelines", lambda tp: pipelined)
  mesh = _mesh((2, 4))
  keys = jax.random.split(jax.random.key(5), 3)
  params = {
    "gate": normal(keys[0], (5, 32, 64)),
    "up": normal(keys[1], (5, 32, 64)),
    "down": normal(keys[2], (5, 64, 32)),
  }
  specs = {
    "gate": P(None, None, "model"),
    "up": P(None, None, "model"),
    "down": P(None, "model", None),
  }
  sharded = _put(params, specs, mesh)
  build = lambda budget: om.orthogonalize(
    dimension_numbers="leading",
    sharding=om.TensorParallel(mesh, mode="allgather", specs=specs),
    memory_budget=budget,
  )
  budget = 3 * waves.newton_schulz_bytes(32, 64) // 2
  _close(_update(build(budget), sharded), _update(build(1 << 40), sharded))
  flops = {
    b: _matmul_flops(build(b), sharded, optax.EmptyState())
    for b in (budget, 1 << 40)
  }
  assert flops[budget] / flops[1 << 40] == pytest.approx(4 / 4)


def test_stacks_pool_their_rests_under_fsdp_homes_with_the_momentum_inside():
  # the same three stacks at 10 layers, their rows over "data" (FSDP), so
  # each data rank is home to 5 layers of each, cut into heads and rests:
  # Muon's momentum computed inside the tasks (each reads a slice of it),
  # two steps, equal to one wave; 4 matrices a rank
  mesh = _mesh((2, 4))
  keys = jax.random.split(jax.random.key(6), 9)
  shapes = {"gate": (10, 32, 64), "up": (10, 32, 64), "down": (10, 64, 32)}
  specs = {
    "gate": P(None, "data", "model"),
    "up": P(None, "data", "model"),
    "down": P(None, "model", "data"),
  }
  # two independent gradients: the second a multiple of the first would
  # make the two steps' directions ±1 times each other's, and a wrong
  # layer order invisible in their sum
  params, grads, more_grads = (
    _put(
      {k: normal(key, s) for (k, s), key in zip(shapes.items(), ks)},
      specs,
      mesh,
    )
    for ks in (keys[:3], keys[3:6], keys[6:])
  )
  build = lambda budget: om.muon(
    0.02,
    dimension_numbers="leading",
    sharding=om.TensorParallel(mesh, mode="allgather", specs=specs),
    memory_budget=budget,
  )

  def two_steps(tx):
    state, p = tx.init(params), params
    for g in (grads, more_grads):
      updates, state = jax.jit(tx.update)(g, state, p)
      p = optax.apply_updates(p, updates)
    return p

  budget = 3 * waves.newton_schulz_bytes(32, 64) // 2
  _close(two_steps(build(budget)), two_steps(build(1 << 40)))
  flops = {
    b: _matmul_flops(build(b), grads, build(b).init(params), params)
    for b in (budget, 1 << 40)
  }
  assert flops[budget] / flops[1 << 40] == pytest.approx(4 / 4)
