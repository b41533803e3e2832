"""Dion2's whole-matrix selection (its ``"global"`` scope, and every
matrix no shard splits): the top slices of each matrix by L1 norm, taken
out, put back, and NorDion2's normalization of the selected neurons."""

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# microsoft/dion's NorMuon normalization: ``U / (√v + 1e-8)``, and the floor
# of the Frobenius norm it rescales by
_NORMUON_EPS = 1e-8


def explicit_sharding(x):
  """The explicit ``NamedSharding`` of ``x`` (``None`` when it has none:
  no mesh, or Auto axes, where XLA's partitioner places the selection)."""
  sharding = jax.typeof(x).sharding
  spec = getattr(sharding, "spec", None)
  explicit = spec is not None and any(a is not None for a in spec)
  return sharding if explicit else None


def replicated(x):
  """``x`` replicated when it is explicitly sharded: the top-k and its
  gather and scatter read whole matrices (the selection is global)."""
  if explicit_sharding(x) is None:
    return x
  return jax.sharding.reshard(
    x, NamedSharding(jax.typeof(x).sharding.mesh, P())
  )


def resharded(x, sharding):
  return x if sharding is None else jax.sharding.reshard(x, sharding)


def selected_count(fraction: float, slices: int) -> int:
  """``max(1, ⌈fraction · slices⌉)``: how many slices a step orthogonalizes."""
  return max(1, math.ceil(fraction * slices))


def selection_axis(fan_in: int, fan_out: int, neurons: bool) -> int:
  """The axis of a ``(matrices, fan_in, fan_out)`` stack whose slices are
  selected: output neurons (``-1``) for NorDion2; for Dion2 the shorter
  axis, output neurons on a tie (microsoft/dion's rows of ``(out, in)``)."""
  return -1 if neurons or fan_out <= fan_in else -2


def select(m: jax.Array, count: int, axis: int):
  """The ``count`` slices of ``m`` along ``axis`` of largest L1 norm: their
  indices ``(matrices, count)`` and the submatrices."""
  norms = jnp.sum(jnp.abs(m.astype(jnp.float32)), axis=-1 if axis == -2 else -2)
  _, index = jax.lax.top_k(norms, count)
  expand = index[:, None, :] if axis == -1 else index[:, :, None]
  return index, jnp.take_along_axis(m, expand, axis=axis)


def scatter(shape, index, selected, axis):
  """A zero array of ``shape`` holding ``selected`` at ``index`` along
  ``axis`` (the inverse of ``select`` off the selected slices)."""
  batch = jnp.arange(shape[0])[:, None]
  out = jnp.zeros(shape, selected.dtype)
  if axis == -1:  # out[b, :, index[b, j]] = selected[b, :, j]
    return out.at[batch, :, index].set(jnp.swapaxes(selected, -1, -2))
  return out.at[batch, index, :].set(selected)


def selected_mask(n: int, index: jax.Array, axis: int) -> jax.Array:
  """Booleans ``(matrices, n, 1)`` or ``(matrices, 1, n)``: the selected."""
  chosen = jnp.zeros(index.shape[:1] + (n,), bool)
  chosen = chosen.at[jnp.arange(index.shape[0])[:, None], index].set(True)
  return chosen[:, None, :] if axis == -1 else chosen[:, :, None]


def normalize_neurons(o, v, index, beta2, summed=lambda x: x, shards=1):
  """NorMuon's step on the selected neurons ``o`` ``(matrices, fan_in, k)``:
  their second moments (taken from ``v`` at ``index``) move toward the mean
  square over ``fan_in``; ``o`` is divided by their root and rescaled to its
  Frobenius norm. Returns ``(normalized o, v with those moments written)``.
  With ``fan_in`` split into ``shards`` (the local scope under FSDP),
  ``summed`` totals a sum over ``fan_in`` across them."""
  o = o.astype(jnp.float32)
  moment = jnp.take_along_axis(v, index[:, None, :], axis=-1)
  square_mean = summed(jnp.sum(jnp.square(o), axis=-2, keepdims=True)) / (
    o.shape[-2] * shards
  )
  moment = moment + (1 - beta2) * (square_mean - moment)
  normalized = o / (jnp.sqrt(moment) + _NORMUON_EPS)
  norm = lambda x: jnp.sqrt(
    summed(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True))
  )
  normalized = normalized * (
    norm(o) / jnp.maximum(norm(normalized), _NORMUON_EPS)
  )
  batch = jnp.arange(v.shape[0])[:, None]
  v = v.at[batch, 0, index].set(moment[:, 0, :])
  return normalized, v
