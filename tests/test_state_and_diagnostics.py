"""Optimizer-state bytes against AdamW, and the per-matrix diagnostics."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import optax_muon as om
from conftest import gaussian
from examples.flax_lm.model import GPT
from examples.flax_lm.model import GPTConfig


def _bytes(tree):
  return sum(
    x.size * x.dtype.itemsize
    for x in jax.tree.leaves(tree)
    if hasattr(x, "dtype")
  )


def test_muon_state_is_half_of_adamw_for_the_muon_leaves():
  params = nnx.state(GPT(GPTConfig(), nnx.Rngs(0)), nnx.Param)  # example size
  labels = om.default_labels(params)
  muon_leaves = [
    p
    for p, l in zip(jax.tree.leaves(params), jax.tree.leaves(labels))
    if l == "muon"
  ]
  muon_state = om.muon(0.02).init(params).inner_states["muon"]
  adamw_state = optax.adamw(1e-3).init(muon_leaves)
  ratio = _bytes(muon_state) / _bytes(adamw_state)
  assert _bytes(muon_state) == _bytes(muon_leaves)  # one buffer, nothing else
  assert ratio == pytest.approx(0.5, abs=1e-6)


def test_update_rms_is_per_matrix():
  x = jnp.stack([jnp.full((4, 6), 1.0), jnp.full((4, 6), 3.0)])
  rms = om.update_rms({"stacked": x, "bias": jnp.full((5,), 2.0)})
  np.testing.assert_allclose(rms["stacked"], [1.0, 3.0])
  np.testing.assert_allclose(rms["bias"], 2.0)


def test_orthogonality_error_and_spread_per_matrix():
  q, _ = jnp.linalg.qr(gaussian((12, 5), 0))
  stacked = jnp.stack([q, 2.0 * q])  # tall: orthonormal columns, then 2×
  error = om.orthogonality_error(stacked)
  np.testing.assert_allclose(error, [0.0, 3.0], atol=1e-5)  # σ² − 1 = 3
  spread = om.singular_value_spread(stacked)
  np.testing.assert_allclose(spread.min, [1.0, 2.0], atol=1e-5)
  np.testing.assert_allclose(spread.max, [1.0, 2.0], atol=1e-5)


def test_newton_schulz_output_is_nearly_orthogonal_by_the_diagnostics():
  x = gaussian((3, 64, 128), 1)
  out = om.newton_schulz(x, coefficients="polar_express", steps=8)
  assert np.all(np.asarray(om.orthogonality_error(out)) < 0.05)
  assert np.all(np.asarray(om.orthogonality_error(x)) > 1.0)
