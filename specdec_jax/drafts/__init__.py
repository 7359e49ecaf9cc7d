"""Drafts that need no model, and the shapes of trees of drafts.

  - `lookup`: `PromptLookupDrafter`, n-gram drafts copied from the context.
  - `static_tree`: `DraftTree`, a tree with a fixed branching per depth, and its attention mask.
  - `dynamic_tree`: `DynamicTree`, a tree chosen each round by the drafter's confidence.

The decoding loop (`specdec_jax.loop`) runs them; nothing here knows the loop's state.
"""

from specdec_jax.drafts.dynamic_tree import DynamicTree
from specdec_jax.drafts.lookup import PromptLookupDrafter
from specdec_jax.drafts.static_tree import DraftTree

__all__ = ["DraftTree", "DynamicTree", "PromptLookupDrafter"]
