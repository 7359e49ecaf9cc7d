"""The three kinds of draft, as the speculative loop sees them.

Each kind answers the same calls inside the loop's program (`specdec_jax.loop.decoding`
explains the round they serve):

- `start(start, prompt_tokens, max_length)`, after the target's prefill:
  prompt lookup keeps no state; a draft model prefills its own cache; a
  feature drafter (EAGLE) feeds the prefill's features.
- `propose(carry, state, draft_keys, sample)`, a chain of K: n-gram matches in
  the token buffer; a draft model feeds [u, t], then its own K-1 tokens; a
  feature drafter catches up on the verified features, then drafts from its
  own hiddens.
- `propose_tree(...)`, a static tree: the continuations of m earlier matches;
  one call per depth with the nodes at their own cache slots; the same for a
  feature drafter, each node reading its parent's hidden.
- `propose_dynamic(...)`, a dynamic tree: a model or feature drafter expands
  its frontier at its own slots, returning the draft probabilities of a
  sampled tree's random rows (prompt lookup is refused before tracing).
- `commit_tree(carry, src, dst)`, after verification: a draft model moves the
  accepted path's cache slots; the others need nothing (a feature drafter's
  next catch-up rewrites them).
- `observe(carry, features, kept)`: a feature drafter keeps the target's
  features for the next catch-up.

`needs_features` tells the loop whether the target's verification pass must
return its features.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specdec_jax.drafts.dynamic_tree import DynamicTree, grow_dynamic_tree
from specdec_jax.drafts.lookup import PromptLookupDrafter
from specdec_jax.drafts.static_tree import DraftTree, grow_tree, tree_attention_mask
from specdec_jax.loop.adapter import merge_model
from specdec_jax.loop.state import LoopState, Start, arange32, gather_rows, prefill_inputs


class LookupDraft:
  """Prompt lookup: proposals from the token buffer, no state, no probabilities."""

  needs_features = False

  def __init__(self, drafter: PromptLookupDrafter, k: int):
    self.drafter, self.k = drafter, k

  def start(self, start: Start, prompt_tokens, max_length):
    return None

  def propose(self, carry, s: LoopState, draft_keys, sample):
    return self.drafter.propose(s.tokens, s.length, self.k), None, carry

  def propose_tree(self, carry, s: LoopState, draft_keys, tree: DraftTree, params, all_greedy, max_length):
    # A tree (m, 1, ..., 1): m branches, the continuations of m different earlier matches.
    branches = self.drafter.propose_branches(s.tokens, s.length, tree.depth, tree.branching[0])  # [B, m, K]
    b = branches.shape[0]
    return jnp.swapaxes(branches, 1, 2).reshape(b, tree.num_nodes), None, carry

  def commit_tree(self, carry, src, dst):
    return carry

  def observe(self, carry, features, kept):
    return carry


class ModelDraft:
  """A draft model: its own cache, fed [u, t] then its own K-1 tokens each round."""

  needs_features = False

  def __init__(self, init, apply, k: int, copy=None):
    self.init, self.apply, self.k, self.copy = init, apply, k, copy

  def start(self, start: Start, prompt_tokens, max_length):
    tokens, pos = prefill_inputs(prompt_tokens, start.state.length - 1)  # length - 1: the prompt lengths
    logits, cache = self.apply(tokens, pos, self.init(max_length))
    check_vocab(logits.shape[-1], start.vocab_size)
    return cache

  def _first_call(self, cache, s: LoopState):
    """Call 0 of a round: feeds [u, t] at [L-2, L-1] (module docstring: fills the slot of dK after a
    fully accepted round; otherwise rewrites an identical slot). Returns (logits [B, 2, V], cache)."""
    length = s.length
    two = jnp.stack([gather_rows(s.tokens, length - 2), gather_rows(s.tokens, length - 1)], axis=1)
    return self.apply(two, jnp.stack([length - 2, length - 1], axis=1), cache)

  def propose(self, cache, s: LoopState, draft_keys, sample):
    length = s.length
    logits, cache = self._first_call(cache, s)
    first, q_first = sample(logits[:, -1], 0)

    def step(cache, token, i):
      logits, cache = self.apply(token[:, None], (length - 1 + i)[:, None], cache)
      return cache, logits[:, 0]

    return draft_chain(self.k, cache, first, q_first, step, sample)

  def propose_tree(self, cache, s: LoopState, draft_keys, tree: DraftTree, params, all_greedy, max_length):
    # Nodes are written at slot L + j (as in the target's verification) and
    # fed depth by depth; the leaves at depth K are never fed, like dK of a chain.
    length = s.length
    logits, cache = self._first_call(cache, s)

    def level(cache, i, tokens):
      nodes = tree.level(i)
      pos = jnp.broadcast_to((length - 1 + i)[:, None], tokens.shape)
      slots = length[:, None] + arange32(tree.num_nodes)[None, nodes]
      mask = tree_attention_mask(length, length, tree.ancestors[nodes], max_length)
      logits, cache = self.apply(tokens, pos, cache, cache_slots=slots, attention_mask=mask)
      return cache, logits

    return grow_tree(tree, logits[:, -1], level, cache, params, draft_keys, all_greedy=all_greedy)

  def propose_dynamic(self, cache, s: LoopState, tree: DynamicTree, max_length, params, draft_keys, all_greedy):
    # The frontier of depth i sits at slots L + (i-1)*k + m (`dynamic_tree`), position L-1+i.
    length, k = s.length, tree.top_k
    logits, cache = self._first_call(cache, s)

    def level(cache, i, tokens, parent, rows):
      pos = jnp.broadcast_to((length - 1 + i)[:, None], tokens.shape)
      slots = length[:, None] + (i - 1) * k + arange32(k)[None, :]
      mask = tree_attention_mask(length, length, rows, max_length)
      logits, cache = self.apply(tokens, pos, cache, cache_slots=slots, attention_mask=mask)
      return cache, logits

    return grow_dynamic_tree(tree, logits[:, -1], level, cache, params, draft_keys, all_greedy=all_greedy)

  def commit_tree(self, cache, src, dst):
    # The accepted path moves to the slots of its positions, as in the target.
    return self.copy(cache, src, dst)

  def observe(self, carry, features, kept):
    return carry


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FeatureCarry:
  """A feature drafter's part of the loop state: its cache and the target's features still to catch up on."""

  cache: Any
  features: jax.Array  # [B, K+1, F]: the target's features of the last verified tokens
  fresh: jax.Array  # int32 [B]: how many of them were accepted (entries to catch up on)


class FeatureDraft:
  """An EAGLE-style drafter: catches up on the target's features, then drafts from its own hiddens."""

  needs_features = True

  def __init__(self, model_def, arrays, b: int, k: int):
    self.model_def, self.arrays, self.b, self.k = model_def, arrays, b, k

  def _model(self):
    return merge_model(self.model_def, self.arrays)

  def _apply(self, tokens, hidden, positions, cache, logits_at=None):
    logits, hidden, cache = self._model()(tokens, hidden, positions, cache, logits_at=logits_at)
    return logits, hidden, cache

  def start(self, start: Start, prompt_tokens, max_length):
    # Entries (f_p, x_{p+1}) for p = 0 .. P-1 from the prefill's features; the
    # buffer already holds the first new token at x_{P_b}. The last real entry,
    # p = P_b - 1, is redone by the first round's catch-up.
    b, p = prompt_tokens.shape
    model = self._model()
    feats = start.prefill_features
    if feats.shape[-1] != model.config.feature_size:
      raise ValueError(f"speculative_generate: the target's features have width {feats.shape[-1]}, the drafter "
                       f"reads {model.config.feature_size}")
    pos = jnp.broadcast_to(arange32(p), (b, p))
    nxt = jnp.maximum(start.state.tokens[:, 1:p + 1], 0)
    logits, _, cache = self._apply(nxt, model.fuse(feats), pos, model.init_cache(self.b, max_length),
                                   logits_at=jnp.zeros((b,), jnp.int32))
    check_vocab(logits.shape[-1], start.vocab_size)
    last = gather_rows(feats, start.state.length - 2)  # f at P_b - 1
    pending = jnp.zeros((b, self.k + 1, feats.shape[-1]), feats.dtype).at[:, 0].set(last)
    return FeatureCarry(cache=cache, features=pending, fresh=jnp.ones((b,), jnp.int32))

  def _catch_up(self, carry: FeatureCarry, s: LoopState):
    """The round's first call: (logits [B, V] of d1, the drafter's hidden there [B, D], cache)."""
    model = self._model()
    # Catch-up: entries at base .. base+K, base = L-1-fresh; the first `fresh`
    # are the verified tokens (f_p, x_{p+1}), the rest junk that later entries
    # overwrite before anyone reads them. Entry fresh-1 (p = L-2) predicts d1.
    base = s.length - 1 - carry.fresh
    idx = base[:, None] + arange32(self.k + 1)[None, :]
    nxt = jnp.maximum(jnp.take_along_axis(s.tokens, idx + 1, axis=1), 0)
    logits, hidden, cache = self._apply(nxt, model.fuse(carry.features), idx, carry.cache,
                                        logits_at=carry.fresh - 1)
    return logits[:, 0], gather_rows(hidden, carry.fresh - 1), cache

  def propose(self, carry: FeatureCarry, s: LoopState, draft_keys, sample):
    length, k = s.length, self.k
    first_logits, h, cache = self._catch_up(carry, s)
    first, q_first = sample(first_logits, 0)

    def step(state, token, i):
      cache, h = state
      logits, h, cache = self._apply(token[:, None], h[:, None], (length - 2 + i)[:, None], cache)
      return (cache, h[:, 0]), logits[:, 0]

    tokens, probs, (cache, _) = draft_chain(k, (cache, h), first, q_first, step, sample)
    return tokens, probs, dataclasses.replace(carry, cache=cache)

  def propose_tree(self, carry: FeatureCarry, s: LoopState, draft_keys, tree: DraftTree, params, all_greedy,
                   max_length):
    # The entries of depth-i nodes sit at position L-2+i and slot L-1+j (node j),
    # each reading its parent's hidden (the catch-up's for depth 1).
    length = s.length
    root_logits, h, cache = self._catch_up(carry, s)

    def level(state, i, tokens):
      cache, parent_h = state  # parent_h [B, n_{i-1}, D]; node m's parent is m // k_i
      nodes = tree.level(i)
      hidden = jnp.repeat(parent_h, tree.branching[i - 1], axis=1)
      pos = jnp.broadcast_to((length - 2 + i)[:, None], tokens.shape)
      slots = (length - 1)[:, None] + arange32(tree.num_nodes)[None, nodes]
      mask = tree_attention_mask(length - 1, length - 1, tree.ancestors[nodes], max_length)
      logits, hidden, cache = self._model()(tokens, hidden, pos, cache, cache_slots=slots, attention_mask=mask)
      return (cache, hidden), logits

    tokens, probs, (cache, _) = grow_tree(tree, root_logits, level, (cache, h[:, None]), params, draft_keys,
                                          all_greedy=all_greedy)
    return tokens, probs, dataclasses.replace(carry, cache=cache)

  def propose_dynamic(self, carry: FeatureCarry, s: LoopState, tree: DynamicTree, max_length, params, draft_keys,
                      all_greedy):
    # As propose_tree, with the frontier of depth i at slots L-1 + (i-1)*k + m (`dynamic_tree`).
    length, k = s.length, tree.top_k
    root_logits, h, cache = self._catch_up(carry, s)
    rows_b = arange32(length.shape[0])[:, None]

    def level(state, i, tokens, parent, rows):
      cache, parent_h = state  # [B, k, D] (depth 1: [B, 1, D], the catch-up's; parent is 0 there)
      pos = jnp.broadcast_to((length - 2 + i)[:, None], tokens.shape)
      slots = (length - 1)[:, None] + (i - 1) * k + arange32(k)[None, :]
      mask = tree_attention_mask(length - 1, length - 1, rows, max_length)
      logits, hidden, cache = self._model()(tokens, parent_h[rows_b, parent], pos, cache, cache_slots=slots,
                                            attention_mask=mask)
      return (cache, hidden), logits

    tokens, parents, fed, probs, (cache, _) = grow_dynamic_tree(tree, root_logits, level, (cache, h[:, None]),
                                                                params, draft_keys, all_greedy=all_greedy)
    return tokens, parents, fed, probs, dataclasses.replace(carry, cache=cache)

  def commit_tree(self, carry, src, dst):
    # Nothing to move: the next round's catch-up rewrites the accepted path from the target's features.
    return carry

  def observe(self, carry: FeatureCarry, features, kept):
    return dataclasses.replace(carry, features=features, fresh=jnp.maximum(kept, 1).astype(jnp.int32))


def draft_chain(k, carry, first, q_first, step, sample):
  """d1 (given) then d2 .. dK by `step(carry, token, i) -> (carry, logits)`, sampled by `sample`.

  `sample(logits, i, earlier)` also gets the round's earlier drafts, int32
  [B, K] with -1 where none is drafted yet (penalties count them as context).

  Returns (tokens int32 [B, K], probs [B, K, V] or None, carry).
  """
  if k == 1:
    return first[:, None], None if q_first is None else q_first[:, None], carry

  def body(c, i):
    carry, token, earlier = c
    carry, logits = step(carry, token, i)
    nxt, q = sample(logits, i, earlier)
    return (carry, nxt, earlier.at[:, i].set(nxt)), (nxt, q)

  earlier = jnp.full((first.shape[0], k), -1, jnp.int32).at[:, 0].set(first)
  (carry, _, _), (ds, qs) = jax.lax.scan(body, (carry, first, earlier), arange32(k)[1:], unroll=True)
  tokens = jnp.concatenate([first[:, None], ds.T], axis=1)
  probs = None if q_first is None else jnp.concatenate([q_first[:, None], jnp.moveaxis(qs, 0, 1)], axis=1)
  return tokens, probs, carry



def check_vocab(draft_v, target_v):
  """Refuses a draft whose vocabulary size differs from the target's (found when the prefill is traced)."""
  if draft_v != target_v:
    raise ValueError(f"speculative_generate: draft and target must share the vocabulary, got draft V={draft_v} "
                     f"and target V={target_v}")

