"""``om.describe``: the routing table for any ``om.muon`` settings."""

import functools
import inspect
from typing import Any
from typing import Literal

import jax
import jax.numpy as jnp
import optax

from optax_muon._src.base import built as _built
from optax_muon._src.base import checks as _checks
from optax_muon._src.base import paths as _paths
from optax_muon._src.base import types
from optax_muon._src.inference.table import RoutingTable
from optax_muon._src.inference.table import render
from optax_muon._src.kernels import shape_scale
from optax_muon._src.optimizers import torch_muon as torch_muon_lib
from optax_muon._src.parallel import balance
from optax_muon._src.parallel import plan as plan_lib
from optax_muon._src.parallel import tensor_parallel as sharding_lib
from optax_muon._src.parallel.execution import Execution
from optax_muon._src.parallel.tensor_parallel import TensorParallel
from optax_muon._src.transforms import scaling
from optax_muon._src.transforms.moment2 import MOMENT2_METHODS
from optax_muon._src.transforms.moment2 import moment2_shape
from optax_muon._src.views import labels as labels_lib
from optax_muon._src.views import layout as layout_lib
from optax_muon._src.views.layout import from_layout


def describe(
  params: optax.Params,
  *,
  labels: types.PerLeaf = None,
  dimension_numbers: types.PerLeaf = None,
  split_qkv: types.PerLeaf = None,
  split_gate_up: types.PerLeaf = None,
  layout: Any = None,
  scale_mode: types.ScaleMode = "spectral",
  match_adamw_update_rms: bool = False,
  extra_scale_factor: types.Numeric | None = None,
  adam_b1: types.Numeric = 0.9,
  moment2_method: types.Moment2Method | None = None,
  sharding: TensorParallel | None = None,
  steps: types.Steps = 5,
  precision: types.Precision = "highest",
  preconditioning: types.Preconditioning = "frobenius",
  memory_budget: int | None = None,
  optimizer: optax.GradientTransformation | None = None,
) -> RoutingTable:
  """The routing table for the given ``om.muon`` settings (defaults
  included), or of a built ``optimizer``: what each leaf gets before
  training starts. It returns the
  table, as flax's ``tabulate`` does: ``print(om.describe(params))``, or
  leave it as a cell's value in a notebook (it shows as the table).
  ``compat.describe_torch_muon`` is the table of ``compat.torch_muon``.

  ``labels``, ``dimension_numbers``, ``split_qkv``, ``split_gate_up``,
  ``layout``, ``scale_mode``, ``match_adamw_update_rms``,
  ``extra_scale_factor``, ``adam_b1``, ``sharding``, ``steps``,
  ``precision``, ``preconditioning`` and ``memory_budget`` are as in
  ``om.muon``; ``moment2_method`` as in ``om.adaptive_muon``. With
  ``optimizer`` (what ``om.muon``, ``om.scale_by_muon``,
  ``om.adaptive_muon``, ``om.dion``, ``om.dion2``, ``om.nordion2``, their
  ``scale_by_*`` directions, ``MuonConfig.build`` or ``compat.torch_muon``
  returned) the settings are the ones it was built with, and no other
  keyword may be given. Each
  matrix's scale is the one the update applies: from the shape it is
  orthogonalized at (each shard's where it runs ``blockwise``). With
  ``sharding``, or params on a mesh with Explicit axes (whose types give
  the sharding, as ``om.muon`` reads them without ``sharding=``), the
  table says each Muon leaf's tensor-parallel mode and
  why: under ``mode="auto"`` each allowed mode's modeled time (the cost
  model of ``optax_muon._src.parallel.cost``, for the params' dtype); and
  under the table, for each data axis that stacks are homed over (FSDP),
  how evenly its ranks share the Newton–Schulz work (``max ÷ mean`` of
  their FLOPs on real matrices, and the share of the homed slots that are
  zero padding: ``optax_muon._src.parallel.balance``).

  Args:
    params: the parameter tree (arrays, shape structs or ``nnx.State``).
    optimizer: a built optimizer to describe, instead of the settings.

  Returns:
    The table, a ``str`` (whose ``repr`` is the table) with columns path, shape, role, optimizer,
    matrices as ``count × fan_in × fan_out`` (one term per ``split_qkv``
    piece), the scale each matrix's update gets (shape scale × extra
    factor), and with ``moment2_method`` the shape of the second moment
    ``om.adaptive_muon`` keeps for it, in the same ``count × fan_in ×
    fan_out`` terms (NorMuon's ``1`` is the axis it averages over), and
    with ``sharding`` the tp mode and why.

  Raises:
    ValueError: what ``om.muon`` would raise at ``init`` for these settings
      (leaves of 3+ axes without dimension numbers, unknown paths, ...).
  """
  if optimizer is not None:
    settings = {
      "labels": labels,
      "dimension_numbers": dimension_numbers,
      "split_qkv": split_qkv,
      "split_gate_up": split_gate_up,
      "layout": layout,
      "scale_mode": scale_mode,
      "match_adamw_update_rms": match_adamw_update_rms,
      "extra_scale_factor": extra_scale_factor,
      "adam_b1": adam_b1,
      "moment2_method": moment2_method,
      "sharding": sharding,
      "steps": steps,
      "precision": precision,
      "preconditioning": preconditioning,
      "memory_budget": memory_budget,
    }
    # the defaults are the signature's own, not restated here
    defaults = inspect.signature(describe).parameters
    given = [
      name
      for name, value in settings.items()
      if not _is_default(value, defaults[name].default)
    ]
    if given:
      raise ValueError(
        f"describe(optimizer=...) reads the optimizer's own settings, but "
        f"{sorted(given)} were also given; accepted: optimizer= alone, or "
        "the settings without optimizer="
      )
    found = _built.built(optimizer)
    if found is not None and found.member == "torch_muon":
      return describe_torch_muon(
        params,
        **{name: found.arguments[name] for name in _TORCH_MUON_READ},
      )
    return describe(params, **settings_of(optimizer))
  labels, dimension_numbers = from_layout(layout, labels, dimension_numbers)
  _checks.check_choice("scale_mode", scale_mode, shape_scale.SCALE_MODES)
  if moment2_method is not None:
    _checks.check_choice("moment2_method", moment2_method, MOMENT2_METHODS)
  extra = scaling.resolve_extra_scale_factor(
    extra_scale_factor, match_adamw_update_rms, adam_b1
  )
  label_tree = labels_lib.label_fn(labels)(params)
  leaves, _ = _paths.leaves_with_paths(params)
  label_of = dict(_paths.leaves_with_paths(label_tree)[0])
  # only the Muon leaves have a view; the others are masked as optax does
  muon_only = jax.tree.map(
    lambda leaf, label: (
      leaf if label == labels_lib.MUON else optax.MaskedNode()
    ),
    params,
    label_tree,
  )
  view_of = {
    path: view
    for path, _, view in layout_lib.view_resolver(
      dimension_numbers, split_qkv, split_gate_up
    )(muon_only)
  }
  # with a layout, its roles and reasons: the same table as print(layout)
  role_of, reason_of = {}, {}
  if layout is not None:
    role_of = dict(_paths.leaves_with_paths(layout.roles)[0])
    reason_of = dict(_paths.leaves_with_paths(layout.reasons)[0])
  rows = []
  for path, leaf in leaves:
    view = view_of.get(path)
    role = (
      ("split qkv" if len(view.widths) == 3 else "split gate/up")
      if view is not None and view.widths
      else role_of.get(path) or ("matrix" if view is not None else "—")
    )
    reason = [reason_of.get(path, "—")] if layout is not None else []
    rows.append((path, leaf, role, label_of[path], view, *reason))
  sharding_lib.check_sharding(sharding)
  muon_pairs = _paths.leaves_with_paths(muon_only)[0]
  sharding = sharding_lib.resolve(
    sharding, [x for _, x in muon_pairs], [view_of[p] for p, _ in muon_pairs]
  )
  plan_of = {}
  loads = []
  if sharding is not None:
    muon_views = [view_of[p] for p, _ in muon_pairs]
    specs = sharding.leaf_specs(muon_only)
    execution = Execution(memory_budget=memory_budget)
    plans = plan_lib.plan_leaves(
      sharding,
      muon_views,
      specs,
      [jnp.dtype(x.dtype).itemsize for _, x in muon_pairs],
      steps,
      precision,
      preconditioning,
      execution.auto_limit,
      execution.wave_bytes,
    )
    plan_of = {path: p for (path, _), p in zip(muon_pairs, plans)}
    # how evenly stacks homed over a data axis share out the work
    loads = balance.rank_loads(sharding, muon_views, specs, int(steps))
  # each matrix's scale as the optimizer applies it: from the shape it is
  # orthogonalized at (each shard's under blockwise)
  scales_of = lambda path, view: tuple(
    float(extra) * factor
    for factor in plan_of.get(path, plan_lib.unsharded(view)).scales(scale_mode)
  )
  table = render(
    rows,
    scales_of,
    moment2_of=None
    if moment2_method is None
    else functools.partial(moment2_shape, moment2_method),
    modes_of=None
    if sharding is None
    else lambda path: (
      (plan_of[path].mode, plan_of[path].reason)
      if path in plan_of
      else ("—", "—")
    ),
  )
  if not loads:
    return table
  return RoutingTable("\n".join([table, *(load.line() for load in loads)]))


def _is_default(value, default) -> bool:
  return value is default or (
    isinstance(value, (str, int, float)) and value == default
  )


# the builders whose optimizers describe reads: an update of shape scale ×
# extra factor × an orthogonalized (or low-rank) direction
DESCRIBED = (
  "muon",
  "scale_by_muon",
  "adaptive_muon",
  "scale_by_adaptive_muon",
  "dion",
  "scale_by_dion",
  "dion2",
  "nordion2",
  "scale_by_dion2",
)
# compat.torch_muon's settings that its table (describe_torch_muon) reads
_TORCH_MUON_READ = (
  "adjust_lr_fn",
  "weight_order",
  "labels",
  "layout",
  "dimension_numbers",
  "split_qkv",
  "split_gate_up",
)
# sharded by schemes of their own, not by the tensor-parallel modes
_OWN_SCHEMES = ("dion", "scale_by_dion", "dion2", "nordion2", "scale_by_dion2")


def settings_of(optimizer) -> dict[str, Any]:
  """``describe``'s keywords for a built ``optimizer``: those it was built
  with (``built.recorded``)."""
  found = _built.built(optimizer)
  if found is None or found.member not in DESCRIBED:
    raise ValueError(
      f"describe(optimizer=...) reads an optimizer built by one of "
      f"{list(DESCRIBED)} (or MuonConfig.build, which calls them) or "
      "compat.torch_muon; got "
      f"{'an optax transformation built elsewhere' if found is None else found.member}"
      " — wrap nothing around it, or pass its settings to describe instead"
    )
  arguments = found.arguments
  parameters = inspect.signature(describe).parameters
  # describe's own settings, as the optimizer was built with them
  read = [
    name
    for name in parameters
    if name not in ("params", "optimizer", "adam_b1")
  ]
  settings = {name: arguments[name] for name in read if name in arguments}
  # adam_b1 under the name its builder gives it: a direction's adamw_beta1,
  # an optimizer's adam_b1 (given directly or in its **scalar_kwargs)
  given = {**arguments.get("scalar_kwargs", {}), **arguments}
  settings["adam_b1"] = given.get(
    "adamw_beta1", given.get("adam_b1", parameters["adam_b1"].default)
  )
  if found.member in _OWN_SCHEMES:
    settings["sharding"] = None
  return settings


def describe_torch_muon(
  params: optax.Params,
  adjust_lr_fn: Literal["original", "match_rms_adamw"] | None = None,
  *,
  weight_order: Literal["in_out", "out_in"] = "in_out",
  labels: types.PerLeaf = None,
  layout: Any = None,
  dimension_numbers: types.PerLeaf = None,
  split_qkv: types.PerLeaf = None,
  split_gate_up: types.PerLeaf = None,
) -> RoutingTable:
  """The routing table of ``compat.torch_muon`` with these settings: its
  scale (``adjust_lr_fn``: ``√max(1, A/B)``, or ``0.2 √max(A, B)``) and its
  weight order, the routing as ``om.describe``'s.

  Args:
    params: the parameter tree (arrays, shape structs or ``nnx.State``).
    adjust_lr_fn: as in ``compat.torch_muon``.
    weight_order: as in ``compat.torch_muon``.
    labels: as in ``om.muon``.
    layout: as in ``om.muon``.
    dimension_numbers: as in ``om.muon``.
    split_qkv: as in ``om.muon``.
    split_gate_up: as in ``om.muon``.

  Returns:
    The table, as ``om.describe`` returns it.
  """
  # validated as torch_muon validates them; the layout itself goes on to
  # describe, for its roles and reasons
  _, given_dimension_numbers = from_layout(layout, labels, dimension_numbers)
  order_dimension_numbers = torch_muon_lib.torch_dimension_numbers(
    weight_order, given_dimension_numbers
  )
  scale_mode, extra = torch_muon_lib.torch_scale(adjust_lr_fn)
  return describe(
    params,
    labels=labels,
    dimension_numbers=dimension_numbers
    if weight_order == "in_out"
    else order_dimension_numbers,
    layout=layout,
    split_qkv=split_qkv,
    split_gate_up=split_gate_up,
    scale_mode=scale_mode,
    extra_scale_factor=extra,
  )
