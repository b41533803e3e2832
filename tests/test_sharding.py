"""Sharded Muon on 8 simulated CPU devices: the four tensor-parallel modes,
the collectives they compile to, shardings kept, and the data-parallel split."""

import re
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_muon as om
from conftest import ROOT
from conftest import nnx_losses
from conftest import normal
from conftest import tp_mlp
from optax_muon._src.parallel.allgather import shares_out

sys.path.insert(0, str(ROOT / "benchmarks"))
import _hlo  # noqa: E402  (the benchmarks' HLO byte count)

SPLIT = om.SplitQKV(num_heads=8, num_kv_heads=8, head_dim=4)  # 8 groups of 12
MESHES = [(8,), (2, 4), (4, 2)]


def _mesh(shape, axis_type=AxisType.Explicit):
  names = ("model",) if len(shape) == 1 else ("data", "model")
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


def _tree():
  keys = iter(jax.random.split(jax.random.key(0), 8))
  draw = lambda shape: normal(next(keys), shape)
  params = {
    "wide_in": draw((32, 64)),
    "wide_out": draw((32, 64)),
    "tall_in": draw((64, 32)),
    "tall_out": draw((64, 32)),
    "stacked": draw((2, 32, 48)),
    "attn": {"qkv": draw((32, 96))},
  }
  specs = {
    "wide_in": P("model", None),
    "wide_out": P(None, "model"),
    "tall_in": P("model", None),
    "tall_out": P(None, "model"),
    "stacked": P(None, None, "model"),
    "attn": {"qkv": P(None, "model")},
  }
  return params, specs


def _put(tree, specs, mesh):
  return jax.tree.map(
    lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs
  )


def _sharded_update(tx, params, mesh):
  with jax.set_mesh(mesh):
    state = tx.init(params)
    return jax.jit(tx.update)(params, state, params)


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("mode", ["duplicated", "distributed", "allgather"])
def test_full_matrix_modes_equal_the_unsharded_update(mesh_shape, mode):
  mesh = _mesh(mesh_shape)
  params, specs = _tree()
  reference = om.scale_by_muon(split_qkv=SPLIT, dimension_numbers="leading")
  expected, _ = reference.update(params, reference.init(params))
  tx = om.scale_by_muon(
    split_qkv=SPLIT,
    sharding=om.TensorParallel(mesh, mode=mode),
    dimension_numbers="leading",
  )
  updates, _ = _sharded_update(tx, _put(params, specs, mesh), mesh)
  chex.assert_trees_all_close(updates, expected, atol=1e-5)


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_blockwise_is_newton_schulz_of_each_shard_with_its_shape(mesh_shape):
  mesh = _mesh(mesh_shape)
  ranks = mesh.shape["model"]
  params, specs = _tree()
  tx = om.scale_by_muon(
    split_qkv=SPLIT,
    sharding=om.TensorParallel(mesh, mode="blockwise"),
    dimension_numbers="leading",
  )
  updates, _ = _sharded_update(tx, _put(params, specs, mesh), mesh)
  updates = jax.tree.map(np.asarray, updates)
  for name, axis in [("wide_out", 1), ("tall_in", 0)]:
    shards = np.split(np.asarray(params[name]), ranks, axis=axis)
    expected = np.concatenate(  # each shard its own matrix, with its shape
      [om.newton_schulz(x) * np.sqrt(max(x.shape)) for x in shards], axis
    )
    np.testing.assert_allclose(updates[name], expected, atol=1e-5)
  # each shard of the column-parallel QKV holds whole heads: Q, K, V split
  groups_per_shard = 8 // ranks
  for r, shard in enumerate(
    np.split(np.asarray(params["attn"]["qkv"]), ranks, axis=1)
  ):
    grouped = shard.reshape(32, groups_per_shard, 12)
    pieces = [
      grouped[..., i * 4 : (i + 1) * 4].reshape(32, -1) for i in range(3)
    ]
    expected = jnp.concatenate(
      [
        (om.newton_schulz(p) * np.sqrt(max(p.shape))).reshape(
          32, groups_per_shard, 4
        )
        for p in pieces
      ],
      axis=-1,
    ).reshape(32, -1)
    width = shard.shape[1]
    np.testing.assert_allclose(
      updates["attn"]["qkv"][:, r * width : (r + 1) * width],
      expected,
      atol=1e-5,
    )


def _allgather_tree():
  # 8 column-parallel and 9 row-parallel matrices: at least the axis size on
  # every mesh, and 9 a multiple of none of 2, 4, 8 (the stack is padded)
  keys = iter(jax.random.split(jax.random.key(7), 17))
  params = {f"col{i}": normal(next(keys), (32, 64)) for i in range(8)}
  params |= {f"row{i}": normal(next(keys), (64, 32)) for i in range(9)}
  specs = {
    k: P(None, "model") if k.startswith("col") else P("model", None)
    for k in params
  }
  return params, specs


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_allgather_all_to_all_path_equals_the_unsharded_update(mesh_shape):
  mesh = _mesh(mesh_shape)
  params, specs = _allgather_tree()
  tx = om.scale_by_muon(
    sharding=om.TensorParallel(mesh, mode="allgather"),
    dimension_numbers="leading",
  )
  updates, _ = _sharded_update(tx, _put(params, specs, mesh), mesh)
  reference = om.scale_by_muon(dimension_numbers="leading")
  expected, _ = reference.update(params, reference.init(params))
  chex.assert_trees_all_close(updates, expected, atol=1e-5)
  _, counts = _collectives(
    om.orthogonalize(
      sharding=om.TensorParallel(mesh, mode="allgather"),
      dimension_numbers="leading",
    ),
    params,
    specs,
    mesh,
  )
  # one group of 17 (the row-parallel matrices are the column-parallel ones'
  # transposes, stacked together once turned wide): two all-to-alls
  assert _only(counts, all_to_all=2)


@pytest.mark.parametrize(
  "mode", ["blockwise", "duplicated", "distributed", "allgather"]
)
def test_sharded_batch_axes_stay_local_and_equal_the_unsharded_update(mode):
  mesh = _mesh((2, 4))
  params = {
    "layers": normal(jax.random.key(3), (8, 32, 64)),
    "experts": normal(jax.random.key(4), (4, 2, 48, 16)),
  }
  specs = {"layers": P("model", None, None), "experts": P("model", "data")}
  tx = om.scale_by_muon(
    sharding=om.TensorParallel(mesh, mode=mode), dimension_numbers="leading"
  )
  updates, _ = _sharded_update(tx, _put(params, specs, mesh), mesh)
  reference = om.scale_by_muon(dimension_numbers="leading")
  expected, _ = reference.update(params, reference.init(params))
  chex.assert_trees_all_close(updates, expected, atol=1e-5)


def _collectives(tx, params, specs, mesh):
  sharded = _put(params, specs, mesh)
  with jax.set_mesh(mesh):
    hlo = (
      jax.jit(lambda u: tx.update(u, tx.init(u))[0])
      .lower(sharded)
      .compile()
      .as_text()
    )
  names = (
    "all-gather",
    "all-reduce",
    "all-to-all",
    "collective-permute",
    "reduce-scatter",
  )
  shape = r"(?:\([^)]*\)|\S+)"  # an array shape or a tuple of them
  return hlo, {
    n: len(re.findall(rf"= {shape} {n}(-start)?\(", hlo)) for n in names
  }


def _only(counts, **expected):
  return {k: v for k, v in counts.items() if v} == {
    k.replace("_", "-"): v for k, v in expected.items()
  }


@pytest.mark.parametrize("spec", [P("model", None), P(None, "model")])
def test_blockwise_and_sharded_batch_axes_need_no_collectives(spec):
  mesh = _mesh((2, 4))
  x = {"w": jnp.ones((32, 64))}
  tx = om.orthogonalize(
    sharding=om.TensorParallel(mesh, mode="blockwise"),
    dimension_numbers="leading",
  )
  assert _only(_collectives(tx, x, {"w": spec}, mesh)[1])
  stacked = {"w": jnp.ones((8, 32, 64))}
  for mode in ("duplicated", "distributed", "allgather"):
    tx = om.orthogonalize(
      sharding=om.TensorParallel(mesh, mode=mode), dimension_numbers="leading"
    )
    assert _only(
      _collectives(tx, stacked, {"w": P("model", None, None)}, mesh)[1]
    ), mode


def test_duplicated_gathers_each_leaf_once():
  mesh = _mesh((2, 4))
  tree = {"a": jnp.ones((32, 64)), "b": jnp.ones((64, 32))}
  tx = om.orthogonalize(
    sharding=om.TensorParallel(mesh, mode="duplicated"),
    dimension_numbers="leading",
  )
  hlo, counts = _collectives(
    tx, tree, {"a": P(None, "model"), "b": P("model", None)}, mesh
  )
  assert _gathers_and_scalars(hlo, counts, gathers=2, matrices=2)


def _gathers_and_scalars(hlo, counts, gathers, matrices):
  """``gathers`` all-gathers, and all-reduces of the normalization's max
  and norm² only, reduced from the shards: 8 bytes a matrix at most."""
  kinds = {k for k, v in counts.items() if v}
  scalars = _hlo.collective_bytes(hlo)["all-reduce"]
  return (
    kinds <= {"all-gather", "all-reduce"}
    and counts["all-gather"] == gathers
    and 0 < scalars <= 8 * matrices
  )


def test_distributed_all_reduces_the_gram_matrix_once_per_step():
  mesh = _mesh((2, 4))
  steps = 5
  tx = om.orthogonalize(
    steps=steps,
    sharding=om.TensorParallel(mesh, mode="distributed"),
    dimension_numbers="leading",
  )
  hlo, counts = _collectives(
    tx, {"w": jnp.ones((32, 64))}, {"w": P(None, "model")}, mesh
  )
  gram = re.findall(r"= f32\[1,32,32\]\{[^}]*\} all-reduce(-start)?\(", hlo)
  assert len(gram) == 1  # in the loop body ...
  trip = re.findall(r'known_trip_count":\{"n":"(\d+)"', hlo)
  assert trip == [str(steps)]  # ... which runs `steps` times
  scalars = re.findall(r"= \S*f32\[1,1,1\]\S* all-reduce(-start)?\(", hlo)
  assert len(scalars) == 2  # max and norm² of the normalization
  assert _only(counts, all_reduce=3)


def test_allgather_uses_all_to_all_and_no_full_gather():
  mesh = _mesh((2, 4))
  tree = {f"w{i}": jnp.ones((32, 64)) for i in range(4)}
  tx = om.orthogonalize(
    sharding=om.TensorParallel(mesh, mode="allgather"),
    dimension_numbers="leading",
  )
  _, counts = _collectives(tx, tree, {k: P(None, "model") for k in tree}, mesh)
  assert _only(counts, all_to_all=2)
  # three leaves on four ranks: padded with a zero matrix, still 2 all-to-alls
  three = {f"w{i}": jnp.ones((32, 64)) for i in range(3)}
  _, counts = _collectives(
    tx, three, {k: P(None, "model") for k in three}, mesh
  )
  assert _only(counts, all_to_all=2)
  # two: the all-to-alls would move as much as gathering each, so duplicated
  two = {f"w{i}": jnp.ones((32, 64)) for i in range(2)}
  hlo, counts = _collectives(tx, two, {k: P(None, "model") for k in two}, mesh)
  assert _gathers_and_scalars(hlo, counts, gathers=2, matrices=2)


@pytest.mark.parametrize(
  "count,ranks,shares",
  [
    (1, 4, False),
    (2, 4, False),
    (3, 4, True),
    (3, 8, True),
    (2, 2, True),
    (9, 8, True),
  ],
)
def test_allgather_shares_out_when_it_moves_fewer_bytes(count, ranks, shares):
  assert shares_out(count, ranks) is shares


def test_allgather_pads_four_leaves_over_eight_ranks_at_half_the_bytes():
  mesh = _mesh((8,))
  params = {f"w{i}": normal(jax.random.key(i), (32, 64)) for i in range(4)}
  specs = {k: P(None, "model") for k in params}
  moved = {}
  for mode in ("duplicated", "allgather"):
    tx = om.orthogonalize(
      sharding=om.TensorParallel(mesh, mode=mode), dimension_numbers="leading"
    )
    hlo, counts = _collectives(tx, params, specs, mesh)
    moved[mode] = sum(_hlo.collective_bytes(hlo).values())
    out, _ = _sharded_update(tx, _put(params, specs, mesh), mesh)
    chex.assert_trees_all_close(
      out, jax.tree.map(om.newton_schulz, params), atol=1e-5
    )
  assert _only(counts, all_to_all=2)
  # 2 leaf-sized transfers against 4
  assert moved["allgather"] <= 0.55 * moved["duplicated"]


def test_allgather_stacks_transposed_shapes_together():
  # an MLP's up (32×128, columns split) and down (128×32, rows split) kernels
  # are each other's transposes: one group of four, not two groups of two
  mesh = _mesh((2, 4))
  params = {f"up{i}": normal(jax.random.key(i), (32, 128)) for i in range(2)}
  params.update(
    {f"down{i}": normal(jax.random.key(5 + i), (128, 32)) for i in range(2)}
  )
  specs = {
    k: P(None, "model") if k.startswith("up") else P("model", None)
    for k in params
  }
  tx = om.orthogonalize(
    sharding=om.TensorParallel(mesh, mode="allgather"),
    dimension_numbers="leading",
  )
  _, counts = _collectives(tx, params, specs, mesh)
  assert _only(counts, all_to_all=2)
  out, _ = _sharded_update(tx, _put(params, specs, mesh), mesh)
  chex.assert_trees_all_close(
    out, jax.tree.map(om.newton_schulz, params), atol=1e-5
  )


def test_fsdp_axis_is_gathered_for_the_matrix_and_resplit():
  mesh = _mesh((2, 4))
  x = normal(jax.random.key(1), (32, 64))
  tx = om.orthogonalize(
    sharding=om.TensorParallel(mesh, mode="duplicated"),
    dimension_numbers="leading",
  )
  out, _ = _sharded_update(
    tx, _put({"w": x}, {"w": P("data", "model")}, mesh), mesh
  )
  assert out["w"].sharding.spec == P("data", "model")
  np.testing.assert_allclose(out["w"], om.newton_schulz(x), atol=1e-5)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_updates_and_state_keep_the_param_sharding(axis_type):
  mesh = _mesh((2, 4), axis_type)
  params, specs = _tree()
  tp = om.TensorParallel(mesh, mode="duplicated", specs=specs)
  tx = om.muon(
    0.01,
    split_qkv=SPLIT,
    sharding=tp,
    labels=jax.tree.map(lambda _: "muon", params),
    dimension_numbers="leading",
  )
  sharded = _put(params, specs, mesh)
  with jax.set_mesh(mesh):
    state = jax.jit(tx.init)(sharded)
    updates, state = jax.jit(tx.update)(sharded, state, sharded)
  want = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  kept = lambda tree: jax.tree.leaves(
    jax.tree.map(
      lambda got, expected: got.sharding.is_equivalent_to(expected, got.ndim),
      tree,
      want,
    )
  )
  assert kept(updates) == [True] * len(jax.tree.leaves(params))
  assert kept(state.inner_states["muon"].inner_state[0][0].mu) == [True] * len(
    jax.tree.leaves(params)
  )


def test_zero1_momentum_sharding_splits_state_over_data():
  mesh = _mesh((2, 4), AxisType.Auto)
  params, specs = _tree()
  tx = om.scale_by_muon(
    split_qkv=SPLIT,
    sharding=om.TensorParallel(mesh, mode="duplicated", specs=specs),
    dimension_numbers="leading",
  )
  sharded = _put(params, specs, mesh)
  state = tx.init(sharded)
  zero1 = om.zero1_sharding(state[0].mu, mesh, "data", specs=specs)
  assert zero1["wide_out"].spec == P("data", "model")
  assert zero1["stacked"].spec == P("data", None, "model")
  state = (state[0]._replace(mu=jax.device_put(state[0].mu, zero1)),) + state[
    1:
  ]
  per_device = lambda t: sum(
    s.data.nbytes for x in jax.tree.leaves(t) for s in x.addressable_shards[:1]
  )
  tp_only = tx.init(sharded)[0].mu  # sharded like the params: 1/4 each
  assert per_device(tp_only) * 4 == sum(
    x.nbytes for x in jax.tree.leaves(tp_only)
  )
  assert per_device(state[0].mu) * 2 == per_device(tp_only)
  # two steps against the formulas, unsharded: the second reads the momentum
  # (m ← βm + (1−β)g, Nesterov u = (1−β)g + βm), then NS and the shape scale
  direction = optax.chain(
    om.orthogonalize(split_qkv=SPLIT, dimension_numbers="leading"),
    om.scale_by_shape(split_qkv=SPLIT, dimension_numbers="leading"),
  )
  momentum = jax.tree.map(jnp.zeros_like, params)
  update = jax.jit(tx.update)
  for step in range(2):
    grads = jax.tree.map(lambda x: jnp.cos(x * (step + 1.0)), params)
    updates, state = update(_put(grads, specs, mesh), state)
    momentum = jax.tree.map(lambda m, g: 0.95 * m + 0.05 * g, momentum, grads)
    expected, _ = direction.update(
      jax.tree.map(lambda m, g: 0.05 * g + 0.95 * m, momentum, grads),
      direction.init(params),
    )
    chex.assert_trees_all_close(updates, expected, atol=1e-5)
    # the momentum keeps its data-axis split
    got = jax.tree.map(lambda x: x.sharding.spec, state[0].mu)
    assert got == jax.tree.map(lambda s: s.spec, zero1), step


def test_distribute_over_data_splits_the_newton_schulz_work():
  mesh = _mesh((8, 1))
  # Each matrix is the largest of the update (320 KiB), which alone would not
  # be stacked; split over the data ranks, the stack is.
  tree = {f"w{i}": normal(jax.random.key(i), (128, 640)) for i in range(8)}
  specs = {k: P() for k in tree}

  def flops(distribute_over):
    tx = om.orthogonalize(
      sharding=om.TensorParallel(
        mesh, mode="duplicated", distribute_over=distribute_over
      ),
      dimension_numbers="leading",
    )
    sharded = _put(tree, specs, mesh)
    with jax.set_mesh(mesh):
      f = jax.jit(lambda u: tx.update(u, optax.EmptyState())[0])
      compiled = f.lower(sharded).compile()
      return compiled.cost_analysis()["flops"], f(sharded)

  split, split_out = flops("data")
  whole, whole_out = flops(None)
  assert split <= whole / 4
  for k in tree:
    np.testing.assert_allclose(split_out[k], whole_out[k], atol=1e-5)


@pytest.mark.parametrize("mode", ["duplicated", "distributed"])
def test_flax_model_with_partitioning_trains(mode):
  mesh = _mesh((2, 4), AxisType.Auto)
  with jax.set_mesh(mesh):
    model = tp_mlp(nnx.Rngs(0))
    specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
    tp = om.TensorParallel(mesh, mode=mode, specs=specs)
    tx = om.muon(0.02, sharding=tp, dimension_numbers="leading")
    losses = nnx_losses(model, tx, normal(jax.random.key(0), (32, 16)))
  assert losses[2] < losses[0]
  assert model.up.kernel.sharding.spec == P(None, "model")


FAMILY_WITH_PIECES = {
  # members whose state holds pieces not shaped like their param (a second
  # moment per neuron, Dion's Q): nnx.Optimizer gave them the param's
  # sharding and init raised IndivisibleError
  "adaptive_muon_normuon": lambda tp: om.adaptive_muon(
    0.02, moment2_method="normuon"
  ),
  "nordion2": lambda tp: om.nordion2(0.02),
  "nordion2_sharded_global": lambda tp: om.nordion2(
    0.02, sharding=tp, selection_scope="global"
  ),
  "dion": lambda tp: om.dion(0.02, rank_fraction=0.5),
}


@pytest.mark.parametrize("member", sorted(FAMILY_WITH_PIECES))
def test_flax_model_with_partitioning_trains_every_state_shape(member):
  mesh = _mesh((2, 4), AxisType.Auto)
  with jax.set_mesh(mesh):
    model = tp_mlp(nnx.Rngs(0))
    specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
    tp = om.TensorParallel(mesh, mode="allgather", specs=specs)
    tx = FAMILY_WITH_PIECES[member](tp)
    losses = nnx_losses(model, tx, normal(jax.random.key(0), (32, 16)))
  assert losses[2] < losses[1] < losses[0]
  assert model.up.kernel.sharding.spec == P(None, "model")


def test_bad_sharding_settings_raise():
  mesh = _mesh((2, 4))
  with pytest.raises(ValueError, match="sharding.axis"):
    om.TensorParallel(mesh, axis="tensor")
  with pytest.raises(ValueError, match="sharding.mode"):
    om.TensorParallel(mesh, mode="sequence")
  with pytest.raises(ValueError, match="distribute_over"):
    om.TensorParallel(mesh, distribute_over="model")
  tree = {"w": jnp.ones((30, 64))}
  with pytest.raises(ValueError, match="does not divide"):
    om.orthogonalize(
      sharding=om.TensorParallel(mesh, specs={"w": P("model", None)}),
      dimension_numbers="leading",
    ).init(tree)
  with pytest.raises(ValueError, match="entries"):
    om.orthogonalize(
      sharding=om.TensorParallel(mesh, specs={"w": P("model", None, None)}),
      dimension_numbers="leading",
    ).init(tree)
  with pytest.raises(ValueError, match="not an axis"):
    om.orthogonalize(
      sharding=om.TensorParallel(mesh, specs={"w": P("tensor", None)}),
      dimension_numbers="leading",
    ).init(tree)
  auto = _mesh((2, 4), AxisType.Auto)
  with pytest.raises(ValueError, match="specs"):
    om.orthogonalize(
      sharding=om.TensorParallel(auto), dimension_numbers="leading"
    ).update(tree, optax.EmptyState())


@pytest.mark.parametrize(
  "precision, whole",
  [("highest", False), ("high", False), ("bf16", True)],
)
def test_duplicated_normalizes_each_matrix_from_its_shards(precision, whole):
  # the max and the norm are reduced from the shards (scalars over the TP
  # axis) and the gathered matrix is only scaled: used once, so a compiler
  # short of memory has no reason to gather it again for each reduction
  # (XLA's GPU compile of Llama-3-70B did: 3x the bytes). The bf16 iterate
  # rounds the norm of the whole matrix, as torch does: it keeps its order.
  mesh = _mesh((2, 4), AxisType.Auto)
  spec = P(None, "model")
  w = jax.device_put(
    normal(jax.random.key(3), (64, 128)), NamedSharding(mesh, spec)
  )
  tx = om.scale_by_muon(
    precision=precision,
    sharding=om.TensorParallel(mesh, mode="duplicated", specs={"w": spec}),
  )
  text = jax.jit(tx.update).lower({"w": w}, tx.init({"w": w}), {"w": w})
  reduced = re.findall(
    r"stablehlo\.reduce\(.*?\) applies stablehlo\.\w+.*?: \(tensor<([\dx]+)x",
    text.as_text(),
  )
  assert reduced, "no reduction found: the pattern no longer reads the text"
  assert ("1x64x128" in reduced) == whole, reduced
  want, _ = om.scale_by_muon(precision=precision).update(
    {"w": w}, om.scale_by_muon().init({"w": w})
  )
  got, _ = jax.jit(tx.update)({"w": w}, tx.init({"w": w}), {"w": w})
  chex.assert_trees_all_close(got, want, atol=1e-5 if not whole else 2e-2)


def test_an_asynchronous_gpu_collective_counts_its_results_only():
  # XLA's GPU compiler writes an asynchronous collective as a start whose
  # type holds its operands and results, ``((operands...), (results...))``
  # for a combined one and ``((operand), result)`` for one alone, and a
  # done whose type is the results: the bytes that move are the done's,
  # once (issue 57: the single form counted 9/8 at TP 8)
  hlo = "\n".join(
    [
      "ENTRY %main () -> f32[] {",
      "  %s = ((bf16[4,2]{1,0}, bf16[8]{0}), (bf16[4,16]{1,0}, bf16[64]{0}))"
      " all-gather-start(%a, %b), dimensions={1}",
      "  %d = (bf16[4,16]{1,0}, bf16[64]{0}) all-gather-done(%s)",
      "  %t = ((bf16[8,1024]{1,0}), bf16[8,8192]{1,0}) all-gather-start(%e),"
      " dimensions={1}",
      "  %u = bf16[8,8192]{1,0} all-gather-done(%t)",
      "  %v = ((f32[8,4]{1,0}), f32[8,4]{1,0}) async-start(%g), calls=%wrapped",
      "  %w = f32[8,4]{1,0} async-done(%v), calls=%wrapped",
      "  %r = f32[16]{0} all-reduce(%c), to_apply=%add",
      "  %k = s32[] conditional(%p), true_computation=%yes,"
      " false_computation=%no",
      "}",
      "%wrapped (x: f32[8,4]) -> f32[8,4] {",
      "  %x = f32[8,4]{1,0} all-to-all(%y), dimensions={0}",
      "}",
      "%yes (x: s32[]) -> s32[] {",
      "  %q = f32[32]{0} all-reduce(%z), to_apply=%add",
      "}",
      "%no (x: s32[]) -> s32[] {",
      "  %n = f32[2]{0} all-reduce(%z), to_apply=%add",
      "}",
    ]
  )
  got = _hlo.collective_bytes(hlo)
  assert got["all-gather"] == (4 * 16 + 64 + 8 * 8192) * 2
  assert got["all-to-all"] == 8 * 4 * 4  # the wrapped one, run once
  # both branches of a GPU conditional are read (an upper bound, as on TPU)
  assert got["all-reduce"] == (16 + 32 + 2) * 4
