"""QK-clip (MuonClip): attention logits held under a threshold.

After each optimizer step, every attention layer reports per query head ``h``
the largest pre-softmax logit ``S_h`` of the step. For each query group ``g``
(the query heads sharing key/value head ``g``) with ``S_g = max_h∈g S_h``
above the threshold ``τ``, with ``η = τ / S_g``::

    W_q(heads of g) ← W_q · η^α;   W_k(head g) ← W_k · η^(1−α)

``W_v`` is left alone, and so is every group with ``S_g ≤ τ``, bit for bit.
``q·k`` is bilinear (RoPE is a rotation), so the group's logits on the same
inputs scale by exactly ``η``: their maximum becomes ``τ``.

Kernels are in Flax's layout, ``(..., in, heads·head_dim)`` or
``(..., in, heads, head_dim)``; leading axes (stacked layers) match the
leading axes of ``max_logits`` (``(..., num_heads)``).
"""

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_muon import _checks
from optax_muon import _paths
from optax_muon import layout


def _check_heads(num_heads, num_kv_heads, head_dim) -> None:
  for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                      ("head_dim", head_dim)):
    _checks.check_int(name, value, minimum=1)
  if num_heads % num_kv_heads:
    raise ValueError(f"num_kv_heads={num_kv_heads} must divide "
                     f"num_heads={num_heads}")


def _check_clip(threshold, alpha) -> None:
  _checks.check_positive("threshold", threshold)
  _checks.check_range("alpha", alpha, 0.0, 1.0 + 1e-12)


def group_scales(max_logits, threshold, alpha, num_heads: int,
                 num_kv_heads: int):
  """Per query head and per key head factors, and which groups are clipped.

  Returns:
    ``(q_scale, k_scale, clipped)`` of shapes ``(..., num_heads)``,
    ``(..., num_kv_heads)``, ``(..., num_kv_heads)``; factors are 1 where a
    group is not clipped.
  """
  max_logits = jnp.asarray(max_logits, jnp.float32)
  if max_logits.shape[-1:] != (num_heads,):
    raise ValueError(f"max_logits must have num_heads={num_heads} entries on "
                     f"its last axis, got shape {max_logits.shape}")
  per_group = num_heads // num_kv_heads
  group_max = max_logits.reshape(
      max_logits.shape[:-1] + (num_kv_heads, per_group)).max(axis=-1)
  clipped = group_max > threshold
  eta = jnp.where(clipped, threshold / jnp.where(clipped, group_max, 1.0), 1.0)
  k_scale = jnp.where(clipped, eta ** (1.0 - alpha), 1.0)
  q_scale = jnp.repeat(jnp.where(clipped, eta ** alpha, 1.0), per_group,
                       axis=-1)
  return q_scale, k_scale, clipped


Q, K, V = 0, 1, 2


def column_map(num_heads: int, num_kv_heads: int, head_dim: int,
               part: str) -> np.ndarray:
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

  query = lambda groups: columns(Q, np.concatenate(
      [np.arange(g * per_group, (g + 1) * per_group) for g in groups]))
  if part == "q":
    return query(range(num_kv_heads))
  if part == "k":
    return columns(K, np.arange(num_kv_heads))
  if part == "grouped":
    return np.concatenate([np.concatenate([query([g]), columns(K, [g]),
                                           columns(V, [g])], axis=1)
                           for g in range(num_kv_heads)], axis=1)
  groups = np.arange(num_kv_heads)
  return np.concatenate([query(groups), columns(K, groups), columns(V, groups)],
                        axis=1)


def column_factors(max_logits, columns: np.ndarray, threshold, alpha,
                   num_heads: int, num_kv_heads: int):
  """Each column's factor and whether its group is clipped, ``(..., width)``
  each, for the ``column_map`` ``columns``."""
  q_scale, k_scale, clipped = group_scales(max_logits, threshold, alpha,
                                           num_heads, num_kv_heads)
  kind, head, group = columns
  factor = jnp.where(kind == Q, q_scale[..., np.where(kind == Q, head, 0)],
                     jnp.where(kind == K, k_scale[..., group], 1.0))
  return factor, (kind != V) & clipped[..., group]


def _by_column(values, kernel):
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
      "(..., in, heads, head_dim)")


def clip_qk(q_kernel, k_kernel, max_logits, *, threshold=100.0, alpha=0.5,
            num_heads: int, num_kv_heads: int, head_dim: int):
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

  Returns:
    ``(q_kernel, k_kernel)`` rescaled.

  References:
    Kimi Team, `Kimi K2: Open Agentic Intelligence
    <https://arxiv.org/abs/2507.20534>`_, 2025
  """
  _check_heads(num_heads, num_kv_heads, head_dim)
  _check_clip(threshold, alpha)
  out = []
  for kernel, part in ((q_kernel, "q"), (k_kernel, "k")):
    factor, _ = column_factors(
        max_logits, column_map(num_heads, num_kv_heads, head_dim, part),
        threshold, alpha, num_heads, num_kv_heads)
    out.append((kernel * _by_column(factor, kernel).astype(kernel.dtype))
               .astype(kernel.dtype))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class _Layer:
  """One attention layer: its kernels, each with its ``column_map`` part
  (``"q"``, ``"k"`` or a fused layout), and its head counts."""
  name: str
  parts: tuple[tuple[tuple[str, ...], str], ...]
  num_heads: int
  num_kv_heads: int
  head_dim: int


def _as_path(path) -> tuple[str, ...]:
  return tuple(path.split("/")) if isinstance(path, str) else tuple(path)


def _layers(attention: Mapping[str, Mapping[str, Any]]) -> list[_Layer]:
  if not isinstance(attention, Mapping) or not attention:
    raise ValueError("attention must be a non-empty dict from a layer name to "
                     "{'q': path, 'k': path, 'num_heads', 'num_kv_heads', "
                     "'head_dim'} or {'qkv': path, 'split_qkv': SplitQKV(...)}")
  layers = []
  for name, spec in attention.items():
    where = f"attention[{name!r}]"
    if "qkv" in spec:
      split = spec.get("split_qkv")
      if not isinstance(split, layout.SplitQKV):
        raise ValueError(f"{where} has 'qkv' and needs 'split_qkv': a "
                         f"SplitQKV with its head counts, got {split!r}")
      unknown = set(spec) - {"qkv", "split_qkv"}
      layers.append(_Layer(name, ((_as_path(spec["qkv"]), split.layout),),
                           split.num_heads, split.num_kv_heads, split.head_dim))
    else:
      needed = {"q", "k", "num_heads", "num_kv_heads", "head_dim"}
      if needed - set(spec):
        raise ValueError(f"{where} lacks {sorted(needed - set(spec))}; "
                         f"accepted keys: {sorted(needed)} or "
                         "['qkv', 'split_qkv']")
      unknown = set(spec) - needed
      _check_heads(spec["num_heads"], spec["num_kv_heads"], spec["head_dim"])
      layers.append(_Layer(name, ((_as_path(spec["q"]), "q"),
                                  (_as_path(spec["k"]), "k")),
                           spec["num_heads"], spec["num_kv_heads"],
                           spec["head_dim"]))
    if unknown:
      raise ValueError(f"{where} has unknown keys {sorted(unknown)}")
  return layers


def qk_clip(threshold=100.0, alpha=0.5, *,
            attention) -> optax.GradientTransformationExtraArgs:
  r"""QK-clip as the last transform of a chain (Megatron-Core's MuonClip).

  ``update(updates, state, params, max_logits=...)`` returns updates such
  that ``params + update = clip(params + updates)``, with ``clip`` as in
  ``clip_qk`` per attention layer; the columns of groups under τ (and every
  other leaf) keep ``updates`` untouched. ``optax.chain`` and
  ``nnx.Optimizer.update(model, grads, max_logits=...)`` pass ``max_logits``
  through.

  Args:
    threshold: ``τ > 0`` (Kimi K2, Megatron-Core: 100).
    alpha: the share of the rescale given to the queries, in ``[0, 1]``.
    attention: a dict from a layer name to where its kernels are:
      ``{"q": path, "k": path, "num_heads": H, "num_kv_heads": G,
      "head_dim": d}`` or ``{"qkv": path, "split_qkv": SplitQKV(...)}``; a path
      is ``"a/b/kernel"`` or a tuple of keys. ``max_logits`` is a dict with
      the same keys, each ``(..., num_heads)`` (leading axes: stacked layers).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` (stateless).

  References:
    Kimi Team, `Kimi K2: Open Agentic Intelligence
    <https://arxiv.org/abs/2507.20534>`_, 2025
  """
  _check_clip(threshold, alpha)
  layers = _layers(attention)

  def init_fn(params):
    for layer in layers:
      _paths.check_paths_known(f"attention[{layer.name!r}]",
                               [path for path, _ in layer.parts], params)
    return optax.EmptyState()

  def update_fn(updates, state, params=None, *, max_logits=None, **extra_args):
    del extra_args
    if params is None or max_logits is None:
      raise ValueError("qk_clip needs the params and max_logits: call "
                       "update(updates, state, params, max_logits={layer: "
                       "(..., num_heads) array})")
    missing = [l.name for l in layers if l.name not in max_logits]
    if missing:
      raise ValueError(f"max_logits has no entry for attention layers "
                       f"{missing}; it has {sorted(max_logits)}")
    leaves, treedef = _paths.leaves_with_paths(updates)
    index = {path: i for i, (path, _) in enumerate(leaves)}
    param_of = dict(_paths.leaves_with_paths(params)[0])
    new = [leaf for _, leaf in leaves]
    for layer in layers:
      for path, part in layer.parts:
        if path not in index:
          raise ValueError(f"attention[{layer.name!r}] names "
                           f"{'/'.join(path)!r}, which is not among the updates")
        factor, clipped = column_factors(
            max_logits[layer.name],
            column_map(layer.num_heads, layer.num_kv_heads, layer.head_dim,
                       part),
            threshold, alpha, layer.num_heads, layer.num_kv_heads)
        i, p = index[path], param_of[path]
        stepped = p + new[i]
        factor = _by_column(factor, stepped).astype(stepped.dtype)
        # unclipped columns keep the incoming update bit for bit
        new[i] = jnp.where(_by_column(clipped, stepped),
                           (stepped * factor - p).astype(new[i].dtype), new[i])
    return jax.tree.unflatten(treedef, new), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
