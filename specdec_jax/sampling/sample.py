"""Plain (non-speculative) sampling of one token per row, and the processed distribution.

`sample_tokens` is the sampler of `generate` and of draft models; `process_logits`
gives the log-probabilities of the distribution it draws random rows from (steps
1-4 of the processing order in `specdec_jax.sampling`'s docstring).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from specdec_jax.mesh import auto_axes_if_explicit
from specdec_jax.sampling.draws import (
  categorical_with_empty,
)
from specdec_jax.sampling.fused_sample import KERNELS, fused_sample_tokens, pallas_uncovered
from specdec_jax.sampling.masks import check_bitmask, masked_view
from specdec_jax.sampling.params import (
  SamplingParams,
  check_logits_values,
  check_params,
  check_promises,
  row_keys,
  single_key,
)
from specdec_jax.sampling.penalties import (
  PenaltyState,
  penalized_view,
  penalty_params,
)
from specdec_jax.sampling.reductions import (
  greedy_argmax,
)
from specdec_jax.sampling.stats import log_probs_from_stats, position_stats, requested_log_probs
from specdec_jax.sampling.vocab_parallel import row_spec, sharded_call, shards_for, take_vocab


def process_logits(logits: jax.Array, params: SamplingParams, penalty_state: PenaltyState | None = None) -> jax.Array:
  """Log-probabilities of the processed distribution (steps 1-4), every row taken as random.

  Steps 1-3 (the logit bias and the penalties, `apply_penalties`) apply when
  params carry them, with `penalty_state` as the context; then temperature,
  top-k, top-p and min-p (step 4). The result is the distribution
  `sample_tokens` draws a random row's token from. Without bias and penalty
  fields the program is the step-4-only one. min-p is read from
  `params.min_p` (None: off, and the program is the one without min-p).
  Greedy rows are processed as random rows at temperature 1 (with their own
  filters); callers pick argmax for them.
  NaN logits count as -inf, +inf logits share all the mass, and a row with no
  logit above -inf comes out all -inf (see the module docstring).

  Args:
    logits: [B, ..., V], any float dtype ([B, V] or [B, K+1, V] when params
      carry a bias or penalties; positions of a round count no drafts).
    params: SamplingParams of batch B.
    penalty_state: PenaltyState of batch B and vocabulary V, needed when params
      carry penalties, unless they are concrete and all neutral (as for `sample_tokens`).

  Returns:
    f32[B, ..., V] normalised log-probabilities, -inf for removed tokens.

  Raises:
    ValueError: penalties without a penalty_state, or concrete logit-bias ids >= V.

  Example:
    >>> logp = process_logits(jnp.zeros((2, 5)), SamplingParams.create(1.0, top_k=2))
    >>> logp = process_logits(logits, SamplingParams.create(0.8, repetition_penalty=1.2), state)   # steps 1-4
  """
  x = logits
  if params.has_logit_bias or params.has_penalties:
    params = penalty_params(params, penalty_state, logits.shape[0], logits.shape[-1], "process_logits")
    if params.has_logit_bias or params.has_penalties:  # (neutral concrete penalties were dropped)
      x = penalized_view(logits, params, penalty_state)
  return log_probs_from_stats(x, params, position_stats(x, params))


def sample_tokens(
  logits: jax.Array,
  params: SamplingParams,
  key,
  *,
  all_greedy: bool = False,
  no_filters: bool = False,
  penalty_state: PenaltyState | None = None,
  logprobs: str | None = None,
  kernels: str = "auto",
  token_bitmask=None,
):
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
    token_bitmask: int32 [B, ceil(V/32)] or None: the tokens each row may
      emit, bit v % 32 of word v // 32 (`sampling.masks`). Applied after steps
      1-3 and before temperature and the filters, like a -inf bias: a row
      draws from its law over the allowed tokens, renormalised; greedy rows
      take the argmax over them. A concrete row that allows no token (or none
      whose logit is above -inf) is a ValueError; under jit it emits token 0.
      The Pallas program does not cover it ("auto" takes XLA's).

  Returns:
    (tokens int32[B], log_probs f32[B, V]): log_probs is the log of the
    distribution each row's token was drawn from (log one-hot for greedy rows).
    With `logprobs`, a third value f32[B]: the tokens' log-probabilities.

  Raises:
    ValueError: for a bad shape, params or logprobs mode, penalties without a
      penalty_state, concrete logit-bias ids >= V, and for concrete logits
      holding a NaN or a row with no logit above -inf; for concrete params that
      contradict all_greedy (a temperature >= GREEDY_TEMPERATURE) or no_filters
      (a random row with top-k, top-p or min-p).

  Example:
    >>> tok, logp = sample_tokens(logits, SamplingParams.create([0.0, 1.0]), jax.random.key(0))
    >>> params = SamplingParams.create(0.8, min_p=0.05, repetition_penalty=1.1)
    >>> tok, logp, lp = sample_tokens(logits, params, key, penalty_state=state, logprobs="processed")
    >>> tok, logp = sample_tokens(logits, SamplingParams.create(1.0), key, no_filters=True)  # branch-free
    >>> tok, logp = sample_tokens(logits, SamplingParams.create(1.0, top_k=50), key, kernels="xla")  # XLA's program
  """
  where = "sample_tokens"
  if logits.ndim != 2:
    raise ValueError(f"{where}: logits must be [B, V], got shape {logits.shape}")
  b, v = logits.shape
  check_params(params, b, where)
  if logprobs not in (None, "raw", "processed"):
    raise ValueError(f"{where}: logprobs must be None, 'raw' or 'processed', got {logprobs!r}")
  check_logits_values(logits, None, f"{where}: logits")
  if token_bitmask is not None:
    token_bitmask = check_bitmask(token_bitmask, (b,), v, where, logits=logits)
  check_promises(where, params, v, all_greedy=all_greedy, no_filters=no_filters or params.no_filters)
  if no_filters:
    params = params.promise_no_filters()
  if kernels not in KERNELS:
    raise ValueError(f"{where}: kernels must be one of {KERNELS}, got {kernels!r}")
  steps = penalty_params(params, penalty_state, b, v, where)
  keys = None if all_greedy else row_keys(key, b)
  mask = token_bitmask is not None
  shards = shards_for(v, b, word_aligned=mask, kernels=kernels)
  uncovered = "" if all_greedy else pallas_uncovered(steps, logprobs, shards is not None, mask=mask)
  if kernels == "pallas" and uncovered:
    raise ValueError(f"{where}: kernels='pallas' does not cover {uncovered}; use kernels='xla' or 'auto'")
  on_gpu = jax.default_backend() == "gpu"
  if not all_greedy and not uncovered and (kernels == "pallas" or (kernels == "auto" and on_gpu)):
    single = single_key(key)  # one key: the kernel folds it with each row index itself
    keys = keys if single is None else single
    return fused_sample_tokens(logits, steps, keys, no_filters=steps.no_filters, interpret=not on_gpu)
  body = functools.partial(_sample_tokens, all_greedy=all_greedy, logprobs=logprobs)
  args = (logits, steps, keys, penalty_state, token_bitmask)
  if shards is None:  # (a vocabulary that does not split into whole chunks: XLA moves the data)
    return auto_axes_if_explicit(functools.partial(body, shards=None))(*args)
  # Each device samples from its rows and its slice of the vocabulary (see `rejection_sample`).
  rows, split = row_spec(shards, 1), row_spec(shards, 2, vocab_last=True)
  out_specs = (rows, split) + ((rows,) if logprobs else ())
  program = functools.partial(body, shards=shards)
  optional = lambda a: P() if a is None else split
  in_specs = (split, rows, P() if keys is None else rows, optional(penalty_state), optional(token_bitmask))
  return sharded_call(program, in_specs, out_specs)(*args)


def _sample_tokens(logits, params, keys, penalty_state, token_bitmask, *, all_greedy, logprobs, shards):
  """`sample_tokens` after its checks, on one device or on this device's rows and vocabulary slice."""
  b, v_here = logits.shape  # v_here: this device's tokens under shards
  offset = 0 if shards is None else shards.offset()
  # Without bias and penalty fields, x is the caller's array: the program is the plain one.
  x = logits
  if params.has_logit_bias or params.has_penalties:
    x = penalized_view(logits, params, penalty_state, vocab_offset=None if shards is None else offset)
  if token_bitmask is not None:  # after steps 1-3, before temperature and the filters
    x = masked_view(x, token_bitmask)
  greedy_tok, best = greedy_argmax(x, shards)
  # float32 constants: weakly typed Python floats would make it float64 under jax_enable_x64.
  one_hot = jnp.where(
    jax.nn.one_hot(greedy_tok - offset, v_here, dtype=jnp.bool_) & (best > -jnp.inf)[:, None],
    np.float32(0),
    np.float32(-np.inf),
  )
  if all_greedy:
    if logprobs is None:
      return greedy_tok, one_hot
    every = jnp.ones((b,), jnp.bool_)
    lp = requested_log_probs(
      logits if logprobs == "raw" else x, greedy_tok, params, jnp.zeros((b,), jnp.float32), logprobs, every, shards
    )
    return greedy_tok, one_hot, lp
  # Greedy rows' filters are ignored: their distribution is the one-hot below.
  logp = log_probs_from_stats(x, params, position_stats(x, params, greedy=params.is_greedy, chunks=True, shards=shards))
  # A row of all -inf draws index 0 (every Gumbel-perturbed weight is -inf), as greedy does.
  tok = categorical_with_empty(keys, logp, shards)[0]
  greedy = params.is_greedy
  tokens, dist = jnp.where(greedy, greedy_tok, tok), jnp.where(greedy[:, None], one_hot, logp)
  if logprobs is None:
    return tokens, dist
  processed = take_vocab(logp, tokens[:, None], shards)[:, 0]
  lp = requested_log_probs(logits if logprobs == "raw" else x, tokens, params, processed, logprobs, greedy, shards)
  return tokens, dist, lp
