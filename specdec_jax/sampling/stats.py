"""What one pass over a position's logits knows: threshold, normaliser, argmax, chunk masses.

Every consumer of a processed distribution (acceptance tests, the recovered
and bonus draws, log-probabilities, `process_logits`) reads the logits through
a `PositionStats`, so none needs a normalised probability tensor. The order of
processing and the rules for non-finite values are in `specdec_jax.sampling`'s
docstring.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from specdec_jax.sampling.params import (
  SamplingParams,
)
from specdec_jax.sampling.penalties import (
  _modifies_logits,
)
from specdec_jax.sampling.reductions import (
  _bcast,
  chunk_size,
  chunk_stats,
  greedy_argmax,
  max_and_sumexp,
  scale_logits,
  shifted_chunk_stats,
  sum_over_vocab,
  values,
)
from specdec_jax.sampling.thresholds import (
  ShiftedStats,
  filter_active,
  shift_non_finite_rows,
  threshold_and_lse,
  top_k_or_top_p_on,
)
from specdec_jax.sampling.vocab_parallel import any_rows, take_vocab

# ----------------------------------------------------------------------------
# Position statistics: what one pass over a position's logits knows
# ----------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PositionStats:
  """The processed distribution of every position, as one pass over the logits leaves it.

  With x = `scale_logits(logits, temperature, shift)`, a position keeps the
  tokens with x >= thr, and a kept token's log-probability is x - lse. Every
  consumer (acceptance, the recovered/bonus draw, log-probabilities,
  `process_logits`) reads the logits through these numbers, so none needs a
  normalised probability tensor.

  Attributes (leading axes [B, ...] of the logits):
    shift: f32; subtracted before dividing by the temperature. 0 except on
      rows whose one pass overflowed (`shift_non_finite_rows`), which were redone.
    thr: f32; keep iff x >= thr (-inf: nothing filtered).
    lse: f32; log-normaliser of the kept set (-inf: no logit above -inf).
    argmax: int32; first index of the largest logit (NaN counted as -inf),
      computed only for rows declared greedy (zeros otherwise).
    redone: bool; the rows that were redone with a shift.
    chunk_log_mass: f32[B, ..., n] or None; log of each `chunk_size` chunk's
      unnormalised mass, when asked for and V is a multiple of the chunk
      size. Stale where `redone`, and all -inf when some row filters (then
      draws read their whole row; see `position_stats`).
  """

  shift: jax.Array
  thr: jax.Array
  lse: jax.Array
  argmax: jax.Array
  redone: jax.Array
  chunk_log_mass: jax.Array | None = None

  def token_log_probs(self, logits: jax.Array, tokens: jax.Array, temperature: jax.Array, shards=None) -> jax.Array:
    """log p(token) under these statistics, reading one logit per token (see `token_log_probs`)."""
    return token_log_probs(logits, tokens, temperature, self.shift, self.thr, self.lse, shards=shards)


# The statistics passes a program can hold (`StatsPlan.passes`).
NO_FILTERS_PASS = "no_filters"  # one overflow-safe pass shifted by each row's max: the static promise, no branch
PLAIN_PASS = "plain"  # (max, sum of exps[, argmax]) per chunk or per row: no row filters
MIN_P_PASS = "min_p_only"  # the plain pass, then a kept-mass pass: min-p rows, none with top-k/top-p
FILTERED_PASS = "filtered"  # sort-free threshold search (`threshold_and_lse`): some row has top-k or top-p


@dataclasses.dataclass(frozen=True, kw_only=True)
class StatsPlan:
  """What `position_stats` compiles, decided once at trace time from static facts.

  Attributes:
    passes: the statistics passes the program holds, in the order of the
      run-time choice among them: (NO_FILTERS_PASS,) under the no-filters
      promise (no run-time branch); (PLAIN_PASS, FILTERED_PASS) chosen by
      `_if_any_row_filters`; (PLAIN_PASS, MIN_P_PASS, FILTERED_PASS) when
      params carry min-p, chosen by `_filter_pass_index`.
    argmax: the greedy rows' argmax is computed (it rides along in the plain
      pass, or takes one more pass after the threshold search), only when
      `_if_any_row_greedy` says some row needs it.
    chunked: the unfiltered pass reduces per chunk of `chunk_size(V)` tokens.
    chunk_masses: `PositionStats.chunk_log_mass` is returned.

  Example:
    >>> stats_plan(SamplingParams.create(1.0), 4096, greedy_rows=False, argmax=False, chunks=True).passes
    ('plain', 'filtered')
  """

  passes: tuple[str, ...]
  argmax: bool
  chunked: bool
  chunk_masses: bool

  @property
  def overflow_redo(self) -> bool:
    """Rows whose one-pass normaliser is not finite are redone under a run-time branch (not in the no-filters pass)."""
    return self.passes != (NO_FILTERS_PASS,)


def stats_plan(
  params: SamplingParams, vocab_size: int, *, greedy_rows: bool, argmax: bool, chunks: bool, sharded: bool = False
) -> StatsPlan:
  """The `StatsPlan` of `position_stats(logits, params, greedy=..., argmax=argmax, chunks=chunks, shards=...)`.

  Args:
    params: SamplingParams; only its structure (no_filters, min_p present) is read.
    vocab_size: V, the whole vocabulary's size.
    greedy_rows: whether some row may be greedy (`position_stats`' greedy is not None).
    argmax, chunks: as for `position_stats`.
    sharded: the vocabulary is split over devices (always chunked).

  Returns:
    StatsPlan.

  Example:
    >>> stats_plan(SamplingParams.create(1.0).promise_no_filters(), 96, greedy_rows=True, argmax=True,
    ...            chunks=False).passes
    ('no_filters',)
  """
  # Else reshaping into chunks would copy the logits. A split vocabulary is always chunked.
  chunked = (chunks and vocab_size % chunk_size(vocab_size) == 0) or sharded
  if params.no_filters:
    passes = (NO_FILTERS_PASS,)
  elif params.min_p is None:
    passes = (PLAIN_PASS, FILTERED_PASS)
  else:
    passes = (PLAIN_PASS, MIN_P_PASS, FILTERED_PASS)
  return StatsPlan(passes=passes, argmax=argmax and greedy_rows, chunked=chunked, chunk_masses=chunked and chunks)


class PassStats(NamedTuple):
  """What one statistics pass leaves, before the overflow redo; leading axes [B, ...] of the logits."""

  thr: jax.Array  # f32: keep iff scaled logit >= thr (-inf: nothing filtered)
  lse: jax.Array  # f32: log-normaliser of the kept set (may be non-finite: then the row is redone)
  argmax: jax.Array  # int32: greedy rows' argmax (zeros when not computed)
  chunk_log_mass: jax.Array  # f32 [B, ..., n]: per-chunk log-masses (-inf where stale: filtered rows)


class _OnePass(NamedTuple):
  """The plain pass: (max, lse, argmax, chunk log-masses) of the unfiltered distribution."""

  max: jax.Array
  lse: jax.Array
  argmax: jax.Array
  chunk_log_mass: jax.Array


def _if_any_row_greedy(greedy, shards, some_greedy, none_greedy, *operands):
  """Run-time branch: the argmax is worth computing only if some row (on any device) is greedy."""
  return jax.lax.cond(any_rows(greedy, shards), some_greedy, none_greedy, *operands)


def _if_any_row_filters(filters_on, shards, filtered, plain, *operands):
  """Run-time branch: the threshold search runs only if some row (on any device) filters."""
  return jax.lax.cond(any_rows(filters_on, shards), filtered, plain, *operands)


def _filter_pass_index(params: SamplingParams, greedy, vocab_size: int, shards) -> jax.Array:
  """Run-time choice among (PLAIN_PASS, MIN_P_PASS, FILTERED_PASS): 2 if a row has top-k/top-p, 1 if min-p only."""
  top_on = top_k_or_top_p_on(params.top_k, params.top_p, vocab_size) & ~greedy
  min_p_on = (params.min_p > 0) & ~greedy
  return jnp.where(any_rows(top_on, shards), 2, jnp.where(any_rows(min_p_on, shards), 1, 0))


def _one_pass(raw, temperature, plan: StatsPlan, with_argmax: bool, shards) -> _OnePass:
  """(max, lse, argmax, chunk log-masses) of the unfiltered distribution, in one read of the logits."""
  lead = raw.shape[:-1]
  no_argmax = jnp.zeros(lead, jnp.int32)
  x = scale_logits(raw, temperature)  # greedy rows are scaled by 1, so the argmax of x is theirs
  if not plan.chunked:
    stats = max_and_sumexp(x, with_argmax=with_argmax)
    lse = stats[0] + jnp.log(stats[1])
    return _OnePass(stats[0], lse, (stats[2] if with_argmax else no_argmax), jnp.zeros(lead + (1,), jnp.float32))
  m, lse, am, chunk_logw = chunk_stats(x, with_argmax=with_argmax, shards=shards)
  return _OnePass(m, lse, (am if with_argmax else no_argmax), chunk_logw)


def _one_pass_with_argmax(raw, params: SamplingParams, plan: StatsPlan, greedy, shards) -> _OnePass:
  """The plain pass; the argmax rides along in it when the plan asks and some row is greedy."""
  t = params.temperature
  if not plan.argmax:
    return _one_pass(raw, t, plan, False, shards)
  return _if_any_row_greedy(
    greedy, shards, lambda r: _one_pass(r, t, plan, True, shards), lambda r: _one_pass(r, t, plan, False, shards), raw
  )


def _plain_pass(raw, *, params: SamplingParams, plan: StatsPlan, greedy, shards) -> PassStats:
  """PLAIN_PASS: nothing filtered; one pass."""
  one = _one_pass_with_argmax(raw, params, plan, greedy, shards)
  return PassStats(jnp.full(raw.shape[:-1], -jnp.inf, jnp.float32), one.lse, one.argmax, one.chunk_log_mass)


def _min_p_pass(raw, *, params: SamplingParams, plan: StatsPlan, greedy, shards) -> PassStats:
  """MIN_P_PASS: min-p alone needs no threshold search: its cut is max + log(min_p), known after the plain pass.

  One more pass sums the kept mass. (Same threshold as `threshold_and_lse`; the
  normaliser may differ from it in rounding.)
  """
  m, lse, am, chunk_logw = _one_pass_with_argmax(raw, params, plan, greedy, shards)
  on = _bcast((params.min_p > 0) & ~greedy, m)
  thr = jnp.where(on, m + jnp.log(jnp.where(on, _bcast(params.min_p, m), 1.0)), -jnp.inf)
  x = scale_logits(raw, params.temperature)
  kept = sum_over_vocab(jnp.where(x >= thr[..., None], jnp.exp(x - m[..., None]), 0.0), shards)
  return PassStats(thr, jnp.where(on, m + jnp.log(kept), lse), am, jnp.full_like(chunk_logw, -jnp.inf))


def _filtered_pass(raw, *, params: SamplingParams, plan: StatsPlan, greedy, shards) -> PassStats:
  """FILTERED_PASS: the threshold search; the argmax takes one more read, only if some row is greedy."""
  lead = raw.shape[:-1]
  v = raw.shape[-1] if shards is None else shards.vocab
  n_ch = v // chunk_size(v) if plan.chunked else 1
  thr, lse = threshold_and_lse(raw, params.temperature, params.top_k, params.top_p, min_p=params.min_p, shards=shards)
  no_argmax = jnp.zeros(lead, jnp.int32)
  am = no_argmax
  if plan.argmax:
    am = _if_any_row_greedy(greedy, shards, lambda r: greedy_argmax(r, shards)[0], lambda r: no_argmax, raw)
  return PassStats(thr, lse, am, jnp.full(lead + (n_ch,), -jnp.inf, jnp.float32))


_PASSES = {PLAIN_PASS: _plain_pass, MIN_P_PASS: _min_p_pass, FILTERED_PASS: _filtered_pass}


def _no_filters_stats(logits, params: SamplingParams, plan: StatsPlan, shards) -> PositionStats:
  """NO_FILTERS_PASS: one pass shifted by every row's max replaces the run-time branches.

  The filter search, the overflow redo and the argmax ride-along each cost a
  device-to-host copy on a GPU. The statistics are the plain pass's up to rounding.
  """
  lead = logits.shape[:-1]
  c = chunk_size(logits.shape[-1] if shards is None else shards.vocab)
  shift, lse, am, chunk_logw = shifted_chunk_stats(
    logits, params.temperature, chunk=c if plan.chunked else logits.shape[-1], with_argmax=plan.argmax, shards=shards
  )
  return PositionStats(
    shift=shift,
    thr=jnp.full(lead, -jnp.inf, jnp.float32),
    lse=lse,
    argmax=am if plan.argmax else jnp.zeros(lead, jnp.int32),
    redone=jnp.zeros(lead, jnp.bool_),
    chunk_log_mass=chunk_logw if plan.chunk_masses else None,
  )


def position_stats(
  logits: jax.Array,
  params: SamplingParams,
  *,
  greedy: jax.Array | None = None,
  argmax: bool = False,
  chunks: bool = False,
  shards=None,
) -> PositionStats:
  """Threshold, normaliser, argmax and chunk masses of every position, in one read of the logits.

  Which passes the program holds is static (`stats_plan`; the pass names are
  this module's *_PASS constants); which of them runs is chosen at run time for
  the whole batch (a row's numbers never depend on which pass its neighbours
  send the batch down, except in rounding of the normaliser):

  * NO_FILTERS_PASS (`params.no_filters`): one overflow-safe pass, no branch.
  * PLAIN_PASS or FILTERED_PASS, by `_if_any_row_filters`; with min-p in the
    params, PLAIN_PASS, MIN_P_PASS or FILTERED_PASS, by `_filter_pass_index`.
    Then rows whose normaliser is not finite (overflow, +inf logits, nothing
    above -inf) are redone on logits shifted by their max
    (`shift_non_finite_rows`, its own run-time branch).

  Args:
    logits: [B, ..., V], any float dtype (after bias and penalties, if any).
    params: SamplingParams of batch B; temperature, top_k, top_p, min_p are read.
    greedy: bool[B], the rows that are greedy: their filters are ignored.
      None: every row is random (a temperature-0 row too).
    argmax: static; compute the argmax of the greedy rows (in the same pass
      when nothing filters), under a run-time `lax.cond` on any(greedy).
    chunks: static; also compute each chunk's mass (the unfiltered pass then
      reduces per chunk of `chunk_size(V)` tokens, which on an H100 is also the
      faster pass; bench/RESULTS.md). Needs V to be a multiple of the chunk
      size, else chunk_log_mass stays None.
    shards: a `vocab_parallel.VocabShards` inside the samplers' shard_map (the
      logits are then this device's slice [B, ..., V/m]), or None. The
      results are the whole vocabulary's, the same on every device.

  Returns:
    PositionStats.

  Example:
    >>> stats = position_stats(logits, params)                    # logits [B, V]
    >>> logp = jnp.where(scale_logits(logits, params.temperature, stats.shift) >= stats.thr[:, None], ...)
  """
  b, v = logits.shape[0], (logits.shape[-1] if shards is None else shards.vocab)
  plan = stats_plan(params, v, greedy_rows=greedy is not None, argmax=argmax, chunks=chunks, sharded=shards is not None)
  if plan.passes == (NO_FILTERS_PASS,):
    return _no_filters_stats(logits, params, plan, shards)
  greedy = jnp.zeros((b,), jnp.bool_) if greedy is None else greedy
  # One predicate decides which rows filter; greedy rows never do.
  filters_on = filter_active(params, v, greedy=greedy)
  min_p = None if params.min_p is None else jnp.where(filters_on, params.min_p, 0.0)
  # Scaling happens inside each pass (reductions, gathers) so it fuses there:
  # a scaled copy passed into lax.cond would be materialised, tripling the traffic.
  passes = [
    functools.partial(_PASSES[name], params=params, plan=plan, greedy=greedy, shards=shards) for name in plan.passes
  ]
  if len(passes) == 2:
    thr, lse, am, chunk_logw = _if_any_row_filters(filters_on, shards, passes[1], passes[0], logits)
  else:
    thr, lse, am, chunk_logw = jax.lax.switch(_filter_pass_index(params, greedy, v, shards), passes, logits)
  # Rows whose one-pass lse is not finite are redone on logits shifted by their max;
  # only they get a nonzero shift, so the other rows' values stay as computed.
  redone = ~jnp.isfinite(lse)
  shift, thr, lse = shift_non_finite_rows(
    logits,
    params.temperature,
    jnp.where(filters_on, params.top_k, 0),
    jnp.where(filters_on, params.top_p, 1.0),
    thr,
    lse,
    min_p=min_p,
    shards=shards,
  )
  return PositionStats(
    shift=shift, thr=thr, lse=lse, argmax=am, redone=redone, chunk_log_mass=chunk_logw if plan.chunk_masses else None
  )


def log_probs_from_stats(logits: jax.Array, params: SamplingParams, stats: PositionStats) -> jax.Array:
  """f32[B, ..., V] log-probabilities of the distribution `stats` describes (-inf for removed tokens).

  Example:
    >>> logp = log_probs_from_stats(logits, params, position_stats(logits, params))
  """
  scaled = scale_logits(logits, params.temperature, stats.shift)
  keep = (scaled >= stats.thr[..., None]) & (stats.lse[..., None] > -jnp.inf)
  return jnp.where(keep, scaled - stats.lse[..., None], -jnp.inf)


# ----------------------------------------------------------------------------
# Log-probabilities of chosen tokens
# ----------------------------------------------------------------------------


def log_softmax_stats(logits: jax.Array, shards=None) -> ShiftedStats:
  """ShiftedStats(shift, thr, lse) of the unmodified distribution, softmax(logits) at T = 1, for `token_log_probs`.

  One pass over the logits (`max_and_sumexp`); rows whose normaliser is not
  finite (+inf logits, overflow, nothing above -inf) are redone as in
  `process_logits`, so +inf tokens share the mass and NaN counts as -inf.

  Args:
    logits: [B, ..., V], any float dtype (this device's slice under `shards`).
    shards: a `vocab_parallel.VocabShards`, or None. Split (or when V is a
      multiple of `chunk_size(V)`), the pass reduces per chunk, as
      `position_stats` does, so both give the same bits.

  Returns:
    ShiftedStats(shift, thr, lse), each f32[B, ...]; thr is -inf (nothing filtered).

  Example:
    >>> stats = log_softmax_stats(logits)   # then token_log_probs(logits, tokens, ones, *stats)
  """
  b = logits.shape[0]
  t = jnp.ones((b,), jnp.float32)
  v = logits.shape[-1] if shards is None else shards.vocab
  if shards is None and v % chunk_size(v):
    m, s = max_and_sumexp(scale_logits(logits, t))
    lse = m + jnp.log(s)
  else:
    lse = chunk_stats(scale_logits(logits, t), shards=shards)[1]
  thr = jnp.full(logits.shape[:-1], -jnp.inf, jnp.float32)
  return shift_non_finite_rows(
    logits, t, jnp.zeros((b,), jnp.int32), jnp.ones((b,), jnp.float32), thr, lse, shards=shards
  )


def token_log_probs(
  logits: jax.Array,
  tokens: jax.Array,
  temperature: jax.Array,
  shift: jax.Array,
  thr: jax.Array,
  lse: jax.Array,
  *,
  shards=None,
) -> jax.Array:
  """log p(token) under the distribution that (shift, thr, lse) describe, reading one logit per token.

  Args:
    logits: [B, ..., V], any float dtype.
    tokens: int [B, ...]; ids outside [0, V) read id 0 (callers mask them).
    temperature: f32[B] (greedy rows count as temperature 1, as in `scale_logits`).
    shift, thr, lse: f32[B, ...] from `log_softmax_stats`, or the sampler's own
      (temperature, top-k, top-p) statistics.
    shards: a `vocab_parallel.VocabShards` (logits: this device's slice; the
      owner of each token reads it), or None.

  Returns:
    f32[B, ...]: x - lse where the token is kept (x >= thr), -inf otherwise or
    where the position has no logit above -inf.

  Example:
    >>> lp = token_log_probs(logits, tokens, jnp.ones(b), *log_softmax_stats(logits))
  """
  safe = jnp.clip(tokens, 0, (logits.shape[-1] if shards is None else shards.vocab) - 1)
  x = scale_logits(take_vocab(values(logits), safe[..., None], shards), temperature, shift)[..., 0]
  return jnp.where((x >= thr) & (lse > -jnp.inf), x - lse, -jnp.inf)


def _if_any_row_needs_log_softmax(needs, shards, log_softmax, zeros):
  """Run-time branch: the log-normaliser pass of the unmodified logits runs only if some row needs it."""
  return jax.lax.cond(any_rows(needs, shards), log_softmax, zeros)


def requested_log_probs(
  logits: jax.Array,
  tokens: jax.Array,
  params: SamplingParams,
  processed: jax.Array,
  mode: str,
  greedy: jax.Array,
  shards=None,
) -> jax.Array:
  """The log-probabilities `mode` asks for ("raw" or "processed"), given the sampled distribution's.

  `processed` holds log p(token) under the distribution each row samples from
  (bias, penalties, temperature, top-k, top-p, min-p). Random rows keep those
  values for "processed", and for "raw" too where they are the raw ones
  (temperature 1, nothing filtered, no bias or penalty: e.g. RL rollouts). The
  other rows, greedy rows included, get `log_softmax` of `logits`: one more pass
  over them, run only when some row needs it.

  Args:
    logits: [B, ..., V] the target's logits: the raw ones for "raw"; for
      "processed", those after the logit bias and penalties (`apply_penalties`),
      which greedy rows read (they are the raw ones when params has neither).
    tokens: int [B, ...] the emitted tokens.
    params: SamplingParams of batch B.
    processed: f32[B, ...] log p(token) under the sampled distribution.
    mode: "raw" or "processed" (static).
    greedy: bool[B] rows that count as greedy.
    shards: a `vocab_parallel.VocabShards` (logits: this device's slice), or None.

  Returns:
    f32[B, ...].

  Example:
    >>> lp = requested_log_probs(logits, tokens, params, processed, "raw", params.is_greedy)
  """
  b = logits.shape[0]
  v = logits.shape[-1] if shards is None else shards.vocab
  own = ~greedy
  if mode == "raw":
    own = own & (params.temperature == 1.0) & ~filter_active(params, v)
    modified = _modifies_logits(params, v)
    if modified is not None:
      own = own & ~modified
  ones = jnp.ones((b,), jnp.float32)
  other = _if_any_row_needs_log_softmax(
    ~own,
    shards,
    lambda: token_log_probs(logits, tokens, ones, *log_softmax_stats(logits, shards), shards=shards),
    lambda: jnp.zeros(tokens.shape, jnp.float32),
  )
  return jnp.where(_bcast(own, processed), processed, other)
