"""One Muon update at Llama-3 scale, compiled on abstract shapes.

    python benchmarks/at_scale.py --model llama3-70b --mesh 1x8 --dtype bf16 \
        --stacked --target tpu-v5p-8 [--modes blockwise,duplicated] \
        [--memory-budget BYTES] [--quick]

Nothing is allocated: the params, grads and state are
``jax.ShapeDtypeStruct``s with ``NamedSharding``s, and ``jax.jit(tx.update)``
is lowered and compiled for the target's devices. ``--target cpu`` uses 8
simulated CPU devices; ``--target gpu`` this machine's accelerators (a
1-GPU machine: ``--mesh 1x1``); ``--target tpu-v5p-8`` (``v5p:2x2x2``) a TPU
topology's devices with no TPU present (``jax.experimental.topologies``,
needs libtpu: ``pip install -e ".[tpu-compile]"``, which pins ``jax[tpu]``
to the installed jax), so the TPU compiler's own buffer assignment is read,
and its refusal when a program does not fit a chip (RESOURCE_EXHAUSTED) is
reported, not raised.

The tree is HF-Llama-shaped (per layer ``q/k/v/o_proj``,
``gate/up/down_proj`` and two norms; an embedding, a head and a final norm),
with Megatron's tensor-parallel layout: q/k/v/gate/up column-parallel
(``P(..., None, "model")``), o/down row-parallel (``P(..., "model", None)``),
the embedding and head vocabulary-parallel, norms replicated; the kernels go
to Muon, the rest to AdamW; momentum in the param dtype. ``--stacked`` makes
each kernel one ``[L, in, out]`` leaf as ``nn.scan`` / MaxText's
``scan_layers=True`` do; ``--fsdp matrix`` also shards each kernel's other
matrix axis over ``data`` (MaxText's FSDP), ``--fsdp layers`` a stack's
layer axis, with ``--mesh 8x8`` on ``--target tpu-v5p-64`` (64 chips) or
``h100-64`` (eight hosts of eight); ``--model deepseek-v3[:LAYERS]`` a
DeepSeek-V3-shaped tree; ``--model shapes.json`` reads a user's own tree:
``{"path/to/leaf": [[shape...], "muon"|"adam", [spec entries...]]}`` (one
entry per axis), and ``--model module:function`` a function of no arguments
returning ``(params, specs)`` (``jax.eval_shape`` of your init and its
``PartitionSpec``s; labels from ``om.default_labels``). A malformed tree
exits 2 naming its path; ``--stacked``, ``--layers`` and ``--fsdp`` apply
to the Llama models only.

For each ``tp_mode`` (``--mesh 1x1``: one device, ``om.muon`` without
``sharding``) and for ``optax.contrib.muon`` under GSPMD it prints a table
row (GiB per device: params + grads + state, the update's temporaries, their
total, whether it fits the target's part: 80 GB, 95 GB on TPU v5p, 141 GB on
H200, 192 GB on B200; collectives by kind), and with
``--json`` a JSON line instead: per device the params, grads and state
bytes, the compiler's argument, output and temporary bytes and its peak over
the arguments (``peak_over_arguments_gib``; XLA:CPU's has been the outputs
alone), the collective bytes by kind (loop bodies counted trip-count times),
compile seconds, and whether params + grads + device-resident state + temp
fit an 80 GB, a 95 GB (v5p), a 141 GB and a 192 GB part (``fits``;
``part``: the target's), the ratio of each mode's collective bytes to
``duplicated``'s, and what compiled it (``compiler``: the jax, jaxlib and
libtpu or CUDA plugin versions; the table says so under it). ``--momentum
8bit`` stores Muon's momentum as
``om.QuantizedMomentum`` (blocks of up to 256 that divide every shard);
``--offload`` keeps the whole state in pinned host
memory (``state_memory_kind``): the compiler's ``host_argument`` bytes are
then the state's, and ``state_device_gib`` is zero. Activations and the
forward and backward pass are not counted: "fits" is the optimizer's share
of a part (80 GB = 74.5 GiB). ``--quick`` measures the tiny model.
"""

import argparse
import importlib.metadata
import json
import math
import os
import sys
import textwrap
import time

_ARGS = sys.argv[1:]
_TARGET = (
  _ARGS[_ARGS.index("--target") + 1] if "--target" in _ARGS[:-1] else "cpu"
)
# GPUs compiled for without one (benchmarks/gpu_targets/<part>.txtpb)
GPU_PARTS = ("a100", "h100", "h200", "b200")
if _TARGET.split("-")[0] in GPU_PARTS:
  # a GPU compiled for without one: no driver, so the CUDA plugin's version
  # check (cuInit) is skipped, in this script only; the default backend
  # stays the CPU
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
elif _TARGET.startswith("tpu"):
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  # no TPU is opened, so one run need not lock out the next
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
elif _TARGET == "cpu":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
  )
sys.path.insert(0, os.path.dirname(__file__))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _hlo import collective_bytes  # noqa: E402
from _hlo import host_bytes  # noqa: E402
from _hlo import matmul_flops  # noqa: E402
from _hlo import overlap  # noqa: E402
from _timing import emit  # noqa: E402
from _update_time import formula  # noqa: E402
from _update_time import rates_of  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_muon as om  # noqa: E402
from optax_muon._src.parallel.rates import node_of  # noqa: E402

# d_model, d_ffn, query heads, kv heads, head dim, layers, vocabulary
MODELS = {
  "llama3-8b": (4096, 14336, 32, 8, 128, 32, 128256),
  "llama3-70b": (8192, 28672, 64, 8, 128, 80, 128256),
  "llama3.2-1b": (2048, 8192, 32, 8, 64, 16, 128256),
  "tiny": (256, 1024, 8, 4, 32, 4, 1024),  # --quick
}
# deviceless GPU targets: an XLA GpuTargetConfigProto in benchmarks/gpu_targets
GPU_TARGETS = {
  f"{part}-{n}": f"{part}.txtpb" for part in GPU_PARTS for n in (8, 64)
}
# None: this machine's own devices (8 simulated ones for "cpu")
TARGETS = {
  "cpu": None,
  "gpu": None,
  "tpu-v5p-8": "v5p:2x2x2",
  "tpu-v5p-64": "v5p:4x4x4",
  "tpu-v5p-512": "v5p:8x8x8",
  # eight hosts of eight GPUs for the -64 targets
  **{t: "1x1x8" if t.endswith("-8") else "1x8x8" for t in GPU_TARGETS},
}
PARTS_GIB = {
  "80GB": 80e9 / 2**30,
  "95GB": 95.74,
  "141GB": 141e9 / 2**30,
  "192GB": 192e9 / 2**30,
}


def part_of(target: str) -> str:
  """The memory part of a target's device, which the table's fit column
  reads (A100/H100: 80 GB, TPU v5p: 95, H200: 141, B200: 192; this
  machine's devices and the CPU: 80)."""
  if target.startswith("tpu-v5p"):
    return "95GB"
  return {"h200": "141GB", "b200": "192GB"}.get(target.split("-")[0], "80GB")


DTYPES = {"bf16": jnp.bfloat16, "fp32": jnp.float32}
GIB = 2**30


def llama_tree(
  model, stacked: bool, layers: int | None = None, fsdp: str = "none"
):
  """``{path: (shape, label, spec)}`` for an HF-Llama tree; ``fsdp``:
  ``"matrix"`` shards each kernel's other matrix axis over ``data`` (and the
  embedding's and head's), ``"layers"`` a stack's layer axis."""
  d, ffn, heads, kv, hd, depth, vocab = MODELS[model]
  depth = layers or depth
  kernels = {
    "q_proj": ((d, heads * hd), "col"),
    "k_proj": ((d, kv * hd), "col"),
    "v_proj": ((d, kv * hd), "col"),
    "o_proj": ((heads * hd, d), "row"),
    "gate_proj": ((d, ffn), "col"),
    "up_proj": ((d, ffn), "col"),
    "down_proj": ((ffn, d), "row"),
  }
  tree = {
    "embed_tokens": ((vocab, d), "adam", ("model", None)),
    "lm_head": ((d, vocab), "adam", (None, "model")),
    "norm": ((d,), "adam", (None,)),
  }
  if fsdp == "matrix":
    tree["embed_tokens"] = ((vocab, d), "adam", ("model", "data"))
    tree["lm_head"] = ((d, vocab), "adam", ("data", "model"))
  other = "data" if fsdp == "matrix" else None
  tp = lambda kind: (other, "model") if kind == "col" else ("model", other)
  if stacked:
    layer = "data" if fsdp == "layers" else None
    for name, (shape, kind) in kernels.items():
      tree[f"layers/{name}"] = ((depth, *shape), "muon", (layer, *tp(kind)))
    for norm in ("input_norm", "post_norm"):
      tree[f"layers/{norm}"] = ((depth, d), "adam", (None, None))
  else:
    for layer in range(depth):
      for name, (shape, kind) in kernels.items():
        tree[f"layers_{layer}/{name}"] = (shape, "muon", tp(kind))
      for norm in ("input_norm", "post_norm"):
        tree[f"layers_{layer}/{norm}"] = ((d,), "adam", (None,))
  return tree


# DeepSeek-V3: hidden, routed experts, expert ffn, dense ffn, dense layers,
# layers, vocabulary, MLA's q rank, kv rank, heads, nope / rope / v head dims
DEEPSEEK_V3 = (7168, 256, 2048, 18432, 3, 61, 129280, 1536, 512, 128, 128, 64)


def deepseek_tree(layers: int | None = None):
  """``{path: (shape, label, spec)}`` for a DeepSeek-V3-shaped MoE with
  scanned layers: MLA (q_a, q_b, kv_a, kv_b, o), the first dense layers'
  MLP, then per MoE layer a router, one shared expert and the routed
  experts ``[L, E, in, out]``, sharded over ``data`` as the expert-parallel
  axis (EP) with tensor parallelism inside; attention and dense kernels
  column / row parallel over ``model``."""
  d, experts, eff, ffn, dense, depth, vocab, q_rank, kv_rank = DEEPSEEK_V3[:9]
  heads, nope, rope = DEEPSEEK_V3[9:]
  v = nope  # the value head dim equals the no-RoPE one (128)
  depth = layers or depth
  dense = min(dense, depth - 1)
  moe = depth - dense
  col, row = (None, "model"), ("model", None)
  kernels = {
    "q_a": ((d, q_rank), (None, None)),
    "q_b": ((q_rank, heads * (nope + rope)), col),
    "kv_a": ((d, kv_rank + rope), (None, None)),
    "kv_b": ((kv_rank, heads * (nope + v)), col),
    "o": ((heads * v, d), row),
  }
  tree = {
    "embed": ((vocab, d), "adam", ("model", None)),
    "lm_head": ((d, vocab), "adam", (None, "model")),
  }
  for name, (shape, spec) in kernels.items():
    tree[f"attn/{name}"] = ((depth, *shape), "muon", (None, *spec))
  for name, shape, spec in (
    ("gate", (d, ffn), col),
    ("up", (d, ffn), col),
    ("down", (ffn, d), row),
  ):
    tree[f"dense/{name}"] = ((dense, *shape), "muon", (None, *spec))
  tree["moe/router"] = ((moe, d, experts), "muon", (None, None, None))
  for name, shape, spec in (
    ("gate", (d, eff), col),
    ("up", (d, eff), col),
    ("down", (eff, d), row),
  ):
    tree[f"moe/shared_{name}"] = ((moe, *shape), "muon", (None, *spec))
    tree[f"moe/experts_{name}"] = (
      (moe, experts, *shape),
      "muon",
      (None, "data", *spec),
    )
  tree["norms"] = ((depth, 4, d), "adam", (None, None, None))
  return tree


LABELS = ("muon", "adam")
MESH_AXES = ("data", "model")


def check_tree(raw, source: str) -> dict:
  """``raw`` as a flat tree ``{path: (shape, label, spec)}``, each entry
  checked; ``ValueError`` naming ``source`` and the path of the first entry
  that is not ``[[shape...], "muon"|"adam", [spec entries...]]`` with a spec
  entry per axis, each None, a mesh axis or a list of them."""
  if not isinstance(raw, dict) or not raw:
    raise ValueError(
      f"{source} is not a non-empty JSON object of "
      '{"path/to/leaf": [[shape...], "muon"|"adam", [spec entries...]]}'
    )
  flat = {}
  for path, entry in raw.items():
    where = f"{source}: leaf {path!r}"
    if not (isinstance(entry, (list, tuple)) and len(entry) == 3):
      raise ValueError(
        f"{where} is {entry!r}, not [[shape...], label, [spec entries...]]"
      )
    shape, label, spec = entry
    if not (
      isinstance(shape, (list, tuple))
      and shape
      and all(isinstance(d, int) and d >= 1 for d in shape)
    ):
      raise ValueError(f"{where}: shape {shape!r} is not a list of ints >= 1")
    if label not in LABELS:
      raise ValueError(
        f"{where}: label {label!r} is not accepted; accepted: {list(LABELS)}"
      )
    if label == "muon" and len(shape) < 2:
      raise ValueError(f"{where}: a Muon leaf needs 2 or more axes: {shape}")
    if not isinstance(spec, (list, tuple)) or len(spec) != len(shape):
      raise ValueError(
        f"{where}: spec {spec!r} needs one entry per axis of shape {shape} "
        "(None for an axis not sharded)"
      )
    for axis in spec:
      names = [axis] if axis is None or isinstance(axis, str) else axis
      if not isinstance(names, (list, tuple)) or any(
        n is not None and n not in MESH_AXES for n in names
      ):
        raise ValueError(
          f"{where}: spec entry {axis!r} names no mesh axis; accepted: None, "
          f"{list(MESH_AXES)} or a list of them"
        )
    flat[path] = (
      tuple(shape),
      label,
      tuple(tuple(a) if isinstance(a, list) else a for a in spec),
    )
  return flat


def read_tree(path):
  with open(path) as f:
    try:
      raw = json.load(f)
    except json.JSONDecodeError as error:
      raise ValueError(f"{path} is not JSON: {error}") from None
  return check_tree(raw, path)


def tree_from_function(text: str) -> dict:
  """The flat tree of ``module:function``: the function returns ``(params,
  specs)``, a tree of arrays or ``jax.ShapeDtypeStruct``s and a tree of
  ``PartitionSpec``s like it (a prefix allowed, as ``jax.jit`` takes); the
  labels are ``om.default_labels``'."""
  import importlib  # noqa: PLC0415

  module_name, _, function_name = text.partition(":")
  if os.getcwd() not in sys.path:  # the user's module, from where they are
    sys.path.insert(0, os.getcwd())
  try:
    function = getattr(importlib.import_module(module_name), function_name)
  except (ImportError, AttributeError) as error:
    raise ValueError(f"{text}: {error}") from None
  try:
    params, specs = function()
  except (TypeError, ValueError) as error:
    raise ValueError(
      f"{text}() must return (params, specs) and take no arguments: {error}"
    ) from None
  labels = om.default_labels(params)
  flat_specs = jax.tree_util.tree_flatten_with_path(
    jax.tree.broadcast(specs, params, is_leaf=lambda x: isinstance(x, P))
  )[0]
  raw = {}
  for (path, leaf), label, (_, spec) in zip(
    jax.tree_util.tree_flatten_with_path(params)[0],
    jax.tree.leaves(labels),
    flat_specs,
  ):
    name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
    entries = list(spec) + [None] * (len(leaf.shape) - len(spec))
    raw[name] = [
      list(leaf.shape),
      "adam" if label != "muon" else label,
      entries,
    ]
  return check_tree(raw, text)


def nest(flat: dict) -> dict:
  """``{"a/b": x}`` → ``{"a": {"b": x}}``."""
  tree: dict = {}
  for path, value in flat.items():
    node = tree
    *parents, leaf = path.split("/")
    for part in parents:
      node = node.setdefault(part, {})
    node[leaf] = value
  return tree


def shard_bytes(struct) -> int:
  shape = struct.sharding.shard_shape(struct.shape)
  return math.prod(shape) * jnp.dtype(struct.dtype).itemsize


def tree_bytes(tree) -> int:
  return sum(shard_bytes(x) for x in jax.tree.leaves(tree))


def make_mesh(target: str, dp: int, tp: int):
  if TARGETS[target] is None:
    devices = jax.devices()[: dp * tp]
  elif target in GPU_TARGETS:
    from jax.experimental import topologies

    config = os.path.join(
      os.path.dirname(__file__), "gpu_targets", GPU_TARGETS[target]
    )
    with open(config) as f:
      devices = topologies.get_topology_desc(
        target.split("-")[0],
        "cuda",
        target_config=f.read(),
        topology=TARGETS[target],
      ).devices[: dp * tp]
  else:
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(
      platform="tpu", topology_name=TARGETS[target]
    ).devices[: dp * tp]
  if len(devices) != dp * tp:
    raise ValueError(
      f"{dp}x{tp} needs {dp * tp} devices; --target {target} has {len(devices)}"
    )
  return jax.sharding.Mesh(np.array(devices).reshape(dp, tp), ("data", "model"))


# the compiler a platform's programs are compiled by, past jaxlib's own
# (XLA:CPU): its distribution, under the names it was released as (a CUDA
# device's platform reads "gpu" or "cuda")
CUDA_PLUGINS = ("jax-cuda12-pjrt", "jax-cuda13-pjrt")
PLUGINS = {"tpu": ("libtpu",), "gpu": CUDA_PLUGINS, "cuda": CUDA_PLUGINS}


def compiler_versions(mesh) -> dict:
  """The installed versions of what compiles for ``mesh``'s devices: jax,
  jaxlib and the platform's plugin (libtpu, the CUDA PJRT plugin). Figures of
  two releases differ (a v5p update's temporaries: 3.75 GiB with libtpu
  0.0.42.1, 6.75 with 0.0.50.1, docs/scaling.md), so each record says which."""
  names = ("jax", "jaxlib", *PLUGINS.get(mesh.devices.flat[0].platform, ()))
  versions = {}
  for name in names:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  return versions


def block_size(flat, mesh) -> int:
  """The 8-bit momentum's block: at most 256, dividing the shard width of
  every Muon leaf's last axis (the abstract init cannot read shardings)."""
  widths = [
    shape[-1] // (mesh.shape["model"] if spec[-1] == "model" else 1)
    for shape, label, spec in flat.values()
    if label == "muon"
  ]
  return math.gcd(256, *widths)


def optimizers(
  flat,
  mesh,
  modes,
  budget,
  momentum="param",
  offload=False,
  precision="highest",
  distribute_over=None,
):
  labels = nest({k: label for k, (_, label, _) in flat.items()})
  specs = nest({k: P(*spec) for k, (_, _, spec) in flat.items()})
  dims = nest(
    {
      k: (
        optax.contrib.MuonDimensionNumbers(len(shape) - 2, len(shape) - 1)
        if label == "muon"
        else None
      )
      for k, (shape, label, _) in flat.items()
    }
  )
  extra = {} if budget is None else {"memory_budget": budget}
  extra["precision"] = precision
  extra["mu_dtype"] = {
    "param": None,
    "fp32": "float32",
    "8bit": om.QuantizedMomentum(block_size=block_size(flat, mesh)),
  }[momentum]
  if offload:
    extra["state_memory_kind"] = "pinned_host"
  out = {}
  for mode in modes:
    if mode == "optax.contrib.muon":
      out[mode] = optax.contrib.muon(0.02, muon_weight_dimension_numbers=dims)
      continue
    if mode in ("dion2", "dion2_global"):  # each shard's rows, or the matrix's
      out[mode] = om.dion2(
        0.02,
        labels=labels,
        dimension_numbers=dims,
        sharding=om.TensorParallel(
          mesh,
          "model",
          "allgather",
          specs=specs,
          distribute_over=distribute_over,
        ),
        selection_scope="global" if mode == "dion2_global" else "local",
        **extra,
      )
      continue
    if mode in ("dion", "dion_distributed"):
      # dion: XLA partitions its products (rcqr's QR is small);
      # dion_distributed: its own scheme, each chip keeping its blocks
      out[mode] = om.dion(
        0.02,
        rank_fraction=DION_RANK_FRACTION,
        qr_method="rcqr",
        labels=labels,
        dimension_numbers=dims,
        sharding=(
          om.TensorParallel(mesh, mode="distributed", specs=specs)
          if mode == "dion_distributed"
          else None
        ),
        **extra,
      )
      continue
    if mode == "muon_bp":  # full steps allgather, block steps blockwise
      full = om.TensorParallel(
        mesh, "model", "allgather", specs=specs, distribute_over=distribute_over
      )
      out[mode] = om.muon_bp(
        0.02,
        period=MUON_BP_PERIOD,
        labels=labels,
        dimension_numbers=dims,
        sharding=full,
        **extra,
      )
      continue
    sharding = (
      None
      if mode == "unsharded"
      else om.TensorParallel(
        mesh, "model", mode, specs=specs, distribute_over=distribute_over
      )
    )
    out[mode] = om.muon(
      0.02, labels=labels, dimension_numbers=dims, sharding=sharding, **extra
    )
  return out


def abstract_tree(flat, mesh, dtype):
  return nest(
    {
      k: jax.ShapeDtypeStruct(
        shape, dtype, sharding=NamedSharding(mesh, P(*spec))
      )
      for k, (shape, _, spec) in flat.items()
    }
  )


def state_like(state, params, memory_kind=None):
  """The abstract state, each param-shaped leaf sharded like its param (its
  path ends with the param's; an 8-bit leaf's values and scales too, the
  scales' blocks split like the param's last axis), the rest replicated;
  all in ``memory_kind``."""
  by_path = {
    tuple(str(k) for k in path): leaf
    for path, leaf in jax.tree_util.tree_leaves_with_path(params)
  }
  mesh = jax.tree.leaves(params)[0].sharding.mesh
  replicated = NamedSharding(mesh, P(), memory_kind=memory_kind)
  parts = (".values", ".scales")

  def place(path, leaf):
    keys = tuple(str(k) for k in path)
    if keys and keys[-1] in parts:
      keys = keys[:-1]
    for start in range(len(keys)):
      param = by_path.get(keys[start:])
      if param is not None and param.shape[:-1] == leaf.shape[:-1]:
        sharding = NamedSharding(
          mesh, param.sharding.spec, memory_kind=memory_kind
        )
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=replicated)

  return jax.tree_util.tree_map_with_path(place, state)


def optimizer_step(tx):
  """``(params, grads, state) → (new params, new state)``: the update and
  its application, as a training step runs them. Compiled with all three
  donated, the compiler holds the params through the update as the step
  does: an update compiled alone, for an optimizer that does not read the
  params (no weight decay), has them pruned, and the compiler then
  schedules as if their memory were free (DeepSeek-V3's 61 layers on
  v5p-64, jax 0.12.0.1: 51.9 GiB of temporaries alone, 12.8 so)."""

  def step(params, grads, state):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def measure(
  tx,
  params,
  name,
  offload=False,
  donate=False,
  rates=None,
  precision=None,
  dump_hlo=None,
):
  """The compiled update's memory and collectives (or the refusal);
  ``donate``: the optimizer's half of a training step (``optimizer_step``),
  params, gradients and state donated. With the devices' ``rates``
  (and the Newton–Schulz ``precision``), what of the collective time the
  compiled schedule hides (``_hlo.overlap``: each collective's ring bytes
  over its group, at the network's rate where the group spans nodes)."""
  state = state_like(
    jax.eval_shape(tx.init, params),
    params,
    "pinned_host" if offload else None,
  )
  start = time.perf_counter()
  state_gib = tree_bytes(state) / GIB
  record = {
    "params_gib": tree_bytes(params) / GIB,
    "grads_gib": tree_bytes(params) / GIB,
    "state_gib": state_gib,
    # what of it stays in device memory between steps
    "state_device_gib": 0.0 if offload else state_gib,
  }
  # params + grads + the device-resident state, before the update's temp
  record["pgs_gib"] = 2 * record["params_gib"] + record["state_device_gib"]
  try:
    if donate:
      compiled = (
        jax.jit(optimizer_step(tx), donate_argnums=(0, 1, 2))
        .lower(params, params, state)
        .compile()
      )
    else:
      compiled = jax.jit(tx.update).lower(params, state, params).compile()
  except Exception as error:  # the TPU compiler's refusal is a result here
    text = str(error)
    record.update(
      compiled=False,
      error=text.splitlines()[0][:300],
      resource_exhausted="RESOURCE_EXHAUSTED" in text,
      compile_s=time.perf_counter() - start,
      resident_gib=None,
    )
    return record
  record["compile_s"] = time.perf_counter() - start
  analysis = compiled.cost_analysis()
  analysis = analysis[0] if isinstance(analysis, list) else analysis
  if analysis and "flops" in analysis:  # a loop's body counted once
    record["cost_analysis_tflop"] = analysis["flops"] / 1e12
  memory = compiled.memory_analysis()
  for key in (
    "argument",
    "output",
    "temp",
    "alias",
    "host_argument",
    "host_output",
    "host_temp",
  ):
    value = getattr(memory, f"{key}_size_in_bytes", None)
    if value is not None:
      record[f"{key}_gib"] = value / GIB
  # the compiler's own peak over the arguments: what a step adds to them.
  # libtpu's ``temp`` can count more than that (a copy its peak does not
  # hold; docs/scaling.md), and XLA:CPU's peak leaves its temps out
  peak = getattr(memory, "peak_memory_in_bytes", None)
  if peak:
    record["peak_over_arguments_gib"] = (
      peak - memory.argument_size_in_bytes
    ) / GIB
  hlo = compiled.as_text()
  if dump_hlo:
    os.makedirs(dump_hlo, exist_ok=True)
    with open(os.path.join(dump_hlo, f"{name}.hlo"), "w") as f:
      f.write(hlo)
  if offload and not record.get("host_argument_gib"):  # the CPU compiler's
    record["host_argument_gib"], record["host_output_gib"] = (
      b / GIB for b in host_bytes(hlo)
    )
  # the program's own matmuls, loops times their trip counts (its
  # Newton–Schulz as grouped and padded, beside the formula's ns_tflop);
  # None where none is read: the TPU compiler writes them as convolutions
  record["hlo_tflop"] = matmul_flops(hlo) / 1e12 or None
  kinds = collective_bytes(hlo)
  record["collective_gib"] = {k: v / GIB for k, v in kinds.items() if v}
  record["collective_total_gib"] = sum(kinds.values()) / GIB
  if rates is not None:
    mesh = jax.tree.leaves(params)[0].sharding.mesh
    seen = overlap(
      hlo,
      rates.matmul_flops(precision),
      rates.link_bytes,
      rates.network_bytes,
      [node_of(d) for d in mesh.devices.flat],
    )
    record["schedule"] = {
      "collective_ms": seen["collective_s"] * 1e3,
      "overlapped_ms": seen["overlapped_s"] * 1e3,
      "exposed_ms": seen["exposed_s"] * 1e3,
      "network_ms": seen["network_s"] * 1e3,
      "collectives": seen["collectives"],
      "asynchronous": seen["asynchronous"],
    }
  record["compiled"] = True
  resident = record["pgs_gib"] + record["temp_gib"]
  record["resident_gib"] = resident
  record["fits"] = {part: resident <= gib for part, gib in PARTS_GIB.items()}
  return record


MODES = (
  *om.TensorParallel.MODES,
  "muon_bp",
  "dion2",
  "dion2_global",
  "dion",
  "dion_distributed",
  "optax.contrib.muon",
)
# the members whose momentum is a float sum (no 8-bit momentum)
FLOAT_SUM_MODES = ("dion2", "dion2_global", "dion", "dion_distributed")
MUON_BP_PERIOD = 5
# Dion at a quarter of each matrix's rank: the share Dion2 orthogonalizes
DION_RANK_FRACTION = 0.25
NOT_COUNTED = (
  "Per device, one optimizer update: params + grads + optimizer state + the "
  "update's temporaries (temp); with --donate, the update applied to the "
  "params as a training step's optimizer half, params, grads and state "
  "donated. Not counted: activations, the forward and "
  "backward pass, the framework's own buffers, so 'fits' says whether the "
  "optimizer's share fits a part, not the training step. Parts: "
  + ", ".join(f"{part[:-2]} GB = {g:.1f} GiB" for part, g in PARTS_GIB.items())
  + "."
)


MODELED = (
  "modeled ms is a model, not a measurement: the Newton-Schulz FLOPs by "
  "formula (5 steps of every matrix) at the part's peak matmul rate for "
  "--precision, plus the compiled collectives' bytes as a ring moves them "
  "over each one's group at its link's peak bandwidth, or the network's "
  "(InfiniBand, DCN) where the group spans nodes (om.KNOWN_RATES), nothing "
  "overlapped. "
  "program: the compiled program's matmul FLOPs read from its text, loops "
  "times their trip counts (benchmarks/_hlo.py matmul_flops; the JSON's "
  "cost_analysis_tflop counts a loop's body once, a floor). auto: each "
  "leaf's mode of least modeled time. collective ms "
  "exposed / all: read from the compiled schedule, an asynchronous "
  "collective hidden up to the matmul time between its start and done, at "
  "the same rates (benchmarks/_hlo.py overlap). share of a step: (the "
  "program's Newton-Schulz time + the exposed collective time) / (6 x params x "
  "--tokens over the devices at the part's bf16 peak x --mfu), a model."
)


def mesh_arg(text: str) -> tuple[int, int]:
  """``"DPxTP"`` as two positive ints (argparse type)."""
  parts = text.lower().split("x")
  if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
    raise argparse.ArgumentTypeError(
      f"{text!r} is not DPxTP with two positive ints, e.g. 1x8 (8-way tensor "
      "parallel), 2x4, or 1x1 (one device)"
    )
  dp, tp = (int(p) for p in parts)
  return dp, tp


MODEL_HELP = (
  f"one of {sorted(MODELS)}; deepseek-v3 or deepseek-v3:LAYERS (at least 2); "
  'a .json tree, {"path/to/leaf": [[shape...], "muon"|"adam", '
  '[spec entry per axis: null, "data", "model" or a list]]}; or '
  "module:function, a function of no arguments returning (params, specs): "
  "abstract params (jax.eval_shape of your init) and their PartitionSpecs, "
  "labelled by om.default_labels (default: llama3-8b)"
)


def model_arg(text: str) -> str:
  """A model name, a ``.json`` tree that exists or ``module:function``
  (argparse type)."""
  if text in MODELS or (text.endswith(".json") and os.path.isfile(text)):
    return text
  name, _, layers = text.partition(":")
  if name == "deepseek-v3" and (
    not layers or (layers.isdigit() and int(layers) >= 2)
  ):
    return text
  if name != "deepseek-v3" and layers.isidentifier() and name:
    return text
  raise argparse.ArgumentTypeError(
    f"{text!r} is not a model; accepted: {MODEL_HELP}"
  )


def fraction(text: str) -> float:
  """A number in (0, 1] (argparse type)."""
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not 0 < value <= 1:
    raise argparse.ArgumentTypeError(f"{text!r} is not a number in (0, 1]")
  return value


def positive_int(text: str) -> int:
  """A positive int (argparse type)."""
  if not text.isdigit() or int(text) < 1:
    raise argparse.ArgumentTypeError(f"{text!r} is not a positive int")
  return int(text)


def modes_arg(text: str) -> list[str]:
  """Comma-separated modes, each of ``MODES`` (argparse type)."""
  modes = [m for m in text.split(",") if m]
  unknown = [m for m in modes if m not in MODES]
  if unknown or not modes:
    raise argparse.ArgumentTypeError(
      f"{text!r} names {unknown or 'no mode'}; accepted: {list(MODES)}, "
      "comma-separated"
    )
  return modes


def gib(x: float) -> str:
  """GiB to three significant figures (two decimals from 10 GiB up)."""
  return f"{x:.2f}" if x >= 10 else f"{x:.3g}"


def _flops_cell(r: dict) -> str:
  formula_tflop = f"{r['ns_tflop']:.3g}" if "ns_tflop" in r else "—"
  compiled = r.get("hlo_tflop")
  return f"{formula_tflop} / {'—' if compiled is None else f'{compiled:.3g}'}"


def _schedule_cell(r: dict) -> str:
  schedule = r.get("schedule")
  if not schedule:
    return "—"
  return f"{schedule['exposed_ms']:.2f} / {schedule['collective_ms']:.2f}"


def table(records: dict, part: str = "80GB") -> str:
  """The records as an aligned table (GiB per device; fits: against
  ``part``), then what is and is not counted."""
  header = (
    "mode",
    "params+grads+state",
    "temp",
    "total",
    f"fits {part[:-2]} GB ({PARTS_GIB[part]:.1f} GiB)",
    "collectives (GiB, by kind)",
    "NS TFLOP formula / program",
    "modeled ms",
    "collective ms exposed / all",
    "share of a step",
    "compile s",
  )
  rows = [header]
  for name, r in records.items():
    if not r["compiled"]:  # the compiler's refusal, as the JSON's error
      why = "does not fit" if r["resource_exhausted"] else r["error"][:60]
      rows.append(
        (
          name,
          gib(r["pgs_gib"]),
          "—",
          "—",
          "no",
          f"refused: {why}",
          "",
          "",
          "",
          "",
          "",
        )
      )
      continue
    kinds = ", ".join(
      f"{kind} {gib(size)}"
      for kind, size in sorted(r["collective_gib"].items())
    )
    rows.append(
      (
        name,
        gib(r["pgs_gib"]),
        gib(r["temp_gib"]),
        gib(r["resident_gib"]),
        "yes" if r["fits"][part] else "no",
        kinds or "none",
        _flops_cell(r),
        f"{r['modeled_ms']:.1f}" if "modeled_ms" in r else "—",
        _schedule_cell(r),
        f"{100 * r['step_share']:.2f} %" if "step_share" in r else "—",
        f"{r['compile_s']:.1f}",
      )
    )
  widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
  lines = [
    "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
    for row in rows
  ]
  return "\n".join(
    lines + ["", textwrap.fill(NOT_COUNTED, 79), "", textwrap.fill(MODELED, 79)]
  )


def add_step_share(record: dict, flat, mesh, args) -> None:
  """The optimizer's modeled share of a training step: (its Newton–Schulz
  time + the collective time the compiled schedule leaves exposed) ÷ the
  step's model compute, ``6 · params · tokens`` over the mesh's devices at
  the part's bf16 peak × ``--mfu``. The Newton–Schulz is the compiled
  program's matmul FLOPs (``hlo_tflop``; the formula's where none were
  read) at the part's rate. A model at peak rates, not a profile."""
  schedule = record.get("schedule")
  rates = rates_of(mesh)
  if not schedule or rates is None or "ns_tflop" not in record:
    return
  params = sum(math.prod(shape) for shape, _, _ in flat.values())
  devices = math.prod(mesh.shape.values())
  train_s = 6 * params * args.tokens / (devices * rates.bf16_flops * args.mfu)
  tflop = record.get("hlo_tflop") or record["ns_tflop"]
  ns_s = tflop * 1e12 / rates.matmul_flops(args.precision)
  optimizer_s = ns_s + schedule["exposed_ms"] / 1e3
  record.update(
    tokens=args.tokens,
    mfu=args.mfu,
    train_model_ms=train_s * 1e3,
    optimizer_model_ms=optimizer_s * 1e3,
    step_share=optimizer_s / train_s,
  )


def add_modeled_time(record: dict, flat, mesh, args) -> None:
  """The cost model's figures for an om.muon mode (``unsharded``: the whole
  matrices on one device), and the modeled ms at the target's rates."""
  mode = {"unsharded": "blockwise"}.get(record["mode"], record["mode"])
  rates = rates_of(mesh)
  if mode not in om.TensorParallel.MODES or rates is None:
    return
  itemsize = jnp.dtype(DTYPES[args.dtype]).itemsize
  model = formula(
    flat,
    mesh,
    mode,
    itemsize,
    args.precision,
    args.memory_budget,
    args.distribute_over,
  )
  record.update(model, rates=rates.name)
  if record.get("schedule"):  # each collective over its own group and link
    ns_s = model["ns_tflop"] * 1e12 / rates.matmul_flops(args.precision)
    record["modeled_ms"] = ns_s * 1e3 + record["schedule"]["collective_ms"]


def add_muon_bp_average(records: dict) -> None:
  """MuonBP's collectives per step on average: its full step's (allgather's
  program) once and its block step's (blockwise's) ``period − 1`` times in
  ``period`` steps; and that over allgather's per step."""
  bp, full, block = (
    records.get(m) for m in ("muon_bp", "allgather", "blockwise")
  )
  if not (
    bp and full and block and full.get("compiled") and block.get("compiled")
  ):
    return
  f, b = full["collective_total_gib"], block["collective_total_gib"]
  average = (f + (MUON_BP_PERIOD - 1) * b) / MUON_BP_PERIOD
  bp.update(
    period=MUON_BP_PERIOD,
    per_step_collective_gib=average,
    per_step_over_allgather=average / f if f else None,
  )


def main(argv=None):
  parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    epilog=(
      f"Models: {', '.join(sorted(MODELS))}, deepseek-v3[:LAYERS], a .json "
      "tree or module:function (see --model). One GPU: "
      "--target gpu --mesh 1x1. Prints a table (GiB per device); --json "
      "prints one JSON line per mode instead. " + NOT_COUNTED
    ),
  )
  parser.add_argument(
    "--model", default="llama3-8b", type=model_arg, help=MODEL_HELP
  )
  parser.add_argument(
    "--mesh",
    default=(1, 8),
    type=mesh_arg,
    help="DPxTP: data x tensor parallel (default: 1x8; one device: 1x1)",
  )
  parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
  parser.add_argument("--stacked", action="store_true")
  parser.add_argument(
    "--fsdp",
    default="none",
    choices=["none", "matrix", "layers"],
    help="the data axis also shards each kernel's other matrix axis "
    "(matrix, as MaxText's FSDP) or a stack's layer axis (layers, with "
    "--stacked); default none",
  )
  parser.add_argument(
    "--layers",
    type=positive_int,
    default=None,
    help="layers (default: the model's)",
  )
  parser.add_argument(
    "--target",
    default="cpu",
    choices=sorted(TARGETS),
    help="cpu: 8 simulated devices (default); gpu: this machine's; "
    "tpu-v5p-8, -64, -512: a TPU topology, no TPU needed (libtpu); a100-8, "
    "h100-8, h200-8, b200-8: eight such GPUs, none needed (the gpu-compile "
    "extra); a100-64 ... b200-64: eight hosts of eight",
  )
  parser.add_argument(
    "--modes",
    default=list(MODES),
    type=modes_arg,
    help=f"comma-separated, of {list(MODES)} (default: all)",
  )
  parser.add_argument(
    "--memory-budget",
    type=positive_int,
    default=None,
    help="bytes per device of NS work in flight",
  )
  parser.add_argument(
    "--momentum",
    default="param",
    choices=["param", "fp32", "8bit"],
    help="Muon's momentum: the param dtype, fp32, or 8-bit blockwise",
  )
  parser.add_argument(
    "--offload",
    action="store_true",
    help="the optimizer state in pinned host memory (state_memory_kind)",
  )
  parser.add_argument(
    "--donate",
    action="store_true",
    help="compile the optimizer's half of a training step: the update "
    "applied to the params, params, gradients and state donated (default: "
    "the update alone, not donated)",
  )
  parser.add_argument(
    "--precision",
    default="highest",
    choices=["highest", "high", "medium", "fp16", "bf16"],
    help="Newton-Schulz precision (default: om.muon's, highest)",
  )
  parser.add_argument(
    "--distribute-over",
    default=None,
    choices=["data"],
    help="split the Newton-Schulz work over the data axis too "
    "(TensorParallel(distribute_over=), Megatron's layer-wise optimizer)",
  )
  parser.add_argument(
    "--quick",
    action="store_true",
    help="the tiny model (on the --target given)",
  )
  parser.add_argument(
    "--json", action="store_true", help="one JSON line per mode"
  )
  parser.add_argument(
    "--tokens",
    type=positive_int,
    default=2**20,
    help="tokens a training step, for the optimizer's modeled share of it "
    "(default 2**20)",
  )
  parser.add_argument(
    "--mfu",
    type=fraction,
    default=0.4,
    help="the training step's model FLOPs utilization, for that share "
    "(default 0.4)",
  )
  parser.add_argument(
    "--dump-hlo",
    metavar="DIR",
    default=None,
    help="write each mode's compiled (scheduled) HLO to DIR/<mode>.hlo",
  )
  args = parser.parse_args(argv)
  if args.quick:
    args.model = "tiny"
  if args.fsdp == "layers" and not args.stacked:
    parser.error(
      "argument --fsdp: layers shards a stack's layer axis: add --stacked"
    )
  dp, tp = args.mesh
  if (
    args.model not in MODELS
  ):  # a tree of its own: the Llama flags do not apply
    for flag, given in (
      ("--stacked", args.stacked),
      ("--layers", args.layers is not None),
      ("--fsdp", args.fsdp != "none"),
    ):
      if given:
        parser.error(
          f"argument {flag}: applies to the Llama models {sorted(MODELS)}, "
          f"not to --model {args.model} (whose tree says its own layout)"
        )
  try:
    if args.model.endswith(".json"):
      flat = read_tree(args.model)
    elif args.model.startswith("deepseek-v3"):
      layers = args.model.partition(":")[2]
      flat = deepseek_tree(int(layers) if layers else None)
    elif args.model in MODELS:
      flat = llama_tree(args.model, args.stacked, args.layers, args.fsdp)
    else:
      flat = tree_from_function(args.model)
  except ValueError as error:
    parser.error(f"argument --model: {error}")
  try:
    mesh = make_mesh(args.target, dp, tp)
  except ValueError as error:
    parser.error(f"argument --mesh: {error}")
  except RuntimeError as error:  # no compiler for the target's devices
    extra = "gpu-compile" if args.target in GPU_TARGETS else "tpu-compile"
    parser.error(
      f"argument --target: {args.target} needs its compiler: pip install -e "
      f'".[{extra}]" (which pins the plugin to the installed jax; Python '
      f">= 3.12 for jax 0.12) ({str(error).splitlines()[0]})"
    )
  params = abstract_tree(flat, mesh, DTYPES[args.dtype])
  modes = args.modes
  if dp * tp == 1:  # one device: no tensor parallelism to choose
    modes = ["unsharded"] + [m for m in modes if m == "optax.contrib.muon"]
  if "muon_bp" in modes:  # its average step is read from its two programs
    modes = list(dict.fromkeys([*modes, "blockwise", "allgather"]))
  records = {}
  if args.momentum != "param" or args.offload:  # options of om.muon only
    modes = [m for m in modes if m != "optax.contrib.muon"]
  if args.momentum == "8bit":  # Dion2's and Dion's momenta: float sums
    modes = [m for m in modes if m not in FLOAT_SUM_MODES]
  if not modes:
    parser.error(
      f"argument --modes: none of {args.modes} takes --momentum "
      f"{args.momentum}{' --offload' if args.offload else ''} "
      f"(optax.contrib.muon takes neither, {list(FLOAT_SUM_MODES)} keep a "
      "float momentum sum); add an om.muon mode"
    )
  built = optimizers(
    flat,
    mesh,
    modes,
    args.memory_budget,
    args.momentum,
    args.offload,
    args.precision,
    args.distribute_over,
  )
  depth = MODELS[args.model][5] if args.model in MODELS else None
  if args.model.startswith("deepseek-v3"):
    depth = int(args.model.partition(":")[2] or DEEPSEEK_V3[5])
  compiler = compiler_versions(mesh)
  for name, tx in built.items():
    record = {
      "benchmark": "at_scale",
      "model": args.model,
      "stacked": args.stacked,
      "fsdp": args.fsdp,
      "distribute_over": args.distribute_over,
      "layers": args.layers or depth,
      "mesh": f"{dp}x{tp}",
      "dtype": args.dtype,
      "target": args.target,
      "memory_budget": args.memory_budget,
      "momentum": args.momentum,
      "offload": args.offload,
      "donate": args.donate,
      "mode": name,
      "part": part_of(args.target),
      "precision": args.precision,
      "compiler": compiler,
      **measure(
        tx,
        params,
        name,
        args.offload,
        args.donate,
        rates_of(mesh),
        args.precision,
        args.dump_hlo,
      ),
    }
    add_modeled_time(record, flat, mesh, args)
    add_step_share(record, flat, mesh, args)
    records[name] = record
  add_muon_bp_average(records)
  base = records.get("duplicated", {}).get("collective_total_gib")
  for record in records.values():
    total = record.get("collective_total_gib")
    if base and total is not None:
      record["bytes_over_duplicated"] = total / base
    if args.json:
      emit(record)
  if not args.json:
    print(table(records, part_of(args.target)))
    built_by = ", ".join(f"{name} {v}" for name, v in compiler.items())
    print(f"\nCompiled by {built_by}.")


if __name__ == "__main__":
  main()
