"""8-bit against float32 momentum on a teacher–student regression.

    python benchmarks/momentum_8bit.py [--quick] [--steps N] [--seeds N]

A student MLP (64 → 256 → 256 → 16, GELU) regresses a random teacher of the
same shape on fresh Gaussian inputs, trained by ``om.muon`` (lr 0.02 or
``--lr``, β 0.95,
the hidden kernels to Muon, the rest to AdamW), once with the momentum in
float32 and once in 8 bits (``om.QuantizedMomentum()``), the same seeds,
batches and initial weights. Prints one JSON line per seed (the final loss of
each, the mean of the last 10 steps) and a summary line: the ratio of the
8-bit mean to the float32 mean, the gap, and float32's own spread over seeds
(max − min), so the gap is read against the seeds' noise. The LM side of the
comparison is ``examples.flax_lm.compare`` (docs/examples.md).
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from _timing import emit  # noqa: E402

import optax_muon as om  # noqa: E402

WIDTHS = (64, 256, 256, 16)


def mlp(params, x):
  for i, layer in enumerate(params):
    x = x @ layer["kernel"] + layer["bias"]
    if i < len(params) - 1:
      x = jax.nn.gelu(x)
  return x


def init_mlp(key):
  keys = jax.random.split(key, len(WIDTHS) - 1)
  return [
    {
      "kernel": jax.random.normal(k, (n_in, n_out)) / jnp.sqrt(n_in),
      "bias": jnp.zeros(n_out),
    }
    for k, n_in, n_out in zip(keys, WIDTHS[:-1], WIDTHS[1:])
  ]


def labels(params):
  last = len(params) - 1
  return [
    {"kernel": "adam" if i in (0, last) else "muon", "bias": "adam"}
    for i in range(len(params))
  ]


def train(
  mu_dtype, seed: int, steps: int, lr: float = 0.02, batch: int = 256
) -> list[float]:
  """The loss of each step."""
  teacher = init_mlp(jax.random.key(10_000 + seed))
  params = init_mlp(jax.random.key(seed))
  tx = om.muon(lr, labels=labels(params), mu_dtype=mu_dtype)
  state = tx.init(params)

  @jax.jit
  def step(params, state, key):
    x = jax.random.normal(key, (batch, WIDTHS[0]))
    loss_fn = lambda p: jnp.mean((mlp(p, x) - mlp(teacher, x)) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for key in jax.random.split(jax.random.key(20_000 + seed), steps):
    params, state, loss = step(params, state, key)
    losses.append(float(loss))
  return losses


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=50)
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--lr", type=float, default=0.02)
  parser.add_argument("--quick", action="store_true", help="10 steps, 2 seeds")
  args = parser.parse_args(argv)
  if args.quick:
    args.steps, args.seeds = 10, 2
  finals: dict[str, list[float]] = {"float32": [], "8bit": []}
  for seed in range(args.seeds):
    record = {
      "benchmark": "momentum_8bit",
      "seed": seed,
      "steps": args.steps,
      "lr": args.lr,
    }
    for name, mu_dtype in (
      ("float32", "float32"),
      ("8bit", om.QuantizedMomentum()),
    ):
      losses = train(mu_dtype, seed, args.steps, args.lr)
      final = statistics.mean(losses[-10:])
      finals[name].append(final)
      record[f"{name}_final_loss"] = final
    emit(record)
  mean32, mean8 = (statistics.mean(finals[k]) for k in ("float32", "8bit"))
  emit(
    {
      "benchmark": "momentum_8bit",
      "summary": True,
      "steps": args.steps,
      "lr": args.lr,
      "seeds": args.seeds,
      "float32_mean": mean32,
      "8bit_mean": mean8,
      "8bit_over_float32": mean8 / mean32,
      "gap": mean8 - mean32,
      "float32_spread": max(finals["float32"]) - min(finals["float32"]),
      "8bit_spread": max(finals["8bit"]) - min(finals["8bit"]),
    }
  )


if __name__ == "__main__":
  main()
