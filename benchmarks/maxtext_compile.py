"""MaxText's own whole train step (forward, backward, update), compiled by the
TPU compiler for a TPU topology without a TPU, with each optimizer:

    python benchmarks/maxtext_compile.py [--model llama2-7b] [--topology v5p-8]
        [--tp 4] [--fsdp 1] [--modes adamw,maxtext_muon,auto]
        [--routing auto] [--layers N] [MAXTEXT_ARGUMENT ...]

Each row runs MaxText 0.2.5's unmodified ``train_compile.py`` in a process of
its own, through ``python -m optax_muon.integrations.maxtext``: ``adamw``
and ``maxtext_muon`` (MaxText's ``opt_type=muon``, which is
``optax.contrib.muon`` partitioned by XLA) as MaxText builds them
(``--maxtexts-own``), every other name as a ``tp_mode`` of optax_muon
installed with ``--routing``. Prints one JSON line per row: the compiler's
per-chip arguments, temporaries and peak (GiB), its refusal if the step does
not fit, and the temporaries and peak against AdamW's.

Needs MaxText (``pip install -e ".[maxtext]" && pip install --no-deps
maxtext==0.2.5``) and libtpu (``pip install "jax[tpu]==<your jax>"``),
Python >= 3.12.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

GIB = 2**30


def compile_step(mode: str, args) -> dict:
  import maxtext  # noqa: PLC0415

  config = os.path.join(
    os.path.dirname(maxtext.__file__), "configs", "base.yml"
  )
  own = mode in ("adamw", "maxtext_muon")
  flags = ["--maxtexts-own"] if own else ["--tp-mode", mode]
  with tempfile.TemporaryDirectory() as folder:
    arguments = [
      config,
      f"compile_topology={args.topology}",
      "compile_topology_num_slices=1",
      f"model_name={args.model}",
      "per_device_batch_size=1",
      f"weight_dtype={args.weight_dtype}",
      f"ici_fsdp_parallelism={args.fsdp}",
      f"ici_tensor_parallelism={args.tp}",
      f"opt_type={'adamw' if mode == 'adamw' else 'muon'}",
      f"base_output_directory={folder}",
      "run_name=compile",
      *(
        ["override_model_config=true", f"base_num_decoder_layers={args.layers}"]
        if args.layers
        else []
      ),
      *args.maxtext_arguments,
    ]
    env = dict(
      os.environ,
      ALLOW_MULTIPLE_LIBTPU_LOAD="1",
      TPU_WORKER_HOSTNAMES="localhost",
      JAX_PLATFORMS="cpu",
    )
    command = [sys.executable, "-m", "optax_muon.integrations.maxtext"]
    result = subprocess.run(
      [*command, *flags, "--routing", args.routing, "train_compile"]
      + arguments,
      capture_output=True,
      text=True,
      env=env,
      cwd=folder,
    )
  text = result.stdout + result.stderr
  record = {
    "benchmark": "maxtext_compile",
    "model": args.model,
    "layers": args.layers,
    "topology": args.topology,
    "fsdp": args.fsdp,
    "tp": args.tp,
    "weight_dtype": args.weight_dtype,
    "mode": mode,
    "routing": None if own else args.routing,
  }
  stats = re.search(r"optax_muon\.maxtext_memory (\{.*\})", text)
  if stats is None:
    refused = "RESOURCE_EXHAUSTED" in text or "exceeds" in text
    record.update(compiled=False, resource_exhausted=refused)
    record["error"] = (text.strip().splitlines() or [""])[-1][-300:]
    return record
  memory = json.loads(stats.group(1))
  peak = memory["peak_memory_in_bytes"]
  record.update(
    compiled=True,
    argument_gib=memory["argument_size_in_bytes"] / GIB,
    temp_gib=memory["temp_size_in_bytes"] / GIB,
    peak_gib=None if peak is None else peak / GIB,
  )
  return record


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="llama2-7b")
  parser.add_argument("--topology", default="v5p-8")
  parser.add_argument("--tp", type=int, default=4)
  parser.add_argument("--fsdp", type=int, default=1)
  parser.add_argument("--weight-dtype", default="float32")
  parser.add_argument("--modes", default="adamw,maxtext_muon,auto")
  parser.add_argument(
    "--routing", default="auto", choices=("auto", "maxtext", "inferred")
  )
  parser.add_argument(
    "--layers", type=int, help="base_num_decoder_layers (default: the model's)"
  )
  parser.add_argument(
    "maxtext_arguments", nargs="*", help="more of MaxText's key=value"
  )
  args = parser.parse_args(argv)
  records = [compile_step(mode, args) for mode in args.modes.split(",")]
  adamw = next(
    (r for r in records if r["mode"] == "adamw" and r["compiled"]), None
  )
  for record in records:
    if adamw and record["compiled"]:
      record["temp_over_adamw"] = record["temp_gib"] / adamw["temp_gib"]
      record["temp_minus_adamw_gib"] = record["temp_gib"] - adamw["temp_gib"]
      if record["peak_gib"] is not None and adamw["peak_gib"] is not None:
        record["peak_minus_adamw_gib"] = record["peak_gib"] - adamw["peak_gib"]
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
  main()
