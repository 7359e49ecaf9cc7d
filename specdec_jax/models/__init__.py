"""Flax NNX decoder-only transformers with a KV cache, the EAGLE-style drafter, and loaders.

  - `config`: `TransformerConfig`, frozen and hashable.
  - `transformer`: `Transformer`, its cache `KVCache`, and `weight_shapes`.
  - `eagle`: `EagleDrafter` and `EagleConfig`, the feature drafter.
  - `block`: `BlockDrafter`, a feature drafter that gives K drafts from one call.
  - `sharding`: `shard` and `Partitioning`, the models on a device mesh (tensor
    parallel over "model", data parallel over "data"); `make_mesh` comes from
    `specdec_jax.mesh`.
  - `loaders`: real checkpoints: any Llama/Qwen2 GGUF (`load_gguf`) or Hugging Face
    directory (`load_hf`), Qwen2.5-Coder-1.5B-Instruct (`fetch_qwen2_5_coder`,
    `load_qwen2_5_coder`, its EAGLE head `load_qwen2_5_coder_eagle`, a block drafter
    `load_qwen2_5_coder_block_drafter`) and SmolLM2-135M with its draft and head (`load_smollm2`,
    `load_smollm2_draft`, `load_smollm2_eagle`).

The decoding loops never import this package: a model reaches them through its
call protocol (`init_cache` and `__call__`; see `Transformer`).
"""

from specdec_jax.mesh import make_mesh
from specdec_jax.models.block import BlockDrafter
from specdec_jax.models.config import TransformerConfig
from specdec_jax.models.eagle import EagleConfig, EagleDrafter
from specdec_jax.models.loaders.gguf import load_gguf
from specdec_jax.models.loaders.hf import load_hf
from specdec_jax.models.loaders.qwen2_5_coder import (
  fetch_qwen2_5_coder,
  load_qwen2_5_coder,
  load_qwen2_5_coder_block_drafter,
  load_qwen2_5_coder_eagle,
)
from specdec_jax.models.loaders.smollm2 import load_smollm2, load_smollm2_draft, load_smollm2_eagle
from specdec_jax.models.sharding import Partitioning, shard
from specdec_jax.models.transformer import KVCache, Transformer, weight_shapes

__all__ = [
  "BlockDrafter",
  "EagleConfig",
  "EagleDrafter",
  "KVCache",
  "Partitioning",
  "Transformer",
  "TransformerConfig",
  "fetch_qwen2_5_coder",
  "load_gguf",
  "load_hf",
  "load_qwen2_5_coder",
  "load_qwen2_5_coder_block_drafter",
  "load_qwen2_5_coder_eagle",
  "load_smollm2",
  "load_smollm2_draft",
  "load_smollm2_eagle",
  "make_mesh",
  "shard",
  "weight_shapes",
]
