"""The README's first command: the Muon-vs-AdamW run on stdlib text."""

import importlib.util
import math
import pathlib

SCRIPT = pathlib.Path(__file__).parents[1] / "examples" / "stdlib_mlp.py"


def test_both_optimizers_learn_the_stdlib_bytes(capsys):
  spec = importlib.util.spec_from_file_location("stdlib_mlp", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  results = module.main(["--steps", "60", "--max-bytes", "400000"])
  uniform = math.log(256)  # 5.545 nats: a model that learned nothing
  assert set(results) == {"muon", "adamw"}
  for name, val_loss in results.items():
    assert val_loss < uniform - 2.0, (name, val_loss)
  out = capsys.readouterr().out
  assert "muon" in out and "adamw" in out and "val loss" in out
