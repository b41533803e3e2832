"""ZeRO-1: optimizer state also split over the data-parallel axis."""

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from optax_muon._src.base import paths as _paths
from optax_muon._src.base import types
from optax_muon._src.kernels import quantize


def zero1_sharding(
  tree: Any,
  mesh: jax.sharding.Mesh,
  axis: str = "data",
  specs: types.PerLeaf = None,
) -> Any:
  """ZeRO-1: ``NamedSharding``s that also split each leaf over ``axis``.

  Each leaf keeps its spec (from ``specs``, a tree like ``tree``, or
  replicated) and its first unsharded axis that ``axis`` divides is split
  over ``axis``, so optimizer state (Muon's momentum) takes 1/N of the memory
  per data-parallel rank. Use it for ``jax.device_put`` and ``out_shardings``.
  An 8-bit leaf (``om.QuantizedMomentum``) splits its values and scales on
  the same axis, one that both divide, so each shard holds whole blocks.

  Returns:
    A tree like ``tree`` of ``jax.sharding.NamedSharding``.
  """
  if axis not in mesh.axis_names:
    raise ValueError(
      f"axis={axis!r} is not a mesh axis; accepted values: "
      f"{list(mesh.axis_names)}"
    )
  lookup = _paths.PathLookup(
    "specs", specs, PartitionSpec, default=PartitionSpec()
  )
  spec_of = lookup.resolve(tree)
  ways = mesh.shape[axis]

  def split(path, shapes):
    """One sharding for arrays of ``shapes`` (a quantized leaf's values and
    scales differ only in their last axis): the first axis all divide."""
    given = spec_of(path)
    spec = list(given) + [None] * (len(shapes[0]) - len(given))
    for dim in range(len(spec)):
      sizes = [shape[dim] for shape in shapes]
      if spec[dim] is None and all(n % ways == 0 and n > 1 for n in sizes):
        spec[dim] = axis
        break
    return jax.sharding.NamedSharding(mesh, PartitionSpec(*spec))

  def pair(path, values, scales):
    """The one sharding of an 8-bit leaf's values and its scales."""
    if not jnp.shape(values):
      return jax.sharding.NamedSharding(mesh, PartitionSpec())
    return split(path, [jnp.shape(values), jnp.shape(scales)])

  is_quantized = lambda x: isinstance(x, quantize.QuantizedState)
  leaves, treedef = _paths.leaves_with_paths(tree, is_leaf=is_quantized)
  out: list[Any] = []
  for path, leaf in leaves:
    if is_quantized(leaf):
      inner, inner_def = _paths.leaves_with_paths(leaf.values)
      both = [
        pair(path + ("values", *inner_path), values, scales)
        for (inner_path, values), scales in zip(
          inner, inner_def.flatten_up_to(leaf.scales)
        )
      ]
      out.append(quantize.QuantizedState(*[inner_def.unflatten(both)] * 2))
    else:
      out.append(split(path, [jnp.shape(leaf)]))
  return jax.tree.unflatten(treedef, out)
