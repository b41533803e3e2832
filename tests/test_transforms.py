"""momentum, orthogonalize, scale_by_shape and the muon chain, piece by piece."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_muon as om
from conftest import gaussian
from optax_muon._src.views import layout

MDN = om.MuonDimensionNumbers


class MomentumTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_styles_and_nesterov_follow_the_formulas(self):
    beta, grads = 0.9, [gaussian((3, 4), i) for i in range(3)]
    for style, nesterov in [
      ("ema", True),
      ("ema", False),
      ("sgd", True),
      ("sgd", False),
    ]:
      tx = om.momentum(beta, nesterov=nesterov, style=style)
      state, update = tx.init(grads[0]), self.variant(tx.update)
      m = np.zeros((3, 4))
      w = 1 - beta if style == "ema" else 1.0
      for g in grads:
        out, state = update(g, state)
        m = beta * m + w * np.asarray(g)
        expected = w * np.asarray(g) + beta * m if nesterov else m
        np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(state.mu, m, rtol=1e-6, atol=1e-6)

  def test_bf16_params_with_fp32_momentum(self):
    params = gaussian((8, 16), 0, jnp.bfloat16)
    tx = om.momentum(0.95, dtype="float32")
    state = tx.init(params)
    assert state.mu.dtype == jnp.float32
    _, state = tx.update(params, state)
    assert state.mu.dtype == jnp.float32
    np.testing.assert_allclose(
      state.mu, 0.05 * np.asarray(params, np.float32), rtol=1e-6
    )

  def test_default_dtype_is_the_param_dtype(self):
    tx = om.momentum()
    state = tx.init({"a": jnp.zeros((2, 2), jnp.bfloat16)})
    assert state.mu["a"].dtype == jnp.bfloat16


class OrthogonalizeTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_grouped_equals_one_by_one(self):
    tree = {
      "a": gaussian((32, 64), 0),
      "b": gaussian((64, 32), 1),
      "c": gaussian((32, 64), 2),
      "d": gaussian((16, 24), 3),
      "stacked": gaussian((3, 32, 64), 4),
      "bf16": gaussian((24, 16), 5, jnp.bfloat16),
    }
    tx = om.orthogonalize(dimension_numbers="leading")
    out, _ = self.variant(tx.update)(tree, tx.init(tree))
    for name, leaf in tree.items():
      expected = om.newton_schulz(leaf)
      assert out[name].dtype == leaf.dtype
      # a bf16 result to its own rounding (one ulp, 2⁻⁷ of the value at
      # most): jax 0.12.1's jitted program rounded one of 384 elements the
      # other way
      rtol = 2**-7 if leaf.dtype == jnp.bfloat16 else 0.0
      chex.assert_trees_all_close(out[name], expected, atol=1e-6, rtol=rtol)

  def test_one_batched_newton_schulz_per_shape(self):
    tree = {
      f"w{i}": gaussian((32, 64) if i % 2 else (64, 32), i) for i in range(6)
    }
    tx = om.orthogonalize(steps=5, dimension_numbers="leading")
    jaxpr = jax.make_jaxpr(lambda t: tx.update(t, optax.EmptyState()))(tree)
    loops = [e for e in jaxpr.eqns if e.primitive.name in ("scan", "while")]
    assert len(loops) == 1  # six leaves, one wide shape, one loop
    (loop,) = loops
    assert any(v.aval.shape == (6, 32, 64) for v in loop.invars)

  def test_stacks_need_no_more_memory_than_the_largest_matrix(self):
    # Eight equal matrices: stacking them would keep 8× the buffers live;
    # one at a time, the peak is that of one matrix's loop.
    tree = {f"w{i}": jnp.ones((96, 384)) for i in range(8)}
    tx = om.orthogonalize(dimension_numbers="leading")
    compiled = jax.jit(tx.update).lower(tree, tx.init(tree)).compile()
    one_matrix = 96 * 384 * 4
    assert compiled.memory_analysis().temp_size_in_bytes <= 2 * one_matrix
    # Beside a larger matrix, the small ones still share one loop.
    tree = {
      "big": jnp.ones((512, 1024)),
      **{f"s{i}": jnp.ones((64, 128)) for i in range(8)},
    }
    jaxpr = jax.make_jaxpr(lambda t: tx.update(t, optax.EmptyState()))(tree)
    loops = [e for e in jaxpr.eqns if e.primitive.name in ("scan", "while")]
    assert len(loops) == 2

  @chex.variants(with_jit=True, without_jit=True)
  def test_a_tree_without_matrices_passes_through(self):
    tx = om.orthogonalize(dimension_numbers="leading")
    assert self.variant(tx.update)({}, tx.init({}))[0] == {}
    tx = om.muon(
      0.1, dimension_numbers="leading"
    )  # every leaf a vector: the Muon branch gets no leaf
    vector = {"b": jnp.arange(3.0)}
    out, _ = self.variant(tx.update)(vector, tx.init(vector), vector)
    assert out["b"].shape == (3,)

  def test_dimension_numbers_select_fan_in_and_fan_out(self):
    x = gaussian((6, 3, 20), 0)  # fan-in 6 * 3 merged, fan-out 20
    dims = MDN(reduction_axis=(0, 1), output_axis=2)
    tx = om.orthogonalize(dimension_numbers=dims)
    out, _ = tx.update({"w": x}, tx.init({"w": x}))
    expected = om.newton_schulz(x.reshape(18, 20)).reshape(6, 3, 20)
    np.testing.assert_allclose(out["w"], expected, atol=1e-6)

  def test_batch_axis_between_matrix_axes(self):
    x = gaussian((8, 5, 12), 0)  # (in, experts, out)
    tx = om.orthogonalize(dimension_numbers={"w": MDN(0, 2)})
    out, _ = tx.update({"w": x}, tx.init({"w": x}))
    for e in range(5):
      np.testing.assert_allclose(
        out["w"][:, e], om.newton_schulz(x[:, e]), atol=1e-6
      )

  def test_dimension_numbers_callable(self):
    tree = {"w": gaussian((4, 6, 10), 0)}
    tx = om.orthogonalize(
      dimension_numbers=lambda p: jax.tree.map(lambda _: MDN((0, 1), 2), p)
    )
    out, _ = tx.update(tree, tx.init(tree))
    np.testing.assert_allclose(
      out["w"],
      om.newton_schulz(tree["w"].reshape(24, 10)).reshape(4, 6, 10),
      atol=1e-6,
    )


@pytest.mark.parametrize("split_layout", layout.QKV_LAYOUTS)
@pytest.mark.parametrize("stacked", [False, True])
def test_split_qkv_orthogonalizes_and_scales_q_k_v_separately(
  split_layout, stacked
):
  heads, kv_heads, head_dim, d = 4, 2, 8, 48
  split = om.SplitQKV(heads, kv_heads, head_dim, layout=split_layout)
  width = (heads + 2 * kv_heads) * head_dim
  x = gaussian((2, d, width) if stacked else (d, width), 0)
  xs = x if stacked else x[None]
  per_group = heads // kv_heads * head_dim
  if split_layout == "grouped":
    g = xs.reshape(xs.shape[0], d, kv_heads, per_group + 2 * head_dim)
    q = g[..., :per_group].reshape(-1, d, heads * head_dim)
    k = g[..., per_group : per_group + head_dim].reshape(
      -1, d, kv_heads * head_dim
    )
    v = g[..., per_group + head_dim :].reshape(-1, d, kv_heads * head_dim)
  else:
    q, k, v = jnp.split(
      xs, [heads * head_dim, (heads + kv_heads) * head_dim], axis=-1
    )
  chain = optax.chain(
    om.orthogonalize(split_qkv=split, dimension_numbers="leading"),
    om.scale_by_shape("spectral", split_qkv=split, dimension_numbers="leading"),
  )
  tree = {
    "attn": {"qkv": {"kernel": x}},
    "mlp": {"kernel": gaussian((d, width), 1)},
  }
  out, _ = chain.update(tree, chain.init(tree))
  parts = [om.newton_schulz(p) * np.sqrt(max(p.shape[-2:])) for p in (q, k, v)]
  if split_layout == "grouped":
    merged = jnp.concatenate(
      [p.reshape(p.shape[0], d, kv_heads, -1) for p in parts], axis=-1
    ).reshape(xs.shape)
  else:
    merged = jnp.concatenate(parts, axis=-1)
  expected = merged if stacked else merged[0]
  np.testing.assert_allclose(out["attn"]["qkv"]["kernel"], expected, atol=1e-5)
  # a leaf whose path does not match the pattern is one whole matrix
  mlp = tree["mlp"]["kernel"]
  np.testing.assert_allclose(
    out["mlp"]["kernel"], om.newton_schulz(mlp) * np.sqrt(width), atol=1e-5
  )


@pytest.mark.parametrize(
  "mode, expected",
  [
    ("spectral", np.sqrt(48)),
    ("shape_scaling", np.sqrt(3.0)),
    ("unit_rms_norm", np.sqrt(48 / 16)),
  ],
)
def test_scale_modes(mode, expected):
  assert om.scale_factor(48, 16, mode) == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["spectral", "shape_scaling", "unit_rms_norm"])
def test_scale_by_shape_scales_each_stacked_matrix_by_its_shape(mode):
  x = jnp.ones((3, 16, 48))  # three (in=16, out=48) matrices
  tx = om.scale_by_shape(mode, dimension_numbers="leading")
  out, _ = tx.update({"w": x}, tx.init({"w": x}))
  np.testing.assert_allclose(out["w"], om.scale_factor(48, 16, mode), rtol=1e-6)
  assert om.scale_factor(16, 48, "shape_scaling") == 1.0


def test_match_adamw_update_rms_uses_beta1_factor():
  x = {"w": gaussian((64, 64), 0)}
  plain = om.scale_by_muon(extra_scale_factor=1.0, dimension_numbers="leading")
  matched = om.scale_by_muon(
    match_adamw_update_rms=True, adamw_beta1=0.9, dimension_numbers="leading"
  )
  a, _ = plain.update(x, plain.init(x))
  b, _ = matched.update(x, matched.init(x))
  np.testing.assert_allclose(b["w"], a["w"] * 0.22941573387056174, rtol=1e-5)
  # spectral + matched: the update RMS lands near AdamW's 0.2
  rms = float(om.update_rms(b)["w"])
  assert 0.15 < rms < 0.25


def test_match_adamw_update_rms_is_logged_once(caplog):
  caplog.set_level("INFO", logger="optax_muon")
  from optax_muon._src.transforms import scaling

  scaling._logged_factors.clear()
  for _ in range(3):
    om.muon(
      0.01,
      match_adamw_update_rms=True,
      adam_b1=0.9,
      dimension_numbers="leading",
    )
  lines = [r.getMessage() for r in caplog.records if "resolved" in r.message]
  assert lines == [
    "match_adamw_update_rms: extra_scale_factor resolved to "
    "0.229416 from adamw beta1=0.9"
  ]


def test_weight_decay_is_decoupled_and_multiplied_by_lr():
  params = {"w": gaussian((8, 8), 0)}
  grads = {"w": jnp.zeros((8, 8))}  # zero grad: NS(0) = 0, only decay acts
  tx = om.muon(0.1, weight_decay=0.5, dimension_numbers="leading")
  updates, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_allclose(updates["w"], -0.1 * 0.5 * params["w"], rtol=1e-6)


def test_weight_decay_masks_by_path_and_adam_settings_are_independent():
  params = {
    "a": {"kernel": jnp.ones((4, 4))},
    "b": {"kernel": jnp.ones((4, 4))},
    "bias": jnp.ones((4,)),
  }
  grads = jax.tree.map(jnp.zeros_like, params)
  tx = om.muon(
    0.1,
    weight_decay=1.0,
    weight_decay_mask={
      "a": {"kernel": True},
      "b": {"kernel": False},
      "bias": False,
    },
    adam_learning_rate=0.01,
    adam_weight_decay=2.0,
    adam_weight_decay_mask={"bias": True},
  )
  updates, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_allclose(updates["a"]["kernel"], -0.1, rtol=1e-6)
  np.testing.assert_allclose(updates["b"]["kernel"], 0.0)
  np.testing.assert_allclose(updates["bias"], -0.01 * 2.0, rtol=1e-6)
  # without a mask the AdamW group decays no vector (norm scales, biases)
  tx = om.muon(0.1, adam_learning_rate=0.01, adam_weight_decay=2.0)
  updates, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_array_equal(updates["bias"], 0.0)


def test_scalar_optimizer_lion_and_adam_get_the_non_muon_leaves():
  params = {"kernel": gaussian((8, 8), 0), "bias": jnp.ones((8,))}
  grads = {"kernel": gaussian((8, 8), 1), "bias": jnp.linspace(-1, 1, 8)}
  for name, reference in [
    ("adam", optax.adamw(0.01, weight_decay=0.0)),
    ("lion", optax.lion(0.01, b2=0.999, weight_decay=0.0)),
  ]:
    tx = om.muon(
      0.02,
      scalar_optimizer=name,
      adam_learning_rate=0.01,
      adam_weight_decay=0.0,
      dimension_numbers="leading",
    )
    updates, _ = tx.update(grads, tx.init(params), params)
    expected, _ = reference.update(
      grads["bias"], reference.init(params["bias"]), params["bias"]
    )
    np.testing.assert_allclose(updates["bias"], expected, rtol=1e-6)
    muon_only, _ = om.scale_by_muon(dimension_numbers="leading").update(
      {"k": grads["kernel"]},
      om.scale_by_muon(dimension_numbers="leading").init(
        {"k": params["kernel"]}
      ),
    )
    np.testing.assert_allclose(
      updates["kernel"], -0.02 * muon_only["k"], rtol=1e-5, atol=1e-7
    )


def test_explicit_labels_override_the_default():
  params = {"embed": gaussian((16, 8), 0), "kernel": gaussian((8, 8), 1)}
  grads = {"embed": gaussian((16, 8), 2), "kernel": gaussian((8, 8), 3)}
  tx = om.muon(
    0.1, labels={"embed": "muon", "kernel": "adam"}, dimension_numbers="leading"
  )
  updates, _ = tx.update(grads, tx.init(params), params)
  muon = om.scale_by_muon(dimension_numbers="leading")
  expected, _ = muon.update(
    {"embed": grads["embed"]}, muon.init({"embed": params["embed"]})
  )
  np.testing.assert_allclose(
    updates["embed"], -0.1 * expected["embed"], rtol=1e-5, atol=1e-7
  )
  adamw = optax.adamw(0.1, weight_decay=0.0)
  expected, _ = adamw.update(
    grads["kernel"], adamw.init(params["kernel"]), params["kernel"]
  )
  np.testing.assert_allclose(updates["kernel"], expected, rtol=1e-6)


@pytest.mark.parametrize(
  "setting",
  [{"mu_dtype": jnp.bfloat16}, {"precision": "medium"}, {"method": "gram"}],
)
def test_muon_forwards_its_settings_to_scale_by_muon(setting):
  params = {"w": gaussian((16, 64), 0)}
  grads = [{"w": gaussian((16, 64), seed)} for seed in (1, 2)]
  tx, reference = (
    om.muon(0.1, **setting, dimension_numbers="leading"),
    om.scale_by_muon(**setting, dimension_numbers="leading"),
  )
  state, reference_state = tx.init(params), reference.init(params)
  default = om.scale_by_muon(dimension_numbers="leading")
  default_state = default.init(params)
  for g in grads:
    updates, state = tx.update(g, state, params)
    expected, reference_state = reference.update(g, reference_state)
    plain, default_state = default.update(g, default_state)
  np.testing.assert_allclose(
    updates["w"], -0.1 * expected["w"], rtol=1e-6, atol=1e-7
  )
  assert np.abs(expected["w"] - plain["w"]).max() > 1e-6  # it matters
  momentum = state.inner_states["muon"].inner_state[0][0].mu["w"]
  assert momentum.dtype == setting.get("mu_dtype", jnp.float32)
