"""Tests of specdec_jax/verify/chain.py (`rejection_sample`), against the `rejection_sample` contract (docs/api.md).

* Exact tables for greedy verification, in every mode (static flag, run-time
  greedy batch, greedy rows of a mixed batch), and the static flags' overrides.
* The compiled programs: the greedy one holds no exponential, random bits or
  probability tensor; the random one no argmax over the vocabulary; sorts only
  under a run-time condition.
* Losslessness, statistically: a chi-square test at every position, bonus
  included (alpha = 1e-3, fixed seeds), plus a planted wrong sampler that the
  same check must reject.
* Hypothesis invariants, batch invariance and keys, no retracing, bad inputs.

Compiling a sampler program takes seconds on a CPU, so tests share a few shapes:
[B, K+1, V] = [4, 4, 8] (and [4, 1, 8] for K = 0) for small batches and
[40000, 4, 8] for the statistical ones.
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import PLACEHOLDER_TOKEN_ID, RejectionOutput, SamplingParams, rejection_sample
from specdec_jax.sampling.params import GREEDY_TEMPERATURE
from tests.support import stats
from tests.support.compiles import count_compiles

K, V, B = 3, 8, 4  # the shared small shape: draft [4, 3], logits [4, 4, 8]

# Temperatures below this are greedy; used only to say which rows the references
# treat as greedy.
_GREEDY_T = GREEDY_TEMPERATURE


def _keys(seed, b=B):
  return jax.random.split(jax.random.key(seed), b)


def _run(draft, logits, params, key=None, draft_probs=None, n=None, **flags) -> RejectionOutput:
  out = rejection_sample(
    draft_token_ids=draft,
    target_logits=logits,
    params=params,
    key=key,
    draft_probs=draft_probs,
    num_draft_tokens=n,
    **flags,
  )
  return jax.tree_util.tree_map(np.asarray, out)


def _random_inputs(seed, b=B, k=K, v=V, *, probs=True):
  rng = np.random.default_rng(seed)
  logits = rng.normal(0, 1.5, (b, k + 1, v)).astype(np.float32)
  draft = rng.integers(0, v, (b, k)).astype(np.int32)
  q = rng.dirichlet(np.ones(v), (b, k)).astype(np.float32) if probs else None
  return draft, logits, q


# ----------------------------------------------------------------------------
# Greedy: exact tables
# ----------------------------------------------------------------------------


def _table_logits(targets, v=V, seed=0):
  """[len(targets), V] logits with argmax targets[i] at position i; a tuple
  gives tied maxima (the first index must win)."""
  x = np.random.default_rng(seed).uniform(-2.0, 0.0, (len(targets), v)).astype(np.float32)
  for i, t in enumerate(targets):
    x[i, list(np.atleast_1d(t))] = 3.0
  return x


# (draft ids, argmax per position (tuple = tie), num_draft_tokens, expected tokens, expected num_accepted)
_T = [1, 2, 3, 4]
GREEDY_TABLE = [
  pytest.param([1, 2, 3], _T, None, [1, 2, 3, 4], 3, id="perfect_match_all_accepted_plus_bonus"),
  pytest.param([1, 5, 3], _T, None, [1, 2, -1, -1], 1, id="early_mismatch"),
  pytest.param([0, 2, 3], _T, None, [1, -1, -1, -1], 0, id="first_position_mismatch"),
  pytest.param([1, 2, 0], _T, None, [1, 2, 3, -1], 2, id="last_position_mismatch"),
  pytest.param([1, 2, 3], _T, 0, [1, -1, -1, -1], 0, id="empty_drafts_n0_bonus_from_position_0"),
  pytest.param([1, 2, 3], _T, 1, [1, 2, -1, -1], 1, id="ragged_n1_bonus_from_position_1"),
  pytest.param([1, 2, 7], _T, 2, [1, 2, 3, -1], 2, id="ragged_n2_bonus_from_position_2"),
  pytest.param([1, 6, 3], _T, 2, [1, 2, -1, -1], 1, id="ragged_n2_mismatch"),
  pytest.param([2, 2, 3], [(2, 5), 2, 3, 4], None, [2, 2, 3, 4], 3, id="tie_first_index_accepted"),
  pytest.param([5, 2, 3], [(2, 5), 2, 3, 4], None, [2, -1, -1, -1], 0, id="tie_later_index_rejected"),
  pytest.param([1, 2, 3], [1, 2, 3, (6, 4)], None, [1, 2, 3, 4], 3, id="tie_in_bonus_position"),
  pytest.param([1, -1, -1], _T, 1, [1, 2, -1, -1], 1, id="minus_one_past_n_ignored"),
  pytest.param([1, 2, 99], _T, 2, [1, 2, 3, -1], 2, id="out_of_range_past_n_ignored"),
  pytest.param([-1, -7, 1000], _T, 0, [1, -1, -1, -1], 0, id="garbage_everywhere_n0"),
  pytest.param([3, 3, 3], [3, 3, 3, 3], None, [3, 3, 3, 3], 3, id="repeated_token"),
  pytest.param([0, 0, 0], [(0, 1, 2, 3, 4, 5, 6, 7)] * 4, None, [0, 0, 0, 0], 3, id="all_tied_rows"),
]


def _table_rows(cases):
  """Stacks table cases into one ragged batch: draft, logits, n, expected, acc."""
  draft = np.array([c.values[0] for c in cases], np.int32)
  logits = np.stack([_table_logits(c.values[1], seed=i) for i, c in enumerate(cases)])
  n = np.array([K if c.values[2] is None else c.values[2] for c in cases], np.int32)
  return draft, logits, n, np.array([c.values[3] for c in cases]), np.array([c.values[4] for c in cases])


@pytest.mark.parametrize("mode", ["all_greedy_flag", "runtime_all_temperatures_zero", "greedy_rows_of_mixed_batch"])
@pytest.mark.parametrize("index", range(len(GREEDY_TABLE)), ids=[c.id for c in GREEDY_TABLE])
def test_greedy_table(index, mode):
  # The case under test is row 0; rows 1-3 hold the next cases of the table (a
  # ragged batch), or random rows at T = 1 in the mixed mode.
  cases = [GREEDY_TABLE[(index + i) % len(GREEDY_TABLE)] for i in range(B)]
  draft, logits, n, expected, acc = _table_rows(cases)
  t = np.zeros(B, np.float32)
  if mode == "greedy_rows_of_mixed_batch":
    t[1::2] = 1.0  # rows 1 and 3 are random
  params = SamplingParams.create(t)
  if mode == "all_greedy_flag":
    out = _run(draft, logits, params, key=None, n=n, all_greedy=True)
  else:
    out = _run(draft, logits, params, key=_keys(index), n=n)
  rows = np.flatnonzero(t == 0)
  np.testing.assert_array_equal(out.token_ids[rows], expected[rows])
  np.testing.assert_array_equal(out.num_accepted[rows], acc[rows])
  np.testing.assert_array_equal(out.num_emitted[rows], acc[rows] + 1)
  ref_tokens, ref_acc = stats.greedy_reference(draft, logits, n)  # the table agrees with the reference
  np.testing.assert_array_equal(ref_tokens[rows], expected[rows])
  assert out.token_ids.dtype == np.int32 and out.num_accepted.dtype == np.int32


@pytest.mark.parametrize("mode", ["all_greedy_flag", "runtime_all_temperatures_zero", "greedy_rows_of_mixed_batch"])
def test_greedy_k0_emits_the_argmax(mode):
  # K = 0: no drafts at all; every row emits argmax(target_logits[b, 0]).
  logits = np.stack([_table_logits([t], seed=i) for i, t in enumerate([3, (2, 6), 0, 7])])
  draft = np.zeros((B, 0), np.int32)
  t = np.array([0.0, 0.0, 1.0, 0.0] if mode == "greedy_rows_of_mixed_batch" else [0.0] * B, np.float32)
  flags = dict(all_greedy=True) if mode == "all_greedy_flag" else {}
  out = _run(draft, logits, SamplingParams.create(t), key=_keys(0), **flags)
  rows = np.flatnonzero(t == 0)
  np.testing.assert_array_equal(out.token_ids[rows, 0], np.array([3, 2, 0, 7])[rows])
  np.testing.assert_array_equal(out.num_accepted, 0)
  np.testing.assert_array_equal(out.num_emitted, 1)
  chex.assert_shape(out.token_ids, (B, 1))


def test_greedy_random_inputs_match_reference_in_every_mode():
  rng = np.random.default_rng(11)
  for seed in range(3):
    draft, logits, _ = _random_inputs(seed, probs=False)
    logits = np.round(logits)  # ties
    # Make acceptance likely: drafts copy the argmax most of the time.
    am = np.argmax(logits, -1)[:, :K]
    draft = np.where(rng.random((B, K)) < 0.7, am, draft).astype(np.int32)
    n = rng.integers(0, K + 1, B).astype(np.int32)
    ref, ref_acc = stats.greedy_reference(draft, logits, n)
    for flags, t in [
      ({"all_greedy": True}, [0.7, 1.0, 0.0, 2.0]),  # the flag overrides T
      ({}, [0.0, 0.0, 0.0, 0.0]),
      ({}, [0.0, 1e-7, 1e-6, 0.0]),
    ]:
      out = _run(draft, logits, SamplingParams.create(np.float32(t)), key=_keys(seed), n=n, **flags)
      np.testing.assert_array_equal(out.token_ids, ref)
      np.testing.assert_array_equal(out.num_accepted, ref_acc)


def test_all_greedy_flag_needs_no_key_and_ignores_sampling_params():
  draft, logits, q = _random_inputs(1)
  params = SamplingParams.create([1.0, 0.5, 2.0, 0.9], top_k=[0, 2, 1, 0], top_p=[1.0, 0.5, 1.0, 0.3])
  ref, ref_acc = stats.greedy_reference(draft, logits)
  for key, probs in [(None, None), (_keys(0), None), (None, q)]:
    out = _run(draft, logits, params, key=key, draft_probs=probs, all_greedy=True)
    np.testing.assert_array_equal(out.token_ids, ref)
    np.testing.assert_array_equal(out.num_accepted, ref_acc)


def test_all_random_flag_treats_zero_temperature_rows_as_random():
  # Documented in sampling.scale_logits: greedy rows are processed at T = 1.
  draft, logits, q = _random_inputs(2)
  logits[:] = logits[:1]  # every row has the same target and drafts
  draft[:] = draft[:1]
  q[:] = q[:1]
  firsts = set()
  for seed in range(12):
    key = jax.random.key(seed)
    zero = _run(draft, logits, SamplingParams.create([0.0, 0.0, 1e-7, 0.0]), key=key, draft_probs=q, all_random=True)
    one = _run(draft, logits, SamplingParams.create([1.0] * B), key=key, draft_probs=q, all_random=True)
    np.testing.assert_array_equal(zero.token_ids, one.token_ids)
    firsts.update(zero.token_ids[np.arange(B), zero.num_accepted].tolist())
  assert len(firsts) > 1, "T=0 rows under all_random=True behave greedily"


# ----------------------------------------------------------------------------
# The compiled programs
# ----------------------------------------------------------------------------

# Distinct sizes so that shapes in the program text are unambiguous.
_HB, _HK, _HV = 3, 4, 37
_LOGITS_SHAPE = f"f32[{_HB},{_HK + 1},{_HV}]"
_POSITIONS_SHAPE = f"s32[{_HB},{_HK + 1}]"


@functools.lru_cache(maxsize=None)
def _compiled(all_greedy=False, all_random=False) -> stats.HloProgram:
  def fn(draft, logits, params, key):
    return rejection_sample(
      draft_token_ids=draft, target_logits=logits, params=params, key=key, all_greedy=all_greedy, all_random=all_random
    )

  args = (
    jnp.zeros((_HB, _HK), jnp.int32),
    jnp.zeros((_HB, _HK + 1, _HV), jnp.float32),
    SamplingParams.create(jnp.ones(_HB)),
    _keys(0, _HB),
  )
  return stats.HloProgram(jax.jit(fn).lower(*args).compile().as_text())


def _expensive_ops(prog, computations=None):
  ops = prog.opcodes(computations)
  return ops & ({"exponential", "log", "sort"} | stats.RANDOM_OPCODES)


def _vocab_argmax_reduces(prog, computations=None):
  """Reductions over the vocabulary that return an s32 [B, K+1] index (argmax)."""
  return [
    i
    for i in prog.instructions(computations)
    if i.opcode == "reduce" and i.shape.startswith("(") and _POSITIONS_SHAPE in i.shape
  ]


def test_all_greedy_program_has_no_softmax_random_bits_or_probability_tensor():
  prog = _compiled(all_greedy=True)
  assert not _expensive_ops(prog), _expensive_ops(prog)
  assert "conditional" not in prog.opcodes()
  assert prog.op_names()
  for marker in ("threefry", "random", "rng", "softmax", "logsumexp"):
    assert not prog.mentions(marker), marker
  steps = {part for name in prog.op_names() for part in name.split("/")}
  assert not steps & {"exp", "log", "sort", "cumsum", "cumlogsumexp"}, steps
  # The only [B, K+1, V] float values are the input parameter itself.
  big = [(i.name, i.opcode) for i in prog.instructions() if i.shape.startswith(_LOGITS_SHAPE)]
  assert big and all(op == "parameter" for _, op in big), big
  assert _vocab_argmax_reduces(prog), "the argmax reduction was not recognised"


def test_all_random_program_has_no_vocab_argmax_and_sorts_only_conditionally():
  prog = _compiled(all_random=True)
  ops = prog.opcodes()
  assert {"exponential", "sort"} <= ops and ops & stats.RANDOM_OPCODES  # the checks below see real ops
  assert prog.mentions("threefry") or prog.mentions("random_bits")
  assert not _vocab_argmax_reduces(prog), _vocab_argmax_reduces(prog)
  # The sort of top-k/top-p lives only in a conditional branch: a batch that
  # filters nothing never runs it.
  assert "sort" not in prog.opcodes(prog.reachable(through_conditionals=False))


def test_default_program_greedy_batches_skip_softmax_at_run_time():
  prog = _compiled()
  always = prog.reachable(through_conditionals=False)
  assert not _expensive_ops(prog, always), _expensive_ops(prog, always)
  # One run-time conditional: a branch without exponential/random bits/sort (all
  # rows greedy) and a branch with them.
  found = False
  for ins, branches in prog.conditionals(always):
    kinds = [bool(_expensive_ops(prog, prog.reachable(b))) for b in branches]
    found |= (False in kinds) and (True in kinds)
  assert found, "no conditional with an argmax-only branch"
  assert _vocab_argmax_reduces(prog)  # mixed batches need the argmax


def test_programs_differ():
  texts = {_compiled(all_greedy=True).text, _compiled(all_random=True).text, _compiled().text}
  assert len(texts) == 3


# ----------------------------------------------------------------------------
# Losslessness: chi-square at every position
# ----------------------------------------------------------------------------
#
# For a target whose logits do not depend on the prefix, losslessness says: at
# every position j, the token emitted there by the rows that reached j (their
# drafts 0..j-1 were accepted and j <= n) is distributed as p_j, the processed
# target distribution: accepted drafts, recovered tokens and the bonus (j = n)
# together. Drafts are drawn from q_j afresh for every row, and
# every row has its own key, so rows are independent trials.
#
# Power (stats.detectable_deviation, alpha = 1e-3, 80% power; any alternative
# with total-variation distance >= w/2 from p_j is rejected that often). Fast set,
# 40,000 rows, 8 bins: position 0 detects TV >= 0.013; the bonus position 3
# (9-13k rows reach it) TV >= 0.022-0.025; the n-gram case's position 3 and the
# ragged case's per-n cells (2-9k rows) TV >= 0.028-0.055. The slow set has 25x
# the rows (1,000,000): 5x smaller (0.0026 at position 0, 0.0045-0.005 at the bonus).
# Each check's label carries its own number; `test_power_of_the_fast_checks`
# pins the headline ones.

FAST_ROWS = 40_000
SLOW_CHUNKS = 25  # the slow set runs FAST_ROWS rows SLOW_CHUNKS times (one program): 1,000,000 rows


def _q(rng, logits, zero=()):
  # Half the target's softmax, half noise: acceptance ~0.7-0.8 per position.
  z = np.exp(logits[:K] - logits[:K].max(-1, keepdims=True))
  q = 0.5 * z / z.sum(-1, keepdims=True) + 0.5 * rng.dirichlet(np.full(V, 0.7), K)
  for pos, tok in zero:
    q[pos, tok] = 0.0
  return (q / q.sum(-1, keepdims=True)).astype(np.float32)


_RNG = np.random.default_rng(1234)
# Prefix-independent target: [K+1, V] logits; -inf marks masked tokens.
_LOGITS = _RNG.normal(0, 1.2, (K + 1, V)).astype(np.float32)
_LOGITS[1, 6] = -np.inf
_LOGITS[3, 0] = -np.inf
# Draft distributions: token 2 is never drafted at position 0 (it must come from
# the residual), and the masked token 6 may be drafted at position 1 (p = 0).
_QS = _q(_RNG, _LOGITS, zero=[(0, 2), (2, 5)])
assert _QS[1, 6] > 0.02
# Logits with ties at the top-k and top-p boundaries (permuted per position).
_TIED = np.array([2.0, 1.5, 1.5, 1.0, 0.7, 0.7, 0.0, -1.0], np.float32)
_LOGITS_TIED = np.stack([_RNG.permutation(_TIED) for _ in range(K + 1)])
_QS_WIDE = _q(_RNG, _LOGITS_TIED)
_LOGITS_BF16 = np.asarray(jnp.asarray(_RNG.normal(0, 1.3, (K + 1, V)) + 0.01, jnp.bfloat16).astype(jnp.float32))
_QS_BF16 = _q(_RNG, _LOGITS_BF16)
# n-gram drafts (no probabilities), three kinds of rows: likely drafts, a draft
# the target masks (p(d) = 0, always rejected), unlikely drafts.
_NGRAM_DRAFTS = np.array(
  [
    np.argsort(-_LOGITS[:K], axis=-1)[:, 0],
    [np.argsort(-_LOGITS[0])[1], 6, 1],
    np.argmin(np.where(np.isfinite(_LOGITS[:K]), _LOGITS[:K], np.inf), axis=-1),  # least likely
  ],
  np.int32,
)


@dataclasses.dataclass(frozen=True)
class LosslessCase:
  name: str
  logits: np.ndarray  # [K+1, V]
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  q: np.ndarray | None = None  # [K, V]: drafts drawn from it; None: n-gram drafts
  dtype: object = jnp.float32
  ragged: bool = False  # random num_draft_tokens, garbage past n, 1 row in 8 greedy
  all_random: bool = False

  def expected(self):
    """[K+1, V] float64 processed target distribution p_j."""
    logits = np.asarray(jnp.asarray(self.logits, self.dtype).astype(jnp.float32))
    probs, near = stats.reference_probs(logits, self.temperature, self.top_k, self.top_p, boundary_tol=1e-4)
    assert not np.any(near), "test case too close to a top-p boundary"
    return probs


CASES = {
  c.name: c
  for c in [
    LosslessCase("draft_probs", _LOGITS, q=_QS),
    LosslessCase("ngram_no_draft_probs", _LOGITS),
    # top-k = 5 keeps 6 tokens (a tie at the 5th); top-p = 0.6 is reached at the
    # first of two tied tokens and keeps both.
    LosslessCase("temperature_top_k_top_p_ties", _LOGITS_TIED, temperature=0.7, top_k=5, top_p=0.6, q=_QS_WIDE),
    LosslessCase(
      "all_random_temperature_top_k_top_p",
      _LOGITS_TIED,
      temperature=1.3,
      top_k=5,
      top_p=0.95,
      q=_QS_WIDE,
      all_random=True,
    ),
    LosslessCase("bf16_logits", _LOGITS_BF16, temperature=0.9, q=_QS_BF16, dtype=jnp.bfloat16),
    LosslessCase("ragged_rows_mixed_batch", _LOGITS, q=_QS, ragged=True),
  ]
}


def _draw_drafts(rng, q, rows):
  """Independent draws d[b, i] ~ q[i] by inverse CDF (float64)."""
  cdf = np.cumsum(q.astype(np.float64), axis=-1)
  u = rng.random((rows, q.shape[0])) * cdf[:, -1]
  return np.stack([np.searchsorted(cdf[i], u[:, i], side="right") for i in range(q.shape[0])], 1).astype(np.int32)


def _case_inputs(case, rows, seed):
  rng = np.random.default_rng(seed)
  if case.q is None:
    draft = _NGRAM_DRAFTS[np.arange(rows) % len(_NGRAM_DRAFTS)]
  else:
    draft = _draw_drafts(rng, case.q, rows)
  n = np.full(rows, K, np.int32)
  t = np.full(rows, case.temperature, np.float32)
  if case.ragged:
    n = rng.integers(0, K + 1, rows).astype(np.int32)
    past = np.arange(K)[None, :] >= n[:, None]
    draft = np.where(past, rng.choice([-1, V, 2 * V, 0], (rows, K)), draft).astype(np.int32)
    t[::8] = 0.0
  return draft, n, t


@functools.lru_cache(maxsize=4)
def _run_case(name, rows, seed):
  """Runs CASES[name] on `rows` rows: (token_ids, num_accepted, n, draft, t)."""
  case = CASES[name]
  draft, n, t = _case_inputs(case, rows, seed)
  logits = jnp.broadcast_to(jnp.asarray(case.logits, case.dtype), (rows, K + 1, V))
  q = None if case.q is None else jnp.broadcast_to(jnp.asarray(case.q), (rows, K, V))
  params = SamplingParams.create(t, top_k=case.top_k, top_p=case.top_p)
  out = _run(
    draft,
    logits,
    params,
    key=_keys(seed, rows),
    draft_probs=q,
    n=n if case.ragged else None,
    all_random=case.all_random,
  )
  return out.token_ids, out.num_accepted, n, draft, t


def positionwise_gof(token_ids, num_accepted, num_draft_tokens, probs, *, per_n=False, label=""):
  """Chi-square results, one per position j (and per n value if per_n): the
  tokens emitted at j by rows that reached it (num_accepted >= j, j <= n)
  against probs[j]."""
  results = []
  groups = (
    [(f"n={m}", num_draft_tokens == m) for m in np.unique(num_draft_tokens)]
    if per_n
    else [("", np.ones(len(num_accepted), bool))]
  )
  for gname, rows in groups:
    for j in range(probs.shape[0]):
      reach = rows & (num_accepted >= j) & (num_draft_tokens >= j)
      if not reach.any():
        continue
      samples = token_ids[reach, j]
      r = stats.chisquare_gof(samples, probs[j], label=f"{label} {gname} position {j}")
      if r.num_bins >= 2:
        _, tv = stats.detectable_deviation(r.num_samples, r.num_bins)
        r = dataclasses.replace(r, label=f"{r.label} (detects TV>={tv:.4f})")
      results.append(r)
  return results


def _check_case(case, token_ids, num_accepted, n, draft, t):
  probs = case.expected()
  random_rows = t >= _GREEDY_T if not case.all_random else np.ones(len(t), bool)
  # Structure and masking, on every row.
  assert np.all(num_accepted <= n)
  for j in range(K + 1):
    emitted = token_ids[:, j] >= 0
    assert np.all(emitted == (num_accepted >= j)), f"position {j}: placeholders out of place"
    tok = token_ids[emitted & random_rows, j]
    assert np.all(probs[j][tok] > 0), f"position {j}: emitted a token the target excludes (masked/filtered)"
  results = positionwise_gof(
    token_ids[random_rows], num_accepted[random_rows], n[random_rows], probs, per_n=case.ragged, label=case.name
  )
  if case.ragged:  # the greedy rows of the mixed batch: exact
    g = ~random_rows
    logits = np.broadcast_to(case.logits, (int(g.sum()), K + 1, V))
    ref, ref_acc = stats.greedy_reference(draft[g], logits, n[g])
    np.testing.assert_array_equal(token_ids[g], ref)
    np.testing.assert_array_equal(num_accepted[g], ref_acc)
  return results


@pytest.mark.parametrize("name", list(CASES))
def test_lossless_chisquare(name):
  case = CASES[name]
  results = _check_case(case, *_run_case(name, FAST_ROWS, seed=0))
  stats.assert_gof(results)
  # Every position, the bonus included, was tested with a useful sample.
  assert all(r.num_samples >= 1500 for r in results), [str(r) for r in results]
  assert len(results) == ((K + 1) * (K + 2) // 2 if case.ragged else K + 1)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_lossless_chisquare_slow(name):
  case = CASES[name]
  runs = [_run_case(name, FAST_ROWS, seed=100 + s) for s in range(SLOW_CHUNKS)]
  token_ids, num_accepted, n, draft, t = (np.concatenate(parts) for parts in zip(*runs))
  stats.assert_gof(_check_case(case, token_ids, num_accepted, n, draft, t))


def test_ngram_draft_masked_by_target_is_always_rejected():
  token_ids, num_accepted, n, draft, t = _run_case("ngram_no_draft_probs", FAST_ROWS, seed=0)
  masked_rows = np.all(draft == _NGRAM_DRAFTS[1], axis=1)
  assert masked_rows.any() and np.all(num_accepted[masked_rows] <= 1)
  assert not np.any(token_ids[masked_rows, 1] == 6)


def test_draft_with_zero_draft_probability():
  # q(d) = 0 gives an infinite ratio: accepted iff p(d) > 0. With p(d) = q(d) = 0
  # the draft is rejected and the recovered token ~ normalise(max(p - q, 0)).
  rows = FAST_ROWS
  q = _QS.copy()
  q[1, 6] = 0.0  # p_1(6) = 0 too: token 6 is masked at position 1
  q[1] /= q[1].sum()
  draft = np.tile(np.array([2, 6, 1], np.int32), (rows, 1))  # q_0(2) = 0 < p_0(2)
  assert _QS[0, 2] == 0 and np.isinf(_LOGITS[1, 6])
  logits = jnp.broadcast_to(jnp.asarray(_LOGITS), (rows, K + 1, V))
  out = _run(
    draft,
    logits,
    SamplingParams.create(np.ones(rows, np.float32)),
    key=_keys(7, rows),
    draft_probs=jnp.broadcast_to(jnp.asarray(q), (rows, K, V)),
  )
  np.testing.assert_array_equal(out.num_accepted, 1)
  np.testing.assert_array_equal(out.token_ids[:, 0], 2)
  p1 = stats.reference_probs(_LOGITS[1], 1.0)
  stats.assert_gof(stats.chisquare_gof(out.token_ids[:, 1], stats.residual_probs(p1, q[1]), label="recovered"))


def test_power_of_the_fast_checks():
  # The smallest deviations the fast chi-square checks detect at 80% power
  # (see the comment above FAST_ROWS).
  w, tv = stats.detectable_deviation(FAST_ROWS, 8)
  assert 0.012 < tv < 0.014 and abs(w - 2 * tv) < 1e-12, tv
  _, tv_bonus = stats.detectable_deviation(10_000, 8)
  assert tv_bonus < 0.027, tv_bonus
  _, tv_slow = stats.detectable_deviation(FAST_ROWS * SLOW_CHUNKS, 8)
  assert tv_slow < 0.003, tv_slow
  # Sanity of the power formula: a deviation of that size is rejected about 80%
  # of the time at N = 2,000 (Monte Carlo over 400 simulated tests).
  rng = np.random.default_rng(0)
  p = np.array([0.3, 0.2, 0.2, 0.1, 0.1, 0.05, 0.05])
  w_small, _ = stats.detectable_deviation(2000, p.size)
  sign = np.array([1, -1, 1, -1, 1, -1, 0.0])
  direction = p * (sign - np.sum(p * sign))  # sums to 0
  direction *= w_small / np.sqrt(np.sum(direction**2 / p))
  rejected = np.mean(
    [stats.chisquare_gof(rng.choice(p.size, 2000, p=p + direction), p).pvalue < stats.ALPHA for _ in range(400)]
  )
  assert 0.7 < rejected < 0.9, rejected


# ----------------------------------------------------------------------------
# Planted wrong samplers: the same check must reject them
# ----------------------------------------------------------------------------


def numpy_rejection_sampler(draft, p, q, rng, *, mistake=None):
  """Rejection sampling in NumPy for a fixed target p [K+1, V] and drafts
  draft [N, K] drawn from q [K, V]. `mistake` plants a bug:
  'recovered_from_p' draws the recovered token from p instead of
  normalise(max(p - q, 0)); 'accept_min_1_p' accepts with min(1, p) instead of
  min(1, p / q). Returns (token_ids [N, K+1], num_accepted [N])."""
  rows, k = draft.shape
  v = p.shape[-1]
  tokens = np.full((rows, k + 1), -1, np.int64)
  alive = np.ones(rows, bool)
  num_accepted = np.zeros(rows, np.int64)

  def draw(dist, count):
    return np.minimum(np.searchsorted(np.cumsum(dist), rng.random(count) * dist.sum(), side="right"), v - 1)

  for i in range(k):
    d = draft[:, i]
    ratio = p[i][d] if mistake == "accept_min_1_p" else p[i][d] / q[i][d]
    accept = alive & (rng.random(rows) < np.minimum(1.0, ratio))
    reject = alive & ~accept
    tokens[accept, i] = d[accept]
    resid = p[i] if mistake == "recovered_from_p" else stats.residual_probs(p[i], q[i])
    tokens[reject, i] = draw(resid, int(reject.sum()))
    num_accepted += accept
    alive = accept
  tokens[alive, k] = draw(p[k], int(alive.sum()))
  return tokens, num_accepted


@pytest.mark.parametrize("mistake", [None, "recovered_from_p", "accept_min_1_p"])
def test_planted_wrong_sampler_is_rejected(mistake):
  case = CASES["draft_probs"]
  p = case.expected()
  q = case.q.astype(np.float64)
  rng = np.random.default_rng(0)
  draft = _draw_drafts(rng, case.q, FAST_ROWS)
  tokens, num_accepted = numpy_rejection_sampler(draft, p, q, rng, mistake=mistake)
  results = positionwise_gof(tokens, num_accepted, np.full(FAST_ROWS, K), p, label=str(mistake))
  if mistake is None:
    stats.assert_gof(results)  # the harness itself is right
  else:
    assert min(r.pvalue for r in results) < stats.ALPHA, "\n".join(map(str, results))


# ----------------------------------------------------------------------------
# Hypothesis: invariants over shapes and parameters
# ----------------------------------------------------------------------------

_FAST_SHAPES = [(B, K, V), (B, 0, V)]
_SLOW_SHAPES = _FAST_SHAPES + [(1, 0, 3), (3, 1, 5), (2, 4, 4), (5, 2, 9)]


@st.composite
def rejection_problems(draw, shapes, dtypes=(jnp.float32,), fast=False):
  """Random problems; `fast` keeps to the programs other tests compile anyway
  (no all_random without draft_probs, no K = 0 with all_random)."""
  b, k, v = draw(st.sampled_from(shapes))
  seed = draw(st.integers(0, 2**32 - 1))
  rng = np.random.default_rng(seed)
  scale = draw(st.sampled_from([0.5, 3.0]))
  logits = rng.normal(0, scale, (b, k + 1, v)).astype(np.float32)
  if draw(st.booleans()):
    logits = np.round(logits)  # ties
  mask = rng.random((b, k + 1, v)) < 0.25
  mask[..., rng.integers(0, v)] = False  # at least one finite logit per position
  logits[mask] = -np.inf
  am = np.argmax(logits, -1)[:, :k]
  draft = np.where(rng.random((b, k)) < 0.5, am, rng.integers(0, v, (b, k))).astype(np.int32)
  n = rng.integers(0, k + 1, b).astype(np.int32)
  past = np.arange(k)[None, :] >= n[:, None]
  draft = np.where(past, rng.choice([-1, v, 5 * v, 0], (b, k)), draft).astype(np.int32)
  mode = draw(st.sampled_from(["default", "all_greedy", "all_random"]))
  if fast and mode == "all_random" and k == 0:
    mode = "default"
  if k > 0 and (draw(st.booleans()) or (fast and mode == "all_random")):
    q = rng.dirichlet(np.full(v, 0.5), (b, k)).astype(np.float32)
    q[rng.random((b, k, v)) < 0.2] = 0.0
    q[..., 0] += 1e-3
    q /= q.sum(-1, keepdims=True)
    # Drafts drawn from q where live (so q(d) > 0 mostly), sometimes where q(d) = 0.
    live = ~past & (rng.random((b, k)) < 0.8)
    for r, i in zip(*np.nonzero(live)):
      pr = q[r, i].astype(np.float64)
      draft[r, i] = rng.choice(v, p=pr / pr.sum())
  else:
    q = None
  temperature = rng.choice(np.float32([0.0, 1e-6, 0.5, 1.0, 2.0]), b)
  top_k = rng.choice([0, 1, 2, v, v + 3], b)
  top_p = rng.choice(np.float32([1.0, 0.9, 0.5, 0.2]), b)
  key_kind = draw(st.sampled_from(["single", "batch", "raw_batch"]))
  dtype = draw(st.sampled_from(dtypes))
  use_none_n = draw(st.booleans())
  if use_none_n:
    n = np.full(b, k, np.int32)
    draft = np.where(draft < 0, 0, draft) % v
  return dict(
    draft=draft,
    logits=np.asarray(jnp.asarray(logits, dtype).astype(jnp.float32)),
    dtype=dtype,
    q=q,
    n=n,
    n_arg=None if use_none_n else n,
    temperature=temperature,
    top_k=top_k,
    top_p=top_p,
    mode=mode,
    key_kind=key_kind,
    seed=seed,
  )


def _check_invariants(pb):
  draft, logits, q, n = pb["draft"], pb["logits"], pb["q"], pb["n"]
  b, k1, v = logits.shape
  k = k1 - 1
  params = SamplingParams.create(pb["temperature"], top_k=pb["top_k"], top_p=pb["top_p"])
  key = jax.random.key(pb["seed"] % 1000)
  if pb["key_kind"] != "single":
    key = jax.random.split(key, b)
  if pb["key_kind"] == "raw_batch":
    key = jax.random.key_data(key)
  flags = {"all_greedy": pb["mode"] == "all_greedy", "all_random": pb["mode"] == "all_random"}
  out = _run(draft, jnp.asarray(logits, pb["dtype"]), params, key=key, draft_probs=q, n=pb["n_arg"], **flags)

  chex.assert_shape(out.token_ids, (b, k + 1))
  chex.assert_shape([out.num_accepted, out.num_emitted], (b,))
  np.testing.assert_array_equal(out.num_emitted, out.num_accepted + 1)
  assert np.all((0 <= out.num_accepted) & (out.num_accepted <= n))
  pos = np.arange(k + 1)[None, :]
  emitted = pos < out.num_emitted[:, None]
  assert np.all(out.token_ids[~emitted] == PLACEHOLDER_TOKEN_ID)
  assert np.all((out.token_ids[emitted] >= 0) & (out.token_ids[emitted] < v))
  accepted = pos[:, :k] < out.num_accepted[:, None]
  np.testing.assert_array_equal(out.token_ids[:, :k][accepted], draft[accepted])

  t = pb["temperature"]
  greedy = np.full(b, pb["mode"] == "all_greedy") | ((t < _GREEDY_T) & (pb["mode"] == "default"))
  ref, ref_acc = stats.greedy_reference(draft, logits, n)
  np.testing.assert_array_equal(out.token_ids[greedy], ref[greedy])
  np.testing.assert_array_equal(out.num_accepted[greedy], ref_acc[greedy])
  for r in np.flatnonzero(~greedy):
    t_r = 1.0 if t[r] < _GREEDY_T else t[r]  # all_random: zero-temperature rows at T = 1
    probs, near = stats.reference_probs(logits[r], t_r, int(pb["top_k"][r]), float(pb["top_p"][r]), boundary_tol=1e-4)
    s = out.num_accepted[r]
    for j in range(s + 1):
      if not near[j]:  # every emitted token lies in the processed support
        assert probs[j, out.token_ids[r, j]] > 0, (r, j)
    if s < n[r] and not near[s]:  # stopped by a rejection: the recovered token is not the draft
      resid = probs[s] if q is None else np.maximum(probs[s] - q[r, s], 0)
      if q is None or resid.sum() > 1e-4:
        assert out.token_ids[r, s] != draft[r, s], (r, s)
        if q is not None:
          assert resid[out.token_ids[r, s]] > 0 or abs(probs[s] - q[r, s])[out.token_ids[r, s]] < 1e-5


@hypothesis.settings(
  max_examples=25, deadline=None, derandomize=True, suppress_health_check=[hypothesis.HealthCheck.too_slow]
)
@hypothesis.given(rejection_problems(_FAST_SHAPES, fast=True))
def test_invariants_hypothesis(pb):
  _check_invariants(pb)


@pytest.mark.slow
@hypothesis.settings(
  max_examples=150, deadline=None, derandomize=True, suppress_health_check=[hypothesis.HealthCheck.too_slow]
)
@hypothesis.given(rejection_problems(_SLOW_SHAPES, dtypes=(jnp.float32, jnp.bfloat16, jnp.float16)))
def test_invariants_hypothesis_slow(pb):
  _check_invariants(pb)


# ----------------------------------------------------------------------------
# Batch invariance, keys, retracing, dtypes
# ----------------------------------------------------------------------------


def _batch_problem(seed=3):
  draft, logits, q = _random_inputs(seed)
  # Rows: greedy, random, random with top-k, random with top-p.
  params = SamplingParams.create([0.0, 0.8, 1.0, 1.2], top_k=[0, 0, 3, 0], top_p=[1.0, 1.0, 1.0, 0.7])
  n = np.array([3, 2, 3, 1], np.int32)
  return draft, logits, q, params, n


def _rows(params, idx):
  return jax.tree_util.tree_map(lambda x: x[np.asarray(idx)], params)


def test_row_output_does_not_depend_on_the_batch():
  draft, logits, q, params, n = _batch_problem()
  for seed in range(3):
    keys = _keys(seed)
    out = _run(draft, logits, params, key=keys, draft_probs=q, n=n)
    perm = np.array([2, 0, 3, 1])  # reordered
    shuffled = _run(draft[perm], logits[perm], _rows(params, perm), key=keys[perm], draft_probs=q[perm], n=n[perm])
    np.testing.assert_array_equal(shuffled.token_ids, out.token_ids[perm])
    # Rows 0 and 1 beside neighbours that filter nothing: the batch takes other
    # run-time branches, the rows' outputs stay.
    idx = np.array([0, 1, 0, 1])
    calm = _run(draft[idx], logits[idx], _rows(params, idx), key=keys[idx], draft_probs=q[idx], n=n[idx])
    np.testing.assert_array_equal(calm.token_ids, out.token_ids[idx])


@pytest.mark.slow
def test_row_output_alone_equals_its_output_in_the_batch():
  draft, logits, q, params, n = _batch_problem()
  for seed in range(3):
    keys = _keys(seed)
    out = _run(draft, logits, params, key=keys, draft_probs=q, n=n)
    for r in range(B):
      alone = _run(
        draft[r : r + 1],
        logits[r : r + 1],
        _rows(params, [r]),
        key=keys[r : r + 1],
        draft_probs=q[r : r + 1],
        n=n[r : r + 1],
      )
      np.testing.assert_array_equal(alone.token_ids[0], out.token_ids[r])


def test_all_random_row_output_does_not_depend_on_the_batch():
  # With all_random=True a zero-temperature row with top-k is a random row like
  # any other: whether a neighbour filters must not change its output.
  a = SamplingParams.create([0.0, 0.0, 0.0, 1.0], top_k=[2, 2, 2, 0])
  b = SamplingParams.create([0.0, 0.0, 0.0, 1.0], top_k=[2, 2, 2, 3])
  for seed in range(8):
    draft, logits, q = _random_inputs(40 + seed)
    out_a = _run(draft, logits, a, key=_keys(seed), draft_probs=q, all_random=True)
    out_b = _run(draft, logits, b, key=_keys(seed), draft_probs=q, all_random=True)
    np.testing.assert_array_equal(out_a.token_ids[:3], out_b.token_ids[:3], err_msg=f"seed {seed}")


def test_single_key_equals_batch_of_fold_in_keys_and_raw_equals_typed():
  draft, logits, q, params, n = _batch_problem()
  key = jax.random.key(42)
  single = _run(draft, logits, params, key=key, draft_probs=q, n=n)
  folded = jnp.stack([jax.random.fold_in(key, r) for r in range(B)])
  np.testing.assert_array_equal(_run(draft, logits, params, key=folded, draft_probs=q, n=n).token_ids, single.token_ids)
  raw_single = _run(draft, logits, params, key=jax.random.PRNGKey(42), draft_probs=q, n=n)
  np.testing.assert_array_equal(raw_single.token_ids, single.token_ids)
  raw_batch = _run(draft, logits, params, key=jax.random.key_data(folded), draft_probs=q, n=n)
  np.testing.assert_array_equal(raw_batch.token_ids, single.token_ids)
  # And the key matters: different keys give different outputs somewhere.
  outs = {_run(draft, logits, params, key=jax.random.key(s), draft_probs=q, n=n).token_ids.tobytes() for s in range(8)}
  assert len(outs) > 1


@functools.lru_cache(maxsize=None)
def _sampler_under_jit():
  """One jitted program shared by the tests below (one compile between them)."""

  @jax.jit
  def rejection_sample_under_jit(draft, logits, params, key, n):
    return rejection_sample(draft_token_ids=draft, target_logits=logits, params=params, key=key, num_draft_tokens=n)

  return rejection_sample_under_jit


def test_no_retrace_for_new_values_under_jit():
  fn = _sampler_under_jit()
  rng = np.random.default_rng(9)
  calls = []
  for i in range(5):
    draft, logits, _ = _random_inputs(i, probs=False)
    t = rng.choice(np.float32([0.0, 0.5, 1.0]), B) if i != 2 else np.zeros(B, np.float32)  # i=2: all greedy
    params = SamplingParams.create(t, top_k=rng.integers(0, 4, B), top_p=rng.choice(np.float32([0.6, 1.0]), B))
    calls.append((draft, logits, params, _keys(i), rng.integers(0, K + 1, B).astype(np.int32)))
  fn(*calls[0])  # compiles, unless another test compiled the shared program first
  with count_compiles("rejection_sample_under_jit") as compiled:
    for args in calls[1:]:
      fn(*args)
  assert not compiled, compiled


def test_under_jit_out_of_range_values_are_clipped_and_never_accepted():
  fn = _sampler_under_jit()  # the same jitted program as test_no_retrace_for_new_values_under_jit
  _, logits, _ = _random_inputs(10, probs=False)
  # Random rows 1 and 3: every position (the bonus too) nearly certain of token 2,
  # so a bonus drawn as if the last draft had been rejected would show.
  logits[[1, 3]] = np.where(np.arange(V) == 2, 12.0, 0.0)
  am = np.argmax(logits, -1).astype(np.int32)
  params = SamplingParams.create([0.0, 1.0, 0.0, 1.0])
  clipped = jax.tree_util.tree_map(np.asarray, fn(am[:, :K], logits, params, _keys(0), np.int32([K, K, 0, 0])))
  with count_compiles("rejection_sample_under_jit") as compiled:  # out-of-range values reuse the program
    # n beyond [0, K] is clipped: K + 2 -> K, -3 -> 0.
    out = jax.tree_util.tree_map(np.asarray, fn(am[:, :K], logits, params, _keys(0), np.int32([K + 2, K + 2, -3, -3])))
    np.testing.assert_array_equal(out.num_accepted[[0, 2]], [K, 0])
    np.testing.assert_array_equal(out.token_ids[0], am[0])  # bonus from position K
    np.testing.assert_array_equal(out.token_ids[2, 0], am[2, 0])
    np.testing.assert_array_equal(out.num_accepted[[1, 3]], [K, 0])
    np.testing.assert_array_equal(out.token_ids[[1, 3]], [[2, 2, 2, 2], [2, -1, -1, -1]])
    # Same keys: random rows too behave exactly as with n clipped by hand.
    np.testing.assert_array_equal(out.token_ids, clipped.token_ids)
    # Out-of-range draft ids are never accepted, and nothing crashes.
    for bad in (V, -1, 10**6, -(10**6)):
      draft = am[:, :K].copy()
      draft[:, 1] = bad
      out = jax.tree_util.tree_map(np.asarray, fn(draft, logits, params, _keys(1), np.full(B, K, np.int32)))
      assert np.all(out.num_accepted <= 1)
      emitted = out.token_ids >= 0
      assert np.all(out.token_ids[emitted] < V)
      np.testing.assert_array_equal(out.num_accepted[[0, 2]], 1)  # greedy rows: position 0 matches
  assert not compiled, compiled


def test_under_jit_rejected_out_of_range_ngram_draft_recovers_from_p():
  # An n-gram draft id outside [0, V) is rejected, and its residual max(p - onehot(d), 0)
  # is p itself: token 0 must keep its probability 0.9 (a residual that removed the
  # clamped index 0 instead would never emit it). 4000 rows: the frequency's standard
  # deviation is 0.005, so +-0.05 is 10 of them.
  b = 4000
  logits = np.full((b, 2, V), -np.inf, np.float32)
  logits[:, 0, :2] = np.log([0.9, 0.1])
  logits[:, 1, 0] = 0.0
  fn = jax.jit(
    lambda d, x, key: rejection_sample(
      draft_token_ids=d, target_logits=x, params=SamplingParams.create(np.ones(b, np.float32)), key=key
    )
  )
  out = jax.tree_util.tree_map(np.asarray, fn(np.full((b, 1), V, np.int32), logits, jax.random.key(3)))
  np.testing.assert_array_equal(out.num_accepted, 0)
  assert abs(np.mean(out.token_ids[:, 0] == 0) - 0.9) < 0.05
  assert set(np.unique(out.token_ids[:, 0])) <= {0, 1}


def test_eager_calls_with_new_values_do_not_recompile():
  draft, logits, q, params, n = _batch_problem()
  _run(draft, logits, params, key=_keys(0), draft_probs=q, n=n)  # warm
  rng = np.random.default_rng(12)
  with count_compiles("jit(_rejection_sample)") as compiled:
    for i in range(3):
      draft2, logits2, q2 = _random_inputs(20 + i)
      params2 = SamplingParams.create(
        rng.choice(np.float32([0.0, 0.3, 1.0]), B),
        top_k=rng.integers(0, 3, B),
        top_p=rng.choice(np.float32([0.5, 1.0]), B),
      )
      _run(draft2, logits2, params2, key=_keys(i), draft_probs=q2, n=rng.integers(0, K + 1, B).astype(np.int32))
    _run(draft, logits, SamplingParams.greedy(B), key=jax.random.key(5), draft_probs=q, n=n)
  assert not compiled, compiled
  with count_compiles("jit(_rejection_sample)") as compiled:  # control: a new shape does compile
    _run(draft[:, :2] % 5, logits[:, :3, :5], params, key=None, n=np.minimum(n, 2), all_greedy=True)
  assert compiled, "the control call compiled nothing: count_compiles saw no compilation"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_logits(dtype):
  # bf16 in the random program: see the chi-square tests; f16 there: slow test below.
  draft, logits32, q = _random_inputs(13)
  logits = jnp.asarray(np.round(logits32 * 4) / 4, dtype)  # ties survive the rounding
  rounded = np.asarray(logits.astype(jnp.float32))
  ref, ref_acc = stats.greedy_reference(draft, rounded)
  out = _run(draft, logits, SamplingParams.greedy(B), all_greedy=True)
  np.testing.assert_array_equal(out.token_ids, ref)
  np.testing.assert_array_equal(out.num_accepted, ref_acc)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_logits_mixed_batch(dtype):
  draft, logits32, q = _random_inputs(13)
  logits = jnp.asarray(logits32, dtype)
  ref, _ = stats.greedy_reference(draft, np.asarray(logits.astype(jnp.float32)))
  params = SamplingParams.create([0.0, 1.0, 0.0, 0.5], top_k=[0, 3, 0, 0])
  out = _run(draft, logits, params, key=_keys(0), draft_probs=jnp.asarray(q, dtype))
  np.testing.assert_array_equal(out.token_ids[[0, 2]], ref[[0, 2]])
  assert np.all(out.token_ids[[1, 3]][out.token_ids[[1, 3]] >= 0] < V)


# ----------------------------------------------------------------------------
# Bad inputs
# ----------------------------------------------------------------------------


def _valid_kwargs():
  draft, logits, q = _random_inputs(0)
  return dict(
    draft_token_ids=draft,
    target_logits=logits,
    params=SamplingParams.create(np.ones(B, np.float32)),
    key=_keys(0),
    draft_probs=q,
    num_draft_tokens=np.full(B, K, np.int32),
  )


_BAD_INPUTS = [
  ("draft_rank_1", dict(draft_token_ids=np.zeros(K, np.int32)), "draft_token_ids"),
  ("draft_wrong_k", dict(draft_token_ids=np.zeros((B, K + 1), np.int32)), "draft_token_ids"),
  ("draft_wrong_batch", dict(draft_token_ids=np.zeros((B + 1, K), np.int32)), "draft_token_ids"),
  ("draft_float", dict(draft_token_ids=np.zeros((B, K), np.float32)), "draft_token_ids"),
  ("logits_rank_2", dict(target_logits=np.zeros((B, V), np.float32)), "target_logits"),
  ("logits_rank_4", dict(target_logits=np.zeros((B, K + 1, V, 1), np.float32)), "target_logits"),
  ("logits_int", dict(target_logits=np.zeros((B, K + 1, V), np.int32)), "target_logits"),
  ("draft_probs_wrong_v", dict(draft_probs=np.ones((B, K, V + 1), np.float32)), "draft_probs"),
  ("draft_probs_rank_2", dict(draft_probs=np.ones((B, V), np.float32)), "draft_probs"),
  ("draft_probs_int", dict(draft_probs=np.ones((B, K, V), np.int32)), "draft_probs"),
  ("n_wrong_shape", dict(num_draft_tokens=np.zeros(B + 1, np.int32)), "num_draft_tokens"),
  ("n_rank_2", dict(num_draft_tokens=np.zeros((B, 1), np.int32)), "num_draft_tokens"),
  ("n_float", dict(num_draft_tokens=np.zeros(B, np.float32)), "num_draft_tokens"),
  ("params_batch_mismatch", dict(params=SamplingParams.create(np.ones(B + 1, np.float32))), "params"),
  ("n_too_large_eager", dict(num_draft_tokens=np.int32([K + 1, 0, 0, 0])), "num_draft_tokens"),
  ("n_negative_eager", dict(num_draft_tokens=np.int32([0, -1, 0, 0])), "num_draft_tokens"),
  ("draft_id_too_large_eager", dict(draft_token_ids=np.int32([[0, V, 0]] * B)), "draft_token_ids"),
  ("draft_id_negative_eager", dict(draft_token_ids=np.int32([[0, 0, -1]] * B)), "draft_token_ids"),
  ("key_wrong_batch", dict(key=_keys(0, B + 1)), "key"),
  ("key_raw_wrong_batch", dict(key=np.zeros((B - 1, 2), np.uint32)), "key"),
  ("key_wrong_dtype", dict(key=np.zeros(2, np.int32)), "key"),
  ("key_none_without_all_greedy", dict(key=None), "key"),
  ("both_flags", dict(all_greedy=True, all_random=True), "all_greedy"),
]


@pytest.mark.parametrize("changes, match", [pytest.param(c, m, id=i) for i, c, m in _BAD_INPUTS])
def test_bad_inputs_raise_value_error_naming_the_argument(changes, match):
  kwargs = _valid_kwargs()
  kwargs.update(changes)
  with pytest.raises(ValueError, match=match):
    rejection_sample(**kwargs)


def test_eager_values_past_n_are_not_checked():
  kwargs = _valid_kwargs()
  kwargs["draft_token_ids"] = np.int32([[0, -1, V], [5, 7, 10**6], [-1, -1, -1], [1, 2, 3]])
  kwargs["num_draft_tokens"] = np.int32([1, 2, 0, 3])
  out = rejection_sample(**kwargs)
  assert np.all(np.asarray(out.num_accepted) <= kwargs["num_draft_tokens"])
