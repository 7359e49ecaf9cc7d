"""Verification: the lossless rejection samplers that decide which drafts the target keeps.

  - `checks`: the argument checks both verifiers share.
  - `plan`: `SamplerPlan`, the chain verifier's static decisions made once at trace
    time, and `sampler_paths()`, the table of its paths.
  - `block`: the helpers of block verification (`method="block"`).
  - `chain`: `rejection_sample`, K drafts in a row, token by token (`method="token"`)
    or by block verification (`method="block"`).
  - `tree`: `tree_rejection_sample`, a tree of drafts walked from the root.

They read logits through `specdec_jax.sampling` and know nothing of models or caches.
"""

from specdec_jax.verify.chain import PLACEHOLDER_TOKEN_ID, RejectionOutput, rejection_sample
from specdec_jax.verify.tree import TreeRejectionOutput, tree_rejection_sample

__all__ = [
  "PLACEHOLDER_TOKEN_ID",
  "RejectionOutput",
  "TreeRejectionOutput",
  "rejection_sample",
  "tree_rejection_sample",
]
