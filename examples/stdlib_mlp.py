"""Muon vs AdamW on a byte-level MLP language model of the Python stdlib.

A context of ``--context`` bytes predicts the next byte. Both optimizers train
the same model from the same initialization on the same batches; the script
prints each one's validation loss (nats per byte). Nothing is downloaded: the
text is the standard library's own ``.py`` sources.

    python examples/stdlib_mlp.py --steps 300
"""

import argparse
import pathlib
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import optax_muon as om


def stdlib_bytes(limit: int) -> tuple[np.ndarray, np.ndarray]:
  """Train and validation bytes: sorted stdlib files, every 10th to val."""
  files = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
  if not files:
    raise FileNotFoundError("no .py files in the Python standard library")
  train, val, size = [], [], 0
  for i, path in enumerate(files):
    data = path.read_bytes()
    (val if i % 10 == 0 else train).append(data)
    size += len(data)
    if size >= limit:
      break
  as_array = lambda parts: np.frombuffer(b"\n".join(parts), np.uint8)
  return as_array(train), as_array(val)


class ByteMLP(nnx.Module):

  def __init__(self, context: int, width: int, rngs: nnx.Rngs):
    self.embed = nnx.Embed(256, 32, rngs=rngs)
    self.hidden = nnx.Linear(context * 32, width, rngs=rngs)
    self.mid = nnx.Linear(width, width, rngs=rngs)
    self.lm_head = nnx.Linear(width, 256, rngs=rngs)

  def __call__(self, context):
    x = self.embed(context).reshape(context.shape[0], -1)
    x = jax.nn.gelu(self.hidden(x))
    x = x + jax.nn.gelu(self.mid(x))
    return self.lm_head(x)


def batches(data, context, batch, seed):
  rng = np.random.default_rng(seed)
  while True:
    starts = rng.integers(0, len(data) - context - 1, batch)
    windows = np.stack([data[s:s + context + 1] for s in starts])
    yield jnp.asarray(windows[:, :-1], jnp.int32), jnp.asarray(windows[:, -1],
                                                                jnp.int32)


def loss_fn(model, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def train(tx, args, train_data, val_data):
  model = ByteMLP(args.context, args.width, nnx.Rngs(args.seed))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss

  data = batches(train_data, args.context, args.batch, args.seed)
  for _ in range(args.steps):
    loss = step(model, optimizer, *next(data))
  val = batches(val_data, args.context, 512, seed=1234)
  val_loss = np.mean([float(jax.jit(loss_fn)(model, *next(val)))
                      for _ in range(4)])
  return float(loss), float(val_loss)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--context", type=int, default=16)
  parser.add_argument("--width", type=int, default=256)
  parser.add_argument("--lr", type=float, default=3e-3,
                      help="AdamW's learning rate, which Muon reuses through "
                      "match_adamw_update_rms=True")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--max-bytes", type=int, default=2_000_000)
  args = parser.parse_args(argv)
  train_data, val_data = stdlib_bytes(args.max_bytes)
  print(f"stdlib text: {len(train_data):,} train bytes, {len(val_data):,} "
        f"val bytes; {args.steps} steps of {args.batch}")
  results = {}
  for name, tx in [
      ("muon", om.muon(args.lr, match_adamw_update_rms=True)),
      ("adamw", optax.adamw(args.lr))]:
    start = time.perf_counter()
    train_loss, val_loss = train(tx, args, train_data, val_data)
    results[name] = val_loss
    print(f"{name:6s} final train loss {train_loss:.4f}  val loss "
          f"{val_loss:.4f}  ({time.perf_counter() - start:.1f} s)")
  return results


if __name__ == "__main__":
  main()
