"""Block verification (`rejection_sample(..., method="block")`, Sun et al., arXiv 2403.10444).

Two layers of evidence:

* Exact, in float64, on a small vocabulary: `round_law` enumerates every draft
  block and the algorithm's stopping probabilities, and `sequence_law` runs
  rounds until L tokens exist. Block verification gives exactly the target's
  law of the first L tokens, accepts in expectation at least as many drafts as
  token verification (strictly more on the paper's example), and a planted
  over-accepting rule is shown not to be lossless.
* Sampled, from `rejection_sample` itself: the law of a round's whole output
  (accepted drafts and the final token, ragged rows, with and without draft
  probabilities, mixed with greedy rows) is chi-square tested against
  `round_law` at ALPHA = 1e-3, and the same test rejects the planted rule
  traced into the sampler.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import SamplingParams, rejection_sample
from specdec_jax.verify import block, chain, fused
from tests.support.optimized import optimized
from tests.support.stats import ALPHA, assert_gof, chisquare_gof

V = 3


def _dist(rng, v=V, sharp=1.5):
  return rng.dirichlet(np.full(v, sharp))


def make_models(seed, v=V, depth=5):
  """Context-dependent target p(. | prefix) and draft q(. | prefix), float64, keyed by the prefix tuple."""
  rng = np.random.default_rng(seed)
  p, q = {}, {}
  for length in range(depth + 1):
    for prefix in itertools.product(range(v), repeat=length):
      p[prefix], q[prefix] = _dist(rng, v), _dist(rng, v)
  return p, q


def _stop_probs_ref(w, r, n, rule):
  """h_1 .. h_n as the paper defines them (rule="block"), or a planted variant."""
  h = []
  for j in range(1, n + 1):
    if j == n:
      h.append(w[j])
    elif rule == "block":
      h.append(r[j] / (r[j] + 1.0 - w[j]) if r[j] > 0 else 0.0)
    else:  # planted: forgets the 1 - w_j term, so it stops as late as it can
      h.append(1.0 if r[j] > 0 else 0.0)
  return h


def block_outcomes(p_rows, q_rows, drafts, rule="block"):
  """{emitted tuple: probability} of one block-verified round for fixed drafts.

  p_rows: n+1 target distributions (position j conditioned on drafts[:j]);
  q_rows: n draft distributions (None entries: one-hot at the draft).
  """
  n = len(drafts)
  qs = [np.eye(V)[d] if q is None else q for q, d in zip(q_rows, drafts)]
  w = [1.0]
  for j in range(n):
    ratio = p_rows[j][drafts[j]] / qs[j][drafts[j]] if qs[j][drafts[j]] > 0 else np.inf
    w.append(min(w[-1] * ratio, 1.0))
  r = [float(np.maximum(w[j] * p_rows[j] - qs[j], 0.0).sum()) if j < n else 0.0 for j in range(n + 1)]
  h = _stop_probs_ref(w, r, n, rule)
  out = {}
  for tau in range(n + 1):
    later = np.prod([1.0 - h[i - 1] for i in range(tau + 1, n + 1)])
    p_tau = later * (h[tau - 1] if tau > 0 else 1.0)
    if p_tau == 0:
      continue
    if tau == n:
      final = p_rows[n]
    else:
      res = np.maximum(w[tau] * p_rows[tau] - qs[tau], 0.0)
      final = res / res.sum() if res.sum() > 0 else p_rows[tau]
    for y in range(V):
      if final[y] > 0:
        key = tuple(drafts[:tau]) + (y,)
        out[key] = out.get(key, 0.0) + p_tau * final[y]
  return out


def token_outcomes(p_rows, q_rows, drafts):
  """{emitted tuple: probability} of one token-verified round (the classic rule)."""
  n = len(drafts)
  qs = [np.eye(V)[d] if q is None else q for q, d in zip(q_rows, drafts)]
  out, alive = {}, 1.0
  for j in range(n):
    d = drafts[j]
    acc = min(1.0, p_rows[j][d] / qs[j][d]) if qs[j][d] > 0 else 1.0
    res = np.maximum(p_rows[j] - qs[j], 0.0)
    res = res / res.sum() if res.sum() > 0 else p_rows[j]
    for y in range(V):
      key = tuple(drafts[:j]) + (y,)
      out[key] = out.get(key, 0.0) + alive * (1.0 - acc) * res[y]
    alive *= acc
  for y in range(V):
    key = tuple(drafts) + (y,)
    out[key] = out.get(key, 0.0) + alive * p_rows[n][y]
  return out


def round_law(p, q, ctx, k, verify):
  """{emitted tuple: probability} of a round from context ctx, drafts drawn from q."""
  law = {}
  for drafts in itertools.product(range(V), repeat=k):
    prob = np.prod([q[ctx + drafts[:j]][drafts[j]] for j in range(k)])
    p_rows = [p[ctx + drafts[:j]] for j in range(k + 1)]
    q_rows = [q[ctx + drafts[:j]] for j in range(k)]
    for out, pr in verify(p_rows, q_rows, list(drafts)).items():
      law[out] = law.get(out, 0.0) + prob * pr
  return law


def sequence_law(p, q, k, length, verify, ctx=()):
  """{first `length` tokens: probability} when rounds repeat from ctx."""
  law = {}
  for out, pr in round_law(p, q, ctx, k, verify).items():
    if len(out) >= length:
      law[out[:length]] = law.get(out[:length], 0.0) + pr
      continue
    for rest, pr2 in sequence_law(p, q, k, length - len(out), verify, ctx + out).items():
      law[out + rest] = law.get(out + rest, 0.0) + pr * pr2
  return law


def target_law(p, length, ctx=()):
  return {
    seq: float(np.prod([p[ctx + seq[:i]][seq[i]] for i in range(length)]))
    for seq in itertools.product(range(V), repeat=length)
  }


def expected_accepted(law):
  return sum(pr * (len(out) - 1) for out, pr in law.items())


@pytest.mark.parametrize("k", [1, 2, 3])
def test_block_rule_is_lossless_exactly(k):
  p, q = make_models(seed=k, depth=k + 3)
  got = sequence_law(p, q, k, 3, block_outcomes)
  want = target_law(p, 3)
  assert set(got) <= set(want)
  np.testing.assert_allclose([got.get(s, 0.0) for s in want], list(want.values()), atol=1e-12)


def test_planted_over_accepting_rule_is_not_lossless():
  """Exact, so any gap above rounding (1e-12) is a loss; this one is large (total variation 0.29)."""
  p, q = make_models(seed=1, depth=6)
  planted = lambda pr, qr, d: block_outcomes(pr, qr, d, rule="planted")
  got = sequence_law(p, q, 3, 3, planted)
  want = target_law(p, 3)
  tv = 0.5 * sum(abs(got.get(s, 0.0) - w) for s, w in want.items())
  assert tv > 0.1, tv


@pytest.mark.parametrize("seed", range(6))
def test_block_accepts_at_least_as_much_as_token(seed):
  p, q = make_models(seed=seed, depth=4)
  for k in (2, 3):
    block = expected_accepted(round_law(p, q, (), k, block_outcomes))
    token = expected_accepted(round_law(p, q, (), k, token_outcomes))
    assert block >= token - 1e-12, (k, block, token)


def test_block_beats_token_on_the_papers_example():
  """Context-free p = (1/3, 2/3), q = (2/3, 1/3), K=2: token 10/9, block 11/9 expected tokens accepted."""
  p = {pre: np.array([1 / 3, 2 / 3, 0.0]) for n in range(4) for pre in itertools.product(range(V), repeat=n)}
  q = {pre: np.array([2 / 3, 1 / 3, 0.0]) for n in range(4) for pre in itertools.product(range(V), repeat=n)}
  token = expected_accepted(round_law(p, q, (), 2, token_outcomes))
  block = expected_accepted(round_law(p, q, (), 2, block_outcomes))
  np.testing.assert_allclose([token, block], [10 / 9, 11 / 9], atol=1e-12)


# ----------------------------------------------------------------------------
# The sampler itself
# ----------------------------------------------------------------------------

_OUTCOMES = {}


def _outcome_index(k):
  """Emitted tuples of a round with K drafts -> consecutive ints."""
  if k not in _OUTCOMES:
    tuples = [t for m in range(1, k + 2) for t in itertools.product(range(V), repeat=m)]
    _OUTCOMES[k] = {t: i for i, t in enumerate(tuples)}
  return _OUTCOMES[k]


def _sample_round(p, q, k, n_rows, seed, with_probs, num_draft=None, greedy_rows=0, kernels="auto"):
  """Draws drafts from q in NumPy, builds the round's inputs, runs rejection_sample(method="block").

  Pallas's interpreter over the chi-square tests' thousands of rows runs compiled at LLVM level 2
  (tests/support/optimized.py: its grid loop runs several times faster there); a small batch compiles at the
  suite's level 0, which compiles faster."""
  rng = np.random.default_rng(seed)
  drafts = np.zeros((n_rows, k), np.int32)
  for b in range(n_rows):
    for j in range(k):
      drafts[b, j] = rng.choice(V, p=q[tuple(drafts[b, :j])])
  logits = np.log(np.stack([[p[tuple(drafts[b, :j])] for j in range(k + 1)] for b in range(n_rows)]))
  probs = np.stack([[q[tuple(drafts[b, :j])] for j in range(k)] for b in range(n_rows)])
  temps = np.ones(n_rows, np.float32)
  temps[:greedy_rows] = 0.0
  if kernels == "pallas" and n_rows >= 1000:
    sample = optimized(rejection_sample, method="block", kernels=kernels)
  else:
    sample = functools.partial(rejection_sample, method="block", kernels=kernels)
  out = sample(
    draft_token_ids=jnp.asarray(drafts),
    target_logits=jnp.asarray(logits, jnp.float32),
    params=SamplingParams.create(temps),
    key=jax.random.key(seed),
    draft_probs=jnp.asarray(probs, jnp.float32) if with_probs else None,
    num_draft_tokens=None if num_draft is None else jnp.asarray(num_draft),
  )
  return drafts, np.asarray(out.token_ids), np.asarray(out.num_emitted)


def _round_law_fixed_n(p, q, k, n, with_probs):
  """Law of a round whose drafts are drawn from q (K of them) but only n are verified."""
  law = {}
  for drafts in itertools.product(range(V), repeat=k):
    prob = np.prod([q[drafts[:j]][drafts[j]] for j in range(k)])
    p_rows = [p[drafts[:j]] for j in range(n + 1)]
    q_rows = [q[drafts[:j]] if with_probs else None for j in range(n)]
    for out, pr in block_outcomes(p_rows, q_rows, list(drafts[:n])).items():
      law[out] = law.get(out, 0.0) + prob * pr
  return law


def _gof(p, q, k, n_per_row, with_probs, seed, rows=12000, kernels="auto"):
  idx = _outcome_index(k)
  drafts, ids, emitted = _sample_round(p, q, k, rows, seed, with_probs, num_draft=n_per_row, kernels=kernels)
  results = []
  for n in sorted(set(n_per_row.tolist())):
    sel = n_per_row == n
    law = _round_law_fixed_n(p, q, k, n, with_probs)
    if not with_probs:  # drafts without probabilities: the round law given each draft block is what we test
      law = {}
      for d in {tuple(r) for r in drafts[sel]}:
        weight = np.mean([tuple(r) == d for r in drafts[sel]])
        p_rows = [p[d[:j]] for j in range(n + 1)]
        for out, pr in block_outcomes(p_rows, [None] * n, list(d[:n])).items():
          law[out] = law.get(out, 0.0) + weight * pr
    probs = np.zeros(len(idx))
    for out, pr in law.items():
      probs[idx[out]] += pr
    samples = [idx[tuple(ids[b, : emitted[b]].tolist())] for b in np.nonzero(sel)[0]]
    results.append(chisquare_gof(samples, probs / probs.sum(), label=f"n={n}, draft_probs={with_probs}"))
  return results


@pytest.mark.parametrize("with_probs", [True, False])
def test_sampler_block_round_matches_the_exact_law(with_probs):
  """The whole output of a round (ragged n in {0, 1, 2, 3}) against the float64 law, ALPHA = 1e-3."""
  p, q = make_models(seed=11, depth=4)
  n = np.arange(12000) % 4
  assert_gof(_gof(p, q, 3, n, with_probs, seed=5))


def test_sampler_block_planted_rule_fails_the_same_check(monkeypatch):
  p, q = make_models(seed=11, depth=4)
  n = np.full(12000, 3)

  original = block.stop_probs

  def planted(w, residual_mass, n):  # forgets the 1 - w_j term: stops as late as it can
    inner = (jnp.arange(1, w.shape[1])[None, :] < n[:, None]) & (residual_mass[:, 1:] > 0)
    return jnp.where(inner, 1.0, original(w, residual_mass, n))

  monkeypatch.setattr(block, "stop_probs", planted)
  # The sampler's jit (which traces block.stop_probs) is traced with the planted rule, then again without it.
  chain._rejection_sample.clear_cache()
  try:
    results = _gof(p, q, 3, n, True, seed=5)
  finally:
    monkeypatch.undo()
    chain._rejection_sample.clear_cache()
  assert min(r.pvalue for r in results) < ALPHA, results


# The Pallas program (verify.fused, run by Pallas's interpreter here, a grid program at a time): the same law,
# its own random stream. The fast test takes 1500 rows with draft probabilities (the block residual pass);
# the slow ones 6000 rows, both kinds of draft, and a planted rule that fails the same check.
PALLAS_FAST_ROWS = 1500
PALLAS_SLOW_ROWS = 6000


def test_pallas_block_round_matches_the_exact_law():
  p, q = make_models(seed=11, depth=4)
  n = np.arange(PALLAS_FAST_ROWS) % 4
  assert_gof(_gof(p, q, 3, n, True, seed=6, rows=PALLAS_FAST_ROWS, kernels="pallas"))


@pytest.mark.slow
@pytest.mark.parametrize("with_probs", [True, False])
def test_pallas_block_round_matches_the_exact_law_slow(with_probs):
  p, q = make_models(seed=11, depth=4)
  n = np.arange(PALLAS_SLOW_ROWS) % 4
  assert_gof(_gof(p, q, 3, n, with_probs, seed=7, rows=PALLAS_SLOW_ROWS, kernels="pallas"))


@pytest.mark.slow
def test_pallas_block_planted_rule_fails_the_same_check(monkeypatch):
  # Uniforms raised to the 4th power: each stop probability is met more often, so blocks run too long.
  p, q = make_models(seed=11, depth=4)
  n = np.full(PALLAS_SLOW_ROWS, 3)
  original = fused._block_stop
  planted = lambda b, row, sc, log_w, u, refs, dims: original(b, row, sc, log_w, u**4, refs, dims)
  monkeypatch.setattr(fused, "_block_stop", planted)
  jax.clear_caches()
  try:
    results = _gof(p, q, 3, n, True, seed=6, rows=PALLAS_SLOW_ROWS, kernels="pallas")
  finally:
    monkeypatch.undo()
    jax.clear_caches()
  assert min(r.pvalue for r in results) < ALPHA, results


@pytest.mark.parametrize("kernels", ["auto", "pallas"])
def test_block_with_greedy_rows_keeps_them_greedy(kernels):
  p, q = make_models(seed=3, depth=4)
  drafts, ids, emitted = _sample_round(p, q, 3, 64, seed=1, with_probs=True, greedy_rows=32, kernels=kernels)
  logits = np.log(np.stack([[p[tuple(drafts[b, :j])] for j in range(4)] for b in range(32)]))
  t = logits.argmax(-1)
  for b in range(32):
    m = 0
    while m < 3 and drafts[b, m] == t[b, m]:
      m += 1
    np.testing.assert_array_equal(ids[b, : emitted[b]], list(drafts[b, :m]) + [t[b, m]])


def test_block_accepts_more_than_token_in_the_sampler():
  """Mean accepted drafts over many rows: block >= token (paper example: 11/9 vs 10/9 at K=2)."""
  rows = 20000
  logits = jnp.log(jnp.tile(jnp.array([1 / 3, 2 / 3]), (rows, 3, 1)))
  q = jnp.tile(jnp.array([2 / 3, 1 / 3]), (rows, 2, 1))
  drafts = jax.random.categorical(jax.random.key(0), jnp.log(q))
  params = SamplingParams.create(jnp.ones(rows))
  acc = {
    m: float(
      jnp.mean(rejection_sample(drafts, logits, params, jax.random.key(1), draft_probs=q, method=m).num_accepted)
    )
    for m in ("token", "block")
  }
  # Standard errors are about 0.006; the exact means are 10/9 and 11/9 (see the float64 test above).
  assert acc["block"] > acc["token"] + 0.05, acc


@pytest.mark.parametrize("kernels", ["auto", "pallas"])
def test_block_without_draft_probs_is_token_when_one_draft(kernels):
  """K=1 (and n=1 rows): the block rule is the token rule; with the same keys, the same outputs."""
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(256, 2, 50)), jnp.float32)
  drafts = jnp.asarray(rng.integers(0, 50, size=(256, 1)), jnp.int32)
  params = SamplingParams.create(jnp.full(256, 0.8), top_k=20)
  a = rejection_sample(drafts, logits, params, jax.random.key(3), method="token", kernels=kernels)
  b = rejection_sample(drafts, logits, params, jax.random.key(3), method="block", kernels=kernels)
  np.testing.assert_array_equal(a.token_ids, b.token_ids)


def test_bad_method_is_a_value_error():
  with pytest.raises(ValueError, match="method"):
    rejection_sample(
      jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 2, 4)), SamplingParams.greedy(1), None, all_greedy=True, method="tree"
    )
