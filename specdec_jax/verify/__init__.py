"""Verification: the lossless rejection samplers that decide which drafts the target keeps.

  - `chain`: `rejection_sample`, K drafts in a row, token by token (`method="token"`)
    or by block verification (`method="block"`, in `block`).
  - `tree`: `tree_rejection_sample`, a tree of drafts walked from the root.
  - `checks`: the argument checks both share.

They read logits through `specdec_jax.sampling` and know nothing of models or caches.
"""

from specdec_jax.verify.chain import PLACEHOLDER_TOKEN_ID, RejectionOutput, rejection_sample
from specdec_jax.verify.tree import TreeRejectionOutput, tree_rejection_sample

__all__ = ["PLACEHOLDER_TOKEN_ID", "RejectionOutput", "TreeRejectionOutput", "rejection_sample",
           "tree_rejection_sample"]
