"""The hyperball step: Muon directions turned into norm-preserving steps."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_muon._src.base import checks as _checks
from optax_muon._src.base import paths as _paths
from optax_muon._src.base import types
from optax_muon._src.kernels.matrices import frobenius


class HyperballState(NamedTuple):
  count: jax.Array  # type: ignore[assignment]  # steps, for a schedule


def _norm(x: jax.Array) -> jax.Array:
  return frobenius(x, axis=None, keepdims=False)


def hyperball(
  learning_rate: optax.ScalarOrSchedule,
  *,
  radius: types.Numeric | None = None,
  eps: types.Numeric = 1e-8,
  weight_decay: types.Numeric = 0.0,
) -> optax.GradientTransformation:
  r"""Turns Muon directions into norm-preserving steps (see the module
  docstring for the formula); the last transform of a Muon chain, in place
  of ``add_decayed_weights`` and ``scale_by_learning_rate``.

  Args:
    learning_rate: a float or an optax schedule.
    radius: the norm every weight keeps; ``None``: each weight's own norm
      (after the decay of each step).
    eps: floor of the norms divided by.
    weight_decay: decoupled weight decay, applied before the step (EO).

  Returns:
    An ``optax.GradientTransformation`` that needs ``params``.

  References:
    NVIDIA emerging-optimizers 0.3.0, ``MuonHyperball``
  """
  if radius is not None:
    _checks.check_positive("radius", radius)
  _checks.check_range("hyperball_eps", eps, 0.0, np.inf)
  _checks.check_range("weight_decay", weight_decay, 0.0, np.inf)

  def init_fn(params):
    if radius is None:  # each weight keeps its norm: a zero one never moves
      for path, p in _paths.leaves_with_paths(params)[0]:
        if not _checks.is_traced(p) and isinstance(p, (jax.Array, np.ndarray)):
          if not float(np.max(np.abs(np.asarray(p, np.float32)), initial=0)):
            raise ValueError(
              f"leaf {_paths.path_string(path) or '<root>'} is all zeros, so "
              "with radius=None (each weight keeps its own norm) its norm 0 "
              "keeps it at zero for ever; initialize it nonzero or pass "
              "radius= (the norm every weight keeps)"
            )
    return HyperballState(jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError(
        "hyperball needs the params: update(updates, state, params)"
      )
    lr = (
      learning_rate(state.count) if callable(learning_rate) else (learning_rate)
    )

    def step(u, p):
      w = p.astype(jnp.float32)
      if radius is not None:
        w = radius * w / jnp.maximum(_norm(w), eps)
      w = w * (1 - lr * weight_decay)
      r = radius if radius is not None else _norm(w)
      u = u.astype(jnp.float32)
      w = w - lr * r * u / jnp.maximum(_norm(u), eps)
      w = r * w / jnp.maximum(_norm(w), eps)
      return (w - p.astype(jnp.float32)).astype(p.dtype)

    return (
      jax.tree.map(step, updates, params),
      HyperballState(optax.safe_increment(state.count)),
    )

  return optax.GradientTransformation(init_fn, update_fn)
