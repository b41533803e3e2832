"""Train the example GPT on byte-level text with Muon or AdamW.

    python -m examples.flax_lm.train optim.optimizer=muon train.steps=300
    python -m examples.flax_lm.train preset=small optim.optimizer=adam
    python -m examples.flax_lm.train ... --resume     # continue exactly

Everything a run writes goes under ``train.out_dir`` (``runs/<name>``):
``checkpoints/``, ``metrics.jsonl`` and ``final.json``.
"""

import argparse
import contextlib
import functools
import json
import logging
import math
import os
import pathlib
import platform
import re
import sys
import time
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import optax_muon as om
from examples.flax_lm import checkpoint as checkpoint_lib
from examples.flax_lm import config as config_lib
from examples.flax_lm import progress
from examples.flax_lm.data import ByteCorpus
from examples.flax_lm.model import GPT


def learning_rate_schedule(cfg: config_lib.RunConfig):
  return optax.warmup_cosine_decay_schedule(
    0.0,
    cfg.optim.lr,
    cfg.train.warmup_steps,
    max(cfg.train.steps, 1),
    end_value=0.1 * cfg.optim.lr,
  )


def split_qkv_of(cfg: config_lib.RunConfig):
  model = cfg.model
  if not model.fused_qkv or model.attention == "mla":
    return None
  return om.SplitQKV(model.n_head, model.kv_heads, model.head_dim)


def matrix_group(path) -> str:
  """``['blocks'][3]['attn']['qkv']['kernel'].value`` → ``attn/qkv``."""
  names = re.findall(r"'([^']+)'", jax.tree_util.keystr(path))
  return "/".join(n for n in names if n not in ("blocks", "kernel"))


def named_leaves(tree) -> dict:
  return {
    jax.tree_util.keystr(path): (path, leaf)
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


def update_rms_by_group(updates, groups: dict) -> dict:
  """``{"update_rms/<group>": mean update RMS}`` over the leaves of each
  group; ``groups`` maps ``named_leaves`` keys to group names."""
  rms = named_leaves(om.update_rms(updates))
  members = {}
  for key, group in groups.items():
    members.setdefault(group, []).append(jnp.mean(rms[key][1]))
  return {
    f"update_rms/{group}": jnp.mean(jnp.stack(values))
    for group, values in members.items()
  }


def newton_schulz_flops(params, labels, steps: int) -> float:
  """``T·(4m²n + 2m³)`` summed over every Muon matrix (m ≤ n)."""
  total = 0.0
  for leaf, label in zip(jax.tree.leaves(params), jax.tree.leaves(labels)):
    if label == "muon":
      *batch, a, b = leaf.shape
      m, n = min(a, b), max(a, b)
      total += math.prod(batch) * steps * (4 * m * m * n + 2 * m**3)
  return total


def parse_mesh(text: str) -> jax.sharding.Mesh:
  """``"data=2,model=4"`` as a mesh of Auto axes over the local devices."""
  try:
    sizes = {
      k.strip(): int(v) for k, v in (p.split("=") for p in text.split(","))
    }
  except ValueError:
    raise ValueError(f"--mesh {text!r}: expected e.g. data=2,model=4") from None
  if set(sizes) - {"data", "model"} or not sizes:
    raise ValueError(f"--mesh {text!r}: accepted axes are data and model")
  needed = math.prod(sizes.values())
  if needed > jax.device_count():
    raise ValueError(
      f"--mesh {text!r} needs {needed} devices and {jax.device_count()} are "
      "present; on a CPU set XLA_FLAGS=--xla_force_host_platform_device_count"
      f"={needed} before starting Python"
    )
  return jax.make_mesh(
    tuple(sizes.values()),
    tuple(sizes),
    axis_types=(jax.sharding.AxisType.Auto,) * len(sizes),
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


def layout_of(cfg: config_lib.RunConfig, model: GPT) -> om.Layout:
  """Which leaves are matrices, and how, read from the model's own forward
  pass on a batch of the run's shape (traced, nothing computed)."""
  return om.infer_layout(
    model, jax.ShapeDtypeStruct((1, cfg.model.block_size), jnp.int32)
  )


class Built(NamedTuple):
  """What ``build`` makes for a run: ``labels`` is the routing of either Muon
  implementation, ``layout`` what ``om.infer_layout`` read from the model."""

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
  layout = layout_of(cfg, model)
  graphdef, params = nnx.split(model)
  specs = nnx.get_partition_spec(params) if mesh is not None else None
  if cfg.train.muon_impl == "optax.contrib":
    tx, labels = optax_contrib_muon(cfg, params)
  else:
    tx = cfg.optim.build(
      learning_rate_schedule(cfg),
      params=params,
      split_qkv=split_qkv_of(cfg),
      mesh=mesh,
      specs=specs,
      attention=attention_of(cfg),
      layout=layout,
    )
    labels = layout.labels
  muon_groups = {
    key: matrix_group(path)
    for key, (path, label) in named_leaves(labels).items()
    if label == "muon" and cfg.optim.optimizer in config_lib.MUON_OPTIMIZERS
  }

  def loss_fn(params, inputs, targets):
    logits, max_logits = nnx.merge(graphdef, params).forward(inputs)
    loss = optax.softmax_cross_entropy_with_integer_labels(
      logits, targets
    ).mean()
    return loss, max_logits

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(params, opt_state, inputs, targets):
    (loss, max_logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      params, inputs, targets
    )
    extra = (
      {"max_logits": max_logits_by_layer(cfg, max_logits)}
      if cfg.optim.qk_clip
      else {}
    )
    updates, opt_state = tx.update(grads, opt_state, params, **extra)
    params = optax.apply_updates(params, updates)
    metrics = {"train_loss": loss, "grad_norm": optax.tree.norm(grads)}
    metrics.update(update_rms_by_group(updates, muon_groups))
    # the largest attention logit of each layer this step (before the clip)
    metrics.update(
      {f"max_logit/layer{i}": m for i, m in enumerate(max_logits.max(axis=-1))}
    )
    return params, opt_state, metrics

  eval_loss = jax.jit(lambda *args: loss_fn(*args)[0])
  return Built(
    graphdef, params, tx, tx.init(params), train_step, eval_loss, labels, layout
  )


def evaluate(eval_loss, params, corpus, cfg) -> float:
  losses = [
    eval_loss(
      params,
      *corpus.batch("val", i, cfg.train.batch_size, cfg.model.block_size),
    )
    for i in range(cfg.train.eval_batches)
  ]
  return float(np.mean([float(l) for l in losses]))


def read_metrics(path: pathlib.Path, upto: int) -> list[str]:
  if not path.exists():
    return []
  return [
    line
    for line in path.read_text().splitlines()
    if line.strip() and json.loads(line)["step"] <= upto
  ]


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
  params, opt_state, labels = built.params, built.opt_state, built.labels
  train_step, eval_loss = built.train_step, built.eval_loss
  if (
    cfg.optim.optimizer in config_lib.MUON_OPTIMIZERS
    and cfg.train.muon_impl == "optax_muon"
    and jax.process_index() == 0
  ):
    split = split_qkv_of(cfg) if cfg.optim.muon_split_qkv else None
    gate_up = om.SplitGateUp() if cfg.optim.muon_split_gate_up else None
    logging.getLogger("flax_lm").info(
      "which matrices Muon sees:\n%s",
      om.describe(
        params,
        split_qkv=split,
        split_gate_up=gate_up,
        layout=built.layout,
        moment2_method=cfg.optim.adaptive_muon_moment2_method
        if cfg.optim.optimizer == "adaptive_muon"
        else None,
      ),
    )
  if mesh is not None:  # batches split over the data axis
    data_sharding = jax.sharding.NamedSharding(
      mesh,
      jax.sharding.PartitionSpec("data" if "data" in mesh.axis_names else None),
    )
    # every process reads the same global batch and puts only its own rows
    put = lambda batch: tuple(
      checkpoint_lib.place(x, data_sharding) for x in batch
    )
  elif jax.process_count() > 1:
    raise ValueError(
      f"a run over {jax.process_count()} processes needs "
      "--mesh spanning their devices, e.g. --mesh data=2,model=4"
    )
  else:
    put = lambda batch: batch
  writer = jax.process_index() == 0  # the others compute, they do not write
  checkpoints = checkpoint_lib.Checkpointer(
    out / "checkpoints", cfg.train.keep_checkpoints
  )
  start = 0
  metrics_path = out / "metrics.jsonl"
  if resume:
    restored = checkpoints.restore_latest((params, opt_state))
    if restored is not None:
      (params, opt_state), meta = restored
      start = meta["step"]
  # a resumed run drops what was logged after its checkpoint
  if writer:
    metrics_path.write_text(
      "".join(line + "\n" for line in read_metrics(metrics_path, start))
      if start
      else ""
    )
  schedule = learning_rate_schedule(cfg)
  tokens_per_step = cfg.train.batch_size * cfg.model.block_size
  ns_steps = (
    5 if cfg.train.muon_impl == "optax.contrib" else cfg.optim.muon_num_ns_steps
  )
  ns_flops = (
    newton_schulz_flops(params, labels, ns_steps)
    if cfg.optim.optimizer in config_lib.MUON_OPTIMIZERS
    else 0.0
  )
  model_flops = (
    6 * sum(x.size for x in jax.tree.leaves(params)) * tokens_per_step
  )
  if writer:
    (out / "run.json").write_text(
      json.dumps(
        {
          "name": cfg.name,
          "preset": cfg.preset,
          "optimizer": cfg.optim.optimizer,
          "processes": jax.process_count(),
          "model_flops_per_step": model_flops,
          "ns_flops_per_step": ns_flops,
          "params": int(sum(x.size for x in jax.tree.leaves(params))),
          "python": platform.python_version(),
          "corpus": corpus.describe(),
        },
        indent=1,
      )
    )
  val_loss = None
  bar = progress.step_bar(
    range(start, cfg.train.steps),
    nested=nested_progress,
    initial=start,
    total=cfg.train.steps,
    disable=not (cfg.train.progress and writer),
    desc=cfg.name,
    file=sys.stdout,
    mininterval=2.0,
  )
  wall = 0.0
  with metrics_path.open("a") if writer else contextlib.nullcontext() as log:
    for step in bar:
      inputs, targets = put(
        corpus.batch(
          "train",
          step,
          cfg.train.batch_size,
          cfg.model.block_size,
          cfg.train.seed,
        )
      )
      begin = time.perf_counter()
      params, opt_state, metrics = train_step(
        params, opt_state, inputs, targets
      )
      metrics = {k: float(v) for k, v in metrics.items()}  # waits for the step
      seconds = time.perf_counter() - begin
      wall += seconds if step > start else 0.0  # the first step compiles
      done = step + 1
      record = None
      if done % cfg.train.log_every == 0 or done == cfg.train.steps:
        record = {
          "step": done,
          **metrics,
          "lr": float(schedule(step)),
          "step_time": seconds,
          "wall_time": wall,
          "tokens_per_s": tokens_per_step / seconds,
        }
      if done % cfg.train.eval_every == 0 or done == cfg.train.steps:
        val_loss = evaluate(eval_loss, params, corpus, cfg)
        record = (record or {"step": done, **metrics}) | {"val_loss": val_loss}
      if record and writer:
        log.write(json.dumps(record) + "\n")
        log.flush()
      bar.set_postfix(
        loss=f"{metrics['train_loss']:.3f}",
        tok_s=f"{tokens_per_step / seconds:,.0f}",
      )
      if (
        cfg.train.checkpoint_every and done % cfg.train.checkpoint_every == 0
      ) or done == cfg.train.steps:
        checkpoints.save(
          done,
          (params, opt_state),
          {"data_position": done, "seed": cfg.train.seed},
        )
  if val_loss is None:
    val_loss = evaluate(eval_loss, params, corpus, cfg)
  final = {
    "optimizer": cfg.optim.optimizer,
    "steps": cfg.train.steps,
    "final_val_loss": val_loss,
    "params_sha256": checkpoint_lib.tree_sha256(params),
  }
  if writer:
    (out / "final.json").write_text(json.dumps(final, indent=1))
  return final


# set by cluster schedulers that start one process per host (SLURM, Open MPI,
# MPICH/PMI) or by whoever sets JAX's own variable
CLUSTER_VARIABLES = (
  "SLURM_NTASKS",
  "OMPI_COMM_WORLD_SIZE",
  "PMI_SIZE",
  "JAX_COORDINATOR_ADDRESS",
)


def start_processes(
  num_processes, process_id, coordinator, environ=os.environ
) -> bool:
  """Joins this process to a multi-process run; whether it did.

  With the three flags, ``jax.distributed.initialize`` gets them (CPU devices
  talk through gloo). Without them, it is called with no arguments, so that
  JAX reads the cluster's settings, only where a scheduler says there is more
  than one process; elsewhere the run is one process.
  """
  given = [num_processes, process_id, coordinator]
  if any(v is not None for v in given):
    if any(v is None for v in given):
      raise ValueError(
        "--num-processes, --process-id and --coordinator go "
        "together (or none of them: a cluster's own settings)"
      )
    if not 0 <= process_id < num_processes:
      raise ValueError(
        f"--process-id={process_id} must be in "
        f"[0, --num-processes={num_processes})"
      )
  elif all(environ.get(name, "1") in ("", "1") for name in CLUSTER_VARIABLES):
    return False
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # None arguments: JAX reads the cluster's settings
  jax.distributed.initialize(coordinator, num_processes, process_id)
  return True


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
    start_processes(args.num_processes, args.process_id, args.coordinator)
    mesh = parse_mesh(args.mesh) if args.mesh else None
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
