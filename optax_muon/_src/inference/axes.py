"""What a jaxpr value is to the layout walk, axis by axis, and how the ops
that only move axes (casts, transposes, reshapes, slices, broadcasts) carry
it: a ``View`` of a parameter leaf, or a ``Product`` of a leaf's matmul; and
the ``Use`` the walk records on a leaf."""

import dataclasses
from collections.abc import Callable

# ops that pass a leaf's axes through unchanged
SAME_AXES = {
  "convert_element_type",
  "copy",
  "copy_p",
  "reduce_precision",
  "sharding_constraint",
  "mesh_cast",
  "optimization_barrier",
  "stop_gradient",
}
# ops after which a leaf is a vector (elementwise, reductions, selections)
ELEMENTWISE = {
  "add",
  "sub",
  "mul",
  "div",
  "neg",
  "max",
  "min",
  "exp",
  "exp2",
  "log",
  "log1p",
  "expm1",
  "tanh",
  "logistic",
  "sqrt",
  "rsqrt",
  "cbrt",
  "pow",
  "integer_pow",
  "square",
  "abs",
  "sign",
  "select_n",
  "erf",
  "erf_inv",
  "sin",
  "cos",
  "reduce_sum",
  "reduce_max",
  "reduce_min",
  "reduce_prod",
  "argmax",
  "argmin",
  "eq",
  "ne",
  "lt",
  "le",
  "gt",
  "ge",
  "clamp",
  "floor",
  "ceil",
  "round",
  "is_finite",
  "add_any",
  "nextafter",
  "atan2",
  "rem",
}


@dataclasses.dataclass(frozen=True)
class View:
  """A jaxpr value that is (a view of) param leaf ``leaf``: for each of its
  axes, the leaf axes it covers (several when merged; shared when split)."""

  leaf: int
  axes: tuple[frozenset[int], ...]


@dataclasses.dataclass(frozen=True)
class Product:
  """A jaxpr value computed by a param's matmul (or from such values by views
  and elementwise ops): for each of its axes, the ``(leaf, leaf axis)``
  pairs of the params' free (output) axes it carries. What happens to those
  axes later says whether they are matrix axes: indexed apart (Gemma's
  fused K/V) or a batch dim of another param's matmul (a dense MoE's expert
  axis) makes them batch axes. ``halves``: ``(leaf, leaf axis, 0 or 1)``
  when the value is one half of such an axis (a fused gate/up's gate or up)."""

  axes: tuple[frozenset[tuple], ...]
  halves: frozenset[tuple[int, int, int]] = frozenset()


def part(pair: tuple) -> tuple:
  """``(leaf, axis)`` of a product axis seen as one piece of that axis (a
  reshape split it: RoPE's value pairs, halves of ``head_dim``): taking a
  piece apart does not make the leaf axis a batch axis."""
  return pair if len(pair) == 3 else (*pair, "part")


def whole(pair: tuple) -> tuple:
  return pair[:2]


@dataclasses.dataclass(frozen=True)
class Use:
  # "dot", "conv", "depthwise", "gather", "vector", "unknown"; and for an
  # output axis of a matmul's product: "split" (indexed apart), "expert"
  # (a batch dim of another param's matmul), "gated" (its two halves
  # multiplied together: a fused gate/up), "attention" (batched or
  # contracted against another parameter's product, or contracted by
  # another parameter's matmul: an axis the structure has classed, which a
  # name may not make an expert axis)
  kind: str
  reduction: frozenset[int] = frozenset()
  output: frozenset[int] = frozenset()
  reason: str = ""


def union(*sets) -> frozenset:
  return frozenset().union(*sets)


def halved(product: Product, halves) -> Product:
  """``product`` cut to half ``half`` of each ``(axis, half)``: records which
  leaf output axes it is half of."""
  return dataclasses.replace(
    product,
    halves=product.halves
    | {
      (pair[0], pair[1], half)
      for axis, half in halves
      for pair in product.axes[axis]
      if len(pair) == 2
    },
  )


def leaf_axes(view: View, dims) -> frozenset[int]:
  return union(*[view.axes[d] for d in dims])


def _transpose(view, eqn):
  return dataclasses.replace(
    view, axes=tuple(view.axes[p] for p in eqn.params["permutation"])
  )


def _reshape_groups(old, new):
  """The axes of a reshape from ``old`` to ``new`` in groups ``(old axes,
  new axes)`` of equal size (whole axes merged or split), or ``None``."""
  groups, i, j = [], 0, 0
  while i < len(old) or j < len(new):
    group_old, group_new = [i], [j]
    size_old = old[i] if i < len(old) else 1
    size_new = new[j] if j < len(new) else 1
    while size_old != size_new:
      if size_old < size_new:
        i += 1
        if i >= len(old):
          return None
        group_old.append(i)
        size_old *= old[i]
      else:
        j += 1
        if j >= len(new):
          return None
        group_new.append(j)
        size_new *= new[j]
    groups.append(
      (
        [a for a in group_old if a < len(old)],
        [b for b in group_new if b < len(new)],
      )
    )
    i, j = i + 1, j + 1
  return groups


def _reshape(value, eqn):
  """Whole axes merged or split: each output axis covers the input axes of
  its group. Of a ``Product``, an axis split into several (of more than one
  element each) becomes pieces (``part``) in each, and pieces merged back
  make the whole axis again."""
  old, new = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
  groups = _reshape_groups(old, new)
  if groups is None:
    return None
  axes = []
  for group_old, group_new in groups:
    covered = union(*[value.axes[a] for a in group_old])
    if isinstance(value, Product):
      split_from = [a for a in group_old if old[a] > 1]
      split_into = [b for b in group_new if new[b] > 1]
      if len(split_from) == 1 and len(split_into) > 1:
        covered = frozenset(part(p) for p in covered)
      elif len(split_from) > 1 and len(split_into) == 1:
        covered = frozenset(whole(p) for p in covered)
    axes += [covered] * len(group_new)
  if len(axes) != len(new):
    return None
  return dataclasses.replace(value, axes=tuple(axes))


def _squeeze(view, eqn):
  dims = {d % len(view.axes) for d in eqn.params["dimensions"]}
  return dataclasses.replace(
    view, axes=tuple(a for d, a in enumerate(view.axes) if d not in dims)
  )


def drop_axis(view, axis: int):
  return dataclasses.replace(
    view, axes=view.axes[:axis] + view.axes[axis + 1 :]
  )


def _expand(view, eqn):
  axes = list(view.axes)
  for d in sorted(eqn.params["dimensions"]):
    axes.insert(d, frozenset())
  return dataclasses.replace(view, axes=tuple(axes))


def _broadcast(view, eqn):
  axes = [frozenset()] * len(eqn.outvars[0].aval.shape)
  for src, dst in enumerate(eqn.params["broadcast_dimensions"]):
    axes[dst] = view.axes[src]
  return dataclasses.replace(view, axes=tuple(axes))


def _slice(view, eqn):
  return view  # a static slice keeps every axis (a later squeeze drops one)


VIEW_OPS: dict[str, Callable] = {
  **{name: (lambda view, eqn: view) for name in SAME_AXES},
  "transpose": _transpose,
  "reshape": _reshape,
  "squeeze": _squeeze,
  "expand_dims": _expand,
  "broadcast_in_dim": _broadcast,
  "slice": _slice,
  "pad": _slice,  # a padded leaf keeps its axes, like a slice
}
