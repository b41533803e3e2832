"""Which leaf goes to Muon, which to the scalar optimizer (AdamW), which to none.

Muon is for the hidden weight matrices. Embeddings, the unembedding (lm_head),
norm scales, biases and every other vector go to AdamW. Leaves with three or
more axes (scan-stacked layers, MoE experts, fused heads) are Muon leaves: their
extra axes are batch axes, never a reason to fall back to AdamW. Leaves that
are not floating point (integer counters, boolean masks) get ``"none"``: no
update and no optimizer state.
"""

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_muon._src.base import paths as _paths

MUON, ADAM, NONE = "muon", "adam", "none"
LABELS = (MUON, ADAM, NONE)


def _component(names: str) -> str:
  """A regex matching a whole path component made of ``names``."""
  return rf"(^|/)({names})(/|$)"


# Regexes searched in the "/"-joined parameter path, ignoring case. Each
# matches whole path components only: "embed_proj", "denormalizer" and
# "lnr_mlp" are matrices, "embed_tokens", "final_norm" and "ln_f" are not.
DEFAULT_ADAM_PATTERNS = (
  _component(
    r"(\w+_)?(embed|embeds|embedding|embeddings|embedder)(_\d+)?"
    r"|embed_tokens|wte|wpe"
  ),
  _component(r"lm_head|unembed|unembedding|(\w+_)?head(_\d+)?"),
  _component(
    r"(\w+_)?(layer_?norm|rms_?norm|group_?norm|batch_?norm|norm)"
    r"(_?\d+)?|ln(_?(\d+|f|final|pre|post))?"
  ),
  _component(r"scale|(\w+_)?bias(es)?"),
)
DEFAULT_MUON_PATTERNS = ()


def _is_vector(shape: Sequence[int]) -> bool:
  return len(shape) < 2 or min(shape[-2:]) == 1


def is_float(leaf) -> bool:
  """Whether a leaf (array, shape struct or scalar) is floating or complex."""
  dtype = getattr(leaf, "dtype", None)
  dtype = np.asarray(leaf).dtype if dtype is None else dtype
  return jnp.issubdtype(dtype, jnp.inexact)


def default_labels(
  params: optax.Params,
  *,
  adam_patterns: Sequence[str] = (),
  muon_patterns: Sequence[str] = (),
) -> Any:
  """Labels each leaf ``"muon"``, ``"adam"`` or ``"none"`` by path, shape, dtype.

  A leaf that is not floating point, or has no elements, is ``"none"`` (a
  zero-size leaf has nothing to update). Otherwise it is ``"muon"``
  when its path matches a ``muon_patterns`` regex, else ``"adam"`` when it is
  a vector (fewer than 2 axes, or a last-two-axes shape with a 1) or its path
  matches a built-in or an ``adam_patterns`` regex, else ``"muon"``. Patterns
  are searched in the ``/``-joined path ignoring case; the built-in ones
  (``DEFAULT_ADAM_PATTERNS``) match whole path components (``embed``,
  ``wte``, ``lm_head``, ``head``, ``*_norm``, ``ln_f``, ``scale``,
  ``bias``, …). The router of an MoE is a matrix and goes to Muon (as in
  Megatron-Core); ``adam_patterns=("router",)`` sends it to AdamW.

  Args:
    params: the parameter tree (arrays, shape structs or ``flax.nnx.State``).
    adam_patterns: more regexes for paths that go to AdamW, added to the
      built-in ones (to replace those, pass ``labels=`` a tree or function).
    muon_patterns: regexes for the paths that go to Muon whatever their name.

  Returns:
    A tree like ``params`` of ``"muon"`` / ``"adam"`` / ``"none"`` strings.

  Raises:
    ValueError: a pattern that matches no leaf, or a ``muon_patterns`` match
      that is not a matrix.
  """
  for name, patterns in (
    ("adam_patterns", adam_patterns),
    ("muon_patterns", muon_patterns),
  ):
    if isinstance(patterns, str):
      raise TypeError(
        f"{name} must be a sequence of regexes, got the single "
        f"string {patterns!r}; wrap it in a tuple"
      )
  leaves, treedef = _paths.leaves_with_paths(params)
  for name, patterns in (
    ("adam_patterns", adam_patterns),
    ("muon_patterns", muon_patterns),
  ):
    for pattern in patterns:
      if not any(_paths.matches([pattern], path) for path, _ in leaves):
        raise ValueError(
          f"{name} has {pattern!r}, which matches no parameter path; the "
          f"params have {len(leaves)} leaves, e.g. "
          f"{[_paths.path_string(p) for p, _ in leaves[:3]]}"
        )
  adam_patterns = tuple(DEFAULT_ADAM_PATTERNS) + tuple(adam_patterns)
  labels = []
  for path, leaf in leaves:
    shape = jnp.shape(leaf)
    if not is_float(leaf) or 0 in shape:
      labels.append(NONE)
    elif _paths.matches(muon_patterns, path):
      if len(shape) < 2:
        raise ValueError(
          f"muon_patterns={list(muon_patterns)} matched "
          f"{_paths.path_string(path)} of shape {shape}, which has fewer "
          "than 2 axes; Muon needs a matrix"
        )
      labels.append(MUON)
    elif _is_vector(shape) or _paths.matches(adam_patterns, path):
      labels.append(ADAM)
    else:
      labels.append(MUON)
  return jax.tree.unflatten(treedef, labels)


def label_fn(labels) -> Callable:
  """``labels`` (``None``, a tree or a function) as a checked callable.

  A tree (or a function's result) is read by path, a prefix of the params
  allowed; a path that names no parameter (except in a ``_paths.FromLayout``
  tree), a leaf left without a label, a value outside ``LABELS`` and a
  non-float leaf given an optimizer raise ``ValueError``.
  """
  if labels is None:
    return default_labels
  lookup = _paths.PathLookup("labels", labels, str)

  def checked(params):
    label_of = lookup.resolve(params)
    leaves, treedef = _paths.leaves_with_paths(params)
    tree = []
    for path, leaf in leaves:
      label, where = label_of(path), _paths.path_string(path) or "<root>"
      if label is None and isinstance(labels, _paths.FromLayout):
        raise ValueError(
          f"layout= describes no leaf {where}: it was read from another "
          "model; infer it from the model these params are from "
          "(om.infer_layout(model, batch)), or pass labels= and "
          "dimension_numbers= instead"
        )
      if label is None:
        raise ValueError(
          f"labels gives no label for leaf {where}; accepted "
          f"values: {list(LABELS)}"
        )
      if label not in LABELS:
        raise ValueError(
          f"labels has {label!r} for leaf {where}; accepted "
          f"values: {list(LABELS)}"
        )
      if label != NONE and not is_float(leaf):
        raise ValueError(
          f"labels sends leaf {where} of dtype {getattr(leaf, 'dtype', None)} to "
          f"{label!r}; a leaf that is not floating point can only be "
          f"{NONE!r} (no update)"
        )
      tree.append(label)
    return jax.tree.unflatten(treedef, tree)

  return checked
