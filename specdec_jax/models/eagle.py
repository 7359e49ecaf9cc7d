"""An EAGLE-style feature drafter: it predicts the target's next token from the target's own hidden states.

An independent small draft model sees only tokens. A feature drafter also reads
the target's *features* (the outputs of a few of its blocks: a low, a middle and
a high one, as in EAGLE-3, arXiv 2503.01840), so one decoder block is enough to
agree with the target far more often.

One entry of the drafter at position p reads the target's features f_p of the
token at p and the token x_{p+1} that followed it, and predicts x_{p+2}:

    target:    x_p ──► f_p (features of blocks feature_layers)
    drafter:   hidden = fuse(f_p)              [F] -> [D]
               block 0 reads concat(norm(embed(x_{p+1})), norm(hidden)) [2D]
               blocks 1.. as in the target, then final norm, output head
               -> logits for x_{p+2}, and its own hidden g_p (stands in for f_{p+1})

Drafting K tokens past a context of length L (target features known up to L-2):

    slot:        ...  L-2            L-1            L              L+K-3
    hidden in:        fuse(f_{L-2})  g_{L-2}        g_{L-1}   ...
    token in:         x_{L-1}        d_1            d_2       ...  d_{K-1}
    predicts:         d_1            d_2            d_3       ...  d_K

Entries from target features (the prefill, and each round's *catch-up* on the
tokens the target just verified) and entries from the drafter's own hiddens
share one KV cache with the usual slot rules: each entry writes its keys and
values at its position, writes out of range are dropped, a query at p sees the
slots s <= p, and a later entry at the same position overwrites an earlier one,
so rejected drafts are rolled back by the loop's length arithmetic alone.

The token embedding and the output head are the target's (`TargetWeight`:
frozen, not saved with the drafter). The head may be restricted to a *draft
vocabulary* (the most frequent tokens, as EAGLE-3 does): logits of the other
tokens are -inf, so the drafter never proposes them, and the rejection sampler
stays exact because it only needs the probabilities the drafts came from.

Blocks with q/k/v biases. The drafter's blocks copy the target's block
architecture (`for_target` keeps the target's config but for `num_layers` and
`feature_layers`), so a drafter for a Qwen2 target (`qkv_bias=True`) has biases
in its blocks' q/k/v projections too ("first.bq", "first.bk", "first.bv", and
"rest.b*" [L-1, ...] for more blocks), saved and loaded with its weights, as
EAGLE heads trained for such targets do. For a head without them, build its
`EagleConfig` with `layers=target.config.replace(num_layers=..., feature_layers=(),
qkv_bias=False)`.

Training ("training-time test", EAGLE-3): `unrolled_logits` runs the drafter on
a whole sequence at depths 0..n-1, where depth j feeds each position the hidden
its own depth j-1 produced one position earlier, and attends exactly as the
cached loop does at draft step j (tests check the two agree).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specdec_jax.models import sharding
from specdec_jax.models.config import TransformerConfig
from specdec_jax.models.sharding import Partitioning, relayout
from specdec_jax.models.transformer import (
  _BIAS_PARAMS,
  _LAYER_PARAMS,
  AttentionContext,
  KVCache,
  Transformer,
  _apply_rope,
  _make_param,
  _rope_tables,
  block_kernels,
  check_tree_args,
  constrain_cache,
  copy_kv_slots,
  decoder_block,
  layer_params,
  linear,
  mlp_block,
  pallas_block,
  project_qkv,
  random_weights,
  rms_norm,
  tree_kernel_args,
)

# The first block's parameters: the plain block's, plus a norm for each half of its input.
_FIRST_PARAMS = ("input_norm", "hidden_norm", *(n for n in _LAYER_PARAMS if n != "attn_norm"))


def _first_params(c: TransformerConfig) -> tuple[str, ...]:
  """The first block's parameter names for the blocks' config `c`: with the q/k/v biases where `c.qkv_bias`."""
  return _FIRST_PARAMS + _BIAS_PARAMS if c.qkv_bias else _FIRST_PARAMS


def _layout(
  params: Mapping[str, jax.Array], c: TransformerConfig, *, fuse_attention: bool = True, fuse_mlp: bool = True
) -> dict[str, jax.Array]:
  """A block's (or a stack's) projections fused (q|k|v, gate|up: one matmul each, as the drafter holds them)
  or separate (as the weights file stores them, and where `sharding.shard` splits them)."""
  return relayout(
    params,
    q_width=c.num_heads * c.head_dim,
    kv_width=c.num_kv_heads * c.head_dim,
    d_ff=c.d_ff,
    fuse_attention=fuse_attention,
    fuse_mlp=fuse_mlp,
  )


def _separate(params: Mapping[str, jax.Array], c: TransformerConfig) -> dict[str, jax.Array]:
  """`_layout` with every projection separate (the weights file's layout)."""
  return _layout(params, c, fuse_attention=False, fuse_mlp=False)


class TargetWeight(nnx.Variable):
  """A weight the drafter borrows from its target (embedding, output head).

  Not an `nnx.Param`: an optimiser built with `wrt=nnx.Param` leaves it alone,
  and `EagleDrafter.to_weights` does not save it.
  """


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, kw_only=True)
class EagleConfig:
  """Static configuration of an `EagleDrafter`.

  Attributes:
    layers: the shape of the drafter's decoder blocks (`num_layers` = how many
      blocks the drafter has; vocabulary, widths, RoPE and dtype are the
      target's; `qkv_bias` gives its blocks q/k/v biases, the target's by
      default in `EagleDrafter.for_target`). Its own `feature_layers` must be empty.
    feature_layers: the target blocks whose outputs the drafter reads, in the
      order they are concatenated (the target's `config.feature_layers`).
    draft_vocab_size: Vd, the size of the draft vocabulary; 0 = the full vocabulary.

  Example:
    >>> cfg = EagleConfig(layers=TransformerConfig.tiny(64, num_layers=1), feature_layers=(0, 1))
    >>> cfg.feature_size
    64
  """

  layers: TransformerConfig
  feature_layers: tuple[int, ...]
  draft_vocab_size: int = 0

  def __post_init__(self):
    if not isinstance(self.layers, TransformerConfig):
      raise ValueError(f"EagleConfig.layers must be a TransformerConfig, got {type(self.layers).__name__}.")
    if self.layers.feature_layers:
      raise ValueError("EagleConfig.layers.feature_layers must be empty (the drafter has no features of its own).")
    layers = tuple(self.feature_layers) if isinstance(self.feature_layers, list) else self.feature_layers
    if (
      not isinstance(layers, tuple)
      or not layers
      or len(set(layers)) != len(layers)
      or any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) or i < 0 for i in layers)
    ):
      raise ValueError(
        f"EagleConfig.feature_layers must be a non-empty tuple of distinct block indices >= 0, "
        f"got {self.feature_layers!r}."
      )
    object.__setattr__(self, "feature_layers", tuple(int(i) for i in layers))
    v, vd = self.layers.vocab_size, self.draft_vocab_size
    if isinstance(vd, bool) or not isinstance(vd, (int, np.integer)) or not 0 <= vd <= v:
      raise ValueError(f"EagleConfig.draft_vocab_size must be an int in [0, V={v}] (0 = full), got {vd!r}.")

  @property
  def feature_size(self) -> int:
    """F = len(feature_layers) * d_model."""
    return len(self.feature_layers) * self.layers.d_model


def eagle_weight_shapes(config: EagleConfig) -> dict[str, tuple[int, ...]]:
  """Keys and shapes of `EagleDrafter.to_weights()` (the drafter's own weights, not the target's).

  With `config.layers.qkv_bias`: also "first.bq" [H*Dh], "first.bk"/"first.bv" [Hkv*Dh], and for
  more than one block "rest.bq" [L-1, H*Dh], "rest.bk"/"rest.bv" [L-1, Hkv*Dh].

  Example:
    >>> cfg = EagleConfig(layers=TransformerConfig.tiny(64, num_layers=1), feature_layers=(0, 1))
    >>> eagle_weight_shapes(cfg)["first.wq"]  # 2D -> H*Dh
    (64, 32)
  """
  c = config.layers
  d, f = c.d_model, c.d_ff
  q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  shapes = {
    "fc": (config.feature_size, d),
    "first.input_norm": (d,),
    "first.hidden_norm": (d,),
    "first.wq": (2 * d, q),
    "first.wk": (2 * d, kv),
    "first.wv": (2 * d, kv),
    **({"first.bq": (q,), "first.bk": (kv,), "first.bv": (kv,)} if c.qkv_bias else {}),
    "first.wo": (q, d),
    "first.mlp_norm": (d,),
    "first.w_gate": (d, f),
    "first.w_up": (d, f),
    "first.w_down": (f, d),
    "final_norm": (d,),
  }
  n = c.num_layers - 1
  if n:
    shapes.update(
      {
        "rest.attn_norm": (n, d),
        "rest.wq": (n, d, q),
        "rest.wk": (n, d, kv),
        "rest.wv": (n, d, kv),
        **({"rest.bq": (n, q), "rest.bk": (n, kv), "rest.bv": (n, kv)} if c.qkv_bias else {}),
        "rest.wo": (n, q, d),
        "rest.mlp_norm": (n, d),
        "rest.w_gate": (n, d, f),
        "rest.w_up": (n, d, f),
        "rest.w_down": (n, f, d),
      }
    )
  if config.draft_vocab_size:
    shapes["draft_vocab"] = (config.draft_vocab_size,)
  return shapes


class _Params(nnx.Module):
  """A group of named parameters (one decoder block, or a stack of them), in the layout given.

  `placement` = (mesh, Partitioning, leading axes) places and annotates them (`sharding.shard`).
  """

  def __init__(self, weights: Mapping[str, jax.Array], placement=None):
    self.names = tuple(weights)  # static: which layout (fused or separate projections) this group holds
    for name, value in weights.items():
      setattr(self, name, _make_param(value, name, placement))

  def values(self) -> dict[str, jax.Array]:
    return {name: getattr(self, name)[...] for name in self.names}


class EagleDrafter(nnx.Module):
  """EAGLE-style drafter: target features + next token -> next-next token (see the module docstring).

  Pass it as `draft` to `speculative_generate` with a target whose
  `config.feature_layers` equal `feature_layers` here; the loop feeds it the
  target's features of every verified token and drafts from its own hiddens.

  Protocol (what the loop uses):
    - `init_cache(batch_size, max_length) -> KVCache` (L = num_layers).
    - `fuse(features [B, T, F]) -> hidden [B, T, D]`.
    - `__call__(tokens [B, T], hidden [B, T, D], positions [B, T], cache, *, logits_at=None)
      -> (logits float32 [B, T or 1, V], hidden [B, T, D], cache)`.

  Many devices: `specdec_jax.models.shard(drafter, mesh)` places it like the
  target (heads, MLP and the head's vocabulary rows over "model"; the
  borrowed embedding and head become the drafter's own placed copies);
  `partitioning` then says what is split, as for `Transformer`.

  Args:
    config: an `EagleConfig`.
    rngs: random streams for the initial weights. The embedding and head are
      random too; `for_target` replaces them with the target's.

  Example:
    >>> target = Transformer(TransformerConfig.tiny(64, feature_layers=(0, 1)), rngs=nnx.Rngs(0))
    >>> drafter = EagleDrafter.for_target(target, rngs=nnx.Rngs(1))
    >>> drafter.feature_layers
    (0, 1)
  """

  def __init__(self, config: EagleConfig, *, rngs: nnx.Rngs):
    if not isinstance(config, EagleConfig):
      raise ValueError(f"config must be an EagleConfig, got {type(config).__name__}.")
    self.config = config
    c = config.layers
    shapes = eagle_weight_shapes(config)
    weights = random_weights(
      tuple((k, v) for k, v in shapes.items() if k != "draft_vocab"), c.num_layers, c.dtype, rngs.params()
    )
    self._set_blocks(weights)
    self.final_norm = nnx.Param(weights["final_norm"])
    v, vd = c.vocab_size, config.draft_vocab_size
    embed = 0.02 * jax.random.normal(rngs.params(), (v, c.d_model), jnp.float32)
    self.embed = TargetWeight(embed.astype(c.dtype))  # [V, D]
    if vd:
      self.draft_vocab = nnx.Variable(jnp.arange(vd, dtype=jnp.int32))  # [Vd] token ids
    self.head = TargetWeight(self.embed[...][:vd] if vd else self.embed[...])  # [Vd or V, D] rows of the head
    # What `sharding.shard` split over a mesh's model axis; None: never sharded (the program has no constraints).
    self.partitioning: Partitioning | None = None

  # --- construction ----------------------------------------------------------

  @classmethod
  def for_target(
    cls,
    target: Transformer,
    *,
    num_layers: int = 1,
    draft_vocab=None,
    d_ff: int | None = None,
    dtype=None,
    rngs: nnx.Rngs,
  ) -> EagleDrafter:
    """An untrained drafter for `target`: its widths, embedding, output head and feature layers.

    Args:
      target: a `Transformer` whose `config.feature_layers` is not empty.
      num_layers: decoder blocks of the drafter (EAGLE uses 1).
      draft_vocab: None for the full vocabulary, or distinct token ids [Vd]
        the drafter may propose (e.g. the most frequent ones).
      d_ff: the width of the drafter's MLP; None = the target's. A narrower
        MLP makes a smaller, cheaper head (the 1.5B coder's is 8960 wide).
      dtype: the drafter's dtype; None = the target's. A float32 head for a
        bf16 target (training) holds float32 copies of its embedding and head.
      rngs: random streams for the drafter's own weights.

    Returns:
      The drafter; its embedding and head hold the target's arrays (no copy
      unless `dtype` differs from the target's).
      Its blocks are the target's kind: with q/k/v biases iff `target.config.qkv_bias`.

    Raises:
      ValueError: the target has no feature layers, `draft_vocab` is not a
        list of distinct ids in [0, V), or `d_ff` is not a positive int.

    Example:
      >>> drafter = EagleDrafter.for_target(target, rngs=nnx.Rngs(0))  # doctest: +SKIP
    """
    tc = target.config
    if d_ff is not None and (isinstance(d_ff, bool) or not isinstance(d_ff, (int, np.integer)) or d_ff < 1):
      raise ValueError(f"d_ff must be a positive int or None (the target's {tc.d_ff}), got {d_ff!r}.")
    if not tc.feature_layers:
      raise ValueError(
        "target.config.feature_layers is empty: build the target with "
        "TransformerConfig(feature_layers=(...)) so it can return features."
      )
    vocab = None
    if draft_vocab is not None:
      vocab = np.asarray(draft_vocab)
      if (
        vocab.ndim != 1
        or vocab.size == 0
        or not np.issubdtype(vocab.dtype, np.integer)
        or vocab.min() < 0
        or vocab.max() >= tc.vocab_size
        or np.unique(vocab).size != vocab.size
      ):
        raise ValueError(
          f"draft_vocab must be distinct token ids in [0, V={tc.vocab_size}), one axis, "
          f"got {vocab.dtype} {vocab.shape}."
        )
    config = EagleConfig(
      layers=tc.replace(
        num_layers=num_layers,
        feature_layers=(),
        d_ff=tc.d_ff if d_ff is None else int(d_ff),
        dtype=tc.dtype if dtype is None else dtype,
      ),
      feature_layers=tc.feature_layers,
      draft_vocab_size=0 if vocab is None else vocab.size,
    )
    drafter = cls(config, rngs=rngs)
    head = target.embed[...] if tc.tie_embeddings else target.lm_head[...].T  # [V, D]
    drafter.set_target_weights(target.embed[...], head, vocab)
    return drafter

  def set_target_weights(self, embed, head_rows, draft_vocab=None) -> None:
    """Installs the target's embedding [V, D] and output head rows [V, D] (`x @ head.T` = logits).

    With a draft vocabulary (ids [Vd]) only those rows of the head are kept.
    """
    c = self.config.layers
    embed = jnp.asarray(embed, c.dtype)
    head_rows = jnp.asarray(head_rows, c.dtype)
    if embed.shape != (c.vocab_size, c.d_model) or head_rows.shape != (c.vocab_size, c.d_model):
      raise ValueError(
        f"embed and head_rows must be [V, D] = {(c.vocab_size, c.d_model)}, got {embed.shape} and {head_rows.shape}."
      )
    self.embed = TargetWeight(embed)
    if self.config.draft_vocab_size:
      if draft_vocab is None:
        raise ValueError("draft_vocab is required: this drafter has a draft vocabulary.")
      ids = jnp.asarray(draft_vocab, jnp.int32)
      if ids.shape != (self.config.draft_vocab_size,):
        raise ValueError(f"draft_vocab must have shape ({self.config.draft_vocab_size},), got {ids.shape}.")
      self.draft_vocab = nnx.Variable(ids)
      head_rows = head_rows[ids]
    self.head = TargetWeight(head_rows)

  @classmethod
  def from_weights(cls, config: EagleConfig, weights: Mapping[str, np.ndarray], *, embed, head_rows) -> EagleDrafter:
    """Builds a drafter from its own weights (keys of `eagle_weight_shapes`) and the target's embedding/head.

    Raises:
      ValueError: a key is missing or unexpected, or a shape is wrong.

    Example:
      >>> clone = EagleDrafter.from_weights(d.config, d.to_weights(), embed=e, head_rows=e)  # doctest: +SKIP
    """
    expected = eagle_weight_shapes(config)
    missing, unexpected = sorted(expected.keys() - weights.keys()), sorted(weights.keys() - expected.keys())
    if missing or unexpected:
      raise ValueError(f"weights: missing key(s) {missing}, unexpected key(s) {unexpected}.")
    for name, shape in expected.items():
      if tuple(np.shape(weights[name])) != shape:
        raise ValueError(f"weights[{name!r}]: expected shape {shape}, got {tuple(np.shape(weights[name]))}.")
    drafter = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))
    dtype = config.layers.dtype
    drafter._set_blocks({k: jnp.asarray(v, dtype) for k, v in weights.items() if k != "draft_vocab"})
    drafter.final_norm = nnx.Param(jnp.asarray(weights["final_norm"], dtype))
    drafter.set_target_weights(embed, head_rows, weights.get("draft_vocab"))
    return drafter

  def to_weights(self) -> dict[str, np.ndarray]:
    """The drafter's own weights as NumPy arrays (the target's embedding and head excluded).

    Example:
      >>> sorted(drafter.to_weights())[:2]  # doctest: +SKIP
      ['fc', 'final_norm']
    """
    c = self.config.layers
    out = {"fc": self.fc[...], "final_norm": self.final_norm[...]}
    out.update({f"first.{n}": v for n, v in _separate(self.first.values(), c).items()})
    if c.num_layers > 1:
      out.update({f"rest.{n}": v for n, v in _separate(self.rest.values(), c).items()})
    if self.config.draft_vocab_size:
      out["draft_vocab"] = self.draft_vocab[...]
    return {k: np.asarray(v) for k, v in out.items()}

  def _set_blocks(self, weights: Mapping[str, jax.Array]) -> None:
    """`fc` and the blocks from weights under `eagle_weight_shapes` names, projections fused.

    Fused q|k|v and gate|up make one matmul each instead of three and two (fewer
    launches per draft step at small batch, and the layout the Pallas kernels read).
    """
    c = self.config.layers
    self.fc = nnx.Param(weights["fc"])
    self.first = _Params(_layout({n: weights[f"first.{n}"] for n in _first_params(c)}, c))
    if c.num_layers > 1:
      self.rest = _Params(_layout({n: weights[f"rest.{n}"] for n in layer_params(c)}, c))

  # --- many devices --------------------------------------------------------------

  def _shard(self, mesh: jax.sharding.Mesh) -> EagleDrafter:
    """`sharding.shard` for the drafter: its parameters and the target's embedding/head placed on `mesh`.

    The same rules as the transformer's (`specdec_jax.models.sharding`): a
    projection split over devices is held as separate matrices, one that is not
    stays fused. The head's rows (the draft vocabulary, Vd) are split only when
    both V and Vd divide.
    """
    config, c = self.config, self.config.layers
    m = sharding.model_axis_size(mesh)
    part = Partitioning.for_shapes(
      model_size=m, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, d_ff=c.d_ff, vocab_size=c.vocab_size
    )
    part = dataclasses.replace(part, vocab=part.vocab and self.head[...].shape[0] % m == 0)
    placement = (mesh, part, 0)
    layout = {"fuse_attention": not part.heads, "fuse_mlp": not part.mlp}
    drafter = nnx.eval_shape(lambda: EagleDrafter(config, rngs=nnx.Rngs(0)))  # the structure, no random numbers
    drafter.fc = _make_param(self.fc[...], "fc", placement)
    drafter.first = _Params(_layout(self.first.values(), c, **layout), placement)
    if c.num_layers > 1:
      drafter.rest = _Params(_layout(self.rest.values(), c, **layout), (mesh, part, 1))
    drafter.final_norm = _make_param(self.final_norm[...], "final_norm", placement)
    drafter.embed = sharding.param(self.embed[...], mesh, part.param_spec("embed"), TargetWeight)
    drafter.head = sharding.param(self.head[...], mesh, part.param_spec("head"), TargetWeight)
    if config.draft_vocab_size:
      drafter.draft_vocab = sharding.param(self.draft_vocab[...], mesh, (), nnx.Variable)
    drafter.partitioning = part
    return drafter

  # --- protocol ----------------------------------------------------------------

  @property
  def feature_layers(self) -> tuple[int, ...]:
    """The target blocks whose outputs this drafter reads (must equal the target's)."""
    return self.config.feature_layers

  @property
  def vocab_size(self) -> int:
    return self.config.layers.vocab_size

  def init_cache(self, batch_size: int, max_length: int) -> KVCache:
    """A zero KV cache [num_layers, B, Hkv, max_length, Dh] (same rules as `Transformer.init_cache`)."""
    for name, value in (("batch_size", batch_size), ("max_length", max_length)):
      if not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}.")
    c = self.config.layers
    shape = (c.num_layers, batch_size, c.num_kv_heads, max_length, c.head_dim)
    return constrain_cache(self.partitioning, KVCache(k=jnp.zeros(shape, c.dtype), v=jnp.zeros(shape, c.dtype)))

  def copy_cache_slots(self, cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    """Copies keys/values from slots `src` [B, M] to `dst` [B, M], as `Transformer.copy_cache_slots`.

    Example:
      >>> cache = drafter.copy_cache_slots(cache, jnp.array([[7]]), jnp.array([[5]]))  # doctest: +SKIP
    """
    return copy_kv_slots(cache, src, dst)

  def fuse(self, features: jax.Array) -> jax.Array:
    """Target features [B, T, F] -> the drafter's hidden input [B, T, D]."""
    f = self.config.feature_size
    if features.ndim != 3 or features.shape[-1] != f:
      raise ValueError(
        f"features must be [B, T, F] with F = {f} (feature_layers {self.feature_layers} x D), got {features.shape}."
      )
    return linear(features.astype(self.config.layers.dtype), self.fc[...])

  def __call__(
    self,
    tokens: jax.Array,  # int32 [B, T]: the token after each entry's hidden
    hidden: jax.Array,  # [B, T, D]: fuse(target features) or the drafter's own previous hidden
    positions: jax.Array,  # int32 [B, T]
    cache: KVCache,
    *,
    logits_at: jax.Array | None = None,  # int32 [B] or [B, N]: only these entries' logits
    cache_slots: jax.Array | None = None,  # int32 [B, T]
    attention_mask: jax.Array | None = None,  # bool [B, T, S]
    draft_vocab_logits: bool = False,
  ) -> tuple[jax.Array, jax.Array, KVCache]:
    """Runs entries (hidden_p, token_{p+1}) at their positions; writes their keys/values.

    Args:
      tokens: int [B, T]; ids outside [0, V) are clipped (their outputs are junk).
      hidden: [B, T, D]: `fuse(features)` for entries from the target's
        features, or the `hidden` this call returned one position earlier.
      positions: int [B, T]; slot rules as for `Transformer` (a query sees
        s <= position; writes outside [0, S) are dropped).
      cache: the drafter's `KVCache`.
      logits_at: None for logits at every entry, or int [B] (in [0, T)): the one
        entry per row whose logits are needed (the catch-up call of a round
        needs only its last accepted entry; skipping the head on the others
        saves most of a call's work), or int [B, N]: N entries per row (a block
        drafter's K drafts).
      cache_slots, attention_mask: the tree extension, as for `Transformer`:
        where each entry writes (None: its position) and which slots each
        entry sees (None: s <= position). Drafting a tree depth by depth, the
        entries of the nodes at depth i sit at position L-2+i (their parents'
        hiddens and their own tokens) and at slots L-1+j (j = node index), and
        see the slots below L-1 plus their ancestors' and their own:

            slot:         ... L-2      L-1   L     L+1   L+2     (tree root -> {n0, n1}, n0 -> {n2})
            entry:        ... (f, t)   n0    n1    n2
            position:     ... L-2      L-1   L-1   L
            n2 sees:      ... x        x     .     x

        The next round's catch-up rewrites the accepted path at its positions
        from the target's features, so nothing needs to be moved afterwards.
      draft_vocab_logits: return the logits over the draft vocabulary [..., Vd]
        (training, where a [..., V] tensor would only hold -inf) instead of V.

    Returns:
      (logits float32 [B, T, V] (or [B, 1, V] with logits_at [B], [B, N, V] with
      logits_at [B, N]; -inf outside the draft vocabulary), hidden [B, T, D] (each entry's output before the final
      norm: the next entry's hidden input), cache).

    Example:
      >>> h = drafter.fuse(features)  # doctest: +SKIP
      >>> logits, h_out, cache = drafter(next_tokens, h, positions, cache)  # doctest: +SKIP
    """
    c = self.config.layers
    b, t = tokens.shape
    if hidden.shape != (b, t, c.d_model):
      raise ValueError(f"hidden must be [B, T, D] = {(b, t, c.d_model)}, got {hidden.shape}.")
    if positions.shape != (b, t):
      raise ValueError(f"positions must have the shape of tokens {(b, t)}, got {positions.shape}.")
    expected = (c.num_layers, b, c.num_kv_heads, cache.max_length, c.head_dim)
    if cache.k.shape != expected or cache.k.dtype != c.dtype:
      raise ValueError(f"cache.k must be {c.dtype} {expected} (from init_cache), got {cache.k.dtype} {cache.k.shape}.")
    check_tree_args(tokens, cache_slots, attention_mask, cache.max_length)
    ctx = AttentionContext.create(
      positions, cache.max_length, c, cache_slots=cache_slots, attention_mask=attention_mask
    )
    emb = sharding.embed_lookup(self.embed[...], tokens, self.partitioning)  # as in Transformer
    x = hidden.astype(c.dtype)
    p = self.first.values()
    # The first block as Pallas kernels: the q|k|v kernel norms the embedding and the hidden each on its own.
    first_as_plain, prefix = {**p, "attn_norm": p["hidden_norm"]}, (emb, p["input_norm"])
    kernels = block_kernels(c, self.partitioning, x, first_as_plain, cache.k, prefix, tree=attention_mask is not None)
    if kernels is not None:
      interpret, tree = kernels == "pallas_interpret", tree_kernel_args(ctx, cache_slots, attention_mask)
      x, k_cache, v_cache = pallas_block(
        c, x, first_as_plain, cache.k, cache.v, 0, positions, ctx, interpret=interpret, prefix=prefix, **tree
      )
      rest = self.rest.values() if c.num_layers > 1 else {}
      # Unrolled: the kernels take one block's weights. Slicing the stacked rest is free for the shipped head
      # (one such block: a bitcast) but a weight copy per call for each block beyond it.
      for i in range(1, c.num_layers):
        x, k_cache, v_cache = pallas_block(
          c, x, {n: w[i - 1] for n, w in rest.items()}, k_cache, v_cache, i, positions, ctx, interpret=interpret, **tree
        )
    else:
      x, k_cache, v_cache = self._xla_blocks(x, emb, p, cache, ctx)
    if logits_at is None:
      out = x
    else:
      at = logits_at.astype(jnp.int32)
      out = jnp.take_along_axis(x, (at[:, None] if at.ndim == 1 else at)[..., None], axis=1)
    logits = self.head_logits(out)
    if not draft_vocab_logits:
      logits = self.full_logits(logits)
    # Vocabulary-split like the target's logits.
    if self.partitioning is not None:
      logits = sharding.constrain(logits, self.partitioning.logits_spec())
    return logits, x, constrain_cache(self.partitioning, KVCache(k=k_cache, v=v_cache))

  def _xla_blocks(self, x, emb, p, cache: KVCache, ctx: AttentionContext):
    """The blocks as XLA ops: the first on concat(norm(emb), norm(x)), the rest under `lax.scan`."""
    c = self.config.layers
    attn_in = jnp.concatenate(
      [rms_norm(emb, p["input_norm"], c.rms_norm_eps), rms_norm(x, p["hidden_norm"], c.rms_norm_eps)], axis=-1
    )
    x, k_cache, v_cache = decoder_block(c, x, attn_in, p, cache.k, cache.v, 0, ctx)
    if c.num_layers > 1:

      def block(carry, layer):
        x, k_cache, v_cache = carry
        p, i = layer
        x, k_cache, v_cache = decoder_block(
          c, x, rms_norm(x, p["attn_norm"], c.rms_norm_eps), p, k_cache, v_cache, i, ctx
        )
        return (x, k_cache, v_cache), None

      ids = jnp.arange(1, c.num_layers, dtype=jnp.int32)
      (x, k_cache, v_cache), _ = jax.lax.scan(block, (x, k_cache, v_cache), (self.rest.values(), ids))
    return x, k_cache, v_cache

  def head_logits(self, x: jax.Array) -> jax.Array:
    """Final norm and head on hiddens [..., D] -> float32 logits over the draft vocabulary [..., Vd or V]."""
    c = self.config.layers
    return jnp.einsum(
      "...d,vd->...v",
      rms_norm(x, self.final_norm[...], c.rms_norm_eps),
      self.head[...],
      preferred_element_type=jnp.float32,
    )

  def full_logits(self, logits: jax.Array) -> jax.Array:
    """Draft-vocabulary logits [..., Vd] -> [..., V] with -inf for tokens outside it (identity without one)."""
    if not self.config.draft_vocab_size:
      return logits
    full = jnp.full((*logits.shape[:-1], self.vocab_size), -jnp.inf, jnp.float32)
    return full.at[..., self.draft_vocab[...]].set(logits)

  # --- training ----------------------------------------------------------------

  def unrolled_logits(self, next_tokens: jax.Array, features: jax.Array, depth: int) -> list[jax.Array]:
    """Training-time test: the drafter unrolled `depth` steps on whole sequences, without a cache.

    Position p of depth 0 reads (fuse(features[:, p]), next_tokens[:, p]) like a
    catch-up entry; depth j >= 1 reads the hidden depth j-1 produced at p-1 and
    attends to depth-0 keys at positions <= p-j and to the depth-i key at
    position p-j+i (i = 1..j): exactly what the cached loop's query at draft
    step j sees. Positions p < j have no such past and are junk (mask them).

    Args:
      next_tokens: int [B, T]: next_tokens[:, p] is the token after position p.
      features: [B, T, F] the target's features at positions 0..T-1.
      depth: static number of unrolled steps (>= 1).

    Returns:
      `depth` arrays float32 [B, T, Vd or V]: logits over the draft vocabulary
      (position p of each predicts the token two after p).

    Example:
      >>> per_depth = drafter.unrolled_logits(tokens[:, 1:], features[:, :-1], depth=4)  # doctest: +SKIP
    """
    c = self.config.layers
    b, t = next_tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    cos, sin = _rope_tables(positions, c.head_dim, c.rope_theta)
    emb = sharding.embed_lookup(self.embed[...], next_tokens, self.partitioning)
    first = self.first.values()
    rest = self.rest.values() if c.num_layers > 1 else None
    emb_in = rms_norm(emb, first["input_norm"], c.rms_norm_eps)
    kv = [[] for _ in range(c.num_layers)]  # per layer: (k, v) of each depth so far
    hidden = self.fuse(features)
    outs = []
    for j in range(depth):
      x = hidden
      attn_in = jnp.concatenate([emb_in, rms_norm(x, first["hidden_norm"], c.rms_norm_eps)], axis=-1)
      x = _unrolled_block(c, x, attn_in, first, kv[0], j, cos, sin)
      for i in range(1, c.num_layers):
        p = {name: w[i - 1] for name, w in rest.items()}
        x = _unrolled_block(c, x, rms_norm(x, p["attn_norm"], c.rms_norm_eps), p, kv[i], j, cos, sin)
      outs.append(self.head_logits(x))
      hidden = jnp.pad(x, ((0, 0), (1, 0), (0, 0)))[:, :t]  # depth j+1 at p reads depth j's output at p-1
    return outs


def _unrolled_block(c: TransformerConfig, x, attn_in, p, kv: list, j: int, cos, sin):
  """One decoder block at unroll depth j (see `EagleDrafter.unrolled_logits`); appends this depth's (k, v) to kv."""
  b, t, _ = x.shape
  h, hkv, dh = c.num_heads, c.num_kv_heads, c.head_dim
  q, k, v = project_qkv(c, attn_in, p)
  q = _apply_rope(q, cos, sin).astype(jnp.float32)
  k = _apply_rope(k, cos, sin)
  kv.append((k, v))
  rep = h // hkv
  scale = dh**-0.5

  def heads(a):  # [B, T, Hkv, Dh] -> [B, T, H, Dh] in float32
    return jnp.repeat(a.astype(jnp.float32), rep, axis=2)

  def shifted(a, s):  # a[:, p - s] at p (zeros where p < s)
    return jnp.pad(a, ((0, 0), (s, 0), (0, 0), (0, 0)))[:, :t] if s else a

  k0, v0 = kv[0]
  scores0 = jnp.einsum("bthd,bshd->bhts", q, heads(k0)) * scale  # [B, H, T, T]
  pos = jnp.arange(t)
  visible = pos[None, :] <= pos[:, None] - j  # depth-0 key s visible from p iff s <= p - j
  scores0 = jnp.where(visible[None, None], scores0, -jnp.inf)
  # Depth i >= 1 contributes exactly one key per query: its entry at p - j + i.
  diag_k = [heads(shifted(kv[i][0], j - i)) for i in range(1, j + 1)]
  diag_v = [heads(shifted(kv[i][1], j - i)) for i in range(1, j + 1)]
  diag = [jnp.einsum("bthd,bthd->bht", q, kd)[..., None] * scale for kd in diag_k]  # [B, H, T, 1]
  valid = [(pos >= j - i)[None, None, :, None] for i in range(1, j + 1)]
  diag = [jnp.where(ok, s, -jnp.inf) for s, ok in zip(diag, valid)]
  # Every query sees its own key (i = j, or s = p at depth 0), so no row is empty.
  weights = jax.nn.softmax(jnp.concatenate([scores0, *diag], axis=-1), axis=-1)
  out = jnp.einsum("bhts,bshd->bthd", weights[..., :t], heads(v0))
  for i, vd in enumerate(diag_v):
    out = out + jnp.swapaxes(weights[..., t + i], 1, 2)[..., None] * vd
  x = x + linear(out.reshape(b, t, h * dh).astype(x.dtype), p["wo"])
  return mlp_block(c, x, p)
