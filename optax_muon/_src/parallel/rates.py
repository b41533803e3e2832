"""A device's rates for the cost model of ``tp_mode="auto"``: its matmul rate
in each Newton–Schulz precision and its link's bandwidth.

The figures are the parts' public peak numbers (NVIDIA's A100, H100, H200
and B200 datasheets, SXM, dense; Google Cloud's TPU v4, v5e and v5p pages);
a model compares the modes with them, it does not predict a step's time.
"""

import dataclasses
import math

import jax

# below these a rate is a unit slip (TFLOP/s or GB/s given as FLOP/s or
# bytes/s): no accelerator or link the cost model compares is that slow
MIN_FLOPS = 1e9
MIN_LINK_BYTES = 1e6

# Newton–Schulz precision -> which of the part's rates its matmuls run at
_RATE_OF_PRECISION = {
  "bf16": "bf16",
  "fp16": "bf16",
  "medium": "bf16",
  "high": "high",
  "highest": "highest",
}


@dataclasses.dataclass(frozen=True)
class DeviceRates:
  """One device's rates, as the cost model of ``tp_mode="auto"`` uses them.

  Attributes:
    bf16_flops: dense bf16 matmul FLOP/s (``precision`` ``"medium"``,
      ``"bf16"``, ``"fp16"``).
    high_flops: FLOP/s at ``precision="high"`` (TF32 on NVIDIA parts, three
      bf16 passes on a TPU).
    highest_flops: FLOP/s at ``precision="highest"`` (fp32 on NVIDIA parts,
      six bf16 passes on a TPU).
    link_bytes: bytes per second one device sends (and receives) over the
      tensor-parallel axis.
    latency: seconds each collective costs however small.
    name: the part, for tables.
  """

  bf16_flops: float
  high_flops: float
  highest_flops: float
  link_bytes: float
  latency: float = 10e-6
  name: str = "custom"

  def __post_init__(self):
    for field, floor, unit in (
      ("bf16_flops", MIN_FLOPS, "FLOP/s"),
      ("high_flops", MIN_FLOPS, "FLOP/s"),
      ("highest_flops", MIN_FLOPS, "FLOP/s"),
      ("link_bytes", MIN_LINK_BYTES, "bytes/s"),
    ):
      value = getattr(self, field)
      if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not value > 0
      ):
        raise ValueError(
          f"DeviceRates.{field} must be a finite positive number of {unit}, "
          f"got {value!r}"
        )
      if value < floor:
        raise ValueError(
          f"DeviceRates.{field}={value!r} is below {floor:.0e} {unit}: the "
          f"field is in {unit}, not tera- or giga- (an H100's bf16 rate is "
          "989e12, NVLink's 450e9); accepted values: a number of "
          f"{unit} >= {floor:.0e}"
        )
    if not isinstance(self.latency, (int, float)) or self.latency < 0:
      raise ValueError(
        f"DeviceRates.latency must be a number >= 0, got {self.latency!r}"
      )

  def matmul_flops(self, precision: str) -> float:
    """FLOP/s of a Newton–Schulz matmul at ``precision``."""
    return getattr(self, _RATE_OF_PRECISION[precision] + "_flops")


def _tpu(bf16: float, ici_gbps: float, name: str) -> DeviceRates:
  # a chip's ICI bandwidth counts both directions of all its links
  return DeviceRates(
    bf16, bf16 / 3, bf16 / 6, ici_gbps / 8 * 1e9 / 2, 5e-6, name
  )


# device_kind prefix -> rates (the first that matches)
KNOWN_RATES = {
  # NVLink 3/4/5: 600 / 900 / 1800 GB/s both directions together
  "NVIDIA A100": DeviceRates(312e12, 156e12, 19.5e12, 300e9, 10e-6, "A100"),
  "NVIDIA H100": DeviceRates(989e12, 494e12, 67e12, 450e9, 10e-6, "H100"),
  "NVIDIA H200": DeviceRates(989e12, 494e12, 67e12, 450e9, 10e-6, "H200"),
  "NVIDIA B200": DeviceRates(2250e12, 1100e12, 75e12, 900e9, 10e-6, "B200"),
  "TPU v4": _tpu(275e12, 2400, "TPU v4"),
  "TPU v5 lite": _tpu(197e12, 1600, "TPU v5e"),
  "TPU v5e": _tpu(197e12, 1600, "TPU v5e"),
  "TPU v5p": _tpu(459e12, 4800, "TPU v5p"),
  "TPU v5": _tpu(459e12, 4800, "TPU v5p"),
  # the simulated devices of one host: an order of magnitude, for tests
  "cpu": DeviceRates(1e11, 1e11, 1e11, 1e10, 1e-6, "CPU"),
}


def device_kind(mesh) -> str:
  """The ``device_kind`` of a mesh's devices (a concrete mesh, or the
  abstract one of a traced array's type)."""
  if isinstance(mesh, jax.sharding.AbstractMesh):
    device = mesh.abstract_device
    return "unknown" if device is None else device.device_kind
  return mesh.devices.flat[0].device_kind


def rates_of(mesh) -> DeviceRates | None:
  """The rates of the mesh's devices by their ``device_kind``, or None."""
  kind = device_kind(mesh)
  for prefix, rates in KNOWN_RATES.items():
    if kind.startswith(prefix):
      return rates
  return None
