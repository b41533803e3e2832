"""One progress bar over the runs of a comparison (``compare.py`` here and
in ``examples/grpo_arith``): runs done of the total and the current run's
name, the run's own step bar beneath it, each finished run's result printed
above both."""

import sys

from tqdm import tqdm


class RunsBar:
  """The overall bar; ``add`` grows the total when a sweep is extended."""

  def __init__(self, total: int, enabled: bool = True):
    self._bar = tqdm(
      total=total,
      desc="runs",
      unit="run",
      file=sys.stdout,
      disable=not enabled,
      position=0,
      bar_format="{desc} {n_fmt}/{total_fmt} |{bar}| {elapsed} {postfix}",
    )
    self.enabled = enabled

  def start(self, name: str) -> None:
    self._bar.set_postfix_str(name)

  def done(self, line: str) -> None:
    """A run finished (or was reused): its result above the bars."""
    tqdm.write(line, file=sys.stdout)
    self._bar.update(1)

  def add(self, runs: int) -> None:
    self._bar.total += runs
    self._bar.refresh()

  def close(self) -> None:
    self._bar.close()


def step_bar(iterable, *, nested: bool, **kwargs):
  """A run's own step bar: beneath a ``RunsBar`` (``nested``), cleared when
  the run ends; else a bar of its own."""
  if nested:
    kwargs.update(position=1, leave=False)
  return tqdm(iterable, **kwargs)
