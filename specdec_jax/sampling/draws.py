"""Categorical draws from unnormalised log-weights: two-stage Gumbel-max over chunks.

A draw picks a chunk of the vocabulary by its mass, then a token inside it, so
it reads the weights once and draws a few thousand Gumbels per row, not V.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specdec_jax.sampling.reductions import chunk_size, max_and_sumexp


def categorical_from_log_weights(key: jax.Array, log_w: jax.Array) -> jax.Array:
  """Draws one index per row with probability proportional to exp(log_w).

  Exact two-stage Gumbel-max: pick a chunk of the vocabulary (`chunk_size`) by
  its total weight, then a token inside it. It draws a few hundred to a few
  thousand Gumbels per row instead of V, reads log_w once for the chunk masses,
  and needs no normalised distribution.

  Args:
    key: typed keys [B] (one per row).
    log_w: f32[B, V] unnormalised log-weights; -inf = impossible. A row must
      have at least one finite entry.

  Returns:
    int32[B] indices in [0, V).

  Example:
    >>> tok = categorical_from_log_weights(row_keys(jax.random.key(0), 2), jnp.log(jnp.array([[1., 3.], [1., 0.]])))
  """
  return categorical_with_empty(key, log_w)[0]


def categorical_with_empty(key: jax.Array, log_w: jax.Array, shards=None):
  """`categorical_from_log_weights`, plus bool[B]: rows with no finite weight.

  An empty row's index is meaningless; the flag comes from the chunk masses
  the draw computes anyway, so checking costs no extra pass over log_w.

  Args:
    key: typed keys [B] (one per row).
    log_w: f32[B, V] unnormalised log-weights; -inf = impossible (this
      device's [B, V/m] under `shards`).
    shards: a `vocab_parallel.VocabShards` inside the samplers' shard_map, or
      None. Split, each device reduces its own chunks; the chunk masses are
      gathered and the chosen chunk's owner draws inside it: the same token
      as one device.

  Returns:
    (int32[B] indices in [0, V), bool[B] empty-row flags).

  Example:
    >>> tok, empty = categorical_with_empty(row_keys(jax.random.key(0), 1), jnp.full((1, 4), -jnp.inf))
    >>> empty   # [True]: redraw that row from another distribution
  """
  b, v = log_w.shape[0], (log_w.shape[1] if shards is None else shards.vocab)
  c = chunk_size(v)
  n = -(-log_w.shape[1] // c)
  if n * c != log_w.shape[1]:  # (a split vocabulary is always whole chunks)
    log_w = jnp.pad(log_w, ((0, 0), (0, n * c - v)), constant_values=-jnp.inf)
  chunks = log_w.reshape(b, n, c)
  m, s = max_and_sumexp(chunks)
  chunk_logw = jnp.where(s > 0, m + jnp.log(s), -jnp.inf)  # [B, n]
  if shards is not None:
    chunk_logw = shards.gather(chunk_logw)
  tok = draw_from_chunks(
    key, chunk_logw, lambda ch: jnp.take_along_axis(chunks, ch[:, None, None], axis=1)[:, 0], shards
  )
  return tok, jnp.all(chunk_logw == -jnp.inf, axis=-1)


def categorical_with_fallback(key: jax.Array, log_w: jax.Array, fallback_log_w: jax.Array, shards=None) -> jax.Array:
  """`categorical_with_empty`, drawing from `fallback_log_w` in the rows where `log_w` has no finite weight.

  Without a branch: both chunk masses come from the same pass (the two
  reductions read the same inputs), each row keeps one set, and only the
  chosen chunk of the chosen weights is built. A caller that would otherwise
  redraw under `lax.cond` avoids the predicate's device-to-host copy.

  Args:
    key: typed keys [B] (one per row).
    log_w, fallback_log_w: f32[B, V] unnormalised log-weights (this device's
      [B, V/m] under `shards`), V a multiple of `chunk_size(V)`.
    shards: as for `categorical_with_empty`.

  Returns:
    int32[B]: drawn from log_w, or from fallback_log_w where log_w is all -inf
    (meaningless where both are).

  Example:
    >>> tok = categorical_with_fallback(keys, residual_log_w, log_p)   # the residual, else p
  """
  b, v = log_w.shape[0], (log_w.shape[1] if shards is None else shards.vocab)
  c = chunk_size(v)
  n = log_w.shape[1] // c
  main, fallback = log_w.reshape(b, n, c), fallback_log_w.reshape(b, n, c)

  def chunk_log_mass(chunks):
    m, s = max_and_sumexp(chunks)
    return jnp.where(s > 0, m + jnp.log(s), -jnp.inf)  # [B, n]

  main_mass, fallback_mass = chunk_log_mass(main), chunk_log_mass(fallback)
  if shards is not None:  # both in one collective
    main_mass, fallback_mass = shards.gather_many(main_mass, fallback_mass)
  empty = jnp.all(main_mass == -jnp.inf, axis=-1)
  pick = lambda chunks, ch: jnp.take_along_axis(chunks, ch[:, None, None], axis=1)[:, 0]
  return draw_from_chunks(
    key,
    jnp.where(empty[:, None], fallback_mass, main_mass),
    lambda ch: jnp.where(empty[:, None], pick(fallback, ch), pick(main, ch)),
    shards,
  )


def draw_from_chunks(key: jax.Array, chunk_log_mass: jax.Array, chunk_log_weights, shards=None) -> jax.Array:
  """Two-stage Gumbel-max: a chunk by its mass, then a token inside that chunk.

  Exact when `chunk_log_mass` holds each chunk's total weight; only the chosen
  chunk's weights are ever built, so a caller that knows the chunk masses
  already (from an earlier pass) reads just c tokens per row.

  Args:
    key: typed keys [B] (one per row).
    chunk_log_mass: f32[B, n] log of each chunk's total weight.
    chunk_log_weights: function from the chosen chunks int32[B] to their
      unnormalised log-weights f32[B, c] (chunk j covers tokens j*c .. j*c+c-1).
      Under `shards` it gets this device's local chunk index (chunk - the
      device's first chunk; 0 where another device owns the chunk).
    shards: a `vocab_parallel.VocabShards`, or None. The chunk masses are
      the whole vocabulary's (the same on every device); the owner of the
      chosen chunk draws inside it and the others add 0.

  Returns:
    int32[B] token indices, chunk * c + position inside it.

  Example:
    >>> w = jnp.log(jnp.array([[1., 3., 0., 4.]]))            # V=4 in 2 chunks of 2
    >>> draw_from_chunks(row_keys(jax.random.key(0), 1), jnp.log(jnp.array([[4., 4.]])),
    ...                  lambda ch: w.reshape(1, 2, 2)[0, ch])  # 0, 1, 3 w.p. 1/8, 3/8, 1/2
  """
  n = chunk_log_mass.shape[-1]
  k_chunk, k_tok = jax.vmap(lambda k: tuple(jax.random.split(k)), out_axes=(0, 0))(key)
  g_chunk = jax.vmap(lambda k: jax.random.gumbel(k, (n,), jnp.float32))(k_chunk)
  chunk = jnp.argmax(chunk_log_mass + g_chunk, axis=-1)
  if shards is None:
    inside = chunk_log_weights(chunk)
  else:
    n_local = n // shards.size
    local = chunk - jax.lax.axis_index(shards.axis) * n_local
    mine = (local >= 0) & (local < n_local)
    inside = chunk_log_weights(jnp.where(mine, local, 0))
  g_tok = jax.vmap(lambda k: jax.random.gumbel(k, (inside.shape[-1],), jnp.float32))(k_tok)
  pos = jnp.argmax(inside + g_tok, axis=-1).astype(jnp.int32)
  if shards is not None:
    pos = shards.sum(jnp.where(mine, pos, 0))
  return (chunk * inside.shape[-1] + pos).astype(jnp.int32)


def draw_from_chunks_excluding(
  key: jax.Array,
  chunk_log_probs: jax.Array,
  chunk_log_weights,
  exclude: jax.Array,
  exclude_prob: jax.Array,
  chunk: int,
  shards=None,
) -> jax.Array:
  """`draw_from_chunks` from a distribution with one token per row taken out: p - onehot(d), clipped at 0.

  This is the residual of a rejected draft that came without probabilities
  (one-hot q). The token's probability comes off its chunk's mass; a chunk
  left with (almost) nothing but that token's own mass (under 1e-6 of it) is
  emptied, so rounding never picks a chunk whose other tokens are impossible;
  inside the chosen chunk the token is masked. A row whose residual would be
  empty draws from p itself (the rejection rule's fallback).

  Args:
    key: typed keys [B] (one per row).
    chunk_log_probs: f32[B, n] log of each chunk's probability under p.
    chunk_log_weights: as for `draw_from_chunks` (the chosen chunk's log-weights
      under p, [B, c]).
    exclude: int32[B], the token to take out; ids outside [0, n * c) (e.g. -1)
      take out nothing.
    exclude_prob: f32[B], p(exclude).
    chunk: c, tokens per chunk (static).
    shards: as for `draw_from_chunks`.

  Returns:
    int32[B] token ids.

  Example:
    >>> tok = draw_from_chunks_excluding(keys, log_pc, weights_of_chunk, jnp.array([7]), jnp.array([0.2]), 4)
  """
  n = chunk_log_probs.shape[-1]
  remove = ((exclude >= 0) & (exclude < n * chunk))[:, None]
  d = exclude[:, None]
  w = jnp.exp(chunk_log_probs)
  w_res = w - jnp.where(remove & (jnp.arange(n)[None, :] == d // chunk), exclude_prob[:, None], 0.0)
  w_res = jnp.where(w_res > 1e-6 * w, w_res, 0.0)
  remove = remove & jnp.any(w_res > 0, axis=-1, keepdims=True)  # empty residual: fall back to p
  log_mass = jnp.where(remove, jnp.log(w_res), chunk_log_probs)

  def weights(ch):  # ch: the chunk (this device's local index under shards)
    first = 0 if shards is None else shards.offset()
    ids = first + ch[:, None] * chunk + jnp.arange(chunk)[None, :]
    return jnp.where(remove & (ids == d), -jnp.inf, chunk_log_weights(ch))

  return draw_from_chunks(key, log_mass, weights, shards)
