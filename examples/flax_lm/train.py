"""Train the example GPT on byte-level text with Muon or AdamW.

    python -m examples.flax_lm.train optim.optimizer=muon train.steps=300
    python -m examples.flax_lm.train preset=small optim.optimizer=adam
    python -m examples.flax_lm.train ... --resume     # continue exactly

Everything a run writes goes under ``train.out_dir`` (``runs/<name>``):
``checkpoints/``, ``metrics.jsonl``, ``run.json`` and ``final.json``.
The optimizer is ``optimizer.py``'s; a mesh and several processes,
``distributed.py``'s (``launch_local.py`` starts them on one machine).
"""

import argparse
import contextlib
import json
import logging
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import numpy as np
import optax
from flax import nnx

import optax_muon as om
from examples.flax_lm import checkpoint as checkpoint_lib
from examples.flax_lm import config as config_lib
from examples.flax_lm import distributed
from examples.flax_lm import metrics as metrics_lib
from examples.flax_lm import optimizer as optimizer_lib
from examples.flax_lm import progress
from examples.flax_lm.data import ByteCorpus
from examples.flax_lm.model import GPT


class Built(NamedTuple):
  """What ``build`` makes for a run: ``labels`` is which leaves the optimizer
  gives Muon, ``layout`` what ``om.infer_layout`` read from the model."""

  graphdef: Any
  params: Any
  tx: optax.GradientTransformation
  opt_state: Any
  train_step: Callable
  eval_loss: Callable
  labels: Any
  layout: om.Layout


def build(cfg: config_lib.RunConfig, mesh=None) -> Built:
  """Model graph, params, optimizer, its state, and the jitted step/eval."""
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    model = GPT(cfg.model, nnx.Rngs(cfg.train.seed))
  layout = optimizer_lib.layout_of(cfg, model)
  graphdef, params = nnx.split(model)
  specs = nnx.get_partition_spec(params) if mesh is not None else None
  tx, labels = optimizer_lib.make_optimizer(cfg, params, layout, mesh, specs)
  # each Muon matrix's update RMS is logged under its group ("attn/qkv")
  muon_groups = {
    key: metrics_lib.matrix_group(path)
    for key, (path, label) in metrics_lib.named_leaves(labels).items()
    if label == "muon" and cfg.optim.optimizer in config_lib.MUON_OPTIMIZERS
  }

  def loss_fn(params, inputs, targets):
    logits, max_logits = nnx.merge(graphdef, params).forward(inputs)
    loss = optax.softmax_cross_entropy_with_integer_labels(
      logits, targets
    ).mean()
    return loss, max_logits

  def train_step(params, opt_state, inputs, targets):
    (loss, max_logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      params, inputs, targets
    )
    extra = {}
    if cfg.optim.qk_clip:  # QK-clip reads each head's largest logit
      extra["max_logits"] = optimizer_lib.max_logits_by_layer(cfg, max_logits)
    updates, opt_state = tx.update(grads, opt_state, params, **extra)
    params = optax.apply_updates(params, updates)
    metrics = {"train_loss": loss, "grad_norm": optax.tree.norm(grads)}
    metrics.update(metrics_lib.update_rms_by_group(updates, muon_groups))
    # the largest attention logit of each layer this step (before the clip)
    metrics.update(
      {f"max_logit/layer{i}": m for i, m in enumerate(max_logits.max(axis=-1))}
    )
    return params, opt_state, metrics

  opt_state = tx.init(params)
  out_shardings = None
  if mesh is not None:
    # the step hands params and state back where it took them, so that the
    # second step does not compile again for other shardings
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    opt_state = jax.tree.map(
      lambda x: (
        checkpoint_lib.place(np.asarray(x), replicated)
        if isinstance(x.sharding, jax.sharding.SingleDeviceSharding)
        else x
      ),
      opt_state,
    )
    out_shardings = (
      *jax.tree.map(lambda x: x.sharding, (params, opt_state)),
      replicated,
    )
  step = jax.jit(train_step, donate_argnums=(0, 1), out_shardings=out_shardings)
  eval_loss = jax.jit(lambda *args: loss_fn(*args)[0])
  return Built(graphdef, params, tx, opt_state, step, eval_loss, labels, layout)


def evaluate(eval_loss, params, corpus, cfg) -> float:
  """Mean loss over the first ``train.eval_batches`` validation batches."""
  losses = [
    eval_loss(
      params,
      *corpus.batch("val", i, cfg.train.batch_size, cfg.model.block_size),
    )
    for i in range(cfg.train.eval_batches)
  ]
  return float(np.mean([float(l) for l in losses]))


def train(
  cfg: config_lib.RunConfig,
  *,
  resume: bool = False,
  mesh=None,
  nested_progress: bool = False,
) -> dict:
  """Runs (or resumes) training; returns the contents of ``final.json``.
  ``nested_progress``: the step bar sits beneath a comparison's ``RunsBar``."""
  out = pathlib.Path(cfg.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  corpus = ByteCorpus(cfg.train.data, max_bytes=cfg.train.max_bytes)
  built = build(cfg, mesh)
  params, opt_state = built.params, built.opt_state
  writer = jax.process_index() == 0  # the others compute, they do not write
  if writer:
    optimizer_lib.log_what_muon_sees(cfg, params, built.layout)
  place = distributed.batch_placer(mesh)
  checkpoints = checkpoint_lib.Checkpointer(
    out / "checkpoints", cfg.train.keep_checkpoints
  )
  start = 0
  if resume and (restored := checkpoints.restore_latest((params, opt_state))):
    (params, opt_state), meta = restored
    start = meta["step"]
  if writer:
    summary = metrics_lib.run_summary(cfg, params, built.labels, corpus)
    (out / "run.json").write_text(json.dumps(summary, indent=1))
  schedule = optimizer_lib.learning_rate_schedule(cfg)
  tokens_per_step = cfg.train.batch_size * cfg.model.block_size
  steps = progress.step_bar(
    range(start, cfg.train.steps),
    nested=nested_progress,
    initial=start,
    total=cfg.train.steps,
    disable=not (cfg.train.progress and writer),
    desc=cfg.name,
    file=sys.stdout,
    mininterval=2.0,
  )
  val_loss, wall = None, 0.0
  log = metrics_lib.MetricsLog(out / "metrics.jsonl", start, enabled=writer)
  with log:
    for step in steps:
      batch = corpus.batch(
        "train",
        step,
        cfg.train.batch_size,
        cfg.model.block_size,
        cfg.train.seed,
      )
      begin = time.perf_counter()
      params, opt_state, metrics = built.train_step(
        params, opt_state, *place(batch)
      )
      metrics = {k: float(v) for k, v in metrics.items()}  # waits for the step
      seconds = time.perf_counter() - begin
      wall += seconds if step > start else 0.0  # the first step compiles
      done = step + 1
      last = done == cfg.train.steps
      logged = done % cfg.train.log_every == 0 or last
      evaluated = done % cfg.train.eval_every == 0 or last
      record = {"step": done, **metrics}
      if logged:
        record |= {
          "lr": float(schedule(step)),
          "step_time": seconds,
          "wall_time": wall,
          "tokens_per_s": tokens_per_step / seconds,
        }
      if evaluated:
        val_loss = evaluate(built.eval_loss, params, corpus, cfg)
        record["val_loss"] = val_loss
      if logged or evaluated:
        log.write(record)
      steps.set_postfix(
        loss=f"{metrics['train_loss']:.3f}",
        tok_s=f"{tokens_per_step / seconds:,.0f}",
      )
      every = cfg.train.checkpoint_every
      if (every and done % every == 0) or last:
        checkpoints.save(
          done,
          (params, opt_state),
          {"data_position": done, "seed": cfg.train.seed},
        )
  if val_loss is None:  # resumed after the last step
    val_loss = evaluate(built.eval_loss, params, corpus, cfg)
  final = {
    "optimizer": cfg.optim.optimizer,
    "steps": cfg.train.steps,
    "final_val_loss": val_loss,
    "params_sha256": checkpoint_lib.tree_sha256(params),
  }
  if writer:
    (out / "final.json").write_text(json.dumps(final, indent=1))
  return final


def main(argv=None):
  parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    epilog="overrides: preset=tiny|small, model.<field>=..., "
    "train.<field>=..., optim.<MuonConfig field>=...",
  )
  parser.add_argument("overrides", nargs="*")
  parser.add_argument(
    "--resume",
    action="store_true",
    help="continue from the newest good checkpoint",
  )
  parser.add_argument("--data", help="a text file or folder to train on")
  parser.add_argument(
    "--mesh",
    help="e.g. data=2,model=4: shard the params "
    "(tensor parallel over model, batches over data)",
  )
  parser.add_argument(
    "--num-processes",
    type=int,
    help="processes of a multi-process run (with "
    "--process-id and --coordinator; see launch_local.py)",
  )
  parser.add_argument("--process-id", type=int, help="this process, from 0")
  parser.add_argument("--coordinator", help="HOST:PORT of process 0")
  # flags may come between the overrides: "... --resume train.steps=9"
  args = parser.parse_intermixed_args(argv)
  # Log to stdout, ours at INFO and libraries' (orbax's absl) at ERROR, so
  # that stderr carries nothing but a failure's one line.
  logging.basicConfig(
    stream=sys.stdout, level=logging.WARNING, format="%(message)s", force=True
  )
  for name in ("flax_lm", "optax_muon"):
    logging.getLogger(name).setLevel(logging.INFO)
  logging.getLogger("absl").setLevel(logging.ERROR)
  overrides = list(args.overrides)
  if args.data:
    overrides.append(f"train.data={args.data}")
  try:
    cfg = config_lib.run_config(overrides)
    distributed.start_processes(
      args.num_processes, args.process_id, args.coordinator
    )
    mesh = distributed.parse_mesh(args.mesh) if args.mesh else None
    final = train(cfg, resume=args.resume, mesh=mesh)
  except (ValueError, TypeError, OSError) as error:
    # a bad setting, path or checkpoint: one line, not a traceback
    parser.exit(2, f"{parser.prog}: error: {error}\n")
  if jax.process_index() == 0:
    print(
      f"{cfg.name}: final val loss {final['final_val_loss']:.4f} "
      f"after {final['steps']} steps ({cfg.out_dir})"
    )
  return final


if __name__ == "__main__":
  main()
