"""Static configuration of the decoder-only transformer.

A `TransformerConfig` is hashable and registered as a static pytree, so it can
ride through `jax.jit` as an argument (or sit on an NNX module) without ever
becoming a traced value: a new config means a new program, by design.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_POSITIVE_INT_FIELDS = (
  "vocab_size",
  "num_layers",
  "d_model",
  "num_heads",
  "num_kv_heads",
  "head_dim",
  "d_ff",
)

KERNELS = ("xla", "pallas", "pallas_interpret")

# The fields that give a checkpoint's weights their meaning (not dtype, kernels, feature_layers or the
# layers' layout): what a saved model records (`TransformerConfig.architecture`).
ARCHITECTURE_FIELDS = _POSITIVE_INT_FIELDS + ("rope_theta", "rms_norm_eps", "tie_embeddings", "qkv_bias", "max_length")


def check_kernels(kernels, name: str = "TransformerConfig.kernels") -> None:
  """Raises ValueError naming `name` unless `kernels` is one of `KERNELS` (the config's check, usable before
  a config exists, e.g. by a loader ahead of its file reads)."""
  if kernels not in KERNELS:
    raise ValueError(f"{name} must be one of {KERNELS}, got {kernels!r}.")


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig:
  """Shape and numerics of a Llama-style decoder-only transformer.

  Attributes:
    vocab_size: V, number of token ids.
    num_layers: L, number of decoder blocks (their parameters stacked on a
      leading L axis).
    d_model: D, width of the residual stream.
    num_heads: H, query heads.
    num_kv_heads: Hkv, key/value heads; `num_heads % num_kv_heads == 0`
      (grouped-query attention; `num_kv_heads == num_heads` is plain MHA).
    head_dim: Dh, width of one head; even, because RoPE rotates pairs.
    d_ff: F, hidden width of the SwiGLU MLP.
    rope_theta: RoPE base; `inv_freq[i] = rope_theta ** (-2 i / head_dim)`.
    rms_norm_eps: epsilon inside RMSNorm's square root.
    tie_embeddings: if True the output projection is `embed.T`, otherwise
      the model holds a separate `lm_head` [D, V].
    qkv_bias: if True the query, key and value projections add biases
      (`bq` [H*Dh], `bk` and `bv` [Hkv*Dh] per layer; the output projection
      and the MLP have none), as Qwen2-family checkpoints do. False (the
      default): no bias parameters at all, and the programs of a model
      without them are unchanged.
    dtype: parameter, activation and KV-cache dtype (float32 or bfloat16).
      Normalised to a `jnp.dtype`, so `jnp.float32` and `"float32"` give
      equal (and equally hashed) configs.
    feature_layers: indices (in [0, L), distinct) of the blocks whose outputs
      (the residual stream after block i) are concatenated into the features
      that `model(..., return_features=True)` returns, F = len * D. An
      EAGLE-style drafter reads them. Empty: the model has no features.
    max_length: the longest context the model was trained for (positions
      0 .. max_length-1), or None for no limit. The decoding loops refuse a
      generation that would run past it.
    scan_layers: how a call runs the blocks. False (the default): unrolled,
      one straight-line program (for SmolLM2, faster than the scan for calls
      of several rows on an H100 and at B=1 on a CPU, a little slower for a
      B=1 step on an H100; bench/RESULTS.md); True: `lax.scan` over the stacked blocks,
      whose compile time does not grow with depth (bench/step_profile.py
      measures both). The outputs are the same up to
      floating-point reassociation by the compiler.

    kernels: how a call of few rows (B*T <= 16; the decode step, a
      verification, a small tree of drafts, a small prefill, an EAGLE head's
      call) runs a block. "xla" (the default): XLA's
      kernels everywhere. "pallas": on a GPU, in bf16/f16, unrolled, unsharded
      models, each block's attention half and MLP half run as hand-written
      Pallas (Triton) kernels, three and two, each half ending in one small
      XLA sum (`specdec_jax/kernels/`); every other
      call, backend or dtype keeps XLA's. "pallas_interpret": the same
      kernels in Pallas's interpreter on any backend (slow; for tests).
      Outputs agree with "xla" up to rounding.
    tree_kernels: whether a tree call (`cache_slots` and `attention_mask`
      given) takes the Pallas blocks where `kernels` gives a call of its
      rows the kernels (True, the default), or XLA's blocks (False). On
      the kernels each node reads its ancestors' keys row by row, in the
      order a chain of its path holds them, so that a node's scores round
      as a chain's do; XLA's blocks read them in one product, which costs
      less (bench/RESULTS.md, "Trees on XLA's blocks and on the kernels").

  Example:
    >>> cfg = TransformerConfig(vocab_size=64, num_layers=2, d_model=32,
    ...                         num_heads=4, num_kv_heads=2, head_dim=8,
    ...                         d_ff=64)
    >>> cfg.num_heads // cfg.num_kv_heads
    2
  """

  vocab_size: int
  num_layers: int
  d_model: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  d_ff: int
  rope_theta: float = 10000.0
  rms_norm_eps: float = 1e-5
  tie_embeddings: bool = True
  qkv_bias: bool = False
  dtype: Any = jnp.float32
  feature_layers: tuple[int, ...] = ()
  max_length: int | None = None
  scan_layers: bool = False
  kernels: str = "xla"
  tree_kernels: bool = True

  def __post_init__(self):
    for name in _POSITIVE_INT_FIELDS:
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"TransformerConfig.{name} must be a positive int, got {value!r}.")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"TransformerConfig.num_heads ({self.num_heads}) must be a multiple of "
        f"num_kv_heads ({self.num_kv_heads}) for grouped-query attention."
      )
    if self.head_dim % 2:
      raise ValueError(f"TransformerConfig.head_dim must be even (RoPE rotates pairs of dims), got {self.head_dim}.")
    if not self.rope_theta > 0:
      raise ValueError(f"TransformerConfig.rope_theta must be > 0, got {self.rope_theta!r}.")
    if not self.rms_norm_eps >= 0:
      raise ValueError(f"TransformerConfig.rms_norm_eps must be >= 0, got {self.rms_norm_eps!r}.")
    try:
      dtype = jnp.dtype(self.dtype)
    except TypeError as e:
      raise ValueError(f"TransformerConfig.dtype must be a float dtype, got {self.dtype!r}.") from e
    if not jnp.issubdtype(dtype, jnp.floating):
      raise ValueError(f"TransformerConfig.dtype must be a float dtype, got {dtype}.")
    layers = self.feature_layers
    if isinstance(layers, list):
      layers = tuple(layers)
    if (
      not isinstance(layers, tuple)
      or len(set(layers)) != len(layers)
      or any(
        isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < self.num_layers for i in layers
      )
    ):
      raise ValueError(
        f"TransformerConfig.feature_layers must be a tuple of distinct layer indices in "
        f"[0, num_layers={self.num_layers}), got {self.feature_layers!r}."
      )
    object.__setattr__(self, "feature_layers", tuple(int(i) for i in layers))
    m = self.max_length
    if m is not None and (isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m <= 0):
      raise ValueError(f"TransformerConfig.max_length must be None or a positive int, got {m!r}.")
    if not isinstance(self.qkv_bias, bool):
      raise ValueError(f"TransformerConfig.qkv_bias must be a bool, got {self.qkv_bias!r}.")
    if not isinstance(self.scan_layers, bool):
      raise ValueError(f"TransformerConfig.scan_layers must be a bool, got {self.scan_layers!r}.")
    check_kernels(self.kernels)
    if not isinstance(self.tree_kernels, bool):
      raise ValueError(f"TransformerConfig.tree_kernels must be a bool, got {self.tree_kernels!r}.")
    # Frozen dataclass: normalise through object.__setattr__ (so equality and
    # hashing do not depend on how the dtype was spelled).
    object.__setattr__(self, "dtype", dtype)

  @classmethod
  def tiny(cls, vocab_size: int = 64, **overrides) -> TransformerConfig:
    """A 2-layer GQA model small enough for unit tests on a CPU.

    Args:
      vocab_size: V.
      **overrides: any other field, e.g. `num_layers=8` or `dtype=jnp.bfloat16`.

    Returns:
      V=vocab_size, L=2, D=32, H=4, Hkv=2, Dh=8, F=64, unless overridden.

    Example:
      >>> TransformerConfig.tiny(64, num_layers=8).num_layers
      8
    """
    fields = dict(
      vocab_size=vocab_size,
      num_layers=2,
      d_model=32,
      num_heads=4,
      num_kv_heads=2,
      head_dim=8,
      d_ff=64,
    )
    fields.update(overrides)
    return cls(**fields)

  @property
  def feature_size(self) -> int:
    """F = len(feature_layers) * d_model: the width of the model's features."""
    return len(self.feature_layers) * self.d_model

  def architecture(self) -> dict[str, Any]:
    """The `ARCHITECTURE_FIELDS` as a dict of JSON-ready values; `TransformerConfig(**it)` rebuilds the config.

    Example:
      >>> TransformerConfig(**TransformerConfig.tiny(64).architecture()) == TransformerConfig.tiny(64)
      True
    """
    return {name: getattr(self, name) for name in ARCHITECTURE_FIELDS}

  def replace(self, **changes) -> TransformerConfig:
    """Returns a copy with `changes` applied (and validated again)."""
    return dataclasses.replace(self, **changes)
