"""Pallas pieces of the samplers' fused path: per-block statistics, and random numbers a kernel makes itself.

At small batch a sampler's time is its number of kernels, not its bytes: a
[B, K+1, V] pass at B=1 moves a few megabytes, and each of the dozens of small
XLA kernels around it (random bits, gathers, run-time branches) costs a
microsecond or more. The fused path reads the logits in one kernel that
leaves, per block of `block` tokens, three numbers (`block_partials`); the
kernels after it read only those partials, the draft tokens' logits and one
block per row, and draw their own random numbers from the row's key
(`threefry2x32`, Random123's counter-based generator, the one `jax.random`
uses by default), so no random array is made beforehand.

Everything here runs inside kernels (Triton on a GPU, Pallas's interpreter
elsewhere) and, being plain jax.numpy, outside them as well (tests).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from specdec_jax.sampling.params import GREEDY_TEMPERATURE

try:  # the Triton back end of Pallas (GPU); the interpreter needs only its load/store
  from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - a jax without Pallas's Triton module
  plgpu = None

# Tokens per block of a pass: a power of two (Triton's tensors are), large enough that a block's three
# partials cost little next to its tokens, small enough that B=1 still gives dozens of programs.
DEFAULT_BLOCK = 2048

_ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)
_PARITY = 0x1BD11BDA


def pow2(n: int, smallest: int = 2) -> int:
  """The smallest power of two >= max(n, smallest) (Triton's tensor extents)."""
  return max(smallest, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def threefry2x32(k0, k1, c0, c1):
  """Threefry-2x32 with 20 rounds (Salmon et al., SC 2011): two uint32 words of random bits per counter.

  Runs on uint32 arrays of any (broadcastable) shapes, inside a Pallas kernel or
  outside; the same function `jax.random`'s default generator computes.

  Args:
    k0, k1: uint32 key words.
    c0, c1: uint32 counter words.

  Returns:
    (x0, x1), uint32.

  Example:
    >>> threefry2x32(*[jnp.uint32(0)] * 4)   # Random123's known answer: (0x6b200159, 0x99ba4efe)
  """
  k0, k1, c0, c1 = (jnp.asarray(a, jnp.uint32) for a in (k0, k1, c0, c1))
  ks = (k0, k1, k0 ^ k1 ^ jnp.uint32(_PARITY))
  x0, x1 = c0 + ks[0], c1 + ks[1]
  for r in range(20):
    rot = _ROTATIONS[r % 8]
    x0 = x0 + x1
    x1 = (x1 << jnp.uint32(rot)) | (x1 >> jnp.uint32(32 - rot))
    x1 = x1 ^ x0
    if r % 4 == 3:
      i = (r + 1) // 4
      x0 = x0 + ks[i % 3]
      x1 = x1 + ks[(i + 1) % 3] + jnp.uint32(i)
  return x0, x1


def open_uniform(bits):
  """f32 uniform on (0, 1) from uint32 bits: the top 24 bits, centred in their cell (never 0 or 1).

  Example:
    >>> open_uniform(jnp.uint32(0))   # 2**-25
  """
  return ((bits >> jnp.uint32(8)).astype(jnp.int32).astype(jnp.float32) + 0.5) * np.float32(2.0**-24)


def log_exponential(bits):
  """f32 log E for E ~ Exponential(1), from all 32 bits: argmax(log w - log E) draws an index with prob. ~ w.

  E = -log1p(-w) with w = (bits + 1/2) 2^-32, so the draws that decide a
  Gumbel-max (small E, large weight) keep 24 significant bits down to
  E = 2^-33: the race's largest noise is 22.9 (jax.random.gumbel's: 16.6).

  Example:
    >>> log_exponential(jnp.uint32(0))   # log(2**-33) = -22.87
  """
  hi = (bits >> jnp.uint32(16)).astype(jnp.int32).astype(jnp.float32)
  lo = (bits & jnp.uint32(0xFFFF)).astype(jnp.int32).astype(jnp.float32)
  w = (hi * np.float32(65536.0) + lo + 0.5) * np.float32(2.0**-32)
  return jnp.log(-jnp.log1p(-w))


def load(ref, idx, mask, other):
  """Masked load (nothing fetched where the mask is off; `other` there, which the interpreter needs)."""
  return plgpu.load(ref.at[idx], mask=mask, other=other)


def store(ref, idx, value, mask=None):
  plgpu.store(ref.at[idx], value, mask=mask)


def scaled(x, t, shift):
  """(x - shift) / t with x == shift mapping to 0 (+inf - +inf included): `reductions.scale_logits`' rule."""
  return jnp.where(x == shift, 0.0, (x - shift) / t)


def _partials_kernel(x_ref, *refs, vocab, block, positions, filters, per_program, blocks, with_mass, skip_last):
  if with_mass:
    temperature_ref, *refs = refs
  thresholds_ref, *refs = refs if filters else (None, *refs)
  m_ref, s_ref, a_ref = refs if with_mass else (refs[0], None, refs[1])
  r = pl.program_id(0)
  # skip_last: the last position of every request is not read (its partials are garbage).
  wanted = (r % positions != positions - 1) if skip_last else True
  if with_mass:
    temperature = temperature_ref[r // positions]
    t = jnp.where(temperature < GREEDY_TEMPERATURE, 1.0, temperature)
  if filters:
    shift, thr = thresholds_ref[r // positions, r % positions, 0], thresholds_ref[r // positions, r % positions, 1]
  for step in range(per_program):  # unrolled: every block's loads are issued before the first reduction
    j = pl.program_id(1) * per_program + step
    cols = j * block + jnp.arange(block, dtype=jnp.int32)
    x = load(x_ref, (r, pl.ds(j * block, block)), (cols < vocab) & (j < blocks) & wanted, -jnp.inf)
    x = x.astype(jnp.float32)
    x = jnp.where(jnp.isnan(x), -jnp.inf, x)  # a NaN logit is a masked token
    kept = jnp.where(scaled(x, t, shift) >= thr, x, -jnp.inf) if filters else x
    m = jnp.max(kept)
    first = jnp.min(jnp.where(kept == m, cols, jnp.int32(2**31 - 1)))
    here = (r, pl.ds(j, 1))
    live = jnp.full((1,), j < blocks)
    store(m_ref, here, m[None], mask=live)
    store(a_ref, here, first[None], mask=live)
    if with_mass:
      mass = jnp.sum(jnp.where(kept > -jnp.inf, jnp.exp(scaled(kept, t, m)), 0.0))
      store(s_ref, here, mass[None], mask=live)


@functools.partial(jax.jit, static_argnames=("positions", "block", "interpret", "num_warps", "skip_last"))
def block_partials(
  logits,
  temperature,
  thresholds=None,
  *,
  positions: int = 1,
  block: int = DEFAULT_BLOCK,
  interpret: bool = False,
  num_warps: int = 4,
  skip_last: bool = False,
):
  """One read of the logits: per row and block of tokens, the kept tokens' max, mass and first argmax.

  Row r belongs to request r // positions (its temperature) at position
  r % positions. A token is kept when `(x - shift) / t >= thr` (NaN logits
  count as -inf); without thresholds every token is kept. t is the
  request's temperature, 1 below `GREEDY_TEMPERATURE`. With m the block's
  largest kept logit, mass = sum over kept tokens of exp((x - m) / t); a block
  with nothing kept has m = -inf and mass 0. The argmax is the first index of
  m in the block (the block's first index when nothing is above -inf).
  `combine_partials` turns a row's partials into its max, normaliser and
  argmax, and each block's log-mass. Without a temperature the kernel only
  finds maxima and argmaxima (no exponential: the greedy program's pass).

  Args:
    logits: [R, V], any float dtype, R = B * positions.
    temperature: f32[B], or None: (m, first) only.
    thresholds: f32[B, positions, 2], (shift, thr) of each position, or None (nothing filtered).
    positions: static rows per request.
    block: static tokens per block, a power of two.
    interpret: run in Pallas's interpreter (any backend; tests).
    skip_last: static; rows at the last position of a request are not read (their partials are garbage).

  Returns:
    (m f32[R, n], mass f32[R, n], first int32[R, n]), n = ceil(V / block); (m, first) without a temperature.

  Example:
    >>> m, s, a = block_partials(logits.reshape(b * 5, v), params.temperature, positions=5, block=1024)
  """
  r, v = logits.shape
  if block & (block - 1):
    raise ValueError(f"block_partials: block must be a power of two, got {block}")
  filters = thresholds is not None
  with_mass = temperature is not None
  n = pl.cdiv(v, block)
  # Blocks per program: one while programs are few (small batch: every SM busy), up to 8 when they are
  # many, so that a program has several loads in flight and the grid fewer programs to schedule.
  per_program = int(min(8, max(1, r * n // 1024)))
  params = None if interpret or plgpu is None else plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
  f32 = jax.ShapeDtypeStruct((r, n), jnp.float32)
  extra = (temperature.astype(jnp.float32),) if with_mass else ()
  extra += (thresholds.astype(jnp.float32),) if filters else ()
  i32 = jax.ShapeDtypeStruct((r, n), jnp.int32)
  return pl.pallas_call(
    functools.partial(
      _partials_kernel,
      vocab=v,
      block=block,
      positions=positions,
      filters=filters,
      per_program=per_program,
      blocks=n,
      with_mass=with_mass,
      skip_last=skip_last,
    ),
    out_shape=(f32, f32, i32) if with_mass else (f32, i32),
    grid=(r, pl.cdiv(n, per_program)),
    interpret=interpret,
    compiler_params=params,
    name="sampler_block_partials",
  )(logits, *extra)


def combine_partials(m, mass, first, t):
  """A row's (or rows') partials -> (max, log-normaliser, argmax, each block's log-mass), over the last axis.

  In the frame of the max: a kept token's log-probability is scaled(x, t, max) - log_norm,
  and block j's log-mass (relative to the same frame) is log_mass[j]. log_norm is -inf
  for a row with nothing above -inf. Plain jax.numpy: used inside the kernels.

  Args:
    m, mass, first: [..., n] from `block_partials` (padding blocks: m = -inf, mass = 0).
    t: f32 broadcastable to [..., 1], the rows' temperatures.

  Returns:
    (top f32[...], log_norm f32[...], argmax int32[...], log_mass f32[..., n]).

  Example:
    >>> top, log_norm, am, log_mass = combine_partials(m, s, a, jnp.ones((r, 1)))
  """
  top = jnp.max(m, axis=-1, keepdims=True)
  log_mass = jnp.where(mass > 0, scaled(m, t, top) + jnp.log(jnp.where(mass > 0, mass, 1.0)), -jnp.inf)
  total = jnp.sum(jnp.where(mass > 0, jnp.exp(log_mass), 0.0), axis=-1)
  log_norm = jnp.where(total > 0, jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
  argmax = jnp.min(jnp.where(m == top, first, jnp.int32(2**31 - 1)), axis=-1)
  return top[..., 0], log_norm, argmax, log_mass
