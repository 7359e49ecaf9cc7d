"""Trees of drafts chosen at run time by the drafter's confidence (EAGLE-2 style): `DynamicTree`.

A static `DraftTree` gives every node at a depth the same number of children.
A dynamic tree spends its N nodes where the drafter is confident (EAGLE-2,
arXiv 2406.16858). Each round, with depth K and width k:

  1. The root's top-k tokens under the drafter's own log-probabilities are the
     candidates of depth 1. Each candidate's score is its path's summed log q,
     which estimates how likely the path is to be accepted.
  2. At each depth i < K, the k candidates of depth i with the highest scores
     (the frontier) are fed to the drafter in one call, and each frontier node
     adds its top-k children (k * k candidates) to depth i+1.
  3. The N candidates with the highest scores form the tree. A child's score
     never exceeds its parent's, and ties go to the lower index, which is the
     parent's, so a chosen node's ancestors are always chosen. The tree keeps
     the candidates' order (depth by depth), so parents come before children.

    candidates (k = 2, K = 3)            chosen, N = 4 (scores in brackets)
    depth 1:  a [-.2]   b [-1.9]         a, b, a->c, a->c->e  with parents [-1, -1, 0, 2]
    depth 2:  a->c [-.5]  a->d [-2.5]    (b was in the frontier too: its children
              b->f [-2.3] b->g [-3.0]     scored below the N-th best)
    depth 3:  a->c->e [-.9] ...

The children are deterministic (the top-k, no random draws), so the loop
verifies them without draft probabilities. Greedy rows walk to the argmax and
random rows draw from p and follow the matching child
(`tree_rejection_sample`, draft_probs=None). Both are lossless whatever the
drafter proposes. The drafter needs no sampling step, so a sampled round costs
the same as a greedy one.

The tree is a run-time value, so its parents are a [B, N] array, and each
query's mask and each node's position are computed from it. The verification
call's shape stays static: N+1 tokens, depth at most K. The frontier uses its
own slots in the drafter's cache: depth i's k nodes at node_base + (i-1)*k + m.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import reductions

__all__ = ["DynamicTree", "grow_dynamic_tree", "tree_ancestors"]


@dataclasses.dataclass(frozen=True)
class DynamicTree:
  """The static bounds of a tree that the drafter chooses each round: depth, width and node count.

  Attributes:
    depth: K >= 1: draft calls per round after the first (K-1) plus one, and the
      deepest node; `speculative_generate`'s num_speculative_tokens.
    top_k: k >= 1: children per expanded node, and nodes expanded per depth.
    num_nodes: N, the nodes verified per round, 1 <= N <= k + (K-1) * k * k.

  Example:
    >>> tree = DynamicTree(depth=5, top_k=8, num_nodes=48)
    >>> tree.num_candidates, tree.frontier_slots
    (264, 32)
  """

  depth: int
  top_k: int
  num_nodes: int

  def __post_init__(self):
    for name in ("depth", "top_k", "num_nodes"):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"draft_tree: DynamicTree.{name} must be an int >= 1, got {value!r}")
    if self.num_nodes > self.num_candidates:
      raise ValueError(f"draft_tree: DynamicTree.num_nodes={self.num_nodes} exceeds the {self.num_candidates} "
                       f"candidates of depth {self.depth} and top_k {self.top_k} (k + (K-1) * k * k)")

  @property
  def num_candidates(self) -> int:
    """M = k + (K-1) * k * k: the candidates a round scores."""
    return self.top_k + (self.depth - 1) * self.top_k ** 2

  @property
  def frontier_slots(self) -> int:
    """(K-1) * k: the drafter cache slots the frontiers of depths 1 .. K-1 take."""
    return (self.depth - 1) * self.top_k

  @property
  def is_chain(self) -> bool:
    return False


def _top_log_q(logits, k):
  """The k most likely tokens under the drafter's own distribution, and their log q [..., k].

  NaN counts as -inf, so it can never outrank a parent; so does a row with no
  finite logit (whose log q would be -inf - -inf = NaN).
  """
  logits = jnp.where(jnp.isnan(logits), -jnp.inf, logits.astype(jnp.float32))
  vals, ids = reductions.top_k(logits, k)
  log_q = vals - jax.nn.logsumexp(logits, axis=-1, keepdims=True)  # <= 0: logsumexp >= the max
  return jnp.where(jnp.isnan(log_q), -jnp.inf, log_q), ids


def grow_dynamic_tree(tree: DynamicTree, root_logits: jax.Array, level_logits, carry):
  """Drafts a tree of N nodes by the drafter's confidence, one depth per draft call.

  Args:
    tree: the `DynamicTree`.
    root_logits: float [B, V], the drafter's logits after the context.
    level_logits: `(carry, i, tokens [B, k], parent [B, k], rows [B, k, (K-1)*k]) -> (carry, logits [B, k, V])`:
      one draft call on the k frontier nodes of depth i (i = 1 .. K-1). parent[b, m] is the frontier index, at
      depth i-1, of node m's parent (zeros at depth 1: the root). The call writes node m at frontier slot
      (i-1)*k + m; rows[b, m, f] says whether frontier slot f holds node m or one of its ancestors.
    carry: the drafter's state, threaded through `level_logits`.

  Returns:
    (tokens int32 [B, N], parents int32 [B, N] in [-1, j), fed int32 [B, N],
    carry): nodes in topological order; fed[b, j] is the frontier slot node j was
    fed at, -1 for a node never fed to the drafter (a leaf of the candidates).

  Example:
    >>> tokens, parents, fed, carry = grow_dynamic_tree(DynamicTree(3, 2, 4), root_logits, level_logits, carry)
    ... # doctest: +SKIP
  """
  b = root_logits.shape[0]
  k, depth = tree.top_k, tree.depth
  rows = jnp.arange(b)[:, None]
  score, token = _top_log_q(root_logits, k)  # [B, k]: depth 1, all of it the first frontier
  scores, tokens, parent_ids = [score], [token], [jnp.full((b, k), -1, jnp.int32)]
  frontier_ids = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))  # candidate index of each frontier node
  frontier_parent = jnp.zeros((b, k), jnp.int32)
  anc = jnp.broadcast_to(jnp.eye(k, tree.frontier_slots, dtype=bool), (b, k, tree.frontier_slots))
  fed = jnp.full((b, tree.num_candidates), -1, jnp.int32)  # frontier slot of each candidate
  if depth > 1:
    fed = fed.at[:, :k].set(jnp.arange(k, dtype=jnp.int32))
  for i in range(1, depth):
    carry, logits = level_logits(carry, i, token, frontier_parent, anc)
    child_score, child_token = _top_log_q(logits, k)  # [B, k, k]
    cum = (score[:, :, None] + child_score).reshape(b, k * k)  # a path's summed log q
    start = k + (i - 1) * k * k  # candidate index of this depth's first child
    scores.append(cum)
    tokens.append(child_token.reshape(b, k * k))
    parent_ids.append(jnp.repeat(frontier_ids, k, axis=1))
    if i + 1 < depth:  # the next frontier: the k best children
      score, pick = jax.lax.top_k(cum, k)
      pick = pick.astype(jnp.int32)
      frontier_parent = pick // k
      token = tokens[-1][rows, pick]
      frontier_ids = start + pick
      fed = fed.at[rows, frontier_ids].set(i * k + jnp.arange(k, dtype=jnp.int32))
      own = jnp.arange(tree.frontier_slots)[None, None, :] == (i * k + jnp.arange(k))[None, :, None]
      anc = anc[rows, frontier_parent] | own
  scores, tokens, parent_ids = (jnp.concatenate(x, axis=1) for x in (scores, tokens, parent_ids))
  # The N best, in candidate order (parents first); top_k breaks ties towards the lower index (the parent).
  _, chosen = jax.lax.top_k(scores, tree.num_nodes)
  chosen = jnp.sort(chosen, axis=1).astype(jnp.int32)
  node_of = jnp.full((b, tree.num_candidates), -1, jnp.int32).at[rows, chosen].set(
      jnp.arange(tree.num_nodes, dtype=jnp.int32))
  parent_candidate = parent_ids[rows, chosen]
  parents = jnp.where(parent_candidate >= 0, node_of[rows, jnp.maximum(parent_candidate, 0)], -1)
  return tokens[rows, chosen].astype(jnp.int32), parents, fed[rows, chosen], carry


def tree_ancestors(parents: jax.Array, max_depth: int) -> tuple[jax.Array, jax.Array]:
  """Each node's ancestors and depth, from parents [B, N] (traced) of a tree at most max_depth deep.

  Args:
    parents: int32 [B, N], parents[b, j] in [-1, j) (-1: a child of the root).
    max_depth: static bound on the depth.

  Returns:
    (ancestors bool [B, N, N]: ancestors[b, j, a] iff node a is node j or one of
     its ancestors; depths int32 [B, N] in [1, max_depth]).

  Example:
    >>> anc, depth = tree_ancestors(jnp.array([[-1, -1, 0]]), 2)
    >>> depth.tolist(), anc[0, 2].astype(int).tolist()
    ([[1, 1, 2]], [1, 0, 1])
  """
  n = parents.shape[1]
  ids = jnp.arange(n, dtype=jnp.int32)
  node = jnp.broadcast_to(ids, parents.shape)
  anc = node[:, :, None] == ids[None, None, :]
  for _ in range(max_depth - 1):
    node = jnp.where(node >= 0, jnp.take_along_axis(parents, jnp.maximum(node, 0), axis=1), -1)
    anc = anc | ((node[:, :, None] == ids[None, None, :]) & (node >= 0)[:, :, None])
  return anc, jnp.sum(anc, axis=2, dtype=jnp.int32)
