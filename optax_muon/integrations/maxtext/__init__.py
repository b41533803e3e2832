"""optax_muon inside MaxText's own trainers, without patching MaxText.

    from optax_muon.integrations import maxtext
    maxtext.install(tp_mode="auto")   # then MaxText's train.py / train_compile.py
                                      # build optax_muon for opt_type=muon

MaxText looks its optimizer up at call time
(``maxtext.optimizers.optimizers.get_optimizer(config, learning_rate_schedule,
model, mesh=...)``, from ``train.py`` through ``train_utils``, from
``train_compile.py`` and from its SFT/DPO trainers). ``install`` puts
``get_optimizer`` below in its place: ``opt_type=muon`` builds
``optax_muon.compat.muon`` — MaxText's own Muon (``optax.contrib.muon``) to the
number, with MaxText's settings (``muon_beta``, ``muon_weight_decay``,
``muon_consistent_rms``, the Adam group's, DeepSeek-V4's 10-step schedule) and
MaxText's own dimension numbers — run over MaxText's mesh in a
tensor-parallel mode (``tp_mode``, default ``"auto"``; Megatron's modes by
``shard_map``), where MaxText's Muon is partitioned by XLA. Every other
``opt_type`` is MaxText's own. MaxText's spike-skip and trainable-mask
wrappers are applied as MaxText applies them. MaxText is imported when
``install`` or ``get_optimizer`` runs, never by this package.

Where MaxText has not vetted its own table (its config refuses
``opt_type=muon`` outside the decoder blocks in ``TESTED_BLOCKS``),
``install`` lets the config through and the Muon leaves and their dimension
numbers are read from the model's own program by ``om.infer_layout``. State
leaves of shapes a param does not have (8-bit momentum's scales) get a
sharding their shape divides, so MaxText can place them, ZeRO-1 included.

From a shell, MaxText's trainers with optax_muon installed::

    python -m optax_muon.integrations.maxtext [--tp-mode auto] [--mu-dtype 8bit] \
        train|train_compile maxtext/configs/base.yml opt_type=muon ...
"""

import contextlib
import functools
import math
import typing
from typing import Any

import jax
import optax

from optax_muon import TensorParallel
from optax_muon import compat
from optax_muon import infer_layout
from optax_muon._src.base import checks as _checks
from optax_muon._src.base import types

# MaxText's own get_optimizer, kept by install() so uninstall() restores it
_ORIGINAL: dict[str, Any] = {}
# MaxText's TP axis in its meshes (ici_tensor_parallelism)
TP_AXIS = "tensor"
# the decoder blocks MaxText 0.2.5's config accepts opt_type=muon for (its
# hand-written dimension numbers were checked there); the others are routed
# by om.infer_layout
TESTED_BLOCKS = (
  "deepseek",
  "deepseek4",
  "qwen3",
  "qwen3_moe",
  "qwen3_custom_moe",
  "qwen3_next",
  "gpt_oss",
  "gemma3",
  "llama2",
)
Routing = typing.Literal["auto", "maxtext", "inferred"]
ROUTINGS = typing.get_args(Routing)
# what MaxText's config raises for opt_type=muon outside TESTED_BLOCKS
_GATE = "Muon dimension numbers haven't been tested"


def _maxtext_optimizers():
  from maxtext.optimizers import optimizers  # noqa: PLC0415  (lazy: optional)

  return optimizers


def _ns_schedule(config) -> tuple[Any, int]:
  """MaxText's Newton–Schulz coefficients and steps for its decoder block."""
  from maxtext.common.common_types import DecoderBlockType  # noqa: PLC0415

  if config.decoder_block == DecoderBlockType.DEEPSEEK4:
    return [(3.4445, -4.7750, 2.0315)] * 8 + [(2.0, -1.5, 0.5)] * 2, 10
  return (3.4445, -4.7750, 2.0315), 5


def param_specs(model, mesh, config) -> Any:
  """Each param's ``PartitionSpec`` on ``mesh``, from MaxText's logical-axis
  rules with the scanned layer axis inserted, as a plain dict by path."""
  from flax import nnx  # noqa: PLC0415
  from flax.linen import partitioning  # noqa: PLC0415
  from maxtext.utils import sharding  # noqa: PLC0415

  with partitioning.axis_rules(config.logical_axis_rules):
    named = sharding.nnx_construct_named_sharding(
      nnx.state(model, nnx.Param), mesh
    )
  return _specs_of(nnx.to_pure_dict(named))


def _specs_of(tree):
  return jax.tree.map(
    lambda s: s.spec,
    tree,
    is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding),
  )


def dimension_numbers(
  model, config, routing: Routing = "auto", mesh=None
) -> Any:
  """Each param's Muon dimension numbers (``None``: Adam), as a plain dict by
  path: ``"maxtext"``: MaxText's own table; ``"inferred"``: read by
  ``om.infer_layout`` from the model's forward pass (traced, not run);
  ``"auto"``: MaxText's table for ``TESTED_BLOCKS``, inferred elsewhere.
  The model is traced on ``mesh`` under MaxText's logical-axis rules, as its
  train step runs it (its experts' ``shard_map`` reads both)."""
  from flax import nnx  # noqa: PLC0415

  _checks.check_choice("routing", routing, ROUTINGS)
  if routing == "maxtext" or (
    routing == "auto" and _block_name(config) in TESTED_BLOCKS
  ):
    from maxtext.utils import muon_utils  # noqa: PLC0415

    return nnx.to_pure_dict(
      muon_utils.get_muon_weight_dimension_numbers(model, config)
    )
  import jax.numpy as jnp  # noqa: PLC0415

  tokens = jax.ShapeDtypeStruct((1, config.max_target_length), jnp.int32)
  from flax.linen import partitioning  # noqa: PLC0415

  try:
    with (
      contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh),
      partitioning.axis_rules(config.logical_axis_rules),
    ):
      layout = infer_layout(
        model,
        tokens,
        tokens,  # positions
        decoder_segment_ids=tokens,
        enable_dropout=False,
      )
  except Exception as error:
    why = (
      "routing='inferred'"
      if routing == "inferred"
      else f"decoder_block={_block_name(config)!r} is not one MaxText "
      f"vetted its Muon table for ({', '.join(TESTED_BLOCKS)})"
    )
    raise ValueError(
      f"{why}, and om.infer_layout could not trace the model to read its "
      "matrices (the error above); pass muon_weight_dimension_numbers= "
      "to get_optimizer/install, or routing='maxtext'"
    ) from error
  is_dims = lambda x: x is None or hasattr(x, "reduction_axis")
  dims, treedef = jax.tree.flatten(
    nnx.to_pure_dict(layout.dimension_numbers), is_leaf=is_dims
  )
  # the same dict by path, its leaves (strings) in the same order
  labels = jax.tree.leaves(nnx.to_pure_dict(layout.labels))
  # compat routes by dims alone: a Muon leaf of the default view gets it
  # written out, every other leaf None (Adam)
  return jax.tree.unflatten(
    treedef,
    [
      (d or compat.MuonDimensionNumbers()) if label == "muon" else None
      for label, d in zip(labels, dims)
    ],
  )


def mesh_of(model) -> jax.sharding.Mesh | None:
  """The mesh MaxText trains ``model`` on, where its caller passes none (its
  SFT and DPO trainers): the one ``jax.set_mesh`` made current (SFT builds
  its optimizer inside it), else the one the model's params are placed on
  (DPO's model comes placed); ``None`` when neither says."""
  from flax import nnx  # noqa: PLC0415

  current = jax.sharding.get_mesh()
  if not current.empty:
    return current
  placed = {
    leaf.sharding.mesh
    for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))
    if isinstance(getattr(leaf, "sharding", None), jax.sharding.NamedSharding)
  }
  if len(placed) > 1:
    raise ValueError(
      "the model's params are placed on more than one mesh; pass mesh= to "
      "get_optimizer"
    )
  return placed.pop() if placed else None


def _block_name(config) -> str:
  block = config.decoder_block
  return str(getattr(block, "value", block)).lower()


def _fitted_state(tx, mesh, config) -> optax.GradientTransformation:
  """``tx`` whose state Variables each carry a sharding their shape divides.

  A state leaf built per param (``nnx.Optimizer`` keeps the param's Variable
  metadata on it) is placed by MaxText with the param's logical axes; one of
  another shape (8-bit momentum's scales: a block count on the last axis)
  may not divide there. Such a leaf gets the param's sharding without the
  axes that do not divide (as an ``out_sharding``); the others are left as
  MaxText would place them."""
  from flax import nnx  # noqa: PLC0415
  from flax.linen import partitioning  # noqa: PLC0415
  from maxtext.utils import sharding  # noqa: PLC0415

  def shards(axes) -> int:
    if axes is None:
      return 1
    names = (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[name] for name in names)

  def fit(variable):
    if not isinstance(variable, nnx.Variable):
      return variable
    value = variable.get_value()
    if not hasattr(value, "shape"):
      return variable
    with partitioning.axis_rules(config.logical_axis_rules):
      placed = sharding.get_nnx_var_named_sharding_with_scan_axis(
        variable, mesh
      ).get_value()
    if not isinstance(placed, jax.sharding.NamedSharding):
      return variable
    spec = tuple(placed.spec)[: value.ndim]
    spec += (None,) * (value.ndim - len(spec))
    fitted = tuple(
      axes if size % shards(axes) == 0 else None
      for size, axes in zip(value.shape, spec)
    )
    if fitted == spec:
      return variable
    # flax reads the deprecated names over out_sharding: they go
    metadata = {
      key: entry
      for key, entry in variable.get_metadata().items()
      if key not in ("sharding_names", "sharding")
    }
    metadata["out_sharding"] = jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(*fitted)
    )
    return type(variable)(value, **metadata)

  def init_fn(params):
    return jax.tree.map(
      fit, tx.init(params), is_leaf=lambda x: isinstance(x, nnx.Variable)
    )

  return tx._replace(init=init_fn)


def get_optimizer(
  config,
  learning_rate_schedule,
  model=None,
  mesh=None,
  *,
  tp_mode: types.TensorParallelMode = "auto",
  tp_axis: str = TP_AXIS,
  routing: Routing = "auto",
  **options,
) -> optax.GradientTransformation:
  """MaxText's ``get_optimizer``, with ``opt_type=muon`` built by optax_muon.

  Args:
    config: MaxText's config.
    learning_rate_schedule: MaxText's schedule.
    model: the NNX model (its dimension numbers and partition specs); MaxText
      refuses Muon without one.
    mesh: MaxText's mesh; ``None`` (its SFT/DPO trainers): ``mesh_of(model)``
      (the current mesh, else the params'), and where there is none, no
      tensor parallelism.
    tp_mode: the ``om.TensorParallel`` mode over ``tp_axis``.
    tp_axis: the tensor-parallel mesh axis.
    routing: which leaves are Muon's, and their dimension numbers:
      ``"maxtext"`` (MaxText's table), ``"inferred"`` (``om.infer_layout``
      on the model) or ``"auto"`` (MaxText's for ``TESTED_BLOCKS``,
      inferred elsewhere); see ``dimension_numbers``.
    **options: keywords of ``optax_muon.compat.muon``, over MaxText's
      settings (``precision``, ``method``, ``mu_dtype`` —
      ``om.QuantizedMomentum()`` for 8-bit momentum —,
      ``muon_weight_dimension_numbers`` over the routing, ...).

  Returns:
    What MaxText's ``get_optimizer`` returns, for ``opt_type=muon`` with
    optax_muon's Muon inside its wrappers.
  """
  optimizers = _maxtext_optimizers()
  original = _ORIGINAL.get("get_optimizer", optimizers.get_optimizer)
  if config.opt_type != "muon":
    return original(config, learning_rate_schedule, model, mesh=mesh)
  if model is None:
    raise ValueError(
      "opt_type=muon needs the model (its dimension numbers), as MaxText's "
      "own Muon does; pass model="
    )
  ns_coeffs, ns_steps = _ns_schedule(config)
  if mesh is None:
    mesh = mesh_of(model)
  sharding = None
  if mesh is not None and tp_axis in mesh.axis_names:
    sharding = TensorParallel(
      mesh, tp_axis, tp_mode, specs=param_specs(model, mesh, config)
    )
  if "muon_weight_dimension_numbers" in options:
    dims = options["muon_weight_dimension_numbers"]
  else:
    dims = dimension_numbers(model, config, routing, mesh)
  settings = dict(
    ns_coeffs=ns_coeffs,
    ns_steps=ns_steps,
    beta=config.muon_beta,
    eps=config.adam_eps,
    weight_decay=config.muon_weight_decay,
    mu_dtype=config.mu_dtype,
    adam_b1=config.adam_b1,
    adam_b2=config.adam_b2,
    adam_eps_root=config.adam_eps_root,
    adam_weight_decay=config.adam_weight_decay,
    muon_weight_dimension_numbers=dims,
    consistent_rms=config.muon_consistent_rms,
    sharding=sharding,
  )
  # what the caller passes wins over MaxText's config (mu_dtype=,
  # precision=, ...)
  tx = compat.muon(learning_rate_schedule, **(settings | options))
  tx = _wrapped(config, tx, optimizers)
  return tx if mesh is None else _fitted_state(tx, mesh, config)


def _wrapped(config, tx, optimizers) -> optax.GradientTransformation:
  """``tx`` inside MaxText's spike-skip and trainable-mask wrappers."""
  if getattr(config, "skip_step_on_spikes", False):
    tx = optimizers.skip_step_on_spikes(
      tx,
      interval=config.skip_step_interval,
      scaling_factor=config.skip_step_scaling_factor,
    )
  frozen = optimizers._get_path_mask_fn(  # noqa: SLF001  (MaxText's own rule)
    getattr(config, "trainable_parameters_mask", None),
    match_returns_true=False,
  )
  if frozen is None:
    return tx
  return optax.multi_transform(
    {"trainable": tx, "frozen": optax.set_to_zero()},
    lambda params: jax.tree.map(
      lambda x: "frozen" if x else "trainable", frozen(params)
    ),
  )


def _past_the_gate(initialize):
  """MaxText's config initializer, letting ``opt_type=muon`` through for
  decoder blocks outside ``TESTED_BLOCKS``: only that check is skipped (the
  config is validated as ``adamw``, then set back to ``muon``)."""

  @functools.wraps(initialize)
  def past_the_gate(argv=None, *args, **kwargs):
    try:
      return initialize(argv, *args, **kwargs)
    except ValueError as error:  # pydantic's ValidationError is one
      if _GATE not in str(error):
        raise
    config = initialize(argv, *args, **(kwargs | {"opt_type": "adamw"}))
    config.opt_type = "muon"
    return config

  return past_the_gate


def install(**options) -> None:
  """Puts ``get_optimizer`` (with ``options``) in MaxText's place, so that
  its unmodified trainers build optax_muon for ``opt_type=muon`` (for every
  decoder block: see ``TESTED_BLOCKS``); again replaces the options;
  ``uninstall`` restores MaxText's own."""
  from maxtext.configs import pyconfig  # noqa: PLC0415

  optimizers = _maxtext_optimizers()
  _ORIGINAL.setdefault("get_optimizer", optimizers.get_optimizer)
  _ORIGINAL.setdefault("_initialize_pydantic", pyconfig._initialize_pydantic)  # noqa: SLF001
  optimizers.get_optimizer = functools.partial(get_optimizer, **options)
  pyconfig._initialize_pydantic = _past_the_gate(  # noqa: SLF001
    _ORIGINAL["_initialize_pydantic"]
  )


def uninstall() -> None:
  """MaxText's own ``get_optimizer`` and config checks back."""
  from maxtext.configs import pyconfig  # noqa: PLC0415

  if "get_optimizer" in _ORIGINAL:
    _maxtext_optimizers().get_optimizer = _ORIGINAL.pop("get_optimizer")
  if "_initialize_pydantic" in _ORIGINAL:
    pyconfig._initialize_pydantic = _ORIGINAL.pop("_initialize_pydantic")  # noqa: SLF001
