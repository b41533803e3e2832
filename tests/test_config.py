"""MuonConfig: verl / Megatron-Core names, defaults, parsing and validation."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_muon as om

# verl's actor.optim and Megatron-Core's muon_* defaults (DESIGN §7); None is
# "unset": muon_tp_mode resolves to blockwise with a mesh, the extra factor to
# 1.0 or the RMS-matching factor
DEFAULTS = {
    "optimizer": "adam", "lr": 1e-6, "betas": (0.9, 0.999), "eps": 1e-8,
    "weight_decay": 0.01, "clip_grad": 1.0,
    "use_layer_wise_distributed_optimizer": False, "muon_momentum": 0.95,
    "muon_nesterov": False, "muon_split_qkv": True,
    "muon_scale_mode": "spectral", "muon_coefficient_type": "quintic",
    "muon_num_ns_steps": 5, "muon_tp_mode": None,
    "muon_fp32_matmul_prec": "medium", "muon_extra_scale_factor": None,
    "muon_scalar_optimizer": "adam", "muon_match_adamw_update_rms": False,
    "muon_momentum_style": "ema",
}


def test_every_field_has_the_reference_default():
  cfg = om.MuonConfig()
  assert set(om.MuonConfig.field_names()) == set(DEFAULTS)
  for name, value in DEFAULTS.items():
    assert getattr(cfg, name) == value, name


@pytest.mark.parametrize("prefix", ["", "optim.", "actor_rollout_ref.actor.optim."])
def test_overrides_parse_with_any_dotted_prefix(prefix):
  cfg = om.MuonConfig.from_overrides([
      f"{prefix}optimizer=muon", f"{prefix}muon_momentum=0.9",
      f"{prefix}betas=[0.9,0.95]", f"{prefix}muon_nesterov=true",
      f"{prefix}muon_num_ns_steps=8", f"{prefix}lr=3e-4",
      f"{prefix}muon_tp_mode=duplicated"])
  assert (cfg.optimizer, cfg.muon_momentum, cfg.betas, cfg.muon_nesterov,
          cfg.muon_num_ns_steps, cfg.lr, cfg.muon_tp_mode) == (
              "muon", 0.9, (0.9, 0.95), True, 8, 3e-4, "duplicated")


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
]


@pytest.mark.parametrize("override, field", BAD_OVERRIDES)
def test_bad_override_raises_naming_the_field(override, field):
  with pytest.raises(ValueError, match=field.replace("[", r"\[").replace(
      "]", r"\]")):
    om.MuonConfig.from_overrides([override])


def test_match_adamw_update_rms_conflicts_with_any_explicit_extra_factor():
  for value in ("1.0", "0.2"):
    with pytest.raises(ValueError, match="set exactly one"):
      om.MuonConfig.from_overrides(["muon_match_adamw_update_rms=true",
                                    f"muon_extra_scale_factor={value}"])
  with pytest.raises(ValueError, match="set exactly one"):
    om.MuonConfig(muon_match_adamw_update_rms=True, muon_extra_scale_factor=1.0)
  assert om.MuonConfig(muon_match_adamw_update_rms=True).extra_scale_factor == (
      pytest.approx(om.adamw_rms_match_factor(0.9)))


def test_resolved_factor_is_logged(caplog):
  from optax_muon import alias
  alias._logged_factors.clear()
  caplog.set_level("INFO", logger="optax_muon")
  om.MuonConfig(optimizer="muon", muon_match_adamw_update_rms=True).build(1e-3)
  assert any("0.229416" in r.getMessage() for r in caplog.records)


def test_adam_builds_plain_adamw_with_clip():
  params = {"w": jnp.ones((4, 4)), "b": jnp.ones((4,))}
  grads = {"w": jnp.full((4, 4), 10.0), "b": jnp.full((4,), 10.0)}
  cfg = om.MuonConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0)
  updates, _ = cfg.build().update(grads, cfg.build().init(params), params)
  reference = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
      1e-2, weight_decay=0.1, mask={"w": True, "b": False}))
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
  om.MuonConfig(optimizer="muon", muon_split_qkv=False).build(1e-3,
                                                            params=params)
