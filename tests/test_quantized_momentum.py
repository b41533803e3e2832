"""8-bit blockwise momentum (om.QuantizedMomentum): bytes, the rounding
bound, no drift, shards, sharded modes, checkpoints."""

import re
import sys

import chex
import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_muon as om
from conftest import ROOT
from conftest import gaussian
from optax_muon._src.kernels import quantize
from optax_muon._src.parallel.execution import Execution

sys.path.insert(0, str(ROOT / "benchmarks"))
import _hlo  # noqa: E402

Q8 = om.QuantizedMomentum()


def _stored(mu, key):
  """Leaf ``key`` of an 8-bit momentum (a ``QuantizedState``)."""
  return quantize.QuantizedArray(mu.values[key], mu.scales[key])


def _stored_leaves(state):
  """Every 8-bit leaf of an optimizer state, as ``QuantizedArray``s."""
  found = [
    x
    for x in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, quantize.QuantizedState)
    )
    if isinstance(x, quantize.QuantizedState)
  ]
  return [
    q
    for mu in found
    for q in quantize.leaves(mu, jax.tree.structure(mu.values))
  ]


def _state_bytes(state):
  return sum(x.nbytes for x in jax.tree.leaves(state))


def test_the_state_takes_a_quarter_of_float32s_bytes():
  params = {
    "a": jnp.zeros((256, 1024)),
    "b": jnp.zeros((4, 512, 512)),
    "c": jnp.zeros((96, 300)),  # 300: blocks of 150
  }
  dims = {"a": None, "b": om.MuonDimensionNumbers(1, 2), "c": None}
  build = lambda mu_dtype: om.scale_by_muon(
    mu_dtype=mu_dtype, dimension_numbers=dims
  )
  ratio = _state_bytes(build(Q8).init(params)) / _state_bytes(
    build("float32").init(params)
  )
  assert ratio <= 0.27, ratio


@pytest.mark.parametrize("width", [512, 300, 257, 7])
def test_a_round_trip_is_within_half_a_step(width):
  # 257 is prime: no divisor block, the last block padded
  x = gaussian((6, width), width) * jnp.linspace(0.1, 10.0, 6)[:, None]
  like = quantize.init(x, Q8)
  stored = quantize.quantize(x, like, Q8)
  assert stored.values.dtype == jnp.int8
  chex.assert_shape(stored.values, x.shape)
  error = jnp.abs(quantize.dequantize(stored, Q8) - x)
  assert bool(jnp.all(error <= quantize.bound(stored, Q8) * (1 + 1e-6)))
  # each block's largest entry is stored exactly (to float32 rounding)
  assert float(jnp.max(error)) <= 1e-2 * float(jnp.max(jnp.abs(x)))


@pytest.mark.parametrize("nesterov", [True, False])
def test_one_update_is_within_the_bound_of_the_float32_one(nesterov):
  beta = 0.95
  params = {"w": jnp.zeros((64, 512))}
  exact = om.momentum(beta, nesterov=nesterov)
  eight = om.momentum(beta, nesterov=nesterov, dtype=Q8)
  state32 = exact.init(params)
  for step in range(5):  # a momentum that is not zero
    _, state32 = exact.update({"w": gaussian((64, 512), step)}, state32)
  old = quantize.quantize(
    state32.mu["w"], _stored(eight.init(params).mu, "w"), Q8
  )
  old_bound = quantize.bound(old, Q8)
  g = {"w": gaussian((64, 512), 99)}
  want, new32 = exact.update(g, state32)
  got, new8 = eight.update(
    g,
    type(state32)(
      mu=quantize.QuantizedState({"w": old.values}, {"w": old.scales})
    ),
  )
  # the update sees the old momentum's rounding, times β (and β again for
  # the Nesterov look-ahead); the stored one adds its own half step
  reach = beta**2 if nesterov else beta
  assert bool(
    jnp.all(jnp.abs(got["w"] - want["w"]) <= reach * old_bound * (1 + 1e-5))
  )
  stored = quantize.dequantize(_stored(new8.mu, "w"), Q8)
  new_bound = quantize.bound(_stored(new8.mu, "w"), Q8)
  assert bool(
    jnp.all(
      jnp.abs(stored - new32.mu["w"])
      <= (beta * old_bound + new_bound) * (1 + 1e-5)
    )
  )


def test_two_hundred_steps_do_not_drift():
  beta = 0.95
  params = {"w": jnp.zeros((128, 512))}
  exact, eight = om.momentum(beta), om.momentum(beta, dtype=Q8)
  s32, s8 = exact.init(params), eight.init(params)

  @jax.jit
  def step(s32, s8, g):
    return exact.update(g, s32)[1], eight.update(g, s8)[1]

  errors = []
  for t in range(200):
    s32, s8 = step(s32, s8, {"w": gaussian((128, 512), 1000 + t)})
    m, m8 = s32.mu["w"], quantize.dequantize(_stored(s8.mu, "w"), Q8)
    errors.append(float(jnp.linalg.norm(m8 - m) / jnp.linalg.norm(m)))
  # each step rounds to half a step of its block (0.7% RMS of a Gaussian
  # block); the EMA carries the past roundings, √(1/(1−β²)) = 3.2× in RMS:
  # 2.2%, flat from step 40 on
  assert errors[-1] <= 3e-2, errors[-1]
  assert max(errors[50:]) <= 1.1 * min(errors[50:]), errors[50:]


def _mesh():
  return jax.make_mesh(
    (2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2
  )


def _collectives(hlo):
  return sum(_hlo.collective_bytes(hlo).values())


def test_a_block_never_spans_two_shards():
  # a last axis of 64 split 4 ways: shards of 16, narrower than the block
  mesh = _mesh()
  params = {
    "col": jax.device_put(
      gaussian((32, 64), 0), NamedSharding(mesh, P(None, "model"))
    ),
    "both": jax.device_put(
      gaussian((32, 64), 1), NamedSharding(mesh, P("data", "model"))
    ),
  }
  tx = om.momentum(dtype=Q8)
  state = tx.init(params)
  for scales in state.mu.scales.values():
    assert scales.shape[-1] % 4 == 0  # whole blocks in each shard
  hlo = jax.jit(tx.update).lower(params, state).compile().as_text()
  assert _collectives(hlo) == 0


def test_zero1_sharded_quantized_state_needs_no_collective():
  mesh = _mesh()
  params = {"w": gaussian((32, 64), 0)}
  tx = om.momentum(dtype=Q8)
  state = tx.init(params)
  state = jax.device_put(state, om.zero1_sharding(state, mesh, "data"))
  assert (
    state.mu.values["w"].sharding.spec == state.mu.scales["w"].sharding.spec
  )
  params = jax.device_put(params, NamedSharding(mesh, P()))
  hlo = jax.jit(tx.update).lower(params, state).compile().as_text()
  # the update reads the whole gradient (replicated) and writes its shard
  assert _collectives(hlo) == 0


def _tree():
  params = {
    "col": gaussian((32, 64), 0),
    "row": gaussian((64, 32), 1),
    "stack": gaussian((4, 32, 64), 2),
  }
  specs = {
    "col": P(None, "model"),
    "row": P("model", None),
    "stack": P(None, None, "model"),
  }
  dims = {"col": None, "row": None, "stack": om.MuonDimensionNumbers(1, 2)}
  return params, specs, dims


def _sharded_run(mode, steps):
  """``steps`` of om.muon with 8-bit momentum, unsharded and in ``mode``."""
  mesh = _mesh()
  params, specs, dims = _tree()
  sharded = jax.tree.map(
    lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs
  )
  # blocks of 8 fit a shard either way, so both store the same blocks
  q = om.QuantizedMomentum(block_size=8)
  build = lambda sharding: om.muon(
    0.02,
    mu_dtype=q,
    dimension_numbers=dims,
    labels=jax.tree.map(lambda _: "muon", params),
    sharding=sharding,
    scale_mode="shape_scaling",
  )

  def run(tx, p):
    state = tx.init(p)
    update = jax.jit(tx.update)
    for step in range(steps):
      grads = jax.tree.map(lambda x, s=step: x * (1.0 + s), p)
      updates, state = update(grads, state, p)
      p = optax.apply_updates(p, updates)
    return p, state

  sharding = om.TensorParallel(mesh, mode=mode, specs=specs)
  return run(build(None), params), run(build(sharding), sharded)


@pytest.mark.parametrize("mode", ["duplicated", "distributed", "allgather"])
def test_sharded_modes_equal_unsharded_with_8_bit_state(mode):
  (want, want_state), (got, got_state) = _sharded_run(mode, 3)
  chex.assert_trees_all_close(got, want, atol=1e-6, rtol=0)
  chex.assert_trees_all_close(got_state, want_state, atol=1e-6, rtol=0)


def test_blockwise_stores_the_unsharded_8_bit_momentum():
  # blockwise orthogonalizes each shard on its own (other numbers by
  # design); the momentum it stores is the same
  (_, want_state), (_, got_state) = _sharded_run("blockwise", 1)
  chex.assert_trees_all_close(got_state, want_state, atol=1e-6, rtol=0)


def test_checkpoint_restore_continue_is_bit_identical(tmp_path):
  params = {"w": gaussian((32, 96), 0), "b": jnp.zeros(96)}
  tx = om.muon(0.02, mu_dtype=Q8)
  update = jax.jit(tx.update)

  def steps(p, s, start, stop):
    for t in range(start, stop):
      g = jax.tree.map(lambda x, t=t: jnp.sin(x * (t + 1.0)) + 0.1, p)
      u, s = update(g, s, p)
      p = optax.apply_updates(p, u)
    return p, s

  p, s = steps(params, tx.init(params), 0, 3)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "ckpt", {"params": p, "state": s})
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(
      tmp_path / "ckpt", {"params": p, "state": s}
    )
  chex.assert_trees_all_equal(restored["state"], s)
  assert jax.tree.map(lambda x: x.dtype, restored["state"]) == jax.tree.map(
    lambda x: x.dtype, s
  )
  straight = steps(p, s, 3, 6)
  resumed = steps(restored["params"], restored["state"], 3, 6)
  chex.assert_trees_all_equal(resumed, straight)


def test_adaptive_muon_keeps_its_first_moment_in_8_bits():
  params = {"w": gaussian((32, 64), 0)}
  labels = {"w": "muon"}
  exact = om.adaptive_muon(0.02, moment2_method="normuon", labels=labels)
  eight = om.adaptive_muon(
    0.02, moment2_method="normuon", labels=labels, mu_dtype=Q8
  )
  s32, s8 = exact.init(params), eight.init(params)
  stored = _stored_leaves(s8)
  assert len(stored) == 1 and stored[0].values.dtype == jnp.int8
  g = {"w": gaussian((32, 64), 1)}
  # from zero the first update is exact; the second sees one rounding
  u32, s32 = exact.update(g, s32, params)
  u8, s8 = eight.update(g, s8, params)
  chex.assert_trees_all_close(u8, u32, atol=1e-6)
  u32, _ = exact.update(g, s32, params)
  u8, _ = eight.update(g, s8, params)
  assert float(jnp.linalg.norm(u8["w"] - u32["w"])) <= 2e-2 * float(
    jnp.linalg.norm(u32["w"])
  )


@pytest.mark.parametrize(
  "make, field",
  [
    (lambda: om.QuantizedMomentum(bits=4), "bits"),
    (lambda: om.QuantizedMomentum(block_size=0), "block_size"),
    (lambda: om.muon(1e-3, mu_dtype="int8"), "mu_dtype"),
    (lambda: om.MuonConfig(muon_momentum_bits=4), "muon_momentum_bits"),
    (
      lambda: om.MuonConfig(muon_momentum_block_size=0),
      "muon_momentum_block_size",
    ),
  ],
)
def test_bad_8_bit_settings_name_the_field(make, field):
  with pytest.raises(ValueError, match=field):
    make()


def test_complex_params_raise_at_init():
  tx = om.momentum(dtype=Q8)
  with pytest.raises(ValueError, match="QuantizedMomentum"):
    tx.init({"w": jnp.zeros((4, 8), jnp.complex64)})


def test_muon_config_builds_8_bit_momentum():
  tx = om.MuonConfig(
    optimizer="muon", muon_momentum_bits=8, muon_momentum_block_size=64
  ).build(1e-3)
  state = tx.init({"layer": {"kernel": jnp.zeros((64, 256))}})
  stored = _stored_leaves(state)
  assert len(stored) == 1
  chex.assert_shape(stored[0].scales, (64, 4))


def test_zero1_splits_values_and_scales_on_an_axis_both_divide():
  mesh = _mesh()
  # rows 3: not divisible by 2; columns 64 in blocks of 64: one scale a
  # row, not divisible either: both stay whole rather than split apart
  odd = om.momentum(dtype=Q8).init({"w": jnp.zeros((3, 64))})
  shardings = om.zero1_sharding(odd, mesh, "data")
  assert (
    shardings.mu.values["w"].spec
    == shardings.mu.scales["w"].spec
    == P(None, None)
  )
  # columns 64 in blocks of 16: four scales a row, split like the values
  even = om.momentum(dtype=om.QuantizedMomentum(block_size=16)).init(
    {"w": jnp.zeros((3, 64))}
  )
  shardings = om.zero1_sharding(even, mesh, "data")
  assert shardings.mu.values["w"].spec == P(None, "data")
  assert shardings.mu.scales["w"].spec == P(None, "data")


def test_the_8_bit_update_runs_in_parts_within_the_memory_budget():
  # a scanned stack over the budget is updated a part (a layer) at a time:
  # its float32 temporaries are a part's, not the whole stack's (the TPU
  # compiler keeps them all otherwise; the CPU one fuses either way)
  params = {"stack": jnp.zeros((16, 128, 512))}

  def hlo(budget):
    tx = om.momentum(dtype=Q8, memory_budget=budget)
    return jax.jit(tx.update).lower(params, tx.init(params)).as_text()

  part = re.compile(r"dynamic_slice[^\n]*tensor<1x128x512xf32>")
  assert "while" in hlo(1) and part.search(hlo(1))
  assert "while" not in hlo(1 << 40)


def test_scale_by_muon_computes_the_8_bit_momentum_in_its_waves():
  # its momentum runs inside the orthogonalization's waves: the float32
  # momentum of every stack is never live at once, as in optax.chain
  params = {f"stack{i}": jnp.zeros((8, 256, 512)) for i in range(6)}
  dims = jax.tree.map(lambda _: om.MuonDimensionNumbers(1, 2), params)
  budget = 3 << 20  # about one stack's part

  def temp(tx):
    compiled = jax.jit(tx.update).lower(params, tx.init(params)).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  fused = om.scale_by_muon(
    dimension_numbers=dims, memory_budget=budget, mu_dtype=Q8
  )
  chained = optax.chain(
    om.momentum(dtype=Q8, memory_budget=1 << 40),
    om.orthogonalize(dimension_numbers=dims, memory_budget=budget),
    om.scale_by_shape(dimension_numbers=dims),
  )
  assert temp(fused) <= 0.6 * temp(chained), (temp(fused), temp(chained))
  # and the state is the chain's, so checkpoints carry over
  chain_state = optax.chain(
    om.momentum(dtype=Q8),
    om.orthogonalize(dimension_numbers=dims),
    om.scale_by_shape(dimension_numbers=dims),
    optax.scale(1.0),
  ).init(params)
  assert jax.tree.structure(fused.init(params)) == jax.tree.structure(
    chain_state
  )


def _nnx_model():
  from flax import nnx

  return nnx.Sequential(
    nnx.Linear(32, 128, rngs=nnx.Rngs(0)),
    jax.nn.relu,
    nnx.Linear(128, 32, rngs=nnx.Rngs(1)),
  )


@pytest.mark.parametrize(
  "make",
  [
    lambda layout: om.muon(3e-3, layout=layout, mu_dtype=Q8),
    lambda layout: om.muon(
      3e-3, layout=layout, state_memory_kind="pinned_host"
    ),
    lambda layout: om.muon(
      3e-3, layout=layout, mu_dtype=Q8, state_memory_kind="pinned_host"
    ),
    lambda layout: om.MuonConfig(
      optimizer="muon", lr=3e-3, muon_momentum_bits=8
    ).build(3e-3, layout=layout),
  ],
  ids=["8-bit", "offload", "8-bit-offload", "config-8-bit"],
)
def test_nnx_optimizer_steps_equal_the_functional_path(make):
  # flax's nnx.Optimizer stores each state leaf in a Variable and writes the
  # new state back with nnx.update: a leaf that is itself a pytree (the
  # int8 values and the scales together) would come back as a dict, and the
  # second update would fail. Three steps through it equal tx.init/update.
  from flax import nnx

  model = _nnx_model()
  x = gaussian((64, 32), 7)
  tx = make(om.infer_layout(model, x))
  loss = lambda m: jnp.mean((m(x) - x) ** 2)
  twin = nnx.clone(model)  # stepped by tx.init / tx.update on plain arrays
  params = nnx.as_pure(nnx.state(twin, nnx.Param))
  state = tx.init(params)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  for _ in range(3):
    optimizer.update(model, nnx.grad(loss)(model))
    grads = nnx.as_pure(nnx.grad(loss)(twin))
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    nnx.update(twin, params)
  chex.assert_trees_all_equal(
    jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(params)
  )
  chex.assert_trees_all_equal(
    jax.tree.leaves(nnx.as_pure(optimizer.opt_state)), jax.tree.leaves(state)
  )


def test_an_8_bit_or_host_momentum_streams_through_the_waves():
  # the one choice of scale_by_muon's route: each leaf's momentum computed
  # in the wave that orthogonalizes it (dequantized, or brought from host
  # memory, a part at a time), or the chain for a float momentum
  assert Execution().streams(om.QuantizedMomentum(8))
  assert Execution(state_memory_kind="pinned_host").streams(None)
  assert not Execution().streams(None)
  assert not Execution().streams(jnp.bfloat16)
  with pytest.raises(ValueError, match="memory_budget"):
    Execution(memory_budget=0)


@pytest.mark.parametrize("member", [om.adaptive_muon, om.polargrad])
def test_the_chained_members_8_bit_momentum_keeps_the_memory_budget(member):
  # adaptive_muon and polargrad chain their momentum before the direction:
  # the budget given to them reaches it, so an over-budget stack's int8
  # values are read a part (a layer) at a time
  params = {"stack": jnp.zeros((16, 128, 512))}

  def int8_parts(budget):
    tx = member(
      0.02, dimension_numbers="leading", mu_dtype=Q8, memory_budget=budget
    )
    text = jax.jit(tx.update).lower(params, tx.init(params), params).as_text()
    return re.findall(r"dynamic_slice[^\n]*-> tensor<1x128x512xi8>", text)

  assert int8_parts(1 << 20)
  assert not int8_parts(1 << 40)
