"""A block drafter: K draft tokens from one call, conditioned on the target's features (PARD/DFlash style).

An EAGLE head (`EagleDrafter`) drafts one token a call: each draft reads the hidden the previous one left, so K
drafts cost K calls. A block drafter reads the same inputs, the target's features of the verified context, and
appends K-1 *placeholder* entries after the last verified one; one call returns logits at the last verified entry
(the first draft) and at every placeholder (the next K-1), each attending causally to the context and to the
placeholders before it:

    position:   ...  L-3        L-2        L-1     L      ...  L+K-3
    entry:      ...  (f, x)     (f, x)     []      []     ...  []          [] = placeholder (learned hidden)
    predicts:                   d_1        d_2     d_3         d_K

A placeholder's input is a learned hidden of its offset in the block (`mask_hidden[j]` for the j-th placeholder)
and token 0: one shared hidden left a one-block drafter to tell the offsets apart by RoPE alone. Because no placeholder sees a drafted token, draft i's law is fixed before any draft is
drawn: the loop draws each draft from its position's logits and hands that law to the verifier as q, which keeps
speculative decoding lossless for sampled drafts as for an autoregressive drafter.

The backbone is an `EagleDrafter` (its fused low/mid/high features, blocks, head, cache and draft vocabulary), so
a block drafter follows the same cache slot rules and the same loader conventions. Its placeholders' keys and
values land in the slots at L-1 and beyond, which the next round's catch-up rewrites from the target's features
before any later entry reads them.

Example:
  >>> target = Transformer(TransformerConfig.tiny(64, feature_layers=(0, 1)), rngs=nnx.Rngs(0))
  >>> drafter = BlockDrafter.for_target(target, block_size=4, rngs=nnx.Rngs(1))
  >>> out = speculative_generate(target, drafter, prompts, lengths, params, key, num_speculative_tokens=4)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from specdec_jax.models.eagle import EagleConfig, EagleDrafter
from specdec_jax.models.transformer import KVCache, Transformer

__all__ = ["BlockDrafter"]


class BlockDrafter(nnx.Module):
  """K draft logits from one call: an `EagleDrafter` backbone with learned placeholder entries.

  Pass it as `draft` to `speculative_generate` (chains, static and dynamic trees) with a target whose
  `config.feature_layers` equal `feature_layers` here.

  Protocol (what the loop uses): the `EagleDrafter` protocol (`init_cache`, `fuse`, `feature_layers`,
  `config`), and `__call__` with `placeholders` (below).

  Args:
    backbone: the `EagleDrafter` whose blocks, head and cache it uses.
    block_size: the number of drafts it was trained to fill in one call (the K it is meant for; drafting
      more is lossless but the later drafts' agreement is untrained).
    rngs: random streams for the placeholder hiddens' initial values.
    shared_placeholder: one hidden for every placeholder (`mask_hidden` [1, D]) instead of one per offset
      ([block_size - 1, D]): the first format's drafter, kept to compare the two.

  Example:
    >>> drafter = BlockDrafter(EagleDrafter.for_target(target, rngs=nnx.Rngs(1)), block_size=8, rngs=nnx.Rngs(2))
    >>> drafter.block_size, drafter.feature_layers
    (8, (0, 1))
  """

  def __init__(self, backbone: EagleDrafter, *, block_size: int, rngs: nnx.Rngs, shared_placeholder: bool = False):
    if not isinstance(backbone, EagleDrafter):
      raise ValueError(f"backbone must be an EagleDrafter, got {type(backbone).__name__}.")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
      raise ValueError(f"block_size must be an int >= 1, got {block_size!r}.")
    self.backbone = backbone
    self.block_size = block_size
    c = backbone.config.layers
    # One hidden per placeholder offset, small like a fused feature after its projection: a placeholder starts
    # as "no information" to refine.
    m = 1 if shared_placeholder else max(block_size - 1, 1)
    self.mask_hidden = nnx.Param((0.02 * jax.random.normal(rngs.params(), (m, c.d_model), jnp.float32)).astype(c.dtype))

  @classmethod
  def for_target(
    cls, target: Transformer, *, block_size: int = 8, num_layers: int = 1, draft_vocab=None, rngs: nnx.Rngs
  ) -> BlockDrafter:
    """A block drafter for `target` (its embedding and head borrowed, as `EagleDrafter.for_target`), random
    otherwise.

    Args:
      target: the `Transformer` whose `config.feature_layers` it reads.
      block_size: K, the drafts it is meant to fill in one call.
      num_layers: its blocks.
      draft_vocab: None (the target's V) or int token ids of a smaller draft vocabulary.
      rngs: random streams.

    Example:
      >>> BlockDrafter.for_target(target, block_size=8, rngs=nnx.Rngs(1)).block_size
      8
    """
    backbone = EagleDrafter.for_target(target, num_layers=num_layers, draft_vocab=draft_vocab, rngs=rngs)
    return cls(backbone, block_size=block_size, rngs=rngs)

  @property
  def config(self) -> EagleConfig:
    """The backbone's `EagleConfig`."""
    return self.backbone.config

  @property
  def feature_layers(self) -> tuple[int, ...]:
    """The target blocks whose features it reads."""
    return self.backbone.feature_layers

  @property
  def vocab_size(self) -> int:
    """V, the target's vocabulary size."""
    return self.backbone.vocab_size

  def init_cache(self, batch_size: int, max_length: int) -> KVCache:
    """The backbone's empty `KVCache` for `batch_size` rows of `max_length` slots.

    Example:
      >>> drafter.init_cache(2, 64).k.shape   # [layers, B, kv heads, S, head dim]   # doctest: +SKIP
    """
    return self.backbone.init_cache(batch_size, max_length)

  def copy_cache_slots(self, cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    """The backbone's slot copy (the tree extension of the model protocol; the loop's trees need none for a
    block drafter, whose next catch-up rewrites the accepted path).

    Example:
      >>> cache = drafter.copy_cache_slots(cache, src, dst)   # int32 [B, N] slots each   # doctest: +SKIP
    """
    return self.backbone.copy_cache_slots(cache, src, dst)

  def fuse(self, features: jax.Array) -> jax.Array:
    """Target features [B, T, F] -> hidden [B, T, D] (the backbone's fusion).

    Example:
      >>> drafter.fuse(features).shape   # (B, T, D)   # doctest: +SKIP
    """
    return self.backbone.fuse(features)

  def __call__(
    self,
    tokens: jax.Array,  # int32 [B, T]
    hidden: jax.Array,  # [B, T, D]
    positions: jax.Array,  # int32 [B, T]
    cache: KVCache,
    *,
    placeholders: jax.Array | None = None,  # bool [B, T]
    placeholder_offsets: jax.Array | None = None,  # int32 [B, T]
    logits_at: jax.Array | None = None,  # int32 [B] or [B, N]
    cache_slots: jax.Array | None = None,  # int32 [B, T]
    attention_mask: jax.Array | None = None,  # bool [B, T, S]
    draft_vocab_logits: bool = False,
  ) -> tuple[jax.Array, jax.Array, KVCache]:
    """Runs entries at their positions, placeholders among them; writes their keys and values.

    Args:
      tokens: int [B, T], the token after each entry's hidden (ignored at placeholders).
      hidden: [B, T, D], `fuse(features)` of verified entries (ignored at placeholders).
      positions: int [B, T]; a query sees the slots at or below its position (`Transformer`'s rules).
      cache: the backbone's `KVCache`.
      placeholders: bool [B, T], True where the entry is a placeholder (the learned hidden of its offset and
        token 0); None: none.
      placeholder_offsets: int [B, T], each placeholder's offset j in its block (it reads `mask_hidden[j]`,
        the last row for j beyond it); None: its index in its run of consecutive placeholders (one block a row,
        as the loop lays them out).
      logits_at: as for `EagleDrafter`: None (every entry), int [B] (one entry a row) or int [B, N].
      cache_slots, attention_mask: as for `EagleDrafter` (where each entry writes, which slots it sees);
        `block_logits` uses them to hold several blocks in one call.
      draft_vocab_logits: as for `EagleDrafter` (logits over the draft vocabulary only).

    Returns:
      (logits float32 [B, T | 1 | N, V], hidden [B, T, D], cache).

    Example:
      >>> is_block = jnp.arange(2 * k)[None, :] >= fresh[:, None]   # doctest: +SKIP
      >>> logits, _, cache = drafter(tokens, hidden, positions, cache, placeholders=is_block, logits_at=at)
    """
    if placeholders is not None:
      if placeholders.shape != tokens.shape:
        raise ValueError(f"placeholders must have the shape of tokens {tokens.shape}, got {placeholders.shape}.")
      if placeholder_offsets is None:
        idx = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
        last_entry = jax.lax.cummax(jnp.where(placeholders, -1, idx), axis=1)  # the run's verified entry before it
        placeholder_offsets = idx - last_entry - 1
      table = self.mask_hidden[...]
      rows = jnp.clip(placeholder_offsets, 0, table.shape[0] - 1)
      hidden = jnp.where(placeholders[..., None], table[rows].astype(hidden.dtype), hidden)
      tokens = jnp.where(placeholders, 0, tokens)
    return self.backbone(
      tokens,
      hidden,
      positions,
      cache,
      logits_at=logits_at,
      cache_slots=cache_slots,
      attention_mask=attention_mask,
      draft_vocab_logits=draft_vocab_logits,
    )

  # --- training ----------------------------------------------------------------

  def block_logits(
    self, next_tokens: jax.Array, features: jax.Array, ends: jax.Array, k: int, *, draft_vocab: bool = False
  ) -> jax.Array:
    """Teacher-forced block logits (training): one call holds a sequence's context and several blocks.

    A block ending its context at c (entries 0 .. c-1: the context's (features[p], next_tokens[p]) at
    positions p) gives the logits of the tokens at positions c+1 .. c+k: the context's last entry's, then
    those of k-1 placeholders at positions c .. c+k-2, which see the context's entries below c and their own
    block's earlier placeholders, as in the loop's round (`BlockDraft`). The context's entries are shared by
    every block of a row; the placeholders sit in cache slots after them.

    Args:
      next_tokens: int32 [B, T], the token after each entry's features (x_{p+1}).
      features: [B, T, F], the target's features of tokens 0 .. T-1.
      ends: int32 [B] or [B, NB]: each block's context length c, in [1, T].
      k: the block's drafts.
      draft_vocab: logits over the draft vocabulary only ([..., Vd]; training), not V.

    Returns:
      float32 [B, k, V] (ends [B]) or [B, NB, k, V] (Vd with `draft_vocab`): the logits of x_{c+1} .. x_{c+k} (compare with the
      target's logits at positions c .. c+k-1).

    Example:
      >>> logits = drafter.block_logits(seqs[:, 1:], feats[:, :-1], jnp.array([[5, 9], [3, 7]]), 8)  # doctest: +SKIP
    """
    single = ends.ndim == 1
    ends = (ends[:, None] if single else ends).astype(jnp.int32)  # [B, NB]
    b, t = next_tokens.shape
    nb, m = ends.shape[1], k - 1  # m placeholders a block
    j = jnp.arange(m, dtype=jnp.int32)
    context_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    block_pos = (ends[:, :, None] + j[None, None, :]).reshape(b, nb * m)
    positions = jnp.concatenate([context_pos, block_pos], axis=1)
    s = t + nb * m
    slot = jnp.arange(s, dtype=jnp.int32)
    # Which slots each entry sees: a context entry its context up to itself; placeholder j of block i the
    # context below the block's end and its block's placeholders up to itself.
    sees_context = slot[None, None, :] < t
    context_rows = sees_context & (slot[None, None, :] <= jnp.arange(t, dtype=jnp.int32)[None, :, None])
    block_of = (slot - t) // max(m, 1)
    block_rows = jnp.where(
      sees_context[:, None],  # [1, 1, 1, S] over [B, NB, m, S]
      slot[None, None, None, :] < ends[:, :, None, None],
      (block_of[None, None, None, :] == jnp.arange(nb, dtype=jnp.int32)[None, :, None, None])
      & ((slot - t)[None, None, None, :] % max(m, 1) <= j[None, None, :, None]),
    ).reshape(b, nb * m, s)
    mask = jnp.concatenate([jnp.broadcast_to(context_rows, (b, t, s)), block_rows], axis=1)
    hidden = self.fuse(features)
    tokens = jnp.concatenate([next_tokens, jnp.zeros((b, nb * m), jnp.int32)], axis=1)
    hidden = jnp.concatenate([hidden, jnp.zeros((b, nb * m, hidden.shape[-1]), hidden.dtype)], axis=1)
    placeholders = jnp.concatenate([jnp.zeros((b, t), bool), jnp.ones((b, nb * m), bool)], axis=1)
    offsets = jnp.concatenate([jnp.zeros((t,), jnp.int32), jnp.tile(j, nb)])  # blocks sit back to back
    offsets = jnp.broadcast_to(offsets, (b, s))
    first = (ends - 1)[:, :, None]  # the context's last entry gives the first draft
    rest = t + (jnp.arange(nb, dtype=jnp.int32) * m)[None, :, None] + j[None, None, :]
    at = jnp.concatenate([first, jnp.broadcast_to(rest, (b, nb, m))], axis=2).reshape(b, nb * k)
    logits, _, _ = self(
      tokens,
      hidden,
      positions,
      self.init_cache(b, s),
      placeholders=placeholders,
      placeholder_offsets=offsets,
      logits_at=at,
      cache_slots=jnp.broadcast_to(slot, (b, s)),
      attention_mask=mask,
      draft_vocab_logits=draft_vocab,
    )
    logits = logits.reshape(b, nb, k, -1)
    return logits[:, 0] if single else logits
