"""Run settings of the GRPO example: presets and the model, sft, train sections.

Overrides use ``examples/flax_lm``'s style: ``preset=tiny|small``,
``model.*`` (its ``GPTConfig``), ``sft.*`` (``SFTConfig``), ``train.*``
(``TrainConfig``, the GRPO run) and ``optim.*`` (``optax_muon.MuonConfig``;
verl's ``actor_rollout_ref.actor.optim.lr=...`` works as it is)::

    python -m examples.grpo_arith.train optim.optimizer=muon optim.lr=2e-3
"""

import dataclasses

from examples.flax_lm.config import EXAMPLE_MUON
from examples.flax_lm.config import check_at_least
from examples.flax_lm.config import parse_sections
from examples.flax_lm.model import GPTConfig
from optax_muon import MuonConfig

REWARDS = ("shaped", "strict")
SFT_OPTIMIZERS = ("adam", "muon")


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  """The supervised warm start on worked solutions (the same for every GRPO
  run of a seed, whatever ``optim`` says, so that runs start alike)."""

  steps: int = 400
  batch_size: int = 32
  lr: float = 3e-3
  warmup_steps: int = 30
  optimizer: str = "adam"

  def __post_init__(self):
    if self.optimizer not in SFT_OPTIMIZERS:
      raise ValueError(
        f"sft.optimizer={self.optimizer!r} is not accepted; "
        f"accepted values: {list(SFT_OPTIMIZERS)}"
      )
    check_at_least("sft", self, 1, ("steps", "batch_size"))
    check_at_least("sft", self, 0, ("lr", "warmup_steps"))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The task, the GRPO objective, its schedule, evaluation and recovery."""

  name: str | None = None  # default: "<preset>-<optimizer>-<reward>"
  out_dir: str | None = None  # default: runs/grpo/<name>
  sft_dir: str | None = None  # default: <out_dir>/sft; reused when it matches
  seed: int = 0
  progress: bool = True
  # the task
  levels: tuple[int, ...] = (1, 2, 3)
  prompt_width: int = 96
  completion_len: int = 56
  test_problems: int = 256
  # GRPO
  steps: int = 120
  prompts_per_step: int = 16
  # 16 samples a problem: 60 % of the groups carry a signal (46 % at 8),
  # and the tiny preset's gain over SFT holds on both jax ends (README)
  group_size: int = 16
  temperature: float = 0.7
  reward: str = "shaped"
  kl_coef: float = 0.04
  clip_ratio: float = 0.2
  # lr · min(step / warmup_steps, 1) / (1 + lr_decay · step)
  warmup_steps: int = 10
  lr_decay: float = 0.01
  # monitoring and recovery
  eval_every: int = 10  # greedy test accuracy; a checkpoint each time
  reward_window: int = 10
  rollback_patience: int = 3  # consecutive accuracy drops before a rollback

  def __post_init__(self):
    if self.reward not in REWARDS:
      raise ValueError(
        f"train.reward={self.reward!r} is not accepted; "
        f"accepted values: {list(REWARDS)}"
      )
    check_at_least(
      "train",
      self,
      1,
      (
        "prompt_width",
        "completion_len",
        "test_problems",
        "steps",
        "prompts_per_step",
        "eval_every",
        "reward_window",
        "rollback_patience",
      ),
    )
    check_at_least("train", self, 2, ("group_size",))
    check_at_least(
      "train", self, 0, ("kl_coef", "clip_ratio", "warmup_steps", "lr_decay")
    )
    if self.temperature <= 0:  # sampling; evaluation is greedy anyway
      raise ValueError(f"train.temperature={self.temperature} must be > 0")
    if not all(1 <= level <= 6 for level in self.levels):
      raise ValueError(f"train.levels={self.levels} must be in [1, 6]")


PRESETS = {
  # SFT + GRPO in about 13 minutes on 2 CPU cores (README, Timing)
  "tiny": {
    "model": dict(n_layer=2, n_embd=96, n_head=4, block_size=152),
    "sft": dict(steps=400),
    "train": dict(steps=120),
  },
  "small": {
    "model": dict(n_layer=4, n_embd=128, n_head=4, block_size=152),
    "sft": dict(steps=800),
    "train": dict(steps=300, test_problems=512),
  },
}

# what the example changes from verl's fine-tuning defaults (lr 2e-4 is both
# optimizers' sweep of examples/grpo_arith/README.md); for Muon runs also
# flax_lm's Muon settings (AdamW-matched update RMS above all)
EXAMPLE_OPTIM = dict(optimizer="muon", lr=2e-4, weight_decay=0.0, clip_grad=1.0)


@dataclasses.dataclass(frozen=True)
class RunConfig:
  preset: str
  model: GPTConfig
  sft: SFTConfig
  train: TrainConfig
  optim: MuonConfig

  def __post_init__(self):
    needed = self.train.prompt_width + self.train.completion_len
    if self.model.block_size < needed:
      raise ValueError(
        f"model.block_size={self.model.block_size} must be >= "
        f"train.prompt_width + train.completion_len = {needed}"
      )

  @property
  def name(self) -> str:
    return (
      self.train.name
      or f"{self.preset}-{self.optim.optimizer}-{self.train.reward}"
    )

  @property
  def out_dir(self) -> str:
    return self.train.out_dir or f"runs/grpo/{self.name}"

  @property
  def sft_dir(self) -> str:
    return self.train.sft_dir or f"{self.out_dir}/sft"


def run_config(overrides=()) -> RunConfig:
  """A preset (``preset=tiny`` by default) with ``section.field=value``
  overrides applied; other dotted paths ending in a ``MuonConfig`` field go
  to ``optim``."""
  preset, sections = parse_sections(
    overrides,
    PRESETS,
    {"model": GPTConfig, "sft": SFTConfig, "train": TrainConfig},
    EXAMPLE_OPTIM,
    EXAMPLE_MUON,
  )
  return RunConfig(preset=preset, **sections)
