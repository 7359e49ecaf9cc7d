"""Trees of drafts, verified losslessly: `tree_rejection_sample`.

A drafter may propose several continuations at once, as a tree of nodes, each
node one token. Nodes come in topological order (a parent before its children);
`parents[j]` is node j's parent, -1 for a child of the root (the context):

            root                 parents = [-1, -1, 0, 0, 1, 2]
           /    \\                 depth D = 3 (node 5 is at depth 3)
         0        1              target_logits row 0     : p after the context
        / \\        \\              target_logits row j + 1 : p after node j's path
       2   3        4
       |
       5

Walking from the root, at the current node c (row c+1 of the logits, row 0 at
the root) with children j_1 < j_2 < ... in node order:

  * greedy row:   t = argmax p; move to the first child whose token is t, else emit t and stop;
  * random row, no draft_probs (deterministic guesses: n-gram, top-k): draw x ~ p; move to the
    first child whose token is x, else emit x and stop;
  * random row with draft_probs (children drawn from q, row c+1 of draft_probs, i.i.d. or
    without replacement: `sibling_draws`): recursive rejection sampling. r = p; for each
    child in order, with q_j its proposal (q itself, or, without replacement, q without the
    earlier siblings' tokens, renormalised), accept it with probability min(1, r(x_j) / q_j(x_j))
    and move there; on rejection r = normalise(max(r - q_j, 0)) (p if that has no mass). Every
    child rejected: emit a draw from r and stop;
  * a node without children emits a bonus token from its p (argmax if greedy).

Every mode is lossless, and a chain (parents = [-1, 0, 1, ...]) has exactly the
distribution of `rejection_sample`. p is processed as there (temperature, top-k,
top-p; `sample.process_logits`), with the same rules for values outside the
ordinary range: NaN logits are masked, +inf logits share the mass, a node whose
logits are all -inf accepts no child and emits token 0.

Memory: the walk goes depth by depth (a `lax.while_loop` that stops when every row
has stopped) and reads one [B, V] row of logits (and of draft_probs) per depth,
the current node's; no [B, N+1, V] probability tensor is formed.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.sampling import draws, reductions, sample
from specdec_jax.sampling.params import (
  SamplingParams,
  check_logits_values,
  check_probs_values,
  check_promises,
  row_keys,
  valid_probs,
)
from specdec_jax.verify.chain import PLACEHOLDER_TOKEN_ID
from specdec_jax.verify.checks import check_probs_sum, check_verifier_args

_WHERE = "tree_rejection_sample"
SIBLING_DRAWS = ("iid", "without_replacement")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeRejectionOutput:
  """What `tree_rejection_sample` emits.

  Attributes:
    token_ids: int32[B, D+1]: the accepted path's tokens, then one recovered or
      bonus token, then PLACEHOLDER_TOKEN_ID (-1).
    accepted_nodes: int32[B, D]: the node accepted at each depth, then -1.
    num_accepted: int32[B]: nodes accepted (the path's length), in [0, D].
    num_emitted: int32[B]: num_accepted + 1.
  """

  token_ids: jax.Array  # [B, D+1]
  accepted_nodes: jax.Array  # [B, D]
  num_accepted: jax.Array  # [B]
  num_emitted: jax.Array  # [B]


def tree_rejection_sample(
  draft_token_ids,  # int32 [B, N], nodes in topological order
  parents,  # int32 [N] (static tree) or [B, N]; -1 = child of the root
  target_logits,  # float [B, N+1, V]
  params: SamplingParams,  # batch B
  key=None,  # one key, or [B] keys (typed or raw uint32)
  draft_probs=None,  # float [B, N+1, V] or None (deterministic drafts)
  num_nodes=None,  # int32 [B] in [0, N]; None = N
  all_greedy: bool = False,
  sibling_draws: str = "iid",
  max_depth: int | None = None,
  no_filters: bool = False,
) -> TreeRejectionOutput:
  """Verifies a tree of draft tokens against the target, losslessly.

  Args:
    draft_token_ids: int32[B, N], one token per node; nodes at or past
      num_nodes[b] are ignored (any value).
    parents: int32[N] or [B, N]: the parent of node j, in [-1, j) (-1 = the
      root). A concrete [N] array (NumPy or a concrete jax array) gives a static
      depth D, that of the deepest node; a [B, N] array, concrete or traced, gives
      D = N and the same program for every tree of that shape.
    target_logits: float[B, N+1, V]; row 0 scores the root's children, row j+1
      node j's children (and its bonus token). Any float dtype; arithmetic is float32.
    params: SamplingParams with batch B (temperature 0 = greedy).
    key: one PRNG key or a batch of B keys, typed or raw uint32[2] (as for
      `rejection_sample`: a single key gives row b `fold_in(key, b)`). Depth d of
      row b uses `fold_in(row_key, d)`. May be None only with all_greedy=True.
    draft_probs: float[B, N+1, V] or None. Row 0 (row j+1) is the distribution q
      the root's (node j's) children were drawn from (see `sibling_draws`); None
      for deterministic drafts.
    num_nodes: int32[B] in [0, N], or None for all N: nodes >= num_nodes[b] do
      not exist for row b. Under jit it is clipped to [0, N].
    all_greedy: static promise that every row is greedy: argmax only, no
      exponential and no random numbers.
    sibling_draws: static, how the children of a node were drawn from its q
      (with draft_probs): "iid" (default), or "without_replacement": in node
      order, each from q without the tokens of the siblings before it,
      renormalised (distinct siblings; `static_tree.child_tokens` draws them so).
      A child drawn when q had no mass left is never accepted. The verifier must
      be told the way the drafts were drawn: either is lossless for its own draws.
    max_depth: static int >= 1 or None: a bound on the tree's depth that sets D
      (the walk's length and the outputs' width) where `parents` cannot: [B, N]
      or traced parents (a tree chosen at run time, e.g. `dynamic_tree`). Nodes
      deeper than max_depth are never accepted. None: D as described above.
    no_filters: static promise that no row uses top-k, top-p or min-p (they
      are ignored): each node's distribution comes from one overflow-safe
      pass with no run-time branch (`SamplingParams.promise_no_filters`).

  Returns:
    TreeRejectionOutput(token_ids int32[B, D+1], accepted_nodes int32[B, D],
    num_accepted int32[B], num_emitted int32[B]); D = max_depth when given.

  Raises:
    ValueError: for mismatched shapes, dtypes or batch sizes (at trace time), and
      for out-of-range concrete values: parents[j] outside [-1, j) (for [B, N]
      parents, at existing nodes only), a concrete tree deeper than max_depth,
      num_nodes outside [0, N], draft ids of
      existing nodes outside [0, V), NaN or all -inf logits at the root or an
      existing node, draft_probs entries that are NaN, +-inf or negative in a row
      whose node has existing children.

  Under jit nothing is checked, and a node whose parent is outside [-1, j) does
  not exist; a draft id outside [0, V) is never accepted (with draft_probs it
  counts as a rejected child); a draft probability that is NaN, +-inf or
  negative counts as 0; nothing is read out of bounds.

  Example:
    >>> # root -> node 0 (token 3) -> node 2 (token 5); root -> node 1 (token 4)
    >>> out = tree_rejection_sample(
    ...     draft_token_ids=jnp.array([[3, 4, 5]]), parents=np.array([-1, -1, 0]),
    ...     target_logits=logits,                 # [1, 4, V]
    ...     params=SamplingParams.greedy(1), all_greedy=True)
    >>> out.token_ids       # e.g. [[4, 9, -1]]: argmax 4 at the root, node 1 is a leaf, bonus 9
    >>> out.accepted_nodes  # [[1, -1]]
  """
  draft = jnp.asarray(draft_token_ids)
  logits = jnp.asarray(target_logits)
  if sibling_draws not in SIBLING_DRAWS:
    raise ValueError(f"{_WHERE}: sibling_draws must be one of {SIBLING_DRAWS}, got {sibling_draws!r}")
  b, n, v = _check_args(draft, logits, params, draft_probs, num_nodes)
  check_promises(_WHERE, params, v, all_greedy=all_greedy, no_filters=no_filters or params.no_filters)
  if params.has_penalties or params.has_logit_bias:
    # Each node's context is its own root path: not built yet. Refuse rather than ignore them.
    raise ValueError(
      f"{_WHERE}: params carry repetition/frequency/presence penalties or a logit bias, which trees "
      "of drafts do not support yet (rejection_sample does); use a chain (draft_tree=None)"
    )
  parents, depth, max_children = _tree_structure(parents, b, n)
  if max_depth is not None and (
    not isinstance(max_depth, (int, np.integer)) or isinstance(max_depth, bool) or max_depth < 1
  ):
    raise ValueError(f"{_WHERE}: max_depth must be None or a static int >= 1, got {max_depth!r}")
  if num_nodes is None:
    num_nodes = jnp.full((b,), n, jnp.int32)
  num_nodes = jnp.asarray(num_nodes)
  if draft_probs is not None:
    draft_probs = jnp.asarray(draft_probs)
  _check_values(draft, parents, num_nodes, logits, draft_probs, iid=sibling_draws == "iid")
  if max_depth is not None:
    _check_max_depth(parents, num_nodes, max_depth)
    depth = int(max_depth)
  if key is None:
    if not all_greedy:
      raise ValueError(f"{_WHERE}: key is required unless all_greedy=True")
    keys = None
  else:
    keys = row_keys(key, b, f"{_WHERE}: key")
  if no_filters:
    params = params.promise_no_filters()
  return _tree_rejection_sample(
    draft.astype(jnp.int32),
    parents.astype(jnp.int32),
    logits,
    params,
    keys,
    draft_probs,
    num_nodes.astype(jnp.int32),
    depth=depth,
    max_children=max_children,
    all_greedy=all_greedy,
    without_replacement=sibling_draws == "without_replacement",
  )


# ----------------------------------------------------------------------------
# Checks at the API boundary
# ----------------------------------------------------------------------------


class _TreeSizes(NamedTuple):
  batch: int  # B
  nodes: int  # N
  vocab: int  # V


def _check_args(draft, logits, params, draft_probs, num_nodes) -> _TreeSizes:
  """Shapes and dtypes (trace time)."""
  shape = check_verifier_args(
    _WHERE, draft, logits, params, draft_probs, num_nodes, axis="N", probs_rows=1, count_name="num_nodes"
  )
  return _TreeSizes(shape.batch, shape.rows - 1, shape.vocab)


class _TreeStructure(NamedTuple):
  """A tree's parents and its static bounds."""

  parents: jax.Array  # int32 [B, N]
  depth: int  # D: the deepest node's depth (N for [B, N] or traced parents)
  max_children: int  # the most children of one node (N for [B, N] or traced parents)


def _tree_structure(parents, b, n) -> _TreeStructure:
  """parents as [B, N], the static depth D and the static bound on children per node.

  A concrete [N] array (or a list or tuple of ints) fixes both from its values
  (and is checked here); [B, N] parents, or traced ones, get the bounds D = N and N children.
  """
  if isinstance(parents, (list, tuple)):
    try:
      arr = np.asarray(parents)
    except ValueError as e:  # ragged
      raise ValueError(f"{_WHERE}: parents must be [N] or [B, N] integers, got the ragged list {parents!r}") from e
    parents = arr.astype(np.int32) if arr.size == 0 else arr  # an empty list has no integer dtype of its own
  shape, dtype = jnp.shape(parents), jnp.result_type(parents)
  if shape not in ((n,), (b, n)):
    raise ValueError(f"{_WHERE}: parents must be [N]=({n},) or [B, N]=({b}, {n}), got {shape}")
  if not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(f"{_WHERE}: parents must be an integer array, got dtype {dtype}")
  if len(shape) == 2 or isinstance(parents, jax.core.Tracer):
    return _TreeStructure(jnp.broadcast_to(jnp.asarray(parents), (b, n)), n, n)
  p = np.asarray(parents).astype(np.int64)
  bad = (p < -1) | (p >= np.arange(n))
  if np.any(bad):
    raise ValueError(
      f"{_WHERE}: parents[j] must be in [-1, j) (nodes in topological order, -1 = the root); "
      f"got parents[{np.flatnonzero(bad)[:8].tolist()}] = {p[bad][:8].tolist()}"
    )
  max_children = int(np.bincount(p + 1, minlength=1).max()) if n else 0
  return _TreeStructure(
    jnp.broadcast_to(jnp.asarray(p, jnp.int32), (b, n)), int(_depths(p).max(initial=0)), max_children
  )


def _check_max_depth(parents, num_nodes, max_depth):
  """A concrete tree deeper than max_depth at its existing nodes is refused; skipped under jit."""
  if isinstance(parents, jax.core.Tracer) or isinstance(num_nodes, jax.core.Tracer) or not parents.shape[1]:
    return
  p = np.asarray(parents)
  live = np.arange(p.shape[1])[None, :] < np.asarray(num_nodes)[:, None]
  deepest = int(np.where(live, _depths(p), 0).max())
  if deepest > max_depth:
    raise ValueError(f"{_WHERE}: max_depth={max_depth}, but the tree has a node at depth {deepest}")


def _depths(parents: np.ndarray) -> np.ndarray:
  """The depth (1 = a child of the root) of every node of concrete parents [..., N] in [-1, j)."""
  depth = np.zeros(parents.shape, np.int64)
  for j in range(parents.shape[-1]):
    p = parents[..., j]
    up = np.take_along_axis(depth, np.clip(p, 0, None)[..., None], axis=-1)[..., 0]
    depth[..., j] = np.where(p < 0, 1, up + 1)
  return depth


def _check_values(draft, parents, num_nodes, logits, draft_probs, iid):
  """Range checks of concrete (eager) inputs, at existing nodes only; skipped under jit."""
  if any(isinstance(a, jax.core.Tracer) for a in (draft, parents, num_nodes, logits, draft_probs)):
    return
  b, n = draft.shape
  v = logits.shape[-1]
  nn = np.asarray(num_nodes)
  if np.any((nn < 0) | (nn > n)):
    raise ValueError(f"{_WHERE}: num_nodes must be in [0, N={n}], got {nn}")
  live = np.arange(n)[None, :] < nn[:, None]  # [B, N]
  p = np.asarray(parents)
  bad = live & ((p < -1) | (p >= np.arange(n)[None, :]))
  if np.any(bad):
    raise ValueError(
      f"{_WHERE}: parents[b, j] must be in [-1, j) at existing nodes; got {p[bad][:8].tolist()} at "
      f"[b, j] = {np.argwhere(bad)[:8].tolist()}"
    )
  d = np.asarray(draft)
  bad = live & ((d < 0) | (d >= v))
  if np.any(bad):
    raise ValueError(f"{_WHERE}: draft_token_ids must be in [0, V={v}) at nodes < num_nodes; got {d[bad][:8]}")
  rows_used = np.concatenate([np.ones((b, 1), bool), live], axis=1)  # the root and the existing nodes
  check_logits_values(logits, jnp.asarray(rows_used), f"{_WHERE}: target_logits")
  if draft_probs is None:
    return
  # q of row c+1 matters only where node c has an existing child (row 0: the root).
  has_child = np.zeros((b, n + 1), bool)
  rows, cols = np.nonzero(live)
  has_child[rows, p[rows, cols] + 1] = True
  where, rows = f"{_WHERE}: draft_probs", "in the rows of nodes with children ([b, row])"
  check_probs_values(draft_probs, jnp.asarray(has_child), where, rows)
  if iid:  # without replacement renormalises q itself; i.i.d. siblings read q as it is
    check_probs_sum(draft_probs, jnp.asarray(has_child), where, rows)


# ----------------------------------------------------------------------------
# The walk
# ----------------------------------------------------------------------------


class _WalkState(NamedTuple):
  """The walk's loop state, per row b."""

  depth: jax.Array  # int32 []: the depth whose children are being decided
  node: jax.Array  # int32 [B]: the current node, -1 = the root
  done: jax.Array  # bool [B]: the row has emitted its last token
  token_ids: jax.Array  # int32 [B, D+1]
  accepted_nodes: jax.Array  # int32 [B, D]


class _Step(NamedTuple):
  """One depth's decision, per row."""

  child: jax.Array  # int32 [B]: the accepted child, -1 = none (the row stops)
  token: jax.Array  # int32 [B]: the emitted token when child == -1


def _row_at(x, node):
  """x[b, node[b] + 1] for x [B, N+1, ...]: the current node's row."""
  idx = (node + 1).reshape((-1,) + (1,) * (x.ndim - 1))
  return jnp.take_along_axis(x, idx, axis=1)[:, 0]


def _first(mask):
  """The first True column of mask [B, N], -1 where there is none."""
  if mask.shape[1] == 0:
    return jnp.full(mask.shape[:1], -1, jnp.int32)
  return jnp.where(jnp.any(mask, axis=1), jnp.argmax(mask, axis=1), -1).astype(jnp.int32)


def _greedy_step(row_logits, draft, children):
  """The first child whose token is the argmax; else emit the argmax."""
  t, best = reductions.greedy_argmax(row_logits)  # NaN counts as -inf; t = 0 for an empty row
  match = children & (draft == t[:, None]) & (best > -jnp.inf)[:, None]
  return _Step(_first(match), t)


def _guess_step(logp, draft, children, key):
  """Deterministic drafts: draw x ~ p; the first child whose token is x, else emit x."""
  nonempty = jnp.any(logp > -jnp.inf, axis=-1)
  x = jnp.where(nonempty, draws.categorical_from_log_weights(key, logp), 0)
  return _Step(_first(children & (draft == x[:, None]) & nonempty[:, None]), x)


def _residual(r, q, p):
  """normalise(max(r - q, 0)) per row, or p where that has no mass."""
  res = jnp.maximum(r - q, 0.0)
  mass = jnp.sum(res, axis=-1, keepdims=True)
  return jnp.where(mass > 0, res / jnp.where(mass > 0, mass, 1.0), p)


class _SlotCarry(NamedTuple):
  """The loop state of `_recursive_rejection_step`, per row b."""

  slot: jax.Array  # int32 []: the child slot being decided
  residual: jax.Array  # f32 [B, V]: r, the distribution the next child is tested against
  chosen: jax.Array  # int32 [B]: the accepted child, -1 = none yet
  rejected_any: jax.Array  # bool [B]: some child was rejected (the final draw reads r, not p)
  removed: jax.Array  # int32 [B, C]: without replacement, the rejected siblings' tokens (-1 = none)
  removed_mass: jax.Array  # f32 [B]: their mass under q


def _recursive_rejection_step(logp, q, draft, children, key, max_children, without_replacement=False):
  """Drafts drawn from q: SpecInfer's recursive rejection sampling over the children.

  Child slot c (the c-th child in node order) is accepted with probability
  min(1, r(x)/q_c(x)), as `u * q_c(x) < r(x)` with u ~ U[0, 1); a loop over slots stops
  once every row has accepted a child or run out of children. q_c is q for i.i.d.
  siblings; without replacement it is q without the earlier slots' tokens,
  renormalised (a slot drawn after q ran out of mass is skipped: it proposed nothing).
  """
  b, n = draft.shape
  v = logp.shape[-1]
  k_accept, k_final = jax.vmap(lambda kk: tuple(jax.random.split(kk)), out_axes=(0, 0))(key)
  u = jax.vmap(lambda kk: jax.random.uniform(kk, (max(max_children, 1),), jnp.float32))(k_accept)  # [B, C]
  nonempty = jnp.any(logp > -jnp.inf, axis=-1)
  p = jnp.exp(logp)
  rank = jnp.cumsum(children.astype(jnp.int32), axis=1) - 1  # [B, N]: slot of each child
  num_children = jnp.sum(children, axis=1, dtype=jnp.int32)

  def pending(c, chosen):
    return (chosen < 0) & (c < num_children)

  def cond(carry: _SlotCarry):
    return (carry.slot < max_children) & jnp.any(pending(carry.slot, carry.chosen))

  total = jnp.sum(q, axis=-1) if without_replacement else None  # (about 1)

  def body(carry: _SlotCarry) -> _SlotCarry:
    c, r, chosen, rejected_any, removed, removed_mass = carry
    at_slot = children & (rank == c)
    j = jnp.argmax(at_slot, axis=1).astype(jnp.int32)
    live = pending(c, chosen)
    if without_replacement:
      # q_c = q without the earlier siblings' tokens (`removed`, -1 = none), renormalised; built
      # inside the reads below (fused), never stored. A slot drawn after q ran out of mass
      # proposed nothing: skip it.
      left = total - removed_mass
      live = live & (left > 0)
      scale = jnp.where(left > 0, 1.0 / jnp.where(left > 0, left, 1.0), 0.0)[:, None]
      ids = jnp.arange(v, dtype=jnp.int32)[None, :]
      out = jnp.any(ids[:, :, None] == removed[:, None, :], axis=-1) if max_children > 1 else jnp.zeros_like(q, bool)
      q_c = jnp.where(out, 0.0, q) * scale
    else:
      q_c = q
    x = jnp.take_along_axis(draft, j[:, None], axis=1)  # [B, 1]; may be out of range
    valid = (x >= 0) & (x < v)
    safe = jnp.where(valid, x, 0)
    r_x = jnp.take_along_axis(r, safe, axis=1)[:, 0]
    q_x = jnp.take_along_axis(q, safe, axis=1)[:, 0]
    if without_replacement:  # q_c(x), from the one gathered q(x)
      q_x = jnp.where(jnp.any(removed == safe, axis=1), 0.0, q_x) * scale[:, 0]
    u_c = jax.lax.dynamic_index_in_dim(u, c, axis=1, keepdims=False)
    accept = live & valid[:, 0] & nonempty & (u_c * q_x < r_x)
    reject = live & ~accept
    r = jnp.where(reject[:, None], _residual(r, q_c, p), r)
    if without_replacement:  # the next sibling was drawn from q without this one's token
      drop = reject & valid[:, 0]
      q_own = jnp.take_along_axis(q, safe, axis=1)[:, 0]
      removed = jnp.where(drop[:, None] & (jnp.arange(removed.shape[1])[None, :] == c), safe, removed)
      removed_mass = removed_mass + jnp.where(drop, q_own, 0.0)
    return _SlotCarry(c + 1, r, jnp.where(accept, j, chosen), rejected_any | reject, removed, removed_mass)

  init = _SlotCarry(
    jnp.int32(0),
    p,
    jnp.full((b,), -1, jnp.int32),
    jnp.zeros((b,), bool),
    jnp.full((b, max(max_children, 1)), -1, jnp.int32),
    jnp.zeros((b,), jnp.float32),
  )
  final = jax.lax.while_loop(cond, body, init) if n and max_children else init
  r, chosen, rejected_any = final.residual, final.chosen, final.rejected_any
  # The bonus (no child rejected) draws from logp itself, not from log(exp(logp)).
  log_w = jnp.where(rejected_any[:, None], jnp.log(r), logp)
  token = jnp.where(nonempty, draws.categorical_from_log_weights(k_final, log_w), 0)
  return _Step(chosen, token)


# A greedy walk of a small tree runs unrolled: at small batch an XLA while-loop iteration costs
# more than a depth's argmax. Random walks stay while loops: unrolled, their per-depth
# conditionals and draws run slower and compile much longer (figures: bench/RESULTS.md, trees).
# The bodies guard every update with the row's own state, so unrolling gives bit-identical outputs.
_UNROLL_LIMIT = 24  # (D + 1): unrolled greedy walk bodies
_UNROLL_MAX_BATCH = 64  # at larger batches the unrolled walk is the slower one
# Random walks of small inputs process every row's logits in one pass before the walk
# (the per-depth processing is a chain of small kernels inside the loop otherwise).
_PREPROCESS_BYTES = 64 * 2**20


def _loop(cond, body, init, max_iters: int, unroll: bool):
  """`lax.while_loop(cond, body, init)` (whose cond stops it within max_iters), or max_iters bodies unrolled.

  The unrolled form runs every body: correct only for bodies that leave finished rows unchanged.
  """
  if not unroll:
    return jax.lax.while_loop(cond, body, init)
  for _ in range(max_iters):
    init = body(init)
  return init


def _walk(
  draft,
  parents,
  logits,
  params,
  keys,
  draft_probs,
  exists,
  *,
  depth,
  max_children,
  greedy_only,
  without_replacement=False,
):
  """Walks every row from the root, one depth per iteration; returns TreeRejectionOutput."""
  b, n = draft.shape
  unroll = greedy_only and depth + 1 <= _UNROLL_LIMIT and b <= _UNROLL_MAX_BATCH
  v = logits.shape[-1]
  # [B, N+1, V] processed log-probabilities when they are small (see _PREPROCESS_BYTES).
  pre = None
  if not greedy_only and b * (n + 1) * v * 4 <= _PREPROCESS_BYTES:
    pre = sample.process_logits(logits, params)

  def step(s: _WalkState) -> _Step:
    # Children of the current node; none at depth D (accepted_nodes has D columns).
    children = exists & (parents == s.node[:, None]) & ~s.done[:, None] & (s.depth < depth)
    row_logits = _row_at(logits, s.node)  # [B, V]
    greedy = _greedy_step(row_logits, draft, children)
    if greedy_only:
      return greedy
    k_draw = jax.vmap(lambda kk: jax.random.fold_in(kk, s.depth))(keys)
    logp = sample.process_logits(row_logits, params) if pre is None else _row_at(pre, s.node)
    if draft_probs is None:
      rand = _guess_step(logp, draft, children, k_draw)
    else:
      q = valid_probs(_row_at(draft_probs, s.node))
      rand = _recursive_rejection_step(logp, q, draft, children, k_draw, max_children, without_replacement)
    is_greedy = params.is_greedy
    return _Step(jnp.where(is_greedy, greedy.child, rand.child), jnp.where(is_greedy, greedy.token, rand.token))

  def body(s: _WalkState) -> _WalkState:
    st = step(s)
    moved = ~s.done & (st.child >= 0)
    safe_child = jnp.maximum(st.child, 0)
    child_token = jnp.take_along_axis(draft, safe_child[:, None], axis=1)[:, 0] if n else st.token
    token = jnp.where(moved, child_token, st.token)
    token_ids = s.token_ids.at[:, s.depth].set(jnp.where(s.done, s.token_ids[:, s.depth], token))
    accepted = s.accepted_nodes
    if depth:
      d = jnp.minimum(s.depth, depth - 1)  # never past the last column (nothing is accepted at depth D)
      accepted = accepted.at[:, d].set(jnp.where(moved, st.child, accepted[:, d]))
    return _WalkState(s.depth + 1, jnp.where(moved, st.child, s.node), s.done | ~moved, token_ids, accepted)

  init = _WalkState(
    jnp.int32(0),
    jnp.full((b,), -1, jnp.int32),
    jnp.zeros((b,), bool),
    jnp.full((b, depth + 1), PLACEHOLDER_TOKEN_ID, jnp.int32),
    jnp.full((b, depth), PLACEHOLDER_TOKEN_ID, jnp.int32),
  )
  final = _loop(lambda s: (s.depth <= depth) & ~jnp.all(s.done), body, init, depth + 1, unroll)
  num_accepted = jnp.sum(final.accepted_nodes >= 0, axis=1, dtype=jnp.int32)
  return TreeRejectionOutput(
    token_ids=final.token_ids,
    accepted_nodes=final.accepted_nodes,
    num_accepted=num_accepted,
    num_emitted=num_accepted + 1,
  )


@functools.partial(jax.jit, static_argnames=("depth", "max_children", "all_greedy", "without_replacement"))
def _tree_rejection_sample(
  draft,
  parents,
  logits,
  params,
  keys,
  draft_probs,
  num_nodes,
  *,
  depth,
  max_children,
  all_greedy,
  without_replacement=False,
):
  b, n = draft.shape
  node_ids = jnp.arange(n, dtype=jnp.int32)[None, :]
  # Under jit a node past num_nodes, or with a parent outside [-1, j), does not exist.
  exists = (node_ids < jnp.clip(num_nodes, 0, n)[:, None]) & (parents >= -1) & (parents < node_ids)
  walk = functools.partial(
    _walk,
    parents=parents,
    params=params,
    keys=keys,
    draft_probs=draft_probs,
    exists=exists,
    depth=depth,
    max_children=max_children,
    without_replacement=without_replacement,
  )
  if all_greedy:
    return walk(draft, logits=logits, greedy_only=True)
  return _if_all_rows_greedy(
    params,
    lambda d, x: walk(d, logits=x, greedy_only=True),
    lambda d, x: walk(d, logits=x, greedy_only=False),
    draft,
    logits,
  )


def _if_all_rows_greedy(params, greedy_walk, walk, *operands):
  """Run-time branch: an all-greedy batch skips the softmax and the random numbers."""
  return jax.lax.cond(jnp.all(params.is_greedy), greedy_walk, walk, *operands)
