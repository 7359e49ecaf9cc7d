"""The MLP half of a decoder block as Pallas GPU (Triton) kernels, for small T.

An experiment for the decode step at batch 1: XLA runs `mlp_block` on a few
rows as a chain of small kernels (norm, a multiply-and-reduce per matrix-vector
product, SiLU, the residual add), each a few microseconds, while the MLP's
memory floor (reading its 5.3 MB of bf16 weights for SmolLM2-135M) is under
2 us on an H100. `fused_mlp` computes the same thing, for at most
`MAX_ROWS` = 16 rows (B*T), in two or three kernels:

  1. `_gate_up_kernel`, grid (cdiv(F, block_f),): program j reads columns
     [j*block_f, (j+1)*block_f) of both the gate and the up half of
     `w_gate_up` [D, 2F] once, K tile by K tile over D, and writes
     h[:, those columns] = silu(n @ w_gate) * (n @ w_up) with n = rms_norm(x).
     Every program re-derives the row norm from x (16 x D values that sit in
     L2 after the first program touches them): no separate norm kernel.
  2. `_down_kernel`, grid (cdiv(D, block_d), split_k): program (i, s) reads
     rows [s*chunk, (s+1)*chunk) of `w_down` [F, D] for output columns
     [i*block_d, (i+1)*block_d) once. With split_k == 1 it adds the residual
     x and writes the output (two kernels in all); with split_k > 1 it writes
     a float32 partial sum [split_k, rows, D] and one small XLA fusion adds
     the partials and x (three kernels), which buys programs: D = 576 output
     columns in blocks of 32 are only 18 programs for 132 SMs.

Both accumulate in float32 and read every weight element exactly once. Ragged
edges (576 and 1536 are not powers of two, Triton tiles must be) are masked
loads and stores, never padded copies of the weights: a pad would copy the
weights each call, the very traffic this is meant to avoid. Rows are padded to
16 by the masks as well (no pad kernel): the loaded x tile is [16, block_k]
with the rows past B*T reading zeros, and stores skip them.

`interpret=True` runs the kernels in Pallas's interpreter (any backend; slow),
which is how the tests check them on a CPU. `fused_mlp_supported` says whether
a call can take the compiled path.

Example:
  >>> x = jnp.ones((1, 1, 576), jnp.bfloat16)  # doctest: +SKIP
  >>> y = fused_mlp(x, p["mlp_norm"], p["w_gate_up"], p["w_down"], 1e-5)  # doctest: +SKIP
  >>> y.shape  # (1, 1, 576), equal to mlp_block(cfg, x, p) within bf16 rounding  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # The Triton-specific half of Pallas (masked load/store, CompilerParams); same names in JAX 0.10 and 0.11.
  from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - a jax without the GPU extras
  plgpu = None

MAX_ROWS = 16  # B*T rows the kernels take; also the padded row count, the smallest M a Triton dot accepts.


@dataclasses.dataclass(frozen=True)
class MlpBlocks:
  """Tile sizes and launch parameters of `fused_mlp` (all block sizes powers of two, >= 16).

  Attributes:
    block_f: F columns (of gate and of up each) per program of kernel 1; grid cdiv(F, block_f).
    block_k1: rows of `w_gate_up` (the D contraction) per loop iteration of kernel 1.
    block_d: output columns per program of kernel 2.
    block_k2: rows of `w_down` (the F contraction) per loop iteration of kernel 2.
    split_k: programs that share one block of output columns of kernel 2, each reducing a
      contiguous chunk of F; > 1 adds a float32 partial buffer and an XLA reduction.
    num_warps: Triton warps per program (both kernels).
    num_stages: Triton software-pipelining depth of the K loops (both kernels).

  Example:
    >>> MlpBlocks(block_f=32).grid_sizes(d=576, f=1536)
    (48, 72)
  """

  block_f: int = 16
  block_k1: int = 128
  block_d: int = 32
  block_k2: int = 128
  split_k: int = 4
  num_warps: int = 4
  num_stages: int = 3

  def validate(self) -> None:
    for name in ("block_f", "block_k1", "block_d", "block_k2"):
      v = getattr(self, name)
      # Triton tensors must have power-of-two sizes, and tl.dot wants every dim >= 16.
      if v < 16 or v & (v - 1):
        raise ValueError(f"{name}={v}: must be a power of two >= 16")
    if self.split_k < 1 or self.num_warps < 1 or self.num_stages < 1:
      raise ValueError(f"split_k, num_warps, num_stages must be >= 1: {self}")

  def grid_sizes(self, d: int, f: int) -> tuple[int, int]:
    """Programs of kernel 1 and of kernel 2 for model width d and MLP width f."""
    return pl.cdiv(f, self.block_f), pl.cdiv(d, self.block_d) * self._split(f)

  def _split(self, f: int) -> int:
    """split_k, less any chunks that would be empty (chunks are whole K tiles)."""
    chunk = self._chunk(f)
    return pl.cdiv(f, chunk)

  def _chunk(self, f: int) -> int:
    """Rows of w_down per split: cdiv(f, split_k) rounded up to whole block_k2 tiles."""
    return pl.cdiv(pl.cdiv(f, self.split_k), self.block_k2) * self.block_k2


DEFAULT_BLOCKS = MlpBlocks()
# The fastest tiles measured on an H100 at 1, 5 and 16 rows (bench/RESULTS.md).
BEST_BLOCKS = MlpBlocks(num_warps=2)
# From this many bytes of MLP weights per layer on, XLA's matrix products read the weights faster than these
# kernels, whose grid is built for narrow models (bench/RESULTS.md, "The Pallas blocks, kernel by kernel").
XLA_MLP_MIN_BYTES = 32 * 2**20


def xla_is_faster(d: int, f: int, dtype) -> bool:
  """Whether XLA's MLP (`transformer.mlp_block`) outruns `fused_mlp` at width d and MLP width f (static).

  Measured on an H200 at one row: SmolLM2-135M's MLP (D=576, F=1536, 5.3 MB in bf16) runs faster on these
  kernels, Qwen2.5-Coder-1.5B's (D=1536, F=8960, 82.6 MB) on XLA's; the switch sits between the two.

  Example:
    >>> xla_is_faster(576, 1536, jnp.bfloat16), xla_is_faster(1536, 8960, jnp.bfloat16)
    (False, True)
  """
  return 3 * d * f * jnp.dtype(dtype).itemsize >= XLA_MLP_MIN_BYTES


def fused_mlp_supported(x, w_gate_up=None, w_down=None) -> bool:
  """Whether `fused_mlp(x, ...)` can run compiled (not interpreted) here; static, safe under jit.

  True when x is [B, T, D] of bf16/f16/f32 with 1 <= B*T <= MAX_ROWS, the default backend is a GPU
  and Pallas's Triton lowering is importable; given weights, also their shapes and dtype must match.
  A model can branch on it at trace time: `fused_mlp(...) if fused_mlp_supported(x) else mlp_block(...)`.

  Args:
    x: array or `jax.ShapeDtypeStruct` [B, T, D].
    w_gate_up: optional [D, 2F] or stacked [L, D, 2F] (or its ShapeDtypeStruct).
    w_down: optional [F, D] or [L, F, D].

  Example:
    >>> fused_mlp_supported(jax.ShapeDtypeStruct((1, 5, 576), jnp.bfloat16))  # False on a CPU
    False
  """
  if plgpu is None or jax.default_backend() != "gpu":
    return False
  return _check_args(x, None, w_gate_up, w_down) is None


def _check_args(x, norm_weight, w_gate_up, w_down) -> str | None:
  """None if the shapes and dtypes suit the kernels, else why not (a weight given as None is unchecked).

  Weights are all per-layer ([D], [D, 2F], [F, D]) or all stacked ([L, D], [L, D, 2F], [L, F, D]).
  """
  if len(x.shape) != 3:
    return f"x must be [B, T, D], got shape {x.shape}"
  rows, d = x.shape[0] * x.shape[1], x.shape[2]
  if not 1 <= rows <= MAX_ROWS:
    return f"B*T = {rows} rows; the kernels take 1..{MAX_ROWS} (use mlp_block for more)"
  if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
    return f"x dtype {x.dtype} is not bfloat16, float16 or float32"
  given = [
    (name, w)
    for name, w in (("norm_weight", norm_weight), ("w_gate_up", w_gate_up), ("w_down", w_down))
    if w is not None
  ]
  for name, w in given:
    if len(w.shape) not in ((1, 2) if name == "norm_weight" else (2, 3)):
      return f"{name} has shape {w.shape}: wrong rank"
  lead = {w.shape[: len(w.shape) - (1 if name == "norm_weight" else 2)] for name, w in given}
  if len(lead) > 1 or any(len(l) > 1 for l in lead):
    return "weights must be all per-layer or all stacked on one leading [L] axis: " + ", ".join(
      f"{name} {w.shape}" for name, w in given
    )
  if norm_weight is not None and norm_weight.shape[-1] != d:
    return f"norm_weight must be [D={d}] ([L, D] stacked), got {norm_weight.shape}"
  if w_gate_up is not None and (w_gate_up.shape[-2] != d or w_gate_up.shape[-1] % 2):
    return f"w_gate_up must be [D={d}, 2F] ([L, D, 2F] stacked), got {w_gate_up.shape}"
  if w_down is not None and w_down.shape[-1] != d:
    return f"w_down must be [F, D={d}] ([L, F, D] stacked), got {w_down.shape}"
  if w_gate_up is not None and w_down is not None and 2 * w_down.shape[-2] != w_gate_up.shape[-1]:
    return f"w_down {w_down.shape} and w_gate_up {w_gate_up.shape} disagree on F"
  for name, w in given[1:] if norm_weight is not None else given:
    if w.dtype != x.dtype:  # the dot takes one input dtype; mixing would need a cast of the weights
      return f"{name} dtype {w.dtype} differs from x's {x.dtype}"
  return None


# Why tl.dot (`jnp.dot` on tiles) rather than broadcast-multiply-and-sum: with the rows padded to 16,
# a multiply-and-sum materialises a [16, block_k, block_n] float32 product per K tile (128 x 16 x 16
# floats = 64 registers per thread at 4 warps, before any pipelining), while a dot keeps only the
# [16, block_n] accumulator and runs on the tensor cores. The wasted MACs of the padded rows at
# B*T = 1 are free: the kernel waits on HBM, not on arithmetic. The price is block sizes >= 16.


def _load(ref, idx, mask):
  """Masked tile load: zeros where the mask is off (reads past an edge fetch nothing on the GPU)."""
  # `other` is required: the interpreter applies the mask only when it is given.
  return plgpu.load(ref.at[idx], mask=mask, other=0)


def _layer(layer_ref, n_layers):
  """The layer index, read from its [1] int32 ref and clamped (like lax.dynamic_index_in_dim): an index
  out of range must not send the kernel's loads outside the weights."""
  return jnp.minimum(jnp.maximum(layer_ref[0], 0), n_layers - 1)


def normed_products(x_ref, nw_ref, w_ref, lead, starts, width, col_ok, *, rows, d, eps, block_k, row0=0, tiles=None):
  """rms_norm(x) @ w[..., row0:row0 + D, start:start + width] for the two `starts`: two float32 [16, width] tiles.

  Shared by the MLP's gate|up kernel and the attention's q|k|v kernel. x_ref [rows, D] (rows past
  `rows` read as zeros), nw_ref [*lead, D], w_ref [*lead, K, N] with `lead` the leading indices (the
  layer of stacked weights, or none) and K >= row0 + D (row0 > 0: x is the second part of a wider
  input, whose parts are normed separately); `col_ok` [1, width] masks columns past N (None: all in range).
  The norm's scale rsqrt(mean(x^2) + eps) is one number per row, so it commutes with the
  contraction: one loop over the K tiles accumulates (x * nw) @ W and sum(x^2), and the results are
  scaled at the end, so the weight loads never wait for a first pass over x. (`rms_norm` rounds
  x * scale * nw to x's dtype before the matmul; this rounds x * nw instead: the same relative
  rounding, 2^-9 in bf16.) Padded rows get the scale rsqrt(eps): finite, never stored.

  `tiles`: None (the whole contraction), or (first, count): K tiles of block_k that this program
  reduces, its chunk of a split contraction whose scaled partial products the caller adds up;
  sum(x^2) then takes a loop of its own over all of x (the real rows only: a few kilobytes).
  """
  row_ok = jnp.arange(MAX_ROWS)[:, None] < rows  # [16, 1]
  n_tiles = pl.cdiv(d, block_k)
  first, count = (0, n_tiles) if tiles is None else tiles

  def x_tile(k):
    k_ok = k * block_k + jnp.arange(block_k) < d
    xt = _load(x_ref, (pl.ds(0, MAX_ROWS), pl.ds(k * block_k, block_k)), row_ok & k_ok[None, :])
    return xt.astype(jnp.float32), k_ok  # [16, bk], [bk]

  def body(k, carry):
    acc_a, acc_b, ss = carry
    xt, k_ok = x_tile(k)
    nw = _load(nw_ref, (*lead, pl.ds(k * block_k, block_k)), k_ok).astype(jnp.float32)  # [bk]
    a = (xt * nw[None, :]).astype(w_ref.dtype)
    wmask = k_ok[:, None] if col_ok is None else k_ok[:, None] & col_ok
    wk = pl.ds(row0 + k * block_k, block_k)
    wa = _load(w_ref, (*lead, wk, pl.ds(starts[0], width)), wmask)  # [bk, width]
    wb = _load(w_ref, (*lead, wk, pl.ds(starts[1], width)), wmask)
    acc_a += jnp.dot(a, wa, preferred_element_type=jnp.float32)
    acc_b += jnp.dot(a, wb, preferred_element_type=jnp.float32)
    ss += jnp.sum(xt * xt, axis=1)
    return acc_a, acc_b, ss

  zeros = jnp.zeros((MAX_ROWS, width), jnp.float32)
  ss0 = jnp.zeros((MAX_ROWS,), jnp.float32)
  acc_a, acc_b, ss = lax.fori_loop(first, first + count, body, (zeros, zeros, ss0))
  if tiles is not None:  # the chunk saw part of x: the whole row's sum of squares
    ss = lax.fori_loop(0, n_tiles, lambda k, ss: ss + jnp.sum(jnp.square(x_tile(k)[0]), axis=1), ss0)
  scale = lax.rsqrt(ss / d + eps)[:, None]  # [16, 1]
  return acc_a * scale, acc_b * scale


def _gate_up_kernel(layer_ref, x_ref, nw_ref, w_ref, h_ref, *, rows, d, f, eps, block_f, block_k):
  """One block of h = silu(n @ w_gate) * (n @ w_up), n = rms_norm(x); see the module docstring.

  Refs (whole arrays, no BlockSpecs: the masks handle the edges): layer [1] int32, x [rows, D],
  nw [L, D], w [L, D, 2F] (gate = columns :F, up = F:), h [rows, F] (written: this program's
  columns). The layer is picked inside the kernel, by pointer offset, so stacked weights need no
  slice (a slice of an operand of a custom call is a copy in XLA: 3.5 MB per call here).

  The norm and both products are `normed_products`' one loop over the K tiles.
  """
  j = pl.program_id(0)
  layer = _layer(layer_ref, w_ref.shape[0])
  r = jnp.arange(MAX_ROWS)
  c = j * block_f + jnp.arange(block_f)
  row_ok, col_ok = r[:, None] < rows, c[None, :] < f  # [16, 1], [1, block_f]
  g, u = normed_products(
    x_ref,
    nw_ref,
    w_ref,
    (layer,),
    (j * block_f, f + j * block_f),
    block_f,
    col_ok,
    rows=rows,
    d=d,
    eps=eps,
    block_k=block_k,
  )
  h = g * lax.logistic(g) * u  # silu(gate) * up, in float32
  plgpu.store(h_ref.at[pl.ds(0, MAX_ROWS), pl.ds(j * block_f, block_f)], h.astype(h_ref.dtype), mask=row_ok & col_ok)


def _down_kernel(layer_ref, h_ref, w_ref, x_ref, o_ref, *, rows, d, f, chunk, block_d, block_k, residual):
  """One block of h @ w_down over one chunk of F (+ x when `residual`); see the module docstring.

  Refs: layer [1] int32, h [rows, F], w [L, F, D], x [rows, D] (read only when `residual`),
  o [rows, D] in x's dtype when `residual` (split_k == 1), else float32 partial sums
  [split_k, rows, D].
  """
  i, s = pl.program_id(0), pl.program_id(1)
  layer = _layer(layer_ref, w_ref.shape[0])
  r = jnp.arange(MAX_ROWS)
  c = i * block_d + jnp.arange(block_d)
  row_ok, col_ok = r[:, None] < rows, c[None, :] < d
  k0 = s * chunk

  def body(k, acc):
    start = k0 + k * block_k
    kk = start + jnp.arange(block_k)
    k_ok = kk < f  # chunks are whole tiles, so only F's own edge needs a mask
    ks = pl.ds(start, block_k)
    ht = _load(h_ref, (pl.ds(0, MAX_ROWS), ks), row_ok & k_ok[None, :])  # [16, bk]
    wt = _load(w_ref, (layer, ks, pl.ds(i * block_d, block_d)), k_ok[:, None] & col_ok)  # [bk, bd]
    return acc + jnp.dot(ht, wt, preferred_element_type=jnp.float32)

  acc = lax.fori_loop(0, chunk // block_k, body, jnp.zeros((MAX_ROWS, block_d), jnp.float32))
  cols = pl.ds(i * block_d, block_d)
  if residual:
    xt = _load(x_ref, (pl.ds(0, MAX_ROWS), cols), row_ok & col_ok).astype(jnp.float32)
    plgpu.store(o_ref.at[pl.ds(0, MAX_ROWS), cols], (acc + xt).astype(o_ref.dtype), mask=row_ok & col_ok)
  else:
    plgpu.store(o_ref.at[s, pl.ds(0, MAX_ROWS), cols], acc, mask=row_ok & col_ok)


def _compiler_params(blocks, interpret: bool):
  """Triton CompilerParams (which also pins the Triton lowering over Mosaic GPU), or None.

  `blocks`: anything with num_warps and num_stages (`MlpBlocks`, `attention.AttentionBlocks`).
  """
  if interpret or plgpu is None or not hasattr(plgpu, "CompilerParams"):
    return None
  try:
    return plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)
  except TypeError:  # pragma: no cover - a jax whose CompilerParams lost a field
    return None


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "blocks"))
def fused_mlp(
  x,
  norm_weight,
  w_gate_up,
  w_down,
  eps: float,
  layer=None,
  *,
  interpret: bool = False,
  blocks: MlpBlocks = DEFAULT_BLOCKS,
):
  """x + (silu(gate) * up) @ w_down with [gate, up] = rms_norm(x, norm_weight, eps) @ w_gate_up.

  The same function as `transformer.mlp_block` (fused `w_gate_up` layout: gate is the first F
  columns), as two or three GPU kernels (see the module docstring), for few rows.

  Args:
    x: [B, T, D] residual stream, B*T <= MAX_ROWS (16); bf16, f16 or f32.
    norm_weight: [D] RMSNorm weight (`p["mlp_norm"]`), or [L, D] for stacked layers.
    w_gate_up: [D, 2F] (or [L, D, 2F]), x's dtype.
    w_down: [F, D] (or [L, F, D]), x's dtype.
    eps: RMSNorm epsilon (static).
    layer: with stacked weights, which layer (int or int32 scalar, may be traced; clamped to
      [0, L) like `lax.dynamic_index_in_dim`); the kernels offset their pointers, so no slice of
      the weights is ever copied. None (default) for per-layer weights.
    interpret: run the kernels in Pallas's interpreter (works on CPU; for tests).
    blocks: tile sizes and launch parameters (`MlpBlocks`; static).

  Returns:
    [B, T, D] in x's dtype. Equal to `mlp_block`'s output up to float32 reassociation, and in
    bf16 up to a rounding or two of the intermediate activations.

  Raises:
    ValueError: bad shapes or dtypes, more than 16 rows, bad block sizes, or `layer` given with
      per-layer weights (or missing with stacked ones).

  Example:
    >>> y = fused_mlp(x, p["mlp_norm"], p["w_gate_up"], p["w_down"], cfg.rms_norm_eps)  # doctest: +SKIP
    >>> y = fused_mlp(x, stacked["mlp_norm"], stacked["w_gate_up"], stacked["w_down"], 1e-5, layer=i)  # doctest: +SKIP
  """
  why = _check_args(x, norm_weight, w_gate_up, w_down)
  if why:
    raise ValueError(f"fused_mlp: {why}")
  blocks.validate()
  if plgpu is None:  # pragma: no cover
    raise ValueError("fused_mlp: jax.experimental.pallas.triton is not importable")
  stacked = w_gate_up.ndim == 3
  if stacked != (layer is not None):
    raise ValueError("fused_mlp: pass `layer` exactly when the weights are stacked [L, ...]")
  if not stacked:  # one layer of stacked weights: the reshapes are bitcasts, no kernels
    norm_weight, w_gate_up, w_down, layer = norm_weight[None], w_gate_up[None], w_down[None], 0
  layer = jnp.asarray(layer, jnp.int32).reshape(1)
  b, t, d = x.shape
  rows, f = b * t, w_down.shape[1]
  x2 = x.reshape(rows, d)  # a bitcast, no kernel
  params = _compiler_params(blocks, interpret)

  h = pl.pallas_call(
    functools.partial(
      _gate_up_kernel, rows=rows, d=d, f=f, eps=float(eps), block_f=blocks.block_f, block_k=blocks.block_k1
    ),
    out_shape=jax.ShapeDtypeStruct((rows, f), x.dtype),  # x's dtype, like mlp_block's silu(gate) * up
    grid=(pl.cdiv(f, blocks.block_f),),
    interpret=interpret,
    compiler_params=params,
    name="fused_mlp_gate_up",
  )(layer, x2, norm_weight, w_gate_up)

  return project_residual(h, w_down, x2, layer, blocks=blocks, interpret=interpret).reshape(b, t, d)


def project_residual(h, w, x2, layer, *, blocks: MlpBlocks = DEFAULT_BLOCKS, interpret: bool = False):
  """x2 + h @ w[layer] for few rows, as `_down_kernel`s (one, or split over K plus one XLA fusion).

  The second half of `fused_mlp`, also the output projection of `attention.fused_attention`.

  Args:
    h: [rows, F] (rows <= MAX_ROWS), w's dtype.
    w: [L, F, D] stacked weights (a per-layer [F, D] passed as w[None]: a bitcast).
    x2: [rows, D] residual.
    layer: int32 [1], the layer of w (clamped into range).
    blocks: uses block_d, block_k2, split_k, num_warps, num_stages.
    interpret: run in Pallas's interpreter.

  Returns:
    [rows, D] in x2's dtype; the sum is accumulated in float32 and rounded once.

  Example:
    >>> y = project_residual(h, w_down[None], x2, jnp.zeros((1,), jnp.int32))  # doctest: +SKIP
  """
  rows, f = h.shape
  d = x2.shape[1]
  params = _compiler_params(blocks, interpret)
  split, chunk = blocks._split(f), blocks._chunk(f)
  residual = split == 1
  out_shape = (
    jax.ShapeDtypeStruct((rows, d), x2.dtype) if residual else jax.ShapeDtypeStruct((split, rows, d), jnp.float32)
  )
  out = pl.pallas_call(
    functools.partial(
      _down_kernel, rows=rows, d=d, f=f, chunk=chunk, block_d=blocks.block_d, block_k=blocks.block_k2, residual=residual
    ),
    out_shape=out_shape,
    grid=(pl.cdiv(d, blocks.block_d), split),
    interpret=interpret,
    compiler_params=params,
    name="fused_mlp_down",
  )(layer, h, w, x2)
  if not residual:  # one XLA fusion: sum the partials, add the residual, round
    # Elementwise adds in a fixed order, not a reduction, whose order XLA may pick by shape: a row's
    # sum is then the same bits whatever the number of rows (batch invariance).
    total = out[0]
    for part in range(1, split):
      total = total + out[part]
    out = (total + x2.astype(jnp.float32)).astype(x2.dtype)
  return out
