"""The vocabulary axis split over a mesh axis: what each device knows and the small collectives that combine it.

Inside the samplers' `shard_map` (see `sharded_call`) every device holds a
contiguous slice of the vocabulary, tokens [offset, offset + V/m) of every
row it holds. A `VocabShards` (static, hashable) tells the reductions of
`reductions`, `thresholds`, `draws` and `sampling` how to finish: each reduces
its slice, then combines per-chunk or per-row partials ([B, K+1, n_chunks] at
most) across the model axis. No collective ever carries the vocabulary axis.

Bit-identity with one device: the per-chunk partials are exactly those a single
device computes (the same reduction over the same `chunk_size(V)` tokens)
whenever V/m is a whole number of chunks, which `shards_for` requires; the
combination that follows runs the single device's own code on the gathered
partials. Max, argmax and one-owner gathers are exact in any order.

Each collective costs a launch and a round trip whatever its few bytes, so
partials that are ready together cross in one (`gather_many`,
`gather_and_max`, `take_many`), and a run-time branch's predicate, the same
on every device of the model axis, is reduced over the row axes only (`any`).

Without a mesh (or with a model axis of one device) `shards_for` returns None
and every function of the samplers compiles exactly its single-device program.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from specdec_jax.mesh import DATA_AXIS, MODEL_AXIS, ambient_mesh
from specdec_jax.mesh import sharded_call as mesh_sharded_call
from specdec_jax.sampling.masks import BITS
from specdec_jax.sampling.reductions import chunk_size


@dataclasses.dataclass(frozen=True)
class VocabShards:
  """The vocabulary split into `size` equal slices along mesh axis `axis` (used inside `shard_map`).

  Attributes:
    axis: the mesh axis over the vocabulary ("model").
    size: m, devices on it.
    vocab: V, the whole vocabulary.
    row_axes: mesh axes the rows are split over (() or ("data",)): a
      batch-wide decision (`any`) also reduces over them, so that every
      device takes the branch one device would take for the whole batch.
    search: how the top-k/top-p search reads each device's slice
      (`thresholds.threshold_and_lse`): "xla" (the largest 4 of every group,
      one fused XLA reduction), "pallas" (the Pallas kernel
      `block_stats.block_partials` with candidates, a GPU's choice) or
      "pallas_interpret" (that kernel in Pallas's interpreter, tests). The
      thresholds are the same.
  """

  axis: str
  size: int
  vocab: int
  row_axes: tuple = ()
  search: str = "xla"

  @property
  def local(self) -> int:
    """V / m, tokens per device."""
    return self.vocab // self.size

  def offset(self) -> jax.Array:
    """int32 scalar: the first token id of this device's slice."""
    return (jax.lax.axis_index(self.axis) * self.local).astype(jnp.int32)

  def gather(self, x: jax.Array) -> jax.Array:
    """[..., n_local] -> [..., m * n_local]: per-slice partials laid out as one device's (in vocabulary order)."""
    return jax.lax.all_gather(x, self.axis, axis=x.ndim - 1, tiled=True)

  def gather_many(self, *xs: jax.Array) -> tuple[jax.Array, ...]:
    """`gather` of several arrays of one shape [..., n_local] (32-bit dtypes), in one all-gather.

    Each collective costs a launch and a round trip whatever its size, and XLA
    does not always combine independent ones. The arrays travel bitcast to
    int32 and come back bitcast: the same bits as separate gathers.

    Example:
      >>> m_c, chunk_logw, first = shards.gather_many(m_c, chunk_logw, first)   # each [B, K+1, n]
    """
    carried = jnp.stack([jax.lax.bitcast_convert_type(x, jnp.int32) for x in xs], axis=-2)  # [..., j, n_local]
    gathered = self.gather(carried)
    return tuple(jax.lax.bitcast_convert_type(gathered[..., i, :], x.dtype) for i, x in enumerate(xs))

  def gather_and_max(self, x: jax.Array, maxima: list[jax.Array]) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """(`gather(x)`, the elementwise max over the slices of each of `maxima`), in one all-gather.

    For a max that no earlier collective needs: it rides as extra columns of
    the gather and is taken after it (max is exact in any order).

    Args:
      x: [..., n_local].
      maxima: arrays [...] of x's dtype.

    Example:
      >>> cand, (m, floor) = shards.gather_and_max(cand, [local_max, local_floor])   # [B, m * n], [B], [B]
    """
    n = x.shape[-1]
    cols = jnp.concatenate([x] + [y[..., None] for y in maxima], axis=-1)  # [..., n + j]
    got = jax.lax.all_gather(cols, self.axis, axis=cols.ndim - 1)  # [..., m, n + j]
    maxed = jnp.max(got[..., n:], axis=-2)  # [..., j]
    return got[..., :n].reshape(x.shape[:-1] + (self.size * n,)), tuple(jnp.moveaxis(maxed, -1, 0))

  def max(self, x: jax.Array) -> jax.Array:
    """Elementwise max over the slices (exact)."""
    return jax.lax.pmax(x, self.axis)

  def min(self, x: jax.Array) -> jax.Array:
    """Elementwise min over the slices (exact)."""
    return jax.lax.pmin(x, self.axis)

  def sum(self, x: jax.Array) -> jax.Array:
    """Elementwise sum over the slices."""
    return jax.lax.psum(x, self.axis)

  def any(self, x: jax.Array) -> jax.Array:
    """bool scalar: any(x) over the whole batch (every row on every device).

    x must be the same on every device of the vocabulary axis, as every
    run-time branch's predicate is: a test of the parameters, or of statistics
    after their combine. Only the row axes are then reduced, so with the rows
    whole (a 1 x m mesh) the decision costs no collective.
    """
    hit = jnp.any(x)
    if not self.row_axes:
      return hit
    return jax.lax.pmax(hit.astype(jnp.int32), tuple(self.row_axes)) > 0

  def owned(self, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(bool: the id is in this device's slice, int32: its local index, 0 where not owned)."""
    local = ids - self.offset()
    mine = (local >= 0) & (local < self.local)
    return mine, jnp.where(mine, local, 0)

  def take(self, x: jax.Array, ids: jax.Array) -> jax.Array:
    """`take_along_axis(x, ids, axis=-1)` with x's last axis split: the owner's value, summed with zeros (exact).

    Args:
      x: [..., V/m] this device's slice (any dtype; returned as it is).
      ids: int [..., n] global token ids in [0, V).
    """
    return self.take_many((x,), ids)[0]

  def take_many(self, xs: tuple[jax.Array, ...], ids: jax.Array) -> tuple[jax.Array, ...]:
    """`take` of several slices of one shape at the same ids, in one psum (each entry has one owner); the
    values come back in the slices' common dtype (a float widening, exact)."""
    mine, local = self.owned(ids)
    dtype = jnp.result_type(*xs)
    got = jnp.stack([jnp.take_along_axis(x, local, axis=-1).astype(dtype) for x in xs])
    summed = self.sum(jnp.where(mine[None], got, jnp.zeros((), got.dtype)))
    return tuple(summed)


def any_rows(x: jax.Array, shards: VocabShards | None) -> jax.Array:
  """bool scalar: any(x), over the whole batch under `shards` (every device the same)."""
  return jnp.any(x) if shards is None else shards.any(x)


def take_vocab(x: jax.Array, ids: jax.Array, shards: VocabShards | None) -> jax.Array:
  """`take_along_axis(x, ids, axis=-1)` over the vocabulary axis; under `shards` x is this device's
  slice and each id is read by its owner (`VocabShards.take`).

  Example:
    >>> x_d = take_vocab(logits, draft[..., None], shards)   # [B, K, 1]
  """
  return jnp.take_along_axis(x, ids, axis=-1) if shards is None else shards.take(x, ids)


def take_vocab_many(xs: tuple[jax.Array, ...], ids: jax.Array, shards: VocabShards | None) -> tuple[jax.Array, ...]:
  """`take_vocab` of several arrays of one shape at the same ids; under `shards` in one collective, the values
  in the arrays' common dtype.

  Example:
    >>> x_d, q_d = take_vocab_many((logits[:, :k], draft_probs), draft[..., None], shards)   # each [B, K, 1]
  """
  if shards is None:
    return tuple(jnp.take_along_axis(x, ids, axis=-1) for x in xs)
  return shards.take_many(xs, ids)


def shards_for(vocab: int, batch: int, *, word_aligned: bool = False, kernels: str = "xla") -> VocabShards | None:
  """The `VocabShards` a sampler call uses under the ambient mesh, or None for the single-device program.

  None without a mesh, without a "model" axis of more than one device, or when
  the vocabulary does not split into whole chunks per device (V % m != 0 or
  (V / m) % chunk_size(V) != 0; e.g. 151936 and 32000 split over 2, 4 or 8
  devices qualify, 49152 over 2 to 16): then the single-device program runs and
  XLA moves data as it must. `word_aligned` (a call with a token_bitmask): each
  device's slice must also start at a mask word ((V / m) % 32 == 0), so that
  the words split with the tokens they cover. Rows are split over "data" when
  it divides B. `kernels` ("xla", "pallas" or "auto", as the samplers take it)
  picks `VocabShards.search`: "auto" reads the slices with the Pallas kernel
  on a GPU, XLA's reduction elsewhere.

  Example:
    >>> with jax.set_mesh(make_mesh(1, 4)):  # doctest: +SKIP
    ...   shards_for(151936, 8)   # VocabShards(axis='model', size=4, vocab=151936, row_axes=())
  """
  mesh = ambient_mesh()
  if mesh.empty:
    return None
  sizes = dict(mesh.shape)
  m = int(sizes.get(MODEL_AXIS, 1))
  if m <= 1 or vocab % m or (vocab // m) % chunk_size(vocab) or (word_aligned and (vocab // m) % BITS):
    return None
  d = int(sizes.get(DATA_AXIS, 1))
  rows = (DATA_AXIS,) if d > 1 and batch % d == 0 else ()
  on_gpu = jax.default_backend() == "gpu"
  search = "pallas" if kernels == "pallas" or (kernels == "auto" and on_gpu) else "xla"
  return VocabShards(axis=MODEL_AXIS, size=m, vocab=vocab, row_axes=rows, search=search)


def row_spec(shards: VocabShards, ndim: int, vocab_last: bool = False) -> P:
  """PartitionSpec of a per-row array [B, ...] (rows over "data" if split; the last axis over "model" if V)."""
  spec = [shards.row_axes[0] if shards.row_axes else None] + [None] * (ndim - 1)
  if vocab_last:
    spec[-1] = shards.axis
  return P(*spec)


def sharded_call(fn, in_specs, out_specs):
  """`fn` as a `jax.shard_map` over the ambient mesh (`specdec_jax.mesh.sharded_call`), with check_vma off
  (the samplers mix replicated and per-device values by design: every combine above makes them agree).

  Under a mesh with Explicit axes the call runs with them made Auto
  (`jax.sharding.auto_axes`), so inputs laid out otherwise are moved to
  `in_specs` instead of refused, and the outputs come back as `out_specs`.

  Example:
    >>> tokens = sharded_call(program, (P("data", "model"),), P("data"))(logits)  # doctest: +SKIP
  """
  return mesh_sharded_call(fn, in_specs, out_specs, check_vma=False)
