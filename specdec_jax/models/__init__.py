"""Flax NNX decoder-only transformers with a KV cache, the EAGLE-style drafter, and loaders.

Public API (imported on first use, so `specdec_jax.models.adapter` and the
decoding loops do not pull in Flax):
  - `TransformerConfig` (config.py): frozen, hashable model configuration.
  - `Transformer`, `KVCache`, `weight_shapes` (transformer.py): the model, its
    cache pytree and the shapes of its weights interface.
  - `EagleDrafter`, `EagleConfig` (eagle.py): the feature drafter.
  - `load_smollm2`, `load_smollm2_draft`, `load_smollm2_eagle` (smollm2.py).
  - `shard`, `make_mesh`, `Partitioning` (sharding.py): the models on a device
    mesh, tensor parallel over "model", data parallel over "data".
"""

import importlib

_EXPORTS = {
    "TransformerConfig": "config",
    "Transformer": "transformer",
    "KVCache": "transformer",
    "weight_shapes": "transformer",
    "EagleDrafter": "eagle",
    "EagleConfig": "eagle",
    "load_smollm2": "smollm2",
    "load_smollm2_draft": "smollm2",
    "load_smollm2_eagle": "smollm2",
    "shard": "sharding",
    "make_mesh": "sharding",
    "Partitioning": "sharding",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  module = _EXPORTS.get(name)
  if module is None:
    raise AttributeError(f"module 'specdec_jax.models' has no attribute {name!r}")
  value = getattr(importlib.import_module(f"specdec_jax.models.{module}"), name)
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(__all__))
