r"""GRPO's pieces: group advantages, the clipped objective with a KL penalty,
the learning-rate schedule, and the rollback rule.

For a prompt with ``G`` sampled completions of rewards ``r_1 … r_G``, each
completion's advantage is ``A_i = (r_i − mean(r)) / std(r)``, and 0 for every
completion of a group whose rewards are all equal (no signal, and no 0/0).
Every token ``t`` of completion ``i`` then contributes

.. math::

  −\min(ρ_t A_i,\ \mathrm{clip}(ρ_t, 1−ε, 1+ε) A_i) + β\,\mathrm{KL}_t,\quad
  ρ_t = π_θ(o_t) / π_{old}(o_t),

with the per-token KL estimate
``exp(log π_ref − log π_θ) − (log π_ref − log π_θ) − 1`` to the frozen SFT
policy (non-negative, unbiased). The loss averages over each completion's
tokens, then over completions (DeepSeekMath's GRPO).

References:
  Shao et al., *DeepSeekMath*, 2024 (arXiv:2402.03300).
"""

import jax.numpy as jnp


def group_advantages(rewards, eps: float = 1e-6):
  """``(prompts, G)`` rewards to advantages, normalized within each group."""
  mean = rewards.mean(axis=-1, keepdims=True)
  std = rewards.std(axis=-1, keepdims=True)
  # a constant group: zero, not 0/0
  return jnp.where(std > eps, (rewards - mean) / jnp.maximum(std, eps), 0.0)


def kl_to_reference(logprobs, reference_logprobs):
  """The per-token estimate of KL(π_θ ‖ π_ref) (Schulman's k3)."""
  delta = reference_logprobs - logprobs
  return jnp.exp(delta) - delta - 1.0


def grpo_loss(
  logprobs,
  old_logprobs,
  reference_logprobs,
  advantages,
  mask,
  *,
  clip_ratio: float,
  kl_coef: float,
):
  """``(loss, metrics)`` of the module docstring's objective.

  Args:
    logprobs, old_logprobs, reference_logprobs: ``(batch, time)`` log-probs
      of the sampled tokens under the policy being trained, the policy that
      sampled them, and the frozen reference.
    advantages: ``(batch,)``.
    mask: ``(batch, time)``, 1.0 on the completion's tokens.
    clip_ratio: ``ε``.
    kl_coef: ``β``.
  """
  ratio = jnp.exp(logprobs - old_logprobs)
  advantages = advantages[:, None]
  clipped = jnp.clip(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)
  surrogate = jnp.minimum(ratio * advantages, clipped * advantages)
  kl = kl_to_reference(logprobs, reference_logprobs)
  per_token = -surrogate + kl_coef * kl
  lengths = jnp.maximum(mask.sum(axis=-1), 1.0)
  per_sequence = lambda x: (x * mask).sum(axis=-1) / lengths
  loss = per_sequence(per_token).mean()
  metrics = {
    "kl": per_sequence(kl).mean(),
    "clip_fraction": per_sequence(
      (jnp.abs(ratio - 1.0) > clip_ratio).astype(jnp.float32)
    ).mean(),
  }
  return loss, metrics


def warmup_decay(peak_lr, warmup_steps: int, decay: float):
  """``step ↦ peak_lr · min(step / warmup_steps, 1) / (1 + decay · step)``,
  with ``step`` the update's number from 1 (optax's count + 1)."""

  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0
    warm = jnp.minimum(step / max(warmup_steps, 1), 1.0)
    return peak_lr * warm / (1.0 + decay * step)

  return schedule


class Rollback:
  """After ``patience`` evaluations in a row each below the one before, says
  to go back to the best checkpoint (and the caller halves the lr).

  The count starts again after a rollback, from the best accuracy.
  """

  def __init__(self, patience: int = 3):
    self.patience = patience
    self.previous = None
    self.drops = 0

  def update(self, accuracy: float, best: float | None = None) -> bool:
    """Records an evaluation; whether to roll back now. ``best`` is the
    accuracy of the checkpoint a rollback restores."""
    dropped = self.previous is not None and accuracy < self.previous
    self.drops = self.drops + 1 if dropped else 0
    self.previous = accuracy
    if self.drops < self.patience:
      return False
    self.drops = 0
    self.previous = best
    return True

  def state(self) -> dict:
    return {"previous": self.previous, "drops": self.drops}

  def load(self, state: dict) -> None:
    self.previous, self.drops = state["previous"], state["drops"]
