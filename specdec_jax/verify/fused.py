"""`rejection_sample` in Pallas kernels: the program `kernels="pallas"` runs (the default on a GPU).

The XLA program (`chain`) reads the logits close to the memory floor at large
batch, but at the batches speculation runs at (B = 1 to 64) its time is its
number of kernels: random bits, gathers, small reductions and run-time
branches, each a microsecond or more. This program has at most four kernels
and no run-time branch outside them:

    1. `block_partials`: one read of target_logits [B, K+1, V]; per block of
       tokens, the max, mass and first argmax (and, for rows whose top-k or
       top-p is on, the block's largest logits: the filter's candidates).
    2. (unless no_filters) `block_thresholds`, grid (B*(K+1),): a row that
       filters nothing writes (0, -inf) and returns; a filtering row finds its
       top-k/top-p threshold from the candidates (or, rarely, its whole row)
       and redoes its partials for the kept tokens.
    3. (with draft probabilities) `_residual_kernel`, grid (B, blocks): the
       acceptance again, then block j's mass of the residual max(p_s - q_s, 0)
       at each row's stopping position s. Block verification
       (`_block_residual_kernel`) computes max(w_i p_i - q_i, 0) at every
       position i < n instead: their sums are the stop probabilities' R_i.
    4. `_draw_kernel`, grid (B,): each row combines its partials (normaliser,
       argmax, block masses), gathers its K draft logits (and draft
       probabilities), accepts or rejects them, picks a block by its mass and
       draws the recovered or bonus token inside it (two-stage Gumbel-max).

The random numbers come from the row's key inside the kernels
(`block_stats.threefry2x32`, counters per use), so a row's tokens depend on
its key and its inputs only. The distribution is the XLA program's; the
random stream is not, so the same key gives other (equally distributed)
tokens than `kernels="xla"`.
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
  open_uniform,
  pow2,
  processed_log_p,
  row_seed,
  store,
  threefry2x32,
)
from specdec_jax.sampling.params import GREEDY_TEMPERATURE, SamplingParams
from specdec_jax.sampling.reductions import greedy_argmax

_INT_MAX = 2**31 - 1
# Counter words (c0) of the kernels' random numbers, one per use; far from the small counters
# `jax.random` itself gives a key, so that a key reused there draws other numbers.
_ACCEPT, _BLOCK, _TOKEN = (0xA5A50001, 0xA5A50002, 0xA5A50003)


# A block whose residual keeps under this fraction of its mass (rounding of p - p(d)) counts as empty.
_EMPTY_BLOCK = 1e-6


class _Dims(NamedTuple):
  k: int  # drafts per row
  vocab: int
  block: int  # tokens per block
  blocks: int  # ceil(V / block)
  k1p: int  # K+1 padded to a power of two
  nbp: int  # blocks padded to a power of two
  draft_probs: bool
  all_random: bool  # no row is greedy (else temperature-0 rows are)
  filters: bool  # shift and thr are inputs (else 0 and -inf: nothing filtered)
  all_drafts: bool  # every row has K drafts (no num_draft_tokens input)
  fold: bool  # one key for the batch: row b's is fold_in(key, b), made in the kernels
  block_method: bool = False  # method "block" (block verification) instead of "token"


class _Row(NamedTuple):
  """Row b's scalars, read inside a kernel."""

  t: jax.Array  # f32: the temperature it samples at (1 for greedy rows)
  greedy: jax.Array  # bool
  n: jax.Array  # int32 drafts in [0, K]
  seed: tuple  # (uint32, uint32): its threefry key


class _Acceptance(NamedTuple):
  """One row's verdict, and what its stopping position s needs."""

  s: jax.Array  # int32: accepted drafts = the stopping position
  rejected: jax.Array  # bool: a draft was rejected at s (s < n)
  draft_s: jax.Array  # int32: the draft token at s (0 where none or out of range)
  valid_s: jax.Array  # bool: it is a token id in [0, V)
  log_p_s: jax.Array  # f32: log p_s(draft_s) under the processed target (-inf: removed)
  top_s: jax.Array  # f32: the largest kept logit at s (the frame of the masses)
  log_norm_s: jax.Array  # f32: log-normaliser at s in that frame (-inf: nothing above -inf)
  argmax_s: jax.Array  # int32: the argmax at s (greedy rows' token)
  log_mass_s: jax.Array  # f32[nbp]: each block's log-mass at s, in the same frame
  shift_s: jax.Array  # f32
  thr_s: jax.Array  # f32
  log_w_s: jax.Array  # f32: block verification's log w_s (0 for method "token")


def _row(b, refs, dims: _Dims) -> _Row:
  temperature = refs["temperature"][b]
  small = temperature < GREEDY_TEMPERATURE
  # all_random: never greedy, as a traced value (Triton cannot lower `~` of a literal, which `~greedy` would be)
  greedy = small & False if dims.all_random else small
  n = jnp.int32(dims.k) if dims.all_drafts else jnp.minimum(jnp.maximum(refs["n"][b], 0), dims.k)
  return _Row(jnp.where(small, 1.0, temperature), greedy, n, row_seed(refs["seed"], b, dims.fold))


def _shift_thr(refs, b, at, dims: _Dims):
  """(shift, thr) of row b at positions `at` (scalar or vector): 0 and -inf without filters."""
  if not dims.filters:
    return jnp.float32(0.0), jnp.float32(-jnp.inf)
  return refs["thresholds"][b, at, 0], refs["thresholds"][b, at, 1]


class _Scores(NamedTuple):
  """Row b's positions as vectors over 0..K (padded to k1p): their statistics and the drafts' scores."""

  top: jax.Array  # f32: the largest kept logit
  log_norm: jax.Array  # f32: log-normaliser in that frame (-inf: nothing above -inf)
  argmax: jax.Array  # int32
  shift: jax.Array  # f32 (or a scalar 0 without filters)
  thr: jax.Array  # f32 (or a scalar -inf)
  draft: jax.Array  # int32: draft i at position i (-1 at K and beyond)
  usable: jax.Array  # bool: draft i is a token id in [0, V) and i < n
  log_p: jax.Array  # f32: log p_i(d_i) under the processed target
  log_q: jax.Array  # f32: log q_i(d_i) (0 without draft probabilities)


def _scores(b, row: _Row, refs, dims: _Dims) -> _Scores:
  """Every position's statistics from the partials, and the K drafts' gathered logits (and draft probabilities).

  Vectorised over positions: a reduction inside a kernel synchronises its
  warps, so the few here are the ones the rule needs.
  """
  k, k1 = dims.k, dims.k + 1
  rows = jnp.arange(dims.k1p, dtype=jnp.int32)
  cols = jnp.arange(dims.nbp, dtype=jnp.int32)
  tile = (pl.ds(b * k1, dims.k1p), pl.ds(0, dims.nbp))
  ok = (rows[:, None] < k1) & (cols[None, :] < dims.blocks)
  top, log_norm, argmax, _ = combine_partials(
    load(refs["m"], tile, ok, -jnp.inf),
    load(refs["mass"], tile, ok, 0.0),
    load(refs["first"], tile, ok, _INT_MAX),
    row.t,
  )
  if dims.filters:
    shift = load(refs["thresholds"], (b, pl.ds(0, dims.k1p), jnp.int32(0)), rows < k1, 0.0)
    thr = load(refs["thresholds"], (b, pl.ds(0, dims.k1p), jnp.int32(1)), rows < k1, -jnp.inf)
  else:
    shift, thr = jnp.float32(0.0), jnp.float32(-jnp.inf)
  # The K drafts and their logits (and draft probabilities): scalar loads, set into vectors elementwise.
  draft = jnp.full((dims.k1p,), -1, jnp.int32)
  x = jnp.full((dims.k1p,), -jnp.inf, jnp.float32)
  q = jnp.ones((dims.k1p,), jnp.float32)
  for i in range(k):
    d = refs["draft"][b, i]
    idx = jnp.where((d >= 0) & (d < dims.vocab), d, 0)
    draft = jnp.where(rows == i, d, draft)
    x = jnp.where(rows == i, refs["logits"][b, i, idx].astype(jnp.float32), x)
    if dims.draft_probs:
      q = jnp.where(rows == i, refs["draft_probs"][b, i, idx].astype(jnp.float32), q)
  usable = (draft >= 0) & (draft < dims.vocab) & (rows < row.n)
  log_p = jnp.where(log_norm > -jnp.inf, processed_log_p(x, row.t, shift, thr, top, log_norm), -jnp.inf)
  log_q = jnp.log(jnp.where(jnp.isfinite(q) & (q > 0), q, 0.0))  # NaN, inf, negative count as 0
  return _Scores(top, log_norm, argmax, shift, thr, draft, usable, log_p, log_q)


def _at(vector, i):
  """vector[i] of a float vector for a traced i (a masked max: Triton has no dynamic indexing of registers)."""
  rows = jnp.arange(vector.shape[0], dtype=jnp.int32)
  return jnp.max(jnp.where(rows == i, vector, -jnp.inf))


def _block_log_weights(sc: _Scores, dims: _Dims):
  """log w_j over positions 0..K: w_0 = 1, w_j = min(w_{j-1} p(d_{j-1}) / q(d_{j-1}), 1) (`verify.block`'s rule)."""
  rows = jnp.arange(dims.k1p, dtype=jnp.int32)
  ratio = jnp.where(
    sc.usable & (sc.log_p > -jnp.inf), jnp.where(sc.log_q > -jnp.inf, sc.log_p - sc.log_q, jnp.inf), -jnp.inf
  )
  log_w = jnp.where(rows == 0, 0.0, -jnp.inf)
  prev = jnp.float32(0.0)
  for j in range(dims.k):  # K is small and static
    prev = jnp.where(prev > -jnp.inf, jnp.minimum(prev + _at(ratio, j), 0.0), -jnp.inf)
    log_w = jnp.where(rows == j + 1, prev, log_w)
  return log_w


def _block_stop(b, row: _Row, sc: _Scores, log_w, u, refs, dims: _Dims):
  """tau: the largest j in 1..n with u_j <= h_j, else 0 (block verification's accepted drafts)."""
  rows = jnp.arange(dims.k1p, dtype=jnp.int32)
  w = jnp.exp(log_w)
  if dims.draft_probs:  # R_j from the residual pass's block masses
    tile = (b, pl.ds(0, dims.k1p), pl.ds(0, dims.nbp))
    live = (rows[:, None] < dims.k) & (jnp.arange(dims.nbp, dtype=jnp.int32)[None, :] < dims.blocks)
    r = jnp.sum(load(refs["residual"], tile, live, 0.0), axis=1)
  else:  # q_j one-hot at d_j: R_j = w_j (1 - p_j(d_j))
    r = w * (1.0 - jnp.exp(sc.log_p))
  inner = jnp.where(r > 0, r / (r + (1.0 - w)), 0.0)
  h = jnp.where(rows < row.n, inner, jnp.where(rows == row.n, w, 0.0))
  return jnp.max(jnp.where((rows >= 1) & (rows <= dims.k) & (u <= h), rows, 0))


def _accept(b, row: _Row, refs, dims: _Dims) -> _Acceptance:
  """Row b's acceptance (the stopping position s) and what its draw reads at s."""
  k, k1 = dims.k, dims.k + 1
  rows = jnp.arange(dims.k1p, dtype=jnp.int32)
  cols = jnp.arange(dims.nbp, dtype=jnp.int32)
  sc = _scores(b, row, refs, dims)
  has_mass = sc.log_norm > -jnp.inf
  uniforms = lambda counters: open_uniform(threefry2x32(*row.seed, jnp.uint32(_ACCEPT), counters.astype(jnp.uint32))[0])
  first_stop = lambda ok: jnp.min(jnp.where(ok & sc.usable, dims.k1p, rows))  # n at the latest
  if dims.block_method:
    log_w = _block_log_weights(sc, dims)
    # h_j meets the uniform that decides draft j-1 under "token": with one draft the two rules draw alike.
    s = jnp.where(
      row.greedy,
      first_stop((sc.draft == sc.argmax) & has_mass),
      _block_stop(b, row, sc, log_w, uniforms(rows - 1), refs, dims),
    )
    log_w_s = jnp.where(row.greedy, 0.0, _at(log_w, s))
  else:
    s = first_stop(
      jnp.where(row.greedy, (sc.draft == sc.argmax) & has_mass, jnp.log(uniforms(rows)) + sc.log_q < sc.log_p)
    )
    log_w_s = jnp.float32(0.0)
  # Row s's own partials, read again (from cache) rather than picked out of the tile.
  at = (b * k1 + s, pl.ds(0, dims.nbp))
  live = cols < dims.blocks
  top_s, log_norm_s, argmax_s, log_mass_s = combine_partials(
    load(refs["m"], at, live, -jnp.inf),
    load(refs["mass"], at, live, 0.0),
    load(refs["first"], at, live, _INT_MAX),
    row.t,
  )
  shift_s, thr_s = _shift_thr(refs, b, s, dims)
  draft_s = refs["draft"][b, jnp.minimum(s, max(k - 1, 0))]
  valid_s = (draft_s >= 0) & (draft_s < dims.vocab) & (s < k)
  return _Acceptance(
    s=s,
    rejected=s < row.n,
    draft_s=jnp.where(valid_s, draft_s, 0),
    valid_s=valid_s,
    log_p_s=_at(sc.log_p, s),
    top_s=top_s,
    log_norm_s=log_norm_s,
    argmax_s=argmax_s,
    log_mass_s=log_mass_s,
    shift_s=shift_s,
    thr_s=thr_s,
    log_w_s=log_w_s,
  )


def _residual(log_p, log_w, q):
  """max(w p - q, 0) from log p, log w and loaded draft probabilities q (NaN, inf, negative count as 0)."""
  q = q.astype(jnp.float32)
  q = jnp.where(jnp.isfinite(q) & (q > 0), q, 0.0)
  return jnp.maximum(jnp.exp(log_p + log_w) - q, 0.0)


def _block_log_p(b, j, pos, t, shift, thr, top, log_norm, refs, dims: _Dims, read):
  """Token ids and log p of block j of row b's position `pos` (-inf: removed, masked, past V)."""
  cols = j * dims.block + jnp.arange(dims.block, dtype=jnp.int32)
  x = load(refs["logits"], (b, pos, pl.ds(j * dims.block, dims.block)), (cols < dims.vocab) & read, -jnp.inf)
  return cols, processed_log_p(x, t, shift, thr, top, log_norm)


def _stop_block_log_p(b, j, row: _Row, acc: _Acceptance, refs, dims: _Dims, read):
  """Token ids and log p_s of block j of row b's stopping row."""
  return _block_log_p(b, j, acc.s, row.t, acc.shift_s, acc.thr_s, acc.top_s, acc.log_norm_s, refs, dims, read)


def _residual_log_p(j, cols, log_p, b, pos, log_w, refs, dims: _Dims, read):
  """log max(w p - q, 0) over block j of position `pos` < K (draft probabilities; w = 1 for method "token")."""
  at = jnp.minimum(pos, dims.k - 1)
  q = load(refs["draft_probs"], (b, at, pl.ds(j * dims.block, dims.block)), (cols < dims.vocab) & read, 0.0)
  return jnp.log(_residual(log_p, log_w, q))


def _residual_kernel(*refs_and_out, names, dims: _Dims):
  refs = dict(zip(names, refs_and_out[:-1]))
  out_ref = refs_and_out[-1]
  b, j = pl.program_id(0), pl.program_id(1)
  row = _row(b, refs, dims)
  acc = _accept(b, row, refs, dims)
  read = acc.rejected & ~row.greedy  # only rejected random rows need their residual
  cols, log_p = _stop_block_log_p(b, j, row, acc, refs, dims, read)
  res = jnp.exp(_residual_log_p(j, cols, log_p, b, acc.s, acc.log_w_s, refs, dims, read))
  store(out_ref, (b, pl.ds(j, 1)), jnp.where(read, jnp.sum(jnp.where(cols < dims.vocab, res, 0.0)), 0.0)[None])


# Tokens a block-verification residual program holds per position at once: its positions of logits and
# draft probabilities as one 2-D tile of (positions x _RESIDUAL_TILE) values.
_RESIDUAL_TILE = 1024
# Below this many (row, block) programs the GPU has idle SMs: block verification's residual then takes one
# position per program instead of all of a row's.
_FEW_PROGRAMS = 128


def _pick(vector, pos):
  """vector[pos] for a vector of traced indices `pos` (a masked max per entry, as `_at`)."""
  idx = jnp.arange(vector.shape[0], dtype=jnp.int32)
  return jnp.max(jnp.where(pos[:, None] == idx[None, :], vector[None, :], -jnp.inf), axis=1)


def _block_residual_kernel(*refs_and_out, names, dims: _Dims, rows: int):
  """Block verification: block j's mass of max(w_i p_i - q_i, 0) at positions i < n of row b.

  Program (b, g, j) takes positions g * rows .. (g + 1) * rows - 1 as 2-D tiles
  (positions x tokens), so that their loads are issued together; `rows` is
  every position (k1p) when the batch gives the GPU enough programs, else 1.
  The sums over blocks are R_i (the stop probabilities); at the stopping
  position tau < n they are also the residual's block masses for the draw.
  """
  refs = dict(zip(names, refs_and_out[:-1]))
  out_ref = refs_and_out[-1]
  b, g, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  row = _row(b, refs, dims)
  sc = _scores(b, row, refs, dims)
  pos = g * rows + jnp.arange(rows, dtype=jnp.int32)
  read = (pos < dims.k) & (pos < row.n) & ~row.greedy  # positions whose residual the rule needs
  col = lambda v: _pick(v, pos)[:, None]  # per-position scalars against a tile's tokens
  log_w = col(_block_log_weights(sc, dims))
  top, log_norm = col(sc.top), col(sc.log_norm)
  shift, thr = (col(sc.shift), col(sc.thr)) if dims.filters else (sc.shift, sc.thr)
  tile = min(_RESIDUAL_TILE, dims.block)
  mass = jnp.zeros((rows,), jnp.float32)
  for start in range(0, dims.block, tile):  # static: block / tile tiles
    cols = j * dims.block + start + jnp.arange(tile, dtype=jnp.int32)
    at = (b, pl.ds(g * rows, rows), pl.ds(j * dims.block + start, tile))
    ok = read[:, None] & (cols < dims.vocab)[None, :]
    log_p = processed_log_p(load(refs["logits"], at, ok, -jnp.inf), row.t, shift, thr, top, log_norm)
    res = _residual(log_p, log_w, load(refs["draft_probs"], at, ok, 0.0))  # as the draw kernel rounds it
    mass = mass + jnp.sum(jnp.where(ok, res, 0.0), axis=1)
  out = (b, pl.ds(g * rows, rows), pl.ds(j, 1))
  store(out_ref, out, jnp.where(read, mass, 0.0)[:, None], mask=(pos < dims.k)[:, None])


def _draw_kernel(*refs_and_out, names, dims: _Dims):
  refs = dict(zip(names, refs_and_out[:-3]))
  ids_ref, accepted_ref, emitted_ref = refs_and_out[-3:]
  b = pl.program_id(0)
  row = _row(b, refs, dims)
  acc = _accept(b, row, refs, dims)
  blocks = jnp.arange(dims.nbp, dtype=jnp.int32)
  p_mass = acc.log_mass_s - acc.log_norm_s  # log of each block's probability under p_s
  if dims.draft_probs:
    at = (b, jnp.minimum(acc.s, dims.k - 1), pl.ds(0, dims.nbp)) if dims.block_method else (b, pl.ds(0, dims.nbp))
    res = load(refs["residual"], at, blocks < dims.blocks, 0.0)
    use_residual = acc.rejected & (jnp.max(res) > 0)  # an empty residual (rounding) draws from p_s
    log_mass = jnp.where(use_residual, jnp.log(res), p_mass)
  else:
    # p_s without the rejected draft: its probability comes off its block; a block left with
    # (almost) nothing but that token's own mass is emptied.
    w = jnp.exp(p_mass)
    w_res = w - jnp.where(blocks == acc.draft_s // dims.block, jnp.exp(acc.log_p_s), 0.0)
    w_res = jnp.where(w_res > _EMPTY_BLOCK * w, w_res, 0.0)
    use_residual = acc.rejected & acc.valid_s & (jnp.max(w_res) > 0)
    log_mass = jnp.where(use_residual, jnp.log(w_res), p_mass)
  chosen = gumbel_pick(log_mass, blocks, blocks < dims.blocks, row.seed, _BLOCK)
  read = ~row.greedy & (acc.log_norm_s > -jnp.inf)
  cols, log_p = _stop_block_log_p(b, chosen, row, acc, refs, dims, read)
  if dims.draft_probs:
    residual = _residual_log_p(chosen, cols, log_p, b, acc.s, acc.log_w_s, refs, dims, read & use_residual)
    log_w = jnp.where(use_residual, residual, log_p)
  else:
    log_w = jnp.where(use_residual & (cols == acc.draft_s), -jnp.inf, log_p)
  token = gumbel_pick(log_w, cols, cols < dims.vocab, row.seed, _TOKEN)
  final = jnp.where(row.greedy, acc.argmax_s, jnp.where(acc.log_norm_s > -jnp.inf, token, 0))
  pos = jnp.arange(dims.k1p, dtype=jnp.int32)
  drafts = load(refs["draft"], (b, pl.ds(0, dims.k1p)), pos < dims.k, 0)
  ids = jnp.where(pos < acc.s, drafts, jnp.where(pos == acc.s, final, -1))
  store(ids_ref, (b, pl.ds(0, dims.k1p)), ids, mask=pos < dims.k + 1)
  store(accepted_ref, (pl.ds(b, 1),), acc.s[None])
  store(emitted_ref, (pl.ds(b, 1),), acc.s[None] + 1)


def _call(kernel, inputs: dict, dims: _Dims, out_shape, grid, name: str, interpret: bool):
  """One of this module's kernels on `inputs` (the kernel reads them by name), with the compiler settings they share."""
  return pl.pallas_call(
    functools.partial(kernel, names=tuple(inputs), dims=dims),
    out_shape=out_shape,
    grid=grid,
    interpret=interpret,
    compiler_params=compiler_params(interpret),
    name=name,
  )(*inputs.values())


@functools.partial(jax.jit, static_argnames=("greedy_rows", "no_filters", "method", "block", "candidates", "interpret"))
def fused_chain(
  draft,
  logits,
  params: SamplingParams,
  keys,
  draft_probs,
  n,
  *,
  greedy_rows: str,
  no_filters: bool,
  method: str = "token",
  block: int = DEFAULT_BLOCK,
  candidates: int | None = None,
  interpret: bool = False,
):
  """`rejection_sample`'s verification (method "token" or "block") in Pallas kernels; see the module docstring.

  Args:
    draft: int32[B, K], K >= 1; logits: float[B, K+1, V]; params: SamplingParams (no min-p);
    keys: typed keys [B], or one typed key (row b then uses fold_in(key, b)); draft_probs: float[B, K, V] or None; n: int32[B] (clipped to [0, K]),
    or None for K drafts in every row.
    greedy_rows: "per_row" (temperature-0 rows are greedy) or "none" (all_random).
    no_filters: static promise that no row filters (no run-time branch at all).
    method: static; "token" or "block" (block verification, as `rejection_sample`'s).
    block: static tokens per block (a power of two).
    candidates: static largest logits kept per block for the top-k/top-p search (a power of two; None:
      `filter_candidates`).
    interpret: run the kernels in Pallas's interpreter (any backend).

  Returns:
    (token_ids int32[B, K+1], num_accepted int32[B], num_emitted int32[B]).

  Example:
    >>> ids, accepted, emitted = fused_chain(draft, logits, params, keys, None, None, greedy_rows="per_row",
    ...                                      no_filters=False)
  """
  b, k1, v = logits.shape
  k = k1 - 1
  blocks = pl.cdiv(v, block)
  seed, fold = key_words(keys, b)
  dims = _Dims(
    k=k,
    vocab=v,
    block=block,
    blocks=blocks,
    k1p=pow2(k1),
    nbp=pow2(blocks),
    draft_probs=draft_probs is not None,
    all_random=greedy_rows == "none",
    filters=not no_filters,
    all_drafts=n is None,
    fold=fold,
    block_method=method == "block",
  )
  temperature = params.temperature.astype(jnp.float32)
  inputs = dict(draft=draft, temperature=temperature, seed=seed, logits=logits)
  if n is not None:
    inputs["n"] = n
  flat = logits.reshape(b * k1, v)
  if dims.filters:
    filter_params = (params.top_k, params.top_p)
    m, mass, first, cand = block_partials(
      flat,
      temperature,
      None,
      filter_params,
      positions=k1,
      block=block,
      interpret=interpret,
      candidates=candidates or filter_candidates(blocks),
      all_random=dims.all_random,
    )
    thresholds, m, mass = block_thresholds(
      flat,
      temperature,
      *filter_params,
      m,
      mass,
      cand,
      positions=k1,
      block=block,
      all_random=dims.all_random,
      interpret=interpret,
    )
    inputs["thresholds"] = thresholds.reshape(b, k1, 2)
  else:
    m, mass, first = block_partials(flat, temperature, positions=k1, block=block, interpret=interpret)
  inputs["m"], inputs["mass"], inputs["first"] = m, mass, first
  if draft_probs is not None:
    inputs["draft_probs"] = draft_probs
  if draft_probs is not None:
    if dims.block_method:  # every position's residual
      rows = dims.k1p if b * blocks >= _FEW_PROGRAMS else 1
      kernel = functools.partial(_block_residual_kernel, rows=rows)
      shape, grid = (b, k, blocks), (b, pl.cdiv(k, rows), blocks)
    else:  # the stopping position's
      kernel, shape, grid = _residual_kernel, (b, blocks), (b, blocks)
    residual = jax.ShapeDtypeStruct(shape, jnp.float32)
    inputs["residual"] = _call(kernel, inputs, dims, residual, grid, "sampler_residual_masses", interpret)
  i32 = jax.ShapeDtypeStruct((b,), jnp.int32)
  ids = jax.ShapeDtypeStruct((b, k1), jnp.int32)
  return _call(_draw_kernel, inputs, dims, (ids, i32, i32), (b,), "sampler_accept_and_draw", interpret)


# ----------------------------------------------------------------------------
# Greedy verification that reads a bonus row only when it is used
# ----------------------------------------------------------------------------


def _greedy_verdict(b, refs, dims: _Dims):
  """(s, bonus, argmax_s): row b's accepted drafts from the argmax of positions 0..K-1, whether its token
  comes from the unread bonus row K (every one of n = K drafts accepted), and the argmax at s otherwise."""
  k = dims.k
  rows = jnp.arange(dims.k1p, dtype=jnp.int32)
  top = load(refs["best"], (b, pl.ds(0, dims.k1p)), rows < k, -jnp.inf)
  argmax = load(refs["argmax"], (b, pl.ds(0, dims.k1p)), rows < k, 0)
  draft = load(refs["draft"], (b, pl.ds(0, dims.k1p)), rows < k, -1)
  n = jnp.int32(k) if dims.all_drafts else jnp.minimum(jnp.maximum(refs["n"][b], 0), k)
  # A position without any logit above -inf accepts nothing (its "argmax" 0 is no choice).
  agree = (draft == argmax) & (top > -jnp.inf) & (rows < n)
  s = jnp.min(jnp.where(agree, dims.k1p, rows))
  return s, (s == k), jnp.max(jnp.where(rows == s, argmax, -_INT_MAX))


def _greedy_bonus_kernel(*refs_and_out, names, dims: _Dims):
  refs = dict(zip(names, refs_and_out[:-2]))
  m_ref, first_ref = refs_and_out[-2:]
  b, j = pl.program_id(0), pl.program_id(1)
  _, bonus, _ = _greedy_verdict(b, refs, dims)
  cols = j * dims.block + jnp.arange(dims.block, dtype=jnp.int32)
  x = load(
    refs["logits"], (b, jnp.int32(dims.k), pl.ds(j * dims.block, dims.block)), (cols < dims.vocab) & bonus, -jnp.inf
  )
  x = jnp.where(jnp.isnan(x.astype(jnp.float32)), -jnp.inf, x.astype(jnp.float32))
  m = jnp.max(x)
  store(m_ref, (b, pl.ds(j, 1)), m[None])
  store(first_ref, (b, pl.ds(j, 1)), jnp.min(jnp.where(x == m, cols, _INT_MAX))[None])


def _greedy_emit_kernel(*refs_and_out, names, dims: _Dims):
  refs = dict(zip(names, refs_and_out[:-3]))
  ids_ref, accepted_ref, emitted_ref = refs_and_out[-3:]
  b = pl.program_id(0)
  s, bonus, argmax_s = _greedy_verdict(b, refs, dims)
  blocks = jnp.arange(dims.nbp, dtype=jnp.int32)
  live = blocks < dims.blocks
  m = load(refs["bonus_m"], (b, pl.ds(0, dims.nbp)), live, -jnp.inf)
  first = load(refs["bonus_first"], (b, pl.ds(0, dims.nbp)), live, _INT_MAX)
  bonus_token = jnp.min(jnp.where(m == jnp.max(m), first, _INT_MAX))
  final = jnp.where(bonus, bonus_token, argmax_s)
  pos = jnp.arange(dims.k1p, dtype=jnp.int32)
  drafts = load(refs["draft"], (b, pl.ds(0, dims.k1p)), pos < dims.k, 0)
  ids = jnp.where(pos < s, drafts, jnp.where(pos == s, final, -1))
  store(ids_ref, (b, pl.ds(0, dims.k1p)), ids, mask=pos < dims.k + 1)
  store(accepted_ref, (pl.ds(b, 1),), s[None])
  store(emitted_ref, (pl.ds(b, 1),), s[None] + 1)


@functools.partial(jax.jit, static_argnames=("block", "interpret"))
def fused_greedy(draft, logits, n, *, block: int = DEFAULT_BLOCK, interpret: bool = False):
  """Greedy verification (`all_greedy=True`) that reads a bonus row only when it is used.

  XLA's argmax of positions 0..K-1 first (one variadic reduction, close to the
  memory floor; no exponential), then two Pallas kernels: a row's bonus row K is
  read only if it accepted all K drafts, so a batch that rejects early reads
  about K/(K+1) of the logits. The tokens are the XLA program's, bit for bit
  (first index on ties, NaN as -inf, a position with nothing above -inf accepts
  nothing and emits 0).

  Args:
    draft: int32[B, K], K >= 1; logits: float[B, K+1, V]; n: int32[B] (clipped to [0, K]) or None (K).
    block: static tokens per block (a power of two); interpret: Pallas's interpreter (any backend).

  Returns:
    (token_ids int32[B, K+1], num_accepted int32[B], num_emitted int32[B]).

  Example:
    >>> ids, accepted, emitted = fused_greedy(draft, logits, None)
  """
  b, k1, v = logits.shape
  k = k1 - 1
  blocks = pl.cdiv(v, block)
  dims = _Dims(
    k=k,
    vocab=v,
    block=block,
    blocks=blocks,
    k1p=pow2(k1),
    nbp=pow2(blocks),
    draft_probs=False,
    all_random=False,
    filters=False,
    all_drafts=n is None,
    fold=False,
  )
  inputs = dict(draft=draft, logits=logits)
  if n is not None:
    inputs["n"] = n
  argmax, best = greedy_argmax(logits[:, :k])  # [B, K] each; the slice fuses into the reduction's read
  inputs["argmax"], inputs["best"] = argmax, best.astype(jnp.float32)
  parts = (jax.ShapeDtypeStruct((b, blocks), jnp.float32), jax.ShapeDtypeStruct((b, blocks), jnp.int32))
  bonus = _call(_greedy_bonus_kernel, inputs, dims, parts, (b, blocks), "sampler_greedy_bonus", interpret)
  inputs["bonus_m"], inputs["bonus_first"] = bonus
  i32 = jax.ShapeDtypeStruct((b,), jnp.int32)
  ids = jax.ShapeDtypeStruct((b, k1), jnp.int32)
  return _call(_greedy_emit_kernel, inputs, dims, (ids, i32, i32), (b,), "sampler_greedy_emit", interpret)
