"""Planted bugs for the lossless tests: tree verifiers that are wrong on purpose, which the tests' statistics must
reject (a test that cannot tell them from the real verifier proves nothing)."""

import jax.numpy as jnp
import numpy as np

from specdec_jax.sampling.sample import sample_tokens
from specdec_jax.verify.tree import TreeRejectionOutput


def accept_first_children(
  draft_token_ids,
  parents,
  target_logits,
  params,
  key=None,
  draft_probs=None,
  num_nodes=None,
  all_greedy=False,
  sibling_draws="iid",
):
  """A planted bug: always accepts the first child at every depth, then a target-sampled bonus."""
  tree_parents = np.asarray(parents)
  b, n = draft_token_ids.shape
  path, last = [], -1
  for j in range(n):
    if tree_parents[j] == last:
      path.append(j)
      last = j
  bonus, _ = sample_tokens(target_logits[:, last + 1], params, key, all_greedy=all_greedy)
  d = len(path)
  return TreeRejectionOutput(
    token_ids=jnp.concatenate([draft_token_ids[:, path], bonus[:, None]], axis=1),
    accepted_nodes=jnp.broadcast_to(jnp.asarray(path, jnp.int32), (b, d)),
    num_accepted=jnp.full((b,), d, jnp.int32),
    num_emitted=jnp.full((b,), d + 1, jnp.int32),
  )


def accept_first_children_per_row(
  draft_token_ids,
  parents,
  target_logits,
  params,
  key=None,
  draft_probs=None,
  num_nodes=None,
  all_greedy=False,
  max_depth=None,
  **_,
):
  """A planted bug for per-row trees: accepts node 0, then each accepted node's first child, then a bonus."""
  b, n = draft_token_ids.shape
  node = jnp.full((b,), -1, jnp.int32)
  path = []
  for _ in range(max_depth):
    is_child = parents == node[:, None]
    child = jnp.where(jnp.any(is_child, axis=1), jnp.argmax(is_child, axis=1), -1).astype(jnp.int32)
    path.append(child)
    node = jnp.where(child >= 0, child, node)
  path = jnp.stack(path, axis=1)  # [B, D]; -1 once a leaf is reached
  accepted = jnp.sum(path >= 0, axis=1, dtype=jnp.int32)
  bonus, _ = sample_tokens(
    jnp.take_along_axis(target_logits, (node + 1)[:, None, None], axis=1)[:, 0], params, key, all_greedy=all_greedy
  )
  toks = jnp.where(path >= 0, jnp.take_along_axis(draft_token_ids, jnp.maximum(path, 0), axis=1), -1)
  toks = jnp.concatenate([toks, jnp.full((b, 1), -1, jnp.int32)], axis=1)
  toks = toks.at[jnp.arange(b), accepted].set(bonus)
  return TreeRejectionOutput(token_ids=toks, accepted_nodes=path, num_accepted=accepted, num_emitted=accepted + 1)
