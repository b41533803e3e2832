"""optax_muon.integrations.levanter: ``type: optax_muon`` in a Levanter
optimizer config trains Levanter's own Llama (haliax, scanned layers) as
Levanter's ``type: muon`` does. Needs Levanter beside our jax (Python 3.11,
jax 0.10.2: pip install -e ".[test,levanter,tunix]", CI's third run)."""

import pytest

levanter = pytest.importorskip("levanter")
pytestmark = pytest.mark.integration

import draccus  # noqa: E402
import equinox as eqx  # noqa: E402
import haliax as hax  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from levanter.layers.attention import AttentionMask  # noqa: E402
from levanter.models.llama import LlamaConfig  # noqa: E402
from levanter.models.llama import LlamaLMHeadModel  # noqa: E402
from levanter.optim import OptimizerConfig  # noqa: E402

import optax_muon as om  # noqa: E402
from optax_muon.integrations import levanter as adapter  # noqa: E402

STEPS = 5
# a run's optimizer section, as Levanter's YAML gives it to draccus
SECTION = {
  "lr": 0.02,
  "adam_lr": 3e-3,
  "warmup": 0.0,
  "lr_schedule": "constant",
  "weight_decay": 0.1,
}


def _model():
  """Levanter's Llama, tiny: 2 scanned layers, 4 query and 2 KV heads."""
  config = LlamaConfig(
    seq_len=32,
    hidden_dim=64,
    intermediate_dim=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
  )
  return LlamaLMHeadModel.init(
    hax.Axis("vocab", 128), config, key=jax.random.PRNGKey(0)
  )


def _train(name, **fields):
  """``STEPS`` steps of next-token loss on one random batch; the losses and
  the trained model. (Levanter's own loss helper needs a newer jax than the
  one it installs beside here: its float loss mask is refused by jax 0.10.2's
  ``mean(where=)``; the loss is written out.)"""
  config = draccus.decode(OptimizerConfig, {"type": name, **SECTION, **fields})
  tx = config.build(STEPS)
  model = _model()
  tokens = hax.random.randint(
    jax.random.PRNGKey(1),
    (hax.Axis("batch", 4), hax.Axis("position", 32)),
    0,
    128,
  )

  def loss_fn(model):
    logits = model(tokens, attn_mask=AttentionMask.causal()).array
    return optax.softmax_cross_entropy_with_integer_labels(
      logits[:, :-1], tokens.array[:, 1:]
    ).mean()

  trainable = lambda model: eqx.filter(model, eqx.is_inexact_array)

  @eqx.filter_jit
  def step(model, state):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    updates, state = tx.update(grads, state, trainable(model))
    return eqx.apply_updates(model, updates), state, loss

  state = tx.init(trainable(model))
  losses = []
  for _ in range(STEPS):
    model, state, loss = step(model, state)
    losses.append(float(loss))
  return config, np.array(losses), trainable(model)


def test_optax_muon_by_name_trains_as_levanters_own_muon():
  ours, our_losses, our_model = _train("optax_muon")
  theirs, their_losses, their_model = _train("muon")
  assert isinstance(ours, adapter.OptaxMuonConfig)
  assert type(theirs).__name__ == "MuonConfig"
  assert our_losses[-1] < our_losses[0] - 1.0  # 5.29 -> 2.90
  # the same numbers, Newton–Schulz by optax_muon over each Linear's own axes
  np.testing.assert_allclose(our_losses, their_losses, rtol=1e-6)
  for ours_leaf, theirs_leaf in zip(
    jax.tree.leaves(our_model), jax.tree.leaves(their_model)
  ):
    np.testing.assert_allclose(ours_leaf, theirs_leaf, atol=1e-6)


def test_kimi_scaling_and_precision_reach_the_update():
  _, kimi, _ = _train("optax_muon", use_kimi_scaling=True)
  _, theirs, _ = _train("muon", use_kimi_scaling=True)
  np.testing.assert_allclose(kimi, theirs, rtol=1e-6)
  _, plain, _ = _train("optax_muon")
  assert np.abs(kimi - plain).max() > 1e-3  # another update size
  _, medium, _ = _train("optax_muon", precision="medium")
  assert medium[-1] < medium[0] - 1.0


def test_each_linear_is_viewed_by_its_named_axes():
  model = eqx.filter(_model(), eqx.is_inexact_array)
  dims = adapter.linear_dimension_numbers(model)
  attention = model.transformer.layers.stacked.self_attn
  # q_proj (GQA): (layer, kv_heads, q_heads_per_group, head_size, embed):
  # Out the three head axes, In embed, the scanned layer axis a batch
  q = attention.q_proj.weight
  names = [axis.name for axis in q.axes]
  got = dims.transformer.layers.stacked.self_attn.q_proj.weight.array
  assert got == om.MuonDimensionNumbers(
    reduction_axis=(names.index("embed"),),
    output_axis=tuple(
      names.index(axis.name)
      for axis in hax.axis.ensure_tuple(attention.q_proj.Out)
    ),
  )
  assert len(got.output_axis) == 3 and names[0] == "layer"
  assert dims.embeddings.token_embeddings.weight.array is None  # no Linear


def test_a_bad_precision_is_refused_at_build():
  config = draccus.decode(
    OptimizerConfig, {"type": "optax_muon", "precision": "fast"}
  )
  with pytest.raises(ValueError, match="precision"):
    config.build(STEPS)
