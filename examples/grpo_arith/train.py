"""GRPO fine-tuning of the example GPT on arithmetic word problems.

    python -m examples.grpo_arith.train preset=tiny optim.optimizer=muon
    python -m examples.grpo_arith.train optim.optimizer=adam optim.lr=1e-3
    python -m examples.grpo_arith.train ... --resume     # continue exactly

A run first makes (or loads) the SFT policy (``sft.py``), then for
``train.steps`` steps samples ``train.group_size`` completions of
``train.prompts_per_step`` train problems at ``train.temperature``, rewards
them, and takes one GRPO step (``grpo.py``) with the ``optim`` optimizer under
``lr · min(step / warmup, 1) / (1 + k · step)``. Every ``train.eval_every``
steps it answers the test problems greedily (and at the train temperature, to
show the difference), checkpoints, and after ``train.rollback_patience``
drops in a row of greedy accuracy goes back to the best checkpoint at half
the lr.

Everything goes under ``train.out_dir``: ``sft/``, ``checkpoints/`` (the latest
and the best by greedy accuracy), ``metrics.jsonl``, ``metrics.png`` and
``final.json``.
"""

import argparse
import collections
import functools
import json
import logging
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from examples.flax_lm import checkpoint as checkpoint_lib
from examples.flax_lm import metrics as metrics_lib
from examples.flax_lm import optimizer as optimizer_lib
from examples.flax_lm import progress
from examples.flax_lm.model import GPT
from examples.grpo_arith import config as config_lib
from examples.grpo_arith import grpo
from examples.grpo_arith import plots
from examples.grpo_arith import policy
from examples.grpo_arith import sft
from examples.grpo_arith import task

_logger = logging.getLogger("grpo_arith")


def optimizer(cfg: config_lib.RunConfig, params, layout):
  """``cfg.optim`` under the warm-up/decay schedule, its peak lr an
  ``inject_hyperparams`` hyperparameter (``learning_rate``) that a rollback
  halves; ``layout`` from ``optimizer_lib.layout_of``."""

  def make(learning_rate):
    schedule = grpo.warmup_decay(
      learning_rate, cfg.train.warmup_steps, cfg.train.lr_decay
    )
    return cfg.optim.build(
      schedule,
      params=params,
      layout=layout,
      split_qkv=optimizer_lib.split_qkv_of(cfg),
      attention=optimizer_lib.attention_of(cfg),
    )

  return optax.inject_hyperparams(make)(learning_rate=cfg.optim.lr)


def parameter_group(path) -> str:
  """``attn/qkv``, ``mlp/fc``, ``wte``, ...: a leaf's layer-free name."""
  return metrics_lib.matrix_group(path).replace("/embedding", "")


class Policy:
  """The model's jitted functions: a GRPO step, log-probs, sampling."""

  def __init__(self, cfg: config_lib.RunConfig):
    self.cfg = cfg
    model = GPT(cfg.model, nnx.Rngs(cfg.train.seed))
    self.layout = optimizer_lib.layout_of(cfg, model)
    self.graphdef, self.initial_params = nnx.split(model)
    self.tx = optimizer(cfg, self.initial_params, self.layout)
    graphdef, tx, run = self.graphdef, self.tx, cfg.train
    matrices = {
      key: parameter_group(path)
      for key, (path, leaf) in metrics_lib.named_leaves(
        self.initial_params
      ).items()
      if leaf.ndim >= 2
    }

    def loss_fn(params, prompts, completions, reference, advantages):
      logprobs, max_logits = policy.token_logprobs(
        nnx.merge(graphdef, params), prompts, completions, run.temperature
      )
      # one update per batch: the sampling policy is this one, ratio 1;
      # log-probs at the sampling temperature, as verl computes them
      loss, metrics = grpo.grpo_loss(
        logprobs,
        jax.lax.stop_gradient(logprobs),
        reference,
        advantages,
        policy.completion_mask(completions),
        clip_ratio=run.clip_ratio,
        kl_coef=run.kl_coef,
      )
      return loss, (metrics, max_logits)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, prompts, completions, reference, advantages):
      (loss, (metrics, max_logits)), grads = jax.value_and_grad(
        loss_fn, has_aux=True
      )(params, prompts, completions, reference, advantages)
      extra = (
        {"max_logits": optimizer_lib.max_logits_by_layer(cfg, max_logits)}
        if cfg.optim.qk_clip
        else {}
      )
      updates, opt_state = tx.update(grads, opt_state, params, **extra)
      params = optax.apply_updates(params, updates)
      metrics |= {
        "loss": loss,
        "grad_norm": optax.tree.norm(grads),
        "max_logit": max_logits.max(),
      }
      metrics |= metrics_lib.update_rms_by_group(updates, matrices)
      return params, opt_state, metrics

    self.step = step
    self.logprobs = jax.jit(
      lambda params, prompts, completions: policy.token_logprobs(
        nnx.merge(graphdef, params), prompts, completions, run.temperature
      )[0]
    )

  def sample(self, params, prompts, temperature: float, key):
    return policy.sample(
      self.graphdef,
      params,
      prompts,
      self.cfg.train.completion_len,
      temperature,
      key,
    )


def score(texts, problems, shaped: bool) -> dict:
  """Rewards, format and correctness of ``texts`` answering ``problems``."""
  return {
    "reward": np.array(
      [
        task.reward(t, p.answer, shaped=shaped) for t, p in zip(texts, problems)
      ],
      np.float32,
    ),
    "format": np.array([task.format_ok(t) for t in texts], np.float32),
    "correct": np.array(
      [task.extract_answer(t) == p.answer for t, p in zip(texts, problems)],
      np.float32,
    ),
  }


def evaluate(
  model: Policy, params, prompts, problems, temperature: float, key
) -> dict:
  """Accuracy (boxed answer correct and well formed) and format rate."""
  texts = policy.decode_completions(
    model.sample(params, prompts, temperature, key)
  )
  scores = score(texts, problems, shaped=False)
  return {
    "accuracy": float(scores["reward"].mean()),
    "format_rate": float(scores["format"].mean()),
  }


def set_learning_rate(opt_state, lr: float):
  opt_state.hyperparams["learning_rate"] = jnp.asarray(
    lr, opt_state.hyperparams["learning_rate"].dtype
  )
  return opt_state


def train(
  cfg: config_lib.RunConfig,
  *,
  resume: bool = False,
  nested_progress: bool = False,
) -> dict:
  """Runs (or resumes) SFT and GRPO; returns the contents of ``final.json``.
  ``nested_progress``: the step bar sits beneath a comparison's ``RunsBar``."""
  begin = time.perf_counter()
  run = cfg.train
  out = pathlib.Path(cfg.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  model = Policy(cfg)
  reference, sft_info = sft.load_or_train(
    cfg, model.graphdef, model.initial_params, optimizer_lib.split_qkv_of(cfg)
  )
  # the step donates the params it is given; the reference stays
  params = jax.tree.map(jnp.copy, reference)
  opt_state = model.tx.init(params)
  train_problems = sft.train_problems(cfg)
  test_problems = task.problems(
    "test", run.test_problems, seed=run.seed, levels=run.levels
  )
  test_prompts = policy.encode_prompts(
    [p.question for p in test_problems], run.prompt_width
  )
  eval_key = jax.random.key(run.seed + 1)
  checkpoints = checkpoint_lib.Checkpointer(
    out / "checkpoints", keep=1, best_metric="accuracy"
  )
  rollback = grpo.Rollback(run.rollback_patience)
  window = collections.deque(maxlen=run.reward_window)
  state = {
    "step": 0,
    "lr": cfg.optim.lr,
    "rollbacks": 0,
    "accuracies": {},
    "sft_accuracy": None,
    "test": None,
  }
  restored = checkpoints.restore_latest((params, opt_state)) if resume else None
  if restored is not None:
    (params, opt_state), meta = restored
    state = meta["state"]
    rollback.load(meta["rollback"])
    window.extend(meta["window"])
  else:  # the SFT policy is step 0: the first best, a rollback target
    accuracy = evaluate(
      model, reference, test_prompts, test_problems, 0.0, eval_key
    )["accuracy"]
    state["sft_accuracy"] = state["accuracies"]["0"] = accuracy
    rollback.update(accuracy)
    checkpoints.save(
      0,
      (params, opt_state),
      {"state": state, "rollback": rollback.state(), "window": []},
      metrics={"accuracy": accuracy},
    )
  start = state["step"]
  metrics_path = out / "metrics.jsonl"
  log = metrics_lib.MetricsLog(metrics_path, start)
  if start == 0:
    with log:
      log.write(
        {"step": 0, "test_accuracy": state["sft_accuracy"], "lr": state["lr"]}
      )
  shaped = run.reward == "shaped"
  bar = progress.step_bar(
    range(start, run.steps),
    nested=nested_progress,
    initial=start,
    total=run.steps,
    desc=cfg.name,
    file=sys.stdout,
    disable=not run.progress,
    mininterval=2.0,
  )
  with log:
    for step in bar:
      tick = time.perf_counter()
      rng = np.random.default_rng([run.seed, step, 1])
      chosen = [
        train_problems[i]
        for i in rng.integers(0, len(train_problems), run.prompts_per_step)
      ]
      group = [p for p in chosen for _ in range(run.group_size)]
      prompts = policy.encode_prompts(
        [p.question for p in group], run.prompt_width
      )
      key = jax.random.fold_in(jax.random.key(run.seed), step)
      completions = model.sample(params, prompts, run.temperature, key)
      scores = score(policy.decode_completions(completions), group, shaped)
      advantages = grpo.group_advantages(
        scores["reward"].reshape(run.prompts_per_step, run.group_size)
      )
      params, opt_state, metrics = model.step(
        params,
        opt_state,
        prompts,
        completions,
        model.logprobs(reference, prompts, completions),
        advantages.reshape(-1),
      )
      window.append(float(scores["reward"].mean()))
      done = step + 1
      record = {
        "step": done,
        **{k: float(v) for k, v in metrics.items()},
        "reward": window[-1],
        "reward_avg": float(np.mean(window)),
        "format_rate": float(scores["format"].mean()),
        # groups whose rewards differ: the only ones that teach
        "signal_groups": float(np.mean(np.any(advantages != 0, axis=-1))),
        "correct_rate": float(scores["correct"].mean()),
        "lr": float(opt_state.hyperparams["learning_rate"]),
        "step_time": time.perf_counter() - tick,
      }
      if done % run.eval_every == 0 or done == run.steps:
        greedy = evaluate(
          model, params, test_prompts, test_problems, 0.0, eval_key
        )
        sampled = evaluate(
          model, params, test_prompts, test_problems, run.temperature, eval_key
        )
        accuracy = greedy["accuracy"]
        record |= {
          "test_accuracy": accuracy,
          "test_format_rate": greedy["format_rate"],
          "test_accuracy_sampled": sampled["accuracy"],
        }
        state["test"] = greedy
        best_step = checkpoints.best_step()
        best = state["accuracies"][str(best_step)]
        if rollback.update(accuracy, best):
          (params, opt_state), _ = checkpoints.restore(
            best_step, (params, opt_state)
          )
          state["lr"] /= 2
          state["rollbacks"] += 1
          opt_state = set_learning_rate(opt_state, state["lr"])
          accuracy, state["test"] = best, None
          record |= {"rollback_to": best_step, "lr": state["lr"]}
          _logger.info(
            "step %d: greedy accuracy fell %d times in a row; back "
            "to step %d (accuracy %.3f), lr halved to %.3g",
            done,
            run.rollback_patience,
            best_step,
            best,
            state["lr"],
          )
        state["step"] = done
        state["accuracies"][str(done)] = accuracy
        record["params_sha256"] = checkpoint_lib.tree_sha256(params)
        checkpoints.save(
          done,
          (params, opt_state),
          {
            "state": state,
            "rollback": rollback.state(),
            "window": list(window),
          },
          metrics={"accuracy": accuracy},
        )
      bar.set_postfix(
        reward=f"{record['reward_avg']:.2f}",
        acc=f"{state['accuracies'][str(state['step'])]:.3f}",
        refresh=False,
      )
      log.write(record)
  if state["test"] is None:  # the run ended on a rollback
    state["test"] = evaluate(
      model, params, test_prompts, test_problems, 0.0, eval_key
    )
  plots.plot_run(metrics_path, out / "metrics.png", cfg.name)
  final = {
    "optimizer": cfg.optim.optimizer,
    "reward": run.reward,
    "lr": cfg.optim.lr,
    "final_lr": state["lr"],
    "sft_accuracy": state["sft_accuracy"],
    "final_accuracy": state["test"]["accuracy"],
    "best_accuracy": max(state["accuracies"].values()),
    "format_rate": state["test"]["format_rate"],
    "rollbacks": state["rollbacks"],
    "steps": run.steps,
    "seed": run.seed,
    "sft_seconds": sft_info["seconds"],
    "params_sha256": checkpoint_lib.tree_sha256(params),
    "seconds": time.perf_counter() - begin,
  }
  (out / "final.json").write_text(json.dumps(final, indent=1))
  return final


def main(argv=None):
  parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    epilog="overrides: preset=tiny|small, model.<field>=..., sft.<field>=..., "
    "train.<field>=..., optim.<MuonConfig field>=... (or a verl path, "
    "actor_rollout_ref.actor.optim.lr=...)",
  )
  parser.add_argument("overrides", nargs="*")
  parser.add_argument(
    "--resume",
    action="store_true",
    help="continue from the newest good checkpoint",
  )
  args = parser.parse_intermixed_args(argv)
  logging.basicConfig(
    stream=sys.stdout, level=logging.WARNING, format="%(message)s", force=True
  )
  for name in ("grpo_arith", "optax_muon"):
    logging.getLogger(name).setLevel(logging.INFO)
  logging.getLogger("absl").setLevel(logging.ERROR)
  try:
    cfg = config_lib.run_config(args.overrides)
    final = train(cfg, resume=args.resume)
  except (ValueError, TypeError, OSError) as error:
    parser.exit(2, f"{parser.prog}: error: {error}\n")
  print(
    f"{cfg.name}: greedy test accuracy {final['sft_accuracy']:.3f} after "
    f"SFT, {final['final_accuracy']:.3f} after {final['steps']} GRPO steps "
    f"(best {final['best_accuracy']:.3f}, format {final['format_rate']:.2f}, "
    f"{final['rollbacks']} rollbacks, {final['seconds']:.0f} s; "
    f"{cfg.out_dir})"
  )
  return final


if __name__ == "__main__":
  main()
