"""Per-leaf settings looked up by parameter path.

``optax.partition`` hands each inner transform the params with the other
group's leaves masked out, so a settings tree shaped like the full params no
longer matches the tree a transform sees. Looking settings up by path (the
longest matching prefix) works on both, and on ``flax.nnx.State`` too.
"""

import difflib
import re
from collections.abc import Callable
from collections.abc import Iterable
from typing import Any

import jax
import optax

Path = tuple[str, ...]


def key_name(key: Any) -> str:
  for attribute in ("key", "name", "idx"):
    if hasattr(key, attribute):
      return str(getattr(key, attribute))
  return str(key)


def path_names(path: Iterable[Any]) -> Path:
  """Key names of a path, without the ``.value`` a ``flax.nnx`` Variable adds
  (so a ``State`` of Variables and its pure-array form share their paths)."""
  path = tuple(path)
  if (
    path
    and isinstance(path[-1], jax.tree_util.GetAttrKey)
    and (path[-1].name == "value")
  ):
    path = path[:-1]
  return tuple(key_name(k) for k in path)


def path_string(path: Path) -> str:
  return "/".join(path)


def leaves_with_paths(tree, is_leaf: Callable[[Any], bool] | None = None):
  """``[(path_names, leaf)]`` and the treedef, in ``jax.tree`` order."""
  pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
  return [(path_names(p), leaf) for p, leaf in pairs], treedef


def known_paths(tree) -> set[Path]:
  """Every path a setting may name in ``tree``: its leaves, the leaves an
  enclosing ``optax.partition`` masked out (``optax.MaskedNode``, the other
  group's), and every prefix of them (a subtree)."""
  pairs, _ = jax.tree_util.tree_flatten_with_path(
    tree, is_leaf=lambda x: isinstance(x, optax.MaskedNode)
  )
  leaves = {path_names(p) for p, _ in pairs}
  return {p[:end] for p in leaves for end in range(len(p) + 1)}


def _sample(known: set[Path], count: int = 3) -> str:
  leaves = sorted(
    p for p in known if not any(q[: len(p)] == p and q != p for q in known)
  )
  shown = [path_string(p) for p in leaves[:count]]
  return f"{len(leaves)} leaves, e.g. {shown}" if leaves else "no leaves"


def check_paths_known(name: str, paths: Iterable[Path], tree) -> None:
  """Raises ValueError naming any of ``paths`` that is no path of ``tree``,
  with the nearest existing ones (compared ignoring case), or, when none is
  near, what the tree does hold."""
  known = known_paths(tree)
  for path in paths:
    if path not in known:
      text = path_string(path)
      by_lower = {path_string(p).lower(): path_string(p) for p in known if p}
      nearest = difflib.get_close_matches(
        text.lower(), sorted(by_lower), n=3, cutoff=0.3
      )
      hint = (
        f"nearest existing paths: {[by_lower[p] for p in nearest]}"
        if nearest
        else f"the optimizer sees {_sample(known)}"
      )
      raise ValueError(
        f"{name} names {text!r}, which is no parameter path; {hint}"
      )


def is_function(value) -> bool:
  """Whether a settings argument is to be called on the params: a function,
  not a pytree that happens to be callable (an Equinox ``Module``, a Flax
  struct) — those are settings trees."""
  if isinstance(value, jax.tree_util.Partial):
    return True
  return callable(value) and jax.tree_util.treedef_is_leaf(
    jax.tree.structure(value)
  )


class FromLayout:
  """A settings tree that may describe more leaves than a transform sees
  (a whole model's layout for an optimizer of its adapters): its entries are
  looked up by path and those no leaf has are ignored."""

  def __init__(self, tree, shapes: dict | None = None):
    self.tree = tree
    self.shapes = shapes  # {path: shape} of the leaves it was read from

  def check_shapes(self, tree) -> None:
    """Raises when a leaf of ``tree`` that the layout describes has another
    shape than the one the layout was read from (a layout of another
    model)."""
    if not self.shapes:
      return
    for path, leaf in leaves_with_paths(tree)[0]:
      want = self.shapes.get(path)
      if want is not None and hasattr(leaf, "shape"):
        got = tuple(leaf.shape)
        if got != tuple(want):
          raise ValueError(
            f"layout= was read from a model whose leaf "
            f"{path_string(path) or '<root>'} has shape {tuple(want)}, but "
            f"the params' has shape {got}; infer the layout from this model"
          )


def _type_name(types) -> str:
  types = types if isinstance(types, tuple) else (types,)
  return "a " + " or ".join(
    f"{t.__module__.split('._')[0]}.{t.__qualname__}"
    if t.__module__ != "builtins"
    else t.__name__
    for t in types
  )


class PathLookup:
  """Per-leaf settings given once for all, as a tree, or as a function.

  ``single_type`` values apply to every leaf; a tree (a prefix of the params
  allowed; ``None`` nodes are empty subtrees) is read by path; a function is
  called on the tree a transform sees, a callable pytree is a tree. A
  ``FromLayout`` tree may name paths the transform does not see; any other
  tree may not. Leaves the tree does not name get ``default``. A tree's
  entries of another type raise ``TypeError`` here, a function's when
  called.
  """

  def __init__(
    self,
    name: str,
    spec,
    single_type: type | tuple[type, ...],
    default=None,
    type_name: str | None = None,
  ):
    self._name = name
    self._layout = spec if isinstance(spec, FromLayout) else None
    self._strict = not isinstance(spec, FromLayout)
    self._spec = spec.tree if isinstance(spec, FromLayout) else spec
    self._single_type = single_type
    self._default = default
    self._type_name = type_name or _type_name(single_type)
    if not self._is_function() and not self._is_single(self._spec):
      self._table(self._spec)

  def _is_function(self) -> bool:
    return is_function(self._spec) and not isinstance(
      self._spec, self._single_type
    )

  def _is_single(self, spec) -> bool:
    return spec is None or isinstance(spec, self._single_type)

  def _table(self, spec) -> dict:
    is_leaf = lambda x: isinstance(x, self._single_type)
    table = dict(leaves_with_paths(spec, is_leaf=is_leaf)[0])
    for path, value in table.items():
      if not isinstance(value, self._single_type):
        where = f" at {path_string(path)}" if path else ""
        raise TypeError(
          f"{self._name}{where} is {value!r}, not {self._type_name}; "
          "accepted: one for all leaves, a tree of them (None: no entry) "
          "or a function of the params returning such a tree"
        )
    return table

  def resolve(self, tree) -> Callable[[Path], Any]:
    if self._layout is not None:
      self._layout.check_shapes(tree)
    spec = self._spec(tree) if self._is_function() else self._spec
    if self._is_single(spec):
      value = self._default if spec is None else spec
      return lambda path: value
    table = self._table(spec)
    if self._strict:
      check_paths_known(self._name, table, tree)

    def lookup(path: Path):
      for end in range(len(path), -1, -1):
        if path[:end] in table:
          return table[path[:end]]
      return self._default

    return lookup


def matches(patterns: Iterable[str], path: Path) -> bool:
  """Whether any regex in ``patterns`` is found in the ``/``-joined path,
  ignoring case (Linen's ``Dense_2`` is matched by ``"dense_2"`` and
  ``"Dense_2"``)."""
  text = path_string(path)
  return any(re.search(p, text, re.IGNORECASE) for p in patterns)
