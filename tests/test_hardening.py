"""What a new user hit silently, now correct or a clear error (issue 10, items
1–9); each test here failed on the code before the fix."""

import dataclasses
import importlib
import json
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import optax_muon as om
from conftest import gaussian
from conftest import polar

MDN = om.MuonDimensionNumbers
gram_lib = importlib.import_module("optax_muon._src.kernels.gram")


# 1. complex parameters ------------------------------------------------------


@pytest.mark.parametrize("shape", [(24, 56), (56, 24)], ids=["wide", "tall"])
def test_complex_newton_schulz_is_the_complex_polar_factor(shape):
  x = gaussian(shape, seed=1, dtype=jnp.complex64)
  out = om.newton_schulz(x, coefficients="polar_express", steps=8)
  assert out.dtype == jnp.complex64
  np.testing.assert_allclose(out, polar(x), atol=1e-5)
  sigma = np.linalg.svd(np.asarray(om.newton_schulz(x)), compute_uv=False)
  assert 0.7 < sigma.min() and sigma.max() < 1.2  # quintic × 5


class ComplexMuonTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_an_imaginary_gradient_gives_i_times_the_real_update(self):
    # (iG)(iG)ᴴ = G Gᴴ, so NS(iG) = i NS(G): nothing of the update is lost
    grad = gaussian((16, 40), seed=2)
    params = {"w": jnp.zeros((16, 40), jnp.complex64)}
    tx = om.muon(0.1, mu_dtype="float32", dimension_numbers="leading")
    update = self.variant(tx.update)
    imaginary, state = update(
      {"w": 1j * grad.astype(jnp.complex64)}, tx.init(params), params
    )
    real, _ = update({"w": grad.astype(jnp.complex64)}, tx.init(params), params)
    assert float(jnp.abs(real["w"]).max()) > 0.01
    chex.assert_trees_all_close(imaginary["w"], 1j * real["w"], atol=1e-6)
    momentum = state.inner_states["muon"].inner_state[0][0].mu["w"]
    assert momentum.dtype == jnp.complex64  # float32 asked: complex kept


def test_complex_at_medium_precision_is_a_clear_error():
  params = {"w": jnp.ones((8, 12), jnp.complex64)}
  with pytest.raises(ValueError, match="precision='medium'.*complex.*leaf w"):
    om.muon(0.1, precision="medium", dimension_numbers="leading").init(params)
  with pytest.raises(ValueError, match="precision='medium'"):
    om.newton_schulz(params["w"], precision="medium")


# 2. settings trees with paths that match no parameter ------------------------

PARAMS = {
  "attn": {"qkv": {"kernel": jnp.ones((8, 24))}},
  "mlp": {"w": jnp.ones((8, 16))},
  "embed": jnp.ones((12, 8)),
  "bias": jnp.ones((8,)),
}

UNKNOWN_PATHS = {
  "weight_decay_mask": lambda: om.muon(
    0.1,
    weight_decay=0.1,
    weight_decay_mask={"mlp": {"W": True}},
    dimension_numbers="leading",
  ),
  "adam_weight_decay_mask": lambda: om.muon(
    0.1, adam_weight_decay_mask={"embedding": True}, dimension_numbers="leading"
  ),
  "dimension_numbers": lambda: om.muon(
    0.1, dimension_numbers={"mlp": {"kernel": MDN(0, 1)}}
  ),
  "split_qkv": lambda: om.muon(
    0.1,
    split_qkv={"attn": {"qkv_proj": om.SplitQKV(1, 1, 8)}},
    dimension_numbers="leading",
  ),
  "labels": lambda: om.muon(
    0.1, labels={"mlp": {"W": "muon"}}, dimension_numbers="leading"
  ),
  "sharding.specs": lambda: om.muon(
    0.1,
    sharding=om.TensorParallel(
      jax.make_mesh((1,), ("model",), axis_types=(AxisType.Explicit,)),
      specs={"mlp": {"w": P()}, "attn": {"qkv": {"kernal": P()}}},
    ),
    dimension_numbers="leading",
  ),
}


@pytest.mark.parametrize("name", sorted(UNKNOWN_PATHS))
def test_a_path_that_names_no_parameter_raises_at_init(name):
  tx = UNKNOWN_PATHS[name]()
  with pytest.raises(ValueError) as raised:
    tx.init(PARAMS)
  message = str(raised.value)
  assert message.startswith(f"{name} names"), message
  assert "no parameter path" in message and "nearest existing paths" in message
  nearest = {
    "weight_decay_mask": "mlp/w",
    "adam_weight_decay_mask": "embed",
    "dimension_numbers": "mlp",
    "split_qkv": "attn/qkv",
    "labels": "mlp/w",
    "sharding.specs": "attn/qkv/kernel",
  }[name]
  assert repr(nearest) in message, message


def test_full_tree_settings_still_work_inside_the_partition():
  # every path names a real leaf, Muon's and AdamW's alike
  full = lambda value: jax.tree.map(lambda _: value, PARAMS)
  tx = om.muon(
    0.1,
    weight_decay=0.1,
    weight_decay_mask=full(True),
    adam_weight_decay_mask=full(False),
    dimension_numbers=full(None),
    labels={"attn": "muon", "mlp": "muon", "embed": "adam", "bias": "adam"},
  )
  updates, _ = tx.update(PARAMS, tx.init(PARAMS), PARAMS)
  chex.assert_trees_all_equal_shapes(updates, PARAMS)


# 3. label patterns ------------------------------------------------------------


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


# 4. leaves that are not floating point ---------------------------------------


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


# 5. errors name the argument of the function that was called -----------------


@pytest.mark.parametrize(
  "build, argument",
  [
    (
      lambda: om.muon(
        0.1, momentum_style="adamish", dimension_numbers="leading"
      ),
      "momentum_style=",
    ),
    (
      lambda: om.scale_by_muon(
        momentum_style="adamish", dimension_numbers="leading"
      ),
      "momentum_style=",
    ),
    (lambda: om.momentum(style="adamish"), "style="),
    (
      lambda: om.muon(0.1, scale_mode="rms", dimension_numbers="leading"),
      "scale_mode=",
    ),
    (
      lambda: om.scale_by_shape(mode="rms", dimension_numbers="leading"),
      "mode=",
    ),
    (lambda: om.scale_factor(4, 4, "rms"), "mode="),
    (
      lambda: om.muon(0.1, mu_dtype="float33", dimension_numbers="leading"),
      "mu_dtype=",
    ),
    (
      lambda: om.muon(0.1, mu_dtype="int32", dimension_numbers="leading"),
      "mu_dtype=",
    ),
    (lambda: om.momentum(dtype="float33"), "dtype="),
  ],
)
def test_errors_name_the_argument_the_user_passed(build, argument):
  with pytest.raises(ValueError) as raised:
    build()
  assert str(raised.value).startswith(argument), str(raised.value)


# 6. a zero extra scale factor --------------------------------------------------


@pytest.mark.parametrize(
  "build",
  [
    lambda: om.muon(0.1, extra_scale_factor=0, dimension_numbers="leading"),
    lambda: om.scale_by_muon(
      extra_scale_factor=0.0, dimension_numbers="leading"
    ),
    lambda: om.MuonConfig(optimizer="muon", muon_extra_scale_factor=0.0),
  ],
)
def test_extra_scale_factor_must_be_positive(build):
  with pytest.raises(ValueError, match="extra_scale_factor.*> 0"):
    build()


# 7. MuonConfig survives asdict -> JSON -> from_dict ------------------------------


def _round_trip(config):
  return om.MuonConfig.from_dict(
    json.loads(json.dumps(dataclasses.asdict(config)))
  )


@pytest.mark.parametrize(
  "overrides",
  [
    [],
    ["optimizer=muon", "muon_match_adamw_update_rms=true"],
    ["optimizer=muon", "muon_extra_scale_factor=0.2", "betas=[0.9,0.95]"],
    ["optimizer=muon", "muon_tp_mode=allgather", "muon_nesterov=true"],
  ],
)
def test_config_round_trips_through_json(overrides):
  config = om.MuonConfig.from_overrides(overrides)
  assert _round_trip(config) == config


def test_unset_extra_factor_stays_none_and_resolves_in_a_property():
  matched = om.MuonConfig(optimizer="muon", muon_match_adamw_update_rms=True)
  assert matched.muon_extra_scale_factor is None
  assert "muon_extra_scale_factor=None" in repr(matched)
  assert matched.extra_scale_factor == pytest.approx(0.229416, abs=1e-6)
  assert om.MuonConfig().extra_scale_factor == 1.0
  assert om.MuonConfig(muon_extra_scale_factor=0.2).extra_scale_factor == 0.2


# 8. from_overrides surprises ----------------------------------------------------


def test_a_field_under_two_prefixes_raises_naming_both():
  with pytest.raises(
    ValueError,
    match=r"actor_rollout_ref\.actor\.optim\.lr.*"
    r"critic\.optim\.lr",
  ):
    om.MuonConfig.from_overrides(
      ["actor_rollout_ref.actor.optim.lr=1e-6", "critic.optim.lr=1e-5"]
    )


def test_muon_fields_with_adam_warn_once_naming_them():
  with pytest.warns(
    UserWarning, match=r"muon_momentum.*muon_nesterov"
  ) as caught:
    om.MuonConfig.from_overrides(
      ["optimizer=adam", "muon_momentum=0.9", "muon_nesterov=true"]
    )
  assert len(caught) == 1


def test_tp_mode_without_a_mesh_raises():
  config = om.MuonConfig(optimizer="muon", muon_tp_mode="duplicated")
  with pytest.raises(ValueError, match="muon_tp_mode='duplicated'.*mesh"):
    config.build(3e-4)
  om.MuonConfig(optimizer="muon").build(3e-4)  # unset: fine without a mesh


def test_fused_qkv_without_split_raises_at_init():
  params = {"attn": {"qkv": {"kernel": jnp.ones((16, 48))}}}
  tx = om.MuonConfig(optimizer="muon").build(3e-4)  # params not given here
  with pytest.raises(ValueError, match="muon_split_qkv=True.*attn/qkv/kernel"):
    tx.init(params)
  plain = {"mlp": {"kernel": jnp.ones((16, 48))}}
  tx.update(plain, tx.init(plain), plain)  # no fused leaves: keeps working


def test_from_dict_accepts_nested_sections():
  config = om.MuonConfig.from_dict(
    {
      "actor": {
        "optim": {"optimizer": "muon", "lr": 3e-4, "muon_momentum": 0.9}
      }
    }
  )
  assert (config.optimizer, config.lr, config.muon_momentum) == (
    "muon",
    3e-4,
    0.9,
  )


def test_a_single_override_string_asks_for_a_list():
  with pytest.raises(TypeError, match="list"):
    om.MuonConfig.from_overrides("optimizer=muon")


@pytest.mark.parametrize("value", [None, "null"])
def test_a_null_weight_decay_is_a_clear_error(value):
  with pytest.raises(ValueError, match="weight_decay.*cannot be unset"):
    om.MuonConfig.from_dict({"weight_decay": value})


# 9. Gram Newton–Schulz with a traced step count --------------------------------


def test_gram_runs_under_inject_hyperparams():
  x = {"w": gaussian((2, 48, 160), seed=3)}  # aspect 3.3: Gram pays
  tx = optax.inject_hyperparams(om.orthogonalize)(
    steps=5, method="gram", dimension_numbers="leading"
  )
  with mock.patch.object(
    gram_lib, "iterate_gram", wraps=gram_lib.iterate_gram
  ) as spy:
    injected, _ = jax.jit(tx.update)(x, tx.init(x))
  assert spy.call_count == 1  # the Gram form ran, with `steps` traced
  static, _ = om.orthogonalize(
    steps=5, method="gram", dimension_numbers="leading"
  ).update(x, None)
  chex.assert_trees_all_close(injected, static, atol=1e-6)
  for steps in (1, 2, 3):  # segments of length 0 and 1
    tx = optax.inject_hyperparams(om.orthogonalize)(
      steps=steps, method="gram", dimension_numbers="leading"
    )
    static, _ = om.orthogonalize(
      steps=steps, method="gram", dimension_numbers="leading"
    ).update(x, None)
    chex.assert_trees_all_close(
      jax.jit(tx.update)(x, tx.init(x))[0], static, atol=1e-6
    )
