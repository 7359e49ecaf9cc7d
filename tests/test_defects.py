"""Small defects of the verifiers and the sampler's API boundary, each pinned by a test.

* `tree_rejection_sample` takes `parents` as a Python list or tuple;
* concrete params that contradict the `no_filters` promise raise a ValueError
  naming the flag and the field (traced params are the caller's promise,
  unchecked); `all_greedy` / `all_random` are defined for any temperature
  (DESIGN.md), so temperatures do not contradict them;
* concrete `draft_probs` rows that do not sum to 1 raise (the tree's i.i.d. mode and the chain);
* `PenaltyState.from_prompt` refuses prompt_lengths outside [0, P];
* `process_logits` applies the logit bias and the penalties (steps 1-3).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import PenaltyState, SamplingParams, rejection_sample, tree_rejection_sample
from specdec_jax.sampling import penalties, sample


def _logits(shape, seed=0):
  return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


# ---- parents as a list ----------------------------------------------------


@pytest.mark.parametrize("parents", [[-1, -1, 0], (-1, -1, 0)])
def test_tree_parents_as_a_python_sequence(parents):
  logits = _logits((1, 4, 16))
  draft = jnp.array([[3, 4, 5]])
  got = tree_rejection_sample(draft, parents, logits, SamplingParams.greedy(1), all_greedy=True)
  want = tree_rejection_sample(draft, np.array([-1, -1, 0]), logits, SamplingParams.greedy(1), all_greedy=True)
  np.testing.assert_array_equal(got.token_ids, want.token_ids)
  np.testing.assert_array_equal(got.accepted_nodes, want.accepted_nodes)


def test_tree_parents_ragged_list_names_parents():
  with pytest.raises(ValueError, match="parents"):
    tree_rejection_sample(
      jnp.array([[3, 4]]), [[-1], [-1, 0]], _logits((1, 3, 16)), SamplingParams.greedy(1), all_greedy=True
    )


# ---- promises contradicted by concrete params -------------------------------


def _chain(params, **flags):
  b = params.batch_size
  key = None if flags.get("all_greedy") else jax.random.key(0)
  return rejection_sample(jnp.zeros((b, 2), jnp.int32), _logits((b, 3, 16)), params, key, **flags)


def _tree(params, **flags):
  b = params.batch_size
  key = None if flags.get("all_greedy") else jax.random.key(0)
  return tree_rejection_sample(
    jnp.zeros((b, 2), jnp.int32), np.array([-1, 0]), _logits((b, 3, 16)), params, key, **flags
  )


def _sample(params, **flags):
  flags.pop("all_random", None)
  return sample.sample_tokens(_logits((params.batch_size, 16)), params, jax.random.key(0), **flags)


CONTRADICTIONS = [
  ({"no_filters": True}, SamplingParams.create([1.0, 0.7], top_k=[0, 5]), "no_filters.*top_k"),
  ({"no_filters": True}, SamplingParams.create(1.0, top_p=0.9), "no_filters.*top_p"),
  ({"no_filters": True}, SamplingParams.create(1.0, min_p=0.1), "no_filters.*min_p"),
]


@pytest.mark.parametrize("verifier", [_chain, _tree, _sample])
@pytest.mark.parametrize("flags, params, message", CONTRADICTIONS)
def test_contradicted_promise_raises(verifier, flags, params, message):
  with pytest.raises(ValueError, match=message):
    verifier(params, **flags)


def test_temperatures_do_not_contradict_all_greedy_or_all_random():
  # DESIGN.md: every row is treated as greedy (random), whatever its temperature.
  _chain(SamplingParams.create([0.0, 0.8]), all_random=True)
  _chain(SamplingParams.create([0.0, 0.8], top_k=5), all_greedy=True, no_filters=True)
  with pytest.raises(ValueError, match="no_filters.*top_k"):  # under all_random a zero-temperature row is random
    _chain(SamplingParams.create([0.0, 0.8], top_k=[5, 0]), all_random=True, no_filters=True)


@pytest.mark.parametrize("verifier", [_chain, _tree, _sample])
def test_kept_promises_and_greedy_rows_with_filters_pass(verifier):
  verifier(SamplingParams.create([1.0, 0.5]), no_filters=True)
  verifier(SamplingParams.greedy(2), all_greedy=True)
  # A greedy row's filters are ignored, so they contradict no promise.
  verifier(SamplingParams.create([0.0, 1.0], top_k=[5, 0]), no_filters=True)


def test_traced_params_are_not_checked():
  params = SamplingParams.create([1.0, 0.7], top_k=[0, 5])
  run = jax.jit(lambda p: _chain(p, no_filters=True).token_ids)
  assert run(params).shape == (2, 3)


# ---- draft_probs that do not sum to 1 --------------------------------------


def _probs(shape, scale=1.0):
  q = np.random.default_rng(1).dirichlet(np.ones(shape[-1]), size=shape[:-1]).astype(np.float32)
  return q * np.float32(scale)


def test_tree_iid_draft_probs_must_sum_to_one():
  args = (jnp.array([[1, 2]]), np.array([-1, -1]), _logits((1, 3, 16)), SamplingParams.create(1.0), jax.random.key(0))
  tree_rejection_sample(*args, draft_probs=_probs((1, 3, 16)))  # normalised: accepted
  with pytest.raises(ValueError, match="draft_probs must sum to 1"):
    tree_rejection_sample(*args, draft_probs=_probs((1, 3, 16), 0.5))
  # Without replacement the verifier renormalises q itself.
  tree_rejection_sample(*args, draft_probs=_probs((1, 3, 16), 0.5), sibling_draws="without_replacement")


def test_chain_draft_probs_must_sum_to_one():
  args = (jnp.array([[1, 2]]), _logits((1, 3, 16)), SamplingParams.create(1.0), jax.random.key(0))
  rejection_sample(*args, draft_probs=_probs((1, 2, 16)))
  with pytest.raises(ValueError, match="draft_probs must sum to 1"):
    rejection_sample(*args, draft_probs=_probs((1, 2, 16), 2.0))
  # Positions past num_draft_tokens are not read, so not checked.
  q = _probs((1, 2, 16))
  q[0, 1] *= 3
  rejection_sample(*args, draft_probs=q, num_draft_tokens=jnp.array([1]))


# ---- PenaltyState.from_prompt ----------------------------------------------


@pytest.mark.parametrize("lengths", [[4], [-1]])
def test_from_prompt_refuses_lengths_outside_the_prompt(lengths):
  with pytest.raises(ValueError, match="prompt_lengths"):
    PenaltyState.from_prompt(jnp.array([[1, 2, 3]]), jnp.array(lengths), 8)
  PenaltyState.from_prompt(jnp.array([[1, 2, 3]]), jnp.array([3]), 8)


# ---- process_logits honours steps 1-3 --------------------------------------


def test_process_logits_applies_bias_and_penalties():
  b, v = 2, 32
  logits = _logits((b, v), seed=3)
  state = PenaltyState.from_prompt(jnp.array([[1, 2], [3, 4]]), jnp.array([2, 2]), v).add_tokens(jnp.array([5, 6]))
  params = SamplingParams.create(
    [0.8, 1.2], top_k=[0, 10], repetition_penalty=1.5, presence_penalty=0.3, logit_bias={7: 2.0}
  )
  got = sample.process_logits(logits, params, state)
  plain = SamplingParams.create([0.8, 1.2], top_k=[0, 10])
  want = sample.process_logits(penalties.apply_penalties(jnp.asarray(logits), params, state), plain)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  assert not np.allclose(got, sample.process_logits(logits, plain))


def test_process_logits_penalties_need_a_state():
  params = SamplingParams.create(1.0, frequency_penalty=0.5)
  with pytest.raises(ValueError, match="penalty_state"):
    sample.process_logits(_logits((1, 8)), params)
  # Neutral concrete penalties need none (the sample_tokens rule).
  sample.process_logits(_logits((1, 8)), SamplingParams.create(1.0, frequency_penalty=0.0))
