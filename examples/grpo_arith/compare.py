"""Muon against AdamW for GRPO, with the shaped and the strict reward.

    python -m examples.grpo_arith.compare                # tiny preset
    python -m examples.grpo_arith.compare --lrs muon=1e-3,3e-3 adam=1e-3

Each optimizer sweeps its lrs with the shaped reward on seed 0 and is ranked
by its final greedy test accuracy; at its best lr it then also runs with the
strict reward (seed 0) and with the shaped reward on seed 1 (its own SFT
policy). Every run of a seed starts from the same SFT policy.

Writes ``results/grpo_<preset>/``: ``summary.json`` (every run's
``final.json``, the best lrs, the table), ``compare.png`` (reward, format rate
and greedy accuracy against steps for the best runs, shaped and strict) and
each of those runs' metrics as ``<optimizer>-<reward>-seed<n>.jsonl``; the runs
themselves under ``runs/``.
"""

import argparse
import json
import logging
import pathlib
import shutil

import numpy as np

from examples.flax_lm import progress
from examples.flax_lm import runs as runs_lib
from examples.grpo_arith import config as config_lib
from examples.grpo_arith import plots
from examples.grpo_arith import train as train_lib

SWEEPS = {
  "tiny": {"muon": (1e-4, 2e-4, 4e-4), "adam": (1e-4, 2e-4, 4e-4)},
  "small": {"muon": (1e-4, 2e-4, 4e-4), "adam": (1e-4, 2e-4, 4e-4)},
}
LABELS = {"muon": "Muon", "adam": "AdamW"}


def run_one(
  overrides,
  root: pathlib.Path,
  optimizer: str,
  lr: float,
  reward: str,
  seed: int,
  reuse: bool = True,
  runs_bar: progress.RunsBar | None = None,
) -> dict:
  """One run (its ``final.json`` plus where it is); a finished run of the same
  settings is read, not redone. ``runs_bar`` shows it (else its result is
  printed)."""
  base = config_lib.run_config(overrides)
  name = f"{base.preset}-{optimizer}-lr{lr:g}-{reward}-seed{seed}"
  run_dir = root / "runs" / name
  cfg = config_lib.run_config(
    list(overrides)
    + [
      f"optim.optimizer={optimizer}",
      f"optim.lr={lr}",
      f"train.reward={reward}",
      f"train.seed={seed}",
      f"train.name={name}",
      f"train.out_dir={run_dir}",
      f"train.sft_dir={root / f'sft-seed{seed}'}",
      f"train.progress={runs_bar is not None and runs_bar.enabled}",
    ]
  )
  final = runs_lib.run_shown(
    name,
    run_dir,
    runs_lib.settings_of(cfg, ("out_dir", "sft_dir", "progress", "name")),
    lambda: train_lib.train(cfg, nested_progress=runs_bar is not None),
    reuse,
    runs_bar,
    describe=lambda final: (
      f"greedy accuracy {final['sft_accuracy']:.3f} -> "
      f"{final['final_accuracy']:.3f} ({final['rollbacks']} rollbacks, "
      f"format {final['format_rate']:.2f})"
    ),
  )
  return dict(final, name=name, dir=str(run_dir))


def diagnostics(records: list[dict]) -> dict:
  """What a run's curves say about the failure modes the README describes:
  the GRPO loss as noise (its mean and spread), the greedy accuracy above the
  train-temperature one, the lowest format rate, the share of groups that
  teach, and each parameter group's mean update RMS."""
  steps = [r for r in records if "loss" in r]
  evals = [r for r in records if "test_accuracy_sampled" in r]
  losses = np.array([r["loss"] for r in steps])
  return {
    "loss_mean": float(losses.mean()),
    "loss_std": float(losses.std()),
    "greedy_minus_sampled": float(
      np.mean([r["test_accuracy"] - r["test_accuracy_sampled"] for r in evals])
    ),
    "min_format_rate": float(min(r["format_rate"] for r in steps)),
    "signal_groups": float(np.mean([r["signal_groups"] for r in steps])),
    "update_rms": {
      key.split("/", 1)[1]: float(np.mean([r[key] for r in steps]))
      for key in steps[0]
      if key.startswith("update_rms/")
    },
  }


def compare(overrides=(), sweeps=None, out="results", reuse=True) -> dict:
  """Sweeps, picks, runs the strict and second-seed runs, writes the
  results (see the module docstring) and returns the summary."""
  base = config_lib.run_config(overrides)
  sweeps = sweeps or SWEEPS[base.preset]
  root = pathlib.Path(out) / f"grpo_{base.preset}"
  root.mkdir(parents=True, exist_ok=True)
  runs, best, shown, checks = [], {}, {}, {}
  # per optimizer: its sweep, then a strict-reward and a second-seed run
  runs_bar = progress.RunsBar(sum(len(lrs) + 2 for lrs in sweeps.values()))
  for optimizer, lrs in sweeps.items():
    sweep = [
      run_one(overrides, root, optimizer, lr, "shaped", 0, reuse, runs_bar)
      for lr in sorted(lrs)
    ]
    runs += sweep
    chosen = max(sweep, key=lambda r: r["final_accuracy"])
    lr = chosen["lr"]
    at_edge = len(lrs) > 1 and lr in (min(lrs), max(lrs))
    best[optimizer] = {"lr": lr, "at_edge_of_sweep": at_edge}
    extra = [
      run_one(overrides, root, optimizer, lr, "strict", 0, reuse, runs_bar),
      run_one(overrides, root, optimizer, lr, "shaped", 1, reuse, runs_bar),
    ]
    runs += extra
    for run in (chosen, *extra):
      label = f"{optimizer}-{run['reward']}-seed{run['seed']}"
      shutil.copy(
        pathlib.Path(run["dir"]) / "metrics.jsonl", root / f"{label}.jsonl"
      )
      records = plots.read(root / f"{label}.jsonl")
      shown[
        f"{LABELS[optimizer]} lr {lr:g}, {run['reward']}, seed {run['seed']}"
      ] = records
      checks[label] = diagnostics(records)
  table = [
    {
      k: run[k]
      for k in (
        "optimizer",
        "lr",
        "reward",
        "seed",
        "sft_accuracy",
        "final_accuracy",
        "best_accuracy",
        "format_rate",
        "rollbacks",
      )
    }
    for run in runs
  ]
  summary = {
    "preset": base.preset,
    "steps": base.train.steps,
    "best": best,
    "runs": table,
    "diagnostics": checks,
  }
  runs_bar.close()
  (root / "summary.json").write_text(json.dumps(summary, indent=1))
  plots.plot_compare(shown, root / "compare.png")
  return summary


def format_table(summary: dict) -> str:
  """The runs as a Markdown table."""
  lines = [
    "| optimizer | lr | reward | seed | SFT acc. | final acc. | best acc. "
    "| format | rollbacks |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for r in summary["runs"]:
    lines.append(
      f"| {LABELS[r['optimizer']]} | {r['lr']:g} | {r['reward']} | {r['seed']} "
      f"| {r['sft_accuracy']:.3f} | {r['final_accuracy']:.3f} | "
      f"{r['best_accuracy']:.3f} | {r['format_rate']:.2f} | {r['rollbacks']} |"
    )
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "overrides",
    nargs="*",
    help="preset=tiny|small and model./sft./train./optim. fields",
  )
  parser.add_argument("--out", default="results")
  parser.add_argument(
    "--lrs",
    nargs="+",
    metavar="OPTIMIZER=LR,LR",
    help="the sweeps, e.g. muon=1e-3,2e-3 adam=1e-3 "
    f"(optimizers: {', '.join(LABELS)}); those not named "
    "are not run",
  )
  parser.add_argument(
    "--fresh", action="store_true", help="rerun every run, even finished ones"
  )
  args = parser.parse_args(argv)
  logging.basicConfig(level=logging.WARNING)
  try:
    sweeps = runs_lib.parse_lrs(args.lrs, LABELS) if args.lrs else None
    summary = compare(
      args.overrides, sweeps=sweeps, out=args.out, reuse=not args.fresh
    )
  except ValueError as error:
    parser.exit(2, f"{parser.prog}: error: {error}\n")
  print(format_table(summary))
  return summary


if __name__ == "__main__":
  main()
