"""The orthogonalize transform: Newton–Schulz on every matrix of the updates.

Leaves are viewed as batches of matrices (``views.layout``), the matrices run
in waves within the memory budget (``parallel.waves``), same-shape ones
batched (``kernels.batched``), or over a mesh (``parallel.tensor_parallel``),
then put back.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_muon._src.base import paths as _paths
from optax_muon._src.base import types
from optax_muon._src.kernels import batched
from optax_muon._src.kernels import matrices
from optax_muon._src.parallel import sharded
from optax_muon._src.parallel import waves
from optax_muon._src.parallel.execution import Execution
from optax_muon._src.parallel.tensor_parallel import TensorParallel
from optax_muon._src.parallel.tensor_parallel import check_blocks
from optax_muon._src.parallel.tensor_parallel import resolve
from optax_muon._src.views.matrix_views import Views


def orthogonalize(
  *,
  coefficients: types.Coefficients = "quintic",
  steps: types.Steps = 5,
  precision: types.Precision = "highest",
  method: types.Method = "standard",
  dimension_numbers: types.PerLeaf = None,
  split_qkv: types.PerLeaf = None,
  split_gate_up: types.PerLeaf = None,
  sharding: TensorParallel | None = None,
  eps: types.Numeric = 1e-30,
  preconditioning: types.Preconditioning = "frobenius",
  add_eps: bool = False,
  memory_budget: int | None = None,
) -> optax.GradientTransformation:
  r"""Replaces each matrix of the updates by its Newton–Schulz polar factor.

  Each leaf is viewed as a batch of matrices ``G`` (``fan_in × fan_out``; see
  ``layout.matrix_view``) and every ``G`` becomes ``newton_schulz(G) ≈ U Vᵀ``
  for ``G = U Σ Vᵀ``. Same-shape matrices (after turning each to its wide
  orientation) run in batched stacks no larger than the largest matrix; the
  result equals doing them one at a time.

  The work runs in waves whose live bytes per device (gathered inputs,
  Newton–Schulz workspace, results) stay within ``memory_budget``
  (``optax_muon._src.parallel.waves``): stacked leaves (scanned layers, experts) are split
  along their batch axes, and the waves are ordered in the program. A single
  matrix larger than the budget runs alone; a tree within it is one wave.

  Args:
    coefficients: a name in ``COEFFICIENT_SETS`` or a list of ``(a, b, c)``.
    steps: Newton–Schulz steps, an int ≥ 1 (may be traced).
    precision: ``"highest"``, ``"high"``, ``"medium"``, ``"fp16"`` or
      ``"bf16"`` (see ``newton_schulz``).
    method: ``"standard"`` or ``"gram"`` (not with ``precision="bf16"``): Gram Newton–Schulz (iterate on the
      m×m Gram matrix, restart once after step 1) for the groups whose aspect
      ratio is at least 2.5, where it saves FLOPs (also with ``steps``
      traced); the standard form elsewhere.
    dimension_numbers: ``None``, an ``optax.contrib.MuonDimensionNumbers``
      for every leaf, a tree of them, or a callable of the params.
    split_qkv: ``None``, a ``SplitQKV``, a tree of them or a callable.
    split_gate_up: ``None``, a ``SplitGateUp``, a tree of them or a callable.
    sharding: a ``TensorParallel`` to run over a mesh; ``None``: the mesh
      and specs the leaves' types carry where they are on a mesh with
      Explicit axes (``tensor_parallel.from_types``: ``mode="auto"`` over the
      exact modes), else each device works on what it holds.
    eps: floor of the norm used to normalize.
    preconditioning: how each matrix is scaled before the iteration:
      ``"frobenius"`` (default), ``"spectral"``, ``"aol"`` or ``"schatten"``
      (see ``newton_schulz.precondition``; ``"spectral"`` not with
      ``sharding.mode="distributed"``).
    add_eps: add ``eps`` to the Frobenius or spectral norm instead of
      flooring it, as ``optax.contrib.muon`` does.
    memory_budget: bytes per device of orthogonalization work in flight, a
      positive int; ``None``: ``waves.DEFAULT_MEMORY_BUDGET`` (2 GiB).

  Returns:
    A stateless ``optax.GradientTransformation``.

  References:
    Jordan et al., `Muon: An optimizer for hidden layers in neural networks
    <https://kellerjordan.github.io/posts/muon/>`_, 2024
  """
  return orthogonalizer(
    batched.Solver(
      coefficients=coefficients,
      steps=steps,
      precision=precision,
      method=method,
      preconditioning=preconditioning,
      eps=eps,
      add_eps=add_eps,
    ),
    Views(
      dimension_numbers=dimension_numbers,
      split_qkv=split_qkv,
      split_gate_up=split_gate_up,
    ),
    Execution(sharding=sharding, memory_budget=memory_budget),
  ).transform


class Orthogonalizer(NamedTuple):
  """``orthogonalize``'s transform and its ``run(updates, states=None,
  step=None, block_steps=None)``, which the fused momentum
  (``muon_direction``) calls with the momentum's state so that each leaf's
  momentum is computed in its wave. Both take MuonBP's ``block_steps``
  (``parallel.block_steps``)."""

  transform: optax.GradientTransformationExtraArgs
  run: Callable


def _check_spectral_sharding(preconditioning, sharding) -> None:
  if (
    preconditioning == "spectral"
    and sharding is not None
    and sharding.mode == "distributed"
  ):
    raise ValueError(
      "preconditioning='spectral' needs each whole matrix (an SVD), but "
      "sharding.mode='distributed' keeps matrices split; accepted: "
      "preconditioning in ['frobenius', 'aol', 'schatten'] with that mode, "
      "or sharding.mode in ['blockwise', 'duplicated', 'allgather']"
    )


def orthogonalizer(
  solver: batched.Solver, views: Views, execution: Execution
) -> Orthogonalizer:
  """``orthogonalize`` built from its settings objects: how each matrix is
  solved, which matrices each leaf holds, and where and within which memory
  budget the work runs."""
  sharding = execution.sharding
  _check_spectral_sharding(solver.preconditioning, sharding)
  budget = execution.wave_bytes

  def check_dtypes(viewed):
    for path, leaf, _ in viewed:
      if 0 in jnp.shape(leaf):
        raise ValueError(
          f"leaf {_paths.path_string(path) or '<root>'} of shape "
          f"{tuple(jnp.shape(leaf))} has no elements, so Muon has no matrix "
          "to orthogonalize; label it 'none' (the default labels do) or "
          "leave it out of the params"
        )
      matrices.check_precision_for(
        jnp.result_type(leaf),
        solver.precision,
        f"leaf {_paths.path_string(path) or '<root>'}",
      )

  def init_fn(params):
    viewed = views(params)
    check_dtypes(viewed)  # bad layouts or dtypes raise here
    tp = resolve(
      sharding, [leaf for _, leaf, _ in viewed], [v for _, _, v in viewed]
    )
    if tp is not None and tp.knows_leaf_specs():
      # and bad specs, or shards blockwise cannot cut, here
      check_blocks(tp, viewed, tp.leaf_specs(params))
    return optax.EmptyState()

  def run(updates, states=None, step=None, block_steps=None):
    """The orthogonalized ``updates``; with ``states`` (per leaf, a list of
    state arrays) and ``step``, each leaf first computed from its gradient
    and state inside its wave (``waves.with_state``), and also the new
    states; with ``block_steps``, MuonBP's choice of sharding."""
    viewed = views(updates)
    check_dtypes(viewed)
    leaves = [leaf for _, leaf, _ in viewed]
    treedef = jax.tree.structure(updates)
    leaf_views = [view for _, _, view in viewed]
    tp = resolve(sharding, leaves, leaf_views)
    if tp is not None:
      out = sharded.orthogonalize_sharded(
        leaves,
        leaf_views,
        tp,
        tp.leaf_specs(updates),
        solver,
        execution,
        states,
        step,
        block=None
        if block_steps is None
        else block_steps.bind(leaves, leaf_views, updates),
      )
      if states is None:
        return jax.tree.unflatten(treedef, out), None
      return jax.tree.unflatten(treedef, out[0]), out[1]
    solve = functools.partial(batched.orthogonalize_matrices, solver=solver)
    tasks = [
      waves.view_task(
        leaf,
        lambda shape, v=view: dataclasses.replace(v, shape=shape),
        solve,
        i,
      )
      for i, (_, leaf, view) in enumerate(viewed)
    ]
    if states is not None:
      tasks = [
        waves.with_state(task, [states[i]], step)
        for i, task in enumerate(tasks)
      ]
    outputs = waves.run(tasks, budget)
    if states is None:
      return jax.tree.unflatten(treedef, [out for (out,) in outputs]), None
    done = [
      waves.split_states(out, [len(states[i])]) for i, out in enumerate(outputs)
    ]
    return jax.tree.unflatten(treedef, [own[0] for own, _ in done]), [
      arrays for _, (arrays,) in done
    ]

  def update_fn(updates, state, params=None, *, block_steps=None, **extra):
    del params, extra
    return run(updates, block_steps=block_steps)[0], state

  return Orthogonalizer(
    optax.GradientTransformationExtraArgs(init_fn, update_fn), run
  )
