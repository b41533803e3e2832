"""``python -m optax_muon.integrations.maxtext``: one of MaxText's trainers,
unmodified, with optax_muon installed for ``opt_type=muon``::

    python -m optax_muon.integrations.maxtext [--tp-mode auto] [--mu-dtype 8bit] \\
        train|train_compile maxtext/configs/base.yml opt_type=muon ...

``--maxtexts-own`` runs MaxText's own optimizer (nothing installed), for
comparison. ``train_compile`` also prints the compiled step's memory, the
compiler's peak among it, as ``optax_muon.maxtext_memory {json}``.
"""

import argparse
import functools
import importlib
import json
import sys
import typing
from collections.abc import Sequence
from typing import Any

from optax_muon import QuantizedMomentum
from optax_muon._src.base import types
from optax_muon.integrations.maxtext import ROUTINGS
from optax_muon.integrations.maxtext import install

MU_DTYPES = {
  "8bit": QuantizedMomentum(),
  "bfloat16": "bfloat16",
  "float32": "float32",
}
# the compiled step's memory_analysis() fields the command prints
MEMORY_FIELDS = (
  "argument_size_in_bytes",
  "output_size_in_bytes",
  "alias_size_in_bytes",
  "temp_size_in_bytes",
  "peak_memory_in_bytes",
)
TRAINERS = {
  "train": "maxtext.trainers.pre_train.train",
  "train_compile": "maxtext.trainers.pre_train.train_compile",
}


def main(argv: Sequence[str] | None = None) -> None:
  """``python -m optax_muon.integrations.maxtext``: one of MaxText's
  trainers with optax_muon installed (see the module docstring)."""
  parser = argparse.ArgumentParser(
    prog="python -m optax_muon.integrations.maxtext",
    description="MaxText's own trainer, with opt_type=muon built by "
    "optax_muon (install()); its arguments follow the trainer's name.",
  )
  parser.add_argument(
    "--tp-mode",
    default="auto",
    choices=typing.get_args(types.TensorParallelMode),
    help="the tensor-parallel mode over MaxText's 'tensor' axis",
  )
  parser.add_argument(
    "--mu-dtype",
    choices=sorted(MU_DTYPES),
    help="the momentum's dtype (default: MaxText's mu_dtype)",
  )
  parser.add_argument(
    "--routing",
    default="auto",
    choices=ROUTINGS,
    help="the Muon leaves and their dimension numbers: MaxText's table, "
    "om.infer_layout's, or MaxText's where it vetted it (auto)",
  )
  parser.add_argument(
    "--maxtexts-own",
    action="store_true",
    help="MaxText's own optimizer, nothing installed (to compare with)",
  )
  parser.add_argument("trainer", choices=sorted(TRAINERS))
  parser.add_argument("arguments", nargs=argparse.REMAINDER)
  args = parser.parse_args(argv)
  if not args.maxtexts_own:
    options: dict[str, Any] = {
      "tp_mode": args.tp_mode,
      "routing": args.routing,
    }
    if args.mu_dtype is not None:
      options["mu_dtype"] = MU_DTYPES[args.mu_dtype]
    install(**options)
  from absl import app  # noqa: PLC0415

  trainer = importlib.import_module(TRAINERS[args.trainer])
  if args.trainer == "train_compile":
    _report_memory(trainer)
  app.run(trainer.main, argv=[args.trainer, *args.arguments])


def _report_memory(train_compile) -> None:
  """Prints the compiled step's memory (``optax_muon.maxtext_memory`` and a
  JSON object), the compiler's peak among it, which MaxText does not print."""
  compile_step = train_compile.jit_and_compile

  @functools.wraps(compile_step)
  def reported(*args, **kwargs):
    compiled = compile_step(*args, **kwargs)
    stats = compiled.memory_analysis()
    record = {name: getattr(stats, name, None) for name in MEMORY_FIELDS}
    print("optax_muon.maxtext_memory", json.dumps(record), flush=True)
    return compiled

  train_compile.jit_and_compile = reported


if __name__ == "__main__":
  main(sys.argv[1:])
