"""default_labels on a real Flax NNX GPT parameter tree."""

import jax
import pytest
from flax import nnx

import optax_muon as om
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
