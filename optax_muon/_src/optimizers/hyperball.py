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

from typing import Any

import optax

from optax_muon._src.base import types
from optax_muon._src.optimizers import muon as alias
from optax_muon._src.optimizers.route import route
from optax_muon._src.transforms.hyperball import hyperball
from optax_muon._src.views.layout import from_layout


def muon_hyperball(
  learning_rate: optax.ScalarOrSchedule,
  *,
  radius: types.Numeric | None = None,
  hyperball_eps: types.Numeric = 1e-8,
  weight_decay: types.Numeric = 0.0,
  labels: types.PerLeaf = None,
  dimension_numbers: types.PerLeaf = None,
  layout: Any = None,
  scalar_optimizer: types.ScalarOptimizer = "adam",
  adam_learning_rate: optax.ScalarOrSchedule | None = None,
  adam_b1: types.Numeric = 0.9,
  adam_b2: types.Numeric = 0.999,
  adam_eps: types.Numeric = 1e-8,
  adam_weight_decay: types.Numeric = 0.0,
  adam_weight_decay_mask: types.PerLeaf = None,
  state_memory_kind: types.MemoryKind | None = None,
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
    **muon_kwargs: the other arguments of ``om.scale_by_muon``.

  ``labels``, ``dimension_numbers``, ``layout``, ``scalar_optimizer``, the
  ``adam_*`` settings and ``state_memory_kind`` are as in ``om.muon``;
  ``weight_decay_mask`` does not apply: every Muon weight is decayed, since
  its radius is measured after the decay.

  Returns:
    An ``optax.GradientTransformation``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_muon as om
    >>> params = {"hidden": jax.random.normal(jax.random.key(0), (16, 32))}
    >>> tx = om.muon_hyperball(0.05)
    >>> grads = {"hidden": jax.random.normal(jax.random.key(1), (16, 32))}
    >>> updates, _ = tx.update(grads, tx.init(params), params)
    >>> new = optax.apply_updates(params, updates)
    >>> bool(jnp.isclose(jnp.linalg.norm(new["hidden"]), jnp.linalg.norm(params["hidden"])))
    True

  References:
    NVIDIA emerging-optimizers 0.3.0, ``MuonHyperball``
  """
  labels, dimension_numbers = from_layout(layout, labels, dimension_numbers)
  muon_kwargs.setdefault("adamw_beta1", adam_b1)
  direction = alias.scale_by_muon(
    dimension_numbers=dimension_numbers, **muon_kwargs
  )
  step = hyperball(
    learning_rate, radius=radius, eps=hyperball_eps, weight_decay=weight_decay
  )
  return route(
    direction,
    learning_rate,
    weight_decay=weight_decay,
    labels=labels,
    scalar_optimizer=scalar_optimizer,
    adam_learning_rate=adam_learning_rate,
    adam_b1=adam_b1,
    adam_b2=adam_b2,
    adam_eps=adam_eps,
    adam_weight_decay=adam_weight_decay,
    adam_weight_decay_mask=adam_weight_decay_mask,
    state_memory_kind=state_memory_kind,
    muon_step=step,  # it decays the Muon weights itself
  )
