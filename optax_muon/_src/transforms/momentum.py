"""The momentum transform of Muon (EMA or SGD style, optional bias correction)."""

import math
import typing
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_muon._src.base import checks as _checks
from optax_muon._src.base import types
from optax_muon._src.kernels import quantize
from optax_muon._src.kernels.quantize import QuantizedMomentum
from optax_muon._src.parallel import waves
from optax_muon._src.parallel.execution import Execution

MOMENTUM_STYLES = typing.get_args(types.MomentumStyle)


class MomentumState(NamedTuple):
  """The momentum buffer, one per leaf (8-bit: a ``QuantizedState``, a tree
  of values and a tree of scales)."""

  mu: optax.Updates


def canonical_dtype(name: str, dtype, quantized: bool = False):
  """``dtype`` as a ``jnp.dtype`` (or None, or with ``quantized`` an
  ``om.QuantizedMomentum`` as it is); ``name`` is the argument's."""
  if dtype is None or (quantized and isinstance(dtype, QuantizedMomentum)):
    return dtype
  try:
    dtype = jnp.dtype(dtype)
  except TypeError as error:
    raise ValueError(
      f"{name}={dtype!r} is not a dtype; accepted: None or a floating "
      f"dtype such as 'float32'{_OR_QUANTIZED[quantized]}"
    ) from error
  if not jnp.issubdtype(dtype, jnp.inexact):
    raise ValueError(
      f"{name}={dtype!r} is not a floating dtype; accepted: None or a "
      f"floating dtype such as 'float32'{_OR_QUANTIZED[quantized]}"
    )
  return dtype


_OR_QUANTIZED = {True: " or om.QuantizedMomentum()", False: ""}


def _buffer_dtype(param_dtype, dtype):
  """The buffer's dtype: ``dtype`` (complex of that precision for a complex
  param, so the imaginary part is kept), or else the param's."""
  if dtype is None:
    return param_dtype
  if jnp.issubdtype(param_dtype, jnp.complexfloating):
    return jnp.result_type(dtype, jnp.complex64)
  return dtype


class BiasCorrectedMomentumState(NamedTuple):
  """The momentum buffer and the number of updates taken."""

  count: jax.Array  # type: ignore[assignment]  # int32 scalar, as optax
  mu: optax.Updates


def gradient_weight(beta, style: str):
  """The gradient's weight in the buffer: ``1 − β`` for ``"ema"``, 1 for
  ``"sgd"`` (a function, so a traced ``β`` is read when the step runs)."""
  return (lambda: 1.0 - beta) if style == "ema" else (lambda: 1.0)


def ema_step(g, m, weight, beta, nesterov):
  """``(update, new buffer)`` from a gradient and the old buffer: the
  momentum step, written once (``momentum``'s float and 8-bit paths and the
  fused ``muon_direction`` all take it)."""
  new = weight * g + beta * m
  return (weight * g + beta * new if nesterov else new), new


def quantized_step(g, old: quantize.QuantizedArray, config, step):
  """``step(g, m)`` on an 8-bit buffer: dequantized, stepped in float32,
  requantized; ``(float32 update, new QuantizedArray)``."""
  update, new = step(g.astype(jnp.float32), quantize.dequantize(old, config))
  return update, quantize.quantize(new, old, config)


def _unchanged(matrices):
  """The solve of a task with no matrices (its work is in ``prepare``)."""
  return matrices


def _quantized_task(g, stored, config, step) -> waves.Task:
  """One leaf's 8-bit momentum update as work of a wave: its inputs the
  gradient, values and scales, its outputs the update (in the gradient's
  dtype) and the new values and scales, each of its input's shape. A stack
  (3+ axes) may be split along its leading axis (blocks run along the last
  one, so a part holds whole blocks)."""

  def prepare(inputs):
    g, values, scales = inputs
    old = quantize.QuantizedArray(values, scales)
    update, new = quantized_step(g, old, config, step)
    return [], [update.astype(g.dtype), new.values, new.scales]

  entries = math.prod(jnp.shape(g))
  return waves.Task(
    [g, stored.values, stored.scales],
    prepare,
    lambda matrices, results: results,
    _unchanged,
    # the gradient and update, int8 in and out, four float32 temporaries
    entries * (2 * jnp.dtype(g.dtype).itemsize + 2 + 16),
    0 if jnp.ndim(g) >= 3 and jnp.shape(g)[0] > 1 else None,
  )


def _check_settings(beta, nesterov, style, bias_correction) -> None:
  """Raises naming the first momentum setting not accepted."""
  _checks.check_range("beta", beta, 0.0, 1.0)
  _checks.check_choice("style", style, MOMENTUM_STYLES)
  if not isinstance(nesterov, bool):
    raise TypeError(f"nesterov must be a bool, got {nesterov!r}")
  if not isinstance(bias_correction, bool):
    raise TypeError(f"bias_correction must be a bool, got {bias_correction!r}")
  if bias_correction and style != "ema":
    raise ValueError(
      f"bias_correction=True needs style='ema' (an average), "
      f"got style={style!r}; accepted styles with it: ['ema']"
    )


def momentum(
  beta: types.Numeric = 0.95,
  *,
  nesterov: bool = True,
  style: types.MomentumStyle = "ema",
  dtype: types.MomentumDtype = None,
  bias_correction: bool = False,
  memory_budget: int | None = None,
) -> optax.GradientTransformation:
  r"""Accumulates gradients into a momentum buffer and returns its update.

  ``style="ema"`` (Megatron-Core, emerging-optimizers)::

    m ← β m + (1 − β) g;   u = (1 − β) g + β m  (Nesterov)  or  u = m

  ``style="sgd"`` (Moonlight, Dion)::

    m ← β m + g;           u = g + β m          (Nesterov)  or  u = m

  ``bias_correction`` (``"ema"`` only; ``optax.contrib.muon``) divides each
  term by its EMA's weight after ``t`` updates, as Adam does::

    u = (1 − β) g / (1 − βᵗ) + β m / (1 − βᵗ⁺¹)  (Nesterov)  or  u = m / (1 − βᵗ)

  The sums are taken in the wider of the gradient's and the buffer's dtypes
  and the buffer is stored in its own.

  Args:
    beta: momentum coefficient in ``[0, 1)``; may be traced.
    nesterov: use the Nesterov look-ahead.
    style: ``"ema"`` or ``"sgd"``.
    dtype: dtype of the buffer; ``None`` keeps each param's dtype (use
      ``"float32"`` for bf16 params; a complex param gets the complex dtype
      of that precision); ``om.QuantizedMomentum()`` stores it in 8 bits
      (int8 and a scale per block), updated in float32.
    bias_correction: correct the EMA's bias towards zero in early steps; the
      state then counts the updates (``BiasCorrectedMomentumState``).
    memory_budget: with an 8-bit buffer, bytes per device of float32 work in
      flight: the leaves are updated in waves (``optax_muon._src.parallel.waves``), a
      stacked leaf (3+ axes) in parts along its leading axis, so a scanned
      70B model never holds its whole momentum in float32 (``None``: 2 GiB).

  Returns:
    An ``optax.GradientTransformation`` with state ``MomentumState`` (or
    ``BiasCorrectedMomentumState``).

  References:
    Jordan et al., `Muon <https://kellerjordan.github.io/posts/muon/>`_, 2024

    Kingma and Ba, `Adam <https://arxiv.org/abs/1412.6980>`_, 2015
  """
  _check_settings(beta, nesterov, style, bias_correction)
  dtype = canonical_dtype("dtype", dtype, quantized=True)
  waves.check_memory_budget(memory_budget)
  weight_of = gradient_weight(beta, style)
  new_mu: Callable[[Any], Any]
  quantized = isinstance(dtype, QuantizedMomentum)
  if isinstance(dtype, QuantizedMomentum):
    config = dtype
    # its float32 work runs in waves of this size; a float buffer has none
    budget = Execution(memory_budget=memory_budget).wave_bytes
    new_mu = lambda params: quantize.init_tree(params, config)
    load = lambda mu, treedef: treedef.unflatten(
      [quantize.dequantize(q, config) for q in quantize.leaves(mu, treedef)]
    )
    store = lambda mu, old, treedef: quantize.from_leaves(
      treedef,
      [
        quantize.quantize(m, q, config)
        for m, q in zip(
          treedef.flatten_up_to(mu), quantize.leaves(old, treedef)
        )
      ],
    )
  else:
    # zeros_like keeps each param's sharding
    new_mu = lambda params: jax.tree.map(
      lambda p: jnp.zeros_like(
        p, dtype=_buffer_dtype(jnp.result_type(p), dtype)
      ),
      params,
    )
    load = lambda mu, treedef: mu
    store = lambda mu, old, treedef: jax.tree.map(
      lambda m, o: m.astype(o.dtype), mu, old
    )

  def init_fn(params):
    mu = new_mu(params)
    if bias_correction:
      return BiasCorrectedMomentumState(count=jnp.zeros([], jnp.int32), mu=mu)
    return MomentumState(mu=mu)

  def quantized_update_fn(updates, state, params=None):
    """The 8-bit path: each leaf dequantized, updated in float32 and
    requantized in waves within the budget (see ``_quantized_task``)."""
    del params
    grads, treedef = jax.tree.flatten(updates)
    stored = quantize.leaves(state.mu, treedef)
    step = lambda g, m: ema_step(g, m, weight_of(), beta, nesterov)
    tasks = [_quantized_task(g, q, config, step) for g, q in zip(grads, stored)]
    outputs = waves.run(tasks, budget)
    return treedef.unflatten([update for update, _, _ in outputs]), (
      MomentumState(
        mu=quantize.from_leaves(
          treedef,
          [quantize.QuantizedArray(v, s) for _, v, s in outputs],
        )
      )
    )

  def update_fn(updates, state, params=None):
    if quantized and not bias_correction:
      return quantized_update_fn(updates, state, params)
    del params
    weight = weight_of()
    treedef = jax.tree.structure(updates)
    previous = load(state.mu, treedef)
    # bf16 grads into an fp32 buffer are summed in fp32
    updates = jax.tree.map(
      lambda g, m: g.astype(jnp.result_type(g, m)), updates, previous
    )
    steps = [
      ema_step(g, m, weight, beta, nesterov and not bias_correction)
      for g, m in zip(
        treedef.flatten_up_to(updates), treedef.flatten_up_to(previous)
      )
    ]
    mu = treedef.unflatten([new for _, new in steps])
    stored = store(mu, state.mu, treedef)
    if not bias_correction:
      out = treedef.unflatten([update for update, _ in steps])
      return out, MomentumState(mu=stored)
    count = optax.safe_increment(state.count)
    if nesterov:
      out = jax.tree.map(
        lambda m, g: beta * m + weight * g,
        optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
        optax.tree.bias_correction(updates, beta, count),
      )
    else:
      out = optax.tree.bias_correction(mu, beta, count)
    return out, BiasCorrectedMomentumState(count=count, mu=stored)

  return optax.GradientTransformation(init_fn, update_fn)
