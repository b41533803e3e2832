"""Sharding read from the types: on a mesh with Explicit axes (jax 0.12's
default) each param's type carries its mesh and spec, so the family's
members need no ``sharding=``: they equal the unsharded update, keep each
param's sharding and gather only what the chosen modes gather."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_muon as om
from conftest import normal
from optax_muon._src.parallel import tensor_parallel
from optax_muon._src.views import layout

HEADS, HEAD_DIM, WIDTH, FFN = 4, 8, 32, 64
SPLITS = dict(
  split_qkv=om.SplitQKV(num_heads=HEADS, num_kv_heads=HEADS, head_dim=HEAD_DIM),
  split_gate_up=om.SplitGateUp(),  # [gate | up]: no shard holds both
)


class MegatronBlock(nnx.Module):
  """A Megatron-Core TP layer: fused QKV and fused gate-up column-parallel,
  the output projections row-parallel, the embedding and norm replicated."""

  def __init__(self, rngs, sharded=True):
    init = nnx.initializers.lecun_normal()
    column = nnx.with_partitioning(init, (None, "model")) if sharded else init
    row = nnx.with_partitioning(init, ("model", None)) if sharded else init
    self.embed = nnx.Embed(16, WIDTH, rngs=rngs)
    self.norm = nnx.RMSNorm(WIDTH, rngs=rngs)
    self.linear_qkv = nnx.Linear(
      WIDTH, 3 * HEADS * HEAD_DIM, kernel_init=column, rngs=rngs
    )
    self.linear_proj = nnx.Linear(
      HEADS * HEAD_DIM, WIDTH, kernel_init=row, use_bias=False, rngs=rngs
    )
    self.linear_fc1_gate_up = nnx.Linear(
      WIDTH, 2 * FFN, kernel_init=column, use_bias=False, rngs=rngs
    )
    self.linear_fc2 = nnx.Linear(
      FFN, WIDTH, kernel_init=row, use_bias=False, rngs=rngs
    )
    self.sharded = sharded

  def _dense(self, linear, x):
    kernel = linear.kernel[...]
    if self.sharded:  # the forward's matmuls replicated: the test is Muon's
      kernel = jax.sharding.reshard(kernel, P())
    y = x @ kernel
    return y if linear.bias is None else y + linear.bias[...]

  def __call__(self, tokens):
    x = self.norm(self.embed(tokens))
    q, k, v = jnp.split(self._dense(self.linear_qkv, x), 3, axis=-1)
    x = x + self._dense(self.linear_proj, jax.nn.softmax(q * k) * v)
    gate, up = jnp.split(self._dense(self.linear_fc1_gate_up, x), 2, axis=-1)
    up = jax.nn.silu(gate) * up
    return self.embed.attend(x + self._dense(self.linear_fc2, up))


def _explicit_mesh(shape):
  return jax.make_mesh(
    shape, ("data", "model"), axis_types=(AxisType.Explicit,) * 2
  )


def _place(model, mesh):
  """Each param of ``model`` placed on ``mesh`` as its partitioning says."""
  state = nnx.state(model, nnx.Param)
  nnx.update(model, _placed(state, nnx.get_partition_spec(state), mesh))


def _updated_params(build_tx, mesh=None, steps=3):
  """The params after ``steps`` jitted ``nnx.Optimizer`` updates with the
  same drawn gradients (placed like the params on ``mesh``)."""
  model = MegatronBlock(nnx.Rngs(0), sharded=mesh is not None)
  if mesh is not None:
    _place(model, mesh)
  optimizer = nnx.Optimizer(model, build_tx(), wrt=nnx.Param)
  params = nnx.state(model, nnx.Param)
  keys = iter(jax.random.split(jax.random.key(1), 64))

  def gradient(x):
    g = normal(next(keys), x.shape)
    return g if mesh is None else jax.device_put(g, x.sharding)

  @nnx.jit
  def step(model, optimizer, grads):
    optimizer.update(model, grads)

  for _ in range(steps):
    step(model, optimizer, jax.tree.map(gradient, params))
  return nnx.state(model, nnx.Param).to_pure_dict()


MEMBERS = {
  "muon": lambda: om.muon(0.02, precision="highest", **SPLITS),
  "adaptive_muon": lambda: om.adaptive_muon(
    0.02, precision="highest", **SPLITS
  ),
  "adaptive_muon_normuon": lambda: om.adaptive_muon(
    0.02, precision="highest", moment2_method="normuon", **SPLITS
  ),
  "polargrad": lambda: om.polargrad(0.02, precision="highest", **SPLITS),
  "muon_config": lambda: om.MuonConfig(
    optimizer="muon",
    lr=0.02,
    muon_fp32_matmul_prec="highest",
    muon_split_qkv=False,
  ).build(split_gate_up=SPLITS["split_gate_up"]),
}


@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2)])
@pytest.mark.parametrize("member", sorted(MEMBERS))
def test_explicit_mesh_needs_no_sharding_and_equals_the_unsharded_update(
  member, mesh_shape
):
  mesh = _explicit_mesh(mesh_shape)
  want = _updated_params(MEMBERS[member])
  with jax.set_mesh(mesh):
    got = _updated_params(MEMBERS[member], mesh)
  # to 1e-5 of each leaf's largest entry (NorMuon divides by a second
  # moment per row, which brings the NS's float32 rounding up to ~1e-5);
  # AdaMuon (adaptive_muon's default) divides each entry by its own, where
  # the NS output is ~0: 2e-2, as tests/test_adaptive.py's sharded cases
  tol = 2e-2 if member == "adaptive_muon" else 1e-5
  for (path, g), w in zip(
    jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)
  ):
    np.testing.assert_allclose(
      np.asarray(g),
      np.asarray(w),
      atol=tol * float(np.abs(w).max()),
      rtol=0,
      err_msg=jax.tree_util.keystr(path),
    )
  # each param keeps its sharding through the three updates
  specs = {
    path: leaf.sharding.spec
    for path, leaf in jax.tree_util.tree_leaves_with_path(got)
  }
  sharded = {
    jax.tree_util.keystr(path): spec
    for path, spec in specs.items()
    if any(entry is not None for entry in spec)
  }
  assert sharded == {
    "['linear_qkv']['kernel']": P(None, "model"),
    "['linear_fc1_gate_up']['kernel']": P(None, "model"),
    "['linear_proj']['kernel']": P("model", None),
    "['linear_fc2']['kernel']": P("model", None),
  }


def _dict_tree():
  keys = iter(jax.random.split(jax.random.key(2), 8))
  params = {
    "linear_qkv": normal(next(keys), (WIDTH, 3 * HEADS * HEAD_DIM)),
    "linear_proj": normal(next(keys), (HEADS * HEAD_DIM, WIDTH)),
    "linear_fc1_gate_up": normal(next(keys), (WIDTH, 2 * FFN)),
    "linear_fc2": normal(next(keys), (FFN, WIDTH)),
    "stacked": normal(next(keys), (4, WIDTH, FFN)),
  }
  specs = {
    "linear_qkv": P(None, "model"),
    "linear_proj": P("model", None),
    "linear_fc1_gate_up": P(None, "model"),
    "linear_fc2": P("model", None),
    "stacked": P("data", None, "model"),
  }
  return params, specs


def _placed(params, specs, mesh):
  return jax.tree.map(
    lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs
  )


def _three_updates(tx, params):
  state, out = tx.init(params), []
  update = jax.jit(tx.update)
  for i in range(3):
    grads = jax.tree.map(lambda x, i=i: jnp.sin(x * (i + 1)), params)
    updates, state = update(grads, state, params)
    out.append(jax.tree.map(np.asarray, updates))
  return out


def test_muon_bp_on_explicit_types_equals_itself_given_the_same_shards():
  # its block steps are the shards by design: the types name them
  params, specs = _dict_tree()
  build = lambda **kw: om.muon_bp(
    0.02, period=2, precision="highest", dimension_numbers="leading", **kw
  )
  explicit = _explicit_mesh((2, 4))
  with jax.set_mesh(explicit):
    got = _three_updates(build(), _placed(params, specs, explicit))
  auto = jax.make_mesh(
    (2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2
  )
  tp = om.TensorParallel(auto, mode="duplicated", specs=specs)
  want = _three_updates(build(sharding=tp), _placed(params, specs, auto))
  unsharded = _three_updates(build(), params)
  for step in range(3):
    for name in params:
      np.testing.assert_allclose(got[step][name], want[step][name], atol=1e-5)
  # step 1 is a block step: the sharded leaves' updates are the shards' NS
  assert np.abs(got[1]["linear_fc2"] - unsharded[1]["linear_fc2"]).max() > 1e-2
  np.testing.assert_allclose(
    got[0]["linear_fc2"], unsharded[0]["linear_fc2"], atol=1e-5
  )


def test_explicit_types_compile_to_the_chosen_modes_collectives():
  from conftest import update_collectives

  params, specs = _dict_tree()
  mesh = _explicit_mesh((2, 4))
  tx = om.scale_by_muon(precision="highest", dimension_numbers="leading")
  with jax.set_mesh(mesh):
    got = update_collectives(tx, params, specs, mesh)
  table = str(
    om.describe(_placed(params, specs, mesh), dimension_numbers="leading")
  )
  modes = dict(
    re.findall(r"^(\S+) .*?\b(duplicated|distributed|allgather)\b", table, re.M)
  )
  assert set(modes) == set(params), table  # every leaf sharded over model
  # only the duplicated leaves are gathered, each once, whole
  gathered = sum(
    params[name].size * 4
    for name, mode in modes.items()
    if mode == "duplicated"
  )
  assert got["all-gather"] == gathered, (got, table)
  # and no mode moves the whole model: less than one gather of every leaf
  whole = sum(x.size * 4 for x in params.values())
  assert sum(got.values()) < whole, got


def test_the_tp_axis_is_the_one_splitting_the_matrices():
  # MaxText names its TP axis "tensor": no "model" axis, so the axis that
  # splits the most matrix elements is TP, the other (FSDP) gathered
  mesh = jax.make_mesh(
    (2, 4), ("fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 2
  )
  params, _ = _dict_tree()
  specs = {
    "linear_qkv": P("fsdp", "tensor"),
    "linear_proj": P("tensor", "fsdp"),
    "linear_fc1_gate_up": P("fsdp", "tensor"),
    "linear_fc2": P("tensor", None),
    "stacked": P("fsdp", None, "tensor"),
  }
  placed = _placed(params, specs, mesh)
  leaves = jax.tree.leaves(placed)
  views = [layout.matrix_view(x.shape, "leading") for x in leaves]
  tp = tensor_parallel.from_types(leaves, views)
  assert (tp.axis, tp.mode) == ("tensor", "auto")
  assert tp.mesh.shape == {"fsdp": 2, "tensor": 4}
  # an axis the setting names, when the mesh has it, is taken as named
  named = tensor_parallel.from_types(
    leaves, views, om.TensorParallel(mesh=None, axis="fsdp", mode="allgather")
  )
  assert (named.axis, named.mode) == ("fsdp", "allgather")
  want = om.scale_by_muon(precision="highest", dimension_numbers="leading")
  state = want.init(params)
  with jax.set_mesh(mesh):
    got, _ = jax.jit(want.update)(placed, want.init(placed))
  expected, _ = want.update(params, state)
  for name in params:
    np.testing.assert_allclose(got[name], expected[name], atol=1e-5)
    assert got[name].sharding.spec == specs[name]


def test_arrays_on_no_explicit_mesh_run_unsharded_and_mixed_meshes_raise():
  params, specs = _dict_tree()
  leaves = jax.tree.leaves(params)
  assert tensor_parallel.from_types(leaves, [None] * len(leaves)) is None
  auto = jax.make_mesh(
    (2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2
  )
  on_auto = jax.tree.leaves(_placed(params, specs, auto))
  assert tensor_parallel.from_types(on_auto, [None] * len(leaves)) is None
  other = jax.make_mesh(
    (4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2
  )
  two = [
    jax.device_put(leaves[0], NamedSharding(_explicit_mesh((2, 4)), P())),
    jax.device_put(leaves[1], NamedSharding(other, P())),
  ]
  with pytest.raises(ValueError, match="2 different meshes"):
    tensor_parallel.from_types(two, [None, None])
  mixed = jax.make_mesh(
    (2, 4), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Auto)
  )
  with pytest.raises(ValueError, match="mixes Explicit and Auto"):
    tensor_parallel.from_types(
      [jax.device_put(leaves[0], NamedSharding(mixed, P()))], [None]
    )
  with pytest.raises(ValueError, match=r"sharding.mesh must be .*or None"):
    om.TensorParallel(mesh="data")
  with pytest.raises(ValueError, match="sharding.mode"):
    om.TensorParallel(mesh=None, mode="bogus")


def test_dion2_takes_auto_among_exact_modes_and_the_dions_need_a_mesh():
  params, specs = _dict_tree()
  del params["stacked"]
  del specs["stacked"]
  mesh = jax.make_mesh(
    (2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2
  )
  placed = _placed(params, specs, mesh)
  auto = om.TensorParallel(mesh, mode="auto", specs=specs)
  exact = om.TensorParallel(mesh, mode="duplicated", specs=specs)
  got = _three_updates(
    om.dion2(0.02, precision="highest", sharding=auto), placed
  )
  want = _three_updates(
    om.dion2(0.02, precision="highest", sharding=exact), placed
  )
  for step in range(3):
    for name in params:
      np.testing.assert_allclose(got[step][name], want[step][name], atol=1e-5)
  blockwise_too = om.TensorParallel(
    mesh, mode="auto", auto_modes=("blockwise", "duplicated"), specs=specs
  )
  with pytest.raises(ValueError, match="auto among exact modes only"):
    om.dion2(0.02, sharding=blockwise_too)
  for member in (om.dion2, om.dion):
    with pytest.raises(ValueError, match="sharding.mesh=None is not accepted"):
      member(0.02, sharding=om.TensorParallel(None, mode="distributed"))


@pytest.mark.parametrize(
  "mode", [None, "duplicated", "distributed", "allgather"]
)
def test_adaptive_muon_splits_a_fused_kernel_sharded_along_its_fan_out(mode):
  # the fused gate-up is [gate | up] over 4 shards (no shard holds both
  # halves) and the QKV [Q | K | V]: cutting them into their pieces on an
  # Explicit mesh is XLA's (issue 57 item 2: a ShardingTypeError at init)
  mesh = _explicit_mesh((2, 4))
  keys = iter(jax.random.split(jax.random.key(3), 4))
  params = {
    "gate_up": normal(next(keys), (64, 256)),
    "qkv": normal(next(keys), (64, 3 * 64)),
  }
  specs = {"gate_up": P(None, "model"), "qkv": P(None, "model")}
  splits = dict(
    split_gate_up=om.SplitGateUp(),
    split_qkv=om.SplitQKV(8, 8, 8, layout="concatenated"),
  )
  build = lambda sharding=None: om.adaptive_muon(
    0.01,
    moment2_method="normuon",
    precision="highest",
    sharding=sharding,
    **splits,
  )
  sharding = None if mode is None else om.TensorParallel(mesh, mode=mode)
  with jax.set_mesh(mesh):
    got = _three_updates(build(sharding), _placed(params, specs, mesh))
    state = build(sharding).init(_placed(params, specs, mesh))
  want = _three_updates(build(), params)
  for step in range(3):
    for name in params:
      np.testing.assert_allclose(
        got[step][name], want[step][name], atol=1e-5, err_msg=name
      )
  # the second moment of each piece stays split like its param's fan-out
  moments = [
    x.sharding.spec
    for x in jax.tree.leaves(state)
    if getattr(x, "ndim", 0) >= 2 and x.shape[-1] >= 64
  ]
  assert moments and all(spec[-1] == "model" for spec in moments), moments


def test_jax_0_12s_default_mesh_needs_no_sharding():
  # jax >= 0.12: jax.make_mesh's axes are Explicit unless told otherwise
  if (
    jax.sharding.AxisType.Explicit not in jax.make_mesh((8,), ("x",)).axis_types
  ):
    pytest.skip("this jax's make_mesh defaults to Auto axes (before 0.12)")
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  params, specs = _dict_tree()
  tx = om.muon(0.02, precision="highest", dimension_numbers="leading")
  with jax.set_mesh(mesh):
    got = _three_updates(tx, _placed(params, specs, mesh))
  want = _three_updates(tx, params)
  for step in range(3):
    for name in params:
      np.testing.assert_allclose(got[step][name], want[step][name], atol=1e-5)
