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
from tests.support.stats import HloProgram, reference_probs

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


PARAMS = dict(
  temperature=[0.0, 1.0, 0.6, 1.5, 0.0, 0.8], top_k=[0, 0, 5, 0, 3, 12], top_p=[1.0, 1.0, 1.0, 0.7, 1.0, 0.9]
)


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
  outs = [
    rejection_sample(jnp.asarray(draft), jnp.asarray(logits), params, jax.random.key(s), logprobs="processed")
    for s in range(20)
  ]
  rejected_at_0 = [(o, r) for o in outs for r in range(B) if int(o.num_accepted[r]) == 0]
  assert len(rejected_at_0) > 5
  for o, r in rejected_at_0:
    tok = int(o.token_ids[r, 0])
    target = _log_softmax(logits[r, 0])[tok]
    np.testing.assert_allclose(float(o.logprobs[r, 0]), target, rtol=1e-5, atol=1e-5)
    residual = target - np.log1p(-np.exp(_log_softmax(logits[r, 0])[7]))
    assert abs(float(o.logprobs[r, 0]) - residual) > 0.1  # a residual-based answer would fail


def test_greedy_logprobs_are_log_softmax_in_every_program():
  """all_greedy=True, the run-time greedy cond and "raw" agree; the all_greedy program draws no random bits."""
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
  text = (
    jax.jit(lambda d, x: rejection_sample(d, x, greedy, None, all_greedy=True, logprobs="processed"))
    .lower(draft, logits)
    .compile()
    .as_text()
  )
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
    out = jax.jit(
      lambda x, m=mode: rejection_sample(draft, x, SamplingParams.create([1.0, 0.0]), jax.random.key(1), logprobs=m)
    )(jnp.asarray(logits))
    lp, tok = np.asarray(out.logprobs), np.asarray(out.token_ids)
    assert tok[0, 0] in (1, 4) and tok[1, 0] == 3
    np.testing.assert_allclose(lp[0, 0], np.log(0.5), rtol=1e-6)
    np.testing.assert_allclose(lp[1, 0], 0.0, atol=1e-6)  # the only finite logit: probability 1
    assert np.all(np.isfinite(lp))


def test_bad_logprobs_mode_is_a_value_error():
  draft, logits, _ = _inputs(0, with_probs=False)
  with pytest.raises(ValueError, match="logprobs must be one of"):
    rejection_sample(draft, logits, SamplingParams.greedy(B), None, all_greedy=True, logprobs="log")


# ----------------------------------------------------------------------------
# The loops: generate and speculative_generate
# ----------------------------------------------------------------------------

from specdec_jax import PromptLookupDrafter, generate, speculative_generate  # noqa: E402
from tests.support.tiny_lm import TinyLM, make_prompts  # noqa: E402

LV, LP, LMAX = 32, 7, 12
LOOP_LENGTHS = [7, 3, 1, 5]
LOOP_EOS = (28, 31)


def _teacher_forced(model, prompts, lengths, out, params_np, mode):
  """float64 reference [B, max_new] from one uncached call per row on prompt + generated tokens."""
  tokens, n = np.asarray(out.tokens), np.asarray(out.lengths)
  want = np.zeros(tokens.shape)
  for r, plen in enumerate(np.asarray(lengths)):
    seq = np.concatenate([np.asarray(prompts)[r, :plen], tokens[r, : n[r]]]).astype(np.int32)
    logits, _ = model(
      jnp.asarray(seq)[None], jnp.arange(len(seq), dtype=jnp.int32)[None], model.init_cache(1, len(seq))
    )
    logits = np.asarray(logits[0], np.float64)
    t, k, p = params_np["temperature"][r], params_np["top_k"][r], params_np["top_p"][r]
    for j in range(n[r]):
      row = logits[plen - 1 + j]
      if mode == "raw" or t == 0.0:
        lp = _log_softmax(row)
      else:
        with np.errstate(divide="ignore"):
          lp = np.log(reference_probs(row, t, k, p))
      want[r, j] = lp[tokens[r, j]]
  return want


# Slow-marked (CI budget): CI checks both modes in the loops with options (tests/loop/test_option_loops.py, the same
# loop plumbing with a mixed batch), and every mode of rejection_sample against float64 above.
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_loops_return_the_targets_logprobs_of_their_tokens(mode):
  """Greedy: both loops give the same tokens and log-probs; sampled: each loop's log-probs are the target's own
  (teacher-forced float64 reference), for mixed temperatures and filters, ragged prompts and EOS inside rounds."""
  target, draft = TinyLM.create(0, LV), TinyLM.create(1, LV)
  prompts, lengths = make_prompts(0, LV, LOOP_LENGTHS, LP)
  common = dict(max_new_tokens=LMAX, eos_token_id=LOOP_EOS, logprobs=mode)

  greedy = SamplingParams.greedy(4)
  g = {"temperature": [0.0] * 4, "top_k": [0] * 4, "top_p": [1.0] * 4}
  plain = generate(target, prompts, lengths, greedy, None, all_greedy=True, **common)
  spec = speculative_generate(
    target, draft, prompts, lengths, greedy, None, num_speculative_tokens=3, all_greedy=True, **common
  )
  np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(plain.tokens))
  np.testing.assert_allclose(np.asarray(spec.logprobs), np.asarray(plain.logprobs), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(
    np.asarray(plain.logprobs), _teacher_forced(target, prompts, lengths, plain, g, mode), rtol=1e-4, atol=1e-4
  )
  assert np.any(np.asarray(plain.lengths) < LMAX)  # EOS cut some rows: their tail must be 0 (checked above)

  mixed = {"temperature": [1.0, 0.0, 0.7, 1.3], "top_k": [0, 0, 6, 0], "top_p": [1.0, 1.0, 1.0, 0.8]}
  params = SamplingParams.create(**mixed)
  for seed in range(3):
    key = jax.random.key(seed)
    outs = [
      generate(target, prompts, lengths, params, key, **common),
      speculative_generate(target, draft, prompts, lengths, params, key, num_speculative_tokens=3, **common),
      speculative_generate(
        target, PromptLookupDrafter((2, 1)), prompts, lengths, params, key, num_speculative_tokens=2, **common
      ),
    ]
    for out in outs:
      assert out.logprobs.shape == (4, LMAX) and out.logprobs.dtype == jnp.float32
      np.testing.assert_allclose(
        np.asarray(out.logprobs), _teacher_forced(target, prompts, lengths, out, mixed, mode), rtol=1e-4, atol=1e-4
      )


def test_loops_without_logprobs_return_none_and_bad_modes_are_refused():
  target = TinyLM.create(0, LV)
  prompts, lengths = make_prompts(0, LV, LOOP_LENGTHS, LP)
  out = generate(target, prompts, lengths, SamplingParams.greedy(4), None, max_new_tokens=3, all_greedy=True)
  assert out.logprobs is None
  with pytest.raises(ValueError, match="generate: logprobs must be one of"):
    generate(target, prompts, lengths, SamplingParams.greedy(4), None, max_new_tokens=3, logprobs=True)
  with pytest.raises(ValueError, match="speculative_generate: logprobs must be one of"):
    speculative_generate(
      target,
      target,
      prompts,
      lengths,
      SamplingParams.greedy(4),
      None,
      max_new_tokens=3,
      num_speculative_tokens=2,
      logprobs="sampled",
    )
