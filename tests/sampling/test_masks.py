"""Masks of allowed tokens in the samplers (`token_bitmask`, `specdec_jax.sampling.masks`).

The law a masked position must follow is the target's law restricted to the allowed tokens and renormalised,
with the mask applied before temperature and the filters (a -inf bias): the float64 reference
(`tests/support/sampling_reference.filtered_probs`) of the logits with disallowed tokens at -inf. Statistical
checks: fixed seeds, chi-square at the suite's significance level (`tests/support/stats.ALPHA`), and the same
check run on the unmasked sampler must fail (it has the power to see a wrong law).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import SamplingParams, rejection_sample, sample_tokens
from specdec_jax.sampling.masks import allowed_tokens, mask_words, pack_bitmask
from tests.support import stats
from tests.support.sampling_reference import filtered_probs
from tests.verify.test_chain import positionwise_gof

V, K, ROWS = 40, 2, 6000
TEMPERATURE, TOP_K = 1.0, 3


def _problem(seed=0):
  """Logits [K+1, V], a mask [K+1, V] that disallows each position's two favourites and half the rest, and
  draft probabilities [K, V] that favour disallowed tokens."""
  rng = np.random.default_rng(seed)
  logits = (1.5 * rng.standard_normal((K + 1, V))).astype(np.float32)
  allowed = rng.random((K + 1, V)) < 0.5
  for j in range(K + 1):
    allowed[j, np.argsort(-logits[j])[:2]] = False
    allowed[j, np.argsort(-logits[j])[2:6]] = True
  q = np.exp(logits[:K] - logits[:K].max(-1, keepdims=True)) + 0.05
  return logits, allowed, (q / q.sum(-1, keepdims=True)).astype(np.float32)


def _masked_law(logits, allowed, top_k=TOP_K):
  return np.stack(
    [
      filtered_probs(np.where(allowed[j], logits[j], -np.inf), temperature=TEMPERATURE, top_k=top_k)
      for j in range(len(logits))
    ]
  )


def test_pack_and_read_back_ignore_the_bits_past_v():
  rng = np.random.default_rng(1)
  allowed = rng.random((3, 70)) < 0.4
  words = pack_bitmask(allowed)
  assert words.dtype == jnp.int32 and words.shape == (3, mask_words(70)) == (3, 3)
  np.testing.assert_array_equal(np.asarray(allowed_tokens(words, 70)), allowed)
  full = np.asarray(words).copy()
  full[:, -1] |= np.int32(-1) << np.int32(6)  # bits of ids 70..95, past V: set, and ignored
  np.testing.assert_array_equal(np.asarray(allowed_tokens(full, 70)), allowed)
  assert int(pack_bitmask(np.ones(32, bool))[0]) == -1  # bit 31 is the sign bit of the int32 word


@pytest.mark.parametrize("with_probs", [True, False])
def test_rejection_sample_follows_the_masked_law_at_every_position(with_probs):
  """Drafts drawn from q (mostly disallowed tokens) or n-gram drafts of each position's disallowed favourite:
  the tokens emitted at every position follow the masked target law, top-k applied after the mask; no
  disallowed token is emitted; the unmasked sampler fails the same check."""
  logits, allowed, q = _problem()
  rng = np.random.default_rng(2)
  if with_probs:
    q64 = q.astype(np.float64) / q.astype(np.float64).sum(-1, keepdims=True)
    draft = np.stack([rng.choice(V, size=ROWS, p=q64[j]) for j in range(K)], 1)
  else:
    draft = np.tile(np.argmax(logits[:K], -1), (ROWS, 1))
  x = np.broadcast_to(logits, (ROWS, K + 1, V))
  mask = np.broadcast_to(np.asarray(pack_bitmask(allowed)), (ROWS, K + 1, mask_words(V)))
  params = SamplingParams.create(np.full(ROWS, TEMPERATURE), top_k=np.full(ROWS, TOP_K))
  probs = np.broadcast_to(q, (ROWS, K, V)) if with_probs else None
  n = np.full(ROWS, K)
  law = _masked_law(logits, allowed)

  def run(bitmask):
    out = jax.jit(
      lambda d, x, p, m: rejection_sample(d, x, params, jax.random.key(3), p, kernels="xla", token_bitmask=m)
    )(draft.astype(np.int32), x, probs, bitmask)
    return np.asarray(out.token_ids), np.asarray(out.num_accepted)

  ids, acc = run(mask)
  for j in range(K + 1):
    emitted = ids[:, j][ids[:, j] >= 0]
    assert allowed[j, emitted].all(), f"position {j} emitted a disallowed token"
  stats.assert_gof(positionwise_gof(ids, acc, n, law, label="masked"))
  if not with_probs:
    assert (acc == 0).all()  # every n-gram draft is its position's favourite, which the mask disallows
  unmasked_ids, unmasked_acc = run(None)
  results = positionwise_gof(unmasked_ids, unmasked_acc, n, law, label="unmasked")
  with pytest.raises(AssertionError):
    stats.assert_gof(results)


def test_the_mask_applies_before_the_filters():
  """Top-k counts allowed tokens only: with the favourite disallowed, top_k=2 keeps the 2nd and 3rd tokens
  (masking after the filter would leave the 2nd alone), and sample_tokens' distribution says so."""
  logits = np.array([[4.0, 3.0, 2.0, 1.0] + [0.0] * 28], np.float32)
  allowed = np.ones((1, 32), bool)
  allowed[0, 0] = False
  _, logp = sample_tokens(
    logits, SamplingParams.create([1.0], top_k=[2]), jax.random.key(0), token_bitmask=pack_bitmask(allowed)
  )
  p = np.exp(np.asarray(logp[0], np.float64))
  np.testing.assert_allclose(p[:4], [0.0, 1 / (1 + np.exp(-1)), np.exp(-1) / (1 + np.exp(-1)), 0.0], rtol=1e-5)
  wrong_order = filtered_probs(logits[0], temperature=1.0, top_k=2) * allowed[0]
  assert np.count_nonzero(wrong_order) == 1  # what masking after the filter would have kept


def test_the_mask_applies_after_the_logit_bias():
  """A mask over a view that already carries a logit bias (a composed transform): the bias moves mass among
  the allowed tokens, and a biased token the mask disallows stays out."""
  logits = np.zeros((1, 32), np.float32)
  allowed = np.zeros((1, 32), bool)
  allowed[0, [1, 2, 3]] = True
  params = SamplingParams.create([1.0], logit_bias=[{2: 1.0, 5: 10.0}])
  _, logp = sample_tokens(logits, params, jax.random.key(0), token_bitmask=pack_bitmask(allowed), kernels="xla")
  p = np.exp(np.asarray(logp[0], np.float64))
  e = np.exp(1.0)
  np.testing.assert_allclose(p[[1, 2, 3]], [1 / (2 + e), e / (2 + e), 1 / (2 + e)], rtol=1e-5)
  assert p[5] == 0.0 and p[[0, 4]].sum() == 0.0


def test_sample_tokens_draws_from_the_masked_law():
  logits, allowed, _ = _problem(4)
  x = np.broadcast_to(logits[0], (ROWS, V))
  mask = np.broadcast_to(np.asarray(pack_bitmask(allowed[0])), (ROWS, mask_words(V)))
  params = SamplingParams.create(np.full(ROWS, TEMPERATURE), top_k=np.full(ROWS, TOP_K))
  tokens, logp = jax.jit(lambda x, m: sample_tokens(x, params, jax.random.key(5), token_bitmask=m, kernels="xla"))(
    x, mask
  )
  law = _masked_law(logits[:1], allowed[:1])[0]
  np.testing.assert_allclose(np.exp(np.asarray(logp[0], np.float64)), law, atol=1e-6)
  stats.assert_gof([stats.chisquare_gof(np.asarray(tokens), law, label="sample_tokens masked")])
  unmasked = jax.jit(lambda x: sample_tokens(x, params, jax.random.key(5), kernels="xla")[0])(x)
  with pytest.raises(AssertionError):
    stats.assert_gof([stats.chisquare_gof(np.asarray(unmasked), law, label="sample_tokens unmasked")])


@pytest.mark.parametrize("all_greedy", [True, False])
def test_greedy_takes_the_argmax_over_allowed_tokens_and_rejects_disallowed_drafts(all_greedy):
  logits, allowed, _ = _problem(6)
  draft = np.argmax(logits[:K], -1)[None].astype(np.int32)  # the favourites: disallowed
  params = SamplingParams.greedy(1)
  out = rejection_sample(
    draft, logits[None], params, None if all_greedy else jax.random.key(0), all_greedy=all_greedy,
    token_bitmask=pack_bitmask(allowed)[None],
  )  # fmt: skip
  assert int(out.num_accepted[0]) == 0
  assert int(out.token_ids[0, 0]) == int(np.argmax(np.where(allowed[0], logits[0], -np.inf)))
  # A draft equal to the masked argmax is accepted.
  masked_argmax = np.argmax(np.where(allowed, logits, -np.inf), -1).astype(np.int32)
  out = rejection_sample(
    masked_argmax[None, :K], logits[None], params, None, all_greedy=True, token_bitmask=pack_bitmask(allowed)[None]
  )
  np.testing.assert_array_equal(np.asarray(out.token_ids[0]), masked_argmax)
  tok, _ = sample_tokens(logits[:1], params, None, all_greedy=True, token_bitmask=pack_bitmask(allowed[:1]))
  assert int(tok[0]) == masked_argmax[0]


def test_all_greedy_with_a_mask_stays_softmax_free_and_writes_no_masked_logits():
  """The mask is read inside the argmax pass: the all_greedy program has no exponential, and its only
  [B, K+1, V] float value is the logits parameter (no masked copy); the random program does exponentiate."""
  logits, allowed, _ = _problem()
  words = pack_bitmask(allowed)[None]
  fn = jax.jit(lambda d, x, m: rejection_sample(d, x, SamplingParams.greedy(1), None, all_greedy=True, token_bitmask=m))
  prog = stats.HloProgram(fn.lower(jnp.zeros((1, K), jnp.int32), logits[None], words).compile().as_text())
  assert not prog.opcodes() & {"exponential", "exponential-minus-one", "log"}, prog.opcodes()
  fused = {name for ins in prog.instructions() if ins.opcode == "fusion" for _, name in ins.callees()}
  outside = [c for c in prog.computations if c not in fused]  # what is written to memory
  big = [(i.name, i.opcode) for i in prog.instructions(outside) if i.shape.startswith(f"f32[1,{K + 1},{V}]")]
  assert big and all(op == "parameter" for _, op in big), big
  random = jax.jit(
    lambda d, x, m: rejection_sample(d, x, SamplingParams.create([1.0]), jax.random.key(0), token_bitmask=m)
  )
  text = random.lower(jnp.zeros((1, K), jnp.int32), logits[None], words).compile().as_text()
  assert "exponential" in stats.HloProgram(text).opcodes()


def test_bad_masks_are_value_errors_naming_the_argument():
  logits, allowed, _ = _problem()
  draft, params = np.zeros((1, K), np.int32), SamplingParams.greedy(1)
  words = np.asarray(pack_bitmask(allowed))[None]
  call = lambda m, n=None: rejection_sample(
    draft, logits[None], params, None, None, n, all_greedy=True, token_bitmask=m
  )
  with pytest.raises(ValueError, match=r"token_bitmask must be int32 \[1, 3, 2\]"):
    call(words[:, :, :1])
  with pytest.raises(ValueError, match="token_bitmask must be int32"):
    call(words.astype(np.float32))
  empty = words.copy()
  empty[0, 1] = 0
  with pytest.raises(ValueError, match=r"allows no token at position\(s\) \[\(0, 1\)\]"):
    call(empty)
  call(empty, np.array([0]))  # position 1 is not used with no drafts: no error
  minus_inf = logits[None].copy()
  minus_inf[0, 0, allowed[0]] = -np.inf
  with pytest.raises(ValueError, match="no token with a logit above -inf"):
    rejection_sample(draft, minus_inf, params, None, all_greedy=True, token_bitmask=words)
  with pytest.raises(ValueError, match="token_bitmask allows no token"):
    sample_tokens(logits[:1], SamplingParams.create([1.0]), jax.random.key(0), token_bitmask=np.zeros((1, 2), np.int32))
  with pytest.raises(ValueError, match="kernels='pallas' does not cover a token_bitmask"):
    rejection_sample(draft, logits[None], SamplingParams.create([1.0]), jax.random.key(0), kernels="pallas",
                     token_bitmask=words)  # fmt: skip


def test_under_jit_an_empty_position_emits_token_0():
  """Documented: a position whose mask allows nothing behaves as one whose logits are all -inf."""
  logits, _, _ = _problem()
  fn = jax.jit(lambda x, m: sample_tokens(x, SamplingParams.create([1.0]), jax.random.key(0), token_bitmask=m)[0])
  assert int(fn(logits[:1], jnp.zeros((1, 2), jnp.int32))[0]) == 0
