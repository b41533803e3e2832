"""Test setup: 8 simulated CPU devices, set before jax is imported."""

import json
import os
import pathlib

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after the flags on purpose)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

ROOT = pathlib.Path(__file__).parents[1]
DATA = ROOT / "tests" / "data"


def gaussian(shape, seed=0, dtype=jnp.float32):
  """Standard normal entries (complex: real and imaginary parts each)."""
  if jnp.issubdtype(dtype, jnp.complexfloating):
    real, imag = jax.random.split(jax.random.key(seed))
    return (
      jax.random.normal(real, shape) + 1j * jax.random.normal(imag, shape)
    ).astype(dtype)
  return jax.random.normal(jax.random.key(seed), shape, dtype)


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
