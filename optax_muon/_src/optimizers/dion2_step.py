"""One Dion2 / NorDion2 step over a tree's leaves (``scale_by_dion2``'s
settings, checked there): each leaf selected whole (``dion2_selection``:
the global scope, and every leaf no shard splits) or, under a
``TensorParallel`` with the local scope, by each of its shards
(``dion2_local``), the selections orthogonalized together."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from optax_muon._src.base import types
from optax_muon._src.kernels import batched
from optax_muon._src.kernels import dion2_selection as selection
from optax_muon._src.kernels import shape_scale
from optax_muon._src.parallel import dion2_local
from optax_muon._src.parallel.execution import Execution
from optax_muon._src.parallel.tensor_parallel import TensorParallel
from optax_muon._src.transforms import orthogonalize as orthogonalize_lib
from optax_muon._src.views.matrix_views import Views


@dataclasses.dataclass(frozen=True, eq=False)
class Dion2Step:
  """One Dion2 / NorDion2 step over a tree's leaves, from the settings
  ``scale_by_dion2`` checked: each leaf selected whole (``global_step``)
  or, split under ``sharding`` (the local scope; ``None`` for the global
  one), by each shard (``local_step``)."""

  fraction: types.Numeric
  ef_decay: types.Numeric
  normalize_neurons: bool
  beta2: types.Numeric
  scale_mode: str
  extra: types.Numeric
  sharding: TensorParallel | None
  solver: batched.Solver  # the selections' Newton–Schulz
  memory_budget: int | None
  # the whole-matrix selections' orthogonalization, built (and its settings
  # checked) when the transform is
  whole: optax.GradientTransformation = dataclasses.field(init=False)

  def __post_init__(self):
    whole = self.orthogonalize(dimension_numbers="leading", sharding=None)
    object.__setattr__(self, "whole", whole)

  def orthogonalize(
    self, dimension_numbers: types.PerLeaf, sharding: TensorParallel | None
  ) -> optax.GradientTransformation:
    """Newton–Schulz on stacks of selected submatrices, seen through
    ``dimension_numbers`` and run over ``sharding``."""
    return orthogonalize_lib.orthogonalizer(
      self.solver,
      Views(dimension_numbers=dimension_numbers),
      Execution(sharding=sharding, memory_budget=self.memory_budget),
    ).transform

  def plans(self, tree, views):
    """Per leaf of ``tree`` (params or updates), its
    ``dion2_local.LocalLeaf`` (``None``: selected whole)."""
    if self.sharding is None:
      return [None] * len(views)
    return [
      dion2_local.plan(
        view, spec, self.sharding, self.fraction, self.normalize_neurons
      )
      for (_, _, view), spec in zip(views, self.sharding.leaf_specs(tree))
    ]

  def placed(self, variance, plan):
    """NorDion2's variance of a locally selected leaf, split as its
    selected neurons from the start (the state keeps one sharding)."""
    if plan is None:
      return variance
    return jax.device_put(
      variance, NamedSharding(self.sharding.mesh, plan.variance_spec)
    )

  def scaled(self, o, fan_in, fan_out):
    """``o`` times the whole matrix's shape factor and ``extra`` (on the
    selected slices, before they are put back)."""
    factor = shape_scale.scale_factor(fan_out, fan_in, self.scale_mode)
    return o * jnp.asarray(factor, o.dtype) * self.extra

  def __call__(self, plans, momenta, gradients, views, variances):
    """``(directions, new momenta, new variances)``, a list per leaf."""
    whole = [i for i, plan in enumerate(plans) if plan is None]
    split = [i for i, plan in enumerate(plans) if plan is not None]
    pick = lambda items, where: [items[i] for i in where]
    outputs = {}
    if whole:
      summed = [
        m + g.astype(m.dtype)
        for m, g in zip(pick(momenta, whole), pick(gradients, whole))
      ]
      results = self.global_step(
        [
          (selection.replicated(m), v)
          for m, v in zip(summed, pick(views, whole))
        ],
        pick(variances, whole),
        [selection.explicit_sharding(m) for m in summed],
      )
      outputs.update(zip(whole, zip(*results)))
    if split:
      results = self.local_step(
        *(pick(x, split) for x in (plans, momenta, gradients, views, variances))
      )
      outputs.update(zip(split, zip(*results)))
    per_leaf = [outputs[i] for i in range(len(plans))]
    return tuple(list(column) for column in zip(*per_leaf))

  def global_step(self, views, variances, specs):
    """Whole-matrix selection of every leaf (``views``: ``(momentum
    replicated, its view)``): ``(directions, new momenta, new variances)``,
    resharded as ``specs``."""
    selections, submatrices = [], []
    for m, view in views:
      for piece in view.to_matrices(m):
        axis = selection.selection_axis(
          piece.shape[-2], piece.shape[-1], self.normalize_neurons
        )
        count = selection.selected_count(self.fraction, piece.shape[axis])
        index, sub = selection.select(piece, count, axis)
        selections.append((piece, index, axis))
        submatrices.append(sub)
    # the selected submatrices are whole matrices of their own (replicated:
    # the global scope's gathered matrices): a stack
    # (matrices, fan_in or k, k or fan_out) each, its leading axis a batch
    orthogonal, _ = self.whole.update(submatrices, optax.EmptyState())
    results = iter(zip(selections, orthogonal))
    directions, new_momenta, new_variances = [], [], []
    for (m, view), leaf_variance, spec in zip(views, variances, specs):
      pieces, decayed, moments = [], [], []
      for i, _ in enumerate(view.matrix_shapes):
        (piece, index, axis), o = next(results)
        if self.normalize_neurons:
          o, v = selection.normalize_neurons(
            o, leaf_variance[i], index, self.beta2
          )
          moments.append(v)
        o = self.scaled(o.astype(piece.dtype), *piece.shape[-2:])
        pieces.append(selection.scatter(piece.shape, index, o, axis))
        chosen = selection.selected_mask(piece.shape[axis], index, axis)
        decay = jnp.asarray(self.ef_decay, piece.dtype)
        decayed.append(jnp.where(chosen, decay * piece, piece))
      directions.append(selection.resharded(view.from_matrices(pieces), spec))
      new_momenta.append(selection.resharded(view.from_matrices(decayed), spec))
      new_variances.append(tuple(moments))
    return directions, new_momenta, new_variances

  def local_step(self, plans, momenta, gradients, views, variances):
    """Each shard's own selection (``dion2_local``): ``(directions, new
    momenta, new variances)``, sharded as the momenta."""
    mesh = self.sharding.mesh
    selections = [
      dion2_local.select(plan, m, g, self.ef_decay, mesh)
      for plan, m, g in zip(plans, momenta, gradients)
    ]
    orthogonal, _ = self.orthogonalize(
      dimension_numbers=[plan.dimension_numbers() for plan in plans],
      sharding=dataclasses.replace(
        self.sharding, specs=[plan.partition_spec for plan in plans]
      ),
    ).update([selected for selected, _, _ in selections], optax.EmptyState())
    directions, new_variances = [], []
    for plan, o, (_, _, index), m, view, variance in zip(
      plans, orthogonal, selections, momenta, views, variances
    ):
      scale = functools.partial(
        self.scaled, fan_in=view.fan_in, fan_out=view.fan_out
      )
      if self.normalize_neurons:
        (v,) = variance  # one matrix piece: local leaves have no splits
        d, v = dion2_local.scatter(
          plan, o, index, m, mesh, scale, v, self.beta2
        )
        new_variances.append((v,))
      else:
        d = dion2_local.scatter(plan, o, index, m, mesh, scale)
        new_variances.append(())
      directions.append(d)
    return (
      directions,
      [decayed for _, decayed, _ in selections],
      new_variances,
    )
