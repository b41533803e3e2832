"""om.dion's distributed scheme (sharding=om.TensorParallel(mode=
"distributed")): the unsharded update on (2,4)/(4,2) meshes, no matrix
gathered, Q kept split, an exact resume, MuonConfig, and bad input."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_muon as om
from conftest import gaussian
from conftest import update_collectives

AUTO = (AxisType.Auto, AxisType.Auto)
HEADS = om.MuonDimensionNumbers(0, (1, 2))
DIMS = {
  "wide": None,
  "tall": None,
  "stack": om.MuonDimensionNumbers(1, 2),
  "heads": HEADS,
  "heads_inner": HEADS,
  "alone": None,
  "bias": None,
}
SPECS = {
  # wide: its fan-out is the tall rows (over model), fan-in the columns
  "wide": P("data", "model"),
  "tall": P("model", "data"),
  # the stack split over data, each matrix's fan-out over model
  "stack": P("data", None, "model"),
  # two fan-out axes, the first split: still one block of (fan_in, fan_out)
  "heads": P("data", "model", None),
  # the second of two fan-out axes split: not one block; gathered whole
  "heads_inner": P(None, None, "model"),
  "alone": P(),
  "bias": P(),
}


def _tree(seed=0):
  return {
    "wide": gaussian((32, 48), seed),
    "tall": gaussian((48, 32), seed + 1),
    "stack": gaussian((4, 24, 40), seed + 2),
    "heads": gaussian((32, 4, 8), seed + 3),
    "heads_inner": gaussian((32, 4, 8), seed + 4),
    "alone": gaussian((24, 40), seed + 5),
    "bias": gaussian((48,), seed + 6),
  }


def _sharded(tree, mesh):
  return jax.tree.map(
    lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, SPECS
  )


def _steps(tx, params, count=3):
  state = tx.init(params)
  update = jax.jit(tx.update)
  for step in range(count):
    grads = jax.tree.map(lambda p: gaussian(p.shape, 10 + step), params)
    grads = jax.tree.map(
      lambda g, p: jax.device_put(g, p.sharding), grads, params
    )
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def _dion(**kwargs):
  kwargs = {"rank_fraction": 0.5, **kwargs}
  return om.dion(0.02, weight_decay=0.1, dimension_numbers=DIMS, **kwargs)


def _distributed(mesh):
  return om.TensorParallel(mesh, mode="distributed", specs=SPECS)


@pytest.mark.parametrize("qr_method", ["qr", "rcqr"])
# Auto first: the fast tier keeps the first case of each value, and the
# Explicit rcqr case (the heaviest compile) repeats what the others run
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2)])
def test_distributed_gives_the_unsharded_update(
  mesh_shape, axis_type, qr_method
):
  mesh = jax.make_mesh(
    mesh_shape, ("data", "model"), axis_types=(axis_type,) * 2
  )
  want, want_state = _steps(_dion(qr_method=qr_method), _tree())
  tx = _dion(qr_method=qr_method, sharding=_distributed(mesh))
  got, state = _steps(tx, _sharded(_tree(), mesh))
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=0)
  # rcqr's Q column signs follow its sketch, which a split block draws on
  # its own (the update does not depend on them: test_dion.py)
  chex.assert_trees_all_close(
    _column_signs_fixed(state), _column_signs_fixed(want_state), atol=1e-5
  )


def _column_signs_fixed(state):
  """``state`` with each Q column's sign set by its first entry."""
  fixed = lambda x: x * np.sign(x[..., :1, :]) if x.ndim == 3 else x
  return jax.tree.map(lambda x: fixed(np.asarray(x)), state)


def test_q_is_kept_split_as_each_matrixs_shorter_side():
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=AUTO)
  state = _dion(sharding=_distributed(mesh)).init(_sharded(_tree(), mesh))
  (dion_state,) = [
    s
    for s in jax.tree.leaves(
      state, is_leaf=lambda s: isinstance(s, om.DionState)
    )
    if isinstance(s, om.DionState)
  ]
  specs = {
    k: dion_state.q[k][0].sharding.spec
    for k in ("wide", "tall", "stack", "heads")
  }
  # wide (32 in, 48 out) stands as 48 × 32: its columns are the fan-in,
  # split over data; tall (48 in, 32 out): its fan-out, over data
  assert specs["wide"] == P(None, "data", None)
  assert specs["tall"] == P(None, "data", None)
  assert specs["stack"] == P("data", None, None)
  assert specs["heads"] == P(None, "data", None)
  # a device holds half of wide's Q (its 32 columns over 2 data ranks)
  q = dion_state.q["wide"][0]
  assert q.addressable_shards[0].data.shape == (1, 16, 16)


def _collectives(tx, mesh, optimized=True):
  return update_collectives(tx, _tree(), SPECS, mesh, optimized)


def test_no_matrix_is_gathered_only_low_rank_products_travel():
  # Explicit axes: without a sharding each split matrix is gathered
  mesh = jax.make_mesh(
    (2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2
  )
  gathered = _collectives(_dion(rank_fraction=0.25), mesh)
  distributed = _collectives(
    _dion(rank_fraction=0.25, sharding=_distributed(mesh)), mesh
  )
  # gathering moves each whole matrix; the scheme moves B Q and Bᵀ P
  # (rows × r, n × r) and gathers P for its QR (rows × r), except for the
  # leaf it gathers (heads_inner)
  assert sum(distributed.values()) < 0.5 * sum(gathered.values()), (
    distributed,
    gathered,
  )


def test_a_resumed_distributed_state_continues_bit_for_bit():
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=AUTO)
  two = {
    k: v for k, v in _sharded(_tree(), mesh).items() if k in ("wide", "stack")
  }
  tx = om.dion(
    0.02,
    rank_fraction=0.5,
    qr_method="rcqr",
    dimension_numbers={"wide": None, "stack": DIMS["stack"]},
    sharding=om.TensorParallel(
      mesh, mode="distributed", specs={k: SPECS[k] for k in two}
    ),
  )
  params, state = _steps(tx, two, count=2)
  restored = jax.tree.map(
    lambda x: jax.device_put(np.asarray(x), x.sharding), state
  )
  grads = jax.tree.map(lambda p: gaussian(p.shape, 99), params)
  once, _ = jax.jit(tx.update)(grads, state, params)
  again, _ = jax.jit(tx.update)(grads, restored, params)
  chex.assert_trees_all_equal(once, again)


def test_muon_config_builds_the_distributed_scheme():
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=AUTO)
  params = {"w": gaussian((32, 48), 0)}
  specs = {"w": P("data", "model")}
  config = om.MuonConfig(
    optimizer="dion", muon_tp_mode="distributed", dion_rank_fraction=0.5
  )
  tx = config.build(params=params, mesh=mesh, specs=specs)
  unsharded = om.MuonConfig(optimizer="dion", dion_rank_fraction=0.5).build()
  want, _ = _steps(unsharded, params)
  sharded = {"w": jax.device_put(params["w"], NamedSharding(mesh, specs["w"]))}
  got, state = _steps(tx, sharded)
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=0)
  (q,) = [x for x in jax.tree.leaves(state) if x.shape == (1, 32, 16)]
  assert q.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "data")), 3)
  with pytest.raises(ValueError, match="muon_tp_mode"):
    om.MuonConfig(optimizer="dion", muon_tp_mode="allgather")


def test_bad_input_names_the_field():
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=AUTO)
  with pytest.raises(ValueError, match="sharding.mode.*distributed"):
    om.dion(0.02, sharding=om.TensorParallel(mesh, mode="allgather"))
  with pytest.raises(ValueError, match="sharding.distribute_over"):
    om.dion(
      0.02,
      sharding=om.TensorParallel(
        mesh, mode="distributed", distribute_over="data"
      ),
    )
  with pytest.raises(ValueError, match="sharding="):
    om.dion(0.02, sharding=mesh)
  # on an Auto mesh without specs the spec of a leaf is unknown: told at init
  tx = om.dion(0.02, sharding=om.TensorParallel(mesh, mode="distributed"))
  with pytest.raises(ValueError, match="specs"):
    tx.init({"w": jnp.ones((32, 48))})


def test_at_medium_precision_the_summed_products_travel_in_bfloat16():
  # "medium" rounds B Q and Bᵀ P to bfloat16, so their partial sums travel
  # at half the bytes (as XLA's partitioner sends them); the sketch and the
  # Gram stay float32
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=AUTO)
  bytes_at = {
    precision: _collectives(
      _dion(precision=precision, sharding=_distributed(mesh)),
      mesh,
      optimized=False,
    )["all-reduce"]
    for precision in ("highest", "medium")
  }
  assert bytes_at["medium"] < 0.75 * bytes_at["highest"], bytes_at
