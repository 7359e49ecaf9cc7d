"""Small models written for the tests, with helpers to feed them and check what the loops return.

- `TinyLM`: a one-layer attention LM, a registered pytree with its own cache
  layout ([2, B, S, D]: keys and values stacked), passed through jit as arrays;
- `BigramLM`: a plain Python object (not a pytree) with a dummy cache, closed over.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.loop.state import GenerateOutput
from specdec_jax.verify.chain import PLACEHOLDER_TOKEN_ID


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TinyLM:
  """One attention layer; cache [2, B, S, D] (keys, values), written at positions."""

  embed: jax.Array  # [V, D]
  wqkv: jax.Array  # [3, D, D]
  unembed: jax.Array  # [D, V]

  traces = 0  # class attribute, not a field: counts traced calls

  @classmethod
  def create(cls, seed, vocab_size, d=16, logit_scale=3.0):
    r = np.random.default_rng(seed)
    return cls(
      embed=jnp.asarray(r.normal(size=(vocab_size, d)), jnp.float32),
      wqkv=jnp.asarray(r.normal(size=(3, d, d)) / np.sqrt(d), jnp.float32),
      unembed=jnp.asarray(r.normal(size=(d, vocab_size)) * logit_scale / np.sqrt(d), jnp.float32),
    )

  def init_cache(self, batch_size, max_length):
    return jnp.zeros((2, batch_size, max_length, self.embed.shape[1]), jnp.float32)

  def __call__(self, tokens, positions, cache):
    TinyLM.traces += 1
    b, _ = tokens.shape
    s, d = cache.shape[2], cache.shape[3]
    freq = (1.0 / (10.0 ** (jnp.arange(d // 2) / (d // 2)))).astype(jnp.float32)  # float32 under x64 too
    ang = positions[..., None].astype(jnp.float32) * freq[None, None, :]
    x = self.embed[tokens] + jnp.concatenate([jnp.sin(ang), jnp.cos(ang)], axis=-1)
    q, k, v = x @ self.wqkv[0], x @ self.wqkv[1], x @ self.wqkv[2]
    slots = jnp.where((positions >= 0) & (positions < s), positions, s)  # out of range -> dropped
    rows = jnp.arange(b)[:, None]
    cache = cache.at[0, rows, slots].set(k, mode="drop").at[1, rows, slots].set(v, mode="drop")
    scores = jnp.einsum("btd,bsd->bts", q, cache[0]) / np.sqrt(d)
    scores = jnp.where(jnp.arange(s)[None, None, :] <= positions[..., None], scores, -jnp.inf)
    h = jnp.tanh(x + jnp.einsum("bts,bsd->btd", jax.nn.softmax(scores, axis=-1), cache[1]))
    return h @ self.unembed, cache


class BigramLM:
  """Not a pytree: next-token logits from a table; the cache is a dummy scalar."""

  def __init__(self, table):
    self.table = np.asarray(table, np.float32)  # [V, V]

  def init_cache(self, batch_size, max_length):
    return jnp.zeros((), jnp.int32)

  def __call__(self, tokens, positions, cache):
    return jnp.asarray(self.table)[tokens], cache + 1


def make_prompts(seed, vocab_size, lengths, p):
  r = np.random.default_rng(seed)
  tokens = r.integers(0, vocab_size, (len(lengths), p))
  tokens = np.where(np.arange(p)[None, :] < np.asarray(lengths)[:, None], tokens, -7)  # odd padding
  return jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32)


def check_output(out: GenerateOutput, max_new_tokens, k, eos=()):
  """Invariants every output satisfies."""
  tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
  st = jax.tree.map(np.asarray, out.stats)
  assert tokens.shape == (lengths.shape[0], max_new_tokens) and tokens.dtype == np.int32
  assert np.all((lengths >= 1) & (lengths <= max_new_tokens))
  live = np.arange(max_new_tokens)[None, :] < lengths[:, None]
  assert np.all(tokens[~live] == PLACEHOLDER_TOKEN_ID) and np.all(tokens[live] >= 0)
  for row, n in zip(tokens, lengths):
    hits = [i for i in range(n) if row[i] in eos]
    # A row ends at its first EOS, or at max_new_tokens without one.
    assert hits == ([n - 1] if hits else []) and (hits or n == max_new_tokens)
  np.testing.assert_array_equal(lengths, st.accepted + st.target_calls)
  assert np.all(st.accepted <= st.drafted) and np.all(st.target_calls >= 1)
  assert st.accepted_per_position.shape == (k,)
  assert st.accepted_per_position.sum() == st.accepted.sum()
  assert np.all(np.diff(st.accepted_per_position) <= 0)  # position i+1 needs position i
  # Usable drafts lie between the accepted and the proposed ones; a position is
  # accepted only where it was reached, and reached only after the one before.
  assert np.all(st.accepted <= st.usable_drafted) and np.all(st.usable_drafted <= st.drafted)
  assert st.reached_per_position.shape == (k,)
  assert np.all(st.accepted_per_position <= st.reached_per_position)
  assert np.all(st.reached_per_position[1:] <= st.accepted_per_position[:-1])
