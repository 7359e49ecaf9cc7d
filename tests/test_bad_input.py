"""Bad and extreme input to the sampler (issue 8): SamplingParams, process_logits, sample_tokens, rejection_sample.

The rules under test are stated in the module docstrings of specdec_jax/sampling.py
and specdec_jax/rejection.py:
* concrete bad values raise a ValueError naming the argument;
* NaN logits count as -inf, on every path (a row never depends on its neighbours);
* +inf logits share all of a position's mass; greedy takes the first;
* finite logits never overflow logits / T (a temperature near 0 is greedy);
* a position with no logit above -inf accepts no draft and emits token 0;
* under jit, a NaN, +-inf or negative draft probability counts as 0;
* a masked (-inf) token is never emitted;
* everything runs, with the same outputs, under jax_enable_x64.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import SamplingParams, rejection_sample
from specdec_jax.sampling.sample import process_logits, sample_tokens

# Compiling a sampler program takes seconds on a CPU: every jitted call here uses
# one batch B = 8 (rejection_sample: [8, 4, 8]; sample_tokens: [8, 8]).
B, K, V = 8, 3, 8

_rs = jax.jit(rejection_sample, static_argnames=("all_greedy", "all_random"))
_st = jax.jit(sample_tokens, static_argnames=("all_greedy",))
_pl = jax.jit(process_logits)


def _keys(seed, b):
  return jax.random.split(jax.random.key(seed), b)


def _rs_np(**kwargs):
  return jax.tree_util.tree_map(np.asarray, _rs(**kwargs))


def _eager_kwargs(seed=0):
  """Valid eager rejection_sample arguments of the shapes and kinds test_rejection uses (one compile)."""
  rng = np.random.default_rng(seed)
  return dict(
    draft_token_ids=np.zeros((4, K), np.int32),
    target_logits=rng.normal(size=(4, K + 1, V)).astype(np.float32),
    params=SamplingParams.create(np.ones(4, np.float32)),
    key=_keys(0, 4),
    draft_probs=rng.dirichlet(np.ones(V), (4, K)).astype(np.float32),
    num_draft_tokens=np.full(4, K, np.int32),
  )


# ----------------------------------------------------------------------------
# SamplingParams.create / greedy / direct construction
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
  "kwargs, name",
  [
    pytest.param(dict(temperature=np.nan), "temperature", id="temperature_nan"),
    pytest.param(dict(temperature=np.inf), "temperature", id="temperature_inf"),
    pytest.param(dict(temperature=1e39), "temperature", id="temperature_overflows_float32"),
    pytest.param(dict(temperature=[0.5, np.nan]), "temperature", id="temperature_nan_in_batch"),
    pytest.param(dict(temperature=None), "temperature", id="temperature_none"),
    pytest.param(dict(temperature=[[1.0], [1.0, 2.0]]), "temperature", id="temperature_ragged"),
    pytest.param(dict(temperature=1 + 2j), "temperature", id="temperature_complex"),
    pytest.param(dict(temperature="hot"), "temperature", id="temperature_string"),
    pytest.param(dict(temperature=1.0, top_k=np.int64(2**32 + 3)), "top_k", id="top_k_wraps_to_3"),
    pytest.param(dict(temperature=1.0, top_k=2**31), "top_k", id="top_k_2_31"),
    pytest.param(dict(temperature=1.0, top_k=[1, 2**40]), "top_k", id="top_k_2_40"),
    pytest.param(dict(temperature=1.0, top_k=2**70), "top_k", id="top_k_python_bigint"),
    pytest.param(dict(temperature=1.0, top_k=np.nan), "top_k", id="top_k_nan"),
    pytest.param(dict(temperature=1.0, top_k=2.5), "top_k", id="top_k_fraction"),
    pytest.param(dict(temperature=1.0, top_k=1j), "top_k", id="top_k_complex"),
    pytest.param(dict(temperature=1.0, top_k=[[1], [1, 2]]), "top_k", id="top_k_ragged"),
    pytest.param(dict(temperature=1.0, top_p=np.nan), "top_p", id="top_p_nan"),
    pytest.param(dict(temperature=1.0, top_p=0.5 + 0j), "top_p", id="top_p_complex"),
    pytest.param(dict(temperature=1.0, top_p=[[0.5], [0.5, 0.9]]), "top_p", id="top_p_ragged"),
  ],
)
def test_create_rejects_bad_values_naming_the_argument(kwargs, name):
  with pytest.raises(ValueError, match=rf"{name} must"):
    SamplingParams.create(**kwargs)


def test_create_accepts_boundary_values():
  params = SamplingParams.create(np.float64(3e38), top_k=[2**31 - 1, 3.0], top_p=np.float64(1.0))
  np.testing.assert_array_equal(params.top_k, [2**31 - 1, 3])
  assert params.top_k.dtype == jnp.int32 and params.temperature.dtype == jnp.float32
  assert SamplingParams.create(1.0, top_k=np.uint64(7)).top_k.tolist() == [7]


@pytest.mark.parametrize("batch_size", [-1, 2.5, None, "3"])
def test_greedy_rejects_bad_batch_size(batch_size):
  with pytest.raises(ValueError, match="batch_size must be an int >= 0"):
    SamplingParams.greedy(batch_size)


def test_greedy_accepts_numpy_ints():
  assert SamplingParams.greedy(np.int64(3)).batch_size == 3


def test_create_under_jit_checks_dtypes():
  with pytest.raises(ValueError, match="top_k must hold integers"):
    jax.jit(lambda t, k: SamplingParams.create(t, top_k=k))(jnp.ones(2), jnp.ones(2))
  with pytest.raises(ValueError, match="temperature must hold real numbers"):
    jax.jit(lambda t: SamplingParams.create(t))(jnp.ones(2, bool))
  params = jax.jit(lambda t, k: SamplingParams.create(t, top_k=k))(jnp.ones(2), jnp.arange(2))
  np.testing.assert_array_equal(params.top_k, [0, 1])


_DIRECT = [
  ("top_k", dict(temperature=jnp.ones(2), top_k=jnp.full(2, 3.0), top_p=jnp.ones(2))),
  ("temperature", dict(temperature=jnp.ones(2, jnp.int32), top_k=jnp.zeros(2, jnp.int32), top_p=jnp.ones(2))),
  ("top_p", dict(temperature=jnp.ones(2), top_k=jnp.zeros(2, jnp.int32), top_p=jnp.ones(2, jnp.int32))),
]


@pytest.mark.parametrize("name, fields", _DIRECT, ids=[n for n, _ in _DIRECT])
def test_directly_built_params_with_wrong_dtypes_are_rejected_at_trace_time(name, fields):
  params = SamplingParams(**fields)
  with pytest.raises(ValueError, match=f"params.{name} must be"):
    sample_tokens(jnp.zeros((2, V)), params, jax.random.key(0))
  with pytest.raises(ValueError, match=f"params.{name} must be"):
    _st(jnp.zeros((2, V)), params, jax.random.key(0))
  with pytest.raises(ValueError, match=f"params.{name} must be"):
    rejection_sample(np.zeros((2, K), np.int32), np.zeros((2, K + 1, V), np.float32), params, jax.random.key(0))


# ----------------------------------------------------------------------------
# Overflow of logits / T
# ----------------------------------------------------------------------------

# Finite logits near the float32 limit: gaps of >= 1e37 make the argmax's probability 1
# at any temperature <= 0.5, but x / T overflows to +-inf. Token 6 is masked.
_HUGE = np.array(
  [
    [3.0e38, 3.2e38, -3e38, 1.0, 0.0, 3.1e38, -np.inf, 2.0],  # argmax 1
    [-3.0e38, -2.9e38, -3.3e38, -3.1e38, -3.2e38, -3.0e38, -np.inf, -3.0e38],  # all negative: argmax 1
  ],
  np.float32,
)


@pytest.mark.parametrize("temperature", [2e-5, 0.1, 0.5])
def test_huge_logits_small_temperature_process_logits_is_one_hot(temperature):
  for top_k in (0, 2):
    params = SamplingParams.create(np.full(B, temperature, np.float32), top_k=top_k)
    logp = np.asarray(_pl(jnp.asarray(np.tile(_HUGE, (B // 2, 1))), params))
    assert not np.any(np.isnan(logp))
    # Log-probabilities of the others may be finite (-2e38) but their probability is 0.
    np.testing.assert_array_equal(np.exp(logp), np.where(np.arange(V) == 1, 1.0, 0.0)[None].repeat(B, 0))
    assert np.all(logp[:, 6] == -np.inf)


@pytest.mark.parametrize("temperature", [2e-5, 0.1, 0.5])
def test_huge_logits_small_temperature_sample_tokens_is_greedy(temperature):
  logits = jnp.asarray(np.tile(_HUGE, (B // 2, 1)))
  for top_k, top_p in ((0, 1.0), (3, 1.0), (0, 0.9)):
    params = SamplingParams.create(np.full(B, temperature, np.float32), top_k=top_k, top_p=top_p)
    tokens, logp = _st(logits, params, jax.random.key(1))
    np.testing.assert_array_equal(tokens, np.ones(B))
    assert not np.any(np.isnan(np.asarray(logp)))


def _huge_target(b):
  """[b, K+1, V]: every position a column permutation of a _HUGE row; returns (logits, argmax, masked)."""
  rng = np.random.default_rng(0)
  logits = np.empty((b, K + 1, V), np.float32)
  for i in range(b):
    for j in range(K + 1):
      perm = rng.permutation(V)
      logits[i, j] = _HUGE[(i + j) % 2][perm]
  return logits, np.argmax(logits, -1), logits == -np.inf


@pytest.mark.parametrize("temperature", [2e-5, 0.1, 0.5])
def test_huge_logits_small_temperature_rejection_sample(temperature):
  b = B
  logits, best, masked = _huge_target(b)
  one_hot = lambda ids: np.eye(V, dtype=np.float32)[ids]
  for top_k in (0, 2):
    params = SamplingParams.create(np.full(b, temperature, np.float32), top_k=top_k)
    # Drafts equal to the argmax, drawn with probability 1: always accepted, bonus = argmax.
    for probs in (one_hot(best[:, :K]), None):
      out = _rs_np(draft_token_ids=best[:, :K], target_logits=logits, params=params, key=_keys(2, b), draft_probs=probs)
      np.testing.assert_array_equal(out.num_accepted, K)
      np.testing.assert_array_equal(out.token_ids, best)
    # Drafts of the masked token with probability 1: rejected, recovered = argmax.
    masked_ids = np.argmax(masked[:, :K], -1).astype(np.int32)
    for probs in (one_hot(masked_ids), None):
      out = _rs_np(draft_token_ids=masked_ids, target_logits=logits, params=params, key=_keys(3, b), draft_probs=probs)
      np.testing.assert_array_equal(out.num_accepted, 0)
      np.testing.assert_array_equal(out.token_ids[:, 0], best[:, 0])


def test_overflowing_row_leaves_its_neighbours_bit_for_bit():
  rng = np.random.default_rng(3)
  ordinary = rng.normal(0, 2, (B, K + 1, V)).astype(np.float32)
  draft = rng.integers(0, V, (B, K)).astype(np.int32)
  q = rng.dirichlet(np.ones(V), (B, K)).astype(np.float32)
  huge, _, _ = _huge_target(B)
  others = [0, 2, 3, 4, 5, 6, 7]
  for top_k in ([0] * B, [0, 0, 3, 0, 2, 0, 0, 0]):  # unfiltered (chunk draws) and filtered batches
    params = SamplingParams.create([0.7, 0.1, 1.0, 0.1, 0.5, 0.0, 1.0, 2.0], top_k=top_k)
    for probs in (q, None):
      alone = _rs_np(draft_token_ids=draft, target_logits=ordinary, params=params, key=_keys(4, B), draft_probs=probs)
      mixed_logits = ordinary.copy()
      mixed_logits[1] = huge[1]
      mixed = _rs_np(
        draft_token_ids=draft, target_logits=mixed_logits, params=params, key=_keys(4, B), draft_probs=probs
      )
      np.testing.assert_array_equal(mixed.token_ids[others], alone.token_ids[others])
    logp_alone = np.asarray(_pl(jnp.asarray(ordinary[:, 0]), params))
    logp_mixed = np.asarray(_pl(jnp.asarray(mixed_logits[:, 0]), params))
    np.testing.assert_array_equal(logp_mixed[others], logp_alone[others])


# ----------------------------------------------------------------------------
# +inf logits
# ----------------------------------------------------------------------------

_PLUS_INF = np.array([0.0, np.inf, 1.0, -np.inf, np.inf, 2.0, -np.inf, 3.0], np.float32)  # "tokens 1 and 4"


def test_plus_inf_logits_share_the_mass_in_process_logits():
  params = SamplingParams.create(
    [1.0, 0.5, 1.0, 2e-5] * 2, top_k=[0, 1, 3, 0, 2, 0, 0, 7], top_p=[1.0, 1.0, 0.5, 0.9] * 2
  )
  logp = np.asarray(_pl(jnp.asarray(np.tile(_PLUS_INF, (B, 1))), params))
  expected = np.where(np.isin(np.arange(V), [1, 4]), np.log(0.5), -np.inf).astype(np.float32)
  np.testing.assert_allclose(logp, np.tile(expected, (B, 1)), rtol=1e-6)


def test_plus_inf_logits_sample_tokens_never_emit_others():
  b = B
  logits = jnp.asarray(np.tile(_PLUS_INF, (b, 1)))
  params = SamplingParams.create(
    np.where(np.arange(b) % 4 == 0, 0.0, 0.8), top_k=np.arange(b) % 3, top_p=np.where(np.arange(b) % 5 == 0, 0.7, 1.0)
  )
  greedy = np.arange(b) % 4 == 0
  seen = set()
  for seed in range(8):
    tokens = np.asarray(_st(logits, params, _keys(seed, b))[0])
    np.testing.assert_array_equal(tokens[greedy], 1)  # the first +inf token
    seen |= set(tokens[~greedy].tolist())
  assert seen == {1, 4}


def test_plus_inf_logits_rejection_sample_never_emits_others():
  b = B
  rng = np.random.default_rng(6)
  logits = np.stack([np.stack([_PLUS_INF[rng.permutation(V)] for _ in range(K + 1)]) for _ in range(b)])
  allowed = np.isposinf(logits)
  draft = rng.integers(0, V, (b, K)).astype(np.int32)
  q = rng.dirichlet(np.ones(V), (b, K)).astype(np.float32)
  temperature = np.where(np.arange(b) % 4 == 0, 0.0, 1.0).astype(np.float32)
  params = SamplingParams.create(temperature, top_k=np.arange(b) % 3, top_p=np.where(np.arange(b) % 5 == 0, 0.6, 1.0))
  for probs, seed in ((q, 7), (None, 7), (q, 8), (None, 8)):
    out = _rs_np(draft_token_ids=draft, target_logits=logits, params=params, key=_keys(seed, b), draft_probs=probs)
    for i in range(b):
      for j in range(out.num_emitted[i]):
        assert allowed[i, j, out.token_ids[i, j]], (i, j, out.token_ids[i])
      if temperature[i] == 0:  # greedy: the first +inf token
        assert out.token_ids[i, out.num_accepted[i]] == np.argmax(allowed[i, out.num_accepted[i]])


# ----------------------------------------------------------------------------
# draft_probs
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-0.5, np.nan, np.inf, -np.inf])
def test_eager_invalid_draft_probs_raise(bad):
  kwargs = _eager_kwargs()
  kwargs["draft_probs"][1, 1, 5] = bad
  with pytest.raises(ValueError, match="draft_probs must be finite and >= 0"):
    rejection_sample(**kwargs)
  kwargs["num_draft_tokens"] = np.int32([3, 1, 3, 3])
  rejection_sample(**kwargs)  # past n: ignored


def test_under_jit_invalid_draft_probs_count_as_zero_and_never_emit_masked_tokens():
  b = B
  rng = np.random.default_rng(9)
  logits = rng.normal(0, 1, (b, K + 1, V)).astype(np.float32)
  logits[:, :, 6] = -np.inf  # masked
  logits[:, :, 7] = -5.0  # filtered by top_k=4 (the lowest unmasked value)
  q = rng.dirichlet(np.ones(V), (b, K)).astype(np.float32)
  bad = np.array([np.nan, -np.inf, np.inf, -0.5], np.float32)
  q[:, :, 6] = bad[np.arange(b) % 4][:, None]
  q[:, :, 7] = bad[(np.arange(b) + 1) % 4][:, None]
  draft = rng.integers(0, 6, (b, K)).astype(np.int32)
  params = SamplingParams.create(1.0, top_k=np.where(np.arange(b) % 2 == 0, 4, 0))
  for seed in range(8):
    out = _rs_np(draft_token_ids=draft, target_logits=logits, params=params, key=_keys(seed, b), draft_probs=q)
    emitted = out.token_ids[out.token_ids >= 0]
    assert not np.any(emitted == 6)
    filtered_rows = (np.arange(b) % 2 == 0)[:, None] & (out.token_ids == 7)
    assert not np.any(filtered_rows)


def test_under_jit_nan_draft_probability_of_the_draft_counts_as_zero():
  # q(d) = 0 means "accept whenever p(d) > 0" (infinite ratio); NaN, -inf and negative mean the same.
  rng = np.random.default_rng(10)
  logits = rng.normal(0, 0.5, (B, K + 1, V)).astype(np.float32)
  draft = np.full((B, K), 2, np.int32)
  q = rng.dirichlet(np.ones(V), (B, K)).astype(np.float32)
  q[:, :, 2] = np.array([np.nan, -np.inf, -1.0, 0.0] * 2, np.float32)[:, None]
  out = _rs_np(
    draft_token_ids=draft,
    target_logits=logits,
    params=SamplingParams.create(np.ones(B)),
    key=_keys(11, B),
    draft_probs=q,
  )
  np.testing.assert_array_equal(out.num_accepted, K)


# ----------------------------------------------------------------------------
# NaN logits: one rule (NaN = -inf) on every path
# ----------------------------------------------------------------------------

_NAN_ROW = np.array([1.0, np.nan, 3.0, 2.0, np.nan, 0.0, -1.0, 3.0], np.float32)  # greedy: 2


def test_nan_logits_sample_tokens_every_path():
  b = B
  logits = jnp.asarray(np.tile(_NAN_ROW, (b, 1)))
  greedy_params = SamplingParams.greedy(b)
  mixed = SamplingParams.create(np.where(np.arange(b) % 2 == 0, 0.0, 1.0), top_k=np.where(np.arange(b) % 4 == 1, 2, 0))
  static = np.asarray(_st(logits, greedy_params, None, all_greedy=True)[0])
  runtime = np.asarray(_st(logits, greedy_params, jax.random.key(0))[0])
  tokens = np.asarray(_st(logits, mixed, _keys(1, b))[0])
  np.testing.assert_array_equal(static, 2)
  np.testing.assert_array_equal(runtime, 2)
  np.testing.assert_array_equal(tokens[::2], 2)
  assert not np.any(np.isin(tokens, [1, 4]))
  logp = np.asarray(_pl(logits, mixed))
  assert not np.any(np.isnan(logp)) and np.all(logp[:, [1, 4]] == -np.inf)


def test_nan_logits_rejection_sample_every_path():
  b = B
  logits = np.tile(_NAN_ROW, (b, K + 1, 1))
  draft = np.array([[2, 2, 1]] * (b // 2) + [[2, 4, 2]] * (b // 2), np.int32)  # 1 and 4 are NaN tokens
  expected = np.array([[2, 2, 2, -1]] * (b // 2) + [[2, 2, -1, -1]] * (b // 2))
  greedy = SamplingParams.greedy(b)
  outs = {
    "all_greedy_flag": _rs_np(draft_token_ids=draft, target_logits=logits, params=greedy, all_greedy=True),
    "runtime_all_greedy": _rs_np(draft_token_ids=draft, target_logits=logits, params=greedy, key=_keys(0, b)),
  }
  for name, top_k in (("mixed_plain", 0), ("mixed_filtered", 3)):
    params = SamplingParams.create(np.where(np.arange(b) % 2 == 0, 0.0, 1.0), top_k=top_k)
    for probs in (None, np.full((b, K, V), 1.0 / V, np.float32)):
      out = _rs_np(draft_token_ids=draft, target_logits=logits, params=params, key=_keys(1, b), draft_probs=probs)
      outs[f"{name}_{probs is None}"] = out
      emitted = out.token_ids[out.token_ids >= 0]
      assert not np.any(np.isin(emitted, [1, 4])), (name, out.token_ids)
  for name, out in outs.items():
    greedy_rows = slice(None) if "mixed" not in name else slice(0, None, 2)
    np.testing.assert_array_equal(out.token_ids[greedy_rows], expected[greedy_rows], err_msg=name)


def test_eager_nan_logits_raise():
  kwargs = _eager_kwargs()
  kwargs["target_logits"][2, 1, 3] = np.nan
  with pytest.raises(ValueError, match="target_logits holds NaN"):
    rejection_sample(**kwargs)
  with pytest.raises(ValueError, match="logits holds NaN"):
    sample_tokens(jnp.asarray(kwargs["target_logits"][:, 1]), SamplingParams.greedy(4), jax.random.key(0))
  # Positions past num_draft_tokens (the bonus position) are never read: not checked.
  kwargs["num_draft_tokens"] = np.int32([3, 3, 0, 3])
  rejection_sample(**kwargs)


# ----------------------------------------------------------------------------
# A position whose logits are all -inf
# ----------------------------------------------------------------------------


def test_all_masked_position_emits_token_zero_and_accepts_nothing_on_every_path():
  b = B
  rng = np.random.default_rng(12)
  logits = rng.normal(size=(b, K + 1, V)).astype(np.float32)
  logits[:, 1] = -np.inf
  logits[3, 1, 5] = np.nan  # NaN counts as -inf: still no usable logit
  best0 = np.argmax(logits[:, 0], -1).astype(np.int32)
  draft = np.stack([best0, np.zeros(b, np.int32), best0], 1)  # position 1 drafts its "argmax" 0
  one_hot = np.eye(V, dtype=np.float32)[draft]
  cases = {
    "all_greedy_flag": dict(params=SamplingParams.greedy(b), all_greedy=True),
    "runtime_all_greedy": dict(params=SamplingParams.greedy(b), key=_keys(0, b)),
  }
  for top_k in (0, 3):
    params = SamplingParams.create([0.0, 1.0, 0.0, 0.5] * 2, top_k=top_k)
    for probs in (None, one_hot):
      cases[f"mixed_top_k{top_k}_{probs is None}"] = dict(params=params, key=_keys(1, b), draft_probs=probs)
      cases[f"random_top_k{top_k}_{probs is None}"] = dict(
        params=SamplingParams.create(np.full(b, 0.8), top_k=top_k), key=_keys(2, b), draft_probs=probs, all_random=True
      )
  for name, kw in cases.items():
    out = _rs_np(draft_token_ids=draft, target_logits=logits, **kw)
    # Position 0 may or may not accept (random rows); position 1 never accepts and emits 0.
    reached = out.num_accepted >= 1
    assert np.all(out.num_accepted <= 1), (name, out.token_ids)
    np.testing.assert_array_equal(out.token_ids[reached, 1], 0, err_msg=name)
    greedy_rows = np.asarray(kw["params"].is_greedy) & ("random" not in name)
    assert np.all(reached[greedy_rows]), name


def test_all_masked_bonus_position_emits_token_zero():
  b = B
  logits = np.full((b, K + 1, V), -np.inf, np.float32)
  for params, flags in (
    (SamplingParams.create([0.0, 1.0, 0.3, 1.0] * 2, top_k=[0, 0, 2, 0] * 2), {}),
    (SamplingParams.create(np.ones(b)), {"all_random": True}),
    (SamplingParams.greedy(b), {"all_greedy": True}),
  ):
    out = _rs_np(
      draft_token_ids=np.zeros((b, K), np.int32),
      target_logits=logits,
      params=params,
      key=_keys(4, b),
      num_draft_tokens=np.zeros(b, np.int32),
      **flags,
    )
    np.testing.assert_array_equal(out.token_ids, [[0, -1, -1, -1]] * b)
    np.testing.assert_array_equal(out.num_accepted, 0)


def test_all_masked_row_in_sample_tokens_and_process_logits():
  logits = np.zeros((B, V), np.float32)
  logits[1] = -np.inf
  logits[3] = -np.inf
  logits[3, 2] = np.nan
  params = SamplingParams.create([0.0, 0.0, 1.0, 0.7] * 2, top_k=[0, 0, 0, 3] * 2)
  for p in (params, SamplingParams.create(np.ones(B))):
    tokens, logp = _st(jnp.asarray(logits), p, _keys(0, B))
    np.testing.assert_array_equal(np.asarray(tokens)[[1, 3]], 0)
    np.testing.assert_array_equal(np.asarray(logp)[[1, 3]], -np.inf)
    out = np.asarray(_pl(jnp.asarray(logits), p))
    np.testing.assert_array_equal(out[[1, 3]], -np.inf)
    assert not np.any(np.isnan(out))
  tokens, _ = _st(jnp.asarray(logits), SamplingParams.greedy(B), None, all_greedy=True)
  np.testing.assert_array_equal(np.asarray(tokens)[[1, 3]], 0)


def test_eager_all_masked_position_raises():
  kwargs = _eager_kwargs()
  kwargs["target_logits"][1, 2] = -np.inf
  with pytest.raises(ValueError, match="target_logits has no value above -inf"):
    rejection_sample(**kwargs)
  with pytest.raises(ValueError, match="logits has no value above -inf"):
    sample_tokens(jnp.asarray(kwargs["target_logits"][:, 2]), kwargs["params"], jax.random.key(0))
  # Position 2 is past row 1's bonus position: fine.
  kwargs["num_draft_tokens"] = np.int32([3, 1, 3, 3])
  rejection_sample(**kwargs)


# ----------------------------------------------------------------------------
# jax_enable_x64
# ----------------------------------------------------------------------------


@contextlib.contextmanager
def _x64():
  jax.config.update("jax_enable_x64", True)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", False)


def _x64_cases(names):
  """Sampler paths by name; returns a dict name -> tuple of outputs."""
  rng = np.random.default_rng(13)
  logits = rng.normal(0, 2, (B, K + 1, V)).astype(np.float32)
  draft = rng.integers(0, V, (B, K)).astype(np.int32)
  q = rng.dirichlet(np.ones(V), (B, K)).astype(np.float32)
  n = np.int32([3, 0, 1, 2, 3, 2, 3, 1])
  temperature = np.float32([0.0, 1.0, 0.5, 0.0, 2.0, 1.0, 0.7, 0.0])
  mixed = SamplingParams.create(temperature, top_k=[0, 0, 3, 0, 0, 2, 0, 4], top_p=[1, 0.8, 1, 1, 1, 0.9, 1, 1])
  plain = SamplingParams.create(temperature)
  key = jax.random.key(14)
  rs_cases = {
    "rs_all_greedy": dict(params=SamplingParams.greedy(B), all_greedy=True, num_draft_tokens=n),
    "rs_runtime_greedy": dict(params=SamplingParams.greedy(B), key=key),
    "rs_mixed_filtered_probs_ragged": dict(params=mixed, key=key, draft_probs=q, num_draft_tokens=n),
    "rs_mixed_plain_ngram_ragged": dict(params=plain, key=key, num_draft_tokens=n),
    "rs_random_probs": dict(params=plain, key=key, draft_probs=q, all_random=True),
    "rs_random_filtered_ngram": dict(params=mixed, key=key, all_random=True),
  }
  st_cases = {
    "st_greedy": (SamplingParams.greedy(B), True),
    "st_mixed_filtered": (mixed, False),
    "st_plain": (plain, False),
  }
  out = {}
  for name in names:
    if name in rs_cases:
      res = _rs(draft_token_ids=draft, target_logits=logits, **rs_cases[name])
      out[name] = (res.token_ids, res.num_accepted, res.num_emitted)
    elif name in st_cases:
      out[name] = _st(jnp.asarray(logits[:, 0]), st_cases[name][0], key, all_greedy=st_cases[name][1])
    else:
      out[name] = (_pl(jnp.asarray(logits[:, 0]), mixed),)
  return out


def _check_x64(names):
  ref = _x64_cases(names)
  with _x64():
    got = _x64_cases(names)
    dtypes = {name: [a.dtype for a in arrays] for name, arrays in got.items()}
    got = {name: [np.asarray(a) for a in arrays] for name, arrays in got.items()}
  for name, arrays in ref.items():
    for r, g, dt in zip(arrays, got[name], dtypes[name]):
      assert dt == r.dtype and dt in (jnp.int32, jnp.float32), (name, dt)
      np.testing.assert_array_equal(g, np.asarray(r), err_msg=name)


def test_sampler_runs_under_x64_with_the_same_outputs():
  # Each path compiles once more under x64: the fast set takes the paths with the most code.
  _check_x64(["rs_all_greedy", "rs_mixed_filtered_probs_ragged", "st_greedy", "st_mixed_filtered"])


@pytest.mark.slow
def test_sampler_runs_under_x64_with_the_same_outputs_every_path():
  _check_x64(
    [
      "rs_all_greedy",
      "rs_runtime_greedy",
      "rs_mixed_filtered_probs_ragged",
      "rs_mixed_plain_ngram_ragged",
      "rs_random_probs",
      "rs_random_filtered_ngram",
      "st_greedy",
      "st_mixed_filtered",
      "st_plain",
      "process_logits",
    ]
  )
