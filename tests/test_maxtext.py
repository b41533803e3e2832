"""optax_muon.integrations.maxtext in MaxText's own, unmodified train.py: tiny
Llama-2, DeepSeek-V3 and Mistral (Qwen3 in the slow run) on 4 simulated CPU
devices, synthetic data, run by ``python -m optax_muon.integrations.maxtext``.
With an exact tensor-parallel mode the losses are MaxText's own Muon's
(optax.contrib.muon, partitioned by XLA), on TP 4 and on FSDP 2 × TP 2;
Mistral, whose block MaxText refuses Muon for, trains with its routing read
by om.infer_layout; 8-bit momentum trains and its state is sharded. Needs
MaxText (Python >= 3.12: pip install -e ".[maxtext]" && pip install
--no-deps maxtext==0.2.5)."""

import fcntl
import hashlib
import json
import os
import subprocess
import sys

import chex
import numpy as np
import pytest

maxtext = pytest.importorskip("maxtext")
pytestmark = pytest.mark.integration

STEPS = 20
CONFIG = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
_DENSE = [
  "base_emb_dim=256",
  "base_num_query_heads=4",
  "base_num_kv_heads=4",
  "base_mlp_dim=512",
  "base_num_decoder_layers=2",
  "head_dim=64",
]
# each model's own config, shrunk
TINY = {
  "llama2": ["model_name=llama2-7b", *_DENSE],
  # its tied embedding starts the loss at 186: an untied head keeps it ~7
  "qwen3": ["model_name=qwen3-0.6b", *_DENSE, "logits_via_embedding=false"],
  "deepseek3": [  # MLA, 4 routed experts and a shared one
    "model_name=deepseek3-tiny",
    "base_num_decoder_layers=3",
    "first_num_dense_layers=1",
    "num_experts=4",
    "num_experts_per_tok=2",
    # the experts' sparse matmul by jax.lax.ragged_dot: Megablox's Pallas
    # kernel runs interpreted on CPU (5 s a step, 136 s a run where this is
    # 47 s); the same parameters and, measured, the same 20 losses
    "megablox=false",
  ],
  "mistral": ["model_name=mistral-7b", *_DENSE],
}


# the losses agree to 2e-3 over 20 steps: a different summation order in the
# sharded Newton–Schulz, grown by training (Llama-2 at FSDP 2 × TP 2: 8.5e-4
# at worst with jax 0.12.0.1, 1.16e-3 at step 6 of 20 with jax 0.12.1, 3.1e-4
# of the loss).
# DeepSeek's router turns such a rounding into another expert now and then:
# 1.4e-3 at step 15 of 20, 3.1e-4 of the loss
TOLERANCE = {"deepseek3": {"rtol": 5e-4}}
_EXACT = {"atol": 2e-3}


def _run(tmp_path, model, fsdp, tp, *flags, extra=()):
  """MaxText's train.py through the adapter's command; its result."""
  tmp_path.mkdir(parents=True, exist_ok=True)
  arguments = [
    CONFIG,
    "run_name=test",
    f"base_output_directory={tmp_path}",
    f"metrics_file={tmp_path / 'metrics.jsonl'}",
    "enable_checkpointing=false",
    "skip_jax_distributed_system=true",
    "dataset_type=synthetic",
    f"steps={STEPS}",
    "log_period=1",
    "override_model_config=true",
    *TINY[model],
    "vocab_size=1024",
    "max_target_length=128",
    "per_device_batch_size=1",
    "attention=dot_product",
    f"ici_fsdp_parallelism={fsdp}",
    f"ici_tensor_parallelism={tp}",
    "opt_type=muon",
    "learning_rate=0.003",
    *extra,
  ]
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS="--xla_force_host_platform_device_count=4",
  )
  command = [sys.executable, "-m", "optax_muon.integrations.maxtext"]
  return subprocess.run(
    [*command, *flags, "train", *arguments],
    capture_output=True,
    text=True,
    timeout=900,
    env=env,
    cwd=tmp_path,
  )


@pytest.fixture(scope="session")
def runs(tmp_path_factory, worker_id):
  """A folder all of this session's xdist workers share: a MaxText run that
  two tests ask for (the same model, mesh, flags) runs once."""
  base = tmp_path_factory.getbasetemp()
  return base if worker_id == "master" else base.parent


def _losses(runs, model, fsdp, tp, *flags, extra=()):
  """The losses MaxText wrote, step by step, at full precision: the run's,
  or those of the same run another test (or worker) made first."""
  # the flags in a canonical order, the adapter's defaults written out
  # (--maxtexts-own, which takes no value, runs MaxText's optimizer alone)
  canonical = list(flags)
  if "--maxtexts-own" not in flags:
    named = dict(zip(flags[::2], flags[1::2]))
    named = {"--tp-mode": "auto", "--routing": "auto", **named}
    canonical = sorted(named.items())
  arguments = (model, fsdp, tp, canonical, list(extra))
  folder = (
    runs / hashlib.sha256(json.dumps(arguments).encode()).hexdigest()[:16]
  )
  folder.mkdir(parents=True, exist_ok=True)
  with open(folder / "lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # another worker's run of it: waited for
    done = folder / "losses.json"
    if not done.exists():
      result = _run(folder / "run", model, fsdp, tp, *flags, extra=extra)
      assert result.returncode == 0, result.stderr[-3000:]
      with open(folder / "run" / "metrics.jsonl") as lines:
        losses = [json.loads(line)["learning/loss"] for line in lines]
      assert len(losses) == STEPS, result.stderr[-3000:]
      done.write_text(json.dumps(losses))
  return np.array(json.loads(done.read_text()))


@pytest.mark.parametrize(
  "model, fsdp, tp, mode, routing",
  [
    ("llama2", 1, 4, "duplicated", "auto"),
    ("llama2", 2, 2, "auto", "auto"),
    # Qwen3's q and k norms, routed as Llama's are (a launch costs ~25 s,
    # most of it MaxText's import: the long run has it)
    pytest.param("qwen3", 2, 2, "auto", "auto", marks=pytest.mark.slow),
    # MLA and experts, their matrices read by om.infer_layout
    ("deepseek3", 2, 2, "auto", "inferred"),
  ],
)
def test_installed_muon_trains_as_maxtexts_own_in_an_exact_mode(
  runs, model, fsdp, tp, mode, routing
):
  ours = _losses(runs, model, fsdp, tp, "--tp-mode", mode, "--routing", routing)
  theirs = _losses(runs, model, fsdp, tp, "--maxtexts-own")
  np.testing.assert_allclose(ours, theirs, **TOLERANCE.get(model, _EXACT))
  assert ours[-1] < ours[0] - 1.0  # it trains: llama2 7.46 -> 3.48
  if mode == "duplicated":
    # and it is optax_muon that runs: blockwise orthogonalizes each shard
    blockwise = _losses(runs, model, fsdp, tp, "--tp-mode", "blockwise")
    assert np.abs(blockwise - theirs).max() > 0.05


def test_install_lets_muon_through_maxtexts_gate_routed_by_inference(runs):
  # MaxText's config refuses opt_type=muon for Mistral's block (read here,
  # in this process: a launch would cost MaxText's import again)
  gate = "Muon dimension numbers haven't been tested"
  with pytest.raises(ValueError, match=gate):
    _config("mistral", "opt_type=muon")
  ours = _losses(runs, "mistral", 2, 2, "--tp-mode", "auto")
  assert ours[-1] < ours[0] - 1.0


def test_8bit_momentum_trains_on_fsdp_and_tp(runs):
  quantized = _losses(
    runs, "llama2", 2, 2, "--tp-mode", "auto", "--mu-dtype", "8bit"
  )
  full = _losses(runs, "llama2", 2, 2, "--tp-mode", "auto")
  assert quantized[-1] < quantized[0] - 1.0
  # the momentum is rounded, not lost: within 2% of float32's losses
  np.testing.assert_allclose(quantized, full, rtol=2e-2)
  assert not np.array_equal(quantized, full)  # and it is 8-bit that ran


def test_8bit_state_offloaded_to_the_host_trains_as_on_the_device(runs):
  # MaxText's optimizer_memory_host_offload keeps the state in host memory
  # and moves it to the device inside the step, by the state's shardings:
  # the 8-bit scales' fitted ones among them
  flags = ("--tp-mode", "auto", "--mu-dtype", "8bit")
  offloaded = _losses(
    runs,
    "llama2",
    2,
    2,
    *flags,
    extra=("optimizer_memory_host_offload=true",),
  )
  on_device = _losses(runs, "llama2", 2, 2, *flags)
  np.testing.assert_array_equal(offloaded, on_device)


def _config(model, *overrides):
  """MaxText's config of a tiny ``model`` over the test's 8 devices."""
  from maxtext.configs import pyconfig

  return pyconfig.initialize(
    [
      None,
      CONFIG,
      "run_name=test",
      "skip_jax_distributed_system=true",
      "enable_checkpointing=false",
      "override_model_config=true",
      *TINY[model],
      "vocab_size=1024",
      "max_target_length=32",
      "per_device_batch_size=1",
      "attention=dot_product",
      *overrides,
    ]
  )


@pytest.mark.parametrize(
  "axes",
  [
    ("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"),
    # ZeRO-1 (MaxText refuses it with FSDP): the state over the data axis
    (
      "ici_data_parallelism=4",
      "ici_tensor_parallelism=2",
      "shard_optimizer_over_data=true",
    ),
  ],
  ids=["fsdp4_tp2", "zero1_data4_tp2"],
)
def test_8bit_state_is_sharded_wherever_its_param_is(axes):
  import jax
  from flax import nnx
  from maxtext.common import train_state_nnx
  from maxtext.utils import maxtext_utils
  from maxtext.utils import model_creation_utils

  import optax_muon as om
  from optax_muon.integrations import maxtext as adapter

  config = _config("llama2", "opt_type=muon", *axes)
  mesh = maxtext_utils.get_mesh_from_config(config)
  create, model = model_creation_utils.create_nnx_abstract_model(config, mesh)
  tx = adapter.get_optimizer(
    config, 0.01, model, mesh, mu_dtype=om.QuantizedMomentum()
  )

  def train_state():
    model = create()
    return train_state_nnx.TrainStateNNX(
      model, nnx.Optimizer(model, tx, wrt=nnx.Param)
    )

  abstract, _, _ = maxtext_utils.get_abstract_state(config, mesh, train_state)
  placed = lambda tree: {
    path[-4:]: leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
  }
  params = placed(nnx.to_pure_dict(abstract.model))
  optimizer = nnx.to_pure_dict(abstract.optimizer)
  moments = optimizer["opt_state"]["inner_states"]["muon"]["inner_state"][0]
  checked = 0
  for part in ("values", "scales"):  # int8 entries, a float32 scale a block
    for path, leaf in placed(moments["mu"][part]).items():
      param = params[path]
      # a sharding its shape divides (jit refuses any other), sharded where
      # the param is
      leaf.sharding.shard_shape(leaf.shape)
      if not param.sharding.is_fully_replicated:
        assert not leaf.sharding.is_fully_replicated, (part, path)
        checked += 1
  assert checked == 2 * 7  # q, k, v, out, wi_0, wi_1, wo


def test_without_a_mesh_passed_the_optimizer_finds_maxtexts():
  # MaxText's SFT trainer builds its optimizer inside jax.set_mesh(mesh),
  # its DPO trainer from a model placed on the mesh; neither passes mesh=
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from maxtext.utils import model_creation_utils

  from optax_muon.integrations import maxtext as adapter

  config = _config(
    "llama2",
    "opt_type=muon",
    "ici_fsdp_parallelism=4",
    "ici_tensor_parallelism=2",
  )
  model, mesh = model_creation_utils.from_pretrained(config)
  assert adapter.mesh_of(model) == mesh
  unplaced = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
  assert adapter.mesh_of(unplaced) is None
  with jax.set_mesh(mesh):
    assert adapter.mesh_of(unplaced) == mesh

  def updated(tp_mode="blockwise", **found):
    # blockwise orthogonalizes each TP shard alone: its numbers say
    # whether the optimizer ran over the mesh
    tx = adapter.get_optimizer(config, 0.01, model, tp_mode=tp_mode, **found)
    trained = nnx.clone(model)
    optimizer = nnx.Optimizer(trained, tx, wrt=nnx.Param)
    grads = jax.tree.map(
      lambda p: jnp.sin(7.0 * p), nnx.state(trained, nnx.Param)
    )
    optimizer.update(trained, grads)
    return nnx.to_pure_dict(nnx.state(trained, nnx.Param))

  given = updated(mesh=mesh)
  from_placed = updated()  # DPO's call
  with jax.set_mesh(mesh):
    from_current = updated()  # SFT's call
  unsharded = updated(tp_mode="duplicated", mesh=mesh)
  chex.assert_trees_all_close(from_placed, given, atol=0, rtol=0)
  chex.assert_trees_all_close(from_current, given, atol=0, rtol=0)
  apart = jax.tree.map(
    lambda a, b: float(jnp.abs(a - b).max()), given, unsharded
  )
  assert max(jax.tree.leaves(apart)) > 1e-4


def test_inferred_routing_agrees_with_maxtexts_table_on_mistral():
  import jax
  from maxtext.utils import maxtext_utils
  from maxtext.utils import model_creation_utils
  from maxtext.utils import muon_utils

  from optax_muon.integrations import maxtext as adapter

  config = _config("mistral", "ici_fsdp_parallelism=8")  # opt_type: adamw
  assert adapter._block_name(config) not in adapter.TESTED_BLOCKS
  mesh = maxtext_utils.get_mesh_from_config(config)
  _, model = model_creation_utils.create_nnx_abstract_model(config, mesh)
  is_dims = lambda x: x is None or hasattr(x, "reduction_axis")
  listed = lambda tree: dict(
    jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_dims)
  )
  ours = listed(adapter.dimension_numbers(model, config, mesh=mesh))
  from flax import nnx

  table = listed(
    nnx.to_pure_dict(muon_utils.get_muon_weight_dimension_numbers(model))
  )
  assert ours.keys() == table.keys()
  normalized = lambda d, ndim: (
    None
    if d is None
    else tuple(
      tuple(sorted(a % ndim for a in ((x,) if isinstance(x, int) else x)))
      for x in (d.reduction_axis, d.output_axis)
    )
  )
  shapes = {
    path: leaf.shape
    for path, leaf in jax.tree_util.tree_leaves_with_path(
      nnx.to_pure_dict(nnx.state(model, nnx.Param))
    )
  }
  for path, dims in ours.items():
    ndim = len(shapes[path])
    assert normalized(dims, ndim) == normalized(table[path], ndim), path
  assert sum(d is not None for d in ours.values()) == 7  # the kernels


def test_install_puts_get_optimizer_in_maxtexts_place_and_uninstall_restores():
  from maxtext.configs import pyconfig
  from maxtext.optimizers import optimizers

  from optax_muon.integrations import maxtext as adapter

  own, own_config = optimizers.get_optimizer, pyconfig._initialize_pydantic
  adapter.install(tp_mode="allgather")
  try:
    installed = optimizers.get_optimizer
    assert installed.func is adapter.get_optimizer
    assert installed.keywords == {"tp_mode": "allgather"}
    assert pyconfig._initialize_pydantic is not own_config
    adapter.install(tp_mode="auto")  # again: new options, one original kept
    assert optimizers.get_optimizer.keywords == {"tp_mode": "auto"}
  finally:
    adapter.uninstall()
  assert optimizers.get_optimizer is own
  assert pyconfig._initialize_pydantic is own_config


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
