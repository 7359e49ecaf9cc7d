"""Float64 NumPy reference of the full processing order: logit bias, penalties, temperature, top-k, top-p, min-p.

Written from the contract (the module docstring of specdec_jax/sampling.py) and
sharing no code with `specdec_jax`: the obvious, slow, sort-based reading, one
position at a time. For one row at one position, with the *context* being the
prompt, the tokens generated so far and, inside a speculative round, the drafts
d_0 .. d_{i-1} before position i:

  1. x = logits + bias (a {token_id: bias} mapping);
  2. repetition penalty r on every token of the context (prompt or generated or
     earlier draft): x / r where x > 0, x * r otherwise;
  3. x -= frequency_penalty * n + presence_penalty * (n > 0), n = the token's count
     among the generated tokens and earlier drafts (the prompt is not counted);
  4. greedy (temperature < 1e-5): argmax of x, first index on ties. Random:
     x / T, keep the top_k largest (ties with the k-th kept), renormalise, keep
     the smallest most-likely set with mass >= top_p (ties with its last token
     kept), renormalise, keep tokens with probability >= min_p * the largest,
     renormalise.

NaN logits count as -inf (masked); +inf logits share all the mass (greedy takes
the first); a position with no logit above -inf has no distribution (all -inf).
Parameters are rounded to float32 first, as `SamplingParams` stores them.

The one NumPy reference of the processing step: tests/support/stats.py's
`reference_probs` applies `filtered_probs` row by row; `round_log_probs` gives
the per-position distributions of a speculative round, for tests of
`rejection_sample`.
"""

from __future__ import annotations

import numpy as np

GREEDY_TEMPERATURE = 1e-5  # the contract's: temperatures below it are greedy


def _f32(value) -> float:
  return float(np.float32(value))


def penalized_logits(
  logits,
  *,
  repetition_penalty=1.0,
  frequency_penalty=0.0,
  presence_penalty=0.0,
  bias=None,
  prompt_tokens=(),
  generated_tokens=(),
):
  """Steps 1-3 for one position: float64 [V].

  Args:
    logits: [V] floats.
    repetition_penalty, frequency_penalty, presence_penalty: floats (1, 0, 0 = off).
    bias: None or {token_id: bias} with ids in [0, V).
    prompt_tokens: the prompt's tokens (ids outside [0, V) are ignored).
    generated_tokens: the generated tokens of the context, earlier drafts
      included (ids outside [0, V) are ignored).

  Returns:
    float64 [V]: NaN stays NaN, +-inf stays +-inf.

  Example:
    >>> penalized_logits([1.0, -1.0], repetition_penalty=2.0, generated_tokens=[0, 1])   # [0.5, -2.0]
  """
  x = np.array(logits, np.float64)
  v = x.size
  for tid, b in (bias or {}).items():
    assert 0 <= tid < v, tid
    x[tid] += _f32(b)
  counts = np.zeros(v)
  for t in generated_tokens:
    if 0 <= t < v:
      counts[t] += 1
  in_context = counts > 0
  for t in prompt_tokens:
    if 0 <= t < v:
      in_context[t] = True
  r = _f32(repetition_penalty)
  for i in range(v):
    if in_context[i]:
      x[i] = x[i] / r if x[i] > 0 else x[i] * r
  for i in range(v):
    if counts[i] > 0:  # a count-0 token is left as it is (no NaN from inf - 0 * ...)
      x[i] -= _f32(frequency_penalty) * counts[i] + _f32(presence_penalty)
  return x


def filtered_probs(x, *, temperature, top_k=0, top_p=1.0, min_p=0.0):
  """Step 4 for one random position: float64 probabilities [V] of the (already penalised) logits x.

  Example:
    >>> filtered_probs(np.log([0.5, 0.3, 0.2]), temperature=1.0, min_p=0.5)   # [0.625, 0.375, 0.]
  """
  t = _f32(temperature)
  y = np.asarray(x, np.float64) / t
  y = np.where(np.isnan(y), -np.inf, y)
  v = y.size
  if np.any(y == np.inf):  # "this token": all +inf tokens share the mass (every filter keeps ties)
    keep = y == np.inf
    return keep / keep.sum()
  keep = y > -np.inf
  if not np.any(keep):
    return np.zeros(v)
  desc = np.sort(y[keep])[::-1]
  if 0 < top_k < v and top_k <= desc.size:
    keep &= y >= desc[top_k - 1]
  w = np.where(keep, np.exp(y - desc[0]), 0.0)
  p = w / w.sum()
  if top_p < 1.0:
    order = np.argsort(-y[keep], kind="stable")
    ys, cum = y[keep][order], np.cumsum(p[keep][order])
    first = min(int(np.sum(cum < _f32(top_p))), ys.size - 1)
    keep &= y >= ys[first]
    p = np.where(keep, p, 0.0)
    p = p / p.sum()
  if min_p > 0.0:
    keep &= p >= _f32(min_p) * p.max()
    p = np.where(keep, p, 0.0)
    p = p / p.sum()
  return p


def greedy_token(x) -> int:
  """First index of the largest value, NaN counted as -inf (0 for a row with nothing above -inf)."""
  y = np.where(np.isnan(x), -np.inf, np.asarray(x, np.float64))
  return int(np.argmax(y))


def log_softmax(x):
  """float64 log_softmax of [..., V], NaN as -inf, +inf sharing the mass; all -inf rows stay all -inf."""
  y = np.where(np.isnan(x), -np.inf, np.asarray(x, np.float64))
  out = np.full(y.shape, -np.inf)
  for idx in np.ndindex(y.shape[:-1]):
    row = y[idx]
    if np.any(row == np.inf):
      keep = row == np.inf
      out[idx] = np.where(keep, -np.log(keep.sum()), -np.inf)
    elif np.any(row > -np.inf):
      m = row.max()
      out[idx] = row - m - np.log(np.sum(np.exp(row - m)))
  return out


def processed_log_probs(
  logits,
  *,
  temperature,
  top_k=0,
  top_p=1.0,
  min_p=0.0,
  repetition_penalty=1.0,
  frequency_penalty=0.0,
  presence_penalty=0.0,
  bias=None,
  prompt_tokens=(),
  generated_tokens=(),
):
  """Log of the distribution one row samples from at one position: float64 [V], -inf for removed tokens.

  Random rows: steps 1-4. Greedy rows (temperature < 1e-5): log one-hot at the
  argmax of the penalised logits (what `sample_tokens` returns as log_probs).

  Example:
    >>> processed_log_probs(np.zeros(4), temperature=1.0, bias={3: 1.0}, min_p=0.5)   # only token 3 kept
  """
  x = penalized_logits(
    logits,
    repetition_penalty=repetition_penalty,
    frequency_penalty=frequency_penalty,
    presence_penalty=presence_penalty,
    bias=bias,
    prompt_tokens=prompt_tokens,
    generated_tokens=generated_tokens,
  )
  if _f32(temperature) < GREEDY_TEMPERATURE:
    out = np.full(x.shape, -np.inf)
    if np.any(np.where(np.isnan(x), -np.inf, x) > -np.inf):
      out[greedy_token(x)] = 0.0
    return out
  p = filtered_probs(x, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
  with np.errstate(divide="ignore"):
    return np.log(p)


def round_log_probs(logits, draft_tokens, *, generated_tokens=(), **options):
  """`processed_log_probs` at every position of a speculative round: float64 [K+1, V].

  Position i's context holds the prompt, `generated_tokens` and the drafts
  d_0 .. d_{i-1} (ids outside [0, V), e.g. -1 placeholders, count nowhere).

  Args:
    logits: [K+1, V] the target's logits of one row.
    draft_tokens: [K] the row's drafts.
    generated_tokens: tokens generated before the round.
    **options: the other keywords of `processed_log_probs` (temperature, ...).

  Example:
    >>> lp = round_log_probs(logits, [4, 4, -1], temperature=0.8, presence_penalty=0.5, prompt_tokens=[1, 2])
  """
  logits = np.asarray(logits)
  drafts = [int(d) for d in np.asarray(draft_tokens).reshape(-1)]
  assert logits.shape[0] == len(drafts) + 1, (logits.shape, drafts)
  return np.stack(
    [
      processed_log_probs(logits[i], generated_tokens=list(generated_tokens) + drafts[:i], **options)
      for i in range(logits.shape[0])
    ]
  )


def round_penalized_logits(logits, draft_tokens, *, generated_tokens=(), **options):
  """`penalized_logits` (steps 1-3) at every position of a round: float64 [K+1, V] (see `round_log_probs`)."""
  logits = np.asarray(logits)
  drafts = [int(d) for d in np.asarray(draft_tokens).reshape(-1)]
  return np.stack(
    [
      penalized_logits(logits[i], generated_tokens=list(generated_tokens) + drafts[:i], **options)
      for i in range(logits.shape[0])
    ]
  )
