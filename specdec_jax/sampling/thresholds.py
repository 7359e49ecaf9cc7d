"""The top-k / top-p / min-p threshold search, sort-free, and the overflow-safe redo of rows.

Every filter is a threshold on the scaled logits (keep x >= thr); these
functions find thr and the log-normaliser of the kept set from one pass over
the logits plus a sort of a few thousand candidates.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.sampling.params import SamplingParams
from specdec_jax.sampling.reductions import LogitsView, _bcast, _lse_combine, scale_logits, values
from specdec_jax.sampling.vocab_parallel import any_rows


class ShiftedStats(NamedTuple):
  """A processed distribution as three numbers per position: keep x >= thr, log p = x - lse, x scaled after a shift."""

  shift: jax.Array  # f32 [B, ...]: subtracted before dividing by the temperature (0 except on redone rows)
  thr: jax.Array  # f32 [B, ...]: keep iff scale_logits(logits, T, shift) >= thr
  lse: jax.Array  # f32 [B, ...]: log-normaliser of the kept set (-inf: no logit above -inf)


def shift_non_finite_rows(
  logits: jax.Array,
  temperature: jax.Array,
  top_k: jax.Array,
  top_p: jax.Array,
  thr: jax.Array,
  lse: jax.Array,
  *,
  min_p: jax.Array | None = None,
  shards=None,
) -> ShiftedStats:
  """Redoes (thr, lse) of the rows whose log-normaliser `lse` is not finite.

  The one-pass reductions compute `logits / T`, which overflows for a small
  temperature or logits near the float32 limit (or meets a +inf logit, or finds
  no finite logit at all); then lse is +-inf or NaN. For those rows only, this
  subtracts the row's max before dividing (`scale_logits` with a shift): every
  value is then <= 0, and an overflow can only give -inf, i.e. a probability
  that rounds to 0 anyway. It sorts the batch, an extra pass or two, run only
  under a `lax.cond` when some row needs it; other rows keep shift 0, so their
  values are those of the one pass.

  Args:
    logits: [B, ..., V], any float dtype (raw).
    temperature, top_k, top_p: [B] sampling parameters.
    thr, lse: f32[B, ...] from the one-pass search (`threshold_and_lse` or
      `max_and_sumexp`).
    min_p: f32[B] or None (off), as given to `threshold_and_lse`.
    shards: a `vocab_parallel.VocabShards` (logits: this device's slice), or
      None. Split, the redone rows are searched by bisection
      (`_bisect_threshold_and_lse`) instead of sorted: the same thresholds,
      normalisers equal to rounding.

  Returns:
    ShiftedStats(shift, thr, lse), each f32[B, ...]: scale with `scale_logits(logits,
    temperature, shift)`; lse is -inf exactly for rows with no logit above -inf
    (no NaN anywhere).

  Example:
    >>> shift, thr, lse = shift_non_finite_rows(logits, t, k, p, *threshold_and_lse(logits, t, k, p))
  """
  redo = ~jnp.isfinite(lse)

  def fix(raw):
    x = values(raw).astype(jnp.float32)
    m = jnp.max(jnp.where(jnp.isnan(x), -jnp.inf, x), axis=-1)  # only here: a second read of the logits
    if shards is not None:
      m = shards.max(m)
    empty = redo & (m == -jnp.inf)
    shift = jnp.where(redo & ~empty, m, 0.0)
    scaled = scale_logits(raw, temperature, shift)
    if shards is None:
      new_thr, new_lse = _sorted_threshold_and_lse(scaled, top_k, top_p, min_p=min_p)
    else:
      new_thr, new_lse = _bisect_batch(scaled, top_k, top_p, min_p, shards)
    return ShiftedStats(shift, jnp.where(redo, new_thr, thr), jnp.where(empty, -jnp.inf, jnp.where(redo, new_lse, lse)))

  return jax.lax.cond(any_rows(redo, shards), fix, lambda raw: ShiftedStats(jnp.zeros_like(lse), thr, lse), logits)


def top_k_on(top_k, vocab_size: int):
  """bool, top_k's shape: the top-k values that may remove tokens (0, and any k >= V, keep every token).

  Example:
    >>> top_k_on(jnp.array([0, 5, 100]), 100)   # [False, True, False]
  """
  return (top_k > 0) & (top_k < vocab_size)


def top_k_or_top_p_on(top_k, top_p, vocab_size: int):
  """bool: top-k or top-p may remove tokens (`filter_active`'s rule before min-p and greedy rows).

  Example:
    >>> top_k_or_top_p_on(jnp.array([0, 0]), jnp.array([1.0, 0.9]), 100)   # [False, True]
  """
  return top_k_on(top_k, vocab_size) | (top_p < 1.0)


def filter_active(params: SamplingParams, vocab_size: int, *, greedy: jax.Array | None = None) -> jax.Array:
  """bool[B]: the rows whose top-k, top-p or min-p may remove tokens (the one "filters active" predicate).

  Greedy rows never filter: they take the argmax.

  Args:
    params: SamplingParams of batch B.
    vocab_size: V (top_k >= V is off).
    greedy: bool[B], the rows that count as greedy; None reads
      `params.is_greedy`. (Under `all_random=True` a sampler passes all False:
      a temperature-0 row is then random, and its filters count.)

  Example:
    >>> filter_active(SamplingParams.create([1.0, 1.0, 0.0], top_k=[0, 5, 5], min_p=[0.1, 0.0, 0.0]), 100)
    ... # [True, True, False]
  """
  if params.no_filters:  # the static promise: nothing filters, whatever the fields hold
    return jnp.zeros(params.temperature.shape, jnp.bool_)
  on = top_k_or_top_p_on(params.top_k, params.top_p, vocab_size)
  if params.min_p is not None:
    on = on | (params.min_p > 0)
  return on & ~(params.is_greedy if greedy is None else greedy)


def sorted_threshold(
  scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, *, min_p: jax.Array | None = None
) -> jax.Array:
  """Top-k/top-p(/min-p) threshold by a full descending sort of the vocabulary.

  The reference method: exact, but a sort of [B, ..., V] costs tens of passes
  over the logits. `top_k_top_p_threshold` uses it only as a fallback.

  Args:
    scaled: f32[B, ..., V] temperature-scaled logits.
    top_k: i32[B], 0 or >= V means off.
    top_p: f32[B], 1 means off.
    min_p: f32[B] or None; 0 (or None) means off.

  Returns:
    f32[B, ...] thresholds (-inf where nothing is filtered): keep iff x >= it.

  Example:
    >>> sorted_threshold(jnp.log(jnp.array([[0.5, 0.3, 0.2]])), jnp.array([0]), jnp.array([0.7]))   # [log 0.3]
  """
  return _sorted_threshold_and_lse(scaled, top_k, top_p, min_p=min_p)[0]


def _sorted_threshold_and_lse(scaled, top_k, top_p, *, min_p=None):
  xs = -jnp.sort(-scaled, axis=-1)
  thr, _, mass = _threshold_from_sorted(xs, top_k, top_p, scaled.shape[-1], min_p=min_p)
  return thr, xs[..., 0] + jnp.log(mass)


class _SortedCut(NamedTuple):
  thr: jax.Array  # the threshold (top-k, top-p and min-p combined)
  kth: jax.Array  # the k-th largest value (top-k's own cut)
  kept_mass: jax.Array  # the kept set's mass, in units of exp(x - max)


def _threshold_from_sorted(xs, top_k, top_p, v, total_mass=None, m=None, *, min_p=None):
  """Threshold from values sorted descending along the last axis.

  xs may hold only the largest candidates of each row; then `total_mass` (sum of
  exp(x - m) over the whole row) and `m` (the row max) must be given, and the
  caller checks for which rows the candidates sufficed (see
  `top_k_top_p_threshold`). With the full sorted row, both are computed here.
  min_p (f32[B] or None) raises the threshold to m + log(min_p) where it is > 0.

  Returns:
    (thr, kth, kept_mass), each f32[B, ...]: the threshold (-inf when nothing is
    filtered), the top-k value (-inf when top-k is off) and the mass of the
    kept set, sum of exp(x - m) over x >= thr.
  """
  c = xs.shape[-1]
  m = xs[..., 0] if m is None else m
  k_on = _bcast(top_k_on(top_k, v), xs[..., 0])
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
  on = k_on | p_on
  if min_p is not None:
    # Top-k and top-p keep the max and renormalising keeps probability ratios, so
    # "p >= min_p * p_max" is x >= m + log(min_p) whatever they removed.
    mp_on = _bcast(min_p > 0, thr)
    mth = jnp.where(mp_on, m + jnp.log(jnp.where(mp_on, _bcast(min_p, thr), 1.0)), -jnp.inf)
    thr = jnp.maximum(thr, mth)
    on = on | mp_on
  kept_mass = jnp.where(on, jnp.sum(jnp.where(xs >= thr[..., None], e, 0.0), axis=-1), row_mass)
  return _SortedCut(thr, kth, kept_mass)


# The sort-free threshold search keeps the _PER_GROUP largest values of each
# group of tokens; about _NUM_GROUPS groups per row make it rare that a row's
# kept set puts more than _PER_GROUP tokens into one group (odds about
# C(k, 4) / G^3 for top-k: 2e-4 at k=50). Up to _MAX_SORTED_ROWS rows that
# still fail are sorted individually.
_PER_GROUP = 4
_NUM_GROUPS = 1024
_MAX_SORTED_ROWS = 64
# The candidates then shrink once more: the _NARROW_PER_GROUP largest of every
# _NARROW_GROUP candidates (0 turns this stage off; bench/threshold_variants.py).
_NARROW_GROUP = 128
_NARROW_PER_GROUP = 8


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


def group_top(x: jax.Array, group_size: int | None = None, per_group: int = _PER_GROUP, *, with_sumexp: bool = False):
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


def top_k_top_p_threshold(
  scaled: jax.Array,
  top_k: jax.Array,
  top_p: jax.Array,
  *,
  group_size: int | None = None,
  min_p: jax.Array | None = None,
) -> jax.Array:
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
    min_p: f32[B] or None; also keep only x >= max + log(min_p) (0 or None: off).

  Returns:
    f32[B, ...] thresholds (-inf where nothing is filtered).

  Example:
    >>> thr = top_k_top_p_threshold(x, jnp.array([50]), jnp.array([0.9]))  # x: [1, V]
  """
  return threshold_and_lse(scaled, None, top_k, top_p, group_size=group_size, min_p=min_p)[0]


class _CandidateSearch(NamedTuple):
  thr: jax.Array
  lse: jax.Array
  exact: jax.Array  # bool: the candidates vouch for the answer (else the row is redone)


def _threshold_from_candidates(flat, floor, *, top_k, top_p, v, total, m, min_p):
  """(thr, lse, exact) from unsorted candidates [..., C]: every token outside them is <= floor.

  `exact` is False for the rows whose answer the candidates cannot vouch for.
  """
  cand = -jnp.sort(-flat, axis=-1)
  thr, kth, kept_mass = _threshold_from_sorted(cand, top_k, top_p, v, total, m, min_p=min_p)
  k_on = _bcast(top_k_on(top_k, v), thr)
  p_on = _bcast(top_p < 1.0, thr)
  kth_exact = (_bcast(top_k, thr) <= cand.shape[-1]) & (kth > floor)
  if min_p is None:
    exact = jnp.where(k_on, kth_exact, jnp.where(p_on, thr > floor, True))
  else:
    # A candidate top-k (top-p) value <= floor means the true one is <= floor too,
    # so a final threshold above the floor is the true one; but top-p's cut
    # depends on the top-k set's mass, which needs an exact top-k value.
    mp_on = _bcast(min_p > 0, thr)
    exact = jnp.where(k_on | p_on | mp_on, (thr > floor) & (kth_exact | ~(k_on & p_on)), True)
  return _CandidateSearch(thr, m + jnp.log(kept_mass), exact)


def _redo_rows(ok, results, operand, redo_some, redo_all, shards=None):
  """Recomputes `results` (arrays [B, ...]) where `ok` [B, ...] is False, from `operand` [B, ..., C].

  Up to _MAX_SORTED_ROWS failing rows are redone one by one: `redo_some(idx,
  operand)` gets their flat indices [n] (unused slots repeat the last row) and
  returns their new values, each [n]. More failing rows redo the whole batch
  with `redo_all(operand)`.
  All under a `lax.switch`, so a batch where every row is fine pays nothing.
  Under `shards` the branch follows the whole batch's count, so every device
  takes the same one (its own rows are then at most as many).
  """
  rows = ok.size
  n_fix = min(_MAX_SORTED_ROWS, rows)
  bad = jnp.nonzero(~ok.reshape(-1), size=n_fix, fill_value=rows)[0]  # [n_fix], `rows` = unused slot
  safe = jnp.minimum(bad, rows - 1)

  def some(res, op):
    new = redo_some(safe, op)
    return tuple(a.reshape(-1).at[bad].set(n, mode="drop").reshape(a.shape) for a, n in zip(res, new))

  num_bad = jnp.sum(~ok)
  if shards is not None and shards.row_axes:
    num_bad = jax.lax.psum(num_bad, shards.row_axes)
  return jax.lax.switch(
    jnp.where(num_bad == 0, 0, jnp.where(num_bad <= n_fix, 1, 2)),
    [lambda res, op: res, some, lambda res, op: tuple(redo_all(op))],
    results,
    operand,
  )


def _row_index(logits, m):
  """The function from a flat (row, position) index of m [B, ...] to its batch row."""
  rows = jnp.broadcast_to(jnp.arange(logits.shape[0]).reshape((-1,) + (1,) * (m.ndim - 1)), m.shape).reshape(-1)
  return lambda idx: rows[idx]


def _rows_from_candidates(idx, cand, floor, *, row_of, top_k, top_p, v, total, m, min_p, narrow=None):
  """`_threshold_from_candidates` of the flat rows idx of cand [B, ..., C].

  `narrow`: None, or (candidates [n, C], floor [n]) -> fewer candidates and their floor, applied to the rows
  (under a split vocabulary it also gathers them across the devices)."""
  r = row_of(idx)
  sub, sub_floor = cand.reshape(-1, cand.shape[-1])[idx], floor.reshape(-1)[idx]
  if narrow is not None:
    sub, sub_floor = narrow(sub, sub_floor)
  return _threshold_from_candidates(
    sub,
    sub_floor,
    top_k=top_k[r],
    top_p=top_p[r],
    v=v,
    total=total.reshape(-1)[idx],
    m=m.reshape(-1)[idx],
    min_p=None if min_p is None else min_p[r],
  )


def _scaled(raw, temperature):
  """f32 logits of raw (a view applied), divided by the temperature unless it is None (already scaled)."""
  return values(raw).astype(jnp.float32) if temperature is None else scale_logits(raw, temperature)


def _scaled_rows(raw, idx, temperature, row_of):
  """The flat rows idx of the logits raw [B, ..., V] (a view applied), f32, scaled by their temperature."""
  sub = values(raw).reshape(-1, raw.shape[-1])[idx].astype(jnp.float32)
  return sub if temperature is None else scale_logits(sub, temperature[row_of(idx)])


def threshold_and_lse(
  logits: jax.Array,
  temperature: jax.Array | None,
  top_k: jax.Array,
  top_p: jax.Array,
  *,
  group_size: int | None = None,
  min_p: jax.Array | None = None,
  shards=None,
):
  """Top-k/top-p(/min-p) threshold and the log-normaliser of the kept set, sort-free.

  Like `top_k_top_p_threshold`, but on raw logits with the temperature applied
  inside every consumer (so a lazily scaled copy is never written to memory,
  not even as a branch operand), and it also returns
  lse = logsumexp(x over x >= thr), read off the candidates: the log-probability
  of a kept token is then x - lse, with no further pass over the vocabulary.

  With min_p, the threshold is max(top-k/top-p threshold, max + log(min_p)) and
  lse that of the final kept set. A row is exact from the candidates when that
  final threshold exceeds every group's 4th largest value (and, when top-k and
  top-p are both on, the top-k value does too, as top-p's mass is that of the
  top-k set); other rows are sorted, as without min_p.

  Args:
    logits: [B, ..., V], any float dtype (already scaled if temperature is None).
    temperature: f32[B] or None.
    top_k: i32[B], 0 or >= V means off.
    top_p: f32[B], 1 means off.
    group_size: static group size of the candidate search (default: about V/1024).
    min_p: f32[B] in [0, 1] or None; 0 or None means off (None compiles exactly
      the program without min-p).
    shards: a `vocab_parallel.VocabShards` (logits: this device's slice), or
      None; see `_sharded_threshold_and_lse`.

  Returns:
    (thr, lse), each f32[B, ...].

  Example:
    >>> thr, lse = threshold_and_lse(logits, params.temperature, params.top_k, params.top_p)
  """
  if shards is not None:
    return _sharded_threshold_and_lse(logits, temperature, top_k, top_p, min_p, shards)
  scale = functools.partial(_scaled, temperature=temperature)
  v = logits.shape[-1]
  group_size = _group_size(v) if group_size is None else group_size
  if v <= 2 * group_size * _PER_GROUP:  # small vocabularies: a sort is cheap
    return _sorted_threshold_and_lse(scale(logits), top_k, top_p, min_p=min_p)
  tops, group_mass = group_top(scale(logits), group_size, with_sumexp=True)  # [..., G, 4], [..., G]
  flat = tops.reshape(tops.shape[:-2] + (-1,))  # [..., 4G]
  floor = jnp.max(tops[..., -1], axis=-1)  # tokens outside the candidates are <= this
  m = jnp.max(tops[..., 0], axis=-1)
  row_of = _row_index(logits, m)
  # The row's whole mass (top-p without top-k, unfiltered rows) from the group masses
  # of the same pass. (A separate (max, sum of exps) pass run only when some row
  # needs it measured faster alone but not inside the sampler; bench/RESULTS.md.)
  total = jnp.sum(jnp.where(group_mass > 0, group_mass * jnp.exp(tops[..., 0] - m[..., None]), 0.0), axis=-1)
  from_candidates = functools.partial(
    _threshold_from_candidates, top_k=top_k, top_p=top_p, v=v, total=total, m=m, min_p=min_p
  )
  if _NARROW_GROUP and flat.shape[-1] > 2 * _NARROW_GROUP:
    # Fewer candidates to sort first: only the 8 largest of every 128 (32 groups'
    # top-4s) can be kept when the threshold clears the 8th largest of each such
    # block (the exactness check sees that through the raised floor). Batches where
    # some row needs more (top-k in the hundreds, wide top-p) redo the search on all
    # 4G candidates, with no new read of the logits (the narrower sort is the faster search;
    # figures: bench/RESULTS.md).
    tops2 = group_top(flat, _NARROW_GROUP, _NARROW_PER_GROUP)  # [..., 4G/128, 8]
    narrow_floor = jnp.maximum(floor, jnp.max(tops2[..., -1], axis=-1))
    thr, lse, exact = from_candidates(tops2.reshape(tops2.shape[:-2] + (-1,)), narrow_floor)

    rows_from_all_candidates = functools.partial(
      _rows_from_candidates, floor=floor, row_of=row_of, top_k=top_k, top_p=top_p, v=v, total=total, m=m, min_p=min_p
    )
    # Rows the narrowed candidates cannot vouch for: from all 4G candidates (no new read of the logits).
    thr, lse, exact = _redo_rows(
      exact, (thr, lse, exact), flat, rows_from_all_candidates, lambda f: from_candidates(f, floor)
    )
  else:
    thr, lse, exact = from_candidates(flat, floor)

  # Rows whose candidates did not suffice: sort just those (a fixed number of
  # them, so shapes stay static), or the whole batch if there are too many.
  # The logits are the operand (raw, or a view), never a closure over a scaled copy.
  def sort_rows(idx, raw):
    r = row_of(idx)
    return _sorted_threshold_and_lse(
      _scaled_rows(raw, idx, temperature, row_of), top_k[r], top_p[r], min_p=None if min_p is None else min_p[r]
    )

  return _redo_rows(
    exact, (thr, lse), logits, sort_rows, lambda raw: _sorted_threshold_and_lse(scale(raw), top_k, top_p, min_p=min_p)
  )


# ----------------------------------------------------------------------------
# The search on a vocabulary split over devices
# ----------------------------------------------------------------------------


class _SliceCandidates(NamedTuple):
  """One device's candidates for the split search, scaled by the temperature (see `_slice_candidates`)."""

  values: jax.Array  # f32[B, ..., C]
  unit_max: jax.Array  # f32[B, ..., n]: each unit's max (a unit: a group or a block of tokens)
  unit_mass: jax.Array  # f32[B, ..., n]: each unit's sum of exp(x - its max)
  floor: jax.Array  # f32[B, ...]: every token outside the candidates is <= it
  narrow: bool  # static: True for XLA's candidates (4 a group, too many to gather): narrowed to 8 of every 128 first


def _slice_candidates(logits, temperature, top_k, top_p, min_p, shards) -> _SliceCandidates:
  """This device's candidates for the split search, from one read of its slice [B, ..., V/m].

  XLA's reduction keeps the 4 largest of every group of 16 to 128 tokens, too
  many to gather: they are narrowed first. The Pallas kernel keeps the 8 (16
  for vocabularies of fewer than 64 blocks) largest of every block of 2048
  tokens, already as few as the narrowed ones.

  The Pallas kernel (`shards.search`, plain arrays with a temperature only)
  writes the candidates of the rows whose filters are on; the other rows' are
  set to -inf here (their search finds nothing to cut, as it should).
  """
  if shards.search == "xla" or temperature is None or isinstance(logits, LogitsView):
    v_local = logits.shape[-1]
    want = int(np.clip(shards.vocab // _NUM_GROUPS, 16, 128))
    fits = [g for g in range(1, 129) if v_local % g == 0 and g <= 2 * want]
    group_size = max(fits, key=lambda g: (-abs(np.log(g / want)), g))
    tops, group_mass = group_top(_scaled(logits, temperature), group_size, with_sumexp=True)  # [..., G, 4], [..., G]
    flat = tops.reshape(tops.shape[:-2] + (-1,))
    return _SliceCandidates(flat, tops[..., 0], group_mass, jnp.max(tops[..., -1], axis=-1), narrow=True)
  from specdec_jax.sampling import block_stats  # (it imports this module)

  lead, v_local = logits.shape[:-1], logits.shape[-1]
  positions = int(np.prod(lead[1:], dtype=np.int64))
  per_block = block_stats.filter_candidates(-(-shards.vocab // block_stats.DEFAULT_BLOCK))
  need = top_k_or_top_p_on(top_k, top_p, shards.vocab)
  if min_p is not None:
    need = need | (min_p > 0)
  # The kernel's own test of "filters on" sees top_k 1 (on) or 0 and top-p 1 (off): the rows `need` names,
  # greedy ones included (all_random), whatever this slice's width makes of a top-k.
  block_max, block_mass, _, cand = block_stats.block_partials(
    logits.reshape(-1, v_local),
    temperature,
    None,
    (need.astype(jnp.int32), jnp.ones_like(top_p, jnp.float32)),
    positions=positions,
    candidates=per_block,
    all_random=True,
    interpret=shards.search == "pallas_interpret",
  )
  n = block_max.shape[-1]
  cand = cand.reshape(lead + (n * per_block,))
  written = _bcast(need, cand[..., 0])[..., None]
  cand = scale_logits(jnp.where(written, cand, -jnp.inf), temperature)
  floor = jnp.max(cand.reshape(lead + (n, per_block))[..., -1], axis=-1)  # each block's smallest candidate
  block_max = scale_logits(block_max.reshape(lead + (n,)), temperature)
  return _SliceCandidates(cand, block_max, block_mass.reshape(lead + (n,)), floor, narrow=False)


def _sharded_threshold_and_lse(logits, temperature, top_k, top_p, min_p, shards):
  """`threshold_and_lse` with the vocabulary split over `shards`: each device keeps its own candidates.

  Each device reads its slice once for its candidates (`_slice_candidates`).
  In XLA's program they are the 4 largest values of every group of tokens,
  narrowed to the 8 largest of every 128 (`group_top`, as on one device); in
  the Pallas kernel's, the 8 largest of every block of 2048 tokens. Only those
  few hundred candidates per position are gathered, with the maxima, floors
  and masses reduced over the devices. In XLA's program, rows the narrowed
  candidates cannot vouch for are redone from the 32 largest of every 128
  (gathered for those rows only); in the Pallas kernel's, such rows' slices are
  read again as XLA's program reads them, for those rows only
  (`_reread_rows`). Rows that still fail are redone by bisection over the
  logits (`_bisect_threshold_and_lse`). No gather grows with V beyond
  V/64 values a position. Thresholds are exact, as on one device; a normaliser may differ
  from one device's in its last bits (sums in another order).
  """
  scale = functools.partial(_scaled, temperature=temperature)
  v = shards.vocab
  local = _slice_candidates(logits, temperature, top_k, top_p, min_p, shards)
  flat = local.values

  def gathered(f, per_group, *local_maxima):
    return _narrow_and_gather(f, per_group, local_maxima, shards, narrow=local.narrow)

  # The row's max and the floor (tokens outside the candidates are <= it) ride with the candidates: one
  # collective, then the mass's.
  cand, (m, floor, narrow_floor) = gathered(flat, _NARROW_PER_GROUP, jnp.max(local.unit_max, axis=-1), local.floor)
  unit_mass, unit_max = local.unit_mass, local.unit_max
  total = shards.sum(jnp.sum(jnp.where(unit_mass > 0, unit_mass * jnp.exp(unit_max - m[..., None]), 0.0), axis=-1))
  row_of = _row_index(logits, m)
  from_candidates = functools.partial(
    _threshold_from_candidates, top_k=top_k, top_p=top_p, v=v, total=total, m=m, min_p=min_p
  )
  thr, lse, exact = from_candidates(cand, jnp.maximum(floor, narrow_floor))

  if local.narrow and flat.shape[-1] > _NARROW_GROUP:
    # Rows the 8 largest of every 128 cannot vouch for: from the 32 largest, narrowed inside the branch
    # for those rows only (a batch whose rows all settle pays nothing for them).
    wide = 4 * _NARROW_PER_GROUP

    def wide_narrowed(f, f_floor):
      every, (every_floor,) = gathered(f, wide)
      return every, jnp.maximum(f_floor, every_floor)

    wide_rows = functools.partial(
      _rows_from_candidates,
      floor=floor,
      row_of=row_of,
      top_k=top_k,
      top_p=top_p,
      v=v,
      total=total,
      m=m,
      min_p=min_p,
      narrow=wide_narrowed,
    )

    def wide_batch(f):
      return from_candidates(*wide_narrowed(f, floor))

    thr, lse, exact = _redo_rows(exact, (thr, lse, exact), flat, wide_rows, wide_batch, shards)
  else:
    # Rows the Pallas candidates cannot vouch for (a block holding more of the row's top tokens than it keeps):
    # their slices read again, these rows only, as XLA's program reads them, before any bisection.
    reread = functools.partial(
      _reread_rows,
      temperature=temperature,
      top_k=top_k,
      top_p=top_p,
      min_p=min_p,
      shards=shards,
      total=total,
      m=m,
      row_of=row_of,
    )
    found = (thr, lse, exact)  # more failing rows than the branch takes: left to the bisection's whole batch
    thr, lse, exact = _redo_rows(exact, found, logits, reread, lambda raw: found, shards)

  def bisect_rows(idx, raw):
    r = row_of(idx)
    return _bisect_threshold_and_lse(
      _scaled_rows(raw, idx, temperature, row_of), top_k[r], top_p[r], None if min_p is None else min_p[r], shards
    )

  return _redo_rows(
    exact, (thr, lse), logits, bisect_rows, lambda raw: _bisect_batch(scale(raw), top_k, top_p, min_p, shards), shards
  )


def _narrow_and_gather(f, per_group, local_maxima, shards, *, narrow=True):
  """This device's candidates f [..., C], narrowed to the `per_group` largest of every _NARROW_GROUP, gathered
  over the devices; with the max over the devices of each of `local_maxima` ([...]) and, last, of the narrowed
  candidates' floor, in the same collective: (candidates, maxima).

  Narrowed on the device before the gather, so that no gather grows with the vocabulary (`narrow` False, or
  C <= _NARROW_GROUP: gathered as they are, with a floor of -inf)."""
  maxima = list(local_maxima)
  if narrow and f.shape[-1] > _NARROW_GROUP:
    tops = group_top(f, _NARROW_GROUP, per_group)
    f = tops.reshape(tops.shape[:-2] + (-1,))
    maxima.append(jnp.max(tops[..., -1], axis=-1))
  else:
    maxima.append(jnp.full(f.shape[:-1], -jnp.inf, f.dtype))  # not narrowed: no floor of its own
  return shards.gather_and_max(f, maxima)


def _reread_rows(idx, raw, *, temperature, top_k, top_p, min_p, shards, total, m, row_of):
  """(thr, lse, exact) of the flat rows idx of the logits raw [B, ..., V/m], from candidates read as XLA's split
  search reads them: the 4 largest of every group of this device's slice, narrowed to the 32 largest of every
  128 and gathered over the devices (about V/32 a row). `total` and `m` [B, ...]: the rows' mass and max;
  `row_of`: `_row_index`'s map from a flat index to its batch row."""
  r = row_of(idx)
  mp = None if min_p is None else min_p[r]
  rows = _scaled_rows(raw, idx, temperature, row_of)  # [n, V/m]
  local = _slice_candidates(rows, None, top_k[r], top_p[r], mp, dataclasses.replace(shards, search="xla"))
  cand, (floor, narrow_floor) = _narrow_and_gather(local.values, 4 * _NARROW_PER_GROUP, [local.floor], shards)
  return _threshold_from_candidates(
    cand,
    jnp.maximum(floor, narrow_floor),
    top_k=top_k[r],
    top_p=top_p[r],
    v=shards.vocab,
    total=total.reshape(-1)[idx],
    m=m.reshape(-1)[idx],
    min_p=mp,
  )


def _bisect_batch(scaled, top_k, top_p, min_p, shards):
  """`_bisect_threshold_and_lse` of every row and position of scaled [B, ..., V/m]; (thr, lse) [B, ...]."""
  lead = scaled.shape[:-1]
  per = int(np.prod(lead[1:], dtype=np.int64))
  rows = lambda a: None if a is None else jnp.repeat(a, per)
  thr, lse = _bisect_threshold_and_lse(
    scaled.reshape(-1, scaled.shape[-1]), rows(top_k), rows(top_p), rows(min_p), shards
  )
  return thr.reshape(lead), lse.reshape(lead)


def ordered_key(x):
  """uint32 keys in the order of the float32 values (-inf lowest, +inf highest)."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | np.uint32(1 << 31))


def from_ordered_key(u):
  """Inverse of `ordered_key`."""
  bits = jnp.where(u >> 31 == 1, u & np.uint32(0x7FFFFFFF), ~u)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def largest_key(weight_at_least, enough, shape=()):
  """The largest uint32 t [shape] with enough(weight_at_least(t)), bit by bit from the top: 32 steps, exact.

  enough(weight_at_least(t)) must hold for the t below some bound and fail
  above it (a weight that does not increase with t, and a lower limit on it);
  rows where even t = 0 is not enough get 0 (the caller checks). Plain
  jax.numpy: the Pallas threshold kernel (`block_stats.block_thresholds`) runs
  it too, on scalars.

  Example:
    >>> largest_key(lambda t: t, lambda w: w <= 7)   # 7
  """

  def step(i, ans):
    cand = ans | jnp.left_shift(jnp.uint32(1), (31 - i).astype(jnp.uint32))
    return jnp.where(enough(weight_at_least(cand)), cand, ans)

  return jax.lax.fori_loop(0, 32, step, jnp.zeros(shape, jnp.uint32))


def largest_key_by_digits(weights_at_least, enough, shape=()):
  """`largest_key` four bits a step: 8 steps of 16 trial keys each instead of 32 of one.

  weights_at_least takes the 16 trial keys of a step at once, uint32
  [*shape, 16], and returns their weights, [*shape, 16]. Where each weighing
  ends in a collective across devices (the split search), a quarter of the
  steps is a quarter of the collectives' latency; each step does 16 times the
  (small) arithmetic. Same answer as `largest_key`.

  Example:
    >>> largest_key_by_digits(lambda t: t, lambda w: w <= 7)   # 7
  """
  digits = jnp.arange(16, dtype=jnp.int32).reshape((1,) * len(shape) + (16,))

  def step(i, ans):
    shift = (28 - 4 * i).astype(jnp.uint32)
    trial = ans[..., None] | jnp.left_shift(digits.astype(jnp.uint32), shift)
    ok = enough(weights_at_least(trial))  # true for a prefix of the digits
    return ans | jnp.left_shift(jnp.max(jnp.where(ok, digits, 0), axis=-1).astype(jnp.uint32), shift)

  return jax.lax.fori_loop(0, 8, step, jnp.zeros(shape, jnp.uint32))


def _bisect_threshold_and_lse(x, top_k, top_p, min_p, shards):
  """Exact top-k/top-p/min-p thresholds of rows x [R, V/m] split over `shards`, by bisection: no sort, no gather.

  The top-k value is the largest t with at least k tokens >= t; the top-p value
  the largest t whose tokens >= t (within the top-k set) hold at least
  top_p of its mass, which is the sorted search's answer. Each of the (up to)
  16 steps (`largest_key_by_digits`) counts or sums over this device's slice
  for 16 trial values and adds the devices' partials ([R, 16] values, one
  collective). Cost: about 16 passes over x, for the rare rows the candidates
  cannot settle.

  Returns:
    (thr, lse) f32[R].
  """
  v = shards.vocab
  u = ordered_key(x)
  m = shards.max(jnp.max(x, axis=-1))
  e = jnp.exp(x - m[:, None])
  k_on = top_k_on(top_k, v)
  p_on = top_p < 1.0
  # Weights of trial keys t [R, J]: [R, J], summed over the devices.
  count_at_least = lambda t: shards.sum(jnp.sum((u[:, None, :] >= t[..., None]).astype(jnp.int32), axis=-1))
  kth = jax.lax.cond(
    shards.any(k_on),
    lambda: jnp.where(
      k_on, from_ordered_key(largest_key_by_digits(count_at_least, lambda n: n >= top_k[:, None], m.shape)), -jnp.inf
    ),
    lambda: jnp.full(m.shape, -jnp.inf, jnp.float32),
  )
  in_top_k = x >= kth[:, None]
  row_mass = shards.sum(jnp.sum(e, axis=-1))
  z = jnp.where(k_on, shards.sum(jnp.sum(jnp.where(in_top_k, e, 0.0), axis=-1)), row_mass)
  target = top_p * z

  def top_p_value():
    mass_at_least = lambda t: shards.sum(
      jnp.sum(jnp.where(in_top_k[:, None, :] & (u[:, None, :] >= t[..., None]), e[:, None, :], 0.0), axis=-1)
    )
    key = largest_key_by_digits(mass_at_least, lambda w: w >= target[:, None], m.shape)
    # Weighed as in the search (16 keys at once, the same sums), else rounding left the total under top_p:
    # keep the top-k set.
    found = mass_at_least(jnp.broadcast_to(key[:, None], key.shape + (16,)))[:, 0] >= target
    return jnp.where(found, from_ordered_key(key), -jnp.inf)

  pth = jax.lax.cond(shards.any(p_on), top_p_value, lambda: jnp.full(m.shape, -jnp.inf, jnp.float32))
  thr = jnp.where(p_on, jnp.maximum(kth, pth), kth)
  on = k_on | p_on
  if min_p is not None:
    mp_on = min_p > 0
    thr = jnp.maximum(thr, jnp.where(mp_on, m + jnp.log(jnp.where(mp_on, min_p, 1.0)), -jnp.inf))
    on = on | mp_on
  kept = jnp.where(on, shards.sum(jnp.sum(jnp.where(x >= thr[:, None], e, 0.0), axis=-1)), row_mass)
  return thr, m + jnp.log(kept)
