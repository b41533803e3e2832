"""The suite's own helpers (conftest.py) do what they say."""

import subprocess
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conftest
from conftest import ROOT
from conftest import UNOPTIMIZED
from conftest import gaussian
from conftest import normal
from conftest import xla_optimized


def random_normal(key, shape, dtype=jnp.float32):
  """``jax.random.normal`` in a program of its own, compiled under this
  test's setting (jax.random keeps the executable of the first call per
  shape, which another test in the worker may have compiled unoptimized)."""
  return jax.jit(lambda k: jax.random.normal(k, shape, dtype))(key)


@pytest.mark.parametrize(
  "shape, seed, dtype",
  [
    ((), 0, jnp.float32),
    ((7,), 3, jnp.float32),
    ((3, 7, 5), 5, jnp.float32),
    ((64, 33), 1, jnp.bfloat16),
    ((300, 257), 2, jnp.float32),  # past the shortest cached draw
    ((4, 6), 4, jnp.complex64),
  ],
)
@pytest.mark.xla_optimized  # the draws users' programs make
def test_gaussian_is_jax_random_normal_bit_for_bit(shape, seed, dtype):
  got = gaussian(shape, seed, dtype)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    real, imag = jax.random.split(jax.random.key(seed))
    want = (
      random_normal(real, shape) + 1j * random_normal(imag, shape)
    ).astype(dtype)
  else:
    want = random_normal(jax.random.key(seed), shape, dtype)
  assert got.shape == want.shape and got.dtype == want.dtype
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize(
  "key",
  [jax.random.split(jax.random.key(7))[1], jax.random.PRNGKey(2)],
  ids=["typed_split_key", "raw_prngkey"],
)
@pytest.mark.xla_optimized
def test_normal_is_jax_random_normal_bit_for_bit_for_any_key(key):
  for shape in [(2, 2, 6), (40, 16), (3, 32, 8)]:
    np.testing.assert_array_equal(
      np.asarray(normal(key, shape)),
      np.asarray(random_normal(key, shape)),
    )


def test_find_repeats_keeps_every_path_and_a_case_of_each_test():
  from find_repeats import repeats

  arcs = {  # a test's arcs are its (file, from, to) triples; numbers here
    "t.py::f[a]": {1, 2},  # the only case reaching 2: stays
    "t.py::f[b]": {1},  # reaches only what f[a] does: a repeat
    "t.py::f[c]": {1},  # under the threshold: not judged
    "t.py::g[a]": {3, 4},
    "t.py::g[b]": {3},  # a repeat of g[a]
    "t.py::h[a]": {1},  # h's only case: stays
    "t.py::k": {1},  # not parametrized: stays
    "t.py::m[a]": {5},  # m[a] and m[b] repeat each other: the one judged
    "t.py::m[b]": {5},  # first goes, the other then reaches 5 alone
    "t.py::p[a]": {6},  # so with two tests: p[a] goes, q[a] reaches 6 alone
    "t.py::p[b]": {7},
    "t.py::q[a]": {6},
    "t.py::q[b]": {8},
  }
  seconds = {"t.py::f[a]": 9, "t.py::f[b]": 8, "t.py::f[c]": 1}
  seconds |= {"t.py::g[a]": 7, "t.py::g[b]": 3, "t.py::h[a]": 6}
  seconds |= {"t.py::k": 5, "t.py::m[a]": 4, "t.py::m[b]": 4}
  seconds |= {"t.py::p[a]": 2.5, "t.py::q[a]": 2.2}
  assert repeats(arcs, seconds, min_seconds=2) == [
    "t.py::f[b]",
    "t.py::m[a]",
    "t.py::g[b]",
    "t.py::p[a]",
  ]


class _Case:
  """What conftest's tier rules read of a collected case."""

  def __init__(self, test, ids="", **params):
    self.path, self.originalname = "t.py", test
    self.name = f"{test}[{ids}]" if params else test
    self.nodeid = f"t.py::{self.name}"
    self.callspec = SimpleNamespace(params=params, id=ids) if params else None
    self.markers: dict[str, tuple] = {}  # name: args

  def get_closest_marker(self, name):
    return name if name in self.markers else None

  def add_marker(self, mark):
    self.markers[mark.name] = mark.args


def _tier(markers):
  if "repeat" in markers:
    return "repeat"  # -m repeat only
  return "default" if "integration" in markers else "fast"


def test_the_tiers_the_long_cases_first_and_the_timeouts():
  cases = [
    _Case("f", "mesh_shape0-a", mesh_shape=(8,), p="a"),
    _Case("f", "mesh_shape1-a", mesh_shape=(2, 4), p="a"),  # a second mesh
    _Case("f", "mesh_shape0-b", mesh_shape=(8,), p="b"),
    _Case("g", "a-x", p="a", q="x"),
    _Case("g", "b-y", p="b", q="y"),
    _Case("g", "a-y", p="a", q="y"),  # each value had: a repeat
    _Case("h", "mesh_shape0-a", mesh_shape=(8,), p="a"),
    _Case("h", "mesh_shape0-b", mesh_shape=(8,), p="b"),
    _Case("h", "mesh_shape1-b", mesh_shape=(4, 2), p="b"),  # a second mesh
    _Case("k__without_jit"),  # a chex variant's un-jitted twin
    _Case("m"),  # not parametrized
    _Case("n"),  # starts processes: marked by its test
    _Case("o"),  # an end-to-end run's long version
  ]
  cases[-2].markers["integration"] = ()
  cases[-1].markers["slow"] = ()
  order = [case.nodeid for case in cases]
  conftest.pytest_collection_modifyitems(
    SimpleNamespace(args=["t.py::f"]), cases
  )
  # the long cases first (xdist hands out cases ahead), the rest in order
  assert [case.nodeid for case in cases] == order[-2:] + order[:-2]
  tiers = {case.nodeid: _tier(case.markers) for case in cases}
  assert tiers == {
    "t.py::f[mesh_shape0-a]": "fast",
    "t.py::f[mesh_shape1-a]": "default",
    "t.py::f[mesh_shape0-b]": "fast",
    "t.py::g[a-x]": "fast",
    "t.py::g[b-y]": "fast",
    "t.py::g[a-y]": "repeat",
    "t.py::h[mesh_shape0-a]": "fast",
    "t.py::h[mesh_shape0-b]": "fast",
    "t.py::h[mesh_shape1-b]": "default",
    "t.py::k__without_jit": "default",
    "t.py::m": "fast",
    "t.py::n": "default",
    "t.py::o": "fast",  # -m slow selects it
  }
  # a case that runs in the worker is ended after 2 minutes, one that
  # starts processes after pyproject.toml's 5, a slow one after 30
  timeouts = {case.nodeid: case.markers.get("timeout") for case in cases}
  assert timeouts.pop("t.py::n") is None
  assert timeouts.pop("t.py::o") == (1800,)
  assert set(timeouts.values()) == {(120,)}
  # a repeat is integration too: out of the fast tier as well
  (repeat,) = [case for case in cases if case.nodeid == "t.py::g[a-y]"]
  assert {"repeat", "integration"} <= repeat.markers.keys()


def test_xla_optimized_nests_and_restores_the_setting_it_found():
  setting = lambda: jax.config.values["jax_disable_most_optimizations"]
  assert setting() == UNOPTIMIZED  # this test is not marked
  with xla_optimized():
    with xla_optimized():
      assert setting() is False
    assert setting() is False  # the inner one left the outer's
  assert setting() == UNOPTIMIZED


@pytest.mark.xla_optimized
def test_the_marker_compiles_optimized():
  assert jax.config.values["jax_disable_most_optimizations"] is False


@pytest.mark.integration  # starts a pytest run with two workers
def test_a_hung_test_is_ended_and_rerun_in_a_new_worker(tmp_path):
  """pyproject.toml's timeout ends a test that does not return (as a worker
  blocked in native code does not), and the rerun runs it again."""
  (tmp_path / "test_hang.py").write_text(
    "import pathlib, time\n"
    "def test_hangs_the_first_time():\n"
    f"  flag = pathlib.Path({str(tmp_path / 'ran')!r})\n"
    "  if not flag.exists():\n"
    "    flag.touch()\n"
    "    time.sleep(600)\n"
  )
  run = subprocess.run(
    [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml")]
    + ["--rootdir", str(tmp_path), "-p", "no:cacheprovider", "-n", "2"]
    + ["-o", "timeout=5", str(tmp_path / "test_hang.py")],
    capture_output=True,
    text=True,
    cwd=tmp_path,
    timeout=120,
  )
  assert run.returncode == 0, run.stdout[-2000:]
  assert "1 passed, 1 rerun" in run.stdout, run.stdout[-2000:]
