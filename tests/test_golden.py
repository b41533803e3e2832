"""Parity with NVIDIA emerging-optimizers 0.3.0 (tests/data/eo_golden.json)."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_muon as om
from conftest import det


@pytest.mark.parametrize(
  "name, key", [("quintic", "ns_quintic5"), ("simple", "ns_simple5")]
)
@pytest.mark.parametrize("flax_orientation", [False, True])
def test_newton_schulz_matches_reference(golden, name, key, flax_orientation):
  x = det(4, 6, 0.37, 1.3, 0.1)
  expected = np.asarray(golden[key], np.float32)
  if flax_orientation:  # the (in, out) kernel is the transposed matrix
    x, expected = x.T, expected.T
  out = om.newton_schulz(jnp.asarray(x), coefficients=name, steps=5)
  np.testing.assert_allclose(out, expected, atol=1e-5)


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("flax_orientation", [False, True])
def test_three_muon_steps_match_reference(golden, nesterov, flax_orientation):
  reference = golden["muon_3_steps"]
  orient = (lambda a: a.T) if flax_orientation else (lambda a: a)
  params = {"w": jnp.asarray(orient(0.5 * det(4, 6, 0.11, 0.23, 0.05)))}
  tx = om.muon(
    0.02,
    beta=0.95,
    nesterov=nesterov,
    momentum_style="ema",
    weight_decay=0.1,
    coefficients="quintic",
    steps=5,
    scale_mode="spectral",
    extra_scale_factor=0.2,
    precision="highest",
  )
  state = tx.init(params)
  for t in range(3):
    grads = {"w": jnp.asarray(orient(det(4, 6, 0.37 + 0.1 * t, 1.3, 0.1)))}
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  key = "p3_nesterov_true" if nesterov else "p3_nesterov_false"
  np.testing.assert_allclose(
    orient(np.asarray(params["w"])), np.asarray(reference[key]), atol=1e-5
  )
  momentum_state = state.inner_states["muon"].inner_state[0][0]
  np.testing.assert_allclose(
    orient(np.asarray(momentum_state.mu["w"])),
    np.asarray(reference["momentum_after_3"]),
    atol=1e-5,
  )


@pytest.mark.parametrize("beta1", ["0.9", "0.95"])
def test_adamw_rms_match_factor_matches_reference(golden, beta1):
  assert om.adamw_rms_match_factor(float(beta1)) == pytest.approx(
    golden["adamw_rms_match_factor"][beta1], abs=1e-12
  )
