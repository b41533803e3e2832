"""Where the orthogonalization runs: over which devices, within which memory
budget, with the momentum in which memory.

``Execution`` is built, and its settings checked, once, when a transform is
built; the transforms read it. It makes the one choice between the two routes
of Muon's direction (``streams``): the chain of momentum and
orthogonalization, or each leaf's momentum computed in the wave that
orthogonalizes it (``transforms.muon_direction``).
"""

import dataclasses

from optax_muon._src.base import types
from optax_muon._src.kernels import quantize
from optax_muon._src.parallel import offload
from optax_muon._src.parallel import waves
from optax_muon._src.parallel.tensor_parallel import TensorParallel
from optax_muon._src.parallel.tensor_parallel import check_sharding


@dataclasses.dataclass(frozen=True, kw_only=True)
class Execution:
  """How the orthogonalization is run (checked when built).

  Attributes:
    sharding: ``None`` (each device works on what it holds; under ``jit``
      XLA partitions) or a ``TensorParallel``.
    memory_budget: bytes per device of work in flight, a positive int, or
      ``None`` (the default), as the user gave it. Its two meanings are
      resolved from it once, when built:
    wave_bytes: the waves' size, bytes per device: ``memory_budget``, or
      ``waves.DEFAULT_MEMORY_BUDGET`` (2 GiB) for ``None``.
    auto_limit: the bytes ``mode="auto"``'s smallest piece of a leaf must
      fit: ``memory_budget``, or ``None`` (no limit: ``auto`` chooses by
      time alone; the default budget only orders the waves).
    state_memory_kind: ``None`` (the device's memory) or ``"pinned_host"``:
      the momentum in host memory between steps.
  """

  sharding: TensorParallel | None = None
  memory_budget: int | None = None
  state_memory_kind: types.MemoryKind | None = None
  wave_bytes: int = dataclasses.field(init=False)
  auto_limit: int | None = dataclasses.field(init=False)

  def __post_init__(self):
    check_sharding(self.sharding)
    waves.check_memory_budget(self.memory_budget)
    offload.check_memory_kind(self.state_memory_kind)
    given = None if self.memory_budget is None else int(self.memory_budget)
    # frozen: the derived fields are set once, here
    object.__setattr__(self, "auto_limit", given)
    object.__setattr__(
      self,
      "wave_bytes",
      waves.DEFAULT_MEMORY_BUDGET if given is None else given,
    )

  def streams(self, momentum_dtype: types.MomentumDtype) -> bool:
    """Whether each leaf's momentum is computed inside the wave that
    orthogonalizes it: for an 8-bit momentum (dequantized a part at a time)
    or one kept in host memory (brought over a wave at a time), so that
    their float32 work and transfers keep to the budget. Otherwise the chain
    ``momentum → orthogonalize``, which keeps whatever sharding the momentum
    was given. The streamed route for every state was measured
    (``benchmarks/at_scale.py --donate``, v5p): DeepSeek-V3 at 64 chips
    19.7 → 2.8 GiB of temp, but Llama-3-70B at TP 8 5.3–7.0 → 9.4–14.4 GiB,
    its loops then copying each stack's gradient and momentum."""
    return self.state_memory_kind is not None or isinstance(
      momentum_dtype, quantize.QuantizedMomentum
    )
