"""The static `no_filters` promise: one overflow-safe softmax pass, no run-time branch, the same law.

`no_filters=True` (in `sample_tokens`, `rejection_sample`, `tree_rejection_sample`,
`generate` and `speculative_generate`) promises that no row uses top-k, top-p or
min-p; it travels as static metadata of the parameters
(`SamplingParams.promise_no_filters`). The samplers then compile
`reductions.shifted_chunk_stats` instead of the run-time branches on the
filters, the overflow redo and an empty residual. Checked here:

* the statistics equal a float64 reference on ordinary rows and on every
  non-finite rule (overflowing temperature, +inf logits, NaN, nothing above -inf);
* the compiled programs hold no `conditional`;
* chi-square (alpha = 1e-3, `tests.support.stats.ALPHA`, fixed seeds) of sampled tokens,
  of every position of a rejection round, and of the first three tokens of
  `speculative_generate`, each with a planted wrong sampler rejected by the
  same samples.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import SamplingParams, rejection_sample
from specdec_jax.loop.decoding import generate, speculative_generate
from specdec_jax.sampling import reductions, sample, thresholds
from specdec_jax.sampling.draws import categorical_with_fallback
from specdec_jax.sampling.reductions import chunk_size, greedy_argmax, shifted_chunk_stats
from specdec_jax.sampling.sample import sample_tokens
from specdec_jax.sampling.stats import log_probs_from_stats, position_stats
from tests.support import sampling_reference as ref
from tests.support import stats
from tests.support.lossless import N_ROWS, SMALL_V, assert_first_tokens_follow, continuation_logits, first_tokens_run
from tests.support.tiny_lm import TinyLM

_F32_MAX = float(np.finfo(np.float32).max)


def _hard_rows(v=4096, seed=0):
  """Logits and temperatures of rows that test every rule; row i's expected law comes from `ref`."""
  rng = np.random.default_rng(seed)
  x = (rng.normal(size=(7, v)) * 3).astype(np.float32)
  t = np.array([1.0, 1e-3, 0.7, 1.0, 1.3, 0.5, 0.0], np.float32)
  x[1] *= 1e37  # logits / T overflows float32
  x[2, [5, 9, 3000]] = np.inf  # three +inf tokens, two of them in one chunk
  x[3] = -np.inf  # nothing above -inf
  x[4, 7] = np.nan  # a masked token
  x[5, : v // 2] = -np.inf  # half the vocabulary masked
  return x, t


@pytest.mark.parametrize("whole_rows", [False, True], ids=["chunks", "whole_rows"])
def test_shifted_chunk_stats_match_float64_log_softmax(whole_rows):
  x, t = _hard_rows()
  v = x.shape[1]
  c = v if whole_rows else chunk_size(v)
  shift, lse, am, chunk_logw = shifted_chunk_stats(jnp.asarray(x), jnp.asarray(t), chunk=c, with_argmax=True)
  with np.errstate(invalid="ignore"):  # the empty row: -inf - -inf
    logp = np.asarray(reductions.scale_logits(jnp.asarray(x), jnp.asarray(t), shift)) - np.asarray(lse)[:, None]
  for i in range(len(t)):
    want = ref.processed_log_probs(x[i], temperature=float(t[i]) if t[i] > 0 else 1.0)
    kept = want > -np.inf
    if not kept.any():  # nothing above -inf: lse -inf, no distribution
      assert np.asarray(lse)[i] == -np.inf
      continue
    # float64 may underflow to -inf where float32 keeps a probability below 1e-38: compare probabilities there.
    np.testing.assert_allclose(np.exp(logp[i]), np.exp(want), rtol=1e-5, atol=1e-7, err_msg=f"row {i}")  # f32 sums
    np.testing.assert_allclose(logp[i, kept], want[kept], atol=2e-5, err_msg=f"row {i}")
  shift = np.asarray(shift)
  assert shift[2] == np.inf and shift[3] == 0 and np.all(np.isfinite(np.delete(shift, 2)))  # +inf row; empty row
  np.testing.assert_array_equal(np.asarray(am), np.asarray(greedy_argmax(jnp.asarray(x))[0]))
  # The chunk masses add up to the normaliser, in the same shifted frame.
  np.testing.assert_allclose(
    np.asarray(jax.nn.logsumexp(chunk_logw, axis=-1))[[0, 1, 2, 4, 5, 6]],
    np.asarray(lse)[[0, 1, 2, 4, 5, 6]],
    rtol=1e-6,
  )


def test_shifted_chunk_stats_shift_is_the_row_max_and_plus_inf_counts():
  x = np.zeros((2, 64), np.float32)
  x[0, [1, 2, 40]] = np.inf  # three +inf: log 3
  x[1, 5] = 1e38
  shift, lse, _, _ = shifted_chunk_stats(jnp.asarray(x), jnp.array([0.5, 1e-4]), chunk=8)
  assert np.asarray(shift)[0] == np.inf and np.asarray(shift)[1] == np.float32(1e38)
  np.testing.assert_allclose(np.asarray(lse), [np.log(3.0), 0.0], rtol=1e-6, atol=1e-7)


def test_position_stats_no_filters_equal_the_default_unfiltered_path():
  """Every consumer reads the statistics through scale_logits(..., shift): the log-probabilities agree."""
  x, t = _hard_rows(seed=1)
  x = np.stack([x, x[::-1]], axis=1)  # [B, 2, V]: the middle axis of rejection_sample
  params = SamplingParams.create(t)
  for chunks in (False, True):
    want = np.asarray(log_probs_from_stats(x, params, position_stats(jnp.asarray(x), params, chunks=chunks)))
    got_stats = position_stats(jnp.asarray(x), params.promise_no_filters(), chunks=chunks)
    got = np.asarray(log_probs_from_stats(x, params, got_stats))
    np.testing.assert_array_equal(got == -np.inf, want == -np.inf)
    np.testing.assert_allclose(np.exp(got), np.exp(want), atol=1e-6)
    assert not np.asarray(got_stats.redone).any() and np.all(np.asarray(got_stats.thr) == -np.inf)


def test_the_plus_inf_rule_with_two_in_one_chunk_on_the_default_path():
  """Regression: two +inf logits in one chunk once made that chunk's mass NaN, so it was dropped."""
  x = np.zeros((1, 4096), np.float32)
  x[0, [5, 9]] = np.inf
  logp = np.asarray(sample.process_logits(jnp.asarray(x), SamplingParams.create([0.7])))
  np.testing.assert_allclose(logp[0, [5, 9]], np.log(0.5), rtol=1e-6)
  assert np.all(np.delete(logp[0], [5, 9]) == -np.inf)


def _ops(fn, *args):
  return stats.HloProgram(jax.jit(fn).lower(*args).compile().as_text())


def test_the_no_filters_programs_hold_no_conditional():
  b, k, v = 2, 2, 512  # chunked (chunk_size(512) divides it), as a real vocabulary is
  logits = jnp.zeros((b, k + 1, v))
  draft = jnp.zeros((b, k), jnp.int32)
  probs = jnp.full((b, k, v), 1.0 / v)
  params = SamplingParams.create([1.0, 0.0])
  keys = jax.random.split(jax.random.key(0), b)
  rs = lambda lg, d, pp, p, kk, **kw: rejection_sample(d, lg, p, kk, draft_probs=pp, **kw)
  for dp in (probs, None):
    prog = _ops(functools.partial(rs, no_filters=True, all_random=True), logits, draft, dp, params, keys)
    assert not prog.conditionals(prog.reachable()), [ins.opcode for ins, _ in prog.conditionals()]
  # A mixed batch keeps one: the run-time shortcut of an all-greedy batch (the contract's), outside the branch.
  prog = _ops(functools.partial(rs, no_filters=True), logits, draft, probs, params, keys)
  assert len(prog.conditionals(prog.reachable())) == 1
  assert len(prog.conditionals(prog.reachable(through_conditionals=False))) == 1
  default = _ops(functools.partial(rs, all_random=True), logits, draft, probs, params, keys)
  assert default.conditionals(default.reachable())  # the check can see the default program's branches
  st = lambda lg, p, kk, **kw: sample_tokens(lg, p, kk, **kw)
  prog = _ops(functools.partial(st, no_filters=True), logits[:, 0], params, keys)
  assert not prog.conditionals(prog.reachable())
  assert _ops(st, logits[:, 0], params, keys).conditionals()


def test_sample_tokens_no_filters_follows_the_law_and_keeps_the_rules():
  """Chi-square per row (N = 20000 draws a row, alpha = 1e-3); a planted T=1 sampler is rejected."""
  v, n = 8, 20000
  base = np.array([1.0, 0.2, -0.5, 2.0, 0.0, -1.0, 0.7, 1.4], np.float32)
  rows = np.stack([base, base * 1e37, np.where(np.arange(v) % 3 == 0, np.inf, base), base])
  t = np.array([0.8, 1e-4, 1.0, 0.0], np.float32)
  params = SamplingParams.create(t, top_k=[0, 0, 0, 3])  # the greedy row's top_k is ignored anyway
  keys = jax.random.split(jax.random.key(3), n)
  draw = jax.jit(
    jax.vmap(lambda kk: sample_tokens(jnp.asarray(rows), params, jax.random.split(kk, 4), no_filters=True)[0])
  )
  tokens = np.asarray(draw(keys))  # [n, 4]
  results = []
  for i in (0, 2):  # row 1 has one outcome (checked below)
    want = np.exp(ref.processed_log_probs(rows[i], temperature=float(t[i])))
    results.append(stats.chisquare_gof(tokens[:, i], want, label=f"row {i}"))
  stats.assert_gof(results)
  assert set(tokens[:, 1].tolist()) == {3}  # T near 0: the argmax, no overflow
  assert set(tokens[:, 2].tolist()) <= {0, 3, 6}  # +inf tokens only
  np.testing.assert_array_equal(tokens[:, 3], 3)  # greedy
  wrong = stats.chisquare_gof(
    tokens[:, 0], np.exp(ref.processed_log_probs(rows[0], temperature=1.0)), label="temperature ignored"
  )
  assert wrong.pvalue < stats.ALPHA, wrong


def _round_law(p, q, *, residual=True):
  """Per position j: P(reach j) [K+1] and the law of the token emitted at j [K+1, V], drafts from q [K, V].

  residual=False is the planted bug: a rejection draws from p instead of normalise(max(p - q, 0)).
  """
  k = len(q)
  reach, probs = np.ones(k + 1), []
  for j in range(k):
    accept = np.minimum(p[j], q[j])  # P(draft x and accepted), per token x
    a = accept.sum()
    resid = np.maximum(p[j] - q[j], 0) if residual else p[j]
    probs.append(accept + (1 - a) * resid / resid.sum())  # an accepted draft, or the recovered token
    reach[j + 1] = reach[j] * a
  probs.append(p[k])  # the bonus
  return reach, np.array(probs)


@pytest.mark.parametrize("with_probs", [True, False], ids=["draft_probs", "no_draft_probs"])
def test_rejection_sample_no_filters_every_position_chisquare(with_probs):
  """20000 rows, K = 2, T = 0.9, alpha = 1e-3: each position's token (where reached) and num_accepted.

  Position 0 has all 20000 rows (detects TV >= ~0.02 at 80% power), later positions
  >= 4000. A sampler that draws a rejection's token from p instead of the residual
  (the classic mistake) is rejected by the same samples.
  """
  n, k, v, t = 20000, 2, 8, 0.9
  rng = np.random.default_rng(5)
  logits = rng.normal(size=(k + 1, v)).astype(np.float32) * 2.5  # argmax guesses accepted often enough
  p = np.stack([np.exp(ref.processed_log_probs(logits[j], temperature=t)) for j in range(k + 1)])
  if with_probs:
    q = 0.6 * p[:k] + 0.4 * rng.dirichlet(np.ones(v), k)  # a draft that agrees often: every position is reached
    drafts = np.stack([rng.choice(v, n, p=q[j]) for j in range(k)], 1)
  else:  # n-gram guesses: the likeliest token at each position, one-hot q
    drafts = np.tile(np.argmax(p[:k], axis=-1), (n, 1))
    q = np.eye(v)[drafts[0]]
  out = rejection_sample(
    jnp.asarray(drafts, jnp.int32),
    jnp.broadcast_to(jnp.asarray(logits), (n, k + 1, v)),
    SamplingParams.create(np.full(n, t, np.float32)),
    jax.random.split(jax.random.key(8), n),
    draft_probs=jnp.broadcast_to(jnp.asarray(q, jnp.float32), (n, k, v)) if with_probs else None,
    no_filters=True,
  )
  tokens, acc = np.asarray(out.token_ids), np.asarray(out.num_accepted)

  def check(residual, label):
    reach, probs = _round_law(p, q, residual=residual)
    found = [stats.chisquare_gof(tokens[acc >= j, j], probs[j], label=f"{label}, position {j}") for j in range(k + 1)]
    return found + [stats.chisquare_gof(acc, np.append(reach[:-1] - reach[1:], reach[-1]), label=f"{label}, accepted")]

  right = check(True, "no_filters")
  assert all(r.num_samples >= 4000 and r.num_bins >= 2 for r in right[:-1]), right
  stats.assert_gof(right)
  wrong = min(check(False, "planted: recovered from p"), key=lambda r: r.pvalue)
  assert wrong.pvalue < stats.ALPHA, wrong


def test_categorical_with_fallback_draws_from_the_fallback_only_where_empty():
  """4000 draws a row, alpha = 1e-3; a sampler that mixed in the fallback where it should not is rejected."""
  n = 4000
  with np.errstate(divide="ignore"):  # log 0 = -inf: impossible tokens
    main = np.log(np.array([[0, 1, 0, 3, 0, 0, 0, 0], [0] * 8], np.float32))
    fallback = np.log(np.array([[1] * 8, [0, 0, 0, 0, 0, 2, 2, 0]], np.float32))
  draw = jax.jit(
    jax.vmap(lambda kk: categorical_with_fallback(jax.random.split(kk, 2), jnp.asarray(main), jnp.asarray(fallback)))
  )
  tokens = np.asarray(draw(jax.random.split(jax.random.key(1), n)))
  stats.assert_gof(
    [
      stats.chisquare_gof(tokens[:, 0], np.array([0, 1, 0, 3, 0, 0, 0, 0]) / 4, label="main"),
      stats.chisquare_gof(tokens[:, 1], np.array([0, 0, 0, 0, 0, 1, 1, 0]) / 2, label="fallback"),
    ]
  )
  mixed = 0.8 * np.array([0, 1, 0, 3, 0, 0, 0, 0]) / 4 + 0.2 / 8  # planted: 20% of row 0 from its fallback
  wrong = stats.chisquare_gof(tokens[:, 0], mixed, label="planted: fallback mixed in")
  assert wrong.pvalue < stats.ALPHA, wrong


@pytest.mark.slow  # the flag's samplers are checked above; this is the loop around them
def test_speculative_generate_no_filters_is_lossless(monkeypatch):
  """The first 3 tokens of 20000 rows follow the target's exact joint (T = 0.8, no filters), as in test_decoding."""
  target, draft = TinyLM.create(10, SMALL_V, logit_scale=1.5), TinyLM.create(11, SMALL_V, logit_scale=1.5)
  prompt = np.array([1, 5, 2, 7])
  probs = stats.reference_probs(continuation_logits(target, prompt), 0.8)
  v = SMALL_V
  joint = (
    probs[0, 0][:, None, None] * probs[:, 1].reshape(v, v, v)[:, 0][:, :, None] * probs[:, 2].reshape(v, v, v)
  ).reshape(-1)
  prompts = jnp.asarray(np.tile(prompt, (N_ROWS, 1)), jnp.int32)
  lengths = jnp.full((N_ROWS,), len(prompt), jnp.int32)
  params = SamplingParams.create(jnp.full((N_ROWS,), 0.8))

  run = first_tokens_run(target, draft, prompts, lengths, params, 42, no_filters=True)

  out = assert_first_tokens_follow(run, joint, monkeypatch, "speculative_generate(no_filters=True), first 3 tokens")
  assert 0.05 < float(out.stats.acceptance_rate) < 0.95


def test_the_promise_is_static_metadata_that_ignores_the_filters():
  params = SamplingParams.create([1.0, 0.7], top_k=[2, 0], top_p=[1.0, 0.5])
  promised = params.promise_no_filters()
  assert promised.no_filters and not params.no_filters
  assert jax.tree.leaves(promised) == jax.tree.leaves(params)  # no new leaf: a new structure, the same arrays
  assert jax.tree.structure(promised) != jax.tree.structure(params)
  np.testing.assert_array_equal(thresholds.filter_active(promised, 8), [False, False])
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8)).astype(np.float32))
  want = sample.process_logits(x, SamplingParams.create([1.0, 0.7]))  # the same rows, unfiltered
  np.testing.assert_allclose(np.exp(sample.process_logits(x, promised)), np.exp(want), atol=1e-6)


def test_tree_rejection_sample_with_the_promise_has_fewer_branches():
  from specdec_jax import tree_rejection_sample

  b, n, v = 2, 3, 512
  args = (
    jnp.zeros((b, n), jnp.int32),
    jnp.zeros((b, n + 1, v)),
    SamplingParams.create([1.0, 0.5]),
    jax.random.split(jax.random.key(0), b),
    jnp.full((b, n + 1, v), 1.0 / v),
  )
  tr = lambda d, lg, p, kk, q, **kw: tree_rejection_sample(d, np.array([-1, -1, 0]), lg, p, kk, draft_probs=q, **kw)
  promised, default = _ops(functools.partial(tr, no_filters=True), *args), _ops(tr, *args)
  assert len(promised.conditionals(promised.reachable())) < len(default.conditionals(default.reachable()))


def test_loops_with_no_filters_keep_greedy_rows_exact(tree_models):
  """Greedy rows of a mixed batch equal plain greedy decoding: plain, a chain, and the EAGLE head's tree."""
  target, draft, _, eagle = tree_models  # float32 Transformers (tests/loop/test_tree_round.py), V = 16
  prompts, lengths = jnp.asarray(np.arange(12).reshape(3, 4) % 16, jnp.int32), jnp.array([4, 2, 3])
  params = SamplingParams.create([0.0, 1.0, 0.0])
  plain = generate(target, prompts, lengths, SamplingParams.greedy(3), None, max_new_tokens=6, all_greedy=True)
  kw = dict(max_new_tokens=6, no_filters=True)
  for out in (
    generate(target, prompts, lengths, params, jax.random.key(0), **kw),
    speculative_generate(target, draft, prompts, lengths, params, jax.random.key(0), num_speculative_tokens=3, **kw),
    speculative_generate(
      target, eagle, prompts, lengths, params, jax.random.key(0), num_speculative_tokens=2, draft_tree=(2, 2), **kw
    ),
  ):
    np.testing.assert_array_equal(np.asarray(out.tokens)[[0, 2]], np.asarray(plain.tokens)[[0, 2]])
    assert np.all(np.asarray(out.lengths) == 6)


@pytest.mark.parametrize("mode", ["processed", pytest.param("raw", marks=pytest.mark.slow)])
def test_logprobs_under_the_promise_are_the_default_programs(mode):
  """The shifted frame changes no log-probability: the same key draws the same tokens, with the same values."""
  target = TinyLM.create(5, 16)
  prompts, lengths = jnp.asarray(np.arange(12).reshape(3, 4) % 16, jnp.int32), jnp.array([4, 2, 3])
  params = SamplingParams.create([0.7, 1.0, 0.0])
  kw = dict(max_new_tokens=6, logprobs=mode)
  want = generate(target, prompts, lengths, params, jax.random.key(3), **kw)
  got = generate(target, prompts, lengths, params, jax.random.key(3), no_filters=True, **kw)
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-5)
  assert np.all(np.asarray(got.logprobs) < 0)  # real log-probabilities, not placeholders
