"""QK-clip on and off at a learning rate where attention logits run away.

    python -m examples.flax_lm.qk_clip_demo                  # tiny, ~3 minutes
    python -m examples.flax_lm.qk_clip_demo optim.lr=0.05    # any override

Trains the example GPT twice with Muon at the same settings, without and with
``optim.qk_clip=true``, and writes ``results/qk_clip/``: the runs under
``runs/``, their metrics as ``plain.jsonl`` and ``clip.jsonl``, ``summary.json`` (largest logit over the run and over its
last quarter, final validation loss) and ``qk_clip.png`` (max attention logit
and training loss against steps, both ways). The logged max logit of a step is
measured in that step's forward pass, before the step's update and clip: the
clip scales the updated weights by what the old ones produced (Megatron-Core's
rule), so a step's logits can exceed τ by what one update adds.
"""

import argparse
import json
import pathlib
import shutil

from examples.flax_lm import config as config_lib
from examples.flax_lm import train as train_lib

# Muon at 0.1 (AdamW-matched RMS) on the tiny preset: logits pass 700
DEMO = ["optim.optimizer=muon", "optim.lr=0.1", "train.log_every=1"]


def _records(run_dir: pathlib.Path) -> list[dict]:
  return [
    json.loads(l)
    for l in (run_dir / "metrics.jsonl").read_text().splitlines()
    if l.strip()
  ]


def max_logit(record: dict) -> float:
  return max(v for k, v in record.items() if k.startswith("max_logit/"))


def summarize(records: list[dict], threshold: float) -> dict:
  tail = records[-max(1, len(records) // 4) :]
  return {
    "max_logit": max(map(max_logit, records)),
    "max_logit_last_quarter": max(map(max_logit, tail)),
    "steps_above_threshold": sum(max_logit(r) > threshold for r in records),
    "final_val_loss": [r for r in records if "val_loss" in r][-1]["val_loss"],
  }


def plot(runs: dict, threshold: float, path: pathlib.Path) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  fig, (top, bottom) = plt.subplots(1, 2, figsize=(11, 4))
  for name, records in runs.items():
    steps = [r["step"] for r in records]
    top.plot(steps, [max_logit(r) for r in records], label=name)
    bottom.plot(
      steps, [r["train_loss"] for r in records], label=name, alpha=0.8
    )
  top.axhline(
    threshold, color="gray", linestyle="--", label=f"τ = {threshold:g}"
  )
  top.set_yscale("log")
  top.set_ylabel("max attention logit of the step")
  bottom.set_ylabel("train loss (nats / byte)")
  for ax in (top, bottom):
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def demo(overrides=(), out="results/qk_clip") -> dict:
  out = pathlib.Path(out)
  runs, summary = {}, {}
  for name, clip in (("without QK-clip", "false"), ("with QK-clip", "true")):
    short = "clip" if clip == "true" else "plain"
    run_dir = out / "runs" / short
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = config_lib.run_config(
      DEMO
      + list(overrides)
      + [f"optim.qk_clip={clip}", f"train.out_dir={run_dir}"]
    )
    train_lib.train(cfg)
    shutil.copy(run_dir / "metrics.jsonl", out / f"{short}.jsonl")
    runs[name] = _records(run_dir)
    summary[name] = summarize(runs[name], cfg.optim.qk_clip_threshold)
  threshold = cfg.optim.qk_clip_threshold
  summary["settings"] = {
    "overrides": DEMO + list(overrides),
    "qk_clip_threshold": threshold,
  }
  (out / "summary.json").write_text(json.dumps(summary, indent=1))
  plot(runs, threshold, out / "qk_clip.png")
  return summary


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("overrides", nargs="*")
  parser.add_argument("--out", default="results/qk_clip")
  args = parser.parse_args(argv)
  summary = demo(args.overrides, args.out)
  for name in ("without QK-clip", "with QK-clip"):
    run = summary[name]
    print(
      f"{name:16s} max logit {run['max_logit']:8.1f} (last quarter "
      f"{run['max_logit_last_quarter']:.1f}), final val loss "
      f"{run['final_val_loss']:.4f}"
    )


if __name__ == "__main__":
  main()
