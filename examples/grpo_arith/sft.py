"""The supervised warm start: the GPT learns the worked solutions' format.

GRPO needs a policy whose samples are sometimes right: from a random model
every reward is 0 and every group's advantage too. A short supervised run on
generated worked solutions (cross-entropy on the completion's bytes only)
gives one. It is saved with orbax under ``train.sft_dir`` together with the
settings it was made with; a later run with the same settings loads it, so
that GRPO runs of a seed (Muon or AdamW, either reward) start from the same
policy.
"""

import dataclasses
import functools
import json
import logging
import pathlib
import shutil
import sys
import time

import jax
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

import optax_muon as om
from examples.flax_lm import checkpoint as checkpoint_lib
from examples.flax_lm import optimizer as optimizer_lib
from examples.grpo_arith import config as config_lib
from examples.grpo_arith import policy
from examples.grpo_arith import task

_logger = logging.getLogger("grpo_arith")
TRAIN_PROBLEMS = 20_000


def train_problems(cfg: config_lib.RunConfig) -> list[task.Problem]:
  return task.problems(
    "train", TRAIN_PROBLEMS, seed=cfg.train.seed, levels=cfg.train.levels
  )


def settings(cfg: config_lib.RunConfig) -> dict:
  """What the SFT policy depends on; a saved one is reused only if equal."""
  run = cfg.train
  return json.loads(
    json.dumps(
      {
        "model": dataclasses.asdict(cfg.model),
        "sft": dataclasses.asdict(cfg.sft),
        "seed": run.seed,
        "levels": run.levels,
        "prompt_width": run.prompt_width,
        "completion_len": run.completion_len,
      }
    )
  )


def batch(problems, step: int, cfg: config_lib.RunConfig):
  """``(prompts, completions)`` of worked solutions, a function of the step."""
  rng = np.random.default_rng([cfg.train.seed, step, 0])
  chosen = [
    problems[i] for i in rng.integers(0, len(problems), cfg.sft.batch_size)
  ]
  return (
    policy.encode_prompts([p.question for p in chosen], cfg.train.prompt_width),
    policy.encode_completions(
      [p.solution for p in chosen], cfg.train.completion_len
    ),
  )


def optimizer(cfg: config_lib.RunConfig, params, split_qkv, layout):
  fields = dict(
    optimizer=cfg.sft.optimizer, lr=cfg.sft.lr, weight_decay=0.0, clip_grad=1.0
  )
  if cfg.sft.optimizer == "muon":
    fields.update(config_lib.EXAMPLE_MUON)
  schedule = optax.warmup_cosine_decay_schedule(
    0.0,
    cfg.sft.lr,
    cfg.sft.warmup_steps,
    max(cfg.sft.steps, cfg.sft.warmup_steps + 1),
    end_value=0.1 * cfg.sft.lr,
  )
  return om.MuonConfig(**fields).build(
    schedule, params=params, split_qkv=split_qkv, layout=layout
  )


def train(cfg: config_lib.RunConfig, graphdef, params, split_qkv):
  """``cfg.sft.steps`` steps of completion-only cross-entropy; the params."""
  layout = optimizer_lib.layout_of(cfg, nnx.merge(graphdef, params))
  tx = optimizer(cfg, params, split_qkv, layout)
  opt_state = tx.init(params)

  def loss_fn(params, prompts, completions):
    logprobs, _ = policy.token_logprobs(
      nnx.merge(graphdef, params), prompts, completions
    )
    mask = policy.completion_mask(completions)
    return -(logprobs * mask).sum() / mask.sum()

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, prompts, completions):
    loss, grads = jax.value_and_grad(loss_fn)(params, prompts, completions)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  problems = train_problems(cfg)
  bar = tqdm(
    range(cfg.sft.steps),
    desc="sft",
    file=sys.stdout,
    disable=not cfg.train.progress,
    mininterval=2.0,
  )
  loss = None
  for i in bar:
    params, opt_state, loss = step(params, opt_state, *batch(problems, i, cfg))
    if i % 20 == 0:
      bar.set_postfix(loss=f"{float(loss):.3f}")
  return params, float(loss)


def load_or_train(cfg: config_lib.RunConfig, graphdef, params, split_qkv):
  """``(params, info)``: the SFT policy of ``cfg.sft_dir`` if it was made
  with these settings, else a new one, saved there."""
  directory = pathlib.Path(cfg.sft_dir)
  record = directory / "sft.json"
  wanted = settings(cfg)
  if record.exists():
    info = json.loads(record.read_text())
    if info["settings"] == wanted:
      restored = checkpoint_lib.Checkpointer(
        directory / "checkpoint", keep=1
      ).restore_latest(params)
      if restored is not None:
        _logger.info("loaded the SFT policy of %s", directory)
        return restored[0], info
    _logger.info(
      "the SFT policy in %s was made with other settings; training a new one",
      directory,
    )
  begin = time.perf_counter()
  params, loss = train(cfg, graphdef, params, split_qkv)
  info = {
    "settings": wanted,
    "final_loss": loss,
    "seconds": time.perf_counter() - begin,
  }
  if jax.process_index() == 0:
    directory.mkdir(parents=True, exist_ok=True)
    record.unlink(missing_ok=True)  # a stale record must not match the new one
    shutil.rmtree(directory / "checkpoint", ignore_errors=True)
    checkpoint_lib.Checkpointer(directory / "checkpoint", keep=1).save(
      cfg.sft.steps, params, {}
    )
    record.write_text(json.dumps(info, indent=1))
  return params, info
