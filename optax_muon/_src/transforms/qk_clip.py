"""The QK-clip transform (``om.qk_clip``): the rule of ``kernels.qk`` applied
after each optimizer step to the attention kernels its layer specs name."""

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_muon._src.base import checks as _checks
from optax_muon._src.base import paths as _paths
from optax_muon._src.base import types
from optax_muon._src.kernels.qk import WIDTHS
from optax_muon._src.kernels.qk import by_column
from optax_muon._src.kernels.qk import check_clip
from optax_muon._src.kernels.qk import check_heads
from optax_muon._src.kernels.qk import check_kernel
from optax_muon._src.kernels.qk import check_mla
from optax_muon._src.kernels.qk import column_factors
from optax_muon._src.kernels.qk import column_map
from optax_muon._src.kernels.qk import layers_first
from optax_muon._src.kernels.qk import mla_column_map
from optax_muon._src.views import layout


@dataclasses.dataclass(frozen=True)
class _Layer:
  """One attention layer: its kernels, each with its ``column_map``, and its
  head counts."""

  name: str
  parts: tuple[tuple[tuple[str, ...], np.ndarray], ...]
  num_heads: int
  num_kv_heads: int
  layer_axis: int | None = None
  fields: str = ""


def _as_path(path) -> tuple[str, ...]:
  return tuple(path.split("/")) if isinstance(path, str) else tuple(path)


_MHA_KEYS = ("q", "k", "num_heads", "num_kv_heads", "head_dim")
_MLA_KEYS = (
  "q",
  "kv",
  "num_heads",
  "qk_nope_head_dim",
  "qk_rope_head_dim",
  "v_head_dim",
)
_ACCEPTED = (
  f"{list(_MHA_KEYS)}, ['qkv', 'split_qkv'] or (MLA) {list(_MLA_KEYS)}"
)


def _layer(name: str, spec: Mapping[str, Any]) -> _Layer:
  where = f"attention[{name!r}]"
  if "qkv" in spec:
    split = spec.get("split_qkv")
    if not isinstance(split, layout.SplitQKV):
      raise ValueError(
        f"{where} has 'qkv' and needs 'split_qkv': a "
        f"SplitQKV with its head counts, got {split!r}"
      )
    keys: tuple[str, ...] = ("qkv", "split_qkv")
    layer = _Layer(
      name,
      (
        (
          _as_path(spec["qkv"]),
          column_map(
            split.num_heads, split.num_kv_heads, split.head_dim, split.layout
          ),
        ),
      ),
      split.num_heads,
      split.num_kv_heads,
    )
  else:
    keys = _MLA_KEYS if "kv" in spec else _MHA_KEYS
    missing = [key for key in keys if key not in spec]
    if missing:
      raise ValueError(f"{where} lacks {missing}; accepted keys: {_ACCEPTED}")
    if "kv" in spec:
      heads, nope, rope, v = (spec[key] for key in _MLA_KEYS[2:])
      check_mla(heads, nope, rope, v)
      layer = _Layer(
        name,
        tuple(
          (_as_path(spec[part]), mla_column_map(heads, nope, rope, v, part))
          for part in ("q", "kv")
        ),
        heads,
        heads,
      )
    else:
      num_heads, num_kv_heads, head_dim = (spec[key] for key in _MHA_KEYS[2:])
      check_heads(num_heads, num_kv_heads, head_dim)
      layer = _Layer(
        name,
        tuple(
          (
            _as_path(spec[part]),
            column_map(num_heads, num_kv_heads, head_dim, part),
          )
          for part in ("q", "k")
        ),
        num_heads,
        num_kv_heads,
      )
  layer_axis = spec.get("layer_axis")
  if layer_axis is not None:
    _checks.check_int(f"{where}['layer_axis']", layer_axis, minimum=0)
  kind = "qkv" if "qkv" in spec else "mla" if "kv" in spec else "mha"
  layer = dataclasses.replace(layer, layer_axis=layer_axis, fields=WIDTHS[kind])
  unknown = set(spec) - set(keys) - {"layer_axis"}
  if unknown:
    raise ValueError(
      f"{where} has unknown keys {sorted(unknown)}; accepted keys: {_ACCEPTED}"
    )
  return layer


def _layers(attention: Mapping[str, Mapping[str, Any]]) -> list[_Layer]:
  if not isinstance(attention, Mapping) or not attention:
    raise ValueError(
      "attention must be a non-empty dict from a layer name to "
      "{'q': path, 'k': path, 'num_heads', 'num_kv_heads', "
      "'head_dim'}, {'qkv': path, 'split_qkv': SplitQKV(...)} "
      "or, for MLA, {'q': path, 'kv': path, 'num_heads', "
      "'qk_nope_head_dim', 'qk_rope_head_dim', 'v_head_dim'}"
    )
  return [_layer(name, spec) for name, spec in attention.items()]


def qk_clip(
  threshold: types.Numeric = 100.0,
  alpha: types.Numeric = 0.5,
  *,
  attention: Mapping[str, Mapping[str, Any]],
) -> optax.GradientTransformationExtraArgs:
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
      "head_dim": d}``, ``{"qkv": path, "split_qkv": SplitQKV(...)}`` or, for
      multi-head latent attention (see ``clip_mla_qk``), ``{"q": path (wq_b),
      "kv": path (wkv_b), "num_heads": H, "qk_nope_head_dim": dn,
      "qk_rope_head_dim": dr, "v_head_dim": dv}``; a path is ``"a/b/kernel"``
      or a tuple of keys; ``"layer_axis": k`` when the kernels' stacked
      layers are on axis ``k`` rather than leading (see ``clip_qk``). Head
      sizes that do not match a kernel's width raise at ``init``. ``max_logits`` is a dict with
      the same keys, each ``(..., num_heads)`` (leading axes: stacked layers).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` (stateless).

  References:
    Kimi Team, `Kimi K2: Open Agentic Intelligence
    <https://arxiv.org/abs/2507.20534>`_, 2025
  """
  check_clip(threshold, alpha)
  layers = _layers(attention)

  def init_fn(params):
    param_of = dict(_paths.leaves_with_paths(params)[0])
    for layer in layers:
      _paths.check_paths_known(
        f"attention[{layer.name!r}]", [path for path, _ in layer.parts], params
      )
      for path, columns in layer.parts:
        if path in param_of:  # head sizes against the kernel, here
          check_kernel(
            jnp.shape(param_of[path]),
            columns,
            layer.layer_axis,
            f"attention[{layer.name!r}] kernel {'/'.join(path)}",
            layer.fields,
          )
    return optax.EmptyState()

  def update_fn(updates, state, params=None, *, max_logits=None, **extra_args):
    del extra_args
    if params is None or max_logits is None:
      raise ValueError(
        "qk_clip needs the params and max_logits: call "
        "update(updates, state, params, max_logits={layer: "
        "(..., num_heads) array})"
      )
    missing = [l.name for l in layers if l.name not in max_logits]
    if missing:
      raise ValueError(
        f"max_logits has no entry for attention layers "
        f"{missing}; it has {sorted(max_logits)}"
      )
    leaves, treedef = _paths.leaves_with_paths(updates)
    index = {path: i for i, (path, _) in enumerate(leaves)}
    param_of = dict(_paths.leaves_with_paths(params)[0])
    new = [leaf for _, leaf in leaves]
    for layer in layers:
      for path, columns in layer.parts:
        if path not in index:
          raise ValueError(
            f"attention[{layer.name!r}] names "
            f"{'/'.join(path)!r}, which is not among the updates"
          )
        factor, clipped = column_factors(
          max_logits[layer.name],
          columns,
          threshold,
          alpha,
          layer.num_heads,
          layer.num_kv_heads,
        )
        i, p = index[path], param_of[path]
        where = f"attention[{layer.name!r}] kernel {'/'.join(path)}"
        axis = layer.layer_axis
        p = layers_first(max_logits[layer.name], p, axis, where)
        update = layers_first(max_logits[layer.name], new[i], axis, where)
        stepped = p + update
        factor = by_column(factor, stepped).astype(stepped.dtype)
        # unclipped columns keep the incoming update bit for bit
        out = jnp.where(
          by_column(clipped, stepped),
          (stepped * factor - p).astype(update.dtype),
          update,
        )
        new[i] = out if axis is None else jnp.moveaxis(out, 0, axis)
    return jax.tree.unflatten(treedef, new), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
