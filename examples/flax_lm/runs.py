"""A comparison's runs, for both examples' ``compare.py``: each run's settings
as recorded, a finished run reused instead of trained again, its line shown
under the comparison's bar, the ``--lrs`` flag, and one compilation cache for
the whole call."""

import contextlib
import dataclasses
import json
import pathlib
import shutil
import tempfile
from collections.abc import Callable

import jax

from examples.flax_lm import progress


def settings_of(cfg, dropped=("out_dir", "progress")) -> dict:
  """The run's settings as JSON, without the ``train.*`` fields in
  ``dropped`` (where it was written, how it was shown: results move)."""
  settings = json.loads(json.dumps(dataclasses.asdict(cfg), default=float))
  for field in dropped:
    settings["train"].pop(field)
  return settings


def reuse_or_train(
  run_dir: pathlib.Path, settings: dict, train, reuse: bool
) -> tuple[dict, bool]:
  """``(final, trained)``: with ``reuse``, the ``final.json`` of a run in
  ``run_dir`` that finished with ``settings``; else ``train()``'s, run afresh,
  its settings recorded (``config.json``) and its checkpoints dropped (the
  curves suffice)."""
  finished, recorded = run_dir / "final.json", run_dir / "config.json"
  if (
    reuse
    and finished.exists()
    and recorded.exists()
    and json.loads(recorded.read_text()) == settings
  ):
    return json.loads(finished.read_text()), False
  shutil.rmtree(run_dir, ignore_errors=True)
  final = train()
  recorded.write_text(json.dumps(settings))
  shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
  return final, True


def run_shown(
  name: str,
  run_dir: pathlib.Path,
  settings: dict,
  train: Callable[[], dict],
  reuse: bool,
  runs_bar: progress.RunsBar | None,
  describe: Callable[[dict], str],
) -> dict:
  """``reuse_or_train`` under the comparison's bar: the run's name while it
  trains, then ``describe(final)`` above the bar (printed without one)."""
  if runs_bar is not None:
    runs_bar.start(name)
  final, trained = reuse_or_train(run_dir, settings, train, reuse)
  line = f"  {name}: {describe(final)}" + ("" if trained else " (reused)")
  if runs_bar is not None:
    runs_bar.done(line)
  elif trained:
    print(line, flush=True)
  return final


@contextlib.contextmanager
def compilation_cache():
  """JAX's persistent compilation cache in a temporary folder for the call,
  unless one is configured: the runs of one lr (its seeds) share their
  compiled programs instead of compiling them again."""
  if jax.config.jax_compilation_cache_dir:
    yield
    return
  min_time = jax.config.jax_persistent_cache_min_compile_time_secs
  with tempfile.TemporaryDirectory(prefix="compare-jax-cache-") as folder:
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    try:
      yield
    finally:
      jax.config.update("jax_compilation_cache_dir", None)
      jax.config.update("jax_persistent_cache_min_compile_time_secs", min_time)


def parse_lrs(items, names) -> dict:
  """``["adam=1e-3,2e-3", ...]`` as ``{"adam": (1e-3, 2e-3), ...}``; every
  name must be one of ``names``."""
  sweeps = {}
  for item in items:
    name, _, lrs = item.partition("=")
    if name not in names or not lrs:
      raise ValueError(
        f"--lrs {item!r}: expected NAME=LR,LR with NAME in {list(names)}"
      )
    sweeps[name] = tuple(float(lr) for lr in lrs.split(","))
  return sweeps
