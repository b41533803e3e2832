"""The structure a state tree of per-matrix pieces is built on.

``flax.nnx.Optimizer`` wraps each leaf of an optimizer state that sits where
a ``Variable`` sits in the params in a ``Variable`` of its own, with that
param's metadata, sharding included; it then gives the value that sharding.
A piece not shaped like its param (a second moment per neuron, Dion's ``Q``)
cannot take it (``IndivisibleError`` at ``init``), so such pieces are kept
on the params' structure down to its Variables, not inside them. Without
flax the structure is the params' own.
"""

import sys

import jax


def is_variable(x) -> bool:
  """Whether ``x`` is a ``flax.nnx.Variable`` (flax is not imported here:
  without it loaded, nothing is)."""
  nnx = sys.modules.get("flax.nnx")
  return nnx is not None and isinstance(x, nnx.Variable)


def _holds_a_leaf(x) -> bool:
  # a Variable optax.partition masked out holds no leaf: its place stays
  # empty, as in the params' own structure
  return is_variable(x) and len(jax.tree.leaves(x)) == 1


def pieces_structure(tree) -> jax.tree_util.PyTreeDef:
  """``tree``'s structure with each flax ``Variable`` that holds an array a
  leaf: unflatten a list of per-leaf pieces (tuples of arrays) on it, and
  flatten them back with its ``flatten_up_to``."""
  return jax.tree.structure(tree, is_leaf=_holds_a_leaf)
