"""What ``MuonConfig`` knows of each family member, declared beside the
member (``register`` at the end of its module): how to build it from the
config, which fields only it reads, which ``muon_tp_mode`` values it takes,
and which of the config's settings do not apply to it. ``MuonConfig``
(``config.muon_config``) reads ``MEMBERS`` and names no member itself,
beyond ``"adam"`` (optax's AdamW everywhere)."""

import dataclasses
from collections.abc import Callable
from typing import Any

import optax

# (config, learning_rate, **keywords) -> the member: the keywords are
# om.muon's (``settings.MuonOptions``) as the config sets them
Factory = Callable[..., optax.GradientTransformation]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConfigMember:
  """How ``MuonConfig(optimizer=name)`` builds a family member.

  Attributes:
    factory: ``(config, learning_rate, **keywords) -> transformation``; the
      keywords are ``om.muon``'s, set from the config's fields; the factory
      reads its own fields (``field_prefixes``) from ``config``.
    field_prefixes: the prefixes of the fields only this member reads
      (``"dion2_"``); set for another member, they are refused by name.
    tp_modes: the ``muon_tp_mode`` values it takes (``None``: every mode);
      with ``tp_modes_why``, said when another is refused.
    own_scheme: it has no Muon tensor-parallel mode of its own: without a
      ``muon_tp_mode`` XLA partitions it under ``jit`` (no ``sharding``), and
      the layer-wise split and 8-bit momentum do not apply.
    takes_state_memory_kind: ``optimizer_offload`` passes it
      ``state_memory_kind``; otherwise the whole chain's state is offloaded.
    unset_tp_mode: the mode when ``muon_tp_mode`` is unset and a mesh is
      given (``None``: Megatron's blockwise, ``auto`` for fused pieces).
  """

  factory: Factory
  field_prefixes: tuple[str, ...] = ()
  tp_modes: tuple[Any, ...] | None = None
  tp_modes_why: str = ""
  own_scheme: bool = False
  takes_state_memory_kind: bool = True
  unset_tp_mode: str | None = None


# name -> member, in the order the members register (muon first)
MEMBERS: dict[str, ConfigMember] = {}


def register(name: str, member: ConfigMember) -> None:
  """Declares ``member`` as ``MuonConfig(optimizer=name)``."""
  if name in MEMBERS or name == "adam":
    raise ValueError(f"optimizer {name!r} is registered already")
  MEMBERS[name] = member
