"""Which matrices Muon sees, read from the model's own computation.

``infer_layout`` traces the model with ``jax.make_jaxpr`` (nothing is
computed) and follows each parameter leaf to the operations that consume it:

* ``dot_general``: the leaf's contracting dims are its fan-in axes, its batch
  dims batch axes, its free dims fan-out axes (a ``DenseGeneral`` query kernel
  ``(in, heads, head_dim)`` is one ``in × heads·head_dim`` matrix);
  ``ragged_dot``'s group axis is a batch axis;
* ``conv_general_dilated``: input feature and spatial dims are fan-in, the
  output feature fan-out; grouped (depthwise) convolutions go to AdamW;
* ``gather`` (an embedding lookup): role ``embedding``, AdamW;
* views in between (``transpose``, ``reshape``, ``squeeze``, ``slice``,
  ``broadcast_in_dim``, dtype casts, sharding constraints) are followed, and
  so are the sub-programs of ``jit``, ``remat``, ``custom_jvp_call`` /
  ``custom_vjp_call``, ``cond``, ``scan`` (a sliced axis is a batch axis),
  ``while`` and ``shard_map``;
* a leaf used elementwise only (norm scales, biases, gates) is a ``vector``;
* the ``head`` is a matrix whose product reaches the output without passing
  through another parameter's matmul.

What the analysis cannot follow keeps ``default_labels``'s label and the
default view, with role ``unknown`` and the operation named in its reason.
"""

import dataclasses
import math
import re
from typing import Any, Callable

import jax
import jax.extend
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers

from optax_muon import _paths
from optax_muon import labels as labels_lib
from optax_muon import layout as layout_lib
from optax_muon import scaling

ROLES = ("matrix", "conv", "embedding", "head", "vector", "unknown", "unused")

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
_EXPERT_NAMES = re.compile(r"(^|/)(expert|experts|moe)(/|$)", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class _View:
  """A jaxpr value that is (a view of) param leaf ``leaf``: for each of its
  axes, the leaf axes it covers (several when merged; shared when split)."""
  leaf: int
  axes: tuple[frozenset[int], ...]


@dataclasses.dataclass(frozen=True)
class _Use:
  kind: str  # "dot", "conv", "depthwise", "gather", "vector", "unknown"
  reduction: frozenset[int] = frozenset()
  output: frozenset[int] = frozenset()
  reason: str = ""


def _union(*sets) -> frozenset:
  return frozenset().union(*sets)


class _Analysis:
  """One walk over a jaxpr: each leaf's uses and each value's last matmuls."""

  def __init__(self, count: int):
    self.uses: list[set[_Use]] = [set() for _ in range(count)]

  def use(self, view: _View, use: _Use) -> None:
    self.uses[view.leaf].add(use)

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
    in_tags = _union(*[tags.get(v, frozenset()) for v in eqn.invars
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
          self.use(view, _Use("dot", _axes(view, contracting),
                              _axes(view, free)))
          leaves.add(view.leaf)
      return [None], [frozenset(leaves) if leaves else in_tags]
    if name == "ragged_dot_general" and ins[1] is not None:
      numbers = eqn.params["ragged_dot_dimension_numbers"]
      (_, contracting), (_, batch) = numbers.dot_dimension_numbers
      view, group = ins[1], tuple(numbers.rhs_group_dimensions)
      free = [a for a in range(len(view.axes))
              if a not in contracting + batch + group]
      self.use(view, _Use("dot", _axes(view, contracting), _axes(view, free)))
      return [None], [frozenset({view.leaf})]  # the group axis: a batch axis
    if name == "conv_general_dilated" and ins[1] is not None:
      view = ins[1]
      spec = eqn.params["dimension_numbers"].rhs_spec  # (out, in, *spatial)
      if eqn.params["feature_group_count"] > 1:
        self.use(view, _Use("depthwise", reason="feature_group_count > 1"))
      else:
        self.use(view, _Use("conv", _axes(view, spec[1:]),
                            _axes(view, spec[:1])))
      return [None], [frozenset({view.leaf})]
    if name == "dynamic_slice" and ins[0] is not None:
      return [ins[0]], [in_tags]  # w[i]: a later squeeze drops the axis
    if name == "gather" and ins[0] is not None:
      if _is_index(eqn):
        collapsed = eqn.params["dimension_numbers"].collapsed_slice_dims
        return [_View(ins[0].leaf, tuple(
            a for d, a in enumerate(ins[0].axes) if d not in collapsed))], [
                in_tags]
      self.use(ins[0], _Use("gather"))
      return plain
    if any(ins) and name in _VIEW_OPS and ins[0] is not None and not any(
        ins[1:]):
      view = _VIEW_OPS[name](ins[0], eqn)
      if view is not None:
        return [view], [in_tags]
    if sub is not None:
      return self.call(name, eqn, sub, ins, [tags.get(v, frozenset())
                                             if _is_var(v) else frozenset()
                                             for v in eqn.invars])
    for view in ins:
      if view is not None:
        kind = "vector" if name in _ELEMENTWISE else "unknown"
        self.use(view, _Use(kind, reason="" if kind == "vector" else
                            f"used through {name}, which the analysis does "
                            "not follow"))
    return plain

  def call(self, name, eqn, sub, ins, in_tags):
    """A primitive with sub-programs: map the operands in, walk, map back."""
    if name == "cond":
      outs = [self.run(branch, _bind(branch, ins[1:]), _bind(branch, in_tags[1:]))
              for branch in sub]
      return ([None] * len(eqn.outvars),
              [_union(*tags) for tags in zip(*[o[1] for o in outs])])
    if name == "scan":
      (body,) = sub
      consts, carry = eqn.params["num_consts"], eqn.params["num_carry"]
      sliced = [None if v is None else _View(v.leaf, v.axes[1:])
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
          self.use(view, _Use("unknown", reason=f"used through {name}, whose "
                              "operands the analysis cannot map"))
      return [None] * len(eqn.outvars), [_union(*in_tags)] * len(eqn.outvars)
    return self.run(inner, _bind(inner, ins), _bind(inner, in_tags))


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


def _axes(view: _View, dims) -> frozenset[int]:
  return _union(*[view.axes[d] for d in dims])


def _is_index(eqn) -> bool:
  """A gather that takes whole slices at one scalar index (``w[i]``)."""
  indices = eqn.invars[1].aval.shape
  return math.prod(indices[:-1]) == 1 and not eqn.params[
      "dimension_numbers"].operand_batching_dims


def _transpose(view, eqn):
  return _View(view.leaf, tuple(view.axes[p]
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
    covered = _union(*[view.axes[a] for a in group_old if a < len(old)])
    axes += [covered] * len([b for b in group_new if b < len(new)])
    i, j = i + 1, j + 1
  return _View(view.leaf, tuple(axes)) if len(axes) == len(new) else None


def _squeeze(view, eqn):
  dims = {d % len(view.axes) for d in eqn.params["dimensions"]}
  return _View(view.leaf, tuple(a for d, a in enumerate(view.axes)
                                if d not in dims))


def _expand(view, eqn):
  axes = list(view.axes)
  for d in sorted(eqn.params["dimensions"]):
    axes.insert(d, frozenset())
  return _View(view.leaf, tuple(axes))


def _broadcast(view, eqn):
  axes = [frozenset()] * len(eqn.outvars[0].aval.shape)
  for src, dst in enumerate(eqn.params["broadcast_dimensions"]):
    axes[dst] = view.axes[src]
  return _View(view.leaf, tuple(axes))


def _slice(view, eqn):
  return view  # a static slice keeps every axis (a later squeeze drops one)


_VIEW_OPS: dict[str, Callable] = {
    **{name: (lambda view, eqn: view) for name in _SAME_AXES},
    "transpose": _transpose, "reshape": _reshape, "squeeze": _squeeze,
    "expand_dims": _expand, "broadcast_in_dim": _broadcast, "slice": _slice,
}


@dataclasses.dataclass(frozen=True)
class Layout:
  """The routing ``infer_layout`` read from a model.

  Attributes:
    labels: a tree like the params of ``"muon"`` / ``"adam"`` / ``"none"``,
      for ``om.muon(labels=...)``.
    dimension_numbers: a tree of ``MuonDimensionNumbers`` or ``None`` (the
      default view), for ``om.muon(dimension_numbers=...)``.
    roles: a tree of ``ROLES`` entries.
    reasons: a tree of strings: which rule decided.
  """
  labels: Any
  dimension_numbers: Any
  roles: Any
  reasons: Any
  table: str = dataclasses.field(repr=False, default="")

  def __str__(self) -> str:
    return self.table


def _trace(fn, params, args, kwargs):
  closed, out_shape = jax.make_jaxpr(
      lambda p, *a: fn(p, *a, **kwargs), return_shape=True)(params, *args)
  return closed.jaxpr, out_shape


def _selected_outputs(out_shape, output) -> list[int]:
  """Indices of the flat outputs that make up "the output"."""
  flat, treedef = jax.tree.flatten(out_shape)
  numbered = jax.tree.unflatten(treedef, list(range(len(flat))))
  if output is None:
    first = numbered[0] if isinstance(numbered, (tuple, list)) and not hasattr(
        out_shape, "shape") else numbered
    return jax.tree.leaves(first)
  if callable(output):
    return jax.tree.leaves(output(numbered))
  return jax.tree.leaves(numbered[output])


def _decide(path, leaf, uses: set, heads: set, index: int, vocab: set):
  """``(role, label, MuonDimensionNumbers | None, reason)`` of one leaf."""
  shape = tuple(jnp.shape(leaf))
  if not labels_lib.is_float(leaf):
    return "vector", labels_lib.NONE, None, "not floating point: no update"
  kinds = {u.kind for u in uses}
  unknown = sorted(u.reason for u in uses if u.kind == "unknown")
  if not uses:
    return "unused", None, None, "not used by the traced function"
  if "gather" in kinds:
    return "embedding", labels_lib.ADAM, None, "looked up by gather"
  if unknown:
    return "unknown", None, None, unknown[0]
  if "depthwise" in kinds:
    return "conv", labels_lib.ADAM, None, (
        "grouped or depthwise conv (feature_group_count > 1)")
  matrix_uses = {(u.reduction, u.output) for u in uses
                 if u.kind in ("dot", "conv")}
  if not matrix_uses:
    return "vector", labels_lib.ADAM, None, "used elementwise only"
  if len(matrix_uses) > 1:
    return "unknown", None, None, (
        "multiplied along different axes in different places")
  ((reduction, output),) = matrix_uses
  role = "conv" if "conv" in kinds else "matrix"
  reason = ("conv kernel: input features and spatial dims are the fan-in"
            if role == "conv" else "contracting dims are the fan-in")
  if len(output) > 1 and _EXPERT_NAMES.search(_paths.path_string(path)):
    batch_axis = min(output)
    output = output - {batch_axis}
    reason += (f"; axis {batch_axis} is a free dim under an expert/moe path, "
               "so by name it is the expert (batch) axis")
  if not reduction or not output:
    return "vector", labels_lib.ADAM, None, "a matmul with a vector"
  fan_in = math.prod(shape[a] for a in reduction)
  fan_out = math.prod(shape[a] for a in output)
  if min(fan_in, fan_out) == 1:
    return "vector", labels_lib.ADAM, None, "a matmul with a vector"
  if index in heads:
    return "head", labels_lib.ADAM, None, (
        "its product reaches the output through no other parameter's matmul")
  if not heads and fan_out in vocab:
    return "head", labels_lib.ADAM, None, (
        "no structural head; fan-out equals the embedding's vocabulary")
  dims = MuonDimensionNumbers(reduction_axis=tuple(sorted(reduction)),
                              output_axis=tuple(sorted(output)))
  if re.search(layout_lib.SplitQKV.pattern, _paths.path_string(path),
               re.IGNORECASE):
    reason += "; a fused QKV kernel is one matrix unless split_qkv= is given"
  return role, labels_lib.MUON, dims, reason


def _infer(fn, params, args, kwargs, output) -> Layout:
  leaves, treedef = _paths.leaves_with_paths(params)
  jaxpr, out_shape = _trace(fn, params, args, kwargs)
  analysis = _Analysis(len(leaves))
  views = {var: _View(i, tuple(frozenset({a}) for a in range(len(
      jnp.shape(leaf))))) for i, (var, (_, leaf)) in enumerate(
          zip(jaxpr.invars, leaves))}
  _, out_tags = analysis.run(jaxpr, views, {})
  heads = _union(*[out_tags[i] for i in _selected_outputs(out_shape, output)])
  vocab = {jnp.shape(leaf)[0] for (_, leaf), uses in zip(leaves, analysis.uses)
           if any(u.kind == "gather" for u in uses) and jnp.ndim(leaf) == 2}
  default = jax.tree.leaves(labels_lib.default_labels(params))
  decided = [_decide(path, leaf, uses, heads, i, vocab)
             for i, ((path, leaf), uses) in enumerate(zip(leaves,
                                                          analysis.uses))]
  rows = []
  for (path, leaf), fallback, (role, label, dims, reason) in zip(
      leaves, default, decided):
    rows.append((path, leaf, role, label or fallback, dims, reason))
  unflat = lambda values: jax.tree.unflatten(treedef, values)
  return Layout(labels=unflat([r[3] for r in rows]),
                dimension_numbers=unflat([r[4] for r in rows]),
                roles=unflat([r[2] for r in rows]),
                reasons=unflat([r[5] for r in rows]),
                table=_table([(path, leaf, role, label,
                               layout_lib.matrix_view(jnp.shape(leaf), dims)
                               if label == labels_lib.MUON else None, reason)
                              for path, leaf, role, label, dims, reason
                              in rows]))


def infer_layout(fn, params=None, *args, output=None, **kwargs) -> Layout:
  """Reads which leaves are matrices, and how, from the model's computation.

  Traces ``fn(params, *args, **kwargs)`` with ``jax.make_jaxpr`` (nothing is
  computed) and follows each parameter leaf to the operations that use it
  (see the module docstring). A ``flax.nnx.Module`` may be passed as ``fn``:
  ``infer_layout(model, *args)`` traces ``model(*args)`` over
  ``nnx.state(model, nnx.Param)``, and the trees line up with what
  ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` hands the transform.

  Args:
    fn: ``fn(params, *args, **kwargs)``, or an ``nnx.Module``.
    params: the parameter tree (arrays or ``jax.ShapeDtypeStruct``s); for a
      module, the first model input.
    *args: the other inputs (arrays or shape structs).
    output: which of ``fn``'s outputs is "the output" for head detection:
      ``None`` (the first), an index, or a callable on the outputs.
    **kwargs: keyword inputs of ``fn``.

  Returns:
    A ``Layout``; ``print(layout)`` shows the routing table.
  """
  if _is_nnx_module(fn):
    from flax import nnx  # pylint: disable=import-outside-toplevel
    model = fn
    graphdef, state, rest = nnx.split(model, nnx.Param, ...)
    inputs = (params,) + args
    return _infer(lambda p, *a, **k: nnx.merge(graphdef, p, rest)(*a, **k),
                  state, inputs, kwargs, output)
  return _infer(fn, params, args, kwargs, output)


def _is_nnx_module(value) -> bool:
  module = type(value).__module__
  return module is not None and any(
      c.__module__.startswith("flax.nnx") and c.__name__ == "Module"
      for c in type(value).__mro__)


def _table(rows) -> str:
  """One aligned line per leaf: path, shape, role, optimizer, matrices,
  scale (spectral), and the rule that decided when rows carry one."""
  header = ("path", "shape", "role", "optimizer", "matrices", "scale", "rule")
  lines = []
  for path, leaf, role, label, view, *reason in rows:
    shape = "×".join(map(str, jnp.shape(leaf))) or "scalar"
    if view is None:
      matrices, scale = "—", "—"
    else:
      count = math.prod(view.batch_shape)
      pieces = view.matrix_shapes
      matrices = " + ".join(f"{count} × {fan_in} × {fan_out}"
                            for fan_in, fan_out in pieces)
      scale = " + ".join(f"{scaling.scale_factor(fan_out, fan_in):.3g}"
                         for fan_in, fan_out in pieces)
    lines.append((_paths.path_string(path), shape, role, label, matrices,
                  scale, *reason))
  lines.insert(0, header[:len(lines[0]) if lines else 6])
  widths = [max(len(line[c]) for line in lines) for c in range(len(lines[0]))]
  return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths))
                   .rstrip() for line in lines)


def describe(params, *, labels=None, dimension_numbers=None,
             split_qkv=None) -> str:
  """The routing table for the given ``om.muon`` settings (defaults
  included): what each leaf gets before training starts.

  Args:
    params: the parameter tree (arrays, shape structs or ``nnx.State``).
    labels, dimension_numbers, split_qkv: as in ``om.muon``.

  Returns:
    The table as a string: path, shape, role, optimizer, matrices as
    ``count × fan_in × fan_out`` (one term per ``split_qkv`` piece), scale
    (``spectral``).
  """
  label_tree = labels_lib.label_fn(labels)(params)
  leaves, _ = _paths.leaves_with_paths(params)
  label_of = dict(_paths.leaves_with_paths(label_tree)[0])
  # only the Muon leaves have a view; the others are masked as optax does
  muon_only = jax.tree.map(
      lambda leaf, label: leaf if label == labels_lib.MUON else
      optax.MaskedNode(), params, label_tree)
  view_of = {path: view for path, _, view in layout_lib.view_resolver(
      dimension_numbers, split_qkv)(muon_only)}
  rows = []
  for path, leaf in leaves:
    view = view_of.get(path)
    role = ("split qkv" if view is not None and view.widths else
            "matrix" if view is not None else "—")
    rows.append((path, leaf, role, label_of[path], view))
  return _table(rows)
