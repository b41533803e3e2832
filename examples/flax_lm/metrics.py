"""What a run records besides its loss: ``metrics.jsonl`` (one JSON record a
line, cut back to the checkpoint on resume), each Muon group's update RMS,
and ``run.json`` (sizes and FLOPs per step, for compare.py's plots). Shared
with the GRPO example."""

import json
import math
import pathlib
import platform
import re

import jax
import jax.numpy as jnp

import optax_muon as om
from examples.flax_lm import config as config_lib


def matrix_group(path) -> str:
  """``['blocks'][3]['attn']['qkv']['kernel'].value`` → ``attn/qkv``."""
  names = re.findall(r"'([^']+)'", jax.tree_util.keystr(path))
  return "/".join(n for n in names if n not in ("blocks", "kernel"))


def named_leaves(tree) -> dict:
  """``{keystr(path): (path, leaf)}`` over the tree's leaves."""
  return {
    jax.tree_util.keystr(path): (path, leaf)
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


def update_rms_by_group(updates, groups: dict) -> dict:
  """``{"update_rms/<group>": mean update RMS}`` over the leaves of each
  group; ``groups`` maps ``named_leaves`` keys to group names."""
  rms = named_leaves(om.update_rms(updates))
  members = {}
  for key, group in groups.items():
    members.setdefault(group, []).append(jnp.mean(rms[key][1]))
  return {
    f"update_rms/{group}": jnp.mean(jnp.stack(values))
    for group, values in members.items()
  }


def _ns(steps: int, a: int, b: int) -> float:
  m, n = min(a, b), max(a, b)
  return steps * (4 * m * m * n + 2 * m**3)


def _matrix_flops(optim: om.MuonConfig, steps: int, fan_in, fan_out):
  """One matrix's orthogonalization FLOPs a step under ``optim``."""
  shorter, longer = min(fan_in, fan_out), max(fan_in, fan_out)
  if optim.optimizer == "dion2":  # k selected slices of the shorter axis
    return _ns(steps, max(1, math.ceil(optim.dion2_fraction * shorter)), longer)
  if optim.optimizer == "nordion2":  # k selected output neurons
    selected = max(1, math.ceil(optim.dion2_fraction * fan_out))
    return _ns(steps, selected, fan_in)
  if optim.optimizer == "dion":  # B·Q, Bᵀ·P and a Householder QR of P
    r = min(shorter, math.ceil(optim.dion_rank_fraction * shorter))
    return 4 * longer * shorter * r + 4 * longer * r * r - 4 * r**3 / 3
  return _ns(steps, fan_in, fan_out)


def orthogonalization_flops(
  params, labels, optim: om.MuonConfig, steps: int
) -> float:
  """FLOPs a step of orthogonalizing every Muon matrix: Newton–Schulz's
  ``T·(4m²n + 2m³)`` (m ≤ n) on what it orthogonalizes (Muon's whole
  matrix; Dion2's ``⌈fraction·m⌉`` selected slices of the shorter axis,
  NorDion2's of ``fan_out``), or Dion's power iteration on the tall side
  (``4mnr`` for ``B·Q`` and ``Bᵀ·P``, ``4mr² − 4r³/3`` for the QR)."""
  total = 0.0
  for leaf, label in zip(jax.tree.leaves(params), jax.tree.leaves(labels)):
    if label == "muon":
      *batch, fan_in, fan_out = leaf.shape
      total += math.prod(batch) * _matrix_flops(optim, steps, fan_in, fan_out)
  return total


def run_summary(cfg: config_lib.RunConfig, params, labels, corpus) -> dict:
  """``run.json``: what was trained, on what, at how many FLOPs a step."""
  tokens_per_step = cfg.train.batch_size * cfg.model.block_size
  size = int(sum(x.size for x in jax.tree.leaves(params)))
  muon = cfg.optim.optimizer in config_lib.MUON_OPTIMIZERS
  ns_steps = (
    5 if cfg.train.muon_impl == "optax.contrib" else cfg.optim.muon_num_ns_steps
  )
  return {
    "name": cfg.name,
    "preset": cfg.preset,
    "optimizer": cfg.optim.optimizer,
    "processes": jax.process_count(),
    "model_flops_per_step": 6 * size * tokens_per_step,
    "ns_flops_per_step": (
      orthogonalization_flops(params, labels, cfg.optim, ns_steps)
      if muon
      else 0.0
    ),
    "params": size,
    "python": platform.python_version(),
    "corpus": corpus.describe(),
  }


def read_metrics(path: pathlib.Path, upto: int) -> list[str]:
  """The records of ``path`` up to step ``upto``, as lines."""
  if not path.exists():
    return []
  return [
    line
    for line in path.read_text().splitlines()
    if line.strip() and json.loads(line)["step"] <= upto
  ]


class MetricsLog:
  """``metrics.jsonl``, opened for appending after the records up to
  ``start`` (a resumed run drops what was logged after its checkpoint).
  ``enabled=False`` (every process of a run but the first) writes nothing.

      with MetricsLog(out / "metrics.jsonl", start) as log:
        log.write({"step": 1, "train_loss": 2.5})
  """

  def __init__(self, path: pathlib.Path, start: int, enabled: bool = True):
    self.path, self.enabled, self._file = path, enabled, None
    if enabled:
      kept = read_metrics(path, start) if start else []
      path.write_text("".join(line + "\n" for line in kept))

  def __enter__(self) -> "MetricsLog":
    if self.enabled:
      self._file = self.path.open("a")
    return self

  def __exit__(self, *exc_info) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None

  def write(self, record: dict) -> None:
    if self._file is not None:
      self._file.write(json.dumps(record) + "\n")
      self._file.flush()
