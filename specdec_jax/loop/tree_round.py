"""One speculative round with a tree of drafts (static or dynamic), inside the loop's program.

`speculative_generate(..., draft_tree=...)` runs this round where `chain_round`
would run, in the same shape (`specdec_jax.loop.round`: keys, propose, verify,
commit, count); its propose and verify steps are:

    propose  propose_tree: the draft kind grows the tree (N nodes)
    verify   verify_tree: the target scores t and every node in one call (tree
             attention), `tree_rejection_sample` walks it;
             commit_path: the accepted path's cache slots move to where a chain
             round would have left them
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.drafts.dynamic_tree import DynamicTree, tree_ancestors
from specdec_jax.drafts.static_tree import tree_attention_mask
from specdec_jax.loop.round import RoundKeys, RoundSetup, Verified, clamp_positions, forced_emission
from specdec_jax.loop.state import LoopState, arange32, gather_rows
from specdec_jax.sampling import sample, stats
from specdec_jax.verify.tree import TreeRejectionOutput, tree_rejection_sample


def tree_round(s: LoopState, keys: RoundKeys, setup: RoundSetup) -> Verified:
  """Propose a tree of drafts, verify it in one target call, move the accepted path into place.

  The target sees the last context token t (the root) at slot L-1 and node j
  at slot L+j with position L-1+depth(j), each query the context and its
  own ancestors (`Transformer.__call__` draws the slots). The accepted path's
  keys/values then move to slots L, L+1, ..., as a chain round would have left them.

  Args:
    s: the loop state at the round's start.
    keys: the round's `RoundKeys`.
    setup: the program's `RoundSetup`, whose `tree` is a `DraftTree` or a `DynamicTree`.

  Returns:
    Verified(emitted int32 [B, K+1] (path, then one token, then -1), num_emitted [B],
    logprobs [B, K+1] or None, target cache, draft carry (path committed),
    features of [t, path] [B, K+1, F] or None).

  Example:
    >>> verified = tree_round(state, round_keys(row_keys, state.length, False), setup)  # doctest: +SKIP
  """
  drafts = propose_tree(s, keys, setup)
  verdict = verify_tree(s, drafts, keys, setup)
  if setup.forced_accepts is not None:  # the benchmark knob (`specdec_jax.loop.forced`): NOT LOSSLESS
    verdict = verdict._replace(walk=force_tree(verdict, drafts, setup.tree, setup.forced_accepts))
  return commit_path(s, drafts, verdict, setup)


class TreeDrafts(NamedTuple):
  """A tree's proposal, static or dynamic, in the form the verifier takes.

  Attributes:
    tokens: int32 [B, N] nodes in topological order.
    parents: int32 [N] (static) or [B, N] (dynamic), -1 for the root's children.
    depths: int32 [1, N] or [B, N], each node's depth in 1 .. K.
    ancestors: bool [N, N] or [B, N, N]: ancestors[.., j, i] says node i is node j or one of its ancestors.
    fed: int32 [B, N] the drafter's frontier slot of each node (-1 never fed), or None (static trees).
    probs: f32 [B, N+1, V] or None.
    carry: the draft kind's carry.
    verify_kw: how `tree_rejection_sample` walks it (siblings' draws, max depth).
  """

  tokens: jax.Array
  parents: Any
  depths: jax.Array
  ancestors: Any
  fed: jax.Array | None
  probs: jax.Array | None
  carry: Any
  verify_kw: dict


def propose_tree(s: LoopState, keys: RoundKeys, setup: RoundSetup) -> TreeDrafts:
  """The draft kind grows the tree: a static one, or a dynamic one chosen at run time."""
  tree, kw = setup.tree, dict(all_greedy=setup.all_greedy, max_length=setup.max_length, end=setup.end)
  if isinstance(tree, DynamicTree):  # top-k children (no draft probabilities), or sampled ones verified with q
    drafts = setup.kind.propose_dynamic(s.draft, s, keys.draft, setup.params, tree=tree, **kw)
    ancestors, depths = tree_ancestors(drafts.parents, tree.depth)
    return TreeDrafts(
      drafts.tokens,
      drafts.parents,
      depths,
      ancestors,
      drafts.fed,
      drafts.probs,
      drafts.carry,
      dict(max_depth=tree.depth, sibling_draws="without_replacement"),
    )  # how a sampled tree draws
  drafts = setup.kind.propose_tree(s.draft, s, keys.draft, setup.params, tree=tree, **kw)
  return TreeDrafts(
    drafts.tokens,
    tree.parents,
    jnp.asarray(tree.depths)[None, :],
    tree.ancestors,
    None,
    drafts.probs,
    drafts.carry,
    dict(sibling_draws=tree.sibling_draws),
  )  # as the drafter drew them (static_tree.child_tokens)


class TreeVerdict(NamedTuple):
  """The tree's verification: the verifier's walk and what the target call returned."""

  walk: Any  # TreeRejectionOutput: token_ids, num_emitted, num_accepted, accepted_nodes
  target_logits: jax.Array  # [B, N+1, V]: t's, then each node's
  target_cache: Any
  features: jax.Array | None  # [B, N+1, F]


def verify_tree(s: LoopState, drafts: TreeDrafts, keys: RoundKeys, setup: RoundSetup) -> TreeVerdict:
  """The target scores t and every node in one call (tree attention); `tree_rejection_sample` walks the tree."""
  length = s.length
  b, n = drafts.tokens.shape
  if drafts.ancestors.ndim == 3:
    rows = jnp.concatenate([jnp.zeros((b, 1, n), bool), drafts.ancestors], axis=1)  # t sees the context only
  else:
    rows = np.concatenate([np.zeros((1, n), bool), drafts.ancestors])
  last = gather_rows(s.tokens, length - 1)
  tokens = jnp.concatenate([last[:, None], drafts.tokens], axis=1)  # [B, N+1]
  positions = clamp_positions((length - 1)[:, None] + jnp.pad(drafts.depths, ((0, 0), (1, 0))), setup.end)
  slots = (length - 1)[:, None] + arange32(n + 1)[None, :]
  kw = dict(cache_slots=slots, attention_mask=tree_attention_mask(length, length, rows, setup.max_length))
  if setup.kind.needs_features:
    target_logits, features, target_cache = setup.target_apply(
      tokens, positions, s.target_cache, return_features=True, **kw
    )
  else:
    (target_logits, target_cache), features = setup.target_apply(tokens, positions, s.target_cache, **kw), None
  walk = tree_rejection_sample(
    draft_token_ids=drafts.tokens,
    parents=drafts.parents,
    target_logits=target_logits,
    params=setup.params,
    key=keys.verify,
    draft_probs=drafts.probs,
    all_greedy=setup.all_greedy,
    **drafts.verify_kw,
  )
  return TreeVerdict(walk, target_logits, target_cache, features)


def force_tree(verdict: TreeVerdict, drafts: TreeDrafts, tree, accepts: int) -> TreeRejectionOutput:
  """The walk replaced by one that accepted `accepts` nodes of the first-child path. Benchmark knob, NOT LOSSLESS.

  The first-child path of a static tree is the first node of every depth
  (children are numbered in their parents' order: `DraftTree.parents`); the
  walk emits its first `accepts` nodes, then the target's own token after them
  (`forced_emission`). A dynamic tree's first path may end before depth K, so
  the entry point refuses it.

  Args:
    verdict: the tree's verification (the verifier's walk and the target's logits [B, N+1, V]).
    drafts: the tree's proposal (tokens [B, N]).
    tree: the static `DraftTree`.
    accepts: static int in [0, K].
  """
  walk, b = verdict.walk, drafts.tokens.shape[0]
  path = np.asarray(tree.level_starts, np.int32)  # [K] the first-child path's nodes, one per depth
  on_path = jnp.all(walk.accepted_nodes[:, :accepts] == path[None, :accepts], axis=1)
  verifier_stopped = (walk.num_accepted == accepts) & on_path
  stop_row = 0 if accepts == 0 else int(path[accepts - 1]) + 1  # logits row 0 is the root's, row j+1 node j's
  token_ids = forced_emission(
    drafts.tokens[:, path], verdict.target_logits[:, stop_row], walk.token_ids, verifier_stopped, accepts
  )
  nodes = np.where(np.arange(len(path)) < accepts, path, -1).astype(np.int32)
  num_accepted = jnp.full((b,), accepts, jnp.int32)
  return TreeRejectionOutput(
    token_ids=token_ids,
    accepted_nodes=jnp.broadcast_to(jnp.asarray(nodes), (b, len(path))),
    num_accepted=num_accepted,
    num_emitted=num_accepted + 1,
  )


def commit_path(s: LoopState, drafts: TreeDrafts, verdict: TreeVerdict, setup: RoundSetup) -> Verified:
  """Moves the accepted path's cache slots to where a chain round would have left them; gathers its rows."""
  length, walk, k, max_length = s.length, verdict.walk, setup.k, setup.max_length
  b = length.shape[0]
  depth = arange32(k)[None, :]
  accepted = depth < walk.num_accepted[:, None]
  src = length[:, None] + jnp.maximum(walk.accepted_nodes, 0)
  dst = jnp.where(accepted, length[:, None] + depth, max_length)  # max_length: dropped
  target_cache = setup.target_copy(verdict.target_cache, src, dst)
  if drafts.fed is not None:
    # The drafter holds only the frontier nodes it was fed, at their frontier slots. The path's last node
    # may not have been fed; the next round's first call writes it, as for a chain's last draft.
    slot = jnp.take_along_axis(drafts.fed, jnp.maximum(walk.accepted_nodes, 0), axis=1)
    src, dst = length[:, None] + jnp.maximum(slot, 0), jnp.where(slot >= 0, dst, max_length)
  draft_carry = setup.kind.commit_tree(drafts.carry, src, dst)
  # The logits rows (and target features) the emitted tokens came from: t's, then the path's nodes'.
  path = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.where(accepted, walk.accepted_nodes + 1, 0)], axis=1)
  features = verdict.features
  if features is not None:
    features = jnp.take_along_axis(features, path[:, :, None], axis=1)
  lp = None
  if setup.logprobs is not None:
    path_logits = jnp.take_along_axis(verdict.target_logits, path[:, :, None], axis=1)  # [B, K+1, V]
    lp = path_logprobs(path_logits, walk.token_ids, setup.params, setup.logprobs, setup.all_greedy)
  return Verified(
    emitted=walk.token_ids,
    num_emitted=walk.num_emitted,
    logprobs=lp,
    target_cache=target_cache,
    draft_carry=draft_carry,
    features=features,
  )


def path_logprobs(logits, tokens, params, mode, all_greedy):
  """log p(token) [B, T] of emitted tokens under their logits [B, T, V] (`rejection_sample`'s `logprobs` modes)."""
  greedy = jnp.full(params.is_greedy.shape, True) if all_greedy else params.is_greedy
  if all_greedy:
    processed = jnp.zeros(tokens.shape, jnp.float32)
  else:
    logp = sample.process_logits(logits, params)
    processed = jnp.take_along_axis(logp, jnp.clip(tokens, 0, logits.shape[-1] - 1)[..., None], axis=-1)[..., 0]
  lp = stats.requested_log_probs(logits, tokens, params, processed, mode, greedy)
  return jnp.where(tokens >= 0, lp, 0.0)
