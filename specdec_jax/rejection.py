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

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import sampling
from specdec_jax.sampling import SamplingParams

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
    penalty_state: sampling.PenaltyState | None = None,
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
      in position i's context (`sampling.apply_penalties`); greedy rows take
      the argmax of the penalised logits, and all_greedy programs stay free of
      exponentials and random numbers. "raw" log-probabilities stay those of
      the unmodified logits.

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
  b, k = _check_args(draft_token_ids, target_logits, params, draft_probs, num_draft_tokens, all_greedy, all_random)
  v = target_logits.shape[-1]
  params = sampling.penalty_params(params, penalty_state, b, v, "rejection_sample")
  if params.has_min_p:  # not wired into the one-pass statistics yet: refuse rather than ignore it
    raise ValueError("rejection_sample: params.min_p is not supported by rejection_sample yet (sample_tokens and "
                     "generate support it); build the params without min_p")
  if num_draft_tokens is None:
    num_draft_tokens = jnp.full((b,), k, jnp.int32)
  num_draft_tokens = jnp.asarray(num_draft_tokens)
  _check_values(draft_token_ids, num_draft_tokens, k, v)
  if draft_probs is not None:
    draft_probs = jnp.asarray(draft_probs)
  _check_float_values(target_logits, draft_probs, num_draft_tokens, k)
  if key is None:
    if not all_greedy:
      raise ValueError("rejection_sample: key is required unless all_greedy=True")
    keys = None
  else:
    keys = sampling.row_keys(key, b, "rejection_sample: key")
  return _rejection_sample(draft_token_ids.astype(jnp.int32), target_logits, params, keys, draft_probs,
                           num_draft_tokens.astype(jnp.int32), all_greedy=all_greedy, all_random=all_random,
                           logprobs=logprobs, method=method, penalty_state=penalty_state)


def _check_args(draft, logits, params, draft_probs, n, all_greedy, all_random):
  where = "rejection_sample"
  b, k1, _ = check_verifier_args(where, draft, logits, params, draft_probs, n, axis="K", probs_rows=0,
                                 count_name="num_draft_tokens")
  if all_greedy and all_random:
    raise ValueError(f"{where}: all_greedy and all_random cannot both be True")
  return b, k1 - 1


def check_verifier_args(where, draft, logits, params, draft_probs, count, *, axis, probs_rows, count_name):
  """Shapes and dtypes a verifier checks at trace time; returns (B, R, V), R = rows of target_logits.

  Shared by `rejection_sample` (axis "K": R = K+1, draft_probs [B, K, V]) and
  `tree_rejection_sample` (axis "N": R = N+1, draft_probs [B, N+1, V]).

  Args:
    where: the function's name, for the messages.
    draft, logits: draft_token_ids [B, R-1] and target_logits [B, R, V].
    params: SamplingParams of batch B.
    draft_probs: None or [B, R - 1 + probs_rows, V].
    count: None or an int [B] (num_draft_tokens, num_nodes), named `count_name`.
    axis: the name of draft_token_ids' second axis ("K" or "N").
    probs_rows: 0 when draft_probs has R - 1 rows, 1 when it has R.
  """
  if logits.ndim != 3:
    raise ValueError(f"{where}: target_logits must be [B, {axis}+1, V], got shape {logits.shape}")
  if not jnp.issubdtype(logits.dtype, jnp.floating):
    raise ValueError(f"{where}: target_logits must be a float array, got dtype {logits.dtype}")
  b, r, v = logits.shape
  if r < 1:
    raise ValueError(f"{where}: target_logits must have {axis}+1 >= 1 positions, got shape {logits.shape}")
  if draft.shape != (b, r - 1):
    raise ValueError(f"{where}: draft_token_ids must be [B, {axis}]=({b}, {r - 1}) to match target_logits "
                     f"{logits.shape}, got {draft.shape}")
  if not jnp.issubdtype(draft.dtype, jnp.integer):
    raise ValueError(f"{where}: draft_token_ids must be an integer array, got dtype {draft.dtype}")
  sampling.check_params(params, b, where)
  if draft_probs is not None:
    dp_shape, dp_dtype = jnp.shape(draft_probs), jnp.result_type(draft_probs)
    rows, rows_name = r - 1 + probs_rows, f"{axis}+1" if probs_rows else axis
    if dp_shape != (b, rows, v):
      raise ValueError(f"{where}: draft_probs must be [B, {rows_name}, V]=({b}, {rows}, {v}), got {dp_shape}")
    if not jnp.issubdtype(dp_dtype, jnp.floating):
      raise ValueError(f"{where}: draft_probs must be a float array, got dtype {dp_dtype}")
  if count is not None:
    n_shape, n_dtype = jnp.shape(count), jnp.result_type(count)
    if n_shape != (b,):
      raise ValueError(f"{where}: {count_name} must be [B]=({b},), got {n_shape}")
    if not jnp.issubdtype(n_dtype, jnp.integer):
      raise ValueError(f"{where}: {count_name} must be an integer array, got dtype {n_dtype}")
  return b, r, v


def _check_values(draft, n, k, v):
  """Range checks for concrete (eager) inputs; skipped under jit."""
  if isinstance(n, jax.core.Tracer) or isinstance(draft, jax.core.Tracer):
    return
  n_np = np.asarray(n)
  if np.any((n_np < 0) | (n_np > k)):
    raise ValueError(f"rejection_sample: num_draft_tokens must be in [0, K={k}], got {n_np}")
  d = np.asarray(draft)
  live = np.arange(k)[None, :] < n_np[:, None]
  bad = live & ((d < 0) | (d >= v))
  if np.any(bad):
    raise ValueError(f"rejection_sample: draft_token_ids must be in [0, V={v}) at positions < num_draft_tokens; "
                     f"got {d[bad][:8]}")


def _check_float_values(logits, draft_probs, n, k):
  """Eager checks of target_logits and draft_probs at the positions that matter.

  Device reductions: only flags come back to the host. Skipped under jit.
  """
  if any(isinstance(a, jax.core.Tracer) for a in (logits, draft_probs, n)):
    return
  n = jnp.asarray(n)
  sampling.check_logits_values(logits, jnp.arange(k + 1)[None, :] <= n[:, None], "rejection_sample: target_logits")
  if draft_probs is None:
    return
  sampling.check_probs_values(draft_probs, jnp.arange(k)[None, :] < n[:, None], "rejection_sample: draft_probs",
                              "at positions < num_draft_tokens ([b, i])")


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
  return RejectionOutput(token_ids=ids.astype(jnp.int32), num_accepted=num_accepted.astype(jnp.int32),
                         num_emitted=(num_accepted + 1).astype(jnp.int32))


def _num_accepted(accept):
  """Length of the all-True prefix of accept [B, K]."""
  return jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)


def _greedy(draft, logits, live):
  """Argmax-only verification: no exponential, no random numbers."""
  t, best = sampling.greedy_argmax(logits)  # [B, K+1]; NaN counts as -inf
  # A position without any logit above -inf accepts nothing (its "argmax" 0 is no choice).
  num_accepted = _num_accepted((draft == t[:, :-1]) & (best[:, :-1] > -jnp.inf) & live)
  final = jnp.take_along_axis(t, num_accepted[:, None], axis=1)[:, 0]
  return _emit(draft, num_accepted, final)


def _block_log_weights(log_p, log_q, ok):
  """log w_j [B, K+1] of block verification: w_0 = 1, w_j = min(w_{j-1} p(d_{j-1}) / q(d_{j-1}), 1).

  log_p, log_q: [B, K] log-probabilities of the drafts under the target and the
  draft; ok: bool [B, K], False where a draft cannot be accepted (past n, or an
  id outside [0, V)). p(d) = 0 makes w 0 from there on; q(d) = 0 < p(d) makes
  the ratio infinite (w back to 1), as "token" accepts such a draft surely.
  """
  ratio = jnp.where(ok & (log_p > -jnp.inf), jnp.where(log_q > -jnp.inf, log_p - log_q, jnp.inf), -jnp.inf)
  log_w = [jnp.zeros(log_p.shape[:1], jnp.float32)]
  for j in range(log_p.shape[1]):  # K is small and static: a scan would cost more than it saves
    prev = log_w[-1]
    log_w.append(jnp.where(prev > -jnp.inf, jnp.minimum(prev + ratio[:, j], 0.0), -jnp.inf))
  return jnp.stack(log_w, axis=1)


def _block_stop_probs(w, residual_mass, n):
  """h_j [B, K] for j = 1..K (column j-1): the chance that the block stops at j, given it does not stop later.

  w: [B, K+1] block weights; residual_mass: [B, K+1], R_j for 1 <= j < n (other
  columns unused); n: [B] drafts per row.
  """
  k = w.shape[1] - 1
  j = jnp.arange(1, k + 1)[None, :]
  w_j, r_j = w[:, 1:], residual_mass[:, 1:]
  inner = jnp.where(r_j > 0, r_j / (r_j + (1.0 - w_j)), 0.0)
  return jnp.where(j < n[:, None], inner, jnp.where(j == n[:, None], w_j, 0.0))


def _block_num_accepted(h, u):
  """tau [B]: the largest j in 1..K with u_j <= h_j (column j-1), else 0."""
  j = jnp.arange(1, h.shape[1] + 1)[None, :]
  return jnp.max(jnp.where(u <= h, j, 0), axis=1, initial=0).astype(jnp.int32)


def _general(draft, logits, params, keys, draft_probs, n, live, need_argmax, method="token"):
  """Random rows (and greedy rows of a mixed batch) in one read of the logits.

  Without top-k/top-p, the one pass over the logits reduces chunks of about
  1024 tokens (`sampling.chunk_size`) to (max, sum of exps, argmax) per chunk.
  Row normalisers come from the chunk sums, and so does the recovered or bonus
  token of an n-gram draft: pick a chunk by its mass, then read only that
  chunk. With draft probabilities, or with filters, the stopping position's row
  is read once more.
  """
  b, k1, v = logits.shape
  k = k1 - 1
  greedy = params.is_greedy if need_argmax else jnp.zeros((b,), bool)
  no_argmax = jnp.zeros((b, k1), jnp.int32)
  c = sampling.chunk_size(v)
  chunked = v % c == 0  # else reshaping into chunks would copy the logits
  n_ch = v // c if chunked else 1
  # Scaling happens inside each consumer (reductions, gathers) so it fuses there:
  # a scaled copy passed into lax.cond would be materialised, tripling the traffic.
  scale = lambda x: sampling.scale_logits(x, params.temperature)

  def plain_stats(raw, with_argmax):
    # Greedy rows are scaled by 1, so the argmax of the scaled logits is theirs.
    x = scale(raw)
    if not chunked:
      stats = sampling.max_and_sumexp(x, with_argmax=with_argmax)
      lse = stats[0] + jnp.log(stats[1])
      return lse, (stats[2] if with_argmax else no_argmax), jnp.zeros((b, k1, 1), jnp.float32)
    stats = sampling.max_and_sumexp(x.reshape(b, k1, n_ch, c), with_argmax=with_argmax)  # [B, K+1, n]
    m_c, s_c = stats[0], stats[1]
    chunk_logw = jnp.where(s_c > 0, m_c + jnp.log(s_c), -jnp.inf)
    lse = jax.nn.logsumexp(chunk_logw, axis=-1)
    am = no_argmax
    if with_argmax:  # first chunk holding the max, first index inside it
      ch = jnp.argmax(m_c, axis=-1)
      am = (ch * c + jnp.take_along_axis(stats[2], ch[..., None], axis=-1)[..., 0]).astype(jnp.int32)
    return lse, am, chunk_logw

  def plain(raw):
    no_thr = jnp.full((b, k1), -jnp.inf, jnp.float32)
    if not need_argmax:
      return (no_thr,) + plain_stats(raw, False)
    # The argmax rides along in the same pass, but only when some row is greedy.
    return (no_thr,) + jax.lax.cond(jnp.any(greedy), lambda r: plain_stats(r, True),
                                    lambda r: plain_stats(r, False), raw)

  def filtered(raw):
    thr, lse = sampling.threshold_and_lse(raw, params.temperature, params.top_k, params.top_p)
    am = no_argmax
    if need_argmax:  # one more read of the logits, only if some row is greedy
      am = jax.lax.cond(jnp.any(greedy), lambda r: sampling.greedy_argmax(r)[0], lambda r: no_argmax, raw)
    return thr, lse, am, jnp.full((b, k1, n_ch), -jnp.inf, jnp.float32)

  # thr: keep iff x >= thr, lse: log normaliser of the kept set, am: argmax  [B, K+1];
  # chunk_logw: log mass of each chunk [B, K+1, n] (unfiltered only).
  # Under all_random a zero-temperature row is random too, so its filters count
  # (else its output would depend on whether a neighbour filters).
  filters_on = ((params.top_k > 0) & (params.top_k < v) | (params.top_p < 1.0)) & ~greedy
  any_filtered = jnp.any(filters_on)
  thr, lse, am, chunk_logw = jax.lax.cond(any_filtered, filtered, plain, logits)
  # Rows whose one-pass lse is not finite (overflow of x / T, +inf logits, all masked)
  # are redone on logits shifted by their max; only they get a nonzero shift, so the
  # other rows' values stay as computed. chunk_logw is not redone: those rows draw
  # from their full stopping row instead (row_draw).
  redone = ~jnp.isfinite(lse)  # [B, K+1]
  shift, thr, lse = sampling.shift_non_finite_rows(
      logits, params.temperature, jnp.where(filters_on, params.top_k, 0), jnp.where(filters_on, params.top_p, 1.0),
      thr, lse)
  nonempty = lse > -jnp.inf  # False: no logit above -inf at that position

  # Acceptance, in log space: accept d_i iff log u + log q_i(d_i) < log p_i(d_i).
  valid = (draft >= 0) & (draft < v)
  safe = jnp.where(valid, draft, 0)  # never read out of bounds
  x_d = sampling.scale_logits(jnp.take_along_axis(logits[:, :k], safe[..., None], axis=-1), params.temperature,
                              shift[:, :k])[..., 0]
  log_p = jnp.where((x_d >= thr[:, :k]) & nonempty[:, :k], x_d - lse[:, :k], -jnp.inf)
  if draft_probs is None:
    log_q = jnp.zeros_like(log_p)  # one-hot draft distribution
  else:
    q_d = sampling.valid_probs(jnp.take_along_axis(draft_probs[:, :k], safe[..., None], axis=-1)[..., 0])
    log_q = jnp.log(q_d)  # q = 0 -> -inf: accepted iff p > 0 (the ratio is infinite)

  def block_residual_mass(log_w):
    """R_j = sum_x max(w_j p_j(x) - q_j(x), 0), [B, K+1]; only columns 1..K-1 are computed (the rest 0)."""
    if draft_probs is None:  # q_j one-hot at d_j: R_j = w_j (1 - p_j(d_j)), from the gathered p_j(d_j)
      r = jnp.exp(log_w[:, :k]) * (1.0 - jnp.exp(log_p))
    elif k > 1:  # one more read of positions 1..K-1 (logits and draft probs)
      sl = slice(1, k)
      x = sampling.scale_logits(logits[:, sl], params.temperature, shift[:, sl])
      logp_all = jnp.where((x >= thr[:, sl, None]) & nonempty[:, sl, None], x - lse[:, sl, None], -jnp.inf)
      q = sampling.valid_probs(draft_probs[:, sl])
      r = jnp.sum(jnp.maximum(jnp.exp(logp_all + log_w[:, sl, None]) - q, 0.0), axis=-1)
      r = jnp.concatenate([jnp.zeros((b, 1), jnp.float32), r], axis=1)
    else:
      r = jnp.zeros((b, k), jnp.float32)
    return jnp.concatenate([r, jnp.zeros((b, 1), jnp.float32)], axis=1)

  k_accept, k_final = jax.vmap(lambda kk: tuple(jax.random.split(kk)), out_axes=(0, 0))(keys)
  u = jax.vmap(lambda kk: jax.random.uniform(kk, (k,), jnp.float32))(k_accept)
  accept_random = jnp.log(u) + log_q < log_p
  accept_greedy = (safe == am[:, :k]) & nonempty[:, :k]
  if method == "token":
    accept = jnp.where(greedy[:, None], accept_greedy, accept_random) & live & valid
    num_accepted = _num_accepted(accept)
    log_w = None
  else:
    log_w = _block_log_weights(log_p, log_q, live & valid)  # [B, K+1]
    h = _block_stop_probs(jnp.exp(log_w), block_residual_mass(log_w), n)
    num_accepted = jnp.where(greedy, _num_accepted(accept_greedy & live & valid), _block_num_accepted(h, u))

  # The one token drawn from a full distribution: at the stopping position only.
  s = num_accepted
  thr_s = jnp.take_along_axis(thr, s[:, None], axis=1)
  lse_s = jnp.take_along_axis(lse, s[:, None], axis=1)
  shift_s = jnp.take_along_axis(shift, s[:, None], axis=1)[:, 0]
  rejected = (s < n)[:, None]
  s_draft = jnp.minimum(s, max(k - 1, 0))
  d_s = jnp.take_along_axis(draft, s_draft[:, None], axis=1)  # [B, 1]; may be out of range

  def stop_log_weights(residual):
    """[B, V] log-weights at the stopping position, built from the inputs (fusible)."""
    row = sampling.scale_logits(jnp.take_along_axis(logits, s[:, None, None], axis=1)[:, 0], params.temperature,
                                shift_s)
    logp_row = jnp.where((row >= thr_s) & (lse_s > -jnp.inf), row - lse_s, -jnp.inf)
    if not residual or k == 0:
      return logp_row
    if draft_probs is None:
      # p - onehot(d), clipped at 0, is p with d removed (an id outside [0, V) removes nothing).
      return jnp.where(rejected & (jnp.arange(v)[None, :] == d_s), -jnp.inf, logp_row)
    q_row = sampling.valid_probs(jnp.take_along_axis(draft_probs, s_draft[:, None, None], axis=1)[:, 0])
    if log_w is not None:  # block: the residual is max(w_s p_s - q_s, 0)
      logp_row = logp_row + jnp.take_along_axis(log_w, s[:, None], axis=1)
    # Masked and filtered tokens stay out without a select: there exp(logp_row) = 0
    # and q_row >= 0 (valid_probs), so the residual is log(0) = -inf.
    return jnp.log(jnp.maximum(jnp.exp(logp_row) - jnp.where(rejected, q_row, 0.0), 0.0))

  def row_draw():
    """Reads the stopping position's row (and draft probs): filtered or with draft_probs."""
    tok, empty = sampling.categorical_with_empty(k_final, stop_log_weights(True))
    # A residual with no mass (possible only through rounding) falls back to p. The
    # check comes from the draw's own chunk masses; the redraw runs only if needed.
    return jax.lax.cond(
        jnp.any(empty),
        lambda: jnp.where(empty, sampling.categorical_from_log_weights(k_final, stop_log_weights(False)), tok),
        lambda: tok)

  def chunk_draw():
    """Unfiltered, no draft probs: chunk masses are known; read one chunk of c tokens."""
    log_pc = jnp.take_along_axis(chunk_logw, s[:, None, None], axis=1)[:, 0] - lse_s  # [B, n]
    remove = jnp.zeros((b, 1), bool)
    if k > 0:
      # Residual p - onehot(d): take p(d) off d's chunk. A chunk left with (almost)
      # nothing but d's own mass is emptied, so rounding never picks a chunk whose
      # other tokens are impossible; an empty residual falls back to p.
      remove = rejected & (d_s >= 0) & (d_s < v)
      p_d = jnp.exp(jnp.take_along_axis(log_p, s_draft[:, None], axis=1))
      w = jnp.exp(log_pc)
      w_res = w - jnp.where(remove & (jnp.arange(n_ch)[None, :] == d_s // c), p_d, 0.0)
      w_res = jnp.where(w_res > 1e-6 * w, w_res, 0.0)
      remove = remove & jnp.any(w_res > 0, axis=-1, keepdims=True)
      log_pc = jnp.where(remove, jnp.log(w_res), log_pc)

    def chunk_log_weights(ch):  # [B] -> [B, c]: the chosen chunk of the stopping row
      inside = jnp.take_along_axis(jnp.take_along_axis(logits, s[:, None, None], axis=1).reshape(b, n_ch, c),
                                   ch[:, None, None], axis=1)[:, 0]
      ids = ch[:, None] * c + jnp.arange(c)[None, :]
      return jnp.where(remove & (ids == d_s), -jnp.inf, scale(inside))

    return sampling.draw_from_chunks(k_final, log_pc, chunk_log_weights)

  if chunked and draft_probs is None:
    # Rows redone by the shift have no chunk masses: they draw from their full row.
    redone_s = jnp.take_along_axis(redone, s[:, None], axis=1)[:, 0]
    mixed_draw = lambda: jax.lax.cond(jnp.any(redone_s), lambda: jnp.where(redone_s, row_draw(), chunk_draw()),
                                      chunk_draw)
    final_random = jax.lax.cond(any_filtered, row_draw, mixed_draw)
  else:
    final_random = row_draw()
  final_random = jnp.where(lse_s[:, 0] > -jnp.inf, final_random, 0)  # nothing to draw from: token 0, as greedy
  final_greedy = jnp.take_along_axis(am, s[:, None], axis=1)[:, 0]
  final = jnp.where(greedy, final_greedy, final_random)
  # (shift, thr, lse) describe each position's processed distribution: what "processed" log-probs read.
  return _emit(draft, num_accepted, final), (shift, thr, lse)


def _with_logprobs(out: RejectionOutput, raw_logits, logits, params, stats, mode: str, greedy) -> RejectionOutput:
  """Adds the emitted tokens' log-probabilities (see `rejection_sample`'s `logprobs`); greedy: bool[B].

  raw_logits are the caller's; logits those the sampler used (after bias and penalties, if any).
  """
  processed = sampling.token_log_probs(logits, out.token_ids, params.temperature, *stats)
  lp = sampling.requested_log_probs(raw_logits if mode == "raw" else logits, out.token_ids, params, processed, mode,
                                    greedy)
  emitted = jnp.arange(logits.shape[1])[None, :] < out.num_emitted[:, None]
  return dataclasses.replace(out, logprobs=jnp.where(emitted, lp, 0.0))


@functools.partial(jax.jit, static_argnames=("all_greedy", "all_random", "logprobs", "method"))
def _rejection_sample(draft, logits, params, keys, draft_probs, n, *, all_greedy, all_random, logprobs=None,
                      method="token", penalty_state=None):
  raw_logits = logits
  if params.has_logit_bias or params.has_penalties:
    # Steps 1-3 of every position, position i counting drafts 0 .. i-1 (fused elementwise work).
    logits = sampling.apply_penalties(logits, params, penalty_state, draft)
  b, k1, v = logits.shape
  k = k1 - 1
  n = jnp.clip(n, 0, k)
  live = jnp.arange(k)[None, :] < n[:, None]
  no_stats = tuple(jnp.zeros((b, k1), jnp.float32) for _ in range(3))  # greedy rows need none
  if all_greedy:
    out, stats = _greedy(draft, logits, live), no_stats
  else:
    general = functools.partial(_general, params=params, keys=keys, draft_probs=draft_probs, n=n, live=live,
                                method=method)
    if all_random:
      out, stats = general(draft, logits, need_argmax=False)
    else:
      # Run-time shortcut: an all-greedy batch skips the softmax path entirely.
      out, stats = jax.lax.cond(jnp.all(params.is_greedy),
                                lambda d, x: (_greedy(d, x, live), no_stats),
                                lambda d, x: general(d, x, need_argmax=True),
                                draft, logits)
  if logprobs is None:
    return out
  # The static promises decide which rows count as greedy, as they do for the tokens.
  greedy = jnp.full((b,), all_greedy) if all_greedy or all_random else params.is_greedy
  return _with_logprobs(out, raw_logits, logits, params, stats, logprobs, greedy)
