"""`rejection_sample(..., logprobs=...)`: the emitted tokens' log-probabilities under the target.

Checked against float64 NumPy references: "raw" is log_softmax of the logits,
"processed" the log of `stats.reference_probs` (temperature, top-k, top-p) for a
random row and log_softmax for a greedy row, at every emitted position (bonus
and recovered tokens included), 0 after the row's last token.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import SamplingParams, rejection_sample
from tests.stats import HloProgram, reference_probs

B, K, V = 6, 3, 40


def _log_softmax(x):
  x = np.asarray(x, np.float64)
  m = np.max(x, axis=-1, keepdims=True)
  return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


def _inputs(seed, *, with_probs):
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(B, K + 1, V)).astype(np.float32) * 2.0
  draft = rng.integers(0, V, size=(B, K)).astype(np.int32)
  # Make some drafts likely so rows stop at different positions (bonus tokens too).
  draft[:, 0] = np.argmax(logits[:, 0], axis=-1)
  probs = None
  if with_probs:
    probs = rng.dirichlet(np.ones(V), size=(B, K)).astype(np.float32)
  return jnp.asarray(draft), jnp.asarray(logits), probs


PARAMS = dict(temperature=[0.0, 1.0, 0.6, 1.5, 0.0, 0.8], top_k=[0, 0, 5, 0, 3, 12], top_p=[1.0, 1.0, 1.0, 0.7, 1.0, 0.9])


def _expected(logits, tokens, num_emitted, mode):
  """float64 reference [B, K+1]."""
  want = np.zeros(tokens.shape)
  for r in range(B):
    t, k, p = PARAMS["temperature"][r], PARAMS["top_k"][r], PARAMS["top_p"][r]
    for j in range(int(num_emitted[r])):
      if mode == "raw" or t == 0.0:
        lp = _log_softmax(logits[r, j])
      else:
        with np.errstate(divide="ignore"):
          lp = np.log(reference_probs(logits[r, j], t, k, p))
      want[r, j] = lp[tokens[r, j]]
  return want


@pytest.mark.parametrize("with_probs", [False, True])
@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_logprobs_match_float64_references_at_every_emitted_position(mode, with_probs):
  params = SamplingParams.create(**PARAMS)
  checked = 0
  for seed in range(4):
    draft, logits, probs = _inputs(seed, with_probs=with_probs)
    out = rejection_sample(draft, logits, params, jax.random.key(seed), draft_probs=probs, logprobs=mode)
    plain = rejection_sample(draft, logits, params, jax.random.key(seed), draft_probs=probs)
    np.testing.assert_array_equal(np.asarray(out.token_ids), np.asarray(plain.token_ids))  # tokens unchanged
    assert plain.logprobs is None and out.logprobs.shape == (B, K + 1) and out.logprobs.dtype == jnp.float32
    tokens, n = np.asarray(out.token_ids), np.asarray(out.num_emitted)
    want = _expected(np.asarray(logits), tokens, n, mode)
    got = np.asarray(out.logprobs)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.all(np.isfinite(got)) and np.all(got <= 1e-6)
    checked += int(n.sum())
  assert checked > 4 * B  # rows stopped at several positions, not only at the first


def test_recovered_token_gets_its_target_logprob_not_the_residuals():
  """A rejected draft's recovered token is drawn from the residual; its log-prob is the target's.

  With drafts that have no target mass (logit -inf) every draft is rejected at
  position 0, and the residual of an n-gram draft is p without that token,
  renormalised: reporting the residual's log-prob would be larger than log p.
  """
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(B, K + 1, V)).astype(np.float32)
  draft = np.full((B, K), 7, np.int32)
  logits[:, :, 7] = np.float32(-np.inf)
  logits[:, 0, 7] = np.float32(3.0)  # ... except at position 0, where d0 = 7 has most of the mass
  params = SamplingParams.create([1.0] * B)
  outs = [rejection_sample(jnp.asarray(draft), jnp.asarray(logits), params, jax.random.key(s), logprobs="processed")
          for s in range(20)]
  rejected_at_0 = [(o, r) for o in outs for r in range(B) if int(o.num_accepted[r]) == 0]
  assert len(rejected_at_0) > 5
  for o, r in rejected_at_0:
    tok = int(o.token_ids[r, 0])
    target = _log_softmax(logits[r, 0])[tok]
    np.testing.assert_allclose(float(o.logprobs[r, 0]), target, rtol=1e-5, atol=1e-5)
    residual = target - np.log1p(-np.exp(_log_softmax(logits[r, 0])[7]))
    assert abs(float(o.logprobs[r, 0]) - residual) > 0.1  # a residual-based answer would fail


def test_greedy_logprobs_are_log_softmax_in_every_program():
  """all_greedy=True, the run-time greedy cond and a mixed batch agree; the all_greedy program draws no random bits."""
  draft, logits, _ = _inputs(5, with_probs=False)
  greedy = SamplingParams.greedy(B)
  a = rejection_sample(draft, logits, greedy, None, all_greedy=True, logprobs="processed")
  b = rejection_sample(draft, logits, greedy, jax.random.key(0), logprobs="processed")
  c = rejection_sample(draft, logits, greedy, None, all_greedy=True, logprobs="raw")
  for o in (b, c):
    np.testing.assert_array_equal(np.asarray(o.token_ids), np.asarray(a.token_ids))
    np.testing.assert_allclose(np.asarray(o.logprobs), np.asarray(a.logprobs), rtol=1e-6, atol=1e-6)
  want = _expected(np.asarray(logits), np.asarray(a.token_ids), np.asarray(a.num_emitted), "raw")
  np.testing.assert_allclose(np.asarray(a.logprobs), want, rtol=1e-5, atol=1e-5)
  text = jax.jit(lambda d, x: rejection_sample(d, x, greedy, None, all_greedy=True, logprobs="processed")
                 ).lower(draft, logits).compile().as_text()
  prog = HloProgram(text)
  assert "exponential" in prog.opcodes() and prog.op_names()  # the check below reads a real program
  for marker in ("threefry", "random", "rng"):
    assert not prog.mentions(marker), marker


def test_non_finite_logits_follow_the_samplers_rules():
  """+inf tokens share the mass (log 1/count), NaN counts as -inf; the position with nothing above -inf gives -inf."""
  logits = np.zeros((2, 2, 6), np.float32)
  logits[0, 0, [1, 4]] = np.inf  # two +inf tokens
  logits[0, 0, 2] = np.nan
  logits[1, 0, :] = -np.inf
  logits[1, 0, 3] = 1.0
  draft = jnp.asarray([[4], [3]], jnp.int32)
  for mode in ("raw", "processed"):  # under jit: eagerly, a NaN logit is a ValueError
    out = jax.jit(lambda x, m=mode: rejection_sample(draft, x, SamplingParams.create([1.0, 0.0]), jax.random.key(1),
                                                     logprobs=m))(jnp.asarray(logits))
    lp, tok = np.asarray(out.logprobs), np.asarray(out.token_ids)
    assert tok[0, 0] in (1, 4) and tok[1, 0] == 3
    np.testing.assert_allclose(lp[0, 0], np.log(0.5), rtol=1e-6)
    np.testing.assert_allclose(lp[1, 0], 0.0, atol=1e-6)  # the only finite logit: probability 1
    assert np.all(np.isfinite(lp))


def test_bad_logprobs_mode_is_a_value_error():
  draft, logits, _ = _inputs(0, with_probs=False)
  with pytest.raises(ValueError, match="logprobs must be one of"):
    rejection_sample(draft, logits, SamplingParams.greedy(B), None, all_greedy=True, logprobs="log")
