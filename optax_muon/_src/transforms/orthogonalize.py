"""The orthogonalize transform: Newton–Schulz on every matrix of the updates.

Leaves are viewed as batches of matrices (``layout``), every matrix is turned
to its wide orientation, matrices of the same shape are stacked (up to a size
cap, see ``STACK_BYTES``) and orthogonalized by one batched Newton–Schulz loop
per stack, then put back.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_muon._src.base import checks as _checks
from optax_muon._src.base import paths as _paths
from optax_muon._src.kernels import coefficients as coefficients_lib
from optax_muon._src.kernels import newton_schulz as ns
from optax_muon._src.parallel import tensor_parallel as sharding_lib
from optax_muon._src.parallel import waves
from optax_muon._src.views import layout

METHODS = ("standard", "gram")


# Stacking same-shape matrices pays for small ones (one batched matmul instead
# of many small ones) and costs memory: a stack's loop keeps two copies of the
# whole stack live. So a stack holds at most as many bytes as the largest
# matrix of the update (what doing the matrices one by one needs anyway),
# but at least MIN_STACK_BYTES, and never more than STACK_BYTES, past which a
# stack only adds memory traffic (24 stacked 1024×4096 leaves: 1.11× optax's
# time). On the example GPT this keeps the peak temporary bytes under
# optax.contrib.muon's (benchmarks/memory.py).
STACK_BYTES = 1 << 24
MIN_STACK_BYTES = 1 << 18


def _chunks(groups, sizes, ranks: int = 1):
  """Each group split into stacks of at most the cap above (one matrix at
  least); ``sizes`` are the members' fp32 bytes. A stack split over ``ranks``
  holds ``ranks`` times as much, as each rank keeps its share."""
  cap = ranks * min(STACK_BYTES, max(sizes + [MIN_STACK_BYTES]))
  for members in groups:
    chunk: list[int] = []
    size = 0
    for i in members:
      if chunk and size + sizes[i] > cap:
        yield chunk
        chunk, size = [], 0
      chunk.append(i)
      size += sizes[i]
    yield chunk


def _wide(matrix: jax.Array) -> jax.Array:
  """The matrix in the iteration's dtype (fp32, or complex64), turned to
  m ≤ n."""
  matrix = matrix.astype(ns.working_dtype(matrix.dtype))
  tall = matrix.shape[-2] > matrix.shape[-1]
  return jnp.swapaxes(matrix, -1, -2) if tall else matrix


def _orthogonalize_grouped(
  matrices: list[jax.Array],
  table: np.ndarray,
  mode: str,
  steps,
  precision: str,
  eps,
  preconditioning: str = "frobenius",
  add_eps: bool = False,
  method: str = "standard",
  distribute_axis: str | None = None,
) -> list[jax.Array]:
  """NS of each ``(batch, m, n)`` array, one batched loop per stack.

  With ``distribute_axis`` (inside ``shard_map``), each rank of that mesh axis
  orthogonalizes 1/N of every group and the results are all-gathered.
  """
  groups: dict[tuple, list[int]] = {}
  for index, matrix in enumerate(matrices):
    key = (tuple(sorted(matrix.shape[-2:])), ns.working_dtype(matrix.dtype))
    groups.setdefault(key, []).append(index)
  sizes = [matrix.size * 4 for matrix in matrices]
  results: list[Any] = [None] * len(matrices)
  ranks = 1 if distribute_axis is None else jax.lax.axis_size(distribute_axis)
  for members in _chunks(groups.values(), sizes, ranks):
    inputs = [matrices[i] for i in members]
    stack = jnp.concatenate([_wide(x) for x in inputs], axis=0)
    count = stack.shape[0]
    if distribute_axis is not None:
      padded = -(-count // ranks) * ranks
      stack = jnp.pad(stack, ((0, padded - count), (0, 0), (0, 0)))
      stack = jax.lax.dynamic_slice_in_dim(
        stack,
        jax.lax.axis_index(distribute_axis) * (padded // ranks),
        padded // ranks,
      )
    m, n = stack.shape[-2:]
    if method == "gram" and ns.gram_saves_flops(m, n):
      stack = ns.iterate_gram(
        ns.precondition(
          stack, preconditioning, eps, precision, add_eps=add_eps
        ),
        table,
        mode,
        steps,
        precision,
      )
    else:
      stack = ns.precondition_and_iterate(
        stack, table, mode, steps, precision, preconditioning, eps, add_eps
      )
    if distribute_axis is not None:
      stack = jax.lax.all_gather(stack, distribute_axis, tiled=True)[:count]
    offsets = np.cumsum([0] + [x.shape[0] for x in inputs])
    for i, start, stop in zip(members, offsets[:-1], offsets[1:]):
      out = stack[start:stop]
      if matrices[i].shape[-2] > matrices[i].shape[-1]:
        out = jnp.swapaxes(out, -1, -2)
      results[i] = out.astype(matrices[i].dtype)
  return results


def _distributed_newton_schulz(
  matrices,
  axis_name,
  table,
  mode,
  steps,
  precision,
  eps,
  preconditioning="frobenius",
  add_eps=False,
):
  """NS of matrices whose columns are split over ``axis_name`` (shard_map)."""
  out = []
  for matrix in matrices:
    x = ns.precondition_and_iterate(
      matrix.astype(ns.working_dtype(matrix.dtype)),
      table,
      mode,
      steps,
      precision,
      preconditioning,
      eps,
      add_eps,
      axis_name,
    )
    out.append(x.astype(matrix.dtype))
  return out


def orthogonalize(
  *,
  coefficients="quintic",
  steps=5,
  precision: str = "highest",
  method: str = "standard",
  dimension_numbers=None,
  split_qkv=None,
  split_gate_up=None,
  sharding=None,
  eps=1e-30,
  preconditioning: str = "frobenius",
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
  (``optax_muon.waves``): stacked leaves (scanned layers, experts) are split
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
    sharding: ``None``, or a ``TensorParallel`` to run over a mesh.
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
  table, mode = coefficients_lib.resolve_coefficients(coefficients)
  _checks.check_int("steps", steps, minimum=1)
  _checks.check_choice("precision", precision, ns.PRECISIONS)
  _checks.check_choice("method", method, METHODS)
  _checks.check_range("eps", eps, 0.0, np.inf)
  _checks.check_choice("preconditioning", preconditioning, ns.PRECONDITIONINGS)
  if not isinstance(add_eps, bool):
    raise TypeError(f"add_eps must be a bool, got {add_eps!r}")
  if method == "gram" and precision == "bf16":
    raise ValueError(
      "precision='bf16' keeps the iterate X in bf16 between steps, but "
      "method='gram' iterates on the Gram matrix (no X until the end), whose "
      "rounding bf16 would amplify; accepted: method='standard' with "
      "precision='bf16', or method='gram' with precision in "
      "['highest', 'high', 'medium', 'fp16']"
    )
  sharding_lib.check_sharding(sharding)
  budget = waves.resolve(memory_budget)
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
  resolve_views = layout.view_resolver(
    dimension_numbers, split_qkv, split_gate_up
  )
  settings = dict(
    table=table,
    mode=mode,
    steps=steps,
    precision=precision,
    eps=eps,
    preconditioning=preconditioning,
    add_eps=add_eps,
  )
  grouped = dict(settings, method=method)

  def check_dtypes(views):
    for path, leaf, _ in views:
      if 0 in jnp.shape(leaf):
        raise ValueError(
          f"leaf {_paths.path_string(path) or '<root>'} of shape "
          f"{tuple(jnp.shape(leaf))} has no elements, so Muon has no matrix "
          "to orthogonalize; label it 'none' (the default labels do) or "
          "leave it out of the params"
        )
      ns.check_precision_for(
        jnp.result_type(leaf),
        precision,
        f"leaf {_paths.path_string(path) or '<root>'}",
      )

  def init_fn(params):
    check_dtypes(resolve_views(params))  # bad layouts or dtypes raise here
    if sharding is not None and (
      sharding.specs is not None or sharding._explicit()
    ):
      sharding.leaf_specs(params)  # and bad specs here
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    del params
    views = resolve_views(updates)
    check_dtypes(views)
    if sharding is not None:
      leaves = sharding_lib.orthogonalize_sharded(
        [leaf for _, leaf, _ in views],
        [view for _, _, view in views],
        sharding,
        sharding.leaf_specs(updates),
        lambda ms, axis: _orthogonalize_grouped(
          ms, distribute_axis=axis, **grouped
        ),
        lambda ms, axis: _distributed_newton_schulz(ms, axis, **settings),
        budget,
      )
      return jax.tree.unflatten(jax.tree.structure(updates), leaves), state
    new_leaves: list[Any] = [None] * len(views)
    tasks = [
      waves.view_task(
        leaf,
        lambda shape, v=view: dataclasses.replace(v, shape=shape),
        lambda out, i=i: new_leaves.__setitem__(i, out),
        "local",
      )
      for i, (_, leaf, view) in enumerate(views)
    ]
    waves.run(
      tasks, budget, {"local": lambda ms: _orthogonalize_grouped(ms, **grouped)}
    )
    treedef = jax.tree.structure(updates)
    return jax.tree.unflatten(treedef, new_leaves), state

  return optax.GradientTransformation(init_fn, update_fn)
