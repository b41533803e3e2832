"""MuonHyperball and PolarGrad against NVIDIA emerging-optimizers 0.3.0
outputs (tests/data/eo_muon_hyperball.*; inputs shared with eo_adaptive_muon.npz)."""

import json

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_muon as om
from conftest import DATA
from conftest import EO_ORIENTATIONS
from conftest import close_to_max as _close
from conftest import eo_orientation
from conftest import eo_steps
from conftest import gaussian

REFERENCE = json.loads((DATA / "eo_muon_hyperball.json").read_text())
ARRAYS = np.load(DATA / "eo_muon_hyperball.npz")
INPUTS = np.load(DATA / "eo_adaptive_muon.npz")
CASES = {case["id"]: case for case in REFERENCE["cases"]}


@pytest.mark.parametrize("orientation", EO_ORIENTATIONS)
@pytest.mark.parametrize("case_id", sorted(CASES))
def test_every_muon_hyperball_case_matches_eo(case_id, orientation):
  case = CASES[case_id]
  kw = case["effective_kwargs"]
  turn, dims = eo_orientation(orientation)
  tx = om.muon_hyperball(
    kw["lr"],
    radius=kw["hyperball_radius"],
    hyperball_eps=kw["hyperball_eps"],
    weight_decay=kw["weight_decay"],
    beta=kw["momentum"],
    nesterov=kw["nesterov"],
    precision="highest",
    labels={"w": "muon"},
    dimension_numbers={"w": dims},
  )
  for k, _, _, _, state, param in eo_steps(tx, case, INPUTS, turn):
    step = lambda key: ARRAYS[f"{case_id}/{k}/{key}"]
    _close(turn(param), step("param"))
    # the applied step keeps the norm: the radius EO used this step
    np.testing.assert_allclose(
      float(jnp.linalg.norm(param)),
      float(step("hyperball_R")[0]),
      rtol=1e-5,
    )
    inner = state.inner_states["muon"].inner_state[0][0]
    _close(turn(inner.mu["w"]), step("momentum_buffer"))


def test_weight_decay_without_a_radius_shrinks_the_radius():
  params = {"w": gaussian((16, 32), 1)}
  radius = float(jnp.linalg.norm(params["w"]))
  tx = om.muon_hyperball(0.1, weight_decay=0.5, labels={"w": "muon"})
  state = tx.init(params)
  for _ in range(3):
    updates, state = tx.update({"w": gaussian((16, 32), 2)}, state, params)
    params = optax.apply_updates(params, updates)
    radius *= 1 - 0.1 * 0.5
    assert float(jnp.linalg.norm(params["w"])) == pytest.approx(
      radius, rel=1e-5
    )


# -- PolarGrad (the same EO inputs) -------------------------------------------

POLARGRAD = json.loads((DATA / "eo_polargrad.json").read_text())["cases"]
POLARGRAD_ARRAYS = np.load(DATA / "eo_polargrad.npz")


@pytest.mark.parametrize("orientation", EO_ORIENTATIONS)
@pytest.mark.parametrize("case", POLARGRAD, ids=[c["id"] for c in POLARGRAD])
def test_every_polargrad_case_matches_eo(case, orientation):
  kw = case["effective_kwargs"]
  turn, dims = eo_orientation(orientation)
  tx = om.polargrad(
    kw["lr"],
    beta=kw["momentum"],
    nesterov=kw["nesterov"],
    weight_decay=kw["weight_decay"],
    labels={"w": "muon"},
    dimension_numbers={"w": dims},
  )
  for k, before, _, update, _, param in eo_steps(tx, case, INPUTS, turn):
    step = lambda key: POLARGRAD_ARRAYS[f"{case['id']}/{k}/{key}"]
    _close(turn(param), step("param"))
    _close(
      turn(-update / kw["lr"] - kw["weight_decay"] * before),
      step("update"),
    )
