"""AdaptiveMuon (AdaMuon, NorMuon, NAMO) against NVIDIA emerging-optimizers
0.3.0's own outputs (tests/data/eo_adaptive_muon.*, copied from the shared
reference: torch (out, in) weights, 3 steps each)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_muon as om
from conftest import DATA
from conftest import EO_ORIENTATIONS
from conftest import close_to_max as _close
from conftest import eo_orientation
from conftest import eo_steps
from conftest import gaussian

REFERENCE = json.loads((DATA / "eo_adaptive_muon.json").read_text())
ARRAYS = np.load(DATA / "eo_adaptive_muon.npz")
CASES = {case["id"]: case for case in REFERENCE["cases"]}
MDN = om.MuonDimensionNumbers


def _optimizer(case, dims):
  kw = case["effective_kwargs"]
  return om.adaptive_muon(
    kw["lr"],
    moment2_method=kw["moment2_method"],
    beta2=kw["beta2"],
    moment2_eps=kw["eps"],
    beta=kw["momentum"],
    nesterov=kw["nesterov"],
    coefficients=kw["coefficient_type"],
    steps=kw["num_ns_steps"],
    precision="highest",
    scale_mode=kw["scale_mode"],
    extra_scale_factor=kw["extra_scale_factor"],
    weight_decay=kw["weight_decay"],
    labels={"w": "muon"},
    dimension_numbers={"w": dims},
  )


@pytest.mark.parametrize("orientation", EO_ORIENTATIONS)
@pytest.mark.parametrize(
  "case_id",
  [
    # AdaMuon's tolerance (below) is EO's own float32 error, which XLA's
    # unoptimized rounding exceeds (2.7e-2 at one entry of 48x32)
    pytest.param(
      case_id,
      marks=pytest.mark.xla_optimized
      if CASES[case_id]["method"] == "adamuon"
      else (),
    )
    for case_id in sorted(CASES)
  ],
)
def test_every_adaptive_muon_case_matches_eo(case_id, orientation):
  case = CASES[case_id]
  turn, dims = eo_orientation(orientation)
  kw = case["effective_kwargs"]
  for k, before, gradient, update, state, param in eo_steps(
    _optimizer(case, dims), case, ARRAYS, turn
  ):
    step = lambda key: ARRAYS[f"{case_id}/{k}/{key}"]
    inner = state.inner_states["muon"].inner_state[0]
    momentum = inner.momentum.mu["w"]
    moment2 = inner.moment2.moment2["w"][0][0]
    _close(turn(momentum), step("momentum_buffer"), 1e-5)
    # the state is per matrix in its (fan_in, fan_out) view, EO's torch
    # buffer (out, in), (out, 1) or (1, in) transposed
    _close(moment2, step("moment2_buffer").T, 1e-5)
    direction = (
      (1 - kw["momentum"]) * gradient + kw["momentum"] * momentum
      if (kw["nesterov"])
      else momentum
    )
    _close(turn(om.newton_schulz(direction)), step("orth"), 1e-5)
    # AdaMuon divides by √v where the NS output is ~0: EO's own float32 is
    # 1.6e-2 from float64 there (its checks say so)
    loose = 2e-2 if case["method"] == "adamuon" else 1e-5
    _close(
      turn(-update / kw["lr"] - kw["weight_decay"] * before),
      step("update"),
      loose,
    )
    _close(turn(param), step("param"), loose)


def test_normuon_averages_over_the_shorter_axis():
  # a planted bug (the longer axis) gives a state of the other shape
  for shape, want in (
    ((32, 48), (1, 1, 48)),
    ((48, 32), (1, 48, 1)),
    ((32, 32), (1, 1, 32)),
  ):
    tx = om.scale_by_moment2("normuon", dimension_numbers=MDN((0,), (1,)))
    state = tx.init({"w": jnp.zeros(shape)})
    assert state.moment2["w"][0].shape == want


def test_namo_needs_the_raw_gradients_and_directions():
  tx = om.scale_by_moment2("namo")
  params = {"w": gaussian((8, 16))}
  with pytest.raises(ValueError, match="gradients="):
    tx.update(params, tx.init(params))


def test_stacked_leaves_get_the_rule_per_matrix():
  # two stacked 16x24 matrices: each its own normuon statistics
  grads = {"w": gaussian((2, 16, 24), 3)}
  stacked = om.scale_by_adaptive_muon(
    moment2_method="normuon", dimension_numbers="leading"
  )
  one = om.scale_by_adaptive_muon(moment2_method="normuon")
  got, _ = stacked.update(grads, stacked.init(grads))
  for i in range(2):
    single = {"w": grads["w"][i]}
    want, _ = one.update(single, one.init(single))
    np.testing.assert_allclose(got["w"][i], want["w"], atol=1e-5)


def test_bad_values_raise_naming_the_argument():
  with pytest.raises(ValueError, match="moment2_method"):
    om.adaptive_muon(0.01, moment2_method="bogus")
  with pytest.raises(ValueError, match="beta2"):
    om.adaptive_muon(0.01, beta2=1.5)


def test_config_builds_adaptive_muon_from_verl_overrides():
  config = om.MuonConfig.from_overrides(
    [
      "actor_rollout_ref.actor.optim.optimizer=adaptive_muon",
      "optim.adaptive_muon_moment2_method=normuon",
    ]
  )
  assert (
    config.optimizer,
    config.adaptive_muon_moment2_method,
    config.adaptive_muon_beta2,
    config.adaptive_muon_eps,
  ) == ("adaptive_muon", "normuon", 0.95, 1e-8)
  params = {"w": gaussian((16, 32))}
  tx = config.build(1e-2)
  updates, _ = tx.update(params, tx.init(params), params)
  assert updates["w"].shape == (16, 32)
  with pytest.raises(ValueError) as error:
    om.MuonConfig.from_overrides(
      [
        "optim.optimizer=adaptive_muon",
        "optim.adaptive_muon_moment2_method=bogus",
      ]
    )
  message = str(error.value)
  assert "\n" not in message and "adaptive_muon_moment2_method" in message
  assert "normuon" in message


@pytest.mark.parametrize("method", ["normuon", "namo"])
def test_config_update_rms_is_eos_not_megatrons_double_scaled(method):
  # MCore 0.19's wrapper applies the shape scale twice for normuon and namo
  # (x sqrt(48) on a 48 x 32 weight); EO applies it once, and so do we
  case = CASES[f"adaptive_muon/{method}/base/48x32"]
  kw = case["effective_kwargs"]
  config = om.MuonConfig(
    optimizer="adaptive_muon",
    adaptive_muon_moment2_method=method,
    lr=kw["lr"],
    weight_decay=0.0,
    clip_grad=0.0,
    muon_momentum=kw["momentum"],
    muon_fp32_matmul_prec="highest",
  )
  w = jnp.asarray(ARRAYS["48x32/W0"]).T  # a Flax kernel (in, out)
  g = jnp.asarray(ARRAYS["48x32/grads"][0]).T
  tx = config.build(kw["lr"])
  updates, _ = tx.update({"w": g}, tx.init({"w": w}), {"w": w})
  rms = float(jnp.sqrt(jnp.mean(jnp.square(updates["w"] / kw["lr"]))))
  eo = ARRAYS[f"{case['id']}/0/update"]
  eo_rms = float(np.sqrt(np.mean(np.square(eo))))
  assert rms == pytest.approx(eo_rms, rel=1e-4)
  assert rms != pytest.approx(eo_rms * np.sqrt(48), rel=0.5)


# -- sharded: Newton–Schulz in the tp mode, the second moment under GSPMD -----


# each method on one mesh by default, and each mesh once; -m slow: all nine
@pytest.mark.parametrize(
  "method, mesh_shape",
  [
    pytest.param(
      method,
      mesh_shape,
      marks=()
      if (method, mesh_shape)
      in (("adamuon", (8,)), ("normuon", (2, 4)), ("namo", (4, 2)))
      else pytest.mark.slow,
    )
    for method in ("adamuon", "normuon", "namo")
    for mesh_shape in ((8,), (2, 4), (4, 2))
  ],
)
def test_exact_tp_modes_equal_the_unsharded_update(method, mesh_shape):
  from jax.sharding import AxisType
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  names = ("model",) if len(mesh_shape) == 1 else ("data", "model")
  mesh = jax.make_mesh(
    mesh_shape, names, axis_types=(AxisType.Explicit,) * len(mesh_shape)
  )
  params = {
    "wide": gaussian((32, 64), 1),
    "tall": gaussian((64, 32), 2),
    "stacked": gaussian((2, 32, 48), 3),
  }
  specs = {
    "wide": P(None, "model"),
    "tall": P("model", None),
    "stacked": P(None, None, "model"),
  }
  reference = om.scale_by_adaptive_muon(
    moment2_method=method, dimension_numbers="leading"
  )
  expected = params
  state = reference.init(params)
  for _ in range(2):
    expected, state = reference.update(params, state)
  for mode in ("duplicated", "distributed", "allgather"):
    tx = om.scale_by_adaptive_muon(
      moment2_method=method,
      dimension_numbers="leading",
      sharding=om.TensorParallel(mesh, mode=mode),
    )
    sharded = jax.tree.map(
      lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs
    )
    with jax.set_mesh(mesh):
      state = tx.init(sharded)
      step = jax.jit(tx.update)
      for _ in range(2):
        got, state = step(sharded, state)
    for name, spec in specs.items():
      assert got[name].sharding.spec == spec, (mode, name)
      # AdaMuon divides by √v where the NS output is ~0 (see above)
      tol = 2e-2 if method == "adamuon" else 1e-5
      np.testing.assert_allclose(
        got[name],
        expected[name],
        err_msg=f"{mode} {name}",
        atol=tol * float(jnp.abs(expected[name]).max()),
      )


@pytest.mark.parametrize("method", ["adamuon", "normuon", "namo"])
def test_the_sharded_second_moment_starts_as_the_update_leaves_it(method):
  # init gives the second moment the sharding update returns: split like
  # its parameter, not a replicated copy of it, so a 70B state is not
  # materialized whole at init and the jitted update compiles once.
  from jax.sharding import AxisType
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh(
    (2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2
  )
  params = {"wide": gaussian((32, 64), 1), "tall": gaussian((64, 32), 2)}
  specs = {"wide": P(None, "model"), "tall": P("model", None)}
  sharded = jax.tree.map(
    lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs
  )
  tx = om.scale_by_adaptive_muon(
    moment2_method=method,
    sharding=om.TensorParallel(mesh, mode="distributed"),
  )
  with jax.set_mesh(mesh):
    state = tx.init(sharded)
    step = jax.jit(tx.update)
    _, after = step(sharded, state)
    step(sharded, after)
  for (path, start), end in zip(
    jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(after)
  ):
    assert start.sharding == end.sharding, jax.tree_util.keystr(path)
  assert step._cache_size() == 1
  if method == "adamuon":  # elementwise: a quarter of each on each device
    for moment in jax.tree.leaves(state.moment2):
      assert moment.addressable_shards[0].data.size == moment.size // 4


def _collectives(tx, mesh, params, specs) -> dict:
  import re

  from jax.sharding import NamedSharding

  sharded = jax.tree.map(
    lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs
  )
  with jax.set_mesh(mesh):
    hlo = (
      jax.jit(tx.update).lower(sharded, tx.init(sharded)).compile().as_text()
    )
  return {
    name: len(re.findall(rf" {name}(?:-start)?\(", hlo))
    for name in (
      "all-gather",
      "all-reduce",
      "all-to-all",
      "collective-permute",
      "reduce-scatter",
    )
  }


@pytest.mark.parametrize(
  "mode", ["duplicated", "distributed", "allgather", "blockwise"]
)
def test_the_second_moment_adds_only_small_reductions(mode):
  # NorMuon's row/column mean over a sharded axis and NAMO's norm are sums
  # across shards (all-reduces of a vector or a scalar); AdaMuon's moment is
  # elementwise. None gathers a matrix or moves more than Muon does.
  from jax.sharding import AxisType
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh(
    (2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2
  )
  params = {"wide": gaussian((32, 64), 1), "tall": gaussian((64, 32), 2)}
  specs = {"wide": P(None, "model"), "tall": P("model", None)}
  sharding = om.TensorParallel(mesh, mode=mode)
  muon = _collectives(om.scale_by_muon(sharding=sharding), mesh, params, specs)
  extra_all_reduces = {"adamuon": 0, "namo": 1, "normuon": 2}
  for method, most in extra_all_reduces.items():
    got = _collectives(
      om.scale_by_adaptive_muon(moment2_method=method, sharding=sharding),
      mesh,
      params,
      specs,
    )
    assert got["all-reduce"] - muon["all-reduce"] <= most, (method, got, muon)
    for name in (
      "all-gather",
      "all-to-all",
      "collective-permute",
      "reduce-scatter",
    ):
      assert got[name] == muon[name], (method, name, got, muon)


@pytest.mark.parametrize("method", ["adamuon", "normuon", "namo"])
def test_describe_shows_the_second_moment_adaptive_muon_keeps(method):
  params = {
    "wide": jnp.zeros((16, 40)),
    "tall": jnp.zeros((40, 16)),
    "stacked": jnp.zeros((3, 24, 8)),
    "bias": jnp.zeros(8),
  }
  dims = {"stacked": MDN((1,), (2,))}
  state = om.adaptive_muon(
    1e-2, moment2_method=method, dimension_numbers=dims
  ).init(params)
  kept = state.inner_states["muon"].inner_state[0].moment2.moment2
  table = om.describe(params, dimension_numbers=dims, moment2_method=method)
  column = {
    line.split()[0]: line.rsplit("  ", 1)[-1].strip()
    for line in table.splitlines()[1:]
  }
  for path in ("wide", "tall", "stacked"):
    (moment,) = kept[path]  # one piece: no split
    assert column[path] == " × ".join(map(str, moment.shape)), table
  assert column["bias"] == "—"
  with pytest.raises(ValueError, match="moment2_method"):
    om.describe(params, dimension_numbers=dims, moment2_method="adam")
