"""The optax and Flax compositions users rely on, under jit and without."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import optax_muon as om
from conftest import normal


def _params():
  keys = jax.random.split(jax.random.key(0), 3)
  return {
    "dense": {
      "kernel": normal(keys[0], (16, 32)),
      "bias": jnp.zeros((32,)),
    },
    "stacked": {"kernel": normal(keys[1], (3, 32, 8))},
    "embed": {"embedding": normal(keys[2], (40, 16))},
  }


def _grads(seed):
  return jax.tree.map(
    lambda p: normal(jax.random.key(seed), p.shape), _params()
  )


def _run(tx, steps=3, update=None):
  params = _params()
  state = tx.init(params)
  update = update or tx.update
  for t in range(steps):
    updates, state = update(_grads(t), state, params)
    params = optax.apply_updates(params, updates)
  return params, state


class CompositionTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_chain_with_global_norm_clipping(self):
    tx = optax.chain(
      optax.clip_by_global_norm(1.0), om.muon(0.02, dimension_numbers="leading")
    )
    params, _ = _run(tx, update=self.variant(tx.update))

    def clip_then_muon(grads, state, params):
      norm = optax.tree.norm(grads)
      grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, 1.0 / norm), grads)
      return muon.update(grads, state, params)

    muon = om.muon(0.02, dimension_numbers="leading")
    reference, _ = _run(muon, update=clip_then_muon)
    chex.assert_trees_all_close(params, reference, atol=1e-6)
    unclipped, _ = _run(om.muon(0.02, dimension_numbers="leading"))
    assert not np.allclose(params["dense"]["bias"], unclipped["dense"]["bias"])

  @chex.variants(with_jit=True, without_jit=True)
  def test_inject_hyperparams_with_a_schedule(self):
    schedule = optax.linear_schedule(0.02, 0.0, 3)
    tx = optax.inject_hyperparams(om.muon)(
      dimension_numbers="leading",
      learning_rate=schedule,
      beta=0.9,
      steps=5,
      adam_b1=0.9,
      match_adamw_update_rms=True,
    )
    params, state = _run(tx, update=self.variant(tx.update))
    assert state.hyperparams["steps"].dtype == jnp.int32
    # the injected value is the one the last (third) update used
    np.testing.assert_allclose(
      state.hyperparams["learning_rate"], schedule(2), rtol=1e-6
    )
    reference, _ = _run(
      optax.chain(
        om.muon(
          1.0,
          beta=0.9,
          match_adamw_update_rms=True,
          dimension_numbers="leading",
        ),
        optax.scale_by_schedule(schedule),
      )
    )
    chex.assert_trees_all_close(params, reference, atol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_inject_hyperparams_traced_step_count(self):
    tx = optax.inject_hyperparams(om.orthogonalize)(
      steps=3, dimension_numbers="leading"
    )
    x = {"w": _params()["dense"]["kernel"]}
    out, _ = self.variant(tx.update)(x, tx.init(x))
    np.testing.assert_allclose(
      out["w"], om.newton_schulz(x["w"], steps=3), atol=1e-6
    )

  @chex.variants(with_jit=True, without_jit=True)
  def test_multi_steps_accumulates_then_applies(self):
    tx = optax.MultiSteps(
      om.muon(0.02, dimension_numbers="leading"), every_k_schedule=2
    )
    params = _params()
    state = tx.init(params)
    update = self.variant(tx.update)
    updates, state = update(_grads(0), state, params)
    chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, params))
    updates, state = update(_grads(1), state, params)
    mean_grad = jax.tree.map(lambda a, b: (a + b) / 2, _grads(0), _grads(1))
    reference = om.muon(0.02, dimension_numbers="leading")
    expected, _ = reference.update(mean_grad, reference.init(params), params)
    chex.assert_trees_all_close(updates, expected, atol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_apply_if_finite_skips_a_nan_step(self):
    tx = optax.apply_if_finite(
      om.muon(0.02, dimension_numbers="leading"), max_consecutive_errors=3
    )
    params = _params()
    state = tx.init(params)
    bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan), _grads(0))
    updates, state = self.variant(tx.update)(bad, state, params)
    chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, params))
    assert int(state.notfinite_count) == 1


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_like_for_like_equals_optax_contrib_muon(weight_decay):
  # optax's defaults written our way (docs/guide.md): the "simple" triple,
  # shape_scaling (its consistent_rms=None), 2-D leaves to Muon, the rest to
  # Adam; Nesterov off, where its bias correction cannot change the update
  # (Newton–Schulz is scale-invariant) and its Adam is AdamW.
  keys = jax.random.split(jax.random.key(0), 3)
  params = {
    "w": normal(keys[0], (64, 256)),
    "v": normal(keys[1], (256, 64)),
    "b": normal(keys[2], (64,)),
  }
  theirs = optax.contrib.muon(
    0.02,
    nesterov=False,
    weight_decay=weight_decay,
    adam_weight_decay=weight_decay,
  )
  ours = om.muon(
    0.02,
    nesterov=False,
    coefficients="simple",
    scale_mode="shape_scaling",
    precision="high",
    weight_decay=weight_decay,
    adam_weight_decay=weight_decay,
    labels=lambda p: jax.tree.map(
      lambda x: "muon" if x.ndim == 2 else "adam", p
    ),
    adam_weight_decay_mask=lambda p: jax.tree.map(lambda _: True, p),
  )
  p_theirs, p_ours = params, params
  s_theirs, s_ours = theirs.init(params), ours.init(params)
  for t in range(5):
    grads = jax.tree.map(
      lambda x: normal(jax.random.key(10 + t), x.shape), params
    )
    u_theirs, s_theirs = theirs.update(grads, s_theirs, p_theirs)
    u_ours, s_ours = ours.update(grads, s_ours, p_ours)
    relative = jax.tree.map(
      lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)),
      u_ours,
      u_theirs,
    )
    assert max(jax.tree.leaves(relative)) <= 1e-5, (t, relative)
    p_theirs = optax.apply_updates(p_theirs, u_theirs)
    p_ours = optax.apply_updates(p_ours, u_ours)


class _Net(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(32, 16, rngs=rngs)
    self.hidden = nnx.Linear(16, 64, rngs=rngs)
    self.out = nnx.Linear(64, 16, rngs=rngs)
    self.norm = nnx.LayerNorm(16, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    return (
      self.norm(self.out(jax.nn.relu(self.hidden(x))))
      @ self.embed.embedding[...].T
    )


def test_flax_nnx_optimizer_trains_under_jit():
  model = _Net(nnx.Rngs(0))
  optimizer = nnx.Optimizer(
    model,
    om.muon(0.02, adam_learning_rate=3e-3, dimension_numbers="leading"),
    wrt=nnx.Param,
  )
  tokens = jnp.arange(64) % 32
  targets = (tokens + 1) % 32

  @nnx.jit
  def step(model, optimizer):
    def loss_fn(model):
      logits = model(tokens)
      return optax.softmax_cross_entropy_with_integer_labels(
        logits, targets
      ).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer)) for _ in range(30)]
  assert losses[-1] < 0.5 * losses[0]
  labels = om.default_labels(nnx.state(model, nnx.Param))
  assert labels["hidden"]["kernel"].get_value() == "muon"
  assert labels["embed"]["embedding"].get_value() == "adam"
