"""Starts N local processes of one multi-process training run, for trying it.

    python -m examples.flax_lm.launch_local 2 --mesh data=2,model=4 \\
        optim.optimizer=muon train.out_dir=runs/two-processes

Each process gets ``--num-processes N --process-id I --coordinator
localhost:PORT`` (a free port) and, on a CPU, its share of the mesh's devices
(``--local-devices``, default 8 / N). Only process 0 prints and writes logs;
the exit code is the first failing process's. On a cluster, start one process
per host with the scheduler instead (docs/scaling.md).
"""

import argparse
import os
import socket
import subprocess
import sys


def free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("localhost", 0))
    return sock.getsockname()[1]


def start(
  num_processes: int,
  train_args,
  local_devices: int | None = None,
  port: int | None = None,
  environ=None,
  **popen,
) -> list[subprocess.Popen]:
  """The N ``examples.flax_lm.train`` processes, started (``environ``:
  their environment, default this one's; ``popen``: ``subprocess.Popen``'s)."""
  port = port or free_port()
  local_devices = local_devices or max(8 // num_processes, 1)
  environ = os.environ if environ is None else environ
  env = dict(
    environ,
    JAX_PLATFORMS=environ.get("JAX_PLATFORMS", "cpu"),
    XLA_FLAGS=f"--xla_force_host_platform_device_count={local_devices}",
  )
  return [
    subprocess.Popen(
      [
        sys.executable,
        "-m",
        "examples.flax_lm.train",
        *train_args,
        "--num-processes",
        str(num_processes),
        "--process-id",
        str(i),
        "--coordinator",
        f"localhost:{port}",
      ],
      env=env,
      **popen,
    )
    for i in range(num_processes)
  ]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("num_processes", type=int)
  parser.add_argument(
    "--local-devices", type=int, help="CPU devices per process (default 8 / N)"
  )
  args, train_args = parser.parse_known_args(argv)
  if args.num_processes < 1:
    parser.error(f"num_processes={args.num_processes} must be >= 1")
  processes = start(args.num_processes, train_args, args.local_devices)
  codes = [process.wait() for process in processes]
  return next((code for code in codes if code), 0)


if __name__ == "__main__":
  sys.exit(main())
