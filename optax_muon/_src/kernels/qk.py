"""QK-clip (MuonClip): attention logits held under a threshold.

After each optimizer step, every attention layer reports per query head ``h``
the largest pre-softmax logit ``S_h`` of the step. For each query group ``g``
(the query heads sharing key/value head ``g``) with ``S_g = max_h∈g S_h``
above the threshold ``τ``, with ``η = τ / S_g``::

    W_q(heads of g) ← W_q · η^α;   W_k(head g) ← W_k · η^(1−α)

``W_v`` is left alone, and so is every group with ``S_g ≤ τ``, bit for bit.
``q·k`` is bilinear (RoPE is a rotation), so the group's logits on the same
inputs scale by exactly ``η``: their maximum becomes ``τ``.

Multi-head latent attention (MLA, DeepSeek-V2/V3, Kimi K2) has one query
group per head, and its logit is ``q_nope·k_nope + q_rope·k_rope`` where
``k_rope`` (from ``wkv_a``) is shared by every head, so it cannot carry a
head's share. Per clipped head ``h``::

    q_nope ← q_nope · η^α;   k_nope ← k_nope · η^(1−α);   q_rope ← q_rope · η

(``wq_b``'s and ``wkv_b``'s columns of head ``h``; ``α = ½`` is Kimi K2's
``√η``) and ``k_rope`` and ``V`` are left alone.

Kernels are in Flax's layout, ``(..., in, heads·head_dim)`` or
``(..., in, heads, head_dim)``; leading axes (stacked layers) match the
leading axes of ``max_logits`` (``(..., num_heads)``).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from optax_muon._src.base import checks as _checks
from optax_muon._src.base import types


def check_heads(num_heads, num_kv_heads, head_dim) -> None:
  for name, value in (
    ("num_heads", num_heads),
    ("num_kv_heads", num_kv_heads),
    ("head_dim", head_dim),
  ):
    _checks.check_int(name, value, minimum=1)
  if num_heads % num_kv_heads:
    raise ValueError(
      f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}"
    )


def check_clip(threshold, alpha) -> None:
  _checks.check_positive("threshold", threshold)
  _checks.check_range("alpha", alpha, 0.0, 1.0 + 1e-12)


def group_scales(
  max_logits, threshold, alpha, num_heads: int, num_kv_heads: int
):
  """Per query head and per key head factors, and which groups are clipped.

  Returns:
    ``(q_scale, k_scale, clipped, eta)`` of shapes ``(..., num_heads)``,
    ``(..., num_kv_heads)``, ``(..., num_kv_heads)``, ``(..., num_kv_heads)``;
    factors (and ``η``) are 1 where a group is not clipped, which is also
    where its max logit is not finite (``inf`` or ``nan``).
  """
  max_logits = jnp.asarray(max_logits, jnp.float32)
  if max_logits.shape[-1:] != (num_heads,):
    raise ValueError(
      f"max_logits must have num_heads={num_heads} entries on "
      f"its last axis, got shape {max_logits.shape}"
    )
  per_group = num_heads // num_kv_heads
  group_max = max_logits.reshape(
    max_logits.shape[:-1] + (num_kv_heads, per_group)
  ).max(axis=-1)
  # a non-finite max logit (an overflowed step) says nothing about the
  # scale to restore: that group is left unchanged, never zeroed (τ/∞ = 0);
  # pair the clip with optax.apply_if_finite to skip such a step
  clipped = jnp.isfinite(group_max) & (group_max > threshold)
  eta = jnp.where(clipped, threshold / jnp.where(clipped, group_max, 1.0), 1.0)
  k_scale = jnp.where(clipped, eta ** (1.0 - alpha), 1.0)
  q_scale = jnp.repeat(jnp.where(clipped, eta**alpha, 1.0), per_group, axis=-1)
  return q_scale, k_scale, clipped, eta


# Column kinds: a query, key or value column, and an MLA rope-query column,
# whose key (k_rope) is shared by all heads, so it takes the whole η.
Q, K, V, Q_ROPE = 0, 1, 2, 3


def column_map(
  num_heads: int, num_kv_heads: int, head_dim: int, part: str
) -> np.ndarray:
  """``(kind, head, group)`` of each output column of a kernel, ``(3, width)``.

  ``part`` is ``"q"``, ``"k"`` or a ``SplitQKV`` layout (``"grouped"``:
  per group ``[q_g | k_g | v_g]``; ``"concatenated"``: ``[Q | K | V]``).
  ``head`` indexes query heads for Q columns and key heads for K and V.
  """
  per_group = num_heads // num_kv_heads

  def columns(kind, heads):
    heads = np.repeat(heads, head_dim)
    group = heads // per_group if kind == Q else heads
    return np.stack([np.full_like(heads, kind), heads, group])

  query = lambda groups: columns(
    Q,
    np.concatenate(
      [np.arange(g * per_group, (g + 1) * per_group) for g in groups]
    ),
  )
  if part == "q":
    return query(range(num_kv_heads))
  if part == "k":
    return columns(K, np.arange(num_kv_heads))
  if part == "grouped":
    return np.concatenate(
      [
        np.concatenate([query([g]), columns(K, [g]), columns(V, [g])], axis=1)
        for g in range(num_kv_heads)
      ],
      axis=1,
    )
  groups = np.arange(num_kv_heads)
  return np.concatenate(
    [query(groups), columns(K, groups), columns(V, groups)], axis=1
  )


def mla_column_map(
  num_heads: int,
  qk_nope_head_dim: int,
  qk_rope_head_dim: int,
  v_head_dim: int,
  part: str,
) -> np.ndarray:
  """``column_map`` of an MLA kernel: ``part="q"`` is ``wq_b`` (or
  ``query``), per head ``[q_nope | q_rope]``; ``part="kv"`` is ``wkv_b``,
  per head ``[k_nope | v]`` (MaxText's and DeepSeek's order)."""
  if part == "q":
    per_head = [(Q, qk_nope_head_dim), (Q_ROPE, qk_rope_head_dim)]
  else:
    per_head = [(K, qk_nope_head_dim), (V, v_head_dim)]
  kinds = np.concatenate([np.full(width, kind) for kind, width in per_head])
  heads = np.repeat(np.arange(num_heads), len(kinds))
  return np.stack([np.tile(kinds, num_heads), heads, heads])


def column_factors(
  max_logits,
  columns: np.ndarray,
  threshold,
  alpha,
  num_heads: int,
  num_kv_heads: int,
):
  """Each column's factor and whether its group is clipped, ``(..., width)``
  each, for the ``column_map`` ``columns``."""
  q_scale, k_scale, clipped, eta = group_scales(
    max_logits, threshold, alpha, num_heads, num_kv_heads
  )
  kind, head, group = columns
  query_head = np.where((kind == Q) | (kind == Q_ROPE), head, 0)
  factor = jnp.where(
    kind == Q,
    q_scale[..., query_head],
    jnp.where(
      kind == K,
      k_scale[..., group],
      jnp.where(kind == Q_ROPE, eta[..., group], 1.0),
    ),
  )
  return factor, (kind != V) & clipped[..., group]


def by_column(values, kernel):
  """``(..., width)`` values broadcast against ``kernel`` (``(..., in,
  width)`` or ``(..., in, heads, head_dim)``)."""
  lead = values.ndim - 1
  if kernel.ndim == lead + 2:
    return values[..., None, :]
  if kernel.ndim == lead + 3:
    return values.reshape(values.shape[:-1] + (1,) + kernel.shape[-2:])
  raise ValueError(
    f"a kernel of shape {kernel.shape} does not match max_logits with "
    f"{lead} leading axes: expected (..., in, heads·head_dim) or "
    "(..., in, heads, head_dim)"
  )


def clip_qk(
  q_kernel: jax.Array,
  k_kernel: jax.Array,
  max_logits: jax.Array,
  *,
  threshold: types.Numeric = 100.0,
  alpha: types.Numeric = 0.5,
  num_heads: int,
  num_kv_heads: int,
  head_dim: int,
  layer_axis: int | None = None,
) -> tuple[jax.Array, jax.Array]:
  r"""Rescales the query and key kernels of groups whose logits exceed τ.

  For each query group ``g`` with ``S_g = max_{h∈g} max_logits[h] > τ`` and
  ``η = τ / S_g``: ``W_q ← W_q η^α`` for its heads, ``W_k ← W_k η^(1−α)``
  for its key head; other groups are returned bit for bit.

  Args:
    q_kernel: ``(..., in, num_heads·head_dim)`` or ``(..., in, num_heads,
      head_dim)``; leading axes are stacked layers.
    k_kernel: the same with ``num_kv_heads``.
    max_logits: ``(..., num_heads)``, the step's largest pre-softmax logit of
      each query head (leading axes as the kernels').
    threshold: ``τ > 0``.
    alpha: the share of the rescale given to the queries, in ``[0, 1]``.
    num_heads: query heads.
    num_kv_heads: key/value heads (query groups); divides ``num_heads``.
    head_dim: width of one head.
    layer_axis: the kernels' axis of stacked layers when it is not leading
      (MaxText's ``param_scan_axis=1``: ``(in, layers, ...)``); then
      ``max_logits`` is ``(layers, num_heads)``.

  Returns:
    ``(q_kernel, k_kernel)`` rescaled.

  References:
    Kimi Team, `Kimi K2: Open Agentic Intelligence
    <https://arxiv.org/abs/2507.20534>`_, 2025
  """
  check_heads(num_heads, num_kv_heads, head_dim)
  check_clip(threshold, alpha)
  return tuple(
    rescale(
      kernel,
      max_logits,
      column_map(num_heads, num_kv_heads, head_dim, part),
      threshold,
      alpha,
      num_heads,
      num_kv_heads,
      layer_axis,
      f"{part}_kernel",
      WIDTHS["mha"],
    )
    for kernel, part in ((q_kernel, "q"), (k_kernel, "k"))
  )


WIDTHS = {
  "mha": "num_heads·head_dim (q) or num_kv_heads·head_dim (k)",
  "mla": "num_heads·(qk_nope_head_dim + qk_rope_head_dim) (q) or "
  "num_heads·(qk_nope_head_dim + v_head_dim) (kv)",
  "qkv": "the split_qkv's fused width",
}


def check_kernel(
  shape, columns: np.ndarray, layer_axis, where: str, fields: str
) -> None:
  """Raises ``ValueError`` when a kernel of ``shape`` cannot hold the
  ``columns`` (``(..., in, width)`` or ``(..., in, heads, head_dim)``) or
  its ``layer_axis`` is not one of its leading axes."""
  shape = tuple(shape)
  width = columns.shape[-1]
  if layer_axis is not None:
    _checks.check_int("layer_axis", layer_axis, minimum=0)
    matrix_axes = 2 if shape[-1:] == (width,) else 3
    if layer_axis >= len(shape) - matrix_axes + 1 or len(shape) < 3:
      raise ValueError(
        f"layer_axis={layer_axis} of {where} (shape {shape}) is not one of "
        f"its stacked-layer axes; accepted: 0 to "
        f"{max(len(shape) - matrix_axes, 0)} (an axis before the kernel's "
        "(in, width) or (in, heads, head_dim) axes)"
      )
    shape = shape[:layer_axis] + shape[layer_axis + 1 :]
  if not (
    shape[-1:] == (width,)
    or (len(shape) >= 3 and shape[-2] * shape[-1] == width)
  ):
    raise ValueError(
      f"{where} of shape {shape} has no (in, {width}) or (in, heads, "
      f"head_dim) axes of width {width} = {fields}; check those fields"
    )


def layers_first(max_logits, kernel, layer_axis, where: str):
  """``kernel`` with its ``layer_axis`` moved to the front, checked
  against ``max_logits`` ``(layers, ..., heads)``."""
  if layer_axis is None:
    return kernel
  kernel = jnp.moveaxis(kernel, layer_axis, 0)
  if jnp.ndim(max_logits) < 2 or jnp.shape(max_logits)[0] != kernel.shape[0]:
    raise ValueError(
      f"{where} has {kernel.shape[0]} layers on axis {layer_axis}, so "
      f"max_logits must be ({kernel.shape[0]}, num_heads); got shape "
      f"{tuple(jnp.shape(max_logits))}"
    )
  return kernel


def rescale(
  kernel,
  max_logits,
  columns,
  threshold,
  alpha,
  num_heads,
  num_kv_heads,
  layer_axis=None,
  where="kernel",
  fields="",
):
  check_kernel(jnp.shape(kernel), columns, layer_axis, where, fields)
  kernel = layers_first(max_logits, kernel, layer_axis, where)
  # (..., in, width) or (..., in, heads, head_dim): the one whose leading
  # (stacked-layer) axes are max_logits' (one head makes both fit the width)
  width, shape = columns.shape[-1], tuple(kernel.shape)
  logits_lead = tuple(jnp.shape(max_logits)[:-1])
  forms = [
    k
    for k in (2, 3)
    if len(shape) >= k
    and math.prod(shape[-(k - 1) :]) == width
    and shape[:-k] == logits_lead
  ]
  if not forms:
    raise ValueError(
      f"{where} of shape {shape} has no stacked-layer axes matching "
      f"max_logits of shape {tuple(jnp.shape(max_logits))} (its leading "
      f"axes {logits_lead}); when the kernel's layers are not its leading "
      "axes, pass layer_axis="
    )
  factor, _ = column_factors(
    max_logits, columns, threshold, alpha, num_heads, num_kv_heads
  )
  out = (kernel * by_column(factor, kernel).astype(kernel.dtype)).astype(
    kernel.dtype
  )
  return out if layer_axis is None else jnp.moveaxis(out, 0, layer_axis)


def check_mla(num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim):
  for name, value in (
    ("num_heads", num_heads),
    ("qk_nope_head_dim", qk_nope_head_dim),
    ("v_head_dim", v_head_dim),
  ):
    _checks.check_int(name, value, minimum=1)
  _checks.check_int("qk_rope_head_dim", qk_rope_head_dim, minimum=0)


def clip_mla_qk(
  q_kernel: jax.Array,
  kv_kernel: jax.Array,
  max_logits: jax.Array,
  *,
  threshold: types.Numeric = 100.0,
  alpha: types.Numeric = 0.5,
  num_heads: int,
  qk_nope_head_dim: int,
  qk_rope_head_dim: int,
  v_head_dim: int,
  layer_axis: int | None = None,
) -> tuple[jax.Array, jax.Array]:
  r"""QK-clip of one multi-head latent attention (MLA) layer.

  For each head ``h`` with ``S_h = max_logits[h] > τ`` and ``η = τ / S_h``:
  its ``q_nope`` columns ``← · η^α``, its ``q_rope`` columns ``← · η``, its
  ``k_nope`` columns ``← · η^(1−α)``; its ``v`` columns, the shared rope key
  (``wkv_a``, not passed) and heads under τ are returned bit for bit. With
  ``α = ½`` this is Kimi K2's MuonClip for MLA and MaxText's
  ``qk_clip_utils`` (``√η`` on ``q_nope`` and ``k_nope``, ``η`` on ``q_rope``).

  Args:
    q_kernel: ``wq_b`` (or ``query`` without a query LoRA), ``(..., in,
      num_heads·(qk_nope_head_dim + qk_rope_head_dim))`` or ``(..., in,
      num_heads, qk_nope_head_dim + qk_rope_head_dim)``, each head
      ``[q_nope | q_rope]``; leading axes are stacked layers.
    kv_kernel: ``wkv_b``, the same with per head ``[k_nope | v]``
      (``qk_nope_head_dim + v_head_dim``).
    max_logits: ``(..., num_heads)``, the step's largest pre-softmax logit of
      each head (leading axes as the kernels').
    threshold: ``τ > 0``.
    alpha: the share of the nope rescale given to the queries, in ``[0, 1]``.
    num_heads: attention heads.
    qk_nope_head_dim: per-head width of the non-rotary query and key.
    qk_rope_head_dim: per-head width of the rotary query (and of the shared
      rotary key).
    v_head_dim: per-head width of the values.
    layer_axis: as in ``clip_qk`` (MaxText's scanned MLA: ``(rank, layers,
      heads, dim)`` is ``layer_axis=1``).

  Returns:
    ``(q_kernel, kv_kernel)`` rescaled.

  References:
    Kimi Team, `Kimi K2: Open Agentic Intelligence
    <https://arxiv.org/abs/2507.20534>`_, 2025;
    DeepSeek-AI, `DeepSeek-V2 <https://arxiv.org/abs/2405.04434>`_, 2024
  """
  check_mla(num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)
  check_clip(threshold, alpha)
  dims = (num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)
  return tuple(
    rescale(
      kernel,
      max_logits,
      mla_column_map(*dims, part),
      threshold,
      alpha,
      num_heads,
      num_heads,
      layer_axis,
      f"{part}_kernel",
      WIDTHS["mla"],
    )
    for kernel, part in ((q_kernel, "q"), (kv_kernel, "kv"))
  )
