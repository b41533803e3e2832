"""The policy: a small Llama from Tunix's own model code, bytes as tokens,
its supervised warm start and its greedy accuracy.

A prompt is ``question + " A: "``; the answer the model writes is one line
(worked steps, then ``\\boxed{answer}``), its newline the end token.
"""

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tunix.generate import sampler as sampler_lib
from tunix.models.llama3 import model as llama3

from examples.grpo_arith import task

PAD, BEGIN, END = 0, 1, ord("\n")


class ByteTokenizer:
  """Bytes as token ids (what Tunix's tokenizer adapter asks of a custom
  one: ``encode``, ``decode`` and the pad, begin and end ids)."""

  def encode(self, text: str, **kwargs) -> list[int]:
    del kwargs
    return list(text.encode())

  def decode(self, ids, **kwargs) -> str:
    del kwargs
    data = bytes(int(i) for i in ids if int(i) not in (PAD, BEGIN))
    return data.split(bytes([END]), 1)[0].decode("utf-8", errors="replace")

  def pad_id(self) -> int:
    return PAD

  def bos_id(self) -> int:
    return BEGIN

  def eos_id(self) -> int:
    return END


def prompt(question: str) -> str:
  return question + " A: "


def make_model(layers: int, width: int, seed: int) -> llama3.Llama3:
  """Tunix's Llama 3, randomly initialized: ``layers`` blocks of ``width``
  (4 query heads, 2 key/value heads), a byte vocabulary."""
  config = llama3.ModelConfig(
    num_layers=layers,
    vocab_size=256,
    embed_dim=width,
    hidden_dim=3 * width,
    num_heads=4,
    head_dim=width // 4,
    num_kv_heads=2,
    rope_theta=10_000,
    norm_eps=1e-5,
  )
  return llama3.Llama3(config, rngs=nnx.Rngs(seed))


def _causal_mask(tokens):
  length = tokens.shape[1]
  causal = jnp.tril(jnp.ones((length, length), bool))[None]
  return causal & (tokens != PAD)[:, None, :]


def example_inputs(model, length: int = 16):
  """One batch of the model's inputs (what ``om.infer_layout`` traces)."""
  del model
  tokens = jnp.zeros((1, length), jnp.int32)
  positions = jnp.arange(length)[None]
  return tokens, positions, None, jnp.ones((1, length, length), bool)


def _solutions(problems, width: int) -> np.ndarray:
  tokenizer = ByteTokenizer()
  rows = []
  for p in problems:
    ids = [BEGIN, *tokenizer.encode(prompt(p.question) + p.solution + "\n")]
    if len(ids) > width:
      raise ValueError(f"a solution of {len(ids)} bytes exceeds {width}")
    rows.append(ids + [PAD] * (width - len(ids)))
  return np.array(rows, np.int32)


def supervised_warm_start(model, problems, steps: int, lr: float, seed: int):
  """``steps`` steps of next-byte loss on worked solutions (Adam, warm-up
  and cosine decay), batches of 32; the last loss."""

  def loss_fn(model, tokens):
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
    logits, _ = model(inputs, positions, None, _causal_mask(inputs))
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    weights = targets != PAD
    return (losses * weights).sum() / weights.sum()

  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, 30, steps)
  optimizer = nnx.Optimizer(model, optax.adam(schedule), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, tokens):
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
    optimizer.update(model, grads)
    return loss

  rng = np.random.default_rng(seed)
  width = 8 + max(len(prompt(p.question) + p.solution) for p in problems)
  loss = jnp.nan
  for _ in range(steps):
    batch = [problems[i] for i in rng.integers(0, len(problems), 32)]
    loss = step(model, optimizer, jnp.asarray(_solutions(batch, width)))
  return float(loss)


def cache_size(prompt_len: int, completion_len: int) -> int:
  """The key/value cache for prompts padded to ``prompt_len`` and
  ``completion_len`` generated tokens (Tunix's sampler asks for more than
  their sum)."""
  return prompt_len + completion_len + 8


def greedy_accuracy(model, problems, prompt_len: int, completion_len: int):
  """The share of ``problems`` answered right, decoding greedily with
  Tunix's sampler."""
  config = model.config
  sampler = sampler_lib.Sampler(
    model,
    ByteTokenizer(),
    sampler_lib.CacheConfig(
      cache_size=cache_size(prompt_len, completion_len),
      num_layers=config.num_layers,
      num_kv_heads=config.num_kv_heads,
      head_dim=config.head_dim,
    ),
  )
  output = sampler(
    [prompt(p.question) for p in problems],
    max_generation_steps=completion_len,
    temperature=0.0,
    eos_tokens=[END],
  )
  right = [
    task.extract_answer(text) == p.answer
    for text, p in zip(output.text, problems)
  ]
  return float(np.mean(right))
