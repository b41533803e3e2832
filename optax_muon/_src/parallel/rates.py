"""A device's rates for the cost model of ``tp_mode="auto"``: its matmul rate
in each Newton–Schulz precision and its links' bandwidths, one inside a node
and one between nodes.

The figures are the parts' public peak numbers (NVIDIA's A100, H100, H200
and B200 datasheets, SXM, dense, and their DGX systems' one 200 or 400 Gb/s
InfiniBand port a GPU; Google Cloud's TPU v4, v5e and v5p pages, ICI inside
a slice and DCN between slices); a model compares the modes with them, it
does not predict a step's time.
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
    link_bytes: bytes per second one device sends (and receives) to the
      devices of its own node (NVLink; a TPU slice's ICI).
    latency: seconds each collective costs however small.
    name: the part, for tables.
    network_bytes: bytes per second one device sends to other nodes
      (InfiniBand between GPU hosts, DCN between TPU slices); ``None``: as
      fast as ``link_bytes``. A mesh axis whose groups span nodes
      (``crosses_nodes``) moves its bytes at this rate.
  """

  bf16_flops: float
  high_flops: float
  highest_flops: float
  link_bytes: float
  latency: float = 10e-6
  name: str = "custom"
  _: dataclasses.KW_ONLY
  network_bytes: float | None = None

  def __post_init__(self):
    for field, floor, unit in (
      ("bf16_flops", MIN_FLOPS, "FLOP/s"),
      ("high_flops", MIN_FLOPS, "FLOP/s"),
      ("highest_flops", MIN_FLOPS, "FLOP/s"),
      ("link_bytes", MIN_LINK_BYTES, "bytes/s"),
      ("network_bytes", MIN_LINK_BYTES, "bytes/s"),
    ):
      value = getattr(self, field)
      if field == "network_bytes" and value is None:
        continue
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

  def link_for(self, crosses: bool) -> float:
    """Bytes/s a device sends over a mesh axis: ``network_bytes`` where
    the axis's groups span nodes (``crosses``), else ``link_bytes``."""
    if crosses and self.network_bytes is not None:
      return self.network_bytes
    return self.link_bytes


def _gpu(bf16, high, highest, nvlink, infiniband_gbps, name) -> DeviceRates:
  # NVLink's figure counts both directions; one InfiniBand port a GPU
  return DeviceRates(
    bf16,
    high,
    highest,
    nvlink / 2,
    10e-6,
    name,
    network_bytes=infiniband_gbps / 8 * 1e9,
  )


def _tpu(
  bf16: float, ici_gbps: float, name: str, dcn_gbps: float | None = None
) -> DeviceRates:
  # a chip's ICI bandwidth counts both directions of all its links; DCN is
  # given per chip (v5p) or per host of eight chips (v5e: 2 x 100 Gb/s)
  network = None if dcn_gbps is None else dcn_gbps / 8 * 1e9
  return DeviceRates(
    bf16,
    bf16 / 3,
    bf16 / 6,
    ici_gbps / 8 * 1e9 / 2,
    5e-6,
    name,
    network_bytes=network,
  )


# device_kind prefix -> rates (the first that matches)
KNOWN_RATES = {
  # NVLink 3/4/5: 600 / 900 / 1800 GB/s; DGX A100: HDR 200 Gb/s a GPU,
  # DGX H100 / H200 / B200: NDR 400 Gb/s a GPU
  "NVIDIA A100": _gpu(312e12, 156e12, 19.5e12, 600e9, 200, "A100"),
  "NVIDIA H100": _gpu(989e12, 494e12, 67e12, 900e9, 400, "H100"),
  "NVIDIA H200": _gpu(989e12, 494e12, 67e12, 900e9, 400, "H200"),
  "NVIDIA B200": _gpu(2250e12, 1100e12, 75e12, 1800e9, 400, "B200"),
  # TPU v4's page gives no DCN figure: its ICI rate is used across slices
  "TPU v4": _tpu(275e12, 2400, "TPU v4"),
  "TPU v5 lite": _tpu(197e12, 1600, "TPU v5e", 200 / 8),
  "TPU v5e": _tpu(197e12, 1600, "TPU v5e", 200 / 8),
  "TPU v5p": _tpu(459e12, 4800, "TPU v5p", 50),
  "TPU v5": _tpu(459e12, 4800, "TPU v5p", 50),
  # the simulated devices of one host: an order of magnitude, for tests;
  # processes on one machine (multi-process runs) count as nodes
  "cpu": DeviceRates(1e11, 1e11, 1e11, 1e10, 1e-6, "CPU", network_bytes=1e9),
}


def device_kind(mesh) -> str:
  """The ``device_kind`` of a mesh's devices (a concrete mesh, or the
  abstract one of a traced array's type)."""
  if isinstance(mesh, jax.sharding.AbstractMesh):
    device = mesh.abstract_device
    return "unknown" if device is None else device.device_kind
  return mesh.devices.flat[0].device_kind


def node_of(device) -> int:
  """The node a device belongs to, for ``crosses_nodes``: a TPU's slice
  (ICI joins the hosts of one slice), any other device's process (one a
  host, as GPU programs are launched)."""
  if device.platform == "tpu":
    return getattr(device, "slice_index", None) or 0
  return device.process_index


def crosses_nodes(mesh, axis) -> bool:
  """Whether a group of devices along ``axis`` (a name or a tuple of names)
  of a concrete mesh spans nodes (``node_of``); an abstract mesh's devices
  are unknown: False."""
  if isinstance(mesh, jax.sharding.AbstractMesh) or axis is None:
    return False
  names = (axis,) if isinstance(axis, str) else tuple(axis)
  devices = mesh.devices
  order = [mesh.axis_names.index(n) for n in names]
  rest = [i for i in range(devices.ndim) if i not in order]
  size = math.prod(devices.shape[i] for i in order)
  groups = devices.transpose(rest + order).reshape(-1, size)
  return any(len({node_of(d) for d in group}) > 1 for group in groups)


def rates_of(mesh) -> DeviceRates | None:
  """The rates of the mesh's devices by their ``device_kind``, or None."""
  kind = device_kind(mesh)
  for prefix, rates in KNOWN_RATES.items():
    if kind.startswith(prefix):
      return rates
  return None
