"""Dion's distributed scheme: each device keeps its block of every matrix.

microsoft/dion's ``dion_update_fsdp_tp``, for any mesh axes that split a
matrix (FSDP's, tensor parallelism's, both): with ``B`` seen on its tall
side, its rows split over the row axes and its ``n`` columns over the
column axes, and ``Q`` ``(n × r)`` split as the columns::

  P = Σ_columns B Q           # psum over the column axes: rows × r
  P = orth(P)                 # QR of the gathered P, or rcqr's psums
  R = Σ_rows Bᵀ P             # psum over the row axes: n × r
  M ← B − (1 − ef_decay) P Rᵀ;   Q ← R / ‖R‖_columns (psum'd);   P Qᵀ

on each block, in one ``jax.shard_map`` per leaf (``dion_power.dion_step``
with the leaf's ``Shards``). No matrix is gathered: only ``rows × r`` and
``n × r`` travel, and each device keeps ``1 / (row parts · column parts)``
of ``Q``. Split batch axes (stacked layers, experts) stay split.

A leaf is kept split when it is one matrix (no split QKV / gate-up
pieces) and, among its batch axes, its fan-in axes and its fan-out axes
(each group in its flattening order) only the first may be split, so that
each device's block is one block of the ``(matrices, fan_in, fan_out)``
stack; any other split leaf is gathered whole, as Muon's ``distributed``
mode gathers split pieces.
"""

import dataclasses
import math

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_muon._src.kernels import dion_power
from optax_muon._src.parallel.tensor_parallel import TensorParallel
from optax_muon._src.parallel.tensor_parallel import placed_as
from optax_muon._src.views import layout as layout_lib


def _first_only(spec, axes) -> bool:
  """Whether, of ``axes`` (in flattening order), only the first is split."""
  return not any(spec[a] for a in axes[1:])


@dataclasses.dataclass(frozen=True)
class DistributedLeaf:
  """A leaf kept split: its spec (per leaf axis, its mesh axes), its view
  and how its tall matrices are split."""

  spec: tuple
  view: layout_lib.MatrixView
  mesh: jax.sharding.Mesh

  @property
  def turned(self) -> bool:
    return dion_power.is_turned(self.view.fan_in, self.view.fan_out)

  def _axes(self, group) -> tuple[str, ...]:
    return tuple(self.spec[group[0]]) if group else ()

  @property
  def shards(self) -> dion_power.Shards:
    short, long = self.view.reduction_axes, self.view.output_axes
    if not self.turned:
      short, long = long, short
    return dion_power.Shards(self._axes(long), self._axes(short))

  @property
  def partition_spec(self) -> P:
    return P(*(axes or None for axes in self.spec))

  @property
  def q_spec(self) -> P:
    """``Q`` ``(matrices, n, r)``: split as the first batch axis and the
    tall matrix's columns."""
    return P(
      self._axes(self.view.batch_axes) or None,
      self.shards.column_axes or None,
      None,
    )

  def placed(self, q: jax.Array) -> jax.Array:
    return jax.device_put(q, NamedSharding(self.mesh, self.q_spec))


def plan(
  view: layout_lib.MatrixView, spec, tp: TensorParallel
) -> DistributedLeaf | None:
  """The leaf's distributed plan, or ``None`` when it is not split or must
  be gathered (see the module docstring)."""
  if not any(spec):
    return None
  if view.widths or not all(
    _first_only(spec, group)
    for group in (view.batch_axes, view.reduction_axes, view.output_axes)
  ):
    return None
  assert isinstance(tp.mesh, jax.sharding.Mesh)  # dion.check_bound
  return DistributedLeaf(tuple(spec), view, tp.mesh)


def step(
  leaf: DistributedLeaf,
  momentum,
  gradient,
  q,
  *,
  rank_step,
  budget: int,
):
  """One Dion step of a split leaf: ``(direction, new momentum, new Q)``,
  split as the momentum and ``Q``. ``rank_step(tall, q, shards)`` is
  ``dion_step`` with the transform's settings."""
  shards = leaf.shards

  def body(m, g, q):
    local = dataclasses.replace(leaf.view, shape=m.shape)
    (piece,) = local.to_matrices(m + g.astype(m.dtype))
    stack = dion_power.tall(piece, leaf.turned)
    rows, n = stack.shape[-2:]
    # Householder QR gathers P: the whole rows × r, twice (P and its basis)
    whole_rows = rows * math.prod(leaf.mesh.shape[a] for a in shards.row_axes)
    per_matrix = dion_power.wave_bytes(rows, n, q.shape[-1]) + 8 * (
      whole_rows * q.shape[-1]
    )

    direction, kept, q = dion_power.in_waves(
      rank_step, stack, q, budget, per_matrix, shards
    )
    back = lambda x: local.from_matrices([dion_power.untall(x, leaf.turned)])
    return back(direction), back(kept), q

  spec = leaf.partition_spec
  return jax.shard_map(
    body,
    mesh=leaf.mesh,
    in_specs=(spec, spec, leaf.q_spec),
    out_specs=(spec, spec, leaf.q_spec),
    check_vma=False,
  )(*placed_as(leaf.mesh, (momentum, spec), (gradient, spec), (q, leaf.q_spec)))
