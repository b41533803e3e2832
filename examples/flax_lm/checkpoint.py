"""Checkpoints with orbax: params, optimizer state, step, data position, seed.

Each checkpoint also records a SHA-256 of its arrays; a restore whose bytes do
not hash to it, or that fails to read, is treated as corrupted and the
previous checkpoint is used, with a warning. With ``best_metric`` the manager
also keeps the checkpoint whose metrics score highest on it (orbax's
``best_fn``), besides the newest ones.
"""

import hashlib
import logging
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from orbax.checkpoint import checkpoint_managers

_logger = logging.getLogger("flax_lm")


def to_host(x) -> np.ndarray:
  """The whole array on this host; across processes, every process gathers
  it (each holds only its shards), so every process must call this."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def place(array: np.ndarray, sharding) -> jax.Array:
  """A host array (the same on every process) as a global array: each
  process puts only the shards its devices hold."""
  return jax.make_array_from_callback(
    np.shape(array), sharding, lambda index: array[index]
  )


def tree_sha256(tree) -> str:
  """SHA-256 over every leaf's bytes in ``jax.tree`` order."""
  digest = hashlib.sha256()
  for leaf in jax.tree.leaves(tree):
    array = to_host(leaf)
    digest.update(str((array.shape, array.dtype.str)).encode())
    digest.update(np.ascontiguousarray(array).tobytes())
  return digest.hexdigest()


class Checkpointer:
  """Atomic save and verified restore of ``(params, opt_state)`` trees."""

  def __init__(self, directory, keep: int = 3, best_metric: str | None = None):
    self.directory = pathlib.Path(directory).absolute()
    # fail now, not at the first save after a run's worth of steps
    self.directory.mkdir(parents=True, exist_ok=True)
    options = dict(max_to_keep=keep)
    if best_metric is not None:
      score = lambda metrics: metrics[best_metric]
      options = dict(
        best_fn=score,
        best_mode="max",
        preservation_policy=checkpoint_managers.AnyPreservationPolicy(
          [
            checkpoint_managers.LatestN(n=keep),
            checkpoint_managers.BestN(get_metric_fn=score, n=1),
          ]
        ),
      )
    self._manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(
        enable_async_checkpointing=False, **options
      ),
    )

  def save(self, step: int, state, meta: dict, metrics=None) -> None:
    leaves = [to_host(x) for x in jax.tree.leaves(state)]
    meta = dict(meta, step=step, sha256=tree_sha256(leaves))
    self._manager.save(
      step,
      args=ocp.args.Composite(
        arrays=ocp.args.StandardSave(leaves), meta=ocp.args.JsonSave(meta)
      ),
      metrics=metrics,
      force=True,
    )
    self._manager.wait_until_finished()

  def best_step(self) -> int | None:
    """The kept step scoring highest on ``best_metric``."""
    return self._manager.best_step()

  def restore(self, step: int, like):
    """``(state, meta)`` of checkpoint ``step``, placed like ``like``.

    Raises:
      ValueError: it does not read, or its arrays do not match their SHA-256.
    """
    leaves, treedef = jax.tree.flatten(like)
    target = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in leaves]
    try:
      restored = self._manager.restore(
        step,
        args=ocp.args.Composite(
          arrays=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()
        ),
      )
    except Exception as error:  # pylint: disable=broad-except
      raise ValueError(
        f"checkpoint {step} in {self.directory} does not read ({error})"
      ) from error
    arrays, meta = list(restored["arrays"]), restored["meta"]
    if tree_sha256(arrays) != meta["sha256"]:
      raise ValueError(
        f"checkpoint {step} in {self.directory}: the arrays do "
        "not match their recorded SHA-256"
      )
    # each array back where ``like``'s is: on its sharding if it was put
    # there, else uncommitted (jit then places it, as the fresh state's)
    arrays = [
      place(a, x.sharding) if getattr(x, "committed", False) else jnp.asarray(a)
      for a, x in zip(arrays, leaves)
    ]
    return jax.tree.unflatten(treedef, arrays), meta

  def restore_latest(self, like):
    """``(state, meta)`` of the newest good checkpoint, or ``None`` if there
    is no checkpoint.

    Args:
      like: a tree with the structure, shapes and dtypes of the saved state.

    Raises:
      ValueError: there are checkpoints but none of them restores.
    """
    for step in sorted(self._manager.all_steps(), reverse=True):
      try:
        return self.restore(step, like)
      except ValueError as error:
        _logger.warning("%s; trying the previous one", error)
    if self._manager.all_steps():
      raise ValueError(
        f"no checkpoint in {self.directory} restores (steps "
        f"{sorted(self._manager.all_steps())} are unreadable or "
        "corrupted); remove them or start without --resume"
      )
    return None
