"""Muon's momentum and orthogonalization as one transform (``scale_by_muon``'s
first two steps).

``optax.chain(momentum, orthogonalize)`` computes every leaf's momentum
before the first Newton–Schulz wave: the compiler then holds all the
updates ``u`` at once (and, for an 8-bit momentum, every leaf dequantized to
float32). Here each leaf's momentum is computed inside the task that
orthogonalizes it (``waves.with_state``), a part at a time for a split
stack, so the momentum work follows the memory budget: an 8-bit buffer is
dequantized a part at a time and a buffer kept in host memory
(``memory_kind="pinned_host"``) comes to the device a wave at a time.
The numbers are the chain's; the state is the chain's, ``(MomentumState,
EmptyState)``.
"""

import jax
import jax.numpy as jnp
import optax

from optax_muon._src.base import types
from optax_muon._src.kernels import batched
from optax_muon._src.kernels import quantize
from optax_muon._src.parallel import offload
from optax_muon._src.parallel.execution import Execution
from optax_muon._src.transforms import momentum as momentum_lib
from optax_muon._src.transforms import orthogonalize as orthogonalize_lib
from optax_muon._src.views.matrix_views import Views


def momentum_orthogonalize(
  beta: types.Numeric,
  *,
  nesterov: bool,
  style: types.MomentumStyle,
  dtype: types.MomentumDtype,
  solver: batched.Solver,
  views: Views,
  execution: Execution,
) -> optax.GradientTransformationExtraArgs:
  """``optax.chain(momentum(beta, nesterov, style, dtype),
  orthogonalizer(solver, views, execution).transform)`` with each leaf's
  momentum computed in its wave; the state in
  ``execution.state_memory_kind`` (see the module)."""
  memory_kind = execution.state_memory_kind
  # checks its arguments and makes the state
  momentum = momentum_lib.momentum(
    beta,
    nesterov=nesterov,
    style=style,
    dtype=dtype,
    memory_budget=execution.memory_budget,
  )
  orthogonalize, run = orthogonalize_lib.orthogonalizer(
    solver, views, execution
  )
  quantized = isinstance(dtype, quantize.QuantizedMomentum)
  weight = momentum_lib.gradient_weight(beta, style)

  def init_fn(params):
    state = momentum.init(params)
    empty = orthogonalize.init(params)
    if memory_kind is not None:
      state = offload.to_host(state)
    return state, empty

  def ema(g, m):
    return momentum_lib.ema_step(g, m, weight(), beta, nesterov)

  def step(g, arrays):
    if memory_kind is not None:  # this leaf's buffer, now, for its wave
      arrays = offload.to_device(arrays)
    if quantized:
      old = quantize.QuantizedArray(*arrays)
      update, stored = momentum_lib.quantized_step(g, old, dtype, ema)
      new_arrays = [stored.values, stored.scales]
    else:
      work = jnp.result_type(g, arrays[0])
      update, new = ema(g.astype(work), arrays[0].astype(work))
      new_arrays = [new.astype(arrays[0].dtype)]
    if memory_kind is not None:
      new_arrays = offload.to_host(new_arrays)
    return update.astype(g.dtype), new_arrays

  def update_fn(updates, state, params=None, *, block_steps=None, **extra):
    del params, extra
    momentum_state, empty = state
    grads, treedef = jax.tree.flatten(updates)
    if quantized:
      stored = quantize.leaves(momentum_state.mu, treedef)
      arrays = [[q.values, q.scales] for q in stored]
    else:
      arrays = [[b] for b in treedef.flatten_up_to(momentum_state.mu)]
    out, new_arrays = run(updates, arrays, step, block_steps)
    if quantized:
      mu = quantize.from_leaves(
        treedef, [quantize.QuantizedArray(*a) for a in new_arrays]
      )
    else:
      mu = treedef.unflatten([a[0] for a in new_arrays])
    new_state = momentum_state._replace(mu=mu)
    return out, (new_state, empty)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
