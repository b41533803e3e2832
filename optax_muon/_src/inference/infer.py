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
from collections.abc import Set as AbstractSet
from typing import Any

import jax
import jax.numpy as jnp
from optax.contrib import MuonDimensionNumbers

from optax_muon._src.base import paths as _paths
from optax_muon._src.inference import axes as _axes
from optax_muon._src.inference import uses as _uses
from optax_muon._src.inference.table import render
from optax_muon._src.views import labels as labels_lib
from optax_muon._src.views import layout as layout_lib

ROLES = ("matrix", "conv", "embedding", "head", "vector", "unknown", "unused")

# The fallback when the program does not show the expert axis (the structural
# rule: a product axis batched with another param's matmul): a path
# component that names experts (MaxText's MoeBlock_0, moe_layers,
# routed_experts, GptOssMlp; expert, experts, moe).
_EXPERT_NAMES = re.compile(
  r"(^|/)[^/]*(expert|moe|gptossmlp)[^/]*(/|$)", re.IGNORECASE
)


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
    shapes: ``{path: shape}`` of the leaves it was read from; ``om.muon``
      raises at ``init`` when a param it describes has another shape.
  """

  labels: Any
  dimension_numbers: Any
  roles: Any
  reasons: Any
  table: str = dataclasses.field(repr=False, default="")
  shapes: dict = dataclasses.field(repr=False, default_factory=dict)

  def __str__(self) -> str:
    return self.table


def _trace(fn, params, args, kwargs):
  closed, out_shape = jax.make_jaxpr(
    lambda p, *a: fn(p, *a, **kwargs), return_shape=True
  )(params, *args)
  return closed.jaxpr, out_shape


def _selected_outputs(out_shape, output) -> list[int]:
  """Indices of the flat outputs that make up "the output"."""
  flat, treedef = jax.tree.flatten(out_shape)
  numbered = jax.tree.unflatten(treedef, list(range(len(flat))))
  if output is None:
    first = (
      numbered[0]
      if isinstance(numbered, (tuple, list)) and not hasattr(out_shape, "shape")
      else numbered
    )
    return jax.tree.leaves(first)
  if callable(output):
    return jax.tree.leaves(output(numbered))
  try:
    return jax.tree.leaves(numbered[output])
  except (KeyError, IndexError, TypeError):
    raise ValueError(
      f"output={output!r} names none of fn's outputs, which are "
      f"{jax.tree.map(lambda _: '·', numbered)!r}; accepted: None (the first "
      "output), an index or key of them, or a function of the outputs"
    ) from None


def _decide(
  path,
  leaf,
  uses: AbstractSet,
  heads: AbstractSet,
  index: int,
  vocab: AbstractSet,
):
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
    return (
      "conv",
      labels_lib.ADAM,
      None,
      ("grouped or depthwise conv (feature_group_count > 1)"),
    )
  matrix_uses = {
    (u.reduction, u.output) for u in uses if u.kind in ("dot", "conv")
  }
  if not matrix_uses:
    return "vector", labels_lib.ADAM, None, "used elementwise only"
  if len(matrix_uses) > 1:
    return (
      "unknown",
      None,
      None,
      ("multiplied along different axes in different places"),
    )
  ((reduction, output),) = matrix_uses
  role = "conv" if "conv" in kinds else "matrix"
  reason = (
    "conv kernel: input features and spatial dims are the fan-in"
    if role == "conv"
    else "contracting dims are the fan-in"
  )
  for kind, why in (
    ("split", "indexed apart after the matmul (its parts are used separately)"),
    ("expert", "a batch dim of another parameter's matmul (an expert axis)"),
  ):
    axes = _axes.union(*[u.output for u in uses if u.kind == kind]) & output
    if axes and output - axes:
      output = output - axes
      reason += (
        f"; output axis {', '.join(map(str, sorted(axes)))} is "
        f"{why}: a batch axis"
      )
  # a name breaks a tie the structure leaves open; it never overrides it
  classed = _axes.union(*[u.output for u in uses if u.kind == "attention"])
  undecided = output - classed
  if (
    len(output) > 1
    and undecided
    and _EXPERT_NAMES.search(_paths.path_string(path))
  ):
    batch_axis = min(undecided)
    output = output - {batch_axis}
    reason += (
      f"; axis {batch_axis} is a free dim under an expert/moe path, "
      "so by name it is the expert (batch) axis"
    )
  if not reduction or not output:
    return "vector", labels_lib.ADAM, None, "a matmul with a vector"
  fan_in = math.prod(shape[a] for a in reduction)
  fan_out = math.prod(shape[a] for a in output)
  if min(fan_in, fan_out) == 1:
    return "vector", labels_lib.ADAM, None, "a matmul with a vector"
  if index in heads:
    return (
      "head",
      labels_lib.ADAM,
      None,
      ("its product reaches the output through no other parameter's matmul"),
    )
  if not heads and fan_out in vocab:
    return (
      "head",
      labels_lib.ADAM,
      None,
      ("no structural head; fan-out equals the embedding's vocabulary"),
    )
  dims = MuonDimensionNumbers(
    reduction_axis=tuple(sorted(reduction)), output_axis=tuple(sorted(output))
  )
  if (
    re.search(
      layout_lib.SplitQKV.pattern, _paths.path_string(path), re.IGNORECASE
    )
    and "indexed apart" not in reason
  ):
    reason += "; a fused QKV kernel is one matrix unless split_qkv= is given"
  gated = _axes.union(*[u.output for u in uses if u.kind == "gated"]) & output
  if gated:
    reason += (
      "; its output's two halves are multiplied together (a fused "
      "gate/up): split_gate_up=om.SplitGateUp() orthogonalizes "
      "them apart, as Megatron-Core does for a gated linear_fc1"
    )
  return role, labels_lib.MUON, dims, reason


def _fall_back(path, leaf, label, reason):
  """``(dims, reason)`` of a leaf whose use the walk could not read (a
  ``pallas_call``, a custom call): its role stays ``unknown`` and the name
  rules' ``label`` routes it; a 2-axis Muon leaf is ``(in, out)``, one of
  3+ axes under an expert/moe path has its leading axes as experts (batch)
  and its last two as ``(in, out)``; any other Muon leaf of 3+ axes gets no
  dimension numbers, so ``om.muon`` raises at ``init`` naming it."""
  reason += "; decided by the fallback rules"
  ndim = jnp.ndim(leaf)
  if label != labels_lib.MUON:
    return None, reason + f": the name rules route it to {label}"
  if ndim == 2:
    return None, reason + ": the name rules route it to muon, as (in, out)"
  if _EXPERT_NAMES.search(_paths.path_string(path)):
    dims = MuonDimensionNumbers(
      reduction_axis=(ndim - 2,), output_axis=(ndim - 1,)
    )
    return dims, (
      reason + ": under an expert/moe path, the leading axes are experts "
      "(batch) and the last two (in, out)"
    )
  return None, (
    reason + ": none decides which of its axes form the matrices; give "
    "dimension_numbers= or labels= for it"
  )


def _infer(fn, params, args, kwargs, output, frozen_args: int = 0) -> Layout:
  """``frozen_args``: how many of ``args`` are frozen weights (the module's
  other state), seen, like closed-over constants, as weights, not inputs."""
  leaves, treedef = _paths.leaves_with_paths(params)
  jaxpr, out_shape = _trace(fn, params, args, kwargs)
  analysis = _uses.Analysis(len(leaves))
  frozen = len(jax.tree.leaves(args[:frozen_args]))
  weights = jaxpr.invars[: len(leaves) + frozen] + list(jaxpr.constvars)
  views = {
    var: _axes.View(
      i, tuple(frozenset({a}) for a in range(len(var.aval.shape)))
    )
    for i, var in enumerate(weights)
    if hasattr(var.aval, "shape")
  }
  _, out_tags = analysis.run(jaxpr, views, {})
  heads = _axes.union(
    *[out_tags[i] for i in _selected_outputs(out_shape, output)]
  )
  vocab = {
    jnp.shape(leaf)[0]
    for (_, leaf), uses in zip(leaves, analysis.uses)
    if any(u.kind == "gather" for u in uses) and jnp.ndim(leaf) == 2
  }
  default = jax.tree.leaves(labels_lib.default_labels(params))
  decided = [
    _decide(path, leaf, uses, heads, i, vocab)
    for i, ((path, leaf), uses) in enumerate(zip(leaves, analysis.uses))
  ]
  rows = []
  for (path, leaf), fallback, (role, label, dims, reason) in zip(
    leaves, default, decided
  ):
    if role == "unknown" and label is None:
      dims, reason = _fall_back(path, leaf, fallback, reason)
    rows.append((path, leaf, role, label or fallback, dims, reason))
  unflat = lambda values: jax.tree.unflatten(treedef, values)
  return Layout(
    shapes={path: tuple(jnp.shape(leaf)) for path, leaf, *_ in rows},
    labels=unflat([r[3] for r in rows]),
    dimension_numbers=unflat([r[4] for r in rows]),
    roles=unflat([r[2] for r in rows]),
    reasons=unflat([r[5] for r in rows]),
    table=render(
      [
        (
          path,
          leaf,
          role,
          label,
          layout_lib.matrix_view(jnp.shape(leaf), dims)
          if label == labels_lib.MUON
          and (dims is not None or jnp.ndim(leaf) == 2)
          else None,
          reason,
        )
        for path, leaf, role, label, dims, reason in rows
      ]
    ),
  )


def infer_layout(
  fn: Any,
  params: Any = None,
  *args: Any,
  output: int | str | None = None,
  wrt: Any = None,
  **kwargs: Any,
) -> Layout:
  """Reads which leaves are matrices, and how, from the model's computation.

  Traces ``fn(params, *args, **kwargs)`` with ``jax.make_jaxpr`` (nothing is
  computed) and follows each parameter leaf to the operations that use it
  (see the module docstring). A ``flax.nnx.Module`` may be passed as ``fn``:
  ``infer_layout(model, *args)`` traces ``model(*args)`` over
  ``nnx.state(model, wrt)`` (the rest of its state, rng counts and batch
  statistics, traced too and left unchanged), and the trees line up with
  what ``nnx.Optimizer(model, tx, wrt=wrt)`` hands the transform.

  Args:
    fn: ``fn(params, *args, **kwargs)``, or an ``nnx.Module``.
    params: the parameter tree (arrays or ``jax.ShapeDtypeStruct``); for a
      module, the first model input.
    *args: the other inputs (arrays or shape structs).
    output: which of ``fn``'s outputs is "the output" for head detection:
      ``None`` (the first), an index, or a callable on the outputs.
    wrt: for a module, the NNX filter of the state the optimizer trains
      (default ``nnx.Param``; ``nnx.LoRAParam`` for adapters): the other
      state is treated as constants of the program.
    **kwargs: keyword inputs of ``fn``.

  Returns:
    A ``Layout``; ``print(layout)`` shows the routing table, and
    ``om.muon(lr, layout=layout)`` uses it.

  Raises:
    ValueError: a module without inputs, or ``wrt`` without a module.

  Example:
    >>> import jax, jax.numpy as jnp, optax_muon as om
    >>> def model(params, x):  # an einsum kernel (in, heads, head_dim)
    ...   return jnp.einsum("bd,dhk->bhk", x, params["query"]).sum(-1) @ params["out"]
    >>> params = {"query": jnp.ones((8, 2, 4)), "out": jnp.ones((2, 8))}
    >>> layout = om.infer_layout(model, params, jnp.ones((3, 8)))
    >>> layout.roles["query"], layout.roles["out"]
    ('matrix', 'head')
    >>> layout.dimension_numbers["query"]
    MuonDimensionNumbers(reduction_axis=(0,), output_axis=(1, 2))
  """
  _check_call(fn, params, output)
  if _is_nnx_module(fn):
    from flax import nnx  # pylint: disable=import-outside-toplevel

    if params is None and not args and not kwargs:
      raise ValueError(
        f"infer_layout({type(fn).__name__}) traces the model on inputs and "
        "got none; pass an example batch: om.infer_layout(model, batch) "
        "(arrays or jax.ShapeDtypeStruct)"
      )
    graphdef, state, rest = nnx.split(  # type: ignore[misc]
      fn, nnx.Param if wrt is None else wrt, ...
    )

    # The rest of the module's state (rng counts, batch statistics, caches,
    # frozen weights) is traced as an input too: a forward pass that updates
    # it then updates tracers of this trace, and the user's module is left
    # as it was.
    def forward(p, r, *a, **k):
      return nnx.merge(graphdef, p, r)(*a, **k)

    return _infer(
      forward, state, (rest, params) + args, kwargs, output, frozen_args=1
    )
  if wrt is not None:
    raise ValueError(
      "wrt= selects the state of an nnx.Module; for a function "
      "pass the trained params as params"
    )
  return _infer(fn, params, args, kwargs, output)


def _check_call(fn, params, output) -> None:
  """Clear errors for the usual slips, before anything is traced."""
  if isinstance(fn, type):
    raise ValueError(
      f"infer_layout got the class {fn.__name__}, not a model; pass an "
      f"instance (om.infer_layout({fn.__name__}(...), batch)) or a function "
      "fn(params, *args)"
    )
  if not callable(fn):
    swapped = " (the function comes first)" if callable(params) else ""
    raise ValueError(
      f"infer_layout's first argument must be fn(params, *args) or an "
      f"nnx.Module, got a {type(fn).__name__}{swapped}: "
      "om.infer_layout(fn, params, *args)"
    )
  if isinstance(output, bool) or not (
    output is None or callable(output) or isinstance(output, (int, str))
  ):
    raise ValueError(
      f"output={output!r} is not accepted; accepted: None (the first "
      "output), an index or key of fn's outputs, or a function of the "
      "outputs returning the ones that are the model's output"
    )


def _is_nnx_module(value) -> bool:
  """Whether ``value`` is a ``flax.nnx.Module`` (without importing Flax)."""
  return any(
    c.__module__.startswith("flax.nnx") and c.__name__ == "Module"
    for c in type(value).__mro__
  )
