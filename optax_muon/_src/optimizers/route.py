"""Routing: a Muon-family direction for the matrices, AdamW (or Lion) for the
rest, nothing for the frozen leaves; weight decay and the learning rate."""

import typing

import jax
import numpy as np
import optax

from optax_muon._src.base import checks as _checks
from optax_muon._src.base import paths as _paths
from optax_muon._src.base import types
from optax_muon._src.parallel import offload
from optax_muon._src.views import labels as labels_lib

SCALAR_OPTIMIZERS = typing.get_args(types.ScalarOptimizer)


def matrices_only(params):
  """The default weight-decay mask of the AdamW group: leaves of 2+ axes
  (embeddings, heads) decay; norm scales, biases and other vectors do not."""
  return jax.tree.map(lambda x: jax.numpy.ndim(x) >= 2, params)


def chain_in_params_dtype(
  *transforms: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
  """``optax.chain(*transforms)`` with each update leaf cast to its
  parameter's dtype at the end (Muon's float32 momentum would otherwise give
  float32 updates to bfloat16 params); the state is ``optax.chain``'s tuple
  of the transforms' states, so checkpoints are unchanged. Extra arguments
  are passed on. One function, not a chain inside a cast: each call between
  ``tx.update`` and the Newton–Schulz loop is a frame of every trace."""
  transforms = tuple(optax.with_extra_args_support(t) for t in transforms)

  def init_fn(params):
    return tuple(t.init(params) for t in transforms)

  def update_fn(updates, state, params=None, **extra_args):
    new_state = []
    for transform, inner in zip(transforms, state):
      updates, inner = transform.update(updates, inner, params, **extra_args)
      new_state.append(inner)
    if params is not None:
      updates = jax.tree.map(
        lambda u, p: u.astype(jax.numpy.result_type(p)), updates, params
      )
    return updates, tuple(new_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _mask_by_path(name, mask):
  """A weight-decay mask tree made readable on the partitioned (masked) tree."""
  if mask is None or callable(mask):
    return mask
  lookup = _paths.PathLookup(name, mask, (bool, np.bool_), default=False)

  def resolved(params):
    of = lookup.resolve(params)
    leaves, treedef = _paths.leaves_with_paths(params)
    return jax.tree.unflatten(treedef, [bool(of(path)) for path, _ in leaves])

  return resolved


def _check_learning_rate(name, value, optional=False):
  if value is None and not optional:
    raise ValueError(
      f"{name}=None is not accepted; accepted: a float >= 0 or "
      "an optax schedule"
    )
  if value is not None and not callable(value):
    _checks.check_range(name, value, 0.0, np.inf)


def route(
  direction: optax.GradientTransformation,
  learning_rate,
  *,
  weight_decay=0.0,
  weight_decay_mask=None,
  labels=None,
  scalar_optimizer: types.ScalarOptimizer = "adam",
  adam_learning_rate=None,
  adam_b1=0.9,
  adam_b2=0.999,
  adam_eps=1e-8,
  adam_weight_decay=0.0,
  adam_weight_decay_mask=None,
  muon_step=None,
  state_memory_kind: str | None = None,
  direction_streams: bool = False,
) -> optax.GradientTransformation:
  """A Muon-family ``direction`` for the ``"muon"`` leaves, with decoupled
  weight decay and the learning rate (or ``muon_step``, a transform that
  turns the direction into the step itself), beside AdamW (or Lion) for the
  ``"adam"`` leaves and nothing for the ``"none"`` ones, the whole state in
  ``state_memory_kind`` between steps (see ``muon``): each piece's state is
  brought to the device for the update, but a ``direction`` that
  ``direction_streams`` (``scale_by_muon`` built with that memory kind)
  brings its own a wave at a time."""
  offload.check_memory_kind(state_memory_kind)
  kept = lambda tx: offload.offload_state(tx, state_memory_kind)
  if state_memory_kind is None:
    kept = lambda tx: tx
  if not direction_streams:
    direction = kept(direction)
  _check_learning_rate("learning_rate", learning_rate)
  _check_learning_rate("adam_learning_rate", adam_learning_rate, optional=True)
  _checks.check_choice("scalar_optimizer", scalar_optimizer, SCALAR_OPTIMIZERS)
  _checks.check_range("weight_decay", weight_decay, 0.0, np.inf)
  _checks.check_range("adam_weight_decay", adam_weight_decay, 0.0, np.inf)
  _checks.check_range("adam_b1", adam_b1, 0.0, 1.0)
  _checks.check_range("adam_b2", adam_b2, 0.0, 1.0)
  _checks.check_range("adam_eps", adam_eps, 0.0, np.inf)
  if muon_step:
    muon_chain = chain_in_params_dtype(direction, kept(muon_step))
  else:
    muon_chain = chain_in_params_dtype(
      direction,
      kept(
        optax.add_decayed_weights(
          weight_decay, _mask_by_path("weight_decay_mask", weight_decay_mask)
        )
      ),
      kept(optax.scale_by_learning_rate(learning_rate)),
    )
  scalar_lr = (
    learning_rate if adam_learning_rate is None else adam_learning_rate
  )
  scalar_mask = (
    matrices_only
    if adam_weight_decay_mask is None
    else _mask_by_path("adam_weight_decay_mask", adam_weight_decay_mask)
  )
  # optax.lion takes AdamW's betas, decay and mask, and no eps
  shared = dict(
    b1=adam_b1, b2=adam_b2, weight_decay=adam_weight_decay, mask=scalar_mask
  )
  if scalar_optimizer == "adam":
    scalar_chain = optax.adamw(scalar_lr, eps=adam_eps, **shared)
  else:
    scalar_chain = optax.lion(scalar_lr, **shared)
  return optax.partition(
    {
      labels_lib.MUON: muon_chain,
      labels_lib.ADAM: kept(scalar_chain),
      labels_lib.NONE: optax.set_to_zero(),
    },
    labels_lib.label_fn(labels),
  )
