"""What both decoding loops carry and share: their outputs, the loop state, the start and the end.

`specdec_jax.loop.decoding` builds `generate` and `speculative_generate` from these
pieces; the kinds of draft (`specdec_jax.loop.draft_kinds`) and the tree round
(`specdec_jax.loop.tree_round`) read the same `LoopState`. `DecodeStats` and
`GenerateOutput` are the public API (re-exported by `specdec_jax.loop.decoding`
and `specdec_jax`); `LoopState` is the carry those internal modules share; the
functions below are the loops' own pieces.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from specdec_jax.mesh import constrain_rows
from specdec_jax.sampling.params import row_keys
from specdec_jax.sampling.penalties import PenaltyState
from specdec_jax.sampling.sample import sample_tokens
from specdec_jax.verify.chain import PLACEHOLDER_TOKEN_ID

__all__ = ["DecodeStats", "GenerateOutput", "LoopState"]


# ----------------------------------------------------------------------------
# Outputs and the loop's carry
# ----------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeStats:
  """Per-row counts of one generation, taken after truncation (EOS / max_new_tokens).

  Attributes:
    target_calls: int32[B] target forward passes that emitted tokens for the row,
      the prefill included.
    drafted: int32[B] draft tokens proposed for the row (K per round it took part in).
    accepted: int32[B] emitted tokens that were accepted drafts. In a round cut
      short by EOS or `max_new_tokens`, the last kept token counts as the target
      pass's own token, so `lengths == accepted + target_calls` always holds.
    accepted_per_position: int32[K] accepted drafts at draft position i, summed
      over rows and rounds (shape [0] for `generate`).
    usable_drafted: int32[B] drafts that could have been emitted: per round
      min(K, tokens the row could still emit - 1), and in a round cut short by
      EOS or the limit only the drafts before the cut. A run whose drafts are
      all right has `accepted == usable_drafted`, however short it is.
    reached_per_position: int32[K] rounds (summed over rows) that reached draft
      position i with room to emit it: drafts 0..i-1 were accepted, and the
      round was not cut before i.

  Example:
    >>> out.stats.mean_accepted_length, out.stats.acceptance_per_position
  """

  target_calls: jax.Array  # [B]
  drafted: jax.Array  # [B]
  accepted: jax.Array  # [B]
  accepted_per_position: jax.Array  # [K]
  usable_drafted: jax.Array  # [B]
  reached_per_position: jax.Array  # [K]

  @property
  def acceptance_rate(self) -> jax.Array:
    """sum(accepted) / sum(drafted), a scalar (0 when nothing was drafted).

    Drafts past a row's end count as proposed and not accepted, so short runs
    read low; `usable_acceptance_rate` does not.
    """
    drafted = jnp.sum(self.drafted)
    return jnp.sum(self.accepted) / jnp.maximum(drafted, 1)

  @property
  def usable_acceptance_rate(self) -> jax.Array:
    """sum(accepted) / sum(usable_drafted), a scalar: acceptance over drafts that could have been emitted."""
    return jnp.sum(self.accepted) / jnp.maximum(jnp.sum(self.usable_drafted), 1)

  @property
  def acceptance_per_position(self) -> jax.Array:
    """float32[K]: at draft position i, accepted / reached (0 where never reached).

    The conditional acceptance the field reports per position: of the rounds
    whose drafts 0..i-1 were all accepted, the fraction that accepted draft i.
    """
    reached = self.reached_per_position
    return jnp.where(reached > 0, self.accepted_per_position / jnp.maximum(reached, 1), 0.0).astype(jnp.float32)

  @property
  def mean_accepted_length(self) -> jax.Array:
    """Tokens emitted per target pass: sum(lengths) / sum(target_calls), a scalar."""
    calls = jnp.sum(self.target_calls)
    return (jnp.sum(self.accepted) + calls) / jnp.maximum(calls, 1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GenerateOutput:
  """What `generate` and `speculative_generate` return.

  Attributes:
    tokens: int32[B, max_new_tokens] generated tokens (the prompt excluded), then
      PLACEHOLDER_TOKEN_ID (-1) after the row's end.
    lengths: int32[B] generated tokens per row (an EOS that ended the row included).
    stats: DecodeStats.
    logprobs: f32[B, max_new_tokens] with `logprobs=...`, else None: each
      generated token's log-probability under the target (0 after the row's end).
  """

  tokens: jax.Array  # [B, max_new_tokens]
  lengths: jax.Array  # [B]
  stats: DecodeStats
  logprobs: jax.Array | None = None  # [B, max_new_tokens]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopState:
  """The carry of both decoding loops.

  Attributes:
    tokens: int32[B, S] every row's context (prompt, then generated tokens);
      slots at or past `length` hold junk or -1.
    length: int32[B] context length L (prompt plus generated tokens).
    done: bool[B] the row has ended (EOS or max_new_tokens).
    target_cache: the target's cache (opaque).
    draft: the draft's own carry (None for `generate` and prompt lookup).
    stats: DecodeStats so far.
    logprobs: f32[B, S] beside `tokens`, each generated token's log-probability
      (0 elsewhere), or None when not asked for.
    penalties: the `PenaltyState` of the context (prompt mask, counts of the
      generated tokens) when the parameters carry penalties, else None.
    grammar_state: int32[B] each row's grammar state after its context
      (`specdec_jax.loop.constraint`), or None without a grammar.
  """

  tokens: jax.Array
  length: jax.Array
  done: jax.Array
  target_cache: Any
  draft: Any
  stats: DecodeStats
  logprobs: jax.Array | None = None
  penalties: PenaltyState | None = None
  grammar_state: jax.Array | None = None


# ----------------------------------------------------------------------------
# Pieces of the program shared by both loops
# ----------------------------------------------------------------------------


def is_eos(tokens, eos: tuple[int, ...]):
  """bool, same shape as tokens: token is one of the (static) EOS ids."""
  hit = jnp.zeros(tokens.shape, bool)
  for e in eos:
    hit |= tokens == e
  return hit


def position_keys(keys, positions):
  """Row b's key for the step that writes slot positions[b]: fold_in(keys[b], pos).

  A row's slots only grow while it is live, so no subkey is ever used twice, and
  the key does not depend on the other rows of the batch.
  """
  if keys is None:
    return None
  return jax.vmap(jax.random.fold_in)(keys, positions.astype(jnp.int32))


def gather_rows(x, idx):
  """x[b, idx[b]] for x [B, S, ...] and idx [B]."""
  idx = idx.astype(jnp.int32).reshape(idx.shape + (1,) * (x.ndim - 1))
  return jnp.take_along_axis(x, idx, axis=1)[:, 0]


def arange32(n):
  """int32[n] 0 .. n-1 (the loops' positions and slots are int32 whatever x64 says)."""
  return jnp.arange(n, dtype=jnp.int32)


def clip_lengths(prompt_lengths, p):
  """Under an outer jit prompt_lengths cannot be checked: every loop clips them into [1, P] once, on entry."""
  return jnp.clip(prompt_lengths, 1, p)


@dataclasses.dataclass(frozen=True)
class Start:
  """What both loops begin with: the state after the prefill and the first new token."""

  state: LoopState
  keys: jax.Array | None  # [B] one typed key per row, None for all-greedy programs
  vocab_size: int
  prefill_features: jax.Array | None  # [B, P, F] when the draft reads features
  empty_start: jax.Array | None = None  # bool [B] with a grammar: the initial state allows nothing (emits nothing)


def prefill_inputs(prompt_tokens, prompt_lengths):
  """(tokens, positions) [B, P] of a prefill: the padded prompt at positions arange(P).

  The caller's pad ids may lie outside the vocabulary: they are fed as 0 (their
  slots are junk, overwritten before anyone reads them).
  """
  b, p = prompt_tokens.shape
  pos = jnp.broadcast_to(arange32(p), (b, p))
  return jnp.where(pos < prompt_lengths[:, None], prompt_tokens, 0), pos


class NextToken(NamedTuple):
  """One sampled token per row."""

  token: jax.Array  # int32 [B]
  log_probs: jax.Array  # f32 [B, V]: the distribution it was drawn from (log one-hot for greedy rows)
  logprob: jax.Array | None  # f32 [B]: its log-probability in the loop's `logprobs` mode, None when not asked for


def sample_next(logits, params, keys, all_greedy, penalties, logprobs, token_bitmask=None) -> NextToken:
  """One token per row from [B, V] logits.

  `penalties` is the context's `PenaltyState` (None without penalties);
  `logprobs` the loop's mode (None: not asked for); `token_bitmask` int32
  [B, ceil(V/32)] the rows' allowed tokens (None without a grammar).
  """
  out = sample_tokens(
    logits,
    params,
    keys,
    all_greedy=all_greedy,
    penalty_state=penalties,
    logprobs=logprobs,
    token_bitmask=token_bitmask,
  )
  return NextToken(*out) if logprobs is not None else NextToken(*out, None)


def start_loop(
  t_init,
  t_apply,
  prompt_tokens,
  prompt_lengths,
  params,
  key,
  *,
  max_new_tokens,
  eos,
  max_length,
  all_greedy,
  with_features,
  where,
  logprobs=None,
  constraint=None,
) -> Start:
  """Keys, the target's prefill, the first new token, the token buffer.

  With a `constraint` (`specdec_jax.loop.constraint`) the first token is drawn
  from the initial state's allowed set and the state follows it; a row whose
  initial state allows nothing is done at once (`Start.empty_start`).

  The prefill feeds the padded prompt at positions arange(P) and samples the
  first new token from the logits at prompt_lengths - 1:

      slot:   0    1    2    3    4          row b with P_b = 3, P = 5
      tokens: p0   p1   p2   0    0          padding writes junk slots 3, 4,
                        ^ logits -> first new token; overwritten before read
  """
  b, p = prompt_tokens.shape
  keys = None if all_greedy else row_keys(key, b)
  tokens, pos = prefill_inputs(prompt_tokens, prompt_lengths)
  out = t_apply(tokens, pos, t_init(max_length), **({"return_features": True} if with_features else {}))
  logits, cache = out[0], out[-1]
  check_eos(eos, logits.shape[-1], where)
  first_logits = gather_rows(logits, prompt_lengths - 1)
  penalties = None
  if params.has_penalties:  # the context's counts, kept by the loop (static: the params' structure)
    penalties = PenaltyState.from_prompt(prompt_tokens, prompt_lengths, logits.shape[-1])
  grammar_state = first_mask = empty_start = None
  if constraint is not None:
    grammar_state = constraint.initial(b)
    first_mask, empty_start = constraint.sampler_masks(grammar_state)
  first, _, first_lp = sample_next(
    first_logits, params, position_keys(keys, prompt_lengths), all_greedy, penalties, logprobs, first_mask
  )

  slot = arange32(max_length)[None, :]
  padded = jnp.pad(prompt_tokens, ((0, 0), (0, max_length - p)))
  buf = jnp.where(slot < prompt_lengths[:, None], padded, PLACEHOLDER_TOKEN_ID)
  buf = jnp.where(slot == prompt_lengths[:, None], first[:, None], buf).astype(jnp.int32)
  zeros = jnp.zeros((b,), jnp.int32)
  lp_buf = None
  if logprobs is not None:
    lp_buf = jnp.where(slot == prompt_lengths[:, None], first_lp[:, None], 0.0).astype(jnp.float32)
  if penalties is not None:
    penalties = penalties.add_tokens(first[:, None])
  state = LoopState(
    tokens=buf,
    length=prompt_lengths + 1,
    done=is_eos(first, eos) | (max_new_tokens <= 1),
    target_cache=cache,
    draft=None,
    logprobs=lp_buf,
    penalties=penalties,
    stats=DecodeStats(
      target_calls=jnp.ones((b,), jnp.int32),
      drafted=zeros,
      accepted=zeros,
      accepted_per_position=jnp.zeros((0,), jnp.int32),
      usable_drafted=zeros,
      reached_per_position=jnp.zeros((0,), jnp.int32),
    ),
  )
  if constraint is not None:  # the state follows the first token; a row may end by the grammar at once
    grammar_state = constraint.advance(grammar_state, first)
    done = state.done | empty_start | constraint.ends(grammar_state)
    state = dataclasses.replace(state, done=done, grammar_state=grammar_state)
  # Under a mesh, the row-major state lives split by rows over the data axis, as
  # the caches do (the models constrain those); a no-op without a mesh.
  state = dataclasses.replace(
    state,
    tokens=constrain_rows(state.tokens),
    length=constrain_rows(state.length),
    done=constrain_rows(state.done),
    logprobs=None if lp_buf is None else constrain_rows(lp_buf),
    grammar_state=None if grammar_state is None else constrain_rows(grammar_state),
  )
  return Start(
    state=state,
    keys=keys,
    vocab_size=logits.shape[-1],
    prefill_features=out[1] if with_features else None,
    empty_start=empty_start,
  )


def loop_outputs(state: LoopState, prompt_lengths, max_new_tokens, empty_start=None):
  """Cuts the generated tokens out of the buffer; -1 after each row's end.

  `empty_start`: bool [B] or None, rows that emit nothing (a grammar's initial state allowed no token):
  their prefill's token is dropped and its target call not counted.
  """
  buf, s = state.tokens, state.tokens.shape[1]
  i = arange32(max_new_tokens)[None, :]
  gen = jnp.take_along_axis(buf, jnp.minimum(prompt_lengths[:, None] + i, s - 1), axis=1)
  lengths = (state.length - prompt_lengths).astype(jnp.int32)
  tokens = jnp.where(i < lengths[:, None], gen, PLACEHOLDER_TOKEN_ID).astype(jnp.int32)
  lp = None
  if state.logprobs is not None:
    lp = jnp.take_along_axis(state.logprobs, jnp.minimum(prompt_lengths[:, None] + i, s - 1), axis=1)
    lp = jnp.where(i < lengths[:, None], lp, 0.0)
  stats = state.stats
  if empty_start is not None:
    lengths = jnp.where(empty_start, 0, lengths)
    tokens = jnp.where(empty_start[:, None], PLACEHOLDER_TOKEN_ID, tokens)
    lp = None if lp is None else jnp.where(empty_start[:, None], 0.0, lp)
    stats = dataclasses.replace(stats, target_calls=jnp.where(empty_start, 0, stats.target_calls))
  return GenerateOutput(tokens=tokens, lengths=lengths, stats=stats, logprobs=lp)


def run_loop(body, state: LoopState) -> LoopState:
  """`body` (one step or round, LoopState -> LoopState) until every row is done, in one `lax.while_loop`."""
  return jax.lax.while_loop(lambda s: jnp.any(~s.done), body, state)


def check_eos(eos, vocab_size, where):
  """At trace time, once V is known from the logits."""
  if any(e >= vocab_size for e in eos):
    raise ValueError(f"{where}: eos_token_id must be token ids in [0, V={vocab_size}), got {eos}")
