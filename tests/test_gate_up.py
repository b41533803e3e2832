"""The gated-FC1 (SwiGLU) split: gate and up orthogonalized apart, as
Megatron-Core's TensorParallelMuon does for ``is_gated_fc1`` parameters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_muon as om
from conftest import gaussian

MDN = om.MuonDimensionNumbers
SPLIT = om.SplitGateUp(pattern="fc1")


def _orthogonalized(tx, tree):
  return tx.update(tree, tx.init(tree))[0]


def test_megatrons_case_gate_and_up_apart():
  # Megatron's test: a torch (out=8, in=3) weight, rows [:4] gate, [4:] up
  grad = jnp.arange(24, dtype=jnp.float32).reshape(8, 3)
  tx = om.orthogonalize(
    split_gate_up=SPLIT, dimension_numbers={"fc1": MDN((1,), (0,))}
  )
  got = _orthogonalized(tx, {"fc1": grad})["fc1"]
  want = jnp.concatenate(
    [om.newton_schulz(grad[:4]), om.newton_schulz(grad[4:])]
  )
  np.testing.assert_allclose(got, want, atol=1e-5)
  # not the whole matrix at once
  assert float(jnp.abs(got - om.newton_schulz(grad)).max()) > 1e-2


def test_flax_kernel_halves_and_their_scales():
  x = gaussian((16, 64), 1)
  tx = om.scale_by_muon(split_gate_up=SPLIT)
  got = _orthogonalized(tx, {"fc1": x})["fc1"]
  want = np.concatenate(
    [om.newton_schulz(x[:, :32]), om.newton_schulz(x[:, 32:])], 1
  ) * np.sqrt(32)
  np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("mode", ["duplicated", "distributed", "allgather"])
def test_exact_modes_equal_the_unsharded_split(mode):
  mesh = jax.make_mesh(
    (2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2
  )
  tree = {"fc1": gaussian((32, 128), 2), "down": gaussian((64, 32), 3)}
  specs = {"fc1": P(None, "model"), "down": P("model", None)}
  want = _orthogonalized(om.orthogonalize(split_gate_up=SPLIT), tree)
  tx = om.orthogonalize(
    split_gate_up=SPLIT, sharding=om.TensorParallel(mesh, mode=mode)
  )
  sharded = jax.tree.map(
    lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs
  )
  with jax.set_mesh(mesh):
    got = jax.jit(lambda t: tx.update(t, tx.init(t))[0])(sharded)
  for name in tree:
    np.testing.assert_allclose(got[name], want[name], atol=1e-5)
    assert got[name].sharding.spec == specs[name]


def test_blockwise_needs_each_shard_to_hold_both_halves():
  mesh = jax.make_mesh((4,), ("model",), axis_types=(AxisType.Explicit,))
  x = gaussian((16, 128), 4)  # 4 groups of [gate_r | up_r], 16 wide each
  sharded = {"fc1": jax.device_put(x, NamedSharding(mesh, P(None, "model")))}
  tx = om.orthogonalize(
    split_gate_up=om.SplitGateUp(groups=4, pattern="fc1"),
    sharding=om.TensorParallel(mesh, mode="blockwise"),
  )
  with jax.set_mesh(mesh):
    got = jax.jit(lambda t: tx.update(t, tx.init(t))[0])(sharded)["fc1"]
  want = np.concatenate(
    [om.newton_schulz(x[:, 16 * i : 16 * (i + 1)]) for i in range(8)], 1
  )
  np.testing.assert_allclose(got, want, atol=1e-5)
  with pytest.raises(ValueError, match="SplitGateUp"):
    tx = om.orthogonalize(
      split_gate_up=SPLIT, sharding=om.TensorParallel(mesh, mode="blockwise")
    )
    with jax.set_mesh(mesh):
      jax.jit(lambda t: tx.update(t, tx.init(t))[0])(sharded)


def test_a_leaf_with_both_splits_or_an_odd_width_raises():
  tree = {"qkv_fc1": jnp.zeros((8, 48))}
  tx = om.orthogonalize(
    split_qkv=om.SplitQKV(4, 4, 4, pattern="qkv"),
    split_gate_up=om.SplitGateUp(pattern="fc1"),
  )
  with pytest.raises(ValueError, match="both split_qkv and split_gate_up"):
    tx.init(tree)
  with pytest.raises(ValueError, match="split_gate_up"):
    om.orthogonalize(split_gate_up=SPLIT).init({"fc1": jnp.zeros((8, 7))})


@pytest.mark.parametrize("optimizer", ["muon", "adaptive_muon"])
def test_config_build_passes_the_split(optimizer):
  config = om.MuonConfig(
    optimizer=optimizer,
    muon_fp32_matmul_prec="highest",
    clip_grad=0.0,
    weight_decay=0.0,
  )
  params = {"mlp": {"fc1": gaussian((16, 64), 5)}}
  plain, split = (config.build(1.0), config.build(1.0, split_gate_up=SPLIT))
  one = plain.update(params, plain.init(params), params)[0]["mlp"]["fc1"]
  two = split.update(params, split.init(params), params)[0]["mlp"]["fc1"]
  assert float(jnp.abs(one - two).max()) > 1e-2  # the halves went apart


def test_config_splits_a_gate_up_leaf_by_default_as_megatron_does():
  params = {"mlp": {"gate_up": gaussian((16, 64), 6)}}
  base = dict(
    optimizer="muon",
    muon_fp32_matmul_prec="highest",
    clip_grad=0.0,
    weight_decay=0.0,
  )
  update = lambda tx: tx.update(params, tx.init(params), params)[0]
  by_default = update(om.MuonConfig(**base).build(1.0))
  explicit = update(
    om.MuonConfig(**base).build(1.0, split_gate_up=om.SplitGateUp())
  )
  off = update(om.MuonConfig(**base, muon_split_gate_up=False).build(1.0))
  np.testing.assert_array_equal(
    by_default["mlp"]["gate_up"], explicit["mlp"]["gate_up"]
  )
  assert (
    float(jnp.abs(by_default["mlp"]["gate_up"] - off["mlp"]["gate_up"]).max())
    > 1e-2
  )


def _swiglu_split(params, x):
  gate, up = jnp.split(x @ params["gate_up"], 2, axis=-1)
  return (jax.nn.silu(gate) * up) @ params["down"]


def _swiglu_slices(params, x):
  h = x @ params["gate_up"]
  return (h[:, 32:] * jax.nn.gelu(h[:, :32])) @ params["down"]


def _halves_added(params, x):
  gate, up = jnp.split(x @ params["gate_up"], 2, axis=-1)
  return (jax.nn.silu(gate) + up) @ params["down"]


def _gelu_mlp(params, x):
  return jax.nn.gelu(x @ params["gate_up"])[:, :32] @ params["down"]


@pytest.mark.parametrize(
  "fn, proposed",
  [
    (_swiglu_split, True),
    (_swiglu_slices, True),
    (_halves_added, False),
    (_gelu_mlp, False),
  ],
)
def test_infer_layout_proposes_the_split_when_halves_are_multiplied(
  fn, proposed
):
  params = {"gate_up": gaussian((16, 64), 1), "down": gaussian((32, 16), 2)}
  layout = om.infer_layout(fn, params, jnp.ones((3, 16)))
  reason = layout.reasons["gate_up"]
  assert ("SplitGateUp" in reason) == proposed, reason
  assert "SplitGateUp" not in layout.reasons["down"]
  # a proposal, not a decision: the view is the whole kernel either way
  assert layout.dimension_numbers["gate_up"] == MDN((0,), (1,))


def test_the_example_swiglu_mlp_is_proposed_and_split():
  from flax import nnx

  from examples.flax_lm.model import GPT
  from examples.flax_lm.model import GPTConfig

  model = GPT(
    GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=8, mlp="swiglu"),
    nnx.Rngs(0),
  )
  layout = om.infer_layout(model, jax.ShapeDtypeStruct((1, 8), jnp.int32))
  assert (
    "SplitGateUp" in layout.reasons["blocks"][0]["mlp"]["gate_up"]["kernel"]
  )
  table = om.describe(
    nnx.state(model, nnx.Param), layout=layout, split_gate_up=om.SplitGateUp()
  )
  row = next(line for line in table.splitlines() if "gate_up" in line)
  assert "split gate/up" in row and "1 × 32 × 128 + 1 × 32 × 128" in row
