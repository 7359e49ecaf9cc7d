"""The argument checks both verifiers share: shapes and dtypes at trace time, values when concrete.

`rejection_sample` (`chain`) and `tree_rejection_sample` (`tree`) call these at
their API boundary. Shape, dtype and batch errors raise at trace time; value
errors (ranges, non-finite entries, draft probabilities that do not sum to 1,
only for concrete arrays: under
jit the documented rules apply instead.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from specdec_jax.sampling.params import _is_concrete, check_logits_values, check_params, check_probs_values

# How far a concrete draft_probs row's sum may be from 1: float32 rounding over a large
# vocabulary, or the dtype's own rounding for narrower dtypes.
PROBS_SUM_TOLERANCE = 1e-3


class VerifierShape(NamedTuple):
  """The sizes a verifier's arguments agree on."""

  batch: int  # B
  rows: int  # R: positions of target_logits (K+1 or N+1)
  vocab: int  # V


def check_verifier_args(
  where, draft, logits, params, draft_probs, count, *, axis, probs_rows, count_name
) -> VerifierShape:
  """Shapes and dtypes a verifier checks at trace time; returns VerifierShape(B, R, V), R = rows of target_logits.

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
    raise ValueError(
      f"{where}: draft_token_ids must be [B, {axis}]=({b}, {r - 1}) to match target_logits "
      f"{logits.shape}, got {draft.shape}"
    )
  if not jnp.issubdtype(draft.dtype, jnp.integer):
    raise ValueError(f"{where}: draft_token_ids must be an integer array, got dtype {draft.dtype}")
  check_params(params, b, where)
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
  return VerifierShape(b, r, v)


def check_chain_values(where, draft, n, logits, draft_probs):
  """Value checks of concrete (eager) chain inputs, at positions < num_draft_tokens; skipped under jit.

  draft: int[B, K]; n: int[B] (num_draft_tokens); logits: float[B, K+1, V];
  draft_probs: float[B, K, V] or None. Device reductions: only flags come back to the host.
  """
  if not _is_concrete(draft, n):
    return
  k, v = draft.shape[1], logits.shape[-1]
  n_np = np.asarray(n)
  if np.any((n_np < 0) | (n_np > k)):
    raise ValueError(f"{where}: num_draft_tokens must be in [0, K={k}], got {n_np}")
  d = np.asarray(draft)
  live = np.arange(k)[None, :] < n_np[:, None]
  bad = live & ((d < 0) | (d >= v))
  if np.any(bad):
    raise ValueError(
      f"{where}: draft_token_ids must be in [0, V={v}) at positions < num_draft_tokens; got {d[bad][:8]}"
    )
  if not _is_concrete(logits, draft_probs):
    return
  n = jnp.asarray(n)
  check_logits_values(logits, jnp.arange(k + 1)[None, :] <= n[:, None], f"{where}: target_logits")
  if draft_probs is None:
    return
  used = jnp.arange(k)[None, :] < n[:, None]
  check_probs_values(draft_probs, used, f"{where}: draft_probs", "at positions < num_draft_tokens ([b, i])")
  check_probs_sum(draft_probs, used, f"{where}: draft_probs", "at positions < num_draft_tokens ([b, i])")


def check_probs_sum(probs, used, where: str, positions: str) -> None:
  """Eager check (skipped for tracers): every used row of probs sums to 1, within `PROBS_SUM_TOLERANCE`.

  Args:
    probs: float[..., V] draft probabilities (already checked finite and >= 0).
    used: bool[...] rows that matter.
    where: the argument's name for the message.
    positions: which rows are checked, in words, for the message.

  Example:
    >>> check_probs_sum(jnp.full((1, 2, 4), 0.25), jnp.ones((1, 2), bool), "f: draft_probs", "everywhere")
  """
  if not _is_concrete(probs):
    return
  dtype = jnp.result_type(probs)
  tol = max(PROBS_SUM_TOLERANCE, 4 * float(jnp.finfo(dtype).eps))
  total = jnp.sum(jnp.asarray(probs, jnp.float32), axis=-1)
  bad = np.asarray((jnp.abs(total - 1.0) > tol) & used)
  if bool(np.any(bad)):
    at = np.argwhere(bad)[:8]
    raise ValueError(
      f"{where} must sum to 1 (within {tol:g}) over the vocabulary {positions}; got sums "
      f"{np.asarray(total)[tuple(at.T)].tolist()} at {at.tolist()}"
    )
