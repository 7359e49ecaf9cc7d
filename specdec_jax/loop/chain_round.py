"""One speculative round with a chain of K drafts, inside the loop's program.

The round's five steps (`specdec_jax.loop.round`) for a row with context
length L whose last token is t:

    keys     round_keys(...)                        (in `specdec_jax.loop.decoding`)
    propose  the draft kind drafts d1 .. dK           propose_chain
    verify   the target scores [t, d1 .. dK] at positions L-1 .. L-1+K in one call,
             `rejection_sample` emits d1 .. dn and one recovered or bonus token
    commit   / count                                  (`specdec_jax.loop.round`)

`tree_round` beside it does the same with a tree of drafts.
"""

from __future__ import annotations

import jax.numpy as jnp

from specdec_jax.loop.draft_kinds import Drafts
from specdec_jax.loop.round import RoundKeys, RoundSetup, Verified, clamp_positions, forced_emission
from specdec_jax.loop.state import LoopState, arange32, gather_rows
from specdec_jax.verify.chain import RejectionOutput, rejection_sample


def chain_round(s: LoopState, keys: RoundKeys, setup: RoundSetup) -> Verified:
  """Propose K drafts, then verify them in one target call.

  Args:
    s: the loop state at the round's start (length L [B], token buffer, caches).
    keys: the round's `RoundKeys` (None fields for all-greedy programs).
    setup: the program's `RoundSetup` (draft kind, target, static choices).

  Returns:
    Verified(emitted int32 [B, K+1], num_emitted [B], logprobs [B, K+1] or None,
    target cache, draft carry, features [B, K+1, F] or None).

  Example:
    >>> verified = chain_round(state, round_keys(row_keys, state.length, False), setup)  # doctest: +SKIP
  """
  drafts = setup.kind.propose_chain(
    s.draft, s, keys.draft, setup.params, all_greedy=setup.all_greedy, end=setup.end, constraint=setup.constraint
  )
  return verify_chain(s, drafts, keys, setup)


def verify_chain(s: LoopState, drafts: Drafts, keys: RoundKeys, setup: RoundSetup) -> Verified:
  """The target scores [t, d1 .. dK] in one call; `rejection_sample` emits 1 .. K+1 tokens.

  With a grammar, position i is verified under the allowed set of s_i, the state after d1 .. di
  (`specdec_jax.loop.constraint`: the walk, and why empty positions get all ones). Drafts not drawn from
  the masked law (prompt lookup) first get the sole token of each single position in their place.
  """
  k = setup.k
  walk = mask = empty = None
  if setup.constraint is not None:
    if setup.kind.masks_drafts:  # masked drafts already are the sole token where one is allowed
      walk = setup.constraint.walk(s.grammar_state, drafts.tokens)  # [B, K+1]: s_0 .. s_K
      mask, empty = setup.constraint.sampler_masks(walk)  # [B, K+1, W], [B, K+1]
    else:
      tokens, walk, words = setup.constraint.walk_sole(s.grammar_state, drafts.tokens)
      drafts = drafts._replace(tokens=tokens)
      mask, empty = setup.constraint.sampler_masks(walk, words)
  last = gather_rows(s.tokens, s.length - 1)
  tokens = jnp.concatenate([last[:, None], drafts.tokens], axis=1)  # [B, K+1]: t, d1 .. dK
  positions = clamp_positions((s.length - 1)[:, None] + arange32(k + 1)[None, :], setup.end)
  if setup.kind.needs_features:
    target_logits, features, target_cache = setup.target_apply(tokens, positions, s.target_cache, return_features=True)
  else:
    (target_logits, target_cache), features = setup.target_apply(tokens, positions, s.target_cache), None
  out = rejection_sample(
    draft_token_ids=drafts.tokens,
    target_logits=target_logits,
    params=setup.params,
    key=keys.verify,
    draft_probs=drafts.probs,
    all_greedy=setup.all_greedy,
    logprobs=setup.logprobs,
    method=setup.method,
    penalty_state=s.penalties,
    token_bitmask=mask,
  )
  if setup.forced_accepts is not None:  # the benchmark knob (`specdec_jax.loop.forced`): NOT LOSSLESS
    out = force_chain(out, drafts.tokens, target_logits, setup.forced_accepts)
  after = ends = None
  if walk is not None:
    after, ends = setup.constraint.emitted_states(walk, empty, out.token_ids, out.num_accepted)
  return Verified(
    emitted=out.token_ids,
    num_emitted=out.num_emitted,
    logprobs=out.logprobs,
    target_cache=target_cache,
    draft_carry=drafts.carry,
    features=features,
    grammar_after=after,
    grammar_ends=ends,
  )


def force_chain(out: RejectionOutput, draft_token_ids, target_logits, accepts: int) -> RejectionOutput:
  """The verifier's output replaced by a round that accepted `accepts` drafts. Benchmark knob, NOT LOSSLESS.

  Emits d1 .. d_accepts, then the target's own token at position `accepts`
  (`forced_emission`). Log-probabilities are not forced (the entry point takes none).

  Args:
    out: `rejection_sample`'s output for the round.
    draft_token_ids: int32 [B, K] the round's drafts.
    target_logits: [B, K+1, V] the verification call's logits.
    accepts: static int in [0, K].
  """
  b = draft_token_ids.shape[0]
  token_ids = forced_emission(
    draft_token_ids, target_logits[:, accepts], out.token_ids, out.num_accepted == accepts, accepts
  )
  num_accepted = jnp.full((b,), accepts, jnp.int32)
  return RejectionOutput(token_ids=token_ids, num_accepted=num_accepted, num_emitted=num_accepted + 1)
