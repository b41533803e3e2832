"""MuonBP: Muon with block-periodic orthogonalization.

Under tensor parallelism each rank holds a block (shard) of every sharded
matrix. MuonBP (Khaled et al., 2025) orthogonalizes each block on its own,
with no communication, on most steps, and the whole matrix every
``period``-th step::

  m ← momentum(g)                      # local to each shard: elementwise
  O = newton_schulz(m)                 # t mod period = 0: the whole matrix
  O = newton_schulz(m_block)           # otherwise: each shard alone
  p ← p − lr · (scale(shape) · O + wd · p)

with each step's shape scale that of what it orthogonalized (the block's
shape on block steps, the matrix's on full steps: the two RMS-matched step
sizes). A fused kernel split along its fan-out (``[gate | up]`` over TP
ranks), whose shards are not whole matrices, is orthogonalized whole on
block steps too. A block step is ``TensorParallel(mode="blockwise")``'s update, a
full step the exact mode the sharding names; both read and write the same
state, so only the step counter is added. The step chooses between the two
per group of leaves within the memory budget, around the orthogonalization
and the shape scale only (``parallel.block_steps``), so that a step does not
hold every leaf's update at once. Without ``sharding=`` the blocks
are the shards that the params' types name on a mesh with Explicit axes
(the full steps' mode then ``"auto"``); for arrays on no such mesh, or with
one block per matrix, every step is Muon's.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_muon._src.optimizers import muon as alias
from optax_muon._src.optimizers import registry
from optax_muon._src.parallel.block_steps import BlockSteps
from optax_muon._src.parallel.tensor_parallel import EXACT_MODES
from optax_muon._src.parallel.tensor_parallel import TensorParallel
from optax_muon._src.parallel.tensor_parallel import check_sharding


class MuonBPState(NamedTuple):
  """The step counter and the optimizer's state (as ``om.muon`` keeps it)."""

  step: jax.Array
  inner_state: optax.OptState


def _block_periodic(
  full: optax.GradientTransformation,
  block: optax.GradientTransformation,
  blockwise: TensorParallel,
  period: int,
) -> optax.GradientTransformationExtraArgs:
  """``full`` (``om.muon`` in the full steps' sharding), whose
  orthogonalization and shape scale run in ``blockwise`` except on steps
  ``0, period, 2·period, …`` (``block_steps.BlockSteps``: the choice made
  per group of leaves, so that no step holds every update at once).
  ``block`` is ``om.muon`` in ``blockwise``: its init checks that
  sharding on the params (nothing allocated)."""
  full = optax.with_extra_args_support(full)

  def init_fn(params):
    jax.eval_shape(block.init, params)  # blockwise's checks, at init
    return MuonBPState(jnp.zeros([], jnp.int32), full.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    steps = BlockSteps(state.step % period == 0, blockwise)
    updates, inner = full.update(
      updates, state.inner_state, params, block_steps=steps, **extra_args
    )
    return updates, MuonBPState(optax.safe_increment(state.step), inner)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def muon_bp(
  learning_rate: optax.ScalarOrSchedule,
  *,
  period: int = 5,
  **muon_kwargs,
) -> optax.GradientTransformation:
  r"""MuonBP: ``om.muon`` whose sharded matrices are orthogonalized block by
  block (no communication) except every ``period``-th step, when the
  sharding's exact mode orthogonalizes each whole matrix.

  Step ``t`` (from 0) is a full step when ``t mod period = 0``, so the first
  step is Muon's exactly; ``period=1`` is ``om.muon`` on every step. Each
  step scales by the shape it orthogonalized (the shard's on block steps),
  and the momentum, weight decay and the AdamW group are ``om.muon``'s.

  Args:
    learning_rate: a float or an optax schedule.
    period: full orthogonalizations every ``period`` steps (a positive int;
      the paper's ``P``).
    **muon_kwargs: the other arguments of ``om.muon`` (``sharding``,
      ``layout``, ``labels``, ``weight_decay``, ``adam_*``, ...);
      ``sharding`` names the full steps' mode, one of the exact modes (or
      ``"auto"``); without it, the params' types give the blocks.

  Returns:
    An ``optax.GradientTransformation``.

  Raises:
    ValueError: for a ``period`` that is not a positive int, or a
      ``sharding`` whose mode is ``"blockwise"`` (it would never be exact).

  Example:
    >>> import jax.numpy as jnp, optax_muon as om
    >>> params = {"hidden": jnp.ones((16, 32)), "bias": jnp.zeros(32)}
    >>> tx = om.muon_bp(0.02, period=5)  # no sharding: Muon on every step
    >>> updates, state = tx.update(params, tx.init(params), params)
    >>> int(state.step)
    1

  References:
    Khaled et al., `MuonBP: Faster Muon via Block-Periodic
    Orthogonalization <https://arxiv.org/abs/2510.16981>`_, 2025
  """
  if isinstance(period, bool) or not isinstance(period, int) or period < 1:
    raise ValueError(
      f"period={period!r} is not accepted; accepted values: a positive int "
      "(a full orthogonalization every `period` steps)"
    )
  sharding = muon_kwargs.get("sharding")
  check_sharding(sharding)
  if sharding is not None and sharding.mode not in (*EXACT_MODES, "auto"):
    raise ValueError(
      f"muon_bp's sharding.mode={sharding.mode!r} is not accepted: its full "
      f"steps need a mode that orthogonalizes whole matrices; accepted: "
      f"{[*EXACT_MODES, 'auto']} (its block steps are blockwise)"
    )
  full = alias.muon(learning_rate, **muon_kwargs)
  # without sharding=, the blocks are the shards the params' types name
  # (none for arrays on no Explicit mesh: then a block step is Muon's)
  base = sharding or TensorParallel(mesh=None)
  # each shard alone wherever the shards are whole matrices (blockwise is
  # the cheapest mode, so auto takes it); a fused [gate | up] or [Q | K | V]
  # split along its fan-out, which no shard holds whole, is orthogonalized
  # whole on every step, in the exact mode of least modeled time
  blockwise = (
    dataclasses.replace(base, mode="blockwise", auto_modes=EXACT_MODES)
    if base.mesh is not None and base.resolved_rates() is None
    else dataclasses.replace(
      base, mode="auto", auto_modes=("blockwise", *EXACT_MODES)
    )
  )
  block = alias.muon(learning_rate, **dict(muon_kwargs, sharding=blockwise))
  return _block_periodic(full, block, blockwise, period)


def _from_config(config, learning_rate, **keywords):
  """``MuonConfig(optimizer="muon_bp")``, every ``muon_bp_period`` steps a
  full one."""
  return muon_bp(learning_rate, period=config.muon_bp_period, **keywords)


registry.register(
  "muon_bp",
  registry.ConfigMember(
    factory=_from_config,
    field_prefixes=("muon_bp_",),
    # two Muons share one state: it is offloaded whole
    takes_state_memory_kind=False,
    # its block steps are blockwise; its full steps the exact mode auto picks
    unset_tp_mode="auto",
  ),
)
