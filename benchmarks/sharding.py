"""Bytes moved by collectives per tensor-parallel mode, against optax under GSPMD.

    python benchmarks/sharding.py [--quick]

On 8 simulated CPU devices (a (2, 4) data × model mesh), a tree of kernels
sharded on their input dim (row-parallel) or output dim (column-parallel) gets
one jitted Muon update from each ``muon_tp_mode`` and from
``optax.contrib.muon`` (which has no sharding logic: XLA's GSPMD inserts the
collectives). Bytes are read from the compiled HLO: each collective's result
size, times the trip count of the loop it sits in. Step times are medians of
interleaved rounds.
"""

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(__file__))
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import optax_muon as om  # noqa: E402
from _hlo import collective_bytes  # noqa: E402
from _timing import emit, interleaved, quick_flag  # noqa: E402

def main():
  quick = quick_flag()
  mesh = jax.make_mesh((2, 4), ("data", "model"),
                       axis_types=(AxisType.Auto,) * 2)
  size = (128, 512) if quick else (512, 2048)
  key = iter(jax.random.split(jax.random.key(0), 16))
  cases = {
      "input_dim_sharded": P("model", None),
      "output_dim_sharded": P(None, "model"),
  }
  for case, spec in cases.items():
    params = {f"w{i}": jax.random.normal(next(key), size) for i in range(4)}
    specs = {k: spec for k in params}
    sharded = {k: jax.device_put(v, NamedSharding(mesh, spec))
               for k, v in params.items()}
    labels = {k: "muon" for k in params}
    optimizers = {mode: om.muon(0.02, labels=labels, sharding=om.TensorParallel(
        mesh, mode=mode, specs=specs)) for mode in om.sharding.MODES}
    optimizers["optax.contrib.muon"] = optax.contrib.muon(0.02,
                                                          ns_coeffs="dion")
    record = {"benchmark": "sharding", "case": case, "leaf_shape": list(size),
              "leaves": len(params), "mesh": {"data": 2, "model": 4},
              "collective_bytes": {}, "seconds": {}}
    candidates = {}
    for name, tx in optimizers.items():
      state = jax.jit(tx.init)(sharded)
      step = jax.jit(tx.update)
      hlo = step.lower(sharded, state, sharded).compile().as_text()
      record["collective_bytes"][name] = collective_bytes(hlo)
      candidates[name] = (step, (sharded, state, sharded))
    record["seconds"] = interleaved(candidates, rounds=3 if quick else 5,
                                    warmup=1)
    total = {k: sum(v.values()) for k, v in record["collective_bytes"].items()}
    record["total_bytes"] = total
    record["bytes_over_optax"] = {
        mode: total[mode] / max(total["optax.contrib.muon"], 1)
        for mode in om.sharding.MODES}
    record["time_over_optax"] = {
        mode: record["seconds"][mode] / record["seconds"]["optax.contrib.muon"]
        for mode in om.sharding.MODES}
    emit(record)


if __name__ == "__main__":
  main()
