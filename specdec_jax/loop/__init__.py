"""The decoding loops: `generate` and `speculative_generate`, each one jitted `lax.while_loop`.

  - `decoding`: the two public loops, their argument checks and programs.
  - `state`: the loop's state, outputs (`GenerateOutput`) and statistics (`DecodeStats`).
  - `chain_round` and `tree_round`: one speculative round, for a chain and for a tree of drafts.
  - `draft_kinds`: the three kinds of draft (a model, prompt lookup, a feature drafter)
    behind one protocol.
  - `adapter`: splits a Flax NNX model into a static definition and its arrays, without
    importing Flax or `specdec_jax.models` (models are reached through their call protocol).
"""

from specdec_jax.loop.decoding import generate, speculative_generate
from specdec_jax.loop.state import DecodeStats, GenerateOutput

__all__ = ["DecodeStats", "GenerateOutput", "generate", "speculative_generate"]
