"""Block verification (Sun et al., ICLR 2025, arXiv 2403.10444): the helpers of `rejection_sample(method="block")`.

For a random row with n drafts (w_j, R_j, h_j are [B]):

    w_0 = 1,  w_j = min(w_{j-1} * p_{j-1}(d_{j-1}) / q_{j-1}(d_{j-1}), 1)    j = 1..n   (`log_weights`)
    R_j = sum_x max(w_j * p_j(x) - q_j(x), 0)                                       (`residual_mass`)
    h_j = R_j / (R_j + 1 - w_j)  for 1 <= j < n  (0 when R_j = 0),   h_n = w_n      (`stop_probs`)
    tau = the largest j in 1..n with u_j <= h_j, else 0                             (`num_accepted`)

The chain verifier (`chain`) gathers p_j(d_j) and q_j(d_j), calls these, and
draws the final token from normalise(max(w_tau * p_tau - q_tau, 0)).
"""

from __future__ import annotations

import jax.numpy as jnp

from specdec_jax.sampling import reductions
from specdec_jax.sampling.params import valid_probs
from specdec_jax.sampling.stats import PositionStats


def log_weights(log_p, log_q, ok):
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


def stop_probs(w, residual_mass, n):
  """h_j [B, K] for j = 1..K (column j-1): the chance that the block stops at j, given it does not stop later.

  w: [B, K+1] block weights; residual_mass: [B, K+1], R_j for 1 <= j < n (other
  columns unused); n: [B] drafts per row.
  """
  k = w.shape[1] - 1
  j = jnp.arange(1, k + 1)[None, :]
  w_j, r_j = w[:, 1:], residual_mass[:, 1:]
  inner = jnp.where(r_j > 0, r_j / (r_j + (1.0 - w_j)), 0.0)
  return jnp.where(j < n[:, None], inner, jnp.where(j == n[:, None], w_j, 0.0))


def num_accepted(h, u):
  """tau [B]: the largest j in 1..K with u_j <= h_j (column j-1), else 0."""
  j = jnp.arange(1, h.shape[1] + 1)[None, :]
  return jnp.max(jnp.where(u <= h, j, 0), axis=1, initial=0).astype(jnp.int32)


def residual_mass(logits, params, stats: PositionStats, draft_probs, log_p, log_w, shards=None):
  """R_j = sum_x max(w_j p_j(x) - q_j(x), 0), [B, K+1]; only columns 1..K-1 are computed (the rest 0).

  log_p: [B, K] log p_j(d_j) of the drafts (gathered by the caller); log_w: [B, K+1] from `log_weights`.
  """
  b, k = log_p.shape
  if draft_probs is None:  # q_j one-hot at d_j: R_j = w_j (1 - p_j(d_j)), from the gathered p_j(d_j)
    r = jnp.exp(log_w[:, :k]) * (1.0 - jnp.exp(log_p))
  elif k > 1:  # one more read of positions 1..K-1 (logits and draft probs)
    sl = slice(1, k)
    x = reductions.scale_logits(reductions.values(logits)[:, sl], params.temperature, stats.shift[:, sl])
    logp_all = jnp.where(
      (x >= stats.thr[:, sl, None]) & (stats.lse[:, sl, None] > -jnp.inf), x - stats.lse[:, sl, None], -jnp.inf
    )
    q = valid_probs(draft_probs[:, sl])
    r = reductions.sum_over_vocab(jnp.maximum(jnp.exp(logp_all + log_w[:, sl, None]) - q, 0.0), shards)
    r = jnp.concatenate([jnp.zeros((b, 1), jnp.float32), r], axis=1)
  else:
    r = jnp.zeros((b, k), jnp.float32)
  return jnp.concatenate([r, jnp.zeros((b, 1), jnp.float32)], axis=1)
