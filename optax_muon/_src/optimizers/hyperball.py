"""MuonHyperball: Muon steps on the sphere of each weight's norm, as NVIDIA
emerging-optimizers' ``MuonHyperball`` takes them.

For each leaf ``W`` with Muon direction ``u`` (``scale_by_muon``'s output)::

  W₁ = (1 − lr·wd) · W                     # decoupled decay, first (EO)
  R  = radius, or ‖W₁‖_F                   # with radius: W is first put on it
  W₂ = W₁ − lr · R · u / max(‖u‖_F, eps)
  W' = R · W₂ / max(‖W₂‖_F, eps)

so every step has length ``lr·R`` and ``‖W'‖_F = R``. Without ``radius`` the
radius is the weight's own norm after the decay: a weight decay ``wd > 0``
shrinks it by ``(1 − lr·wd)`` each step (EO measures ``R`` after applying the
decay). With ``radius``, EO's constructor rescales each weight onto it; here
the first update does that (the rescale is the identity from then on), so
the params need no preparation. Norms are over the whole leaf, as EO's are
over a parameter tensor.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_muon._src.base import checks as _checks
from optax_muon._src.base import paths as _paths
from optax_muon._src.kernels.matrices import frobenius
from optax_muon._src.optimizers import muon as alias


class HyperballState(NamedTuple):
  count: jax.Array  # type: ignore[assignment]  # steps, for a schedule


def _norm(x: jax.Array) -> jax.Array:
  return frobenius(x, axis=None, keepdims=False)


def hyperball(
  learning_rate, *, radius=None, eps=1e-8, weight_decay=0.0
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


def muon_hyperball(
  learning_rate,
  *,
  radius=None,
  hyperball_eps=1e-8,
  weight_decay=0.0,
  labels=None,
  dimension_numbers=None,
  layout=None,
  scalar_optimizer: str = "adam",
  adam_learning_rate=None,
  adam_b1=0.9,
  adam_b2=0.999,
  adam_eps=1e-8,
  adam_weight_decay=0.0,
  adam_weight_decay_mask=None,
  state_memory_kind: str | None = None,
  **muon_kwargs,
) -> optax.GradientTransformation:
  r"""MuonHyperball for the matrices, AdamW for the rest: ``om.muon`` whose
  Muon leaves take ``hyperball`` steps (norm-preserving; see ``hyperball``).

  Args:
    learning_rate: a float or an optax schedule.
    radius: the norm every Muon weight keeps; ``None``: its own.
    hyperball_eps: floor of the norms divided by.
    weight_decay: the Muon leaves' decoupled decay, applied before the step
      (without ``radius`` it shrinks the radius by ``1 − lr·wd`` per step).
    labels, dimension_numbers, layout, scalar_optimizer, adam_*,
      state_memory_kind: as in ``om.muon``.
    **muon_kwargs: the other arguments of ``om.scale_by_muon``.

  Returns:
    An ``optax.GradientTransformation``.

  References:
    NVIDIA emerging-optimizers 0.3.0, ``MuonHyperball``
  """
  labels, dimension_numbers = alias.from_layout(
    layout, labels, dimension_numbers
  )
  muon_kwargs.setdefault("adamw_beta1", adam_b1)
  direction = alias.scale_by_muon(
    dimension_numbers=dimension_numbers, **muon_kwargs
  )
  return alias.route(
    direction,
    learning_rate,
    labels=labels,
    scalar_optimizer=scalar_optimizer,
    adam_learning_rate=adam_learning_rate,
    adam_b1=adam_b1,
    adam_b2=adam_b2,
    adam_eps=adam_eps,
    adam_weight_decay=adam_weight_decay,
    adam_weight_decay_mask=adam_weight_decay_mask,
    muon_step=hyperball(
      learning_rate, radius=radius, eps=hyperball_eps, weight_decay=weight_decay
    ),
    state_memory_kind=state_memory_kind,
  )
