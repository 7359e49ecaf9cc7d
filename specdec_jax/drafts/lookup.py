"""Drafters that need no model: n-gram prompt lookup.

A prompt-lookup drafter guesses that text repeats itself. It takes the last n
tokens of a row's context, finds the most recent earlier place where the same n
tokens occur, and proposes the K tokens that followed them there:

    context:  a b c d x y a b c | ?            n = 3, suffix = "a b c"
              ^^^^^ earlier match at j = 0
    proposal: d x y a ...        (the tokens after the match)

It runs on device inside the decoding loop (`speculative_generate` passes it the
token buffer it keeps anyway) and gives no draft probabilities: the rejection
sampler treats its proposals as one-hot drafts, which keeps the output exactly
the target's distribution.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class PromptLookupDrafter:
  """n-gram ("prompt lookup") drafter; pass it as `draft` to `speculative_generate`.

  Attributes:
    ngram_size: the suffix length n to match, or a tuple of lengths tried from the
      largest to the smallest (a longer match is a better predictor; a shorter
      one matches more often). Each size must be >= 1.

  The drafter is static configuration (frozen and hashable): changing it
  recompiles the loop, changing prompts does not.

  Example:
    >>> drafter = PromptLookupDrafter(ngram_size=(3, 2, 1))
    >>> out = speculative_generate(target, drafter, prompts, prompt_lengths, params, key,
    ...                            max_new_tokens=64, num_speculative_tokens=4)
  """

  ngram_size: int | tuple[int, ...] = 3

  def __post_init__(self):
    sizes = self.ngram_size if isinstance(self.ngram_size, tuple) else (self.ngram_size,)
    if not sizes or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes):
      raise ValueError(
        f"PromptLookupDrafter: ngram_size must be an int >= 1 or a non-empty tuple of them, got {self.ngram_size!r}"
      )

  @property
  def ngram_sizes(self) -> tuple[int, ...]:
    """The sizes to try, largest first, without duplicates."""
    sizes = self.ngram_size if isinstance(self.ngram_size, tuple) else (self.ngram_size,)
    return tuple(sorted(set(sizes), reverse=True))

  def propose(self, tokens: jax.Array, lengths: jax.Array, num_tokens: int) -> jax.Array:
    """Proposes `num_tokens` draft tokens per row.

    Args:
      tokens: int32[B, S] token buffer: row b holds its context in
        `[0, lengths[b])`; entries at or after `lengths[b]` are ignored.
      lengths: int32[B] context lengths, >= 1.
      num_tokens: K, static.

    Returns:
      int32[B, K]. For a row whose last n tokens also occur earlier (ending
      before the last token), the K tokens that followed the most recent such
      occurrence; where the copied span would run into the unknown future, the
      span repeats with the period of the match (so "a b a b" continues "a b").
      A row with no match repeats its last token: a harmless guess that the
      rejection sampler simply rejects if it is wrong.

    Example:
      >>> PromptLookupDrafter(2).propose(jnp.array([[5, 6, 7, 5, 6, 0]]), jnp.array([5]), 3)
      Array([[7, 5, 6]], dtype=int32)
    """
    b, s = tokens.shape
    k = num_tokens
    lengths = lengths.astype(jnp.int32)
    last = jnp.take_along_axis(tokens, jnp.maximum(lengths - 1, 0)[:, None], axis=1)  # [B, 1]
    proposal = jnp.broadcast_to(last, (b, k)).astype(jnp.int32)
    found = jnp.zeros((b,), bool)
    for n in self.ngram_sizes:
      if n >= s:
        continue
      score = _match_scores(tokens, lengths, n)
      has = jnp.any(score >= 0, axis=1)
      start = jnp.max(score, axis=1)  # most recent match, -1 if none
      # The follower span starts at start + n; past the context it would read
      # unknown tokens, so it wraps with the match's period (lengths - n - start).
      period = jnp.maximum(lengths - n - start, 1)
      src = start[:, None] + n + jnp.arange(k)[None, :] % period[:, None]
      guess = jnp.take_along_axis(tokens, jnp.clip(src, 0, s - 1), axis=1).astype(jnp.int32)
      proposal = jnp.where((has & ~found)[:, None], guess, proposal)
      found |= has
    return proposal

  def propose_branches(self, tokens: jax.Array, lengths: jax.Array, num_tokens: int, num_branches: int) -> jax.Array:
    """Up to `num_branches` different continuations per row: the branches of a tree of drafts.

    Candidates are taken in the order `propose` prefers them (the largest n
    first, then the most recent match); two matches whose continuations start
    at the same place count once. Branch 0 is `propose`'s proposal.

    Args:
      tokens, lengths, num_tokens: as for `propose`.
      num_branches: m (static) >= 1.

    Returns:
      int32[B, m, K]: the continuations of the m preferred matches; a branch
      without a match repeats the last token (a guess the sampler rejects if wrong).

    Example:
      >>> PromptLookupDrafter(1).propose_branches(jnp.array([[5, 6, 5, 7, 5]]), jnp.array([5]), 2, 2)
      Array([[[7, 5],
              [6, 5]]], dtype=int32)
    """
    b, s = tokens.shape
    k, m = num_tokens, num_branches
    lengths = lengths.astype(jnp.int32)
    last = jnp.take_along_axis(tokens, jnp.maximum(lengths - 1, 0)[:, None], axis=1)  # [B, 1]
    starts, valid = [], []  # where each candidate's continuation starts, in order of preference
    for n in self.ngram_sizes:
      if n >= s:
        continue
      score = _match_scores(tokens, lengths, n)  # the most recent matches score highest
      top = jax.lax.top_k(score, min(m, score.shape[1]))[0]
      starts.append(top + n)
      valid.append(top >= 0)
    if not starts:
      return jnp.broadcast_to(last[:, :, None], (b, m, k)).astype(jnp.int32)
    start, ok = jnp.concatenate(starts, axis=1), jnp.concatenate(valid, axis=1)  # [B, C]
    c = start.shape[1]
    idx = jnp.arange(c)
    if m > 1:  # a continuation already offered by a preferred candidate is not offered again
      earlier = idx[None, :, None] > idx[None, None, :]
      ok &= ~jnp.any(earlier & (start[:, :, None] == start[:, None, :]) & ok[:, None, :], axis=2)
    if c < m:
      start = jnp.pad(start, ((0, 0), (0, m - c)))
      ok = jnp.pad(ok, ((0, 0), (0, m - c)))
      idx = jnp.arange(m)
    # The first m valid candidates, in order of preference (a stable sort of valid-first).
    order = jnp.argsort(jnp.where(ok, idx[None, :], idx[None, :] + ok.shape[1]), axis=1)[:, :m]
    start, ok = jnp.take_along_axis(start, order, axis=1), jnp.take_along_axis(ok, order, axis=1)
    # The follower span past the context would read unknown tokens, so it wraps
    # with the match's period (lengths - start).
    period = jnp.maximum(lengths[:, None] - start, 1)
    src = start[:, :, None] + jnp.arange(k)[None, None, :] % period[:, :, None]
    guess = jnp.take_along_axis(tokens, jnp.clip(src, 0, s - 1).reshape(b, m * k), axis=1).reshape(b, m, k)
    return jnp.where(ok[:, :, None], guess, last[:, :, None]).astype(jnp.int32)


def _match_scores(tokens: jax.Array, lengths: jax.Array, n: int) -> jax.Array:
  """int [B, S-n+1]: j where the window tokens[j : j+n] equals the row's last n tokens and ends before them, else -1."""
  b, s = tokens.shape
  w = s - n + 1  # candidate windows tokens[j : j+n], j in [0, w)
  suffix_idx = jnp.maximum(lengths[:, None] - n + jnp.arange(n)[None, :], 0)  # [B, n]
  suffix = jnp.take_along_axis(tokens, suffix_idx, axis=1)
  match = jnp.ones((b, w), bool)
  for m in range(n):
    match &= tokens[:, m : m + w] == suffix[:, m : m + 1]
  j = jnp.arange(w)[None, :]
  # Strictly earlier than the suffix itself, so the window has a follower
  # inside the known context (j + n <= lengths - 1); with lengths < n + 1
  # nothing qualifies.
  match &= j + n < lengths[:, None]
  return jnp.where(match, j, -1)
