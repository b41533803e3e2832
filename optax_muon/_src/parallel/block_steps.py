"""MuonBP's two orthogonalizations in one update: the full steps' sharding
or the block steps' (``blockwise``), chosen by the step.

One ``jax.lax.cond`` over the whole update holds every leaf's update at its
end, before any is applied: in a training step's optimizer half on a v5p-8
compile of Llama-3-70B (TP 8) that was 47.4 GiB of temporaries, where the
full step alone needs 8.75. So the choice is made per group of leaves
(``groups``), around the orthogonalization only (the momentum and the AdamW
group are shared), so that a group's updates can leave its branch, and be
applied, before the next group's are made (9.6 GiB there).
"""

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import numpy as np

from optax_muon._src.parallel.tensor_parallel import TensorParallel
from optax_muon._src.parallel.tensor_parallel import resolve

# A group's ``lax.cond`` holds its inputs and its outputs whole, and the TPU
# compiler's conditional code motion can leave the outputs there twice
# (hoisting the branches' layout copies): so a group is at most a quarter
# of the memory budget. v5p-8 compile of Llama-3-8B stacked (TP 8, every
# leaf in one group of the whole budget): 7.13 GiB of temporaries, 3.94
# with half of it, 2.50 with a quarter; one leaf a group, 1.50, moved its
# unstacked twin's collectives into 416 (H100-8: 27.1 ms of them, where a
# quarter of the budget gives 50 and 8.1 ms).
GROUP_SHARE = 4


class Bound(NamedTuple):
  """``BlockSteps`` bound to the updates: the block steps'
  ``TensorParallel`` and the leaves' specs under it."""

  full_step: jax.Array
  tp: TensorParallel
  specs: list


class BlockSteps(NamedTuple):
  """The extra argument (``block_steps=``) that makes an orthogonalization
  and its shape scale MuonBP's: on a step whose ``full_step`` is false,
  each leaf is orthogonalized, and scaled, as ``sharding`` says.

  Attributes:
    full_step: a boolean scalar (traced): whether this step orthogonalizes
      whole matrices, in the orthogonalization's own sharding.
    sharding: the block steps' ``TensorParallel`` settings (bound to the
      updates' types as the full steps' are).
  """

  full_step: jax.Array
  sharding: TensorParallel

  def bind(self, leaves, views, updates) -> Bound | None:
    """The block steps' sharding resolved as the full steps' is
    (``tensor_parallel.resolve``), or None where it names no mesh."""
    tp = resolve(self.sharding, leaves, views)
    if tp is None:
      return None
    return Bound(self.full_step, tp, tp.leaf_specs(updates))


def local_bytes(leaf, spec, tp: TensorParallel) -> int:
  """A global ``leaf``'s bytes on one device under normalized ``spec``."""
  mesh = tp.bound_mesh
  shards = math.prod(mesh.shape[name] for names in spec for name in names)
  return leaf.size * np.dtype(leaf.dtype).itemsize // shards


def groups(sizes: Sequence[int], budget: int) -> list[list[int]]:
  """Consecutive leaves grouped while their ``sizes`` (bytes a device) sum
  to at most ``budget``; a leaf over it is a group alone."""
  found: list[list[int]] = []
  total = 0
  for index, size in enumerate(sizes):
    if found and total + size <= budget:
      found[-1].append(index)
      total += size
    else:
      found.append([index])
      total = size
  return found
