"""Trees of drafts in the models and the loop (`draft_tree=`): tree attention, the slot move, the loop.

The sampler on its own (`tree_rejection_sample`) is tested in tests/verify/test_tree.py. Here:
  - tree attention: a tree call equals, node by node, the plain call on that
    node's root path (target and EAGLE drafter, float32);
  - `copy_cache_slots` leaves the cache as a chain call on the accepted path would;
  - the loop: greedy with a tree equals `generate` (model, EAGLE and prompt-lookup
    drafts; ragged prompts, EOS inside rounds), sampled runs are lossless (chi-square
    of the first tokens' joint law, a planted wrong verifier fails), bad trees are refused.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specdec_jax.drafts.dynamic_tree import DynamicTree
from specdec_jax.drafts.lookup import PromptLookupDrafter
from specdec_jax.drafts.static_tree import DraftTree, child_tokens, tree_attention_mask
from specdec_jax.loop import tree_round
from specdec_jax.loop.decoding import generate, speculative_generate
from specdec_jax.models import TransformerConfig
from specdec_jax.models.eagle import EagleDrafter
from specdec_jax.sampling.params import SamplingParams
from tests.support.compiles import count_compiles
from tests.support.lossless import (
  N_ROWS,
  SMALL_V,
  TEMPERATURE,
  TOP_K,
  assert_first_tokens_follow,
  assert_sampled_tree_follows,
  exact_joint,
  first_tokens_run,
)
from tests.support.planted import accept_first_children
from tests.support.tiny_lm import TinyLM, check_output, make_prompts
from tests.support.tiny_transformers import CONFIG, LENGTHS, V, greedy_case, sampled_tree_case, unit_target

# ----------------------------------------------------------------------------
# The tree's shape and mask
# ----------------------------------------------------------------------------


def test_draft_tree_shape():
  tree = DraftTree((2, 3, 1))
  assert tree.level_sizes == (2, 6, 6) and tree.num_nodes == 14 and tree.depth == 3
  assert tree.parents.tolist() == [-1, -1, 0, 0, 0, 1, 1, 1, 2, 3, 4, 5, 6, 7]
  assert tree.depths.tolist() == [1] * 2 + [2] * 6 + [3] * 6
  # Node 13 (depth 3) descends from 7, which descends from 1.
  assert np.flatnonzero(tree.ancestors[13]).tolist() == [1, 7, 13]
  assert not DraftTree((2, 3, 1)).is_chain and DraftTree((1, 1)).is_chain
  for bad in ((), (2, 0), [2, 2], (2, 1.5), (True,)):
    with pytest.raises(ValueError, match="draft_tree"):
      DraftTree(bad)


def test_tree_attention_mask_sees_context_and_ancestors_only():
  tree = DraftTree((2, 2))
  ctx, base = jnp.array([3, 5]), jnp.array([4, 6])
  m = np.asarray(tree_attention_mask(ctx, base, tree.ancestors, 14))
  for b in range(2):
    for j in range(tree.num_nodes):
      seen = set(np.flatnonzero(m[b, j]).tolist())
      want = set(range(int(ctx[b]))) | {int(base[b]) + a for a in np.flatnonzero(tree.ancestors[j])}
      assert seen == want, (b, j, seen, want)


def test_child_tokens_top_k_for_greedy_rows_and_iid_draws_for_random_rows():
  """Greedy rows: the top-k in order. Random rows: i.i.d. draws from the processed q (chi-square, alpha 1e-3)."""
  q_true = np.array([0.1, 0.5, 0.15, 0.25])
  logits = jnp.log(jnp.asarray(np.stack([q_true, q_true[::-1]])))[:, None, :]  # [B=2, n=1, V=4]
  toks, q = child_tokens(logits, 2, SamplingParams.greedy(2), None, all_greedy=True)
  assert toks.tolist() == [[1, 3], [2, 0]] and q is None
  n, k = 5000, 4  # 20000 draws for the random row, from 5000 identical nodes with 4 children each
  many = jnp.repeat(logits, n, axis=1)
  keys = jax.random.split(jax.random.key(0), 2 * n * k).reshape(2, n, k)
  params = SamplingParams.create([0.0, 0.5])  # row 1 at temperature 0.5: q proportional to p^2
  toks, q = child_tokens(many, k, params, keys, all_greedy=False, without_replacement=False)
  toks = np.asarray(toks)
  assert np.all(toks[0] == np.tile([1, 3, 2, 0], n))
  q_hot = q_true[::-1] ** 2 / np.sum(q_true**2)
  np.testing.assert_allclose(np.asarray(q)[1, 0], q_hot, rtol=1e-5)
  from scipy.stats import chisquare

  counts = np.bincount(toks[1], minlength=4)
  assert chisquare(counts, n * k * q_hot).pvalue > 1e-3
  # The same draws are far from the untempered q (the check has the power to see a wrong temperature).
  assert chisquare(counts, n * k * q_true[::-1]).pvalue < 1e-3
  # Children of one node are independent draws: pairs (child 0, child 1) follow q x q.
  pairs = np.bincount(toks[1].reshape(n, k)[:, 0] * 4 + toks[1].reshape(n, k)[:, 1], minlength=16)
  assert chisquare(pairs, n * np.outer(q_hot, q_hot).ravel()).pvalue > 1e-3


def test_child_tokens_without_replacement_are_distinct_sequential_draws():
  """Siblings drawn without replacement: distinct, the first from q, the second from q without the first
  (chi-square of the pairs at alpha 1e-3; the i.i.d. law q x q fails the same check)."""
  q_true = np.array([0.1, 0.5, 0.15, 0.25])
  n = 20000
  logits = jnp.repeat(jnp.log(jnp.asarray(q_true))[None, None, :], n, axis=1)  # [B=1, n, V=4]
  keys = jax.random.split(jax.random.key(1), n * 3).reshape(1, n, 3)
  toks, q = child_tokens(logits, 3, SamplingParams.create([1.0]), keys, all_greedy=False)
  toks = np.asarray(toks).reshape(n, 3)
  np.testing.assert_allclose(np.asarray(q)[0, 0], q_true, rtol=1e-5)  # q is the node's own distribution
  assert np.all((toks[:, 0] != toks[:, 1]) & (toks[:, 0] != toks[:, 2]) & (toks[:, 1] != toks[:, 2]))
  from scipy.stats import chisquare

  law = np.array([[0.0 if a == b else q_true[a] * q_true[b] / (1 - q_true[a]) for b in range(4)] for a in range(4)])
  pairs = np.bincount(toks[:, 0] * 4 + toks[:, 1], minlength=16)
  seen = law.ravel() > 0
  assert chisquare(pairs[seen], n * law.ravel()[seen]).pvalue > 1e-3
  iid = np.outer(q_true, q_true).ravel()
  assert chisquare(pairs[seen], n * iid[seen] / iid[seen].sum()).pvalue < 1e-3


def test_lookup_branches_are_distinct_continuations_in_order_of_preference():
  tokens = jnp.array([[1, 2, 3, 4, 1, 2, 3, 9, 2, 3], [5, 6, 5, 7, 5, 0, 0, 0, 0, 0]], jnp.int32)
  lengths = jnp.array([10, 5])
  drafter = PromptLookupDrafter((3, 2, 1))
  branches = np.asarray(drafter.propose_branches(tokens, lengths, 3, 4))
  # Row 0: "2 3" matched at 5 (-> 9 2 3, wrapping with period 3) and at 1 (-> 4 1 2); the matches of "3"
  # continue at the same places; nothing else: the last token repeated.
  assert branches[0].tolist() == [[9, 2, 3], [4, 1, 2], [3, 3, 3], [3, 3, 3]]
  # Row 1: "5" matched at 2 (-> 7 5, then the period 2 repeats) and at 0 (-> 6 5 7).
  assert branches[1].tolist() == [[7, 5, 7], [6, 5, 7], [5, 5, 5], [5, 5, 5]]
  np.testing.assert_array_equal(branches[:, 0], drafter.propose(tokens, lengths, 3))


# ----------------------------------------------------------------------------
# Tree attention in the models
# ----------------------------------------------------------------------------

TREE = DraftTree((2, 2, 1))


def _tree_call(target, tree, b, c, s, seed, **kw):
  """A context of c-1 random tokens, then one tree call (root and nodes) as the loop makes it.

  Returns (context [B, c-1], tokens [B, N+1], the context's cache, the tree call's outputs).
  """
  rng = np.random.default_rng(seed)
  n = tree.num_nodes
  context = jnp.asarray(rng.integers(0, V, (b, c - 1)), jnp.int32)
  tokens = jnp.asarray(rng.integers(0, V, (b, n + 1)), jnp.int32)
  L = jnp.full((b,), c, jnp.int32)
  positions = (L - 1)[:, None] + jnp.asarray(np.concatenate([[0], tree.depths]))[None, :]
  slots = (L - 1)[:, None] + jnp.arange(n + 1)[None, :]
  rows = np.concatenate([np.zeros((1, n), bool), tree.ancestors])
  _, cache = target(context, jnp.broadcast_to(jnp.arange(c - 1), (b, c - 1)), target.init_cache(b, s))
  out = target(tokens, positions, cache, cache_slots=slots, attention_mask=tree_attention_mask(L, L, rows, s), **kw)
  return context, tokens, cache, out


def _path(tree, j):
  """Node j's root path: [its ancestors..., j]."""
  return np.flatnonzero(tree.ancestors[j]).tolist()


@pytest.mark.parametrize("scan_layers", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_transformer_tree_call_equals_plain_calls_on_each_root_path(scan_layers):
  target = unit_target(CONFIG.replace(scan_layers=scan_layers))
  b, c, s = 2, 5, 32
  context, tokens, _, (logits, feats, _) = _tree_call(target, TREE, b, c, s, 1, return_features=True)
  leaves = range(TREE.level(TREE.depth).start, TREE.num_nodes)  # every node lies on a leaf's root path
  for j in leaves:
    path = _path(TREE, j)
    cols = [0] + [a + 1 for a in path]  # columns of `tokens`: the root, then the path's nodes
    seq = jnp.concatenate([context, tokens[:, cols]], axis=1)
    t = seq.shape[1]
    ref, ref_feats, _ = target(
      seq, jnp.broadcast_to(jnp.arange(t), (b, t)), target.init_cache(b, s), return_features=True
    )
    for d, a in enumerate(path, start=c):  # node a's plain logits are at position c - 1 + depth
      np.testing.assert_allclose(logits[:, a + 1], ref[:, d], rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(feats[:, a + 1], ref_feats[:, d], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits[:, 0], ref[:, c - 1], rtol=1e-5, atol=1e-5)  # the root sees the context


def test_copy_cache_slots_leaves_the_cache_of_a_chain_call_on_the_accepted_path():
  target = unit_target()
  b, c, s = 2, 5, 32
  _, tokens, cache, (_, tree_cache) = _tree_call(target, TREE, b, c, s, 3)
  # Row 0 accepted the path 1 -> 5 -> 9 (depths 1..3), row 1 only node 0.
  accepted = jnp.array([[1, 5, 9], [0, -1, -1]])
  n_acc = np.array([3, 1])
  src = c + jnp.maximum(accepted, 0)
  dst = jnp.where(jnp.arange(3)[None, :] < n_acc[:, None], c + jnp.arange(3)[None, :], s)
  moved = target.copy_cache_slots(tree_cache, src, dst)
  for r in range(b):
    path = tokens[r : r + 1, [0] + [int(a) + 1 for a in accepted[r, : n_acc[r]]]]
    t = path.shape[1]
    _, chain = target(path, (c - 1) + jnp.arange(t)[None, :], jax.tree.map(lambda x: x[:, r : r + 1], cache))
    end = c - 1 + t
    np.testing.assert_allclose(moved.k[:, r, :, :end], chain.k[:, 0, :, :end], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(moved.v[:, r, :, :end], chain.v[:, 0, :, :end], rtol=1e-6, atol=1e-6)


def test_eagle_tree_levels_equal_chain_steps_on_each_root_path():
  """Drafting a tree depth by depth gives every node the logits a chain drafted along its root path would."""
  target = unit_target()
  drafter = EagleDrafter.for_target(target, num_layers=2, rngs=nnx.Rngs(3))
  call = nnx.jit(lambda d, *args, **kw: d(*args, **kw))  # compiled per shape: faster than op by op
  b, c, s = 2, 6, 40
  tree = TREE
  rng = np.random.default_rng(4)
  seq = jnp.asarray(rng.integers(0, V, (b, c)), jnp.int32)
  nodes = jnp.asarray(rng.integers(0, V, (b, tree.num_nodes)), jnp.int32)
  _, feats, _ = target(seq, jnp.broadcast_to(jnp.arange(c), (b, c)), target.init_cache(b, s), return_features=True)
  # Catch-up: entries (f_p, x_{p+1}) for p = 0 .. c-2; the last one's hidden feeds depth 1.
  pos = jnp.broadcast_to(jnp.arange(c - 1), (b, c - 1))
  _, hidden, cache = call(drafter, seq[:, 1:], drafter.fuse(feats[:, :-1]), pos, drafter.init_cache(b, s))
  h0 = hidden[:, -1:]
  L = jnp.full((b,), c, jnp.int32)
  tree_logits, parent_h, tree_cache = {}, h0, cache
  for i in range(1, tree.depth + 1):
    lv = tree.level(i)
    toks = nodes[:, lv]
    hid = jnp.repeat(parent_h, tree.branching[i - 1], axis=1)
    mask = tree_attention_mask(L - 1, L - 1, tree.ancestors[lv], s)
    slots = jnp.broadcast_to((c - 1) + jnp.arange(tree.num_nodes)[lv], toks.shape)
    logits, parent_h, tree_cache = call(
      drafter, toks, hid, jnp.full(toks.shape, c - 2 + i), tree_cache, cache_slots=slots, attention_mask=mask
    )
    for m, j in enumerate(range(lv.start, lv.stop)):
      tree_logits[j] = logits[:, m]
  for j in range(tree.level(tree.depth).start, tree.num_nodes):  # every node lies on a leaf's root path
    h, chain_cache = h0, cache
    for d, a in enumerate(_path(tree, j), start=1):
      logits, h, chain_cache = call(drafter, nodes[:, a : a + 1], h, jnp.full((b, 1), c - 2 + d), chain_cache)
      np.testing.assert_allclose(tree_logits[a], logits[:, 0], rtol=1e-5, atol=1e-5)


def test_tree_arguments_are_checked():
  target = unit_target()
  cache = target.init_cache(1, 8)
  tok = jnp.zeros((1, 3), jnp.int32)
  with pytest.raises(ValueError, match="cache_slots"):
    target(tok, tok, cache, cache_slots=jnp.zeros((1, 2), jnp.int32))
  with pytest.raises(ValueError, match="attention_mask"):
    target(tok, tok, cache, attention_mask=jnp.ones((1, 3, 7), bool))
  with pytest.raises(ValueError, match="attention_mask"):
    target(tok, tok, cache, attention_mask=jnp.ones((1, 3, 8), jnp.int32))


# ----------------------------------------------------------------------------
# In the loop
# ----------------------------------------------------------------------------


def _check_tree_output(out, plain, tree, eos):
  np.testing.assert_array_equal(out.tokens, plain.tokens)
  np.testing.assert_array_equal(out.lengths, plain.lengths)
  check_output(out, 15, tree.depth, eos=(eos,))
  st = jax.tree.map(np.asarray, out.stats)
  np.testing.assert_array_equal(st.drafted, tree.num_nodes * (st.target_calls - 1))  # N nodes per round


@pytest.mark.parametrize(
  "drafter,branching",
  [
    ("model", (2, 2, 1)),
    pytest.param("model", (1, 3), marks=pytest.mark.slow),
    ("eagle", (2, 2, 1)),
    pytest.param("eagle", (3, 1, 2), marks=pytest.mark.slow),
    ("lookup", (3, 1, 1)),
  ],
)
def test_greedy_tree_equals_generate(tree_models, drafter, branching):
  """Ragged prompts, EOS inside rounds, max_new_tokens cutting a round: the tokens of plain greedy."""
  target, draft, untrained, trained = tree_models
  prompts, lengths, params, kw, plain = greedy_case(target)
  tree = DraftTree(branching)
  drafts = {"model": [draft], "eagle": [untrained, trained], "lookup": [PromptLookupDrafter((2, 1))]}[drafter]
  for d in drafts:
    out = speculative_generate(
      target, d, prompts, lengths, params, None, num_speculative_tokens=tree.depth, draft_tree=branching, **kw
    )
    _check_tree_output(out, plain, tree, kw["eos_token_id"])
  if drafter == "eagle":
    # The untrained drafter's first children are mostly wrong; its other children are right more often, so
    # a tree accepts more than the chain of first children (the distilled one accepts nearly all of both).
    kw.update(num_speculative_tokens=tree.depth)
    chain = speculative_generate(target, untrained, prompts, lengths, params, None, **kw)
    tree_out = speculative_generate(target, untrained, prompts, lengths, params, None, draft_tree=branching, **kw)
    assert int(np.sum(tree_out.stats.accepted)) > int(np.sum(chain.stats.accepted))


@pytest.mark.parametrize(
  "tree",
  [(2, 2), DynamicTree(2, 2, 4), DynamicTree(2, 2, 6, sampled=True)],
  ids=["static", "dynamic", "dynamic-sampled"],
)
def test_mixed_batch_tree_and_no_recompilation(tree_models, tree):
  """Greedy rows of a mixed batch equal plain greedy; new prompts, keys and parameters reuse the program."""
  target, _, _, trained = tree_models
  kw = dict(max_new_tokens=10, num_speculative_tokens=2, draft_tree=tree)

  def call(seed, temps):
    prompts, lengths = make_prompts(seed, V, LENGTHS, 4)
    out = speculative_generate(
      target, trained, prompts, lengths, SamplingParams.create(temps), jax.random.key(seed), **kw
    )
    check_output(out, 10, 2)
    return out, prompts, lengths

  call(0, [0.0, 1.0, 0.5, 0.0])
  with count_compiles("_speculative_jit") as compiled:
    out, prompts, lengths = call(1, [0.0, 0.8, 1.0, 0.0])
  assert not compiled, compiled
  plain = generate(target, prompts, lengths, SamplingParams.greedy(4), None, max_new_tokens=10, all_greedy=True)
  np.testing.assert_array_equal(np.asarray(out.tokens)[[0, 3]], np.asarray(plain.tokens)[[0, 3]])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_greedy_logprobs_with_a_tree_equal_those_of_generate(tree_models, mode):
  target, _, _, trained = tree_models
  prompts, lengths = make_prompts(3, V, LENGTHS, 4)
  params = SamplingParams.greedy(4)
  plain = generate(target, prompts, lengths, params, None, max_new_tokens=12, all_greedy=True, logprobs=mode)
  out = speculative_generate(
    target,
    trained,
    prompts,
    lengths,
    params,
    None,
    max_new_tokens=12,
    num_speculative_tokens=3,
    draft_tree=(2, 2, 1),
    all_greedy=True,
    logprobs=mode,
  )
  np.testing.assert_array_equal(out.tokens, plain.tokens)
  np.testing.assert_allclose(out.logprobs, plain.logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_logprobs_with_a_tree_are_those_of_the_processed_law(tree_models):
  """Rows at T=0.7 with top-k 4, T=0.7, T=1 and greedy (log_softmax): teacher-forced float64 references."""
  target, _, _, trained = tree_models
  prompts, lengths = make_prompts(3, V, LENGTHS, 4)
  params = SamplingParams.create([0.7, 0.7, 1.0, 0.0], top_k=[4, 0, 0, 0])
  out = speculative_generate(
    target,
    trained,
    prompts,
    lengths,
    params,
    jax.random.key(0),
    max_new_tokens=12,
    num_speculative_tokens=3,
    draft_tree=(2, 2, 1),
    logprobs="processed",
  )
  tokens = np.asarray(out.tokens)
  width = prompts.shape[1] + 12
  seqs = np.zeros((4, width), np.int32)
  for r in range(4):  # each row's prompt, then its tokens, right-padded: one teacher-forced call
    p = int(lengths[r])
    seqs[r, : p + 12] = np.concatenate([np.asarray(prompts)[r, :p], tokens[r]])
  all_logits, _ = target(
    jnp.asarray(seqs), jnp.broadcast_to(jnp.arange(width), (4, width)), target.init_cache(4, width)
  )
  for r in range(4):
    p = int(lengths[r])
    x = np.asarray(all_logits[r, p - 1 : p - 1 + 12], np.float64)
    t = float(params.temperature[r]) or 1.0
    x = x / t
    if int(params.top_k[r]):
      kth = np.sort(x, axis=-1)[:, -int(params.top_k[r])][:, None]
      x = np.where(x >= kth, x, -np.inf)
    ref = x - np.log(np.sum(np.exp(x - x.max(-1, keepdims=True)), -1, keepdims=True)) - x.max(-1, keepdims=True)
    want = ref[np.arange(12), tokens[r]]
    np.testing.assert_allclose(np.asarray(out.logprobs)[r], want, rtol=1e-4, atol=1e-4)


def test_bad_trees_are_refused(tree_models):
  target, draft, _, _ = tree_models
  prompts, lengths = make_prompts(0, V, LENGTHS, 4)
  kw = dict(max_new_tokens=4, num_speculative_tokens=2, all_greedy=True)
  args = (prompts, lengths, SamplingParams.greedy(4), None)
  with pytest.raises(ValueError, match="num_speculative_tokens=2 entries"):
    speculative_generate(target, draft, *args, draft_tree=(2, 2, 1), **kw)
  with pytest.raises(ValueError, match="draft_tree"):
    speculative_generate(target, draft, *args, draft_tree=(2, 0), **kw)
  with pytest.raises(ValueError, match=r"\(m, 1, ..., 1\)"):
    speculative_generate(target, PromptLookupDrafter(2), *args, draft_tree=(2, 2), **kw)
  tiny = TinyLM.create(0, V)  # a model without the tree extension still serves chains
  with pytest.raises(ValueError, match="tree extension.*target"):
    speculative_generate(tiny, draft, *args, draft_tree=(2, 2), **kw)
  with pytest.raises(ValueError, match="tree extension.*draft"):
    speculative_generate(target, tiny, *args, draft_tree=(2, 2), **kw)
  out = speculative_generate(tiny, tiny, *args, draft_tree=(1, 1), **kw)  # (1,) * K is the chain
  assert out.tokens.shape == (4, 4)


@pytest.mark.slow  # CI runs the dynamic tree's (tests/drafts/test_dynamic_tree.py) and the sampler's own (tests/verify/test_tree.py)
@pytest.mark.parametrize("drafter", ["model", "eagle"])
def test_sampled_tree_is_lossless(monkeypatch, drafter):
  """The first 3 tokens of N rows follow the target's exact joint when drafts come as sampled trees.

  Temperature 0.8 and top-k 6; tree (3, 2), siblings drawn without replacement
  (the default): the first round's depth-2 walk decides two tokens through
  recursive rejection sampling, so the joint law of tokens 1..3 covers both
  depths and a bonus. N = 20000 rows (each with its own key) detect every
  total-variation shift >= ~0.03 at alpha 1e-3 (asserted in the helper);
  accepting the first child at every depth is rejected.
  """
  out = assert_sampled_tree_follows(
    sampled_tree_case(drafter), (3, 2), monkeypatch, f"{drafter} tree (3, 2), first 3 tokens", accept_first_children
  )
  assert 0.05 < float(out.stats.usable_acceptance_rate) * 3 < 2.5  # nodes are accepted and rejected


@pytest.mark.slow
def test_sampled_lookup_tree_is_lossless(monkeypatch):
  """Deterministic branches (prompt lookup, no draft probabilities) at T=0.8, top-k 6: as above."""
  config = TransformerConfig.tiny(SMALL_V)
  target = unit_target(config, seed=4, embed_scale=0.3)
  prompt = np.array([1, 5, 2, 1, 5, 7, 1])  # "1" was followed by 5 twice: branches 5 7.., 5 2..
  prompts = jnp.asarray(np.tile(prompt, (N_ROWS, 1)), jnp.int32)
  lengths = jnp.full((N_ROWS,), len(prompt), jnp.int32)
  params = SamplingParams.create(jnp.full((N_ROWS,), TEMPERATURE), top_k=TOP_K)
  joint = exact_joint(target, prompt)

  run = first_tokens_run(target, PromptLookupDrafter(1), prompts, lengths, params, 9, draft_tree=(3, 1))

  assert_first_tokens_follow(
    run,
    joint,
    monkeypatch,
    "lookup tree (3, 1), first 3 tokens",
    planted=(tree_round, "tree_rejection_sample", accept_first_children),
  )
