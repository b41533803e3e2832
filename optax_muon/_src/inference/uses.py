"""How each parameter leaf is used in a jaxpr: the walk behind ``infer_layout``.

Every value derived from a leaf by views only (casts, transposes, reshapes,
slices, broadcasts) is tracked as a ``View``: for each of its axes, the leaf
axes it covers. Each operation that consumes such a value records a ``Use``
on the leaf (a matmul's fan-in and fan-out axes, a conv, a gather, elementwise
use, or an operation the walk does not follow). Alongside, each value carries
the set of leaves whose matmul produced it last, which finds the head.
"""

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.extend

# ops that pass a leaf's axes through unchanged
_SAME_AXES = {
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
_ELEMENTWISE = {
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


def _part(pair: tuple) -> tuple:
  """``(leaf, axis)`` of a product axis seen as one piece of that axis (a
  reshape split it: RoPE's value pairs, halves of ``head_dim``): taking a
  piece apart does not make the leaf axis a batch axis."""
  return pair if len(pair) == 3 else (*pair, "part")


def _whole(pair: tuple) -> tuple:
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


class Analysis:
  """One walk over a jaxpr: each leaf's uses and each value's last matmuls.

  Leaves ``0 .. count-1`` are the params; higher leaf numbers are frozen
  weights (closed-over constants, the model's other state): their uses are
  not recorded, but a matmul with one ends a head path as a param's does.
  """

  def __init__(self, count: int):
    self.count = count
    self.uses: list[set[Use]] = [set() for _ in range(count)]

  def use(self, view: View, use: Use) -> None:
    if view.leaf < self.count:
      self.uses[view.leaf].add(use)

  def _params(self, leaves) -> frozenset[int]:
    return frozenset(leaf for leaf in leaves if leaf < self.count)

  def run(self, jaxpr, views: dict, tags: dict):
    """Walks ``jaxpr`` (a core.Jaxpr) with the given input views and tags;
    returns the views and tags of its outputs."""
    views, tags = dict(views), dict(tags)
    for eqn in jaxpr.eqns:
      out_views, out_tags = self.equation(eqn, views, tags)
      for var, view, tag in zip(eqn.outvars, out_views, out_tags):
        if view is not None:
          views[var] = view
        if tag:
          tags[var] = tag
    return (
      [views.get(v) if _is_var(v) else None for v in jaxpr.outvars],
      [
        tags.get(v, frozenset()) if _is_var(v) else frozenset()
        for v in jaxpr.outvars
      ],
    )

  def mark(self, pairs, kind: str, reason: str) -> None:
    """Records ``kind`` for each ``(leaf, axis)`` of a product's axis (not
    for pieces of an axis: see ``_part``)."""
    for pair in pairs:
      if len(pair) != 2:
        continue
      leaf, axis = pair
      if leaf < self.count:
        self.uses[leaf].add(Use(kind, output=frozenset({axis}), reason=reason))

  def product(self, eqn, values):
    """The outputs of ``eqn`` when its operands include products, marking
    the product axes it indexes apart or batches with a param; ``None``
    when the operation does not carry products."""
    name = eqn.primitive.name
    prods = [v if isinstance(v, Product) else None for v in values]
    if not any(prods):
      return None
    if name in ("slice", "dynamic_slice"):
      shape = eqn.invars[0].aval.shape
      sizes = (
        eqn.params["slice_sizes"]
        if name == "dynamic_slice"
        else [
          b - a
          for a, b in zip(
            eqn.params["start_indices"], eqn.params["limit_indices"]
          )
        ]
      )
      if prods[0] is None:
        return None
      for axis, (old, new) in enumerate(zip(shape, sizes)):
        if new == 1 < old:
          self.mark(prods[0].axes[axis], "split", "indexed apart")
      if name == "slice":
        return [
          _halved(
            prods[0],
            [
              (axis, start // new)
              for axis, (old, new, start) in enumerate(
                zip(shape, sizes, eqn.params["start_indices"])
              )
              if 2 * new == old and start % new == 0
            ],
          )
        ]
      return [prods[0]]
    if name == "gather" and prods[0] is not None and _is_index(eqn):
      collapsed = eqn.params["dimension_numbers"].collapsed_slice_dims
      for axis in collapsed:
        self.mark(prods[0].axes[axis], "split", "indexed apart")
      return [
        Product(
          tuple(a for d, a in enumerate(prods[0].axes) if d not in collapsed)
        )
      ]
    if name == "unstack" and prods[0] is not None:  # jax >= 0.11: a, b = x
      axis = eqn.params["axis"]
      self.mark(prods[0].axes[axis], "split", "indexed apart")
      return [_drop_axis(prods[0], axis)] * len(eqn.outvars)
    if name == "split" and prods[0] is not None:
      axis, sizes = eqn.params["axis"], eqn.params["sizes"]
      if all(size == 1 for size in sizes):
        self.mark(prods[0].axes[axis], "split", "indexed apart")
      if len(sizes) == 2 and sizes[0] == sizes[1]:
        return [_halved(prods[0], [(axis, half)]) for half in (0, 1)]
      return [prods[0]] * len(eqn.outvars)
    if name == "dot_general":
      (lhs_c, rhs_c), (lhs_b, rhs_b) = eqn.params["dimension_numbers"]
      if prods[0] is not None and prods[1] is not None:  # q·k, scores·v
        for prod, dims in (
          (prods[0], lhs_b + lhs_c),
          (prods[1], rhs_b + rhs_c),
        ):
          for axis in dims:
            self.mark(
              {_whole(p) for p in prod.axes[axis]},
              "attention",
              "batched or contracted against another product",
            )
      for prod, other, batch, contracting in (
        (prods[0], values[1], lhs_b, lhs_c),
        (prods[1], values[0], rhs_b, rhs_c),
      ):
        if (
          prod is not None
          and isinstance(other, View)
          and (other.leaf < self.count)
        ):
          for axis in contracting:
            self.mark(
              {_whole(p) for p in prod.axes[axis]},
              "attention",
              "contracted by another parameter's matmul",
            )
          for axis in batch:
            self.mark(
              prod.axes[axis],
              "expert",
              "a batch dim of another parameter's matmul",
            )
      return None
    if name in VIEW_OPS and prods[0] is not None and not any(values[1:]):
      return [VIEW_OPS[name](prods[0], eqn)]
    rank = len(eqn.outvars[0].aval.shape) if eqn.outvars else -1
    if name in _ELEMENTWISE and len(eqn.outvars) == 1:
      carried = [p for p in prods if p is not None and len(p.axes) == rank]
      if carried and rank == len(eqn.invars[0].aval.shape):
        halves = union(*[p.halves for p in carried])
        if name == "mul":
          for leaf, axis, half in halves:
            if half == 0 and (leaf, axis, 1) in halves:
              self.mark({(leaf, axis)}, "gated", "halves multiplied together")
        return [
          Product(
            tuple(union(*axes) for axes in zip(*[p.axes for p in carried])),
            halves,
          )
        ]
    return None

  def equation(self, eqn, views, tags):
    name = eqn.primitive.name
    values = [views.get(v) if _is_var(v) else None for v in eqn.invars]
    ins = [v if isinstance(v, View) else None for v in values]
    in_tags = union(
      *[tags.get(v, frozenset()) for v in eqn.invars if _is_var(v)]
    )
    n_out = len(eqn.outvars)
    plain = ([None] * n_out, [in_tags] * n_out)
    sub = _sub_jaxprs(eqn)
    carried = None if sub is not None else self.product(eqn, values)
    if carried is not None:
      self.use_plainly(name, ins)  # a bias added to a product, say
      return carried, [in_tags] * n_out
    if name == "dot_general":
      (lhs_c, rhs_c), (lhs_b, rhs_b) = eqn.params["dimension_numbers"]
      leaves, out_axes = set(), [frozenset()] * len(lhs_b)
      for view, operand, contracting, batch in (
        (ins[0], eqn.invars[0], lhs_c, lhs_b),
        (ins[1], eqn.invars[1], rhs_c, rhs_b),
      ):
        free = [
          a
          for a in range(len(operand.aval.shape))
          if a not in tuple(contracting) + tuple(batch)
        ]
        if view is not None:
          self.use(
            view, Use("dot", _axes(view, contracting), _axes(view, free))
          )
          leaves.add(view.leaf)
          out_axes += [
            frozenset({(view.leaf, a) for a in view.axes[d]}) for d in free
          ]
        else:
          out_axes += [frozenset()] * len(free)
      product = Product(tuple(out_axes)) if len(leaves) == 1 else None
      return [product], [self._params(leaves) if leaves else in_tags]
    if name == "ragged_dot_general" and ins[1] is not None:
      numbers = eqn.params["ragged_dot_dimension_numbers"]
      (_, contracting), (_, batch) = numbers.dot_dimension_numbers
      view, group = ins[1], tuple(numbers.rhs_group_dimensions)
      free = [
        a for a in range(len(view.axes)) if a not in contracting + batch + group
      ]
      self.use(view, Use("dot", _axes(view, contracting), _axes(view, free)))
      return [None], [self._params({view.leaf})]  # the group axis: batch
    if name == "conv_general_dilated" and ins[1] is not None:
      view = ins[1]
      spec = eqn.params["dimension_numbers"].rhs_spec  # (out, in, *spatial)
      if eqn.params["feature_group_count"] > 1:
        self.use(view, Use("depthwise", reason="feature_group_count > 1"))
      else:
        self.use(
          view, Use("conv", _axes(view, spec[1:]), _axes(view, spec[:1]))
        )
      return [None], [self._params({view.leaf})]
    if name == "dynamic_slice" and ins[0] is not None:
      return [ins[0]], [in_tags]  # w[i]: a later squeeze drops the axis
    if name == "gather" and ins[0] is not None:
      if _is_index(eqn):
        collapsed = eqn.params["dimension_numbers"].collapsed_slice_dims
        return [
          View(
            ins[0].leaf,
            tuple(a for d, a in enumerate(ins[0].axes) if d not in collapsed),
          )
        ], [in_tags]
      self.use(ins[0], Use("gather"))
      return plain
    if name == "unstack" and ins[0] is not None:  # jax >= 0.11: a, b = w
      return (
        [_drop_axis(ins[0], eqn.params["axis"])] * n_out,
        [in_tags] * n_out,
      )
    if name == "concatenate" and sum(v is not None for v in ins) == 1:
      # each operand is a slice of the result along the joined axis
      (view,) = [v for v in ins if v is not None]
      return [view], [in_tags]
    if name in VIEW_OPS and ins[0] is not None and not any(ins[1:]):
      view = VIEW_OPS[name](ins[0], eqn)
      if view is not None:
        return [view], [in_tags]
    if sub is not None:
      return self.call(
        name,
        eqn,
        sub,
        values,
        [
          tags.get(v, frozenset()) if _is_var(v) else frozenset()
          for v in eqn.invars
        ],
      )
    self.use_plainly(name, ins)
    return plain

  def use_plainly(self, name, ins) -> None:
    """Records an operation that is no matmul, view or sub-program."""
    for view in ins:
      if view is not None:
        kind = "vector" if name in _ELEMENTWISE else "unknown"
        self.use(
          view,
          Use(
            kind,
            reason=""
            if kind == "vector"
            else f"used through {name}, which the analysis does not follow",
          ),
        )

  def call(self, name, eqn, sub, ins, in_tags):
    """A primitive with sub-programs: map the operands in, walk, map back."""
    if name == "cond":
      outs = [
        self.run(branch, _bind(branch, ins[1:]), _bind(branch, in_tags[1:]))
        for branch in sub
      ]
      return (
        [None] * len(eqn.outvars),
        [union(*tags) for tags in zip(*[o[1] for o in outs])],
      )
    if name == "scan":
      (body,) = sub
      consts, carry = scan_operand_counts(eqn.params)
      sliced = [
        None if v is None else dataclasses.replace(v, axes=v.axes[1:])
        for v in ins[consts + carry :]
      ]
      body_ins = ins[: consts + carry] + sliced
      body_tags = list(in_tags)
      for _ in range(2):  # tags that go round the carry
        _, out_tags = self.run(
          body, _bind(body, body_ins), _bind(body, body_tags)
        )
        body_tags[consts : consts + carry] = [
          a | b
          for a, b in zip(body_tags[consts : consts + carry], out_tags[:carry])
        ]
      return [None] * len(eqn.outvars), out_tags
    if name == "while":
      cond_n, body_n = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
      body = eqn.params["body_jaxpr"].jaxpr
      body_ins = ins[cond_n:]
      body_tags = list(in_tags[cond_n:])
      for _ in range(2):
        _, out_tags = self.run(
          body, _bind(body, body_ins), _bind(body, body_tags)
        )
        body_tags[body_n:] = [
          a | b for a, b in zip(body_tags[body_n:], out_tags)
        ]
      return [None] * len(eqn.outvars), out_tags
    (inner,) = sub[:1]
    if len(inner.invars) != len(ins):
      for view in ins:
        if isinstance(view, View):
          self.use(
            view,
            Use(
              "unknown",
              reason=f"used through {name}, whose "
              "operands the analysis cannot map",
            ),
          )
      return [None] * len(eqn.outvars), [union(*in_tags)] * len(eqn.outvars)
    return self.run(inner, _bind(inner, ins), _bind(inner, in_tags))


def _halved(product: Product, halves) -> Product:
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


def scan_operand_counts(params) -> tuple[int, int]:
  """``(consts, carry)``: how many of a ``scan``'s operands are constants and
  how many the carry (the rest are the scanned-over ``xs``).

  jax ≤ 0.10 names them ``num_consts`` / ``num_carry``; jax ≥ 0.11 packs
  the operands as a flat tree ``ft_in`` of the three groups.
  """
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = params["ft_in"].unpack()
  return len(consts), len(carry)


def _is_var(v) -> bool:
  return isinstance(v, jax.extend.core.Var) and not isinstance(
    v, jax.extend.core.DropVar
  )


def _bind(jaxpr, values) -> dict:
  return {
    var: value
    for var, value in zip(jaxpr.invars, values)
    if value is not None and value != frozenset()
  }


def _sub_jaxprs(eqn):
  """The sub-programs (core.Jaxpr) of a call-like primitive, or None."""
  if eqn.primitive.name == "cond":
    return [b.jaxpr for b in eqn.params["branches"]]
  if eqn.primitive.name == "while":
    return [eqn.params["body_jaxpr"].jaxpr]
  for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    value = eqn.params.get(key)
    if value is not None:
      inner = getattr(value, "jaxpr", value)
      if hasattr(inner, "eqns"):
        return [inner]
  return None


def _axes(view: View, dims) -> frozenset[int]:
  return union(*[view.axes[d] for d in dims])


def _is_index(eqn) -> bool:
  """A gather that takes whole slices at one scalar index (``w[i]``)."""
  indices = eqn.invars[1].aval.shape
  return (
    math.prod(indices[:-1]) == 1
    and not eqn.params["dimension_numbers"].operand_batching_dims
  )


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
  element each) becomes pieces (``_part``) in each, and pieces merged back
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
        covered = frozenset(_part(p) for p in covered)
      elif len(split_from) > 1 and len(split_into) == 1:
        covered = frozenset(_whole(p) for p in covered)
    axes += [covered] * len(group_new)
  if len(axes) != len(new):
    return None
  return dataclasses.replace(value, axes=tuple(axes))


def _squeeze(view, eqn):
  dims = {d % len(view.axes) for d in eqn.params["dimensions"]}
  return dataclasses.replace(
    view, axes=tuple(a for d, a in enumerate(view.axes) if d not in dims)
  )


def _drop_axis(view, axis: int):
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
  **{name: (lambda view, eqn: view) for name in _SAME_AXES},
  "transpose": _transpose,
  "reshape": _reshape,
  "squeeze": _squeeze,
  "expand_dims": _expand,
  "broadcast_in_dim": _broadcast,
  "slice": _slice,
  "pad": _slice,  # a padded leaf keeps its axes, like a slice
}
