"""Muon against AdamW at the same budget, each at its best lr of a small sweep.

    python -m examples.flax_lm.compare                 # tiny preset, ~1 minute
    python -m examples.flax_lm.compare preset=small    # the README's table

Writes ``results/<preset>/``: every sweep run's ``metrics.jsonl`` under
``runs/``, the best run of each optimizer as ``<optimizer>.jsonl``,
``summary.json`` (the sweep, the best lrs, the step and FLOP ratios) and
``val_loss.png`` (validation loss against steps, wall-clock and FLOPs, the
FLOPs counting the model's 6·N·tokens and Muon's Newton–Schulz).
"""

import argparse
import dataclasses
import json
import logging
import pathlib
import shutil

from examples.flax_lm import config as config_lib
from examples.flax_lm import train as train_lib

SWEEPS = {"tiny": {"adam": (3e-3, 1e-2, 2e-2), "muon": (3e-3, 1e-2, 2e-2)},
          "small": {"adam": (1e-3, 2e-3, 4e-3), "muon": (2e-3, 4e-3)}}


def _curve(run_dir: pathlib.Path) -> list[dict]:
  records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text()
             .splitlines() if l.strip()]
  return [r for r in records if "val_loss" in r]


def match_ratios(muon: dict, adam: dict) -> dict:
  """Steps and FLOPs Muon needs to reach AdamW's final val loss, as ratios."""
  target = adam["curve"][-1]["val_loss"]
  reached = next((r for r in muon["curve"] if r["val_loss"] <= target), None)
  adam_steps = adam["curve"][-1]["step"]
  if reached is None:
    return {"adam_final_val_loss": target, "muon_reaches_it": False}
  flops = lambda run, steps: steps * (run["info"]["model_flops_per_step"] +
                                      run["info"]["ns_flops_per_step"])
  return {"adam_final_val_loss": target, "muon_reaches_it": True,
          "muon_steps": reached["step"], "adam_steps": adam_steps,
          "step_ratio": reached["step"] / adam_steps,
          "flop_ratio": flops(muon, reached["step"]) / flops(adam, adam_steps)}


def plot(runs: dict, path: pathlib.Path) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
  for name, run in runs.items():
    curve, info = run["curve"], run["info"]
    per_step = info["model_flops_per_step"] + info["ns_flops_per_step"]
    label = f"{name} (lr {run['lr']:g})"
    steps = [r["step"] for r in curve]
    losses = [r["val_loss"] for r in curve]
    axes[0].plot(steps, losses, label=label)
    axes[1].plot([r.get("wall_time", 0.0) for r in curve], losses, label=label)
    axes[2].plot([s * per_step for s in steps], losses, label=label)
  for ax, xlabel in zip(axes, ["step", "wall-clock (s, compile excluded)",
                               "FLOPs (model 6·N·tokens + Newton–Schulz)"]):
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3)
  axes[2].set_xscale("linear")
  axes[0].set_ylabel("validation loss (nats / byte)")
  axes[0].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _as_dict(cfg) -> dict:
  return json.loads(json.dumps(dataclasses.asdict(cfg), default=float))


def compare(overrides=(), sweeps=None, out="results", reuse=True) -> dict:
  """Sweeps, picks each optimizer's best lr, writes the results; with
  ``reuse`` a run whose settings match a finished one is read, not redone."""
  base = config_lib.run_config(overrides)
  sweeps = sweeps or SWEEPS[base.preset]
  root = pathlib.Path(out) / base.preset
  best, sweep_table = {}, []
  for optimizer, lrs in sweeps.items():
    for lr in lrs:
      name = f"{base.preset}-{optimizer}-lr{lr:g}"
      run_dir = root / "runs" / name
      cfg = config_lib.run_config(list(overrides) + [
          f"optim.optimizer={optimizer}", f"optim.lr={lr}",
          f"train.name={name}", f"train.out_dir={run_dir}",
          "train.progress=false"])
      finished = run_dir / "final.json"
      if reuse and finished.exists() and json.loads((run_dir / "config.json")
                                                   .read_text()) == _as_dict(cfg):
        final = json.loads(finished.read_text())  # the same run, done before
      else:
        shutil.rmtree(run_dir, ignore_errors=True)
        final = train_lib.train(cfg)
        (run_dir / "config.json").write_text(json.dumps(_as_dict(cfg)))
      sweep_table.append({"optimizer": optimizer, "lr": lr,
                          "final_val_loss": final["final_val_loss"]})
      print(f"  {name}: val loss {final['final_val_loss']:.4f}", flush=True)
      if (optimizer not in best or final["final_val_loss"] <
          best[optimizer]["final_val_loss"]):
        best[optimizer] = {"lr": lr, "final_val_loss": final["final_val_loss"],
                           "dir": run_dir}
  runs = {}
  for optimizer, run in best.items():
    shutil.copy(run["dir"] / "metrics.jsonl", root / f"{optimizer}.jsonl")
    runs[optimizer] = {"lr": run["lr"], "curve": _curve(run["dir"]),
                       "info": json.loads((run["dir"] / "run.json").read_text())}
  summary = {"preset": base.preset, "steps": base.train.steps,
             "sweep": sweep_table,
             "best": {k: {"lr": v["lr"], "final_val_loss": v["final_val_loss"]}
                      for k, v in best.items()}}
  if {"muon", "adam"} <= set(runs):
    summary["muon_vs_adam"] = match_ratios(runs["muon"], runs["adam"])
  (root / "summary.json").write_text(json.dumps(summary, indent=1))
  plot(runs, root / "val_loss.png")
  return summary


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("overrides", nargs="*",
                      help="preset=tiny|small and model./train./optim. fields")
  parser.add_argument("--out", default="results")
  parser.add_argument("--lrs", nargs="+", metavar="OPTIMIZER=LR,LR",
                      help="the sweep, e.g. adam=2e-3,4e-3 muon=4e-3")
  parser.add_argument("--fresh", action="store_true",
                      help="rerun every run, even finished ones")
  args = parser.parse_args(argv)
  logging.basicConfig(level=logging.WARNING)
  sweeps = None
  if args.lrs:
    sweeps = {}
    for item in args.lrs:
      name, _, lrs = item.partition("=")
      if name not in ("adam", "muon") or not lrs:
        raise ValueError(f"--lrs {item!r}: expected adam=LR,LR or muon=LR,LR")
      sweeps[name] = tuple(float(lr) for lr in lrs.split(","))
  summary = compare(args.overrides, sweeps=sweeps, out=args.out,
                    reuse=not args.fresh)
  for optimizer, run in summary["best"].items():
    print(f"{optimizer}: final val loss {run['final_val_loss']:.4f} "
          f"(best lr {run['lr']:g})")
  ratios = summary.get("muon_vs_adam", {})
  if ratios.get("muon_reaches_it"):
    print(f"muon reaches adam's final val loss in {ratios['step_ratio']:.0%} "
          f"of its steps and {ratios['flop_ratio']:.0%} of its FLOPs")
  elif ratios:
    print("muon does not reach adam's final val loss in this budget")
  return summary


if __name__ == "__main__":
  main()
