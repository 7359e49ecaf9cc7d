"""Tests of the loops' grammar (`generate(..., grammar=)`, `speculative_generate(..., grammar=)`, loop/constraint.py).

The grammar is `TableGrammar` (tests/loop/grammar_fixtures.py), a DFA from a dense table, so these tests do not
depend on `specdec_jax.grammar`. The fast tests share a few compiled programs: one batch mixes greedy and random
rows, so one call per loop checks both that every row follows the grammar and that greedy rows of every draft
kind equal `generate`'s.
"""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax.drafts.lookup import PromptLookupDrafter
from specdec_jax.loop import chain_round, constraint, decoding, draft_kinds
from specdec_jax.loop.decoding import generate, speculative_generate
from specdec_jax.loop.forced import speculative_generate_forced
from specdec_jax.sampling.params import SamplingParams
from specdec_jax.sampling.sample import sample_tokens
from tests.loop.grammar_fixtures import TableGrammar, finite_grammar, host_walk, literal_grammar, random_grammar
from tests.support.lossless import continuation_logits
from tests.support.stats import ALPHA, assert_gof, chisquare_gof, detectable_deviation, reference_probs
from tests.support.tiny_lm import TinyLM, make_prompts

ROOT = pathlib.Path(__file__).resolve().parents[2]
V, P, MAX_NEW, K = 24, 6, 10, 3
EOS = 3
LENGTHS = [6, 3, 1, 5, 2, 6, 4, 1]
TEMPERATURES = [0.0, 1.0, 0.0, 0.8, 1.0, 0.0, 1.3, 0.9]  # greedy rows 0, 2, 5 beside random ones


@pytest.fixture(scope="module")
def case():
  """Models, prompts, a grammar whose EOS ends rows, and a finite grammar (5 tokens, then nothing: no EOS)."""
  target, draft = TinyLM.create(0, V), TinyLM.create(1, V)
  prompts, lengths = make_prompts(0, V, LENGTHS, P)
  params = SamplingParams.create(jnp.asarray(TEMPERATURES, jnp.float32))
  return target, draft, prompts, lengths, params


def _run(loop, target, draft, prompts, lengths, params, grammar, eos, key=0, **kw):
  common = dict(max_new_tokens=MAX_NEW, eos_token_id=eos, grammar=grammar, **kw)
  k = None if kw.get("all_greedy") else jax.random.key(key)
  if loop == "generate":
    return generate(target, prompts, lengths, params, k, **common)
  drafter = PromptLookupDrafter((2, 1)) if loop == "lookup" else draft
  return speculative_generate(target, drafter, prompts, lengths, params, k, num_speculative_tokens=K, **common)


def _assert_follows(grammar, out, eos, finite_length=None):
  """Every row is a prefix the grammar allows, EOS only where it accepts; rows end at EOS, at the limit, or
  where the grammar allows nothing more (a finite grammar's full length)."""
  eos_ids = () if eos is None else (eos,)
  tokens, lens = np.asarray(out.tokens), np.asarray(out.lengths)
  for row, n in zip(tokens, lens):
    ok, _ = host_walk(grammar, list(row[:n]), eos_ids)
    assert ok, f"row {row[:n]} leaves the grammar"
    assert np.all(row[n:] == -1)
    ended = n == MAX_NEW or (n > 0 and row[n - 1] in eos_ids) or n == finite_length
    assert ended, f"row {row[:n]} stopped early"
  np.testing.assert_array_equal(lens, out.stats.accepted + out.stats.target_calls)


# ----------------------------------------------------------------------------
# Every row follows the grammar; greedy rows of every draft kind equal generate's
# ----------------------------------------------------------------------------


def _masked_log_softmax(logits, allowed, temperature):
  x = np.where(allowed, np.asarray(logits, np.float64) / temperature, -np.inf)
  top = x.max(-1, keepdims=True)
  return x - top - np.log(np.sum(np.exp(x - top), -1, keepdims=True))


@pytest.mark.parametrize("which", ["eos", pytest.param("finite", marks=pytest.mark.slow)])
def test_rows_follow_the_grammar_and_greedy_rows_equal_generate(case, which):
  """Random and greedy rows (one batch, each row its own key) of `generate` and of `speculative_generate` with
  prompt lookup and a draft model: every row follows the grammar; greedy rows are the same tokens everywhere;
  `generate`'s "processed" log-probability of the first token is under the target's law over the allowed set.
  "finite": no EOS id, a grammar of exactly 5 tokens: every row ends after 5 (the grammar allows nothing more)."""
  target, draft, prompts, lengths, params = case
  grammar, eos, finite = (
    (random_grammar(0, V, eos=[EOS]), EOS, None)
    if which == "eos"
    else (finite_grammar(V, 5, [1, 5, 7, 9, 20]), None, 5)
  )
  outs = {"generate": _run("generate", target, draft, prompts, lengths, params, grammar, eos, logprobs="processed")}
  outs.update({loop: _run(loop, target, draft, prompts, lengths, params, grammar, eos) for loop in ("lookup", "model")})
  greedy = np.asarray(TEMPERATURES) == 0.0
  for loop, out in outs.items():
    _assert_follows(grammar, out, eos, finite)
    np.testing.assert_array_equal(np.asarray(out.tokens)[greedy], np.asarray(outs["generate"].tokens)[greedy], loop)
  if which == "finite":
    assert np.all(np.asarray(outs["model"].lengths) == 5)
  assert int(np.sum(outs["model"].stats.accepted)) > 0
  # The first token's logits: the prefill's at P_b - 1; state 0 allows its table's tokens (and never accepts).
  b = len(LENGTHS)
  logits, _ = target(jnp.maximum(prompts, 0), jnp.broadcast_to(jnp.arange(P), prompts.shape), target.init_cache(b, P))
  first = np.asarray(logits)[np.arange(b), np.asarray(lengths) - 1]
  allowed = np.asarray(grammar.next_table)[0] >= 0
  t = np.where(greedy, 1.0, TEMPERATURES)[:, None]  # greedy rows: log_softmax of the masked logits
  expected = _masked_log_softmax(first, allowed[None, :], t)[np.arange(b), np.asarray(outs["generate"].tokens)[:, 0]]
  np.testing.assert_allclose(np.asarray(outs["generate"].logprobs)[:, 0], expected, rtol=1e-4, atol=1e-5)


def test_all_greedy_speculative_equals_generate_and_rows_end_by_the_grammar(case):
  """all_greedy=True (float32), no EOS id, a grammar of exactly 5 tokens: the draft model's masked greedy drafts,
  verified under the masks, give generate's tokens, and every row ends after 5 tokens (nothing more allowed).
  A grammar whose initial state allows nothing (and no EOS) emits no token."""
  target, draft, prompts, lengths, _ = case
  grammar, params = finite_grammar(V, 5, [1, 5, 7, 9, 20]), SamplingParams.greedy(len(LENGTHS))
  plain = _run("generate", target, draft, prompts, lengths, params, grammar, None, all_greedy=True)
  spec = _run("model", target, draft, prompts, lengths, params, grammar, None, all_greedy=True)
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  _assert_follows(grammar, spec, None, finite_length=5)
  assert np.all(np.asarray(spec.lengths) == 5)
  # The same tables from their last state (accepting, allows nothing): the same program, no token.
  empty = TableGrammar(grammar.next_table, grammar.accepting, vocab_size=V, start=jnp.int32(5))
  out = _run("generate", target, draft, prompts, lengths, params, empty, None, all_greedy=True)
  assert np.all(np.asarray(out.lengths) == 0) and np.all(np.asarray(out.tokens) == -1)
  assert np.all(np.asarray(out.stats.target_calls) == 0)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("loop", ["generate", "lookup", "model"])
def test_rows_follow_the_grammar_over_seeds(case, loop, seed):
  target, draft, prompts, lengths, params = case
  grammar = random_grammar(seed, V, num_states=6, density=0.3, eos=[EOS])
  _assert_follows(grammar, _run(loop, target, draft, prompts, lengths, params, grammar, EOS, key=seed), EOS)


@pytest.mark.slow  # ~10 s: three compiles of the tiny Transformer and its EAGLE drafter
def test_eagle_rows_follow_the_grammar_and_greedy_equals_generate():
  from flax import nnx

  from specdec_jax.models import EagleDrafter, Transformer, TransformerConfig

  target = Transformer(TransformerConfig.tiny(V, feature_layers=(0, 1)), rngs=nnx.Rngs(0))
  eagle = EagleDrafter.for_target(target, rngs=nnx.Rngs(2))
  prompts, lengths = make_prompts(0, V, LENGTHS, P)
  grammar, greedy = random_grammar(4, V, eos=[EOS]), SamplingParams.greedy(len(LENGTHS))
  plain = _run("generate", target, None, prompts, lengths, greedy, grammar, EOS, all_greedy=True)
  spec = _run("model", target, eagle, prompts, lengths, greedy, grammar, EOS, all_greedy=True)
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  params = SamplingParams.create(jnp.asarray(TEMPERATURES, jnp.float32))
  out = _run("model", target, eagle, prompts, lengths, params, grammar, EOS, key=3, logprobs="processed")
  _assert_follows(grammar, out, EOS)
  assert np.all(np.isfinite(np.asarray(out.logprobs)))


# ----------------------------------------------------------------------------
# Prompt lookup: the sole token of a single position in place of the draft
# ----------------------------------------------------------------------------


def test_walk_sole_puts_sole_tokens_in_place_of_drafts():
  """Hand-made states: the drafts at single positions are replaced and the walk goes on from the replacement;
  others are kept (a disallowed draft too: the verifier rejects it). State 5 accepts and its mask holds one
  token: with an EOS id it allows two (not single), without one it is single."""
  v = 40  # two words: token 33 sits in word 1
  table = np.full((7, v), -1)
  table[0, [1, 2]] = 1  # a free choice
  table[1, 33] = 2  # single: 33 (word 1, bit 1)
  table[2, 31] = 3  # single: 31 (bit 31 of word 0: the sign bit)
  table[3, [4, 6]] = 5
  table[5, 7] = 6  # accepting, one mask token
  acc = np.zeros(7, bool)
  acc[5] = True
  grammar = TableGrammar.create(table, acc)
  with_eos, without = constraint.Constraint(grammar, (EOS,)), constraint.Constraint(grammar, ())
  states = jnp.asarray([0, 1, 5, 5, 6], jnp.int32)
  drafts = jnp.asarray([[2, 9, 9], [0, 9, 4], [9, 9, 9], [EOS, 9, 9], [9, 9, 9]], jnp.int32)

  @jax.jit  # one program: op by op it takes a second
  def run(states, drafts):
    tokens, walk, words = with_eos.walk_sole(states, drafts)
    masks = (with_eos.sampler_masks(walk, words)[0], with_eos.sampler_masks(walk)[0])
    every = constraint.sole_token(with_eos.allowed(jnp.arange(-1, 7, dtype=jnp.int32)))
    return tokens, walk, words, with_eos.allowed(walk), masks, without.walk_sole(states, drafts)[:2], every

  (tokens, walk, words, allowed, masks, (tokens_no_eos, walk_no_eos), (sole, single)) = run(states, drafts)
  np.testing.assert_array_equal(tokens, [[2, 33, 31], [33, 31, 4], [9, 9, 9], [EOS, 9, 9], [9, 9, 9]])
  np.testing.assert_array_equal(walk, [[0, 1, 2, 3], [1, 2, 3, 5], [5, -1, -1, -1], [5, -1, -1, -1], [6] + [-1] * 3])
  np.testing.assert_array_equal(words, allowed)
  np.testing.assert_array_equal(*masks)
  np.testing.assert_array_equal(tokens_no_eos[2:4, 0], [7, 7])
  np.testing.assert_array_equal(walk_no_eos[2:4, :2], [[5, 6], [5, 6]])
  np.testing.assert_array_equal(single, [False, False, True, True, False, False, False, False])
  np.testing.assert_array_equal(sole[2:4], [33, 31])


def test_prompt_lookup_takes_sole_tokens_as_drafts(case, monkeypatch):
  """A grammar of a free choice, then a fixed literal of 3 tokens, repeated: greedy rows with prompt lookup equal
  `generate`'s, random rows follow the grammar, and more drafts are accepted than with the replacement
  disabled (the round then verifies the lookup's own drafts). Its tables have the shapes of the first test's
  grammar, so `generate` and the lookup program are that test's where both run in one process."""
  target, draft, prompts, lengths, params = case
  grammar = literal_grammar(V, [1, 5, 7, 9, 20], [11, 12, 13])
  plain = _run("generate", target, draft, prompts, lengths, params, grammar, EOS)
  sole = _run("lookup", target, draft, prompts, lengths, params, grammar, EOS)
  monkeypatch.setattr(draft_kinds.LookupDraft, "masks_drafts", True)  # the walk without replacements
  decoding._speculative_jit.clear_cache()
  try:
    own = _run("lookup", target, draft, prompts, lengths, params, grammar, EOS)
  finally:
    monkeypatch.undo()
    decoding._speculative_jit.clear_cache()
  greedy = np.asarray(TEMPERATURES) == 0.0
  for out in (sole, own):
    _assert_follows(grammar, out, EOS)
    np.testing.assert_array_equal(np.asarray(out.tokens)[greedy], np.asarray(plain.tokens)[greedy])
  accepted = [int(np.sum(out.stats.accepted)) for out in (sole, own)]
  print(
    f"accepted drafts {accepted}, mean accepted length {[float(o.stats.mean_accepted_length) for o in (sole, own)]}"
  )
  assert accepted[0] > accepted[1]


# ----------------------------------------------------------------------------
# Exactness: the first 3 tokens against the constrained target's joint law
# ----------------------------------------------------------------------------

SMALL_V, N_ROWS, TEMPERATURE, TOP_K = 8, 20000, 0.8, 5
PROMPT = np.array([1, 5, 2, 7])


def _stat_case():
  target, draft = TinyLM.create(10, SMALL_V, logit_scale=1.5), TinyLM.create(11, SMALL_V, logit_scale=1.5)
  # Each state allows about half the tokens; the masks differ from state to state.
  grammar = random_grammar(7, SMALL_V, num_states=3, density=0.5, accepting=())
  return target, draft, grammar


def constrained_joint(target, grammar, prompt, top_k=TOP_K, topk_first=False):
  """p(x1, x2, x3 | prompt) [V^3] of the target restricted to the grammar's allowed sets (float64 reference).

  topk_first: the planted order (top-k on the raw logits, then the mask), for the test's power."""
  v = SMALL_V
  logits = continuation_logits(target, prompt)  # [V*V, 3, V], rows x1-major
  table = np.asarray(grammar.next_table)
  x1, x2 = np.meshgrid(np.arange(v), np.arange(v), indexing="ij")
  s0 = np.full(v * v, int(grammar.start))
  s1 = table[s0, x1.reshape(-1)]
  s2 = np.where(s1 >= 0, table[np.maximum(s1, 0), x2.reshape(-1)], -1)
  allowed = (
    np.stack([table[np.maximum(s, 0)] >= 0 for s in (s0, s1, s2)], axis=1)
    & (np.stack([s0, s1, s2], axis=1) >= 0)[..., None]
  )
  allowed |= ~np.any(allowed, axis=-1, keepdims=True)  # unreachable paths: any law (their weight is 0)
  if topk_first:
    kth = np.sort(logits, axis=-1)[..., -top_k][..., None]
    logits = np.where(logits >= kth, logits, -np.inf)
    top_k = 0
  probs = reference_probs(np.where(allowed, logits, -np.inf), TEMPERATURE, top_k=top_k)
  p1 = probs[0, 0]
  p2 = probs[:, 1].reshape(v, v, v)[:, 0]
  p3 = probs[:, 2].reshape(v, v, v)
  return (p1[:, None, None] * p2[:, :, None] * p3).reshape(-1)


def _first_tokens(loop, target, draft, grammar, key=42, prompt=PROMPT):
  prompts = jnp.asarray(np.tile(prompt, (N_ROWS, 1)), jnp.int32)
  lengths = jnp.full((N_ROWS,), len(prompt), jnp.int32)
  params = SamplingParams.create(jnp.full((N_ROWS,), TEMPERATURE), top_k=TOP_K)
  drafter = PromptLookupDrafter(1) if loop == "lookup" else draft
  out = speculative_generate(
    target,
    drafter,
    prompts,
    lengths,
    params,
    jax.random.key(key),
    max_new_tokens=3,
    num_speculative_tokens=2,
    grammar=grammar,
  )
  tokens = np.asarray(out.tokens)
  assert np.all(tokens >= 0)  # every row emits its 3 tokens
  return tokens @ np.array([SMALL_V**2, SMALL_V, 1]), out


def _pvalue(samples, joint):
  return chisquare_gof(samples, joint).pvalue


@pytest.fixture(scope="module")
def stat_case():
  target, draft, grammar = _stat_case()
  return target, draft, grammar, constrained_joint(target, grammar, PROMPT)


def _planted(monkeypatch, loop, stat_case, *patches):
  """The p-value of a run with `patches` ((object, name, value)) in place; the compiled program is dropped on both
  sides so that the planted bug is traced in and not kept."""
  target, draft, grammar, joint = stat_case
  for p in patches:
    monkeypatch.setattr(*p)
  decoding._speculative_jit.clear_cache()
  try:
    samples, _ = _first_tokens(loop, target, draft, grammar)
  finally:
    monkeypatch.undo()
    decoding._speculative_jit.clear_cache()
  return _pvalue(samples, joint)


def test_sampled_speculative_with_a_draft_model_follows_the_constrained_law(monkeypatch, stat_case):
  """The first 3 tokens of N = 20000 rows (each its own key, T = 0.8, top-k 5, the drafts masked and their masked
  law given to the verifier) against the exact constrained joint: chi-square, sparse bins pooled, alpha = 1e-3,
  fixed seed; it detects (power 0.8) every total-variation shift >= ~0.03. Planted (a): drafts drawn from the
  masked draft law but the verifier given the unmasked q, must fail it."""
  target, draft, grammar, joint = stat_case
  samples, out = _first_tokens("model", target, draft, grammar)
  result = chisquare_gof(samples, joint, label="draft model, masked drafts")
  assert_gof(result)
  assert detectable_deviation(N_ROWS, result.num_bins)[1] < 0.04
  assert 0.05 < float(out.stats.acceptance_rate) < 0.95

  def unmasked_q(logits, params, key, *, token_bitmask=None, **kw):  # draws masked, reports the unmasked law
    token, _ = sample_tokens(logits, params, key, token_bitmask=token_bitmask, **kw)
    return token, sample_tokens(logits, params, key, **kw)[1]

  assert _planted(monkeypatch, "model", stat_case, (draft_kinds, "sample_tokens", unmasked_q)) < ALPHA


@pytest.mark.slow
def test_planted_unmasked_draws_with_a_masked_q_fail(monkeypatch, stat_case):
  """The converse of (a): drafts drawn from the unmasked law, q reported masked."""

  def masked_q(logits, params, key, *, token_bitmask=None, **kw):
    token, _ = sample_tokens(logits, params, key, **kw)
    return token, sample_tokens(logits, params, key, token_bitmask=token_bitmask, **kw)[1]

  assert _planted(monkeypatch, "model", stat_case, (draft_kinds, "sample_tokens", masked_q)) < ALPHA


# A prompt whose lookup drafts the grammar allows and the target accepts a quarter of the time (PROMPT's are
# all refused: only the rejection path would be tested).
LOOKUP_PROMPT = np.array([0, 4, 0, 4])


def test_sampled_speculative_with_prompt_lookup_follows_the_constrained_law(monkeypatch, stat_case):
  """As above, with prompt lookup (unmasked drafts without probabilities), on a prompt where its drafts are
  accepted with probability p(d) under the mask as well as rejected."""
  target, draft, grammar, _ = stat_case
  joint = constrained_joint(target, grammar, LOOKUP_PROMPT)
  samples, out = _first_tokens("lookup", target, draft, grammar, prompt=LOOKUP_PROMPT)
  assert 0.05 < float(out.stats.acceptance_rate) < 0.95  # both branches of the verifier are exercised
  assert_gof(chisquare_gof(samples, joint, label="prompt lookup"))


def _sole_grammar():
  """3 states over SMALL_V (the shapes of `_stat_case`'s grammar: the same program): state 1 allows token 4 only,
  reached from state 0 by 1 or 5, so the first 3 tokens meet single positions on many paths."""
  table = np.full((3, SMALL_V), -1)
  table[0, [1, 5]], table[0, 2] = 1, 2
  table[1, 4] = 2
  table[2, [0, 3, 6, 7]] = [0, 1, 0, 2]
  return TableGrammar.create(table, np.zeros(3, bool))


@pytest.fixture(scope="module")
def sole_case(stat_case):
  target, draft, _, _ = stat_case
  grammar = _sole_grammar()
  return target, draft, grammar, constrained_joint(target, grammar, PROMPT)


def test_sampled_prompt_lookup_with_sole_tokens_follows_the_constrained_law(sole_case):
  """As above, on a grammar with single positions, whose sole tokens replace the lookup's drafts."""
  target, draft, grammar, joint = sole_case
  samples, out = _first_tokens("lookup", target, draft, grammar)
  assert_gof(chisquare_gof(samples, joint, label="prompt lookup, sole tokens"))
  assert int(np.sum(out.stats.accepted)) > N_ROWS // 2  # the sole tokens are drafted and accepted


@pytest.mark.slow
def test_planted_sole_token_not_walked_fails(monkeypatch, sole_case):
  """Planted (d): the sole tokens replace the drafts, but the walk (and so the masks) follows the lookup's own
  drafts, must fail: here it ends rows early (an accepted sole token's state is the dead one of the draft it
  replaced), which `_first_tokens` refuses, or else the chi-square rejects."""
  real = constraint.Constraint.walk_sole

  def walk_own(self, states, tokens):
    walk = self.walk(states, tokens)
    return real(self, states, tokens)[0], walk, self.allowed(walk)

  try:
    pvalue = _planted(monkeypatch, "lookup", sole_case, (constraint.Constraint, "walk_sole", walk_own))
  except AssertionError:  # rows shorter than 3 tokens
    return
  assert pvalue < ALPHA


@pytest.mark.slow
def test_planted_state_not_walked_along_the_drafts_fails(monkeypatch, stat_case):
  """Planted (b): the verifier's masks all taken from s_0 (the state not advanced along the drafts; the draft
  model's drafts still masked right), must fail."""

  def no_walk(self, states, tokens):
    return jnp.broadcast_to(states[:, None], (states.shape[0], tokens.shape[1] + 1))

  assert _planted(monkeypatch, "model", stat_case, (constraint.Constraint, "walk", no_walk)) < ALPHA


@pytest.mark.slow
def test_planted_top_k_before_the_mask_fails(monkeypatch, stat_case):
  """Planted (c): the verifier filters top-k on the raw logits, then masks. The constrained law differs (shown
  on the references), and the check rejects it."""
  target, _, grammar, joint = stat_case
  wrong = constrained_joint(target, grammar, PROMPT, topk_first=True)
  assert 0.5 * np.abs(wrong - joint).sum() > 0.05
  real = chain_round.rejection_sample

  def topk_first(draft_token_ids, target_logits, params, *args, **kw):
    kth = jnp.sort(target_logits, axis=-1)[..., -TOP_K][..., None]
    return real(draft_token_ids, jnp.where(target_logits >= kth, target_logits, -jnp.inf), params, *args, **kw)

  assert _planted(monkeypatch, "lookup", stat_case, (chain_round, "rejection_sample", topk_first)) < ALPHA


# ----------------------------------------------------------------------------
# Refusals, and the program without a grammar
# ----------------------------------------------------------------------------


def test_refusals_name_grammar(case):
  target, draft, prompts, lengths, params = case
  key, common = jax.random.key(0), dict(max_new_tokens=4, num_speculative_tokens=2)
  grammar = random_grammar(0, V, eos=[EOS])
  with pytest.raises(ValueError, match=r"grammar with draft_tree=\(2, 1\) is not supported yet"):
    speculative_generate(target, draft, prompts, lengths, params, key, draft_tree=(2, 1), grammar=grammar, **common)
  with pytest.raises(ValueError, match="grammar.vocab_size=16 must equal the target's vocabulary size V=24"):
    generate(target, prompts, lengths, params, key, max_new_tokens=4, grammar=random_grammar(0, 16))
  with pytest.raises(ValueError, match="grammar.vocab_size=16 must equal"):
    speculative_generate(target, draft, prompts, lengths, params, key, grammar=random_grammar(0, 16), **common)
  with pytest.raises(ValueError, match="grammar must be a token automaton"):
    generate(target, prompts, lengths, params, key, max_new_tokens=4, grammar=object())
  with pytest.raises(ValueError, match="grammar is not supported by the forced-acceptance"):
    speculative_generate_forced(
      target, draft, prompts, lengths, params, key, forced_accepts=1, grammar=grammar, **common
    )


def test_no_grammar_traces_no_automaton_op(case, monkeypatch):
  """grammar=None builds no `Constraint`, the one object through which the loops read a grammar, so no
  automaton op and no mask enters the program of `generate` or of `speculative_generate` with either draft kind."""
  target, draft, prompts, lengths, params = case

  def refuse(*_, **__):
    raise AssertionError("a Constraint was built for grammar=None")

  monkeypatch.setattr(decoding, "Constraint", refuse)
  kw = dict(max_new_tokens=3, eos_token_id=EOS)
  key = jax.random.key(0)
  jax.eval_shape(lambda: generate(target, prompts, lengths, params, key, **kw))
  for drafter in (draft, PromptLookupDrafter(2)):
    jax.eval_shape(
      lambda d=drafter: speculative_generate(target, d, prompts, lengths, params, key, num_speculative_tokens=2, **kw)
    )


# ----------------------------------------------------------------------------
# A mesh that splits the rows only
# ----------------------------------------------------------------------------

_MESH_CHECK = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from specdec_jax.loop.decoding import generate
from specdec_jax.mesh import make_mesh
from specdec_jax.sampling.params import SamplingParams
from tests.loop.grammar_fixtures import random_grammar
from tests.support.tiny_lm import TinyLM, make_prompts

c = json.load(sys.stdin)
assert len(jax.devices()) == 2
target = TinyLM.create(0, c["V"])
prompts, lengths = make_prompts(0, c["V"], c["LENGTHS"], c["P"])
params = SamplingParams.create(jnp.asarray(c["TEMPERATURES"], jnp.float32))
with jax.set_mesh(make_mesh(2, 1)):
  out = generate(target, prompts, lengths, params, jax.random.key(0), max_new_tokens=c["MAX_NEW"],
                 eos_token_id=c["EOS"], grammar=random_grammar(0, c["V"], eos=[c["EOS"]]), logprobs="processed")
np.testing.assert_array_equal(out.tokens, np.asarray(c["tokens"]))
np.testing.assert_allclose(out.logprobs, np.asarray(c["logprobs"]), rtol=1e-5, atol=1e-6)

# The vocabulary split over "model" (1x2)
from specdec_jax.drafts.lookup import PromptLookupDrafter
from specdec_jax.loop.decoding import speculative_generate

V, EOS = 64, 3  # V/2 = 32 tokens a device: the mask's words split with the vocabulary
target = TinyLM.create(0, V)
prompts, lengths = make_prompts(0, V, [6, 3, 1, 5], 6)
params = SamplingParams.create(jnp.asarray([0.0, 1.0, 0.0, 0.8], jnp.float32))
run = lambda: speculative_generate(target, PromptLookupDrafter((2, 1)), prompts, lengths, params, jax.random.key(0),
                                   num_speculative_tokens=3, max_new_tokens=10, eos_token_id=EOS,
                                   grammar=random_grammar(0, V, eos=[EOS]))
one = run()
with jax.set_mesh(make_mesh(1, 2)):
  split = run()
np.testing.assert_array_equal(split.tokens, one.tokens)
print("OK")
"""


def test_rows_only_mesh_gives_one_devices_tokens(case):
  """Two CPU devices, the rows split over "data" (`_on_each_data_device`): the grammar rides replicated, each
  device decodes its rows; `generate`'s tokens and log-probabilities equal one device's (per-row keys). The
  one-device program is the first test's. Then the vocabulary split over "model" (1x2, V=64: the mask's words
  split too): prompt lookup's sole-token walk reduces each position's words, which must compile there (XLA's
  all-reduce has no bitwise OR: the walk sums the words) and give one device's tokens, sampled rows included. (`speculative_generate` passes its grammar the same way: both loops go
  through `_jit`'s `_on_each_data_device`, whose models include the grammar.)"""
  target, draft, prompts, lengths, params = case
  grammar = random_grammar(0, V, eos=[EOS])
  one = _run("generate", target, draft, prompts, lengths, params, grammar, EOS, logprobs="processed")
  config = dict(V=V, P=P, EOS=EOS, MAX_NEW=MAX_NEW, LENGTHS=LENGTHS, TEMPERATURES=TEMPERATURES)
  config.update(tokens=np.asarray(one.tokens).tolist(), logprobs=np.asarray(one.logprobs).tolist())
  env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2")
  res = subprocess.run(
    [sys.executable, "-c", _MESH_CHECK],
    input=json.dumps(config),
    capture_output=True,
    text=True,
    env=dict(env, JAX_PLATFORMS="cpu"),
    timeout=300,
    cwd=ROOT,
  )
  assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


def test_eos_only_where_the_state_accepts_even_if_an_automaton_allows_it_elsewhere():
  """The loop owns EOS: an automaton whose mask (against the protocol) holds an EOS id at a state that does not
  accept still may not end the row there; at an accepting state EOS is allowed whatever its mask says."""
  v, eos = 24, 3
  table = np.full((3, v), -1)
  table[0, [eos, 4]] = 1  # state 0 (not accepting) "allows" EOS
  table[1, [5, 6]] = 2
  table[2, 7] = 0  # state 2 accepts, and its mask lacks EOS
  grammar = TableGrammar.create(table, [False, False, True])
  allowed = np.asarray(constraint.Constraint(grammar, (eos,)).allowed(jnp.array([0, 1, 2, -1])))
  bits = (allowed[:, :, None] >> np.arange(32)) & 1
  ids = [set(np.flatnonzero(row.reshape(-1)[:v]).tolist()) for row in bits]
  assert ids == [{4}, {5, 6}, {7, eos}, set()]


def test_a_grammar_that_is_no_pytree_or_gives_wrong_shapes_is_refused_before_tracing(case):
  target, draft, prompts, lengths, params = case

  class Plain:  # the four methods, but an object jit cannot take apart
    vocab_size = V

    def initial_state(self):
      return jnp.int32(0)

    def mask(self, states):
      return jnp.zeros(states.shape + (-(-V // 32),), jnp.int32)

    def next_state(self, states, tokens):
      return states

    def accepts(self, states):
      return states == 0

  wide = random_grammar(0, V, eos=[EOS])
  wide_mask = TableGrammar.mask  # the right words, one too many of them
  with pytest.raises(ValueError, match=r"generate: grammar must be a JAX pytree"):
    generate(target, prompts, lengths, params, jax.random.key(0), max_new_tokens=2, grammar=Plain())
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(TableGrammar, "mask", lambda self, s: jnp.pad(wide_mask(self, s), [(0, 0)] * s.ndim + [(0, 1)]))
    with pytest.raises(ValueError, match=r"speculative_generate: grammar\.mask\(states \[1\]\) must give int32"):
      speculative_generate(
        target,
        draft,
        prompts,
        lengths,
        params,
        jax.random.key(0),
        max_new_tokens=2,
        num_speculative_tokens=2,
        grammar=wide,
      )


# ----------------------------------------------------------------------------
# Whole rows against the exact constrained law: every position, the bonus one, later rounds, EOS, rows the
# grammar ends
# ----------------------------------------------------------------------------

ROW_V, ROW_EOS, ROW_PROMPT, ROW_N = 6, 0, np.array([1, 5, 2, 4, 3]), 20000


def _row_grammar():
  """State 0 allows {1, 2, 3}; 1 accepts and allows {4, 5}; 2 accepts and allows nothing (the row must stop);
  3 allows 2 only (a single position)."""
  table = np.full((4, ROW_V), -1)
  table[0, [1, 2, 3]] = [1, 3, 0]
  table[1, [4, 5]] = [2, 0]
  table[3, 2] = 1
  return TableGrammar.create(table, [False, True, True, False])


def _row_law(target, grammar, eos, max_new):
  """{row tokens: probability} of the constrained target at T=1 by enumeration (float64)."""
  table, acc = np.asarray(grammar.next_table), np.asarray(grammar.accepting)
  law = {}

  def logits_after(prefix):
    seq = jnp.asarray(np.concatenate([ROW_PROMPT, np.array(prefix, int)])[None], jnp.int32)
    t = seq.shape[1]
    logits, _ = target(seq, jnp.arange(t)[None], target.init_cache(1, t))
    return np.asarray(logits[0, -1], np.float64)

  def walk(prefix, s, p):
    allowed = table[s] >= 0
    if eos is not None and acc[s]:
      allowed[eos] = True
    if len(prefix) == max_new or not allowed.any():
      law[prefix] = law.get(prefix, 0.0) + p
      return
    x = np.where(allowed, logits_after(prefix), -np.inf)
    q = np.exp(x - x.max())
    q /= q.sum()
    for t in np.flatnonzero(allowed).tolist():
      if t == eos:
        law[prefix + (t,)] = law.get(prefix + (t,), 0.0) + p * q[t]
      else:
        walk(prefix + (t,), int(table[s, t]), p * q[t])

  walk((), 0, 1.0)
  return law


def _whole_rows(eos, k, max_new, loop):
  """(rows outside the constrained law's support, the chi-square result, the acceptance rate) of one run."""
  target, draft = TinyLM.create(10, ROW_V, logit_scale=1.5), TinyLM.create(11, ROW_V, logit_scale=1.5)
  grammar = _row_grammar()
  law = _row_law(target, grammar, eos, max_new)
  outcomes = sorted(law)
  index = {o: i for i, o in enumerate(outcomes)}
  probs = np.array([law[o] for o in outcomes])
  _, tv = detectable_deviation(ROW_N, len(outcomes))
  assert tv < 0.1, f"too few rows to detect a total variation of 0.1 over {len(outcomes)} outcomes"
  prompts = jnp.asarray(np.tile(ROW_PROMPT, (ROW_N, 1)), jnp.int32)
  lengths = jnp.full((ROW_N,), len(ROW_PROMPT), jnp.int32)
  out = speculative_generate(
    target,
    draft if loop == "model" else PromptLookupDrafter(1),
    prompts,
    lengths,
    SamplingParams.create(jnp.ones((ROW_N,))),
    jax.random.key(2),
    max_new_tokens=max_new,
    num_speculative_tokens=k,
    eos_token_id=eos,
    grammar=grammar,
  )
  rows = [tuple(r[:n].tolist()) for r, n in zip(np.asarray(out.tokens), np.asarray(out.lengths))]
  outside = [r for r in rows if r not in index]
  inside = np.array([index[r] for r in rows if r in index])
  gof = chisquare_gof(inside, probs, label=f"{loop}, eos={eos}, K={k}, {max_new} tokens")
  return outside, gof, float(out.stats.acceptance_rate)


@pytest.mark.parametrize(
  "eos, k, max_new, loop",
  [
    (ROW_EOS, 2, 4, "model"),
    pytest.param(ROW_EOS, 2, 4, "lookup", marks=pytest.mark.slow),
    pytest.param(None, 3, 6, "model", marks=pytest.mark.slow),
    pytest.param(None, 3, 6, "lookup", marks=pytest.mark.slow),
    pytest.param(ROW_EOS, 3, 6, "lookup", marks=pytest.mark.slow),
  ],
)
def test_whole_rows_follow_the_constrained_law(eos, k, max_new, loop):
  """Sampled rows (T=1) of constrained `speculative_generate` (a draft model; prompt lookup in the slow set),
  whole rows (more than one round, the bonus position, EOS where accepting, rows the grammar ends) against the
  exact constrained law: chi-square at alpha=ALPHA over every row outcome; no row outside the law's support."""
  outside, gof, acceptance = _whole_rows(eos, k, max_new, loop)
  assert not outside, f"{len(outside)} rows outside the constrained law's support, e.g. {outside[:3]}"
  assert 0.02 < acceptance < 0.98  # drafts are both accepted and rejected
  assert_gof(gof)


@pytest.mark.slow
def test_planted_state_not_advanced_by_the_recovered_token_fails(monkeypatch):
  """The state after a round taken as the walk's s_n, not advanced by the recovered/bonus token: the whole-row
  test must reject it."""

  def wrong(self, walk, empty, emitted, num_accepted):
    n = num_accepted.astype(jnp.int32)[:, None]
    s_n = jnp.take_along_axis(walk, n, axis=1)
    j = jnp.arange(walk.shape[1], dtype=jnp.int32)[None, :]
    after = jnp.where(j < n, jnp.concatenate([walk[:, 1:], walk[:, -1:]], axis=1), s_n)
    ends = jnp.where(j < n, jnp.concatenate([empty[:, 1:], empty[:, -1:]], axis=1), self.ends(s_n[:, 0])[:, None])
    return after, ends

  monkeypatch.setattr(constraint.Constraint, "emitted_states", wrong)
  decoding._speculative_jit.clear_cache()
  try:
    outside, gof, _ = _whole_rows(ROW_EOS, 2, 4, "model")
  finally:
    monkeypatch.undo()
    decoding._speculative_jit.clear_cache()
  assert outside or gof.pvalue < ALPHA


def test_grammar_checked_once_per_structure(case):
  """`check_grammar` traces a grammar's methods once per structure (methods, tree, leaf shapes): a grammar
  passed call after call costs no host tracing, and a grammar of another shape or code is checked anew."""
  traced = []

  @jax.tree_util.register_dataclass
  @dataclasses.dataclass(frozen=True)
  class Counted(TableGrammar):
    def mask(self, states):
      traced.append(states.shape)
      return super().mask(states)

  base = random_grammar(0, V, eos=[EOS])
  grammar = Counted(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})
  for _ in range(3):
    constraint.check_grammar("generate", grammar, V)
  assert traced == [(1,)]
  other = random_grammar(1, V, num_states=7, eos=[EOS])  # more states: other leaf shapes
  wider = Counted(**{f.name: getattr(other, f.name) for f in dataclasses.fields(other)})
  constraint.check_grammar("generate", wider, V)
  assert traced == [(1,), (1,)]
