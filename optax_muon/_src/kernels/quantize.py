"""8-bit blockwise storage for optimizer state (``om.QuantizedMomentum``).

A leaf is stored as int8 values of its own shape and one float32 scale per
block of ``block`` consecutive entries along its last axis (the block's
largest magnitude): ``x ≈ values · scale / 127``. Blocks follow the leaf's
last axis, so a shard of any other axis holds whole blocks; where the last
axis itself is sharded, the block is shrunk to a divisor of the shard's width
(read off the parameter's sharding at ``init``), so quantizing never needs a
value from another device.

In optimizer state a tree of such leaves is kept as a ``QuantizedState``: one
tree of values and one of scales, each shaped like the params, as optax keeps
Adam's two moments. Every leaf of the state is then an array, which is what
``flax.nnx.Optimizer`` can store: it wraps each leaf of a param-shaped tree in
a ``Variable``, and a ``Variable`` holding a pair of arrays comes back from
``nnx.update`` as a dict.
"""

import dataclasses
import math
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp

LEVELS = 127  # int8's symmetric range, [-127, 127]


@dataclasses.dataclass(frozen=True)
class QuantizedMomentum:
  """Store the momentum as int8 with one float32 scale per block.

  Pass it as ``mu_dtype=`` (``om.momentum(dtype=...)``): the buffer is
  dequantized, updated in float32 and requantized (absmax, round to
  nearest) inside each update; the update itself is computed from the
  float32 momentum. State bytes per entry: ``1 + 4 / block_size`` (0.254×
  float32's at 256).

  Attributes:
    bits: bits per entry; 8 (int8) is the one accepted.
    block_size: the widest block, in entries along the last axis. The
      block used is ``block_size`` where it divides the axis; else the
      largest divisor of the axis's width below it, if that is at least a
      quarter of it (``block_size=100`` on a 256-wide axis: blocks of 64),
      else ``block_size`` with the last block zero-padded (257 wide: 256
      and 1 padded). A sharded last axis uses the largest divisor of its
      shard's width, so a block never spans two devices. The state's
      ``scales`` (one per block) show the blocks used.
  """

  bits: int = 8
  block_size: int = 256

  def __post_init__(self):
    if self.bits != 8 or isinstance(self.bits, bool):
      raise ValueError(
        f"QuantizedMomentum(bits={self.bits!r}) is not accepted; accepted "
        "bits: [8] (int8 values with a float32 scale per block)"
      )
    if (
      isinstance(self.block_size, bool)
      or not isinstance(self.block_size, int)
      or self.block_size < 1
    ):
      raise ValueError(
        f"QuantizedMomentum(block_size={self.block_size!r}) is not accepted; "
        "accepted: a positive int (entries per block, e.g. 256)"
      )


class QuantizedArray(NamedTuple):
  """One leaf in 8 bits: ``values · scales / 127`` blockwise."""

  values: jax.Array  # int8, the leaf's shape
  scales: jax.Array  # float32, leaf.shape[:-1] + (blocks,)


class QuantizedState(NamedTuple):
  """A tree of 8-bit leaves as two trees shaped like the params: the int8
  ``values`` and the float32 ``scales`` of each leaf."""

  values: Any
  scales: Any


def _last_axis_shards(x) -> int:
  """How many ways ``x``'s last axis is split, from its sharding (a
  concrete array's, or an explicit-mesh tracer's); 1 when unknown."""
  sharding = getattr(x, "sharding", None)
  if sharding is None:
    try:
      sharding = jax.typeof(x).sharding
    except (AttributeError, TypeError):
      return 1
  spec = getattr(sharding, "spec", None)
  mesh = getattr(sharding, "mesh", None)
  if spec is None or mesh is None or len(spec) < jnp.ndim(x) or not x.ndim:
    return 1
  names = spec[x.ndim - 1]
  if names is None:
    return 1
  names = names if isinstance(names, tuple) else (names,)
  return math.prod(mesh.shape[name] for name in names)


def block_width(width: int, block_size: int, shards: int = 1) -> int:
  """The block of a last axis of ``width`` entries split ``shards`` ways.

  Sharded: the largest divisor of the shard's width up to ``block_size``
  (a block never spans two shards). Unsharded: ``block_size`` where it
  divides the width, else the largest divisor up to it when that is at
  least a quarter of it, else ``block_size`` with the last block padded.
  """
  local = width // shards if shards > 1 and width % shards == 0 else width
  fits = max(d for d in range(1, min(local, block_size) + 1) if local % d == 0)
  if shards > 1 or local <= block_size or 4 * fits >= block_size:
    return fits
  return block_size


def _blocks(width: int, block: int) -> int:
  return -(-width // block)


def stored_block(width: int, blocks: int, block_size: int) -> int:
  """The block a stored leaf was quantized with, read off its shapes: the
  blocks tile the axis exactly, or (padded) are ``block_size`` wide."""
  return width // blocks if width % blocks == 0 else block_size


def _as_blocks(x: jax.Array, block: int) -> jax.Array:
  """``x`` as ``(..., blocks, block)``, the last block zero-padded."""
  width = x.shape[-1]
  pad = _blocks(width, block) * block - width
  if pad:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  return x.reshape(*x.shape[:-1], -1, block)


def _from_blocks(x: jax.Array, width: int) -> jax.Array:
  return x.reshape(*x.shape[:-2], -1)[..., :width]


def init(param, config: QuantizedMomentum) -> QuantizedArray:
  """Zeros for ``param``, with blocks that fit its shards."""
  if jnp.issubdtype(jnp.result_type(param), jnp.complexfloating):
    raise ValueError(
      "mu_dtype=QuantizedMomentum stores real momentum, but a leaf is "
      f"{jnp.result_type(param)}; accepted for complex params: a float "
      "mu_dtype or None"
    )
  shape = jnp.shape(param) or (1,)
  block = block_width(shape[-1], config.block_size, _last_axis_shards(param))
  # from the param itself, so that both keep its sharding
  zeros = jnp.zeros_like(param, dtype=jnp.float32).reshape(shape)
  return QuantizedArray(
    values=jnp.zeros_like(param, dtype=jnp.int8),
    scales=_as_blocks(zeros, block)[..., 0],
  )


def init_tree(params, config: QuantizedMomentum) -> QuantizedState:
  """Zeros for every leaf of ``params``, as a ``QuantizedState``."""
  return QuantizedState(
    values=jax.tree.map(lambda p: init(p, config).values, params),
    scales=jax.tree.map(lambda p: init(p, config).scales, params),
  )


def leaves(state: QuantizedState, treedef) -> list[QuantizedArray]:
  """The ``QuantizedArray`` of each leaf of ``treedef`` (the params')."""
  values = treedef.flatten_up_to(state.values)
  scales = treedef.flatten_up_to(state.scales)
  return [QuantizedArray(v, s) for v, s in zip(values, scales)]


def from_leaves(treedef, stored: list[QuantizedArray]) -> QuantizedState:
  """The ``QuantizedState`` of ``treedef``'s leaves, one ``QuantizedArray``
  each (the inverse of ``leaves``)."""
  return QuantizedState(
    values=treedef.unflatten([q.values for q in stored]),
    scales=treedef.unflatten([q.scales for q in stored]),
  )


def dequantize(q: QuantizedArray, config: QuantizedMomentum) -> jax.Array:
  """The float32 leaf ``q`` stores."""
  shape = q.values.shape or (1,)
  block = stored_block(shape[-1], q.scales.shape[-1], config.block_size)
  values = _as_blocks(q.values.reshape(shape).astype(jnp.float32), block)
  out = values * (q.scales[..., None] / LEVELS)
  return _from_blocks(out, shape[-1]).reshape(q.values.shape)


def quantize(
  x: jax.Array, like: QuantizedArray, config: QuantizedMomentum
) -> QuantizedArray:
  """``x`` in ``like``'s blocks: the scale is each block's largest
  magnitude, the values ``round(127 x / scale)`` (zero for a zero block)."""
  shape = x.shape or (1,)
  block = stored_block(shape[-1], like.scales.shape[-1], config.block_size)
  blocks = _as_blocks(x.reshape(shape).astype(jnp.float32), block)
  scales = jnp.max(jnp.abs(blocks), axis=-1)
  safe = jnp.where(scales > 0, scales, 1.0)[..., None]
  values = jnp.clip(jnp.round(blocks / safe * LEVELS), -LEVELS, LEVELS)
  values = _from_blocks(values.astype(jnp.int8), shape[-1])
  return QuantizedArray(values=values.reshape(x.shape), scales=scales)


def bound(q: QuantizedArray, config: QuantizedMomentum) -> jax.Array:
  """The largest rounding error of each entry ``q`` stores: half a step,
  ``scale / 254``, as an array of the leaf's shape."""
  return dequantize(
    QuantizedArray(jnp.ones_like(q.values), q.scales / 2), config
  )
