"""MuonBP (``om.muon_bp``): block steps are ``blockwise``'s update, every
``period``-th step the exact mode's; the identities of issue 44."""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_muon as om
from conftest import normal


def _mesh(shape=(2, 4)):
  return jax.make_mesh(
    shape, ("data", "model"), axis_types=(AxisType.Explicit,) * 2
  )


def _tree():
  keys = iter(jax.random.split(jax.random.key(7), 4))
  params = {
    "up": normal(next(keys), (4, 32, 64)),
    "down": normal(next(keys), (64, 32)),
    "bias": jnp.zeros(64),
  }
  specs = {
    "up": P(None, None, "model"),
    "down": P("model", None),
    "bias": P(),
  }
  return params, specs


def _put(tree, specs, mesh):
  return jax.tree.map(
    lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs
  )


def _steps(tx, params, steps, mesh=None):
  """The updates of ``steps`` jitted steps from one init, each on its own
  gradient."""
  state = tx.init(params)
  update = jax.jit(tx.update)
  out = []
  for t in range(steps):
    grads = jax.tree.map(lambda x, t=t: jnp.cos(x * (t + 1.0)), params)
    if mesh is None:
      updates, state = update(grads, state, params)
    else:
      with jax.set_mesh(mesh):
        updates, state = update(grads, state, params)
    out.append(updates)
  return out, state


def _muon(sharding=None, **kwargs):
  return om.muon(
    0.02,
    dimension_numbers="leading",
    sharding=sharding,
    weight_decay=0.1,
    **kwargs,
  )


def _bp(sharding=None, period=3):
  return om.muon_bp(
    0.02,
    period=period,
    dimension_numbers="leading",
    sharding=sharding,
    weight_decay=0.1,
  )


@pytest.mark.parametrize("mode", ["duplicated", "allgather"])
def test_full_steps_are_the_exact_modes_and_the_others_blockwise(mode):
  """period 3: steps 0 and 3 equal the exact mode's (step 0 = unsharded
  Muon's), steps 1, 2 and 4 blockwise's."""
  mesh = _mesh()
  params, specs = _tree()
  sharded = _put(params, specs, mesh)
  tp = om.TensorParallel(mesh, mode=mode)
  got, state = _steps(_bp(tp), sharded, 5, mesh)
  exact, _ = _steps(_muon(tp), sharded, 5, mesh)
  block, _ = _steps(
    _muon(om.TensorParallel(mesh, mode="blockwise")), sharded, 5, mesh
  )
  unsharded, _ = _steps(_muon(), params, 1)
  chex.assert_trees_all_close(got[0], unsharded[0], atol=1e-6)
  for t in range(5):  # the same gradients, so the same momentum each step
    want = exact[t] if t % 3 == 0 else block[t]
    chex.assert_trees_all_close(got[t], want, atol=1e-6)
  # a block step moves the shard differently from the full step
  assert not jnp.allclose(got[1]["up"], exact[1]["up"], atol=1e-4)
  assert int(state.step) == 5
  for name, spec in specs.items():
    leaf = got[-1][name]
    assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim)


def test_period_one_and_no_sharding_are_muon():
  mesh = _mesh()
  params, specs = _tree()
  sharded = _put(params, specs, mesh)
  tp = om.TensorParallel(mesh, mode="allgather")
  got, _ = _steps(_bp(tp, period=1), sharded, 3, mesh)
  want, _ = _steps(_muon(tp), sharded, 3, mesh)
  chex.assert_trees_all_close(got, want, atol=1e-6)
  got, _ = _steps(_bp(None, period=4), params, 3)
  want, _ = _steps(_muon(), params, 3)
  chex.assert_trees_all_close(got, want, atol=1e-6)


def test_one_shard_a_matrix_is_muon():
  """A tensor-parallel axis of one rank: each block is the whole matrix."""
  mesh = _mesh((8, 1))
  params, specs = _tree()
  sharded = _put(params, specs, mesh)
  got, _ = _steps(
    _bp(om.TensorParallel(mesh, mode="duplicated")), sharded, 4, mesh
  )
  want, _ = _steps(_muon(), params, 4)
  chex.assert_trees_all_close(got, want, atol=1e-5)


def test_block_steps_run_the_blockwise_program():
  """Steps past the first follow blockwise's numbers over several steps
  (the momentum carried by the shared state): period larger than the run."""
  mesh = _mesh()
  params, specs = _tree()
  sharded = _put(params, specs, mesh)
  tp = om.TensorParallel(mesh, mode="duplicated")
  got, _ = _steps(_bp(tp, period=10), sharded, 4, mesh)
  blockwise = om.TensorParallel(mesh, mode="blockwise")
  want, _ = _steps(_muon(blockwise), sharded, 4, mesh)
  exact, _ = _steps(_muon(tp), sharded, 1, mesh)
  chex.assert_trees_all_close(got[0], exact[0], atol=1e-6)
  chex.assert_trees_all_close(got[1:], want[1:], atol=1e-6)


def test_bad_settings_raise():
  mesh = _mesh()
  for period in (0, -1, 2.0, True, "5"):
    with pytest.raises(ValueError, match="period="):
      om.muon_bp(0.02, period=period)
  with pytest.raises(ValueError, match="sharding.mode='blockwise'"):
    om.muon_bp(0.02, sharding=om.TensorParallel(mesh, mode="blockwise"))


def test_the_state_restores_and_the_run_continues_exactly():
  """A step counter and om.muon's state: a run resumed from a copy of the
  state continues bit for bit."""
  mesh = _mesh()
  params, specs = _tree()
  sharded = _put(params, specs, mesh)
  tx = _bp(om.TensorParallel(mesh, mode="allgather"))
  _, state = _steps(tx, sharded, 2, mesh)
  copy = jax.tree.map(
    lambda x: jax.device_put(jax.device_get(x), x.sharding), state
  )
  grads = jax.tree.map(lambda x: jnp.sin(x), sharded)
  with jax.set_mesh(mesh):
    a = jax.jit(tx.update)(grads, state, sharded)
    b = jax.jit(tx.update)(grads, copy, sharded)
  chex.assert_trees_all_equal(a, b)
  assert isinstance(optax.tree_utils.tree_get(state, "step"), jax.Array)


def test_the_step_chooses_per_group_of_leaves_around_the_orthogonalization():
  """One lax.cond per group of leaves within the memory budget: a budget
  below either stack gives each its own (so a group's updates can leave
  its branch and be applied before the next group's are made; one cond
  over the whole update held them all), the default budget one for both.
  A group is at most a quarter of the budget: 16 KiB would hold both
  stacks (8 and 2 KiB a device), its quarter holds neither with the other."""
  mesh = _mesh()
  params, specs = _tree()
  sharded = _put(params, specs, mesh)
  tp = om.TensorParallel(mesh, mode="allgather")

  def branches(**kwargs):
    tx = om.muon_bp(
      0.02, period=3, dimension_numbers="leading", sharding=tp, **kwargs
    )
    state = tx.init(sharded)
    with jax.set_mesh(mesh):
      hlo = jax.jit(tx.update).lower(sharded, state, sharded).as_text()
    return hlo.count("stablehlo.case")

  assert (branches(), branches(memory_budget=1024)) == (1, 2)
  assert branches(memory_budget=16 * 1024) == 2


def test_groups_keep_within_the_budget_in_order():
  from optax_muon._src.parallel.block_steps import groups

  assert groups([3, 3, 3, 10, 1], budget=6) == [[0, 1], [2], [3], [4]]
  assert groups([], budget=6) == []
  assert groups([7], budget=6) == [[0]]


def test_an_8bit_momentum_streams_in_both_kinds_of_step():
  """8-bit momentum is computed inside the waves (the streamed route): its
  steps follow the exact mode's and blockwise's 8-bit runs."""
  mesh = _mesh()
  params, specs = _tree()
  sharded = _put(params, specs, mesh)
  tp = om.TensorParallel(mesh, mode="allgather")
  eight = om.QuantizedMomentum()
  bp = om.muon_bp(
    0.02,
    period=2,
    dimension_numbers="leading",
    sharding=tp,
    weight_decay=0.1,
    mu_dtype=eight,
  )
  got, _ = _steps(bp, sharded, 3, mesh)
  exact, _ = _steps(_muon(tp, mu_dtype=eight), sharded, 3, mesh)
  block, _ = _steps(
    _muon(om.TensorParallel(mesh, mode="blockwise"), mu_dtype=eight),
    sharded,
    3,
    mesh,
  )
  for t, want in enumerate((exact[0], block[1], exact[2])):
    chex.assert_trees_all_close(got[t], want, atol=1e-6)
