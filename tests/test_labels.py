"""Routing labels: default_labels on a real Flax NNX GPT parameter tree, the
built-in and user patterns, and leaves that are not floating point."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import optax_muon as om
from conftest import gaussian
from examples.flax_lm.model import GPT
from examples.flax_lm.model import GPTConfig
from optax_muon._src.base import paths as _paths


def _labels_by_path(cfg, **kwargs):
  params = nnx.state(GPT(cfg, nnx.Rngs(0)), nnx.Param)
  labels = om.default_labels(params, **kwargs)
  pairs, _ = _paths.leaves_with_paths(labels)
  shapes = dict(
    _paths.leaves_with_paths(
      jax.tree.map(lambda x: x.shape, params),
      is_leaf=lambda x: isinstance(x, tuple),
    )[0]
  )
  return {"/".join(p): (label, shapes[p]) for p, label in pairs}


@pytest.fixture(scope="module")
def stacked_moe():
  cfg = GPTConfig(
    n_layer=2,
    n_embd=32,
    block_size=16,
    scan_layers=True,
    n_experts=4,
    n_kv_head=2,
  )
  return _labels_by_path(cfg)


def test_embeddings_norms_biases_and_lm_head_go_to_adam(stacked_moe):
  for path in [
    "wte/embedding",
    "wpe/embedding",
    "ln_f/scale",
    "ln_f/bias",
    "blocks/ln1/scale",
    "blocks/ln2/bias",
    "lm_head/kernel",
  ]:
    assert stacked_moe[path][0] == "adam", path


def test_stacked_attention_mlp_experts_and_router_go_to_muon(stacked_moe):
  assert stacked_moe["blocks/attn/qkv/kernel"] == ("muon", (2, 32, 64))
  assert stacked_moe["blocks/attn/proj/kernel"] == ("muon", (2, 32, 32))
  assert stacked_moe["blocks/experts/fc"] == ("muon", (2, 4, 32, 128))
  assert stacked_moe["blocks/experts/proj"] == ("muon", (2, 4, 128, 32))
  assert stacked_moe["blocks/experts/router/kernel"][0] == "muon"


def test_unstacked_model_with_separate_projections():
  labels = _labels_by_path(
    GPTConfig(n_layer=2, n_embd=32, block_size=16, fused_qkv=False, n_kv_head=1)
  )
  for name in ["query", "key", "value", "proj"]:
    assert labels[f"blocks/1/attn/{name}/kernel"][0] == "muon"
  assert labels["blocks/0/mlp/fc/kernel"][0] == "muon"
  assert labels["blocks/0/mlp/fc/bias"][0] == "adam"
  assert {label for label, shape in labels.values() if len(shape) == 1} == {
    "adam"
  }


def test_patterns_override_the_defaults(stacked_moe):
  cfg = GPTConfig(
    n_layer=2, n_embd=32, block_size=16, scan_layers=True, n_experts=4
  )
  labels = _labels_by_path(
    cfg, adam_patterns=("router",), muon_patterns=("lm_head",)
  )
  assert labels["blocks/experts/router/kernel"][0] == "adam"
  assert labels["lm_head/kernel"][0] == "muon"
  with pytest.raises(ValueError, match="muon_patterns"):
    _labels_by_path(cfg, muon_patterns=("ln_f",))


# label patterns -------------------------------------------------------------


@pytest.mark.parametrize(
  "path, label",
  [
    ("denormalizer/kernel", "muon"),
    ("embed_proj/kernel", "muon"),
    ("lnr_mlp/kernel", "muon"),
    ("headroom/kernel", "muon"),
    ("embed_tokens/embedding", "adam"),
    ("Embed_0/embedding", "adam"),
    ("ln_f/kernel", "adam"),
    ("final_norm/kernel", "adam"),
    ("LayerNorm_0/scale", "adam"),
    ("lm_head/kernel", "adam"),
    ("blocks/input_layernorm/kernel", "adam"),
    ("Dense_2/kernel", "muon"),
  ],
)
def test_built_in_patterns_match_whole_path_components(path, label):
  tree = {}
  node = tree
  *parents, leaf = path.split("/")
  for name in parents:
    node = node.setdefault(name, {})
  node[leaf] = jnp.ones((8, 8))
  assert jax.tree.leaves(om.default_labels(tree)) == [label]


def test_user_patterns_match_ignoring_case():
  params = {
    "Dense_0": {"kernel": jnp.ones((8, 8))},
    "Dense_2": {"kernel": jnp.ones((8, 8))},
  }
  labels = om.default_labels(params, adam_patterns=("Dense_2",))
  assert labels == {
    "Dense_0": {"kernel": "muon"},
    "Dense_2": {"kernel": "adam"},
  }
  assert om.default_labels(params, adam_patterns=("dense_2",)) == labels


# leaves that are not floating point -----------------------------------------


class NonFloatLeavesTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_an_integer_leaf_gets_no_update_and_no_state(self):
    params = {"w": gaussian((8, 12)), "count": jnp.arange(12).reshape(3, 4)}
    assert om.default_labels(params) == {"w": "muon", "count": "none"}
    tx = om.muon(0.1, weight_decay=0.1, dimension_numbers="leading")
    state = tx.init(params)
    grads = {
      "w": gaussian((8, 12), seed=1),
      "count": jnp.ones((3, 4), jnp.int32),
    }
    updates, state = self.variant(tx.update)(grads, state, params)
    np.testing.assert_array_equal(updates["count"], np.zeros((3, 4)))
    new_params = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(new_params["count"], params["count"])
    floats_only = om.muon(
      0.1, weight_decay=0.1, dimension_numbers="leading"
    ).init({"w": params["w"]})
    assert len(jax.tree.leaves(state)) == len(jax.tree.leaves(floats_only))
    reference = om.muon(0.1, weight_decay=0.1, dimension_numbers="leading")
    expected, _ = reference.update(
      {"w": grads["w"]}, reference.init({"w": params["w"]}), {"w": params["w"]}
    )
    # jit against eager: XLA fusion moves the Newton–Schulz by ~1e-6
    chex.assert_trees_all_close(
      updates["w"], expected["w"], rtol=1e-5, atol=1e-6
    )


def test_labels_may_freeze_a_leaf_and_must_not_train_integers():
  params = {
    "w": gaussian((8, 12)),
    "v": gaussian((8, 12), seed=1),
    "count": jnp.zeros((3, 4), jnp.int32),
  }
  tx = om.muon(
    0.1,
    labels={"w": "muon", "v": "none", "count": "none"},
    dimension_numbers="leading",
  )
  updates, _ = tx.update(params, tx.init(params), params)
  np.testing.assert_array_equal(updates["v"], np.zeros((8, 12)))
  with pytest.raises(ValueError, match="count.*int32.*'none'"):
    om.muon(
      0.1,
      labels={"w": "muon", "v": "adam", "count": "adam"},
      dimension_numbers="leading",
    ).init(params)
