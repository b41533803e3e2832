"""optax_muon.compat against optax.contrib.muon 0.2.8: signatures, numbers, state.

The oracle is optax itself, pinned in the test extra.
"""

import importlib
import importlib.util
import inspect
import unittest
from unittest import mock

import chex
import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import orbax.checkpoint as ocp
import pytest
from hypothesis import strategies as st
from optax.contrib import MuonDimensionNumbers as Dims

import optax_muon as om
from conftest import gaussian
from optax_muon import compat
from optax_muon._src.optimizers import optax_compat

OPTAX_MUON = importlib.import_module("optax.contrib._muon")
PUBLIC = (
  "muon",
  "scale_by_muon",
  "scale_by_shape",
  "orthogonalize_via_newton_schulz",
)
EXTRAS = {
  "sharding": None,
  "method": "standard",
  "precision": "high",
  "memory_budget": None,
  "state_memory_kind": None,
}


def test_pinned_optax_is_the_mirrored_one():
  assert optax.__version__ == optax_compat.OPTAX_VERSION


@pytest.mark.parametrize("name", PUBLIC)
def test_signature_is_optax_then_keyword_only_extras(name):
  theirs = list(
    inspect.signature(getattr(OPTAX_MUON, name)).parameters.values()
  )
  ours = list(inspect.signature(getattr(compat, name)).parameters.values())
  strip = lambda ps: [(p.name, p.kind, p.default) for p in ps]
  assert strip(ours[: len(theirs)]) == strip(theirs)
  for extra in ours[len(theirs) :]:
    assert extra.kind is inspect.Parameter.KEYWORD_ONLY
    assert EXTRAS[extra.name] == extra.default


def test_state_and_dimension_number_types_are_optax_own():
  assert compat.MuonState is optax.contrib.MuonState
  assert compat.MuonDimensionNumbers is optax.contrib.MuonDimensionNumbers


# -- optax's own test module, pointed at compat -------------------------------


def _optax_muon_tests():
  """optax/contrib/_muon_test.py, imported with its ``_muon`` being compat."""
  spec = importlib.util.find_spec("optax.contrib._muon_test")
  module = importlib.util.module_from_spec(spec)
  with mock.patch.object(optax.contrib, "_muon", compat):
    spec.loader.exec_module(module)
  assert module._muon is compat  # pylint: disable=protected-access
  return module


# These call optax's private reshape helper directly, not the public API.
PRIVATE_HELPER_TESTS = ("test_reshape_inverse",)


class TestOptaxMuonSuiteOnCompat(_optax_muon_tests().MuonTest):
  """Every test of optax's Muon module, run against compat."""


for _name in dir(TestOptaxMuonSuiteOnCompat):
  if _name.startswith(PRIVATE_HELPER_TESTS):
    setattr(
      TestOptaxMuonSuiteOnCompat,
      _name,
      unittest.skip("calls optax's private _compute_muon_reshape")(
        getattr(TestOptaxMuonSuiteOnCompat, _name)
      ),
    )


# -- the same numbers ---------------------------------------------------------


def _relative(a, b):
  return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def _trees(draw):
  """A random tree: matrices wide and tall, a stacked 3-D and a 4-D leaf with
  dimension numbers, a vector (Adam) and maybe a complex matrix."""
  shapes = st.sampled_from([(8, 24), (24, 8), (16, 16), (12, 40)])
  params, dims = {}, {}
  for i in range(draw(st.integers(1, 3))):
    params[f"w{i}"], dims[f"w{i}"] = draw(shapes), Dims()
  if draw(st.booleans()):
    params["stack"], dims["stack"] = (3, 8, 20), Dims(1, 2)
  if draw(st.booleans()):
    params["conv"], dims["conv"] = (2, 3, 8, 5), Dims((2,), (0, 3))
  params["bias"], dims["bias"] = (7,), None
  complex_leaf = draw(st.booleans())
  if complex_leaf:
    params["c"], dims["c"] = (10, 6), Dims()
  seed = draw(st.integers(0, 1000))
  tree = {
    k: gaussian(s, seed + i, jnp.complex64 if k == "c" else jnp.float32)
    for i, (k, s) in enumerate(sorted(params.items()))
  }
  return tree, dims, complex_leaf


@st.composite
def _cases(draw):
  tree, dims, complex_leaf = _trees(draw)
  routing = draw(st.sampled_from(["tree", "callable", "none"]))
  settings = dict(
    learning_rate=draw(
      st.sampled_from([0.02, optax.linear_schedule(0.05, 0.0, 10)])
    ),
    ns_coeffs=draw(
      st.sampled_from(
        [
          "standard",
          "dion",
          (3.0, -3.2, 1.2),
          ((4.0, -6.8, 2.9), (3.4, -4.7, 2.0), (2.9, -3.1, 1.2)),
        ]
      )
    ),
    ns_steps=draw(st.integers(3, 6)),
    beta=draw(st.sampled_from([0.9, 0.95])),
    eps=draw(st.sampled_from([1e-8, 1e-6])),
    weight_decay=draw(st.sampled_from([0.0, 0.1])),
    nesterov=draw(st.booleans()),
    adaptive=draw(st.booleans()),
    preconditioning=draw(st.sampled_from(optax_compat.PRECONDITIONINGS)),
    adam_b1=draw(st.sampled_from([0.8, 0.9])),
    adam_b2=draw(st.sampled_from([0.99, 0.999])),
    adam_eps_root=draw(st.sampled_from([0.0, 1e-8])),
    adam_weight_decay=draw(st.sampled_from([0.0, 0.01])),
    adam_learning_rate=draw(st.sampled_from([None, 0.003])),
    consistent_rms=draw(st.sampled_from([None, 0.2])),
    muon_weight_dimension_numbers={
      "tree": dims,
      "none": None,
      "callable": lambda p: dims,
    }[routing],
  )
  if draw(st.booleans()):
    settings["weight_decay_mask"] = {k: k != "w0" for k in tree}
  if not complex_leaf and draw(st.booleans()):
    settings["mu_dtype"] = jnp.bfloat16  # optax drops the imaginary part
  if settings["preconditioning"] == "schatten" and complex_leaf:
    settings["preconditioning"] = "aol"  # optax's Schatten uses X Xᵀ there
  rows = np.asarray(
    optax_compat.NS_COEFFS_PRESETS.get(
      settings["ns_coeffs"], settings["ns_coeffs"]
    )
  )
  if rows.ndim == 2:
    settings["ns_steps"] = max(settings["ns_steps"], len(rows))
  return tree, settings


def _run_both(tree, settings, steps, jit=True):
  theirs, ours = optax.contrib.muon(**settings), compat.muon(**settings)
  s_theirs, s_ours = theirs.init(tree), ours.init(tree)
  chex.assert_trees_all_equal_structs(s_theirs, s_ours)
  chex.assert_trees_all_equal_shapes_and_dtypes(s_theirs, s_ours)
  update_theirs = jax.jit(theirs.update) if jit else theirs.update
  update_ours = jax.jit(ours.update) if jit else ours.update
  worst = 0.0
  for t in range(steps):
    grads = jax.tree.map(lambda x: gaussian(x.shape, 100 + t, x.dtype), tree)
    u_theirs, s_theirs = update_theirs(grads, s_theirs, tree)
    u_ours, s_ours = update_ours(grads, s_ours, tree)
    worst = max(
      [worst] + jax.tree.leaves(jax.tree.map(_relative, u_ours, u_theirs))
    )
    tree = optax.apply_updates(tree, u_theirs)
  return worst


# XLA's fusion choices alone move optax's own jitted update by ~1e-6: its
# Newton–Schulz on a materialized momentum vs on the one it fuses differ by
# 1.02e-6 (one rounding of the norm, amplified ~18× by five steps). So the
# jitted comparison allows 2e-6, and the one below without jit, where each
# operation runs alone, asks for the same bits. Its tree has no two leaves
# that we stack into one batched Newton–Schulz where optax runs them one by
# one: from jax 0.11 on, the CPU's batched matmul of two matrices rounds
# differently from the two matmuls (4e-6 on entries ~20), so stacking changes
# the last bit there (the jitted comparisons above cover stacked trees).
JIT_TOLERANCE = 2e-6


@hypothesis.settings(
  deadline=None,
  max_examples=6,
  derandomize=True,
  suppress_health_check=list(hypothesis.HealthCheck),
)
@pytest.mark.integration
@hypothesis.given(_cases())
def test_random_trees_and_settings_match_optax(case):
  tree, settings = case
  assert _run_both(tree, settings, steps=10) <= JIT_TOLERANCE


@pytest.mark.parametrize(
  "settings",
  [
    dict(nesterov=True, weight_decay=0.1),
    dict(
      nesterov=False,
      adaptive=True,
      preconditioning="spectral",
      ns_coeffs="dion",
    ),
  ],
)
def test_without_jit_the_update_is_optax_bits(settings):
  tree = {
    "w": gaussian((12, 20), 0),
    "t": gaussian((20, 16), 1),
    "s": gaussian((2, 8, 12), 2),
    "b": gaussian((5,), 3),
    "c": gaussian((6, 4), 4, jnp.complex64),
  }
  settings = dict(
    learning_rate=0.02,
    muon_weight_dimension_numbers={
      "w": Dims(),
      "t": Dims(),
      "s": Dims(1, 2),
      "b": None,
      "c": Dims(),
    },
    **settings,
  )
  assert _run_both(tree, settings, steps=3, jit=False) == 0.0


def test_mu_dtype_bfloat16_matches_and_keeps_a_bfloat16_buffer():
  tree = {"w": gaussian((16, 48), 0), "b": gaussian((4,), 1)}
  settings = dict(learning_rate=0.02, mu_dtype=jnp.bfloat16)
  assert _run_both(tree, settings, steps=5) <= JIT_TOLERANCE
  state = compat.muon(**settings).init(tree)
  assert state.inner_states["muon"].inner_state[0].mu["w"].dtype == jnp.bfloat16


def test_mu_dtype_8bit_keeps_int8_muon_momentum_near_optaxs_and_adams_as_is():
  tree = {"w": gaussian((16, 512), 0), "b": gaussian((4,), 1)}
  ours = compat.muon(0.02, mu_dtype=om.QuantizedMomentum())
  theirs = optax.contrib.muon(0.02)
  s_ours, s_theirs = ours.init(tree), theirs.init(tree)
  mu = s_ours.inner_states["muon"].inner_state[0].mu
  assert mu.values["w"].dtype == jnp.int8  # the Muon leaf's momentum: 8 bits
  chex.assert_shape(mu.scales["w"], (16, 2))  # a scale per 256 entries
  # optax.adamw has no 8-bit buffer: Adam's group keeps the param dtype
  adam = s_ours.inner_states["adam"].inner_state[0]
  assert adam.mu["b"].dtype == jnp.float32
  for t in range(3):
    grads = jax.tree.map(lambda x: gaussian(x.shape, 100 + t), tree)
    u_ours, s_ours = jax.jit(ours.update)(grads, s_ours, tree)
    u_theirs, s_theirs = jax.jit(theirs.update)(grads, s_theirs, tree)
  # the momentum is rounded to 1/127 of its block's largest entry: by step
  # 3 the orthogonalized update has moved by 0.3% of its largest entry
  error = jnp.abs(u_ours["w"] - u_theirs["w"]).max()
  assert 0 < error < 0.02 * jnp.abs(u_theirs["w"]).max()
  chex.assert_trees_all_close(u_ours["b"], u_theirs["b"], atol=1e-7)


# -- the same state: an optax checkpoint continues here ----------------------


def test_optax_checkpoint_restores_into_compat_and_continues(tmp_path):
  tree = {
    "w": gaussian((16, 48), 0),
    "t": gaussian((48, 16), 1),
    "b": gaussian((16,), 2),
  }
  grads = lambda t: jax.tree.map(lambda x: gaussian(x.shape, 50 + t), tree)
  theirs = optax.contrib.muon(0.02, weight_decay=0.1, adaptive=True)
  ours = compat.muon(0.02, weight_decay=0.1, adaptive=True)

  def run(tx, params, state, steps):
    for t in steps:
      updates, state = jax.jit(tx.update)(grads(t), state, params)
      params = optax.apply_updates(params, updates)
    return params, state

  reference, _ = run(theirs, tree, theirs.init(tree), range(10))
  half, state = run(theirs, tree, theirs.init(tree), range(5))
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "step5", {"params": half, "opt_state": state})
    checkpointer.wait_until_finished()
    target = {"params": tree, "opt_state": ours.init(tree)}
    restored = checkpointer.restore(
      tmp_path / "step5", jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    )
  chex.assert_trees_all_equal(restored["opt_state"], state)
  resumed, _ = run(
    ours, restored["params"], restored["opt_state"], range(5, 10)
  )
  for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(reference)):
    assert _relative(a, b) <= 1e-6


# -- what compat adds ---------------------------------------------------------


def test_three_dimensional_leaf_without_dimension_numbers_fails_at_init():
  tx = compat.scale_by_muon()
  with pytest.raises(ValueError, match=r"\['w'\].*weight_dimension_numbers"):
    tx.init({"w": jnp.zeros((2, 4, 4))})


def test_unknown_preset_and_too_many_rows_fail_at_build():
  with pytest.raises(ValueError, match="ns_coeffs='muon'.*'dion', 'standard'"):
    compat.muon(0.1, ns_coeffs="muon")
  with pytest.raises(ValueError, match="5 rows, more than ns_steps=3"):
    compat.muon(0.1, ns_coeffs="dion", ns_steps=3)
  with pytest.raises(ValueError, match="preconditioning='polar'"):
    compat.muon(0.1, preconditioning="polar")


def test_gram_method_gives_the_standard_polynomial():
  tree = {"w": gaussian((16, 64), 0), "t": gaussian((96, 24), 1)}
  standard = compat.muon(0.02, ns_coeffs="dion")
  gram = compat.muon(0.02, ns_coeffs="dion", method="gram")
  a, _ = standard.update(tree, standard.init(tree), tree)
  b, _ = gram.update(tree, gram.init(tree), tree)
  for x, y in zip(jax.tree.leaves(b), jax.tree.leaves(a)):
    assert _relative(x, y) <= 2e-5


def test_tensor_parallel_through_compat_equals_unsharded():
  mesh = jax.make_mesh(
    (2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )
  P = jax.sharding.PartitionSpec
  specs = {
    "qkv": P(None, "model"),
    "out": P("model", None),
    "up": P(None, "model"),
    "b": P(),
  }
  tree = {
    "qkv": gaussian((32, 96), 0),
    "out": gaussian((32, 32), 1),
    "up": gaussian((32, 128), 2),
    "b": gaussian((32,), 3),
  }
  tree = jax.tree.map(
    lambda x, s: jax.device_put(x, jax.sharding.NamedSharding(mesh, s)),
    tree,
    specs,
  )
  plain = compat.muon(0.02)
  expected, _ = jax.jit(plain.update)(tree, plain.init(tree), tree)
  for mode in om.TensorParallel.MODES:
    sharded = compat.muon(
      0.02, sharding=om.TensorParallel(mesh, "model", mode, specs=specs)
    )
    update = jax.jit(sharded.update)
    state = sharded.init(tree)
    # the leaves enter our shard_map, not GSPMD's gathers
    assert "manual_computation" in update.lower(tree, state, tree).as_text()
    got, _ = update(tree, state, tree)
    for name in ("qkv", "out", "up", "b"):
      if mode == "blockwise" and name != "b":
        continue  # blockwise orthogonalizes each shard: another update
      assert _relative(got[name], expected[name]) <= 1e-5, (mode, name)


def test_dimension_numbers_are_read_by_path_against_nnx_params():
  # MaxText hands optax a plain dict of dimension numbers for its NNX
  # params; optax needs one pytree structure, om.muon and compat read paths
  from flax import nnx

  model = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
  state = nnx.state(model, nnx.Param)
  muon_kernel = {
    "kernel": compat.MuonDimensionNumbers(reduction_axis=0, output_axis=1),
    "bias": None,
  }
  keys = iter(jax.random.split(jax.random.key(4), 2))
  grads = jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape), state)
  plain = state.to_pure_dict()
  plain_grads = grads.to_pure_dict()

  def update(dims, grads, params):
    tx = compat.muon(0.02, muon_weight_dimension_numbers=dims)
    return tx.update(grads, tx.init(params), params)[0]

  got = update(muon_kernel, grads, state).to_pure_dict()
  want = update(muon_kernel, plain_grads, plain)
  chex.assert_trees_all_close(got, want, atol=0)
  # and the kernel was Muon's, not Adam's
  adam = update({"kernel": None, "bias": None}, plain_grads, plain)
  assert np.abs(np.asarray(want["kernel"] - adam["kernel"])).max() > 1e-3
