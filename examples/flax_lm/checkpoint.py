"""Checkpoints with orbax: params, optimizer state, step, data position, seed.

Each checkpoint also records a SHA-256 of its arrays; a restore whose bytes do
not hash to it, or that fails to read, is treated as corrupted and the
previous checkpoint is used, with a warning.
"""

import hashlib
import logging
import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp

_logger = logging.getLogger("flax_lm")


def tree_sha256(tree) -> str:
  """SHA-256 over every leaf's bytes in ``jax.tree`` order."""
  digest = hashlib.sha256()
  for leaf in jax.tree.leaves(tree):
    array = np.asarray(leaf)
    digest.update(str((array.shape, array.dtype.str)).encode())
    digest.update(np.ascontiguousarray(array).tobytes())
  return digest.hexdigest()


class Checkpointer:
  """Atomic save and verified restore of ``(params, opt_state)`` trees."""

  def __init__(self, directory, keep: int = 3):
    self.directory = pathlib.Path(directory).absolute()
    # fail now, not at the first save after a run's worth of steps
    self.directory.mkdir(parents=True, exist_ok=True)
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=False))

  def save(self, step: int, state, meta: dict) -> None:
    leaves = [np.asarray(x) for x in jax.tree.leaves(state)]
    meta = dict(meta, step=step, sha256=tree_sha256(leaves))
    self._manager.save(step, args=ocp.args.Composite(
        arrays=ocp.args.StandardSave(leaves), meta=ocp.args.JsonSave(meta)),
                       force=True)
    self._manager.wait_until_finished()

  def restore_latest(self, like):
    """``(state, meta)`` of the newest good checkpoint, or ``None`` if there
    is no checkpoint.

    Args:
      like: a tree with the structure, shapes and dtypes of the saved state.

    Raises:
      ValueError: there are checkpoints but none of them restores.
    """
    leaves, treedef = jax.tree.flatten(like)
    target = [jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
              for x in leaves]
    for step in sorted(self._manager.all_steps(), reverse=True):
      try:
        restored = self._manager.restore(step, args=ocp.args.Composite(
            arrays=ocp.args.StandardRestore(target),
            meta=ocp.args.JsonRestore()))
        arrays, meta = list(restored["arrays"]), restored["meta"]
        if tree_sha256(arrays) != meta["sha256"]:
          raise ValueError("the arrays do not match their recorded SHA-256")
      except Exception as error:  # pylint: disable=broad-except
        _logger.warning("checkpoint %d in %s is unreadable or corrupted (%s); "
                        "trying the previous one", step, self.directory, error)
        continue
      return jax.tree.unflatten(treedef, arrays), meta
    if self._manager.all_steps():
      raise ValueError(f"no checkpoint in {self.directory} restores (steps "
                       f"{sorted(self._manager.all_steps())} are unreadable or "
                       "corrupted); remove them or start without --resume")
    return None
