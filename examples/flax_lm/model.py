"""A small decoder-only GPT in Flax NNX.

Token and position embeddings, pre-norm blocks (attention + MLP or a small
dense mixture of experts), an optional fused QKV projection in Megatron's
grouped layout, grouped-query attention or DeepSeek's multi-head latent
attention (``attention="mla"``), a GELU MLP or a SwiGLU one with a fused
gate/up kernel (``mlp="swiglu"``), an optional scan over stacked layers, and an
untied lm_head. Attention is computed explicitly (einsum, causal mask,
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
  fused_qkv: bool = True  # grouped-query attention only
  scan_layers: bool = False
  n_experts: int = 0  # 0: a plain MLP
  attention: str = "gqa"  # or "mla": multi-head latent attention
  mlp: str = "gelu"  # or "swiglu": silu(gate) · up from one fused kernel
  # multi-head latent attention (DeepSeek-V2's names)
  q_lora_rank: int = 32
  kv_lora_rank: int = 32
  qk_nope_head_dim: int = 16
  qk_rope_head_dim: int = 8
  v_head_dim: int = 16

  @property
  def head_dim(self) -> int:
    return self.n_embd // self.n_head

  @property
  def kv_heads(self) -> int:
    return self.n_kv_head or self.n_head

  @property
  def cache_dims(self) -> tuple[tuple[int, int], tuple[int, int]]:
    """``(heads, width)`` of the cached keys and of the cached values."""
    if self.attention == "mla":
      return (
        (self.n_head, self.qk_nope_head_dim + self.qk_rope_head_dim),
        (self.n_head, self.v_head_dim),
      )
    return (self.kv_heads, self.head_dim), (self.kv_heads, self.head_dim)

  def __post_init__(self):
    for name, accepted in (
      ("attention", ("gqa", "mla")),
      ("mlp", ("gelu", "swiglu")),
    ):
      if getattr(self, name) not in accepted:
        raise ValueError(
          f"model.{name}={getattr(self, name)!r} is not "
          f"accepted; accepted values: {list(accepted)}"
        )
    for name in (
      "q_lora_rank",
      "kv_lora_rank",
      "qk_nope_head_dim",
      "v_head_dim",
    ):
      if getattr(self, name) < 1:
        raise ValueError(f"model.{name}={getattr(self, name)} must be >= 1")
    if self.qk_rope_head_dim < 0 or self.qk_rope_head_dim % 2:
      raise ValueError(
        f"model.qk_rope_head_dim={self.qk_rope_head_dim} must "
        "be even and >= 0 (rotary pairs)"
      )
    if self.n_embd % self.n_head:
      raise ValueError(
        f"model.n_embd={self.n_embd} must be a multiple of "
        f"model.n_head={self.n_head}"
      )
    if self.n_head % self.kv_heads:
      raise ValueError(
        f"model.n_kv_head={self.kv_heads} must divide "
        f"model.n_head={self.n_head}"
      )


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
  return nnx.Linear(
    n_in,
    n_out,
    use_bias=use_bias,
    kernel_init=kernel_init,
    bias_init=bias_init,
    rngs=rngs,
  )


class _CausalAttention(nnx.Module):
  """Attention over keys and values from ``_project``, reporting each head's
  largest logit; subclasses say how queries, keys and values are made."""

  def _attend(self, q, k, v, visible):
    """Attention of queries ``q`` ``(b, t, n_head, d)`` over keys ``k``
    where ``visible`` ``(t_q, t_k)`` allows; ``(out, max_logits)``."""
    (b, t, n_head, d) = q.shape
    # each query head h reads key/value head h // (n_head / kv_heads)
    k = jnp.repeat(k, n_head // k.shape[2], axis=2)
    v = jnp.repeat(v, n_head // v.shape[2], axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    scores = jnp.where(visible, scores, -jnp.inf)
    # the largest logit each head produced, over batch and positions (QK-clip)
    max_logits = jax.lax.stop_gradient(scores.max(axis=(0, 2, 3)))
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
    return self.proj(out.reshape(b, t, -1)), max_logits

  def __call__(self, x):
    t = x.shape[1]
    return self._attend(
      *self._project(x, jnp.arange(t)), jnp.tril(jnp.ones((t, t), bool))
    )

  def decode(self, x, cache, position):
    """``x`` at positions ``position, position + 1, ...`` attending over the
    keys and values cached before them; ``(out, max_logits, cache)``."""
    queries_at = position + jnp.arange(x.shape[1])
    q, k, v = self._project(x, queries_at)
    keys, values = (
      jax.lax.dynamic_update_slice_in_dim(
        c, new.astype(c.dtype), position, axis=1
      )
      for c, new in zip(cache, (k, v))
    )
    visible = jnp.arange(keys.shape[1])[None, :] <= queries_at[:, None]
    out, max_logits = self._attend(q, keys, values, visible)
    return out, max_logits, (keys, values)


class Attention(_CausalAttention):
  """Causal self-attention with grouped key/value heads."""

  def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    d, hd = cfg.n_embd, cfg.head_dim
    if cfg.fused_qkv:
      # Megatron's grouped layout: per KV group [q_g | k_g | v_g].
      self.qkv = _dense(
        d, (cfg.n_head + 2 * cfg.kv_heads) * hd, rngs, False, COLUMN
      )
    else:
      self.query = _dense(d, cfg.n_head * hd, rngs, False, COLUMN)
      self.key = _dense(d, cfg.kv_heads * hd, rngs, False, COLUMN)
      self.value = _dense(d, cfg.kv_heads * hd, rngs, False, COLUMN)
    self.proj = _dense(cfg.n_head * hd, d, rngs, False, ROW)

  def _project(self, x, positions):
    """Queries ``(b, t, n_head, hd)``, keys and values ``(b, t, kv_heads, hd)``
    (positions enter through the learned position embedding)."""
    del positions
    cfg, (b, t, _) = self.cfg, x.shape
    hd, groups = cfg.head_dim, cfg.kv_heads
    if cfg.fused_qkv:
      per_group = cfg.n_head // groups
      qkv = self.qkv(x).reshape(b, t, groups, (per_group + 2) * hd)
      q = qkv[..., : per_group * hd].reshape(b, t, cfg.n_head, hd)
      k = qkv[..., per_group * hd : (per_group + 1) * hd]
      v = qkv[..., (per_group + 1) * hd :]
      return q, k, v
    return (
      self.query(x).reshape(b, t, cfg.n_head, hd),
      self.key(x).reshape(b, t, groups, hd),
      self.value(x).reshape(b, t, groups, hd),
    )


def rotary(x, positions):
  """Rotary position embedding of ``x`` ``(b, t, ..., d)`` at ``positions``
  ``(t,)``: the two halves of the last axis rotated as pairs."""
  half = x.shape[-1] // 2
  angle = positions[:, None] / 10_000.0 ** (jnp.arange(half) / half)
  angle = angle.reshape(angle.shape[:1] + (1,) * (x.ndim - 3) + (half,))
  x1, x2 = x[..., :half], x[..., half:]
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class LatentAttention(_CausalAttention):
  """Multi-head latent attention (DeepSeek-V2), MaxText's kernel names.

  Queries come from a low-rank latent (``wq_a`` then ``wq_b``, each head
  ``[q_nope | q_rope]``); keys and values from another (``wkv_a`` gives the
  latent and one rotary key ``k_rope`` shared by all heads, ``wkv_b`` each
  head's ``[k_nope | v]``). A head's logit is ``q_nope·k_nope + q_rope·k_rope``,
  which is why QK-clip leaves ``k_rope`` alone (``om.clip_mla_qk``).
  """

  def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    d, h = cfg.n_embd, cfg.n_head
    nope, rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    self.wq_a = _dense(d, cfg.q_lora_rank, rngs, False)
    self.q_norm = nnx.RMSNorm(cfg.q_lora_rank, rngs=rngs)
    self.wq_b = _dense(cfg.q_lora_rank, h * (nope + rope), rngs, False, COLUMN)
    self.wkv_a = _dense(d, cfg.kv_lora_rank + rope, rngs, False)
    self.kv_norm = nnx.RMSNorm(cfg.kv_lora_rank, rngs=rngs)
    self.wkv_b = _dense(
      cfg.kv_lora_rank, h * (nope + cfg.v_head_dim), rngs, False, COLUMN
    )
    self.proj = _dense(h * cfg.v_head_dim, d, rngs, False, ROW)

  def _project(self, x, positions):
    """Queries and keys ``(b, t, n_head, nope + rope)``, values ``(b, t,
    n_head, v_head_dim)``."""
    cfg, (b, t, _) = self.cfg, x.shape
    h, nope = cfg.n_head, cfg.qk_nope_head_dim
    q = self.wq_b(self.q_norm(self.wq_a(x))).reshape(b, t, h, -1)
    q = jnp.concatenate([q[..., :nope], rotary(q[..., nope:], positions)], -1)
    latent = self.wkv_a(x)
    k_rope = rotary(latent[..., cfg.kv_lora_rank :], positions)  # (b, t, rope)
    kv = self.wkv_b(self.kv_norm(latent[..., : cfg.kv_lora_rank]))
    kv = kv.reshape(b, t, h, -1)
    k = jnp.concatenate(
      [
        kv[..., :nope],
        jnp.broadcast_to(k_rope[:, :, None], (b, t, h, cfg.qk_rope_head_dim)),
      ],
      -1,
    )
    return q, k, kv[..., nope:]


class MLP(nnx.Module):
  def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
    self.fc = _dense(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd, rngs, True, COLUMN)
    self.proj = _dense(cfg.mlp_ratio * cfg.n_embd, cfg.n_embd, rngs, True, ROW)

  def __call__(self, x):
    return self.proj(jax.nn.gelu(self.fc(x)))


class GatedMLP(nnx.Module):
  """SwiGLU with Megatron's fused ``linear_fc1``: one kernel ``(d, 2·ffn)``
  whose halves are the gate and the up projection (``om.SplitGateUp``)."""

  def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
    hidden = cfg.mlp_ratio * cfg.n_embd
    self.gate_up = _dense(cfg.n_embd, 2 * hidden, rngs, False, COLUMN)
    self.proj = _dense(hidden, cfg.n_embd, rngs, False, ROW)

  def __call__(self, x):
    gate, up = jnp.split(self.gate_up(x), 2, axis=-1)
    return self.proj(jax.nn.silu(gate) * up)


class Experts(nnx.Module):
  """A dense mixture of experts: every expert runs, weighted by the router."""

  def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
    d, h, e = cfg.n_embd, cfg.mlp_ratio * cfg.n_embd, cfg.n_experts
    init = nnx.initializers.lecun_normal(
      in_axis=-2, out_axis=-1, batch_axis=(0,)
    )
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
    self.attn = (LatentAttention if cfg.attention == "mla" else Attention)(
      cfg, rngs
    )
    self.ln2 = nnx.LayerNorm(cfg.n_embd, rngs=rngs)
    # "experts" names the MoE so that layout inference reads its free expert
    # axis (btd,edh->bteh) as a batch axis (optax_muon.infer_layout)
    if cfg.n_experts:
      self.experts = Experts(cfg, rngs)
    else:
      self.mlp = (GatedMLP if cfg.mlp == "swiglu" else MLP)(cfg, rngs)

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
      @nnx.vmap(
        in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None}
      )
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
    each ``(batch, length, heads, width)`` (``GPTConfig.cache_dims``; stacked
    over layers when they are scanned)."""
    cfg = self.cfg
    shapes = [(batch, length) + dims for dims in cfg.cache_dims]
    if cfg.scan_layers:
      return tuple(jnp.zeros((cfg.n_layer,) + shape, dtype) for shape in shapes)
    return [
      tuple(jnp.zeros(shape, dtype) for shape in shapes)
      for _ in range(cfg.n_layer)
    ]

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
