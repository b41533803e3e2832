"""The types of the public signatures: the accepted choices as ``Literal``s
(their tuples, ``get_args``, are what the checks accept) and the shapes of
settings (a value, a tree by path, or a function of the params)."""

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import Literal

import jax
import optax

# a number that ``optax.inject_hyperparams`` may turn into a traced array
Numeric = float | jax.Array
# the Newton–Schulz steps (traced under inject_hyperparams)
Steps = int | jax.Array
# a schedule name of COEFFICIENT_SETS or (a, b, c) rows
Coefficients = str | Sequence[tuple[float, float, float]] | Any
# a setting for every leaf, a tree of them (by path, a prefix allowed) or a
# function of the params
PerLeaf = Any | Callable[[optax.Params], Any]
# a momentum dtype: None (the param's), a floating dtype, or
# om.QuantizedMomentum (8 bits)
MomentumDtype = Any

Precision = Literal["highest", "high", "medium", "fp16", "bf16"]
Method = Literal["standard", "gram"]
ScaleMode = Literal["spectral", "shape_scaling", "unit_rms_norm"]
MomentumStyle = Literal["ema", "sgd"]
Preconditioning = Literal["frobenius", "spectral", "aol", "schatten"]
ScalarOptimizer = Literal["adam", "lion"]
Moment2Method = Literal["adamuon", "normuon", "namo"]
TensorParallelMode = Literal[
  "blockwise", "duplicated", "distributed", "allgather", "auto"
]
MemoryKind = Literal["pinned_host"]
