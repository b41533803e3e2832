"""The suite's own helpers (conftest.py) do what they say."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import gaussian
from conftest import normal


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
def test_gaussian_is_jax_random_normal_bit_for_bit(shape, seed, dtype):
  got = gaussian(shape, seed, dtype)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    real, imag = jax.random.split(jax.random.key(seed))
    want = (
      jax.random.normal(real, shape) + 1j * jax.random.normal(imag, shape)
    ).astype(dtype)
  else:
    want = jax.random.normal(jax.random.key(seed), shape, dtype)
  assert got.shape == want.shape and got.dtype == want.dtype
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize(
  "key",
  [jax.random.split(jax.random.key(7))[1], jax.random.PRNGKey(2)],
  ids=["typed_split_key", "raw_prngkey"],
)
def test_normal_is_jax_random_normal_bit_for_bit_for_any_key(key):
  for shape in [(2, 2, 6), (40, 16), (3, 32, 8)]:
    np.testing.assert_array_equal(
      np.asarray(normal(key, shape)),
      np.asarray(jax.random.normal(key, shape)),
    )
