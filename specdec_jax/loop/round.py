"""What every speculative round shares, chain or tree: its setup, keys, verified result, commit and count.

A round is five steps; `chain_round` and `tree_round` do the middle two:

    keys     round_keys: one fresh (draft, verify) key pair per row
    propose  the draft kind proposes drafts (a chain of K, or a tree of N)
    verify   one target call scores them; the rejection sampler emits 1 .. K+1 tokens
    commit   commit: keep tokens up to EOS / max_new_tokens, write them, advance L
    count    count: add the round's statistics

`RoundSetup` holds what the round closes over: the models as functions, the
draft kind and the static choices (K, the tree, greedy, logprobs, verification)
plus the two bounds every call respects:

    max_length  the slots of the loop's caches and token buffer: P + max_new_tokens
                + (slots one round writes) + 1; index max_length is the "dropped"
                slot of a scatter with mode="drop".
    end         P + max_new_tokens: no model is called at a position >= end.
                `speculative_generate` checks P + max_new_tokens against a model's
                declared `max_length`; a row's last needed position is
                P_b + max_new_tokens - 2, so what lies past `end` belongs to drafts
                that can never be emitted (`clamp_positions`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from specdec_jax.drafts.dynamic_tree import DynamicTree
from specdec_jax.drafts.static_tree import DraftTree
from specdec_jax.loop.state import DecodeStats, LoopState, arange32, is_eos, position_keys
from specdec_jax.sampling.params import SamplingParams
from specdec_jax.verify.chain import PLACEHOLDER_TOKEN_ID


@dataclasses.dataclass(frozen=True)
class RoundSetup:
  """What one speculative round closes over, fixed for the whole program.

  Attributes:
    kind: the draft kind (`specdec_jax.loop.draft_kinds.DraftKind`).
    target_apply: the target's `__call__(tokens, positions, cache, **kw)`.
    target_copy: the target's `copy_cache_slots(cache, src, dst)` (trees), else None.
    params: SamplingParams of batch B.
    k: K, draft positions per round (a tree's depth).
    tree: None (a chain), a `DraftTree` or a `DynamicTree`.
    all_greedy: static promise that every row is greedy.
    logprobs: None, "raw" or "processed".
    method: "token" or "block" (chain verification).
    max_length: slots of the caches and the token buffer (module docstring).
    end: P + max_new_tokens, the first position no model is called at.
    forced_accepts: None (every real round), or the benchmark knob of
      `specdec_jax.loop.forced`: every round accepts exactly this many drafts
      (NOT LOSSLESS; `forced_emission`).
    constraint: the grammar with the EOS ids (`specdec_jax.loop.constraint.Constraint`;
      chains only), or None.
  """

  kind: Any
  target_apply: Callable
  target_copy: Callable | None
  params: SamplingParams
  k: int
  tree: DraftTree | DynamicTree | None
  all_greedy: bool
  logprobs: str | None
  method: str
  max_length: int
  end: int
  forced_accepts: int | None = None
  constraint: Any = None

  @property
  def drafts_per_round(self) -> int:
    """N: K for a chain, the tree's node count for a tree."""
    return self.k if self.tree is None else self.tree.num_nodes


def clamp_positions(positions, end: int):
  """positions, with those >= end moved to end - 1 (the same shape and dtype).

  A position >= end = P + max_new_tokens belongs to a draft that cannot be
  emitted: a live row has L <= P_b + max_new_tokens - 1 and emits at most
  max_new_tokens - (L - P_b) tokens, the last from position P_b + max_new_tokens - 2.
  Such drafts still fill the round's static shapes; moving them to end - 1 keeps
  every call inside the context `speculative_generate` checks. A call without
  `cache_slots` writes them at slot end - 1, which no needed query sees (a query
  at p sees slots <= p). With a chain verified token by token or a static tree,
  the kept tokens read no logits from those positions, so every output is the
  same as with the unclamped positions. Block verification (which weighs the
  whole block) and a dynamic tree (whose nodes compete across depths) read them:
  in a row's last round they may draw differently, from the same distribution.
  """
  return jnp.minimum(positions, end - 1)


class RoundKeys(NamedTuple):
  """One round's keys, typed [B] each, or None for all-greedy programs."""

  draft: jax.Array | None  # the draft kind's sampling
  verify: jax.Array | None  # the rejection sampler's


def round_keys(row_keys, length, all_greedy: bool) -> RoundKeys:
  """One fresh key per row and round (L grows every round), split in two: drafting and verification."""
  if all_greedy:
    return RoundKeys(None, None)
  pair = jax.vmap(jax.random.split)(position_keys(row_keys, length))
  return RoundKeys(draft=pair[:, 0], verify=pair[:, 1])


def forced_emission(path_tokens, stop_logits, verifier_token_ids, verifier_stopped, accepts: int) -> jax.Array:
  """int32 [B, D+1]: what a round forced to accept `accepts` drafts emits. Benchmark knob, NOT LOSSLESS.

  The first `accepts` drafts of the path, then the target's own token at the
  next position, then -1. That token is the verifier's own (recovered or bonus)
  where the verifier stopped there too (`verifier_stopped`), else the argmax of
  the target's logits there. Reading the verifier's tokens keeps the verifier
  in the program (XLA drops work whose result nobody reads), so a forced round
  costs what a real round costs, plus one argmax over [B, V].

  Args:
    path_tokens: int32 [B, D]: the drafts along the forced path (a chain's d1 .. dK).
    stop_logits: [B, V]: the target's logits at the position after the path's `accepts` drafts.
    verifier_token_ids: int32 [B, D+1]: the verifier's own emission.
    verifier_stopped: bool [B]: the verifier accepted exactly the forced path's first `accepts` drafts.
    accepts: static int in [0, D].
  """
  b, d = path_tokens.shape
  own = jnp.where(verifier_stopped, verifier_token_ids[:, accepts], jnp.argmax(stop_logits, axis=-1).astype(jnp.int32))
  after = jnp.full((b, d - accepts), PLACEHOLDER_TOKEN_ID, jnp.int32)
  return jnp.concatenate([path_tokens[:, :accepts].astype(jnp.int32), own[:, None], after], axis=1)


class Verified(NamedTuple):
  """What a round's propose and verify steps hand to `commit`.

  Attributes:
    emitted: int32 [B, K+1] accepted drafts, then one recovered or bonus token, then -1.
    num_emitted: int32 [B] in [1, K+1].
    logprobs: f32 [B, K+1] the emitted tokens' log-probabilities, or None.
    target_cache: the target's cache after the verification call.
    draft_carry: the draft kind's carry after proposing (and, for trees, committing the path).
    features: [B, K+1, F] the target's features of t and the emitted path, or None.
    grammar_after: int32 [B, K+1] the grammar state after each emitted token, or None without a grammar.
    grammar_ends: bool [B, K+1] that state allows nothing: the row ends after the token, or None.
  """

  emitted: jax.Array
  num_emitted: jax.Array
  logprobs: jax.Array | None
  target_cache: Any
  draft_carry: Any
  features: jax.Array | None
  grammar_after: jax.Array | None = None
  grammar_ends: jax.Array | None = None


def kept_tokens(s: LoopState, verified: Verified, prompt_lengths, *, eos, max_new_tokens) -> jax.Array:
  """int32 [B]: how many emitted tokens each row keeps.

  Up to the first EOS (included) or the first token after which the grammar allows nothing (included), and up
  to max_new_tokens; finished rows keep nothing.
  """
  k1 = verified.emitted.shape[1]
  j = arange32(k1)[None, :]
  end_hit = _ends_row(verified, eos) & (j < verified.num_emitted[:, None])
  first_end = jnp.min(jnp.where(end_hit, j, k1), axis=1)
  room = max_new_tokens - (s.length - prompt_lengths)
  kept = jnp.minimum(jnp.minimum(verified.num_emitted, room), first_end + 1)
  return jnp.where(~s.done, kept, 0).astype(jnp.int32)


def commit(
  s: LoopState, verified: Verified, kept, setup: RoundSetup, prompt_lengths, *, eos, max_new_tokens
) -> LoopState:
  """Writes the kept tokens (and log-probabilities) into the buffer, advances L, ends rows, counts.

  The draft kind observes the round last (a feature drafter keeps the target's features).
  """
  b, k1 = verified.emitted.shape
  live = ~s.done
  j = arange32(k1)[None, :]
  rows = arange32(b)[:, None]
  slots = jnp.where(j < kept[:, None], s.length[:, None] + j, setup.max_length)  # max_length: dropped
  tokens = s.tokens.at[rows, slots].set(verified.emitted, mode="drop")
  lp = None if s.logprobs is None else s.logprobs.at[rows, slots].set(verified.logprobs, mode="drop")
  length = s.length + kept
  hit_end = jnp.any(_ends_row(verified, eos) & (j < kept[:, None]), axis=1)
  done = s.done | (live & (hit_end | (length - prompt_lengths >= max_new_tokens)))
  room = max_new_tokens - (s.length - prompt_lengths)
  penalties = None if s.penalties is None else s.penalties.add_tokens(verified.emitted, j < kept[:, None])
  grammar_state = s.grammar_state
  if verified.grammar_after is not None:  # the state after the last kept token
    after = jnp.take_along_axis(verified.grammar_after, jnp.maximum(kept - 1, 0)[:, None], axis=1)[:, 0]
    grammar_state = jnp.where(kept > 0, after, s.grammar_state)
  return LoopState(
    tokens=tokens,
    length=length,
    done=done,
    target_cache=verified.target_cache,
    draft=setup.kind.observe(verified.draft_carry, verified.features, kept),
    stats=count(s.stats, setup, live, kept, verified.num_emitted, room),
    logprobs=lp,
    penalties=penalties,
    grammar_state=grammar_state,
  )


def _ends_row(verified: Verified, eos) -> jax.Array:
  """bool [B, K+1]: the emitted token ends its row: an EOS id, or (with a grammar) its state allows nothing."""
  hit = is_eos(verified.emitted, eos)
  return hit if verified.grammar_ends is None else hit | verified.grammar_ends


def count(stats: DecodeStats, setup: RoundSetup, live, kept, num_emitted, room) -> DecodeStats:
  """Adds one round's counts (K draft positions, N drafts).

  Every live row keeps >= 1 token; its last is the pass's own.
  """
  k = setup.k
  acc = jnp.maximum(kept - 1, 0)
  cut = kept < num_emitted  # EOS or the token limit ended the round early
  usable = jnp.where(cut, acc, jnp.minimum(k, room - 1))
  i = arange32(k)[None, :]
  # Position i was reached if drafts before it were accepted; in a cut round only
  # the positions before the cut count (what came after could not be emitted).
  reached = live[:, None] & ((i < acc[:, None]) | ((i == acc[:, None]) & ~cut[:, None] & (i < room[:, None] - 1)))
  return DecodeStats(
    target_calls=stats.target_calls + (kept > 0),
    drafted=stats.drafted + setup.drafts_per_round * live,
    accepted=stats.accepted + acc,
    accepted_per_position=stats.accepted_per_position + jnp.sum(i < acc[:, None], axis=0, dtype=jnp.int32),
    usable_drafted=stats.usable_drafted + jnp.where(live, usable, 0).astype(jnp.int32),
    reached_per_position=stats.reached_per_position + jnp.sum(reached, axis=0, dtype=jnp.int32),
  )
