"""Drop-ins: ``optax.contrib.muon`` and ``torch.optim.Muon``, the same numbers.

``torch_muon`` takes ``torch.optim.Muon``'s arguments and defaults and gives
its numbers (see its docstring), ``describe_torch_muon`` its routing table;
the rest of this module is the drop-in for
``optax.contrib.muon``: one changed import, the same numbers.

Mirrors optax 0.2.8 (``optax/contrib/_muon.py``): the same functions with the
same signatures and defaults, the same update to fp32 rounding, the same
state (optax's own ``MuonState`` inside the same ``optax.partition``), so an
``optax.contrib.muon`` checkpoint restores here and continues::

    tx = optax.contrib.muon(3e-4)          # before
    tx = optax_muon.compat.muon(3e-4)      # after

It is built from optax_muon's transforms: the Newton–Schulz of same-shape
matrices runs as one batched loop (its speed against optax's:
docs/performance.md), and three keyword-only extras open the rest of the
package: ``sharding`` (a ``TensorParallel``), ``method="gram"`` and
``precision``.

Deliberate differences, each a case where optax loses information:
- the iteration runs in fp32 (complex64) whatever the param dtype (optax runs
  it in the param's: bf16 params get a bf16 Newton–Schulz), and the result is
  cast back;
- ``mu_dtype`` with complex params keeps a complex buffer of that precision
  (optax stores the real part only);
- ``preconditioning="schatten"`` uses ``X Xᴴ`` for complex matrices (optax's
  first step uses ``X Xᵀ``, which is not the polar iteration for them).
"""

from optax_muon._src.config.describe import describe_torch_muon
from optax_muon._src.optimizers.optax_compat import MuonDimensionNumbers
from optax_muon._src.optimizers.optax_compat import MuonState
from optax_muon._src.optimizers.optax_compat import muon
from optax_muon._src.optimizers.optax_compat import (
  orthogonalize_via_newton_schulz,
)
from optax_muon._src.optimizers.optax_compat import scale_by_muon
from optax_muon._src.optimizers.optax_compat import scale_by_shape
from optax_muon._src.optimizers.torch_muon import torch_muon

__all__ = (
  "MuonDimensionNumbers",
  "MuonState",
  "describe_torch_muon",
  "muon",
  "orthogonalize_via_newton_schulz",
  "scale_by_muon",
  "scale_by_shape",
  "torch_muon",
)
