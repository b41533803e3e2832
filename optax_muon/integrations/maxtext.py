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
"""

import functools
from typing import Any

import jax
import optax

from optax_muon import TensorParallel
from optax_muon import compat
from optax_muon._src.base import types

# MaxText's own get_optimizer, kept by install() so uninstall() restores it
_ORIGINAL: dict[str, Any] = {}
# MaxText's TP axis in its meshes (ici_tensor_parallelism)
TP_AXIS = "tensor"


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


def get_optimizer(
  config,
  learning_rate_schedule,
  model=None,
  mesh=None,
  *,
  tp_mode: types.TensorParallelMode = "auto",
  tp_axis: str = TP_AXIS,
  **options,
) -> optax.GradientTransformation:
  """MaxText's ``get_optimizer``, with ``opt_type=muon`` built by optax_muon.

  Args:
    config: MaxText's config.
    learning_rate_schedule: MaxText's schedule.
    model: the NNX model (its dimension numbers and partition specs); MaxText
      refuses Muon without one.
    mesh: MaxText's mesh; ``None`` (its SFT/DPO trainers): no tensor
      parallelism (each device works on what it holds).
    tp_mode: the ``om.TensorParallel`` mode over ``tp_axis``.
    tp_axis: the tensor-parallel mesh axis.
    **options: keywords of ``optax_muon.compat.muon``, over MaxText's
      settings (``precision``, ``method``, ``mu_dtype``, ...).

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
  from maxtext.utils import muon_utils  # noqa: PLC0415

  ns_coeffs, ns_steps = _ns_schedule(config)
  sharding = None
  if mesh is not None and tp_axis in mesh.axis_names:
    sharding = TensorParallel(
      mesh, tp_axis, tp_mode, specs=param_specs(model, mesh, config)
    )
  from flax import nnx  # noqa: PLC0415

  dims = nnx.to_pure_dict(
    muon_utils.get_muon_weight_dimension_numbers(model, config)
  )
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
  return _wrapped(config, tx, optimizers)


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


def install(**options) -> None:
  """Puts ``get_optimizer`` (with ``options``) in MaxText's place, so that
  its unmodified trainers build optax_muon for ``opt_type=muon``; again
  replaces the options; ``uninstall`` restores MaxText's own."""
  optimizers = _maxtext_optimizers()
  _ORIGINAL.setdefault("get_optimizer", optimizers.get_optimizer)
  optimizers.get_optimizer = functools.partial(get_optimizer, **options)


def uninstall() -> None:
  """MaxText's own ``get_optimizer`` back."""
  if "get_optimizer" in _ORIGINAL:
    _maxtext_optimizers().get_optimizer = _ORIGINAL.pop("get_optimizer")
