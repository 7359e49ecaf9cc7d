"""Tests of the per-request options (logit bias, the three penalties, min-p) in sampling.py and rejection_sample.

Expected values come from `tests.sampling_reference`, a float64 NumPy reading of
the processing order that shares no code with the library. Statistical tests
use fixed seeds and a chi-square test at alpha = 1e-3 (`tests.support.stats.ALPHA`);
each also shows that a plausible wrong implementation is rejected by the same
samples at that level. The `rejection_sample` section checks every position of
a round, the bonus included, with the round's earlier drafts in the context
(the loops' use of the options: tests/loop/test_option_loops.py).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import PenaltyState, SamplingParams, rejection_sample
from specdec_jax.sampling import params as params_mod
from specdec_jax.sampling import penalties as penalties_mod
from specdec_jax.sampling import reductions, thresholds
from specdec_jax.sampling.penalties import apply_penalties
from specdec_jax.sampling.sample import process_logits, sample_tokens
from specdec_jax.sampling.thresholds import threshold_and_lse
from tests.support import sampling_reference as ref
from tests.support import stats
from tests.support.option_rows import rows_params, rows_state

_sample = jax.jit(sample_tokens, static_argnames=("all_greedy", "logprobs"))
_apply = jax.jit(apply_penalties)
_F32_MAX = float(np.finfo(np.float32).max)

# ----------------------------------------------------------------------------
# Helpers: one batch of rows, each with its own options and context
# ----------------------------------------------------------------------------


_REF_KEYS = (
  "temperature",
  "top_k",
  "top_p",
  "min_p",
  "repetition_penalty",
  "frequency_penalty",
  "presence_penalty",
  "bias",
)


def _ref_options(row):
  out = {k: row[k] for k in _REF_KEYS if k in row}
  out.setdefault("temperature", 1.0)
  return dict(out, prompt_tokens=row.get("prompt", ()), generated_tokens=row.get("generated", ()))


def _ref_penalized(logits, row, drafts=()):
  o = _ref_options(row)
  return ref.penalized_logits(
    logits,
    repetition_penalty=o.get("repetition_penalty", 1.0),
    frequency_penalty=o.get("frequency_penalty", 0.0),
    presence_penalty=o.get("presence_penalty", 0.0),
    bias=o.get("bias"),
    prompt_tokens=o["prompt_tokens"],
    generated_tokens=list(o["generated_tokens"]) + list(drafts),
  )


# ----------------------------------------------------------------------------
# SamplingParams: absent options, structure, create
# ----------------------------------------------------------------------------


def test_create_without_options_has_the_three_field_structure():
  params = SamplingParams.create(0.5)
  direct = SamplingParams(temperature=jnp.full((1,), 0.5), top_k=jnp.zeros((1,), jnp.int32), top_p=jnp.ones((1,)))
  assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(direct)
  assert len(jax.tree_util.tree_leaves(params)) == 3
  for name in (
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias_ids",
    "logit_bias_values",
  ):
    assert getattr(params, name) is None, name
  assert not (params.has_min_p or params.has_penalties or params.has_logit_bias)
  # A present option is a new leaf: programs with options compile separately.
  with_min_p = SamplingParams.create(0.5, min_p=0.0)
  assert with_min_p.has_min_p and not with_min_p.has_penalties
  assert jax.tree_util.tree_structure(with_min_p) != jax.tree_util.tree_structure(params)
  assert SamplingParams.create(0.5, presence_penalty=0.0).has_penalties


def test_create_broadcasts_options_and_pads_logit_bias():
  params = SamplingParams.create(
    [0.0, 1.0, 0.5],
    min_p=0.1,
    repetition_penalty=[1.0, 1.2, 1.5],
    frequency_penalty=-0.5,
    presence_penalty=np.float32(0.25),
    logit_bias=[{3: 1.0, 7: -2}, {}, {np.int64(5): np.float32(0.5)}],
  )
  for name in ("min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
    value = getattr(params, name)
    assert value.shape == (3,) and value.dtype == jnp.float32, name
  np.testing.assert_array_equal(params.min_p, np.float32([0.1] * 3))
  np.testing.assert_array_equal(params.logit_bias_ids, [[3, 7], [-1, -1], [5, -1]])
  np.testing.assert_array_equal(params.logit_bias_values, [[1.0, -2.0], [0, 0], [0.5, 0]])
  assert params.logit_bias_ids.dtype == jnp.int32 and params.logit_bias_values.dtype == jnp.float32
  shared = SamplingParams.create([1.0, 1.0], logit_bias={2: 1.5})
  np.testing.assert_array_equal(shared.logit_bias_ids, [[2], [2]])
  empty = SamplingParams.create(1.0, logit_bias={})
  assert empty.logit_bias_ids.shape == (1, 0) and empty.logit_bias_values.shape == (1, 0) and empty.has_logit_bias
  # The batch comes from an option too.
  assert SamplingParams.create(1.0, min_p=[0.0, 0.1, 0.2, 0.3]).batch_size == 4
  assert SamplingParams.create(1.0, logit_bias=[{}, {}]).batch_size == 2


_BAD_CREATE = [
  ("min_p", dict(min_p=-0.1)),
  ("min_p", dict(min_p=1.5)),
  ("min_p", dict(min_p=[0.1, np.nan])),
  ("min_p", dict(min_p="0.1")),
  ("repetition_penalty", dict(repetition_penalty=0.0)),
  ("repetition_penalty", dict(repetition_penalty=-1.0)),
  ("repetition_penalty", dict(repetition_penalty=np.inf)),
  ("repetition_penalty", dict(repetition_penalty=np.nan)),
  ("repetition_penalty", dict(repetition_penalty=1e39)),
  ("frequency_penalty", dict(frequency_penalty=np.inf)),
  ("frequency_penalty", dict(frequency_penalty=np.nan)),
  ("presence_penalty", dict(presence_penalty=-np.inf)),
  ("presence_penalty", dict(presence_penalty=[True])),
  ("logit_bias", dict(logit_bias={1: np.inf})),
  ("logit_bias", dict(logit_bias={1: np.nan})),
  ("logit_bias", dict(logit_bias={1: 1e39})),
  ("logit_bias", dict(logit_bias={-2: 1.0})),
  ("logit_bias", dict(logit_bias={1.5: 1.0})),
  ("logit_bias", dict(logit_bias={"a": 1.0})),
  ("logit_bias", dict(logit_bias={True: 1.0})),
  ("logit_bias", dict(logit_bias={1: "x"})),
  ("logit_bias", dict(logit_bias={2**31: 1.0})),
  ("logit_bias", dict(logit_bias=5)),
  ("logit_bias", dict(logit_bias=[{1: 1.0}, 3])),
  ("logit_bias", dict(temperature=[1.0, 1.0], logit_bias=[{1: 1.0}] * 3)),  # batch sizes disagree
  ("min_p", dict(temperature=[1.0, 1.0], min_p=[0.1, 0.2, 0.3])),
]


@pytest.mark.parametrize("name, kwargs", _BAD_CREATE, ids=[f"{n}-{i}" for i, (n, _) in enumerate(_BAD_CREATE)])
def test_create_rejects_bad_options(name, kwargs):
  kwargs = dict({"temperature": 1.0}, **kwargs)
  with pytest.raises(ValueError, match=name):
    SamplingParams.create(**kwargs)


def test_create_accepts_boundary_options_and_traced_values():
  SamplingParams.create(
    1.0,
    min_p=[0.0, 1.0],
    repetition_penalty=[1e-3, 100.0],
    frequency_penalty=-2.0,
    presence_penalty=2.0,
    logit_bias={0: -100.0, 2**31 - 1: 100},
  )
  params = jax.jit(lambda t, m, r: SamplingParams.create(t, min_p=m, repetition_penalty=r))(
    jnp.ones(2), jnp.zeros(2), jnp.ones(2)
  )
  assert params.min_p.dtype == jnp.float32 and params.repetition_penalty.shape == (2,)


_DIRECT_BAD = [
  ("params.min_p must be", dict(min_p=jnp.zeros(2, jnp.int32))),
  ("params.repetition_penalty must have shape", dict(repetition_penalty=jnp.ones(3))),
  ("logit_bias_ids and params.logit_bias_values", dict(logit_bias_ids=jnp.zeros((2, 1), jnp.int32))),
  (
    "params.logit_bias_ids must be an integer",
    dict(logit_bias_ids=jnp.zeros((2, 1)), logit_bias_values=jnp.zeros((2, 1))),
  ),
  (
    "params.logit_bias_values must have the shape",
    dict(logit_bias_ids=jnp.zeros((2, 1), jnp.int32), logit_bias_values=jnp.zeros((2, 2))),
  ),
]


@pytest.mark.parametrize("match, fields", _DIRECT_BAD, ids=[m for m, _ in _DIRECT_BAD])
def test_check_params_covers_present_options(match, fields):
  params = SamplingParams(temperature=jnp.ones(2), top_k=jnp.zeros(2, jnp.int32), top_p=jnp.ones(2), **fields)
  with pytest.raises(ValueError, match=match):
    params_mod.check_params(params, 2, "test")


# ----------------------------------------------------------------------------
# PenaltyState
# ----------------------------------------------------------------------------


def test_penalty_state_from_prompt_and_add_tokens():
  v = 6
  prompt = np.array([[1, 1, 4, 5, 5], [0, 7, -1, 3, 2], [2, 2, 2, 2, 2]], np.int32)
  lengths = np.array([3, 5, 0], np.int32)
  state = jax.jit(PenaltyState.from_prompt, static_argnums=2)(prompt, lengths, v)
  want = np.zeros((3, v), bool)
  want[0, [1, 4]] = True  # 5 is past the length
  want[1, [0, 3, 2]] = True  # 7 and -1 are outside [0, V)
  np.testing.assert_array_equal(state.prompt_mask, want)
  np.testing.assert_array_equal(state.output_counts, np.zeros((3, v)))
  tokens = np.array([[3, 3, -1, 6], [5, 0, 5, 5], [9, -7, 1, 1]], np.int32)
  valid = np.array([[True, True, True, True], [True, True, False, True], [True, True, True, False]])
  state = jax.jit(lambda s, t, ok: s.add_tokens(t, ok))(state, tokens, valid)
  counts = np.zeros((3, v), np.int32)
  counts[0, 3] = 2
  counts[1, 5], counts[1, 0] = 2, 1
  counts[2, 1] = 1
  np.testing.assert_array_equal(state.output_counts, counts)
  np.testing.assert_array_equal(state.prompt_mask, want)  # unchanged
  state = state.add_tokens(jnp.array([4, -1, 0]))  # one token a row, all valid
  counts[0, 4] += 1
  counts[2, 0] += 1
  np.testing.assert_array_equal(state.output_counts, counts)
  assert state.output_counts.dtype == jnp.int32 and state.vocab_size == v


# ----------------------------------------------------------------------------
# apply_penalties against the float64 reference (steps 1-3)
# ----------------------------------------------------------------------------

_PEN_ROWS = [
  dict(repetition_penalty=1.5, prompt=[0, 3], generated=[3, 5, 5]),
  dict(frequency_penalty=0.4, presence_penalty=0.7, prompt=[1, 2], generated=[2, 6, 6, 6]),
  dict(bias={0: 2.0, 4: -3.5, 7: 0.25}, repetition_penalty=0.8, prompt=[4], generated=[0]),
  dict(
    repetition_penalty=1.3,
    frequency_penalty=-0.2,
    presence_penalty=0.5,
    bias={2: 1.0},
    prompt=[2, 7],
    generated=[1, 1, 7],
  ),
  dict(),  # neutral row: comes back bit for bit
  dict(presence_penalty=1.0, prompt=[0, 1, 2, 3, 4, 5, 6, 7]),  # prompt only: no presence penalty
]


def test_apply_penalties_one_position_matches_reference():
  v = 8
  rng = np.random.default_rng(0)
  logits = rng.normal(0, 2.0, (len(_PEN_ROWS), v)).astype(np.float32)
  params, state = rows_params(_PEN_ROWS), rows_state(_PEN_ROWS, v)
  out = np.asarray(_apply(jnp.asarray(logits), params, state))
  assert out.dtype == np.float32
  for b, row in enumerate(_PEN_ROWS):
    np.testing.assert_allclose(out[b], _ref_penalized(logits[b], row), rtol=1e-6, atol=1e-6, err_msg=f"row {b}")
  np.testing.assert_array_equal(out[4], logits[4])
  np.testing.assert_array_equal(out[5], logits[5])


def test_apply_penalties_round_counts_earlier_drafts():
  v, k = 8, 4
  rng = np.random.default_rng(1)
  logits = rng.normal(0, 2.0, (len(_PEN_ROWS), k + 1, v)).astype(np.float32)
  # A repeated draft, a -1 placeholder, an id >= V, drafts already in the prompt.
  drafts = np.array([[5, 5, 5, 2], [6, -1, 2, 6], [0, 4, 4, 9], [7, 1, -1, 1], [3, 3, 3, 3], [1, 1, 8, 0]], np.int32)
  params, state = rows_params(_PEN_ROWS), rows_state(_PEN_ROWS, v)
  out = np.asarray(_apply(jnp.asarray(logits), params, state, jnp.asarray(drafts)))
  for b, row in enumerate(_PEN_ROWS):
    o = _ref_options(row)
    want = ref.round_penalized_logits(
      logits[b],
      drafts[b],
      generated_tokens=o.pop("generated_tokens"),
      **{
        n: o[n]
        for n in ("repetition_penalty", "frequency_penalty", "presence_penalty", "bias", "prompt_tokens")
        if n in o
      },
    )
    np.testing.assert_allclose(out[b], want, rtol=1e-6, atol=1e-6, err_msg=f"row {b}")
  np.testing.assert_array_equal(out[4], logits[4])
  # Without drafts, every position sees only the state.
  flat = np.asarray(_apply(jnp.asarray(logits), params, state))
  for b, row in enumerate(_PEN_ROWS):
    for i in range(k + 1):
      np.testing.assert_allclose(flat[b, i], _ref_penalized(logits[b, i], row), rtol=1e-6, atol=1e-6)


def test_apply_penalties_bias_alone_needs_no_state():
  params = SamplingParams.create([1.0, 0.0], logit_bias=[{1: 2.0, 1000: 5.0}, {}])  # 1000 >= V: ignored under jit
  out = _apply(jnp.zeros((2, 3)), params, None)
  np.testing.assert_array_equal(out, [[0, 2, 0], [0, 0, 0]])
  with pytest.raises(ValueError, match="state"):
    apply_penalties(jnp.zeros((2, 3)), SamplingParams.create([1.0, 1.0], repetition_penalty=1.2), None)


def test_apply_penalties_keeps_the_non_finite_rules():
  big = 3.0e38
  logits = np.array([[np.nan, np.inf, -np.inf, big, -big, 1.0, -1.0, 0.0]] * 3, np.float32)
  rows = [
    dict(repetition_penalty=0.5, prompt=list(range(8))),  # x / 0.5 of 3e38 overflows; -inf * 0.5
    dict(repetition_penalty=2.0, frequency_penalty=1e38, presence_penalty=1e38, generated=list(range(8)) * 3),
    dict(bias={0: 1.0, 1: -1e38, 2: 1e38, 3: 1e38, 4: -1e38}),
  ]
  out = np.asarray(_apply(jnp.asarray(logits), rows_params(rows), rows_state(rows, 8)))
  assert np.all(np.isnan(out[:, 0])), out[:, 0]  # NaN stays NaN (a masked token)
  np.testing.assert_array_equal(out[:, 1], np.inf)  # +inf stays "this token"
  np.testing.assert_array_equal(out[:, 2], -np.inf)  # -inf stays masked
  assert np.all(np.isfinite(out[:, 3:])), out  # finite stays finite, saturating
  np.testing.assert_array_equal(out[0, 3], _F32_MAX)
  np.testing.assert_array_equal(out[1, 4], -_F32_MAX)
  np.testing.assert_array_equal(out[2, 3], _F32_MAX)


# ----------------------------------------------------------------------------
# Greedy rows: exact argmax tables
# ----------------------------------------------------------------------------

# (logits, row options, argmax without the options, argmax with them)
_GREEDY_TABLE = [
  ([2.0, 1.5, 0.0, -1.0], dict(repetition_penalty=2.0, prompt=[0]), 0, 1),  # 2 / 2 = 1 < 1.5
  ([-1.0, -1.5, -3.0, -4.0], dict(repetition_penalty=2.0, generated=[0]), 0, 1),  # -1 * 2 = -2 < -1.5
  ([2.0, 1.0, 0.0, 0.0], dict(repetition_penalty=2.0, prompt=[0]), 0, 0),  # tie 1.0, 1.0: first index
  ([1.0, 0.5, 0.0, 0.0], dict(frequency_penalty=0.3, generated=[0, 0]), 0, 1),  # 1 - 0.6 = 0.4
  ([1.0, 0.5, 0.0, 0.0], dict(frequency_penalty=0.3, generated=[0]), 0, 0),  # 1 - 0.3 = 0.7
  ([1.0, 0.5, 0.9, 0.0], dict(presence_penalty=0.6, generated=[0, 0, 0]), 0, 2),  # once, not per count
  ([1.0, 0.5, 0.9, 0.0], dict(presence_penalty=5.0, frequency_penalty=5.0, prompt=[0]), 0, 0),  # prompt: not counted
  ([1.0, 0.5, 0.0, 0.0], dict(bias={2: 1.5}), 0, 2),
  ([1.0, 1.0, 0.0, 0.0], dict(bias={0: -1e-3}), 0, 1),
  ([0.0, 0.0, 0.0, 0.0], dict(bias={3: 1e-6, 2: 1e-6}), 0, 2),
  ([3.0, 2.0, 0.0, 0.0], dict(bias={0: 1.0}, repetition_penalty=2.0, presence_penalty=0.6, generated=[0]), 0, 1),
]


def _greedy_batch():
  rows = [dict(opts, temperature=0.0) for _, opts, _, _ in _GREEDY_TABLE]
  logits = np.array([lg for lg, _, _, _ in _GREEDY_TABLE], np.float32)
  return logits, rows_params(rows), rows_state(rows, logits.shape[1])


@pytest.mark.parametrize("all_greedy", [False, True])
def test_greedy_table_penalties_and_bias_change_the_argmax(all_greedy):
  logits, params, state = _greedy_batch()
  tokens, logp = _sample(jnp.asarray(logits), params, jax.random.key(0), all_greedy=all_greedy, penalty_state=state)
  without = np.array([t for _, _, t, _ in _GREEDY_TABLE])
  want = np.array([t for _, _, _, t in _GREEDY_TABLE])
  np.testing.assert_array_equal(np.argmax(logits, -1), without)
  np.testing.assert_array_equal(tokens, want)
  np.testing.assert_array_equal(logp, np.where(np.eye(logits.shape[1], dtype=bool)[want], 0.0, -np.inf))
  for b, (lg, opts, _, _) in enumerate(_GREEDY_TABLE):
    assert ref.greedy_token(_ref_penalized(np.float32(lg), opts)) == want[b]


def test_all_greedy_program_with_penalties_has_no_exponential_or_random_bits():
  logits, params, state = _greedy_batch()
  fn = jax.jit(functools.partial(sample_tokens, all_greedy=True))
  prog = stats.HloProgram(
    fn.lower(jnp.asarray(logits), params, jax.random.key(0), penalty_state=state).compile().as_text()
  )
  ops = prog.opcodes()
  assert "exponential" not in ops and "sort" not in ops, ops
  assert not ops & stats.RANDOM_OPCODES, ops & stats.RANDOM_OPCODES
  for marker in ("threefry", "rng", "random"):
    assert not prog.mentions(marker), marker


# ----------------------------------------------------------------------------
# sample_tokens: chi-square against the reference, and against wrong variants
# ----------------------------------------------------------------------------

_V = 10
_LOGITS = np.array(
  [
    [2.0, 1.4, 0.9, 0.5, 0.1, -0.3, -0.8, -1.5, -2.5, -np.inf],
    [1.0, 0.6, 0.3, 1.2, -0.5, 0.8, 0.0, -1.0, 0.4, -0.2],
  ],
  np.float32,
)


def _wrong_min_p_before_temperature(logits, row):
  # Bug: min-p's cut taken on the unscaled probabilities (before the temperature).
  x = _ref_penalized(logits, row)
  cut = x >= np.max(x) + np.log(np.float32(row["min_p"]))
  p = ref.filtered_probs(
    np.where(cut, x, -np.inf), temperature=row["temperature"], top_k=row.get("top_k", 0), top_p=row.get("top_p", 1.0)
  )
  return p


def _wrong_min_p_absolute(logits, row):
  # Bug: min_p as an absolute probability floor instead of relative to the largest.
  x = _ref_penalized(logits, row)
  p = ref.filtered_probs(x, temperature=row["temperature"], top_k=row.get("top_k", 0), top_p=row.get("top_p", 1.0))
  p = np.where(p >= row["min_p"], p, 0.0)
  return p / p.sum()


def _wrong_with(**changes):
  # Bug: the reference with some options replaced (e.g. the prompt counted as generated tokens).
  def wrong(logits, row):
    return np.exp(ref.processed_log_probs(logits, **_ref_options(dict(row, **changes))))

  return wrong


def _wrong_rep_divides_negatives(logits, row):
  # Bug: x / r for every context token, also where x < 0 (which raises those).
  o = _ref_options(row)
  x = np.asarray(logits, np.float64).copy()
  context = set(o["prompt_tokens"]) | set(o["generated_tokens"])
  for t in context:
    x[t] /= np.float32(row["repetition_penalty"])
  return ref.filtered_probs(x, temperature=row["temperature"], top_k=row.get("top_k", 0), top_p=row.get("top_p", 1.0))


def _wrong_bias_after_temperature(logits, row):
  # Bug: the bias added to x / T instead of x.
  t = np.float32(row["temperature"])
  x = np.asarray(logits, np.float64) / t
  for tid, b in row["bias"].items():
    x[tid] += np.float32(b)
  return ref.filtered_probs(x, temperature=1.0, top_k=row.get("top_k", 0), top_p=row.get("top_p", 1.0))


# (label, logits row, options, wrong variant): every group is a block of rows of one batch.
_GROUPS = [
  ("min_p, T=1.6", 0, dict(temperature=1.6, min_p=0.2), _wrong_min_p_before_temperature),
  ("min_p + top_k, T=0.7", 1, dict(temperature=0.7, top_k=6, min_p=0.15), _wrong_min_p_absolute),
  (
    "repetition + top_p",
    1,
    dict(temperature=1.0, top_p=0.95, repetition_penalty=2.0, prompt=[3, 4, 9], generated=[7, 0]),
    _wrong_rep_divides_negatives,
  ),
  (
    "frequency + top_k",
    0,
    dict(temperature=0.8, top_k=7, frequency_penalty=0.5, prompt=[2, 2, 4], generated=[0, 0, 0, 1]),
    _wrong_with(generated=[0, 0, 0, 1, 2, 2, 4]),
  ),
  (
    "presence",
    1,
    dict(temperature=1.2, presence_penalty=1.0, prompt=[0, 3, 5], generated=[8, 8]),
    _wrong_with(generated=[8, 8, 0, 3, 5]),
  ),
  ("bias + top_p, T=2", 0, dict(temperature=2.0, top_p=0.8, bias={5: 3.0, 0: -2.0}), _wrong_bias_after_temperature),
  (
    "all options",
    1,
    dict(
      temperature=0.9,
      top_k=8,
      top_p=0.95,
      min_p=0.1,
      repetition_penalty=1.3,
      frequency_penalty=0.3,
      presence_penalty=0.4,
      bias={7: 1.5, 3: -0.5},
      prompt=[0, 1],
      generated=[3, 3, 5],
    ),
    _wrong_with(presence_penalty=0.0),
  ),
]


def _sample_groups(n, seed):
  rows = [opts for _, _, opts, _ in _GROUPS for _ in range(n)]
  logits = np.repeat(_LOGITS[[g for _, g, _, _ in _GROUPS]], n, axis=0)
  tokens, logp = _sample(
    jnp.asarray(logits), rows_params(rows), jax.random.key(seed), penalty_state=rows_state(rows, _V)
  )
  return np.asarray(tokens).reshape(len(_GROUPS), n), np.asarray(logp).reshape(len(_GROUPS), n, _V)


def _check_groups(n, seed):
  tokens, logp = _sample_groups(n, seed)
  right, wrong = [], []
  for grp, (label, g, opts, wrong_variant) in enumerate(_GROUPS):
    expected = np.exp(ref.processed_log_probs(_LOGITS[g], **_ref_options(opts)))
    np.testing.assert_allclose(np.exp(logp[grp, 0]), expected, atol=2e-6, err_msg=label)
    right.append(stats.chisquare_gof(tokens[grp], expected, label=label))
    bad = wrong_variant(_LOGITS[g], opts)
    assert np.abs(bad - expected).sum() > 0.05, f"{label}: the wrong variant is too close to test"
    wrong.append(stats.chisquare_gof(tokens[grp], bad, label=f"{label} (wrong variant)"))
  stats.assert_gof(right)
  # The same samples reject every wrong variant at the same level.
  accepted = [str(r) for r in wrong if r.pvalue >= stats.ALPHA]
  assert not accepted, "wrong variants not rejected:\n  " + "\n  ".join(accepted)


def test_sample_tokens_options_chisquare():
  # 20,000 rows a group: over <= 10 bins, detects TV >= 0.018 at 80% power
  # (stats.detectable_deviation(20000, 10)); the wrong variants differ by TV > 0.025.
  _check_groups(20_000, seed=0)


@pytest.mark.slow
def test_sample_tokens_options_chisquare_slow():
  _check_groups(300_000, seed=1)


# ----------------------------------------------------------------------------
# min-p through the sort-free threshold search
# ----------------------------------------------------------------------------


def _threshold_rows(kind, b, v, rng):
  if kind == "peaked":  # language-model-like: the kept set is among the candidates
    x = rng.normal(0, 1.0, (b, v)).astype(np.float32)
    for r in range(b):
      x[r, rng.choice(v, 12, replace=False)] += rng.normal(9.0, 1.5, 12).astype(np.float32)
    return x
  return rng.normal(0, 0.05, (b, v)).astype(np.float32)  # flat: min-p keeps most of the vocabulary


@pytest.mark.parametrize("num_flat", [3, 70])  # a few sorted rows; more than the 64 sorted one by one
def test_threshold_and_lse_min_p_candidates_and_fallback_equal_sorted(num_flat):
  v, rng = 4096, np.random.default_rng(num_flat)
  grid = [
    (t, k, p, m)
    for t in (1.0, 0.6)
    for k, p in ((0, 1.0), (20, 1.0), (0, 0.9), (30, 0.8))
    for m in (0.0, 0.01, 0.2, 1.0)
  ]
  peaked = _threshold_rows("peaked", len(grid), v, rng)
  flat = _threshold_rows("flat", num_flat, v, rng)
  x = np.concatenate([peaked, flat])
  t, k, p, m = (np.array(c) for c in zip(*grid))
  flat_params = [
    rng.choice([1.0, 0.7], num_flat),
    np.zeros(num_flat, int),
    np.ones(num_flat),
    rng.choice([0.3, 0.6], num_flat),
  ]
  t, k, p, m = (np.concatenate([a, f]) for a, f in zip((t, k, p, m), flat_params))
  t, k, p, m = jnp.float32(t), jnp.int32(k), jnp.float32(p), jnp.float32(m)
  thr, lse = jax.jit(functools.partial(threshold_and_lse, min_p=m))(jnp.asarray(x), t, k, p)
  scaled = reductions.scale_logits(jnp.asarray(x), t)
  want_thr = thresholds.sorted_threshold(scaled, k, p, min_p=m)
  np.testing.assert_array_equal(thr, want_thr)
  want_lse = jax.nn.logsumexp(jnp.where(scaled >= want_thr[:, None], scaled, -jnp.inf), axis=-1)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-6)
  # Which path each row took: the candidates are exact iff the threshold is above every group's 4th largest.
  floor = np.asarray(thresholds.group_top(scaled)[..., -1].max(axis=-1))
  thr = np.asarray(thr)
  assert np.all(thr[: len(grid)][np.asarray(m[: len(grid)]) > 0] > floor[: len(grid)][np.asarray(m[: len(grid)]) > 0])
  assert np.all(thr[len(grid) :] <= floor[len(grid) :]), "the flat rows must need the sorted fallback"
  # And the kept sets are the float64 reference's.
  for r in list(range(0, len(grid), 5)) + [len(grid), len(x) - 1]:
    want = ref.filtered_probs(x[r], temperature=float(t[r]), top_k=int(k[r]), top_p=float(p[r]), min_p=float(m[r]))
    np.testing.assert_array_equal(np.asarray(scaled[r]) >= thr[r], want > 0, err_msg=f"row {r}")


def test_process_logits_min_p_matches_reference():
  rng = np.random.default_rng(5)
  rows = [
    dict(temperature=t, top_k=k, top_p=p, min_p=m)
    for t in (0.5, 1.0, 2.0)
    for k in (0, 3)
    for p in (1.0, 0.8)
    for m in (0.0, 0.05, 0.3, 1.0)
  ]
  logits = rng.normal(0, 2.0, (len(rows), 9)).astype(np.float32)
  logits[0, 3] = -np.inf
  params = SamplingParams.create(
    [r["temperature"] for r in rows],
    top_k=[r["top_k"] for r in rows],
    top_p=[r["top_p"] for r in rows],
    min_p=[r["min_p"] for r in rows],
  )
  logp = np.asarray(jax.jit(process_logits)(jnp.asarray(logits), params))
  for b, row in enumerate(rows):
    want = ref.filtered_probs(logits[b], **row)
    np.testing.assert_array_equal(logp[b] > -np.inf, want > 0, err_msg=f"row {b}: {row}")
    np.testing.assert_allclose(np.exp(logp[b]), want, rtol=1e-5, atol=1e-7, err_msg=f"row {b}: {row}")


def test_process_logits_min_p_keeps_the_non_finite_rules():
  logits = np.array(
    [
      [np.inf, 1.0, np.inf, np.nan, 0.0],  # +inf tokens share the mass; NaN masked
      [3.0e38, 3.2e38, -3e38, 1.0, np.nan],  # x / T overflows: the shifted recomputation
      [-np.inf, -np.inf, np.nan, -np.inf, -np.inf],  # nothing to keep
      [0.0, np.log(0.5), np.log(0.25), -np.inf, np.log(0.2)],
    ],
    np.float32,
  )
  params = SamplingParams.create([1.0, 0.1, 1.0, 1.0], min_p=[0.5, 0.1, 0.5, 0.25])
  probs = np.exp(np.asarray(jax.jit(process_logits)(jnp.asarray(logits), params)))
  np.testing.assert_array_equal(probs[0], [0.5, 0, 0.5, 0, 0])
  np.testing.assert_array_equal(probs[1], [0, 1, 0, 0, 0])
  np.testing.assert_array_equal(probs[2], 0)
  np.testing.assert_allclose(probs[3], np.array([1, 0.5, 0.25, 0, 0]) / 1.75, rtol=1e-6)  # 0.25 at the cut: kept


# ----------------------------------------------------------------------------
# No option given: the outputs are those of the plain functions, bit for bit
# ----------------------------------------------------------------------------


def test_threshold_and_lse_without_min_p_is_bit_identical():
  rng = np.random.default_rng(6)
  for v in (50, 4096):
    x = jnp.asarray(np.concatenate([_threshold_rows("peaked", 4, v, rng), _threshold_rows("flat", 2, v, rng)]))
    t = jnp.float32([1.0, 0.7, 1.0, 1.3, 1.0, 0.8])
    k = jnp.int32([0, 10, 40, 0, 0, 2000])
    p = jnp.float32([0.9, 1.0, 0.7, 1.0, 0.5, 0.9])
    plain = jax.jit(threshold_and_lse)(x, t, k, p)
    off = jax.jit(functools.partial(threshold_and_lse, min_p=jnp.zeros(6)))(x, t, k, p)
    for a, b in zip(plain, off):
      np.testing.assert_array_equal(a, b)


def test_process_logits_and_sample_tokens_without_options_are_bit_identical():
  rng = np.random.default_rng(7)
  b, v = 8, 12
  logits = jnp.asarray(rng.normal(0, 2.0, (b, v)).astype(np.float32))
  base = dict(temperature=[0.0, 1.0, 0.7, 1.3] * 2, top_k=[0, 0, 4, 0] * 2, top_p=[1.0, 1.0, 1.0, 0.8] * 2)
  plain = SamplingParams.create(**base)
  neutral = SamplingParams.create(
    **base, min_p=0.0, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0, logit_bias={3: 0.0}
  )
  state = PenaltyState.from_prompt(jnp.asarray(rng.integers(0, v, (b, 5)), jnp.int32), jnp.full((b,), 5), v)
  state = state.add_tokens(jnp.asarray(rng.integers(0, v, (b, 4)), jnp.int32))
  np.testing.assert_array_equal(
    jax.jit(process_logits)(logits, plain), jax.jit(process_logits)(logits, neutral, state)
  )  # traced penalties need the state
  for seed in range(3):
    key = jax.random.key(seed)
    want = _sample(logits, plain, key)
    assert len(want) == 2
    got = [_sample(logits, neutral, key, penalty_state=state)]
    if seed == 0:  # concrete neutral penalties (closed over, not traced) need no state
      got.append(jax.jit(lambda x, k: sample_tokens(x, neutral, k))(logits, key))
    for outputs in got:
      for a, c in zip(want, outputs):
        np.testing.assert_array_equal(a, c)


# ----------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------


def test_sample_tokens_rejects_bias_ids_beyond_the_vocabulary():
  params = SamplingParams.create([1.0, 0.0], logit_bias=[{2: 1.0}, {8: -1.0}])
  with pytest.raises(ValueError, match="logit_bias"):
    sample_tokens(jnp.zeros((2, 8)), params, jax.random.key(0))
  with pytest.raises(ValueError, match="logit_bias"):
    params_mod.check_bias_ids(params, 8, "test")
  params_mod.check_bias_ids(params, 9, "test")


def test_sample_tokens_penalties_need_a_state():
  logits = jnp.zeros((2, 8))
  with pytest.raises(ValueError, match="penalty_state"):
    sample_tokens(logits, SamplingParams.create([1.0, 1.0], repetition_penalty=[1.0, 1.1]), jax.random.key(0))
  with pytest.raises(ValueError, match="penalty_state"):
    sample_tokens(logits, SamplingParams.create([0.0, 0.0], presence_penalty=0.5), jax.random.key(0), all_greedy=True)
  with pytest.raises(ValueError, match="penalty_state"):  # traced values cannot be checked: a state is needed
    jax.jit(sample_tokens)(logits, SamplingParams.create([1.0, 1.0], frequency_penalty=0.0), jax.random.key(0))
  # Concrete neutral penalties need no state.
  tok, _ = sample_tokens(
    logits,
    SamplingParams.create([0.0, 0.0], repetition_penalty=1.0, frequency_penalty=0.0),
    jax.random.key(0),
    all_greedy=True,
  )
  np.testing.assert_array_equal(tok, [0, 0])


def test_penalty_params_drops_neutral_penalties_without_a_state():
  params = SamplingParams.create([1.0, 0.0], repetition_penalty=1.0, presence_penalty=0.0, logit_bias={1: 1.0})
  out = penalties_mod.penalty_params(params, None, 2, 4, "test")
  assert not out.has_penalties and out.has_logit_bias
  state = PenaltyState.from_prompt(jnp.zeros((2, 1), jnp.int32), jnp.ones(2, jnp.int32), 4)
  assert penalties_mod.penalty_params(params, state, 2, 4, "test") is params
  with pytest.raises(ValueError, match="logit_bias"):
    penalties_mod.penalty_params(params, state, 2, 1, "test")
  with pytest.raises(ValueError, match="penalty_state.output_counts"):
    penalties_mod.penalty_params(params, PenaltyState(state.prompt_mask, jnp.zeros((2, 5), jnp.int32)), 2, 4, "test")


def test_sample_tokens_rejects_bad_logprobs_mode_and_state_shape():
  with pytest.raises(ValueError, match="logprobs"):
    sample_tokens(jnp.zeros((2, 8)), SamplingParams.greedy(2), jax.random.key(0), logprobs="log")
  state = PenaltyState.from_prompt(jnp.zeros((2, 3), jnp.int32), jnp.ones(2, jnp.int32), 7)
  with pytest.raises(ValueError, match="state.prompt_mask"):
    sample_tokens(
      jnp.zeros((2, 8)),
      SamplingParams.create(1.0, repetition_penalty=[1.2, 1.2]),
      jax.random.key(0),
      penalty_state=state,
    )


# ----------------------------------------------------------------------------
# Log-probabilities of the sampled tokens
# ----------------------------------------------------------------------------

_LP_ROWS = [
  dict(temperature=0.0, repetition_penalty=1.5, prompt=[0, 1], bias={4: 1.0}),
  dict(temperature=1.0),  # nothing modified: "raw" reads the sampled distribution
  dict(temperature=1.0, bias={2: 2.0}),
  dict(temperature=0.7, top_k=5, min_p=0.1, presence_penalty=0.5, generated=[3, 3]),
  dict(temperature=1.3, top_p=0.8, frequency_penalty=0.4, repetition_penalty=1.2, prompt=[5], generated=[6, 6, 7]),
  dict(temperature=0.0, frequency_penalty=2.0, generated=[9, 9]),
]


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_sample_tokens_logprobs_match_float64_references(mode):
  v = 12
  rng = np.random.default_rng(8)
  logits = rng.normal(0, 2.0, (len(_LP_ROWS), v)).astype(np.float32)
  logits[5, 9] = logits[5].max() + 2.0  # the frequency penalty (-4) moves the greedy row off its argmax, 9
  params, state = rows_params(_LP_ROWS), rows_state(_LP_ROWS, v)
  raw_lsm = ref.log_softmax(logits)
  for seed in range(3):
    tokens, _, lp = _sample(jnp.asarray(logits), params, jax.random.key(seed), penalty_state=state, logprobs=mode)
    tokens, lp = np.asarray(tokens), np.asarray(lp)
    assert lp.shape == (len(_LP_ROWS),) and lp.dtype == np.float32
    for b, row in enumerate(_LP_ROWS):
      if mode == "raw":
        want = raw_lsm[b, tokens[b]]
      elif row["temperature"] == 0.0:
        want = ref.log_softmax(_ref_penalized(logits[b], row))[tokens[b]]
      else:
        want = ref.processed_log_probs(logits[b], **_ref_options(row))[tokens[b]]
      np.testing.assert_allclose(lp[b], want, rtol=1e-5, atol=1e-5, err_msg=f"row {b} seed {seed}")
  assert tokens[5] != 9
  # all_greedy: the greedy rows' values, from the same references.
  greedy_rows = [dict(r, temperature=0.0) for r in _LP_ROWS]
  tokens, _, lp = _sample(
    jnp.asarray(logits), rows_params(greedy_rows), None, all_greedy=True, penalty_state=state, logprobs=mode
  )
  for b, row in enumerate(greedy_rows):
    x = logits[b] if mode == "raw" else _ref_penalized(logits[b], row)
    assert tokens[b] == ref.greedy_token(_ref_penalized(logits[b], row))
    np.testing.assert_allclose(lp[b], ref.log_softmax(x)[tokens[b]], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------
# rejection_sample: the options at every position of a round, drafts in the context
# ----------------------------------------------------------------------------
#
# Position i of a round sees the prompt, the tokens generated before the round
# and the drafts d_0 .. d_{i-1}: p_i depends on the drafts. Given that a row
# reached position j with drafts `prefix` accepted, the token it emits there
# (accepted draft, recovered or bonus token) is distributed as p_j(. | prefix),
# with or without draft probabilities; so among all rows that reach j it follows
# the mixture of p_j(. | prefix) weighted by P(reach j with prefix). `_round_law`
# enumerates the prefixes (V^K of them at most) in float64.

_RK, _RV = 3, 8
_PEAKS = [2, 4, 1, 6]  # the most likely token at positions 0 .. K


def _round_logits():
  """[K+1, V]: position j peaks at _PEAKS[j], with the earlier peaks (the likely drafts) next.

  So drafts are mostly accepted (rows reach the bonus often enough to test it)
  and the tokens that earlier drafts put into the context keep real mass at
  the later positions, where the penalties move it. -inf masks token 7 at
  position 1.
  """
  x = np.random.default_rng(5).normal(0, 0.6, (_RK + 1, _RV))
  for j, peak in enumerate(_PEAKS):
    x[j, peak] += 2.5
    if j >= 1:
      x[j, _PEAKS[j - 1]] += 1.5
    if j >= 2:
      x[j, _PEAKS[j - 2]] += 0.8
  x[1, 7] = -np.inf
  return x.astype(np.float32)


_RLOGITS = _round_logits()
# Draft distributions given to the sampler: half the target's softmax, half
# fixed noise (acceptance ~0.75 a position); q_0(5) = 0, so token 5 comes at
# position 0 only from a residual.
_RQ = np.exp(_RLOGITS[:_RK]) / np.exp(_RLOGITS[:_RK]).sum(-1, keepdims=True)
_RQ = 0.5 * _RQ + 0.5 * np.random.default_rng(21).dirichlet(np.ones(_RV), _RK)
_RQ[0, 5] = 0.0
_RQ = (_RQ / _RQ.sum(-1, keepdims=True)).astype(np.float32)
# Drafts without probabilities (n-gram style) are drawn from this, which the
# sampler never sees: the peak 9 times in 10, so rows reach the bonus.
_RQ_NGRAM = (0.9 * np.eye(_RV)[_PEAKS[:_RK]] + 0.1 / _RV).astype(np.float32)

# (label, options): one block of rows each in one batch. Greedy rows are checked exactly.
_PENALTY_GROUPS = [
  (
    "presence + frequency",
    dict(temperature=1.0, frequency_penalty=0.6, presence_penalty=0.8, prompt=[4], generated=[0]),
  ),
  (
    "repetition + bias + top_k",
    dict(temperature=0.8, top_k=5, repetition_penalty=1.8, bias={1: 1.0, 6: -2.0}, prompt=[0, 3], generated=[3]),
  ),
  (
    "all + top_p",
    dict(
      temperature=1.2,
      top_p=0.9,
      repetition_penalty=1.3,
      frequency_penalty=-0.3,
      presence_penalty=1.2,
      bias={4: 0.7},
      prompt=[5],
      generated=[7, 7],
    ),
  ),
]
_MIN_P_GROUPS = [
  ("min_p", dict(temperature=1.0, min_p=0.1)),
  ("min_p + top_k", dict(temperature=0.7, top_k=6, min_p=0.05)),
  (
    "min_p + top_p + penalties",
    dict(
      temperature=1.0,
      top_p=0.9,
      min_p=0.15,
      repetition_penalty=1.4,
      presence_penalty=0.7,
      bias={3: 0.5},
      prompt=[0],
      generated=[3],
    ),
  ),
]
_GREEDY_ROW = dict(
  temperature=0.0, repetition_penalty=2.0, presence_penalty=0.5, bias={3: 0.6}, prompt=[1], min_p=0.5
)  # min_p is ignored by greedy rows
_ROUND_ROWS = 20_000  # rows per group
_GREEDY_ROWS = 500


def _round_law(dist, q, accept):
  """The per-position law of one round, by enumerating the draft prefixes (float64).

  Args:
    dist: dist(j, prefix) -> [V], the processed target distribution at position j
      given the drafts `prefix` = (d_0, .., d_{j-1}) before it.
    q: [K, V]: each draft d_j is drawn from q[j], independently.
    accept: accept(q_d, p_d): probability of drafting d and accepting it; min(q, p)
      with draft probabilities (accept w.p. min(1, p / q)), q * p without (the
      sampler takes q as the one-hot of the draft).

  Returns:
    (reach [K+1]: P(a row reaches position j), probs [K+1, V]: law of the token
    emitted at j by the rows that reach it).
  """
  k = q.shape[0]
  level, reach, probs = {(): 1.0}, [], []
  for j in range(k + 1):
    mix, nxt = 0.0, {}
    for prefix, w in level.items():
      p = dist(j, prefix)
      mix = mix + w * p
      for d in np.flatnonzero(q[j] > 0) if j < k else ():
        a = accept(float(q[j, d]), float(p[d]))
        if a > 0:
          nxt[prefix + (int(d),)] = w * a
    total = sum(level.values())
    reach.append(total)
    probs.append(mix / total)
    level = nxt
  return np.array(reach), np.stack(probs)


def _ref_dist(row, *, drafts_counted=True, **changes):
  """dist(j, prefix) of the float64 reference for a row's options; `drafts_counted=False` plants the bug
  of a sampler that forgets the round's drafts (every position sees only the state)."""
  opts = _ref_options(dict(row, **changes))
  cache = {}

  def dist(j, prefix):
    prefix = prefix if drafts_counted else ()
    if (j, prefix) not in cache:
      o = dict(opts, generated_tokens=list(opts["generated_tokens"]) + list(prefix))
      cache[j, prefix] = np.exp(ref.processed_log_probs(_RLOGITS[j], **o))
    return cache[j, prefix]

  return dist


def _min_p_absolute_dist(row):
  """Planted: min_p as an absolute probability floor instead of relative to the largest."""
  plain = _ref_dist(row, min_p=0.0)

  def dist(j, prefix):
    p = plain(j, prefix)
    p = np.where(p >= row["min_p"], p, 0.0)
    return p / p.sum()

  return dist


def _greedy_round_reference(logits, drafts, row, n=None, *, drafts_counted=True):
  """(token_ids [K+1], num_accepted) of a greedy row: argmax of the penalised logits, drafts in the context.

  n: drafts verified (None: all K). drafts_counted=False: the planted sampler
  whose positions see only the state, not the round's earlier drafts.
  """
  o = _ref_options(row)
  k = len(drafts)
  n = k if n is None else n
  pen = ref.round_penalized_logits(
    logits,
    drafts if drafts_counted else [-1] * k,
    generated_tokens=o["generated_tokens"],
    **{
      m: o[m]
      for m in ("repetition_penalty", "frequency_penalty", "presence_penalty", "bias", "prompt_tokens")
      if m in o
    },
  )
  out = [-1] * (k + 1)
  a = 0
  while a < n and drafts[a] == ref.greedy_token(pen[a]):
    out[a] = int(drafts[a])
    a += 1
  out[a] = ref.greedy_token(pen[a])
  return out, a


def _accept_rule(with_probs):
  return (lambda q, p: min(q, p)) if with_probs else (lambda q, p: q * p)


def _run_round_groups(groups, with_probs, seed, per_group=_ROUND_ROWS):
  """Every group's rows and the greedy rows in one batch: (rows, drafts, token_ids, num_accepted)."""
  rows = [opts for _, opts in groups for _ in range(per_group)] + [_GREEDY_ROW] * _GREEDY_ROWS
  n = len(rows)
  rng = np.random.default_rng(seed)
  q64 = (_RQ if with_probs else _RQ_NGRAM).astype(np.float64)
  q64 /= q64.sum(-1, keepdims=True)
  drafts = np.stack([rng.choice(_RV, n, p=q64[i]) for i in range(_RK)], 1).astype(np.int32)
  params = rows_params(rows)
  if not any("min_p" in opts for _, opts in groups):
    params = dataclasses.replace(params, min_p=None)  # the program without min-p
  out = rejection_sample(
    drafts,
    jnp.broadcast_to(jnp.asarray(_RLOGITS), (n, _RK + 1, _RV)),
    params,
    jax.random.split(jax.random.key(seed), n),
    draft_probs=jnp.broadcast_to(jnp.asarray(_RQ), (n, _RK, _RV)) if with_probs else None,
    penalty_state=rows_state(rows, _RV),
  )
  return rows, drafts, np.asarray(out.token_ids), np.asarray(out.num_accepted)


def _positionwise(token_ids, num_accepted, reach, probs, label):
  """One chi-square per position (the bonus included) and one of num_accepted, against a round law."""
  results = []
  for j in range(_RK + 1):
    at = num_accepted >= j
    r = stats.chisquare_gof(token_ids[at, j], probs[j], label=f"{label}, position {j}")
    if r.num_bins >= 2:
      _, tv = stats.detectable_deviation(r.num_samples, r.num_bins)
      r = dataclasses.replace(r, label=f"{r.label} (detects TV>={tv:.3f})")
    results.append(r)
  accepted_law = np.append(reach[:-1] - reach[1:], reach[-1])
  results.append(stats.chisquare_gof(num_accepted, accepted_law, label=f"{label}, num_accepted"))
  return results


def _check_round_groups(groups, wrong_variants, with_probs, seed, per_group=_ROUND_ROWS):
  rows, drafts, token_ids, num_accepted = _run_round_groups(groups, with_probs, seed, per_group)
  accept, q = _accept_rule(with_probs), (_RQ if with_probs else _RQ_NGRAM)
  right, wrong = [], []
  for g, (label, opts) in enumerate(groups):
    sel = slice(g * per_group, (g + 1) * per_group)
    reach, probs = _round_law(_ref_dist(opts), q, accept)
    results = _positionwise(token_ids[sel], num_accepted[sel], reach, probs, label)
    for r in results[:-1]:  # every position, the bonus included, gets a useful sample
      assert r.num_samples >= 1400 and r.num_bins >= 2, r
    right += results
    for wlabel, make in wrong_variants:
      w_reach, w_probs = _round_law(make(opts), q, accept)
      tv = 0.5 * np.abs(w_probs - probs).sum(-1).max()
      assert tv > 0.07, f"{label}: {wlabel} moves no position by more than the test detects (TV {tv:.3f})"
      results = _positionwise(token_ids[sel], num_accepted[sel], w_reach, w_probs, f"{label} ({wlabel})")
      wrong.append(min(results, key=lambda r: r.pvalue))
  stats.assert_gof(right)
  # The same samples reject every planted variant at the same level.
  accepted = [str(r) for r in wrong if r.pvalue >= stats.ALPHA]
  assert not accepted, "wrong variants not rejected:\n  " + "\n  ".join(accepted)
  # Greedy rows of the same batch: exact, min_p ignored, drafts in the context.
  for b in range(len(rows) - _GREEDY_ROWS, len(rows)):
    want, a = _greedy_round_reference(_RLOGITS, drafts[b], rows[b])
    np.testing.assert_array_equal(token_ids[b], want, err_msg=f"greedy row {b}, drafts {drafts[b]}")
    assert num_accepted[b] == a


@pytest.mark.parametrize("with_probs", [True, False], ids=["draft_probs", "no_draft_probs"])
def test_rejection_sample_penalties_chisquare_every_position(with_probs):
  # 20,000 rows a group, alpha = 1e-3 (stats.ALPHA), fixed seeds. Every position's
  # test has >= 1,400 samples over <= 8 bins: it detects TV >= 0.07 at 80% power
  # (stats.detectable_deviation(1400, 8)); position 0 (20,000 samples) TV >= 0.018.
  # The planted sampler that forgets the drafts moves some position by TV > 0.07.
  _check_round_groups(
    _PENALTY_GROUPS, [("drafts not counted", functools.partial(_ref_dist, drafts_counted=False))], with_probs, seed=3
  )


@pytest.mark.parametrize("with_probs", [True, False], ids=["draft_probs", "no_draft_probs"])
def test_rejection_sample_min_p_chisquare_every_position(with_probs):
  # As above (power and level); planted: min-p ignored, and min-p as an absolute
  # floor instead of relative to the largest probability.
  wrong = [("min_p ignored", functools.partial(_ref_dist, min_p=0.0)), ("min_p absolute", _min_p_absolute_dist)]
  _check_round_groups(_MIN_P_GROUPS, wrong, with_probs, seed=4)


@pytest.mark.slow
@pytest.mark.parametrize("with_probs", [True, False], ids=["draft_probs", "no_draft_probs"])
def test_rejection_sample_options_chisquare_every_position_slow(with_probs):
  # 200,000 rows a group (10x the fast tests): every position detects TV >= ~0.022.
  _check_round_groups(
    _PENALTY_GROUPS,
    [("drafts not counted", functools.partial(_ref_dist, drafts_counted=False))],
    with_probs,
    seed=13,
    per_group=200_000,
  )
  _check_round_groups(
    _MIN_P_GROUPS, [("min_p ignored", functools.partial(_ref_dist, min_p=0.0))], with_probs, seed=14, per_group=200_000
  )


_G = [2.0, 1.5, 0.0, -1.0]  # one position's logits: 0 leads 1 by 0.5
# (label, logits of every position, drafts, n, options, emitted, emitted by a sampler that forgets the drafts)
_ROUND_GREEDY_TABLE = [
  ("presence: d0 penalised at position 1", _G, [0, 0], 2, dict(presence_penalty=1.0), [0, 1, -1], [0, 0, 0]),
  ("frequency: two drafts at the bonus", _G, [0, 0], 2, dict(frequency_penalty=0.3), [0, 0, 1], [0, 0, 0]),
  ("frequency: generated + draft", _G, [0, 0], 2, dict(frequency_penalty=0.3, generated=[0]), [0, 1, -1], [0, 0, 0]),
  ("repetition: accepted d1 thanks to d0", _G, [0, 1], 2, dict(repetition_penalty=2.0), [0, 1, 0], [0, 0, -1]),
  (
    "repetition of a negative logit",
    [-1.0, -1.5, -3.0, -4.0],
    [0, 0],
    2,
    dict(repetition_penalty=2.0),
    [0, 1, -1],
    [0, 0, 0],
  ),
  (
    "prompt: presence ignores it, drafts count",
    _G,
    [0, 0],
    2,
    dict(presence_penalty=1.0, prompt=[0]),
    [0, 1, -1],
    [0, 0, 0],
  ),
  (
    "bias, then presence on the biased draft",
    _G,
    [2, 2],
    2,
    dict(bias={2: 2.5}, presence_penalty=0.8),
    [2, 0, -1],
    [2, 2, 2],
  ),
  ("ragged n=1: the bonus counts d0", _G, [0, 0], 1, dict(presence_penalty=1.0), [0, 1, -1], [0, 0, -1]),
  ("n=0: no draft counted", _G, [0, 0], 0, dict(presence_penalty=1.0), [0, -1, -1], [0, -1, -1]),
  ("rejected d0: later drafts never matter", _G, [1, 0], 2, dict(presence_penalty=1.0), [0, -1, -1], [0, -1, -1]),
]


@pytest.mark.parametrize("mode", ["all_greedy_flag", "runtime_all_temperatures_zero", "greedy_rows_of_mixed_batch"])
def test_rejection_sample_greedy_table_penalties_count_earlier_drafts(mode):
  k = 2
  rows = [dict(opts, temperature=0.0) for _, _, _, _, opts, _, _ in _ROUND_GREEDY_TABLE]
  logits = np.array([[lg] * (k + 1) for _, lg, _, _, _, _, _ in _ROUND_GREEDY_TABLE], np.float32)
  drafts = np.array([d for _, _, d, _, _, _, _ in _ROUND_GREEDY_TABLE], np.int32)
  n = np.array([m for _, _, _, m, _, _, _ in _ROUND_GREEDY_TABLE], np.int32)
  if mode == "greedy_rows_of_mixed_batch":  # one random row beside them
    rows.append(dict(temperature=1.0, presence_penalty=1.0))
    logits, drafts, n = np.concatenate([logits, logits[:1]]), np.concatenate([drafts, drafts[:1]]), np.append(n, k)
  params = dataclasses.replace(rows_params(rows), min_p=None)
  out = rejection_sample(
    drafts,
    logits,
    params,
    None if mode == "all_greedy_flag" else jax.random.key(0),
    num_draft_tokens=n,
    all_greedy=mode == "all_greedy_flag",
    penalty_state=rows_state(rows, logits.shape[-1]),
  )
  for b, (label, lg, d, m, opts, want, forgetful) in enumerate(_ROUND_GREEDY_TABLE):
    # The table agrees with the float64 reference, and the drafts' context matters
    # in every row where the two columns differ.
    assert _greedy_round_reference(logits[b], d, rows[b], m)[0] == want, label
    assert _greedy_round_reference(logits[b], d, rows[b], m, drafts_counted=False)[0] == forgetful, label
    np.testing.assert_array_equal(out.token_ids[b], want, err_msg=label)
    assert int(out.num_accepted[b]) == sum(t >= 0 for t in want) - 1, label
  assert sum(w != f for *_, w, f in _ROUND_GREEDY_TABLE) >= 7


def test_rejection_sample_greedy_rows_ignore_min_p():
  # min_p filters the distribution a random row samples from; a greedy row's argmax
  # is never filtered, and its "processed" log-probability stays log_softmax of the
  # (penalised) logits, not renormalised over the min-p set.
  rng = np.random.default_rng(9)
  b, k, v = 8, 3, 16
  logits = rng.normal(0, 1.5, (b, k + 1, v)).astype(np.float32)
  drafts = np.argmax(logits[:, :k], -1).astype(np.int32)
  drafts[::3, 1] = (drafts[::3, 1] + 1) % v  # some rows reject at position 1
  temperature = np.array([0.0, 0.0, 0.0, 1.0, 0.0, 0.7, 0.0, 0.0])
  rows = [dict(temperature=t, min_p=m) for t, m in zip(temperature, [0.9, 0.5, 0.0, 0.3, 1.0, 0.2, 0.9, 0.9])]
  rows[6].update(presence_penalty=1.0, bias={3: 1.0})  # a greedy row with steps 1-3 as well
  params, state = rows_params(rows), rows_state(rows, v)

  def check_greedy_rows(out, idx):
    for i, r in enumerate(idx):
      if temperature[r] > 0:
        continue
      tokens, a = _greedy_round_reference(logits[r], drafts[r], rows[r])
      np.testing.assert_array_equal(out.token_ids[i], tokens, err_msg=f"row {r}")
      o = _ref_options(rows[r])
      pen = ref.round_penalized_logits(
        logits[r],
        drafts[r],
        generated_tokens=o["generated_tokens"],
        **{m: o[m] for m in ("presence_penalty", "bias", "prompt_tokens") if m in o},
      )
      lp = np.asarray(out.logprobs[i, : a + 1])
      np.testing.assert_allclose(
        lp, [ref.log_softmax(pen[j])[tokens[j]] for j in range(a + 1)], rtol=1e-5, atol=1e-5, err_msg=f"row {r}"
      )
      assert np.all(lp < -1e-3), f"row {r}: renormalised over the min-p set? {lp}"

  # Mixed batch: the greedy rows are the reference's, and the same as without min_p.
  key = jax.random.key(1)
  got = rejection_sample(drafts, logits, params, key, logprobs="processed", penalty_state=state)
  want = rejection_sample(
    drafts, logits, dataclasses.replace(params, min_p=None), key, logprobs="processed", penalty_state=state
  )
  check_greedy_rows(got, range(b))
  greedy = np.flatnonzero(temperature == 0)
  np.testing.assert_array_equal(np.asarray(got.token_ids)[greedy], np.asarray(want.token_ids)[greedy])
  # all_greedy, min_p present: the same tokens, from a program with no exponential and no random bits.
  sub = jax.tree.map(lambda x: x[greedy], (drafts, logits, params, state))
  fn = jax.jit(lambda d, x, p, s: rejection_sample(d, x, p, None, all_greedy=True, penalty_state=s))
  compiled = fn.lower(*sub).compile()
  ops = stats.HloProgram(compiled.as_text()).opcodes()
  assert "exponential" not in ops and not ops & stats.RANDOM_OPCODES, ops
  np.testing.assert_array_equal(compiled(*sub).token_ids, np.asarray(got.token_ids)[greedy])


def _min_p_zero_case(with_probs, penalties):
  rng = np.random.default_rng(10)
  b, k, v = 64, 3, 50
  logits = rng.normal(0, 2.0, (b, k + 1, v)).astype(np.float32)
  drafts = np.argmax(logits[:, :k], -1).astype(np.int32)  # likely drafts: rows stop at every position
  drafts[::5, 2] = rng.integers(0, v, len(drafts[::5]))
  probs = rng.dirichlet(np.ones(v), (b, k)).astype(np.float32) if with_probs else None
  base = dict(
    temperature=np.tile([0.0, 1.0, 0.7, 1.3], b // 4),
    top_k=np.tile([0, 0, 10, 0], b // 4),
    top_p=np.tile([1.0, 1.0, 1.0, 0.8], b // 4),
  )
  extra, state = {}, None
  if penalties:
    extra = dict(repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.4, logit_bias={7: 1.5})
    state = PenaltyState.from_prompt(rng.integers(0, v, (b, 6)), np.full(b, 6), v).add_tokens(
      rng.integers(0, v, (b, 4))
    )
  on = np.arange(b) % 8 >= 4  # rows 4-7 of every 8 use min-p in the mixed batch
  plain = SamplingParams.create(**base, **extra)
  zero = SamplingParams.create(**base, **extra, min_p=0.0)
  mixed = SamplingParams.create(**base, **extra, min_p=np.where(on, 0.2, 0.0))
  changed = 0
  for seed in range(3):
    want, got, some = (
      rejection_sample(
        drafts, logits, p, jax.random.key(seed), draft_probs=probs, logprobs="processed", penalty_state=state
      )
      for p in (plain, zero, mixed)
    )
    for name in ("token_ids", "num_accepted", "logprobs"):
      np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
      # A min_p = 0 row is untouched by its neighbours' min-p, bit for bit.
      np.testing.assert_array_equal(
        np.asarray(getattr(some, name))[~on], np.asarray(getattr(want, name))[~on], err_msg=name
      )
    changed += int(np.sum(np.asarray(some.logprobs)[on] != np.asarray(want.logprobs)[on]))
  assert changed > 0, "min_p = 0.2 changed nothing: the comparison above would not see min-p at all"


def test_rejection_sample_min_p_zero_is_bit_identical_to_no_min_p():
  _min_p_zero_case(with_probs=True, penalties=True)


@pytest.mark.slow
def test_rejection_sample_min_p_zero_is_bit_identical_to_no_min_p_without_draft_probs():
  _min_p_zero_case(with_probs=False, penalties=False)
