"""How ``MuonConfig.build`` makes the optimizer from a config: the clip,
AdamW or the family member the config names (built by the member's own
``optimizers.registry`` entry, with ``om.muon``'s keywords set from the
fields), QK-clip, the tensor-parallel settings from the mesh, offload."""

from typing import Any

import jax
import optax

from optax_muon._src.base import built
from optax_muon._src.base import paths as _paths
from optax_muon._src.optimizers import registry
from optax_muon._src.optimizers import settings
from optax_muon._src.optimizers.route import matrices_only
from optax_muon._src.parallel import offload
from optax_muon._src.parallel import rates as rates_lib
from optax_muon._src.parallel import tensor_parallel as sharding_lib
from optax_muon._src.transforms import momentum
from optax_muon._src.transforms import qk_clip as qk_clip_lib
from optax_muon._src.views import layout as layout_lib

MEMBERS = registry.MEMBERS
# The fields that are a family keyword under Megatron-Core's name. Every other
# field named ``muon_<keyword>`` (or ``<keyword>``) of the family's keywords
# (``settings.MuonOptions``) is that keyword as it is; ``build`` makes the
# rest (``split_qkv``, the mask, the AdamW group, the momentum's bits).
FIELD_KEYWORDS = {
  "muon_momentum": "beta",
  "muon_nesterov": "nesterov",
  "muon_coefficient_type": "coefficients",
  "muon_num_ns_steps": "steps",
  "muon_fp32_matmul_prec": "precision",
}


def _offloaded_whole(optimizer: str) -> bool:
  """``optimizer_offload`` for optax's AdamW and the members that take no
  ``state_memory_kind``: the whole chain's state offloaded
  (``offload.offload_state``); the others are given ``state_memory_kind``,
  so their state comes to the device a wave at a time."""
  return optimizer == "adam" or not MEMBERS[optimizer].takes_state_memory_kind


def _tp_sharded(config) -> bool:
  """Whether ``build``'s mesh shards the member: Muon's modes, or a
  member of its own scheme with ``muon_tp_mode`` set (Dion2's local
  selection scope, Dion's ``"distributed"``)."""
  member = MEMBERS.get(config.optimizer)
  return member is not None and (
    not member.own_scheme or config.muon_tp_mode is not None
  )


def build(
  config,
  learning_rate,
  *,
  params,
  mesh,
  split_qkv,
  labels,
  specs,
  attention,
  layout,
  dimension_numbers,
  tp_axis,
  split_gate_up,
) -> optax.GradientTransformation:
  """``MuonConfig.build`` (see it there)."""
  lr = config.lr if learning_rate is None else learning_rate
  b1, b2 = config.betas
  decay_mask = matrices_only
  clip = (
    [optax.clip_by_global_norm(config.clip_grad)]
    if config.clip_grad > 0
    else []
  )
  if config.qk_clip and attention is None:
    raise ValueError(
      "qk_clip=True needs build(..., attention={layer: "
      "{'q': path, 'k': path, ...} or {'qkv': path, "
      "'split_qkv': SplitQKV(...)}}) to find the kernels"
    )
  clip_logits = (
    [
      qk_clip_lib.qk_clip(
        config.qk_clip_threshold, config.qk_clip_alpha, attention=attention
      )
    ]
    if config.qk_clip
    else []
  )
  if config.optimizer == "adam":
    return _offloaded(
      config,
      optax.chain(
        *clip,
        optax.adamw(
          lr,
          b1=b1,
          b2=b2,
          eps=config.eps,
          weight_decay=config.weight_decay,
          mask=decay_mask,
        ),
        *clip_logits,
      ),
    )
  sharding = _sharding(config, mesh, specs, tp_axis)
  adam_lr = None
  if config.adam_lr is not None:
    ratio = config.adam_lr / config.lr
    adam_lr = (lambda count: lr(count) * ratio) if callable(lr) else lr * ratio
  split = split_qkv if config.muon_split_qkv else None
  check_split = config.muon_split_qkv and split is None
  if check_split and params is not None:
    _check_no_fused_qkv(params)
  member = MEMBERS[config.optimizer]
  keywords = _family_keywords(config)
  if member.takes_state_memory_kind:
    # the member keeps its own state in host memory, a wave at a time
    keywords["state_memory_kind"] = (
      "pinned_host" if config.optimizer_offload else None
    )
  keywords.update(
    split_qkv=split,
    sharding=sharding,
    split_gate_up=(
      (split_gate_up or layout_lib.SplitGateUp())
      if config.muon_split_gate_up
      else None
    ),
    weight_decay_mask=decay_mask,
    labels=labels,
    layout=layout,
    dimension_numbers=dimension_numbers,
    adam_learning_rate=adam_lr,
    adam_b1=b1,
    adam_b2=b2,
    adam_eps=config.eps,
    adam_weight_decay=config.weight_decay,
    adam_weight_decay_mask=decay_mask,
    mu_dtype=(
      None
      if config.muon_momentum_bits is None
      else momentum.QuantizedMomentum(
        config.muon_momentum_bits, config.muon_momentum_block_size
      )
    ),
  )
  inner = member.factory(config, lr, **keywords)
  tx = built.wrapped(optax.chain(*clip, inner, *clip_logits), inner)
  if not check_split:
    return _offloaded(config, tx)

  def init_fn(params):
    _check_no_fused_qkv(params)
    return tx.init(params)

  return _offloaded(
    config, optax.GradientTransformationExtraArgs(init_fn, tx.update)
  )


def _offloaded(config, tx) -> optax.GradientTransformation:
  """``tx`` with its whole state in pinned host memory between steps, for
  ``optimizer_offload`` where the member does not keep its own state there
  (``state_memory_kind``)."""
  if not config.optimizer_offload or not _offloaded_whole(config.optimizer):
    return tx
  return built.wrapped(offload.offload_state(tx, "pinned_host"), tx)


def _family_keywords(config) -> dict[str, Any]:
  """The family's keywords that fields set as they are
  (``FIELD_KEYWORDS``, then ``muon_<keyword>`` and ``<keyword>``)."""
  family = settings.names(settings.MuonOptions)
  keywords = {}
  for field in config.field_names():
    keyword = FIELD_KEYWORDS.get(field, field.removeprefix("muon_"))
    if keyword in family:
      keywords[keyword] = getattr(config, field)
  return keywords


def _sharding(config, mesh, specs, tp_axis):
  """The ``TensorParallel`` ``build``'s mesh and ``muon_tp_mode`` ask
  for, or ``None``."""
  if mesh is not None and _tp_sharded(config):
    axes = list(mesh.axis_names)
    if tp_axis not in axes:
      raise ValueError(
        f"tp_axis={tp_axis!r} is not an axis of the mesh; "
        f"accepted values: {axes}"
      )
    distribute = None
    if config.use_layer_wise_distributed_optimizer:
      if "data" not in axes:
        raise ValueError(
          "use_layer_wise_distributed_optimizer=True needs a "
          f"mesh axis named 'data'; the mesh has {axes}"
        )
      distribute = "data"
    mode, auto_modes = config.tp_mode, sharding_lib.EXACT_MODES
    unset = MEMBERS[config.optimizer].unset_tp_mode
    if config.muon_tp_mode is None and unset is not None:
      mode = unset
    elif config.muon_tp_mode is None and rates_lib.rates_of(mesh):
      # Megatron's blockwise wherever a leaf's shards are whole pieces
      # (cheapest, so auto takes it); the exact mode of least modeled time
      # for a fused [gate | up] or [Q | K | V] split along its fan-out
      mode, auto_modes = "auto", ("blockwise", *sharding_lib.EXACT_MODES)
    return sharding_lib.TensorParallel(
      mesh,
      tp_axis,
      mode,
      specs=specs,
      distribute_over=distribute,
      auto_modes=auto_modes,
    )
  if config.use_layer_wise_distributed_optimizer:
    raise ValueError(
      "use_layer_wise_distributed_optimizer=True needs a mesh "
      "with a 'data' axis: pass build(..., mesh=mesh)"
    )
  if config.muon_tp_mode is not None:
    raise ValueError(
      f"muon_tp_mode={config.muon_tp_mode!r} is set but build() got no "
      "mesh; pass build(..., mesh=mesh) or leave muon_tp_mode unset"
    )
  return None


def _check_no_fused_qkv(params) -> None:
  """Raises when ``SplitQKV``'s default pattern finds fused QKV matrices."""
  pattern = layout_lib.SplitQKV.pattern
  leaves, _ = _paths.leaves_with_paths(params)
  fused = [
    _paths.path_string(p)
    for p, leaf in leaves
    if _paths.matches([pattern], p) and jax.numpy.ndim(leaf) >= 2
  ]
  if fused:
    raise ValueError(
      f"muon_split_qkv=True but the params have fused QKV leaves "
      f"({fused[0]}, ...) and build() got no split_qkv=SplitQKV(...) "
      "with their head counts; pass it or set muon_split_qkv=False"
    )
