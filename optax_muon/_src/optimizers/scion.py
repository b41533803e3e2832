"""Scion: Muon's direction under an RMS→RMS operator norm, on a ball.

NVIDIA emerging-optimizers' ``Scion`` (the constrained form of Pethick et
al.'s Scion) is Muon with the ``"unit_rms_norm"`` shape scale, the spectral
radius ``ρ`` as the extra factor and a weight decay of exactly one::

  m ← β m + (1 − β) g;   O = newton_schulz(m)
  p ← (1 − lr) · p − lr · ρ · √(fan_out / fan_in) · O

so the weights stay in the ball of radius ``ρ`` of that norm (a convex
combination of ``p`` and the linear minimization oracle ``−ρ·√(out/in)·O``).
It needs no code of its own beyond this: ``om.muon`` with those settings.
"""

import optax

from optax_muon._src.base import types
from optax_muon._src.optimizers import muon as alias
from optax_muon._src.optimizers import settings


def scion(
  learning_rate: optax.ScalarOrSchedule,
  *,
  beta: types.Numeric = 0.95,
  spectral_radius: types.Numeric = 1.0,
  coefficients: types.Coefficients = "quintic",
  steps: types.Steps = 5,
  precision: types.Precision = "highest",
  **muon_kwargs,
) -> optax.GradientTransformation:
  r"""Scion (emerging-optimizers' constrained form) for the matrices, AdamW
  for the rest.

  ``p ← (1 − lr) · p − lr · ρ · √(fan_out / fan_in) · newton_schulz(m)`` with
  ``m`` EMA momentum (no Nesterov): ``om.muon(learning_rate,
  scale_mode="unit_rms_norm", extra_scale_factor=spectral_radius,
  weight_decay=1.0, nesterov=False, ...)``.

  Args:
    learning_rate: a float or an optax schedule; also the step of the convex
      combination, so at most 1.
    beta: the momentum's decay.
    spectral_radius: ``ρ > 0``, the radius of the ball the weights stay in.
    coefficients: the Newton–Schulz schedule.
    steps: Newton–Schulz steps.
    precision: the Newton–Schulz matmul precision.
    **muon_kwargs: the other arguments of ``om.muon`` (``layout``,
      ``labels``, ``dimension_numbers``, ``sharding``, ``adam_*``, ...);
      not ``scale_mode``, ``extra_scale_factor`` (nor
      ``match_adamw_update_rms``), ``weight_decay`` or ``nesterov``, which
      Scion fixes.

  Returns:
    An ``optax.GradientTransformation``.

  Raises:
    ValueError: for one of the arguments Scion fixes.

  Example:
    >>> import jax, jax.numpy as jnp, optax_muon as om
    >>> params = {"hidden": jnp.ones((16, 32)), "embed": jnp.ones((64, 16))}
    >>> tx = om.scion(0.02, labels={"hidden": "muon", "embed": "adam"})
    >>> updates, _ = tx.update(params, tx.init(params), params)
    >>> sorted(updates)
    ['embed', 'hidden']

  References:
    Pethick et al., `Training Deep Learning Models with Norm-Constrained
    LMOs <https://arxiv.org/abs/2502.07529>`_, 2025;
    NVIDIA emerging-optimizers 0.3.0, ``Scion``
  """
  fixed = sorted(set(settings.NOT_APPLICABLE["scion"]) & set(muon_kwargs))
  if fixed:
    raise ValueError(
      f"scion fixes {fixed} (unit_rms_norm scale, spectral_radius as the "
      "factor, weight decay 1, no Nesterov); use om.muon to set them"
    )
  return alias.muon(
    learning_rate,
    beta=beta,
    nesterov=False,
    coefficients=coefficients,
    steps=steps,
    precision=precision,
    scale_mode="unit_rms_norm",
    extra_scale_factor=spectral_radius,
    weight_decay=1.0,
    **muon_kwargs,
  )
