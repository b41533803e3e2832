"""Newton–Schulz of many matrices at once: same-shape matrices stacked and
orthogonalized by one batched loop per stack (``orthogonalize_matrices``),
or matrices whose columns are split over a mesh axis
(``orthogonalize_split_columns``). The transforms and the tensor-parallel
planners hand their matrices here."""

import copy
import dataclasses
import typing
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_muon._src.base import checks as _checks
from optax_muon._src.base import types
from optax_muon._src.kernels import coefficients as coefficients_lib
from optax_muon._src.kernels import gram
from optax_muon._src.kernels import matrices
from optax_muon._src.kernels import newton_schulz as ns
from optax_muon._src.kernels.matrices import from_wide
from optax_muon._src.kernels.matrices import to_wide
from optax_muon._src.kernels.matrices import working_dtype

METHODS = typing.get_args(types.Method)

# Stacking same-shape matrices pays for small ones (one batched matmul instead
# of many small ones) and costs memory: a stack's loop keeps two copies of the
# whole stack live. So a stack holds at most as many bytes as the largest
# matrix of the update (what doing the matrices one by one needs anyway),
# but at least MIN_STACK_BYTES, and never more than STACK_BYTES, past which a
# stack only adds memory traffic. The times and peak bytes this gives against
# optax.contrib.muon are measured by benchmarks/update_vs_optax.py and
# benchmarks/memory.py and recorded in docs/performance.md.
STACK_BYTES = 1 << 24
MIN_STACK_BYTES = 1 << 18


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class Solver:
  """How each matrix is orthogonalized: ``orthogonalize``'s Newton–Schulz
  keywords (their meanings are there), checked when built: a setting not
  accepted raises a ``ValueError`` naming it. ``steps`` and ``eps`` may be
  traced (``optax.inject_hyperparams``).

  Attributes:
    table: the ``(a, b, c)`` rows of the schedule ``coefficients`` names,
      or given as they are (``optax.contrib``'s own, maybe traced).
    mode: ``"cycle"`` or ``"repeat_last"`` (with ``table``: given too).
  """

  coefficients: types.Coefficients = "quintic"
  steps: Any = 5
  precision: types.Precision = "highest"
  method: types.Method = "standard"
  preconditioning: types.Preconditioning = "frobenius"
  eps: Any = 1e-30
  add_eps: bool = False
  table: Any = None
  mode: str = "cycle"

  def __post_init__(self):
    if self.table is None:
      table, mode = coefficients_lib.resolve_coefficients(self.coefficients)
      object.__setattr__(self, "table", table)
      object.__setattr__(self, "mode", mode)
    _checks.check_int("steps", self.steps, minimum=1)
    _checks.check_choice("precision", self.precision, matrices.PRECISIONS)
    _checks.check_choice("method", self.method, METHODS)
    _checks.check_range("eps", self.eps, 0.0, np.inf)
    _checks.check_choice(
      "preconditioning", self.preconditioning, ns.PRECONDITIONINGS
    )
    if not isinstance(self.add_eps, bool):
      raise TypeError(f"add_eps must be a bool, got {self.add_eps!r}")
    if self.method == "gram" and self.precision == "bf16":
      raise ValueError(
        "precision='bf16' keeps the iterate X in bf16 between steps, but "
        "method='gram' iterates on the Gram matrix (no X until the end), "
        "whose rounding bf16 would amplify; accepted: method='standard' "
        "with precision='bf16', or method='gram' with precision in "
        "['highest', 'high', 'medium', 'fp16']"
      )

  @property
  def normalizes_from_blocks(self) -> bool:
    """Whether ``newton_schulz.frobenius_divisors`` of a matrix's blocks
    give its normalization (optax's ``add_eps`` norm and the bf16 iterate's
    rounded one are computed whole)."""
    return (
      self.preconditioning == "frobenius"
      and not self.add_eps
      and self.precision != "bf16"
    )

  def prenormalized(self) -> "Solver":
    """This solver for matrices that come normalized (an internal
    preconditioning, so not through the user's checks)."""
    solver = copy.copy(self)
    object.__setattr__(solver, "preconditioning", ns.PRENORMALIZED)
    return solver


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


def orthogonalize_matrices(
  matrices: list[jax.Array],
  solver: Solver,
  distribute_axis: str | None = None,
) -> list[jax.Array]:
  """Newton–Schulz of each ``(batch, m, n)`` array, one batched loop per
  stack of same-shape matrices (each turned wide); each result has its
  input's shape and dtype.

  With ``distribute_axis`` (inside ``shard_map``), each rank of that mesh axis
  orthogonalizes 1/N of every stack and the results are all-gathered.
  """
  groups: dict[tuple, list[int]] = {}
  for index, matrix in enumerate(matrices):
    key = (tuple(sorted(matrix.shape[-2:])), working_dtype(matrix.dtype))
    groups.setdefault(key, []).append(index)
  sizes = [matrix.size * 4 for matrix in matrices]
  results: list[Any] = [None] * len(matrices)
  ranks = 1 if distribute_axis is None else jax.lax.axis_size(distribute_axis)
  for members in _chunks(groups.values(), sizes, ranks):
    inputs = [matrices[i] for i in members]
    stack = jnp.concatenate(
      [to_wide(x.astype(working_dtype(x.dtype)))[0] for x in inputs], axis=0
    )
    count = stack.shape[0]
    if distribute_axis is not None:
      padded = -(-count // ranks) * ranks
      stack = jnp.pad(stack, ((0, padded - count), (0, 0), (0, 0)))
      stack = jax.lax.dynamic_slice_in_dim(
        stack,
        jax.lax.axis_index(distribute_axis) * (padded // ranks),
        padded // ranks,
      )
    # Newton–Schulz, inline: each call on the way to the loop is a frame
    m, n = stack.shape[-2:]
    if solver.method == "gram" and gram.gram_saves_flops(m, n):
      s = solver
      stack = gram.iterate_gram(
        ns.precondition(
          stack, s.preconditioning, s.eps, s.precision, add_eps=s.add_eps
        ),
        s.table,
        s.mode,
        s.steps,
        s.precision,
      )
    else:
      stack = ns.precondition_and_iterate(stack, solver)
    if distribute_axis is not None:
      stack = jax.lax.all_gather(stack, distribute_axis, tiled=True)[:count]
    offsets = np.cumsum([0] + [x.shape[0] for x in inputs])
    for i, start, stop in zip(members, offsets[:-1], offsets[1:]):
      tall = matrices[i].shape[-2] > matrices[i].shape[-1]
      results[i] = from_wide(stack[start:stop], tall).astype(matrices[i].dtype)
  return results


def orthogonalize_split_columns(
  matrices: list[jax.Array], solver: Solver, axis_name: str
) -> list[jax.Array]:
  """Newton–Schulz of matrices whose columns are split over ``axis_name``
  (inside ``shard_map``): the Gram matrix ``X Xᵀ`` is the sum of the shards'."""
  return [
    ns.precondition_and_iterate(
      matrix.astype(working_dtype(matrix.dtype)), solver, axis_name
    ).astype(matrix.dtype)
    for matrix in matrices
  ]
