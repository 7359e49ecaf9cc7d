"""`count_compiles`: the one way the tests check "does not recompile".

    with count_compiles("_speculative_jit") as compiled:
      ...  # calls with new values (prompts, keys, parameters, weights)
    assert not compiled, compiled  # the names of whatever did compile

It listens to XLA backend compilations through JAX's public monitoring API
(`jax.monitoring.register_event_duration_secs_listener`): JAX reports every
backend compilation as the event "/jax/core/compile/backend_compile_duration"
with the compiled function's name as `fun_name` (e.g. "jit(_speculative_jit)").
Why this signal rather than the others the tests used to mix:

* one signal for every path: an outer jit, an eager call into a library jit
  (`rejection_sample` outside jit compiles `jit(_rejection_sample)`), and a jit
  nested in another (inlined: compiles nothing of its own, as it should);
* a retrace of a jit always lowers and compiles a new program, so no compile
  also means no retrace of that jit;
* public and version-stable, unlike `jitted._cache_size()` (private), with no
  log-message parsing (`jax.log_compiles()` + caplog) and no decorator placed
  inside the function under test (`chex.assert_max_traces`);
* it fires on a persistent compilation-cache hit too (the event wraps the
  cache lookup), so an on-disk cache cannot hide a recompilation.

tests/test_compiles.py checks the helper itself: a new shape is seen, a repeat
call is not (if JAX renamed the event, that control would fail, not pass quietly).
"""

import contextlib

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_compiles(*name_fragments):
  """Yields the list of function names compiled inside the block, in order.

  With `name_fragments`, only names containing one of them are recorded (so the
  small eager ops a test runs around the call under test, `jnp.stack`,
  `jax.random.key`..., do not count). The list is filled as compilations happen
  and is complete when the block exits.
  """
  compiled = []

  def listener(event, duration_secs, **kwargs):
    del duration_secs
    if event != BACKEND_COMPILE_EVENT:
      return
    name = str(kwargs.get("fun_name", "?"))
    if not name_fragments or any(fragment in name for fragment in name_fragments):
      compiled.append(name)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield compiled
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
