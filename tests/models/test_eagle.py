"""Tests of specdec_jax/models/eagle.py (EagleDrafter) and of the loop with a feature drafter.

The drafter is checked three ways: its training-time-test unrolling equals the
cached path the loop runs, step by step; greedy speculative decoding with it
equals plain greedy decoding token for token (an untrained drafter, which
rejects, and a briefly distilled one, which accepts); sampled decoding with it
is lossless (chi-square on the joint law of the first tokens, with a planted
bug shown to fail).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specdec_jax.loop.decoding import generate, speculative_generate
from specdec_jax.models import TransformerConfig
from specdec_jax.models.eagle import EagleConfig, EagleDrafter, eagle_weight_shapes
from specdec_jax.sampling.params import SamplingParams
from tests.support.compiles import count_compiles
from tests.support.lossless import assert_first_tokens_follow, first_tokens_run
from tests.support.tiny_lm import check_output, make_prompts
from tests.support.tiny_transformers import CONFIG, V, sampled_tree_case, unit_target


@pytest.fixture(scope="module")
def pair(tree_models):
  """(target, untrained EAGLE drafter, distilled EAGLE drafter): the session's (tests/conftest.py), distilled once."""
  target, _, untrained, trained = tree_models
  return target, untrained, trained


# ----------------------------------------------------------------------------
# The module
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("draft_vocab", [None, np.arange(0, V, 2)])
def test_unrolled_training_equals_cached_drafting(num_layers, draft_vocab):
  """Depth j of `unrolled_logits` at position p equals draft step j of the cached loop path."""
  _check_unrolled_equals_cached(unit_target(), num_layers, draft_vocab)


def _check_unrolled_equals_cached(target, num_layers, draft_vocab):
  drafter = EagleDrafter.for_target(target, num_layers=num_layers, draft_vocab=draft_vocab, rngs=nnx.Rngs(3))
  b, t, depth, base = 2, 12, 4, 6
  tokens = jax.random.randint(jax.random.key(0), (b, t + 1), 0, V)
  pos = jnp.broadcast_to(jnp.arange(t + 1), (b, t + 1))
  _, feats, _ = target(tokens, pos, target.init_cache(b, 32), return_features=True)
  unrolled = drafter.unrolled_logits(tokens[:, 1:], feats[:, :-1], depth)
  sub = (lambda x: x) if draft_vocab is None else (lambda x: x[..., draft_vocab])

  # Catch-up on entries 0..base from target features, then steps from the drafter's own hiddens.
  cache = drafter.init_cache(b, 32)
  logits, hidden, cache = drafter(
    tokens[:, 1 : base + 2], drafter.fuse(feats[:, : base + 1]), pos[:, : base + 1], cache
  )
  np.testing.assert_allclose(sub(logits[:, base]), unrolled[0][:, base], rtol=1e-5, atol=1e-5)
  h = hidden[:, base : base + 1]
  for j in range(1, depth):
    p = base + j
    logits, h, cache = drafter(tokens[:, p + 1 : p + 2], h, jnp.full((b, 1), p), cache)
    np.testing.assert_allclose(sub(logits[:, 0]), unrolled[j][:, p], rtol=1e-5, atol=1e-5)


def test_head_for_a_biased_target_has_biased_blocks():
  """A target with q/k/v biases (Qwen2) gets a head whose blocks have them too: saved and loaded with its weights,
  used by the cached and the unrolled (training) paths alike, and not ignored (zeroing them moves the logits)."""
  target = unit_target(CONFIG.replace(qkv_bias=True))
  drafter = EagleDrafter.for_target(target, num_layers=2, rngs=nnx.Rngs(4))
  assert drafter.config.layers.qkv_bias
  weights = drafter.to_weights()
  biases = {"first.bq", "first.bk", "first.bv", "rest.bq", "rest.bk", "rest.bv"}
  assert biases <= set(weights) and {k: v.shape for k, v in weights.items()} == eagle_weight_shapes(drafter.config)
  assert eagle_weight_shapes(drafter.config)["rest.bk"] == (1, CONFIG.num_kv_heads * CONFIG.head_dim)
  e = target.embed[...]
  clone = EagleDrafter.from_weights(drafter.config, weights, embed=e, head_rows=e)
  zeroed = EagleDrafter.from_weights(
    drafter.config, {k: 0 * v if k in biases else v for k, v in weights.items()}, embed=e, head_rows=e
  )
  with pytest.raises(ValueError, match="first.bq"):
    EagleDrafter.from_weights(
      drafter.config, {k: v for k, v in weights.items() if k != "first.bq"}, embed=e, head_rows=e
    )
  tokens = jax.random.randint(jax.random.key(5), (2, 5), 0, V)
  hidden = drafter.fuse(jax.random.normal(jax.random.key(6), (2, 5, CONFIG.feature_size)))
  pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
  logits = [m(tokens, hidden, pos, m.init_cache(2, 8))[0] for m in (drafter, clone, zeroed)]
  np.testing.assert_array_equal(logits[1], logits[0])
  assert np.abs(np.asarray(logits[2]) - np.asarray(logits[0])).max() > 1e-2
  _check_unrolled_equals_cached(target, 2, None)


def test_logits_at_and_draft_vocabulary():
  target = unit_target()
  vocab = np.array([1, 4, 9, 15])
  drafter = EagleDrafter.for_target(target, draft_vocab=vocab, rngs=nnx.Rngs(0))
  b, t = 2, 5
  tokens = jax.random.randint(jax.random.key(1), (b, t), 0, V)
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  hidden = drafter.fuse(jax.random.normal(jax.random.key(2), (b, t, CONFIG.feature_size)))
  full, _, _ = drafter(tokens, hidden, pos, drafter.init_cache(b, 8))
  outside = np.setdiff1d(np.arange(V), vocab)
  assert np.all(np.isneginf(np.asarray(full)[..., outside])) and np.all(np.isfinite(np.asarray(full)[..., vocab]))
  at = jnp.array([3, 0])
  one, _, _ = drafter(tokens, hidden, pos, drafter.init_cache(b, 8), logits_at=at)
  assert one.shape == (b, 1, V)
  np.testing.assert_allclose(one[:, 0], full[jnp.arange(b), at], rtol=1e-6)


def test_for_target_shares_the_target_arrays_and_round_trips():
  target = unit_target()
  drafter = EagleDrafter.for_target(target, num_layers=2, rngs=nnx.Rngs(0))
  assert drafter.embed[...] is target.embed[...] and drafter.head[...] is target.embed[...]
  assert drafter.feature_layers == CONFIG.feature_layers
  weights = drafter.to_weights()
  assert {k: v.shape for k, v in weights.items()} == eagle_weight_shapes(drafter.config)
  clone = EagleDrafter.from_weights(drafter.config, weights, embed=target.embed[...], head_rows=target.embed[...])
  x = jnp.ones((1, 3, CONFIG.feature_size))
  np.testing.assert_array_equal(clone.fuse(x), drafter.fuse(x))
  # The optimiser only sees the drafter's own weights, never the target's.
  trainable = nnx.state(drafter, nnx.Param)
  assert sum(a.size for a in jax.tree.leaves(trainable)) == sum(w.size for w in weights.values())


def test_bad_configurations_raise():
  with pytest.raises(ValueError, match="feature_layers is empty"):
    EagleDrafter.for_target(unit_target(CONFIG.replace(feature_layers=())), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="draft_vocab"):
    EagleDrafter.for_target(unit_target(), draft_vocab=[1, 1, 2], rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="draft_vocab"):
    EagleDrafter.for_target(unit_target(), draft_vocab=[V], rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="feature_layers"):
    TransformerConfig.tiny(V, feature_layers=(2,))  # only layers 0, 1 exist
  with pytest.raises(ValueError, match="draft_vocab_size"):
    EagleConfig(layers=TransformerConfig.tiny(V, num_layers=1), feature_layers=(0,), draft_vocab_size=V + 1)
  with pytest.raises(ValueError, match="return_features"):
    target = unit_target(CONFIG.replace(feature_layers=()))
    target(jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2), jnp.int32), target.init_cache(1, 4), return_features=True)


# ----------------------------------------------------------------------------
# In the loop
# ----------------------------------------------------------------------------

LENGTHS = [4, 1, 3, 2]


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_speculative_equals_generate(pair, k):
  """Ragged prompts, EOS inside rounds, max_new_tokens cutting a round: same tokens as plain greedy."""
  target, untrained, trained = pair
  prompts, lengths = make_prompts(5, V, LENGTHS, 4)
  params = SamplingParams.greedy(len(LENGTHS))
  plain0 = generate(target, prompts, lengths, params, None, max_new_tokens=15, all_greedy=True)
  eos = int(np.asarray(plain0.tokens)[2, 6])  # ends row 2 (at least) early: EOS lands inside rounds
  kw = dict(max_new_tokens=15, eos_token_id=eos, all_greedy=True)
  plain = generate(target, prompts, lengths, params, None, **kw)
  assert np.asarray(plain.lengths).min() < 15
  accepted = []
  for drafter in (untrained, trained):
    out = speculative_generate(target, drafter, prompts, lengths, params, None, num_speculative_tokens=k, **kw)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    np.testing.assert_array_equal(out.lengths, plain.lengths)
    check_output(out, 15, k, eos=(eos,))
    accepted.append(int(np.sum(out.stats.accepted)))
  # The distilled drafter's drafts are accepted (catch-up over several verified
  # tokens is exercised); the untrained one's mostly are not (rejections are).
  assert accepted[1] > accepted[0] and accepted[1] >= np.sum(plain.lengths) // 3


def test_mixed_batch_and_no_recompilation(pair):
  """Greedy rows of a mixed batch equal plain greedy; new prompts, keys and parameters reuse the program."""
  target, _, trained = pair
  kw = dict(max_new_tokens=10, num_speculative_tokens=3)

  def call(seed, temps):
    prompts, lengths = make_prompts(seed, V, LENGTHS, 4)
    params = SamplingParams.create(temps)
    out = speculative_generate(target, trained, prompts, lengths, params, jax.random.key(seed), **kw)
    check_output(out, 10, 3)
    return out, prompts, lengths

  call(0, [0.0, 1.0, 0.5, 0.0])
  with count_compiles("_speculative_jit") as compiled:
    out, prompts, lengths = call(1, [0.0, 0.8, 1.0, 0.0])
    call(2, [1.0, 0.0, 0.7, 0.3])
  assert not compiled, compiled
  plain = generate(target, prompts, lengths, SamplingParams.greedy(4), None, max_new_tokens=10, all_greedy=True)
  np.testing.assert_array_equal(np.asarray(out.tokens)[[0, 3]], np.asarray(plain.tokens)[[0, 3]])


def test_mismatched_drafter_is_refused(pair):
  target, untrained, _ = pair
  prompts, lengths = make_prompts(0, V, LENGTHS, 4)
  kw = dict(max_new_tokens=4, num_speculative_tokens=2, all_greedy=True)
  other = unit_target(CONFIG.replace(feature_layers=(1,)))
  with pytest.raises(ValueError, match="feature_layers"):
    speculative_generate(other, untrained, prompts, lengths, SamplingParams.greedy(4), None, **kw)
  bigger = unit_target(TransformerConfig.tiny(V + 1, feature_layers=(0, 1)))
  with pytest.raises(ValueError, match="vocabulary"):
    speculative_generate(bigger, untrained, prompts, lengths, SamplingParams.greedy(4), None, **kw)


def test_sampled_speculative_with_feature_drafter_is_lossless(monkeypatch):
  """The first 3 tokens of N rows follow the target's exact joint, with draft probabilities in play.

  Temperature 0.8 and top-k 6 (as the model-drafter test in tests/loop/test_decoding.py).
  With max_new_tokens=4 and K=2, the third token comes from the first round or
  from a second round that begins with the drafter's catch-up. Sparse bins
  (expected count < 5) are pooled; alpha = 1e-3 with a fixed seed. N = 20000
  detects, with 80% power, every total-variation shift >= ~0.03 (asserted
  below). A planted loop that accepts every draft is rejected.
  """
  # The target (SMALL_V tokens, seed 4, embed scale 0.3), its EAGLE head distilled for 30 steps, N_ROWS copies of
  # the prompt [1, 5, 2, 7] and the exact joint: the sampled dynamic tree's case, built once per process.
  target, drafter, prompts, lengths, params, joint = sampled_tree_case("eagle")

  run = first_tokens_run(target, drafter, prompts, lengths, params, 7, max_new_tokens=4)

  out = assert_first_tokens_follow(run, joint, monkeypatch, "EAGLE speculative_generate, first 3 tokens")
  check_output(out, 4, 2)
  assert 0.05 < float(out.stats.usable_acceptance_rate) < 0.95  # drafts are accepted and rejected
