"""Tests of the Pallas programs (specdec_jax/verify/fused.py, `rejection_sample(kernels="pallas")`).

On a CPU the kernels run in Pallas's interpreter (the same kernel code the GPU
compiles with Triton; a GPU run compared the two token for token,
bench/RESULTS.md), so these tests check the kernels' logic:

* the random numbers: threefry equals jax's, uniforms and exponentials follow their laws;
* `block_partials` + `combine_partials` against a NumPy reference, NaN, +-inf and thresholds included;
* losslessness by chi-square at every position (alpha = 1e-3, fixed seeds), through
  `rejection_sample` (one block, as the test vocabulary is small) and through `fused_chain`
  with blocks of 2 tokens (the two-stage draw over several blocks), and a planted bias that
  the same check rejects;
* greedy rows and `fused_greedy` equal the XLA program token for token;
* keys: one key is folded per row exactly as `row_keys` does; a row does not depend on its
  neighbours, nor on whether a neighbour filters (the run-time branch);
* the kernels lower to Triton for a CUDA target; the `kernels` argument's errors.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.extend.random
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import SamplingParams, rejection_sample
from specdec_jax.sampling.block_stats import (
  block_partials,
  block_thresholds,
  combine_partials,
  log_exponential,
  open_uniform,
  threefry2x32,
)
from specdec_jax.sampling.params import row_keys
from specdec_jax.verify import fused, plan
from tests.support import stats
from tests.support.lowering import cuda_module_text
from tests.support.optimized import optimized
from tests.support.sampling_reference import filtered_probs
from tests.verify.test_chain import CASES, K, V, _case_inputs, _check_case

# Rows per chi-square run in the default set: the interpreter runs a grid program at a time.
# 1000 rows, 8 bins: position 0 detects TV >= 0.082 at alpha = 1e-3 with 80% power
# (stats.detectable_deviation); the slow set runs 40,000 rows (TV >= 0.013).
FAST_ROWS = 1000
SLOW_ROWS = 40_000


# ----------------------------------------------------------------------------
# Random numbers
# ----------------------------------------------------------------------------


def test_threefry_is_jaxs_and_gives_the_known_answer():
  assert [int(w) for w in threefry2x32(*[jnp.uint32(0)] * 4)] == [0x6B200159, 0x99BA4EFE]  # Random123's KAT
  rng = np.random.default_rng(0)
  words = rng.integers(0, 2**32, (4, 64), dtype=np.uint64).astype(np.uint32)
  ours = np.stack([np.asarray(w) for w in threefry2x32(*words)])
  for i in range(64):
    theirs = jax.extend.random.threefry_2x32(jnp.asarray(words[:2, i]), jnp.asarray(words[2:, i]))
    np.testing.assert_array_equal(ours[:, i], np.asarray(theirs))


def test_uniforms_and_exponentials_follow_their_laws():
  bits = threefry2x32(jnp.uint32(7), jnp.uint32(9), jnp.uint32(1), jnp.arange(200_000, dtype=jnp.uint32))[0]
  u = np.asarray(open_uniform(bits))
  assert u.min() > 0 and u.max() < 1
  counts = np.histogram(u, bins=20, range=(0, 1))[0]
  stats.assert_gof([stats.chisquare_gof(np.repeat(np.arange(20), counts), np.full(20, 0.05), label="uniform")])
  e = np.exp(np.asarray(log_exponential(bits), np.float64))
  edges = np.concatenate([-np.log(1 - np.arange(20) / 20), [np.inf]])  # 20 equiprobable bins of Exp(1)
  counts = np.histogram(e, bins=edges)[0]
  stats.assert_gof([stats.chisquare_gof(np.repeat(np.arange(20), counts), np.full(20, 0.05), label="exponential")])
  assert float(log_exponential(jnp.uint32(0))) == pytest.approx(-33 * np.log(2), rel=1e-3)


# ----------------------------------------------------------------------------
# Per-block partials
# ----------------------------------------------------------------------------


def test_block_partials_combine_to_the_max_normaliser_and_argmax():
  rng = np.random.default_rng(3)
  b, pos, v = 4, 3, 50
  x = rng.normal(0, 3, (b * pos, v)).astype(np.float32)
  x[0, 7] = np.nan
  x[1] = -np.inf  # nothing above -inf: no mass, argmax 0
  x[2, [3, 40]] = np.inf  # two +inf tokens share the mass
  x[4, [10, 30]] = x[4].max() + 1  # a tie: the first index wins
  t = np.array([0.5, 1.0, 2.0, 0.0], np.float32)  # 0: greedy, scaled at 1
  thr = np.full((b, pos), -np.inf, np.float32)
  thr[3, 1] = 0.5  # row 10 keeps x / 1 >= 0.5 only
  thresholds = np.stack([np.zeros_like(thr), thr], axis=-1)
  m, mass, first = block_partials(
    jnp.asarray(x), jnp.asarray(t), jnp.asarray(thresholds), positions=pos, block=16, interpret=True
  )
  assert m.shape == (b * pos, 4)
  t_rows = np.repeat(np.where(t < 1e-5, 1.0, t), pos)[:, None]
  top, log_norm, argmax, log_mass = (np.asarray(a) for a in combine_partials(m, mass, first, jnp.asarray(t_rows)))
  for r in range(b * pos):
    xr = np.where(np.isnan(x[r]), -np.inf, x[r]).astype(np.float64)
    kept = xr / t_rows[r, 0] >= thr.reshape(-1)[r]
    xk = np.where(kept, xr, -np.inf)
    assert argmax[r] == int(np.argmax(xk)), r
    if r == 1:
      assert top[r] == -np.inf and log_norm[r] == -np.inf and argmax[r] == 0
      continue
    assert top[r] == xk.max()
    with np.errstate(invalid="ignore", divide="ignore"):  # inf - inf where the max is +inf; log of empty blocks
      shifted = np.where(xk == xk.max(), 0.0, (xk - xk.max()) / t_rows[r, 0])
      per_block = np.log(np.add.reduceat(np.exp(shifted), np.arange(0, v, 16)))
    np.testing.assert_allclose(log_norm[r], np.log(np.sum(np.exp(shifted))), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(log_mass[r], per_block, rtol=1e-5, atol=1e-6)
  assert log_norm[2] == pytest.approx(np.log(2.0))  # the two +inf tokens, nothing else


def test_block_thresholds_keep_the_sorted_searchs_tokens_and_redo_the_partials():
  # Blocks of 16 tokens with 4 candidates each: top-k 3 and narrow top-p are settled from the candidates,
  # top-k 60 and top-p over a flat row are not (the whole-row search). Ties, NaN, +-inf, greedy rows.
  rng = np.random.default_rng(7)
  pos, v, block, c = 3, 200, 16, 4
  top_k = np.array([3, 0, 60, 3, 0, 10, 0, 5], np.int32)
  top_p = np.array([1.0, 0.6, 1.0, 0.9, 0.95, 0.5, 1.0, 0.7], np.float32)
  t = np.array([1.0, 0.7, 2.0, 0.0, 1.5, 1.0, 1.0, 0.3], np.float32)  # row 3 is greedy: nothing filtered
  b = len(t)
  x = (rng.normal(0, 3, (b * pos, v))).astype(np.float32)
  x[12:15] = rng.normal(0, 0.05, (3, v))  # flat: top-p 0.95 keeps most tokens
  x[15:18] = rng.integers(-3, 3, (3, v))  # ties at the thresholds
  x[15, 5] = np.nan
  x[16] = -np.inf  # nothing above -inf
  x[17, [2, 50]] = np.inf
  args = (jnp.asarray(t), jnp.asarray(top_k), jnp.asarray(top_p))
  m, mass, first, cand = block_partials(
    jnp.asarray(x), args[0], None, args[1:], positions=pos, block=block, candidates=c, interpret=True
  )
  thresholds, m2, mass2 = block_thresholds(
    jnp.asarray(x), *args, m, mass, cand, positions=pos, block=block, interpret=True
  )
  thresholds = np.asarray(thresholds)
  tt = np.where(t < 1e-5, 1.0, t)
  settled = []
  for r in range(b * pos):
    q = r // pos
    shift, thr = thresholds[r]
    if t[q] < 1e-5 or (top_k[q] == 0 and top_p[q] >= 1.0):
      assert (shift, thr) == (0.0, -np.inf), r
      continue
    xr = np.where(np.isnan(x[r]), -np.inf, x[r])
    with np.errstate(invalid="ignore"):
      kept = np.where(xr == shift, 0.0, (xr - shift) / tt[q]) >= thr
    if r != 16:
      # The float64 reference's kept tokens (a -inf logit is never kept there: it has no probability).
      want = filtered_probs(x[r], temperature=tt[q], top_k=int(top_k[q]), top_p=float(top_p[q])) > 0
      np.testing.assert_array_equal(kept & (xr > -np.inf), want, err_msg=str(r))
    blocks = np.pad(xr, (0, -v % block), constant_values=-np.inf).reshape(-1, block)
    cth = np.sort(blocks, -1)[:, -c]  # each block's c-th largest: what the candidates cannot see below
    with np.errstate(invalid="ignore"):
      floor = np.max(np.where(cth > -np.inf, (cth - shift) / tt[q], -np.inf))
    settled.append(thr > floor)
  assert any(settled) and not all(settled)  # both paths ran
  # The redone partials are block_partials' for those thresholds.
  m3, mass3, _ = block_partials(
    jnp.asarray(x), args[0], jnp.asarray(thresholds.reshape(b, pos, 2)), positions=pos, block=block, interpret=True
  )
  np.testing.assert_array_equal(np.asarray(m2), np.asarray(m3))
  np.testing.assert_allclose(np.asarray(mass2), np.asarray(mass3), rtol=1e-5)


def test_greedy_partials_have_no_exponential():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(6, 40)), jnp.float32)
  text = str(jax.make_jaxpr(lambda a: block_partials(a, None, positions=3, block=16, interpret=True))(x))
  assert "exp" not in text
  m, first = block_partials(x, None, positions=3, block=16, interpret=True)
  m, first = np.asarray(m), np.asarray(first)
  for r in range(6):
    assert m[r].max() == np.asarray(x[r]).max()
    assert first[r][np.argmax(m[r])] == int(np.argmax(np.asarray(x[r])))


# ----------------------------------------------------------------------------
# Losslessness
# ----------------------------------------------------------------------------


def _run_pallas(name, rows, seed, block=None):
  """CASES[name] through the Pallas program: (token_ids, num_accepted, n, draft, t)."""
  case = CASES[name]
  draft, n, t = _case_inputs(case, rows, seed)
  logits = jnp.broadcast_to(jnp.asarray(case.logits, case.dtype), (rows, K + 1, V))
  q = None if case.q is None else jnp.broadcast_to(jnp.asarray(case.q), (rows, K, V))
  params = SamplingParams.create(t, top_k=case.top_k, top_p=case.top_p)
  keys = jax.random.split(jax.random.key(seed), rows)
  # Compiled at LLVM level 2 (tests/support/optimized.py): the interpreter's grid loop over 1000 rows runs ~9x faster.
  if block is None:
    out = optimized(rejection_sample, all_random=case.all_random, kernels="pallas")(
      draft,
      logits,
      params,
      keys,
      draft_probs=q,
      num_draft_tokens=jnp.asarray(n) if case.ragged else None,
    )
    ids, accepted = out.token_ids, out.num_accepted
  else:
    ids, accepted, _ = optimized(
      fused.fused_chain,
      greedy_rows="none" if case.all_random else "per_row",
      no_filters=False,
      block=block,
      interpret=True,
    )(
      jnp.asarray(draft),
      logits,
      params,
      keys,
      q,
      jnp.asarray(n) if case.ragged else None,
    )
  return np.asarray(ids), np.asarray(accepted), n, draft, t


# draft_probs over one block runs in the slow set: its fast test is over several blocks (below).
FAST_CASES = ("ngram_no_draft_probs", "ragged_rows_mixed_batch", "temperature_top_k_top_p_ties")


@pytest.mark.parametrize("name", FAST_CASES)
def test_lossless_chisquare(name):
  results = _check_case(CASES[name], *_run_pallas(name, FAST_ROWS, seed=0))
  stats.assert_gof(results)
  # Every position is tested (later ones see only the rows that accepted that far).
  assert len(results) >= K and all(r.num_samples >= 50 for r in results), [str(r) for r in results]


@pytest.mark.parametrize(
  "name",
  (
    "draft_probs",
    pytest.param("ngram_no_draft_probs", marks=pytest.mark.slow),
    pytest.param("ragged_rows_mixed_batch", marks=pytest.mark.slow),
  ),
)
def test_lossless_chisquare_over_several_blocks(name):
  # Blocks of 2 tokens: V = 8 in 4 blocks, so the block choice, the residual's block masses
  # and the draft's exclusion from its block are all exercised.
  stats.assert_gof(_check_case(CASES[name], *_run_pallas(name, FAST_ROWS, seed=1, block=2)))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("block", (None, 2))
def test_lossless_chisquare_slow(name, block):
  stats.assert_gof(_check_case(CASES[name], *_run_pallas(name, SLOW_ROWS, seed=5, block=block)))


@pytest.mark.slow
def test_planted_bias_is_rejected(monkeypatch):
  # Acceptance tests against u^0.7 instead of u (too generous): the same check must fail.
  jax.clear_caches()
  monkeypatch.setattr(fused, "open_uniform", lambda bits: open_uniform(bits) ** 0.7)
  try:
    results = _check_case(CASES["draft_probs"], *_run_pallas("draft_probs", FAST_ROWS, seed=0))
  finally:
    jax.clear_caches()
  assert min(r.pvalue for r in results) < stats.ALPHA, [str(r) for r in results]


# ----------------------------------------------------------------------------
# Greedy rows: token for token the XLA program's
# ----------------------------------------------------------------------------


def _greedy_problem(seed, b=24, k=3, v=40):
  rng = np.random.default_rng(seed)
  logits = rng.integers(-3, 3, (b, k + 1, v)).astype(np.float32)  # many ties
  logits[0, 1] = -np.inf
  logits[1, :, 5] = np.nan
  logits[2, 0] = np.nan
  logits[3, 2, [4, 9]] = np.inf
  best = np.argmax(np.where(np.isnan(logits), -np.inf, logits), -1)
  draft = np.where(rng.random((b, k)) < 0.75, best[:, :k], rng.integers(0, v, (b, k))).astype(np.int32)
  n = rng.integers(0, k + 1, b).astype(np.int32)
  return draft, jnp.asarray(logits), n


def _xla_greedy(draft, logits, n):
  # Under jit: NaN logits are the rule's business there (eagerly they are a ValueError).
  fn = jax.jit(
    lambda d, x, m: rejection_sample(
      d, x, SamplingParams.greedy(d.shape[0]), None, num_draft_tokens=m, all_greedy=True, kernels="xla"
    )
  )
  return fn(draft, logits, n)


@pytest.mark.parametrize("seed", (0, 1))
def test_fused_greedy_equals_the_xla_program(seed):
  draft, logits, n = _greedy_problem(seed)
  ref = _xla_greedy(draft, logits, n)
  for m in (n, None):
    want = ref if m is not None else _xla_greedy(draft, logits, np.full(len(n), draft.shape[1], np.int32))
    ids, accepted, emitted = fused.fused_greedy(jnp.asarray(draft), logits, m, block=16, interpret=True)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want.token_ids))
    np.testing.assert_array_equal(np.asarray(accepted), np.asarray(want.num_accepted))
    np.testing.assert_array_equal(np.asarray(emitted), np.asarray(want.num_accepted) + 1)


def test_greedy_rows_of_the_fused_program_equal_the_xla_program():
  draft, logits, n = _greedy_problem(2)
  params = SamplingParams.create(np.where(np.arange(len(n)) % 3 == 0, 1.0, 0.0).astype(np.float32))
  ids, accepted, _ = fused.fused_chain(
    jnp.asarray(draft),
    logits,
    params,
    jax.random.key(0),
    None,
    jnp.asarray(n),
    greedy_rows="per_row",
    no_filters=False,
    block=16,
    interpret=True,
  )
  ref = _xla_greedy(draft, logits, n)
  greedy = np.arange(len(n)) % 3 != 0
  np.testing.assert_array_equal(np.asarray(ids)[greedy], np.asarray(ref.token_ids)[greedy])
  np.testing.assert_array_equal(np.asarray(accepted)[greedy], np.asarray(ref.num_accepted)[greedy])


# ----------------------------------------------------------------------------
# Keys and neighbours
# ----------------------------------------------------------------------------


def _mixed_problem(seed=0, b=6, k=3, v=40):
  rng = np.random.default_rng(seed)
  logits = rng.normal(0, 2, (b, k + 1, v)).astype(np.float32)
  q = rng.dirichlet(np.ones(v), (b, k)).astype(np.float32)
  draft = rng.integers(0, v, (b, k)).astype(np.int32)
  return jnp.asarray(draft), jnp.asarray(logits), jnp.asarray(q)


def test_one_key_is_folded_into_rows_like_row_keys():
  draft, logits, q = _mixed_problem()
  params = SamplingParams.create([1.0, 0.0, 0.8, 1.0, 1.2, 1.0])
  run = lambda key: rejection_sample(draft, logits, params, key, draft_probs=q, kernels="pallas").token_ids
  key = jax.random.key(42)
  single = np.asarray(run(key))
  np.testing.assert_array_equal(np.asarray(run(row_keys(key, 6))), single)
  np.testing.assert_array_equal(np.asarray(run(jax.random.PRNGKey(42))), single)
  assert len({np.asarray(run(jax.random.key(s))).tobytes() for s in range(6)}) > 1  # and the key matters


def test_a_row_depends_on_neither_its_neighbours_nor_their_filters():
  draft, logits, q = _mixed_problem(1)
  keys = jax.random.split(jax.random.key(3), 6)
  t = np.array([1.0, 0.0, 0.8, 1.0, 1.2, 1.0], np.float32)
  calm = SamplingParams.create(t)
  filtering = SamplingParams.create(t, top_k=[0, 0, 0, 5, 0, 0], top_p=[1.0, 1.0, 1.0, 1.0, 1.0, 0.5])
  run = lambda p, rows: np.asarray(
    rejection_sample(draft[rows], logits[rows], p, keys[rows], draft_probs=q[rows], kernels="pallas").token_ids
  )
  everyone = np.arange(6)
  a, b = run(calm, everyone), run(filtering, everyone)  # the second batch takes the threshold search
  np.testing.assert_array_equal(a[:3], b[:3])
  perm = np.array([4, 0, 5, 2, 1, 3])
  np.testing.assert_array_equal(run(_take(calm, perm), perm), a[perm])


@pytest.mark.parametrize("draft_probs", (False, True))
def test_a_filtering_row_with_nothing_above_minus_inf_emits_token_zero(draft_probs):
  """Under jit (eagerly it raises): no distribution, so no draft is accepted and the token is 0, as in XLA's
  program, also when the row's top-k is on (its threshold search once counted the -inf candidates as mass)."""
  draft, logits, q = _mixed_problem()
  logits = logits.at[0].set(-jnp.inf)
  params = SamplingParams.create(np.ones(6, np.float32), top_k=[5, 0, 5, 0, 0, 0])
  sample = jax.jit(lambda *a: rejection_sample(*a, draft_probs=q if draft_probs else None, kernels="pallas"))
  out = sample(draft, logits, params, jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(out.token_ids[0]), [0, -1, -1, -1])
  assert int(out.num_accepted[0]) == 0


@pytest.mark.parametrize("filters", (False, True))
def test_block_residual_layouts_give_the_same_tokens(monkeypatch, filters):
  """Block verification's residual pass takes all of a row's positions per program, or one when the batch has few
  (row, block) programs: the two layouts compute the same masses, so the same tokens for the same keys."""
  b = 48
  draft, logits, q = _mixed_problem(2, b=b, k=4, v=40)
  t = np.tile(np.float32([1.0, 0.0, 0.8, 1.2]), b // 4)
  top_k, top_p = (np.tile([0, 5, 0], b // 3), np.tile(np.float32([1.0, 1.0, 0.7]), b // 3)) if filters else (0, 1.0)
  params = SamplingParams.create(t, top_k=top_k, top_p=top_p)
  runs = {}
  for few in (0, 10**9):  # every program all positions; every program one position
    monkeypatch.setattr(fused, "_FEW_PROGRAMS", few)
    # fused_chain's trace reads the constant (in its own body, not in a jitted callee): dropping fused_chain's
    # compiled programs makes it trace the new layout. Not jax.clear_caches(), which would also drop every
    # program this worker compiled before (the other tests' shared ones, compiled again after this test).
    fused.fused_chain.clear_cache()
    sample = functools.partial(
      fused.fused_chain, greedy_rows="per_row", no_filters=False, method="block", block=8, interpret=True
    )
    runs[few] = [
      np.asarray(sample(draft, logits, params, key, q, None)[0]) for key in jax.random.split(jax.random.key(7), 3)
    ]
  fused.fused_chain.clear_cache()  # no later caller gets a program of the patched constant
  for a, b in zip(runs[0], runs[10**9]):
    np.testing.assert_array_equal(a, b)
  assert len({r.tobytes() for r in runs[0]}) > 1  # the keys matter: the rows are not all decided alike


def _take(params, rows):
  return dataclasses.replace(params, **{f: getattr(params, f)[rows] for f in ("temperature", "top_k", "top_p")})


# ----------------------------------------------------------------------------
# Lowering and arguments
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("greedy_rows", ("per_row", "none"))
@pytest.mark.parametrize("draft_probs", (False, True))
def test_triton_lowering(draft_probs, greedy_rows):
  """The kernels lower to Triton IR for a CUDA target (what the GPU compiles); no GPU needed for this step.
  greedy_rows "none" is `all_random=True` (the kernels then know no row is greedy)."""
  s = jax.ShapeDtypeStruct
  b, k, v = 2, 4, 151936
  args = [s((b, k), jnp.int32), s((b, k + 1, v), jnp.float32), s((b,), jnp.float32)]
  args += [s((b, k, v), jnp.float32)] if draft_probs else []

  def sample(d, x, t, *q, method="token"):
    params = SamplingParams.create(t, top_k=jnp.zeros((b,), jnp.int32), top_p=jnp.ones((b,), jnp.float32))
    return fused.fused_chain(
      d,
      x,
      params,
      jax.random.key(0),
      q[0] if q else None,
      None,
      greedy_rows=greedy_rows,
      no_filters=False,
      method=method,
    )

  text = cuda_module_text(jax.jit(sample), args)
  names = ["sampler_block_partials", "sampler_thresholds", "sampler_accept_and_draw"]
  names += ["sampler_residual_masses"] if draft_probs else []
  for name in names:
    assert name in text, f"expected the {name} kernel as a Triton custom call"
  if draft_probs:  # block verification's residual pass, all positions per program (2 x 75 programs)
    block = cuda_module_text(jax.jit(functools.partial(sample, method="block")), args)
    assert "sampler_residual_masses" in block
  greedy = cuda_module_text(jax.jit(lambda d, x: fused.fused_greedy(d, x, None)), args[:2])
  for name in ("sampler_greedy_bonus", "sampler_greedy_emit"):  # after XLA's argmax of positions 0..K-1
    assert name in greedy


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("draft_probs", [False, True])
def test_default_program_has_no_branch_outside_its_kernels(method, draft_probs):
  """No promise given: the filters are decided inside a kernel, so the CUDA program holds no run-time branch
  (a `lax.cond` there is a host round trip or a conditional command buffer per call)."""
  s = jax.ShapeDtypeStruct
  b, k, v = 2, 4, 4096
  args = [s((b, k), jnp.int32), s((b, k + 1, v), jnp.float32), s((b,), jnp.float32), s((b,), jnp.int32)]
  args += [s((b, k, v), jnp.float32)] if draft_probs else []

  def sample(d, x, t, top_k, *q):  # fused_chain itself: off a GPU, rejection_sample picks the interpreter
    params = SamplingParams.create(t, top_k=top_k, top_p=jnp.ones((b,), jnp.float32))
    return fused.fused_chain(
      d, x, params, jax.random.key(0), q[0] if q else None, None, greedy_rows="per_row", no_filters=False, method=method
    )

  text = cuda_module_text(jax.jit(sample), args)
  assert "sampler_thresholds" in text and "sampler_accept_and_draw" in text
  assert "stablehlo.case" not in text and "stablehlo.if" not in text and "stablehlo.while" not in text


def test_kernels_argument_is_checked():
  draft, logits, q = _mixed_problem()
  params = SamplingParams.create(np.ones(6, np.float32))
  with pytest.raises(ValueError, match="kernels must be one of"):
    rejection_sample(draft, logits, params, jax.random.key(0), kernels="cuda")
  with pytest.raises(ValueError, match="does not cover logprobs"):
    rejection_sample(draft, logits, params, jax.random.key(0), logprobs="raw", kernels="pallas")
  with pytest.raises(ValueError, match="does not cover min-p"):
    rejection_sample(
      draft, logits, SamplingParams.create(np.ones(6, np.float32), min_p=0.1), jax.random.key(0), kernels="pallas"
    )


def test_auto_is_the_xla_program_off_a_gpu():
  params = SamplingParams.create(1.0)
  p = plan.chain_plan(params, vocab=4096, local_vocab=4096, kernels="auto")
  assert p.kernels == ("pallas" if jax.default_backend() == "gpu" else "xla")
  assert plan.chain_plan(params, vocab=4096, local_vocab=4096, kernels="pallas").paths() == (
    "pallas",
    "pallas threshold search",
  )


def test_auto_on_a_gpu_keeps_xla_argmax_only_for_the_smallest_greedy_batches(monkeypatch):
  monkeypatch.setattr(plan.jax, "default_backend", lambda: "gpu")
  greedy = SamplingParams.greedy(1)
  kernels = lambda b, **kw: plan.chain_plan(greedy, vocab=4096, local_vocab=4096, kernels="auto", batch=b, **kw).kernels
  small = plan.PALLAS_GREEDY_MIN_ROWS - 1
  assert kernels(small, all_greedy=True) == "xla"
  assert kernels(plan.PALLAS_GREEDY_MIN_ROWS, all_greedy=True) == "pallas"
  assert kernels(small) == "pallas"  # a batch that may sample takes the Pallas program at any size
