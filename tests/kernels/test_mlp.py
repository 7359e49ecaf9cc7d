"""`fused_mlp` (Pallas kernels for the MLP half of a block) against `mlp_block`, in interpret mode on the CPU.

The kernels run in Pallas's interpreter here (no GPU): that checks their
indexing, masks, tiling and arithmetic, not the Triton compiler.
`test_triton_lowering` additionally lowers them to Triton IR for a CUDA target
(no GPU needed for that step), so a kernel the Pallas Triton lowering rejects
fails here, not on the H100. Shapes: SmolLM2-135M's (D=576, F=1536) and a
small odd one (D=96, F=160: neither a power of two nor a multiple of every
block, so the ragged-edge masks and partial K tiles are exercised).

Tolerances (both relative to s = |reference| + max |MLP branch|, the branch
being mlp_block(x) - x):
  float32: 1e-5 s. Only the summation order differs (f32 eps is 1.2e-7; a
    K = 1536 reduction reassociated moves the result by ~sqrt(K) eps).
  bfloat16: 2^-6 s against mlp_block in bf16, and 2^-7 s against the float32
    truth of the same (bf16-rounded) inputs. bf16 keeps 8 significant bits, so
    rounding a value moves it by at most 2^-8 of itself. Each of the two is
    within about 2^-8 s of the truth (the final rounding of x + branch; the
    reference also rounds the branch to bf16 before the add; both round some
    intermediate activations, which mostly average out in the matmuls), so
    their difference is within about 2^-7 s; 2^-6 leaves a factor 2 (observed:
    at most 0.49 of it, over 28 seeded cases). The kernel keeps the branch in
    float32 until the residual add, so it is closer to the truth than the
    reference (observed: at most 0.5 of its 2^-7 s bound, the reference up to 0.87).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Most of these run with `-m slow`: the models' `kernels="pallas_interpret"` tests
# (tests/kernels/test_attention.py) run this MLP in CI, as do the bad-input checks and one lowering case.
_SLOW = pytest.mark.slow

from specdec_jax.kernels.mlp import MAX_ROWS, MlpBlocks, _check_args, fused_mlp, fused_mlp_supported
from specdec_jax.models.config import TransformerConfig
from specdec_jax.models.transformer import mlp_block
from tests.support.lowering import cuda_module_text

SMOL = (576, 1536)
ODD = (96, 160)
EPS = 1e-5
# Small tiles on the odd shape: 3 K tiles over D=96 in kernel 1; F=160 in chunks of 64 (the last one partial,
# ragged F tile) in kernel 2; output columns 96 in blocks of 32; gate columns 160 in blocks of 64 (ragged).
SMALL_TILES = MlpBlocks(block_f=64, block_k1=32, block_d=32, block_k2=32, split_k=3)
NO_SPLIT = MlpBlocks(block_f=16, block_k1=64, block_d=16, block_k2=64, split_k=1)


def _params(seed, d, f, dtype, layers=None):
  """x-independent MLP parameters with O(1) activations; stacked on a leading axis when `layers`."""
  lead = () if layers is None else (layers,)
  k = jax.random.split(jax.random.key(seed), 3)
  return {
    "mlp_norm": (1 + 0.1 * jax.random.normal(k[0], lead + (d,))).astype(dtype),
    "w_gate_up": (jax.random.normal(k[1], lead + (d, 2 * f)) / np.sqrt(d)).astype(dtype),
    "w_down": (jax.random.normal(k[2], lead + (f, d)) / np.sqrt(f)).astype(dtype),
  }


def _x(seed, b, t, d, dtype):
  return (2 * jax.random.normal(jax.random.key(1000 + seed), (b, t, d))).astype(dtype)


def _reference(x, p, dtype):
  d, f = x.shape[-1], p["w_down"].shape[-2]
  cfg = TransformerConfig(
    vocab_size=8,
    num_layers=1,
    d_model=d,
    num_heads=1,
    num_kv_heads=1,
    head_dim=d,
    d_ff=f,
    rms_norm_eps=EPS,
    dtype=dtype,
  )
  return np.asarray(mlp_block(cfg, x.astype(dtype), {k: v.astype(dtype) for k, v in p.items()}), np.float32)


def _check(out, x, p, *, bf16):
  """Asserts the tolerances of the module docstring; x and p are the inputs fused_mlp saw."""
  out = np.asarray(out, np.float32)
  truth = _reference(x, p, jnp.float32)
  scale = np.abs(truth) + np.abs(truth - np.asarray(x, np.float32)).max()
  if not bf16:
    np.testing.assert_array_less(np.abs(out - truth), 1e-5 * scale)
    return
  ref = _reference(x, p, jnp.bfloat16)
  np.testing.assert_array_less(np.abs(out - ref), 2**-6 * scale)
  np.testing.assert_array_less(np.abs(out - truth), 2**-7 * scale)


@_SLOW
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("bt", [(1, 1), (1, 5), (2, 8)])
@pytest.mark.parametrize("blocks", [MlpBlocks(), SMALL_TILES, NO_SPLIT], ids=["default", "small_tiles", "no_split"])
def test_odd_shape(bt, dtype, blocks):
  p = _params(0, *ODD, dtype)
  x = _x(sum(bt), *bt, ODD[0], dtype)
  out = fused_mlp(x, p["mlp_norm"], p["w_gate_up"], p["w_down"], EPS, interpret=True, blocks=blocks)
  assert out.shape == x.shape and out.dtype == x.dtype
  _check(out, x, p, bf16=dtype == jnp.bfloat16)


@_SLOW
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("bt", [(1, 1), (1, 5), (4, 4)])
def test_smollm2_shape(bt, dtype):
  p = _params(1, *SMOL, dtype)
  x = _x(sum(bt), *bt, SMOL[0], dtype)
  out = fused_mlp(x, p["mlp_norm"], p["w_gate_up"], p["w_down"], EPS, interpret=True)
  _check(out, x, p, bf16=dtype == jnp.bfloat16)


@_SLOW
def test_stacked_layers_pick_the_layer_inside_the_kernel():
  """With [L, ...] weights and a traced `layer`, the result is that layer's; out-of-range layers clamp."""
  layers = 3
  p = _params(2, *ODD, jnp.bfloat16, layers=layers)
  x = _x(2, 1, 5, ODD[0], jnp.bfloat16)
  run = jax.jit(
    lambda x, l: fused_mlp(x, p["mlp_norm"], p["w_gate_up"], p["w_down"], EPS, l, interpret=True, blocks=SMALL_TILES)
  )
  for layer, want in [(0, 0), (2, 2), (1, 1), (7, 2), (-3, 0)]:
    one = {k: v[want] for k, v in p.items()}
    expect = fused_mlp(x, one["mlp_norm"], one["w_gate_up"], one["w_down"], EPS, interpret=True, blocks=SMALL_TILES)
    np.testing.assert_array_equal(np.asarray(run(x, jnp.int32(layer)), np.float32), np.asarray(expect, np.float32))


def test_bad_inputs_raise():
  p = _params(0, *ODD, jnp.float32)
  args = (p["mlp_norm"], p["w_gate_up"], p["w_down"], EPS)
  with pytest.raises(ValueError, match="rows"):
    fused_mlp(jnp.zeros((1, MAX_ROWS + 1, ODD[0])), *args, interpret=True)
  with pytest.raises(ValueError, match="rows"):
    fused_mlp(jnp.zeros((3, 6, ODD[0])), *args, interpret=True)
  with pytest.raises(ValueError, match="B, T, D"):
    fused_mlp(jnp.zeros((5, ODD[0])), *args, interpret=True)
  with pytest.raises(ValueError, match="w_gate_up"):
    fused_mlp(jnp.zeros((1, 1, ODD[0])), p["mlp_norm"], p["w_gate_up"][:-1], p["w_down"], EPS, interpret=True)
  with pytest.raises(ValueError, match="dtype"):
    fused_mlp(jnp.zeros((1, 1, ODD[0]), jnp.bfloat16), *args, interpret=True)
  with pytest.raises(ValueError, match="layer"):
    fused_mlp(jnp.zeros((1, 1, ODD[0])), *args, 0, interpret=True)
  with pytest.raises(ValueError, match="power of two"):
    fused_mlp(jnp.zeros((1, 1, ODD[0])), *args, interpret=True, blocks=MlpBlocks(block_f=24))
  with pytest.raises(ValueError, match="power of two"):
    fused_mlp(jnp.zeros((1, 1, ODD[0])), *args, interpret=True, blocks=MlpBlocks(block_k2=8))


def test_supported():
  s = jax.ShapeDtypeStruct
  good = (s((1, 5, 576), jnp.bfloat16), s((576, 3072), jnp.bfloat16), s((1536, 576), jnp.bfloat16))
  assert _check_args(good[0], None, *good[1:]) is None
  assert _check_args(s((2, 9, 576), jnp.bfloat16), None, *good[1:]) is not None
  assert _check_args(good[0], None, s((576, 3072), jnp.float32), good[2]) is not None
  assert (
    _check_args(good[0], s((30, 576), jnp.bfloat16), s((30, 576, 3072), jnp.bfloat16), s((30, 1536, 576), jnp.bfloat16))
    is None
  )
  assert _check_args(good[0], s((576,), jnp.bfloat16), s((30, 576, 3072), jnp.bfloat16), None) is not None
  assert fused_mlp_supported(good[0], *good[1:]) == (jax.default_backend() == "gpu")


@pytest.mark.parametrize("stacked", [False, pytest.param(True, marks=_SLOW)])
@pytest.mark.parametrize(
  "blocks",
  [
    MlpBlocks(),
    pytest.param(NO_SPLIT, marks=_SLOW),
    pytest.param(MlpBlocks(block_f=32, block_k1=256, block_k2=64, split_k=8), marks=_SLOW),
  ],
  ids=["default", "no_split", "split8"],
)
def test_triton_lowering(blocks, stacked):
  """The kernels lower to Triton IR for a CUDA target (what the GPU compiles); no GPU needed for this step."""
  d, f = SMOL
  s = jax.ShapeDtypeStruct
  lead = (30,) if stacked else ()
  args = [
    s((1, 5, d), jnp.bfloat16),
    s(lead + (d,), jnp.bfloat16),
    s(lead + (d, 2 * f), jnp.bfloat16),
    s(lead + (f, d), jnp.bfloat16),
  ] + ([s((), jnp.int32)] if stacked else [])
  fn = jax.jit(lambda x, n, a, b, *l: fused_mlp(x, n, a, b, EPS, *l, blocks=blocks))
  text = cuda_module_text(fn, args)
  assert text.count("xla.gpu.triton") >= 2, "expected the two Pallas kernels as Triton custom calls"
