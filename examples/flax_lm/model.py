"""A small decoder-only GPT in Flax NNX.

Token and position embeddings, pre-norm blocks (attention + MLP or a small
dense mixture of experts), an optional fused QKV projection in Megatron's
grouped layout, grouped-query attention, an optional scan over stacked layers,
and an untied lm_head. Attention is computed explicitly (einsum, causal mask,
softmax) so that each layer can report its largest pre-softmax logit per head,
which QK-clip needs (``GPT.forward``). ``GPT.decode`` runs the same layers over
a key/value cache, for sampling (``examples/grpo_arith``).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  vocab_size: int = 256
  block_size: int = 128
  n_layer: int = 4
  n_head: int = 4
  n_kv_head: int | None = None  # None: n_head (no grouping)
  n_embd: int = 128
  mlp_ratio: int = 4
  fused_qkv: bool = True
  scan_layers: bool = False
  n_experts: int = 0  # 0: a plain MLP

  @property
  def head_dim(self) -> int:
    return self.n_embd // self.n_head

  @property
  def kv_heads(self) -> int:
    return self.n_kv_head or self.n_head

  def __post_init__(self):
    if self.n_embd % self.n_head:
      raise ValueError(f"model.n_embd={self.n_embd} must be a multiple of "
                       f"model.n_head={self.n_head}")
    if self.n_head % self.kv_heads:
      raise ValueError(f"model.n_kv_head={self.kv_heads} must divide "
                       f"model.n_head={self.n_head}")


# Megatron's tensor parallelism on a (data, model) mesh: QKV and the MLP's
# first layer split their outputs (column-parallel), the projections back
# split their inputs (row-parallel).
COLUMN, ROW = (None, "model"), ("model", None)


def _dense(n_in, n_out, rngs, use_bias=True, sharding=None):
  kernel_init = nnx.initializers.lecun_normal()
  bias_init = nnx.initializers.zeros_init()
  if sharding is not None:
    kernel_init = nnx.with_partitioning(kernel_init, sharding)
    bias_init = nnx.with_partitioning(bias_init, (sharding[1],))
  return nnx.Linear(n_in, n_out, use_bias=use_bias, kernel_init=kernel_init,
                    bias_init=bias_init, rngs=rngs)


class Attention(nnx.Module):
  """Causal self-attention with grouped key/value heads."""

  def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    d, hd = cfg.n_embd, cfg.head_dim
    if cfg.fused_qkv:
      # Megatron's grouped layout: per KV group [q_g | k_g | v_g].
      self.qkv = _dense(d, (cfg.n_head + 2 * cfg.kv_heads) * hd, rngs, False,
                        COLUMN)
    else:
      self.query = _dense(d, cfg.n_head * hd, rngs, False, COLUMN)
      self.key = _dense(d, cfg.kv_heads * hd, rngs, False, COLUMN)
      self.value = _dense(d, cfg.kv_heads * hd, rngs, False, COLUMN)
    self.proj = _dense(cfg.n_head * hd, d, rngs, False, ROW)

  def _project(self, x):
    """Queries ``(b, t, n_head, hd)``, keys and values ``(b, t, kv_heads, hd)``."""
    cfg, (b, t, _) = self.cfg, x.shape
    hd, groups = cfg.head_dim, cfg.kv_heads
    if cfg.fused_qkv:
      per_group = cfg.n_head // groups
      qkv = self.qkv(x).reshape(b, t, groups, (per_group + 2) * hd)
      q = qkv[..., :per_group * hd].reshape(b, t, cfg.n_head, hd)
      k = qkv[..., per_group * hd:(per_group + 1) * hd]
      v = qkv[..., (per_group + 1) * hd:]
      return q, k, v
    return (self.query(x).reshape(b, t, cfg.n_head, hd),
            self.key(x).reshape(b, t, groups, hd),
            self.value(x).reshape(b, t, groups, hd))

  def _attend(self, q, k, v, visible):
    """Attention of queries ``q`` over keys ``k`` where ``visible``
    ``(t_q, t_k)`` allows; ``(out, max_logits)``."""
    cfg, (b, t, _, hd) = self.cfg, q.shape
    # each query head h reads key/value head h // (n_head / kv_heads)
    k = jnp.repeat(k, cfg.n_head // cfg.kv_heads, axis=2)
    v = jnp.repeat(v, cfg.n_head // cfg.kv_heads, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    scores = jnp.where(visible, scores, -jnp.inf)
    # the largest logit each head produced, over batch and positions (QK-clip)
    max_logits = jax.lax.stop_gradient(scores.max(axis=(0, 2, 3)))
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
    return self.proj(out.reshape(b, t, cfg.n_head * hd)), max_logits

  def __call__(self, x):
    t = x.shape[1]
    return self._attend(*self._project(x), jnp.tril(jnp.ones((t, t), bool)))

  def decode(self, x, cache, position):
    """``x`` at positions ``position, position + 1, ...`` attending over the
    keys and values cached before them; ``(out, max_logits, cache)``."""
    q, k, v = self._project(x)
    keys, values = (jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype),
                                                        position, axis=1)
                    for c, new in zip(cache, (k, v)))
    queries_at = position + jnp.arange(x.shape[1])
    visible = jnp.arange(keys.shape[1])[None, :] <= queries_at[:, None]
    out, max_logits = self._attend(q, keys, values, visible)
    return out, max_logits, (keys, values)


class MLP(nnx.Module):

  def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
    self.fc = _dense(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd, rngs, True, COLUMN)
    self.proj = _dense(cfg.mlp_ratio * cfg.n_embd, cfg.n_embd, rngs, True, ROW)

  def __call__(self, x):
    return self.proj(jax.nn.gelu(self.fc(x)))


class Experts(nnx.Module):
  """A dense mixture of experts: every expert runs, weighted by the router."""

  def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
    d, h, e = cfg.n_embd, cfg.mlp_ratio * cfg.n_embd, cfg.n_experts
    init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1,
                                         batch_axis=(0,))
    self.router = _dense(d, e, rngs, False)
    self.fc = nnx.Param(init(rngs.params(), (e, d, h)))
    self.proj = nnx.Param(init(rngs.params(), (e, h, d)))

  def __call__(self, x):
    weights = jax.nn.softmax(self.router(x), axis=-1)
    hidden = jax.nn.gelu(jnp.einsum("btd,edh->bteh", x, self.fc[...]))
    out = jnp.einsum("bteh,ehd->bted", hidden, self.proj[...])
    return jnp.einsum("bted,bte->btd", out, weights)


class Block(nnx.Module):

  def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.ln1 = nnx.LayerNorm(cfg.n_embd, rngs=rngs)
    self.attn = Attention(cfg, rngs)
    self.ln2 = nnx.LayerNorm(cfg.n_embd, rngs=rngs)
    # "experts" names the MoE so that layout inference reads its free expert
    # axis (btd,edh->bteh) as a batch axis (optax_muon.infer_layout)
    if cfg.n_experts:
      self.experts = Experts(cfg, rngs)
    else:
      self.mlp = MLP(cfg, rngs)

  def __call__(self, x):
    """``(x, max_logits)``: the block's output and its attention's largest
    logit per head, ``(n_head,)``."""
    attended, max_logits = self.attn(self.ln1(x))
    return self._feed_forward(x + attended), max_logits

  def decode(self, x, cache, position):
    """``__call__`` for ``x`` at ``position`` with a key/value cache;
    ``(x, max_logits, cache)``."""
    attended, max_logits, cache = self.attn.decode(self.ln1(x), cache, position)
    return self._feed_forward(x + attended), max_logits, cache

  def _feed_forward(self, x):
    feed_forward = self.experts if self.cfg.n_experts else self.mlp
    return x + feed_forward(self.ln2(x))


class GPT(nnx.Module):
  """Byte-level GPT: ``(batch, time)`` int tokens to ``(batch, time, vocab)``."""

  def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
    # Sharding annotations place the params only under a mesh
    # (jax.set_mesh); without one they are metadata.
    with nnx.use_eager_sharding(not jax.sharding.get_abstract_mesh().empty):
      self._build(cfg, rngs)

  def _build(self, cfg: GPTConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.wte = nnx.Embed(cfg.vocab_size, cfg.n_embd, rngs=rngs)
    self.wpe = nnx.Embed(cfg.block_size, cfg.n_embd, rngs=rngs)
    if cfg.scan_layers:
      @nnx.split_rngs(splits=cfg.n_layer)
      @nnx.vmap(in_axes=(0,), out_axes=0,
                transform_metadata={nnx.PARTITION_NAME: None})
      def stacked_blocks(rngs):
        return Block(cfg, rngs)
      self.blocks = stacked_blocks(rngs)
    else:
      self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layer)])
    self.ln_f = nnx.LayerNorm(cfg.n_embd, rngs=rngs)
    self.lm_head = _dense(cfg.n_embd, cfg.vocab_size, rngs, False)

  def __call__(self, tokens):
    return self.forward(tokens)[0]

  def forward(self, tokens):
    """``(logits, max_logits)``: ``(batch, time, vocab)`` and each layer's
    largest attention logit per head, ``(n_layer, n_head)``."""
    x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[-1]))
    if self.cfg.scan_layers:
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
      def run(x, block):
        return block(x)
      x, max_logits = run(x, self.blocks)
    else:
      per_layer = []
      for block in self.blocks:
        x, layer_max = block(x)
        per_layer.append(layer_max)
      max_logits = jnp.stack(per_layer)
    return self.lm_head(self.ln_f(x)), max_logits

  def init_cache(self, batch: int, length: int, dtype=jnp.float32):
    """An empty key/value cache for ``decode``: per layer ``(keys, values)``,
    each ``(batch, length, kv_heads, head_dim)`` (stacked over layers when
    they are scanned)."""
    cfg = self.cfg
    shape = (batch, length, cfg.kv_heads, cfg.head_dim)
    if cfg.scan_layers:
      shape = (cfg.n_layer,) + shape
      return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
            for _ in range(cfg.n_layer)]

  def decode(self, tokens, cache, position):
    """``forward`` for ``tokens`` ``(batch, t)`` placed at positions
    ``position … position + t − 1`` of sequences whose earlier keys and values
    are in ``cache``: ``(logits, cache)``. A prompt goes in at position 0
    (the prefill), then one token at a time."""
    x = self.wte(tokens) + self.wpe(position + jnp.arange(tokens.shape[-1]))
    if self.cfg.scan_layers:
      @nnx.scan(in_axes=(nnx.Carry, 0, 0, None), out_axes=(nnx.Carry, 0))
      def run(x, block, layer_cache, position):
        x, _, layer_cache = block.decode(x, layer_cache, position)
        return x, layer_cache
      x, cache = run(x, self.blocks, cache, position)
    else:
      updated = []
      for block, layer_cache in zip(self.blocks, cache):
        x, _, layer_cache = block.decode(x, layer_cache, position)
        updated.append(layer_cache)
      cache = updated
    return self.lm_head(self.ln_f(x)), cache
