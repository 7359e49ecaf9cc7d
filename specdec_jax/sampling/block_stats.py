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
from specdec_jax.sampling.thresholds import (
  from_ordered_key,
  largest_key,
  largest_key_by_digits,
  ordered_key,
  top_k_on,
  top_k_or_top_p_on,
)

try:  # the Triton back end of Pallas (GPU); the interpreter needs only its load/store
  from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - a jax without Pallas's Triton module
  plgpu = None


def compiler_params(interpret: bool, num_warps: int = 4):
  """The Triton settings the sampler's kernels share; None in the interpreter or without Pallas's Triton module."""
  return None if interpret or plgpu is None else plgpu.CompilerParams(num_warps=num_warps, num_stages=1)


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


def gumbel_pick(log_w, ids, live, seed, counter: int):
  """The first id of max(log w - log E) over the live entries: an id drawn with probability ~ w (Gumbel-max).

  E ~ Exponential(1) per entry from the row's key and (counter, id), so the
  same row, counter and id always get the same noise. With no live entry of
  weight > 0 it returns the smallest id whose score ties at -inf.

  Args:
    log_w: f32[n] log-weights (-inf: never drawn while another has weight); ids: int32[n] their ids;
    live: bool[n], entries that take part; seed: the row's (uint32, uint32) key (`row_seed`);
    counter: static uint32 counter word, one per use.

  Example:
    >>> gumbel_pick(jnp.log(jnp.array([0.2, 0.8])), jnp.arange(2), jnp.ones(2, bool), seed, 7)   # 1 w.p. 0.8
  """
  noise = log_exponential(threefry2x32(*seed, jnp.uint32(counter), ids.astype(jnp.uint32))[0])
  score = jnp.where(live, log_w - noise, -jnp.inf)
  return jnp.min(jnp.where(score == jnp.max(score), ids, jnp.int32(2**31 - 1)))


def key_words(keys, b: int):
  """(uint32 words, fold) of the kernels' keys: one typed key's [2] words, folded with each row index inside
  the kernels (fold=True, as `row_keys` folds), or the rows' keys [B, 2]. The default generator's keys are
  their own words; other generators' keys are drawn from.

  Args:
    keys: a typed key [] or [B]; b: B.

  Example:
    >>> words, fold = key_words(jax.random.key(0), 4)   # (uint32[2], True)
  """
  threefry = "threefry" in str(jax.random.key_impl(keys))
  if keys.ndim == 0 and threefry:
    return jax.random.key_data(keys), True
  if keys.ndim == 0:
    keys = jax.vmap(lambda i: jax.random.fold_in(keys, i))(jnp.arange(b, dtype=jnp.int32))
  if threefry:
    return jax.random.key_data(keys), False
  return jax.vmap(lambda kk: jax.random.bits(kk, (2,), jnp.uint32))(keys), False


def row_seed(words_ref, b, fold: bool):
  """Row b's threefry key (uint32, uint32) inside a kernel, from `key_words`' output
  (fold: jax.random.fold_in(key, b) of the default generator, bit for bit)."""
  if fold:
    return threefry2x32(words_ref[0], words_ref[1], jnp.uint32(0), b.astype(jnp.uint32))
  return words_ref[b, 0], words_ref[b, 1]


def load(ref, idx, mask, other):
  """Masked load (nothing fetched where the mask is off; `other` there, which the interpreter needs)."""
  return plgpu.load(ref.at[idx], mask=mask, other=other)


def store(ref, idx, value, mask=None):
  plgpu.store(ref.at[idx], value, mask=mask)


def scaled(x, t, shift):
  """(x - shift) / t with x == shift mapping to 0 (+inf - +inf included): `reductions.scale_logits`' rule."""
  return jnp.where(x == shift, 0.0, (x - shift) / t)


def processed_log_p(x, t, shift, thr, top, log_norm):
  """log p of loaded logits x under the processed distribution (-inf: removed or NaN), from a position's
  (shift, thr) and its `combine_partials` (top, log_norm); they broadcast against x (scalars, or a column per
  position of a 2-D tile).

  Example:
    >>> log_p = processed_log_p(x, t, shift, thr, top, log_norm)   # x: a block of one row's logits
  """
  x = x.astype(jnp.float32)
  x = jnp.where(jnp.isnan(x), -jnp.inf, x)
  return jnp.where(scaled(x, t, shift) >= thr, scaled(x, t, top) - log_norm, -jnp.inf)


def filter_candidates(blocks: int) -> int:
  """Largest logits per block that the top-k/top-p search keeps (`block_thresholds`).

  A row's kept set is settled from them while no block holds all c of its
  candidates inside the set, else the row searches its whole vocabulary (slow).
  The kept tokens fall into blocks about at random (balls in bins): with 8 a
  block over 64 blocks or more (V = 151936 with blocks of 2048) and 16 over
  fewer (V = 49152, 32000), about 1% of rows or fewer with a top-k of 100 fall
  back, and almost none with a top-k of 50. Each candidate costs a pass over its block.

  Example:
    >>> filter_candidates(75), filter_candidates(24)   # V = 151936, 49152: (8, 16)
  """
  return 8 if blocks >= 64 else 16


def filters_on(top_k, top_p, t_raw, vocab: int, all_random: bool):
  """Whether a request's top-k or top-p may remove tokens (`thresholds.filter_active`'s rule, on scalars).

  Greedy requests (temperature below `GREEDY_TEMPERATURE`, unless `all_random`) never filter.

  Args:
    top_k: int32 scalar or array; top_p, t_raw (the request's temperature): f32 of the same shape.
    vocab: V (a top-k >= V is off); all_random: static, as `rejection_sample`'s.

  Returns:
    bool, the shape of the inputs.

  Example:
    >>> filters_on(jnp.int32(50), jnp.float32(1.0), jnp.float32(0.8), 1000, False)   # True
  """
  on = top_k_or_top_p_on(top_k, top_p, vocab)
  return on if all_random else on & (t_raw >= GREEDY_TEMPERATURE)


def top_values(x, cols, count: int):
  """The `count` largest values of the vector x (multiset: a tie counts twice), descending, as f32[count].

  Args:
    x: f32[n]; cols: int32[n], distinct ids of x's entries (which copy of a tie to take out);
    count: static, a power of two (Triton's vectors are).

  Example:
    >>> top_values(jnp.array([1.0, 3.0, 3.0, 2.0]), jnp.arange(4), 2)   # [3, 3]
  """
  out = jnp.full((count,), -jnp.inf, jnp.float32)
  slots = jnp.arange(count, dtype=jnp.int32)
  for i in range(count):
    m = jnp.max(x)
    out = jnp.where(slots == i, m, out)
    x = jnp.where(cols == jnp.min(jnp.where(x == m, cols, jnp.int32(2**31 - 1))), -jnp.inf, x)
  return out


def _partials_kernel(
  x_ref, *refs, vocab, block, positions, filters, per_program, blocks, with_mass, candidates, all_random
):
  if with_mass:
    temperature_ref, *refs = refs
  thresholds_ref, *refs = refs if filters else (None, *refs)
  if candidates:
    top_k_ref, top_p_ref, *refs, cand_ref = refs
  m_ref, s_ref, a_ref = refs if with_mass else (refs[0], None, refs[1])
  r = pl.program_id(0)
  if with_mass:
    temperature = temperature_ref[r // positions]
    t = jnp.where(temperature < GREEDY_TEMPERATURE, 1.0, temperature)
  if filters:
    shift, thr = thresholds_ref[r // positions, r % positions, 0], thresholds_ref[r // positions, r % positions, 1]
  if candidates:
    b = r // positions
    active = filters_on(top_k_ref[b], top_p_ref[b], temperature, vocab, all_random)
  for step in range(per_program):  # unrolled: every block's loads are issued before the first reduction
    j = pl.program_id(1) * per_program + step
    cols = j * block + jnp.arange(block, dtype=jnp.int32)
    x = load(x_ref, (r, pl.ds(j * block, block)), (cols < vocab) & (j < blocks), -jnp.inf)
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
    if candidates:

      @pl.when(active & (j < blocks))
      def _():  # only rows whose filters are on pay for the candidates
        store(cand_ref, (r, j, pl.ds(0, candidates)), top_values(kept, cols, candidates))


@functools.partial(
  jax.jit,
  static_argnames=("positions", "block", "interpret", "num_warps", "candidates", "all_random"),
)
def block_partials(
  logits,
  temperature,
  thresholds=None,
  filter_params=None,
  *,
  positions: int = 1,
  block: int = DEFAULT_BLOCK,
  interpret: bool = False,
  num_warps: int = 4,
  candidates: int = 0,
  all_random: bool = False,
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

  With `candidates` = c > 0, requests whose top-k or top-p is on (`filters_on`)
  also get each block's c largest logits (NaN as -inf), the candidates of the
  threshold search (`block_thresholds`); other requests' rows of that output
  are not written.

  Args:
    logits: [R, V], any float dtype, R = B * positions.
    temperature: f32[B], or None: (m, first) only.
    thresholds: f32[B, positions, 2], (shift, thr) of each position, or None (nothing filtered).
    positions: static rows per request.
    block: static tokens per block, a power of two.
    interpret: run in Pallas's interpreter (any backend; tests).
    filter_params: (top_k int32[B], top_p f32[B]), with `candidates` > 0 (needs a temperature).
    candidates: static c, a power of two (0: none).
    all_random: static; requests at temperature 0 count as random (`rejection_sample(all_random=True)`).

  Returns:
    (m f32[R, n], mass f32[R, n], first int32[R, n]), n = ceil(V / block); (m, first) without a temperature;
    with candidates, a fourth output f32[R, n, c].

  Example:
    >>> m, s, a = block_partials(logits.reshape(b * 5, v), params.temperature, positions=5, block=1024)
  """
  r, v = logits.shape
  if block & (block - 1):
    raise ValueError(f"block_partials: block must be a power of two, got {block}")
  if candidates & (candidates - 1) or (candidates and (filter_params is None or temperature is None)):
    raise ValueError(
      f"block_partials: candidates must be 0 or a power of two given with filter_params and a temperature, "
      f"got {candidates}"
    )
  filters = thresholds is not None
  with_mass = temperature is not None
  n = pl.cdiv(v, block)
  # Blocks per program: one while programs are few (small batch: every SM busy), up to 8 when they are
  # many, so that a program has several loads in flight and the grid fewer programs to schedule.
  per_program = int(min(8, max(1, r * n // 1024)))
  params = compiler_params(interpret, num_warps)
  f32 = jax.ShapeDtypeStruct((r, n), jnp.float32)
  extra = (temperature.astype(jnp.float32),) if with_mass else ()
  extra += (thresholds.astype(jnp.float32),) if filters else ()
  if candidates:
    extra += (filter_params[0].astype(jnp.int32), filter_params[1].astype(jnp.float32))
  i32 = jax.ShapeDtypeStruct((r, n), jnp.int32)
  out_shape = (f32, f32, i32) if with_mass else (f32, i32)
  if candidates:
    out_shape += (jax.ShapeDtypeStruct((r, n, candidates), jnp.float32),)
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
      candidates=candidates,
      all_random=all_random,
    ),
    out_shape=out_shape,
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


# ----------------------------------------------------------------------------
# Top-k / top-p thresholds from the candidates, on the GPU, with no run-time branch outside a kernel
# ----------------------------------------------------------------------------


def _search(count_at, mass_at, total, top_k, top_p, k_on, p_on, largest_key=largest_key):
  """(kth, thr) of one row from counts and masses of its scaled values (`thresholds`' sorted search, exactly).

  count_at(u): tokens whose ordered key is >= u. mass_at(u, kth): the mass of the
  tokens >= kth whose key is >= u. The top-k value is the largest value with at
  least k tokens at or above it; the top-p value the largest whose tokens (within
  the top-k set) hold at least top_p of that set's mass (none: the whole top-k set).
  largest_key: `thresholds.largest_key` (bit by bit), or `thresholds.largest_key_by_digits` (four bits a
  step, so a search that reads the row for every weighing reads it 8 times instead of 32; count_at and
  mass_at then also take a vector of 16 keys).
  """
  # The branches take -inf as an operand, computed (a select) so that it is a value: Triton's scf.if yields
  # values, not literals.
  off = jnp.where(k_on, jnp.float32(-jnp.inf), jnp.float32(-jnp.inf))
  kth = jax.lax.cond(
    k_on,
    lambda off: from_ordered_key(largest_key(count_at, lambda n: n >= top_k)),
    lambda off: off,
    off,
  )

  def top_p_value(off):
    target = top_p * jnp.where(k_on, mass_at(jnp.uint32(0), kth), total)
    key = largest_key(lambda u: mass_at(u, kth), lambda w: w >= target)
    return jnp.where(mass_at(key, kth) >= target, from_ordered_key(key), off)

  pth = jax.lax.cond(p_on, top_p_value, lambda off: off, off)
  return kth, jnp.where(p_on, jnp.maximum(kth, pth), kth)


def _thresholds_kernel(
  t_ref,
  top_k_ref,
  top_p_ref,
  cand_ref,
  x_ref,
  m_in,
  mass_in,
  thr_ref,
  m_ref,
  mass_ref,
  *,
  vocab,
  block,
  blocks,
  nbp,
  positions,
  candidates,
  all_random,
):
  del m_in, mass_in  # read through their aliases m_ref and mass_ref
  r = pl.program_id(0)
  b = r // positions
  t_raw, top_k, top_p = t_ref[b], top_k_ref[b], top_p_ref[b]
  active = filters_on(top_k, top_p, t_raw, vocab, all_random)
  pair = jnp.arange(2, dtype=jnp.int32)

  @pl.when(~active)
  def _():
    store(thr_ref, (r, pl.ds(0, 2)), jnp.where(pair == 0, 0.0, -jnp.inf))

  @pl.when(active)
  def _():
    t = jnp.where(t_raw < GREEDY_TEMPERATURE, 1.0, t_raw)
    ids = jnp.arange(nbp, dtype=jnp.int32)
    slots = jnp.arange(candidates, dtype=jnp.int32)
    live = ids < blocks
    m = load(m_ref, (r, pl.ds(0, nbp)), live, -jnp.inf)
    mass = load(mass_ref, (r, pl.ds(0, nbp)), live, 0.0)
    top = jnp.max(m)
    # Scaled values in the frame of the row's max (never above 0: no overflow at any temperature).
    frame = lambda x: jnp.where(x > -jnp.inf, scaled(x, t, top), -jnp.inf)
    total = jnp.sum(jnp.where(mass > 0, mass * jnp.exp(frame(m)), 0.0))
    k_on, p_on = top_k_on(top_k, vocab), top_p < 1.0

    cand = load(
      cand_ref, (r, pl.ds(0, nbp), pl.ds(0, candidates)), live[:, None] & (slots < candidates)[None], -jnp.inf
    )
    s = frame(cand)
    keys, e = ordered_key(s), jnp.exp(s)
    # A token outside the candidates is at most its block's c-th largest: at most `floor`.
    floor = jnp.max(jnp.where(slots[None, :] == candidates - 1, s, -jnp.inf))
    kth, thr = _search(
      lambda u: jnp.sum((keys >= u).astype(jnp.int32)),
      lambda u, kth: jnp.sum(jnp.where((s >= kth) & (keys >= u), e, 0.0)),
      total,
      top_k,
      top_p,
      k_on,
      p_on,
    )
    # The candidates hold every token at or above a threshold above the floor (top-p's mass also needs the
    # top-k set whole); a row with nothing above -inf has nothing to filter.
    exact = jnp.where(k_on, kth > floor, thr > floor) | (top == -jnp.inf)

    @pl.when(exact)
    def _():
      kept = (s >= thr) & (cand > -jnp.inf)  # a row with nothing above -inf keeps nothing (mass 0)
      m_kept = jnp.max(jnp.where(kept, cand, -jnp.inf), axis=1)
      mass_kept = jnp.sum(jnp.where(kept, jnp.exp(scaled(cand, t, m_kept[:, None])), 0.0), axis=1)
      store(m_ref, (r, pl.ds(0, nbp)), m_kept, mask=live)
      store(mass_ref, (r, pl.ds(0, nbp)), mass_kept, mask=live)
      store(thr_ref, (r, pl.ds(0, 2)), jnp.where(pair == 0, jnp.where(top > -jnp.inf, top, 0.0), thr))

    @pl.when(~exact)
    def _():  # rare: the same search over the whole row, a pass over it per step
      cols = jnp.arange(block, dtype=jnp.int32)

      def scaled_block(j):
        x = load(x_ref, (r, pl.ds(j * block, block)), j * block + cols < vocab, -jnp.inf).astype(jnp.float32)
        x = jnp.where(jnp.isnan(x), -jnp.inf, x)
        return x, frame(x)

      # Each weighing is a pass over the row: 16 trial keys a pass (`largest_key_by_digits`).
      def over_row(weigh, u):
        """Sum of weigh(scaled block, keys >= u) over the blocks; u a key or a vector of keys."""
        ge = (lambda keys: keys >= u) if u.ndim == 0 else (lambda keys: keys[None, :] >= u[:, None])
        add = lambda j, acc: acc + weigh(scaled_block(j)[1], ge, u.ndim)
        return jax.lax.fori_loop(0, blocks, add, jnp.zeros(u.shape, jnp.float32))

      count_row = lambda u: over_row(lambda sx, ge, d: jnp.sum(ge(ordered_key(sx)).astype(jnp.float32), axis=d), u)

      def mass_row(u, kth):
        def mass(sx, ge, d):
          w = jnp.where(sx >= kth, jnp.exp(sx), 0.0)
          return jnp.sum(jnp.where(ge(ordered_key(sx)), w if d == 0 else w[None, :], 0.0), axis=d)

        return over_row(mass, u)

      _, thr_row = _search(count_row, mass_row, total, top_k, top_p, k_on, p_on, largest_key_by_digits)

      def fix_block(j, carry):
        x, sx = scaled_block(j)
        kept = jnp.where(sx >= thr_row, x, -jnp.inf)
        m_j = jnp.max(kept)
        mass_j = jnp.sum(jnp.where(kept > -jnp.inf, jnp.exp(scaled(kept, t, m_j)), 0.0))
        store(m_ref, (r, pl.ds(j, 1)), m_j[None])
        store(mass_ref, (r, pl.ds(j, 1)), mass_j[None])
        return carry

      jax.lax.fori_loop(0, blocks, fix_block, jnp.int32(0))
      store(thr_ref, (r, pl.ds(0, 2)), jnp.where(pair == 0, top, thr_row))


@functools.partial(jax.jit, static_argnames=("positions", "block", "all_random", "interpret"))
def block_thresholds(
  logits,
  temperature,
  top_k,
  top_p,
  m,
  mass,
  cand,
  *,
  positions: int,
  block: int = DEFAULT_BLOCK,
  all_random: bool = False,
  interpret: bool = False,
):
  """Top-k/top-p thresholds of every row, and its block partials redone for the kept tokens, in one kernel.

  A row whose request filters nothing (`filters_on`) writes (0, -inf) and
  returns: the batch needs no run-time branch outside the kernel. A filtering
  row searches its candidates (`block_partials(candidates=c)`) by bisection on
  the values' bit patterns: the top-k value, then the top-p value, exactly as
  `thresholds`' sorted search defines them (ties kept), in the frame of the
  row's max. Where a threshold is not above every block's c-th largest value,
  the candidates may miss kept tokens, and the row repeats the search over its
  whole vocabulary (exact; 16 trial values weighed per pass over the row, up
  to 19 passes, so slow, and rare for top-k in the tens and language-model
  top-p). Its (m, mass) partials are then those of the
  kept tokens: `block_partials` with these thresholds would give the same.

  Args:
    logits: [R, V], R = B * positions; temperature f32[B]; top_k int32[B]; top_p f32[B].
    m, mass: f32[R, n] from `block_partials` (no thresholds); cand: f32[R, n, c] from it.
    positions, block, all_random: static, as given to `block_partials`; interpret: Pallas's interpreter.

  Returns:
    (thresholds f32[R, 2] = (shift, thr): keep x iff scaled(x, t, shift) >= thr; m f32[R, n]; mass f32[R, n]).

  Example:
    >>> m, mass, first, cand = block_partials(x, t, None, (k, p), positions=5, candidates=8)
    >>> thresholds, m, mass = block_thresholds(x, t, k, p, m, mass, cand, positions=5)
  """
  r, v = logits.shape
  n, candidates = cand.shape[1], cand.shape[2]
  kernel = functools.partial(
    _thresholds_kernel,
    vocab=v,
    block=block,
    blocks=n,
    nbp=pow2(n),
    positions=positions,
    candidates=candidates,
    all_random=all_random,
  )
  params = compiler_params(interpret)
  f32 = jax.ShapeDtypeStruct((r, n), jnp.float32)
  return pl.pallas_call(
    kernel,
    out_shape=(jax.ShapeDtypeStruct((r, 2), jnp.float32), f32, f32),
    grid=(r,),
    input_output_aliases={5: 1, 6: 2},
    interpret=interpret,
    compiler_params=params,
    name="sampler_thresholds",
  )(
    temperature.astype(jnp.float32),
    top_k.astype(jnp.int32),
    top_p.astype(jnp.float32),
    cand,
    logits,
    m,
    mass,
  )
