"""Tiny Flax Transformers for the loop tests (V = 16 tokens, float32) and the cases built from them.

`unit_target` gives peaked, input-dependent distributions; `distil` trains an
EAGLE head briefly on the target's greedy continuations, so that it accepts;
`build_models` returns the (target, draft model, untrained EAGLE, distilled
EAGLE) that tests/conftest.py's session fixture `tree_models` builds once.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from specdec_jax.loop.decoding import generate
from specdec_jax.models import Transformer, TransformerConfig, weight_shapes
from specdec_jax.models.eagle import EagleDrafter
from specdec_jax.sampling.params import SamplingParams
from tests.support.lossless import N_ROWS, SMALL_V, TEMPERATURE, TOP_K, exact_joint
from tests.support.tiny_lm import make_prompts

V = 16
CONFIG = TransformerConfig.tiny(V, feature_layers=(0, 1))


def unit_target(config=CONFIG, seed=0, embed_scale=1.0) -> Transformer:
  """A target with unit-scale weights: peaked, input-dependent distributions (flatter with a small embed_scale)."""
  rng = np.random.default_rng(seed)
  w = {}
  for name, shape in weight_shapes(config).items():
    if name.endswith("norm"):
      w[name] = np.ones(shape, np.float32)
    elif name == "embed":
      w[name] = (embed_scale * rng.standard_normal(shape)).astype(np.float32)
    else:
      w[name] = (rng.standard_normal(shape) / np.sqrt(shape[-2])).astype(np.float32)
  return Transformer.from_weights(config, w)


def _continuations(target, rng):
  """(sequences int32 [64, 32]: random 4-token prompts and the target's 28 greedy tokens, the target's logits
  and features of them)."""
  b, p, n = 64, 4, 28
  prompts = jnp.asarray(rng.integers(0, target.config.vocab_size, (b, p)), jnp.int32)
  out = generate(
    target, prompts, jnp.full((b,), p, jnp.int32), SamplingParams.greedy(b), None, max_new_tokens=n, all_greedy=True
  )
  seqs = jnp.concatenate([prompts, out.tokens], 1)
  s = seqs.shape[1]
  logits, feats, _ = target(
    seqs, jnp.broadcast_to(jnp.arange(s), (b, s)), target.init_cache(b, s), return_features=True
  )
  return seqs, logits, feats


def distil(target, drafter, steps=60, depth=3, seed=0):
  """A few steps of training-time-test distillation on the target's greedy continuations."""
  rng = np.random.default_rng(seed)
  seqs, logits, feats = _continuations(target, rng)
  b, s = seqs.shape
  target_p = jax.nn.softmax(logits[:, 1:-1], -1)
  opt = nnx.Optimizer(drafter, optax.adam(3e-3), wrt=nnx.Param)

  @nnx.jit
  def step(drafter, opt):
    def loss_fn(d):
      outs = d.unrolled_logits(seqs[:, 1:-1], feats[:, :-2], depth)
      return sum(-jnp.mean(jnp.sum(target_p * jax.nn.log_softmax(o, -1), -1)[:, j:]) for j, o in enumerate(outs))

    loss, grads = nnx.value_and_grad(loss_fn)(drafter)
    opt.update(drafter, grads)
    return loss

  for _ in range(steps):
    step(drafter, opt)
  return drafter


def distil_block(target, drafter, steps=80, k=4, seed=0):
  """A few steps of teacher-forced distillation of a `BlockDrafter` on the target's greedy continuations: at
  4 random context ends a sequence (one call, `block_logits`), its k logits against the target's laws of the
  next k tokens."""
  rng = np.random.default_rng(seed)
  seqs, logits, feats = _continuations(target, rng)
  b, s = seqs.shape
  target_p = jax.nn.softmax(logits, -1)  # [B, S, V]: position q's law of token q+1
  opt = nnx.Optimizer(drafter, optax.adam(3e-3), wrt=nnx.Param)

  @nnx.jit
  def step(drafter, opt, ends):
    def loss_fn(d):
      got = d.block_logits(seqs[:, 1:], feats[:, :-1], ends, k)  # [B, NB, k, V]: tokens ends+1 .. ends+k
      at = (ends[:, :, None] + jnp.arange(k)[None, None, :]).reshape(b, -1)
      want = jnp.take_along_axis(target_p, at[..., None], axis=1).reshape(got.shape)
      return -jnp.mean(jnp.sum(want * jax.nn.log_softmax(got, -1), -1))

    loss, grads = nnx.value_and_grad(loss_fn)(drafter)
    opt.update(drafter, grads)
    return loss

  for _ in range(steps):
    step(drafter, opt, jnp.asarray(rng.integers(1, s - k, (b, 4)), jnp.int32))  # 4 blocks a sequence
  return drafter


LENGTHS = [4, 1, 3, 2]


def build_models():
  """(target, draft model, untrained EAGLE drafter, distilled EAGLE drafter): tests/conftest.py's `tree_models`."""
  target = unit_target()
  draft = unit_target(CONFIG.replace(num_layers=1, feature_layers=()), seed=1)
  untrained = EagleDrafter.for_target(target, rngs=nnx.Rngs(1))
  trained = distil(target, EagleDrafter.for_target(target, rngs=nnx.Rngs(2)))
  return target, draft, untrained, trained


def greedy_case(target):
  """(prompts, lengths, params, loop kwargs, plain greedy output) of the greedy tree tests: ragged prompts, an EOS
  that ends a row inside a round, max_new_tokens cutting a round."""
  prompts, lengths = make_prompts(5, V, LENGTHS, 4)
  params = SamplingParams.greedy(len(LENGTHS))
  plain0 = generate(target, prompts, lengths, params, None, max_new_tokens=15, all_greedy=True)
  eos = int(np.asarray(plain0.tokens)[2, 6])  # ends row 2 (at least) early: EOS lands inside rounds
  kw = dict(max_new_tokens=15, eos_token_id=eos, all_greedy=True)
  plain = generate(target, prompts, lengths, params, None, **kw)
  assert np.asarray(plain.lengths).min() < 15
  return prompts, lengths, params, kw, plain


@functools.cache
def sampled_tree_case(drafter: str):
  """(target, draft, prompts, lengths, params, exact joint law of the first 3 tokens) of the sampled tree tests:
  N_ROWS copies of one prompt at T=0.8 and top-k 6; drafter "model" (a 1-layer model) or "eagle" (distilled).

  Built once per process (the models are only read): the EAGLE case also serves tests/models/test_eagle.py."""
  config = TransformerConfig.tiny(SMALL_V, feature_layers=(0, 1))
  target = unit_target(config, seed=4, embed_scale=0.3)
  if drafter == "model":
    draft = unit_target(config.replace(num_layers=1, feature_layers=()), seed=6, embed_scale=0.3)
  else:
    draft = distil(target, EagleDrafter.for_target(target, rngs=nnx.Rngs(5)), steps=30)
  prompt = np.array([1, 5, 2, 7])
  prompts = jnp.asarray(np.tile(prompt, (N_ROWS, 1)), jnp.int32)
  lengths = jnp.full((N_ROWS,), len(prompt), jnp.int32)
  params = SamplingParams.create(jnp.full((N_ROWS,), TEMPERATURE), top_k=TOP_K)
  return target, draft, prompts, lengths, params, exact_joint(target, prompt)
