"""The rules that turn a leaf's uses (``uses``) into its role, its label
and its view: what no matmul reads as a matrix, which output axes are
batch axes, which matmuls belong to AdamW (a vector's product, the output
head), what a fused kernel needs said, and the name rules' fallback when the
program cannot be read."""

import math
import re
from collections.abc import Set as AbstractSet

import jax.numpy as jnp
from optax.contrib import MuonDimensionNumbers

from optax_muon._src.base import paths as _paths
from optax_muon._src.inference import axes as _axes
from optax_muon._src.views import labels as labels_lib
from optax_muon._src.views import layout as layout_lib

# The fallback when the program does not show the expert axis (the structural
# rule: a product axis batched with another param's matmul): a path
# component that names experts (MaxText's MoeBlock_0, moe_layers,
# routed_experts, GptOssMlp; expert, experts, moe).
_EXPERT_NAMES = re.compile(
  r"(^|/)[^/]*(expert|moe|gptossmlp)[^/]*(/|$)", re.IGNORECASE
)


def _not_a_matrix(leaf, uses: AbstractSet, kinds: set):
  """``(role, label, None, reason)`` of a leaf no single matmul reads as a
  matrix (not float, unused, looked up, depthwise, elementwise, read along
  different axes), else ``None``."""
  if not labels_lib.is_float(leaf):
    return "vector", labels_lib.NONE, None, "not floating point: no update"
  unknown = sorted(u.reason for u in uses if u.kind == "unknown")
  if not uses:
    return "unused", None, None, "not used by the traced function"
  if "gather" in kinds:
    return "embedding", labels_lib.ADAM, None, "looked up by gather"
  if unknown:
    return "unknown", None, None, unknown[0]
  if "depthwise" in kinds:
    return (
      "conv",
      labels_lib.ADAM,
      None,
      "grouped or depthwise conv (feature_group_count > 1)",
    )
  matrix_uses = {
    (u.reduction, u.output) for u in uses if u.kind in ("dot", "conv")
  }
  if not matrix_uses:
    return "vector", labels_lib.ADAM, None, "used elementwise only"
  if len(matrix_uses) > 1:
    return (
      "unknown",
      None,
      None,
      "multiplied along different axes in different places",
    )
  return None


def _without_batch_axes(
  path, uses: AbstractSet, reduction, output, reason: str
):
  """``(output axes, reason)`` with the output axes that are batch axes
  taken out: indexed apart, another matmul's batch (experts), or, where
  the structure leaves a tie, a free axis under an expert/moe name that
  stands before the fan-in (experts are stacked in front of their matrices,
  ``(E, in, out)``, ``(E, layers, in, out)``; an attention projection's
  heads axis comes after its fan-in, ``(in, layers, heads, head_dim)``)."""
  for kind, why in (
    ("split", "indexed apart after the matmul (its parts are used separately)"),
    ("expert", "a batch dim of another parameter's matmul (an expert axis)"),
  ):
    axes = _axes.union(*[u.output for u in uses if u.kind == kind]) & output
    if axes and output - axes:
      output = output - axes
      reason += (
        f"; output axis {', '.join(map(str, sorted(axes)))} is "
        f"{why}: a batch axis"
      )
  # a name breaks a tie the structure leaves open; it never overrides it
  classed = _axes.union(*[u.output for u in uses if u.kind == "attention"])
  undecided = {a for a in output - classed if a < min(reduction, default=0)}
  if (
    len(output) > 1
    and undecided
    and _EXPERT_NAMES.search(_paths.path_string(path))
  ):
    batch_axis = min(undecided)
    output = output - {batch_axis}
    reason += (
      f"; axis {batch_axis} is a free dim under an expert/moe path, "
      "so by name it is the expert (batch) axis"
    )
  return output, reason


def _adam_reason(shape, reduction, output, index, heads, vocab):
  """Why a matmul's leaf goes to AdamW (a vector's product, an output
  head), or ``None``."""
  if not reduction or not output:
    return "vector", "a matmul with a vector"
  fan_in = math.prod(shape[a] for a in reduction)
  fan_out = math.prod(shape[a] for a in output)
  if min(fan_in, fan_out) == 1:
    return "vector", "a matmul with a vector"
  if index in heads:
    return (
      "head",
      "its product reaches the output through no other parameter's matmul",
    )
  if not heads and fan_out in vocab:
    return (
      "head",
      "no structural head; fan-out equals the embedding's vocabulary",
    )
  return None


def _fused_notes(path, uses: AbstractSet, output, reason: str) -> str:
  """``reason`` with what a fused QKV or gate/up kernel needs said."""
  if (
    re.search(
      layout_lib.SplitQKV.pattern, _paths.path_string(path), re.IGNORECASE
    )
    and "indexed apart" not in reason
  ):
    reason += "; a fused QKV kernel is one matrix unless split_qkv= is given"
  gated = _axes.union(*[u.output for u in uses if u.kind == "gated"]) & output
  if gated:
    reason += (
      "; its output's two halves are multiplied together (a fused "
      "gate/up): split_gate_up=om.SplitGateUp() orthogonalizes "
      "them apart, as Megatron-Core does for a gated linear_fc1"
    )
  return reason


def decide(
  path,
  leaf,
  uses: AbstractSet,
  heads: AbstractSet,
  index: int,
  vocab: AbstractSet,
):
  """``(role, label, MuonDimensionNumbers | None, reason)`` of one leaf."""
  kinds = {u.kind for u in uses}
  decided = _not_a_matrix(leaf, uses, kinds)
  if decided is not None:
    return decided
  ((reduction, output),) = {
    (u.reduction, u.output) for u in uses if u.kind in ("dot", "conv")
  }
  role = "conv" if "conv" in kinds else "matrix"
  reason = (
    "conv kernel: input features and spatial dims are the fan-in"
    if role == "conv"
    else "contracting dims are the fan-in"
  )
  output, reason = _without_batch_axes(path, uses, reduction, output, reason)
  adam = _adam_reason(
    tuple(jnp.shape(leaf)), reduction, output, index, heads, vocab
  )
  if adam is not None:
    return adam[0], labels_lib.ADAM, None, adam[1]
  dims = MuonDimensionNumbers(
    reduction_axis=tuple(sorted(reduction)), output_axis=tuple(sorted(output))
  )
  return role, labels_lib.MUON, dims, _fused_notes(path, uses, output, reason)


def fall_back(path, leaf, label, reason):
  """``(dims, reason)`` of a leaf whose use the walk could not read (a
  ``pallas_call``, a custom call): its role stays ``unknown`` and the name
  rules' ``label`` routes it; a 2-axis Muon leaf is ``(in, out)``, one of
  3+ axes under an expert/moe path has its leading axes as experts (batch)
  and its last two as ``(in, out)``; any other Muon leaf of 3+ axes gets no
  dimension numbers, so ``om.muon`` raises at ``init`` naming it."""
  reason += "; decided by the fallback rules"
  ndim = jnp.ndim(leaf)
  if label != labels_lib.MUON:
    return None, reason + f": the name rules route it to {label}"
  if ndim == 2:
    return None, reason + ": the name rules route it to muon, as (in, out)"
  if _EXPERT_NAMES.search(_paths.path_string(path)):
    dims = MuonDimensionNumbers(
      reduction_axis=(ndim - 2,), output_axis=(ndim - 1,)
    )
    return dims, (
      reason + ": under an expert/moe path, the leading axes are experts "
      "(batch) and the last two (in, out)"
    )
  return None, (
    reason + ": none decides which of its axes form the matrices; give "
    "dimension_numbers= or labels= for it"
  )
