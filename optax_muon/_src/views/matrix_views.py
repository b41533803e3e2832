"""Which matrices a transform sees in each leaf: the view settings, checked
once when the transform is built (``Views``), then applied to every tree."""

import dataclasses
from collections.abc import Callable
from typing import Any

from optax_muon._src.base import types
from optax_muon._src.views import layout


@dataclasses.dataclass(frozen=True, kw_only=True)
class Views:
  """How each leaf is seen as a batch of matrices (``layout.view_resolver``).

  Attributes:
    dimension_numbers: ``None``, ``"leading"``, an
      ``optax.contrib.MuonDimensionNumbers``, a tree of them or a callable.
    split_qkv: ``None``, a ``SplitQKV``, a tree of them or a callable.
    split_gate_up: ``None``, a ``SplitGateUp``, a tree of them or a callable.
    torch_orientation: iterate a square matrix as torch holds it, ``(out,
      in)`` (``layout.torch_oriented``; ``compat.torch_muon``).
  """

  dimension_numbers: types.PerLeaf = None
  split_qkv: types.PerLeaf = None
  split_gate_up: types.PerLeaf = None
  torch_orientation: bool = False
  resolver: Callable[[Any], list] = dataclasses.field(
    init=False, repr=False, compare=False
  )

  def __post_init__(self):
    # built here, so that a bad setting raises when the transform is built
    resolver = layout.view_resolver(
      self.dimension_numbers, self.split_qkv, self.split_gate_up
    )
    object.__setattr__(self, "resolver", resolver)

  def __call__(self, tree) -> list[tuple[Any, Any, layout.MatrixView]]:
    """``[(path, leaf, MatrixView)]`` of ``tree``'s leaves."""
    views = self.resolver(tree)
    if not self.torch_orientation:
      return views
    return [(p, leaf, layout.torch_oriented(v)) for p, leaf, v in views]
