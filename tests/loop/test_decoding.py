"""Tests of specdec_jax/loop/decoding.py (generate, speculative_generate) and drafts/lookup.py.

Three kinds of model go through the loops, one per way a model rides through jit:
  - `TinyLM`: a one-layer attention LM written here, a registered pytree with its
    own cache layout ([2, B, S, D]: keys and values stacked), passed as arrays;
  - `BigramLM`: a plain Python object (not a pytree) with a dummy cache, closed over;
  - `specdec_jax.models.Transformer`: a Flax NNX module, split and merged.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax.drafts.lookup import PromptLookupDrafter
from specdec_jax.loop.decoding import generate, speculative_generate
from specdec_jax.loop.state import DecodeStats, GenerateOutput
from specdec_jax.sampling.params import SamplingParams
from tests.support.compiles import count_compiles
from tests.support.lossless import (
  N_ROWS,
  SMALL_V,
  TEMPERATURE,
  TOP_K,
  assert_first_tokens_follow,
  exact_joint,
  first_tokens_run,
)
from tests.support.tiny_lm import BigramLM, TinyLM, check_output, make_prompts

# ----------------------------------------------------------------------------
# Greedy: speculative == plain, token for token
# ----------------------------------------------------------------------------

V, P, MAX_NEW = 32, 7, 16
LENGTHS = [7, 3, 1, 5]


# 28 ends rows 1-3 early (found by a run without EOS); row 0 never emits it and
# runs to MAX_NEW; 31 is never emitted (a tuple of EOS ids).
EOS = (28, 31)


@pytest.fixture(scope="module")
def greedy_setup():
  target, draft = TinyLM.create(0, V), TinyLM.create(1, V)
  prompts, lengths = make_prompts(0, V, LENGTHS, P)
  params = SamplingParams.greedy(len(LENGTHS))
  plain = generate(target, prompts, lengths, params, None, max_new_tokens=MAX_NEW, eos_token_id=EOS, all_greedy=True)
  plain_lengths = np.asarray(plain.lengths)
  assert plain_lengths[0] == MAX_NEW and plain_lengths[1:].max() < MAX_NEW  # EOS does cut rows short
  return target, draft, prompts, lengths, params, plain


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_greedy_speculative_equals_generate(greedy_setup, k, drafter):
  target, draft, prompts, lengths, params, plain = greedy_setup
  if drafter == "lookup":
    draft = PromptLookupDrafter(ngram_size=(3, 1))
  out = speculative_generate(
    target,
    draft,
    prompts,
    lengths,
    params,
    None,
    max_new_tokens=MAX_NEW,
    num_speculative_tokens=k,
    eos_token_id=EOS,
    all_greedy=True,
  )
  np.testing.assert_array_equal(out.tokens, plain.tokens)
  np.testing.assert_array_equal(out.lengths, plain.lengths)
  check_output(out, MAX_NEW, k, eos=EOS)
  check_output(plain, MAX_NEW, 0, eos=EOS)
  st = plain.stats
  np.testing.assert_array_equal(st.target_calls, plain.lengths)
  assert float(st.acceptance_rate) == 0.0 and float(st.mean_accepted_length) == 1.0


# One static configuration shared by the sampled tests below, so they reuse one
# compiled program (TinyLMs of one vocabulary differ only in their arrays).
SAMPLED = dict(max_new_tokens=13, num_speculative_tokens=3, eos_token_id=(3, 4))
SAMPLED_B = 4


def _sampled_inputs(seed):
  r = np.random.default_rng(seed)
  prompts, lengths = make_prompts(seed, V, r.integers(1, P + 1, SAMPLED_B), P)
  greedy = r.uniform(size=SAMPLED_B) < 0.3
  params = SamplingParams.create(
    np.where(greedy, 0.0, r.uniform(0.3, 1.5, SAMPLED_B)),
    top_k=r.integers(0, 9, SAMPLED_B),
    top_p=r.uniform(0.5, 1.0, SAMPLED_B),
  )
  return prompts, lengths, params, jax.random.split(jax.random.key(seed), SAMPLED_B)


def test_identical_draft_is_always_accepted():
  """A draft equal to the target: every draft accepted (the draft cache never misses a token).

  Greedy, max_new_tokens = 1 + 4 (K + 1) makes every round whole, so the rate is
  exactly 1. Sampled, the draft's distribution q equals the target's p up to
  float rounding (a T=1 versus a T=K+1 forward), so min(1, p/q) < 1 only by
  ~1e-7: every round but a row's last (cut by EOS or max_new_tokens) emits K+1
  tokens. A draft whose cache missed a token, or that was sampled with other
  parameters or the target's keys, falls far below that.
  """
  k, b, max_new = 3, 8, 17
  model = TinyLM.create(2, V)
  prompts, lengths = make_prompts(1, V, [7, 1, 2, 3, 4, 5, 6, 7], P)
  out = speculative_generate(
    model,
    model,
    prompts,
    lengths,
    SamplingParams.greedy(b),
    None,
    max_new_tokens=max_new,
    num_speculative_tokens=k,
    all_greedy=True,
  )
  assert float(out.stats.acceptance_rate) == 1.0
  np.testing.assert_array_equal(out.stats.target_calls, 5)
  np.testing.assert_array_equal(out.stats.accepted_per_position, [4 * b] * k)
  assert float(out.stats.mean_accepted_length) == pytest.approx(max_new / 5)

  k = SAMPLED["num_speculative_tokens"]
  for seed in (20, 21):
    prompts, lengths, params, keys = _sampled_inputs(seed)
    sampled = speculative_generate(model, model, prompts, lengths, params, keys, **SAMPLED)
    check_output(sampled, SAMPLED["max_new_tokens"], k, eos=SAMPLED["eos_token_id"])
    full_rounds = 1 + -(-(np.asarray(sampled.lengths) - 1) // (k + 1))  # prefill + ceil((n - 1) / (K + 1))
    np.testing.assert_array_equal(sampled.stats.target_calls, full_rounds)


# ----------------------------------------------------------------------------
# Models of every kind; no recompilation; batch invariance; stats
# ----------------------------------------------------------------------------


def test_bigram_model_not_a_pytree_runs_through_both_loops():
  """A plain object with a dummy cache: the greedy chain is known in closed form."""
  v = 11
  table = np.full((v, v), -5.0)
  table[np.arange(v), (3 * np.arange(v) + 1) % v] = 5.0  # next = 3 t + 1 mod v
  model = BigramLM(table)
  prompts, lengths = make_prompts(2, v, [3, 1, 2], 4)
  last = np.asarray(prompts)[np.arange(3), np.asarray(lengths) - 1]
  expected = np.zeros((3, 6), np.int64)
  for i in range(6):
    last = (3 * last + 1) % v
    expected[:, i] = last
  params = SamplingParams.greedy(3)
  plain = generate(model, prompts, lengths, params, None, max_new_tokens=6, all_greedy=True)
  np.testing.assert_array_equal(plain.tokens, expected)
  for draft in (model, PromptLookupDrafter(1)):
    out = speculative_generate(
      model, draft, prompts, lengths, params, None, max_new_tokens=6, num_speculative_tokens=2, all_greedy=True
    )
    np.testing.assert_array_equal(out.tokens, expected)
    check_output(out, 6, 2)
  # max_new_tokens=1: the prefill's token only, the loop runs no round.
  one = speculative_generate(
    model, model, prompts, lengths, params, None, max_new_tokens=1, num_speculative_tokens=2, all_greedy=True
  )
  np.testing.assert_array_equal(one.tokens, expected[:, :1])
  np.testing.assert_array_equal(one.stats.drafted, 0)


def test_no_recompilation_for_new_prompts_params_keys_and_weights():
  def call(seed):
    prompts, lengths, params, keys = _sampled_inputs(seed)
    out = speculative_generate(
      TinyLM.create(seed, V), TinyLM.create(seed + 100, V), prompts, lengths, params, keys, **SAMPLED
    )
    check_output(out, SAMPLED["max_new_tokens"], SAMPLED["num_speculative_tokens"], eos=SAMPLED["eos_token_id"])
    return out

  call(0)
  # TinyLM.traces adds what compiles cannot see: a model trace outside the jit
  # (e.g. a jax.eval_shape check in the Python wrapper) compiles nothing but
  # would still trace the whole model on every call.
  traces = TinyLM.traces
  with count_compiles("_speculative_jit") as compiled:
    for seed in (1, 2):
      call(seed)
  assert not compiled, compiled
  assert TinyLM.traces == traces


def test_generate_does_not_recompile_for_new_prompts_params_keys_and_weights():
  def call(seed):
    prompts, lengths, params, keys = _sampled_inputs(seed)
    out = generate(
      TinyLM.create(seed, V),
      prompts,
      lengths,
      params,
      keys,
      max_new_tokens=SAMPLED["max_new_tokens"],
      eos_token_id=SAMPLED["eos_token_id"],
    )
    check_output(out, SAMPLED["max_new_tokens"], 0, eos=SAMPLED["eos_token_id"])

  call(0)
  with count_compiles("_generate_jit") as compiled:
    for seed in (1, 2):
      call(seed)
  assert not compiled, compiled


def test_int_eos_equals_one_element_tuple(greedy_setup):
  target, draft, prompts, lengths, params, _ = greedy_setup
  for loop in (
    lambda eos: generate(
      target, prompts, lengths, params, None, max_new_tokens=MAX_NEW, eos_token_id=eos, all_greedy=True
    ),
    lambda eos: speculative_generate(
      target,
      draft,
      prompts,
      lengths,
      params,
      None,
      max_new_tokens=MAX_NEW,
      num_speculative_tokens=3,
      eos_token_id=eos,
      all_greedy=True,
    ),
  ):
    as_int, as_tuple = loop(EOS[0]), loop((EOS[0],))
    np.testing.assert_array_equal(as_int.tokens, as_tuple.tokens)
    assert np.asarray(as_int.lengths).min() < MAX_NEW  # the int EOS did end some rows


def test_all_greedy_loop_program_has_no_exponential_or_random_bits():
  # all_greedy reaches both the draft's token choice and the sampler: with
  # softmax-free models (bigram tables), the whole compiled speculative loop
  # holds no exp and no PRNG (threefry) instruction.
  r = np.random.default_rng(5)
  target, draft = BigramLM(r.normal(size=(V, V))), BigramLM(r.normal(size=(V, V)))
  prompts, lengths = make_prompts(0, V, LENGTHS, P)
  params = SamplingParams.greedy(len(LENGTHS))

  def program(**flags):
    fn = lambda p, n, key: (
      speculative_generate(
        target, draft, p, n, params, key, max_new_tokens=MAX_NEW, num_speculative_tokens=3, **flags
      ).tokens
    )
    return jax.jit(fn).lower(prompts, lengths, jax.random.key(0)).compile().as_text()

  greedy = program(all_greedy=True)
  assert "exponential(" not in greedy and "threefry" not in greedy
  assert "exponential(" in program()  # the check sees them when they are there


def test_batch_invariance_with_per_row_keys():
  """Row b's tokens depend on its own key, prompt and parameters only.

  Two batches of the same size share two requests, at other row indices, among
  different neighbours (same size: one compiled program serves both).
  """
  target, draft = TinyLM.create(3, V), TinyLM.create(4, V)
  a, other = _sampled_inputs(30), _sampled_inputs(31)
  # Batch b = [other0, a2, other2, a0].
  pick = lambda x, y: jnp.stack([y[0], x[2], y[2], x[0]])
  b = jax.tree.map(pick, a, other)
  out_a = speculative_generate(target, draft, *a, **SAMPLED)
  out_b = speculative_generate(target, draft, *b, **SAMPLED)
  for row_a, row_b in ((0, 3), (2, 1)):
    np.testing.assert_array_equal(out_a.tokens[row_a], out_b.tokens[row_b])
    np.testing.assert_array_equal(out_a.stats.accepted[row_a], out_b.stats.accepted[row_b])
  assert not np.array_equal(a[0][1], b[0][0]) and not np.array_equal(a[0][3], b[0][2])  # other neighbours


def test_nnx_transformer_greedy_and_no_recompile_for_new_weights():
  models = pytest.importorskip("specdec_jax.models")
  from flax import nnx

  config = models.TransformerConfig.tiny(V, tie_embeddings=False)

  def make(seed):
    # Larger weights than the default init, so logits are far from ties.
    r = np.random.default_rng(seed)
    weights = {
      name: r.normal(size=shape) / np.sqrt(shape[-2] if len(shape) > 1 else 1.0)
      for name, shape in models.weight_shapes(config).items()
    }
    for name in weights:
      if name.endswith("norm"):
        weights[name] = np.ones_like(weights[name])
    weights["embed"] = r.normal(size=weights["embed"].shape)
    weights["lm_head"] *= 4.0
    return models.Transformer.from_weights(config, weights)

  target = make(0)
  assert isinstance(target, nnx.Module)
  prompts, lengths = make_prompts(6, V, [5, 2, 6], 6)
  params = SamplingParams.greedy(3)
  kwargs = dict(max_new_tokens=10, all_greedy=True)
  plain = generate(target, prompts, lengths, params, None, **kwargs)
  out = speculative_generate(target, make(1), prompts, lengths, params, None, num_speculative_tokens=3, **kwargs)
  np.testing.assert_array_equal(out.tokens, plain.tokens)
  check_output(out, 10, 3)
  with count_compiles("_speculative_jit") as compiled:
    same = speculative_generate(target, target, prompts, lengths, params, None, num_speculative_tokens=3, **kwargs)
  np.testing.assert_array_equal(same.tokens, plain.tokens)
  assert not compiled, compiled  # new draft weights, same program


# ----------------------------------------------------------------------------
# Prompt lookup and argument checks
# ----------------------------------------------------------------------------


def test_prompt_lookup_proposals():
  tokens = jnp.array(
    [
      [1, 2, 3, 9, 1, 2, 3, 0, 0],  # "1 2 3" seen before: propose what followed
      [5, 6, 5, 6, 5, 6, 0, 0, 0],  # periodic: continues the period
      [1, 2, 3, 4, 5, 6, 7, 8, 0],  # no repeat: repeat the last token
      [4, 0, 0, 0, 0, 0, 0, 0, 0],
    ],
    jnp.int32,
  )  # length 1
  lengths = jnp.array([7, 6, 8, 1], jnp.int32)
  propose = jax.jit(PromptLookupDrafter(ngram_size=(3, 2)).propose, static_argnums=2)
  got = propose(tokens, lengths, 4)
  np.testing.assert_array_equal(got, [[9, 1, 2, 3], [5, 6, 5, 6], [8, 8, 8, 8], [4, 4, 4, 4]])
  # The most recent match wins; the smaller size is tried when the larger fails.
  propose = jax.jit(PromptLookupDrafter(ngram_size=(4, 1)).propose, static_argnums=2)
  got = propose(jnp.array([[7, 1, 7, 2, 7, 0]]), jnp.array([5]), 2)
  np.testing.assert_array_equal(got, [[2, 7]])
  with pytest.raises(ValueError, match="ngram_size"):
    PromptLookupDrafter(ngram_size=0)


def test_argument_errors_name_the_argument():
  model = TinyLM.create(0, V)
  prompts, lengths = make_prompts(0, V, [3, 2], 4)
  params = SamplingParams.greedy(2)
  kw = dict(max_new_tokens=4, num_speculative_tokens=2, all_greedy=True)
  with pytest.raises(ValueError, match="prompt_lengths"):
    speculative_generate(model, model, prompts, jnp.array([0, 2]), params, None, **kw)
  with pytest.raises(ValueError, match="prompt_tokens"):
    speculative_generate(model, model, prompts[0], lengths, params, None, **kw)
  with pytest.raises(ValueError, match="num_speculative_tokens"):
    speculative_generate(model, model, prompts, lengths, params, None, **{**kw, "num_speculative_tokens": 0})
  with pytest.raises(ValueError, match="max_new_tokens"):
    generate(model, prompts, lengths, params, None, max_new_tokens=0)
  with pytest.raises(ValueError, match="key"):
    generate(model, prompts, lengths, params, None, max_new_tokens=4)
  with pytest.raises(ValueError, match="eos_token_id"):
    generate(model, prompts, lengths, params, None, max_new_tokens=4, eos_token_id="2", all_greedy=True)
  with pytest.raises(ValueError, match="params"):
    generate(model, prompts, lengths, SamplingParams.greedy(3), None, max_new_tokens=4, all_greedy=True)
  with pytest.raises(TypeError, match="draft"):
    speculative_generate(model, object(), prompts, lengths, params, None, **kw)
  with pytest.raises(ValueError, match="vocabulary"):
    speculative_generate(model, TinyLM.create(0, V + 1), prompts, lengths, params, None, **kw)


def test_outputs_are_pytrees():
  out = GenerateOutput(
    tokens=jnp.zeros((1, 2), jnp.int32),
    lengths=jnp.ones((1,), jnp.int32),
    stats=DecodeStats(
      *(jnp.ones((1,), jnp.int32),) * 3,
      jnp.zeros((0,), jnp.int32),
      jnp.ones((1,), jnp.int32),
      jnp.zeros((0,), jnp.int32),
    ),
  )
  assert len(jax.tree.leaves(out)) == 8
  assert isinstance(jax.tree.map(lambda x: x, out), GenerateOutput)


# ----------------------------------------------------------------------------
# Sampled: lossless end to end (chi-square on the joint of the first 3 tokens)
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("verification", ["token", pytest.param("block", marks=pytest.mark.slow)])
def test_sampled_speculative_is_lossless(monkeypatch, verification):
  """The first 3 tokens of N rows (each with its own key) follow the target's exact joint.

  Sparse bins (expected count < 5) are pooled; alpha = 1e-3 with a fixed seed.
  Power (tests/support/stats.py `detectable_deviation`): N = 20000 samples over the
  ~200 pooled bins detect, with 80% power, every deviation of Cohen's w >= ~0.06,
  so every total-variation shift >= ~0.03. The planted loop below, which
  accepts every draft, is rejected with a p-value far below alpha. Both
  verification methods ("token", "block") face the same check.
  """
  target, draft = TinyLM.create(10, SMALL_V, logit_scale=1.5), TinyLM.create(11, SMALL_V, logit_scale=1.5)
  prompt = np.array([1, 5, 2, 7])
  prompts = jnp.asarray(np.tile(prompt, (N_ROWS, 1)), jnp.int32)
  lengths = jnp.full((N_ROWS,), len(prompt), jnp.int32)
  params = SamplingParams.create(jnp.full((N_ROWS,), TEMPERATURE), top_k=TOP_K)
  joint = exact_joint(target, prompt)
  np.testing.assert_allclose(joint.sum(), 1.0, rtol=1e-6)

  run = first_tokens_run(target, draft, prompts, lengths, params, 42, verification=verification)

  out = assert_first_tokens_follow(run, joint, monkeypatch, f"speculative_generate({verification}), first 3 tokens")
  check_output(out, 3, 2)
  assert 0.05 < float(out.stats.acceptance_rate) < 0.95  # the draft differs: rejections happen


def test_verification_is_checked():
  target = TinyLM.create(10, SMALL_V)
  prompts, lengths = jnp.ones((1, 3), jnp.int32), jnp.array([3])
  with pytest.raises(ValueError, match="verification must be one of"):
    speculative_generate(
      target,
      target,
      prompts,
      lengths,
      SamplingParams.greedy(1),
      None,
      max_new_tokens=2,
      num_speculative_tokens=2,
      all_greedy=True,
      verification="tokens",
    )
  with pytest.raises(ValueError, match="verifies chains"):
    speculative_generate(
      target,
      target,
      prompts,
      lengths,
      SamplingParams.greedy(1),
      None,
      max_new_tokens=2,
      num_speculative_tokens=2,
      all_greedy=True,
      verification="block",
      draft_tree=(2, 1),
    )


# ----------------------------------------------------------------------------
# What a new user trips on: x64, context limits, int32 limits, short runs, imports
# ----------------------------------------------------------------------------


@pytest.mark.slow  # 17 s on 2 cores: both loops compiled again under x64
def test_loops_run_under_x64_with_the_same_tokens(greedy_setup):
  target, draft, prompts, lengths, _, _ = greedy_setup
  sampled_prompts, sampled_lengths, params, keys = _sampled_inputs(3)

  def run():
    greedy = speculative_generate(
      target,
      draft,
      prompts,
      lengths,
      SamplingParams.greedy(len(LENGTHS)),
      None,
      max_new_tokens=MAX_NEW,
      num_speculative_tokens=3,
      eos_token_id=EOS,
      all_greedy=True,
    )
    sampled = speculative_generate(target, draft, sampled_prompts, sampled_lengths, params, keys, **SAMPLED)
    lookup = speculative_generate(
      target, PromptLookupDrafter(2), sampled_prompts, sampled_lengths, params, keys, **SAMPLED
    )
    plain = generate(target, sampled_prompts, sampled_lengths, params, keys, max_new_tokens=9)
    return [jax.tree.map(np.asarray, o) for o in (greedy, sampled, lookup, plain)]

  expected = run()
  jax.config.update("jax_enable_x64", True)
  try:
    got = run()
  finally:
    jax.config.update("jax_enable_x64", False)
  for e, g in zip(expected, got):
    assert g.tokens.dtype == np.int32 and g.lengths.dtype == np.int32
    np.testing.assert_array_equal(g.tokens, e.tokens)
    np.testing.assert_array_equal(g.stats.accepted, e.stats.accepted)


class _ShortContextLM(TinyLM):
  """TinyLM declaring a context of 20 positions (the attribute the loops check)."""

  max_length = 20


def test_generation_past_the_model_context_is_refused():
  base = TinyLM.create(0, V)
  model = _ShortContextLM(embed=base.embed, wqkv=base.wqkv, unembed=base.unembed)
  prompts, lengths = make_prompts(0, V, [5, 3], 8)
  params = SamplingParams.greedy(2)
  with pytest.raises(ValueError, match=r"max_new_tokens=13 .* target\.max_length=20"):
    generate(model, prompts, lengths, params, None, max_new_tokens=13, all_greedy=True)
  with pytest.raises(ValueError, match=r"draft\.max_length=20"):
    speculative_generate(
      base, model, prompts, lengths, params, None, max_new_tokens=13, num_speculative_tokens=2, all_greedy=True
    )
  out = generate(model, prompts, lengths, params, None, max_new_tokens=12, all_greedy=True)  # P + 12 = 20 fits
  assert out.tokens.shape == (2, 12)


def test_int32_limits_name_the_argument(greedy_setup):
  target, draft, prompts, lengths, params, _ = greedy_setup
  kw = dict(all_greedy=True)
  with pytest.raises(ValueError, match="max_new_tokens"):
    generate(target, prompts, lengths, params, None, max_new_tokens=2**31 - 1, **kw)
  with pytest.raises(ValueError, match="max_new_tokens"):
    speculative_generate(
      target, draft, prompts, lengths, params, None, max_new_tokens=2**31 - 10, num_speculative_tokens=4, **kw
    )
  for eos in (2**31, -1, (3, 2**40)):
    with pytest.raises(ValueError, match="eos_token_id"):
      generate(target, prompts, lengths, params, None, max_new_tokens=4, eos_token_id=eos, **kw)
  with pytest.raises(ValueError, match=r"eos_token_id must be token ids in \[0, V=32\)"):  # known once traced
    speculative_generate(
      target, draft, prompts, lengths, params, None, max_new_tokens=4, num_speculative_tokens=2, eos_token_id=V, **kw
    )


def test_prompt_lengths_out_of_range_under_jit_are_clipped(greedy_setup):
  """Traced prompt_lengths cannot be checked: they are clipped into [1, P] (documented)."""
  target, draft, prompts, _, params, _ = greedy_setup
  kw = dict(max_new_tokens=6, all_greedy=True)
  bad = jnp.array([0, P + 3, -2, 4], jnp.int32)
  clipped = jnp.clip(bad, 1, P)
  for loop in (
    lambda pl: generate(target, prompts, pl, params, None, **kw),
    lambda pl: speculative_generate(target, draft, prompts, pl, params, None, num_speculative_tokens=2, **kw),
  ):
    got = jax.jit(loop)(bad)
    want = loop(clipped)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    assert np.all(np.asarray(got.tokens) >= 0)


def test_short_runs_do_not_undercount_acceptance():
  """An identical draft at max_new_tokens=12: every usable draft is accepted, at every position."""
  model = TinyLM.create(2, V)
  prompts, lengths = make_prompts(4, V, [7, 1, 2, 3], P)
  out = speculative_generate(
    model,
    model,
    prompts,
    lengths,
    SamplingParams.greedy(4),
    None,
    max_new_tokens=12,
    num_speculative_tokens=4,
    all_greedy=True,
  )
  check_output(out, 12, 4)
  st = out.stats
  assert float(st.acceptance_rate) < 1.0  # drafts past the limit count as proposed
  assert float(st.usable_acceptance_rate) == 1.0
  np.testing.assert_array_equal(st.acceptance_per_position, [1.0] * 4)
  np.testing.assert_array_equal(st.accepted, st.usable_drafted)
  # The first round (11 tokens of room) uses all 4 drafts, the second (6) all 4, the third (1) none.
  np.testing.assert_array_equal(st.usable_drafted, [8] * 4)
