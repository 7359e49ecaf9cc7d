"""The threshold search's candidate stages, and the penalised-logits view the samplers read through.

* The narrowed candidate stage (the 8 largest of every 128 group-top
  candidates) gives the sorted reference's thresholds exactly, and batches
  whose rows need more candidates (top-k in the hundreds, wide top-p) fall
  back to all candidates and still do; turning the stage off changes nothing
  but rounding of the normaliser.
* `penalized_view`: the samplers apply the bias and penalties inside every
  read; their outputs equal those of the same sampler given the penalised
  logits as a materialised array (same keys, bit for bit).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import PenaltyState, SamplingParams, rejection_sample, sample_tokens
from specdec_jax.sampling import thresholds
from specdec_jax.sampling.penalties import apply_penalties
from specdec_jax.sampling.reductions import scale_logits

V = 32000  # not a power of two: groups of 125 tokens, 256 groups, 1024 candidates -> 64 after narrowing


def _peaked(b, k1, rng):
  """Language-model-like rows: a Gaussian tail and a dozen tokens far above it."""
  x = rng.normal(0, 1.0, (b, k1, V)).astype(np.float32)
  for i in range(b):
    for j in range(k1):
      x[i, j, rng.choice(V, 12, replace=False)] += rng.normal(9.0, 1.5, 12).astype(np.float32)
  return x


def _sorted_reference(x, t, k, p, m):
  scaled = scale_logits(jnp.asarray(x), t)
  thr, _ = thresholds._sorted_threshold_and_lse(scaled, k, p, min_p=m)
  lse = jax.nn.logsumexp(jnp.where(scaled >= thr[..., None], scaled, -jnp.inf), axis=-1)
  return thr, lse


@pytest.mark.parametrize(
  "top_k,top_p,min_p", [(50, 0.9, None), (1, 1.0, None), (0, 0.95, 0.02), (1000, 1.0, None), (300, 0.99, 0.001)]
)
def test_narrowed_candidates_are_exact_and_fall_back(top_k, top_p, min_p):
  rng = np.random.default_rng(top_k)
  b = 6
  x = _peaked(b, 2, rng)
  t = jnp.asarray(rng.choice([1.0, 0.7], b), jnp.float32)
  k, p = jnp.full((b,), top_k, jnp.int32), jnp.full((b,), top_p, jnp.float32)
  m = None if min_p is None else jnp.full((b,), min_p, jnp.float32)
  thr, lse = jax.jit(thresholds.threshold_and_lse)(jnp.asarray(x), t, k, p, min_p=m)
  want_thr, want_lse = _sorted_reference(x, t, k, p, m)
  np.testing.assert_array_equal(thr, want_thr)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-6)
  # top-k 1000 keeps more tokens than the narrowed stage holds (64 here), so that
  # batch must have taken the fallback: the kept sets are larger than 64.
  kept = np.sum(np.asarray(scale_logits(jnp.asarray(x), t)) >= np.asarray(thr)[..., None], axis=-1)
  if top_k == 1000:
    assert np.all(kept >= 1000)
  elif top_k in (1, 50):
    assert np.all(kept <= 64)


def test_narrowing_off_gives_the_same_thresholds(monkeypatch):
  rng = np.random.default_rng(7)
  x = jnp.asarray(_peaked(4, 3, rng))
  t, k, p = jnp.ones((4,), jnp.float32), jnp.array([50, 0, 10, 200], jnp.int32), jnp.array([0.9, 0.8, 1.0, 0.95])
  on = jax.jit(thresholds.threshold_and_lse)(x, t, k, p)
  monkeypatch.setattr(thresholds, "_NARROW_GROUP", 0)
  off = jax.jit(thresholds.threshold_and_lse)(x, t, k, p)  # a new trace: the module constant is read at trace time
  np.testing.assert_array_equal(on[0], off[0])
  np.testing.assert_allclose(on[1], off[1], rtol=1e-6)


def _penalty_problem(seed, b=4, k=3, v=500):
  rng = np.random.default_rng(seed)
  logits = rng.normal(0, 2, (b, k + 1, v)).astype(np.float32)
  # Drafts the target likes (its raw argmax), so acceptance hinges on the penalties:
  # the prompt holds half of them, and a repeated draft counts twice at position 2.
  draft = np.argmax(logits[:, :k], axis=-1).astype(np.int32)
  draft[:, 1] = draft[:, 0]
  prompt = rng.integers(0, v, (b, 8)).astype(np.int32)
  prompt[::2, :k] = draft[::2]
  state = PenaltyState.from_prompt(prompt, np.full(b, 8), v).add_tokens(rng.integers(0, v, (b, 5)))
  params = SamplingParams.create(
    np.array([0.0, 1.0, 0.8, 1.0][:b]),
    top_k=np.array([0, 0, 40, 0][:b]),
    repetition_penalty=1.4,
    frequency_penalty=0.5,
    presence_penalty=0.3,
    logit_bias={int(draft[0, 0]): 2.5, 3: -1.0},
    min_p=np.array([0, 0.05, 0, 0][:b]),
  )
  plain = SamplingParams.create(params.temperature, top_k=params.top_k, min_p=params.min_p)
  return logits, draft, state, params, plain


# Slow-marked (CI budget): CI checks the view through sample_tokens below and rejection_sample's penalties
# by their exact laws (tests/sampling/test_options.py).
@pytest.mark.slow
@pytest.mark.parametrize("with_dp", [False, True])
def test_rejection_sample_through_the_view_equals_materialised_penalised_logits(with_dp):
  logits, draft, state, params, plain = _penalty_problem(1)
  b, k1, v = logits.shape
  dp = None
  if with_dp:
    dp = np.random.default_rng(2).dirichlet(np.ones(v), (b, k1 - 1)).astype(np.float32)
  penalised = jax.jit(apply_penalties)(jnp.asarray(logits), params, state, jnp.asarray(draft))
  run = jax.jit(functools.partial(rejection_sample, logprobs="processed"))  # jitted: eager calls are slow
  for seed in range(8):
    key = jax.random.key(seed)
    got = run(draft, logits, params, key, draft_probs=dp, penalty_state=state)
    want = run(draft, penalised, plain, key, draft_probs=dp)
    np.testing.assert_array_equal(got.token_ids, want.token_ids)
    np.testing.assert_array_equal(got.logprobs, want.logprobs)


def test_sample_tokens_through_the_view_equals_materialised_penalised_logits():
  logits, _, state, params, plain = _penalty_problem(3)
  x = logits[:, 0]
  penalised = jax.jit(apply_penalties)(jnp.asarray(x), params, state)
  run = jax.jit(functools.partial(sample_tokens, logprobs="processed"))  # jitted: eager op-by-op calls are slow
  for seed in range(5):
    got = run(x, params, jax.random.key(seed), penalty_state=state)
    want = run(penalised, plain, jax.random.key(seed))
    for g, w in zip(got, want):
      np.testing.assert_array_equal(g, w)


def test_a_few_rows_needing_all_candidates_are_redone_alone():
  # Row 1 keeps 1000 tokens (more than the 64 narrowed candidates hold), row 3 a
  # wide top-p; the others are narrow. Only those two are redone from all candidates.
  rng = np.random.default_rng(11)
  b = 6
  x = _peaked(b, 2, rng)
  t = jnp.ones((b,), jnp.float32)
  k = jnp.array([50, 1000, 5, 0, 20, 50], jnp.int32)
  p = jnp.array([0.9, 1.0, 1.0, 0.999, 0.8, 1.0], jnp.float32)
  thr, lse = jax.jit(thresholds.threshold_and_lse)(jnp.asarray(x), t, k, p)
  want_thr, want_lse = _sorted_reference(x, t, k, p, None)
  np.testing.assert_array_equal(thr, want_thr)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-6)


def test_largest_key_by_digits_equals_bit_by_bit_search():
  """The split search's bisection weighs 16 keys a step; its answer must be `largest_key`'s, to the bit.

  Rows of values (ties, -inf, +inf, both signs) and per-row limits: the largest key with at least k values at
  or above it (the top-k value), and with at least a given mass (the top-p value), some limits unreachable.
  A planted off-by-one (the digit after the last good one) changes the answers.
  """
  rng = np.random.default_rng(3)
  x = rng.standard_normal((40, 300)).astype(np.float32)
  x[:, :20] = np.round(x[:, :20])  # ties
  x[0, :5], x[1, :3] = -np.inf, np.inf
  u = thresholds.ordered_key(jnp.asarray(x))
  e = jnp.exp(jnp.asarray(np.nan_to_num(x, posinf=3.0, neginf=-50.0)))
  k = jnp.asarray(rng.integers(1, 320, 40), jnp.int32)  # some above 300: no key has that many
  target = jnp.asarray(rng.uniform(0.0, 1.2, 40), jnp.float32) * jnp.sum(e, axis=-1)
  count_one = lambda t: jnp.sum(u >= t[:, None], axis=-1)
  count_many = lambda t: jnp.sum(u[:, None, :] >= t[..., None], axis=-1)
  mass_one = lambda t: jnp.sum(jnp.where(u >= t[:, None], e, 0.0), axis=-1)
  mass_many = lambda t: jnp.sum(jnp.where(u[:, None, :] >= t[..., None], e[:, None, :], 0.0), axis=-1)
  for one, many, limit in ((count_one, count_many, k), (mass_one, mass_many, target)):
    want = np.asarray(thresholds.largest_key(one, lambda w: w >= limit, (40,)))
    got = np.asarray(thresholds.largest_key_by_digits(many, lambda w: w >= limit[:, None], (40,)))
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(want)) > 20, "the rows' answers are too alike to test the search"
    planted = np.asarray(
      thresholds.largest_key_by_digits(many, lambda w, lim=limit: jnp.roll(w >= lim[:, None], 1, axis=-1), (40,))
    )
    assert (planted != want).any(), "a search that takes one digit too many gives the same answers"
  assert int(thresholds.largest_key_by_digits(lambda t: t, lambda w: w <= 7)) == 7
