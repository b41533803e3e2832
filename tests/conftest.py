"""Test setup: 8 simulated CPU devices, set before jax is imported."""

import json
import os
import pathlib

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402  (after the flags on purpose)
import pytest  # noqa: E402

DATA = pathlib.Path(__file__).parent / "data"


def det(m, n, a, b, c):
  """The reference's deterministic matrix: float32(sin(a i + b j + c i j))."""
  i = np.arange(m, dtype=np.float64)[:, None]
  j = np.arange(n, dtype=np.float64)[None, :]
  return np.sin(a * i + b * j + c * i * j).astype(np.float32)


@pytest.fixture(scope="session")
def golden():
  return json.loads((DATA / "eo_golden.json").read_text())


@pytest.fixture(scope="session")
def reference_coefficients():
  return json.loads((DATA / "coefficients.json").read_text())
