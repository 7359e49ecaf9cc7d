"""A Llama-style decoder-only transformer in Flax NNX with a fixed-size KV cache.

The model knows nothing about speculation. It follows the model protocol of the
decoding loop (docs/models.md): one call

    logits, cache = model(tokens, positions, cache)   # [B, T] x2 -> [B, T, V]

serves a prefill, a one-token decode step and a (K+1)-token verification. Every
token writes its keys/values at *its own* position, per row, and a query at
position p attends to exactly the cache slots s <= p. The loop owns the row
lengths; the cache holds no length at all.

Cache slots of a batch of two rows (prompt lengths 3 and 5, P=5, K=2), with
`_` = slot never written, `j` = junk written by padding or a rejected draft:

    slot:               0  1  2  3  4  5  6  7  8
    after prefill  r0:  a  b  c  j  j  _  _  _  _    positions 0..4 for both rows;
                   r1:  v  w  x  y  z  _  _  _  _    r0's pad tokens wrote junk at 3, 4
    verify K+1=3   r0:  a  b  c  d  e  f  _  _  _    r0 at positions 3,4,5 (overwrote junk)
                   r1:  v  w  x  y  z  A  B  C  _    r1 at positions 5,6,7
    r1 rejected B, C: its length drops to 6; slots 6, 7 keep junk nobody can see,
    because r1's next round writes positions 6.. before querying them.

Writes at positions outside [0, max_length) are dropped (a scatter with
`mode="drop"`), never clamped onto the last slot as `lax.dynamic_update_slice`
would. Masked slots get exactly zero attention weight, so junk never leaks.

Layers are stacked (every per-layer parameter has a leading L axis). A call
runs them unrolled, one straight-line program (the default), or under
`lax.scan` (`config.scan_layers`), whose compile time does not grow with depth
(see `TransformerConfig.scan_layers` for what each costs); either way the cache of all layers is
updated in place. Inside the model the query/key/value projections are one
matrix `wqkv` and the gate/up projections one matrix `w_gate_up` (one matmul
each instead of three and two), and a model with q/k/v biases
(`config.qkv_bias`, Qwen2) holds them as one vector `bqkv` beside `wqkv`; the
weights interface (`weight_shapes`, `from_weights`, `to_weights`, the files)
keeps them separate.

Many devices: `specdec_jax.models.shard(model, mesh)` returns the model placed
on a mesh, tensor parallel over its "model" axis (heads, MLP, vocabulary) and
replicated over "data"; a projection it splits is held as separate matrices
(`wq`, `wk`, `wv`, and biases `bq`, `bk`, `bv`; `w_gate`, `w_up`). Such a
model (`partitioning` set) constrains its KV cache to rows over "data" and
heads over "model", and its logits to `P("data", None, "model")`, under the
ambient `jax.set_mesh` (`specdec_jax/models/sharding.py` has the rules and why).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specdec_jax.kernels import attention, mlp
from specdec_jax.models import sharding
from specdec_jax.models.config import TransformerConfig
from specdec_jax.models.sharding import Partitioning, relayout

# Per-layer parameters, in the order of the weights interface ("layers.<name>").
_LAYER_PARAMS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
# The q/k/v biases, per layer, of a model with `config.qkv_bias` (Qwen2): after _LAYER_PARAMS.
_BIAS_PARAMS = ("bq", "bk", "bv")
# The same parameters as the model holds them: q|k|v (and the biases' q|k|v) and gate|up concatenated on the
# output axis; "bqkv" only with `config.qkv_bias`.
_FUSED_PARAMS = ("attn_norm", "wqkv", "wo", "mlp_norm", "w_gate_up", "w_down")
_FUSED_FROM = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up"), "bqkv": _BIAS_PARAMS}


def layer_params(config: TransformerConfig) -> tuple[str, ...]:
  """The per-layer names of the weights interface ("layers.<name>") for `config`: biases only with `qkv_bias`.

  Example:
    >>> layer_params(TransformerConfig.tiny(64, qkv_bias=True))[-3:]
    ('bq', 'bk', 'bv')
  """
  return _LAYER_PARAMS + _BIAS_PARAMS if config.qkv_bias else _LAYER_PARAMS


def fuse_projections(weights: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
  """Per-layer weights under `layer_params` names -> the model's fused layout (concatenated on the last axis).

  Args:
    weights: one block's (or a stack's, [L, ...]) weights: "attn_norm", "wq" [..., D, H*Dh], "wk", "wv"
      [..., D, Hkv*Dh], "wo", "mlp_norm", "w_gate", "w_up" [..., D, F], "w_down", and optionally the
      biases "bq" [..., H*Dh], "bk", "bv" [..., Hkv*Dh].

  Returns:
    `_FUSED_PARAMS`: "wqkv" [..., D, (H + 2 Hkv) Dh], "w_gate_up" [..., D, 2F], the others as they are;
    plus "bqkv" [..., (H + 2 Hkv) Dh] where the biases are given (absent without them, so a model
    without biases holds exactly the parameters it held before biases existed).

  Example:
    >>> w = {n: jnp.zeros(s[1:]) for n, s in weight_shapes(TransformerConfig.tiny(64, qkv_bias=True)).items()
    ...      if n.startswith("layers.")}
    >>> fuse_projections({n[len("layers."):]: a for n, a in w.items()})["bqkv"].shape
    (64,)
  """
  out = {name: weights[name] for name in _FUSED_PARAMS if name not in _FUSED_FROM}
  # (Insertion order as before biases existed: a block's parameter names are static structure.)
  for name, parts in _FUSED_FROM.items():
    if parts[0] in weights:
      out[name] = jnp.concatenate([jnp.asarray(weights[part]) for part in parts], axis=-1)
  return out


def split_projections(fused: Mapping[str, np.ndarray], config: TransformerConfig) -> dict[str, np.ndarray]:
  """The inverse of `fuse_projections` (exact: slicing, "bqkv" -> "bq", "bk", "bv" too); projections already
  separate pass through."""
  return relayout(
    fused,
    q_width=config.num_heads * config.head_dim,
    kv_width=config.num_kv_heads * config.head_dim,
    d_ff=config.d_ff,
    fuse_attention=False,
    fuse_mlp=False,
  )


@flax.struct.dataclass
class KVCache:
  """Keys and values of every layer, one slot per position.

  Attributes:
    k: [L, B, Hkv, S, Dh] keys, RoPE already applied, in `config.dtype`.
    v: [L, B, Hkv, S, Dh] values.

  S is `max_length`. The cache holds no lengths: callers say where each token
  goes through `positions` (see the module docstring). Heads come before slots
  because the attention matmuls batch over (B, Hkv) and want those axes major:
  with [L, B, S, Hkv, Dh], XLA on GPU transposed the whole cache on the way in
  and out of every call (measured on an H100: 4.0 ms -> 3.0 ms per step for a
  30-layer model at B=8, S=4096). Treat the layout as private all the same.

  Example:
    >>> cache = model.init_cache(batch_size=2, max_length=16)  # doctest: +SKIP
    >>> cache.k.shape  # (L, 2, Hkv, 16, Dh)  # doctest: +SKIP
  """

  k: jax.Array
  v: jax.Array

  @property
  def batch_size(self) -> int:
    return self.k.shape[1]

  @property
  def max_length(self) -> int:
    return self.k.shape[3]


def weight_shapes(config: TransformerConfig) -> dict[str, tuple[int, ...]]:
  """The keys and shapes of `Transformer.to_weights()` for `config`.

  Linear weights are in `x @ W` orientation; per-layer weights are stacked on a
  leading L axis. Q/K output columns (and their biases' entries) are in Hugging
  Face "rotate_half" order.

  Args:
    config: the model configuration.

  Returns:
    Dict from weight name to shape; "lm_head" [D, V] only when embeddings are
    untied; "layers.bq" [L, H*Dh], "layers.bk" and "layers.bv" [L, Hkv*Dh]
    only with `config.qkv_bias` (added to x @ wq, x @ wk, x @ wv).

  Example:
    >>> weight_shapes(TransformerConfig.tiny(64))["layers.wk"]
    (2, 32, 16)
    >>> weight_shapes(TransformerConfig.tiny(64, qkv_bias=True))["layers.bk"]
    (2, 16)
  """
  L, D, F, V = config.num_layers, config.d_model, config.d_ff, config.vocab_size
  q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
  shapes = {
    "embed": (V, D),
    "layers.attn_norm": (L, D),
    "layers.wq": (L, D, q),
    "layers.wk": (L, D, kv),
    "layers.wv": (L, D, kv),
    **({"layers.bq": (L, q), "layers.bk": (L, kv), "layers.bv": (L, kv)} if config.qkv_bias else {}),
    "layers.wo": (L, q, D),
    "layers.mlp_norm": (L, D),
    "layers.w_gate": (L, D, F),
    "layers.w_up": (L, D, F),
    "layers.w_down": (L, F, D),
    "final_norm": (D,),
  }
  if not config.tie_embeddings:
    shapes["lm_head"] = (D, V)
  return shapes


def _random_weights(config: TransformerConfig, key: jax.Array) -> dict[str, jax.Array]:
  """Random weights under the keys of `weight_shapes` (see `random_weights`)."""
  return random_weights(tuple(weight_shapes(config).items()), config.num_layers, config.dtype, key)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def random_weights(
  shapes: tuple[tuple[str, tuple[int, ...]], ...], num_layers: int, dtype, key: jax.Array
) -> dict[str, jax.Array]:
  """Initial weights for the named shapes, in one compiled program (the transformer's and the EAGLE drafter's).

  (Drawn op by op, eagerly, each shape would compile on its own: seconds even
  for a tiny model.) Names ending in "norm" get scales of 1; matrices, and the
  q/k/v biases ("bq", "bk", "bv": small but not zero, so that a fresh model's
  tests exercise them), are normal with std 0.02, and the projections that
  write into the residual stream (names ending in "wo", "w_down") are scaled
  down by sqrt(2 L) (GPT-2) so its variance stays O(1) in depth.

  Args:
    shapes: ((name, shape), ...), hashable.
    num_layers: L of that scaling.
    dtype: the weights' dtype.
    key: a PRNG key.

  Returns:
    {name: array of that shape}.

  Example:
    >>> random_weights((("w", (2, 3)), ("norm", (3,))), 1, jnp.float32, jax.random.key(0))["norm"]
    Array([1., 1., 1.], dtype=float32)
  """
  matrices = [(name, shape) for name, shape in shapes if not name.endswith("norm")]
  sizes = [int(np.prod(shape)) for _, shape in matrices]
  # One draw for all matrices: XLA compiles a single threefry instead of one per shape.
  noise = jax.random.normal(key, (sum(sizes),), jnp.float32)
  weights = {}
  for (name, shape), chunk in zip(matrices, jnp.split(noise, np.cumsum(sizes)[:-1])):
    std = 0.02 / np.sqrt(2 * num_layers) if name.endswith(("wo", "w_down")) else 0.02
    weights[name] = (std * chunk.reshape(shape)).astype(dtype)
  for name, shape in shapes:
    if name.endswith("norm"):
      weights[name] = jnp.ones(shape, dtype)
  return weights


def _make_param(value, name: str, placement):
  """An `nnx.Param`, placed and annotated by `placement` = (mesh, Partitioning, leading axes) when sharding."""
  if placement is None:
    return nnx.Param(value)
  mesh, part, lead = placement
  return sharding.param(value, mesh, (None,) * lead + part.param_spec(name))


class _Block(nnx.Module):
  """One decoder block's parameters, for the unrolled layout.

  Projections fused (`_FUSED_PARAMS`) as the model builds them, or some of them
  separate (`wq`, `wk`, `wv`; `w_gate`, `w_up`) where `sharding.shard` splits them.
  """

  def __init__(self, weights: Mapping[str, jax.Array], placement=None):
    self.names = tuple(weights)  # static: which layout this block holds
    for name, value in weights.items():
      setattr(self, name, _make_param(value, name, placement))

  def values(self) -> dict[str, jax.Array]:
    return {name: getattr(self, name)[...] for name in self.names}


class _LayerStack(nnx.Module):
  """All decoder blocks' parameters, projections fused (`_FUSED_PARAMS`) unless sharding split them.

  Under `scan_layers` each parameter is one array with a leading [L] axis,
  which `lax.scan` slices. Unrolled, each block owns its arrays (`block0`,
  `block1`, ...): slicing a stacked array inside the compiled step is a copy
  of every layer's weights per step on XLA:CPU (a SmolLM2 step on a 2-core
  CPU: 46 ms under scan, 126 ms unrolled over slices, 31 ms unrolled over
  per-block arrays).

  Args:
    layers: the stacked [L, ...] parameters by name, or (unrolled layout
      only) one dict of unstacked parameters per block.
    config: the model configuration.
    placement: None, or (mesh, Partitioning, 0) to place and annotate every
      parameter (`sharding.shard`).
  """

  def __init__(self, layers, config: TransformerConfig, placement=None):
    if config.scan_layers:
      self.names = tuple(layers)
      lead = None if placement is None else placement[:2] + (1,)  # the [L] axis stays whole
      for name, value in layers.items():
        setattr(self, name, _make_param(value, name, lead))
      return
    if isinstance(layers, Mapping):
      layers = [{name: value[i] for name, value in layers.items()} for i in range(config.num_layers)]
    for i, block in enumerate(layers):
      setattr(self, f"block{i}", _Block(block, placement))

  def stacked(self, config: TransformerConfig) -> dict[str, jax.Array]:
    """The parameters stacked on a leading [L] axis (what `lax.scan` reads; a copy when unrolled)."""
    if config.scan_layers:
      return {name: getattr(self, name)[...] for name in self.names}
    blocks = self.blocks(config)
    return {name: jnp.stack([block[name] for block in blocks]) for name in blocks[0]}

  def blocks(self, config: TransformerConfig) -> list[dict[str, jax.Array]]:
    """Every block's parameters (unrolled layout)."""
    return [self.block(i) for i in range(config.num_layers)]

  def block(self, i: int) -> dict[str, jax.Array]:
    """Block i's parameters (unrolled layout)."""
    return getattr(self, f"block{i}").values()


class Transformer(nnx.Module):
  """Decoder-only Llama-style transformer (RoPE, RMSNorm, SwiGLU, GQA).

  Implements the model protocol of the decoding loop: `init_cache` and
  `__call__(tokens, positions, cache)`.

  Attributes:
    config: the `TransformerConfig`.
    partitioning: None, or for a model from `specdec_jax.models.shard` the
      `Partitioning` saying what is split over the mesh's "model" axis (heads,
      MLP, vocabulary). Static: it rides in the NNX graph definition.

  Args:
    config: the model configuration.
    rngs: random streams; `rngs.params()` draws the initial weights.

  Example:
    >>> config = TransformerConfig.tiny(vocab_size=64)
    >>> model = Transformer(config, rngs=nnx.Rngs(0))
    >>> cache = model.init_cache(batch_size=2, max_length=16)
    >>> tokens = jnp.array([[1, 2, 3], [4, 5, 0]], jnp.int32)
    >>> positions = jnp.broadcast_to(jnp.arange(3, dtype=jnp.int32), (2, 3))
    >>> logits, cache = model(tokens, positions, cache)
    >>> logits.shape
    (2, 3, 64)
  """

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    if not isinstance(config, TransformerConfig):
      raise ValueError(f"config must be a TransformerConfig, got {type(config).__name__}.")
    self.config = config
    weights = _random_weights(config, rngs.params())
    self.embed = nnx.Param(weights["embed"])  # [V, D]
    self.layers = _LayerStack(
      fuse_projections({name: weights[f"layers.{name}"] for name in layer_params(config)}), config
    )
    self.final_norm = nnx.Param(weights["final_norm"])  # [D]
    if not config.tie_embeddings:
      self.lm_head = nnx.Param(weights["lm_head"])  # [D, V]
    # What `sharding.shard` split over a mesh's model axis; None: never sharded (the program has no constraints).
    self.partitioning: Partitioning | None = None

  # --- weights interface (shared with the GGUF loader) ----------------------

  @classmethod
  def from_weights(cls, config: TransformerConfig, weights: Mapping[str, np.ndarray]) -> Transformer:
    """Builds a model from named arrays, without a random initialisation.

    Args:
      config: the model configuration.
      weights: exactly the keys of `weight_shapes(config)` with those shapes:
        "embed" [V, D], "layers.attn_norm" [L, D], "layers.wq" [L, D, H*Dh],
        "layers.wk"/"layers.wv" [L, D, Hkv*Dh], "layers.wo" [L, H*Dh, D],
        "layers.mlp_norm" [L, D], "layers.w_gate"/"layers.w_up" [L, D, F],
        "layers.w_down" [L, F, D], "final_norm" [D], "lm_head" [D, V] only
        when `config.tie_embeddings` is False, and "layers.bq" [L, H*Dh],
        "layers.bk"/"layers.bv" [L, Hkv*Dh] only when `config.qkv_bias` is
        True. `x @ W` orientation; Q/K columns (and biases) in "rotate_half"
        order. Any float dtype; cast to `config.dtype`.

    Returns:
      The model.

    Raises:
      ValueError: a key is missing or unexpected, or an array has the wrong shape.

    Example:
      >>> clone = Transformer.from_weights(model.config, model.to_weights())  # doctest: +SKIP
    """
    expected = weight_shapes(config)
    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - expected.keys())
    biases = {f"layers.{name}" for name in _BIAS_PARAMS}
    if missing:
      hint = " (config.qkv_bias is True)" if biases & set(missing) else ""
      raise ValueError(f"weights: missing key(s) {missing}{hint} for {config}.")
    if unexpected:
      hint = " (config.tie_embeddings is True)" if "lm_head" in unexpected else ""
      hint += " (config.qkv_bias is False)" if biases & set(unexpected) else ""
      raise ValueError(f"weights: unexpected key(s) {unexpected}{hint}.")
    for name, shape in expected.items():
      got = tuple(np.shape(weights[name]))
      if got != shape:
        raise ValueError(f"weights[{name!r}]: expected shape {shape}, got {got}.")

    # Build the structure abstractly (no random numbers), then fill it in.
    graphdef, state = nnx.split(nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0))))
    values = {
      name: jnp.asarray(weights[name], dtype=config.dtype) for name in expected if not name.startswith("layers.")
    }

    def fused(index):  # one layer's (or, under scan, every layer's) parameters, read from the inputs' slices
      return fuse_projections(
        {name: jnp.asarray(weights[f"layers.{name}"][index], dtype=config.dtype) for name in layer_params(config)}
      )

    # Block by block when unrolled: a 1.5B model in float32 is 7 GB, and a stacked
    # copy of it beside the blocks (and the inputs) would not fit in 24 GB.
    if config.scan_layers:
      values["layers"] = fused(slice(None))
    else:
      values["layers"] = {f"block{i}": fused(i) for i in range(config.num_layers)}
    nnx.replace_by_pure_dict(state, values)
    return nnx.merge(graphdef, state)

  def to_weights(self) -> dict[str, np.ndarray]:
    """Returns the parameters as NumPy arrays under the keys of `from_weights`.

    Arrays are in `config.dtype` (bfloat16 via `ml_dtypes`), so
    `Transformer.from_weights(config, model.to_weights())` is exact.

    Example:
      >>> model.to_weights()["layers.wq"].shape  # (L, D, H*Dh)  # doctest: +SKIP
    """
    out = {
      name: np.asarray(getattr(self, name)[...])
      for name in weight_shapes(self.config)
      if not name.startswith("layers.")
    }
    fused = {name: np.asarray(w) for name, w in self.layers.stacked(self.config).items()}
    out.update({f"layers.{name}": w for name, w in split_projections(fused, self.config).items()})
    return out

  # --- many devices --------------------------------------------------------------

  def _shard(self, mesh: jax.sharding.Mesh) -> Transformer:
    """`sharding.shard` for a transformer: the parameters placed on `mesh` (a new model; self is unchanged)."""
    c = self.config
    part = Partitioning.for_shapes(
      model_size=sharding.model_axis_size(mesh),
      num_heads=c.num_heads,
      num_kv_heads=c.num_kv_heads,
      d_ff=c.d_ff,
      vocab_size=c.vocab_size,
    )
    placement = (mesh, part, 0)
    # A projection split over devices is held as separate matrices (the sharding module explains why).
    layout = {
      "q_width": c.num_heads * c.head_dim,
      "kv_width": c.num_kv_heads * c.head_dim,
      "d_ff": c.d_ff,
      "fuse_attention": not part.heads,
      "fuse_mlp": not part.mlp,
    }
    if c.scan_layers:
      layers = relayout(self.layers.stacked(c), **layout)
    else:
      layers = [relayout(block, **layout) for block in self.layers.blocks(c)]
    model = nnx.eval_shape(lambda: Transformer(c, rngs=nnx.Rngs(0)))  # the structure, without random numbers
    model.embed = _make_param(self.embed[...], "embed", placement)
    model.layers = _LayerStack(layers, c, placement)
    model.final_norm = _make_param(self.final_norm[...], "final_norm", placement)
    if not c.tie_embeddings:
      model.lm_head = _make_param(self.lm_head[...], "lm_head", placement)
    model.partitioning = part
    return model

  # --- model protocol ---------------------------------------------------------

  def init_cache(self, batch_size: int, max_length: int) -> KVCache:
    """A zero KV cache with `max_length` slots per row.

    Args:
      batch_size: B.
      max_length: S, number of slots; writes at positions >= S are dropped.

    Returns:
      `KVCache` with k, v of shape [L, B, Hkv, S, Dh] in `config.dtype`.

    Example:
      >>> model.init_cache(2, 16).k.shape  # (L, 2, Hkv, 16, Dh)  # doctest: +SKIP
    """
    for name, value in (("batch_size", batch_size), ("max_length", max_length)):
      if not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}.")
    c = self.config
    shape = (c.num_layers, batch_size, c.num_kv_heads, max_length, c.head_dim)
    return constrain_cache(self.partitioning, KVCache(k=jnp.zeros(shape, c.dtype), v=jnp.zeros(shape, c.dtype)))

  @property
  def max_length(self) -> int | None:
    """The longest context the model serves (`config.max_length`); the loops check it."""
    return self.config.max_length

  def __call__(
    self,
    tokens: jax.Array,  # int32 [B, T]
    positions: jax.Array,  # int32 [B, T]
    cache: KVCache,  # k, v: [L, B, Hkv, S, Dh]
    *,
    return_features: bool = False,
    cache_slots: jax.Array | None = None,  # int32 [B, T]
    attention_mask: jax.Array | None = None,  # bool [B, T, S]
  ) -> tuple[jax.Array, KVCache] | tuple[jax.Array, jax.Array, KVCache]:
    """Writes the tokens' keys/values at their positions and returns their logits.

    Args:
      tokens: int [B, T] token ids. Ids outside [0, V) (e.g. -1 padding) are
        clipped into range so they never produce NaNs; their logits are junk.
      positions: int [B, T] position of each token, per row. It picks the RoPE
        angle and the cache slot; the query sees exactly the slots s <= position.
        Positions outside [0, S) are not written (their keys/values are dropped).
      cache: the `KVCache` to write into.
      return_features: static; also return the outputs of the blocks named by
        `config.feature_layers`, concatenated (what an EAGLE-style drafter
        reads). False leaves the compiled program exactly as without it.
      cache_slots: int [B, T] or None: the slot each token's keys/values are
        written to (dropped outside [0, S)); None writes at `positions`.
      attention_mask: bool [B, T, S] or None: query t of row b sees slot s iff
        attention_mask[b, t, s]; None means s <= positions[b, t]. The call's
        own keys are written before anyone attends, so a query may see its
        own slot and those of other tokens of the call.

    Trees of drafts. A tree verification feeds the last context token t (the
    root) and N draft nodes in one call. A node's RoPE position is its depth
    below the root (siblings share a position), but each node needs its own
    slot, and a query must see the committed context and its own ancestors
    only. For a row of context length L (t at L-1) and the tree
    root -> {n0, n1}, n0 -> {n2}:

        slot:            ... L-2   L-1   L     L+1   L+2
        token:           ... u     t     n0    n1    n2
        position:        ... L-2   L-1   L     L     L+1
        query n2 sees:   ... x     x     x     .     x
        query n1 sees:   ... x     x     .     x     .

    i.e. `positions = L-1 + depth`, `cache_slots = L-1 + [0, 1, 2, 3]` and a
    mask of the slots below L plus each node's ancestors and itself
    (`specdec_jax.drafts.static_tree.tree_attention_mask` builds it). After
    verification, `copy_cache_slots` moves the accepted path's keys/values to
    the slots its positions name (L, L+1, ...), where the next round expects
    them; the other nodes' slots hold junk that no later query sees. Without
    these two arguments the call is the chain call, compiled exactly as before.

    Returns:
      (logits float32 [B, T, V], the updated cache), or with `return_features`
      (logits, features [B, T, F] in `config.dtype`, cache), where
      F = len(feature_layers) * D and features[..., i*D:(i+1)*D] is the residual
      stream after block `feature_layers[i]`.

    Raises:
      ValueError: at trace time, on wrong ranks, dtypes, or shapes that do not
        match each other or the cache; `return_features` without feature_layers.

    Example:
      >>> # prefill a right-padded prompt, then decode one token per row
      >>> prefill_positions = jnp.broadcast_to(jnp.arange(P), (B, P))  # doctest: +SKIP
      >>> logits, cache = model(prompt, prefill_positions, cache)  # doctest: +SKIP
      >>> logits, cache = model(next_tok[:, None], lengths[:, None], cache)  # doctest: +SKIP
    """
    self._check_inputs(tokens, positions, cache)
    check_tree_args(tokens, cache_slots, attention_mask, cache.max_length)
    c = self.config
    if return_features and not c.feature_layers:
      raise ValueError("return_features=True needs TransformerConfig.feature_layers (the blocks to return).")
    # A vocabulary-parallel embedding is read by an explicit shard_map (each device its own rows, then a
    # psum of [B, T, D]): left to XLA, the GPU program all-gathered the whole table every call.
    x = sharding.embed_lookup(self.embed[...], tokens, self.partitioning)  # [B, T, D], split by rows
    ctx = AttentionContext.create(
      positions, cache.max_length, c, cache_slots=cache_slots, attention_mask=attention_mask
    )

    kernels = self._block_kernels(x, cache, tree=attention_mask is not None)
    rows = self._invariant_length(tokens, kernels, cache_slots, attention_mask)
    if rows:  # the same call, padded to a fixed shape (see _invariant_length); the padding's outputs dropped
      t = tokens.shape[1]
      pad = ((0, 0), (0, rows - t))
      out = self(
        jnp.pad(tokens, pad),
        jnp.pad(positions, pad, constant_values=cache.max_length),  # outside the cache: written nowhere
        cache,
        return_features=return_features,
      )
      return (*(a[:, :t] for a in out[:-1]), out[-1])
    tree = tree_kernel_args(ctx, cache_slots, attention_mask)

    def block(carry, layer):
      x, k_cache, v_cache = carry
      p, i = layer  # this layer's parameters, its index
      if kernels is not None:
        x, k_cache, v_cache = pallas_block(
          c, x, p, k_cache, v_cache, i, positions, ctx, interpret=kernels == "pallas_interpret", **tree
        )
      else:
        attn_in = rms_norm(x, p["attn_norm"], c.rms_norm_eps)
        x, k_cache, v_cache = decoder_block(c, x, attn_in, p, k_cache, v_cache, i, ctx)
      # Each block's output is kept only when features are asked for.
      return (x, k_cache, v_cache), (x if return_features else None)

    carry = (x, cache.k, cache.v)
    if c.scan_layers:
      layer_ids = jnp.arange(c.num_layers, dtype=jnp.int32)
      (x, k_cache, v_cache), outs = jax.lax.scan(block, carry, (self.layers.stacked(c), layer_ids))
    else:
      outs = []
      for i in range(c.num_layers):
        carry, out = block(carry, (self.layers.block(i), i))
        outs.append(out)
      x, k_cache, v_cache = carry

    logits = self._logits(x, fixed_rows=kernels is not None)
    # Vocabulary-parallel logits stay split, [B, T, V] as P("data", None, "model"), for the sampler.
    if self.partitioning is not None:
      logits = sharding.constrain(logits, self.partitioning.logits_spec())
    cache = constrain_cache(self.partitioning, KVCache(k=k_cache, v=v_cache))
    if not return_features:
      return logits, cache
    features = jnp.concatenate([outs[i] for i in c.feature_layers], axis=-1)  # [B, T, F]
    return logits, features, cache

  def _logits(self, x: jax.Array, fixed_rows: bool) -> jax.Array:
    """Final norm and head: float32 logits [B, T, V] of the residual x [B, T, D].

    With `fixed_rows` (the call took the Pallas blocks, B*T <= MAX_ROWS) the rows are padded to
    MAX_ROWS first. The kernels compute every row on tiles of MAX_ROWS whatever B*T; with the head
    on a fixed shape too, a token's logits are the same bits in a one-token step and in a
    verification call, so greedy speculation equals plain greedy decoding (batch invariance).
    """
    c = self.config
    lm_head = self.embed[...].T if c.tie_embeddings else self.lm_head[...]  # [D, V]

    def head(x):  # accumulates the logits in float32 whatever the compute dtype
      return linear(rms_norm(x, self.final_norm[...], c.rms_norm_eps), lm_head, preferred_element_type=jnp.float32)

    return on_fixed_rows(head, x) if fixed_rows else head(x)

  def _invariant_length(self, tokens, kernels, cache_slots, attention_mask) -> int | None:
    """T to pad this call to so that XLA's blocks are batch-invariant, or None (no padding).

    XLA picks its matrix-product and reduction kernels by shape, so a token's logits in a one-token
    step and in a verification of K+1 tokens round differently, and greedy speculation can part
    from plain greedy decoding at a near-tie. On a GPU a chain call of B*T <= MAX_ROWS rows on
    XLA's blocks therefore runs at the fixed T = MAX_ROWS // B (padding rows at a position past the
    cache: they write nothing), which costs little where a step reads its weights from memory
    (bench/RESULTS.md). The Pallas blocks are invariant by themselves (their XLA products run in
    `on_fixed_rows`); trees, sharded models (but for each device's rows of a data-parallel loop,
    `sharding.runs_locally`) and CPUs (where rows cost time) keep their shape. A
    tree's tokens are not invariant on either path: their keys sit in other cache slots than a
    chain's, so the attention sums them in another order.
    """
    b, t = tokens.shape
    if (
      kernels is not None
      or not sharding.runs_locally(self.partitioning)
      or cache_slots is not None
      or attention_mask is not None
      or jax.default_backend() != "gpu"
      or b * t > mlp.MAX_ROWS
    ):
      return None
    rows = mlp.MAX_ROWS // b
    return rows if rows > t else None

  def _block_kernels(self, x, cache: KVCache, tree: bool) -> str | None:
    """`config.kernels` where this call can take the Pallas blocks, else None (XLA's): decided at trace time."""
    if self.config.scan_layers:
      return None
    return block_kernels(self.config, self.partitioning, x, self.layers.block(0), cache.k, tree=tree)

  def copy_cache_slots(self, cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    """Copies every layer's keys/values from slots `src` to slots `dst`, per row (see `copy_kv_slots`).

    The model protocol's tree extension: after a tree verification, the loop
    moves the accepted path from its nodes' slots to the slots of its positions.

    Example:
      >>> cache = model.copy_cache_slots(cache, jnp.array([[7, 9]]), jnp.array([[5, 6]]))  # doctest: +SKIP
    """
    return copy_kv_slots(cache, src, dst)

  def _check_inputs(self, tokens, positions, cache) -> None:
    c = self.config
    if not isinstance(cache, KVCache):
      raise ValueError(f"cache must be a KVCache (from init_cache), got {type(cache).__name__}.")
    for name, a in (("tokens", tokens), ("positions", positions)):
      if jnp.ndim(a) != 2:
        raise ValueError(f"{name} must have shape [B, T], got shape {jnp.shape(a)}.")
      if not jnp.issubdtype(jnp.result_type(a), jnp.integer):
        raise ValueError(f"{name} must be an integer array [B, T], got dtype {jnp.result_type(a)}.")
    if jnp.shape(positions) != jnp.shape(tokens):
      raise ValueError(
        f"positions must have the shape of tokens [B, T] = {jnp.shape(tokens)}, got {jnp.shape(positions)}."
      )
    B = jnp.shape(tokens)[0]
    expected = (c.num_layers, B, c.num_kv_heads, cache.max_length, c.head_dim)
    for name, a in (("cache.k", cache.k), ("cache.v", cache.v)):
      if jnp.shape(a) != expected:
        raise ValueError(f"{name} must have shape [L, B, Hkv, S, Dh] = {expected} (B from tokens), got {jnp.shape(a)}.")
      if jnp.result_type(a) != c.dtype:
        raise ValueError(f"{name} must have dtype {c.dtype} (config.dtype), got {jnp.result_type(a)}.")


def constrain_cache(part: Partitioning | None, cache: KVCache) -> KVCache:
  """A sharded model's cache: rows over "data", heads over "model" where they are split (`Partitioning.cache_spec`).

  `part` None (a model never sharded): the cache as it is, so that model's program does not change.
  """
  if part is None:
    return cache
  spec = part.cache_spec()
  return KVCache(k=sharding.constrain(cache.k, spec), v=sharding.constrain(cache.v, spec))


def check_tree_args(tokens, cache_slots, attention_mask, max_length: int) -> None:
  """Trace-time checks of `cache_slots` [B, T] and `attention_mask` [B, T, S] (None passes)."""
  b, t = jnp.shape(tokens)
  if cache_slots is not None and (
    jnp.shape(cache_slots) != (b, t) or not jnp.issubdtype(jnp.result_type(cache_slots), jnp.integer)
  ):
    raise ValueError(
      f"cache_slots must be an integer array [B, T] = {(b, t)}, got "
      f"{jnp.result_type(cache_slots)} {jnp.shape(cache_slots)}."
    )
  if attention_mask is not None and (
    jnp.shape(attention_mask) != (b, t, max_length) or jnp.result_type(attention_mask) != jnp.bool_
  ):
    raise ValueError(
      f"attention_mask must be a bool array [B, T, S] = {(b, t, max_length)} (S = the cache's "
      f"max_length), got {jnp.result_type(attention_mask)} {jnp.shape(attention_mask)}."
    )


def copy_kv_slots(cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
  """Copies keys/values of all layers from slots src[b, m] to dst[b, m] of row b.

  All sources are read before anything is written, so sources and
  destinations may overlap. Destinations outside [0, S) are dropped (the
  loop sends the moves it does not want there); sources are clipped into range.

  Args:
    cache: a `KVCache` [L, B, Hkv, S, Dh].
    src, dst: int [B, M].

  Returns:
    The updated cache.

  Example:
    >>> cache = copy_kv_slots(cache, jnp.array([[7, 9]]), jnp.array([[5, 6]]))  # doctest: +SKIP
  """
  b, s = cache.batch_size, cache.max_length
  if jnp.shape(src) != jnp.shape(dst) or jnp.ndim(src) != 2 or jnp.shape(src)[0] != b:
    raise ValueError(
      f"src and dst must be int arrays of one shape [B={b}, M], got {jnp.shape(src)} and {jnp.shape(dst)}."
    )
  rows = jnp.arange(b, dtype=jnp.int32)[:, None]
  src = jnp.clip(src.astype(jnp.int32), 0, s - 1)
  dst = dst.astype(jnp.int32)
  dst = jnp.where((dst >= 0) & (dst < s), dst, s)

  def move(x):  # [L, B, Hkv, S, Dh]; the indexed shape is [B, M, L, Hkv, Dh]
    return x.at[:, rows, :, dst].set(x[:, rows, :, src], mode="drop")

  return KVCache(k=move(cache.k), v=move(cache.v))


@flax.struct.dataclass
class AttentionContext:
  """What every attention block of one call shares: RoPE tables, mask, write slots.

  Built once per call by `AttentionContext.create` from the positions; the
  transformer and the EAGLE drafter both use it, so their slot rules agree.
  """

  cos: jax.Array  # [B, T, 1, Dh]
  sin: jax.Array  # [B, T, 1, Dh]
  mask: jax.Array  # bool [B, 1, T, S]: query (b, t) sees slot s iff s <= positions[b, t]
  slots: jax.Array  # int32 [B, T]: write slot of each token, S (dropped) when out of range
  rows: jax.Array  # int32 [B, 1]

  @classmethod
  def create(
    cls,
    positions: jax.Array,
    max_length: int,
    config: TransformerConfig,
    *,
    cache_slots: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
  ) -> AttentionContext:
    """The context of one call; `cache_slots` / `attention_mask` as in `Transformer.__call__` (None: positions)."""
    b, _ = positions.shape
    s = max_length
    cos, sin = _rope_tables(positions, config.head_dim, config.rope_theta)
    if attention_mask is None:
      mask = jnp.arange(s, dtype=jnp.int32)[None, None, :] <= positions[:, :, None]
    else:
      mask = attention_mask.astype(bool)
    slots = positions if cache_slots is None else cache_slots.astype(jnp.int32)
    # Out-of-range slots become slot S, which mode="drop" discards. Needed for
    # negative ones too: JAX indexing wraps -1 to S-1 even in drop mode.
    slots = jnp.where((slots >= 0) & (slots < s), slots, s)
    return cls(
      cos=cos,
      sin=sin,
      mask=mask[:, None, :, :],
      slots=slots.astype(jnp.int32),
      rows=jnp.arange(b, dtype=jnp.int32)[:, None],
    )


def decoder_block(c: TransformerConfig, x, attn_in, p, k_cache, v_cache, i, ctx: AttentionContext):
  """One pre-norm decoder block on the residual stream x [B, T, D].

  `attn_in` is what the attention projections read: `rms_norm(x)` in a plain
  block, a wider input in the EAGLE drafter's first block. Writes layer i's
  keys/values at `ctx.slots` of k_cache/v_cache [L, B, Hkv, S, Dh] and returns
  (x, k_cache, v_cache). `p` holds the block's parameters, fused (`wqkv`,
  `w_gate_up`: the transformer) or separate (`wq`, `wk`, `wv`, `w_gate`,
  `w_up`: the EAGLE drafter).
  """
  x, k_cache, v_cache = attention_block(c, x, attn_in, p, k_cache, v_cache, i, ctx)
  return mlp_block(c, x, p), k_cache, v_cache


def block_kernels(c: TransformerConfig, partitioning, x, p, k_cache, prefix=None, *, tree: bool = False) -> str | None:
  """`c.kernels` where a call on x [B, T, D] can take `pallas_block` with block parameters p, else None.

  Decided at trace time from static facts: XLA's blocks serve sharded models (not a data-parallel loop's
  per-device program, `sharding.runs_locally`), a CPU or float32 for
  "pallas", tree calls (`tree`) of a config with `tree_kernels=False`, and shapes the kernels do not take
  (more than 16 rows, B*T, tree calls included; see `attention.check_args`). `prefix`: as for `pallas_block`.

  Example:
    >>> block_kernels(TransformerConfig.tiny(64), None, jnp.zeros((1, 1, 32)), {}, None) is None  # kernels="xla"
    True
  """
  if c.kernels == "xla" or not sharding.runs_locally(partitioning) or (tree and not c.tree_kernels):
    return None
  if c.kernels == "pallas" and (
    jax.default_backend() != "gpu" or c.dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
  ):
    return None
  if (
    attention.check_args(
      x, p["wqkv"], p["wo"], k_cache, c.num_heads, c.num_kv_heads, None if prefix is None else prefix[0], p.get("bqkv")
    )
    is not None
  ):
    return None
  if mlp._check_args(x, p["mlp_norm"], p["w_gate_up"], p["w_down"]) is not None:
    return None
  return c.kernels


def tree_kernel_args(ctx: AttentionContext, cache_slots, attention_mask) -> dict:
  """`pallas_block`'s slots and mask for a call given these tree arguments (None for those not given)."""
  return {
    "slots": None if cache_slots is None else ctx.slots,
    "mask": None if attention_mask is None else ctx.mask[:, 0],
  }


def pallas_block(
  c: TransformerConfig,
  x,
  p,
  k_cache,
  v_cache,
  i,
  positions,
  ctx: AttentionContext,
  *,
  interpret: bool,
  attn_blocks=None,
  mlp_blocks=None,
  prefix=None,
  slots=None,
  mask=None,
):
  """`decoder_block` of a plain (fused-projection) block as Pallas kernels: a call of <= 16 rows.

  `block_kernels` decides when a call may take it (`TransformerConfig.kernels`); the tile sizes
  default to the fastest measured (`attn_blocks`, `mlp_blocks`: for benchmarks). Without `mlp_blocks`,
  a model whose MLP runs faster on XLA's blocks (`mlp.xla_is_faster`: wide models) takes `xla_mlp_rows`.
  x is [B, T, D] with B*T <= 16, positions int32 [B, T]; returns (x, k_cache, v_cache) like `decoder_block`.
  `prefix`: None, or (e [B, T, D], its norm weight [D]) for a block whose attention reads
  concat(rms_norm(e), rms_norm(x, p["attn_norm"])) through p["wqkv"] [2D, ...] (the EAGLE
  drafter's first block). `slots` [B, T] and `mask` [B, T, S]: a tree call's write slots and
  visibility (`ctx.slots`, `ctx.mask[:, 0]`; None: at `positions`, by the chain rule). A block
  with q/k/v biases (`config.qkv_bias`) holds them as p["bqkv"] [(H + 2 Hkv) Dh], which the q|k|v
  kernel adds to its float32 products.

  Example:
    >>> x, k, v = pallas_block(cfg, x, model.layers.block(i), cache.k, cache.v, i, positions, ctx,
    ...                        interpret=False)  # doctest: +SKIP
  """
  x, k_cache, v_cache = pallas_attention(
    c,
    x,
    p,
    k_cache,
    v_cache,
    i,
    positions,
    ctx,
    interpret=interpret,
    blocks=attn_blocks,
    prefix=prefix,
    slots=slots,
    mask=mask,
  )
  if mlp_blocks is None and mlp.xla_is_faster(c.d_model, c.d_ff, c.dtype):
    return xla_mlp_rows(c, x, p), k_cache, v_cache
  x = mlp.fused_mlp(
    x,
    p["mlp_norm"],
    p["w_gate_up"],
    p["w_down"],
    c.rms_norm_eps,
    interpret=interpret,
    blocks=mlp_blocks or mlp.BEST_BLOCKS,
  )
  return x, k_cache, v_cache


def pallas_attention(
  c: TransformerConfig,
  x,
  p,
  k_cache,
  v_cache,
  i,
  positions,
  ctx: AttentionContext,
  *,
  interpret: bool,
  blocks=None,
  prefix=None,
  slots=None,
  mask=None,
):
  """The attention half of `pallas_block`: `attention.fused_attention` on block parameters p, with the tiles
  `attention.blocks_for` picks for the model's width unless `blocks` says otherwise; other arguments and the
  result (x, k_cache, v_cache) as for `pallas_block`.

  Example:
    >>> x, k, v = pallas_attention(cfg, x, model.layers.block(i), cache.k, cache.v, i, positions, ctx,
    ...                            interpret=False)  # doctest: +SKIP
  """
  half = c.head_dim // 2
  return attention.fused_attention(
    x,
    p["attn_norm"],
    p["wqkv"],
    p["wo"],
    k_cache,
    v_cache,
    i,
    positions,
    ctx.cos[:, :, 0, :half],
    ctx.sin[:, :, 0, :half],
    num_heads=c.num_heads,
    num_kv_heads=c.num_kv_heads,
    eps=c.rms_norm_eps,
    interpret=interpret,
    blocks=blocks or attention.blocks_for(c.d_model),
    prefix=prefix,
    slots=slots,
    mask=mask,
    bias=p.get("bqkv"),
  )


def xla_mlp_rows(c: TransformerConfig, x, p):
  """`mlp_block` of x [B, T, D] (B*T <= MAX_ROWS) computed on MAX_ROWS rows, whatever B*T.

  XLA picks its products' kernels by shape; on a fixed shape a row's result is the same bits in a
  one-token step and in a verification call, as on the Pallas kernels (batch invariance). Rows
  cost little here: the MLP reads its weights from memory once, whatever the rows.

  Example:
    >>> xla_mlp_rows(cfg, x, model.layers.block(0)).shape == x.shape  # doctest: +SKIP
    True
  """
  return on_fixed_rows(lambda rows: mlp_block(c, rows, p), x)


def on_fixed_rows(fn, x: jax.Array) -> jax.Array:
  """fn of x [B, T, D] (B*T <= MAX_ROWS) run on its rows padded with zeros to [1, MAX_ROWS, D]: [B, T, N].

  fn maps [1, MAX_ROWS, D] to [1, MAX_ROWS, N] row by row; the padding rows' results are dropped. One shape
  whatever B*T, so a row's bits do not depend on the call's size (batch invariance). The shape alone is
  not enough: XLA fused the padding and the slicing, which depend on B*T, into fn's products, and a
  one-token step and a verification call then summed some rows in different orders (on an H200:
  bench/RESULTS.md). Optimization barriers around fn keep its fusions the same computation in every call.

  Example:
    >>> on_fixed_rows(lambda r: 2 * r, jnp.ones((1, 3, 4))).shape
    (1, 3, 4)
  """
  b, t, d = x.shape
  rows = jnp.zeros((1, mlp.MAX_ROWS, d), x.dtype).at[0, : b * t].set(x.reshape(b * t, d))
  out = jax.lax.optimization_barrier(fn(jax.lax.optimization_barrier(rows)))
  return out[0, : b * t].reshape(b, t, -1)


def project_qkv(c: TransformerConfig, attn_in, p):
  """q [B, T, H, Dh], k and v [B, T, Hkv, Dh] from attn_in [B, T, K], before RoPE.

  One matmul through a fused `wqkv` [K, (H + 2 Hkv) Dh], or three through `wq`, `wk`, `wv` (a projection
  `sharding.shard` split). Biases, where the block has them (`config.qkv_bias`: a fused `bqkv`
  [(H + 2 Hkv) Dh] or `bq`, `bk`, `bv`), are added to the float32 product before its one rounding to the
  model's dtype, as the Pallas q|k|v kernel does (and a fused GEMM-with-bias would).

  Example:
    >>> q, k, v = project_qkv(cfg, rms_norm(x, p["attn_norm"], cfg.rms_norm_eps), p)  # doctest: +SKIP
    >>> q.shape  # (B, T, H, Dh)  # doctest: +SKIP
  """
  b, t, _ = attn_in.shape
  qd, kvd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

  def biased(w, bias):
    # Without a bias the product stays `attn_in @ w`, the program of a model without biases.
    if bias is None:
      return linear(attn_in, w)
    y = linear(attn_in, w, preferred_element_type=jnp.float32)
    return (y + bias.astype(jnp.float32)[None, None, :]).astype(jnp.result_type(attn_in, w))

  if "wqkv" in p:  # one matmul
    qkv = biased(p["wqkv"], p.get("bqkv"))
    q, k, v = qkv[..., :qd], qkv[..., qd : qd + kvd], qkv[..., qd + kvd :]
  else:
    q, k, v = (biased(p[w], p.get(bias)) for w, bias in (("wq", "bq"), ("wk", "bk"), ("wv", "bv")))
  return (
    q.reshape(b, t, c.num_heads, c.head_dim),
    k.reshape(b, t, c.num_kv_heads, c.head_dim),
    v.reshape(b, t, c.num_kv_heads, c.head_dim),
  )


def attention_block(c: TransformerConfig, x, attn_in, p, k_cache, v_cache, i, ctx: AttentionContext):
  """The attention half of `decoder_block`: x + attention(attn_in), with layer i's cache write."""
  b, t, _ = x.shape
  qd = c.num_heads * c.head_dim
  q, k, v = project_qkv(c, attn_in, p)
  q, k = _apply_rope(q, ctx.cos, ctx.sin), _apply_rope(k, ctx.cos, ctx.sin)
  k_cache = _write_slots(k_cache, i, ctx, k)
  v_cache = _write_slots(v_cache, i, ctx, v)
  k_all = jnp.swapaxes(k_cache[i], 1, 2)  # [B, S, Hkv, Dh]
  v_all = jnp.swapaxes(v_cache[i], 1, 2)
  attn = jax.nn.dot_product_attention(q, k_all, v_all, mask=ctx.mask)  # [B, T, H, Dh]
  return x + linear(attn.reshape(b, t, qd), p["wo"]), k_cache, v_cache


def _write_slots(cache: jax.Array, i, ctx: AttentionContext, new: jax.Array) -> jax.Array:
  """cache[i, b, :, ctx.slots[b, t]] = new[b, t] for cache [L, B, Hkv, S, Dh], new [B, T, Hkv, Dh] (slot S: dropped)."""
  if sharding.axis_size(sharding.DATA_AXIS) == 1:
    # One scatter of B*T rows into the loop-carried cache, which XLA updates in
    # place. (Indices split by a slice, so the indexed shape is [B, T, Hkv, Dh], like new's.)
    return cache.at[i, ctx.rows, :, ctx.slots].set(new, mode="drop")
  # Rows split over the data axis: the same writes as a scatter batched over rows
  # (vmap gives it batching dimensions), which XLA partitions row by row; the
  # scatter above made every device all-gather every row's keys and values.
  layer = jax.vmap(lambda c, s, n: c.at[:, s].set(jnp.swapaxes(n, 0, 1), mode="drop"))(cache[i], ctx.slots, new)
  return cache.at[i].set(layer)


def mlp_block(c: TransformerConfig, x, p):
  """The MLP half of `decoder_block`: x + SwiGLU(rms_norm(x))."""
  h = rms_norm(x, p["mlp_norm"], c.rms_norm_eps)
  if "w_gate_up" in p:  # one matmul
    gate_up = linear(h, p["w_gate_up"])
    gate, up = gate_up[..., : c.d_ff], gate_up[..., c.d_ff :]
  else:
    gate, up = linear(h, p["w_gate"]), linear(h, p["w_up"])
  return x + linear(jax.nn.silu(gate) * up, p["w_down"])


def linear(x: jax.Array, w: jax.Array, preferred_element_type=None) -> jax.Array:
  """x [..., K] @ w [K, N] -> [..., N]; on a GPU, a product of one row runs as a product of two.

  XLA rewrites a product with a single row into a multiply and a reduction ("dot
  strength reduction"), which reads the weights more slowly than its matrix-product
  kernels: a one-row call then costs more than a verification call of several rows
  (bench/RESULTS.md). The row is computed twice in one matrix product and the copy
  dropped; elsewhere (CPU, more rows) this is `jnp.matmul`.

  Example:
    >>> linear(jnp.ones((1, 1, 4)), jnp.ones((4, 3))).shape
    (1, 1, 3)
  """
  if math.prod(x.shape[:-1]) != 1 or jax.default_backend() != "gpu":
    return jnp.matmul(x, w, preferred_element_type=preferred_element_type)
  two = jnp.concatenate([x.reshape(1, -1)] * 2)
  return jnp.matmul(two, w, preferred_element_type=preferred_element_type)[:1].reshape(*x.shape[:-1], w.shape[-1])


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """x * rsqrt(mean(x^2) + eps) * weight over the last axis, in float32."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
  return (y * weight.astype(jnp.float32)[None, None, :]).astype(x.dtype)


def _rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
  """cos and sin [B, T, 1, Dh] for "rotate_half" RoPE (dims i and i + Dh/2 pair up)."""
  inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)  # [Dh/2]
  angles = positions.astype(jnp.float32)[:, :, None] * inv_freq[None, None, :]  # [B, T, Dh/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, Dh]
  return jnp.cos(angles), jnp.sin(angles)


def _apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotates x [B, T, N, Dh] by the position angles, in float32."""
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)  # HF rotate_half
  return (x32 * cos + rotated * sin).astype(x.dtype)
