"""Test setup: 8 simulated CPU devices, set before jax is imported."""

import atexit
import contextlib
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the run, shared by the xdist workers
# (they inherit this process's environment) and the scripts tests launch: many
# tests compile the same programs, and a cache hit costs nothing (measured: a
# third of the CPU time of test_config, test_transforms and test_sharding).
# The process that made it removes it; a cache the user set is kept as is.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="optax_muon_tests_jax_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)

import jax  # noqa: E402  (after the flags on purpose)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# The fast tier compiles about four thousand small programs, most of them run
# once: XLA's backend optimizations cost more than they save here (the fast
# tier 4 min 4 s against 5 min 31 s, benchmarks/fast_tier.py). Set in this
# process and its xdist workers only: the example runs, benchmark scripts and
# processes the tests launch compile as users' programs do, and so do the
# tests marked `xla_optimized` (the fixture below).
# JAX_DISABLE_MOST_OPTIMIZATIONS=0 runs every test optimized.
if "JAX_DISABLE_MOST_OPTIMIZATIONS" not in os.environ:
  jax.config.update("jax_disable_most_optimizations", True)
UNOPTIMIZED = jax.config.values["jax_disable_most_optimizations"]

ROOT = pathlib.Path(__file__).parents[1]


def benchmark_env() -> dict:
  """The environment a benchmark runs in: without the tests' XLA_FLAGS (it
  compiles as users' programs do), with ``PYTHON`` for the shell scripts."""
  return dict(os.environ, XLA_FLAGS="", PYTHON=sys.executable)


def call_benchmark(
  script: str, *args: str, cwd=ROOT, timeout: int = 600
) -> subprocess.CompletedProcess:
  """``benchmarks/<script>`` with ``args`` run in ``cwd``, as it exited."""
  return subprocess.run(
    [sys.executable, str(ROOT / "benchmarks" / script), *args],
    capture_output=True,
    text=True,
    cwd=cwd,
    timeout=timeout,
    env=benchmark_env(),
  )


def run_benchmark(script: str, *args: str, timeout: int = 600) -> str:
  """``benchmarks/<script>`` with ``args``; its stdout, once it exited 0."""
  result = call_benchmark(script, *args, timeout=timeout)
  assert result.returncode == 0, result.stderr[-2000:]
  return result.stdout


DATA = ROOT / "tests" / "data"


def gaussian(shape, seed=0, dtype=jnp.float32):
  """Standard normal entries (complex: real and imaginary parts each), bit
  for bit ``jax.random.normal(jax.random.key(seed), shape, dtype)``."""
  if jnp.issubdtype(dtype, jnp.complexfloating):
    real, imag = jax.random.split(jax.random.key(seed))
    parts = np.empty(shape, np.complex64)
    parts.real, parts.imag = normal(real, shape), normal(imag, shape)
    return jnp.asarray(parts.astype(dtype))
  return normal(jax.random.key(seed), shape, dtype)


def update_collectives(tx, tree, specs, mesh, optimized=True) -> dict:
  """Bytes per collective kind of ``tx.update`` on abstract copies of
  ``tree`` sharded as ``specs`` over ``mesh``: of the compiled program, or
  of the one JAX asks for (XLA:CPU widens a bfloat16 all-reduce to
  float32; the TPU and GPU compilers keep it)."""
  import sys  # noqa: PLC0415

  sys.path.insert(0, str(ROOT / "benchmarks"))
  import _hlo  # noqa: PLC0415  (the benchmarks' HLO byte count)
  from jax.sharding import NamedSharding  # noqa: PLC0415

  tree = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(mesh, s)
    ),
    tree,
    specs,
  )
  state = jax.eval_shape(tx.init, tree)
  lowered = jax.jit(tx.update).lower(tree, state, tree)
  if not optimized:
    return _hlo.collective_bytes(lowered.compiler_ir("hlo").as_hlo_text())
  return _hlo.collective_bytes(lowered.compile().as_text())


@contextlib.contextmanager
def xla_optimized():
  """Programs compiled inside are compiled with XLA's optimizations, as
  users' programs are (conftest.py turns them off for the tests)."""
  before = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", False)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture(autouse=True)
def _xla_optimized_marker(request):
  """A test marked ``xla_optimized`` runs under ``xla_optimized()``: its
  tolerance holds for the rounding XLA's optimizations give (LLVM fuses
  multiply-adds) and not for the unoptimized one. jax keeps the executable a
  function got first (``jax.random.normal`` called eagerly is one per
  shape), so what a marked test compares must be compiled in the test; its
  inputs, from ``normal``, are optimized whatever the test."""
  if request.node.get_closest_marker("xla_optimized") is None:
    yield
    return
  with xla_optimized():
    yield


_NORMALS: dict = {}  # the long draws, by key, dtype and length
_LONG_NORMALS: dict = {}  # their programs, compiled optimized


def normal(key, shape, dtype=jnp.float32) -> jax.Array:
  """``jax.random.normal(key, shape, dtype)`` as users' programs compile it
  (optimized), bit for bit, without compiling a program per shape (~1 s each
  on a CPU; the tests use hundreds of shapes). Threefry draws are
  partitionable (jax's default since 0.5): entry ``i`` does not depend on the
  draw's shape, so each draw is a prefix of one long draw from the same key,
  made once."""
  size = math.prod(shape)
  if not jax.config.jax_threefry_partitionable:
    return jax.random.normal(key, shape, dtype)
  long = max(1 << 16, 1 << max(size - 1, 0).bit_length())
  data = (
    jax.random.key_data(key)
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    else key
  )
  name = (np.asarray(data).tobytes(), jnp.dtype(dtype).name, long)
  if name not in _NORMALS:
    _NORMALS[name] = np.asarray(_long_normal(key, long, dtype))
  return jnp.asarray(_NORMALS[name][:size].reshape(shape))


def _long_normal(key, long, dtype) -> jax.Array:
  """``jax.random.normal(key, (long,), dtype)`` compiled as users' programs
  are (jax.random keeps one executable per shape, so the draw's bits would
  otherwise depend on whether a marked test made it first)."""
  program = (long, dtype, key.dtype, key.shape)
  if program not in _LONG_NORMALS:
    with xla_optimized():
      _LONG_NORMALS[program] = (
        jax.jit(lambda k: jax.random.normal(k, (long,), dtype))
        .lower(key)
        .compile()
      )
  return _LONG_NORMALS[program](key)


def tp_mlp(rngs):
  """A two-layer Flax NNX MLP, 16 -> 64 -> 16: ``up``'s kernel column- and
  ``down``'s row-parallel over ``model`` (``nnx.with_partitioning``)."""
  from flax import nnx

  class TpMlp(nnx.Module):
    def __init__(self, rngs):
      init = nnx.initializers.lecun_normal()
      self.up = nnx.Linear(
        16,
        64,
        kernel_init=nnx.with_partitioning(init, (None, "model")),
        use_bias=False,
        rngs=rngs,
      )
      self.down = nnx.Linear(
        64,
        16,
        kernel_init=nnx.with_partitioning(init, ("model", None)),
        use_bias=False,
        rngs=rngs,
      )

    def __call__(self, x):
      return self.down(jax.nn.relu(self.up(x)))

  return TpMlp(rngs)


def nnx_losses(model, tx, x, steps=3) -> list[float]:
  """The reconstruction losses of ``steps`` jitted ``nnx.Optimizer`` steps
  of ``model`` on ``x`` (a mesh, if any, set by the caller)."""
  from flax import nnx

  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - x) ** 2))(model)
    optimizer.update(model, grads)
    return loss

  return [float(step(model, optimizer)) for _ in range(steps)]


def polar(x):
  """The polar factor ``U Vᴴ`` of each matrix of ``x`` (float64 SVD)."""
  x = np.asarray(x)
  x = x.astype(np.complex128 if np.iscomplexobj(x) else np.float64)
  u, _, vh = np.linalg.svd(x, full_matrices=False)
  return u @ vh


def det(m, n, a, b, c):
  """The reference's deterministic matrix: float32(sin(a i + b j + c i j))."""
  i = np.arange(m, dtype=np.float64)[:, None]
  j = np.arange(n, dtype=np.float64)[None, :]
  return np.sin(a * i + b * j + c * i * j).astype(np.float32)


def close_to_max(got, want, rtol=1e-5):
  """``got`` equals ``want`` to ``rtol`` of ``want``'s largest magnitude
  (how the EO-family parity tests compare; ``got`` reshaped to ``want``)."""
  want = np.asarray(want, np.float32)
  np.testing.assert_allclose(
    np.asarray(got).reshape(want.shape),
    want,
    atol=rtol * np.abs(want).max(),
    rtol=0,
  )


@pytest.fixture(scope="session")
def golden():
  return json.loads((DATA / "eo_golden.json").read_text())


@pytest.fixture(scope="session")
def reference_coefficients():
  return json.loads((DATA / "coefficients.json").read_text())


# -- the EO-family parity tests -----------------------------------------------

EO_ORIENTATIONS = ("torch", "flax")


def eo_orientation(orientation):
  """``(turn, dimension_numbers)`` for a weight EO keeps as torch ``(out,
  in)``: ``turn`` maps it to the tested orientation (a Flax kernel is its
  transpose) and back, and the dimension numbers name that orientation's
  fan-in axis."""
  import optax_muon as om  # noqa: PLC0415  (conftest loads before the tests)

  if orientation == "torch":
    return np.asarray, om.MuonDimensionNumbers((1,), (0,))
  return (
    lambda x: np.swapaxes(np.asarray(x), -1, -2),
    om.MuonDimensionNumbers((0,), (1,)),
  )


def eo_steps(tx, case, inputs, turn):
  """Runs ``tx`` (jitted) over an EO case's steps from its recorded weight
  ``W0`` and per-step gradients in ``inputs``, turned to the tested
  orientation; yields ``(k, weight_before, gradient, update, state,
  weight_after)`` after each step, arrays of the one leaf ``"w"``."""
  import optax  # noqa: PLC0415

  params = {"w": jnp.asarray(turn(inputs[f"{case['input']}/W0"]))}
  grads = inputs[f"{case['input']}/grads"]
  state = tx.init(params)
  update = jax.jit(tx.update)
  for k in range(case["n_steps"]):
    before, gradient = params["w"], jnp.asarray(turn(grads[k]))
    updates, state = update({"w": gradient}, state, params)
    params = optax.apply_updates(params, updates)
    yield k, before, gradient, updates["w"], state, params["w"]


# -- the tiers -------------------------------------------------------------------
# ``-m "not integration and not slow"`` (the fast tier) runs every code path
# once. ``integration`` also marks, here, the cases that run a path the fast
# tier has already run; the README's command (and CI, on both jax ends) runs
# them all but those also marked ``repeat``:
# - in the default run: a case that differs from an earlier one of the same
#   test only by its mesh (the tp modes run the same code on (8,), (2, 4) and
#   (4, 2): per-test branch coverage shows no line or branch that only a
#   second mesh reaches, but a second mesh shows a wrong axis size), and the
#   un-jitted twin of a chex variant test (what a user's eager call runs);
# - ``repeat``, on request (``-m repeat``): a parametrized case whose every
#   parameter value (or every part of its id: a recorded case's method,
#   variant, shape and orientation) earlier cases of the same test have had
#   (a further shape for the same schedule), and the cases tests/repeats.txt
#   lists (heavy cases that reach no line or branch of the library the rest
#   of the fast tier does not: tests/find_repeats.py).

# pyproject.toml's `timeout` (5 minutes) is for the cases that start
# processes or training runs (marked `integration` by their tests); the slow
# ones get 30. The rest run inside the worker in seconds (13 s the longest on
# 2 cores, 2026-12-08), and get 2 minutes: a worker stuck in XLA's native
# code (seen in CI, and here on 2026-12-08, in a case that then passed in
# 1.5 s) holds its cases back 2 minutes, not 5.
SLOW_TIMEOUT_SECONDS = 1800
IN_WORKER_TIMEOUT_SECONDS = 120

_MESH_PARAMETERS = ("mesh_shape",)
_REPEATS = frozenset(
  line.strip()
  for line in (ROOT / "tests" / "repeats.txt").read_text().splitlines()
  if line.strip() and not line.startswith("#")
)


def _has_a_mesh(item) -> bool:
  callspec = getattr(item, "callspec", None)
  return any(name in callspec.params for name in _MESH_PARAMETERS)


def _parameter_values(item) -> tuple[set, set] | None:
  """The case's parameter values and id parts, its mesh left out; None for
  an unparametrized test."""
  callspec = getattr(item, "callspec", None)
  if callspec is None:
    return None
  values = {
    (name, repr(value))
    for name, value in callspec.params.items()
    if name not in _MESH_PARAMETERS
  }
  parts = set(re.split(r"[-/]", callspec.id)) - {
    f"{name}{i}" for name in _MESH_PARAMETERS for i in range(16)
  }
  return values, parts


def _check_repeats_exist(config, items):
  """A listed repeat that is gone (renamed, re-parametrized) is an error,
  not a case silently back in the fast tier; checked when whole files are
  collected (a node id on the command line collects only its cases)."""
  if any("::" in arg for arg in config.args):
    return
  collected = {item.nodeid for item in items}
  files = {nodeid.split("::", 1)[0] for nodeid in collected}
  missing = sorted(
    test for test in _REPEATS - collected if test.split("::", 1)[0] in files
  )
  if missing:
    raise pytest.UsageError(
      "tests/repeats.txt lists cases that are not collected (update it with"
      f" tests/find_repeats.py): {missing}"
    )


def _start_the_long_cases_first(items, long_cases) -> None:
  """The cases that start processes or training runs first, each file's
  order kept: xdist hands each worker its cases ahead, so a run of minutes
  late in the order kept one worker busy while the other had nothing left
  (the newest jax's run: test_maxtext.py's 197 s ahead of
  test_multiprocess.py's 71 s on one worker, the other idle for the last
  67 s)."""
  items.sort(key=lambda item: item.nodeid not in long_cases)


def _set_timeouts(items, long_cases) -> None:
  for item in items:
    if item.get_closest_marker("timeout"):
      continue  # the test's own
    if item.get_closest_marker("slow"):
      item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_SECONDS))
    elif item.nodeid not in long_cases:
      item.add_marker(pytest.mark.timeout(IN_WORKER_TIMEOUT_SECONDS))


def _leave_fast_tier(item) -> None:
  """Out of the fast tier: a case whose lines and branches the fast tier
  reaches already, run by the README's command."""
  item.add_marker(pytest.mark.integration)


def _mark_repeat(item) -> None:
  """Out of the fast tier and out of the README's command (``repeat``, run
  by ``-m repeat``): a case that repeats what others run with the same mesh."""
  _leave_fast_tier(item)
  item.add_marker(pytest.mark.repeat)


@pytest.hookimpl(tryfirst=True)  # before -k and -m deselect any case
def pytest_collection_modifyitems(config, items):
  _check_repeats_exist(config, items)
  # marked by their tests: they start processes or training runs
  long_cases = {
    item.nodeid
    for item in items
    if item.get_closest_marker("integration") or item.get_closest_marker("slow")
  }
  _start_the_long_cases_first(items, long_cases)
  seen: dict = {}
  for item in items:
    if item.nodeid in long_cases:
      continue
    if item.name.endswith("__without_jit"):
      _leave_fast_tier(item)
      continue
    case = _parameter_values(item)
    if case is None:
      continue
    values, parts = case
    test = (item.path, item.originalname)
    if test in seen:
      covered_values, covered_parts, cases = seen[test]
      if frozenset(values) in cases and _has_a_mesh(item):
        _leave_fast_tier(item)  # only its mesh is new
      elif values <= covered_values or parts <= covered_parts:
        _mark_repeat(item)
    else:
      covered_values, covered_parts, cases = seen[test] = (set(), set(), set())
    covered_values |= values
    covered_parts |= parts
    cases.add(frozenset(values))
  for item in items:  # after the rules above, which the list was made under
    if item.nodeid in _REPEATS:
      _mark_repeat(item)
  _set_timeouts(items, long_cases)
