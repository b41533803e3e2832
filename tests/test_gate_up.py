"""The gated-FC1 (SwiGLU) split: gate and up orthogonalized apart, as
Megatron-Core's TensorParallelMuon does for ``is_gated_fc1`` parameters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import optax_muon as om
from conftest import gaussian

MDN = om.MuonDimensionNumbers
SPLIT = om.SplitGateUp(pattern="fc1")


def _orthogonalized(tx, tree):
  return tx.update(tree, tx.init(tree))[0]


def test_megatrons_case_gate_and_up_apart():
  # Megatron's test: a torch (out=8, in=3) weight, rows [:4] gate, [4:] up
  grad = jnp.arange(24, dtype=jnp.float32).reshape(8, 3)
  tx = om.orthogonalize(split_gate_up=SPLIT,
                        dimension_numbers={"fc1": MDN((1,), (0,))})
  got = _orthogonalized(tx, {"fc1": grad})["fc1"]
  want = jnp.concatenate([om.newton_schulz(grad[:4]),
                          om.newton_schulz(grad[4:])])
  np.testing.assert_allclose(got, want, atol=1e-5)
  # not the whole matrix at once
  assert float(jnp.abs(got - om.newton_schulz(grad)).max()) > 1e-2


def test_flax_kernel_halves_and_their_scales():
  x = gaussian((16, 64), 1)
  tx = om.scale_by_muon(split_gate_up=SPLIT)
  got = _orthogonalized(tx, {"fc1": x})["fc1"]
  want = np.concatenate([om.newton_schulz(x[:, :32]),
                         om.newton_schulz(x[:, 32:])], 1) * np.sqrt(32)
  np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("mode", ["duplicated", "distributed", "allgather"])
def test_exact_modes_equal_the_unsharded_split(mode):
  mesh = jax.make_mesh((2, 4), ("data", "model"),
                       axis_types=(AxisType.Explicit,) * 2)
  tree = {"fc1": gaussian((32, 128), 2), "down": gaussian((64, 32), 3)}
  specs = {"fc1": P(None, "model"), "down": P("model", None)}
  want = _orthogonalized(om.orthogonalize(split_gate_up=SPLIT), tree)
  tx = om.orthogonalize(split_gate_up=SPLIT,
                        sharding=om.TensorParallel(mesh, mode=mode))
  sharded = jax.tree.map(lambda x, s: jax.device_put(
      x, NamedSharding(mesh, s)), tree, specs)
  with jax.set_mesh(mesh):
    got = jax.jit(lambda t: tx.update(t, tx.init(t))[0])(sharded)
  for name in tree:
    np.testing.assert_allclose(got[name], want[name], atol=1e-5)
    assert got[name].sharding.spec == specs[name]


def test_blockwise_needs_each_shard_to_hold_both_halves():
  mesh = jax.make_mesh((4,), ("model",), axis_types=(AxisType.Explicit,))
  x = gaussian((16, 128), 4)  # 4 groups of [gate_r | up_r], 16 wide each
  sharded = {"fc1": jax.device_put(x, NamedSharding(mesh, P(None, "model")))}
  tx = om.orthogonalize(split_gate_up=om.SplitGateUp(groups=4, pattern="fc1"),
                        sharding=om.TensorParallel(mesh, mode="blockwise"))
  with jax.set_mesh(mesh):
    got = jax.jit(lambda t: tx.update(t, tx.init(t))[0])(sharded)["fc1"]
  want = np.concatenate([om.newton_schulz(x[:, 16 * i:16 * (i + 1)])
                         for i in range(8)], 1)
  np.testing.assert_allclose(got, want, atol=1e-5)
  with pytest.raises(ValueError, match="SplitGateUp"):
    tx = om.orthogonalize(split_gate_up=SPLIT, sharding=om.TensorParallel(
        mesh, mode="blockwise"))
    with jax.set_mesh(mesh):
      jax.jit(lambda t: tx.update(t, tx.init(t))[0])(sharded)


def test_a_leaf_with_both_splits_or_an_odd_width_raises():
  tree = {"qkv_fc1": jnp.zeros((8, 48))}
  tx = om.orthogonalize(split_qkv=om.SplitQKV(4, 4, 4, pattern="qkv"),
                        split_gate_up=om.SplitGateUp(pattern="fc1"))
  with pytest.raises(ValueError, match="both split_qkv and split_gate_up"):
    tx.init(tree)
  with pytest.raises(ValueError, match="split_gate_up"):
    om.orthogonalize(split_gate_up=SPLIT).init({"fc1": jnp.zeros((8, 7))})


@pytest.mark.parametrize("optimizer", ["muon", "adaptive_muon"])
def test_config_build_passes_the_split(optimizer):
  config = om.MuonConfig(optimizer=optimizer, muon_fp32_matmul_prec="highest",
                         clip_grad=0.0, weight_decay=0.0)
  params = {"mlp": {"fc1": gaussian((16, 64), 5)}}
  plain, split = (config.build(1.0), config.build(1.0, split_gate_up=SPLIT))
  one = plain.update(params, plain.init(params), params)[0]["mlp"]["fc1"]
  two = split.update(params, split.init(params), params)[0]["mlp"]["fc1"]
  assert float(jnp.abs(one - two).max()) > 1e-2  # the halves went apart
