"""Shared pytest configuration.

Strict rank promotion, as in equinox's tests/conftest.py: an implicit broadcast
between arrays of different ranks (e.g. [B] against [B, V]) raises instead of
silently lining up the wrong axes. Library code must broadcast explicitly
(`x[:, None]`, reshape). float64 stays off: the library computes in float32 and
the tests check it there.
"""

import jax
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_enable_x64", False)


@pytest.fixture(autouse=True, scope="session")
def _strict_jax_config():
  """Fails loudly if something switched the configuration back."""
  assert jax.config.jax_numpy_rank_promotion == "raise"
  assert not jax.config.jax_enable_x64
  yield
