"""Flax NNX decoder-only transformers with a KV cache, and their configs.

Public API:
  - `TransformerConfig` (config.py): frozen, hashable model configuration.
  - `Transformer`, `KVCache`, `weight_shapes` (transformer.py): the model, its
    cache pytree and the shapes of its weights interface (`from_weights` /
    `to_weights`).
"""

from specdec_jax.models.config import TransformerConfig
from specdec_jax.models.transformer import KVCache, Transformer, weight_shapes

__all__ = [
    "KVCache",
    "Transformer",
    "TransformerConfig",
    "weight_shapes",
]
# SmolLM2 loaders; smollm2.py imports gguf/tokenizers/safetensors only when called.
from specdec_jax.models.smollm2 import load_smollm2, load_smollm2_draft  # noqa: E402
__all__ += ["load_smollm2", "load_smollm2_draft"]
