"""Spectral clipping, hardcap and clipped weight decay against NVIDIA
emerging-optimizers 0.3.0 (tests/data/eo_spectral_clipping.*)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

import optax_muon as om
from conftest import DATA
from conftest import gaussian

REFERENCE = json.loads((DATA / "eo_spectral_clipping.json").read_text())
ARRAYS = np.load(DATA / "eo_spectral_clipping.npz")
CALLS = [
  (case["input"], call) for case in REFERENCE["cases"] for call in case["calls"]
]
FUNCTIONS = {
  "spectral_clip": om.spectral_clip,
  "spectral_hardcap": om.spectral_hardcap,
  "spectral_clipped_weight_decay": om.spectral_clipped_weight_decay,
}


@pytest.mark.parametrize("orientation", ["torch", "flax"])
@pytest.mark.parametrize("name, call", CALLS, ids=[c["key"] for _, c in CALLS])
def test_every_spectral_case_matches_eo(name, call, orientation):
  x, want = ARRAYS[f"{name}/X"], ARRAYS[call["key"]]
  if orientation == "flax":  # f(Xᵀ) = f(X)ᵀ
    x, want = x.T, want.T
  got = FUNCTIONS[call["fn"]](jnp.asarray(x), **call["kwargs"])
  np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)


def test_singular_values_end_in_the_range():
  x = gaussian((24, 40), 1) * 0.5
  s = np.linalg.svd(np.asarray(om.spectral_clip(x, 0.5, 2.0)), compute_uv=False)
  want = np.clip(np.linalg.svd(np.asarray(x), compute_uv=False), 0.5, 2.0)
  np.testing.assert_allclose(s, want, atol=2e-2)


def test_the_decay_transform_moves_params_as_the_function_does():
  params = {"w": gaussian((16, 24), 2) * 2, "s": gaussian((2, 16, 24), 3)}
  tx = om.add_spectral_clipped_weight_decay(
    beta=1.0, c=0.3, dimension_numbers="leading"
  )
  zeros = {k: jnp.zeros_like(v) for k, v in params.items()}
  updates, _ = tx.update(zeros, tx.init(params), params)
  for name, leaf in params.items():
    np.testing.assert_allclose(
      leaf + updates[name],
      om.spectral_clipped_weight_decay(leaf, 1.0, 0.3),
      atol=1e-5,
    )


def test_bad_bounds_raise():
  with pytest.raises(ValueError, match="sigma_min"):
    om.spectral_clip(jnp.ones((4, 4)), 2.0, 1.0)
  with pytest.raises(ValueError, match="beta"):
    om.spectral_hardcap(jnp.ones((4, 4)), 0.0)
  with pytest.raises(ValueError, match="c must"):
    om.add_spectral_clipped_weight_decay(c=1.5)
