"""One speculative round with a tree of drafts (static or dynamic), inside the loop's program.

`specdec_jax.loop.decoding.speculative_generate(..., draft_tree=...)` runs this
round instead of the chain's: the drafter grows the tree, the target verifies
every node in one call (tree attention), `tree_rejection_sample` walks it, and
the accepted path's cache slots move to where a chain round would have left them.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from specdec_jax.drafts.dynamic_tree import DynamicTree, tree_ancestors
from specdec_jax.drafts.static_tree import DraftTree, tree_attention_mask
from specdec_jax.loop.state import LoopState, arange32, gather_rows
from specdec_jax.sampling import sample, stats
from specdec_jax.verify.tree import tree_rejection_sample


def tree_round(s: LoopState, drafter, tree: DraftTree | DynamicTree, t_apply, t_copy, params, draft_keys,
                reject_keys, *, all_greedy, logprobs, max_length):
  """One round with a tree of drafts: draft it, verify it in one target call, move the accepted path into place.

  The target sees the last context token t (the root) at slot L-1 and node j
  at slot L+j with position L-1+depth(j), each query the context and its
  own ancestors (`Transformer.__call__` draws the slots). The accepted path's
  keys/values then move to slots L, L+1, ..., as a chain round would have left them.

  Returns:
    (emitted int32 [B, K+1] (path, then one token, then -1), num_emitted [B],
    logprobs [B, K+1] or None, target cache, draft carry, features of
    [t, path] [B, K+1, F] or None).
  """
  length = s.length
  b, k, n = length.shape[0], tree.depth, tree.num_nodes
  dynamic = isinstance(tree, DynamicTree)
  if dynamic:  # chosen at run time: top-k children (no draft probabilities), or sampled ones verified with q
    nodes, parents, fed, draft_probs, draft_carry = drafter.propose_dynamic(s.draft, s, tree, max_length, params,
                                                                            draft_keys, all_greedy)
    ancestors, depths = tree_ancestors(parents, k)
    verify_kw = dict(max_depth=k, sibling_draws="without_replacement")  # how a sampled tree draws
    rows = jnp.concatenate([jnp.zeros((b, 1, n), bool), ancestors], axis=1)  # t sees the context only
  else:
    nodes, draft_probs, draft_carry = drafter.propose_tree(s.draft, s, draft_keys, tree, params, all_greedy,
                                                           max_length)
    parents, depths = tree.parents, jnp.asarray(tree.depths)[None, :]
    verify_kw = dict(sibling_draws=tree.sibling_draws)  # as the drafter drew them (static_tree.child_tokens)
    rows = np.concatenate([np.zeros((1, n), bool), tree.ancestors])  # t sees the context only
  last = gather_rows(s.tokens, length - 1)
  verify = jnp.concatenate([last[:, None], nodes], axis=1)  # [B, N+1]
  positions = (length - 1)[:, None] + jnp.pad(depths, ((0, 0), (1, 0)))
  slots = (length - 1)[:, None] + arange32(n + 1)[None, :]
  kw = dict(cache_slots=slots, attention_mask=tree_attention_mask(length, length, rows, max_length))
  if drafter.needs_features:
    target_logits, features, t_cache = t_apply(verify, positions, s.target_cache, return_features=True, **kw)
  else:
    (target_logits, t_cache), features = t_apply(verify, positions, s.target_cache, **kw), None
  out = tree_rejection_sample(draft_token_ids=nodes, parents=parents, target_logits=target_logits,
                              params=params, key=reject_keys, draft_probs=draft_probs, all_greedy=all_greedy,
                              **verify_kw)

  depth = arange32(k)[None, :]
  accepted = depth < out.num_accepted[:, None]
  src = length[:, None] + jnp.maximum(out.accepted_nodes, 0)
  dst = jnp.where(accepted, length[:, None] + depth, max_length)  # max_length: dropped
  t_cache = t_copy(t_cache, src, dst)
  if dynamic:
    # The drafter holds only the frontier nodes it was fed, at their frontier slots. The path's last node
    # may not have been fed; the next round's first call writes it, as for a chain's last draft.
    slot = jnp.take_along_axis(fed, jnp.maximum(out.accepted_nodes, 0), axis=1)
    src, dst = length[:, None] + jnp.maximum(slot, 0), jnp.where(slot >= 0, dst, max_length)
  draft_carry = drafter.commit_tree(draft_carry, src, dst)
  # The logits rows (and target features) the emitted tokens came from: t's, then the path's nodes'.
  path = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.where(accepted, out.accepted_nodes + 1, 0)], axis=1)
  if features is not None:
    features = jnp.take_along_axis(features, path[:, :, None], axis=1)
  lp = None
  if logprobs is not None:
    path_logits = jnp.take_along_axis(target_logits, path[:, :, None], axis=1)  # [B, K+1, V]
    lp = path_logprobs(path_logits, out.token_ids, params, logprobs, all_greedy)
  return out.token_ids, out.num_emitted, lp, t_cache, draft_carry, features


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

