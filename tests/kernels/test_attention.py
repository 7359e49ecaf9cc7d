"""The Pallas blocks (`TransformerConfig(kernels="pallas")`) against XLA's, in interpret mode on the CPU.

The kernels run in Pallas's interpreter here (no GPU): that checks their
indexing, masks, tiling, cache writes and arithmetic, not the Triton compiler.
`test_triton_lowering` also lowers them to Triton IR for a CUDA target (no GPU
needed for that step), so a kernel the Pallas Triton lowering rejects fails
here, not on the H100.

Shapes: D=96 (not a power of two: two K tiles of 64, the second ragged),
H=6 query heads over Hkv=2 key/value heads, Dh=64 (two programs per head with
the default block_h=16, since each half of a head is Dh/2 = 32 columns), S=40
cache slots in blocks of 16 (three slot blocks, the last ragged).

Tolerances, relative to s = |truth| + max |attention branch| where truth is
the float32 computation from the same inputs:
  float32: 1e-5 s. Only the summation order differs (online softmax against a
    two-pass one; the norm's scale applied after the product).
  bfloat16: 2^-6 s. Both `attention_block` and the kernels round q, k, v, the
    attention output and the result to bf16 (8 significant bits: 2^-8 each),
    at slightly different points (the kernels apply the norm's scale after
    the product and divide by the softmax sum after the P V product), so each
    is within a few 2^-8 s of the truth. Observed over 24 seeded cases: the
    kernels at most 0.22 of the bound from the truth and 0.39 from
    `attention_block` in bf16, which is itself 0.24 of it from the truth;
    float32 at most 0.05 of its bound.
  The written cache rows: the same bounds relative to max |k| (or |v|); every
  slot the call does not write is bit-identical.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specdec_jax.kernels import attention, mlp
from specdec_jax.kernels.attention import AttentionBlocks, check_args, fused_attention
from specdec_jax.models import EagleDrafter, Transformer, TransformerConfig
from specdec_jax.models.transformer import AttentionContext, attention_block, rms_norm
from tests.support.invariance import step_and_verify
from tests.support.lowering import cuda_module_text

CFG = TransformerConfig(vocab_size=96, num_layers=2, d_model=96, num_heads=6, num_kv_heads=2, head_dim=64, d_ff=160)
S = 40
SMALL = AttentionBlocks(block_s=16)
# The q|k|v product split over K (D=96 in tiles of 32, two chunks: 2 tiles and 1), its parts summed by a second kernel.
SPLIT = AttentionBlocks(block_s=16, block_k=32, split_k=2)


def _inputs(seed, b, t, dtype):
  k = jax.random.split(jax.random.key(seed), 6)
  d, dh, n = CFG.d_model, CFG.head_dim, (CFG.num_heads + 2 * CFG.num_kv_heads) * CFG.head_dim
  p = {
    "attn_norm": 1 + 0.1 * jax.random.normal(k[0], (d,)),
    "wqkv": jax.random.normal(k[1], (d, n)) / np.sqrt(d),
    "wo": jax.random.normal(k[2], (CFG.num_heads * dh, d)) / np.sqrt(CFG.num_heads * dh),
  }
  x = 2 * jax.random.normal(k[3], (b, t, d))
  shape = (CFG.num_layers, b, CFG.num_kv_heads, S, dh)
  kc, vc = jax.random.normal(k[4], shape), jax.random.normal(k[5], shape)
  cast = lambda a: a.astype(dtype)  # noqa: E731
  return jax.tree.map(cast, p), cast(x), cast(kc), cast(vc)


def _reference(p, x, kc, vc, layer, pos, dtype):
  cfg = CFG.replace(dtype=dtype)
  ctx = AttentionContext.create(pos, S, cfg)
  cast = lambda a: a.astype(dtype)  # noqa: E731
  p, x, kc, vc = jax.tree.map(cast, p), cast(x), cast(kc), cast(vc)
  return attention_block(cfg, x, rms_norm(x, p["attn_norm"], cfg.rms_norm_eps), p, kc, vc, layer, ctx)


def _fused(p, x, kc, vc, layer, pos, blocks=SMALL):
  """`fused_attention` on block parameters p (with its q|k|v bias where p holds "bqkv", as `pallas_block`)."""
  ctx = AttentionContext.create(pos, S, CFG)
  half = CFG.head_dim // 2
  return fused_attention(
    x,
    p["attn_norm"],
    p["wqkv"],
    p["wo"],
    kc,
    vc,
    layer,
    pos,
    ctx.cos[:, :, 0, :half],
    ctx.sin[:, :, 0, :half],
    num_heads=CFG.num_heads,
    num_kv_heads=CFG.num_kv_heads,
    eps=CFG.rms_norm_eps,
    interpret=True,
    blocks=blocks,
    bias=p.get("bqkv"),
  )


def _close(got, want, truth_scale, bound):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  np.testing.assert_array_less(np.abs(got - want), bound * truth_scale)


POSITIONS = {
  (1, 1): [[17]],
  (1, 5): [[20, 21, 22, 23, 24]],
  (2, 3): [[5, 6, 7], [30, 31, 45]],  # 45 >= S: that key is dropped and its query sees every slot
}


# These run with `-m slow` (4-9 s each in the interpreter); CI runs the model test below, which checks float32
# calls of 2 to 10 rows through the Transformer, a dropped write included.
_SLOW = pytest.mark.slow
CASES = [pytest.param(bt, dtype, marks=_SLOW) for bt in POSITIONS for dtype in (jnp.float32, jnp.bfloat16)]


@pytest.mark.parametrize(("bt", "dtype"), CASES)
def test_fused_attention_equals_attention_block(bt, dtype):
  p, x, kc, vc = _inputs(sum(bt), *bt, dtype)
  pos = jnp.asarray(POSITIONS[bt], jnp.int32)
  layer = 1
  out, k_new, v_new = _fused(p, x, kc, vc, layer, pos)
  assert out.shape == x.shape and out.dtype == x.dtype and k_new.dtype == kc.dtype
  truth = _reference(p, x, kc, vc, layer, pos, jnp.float32)
  ref = _reference(p, x, kc, vc, layer, pos, dtype) if dtype != jnp.float32 else truth
  bound = 1e-5 if dtype == jnp.float32 else 2**-6
  xt = np.asarray(x, np.float32)
  scale = np.abs(np.asarray(truth[0])) + np.abs(np.asarray(truth[0]) - xt).max()
  _close(out, truth[0], scale, bound)
  _close(out, ref[0], scale, bound)
  for got, want in ((k_new, truth[1]), (v_new, truth[2])):
    _close(got, want, np.abs(np.asarray(want, np.float32)).max(), bound)
  # Slots this call does not write are untouched, bit for bit (other layer, other slots, dropped writes).
  written = np.zeros(kc.shape, bool)
  for b, row in enumerate(POSITIONS[bt]):
    for position in row:
      if position < S:
        written[layer, b, :, position] = True
  for got, before in ((k_new, kc), (v_new, vc)):
    np.testing.assert_array_equal(np.asarray(got, np.float32)[~written], np.asarray(before, np.float32)[~written])


@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=_SLOW)])
@pytest.mark.parametrize("blocks", [SMALL, SPLIT], ids=["whole", "split_k"])
def test_fused_attention_adds_the_qkv_bias(dtype, blocks):
  """With a q|k|v bias [(H + 2 Hkv) Dh] (Qwen2's) the kernels equal `attention_block` on a block holding it as
  "bqkv" (a 5-row call at layer 1), within the bounds above, with the q|k|v product whole or split over K; the
  reference without the bias is far outside them."""
  p, x, kc, vc = _inputs(5, 1, 5, dtype)
  n = (CFG.num_heads + 2 * CFG.num_kv_heads) * CFG.head_dim
  biased = {**p, "bqkv": (0.5 * jax.random.normal(jax.random.key(9), (n,))).astype(dtype)}
  pos = jnp.asarray(POSITIONS[(1, 5)], jnp.int32)
  out, k_new, v_new = _fused(biased, x, kc, vc, 1, pos, blocks)
  truth = _reference(biased, x, kc, vc, 1, pos, jnp.float32)
  ref = _reference(biased, x, kc, vc, 1, pos, dtype) if dtype != jnp.float32 else truth
  bound = 1e-5 if dtype == jnp.float32 else 2**-6
  scale = np.abs(np.asarray(truth[0])) + np.abs(np.asarray(truth[0]) - np.asarray(x, np.float32)).max()
  for want in (truth, ref):
    _close(out, want[0], scale, bound)
    for got, w in ((k_new, want[1]), (v_new, want[2])):
      _close(got, w, np.abs(np.asarray(w, np.float32)).max(), bound)
  # Without the bias the same bounds fail by far (elements ten times past them): a dropped bias would show.
  unbiased = _reference(p, x, kc, vc, 1, pos, jnp.float32)
  for got, want, s in zip((out, k_new, v_new), unbiased, (scale, *(np.abs(np.asarray(a)).max() for a in truth[1:]))):
    err = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32)) / (bound * s)
    assert err.max() > 10, err.max()


@pytest.mark.slow  # three more interpreted calls (6 s)
def test_every_tiling_gives_the_same_result():
  """Default tiles, one program per head half (block_h = Dh/2), K tiles wider than D, one slot block."""
  p, x, kc, vc = _inputs(7, 1, 5, jnp.float32)
  pos = jnp.asarray([[3, 4, 5, 6, 7]], jnp.int32)
  want = _fused(p, x, kc, vc, 0, pos)
  for blocks in (
    AttentionBlocks(),
    AttentionBlocks(block_h=32, block_k=128, block_s=64),
    AttentionBlocks(block_h=64, block_k=16, block_s=16),
  ):
    got = _fused(p, x, kc, vc, 0, pos, blocks)
    for g, w in zip(got, want):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_refused():
  p, x, kc, vc = _inputs(0, 1, 1, jnp.float32)
  pos = jnp.zeros((1, 1), jnp.int32)
  assert check_args(x, p["wqkv"], p["wo"], kc, CFG.num_heads, CFG.num_kv_heads) is None
  with pytest.raises(ValueError, match="rows"):
    _fused(p, jnp.zeros((1, 17, CFG.d_model)), kc, vc, 0, jnp.zeros((1, 17), jnp.int32))
  with pytest.raises(ValueError, match="wqkv"):
    _fused({**p, "wqkv": p["wqkv"][:, :-1]}, x, kc, vc, 0, pos)
  with pytest.raises(ValueError, match="dtype"):
    _fused(p, x.astype(jnp.bfloat16), kc, vc, 0, pos)
  with pytest.raises(ValueError, match="power of two"):
    _fused(p, x, kc, vc, 0, pos, AttentionBlocks(block_s=24))
  n = p["wqkv"].shape[1]
  assert check_args(x, p["wqkv"], p["wo"], kc, CFG.num_heads, CFG.num_kv_heads, bias=jnp.zeros(n)) is None
  assert "bias" in check_args(x, p["wqkv"], p["wo"], kc, CFG.num_heads, CFG.num_kv_heads, bias=jnp.zeros(n - 1))
  assert "dtype" in check_args(
    x, p["wqkv"], p["wo"], kc, CFG.num_heads, CFG.num_kv_heads, bias=jnp.zeros(n, jnp.bfloat16)
  )
  small_heads = jnp.zeros(kc.shape[:4] + (16,))
  assert "head_dim" in check_args(x, p["wqkv"], p["wo"], small_heads, CFG.num_heads, CFG.num_kv_heads)
  with pytest.raises(ValueError, match="kernels"):
    TransformerConfig(**{**CFG.__dict__, "kernels": "cuda"})


@pytest.fixture(scope="module")
def models():
  # One block: each interpreted kernel is a program of its own for XLA to compile, so a block costs seconds;
  # the kernels' layer indexing is checked above (layer 1 of a 2-layer cache).
  cfg = CFG.replace(num_layers=1)
  xla = Transformer(cfg, rngs=nnx.Rngs(3))
  return xla, Transformer.from_weights(cfg.replace(kernels="pallas_interpret"), xla.to_weights())


def test_model_calls_agree_and_only_calls_of_few_rows_take_the_kernels(models):
  """Prefill of 10 rows, a decode step (one row at a position past the cache), a 5-token verification and a
  tree call (cache_slots, attention_mask: a root and two children, one child's slot past the cache) agree with
  XLA's to float32 rounding; a 20-row prefill is XLA's program, so bit-identical."""
  xla, pallas = models
  call = jax.jit(lambda m, t, p, c: m(t, p, c))
  tree = jax.jit(lambda m, t, p, c, s, a: m(t, p, c, cache_slots=s, attention_mask=a))
  tokens = jnp.asarray(np.arange(40).reshape(2, 20) % CFG.vocab_size, jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(20, dtype=jnp.int32), (2, 20))
  # After 11 tokens: root at slot 11 (position 11), children at slots 12 and 13 (both position 12), each seeing
  # the context, the root and itself; row 1's second child writes past the cache (dropped: it sees the context).
  tree_pos = jnp.asarray([[11, 12, 12], [11, 12, 12]], jnp.int32)
  tree_slots = jnp.asarray([[11, 12, 13], [11, 12, S + 3]], jnp.int32)
  own = jnp.arange(S)[None, None, :] == tree_slots[:, :, None]
  tree_mask = (jnp.arange(S)[None, None, :] <= 11) | own
  caches = {}
  for name, m in (("xla", xla), ("pallas", pallas)):
    cache = m.init_cache(2, S)
    l1, cache = call(m, tokens[:, :5], pos[:, :5], cache)  # 10 rows: the kernels
    step_pos = jnp.asarray([[5], [S + 5]], jnp.int32)  # row 1 past the cache: its write is dropped, it sees all S
    l2, cache = call(m, tokens[:, 5:6], step_pos, cache)
    l3, cache = call(m, tokens[:, 6:11], pos[:, 6:11], cache)
    l4, cache = tree(m, tokens[:, 11:14], tree_pos, cache, tree_slots, tree_mask)
    caches[name] = (l1, l2, l3, l4, cache)
  for got, want in zip(jax.tree.leaves(caches["pallas"]), jax.tree.leaves(caches["xla"])):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  lowered = {n: call.lower(m, tokens, pos, m.init_cache(2, S)).as_text() for n, m in (("xla", xla), ("p", pallas))}
  assert lowered["xla"] == lowered["p"]  # 40 rows: XLA's blocks
  small = {
    n: call.lower(m, tokens[:, :1], pos[:, :1], m.init_cache(2, S)).as_text() for n, m in (("xla", xla), ("p", pallas))
  }
  assert small["xla"] != small["p"]  # 2 rows: the kernels


def test_tree_kernels_false_sends_tree_calls_to_xlas_blocks(models, eagle_heads):
  """`tree_kernels=False`: a tree call (cache_slots, attention_mask) of a target or an EAGLE head on the kernels
  lowers to XLA's blocks' program, while its one-row step keeps the kernels; the default keeps trees on the
  kernels too."""
  xla, pallas = models
  no_trees = Transformer.from_weights(pallas.config.replace(tree_kernels=False), xla.to_weights())
  tree = jax.jit(lambda m, t, p, c, s, a: m(t, p, c, cache_slots=s, attention_mask=a))
  step = jax.jit(lambda m, t, p, c: m(t, p, c))
  slots = jnp.asarray([[11, 12, 13]], jnp.int32)
  mask = (jnp.arange(S)[None, None, :] <= 11) | (jnp.arange(S)[None, None, :] == slots[:, :, None])
  args = (jnp.zeros((1, 3), jnp.int32), jnp.asarray([[11, 12, 12]], jnp.int32))

  def texts(fn, *a):
    return [fn.lower(m, *a[:2], m.init_cache(1, S), *a[2:]).as_text() for m in (xla, pallas, no_trees)]

  on_xla, on_kernels, without = texts(tree, *args, slots, mask)
  assert without == on_xla != on_kernels
  on_xla, on_kernels, without = texts(step, args[0][:, :1], args[1][:, :1])
  assert without == on_kernels != on_xla

  head_xla, head = eagle_heads
  layers = head.config.layers.replace(tree_kernels=False)
  head_no_trees = EagleDrafter.from_weights(
    dataclasses.replace(head.config, layers=layers),
    head_xla.to_weights(),
    embed=head.embed[...],
    head_rows=head.embed[...],
  )
  head_tree = jax.jit(lambda m, t, h, p, c, s, a: m(t, h, p, c, cache_slots=s, attention_mask=a))
  hidden = jnp.zeros((1, 3, CFG.d_model))
  on_xla, on_kernels, without = (
    head_tree.lower(m, args[0], hidden, args[1], m.init_cache(1, S), slots, mask).as_text()
    for m in (head_xla, head, head_no_trees)
  )
  assert without == on_xla != on_kernels
  with pytest.raises(ValueError, match="tree_kernels must be a bool"):
    CFG.replace(tree_kernels="no")


@pytest.fixture(scope="module")
def eagle_heads():
  """An EAGLE head of two blocks (the first reads the 2D-wide input, through the kernels' prefix) and its copy
  on the kernels; a draft vocabulary of every other token."""
  target = Transformer(CFG.replace(feature_layers=(0, 1)), rngs=nnx.Rngs(5))
  xla = EagleDrafter.for_target(target, num_layers=2, draft_vocab=np.arange(0, CFG.vocab_size, 2), rngs=nnx.Rngs(6))
  config = dataclasses.replace(xla.config, layers=xla.config.layers.replace(kernels="pallas_interpret"))
  head = target.embed[...] if CFG.tie_embeddings else target.lm_head[...].T
  return xla, EagleDrafter.from_weights(config, xla.to_weights(), embed=target.embed[...], head_rows=head)


def test_eagle_head_calls_agree_with_the_kernels(eagle_heads):
  """A catch-up call (2 rows of 4 entries, logits at one entry each, one entry past the cache), a draft step and
  a tree level (two siblings at their own slots) agree with XLA's blocks to float32 rounding: logits, hiddens
  and both layers' caches. Calls of more than 16 rows are XLA's program."""
  xla, pallas = eagle_heads
  call = jax.jit(lambda m, t, h, p, c, at: m(t, h, p, c, logits_at=at))
  step = jax.jit(lambda m, t, h, p, c: m(t, h, p, c))
  k = jax.random.split(jax.random.key(11), 2)
  tokens = jax.random.randint(k[0], (2, 4), 0, CFG.vocab_size)
  hidden = jax.random.normal(k[1], (2, 4, CFG.d_model))
  pos = jnp.asarray([[3, 4, 5, 6], [30, 31, 32, S + 1]], jnp.int32)
  tree = jax.jit(lambda m, t, h, p, c, s, a: m(t, h, p, c, cache_slots=s, attention_mask=a))
  sib_pos = jnp.broadcast_to(pos[:, 3:] + 2, (2, 2))
  sib_slots = pos[:, 3:] + jnp.asarray([[2, 3]], jnp.int32)
  sib_mask = (jnp.arange(S)[None, None, :] <= pos[:, 3:, None] + 1) | (
    jnp.arange(S)[None, None, :] == sib_slots[:, :, None]
  )
  outs = {}
  for name, m in (("xla", xla), ("pallas", pallas)):
    logits, h, cache = call(m, tokens, hidden, pos, m.init_cache(2, S), jnp.asarray([3, 1], jnp.int32))
    logits2, h2, cache = step(m, tokens[:, :1], h[:, 3:], pos[:, 3:] + 1, cache)
    level = tree(m, tokens[:, 1:3], jnp.repeat(h2, 2, axis=1), sib_pos, cache, sib_slots, sib_mask)
    outs[name] = (logits, h, logits2, h2, *level)
  assert np.isinf(np.asarray(outs["pallas"][0])[..., 1::2]).all()  # outside the draft vocabulary
  for got, want in zip(jax.tree.leaves(outs["pallas"]), jax.tree.leaves(outs["xla"])):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  texts = {
    n: step.lower(m, tokens[:, :1], hidden[:, :1], pos[:, :1], m.init_cache(2, S)).as_text()
    for n, m in (("xla", xla), ("p", pallas))
  }
  assert texts["xla"] != texts["p"]  # 2 rows: the kernels
  wide = jnp.zeros((2, 10), jnp.int32), jnp.zeros((2, 10, CFG.d_model)), jnp.zeros((2, 10), jnp.int32)
  texts = [step.lower(m, *wide, m.init_cache(2, S)).as_text() for m in eagle_heads]
  assert texts[0] == texts[1]  # 20 rows: XLA's blocks


# The fast subset keeps the bias in the kernel (test_fused_attention_adds_the_qkv_bias) and the EAGLE head on the
# kernels (test_eagle_head_calls_agree_with_the_kernels); this one joins the two.
@pytest.mark.slow
def test_biased_eagle_head_calls_agree_with_the_kernels():
  """A head of two blocks for a target with q/k/v biases (so both blocks hold "bqkv": the first through the q|k|v
  kernel's prefix, the second plain): a catch-up call and a draft step agree with XLA's blocks to float32
  rounding, logits, hiddens and caches."""
  target = Transformer(CFG.replace(feature_layers=(0, 1), qkv_bias=True), rngs=nnx.Rngs(7))
  xla = EagleDrafter.for_target(target, num_layers=2, rngs=nnx.Rngs(8))
  assert "bqkv" in xla.first.names and "bqkv" in xla.rest.names
  config = dataclasses.replace(xla.config, layers=xla.config.layers.replace(kernels="pallas_interpret"))
  pallas = EagleDrafter.from_weights(config, xla.to_weights(), embed=target.embed[...], head_rows=target.embed[...])
  call = jax.jit(lambda m, t, h, p, c: m(t, h, p, c))
  k = jax.random.split(jax.random.key(12), 2)
  tokens = jax.random.randint(k[0], (1, 4), 0, CFG.vocab_size)
  hidden = jax.random.normal(k[1], (1, 4, CFG.d_model))
  pos = jnp.asarray([[3, 4, 5, 6]], jnp.int32)
  outs = {}
  for name, m in (("xla", xla), ("pallas", pallas)):
    logits, h, cache = call(m, tokens, hidden, pos, m.init_cache(1, S))
    outs[name] = (logits, h, *call(m, tokens[:, :1], h[:, 3:], pos[:, 3:] + 1, cache))
  for got, want in zip(jax.tree.leaves(outs["pallas"]), jax.tree.leaves(outs["xla"])):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # compiles three speculative loops with interpreted kernels
def test_greedy_speculative_decoding_with_the_kernels_equals_generate(models):
  from specdec_jax import SamplingParams, generate, speculative_generate

  xla, pallas = models
  prompts = jnp.asarray([[5, 9, 14, 3, 0, 0], [7, 7, 2, 11, 30, 4]], jnp.int32)
  lengths = jnp.asarray([4, 6], jnp.int32)
  params = SamplingParams.greedy(2)
  plain = generate(xla, prompts, lengths, params, None, max_new_tokens=8, all_greedy=True)
  spec = speculative_generate(
    pallas, pallas, prompts, lengths, params, None, max_new_tokens=8, num_speculative_tokens=3, all_greedy=True
  )
  np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(plain.tokens))
  # A tree of drafts (4 nodes + the root, 2 rows: 10 rows): verification and the draft's levels take the kernels too.
  tree = speculative_generate(
    pallas,
    pallas,
    prompts,
    lengths,
    params,
    None,
    max_new_tokens=8,
    num_speculative_tokens=2,
    all_greedy=True,
    draft_tree=(2, 1),
  )
  np.testing.assert_array_equal(np.asarray(tree.tokens), np.asarray(plain.tokens))


@pytest.mark.parametrize("bt", [pytest.param((1, 1), marks=_SLOW), (1, 5), pytest.param((2, 8), marks=_SLOW)])
def test_triton_lowering(bt):
  """The kernels lower to Triton IR for a CUDA target (what the GPU compiles); no GPU needed for this step."""
  s, bf = jax.ShapeDtypeStruct, jnp.bfloat16
  b, t = bt
  args = [
    s((b, t, 576), bf),
    s((576,), bf),
    s((576, 960), bf),
    s((576, 576), bf),
    s((30, b, 3, 320, 64), bf),
    s((30, b, 3, 320, 64), bf),
    s((), jnp.int32),
    s((b, t), jnp.int32),
    s((b, t, 32), jnp.float32),
    s((b, t, 32), jnp.float32),
  ]
  fn = jax.jit(
    lambda x, n, a, o, kc, vc, l, p, c, sn: fused_attention(
      x, n, a, o, kc, vc, l, p, c, sn, num_heads=9, num_kv_heads=3, eps=1e-5
    )
  )
  text = cuda_module_text(fn, args)
  for name in ("fused_attention_qkv", "fused_attention_core", "fused_mlp_down"):
    assert name in text, f"expected the {name} kernel as a Triton custom call"
  if bt == (1, 5):  # the q|k|v kernel with a prefix (the EAGLE head's first block: wqkv [2D, ...])
    with_prefix = jax.jit(
      lambda x, n, a, o, kc, vc, l, p, c, sn, e: fused_attention(
        x, n, a, o, kc, vc, l, p, c, sn, num_heads=9, num_kv_heads=3, eps=1e-5, prefix=(e, n)
      )
    )
    assert "fused_attention_qkv" in cuda_module_text(
      with_prefix, [*args[:2], s((2 * 576, 960), bf), *args[3:], s((b, t, 576), bf)]
    )
    # with a q|k|v bias (Qwen2's)
    with_bias = jax.jit(
      lambda x, n, a, o, kc, vc, l, p, c, sn, bias: fused_attention(
        x, n, a, o, kc, vc, l, p, c, sn, num_heads=9, num_kv_heads=3, eps=1e-5, bias=bias
      )
    )
    assert "fused_attention_qkv" in cuda_module_text(with_bias, [*args, s((960,), bf)])
    # with the q|k|v product split over K (the wide models' tiles)
    split = jax.jit(
      lambda x, n, a, o, kc, vc, l, p, c, sn, bias: fused_attention(
        x,
        n,
        a,
        o,
        kc,
        vc,
        l,
        p,
        c,
        sn,
        num_heads=9,
        num_kv_heads=3,
        eps=1e-5,
        bias=bias,
        blocks=AttentionBlocks(block_k=64, split_k=4),
      )
    )
    assert "fused_attention_qkv_parts" in cuda_module_text(split, [*args, s((960,), bf)])
    # a tree call: given write slots and a [B, T, S] mask
    with_mask = jax.jit(
      lambda x, n, a, o, kc, vc, l, p, c, sn, m: fused_attention(
        x, n, a, o, kc, vc, l, p, c, sn, num_heads=9, num_kv_heads=3, eps=1e-5, slots=p, mask=m
      )
    )
    assert "fused_attention_core" in cuda_module_text(with_mask, [*args, s((b, t, 320), jnp.bool_)])


def test_kernels_path_is_batch_invariant(models):
  """On the kernels' path a token's logits are the same bits whether it comes in a one-token step or in a
  call of several tokens: the kernels work on tiles of MAX_ROWS rows whatever B*T, and the final norm and
  head run on MAX_ROWS rows too. So greedy speculation on the kernels equals plain greedy decoding."""
  _, pallas = models
  tokens = jnp.asarray(np.arange(3, 13).reshape(1, 10) % CFG.vocab_size, jnp.int32)
  together, steps, _, _ = step_and_verify(pallas, tokens, 6, S)  # a verification of 4 tokens, and 4 steps
  np.testing.assert_array_equal(steps, together)


def test_kernels_path_is_batch_invariant_in_bfloat16(monkeypatch):
  """The same in bfloat16, the model dtype of the GPU runs, where a different rounding of any intermediate shows:
  five one-token steps and one 5-token call from the same cache give the same logits and write the same cache,
  bit for bit. The attention takes SPLIT's tiles (the q|k|v product split over K and summed by a second kernel,
  the output product split over K and summed by XLA), the block holds Qwen2's q|k|v bias, and the call's
  positions 14..18 cross a 16-slot block, so a query of the call runs one slot block more than its step does."""
  cfg = CFG.replace(num_layers=1, qkv_bias=True, dtype=jnp.bfloat16, kernels="pallas_interpret")
  monkeypatch.setattr(attention, "blocks_for", lambda d: SPLIT)
  model = Transformer(cfg, rngs=nnx.Rngs(12))
  tokens = jnp.asarray(np.arange(19).reshape(1, 19) * 7 % CFG.vocab_size, jnp.int32)
  together, steps, after_call, after_steps = step_and_verify(model, tokens, 14, S)
  np.testing.assert_array_equal(steps, together)
  for got, want in ((after_steps.k, after_call.k), (after_steps.v, after_call.v)):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_a_wide_model_runs_its_mlp_on_xla_on_sixteen_rows(monkeypatch):
  """A model whose MLP runs faster on XLA's blocks (`mlp.xla_is_faster`: wide models; its threshold lowered here
  so a small model counts as wide) takes the kernels for its attention half only, and XLA's MLP on a fixed 16
  rows: its logits agree with XLA's model, a token's logits are the same bits in a one-token step and in a
  verification (batch invariance), and the GPU program holds the attention kernels and no MLP kernel."""
  # Wide enough that XLA:CPU, too, rounds a one-row product differently from a four-row one.
  cfg = CFG.replace(num_layers=1, d_model=256, d_ff=512, vocab_size=512)
  assert not mlp.xla_is_faster(cfg.d_model, cfg.d_ff, cfg.dtype)
  monkeypatch.setattr(mlp, "XLA_MLP_MIN_BYTES", 0)
  xla = Transformer(cfg, rngs=nnx.Rngs(4))
  pallas = Transformer.from_weights(cfg.replace(kernels="pallas_interpret"), xla.to_weights())
  tokens = jnp.asarray(np.arange(3, 13).reshape(1, 10) * 37 % cfg.vocab_size, jnp.int32)
  # A verification of 4 tokens, the same tokens in 4 steps, and the cache after the verification.
  results = {name: step_and_verify(m, tokens, 6, S)[:3] for name, m in (("xla", xla), ("pallas", pallas))}
  np.testing.assert_array_equal(results["pallas"][1], results["pallas"][0])
  assert not np.array_equal(results["xla"][1], results["xla"][0])  # XLA's rows alone would differ
  for got, want in zip(jax.tree.leaves(results["pallas"]), jax.tree.leaves(results["xla"])):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)

  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  gpu = Transformer.from_weights(cfg.replace(dtype=jnp.bfloat16, kernels="pallas"), xla.to_weights())
  step = jax.jit(lambda t, p: gpu(t, p, gpu.init_cache(1, S))[0])
  text = cuda_module_text(step, [jax.ShapeDtypeStruct((1, 1), jnp.int32)] * 2)
  assert "fused_attention_qkv" in text and "fused_mlp_gate_up" not in text


def test_tree_calls_on_the_kernels_give_each_node_the_bits_of_a_chain_of_its_path(monkeypatch):
  """A tree call writes its nodes at slots of their own, so a node's ancestors sit in other slots than in a chain
  of its path; the kernel reads each node's keys from the tail on in a chain's order (`_tree_tails`), so every
  node's logits are the bits of one-token steps along its path (bf16, 2 blocks, slot blocks of 16, the two rows'
  trees starting in different blocks, one node's parent in the next block). Before, nodes whose ancestors crossed
  a block boundary differently than a chain's parted in the last bits (greedy trees then parted from plain
  greedy decoding at near-ties)."""
  cfg = CFG.replace(qkv_bias=True, dtype=jnp.bfloat16, kernels="pallas_interpret")
  monkeypatch.setattr(attention, "blocks_for", lambda d: SPLIT)
  model = Transformer(cfg, rngs=nnx.Rngs(12))
  call = jax.jit(lambda m, t, p, c: m(t, p, c))
  tree = jax.jit(lambda m, t, p, c, s, a: m(t, p, c, cache_slots=s, attention_mask=a))
  starts = np.array([14, 21])  # each row's context length: its root at that position
  rng = np.random.default_rng(0)
  context = rng.integers(0, CFG.vocab_size, (2, starts.max())).astype(np.int32)
  pos = np.where(np.arange(starts.max())[None] < starts[:, None], np.arange(starts.max())[None], S)  # pads: nowhere
  _, cache = call(model, jnp.asarray(context), jnp.asarray(pos, jnp.int32), model.init_cache(2, S))
  parent = [-1, 0, 0, 2, 1, 3]  # root; children 1, 2; 3 under 2; 4 under 1; 5 under 3 (nodes in topological order)
  depth = [0, 1, 1, 2, 2, 3]
  tokens = rng.integers(0, CFG.vocab_size, (2, len(parent))).astype(np.int32)
  mask = np.zeros((2, len(parent), S), bool)
  for b in range(2):
    mask[b, :, : starts[b]] = True
    for i in range(len(parent)):
      j = i
      while j >= 0:
        mask[b, i, starts[b] + j] = True
        j = parent[j]
  node_pos = jnp.asarray(starts[:, None] + np.asarray(depth)[None], jnp.int32)
  node_slots = jnp.asarray(starts[:, None] + np.arange(len(parent))[None], jnp.int32)
  got, _ = tree(model, jnp.asarray(tokens), node_pos, cache, node_slots, jnp.asarray(mask))
  for i in range(len(parent)):
    path, j = [], i
    while j >= 0:
      path.insert(0, j)
      j = parent[j]
    c = cache
    for k, j in enumerate(path):  # one-token steps along the path, both rows at once
      want, c = call(model, jnp.asarray(tokens[:, j : j + 1]), jnp.asarray(starts[:, None] + k, jnp.int32), c)
    np.testing.assert_array_equal(np.asarray(got)[:, i], np.asarray(want)[:, 0], err_msg=f"node {i}, path {path}")


def _subjaxprs(eqn):
  for param in eqn.params.values():
    for sub in param if isinstance(param, (list, tuple)) else (param,):
      inner = getattr(sub, "jaxpr", sub)
      if hasattr(inner, "eqns"):
        yield inner


def _products(jaxpr) -> int:
  """dot_general equations in `jaxpr`, those inside loops and conditionals included."""
  return sum(e.primitive.name == "dot_general" for e in jaxpr.eqns) + sum(
    _products(sub) for e in jaxpr.eqns for sub in _subjaxprs(e)
  )


def _kernel_products(jaxpr) -> dict[str, int]:
  """{kernel name: products in its body} of each Pallas call in `jaxpr`, however deeply it is nested."""
  out = {}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      name = eqn.params.get("name") or eqn.params.get("name_and_src_info")  # by JAX version
      out[str(name)] = _products(eqn.params["jaxpr"])
    else:
      for sub in _subjaxprs(eqn):
        out.update(_kernel_products(sub))
  return out


def test_a_tree_calls_attention_kernel_holds_the_same_products_whatever_its_rows():
  """The tree tail's per-row products run in a loop over the call's rows: unrolled, Triton kept every row's
  operand tiles in shared memory at once (on an H200 a 15-row tree call of the Qwen shape asked for 538 KB
  of the 227 KB there and failed to compile). So the kernel's program must not grow with T."""
  s, bf = jax.ShapeDtypeStruct, jnp.bfloat16

  def products(t):
    args = [
      s((1, t, 576), bf),
      s((576,), bf),
      s((576, 960), bf),
      s((576, 576), bf),
      s((2, 1, 3, 320, 64), bf),
      s((2, 1, 3, 320, 64), bf),
      s((), jnp.int32),
      s((1, t), jnp.int32),
      s((1, t, 32), jnp.float32),
      s((1, t, 32), jnp.float32),
      s((1, t, 320), jnp.bool_),
    ]
    fn = lambda x, n, a, o, kc, vc, l, p, c, sn, m: fused_attention(  # noqa: E731
      x, n, a, o, kc, vc, l, p, c, sn, num_heads=9, num_kv_heads=3, eps=1e-5, slots=p, mask=m
    )
    counts = _kernel_products(jax.make_jaxpr(fn)(*args).jaxpr)
    (core,) = [n for name, n in counts.items() if "fused_attention_core" in name]
    return core

  assert products(2) == products(15) > 0
