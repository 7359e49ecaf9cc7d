"""Tests of specdec_jax/tree.py, against the `tree_rejection_sample` contract.

* Exact greedy tables on a hand-made tree (duplicate children, leaf bonus, root
  mismatch, ragged rows), with parents as [N] and as [B, N], against a NumPy walker.
* A chain tree equals `rejection_sample`: exactly for greedy rows, in distribution
  (chi-square against the exact float64 law of the chain) for random rows.
* Losslessness on a branching tree: children drawn i.i.d. from q by a fake
  drafter, target logits from a fake target model of the path; the joint law of
  the first two emitted tokens (a row that stopped after one token is completed
  from the reference target law) must be the target's. A planted verifier
  without the residual update between siblings must fail the same check.
* Hypothesis invariants, no recompilation for new trees, bad inputs.

The tree used throughout (N = 7, depth D = 3):

            root
          /   |   \\
         0    1    2
        / \\   |
       3   4  5
       |
       6
"""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import SamplingParams, TreeRejectionOutput, rejection_sample, tree_rejection_sample
from specdec_jax.verify import tree as tree_verifier
from tests.support import stats
from tests.support.compiles import count_compiles

PARENTS = np.array([-1, -1, -1, 0, 0, 1, 3], np.int32)
N, D, V = 7, 3, 6


def _run(draft, parents, logits, params, key=None, draft_probs=None, num_nodes=None, **flags) -> TreeRejectionOutput:
  out = tree_rejection_sample(
    draft_token_ids=draft,
    parents=parents,
    target_logits=logits,
    params=params,
    key=key,
    draft_probs=draft_probs,
    num_nodes=num_nodes,
    **flags,
  )
  return jax.tree_util.tree_map(np.asarray, out)


def _path_of(parents, j):
  """Nodes from the root's child down to j."""
  path = []
  while j >= 0:
    path.append(j)
    j = parents[j]
  return path[::-1]


def _greedy_reference(draft, parents, logits, num_nodes, depth):
  """NumPy walker of the greedy contract: (token_ids [B, depth+1], accepted_nodes [B, depth])."""
  b, n = draft.shape
  parents = np.broadcast_to(parents, (b, n))
  tokens = np.full((b, depth + 1), -1)
  nodes = np.full((b, depth), -1)
  for r in range(b):
    cur, d = -1, 0
    while True:
      t = int(np.argmax(logits[r, cur + 1]))
      kids = [j for j in range(num_nodes[r]) if parents[r, j] == cur and draft[r, j] == t]
      tokens[r, d] = t
      if not kids:
        break
      cur = kids[0]
      nodes[r, d] = cur
      d += 1
  return tokens, nodes


# ----------------------------------------------------------------------------
# Greedy: exact tables
# ----------------------------------------------------------------------------


def _argmax_logits(targets, n=N, v=V, seed=0):
  """[n+1, V] logits whose row i has its argmax at targets[i]."""
  x = np.random.default_rng(seed).uniform(-2.0, 0.0, (n + 1, v)).astype(np.float32)
  x[np.arange(n + 1), targets] = 3.0
  return x


# (node tokens, argmax per row 0..N, num_nodes, expected token_ids [D+1], expected accepted_nodes [D])
GREEDY_TABLE = [
  pytest.param(
    [2, 2, 5, 1, 3, 4, 0],
    [2, 3, 0, 0, 0, 5, 0, 0],
    7,
    [2, 3, 5, -1],
    [0, 4, -1],
    id="duplicate_children_first_wins_then_leaf_bonus",
  ),
  pytest.param([2, 2, 5, 1, 3, 4, 0], [2, 1, 0, 0, 0, 0, 0, 4], 7, [2, 1, 0, 4], [0, 3, 6], id="deepest_path"),
  pytest.param([2, 2, 5, 1, 3, 4, 0], [3, 1, 0, 0, 0, 0, 0, 4], 7, [3, -1, -1, -1], [-1, -1, -1], id="root_mismatch"),
  pytest.param(
    [2, 5, 5, 1, 3, 4, 0],
    [5, 0, 4, 0, 0, 0, 1, 0],
    7,
    [5, 4, 1, -1],
    [1, 5, -1],
    id="second_child_duplicate_and_its_subtree",
  ),
  pytest.param(
    [2, 2, 5, 1, 3, 4, 0], [5, 0, 0, 2, 0, 0, 0, 0], 7, [5, 2, -1, -1], [2, -1, -1], id="leaf_child_of_root_bonus"
  ),
  pytest.param(
    [2, 2, 5, 1, 3, 4, 0],
    [2, 3, 0, 0, 0, 5, 0, 0],
    4,
    [2, 3, -1, -1],
    [0, -1, -1],
    id="ragged_child_past_num_nodes_missing",
  ),
  pytest.param(
    [2, 2, 5, 1, 3, 4, 0],
    [2, 1, 0, 0, 4, 0, 0, 4],
    6,
    [2, 1, 4, -1],
    [0, 3, -1],
    id="ragged_leaf_bonus_where_node_6_is_cut",
  ),
  pytest.param(
    [2, 2, 5, 1, 3, 4, 0], [2, 1, 0, 0, 0, 0, 0, 4], 0, [2, -1, -1, -1], [-1, -1, -1], id="no_nodes_argmax_of_row_0"
  ),
  pytest.param(
    [-3, 9, 2, 1, 3, 4, 0],
    [2, 1, 0, 5, 0, 0, 0, 4],
    7,
    [2, 5, -1, -1],
    [2, -1, -1],
    id="garbage_is_never_matched_past_num_nodes_or_equal",
  ),
]


def _table(cases):
  draft = np.array([c.values[0] for c in cases], np.int32)
  logits = np.stack([_argmax_logits(c.values[1], seed=i) for i, c in enumerate(cases)])
  num_nodes = np.array([c.values[2] for c in cases], np.int32)
  return draft, logits, num_nodes, np.array([c.values[3] for c in cases]), np.array([c.values[4] for c in cases])


@pytest.mark.parametrize(
  "mode",
  [
    "all_greedy_flag",
    "runtime_all_greedy",
    "greedy_rows_of_mixed_batch",
    "parents_per_row",
    "parents_per_row_under_jit",
  ],
)
def test_greedy_table(mode):
  cases = [c for c in GREEDY_TABLE if c.id != "garbage_is_never_matched_past_num_nodes_or_equal"]
  draft, logits, num_nodes, expected, nodes = _table(cases)
  b = len(cases)
  t = np.zeros(b, np.float32)
  if mode == "greedy_rows_of_mixed_batch":
    t[1::2] = 1.0
  params = SamplingParams.create(t)
  key = jax.random.key(0)
  if mode == "all_greedy_flag":
    out = _run(draft, PARENTS, logits, params, num_nodes=num_nodes, all_greedy=True)
  elif mode.startswith("parents_per_row"):
    # [B, N] parents: D = N, so the outputs are padded with -1 to [B, N+1] and [B, N].
    parents = np.tile(PARENTS, (b, 1))
    fn = lambda *a: tree_rejection_sample(*a, params=params, key=key, num_nodes=num_nodes)
    if mode.endswith("under_jit"):
      fn = jax.jit(fn)
    out = jax.tree_util.tree_map(np.asarray, fn(draft, parents, logits))
    assert out.token_ids.shape == (b, N + 1) and out.accepted_nodes.shape == (b, N)
    np.testing.assert_array_equal(out.token_ids[:, D + 1 :], -1)
    np.testing.assert_array_equal(out.accepted_nodes[:, D:], -1)
    out = TreeRejectionOutput(out.token_ids[:, : D + 1], out.accepted_nodes[:, :D], out.num_accepted, out.num_emitted)
  else:
    out = _run(draft, PARENTS, logits, params, key=key, num_nodes=num_nodes)
  rows = np.flatnonzero(t == 0)
  np.testing.assert_array_equal(out.token_ids[rows], expected[rows])
  np.testing.assert_array_equal(out.accepted_nodes[rows], nodes[rows])
  acc = (nodes >= 0).sum(1)
  np.testing.assert_array_equal(out.num_accepted[rows], acc[rows])
  np.testing.assert_array_equal(out.num_emitted[rows], acc[rows] + 1)
  ref_tokens, ref_nodes = _greedy_reference(draft, PARENTS, logits, num_nodes, D)  # the table agrees
  np.testing.assert_array_equal(ref_tokens, expected)
  np.testing.assert_array_equal(ref_nodes, nodes)
  assert out.token_ids.dtype == np.int32 and out.accepted_nodes.dtype == np.int32


def test_greedy_under_jit_garbage_is_ignored():
  # Node 0 holds -3 and node 1 holds 9 (out of [0, V)); under jit they are never matched.
  case = GREEDY_TABLE[-1]
  draft, logits, num_nodes, expected, nodes = _table([case])
  fn = jax.jit(
    lambda d, x: tree_rejection_sample(d, PARENTS, x, SamplingParams.greedy(1), num_nodes=num_nodes, all_greedy=True)
  )
  out = fn(draft, logits)
  np.testing.assert_array_equal(out.token_ids, expected)
  np.testing.assert_array_equal(out.accepted_nodes, nodes)


def test_under_jit_parents_out_of_range_make_nodes_absent():
  # Node 1's parent 5 (not < 1) and node 2's parent -4: under jit both nodes do not exist.
  logits = _argmax_logits([4, 0, 0, 0, 0, 0, 0, 0])[None]
  draft = np.array([[1, 4, 4, 1, 1, 1, 1]], np.int32)
  parents = np.array([[-1, 5, -4, 0, 0, 1, 3]], np.int32)
  out = jax.jit(lambda p: tree_rejection_sample(draft, p, logits, SamplingParams.greedy(1), all_greedy=True))(parents)
  np.testing.assert_array_equal(out.token_ids[0, :2], [4, -1])
  assert int(out.num_accepted[0]) == 0


def test_greedy_random_trees_match_the_numpy_walker():
  rng = np.random.default_rng(3)
  b, n = 16, 9
  parents = np.stack([[rng.integers(max(-1, j - 3), j) for j in range(n)] for _ in range(b)]).astype(np.int32)
  logits = np.round(rng.normal(0, 1.0, (b, n + 1, V))).astype(np.float32)  # ties: the first index wins
  am = np.argmax(logits, -1)
  # Children mostly copy their parent's argmax, so paths get deep.
  draft = np.where(rng.random((b, n)) < 0.8, am[np.arange(b)[:, None], parents + 1], rng.integers(0, V, (b, n)))
  num_nodes = rng.integers(0, n + 1, b).astype(np.int32)
  out = _run(draft.astype(np.int32), parents, logits, SamplingParams.greedy(b), num_nodes=num_nodes, all_greedy=True)
  ref_tokens, ref_nodes = _greedy_reference(draft, parents, logits, num_nodes, n)
  np.testing.assert_array_equal(out.token_ids, ref_tokens)
  np.testing.assert_array_equal(out.accepted_nodes, ref_nodes)
  assert out.num_accepted.max() >= 3  # the test reached deep nodes


# ----------------------------------------------------------------------------
# A chain is rejection_sample
# ----------------------------------------------------------------------------

CHAIN_K = 3
CHAIN = np.arange(-1, CHAIN_K - 1, dtype=np.int32)  # [-1, 0, 1]


def test_chain_greedy_equals_rejection_sample():
  rng = np.random.default_rng(5)
  b = 12
  logits = np.round(rng.normal(0, 1.0, (b, CHAIN_K + 1, V))).astype(np.float32)
  am = np.argmax(logits, -1)[:, :CHAIN_K]
  draft = np.where(rng.random((b, CHAIN_K)) < 0.7, am, rng.integers(0, V, (b, CHAIN_K))).astype(np.int32)
  n = rng.integers(0, CHAIN_K + 1, b).astype(np.int32)
  params = SamplingParams.create(np.where(np.arange(b) % 3 == 0, 1.0, 0.0).astype(np.float32))
  key = jax.random.key(1)
  chain = _run(draft, CHAIN, logits, params, key=key, num_nodes=n)
  flat = jax.tree_util.tree_map(np.asarray, rejection_sample(draft, logits, params, key, num_draft_tokens=n))
  rows = np.flatnonzero(~np.asarray(params.is_greedy))
  greedy = np.flatnonzero(np.asarray(params.is_greedy))
  assert rows.size and greedy.size
  np.testing.assert_array_equal(chain.token_ids[greedy], flat.token_ids[greedy])
  np.testing.assert_array_equal(chain.num_accepted[greedy], flat.num_accepted[greedy])
  expected_nodes = np.where(np.arange(CHAIN_K)[None, :] < chain.num_accepted[:, None], np.arange(CHAIN_K), -1)
  np.testing.assert_array_equal(chain.accepted_nodes, expected_nodes)


def _chain_law(draft, logits, q, params):
  """Exact float64 law of (num_accepted s, final token y) of one chain row, as [(K+1) * V] (index s * V + y)."""
  t, k, p = params
  probs = stats.reference_probs(logits, t, k, p)  # [K+1, V]
  law = np.zeros((CHAIN_K + 1, V))
  reach = 1.0
  for i in range(CHAIN_K):
    d = draft[i]
    if q is None:
      a = probs[i, d]
      res = probs[i].copy()
      res[d] = 0.0
      res = res / res.sum() if res.sum() > 0 else probs[i]
    else:
      a = min(1.0, probs[i, d] / q[i, d]) if q[i, d] > 0 else float(probs[i, d] > 0)
      res = stats.residual_probs(probs[i], q[i])
    law[i] = reach * (1 - a) * res
    reach *= a
  law[CHAIN_K] = reach * probs[CHAIN_K]
  return law.reshape(-1)


PARAM_SETS = {"T1": (1.0, 0, 1.0), "T0.7_topk3": (0.7, 3, 1.0), "T1.3_topp0.8": (1.3, 0, 0.8)}
STAT_ROWS = 20000


@pytest.mark.parametrize("with_q", [False, True], ids=["guesses", "draft_probs"])
@pytest.mark.parametrize("pname", list(PARAM_SETS))
def test_chain_random_matches_the_exact_chain_law(with_q, pname):
  rng = np.random.default_rng(2 * list(PARAM_SETS).index(pname) + int(with_q))
  logits1 = rng.normal(0, 1.2, (CHAIN_K + 1, V)).astype(np.float32)
  q1 = rng.dirichlet(np.ones(V), CHAIN_K + 1).astype(np.float32) if with_q else None
  probs = stats.reference_probs(logits1, *PARAM_SETS[pname])
  draft1 = np.argsort(-probs[:CHAIN_K], axis=-1)[:, 1].astype(np.int32)  # plausible but not certain drafts
  law = _chain_law(draft1, logits1, None if q1 is None else q1.astype(np.float64), PARAM_SETS[pname])
  b = STAT_ROWS
  params = SamplingParams.create(*[np.full(b, x) for x in PARAM_SETS[pname]])
  draft = np.tile(draft1, (b, 1))
  logits = np.tile(logits1, (b, 1, 1))
  q = None if q1 is None else np.tile(q1, (b, 1, 1))
  results = []
  for name, out in [
    ("tree", _run(draft, CHAIN, logits, params, key=jax.random.key(7), draft_probs=q)),
    (
      "rejection_sample",
      rejection_sample(draft, logits, params, jax.random.key(7), draft_probs=None if q is None else q[:, :CHAIN_K]),
    ),
  ]:
    acc, tok = np.asarray(out.num_accepted), np.asarray(out.token_ids)
    final = tok[np.arange(b), acc]
    results.append(stats.chisquare_gof(acc * V + final, law, label=f"{name} {pname}"))
  stats.assert_gof(results, min_bins=5)


# ----------------------------------------------------------------------------
# Losslessness on a branching tree
# ----------------------------------------------------------------------------


def _prefix_code(code, token):
  """The index of prefix + (token,) in the fake models' tables (the empty prefix is 0)."""
  return code * V + token + 1


TABLE_ROWS = _prefix_code(_prefix_code(_prefix_code(0, V - 1), V - 1), V - 1) + 1  # prefixes up to length 3


def _fake_models(seed):
  """Target logits and drafter q for every prefix of length <= 3: [TABLE_ROWS, V] each."""
  rng = np.random.default_rng(seed)
  f = rng.normal(0, 1.2, (TABLE_ROWS, V)).astype(np.float32)
  q = rng.dirichlet(np.full(V, 0.7), TABLE_ROWS).astype(np.float32)
  return f, q


def _draft_tree(f_table, q_table, b, rng, with_q, sibling_draws="iid"):
  """Per row: node tokens (from q of their parent's path, i.i.d. or without replacement among
  siblings, or fixed guesses), and the target logits / draft probs rows of the root and of every
  node's path."""
  code = np.zeros((b, N + 1), np.int64)  # prefix code of row 0 (root) and row j+1 (node j)
  draft = np.zeros((b, N), np.int32)
  for j in range(N):
    parent_code = code[:, PARENTS[j] + 1]
    if with_q:  # inverse-CDF draws from q(parent's path)
      q = q_table[parent_code].astype(np.float64)
      if sibling_draws == "without_replacement":  # without the earlier siblings' tokens
        for i in np.flatnonzero(PARENTS[:j] == PARENTS[j]):
          q[np.arange(b), draft[:, i]] = 0.0
      cdf = np.cumsum(q, axis=-1)
      draft[:, j] = np.minimum((rng.random((b, 1)) * cdf[:, -1:] > cdf).sum(-1), V - 1)
    else:  # deterministic guesses: the same tokens in every row, a duplicate included
      draft[:, j] = [2, 2, 4, 1, 3, 0, 5][j]
    code[:, j + 1] = _prefix_code(parent_code, draft[:, j])
  return draft, f_table[code], (q_table[code] if with_q else None)


def _first_two_law(f_table, pset):
  """Exact float64 law of the first two tokens of the target: [V * V], index t1 * V + t2."""
  p0 = stats.reference_probs(f_table[0], *pset)
  p1 = stats.reference_probs(f_table[[_prefix_code(0, t) for t in range(V)]], *pset)  # [V, V]
  return (p0[:, None] * p1).reshape(-1)


def _first_two_tokens(out, f_table, pset, rng):
  """The first two emitted tokens; a row that emitted one is completed from the reference target law."""
  tok = np.asarray(out.token_ids)
  t1, t2 = tok[:, 0].astype(np.int64), tok[:, 1].astype(np.int64)
  stopped = np.asarray(out.num_emitted) < 2
  p1 = stats.reference_probs(f_table[[_prefix_code(0, t) for t in range(V)]], *pset)
  cdf = np.cumsum(p1[t1[stopped]], axis=-1)
  t2[stopped] = np.minimum((rng.random((int(stopped.sum()), 1)) * cdf[:, -1:] > cdf).sum(-1), V - 1)
  return t1 * V + t2, stopped.mean()


def _lossless_check(with_q, pname, seed, rows=STAT_ROWS, drawn="iid", verified=None):
  """Chi-square of the first token and the first two: drafts drawn `drawn`, verified as `verified` (default:
  the same)."""
  pset = PARAM_SETS[pname]
  f_table, q_table = _fake_models(seed)
  rng = np.random.default_rng(seed)
  draft, logits, q = _draft_tree(f_table, q_table, rows, rng, with_q, drawn)
  params = SamplingParams.create(*[np.full(rows, x) for x in pset])
  out = _run(draft, PARENTS, logits, params, key=jax.random.key(seed), draft_probs=q, sibling_draws=verified or drawn)
  assert out.token_ids.shape == (rows, D + 1)
  samples, stop_rate = _first_two_tokens(out, f_table, pset, rng)
  assert 0.05 < stop_rate < 0.95, stop_rate  # both branches of the completion are exercised
  first = stats.chisquare_gof(samples // V, stats.reference_probs(f_table[0], *pset), label=f"first {pname}")
  joint = stats.chisquare_gof(samples, _first_two_law(f_table, pset), label=f"first two {pname}")
  return first, joint, out


@pytest.mark.parametrize("with_q", [False, True], ids=["guesses", "draft_probs"])
@pytest.mark.parametrize("pname", list(PARAM_SETS))
def test_lossless_branching_tree(with_q, pname):
  first, joint, out = _lossless_check(with_q, pname, seed=11)
  stats.assert_gof(first, min_bins=3)
  stats.assert_gof(joint, min_bins=8)
  assert out.num_accepted.max() == D  # the deepest node was reached


@pytest.mark.parametrize("pname", list(PARAM_SETS))
def test_lossless_tree_with_siblings_drawn_without_replacement(pname):
  first, joint, out = _lossless_check(True, pname, seed=12, drawn="without_replacement")
  stats.assert_gof(first, min_bins=3)
  stats.assert_gof(joint, min_bins=8)
  assert out.num_accepted.max() == D


def test_siblings_without_replacement_accept_more_and_need_their_own_verifier():
  """Distinct siblings are accepted more often than i.i.d. ones; verified as if i.i.d., they are not lossless."""
  iid = _lossless_check(True, "T1", seed=12)[2]
  distinct = _lossless_check(True, "T1", seed=12, drawn="without_replacement")[2]
  assert distinct.num_accepted.mean() > iid.num_accepted.mean() + 0.05, (
    distinct.num_accepted.mean(),
    iid.num_accepted.mean(),
  )
  first, joint, _ = _lossless_check(True, "T1", seed=12, drawn="without_replacement", verified="iid")
  assert min(first.pvalue, joint.pvalue) < stats.ALPHA, (first, joint)


def test_power_of_the_lossless_checks():
  # 20000 rows over <= 36 bins: a total-variation deviation of about 0.03 is caught with
  # 80% power at alpha = 1e-3 (the planted verifier below is off by more).
  _, tv = stats.detectable_deviation(STAT_ROWS, V * V)
  assert tv < 0.035, tv


_RIGHT_RESIDUAL = tree_verifier._residual
PLANTED = {
  # After a rejected sibling, keep r (no max(r - q, 0) at all, final draw from p included).
  "no_residual": lambda r, q, p: r,
  # The residual taken from p every time, not from the current r: right for the first
  # rejection only, wrong from the second sibling on.
  "residual_of_p_not_of_r": lambda r, q, p: _RIGHT_RESIDUAL(p, q, p),
}


@pytest.mark.parametrize("mistake", list(PLANTED))
def test_planted_wrong_verifier_fails_the_lossless_check(monkeypatch, mistake):
  monkeypatch.setattr(tree_verifier, "_residual", PLANTED[mistake])
  tree_verifier._tree_rejection_sample.clear_cache()  # the planted function must be traced, not a cached program
  try:
    first, joint, _ = _lossless_check(True, "T1", seed=11)
  finally:
    tree_verifier._tree_rejection_sample.clear_cache()
  assert min(first.pvalue, joint.pvalue) < stats.ALPHA, (first, joint)


@pytest.mark.slow
@pytest.mark.parametrize("with_q", [False, True], ids=["guesses", "draft_probs"])
@pytest.mark.parametrize("seed", [1, 2])
def test_lossless_branching_tree_slow(with_q, seed):
  first, joint, _ = _lossless_check(with_q, "T0.7_topk3", seed=seed, rows=1_000_000)
  stats.assert_gof(first, min_bins=3)
  stats.assert_gof(joint, min_bins=8)


# ----------------------------------------------------------------------------
# Invariants, keys, compilation
# ----------------------------------------------------------------------------

HB, HN, HV = 3, 6, 8  # one shape: every example reuses one compiled program per mode


@st.composite
def _tree_batches(draw):
  parents = np.array([[draw(st.integers(-1, j - 1)) for j in range(HN)] for _ in range(HB)], np.int32)
  draft = np.array(draw(st.lists(st.integers(0, HV - 1), min_size=HB * HN, max_size=HB * HN)), np.int32)
  num_nodes = np.array(draw(st.lists(st.integers(0, HN), min_size=HB, max_size=HB)), np.int32)
  temps = np.array(draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=HB, max_size=HB)), np.float32)
  seed = draw(st.integers(0, 2**16))
  with_q = draw(st.booleans())
  return parents, draft.reshape(HB, HN), num_nodes, temps, seed, with_q


@hypothesis.settings(max_examples=40, deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(_tree_batches())
def test_invariants_hypothesis(case):
  parents, draft, num_nodes, temps, seed, with_q = case
  rng = np.random.default_rng(seed)
  # Logits that often agree with the drafts, so paths get deep.
  logits = rng.normal(0, 1.0, (HB, HN + 1, HV)).astype(np.float32)
  rows, cols = np.nonzero(np.ones((HB, HN), bool))
  logits[rows, parents[rows, cols] + 1, draft[rows, cols]] += 3.0
  q = rng.dirichlet(np.ones(HV), (HB, HN + 1)).astype(np.float32) if with_q else None
  out = _run(
    draft, parents, logits, SamplingParams.create(temps), key=jax.random.key(seed), draft_probs=q, num_nodes=num_nodes
  )
  for b in range(HB):
    a = int(out.num_accepted[b])
    assert int(out.num_emitted[b]) == a + 1
    nodes = out.accepted_nodes[b]
    assert np.all(nodes[:a] >= 0) and np.all(nodes[a:] == -1)
    prev = -1
    for j in nodes[:a]:  # a path from the root through existing nodes
      assert j < num_nodes[b] and parents[b, j] == prev
      prev = j
    np.testing.assert_array_equal(out.token_ids[b, :a], draft[b, nodes[:a]])
    assert 0 <= out.token_ids[b, a] < HV
    assert np.all(out.token_ids[b, a + 1 :] == -1)
    if temps[b] == 0.0:  # greedy rows: exactly the walker
      ref_tokens, ref_nodes = _greedy_reference(
        draft[b : b + 1], parents[b : b + 1], logits[b : b + 1], num_nodes[b : b + 1], HN
      )
      np.testing.assert_array_equal(out.token_ids[b], ref_tokens[0])
      np.testing.assert_array_equal(out.accepted_nodes[b], ref_nodes[0])


def test_row_uses_only_its_own_key():
  f_table, q_table = _fake_models(3)
  draft, logits, q = _draft_tree(f_table, q_table, 4, np.random.default_rng(3), True)
  params = SamplingParams.create([1.0, 0.7, 1.0, 1.3])
  keys = jax.random.split(jax.random.key(4), 4)
  full = _run(draft, PARENTS, logits, params, key=keys, draft_probs=q)
  single = _run(draft, PARENTS, logits, params, key=jax.random.key(4), draft_probs=q)
  folded = _run(
    draft,
    PARENTS,
    logits,
    params,
    key=jax.vmap(lambda b: jax.random.fold_in(jax.random.key(4), b))(jnp.arange(4, dtype=jnp.int32)),
    draft_probs=q,
  )
  np.testing.assert_array_equal(single.token_ids, folded.token_ids)
  # Row 2 alone in a batch of one (its key, its inputs) gives the same output.
  params2 = SamplingParams.create([1.0])
  alone = _run(draft[2:3], PARENTS, logits[2:3], params2, key=keys[2:3], draft_probs=q[2:3])
  np.testing.assert_array_equal(alone.token_ids[0], full.token_ids[2])


def test_no_recompile_for_new_trees_keys_and_params():
  b, n = 2, 5
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(b, n + 1, V)).astype(np.float32)
  draft = rng.integers(0, V, (b, n)).astype(np.int32)
  q = rng.dirichlet(np.ones(V), (b, n + 1)).astype(np.float32)

  @jax.jit
  def traced_trees(p, key, t):
    return tree_rejection_sample(draft, p, logits, SamplingParams.create(t), key, draft_probs=q)

  traced_trees(np.array([[-1, 0, 1, 2, 3]] * b, np.int32), jax.random.key(0), np.ones(b, np.float32))
  with count_compiles("traced_trees") as compiled:
    for seed, parents in enumerate([[-1, -1, -1, -1, -1], [-1, 0, 0, 1, -1], [-1, -1, 1, 2, 0]]):
      out = traced_trees(np.array([parents] * b, np.int32), jax.random.key(seed), np.full(b, 0.5 + seed, np.float32))
      assert out.token_ids.shape == (b, n + 1)
  assert not compiled, compiled
  # Eagerly, concrete [N] trees of the same depth and branching share one program too.
  _run(draft, np.array([-1, 0, 0, 1, 1]), logits, SamplingParams.create(np.ones(b)), jax.random.key(0), q)
  with count_compiles("_tree_rejection_sample") as compiled:
    _run(draft, np.array([-1, -1, 0, 1, 2]), logits, SamplingParams.create(np.full(b, 0.3)), jax.random.key(1), q)
  assert not compiled, compiled


def test_static_parents_give_static_depth():
  out = _run(
    np.zeros((1, 4), np.int32),
    np.array([-1, -1, -1, -1]),
    np.zeros((1, 5, V), np.float32),
    SamplingParams.greedy(1),
    all_greedy=True,
  )
  assert out.token_ids.shape == (1, 2) and out.accepted_nodes.shape == (1, 1)
  out = _run(
    np.zeros((1, 0), np.int32),
    np.zeros((0,), np.int32),
    np.zeros((1, 1, V), np.float32),
    SamplingParams.create([1.0]),
    jax.random.key(0),
  )
  assert out.token_ids.shape == (1, 1) and out.accepted_nodes.shape == (1, 0)
  assert int(out.num_emitted[0]) == 1


def test_all_masked_node_accepts_nothing_and_emits_token_0():
  logits = np.zeros((2, 3, V), np.float32)
  logits[:, 0] = -np.inf
  draft = np.zeros((2, 2), np.int32)
  fn = jax.jit(
    lambda x: tree_rejection_sample(
      draft,
      np.array([-1, -1]),
      x,
      SamplingParams.create([0.0, 1.0]),
      jax.random.key(0),
      draft_probs=np.full((2, 3, V), 1 / V, np.float32),
    )
  )
  out = fn(logits)
  np.testing.assert_array_equal(out.token_ids, [[0, -1], [0, -1]])
  np.testing.assert_array_equal(out.num_accepted, [0, 0])


# ----------------------------------------------------------------------------
# Bad inputs
# ----------------------------------------------------------------------------


def _good():
  b = 2
  return dict(
    draft_token_ids=np.zeros((b, N), np.int32),
    parents=PARENTS,
    target_logits=np.zeros((b, N + 1, V), np.float32),
    params=SamplingParams.create([1.0, 0.0]),
    key=jax.random.key(0),
    draft_probs=np.full((b, N + 1, V), 1 / V, np.float32),
    num_nodes=np.array([N, 3], np.int32),
  )


def _with(**changes):
  kw = _good()
  kw.update(changes)
  return kw


BAD = [
  (dict(target_logits=np.zeros((2, V), np.float32)), "target_logits must be"),
  (dict(target_logits=np.zeros((2, N + 1, V), np.int32)), "target_logits must be a float"),
  (dict(draft_token_ids=np.zeros((2, N - 1), np.int32)), "draft_token_ids must be"),
  (dict(draft_token_ids=np.zeros((2, N), np.float32)), "draft_token_ids must be an integer"),
  (dict(parents=PARENTS[:-1]), "parents must be"),
  (dict(parents=PARENTS.astype(np.float32)), "parents must be an integer"),
  (dict(parents=np.array([-1, -1, -1, 0, 0, 5, 3])), r"parents\[j\] must be in \[-1, j\)"),
  (dict(parents=np.array([-2, -1, -1, 0, 0, 1, 3])), r"parents\[j\] must be in \[-1, j\)"),
  (dict(parents=np.tile(np.array([-1, -1, -1, 0, 7, 1, 3]), (2, 1))), r"parents\[b, j\] must be in"),
  (dict(num_nodes=np.array([N + 1, 0])), r"num_nodes must be in \[0, N"),
  (dict(num_nodes=np.array([-1, 0])), r"num_nodes must be in \[0, N"),
  (dict(num_nodes=np.array([1])), r"num_nodes must be \[B\]"),
  (dict(num_nodes=np.array([1.0, 2.0])), "num_nodes must be an integer"),
  (dict(draft_token_ids=np.full((2, N), V, np.int32)), r"draft_token_ids must be in \[0, V"),
  (dict(draft_probs=np.zeros((2, N, V), np.float32)), r"draft_probs must be \[B, N\+1, V\]"),
  (dict(draft_probs=np.full((2, N + 1, V), np.nan, np.float32)), "draft_probs must be finite"),
  (dict(target_logits=np.full((2, N + 1, V), np.nan, np.float32)), "target_logits holds NaN"),
  (dict(target_logits=np.full((2, N + 1, V), -np.inf, np.float32)), "target_logits has no value above -inf"),
  (dict(key=None), "key is required"),
  (dict(key=jax.random.split(jax.random.key(0), 3)), "key"),
  (dict(params=SamplingParams.create([1.0])), "params.temperature must have shape"),
]


@pytest.mark.parametrize("changes,match", BAD, ids=[m for _, m in BAD])
def test_bad_inputs_raise_value_error_naming_the_argument(changes, match):
  with pytest.raises(ValueError, match=match):
    tree_rejection_sample(**_with(**changes))


def test_values_of_absent_nodes_are_not_checked():
  # Row 1 has 3 nodes: garbage tokens, parents, logits and q past them are ignored.
  kw = _good()
  kw["draft_token_ids"][1, 3:] = -7
  kw["parents"] = np.tile(PARENTS, (2, 1))
  kw["parents"][1, 3:] = 99
  kw["target_logits"][1, 4:] = np.nan
  kw["draft_probs"][1, 4:] = -1.0  # nodes 3.. have no existing children in row 1
  out = tree_rejection_sample(**kw)
  assert int(out.num_accepted[1]) <= 1


def test_all_greedy_tree_program_has_no_exponential_or_random_numbers():
  """all_greedy=True compiles an argmax-only walk; without the flag the random walk's exp and PRNG are there."""
  b, n, v = 2, 5, 64
  parents = np.array([-1, -1, 0, 0, 2])

  def program(**flags):
    def fn(draft, logits, params, key):
      return tree_rejection_sample(
        draft_token_ids=draft, parents=parents, target_logits=logits, params=params, key=key, **flags
      ).token_ids

    args = (
      jnp.zeros((b, n), jnp.int32),
      jnp.zeros((b, n + 1, v), jnp.float32),
      SamplingParams.greedy(b),
      jax.random.key(0),
    )
    return stats.HloProgram(jax.jit(fn).lower(*args).compile().as_text())

  greedy, general = program(all_greedy=True), program()
  assert not greedy.opcodes() & ({"exponential", "log"} | stats.RANDOM_OPCODES), greedy.opcodes()
  assert not greedy.mentions("threefry") and not greedy.mentions("random_bits")
  # The check sees these ops when they are there: the general program holds the random walk.
  assert "exponential" in general.opcodes() and (general.mentions("threefry") or general.mentions("random_bits"))


@pytest.mark.parametrize(
  "parents", [[-1, -1, 0, 0, 1, 2, 3], pytest.param([-1, -1, -1, 0, 1, 2, 3, 4, 5], marks=pytest.mark.slow)]
)
def test_unrolled_greedy_walk_is_bit_identical_to_the_while_loop(monkeypatch, parents):
  """Small greedy trees unroll the walk (no early exit): the same outputs, bit for bit (mixed batches: the
  run-time all-greedy branch is not taken, so both programs also hold the random walk)."""

  rng = np.random.default_rng(0)
  b, v, n = 64, 12, len(parents)
  logits = jnp.asarray(rng.normal(size=(b, n + 1, v)) * 2, jnp.float32)
  draft = jnp.asarray(rng.integers(0, v, (b, n)), jnp.int32)
  probs = jax.nn.softmax(jnp.asarray(rng.normal(size=(b, n + 1, v))), -1)
  temps = np.where(np.arange(b) % 3 == 0, 0.0, 0.9)  # mixed
  params = SamplingParams.create(jnp.asarray(temps, jnp.float32), top_k=jnp.asarray(rng.integers(0, 5, b), jnp.int32))
  num_nodes = jnp.asarray(rng.integers(0, n + 1, b), jnp.int32)
  outs = []
  for limit in (0, 10_000):  # every loop a while loop; every loop unrolled
    monkeypatch.setattr(tree_verifier, "_UNROLL_LIMIT", limit)
    tree_verifier._tree_rejection_sample.clear_cache()
    for greedy in (True, False):  # the static all-greedy program, and a mixed batch
      p = SamplingParams.greedy(b) if greedy else params
      outs.append(
        jax.tree.map(
          np.asarray,
          tree_rejection_sample(
            draft,
            np.array(parents),
            logits,
            p,
            None if greedy else jax.random.key(3),
            draft_probs=probs,
            num_nodes=num_nodes,
            all_greedy=greedy,
          ),
        )
      )
  tree_verifier._tree_rejection_sample.clear_cache()
  for a, c in ((outs[0], outs[2]), (outs[1], outs[3])):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(c)):
      np.testing.assert_array_equal(x, y)
  assert outs[0].num_accepted.sum() > 0  # acceptances happen, so the comparison covers the walk
