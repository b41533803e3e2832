"""examples/grpo_arith/task.py: the answer format, the reward, the split."""

import random

import pytest

from examples.grpo_arith import task


@pytest.mark.parametrize(
  "text,answer,well_formed",
  [
    ("3 + 4 = 7. \\boxed{7}", 7, True),
    ("\\boxed{-12}", -12, True),
    ("so \\boxed{7} and 9", 7, True),  # the box wins over a later 9
    ("\\boxed{}", None, False),  # empty box
    ("the sum is 5 \\boxed{}", 5, False),  # empty: the last integer
    ("\\boxed{12", 12, False),  # unclosed
    ("\\boxed{{3}}", 3, False),  # nested braces
    ("\\boxed{3} \\boxed{4}", 4, False),  # two boxes
    ("\\boxed{3.5}", 5, False),  # not an integer
    ("no number at all", None, False),
    ("it is -8", -8, False),  # a negative without a box
  ],
)
def test_extract_answer_and_format(text, answer, well_formed):
  assert task.format_ok(text) is well_formed
  assert task.extract_answer(text) == answer


def test_shaped_and_strict_rewards():
  assert task.reward("\\boxed{7}", 7) == pytest.approx(1.0)
  assert task.reward("\\boxed{6}", 7) == pytest.approx(0.3)  # format only
  assert task.reward("it is 7", 7) == pytest.approx(0.7)  # box lost
  assert task.reward("it is 6", 7) == 0.0
  assert task.reward("\\boxed{7}", 7, shaped=False) == 1.0
  assert task.reward("it is 7", 7, shaped=False) == 0.0  # format collapse
  assert task.reward("\\boxed{6}", 7, shaped=False) == 0.0


def test_worked_solutions_compute_their_answers():
  rng = random.Random(0)
  for level in (1, 2, 3):
    for _ in range(50):
      problem = task.make_problem(rng, level)
      assert problem.solution.count("=") == level
      assert task.reward(problem.solution, problem.answer, shaped=False) == 1.0
      assert problem.answer >= 0


def test_train_and_test_are_disjoint_and_seeded():
  test = task.problems("test", 200, seed=3)
  train = task.problems("train", 400, seed=3)
  assert not {p.question for p in test} & {p.question for p in train}
  assert task.problems("test", 200, seed=3) == test
  assert task.problems("test", 200, seed=4) != test
  with pytest.raises(ValueError, match="split='val'"):
    task.problems("val", 1)
