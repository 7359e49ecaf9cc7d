"""specdec_jax: lossless speculative decoding for JAX, as jitted pure functions.

Public API:
  - `rejection_sample`, `RejectionOutput`, `PLACEHOLDER_TOKEN_ID` (rejection.py)
  - `tree_rejection_sample`, `TreeRejectionOutput` (tree.py): trees of drafts
  - `SamplingParams`, `PenaltyState`, `sample_tokens`, `process_logits`, `row_keys` (sampling.py)
  - `generate`, `speculative_generate`, `GenerateOutput`, `DecodeStats` (decoding.py)
  - `PromptLookupDrafter` (drafters.py)
  - models: `specdec_jax.models` (Transformer, TransformerConfig, load_smollm2, ...)
"""

from specdec_jax.decoding import DecodeStats, GenerateOutput, generate, speculative_generate
from specdec_jax.drafters import PromptLookupDrafter
from specdec_jax.rejection import PLACEHOLDER_TOKEN_ID, RejectionOutput, rejection_sample
from specdec_jax.sampling import PenaltyState, SamplingParams, process_logits, row_keys, sample_tokens
from specdec_jax.tree import TreeRejectionOutput, tree_rejection_sample

__all__ = [
    "DecodeStats", "GenerateOutput", "PLACEHOLDER_TOKEN_ID", "PenaltyState", "PromptLookupDrafter", "RejectionOutput",
    "SamplingParams", "TreeRejectionOutput", "generate", "process_logits", "rejection_sample", "row_keys",
    "sample_tokens", "speculative_generate", "tree_rejection_sample",
]
__version__ = "0.1.0"
