"""Bad input raises a clear error when a transform is built or first traced."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest

import optax_muon as om

MDN = om.MuonDimensionNumbers
MATRIX = {"w": jnp.ones((8, 12))}


def _init(tx, params=MATRIX):
  return tx.init(params)


def _update(tx, params=MATRIX):
  return tx.update(params, tx.init(params), params)


# (what is built, the exception, words the message must hold)
CASES = {
  "unknown coefficient name": (
    lambda: om.orthogonalize(coefficients="fastest"),
    ValueError,
    ["coefficients", "quintic", "polar_express"],
  ),
  "custom coefficients of the wrong shape": (
    lambda: om.newton_schulz(jnp.ones((4, 4)), coefficients=[(1.0, 2.0)]),
    ValueError,
    ["coefficients", "(a, b, c)"],
  ),
  "steps below one": (
    lambda: om.scale_by_muon(steps=0),
    ValueError,
    ["steps", ">= 1"],
  ),
  "steps not an integer": (
    lambda: om.orthogonalize(steps=2.5),
    TypeError,
    ["steps", "integer"],
  ),
  "coefficient_schedule steps below one": (
    lambda: om.coefficient_schedule("quintic", -1),
    ValueError,
    ["steps"],
  ),
  "beta of one": (lambda: om.momentum(1.0), ValueError, ["beta", "[0.0, 1.0)"]),
  "beta below zero": (
    lambda: om.muon(0.01, beta=-0.1),
    ValueError,
    ["beta", "[0.0, 1.0)"],
  ),
  "unknown momentum style": (
    lambda: om.momentum(style="adam"),
    ValueError,
    ["style", "ema", "sgd"],
  ),
  "unknown scale mode": (
    lambda: om.scale_by_shape("rms"),
    ValueError,
    ["mode", "spectral", "unit_rms_norm"],
  ),
  "unknown precision": (
    lambda: om.orthogonalize(precision="fp8"),
    ValueError,
    ["precision", "highest", "medium"],
  ),
  "unknown method": (
    lambda: om.scale_by_muon(method="svd"),
    ValueError,
    ["method", "standard"],
  ),
  "match_adamw_update_rms with extra_scale_factor": (
    lambda: om.muon(0.01, match_adamw_update_rms=True, extra_scale_factor=1.0),
    ValueError,
    ["match_adamw_update_rms", "extra_scale_factor", "exactly one"],
  ),
  "adamw beta1 out of range": (
    lambda: om.adamw_rms_match_factor(1.5),
    ValueError,
    ["adamw_beta1", "[0.0, 1.0)"],
  ),
  "negative extra scale": (
    lambda: om.scale_by_muon(extra_scale_factor=-2.0),
    ValueError,
    ["extra_scale_factor"],
  ),
  "unknown scalar optimizer": (
    lambda: om.muon(0.01, scalar_optimizer="sgd"),
    ValueError,
    ["scalar_optimizer", "adam", "lion"],
  ),
  "negative learning rate": (
    lambda: om.muon(-0.01),
    ValueError,
    ["learning_rate"],
  ),
  "negative weight decay": (
    lambda: om.muon(0.01, weight_decay=-1.0),
    ValueError,
    ["weight_decay"],
  ),
  "adam_b2 out of range": (
    lambda: om.muon(0.01, adam_b2=1.0),
    ValueError,
    ["adam_b2"],
  ),
  "bad momentum dtype": (
    lambda: om.momentum(dtype="float33"),
    ValueError,
    ["dtype"],
  ),
  "sharding that is not TensorParallel": (
    lambda: om.orthogonalize(sharding="model"),
    ValueError,
    ["sharding", "None"],
  ),
  "overlapping dimension numbers": (
    lambda: _init(om.orthogonalize(dimension_numbers=MDN(0, 0))),
    ValueError,
    ["dimension_numbers", "overlap", "leaf w"],
  ),
  "dimension numbers outside the array": (
    lambda: _init(om.orthogonalize(dimension_numbers=MDN(0, 3))),
    ValueError,
    ["dimension_numbers.output_axis", "leaf w", "[-2, 2)"],
  ),
  "dimension numbers of the wrong type": (
    lambda: _init(om.scale_by_shape(dimension_numbers={"w": (0, 1)})),
    TypeError,
    ["dimension_numbers", "MuonDimensionNumbers"],
  ),
  "vector sent to Muon": (
    lambda: _update(om.muon(0.01, labels={"w": "muon"}), {"w": jnp.ones((8,))}),
    ValueError,
    ["leaf w", "fewer than 2 axes", "labels"],
  ),
  "heads that kv heads do not divide": (
    lambda: om.SplitQKV(num_heads=6, num_kv_heads=4, head_dim=8),
    ValueError,
    ["num_kv_heads", "num_heads"],
  ),
  "fused QKV width that does not match": (
    lambda: _init(
      om.orthogonalize(split_qkv=om.SplitQKV(4, 2, 8)),
      {"qkv": jnp.ones((16, 60))},
    ),
    ValueError,
    ["split_qkv", "fan-out of 64", "leaf qkv"],
  ),
  "unknown QKV layout": (
    lambda: om.SplitQKV(4, 2, 8, layout="interleaved"),
    ValueError,
    ["layout", "grouped", "concatenated"],
  ),
  "unknown label value": (
    lambda: _update(om.muon(0.01, labels={"w": "sgd"})),
    ValueError,
    ["labels", "muon", "adam"],
  ),
  "muon_patterns matching a vector": (
    lambda: om.default_labels({"bias": jnp.ones(3)}, muon_patterns=["bias"]),
    ValueError,
    ["muon_patterns", "bias"],
  ),
  # the first ten minutes (issue 32): silent or foreign before
  "adam_b1 of one with RMS matching names adam_b1, the argument passed": (
    lambda: om.muon(0.01, adam_b1=1.0, match_adamw_update_rms=True),
    ValueError,
    ["adam_b1", "[0.0, 1.0)"],
  ),
  "compat.muon with a negative learning rate": (
    lambda: om.compat.muon(-0.1),
    ValueError,
    ["learning_rate", "[0.0, inf)"],
  ),
  "compat.muon with a NaN weight decay": (
    lambda: om.compat.muon(0.1, weight_decay=float("nan")),
    ValueError,
    ["weight_decay", "nan"],
  ),
  "infer_layout with an output no output has": (
    lambda: om.infer_layout(
      lambda p, x: x @ p, jnp.zeros((4, 4)), jnp.ones((2, 4)), output="none"
    ),
    ValueError,
    ["output='none'", "accepted"],
  ),
  "infer_layout with a class, not a model": (
    lambda: om.infer_layout(om.TensorParallel, jnp.ones((2, 4))),
    ValueError,
    ["class TensorParallel", "instance"],
  ),
  "infer_layout with params and the function swapped": (
    lambda: om.infer_layout(
      jnp.zeros((4, 4)), lambda p, x: x @ p, jnp.ones((2, 4))
    ),
    ValueError,
    ["first argument", "the function comes first"],
  ),
  "a zero-size leaf routed to Muon by hand": (
    lambda: om.muon(0.1, labels={"w": "muon"}).init({"w": jnp.zeros((0, 8))}),
    ValueError,
    ["leaf w", "(0, 8)", "no elements", "'none'"],
  ),
  "muon_hyperball on an all-zero matrix without a radius": (
    lambda: om.muon_hyperball(0.1).init({"w": jnp.zeros((8, 12))}),
    ValueError,
    ["leaf w", "all zeros", "radius="],
  ),
  "a block size without 8-bit momentum": (
    lambda: om.MuonConfig(muon_momentum_block_size=64),
    ValueError,
    ["muon_momentum_block_size=64", "muon_momentum_bits"],
  ),
  "a string for a bool field, built directly": (
    lambda: om.MuonConfig(optimizer_offload="yes"),
    ValueError,
    ["optimizer_offload", "bool", "from_overrides"],
  ),
  "an int for a bool field": (
    lambda: om.MuonConfig(optimizer_offload=0),
    ValueError,
    ["optimizer_offload", "bool"],
  ),
  "a layout read from another model": (
    lambda: om.muon(
      0.1,
      layout=om.infer_layout(
        lambda p, x: x @ p["a"], {"a": MATRIX["w"]}, jnp.ones((2, 8))
      ),
    ).init({"b": MATRIX["w"]}),
    ValueError,
    ["layout=", "leaf b", "another model", "infer_layout"],
  ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_raises_naming_the_argument(case):
  build, error, words = CASES[case]
  with pytest.raises(error) as raised:
    build()
  for word in words:
    assert word in str(raised.value), (case, str(raised.value))


def test_there_are_at_least_fifteen_distinct_cases():
  assert len(CASES) >= 15


def test_a_zero_size_leaf_goes_to_no_optimizer_by_default():
  params = {"w": jnp.ones((8, 12)), "empty": jnp.zeros((0, 8))}
  assert om.default_labels(params) == {"empty": "none", "w": "muon"}
  tx = om.muon(0.1)
  updates, _ = tx.update(params, tx.init(params), params)
  assert updates["empty"].shape == (0, 8)
  assert "empty  0×8    —       none" in om.describe(params)


def test_muon_hyperball_with_a_radius_moves_a_zero_matrix():
  params = {"w": jnp.zeros((8, 12))}
  tx = om.muon_hyperball(0.1, radius=2.0)
  grads = {"w": jnp.ones((8, 12)).at[0, 0].set(3.0)}
  updates, _ = tx.update(grads, tx.init(params), params)
  assert float(jnp.linalg.norm(params["w"] + updates["w"])) == pytest.approx(
    2.0, rel=1e-5
  )


# errors name the argument of the function that was called -------------------


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


# a zero extra scale factor --------------------------------------------------


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


def test_a_numpy_int_memory_budget_is_a_memory_budget():
  # as ns_steps takes numpy ints: the budget must be the same as the int's
  params = MATRIX
  exact = _update(om.muon(0.1, memory_budget=2**31), params)
  chex.assert_trees_all_equal(
    _update(om.muon(0.1, memory_budget=np.int64(2**31)), params), exact
  )
  chex.assert_trees_all_equal(
    _update(
      om.MuonConfig(muon_memory_budget=np.int64(2**31)).build(0.1), params
    ),
    _update(om.MuonConfig(muon_memory_budget=2**31).build(0.1), params),
  )


def test_overrides_still_parse_strings_the_constructor_refuses():
  config = om.MuonConfig.from_overrides(
    ["optimizer_offload=yes", "lr=1e-3", "muon_tp_mode=none"]
  )
  assert config.optimizer_offload is True and config.lr == 1e-3
  assert config.muon_tp_mode is None


def test_a_block_size_that_does_not_divide_uses_a_stated_block():
  # QuantizedMomentum's docstring: block_size=100 on a 256-wide axis gives
  # blocks of 64 (a divisor at least a quarter of it); 257 wide: padded 256
  def blocks(width, block_size):
    tx = om.momentum(dtype=om.QuantizedMomentum(block_size=block_size))
    return tx.init({"w": jnp.zeros((4, width))}).mu.scales["w"].shape[-1]

  assert blocks(256, 100) == 256 // 64
  assert blocks(257, 256) == 2
  assert blocks(300, 256) == 300 // 150
  assert blocks(512, 256) == 2
