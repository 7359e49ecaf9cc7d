"""Per-request sampling parameters and plain (non-speculative) token sampling.

Processing order for a row (docs/api.md); steps 1-3 only when the request sets
them, and for greedy rows too:

    1. logits + logit_bias
    2. repetition penalty on every token of the context (prompt, generated
       tokens, earlier drafts of the round): x / r where x > 0, else x * r
    3. x -= frequency_penalty * count + presence_penalty * (count > 0), count of
       the token among the generated tokens (and earlier drafts; not the prompt)
    4. greedy: argmax. Random:
       logits / temperature -> keep top_k largest -> renormalise
                            -> keep the smallest most-likely set with mass >= top_p
                            -> renormalise
                            -> keep tokens with probability >= min_p * the largest
                            -> renormalise

All three filters are *threshold* filters: a token is kept iff its scaled logit
is >= a per-row threshold, so tokens tied with the last kept token are kept too.
Renormalising keeps probability ratios, so min-p's cut is `x / T >= max + log(min_p)`
on the scaled logits, and the kept set is `x / T >= max(top-k/top-p threshold, that)`.
Greedy requests (temperature below `GREEDY_TEMPERATURE`) use `argmax` of the
logits after steps 1-3, first index on ties.

Values outside the ordinary range, the same rule on every path (greedy, random,
filtered or not, alone or in any batch; a row never depends on its neighbours):

* NaN logits are masked tokens (as -inf): never emitted, never the argmax.
* +inf logits mean "this token": a row with +inf logits puts all its mass,
  uniformly, on them (after top-k/top-p, which keep all of them as a tie);
  greedy takes the first.
* A row with no logit above -inf (all masked or NaN) has no distribution:
  `process_logits` gives it all -inf, and the samplers emit token 0 there
  (greedy, random and mixed alike). Eager calls of `sample_tokens` raise instead.
* Finite logits never overflow: `logits / temperature` is computed as
  `(logits - row max) / temperature` for any row where the plain quotient is not
  finite (a temperature near 0, or logits near the float32 limit), so a
  temperature near 0 behaves like greedy for every finite logit. The shifted
  recomputation runs under a run-time `lax.cond`, only for batches that need it;
  other rows keep the one-pass results bit for bit.
* Steps 1-3 (`apply_penalties`) keep these classes: NaN stays NaN, +-inf stays
  +-inf (with finite biases and penalties), and a finite logit stays finite (a
  result beyond the float32 range saturates at +-3.4e38 instead of turning into
  "this token" or "masked").

Everything here is pure `jax.numpy` and works under `jit`; a "row" is one request
and every function broadcasts the per-request parameters over any middle axes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

# The building blocks live in their own modules (parameters, reductions, penalties,
# thresholds, draws); the names the rest of the library reads are re-exported here.
from specdec_jax.draws import (  # noqa: F401
    categorical_from_log_weights, categorical_with_empty, categorical_with_fallback, draw_from_chunks,
    draw_from_chunks_excluding)
from specdec_jax.penalties import (  # noqa: F401
    PenaltyState, _modifies_logits, apply_penalties, penalized_view, penalty_params)
from specdec_jax.reductions import (  # noqa: F401
    LogitsView, _bcast, chunk_size, chunk_stats, greedy_argmax, max_and_sumexp, scale_logits, shifted_chunk_stats,
    sum_over_vocab, values)
from specdec_jax.sampling_params import (  # noqa: F401
    GREEDY_TEMPERATURE, SamplingParams, check_bias_ids, check_logits_values, check_params, check_probs_values,
    row_keys, valid_probs)
from specdec_jax.thresholds import (  # noqa: F401
    filter_active, group_top, shift_non_finite_rows, sorted_threshold, threshold_and_lse, top_k_top_p_threshold)
from specdec_jax.mesh import auto_axes_if_explicit
from specdec_jax.vocab_parallel import any_rows, row_spec, sharded_call, shards_for, take_vocab


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


def position_stats(logits: jax.Array, params: SamplingParams, *, greedy: jax.Array | None = None,
                   argmax: bool = False, chunks: bool = False, shards=None) -> PositionStats:
  """Threshold, normaliser, argmax and chunk masses of every position, in one read of the logits.

  The paths, chosen at run time for the whole batch (a row's numbers never
  depend on which path its neighbours send the batch down, except in rounding
  of the normaliser: see below):

  | condition                          | pass over the logits                                      |
  | ---------------------------------- | --------------------------------------------------------- |
  | no row filters (top-k/top-p/min-p) | (max, sum of exps[, argmax]) per chunk, or per row        |
  | some row filters                   | sort-free threshold search (`threshold_and_lse`); argmax  |
  |                                    | in one more pass, only if some row is greedy              |
  | some lse not finite (overflow,     | those rows redone on logits shifted by their max          |
  | +inf logits, nothing above -inf)   | (`shift_non_finite_rows`), under a `lax.cond`             |
  | `params.no_filters` (static)       | one overflow-safe pass (`shifted_chunk_stats`), no branch |

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
  lead = logits.shape[:-1]
  need_argmax = argmax and greedy is not None
  greedy = jnp.zeros((b,), jnp.bool_) if greedy is None else greedy
  no_argmax = jnp.zeros(lead, jnp.int32)
  c = chunk_size(v)
  # Else reshaping into chunks would copy the logits. A split vocabulary is always chunked.
  chunked = (chunks and v % c == 0) or shards is not None
  n_ch = v // c if chunked else 1
  t = params.temperature
  # The promise that no row filters (static): one pass shifted by every row's max replaces the
  # run-time branches (the filter search, the overflow redo, the argmax ride-along), each of which
  # costs a device-to-host copy on a GPU. The statistics are the unfiltered path's up to rounding.
  if params.no_filters:
    shift, lse, am, chunk_logw = shifted_chunk_stats(logits, t, chunk=c if chunked else logits.shape[-1],
                                                     with_argmax=need_argmax, shards=shards)
    return PositionStats(shift=shift, thr=jnp.full(lead, -jnp.inf, jnp.float32), lse=lse,
                         argmax=am if need_argmax else no_argmax, redone=jnp.zeros(lead, jnp.bool_),
                         chunk_log_mass=chunk_logw if chunked and chunks else None)
  any_ = lambda x: any_rows(x, shards)
  # One predicate decides which rows filter; greedy rows never do.
  filters_on = filter_active(params, v, greedy=greedy)
  min_p = None if params.min_p is None else jnp.where(filters_on, params.min_p, 0.0)

  # Scaling happens inside each consumer (reductions, gathers) so it fuses there:
  # a scaled copy passed into lax.cond would be materialised, tripling the traffic.
  def plain_stats(raw, with_argmax):
    """(max, lse, argmax, chunk log-masses) of the unfiltered distribution: one pass."""
    x = scale_logits(raw, t)  # greedy rows are scaled by 1, so the argmax of x is theirs
    if not chunked:
      stats = max_and_sumexp(x, with_argmax=with_argmax)
      lse = stats[0] + jnp.log(stats[1])
      return stats[0], lse, (stats[2] if with_argmax else no_argmax), jnp.zeros(lead + (1,), jnp.float32)
    m, lse, am, chunk_logw = chunk_stats(x, with_argmax=with_argmax, shards=shards)
    return m, lse, (am if with_argmax else no_argmax), chunk_logw

  def plain_with_max(raw):
    if not need_argmax:
      return plain_stats(raw, False)
    # The argmax rides along in the same pass, but only when some row is greedy.
    return jax.lax.cond(any_(greedy), lambda r: plain_stats(r, True), lambda r: plain_stats(r, False), raw)

  def plain(raw):
    _, lse, am, chunk_logw = plain_with_max(raw)
    return jnp.full(lead, -jnp.inf, jnp.float32), lse, am, chunk_logw

  def min_p_only(raw):
    # min-p alone needs no threshold search: its cut is max + log(min_p), known after
    # the plain pass; one more pass sums the kept mass. (Same threshold as
    # `threshold_and_lse`; the normaliser may differ from it in rounding.)
    m, lse, am, chunk_logw = plain_with_max(raw)
    on = _bcast(mp_rows, m)
    thr = jnp.where(on, m + jnp.log(jnp.where(on, _bcast(params.min_p, m), 1.0)), -jnp.inf)
    x = scale_logits(raw, t)
    kept = sum_over_vocab(jnp.where(x >= thr[..., None], jnp.exp(x - m[..., None]), 0.0), shards)
    return thr, jnp.where(on, m + jnp.log(kept), lse), am, jnp.full_like(chunk_logw, -jnp.inf)

  def filtered(raw):
    thr, lse = threshold_and_lse(raw, t, params.top_k, params.top_p, min_p=params.min_p, shards=shards)
    am = no_argmax
    if need_argmax:  # one more read of the logits, only if some row is greedy
      am = jax.lax.cond(any_(greedy), lambda r: greedy_argmax(r, shards)[0], lambda r: no_argmax, raw)
    return thr, lse, am, jnp.full(lead + (n_ch,), -jnp.inf, jnp.float32)

  if params.min_p is None:
    thr, lse, am, chunk_logw = jax.lax.cond(any_(filters_on), filtered, plain, logits)
  else:
    mp_rows = (params.min_p > 0) & ~greedy
    top_on = (((params.top_k > 0) & (params.top_k < v)) | (params.top_p < 1.0)) & ~greedy  # top-k/top-p rows
    branch = jnp.where(any_(top_on), 2, jnp.where(any_(mp_rows), 1, 0))
    thr, lse, am, chunk_logw = jax.lax.switch(branch, [plain, min_p_only, filtered], logits)
  # Rows whose one-pass lse is not finite are redone on logits shifted by their max;
  # only they get a nonzero shift, so the other rows' values stay as computed.
  redone = ~jnp.isfinite(lse)
  shift, thr, lse = shift_non_finite_rows(logits, t, jnp.where(filters_on, params.top_k, 0),
                                          jnp.where(filters_on, params.top_p, 1.0), thr, lse, min_p=min_p,
                                          shards=shards)
  return PositionStats(shift=shift, thr=thr, lse=lse, argmax=am, redone=redone,
                       chunk_log_mass=chunk_logw if chunked and chunks else None)


def log_probs_from_stats(logits: jax.Array, params: SamplingParams, stats: PositionStats) -> jax.Array:
  """f32[B, ..., V] log-probabilities of the distribution `stats` describes (-inf for removed tokens).

  Example:
    >>> logp = log_probs_from_stats(logits, params, position_stats(logits, params))
  """
  scaled = scale_logits(logits, params.temperature, stats.shift)
  keep = (scaled >= stats.thr[..., None]) & (stats.lse[..., None] > -jnp.inf)
  return jnp.where(keep, scaled - stats.lse[..., None], -jnp.inf)


def process_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """Log-probabilities after temperature, top-k, top-p and min-p (every row as random).

  Step 4 of the processing order only: the logit bias and the penalties
  (`apply_penalties`) are the caller's, before this. min-p is read from
  `params.min_p` (None: off, and the program is the one without min-p).
  Greedy rows are processed as random rows at temperature 1 (with their own
  filters); callers pick argmax for them.
  NaN logits count as -inf, +inf logits share all the mass, and a row with no
  logit above -inf comes out all -inf (see the module docstring).

  Args:
    logits: [B, ..., V], any float dtype.
    params: SamplingParams of batch B.

  Returns:
    f32[B, ..., V] normalised log-probabilities, -inf for removed tokens.

  Example:
    >>> logp = process_logits(jnp.zeros((2, 5)), SamplingParams.create(1.0, top_k=2))
  """
  return log_probs_from_stats(logits, params, position_stats(logits, params))



# ----------------------------------------------------------------------------
# Log-probabilities of chosen tokens
# ----------------------------------------------------------------------------


def log_softmax_stats(logits: jax.Array, shards=None):
  """(shift, thr, lse) of the unmodified distribution, softmax(logits) at temperature 1, for `token_log_probs`.

  One pass over the logits (`max_and_sumexp`); rows whose normaliser is not
  finite (+inf logits, overflow, nothing above -inf) are redone as in
  `process_logits`, so +inf tokens share the mass and NaN counts as -inf.

  Args:
    logits: [B, ..., V], any float dtype (this device's slice under `shards`).
    shards: a `vocab_parallel.VocabShards`, or None. Split (or when V is a
      multiple of `chunk_size(V)`), the pass reduces per chunk, as
      `position_stats` does, so both give the same bits.

  Returns:
    (shift, thr, lse), each f32[B, ...]; thr is -inf (nothing filtered).

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
  return shift_non_finite_rows(logits, t, jnp.zeros((b,), jnp.int32), jnp.ones((b,), jnp.float32), thr, lse,
                               shards=shards)


def token_log_probs(logits: jax.Array, tokens: jax.Array, temperature: jax.Array, shift: jax.Array, thr: jax.Array,
                    lse: jax.Array, *, shards=None) -> jax.Array:
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


def requested_log_probs(logits: jax.Array, tokens: jax.Array, params: SamplingParams, processed: jax.Array,
                        mode: str, greedy: jax.Array, shards=None) -> jax.Array:
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
  other = jax.lax.cond(any_rows(~own, shards),
                       lambda: token_log_probs(logits, tokens, ones, *log_softmax_stats(logits, shards), shards=shards),
                       lambda: jnp.zeros(tokens.shape, jnp.float32))
  return jnp.where(_bcast(own, processed), processed, other)


def sample_tokens(logits: jax.Array, params: SamplingParams, key, *, all_greedy: bool = False,
                  no_filters: bool = False, penalty_state: PenaltyState | None = None, logprobs: str | None = None):
  """Plain sampling of one token per row, plus the distribution it came from.

  When params carry a logit bias or penalties, each row's logits first go
  through `apply_penalties` (steps 1-3, context = `penalty_state`). Greedy rows
  then take the argmax (first index on ties); random rows draw from the
  processed (temperature, top-k, top-p, min-p) distribution.

  Under jit, NaN logits count as -inf on every path, and a row with no logit
  above -inf emits token 0 (greedy or random) with an all -inf log_probs row.
  Called eagerly with concrete logits, either raises a ValueError instead.

  Args:
    logits: [B, V], any float dtype.
    params: SamplingParams of batch B.
    key: one PRNG key or a batch of B keys (see `row_keys`).
    all_greedy: static promise that every row is greedy: argmax only, no
      softmax and no random numbers for the token (log_probs is one-hot).
    no_filters: static promise that no row uses top-k, top-p or min-p (they
      are ignored): the program holds one overflow-safe softmax pass and no
      run-time branch (`position_stats`): `params.promise_no_filters()`. The
      same distribution; draws may differ from the default program's where
      rounding ties two candidates.
    penalty_state: PenaltyState of batch B and vocabulary V (the rows' prompts
      and generated tokens). Needed when params carry penalties, unless they
      are concrete and all neutral (r = 1, f = p = 0).
    logprobs: static; None (default), "raw" or "processed": also return the
      log-probability of each sampled token, "raw" under log_softmax of the
      unmodified logits, "processed" under the distribution it was drawn from
      (for greedy rows: log_softmax of the logits after steps 1-3).

  Returns:
    (tokens int32[B], log_probs f32[B, V]): log_probs is the log of the
    distribution each row's token was drawn from (log one-hot for greedy rows).
    With `logprobs`, a third value f32[B]: the tokens' log-probabilities.

  Raises:
    ValueError: for a bad shape, params or logprobs mode, penalties without a
      penalty_state, concrete logit-bias ids >= V, and for concrete logits
      holding a NaN or a row with no logit above -inf.

  Example:
    >>> tok, logp = sample_tokens(logits, SamplingParams.create([0.0, 1.0]), jax.random.key(0))
    >>> params = SamplingParams.create(0.8, min_p=0.05, repetition_penalty=1.1)
    >>> tok, logp, lp = sample_tokens(logits, params, key, penalty_state=state, logprobs="processed")
    >>> tok, logp = sample_tokens(logits, SamplingParams.create(1.0), key, no_filters=True)  # branch-free
  """
  where = "sample_tokens"
  if logits.ndim != 2:
    raise ValueError(f"{where}: logits must be [B, V], got shape {logits.shape}")
  b, v = logits.shape
  check_params(params, b, where)
  if logprobs not in (None, "raw", "processed"):
    raise ValueError(f"{where}: logprobs must be None, 'raw' or 'processed', got {logprobs!r}")
  check_logits_values(logits, None, f"{where}: logits")
  if no_filters:
    params = params.promise_no_filters()
  steps = penalty_params(params, penalty_state, b, v, where)
  keys = None if all_greedy else row_keys(key, b)
  body = functools.partial(_sample_tokens, all_greedy=all_greedy, logprobs=logprobs)
  shards = shards_for(v, b)
  if shards is None:  # (a vocabulary that does not split into whole chunks: XLA moves the data)
    return auto_axes_if_explicit(functools.partial(body, shards=None))(logits, steps, keys, penalty_state)
  # Each device samples from its rows and its slice of the vocabulary (see `rejection_sample`).
  rows, split = row_spec(shards, 1), row_spec(shards, 2, vocab_last=True)
  out_specs = (rows, split) + ((rows,) if logprobs else ())
  program = functools.partial(body, shards=shards)
  return sharded_call(program, (split, rows, P() if keys is None else rows,
                                        P() if penalty_state is None else split), out_specs)(
      logits, steps, keys, penalty_state)


def _sample_tokens(logits, params, keys, penalty_state, *, all_greedy, logprobs, shards):
  """`sample_tokens` after its checks, on one device or on this device's rows and vocabulary slice."""
  b, v_here = logits.shape  # v_here: this device's tokens under shards
  offset = 0 if shards is None else shards.offset()
  # Without bias and penalty fields, x is the caller's array: the program is the plain one.
  x = logits
  if params.has_logit_bias or params.has_penalties:
    x = penalized_view(logits, params, penalty_state, vocab_offset=None if shards is None else offset)
  greedy_tok, best = greedy_argmax(x, shards)
  # float32 constants: weakly typed Python floats would make it float64 under jax_enable_x64.
  one_hot = jnp.where(jax.nn.one_hot(greedy_tok - offset, v_here, dtype=jnp.bool_) & (best > -jnp.inf)[:, None],
                      np.float32(0), np.float32(-np.inf))
  if all_greedy:
    if logprobs is None:
      return greedy_tok, one_hot
    every = jnp.ones((b,), jnp.bool_)
    lp = requested_log_probs(logits if logprobs == "raw" else x, greedy_tok, params, jnp.zeros((b,), jnp.float32),
                             logprobs, every, shards)
    return greedy_tok, one_hot, lp
  # Greedy rows' filters are ignored: their distribution is the one-hot below.
  logp = log_probs_from_stats(x, params, position_stats(x, params, greedy=params.is_greedy, chunks=True,
                                                        shards=shards))
  # A row of all -inf draws index 0 (every Gumbel-perturbed weight is -inf), as greedy does.
  tok = categorical_with_empty(keys, logp, shards)[0]
  greedy = params.is_greedy
  tokens, dist = jnp.where(greedy, greedy_tok, tok), jnp.where(greedy[:, None], one_hot, logp)
  if logprobs is None:
    return tokens, dist
  processed = take_vocab(logp, tokens[:, None], shards)[:, 0]
  lp = requested_log_probs(logits if logprobs == "raw" else x, tokens, params, processed, logprobs, greedy, shards)
  return tokens, dist, lp
