"""`step_and_verify`: a token's logits from a verification call and from one-token steps, for batch-invariance tests."""

import jax
import jax.numpy as jnp
import numpy as np


def step_and_verify(model, tokens, prefix: int, max_length: int):
  """Logits of tokens[:, prefix:] from one call and from one-token steps, after the same prefill of
  tokens[:, :prefix] into a cache of `max_length` slots (B=1, positions 0, 1, ...).

  Returns (the call's logits, the steps' logits concatenated, both as NumPy [1, T, V]; the cache after the
  call; the cache after the steps). The jitted call is made afresh on each use, so a test that changes what
  the model sees at trace time (a monkeypatched backend) gets a new trace.
  """
  call = jax.jit(lambda m, t, p, c: m(t, p, c))
  pos = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
  _, cache = call(model, tokens[:, :prefix], pos[:, :prefix], model.init_cache(1, max_length))
  together, after_call = call(model, tokens[:, prefix:], pos[:, prefix:], cache)
  steps = []
  for j in range(prefix, tokens.shape[1]):
    logits, cache = call(model, tokens[:, j : j + 1], pos[:, j : j + 1], cache)
    steps.append(logits)
  return np.asarray(together), np.concatenate(steps, axis=1), after_call, cache
