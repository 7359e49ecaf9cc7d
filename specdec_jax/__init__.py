"""specdec_jax: lossless speculative decoding for JAX, as jitted pure functions.

The package's folders are its layers, each importing only the ones before it:

  - `mesh`: mesh axis names, sharding constraints, `make_mesh`.
  - `sampling`: `SamplingParams`, `PenaltyState`, `sample_tokens`, `process_logits`.
  - `verify`: `rejection_sample` and `tree_rejection_sample`, the lossless verifiers.
  - `drafts`: `PromptLookupDrafter` and the shapes of trees (`DraftTree`, `DynamicTree`).
  - `loop`: `generate` and `speculative_generate`, one jitted `lax.while_loop` each.

Beside them, `kernels` (Pallas kernels of a decoder block) and `models` (Flax NNX
transformers, the EAGLE-style drafter, loaders) serve the loop through the model
protocol only; `import specdec_jax` imports neither.
"""

from specdec_jax.drafts import DraftTree, DynamicTree, PromptLookupDrafter
from specdec_jax.grammar import TokenAutomaton, TokenGrammar
from specdec_jax.loop import DecodeStats, GenerateOutput, generate, speculative_generate
from specdec_jax.sampling import PenaltyState, SamplingParams, process_logits, row_keys, sample_tokens
from specdec_jax.verify import (
  PLACEHOLDER_TOKEN_ID,
  RejectionOutput,
  TreeRejectionOutput,
  rejection_sample,
  tree_rejection_sample,
)

__all__ = [
  "PLACEHOLDER_TOKEN_ID",
  "DecodeStats",
  "DraftTree",
  "DynamicTree",
  "GenerateOutput",
  "PenaltyState",
  "PromptLookupDrafter",
  "RejectionOutput",
  "SamplingParams",
  "TokenAutomaton",
  "TokenGrammar",
  "TreeRejectionOutput",
  "generate",
  "process_logits",
  "rejection_sample",
  "row_keys",
  "sample_tokens",
  "speculative_generate",
  "tree_rejection_sample",
]
__version__ = "0.1.0"
