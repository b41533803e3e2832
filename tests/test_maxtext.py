"""optax_muon.integrations.maxtext in MaxText's own, unmodified train.py: a
tiny Llama-2 on 4 simulated CPU devices, synthetic data. After ``install()``
MaxText's ``opt_type=muon`` is optax_muon's; with an exact tensor-parallel
mode its losses are MaxText's own Muon's (optax.contrib.muon, partitioned
by XLA), on TP 4 and on FSDP 2 × TP 2. Needs MaxText (Python >= 3.12:
pip install -e ".[maxtext]" && pip install --no-deps maxtext==0.2.5)."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

maxtext = pytest.importorskip("maxtext")
pytestmark = pytest.mark.integration

STEPS = 8
# MaxText's own run: install() with tp_mode=None keeps MaxText's optimizer
RUN = """
import sys
from absl import app
from optax_muon.integrations import maxtext as adapter
if sys.argv[1] != "maxtext":
  adapter.install(tp_mode=sys.argv[1])
from maxtext.trainers.pre_train import train
app.run(train.main, argv=["train"] + sys.argv[2:])
"""


def _losses(tmp_path, mode, fsdp, tp):
  config = os.path.join(
    os.path.dirname(maxtext.__file__), "configs", "base.yml"
  )
  arguments = [
    config,
    "run_name=test",
    f"base_output_directory={tmp_path}",
    "enable_checkpointing=false",
    "skip_jax_distributed_system=true",
    "dataset_type=synthetic",
    f"steps={STEPS}",
    "log_period=1",
    "model_name=llama2-7b",
    "override_model_config=true",
    "base_emb_dim=256",
    "base_num_query_heads=4",
    "base_num_kv_heads=4",
    "base_mlp_dim=512",
    "base_num_decoder_layers=2",
    "head_dim=64",
    "vocab_size=1024",
    "max_target_length=128",
    "per_device_batch_size=1",
    "attention=dot_product",
    f"ici_fsdp_parallelism={fsdp}",
    f"ici_tensor_parallelism={tp}",
    "opt_type=muon",
    "learning_rate=0.003",
  ]
  tmp_path.mkdir(parents=True, exist_ok=True)
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS="--xla_force_host_platform_device_count=4",
  )
  result = subprocess.run(
    [sys.executable, "-c", RUN, mode, *arguments],
    capture_output=True,
    text=True,
    timeout=900,
    env=env,
    cwd=tmp_path,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  losses = [
    float(x)
    for x in re.findall(
      r"completed step: \d+, .*? loss: ([0-9.]+)", result.stderr
    )
  ]
  assert len(losses) == STEPS, result.stderr[-3000:]
  return np.array(losses)


@pytest.mark.parametrize(
  "fsdp, tp, mode", [(1, 4, "duplicated"), (2, 2, "auto")]
)
def test_installed_muon_trains_as_maxtexts_own_in_an_exact_mode(
  tmp_path, fsdp, tp, mode
):
  ours = _losses(tmp_path / "ours", mode, fsdp, tp)
  theirs = _losses(tmp_path / "theirs", "maxtext", fsdp, tp)
  np.testing.assert_allclose(ours, theirs, atol=1e-3)
  assert ours[-1] < ours[0] - 1.0  # it trains: 7.46 -> 3.48
  if mode == "duplicated":
    # and it is optax_muon that runs: blockwise orthogonalizes each shard
    blockwise = _losses(tmp_path / "blockwise", "blockwise", fsdp, tp)
    assert np.abs(blockwise - theirs).max() > 0.05


def test_install_puts_get_optimizer_in_maxtexts_place_and_uninstall_restores():
  from maxtext.optimizers import optimizers

  from optax_muon.integrations import maxtext as adapter

  own = optimizers.get_optimizer
  adapter.install(tp_mode="allgather")
  try:
    installed = optimizers.get_optimizer
    assert installed.func is adapter.get_optimizer
    assert installed.keywords == {"tp_mode": "allgather"}
    adapter.install(tp_mode="auto")  # again: new options, one original kept
    assert optimizers.get_optimizer.keywords == {"tp_mode": "auto"}
  finally:
    adapter.uninstall()
  assert optimizers.get_optimizer is own


def test_the_callers_keywords_win_over_maxtexts_settings():
  import types

  import jax
  import jax.numpy as jnp
  from flax import nnx
  from maxtext.common.common_types import DecoderBlockType

  from optax_muon.integrations import maxtext as adapter

  config = types.SimpleNamespace(
    opt_type="muon",
    decoder_block=DecoderBlockType.LLAMA2,
    muon_beta=0.95,
    muon_weight_decay=0.0,
    muon_consistent_rms=None,
    muon_include_routers=True,
    mu_dtype=None,
    adam_b1=0.9,
    adam_b2=0.95,
    adam_eps=1e-8,
    adam_eps_root=0.0,
    adam_weight_decay=0.0,
  )
  model = nnx.Linear(256, 256, use_bias=False, rngs=nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  # MaxText's config says mu_dtype=None (the param dtype, float32 here)
  tx = adapter.get_optimizer(config, 0.01, model=model, mu_dtype="bfloat16")
  dtypes = {x.dtype for x in jax.tree.leaves(tx.init(params))}
  assert jnp.dtype(jnp.bfloat16) in dtypes, dtypes  # the momentum's
  plain = adapter.get_optimizer(config, 0.01, model=model)
  assert jnp.dtype(jnp.bfloat16) not in {
    x.dtype for x in jax.tree.leaves(plain.init(params))
  }
