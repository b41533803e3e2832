"""Per-leaf settings looked up by parameter path.

``optax.partition`` hands each inner transform the params with the other
group's leaves masked out, so a settings tree shaped like the full params no
longer matches the tree a transform sees. Looking settings up by path (the
longest matching prefix) works on both, and on ``flax.nnx.State`` too.
"""

import difflib
import re
from typing import Any, Callable, Iterable

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
  if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and (
      path[-1].name == "value"):
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
      tree, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
  leaves = {path_names(p) for p, _ in pairs}
  return {p[:end] for p in leaves for end in range(len(p) + 1)}


def check_paths_known(name: str, paths: Iterable[Path], tree) -> None:
  """Raises ValueError naming any of ``paths`` that is no path of ``tree``,
  with the nearest existing ones (compared ignoring case)."""
  known = known_paths(tree)
  for path in paths:
    if path not in known:
      text = path_string(path)
      by_lower = {path_string(p).lower(): path_string(p) for p in known if p}
      nearest = difflib.get_close_matches(text.lower(), sorted(by_lower), n=3,
                                          cutoff=0.3)
      raise ValueError(
          f"{name} names {text!r}, which is no parameter path; nearest "
          f"existing paths: {[by_lower[p] for p in nearest]}")


class PathLookup:
  """Per-leaf settings given once for all, as a tree, or as a callable.

  ``single_type`` values apply to every leaf; a tree (a prefix of the params
  allowed) is read by path; a callable is called on the tree a transform sees.
  Leaves the tree does not name get ``default``.
  """

  def __init__(self, name: str, spec, single_type: type | tuple[type, ...],
               default=None):
    self._name = name
    self._spec = spec
    self._single_type = single_type
    self._default = default

  def resolve(self, tree) -> Callable[[Path], Any]:
    spec = self._spec(tree) if callable(self._spec) and not isinstance(
        self._spec, self._single_type) else self._spec
    if spec is None or isinstance(spec, self._single_type):
      value = self._default if spec is None else spec
      return lambda path: value
    is_leaf = lambda x: x is None or isinstance(x, self._single_type)
    table = dict(leaves_with_paths(spec, is_leaf=is_leaf)[0])
    check_paths_known(self._name, table, tree)
    for path, value in table.items():
      if value is not None and not isinstance(value, self._single_type):
        raise ValueError(
            f"{self._name} at {path_string(path) or '<root>'} is {value!r}; "
            f"accepted: {self._single_type} or None, one for all leaves, "
            "a tree of them or a callable returning such a tree")

    def lookup(path: Path):
      for end in range(len(path), -1, -1):
        if path[:end] in table:
          value = table[path[:end]]
          return self._default if value is None else value
      return self._default

    return lookup


def matches(patterns: Iterable[str], path: Path) -> bool:
  """Whether any regex in ``patterns`` is found in the ``/``-joined path,
  ignoring case (Linen's ``Dense_2`` is matched by ``"dense_2"`` and
  ``"Dense_2"``)."""
  text = path_string(path)
  return any(re.search(p, text, re.IGNORECASE) for p in patterns)
