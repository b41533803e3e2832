"""What each process of tests/test_multiprocess.py runs (see multiprocess.py).

A global (2, 4) mesh over 2 processes × 4 devices, laid out two ways: the
data axis across the processes (each process one data row), or the model axis
across them (each model group half on each process). The params are the same
numpy arrays in every process and in the single-process reference.
"""

import logging

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_muon as om

SPLIT = om.SplitQKV(num_heads=4, num_kv_heads=4, head_dim=4)  # 4 groups of 12
MODES = ("blockwise", "duplicated", "distributed", "allgather")


def tree():
  """Stacked layers, a fused QKV kernel, and five same-shape matrices (a
  group larger than the 4-way model axis, for allgather's all-to-all)."""
  rng = np.random.default_rng(0)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  params = {
    "stacked": normal(2, 32, 64),
    "qkv": normal(32, 48),
    **{f"w{i}": normal(32, 64) for i in range(5)},
    "down": normal(64, 32),
  }
  specs = {
    "stacked": P(None, None, "model"),
    "qkv": P(None, "model"),
    **{f"w{i}": P(None, "model") for i in range(5)},
    "down": P("model", None),
  }
  return params, specs


def mesh(layout: str) -> jax.sharding.Mesh:
  """``"data_across"``: process p holds data row p; ``"model_across"``: each
  model group spans both processes."""
  devices = np.array(jax.devices())  # process 0's four, then process 1's
  grid = (
    devices.reshape(2, 4)
    if layout == "data_across"
    else devices.reshape(4, 2).T
  )
  return jax.sharding.Mesh(
    grid, ("data", "model"), axis_types=(AxisType.Auto,) * 2
  )


def put(tree_, specs, mesh_):
  return jax.tree.map(
    lambda x, s: jax.make_array_from_callback(
      x.shape, NamedSharding(mesh_, s), lambda index: x[index]
    ),
    tree_,
    specs,
  )


def optimizer(mesh_, mode, specs, **extra):
  return om.scale_by_muon(
    split_qkv={"qkv": SPLIT},
    sharding=om.TensorParallel(mesh_, mode=mode, specs=specs, **extra),
    dimension_numbers="leading",
  )


def gathered(tree_):
  return jax.tree.map(
    np.asarray, multihost_utils.process_allgather(tree_, tiled=True)
  )


def update(mesh_, mode, fsdp=False, **extra):
  """One update, gathered; ``fsdp``: the stack's and ``down``'s other
  matrix axis sharded over ``data`` too (the stack homed per data rank)."""
  params, specs = tree()
  if fsdp:
    specs = dict(
      specs, stacked=P(None, "data", "model"), down=P("model", "data")
    )
  tx = optimizer(mesh_, mode, specs, **extra)
  sharded = put(params, specs, mesh_)
  updates, _ = jax.jit(tx.update)(sharded, tx.init(sharded))
  return gathered(updates)


def everything():
  """All of the below in one launch (each launch costs seconds)."""
  return {
    "tp_modes": tp_modes(),
    "zero1": zero1_two_steps(),
    "log_records": logging_process(),
  }


def tp_modes():
  """Every mode on both layouts, and the data-axis split of the work."""
  out = {}
  for layout in ("data_across", "model_across"):
    for mode in MODES:
      out[(layout, mode)] = update(mesh(layout), mode)
  out[("data_across", "distribute_over")] = update(
    mesh("data_across"), "duplicated", distribute_over="data"
  )
  for mode in MODES[1:]:
    out[("data_across", "fsdp", mode)] = update(
      mesh("data_across"), mode, fsdp=True
    )
  return out


def zero1_two_steps():
  """ZeRO-1 momentum split over the data axis, which spans the processes:
  two steps, the second reading the split momentum."""
  mesh_ = mesh("data_across")
  params, specs = tree()
  tx = optimizer(mesh_, "duplicated", specs)
  sharded = put(params, specs, mesh_)
  state = tx.init(sharded)
  zero1 = om.zero1_sharding(state[0].mu, mesh_, "data", specs=specs)
  state = (state[0]._replace(mu=jax.device_put(state[0].mu, zero1)),) + state[
    1:
  ]
  step = jax.jit(tx.update)
  outs = []
  for t in range(2):
    grads = put(
      jax.tree.map(lambda x: np.cos(x * (t + 1.0)), params), specs, mesh_
    )
    updates, state = step(grads, state)
    outs.append(gathered(updates))
  splits = {k: v.sharding.spec for k, v in state[0].mu.items()}
  return outs, splits


def logging_process():
  """How many times building an AdamW-matched Muon logged its factor here."""
  records = []
  handler = logging.Handler()
  handler.emit = records.append
  logging.getLogger("optax_muon").addHandler(handler)
  logging.getLogger("optax_muon").setLevel(logging.INFO)
  om.muon(
    0.02, match_adamw_update_rms=True, adam_b1=0.83, dimension_numbers="leading"
  )
  return len(records)
