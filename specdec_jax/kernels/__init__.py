"""Pallas kernels of a decoder block for the decode step (GPU, bf16; opt-in with `kernels="pallas"`).

  - `mlp`: `fused_mlp`, RMSNorm + SwiGLU MLP + residual of up to `MAX_ROWS` rows.
  - `attention`: `fused_attention`, RMSNorm + QKV + RoPE + cache write + attention + output projection.

They know about blocks of a transformer only; `specdec_jax.models` chooses when to call them.
"""

from specdec_jax.kernels.attention import AttentionBlocks, fused_attention
from specdec_jax.kernels.mlp import MAX_ROWS, MlpBlocks, fused_mlp, fused_mlp_supported

__all__ = ["MAX_ROWS", "AttentionBlocks", "MlpBlocks", "fused_attention", "fused_mlp", "fused_mlp_supported"]
