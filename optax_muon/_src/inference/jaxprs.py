"""Reading a jaxpr's equations across jax versions: the operands of a
``scan``, the sub-programs of call-like primitives, variables that are
values. Version differences live here (and in the rules of ``uses`` that
name a primitive only newer jax emits, such as ``unstack``)."""

import math

import jax
import jax.extend


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


def is_var(v) -> bool:
  return isinstance(v, jax.extend.core.Var) and not isinstance(
    v, jax.extend.core.DropVar
  )


def bind(jaxpr, values) -> dict:
  return {
    var: value
    for var, value in zip(jaxpr.invars, values)
    if value is not None and value != frozenset()
  }


def sub_jaxprs(eqn):
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


def is_index(eqn) -> bool:
  """A gather that takes whole slices at one scalar index (``w[i]``)."""
  indices = eqn.invars[1].aval.shape
  return (
    math.prod(indices[:-1]) == 1
    and not eqn.params["dimension_numbers"].operand_batching_dims
  )
