"""QK-clip for multi-head latent attention (MLA): MaxText's cases and the rule.

The first tests port MaxText's own ``tests/unit/qk_clip_test.py`` cases
(``src/maxtext/utils/qk_clip_utils.py`` is the oracle): kernels in its
``[rank, heads, dim]`` layout, ``wq_b`` per head ``[q_nope | q_rope]``,
``wkv_b`` per head ``[k_nope | v]``, ``max_logits`` ``[batch, heads]``
reduced over the batch (MaxText reduces it inside the clip; we take per-head
values).
"""

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
from conftest import normal


def _maxtext_clip(wq_b, wkv_b, max_logits_batch, threshold, nope):
  """MaxText's arguments in our call: heads from the kernel, rope and v
  widths the rest of each head's columns."""
  heads, width = wq_b.shape[-2:]
  return om.clip_mla_qk(
    wq_b,
    wkv_b,
    jnp.max(max_logits_batch, axis=0),
    threshold=threshold,
    num_heads=heads,
    qk_nope_head_dim=nope,
    qk_rope_head_dim=width - nope,
    v_head_dim=wkv_b.shape[-1] - nope,
  )


def test_maxtext_apply_qk_clip_logic():
  rng_q, rng_kv = jax.random.split(jax.random.PRNGKey(0))
  wq_b = normal(rng_q, (2, 2, 6))  # [rank, heads, dim]
  wkv_b = normal(rng_kv, (2, 2, 6))
  # head 0: 20 > 10, γ = 0.5; head 1: 5 < 10, untouched
  new_wq, new_wkv = _maxtext_clip(
    wq_b, wkv_b, jnp.array([[20.0, 5.0]]), 10.0, 4
  )
  np.testing.assert_allclose(
    new_wq[:, 0, :4], wq_b[:, 0, :4] * np.sqrt(0.5), rtol=1e-6
  )
  np.testing.assert_allclose(new_wq[:, 0, 4:], wq_b[:, 0, 4:] * 0.5, rtol=1e-6)
  np.testing.assert_allclose(
    new_wkv[:, 0, :4], wkv_b[:, 0, :4] * np.sqrt(0.5), rtol=1e-6
  )
  np.testing.assert_array_equal(new_wkv[:, 0, 4:], wkv_b[:, 0, 4:])  # V
  np.testing.assert_array_equal(new_wq[:, 1], wq_b[:, 1])
  np.testing.assert_array_equal(new_wkv[:, 1], wkv_b[:, 1])


def test_maxtext_per_head_clipping():
  wq_b = normal(jax.random.PRNGKey(1), (1, 3, 6))
  new_wq, _ = _maxtext_clip(
    wq_b, jnp.zeros((1, 3, 6)), jnp.array([[40.0, 9.9, 1.0]]), 10.0, 4
  )
  np.testing.assert_allclose(
    new_wq[0, 0, 0], wq_b[0, 0, 0] * np.sqrt(0.25), rtol=1e-6
  )
  np.testing.assert_array_equal(new_wq[0, 1:], wq_b[0, 1:])


def test_maxtext_no_clipping_below_threshold_and_parity_case():
  wq_b = normal(jax.random.PRNGKey(2), (2, 1, 6))
  new_wq, new_wkv = _maxtext_clip(wq_b, wq_b, jnp.array([[50.0]]), 100.0, 4)
  np.testing.assert_array_equal(new_wq, wq_b)
  np.testing.assert_array_equal(new_wkv, wq_b)
  # MaxText's Linen/NNX parity case: logits [40, 9] at τ = 10
  rng_q, rng_kv = jax.random.split(jax.random.PRNGKey(7))
  wq_b = normal(rng_q, (2, 2, 6))
  wkv_b = normal(rng_kv, (2, 2, 6))
  new_wq, new_wkv = _maxtext_clip(
    wq_b, wkv_b, jnp.array([[40.0, 9.0]]), 10.0, 4
  )
  np.testing.assert_allclose(
    new_wq[:, 0],
    np.concatenate([wq_b[:, 0, :4] * 0.5, wq_b[:, 0, 4:] * 0.25], -1),
    rtol=1e-6,
  )
  np.testing.assert_allclose(
    new_wkv[:, 0],
    np.concatenate([wkv_b[:, 0, :4] * 0.5, wkv_b[:, 0, 4:]], -1),
    rtol=1e-6,
  )


# A small MLA layer (DeepSeek-V2 without the latent norms), every kernel
# in Flax's (in, out) layout.
D_MODEL, H, NOPE, ROPE, V_DIM, Q_RANK, KV_RANK = 16, 4, 8, 4, 8, 12, 10


def _mla_params(seed=0, scale=1.0):
  shapes = {
    "wq_a": (D_MODEL, Q_RANK),
    "wq_b": (Q_RANK, H * (NOPE + ROPE)),
    "wkv_a": (D_MODEL, KV_RANK + ROPE),
    "wkv_b": (KV_RANK, H * (NOPE + V_DIM)),
  }
  return {
    name: scale * gaussian(shape, seed + i)
    for i, (name, shape) in enumerate(shapes.items())
  }


def _rope(x, positions):
  """Rotary embedding over the last axis (pairs of halves)."""
  half = x.shape[-1] // 2
  angle = positions[:, None] / 100.0 ** (np.arange(half) / half)
  angle = angle.reshape(angle.shape[:1] + (1,) * (x.ndim - 3) + angle.shape[1:])
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _mla_max_logits(params, x):
  """Per-head max pre-softmax logit of causal MLA over ``x`` ``(b, t, d)``."""
  b, t, _ = x.shape
  positions = jnp.arange(t, dtype=jnp.float32)
  q = (x @ params["wq_a"] @ params["wq_b"]).reshape(b, t, H, NOPE + ROPE)
  q_nope, q_rope = q[..., :NOPE], _rope(q[..., NOPE:], positions)
  latent = x @ params["wkv_a"]
  k_rope = _rope(latent[..., KV_RANK:], positions)  # (b, t, ROPE): shared
  kv = (latent[..., :KV_RANK] @ params["wkv_b"]).reshape(b, t, H, NOPE + V_DIM)
  scores = (
    jnp.einsum("bqhd,bkhd->bhqk", q_nope, kv[..., :NOPE])
    + jnp.einsum("bqhd,bkd->bhqk", q_rope, k_rope)
  ) / np.sqrt(NOPE + ROPE)
  causal = jnp.tril(jnp.ones((t, t), bool))
  return jnp.where(causal, scores, -jnp.inf).max(axis=(0, 2, 3))


MLA = {
  "layer": {
    "q": "wq_b",
    "kv": "wkv_b",
    "num_heads": H,
    "qk_nope_head_dim": NOPE,
    "qk_rope_head_dim": ROPE,
    "v_head_dim": V_DIM,
  }
}


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_after_the_clip_each_heads_max_logit_is_min_of_s_and_tau(alpha):
  params, x = _mla_params(), gaussian((2, 6, D_MODEL), 9)
  before = _mla_max_logits(params, x)
  tau = float(np.median(before))  # two heads over τ, two under
  new_q, new_kv = om.clip_mla_qk(
    params["wq_b"],
    params["wkv_b"],
    before,
    threshold=tau,
    alpha=alpha,
    num_heads=H,
    qk_nope_head_dim=NOPE,
    qk_rope_head_dim=ROPE,
    v_head_dim=V_DIM,
  )
  after = _mla_max_logits(dict(params, wq_b=new_q, wkv_b=new_kv), x)
  assert (before > tau).sum() == 2
  np.testing.assert_allclose(after, np.minimum(before, tau), rtol=1e-5)
  # heads under τ and every V column bit for bit; the flat and the
  # (in, heads, dim) layouts give the same numbers
  under = np.repeat(np.asarray(before <= tau), NOPE + ROPE)
  np.testing.assert_array_equal(new_q[:, under], params["wq_b"][:, under])
  v_columns = np.tile(np.arange(NOPE + V_DIM) >= NOPE, H)
  np.testing.assert_array_equal(
    new_kv[:, v_columns], params["wkv_b"][:, v_columns]
  )
  per_head_q, per_head_kv = om.clip_mla_qk(
    params["wq_b"].reshape(Q_RANK, H, -1),
    params["wkv_b"].reshape(KV_RANK, H, -1),
    before,
    threshold=tau,
    alpha=alpha,
    num_heads=H,
    qk_nope_head_dim=NOPE,
    qk_rope_head_dim=ROPE,
    v_head_dim=V_DIM,
  )
  np.testing.assert_array_equal(per_head_q.reshape(new_q.shape), new_q)
  np.testing.assert_array_equal(per_head_kv.reshape(new_kv.shape), new_kv)


def test_the_transform_leaves_the_shared_rope_key_and_stacked_layers_apart():
  layers = [_mla_params(seed) for seed in (0, 10, 20)]
  params = jax.tree.map(lambda *leaves: jnp.stack(leaves), *layers)
  logits = jnp.array(
    [[5.0, 5.0, 5.0, 5.0], [300.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 150.0]]
  )
  grads = jax.tree.map(lambda p: 0.01 * gaussian(p.shape, 5), params)
  tx = optax.chain(optax.sgd(1.0), om.qk_clip(100.0, attention=MLA))
  updates, _ = tx.update(
    grads, tx.init(params), params, max_logits={"layer": logits}
  )
  new = optax.apply_updates(params, updates)
  stepped = jax.tree.map(lambda p, g: p - g, params, grads)
  for name in ("wq_a", "wkv_a"):  # the shared rope key's kernel: untouched
    np.testing.assert_array_equal(new[name], stepped[name])
  want_q, want_kv = om.clip_mla_qk(
    stepped["wq_b"],
    stepped["wkv_b"],
    logits,
    threshold=100.0,
    num_heads=H,
    qk_nope_head_dim=NOPE,
    qk_rope_head_dim=ROPE,
    v_head_dim=V_DIM,
  )
  np.testing.assert_allclose(new["wq_b"], want_q, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(new["wkv_b"], want_kv, rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(new["wq_b"][0], stepped["wq_b"][0])  # under τ
  head0 = slice(0, NOPE + ROPE)
  np.testing.assert_allclose(
    new["wq_b"][1][:, head0],
    np.concatenate(
      [
        stepped["wq_b"][1][:, :NOPE] * (1 / 3) ** 0.5,
        stepped["wq_b"][1][:, NOPE : NOPE + ROPE] / 3,
      ],
      -1,
    ),
    rtol=1e-6,
  )


def test_sharded_over_heads_needs_no_collectives():
  mesh = jax.make_mesh(
    (2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2
  )
  params = _mla_params()
  specs = {
    "wq_a": P(),
    "wq_b": P(None, "model"),
    "wkv_a": P(),
    "wkv_b": P(None, "model"),
  }  # one head per shard
  updates = jax.tree.map(lambda p: gaussian(p.shape, 3), params)
  logits = {"layer": jnp.array([400.0, 10.0, 250.0, 1.0])}
  clip = om.qk_clip(100.0, attention=MLA)
  expected, _ = clip.update(
    updates, clip.init(params), params, max_logits=logits
  )
  put = lambda tree: jax.tree.map(
    lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs
  )
  step = jax.jit(
    lambda u, p: clip.update(u, clip.init(p), p, max_logits=logits)[0]
  )
  with jax.set_mesh(mesh):
    sharded = step(put(updates), put(params))
    hlo = step.lower(put(updates), put(params)).compile().as_text()
  chex.assert_trees_all_close(sharded, expected, atol=1e-6)
  assert sharded["wq_b"].sharding.spec == P(None, "model")
  for collective in (
    "all-gather",
    "all-reduce",
    "all-to-all",
    "collective-permute",
  ):
    assert f" {collective}(" not in hlo and f" {collective}-start(" not in hlo


@pytest.mark.parametrize(
  "spec, match",
  [
    ({"q": "wq_b", "kv": "wkv_b", "num_heads": H}, "lacks"),
    (dict(MLA["layer"], qk_nope_head_dim=0), "qk_nope_head_dim"),
    (dict(MLA["layer"], head_dim=8), "unknown keys"),
  ],
)
def test_bad_mla_specs_raise_naming_the_field(spec, match):
  with pytest.raises(ValueError, match=match):
    om.qk_clip(attention={"layer": spec})


def test_missing_max_logits_is_an_error_not_a_silent_skip():
  # MaxText skips a layer without statistics; a missing entry here is a
  # wiring mistake, so it raises.
  params = _mla_params()
  clip = om.qk_clip(attention=MLA)
  with pytest.raises(ValueError, match="no entry for attention layers"):
    clip.update(params, clip.init(params), params, max_logits={})


# -- scanned kernels whose layer axis is not leading (MaxText param_scan_axis=1)


def _scanned_maxtext(layers=3, rank=2, heads=2, nope=4, rope=2, v=4, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 2)
  wq_b = normal(keys[0], (rank, layers, heads, nope + rope))
  wkv_b = normal(keys[1], (rank, layers, heads, nope + v))
  logits = jnp.array([[20.0, 5.0], [1.0, 30.0], [50.0, 50.0]])[:layers]
  dims = dict(
    num_heads=heads, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v
  )
  return wq_b, wkv_b, logits, dims


def test_mla_clip_with_the_layer_axis_second_equals_the_leading_axis_result():
  wq_b, wkv_b, logits, dims = _scanned_maxtext()
  got = om.clip_mla_qk(
    wq_b, wkv_b, logits, threshold=10.0, layer_axis=1, **dims
  )
  # by hand: layers to the front, the leading-axis clip, back
  front = [jnp.moveaxis(w, 1, 0) for w in (wq_b, wkv_b)]
  want = om.clip_mla_qk(*front, logits, threshold=10.0, **dims)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, jnp.moveaxis(w, 0, 1))
  # and per layer it is MaxText's own rule on that layer's kernels
  for layer in range(3):
    q, kv = _maxtext_clip(
      wq_b[:, layer], wkv_b[:, layer], logits[layer][None], 10.0, 4
    )
    np.testing.assert_allclose(got[0][:, layer], q, rtol=1e-6)
    np.testing.assert_allclose(got[1][:, layer], kv, rtol=1e-6)


def test_the_transform_takes_a_layer_axis_per_attention_layer():
  wq_b, wkv_b, logits, dims = _scanned_maxtext()
  params = {"wq_b": wq_b, "wkv_b": wkv_b}
  spec = {"q": "wq_b", "kv": "wkv_b", "layer_axis": 1, **dims}
  tx = optax.chain(optax.sgd(1.0), om.qk_clip(10.0, attention={"l": spec}))
  grads = jax.tree.map(lambda p: 0.01 * gaussian(p.shape, 3), params)
  updates, _ = tx.update(
    grads, tx.init(params), params, max_logits={"l": logits}
  )
  new = optax.apply_updates(params, updates)
  stepped = jax.tree.map(lambda p, g: p - g, params, grads)
  want = om.clip_mla_qk(
    stepped["wq_b"],
    stepped["wkv_b"],
    logits,
    threshold=10.0,
    layer_axis=1,
    **dims,
  )
  np.testing.assert_allclose(new["wq_b"], want[0], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(new["wkv_b"], want[1], rtol=1e-6, atol=1e-7)


def test_scanned_clip_errors_name_the_expected_shapes():
  wq_b, wkv_b, logits, dims = _scanned_maxtext()
  # without layer_axis the layers axis is read as heads: a clear error
  with pytest.raises(ValueError, match="max_logits|width"):
    om.clip_mla_qk(wq_b, wkv_b, logits, **dims)
  with pytest.raises(ValueError, match=r"max_logits must be \(3, num_heads\)"):
    om.clip_mla_qk(wq_b, wkv_b, logits[:2], layer_axis=1, **dims)
  with pytest.raises(ValueError, match="layer_axis=3"):
    om.clip_mla_qk(wq_b, wkv_b, logits, layer_axis=3, **dims)
  # head sizes that do not match the kernel: at init, naming the fields
  params = {"wq_b": wq_b, "wkv_b": wkv_b}
  bad = dict(dims, qk_rope_head_dim=3)
  tx = om.qk_clip(
    attention={"l": {"q": "wq_b", "kv": "wkv_b", "layer_axis": 1, **bad}}
  )
  with pytest.raises(ValueError, match="qk_rope_head_dim"):
    tx.init(params)


@pytest.mark.parametrize("bad", [jnp.inf, jnp.nan])
def test_a_non_finite_max_logit_leaves_its_group_unchanged(bad):
  q = gaussian((16, 4 * 8), 1)
  k = gaussian((16, 2 * 8), 2)
  # group 0 (heads 0, 1) has a non-finite logit; group 1 is clipped
  logits = jnp.array([bad, 5.0, 300.0, 1.0])
  new_q, new_k = om.clip_qk(
    q, k, logits, threshold=100.0, num_heads=4, num_kv_heads=2, head_dim=8
  )
  np.testing.assert_array_equal(new_q[:, :16], q[:, :16])  # not zeroed
  np.testing.assert_array_equal(new_k[:, :8], k[:, :8])
  eta = 100.0 / 300.0
  np.testing.assert_allclose(new_q[:, 16:], q[:, 16:] * eta**0.5, rtol=1e-6)
  np.testing.assert_allclose(new_k[:, 8:], k[:, 8:] * eta**0.5, rtol=1e-6)
