"""The lossless rejection sampler of speculative decoding.

For row b with n = num_draft_tokens[b] draft tokens d_0 .. d_{n-1}:

    position:   0     1     ...   n-1   n
    target:     p_0   p_1   ...   p_{n-1} p_n      (target_logits[b, i] -> p_i)
    draft:      d_0   d_1   ...   d_{n-1}          (drawn from q_i)

    accept d_i with prob min(1, p_i(d_i) / q_i(d_i)), left to right;
    first rejection at i: emit a token from normalise(max(p_i - q_i, 0)), stop;
    all n accepted:       emit a bonus token from p_n.

Greedy rows replace "accept" by "d_i == argmax(target_logits[b, i])" and the
recovered/bonus token by that argmax.

Memory traffic is the cost (docs/sampler.md): the floor is one read of target_logits.
The random path needs, per position, only log p_i(d_i) = x_i[d_i]/T - logsumexp(x_i/T)
(a reduction and a gather), compared in log space; at most one full row per
request (the stopping position) is gathered to draw the recovered/bonus token.
A mixed batch computes the argmax and the logsumexp in the same single pass.

Every path, when it is taken and what it reads, is the table `verify.plan.sampler_paths()`
returns; the static choices among them are one frozen `SamplerPlan` (`verify.plan.chain_plan`),
made once at trace time, and the `lax.cond`s left in the program are the run-time ones, each
named for what it decides (listed in `verify.plan`). Measured costs per path: bench/RESULTS.md.

The code follows the plan: `_program` runs `_greedy`, `_general` or both under
`_if_all_rows_greedy` (`plan.verifier`); `_general` runs four named steps:
`position_stats` (threshold, normaliser, argmax, chunk masses in one pass;
`plan.stats`), `_score_drafts` (gathers), the acceptance rule (`plan.method`;
`block` for "block"), `_draw_final` (`plan.draw`: chunk draw, row draw or redraw).

Inputs outside the ordinary range (the rules of `specdec_jax.sampling`, the same
for greedy, random and mixed batches; a row never depends on its neighbours):
NaN logits count as -inf; +inf logits share all of a position's mass; finite
logits never overflow `logits / T` (rows that would are recomputed shifted by
their max, under a run-time `lax.cond`); a position with no logit above -inf
accepts no draft and emits token 0. Under jit, a draft probability that is NaN,
+-inf or negative counts as 0.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from specdec_jax.mesh import auto_axes_if_explicit
from specdec_jax.sampling import draws, masks, penalties, reductions, thresholds, vocab_parallel
from specdec_jax.sampling.fused_sample import KERNELS
from specdec_jax.sampling.params import SamplingParams, check_promises, row_keys, single_key, valid_probs
from specdec_jax.sampling.stats import PositionStats, position_stats, requested_log_probs
from specdec_jax.verify import block, fused
from specdec_jax.verify.checks import check_chain_values, check_verifier_args
from specdec_jax.verify.plan import (
  CHUNK_DRAW,
  CHUNK_OR_ROW_DRAW,
  GENERAL_VERIFIER,
  GREEDY_VERIFIER,
  ROW_DRAW_WITH_FALLBACK,
  SamplerPlan,
  chain_plan,
)

PLACEHOLDER_TOKEN_ID = -1
LOGPROBS_MODES = (None, "raw", "processed")
METHODS = ("token", "block")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RejectionOutput:
  """What `rejection_sample` emits.

  Attributes:
    token_ids: int32[B, K+1]: accepted drafts, then one recovered or bonus token,
      then PLACEHOLDER_TOKEN_ID (-1).
    num_accepted: int32[B]: draft tokens accepted, in [0, num_draft_tokens].
    num_emitted: int32[B]: num_accepted + 1.
    logprobs: f32[B, K+1] with `rejection_sample(..., logprobs=...)`, else None:
      the log-probability of each emitted token under the target at its
      position (0 past num_emitted; see `rejection_sample`).
  """

  token_ids: jax.Array  # [B, K+1]
  num_accepted: jax.Array  # [B]
  num_emitted: jax.Array  # [B]
  logprobs: jax.Array | None = None  # [B, K+1]


def rejection_sample(
  draft_token_ids,  # int32 [B, K]
  target_logits,  # float [B, K+1, V]
  params: SamplingParams,  # batch B
  key=None,  # one key, or [B] keys (typed or raw uint32)
  draft_probs=None,  # float [B, K, V] or None (n-gram drafts)
  num_draft_tokens=None,  # int32 [B] in [0, K]; None = K
  all_greedy: bool = False,
  all_random: bool = False,
  logprobs: str | None = None,
  method: str = "token",
  penalty_state: penalties.PenaltyState | None = None,
  no_filters: bool = False,
  kernels: str = "auto",
  token_bitmask=None,  # int32 [B, K+1, ceil(V/32)] or None
) -> RejectionOutput:
  """Verifies draft tokens against the target, losslessly.

  Args:
    draft_token_ids: int32[B, K] proposed tokens; entries at or past
      num_draft_tokens[b] are ignored (any value, -1 included).
    target_logits: float[B, K+1, V]; row i scores position i, row n_b gives the
      bonus token of row b. Any float dtype; arithmetic is float32.
    params: SamplingParams with batch B (temperature 0 = greedy).
    key: one PRNG key or a batch of B keys, typed or raw uint32[2]. A single key
      gives row b `fold_in(key, b)`; a batch gives row b `key[b]`. May be None
      only with all_greedy=True.
    draft_probs: float[B, K, V], the distributions the drafts were sampled
      from, or None for drafts without probabilities (treated as one-hot).
    num_draft_tokens: int32[B] in [0, K], or None for all K. Under jit it is
      clipped to [0, K].
    all_greedy: static promise that every row is greedy: the program has no
      exponential, no random numbers and no probability tensor.
    all_random: static promise that no row is greedy: no argmax is computed.
      (Both flags are promises; they are not checked under jit.)
    logprobs: static; None (default), "raw" or "processed": also return the
      log-probability of every emitted token under the target at its position.
      "raw" is `log_softmax` of the unmodified logits; "processed" is under the
      distribution the row samples from (temperature, top-k, top-p), and for a
      greedy row `log_softmax` of its logits. A recovered token gets its target
      log-probability, not the residual's. "processed" reuses the sampler's own
      statistics for random rows, and so does "raw" for random rows at
      temperature 1 without top-k/top-p; other rows (greedy rows included) need
      one more log-normaliser pass over the logits, run only when some row
      needs it (it brings exponentials into the all_greedy program, which stays
      free of random numbers).
    method: static; "token" (default): each draft is accepted or rejected on
      its own, left to right, as above. "block": block verification (Sun et al.,
      ICLR 2025, arXiv 2403.10444) for random rows: the accepted prefix is
      chosen jointly (see "Block verification" below); lossless, and it accepts
      in expectation at least as many drafts as "token". Greedy rows are the
      same under both.
    penalty_state: a `PenaltyState` (prompt mask and counts of the tokens
      generated before this round), needed when params carry repetition,
      frequency or presence penalties with non-neutral values. Every position
      applies the logit bias and the penalties before temperature, top-k,
      top-p and min-p, with the round's earlier drafts d_0 .. d_{i-1} counted
      in position i's context (`penalties.apply_penalties`); greedy rows take
      the argmax of the penalised logits, and all_greedy programs stay free of
      exponentials and random numbers. "raw" log-probabilities stay those of
      the unmodified logits.
    no_filters: static promise that no row uses top-k, top-p or min-p (they
      are ignored; `SamplingParams.promise_no_filters`). Random rows then take
      one overflow-safe softmax pass (`position_stats`) and draw
      without any run-time branch on the filters, the overflow redo or an
      empty residual: on a GPU every such branch costs a conditional or a
      host copy, which at batch 1 costs more than the work. The same
      distribution as without the flag.
    kernels: static; "xla", "pallas" or "auto" (default): which program runs.
      "pallas" is `verify.fused`: up to four Pallas kernels with the random
      numbers drawn inside them and no run-time branch outside a kernel
      (built for batch 1 to 64 on a GPU; elsewhere Pallas's interpreter runs
      them, for tests), and for all_greedy a program that reads a bonus row
      only where every draft was accepted. It covers methods "token" and
      "block" without logprobs, a logit bias or penalties, min-p or a split
      vocabulary (all_greedy: without logprobs, bias, penalties or a split),
      and raises ValueError for the rest. "auto" takes "pallas" on a GPU
      where it covers the call, except for all_greedy under 8 rows (XLA's
      argmax of all positions is a microsecond faster there), else "xla". Both draw from the same distribution
      with different random streams: one key gives other, equally
      distributed, tokens under each; greedy tokens are the same.
    token_bitmask: int32 [B, K+1, ceil(V/32)] or None: the tokens allowed at
      each position, bit v % 32 of word v // 32 (`sampling.masks`; structured
      output). Applied after the bias and penalties and before temperature and
      the filters, like a -inf bias: the target's law at a position is its law
      over the allowed tokens, renormalised; a draft outside the mask is
      rejected; recovered and bonus tokens are allowed ones; greedy rows take
      the argmax over allowed tokens (all_greedy stays softmax-free). Read
      inside the passes over the logits (no masked copy is written). A
      concrete mask with a used position (<= num_draft_tokens) that allows no
      token, or none above -inf, is a ValueError; under jit such a position
      behaves as one whose logits are all -inf (below). Pallas programs do not
      cover it ("auto" takes XLA's); a vocabulary split needs V/m to be a
      multiple of 32 (else the one-device program runs).

  Returns:
    RejectionOutput(token_ids int32[B, K+1], num_accepted int32[B],
    num_emitted int32[B], logprobs f32[B, K+1] or None).

  Raises:
    ValueError: for mismatched shapes, dtypes or batch sizes (at trace time), and
      for out-of-range values given as concrete arrays: num_draft_tokens outside
      [0, K], draft ids outside [0, V), draft_probs entries that are NaN, +-inf
      or negative, target_logits holding NaN or a position whose logits are all
      -inf (only positions <= num_draft_tokens are checked).

  Under jit nothing is checked, and:
    * a draft id outside [0, V) is never accepted; nothing is read out of bounds;
    * a draft probability that is NaN, +-inf or negative counts as 0;
    * a NaN logit counts as -inf (never emitted; never the greedy argmax), on
      every path, so a row does not depend on its neighbours;
    * +inf logits mean "this token": the position's mass goes uniformly to its
      +inf tokens (greedy: the first of them);
    * a position whose logits are all -inf (or NaN) accepts no draft, not even
      one equal to its argmax, and emits token 0 if the row stops there (greedy,
      random and mixed batches alike);
    * a temperature near 0 behaves like greedy for every finite logit: no
      overflow of logits / T;
    * a masked (-inf) target token is never emitted.

  Block verification, for a random row with n drafts (w_j, R_j, h_j are [B]):

      w_0 = 1,  w_j = min(w_{j-1} * p_{j-1}(d_{j-1}) / q_{j-1}(d_{j-1}), 1)    j = 1..n
      R_j = sum_x max(w_j * p_j(x) - q_j(x), 0)   (one-hot q: R_j = w_j * (1 - p_j(d_j)))
      h_j = R_j / (R_j + 1 - w_j)  for 1 <= j < n  (0 when R_j = 0),   h_n = w_n
      accept tau = the largest j in 1..n with u_j <= h_j (u_j uniform), else 0;
      emit d_0 .. d_{tau-1}, then a token from normalise(max(w_tau * p_tau - q_tau, 0))
      if tau < n, or the bonus from p_n if tau = n.

    A draft rejected on its own can still be accepted as part of the block: a
    later draft that the target likes more than the draft did raises w_j back.
    Without draft probabilities it costs nothing over "token" (R_j comes from the
    same gathered p_j(d_j), and the residual is p_tau without d_tau, as before);
    with them, R_j needs one more pass over the logits and draft_probs of
    positions 1..K-1.

  Example:
    >>> out = rejection_sample(
    ...     draft_token_ids=jnp.array([[3, 1]]),
    ...     target_logits=logits,                 # [1, 3, V]
    ...     params=SamplingParams.greedy(1),
    ...     key=None, all_greedy=True)
    >>> out.token_ids  # e.g. [[3, 7, -1]]: draft 3 accepted, 1 rejected, 7 emitted
  """
  draft_token_ids = jnp.asarray(draft_token_ids)
  target_logits = jnp.asarray(target_logits)
  if logprobs not in LOGPROBS_MODES:
    raise ValueError(f"rejection_sample: logprobs must be one of {LOGPROBS_MODES}, got {logprobs!r}")
  if method not in METHODS:
    raise ValueError(f"rejection_sample: method must be one of {METHODS}, got {method!r}")
  if kernels not in KERNELS:
    raise ValueError(f"rejection_sample: kernels must be one of {KERNELS}, got {kernels!r}")
  where = "rejection_sample"
  b, k1, v = check_verifier_args(
    where,
    draft_token_ids,
    target_logits,
    params,
    draft_probs,
    num_draft_tokens,
    axis="K",
    probs_rows=0,
    count_name="num_draft_tokens",
  )
  k = k1 - 1
  check_promises(
    where, params, v, all_greedy=all_greedy, all_random=all_random, no_filters=no_filters or params.no_filters
  )
  params = penalties.penalty_params(params, penalty_state, b, v, where)
  all_drafts = num_draft_tokens is None
  if all_drafts:
    num_draft_tokens = jnp.full((b,), k, jnp.int32)
  num_draft_tokens = jnp.asarray(num_draft_tokens)
  if draft_probs is not None:
    draft_probs = jnp.asarray(draft_probs)
  check_chain_values(where, draft_token_ids, num_draft_tokens, target_logits, draft_probs)
  if token_bitmask is not None:
    used = jnp.arange(k1)[None, :] <= jnp.clip(num_draft_tokens, 0, k)[:, None]
    token_bitmask = masks.check_bitmask(token_bitmask, (b, k1), v, where, used=used, logits=target_logits)
  single = None  # one key for the batch (typed), which the Pallas kernels fold with each row index
  if key is None:
    if not all_greedy:
      raise ValueError(f"{where}: key is required unless all_greedy=True")
    keys = None
  else:
    keys = row_keys(key, b, f"{where}: key")
    single = single_key(key)
  shards = vocab_parallel.shards_for(v, b, word_aligned=token_bitmask is not None, kernels=kernels)
  # A mesh whose vocabulary does not split into whole chunks runs the one-device program,
  # with Explicit axes made Auto (XLA moves the data).
  if no_filters:
    params = params.promise_no_filters()  # static, in the params' structure (`_general` reads it)
  plan = chain_plan(
    params,
    vocab=v,
    local_vocab=v if shards is None else shards.local,
    draft_probs=draft_probs is not None,
    all_greedy=all_greedy,
    all_random=all_random,
    logprobs=logprobs,
    method=method,
    sharded=shards is not None,
    kernels=kernels,
    batch=b,
    mask=token_bitmask is not None,
  )
  program = functools.partial(_rejection_sample, plan=plan, shards=shards)
  if shards is None:
    program = auto_axes_if_explicit(program)
  pallas = plan.kernels == "pallas"
  return program(
    draft_token_ids.astype(jnp.int32),
    target_logits,
    params,
    single if pallas and single is not None else keys,  # the Pallas kernels fold one key into rows themselves
    draft_probs,
    None if all_drafts and pallas else num_draft_tokens.astype(jnp.int32),
    penalty_state,
    token_bitmask,
  )


# ----------------------------------------------------------------------------
# The program
# ----------------------------------------------------------------------------


def _emit(draft, num_accepted, final_token):
  """token_ids [B, K+1]: drafts before num_accepted, final at it, -1 after."""
  b, k = draft.shape
  pos = jnp.arange(k + 1)[None, :]
  padded = jnp.concatenate([draft, jnp.zeros((b, 1), jnp.int32)], axis=1)
  na = num_accepted[:, None]
  ids = jnp.where(pos < na, padded, jnp.where(pos == na, final_token[:, None], PLACEHOLDER_TOKEN_ID))
  return RejectionOutput(
    token_ids=ids.astype(jnp.int32),
    num_accepted=num_accepted.astype(jnp.int32),
    num_emitted=(num_accepted + 1).astype(jnp.int32),
  )


def _num_accepted(accept):
  """Length of the all-True prefix of accept [B, K]."""
  return jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)


def _greedy(draft, logits, live, shards=None):
  """Argmax-only verification: no exponential, no random numbers."""
  t, best = reductions.greedy_argmax(logits, shards)  # [B, K+1]; NaN counts as -inf
  # A position without any logit above -inf accepts nothing (its "argmax" 0 is no choice).
  num_accepted = _num_accepted((draft == t[:, :-1]) & (best[:, :-1] > -jnp.inf) & live)
  final = jnp.take_along_axis(t, num_accepted[:, None], axis=1)[:, 0]
  return _emit(draft, num_accepted, final)


class _DraftScores(NamedTuple):
  """Each draft as the target and the draft see it; all [B, K]."""

  ids: jax.Array  # int32: the draft ids, 0 where out of [0, V) (never read out of bounds)
  valid: jax.Array  # bool: the id is in [0, V)
  log_p: jax.Array  # f32: log p_i(d_i) under the processed target distribution (-inf: removed or masked)
  log_q: jax.Array  # f32: log q_i(d_i) (0 for drafts without probabilities: one-hot q)


def _score_drafts(draft, logits, params, stats: PositionStats, draft_probs, shards=None) -> _DraftScores:
  """Gathers one logit (and one draft probability) per draft: no pass over the vocabulary."""
  k, v = draft.shape[1], (logits.shape[-1] if shards is None else shards.vocab)
  valid = (draft >= 0) & (draft < v)
  ids = jnp.where(valid, draft, 0)
  # Both gathers in one collective under shards (each value has one owner: exact).
  rows = (reductions.values(logits)[:, :k],) + (() if draft_probs is None else (draft_probs[:, :k],))
  taken = vocab_parallel.take_vocab_many(rows, ids[..., None], shards)
  x_d = reductions.scale_logits(taken[0], params.temperature, stats.shift[:, :k])[..., 0]
  log_p = jnp.where((x_d >= stats.thr[:, :k]) & (stats.lse[:, :k] > -jnp.inf), x_d - stats.lse[:, :k], -jnp.inf)
  if draft_probs is None:
    log_q = jnp.zeros_like(log_p)
  else:
    q_d = valid_probs(taken[1][..., 0])
    log_q = jnp.log(q_d)  # q = 0 -> -inf: accepted iff p > 0 (the ratio is infinite)
  return _DraftScores(ids=ids, valid=valid, log_p=log_p, log_q=log_q)


class _StopRow(NamedTuple):
  """The stopping position s [B] of every row and what the draws read there."""

  s: jax.Array  # int32 [B]: num_accepted, the position of the recovered or bonus token
  thr: jax.Array  # f32 [B, 1]
  lse: jax.Array  # f32 [B, 1]
  shift: jax.Array  # f32 [B]
  rejected: jax.Array  # bool [B, 1]: a draft was rejected there (s < n), so the residual applies
  draft_at: jax.Array  # int32 [B]: the draft column read at s (clipped into [0, K-1])
  draft: jax.Array  # int32 [B, 1]: the draft token at s; may be out of range


def _stop_row(draft, stats: PositionStats, s, n) -> _StopRow:
  at_s = lambda a: jnp.take_along_axis(a, s[:, None], axis=1)  # [B, K+1] -> [B, 1]
  s_draft = jnp.minimum(s, max(draft.shape[1] - 1, 0))
  return _StopRow(
    s=s,
    thr=at_s(stats.thr),
    lse=at_s(stats.lse),
    shift=at_s(stats.shift)[:, 0],
    rejected=(s < n)[:, None],
    draft_at=s_draft,
    draft=jnp.take_along_axis(draft, s_draft[:, None], axis=1),
  )


def _stop_log_weights(residual: bool, logits, params, draft_probs, stop: _StopRow, log_w, shards):
  """[B, V] log-weights at the stopping position, built from the inputs (fusible): p, or the residual."""
  k = logits.shape[1] - 1
  token_ids = jnp.arange(logits.shape[-1])[None, :] + (0 if shards is None else shards.offset())
  row = reductions.scale_logits(
    jnp.take_along_axis(reductions.values(logits), stop.s[:, None, None], axis=1)[:, 0], params.temperature, stop.shift
  )
  logp_row = jnp.where((row >= stop.thr) & (stop.lse > -jnp.inf), row - stop.lse, -jnp.inf)
  if not residual or k == 0:
    return logp_row
  if draft_probs is None:
    # p - onehot(d), clipped at 0, is p with d removed (an id outside [0, V) removes nothing).
    return jnp.where(stop.rejected & (token_ids == stop.draft), -jnp.inf, logp_row)
  q_row = valid_probs(jnp.take_along_axis(draft_probs, stop.draft_at[:, None, None], axis=1)[:, 0])
  if log_w is not None:  # block: the residual is max(w_s p_s - q_s, 0)
    logp_row = logp_row + jnp.take_along_axis(log_w, stop.s[:, None], axis=1)
  # Masked and filtered tokens stay out without a select: there exp(logp_row) = 0
  # and q_row >= 0 (valid_probs), so the residual is log(0) = -inf.
  return jnp.log(jnp.maximum(jnp.exp(logp_row) - jnp.where(stop.rejected, q_row, 0.0), 0.0))


def _if_any_residual_empty(empty, shards, redraw, keep):
  """Run-time branch: redraw from p only if some row's residual had no mass (rounding)."""
  return jax.lax.cond(vocab_parallel.any_rows(empty, shards), redraw, keep)


def _row_draw(key, weights, plan: SamplerPlan, shards):
  """Reads the stopping row (and its draft probabilities) once; weights(residual) gives its log-weights."""
  if plan.draw == ROW_DRAW_WITH_FALLBACK:
    # The no-filters program has no branch: the fallback's chunk masses come from the same pass.
    return draws.categorical_with_fallback(key, weights(True), weights(False), shards)
  tok, empty = draws.categorical_with_empty(key, weights(True), shards)
  # A residual with no mass falls back to p. The check comes from the draw's own chunk masses.
  return _if_any_residual_empty(
    empty,
    shards,
    lambda: jnp.where(empty, draws.categorical_with_empty(key, weights(False), shards)[0], tok),
    lambda: tok,
  )


def _chunk_draw(key, logits, params, stats: PositionStats, scores: _DraftScores, stop: _StopRow, shards):
  """Picks a chunk by the masses the one pass left, then reads that chunk of the stopping row."""
  b, k1, v = logits.shape  # v: this device's tokens under shards
  k = k1 - 1
  c = reductions.chunk_size(v if shards is None else shards.vocab)
  n_ch = v // c  # this device's chunks under shards
  log_pc = jnp.take_along_axis(stats.chunk_log_mass, stop.s[:, None, None], axis=1)[:, 0] - stop.lse  # [B, n]
  if k > 0:  # residual p - onehot(d) of a rejected draft
    exclude = jnp.where(stop.rejected[:, 0], stop.draft[:, 0], -1)
    p_d = jnp.exp(jnp.take_along_axis(scores.log_p, stop.draft_at[:, None], axis=1))[:, 0]
  else:
    exclude, p_d = jnp.full((b,), -1, jnp.int32), jnp.zeros((b,), jnp.float32)

  def chunk_log_weights(ch):  # [B] -> [B, c]: the chosen chunk of the stopping row, under p
    row = jnp.take_along_axis(reductions.values(logits), stop.s[:, None, None], axis=1).reshape(b, n_ch, c)
    return reductions.scale_logits(
      jnp.take_along_axis(row, ch[:, None, None], axis=1)[:, 0], params.temperature, stop.shift
    )

  return draws.draw_from_chunks_excluding(key, log_pc, chunk_log_weights, exclude, p_d, c, shards)


def _if_any_row_filtered(any_filtered, filtered, unfiltered):
  """Run-time branch: filtered rows have no chunk masses, so some filtered row sends the batch to the row draw."""
  return jax.lax.cond(any_filtered, filtered, unfiltered)


def _if_any_stop_row_redone(redone, shards, some_redone, none_redone):
  """Run-time branch: rows redone by the overflow shift have no chunk masses; only then is the row draw run too."""
  return jax.lax.cond(vocab_parallel.any_rows(redone, shards), some_redone, none_redone)


def _draw_final(
  key,
  draft,
  logits,
  params,
  stats,
  scores: _DraftScores,
  draft_probs,
  s,
  n,
  log_w,
  any_filtered,
  plan: SamplerPlan,
  shards=None,
):
  """The recovered or bonus token of every row, drawn at its stopping position s [B] (random rows' rule).

  `plan.draw` says how (see `verify.plan`): the chunk draw (nothing filtered,
  no draft probabilities, V a multiple of the chunk size) reads one chunk; the
  row draw (filtered, with draft probabilities, or a row redone by the overflow
  shift) reads the stopping row once; an empty residual (rounding) is redrawn
  from p. Under `shards` every draw reads only this device's slice (`sampling.draws`).
  """
  stop = _stop_row(draft, stats, s, n)
  weights = functools.partial(
    _stop_log_weights, logits=logits, params=params, draft_probs=draft_probs, stop=stop, log_w=log_w, shards=shards
  )
  row_draw = lambda: _row_draw(key, weights, plan, shards)
  chunk_draw = lambda: _chunk_draw(key, logits, params, stats, scores, stop, shards)
  if plan.draw == CHUNK_DRAW:
    tok = chunk_draw()  # no filters and no redone rows (`params.no_filters`: see `position_stats`)
  elif plan.draw == CHUNK_OR_ROW_DRAW:
    redone_s = jnp.take_along_axis(stats.redone, s[:, None], axis=1)[:, 0]
    mixed_draw = lambda: _if_any_stop_row_redone(
      redone_s, shards, lambda: jnp.where(redone_s, row_draw(), chunk_draw()), chunk_draw
    )
    tok = _if_any_row_filtered(any_filtered, row_draw, mixed_draw)
  else:
    tok = row_draw()
  return jnp.where(stop.lse[:, 0] > -jnp.inf, tok, 0)  # nothing to draw from: token 0, as greedy


def _general(draft, logits, params, keys, draft_probs, n, live, plan: SamplerPlan, shards=None):
  """Random rows (and greedy rows of a mixed batch) in one read of the logits, in four steps."""
  b, k1 = logits.shape[:2]
  v = logits.shape[-1] if shards is None else shards.vocab
  k = k1 - 1
  greedy = params.is_greedy if plan.argmax else jnp.zeros((b,), bool)
  # 1. Every position's processed distribution: threshold, normaliser, argmax, chunk masses.
  stats = position_stats(
    logits, params, greedy=greedy if plan.argmax else None, argmax=plan.argmax, chunks=True, shards=shards
  )
  # Read only by the chunk-or-row draw (under the no-filters promise no row filters, statically).
  any_filtered = None
  if plan.draw == CHUNK_OR_ROW_DRAW:
    any_filtered = vocab_parallel.any_rows(thresholds.filter_active(params, v, greedy=greedy), shards)
  # 2. Each draft's log-probability under the target and the draft (gathers only).
  scores = _score_drafts(draft, logits, params, stats, draft_probs, shards)
  # 3. The accepted prefix: in log space, accept d_i iff log u + log q_i(d_i) < log p_i(d_i).
  k_accept, k_final = jax.vmap(lambda kk: tuple(jax.random.split(kk)), out_axes=(0, 0))(keys)
  u = jax.vmap(lambda kk: jax.random.uniform(kk, (k,), jnp.float32))(k_accept)
  usable = live & scores.valid
  accept_greedy = (scores.ids == stats.argmax[:, :k]) & (stats.lse[:, :k] > -jnp.inf)
  if plan.method == "token":
    accept_random = jnp.log(u) + scores.log_q < scores.log_p
    num_accepted = _num_accepted(jnp.where(greedy[:, None], accept_greedy, accept_random) & usable)
    log_w = None
  else:
    log_w = block.log_weights(scores.log_p, scores.log_q, usable)  # [B, K+1]
    r = block.residual_mass(logits, params, stats, draft_probs, scores.log_p, log_w, shards)
    h = block.stop_probs(jnp.exp(log_w), r, n)
    num_accepted = jnp.where(greedy, _num_accepted(accept_greedy & usable), block.num_accepted(h, u))
  # 4. One token from a full distribution, at the stopping position only.
  final_random = _draw_final(
    k_final, draft, logits, params, stats, scores, draft_probs, num_accepted, n, log_w, any_filtered, plan, shards
  )
  final = jnp.where(greedy, jnp.take_along_axis(stats.argmax, num_accepted[:, None], axis=1)[:, 0], final_random)
  return _emit(draft, num_accepted, final), dataclasses.replace(stats, chunk_log_mass=None)


def _with_logprobs(
  out: RejectionOutput, raw_logits, logits, params, stats, mode: str, greedy, shards=None
) -> RejectionOutput:
  """Adds the emitted tokens' log-probabilities (see `rejection_sample`'s `logprobs`); greedy: bool[B].

  raw_logits are the caller's; logits those the sampler used (after bias and penalties, if any).
  """
  processed = stats.token_log_probs(logits, out.token_ids, params.temperature, shards)
  lp = requested_log_probs(
    raw_logits if mode == "raw" else logits, out.token_ids, params, processed, mode, greedy, shards
  )
  emitted = jnp.arange(logits.shape[1])[None, :] < out.num_emitted[:, None]
  return dataclasses.replace(out, logprobs=jnp.where(emitted, lp, 0.0))


@functools.partial(jax.jit, static_argnames=("plan", "shards"))
def _rejection_sample(
  draft, logits, params, keys, draft_probs, n, penalty_state=None, token_bitmask=None, *, plan: SamplerPlan, shards=None
):
  program = functools.partial(_program, plan=plan, shards=shards)
  if shards is None:
    return program(draft, logits, params, keys, draft_probs, n, penalty_state, token_bitmask)
  # Each device runs the program on its rows and its slice of the vocabulary.
  rows = lambda a, ndim=1: P() if a is None else vocab_parallel.row_spec(shards, ndim)
  vocab = lambda a, ndim: P() if a is None else vocab_parallel.row_spec(shards, ndim, vocab_last=True)
  in_specs = (
    rows(draft),
    vocab(logits, 3),
    rows(params),
    rows(keys),
    vocab(draft_probs, 3),
    rows(n),
    vocab(penalty_state, 2),
    vocab(token_bitmask, 3),  # words split like the tokens they cover (V/m is a multiple of 32)
  )
  sharded = vocab_parallel.sharded_call(program, in_specs, rows(draft))
  return sharded(draft, logits, params, keys, draft_probs, n, penalty_state, token_bitmask)


def _if_all_rows_greedy(params, shards, greedy, general, *operands):
  """Run-time branch: an all-greedy batch skips the softmax path entirely."""
  return jax.lax.cond(~vocab_parallel.any_rows(~params.is_greedy, shards), greedy, general, *operands)


def _program(draft, logits, params, keys, draft_probs, n, penalty_state, token_bitmask, *, plan: SamplerPlan, shards):
  """The whole sampler on one device, or on this device's rows and vocabulary slice under `shards`."""
  interpret = jax.default_backend() != "gpu"
  if plan.kernels == "pallas" and plan.verifier == GREEDY_VERIFIER:  # n: None when every row has K drafts
    ids, num_accepted, num_emitted = fused.fused_greedy(draft, logits, n, interpret=interpret)
    return RejectionOutput(token_ids=ids, num_accepted=num_accepted, num_emitted=num_emitted)
  if plan.kernels == "pallas":
    ids, num_accepted, num_emitted = fused.fused_chain(
      draft,
      logits,
      params,
      keys,
      draft_probs,
      n,
      greedy_rows=plan.greedy_rows,
      no_filters=params.no_filters,
      method=plan.method,
      interpret=interpret,
    )
    return RejectionOutput(token_ids=ids, num_accepted=num_accepted, num_emitted=num_emitted)
  raw_logits = logits
  if plan.penalties:
    # Steps 1-3 of every position, position i counting drafts 0 .. i-1: a view, so that
    # every read of the logits applies them itself (fused) instead of reading a copy.
    logits = penalties.penalized_view(
      logits, params, penalty_state, draft, vocab_offset=None if shards is None else shards.offset()
    )
  if token_bitmask is not None:  # after steps 1-3, before temperature and the filters; read by every pass
    logits = masks.masked_view(logits, token_bitmask)
  b, k1 = logits.shape[:2]
  k = k1 - 1
  n = jnp.clip(n, 0, k)
  live = jnp.arange(k)[None, :] < n[:, None]
  zeros = jnp.zeros((b, k1), jnp.float32)
  no_stats = PositionStats(
    shift=zeros, thr=zeros, lse=zeros, argmax=jnp.zeros((b, k1), jnp.int32), redone=jnp.zeros((b, k1), jnp.bool_)
  )  # greedy rows need none
  general = functools.partial(
    _general, params=params, keys=keys, draft_probs=draft_probs, n=n, live=live, plan=plan, shards=shards
  )
  if plan.verifier == GREEDY_VERIFIER:
    out, stats = _greedy(draft, logits, live, shards), no_stats
  elif plan.verifier == GENERAL_VERIFIER:
    out, stats = general(draft, logits)
  else:
    out, stats = _if_all_rows_greedy(
      params, shards, lambda d, x: (_greedy(d, x, live, shards), no_stats), general, draft, logits
    )
  if plan.logprobs is None:
    return out
  # The static promises decide which rows count as greedy, as they do for the tokens.
  greedy = params.is_greedy if plan.greedy_rows == "per_row" else jnp.full((b,), plan.greedy_rows == "all")
  return _with_logprobs(out, raw_logits, logits, params, stats, plan.logprobs, greedy, shards)
