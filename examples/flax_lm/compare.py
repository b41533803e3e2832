"""Muon, optax.contrib.muon and AdamW at the same budget, each at its best lr.

    python -m examples.flax_lm.compare                 # tiny preset, 22 runs
    python -m examples.flax_lm.compare --all           # and NorMuon, AdaMuon, Dion2, Dion
    python -m examples.flax_lm.compare preset=small    # the README's table

By default three contestants: ``muon`` (optax_muon through ``MuonConfig``),
``optax`` (``optax.contrib.muon`` as a user calls it: its defaults, the
example's lr schedule, weight decay and clipping) and ``adam`` (AdamW);
``--all`` adds ``normuon`` and ``adamuon``
(``MuonConfig(optimizer="adaptive_muon")`` with the example's Muon settings),
``dion2`` and ``nordion2`` (``optimizer="dion2"`` / ``"nordion2"``, a
quarter of each matrix's slices a step, with the same settings) and
``dion`` (``optimizer="dion"`` at a quarter of each matrix's rank);
``muon8bit``, optax_muon's Muon with its momentum in 8 bits, runs when
``--lrs`` names it. ``--lrs`` runs a subset. Each sweeps its
own lrs with two seeds (model init and batches) and is ranked by the mean
final validation loss; a sweep whose best lr is at an edge is extended past it
(×2 or ÷2) until the best is inside, at most ``MAX_EXTENSIONS`` times.

A call that sweeps only some contestants (``--lrs``) keeps the others from
the ``summary.json`` an earlier call wrote there for the same preset, steps
and seeds (unless ``--fresh``): their sweeps and ratios as recorded, the new
ones' ratios against its AdamW's final loss.

Writes ``results/<preset>/``: every run's ``metrics.jsonl`` under ``runs/``,
each contestant's best run (seed 0) as ``<contestant>.jsonl``,
``summary.json`` (the sweeps, the best lrs, the step and FLOP ratios to AdamW's
final loss) and ``val_loss.png`` (the seed-mean validation loss against steps,
wall-clock and FLOPs, the FLOPs counting the model's 6·N·tokens and the
Newton–Schulz of whichever matrices the contestant orthogonalizes).
"""

import argparse
import json
import logging
import pathlib
import shutil
import statistics

from examples.flax_lm import config as config_lib
from examples.flax_lm import progress
from examples.flax_lm import runs as runs_lib
from examples.flax_lm import train as train_lib

ADAPTIVE = "optim.optimizer=adaptive_muon"
CONTESTANTS = {
  "adam": ("optim.optimizer=adam",),
  "muon": ("optim.optimizer=muon",),
  "optax": ("optim.optimizer=muon", "train.muon_impl=optax.contrib"),
  "normuon": (ADAPTIVE, "optim.adaptive_muon_moment2_method=normuon"),
  "adamuon": (ADAPTIVE, "optim.adaptive_muon_moment2_method=adamuon"),
  # optax_muon's Muon with its momentum in 8 bits (om.QuantizedMomentum)
  "muon8bit": ("optim.optimizer=muon", "optim.muon_momentum_bits=8"),
  # a quarter of each matrix's slices a step (om.dion2, om.nordion2); on one
  # device MuonBP (om.muon_bp) is Muon, so it is not a contestant here
  "dion2": ("optim.optimizer=dion2",),
  "nordion2": ("optim.optimizer=nordion2",),
  # Dion's low-rank step at a quarter of the shorter side (om.dion)
  "dion": ("optim.optimizer=dion", "optim.dion_rank_fraction=0.25"),
}
LABELS = {
  "adam": "AdamW",
  "muon": "optax_muon",
  "optax": "optax.contrib.muon",
  "normuon": "NorMuon (optax_muon)",
  "adamuon": "AdaMuon (optax_muon)",
  "muon8bit": "optax_muon, 8-bit momentum",
  "dion2": "Dion2 (optax_muon, fraction 0.25)",
  "nordion2": "NorDion2 (optax_muon, fraction 0.25)",
  "dion": "Dion (optax_muon, rank fraction 0.25)",
}
SWEEPS = {
  "tiny": {
    "adam": (3e-3, 1e-2, 2e-2),
    "muon": (3e-3, 1e-2, 2e-2),
    "optax": (1e-2, 2e-2, 4e-2),
    "normuon": (3e-3, 1e-2, 2e-2),
    # AdaMuon divides by √v elementwise: its steps are ~10× Muon's at one lr
    "adamuon": (3e-4, 1e-3, 2e-3),
    "dion2": (3e-3, 1e-2, 2e-2),
    "nordion2": (3e-3, 1e-2, 2e-2),
    "dion": (3e-3, 1e-2, 2e-2),
  },
  "small": {
    "adam": (1e-3, 2e-3, 4e-3),
    "muon": (4e-3, 8e-3, 1.6e-2),
    "optax": (4e-3, 8e-3, 1.6e-2),
    "normuon": (4e-3, 8e-3, 1.6e-2),
    "adamuon": (4e-4, 8e-4, 1.6e-3),
    "dion2": (4e-3, 8e-3, 1.6e-2),
    "nordion2": (4e-3, 8e-3, 1.6e-2),
    "dion": (4e-3, 8e-3, 1.6e-2),
  },
}
# the README's first command: the comparison the project exists for, within
# a few minutes of 2 CPU cores (``--all``: every contestant of the preset)
DEFAULT_CONTESTANTS = ("adam", "muon", "optax")
SEEDS = (0, 1)
MAX_EXTENSIONS = 3
# the figures docs/examples.md quotes, by preset (results/<folder>/summary.json)
RECORDED = pathlib.Path(__file__).resolve().parents[2] / "results"
RECORDED_IN = {"tiny": "tiny_five", "small": "small"}


def _curve(metrics: pathlib.Path) -> list[dict]:
  """The validation points of a run's ``metrics.jsonl``."""
  records = [
    json.loads(l) for l in metrics.read_text().splitlines() if l.strip()
  ]
  return [r for r in records if "val_loss" in r]


def _earlier_summary(path: pathlib.Path, summary: dict) -> dict | None:
  """The summary an earlier call wrote to the same place for runs of the same
  preset, steps and seeds, or None."""
  if not path.exists():
    return None
  earlier = json.loads(path.read_text())
  keys = ("preset", "steps", "seeds")
  return earlier if all(earlier[k] == summary[k] for k in keys) else None


def _recorded_adam(earlier: dict | None, runs: dict) -> dict | None:
  """AdamW as an earlier summary recorded it: its seed-mean final loss at the
  last step, and the model's FLOPs a step (AdamW has no Newton–Schulz; the
  model is the same for every contestant of a preset)."""
  if earlier is None or "adam" not in earlier["best"] or not runs:
    return None
  model_flops = next(iter(runs.values()))["info"]["model_flops_per_step"]
  return {
    "curve": [
      {
        "step": earlier["steps"],
        "val_loss": earlier["best"]["adam"]["final_val_loss"],
      }
    ],
    "info": {"model_flops_per_step": model_flops, "ns_flops_per_step": 0.0},
  }


def mean_curve(curves: list[list[dict]]) -> list[dict]:
  """The seeds' validation curves averaged step by step."""
  return [
    {
      "step": points[0]["step"],
      "val_loss": statistics.fmean(p["val_loss"] for p in points),
      "wall_time": statistics.fmean(p.get("wall_time", 0.0) for p in points),
    }
    for points in zip(*curves)
  ]


def match_ratios(run: dict, adam: dict) -> dict:
  """Steps and FLOPs ``run`` needs to reach AdamW's final val loss, as ratios."""
  target = adam["curve"][-1]["val_loss"]
  reached = next((r for r in run["curve"] if r["val_loss"] <= target), None)
  adam_steps = adam["curve"][-1]["step"]
  if reached is None:
    return {"adam_final_val_loss": target, "reaches_it": False}
  flops = lambda run, steps: (
    steps
    * (run["info"]["model_flops_per_step"] + run["info"]["ns_flops_per_step"])
  )
  return {
    "adam_final_val_loss": target,
    "reaches_it": True,
    "steps": reached["step"],
    "adam_steps": adam_steps,
    "step_ratio": reached["step"] / adam_steps,
    "flop_ratio": flops(run, reached["step"]) / flops(adam, adam_steps),
  }


def next_lr(results: dict) -> float | None:
  """The lr past the edge the best mean loss sits at, or None if bracketed."""
  ordered = sorted(results)
  best = min(results, key=lambda lr: results[lr]["final_val_loss"])
  if len(ordered) > 1 and best == ordered[0]:
    return best / 2
  if best == ordered[-1]:
    return best * 2
  return None


def plot(runs: dict, path: pathlib.Path) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
  for name, run in runs.items():
    curve, info = run["curve"], run["info"]
    # a contestant kept from an earlier call: its seed-0 curve, no FLOPs
    label = (
      f"{LABELS[name]} (lr {run['lr']:g}{', seed 0' if info is None else ''})"
    )
    steps = [r["step"] for r in curve]
    losses = [r["val_loss"] for r in curve]
    axes[0].plot(steps, losses, label=label)
    axes[1].plot([r.get("wall_time", 0.0) for r in curve], losses, label=label)
    if info is not None:
      per_step = info["model_flops_per_step"] + info["ns_flops_per_step"]
      axes[2].plot([s * per_step for s in steps], losses, label=label)
  for ax, xlabel in zip(
    axes,
    [
      "step",
      "wall-clock (s, compile excluded)",
      "FLOPs (model 6·N·tokens + Newton–Schulz)",
    ],
  ):
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3)
  axes[2].set_xscale("linear")
  axes[0].set_ylabel(f"validation loss, mean of {len(SEEDS)} seeds (nats/byte)")
  axes[0].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def run_one(
  overrides,
  contestant: str,
  lr: float,
  seed: int,
  root: pathlib.Path,
  reuse: bool,
  runs_bar: progress.RunsBar | None = None,
) -> tuple[dict, pathlib.Path]:
  """One training run; with ``reuse`` a finished run of the same settings is
  read, not redone. ``runs_bar`` shows it (else its result is printed)."""
  base = config_lib.run_config(overrides)
  name = f"{base.preset}-{contestant}-lr{lr:g}-seed{seed}"
  run_dir = root / "runs" / name
  cfg = config_lib.run_config(
    list(overrides)
    + list(CONTESTANTS[contestant])
    + [
      f"optim.lr={lr}",
      f"train.seed={seed}",
      f"train.name={name}",
      f"train.out_dir={run_dir}",
      f"train.progress={runs_bar is not None and runs_bar.enabled}",
    ]
  )
  final = runs_lib.run_shown(
    name,
    run_dir,
    runs_lib.settings_of(cfg),
    lambda: train_lib.train(cfg, nested_progress=runs_bar is not None),
    reuse,
    runs_bar,
    describe=lambda final: f"val loss {final['final_val_loss']:.4f}",
  )
  return final, run_dir


def sweep(
  overrides,
  contestant: str,
  lrs,
  seeds,
  root: pathlib.Path,
  reuse: bool,
  max_extensions: int | None = None,
  runs_bar: progress.RunsBar | None = None,
) -> tuple[dict, bool]:
  """``lr -> {"final_val_loss": seed mean, "seeds": [...], "dirs": [...]}``,
  extended until the best lr is bracketed; and whether it is."""
  results = {}
  pending = sorted(lrs)
  extensions = MAX_EXTENSIONS if max_extensions is None else max_extensions
  for round_ in range(extensions + 1):
    for lr in pending:
      finals = [
        run_one(overrides, contestant, lr, seed, root, reuse, runs_bar)
        for seed in seeds
      ]
      losses = [final["final_val_loss"] for final, _ in finals]
      results[lr] = {
        "final_val_loss": statistics.fmean(losses),
        "seeds": losses,
        "dirs": [d for _, d in finals],
      }
    extension = next_lr(results)
    if extension is None:
      return results, True
    pending = [extension]
    if runs_bar is not None and round_ < extensions:
      runs_bar.add(len(seeds))
  return results, next_lr(results) is None


def compare(
  overrides=(),
  sweeps=None,
  out="results",
  reuse=True,
  seeds=SEEDS,
  max_extensions: int | None = None,
  contestants=DEFAULT_CONTESTANTS,
) -> dict:
  """Sweeps each contestant (``sweeps``, else those of ``contestants``, or
  all of the preset's if ``None``, with the preset's lrs), picks its best lr by the seed-mean final loss, writes
  the results (see the module docstring) and returns the summary."""
  base = config_lib.run_config(overrides)
  if not sweeps:
    preset_sweeps = SWEEPS[base.preset]
    sweeps = {
      name: preset_sweeps[name] for name in contestants or preset_sweeps
    }
  root = pathlib.Path(out) / base.preset
  root.mkdir(parents=True, exist_ok=True)
  sweep_table, best, runs = [], {}, {}
  runs_bar = progress.RunsBar(
    sum(len(lrs) for lrs in sweeps.values()) * len(seeds)
  )
  for contestant, lrs in sweeps.items():
    results, bracketed = sweep(
      overrides, contestant, lrs, seeds, root, reuse, max_extensions, runs_bar
    )
    for lr in sorted(results):
      sweep_table.append(
        {
          "optimizer": contestant,
          "lr": lr,
          "final_val_loss": results[lr]["final_val_loss"],
          "seeds": results[lr]["seeds"],
        }
      )
    lr = min(results, key=lambda lr: results[lr]["final_val_loss"])
    best[contestant] = {
      "lr": lr,
      "bracketed": bracketed,
      **{k: results[lr][k] for k in ("final_val_loss", "seeds")},
    }
    dirs = results[lr]["dirs"]
    shutil.copy(dirs[0] / "metrics.jsonl", root / f"{contestant}.jsonl")
    runs[contestant] = {
      "lr": lr,
      "curve": mean_curve([_curve(d / "metrics.jsonl") for d in dirs]),
      "info": json.loads((dirs[0] / "run.json").read_text()),
    }
  summary = {
    "preset": base.preset,
    "steps": base.train.steps,
    "seeds": list(seeds),
    "sweep": sweep_table,
    "best": best,
  }
  trained_on = next(
    (run["info"] for run in runs.values() if "corpus" in run["info"]), None
  )
  if trained_on is not None:
    summary |= {k: trained_on[k] for k in ("python", "corpus")}
  earlier = _earlier_summary(root / "summary.json", summary) if reuse else None
  adam = runs.get("adam") or _recorded_adam(earlier, runs)
  vs_adam = {
    name: match_ratios(run, adam)
    for name, run in runs.items()
    if name != "adam" and adam is not None
  }
  if earlier is not None:  # keep the contestants this call did not sweep
    kept = [name for name in earlier["best"] if name not in sweeps]
    summary["sweep"] = [
      row for row in earlier["sweep"] if row["optimizer"] in kept
    ] + sweep_table
    summary["best"] = {name: earlier["best"][name] for name in kept} | best
    vs_adam = {
      name: ratios
      for name, ratios in earlier.get("vs_adam", {}).items()
      if name in kept
    } | vs_adam
    for name in kept:  # their best run's curve (seed 0) for the plot
      runs[name] = {
        "lr": earlier["best"][name]["lr"],
        "curve": _curve(root / f"{name}.jsonl"),
        "info": None,  # their FLOPs a step are not recorded
      }
  if vs_adam:
    summary["vs_adam"] = vs_adam
  runs_bar.close()
  (root / "summary.json").write_text(json.dumps(summary, indent=1))
  plot(runs, root / "val_loss.png")
  return summary


def corpus_note(summary: dict, recorded: pathlib.Path = RECORDED) -> str:
  """A line saying whether ``summary``'s runs trained on the text the
  recorded figures of its preset did (only then are the losses comparable)."""
  folder = RECORDED_IN.get(summary["preset"])
  path = recorded / str(folder) / "summary.json"
  if folder is None or not path.exists() or "corpus" not in summary:
    return ""
  theirs = json.loads(path.read_text())
  ours = summary["corpus"]
  where = f"results/{folder}/ and docs/examples.md"
  if theirs.get("corpus", {}).get("sha256") == ours["sha256"]:
    return (
      f"Same text as the recorded figures ({where}): the losses above "
      "should equal theirs to the digits shown."
    )
  recorded_on = theirs.get("corpus", {}).get("source", "another text")
  return (
    f"Note: this run trained on {ours['source']} ({ours['bytes']} bytes, "
    f"sha256 {ours['sha256'][:12]}); the recorded figures ({where}) trained "
    f"on {recorded_on}, so the losses differ. To train on the same text, "
    "pass train.data=<that Python's Lib folder>."
  )


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "overrides",
    nargs="*",
    help="preset=tiny|small and model./train./optim. fields",
  )
  parser.add_argument("--out", default="results")
  parser.add_argument(
    "--lrs",
    nargs="+",
    metavar="CONTESTANT=LR,LR",
    help="the starting sweeps, e.g. adam=2e-3,4e-3 muon=4e-3 "
    f"(contestants: {', '.join(CONTESTANTS)}); those not "
    "named are not run",
  )
  parser.add_argument(
    "--seeds",
    default=",".join(map(str, SEEDS)),
    help="comma-separated seeds, each lr runs with each",
  )
  parser.add_argument(
    "--max-extensions",
    type=int,
    default=MAX_EXTENSIONS,
    help="how many times a sweep may extend past its edge",
  )
  parser.add_argument(
    "--all",
    action="store_true",
    help="every contestant of the preset's sweeps, not only "
    f"{', '.join(DEFAULT_CONTESTANTS)}",
  )
  parser.add_argument(
    "--fresh", action="store_true", help="rerun every run, even finished ones"
  )
  args = parser.parse_args(argv)
  logging.basicConfig(level=logging.WARNING)
  if args.all and args.lrs:
    parser.error("--all and --lrs: pass one (--lrs names the contestants)")
  try:
    sweeps = runs_lib.parse_lrs(args.lrs, CONTESTANTS) if args.lrs else None
    seeds = tuple(int(seed) for seed in args.seeds.split(","))
    with runs_lib.compilation_cache():
      summary = compare(
        args.overrides,
        sweeps=sweeps,
        out=args.out,
        reuse=not args.fresh,
        seeds=seeds,
        max_extensions=args.max_extensions,
        contestants=None if args.all else DEFAULT_CONTESTANTS,
      )
  except ValueError as error:
    parser.exit(2, f"{parser.prog}: error: {error}\n")
  for name, run in summary["best"].items():
    edge = "" if run["bracketed"] else " (at the edge of its sweep)"
    print(
      f"{LABELS[name]}: final val loss {run['final_val_loss']:.4f}, mean "
      f"of {len(run['seeds'])} seeds (best lr {run['lr']:g}{edge})"
    )
  for name, ratios in summary.get("vs_adam", {}).items():
    if ratios["reaches_it"]:
      print(
        f"{LABELS[name]} reaches AdamW's final val loss in "
        f"{ratios['step_ratio']:.0%} of its steps and "
        f"{ratios['flop_ratio']:.0%} of its FLOPs"
      )
    else:
      print(f"{LABELS[name]} does not reach AdamW's final val loss")
  note = corpus_note(summary)
  if note:
    print(note)
  return summary


if __name__ == "__main__":
  main()
