"""Run settings of the Flax LM example: presets, model and training fields.

An override line has three sections: ``model.*`` (``GPTConfig``), ``train.*``
(``TrainConfig``) and ``optim.*`` (``optax_muon.MuonConfig``, verl names)::

    python -m examples.flax_lm.train optim.optimizer=muon model.n_layer=4
"""

import dataclasses

import optax_muon as om
from examples.flax_lm.model import GPTConfig
from optax_muon import MuonConfig

MUON_IMPLS = ("optax_muon", "optax.contrib")
# optimizers with a Newton–Schulz step (and the example's Muon settings)
MUON_OPTIMIZERS = (
  "muon",
  "adaptive_muon",
  "muon_bp",
  "dion2",
  "nordion2",
  "dion",
)


def check_at_least(section: str, config, minimum: float, names) -> None:
  """Raises naming ``section.name`` for the first field below ``minimum``."""
  for name in names:
    if getattr(config, name) < minimum:
      raise ValueError(
        f"{section}.{name}={getattr(config, name)} must be >= {minimum}"
      )


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  name: str | None = None  # default: "<preset>-<optimizer>"
  steps: int = 200
  batch_size: int = 16
  warmup_steps: int = 20
  eval_every: int = 50
  eval_batches: int = 4
  log_every: int = 10
  checkpoint_every: int = 0  # 0: only at the end
  keep_checkpoints: int = 3
  out_dir: str | None = None  # default: runs/<name>
  data: str | None = None  # default: the Python standard library
  max_bytes: int = 8_000_000
  seed: int = 0
  progress: bool = True
  # "optax.contrib": optax.contrib.muon with its own defaults (the baseline
  # compare.py runs), for optim.optimizer=muon
  muon_impl: str = "optax_muon"

  def __post_init__(self):
    if self.muon_impl not in MUON_IMPLS:
      raise ValueError(
        f"train.muon_impl={self.muon_impl!r} is not accepted; "
        f"accepted values: {list(MUON_IMPLS)}"
      )
    check_at_least(
      "train",
      self,
      1,
      (
        "steps",
        "batch_size",
        "eval_every",
        "eval_batches",
        "log_every",
        "keep_checkpoints",
        "max_bytes",
      ),
    )
    if not 0 <= self.warmup_steps < self.steps:
      raise ValueError(
        f"train.warmup_steps={self.warmup_steps} must be in "
        f"[0, train.steps={self.steps})"
      )
    if self.checkpoint_every < 0:
      raise ValueError(
        f"train.checkpoint_every={self.checkpoint_every} must "
        "be >= 0 (0: only at the end)"
      )


PRESETS = {
  # < 3 minutes for both optimizers on 2 CPU cores
  "tiny": {
    "model": dict(n_layer=2, n_embd=64, n_head=4, block_size=64),
    "train": dict(steps=200, batch_size=16, warmup_steps=20, eval_every=50),
    "optim": dict(lr=3e-3),
  },
  # 1.9M parameters; ~0.45 s a step on 2 CPU cores
  "small": {
    "model": dict(n_layer=4, n_embd=192, n_head=6, block_size=128),
    "train": dict(
      steps=600, batch_size=16, warmup_steps=50, eval_every=50, eval_batches=8
    ),
    "optim": dict(lr=4e-3),
  },
}

# what the example changes from verl's fine-tuning defaults for pre-training;
# the muon_* ones only for Muon runs (an AdamW config setting them warns)
EXAMPLE_OPTIM = dict(weight_decay=0.1)
EXAMPLE_MUON = dict(
  muon_match_adamw_update_rms=True,
  muon_nesterov=True,
  muon_fp32_matmul_prec="highest",
)


@dataclasses.dataclass(frozen=True)
class RunConfig:
  preset: str
  model: GPTConfig
  train: TrainConfig
  optim: MuonConfig

  def __post_init__(self):
    if self.train.muon_impl != "optax_muon" and (
      self.optim.optimizer != "muon" or self.optim.qk_clip
    ):
      raise ValueError(
        f"train.muon_impl={self.train.muon_impl!r} needs "
        "optim.optimizer=muon and no optim.qk_clip"
      )

  @property
  def name(self) -> str:
    return self.train.name or f"{self.preset}-{self.optim.optimizer}"

  @property
  def out_dir(self) -> str:
    return self.train.out_dir or f"runs/{self.name}"


def _section(name: str, cls, fields: dict):
  """``cls`` built from ``fields`` (override texts parsed by the library's
  one parser, their messages naming ``name.field``)."""
  return cls(
    **om.parse_fields(
      cls, {f"{name}.{field}": value for field, value in fields.items()}
    )
  )


def parse_sections(
  overrides,
  presets: dict,
  classes: dict,
  optim_defaults: dict,
  muon_defaults: dict,
) -> tuple[str, dict]:
  """``(preset, {section: instance})`` from ``preset=...`` and
  ``section.field=value`` overrides over ``presets[preset]``.

  ``classes`` maps section names (``model``, ``train``, ...) to dataclasses;
  any other dotted path ending in a ``MuonConfig`` field (verl's
  ``actor_rollout_ref.actor.optim.lr``) goes to ``optim``, over
  ``optim_defaults``, the preset's ``optim``, and for ``optimizer=muon`` or
  ``adaptive_muon`` ``muon_defaults``.
  """
  values = om.split_overrides(overrides)
  preset = values.pop("preset", next(iter(presets)))
  if preset not in presets:
    raise ValueError(
      f"preset={preset!r} is not accepted; accepted values: {list(presets)}"
    )
  sections = {name: {} for name in classes}
  for section, fields in presets[preset].items():
    if section != "optim":
      sections[section].update(fields)
  optim = {}
  for key, value in values.items():
    section, field = key.split(".", 1)[0], key.rsplit(".", 1)[-1]
    if section in classes:
      sections[section][field] = value
    elif "." not in key:
      raise ValueError(
        f"override {key!r} names no section; accepted: preset, "
        + ", ".join(f"{name}.*" for name in classes)
        + ", optim.* (or a verl path)"
      )
    else:
      optim[key] = value
  # a field given under two verl prefixes raises
  optim = om.parse_fields(MuonConfig, optim)
  defaults = dict(optim_defaults, **presets[preset].get("optim", {}))
  optimizer = optim.get("optimizer", defaults.get("optimizer"))
  if optimizer in MUON_OPTIMIZERS:
    defaults.update(muon_defaults)
  built = {
    name: _section(name, cls, sections[name]) for name, cls in classes.items()
  }
  built["optim"] = MuonConfig.from_dict(defaults | optim)
  return preset, built


def run_config(overrides=()) -> RunConfig:
  """A preset (``preset=tiny`` by default) with ``section.field=value``
  overrides applied; any dotted path ending in a ``MuonConfig`` field (verl's
  ``actor_rollout_ref.actor.optim.lr``) goes to ``optim``."""
  preset, sections = parse_sections(
    overrides,
    PRESETS,
    {"model": GPTConfig, "train": TrainConfig},
    EXAMPLE_OPTIM,
    EXAMPLE_MUON,
  )
  return RunConfig(preset=preset, **sections)
