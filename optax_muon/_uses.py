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
from typing import Callable

import jax
import jax.extend

# ops that pass a leaf's axes through unchanged
_SAME_AXES = {"convert_element_type", "copy", "copy_p", "reduce_precision",
              "sharding_constraint", "mesh_cast", "optimization_barrier",
              "stop_gradient"}
# ops after which a leaf is a vector (elementwise, reductions, selections)
_ELEMENTWISE = {
    "add", "sub", "mul", "div", "neg", "max", "min", "exp", "exp2", "log",
    "log1p", "expm1", "tanh", "logistic", "sqrt", "rsqrt", "cbrt", "pow",
    "integer_pow", "square", "abs", "sign", "select_n", "erf", "erf_inv",
    "sin", "cos", "reduce_sum", "reduce_max", "reduce_min", "reduce_prod",
    "argmax", "argmin", "eq", "ne", "lt", "le", "gt", "ge", "clamp", "floor",
    "ceil", "round", "is_finite", "add_any", "nextafter", "atan2", "rem"}


@dataclasses.dataclass(frozen=True)
class View:
  """A jaxpr value that is (a view of) param leaf ``leaf``: for each of its
  axes, the leaf axes it covers (several when merged; shared when split)."""
  leaf: int
  axes: tuple[frozenset[int], ...]


@dataclasses.dataclass(frozen=True)
class Use:
  kind: str  # "dot", "conv", "depthwise", "gather", "vector", "unknown"
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
    return ([views.get(v) if _is_var(v) else None for v in jaxpr.outvars],
            [tags.get(v, frozenset()) if _is_var(v) else frozenset()
             for v in jaxpr.outvars])

  def equation(self, eqn, views, tags):
    name = eqn.primitive.name
    ins = [views.get(v) if _is_var(v) else None for v in eqn.invars]
    in_tags = union(*[tags.get(v, frozenset()) for v in eqn.invars
                       if _is_var(v)])
    n_out = len(eqn.outvars)
    plain = ([None] * n_out, [in_tags] * n_out)
    sub = _sub_jaxprs(eqn)
    if name == "dot_general":
      (lhs_c, rhs_c), (lhs_b, rhs_b) = eqn.params["dimension_numbers"]
      leaves = set()
      for view, contracting, batch in ((ins[0], lhs_c, lhs_b),
                                       (ins[1], rhs_c, rhs_b)):
        if view is not None:
          free = [a for a in range(len(view.axes))
                  if a not in contracting and a not in batch]
          self.use(view, Use("dot", _axes(view, contracting),
                              _axes(view, free)))
          leaves.add(view.leaf)
      return [None], [self._params(leaves) if leaves else in_tags]
    if name == "ragged_dot_general" and ins[1] is not None:
      numbers = eqn.params["ragged_dot_dimension_numbers"]
      (_, contracting), (_, batch) = numbers.dot_dimension_numbers
      view, group = ins[1], tuple(numbers.rhs_group_dimensions)
      free = [a for a in range(len(view.axes))
              if a not in contracting + batch + group]
      self.use(view, Use("dot", _axes(view, contracting), _axes(view, free)))
      return [None], [self._params({view.leaf})]  # the group axis: batch
    if name == "conv_general_dilated" and ins[1] is not None:
      view = ins[1]
      spec = eqn.params["dimension_numbers"].rhs_spec  # (out, in, *spatial)
      if eqn.params["feature_group_count"] > 1:
        self.use(view, Use("depthwise", reason="feature_group_count > 1"))
      else:
        self.use(view, Use("conv", _axes(view, spec[1:]),
                            _axes(view, spec[:1])))
      return [None], [self._params({view.leaf})]
    if name == "dynamic_slice" and ins[0] is not None:
      return [ins[0]], [in_tags]  # w[i]: a later squeeze drops the axis
    if name == "gather" and ins[0] is not None:
      if _is_index(eqn):
        collapsed = eqn.params["dimension_numbers"].collapsed_slice_dims
        return [View(ins[0].leaf, tuple(
            a for d, a in enumerate(ins[0].axes) if d not in collapsed))], [
                in_tags]
      self.use(ins[0], Use("gather"))
      return plain
    if name == "concatenate" and sum(v is not None for v in ins) == 1:
      # each operand is a slice of the result along the joined axis
      (view,) = [v for v in ins if v is not None]
      return [view], [in_tags]
    if name in VIEW_OPS and ins[0] is not None and not any(ins[1:]):
      view = VIEW_OPS[name](ins[0], eqn)
      if view is not None:
        return [view], [in_tags]
    if sub is not None:
      return self.call(name, eqn, sub, ins, [tags.get(v, frozenset())
                                             if _is_var(v) else frozenset()
                                             for v in eqn.invars])
    for view in ins:
      if view is not None:
        kind = "vector" if name in _ELEMENTWISE else "unknown"
        self.use(view, Use(kind, reason="" if kind == "vector" else
                            f"used through {name}, which the analysis does "
                            "not follow"))
    return plain

  def call(self, name, eqn, sub, ins, in_tags):
    """A primitive with sub-programs: map the operands in, walk, map back."""
    if name == "cond":
      outs = [self.run(branch, _bind(branch, ins[1:]), _bind(branch, in_tags[1:]))
              for branch in sub]
      return ([None] * len(eqn.outvars),
              [union(*tags) for tags in zip(*[o[1] for o in outs])])
    if name == "scan":
      (body,) = sub
      consts, carry = scan_operand_counts(eqn.params)
      sliced = [None if v is None else View(v.leaf, v.axes[1:])
                for v in ins[consts + carry:]]
      body_ins = ins[:consts + carry] + sliced
      body_tags = list(in_tags)
      for _ in range(2):  # tags that go round the carry
        _, out_tags = self.run(body, _bind(body, body_ins),
                               _bind(body, body_tags))
        body_tags[consts:consts + carry] = [
            a | b for a, b in zip(body_tags[consts:consts + carry],
                                  out_tags[:carry])]
      return [None] * len(eqn.outvars), out_tags
    if name == "while":
      cond_n, body_n = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
      body = eqn.params["body_jaxpr"].jaxpr
      body_ins = ins[cond_n:]
      body_tags = list(in_tags[cond_n:])
      for _ in range(2):
        _, out_tags = self.run(body, _bind(body, body_ins),
                               _bind(body, body_tags))
        body_tags[body_n:] = [a | b for a, b in zip(body_tags[body_n:],
                                                    out_tags)]
      return [None] * len(eqn.outvars), out_tags
    (inner,) = sub[:1]
    if len(inner.invars) != len(ins):
      for view in ins:
        if view is not None:
          self.use(view, Use("unknown", reason=f"used through {name}, whose "
                              "operands the analysis cannot map"))
      return [None] * len(eqn.outvars), [union(*in_tags)] * len(eqn.outvars)
    return self.run(inner, _bind(inner, ins), _bind(inner, in_tags))


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
      v, jax.extend.core.DropVar)


def _bind(jaxpr, values) -> dict:
  return {var: value for var, value in zip(jaxpr.invars, values)
          if value is not None and value != frozenset()}


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
  return math.prod(indices[:-1]) == 1 and not eqn.params[
      "dimension_numbers"].operand_batching_dims


def _transpose(view, eqn):
  return View(view.leaf, tuple(view.axes[p]
                                for p in eqn.params["permutation"]))


def _reshape(view, eqn):
  """Whole axes merged or split: each output axis covers the input axes of
  its group."""
  old, new = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
  axes, i, j = [], 0, 0
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
    covered = union(*[view.axes[a] for a in group_old if a < len(old)])
    axes += [covered] * len([b for b in group_new if b < len(new)])
    i, j = i + 1, j + 1
  return View(view.leaf, tuple(axes)) if len(axes) == len(new) else None


def _squeeze(view, eqn):
  dims = {d % len(view.axes) for d in eqn.params["dimensions"]}
  return View(view.leaf, tuple(a for d, a in enumerate(view.axes)
                                if d not in dims))


def _expand(view, eqn):
  axes = list(view.axes)
  for d in sorted(eqn.params["dimensions"]):
    axes.insert(d, frozenset())
  return View(view.leaf, tuple(axes))


def _broadcast(view, eqn):
  axes = [frozenset()] * len(eqn.outvars[0].aval.shape)
  for src, dst in enumerate(eqn.params["broadcast_dimensions"]):
    axes[dst] = view.axes[src]
  return View(view.leaf, tuple(axes))


def _slice(view, eqn):
  return view  # a static slice keeps every axis (a later squeeze drops one)


VIEW_OPS: dict[str, Callable] = {
    **{name: (lambda view, eqn: view) for name in _SAME_AXES},
    "transpose": _transpose, "reshape": _reshape, "squeeze": _squeeze,
    "expand_dims": _expand, "broadcast_in_dim": _broadcast, "slice": _slice,
    "pad": _slice,  # a padded leaf keeps its axes, like a slice
}
