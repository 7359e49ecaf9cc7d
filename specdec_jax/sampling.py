"""Per-request sampling parameters and plain (non-speculative) token sampling.

Processing order for a random request (DESIGN.md):

    logits / temperature -> keep top_k largest -> renormalise
                         -> keep the smallest most-likely set with mass >= top_p
                         -> renormalise

Both filters are *threshold* filters: a token is kept iff its scaled logit is
>= a per-row threshold, so tokens tied with the last kept token are kept too.
Greedy requests (temperature below `GREEDY_TEMPERATURE`) use `argmax` of the raw
logits, first index on ties.

Everything here is pure `jax.numpy` and works under `jit`; a "row" is one request
and every function broadcasts the per-request parameters over any middle axes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Temperatures below this are greedy. Dividing by a smaller temperature would only
# sharpen the distribution towards the argmax anyway, and this keeps `x / T` finite.
GREEDY_TEMPERATURE = 1e-5


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Per-request sampling parameters, a pytree of three `[B]` arrays.

  Attributes:
    temperature: f32[B]; 0 means greedy.
    top_k: i32[B]; 0 (or >= vocabulary size) means off.
    top_p: f32[B]; 1.0 means off.

  Example:
    >>> params = SamplingParams.create([0.0, 0.7], top_k=[0, 50], top_p=0.9)
    >>> params.batch_size
    2
  """

  temperature: jax.Array  # [B]
  top_k: jax.Array  # [B]
  top_p: jax.Array  # [B]

  @classmethod
  def greedy(cls, batch_size: int) -> "SamplingParams":
    """All-greedy parameters for `batch_size` requests."""
    return cls.create(jnp.zeros((batch_size,), jnp.float32))

  @classmethod
  def create(cls, temperature, top_k=None, top_p=None) -> "SamplingParams":
    """Builds parameters from scalars or sequences, broadcast to one batch.

    Concrete values are validated; traced values (inside `jit`) are not.

    Args:
      temperature: scalar or [B]; >= 0, 0 means greedy.
      top_k: None, scalar or [B]; >= 0, 0 means off.
      top_p: None, scalar or [B]; in (0, 1], 1 means off.

    Returns:
      A `SamplingParams` with float32/int32 arrays of one shared batch size.

    Raises:
      ValueError: on negative temperature or top_k, top_p outside (0, 1], or
        sizes that do not broadcast to one batch.
    """
    temperature = jnp.asarray(temperature, jnp.float32)
    top_k = jnp.asarray(0 if top_k is None else top_k, jnp.int32)
    top_p = jnp.asarray(1.0 if top_p is None else top_p, jnp.float32)
    for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
      if value.ndim > 1:
        raise ValueError(f"SamplingParams.create: {name} must be a scalar or 1-D [B], got shape {value.shape}")
    try:
      shape = jnp.broadcast_shapes(temperature.shape, top_k.shape, top_p.shape)
    except ValueError as e:
      raise ValueError(
          "SamplingParams.create: temperature, top_k and top_p must broadcast to one batch size, got shapes "
          f"{temperature.shape}, {top_k.shape}, {top_p.shape}") from e
    if shape == ():
      shape = (1,)
    if _is_concrete(temperature) and bool(np.any(np.asarray(temperature) < 0)):
      raise ValueError(f"SamplingParams.create: temperature must be >= 0, got {np.asarray(temperature)}")
    if _is_concrete(top_k) and bool(np.any(np.asarray(top_k) < 0)):
      raise ValueError(f"SamplingParams.create: top_k must be >= 0 (0 = off), got {np.asarray(top_k)}")
    if _is_concrete(top_p):
      p = np.asarray(top_p)
      if bool(np.any(~((p > 0) & (p <= 1)))):
        raise ValueError(f"SamplingParams.create: top_p must be in (0, 1] (1 = off), got {p}")
    return cls(
        temperature=jnp.broadcast_to(temperature, shape),
        top_k=jnp.broadcast_to(top_k, shape),
        top_p=jnp.broadcast_to(top_p, shape),
    )

  @property
  def batch_size(self) -> int:
    return self.temperature.shape[0]

  @property
  def is_greedy(self) -> jax.Array:
    """bool[B]: rows sampled by argmax."""
    return self.temperature < GREEDY_TEMPERATURE


def check_params(params: SamplingParams, batch_size: int, where: str) -> None:
  """Raises ValueError unless `params` holds three [batch_size] arrays."""
  if not isinstance(params, SamplingParams):
    raise ValueError(f"{where}: params must be a SamplingParams, got {type(params).__name__}")
  for name in ("temperature", "top_k", "top_p"):
    shape = jnp.shape(getattr(params, name))
    if shape != (batch_size,):
      raise ValueError(f"{where}: params.{name} must have shape [B]=({batch_size},), got {shape}")


# ----------------------------------------------------------------------------
# Keys
# ----------------------------------------------------------------------------


def row_keys(key, batch_size: int, where: str = "key") -> jax.Array:
  """One typed PRNG key per row.

  A single key gives row b `fold_in(key, b)`; a batch of B keys gives row b
  exactly `key[b]`, so a row never depends on its neighbours. Raw `uint32[2]`
  keys (and batches `uint32[B, 2]`) are accepted.

  Args:
    key: typed key [] or [B], or raw uint32 [2] or [B, 2].
    batch_size: B.
    where: argument name used in error messages.

  Returns:
    A typed key array of shape [B].

  Example:
    >>> keys = row_keys(jax.random.key(0), 4)   # keys.shape == (4,)
  """
  key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    typed = key
  elif key.dtype == jnp.uint32 and key.ndim >= 1 and key.shape[-1] == 2:
    typed = jax.random.wrap_key_data(key)
  else:
    raise ValueError(
        f"{where} must be a typed PRNG key (jax.random.key) or a raw uint32[2] key, "
        f"or a batch of B of either; got dtype {key.dtype}, shape {key.shape}")
  if typed.ndim == 0:
    return jax.vmap(lambda b: jax.random.fold_in(typed, b))(jnp.arange(batch_size))
  if typed.shape == (batch_size,):
    return typed
  raise ValueError(f"{where}: expected one key or a batch of B={batch_size} keys, got key batch shape {typed.shape}")


# ----------------------------------------------------------------------------
# One-pass reductions over the vocabulary
# ----------------------------------------------------------------------------


def _lse_combine(m1, s1, m2, s2):
  """Merges two (max, sum of exp(x - max)) pairs with a single exponential.

  The larger max survives and only the other side's sum is rescaled. A side
  whose max is -inf carries no mass (and exp(-inf - -inf) would be NaN).
  """
  first = m1 >= m2
  hi, lo = jnp.where(first, m1, m2), jnp.where(first, m2, m1)
  s_hi, s_lo = jnp.where(first, s1, s2), jnp.where(first, s2, s1)
  return hi, s_hi + jnp.where(lo == -jnp.inf, 0.0, s_lo * jnp.exp(lo - hi))


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
    i = jnp.where(a[0] > b[0], a[2], jnp.where(b[0] > a[0], b[2], jnp.minimum(a[2], b[2])))
    return m, s, i

  operands, init = (x, jnp.ones_like(x)), (np.float32(-np.inf), np.float32(0))
  if with_argmax:
    operands += (jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1),)
    init += (np.int32(np.iinfo(np.int32).max),)
  return jax.lax.reduce(operands, init, combine, (x.ndim - 1,))


# ----------------------------------------------------------------------------
# Logit processing
# ----------------------------------------------------------------------------


def _bcast(row_values: jax.Array, x: jax.Array) -> jax.Array:
  """Reshapes per-row values [B] to broadcast against x [B, ..., V]."""
  return row_values.reshape(row_values.shape + (1,) * (x.ndim - 1))


def scale_logits(logits: jax.Array, temperature: jax.Array) -> jax.Array:
  """float32 logits / temperature, with greedy rows left at temperature 1.

  Args:
    logits: [B, ..., V], any float dtype.
    temperature: f32[B].

  Returns:
    f32[B, ..., V].
  """
  t = jnp.where(temperature < GREEDY_TEMPERATURE, 1.0, temperature).astype(jnp.float32)
  return logits.astype(jnp.float32) / _bcast(t, logits)


def filter_active(params: SamplingParams, vocab_size: int) -> jax.Array:
  """bool[B]: rows whose top-k or top-p actually removes tokens."""
  k_on = (params.top_k > 0) & (params.top_k < vocab_size)
  return (k_on | (params.top_p < 1.0)) & ~params.is_greedy


def sorted_threshold(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """Top-k/top-p threshold by a full descending sort of the vocabulary.

  The reference method: exact, but a sort of [B, ..., V] costs tens of passes
  over the logits. `top_k_top_p_threshold` uses it only as a fallback.

  Args:
    scaled: f32[B, ..., V] temperature-scaled logits.
    top_k: i32[B], 0 or >= V means off.
    top_p: f32[B], 1 means off.

  Returns:
    f32[B, ...] thresholds (-inf where nothing is filtered): keep iff x >= it.
  """
  return _sorted_threshold_and_lse(scaled, top_k, top_p)[0]


def _sorted_threshold_and_lse(scaled, top_k, top_p):
  xs = -jnp.sort(-scaled, axis=-1)
  thr, _, mass = _threshold_from_sorted(xs, top_k, top_p, scaled.shape[-1])
  return thr, xs[..., 0] + jnp.log(mass)


def _threshold_from_sorted(xs, top_k, top_p, v, total_mass=None, m=None):
  """Threshold from values sorted descending along the last axis.

  xs may hold only the largest candidates of each row; then `total_mass` (sum of
  exp(x - m) over the whole row) and `m` (the row max) must be given, and the
  caller checks for which rows the candidates sufficed (see
  `top_k_top_p_threshold`). With the full sorted row, both are computed here.

  Returns:
    (thr, kth, kept_mass), each f32[B, ...]: the threshold (-inf when nothing is
    filtered), the top-k value (-inf when top-k is off) and the mass of the
    kept set, sum of exp(x - m) over x >= thr.
  """
  c = xs.shape[-1]
  m = xs[..., 0] if m is None else m
  k_on = _bcast((top_k > 0) & (top_k < v), xs[..., 0])
  p_on = _bcast(top_p < 1.0, xs[..., 0])
  k = _bcast(jnp.clip(top_k, 1, c), xs[..., 0])
  kth = jnp.where(k_on, jnp.take_along_axis(xs, (k - 1)[..., None], axis=-1)[..., 0], -jnp.inf)
  e = jnp.exp(xs - m[..., None])
  kept_k = xs >= kth[..., None]
  cum = jnp.cumsum(jnp.where(kept_k, e, 0.0), axis=-1)
  row_mass = cum[..., -1] if total_mass is None else total_mass  # all tokens (top-k off)
  # Mass of the top-k set: from the candidates when top-k is on (all kept tokens
  # are among them), else the whole row's mass.
  z = jnp.where(k_on, cum[..., -1], row_mass)
  p = _bcast(top_p, kth)
  # First sorted position whose cumulative mass reaches top_p, clipped into the
  # kept set (rounding can leave the total a hair under top_p).
  first = jnp.sum(cum < (p * z)[..., None], axis=-1)
  first = jnp.minimum(first, jnp.sum(kept_k, axis=-1) - 1)
  pth = jnp.take_along_axis(xs, first[..., None], axis=-1)[..., 0]
  thr = jnp.where(p_on, jnp.maximum(kth, pth), kth)
  kept_mass = jnp.where(k_on | p_on, jnp.sum(jnp.where(xs >= thr[..., None], e, 0.0), axis=-1), row_mass)
  return thr, kth, kept_mass


# The sort-free threshold search keeps the _PER_GROUP largest values of each
# group of tokens; about _NUM_GROUPS groups per row make it rare that a row's
# kept set puts more than _PER_GROUP tokens into one group (odds about
# C(k, 4) / G^3 for top-k: 2e-4 at k=50). Up to _MAX_SORTED_ROWS rows that
# still fail are sorted individually.
_PER_GROUP = 4
_NUM_GROUPS = 1024
_MAX_SORTED_ROWS = 64


def _group_size(v: int) -> int:
  """About V / 1024 tokens a group, in [16, 128]; a divisor of V if one is near
  (a padded copy of the logits would cost a write and a read)."""
  want = int(np.clip(v // _NUM_GROUPS, 16, 128))
  divisors = [g for g in range(16, 129) if v % g == 0 and want / 2 <= g <= 2 * want]
  return min(divisors, key=lambda g: abs(g - want)) if divisors else want


def _merge_top(a, b):
  """Largest len(a) of two descending lists (tuples of arrays), multiset-wise.

  The i-th largest of the union is max_j min(a_j, b_{i-j}) with a_0 = b_0 = +inf.
  """
  n = len(a)
  inf = jnp.full_like(a[0], jnp.inf)
  aa, bb = (inf,) + tuple(a), (inf,) + tuple(b)
  out = []
  for i in range(1, n + 1):
    best = jnp.minimum(aa[0], bb[i])
    for j in range(1, i + 1):
      best = jnp.maximum(best, jnp.minimum(aa[j], bb[i - j]))
    out.append(best)
  return tuple(out)


def group_top(x: jax.Array, group_size: int | None = None, per_group: int = _PER_GROUP, *,
              with_sumexp: bool = False):
  """The `per_group` largest values of every `group_size` block of the last axis.

  One fused variadic reduction (a single read of x): each element enters as the
  list (x, -inf, ..., -inf) and lists are merged by `_merge_top`.

  Args:
    x: f32[..., V].
    group_size: tokens per group (default: about V / 1024, in [16, 128]).
    per_group: values kept per group.
    with_sumexp: also return each group's sum of exp(x - group max), from the
      same pass (the whole row's mass then needs no second read).

  Returns:
    f32[..., ceil(V / group_size), per_group], descending within each group;
    with `with_sumexp`, a pair (that, f32[..., G] sums).

  Example:
    >>> tops = group_top(jnp.arange(64.0)[None], group_size=16, per_group=2)  # [[[15, 14], [31, 30], ...]]
  """
  v = x.shape[-1]
  group_size = _group_size(v) if group_size is None else group_size
  g = -(-v // group_size)
  xg = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, g * group_size - v)], constant_values=-jnp.inf)
  xg = xg.reshape(x.shape[:-1] + (g, group_size))
  fill = jnp.full_like(xg, -jnp.inf)
  operands = (xg,) + (fill,) * (per_group - 1)
  init = tuple(np.float32(-np.inf) for _ in range(per_group))
  if with_sumexp:
    operands, init = operands + (jnp.ones_like(xg),), init + (np.float32(0),)

  def combine(a, b):
    top = _merge_top(a[:per_group], b[:per_group])
    if not with_sumexp:
      return top
    return top + (_lse_combine(a[0], a[-1], b[0], b[-1])[1],)

  out = jax.lax.reduce(operands, init, combine, (xg.ndim - 1,))
  tops = jnp.stack(out[:per_group], axis=-1)
  return (tops, out[-1]) if with_sumexp else tops


def top_k_top_p_threshold(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array,
                          *, group_size: int | None = None) -> jax.Array:
  """Per-row-and-position threshold on scaled logits: keep iff x >= threshold.

  The top-k threshold is the k-th largest value; the top-p threshold is the value
  of the first token, in descending order, at which the cumulative mass (within
  the top-k set) reaches top_p. Tokens tied with a threshold are kept.

  Sort-free over the vocabulary: one pass keeps the 4 largest values of every
  group of tokens (about 1024 groups) and each group's mass, and only those
  candidates are sorted. Any token outside the candidates is <= its group's 4th
  largest, so a row's answer is exact whenever its threshold exceeds every
  group's 4th largest value (for language-model logits: top-k up to about 100,
  and top-p sets of similar size). Rows where that fails (e.g. top-p over a
  flat distribution) are sorted individually, up to 64 of them; beyond that a
  `lax.switch` sorts the whole batch. The result is always exact.

  Args:
    scaled: f32[B, ..., V] temperature-scaled logits.
    top_k: i32[B], 0 or >= V means off.
    top_p: f32[B], 1 means off.
    group_size: static group size of the candidate search (default: about V/1024).

  Returns:
    f32[B, ...] thresholds (-inf where nothing is filtered).

  Example:
    >>> thr = top_k_top_p_threshold(x, jnp.array([50]), jnp.array([0.9]))  # x: [1, V]
  """
  return threshold_and_lse(scaled, None, top_k, top_p, group_size=group_size)[0]


def threshold_and_lse(logits: jax.Array, temperature: jax.Array | None, top_k: jax.Array, top_p: jax.Array,
                      *, group_size: int | None = None):
  """Top-k/top-p threshold and the log-normaliser of the kept set, sort-free.

  Like `top_k_top_p_threshold`, but on raw logits with the temperature applied
  inside every consumer (so a lazily scaled copy is never written to memory,
  not even as a branch operand), and it also returns
  lse = logsumexp(x over x >= thr), read off the candidates: the log-probability
  of a kept token is then x - lse, with no further pass over the vocabulary.

  Args:
    logits: [B, ..., V], any float dtype (already scaled if temperature is None).
    temperature: f32[B] or None.
    top_k: i32[B], 0 or >= V means off.
    top_p: f32[B], 1 means off.
    group_size: static group size of the candidate search (default: about V/1024).

  Returns:
    (thr, lse), each f32[B, ...].

  Example:
    >>> thr, lse = threshold_and_lse(logits, params.temperature, params.top_k, params.top_p)
  """
  scale = (lambda x: x.astype(jnp.float32)) if temperature is None else (lambda x: scale_logits(x, temperature))
  v = logits.shape[-1]
  group_size = _group_size(v) if group_size is None else group_size
  if v <= 2 * group_size * _PER_GROUP:  # small vocabularies: a sort is cheap
    return _sorted_threshold_and_lse(scale(logits), top_k, top_p)
  tops, group_mass = group_top(scale(logits), group_size, with_sumexp=True)  # [..., G, 4], [..., G]
  cand = -jnp.sort(-tops.reshape(tops.shape[:-2] + (-1,)), axis=-1)  # [..., 4G]
  floor = jnp.max(tops[..., -1], axis=-1)  # tokens outside the candidates are <= this
  m = cand[..., 0]
  total = jnp.sum(jnp.where(group_mass > 0, group_mass * jnp.exp(tops[..., 0] - m[..., None]), 0.0), axis=-1)
  thr, kth, kept_mass = _threshold_from_sorted(cand, top_k, top_p, v, total, m)
  k_on = _bcast((top_k > 0) & (top_k < v), thr)
  p_on = _bcast(top_p < 1.0, thr)
  exact = jnp.where(k_on, (_bcast(top_k, thr) <= cand.shape[-1]) & (kth > floor),
                    jnp.where(p_on, thr > floor, True))
  lse = m + jnp.log(kept_mass)

  # Rows whose candidates did not suffice: sort just those (a fixed number of
  # them, so shapes stay static), or the whole batch if there are too many.
  # Branches take the raw logits (an operand, not a closure over a scaled copy).
  rows = thr.size
  row_batch = jnp.broadcast_to(jnp.arange(logits.shape[0]).reshape((-1,) + (1,) * (thr.ndim - 1)), thr.shape)
  n_fix = min(_MAX_SORTED_ROWS, rows)
  bad = jnp.nonzero(~exact.reshape(-1), size=n_fix, fill_value=rows)[0]  # [n_fix], `rows` = unused slot
  safe = jnp.minimum(bad, rows - 1)

  def fix_rows(thr, lse, raw):
    b_of = row_batch.reshape(-1)[safe]
    sub = raw.reshape(-1, v)[safe].astype(jnp.float32)
    if temperature is not None:
      sub = scale_logits(sub, temperature[b_of])
    fixed_thr, fixed_lse = _sorted_threshold_and_lse(sub, top_k[b_of], top_p[b_of])
    put = lambda a, new: a.reshape(-1).at[bad].set(new, mode="drop").reshape(a.shape)
    return put(thr, fixed_thr), put(lse, fixed_lse)

  num_bad = jnp.sum(~exact)
  return jax.lax.switch(
      jnp.where(num_bad == 0, 0, jnp.where(num_bad <= n_fix, 1, 2)),
      [lambda thr, lse, raw: (thr, lse), fix_rows,
       lambda thr, lse, raw: _sorted_threshold_and_lse(scale(raw), top_k, top_p)],
      thr, lse, logits)


def process_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """Log-probabilities after temperature, top-k and top-p (every row as random).

  Greedy rows are processed at temperature 1; callers pick argmax for them.

  Args:
    logits: [B, ..., V], any float dtype.
    params: SamplingParams of batch B.

  Returns:
    f32[B, ..., V] normalised log-probabilities, -inf for removed tokens.

  Example:
    >>> logp = process_logits(jnp.zeros((2, 5)), SamplingParams.create(1.0, top_k=2))
  """
  t = params.temperature

  def unfiltered(raw):
    m, s = max_and_sumexp(scale_logits(raw, t))
    return jnp.full(raw.shape[:-1], -jnp.inf, jnp.float32), m + jnp.log(s)

  # The threshold search is the costliest step: skip it at run time when no row
  # filters anything. (The raw logits go into the cond, so scaling stays fusible.)
  thr, lse = jax.lax.cond(jnp.any(filter_active(params, logits.shape[-1])),
                          lambda raw: threshold_and_lse(raw, t, params.top_k, params.top_p),
                          unfiltered, logits)
  scaled = scale_logits(logits, t)
  return jnp.where(scaled >= thr[..., None], scaled - lse[..., None], -jnp.inf)


# ----------------------------------------------------------------------------
# Drawing one token from unnormalised weights
# ----------------------------------------------------------------------------


def chunk_size(v: int) -> int:
  """Tokens per chunk when a pass over the vocabulary is split into chunks.

  Real vocabularies (V >= 8192) get a divisor of V near 1024 (512 to 8192) that
  is a multiple of 4 (so loads can be vectorised). Measured on an H100 (bench/
  RESULTS.md), one pass of (max, sum of exps, argmax) over [1024, 5, 151936]
  took 1.04x the memory floor in chunks of 4748 tokens, 1.21x over whole rows,
  and about 1.5x in chunks of 128 or of 1187 (a prime) tokens; over V=32000,
  chunks of 1000 took 1.23x and whole rows 1.36x. The few dozen chunk totals and
  one chunk's tokens are then cheap to sample from. Otherwise a size near
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


def categorical_from_log_weights(key: jax.Array, log_w: jax.Array) -> jax.Array:
  """Draws one index per row with probability proportional to exp(log_w).

  Exact two-stage Gumbel-max: pick a chunk of the vocabulary (`chunk_size`) by
  its total weight, then a token inside it. It draws a few hundred to a few
  thousand Gumbels per row instead of V, reads log_w once for the chunk masses,
  and needs no normalised distribution.

  Args:
    key: typed keys [B] (one per row).
    log_w: f32[B, V] unnormalised log-weights; -inf = impossible. A row must
      have at least one finite entry.

  Returns:
    int32[B] indices in [0, V).

  Example:
    >>> tok = categorical_from_log_weights(row_keys(jax.random.key(0), 2), jnp.log(jnp.array([[1., 3.], [1., 0.]])))
  """
  return categorical_with_empty(key, log_w)[0]


def categorical_with_empty(key: jax.Array, log_w: jax.Array):
  """`categorical_from_log_weights`, plus bool[B]: rows with no finite weight.

  An empty row's index is meaningless; the flag comes from the chunk masses
  the draw computes anyway, so checking costs no extra pass over log_w.

  Args:
    key: typed keys [B] (one per row).
    log_w: f32[B, V] unnormalised log-weights; -inf = impossible.

  Returns:
    (int32[B] indices in [0, V), bool[B] empty-row flags).

  Example:
    >>> tok, empty = categorical_with_empty(row_keys(jax.random.key(0), 1), jnp.full((1, 4), -jnp.inf))
    >>> empty   # [True]: redraw that row from another distribution
  """
  b, v = log_w.shape
  c = chunk_size(v)
  n = -(-v // c)
  if n * c != v:
    log_w = jnp.pad(log_w, ((0, 0), (0, n * c - v)), constant_values=-jnp.inf)
  chunks = log_w.reshape(b, n, c)
  m, s = max_and_sumexp(chunks)
  chunk_logw = jnp.where(s > 0, m + jnp.log(s), -jnp.inf)  # [B, n]
  tok = draw_from_chunks(key, chunk_logw, lambda ch: jnp.take_along_axis(chunks, ch[:, None, None], axis=1)[:, 0])
  return tok, jnp.all(chunk_logw == -jnp.inf, axis=-1)


def draw_from_chunks(key: jax.Array, chunk_log_mass: jax.Array, chunk_log_weights) -> jax.Array:
  """Two-stage Gumbel-max: a chunk by its mass, then a token inside that chunk.

  Exact when `chunk_log_mass` holds each chunk's total weight; only the chosen
  chunk's weights are ever built, so a caller that knows the chunk masses
  already (from an earlier pass) reads just c tokens per row.

  Args:
    key: typed keys [B] (one per row).
    chunk_log_mass: f32[B, n] log of each chunk's total weight.
    chunk_log_weights: function from the chosen chunks int32[B] to their
      unnormalised log-weights f32[B, c] (chunk j covers tokens j*c .. j*c+c-1).

  Returns:
    int32[B] token indices, chunk * c + position inside it.

  Example:
    >>> w = jnp.log(jnp.array([[1., 3., 0., 4.]]))            # V=4 in 2 chunks of 2
    >>> draw_from_chunks(row_keys(jax.random.key(0), 1), jnp.log(jnp.array([[4., 4.]])),
    ...                  lambda ch: w.reshape(1, 2, 2)[0, ch])  # 0, 1, 3 w.p. 1/8, 3/8, 1/2
  """
  n = chunk_log_mass.shape[-1]
  k_chunk, k_tok = jax.vmap(lambda k: tuple(jax.random.split(k)), out_axes=(0, 0))(key)
  g_chunk = jax.vmap(lambda k: jax.random.gumbel(k, (n,)))(k_chunk)
  chunk = jnp.argmax(chunk_log_mass + g_chunk, axis=-1)
  inside = chunk_log_weights(chunk)
  g_tok = jax.vmap(lambda k: jax.random.gumbel(k, (inside.shape[-1],)))(k_tok)
  return (chunk * inside.shape[-1] + jnp.argmax(inside + g_tok, axis=-1)).astype(jnp.int32)


def sample_tokens(logits: jax.Array, params: SamplingParams, key, *, all_greedy: bool = False):
  """Plain sampling of one token per row, plus the distribution it came from.

  Greedy rows take `argmax(logits)` (first index on ties); random rows draw from
  the processed (temperature, top-k, top-p) distribution.

  Args:
    logits: [B, V], any float dtype.
    params: SamplingParams of batch B.
    key: one PRNG key or a batch of B keys (see `row_keys`).
    all_greedy: static promise that every row is greedy: argmax only, no
      softmax and no random numbers for the token (log_probs is one-hot).

  Returns:
    (tokens int32[B], log_probs f32[B, V]): log_probs is the log of the
    distribution each row's token was drawn from (log one-hot for greedy rows).

  Example:
    >>> tok, logp = sample_tokens(logits, SamplingParams.create([0.0, 1.0]), jax.random.key(0))
  """
  if logits.ndim != 2:
    raise ValueError(f"sample_tokens: logits must be [B, V], got shape {logits.shape}")
  b, v = logits.shape
  check_params(params, b, "sample_tokens")
  greedy_tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  one_hot = jnp.where(jax.nn.one_hot(greedy_tok, v, dtype=jnp.bool_), 0.0, -jnp.inf)
  if all_greedy:
    return greedy_tok, one_hot
  keys = row_keys(key, b)
  logp = process_logits(logits, params)
  tok = categorical_from_log_weights(keys, logp)
  greedy = params.is_greedy
  return jnp.where(greedy, greedy_tok, tok), jnp.where(greedy[:, None], one_hot, logp)
