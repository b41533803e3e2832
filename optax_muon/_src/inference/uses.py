"""How each parameter leaf is used in a jaxpr: the walk behind ``infer_layout``.

Every value derived from a leaf by views only is tracked as a ``View`` (see
``axes``); each operation that consumes one records a ``Use`` on the leaf (a
matmul's fan-in and fan-out axes, a conv, a gather, elementwise use, or an
operation the walk does not follow). A matmul's output is tracked as a
``Product``, so that what later happens to its axes (indexed apart, batched
by another parameter, its halves multiplied) classes them. Alongside, each
value carries the set of leaves whose matmul produced it last, which finds
the head.

The walk is written as jax's own interpreters are: a rule per primitive, in
three tables. ``LEAF_RULES``: what an operation does to a parameter's view;
``PRODUCT_RULES``: what it does to a matmul's product; ``CALL_RULES``: how a
primitive with sub-programs (``cond``, ``scan``, ``while``; any other call
maps its operands straight in) is walked. Ops that only move axes are
``axes.VIEW_OPS``; elementwise ops are ``axes.ELEMENTWISE``. A primitive no
table names is a use the walk does not follow (``"unknown"``).
"""

import dataclasses

from optax_muon._src.inference import jaxprs
from optax_muon._src.inference.axes import ELEMENTWISE
from optax_muon._src.inference.axes import VIEW_OPS
from optax_muon._src.inference.axes import Product
from optax_muon._src.inference.axes import Use
from optax_muon._src.inference.axes import View
from optax_muon._src.inference.axes import drop_axis
from optax_muon._src.inference.axes import halved
from optax_muon._src.inference.axes import leaf_axes
from optax_muon._src.inference.axes import union
from optax_muon._src.inference.axes import whole


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

  def params(self, leaves) -> frozenset[int]:
    return frozenset(leaf for leaf in leaves if leaf < self.count)

  def mark(self, pairs, kind: str, reason: str) -> None:
    """Records ``kind`` for each ``(leaf, axis)`` of a product's axis (not
    for pieces of an axis: see ``axes.part``)."""
    for pair in pairs:
      if len(pair) != 2:
        continue
      leaf, axis = pair
      if leaf < self.count:
        self.uses[leaf].add(Use(kind, output=frozenset({axis}), reason=reason))

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
      [views.get(v) if jaxprs.is_var(v) else None for v in jaxpr.outvars],
      [
        tags.get(v, frozenset()) if jaxprs.is_var(v) else frozenset()
        for v in jaxpr.outvars
      ],
    )

  def equation(self, eqn, views, tags):
    """The views (or products) and tags of ``eqn``'s outputs."""
    name = eqn.primitive.name
    values = [views.get(v) if jaxprs.is_var(v) else None for v in eqn.invars]
    operand_tags = [
      tags.get(v, frozenset()) if jaxprs.is_var(v) else frozenset()
      for v in eqn.invars
    ]
    in_tags = union(*operand_tags)
    n_out = len(eqn.outvars)
    sub = jaxprs.sub_jaxprs(eqn)
    if sub is not None:
      return CALL_RULES.get(name, _call)(self, eqn, sub, values, operand_tags)
    if any(isinstance(v, Product) for v in values):
      carried = PRODUCT_RULES.get(name, _product_moved)(self, eqn, values)
      if carried is not None:
        self._use_plainly(name, values)  # a bias added to a product, say
        return carried, [in_tags] * n_out
    ins = [v if isinstance(v, View) else None for v in values]
    rule = LEAF_RULES.get(name)
    out = None if rule is None else rule(self, eqn, ins, in_tags)
    if out is not None:
      return out
    if name in VIEW_OPS and ins[0] is not None and not any(ins[1:]):
      view = VIEW_OPS[name](ins[0], eqn)
      if view is not None:
        return [view], [in_tags]
    self._use_plainly(name, values)
    return [None] * n_out, [in_tags] * n_out

  def _use_plainly(self, name, values) -> None:
    """Records an operation that is no matmul, view or sub-program."""
    for view in values:
      if isinstance(view, View):
        kind = "vector" if name in ELEMENTWISE else "unknown"
        reason = (
          ""
          if kind == "vector"
          else f"used through {name}, which the analysis does not follow"
        )
        self.use(view, Use(kind, reason=reason))


# -- parameters' views: matmuls, convs, indexing ------------------------------
# A rule returns ``(out_views, out_tags)``, or None to treat the operation as
# a view op (axes.VIEW_OPS) or a plain use.


def _free_axes(operand, contracting, batch) -> list[int]:
  return [
    a
    for a in range(len(operand.aval.shape))
    if a not in tuple(contracting) + tuple(batch)
  ]


def _dot_general(analysis, eqn, ins, in_tags):
  (lhs_c, rhs_c), (lhs_b, rhs_b) = eqn.params["dimension_numbers"]
  leaves, out_axes = set(), [frozenset()] * len(lhs_b)
  for view, operand, contracting, batch in (
    (ins[0], eqn.invars[0], lhs_c, lhs_b),
    (ins[1], eqn.invars[1], rhs_c, rhs_b),
  ):
    free = _free_axes(operand, contracting, batch)
    if view is None:
      out_axes += [frozenset()] * len(free)
      continue
    analysis.use(
      view, Use("dot", leaf_axes(view, contracting), leaf_axes(view, free))
    )
    leaves.add(view.leaf)
    out_axes += [
      frozenset({(view.leaf, a) for a in view.axes[d]}) for d in free
    ]
  product = Product(tuple(out_axes)) if len(leaves) == 1 else None
  return [product], [analysis.params(leaves) if leaves else in_tags]


def _ragged_dot_general(analysis, eqn, ins, in_tags):
  if ins[1] is None:
    return None
  numbers = eqn.params["ragged_dot_dimension_numbers"]
  (_, contracting), (_, batch) = numbers.dot_dimension_numbers
  view, group = ins[1], tuple(numbers.rhs_group_dimensions)
  free = [
    a for a in range(len(view.axes)) if a not in contracting + batch + group
  ]
  analysis.use(
    view, Use("dot", leaf_axes(view, contracting), leaf_axes(view, free))
  )
  return [None], [analysis.params({view.leaf})]  # the group axis: batch


def _conv_general_dilated(analysis, eqn, ins, in_tags):
  view = ins[1]
  if view is None:
    return None
  spec = eqn.params["dimension_numbers"].rhs_spec  # (out, in, *spatial)
  if eqn.params["feature_group_count"] > 1:
    analysis.use(view, Use("depthwise", reason="feature_group_count > 1"))
  else:
    analysis.use(
      view,
      Use("conv", leaf_axes(view, spec[1:]), leaf_axes(view, spec[:1])),
    )
  return [None], [analysis.params({view.leaf})]


def _dynamic_slice(analysis, eqn, ins, in_tags):
  if ins[0] is None:
    return None
  return [ins[0]], [in_tags]  # w[i]: a later squeeze drops the axis


def _gather(analysis, eqn, ins, in_tags):
  view = ins[0]
  if view is None:
    return None
  if not jaxprs.is_index(eqn):
    analysis.use(view, Use("gather"))
    return [None], [in_tags]
  collapsed = eqn.params["dimension_numbers"].collapsed_slice_dims
  kept = tuple(a for d, a in enumerate(view.axes) if d not in collapsed)
  return [View(view.leaf, kept)], [in_tags]


def _unstack(analysis, eqn, ins, in_tags):  # jax >= 0.11: a, b = w
  if ins[0] is None:
    return None
  n_out = len(eqn.outvars)
  return [drop_axis(ins[0], eqn.params["axis"])] * n_out, [in_tags] * n_out


def _concatenate(analysis, eqn, ins, in_tags):
  present = [v for v in ins if v is not None]
  if len(present) != 1:
    return None
  # each operand is a slice of the result along the joined axis
  return present, [in_tags]


LEAF_RULES = {
  "dot_general": _dot_general,
  "ragged_dot_general": _ragged_dot_general,
  "conv_general_dilated": _conv_general_dilated,
  "dynamic_slice": _dynamic_slice,
  "gather": _gather,
  "unstack": _unstack,
  "concatenate": _concatenate,
}


# -- matmuls' products: what is done to their axes ----------------------------
# A rule returns the outputs (products), or None when the operation does not
# carry the product (it may still have marked its axes).


def _product_slice(analysis, eqn, values):
  product = values[0]
  if not isinstance(product, Product):
    return None
  shape = eqn.invars[0].aval.shape
  if eqn.primitive.name == "dynamic_slice":
    sizes = eqn.params["slice_sizes"]
  else:
    starts = eqn.params["start_indices"]
    sizes = [b - a for a, b in zip(starts, eqn.params["limit_indices"])]
  # a slice of one element is indexed apart only once its axis is dropped
  # (_product_squeeze: ``kv[..., 0, :]``); kept, it may be joined back
  # (MaxText's RoPE rolls head_dim by concatenating ``x[..., :1]``)
  if eqn.primitive.name == "dynamic_slice":
    return [product]
  halves = [
    (axis, start // new)
    for axis, (old, new, start) in enumerate(zip(shape, sizes, starts))
    if 2 * new == old and start % new == 0
  ]
  return [halved(product, halves)]


def _product_squeeze(analysis, eqn, values):
  """A dropped axis of one element that carries a param's output axis: a
  part taken apart from it (``kv[..., 0, :]``, a slice then a squeeze)."""
  product = values[0]
  if not isinstance(product, Product):
    return None
  dims = {d % len(product.axes) for d in eqn.params["dimensions"]}
  for axis in dims:
    analysis.mark(product.axes[axis], "split", "indexed apart")
  return [VIEW_OPS["squeeze"](product, eqn)]


def _product_concatenate(analysis, eqn, values):
  """Products joined along an axis (MLA's ``[q_nope | q_pe]``, RoPE's
  roll) with activations at most: each axis carries what any operand's
  does."""
  del analysis
  rank = len(eqn.outvars[0].aval.shape)
  prods = [v for v in values if isinstance(v, Product) and len(v.axes) == rank]
  if not prods or any(isinstance(v, View) for v in values):
    return None  # a parameter joined in (gpt-oss's sinks): the leaf rule's
  axes = tuple(union(*axes) for axes in zip(*[p.axes for p in prods]))
  return [Product(axes)]


def _product_gather(analysis, eqn, values):
  product = values[0]
  if not isinstance(product, Product) or not jaxprs.is_index(eqn):
    return None
  collapsed = eqn.params["dimension_numbers"].collapsed_slice_dims
  for axis in collapsed:
    analysis.mark(product.axes[axis], "split", "indexed apart")
  return [
    Product(tuple(a for d, a in enumerate(product.axes) if d not in collapsed))
  ]


def _product_unstack(analysis, eqn, values):  # jax >= 0.11: a, b = x
  product = values[0]
  if not isinstance(product, Product):
    return None
  axis = eqn.params["axis"]
  analysis.mark(product.axes[axis], "split", "indexed apart")
  return [drop_axis(product, axis)] * len(eqn.outvars)


def _product_split(analysis, eqn, values):
  product = values[0]
  if not isinstance(product, Product):
    return None
  axis, sizes = eqn.params["axis"], eqn.params["sizes"]
  if all(size == 1 for size in sizes):
    analysis.mark(product.axes[axis], "split", "indexed apart")
  if len(sizes) == 2 and sizes[0] == sizes[1]:
    return [halved(product, [(axis, half)]) for half in (0, 1)]
  return [product] * len(eqn.outvars)


def _product_dot_general(analysis, eqn, values):
  """Marks the product axes a matmul batches or contracts (q·k, scores·v,
  an expert's batch dim); the matmul itself is then a parameter's rule."""
  (lhs_c, rhs_c), (lhs_b, rhs_b) = eqn.params["dimension_numbers"]
  prods = [v if isinstance(v, Product) else None for v in values]
  if prods[0] is not None and prods[1] is not None:
    for prod, dims in ((prods[0], lhs_b + lhs_c), (prods[1], rhs_b + rhs_c)):
      for axis in dims:
        analysis.mark(
          {whole(p) for p in prod.axes[axis]},
          "attention",
          "batched or contracted against another product",
        )
  for prod, other, batch, contracting in (
    (prods[0], values[1], lhs_b, lhs_c),
    (prods[1], values[0], rhs_b, rhs_c),
  ):
    if prod is None or not (
      isinstance(other, View) and other.leaf < analysis.count
    ):
      continue
    for axis in contracting:
      analysis.mark(
        {whole(p) for p in prod.axes[axis]},
        "attention",
        "contracted by another parameter's matmul",
      )
    for axis in batch:
      analysis.mark(
        prod.axes[axis], "expert", "a batch dim of another parameter's matmul"
      )
  if (prods[0] is None) != (prods[1] is None) and not any(
    isinstance(v, View) for v in values
  ):
    # a product times activations (attention weights times the values):
    # the result carries the product's batch and free axes, so a later
    # matmul still sees what they are
    return [_carried_through_dot(eqn, prods)]
  return None


def _carried_through_dot(eqn, prods) -> Product:
  """The output of ``dot_general`` whose one ``Product`` operand is in
  ``prods``: its axes in the output's order (batch, lhs free, rhs free)."""
  (lhs_c, rhs_c), (lhs_b, rhs_b) = eqn.params["dimension_numbers"]
  batch = lhs_b if prods[0] is not None else rhs_b
  carrier = prods[0] if prods[0] is not None else prods[1]
  axes = [carrier.axes[d] for d in batch]
  for prod, operand, contracting, batch_dims in (
    (prods[0], eqn.invars[0], lhs_c, lhs_b),
    (prods[1], eqn.invars[1], rhs_c, rhs_b),
  ):
    free = _free_axes(operand, contracting, batch_dims)
    axes += [prod.axes[d] if prod is not None else frozenset() for d in free]
  return Product(tuple(axes))


def _product_moved(analysis, eqn, values):
  """A view op on a product, or an elementwise op of products of one rank
  (a gate times its up marks the fused axis ``"gated"``)."""
  name = eqn.primitive.name
  prods = [v if isinstance(v, Product) else None for v in values]
  if name in VIEW_OPS and prods[0] is not None and not any(values[1:]):
    return [VIEW_OPS[name](prods[0], eqn)]
  if name not in ELEMENTWISE or len(eqn.outvars) != 1:
    return None
  rank = len(eqn.outvars[0].aval.shape)
  carried = [p for p in prods if p is not None and len(p.axes) == rank]
  if not carried or rank != len(eqn.invars[0].aval.shape):
    return None
  halves = union(*[p.halves for p in carried])
  if name == "mul":
    for leaf, axis, half in halves:
      if half == 0 and (leaf, axis, 1) in halves:
        analysis.mark({(leaf, axis)}, "gated", "halves multiplied together")
  axes = tuple(union(*axes) for axes in zip(*[p.axes for p in carried]))
  return [Product(axes, halves)]


PRODUCT_RULES = {
  "slice": _product_slice,
  "dynamic_slice": _product_slice,
  "gather": _product_gather,
  "unstack": _product_unstack,
  "split": _product_split,
  "squeeze": _product_squeeze,
  "concatenate": _product_concatenate,
  "dot_general": _product_dot_general,
}


# -- sub-programs --------------------------------------------------------------
# A rule maps the operands into the sub-program(s), walks them and returns
# the outputs' views and tags.


def _cond(analysis, eqn, branches, values, tags):
  outs = [
    analysis.run(
      branch, jaxprs.bind(branch, values[1:]), jaxprs.bind(branch, tags[1:])
    )
    for branch in branches
  ]
  return (
    [None] * len(eqn.outvars),
    [union(*branch_tags) for branch_tags in zip(*[o[1] for o in outs])],
  )


def _loop_tags(analysis, body, body_values, body_tags, carry_at, carry):
  """Walks a loop body twice, so that tags that go round the carry (the
  first ``carry`` outputs, fed back in at ``carry_at``) reach every output."""
  body_tags = list(body_tags)
  for _ in range(2):
    _, out_tags = analysis.run(
      body, jaxprs.bind(body, body_values), jaxprs.bind(body, body_tags)
    )
    fed_back = slice(carry_at, carry_at + carry)
    body_tags[fed_back] = [
      a | b for a, b in zip(body_tags[fed_back], out_tags[:carry])
    ]
  return out_tags


def _scan(analysis, eqn, sub, values, tags):
  (body,) = sub
  consts, carry = jaxprs.scan_operand_counts(eqn.params)
  # each scanned-over operand is seen one slice (of its leading axis) a step
  sliced = [
    None if v is None else dataclasses.replace(v, axes=v.axes[1:])
    for v in values[consts + carry :]
  ]
  body_values = values[: consts + carry] + sliced
  out_tags = _loop_tags(analysis, body, body_values, tags, consts, carry)
  return [None] * len(eqn.outvars), out_tags


def _while(analysis, eqn, sub, values, tags):
  (body,) = sub
  cond_n, body_n = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
  carry = len(values) - cond_n - body_n
  out_tags = _loop_tags(
    analysis, body, values[cond_n:], tags[cond_n:], body_n, carry
  )
  return [None] * len(eqn.outvars), out_tags


def _call(analysis, eqn, sub, values, tags):
  """Any other call (pjit, custom_jvp, remat, ...): its first sub-program,
  the operands mapped straight in."""
  (inner,) = sub[:1]
  if len(inner.invars) == len(values):
    return analysis.run(
      inner, jaxprs.bind(inner, values), jaxprs.bind(inner, tags)
    )
  for view in values:
    if isinstance(view, View):
      analysis.use(
        view,
        Use(
          "unknown",
          reason=f"used through {eqn.primitive.name}, whose "
          "operands the analysis cannot map",
        ),
      )
  return [None] * len(eqn.outvars), [union(*tags)] * len(eqn.outvars)


CALL_RULES = {"cond": _cond, "scan": _scan, "while": _while}
