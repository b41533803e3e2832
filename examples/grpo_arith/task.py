"""The verifiable task: integer arithmetic word problems, answers in \\boxed{}.

A problem is a short story of ``level`` operations on small integers
("Ada has 7 coins. They get 5 more. It doubles. They lose 3. How many coins
now?"); its answer is an integer, and a worked solution writes one
equation a step and ends with ``\\boxed{answer}``. Train and test problems
come from separate random streams of one seed, and no test question appears
among the train ones.

The reward reads the format and the answer separately:

* format: the text holds exactly one ``\\boxed{...}`` and it is well formed,
  an optional minus sign and digits inside (``\\boxed{}``, ``\\boxed{12``,
  ``\\boxed{{3}}`` or two boxes fail it);
* correctness: the boxed integer when the format holds, else the last integer
  in the text;
* ``shaped`` (default): ``0.3·format + 0.7·correct``, a signal even when the
  box is lost; strict: ``format·correct``.
"""

import dataclasses
import random
import re

NAMES = ("Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Ivy")
ITEMS = ("apples", "coins", "marbles", "stamps", "shells", "cards")
_BOX = re.compile(r"\\boxed\{(-?\d+)\}")
_INTEGER = re.compile(r"-?\d+")


@dataclasses.dataclass(frozen=True)
class Problem:
  question: str
  answer: int
  solution: str  # worked steps ending in \boxed{answer}
  level: int


def make_problem(rng: random.Random, level: int) -> Problem:
  """A problem of ``level`` operations (+, − or ×) on numbers below 10."""
  name, item = rng.choice(NAMES), rng.choice(ITEMS)
  value = rng.randint(2, 9)
  sentences = [f"{name} has {value} {item}."]
  steps = []
  for _ in range(level):
    op = rng.choice("+-*")
    operand = rng.randint(2, 3) if op == "*" else rng.randint(1, 9)
    if op == "-" and operand > value:
      op = "+"  # counts stay non-negative
    new = {"+": value + operand, "-": value - operand, "*": value * operand}[op]
    sentences.append(
      {
        "+": f"They get {operand} more.",
        "-": f"They lose {operand}.",
        "*": "It doubles." if operand == 2 else "It triples.",
      }[op]
    )
    steps.append(f"{value} {'x' if op == '*' else op} {operand} = {new}.")
    value = new
  question = " ".join(sentences) + f" How many {item} now?"
  solution = " ".join(steps) + f" \\boxed{{{value}}}"
  return Problem(question, value, solution, level)


def problems(
  split: str, count: int, *, seed: int = 0, levels=(1, 2, 3)
) -> list[Problem]:
  """``count`` problems of ``split`` ("train" or "test"), levels mixed."""
  if split not in ("train", "test"):
    raise ValueError(
      f"split={split!r} is not accepted; accepted: ['train', 'test']"
    )
  rng = random.Random(f"{seed}-{split}")
  held_out = set()
  if split == "train":  # keep test questions out of the train set
    held_out = {
      p.question for p in problems("test", 500, seed=seed, levels=levels)
    }
  out = []
  while len(out) < count:
    problem = make_problem(rng, rng.choice(tuple(levels)))
    if problem.question not in held_out:
      out.append(problem)
  return out


def format_ok(text: str) -> bool:
  """Exactly one ``\\boxed{``, and it is a well-formed ``\\boxed{<integer>}``."""
  return text.count("\\boxed{") == 1 and _BOX.search(text) is not None


def extract_answer(text: str) -> int | None:
  """The boxed integer if the format holds, else the text's last integer."""
  if format_ok(text):
    return int(_BOX.search(text).group(1))
  numbers = _INTEGER.findall(text)
  return int(numbers[-1]) if numbers else None


def reward(text: str, answer: int, *, shaped: bool = True) -> float:
  """``0.3·format + 0.7·correct`` (``shaped``) or ``format·correct``."""
  well_formed = format_ok(text)
  correct = extract_answer(text) == answer
  if shaped:
    return 0.3 * well_formed + 0.7 * correct
  return float(well_formed and correct)
