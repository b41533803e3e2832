"""grpo_arith's monitoring and recovery, as a hook of Tunix's trainer.

Every ``eval_every`` steps the actor's greedy accuracy on held-out
validation problems is measured and the best params and optimizer state are
kept; after ``patience`` drops in a row (grpo_arith's ``Rollback``) the
actor goes back to the best at half the learning rate. At the end of
training the best is restored (early stopping by validation accuracy).
"""

import jax
import jax.numpy as jnp
from flax import nnx
from tunix.sft import hooks

from examples.grpo_arith import grpo as grpo_arith
from examples.tunix_grpo import policy

# the inject_hyperparams hyperparameter a rollback halves
LR_SCALE = "lr_scale"


def _copy(state):
  return jax.tree.map(jnp.copy, state)


class Recovery(hooks.TrainingHooks):
  """Greedy validation accuracy, the best checkpoint kept in memory, and
  rollbacks to it at half the lr; ``history`` and ``rollbacks`` say what
  happened."""

  def __init__(self, problems, lengths: tuple[int, int], eval_every, patience):
    self.problems = problems
    self.lengths = lengths  # the prompts' padded length, the completions'
    self.eval_every = eval_every
    self.rollback = grpo_arith.Rollback(patience)
    self.history: list[tuple[int, float]] = []
    self.rollbacks: list[dict] = []
    self.best_accuracy = -1.0
    self.best_step = 0
    self._best = None

  def evaluate(self, trainer, step: int) -> None:
    """Measures the actor at ``step``; keeps it if it is the best so far;
    rolls back when ``patience`` measurements fell in a row."""
    accuracy = policy.greedy_accuracy(
      trainer.model, self.problems, *self.lengths
    )
    self.history.append((step, accuracy))
    if accuracy > self.best_accuracy:
      self.best_accuracy, self.best_step = accuracy, step
      self._best = (
        _copy(nnx.state(trainer.model, nnx.Param)),
        _copy(nnx.state(trainer.optimizer, nnx.optimizer.OptState)),
      )
    if self.rollback.update(accuracy, self.best_accuracy):
      scale = self._restore(trainer) * 0.5
      trainer.optimizer.opt_state.hyperparams[LR_SCALE][...] = scale
      self.rollbacks.append(
        {"step": step, "to_step": self.best_step, "lr_scale": scale}
      )

  def _restore(self, trainer) -> float:
    """The best params and optimizer state back; the lr scale they held."""
    params, opt_state = self._best
    nnx.update(trainer.model, _copy(params))
    nnx.update(trainer.optimizer, _copy(opt_state))
    return float(trainer.optimizer.opt_state.hyperparams[LR_SCALE][...])

  def restore_best(self, trainer) -> None:
    if self._best is not None:
      self._restore(trainer)

  def on_train_step_start(self, train_ctx):
    # Tunix's RL learner calls its trainer's train() once a step, so the
    # steps done are read from the trainer; a step's update follows
    done = train_ctx.train_steps
    measured = self.history and self.history[-1][0] == done
    if done % self.eval_every == 0 and not measured:
      self.evaluate(train_ctx, done)

  def on_train_start(self, train_ctx):
    pass

  def on_train_step_end(self, train_ctx, train_step, train_loss):
    pass

  def on_train_end(self, train_ctx):
    pass

  def on_eval_step_start(self, train_ctx):
    pass

  def on_eval_step_end(self, train_ctx, eval_loss):
    pass
