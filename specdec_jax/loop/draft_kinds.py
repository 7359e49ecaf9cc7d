"""The draft kinds: how the speculative loop drives each kind of drafter.

Vocabulary (as in `specdec_jax.loop`): the *drafter* is the user's object (a
model, a `PromptLookupDrafter` or a feature drafter such as `EagleDrafter`); a
*draft kind* is the loop's adapter for one kind of drafter (`ModelDraft`,
`LookupDraft`, `FeatureDraft`, and `BlockDraft`, a feature drafter that gives all
K drafts' logits from one call, for chains and trees alike), which follows the
`DraftKind` protocol below;
the *drafts* are the tokens it proposes. A draft kind's part of the loop state
is its *carry* (`LoopState.draft`).

Every proposal takes `(carry, state, keys, params)` in that order, then its
static options by keyword:

| method            | ModelDraft                  | LookupDraft          | FeatureDraft                     |
|-------------------|-----------------------------|----------------------|----------------------------------|
| `start`           | prefills its own cache      | no carry (None)      | feeds the prefill's features     |
| `propose_chain`   | feeds [u, t], then its own  | n-gram matches in    | catches up on the verified       |
|                   | K-1 drafts                  | the token buffer     | features, then its own hiddens   |
| `propose_tree`    | one call per depth, nodes   | continuations of m   | as a model, each node reading    |
|                   | at their own slots          | earlier matches      | its parent's hidden              |
| `propose_dynamic` | expands its frontier at its | refused (TypeError;  | as a model, from its hiddens     |
|                   | own slots                   | checked before jit)  |                                  |
| `commit_tree`     | moves the accepted path's   | nothing              | nothing (the next catch-up       |
|                   | cache slots                 |                      | rewrites them)                   |
| `observe`         | nothing                     | nothing              | keeps the target's features      |

`needs_features` tells the round whether the target's verification call must
return its features. With a grammar (`constraint`, chains only) a draft model and
a feature drafter draw each draft from their law over the allowed set of the
state after the drafts before it, and report that law as the draft's
probabilities (`masks_drafts`); prompt lookup proposes unmasked drafts, which the
verifier rejects where the grammar disallows them, except where the grammar allows
one token only: the round puts that token in the draft's place
(`specdec_jax.loop.constraint`, `Constraint.walk_sole`). Every model call respects `RoundSetup.end`
(`specdec_jax.loop.round.clamp_positions`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from specdec_jax.drafts.dynamic_tree import DynamicTree, grow_dynamic_tree
from specdec_jax.drafts.lookup import PromptLookupDrafter
from specdec_jax.drafts.static_tree import DraftTree, grow_tree, tree_attention_mask
from specdec_jax.loop.adapter import merge_model
from specdec_jax.loop.round import clamp_positions
from specdec_jax.loop.state import LoopState, Start, arange32, gather_rows, position_keys, prefill_inputs
from specdec_jax.sampling.params import SamplingParams
from specdec_jax.sampling.sample import sample_tokens


class Drafts(NamedTuple):
  """A chain's or a static tree's proposal.

  Attributes:
    tokens: int32 [B, K] (a chain) or [B, N] (tree nodes in topological order).
    probs: f32 [B, K, V] (a chain) or [B, N+1, V] (a tree: the root's q, then each
      node's) for random rows to verify with; None for all-greedy programs and for
      a drafter without probabilities (prompt lookup).
    carry: the draft kind's carry after proposing.
  """

  tokens: jax.Array
  probs: jax.Array | None
  carry: Any


class DynamicDrafts(NamedTuple):
  """A dynamic tree's proposal (`grow_dynamic_tree`'s result).

  Attributes:
    tokens: int32 [B, N] nodes in topological order.
    parents: int32 [B, N] each node's parent, -1 for the root's children.
    fed: int32 [B, N] the frontier slot a node was fed at, -1 if never fed.
    probs: f32 [B, N+1, V] for a sampled tree's random rows, else None.
    carry: the draft kind's carry after proposing.
  """

  tokens: jax.Array
  parents: jax.Array
  fed: jax.Array
  probs: jax.Array | None
  carry: Any


class DraftKind(Protocol):
  """What the speculative round asks of a draft kind (module docstring: what each kind does).

  `state` is the round's `LoopState` (length L, token buffer, penalties);
  `keys` its typed draft keys [B] (None for all-greedy programs); `params`
  the rows' SamplingParams. `max_length` is the slots of the caches, `end`
  the first position no call may use (`specdec_jax.loop.round`).
  """

  needs_features: bool
  masks_drafts: bool  # with a grammar, drafts come from the masked law (else the round fills in sole tokens)

  def start(self, start: Start, prompt_tokens: jax.Array, max_length: int) -> Any:
    """The carry after the target's prefill."""

  def propose_chain(
    self, carry, state: LoopState, keys, params: SamplingParams, *, all_greedy: bool, end: int, constraint=None
  ) -> Drafts:
    """K drafts in a chain: tokens [B, K], probs [B, K, V] or None (`constraint`: a grammar, or None)."""

  def propose_tree(
    self,
    carry,
    state: LoopState,
    keys,
    params: SamplingParams,
    *,
    tree: DraftTree,
    all_greedy: bool,
    max_length: int,
    end: int,
  ) -> Drafts:
    """The N nodes of a static tree: tokens [B, N], probs [B, N+1, V] or None."""

  def propose_dynamic(
    self,
    carry,
    state: LoopState,
    keys,
    params: SamplingParams,
    *,
    tree: DynamicTree,
    all_greedy: bool,
    max_length: int,
    end: int,
  ) -> DynamicDrafts:
    """A tree chosen by the drafter's confidence; raises TypeError for a kind that has none."""

  def commit_tree(self, carry, src: jax.Array, dst: jax.Array) -> Any:
    """After a tree's verification: the accepted path's slots src -> dst [B, K] (dst max_length: dropped)."""

  def observe(self, carry, features: jax.Array | None, kept: jax.Array) -> Any:
    """After the round's commit: the target's features [B, K+1, F] (or None) and kept [B]."""


class LookupDraft:
  """Prompt lookup: drafts copied from the token buffer, no carry, no probabilities."""

  needs_features = False
  masks_drafts = False

  def __init__(self, drafter: PromptLookupDrafter, k: int):
    self.drafter, self.k = drafter, k

  def start(self, start: Start, prompt_tokens, max_length):
    return None

  def propose_chain(self, carry, state: LoopState, keys, params, *, all_greedy, end, constraint=None) -> Drafts:
    # Unmasked even with a grammar: a disallowed draft is rejected by the verifier, and the round puts the sole
    # token in place of the draft where one token only is allowed (`verify_chain`).
    return Drafts(self.drafter.propose(state.tokens, state.length, self.k), None, carry)

  def propose_tree(
    self, carry, state: LoopState, keys, params, *, tree: DraftTree, all_greedy, max_length, end
  ) -> Drafts:
    # A tree (m, 1, ..., 1): m branches, the continuations of m different earlier matches.
    branches = self.drafter.propose_branches(state.tokens, state.length, tree.depth, tree.branching[0])  # [B, m, K]
    b = branches.shape[0]
    return Drafts(jnp.swapaxes(branches, 1, 2).reshape(b, tree.num_nodes), None, carry)

  def propose_dynamic(
    self, carry, state: LoopState, keys, params, *, tree: DynamicTree, all_greedy, max_length, end
  ) -> DynamicDrafts:
    raise TypeError(
      f"speculative_generate: draft_tree={tree} is chosen by a drafter's confidence; prompt lookup "
      "has none (use a DraftTree (m, 1, ..., 1))"
    )

  def commit_tree(self, carry, src, dst):
    return carry

  def observe(self, carry, features, kept):
    return carry


class ModelDraft:
  """A draft model: its own cache, fed [u, t] then its own K-1 drafts each round."""

  needs_features = False
  masks_drafts = True

  def __init__(self, init, apply, k: int, copy=None):
    self.init, self.apply, self.k, self.copy = init, apply, k, copy

  def start(self, start: Start, prompt_tokens, max_length):
    tokens, pos = prefill_inputs(prompt_tokens, start.state.length - 1)  # length - 1: the prompt lengths
    logits, cache = self.apply(tokens, pos, self.init(max_length))
    check_vocab(logits.shape[-1], start.vocab_size)
    return cache

  def _first_call(self, cache, state: LoopState, end):
    """Call 0 of a round: feeds [u, t] at [L-2, L-1] (`specdec_jax.loop.decoding`: fills the slot of dK after a
    fully accepted round; otherwise rewrites an identical slot). Returns (logits [B, 2, V], cache)."""
    length = state.length
    two = jnp.stack([gather_rows(state.tokens, length - 2), gather_rows(state.tokens, length - 1)], axis=1)
    return self.apply(two, clamp_positions(jnp.stack([length - 2, length - 1], axis=1), end), cache)

  def propose_chain(self, cache, state: LoopState, keys, params, *, all_greedy, end, constraint=None) -> Drafts:
    length = state.length
    sample = chain_sampler(state, keys, params, all_greedy=all_greedy, constraint=constraint)
    logits, cache = self._first_call(cache, state, end)
    first, q_first = sample(logits[:, -1], 0, grammar_state=state.grammar_state)

    def step(cache, token, i):  # d_i at position L-1+i -> logits of d_{i+1}
      logits, cache = self.apply(token[:, None], clamp_positions((length - 1 + i)[:, None], end), cache)
      return cache, logits[:, 0]

    return draft_chain(self.k, cache, first, q_first, step, sample, constraint, state.grammar_state)

  def propose_tree(
    self, cache, state: LoopState, keys, params, *, tree: DraftTree, all_greedy, max_length, end
  ) -> Drafts:
    # Nodes are written at slot L + j (as in the target's verification) and
    # fed depth by depth; the leaves at depth K are never fed, like dK of a chain.
    length = state.length
    logits, cache = self._first_call(cache, state, end)

    def level(cache, i, tokens):
      nodes = tree.level(i)
      pos = clamp_positions(jnp.broadcast_to((length - 1 + i)[:, None], tokens.shape), end)
      slots = length[:, None] + arange32(tree.num_nodes)[None, nodes]
      mask = tree_attention_mask(length, length, tree.ancestors[nodes], max_length)
      logits, cache = self.apply(tokens, pos, cache, cache_slots=slots, attention_mask=mask)
      return cache, logits

    return Drafts(*grow_tree(tree, logits[:, -1], level, cache, params, keys, all_greedy=all_greedy))

  def propose_dynamic(
    self, cache, state: LoopState, keys, params, *, tree: DynamicTree, all_greedy, max_length, end
  ) -> DynamicDrafts:
    # The frontier of depth i sits at slots L + (i-1)*k + m (`dynamic_tree`), position L-1+i.
    length, k = state.length, tree.top_k
    logits, cache = self._first_call(cache, state, end)

    def level(cache, i, tokens, parent, rows):
      pos = clamp_positions(jnp.broadcast_to((length - 1 + i)[:, None], tokens.shape), end)
      slots = length[:, None] + (i - 1) * k + arange32(k)[None, :]
      mask = tree_attention_mask(length, length, rows, max_length)
      logits, cache = self.apply(tokens, pos, cache, cache_slots=slots, attention_mask=mask)
      return cache, logits

    return DynamicDrafts(*grow_dynamic_tree(tree, logits[:, -1], level, cache, params, keys, all_greedy=all_greedy))

  def commit_tree(self, cache, src, dst):
    # The accepted path moves to the slots of its positions, as in the target.
    return self.copy(cache, src, dst)

  def observe(self, carry, features, kept):
    return carry


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FeatureCarry:
  """A feature drafter's carry: its cache and the target's features still to catch up on."""

  cache: Any
  features: jax.Array  # [B, K+1, F]: the target's features of the last verified tokens
  fresh: jax.Array  # int32 [B]: how many of them were accepted (entries to catch up on)


class CatchUp(NamedTuple):
  """The first call of a feature drafter's round."""

  logits: jax.Array  # [B, V]: the drafter's logits of d1
  hidden: jax.Array  # [B, D]: its hidden there, which d1's successors read
  cache: Any


class FeatureDraft:
  """An EAGLE-style drafter: catches up on the target's features, then drafts from its own hiddens."""

  needs_features = True
  masks_drafts = True

  def __init__(self, model_def, arrays, b: int, k: int):
    self.model_def, self.arrays, self.b, self.k = model_def, arrays, b, k

  def _model(self):
    return merge_model(self.model_def, self.arrays)

  def start(self, start: Start, prompt_tokens, max_length):
    # Entries (f_p, x_{p+1}) for p = 0 .. P-1 from the prefill's features; the
    # buffer already holds the first new token at x_{P_b}. The last real entry,
    # p = P_b - 1, is redone by the first round's catch-up.
    b, p = prompt_tokens.shape
    model = self._model()
    feats = start.prefill_features
    if feats.shape[-1] != model.config.feature_size:
      raise ValueError(
        f"speculative_generate: the target's features have width {feats.shape[-1]}, the drafter "
        f"reads {model.config.feature_size}"
      )
    pos = jnp.broadcast_to(arange32(p), (b, p))
    nxt = jnp.maximum(start.state.tokens[:, 1 : p + 1], 0)
    logits, _, cache = model(
      nxt, model.fuse(feats), pos, model.init_cache(self.b, max_length), logits_at=jnp.zeros((b,), jnp.int32)
    )
    check_vocab(logits.shape[-1], start.vocab_size)
    last = gather_rows(feats, start.state.length - 2)  # f at P_b - 1
    pending = jnp.zeros((b, self.k + 1, feats.shape[-1]), feats.dtype).at[:, 0].set(last)
    return FeatureCarry(cache=cache, features=pending, fresh=jnp.ones((b,), jnp.int32))

  @staticmethod
  def _entries(carry: FeatureCarry, state: LoopState, width: int) -> tuple[jax.Array, jax.Array]:
    """(positions int32 [B, width] of a round's first call, from base = L-1-fresh; the token after each).

    The first `fresh` entries are the verified tokens' (f_p, x_{p+1}); what the rest hold is the caller's
    (junk for `FeatureDraft`, placeholders for `BlockDraft`), rewritten before anyone reads it. The token read
    stays inside the buffer (a block drafter's 2K entries may reach past it near the end).
    """
    idx = (state.length - 1 - carry.fresh)[:, None] + arange32(width)[None, :]
    last_slot = state.tokens.shape[1] - 1
    return idx, jnp.maximum(jnp.take_along_axis(state.tokens, jnp.minimum(idx + 1, last_slot), axis=1), 0)

  def _catch_up(self, carry: FeatureCarry, state: LoopState, end) -> CatchUp:
    """The round's first call, which also yields d1's logits."""
    model = self._model()
    # Catch-up: entries at base .. base+K (`_entries`); entry fresh-1 (p = L-2) predicts d1.
    idx, nxt = self._entries(carry, state, self.k + 1)
    logits, hidden, cache = model(
      nxt, model.fuse(carry.features), clamp_positions(idx, end), carry.cache, logits_at=carry.fresh - 1
    )
    return CatchUp(logits[:, 0], gather_rows(hidden, carry.fresh - 1), cache)

  def propose_chain(
    self, carry: FeatureCarry, state: LoopState, keys, params, *, all_greedy, end, constraint=None
  ) -> Drafts:
    length, k = state.length, self.k
    sample = chain_sampler(state, keys, params, all_greedy=all_greedy, constraint=constraint)
    first_logits, h, cache = self._catch_up(carry, state, end)
    first, q_first = sample(first_logits, 0, grammar_state=state.grammar_state)

    def step(carried, token, i):  # d_i at position L-2+i, reading the hidden that drafted it
      cache, h = carried
      logits, h, cache = self._model()(
        token[:, None], h[:, None], clamp_positions((length - 2 + i)[:, None], end), cache
      )
      return (cache, h[:, 0]), logits[:, 0]

    tokens, probs, (cache, _) = draft_chain(
      k, (cache, h), first, q_first, step, sample, constraint, state.grammar_state
    )
    return Drafts(tokens, probs, dataclasses.replace(carry, cache=cache))

  def propose_tree(
    self, carry: FeatureCarry, state: LoopState, keys, params, *, tree: DraftTree, all_greedy, max_length, end
  ) -> Drafts:
    # The entries of depth-i nodes sit at position L-2+i and slot L-1+j (node j),
    # each reading its parent's hidden (the catch-up's for depth 1).
    length = state.length
    root_logits, h, cache = self._catch_up(carry, state, end)

    def level(carried, i, tokens):
      cache, parent_h = carried  # parent_h [B, n_{i-1}, D]; node m's parent is m // k_i
      nodes = tree.level(i)
      hidden = jnp.repeat(parent_h, tree.branching[i - 1], axis=1)
      pos = clamp_positions(jnp.broadcast_to((length - 2 + i)[:, None], tokens.shape), end)
      slots = (length - 1)[:, None] + arange32(tree.num_nodes)[None, nodes]
      mask = tree_attention_mask(length - 1, length - 1, tree.ancestors[nodes], max_length)
      logits, hidden, cache = self._model()(tokens, hidden, pos, cache, cache_slots=slots, attention_mask=mask)
      return (cache, hidden), logits

    tokens, probs, (cache, _) = grow_tree(
      tree, root_logits, level, (cache, h[:, None]), params, keys, all_greedy=all_greedy
    )
    return Drafts(tokens, probs, dataclasses.replace(carry, cache=cache))

  def propose_dynamic(
    self, carry: FeatureCarry, state: LoopState, keys, params, *, tree: DynamicTree, all_greedy, max_length, end
  ) -> DynamicDrafts:
    # As propose_tree, with the frontier of depth i at slots L-1 + (i-1)*k + m (`dynamic_tree`).
    length, k = state.length, tree.top_k
    root_logits, h, cache = self._catch_up(carry, state, end)
    rows_b = arange32(length.shape[0])[:, None]

    def level(carried, i, tokens, parent, rows):
      cache, parent_h = carried  # [B, k, D] (depth 1: [B, 1, D], the catch-up's; parent is 0 there)
      pos = clamp_positions(jnp.broadcast_to((length - 2 + i)[:, None], tokens.shape), end)
      slots = (length - 1)[:, None] + (i - 1) * k + arange32(k)[None, :]
      mask = tree_attention_mask(length - 1, length - 1, rows, max_length)
      logits, hidden, cache = self._model()(
        tokens, parent_h[rows_b, parent], pos, cache, cache_slots=slots, attention_mask=mask
      )
      return (cache, hidden), logits

    tokens, parents, fed, probs, (cache, _) = grow_dynamic_tree(
      tree, root_logits, level, (cache, h[:, None]), params, keys, all_greedy=all_greedy
    )
    return DynamicDrafts(tokens, parents, fed, probs, dataclasses.replace(carry, cache=cache))

  def commit_tree(self, carry, src, dst):
    # Nothing to move: the next round's catch-up rewrites the accepted path from the target's features.
    return carry

  def observe(self, carry: FeatureCarry, features, kept):
    return dataclasses.replace(carry, features=features, fresh=jnp.maximum(kept, 1).astype(jnp.int32))


class BlockDraft(FeatureDraft):
  """A block drafter (`specdec_jax.models.BlockDrafter`): all K drafts' logits from one call.

  The call holds 2K entries at positions base .. base+2K-1, base = L-1-fresh: the first `fresh` are the
  verified tokens' (f_p, x_{p+1}), the catch-up of `FeatureDraft`; the rest are placeholders. Entry fresh-1
  (position L-2) gives d_1's logits and placeholder entry fresh-2+i (position L-3+i) d_i's:

      entry:      0 .. fresh-1        fresh     fresh+1   ...  fresh+K-2    ...  2K-1
      position:   L-1-fresh .. L-2    L-1       L         ...  L+K-3
      logits of:  d_1 (the last)      d_2       d_3       ...  d_K

  No placeholder sees a drafted token, so each draft's law is known before any is drawn; the drafts are then
  drawn one after another (`draft_chain`: penalties count the earlier drafts, a grammar masks each with the
  state after them), and the law each is drawn from is its q. The next round's window starts at the same L-1
  (L' - 1 - fresh' = L - 1) and rewrites every slot a placeholder wrote before any query reads it.

  Trees (DDTree, arXiv 2604.12989): every node of depth i drafts its children from position i's logits, static
  trees (`grow_tree`) and dynamic ones (`grow_dynamic_tree`) alike, still with the one call.
  """

  def _block(self, carry: FeatureCarry, state: LoopState, end) -> tuple[jax.Array, Any]:
    """The round's one drafter call: (logits [B, K, V] of d_1 .. d_K, the drafter's cache)."""
    model, k = self._model(), self.k
    width = 2 * k
    idx, nxt = self._entries(carry, state, width)
    placeholders = arange32(width)[None, :] >= carry.fresh[:, None]
    features = jnp.pad(carry.features, ((0, 0), (0, width - carry.features.shape[1]), (0, 0)))
    at = (carry.fresh - 1)[:, None] + arange32(k)[None, :]
    logits, _, cache = model(
      nxt, model.fuse(features), clamp_positions(idx, end), carry.cache, placeholders=placeholders, logits_at=at
    )
    return logits, cache

  def propose_chain(
    self, carry: FeatureCarry, state: LoopState, keys, params, *, all_greedy, end, constraint=None
  ) -> Drafts:
    logits, cache = self._block(carry, state, end)
    sample = chain_sampler(state, keys, params, all_greedy=all_greedy, constraint=constraint)
    first, q_first = sample(logits[:, 0], 0, grammar_state=state.grammar_state)

    def step(carried, token, i):  # the block's logits are all computed: no call per draft
      return carried, _position(logits, i, token.shape)

    tokens, probs, _ = draft_chain(self.k, (), first, q_first, step, sample, constraint, state.grammar_state)
    return Drafts(tokens, probs, dataclasses.replace(carry, cache=cache))

  def propose_tree(
    self, carry: FeatureCarry, state: LoopState, keys, params, *, tree: DraftTree, all_greedy, max_length, end
  ) -> Drafts:
    # DDTree: every node of depth i drafts its children from position i's law (the block's logits do not
    # depend on the drafted tokens), so the tree costs the one call of a chain.
    logits, cache = self._block(carry, state, end)

    def level(carried, i, tokens):
      return carried, _position(logits, i, tokens.shape)

    tokens, probs, _ = grow_tree(tree, logits[:, 0], level, (), params, keys, all_greedy=all_greedy)
    return Drafts(tokens, probs, dataclasses.replace(carry, cache=cache))

  def propose_dynamic(
    self, carry: FeatureCarry, state: LoopState, keys, params, *, tree: DynamicTree, all_greedy, max_length, end
  ) -> DynamicDrafts:
    # As propose_tree: the frontier of depth i expands from position i's law.
    logits, cache = self._block(carry, state, end)

    def level(carried, i, tokens, parent, rows):
      return carried, _position(logits, i, tokens.shape)

    tokens, parents, fed, probs, _ = grow_dynamic_tree(
      tree, logits[:, 0], level, (), params, keys, all_greedy=all_greedy
    )
    return DynamicDrafts(tokens, parents, fed, probs, dataclasses.replace(carry, cache=cache))


def _position(logits, i, shape) -> jax.Array:
  """A block's logits [B, K, V] at position i (static or traced), for `shape` [B] (a chain's draft) or [B, n]
  (the n nodes of a tree's depth, all reading that one position's law)."""
  row = jax.lax.dynamic_index_in_dim(logits, i, axis=1, keepdims=len(shape) > 1)
  return jnp.broadcast_to(row, tuple(shape) + row.shape[-1:])


def chain_sampler(state: LoopState, keys, params: SamplingParams, *, all_greedy: bool, constraint=None):
  """`sample(logits [B, V], i, earlier=None, grammar_state=None) -> (draft i [B], its distribution [B, V] or
  None)` for one round.

  Draft i (static or traced) uses fold_in(keys[b], i). `earlier`: int32 [B, K]
  drafts 0 .. i-1 of this round (-1 elsewhere), which penalties count as
  context; None for draft 0. Greedy verification ignores draft probabilities,
  so all-greedy programs get None instead of a [B, K, V] tensor. With a
  `constraint`, `grammar_state` int32 [B] is the state after drafts 0 .. i-1:
  the draft is drawn from the law over its allowed set (all tokens where that
  set is empty: such a draft is never emitted), and that law is the returned
  distribution, which the verifier reads as q.
  """
  b = state.length.shape[0]

  def sample(logits, i, earlier=None, grammar_state=None):
    penalties = state.penalties
    if penalties is not None and earlier is not None:
      penalties = penalties.add_tokens(earlier, earlier >= 0)
    mask = None if constraint is None else constraint.sampler_masks(grammar_state)[0]
    token, log_probs = sample_tokens(
      logits,
      params,
      position_keys(keys, jnp.full((b,), i, jnp.int32)),
      all_greedy=all_greedy,
      penalty_state=penalties,
      token_bitmask=mask,
    )
    return token, None if all_greedy else jnp.exp(log_probs)

  return sample


def draft_chain(k, carry, first, q_first, step, sample, constraint=None, grammar_state=None):
  """d1 (given) then d2 .. dK by `step(carry, token, i) -> (carry, logits)`, sampled by `sample`.

  `sample(logits, i, earlier, grammar_state)` also gets the round's earlier drafts, int32
  [B, K] with -1 where none is drafted yet (penalties count them as context), and with a
  `constraint` the grammar state after them (`grammar_state`: s_0, the state before d1).

  Returns:
    Drafts(tokens int32 [B, K], probs [B, K, V] or None, carry).
  """
  if k == 1:
    return Drafts(first[:, None], None if q_first is None else q_first[:, None], carry)

  def body(c, i):
    carry, token, earlier, *walk = c  # walk: [the grammar state after `token`] with a constraint
    carry, logits = step(carry, token, i)
    nxt, q = sample(logits, i, earlier, *walk)
    walk = [constraint.advance(walk[0], nxt)] if walk else []
    return (carry, nxt, earlier.at[:, i].set(nxt), *walk), (nxt, q)

  earlier = jnp.full((first.shape[0], k), -1, jnp.int32).at[:, 0].set(first)
  walk = [] if constraint is None else [constraint.advance(grammar_state, first)]
  (carry, *_), (ds, qs) = jax.lax.scan(body, (carry, first, earlier, *walk), arange32(k)[1:], unroll=True)
  tokens = jnp.concatenate([first[:, None], ds.T], axis=1)
  probs = None if q_first is None else jnp.concatenate([q_first[:, None], jnp.moveaxis(qs, 0, 1)], axis=1)
  return Drafts(tokens, probs, carry)


def check_vocab(draft_v, target_v):
  """Refuses a draft whose vocabulary size differs from the target's (found when the prefill is traced)."""
  if draft_v != target_v:
    raise ValueError(
      f"speculative_generate: draft and target must share the vocabulary, got draft V={draft_v} and target V={target_v}"
    )
