"""The run's optimizer: how the example GPT meets optax_muon.

``make_optimizer`` is what ``train.py`` calls: ``optim.*`` (an
``optax_muon.MuonConfig``) built for this model, with the layout read from its
own forward pass, its fused QKV described, and its attention kernels named for
QK-clip. ``train.muon_impl=optax.contrib`` swaps in ``optax.contrib.muon`` as a
user migrating to it writes it: compare.py's baseline. The helpers are shared
with the GRPO example, which trains the same GPT.
"""

import logging

import jax
import jax.numpy as jnp
import optax

import optax_muon as om
from examples.flax_lm import config as config_lib
from examples.flax_lm.model import GPT


def learning_rate_schedule(cfg: config_lib.RunConfig):
  """Linear warm-up to ``optim.lr``, then cosine decay to a tenth of it."""
  return optax.warmup_cosine_decay_schedule(
    0.0,
    cfg.optim.lr,
    cfg.train.warmup_steps,
    max(cfg.train.steps, 1),
    end_value=0.1 * cfg.optim.lr,
  )


def split_qkv_of(cfg: config_lib.RunConfig):
  """The fused QKV kernel's heads, so Muon orthogonalizes Q, K, V apart."""
  model = cfg.model
  if not model.fused_qkv or model.attention == "mla":
    return None
  return om.SplitQKV(model.n_head, model.kv_heads, model.head_dim)


def layout_of(cfg: config_lib.RunConfig, model: GPT) -> om.Layout:
  """Which leaves are matrices, and how, read from the model's own forward
  pass on a batch of the run's shape (traced, nothing computed)."""
  return om.infer_layout(
    model, jax.ShapeDtypeStruct((1, cfg.model.block_size), jnp.int32)
  )


def attention_of(cfg: config_lib.RunConfig) -> dict:
  """Where each attention layer's query and key kernels are, for QK-clip:
  one entry for a scanned stack (its max logits are ``(n_layer, n_head)``),
  else one per layer."""
  model = cfg.model
  layers = (
    {"blocks": "blocks/attn"}
    if model.scan_layers
    else {f"layer{i}": f"blocks/{i}/attn" for i in range(model.n_layer)}
  )
  if model.attention == "mla":
    return {
      name: {
        "q": f"{where}/wq_b/kernel",
        "kv": f"{where}/wkv_b/kernel",
        "num_heads": model.n_head,
        "qk_nope_head_dim": model.qk_nope_head_dim,
        "qk_rope_head_dim": model.qk_rope_head_dim,
        "v_head_dim": model.v_head_dim,
      }
      for name, where in layers.items()
    }
  if model.fused_qkv:
    return {
      name: {"qkv": f"{where}/qkv/kernel", "split_qkv": split_qkv_of(cfg)}
      for name, where in layers.items()
    }
  return {
    name: {
      "q": f"{where}/query/kernel",
      "k": f"{where}/key/kernel",
      "num_heads": model.n_head,
      "num_kv_heads": model.kv_heads,
      "head_dim": model.head_dim,
    }
    for name, where in layers.items()
  }


def max_logits_by_layer(cfg: config_lib.RunConfig, max_logits) -> dict:
  """The model's ``(n_layer, n_head)`` max logits keyed as ``attention_of``."""
  if cfg.model.scan_layers:
    return {"blocks": max_logits}
  return {f"layer{i}": max_logits[i] for i in range(cfg.model.n_layer)}


def optax_contrib_muon(cfg: config_lib.RunConfig, params):
  """``optax.contrib.muon`` as a user migrating to it writes it: the run's
  schedule, weight decay and clipping, optax's defaults for the rest (2-D
  leaves, the embeddings too, to Muon); and its routing, as labels."""
  clip = (
    [optax.clip_by_global_norm(cfg.optim.clip_grad)]
    if cfg.optim.clip_grad > 0
    else []
  )
  tx = optax.chain(
    *clip,
    optax.contrib.muon(
      learning_rate_schedule(cfg), weight_decay=cfg.optim.weight_decay
    ),
  )
  labels = jax.tree.map(lambda x: "muon" if x.ndim == 2 else "adam", params)
  return tx, labels


def make_optimizer(
  cfg: config_lib.RunConfig, params, layout: om.Layout, mesh=None, specs=None
):
  """``(tx, labels)``: the run's optimizer and which leaves it gives Muon."""
  if cfg.train.muon_impl == "optax.contrib":
    return optax_contrib_muon(cfg, params)
  tx = cfg.optim.build(
    learning_rate_schedule(cfg),
    params=params,
    split_qkv=split_qkv_of(cfg),
    mesh=mesh,
    specs=specs,
    attention=attention_of(cfg),
    layout=layout,
  )
  return tx, layout.labels


def log_what_muon_sees(cfg: config_lib.RunConfig, params, layout) -> None:
  """Logs ``om.describe``'s table: each leaf's route and the matrices Muon
  orthogonalizes (for optax_muon's Muon family only)."""
  if (
    cfg.optim.optimizer not in config_lib.MUON_OPTIMIZERS
    or cfg.train.muon_impl != "optax_muon"
  ):
    return
  optim = cfg.optim
  logging.getLogger("flax_lm").info(
    "which matrices Muon sees:\n%s",
    om.describe(
      params,
      split_qkv=split_qkv_of(cfg) if optim.muon_split_qkv else None,
      split_gate_up=om.SplitGateUp() if optim.muon_split_gate_up else None,
      layout=layout,
      moment2_method=optim.adaptive_muon_moment2_method
      if optim.optimizer == "adaptive_muon"
      else None,
    ),
  )
