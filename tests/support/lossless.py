"""The end-to-end lossless check of the loops: the first 3 tokens of N rows against the target's exact joint.

A target over a small vocabulary (SMALL_V tokens) continues one prompt in
N_ROWS rows, each with its own key, at TEMPERATURE and TOP_K. `exact_joint`
computes p(x1, x2, x3 | prompt) from full forwards without cache reuse and
the float64 reference (tests/support/sampling_reference.py);
`assert_first_tokens_follow` runs the chi-square and shows that a planted
verifier (by default `accept_every_draft`) fails the same check.
"""

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.loop import chain_round, decoding, tree_round
from specdec_jax.sampling.sample import sample_tokens
from specdec_jax.verify.chain import RejectionOutput
from tests.support.stats import ALPHA, assert_gof, chisquare_gof, detectable_deviation, reference_probs
from tests.support.tiny_lm import check_output

SMALL_V, N_ROWS, TEMPERATURE, TOP_K = 8, 20000, 0.8, 6


def continuation_logits(target, prompt):
  """The target's logits at positions P-1, P, P+1 of prompt + (x1, x2), for every (x1, x2): [V*V, 3, V].

  Rows are x1-major; from full forwards without cache reuse. Position P-1 scores
  x1, P scores x2 given x1, P+1 scores x3 given x1 and x2.
  """
  v = SMALL_V
  x1, x2 = np.meshgrid(np.arange(v), np.arange(v), indexing="ij")
  seqs = np.concatenate([np.tile(prompt, (v * v, 1)), x1.reshape(-1, 1), x2.reshape(-1, 1)], axis=1)
  n, t = seqs.shape
  logits, _ = target(
    jnp.asarray(seqs, jnp.int32), jnp.broadcast_to(jnp.arange(t)[None, :], (n, t)), target.init_cache(n, t)
  )
  return np.asarray(logits)[:, -3:]


def exact_joint(target, prompt):
  """p(x1, x2, x3 | prompt), flattened [V^3], from full forwards without cache reuse."""
  v = SMALL_V
  # p(x1), p(x2 | x1), p(x3 | x1, x2) with float64 reference processing.
  probs = reference_probs(continuation_logits(target, prompt), TEMPERATURE, top_k=TOP_K)
  p1 = probs[0, 0]  # [V]
  p2 = probs[:, 1].reshape(v, v, v)[:, 0]  # [x1, x2]: any x2 row serves, it is not yet seen
  p3 = probs[:, 2].reshape(v, v, v)  # [x1, x2, x3]
  return (p1[:, None, None] * p2[:, :, None] * p3).reshape(-1)


def accept_every_draft(draft_token_ids, target_logits, params, key=None, draft_probs=None, all_greedy=False, **_):
  """A planted bug: keeps every draft token and appends a target-sampled bonus."""
  b, k = draft_token_ids.shape
  bonus, _ = sample_tokens(target_logits[:, k], params, key, all_greedy=all_greedy)
  return RejectionOutput(
    token_ids=jnp.concatenate([draft_token_ids, bonus[:, None]], axis=1),
    num_accepted=jnp.full((b,), k, jnp.int32),
    num_emitted=jnp.full((b,), k + 1, jnp.int32),
  )


def assert_first_tokens_follow(run, joint, monkeypatch, label, planted=None):
  """Chi-square of the first 3 tokens against `joint`, and a planted bug shown to fail the same check.

  run() -> (GenerateOutput, int [N_ROWS, 3] first tokens). The check pools
  sparse bins and must keep its power (detects total-variation shifts < 0.04).
  Then the verifier is swapped for a wrong one, by default a `rejection_sample`
  that accepts every draft (`planted`: (module, name in it, replacement), e.g.
  `specdec_jax.loop.tree_round`'s `tree_rejection_sample`), which must be rejected
  at ALPHA. Returns the correct run's output.
  """
  out, samples = run()
  weights = np.array([SMALL_V**2, SMALL_V, 1])
  result = chisquare_gof(samples @ weights, joint, label=label)
  assert_gof(result)
  _, tv_min = detectable_deviation(N_ROWS, result.num_bins)
  assert tv_min < 0.04, f"the test lost its power: {result}, detects TV >= {tv_min:.3f}"

  monkeypatch.setattr(*(planted or (chain_round, "rejection_sample", accept_every_draft)))
  # The planted bug must be traced in; the cache is cleared again afterwards.
  decoding._speculative_jit.clear_cache()
  try:
    _, wrong = run()
  finally:
    monkeypatch.undo()
    decoding._speculative_jit.clear_cache()
  assert chisquare_gof(wrong @ weights, joint).pvalue < ALPHA
  return out


def first_tokens_run(target, draft, prompts, lengths, params, seed, *, max_new_tokens=3, **options):
  """A `run` for `assert_first_tokens_follow`: `speculative_generate` of the case with K=2 and the key `seed`
  (`options` passed on: a tree, a verification method, ...), returning (its output, every row's first 3 tokens).

  Example:
    >>> run = first_tokens_run(target, draft, prompts, lengths, params, 42, verification="block")
  """

  def run():
    out = decoding.speculative_generate(
      target,
      draft,
      prompts,
      lengths,
      params,
      jax.random.key(seed),
      max_new_tokens=max_new_tokens,
      num_speculative_tokens=2,
      **options,
    )
    return out, np.asarray(out.tokens)[:, :3]

  return run


def assert_sampled_tree_follows(case, tree, monkeypatch, label, planted):
  """The sampled tree tests' check: 3 new tokens of `case` = (target, draft, prompts, lengths, params, joint)
  (`tiny_transformers.sampled_tree_case`) with `draft_tree=tree` (K=2), by `assert_first_tokens_follow`, the
  tree verifier swapped for `planted` (a wrong `tree_rejection_sample`, `tests.support.planted`) to show the
  check's power. Returns the correct run's output, its invariants checked."""
  target, draft, prompts, lengths, params, joint = case
  run = first_tokens_run(target, draft, prompts, lengths, params, 8, draft_tree=tree)
  out = assert_first_tokens_follow(
    run, joint, monkeypatch, label, planted=(tree_round, "tree_rejection_sample", planted)
  )
  check_output(out, 3, 2)
  return out
