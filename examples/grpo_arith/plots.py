"""Pictures of GRPO runs from their ``metrics.jsonl``."""

import json
import pathlib


def read(path) -> list[dict]:
  return [
    json.loads(line)
    for line in pathlib.Path(path).read_text().splitlines()
    if line.strip()
  ]


def _series(records, key):
  points = [(r["step"], r[key]) for r in records if key in r]
  return [s for s, _ in points], [v for _, v in points]


def _pyplot():
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  return plt


def plot_run(metrics_path, png_path, title: str) -> None:
  """Six panels: reward and format rate, test accuracy (greedy and at the
  train temperature), the GRPO loss, KL to the SFT policy, update RMS per
  parameter group, and the largest attention logit; rollbacks as lines."""
  plt = _pyplot()
  records = read(metrics_path)
  fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
  panels = [
    (
      axes[0, 0],
      [
        ("reward_avg", "reward, moving average"),
        ("format_rate", "format rate (samples)"),
      ],
    ),
    (
      axes[0, 1],
      [
        ("test_accuracy", "test accuracy, greedy"),
        ("test_accuracy_sampled", "test accuracy, train temperature"),
        ("test_format_rate", "test format rate, greedy"),
      ],
    ),
    (axes[0, 2], [("loss", "GRPO loss")]),
    (axes[1, 0], [("kl", "KL to the SFT policy")]),
    (
      axes[1, 1],
      sorted(
        (k, k.split("/", 1)[1])
        for k in {k for r in records for k in r}
        if k.startswith("update_rms/")
      ),
    ),
    (axes[1, 2], [("max_logit", "largest attention logit")]),
  ]
  for ax, series in panels:
    for key, label in series:
      steps, values = _series(records, key)
      ax.plot(
        steps, values, label=label, marker="." if len(steps) < 30 else None
      )
    ax.set_xlabel("GRPO step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    for r in records:
      if "rollback_to" in r:
        ax.axvline(r["step"], color="red", alpha=0.4, linestyle="--")
  # a log scale needs a positive value (a short run's may all be zero)
  if any(y > 0 for line in axes[1, 1].get_lines() for y in line.get_ydata()):
    axes[1, 1].set_yscale("log")
  fig.suptitle(f"{title} (dashed red: a rollback to the best checkpoint)")
  fig.tight_layout()
  fig.savefig(png_path, dpi=100)
  plt.close(fig)


def plot_compare(runs: dict, png_path) -> None:
  """``runs``: label → records (one row per run). Reward (moving average),
  format rate of the samples and greedy test accuracy against steps."""
  plt = _pyplot()
  fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
  for label, records in runs.items():
    for ax, key in zip(axes, ("reward_avg", "format_rate", "test_accuracy")):
      steps, values = _series(records, key)
      ax.plot(steps, values, label=label)
  for ax, title in zip(
    axes,
    (
      "reward (moving average of the samples)",
      "format rate of the samples",
      "greedy test accuracy",
    ),
  ):
    ax.set_title(title)
    ax.set_xlabel("GRPO step")
    ax.grid(alpha=0.3)
  axes[2].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(png_path, dpi=100)
  plt.close(fig)
