"""Tests for specdec_jax/models: config, transformer, KV cache, weights interface."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specdec_jax.models import KVCache, Transformer, TransformerConfig, weight_shapes
from specdec_jax.models.transformer import on_fixed_rows
from tests.support.invariance import step_and_verify

TINY = TransformerConfig.tiny(vocab_size=64)  # L=2, D=32, H=4, Hkv=2, Dh=8, F=64
# Shared shapes keep the number of compilations (the cost of this file) small.
BATCH, PROMPT, MAX_LENGTH = 3, 7, 24
BIASES = ("layers.bq", "layers.bk", "layers.bv")


@pytest.fixture(autouse=True)
def _strict_numerics():
  # Implicit broadcasting between ranks hides shape bugs; the model must not rely
  # on it. Full f32 matmuls keep the 1e-5 comparisons meaningful on GPUs, whose
  # default f32 matmul precision is TF32 (errors around 1e-3).
  with jax.numpy_rank_promotion("raise"), jax.default_matmul_precision("highest"):
    yield


def _random_weights(config: TransformerConfig, seed: int = 0) -> dict[str, np.ndarray]:
  """Weights at unit scale (std 1/sqrt(fan_in)), so attention is far from uniform; q/k/v biases of std 0.5."""
  rng = np.random.default_rng(seed)
  weights = {}
  for name, shape in weight_shapes(config).items():
    if name.endswith("norm"):
      weights[name] = 1.0 + 0.2 * rng.standard_normal(shape)
    elif name == "embed":
      weights[name] = rng.standard_normal(shape)
    elif name in BIASES:
      weights[name] = 0.5 * rng.standard_normal(shape)
    else:
      weights[name] = rng.standard_normal(shape) / np.sqrt(shape[-2])
  return {k: v.astype(np.float32) for k, v in weights.items()}


@functools.partial(jax.jit, static_argnums=0)
def _step(graphdef, state, tokens, positions, cache):
  return nnx.merge(graphdef, state)(tokens, positions, cache)


def _jit(model: Transformer):
  """Jits the model the way the loop does: split once, merge inside a pure function.

  The program is cached on (graphdef, shapes), so tests that use the same config
  and shapes share one compilation.
  """
  graphdef, state = nnx.split(model)
  return lambda tokens, positions, cache: _step(graphdef, state, tokens, positions, cache)


def _arange_positions(batch_size: int, length: int) -> jax.Array:
  return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch_size, length))


def _numpy_forward(config: TransformerConfig, w: dict[str, np.ndarray], tokens: np.ndarray, hidden=None):
  """Independent float64 reference: one sequence [N] -> logits [N, V], no cache.

  Reads the `weight_shapes` dict (x @ W orientation; q/k/v biases added where `w` has them, whatever the
  config says, so a model that ignored them would disagree). If `hidden` is a list, each block's output
  (the residual stream, [N, D]) is appended to it.
  """
  w = {k: v.astype(np.float64) for k, v in w.items()}
  n, h, hkv, dh = len(tokens), config.num_heads, config.num_kv_heads, config.head_dim

  def norm(x, g):
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + config.rms_norm_eps) * g

  angles = np.arange(n)[:, None] * config.rope_theta ** (-np.arange(0, dh, 2) / dh)  # [N, Dh/2]
  cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]

  def rope(t):  # [N, heads, Dh]; pairs (i, i + Dh/2)
    a, b = t[..., : dh // 2], t[..., dh // 2 :]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

  causal = np.tril(np.ones((n, n), bool))
  x = w["embed"][tokens]
  for l in range(config.num_layers):
    y = norm(x, w["layers.attn_norm"][l])

    def project(name, l=l, y=y):
      bias = w.get(f"layers.b{name}")
      return y @ w[f"layers.w{name}"][l] + (0.0 if bias is None else bias[l])

    q = rope(project("q").reshape(n, h, dh))
    # GQA: consecutive query heads share a kv head (head i reads kv head i // (H / Hkv)).
    k = np.repeat(rope(project("k").reshape(n, hkv, dh)), h // hkv, axis=1)
    v = np.repeat(project("v").reshape(n, hkv, dh), h // hkv, axis=1)
    s = np.where(causal, np.einsum("qhd,khd->hqk", q, k) / np.sqrt(dh), -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    x = x + np.einsum("hqk,khd->qhd", p, v).reshape(n, h * dh) @ w["layers.wo"][l]
    y = norm(x, w["layers.mlp_norm"][l])
    gate = y @ w["layers.w_gate"][l]
    x = x + (gate / (1 + np.exp(-gate)) * (y @ w["layers.w_up"][l])) @ w["layers.w_down"][l]
    if hidden is not None:
      hidden.append(x)
  x = norm(x, w["final_norm"])
  return x @ (w["embed"].T if config.tie_embeddings else w["lm_head"])


# --- numerics ---------------------------------------------------------------


def _tokens(seed: int, shape=(BATCH, PROMPT)) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, TINY.vocab_size, size=shape).astype(np.int32)


def _prefill(model, tokens, lengths=None, pad_id=-1):
  """Prefills `tokens[:, :PROMPT]`, right-padded with `pad_id` after each row's length.

  Returns (logits [B, PROMPT, V], cache with MAX_LENGTH slots).
  """
  prompt = tokens[:, :PROMPT]
  if lengths is not None:
    prompt = np.where(np.arange(PROMPT)[None, :] < lengths[:, None], prompt, pad_id)
  cache = model.init_cache(len(prompt), MAX_LENGTH)
  return _jit(model)(jnp.asarray(prompt), _arange_positions(len(prompt), PROMPT), cache)


@pytest.mark.parametrize("tie_embeddings", [True, False])
def test_forward_matches_numpy_reference(tie_embeddings):
  config = TINY.replace(tie_embeddings=tie_embeddings)
  weights = _random_weights(config, seed=1)
  tokens = _tokens(2)
  logits, _ = _prefill(Transformer.from_weights(config, weights), tokens)
  assert logits.dtype == jnp.float32
  for b in range(BATCH):
    expected = _numpy_forward(config, weights, tokens[b])
    np.testing.assert_allclose(logits[b], expected, rtol=1e-4, atol=1e-4)


def test_features_are_the_hidden_states_of_a_forward_without_cache():
  """return_features gives the outputs of the feature_layers blocks, concatenated in their order."""
  config = TINY.replace(num_layers=3, feature_layers=(2, 0))
  weights = _random_weights(config, seed=4)
  model = Transformer.from_weights(config, weights)
  tokens = _tokens(5)
  positions = _arange_positions(BATCH, PROMPT)
  graphdef, state = nnx.split(model)
  logits, features, _ = jax.jit(lambda s, t, p, c: nnx.merge(graphdef, s)(t, p, c, return_features=True))(
    state, jnp.asarray(tokens), positions, model.init_cache(BATCH, MAX_LENGTH)
  )
  assert features.shape == (BATCH, PROMPT, 2 * config.d_model) == (BATCH, PROMPT, config.feature_size)
  plain_logits, _ = _jit(model)(jnp.asarray(tokens), positions, model.init_cache(BATCH, MAX_LENGTH))
  np.testing.assert_array_equal(logits, plain_logits)
  for b in range(BATCH):
    hidden = []
    _numpy_forward(config, weights, tokens[b], hidden)
    np.testing.assert_allclose(features[b], np.concatenate([hidden[2], hidden[0]], -1), rtol=1e-4, atol=1e-4)


def test_feature_layers_cost_nothing_without_the_flag():
  """A config with feature_layers lowers to the same program as one without, when features are not asked for."""

  def program(config, **kw):
    model = Transformer(config, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jnp.zeros((2, 3), jnp.int32)
    step = jax.jit(lambda state, t, p, c: nnx.merge(graphdef, state)(t, p, c, **kw))
    return step.lower(state, tokens, tokens, model.init_cache(2, 8)).as_text()

  without = program(TINY)
  assert program(TINY.replace(feature_layers=(0, 1))) == without
  assert program(TINY.replace(feature_layers=(1,)), return_features=False) == without
  assert program(TINY.replace(feature_layers=(1,)), return_features=True) != without


@pytest.mark.parametrize("chunk", [1, 3])
def test_cached_decoding_matches_full_forward(chunk):
  """Ragged prefill, then chunks at per-row positions, equal one uncached forward.

  With chunk=3 the chunk's trailing tokens are sometimes wrong (like rejected
  drafts): the row then advances only past its leading correct tokens and the
  next chunk overwrites the junk slots. Logits are compared only where every
  token up to that position was right.
  """
  model = Transformer.from_weights(TINY, _random_weights(TINY, seed=3))
  forward = _jit(model)
  rng = np.random.default_rng(4)
  n = MAX_LENGTH  # the full sequence fills the cache
  tokens = _tokens(5, (BATCH, n + chunk))
  full_cache = model.init_cache(BATCH, n)
  expected, _ = forward(jnp.asarray(tokens[:, :n]), _arange_positions(BATCH, n), full_cache)
  expected = np.asarray(expected)  # [B, N, V], no cache involved

  lengths = np.array([5, 2, PROMPT])
  logits, cache = _prefill(model, tokens, lengths, pad_id=-1)
  checked = np.zeros((BATCH, n), bool)
  for b, length in enumerate(lengths):
    np.testing.assert_allclose(logits[b, :length], expected[b, :length], rtol=1e-5, atol=1e-5)
    checked[b, :length] = True

  next_pos = lengths.copy()  # first position not yet in the cache, per row
  while (next_pos < n).any():
    positions = next_pos[:, None] + np.arange(chunk)[None, :]  # [B, chunk]; may pass n: dropped
    chunk_tokens = np.take_along_axis(tokens, np.minimum(positions, n + chunk - 1), axis=1)
    # Corrupt trailing tokens at random (never the first: every round makes progress).
    wrong = (rng.random((BATCH, chunk)) < 0.3) & (np.arange(chunk)[None, :] > 0)
    chunk_tokens = np.where(wrong, (chunk_tokens + 1) % TINY.vocab_size, chunk_tokens)
    logits, cache = forward(jnp.asarray(chunk_tokens), jnp.asarray(positions, jnp.int32), cache)
    num_good = np.where(wrong.any(1), wrong.argmax(1), chunk)  # leading correct tokens
    for b in range(BATCH):
      for t in range(num_good[b]):
        if positions[b, t] < n:
          want = expected[b, positions[b, t]]
          np.testing.assert_allclose(logits[b, t], want, rtol=1e-5, atol=1e-5)
          checked[b, positions[b, t]] = True
    next_pos = next_pos + num_good
  assert checked.all()


def test_write_outside_cache_is_dropped():
  model = Transformer.from_weights(TINY, _random_weights(TINY, seed=5))
  forward = _jit(model)
  _, cache = _prefill(model, _tokens(6))
  # Fill the last slots too, so that a clamped write would show.
  tail = _arange_positions(BATCH, 3) + (MAX_LENGTH - 3)
  _, cache = forward(jnp.asarray(_tokens(7, (BATCH, 3))), tail, cache)
  assert np.abs(np.asarray(cache.k[:, :, :, -1])).min() > 0

  # Neither a clamping write (dynamic_update_slice) nor a wrapping one (x[-1])
  # may touch any slot.
  s = MAX_LENGTH
  positions = jnp.array([[s, s + 3, -1], [-2, s + 1, 100], [-1, -1, -1]], jnp.int32)
  logits, new_cache = forward(jnp.asarray(_tokens(8, (BATCH, 3))), positions, cache)
  np.testing.assert_array_equal(new_cache.k, cache.k)
  np.testing.assert_array_equal(new_cache.v, cache.v)
  assert np.isfinite(logits).all()


def test_query_never_sees_later_slots():
  model = Transformer.from_weights(TINY, _random_weights(TINY, seed=9))
  forward = _jit(model)
  _, cache = _prefill(model, _tokens(10))
  query_pos = np.array([3, 6, 0])  # per row
  later = np.arange(MAX_LENGTH)[None, :] > query_pos[:, None]  # [B, S]
  later = later[None, :, None, :, None]  # [1, B, 1, S, 1]
  noise = 100 * np.random.default_rng(11).standard_normal(cache.k.shape).astype(np.float32)
  scrambled = KVCache(
    k=jnp.asarray(np.where(later, noise, cache.k)),
    v=jnp.asarray(np.where(later, -noise, cache.v)),
  )

  query_tokens = jnp.array([[5], [9], [1]], jnp.int32)
  logits, _ = forward(query_tokens, jnp.asarray(query_pos[:, None], jnp.int32), cache)
  logits_scrambled, _ = forward(query_tokens, jnp.asarray(query_pos[:, None], jnp.int32), scrambled)
  np.testing.assert_array_equal(logits, logits_scrambled)
  # Sanity: the scrambled slots do change what a query at the last slot sees.
  last = jnp.full((BATCH, 1), MAX_LENGTH - 1, jnp.int32)
  logits_last, _ = forward(query_tokens, last, cache)
  logits_last_scrambled, _ = forward(query_tokens, last, scrambled)
  assert not np.allclose(logits_last, logits_last_scrambled)


# --- q/k/v biases (Qwen2) ----------------------------------------------------------

BIASED = TINY.replace(qkv_bias=True, tie_embeddings=False)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_biased_model_matches_numpy_reference_in_prefill_and_decode(scan_layers):
  """q/k/v biases and an untied head: a ragged prefill, then one-token cached steps at per-row positions, equal the
  float64 reference. The same weights with the biases zeroed give other logits (so an ignored bias fails), and
  those equal a model without biases (qkv_bias=False) built from the rest of the weights."""
  config = BIASED.replace(scan_layers=scan_layers)
  weights = _random_weights(config, seed=21)
  model = Transformer.from_weights(config, weights)
  n = PROMPT + 4
  tokens = _tokens(22, (BATCH, n))
  expected = [_numpy_forward(config, weights, tokens[b]) for b in range(BATCH)]  # [N, V] per row, no cache
  lengths = np.array([PROMPT, 3, 5])
  logits, cache = _prefill(model, tokens, lengths)
  for b, length in enumerate(lengths):
    np.testing.assert_allclose(logits[b, :length], expected[b][:length], rtol=1e-4, atol=1e-4)
  forward, pos = _jit(model), lengths.copy()
  for _ in range(n - PROMPT):  # every row stays below n
    step_tokens = jnp.asarray(tokens[np.arange(BATCH), pos][:, None])
    step, cache = forward(step_tokens, jnp.asarray(pos[:, None], jnp.int32), cache)
    for b in range(BATCH):
      np.testing.assert_allclose(step[b, 0], expected[b][pos[b]], rtol=1e-4, atol=1e-4)
    pos = pos + 1

  zeroed, _ = _prefill(Transformer.from_weights(config, {**weights, **{k: 0 * weights[k] for k in BIASES}}), tokens)
  biased, _ = _prefill(model, tokens)
  assert np.abs(np.asarray(zeroed) - np.asarray(biased)).max() > 0.1
  unbiased = Transformer.from_weights(
    config.replace(qkv_bias=False), {k: v for k, v in weights.items() if k not in BIASES}
  )
  np.testing.assert_allclose(_prefill(unbiased, tokens)[0], zeroed, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_biases_round_trip_exactly_and_are_fused_beside_wqkv(dtype):
  config = BIASED.replace(dtype=dtype)
  model = Transformer(config, rngs=nnx.Rngs(0))
  weights = model.to_weights()
  assert {k: v.shape for k, v in weights.items()} == weight_shapes(config)
  assert all(np.abs(np.asarray(weights[k], np.float32)).max() > 0 for k in BIASES)  # random init: small, not zero
  again = Transformer.from_weights(config, weights).to_weights()
  assert weights.keys() == again.keys()
  for name in weights:
    np.testing.assert_array_equal(again[name], weights[name], err_msg=name)
  for cfg in (config, config.replace(scan_layers=True)):
    fused = {n: np.asarray(a) for n, a in Transformer.from_weights(cfg, weights).layers.stacked(cfg).items()}
    assert {"wq", "wk", "wv", "bq", "bk", "bv"}.isdisjoint(fused)
    np.testing.assert_array_equal(fused["bqkv"], np.concatenate([weights[k] for k in BIASES], axis=-1))


def test_without_qkv_bias_the_model_holds_no_bias():
  """The flag off (the default) leaves the weights interface and the parameters as before biases existed."""
  plain, biased = weight_shapes(TINY), weight_shapes(TINY.replace(qkv_bias=True))
  assert not TINY.qkv_bias and set(biased) - set(plain) == set(BIASES) and set(plain) <= set(biased)
  q, kv = TINY.num_heads * TINY.head_dim, TINY.num_kv_heads * TINY.head_dim
  assert (biased["layers.bq"], biased["layers.bk"], biased["layers.bv"]) == ((2, q), (2, kv), (2, kv))
  model = Transformer(TINY, rngs=nnx.Rngs(0))
  assert model.layers.block0.names == ("attn_norm", "wo", "mlp_norm", "w_down", "wqkv", "w_gate_up")
  scanned = Transformer(TINY.replace(scan_layers=True), rngs=nnx.Rngs(0))
  paths = {path for path, _ in nnx.to_flat_state(nnx.state(scanned, nnx.Param))}
  assert {p[-1] for p in paths} == {"embed", "final_norm", "attn_norm", "mlp_norm", "w_down", "w_gate_up", "wo", "wqkv"}
  assert set(model.to_weights()) == set(plain)


def test_from_weights_names_missing_and_unexpected_biases():
  weights = _random_weights(BIASED)
  with pytest.raises(ValueError, match=r"missing key\(s\) \['layers\.bq'\] \(config\.qkv_bias is True\)"):
    Transformer.from_weights(BIASED, {k: v for k, v in weights.items() if k != "layers.bq"})
  with pytest.raises(ValueError, match=r"unexpected key\(s\) .*'layers\.bk'.*\(config\.qkv_bias is False\)"):
    Transformer.from_weights(BIASED.replace(qkv_bias=False), weights)
  with pytest.raises(ValueError, match=r"layers\.bv.*\(2, 16\)"):
    Transformer.from_weights(BIASED, {**weights, "layers.bv": np.zeros((2, 32), np.float32)})


# --- dtypes and the weights interface ------------------------------------------


@pytest.mark.parametrize("tie_embeddings", [True, False])
def test_bf16_runs_and_is_close_to_f32(tie_embeddings):
  config = TINY.replace(tie_embeddings=tie_embeddings)
  weights = _random_weights(config, seed=12)
  tokens = _tokens(13)
  outputs = {}
  for dtype in (jnp.float32, jnp.bfloat16):
    model = Transformer.from_weights(config.replace(dtype=dtype), weights)
    logits, cache = _prefill(model, tokens)
    assert logits.dtype == jnp.float32 and cache.k.dtype == dtype and cache.v.dtype == dtype
    assert np.isfinite(logits).all()
    outputs[dtype] = np.asarray(logits)
  scale = np.abs(outputs[jnp.float32]).max()
  np.testing.assert_allclose(outputs[jnp.bfloat16], outputs[jnp.float32], atol=0.1 * scale)


@pytest.mark.parametrize("tie_embeddings", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_weights_round_trip_exactly(tie_embeddings, dtype):
  config = TINY.replace(tie_embeddings=tie_embeddings, dtype=dtype)
  model = Transformer(config, rngs=nnx.Rngs(0))
  weights = model.to_weights()
  assert {k: v.shape for k, v in weights.items()} == weight_shapes(config)
  assert ("lm_head" in weights) == (not tie_embeddings)
  assert all(v.dtype == dtype for v in weights.values())
  again = Transformer.from_weights(config, weights).to_weights()
  assert weights.keys() == again.keys()
  for name in weights:
    np.testing.assert_array_equal(again[name], weights[name], err_msg=name)


def test_from_weights_casts_to_config_dtype():
  config = TINY.replace(dtype=jnp.bfloat16)
  weights = _random_weights(config)  # float32
  restored = Transformer.from_weights(config, weights).to_weights()
  for name, value in weights.items():
    assert restored[name].dtype == jnp.bfloat16
    np.testing.assert_array_equal(restored[name], value.astype(jnp.bfloat16))


def test_from_weights_rejects_bad_keys_and_shapes():
  weights = _random_weights(TINY)
  missing = {k: v for k, v in weights.items() if k != "layers.wk"}
  with pytest.raises(ValueError, match="layers.wk"):
    Transformer.from_weights(TINY, missing)
  with pytest.raises(ValueError, match="lm_head"):
    Transformer.from_weights(TINY, {**weights, "lm_head": np.zeros((32, 64), np.float32)})
  with pytest.raises(ValueError, match="lm_head"):  # untied needs it
    Transformer.from_weights(TINY.replace(tie_embeddings=False), weights)
  with pytest.raises(ValueError, match=r"layers\.wo.*\(2, 32, 32\)"):
    Transformer.from_weights(TINY, {**weights, "layers.wo": np.zeros((2, 32, 16), np.float32)})
  with pytest.raises(ValueError, match="final_norm"):
    Transformer.from_weights(TINY, {**weights, "final_norm": np.zeros((1, 32), np.float32)})


# --- validation -----------------------------------------------------------------


@pytest.mark.parametrize(
  "field, value",
  [
    ("vocab_size", 0),
    ("num_layers", -1),
    ("d_model", 2.0),
    ("num_heads", True),
    ("num_kv_heads", 3),  # 4 % 3 != 0
    ("head_dim", 7),  # odd: RoPE needs pairs
    ("d_ff", 0),
    ("rope_theta", 0.0),
    ("rms_norm_eps", -1e-6),
    ("dtype", jnp.int32),
    ("qkv_bias", 1),
    ("qkv_bias", None),
  ],
)
def test_config_rejects_bad_fields(field, value):
  match = "num_heads" if field == "num_kv_heads" else field
  with pytest.raises(ValueError, match=match):
    TINY.replace(**{field: value})


def test_config_is_hashable_frozen_and_static():
  assert TINY.replace(dtype="float32") == TINY
  assert hash(TINY.replace(dtype=np.float32)) == hash(TINY)
  assert TINY.replace(dtype=jnp.bfloat16) != TINY
  with pytest.raises(dataclasses.FrozenInstanceError):
    TINY.num_layers = 3  # type: ignore[misc]
  assert jax.tree.leaves(TINY) == []  # rides through jit as static structure


def test_call_rejects_bad_shapes_at_trace_time():
  model = Transformer(TINY, rngs=nnx.Rngs(0))
  cache = jax.eval_shape(lambda: model.init_cache(2, 8))
  ok_tokens = jax.ShapeDtypeStruct((2, 3), jnp.int32)
  logits, new_cache = jax.eval_shape(model, ok_tokens, ok_tokens, cache)
  assert logits.shape == (2, 3, 64) and logits.dtype == jnp.float32
  assert new_cache.k.shape == (2, 2, 2, 8, 8)  # [L, B, Hkv, S, Dh]

  cases = [
    ("tokens", jax.ShapeDtypeStruct((3,), jnp.int32), ok_tokens, cache),
    ("positions", ok_tokens, jax.ShapeDtypeStruct((2, 3, 1), jnp.int32), cache),
    ("positions", ok_tokens, jax.ShapeDtypeStruct((2, 4), jnp.int32), cache),
    ("tokens", jax.ShapeDtypeStruct((2, 3), jnp.float32), ok_tokens, cache),
    ("cache.k", jax.ShapeDtypeStruct((3, 3), jnp.int32), ok_tokens.update(shape=(3, 3)), cache),
    ("cache", ok_tokens, ok_tokens, (cache.k, cache.v)),
  ]
  for name, tokens, positions, c in cases:
    with pytest.raises(ValueError, match=name):
      jax.eval_shape(model, tokens, positions, c)
  with pytest.raises(ValueError, match="max_length"):
    model.init_cache(2, 0)


# --- compile cost -----------------------------------------------------------------


def test_program_size_does_not_grow_with_depth_under_scan_layers():
  """With scan_layers=True the layers are scanned: 8 layers lower to the same program as 2, up to shapes."""

  def program(num_layers):
    model = Transformer(TINY.replace(num_layers=num_layers, scan_layers=True), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jnp.zeros((2, 3), jnp.int32)
    cache = model.init_cache(2, 8)
    step = jax.jit(lambda state, t, p, c: nnx.merge(graphdef, state)(t, p, c))
    return step.lower(state, tokens, tokens, cache).as_text()

  shallow, deep = program(2), program(8)
  assert "stablehlo.while" in shallow
  assert len(deep.splitlines()) == len(shallow.splitlines())
  assert len(deep) < 1.05 * len(shallow)


def test_unrolled_and_scanned_layers_agree():
  """The default (unrolled, straight-line) and scan_layers=True compute the same logits, features and cache."""
  cfg = TINY.replace(num_layers=3, feature_layers=(0, 2))
  unrolled = Transformer(cfg, rngs=nnx.Rngs(1))
  scanned = Transformer.from_weights(cfg.replace(scan_layers=True), unrolled.to_weights())
  tokens = jnp.array([[3, 9, 1, 4], [7, 7, 2, 0]], jnp.int32)
  positions = jnp.array([[0, 1, 2, 3], [0, 1, 2, -1]], jnp.int32)  # -1: dropped write
  outs = [m(tokens, positions, m.init_cache(2, 6), return_features=True) for m in (unrolled, scanned)]
  for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  graphdef, state = nnx.split(unrolled)
  text = (
    jax.jit(lambda s, t, p, c: nnx.merge(graphdef, s)(t, p, c))
    .lower(state, tokens, positions, unrolled.init_cache(2, 6))
    .as_text()
  )
  assert "stablehlo.while" not in text  # straight-line: no per-layer loop iterations at run time


def test_fused_projections_round_trip_through_the_weights_interface():
  """The model holds q|k|v and gate|up fused; from_weights/to_weights keep the interface's separate arrays exact."""
  model = Transformer(TINY, rngs=nnx.Rngs(2))
  w = model.to_weights()
  assert set(w) == set(weight_shapes(TINY))
  for name, shape in weight_shapes(TINY).items():
    assert w[name].shape == shape, name
  clone = Transformer.from_weights(TINY, w).to_weights()
  for name in w:
    np.testing.assert_array_equal(clone[name], w[name])
  q, kv = TINY.num_heads * TINY.head_dim, TINY.num_kv_heads * TINY.head_dim
  for cfg in (TINY, TINY.replace(scan_layers=True)):
    fused = {n: np.asarray(a) for n, a in Transformer.from_weights(cfg, w).layers.stacked(cfg).items()}
    assert fused["wqkv"].shape == (TINY.num_layers, TINY.d_model, q + 2 * kv)
    np.testing.assert_array_equal(fused["wqkv"][..., q : q + kv], w["layers.wk"])  # k sits between q and v
    np.testing.assert_array_equal(fused["w_gate_up"][..., TINY.d_ff :], w["layers.w_up"])


def test_small_chain_calls_on_a_gpu_are_padded_to_a_fixed_shape(monkeypatch):
  """On a GPU, XLA's blocks run a chain call of B*T <= 16 rows at T = 16 // B: a token's logits are then the
  same bits in a step and in a verification (greedy speculation equals plain greedy decoding), the padding
  writes nothing, and the logits equal the unpadded call's to rounding. Simulated here by reporting a GPU."""
  # Wide enough that XLA:CPU, too, rounds a one-row product differently from a four-row one.
  config = TINY.replace(d_model=256, num_heads=4, head_dim=64, d_ff=512, vocab_size=512)
  model = Transformer(config, rngs=nnx.Rngs(5))
  tokens = jnp.asarray([[3, 9, 4, 1, 7, 2, 8, 5, 6, 10]], jnp.int32)
  plain_together, plain_steps, plain_cache, _ = step_and_verify(model, tokens, 6, 32)
  assert not np.array_equal(plain_steps, plain_together)  # unpadded, the two differ in the last bits
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  together, steps, cache_after_call, _ = step_and_verify(model, tokens, 6, 32)
  np.testing.assert_array_equal(steps, together)  # batch-invariant
  np.testing.assert_allclose(together, plain_together, rtol=1e-5, atol=1e-5)
  for got, want in zip(jax.tree.leaves(cache_after_call), jax.tree.leaves(plain_cache)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert not np.asarray(got)[:, :, :, tokens.shape[1] :].any()  # the padding rows wrote nothing
  assert model._invariant_length(tokens[:, :3], None, None, None) == 16
  assert model._invariant_length(jnp.zeros((2, 3), jnp.int32), None, None, None) == 8
  assert model._invariant_length(jnp.zeros((1, 17), jnp.int32), None, None, None) is None  # a prefill
  assert model._invariant_length(tokens[:, :3], None, jnp.zeros((1, 3), jnp.int32), None) is None  # a tree


def _between_barriers(rows: int) -> list[str]:
  """The equations `on_fixed_rows` runs between its two optimization barriers, for a call of `rows` rows."""
  w = jnp.ones((8, 3), jnp.bfloat16)
  jaxpr = jax.make_jaxpr(lambda x: on_fixed_rows(lambda r: (r @ w) * 2, x))(jnp.ones((1, rows, 8), jnp.bfloat16))
  eqns = jaxpr.jaxpr.eqns
  barriers = [i for i, e in enumerate(eqns) if e.primitive.name == "optimization_barrier"]
  if len(barriers) != 2:
    return []
  first, second = barriers
  inner = eqns[first + 1 : second]
  # fn must read the first barrier's output and write the second's input, with nothing of B*T in between.
  if not inner or inner[0].invars[0] is not eqns[first].outvars[0]:
    return []
  if eqns[second].invars[0] is not inner[-1].outvars[0]:
    return []
  return [f"{e.primitive.name} {[str(v.aval) for v in e.invars]}" for e in inner]


def test_fixed_row_products_sit_between_barriers_that_hide_the_call_size():
  """On a GPU XLA fuses a product's neighbours into it, so the padding to 16 rows and the slicing back, which
  depend on B*T, would make the product of a one-token step and of a verification call two different fusions,
  which may sum a row in a different order (measured on an H200: one-token steps and 5-token calls parted in
  the logits' last bits on 1 of 8 calls of a real prompt, and greedy speculation parted from plain greedy
  decoding). Between the barriers the computation must be the same for every call size."""
  one = _between_barriers(1)
  assert one, "fn must run between two optimization barriers, reading the first and feeding the second"
  for rows in (2, 5, 16):
    assert _between_barriers(rows) == one
  np.testing.assert_array_equal(
    np.asarray(on_fixed_rows(lambda r: r * 3, jnp.arange(10.0).reshape(2, 1, 5))), 3 * np.arange(10.0).reshape(2, 1, 5)
  )


def test_small_calls_on_a_cpu_keep_their_shape():
  model = Transformer(TINY, rngs=nnx.Rngs(5))
  assert jax.default_backend() != "gpu" or pytest.skip("runs on a CPU")
  assert model._invariant_length(jnp.zeros((1, 3), jnp.int32), None, None, None) is None
