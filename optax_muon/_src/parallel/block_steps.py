"""MuonBP's two orthogonalizations in one update: the full steps' sharding
or the block steps' (``blockwise``), chosen by the step.

One ``jax.lax.cond`` over the whole update holds every leaf's update at its
end, before any is applied: in a training step's optimizer half on a v5p-8
compile of Llama-3-70B (TP 8) that was 47.4 GiB of temporaries, where the
full step alone needs 8.75. So the choice is made per group of leaves
within the memory budget (``groups``), around the orthogonalization only
(the momentum and the AdamW group are shared): a group's updates leave its
branch and are applied before the next group's are made (17.5 GiB there).
"""

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import numpy as np

from optax_muon._src.kernels import batched
from optax_muon._src.parallel import sharded
from optax_muon._src.parallel.execution import Execution
from optax_muon._src.parallel.tensor_parallel import TensorParallel
from optax_muon._src.parallel.tensor_parallel import resolve


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


def orthogonalize_sharded(
  leaves,
  views,
  tp: TensorParallel,
  specs,
  solver: batched.Solver,
  execution: Execution,
  states=None,
  step=None,
  block: Bound | None = None,
):
  """``sharded.orthogonalize_sharded``, or with ``block`` each group of
  leaves (``groups``, within ``execution.wave_bytes``) under ``tp`` or
  under the block steps', as ``block.full_step`` says."""

  if block is None:
    return sharded.orthogonalize_sharded(
      leaves, views, tp, specs, solver, execution, states, step
    )
  sizes = [local_bytes(x, spec, tp) for x, spec in zip(leaves, specs)]
  outs: list = [None] * len(leaves)
  new_states: list = [None] * len(leaves)
  for group in groups(sizes, execution.wave_bytes):

    def under(each_tp, each_specs, group=group):
      return sharded.orthogonalize_sharded(
        _pick(group, leaves),
        _pick(group, views),
        each_tp,
        _pick(group, each_specs),
        solver,
        execution,
        None if states is None else _pick(group, states),
        step,
      )

    out = jax.lax.cond(
      block.full_step,
      functools.partial(under, tp, specs),
      functools.partial(under, block.tp, block.specs),
    )
    if states is not None:
      out, own = out
      for i, arrays in zip(group, own):
        new_states[i] = arrays
    for i, leaf in zip(group, out):
      outs[i] = leaf
  return outs if states is None else (outs, new_states)


def _pick(group: list[int], items) -> list:
  return [items[i] for i in group]
