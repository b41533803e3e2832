"""Optimizer state kept in host memory between steps (``state_memory_kind``).

JAX arrays have memory kinds: ``"device"`` (the accelerator's) and
``"pinned_host"`` (the host's, page-locked for fast transfers; the CPU backend
has both too). With ``state_memory_kind="pinned_host"`` every state leaf
lives in host memory: ``init`` puts it there, and each ``update`` brings each
leaf to the device where it is used and sends the new one back, inside the
same jitted program, where XLA schedules each leaf's transfers on its own.
"""

import typing
from typing import Any

import jax
import optax

from optax_muon._src.base import types

MEMORY_KINDS = typing.get_args(types.MemoryKind)


def check_memory_kind(memory_kind, name: str = "state_memory_kind") -> None:
  if memory_kind is not None and memory_kind not in MEMORY_KINDS:
    raise ValueError(
      f"{name}={memory_kind!r} is not accepted; accepted: None (the "
      f"device's memory) or one of {list(MEMORY_KINDS)}"
    )


def _to(space, tree):
  return jax.tree.map(lambda x: jax.device_put(x, space), tree)


def to_host(tree) -> Any:
  """``tree`` with every array in host memory, each keeping its sharding."""
  return _to(jax.memory.Space.Host, tree)


def to_device(tree) -> Any:
  """``tree`` with every array in device memory, each keeping its sharding."""
  return _to(jax.memory.Space.Device, tree)


def _replicated(params) -> jax.sharding.Sharding | None:
  """A host-memory sharding replicated over the devices of the first
  sharded (concrete) param, or None where there is none."""
  for leaf in jax.tree.leaves(params):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
      return jax.sharding.NamedSharding(
        sharding.mesh, jax.sharding.PartitionSpec(), memory_kind="pinned_host"
      )
  return None


def offload_state(
  inner: optax.GradientTransformation, memory_kind: str | None
) -> optax.GradientTransformationExtraArgs:
  """``inner`` with its state in ``memory_kind`` between steps.

  The numbers are ``inner``'s, bit for bit; only where the state lives
  changes. Initialize outside ``jax.jit`` (as ``nnx.Optimizer`` does), or
  under ``jax.set_mesh``, or with ``out_shardings``: traced without a mesh,
  JAX puts a host array on one device. A jitted ``update`` keeps each
  leaf's sharding, and ``out_shardings`` built from the state's own
  shardings keep its memory kind.

  Args:
    inner: any optax transformation (extra arguments are passed on).
    memory_kind: ``"pinned_host"``, or ``None`` for ``inner`` as it is.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.
  """
  check_memory_kind(memory_kind)
  inner = optax.with_extra_args_support(inner)
  if memory_kind is None:
    return inner

  def init_fn(params):
    state = inner.init(params)
    home = _replicated(params)
    if home is None:
      return to_host(state)
    # leaves made from nothing (step counts) sit on one device: put them on
    # the params' devices, replicated, so one jitted update takes both
    return jax.tree.map(
      lambda x: jax.device_put(
        x,
        home
        if getattr(x, "sharding", home).device_set != home.device_set
        else jax.memory.Space.Host,
      ),
      state,
    )

  def update_fn(updates, state, params=None, **extra_args):
    updates, state = inner.update(
      updates, to_device(state), params, **extra_args
    )
    return updates, to_host(state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
