"""examples/tunix_grpo, small: Tunix's own GRPO learner trains a Llama from
Tunix's model code with om.muon for 20 steps; Tunix logs the injected
learning rate. Needs Tunix (pip install -e ".[test,levanter,tunix]", CI's
third run)."""

import dataclasses

import pytest

pytest.importorskip("tunix")
pytestmark = pytest.mark.integration

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from examples.tunix_grpo import policy  # noqa: E402
from examples.tunix_grpo import train  # noqa: E402

SMALL = train.Config(
  sft_steps=60,
  grpo_steps=20,
  prompts_per_step=4,
  group_size=4,
  test_problems=8,
  validation_problems=8,
)


def test_tunix_grpo_learner_runs_20_steps_of_muon(tmp_path):
  cfg = dataclasses.replace(SMALL, out_dir=str(tmp_path))
  result = train.run(cfg)
  assert result["grpo_steps"] == 20
  # Tunix logged the lr that inject_hyperparams holds after each step (the
  # next step's): the example's schedule, warm-up over 10 steps, then decay
  # (its last entry repeats the one before: Tunix logs it before the last
  # update lands)
  np.testing.assert_allclose(
    result["learning_rate"][:19],
    [float(train.schedule(cfg)(count)) for count in range(1, 20)],
    rtol=1e-6,
  )
  assert all(np.isfinite(result["loss"]))
  # grpo_arith's monitoring ran inside Tunix's trainer: validation accuracy
  # at steps 0, 10 and 20 (the last after training)
  assert [step for step, _ in result["validation_accuracy"]] == [0, 10, 20]
  assert (tmp_path / "final.json").exists()


def test_the_actors_matrices_go_to_muon_by_the_layout():
  model = policy.make_model(layers=1, width=32, seed=0)
  tx = train.muon(SMALL, model)
  params = nnx.state(model, nnx.Param)
  state = tx.init(params)
  # the layout infer_layout reads: the q, k, v, o einsums and the MLP are
  # matrices, the embedding, the head and the norms AdamW's
  import optax_muon as om

  layout = om.infer_layout(model, *policy.example_inputs(model))
  labels = jax.tree.leaves(nnx.to_pure_dict(layout.labels))
  assert labels.count("muon") == 7, labels  # q, k, v, o, gate, up, down
  grads = jax.tree.map(
    lambda x: jax.random.normal(jax.random.key(1), x.shape, x.dtype), params
  )
  updates, _ = tx.update(grads, state, params)
  kernel = nnx.to_pure_dict(updates)["layers"][0]["mlp"]["down_proj"]["kernel"]
  # Muon's update of a matrix has equal singular values (its polar factor)
  singular = jnp.linalg.svd(kernel, compute_uv=False)
  assert float(singular.min() / singular.max()) > 0.6


def test_recovery_rolls_back_to_the_best_at_half_the_lr(monkeypatch):
  from examples.tunix_grpo import recovery

  model = policy.make_model(layers=1, width=32, seed=0)
  trainer = type("Trainer", (), {})()  # what the hook reads of Tunix's
  trainer.model = model
  trainer.optimizer = nnx.Optimizer(
    model, train.muon(SMALL, model), wrt=nnx.Param
  )
  # validation accuracy at steps 0, 10, ..., 50: best at 10, then 3 drops
  accuracies = iter([0.5, 0.6, 0.55, 0.5, 0.45, 0.7])
  monkeypatch.setattr(
    recovery.policy, "greedy_accuracy", lambda *args: next(accuracies)
  )
  monitor = recovery.Recovery([], (0, 0), eval_every=10, patience=3)
  kernel = lambda: np.asarray(model.layers[0].mlp.down_proj.kernel[...])
  kept = {}
  for step in range(0, 60, 10):
    trainer.train_steps = step
    monitor.on_train_step_start(trainer)
    monitor.on_train_step_start(trainer)  # measured once a step
    kept[step] = kernel()
    # a "training step": the params move
    model.layers[0].mlp.down_proj.kernel[...] += 0.01 * (step + 1)
  assert [s for s, _ in monitor.history] == [0, 10, 20, 30, 40, 50]
  assert monitor.rollbacks == [{"step": 40, "to_step": 10, "lr_scale": 0.5}]
  # the rollback at 40 put back what step 10 measured
  np.testing.assert_array_equal(kept[40], kept[10])
  scale = trainer.optimizer.opt_state.hyperparams[recovery.LR_SCALE]
  assert float(scale[...]) == 0.5
  assert (monitor.best_step, monitor.best_accuracy) == (50, 0.7)
  monitor.restore_best(trainer)
  np.testing.assert_array_equal(kernel(), kept[50])


def test_bad_settings_are_refused_naming_the_field():
  with pytest.raises(ValueError, match=r"optimizer='sgd' is not accepted"):
    train.Config(optimizer="sgd")
  with pytest.raises(ValueError, match="test_problems \\+ validation_problems"):
    train.Config(test_problems=400, validation_problems=200)
  # more steps than the training problems feed: refused, not cut short
  with pytest.raises(
    ValueError, match=r"grpo_steps \* prompts_per_step .* 4000.* 300 \* 16"
  ):
    train.Config(grpo_steps=300, prompts_per_step=16)


def test_the_shorter_reward_and_a_bad_reward_name():
  # 1 − length / completion_len, capped at the completion's length
  assert train.shorter(40)(None, ["", "x" * 10, "x" * 40, "x" * 50]) == [
    1.0,
    0.75,
    0.0,
    0.0,
  ]
  with pytest.raises(ValueError, match="reward='longer'.*'shaped', 'shorter'"):
    train.parse(["reward=longer"])
