"""Muon train step over AdamW train step on the example model.

    python benchmarks/train_step.py [--quick] [--also=dion2,dion] [preset=small ...]
    XLA_FLAGS=--xla_force_host_platform_device_count=2 \
        python benchmarks/train_step.py --mesh=model=2 --also=muon_bp

Both steps are the example's jitted ``train_step`` (forward, backward,
optimizer, donated buffers) on the same batch, timed in alternation;
``--also`` times more ``optim.optimizer`` values in the same rounds and
reports each over Muon's step. ``--mesh`` runs every step on the example's
``--mesh`` (tensor-parallel over ``model``): MuonBP's block steps differ
from Muon's only there. Rounds are consecutive steps, so a periodic
optimizer's median is over its mix of steps.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import statistics  # noqa: E402

from _timing import emit  # noqa: E402
from _timing import quick_flag  # noqa: E402
from _timing import time_once  # noqa: E402

from examples.flax_lm import config as config_lib  # noqa: E402
from examples.flax_lm import distributed  # noqa: E402
from examples.flax_lm import train as train_lib  # noqa: E402
from examples.flax_lm.data import ByteCorpus  # noqa: E402


def main():
  quick = quick_flag()
  overrides = [
    a for a in sys.argv[1:] if "=" in a and not a.startswith("--")
  ] or (["preset=tiny", "train.batch_size=4"] if quick else ["preset=small"])
  also = [
    name
    for a in sys.argv[1:]
    if a.startswith("--also=")
    for name in a.split("=", 1)[1].split(",")
  ]
  meshes = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--mesh=")]
  mesh = distributed.parse_mesh(meshes[-1]) if meshes else None
  place = distributed.batch_placer(mesh)
  corpus = ByteCorpus(max_bytes=500_000)
  states, samples = {}, {}
  for optimizer in ("muon", "adam", *also):
    cfg = config_lib.run_config(overrides + [f"optim.optimizer={optimizer}"])
    built = train_lib.build(cfg, mesh)
    params, opt_state, step = built.params, built.opt_state, built.train_step
    batch = place(
      corpus.batch("train", 0, cfg.train.batch_size, cfg.model.block_size)
    )
    params, opt_state, _ = step(params, opt_state, *batch)  # compile
    states[optimizer] = [step, params, opt_state, batch]
    samples[optimizer] = []
  for _ in range(3 if quick else 15):
    for optimizer, entry in states.items():
      step, params, opt_state, batch = entry

      def run():
        entry[1], entry[2], metrics = step(entry[1], entry[2], *batch)
        return metrics

      samples[optimizer].append(time_once(run))
  median = {k: statistics.median(v) for k, v in samples.items()}
  emit(
    {
      "benchmark": "train_step",
      "overrides": overrides,
      "mesh": meshes[-1] if meshes else None,
      "seconds": median,
      "muon_over_adamw": median["muon"] / median["adam"],
      **{f"{name}_over_muon": median[name] / median["muon"] for name in also},
    }
  )


if __name__ == "__main__":
  main()
