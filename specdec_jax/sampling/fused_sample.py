"""`sample_tokens` in Pallas kernels: the program `kernels="pallas"` runs (the default on a GPU).

The XLA program decides three things at run time for the whole batch: whether
any row filters (top-k/top-p), whether any row is greedy (the argmax rides
along) and whether any row's normaliser overflowed (the shifted redo). On a GPU
each decision is a host copy or a conditional command buffer, and at the
batches drafts are sampled at (B = 1 to 64) they cost more than the work. This
program decides per row, inside its kernels, and has at most three of them:

    1. `block_partials`: one read of the logits [B, V]; per block of tokens,
       the max, mass and first argmax (and the filter's candidates for rows
       whose top-k or top-p is on).
    2. (unless no_filters) `block_thresholds`: each filtering row's threshold,
       and its partials redone for the kept tokens; other rows return at once.
    3. `_sample_kernel`, grid (B, blocks): program (b, j) combines row b's
       partials, writes block j of its log-probabilities, and picks the row's
       block by the blocks' masses (Gumbel-max; every program of the row picks
       the same one). The program whose block was picked draws the token
       inside it (Gumbel-max again) and writes it: a two-stage draw from the
       whole row's distribution.

The random numbers come from the row's key inside the kernel
(`block_stats.threefry2x32`), so a row's token depends on its key and its
logits only. The distribution is the XLA program's; the random stream is not:
one key gives other (equally distributed) tokens than `kernels="xla"`. Greedy
rows take the argmax, first index on ties, as there.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from specdec_jax.sampling.block_stats import (
  DEFAULT_BLOCK,
  block_partials,
  block_thresholds,
  combine_partials,
  compiler_params,
  filter_candidates,
  gumbel_pick,
  key_words,
  load,
  pow2,
  processed_log_p,
  row_seed,
  store,
)
from specdec_jax.sampling.params import GREEDY_TEMPERATURE, SamplingParams

# The samplers' `kernels=` values (`sample_tokens`, `rejection_sample`).
KERNELS = ("auto", "xla", "pallas")
# Counter words of this program's random numbers (`rejection_sample`'s kernels use others).
_BLOCK, _TOKEN = (0x5A5A0001, 0x5A5A0002)


def pallas_uncovered(
  params: SamplingParams, logprobs: str | None, sharded: bool, *, greedy: bool = False, mask: bool = False
) -> str:
  """What of a sampler call the Pallas programs do not cover, in words; "" when they cover it all.

  Shared by `sample_tokens` and `rejection_sample` (`verify.fused`). greedy: an
  all-greedy program, which ignores min-p. mask: a token_bitmask is given.

  Example:
    >>> pallas_uncovered(SamplingParams.create(1.0), None, True)
    'a vocabulary split over devices'
  """
  missing = []
  if logprobs is not None:
    missing.append(f'logprobs="{logprobs}"')
  if params.has_logit_bias or params.has_penalties:
    missing.append("a logit bias or penalties")
  if params.min_p is not None and not greedy:
    missing.append("min-p")
  if sharded:
    missing.append("a vocabulary split over devices")
  if mask:
    missing.append("a token_bitmask")
  return ", ".join(missing)


class _Dims(NamedTuple):
  vocab: int
  block: int  # tokens per block
  blocks: int  # ceil(V / block)
  nbp: int  # blocks padded to a power of two
  filters: bool  # (shift, thr) per row is an input (else 0 and -inf: nothing filtered)
  fold: bool  # one key for the batch: row b's is fold_in(key, b), made in the kernel


def _sample_kernel(t_ref, words_ref, m_ref, mass_ref, first_ref, *refs, dims: _Dims):
  thresholds_ref, x_ref, logp_ref, token_ref = refs if dims.filters else (None, *refs)
  b, j = pl.program_id(0), pl.program_id(1)
  t_raw = t_ref[b]
  greedy = t_raw < GREEDY_TEMPERATURE
  t = jnp.where(greedy, 1.0, t_raw)
  blocks = jnp.arange(dims.nbp, dtype=jnp.int32)
  live = blocks < dims.blocks
  row = (b, pl.ds(0, dims.nbp))
  top, log_norm, argmax, log_mass = combine_partials(
    load(m_ref, row, live, -jnp.inf), load(mass_ref, row, live, 0.0), load(first_ref, row, live, 2**31 - 1), t
  )
  shift, thr = (thresholds_ref[b, 0], thresholds_ref[b, 1]) if dims.filters else (0.0, -jnp.inf)
  cols = j * dims.block + jnp.arange(dims.block, dtype=jnp.int32)
  in_vocab = cols < dims.vocab
  x = load(x_ref, (b, pl.ds(j * dims.block, dims.block)), in_vocab, -jnp.inf)
  log_p = processed_log_p(x, t, shift, thr, top, log_norm)
  some = log_norm > -jnp.inf  # a row with nothing above -inf has no distribution (all -inf, token 0)
  log_p = jnp.where(some, jnp.where(greedy, jnp.where(cols == argmax, 0.0, -jnp.inf), log_p), -jnp.inf)
  store(logp_ref, (b, pl.ds(j * dims.block, dims.block)), log_p, mask=in_vocab)
  seed = row_seed(words_ref, b, dims.fold)
  chosen = gumbel_pick(log_mass, blocks, live, seed, _BLOCK)

  @pl.when(j == chosen)
  def _():
    token = gumbel_pick(log_p, cols, in_vocab, seed, _TOKEN)
    store(token_ref, (pl.ds(b, 1),), jnp.where(greedy, argmax, jnp.where(some, token, 0))[None])


@functools.partial(jax.jit, static_argnames=("no_filters", "block", "candidates", "interpret"))
def fused_sample_tokens(
  logits,
  params: SamplingParams,
  keys,
  *,
  no_filters: bool,
  block: int = DEFAULT_BLOCK,
  candidates: int | None = None,
  interpret: bool = False,
):
  """`sample_tokens`' random path in at most three Pallas kernels; see the module docstring.

  Rows at a temperature below `GREEDY_TEMPERATURE` are greedy (their filters
  ignored). Covers params without min-p, a logit bias or penalties
  (`pallas_uncovered`).

  Args:
    logits: float[B, V]; params: SamplingParams of batch B (temperature, top_k, top_p read);
    keys: typed keys [B], or one typed key (row b then uses fold_in(key, b), as `row_keys`).
    no_filters: static promise that no row filters (top-k/top-p ignored; two kernels).
    block: static tokens per block (a power of two).
    candidates: static largest logits kept per block for the top-k/top-p search (a power of two; None:
      `block_stats.filter_candidates`).
    interpret: run the kernels in Pallas's interpreter (any backend).

  Returns:
    (tokens int32[B], log_probs f32[B, V]): log_probs is the distribution each
    token was drawn from (log one-hot for greedy rows, all -inf for a row with
    nothing above -inf, whose token is 0).

  Example:
    >>> tokens, log_probs = fused_sample_tokens(logits, SamplingParams.create(0.8, top_k=50), jax.random.key(0),
    ...                                         no_filters=False)
  """
  b, v = logits.shape
  blocks = pl.cdiv(v, block)
  words, fold = key_words(keys, b)
  temperature = params.temperature.astype(jnp.float32)
  dims = _Dims(vocab=v, block=block, blocks=blocks, nbp=pow2(blocks), filters=not no_filters, fold=fold)
  if dims.filters:
    filter_params = (params.top_k, params.top_p)
    cand_count = candidates or filter_candidates(blocks)
    m, mass, first, cand = block_partials(
      logits, temperature, None, filter_params, block=block, interpret=interpret, candidates=cand_count
    )
    thresholds, m, mass = block_thresholds(
      logits, temperature, *filter_params, m, mass, cand, positions=1, block=block, interpret=interpret
    )
    extra = (thresholds,)
  else:
    m, mass, first = block_partials(logits, temperature, block=block, interpret=interpret)
    extra = ()
  return pl.pallas_call(
    functools.partial(_sample_kernel, dims=dims),
    out_shape=(jax.ShapeDtypeStruct((b, v), jnp.float32), jax.ShapeDtypeStruct((b,), jnp.int32)),
    grid=(b, blocks),
    interpret=interpret,
    compiler_params=compiler_params(interpret),
    name="sampler_sample_tokens",
  )(temperature, words, m, mass, first, *extra, logits)[::-1]
