"""Logit bias and repetition/frequency/presence penalties through the loops (`generate`, `speculative_generate`).

The loops keep each row's `PenaltyState` (prompt mask, counts of generated
tokens) and `rejection_sample` adds a round's drafts position by position
(docs/api.md, "Sampling options"). Checked here, with float32 tiny models
(`tests.support.tiny_lm.TinyLM`):

* greedy: `generate` equals a NumPy loop that applies the float64 reference
  steps (`tests.sampling_reference`) to full uncached forwards token by token;
  the prompt-versus-generated rules, the prompt's padding and the state's
  updates each change the tokens, so a loop that got one of them wrong fails;
* greedy: `speculative_generate` (model and prompt-lookup drafts, K=3, EOS
  inside rounds) gives `generate`'s tokens and log-probabilities ("raw" and
  "processed"), the penalties change them, and a planted verifier that forgets
  the round's drafts breaks the equality;
* sampled: each loop's log-probabilities are the target's at each token's own
  context (teacher-forced float64 reference); the first 3 tokens of
  `speculative_generate` and `generate` (T=1, penalties on) follow the exact
  float64 joint by chi-square at alpha = 1e-3 (`tests.support.stats.ALPHA`, fixed
  seeds), and the planted verifier fails that check.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import PromptLookupDrafter, SamplingParams, generate, rejection_sample, speculative_generate
from specdec_jax.loop import chain_round, decoding
from specdec_jax.sampling.penalties import apply_penalties
from tests.support import sampling_reference as ref
from tests.support.lossless import N_ROWS, SMALL_V, assert_first_tokens_follow, continuation_logits, first_tokens_run
from tests.support.option_rows import rows_params
from tests.support.stats import ALPHA, assert_gof, chisquare_gof
from tests.support.tiny_lm import TinyLM, check_output, make_prompts

V, P, MAX_NEW, K = 32, 7, 16, 3
LENGTHS = [7, 3, 1, 5, 4]
# One row per kind of option; rows 1-4 have padding (valid ids: see _padded_prompts).
GREEDY_ROWS = [
  dict(frequency_penalty=0.7, presence_penalty=0.9),  # generated tokens only: the full prompt is not counted
  dict(repetition_penalty=1.8),  # prompt and generated tokens
  dict(repetition_penalty=1.3, frequency_penalty=-0.3, presence_penalty=1.2, bias={5: 2.0, 12: -1.5}),
  dict(repetition_penalty=1.5, presence_penalty=1.5, bias={9: 1.0}),
  # Rewards repetition, so prompt lookup's drafts get accepted and rounds count them.
  dict(frequency_penalty=-0.4, presence_penalty=0.2),
]
_OPTION_NAMES = ("repetition_penalty", "frequency_penalty", "presence_penalty", "bias")


def _greedy_params():
  return dataclasses.replace(rows_params([dict(r, temperature=0.0) for r in GREEDY_ROWS]), min_p=None)


def _padded_prompts():
  """Prompts padded with valid token ids, so that counting the padding as prompt would change the output."""
  tokens, lengths = make_prompts(0, V, LENGTHS, P)
  pad = np.random.default_rng(1).integers(0, V, (len(LENGTHS), P))
  tokens = np.where(np.arange(P)[None, :] < np.asarray(lengths)[:, None], np.asarray(tokens), pad)
  return jnp.asarray(tokens, jnp.int32), lengths


@functools.cache
def _models():
  """(target, draft): the draft is the target with 20% noise on its weights, so it agrees often
  (rounds accept 1-3 drafts, whose context the later positions must count) but not always."""
  target = TinyLM.create(0, V)
  rng = np.random.default_rng(2)
  draft = jax.tree.map(lambda a: a + 0.2 * jnp.asarray(rng.normal(size=a.shape), jnp.float32) * jnp.std(a), target)
  return target, draft


@jax.jit
def _full_forward(model, tokens):
  """Logits [T, V] of one sequence [T] in one uncached call (no state shared with the loops)."""
  t = tokens.shape[0]
  logits, _ = model(tokens[None], jnp.arange(t, dtype=jnp.int32)[None], model.init_cache(1, t))
  return logits[0]


def _true_context(padded_prompt, length, generated):
  """(prompt tokens, generated tokens) of the contract: repetition sees both, frequency/presence the second."""
  return list(padded_prompt[:length]), list(generated)


# Plausible wrong loops: each changes the tokens of some row, so the exact check would catch it.
WRONG_CONTEXTS = {
  "frequency/presence count the prompt": lambda pp, n, g: (list(pp[:n]), list(pp[:n]) + list(g)),
  "repetition ignores the prompt": lambda pp, n, g: ([], list(g)),
  "the prompt's padding counted": lambda pp, n, g: (list(pp), list(g)),
  "generated tokens never counted": lambda pp, n, g: (list(pp[:n]), []),
}


def _reference_greedy(model, prompts, lengths, context=_true_context):
  """The NumPy loop: float64 steps 1-3 on uncached float32 logits, argmax, append.

  Returns (tokens int [B, MAX_NEW], raw [B, MAX_NEW], processed [B, MAX_NEW], margin):
  the log_softmax of each token under the raw and the penalised logits, and the
  smallest gap between the two largest penalised logits (a gap far above
  float32 rounding means the argmax is well defined).
  """
  prompts, lengths = np.asarray(prompts), np.asarray(lengths)
  total = P + MAX_NEW
  tokens, raw, processed = (np.zeros((len(lengths), MAX_NEW)) for _ in range(3))
  margin = np.inf
  for b, row in enumerate(GREEDY_ROWS):
    options = {name: row[name] for name in _OPTION_NAMES if name in row}
    seq = list(prompts[b, : lengths[b]])
    generated = []
    for j in range(MAX_NEW):
      # Padding after the sequence is never seen by its last position (causal attention).
      padded = np.zeros(total, np.int32)
      padded[: len(seq)] = seq
      logits = np.asarray(_full_forward(model, jnp.asarray(padded))[len(seq) - 1], np.float64)
      prompt_ctx, gen_ctx = context(prompts[b], lengths[b], generated)
      x = ref.penalized_logits(logits, prompt_tokens=prompt_ctx, generated_tokens=gen_ctx, **options)
      tok = ref.greedy_token(x)
      margin = min(margin, np.sort(x)[-1] - np.sort(x)[-2])
      tokens[b, j], raw[b, j], processed[b, j] = tok, ref.log_softmax(logits)[tok], ref.log_softmax(x)[tok]
      generated.append(tok)
      seq.append(tok)
  return tokens.astype(np.int32), raw, processed, margin


@functools.cache
def _reference():
  target, _ = _models()
  prompts, lengths = _padded_prompts()
  return _reference_greedy(target, prompts, lengths)


def _eos_and_tokens():
  """EOS ids that end rows 1 and 3 mid-way (two ids: a tuple), and the reference tokens cut after the first one.

  A row that ends inside a round must not count the round's later tokens; the
  cut tokens are what both loops must return.
  """
  tokens = _reference()[0]
  eos = (int(tokens[1, 5]), int(tokens[3, 9]))
  cut = tokens.copy()
  for row in cut:
    hits = np.flatnonzero(np.isin(row, eos))
    if hits.size:
      row[hits[0] + 1 :] = -1
  return eos, cut


def _drafts_forgotten(draft_token_ids, target_logits, params, key=None, *, penalty_state=None, **kwargs):
  """Planted verifier: every position of a round sees only the state before the round (drafts not counted)."""
  x = apply_penalties(target_logits, params, penalty_state)
  plain = dataclasses.replace(
    params,
    repetition_penalty=None,
    frequency_penalty=None,
    presence_penalty=None,
    logit_bias_ids=None,
    logit_bias_values=None,
  )
  return rejection_sample(draft_token_ids, x, plain, key, **kwargs)


def _with_planted_verifier(monkeypatch, run):
  """run() with `_drafts_forgotten` traced into the speculative loop instead of rejection_sample."""
  monkeypatch.setattr(chain_round, "rejection_sample", _drafts_forgotten)
  decoding._speculative_jit.clear_cache()
  try:
    return run()
  finally:
    monkeypatch.undo()
    decoding._speculative_jit.clear_cache()


# ----------------------------------------------------------------------------
# Greedy: generate == the NumPy loop == speculative_generate
# ----------------------------------------------------------------------------


def test_greedy_generate_with_penalties_equals_the_numpy_loop():
  target, _ = _models()
  prompts, lengths = _padded_prompts()
  out = generate(target, prompts, lengths, _greedy_params(), None, max_new_tokens=MAX_NEW, all_greedy=True)
  want, _, _, margin = _reference()
  assert margin > 1e-3, f"a near-tie ({margin}) would make float32 and float64 argmaxes differ legitimately"
  np.testing.assert_array_equal(np.asarray(out.tokens), want)
  # Each rule matters for these rows: a loop that broke it would fail the check above.
  for label, context in WRONG_CONTEXTS.items():
    wrong, *_ = _reference_greedy(target, prompts, lengths, context)
    assert not np.array_equal(wrong, want), f"{label}: gives the same tokens, so the check cannot see it"
  # With EOS: the same tokens, cut after the first EOS.
  eos, cut = _eos_and_tokens()
  out = generate(
    target, prompts, lengths, _greedy_params(), None, max_new_tokens=MAX_NEW, eos_token_id=eos, all_greedy=True
  )
  np.testing.assert_array_equal(np.asarray(out.tokens), cut)
  assert np.sum(cut < 0) >= 10  # rows did end early
  # And the options do something: without them every row changes.
  plain = generate(
    target, prompts, lengths, SamplingParams.greedy(len(LENGTHS)), None, max_new_tokens=MAX_NEW, all_greedy=True
  )
  assert np.all(np.any(np.asarray(plain.tokens) != want, axis=1))


@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_greedy_speculative_with_penalties_equals_generate(drafter, monkeypatch):
  target, draft = _models()
  if drafter == "lookup":
    draft = PromptLookupDrafter(ngram_size=(3, 1))
  prompts, lengths = _padded_prompts()
  params = _greedy_params()

  eos, want = _eos_and_tokens()  # == generate's tokens (previous test)

  def run():
    return speculative_generate(
      target,
      draft,
      prompts,
      lengths,
      params,
      None,
      max_new_tokens=MAX_NEW,
      num_speculative_tokens=K,
      eos_token_id=eos,
      all_greedy=True,
    )

  out = run()
  np.testing.assert_array_equal(np.asarray(out.tokens), want)
  check_output(out, MAX_NEW, K, eos=eos)
  # Drafts were accepted, so later positions of those rounds had drafts in their context.
  assert int(out.stats.accepted_per_position[1]) >= 3, out.stats.accepted_per_position
  # A verifier that leaves the round's drafts out of the context parts from generate.
  wrong = _with_planted_verifier(monkeypatch, run)
  assert not np.array_equal(np.asarray(wrong.tokens), want), "the planted verifier went unnoticed"


# "raw" is slow-marked (CI budget): the mixed-batch test below checks it, greedy rows included.
@pytest.mark.parametrize("mode", [pytest.param("raw", marks=pytest.mark.slow), "processed"])
def test_greedy_loop_logprobs_with_penalties(mode):
  """Both loops give the same log-probabilities for the same tokens: the target's, raw or after steps 1-3."""
  target, draft = _models()
  prompts, lengths = _padded_prompts()
  params = _greedy_params()
  common = dict(max_new_tokens=MAX_NEW, all_greedy=True, logprobs=mode)
  outs = [
    generate(target, prompts, lengths, params, None, **common),
    speculative_generate(target, draft, prompts, lengths, params, None, num_speculative_tokens=K, **common),
    speculative_generate(
      target, PromptLookupDrafter((3, 1)), prompts, lengths, params, None, num_speculative_tokens=K, **common
    ),
  ]
  tokens, raw, processed, _ = _reference()
  want = raw if mode == "raw" else processed
  # The two modes differ here by more than the tolerance, so a swapped mode fails.
  assert np.abs(raw - processed).max() > 0.1
  for out in outs:
    np.testing.assert_array_equal(np.asarray(out.tokens), tokens)
    assert out.logprobs.shape == (len(LENGTHS), MAX_NEW) and out.logprobs.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(outs[0].logprobs), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.logprobs), want, rtol=1e-4, atol=1e-4)


# A mixed batch: rows 1 and 4 greedy, the others random with their filters.
SAMPLED_ROWS = [
  dict(r, temperature=t, top_k=k) for r, t, k in zip(GREEDY_ROWS, [1.0, 0.0, 1.2, 0.7, 0.0], [0, 0, 8, 5, 0])
]


@pytest.mark.parametrize("mode", [pytest.param("raw", marks=pytest.mark.slow), "processed"])  # CI: "processed"
def test_mixed_batch_loop_logprobs_with_penalties_are_the_targets(mode):
  """Each loop's log-probabilities of its own tokens are the target's at their position, raw or processed
  (steps 1-4 with the prompt and every earlier token, drafts of the same round included, in the context);
  the greedy rows of the mixed batch give the greedy reference's tokens."""
  target, draft = _models()
  prompts, lengths = _padded_prompts()
  params = dataclasses.replace(rows_params(SAMPLED_ROWS), min_p=None)
  key = jax.random.key(3)
  outs = [
    generate(target, prompts, lengths, params, key, max_new_tokens=MAX_NEW, logprobs=mode),
    speculative_generate(
      target, draft, prompts, lengths, params, key, max_new_tokens=MAX_NEW, num_speculative_tokens=K, logprobs=mode
    ),
  ]
  assert int(outs[1].stats.accepted_per_position[1]) >= 3  # tokens emitted after accepted drafts of their round
  greedy = np.array([row["temperature"] == 0.0 for row in SAMPLED_ROWS])
  for out in outs:
    tokens = np.asarray(out.tokens)
    np.testing.assert_array_equal(tokens[greedy], _reference()[0][greedy])
    want = np.zeros(tokens.shape)
    for b, row in enumerate(SAMPLED_ROWS):
      prompt = list(np.asarray(prompts)[b, : int(lengths[b])])
      seq = np.zeros(P + MAX_NEW, np.int32)  # one shape for every row: one compile; the tail is never attended to
      seq[: len(prompt) + MAX_NEW] = prompt + list(tokens[b])
      logits = np.asarray(_full_forward(target, jnp.asarray(seq)), np.float64)
      options = {name: row[name] for name in _OPTION_NAMES + ("temperature", "top_k") if name in row}
      for j in range(MAX_NEW):
        x = logits[len(prompt) - 1 + j]
        context = dict(prompt_tokens=prompt, generated_tokens=list(tokens[b, :j]))
        if mode == "raw":
          lp = ref.log_softmax(x)
        elif greedy[b]:  # a greedy row: log_softmax after steps 1-3
          lp = ref.log_softmax(ref.penalized_logits(x, **context, **{n: row[n] for n in _OPTION_NAMES if n in row}))
        else:
          lp = ref.processed_log_probs(x, **context, **options)
        want[b, j] = lp[tokens[b, j]]
    np.testing.assert_allclose(np.asarray(out.logprobs), want, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------
# Sampled: lossless with penalties (chi-square on the first 3 tokens)
# ----------------------------------------------------------------------------

# x1 = 3 is likely (the model favours it, and the bias), and 3 opens the prompt,
# so prompt lookup often drafts 5, 2 after it: drafts that the round's state
# does not count yet, which is what the planted verifier gets wrong.
PROMPT = [3, 5, 2, 7]
SAMPLED_OPTIONS = dict(repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=1.0, bias={3: 0.8})


def _exact_joint_with_penalties(target, options=SAMPLED_OPTIONS):
  """p(x1, x2, x3 | PROMPT) [V^3] under T=1 and `options`, from full uncached forwards (float64 steps).

  x1's context is the prompt; x2's adds x1; x3's adds x1 and x2 (in the
  speculative loop, x2 is a draft of the round that emits x3).
  """
  v = SMALL_V
  logits = continuation_logits(target, PROMPT).astype(np.float64).reshape(v, v, 3, v)  # [x1, x2, position, V]

  def law(row, generated):
    return np.exp(
      ref.processed_log_probs(row, temperature=1.0, prompt_tokens=PROMPT, generated_tokens=generated, **options)
    )

  joint = np.zeros((v, v, v))
  p1 = law(logits[0, 0, 0], [])
  for a in range(v):
    p2 = law(logits[a, 0, 1], [a])  # any x2 serves: position P does not see it
    for c in range(v):
      joint[a, c] = p1[a] * p2[c] * law(logits[a, c, 2], [a, c])
  return joint.reshape(-1)


# Slow-marked (CI budget): CI checks penalties' exact law in the sampler (tests/sampling/test_options.py) and the
# loop's penalised greedy and logprob rows here; the loop's sampled law with penalties needs `-m slow`.
@pytest.mark.slow
@pytest.mark.parametrize("drafter, verification", [("model", "token"), ("lookup", "token"), ("model", "block")])
def test_sampled_speculative_with_penalties_is_lossless(drafter, verification, monkeypatch):
  """The first 3 tokens of N_ROWS rows (own keys) follow the exact joint.

  alpha = 1e-3, sparse bins pooled; 20,000 rows detect every total-variation
  shift >= ~0.03 at 80% power (`assert_first_tokens_follow` checks the power).
  The first two tokens cannot tell whether a round's drafts are counted (x2 is
  position 0 of the first round), so the check reaches x3. The planted verifier
  that forgets the drafts must fail it.
  """
  target = TinyLM.create(10, SMALL_V, logit_scale=1.5)
  draft = TinyLM.create(11, SMALL_V, logit_scale=1.5) if drafter == "model" else PromptLookupDrafter((2, 1))
  prompts = jnp.asarray(np.tile(PROMPT, (N_ROWS, 1)), jnp.int32)
  lengths = jnp.full((N_ROWS,), len(PROMPT), jnp.int32)
  params = dataclasses.replace(rows_params([dict(SAMPLED_OPTIONS, temperature=1.0)] * N_ROWS), min_p=None)
  joint = _exact_joint_with_penalties(target)
  np.testing.assert_allclose(joint.sum(), 1.0, rtol=1e-6)
  # The options move the law by far more than the test resolves.
  assert 0.5 * np.abs(joint - _exact_joint_with_penalties(target, {})).sum() > 0.1

  run = first_tokens_run(target, draft, prompts, lengths, params, 42, verification=verification)

  out = assert_first_tokens_follow(
    run,
    joint,
    monkeypatch,
    f"speculative_generate({drafter}, {verification}), penalties",
    planted=(chain_round, "rejection_sample", _drafts_forgotten),
  )
  check_output(out, 3, 2)
  # x2 was an accepted draft in many rows: those rows' x3 came from a position with a draft in its context.
  assert int(out.stats.accepted_per_position[0]) >= 500, out.stats.accepted_per_position


def test_sampled_generate_with_penalties_follows_the_joint():
  """`generate`'s first 3 tokens against the same joint (alpha = 1e-3, 20,000 rows)."""
  target = TinyLM.create(10, SMALL_V, logit_scale=1.5)
  prompts = jnp.asarray(np.tile(PROMPT, (N_ROWS, 1)), jnp.int32)
  lengths = jnp.full((N_ROWS,), len(PROMPT), jnp.int32)
  params = dataclasses.replace(rows_params([dict(SAMPLED_OPTIONS, temperature=1.0)] * N_ROWS), min_p=None)
  out = generate(target, prompts, lengths, params, jax.random.key(7), max_new_tokens=3)
  joint = _exact_joint_with_penalties(target)
  weights = np.array([SMALL_V**2, SMALL_V, 1])
  assert_gof(chisquare_gof(np.asarray(out.tokens) @ weights, joint, label="generate, penalties"))
  # The same samples reject the law without the options (a loop that dropped them).
  assert chisquare_gof(np.asarray(out.tokens) @ weights, _exact_joint_with_penalties(target, {})).pvalue < ALPHA


def test_loops_reject_logit_bias_ids_outside_the_vocabulary():
  # Inside the loop's jit an id >= V would be dropped silently; the wrappers check it first.
  target = TinyLM.create(0, SMALL_V)
  prompts, lengths = make_prompts(0, SMALL_V, [7, 3], 7)
  bad = SamplingParams.create([0.0, 0.0], logit_bias={SMALL_V + 5: 5.0})
  with pytest.raises(ValueError, match="generate: logit_bias holds token ids >= the vocabulary size"):
    generate(target, prompts, lengths, bad, None, max_new_tokens=3, all_greedy=True)
  with pytest.raises(ValueError, match="speculative_generate: logit_bias holds token ids >= the vocabulary size"):
    speculative_generate(
      target, target, prompts, lengths, bad, None, max_new_tokens=3, num_speculative_tokens=2, all_greedy=True
    )
  ok = SamplingParams.create([0.0, 0.0], logit_bias={SMALL_V - 1: 50.0})  # the last id is in range: accepted
  out = generate(target, prompts, lengths, ok, None, max_new_tokens=3, all_greedy=True)
  assert np.all(np.asarray(out.tokens) == SMALL_V - 1)  # and a large bias on it decides every token
