"""The policy's text interface: prompts as bytes, a jitted sampler, log-probs.

The policy is ``examples/flax_lm``'s byte-level GPT. A prompt is the question
and a newline, left-padded with NUL bytes to a fixed width, so that every
prompt of a batch ends at the same position and needs no attention mask; a
completion is the model's next ``completion_len`` bytes, of which the text
runs up to and including the first newline (the end of the answer). Bytes
after it are generated (the batch decodes in lock-step) but masked out of
every loss and reward.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

PAD, END = 0, ord("\n")


def _encode(texts, width: int, field: str, left: bool) -> np.ndarray:
  rows = []
  for text in texts:
    data = (text + "\n").encode()
    if len(data) > width:
      raise ValueError(
        f"a text of {len(data)} bytes does not fit "
        f"train.{field}={width}; raise it"
      )
    padded = (data.rjust if left else data.ljust)(width, bytes([PAD]))
    rows.append(np.frombuffer(padded, np.uint8))
  return np.stack(rows).astype(np.int32)


def encode_prompts(questions, width: int) -> np.ndarray:
  """``(len(questions), width)`` int32: each ``question + "\\n"``, left-padded."""
  return _encode(questions, width, "prompt_width", left=True)


def encode_completions(texts, length: int) -> np.ndarray:
  """``(len(texts), length)`` int32: each ``text + "\\n"``, right-padded."""
  return _encode(texts, length, "completion_len", left=False)


def completion_mask(completions) -> jax.Array:
  """1.0 up to and including each row's first newline, 0.0 after it."""
  ended_before = jnp.cumsum(completions == END, axis=-1) - (completions == END)
  return (ended_before == 0).astype(jnp.float32)


def decode_completions(completions) -> list[str]:
  """Each row's text, up to (not including) its first newline."""
  texts = []
  for row in np.asarray(completions):
    data = bytes(row.astype(np.uint8).tolist()).split(bytes([END]), 1)[0]
    texts.append(data.decode("utf-8", errors="replace"))
  return texts


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def sample(
  graphdef, params, prompts, completion_len: int, temperature: float, key
) -> jax.Array:
  """``(batch, completion_len)`` tokens continuing ``prompts``.

  The prompt fills the key/value cache in one pass, then a ``lax.scan``
  decodes one token a step. ``temperature == 0`` is greedy (argmax).
  """
  model = nnx.merge(graphdef, params)
  batch, width = prompts.shape
  cache = model.init_cache(batch, width + completion_len)
  logits, cache = model.decode(prompts, cache, 0)

  def pick(logits, key):
    if temperature == 0:
      return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature).astype(jnp.int32)

  def step(carry, key):
    logits, cache, position = carry
    token = pick(logits, key)
    logits, cache = model.decode(token[:, None], cache, position)
    return (logits[:, -1], cache, position + 1), token

  keys = jax.random.split(key, completion_len)
  _, tokens = jax.lax.scan(step, (logits[:, -1], cache, width), keys)
  return tokens.T


def token_logprobs(model, prompts, completions, temperature: float = 1.0):
  """``(log p(completion_t | prompt, completion_<t), max_logits)``:
  ``(batch, completion_len)`` and the forward's ``(n_layer, n_head)``; ``p``
  is the policy at ``temperature`` (the one that sampled, for GRPO)."""
  sequences = jnp.concatenate([prompts, completions], axis=1)
  logits, max_logits = model.forward(sequences[:, :-1])
  logits = logits[:, prompts.shape[1] - 1 :].astype(jnp.float32)
  logprobs = jax.nn.log_softmax(logits / temperature, axis=-1)
  chosen = jnp.take_along_axis(logprobs, completions[..., None], axis=-1)
  return chosen[..., 0], max_logits
