"""The models on a device mesh: data parallel over rows, tensor parallel inside the models.

A mesh has up to two axes, named in `specdec_jax.mesh` (re-exported here):

  - `DATA_AXIS = "data"`: the batch. Rows of the prompts, the KV caches and the
    decoding loops' state are split over it; every device group holds a whole
    model (or its tensor-parallel share).
  - `MODEL_AXIS = "model"`: tensor parallelism (Megatron-style) inside each
    model, as the table below says.

`shard(model, mesh)` returns the model with every parameter placed by a
`NamedSharding` on `mesh` and annotated (Flax NNX `out_sharding` metadata, so
`nnx.get_partition_spec(nnx.state(model))` reports the layout). It works on any
`Transformer` or `EagleDrafter`, freshly built or loaded (`load_smollm2`,
`load_smollm2_eagle`), so checkpoints are loaded on one device and then
sharded. The decoding loops need nothing else: call them under
`with jax.set_mesh(mesh):` with the sharded models.

What is split over the model axis (m devices), per parameter:

    parameter          shape               split when               spec
    embed              [V, D]              V % m == 0               ("model", None): vocabulary-parallel
    lm_head (untied)   [D, V]              V % m == 0               (None, "model")
    EAGLE head rows    [Vd, D]             V % m == Vd % m == 0     ("model", None)
    wq, wk, wv         [D, H*Dh|Hkv*Dh]    H % m == Hkv % m == 0    (None, "model"): whole heads per device
    bq, bk, bv         [H*Dh|Hkv*Dh]       same                     ("model",): their wq/wk/wv's columns
    wo                 [H*Dh, D]           same                     ("model", None)
    w_gate, w_up       [D, F]              F % m == 0               (None, "model")
    w_down             [F, D]              same                     ("model", None)
    norms, EAGLE's fc  -                   never (small)            replicated
    KV cache           [L, B, Hkv, S, Dh]  rows always, heads when split   (None, "data", "model" | None, None, None)

so the logits, `x @ embed.T` (or `x @ lm_head`), come out split over the
vocabulary, `[B, T, V]` as `P("data", None, "model")`, and go to the sampler
as they are. The row-parallel matmuls (`wo` where heads are split, `w_down`)
end in a sum over devices that XLA inserts (an all-reduce of `[B, T, D]`):
the only collectives of a block. The embedding lookup adds one per call, of
`[B, T, D]` too: each device reads the tokens in its own rows and a psum
combines them (`embed_lookup`, an explicit `shard_map`: left to XLA, the
GPU program gathered the whole table instead).

Heads that do not divide. Attention is split only when both the query heads
and the KV heads divide by m; otherwise every device keeps all heads (the
attention weights and the KV cache are replicated over the model axis, their
work repeated) while the MLP and the vocabulary are still split. SmolLM2 has 9
query and 3 KV heads, which no m in {2, 4, 8} divides, so on those meshes its
attention is replicated: about 20% of its 135M parameters (wqkv, wo: 26.5M) and the
whole KV cache on every model-axis device. The alternatives were worse:
padding the heads (to 12 and 4 for m = 4) changes the parameters' shapes
(checkpoints, `to_weights`) and spends a third more attention work on zeros,
and splitting query heads while repeating KV heads needs H % m == 0 too.

Fused projections. On one device the transformer keeps q|k|v as one matrix
`wqkv` and gate|up as one `w_gate_up` (one matmul each). Split evenly over m
devices, a fused matrix would give device 0 all the queries and device 1 the
keys and values, so `shard` keeps a projection fused only where it is not
split, and otherwise holds its parts (`wq`, `wk`, `wv`; `w_gate`, `w_up`) as
separate matrices, each split by heads or hidden units. The q/k/v biases of a
model with `qkv_bias` follow their projections: a fused `bqkv` beside `wqkv`
(replicated, like it), or `bq`, `bk`, `bv` split like the columns of `wq`, `wk`,
`wv`, so each device adds the biases of its own heads. With m = 1 nothing
changes: a 1-device mesh runs today's program.

Mesh axis types. The models and loops rely on XLA's sharding propagation
(`jax.sharding.AxisType.Auto`). `make_mesh` builds such a mesh; a mesh with
Explicit axes (the default of `jax.make_mesh`) works too with the decoding
loops, which run their program under `jax.sharding.auto_axes`.

Example:
  >>> mesh = make_mesh(data=2, model=4)  # 8 devices  # doctest: +SKIP
  >>> model = shard(load_smollm2()[0], mesh)  # doctest: +SKIP
  >>> with jax.set_mesh(mesh):  # doctest: +SKIP
  ...   out = generate(model, prompts, lengths, params, key, max_new_tokens=32)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

# Re-exported: the axis names and constraints belong to every layer, the models included.
from specdec_jax.mesh import (
  AXIS_NAMES,
  DATA_AXIS,
  MODEL_AXIS,
  ambient_mesh,
  axis_size,
  constrain,
  constrain_rows,
  make_mesh,
  sharded_call,
)

__all__ = [
  "AXIS_NAMES",
  "DATA_AXIS",
  "MODEL_AXIS",
  "Partitioning",
  "axis_size",
  "check_mesh",
  "constrain",
  "constrain_rows",
  "make_mesh",
  "shard",
]


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, kw_only=True)
class Partitioning:
  """What a sharded model splits over the model axis (static: it rides on the model through jit).

  Attributes:
    model_size: m, devices on the model axis (1: nothing is split).
    heads: attention heads (wq, wk, wv, wo, and the biases bq, bk, bv) and the KV cache's heads are split.
    mlp: the SwiGLU hidden units (w_gate, w_up, w_down) are split.
    vocab: the embedding's rows and the output head's columns are split.

  Example:
    >>> Partitioning.for_shapes(model_size=4, num_heads=9, num_kv_heads=3, d_ff=1536, vocab_size=49152)
    Partitioning(model_size=4, heads=False, mlp=True, vocab=True)
  """

  model_size: int
  heads: bool
  mlp: bool
  vocab: bool

  @classmethod
  def for_shapes(
    cls, *, model_size: int, num_heads: int, num_kv_heads: int, d_ff: int, vocab_size: int
  ) -> Partitioning:
    """The module docstring's rules: split a part over m devices only where it divides evenly."""
    m = model_size
    split = m > 1
    return cls(
      model_size=m,
      heads=split and num_heads % m == 0 and num_kv_heads % m == 0,
      mlp=split and d_ff % m == 0,
      vocab=split and vocab_size % m == 0,
    )

  def param_spec(self, name: str) -> tuple[str | None, ...]:
    """The spec of a per-layer or top-level parameter by name (without a leading layer axis)."""
    h = MODEL_AXIS if self.heads else None
    f = MODEL_AXIS if self.mlp else None
    v = MODEL_AXIS if self.vocab else None
    specs = {
      "embed": (v, None),
      "head": (v, None),
      "lm_head": (None, v),
      "wq": (None, h),
      "wk": (None, h),
      "wv": (None, h),
      "bq": (h,),
      "bk": (h,),
      "bv": (h,),
      "wo": (h, None),
      "w_gate": (None, f),
      "w_up": (None, f),
      "w_down": (f, None),
    }
    return specs.get(name, ())  # () = replicated (norms, fused projections and biases, fc, draft ids)

  def cache_spec(self) -> tuple[str | None, ...]:
    """The spec of a `KVCache`'s k and v [L, B, Hkv, S, Dh]."""
    return (None, DATA_AXIS, MODEL_AXIS if self.heads else None, None, None)

  def logits_spec(self) -> tuple[str | None, ...]:
    """The spec of logits [B, T, V]: rows over "data", the vocabulary over "model" where it is split."""
    return (DATA_AXIS, None, MODEL_AXIS if self.vocab else None)


def runs_locally(part: Partitioning | None) -> bool:
  """Whether a model placed as `part` computes here as an unsharded model on one device's rows (static).

  True without a partitioning, and for one that splits nothing over the model axis (`part.model_size` 1)
  where every axis of the ambient mesh with more than one device is manual: inside a `shard_map` over the
  rows, such as the loops' data-parallel program, each device runs the one-device program on its own rows.
  The Pallas blocks and the fixed-shape padding of small calls (batch invariance) then apply as on one device.

  Example:
    >>> runs_locally(None)
    True
  """
  if part is None:
    return True
  if part.model_size != 1:
    return False
  mesh = ambient_mesh()
  return mesh.empty or all(size == 1 or name in mesh.manual_axes for name, size in dict(mesh.shape).items())


def embed_lookup(table: jax.Array, tokens: jax.Array, part: Partitioning | None) -> jax.Array:
  """The embedding rows of `tokens`: `table[clip(tokens, 0, V - 1)]` [B, T, D], for a model placed as `part`.

  With the table split over the vocabulary (`part.vocab`, under an ambient mesh
  whose model axis has `part.model_size` > 1 devices) the lookup is written out
  as a `shard_map`: each device reads the ids in its own rows [lo, lo + V/m),
  gives zeros for the others, and one psum over "model" of [B, T, D] combines
  them (rows over "data" where it divides B). Left to itself, XLA may instead
  all-gather the whole table on every call (on GPU it did: 467 MB for
  Qwen2.5-Coder-1.5B's [151936, 1536], to read one row a token; see
  bench/RESULTS.md). Every element has one owner, so the sum is the one-device
  lookup bit for bit, but for the sign of a zero (an all-reduce adds into
  +0.0, so a -0.0 entry comes back +0.0, as it did from XLA's own split lookup).

  Otherwise (`part` None, the vocabulary whole, no such mesh) it is the plain
  `jnp.take`, constrained to rows over "data" when `part` is set.

  Args:
    table: [V, D] embedding (placed as `part.param_spec("embed")`).
    tokens: int [B, T]; ids outside [0, V) are clipped into range.
    part: the model's `partitioning` (None: not sharded).

  Example:
    >>> x = embed_lookup(self.embed[...], tokens, self.partitioning)  # [B, T, D]  # doctest: +SKIP
  """
  v = table.shape[0]
  ids = jnp.clip(tokens, 0, v - 1)
  m = axis_size(MODEL_AXIS)
  if part is None or not part.vocab or m <= 1 or m != part.model_size or v % m:
    x = jnp.take(table, ids, axis=0)
    return x if part is None else constrain_rows(x)
  rows = v // m
  d = axis_size(DATA_AXIS)
  split = DATA_AXIS if d > 1 and ids.shape[0] % d == 0 else None

  def lookup(table, ids):  # table [V/m, D]: this device's rows; ids [B or B/d, T]
    local = ids - jax.lax.axis_index(MODEL_AXIS) * rows
    mine = (local >= 0) & (local < rows)
    got = jnp.take(table, jnp.where(mine, local, 0), axis=0)
    return jax.lax.psum(jnp.where(mine[..., None], got, jnp.zeros((), got.dtype)), MODEL_AXIS)

  call = sharded_call(lookup, (PartitionSpec(MODEL_AXIS, None), PartitionSpec(split, None)), PartitionSpec(split))
  return call(table, ids)


def check_mesh(mesh, where: str = "shard") -> None:
  """Raises ValueError unless `mesh` is a concrete `jax.sharding.Mesh` whose axes are among ("data", "model")."""
  if not isinstance(mesh, jax.sharding.Mesh):
    raise ValueError(  # noqa: TRY004 (the project's contract: bad arguments are ValueErrors)
      f"{where}: mesh must be a jax.sharding.Mesh (e.g. specdec_jax.models.make_mesh(data=2, model=4)), "
      f"got {type(mesh).__name__}."
    )
  unknown = [a for a in mesh.axis_names if a not in AXIS_NAMES]
  if unknown:
    raise ValueError(
      f"{where}: mesh axis names must be among {AXIS_NAMES} (batch rows over 'data', tensor "
      f"parallelism over 'model'), got {tuple(mesh.axis_names)}."
    )


def model_axis_size(mesh) -> int:
  """Devices on the model axis of `mesh` (1 when it has none)."""
  return int(dict(mesh.shape).get(MODEL_AXIS, 1))


def place(value: jax.Array, mesh: jax.sharding.Mesh, spec: tuple[str | None, ...]) -> jax.Array:
  """`value` put on `mesh` split as `spec` (axes the mesh lacks are replicated)."""
  return jax.device_put(value, NamedSharding(mesh, _spec_on(spec, mesh.axis_names)))


def param(value: jax.Array, mesh: jax.sharding.Mesh, spec: tuple[str | None, ...], kind=None):
  """An NNX variable (`kind`, default `nnx.Param`) holding `value` placed as `spec`, annotated with it.

  The annotation is Flax's `out_sharding` metadata (via `nnx.with_partitioning`),
  so `nnx.get_partition_spec` reports it; `eager_sharding=False` because the
  value is already placed, and an NNX merge inside a program must not need a mesh.
  """
  from flax import nnx  # the models already import it

  spec = tuple(spec) + (None,) * (np.ndim(value) - len(spec))
  placed = place(value, mesh, spec)
  kind = nnx.Param if kind is None else kind
  return kind(nnx.with_partitioning(lambda: placed, spec, eager_sharding=False)())


def _spec_on(spec, axis_names) -> PartitionSpec:
  return PartitionSpec(*(a if a in axis_names else None for a in spec))


def shard(model, mesh: jax.sharding.Mesh):
  """Places a model's parameters on `mesh`: tensor parallel over "model", replicated over "data".

  Args:
    model: a `Transformer` or an `EagleDrafter` (built, loaded, or already
      sharded on another mesh). Not modified.
    mesh: a `jax.sharding.Mesh` whose axis names are among ("data", "model")
      (`make_mesh` builds one). Which parts are split follows the module
      docstring's table: a part whose size the model axis does not divide
      stays whole on every device.

  Returns:
    A model of the same class and config holding the placed parameters, with
    `partitioning` (a `Partitioning`) saying what is split. Its KV caches
    (`init_cache` under `jax.set_mesh(mesh)`) are split by rows over "data"
    and, where the heads are, by heads over "model".

  Raises:
    ValueError: `mesh` is not a Mesh or has other axis names; `model` is not a
      `Transformer` or `EagleDrafter`.

  Example:
    >>> mesh = make_mesh(data=2, model=4)  # doctest: +SKIP
    >>> target = shard(target, mesh)  # doctest: +SKIP
    >>> target.embed.sharding.spec  # doctest: +SKIP
    PartitionSpec('model', None)
  """
  check_mesh(mesh)
  shard_fn = getattr(type(model), "_shard", None)
  if shard_fn is None:
    raise ValueError(
      f"shard: model must be a specdec_jax.models Transformer or EagleDrafter, got "
      f"{type(model).__name__} (shard your own model's arrays with jax.device_put and "
      f"NamedSharding; the loops accept any sharded model)."
    )
  return shard_fn(model, mesh)


def relayout(
  params: Mapping[str, jax.Array], *, q_width: int, kv_width: int, d_ff: int, fuse_attention: bool, fuse_mlp: bool
) -> dict[str, jax.Array]:
  """One block's (or a stack's) projections fused or separate, as asked (columns on the last axis).

  Fused: "wqkv" = q|k|v and "w_gate_up" = gate|up; separate: "wq", "wk", "wv",
  "w_gate", "w_up". The q/k/v biases, where a block has them (`qkv_bias`), follow
  `fuse_attention` too: "bqkv" = q|k|v, or "bq", "bk", "bv". Exact either way
  (concatenation and slicing).

  Example:
    >>> relayout({"wqkv": np.zeros((8, 12)), "bqkv": np.zeros(12)}, q_width=6, kv_width=3, d_ff=5,
    ...          fuse_attention=False, fuse_mlp=False)["bk"].shape
    (3,)
  """
  out = dict(params)
  for fused, parts in (("wqkv", ("wq", "wk", "wv")), ("bqkv", ("bq", "bk", "bv"))):
    if fused in out and not fuse_attention:
      w = out.pop(fused)
      q, k, v = w[..., :q_width], w[..., q_width : q_width + kv_width], w[..., q_width + kv_width :]
      out.update(zip(parts, (q, k, v)))
    elif fused not in out and fuse_attention and parts[0] in out:
      out[fused] = jnp.concatenate([out.pop(part) for part in parts], axis=-1)
  if "w_gate_up" in out and not fuse_mlp:
    w = out.pop("w_gate_up")
    out.update(w_gate=w[..., :d_ff], w_up=w[..., d_ff:])
  elif "w_gate_up" not in out and fuse_mlp:
    out["w_gate_up"] = jnp.concatenate([out.pop("w_gate"), out.pop("w_up")], axis=-1)
  return out
