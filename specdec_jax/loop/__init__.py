"""The decoding loops: `generate` and `speculative_generate`, each one jitted `lax.while_loop`.

  - `decoding`: the two public loops, their argument checks and programs.
  - `state`: the loop's state, outputs (`GenerateOutput`) and statistics (`DecodeStats`).
  - `round`: what every speculative round shares: its setup, keys, `commit` and `count`.
  - `chain_round` and `tree_round`: the propose and verify steps of one round, for a chain
    and for a tree of drafts.
  - `draft_kinds`: the draft kinds (model, lookup, feature, block) behind one protocol, `DraftKind`.
  - `constraint`: a grammar (token automaton, `TokenAutomaton`) as the loops use it: each row's
    grammar state, the masks of allowed tokens, the walk along a round's drafts.
  - `adapter`: splits a Flax NNX model into a static definition and its arrays, without
    importing Flax or `specdec_jax.models` (models are reached through their call protocol).
  - `forced`: `speculative_generate_forced`, a benchmark knob that forces every round to
    accept a fixed number of drafts. NOT LOSSLESS, timing only; not exported here.

Words used throughout, each for one thing:

  - drafter: the user's object that proposes tokens: a draft model, a
    `PromptLookupDrafter` or a feature drafter such as `EagleDrafter`
    (`speculative_generate`'s `draft` argument).
  - draft kind: the loop's adapter for one kind of drafter, following the
    `DraftKind` protocol: `ModelDraft`, `LookupDraft` or `FeatureDraft`. Its part
    of the loop state is its carry (`LoopState.draft`).
  - drafts: the tokens a draft kind proposes in a round (d1 .. dK of a chain, or
    the N nodes of a tree).
  - round: keys -> propose -> verify -> commit -> count, once per `lax.while_loop`
    iteration.
  - grammar, grammar state, allowed set: see `constraint`.
"""

from specdec_jax.loop.decoding import generate, speculative_generate
from specdec_jax.loop.state import DecodeStats, GenerateOutput

__all__ = ["DecodeStats", "GenerateOutput", "generate", "speculative_generate"]
