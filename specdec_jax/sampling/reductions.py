"""One-pass reductions over the vocabulary, scaling, and the chunking they share.

The samplers' cost is memory traffic: each function here reads its input once.
`chunk_size` holds the measured tuning constant that every chunked pass uses.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.sampling.params import GREEDY_TEMPERATURE


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LogitsView:
  """Logits with an elementwise transform still to apply (the logit bias and penalties).

  Every reader calls `values(view)` at the point of reading, so the transform
  fuses into that read. A transformed copy made once would cross `lax.cond`
  boundaries as an operand and be written to memory and read back: two more
  passes over [B, K+1, V]. As a pytree, a view crosses them as its inputs.

  Attributes:
    raw: the caller's logits [B, ..., V].
    args: a pytree of the transform's other inputs.
    fn: static; fn(raw, *args) -> f32 logits of raw's shape (elementwise in V).
  """

  raw: jax.Array
  args: tuple
  fn: Callable = dataclasses.field(metadata=dict(static=True))

  @property
  def shape(self) -> tuple:
    return self.raw.shape

  @property
  def ndim(self) -> int:
    return self.raw.ndim


def values(logits):
  """The logits' values: an array as it is, a `LogitsView` transformed here (inside this read)."""
  return logits.fn(logits.raw, *logits.args) if isinstance(logits, LogitsView) else logits


# ----------------------------------------------------------------------------
# One-pass reductions over the vocabulary
# ----------------------------------------------------------------------------


def _lse_combine(m1, s1, m2, s2, temperature=None):
  """Merges two (max, sum of exp((x - max) / T)) pairs with a single exponential (T = 1 when None).

  The larger max survives and only the other side's sum is rescaled. A side
  whose max is -inf carries no mass (and exp(-inf - -inf) would be NaN); two
  sides whose max is +inf add their sums (counts of +inf logits).
  """
  first = m1 >= m2
  hi, lo = jnp.where(first, m1, m2), jnp.where(first, m2, m1)
  s_hi, s_lo = jnp.where(first, s1, s2), jnp.where(first, s2, s1)
  gap = lo - hi if temperature is None else (lo - hi) / temperature  # <= 0: cannot overflow
  # lo == hi: exp(0) = 1 exactly, and +inf == +inf (two +inf logits in one chunk) must not give exp(NaN).
  return hi, s_hi + jnp.where(lo == -jnp.inf, 0.0, jnp.where(lo == hi, s_lo, s_lo * jnp.exp(gap)))


def _first_max_index(m1, i1, m2, i2):
  """The index of the larger max; the smaller index on a tie (the combiner of a first-argmax reduction)."""
  return jnp.where(m1 > m2, i1, jnp.where(m2 > m1, i2, jnp.minimum(i1, i2)))


def max_and_sumexp(x: jax.Array, *, with_argmax: bool = False):
  """One pass: (max, sum exp(x - max)[, first argmax]) over the last axis.

  XLA's logsumexp makes two passes (max, then sum); a variadic reduce whose
  combiner rescales the running sum reads x once, and carrying the argmax index
  too costs no extra read. The combiner needs one exponential per element.
  Rows that are all -inf give (-inf, 0).

  Args:
    x: f32[..., V].
    with_argmax: also return the first index of the maximum.

  Returns:
    (m f32[...], s f32[...]) with logsumexp(x) = m + log(s), and
    argmax int32[...] as a third element when `with_argmax`.

  Example:
    >>> m, s = max_and_sumexp(jnp.log(jnp.array([[1., 3.]])))   # m + log(s) == log(4)
  """

  def combine(a, b):
    m, s = _lse_combine(a[0], a[1], b[0], b[1])
    if not with_argmax:
      return m, s
    return m, s, _first_max_index(a[0], a[2], b[0], b[2])

  operands, init = (x, jnp.ones_like(x)), (np.float32(-np.inf), np.float32(0))
  if with_argmax:
    operands += (jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1),)
    init += (np.int32(np.iinfo(np.int32).max),)
  return jax.lax.reduce(operands, init, combine, (x.ndim - 1,))


def _bcast(row_values: jax.Array, x: jax.Array) -> jax.Array:
  """Reshapes per-row values [B] to broadcast against x [B, ..., V]."""
  return row_values.reshape(row_values.shape + (1,) * (x.ndim - 1))


def scale_logits(logits: jax.Array, temperature: jax.Array, shift: jax.Array | None = None) -> jax.Array:
  """float32 (logits - shift) / temperature, with greedy rows left at temperature 1.

  NaN results (NaN logits) become -inf: a NaN logit is a masked token. With a
  `shift` (the row max, see `shift_non_finite_rows`), a logit equal to it maps
  to 0, which also makes +inf - +inf a 0 (the +inf tokens share the mass).

  Args:
    logits: [B, ..., V], any float dtype.
    temperature: f32[B].
    shift: f32[B, ...] or None (no shift, the plain quotient).

  Returns:
    f32[B, ..., V].

  Example:
    >>> scale_logits(jnp.array([[2.0, jnp.nan]]), jnp.array([0.5]))   # [[4., -inf]]
  """
  x = values(logits).astype(jnp.float32)
  t = _bcast(jnp.where(temperature < GREEDY_TEMPERATURE, 1.0, temperature).astype(jnp.float32), x)
  if shift is None:
    y = x / t
  else:
    s = shift.astype(jnp.float32)[..., None]
    y = jnp.where(x == s, 0.0, (x - s) / t)
  return jnp.where(jnp.isnan(y), -jnp.inf, y)


_NO_ID = np.int32(np.iinfo(np.int32).max)  # loses every min over token ids


def greedy_argmax(logits: jax.Array, shards=None):
  """First index of the largest logit, NaN counted as -inf; 0 for a row with none above -inf.

  A single variadic reduction (like `jnp.argmax`, which would pick a NaN): the
  NaN rule lives in the combiner, so no masked copy of the logits is formed.

  Args:
    logits: [..., V], any float dtype (this device's slice [..., V/m] under `shards`).
    shards: a `vocab_parallel.VocabShards` inside the samplers' shard_map, or None.

  Returns:
    (int32[...] indices, [...] the max in the logits' dtype; -inf for a row without
    a usable logit). Under `shards`: global ids and the global max, on every device.

  Example:
    >>> greedy_argmax(jnp.array([[1.0, jnp.nan, 3.0]]))[0]   # [2]
  """
  x = jnp.asarray(values(logits))
  neg_inf = np.array(-np.inf, x.dtype)

  def combine(a, b):
    av, bv = jnp.where(jnp.isnan(a[0]), neg_inf, a[0]), jnp.where(jnp.isnan(b[0]), neg_inf, b[0])
    take_b = (bv > av) | ((bv == av) & (b[1] < a[1]))
    return jnp.where(take_b, bv, av), jnp.where(take_b, b[1], a[1])

  iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  best, idx = jax.lax.reduce((x, iota), (neg_inf, np.int32(np.iinfo(np.int32).max)), combine, (x.ndim - 1,))
  # Every entry -inf or NaN: the index is the first one, 0.
  idx = idx.astype(jnp.int32)
  if shards is None:
    return idx, best
  # The largest max wins, then the first device holding it (max and min are exact), from one gather of every
  # device's pair instead of a max and then a min across devices. (float32 holds any narrower float exactly.)
  best_d, idx_d = shards.gather_many(best.astype(jnp.float32)[..., None], idx[..., None])  # [..., m]
  top = jnp.max(best_d, axis=-1)
  offsets = (jnp.arange(shards.size, dtype=jnp.int32) * shards.local).reshape((1,) * (idx_d.ndim - 1) + (-1,))
  ids = jnp.where(best_d == top[..., None], idx_d + offsets, _NO_ID)
  return jnp.min(ids, axis=-1), top.astype(best.dtype)


class ChunkStats(NamedTuple):
  """`chunk_stats`' results."""

  max: jax.Array  # f32 [...]
  lse: jax.Array  # f32 [...]
  argmax: jax.Array | None  # int32 [...], or None without with_argmax
  chunk_log_mass: jax.Array  # f32 [..., n]


def chunk_stats(x: jax.Array, *, with_argmax: bool = False, shards=None) -> ChunkStats:
  """(max, lse, argmax or None, chunk log-masses [..., n]) of x over its last axis in chunks of `chunk_size(V)`.

  The per-chunk (max, sum of exps[, argmax]) come from one pass (`max_and_sumexp`
  on [..., n, c]); everything after reads only those n partials. Under
  `shards` each device reduces its own chunks and the partials are gathered,
  so the results are bit for bit those of one device.

  Args:
    x: f32[..., V] (this device's [..., V/m] under `shards`), V a multiple of the chunk size.
    with_argmax: also the first index of the max.
    shards: a `vocab_parallel.VocabShards`, or None.

  Returns:
    ChunkStats(max f32[...], lse f32[...], argmax int32[...] or None, chunk_log_mass f32[..., n]).

  Example:
    >>> m, lse, _, chunk_logw = chunk_stats(jnp.zeros((2, 4096)))   # lse = log 4096
  """
  v = x.shape[-1] if shards is None else shards.vocab
  c = chunk_size(v)
  stats = max_and_sumexp(x.reshape(x.shape[:-1] + (x.shape[-1] // c, c)), with_argmax=with_argmax)
  m_c, s_c = stats[0], stats[1]
  chunk_logw = jnp.where(s_c > 0, m_c + jnp.log(s_c), -jnp.inf)
  first = stats[2] if with_argmax else None
  if shards is not None and with_argmax:
    m_c, chunk_logw, first = shards.gather_many(m_c, chunk_logw, first)
  elif shards is not None:  # separate: a caller that never reads the max gathers only the masses
    m_c, chunk_logw = shards.gather(m_c), shards.gather(chunk_logw)
  lse = jax.nn.logsumexp(chunk_logw, axis=-1)
  am = None
  if with_argmax:  # first chunk holding the max, first index inside it
    ch = jnp.argmax(m_c, axis=-1)
    am = (ch * c + jnp.take_along_axis(first, ch[..., None], axis=-1)[..., 0]).astype(jnp.int32)
  return ChunkStats(jnp.max(m_c, axis=-1), lse, am, chunk_logw)


class ShiftedChunkStats(NamedTuple):
  """`shifted_chunk_stats`' results, the logs in the frame shifted by `shift`."""

  shift: jax.Array  # f32 [B, ...]: the row max (0 for a row with no logit above -inf)
  lse: jax.Array  # f32 [B, ...]
  argmax: jax.Array | None  # int32 [B, ...], or None without with_argmax
  chunk_log_mass: jax.Array  # f32 [B, ..., n]


def shifted_chunk_stats(
  logits: jax.Array, temperature: jax.Array, *, chunk: int, with_argmax: bool = False, shards=None
) -> ShiftedChunkStats:
  """(shift, lse, argmax or None, chunk log-masses) of softmax(logits / T), overflow-safe in one pass, no branch.

  `chunk_stats` reduces `logits / T`, which overflows for a temperature near 0
  or logits near the float32 limit; its callers then redo those rows under a
  run-time `lax.cond`, which on a GPU costs a device-to-host copy of the
  predicate on every call. Here the running max is kept on the *raw* logits
  and the running sum in units of exp((x - max) / T), so every exponent is
  <= 0: nothing can overflow and no row needs a redo. The results describe
  `scale_logits(logits, T, shift)` with shift = the row max (0 for a row with
  no logit above -inf), so +inf logits share the mass and NaN counts as -inf,
  as on every other path.

  Args:
    logits: [B, ..., V], any float dtype (this device's slice under `shards`).
    temperature: f32[B]; greedy rows (below `GREEDY_TEMPERATURE`) count as 1.
    chunk: static tokens per chunk; a divisor of the (local) V. `V` itself
      gives one chunk, i.e. whole rows.
    with_argmax: also the first index of the max (NaN counted as -inf).
    shards: a `vocab_parallel.VocabShards`, or None. Each device reduces its
      own chunks and the partials are gathered: the same bits as one device.

  Returns:
    ShiftedChunkStats(shift f32[B, ...], lse f32[B, ...] (-inf: no logit above -inf),
    argmax int32[B, ...] or None, chunk_logw f32[B, ..., n]), the logs in the
    shifted frame.

  Example:
    >>> shift, lse, _, _ = shifted_chunk_stats(jnp.array([[1e38, 0.0]]), jnp.array([1e-3]), chunk=2)
    >>> shift, lse   # [1e38], [0.]: all the mass on token 0, no overflow
  """
  x = values(logits).astype(jnp.float32)
  x = jnp.where(jnp.isnan(x), -jnp.inf, x)
  n = x.shape[-1] // chunk
  x = x.reshape(x.shape[:-1] + (n, chunk))
  t = jnp.where(temperature < GREEDY_TEMPERATURE, 1.0, temperature).astype(jnp.float32)
  t_x = jnp.broadcast_to(t.reshape(t.shape + (1,) * (x.ndim - 1)), x.shape)

  def combine(a, b):
    t_ab = jnp.maximum(a[2], b[2])  # the row's T (the initial value 0 is below any)
    out = _lse_combine(a[0], a[1], b[0], b[1], t_ab) + (t_ab,)
    return out + (_first_max_index(a[0], a[3], b[0], b[3]),) if with_argmax else out

  operands, init = (x, jnp.ones_like(x), t_x), (np.float32(-np.inf), np.float32(0), np.float32(0))
  if with_argmax:
    operands += (jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1),)
    init += (np.int32(np.iinfo(np.int32).max),)
  stats = jax.lax.reduce(operands, init, combine, (x.ndim - 1,))
  m_c, log_s = stats[0], jnp.log(stats[1])  # per chunk, raw max and log sum in units of its max
  first = stats[3] if with_argmax else None
  if shards is not None:
    m_c, log_s, *rest = shards.gather_many(m_c, log_s, *((first,) if with_argmax else ()))
    first = rest[0] if with_argmax else None
  top = jnp.max(m_c, axis=-1, keepdims=True)
  t_c = t.reshape(t.shape + (1,) * (m_c.ndim - 1))
  chunk_logw = jnp.where(m_c == -jnp.inf, -jnp.inf, jnp.where(m_c == top, 0.0, (m_c - top) / t_c) + log_s)
  lse = jax.nn.logsumexp(chunk_logw, axis=-1)
  am = None
  if with_argmax:  # first chunk holding the max, first index inside it
    ch = jnp.argmax(m_c, axis=-1)
    am = (ch * chunk + jnp.take_along_axis(first, ch[..., None], axis=-1)[..., 0]).astype(jnp.int32)
  top = top[..., 0]
  return ShiftedChunkStats(jnp.where(top == -jnp.inf, 0.0, top), lse, am, chunk_logw)


def sum_over_vocab(x: jax.Array, shards=None) -> jax.Array:
  """sum(x, axis=-1), in chunks of `chunk_size(V)` when V is a multiple of it (so that a vocabulary split
  over devices sums to the same bits: per-chunk sums, gathered, then summed).

  Example:
    >>> sum_over_vocab(jnp.ones((2, 4096)))   # [4096., 4096.]
  """
  v = x.shape[-1] if shards is None else shards.vocab
  c = chunk_size(v)
  if x.shape[-1] % c:
    return jnp.sum(x, axis=-1)
  part = jnp.sum(x.reshape(x.shape[:-1] + (x.shape[-1] // c, c)), axis=-1)
  return jnp.sum(part if shards is None else shards.gather(part), axis=-1)


def chunk_size(v: int) -> int:
  """Tokens per chunk when a pass over the vocabulary is split into chunks.

  Real vocabularies (V >= 8192) get a divisor of V near 1024 (512 to 8192) that
  is a multiple of 4 (so loads can be vectorised): such chunks read closest to
  the memory floor, whole rows and odd sizes slower (figures: bench/RESULTS.md).
  The few dozen chunk totals and one chunk's tokens are then cheap to sample from. Otherwise a size near
  sqrt(V), preferring a divisor (no padded copy); tiny test vocabularies get
  chunks of 2 or more, so that they exercise the same paths.

  Example:
    >>> chunk_size(151936), chunk_size(32000), chunk_size(49152)
    (4748, 1000, 1024)
  """
  if v >= 8192:
    divisors = [c for c in range(512, 8193, 4) if v % c == 0]
    if divisors:
      return min(divisors, key=lambda c: abs(np.log(c / 1024)))
  root = int(np.ceil(np.sqrt(v)))
  smallest = 16 if v >= 1024 else 2
  for c in sorted(range(max(1, root // 4), 4 * root + 1), key=lambda c: abs(c - root)):
    if v % c == 0 and c >= smallest:
      return c
  return root


def top_k(x: jax.Array, k: int, *, group: int = 128) -> tuple[jax.Array, jax.Array]:
  """`jax.lax.top_k(x, k)` over the last axis, the same values and indices, found through group maxima.

  XLA's TopK kernel is slow for small k over a large vocabulary (bench/round_profile.py).
  Here one pass takes the max of every group of
  `group` columns, a small top_k picks the k best groups, and a top_k over
  their k * group entries finishes: the k largest entries lie in the k groups
  with the largest maxima. The chosen groups are gathered in column order, so
  ties go to the lower index, as in `lax.top_k`. Inputs too small to gain,
  or whose V is not a multiple of `group`, go to `lax.top_k` directly.

  Args:
    x: [..., V], no NaN (callers map NaN to -inf).
    k: static, 1 <= k <= V.
    group: static group width.

  Returns:
    (values [..., k], indices int32 [..., k]), largest first.

  Example:
    >>> vals, ids = top_k(jnp.arange(1024.0).reshape(1, 1024) % 300, 3)
    >>> ids.tolist()
    [[299, 599, 899]]
  """
  v = x.shape[-1]
  if k > group or v % group or v // group <= 4 * k:
    vals, ids = jax.lax.top_k(x, k)
    return vals, ids.astype(jnp.int32)
  lead = x.shape[:-1]
  groups = x.reshape(lead + (v // group, group))
  _, best = jax.lax.top_k(jnp.max(groups, axis=-1), k)
  best = jnp.sort(best, axis=-1)  # column order: ties resolve to the lower index
  cand = jnp.take_along_axis(groups, best[..., None], axis=-2).reshape(lead + (k * group,))
  vals, pos = jax.lax.top_k(cand, k)
  ids = jnp.take_along_axis(best, pos // group, axis=-1) * group + pos % group
  return vals, ids.astype(jnp.int32)
