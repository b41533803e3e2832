"""GRPO with Muon in Tunix's own learner, on grpo_arith's arithmetic task.

    python -m examples.tunix_grpo.train                 # the recorded run
    python -m examples.tunix_grpo.train grpo_steps=20 sft_steps=100
    python -m examples.tunix_grpo.train optimizer=adamw    # the same, AdamW

A small Llama from Tunix's model code (``policy.py``), randomly initialized,
first learns the answer format from worked solutions (Adam); then Tunix's
``GRPOLearner`` (its ``RLCluster``, vanilla rollout, KL to the warm start)
trains it on the task's reward with ``om.muon`` as the actor's optimizer:
the layout read from the model by ``om.infer_layout``, update RMS matched to
AdamW's, clipped at global norm 1, under grpo_arith's warm-up and decay,
inside ``optax.inject_hyperparams`` so that Tunix logs the learning rate.
grpo_arith's monitoring and recovery run as a hook of Tunix's trainer
(``recovery.py``): greedy accuracy on validation problems every
``eval_every`` steps, a rollback to the best at half the lr after
``rollback_patience`` drops in a row, the best restored at the end. Greedy
accuracy on held-out test problems is measured before and after with
Tunix's sampler. Writes ``<out_dir>/final.json``.

Needs Tunix (``pip install google-tunix``; Python >= 3.11).
"""

import dataclasses
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from grain import python as grain
from tunix.rl import rl_cluster
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout

import optax_muon as om
from examples.grpo_arith import task
from examples.tunix_grpo import policy
from examples.tunix_grpo import recovery

OPTIMIZERS = ("muon", "adamw")
# "shaped": grpo_arith's reward; "shorter": 1 − length / completion_len, a
# reward the policy can surely reach (a check of the learner, not the task)
REWARDS = ("shaped", "shorter")
TRAIN_PROBLEMS = 4000


@dataclasses.dataclass(frozen=True)
class Config:
  seed: int = 0
  levels: tuple[int, ...] = (1,)
  layers: int = 2
  width: int = 128
  sft_steps: int = 1500
  sft_lr: float = 3e-3
  # the actor's optimizer: "muon", or "adamw" to compare in the same learner
  optimizer: str = "muon"
  reward: str = "shaped"
  # GRPO: grpo_arith's recipe (warm-up, decay, clip, KL, temperature);
  # 16 prompts a step over the 4000 training problems once, at 3e-4 (8
  # prompts a step at 1e-4 to 1e-3 ended at or below the start: the
  # group-relative signal of 8 prompts is too noisy at these sizes)
  grpo_steps: int = 250
  prompts_per_step: int = 16
  group_size: int = 16
  lr: float = 3e-4
  warmup_steps: int = 10
  lr_decay: float = 0.01
  kl_coef: float = 0.04
  temperature: float = 0.7
  completion_len: int = 40
  # the prompts' padded length (Tunix's sampler pads to a power of two)
  prompt_len: int = 128
  # grpo_arith's monitoring and recovery (recovery.py), on validation
  # problems held out from the training and the test problems
  eval_every: int = 10
  validation_problems: int = 128
  rollback_patience: int = 3
  test_problems: int = 372  # with the validation ones, all 500 held out
  out_dir: str = "runs/tunix_grpo"

  def __post_init__(self):
    if self.optimizer not in OPTIMIZERS:
      raise ValueError(
        f"optimizer={self.optimizer!r} is not accepted; accepted values: "
        f"{list(OPTIMIZERS)}"
      )
    if self.reward not in REWARDS:
      raise ValueError(
        f"reward={self.reward!r} is not accepted; accepted values: "
        f"{list(REWARDS)}"
      )
    if self.grpo_steps * self.prompts_per_step > TRAIN_PROBLEMS:
      raise ValueError(
        f"grpo_steps * prompts_per_step must be at most {TRAIN_PROBLEMS} "
        "(the training problems, each prompted once); got "
        f"{self.grpo_steps} * {self.prompts_per_step}"
      )
    if self.test_problems + self.validation_problems > 500:
      raise ValueError(
        "test_problems + validation_problems must be at most 500 (the test "
        f"questions the train set leaves out); got {self.test_problems} + "
        f"{self.validation_problems}"
      )


def parse(argv) -> Config:
  """``key=value`` overrides of ``Config`` (the library's one parser)."""
  return Config(**om.parse_fields(Config, om.split_overrides(argv)))


def schedule(cfg: Config):
  """``lr · min(step / warmup, 1) / (1 + decay · step)``, steps from 1."""

  def learning_rate(count):
    step = jnp.asarray(count, jnp.float32) + 1.0
    warm = jnp.minimum(step / cfg.warmup_steps, 1.0)
    return cfg.lr * warm / (1.0 + cfg.lr_decay * step)

  return learning_rate


def muon(cfg: Config, model) -> optax.GradientTransformation:
  """The actor's optimizer: ``om.muon`` on the layout read from the model
  (``cfg.optimizer="adamw"``: ``optax.adamw``, to compare)."""
  layout = om.infer_layout(model, *policy.example_inputs(model))

  def make(learning_rate, lr_scale):
    lr = learning_rate * lr_scale
    step = (
      om.muon(lr, match_adamw_update_rms=True, layout=layout)
      if cfg.optimizer == "muon"
      else optax.adamw(lr, weight_decay=0.0)
    )
    return optax.chain(optax.clip_by_global_norm(1.0), step)

  # lr_scale: what a rollback halves (recovery.py)
  return optax.inject_hyperparams(make)(
    learning_rate=schedule(cfg), **{recovery.LR_SCALE: 1.0}
  )


class _Prompts(grain.RandomAccessDataSource):
  def __init__(self, problems):
    self._problems = problems

  def __getitem__(self, index):
    problem = self._problems[index]
    return {
      "prompts": policy.prompt(problem.question),
      "answer": str(problem.answer),
    }

  def __len__(self):
    return len(self._problems)


def reward(prompts, completions, answer, **kwargs):
  """grpo_arith's shaped reward: 0.3 for the format, 0.7 for the answer."""
  del prompts, kwargs
  return [task.reward(text, int(a)) for text, a in zip(completions, answer)]


def shorter(completion_len: int):
  """The ``"shorter"`` reward: ``1 − length / completion_len`` (Tunix logs
  a reward function under its name: ``reward``)."""

  def reward(prompts, completions, **kwargs):
    del prompts, kwargs
    return [
      1.0 - min(len(text), completion_len) / completion_len
      for text in completions
    ]

  return reward


def grpo(cfg: Config, model, problems, monitor: recovery.Recovery | None):
  """Tunix's GRPO learner on ``problems`` for ``cfg.grpo_steps`` steps,
  ``monitor`` hooked into its trainer; the trained actor and the learner."""
  reference = nnx.clone(model)
  mesh = jax.make_mesh(
    (1, 1),
    ("fsdp", "tp"),
    axis_types=(jax.sharding.AxisType.Auto,) * 2,
    devices=jax.devices()[:1],
  )
  cluster = rl_cluster.RLCluster(
    actor=model,
    reference=reference,
    tokenizer=policy.ByteTokenizer(),
    cluster_config=rl_cluster.ClusterConfig(
      role_to_mesh={role: mesh for role in rl_cluster.Role},
      rollout_engine="vanilla",
      offload_to_cpu=False,
      training_config=rl_cluster.RLTrainingConfig(
        actor_optimizer=muon(cfg, model),
        eval_every_n_steps=10**9,
        max_steps=cfg.grpo_steps,
      ),
      rollout_config=base_rollout.RolloutConfig(
        max_tokens_to_generate=cfg.completion_len,
        max_prompt_length=cfg.prompt_len,
        kv_cache_size=policy.cache_size(cfg.prompt_len, cfg.completion_len),
        temperature=cfg.temperature,
        eos_tokens=[policy.END],
      ),
    ),
  )
  learner = grpo_learner.GRPOLearner(
    rl_cluster=cluster,
    reward_fns=reward
    if cfg.reward == "shaped"
    else shorter(cfg.completion_len),
    algo_config=grpo_learner.GRPOConfig(
      num_generations=cfg.group_size, num_iterations=1, beta=cfg.kl_coef
    ),
  )
  if monitor is not None:
    cluster.actor_trainer.with_training_hooks(monitor)
  count = cfg.grpo_steps * cfg.prompts_per_step
  learner.train(
    grain.MapDataset.source(_Prompts(problems[:count])).batch(
      cfg.prompts_per_step
    )
  )
  return cluster.actor_trainer.model, learner


def run(cfg: Config) -> dict:
  start = time.perf_counter()
  train = task.problems(
    "train", TRAIN_PROBLEMS, seed=cfg.seed, levels=cfg.levels
  )
  # the train set leaves out the first 500 test questions: the test
  # problems and, after them, the validation ones
  held_out = task.problems("test", 500, seed=cfg.seed, levels=cfg.levels)
  test = held_out[: cfg.test_problems]
  validation = held_out[500 - cfg.validation_problems :]
  model = policy.make_model(cfg.layers, cfg.width, cfg.seed)
  sft_loss = policy.supervised_warm_start(
    model, train, cfg.sft_steps, cfg.sft_lr, cfg.seed
  )
  lengths = (cfg.prompt_len, cfg.completion_len)
  before = policy.greedy_accuracy(model, test, *lengths)
  monitor = recovery.Recovery(
    validation, lengths, cfg.eval_every, cfg.rollback_patience
  )
  trained, learner = grpo(cfg, model, train, monitor)
  actor_trainer = learner.rl_cluster.actor_trainer
  monitor.evaluate(actor_trainer, actor_trainer.train_steps)
  last = policy.greedy_accuracy(trained, test, *lengths)
  monitor.restore_best(actor_trainer)
  after = policy.greedy_accuracy(trained, test, *lengths)
  metrics = learner.rl_cluster.actor_trainer.metrics_logger
  history = lambda name: [
    float(x) for x in metrics.get_metric_history("actor", name, "train")
  ]
  result = {
    "config": dataclasses.asdict(cfg),
    "sft_loss": sft_loss,
    "greedy_accuracy_before": before,
    # the policy the run keeps: the best by validation accuracy
    "greedy_accuracy_after": after,
    "greedy_accuracy_last": last,
    "best_step": monitor.best_step,
    "validation_accuracy": monitor.history,
    "rollbacks": monitor.rollbacks,
    "grpo_steps": learner.rl_cluster.actor_trainer.iter_steps,
    "learning_rate": history("learning_rate"),
    "loss": history("loss"),
    "reward": [
      float(x) for x in metrics.get_metric_history("rewards", "reward", "train")
    ],
    "kl": history("kl"),
    "seconds": time.perf_counter() - start,
  }
  out = pathlib.Path(cfg.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  (out / "final.json").write_text(json.dumps(result, indent=1) + "\n")
  return result


def main(argv=None):
  result = run(parse(sys.argv[1:] if argv is None else argv))
  rewards = result["reward"]
  window = max(1, len(rewards) // 5)
  first, last = rewards[:window], rewards[-window:]
  print(
    f"greedy accuracy {result['greedy_accuracy_before']:.3f} -> "
    f"{result['greedy_accuracy_after']:.3f} after {result['grpo_steps']} "
    f"GRPO steps with {result['config']['optimizer']}; mean "
    f"{result['config']['reward']} reward {sum(first) / len(first):.3f} over "
    f"the first {window} steps, {sum(last) / len(last):.3f} over the last "
    f"({result['seconds']:.0f} s)"
  )


if __name__ == "__main__":
  main()
