"""Static trees of drafts for the decoding loop: their shape, their attention masks, and their growth.

`speculative_generate(..., draft_tree=(k_1, ..., k_K))` drafts a tree instead
of a chain: every node at depth i-1 (the root, the context, at depth 0) gets
k_i children, so depth i holds n_i = k_1 * ... * k_i nodes and the tree
N = n_1 + ... + n_K. Nodes are numbered depth by depth (a parent before its
children), and the children of the m-th node of a depth are consecutive:

    draft_tree = (2, 2, 1)                  parents = [-1, -1, 0, 0, 1, 1, 2, 3, 4, 5]
                 root                       depth 1: nodes 0, 1
               /      \\                      depth 2: nodes 2..5 (node m's parent: 0 + (m-2) // 2)
             0          1                   depth 3: nodes 6..9 (one child each)
            / \\        / \\
           2   3      4   5
           |   |      |   |
           6   7      8   9

A drafter grows such a tree one depth per call (`grow_tree`): each call feeds
the nodes of one depth and its logits give each node its children
(`child_tokens`: a greedy row takes the top-k_i tokens, a random row draws k_i
tokens i.i.d. from its processed distribution, whose probabilities go to
`tree_rejection_sample`). Every node has its own cache slot and sees only its
ancestors (`tree_attention_mask`); see `Transformer.__call__` for the slots.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.sampling import reductions, sample
from specdec_jax.sampling.draws import categorical_from_log_weights
from specdec_jax.sampling.params import SamplingParams
from specdec_jax.verify.tree import SIBLING_DRAWS

__all__ = ["DraftTree", "tree_attention_mask", "child_tokens", "grow_tree", "node_keys"]


@dataclasses.dataclass(frozen=True)
class DraftTree:
  """The static shape of a tree of drafts: `branching[i]` children for every node at depth i.

  Attributes:
    branching: (k_1, ..., k_K), each an int >= 1; `(1,) * K` is a chain of K drafts.
    sibling_draws: how a model drafter's random rows draw a node's children
      from its q: "without_replacement" (default: distinct siblings, which are
      accepted more often) or "iid"; the loop verifies them accordingly
      (`tree_rejection_sample(..., sibling_draws=)`).

  Example:
    >>> tree = DraftTree((2, 2, 1))
    >>> tree.num_nodes, tree.level_sizes, tree.parents.tolist()
    (10, (2, 4, 4), [-1, -1, 0, 0, 1, 1, 2, 3, 4, 5])
  """

  branching: tuple[int, ...]
  sibling_draws: str = "without_replacement"

  def __post_init__(self):
    if self.sibling_draws not in SIBLING_DRAWS:
      raise ValueError(f"draft_tree: sibling_draws must be one of {SIBLING_DRAWS}, got {self.sibling_draws!r}")
    b = self.branching
    if (
      not isinstance(b, tuple)
      or not b
      or any(not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 1 for k in b)
    ):
      raise ValueError(
        f"draft_tree must be a non-empty tuple of ints >= 1 (children per node at each depth), got {b!r}"
      )

  @property
  def depth(self) -> int:
    """K, the number of depths (draft positions)."""
    return len(self.branching)

  @property
  def is_chain(self) -> bool:
    return all(k == 1 for k in self.branching)

  @functools.cached_property
  def level_sizes(self) -> tuple[int, ...]:
    """(n_1, ..., n_K): the nodes at each depth."""
    return tuple(int(n) for n in np.cumprod(self.branching))

  @functools.cached_property
  def level_starts(self) -> tuple[int, ...]:
    """The index of the first node of each depth."""
    return tuple(int(s) for s in np.concatenate([[0], np.cumsum(self.level_sizes)[:-1]]))

  @property
  def num_nodes(self) -> int:
    """N, all nodes of the tree."""
    return sum(self.level_sizes)

  @functools.cached_property
  def parents(self) -> np.ndarray:
    """int32 [N]: each node's parent, -1 for the root's children (`tree_rejection_sample`'s `parents`)."""
    out = [-1] * self.level_sizes[0]
    for i in range(1, self.depth):
      start_above = self.level_starts[i - 1]
      out += [start_above + m // self.branching[i] for m in range(self.level_sizes[i])]
    return np.asarray(out, np.int32)

  @functools.cached_property
  def depths(self) -> np.ndarray:
    """int32 [N]: each node's depth, 1 .. K."""
    return np.repeat(np.arange(1, self.depth + 1), self.level_sizes).astype(np.int32)

  @functools.cached_property
  def ancestors(self) -> np.ndarray:
    """bool [N, N]: ancestors[j, a] iff node a is node j or one of its ancestors."""
    n = self.num_nodes
    out = np.eye(n, dtype=bool)
    for j in range(n):  # parents come first, so their rows are complete
      if self.parents[j] >= 0:
        out[j] |= out[self.parents[j]]
    return out

  def level(self, i: int) -> slice:
    """The node indices at depth i (1-based)."""
    return slice(self.level_starts[i - 1], self.level_starts[i - 1] + self.level_sizes[i - 1])


def tree_attention_mask(context_end: jax.Array, node_base: jax.Array, rows: np.ndarray, max_length: int) -> jax.Array:
  """Which cache slots each query of a tree call sees: the context, and its own ancestors.

  Node j of a row sits at slot node_base[b] + j; the context is every slot below
  context_end[b].

  Args:
    context_end: int [B]: query slots s < context_end[b] are the committed context.
    node_base: int [B]: the slot of node 0.
    rows: bool [T, N] (static): rows[t, j] iff query t sees node j
      (`DraftTree.ancestors` rows, or zeros for a query that sees the context only);
      or bool [B, T, N], a per-row array (a tree chosen at run time, `dynamic_tree`).
    max_length: S, the cache's slots.

  Returns:
    bool [B, T, S], the `attention_mask` of `Transformer.__call__`.

  Example:
    >>> tree = DraftTree((2, 1))
    >>> m = tree_attention_mask(jnp.array([3]), jnp.array([3]), tree.ancestors, 8)
    >>> m[0, 2].astype(int).tolist()  # node 2 (child of node 0) sees slots 0..2, node 0 (slot 3), itself (slot 5)
    [1, 1, 1, 1, 0, 1, 0, 0]
  """
  per_row = jnp.ndim(rows) == 3
  rows = jnp.asarray(rows, bool) if per_row else np.asarray(rows, bool)
  n = rows.shape[-1]
  s = jnp.arange(max_length, dtype=jnp.int32)[None, :]
  offset = s - node_base.astype(jnp.int32)[:, None]  # [B, S]: the node a slot holds
  in_tree = (offset >= 0) & (offset < n)
  node = jnp.clip(offset, 0, n - 1)
  if per_row:
    sees = jnp.take_along_axis(rows, jnp.broadcast_to(node[:, None, :], rows.shape[:2] + node.shape[1:]), axis=2)
  else:
    sees = jnp.swapaxes(jnp.take(jnp.asarray(rows), node, axis=1), 0, 1)  # [B, T, S]
  return (s < context_end.astype(jnp.int32)[:, None])[:, None, :] | (in_tree[:, None, :] & sees)


def child_tokens(
  logits: jax.Array,
  num_children: int,
  params: SamplingParams,
  keys: jax.Array | None,
  *,
  all_greedy: bool,
  without_replacement: bool = True,
) -> tuple[jax.Array, jax.Array | None]:
  """Children for each of n nodes from the draft's logits at those nodes.

  A greedy row takes the node's top-`num_children` tokens (distinct, the argmax
  first); a random row draws `num_children` tokens from the node's processed
  distribution q (temperature, top-k, top-p): without replacement (default;
  each from q without the earlier children's tokens, so siblings are distinct,
  `tree_rejection_sample(..., sibling_draws="without_replacement")`) or i.i.d.
  A duplicate sibling can only be rejected where the first one was, so distinct
  siblings accept more often.

  Args:
    logits: float [B, n, V], the draft's logits at the n nodes.
    num_children: k (static), at most V.
    params: SamplingParams of batch B.
    keys: typed keys [B, n, k] (one per child), None with all_greedy.
    all_greedy: static: every row greedy (top-k only, no softmax, no RNG).
    without_replacement: static; how random rows draw (see above).

  Returns:
    (tokens int32 [B, n * k]: node m's children at m*k .. m*k+k-1,
     q float32 [B, n, V] or None with all_greedy: the distribution random rows
     drew from (greedy rows' rows are ignored by the sampler)).

  Example:
    >>> toks, q = child_tokens(jnp.log(jnp.array([[[.1, .6, .3]]])), 2, SamplingParams.greedy(1), None,
    ...                        all_greedy=True)
    >>> toks.tolist()
    [[1, 2]]
  """
  b, n, v = logits.shape
  k = num_children
  if k > v:
    raise ValueError(f"draft_tree: a node cannot have {k} children in a vocabulary of V={v} tokens")
  _, top = reductions.top_k(jnp.where(jnp.isnan(logits), -jnp.inf, logits), k)  # [B, n, k]
  top = top.astype(jnp.int32).reshape(b, n * k)
  if all_greedy:
    return top, None
  logq = sample.process_logits(logits, params)  # [B, n, V]
  flat = logq.reshape(b * n, v)
  draws = []
  for c in range(k):
    draws.append(categorical_from_log_weights(keys[:, :, c].reshape(b * n), flat))
    if without_replacement and c + 1 < k:  # the next child comes from q without this token
      flat = jnp.where(jnp.arange(v)[None, :] == draws[-1][:, None], -jnp.inf, flat)
  draws = jnp.stack(draws, axis=-1).reshape(b, n * k)
  tokens = jnp.where(params.is_greedy[:, None], top, draws).astype(jnp.int32)
  return tokens, jnp.exp(logq)


def node_keys(keys: jax.Array, ids: jax.Array) -> jax.Array:
  """Typed keys [B, n, k]: fold_in(keys[b], ids[m, c]) for row keys [B] and node ids int [n, k].

  Each node's draw has its own key, fixed by the row and the node's index, so
  it does not depend on the other rows or on the order nodes are drawn in.

  Example:
    >>> node_keys(jax.random.split(jax.random.key(0), 2), jnp.arange(6).reshape(3, 2)).shape
    (2, 3, 2)
  """
  return jax.vmap(lambda key: jax.vmap(jax.vmap(lambda j: jax.random.fold_in(key, j)))(ids))(keys)


def grow_tree(
  tree: DraftTree,
  root_logits: jax.Array,
  level_logits,
  carry,
  params: SamplingParams,
  keys: jax.Array | None,
  *,
  all_greedy: bool,
):
  """Drafts a whole tree, one depth per draft call.

  Args:
    tree: the `DraftTree`.
    root_logits: float [B, V], the draft's logits after the context (the root's children).
    level_logits: `(carry, i, tokens [B, n_i]) -> (carry, logits [B, n_i, V])`: one draft
      call on the nodes at depth i (i = 1 .. K-1), in node order.
    carry: the drafter's state, threaded through `level_logits`.
    params: SamplingParams of batch B.
    keys: typed keys [B] (one per row and round), None with all_greedy; child j
      (node index) uses fold_in(keys[b], j).
    all_greedy: static. Random rows draw siblings as `tree.sibling_draws` says.

  Returns:
    (tokens int32 [B, N], draft_probs float32 [B, N+1, V] or None, carry): row 0
    of draft_probs is q at the root, row j+1 node j's (zeros for the leaves),
    as `tree_rejection_sample` takes them.

  Example:
    >>> tokens, q, carry = grow_tree(DraftTree((2, 1)), root_logits, level_logits, carry, params, keys,
    ...                              all_greedy=False)  # doctest: +SKIP
  """
  b, v = root_logits.shape
  tokens, qs = [], []
  logits = root_logits[:, None, :]
  for i, k in enumerate(tree.branching, start=1):
    child_keys = None
    if not all_greedy:
      ids = jnp.arange(
        tree.level_starts[i - 1], tree.level_starts[i - 1] + tree.level_sizes[i - 1], dtype=jnp.int32
      ).reshape(-1, k)
      child_keys = node_keys(keys, ids)
    level_tokens, q = child_tokens(
      logits,
      k,
      params,
      child_keys,
      all_greedy=all_greedy,
      without_replacement=tree.sibling_draws == "without_replacement",
    )
    tokens.append(level_tokens)
    qs.append(q)
    if i < tree.depth:
      carry, logits = level_logits(carry, i, level_tokens)
  probs = None
  if not all_greedy:
    probs = jnp.concatenate(qs + [jnp.zeros((b, tree.level_sizes[-1], v), jnp.float32)], axis=1)
  return jnp.concatenate(tokens, axis=1), probs, carry
