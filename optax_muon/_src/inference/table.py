"""The routing table: one aligned line per leaf (``print(layout)``,
``om.describe``)."""

import math

import jax.numpy as jnp

from optax_muon._src.base import paths as _paths
from optax_muon._src.kernels import shape_scale


class RoutingTable(str):
  """The table as a string, shown as the table where Python shows a value
  (a REPL, a notebook cell), as ``print`` shows it."""

  def __repr__(self) -> str:
    return str(self)

  def _repr_pretty_(self, printer, cycle) -> None:  # IPython
    del cycle
    printer.text(str(self))


def _spectral_scales(path, view) -> tuple[float, ...]:
  del path
  return tuple(
    shape_scale.scale_factor(fan_out, fan_in)
    for fan_in, fan_out in view.matrix_shapes
  )


def render(
  rows, scales_of=_spectral_scales, moment2_of=None, modes_of=None
) -> RoutingTable:
  """One aligned line per leaf: path, shape, role, optimizer, matrices,
  scale (``scales_of(path, view)``: each matrix piece's, spectral by
  default), with
  ``moment2_of`` the second moment's shape (``moment2_of(count, fan_in,
  fan_out)``), with ``modes_of`` (``path -> cells``) the tensor-parallel
  mode and why, and the rule that decided when rows carry one."""
  header = ["path", "shape", "role", "optimizer", "matrices", "scale"]
  header += ["second moment"] if moment2_of is not None else []
  header += ["tp mode", "why"] if modes_of is not None else []
  lines = []
  for path, leaf, role, label, view, *reason in rows:
    shape = "×".join(map(str, jnp.shape(leaf))) or "scalar"
    moment2 = []
    if view is None:
      matrices, scale = "—", "—"
      moment2 = ["—"] if moment2_of is not None else []
    else:
      count = math.prod(view.batch_shape)
      pieces = view.matrix_shapes
      matrices = " + ".join(
        f"{count} × {fan_in} × {fan_out}" for fan_in, fan_out in pieces
      )
      scale = " + ".join(f"{f:.3g}" for f in scales_of(path, view))
      if moment2_of is not None:
        moment2 = [
          " + ".join(
            " × ".join(map(str, moment2_of(count, fan_in, fan_out)))
            for fan_in, fan_out in pieces
          )
        ]
    modes = () if modes_of is None else tuple(modes_of(path))
    lines.append(
      (_paths.path_string(path), shape, role, label, matrices, scale)
      + (*moment2, *modes, *reason)
    )
  lines.insert(0, tuple(header + ["rule"])[: len(lines[0]) if lines else 6])
  widths = [max(len(line[c]) for line in lines) for c in range(len(lines[0]))]
  return RoutingTable(
    "\n".join(
      "  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip()
      for line in lines
    )
  )
