"""The chain verifier's plan: every static decision of `rejection_sample`, made once at trace time.

`chain_plan` turns the static switches (all_greedy, all_random, no_filters,
logprobs, method, the vocabulary split) and the static facts about the
arguments (draft probabilities given, min-p or bias/penalty fields present)
into a frozen `SamplerPlan`. The program (`chain`) reads only the plan's
fields in Python `if`s; the `lax.cond`s left in the traced program are the
run-time ones, each behind a function named for what it decides:

    _if_all_rows_greedy      (chain)  an all-greedy batch skips the softmax path
    _if_any_row_greedy       (stats)  the argmax rides along only if some row is greedy
    _if_any_row_filters      (stats)  the threshold search runs only if some row filters
    _filter_pass_index       (stats)  plain / min-p only / threshold search, with min-p
    shift_non_finite_rows    (thresholds)  rows whose normaliser overflowed are redone
    _if_any_row_filtered     (chain)  filtered rows draw from their full row
    _if_any_stop_row_redone  (chain)  rows redone by the shift draw from their full row
    _if_any_residual_empty   (chain)  a residual with no mass is redrawn from p
    _if_any_row_needs_log_softmax (stats)  "raw"/greedy log-probabilities need one more pass

(`tree_rejection_sample` has its own `_if_all_rows_greedy` in `tree`.)

`sampler_paths()` is the table of every path (when it is taken, what it reads);
`SamplerPlan.paths()` lists the ones a plan's program holds. Measured costs per
path are in bench/RESULTS.md.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax

from specdec_jax.sampling.fused_sample import pallas_uncovered
from specdec_jax.sampling.params import SamplingParams
from specdec_jax.sampling.reductions import chunk_size
from specdec_jax.sampling.stats import FILTERED_PASS, MIN_P_PASS, NO_FILTERS_PASS, PLAIN_PASS, StatsPlan, stats_plan

# Which verifier the program holds.
GREEDY_VERIFIER = "greedy"  # all_greedy: one argmax pass; no exponential, no random numbers
GENERAL_VERIFIER = "general"  # all_random: the softmax path for every row
GREEDY_OR_GENERAL = "greedy_or_general"  # both, chosen at run time by `_if_all_rows_greedy`

# How the general verifier draws the recovered or bonus token at the stopping position.
CHUNK_DRAW = "chunk"  # pick a chunk by the masses the one pass left, read one chunk (no_filters, no draft probs)
CHUNK_OR_ROW_DRAW = "chunk_or_row"  # the chunk draw, or the row draw for filtered or redone rows (run time)
ROW_DRAW = "row"  # read the stopping row once; an empty residual is redrawn under `_if_any_residual_empty`
ROW_DRAW_WITH_FALLBACK = "row_with_fallback"  # the row draw, the fallback's masses from the same pass: no branch


class SamplerPath(NamedTuple):
  """One row of the path table: a path of `rejection_sample`, when it is taken, what it reads."""

  name: str
  taken_when: str
  reads: str


_PATHS = (
  SamplerPath(
    "greedy",
    "all_greedy=True, or at run time every row greedy (`_if_all_rows_greedy`)",
    "one argmax pass; no exp, no RNG",
  ),
  SamplerPath("general", "some row may be random", "the statistics pass, the drafts' gathers, one draw"),
  SamplerPath(
    "argmax ride-along",
    "some row may be greedy and some random (neither promise)",
    "the same pass also keeps the argmax, when some row is greedy (run time)",
  ),
  SamplerPath("no-filters pass", "no_filters=True", "one overflow-safe pass shifted by the row max; no branch"),
  SamplerPath("plain pass", "no row filters (run time)", "one pass of (max, sum exp) per chunk or per row"),
  SamplerPath(
    "threshold search",
    "some row has top-k or top-p (run time)",
    "group top-4 pass, candidates narrowed and sorted; + argmax pass if some row is greedy",
  ),
  SamplerPath(
    "min-p only",
    "params carry min-p; some row has it, none top-k/top-p (run time)",
    "the plain pass + a kept-mass pass",
  ),
  SamplerPath(
    "overflow redo",
    "some row's normaliser not finite (run time; not under no_filters)",
    "+ a max pass and a sort, for those batches",
  ),
  SamplerPath(
    "chunk draw", "nothing filtered, no draft probs, V a multiple of the chunk size", "one chunk of the stopping row"
  ),
  SamplerPath(
    "row draw",
    "filtered or redone rows, draft probs, or V not a multiple of the chunk size",
    "the stopping row of logits (and of draft probs)",
  ),
  SamplerPath("empty-residual redraw", "a residual with no mass (rounding; run time)", "the stopping row once more"),
  SamplerPath("block", 'method="block"', "as token, from the same gathers"),
  SamplerPath("block residual pass", 'method="block" with draft probs', "+ positions 1..K-1 of logits and probs"),
  SamplerPath("bias / penalties", "params carry a logit bias or penalties", "+ the [B, V] state, fused into reads"),
  SamplerPath(
    "pallas",
    'kernels="pallas", or "auto" on a GPU (no logprobs, penalties, min-p or split)',
    "one pass leaving per-block partials; + the stopping rows' logits and probs (draft probs; block"
    " verification: every position below n); one block per row",
  ),
  SamplerPath(
    "pallas greedy",
    'all_greedy=True with kernels="pallas", or "auto" on a GPU from 8 rows',
    "XLA's argmax of positions 0..K-1; a bonus row only where every draft was accepted",
  ),
  SamplerPath(
    "pallas threshold search",
    "the pallas path, not under no_filters (a kernel; a row that filters nothing returns at once)",
    "the filtering rows' candidates (8 or 16 a block); their whole rows when the candidates cannot settle them",
  ),
  SamplerPath("logprobs processed", 'logprobs="processed"', "gathers only (the sampler's statistics)"),
  SamplerPath(
    "logprobs raw",
    'logprobs="raw"',
    "+ a log-normaliser pass for rows not at T=1 or filtered, greedy rows too (run time)",
  ),
)

_STATS_PATH = {
  NO_FILTERS_PASS: "no-filters pass",
  PLAIN_PASS: "plain pass",
  MIN_P_PASS: "min-p only",
  FILTERED_PASS: "threshold search",
}


def sampler_paths() -> tuple[SamplerPath, ...]:
  """Every path of `rejection_sample`: (name, when it is taken, what it reads), as data.

  Example:
    >>> [p.name for p in sampler_paths()][:2]
    ['greedy', 'general']
  """
  return _PATHS


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplerPlan:
  """What `rejection_sample`'s program holds, decided once at trace time (hashable: a static jit argument).

  Attributes:
    verifier: GREEDY_VERIFIER, GENERAL_VERIFIER or GREEDY_OR_GENERAL.
    stats: the general verifier's `StatsPlan` (which statistics passes), or
      None with the greedy verifier alone.
    method: "token" or "block" (the general verifier's acceptance rule).
    draw: CHUNK_DRAW, CHUNK_OR_ROW_DRAW, ROW_DRAW or ROW_DRAW_WITH_FALLBACK, or
      None with the greedy verifier alone.
    draft_probs: draft probabilities are given (else one-hot q).
    penalties: steps 1-3 (logit bias, penalties) are applied through a fused view.
    logprobs: None, "raw" or "processed".
    greedy_rows: "all", "none" or "per_row": which rows count as greedy (the
      promises decide, else each row's temperature at run time).
    kernels: "xla" (the program above) or "pallas" (`verify.fused`: the
      general verifier in at most four Pallas kernels; then `stats` and
      `draw` describe nothing it runs).

  Example:
    >>> chain_plan(SamplingParams.create(1.0), vocab=4096, local_vocab=4096, all_random=True).draw
    'chunk_or_row'
  """

  verifier: str
  stats: StatsPlan | None
  method: str
  draw: str | None
  draft_probs: bool
  penalties: bool
  logprobs: str | None
  greedy_rows: str
  kernels: str = "xla"

  @property
  def argmax(self) -> bool:
    """The general verifier also computes the greedy rows' argmax (a batch may mix greedy and random rows)."""
    return self.stats is not None and self.stats.argmax

  @property
  def uses_random_numbers(self) -> bool:
    return self.verifier != GREEDY_VERIFIER

  def paths(self) -> tuple[str, ...]:
    """The names (from `sampler_paths()`) of the paths this plan's program holds, static or run-time."""
    names = []
    if self.kernels == "pallas" and self.verifier == GREEDY_VERIFIER:
      return ("pallas greedy",)
    if self.kernels == "pallas":
      return ("pallas",) if self.stats.passes == (NO_FILTERS_PASS,) else ("pallas", "pallas threshold search")
    if self.verifier != GENERAL_VERIFIER:
      names.append("greedy")
    if self.verifier != GREEDY_VERIFIER:
      names.append("general")
      if self.argmax:
        names.append("argmax ride-along")
      names += [_STATS_PATH[p] for p in self.stats.passes]
      if self.stats.overflow_redo:
        names.append("overflow redo")
      if self.draw in (CHUNK_DRAW, CHUNK_OR_ROW_DRAW):
        names.append("chunk draw")
      if self.draw != CHUNK_DRAW:
        names.append("row draw")
      if self.draw in (CHUNK_OR_ROW_DRAW, ROW_DRAW):
        names.append("empty-residual redraw")
      if self.method == "block":
        names.append("block")
        if self.draft_probs:
          names.append("block residual pass")
    if self.penalties:
      names.append("bias / penalties")
    if self.logprobs is not None:
      names.append(f"logprobs {self.logprobs}")
    return tuple(names)


# Under kernels="auto", all-greedy batches of at least this many rows take the Pallas greedy program.
PALLAS_GREEDY_MIN_ROWS = 8


def chain_plan(
  params: SamplingParams,
  *,
  vocab: int,
  local_vocab: int,
  draft_probs: bool = False,
  all_greedy: bool = False,
  all_random: bool = False,
  logprobs: str | None = None,
  method: str = "token",
  sharded: bool = False,
  kernels: str = "xla",
  batch: int = 0,
  mask: bool = False,
) -> SamplerPlan:
  """The `SamplerPlan` of one `rejection_sample` call, from its static switches and static facts.

  Args:
    params: SamplingParams; only its structure is read (no_filters, min-p,
      bias and penalty fields present).
    vocab: V, the whole vocabulary; local_vocab: this device's tokens (V unless sharded).
    draft_probs: draft probabilities are given.
    all_greedy, all_random, logprobs, method, kernels: as for `rejection_sample`.
    sharded: the vocabulary is split over devices (`vocab_parallel.VocabShards`).
    batch: B, the rows (under kernels="auto", all-greedy batches of fewer than
      `PALLAS_GREEDY_MIN_ROWS` keep XLA's argmax program).
    mask: a token_bitmask is given (XLA's program only).

  Returns:
    SamplerPlan.

  Example:
    >>> chain_plan(SamplingParams.greedy(2), vocab=96, local_vocab=96, all_greedy=True).paths()
    ('greedy',)
  """
  if all_greedy:
    verifier = GREEDY_VERIFIER
  elif all_random:
    verifier = GENERAL_VERIFIER
  else:
    verifier = GREEDY_OR_GENERAL
  stats, draw = None, None
  if verifier != GREEDY_VERIFIER:
    mixed = verifier == GREEDY_OR_GENERAL
    stats = stats_plan(params, vocab, greedy_rows=mixed, argmax=mixed, chunks=True, sharded=sharded)
    if stats.chunk_masses and not draft_probs:
      draw = CHUNK_DRAW if params.no_filters else CHUNK_OR_ROW_DRAW
    elif params.no_filters and local_vocab % chunk_size(vocab) == 0:
      draw = ROW_DRAW_WITH_FALLBACK
    else:
      draw = ROW_DRAW
  greedy_only = verifier == GREEDY_VERIFIER
  uncovered = pallas_uncovered(params, logprobs, sharded, greedy=greedy_only, mask=mask)
  if kernels == "pallas" and uncovered:
    raise ValueError(f"rejection_sample: kernels='pallas' does not cover {uncovered}; use kernels='xla' or 'auto'")
  # "auto": the Pallas programs on a GPU, except for the smallest all-greedy batches, where XLA's argmax
  # program is as fast or a microsecond faster (bench/RESULTS.md, "The sampler at small batch").
  auto = jax.default_backend() == "gpu" and not (greedy_only and batch < PALLAS_GREEDY_MIN_ROWS)
  use_pallas = not uncovered and (kernels == "pallas" or (kernels == "auto" and auto))
  return SamplerPlan(
    verifier=verifier,
    stats=stats,
    method=method,
    draw=draw,
    draft_probs=draft_probs,
    penalties=params.has_logit_bias or params.has_penalties,
    logprobs=logprobs,
    greedy_rows="all" if all_greedy else "none" if all_random else "per_row",
    kernels="pallas" if use_pallas else "xla",
  )
