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
from typing import Any

import jax
import jax.numpy as jnp

from optax_muon._src.base import paths as _paths
from optax_muon._src.inference import axes as _axes
from optax_muon._src.inference import rules
from optax_muon._src.inference import uses as _uses
from optax_muon._src.inference.table import render
from optax_muon._src.views import labels as labels_lib
from optax_muon._src.views import layout as layout_lib

ROLES = ("matrix", "conv", "embedding", "head", "vector", "unknown", "unused")


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
    rules.decide(path, leaf, uses, heads, i, vocab)
    for i, ((path, leaf), uses) in enumerate(zip(leaves, analysis.uses))
  ]
  rows = []
  for (path, leaf), fallback, (role, label, dims, reason) in zip(
    leaves, default, decided
  ):
    if role == "unknown" and label is None:
      dims, reason = rules.fall_back(path, leaf, fallback, reason)
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
