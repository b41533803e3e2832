"""Runs a function in several local JAX processes that form one global mesh.

    results = local_processes.run("module:function", processes=2, local_devices=4)

Each process is a fresh Python with ``local_devices`` CPU devices, joined to
the others by ``jax.distributed.initialize`` (a coordinator on a free
localhost port, gloo collectives). ``function()`` runs in each; what it returns
(anything ``pickle`` takes, e.g. numpy arrays) comes back as a list indexed by
process. The worker side is this same file run as a script.
"""

import os
import pickle
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from examples.flax_lm.launch_local import free_port  # noqa: E402


def environment(local_devices: int) -> dict:
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=f"--xla_force_host_platform_device_count={local_devices}",
  )
  env["PYTHONPATH"] = os.pathsep.join(
    [ROOT, os.path.join(ROOT, "tests"), env.get("PYTHONPATH", "")]
  )
  return env


def run(
  target: str,
  processes: int = 2,
  local_devices: int = 4,
  timeout: float = 120.0,
) -> list:
  """``target()`` (``"module:function"``) in each process; their results."""
  port = free_port()
  with tempfile.TemporaryDirectory() as folder:
    outputs = [os.path.join(folder, f"{i}.pkl") for i in range(processes)]
    workers = [
      subprocess.Popen(
        [
          sys.executable,
          os.path.abspath(__file__),
          target,
          str(i),
          str(processes),
          str(port),
          outputs[i],
        ],
        env=environment(local_devices),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
      )
      for i in range(processes)
    ]
    logs = []
    try:
      for worker in workers:
        logs.append(worker.communicate(timeout=timeout)[0])
    finally:
      for worker in workers:
        worker.kill()
    for i, worker in enumerate(workers):
      if worker.returncode != 0:
        raise RuntimeError(
          f"process {i} of {target} exited with "
          f"{worker.returncode}:\n{logs[i][-4000:]}"
        )
    results = []
    for path in outputs:
      with open(path, "rb") as f:
        results.append(pickle.load(f))
    return results


def _worker(target, process_id, processes, port, output):
  import importlib  # pylint: disable=import-outside-toplevel

  import jax  # pylint: disable=import-outside-toplevel

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    f"localhost:{port}", int(processes), int(process_id)
  )
  module, function = target.split(":")
  result = getattr(importlib.import_module(module), function)()
  with open(output, "wb") as f:
    pickle.dump(result, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  _worker(*sys.argv[1:])
