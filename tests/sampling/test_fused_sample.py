"""Tests of `sample_tokens(kernels="pallas")` (specdec_jax/sampling/fused_sample.py).

On a CPU the kernels run in Pallas's interpreter (the kernel code the GPU compiles
with Triton; bench/sampler_gpu_check.py compares the two token for token on a GPU):

* the distribution it returns equals `process_logits` (the XLA program's), with
  NaN, +inf, a row with nothing above -inf, greedy rows and filters, over several blocks;
* tokens by chi-square (alpha = 1e-3, fixed seeds) for the groups of
  tests/sampling/test_sample.py, in one block and over blocks of 2 tokens (the
  two-stage draw), and (slow) a planted error in the block draw that the same check rejects;
* keys: one key is folded per row as `row_keys` does; a row does not depend on its neighbours;
* the kernels lower to Triton for a CUDA target with no run-time branch outside them;
  the `kernels` argument's errors, and "auto" is the XLA program off a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax.sampling import fused_sample
from specdec_jax.sampling.params import SamplingParams, row_keys
from specdec_jax.sampling.sample import process_logits, sample_tokens
from tests.sampling.test_sample import _GROUP_LOGITS, _GROUP_PARAMS
from tests.support import stats
from tests.support.lowering import cuda_module_text
from tests.support.optimized import optimized

KEY = jax.random.key(0)
sample_jit = jax.jit(sample_tokens, static_argnames=("kernels",))  # eager calls reject the NaN rows


def _odd_rows():
  """Rows of every kind over 5 blocks of 64 (the last one partial): random, filtered, greedy, NaN, +inf, empty."""
  rng = np.random.default_rng(0)
  x = rng.normal(0, 2, (7, 300)).astype(np.float32)
  x[1] = -np.inf  # nothing above -inf, with filters on
  x[2, [5, 270]] = np.inf  # "this token", twice
  x[3, ::3] = np.nan  # greedy over masked tokens
  x[6, 100] = 40.0  # one token far above the rest
  params = SamplingParams.create(
    np.array([1.0, 0.8, 1.0, 0.0, 1.3, 0.7, 0.05], np.float32),
    top_k=np.array([0, 5, 0, 3, 0, 20, 0]),
    top_p=np.array([1.0, 1.0, 0.9, 1.0, 0.5, 0.9, 1.0], np.float32),
  )
  return jnp.asarray(x), params


@pytest.mark.parametrize("no_filters", (False, True))
def test_log_probs_are_the_processed_distribution(no_filters):
  x, params = _odd_rows()
  if no_filters:
    params = params.promise_no_filters()
  tokens, log_p = fused_sample.fused_sample_tokens(
    x, params, jax.random.key(0), no_filters=no_filters, block=64, interpret=True
  )
  tokens, log_p = np.asarray(tokens), np.asarray(log_p)
  expected = np.asarray(process_logits(x, params))
  for r in (0, 2, 4, 5, 6):  # random rows: the same kept set and values
    np.testing.assert_array_equal(np.isfinite(log_p[r]), np.isfinite(expected[r]), err_msg=f"row {r}")
    np.testing.assert_allclose(log_p[r], expected[r], atol=2e-6, err_msg=f"row {r}")
    assert np.isfinite(log_p[r, tokens[r]]), f"row {r} drew a removed token"
  assert tokens[1] == 0 and np.all(log_p[1] == -np.inf)  # no distribution
  assert tokens[2] in (5, 270)
  greedy = int(np.nanargmax(np.where(np.isnan(x[3]), -np.inf, x[3])))
  assert tokens[3] == greedy
  np.testing.assert_array_equal(log_p[3], np.where(np.arange(300) == greedy, 0.0, -np.inf))


def _groups(rows_per_group, seed, *, block, candidates=None):
  """Tokens [groups, rows_per_group]: calls of _CALL_ROWS rows (the interpreter's time grows faster than its
  grid), each a quarter of every group, with its own key."""
  g, per_call = len(_GROUP_PARAMS), _CALL_ROWS // len(_GROUP_PARAMS)
  logits = jnp.asarray(np.repeat(_GROUP_LOGITS, per_call, axis=0))
  t, k, p = (np.repeat(np.array(c), per_call) for c in zip(*_GROUP_PARAMS))
  params = SamplingParams.create(t, top_k=k, top_p=p)
  # Compiled at LLVM level 2 (tests/support/optimized.py): the interpreter's grid loop runs several times faster.
  sample = optimized(
    fused_sample.fused_sample_tokens, no_filters=False, block=block, candidates=candidates, interpret=True
  )
  calls = [
    np.asarray(sample(logits, params, jax.random.fold_in(jax.random.key(seed), c))[0]).reshape(g, per_call)
    for c in range(rows_per_group // per_call)
  ]
  return np.concatenate(calls, axis=1)


def _chisquare_groups(tokens):
  return [
    stats.chisquare_gof(tokens[grp], stats.reference_probs(_GROUP_LOGITS[grp], t, k, p), label=f"group {grp}")
    for grp, (t, k, p) in enumerate(_GROUP_PARAMS[:3])
  ]


# 6,000 rows a group: with about 8 bins, a TV of 0.03 or more is caught with 80% power
# (stats.detectable_deviation(6000, 8)); the interpreter runs one program at a time.
_ROWS = 6000
_CALL_ROWS = 1000


def test_tokens_follow_the_distribution():
  tokens = _groups(_ROWS, seed=0, block=16)  # one block
  stats.assert_gof(_chisquare_groups(tokens))
  np.testing.assert_array_equal(tokens[3], 1)  # greedy: the first of the tied maxima


# Five blocks of 2 tokens (the two-stage draw), 4 candidates a block (the search stays exact). 1,000 rows a
# group catch a TV of 0.08 (80% power, stats.detectable_deviation); the slow test's 12,000 a TV of 0.024.
@pytest.mark.parametrize("rows", (1000, pytest.param(12_000, marks=pytest.mark.slow)))
def test_tokens_follow_the_distribution_over_blocks(rows):
  tokens = _groups(rows, seed=rows, block=2, candidates=4)
  stats.assert_gof(_chisquare_groups(tokens))
  np.testing.assert_array_equal(tokens[3], 1)


@pytest.mark.slow
def test_a_planted_error_in_the_block_draw_is_caught(monkeypatch):
  """The fast check over blocks rejects a draw that picks blocks uniformly instead of by their masses."""
  real = fused_sample.gumbel_pick

  def uniform_blocks(log_w, ids, live, seed, counter):
    if counter == fused_sample._BLOCK:
      log_w = jnp.zeros_like(log_w)
    return real(log_w, ids, live, seed, counter)

  monkeypatch.setattr(fused_sample, "gumbel_pick", uniform_blocks)
  fused_sample.fused_sample_tokens.clear_cache()
  try:
    tokens = _groups(1000, seed=1000, block=2, candidates=4)
  finally:
    fused_sample.fused_sample_tokens.clear_cache()
  with pytest.raises(AssertionError):
    stats.assert_gof(_chisquare_groups(tokens))


def test_one_key_is_folded_into_rows_like_row_keys():
  x, params = _odd_rows()
  run = lambda key: np.asarray(sample_jit(x, params, key, kernels="pallas")[0])
  key = jax.random.key(42)
  single = run(key)
  np.testing.assert_array_equal(run(row_keys(key, 7)), single)
  np.testing.assert_array_equal(run(jax.random.PRNGKey(42)), single)
  assert len({run(jax.random.key(s)).tobytes() for s in range(6)}) > 1  # and the key matters


def test_a_row_depends_on_neither_its_neighbours_nor_their_filters():
  x, params = _odd_rows()
  keys = jax.random.split(jax.random.key(3), 7)
  run = lambda p, rows: np.asarray(sample_jit(x[rows], p, keys[rows], kernels="pallas")[0])
  everyone = np.arange(7)
  calm = SamplingParams.create(params.temperature)
  a, b = run(calm, everyone), run(params, everyone)  # the second batch has filtering rows
  np.testing.assert_array_equal(a[[0, 3, 6]], b[[0, 3, 6]])  # rows that do not filter in either
  perm = np.array([4, 0, 6, 5, 2, 1, 3])
  take = lambda p: jax.tree.map(lambda f: f[perm], p)
  np.testing.assert_array_equal(run(take(params), perm), b[perm])


def test_triton_lowering_has_no_branch_outside_the_kernels():
  """The default program (no promise) on a CUDA target: three kernels, and no `lax.cond` (a host round trip)."""
  s = jax.ShapeDtypeStruct
  b, v = 2, 151936

  def sample(x, t, top_k):
    params = SamplingParams.create(t, top_k=top_k, top_p=jnp.ones((b,), jnp.float32))
    return fused_sample.fused_sample_tokens(x, params, jax.random.key(0), no_filters=False)

  text = cuda_module_text(jax.jit(sample), [s((b, v), jnp.float32), s((b,), jnp.float32), s((b,), jnp.int32)])
  for name in ("sampler_block_partials", "sampler_thresholds", "sampler_sample_tokens"):
    assert name in text, f"expected the {name} kernel as a Triton custom call"
  assert "stablehlo.case" not in text and "stablehlo.if" not in text and "stablehlo.while" not in text


def test_kernels_argument_is_checked():
  x = jnp.zeros((2, 40), jnp.float32)
  key = jax.random.key(0)
  with pytest.raises(ValueError, match="kernels must be one of"):
    sample_tokens(x, SamplingParams.create([1.0, 1.0]), key, kernels="cuda")
  with pytest.raises(ValueError, match="does not cover min-p"):
    sample_tokens(x, SamplingParams.create([1.0, 1.0], min_p=0.1), key, kernels="pallas")
  with pytest.raises(ValueError, match="does not cover logprobs"):
    sample_tokens(x, SamplingParams.create([1.0, 1.0]), key, logprobs="raw", kernels="pallas")


def test_auto_is_the_xla_program_off_a_gpu():
  if jax.default_backend() == "gpu":
    pytest.skip("on a GPU auto takes the Pallas program")
  x, params = _odd_rows()
  run = lambda kernels: np.asarray(sample_jit(x, params, KEY, kernels=kernels)[0])
  np.testing.assert_array_equal(run("auto"), run("xla"))
  assert not np.array_equal(run("pallas"), run("xla"))  # another random stream: auto did not take it
