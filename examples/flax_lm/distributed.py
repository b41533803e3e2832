"""A run over a mesh and over several processes: ``--mesh`` parsed, this
process joined to the others (``launch_local.py`` starts them on one machine,
a scheduler on a cluster), and each global batch split over the data axis."""

import math
import os

import jax

from examples.flax_lm import checkpoint as checkpoint_lib

# set by cluster schedulers that start one process per host (SLURM, Open MPI,
# MPICH/PMI) or by whoever sets JAX's own variable
CLUSTER_VARIABLES = (
  "SLURM_NTASKS",
  "OMPI_COMM_WORLD_SIZE",
  "PMI_SIZE",
  "JAX_COORDINATOR_ADDRESS",
)


def parse_mesh(text: str) -> jax.sharding.Mesh:
  """``"data=2,model=4"`` as a mesh of Auto axes over the local devices."""
  try:
    sizes = {
      k.strip(): int(v) for k, v in (p.split("=") for p in text.split(","))
    }
  except ValueError:
    raise ValueError(f"--mesh {text!r}: expected e.g. data=2,model=4") from None
  if set(sizes) - {"data", "model"} or not sizes:
    raise ValueError(f"--mesh {text!r}: accepted axes are data and model")
  needed = math.prod(sizes.values())
  if needed > jax.device_count():
    raise ValueError(
      f"--mesh {text!r} needs {needed} devices and {jax.device_count()} are "
      "present; on a CPU set XLA_FLAGS=--xla_force_host_platform_device_count"
      f"={needed} before starting Python"
    )
  return jax.make_mesh(
    tuple(sizes.values()),
    tuple(sizes),
    axis_types=(jax.sharding.AxisType.Auto,) * len(sizes),
  )


def start_processes(
  num_processes, process_id, coordinator, environ=os.environ
) -> bool:
  """Joins this process to a multi-process run; whether it did.

  With the three flags, ``jax.distributed.initialize`` gets them (CPU devices
  talk through gloo). Without them, it is called with no arguments, so that
  JAX reads the cluster's settings, only where a scheduler says there is more
  than one process; elsewhere the run is one process.
  """
  given = [num_processes, process_id, coordinator]
  if any(v is not None for v in given):
    if any(v is None for v in given):
      raise ValueError(
        "--num-processes, --process-id and --coordinator go "
        "together (or none of them: a cluster's own settings)"
      )
    if not 0 <= process_id < num_processes:
      raise ValueError(
        f"--process-id={process_id} must be in "
        f"[0, --num-processes={num_processes})"
      )
  elif all(environ.get(name, "1") in ("", "1") for name in CLUSTER_VARIABLES):
    return False
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # None arguments: JAX reads the cluster's settings
  jax.distributed.initialize(coordinator, num_processes, process_id)
  return True


def batch_placer(mesh):
  """How a host batch becomes the step's input: split over the mesh's data
  axis (every process reads the same global batch and puts only its own
  rows), or left as it is on one device."""
  if mesh is None:
    if jax.process_count() > 1:
      raise ValueError(
        f"a run over {jax.process_count()} processes needs "
        "--mesh spanning their devices, e.g. --mesh data=2,model=4"
      )
    return lambda batch: batch
  rows = jax.sharding.NamedSharding(
    mesh,
    jax.sharding.PartitionSpec("data" if "data" in mesh.axis_names else None),
  )
  return lambda batch: tuple(checkpoint_lib.place(x, rows) for x in batch)
