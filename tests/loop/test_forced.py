"""Tests of specdec_jax/loop/forced.py: the forced-acceptance benchmark knob (NOT LOSSLESS).

Every round must accept exactly `forced_accepts` drafts in every live row,
greedy or random, whatever the target thinks of them, and emit those drafts
followed by the target's own token; the public loops and the sampler must not
offer the knob at all.
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax.drafts.dynamic_tree import DynamicTree
from specdec_jax.drafts.lookup import PromptLookupDrafter
from specdec_jax.loop.decoding import generate, speculative_generate
from specdec_jax.loop.forced import speculative_generate_forced
from specdec_jax.sampling.params import SamplingParams
from specdec_jax.verify.chain import rejection_sample
from specdec_jax.verify.tree import tree_rejection_sample
from tests.support.tiny_lm import TinyLM, check_output, make_prompts
from tests.support.tiny_transformers import CONFIG, unit_target

# 12 tokens after the prefill's: a whole number of rounds of a + 1 tokens for every a in 0 .. K, so no round is
# cut by max_new_tokens and every count below is exact.
V, K, MAX_NEW = 32, 3, 13
LENGTHS = [7, 3, 5]
TEMPERATURES = [0.0, 0.0, 1.0]  # two greedy rows (checked token by token) and a random one (counted only)


@pytest.fixture(scope="module")
def chain_setup():
  target, draft = TinyLM.create(0, V), TinyLM.create(1, V)
  prompts, lengths = make_prompts(3, V, LENGTHS, max(LENGTHS))
  return target, draft, prompts, lengths, SamplingParams.create(TEMPERATURES)


@jax.jit
def _argmax_after(model, tokens, n):
  # One shape for every context (a query at position n-1 sees slots <= n-1, never the padding): one compile.
  s = tokens.shape[1]
  logits, _ = model(tokens, jnp.arange(s, dtype=jnp.int32)[None, :], model.init_cache(1, s))
  return jnp.argmax(logits[0, n - 1])


def _next_greedy(model, context):
  """argmax of `model`'s logits after `context`, by one uncached forward pass."""
  tokens = np.zeros((1, 2 * MAX_NEW + max(LENGTHS)), np.int32)
  tokens[0, : len(context)] = context
  return int(_argmax_after(model, tokens, len(context)))


def _forced_on_chain_setup(chain_setup, forced_accepts, **kw):
  """`speculative_generate_forced` on the module's rows (key 0, MAX_NEW tokens, K drafts)."""
  target, draft, prompts, lengths, params = chain_setup
  return speculative_generate_forced(
    target,
    draft,
    prompts,
    lengths,
    params,
    jax.random.key(0),
    forced_accepts=forced_accepts,
    max_new_tokens=MAX_NEW,
    num_speculative_tokens=K,
    **kw,
  )


def _forced_reference(target, draft, prompt, accepts, n):
  """A greedy row of a forced run: the target's first token, then per round `accepts` greedy drafts of the draft
  model, each taken as it is, and the target's argmax after them."""
  out = [_next_greedy(target, prompt)]
  while len(out) < n:
    for _ in range(accepts):
      out.append(_next_greedy(draft, prompt + out))
    out.append(_next_greedy(target, prompt + out))
  return out[:n]


# CI keeps a=0 and a=1; a=K is also what test_forced_rounds_are_real_rounds_when_the_verifier_agrees runs.
@pytest.mark.parametrize("accepts", [0, 1, pytest.param(K, marks=pytest.mark.slow)])
def test_every_round_accepts_exactly_the_forced_count(chain_setup, accepts):
  target, draft, prompts, lengths, params = chain_setup
  out = _forced_on_chain_setup(chain_setup, accepts)
  check_output(out, MAX_NEW, K)
  st = jax.tree.map(np.asarray, out.stats)
  b, rounds = len(LENGTHS), (MAX_NEW - 1) // (accepts + 1)
  np.testing.assert_array_equal(out.lengths, [MAX_NEW] * b)
  np.testing.assert_array_equal(st.target_calls, [1 + rounds] * b)  # the prefill, then one call per round
  np.testing.assert_array_equal(st.accepted, [rounds * accepts] * b)
  np.testing.assert_array_equal(st.accepted_per_position, [b * rounds] * accepts + [0] * (K - accepts))
  # Draft position `accepts` is reached every round and never accepted; those after it are never reached.
  np.testing.assert_array_equal(st.acceptance_per_position, [1.0] * accepts + [0.0] * (K - accepts))
  # Tokens per round (the prefill's call left out): exactly accepts + 1.
  assert (out.lengths.sum() - b) / (st.target_calls.sum() - b) == accepts + 1
  tokens = np.asarray(out.tokens)
  for row in np.flatnonzero(np.asarray(TEMPERATURES) == 0.0):
    prompt = np.asarray(prompts)[row, : LENGTHS[row]].tolist()
    assert tokens[row].tolist() == _forced_reference(target, draft, prompt, accepts, MAX_NEW), row


def test_forced_rounds_are_real_rounds_when_the_verifier_agrees(chain_setup):
  # With the target as its own draft, every greedy round accepts all K drafts anyway: forcing K must change
  # nothing, tokens and statistics alike (the forced path writes what the real one writes).
  target, _, prompts, lengths, _ = chain_setup
  params = SamplingParams.greedy(len(LENGTHS))
  kw = dict(max_new_tokens=MAX_NEW, num_speculative_tokens=K, eos_token_id=14, all_greedy=True)
  real = speculative_generate(target, target, prompts, lengths, params, None, **kw)
  forced = speculative_generate_forced(target, target, prompts, lengths, params, None, forced_accepts=K, **kw)
  assert np.asarray(real.lengths).min() < MAX_NEW  # the EOS ends a row inside a round
  jax.tree.map(np.testing.assert_array_equal, forced, real)


@pytest.mark.parametrize("drafter", [pytest.param("lookup", marks=pytest.mark.slow), "model"])  # CI: the model
def test_a_tree_forces_its_first_child_path(drafter):
  # A tree (2, 1, 1)'s first-child path is the chain's proposal (prompt lookup's branch 0; a greedy model's top-1
  # child at every depth), so forcing the tree emits the chain's forced tokens (greedy, float32) and counts the
  # same accepted drafts, while it drafts 2 * K nodes per round.
  # Flat distributions (embed_scale 0.3), so that the draft model's text differs from the target's.
  target = unit_target(seed=2, embed_scale=0.3)
  draft = unit_target(CONFIG.replace(num_layers=1, feature_layers=()), seed=1, embed_scale=0.3)
  if drafter == "lookup":
    draft = PromptLookupDrafter(ngram_size=(2, 1))
  b, accepts = 2, 2
  prompts, lengths = make_prompts(5, target.config.vocab_size, [4, 2], 4)
  params = SamplingParams.greedy(b)
  kw = dict(forced_accepts=accepts, max_new_tokens=MAX_NEW, num_speculative_tokens=K, all_greedy=True)
  chain = speculative_generate_forced(target, draft, prompts, lengths, params, None, **kw)
  tree = speculative_generate_forced(target, draft, prompts, lengths, params, None, draft_tree=(2, 1, 1), **kw)
  np.testing.assert_array_equal(tree.tokens, chain.tokens)
  rounds = (MAX_NEW - 1) // (accepts + 1)
  np.testing.assert_array_equal(tree.stats.accepted_per_position, [b * rounds] * accepts + [0] * (K - accepts))
  for field in ("target_calls", "accepted", "accepted_per_position", "reached_per_position"):
    np.testing.assert_array_equal(getattr(tree.stats, field), getattr(chain.stats, field), err_msg=field)
  np.testing.assert_array_equal(tree.stats.drafted, 2 * chain.stats.drafted)
  if drafter == "model":  # the draft model disagrees with the target: the forced text is not the target's
    plain = generate(target, prompts, lengths, params, None, max_new_tokens=MAX_NEW, all_greedy=True)
    assert not np.array_equal(chain.tokens, plain.tokens)


@pytest.mark.parametrize("bad", [-1, K + 1, True, 1.5, "1", None])
def test_bad_forced_accepts_is_a_value_error_naming_it(chain_setup, bad):
  with pytest.raises(ValueError, match="forced_accepts"):
    _forced_on_chain_setup(chain_setup, bad)


def test_a_dynamic_tree_is_refused(chain_setup):
  with pytest.raises(ValueError, match="DynamicTree"):
    _forced_on_chain_setup(chain_setup, 1, draft_tree=DynamicTree(depth=K, top_k=2, num_nodes=4))


@pytest.mark.parametrize("fn", [speculative_generate, generate, rejection_sample, tree_rejection_sample])
def test_the_lossless_entry_points_offer_no_forcing_argument(fn):
  # DESIGN.md: forced acceptance must not be reachable from the loops or the sampler by ordinary arguments.
  assert not [name for name in inspect.signature(fn).parameters if "forced" in name]
