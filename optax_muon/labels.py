"""Which leaf goes to Muon and which to the scalar optimizer (AdamW).

Muon is for the hidden weight matrices. Embeddings, the unembedding (lm_head),
norm scales, biases and every other vector go to AdamW. Leaves with three or
more axes (scan-stacked layers, MoE experts, fused heads) are Muon leaves: their
extra axes are batch axes, never a reason to fall back to AdamW.
"""

from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from optax_muon import _paths

MUON, ADAM = "muon", "adam"
LABELS = (MUON, ADAM)

# Regexes searched in the lower-cased, "/"-joined parameter path.
DEFAULT_ADAM_PATTERNS = (
    r"embed", r"(^|/)wte(/|$)", r"(^|/)wpe(/|$)", r"lm_head", r"unembed",
    r"(^|/)head(/|$)", r"norm", r"(^|/)ln", r"(^|/)scale(/|$)", r"bias",
)
DEFAULT_MUON_PATTERNS = ()


def _is_vector(shape: Sequence[int]) -> bool:
  return len(shape) < 2 or min(shape[-2:]) == 1


def default_labels(params, *, adam_patterns: Sequence[str] = DEFAULT_ADAM_PATTERNS,
                   muon_patterns: Sequence[str] = DEFAULT_MUON_PATTERNS):
  """Labels each leaf ``"muon"`` or ``"adam"`` by its path and shape.

  A leaf is ``"muon"`` when its path matches a ``muon_patterns`` regex, else
  ``"adam"`` when it is a vector (fewer than 2 axes, or a last-two-axes shape
  with a 1) or its path matches an ``adam_patterns`` regex, else ``"muon"``.
  The router of an MoE is a matrix and goes to Muon (as in Megatron-Core);
  add ``"router"`` to ``adam_patterns`` to send it to AdamW.

  Args:
    params: the parameter tree (arrays, shape structs or ``flax.nnx.State``).
    adam_patterns: regexes for the paths that go to AdamW.
    muon_patterns: regexes for the paths that go to Muon whatever their name.

  Returns:
    A tree like ``params`` of ``"muon"`` / ``"adam"`` strings.

  Raises:
    ValueError: a ``muon_patterns`` match that is not a matrix.
  """
  leaves, treedef = _paths.leaves_with_paths(params)
  labels = []
  for path, leaf in leaves:
    shape = jnp.shape(leaf)
    if _paths.matches(muon_patterns, path):
      if len(shape) < 2:
        raise ValueError(
            f"muon_patterns={list(muon_patterns)} matched "
            f"{_paths.path_string(path)} of shape {shape}, which has fewer "
            "than 2 axes; Muon needs a matrix")
      labels.append(MUON)
    elif _is_vector(shape) or _paths.matches(adam_patterns, path):
      labels.append(ADAM)
    else:
      labels.append(MUON)
  return jax.tree.unflatten(treedef, labels)


def label_fn(labels) -> Callable:
  """``labels`` (``None``, a tree or a callable) as a checked callable."""
  if labels is None:
    return default_labels
  resolve = labels if callable(labels) else (lambda params: labels)

  def checked(params):
    tree = resolve(params)
    bad = {leaf for leaf in jax.tree.leaves(tree) if leaf not in LABELS}
    if bad:
      raise ValueError(f"labels has values {sorted(map(str, bad))}; accepted "
                       f"values: {list(LABELS)}")
    return tree

  return checked
