"""Forced acceptance: a BENCHMARK KNOB. NOT LOSSLESS: its outputs are not samples of the target.

`speculative_generate_forced` runs `speculative_generate`'s program with every
round forced to accept the same number of drafts `a` in every live row, whatever
the target thinks of them, so a benchmark can chart tokens/s against the mean
accepted length (a + 1 per round) for a draft kind and K, independently of how
good the drafter is (vLLM calls this "synthetic" acceptance):

    real round:    target scores [t, d1 .. dK]; the verifier accepts d1 .. dn (n: the drafts' quality)
    forced round:  the same target call and verifier; then d1 .. da are emitted, whatever n was,
                   followed by the target's own token at position a (`round.forced_emission`)

Everything else is the real round's: the draft kind proposes K drafts (or a tree
of them), the target verifies all of them in one call, the verifier runs, and
EOS and `max_new_tokens` end rows as usual. The forced tokens are the drafts the
models' caches already hold, so the next round's inputs are those of a real
round that accepted `a` drafts.

The knob is reachable only from here (DESIGN.md, "Forced acceptance"):
`speculative_generate` and `rejection_sample` have no argument that forces
anything, and with the knob off their compiled programs are unchanged.
"""

from __future__ import annotations

from specdec_jax.drafts.dynamic_tree import DynamicTree
from specdec_jax.drafts.static_tree import DraftTree
from specdec_jax.loop.decoding import _is_int, _speculative_generate
from specdec_jax.loop.state import GenerateOutput
from specdec_jax.sampling.params import SamplingParams

__all__ = ["speculative_generate_forced"]


def speculative_generate_forced(
  target,
  draft,
  prompt_tokens,
  prompt_lengths,
  params: SamplingParams,
  key,
  *,
  forced_accepts: int,
  max_new_tokens: int,
  num_speculative_tokens: int,
  eos_token_id=None,
  all_greedy: bool = False,
  draft_tree: tuple[int, ...] | DraftTree | None = None,
  verification: str = "token",
  no_filters: bool = False,
  grammar=None,
) -> GenerateOutput:
  """`speculative_generate` with every round accepting `forced_accepts` drafts. BENCHMARK ONLY, NOT LOSSLESS.

  The returned tokens are NOT samples of the target: they are mostly the
  drafter's proposals, accepted without asking the target. Use this only to
  time a round that accepts a given number of drafts (tokens/s against mean
  accepted length); for text, call `speculative_generate`.

  Every round of every live row accepts exactly `forced_accepts` drafts: a
  chain's d1 .. d_a, or a static tree's first-child path (node 0 and the first
  child at every depth below it); then it emits the target's own token at the
  next position: the verifier's recovered or bonus token where the verifier
  stopped there itself, else the argmax of the target's logits there (random
  rows included). The round's work is a real round's (the draft kind proposes
  K drafts, the target verifies all K+1 positions, the verifier runs) plus one
  argmax over [B, V]. EOS and `max_new_tokens` end rows as in
  `speculative_generate`, so every round but a row's last accepts
  `forced_accepts` drafts: the stats show `accepted_per_position[i] == 0` for
  i >= forced_accepts, and `mean_accepted_length` tends to forced_accepts + 1
  (the prefill's target call emits one token, and a row's last round may be cut).

  Args:
    target, draft, prompt_tokens, prompt_lengths, params, key, max_new_tokens,
      num_speculative_tokens, eos_token_id, all_greedy, verification,
      no_filters: as for `speculative_generate` (no `logprobs`: those of
      forced tokens would be the verifier's, for other tokens).
    forced_accepts: static int in [0, num_speculative_tokens]: drafts accepted
      per round (a; the round emits a + 1 tokens).
    draft_tree: None (a chain) or a static tree (a tuple of branching factors
      or a `DraftTree`); a `DynamicTree` is refused (its first-child path may
      end before depth K).
    grammar: must be None: forced tokens ignore a grammar, so any other value
      is refused (ValueError).

  Returns:
    GenerateOutput, as `speculative_generate` returns it (logprobs None).

  Raises:
    ValueError: `forced_accepts` not an int in [0, num_speculative_tokens]
      (bools refused), a `DynamicTree`, or anything `speculative_generate` refuses.

  Example:
    >>> out = speculative_generate_forced(target, PromptLookupDrafter(2), prompts, prompt_lengths,
    ...                                   SamplingParams.greedy(B), None, forced_accepts=2,
    ...                                   max_new_tokens=64, num_speculative_tokens=4, all_greedy=True)
    >>> out.stats.accepted_per_position  # [rounds * B, rounds * B, 0, 0]: timing only, not target text
  """
  where = "speculative_generate_forced"
  k = num_speculative_tokens
  if not _is_int(forced_accepts) or forced_accepts < 0 or (_is_int(k) and forced_accepts > k):
    raise ValueError(
      f"{where}: forced_accepts must be an int in [0, num_speculative_tokens={k!r}], got {forced_accepts!r}"
    )
  if isinstance(draft_tree, DynamicTree):
    raise ValueError(
      f"{where}: draft_tree={draft_tree} is a DynamicTree, whose first-child path may end before depth K; "
      "forced acceptance takes a chain or a static tree"
    )
  return _speculative_generate(
    where,
    target,
    draft,
    prompt_tokens,
    prompt_lengths,
    params,
    key,
    max_new_tokens=max_new_tokens,
    num_speculative_tokens=num_speculative_tokens,
    eos_token_id=eos_token_id,
    all_greedy=all_greedy,
    logprobs=None,
    draft_tree=draft_tree,
    verification=verification,
    no_filters=no_filters,
    forced_accepts=int(forced_accepts),
    grammar=grammar,
  )
