"""Tests of specdec_jax/sampling.py: SamplingParams, logit processing, plain sampling.

The expected values come from `tests/support/stats.py's `reference_probs``, a float64 NumPy
reading of the contract (docs/api.md) that shares no code with the library. Statistical tests use
fixed seeds and a chi-square test at alpha = 1e-3 (`tests.support.stats.ALPHA`).
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax.sampling.params import SamplingParams, row_keys
from specdec_jax.sampling.sample import process_logits, sample_tokens
from tests.support import stats
from tests.support.compiles import count_compiles

process_logits_jit = jax.jit(process_logits)
sample_tokens_jit = jax.jit(sample_tokens, static_argnames=("all_greedy",))

# ----------------------------------------------------------------------------
# SamplingParams
# ----------------------------------------------------------------------------


def test_create_broadcasts_scalars_and_sequences():
  params = SamplingParams.create(0.7, top_k=[1, 2, 3])
  chex.assert_shape([params.temperature, params.top_k, params.top_p], (3,))
  assert params.temperature.dtype == jnp.float32 and params.top_k.dtype == jnp.int32
  assert params.top_p.dtype == jnp.float32
  np.testing.assert_array_equal(params.temperature, np.float32([0.7] * 3))
  np.testing.assert_array_equal(params.top_p, [1.0] * 3)
  greedy = SamplingParams.greedy(4)
  np.testing.assert_array_equal(greedy.temperature, np.zeros(4))
  np.testing.assert_array_equal(greedy.top_k, np.zeros(4))
  assert bool(jnp.all(greedy.is_greedy))
  assert SamplingParams.create(1.0).batch_size == 1


@pytest.mark.parametrize(
  "kwargs, name",
  [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=[1.0, -1.0]), "temperature"),
    (dict(temperature=1.0, top_p=0.0), "top_p"),
    (dict(temperature=1.0, top_p=1.5), "top_p"),
    (dict(temperature=1.0, top_p=[0.5, -0.2]), "top_p"),
    (dict(temperature=1.0, top_k=-1), "top_k"),
    (dict(temperature=[1.0, 1.0], top_k=[1, 2, 3]), "top_k"),  # batch sizes disagree
  ],
)
def test_create_rejects_bad_values(kwargs, name):
  with pytest.raises(ValueError, match=name):
    SamplingParams.create(**kwargs)


def test_params_is_a_pytree_with_traced_fields():
  params = SamplingParams.create([0.0, 0.5], top_k=[0, 3], top_p=[1.0, 0.9])
  leaves = jax.tree_util.tree_leaves(params)
  assert len(leaves) == 3
  doubled = jax.jit(lambda p: jax.tree_util.tree_map(lambda x: x * 2, p))(params)
  np.testing.assert_allclose(doubled.temperature, [0.0, 1.0])


# ----------------------------------------------------------------------------
# Keys
# ----------------------------------------------------------------------------


def test_row_keys_single_key_is_fold_in():
  key = jax.random.key(3)
  keys = row_keys(key, 5)
  expected = jnp.stack([jax.random.key_data(jax.random.fold_in(key, b)) for b in range(5)])
  np.testing.assert_array_equal(jax.random.key_data(keys), expected)


def test_row_keys_raw_equals_typed_and_batch_is_kept():
  typed = jax.random.split(jax.random.key(1), 4)
  raw = jax.random.key_data(typed)
  np.testing.assert_array_equal(jax.random.key_data(row_keys(raw, 4)), raw)
  np.testing.assert_array_equal(jax.random.key_data(row_keys(typed, 4)), raw)
  np.testing.assert_array_equal(
    jax.random.key_data(row_keys(jax.random.PRNGKey(7), 3)), jax.random.key_data(row_keys(jax.random.key(7), 3))
  )


@pytest.mark.parametrize(
  "key",
  [
    jax.random.split(jax.random.key(0), 3),  # wrong batch
    np.zeros((2,), np.int32),  # not a key dtype
    np.zeros((4, 3), np.uint32),  # not [.., 2]
  ],
)
def test_row_keys_rejects_bad_keys(key):
  with pytest.raises(ValueError, match="key"):
    row_keys(key, 4, "key")


# ----------------------------------------------------------------------------
# process_logits against the float64 reference
# ----------------------------------------------------------------------------

# Every combination is one row of the batch.
_GRID = [(t, k, p) for t in (0.5, 1.0, 2.0) for k in (0, 1, 3, 6, 7, 9) for p in (1.0, 0.9, 0.5, 0.2)]


def _grid_params(grid):
  t, k, p = (np.array(c) for c in zip(*grid))
  return SamplingParams.create(t, top_k=k, top_p=p), (t, k, p)


def _assert_matches_reference(logits, params_np, logp, *, max_near=0.1):
  """exp(logp) equals the float64 reference; supports are equal except on rows
  whose top-p cumulative mass comes within 1e-5 of top_p (float32 rounding)."""
  t, k, p = params_np
  logits = np.asarray(logits, np.float32)
  logp = np.asarray(logp)
  assert not np.any(np.isnan(logp))
  near_rows = 0
  for b in range(logits.shape[0]):
    ref, near = stats.reference_probs(logits[b], t[b], int(k[b]), float(p[b]), boundary_tol=1e-5)
    if np.any(near):
      near_rows += 1
      continue
    np.testing.assert_array_equal(logp[b] > -np.inf, ref > 0, err_msg=f"support of row {b}: T,k,p={t[b], k[b], p[b]}")
    np.testing.assert_allclose(np.exp(logp[b]), ref, atol=2e-6, rtol=1e-4, err_msg=f"row {b}")
  assert near_rows <= max_near * logits.shape[0], f"{near_rows} rows too close to a top-p boundary to check"


@pytest.mark.parametrize("kind", ["normal_with_masks", "tie_heavy"])
def test_process_logits_matches_reference_small_vocab(kind):
  rng = np.random.default_rng(0 if kind == "normal_with_masks" else 1)
  params, params_np = _grid_params(_GRID * 2)
  b, v = len(_GRID) * 2, 7
  if kind == "normal_with_masks":
    logits = rng.normal(0, 2.0, (b, 3, v)).astype(np.float32)
    logits[rng.random((b, 3, v)) < 0.15] = -np.inf
    logits[:, :, 0] = np.where(np.all(logits == -np.inf, axis=-1), 0.0, logits[:, :, 0])
  else:
    # Integer logits: ties everywhere, at the top-k boundary and inside the top-p set.
    logits = rng.integers(-2, 3, (b, 3, v)).astype(np.float32)
  logp = process_logits_jit(jnp.asarray(logits), params)
  chex.assert_shape(logp, (b, 3, v))
  for pos in range(3):
    _assert_matches_reference(logits[:, pos], params_np, logp[:, pos])


@pytest.mark.parametrize("kind", ["peaked", "flat"])
def test_process_logits_matches_reference_large_vocab(kind):
  # V > 1024: language-model-like logits (a few large values) where the
  # threshold lies among the top candidates, and flat logits where top-p / a
  # large top-k reaches deep into the vocabulary.
  rng = np.random.default_rng(2)
  v = 1500
  if kind == "peaked":
    grid = [(t, k, p) for t in (1.0, 0.7) for k in (0, 1, 5, 20) for p in (1.0, 0.9, 0.5)]
  else:
    grid = [(t, k, p) for t in (1.0, 0.7) for k in (0, 200, 1400, 1499) for p in (1.0, 0.95, 0.5)]
  params, params_np = _grid_params(grid)
  logits = rng.normal(0, 1.0, (len(grid), 2, v)).astype(np.float32)
  if kind == "peaked":
    for b in range(len(grid)):
      for pos in range(2):
        logits[b, pos, rng.choice(v, 20, replace=False)] += rng.normal(8.0, 1.0, 20).astype(np.float32)
    logits[:, 0, 7] = logits[:, 0, 3] = logits.max()  # a tie at the very top
  logp = process_logits_jit(jnp.asarray(logits), params)
  for pos in range(2):
    _assert_matches_reference(logits[:, pos], params_np, logp[:, pos])


# Hand-computed tie cases: (logits, T, top_k, top_p, kept tokens).
_TIE_TABLE = [
  ([2, 2, 2, 1, 1, 0], 1.0, 1, 1.0, [0, 1, 2]),  # k=1 keeps all three tied maxima
  ([2, 2, 2, 1, 1, 0], 1.0, 4, 1.0, [0, 1, 2, 3, 4]),  # the 4th is tied with the 5th
  ([2, 2, 2, 1, 1, 0], 1.0, 0, 0.1, [0, 1, 2]),  # first token reaches 0.1; its ties stay
  ([0, 0, 0, 0, 0, 0], 1.0, 2, 1.0, [0, 1, 2, 3, 4, 5]),
  ([0, 0, 0, 0, 0, 0], 1.0, 0, 0.5, [0, 1, 2, 3, 4, 5]),
  ([3, 1, 1, 0, -np.inf, -np.inf], 1.0, 0, 0.99, [0, 1, 2, 3]),
  ([3, 1, 1, 0, -np.inf, -np.inf], 1.0, 5, 1.0, [0, 1, 2, 3]),  # k beyond the finite tokens
  ([1, 5, 1, 5, 0, 0], 0.5, 0, 0.3, [1, 3]),
  ([1, 5, 1, 5, 0, 0], 2.0, 3, 1.0, [0, 1, 2, 3]),  # k=3: the 3rd largest (1) is tied
  ([4, 3, 2, 1, 0, -1], 1.0, 0, 0.8, [0, 1]),  # 0.64 < 0.8 <= 0.87
  ([4, 3, 2, 1, 0, -1], 1.0, 2, 0.7, [0]),  # top-k renormalises first: 0.73 >= 0.7 (0.63 before)
  ([4, 3, 2, 1, 0, -1], 1.0, 6, 1.0, [0, 1, 2, 3, 4, 5]),  # top_k == V is off
]


@pytest.mark.parametrize("logits, t, k, p, kept", _TIE_TABLE)
def test_process_logits_tie_table(logits, t, k, p, kept):
  logits = np.asarray(logits, np.float32)
  # Pad the batch with an unfiltered row: the filter must act per row.
  both = np.stack([logits, logits])
  params = SamplingParams.create([t, 1.0], top_k=[k, 0], top_p=[p, 1.0])
  logp = np.asarray(process_logits_jit(jnp.asarray(both), params))
  np.testing.assert_array_equal(np.flatnonzero(logp[0] > -np.inf), kept)
  z = np.exp(logits[kept].astype(np.float64) / np.float32(t))
  np.testing.assert_allclose(np.exp(logp[0][kept]), z / z.sum(), rtol=1e-5)
  np.testing.assert_array_equal(logp[1] > -np.inf, np.isfinite(logits))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_process_logits_half_precision_matches_reference_of_rounded_values(dtype):
  rng = np.random.default_rng(3)
  params, params_np = _grid_params(_GRID[::5])
  logits = jnp.asarray(rng.normal(0, 2.0, (len(_GRID[::5]), 7)), dtype)
  logp = process_logits_jit(logits, params)
  assert logp.dtype == jnp.float32
  _assert_matches_reference(np.asarray(logits.astype(jnp.float32)), params_np, logp)


def test_process_logits_greedy_rows_use_temperature_one():
  x = jnp.asarray(np.random.default_rng(4).normal(size=(1, 9)).repeat(2, axis=0), jnp.float32)
  logp = process_logits_jit(x, SamplingParams.create([0.0, 1.0]))
  np.testing.assert_allclose(logp[0], logp[1], rtol=1e-6)
  np.testing.assert_allclose(logp[1], jax.nn.log_softmax(x[1]), rtol=1e-6)


# ----------------------------------------------------------------------------
# sample_tokens
# ----------------------------------------------------------------------------

# Four groups of rows in one batch; each row has its own key (fold_in of one key).
_V = 10
_GROUP_LOGITS = np.array(
  [
    [2.0, 1.5, 1.5, 1.0, 0.5, 0.5, 0.0, -1.0, -2.0, -np.inf],  # ties at the top-k boundary
    [0.3, 1.2, -0.4, 0.9, 0.0, 2.1, -1.0, 0.9, 0.2, -0.3],
    [0.0, -np.inf, 1.0, 0.5, -np.inf, -0.5, 0.25, 1.5, -1.0, 0.75],
    [1.0, 3.0, 0.0, 3.0, 2.0, -1.0, 0.0, 0.0, 1.0, 2.5],  # greedy: tie, first index (1) wins
  ],
  np.float32,
)
_GROUP_PARAMS = [(0.8, 4, 1.0), (1.3, 0, 0.7), (1.0, 0, 1.0), (0.0, 0, 1.0)]


def _sample_groups(rows_per_group, seed):
  g = len(_GROUP_PARAMS)
  logits = np.repeat(_GROUP_LOGITS, rows_per_group, axis=0)
  t, k, p = (np.repeat(np.array(c), rows_per_group) for c in zip(*_GROUP_PARAMS))
  params = SamplingParams.create(t, top_k=k, top_p=p)
  tokens, logp = sample_tokens_jit(jnp.asarray(logits), params, jax.random.key(seed))
  return np.asarray(tokens).reshape(g, rows_per_group), np.asarray(logp).reshape(g, rows_per_group, _V)


def _check_sample_groups(rows_per_group, seed):
  tokens, logp = _sample_groups(rows_per_group, seed)
  results = []
  for grp, (t, k, p) in enumerate(_GROUP_PARAMS[:3]):
    expected = stats.reference_probs(_GROUP_LOGITS[grp], t, k, p)
    results.append(stats.chisquare_gof(tokens[grp], expected, label=f"group {grp} T={t} k={k} p={p}"))
    np.testing.assert_allclose(np.exp(logp[grp, 0]), expected, atol=2e-6)
  stats.assert_gof(results)
  # Greedy rows: the first of the tied maxima, every time; log-probs one-hot.
  np.testing.assert_array_equal(tokens[3], 1)
  np.testing.assert_array_equal(logp[3], np.where(np.arange(_V) == 1, 0.0, -np.inf)[None].repeat(rows_per_group, 0))
  return results


def test_sample_tokens_chisquare():
  # 15,000 rows per group: with ~8 bins, detects TV >= 0.019 at 80% power
  # (stats.detectable_deviation(15000, 8) -> w = 0.038).
  _check_sample_groups(15_000, seed=0)


@pytest.mark.slow
def test_sample_tokens_chisquare_slow():
  # 300,000 rows per group: TV >= 0.0042 at 80% power.
  _check_sample_groups(300_000, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("v", [50, 300, 2000])
def test_sample_tokens_chisquare_wider_vocab(v):
  # The two-stage (chunk, then token) Gumbel draw over several chunk layouts.
  rng = np.random.default_rng(v)
  row = rng.normal(0, 1.5, v).astype(np.float32)
  row[rng.random(v) < 0.1] = -np.inf
  row[0] = 1.0
  n = 200_000
  params = SamplingParams.create(np.full(n, 0.9, np.float32))
  tokens, _ = sample_tokens_jit(jnp.asarray(np.broadcast_to(row, (n, v))), params, jax.random.key(v))
  stats.assert_gof(stats.chisquare_gof(np.asarray(tokens), stats.reference_probs(row, 0.9), label=f"V={v}"))


def test_sample_tokens_all_greedy_is_argmax_and_one_hot():
  rng = np.random.default_rng(5)
  logits = rng.integers(-3, 3, (16, 12)).astype(np.float32)  # many ties
  params = SamplingParams.create(np.linspace(0, 2, 16))  # flag overrides temperatures
  tokens, logp = sample_tokens_jit(jnp.asarray(logits), params, jax.random.key(0), all_greedy=True)
  np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))
  np.testing.assert_array_equal(logp, np.where(np.eye(12, dtype=bool)[np.argmax(logits, -1)], 0.0, -np.inf))


def test_sample_tokens_all_greedy_program_has_no_exponential_or_random_bits():
  logits = jnp.zeros((3, 37), jnp.float32)
  fn = jax.jit(functools.partial(sample_tokens, all_greedy=True))
  prog = stats.HloProgram(fn.lower(logits, SamplingParams.greedy(3), jax.random.key(0)).compile().as_text())
  ops = prog.opcodes()
  assert "exponential" not in ops and "sort" not in ops, ops
  assert not ops & stats.RANDOM_OPCODES, ops & stats.RANDOM_OPCODES
  assert prog.op_names(), "no op_name metadata to search"
  for marker in ("threefry", "rng", "random"):
    assert not prog.mentions(marker), marker


@pytest.mark.parametrize("temperature", [1e-7, 1e-6])
def test_near_zero_temperature_is_greedy(temperature):
  rng = np.random.default_rng(6)
  logits = (rng.normal(size=(8, 20)) * 30).astype(np.float32)
  logits[0, [4, 9]] = logits[0].max() + 1.0  # a tie: first index wins
  params = SamplingParams.create(np.full(8, temperature, np.float32), top_k=3, top_p=0.9)
  for seed in range(3):
    tokens, logp = sample_tokens_jit(jnp.asarray(logits), params, jax.random.key(seed))
    np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))
    assert not np.any(np.isnan(logp))
    np.testing.assert_array_equal(np.asarray(logp).max(axis=-1), 0.0)


@pytest.mark.parametrize("temperature", [1e-5, 2e-5, 1e-4, 1e-3])
def test_small_temperature_on_large_logits_has_no_nan(temperature):
  rng = np.random.default_rng(7)
  logits = (rng.normal(size=(8, 20)) * 1e4).astype(np.float32)  # gaps >> temperature
  params = SamplingParams.create(np.full(8, temperature, np.float32), top_k=[0, 5] * 4, top_p=[1.0, 1.0, 0.9, 0.9] * 2)
  tokens, logp = sample_tokens_jit(jnp.asarray(logits), params, jax.random.key(0))
  assert not np.any(np.isnan(logp))
  np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))
  logp2 = process_logits_jit(jnp.asarray(logits), params)
  assert not np.any(np.isnan(logp2))
  np.testing.assert_allclose(np.exp(np.asarray(logp2)).sum(-1), 1.0, rtol=1e-5)


def test_sample_tokens_no_retrace_on_new_values():
  @jax.jit
  def sample_tokens_under_jit(logits, params, key):
    return sample_tokens(logits, params, key)

  rng = np.random.default_rng(8)
  with count_compiles("sample_tokens_under_jit") as compiled:
    for i in range(4):
      params = SamplingParams.create(
        rng.choice([0.0, 0.5, 1.0], 4), top_k=rng.integers(0, 5, 4), top_p=rng.choice([0.5, 1.0], 4)
      )
      sample_tokens_under_jit(jnp.asarray(rng.normal(size=(4, 6)), jnp.float32), params, jax.random.key(i))
  assert len(compiled) == 1, compiled  # the first call only (a new function: always compiles once)


def test_sample_tokens_rejects_bad_shapes():
  with pytest.raises(ValueError, match="logits"):
    sample_tokens(jnp.zeros((2, 3, 4)), SamplingParams.greedy(2), jax.random.key(0))
  with pytest.raises(ValueError, match="params"):
    sample_tokens(jnp.zeros((2, 4)), SamplingParams.greedy(3), jax.random.key(0))
