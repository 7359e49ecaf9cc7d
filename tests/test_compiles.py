"""The `count_compiles` helper (tests/support/compiles.py) that the no-recompilation tests use."""

import jax
import jax.numpy as jnp
import numpy as np

from tests.support.compiles import count_compiles


def test_count_compiles_sees_a_new_shape_and_not_a_repeat_call():
  @jax.jit
  def count_compiles_probe(x):
    return jnp.sin(x) * 2.0

  with count_compiles("count_compiles_probe") as compiled:
    count_compiles_probe(np.ones(3, np.float32))
  assert compiled == ["jit(count_compiles_probe)"], compiled  # first call: one compile, named
  with count_compiles("count_compiles_probe") as compiled:
    count_compiles_probe(np.full(3, 5.0, np.float32))  # new values, same shape
  assert not compiled, compiled
  with count_compiles("count_compiles_probe") as compiled:
    count_compiles_probe(np.ones(4, np.float32))  # new shape
  assert compiled == ["jit(count_compiles_probe)"], compiled


def test_count_compiles_filters_by_name_and_stops_listening_at_exit():
  @jax.jit
  def count_compiles_other(x):
    return x + 1

  with count_compiles("count_compiles_probe") as filtered, count_compiles() as everything:
    count_compiles_other(np.ones(5, np.float32))
  assert not filtered, filtered
  assert "jit(count_compiles_other)" in everything, everything
  with count_compiles() as compiled:
    pass
  count_compiles_other(np.ones(6, np.float32))  # after the block: the listener is gone
  assert not compiled, compiled
