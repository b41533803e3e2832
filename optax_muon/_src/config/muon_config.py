"""MuonConfig: validated settings with verl / Megatron-Core names.

Field names and defaults follow verl's ``actor.optim`` and Megatron-Core's
``muon_*`` arguments, so a verl override line works here unchanged::

    cfg = MuonConfig.from_overrides(["optim.optimizer=muon",
                                     "optim.muon_momentum=0.9"])
    tx = cfg.build(3e-4, params=params)
"""

import dataclasses
import math
import typing
import warnings
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any

import optax

from optax_muon._src.base import checks as _checks
from optax_muon._src.base import types
from optax_muon._src.config import building
from optax_muon._src.config import overrides as overrides_lib
from optax_muon._src.kernels import coefficients
from optax_muon._src.kernels import matrices
from optax_muon._src.kernels import shape_scale

# the members: each registers itself (optimizers.registry) when imported
from optax_muon._src.optimizers import adaptive  # noqa: F401
from optax_muon._src.optimizers import dion as dion_lib
from optax_muon._src.optimizers import dion2 as dion2_lib
from optax_muon._src.optimizers import muon  # noqa: F401
from optax_muon._src.optimizers import muon_bp  # noqa: F401
from optax_muon._src.optimizers import registry
from optax_muon._src.optimizers.route import SCALAR_OPTIMIZERS
from optax_muon._src.parallel import tensor_parallel as sharding_lib
from optax_muon._src.parallel import waves
from optax_muon._src.transforms import moment2
from optax_muon._src.transforms import momentum
from optax_muon._src.views import layout as layout_lib

# "adam", then the family members as they declare themselves beside their
# own code (``optimizers.registry``), "muon" first
MEMBERS = registry.MEMBERS
OPTIMIZERS = ("adam", *sorted(MEMBERS, key=lambda name: name != "muon"))
# field prefix -> the optimizers that read the fields (no prefix is another's
# start: "dion2_" and "dion_", "nordion2_")
FIELDS_READ_BY = {
  prefix: tuple(
    name for name, m in MEMBERS.items() if prefix in m.field_prefixes
  )
  for m in MEMBERS.values()
  for prefix in m.field_prefixes
}
TP_MODES = sharding_lib.MODES


@dataclasses.dataclass(frozen=True)
class MuonConfig:
  """Optimizer settings under verl / Megatron-Core names, checked when made.

  Attributes:
    optimizer: ``"adam"`` (AdamW everywhere), ``"muon"``,
      ``"adaptive_muon"`` (Megatron-Core's name: ``om.adaptive_muon`` with
      the ``muon_*`` settings and the ``adaptive_muon_*`` ones below),
      ``"muon_bp"`` (``om.muon_bp``, ``muon_bp_period``; its full steps in
      ``muon_tp_mode``, ``"auto"`` when unset), ``"dion2"`` or
      ``"nordion2"`` (``om.dion2`` / ``om.nordion2`` with the ``dion2_*``
      settings and the ``muon_*`` ones that apply: the Newton–Schulz
      schedule, steps, precision, scale; NorDion2's β is
      ``muon_momentum``; with ``muon_tp_mode`` one of the exact modes they
      run sharded over ``build``'s mesh, each shard selecting its own
      slices, microsoft/dion's ``"local"`` scope), or ``"dion"`` (``om.dion``
      with ``dion_rank_fraction``, its ``ef_decay`` (microsoft/dion's
      ``mu``) ``muon_momentum``; precision and scale apply, no
      Newton–Schulz settings; ``muon_tp_mode="distributed"`` runs Dion's
      own scheme over ``build``'s mesh, each device keeping its block).
    lr: learning rate of both groups (verl's default 1e-6, for fine-tuning;
      ``build`` may pass a schedule instead).
    adam_lr: the AdamW (scalar) group's own learning rate with
      ``optimizer="muon"``; ``None``: ``lr``. A schedule given to ``build``
      drives both groups, the AdamW one scaled by ``adam_lr / lr``.
    betas: AdamW's ``(β₁, β₂)``.
    eps: AdamW's epsilon.
    weight_decay: decoupled weight decay, matrices and embeddings (vectors are
      not decayed, as in Megatron-Core).
    clip_grad: global-norm clip over all params before the optimizer; 0: off.
    use_layer_wise_distributed_optimizer: split Newton–Schulz work over the
      data-parallel axis (needs a mesh).
    muon_momentum: Muon's β.
    muon_nesterov: Nesterov momentum.
    muon_split_qkv: orthogonalize fused Q, K and V separately.
    muon_split_gate_up: orthogonalize the gate and up halves of fused
      gated-MLP kernels separately (Megatron-Core does for a gated
      ``linear_fc1``): ``build``'s ``split_gate_up``, or when it is not
      given ``SplitGateUp()`` (leaves whose path has ``gate_up``).
    muon_scale_mode: ``"spectral"``, ``"shape_scaling"`` or ``"unit_rms_norm"``.
    muon_coefficient_type: a Newton–Schulz schedule name.
    muon_num_ns_steps: Newton–Schulz steps.
    muon_tp_mode: ``"blockwise"``, ``"duplicated"``, ``"distributed"``,
      ``"allgather"`` or ``"auto"`` (each leaf the exact mode of least
      modeled time, Megatron-Core's ``--muon-tp-mode auto``); ``None``
      (unset), when ``build`` gets a mesh: Megatron's ``"blockwise"`` for
      every leaf whose shards are whole matrices, and for a fused kernel
      split along its fan-out (``[gate | up]``, ``[Q | K | V]`` over TP
      ranks), which no shard holds whole, the exact mode of least modeled
      time (``"auto"`` over blockwise and the exact modes; plain
      ``"blockwise"`` on a device kind without ``om.KNOWN_RATES``). Set, it
      needs one.
    muon_fp32_matmul_prec: ``"highest"``, ``"high"``, ``"medium"``, ``"fp16"``
      or ``"bf16"``.
    muon_extra_scale_factor: factor after the shape scale, > 0; ``None``
      (unset): 1.0, or the RMS-matching factor (``extra_scale_factor``).
    muon_scalar_optimizer: ``"adam"`` or ``"lion"`` for the non-matrix leaves.
    muon_match_adamw_update_rms: derive the extra factor from ``betas[0]``.
    muon_momentum_style: ``"ema"`` or ``"sgd"``.
    muon_memory_budget: bytes per device of orthogonalization work in flight
      (``None``: the default, 2 GiB; see ``om.orthogonalize``).
    muon_momentum_bits: ``None`` (the momentum in the param's dtype) or 8
      (int8 with a float32 scale per block: ``om.QuantizedMomentum``).
    muon_momentum_block_size: entries per block of the 8-bit momentum.
    optimizer_offload: verl's name: the optimizer state (Muon's momentum,
      AdamW's moments) in pinned host memory between steps: the member is
      given ``state_memory_kind="pinned_host"`` (its state brought to the
      device a wave at a time); ``adam`` and ``muon_bp`` have the whole
      chain's state brought over inside each update.
    qk_clip: QK-clip (MuonClip) after each step; ``build`` then needs
      ``attention=`` (see ``optax_muon.qk_clip``) and ``update`` the step's
      ``max_logits=``.
    qk_clip_threshold: its ``τ`` (> 0).
    qk_clip_alpha: the share of the rescale given to the queries, [0, 1].
    adaptive_muon_moment2_method: ``"adamuon"``, ``"normuon"`` or ``"namo"``.
    adaptive_muon_beta2: the second moment's decay, [0, 1).
    adaptive_muon_eps: the second moment's eps, >= 0.
    muon_bp_period: MuonBP's full orthogonalization every this many steps.
    dion2_fraction: the share of slices Dion2 / NorDion2 orthogonalize, (0, 1].
    dion2_ef_decay: Dion2's error-feedback decay, [0, 1].
    dion2_selection_scope: with ``muon_tp_mode`` set, ``"local"`` (each
      shard selects its own slices, microsoft/dion's default) or
      ``"global"`` (the whole matrix's, for trees the local scope refuses:
      split QKV or gate/up pieces on the tensor-parallel axis).
    nordion2_beta2: NorDion2's second-moment decay, [0, 1).
    dion_rank_fraction: Dion's rank as a share of each matrix's shorter
      side, (0, 1].
    dion_qr_method: ``"qr"`` (Householder) or ``"rcqr"`` (microsoft/dion's
      randomized Cholesky QR: what a sharded run wants; see ``om.dion``).
  """

  optimizer: str = "adam"
  lr: float = 1e-6
  adam_lr: float | None = None
  betas: tuple[float, float] = (0.9, 0.999)
  eps: float = 1e-8
  weight_decay: float = 0.01
  clip_grad: float = 1.0
  use_layer_wise_distributed_optimizer: bool = False
  muon_momentum: float = 0.95
  muon_nesterov: bool = False
  muon_split_qkv: bool = True
  muon_split_gate_up: bool = True
  muon_scale_mode: types.ScaleMode = "spectral"
  muon_coefficient_type: str = "quintic"
  muon_num_ns_steps: int = 5
  muon_tp_mode: types.TensorParallelMode | None = None
  muon_fp32_matmul_prec: types.Precision = "medium"
  muon_extra_scale_factor: float | None = None
  muon_scalar_optimizer: types.ScalarOptimizer = "adam"
  muon_match_adamw_update_rms: bool = False
  muon_momentum_style: types.MomentumStyle = "ema"
  muon_memory_budget: int | None = None
  muon_momentum_bits: int | None = None
  muon_momentum_block_size: int = 256
  optimizer_offload: bool = False
  qk_clip: bool = False
  qk_clip_threshold: float = 100.0
  qk_clip_alpha: float = 0.5
  adaptive_muon_moment2_method: types.Moment2Method = "adamuon"
  adaptive_muon_beta2: float = 0.95
  adaptive_muon_eps: float = 1e-8
  muon_bp_period: int = 5
  dion2_fraction: float = 0.25
  dion2_ef_decay: float = 0.95
  nordion2_beta2: float = 0.95
  dion_rank_fraction: float = 1.0
  dion_qr_method: str = "qr"
  dion2_selection_scope: str = "local"

  def __post_init__(self):
    self._coerce_fields()
    self._check_values()
    self._check_family()
    self._check_fields_read()
    self._check_momentum_and_clip()

  def _coerce_fields(self) -> None:
    """Each field as its type (a value of another type raises)."""
    hints = typing.get_type_hints(type(self))
    for field in dataclasses.fields(self):
      object.__setattr__(
        self,
        field.name,
        overrides_lib.coerce(
          field.name,
          getattr(self, field.name),
          hints[field.name],
          parse_strings=False,
        ),
      )

  def _check_values(self) -> None:
    """Raises naming the first choice or range not accepted."""
    choices = {
      "optimizer": OPTIMIZERS,
      "muon_scale_mode": shape_scale.SCALE_MODES,
      "muon_coefficient_type": tuple(coefficients.COEFFICIENT_SETS),
      "muon_fp32_matmul_prec": matrices.PRECISIONS,
      "muon_scalar_optimizer": SCALAR_OPTIMIZERS,
      "muon_momentum_style": momentum.MOMENTUM_STYLES,
      "adaptive_muon_moment2_method": moment2.MOMENT2_METHODS,
    }
    for name, accepted in choices.items():
      _checks.check_choice(name, getattr(self, name), accepted)
    if self.muon_tp_mode is not None:
      _checks.check_choice("muon_tp_mode", self.muon_tp_mode, TP_MODES)
    for name in ("lr", "weight_decay", "clip_grad", "eps"):
      _checks.check_range(name, getattr(self, name), 0.0, math.inf)
    if self.adam_lr is not None:
      _checks.check_range("adam_lr", self.adam_lr, 0.0, math.inf)
      if self.lr == 0:
        raise ValueError(
          f"adam_lr={self.adam_lr} is applied as adam_lr / lr "
          "times build()'s schedule and needs lr > 0; got lr=0"
        )
    if self.muon_extra_scale_factor is not None:
      _checks.check_positive(
        "muon_extra_scale_factor", self.muon_extra_scale_factor
      )
    for i, beta in enumerate(self.betas):
      _checks.check_range(f"betas[{i}]", beta, 0.0, 1.0)
    _checks.check_range("muon_momentum", self.muon_momentum, 0.0, 1.0)
    _checks.check_range(
      "adaptive_muon_beta2", self.adaptive_muon_beta2, 0.0, 1.0
    )
    _checks.check_range(
      "adaptive_muon_eps", self.adaptive_muon_eps, 0.0, math.inf
    )
    _checks.check_int("muon_num_ns_steps", self.muon_num_ns_steps, minimum=1)
    _checks.check_int("muon_bp_period", self.muon_bp_period, minimum=1)

  def _check_fields_read(self) -> None:
    """Raises naming a family member's field set (to other than its
    default) while ``optimizer`` is another Muon-family member, which would
    ignore it (``"adam"`` ignores every Muon field: ``from_dict`` warns, as
    verl's configs carry them all)."""
    if self.optimizer == "adam":
      return
    defaults = type(self)()
    for field in dataclasses.fields(self):
      readers = [
        readers
        for prefix, readers in FIELDS_READ_BY.items()
        if field.name.startswith(prefix)
      ]
      if (
        readers
        and self.optimizer not in readers[0]
        and getattr(self, field.name) != getattr(defaults, field.name)
      ):
        raise ValueError(
          f"{field.name}={getattr(self, field.name)!r} is read only by "
          f"optimizer in {list(readers[0])}, but optimizer="
          f"{self.optimizer!r}; accepted: one of those optimizers, or "
          f"{field.name} left at its default"
        )

  def _check_family(self) -> None:
    """Raises naming the first Dion-family setting not accepted."""
    _checks.check_fraction("dion2_fraction", self.dion2_fraction)
    _checks.check_range("dion2_ef_decay", self.dion2_ef_decay, 0.0, 1.0 + 1e-12)
    _checks.check_choice(
      "dion2_selection_scope",
      self.dion2_selection_scope,
      dion2_lib.SELECTION_SCOPES,
    )
    _checks.check_range("nordion2_beta2", self.nordion2_beta2, 0.0, 1.0)
    _checks.check_fraction("dion_rank_fraction", self.dion_rank_fraction)
    _checks.check_choice(
      "dion_qr_method", self.dion_qr_method, dion_lib.QR_METHODS
    )
    member = MEMBERS.get(self.optimizer)
    if member is None:  # adam
      return
    if member.tp_modes is not None and self.muon_tp_mode not in member.tp_modes:
      raise ValueError(
        f"muon_tp_mode={self.muon_tp_mode!r} is not accepted with "
        f"optimizer={self.optimizer!r} ({member.tp_modes_why}); accepted "
        f"values: {list(member.tp_modes)}"
      )
    with_modes = [name for name, m in MEMBERS.items() if not m.own_scheme]
    if member.own_scheme and self.use_layer_wise_distributed_optimizer:
      raise ValueError(
        "use_layer_wise_distributed_optimizer=True is not accepted with "
        f"optimizer={self.optimizer!r} (it orthogonalizes no whole stack to "
        f"share out); accepted: False, or optimizer in {with_modes}"
      )
    if member.own_scheme and self.muon_momentum_bits is not None:
      raise ValueError(
        f"muon_momentum_bits={self.muon_momentum_bits} is not accepted with "
        f"optimizer={self.optimizer!r} (its momentum is a sum kept in the "
        "param's dtype); accepted: None"
      )

  def _check_momentum_and_clip(self) -> None:
    """Raises naming the first budget, 8-bit momentum, QK-clip or scale
    setting not accepted."""
    waves.check_memory_budget(self.muon_memory_budget, "muon_memory_budget")
    if self.muon_momentum_bits not in (None, 8):
      raise ValueError(
        f"muon_momentum_bits={self.muon_momentum_bits!r} is not accepted; "
        "accepted: None (the param's dtype) or 8 (int8 blockwise)"
      )
    _checks.check_int(
      "muon_momentum_block_size", self.muon_momentum_block_size, minimum=1
    )
    if self.muon_momentum_bits is None and self.muon_momentum_block_size != 256:
      raise ValueError(
        f"muon_momentum_block_size={self.muon_momentum_block_size} applies "
        "to an 8-bit momentum, but muon_momentum_bits is None (the "
        "momentum in the param's dtype); set muon_momentum_bits=8 too, or "
        "leave muon_momentum_block_size at 256"
      )
    _checks.check_positive("qk_clip_threshold", self.qk_clip_threshold)
    if not 0.0 <= self.qk_clip_alpha <= 1.0:
      raise ValueError(
        f"qk_clip_alpha must be in [0, 1], got {self.qk_clip_alpha!r}"
      )
    if self.muon_match_adamw_update_rms and (
      self.muon_extra_scale_factor is not None
    ):
      raise ValueError(
        "muon_match_adamw_update_rms=True derives muon_extra_scale_factor "
        f"from betas[0], but muon_extra_scale_factor="
        f"{self.muon_extra_scale_factor} was also set; set exactly one"
      )

  @classmethod
  def field_names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))

  @classmethod
  def from_dict(cls, values: Mapping[str, Any]) -> "MuonConfig":
    """From ``{name: value}``; names may carry a dotted prefix (``optim.lr``)
    or be nested (``{"optim": {"lr": 1e-3}}``).

    Warns once, naming them, when ``muon_*`` fields or ``adam_lr`` are set
    to other than their defaults but the optimizer is ``"adam"`` (they have
    no effect then).
    """
    fields = overrides_lib.parse_fields(cls, values)
    config = cls(**fields)
    defaults = cls()
    ignored = sorted(
      n
      for n in fields
      if n.startswith(
        (
          "muon_",
          "adam_lr",
          "adaptive_muon_",
          "dion2_",
          "nordion2_",
          "dion_",
        )
      )
      and getattr(config, n) != getattr(defaults, n)
    )
    if config.optimizer == "adam" and ignored:
      warnings.warn(
        f"optimizer='adam' ignores the fields that were set: "
        f"{ignored}; set optimizer=muon to use them",
        stacklevel=2,
      )
    return config

  @classmethod
  def from_overrides(cls, overrides: Iterable[str]) -> "MuonConfig":
    """From ``"key=value"`` strings, types read from the fields (no ``eval``)."""
    return cls.from_dict(overrides_lib.split_overrides(overrides))

  @property
  def extra_scale_factor(self) -> float:
    """The resolved factor after the shape scale: ``muon_extra_scale_factor``,
    or when unset 1.0, or the RMS-matching factor from ``betas[0]``."""
    if self.muon_match_adamw_update_rms:
      return float(shape_scale.adamw_rms_match_factor(self.betas[0]))
    if self.muon_extra_scale_factor is None:
      return 1.0
    return float(self.muon_extra_scale_factor)

  @property
  def tp_mode(self) -> types.TensorParallelMode:
    """``muon_tp_mode``, or Megatron's ``"blockwise"`` when unset."""
    return self.muon_tp_mode or "blockwise"

  def build(
    self,
    learning_rate=None,
    *,
    params=None,
    mesh=None,
    split_qkv: layout_lib.SplitQKV | None = None,
    labels=None,
    specs=None,
    attention=None,
    layout=None,
    dimension_numbers=None,
    tp_axis: str = "model",
    split_gate_up=None,
  ) -> optax.GradientTransformation:
    """The optimizer: global-norm clip, then AdamW or Muon + AdamW, then
    QK-clip when ``qk_clip``.

    Args:
      learning_rate: a float or optax schedule; ``None`` uses ``lr``.
      params: the params (or their shapes), used to check the settings
        against the model (fused QKV leaves need ``split_qkv``).
      mesh: a ``jax.sharding.Mesh`` for tensor-parallel / layer-wise modes
        (needed when ``muon_tp_mode`` is set).
      split_qkv: head counts of the fused QKV kernels, for ``muon_split_qkv``
        (params with fused QKV leaves and none raise, here when ``params`` is
        given, else at ``init``).
      labels: as in ``muon``; ``None`` uses ``default_labels``.
      specs: the params' ``PartitionSpec``s for ``TensorParallel`` (needed on
        meshes with Auto axes), e.g. ``nnx.get_partition_spec(state)``.
      attention: where the attention kernels are, for ``qk_clip`` (the
        ``attention`` argument of ``optax_muon.qk_clip``); unused without.
      layout: an ``om.Layout`` from ``om.infer_layout`` (labels and
        dimension numbers); not with ``labels`` or ``dimension_numbers``.
      dimension_numbers: as in ``muon``.
      tp_axis: the mesh axis that ``muon_tp_mode`` runs over (any name:
        ``"model"``, Tunix's ``"tp"``, ...).
      split_gate_up: ``om.SplitGateUp`` for fused gated-MLP kernels
        (Megatron's ``is_gated_fc1`` split), as in ``muon``; ``None`` uses
        ``SplitGateUp()`` when ``muon_split_gate_up``.

    Returns:
      An ``optax.GradientTransformation``; with ``optimizer_offload`` its
      whole state lives in pinned host memory between steps.
    """
    return building.build(
      self,
      learning_rate,
      params=params,
      mesh=mesh,
      split_qkv=split_qkv,
      labels=labels,
      specs=specs,
      attention=attention,
      layout=layout,
      dimension_numbers=dimension_numbers,
      tp_axis=tp_axis,
      split_gate_up=split_gate_up,
    )
