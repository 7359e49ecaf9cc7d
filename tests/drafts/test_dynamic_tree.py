"""Trees chosen at run time by the drafter's confidence (`DynamicTree`, EAGLE-2 style).

- the growth: the chosen nodes are exactly the N best-scoring candidates of a
  NumPy re-implementation of the expansion, in topological order, with their
  ancestors; the drafter is fed each frontier with the right masks;
- `tree_ancestors` and `tree_rejection_sample(max_depth=)` on per-row trees;
- the loop: greedy with a dynamic tree equals `generate` (model and EAGLE
  drafters; ragged prompts, EOS inside rounds), sampled runs are lossless
  (chi-square of the first tokens' joint law; a planted verifier that accepts
  the first child fails), bad trees refused; the mixed-batch and
  no-recompilation test is shared with static trees in tests/loop/test_tree_round.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax.drafts.dynamic_tree import DynamicTree, grow_dynamic_tree, tree_ancestors
from specdec_jax.drafts.lookup import PromptLookupDrafter
from specdec_jax.loop.decoding import generate, speculative_generate
from specdec_jax.sampling import reductions, sample
from specdec_jax.sampling.params import SamplingParams
from specdec_jax.verify.tree import tree_rejection_sample
from tests.support.lossless import assert_sampled_tree_follows
from tests.support.planted import accept_first_children_per_row
from tests.support.tiny_lm import TinyLM, check_output, make_prompts
from tests.support.tiny_transformers import CONFIG, LENGTHS, V, greedy_case, sampled_tree_case, unit_target

# ----------------------------------------------------------------------------
# The growth
# ----------------------------------------------------------------------------


def _reference_growth(tree, root_logits, level_logits):
  """EAGLE-2's expansion and reranking in NumPy, one row: (tokens, parents) of the chosen nodes."""
  k = tree.top_k

  def log_q(x):
    x = np.asarray(x, np.float64)
    return x - x.max() - np.log(np.sum(np.exp(x - x.max())))

  cands = []  # (score, token, parent candidate index, depth)
  lq = log_q(root_logits)
  top = np.argsort(-lq, kind="stable")[:k]
  frontier = []
  for t in top:
    cands.append((lq[t], int(t), -1, 1))
    frontier.append(len(cands) - 1)
  for i in range(1, tree.depth):
    start = len(cands)
    for f in frontier:
      lq = log_q(level_logits(i, cands[f][1], f))
      for t in np.argsort(-lq, kind="stable")[:k]:
        cands.append((cands[f][0] + lq[t], int(t), f, i + 1))
    layer = list(range(start, len(cands)))
    frontier = sorted(layer, key=lambda c: -cands[c][0])[:k]
  chosen = sorted(sorted(range(len(cands)), key=lambda c: -cands[c][0])[: tree.num_nodes])
  node_of = {c: j for j, c in enumerate(chosen)}
  return ([cands[c][1] for c in chosen], [node_of[cands[c][2]] if cands[c][2] >= 0 else -1 for c in chosen])


@pytest.mark.parametrize("depth,k,n", [(3, 2, 5), (4, 3, 12), (3, 4, 36), (1, 4, 3)])
def test_grown_tree_is_the_n_best_candidates_of_the_reference_expansion(depth, k, n):
  """Logits are a fixed random function of (depth, token, parent's token): the same in both implementations."""
  tree = DynamicTree(depth, k, n)
  rng = np.random.default_rng(depth * 100 + k)
  b, v = 3, 11
  root = rng.normal(size=(b, v)).astype(np.float32) * 2
  table = rng.normal(size=(depth + 1, v, v)).astype(np.float32) * 2
  fed_log = []

  def level(carry, i, tokens, parent, rows):
    fed_log.append((i, np.asarray(tokens), np.asarray(parent), np.asarray(rows)))
    return carry, jnp.asarray(table)[i][tokens]

  tokens, parents, fed, probs, _ = grow_dynamic_tree(tree, jnp.asarray(root), level, None)
  assert probs is None  # top-k children: verified without draft probabilities
  tokens, parents, fed = np.asarray(tokens), np.asarray(parents), np.asarray(fed)
  assert tokens.shape == parents.shape == fed.shape == (b, n)
  for r in range(b):
    want_tokens, want_parents = _reference_growth(tree, root[r], lambda i, t, f: table[i][t])
    assert tokens[r].tolist() == want_tokens
    assert parents[r].tolist() == want_parents
    assert all(-1 <= parents[r, j] < j for j in range(n))
  # Each call fed the k frontier nodes of depth i; rows give each its own slot and its parent's ancestors.
  assert [i for i, *_ in fed_log] == list(range(1, depth))
  for i, toks, parent, rows in fed_log:
    assert toks.shape == parent.shape == (b, k)
    for m in range(k):
      own = (i - 1) * k + m
      assert rows[:, m, own].all()
      if i > 1:
        parent_slot = (i - 2) * k + parent[:, m]
        assert rows[np.arange(b), m, parent_slot].all()
      assert (rows[:, m].sum(axis=1) == i).all()  # itself and its i-1 ancestors
  # A fed node's token is the one fed at its slot; unfed nodes have fed = -1.
  for r in range(b):
    for j in np.flatnonzero(fed[r] >= 0):
      i, m = divmod(int(fed[r, j]), k)
      toks = [t for d, t, *_ in fed_log if d == i + 1][0]
      assert toks[r, m] == tokens[r, j]


@pytest.mark.parametrize("v,k", [(49152, 8), (4096, 3), (2048, 2), (1000, 4), (640, 8)])
def test_grouped_top_k_equals_lax_top_k(v, k):
  """Values and indices, ties (rounded values) and -inf rows included; 640 and 1000 take lax.top_k itself."""
  rng = np.random.default_rng(v + k)
  x = rng.normal(size=(4, 6, v)).astype(np.float32)
  x[1] = np.round(x[1], 1)  # many ties, across groups
  x[2, :, rng.random(v) < 0.95] = -np.inf  # a draft vocabulary: most columns -inf
  x[3, :3] = -np.inf  # whole rows -inf: the lowest indices
  x[3, 3:] = np.where(np.arange(v) % 7 == 0, 1.0, 0.0)  # exact ties in every group
  x[3, 5] = 0.0  # a tie between a group and a later group with a larger max: the lower index wins
  x[3, 5, [5, 200, 201]] = [1.0, 1.0, 2.0]
  got, want = reductions.top_k(jnp.asarray(x), k), jax.lax.top_k(jnp.asarray(x), k)
  np.testing.assert_array_equal(got[1], want[1])
  np.testing.assert_array_equal(got[0], want[0])


def test_growth_from_nan_or_empty_logits_still_gives_a_tree():
  """A drafter whose logits are NaN or all -inf drafts nonsense, but the parents still form a tree."""
  tree = DynamicTree(3, 2, 6)
  root = jnp.full((2, 16), -jnp.inf).at[1].set(jnp.nan)

  def level(carry, i, tokens, parent, rows):
    return carry, jnp.full(tokens.shape + (16,), jnp.nan).at[0].set(-jnp.inf)

  tokens, parents, fed, _, _ = grow_dynamic_tree(tree, root, level, None)
  parents = np.asarray(parents)
  assert all(-1 <= parents[r, j] < j for r in range(2) for j in range(6))
  assert ((np.asarray(tokens) >= 0) & (np.asarray(tokens) < 16)).all()
  _, depth = tree_ancestors(jnp.asarray(parents), 3)
  assert (np.asarray(depth) <= 3).all()


def test_tree_ancestors_and_depths():
  parents = jnp.array([[-1, -1, 0, 2, 1], [-1, 0, 1, 2, 3]])
  anc, depth = tree_ancestors(parents, 5)
  assert np.asarray(depth).tolist() == [[1, 1, 2, 3, 2], [1, 2, 3, 4, 5]]
  assert np.flatnonzero(np.asarray(anc)[0, 3]).tolist() == [0, 2, 3]
  assert np.flatnonzero(np.asarray(anc)[1, 4]).tolist() == [0, 1, 2, 3, 4]


def test_dynamic_tree_is_checked():
  assert DynamicTree(5, 8, 48).num_candidates == 8 + 4 * 64
  for bad in [(0, 2, 2), (2, 0, 2), (2, 2, 0), (2, 2, 7), (2.0, 2, 2), (True, 2, 2)]:
    with pytest.raises(ValueError, match="DynamicTree"):
      DynamicTree(*bad)
  assert DynamicTree(3, 2, 10, sampled=True).num_nodes == DynamicTree(3, 2, 1).num_candidates
  with pytest.raises(ValueError, match="sampled DynamicTree verifies every candidate.*= 10"):
    DynamicTree(3, 2, 9, sampled=True)  # a cut by the nodes' own scores would bias their draws
  with pytest.raises(ValueError, match="sampled must be a bool"):
    DynamicTree(3, 2, 10, sampled="yes")


def test_sampled_growth_draws_children_from_q_and_keeps_every_candidate():
  """Greedy rows: the top-k pool. Random rows: distinct siblings from the processed q, which draft_probs holds."""
  depth, k, b, v = 3, 2, 4, 11
  tree = DynamicTree(depth, k, DynamicTree(depth, k, 1).num_candidates, sampled=True)
  rng = np.random.default_rng(5)
  root = jnp.asarray(rng.normal(size=(b, v)).astype(np.float32) * 2)
  table = jnp.asarray(rng.normal(size=(depth + 1, v, v)).astype(np.float32) * 2)

  def level(carry, i, tokens, parent, rows):
    return carry, table[i][tokens]

  params = SamplingParams.create(jnp.array([0.0, 0.0, 0.7, 1.3]), top_k=jnp.array([0, 0, 5, 0]))
  keys = jax.random.split(jax.random.key(3), b)
  grow = jax.jit(lambda params, keys: grow_dynamic_tree(tree, root, level, None, params, keys, all_greedy=False))
  tokens, parents, fed, probs, _ = grow(params, keys)
  full_pool = jax.jit(lambda: grow_dynamic_tree(DynamicTree(depth, k, tree.num_nodes), root, level, None))()
  # Greedy rows: the deterministic tree over the whole pool.
  for got, want in zip((tokens, parents, fed), full_pool[:3]):
    np.testing.assert_array_equal(np.asarray(got)[:2], np.asarray(want)[:2])
  tokens, parents, probs = np.asarray(tokens), np.asarray(parents), np.asarray(probs)
  # Every row: a tree in topological order whose expanded nodes (the root, then k per depth) have k children.
  for r in range(b):
    assert all(-1 <= parents[r, j] < j for j in range(tree.num_nodes))
    counts = np.bincount(parents[r] + 1, minlength=tree.num_nodes + 1)
    assert sorted(set(counts.tolist())) == [0, k] and (counts == k).sum() == 1 + (depth - 1) * k
  assert probs.shape == (b, tree.num_nodes + 1, v)
  want_root = np.asarray(jax.nn.softmax(sample.process_logits(root, params), axis=-1))
  np.testing.assert_allclose(probs[:, 0], want_root, rtol=1e-6, atol=1e-7)
  for r in (2, 3):  # random rows: siblings distinct and in q's support; expanded nodes' rows are their q
    for parent in range(-1, tree.num_nodes):
      kids = np.flatnonzero(parents[r] == parent)
      if kids.size:
        assert len(set(tokens[r, kids].tolist())) == kids.size
        assert (probs[r, parent + 1, tokens[r, kids]] > 0).all()
        np.testing.assert_allclose(probs[r, parent + 1].sum(), 1.0, rtol=1e-5)
      else:
        assert not probs[r, parent + 1].any()  # a leaf: no q
  # Another key draws other children for a random row, never for a greedy one.
  other = grow(params, jax.random.split(jax.random.key(4), b))[0]
  np.testing.assert_array_equal(np.asarray(other)[:2], tokens[:2])
  assert (np.asarray(other)[2:] != tokens[2:]).any()


def test_max_depth_sets_the_walk_of_per_row_parents():
  """[B, N] parents with max_depth=D give [B, D+1] outputs, the same tokens as the static tree; deeper refused."""
  rng = np.random.default_rng(0)
  static = np.array([-1, -1, 0, 2])
  per_row = np.array([[-1, -1, 0, 2], [-1, 0, 0, 1]])
  logits = jnp.asarray(rng.normal(size=(2, 5, 7)), jnp.float32)
  draft = jnp.argmax(logits[:, :4], axis=-1)  # mostly right guesses
  params = SamplingParams.greedy(2)
  out = tree_rejection_sample(draft, per_row, logits, params, all_greedy=True, max_depth=3)
  assert out.token_ids.shape == (2, 4)
  row0 = tree_rejection_sample(draft[:1], static, logits[:1], SamplingParams.greedy(1), all_greedy=True)
  np.testing.assert_array_equal(out.token_ids[0], row0.token_ids[0])
  jitted = jax.jit(lambda p: tree_rejection_sample(draft, p, logits, params, all_greedy=True, max_depth=3))
  np.testing.assert_array_equal(jitted(jnp.asarray(per_row)).token_ids, out.token_ids)
  with pytest.raises(ValueError, match="max_depth=2, but the tree has a node at depth 3"):
    tree_rejection_sample(draft, per_row, logits, params, all_greedy=True, max_depth=2)
  with pytest.raises(ValueError, match="max_depth"):
    tree_rejection_sample(draft, per_row, logits, params, all_greedy=True, max_depth=0)


# ----------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
  "drafter,tree",
  [
    ("model", DynamicTree(3, 2, 6)),
    ("eagle", DynamicTree(3, 3, 7)),
    pytest.param("eagle", DynamicTree(2, 2, 2), marks=pytest.mark.slow),
  ],
)
def test_greedy_dynamic_tree_equals_generate(tree_models, drafter, tree):
  """Ragged prompts, EOS inside rounds, max_new_tokens cutting a round: the tokens of plain greedy."""
  target, draft, untrained, trained = tree_models
  prompts, lengths, params, kw, plain = greedy_case(target)
  drafts = {"model": [draft], "eagle": [untrained, trained]}[drafter]
  for d in drafts:
    out = speculative_generate(
      target, d, prompts, lengths, params, None, num_speculative_tokens=tree.depth, draft_tree=tree, **kw
    )
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    np.testing.assert_array_equal(out.lengths, plain.lengths)
    check_output(out, 15, tree.depth, eos=(kw["eos_token_id"],))
    st = jax.tree.map(np.asarray, out.stats)
    np.testing.assert_array_equal(st.drafted, tree.num_nodes * (st.target_calls - 1))
  if drafter == "eagle":  # the distilled drafter's tree is accepted more often than the untrained one's
    accepted = [
      int(
        np.sum(
          speculative_generate(
            target, d, prompts, lengths, params, None, draft_tree=tree, num_speculative_tokens=tree.depth, **kw
          ).stats.accepted
        )
      )
      for d in (untrained, trained)
    ]
    assert accepted[1] > accepted[0], accepted


def test_a_target_drafting_for_itself_has_every_reached_position_accepted():
  """With the whole candidate pool kept, the drafter's top-1 path is in the tree; a drafter equal to the
  target then never misses, which needs its cache to hold every accepted path at the right slots (8 rows,
  40 tokens; leaving the drafter's cache unmoved misses 4 positions of 226)."""
  target = unit_target(CONFIG, seed=3)
  prompts, lengths = make_prompts(7, V, [6, 5, 7, 4, 6, 3, 5, 6], 8)
  tree = DynamicTree(3, 2, DynamicTree(3, 2, 1).num_candidates)
  params = SamplingParams.greedy(8)
  kw = dict(max_new_tokens=40, all_greedy=True)
  out = speculative_generate(
    target, target, prompts, lengths, params, None, num_speculative_tokens=3, draft_tree=tree, **kw
  )
  np.testing.assert_array_equal(out.tokens, generate(target, prompts, lengths, params, None, **kw).tokens)
  st = jax.tree.map(np.asarray, out.stats)
  assert st.reached_per_position.sum() > 200
  np.testing.assert_array_equal(st.accepted_per_position, st.reached_per_position)


def test_bad_dynamic_trees_are_refused(tree_models):
  target, draft, _, _ = tree_models
  prompts, lengths = make_prompts(0, V, LENGTHS, 4)
  kw = dict(max_new_tokens=4, num_speculative_tokens=2, all_greedy=True)
  args = (prompts, lengths, SamplingParams.greedy(4), None)
  with pytest.raises(ValueError, match="depth num_speculative_tokens=2"):
    speculative_generate(target, draft, *args, draft_tree=DynamicTree(3, 2, 4), **kw)
  with pytest.raises(ValueError, match="prompt lookup has none"):
    speculative_generate(target, PromptLookupDrafter(2), *args, draft_tree=DynamicTree(2, 2, 4), **kw)
  with pytest.raises(ValueError, match="verification='block' verifies chains"):
    speculative_generate(target, draft, *args, draft_tree=DynamicTree(2, 2, 4), verification="block", **kw)
  tiny = TinyLM.create(0, V)  # no tree extension of the model protocol
  with pytest.raises(ValueError, match="tree extension.*draft"):
    speculative_generate(target, tiny, *args, draft_tree=DynamicTree(2, 2, 4), **kw)
  with pytest.raises(ValueError, match="DynamicTree.num_nodes=9 exceeds"):
    speculative_generate(target, draft, *args, draft_tree=DynamicTree(2, 2, 9), **kw)


# CI runs the sampled tree's loop (the same per-row plumbing, verified with q); the sampler's own tests
# (tests/verify/test_tree.py) check deterministic children ("guesses") in CI.
@pytest.mark.parametrize(
  "drafter,tree",
  [
    pytest.param("eagle", DynamicTree(2, 3, 5), marks=pytest.mark.slow),
    pytest.param("model", DynamicTree(2, 3, 5), marks=pytest.mark.slow),
    ("eagle", DynamicTree(2, 2, 6, sampled=True)),
    pytest.param("model", DynamicTree(2, 2, 6, sampled=True), marks=pytest.mark.slow),
  ],
)
def test_sampled_dynamic_tree_is_lossless(monkeypatch, drafter, tree):
  """The first 3 tokens of N rows follow the target's exact joint with a dynamic tree (T=0.8, top-k 6).

  Depth 2: the first round's walk decides two tokens, against deterministic
  children (width 3, 5 nodes) or children drawn without replacement from q and
  verified with it (`sampled`, width 2, all 6 candidates), so the joint law of
  tokens 1..3 covers both depths and a bonus. N = 20000 rows detect every
  total-variation shift >= ~0.03 at alpha 1e-3 (asserted in the helper);
  accepting the first child at every depth is rejected.
  """
  out = assert_sampled_tree_follows(
    sampled_tree_case(drafter), tree, monkeypatch, f"{drafter} {tree}, first 3 tokens", accept_first_children_per_row
  )
  n = tree.num_nodes
  assert 0.05 < float(out.stats.usable_acceptance_rate) * n < n - 0.5  # nodes are accepted and rejected
