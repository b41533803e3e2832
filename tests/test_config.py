"""MuonConfig: verl / Megatron-Core names, defaults, parsing and validation."""

import dataclasses
import functools
import json

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
from optax_muon._src.config import muon_config

# verl's actor.optim and Megatron-Core's muon_* defaults (DESIGN §7); None is
# "unset": muon_tp_mode resolves to blockwise with a mesh, the extra factor to
# 1.0 or the RMS-matching factor
DEFAULTS = {
  "optimizer": "adam",
  "lr": 1e-6,
  "adam_lr": None,
  "betas": (0.9, 0.999),
  "eps": 1e-8,
  "weight_decay": 0.01,
  "clip_grad": 1.0,
  "use_layer_wise_distributed_optimizer": False,
  "muon_momentum": 0.95,
  "muon_nesterov": False,
  "muon_split_qkv": True,
  "muon_scale_mode": "spectral",
  "muon_coefficient_type": "quintic",
  "muon_num_ns_steps": 5,
  "muon_tp_mode": None,
  "muon_fp32_matmul_prec": "medium",
  "muon_extra_scale_factor": None,
  "muon_scalar_optimizer": "adam",
  "muon_match_adamw_update_rms": False,
  "muon_momentum_style": "ema",
  "muon_memory_budget": None,
  "muon_momentum_bits": None,
  "muon_momentum_block_size": 256,
  "optimizer_offload": False,
  "qk_clip": False,
  "qk_clip_threshold": 100.0,
  "qk_clip_alpha": 0.5,
  # Megatron-Core 0.19's OptimizerConfig (shared reference, mcore fields)
  "adaptive_muon_moment2_method": "adamuon",
  "adaptive_muon_beta2": 0.95,
  "adaptive_muon_eps": 1e-8,
  # no config name in Megatron-Core: a gated linear_fc1 is always split
  # (its is_gated_fc1 attribute); ours follows, and can be turned off
  "muon_split_gate_up": True,
  # no reference names (microsoft/dion's defaults: period 5 is MuonBP's P)
  "muon_bp_period": 5,
  "dion2_fraction": 0.25,
  "dion2_ef_decay": 0.95,
  "nordion2_beta2": 0.95,
  "dion_rank_fraction": 1.0,
  "dion_qr_method": "qr",
  "dion2_selection_scope": "local",
}


def test_every_field_has_the_reference_default():
  cfg = om.MuonConfig()
  assert set(om.MuonConfig.field_names()) == set(DEFAULTS)
  for name, value in DEFAULTS.items():
    assert getattr(cfg, name) == value, name


@pytest.mark.parametrize(
  "prefix", ["", "optim.", "actor_rollout_ref.actor.optim."]
)
def test_overrides_parse_with_any_dotted_prefix(prefix):
  cfg = om.MuonConfig.from_overrides(
    [
      f"{prefix}optimizer=muon",
      f"{prefix}muon_momentum=0.9",
      f"{prefix}betas=[0.9,0.95]",
      f"{prefix}muon_nesterov=true",
      f"{prefix}muon_num_ns_steps=8",
      f"{prefix}lr=3e-4",
      f"{prefix}muon_tp_mode=duplicated",
    ]
  )
  assert (
    cfg.optimizer,
    cfg.muon_momentum,
    cfg.betas,
    cfg.muon_nesterov,
    cfg.muon_num_ns_steps,
    cfg.lr,
    cfg.muon_tp_mode,
  ) == ("muon", 0.9, (0.9, 0.95), True, 8, 3e-4, "duplicated")


BAD_OVERRIDES = [
  ("optimizer=sgd", "optimizer"),
  ("muon_momentum=1.0", "muon_momentum"),
  ("muon_momentum=fast", "muon_momentum"),
  ("muon_nesterov=maybe", "muon_nesterov"),
  ("muon_num_ns_steps=0", "muon_num_ns_steps"),
  ("muon_num_ns_steps=2.5", "muon_num_ns_steps"),
  ("muon_scale_mode=rms", "muon_scale_mode"),
  ("muon_coefficient_type=fastest", "muon_coefficient_type"),
  ("muon_tp_mode=sequence", "muon_tp_mode"),
  ("muon_fp32_matmul_prec=fp8", "muon_fp32_matmul_prec"),
  ("muon_extra_scale_factor=-1", "muon_extra_scale_factor"),
  ("muon_scalar_optimizer=sgd", "muon_scalar_optimizer"),
  ("muon_momentum_style=adam", "muon_momentum_style"),
  ("lr=-0.1", "lr"),
  ("betas=[0.9]", "betas"),
  ("betas=[0.9,1.5]", "betas[1]"),
  ("weight_decay=-0.01", "weight_decay"),
  ("clip_grad=-1", "clip_grad"),
  ("eps=-1e-8", "eps"),
  ("muon_split_qkv=2", "muon_split_qkv"),
  ("muon_learning_rate=0.1", "muon_learning_rate"),
  ("optim.muon_mometum=0.9", "muon_mometum"),
  ("muon_momentum", "key=value"),
  ("qk_clip_threshold=0", "qk_clip_threshold"),
  ("qk_clip_alpha=1.5", "qk_clip_alpha"),
  ("qk_clip=maybe", "qk_clip"),
]


@pytest.mark.parametrize("override, field", BAD_OVERRIDES)
def test_bad_override_raises_naming_the_field(override, field):
  with pytest.raises(
    ValueError, match=field.replace("[", r"\[").replace("]", r"\]")
  ):
    om.MuonConfig.from_overrides([override])


def test_match_adamw_update_rms_conflicts_with_any_explicit_extra_factor():
  for value in ("1.0", "0.2"):
    with pytest.raises(ValueError, match="set exactly one"):
      om.MuonConfig.from_overrides(
        ["muon_match_adamw_update_rms=true", f"muon_extra_scale_factor={value}"]
      )
  with pytest.raises(ValueError, match="set exactly one"):
    om.MuonConfig(muon_match_adamw_update_rms=True, muon_extra_scale_factor=1.0)
  assert om.MuonConfig(muon_match_adamw_update_rms=True).extra_scale_factor == (
    pytest.approx(om.adamw_rms_match_factor(0.9))
  )


def test_resolved_factor_is_logged(caplog):
  from optax_muon._src.transforms import scaling

  scaling._logged_factors.clear()
  caplog.set_level("INFO", logger="optax_muon")
  om.MuonConfig(optimizer="muon", muon_match_adamw_update_rms=True).build(1e-3)
  assert any("0.229416" in r.getMessage() for r in caplog.records)


def test_adam_builds_plain_adamw_with_clip():
  params = {"w": jnp.ones((4, 4)), "b": jnp.ones((4,))}
  grads = {"w": jnp.full((4, 4), 10.0), "b": jnp.full((4,), 10.0)}
  cfg = om.MuonConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0)
  updates, _ = cfg.build().update(grads, cfg.build().init(params), params)
  reference = optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.adamw(1e-2, weight_decay=0.1, mask={"w": True, "b": False}),
  )
  expected, _ = reference.update(grads, reference.init(params), params)
  np.testing.assert_allclose(updates["w"], expected["w"], rtol=1e-6)
  np.testing.assert_allclose(updates["b"], expected["b"], rtol=1e-6)


def test_muon_build_needs_head_counts_for_fused_qkv():
  params = {"attn": {"qkv": {"kernel": jnp.ones((16, 48))}}}
  cfg = om.MuonConfig(optimizer="muon")
  with pytest.raises(ValueError, match="split_qkv"):
    cfg.build(1e-3, params=params)
  tx = cfg.build(1e-3, params=params, split_qkv=om.SplitQKV(2, 2, 8))
  updates, _ = tx.update(params, tx.init(params), params)
  assert updates["attn"]["qkv"]["kernel"].shape == (16, 48)
  om.MuonConfig(optimizer="muon", muon_split_qkv=False).build(
    1e-3, params=params
  )


# build() forwards every field: each case sets one field away from its default
# and compares build() with the optax chain written out by hand.
SPLIT = om.SplitQKV(num_heads=2, num_kv_heads=2, head_dim=8)
FORWARD_PARAMS = {
  "attn": {"qkv": {"kernel": jnp.ones((16, 48))}},
  "mlp": {"kernel": jnp.ones((16, 32))},
  "ffn": {"gate_up": {"kernel": jnp.ones((16, 64))}},
  "embed": {"embedding": jnp.ones((20, 16))},
  "ln": {"scale": jnp.ones((16,))},
}
FORWARD_CASES = {
  "defaults": ({}, {}),
  "muon_momentum": ({"muon_momentum": 0.8}, {"beta": 0.8}),
  "muon_nesterov": ({"muon_nesterov": True}, {"nesterov": True}),
  "muon_split_qkv": ({"muon_split_qkv": False}, {"split_qkv": None}),
  "muon_split_gate_up": (
    {"muon_split_gate_up": False},
    {"split_gate_up": None},
  ),
  "muon_scale_mode": (
    {"muon_scale_mode": "unit_rms_norm"},
    {"scale_mode": "unit_rms_norm"},
  ),
  "muon_coefficient_type": (
    {"muon_coefficient_type": "cubic5"},
    {"coefficients": "cubic5"},
  ),
  "muon_num_ns_steps": ({"muon_num_ns_steps": 2}, {"steps": 2}),
  "muon_fp32_matmul_prec": (
    {"muon_fp32_matmul_prec": "highest"},
    {"precision": "highest"},
  ),
  "muon_extra_scale_factor": (
    {"muon_extra_scale_factor": 0.3},
    {"extra_scale_factor": 0.3},
  ),
  "muon_scalar_optimizer": (
    {"muon_scalar_optimizer": "lion"},
    {"scalar_optimizer": "lion"},
  ),
  "muon_match_adamw_update_rms": (
    {"muon_match_adamw_update_rms": True},
    {"match_adamw_update_rms": True},
  ),
  "muon_momentum_style": (
    {"muon_momentum_style": "sgd"},
    {"momentum_style": "sgd"},
  ),
  "betas": ({"betas": (0.8, 0.99)}, {"adam_b1": 0.8, "adam_b2": 0.99}),
  "eps": ({"eps": 1e-3}, {"adam_eps": 1e-3}),
  "weight_decay": (
    {"weight_decay": 0.5},
    {"weight_decay": 0.5, "adam_weight_decay": 0.5},
  ),
  "clip_grad": ({"clip_grad": 0.5}, {"clip": 0.5}),
  "adam_lr": ({"adam_lr": 3e-3}, {"adam_learning_rate": 3e-3}),
}
# Muon and AdamW are nearly scale-invariant: a clip shows through eps = 1
CONTEXT = {"clip_grad": ({"eps": 1.0}, {"adam_eps": 1.0})}


def _hand_written(lr, clip=1.0, **overrides):
  """verl / Megatron's defaults (DESIGN §7) spelled out as om.muon arguments."""
  decay = lambda p: jax.tree.map(lambda x: jnp.ndim(x) >= 2, p)
  args = dict(
    beta=0.95,
    nesterov=False,
    momentum_style="ema",
    coefficients="quintic",
    steps=5,
    precision="medium",
    scale_mode="spectral",
    extra_scale_factor=None,
    match_adamw_update_rms=False,
    split_qkv=SPLIT,
    split_gate_up=om.SplitGateUp(),
    weight_decay=0.01,
    weight_decay_mask=decay,
    scalar_optimizer="adam",
    adam_b1=0.9,
    adam_b2=0.999,
    adam_eps=1e-8,
    adam_weight_decay=0.01,
    adam_weight_decay_mask=decay,
  )
  return optax.chain(
    optax.clip_by_global_norm(clip), om.muon(lr, **(args | overrides))
  )


def _three_steps(tx, params):
  p, state = params, tx.init(params)
  update = jax.jit(tx.update)  # one compile: faster than op by op
  for step in range(3):  # gradients large enough for the clip to act
    grads = jax.tree.map(lambda x: 10.0 * jnp.cos(x * (step + 1)), params)
    updates, state = update(grads, state, p)
    p = optax.apply_updates(p, updates)
  return p


def _forward_params():
  keys = iter(jax.random.split(jax.random.key(0), 12))
  return jax.tree.map(lambda x: normal(next(keys), x.shape), FORWARD_PARAMS)


@functools.lru_cache
def _without_the_field(context):
  """Three steps of the defaults (in ``context``), shared by the cases."""
  return _three_steps(_hand_written(1e-2, **dict(context)), _forward_params())


@pytest.mark.parametrize("case", sorted(FORWARD_CASES))
def test_build_forwards_every_field(case):
  fields, overrides = FORWARD_CASES[case]
  context_fields, context = CONTEXT.get(case, ({}, {}))
  built = om.MuonConfig(
    optimizer="muon", lr=1e-2, **fields, **context_fields
  ).build(split_qkv=SPLIT)
  params = _forward_params()
  got = _three_steps(built, params)
  chex.assert_trees_all_close(
    got,
    _three_steps(_hand_written(1e-2, **overrides, **context), params),
    atol=1e-6,
    rtol=1e-6,
  )
  if case != "defaults":  # the field changes the result: the check has teeth
    without = _without_the_field(tuple(sorted(context.items())))
    differs = jax.tree.leaves(
      jax.tree.map(
        lambda a, b: not np.allclose(a, b, atol=1e-6, rtol=1e-6), got, without
      )
    )
    assert any(differs), case


def test_adam_lr_follows_the_schedule_and_an_injected_lr():
  # the AdamW group follows build()'s schedule at adam_lr / lr of it, so that
  # an inject_hyperparams lr (halved on a rollback) moves both groups
  params = {"w": jnp.ones((8, 8)), "b": jnp.ones((8,))}
  grads = {"w": jnp.ones((8, 8)), "b": jnp.ones((8,))}
  cfg = om.MuonConfig(
    optimizer="muon", lr=1e-2, adam_lr=4e-2, clip_grad=0.0, weight_decay=0.0
  )
  schedule = lambda count: 1e-2 * (count + 1.0)
  tx = cfg.build(schedule)
  state = tx.init(params)
  for step in range(2):
    updates, state = tx.update(grads, state, params)
    # Adam's first steps are -lr·sign(g): its lr read off the update
    np.testing.assert_allclose(-updates["b"], 4e-2 * (step + 1), rtol=1e-4)
  injected = optax.inject_hyperparams(
    lambda learning_rate: cfg.build(learning_rate)
  )(learning_rate=1e-2)
  state = injected.init(params)
  state.hyperparams["learning_rate"] = jnp.asarray(5e-3)  # halved
  updates, _ = injected.update(grads, state, params)
  np.testing.assert_allclose(-updates["b"], 2e-2, rtol=1e-4)


@pytest.mark.parametrize(
  "fields, match",
  [
    ({"adam_lr": -1.0}, "adam_lr"),
    ({"adam_lr": 1e-3, "lr": 0.0}, "adam_lr.*lr > 0"),
  ],
)
def test_bad_adam_lr_raises(fields, match):
  with pytest.raises(ValueError, match=match):
    om.MuonConfig(optimizer="muon", **fields)


def test_adam_lr_with_adamw_warns():
  with pytest.warns(UserWarning, match="adam_lr"):
    om.MuonConfig.from_dict({"optimizer": "adam", "adam_lr": 1e-3})


@pytest.mark.parametrize(
  "fields, collective",
  [
    ({"muon_tp_mode": "duplicated"}, "all-gather"),
    ({"use_layer_wise_distributed_optimizer": True}, "all-gather"),
  ],
)
def test_build_forwards_the_mesh_fields(fields, collective):
  # on a (2, 4) mesh: kernels split over model need duplicated's gather, and
  # replicated ones are shared out over data by the layer-wise optimizer
  mesh = jax.make_mesh(
    (2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2
  )
  column = P(None, "model") if "muon_tp_mode" in fields else P()
  specs = {"a": column, "b": column}
  params = {
    name: jax.device_put(jnp.ones((32, 64)), NamedSharding(mesh, spec))
    for name, spec in specs.items()
  }
  counts = {}
  for config in (
    om.MuonConfig(optimizer="muon", **fields),
    om.MuonConfig(optimizer="muon"),
  ):
    tx = config.build(1e-2, mesh=mesh, specs=specs)
    with jax.set_mesh(mesh):
      hlo = (
        jax.jit(lambda p: tx.update(p, tx.init(p), p)[0])
        .lower(params)
        .compile()
        .as_text()
      )
    counts[config == om.MuonConfig(optimizer="muon")] = hlo.count(
      f" {collective}("
    ) + hlo.count(f" {collective}-start(")
  assert counts[False] > 0 and counts[True] == 0, counts


# MuonConfig survives asdict -> JSON -> from_dict ----------------------------


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


# from_overrides surprises ---------------------------------------------------


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


@pytest.mark.parametrize(
  "overrides, build",
  [
    (
      ["optimizer=dion2", "dion2_fraction=0.5", "dion2_ef_decay=0.9"],
      lambda lr, **kw: om.dion2(lr, fraction=0.5, ef_decay=0.9, **kw),
    ),
    (
      ["optimizer=nordion2", "muon_momentum=0.9", "nordion2_beta2=0.99"],
      lambda lr, **kw: om.nordion2(lr, beta=0.9, beta2=0.99, **kw),
    ),
    (
      [
        "optimizer=dion",
        "muon_momentum=0.9",
        "dion_rank_fraction=0.5",
        "dion_qr_method=rcqr",
      ],
      lambda lr, coefficients, **kw: om.dion(
        lr, ef_decay=0.9, rank_fraction=0.5, qr_method="rcqr", **kw
      ),
    ),
    (
      ["optimizer=muon_bp", "muon_bp_period=3"],
      lambda lr, **kw: om.muon_bp(
        lr, period=3, beta=0.95, nesterov=False, **kw
      ),
    ),
  ],
)
def test_the_family_names_build_their_optimizer(overrides, build):
  cfg = om.MuonConfig.from_overrides(
    ["lr=0.02", "clip_grad=0", "muon_fp32_matmul_prec=highest", *overrides]
  )
  params = {"w": gaussian((16, 32), 0), "b": jnp.zeros(32)}
  want_tx = build(
    0.02,
    coefficients="quintic",
    scale_mode="spectral",
    weight_decay=0.01,
    adam_weight_decay=0.01,
    adam_b2=0.999,
  )
  got_tx = cfg.build(params=params)
  got_state, want_state = got_tx.init(params), want_tx.init(params)
  for step in range(3):  # the momentum's settings act from the second step
    grads = {"w": gaussian((16, 32), 1 + step), "b": jnp.ones(32)}
    got, got_state = got_tx.update(grads, got_state, params)
    want, want_state = want_tx.update(grads, want_state, params)
    chex.assert_trees_all_close(got, want, atol=1e-7)


@pytest.mark.parametrize(
  "overrides, field",
  [
    (["optimizer=dion2", "muon_tp_mode=blockwise"], "muon_tp_mode"),
    (["optimizer=dion2", "muon_tp_mode=auto"], "muon_tp_mode"),
    (["optimizer=nordion2", "muon_tp_mode=blockwise"], "muon_tp_mode"),
    (["optimizer=dion", "muon_tp_mode=allgather"], "muon_tp_mode"),
    (
      ["optimizer=dion2", "use_layer_wise_distributed_optimizer=true"],
      "use_layer_wise_distributed_optimizer",
    ),
    (["optimizer=nordion2", "muon_momentum_bits=8"], "muon_momentum_bits"),
    (["optimizer=dion2", "dion2_fraction=1.5"], "dion2_fraction"),
    (["optimizer=dion2", "dion2_ef_decay=-1"], "dion2_ef_decay"),
    (
      ["optimizer=dion2", "dion2_selection_scope=shard"],
      "dion2_selection_scope",
    ),
    (["optimizer=nordion2", "nordion2_beta2=1"], "nordion2_beta2"),
    (["optimizer=muon_bp", "muon_bp_period=0"], "muon_bp_period"),
    (["optimizer=dion", "dion_rank_fraction=0"], "dion_rank_fraction"),
    (["optimizer=dion", "dion_qr_method=householder"], "dion_qr_method"),
    (["optimizer=dion", "muon_tp_mode=blockwise"], "muon_tp_mode"),
  ],
)
def test_the_family_names_reject_what_they_cannot_do(overrides, field):
  with pytest.raises(ValueError, match=field):
    om.MuonConfig.from_overrides(overrides)


def test_dion2_with_an_exact_tp_mode_selects_in_each_shard():
  # fan-out split over 2 model devices: the config's Dion2 is om.dion2's
  # local scope on the same TensorParallel, and not the whole-matrix one
  mesh = jax.make_mesh((2,), ("model",), axis_types=(AxisType.Auto,))
  specs = {"w": P(None, "model"), "b": P()}
  put = lambda tree: jax.tree.map(
    lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs
  )
  params = put({"w": gaussian((16, 32), 0), "b": jnp.zeros(32)})
  grads = [
    put({"w": gaussian((16, 32), 1 + i), "b": jnp.ones(32)}) for i in range(3)
  ]
  cfg = om.MuonConfig.from_overrides(
    [
      "optimizer=dion2",
      "lr=0.02",
      "clip_grad=0",
      "muon_fp32_matmul_prec=highest",
      "muon_tp_mode=allgather",
    ]
  )
  sharding = om.TensorParallel(mesh, "model", "allgather", specs=specs)
  kwargs = dict(
    coefficients="quintic",
    scale_mode="spectral",
    weight_decay=0.01,
    adam_weight_decay=0.01,
    adam_b2=0.999,
  )
  local = om.dion2(0.02, sharding=sharding, **kwargs)
  whole = om.dion2(0.02, **kwargs)

  def run(tx):
    state, out = tx.init(params), []
    for g in grads:
      updates, state = jax.jit(tx.update)(g, state, params)
      out.append(updates["w"])
    return out

  got = run(cfg.build(params=params, mesh=mesh, specs=specs))
  chex.assert_trees_all_close(got, run(local), atol=1e-7)
  assert (
    max(float(jnp.abs(a - b).max()) for a, b in zip(got, run(whole))) > 1e-3
  )


def test_dion2_selection_scope_global_takes_what_the_local_scope_refuses():
  # a (16, 4, 8) kernel with two fan-out axes split over model: the local
  # scope refuses it at init, naming the config field; global takes it and
  # is the unsharded update
  mesh = jax.make_mesh((2,), ("model",), axis_types=(AxisType.Auto,))
  specs = {"heads": P(None, "model", None)}
  dims = {"heads": om.MuonDimensionNumbers(0, (1, 2))}
  params = {"heads": gaussian((16, 4, 8), 0)}
  grads = {"heads": gaussian((16, 4, 8), 1)}
  fields = [
    "optimizer=dion2",
    "lr=0.02",
    "clip_grad=0",
    "muon_fp32_matmul_prec=highest",
    "muon_tp_mode=allgather",
  ]
  build = lambda cfg: cfg.build(
    params=params, mesh=mesh, specs=specs, dimension_numbers=dims
  )
  local = build(om.MuonConfig.from_overrides(fields))
  with pytest.raises(ValueError, match="dion2_selection_scope='global'"):
    local.init(params)
  tx = build(
    om.MuonConfig.from_overrides([*fields, "dion2_selection_scope=global"])
  )
  got, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  unsharded = om.MuonConfig.from_overrides(fields[:-1]).build(
    params=params, dimension_numbers=dims
  )
  want, _ = unsharded.update(grads, unsharded.init(params), params)
  chex.assert_trees_all_close(got, want, atol=1e-6)


@pytest.mark.parametrize(
  "optimizer, field, value",
  [
    ("muon", "dion2_fraction", 0.5),
    ("muon", "adaptive_muon_beta2", 0.9),
    ("dion2", "nordion2_beta2", 0.9),
    ("nordion2", "dion_rank_fraction", 0.5),
    ("adaptive_muon", "muon_bp_period", 3),
  ],
)
def test_a_members_field_set_for_another_member_is_refused_by_name(
  optimizer, field, value
):
  with pytest.raises(ValueError, match=f"{field}={value!r} is read only by"):
    om.MuonConfig(optimizer=optimizer, **{field: value})
  # its own member reads it, and adam keeps verl's configs (from_dict warns)
  readers = [
    r for p, r in muon_config.FIELDS_READ_BY.items() if field.startswith(p)
  ]
  om.MuonConfig(optimizer=readers[0][0], **{field: value})
  om.MuonConfig(optimizer="adam", **{field: value})


@pytest.mark.parametrize(
  "fields, message",
  [
    (
      dict(optimizer="dion2", muon_tp_mode="blockwise"),
      "muon_tp_mode='blockwise' is not accepted with optimizer='dion2'",
    ),
    (
      dict(optimizer="nordion2", muon_tp_mode="auto"),
      "muon_tp_mode='auto' is not accepted with optimizer='nordion2'",
    ),
    (
      dict(optimizer="dion", muon_tp_mode="duplicated"),
      "muon_tp_mode='duplicated' is not accepted with optimizer='dion'",
    ),
    (
      dict(optimizer="dion", use_layer_wise_distributed_optimizer=True),
      "use_layer_wise_distributed_optimizer=True is not accepted with "
      "optimizer='dion'.*'muon'",
    ),
    (
      dict(optimizer="dion2", muon_momentum_bits=8),
      "muon_momentum_bits=8 is not accepted with optimizer='dion2'",
    ),
  ],
)
def test_a_setting_a_member_does_not_take_is_refused_by_name(fields, message):
  # what each member takes is declared beside it (optimizers.registry)
  with pytest.raises(ValueError, match=message):
    om.MuonConfig(**fields)


def test_every_member_is_built_by_the_config_as_by_its_function():
  params = {"w": normal(jax.random.key(0), (16, 32)), "b": jnp.zeros(32)}
  grads = {"w": normal(jax.random.key(1), (16, 32)), "b": jnp.ones(32)}
  direct = {
    "muon": om.muon(0.1),
    "adaptive_muon": om.adaptive_muon(0.1),
    "muon_bp": om.muon_bp(0.1, period=5),
    # the config's Newton–Schulz schedule and scale are Muon's
    "dion2": om.dion2(0.1, coefficients="quintic", scale_mode="spectral"),
    "nordion2": om.nordion2(
      0.1, beta=0.95, coefficients="quintic", scale_mode="spectral"
    ),
    "dion": om.dion(0.1, ef_decay=0.95, scale_mode="spectral"),
  }
  # the config's defaults that differ from the functions': none of these
  defaults = dict(
    muon_fp32_matmul_prec="highest",
    betas=(0.9, 0.999),
    eps=1e-8,
    weight_decay=0.0,
    clip_grad=0.0,
    muon_split_qkv=False,
    muon_split_gate_up=False,
  )
  assert set(direct) == set(muon_config.OPTIMIZERS) - {"adam"}
  for name, tx in direct.items():
    config = om.MuonConfig(optimizer=name, **defaults)
    built = config.build(0.1)
    got, _ = built.update(grads, built.init(params), params)
    want, _ = tx.update(grads, tx.init(params), params)
    chex.assert_trees_all_close(got, want, atol=1e-6, custom_message=name)


def _megatron_tp_tree():
  """A Megatron TP layer: fused QKV [Q | K | V] and gate-up [gate | up]
  column-parallel over 4 ranks (no shard holds a whole piece), the output
  projections row-parallel."""
  keys = iter(jax.random.split(jax.random.key(7), 4))
  params = {
    "linear_qkv": normal(next(keys), (32, 96)),
    "linear_proj": normal(next(keys), (32, 32)),
    "linear_fc1_gate_up": normal(next(keys), (32, 128)),
    "linear_fc2": normal(next(keys), (64, 32)),
  }
  specs = {
    "linear_qkv": P(None, "model"),
    "linear_proj": P("model", None),
    "linear_fc1_gate_up": P(None, "model"),
    "linear_fc2": P("model", None),
  }
  return params, specs


@pytest.mark.parametrize("optimizer", ["muon", "muon_bp"])
def test_unset_tp_mode_works_on_a_megatron_tp_tree_with_fused_kernels(
  optimizer,
):
  # issue 57 item 3: muon_tp_mode unset (Megatron's blockwise) failed at the
  # first update on the fused gate-up; now each fused leaf split along its
  # fan-out runs an exact mode, every other leaf blockwise
  mesh = jax.make_mesh(
    (2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2
  )
  params, specs = _megatron_tp_tree()
  split_qkv = om.SplitQKV(4, 4, 8, layout="concatenated")
  config = om.MuonConfig(
    optimizer=optimizer, lr=0.02, muon_fp32_matmul_prec="highest", clip_grad=0.0
  )
  tx = config.build(mesh=mesh, specs=specs, split_qkv=split_qkv)
  placed = jax.tree.map(
    lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs
  )
  got, _ = jax.jit(tx.update)(placed, tx.init(placed), placed)
  unsharded = config.build(split_qkv=split_qkv)
  want, _ = unsharded.update(params, unsharded.init(params), params)
  for name in ("linear_qkv", "linear_fc1_gate_up"):  # exact: as unsharded
    np.testing.assert_allclose(got[name], want[name], atol=1e-6, err_msg=name)
  if optimizer == "muon_bp":  # step 0 is a full step: every leaf exact
    np.testing.assert_allclose(got["linear_fc2"], want["linear_fc2"], atol=1e-6)
    return
  # the row-parallel leaves are blockwise: each shard its own matrix
  shard = {"linear_fc2": params["linear_fc2"][:16]}
  one, _ = unsharded.update(shard, unsharded.init(shard), shard)
  np.testing.assert_allclose(
    np.asarray(got["linear_fc2"])[:16], one["linear_fc2"], atol=1e-6
  )
  assert np.abs(np.asarray(got["linear_fc2"]) - want["linear_fc2"]).max() > 1e-3


def test_blockwise_on_a_fused_kernel_split_along_its_fan_out_fails_at_init():
  mesh = jax.make_mesh(
    (2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2
  )
  params, specs = _megatron_tp_tree()
  tx = om.MuonConfig(optimizer="muon", muon_tp_mode="blockwise").build(
    mesh=mesh,
    specs=specs,
    split_qkv=om.SplitQKV(4, 4, 8, layout="concatenated"),
  )
  with pytest.raises(
    ValueError,
    match=r"leaf linear_fc1_gate_up: split_gate_up cannot .*muon_tp_mode",
  ):
    tx.init(params)
