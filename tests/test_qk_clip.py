"""QK-clip (MuonClip): the rule, one attention layer, and the optax transform."""

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
from conftest import gaussian

H, G, D, IN = 4, 2, 8, 16  # 4 query heads in 2 groups of 2, head_dim 8


def _reference(q, k, logits, tau, alpha):
  """The rule written out per group on (in, heads, head_dim) kernels."""
  q, k = np.array(q, np.float64), np.array(k, np.float64)
  per_group = H // G
  for g in range(G):
    s = max(logits[g * per_group : (g + 1) * per_group])
    if s > tau:
      q[:, g * per_group : (g + 1) * per_group] *= (tau / s) ** alpha
      k[:, g] *= (tau / s) ** (1 - alpha)
  return q, k


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_gqa_groups_take_the_max_over_their_heads(alpha):
  q, k = gaussian((IN, H, D), 1), gaussian((IN, G, D), 2)
  logits = np.array([20.0, 150.0, 90.0, 99.0])  # group 0 clipped, group 1 not
  new_q, new_k = om.clip_qk(
    q,
    k,
    logits,
    threshold=100.0,
    alpha=alpha,
    num_heads=H,
    num_kv_heads=G,
    head_dim=D,
  )
  want_q, want_k = _reference(q, k, logits, 100.0, alpha)
  np.testing.assert_allclose(new_q, want_q, rtol=1e-6)
  np.testing.assert_allclose(new_k, want_k, rtol=1e-6)
  # both heads of group 0 scaled (head 0, at 20, by its group's max)
  np.testing.assert_allclose(
    new_q[:, 0], q[:, 0] * (100 / 150) ** alpha, rtol=1e-6
  )
  # the group under τ: bit for bit; the flat layout gives the same numbers
  np.testing.assert_array_equal(new_q[:, 2:], q[:, 2:])
  np.testing.assert_array_equal(new_k[:, 1], k[:, 1])
  flat_q, flat_k = om.clip_qk(
    q.reshape(IN, H * D),
    k.reshape(IN, G * D),
    logits,
    threshold=100.0,
    alpha=alpha,
    num_heads=H,
    num_kv_heads=G,
    head_dim=D,
  )
  np.testing.assert_array_equal(flat_q, new_q.reshape(IN, H * D))
  np.testing.assert_array_equal(flat_k, new_k.reshape(IN, G * D))


def test_mha_and_stacked_layers_are_independent():
  q, k = gaussian((3, IN, H * D), 3), gaussian((3, IN, H * D), 4)
  logits = np.array([[50.0] * H, [400.0, 1, 1, 1], [1, 1, 1, 200.0]])
  new_q, new_k = om.clip_qk(
    q, k, logits, num_heads=H, num_kv_heads=H, head_dim=D
  )
  np.testing.assert_array_equal(new_q[0], q[0])  # layer 0: all under τ
  np.testing.assert_array_equal(new_k[0], k[0])
  for layer, head, s in ((1, 0, 400.0), (2, 3, 200.0)):
    cols = slice(head * D, (head + 1) * D)
    np.testing.assert_allclose(
      new_q[layer][:, cols], q[layer][:, cols] * (100 / s) ** 0.5, rtol=1e-6
    )
    np.testing.assert_allclose(
      new_k[layer][:, cols], k[layer][:, cols] * (100 / s) ** 0.5, rtol=1e-6
    )
    others = np.ones(H * D, bool)
    others[cols] = False  # MHA: every other head is its own group, untouched
    np.testing.assert_array_equal(new_q[layer][:, others], q[layer][:, others])


def _logits(x, q_kernel, k_kernel):
  """Max pre-softmax logit per query head of one GQA layer, (H,)."""
  q = jnp.einsum("btd,dhk->bthk", x, q_kernel.reshape(IN, H, D))
  k = jnp.einsum("btd,dgk->btgk", x, k_kernel.reshape(IN, G, D))
  k = jnp.repeat(k, H // G, axis=2)
  scores = jnp.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(D)
  return scores.max(axis=(0, 2, 3))


def test_one_layer_max_logit_after_the_clip_is_min_of_s_and_tau():
  x = gaussian((2, 6, IN), 5)
  q_kernel, k_kernel = (
    3 * gaussian((IN, H * D), 6),
    3 * gaussian((IN, G * D), 7),
  )
  before = _logits(x, q_kernel, k_kernel)
  tau = float(np.asarray(before).reshape(G, -1).max(1).mean())  # between
  new_q, new_k = om.clip_qk(
    q_kernel,
    k_kernel,
    before,
    threshold=tau,
    num_heads=H,
    num_kv_heads=G,
    head_dim=D,
  )
  after = _logits(x, new_q, new_k)
  group = lambda s: np.asarray(s).reshape(G, -1).max(1)
  assert (group(before) > tau).sum() == 1  # one group clipped, one not
  np.testing.assert_allclose(
    group(after), np.minimum(group(before), tau), rtol=1e-5
  )


@pytest.mark.parametrize("qkv_layout", ["grouped", "concatenated"])
def test_fused_qkv_in_both_layouts(qkv_layout):
  split = om.SplitQKV(H, G, D, layout=qkv_layout)
  q, k, v = (
    gaussian((IN, H * D), 1),
    gaussian((IN, G * D), 2),
    gaussian((IN, G * D), 3),
  )
  if qkv_layout == "grouped":
    per = (H // G) * D
    fused = jnp.concatenate(
      [
        jnp.concatenate(
          [
            q[:, g * per : (g + 1) * per],
            k[:, g * D : (g + 1) * D],
            v[:, g * D : (g + 1) * D],
          ],
          1,
        )
        for g in range(G)
      ],
      1,
    )
  else:
    fused = jnp.concatenate([q, k, v], 1)
  logits = jnp.array([10.0, 300.0, 5.0, 5.0])
  params = {"attn": {"qkv": fused}}
  tx = om.qk_clip(attention={"layer": {"qkv": "attn/qkv", "split_qkv": split}})
  zero = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(
    zero, tx.init(params), params, max_logits={"layer": logits}
  )
  new = params["attn"]["qkv"] + updates["attn"]["qkv"]
  want_q, want_k = om.clip_qk(
    q, k, logits, num_heads=H, num_kv_heads=G, head_dim=D
  )
  if qkv_layout == "grouped":
    per = (H // G) * D
    want = jnp.concatenate(
      [
        jnp.concatenate(
          [
            want_q[:, g * per : (g + 1) * per],
            want_k[:, g * D : (g + 1) * D],
            v[:, g * D : (g + 1) * D],
          ],
          1,
        )
        for g in range(G)
      ],
      1,
    )
  else:
    want = jnp.concatenate([want_q, want_k, v], 1)
  np.testing.assert_allclose(new, want, rtol=1e-6)


def _attention_params():
  return {
    "attn": {
      "q": {"kernel": gaussian((IN, H * D), 1)},
      "k": {"kernel": gaussian((IN, G * D), 2)},
      "v": {"kernel": gaussian((IN, G * D), 3)},
    },
    "mlp": {"kernel": gaussian((IN, 32), 4)},
  }


ATTENTION = {
  "layer": {
    "q": "attn/q/kernel",
    "k": ("attn", "k", "kernel"),
    "num_heads": H,
    "num_kv_heads": G,
    "head_dim": D,
  }
}


class QKClipTransformTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_chain_equals_clip_of_the_post_step_weights(self):
    params = _attention_params()
    grads = jax.tree.map(lambda p: gaussian(p.shape, 9), params)
    muon = om.muon(0.05, labels=jax.tree.map(lambda _: "muon", params))
    tx = optax.chain(muon, om.qk_clip(50.0, 0.5, attention=ATTENTION))
    logits = jnp.array([80.0, 10.0, 20.0, 30.0])
    updates, _ = self.variant(tx.update)(
      grads, tx.init(params), params, max_logits={"layer": logits}
    )
    plain, _ = self.variant(muon.update)(grads, muon.init(params), params)
    stepped = optax.apply_updates(params, plain)
    want_q, want_k = om.clip_qk(
      stepped["attn"]["q"]["kernel"],
      stepped["attn"]["k"]["kernel"],
      logits,
      threshold=50.0,
      num_heads=H,
      num_kv_heads=G,
      head_dim=D,
    )
    new = optax.apply_updates(params, updates)
    np.testing.assert_allclose(
      new["attn"]["q"]["kernel"], want_q, rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
      new["attn"]["k"]["kernel"], want_k, rtol=1e-5, atol=1e-6
    )
    # unclipped group's columns and other leaves: the update, bit for bit
    np.testing.assert_array_equal(
      updates["attn"]["q"]["kernel"][:, 2 * D :],
      plain["attn"]["q"]["kernel"][:, 2 * D :],
    )
    np.testing.assert_array_equal(
      updates["attn"]["v"]["kernel"], plain["attn"]["v"]["kernel"]
    )
    np.testing.assert_array_equal(
      updates["mlp"]["kernel"], plain["mlp"]["kernel"]
    )


def test_nnx_optimizer_passes_max_logits():
  class Layer(nnx.Module):
    def __init__(self, rngs):
      self.q = nnx.Linear(IN, H * D, use_bias=False, rngs=rngs)
      self.k = nnx.Linear(IN, G * D, use_bias=False, rngs=rngs)

    def __call__(self, x):
      return _logits(x, self.q.kernel[...], self.k.kernel[...])

  model = Layer(nnx.Rngs(0))
  attention = {
    "layer": {
      "q": "q/kernel",
      "k": "k/kernel",
      "num_heads": H,
      "num_kv_heads": G,
      "head_dim": D,
    }
  }
  tx = optax.chain(om.muon(1e-3), om.qk_clip(1.0, attention=attention))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  x = 4 * gaussian((2, 6, IN), 5)

  @nnx.jit
  def step(model, optimizer):
    logits, grads = nnx.value_and_grad(lambda m: m(x).sum())(model)
    del logits
    optimizer.update(model, grads, max_logits={"layer": model(x)})

  before = model(x)
  assert float(before.max()) > 1.0
  step(model, optimizer)
  # after a tiny step and the clip to τ = 1 the logits are near τ
  assert float(model(x).max()) < 1.1


def test_sharded_equals_unsharded():
  mesh = jax.make_mesh(
    (2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2
  )
  params = _attention_params()
  specs = {
    "attn": {
      "q": {"kernel": P(None, "model")},
      "k": {"kernel": P(None, "model")},
      "v": {"kernel": P(None, "model")},
    },
    "mlp": {"kernel": P("model", None)},
  }
  grads = jax.tree.map(lambda p: gaussian(p.shape, 9), params)
  labels = jax.tree.map(lambda _: "muon", params)
  logits = {"layer": jnp.array([80.0, 10.0, 20.0, 300.0])}
  unsharded = optax.chain(
    om.muon(0.05, labels=labels), om.qk_clip(50.0, attention=ATTENTION)
  )
  expected, _ = unsharded.update(
    grads, unsharded.init(params), params, max_logits=logits
  )
  tx = optax.chain(
    om.muon(
      0.05, labels=labels, sharding=om.TensorParallel(mesh, mode="duplicated")
    ),
    om.qk_clip(50.0, attention=ATTENTION),
  )
  put = lambda tree: jax.tree.map(
    lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs
  )
  with jax.set_mesh(mesh):
    sharded = put(params)
    updates, _ = jax.jit(tx.update)(
      put(grads), tx.init(sharded), sharded, max_logits=logits
    )
  chex.assert_trees_all_close(updates, expected, atol=1e-6)
  assert updates["attn"]["q"]["kernel"].sharding.spec == P(None, "model")
  # the rescale itself is local to each shard: no collectives
  clip = om.qk_clip(50.0, attention=ATTENTION)
  with jax.set_mesh(mesh):
    hlo = (
      jax.jit(
        lambda u, p: clip.update(u, clip.init(p), p, max_logits=logits)[0]
      )
      .lower(put(grads), sharded)
      .compile()
      .as_text()
    )
  for collective in (
    "all-gather",
    "all-reduce",
    "all-to-all",
    "collective-permute",
  ):
    assert f" {collective}(" not in hlo and f" {collective}-start(" not in hlo


@pytest.mark.parametrize(
  "build, match",
  [
    (lambda: om.qk_clip(attention={}), "non-empty"),
    (lambda: om.qk_clip(0.0, attention=ATTENTION), "threshold"),
    (lambda: om.qk_clip(attention={"l": {"qkv": "a"}}), "split_qkv"),
    (lambda: om.qk_clip(attention={"l": {"q": "a"}}), "lacks"),
    (
      lambda: om.qk_clip(
        attention={"layer": dict(ATTENTION["layer"], q="attn/query/kernel")}
      ).init(_attention_params()),
      "attn/query/kernel",
    ),
  ],
)
def test_bad_settings_raise(build, match):
  with pytest.raises(ValueError, match=match):
    build()


def test_config_builds_the_clip_after_the_optimizer():
  params = _attention_params()
  grads = jax.tree.map(lambda p: gaussian(p.shape, 9), params)
  logits = {"layer": jnp.array([80.0, 10.0, 20.0, 300.0])}
  config = om.MuonConfig(
    optimizer="muon",
    lr=0.05,
    qk_clip=True,
    qk_clip_threshold=50.0,
    qk_clip_alpha=0.25,
    muon_split_qkv=False,
  )
  with pytest.raises(ValueError, match="attention"):
    config.build()
  tx = config.build(attention=ATTENTION)
  updates, _ = tx.update(grads, tx.init(params), params, max_logits=logits)
  no_clip = om.MuonConfig(optimizer="muon", lr=0.05, muon_split_qkv=False)
  reference = optax.chain(
    no_clip.build(), om.qk_clip(50.0, 0.25, attention=ATTENTION)
  )
  expected, _ = reference.update(
    grads, reference.init(params), params, max_logits=logits
  )
  chex.assert_trees_all_close(updates, expected, atol=1e-7)
  plain, _ = no_clip.build().update(grads, no_clip.build().init(params), params)
  assert not np.allclose(
    updates["attn"]["q"]["kernel"], plain["attn"]["q"]["kernel"]
  )


def test_the_example_attention_equals_dot_product_attention():
  from examples.flax_lm.model import Attention
  from examples.flax_lm.model import GPTConfig

  cfg = GPTConfig(n_layer=1, n_embd=32, n_head=4, n_kv_head=2, block_size=16)
  with nnx.use_eager_sharding(False):  # no mesh: annotations are metadata
    attention = Attention(cfg, nnx.Rngs(0))
  x = gaussian((2, 16, 32), 3)
  out, max_logits = attention(x)
  per_group = cfg.n_head // cfg.kv_heads
  qkv = attention.qkv(x).reshape(2, 16, cfg.kv_heads, (per_group + 2) * 8)
  q = qkv[..., : per_group * 8].reshape(2, 16, cfg.n_head, 8)
  k, v = (
    qkv[..., per_group * 8 : (per_group + 1) * 8],
    qkv[..., (per_group + 1) * 8 :],
  )
  want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  np.testing.assert_allclose(
    out, attention.proj(want.reshape(2, 16, 32)), atol=1e-5
  )
  scores = jnp.einsum(
    "bqhd,bkhd->bhqk", q, jnp.repeat(k, per_group, 2)
  ) / np.sqrt(8)
  causal = np.tril(np.ones((16, 16), bool))
  np.testing.assert_allclose(
    max_logits, np.where(causal, scores, -np.inf).max(axis=(0, 2, 3)), rtol=1e-6
  )
