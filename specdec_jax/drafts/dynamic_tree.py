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

**Sampled children (`sampled=True`), lossless at any temperature with draft
probabilities.** Deterministic children suit greedy rows; a random row accepts
a node only if its own draw from p lands on it. With `sampled=True` a random
row instead draws each expanded node's k children without replacement from the
drafter's processed distribution q (temperature, top-k, top-p), and the loop
verifies them by recursive rejection with q (`tree_rejection_sample(...,
sibling_draws="without_replacement")`). Then a node may only be kept or dropped
by what was known before its own draw, or the kept children would no longer be
draws from q: the frontier is still chosen by score (a node's score decides
whether *its children* exist, which they do not yet), but the final cut to the
N best is not made. Every candidate is verified, so `num_nodes` must equal
`num_candidates`. Greedy rows take the top-k as before.

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

from specdec_jax.drafts.static_tree import child_tokens, node_keys
from specdec_jax.sampling import reductions
from specdec_jax.sampling.params import SamplingParams

__all__ = ["DynamicTree", "grow_dynamic_tree", "tree_ancestors"]


@dataclasses.dataclass(frozen=True)
class DynamicTree:
  """The static bounds of a tree that the drafter chooses each round: depth, width and node count.

  Attributes:
    depth: K >= 1: draft calls per round after the first (K-1) plus one, and the
      deepest node; `speculative_generate`'s num_speculative_tokens.
    top_k: k >= 1: children per expanded node, and nodes expanded per depth.
    num_nodes: N, the nodes verified per round, 1 <= N <= k + (K-1) * k * k
      (with `sampled`, exactly k + (K-1) * k * k).
    sampled: random rows draw children without replacement from q and are
      verified with it (module docstring); False: the top-k for every row.

  Example:
    >>> tree = DynamicTree(depth=5, top_k=8, num_nodes=48)
    >>> tree.num_candidates, tree.frontier_slots
    (264, 32)
    >>> DynamicTree(depth=3, top_k=3, num_nodes=21, sampled=True).num_candidates
    21
  """

  depth: int
  top_k: int
  num_nodes: int
  sampled: bool = False

  def __post_init__(self):
    for name in ("depth", "top_k", "num_nodes"):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"draft_tree: DynamicTree.{name} must be an int >= 1, got {value!r}")
    if not isinstance(self.sampled, (bool, np.bool_)):
      raise ValueError(f"draft_tree: DynamicTree.sampled must be a bool, got {self.sampled!r}")
    if self.num_nodes > self.num_candidates:
      raise ValueError(
        f"draft_tree: DynamicTree.num_nodes={self.num_nodes} exceeds the {self.num_candidates} "
        f"candidates of depth {self.depth} and top_k {self.top_k} (k + (K-1) * k * k)"
      )
    if self.sampled and self.num_nodes != self.num_candidates:
      raise ValueError(
        f"draft_tree: a sampled DynamicTree verifies every candidate, so num_nodes must be "
        f"k + (K-1) * k * k = {self.num_candidates} for depth {self.depth} and top_k "
        f"{self.top_k}, got {self.num_nodes}"
      )

  @property
  def num_candidates(self) -> int:
    """M = k + (K-1) * k * k: the candidates a round scores."""
    return self.top_k + (self.depth - 1) * self.top_k**2

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
  logits = _finite_or_neg_inf(logits)
  vals, ids = reductions.top_k(logits, k)
  return _log_q(vals, logits), ids


def _finite_or_neg_inf(logits):
  """float32 logits with NaN as -inf (a NaN logit is never drafted and never outranks a parent)."""
  return jnp.where(jnp.isnan(logits), -jnp.inf, logits.astype(jnp.float32))


def _log_q(values, logits):
  """log q of `values` [..., m] taken from `logits` [..., V] (NaN-free), with NaN (a row with no finite
  logit: -inf - -inf) as -inf."""
  log_q = values - jax.nn.logsumexp(logits, axis=-1, keepdims=True)  # <= 0: logsumexp >= the max
  return jnp.where(jnp.isnan(log_q), -jnp.inf, log_q)


def _children(logits, k, tree, params, keys, ids, all_greedy):
  """Children of n nodes: (log q [B, n, k] for the scores, tokens int32 [B, n, k], q [B, n, V] or None).

  The top-k, or with `tree.sampled` (and a random row) k draws without
  replacement from the processed q, child (m, c) keyed by fold_in(keys[b], ids[m, c]).
  """
  if not tree.sampled or all_greedy:
    log_q, tokens = _top_log_q(logits, k)
    return log_q, tokens.astype(jnp.int32), None
  b, n, _ = logits.shape
  tokens, q = child_tokens(logits, k, params, node_keys(keys, ids), all_greedy=False, without_replacement=True)
  tokens = tokens.reshape(b, n, k)
  raw = _finite_or_neg_inf(logits)
  return _log_q(jnp.take_along_axis(raw, tokens, axis=-1), raw), tokens, q


def grow_dynamic_tree(
  tree: DynamicTree,
  root_logits: jax.Array,
  level_logits,
  carry,
  params: SamplingParams | None = None,
  keys: jax.Array | None = None,
  *,
  all_greedy: bool = True,
):
  """Drafts a tree of N nodes by the drafter's confidence, one depth per draft call.

  Args:
    tree: the `DynamicTree`.
    root_logits: float [B, V], the drafter's logits after the context.
    level_logits: `(carry, i, tokens [B, k], parent [B, k], rows [B, k, (K-1)*k]) -> (carry, logits [B, k, V])`:
      one draft call on the k frontier nodes of depth i (i = 1 .. K-1). parent[b, m] is the frontier index, at
      depth i-1, of node m's parent (zeros at depth 1: the root). The call writes node m at frontier slot
      (i-1)*k + m; rows[b, m, f] says whether frontier slot f holds node m or one of its ancestors.
    carry: the drafter's state, threaded through `level_logits`.
    params, keys, all_greedy: for a `sampled` tree only: the rows' SamplingParams,
      typed keys [B] (one per row and round; candidate j uses fold_in(keys[b], j)),
      and the static all-greedy promise (then every row takes the top-k).

  Returns:
    (tokens int32 [B, N], parents int32 [B, N] in [-1, j), fed int32 [B, N],
    draft_probs float32 [B, N+1, V] or None, carry): nodes in topological
    order; fed[b, j] is the frontier slot node j was fed at, -1 for a node never
    fed to the drafter (a leaf of the candidates). draft_probs (a sampled tree
    with random rows only) holds q at the root (row 0) and at each expanded node
    j (row j+1; zeros elsewhere), as `tree_rejection_sample` takes it.

  Example:
    >>> tokens, parents, fed, _, carry = grow_dynamic_tree(DynamicTree(3, 2, 4), root_logits, level_logits,
    ...                                                    carry)  # doctest: +SKIP
  """
  b, v = root_logits.shape
  k, depth = tree.top_k, tree.depth
  sampled = tree.sampled and not all_greedy
  if sampled and (params is None or keys is None):
    raise ValueError("grow_dynamic_tree: a sampled tree with random rows needs params and keys")
  rows = jnp.arange(b)[:, None]
  score, token, q = _children(
    root_logits[:, None, :], k, tree, params, keys, jnp.arange(k, dtype=jnp.int32)[None, :], all_greedy
  )
  score, token = score[:, 0], token[:, 0]  # [B, k]: depth 1, all of it the first frontier
  probs = None
  if sampled:  # row 0: the root's q; row j+1: expanded candidate j's (filled below)
    probs = jnp.zeros((b, tree.num_candidates + 1, v), jnp.float32).at[:, 0].set(q[:, 0])
  scores, tokens, parent_ids = [score], [token], [jnp.full((b, k), -1, jnp.int32)]
  frontier_ids = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))  # candidate index of each frontier node
  frontier_parent = jnp.zeros((b, k), jnp.int32)
  anc = jnp.broadcast_to(jnp.eye(k, tree.frontier_slots, dtype=bool), (b, k, tree.frontier_slots))
  fed = jnp.full((b, tree.num_candidates), -1, jnp.int32)  # frontier slot of each candidate
  if depth > 1:
    fed = fed.at[:, :k].set(jnp.arange(k, dtype=jnp.int32))
  for i in range(1, depth):
    carry, logits = level_logits(carry, i, token, frontier_parent, anc)
    start = k + (i - 1) * k * k  # candidate index of this depth's first child
    ids = start + jnp.arange(k * k, dtype=jnp.int32).reshape(k, k)
    child_score, child_token, q = _children(logits, k, tree, params, keys, ids, all_greedy)  # [B, k, k]
    if sampled:  # the frontier nodes' q, from which their children were just drawn
      probs = probs.at[rows, 1 + frontier_ids].set(q)
    cum = (score[:, :, None] + child_score).reshape(b, k * k)  # a path's summed log q
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
  if tree.sampled:  # every candidate: a cut by a node's own score would bias its draw (module docstring)
    return tokens.astype(jnp.int32), parent_ids.astype(jnp.int32), fed, probs, carry
  # The N best, in candidate order (parents first); top_k breaks ties towards the lower index (the parent).
  _, chosen = jax.lax.top_k(scores, tree.num_nodes)
  chosen = jnp.sort(chosen, axis=1).astype(jnp.int32)
  node_of = (
    jnp.full((b, tree.num_candidates), -1, jnp.int32).at[rows, chosen].set(jnp.arange(tree.num_nodes, dtype=jnp.int32))
  )
  parent_candidate = parent_ids[rows, chosen]
  parents = jnp.where(parent_candidate >= 0, node_of[rows, jnp.maximum(parent_candidate, 0)], -1)
  return tokens[rows, chosen].astype(jnp.int32), parents, fed[rows, chosen], None, carry


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
