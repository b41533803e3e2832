"""Records microsoft/dion's Dion2 and NorDion2 with ``selection_scope="local"``
on a row-sharded mesh, for tests/test_dion2_local.py.

Run once, with torch and a checkout of microsoft/dion (the tests need
neither)::

    pip install torch==2.13.0 numpy
    git clone https://github.com/microsoft/dion /tmp/dion_src
    python tests/data/record_dion2_local.py /tmp/dion_src

The weights and gradients of ``record_dion2.py`` (torch's ``(out, in)``:
64×128, 128×64, 96×96), each a ``DTensor`` sharded by rows (``Shard(0)``,
FSDP2's layout) over a one-dimensional CPU ``DeviceMesh`` of 2 and of 4
processes (gloo); five ``optimizer.step()`` calls in float32 (the
``record_dion2.py`` way: dion's bfloat16 read as float32, its Polar Express
in float32), for both settings of each. Each rank selects its own top rows
(NorDion2: its own output neurons, normalized on the rank), and only those
travel in the all-to-all. Writes ``dion2_local.npz`` (final weights,
momenta and NorDion2's neuron variances, gathered) and ``dion2_local.json``.
"""

import json
import os
import pathlib
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))
import record_dion2  # noqa: E402

WORLD_SIZES = (2, 4)
SETTINGS = record_dion2.SETTINGS


def _worker(rank, world_size, dion_path, port, out_dir):
  from torch.distributed.device_mesh import init_device_mesh
  from torch.distributed.tensor import Shard
  from torch.distributed.tensor import distribute_tensor

  os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
  dist.init_process_group("gloo", rank=rank, world_size=world_size)
  torch.compile = record_dion2.eager
  sys.path.insert(0, dion_path)
  import dion
  from dion import dion2 as dion2_module
  from dion import nordion2 as nordion2_module
  from dion import polar_express

  mesh = init_device_mesh("cpu", (world_size,))
  weights, grads, _ = record_dion2.inputs()
  dion2_module.torch = record_dion2._Float32ForBfloat16()
  nordion2_module.torch = record_dion2._Float32ForBfloat16()
  results = {}
  for setting, (name, kwargs) in SETTINGS.items():
    kwargs = dict(
      kwargs,
      selection_scope="local",
      newton_schulz_func=record_dion2.polar_express_fp32(
        polar_express._POLAR_EXPRESS_COEFFS
      ),
    )
    params = [
      torch.nn.Parameter(distribute_tensor(torch.tensor(w), mesh, [Shard(0)]))
      for w in weights
    ]
    optimizer = getattr(dion, name)(params, distributed_mesh=mesh, **kwargs)
    for step in range(record_dion2.STEPS):
      for p, g in zip(params, grads[step]):
        p.grad = distribute_tensor(torch.tensor(g), mesh, [Shard(0)])
      optimizer.step()
    for i, p in enumerate(params):
      results[f"{setting}/world_{world_size}/final_{i}"] = (
        p.detach().full_tensor().numpy().copy()
      )
      for key, state in optimizer.state[p].items():
        if key in ("momentum", "variance_neuron"):
          results[f"{setting}/world_{world_size}/{key}_{i}"] = (
            state.full_tensor().numpy().copy()
          )
  if rank == 0:
    np.savez(os.path.join(out_dir, f"world_{world_size}.npz"), **results)
  dist.destroy_process_group()


def main(dion_path):
  arrays = {}
  with tempfile.TemporaryDirectory() as out_dir:
    for world_size in WORLD_SIZES:
      mp.spawn(
        _worker,
        args=(world_size, dion_path, 29600 + world_size, out_dir),
        nprocs=world_size,
      )
      arrays.update(np.load(os.path.join(out_dir, f"world_{world_size}.npz")))
  np.savez_compressed(HERE / "dion2_local.npz", **arrays)
  about = {
    "conventions": (
      "the inputs of dion2.npz (record_dion2.py); each weight a DTensor "
      "sharded by rows (Shard(0), torch's (out, in)) over world_size gloo "
      "ranks; final_i, momentum_i (and NorDion2's variance_neuron_i, "
      "torch's (out, 1)) gathered after 5 optimizer.step() calls with "
      "selection_scope='local' in float32"
    ),
    "world_sizes": list(WORLD_SIZES),
    "settings": {
      k: {"optimizer": n, **kw, "selection_scope": "local"}
      for k, (n, kw) in SETTINGS.items()
    },
    "torch": torch.__version__,
    "dion_commit": record_dion2.dion_commit(dion_path),
  }
  (HERE / "dion2_local.json").write_text(json.dumps(about, indent=1) + "\n")


if __name__ == "__main__":
  main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/dion_src")
