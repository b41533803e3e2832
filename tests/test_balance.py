"""Each data rank's Newton–Schulz load under FSDP homes
(``parallel/balance.py``), as ``om.describe`` shows it."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import optax_muon as om
from optax_muon._src.parallel import balance
from optax_muon._src.views import layout

DN = {
  "stack": om.MuonDimensionNumbers(1, 2),
  "plain": om.MuonDimensionNumbers(0, 1),
}


def _flops(m, n, steps=5):
  # Newton–Schulz on an m x n matrix (m <= n): X Xᵀ, (X Xᵀ)², B X a step
  return steps * (2 * m * m * n + 2 * m * m * m + 2 * m * m * n)


def _setting(layers):
  mesh = jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:8])
  params = {
    "stack": jax.ShapeDtypeStruct((layers, 16, 32), jnp.float32),
    "plain": jax.ShapeDtypeStruct((16, 32), jnp.float32),
  }
  specs = {"stack": P(None, "data", "model"), "plain": P(None, "model")}
  tp = om.TensorParallel(mesh, "model", "allgather", specs=specs)
  return params, tp


def _loads(layers):
  params, tp = _setting(layers)
  # the leaves in the tree's order (plain, stack), as the specs are
  views = [view for _, _, view in layout.view_resolver(DN)(params)]
  return balance.rank_loads(tp, views, tp.leaf_specs(params), 5)


def test_a_stack_the_data_axis_does_not_divide_loads_the_first_ranks():
  # 6 layers over 4 ranks: 2 slots a rank, the last rank's both padding;
  # the plain leaf is repeated on every rank
  (loads,) = _loads(6)
  f = _flops(16, 32)
  assert loads.axis == "data"
  assert loads.real == pytest.approx((3 * f, 3 * f, 3 * f, f))
  assert loads.slots == pytest.approx(3 * f)  # 2 slots + the plain leaf
  assert loads.imbalance == pytest.approx(3 / 2.5)
  assert loads.padding == pytest.approx(2 / 8)


def test_a_stack_the_data_axis_divides_is_even():
  (loads,) = _loads(8)
  assert loads.imbalance == pytest.approx(1.0)
  assert loads.padding == 0.0


def test_describe_shows_each_data_axis_load():
  params, tp = _setting(6)
  tx = om.muon(0.1, dimension_numbers=DN, sharding=tp)
  table = str(om.describe(params, optimizer=tx))
  assert table.splitlines()[-1] == (
    "homes over 'data' (4 ranks): each rank's Newton–Schulz FLOPs on real "
    "matrices, max ÷ mean 1.20; 25% of the homed slots are zero padding "
    "(run as well)"
  )
  # no homes (the stack's matrix axes are not split over data): no line
  replicated = om.TensorParallel(
    tp.mesh,
    "model",
    "allgather",
    specs={"stack": P(None, None, "model"), "plain": P(None, "model")},
  )
  table = str(om.describe(params, dimension_numbers=DN, sharding=replicated))
  assert "homes over" not in table


def test_a_stack_sharded_over_data_homes_nothing_and_is_even():
  # experts (the stack's axis) over data, as expert parallelism shards
  # them: each rank orthogonalizes its own 2 of the 8, plus the plain leaf
  mesh = jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:8])
  params = {
    "stack": jax.ShapeDtypeStruct((8, 16, 32), jnp.float32),
    "plain": jax.ShapeDtypeStruct((16, 32), jnp.float32),
  }
  specs = {"stack": P("data", None, "model"), "plain": P(None, "model")}
  tp = om.TensorParallel(mesh, "model", "allgather", specs=specs)
  views = [view for _, _, view in layout.view_resolver(DN)(params)]
  (loads,) = balance.rank_loads(tp, views, tp.leaf_specs(params), 5)
  f = _flops(16, 32)
  assert loads.axis == "data" and not loads.homed
  assert loads.real == pytest.approx((3 * f,) * 4)
  assert loads.imbalance == pytest.approx(1.0) and loads.padding == 0.0
  tx = om.muon(0.1, dimension_numbers=DN, sharding=tp)
  assert str(om.describe(params, optimizer=tx)).splitlines()[-1] == (
    "stacks sharded over 'data' (4 ranks), none homed: each rank's "
    "Newton–Schulz FLOPs, max ÷ mean 1.00"
  )
