"""The attention half of a decoder block as Pallas GPU (Triton) kernels, for calls of few rows (chains and trees).

At batch 1 XLA runs a block's attention half (norm, q|k|v product, RoPE, two
cache writes, attention, output product, residual) as about 11 small kernels
of 1-5 us each, and the step is made of those launches, not of bytes. Here
the same half is three kernels:

  1. `_qkv_kernel`, grid ((H + 2 Hkv) Dh / (2 block_h),): a program computes
     2 block_h of one head's Dh columns of rms_norm(x) @ wqkv (q heads, then
     k heads, then v heads), plus the bias's columns where there is one
     (Qwen2's q/k/v biases), rotates q and k heads by RoPE, and writes its
     head: q to a [rows, H*Dh] buffer, k and v straight into the cache at
     each row's slot (the cache is aliased in and out, so the write is in
     place). The columns are loaded as matching pieces of the head's two
     halves, [D, block_h] at c and at c + Dh/2, which is RoPE's pairing
     (dims i and i + Dh/2), so the rotation needs no shuffle inside a tile.
     With `AttentionBlocks.split_k` > 1 (wide models: few column pieces, long
     columns) this is two kernels: programs (piece, chunk of D) write float32
     partial products, then one program per piece adds them in a fixed order
     and does the rest.
  2. `_attention_kernel`, grid (B, H): program (b, h) attends head h's T
     queries of row b over the live slots of the cache, [0, max position of
     the row], in blocks of `block_s` slots with an online softmax, and
     writes its [T, Dh] output. Query t sees slot s iff s <= positions[b, t]
     (the chain rule of `AttentionContext`), or, for a tree call, iff its row
     of the given mask says so; kernel 1 then writes at the given slots. A
     tree call reads each query's keys from the block of its first write slot
     on in a chain's order (`_tree_tails`: a node's ancestors where a chain of
     its path holds them), so a node's logits are the bits of one-token steps
     along its path, as a chain call's are.
  3. The output product plus the residual, `mlp.project_residual`
     (the MLP's down-projection kernel on wo).

Rows (B*T) are at most `MAX_ROWS` = 16, padded to 16 by masks, as in
`mlp` (the smallest M a Triton dot takes). The cache write happens
in kernel 1, before kernel 2 reads the cache, so a query sees its own key and
those of the call's earlier tokens, as in `attention_block`.

`interpret=True` runs the kernels in Pallas's interpreter (any backend;
slow), which is how the tests check them on a CPU.

Example:
  >>> x, k, v = fused_attention(x, p["attn_norm"], p["wqkv"], p["wo"], cache.k, cache.v, i, positions,
  ...                           cos, sin, num_heads=9, num_kv_heads=3, eps=1e-5)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from specdec_jax.kernels.mlp import (
  MAX_ROWS,
  MlpBlocks,
  _compiler_params,
  _load,
  normed_products,
  plgpu,
  project_residual,
)

_MASKED = -1e30  # a score no visible slot reaches; finite, so a block with nothing visible makes no NaN


@dataclasses.dataclass(frozen=True)
class AttentionBlocks:
  """Tile sizes and launch parameters of `fused_attention` (block sizes powers of two, >= 16).

  Attributes:
    block_k: rows of wqkv (the D contraction) per loop step of the q|k|v kernel.
    block_h: columns of each half of a head per program of the q|k|v kernel (capped at Dh/2);
      Dh/(2 block_h) programs share a head, so smaller means more programs.
    block_s: cache slots per loop step of the attention kernel.
    out: the output product's tiles (`MlpBlocks`' block_d, block_k2, split_k).
    num_warps, num_stages: Triton launch parameters of kernels 1 and 2.
    split_k: programs that share one piece of q|k|v columns, each reducing a chunk of D (calls
      without a prefix); > 1 makes kernel 1 two kernels: the products' float32 partials, then
      their sum with the bias, RoPE and the writes (wide models: enough programs for D = 1536).

  Example:
    >>> AttentionBlocks(block_s=32).block_s
    32
  """

  # The defaults are the fastest of bench/step_profile.py's sweep on an H100 (bench/RESULTS.md).
  block_k: int = 64
  block_h: int = 16
  block_s: int = 64
  out: MlpBlocks = MlpBlocks(block_d=32, block_k2=128, split_k=4, num_warps=2)
  num_warps: int = 4
  num_stages: int = 4
  split_k: int = 1

  def validate(self) -> None:
    for name in ("block_k", "block_h", "block_s"):
      v = getattr(self, name)
      if v < 16 or v & (v - 1):
        raise ValueError(f"AttentionBlocks.{name}={v}: must be a power of two >= 16")
    if min(self.num_warps, self.num_stages, self.split_k) < 1:
      raise ValueError(f"AttentionBlocks: num_warps, num_stages and split_k must be >= 1: {self}")

  def qkv_chunks(self, d: int) -> tuple[int, int]:
    """(programs sharing a column piece, K tiles each) of the q|k|v product over width d: split_k, less
    any chunks that would be empty."""
    tiles = pl.cdiv(d, self.block_k)
    per = pl.cdiv(tiles, self.split_k)
    return pl.cdiv(tiles, per), per
    self.out.validate()


DEFAULT_BLOCKS = AttentionBlocks()
# For wide models: the fastest of bench/kernel_tiles.py's search at D=1536 (Qwen2.5-Coder-1.5B) on an H200,
# K tiles of 256 rows (few, long loads), 32-wide strips of each head half and the q|k|v product split in three
# (32 column pieces alone would leave most of the GPU idle).
WIDE_BLOCKS = AttentionBlocks(
  block_k=256,
  block_h=32,
  out=MlpBlocks(block_d=32, block_k2=64, split_k=8, num_warps=2, num_stages=4),
  num_warps=2,
  num_stages=3,
  split_k=3,
)


def blocks_for(d: int) -> AttentionBlocks:
  """The tiles `fused_attention` takes by default at model width d: WIDE_BLOCKS from d = 1024 up, else DEFAULT_BLOCKS.

  Example:
    >>> blocks_for(576) == DEFAULT_BLOCKS, blocks_for(1536) == WIDE_BLOCKS
    (True, True)
  """
  return WIDE_BLOCKS if d >= 1024 else DEFAULT_BLOCKS


def check_args(x, wqkv, wo, k_cache, num_heads: int, num_kv_heads: int, prefix=None, bias=None) -> str | None:
  """None if these shapes and dtypes suit the kernels, else why not (static; safe under jit).

  Args:
    x: [B, T, D] (or its ShapeDtypeStruct); wqkv [D, (H + 2 Hkv) Dh] ([2D, ...] with a prefix);
    wo [H Dh, D]; k_cache: [L, B, Hkv, S, Dh]; num_heads, num_kv_heads: H and Hkv;
    prefix: None, or the [B, T, D] input normed ahead of x (`fused_attention`'s `prefix`);
    bias: None, or the q|k|v bias [(H + 2 Hkv) Dh] (`fused_attention`'s `bias`).

  Example:
    >>> s = jax.ShapeDtypeStruct
    >>> check_args(s((1, 1, 576), jnp.bfloat16), s((576, 960), jnp.bfloat16), s((576, 576), jnp.bfloat16),
    ...            s((30, 1, 3, 320, 64), jnp.bfloat16), 9, 3) is None
    True
  """
  if len(x.shape) != 3:
    return f"x must be [B, T, D], got shape {x.shape}"
  b, t, d = x.shape
  if not 1 <= b * t <= MAX_ROWS:
    return f"B*T = {b * t} rows; the kernels take 1..{MAX_ROWS}"
  if len(k_cache.shape) != 5 or k_cache.shape[1] != b or k_cache.shape[2] != num_kv_heads:
    return f"cache must be [L, B={b}, Hkv={num_kv_heads}, S, Dh], got {k_cache.shape}"
  dh = k_cache.shape[4]
  half = dh // 2
  if dh % 2 or half < 16 or half & (half - 1):
    return f"head_dim = {dh}: the kernels need head_dim / 2 a power of two >= 16"
  if num_heads % num_kv_heads:
    return f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
  n = (num_heads + 2 * num_kv_heads) * dh
  k = d if prefix is None else 2 * d
  if wqkv.shape != (k, n):
    return f"wqkv must be [{'D' if prefix is None else '2D'}={k}, (H + 2 Hkv) Dh = {n}], got {wqkv.shape}"
  if wo.shape != (num_heads * dh, d):
    return f"wo must be [H Dh = {num_heads * dh}, D={d}], got {wo.shape}"
  if prefix is not None and prefix.shape != x.shape:
    return f"prefix must have x's shape {x.shape}, got {prefix.shape}"
  if bias is not None and bias.shape != (n,):
    return f"bias must be [(H + 2 Hkv) Dh = {n}], got {bias.shape}"
  optional = tuple(a for a in (prefix, bias) if a is not None)
  dtypes = {jnp.dtype(a.dtype) for a in (x, wqkv, wo, k_cache, *optional)}
  if len(dtypes) != 1:
    return f"x, wqkv, wo, the cache (and prefix, bias) must share one dtype, got {sorted(str(a) for a in dtypes)}"
  return None


def _qkv_kernel(*refs, d, eps, block_k, prefix, bias=False, **head):
  """2 block_h columns of one head of q|k|v = rms_norm(x) @ wqkv (+ bias), rotated (q, k) and written.

  See the module docstring.

  Refs: layer [1] int32, slot [rows] int32 (write slot of each row's key/value; S = dropped),
  [with `prefix`: px [rows, D] and its norm weight pnw [D],] x [rows, D], nw [D],
  w [D or 2D, (H + 2 Hkv) Dh], [with `bias`: b [(H + 2 Hkv) Dh],] cos/sin [rows, Dh/2] float32;
  outputs q [rows, H Dh] and the caches [L, B, Hkv, S, Dh] (aliased to the _kc_in/_vc_in inputs:
  written in place). The norm and the product are `mlp.normed_products`, as in the MLP's gate|up
  kernel; with a prefix the product reads concat(rms_norm(px), rms_norm(x)), each part normed on
  its own. The rest is `_finish_head`; `head` holds its geometry (rows, t, heads, kv_heads, dh, s, block_h).
  """
  layer_ref, slot_ref, *refs = refs
  px_ref, pnw_ref, *refs = refs if prefix else (None, None, *refs)
  x_ref, nw_ref, w_ref, *refs = refs
  b_ref, *refs = refs if bias else (None, *refs)
  cos_ref, sin_ref, _, _, *outs = refs
  dh, block_h = head["dh"], head["block_h"]
  _, _, col0 = _head_columns(pl.program_id(0), dh, block_h)
  product = functools.partial(
    normed_products,
    w_ref=w_ref,
    lead=(),
    starts=(col0, col0 + dh // 2),
    width=block_h,
    col_ok=None,
    rows=head["rows"],
    d=d,
    eps=eps,
    block_k=block_k,
  )
  acc1, acc2 = product(x_ref, nw_ref, row0=d if prefix else 0)
  if prefix:  # its rows of wqkv come first
    p1, p2 = product(px_ref, pnw_ref)
    acc1, acc2 = acc1 + p1, acc2 + p2
  _finish_head(acc1, acc2, layer_ref[0], (slot_ref, b_ref, cos_ref, sin_ref, *outs), **head)


def _qkv_part_kernel(x_ref, nw_ref, w_ref, part_ref, *, rows, d, dh, eps, block_k, block_h, chunk_tiles):
  """The q|k|v product split over K: program (j, c) reduces K tiles [c chunk_tiles, (c + 1) chunk_tiles) of
  the columns `_qkv_kernel`'s program j takes, and writes them as float32 partials part [split, rows, N]."""
  j, c = pl.program_id(0), pl.program_id(1)
  _, _, col0 = _head_columns(j, dh, block_h)
  half = dh // 2
  first = c * chunk_tiles
  tiles = (first, jnp.minimum(chunk_tiles, pl.cdiv(d, block_k) - first))
  acc1, acc2 = normed_products(
    x_ref, nw_ref, w_ref, (), (col0, col0 + half), block_h, None, rows=rows, d=d, eps=eps, block_k=block_k, tiles=tiles
  )
  row_ok = (jnp.arange(MAX_ROWS) < rows)[:, None]
  plgpu.store(part_ref.at[c, pl.ds(0, MAX_ROWS), pl.ds(col0, block_h)], acc1, mask=row_ok)
  plgpu.store(part_ref.at[c, pl.ds(0, MAX_ROWS), pl.ds(col0 + half, block_h)], acc2, mask=row_ok)


def _qkv_finish_kernel(*refs, bias, **head):
  """`_qkv_kernel`'s program after a split product: adds up its columns' partials (in part order), then
  `_finish_head`. Refs: layer, slot, part [split, rows, N] float32, [b,] cos, sin, the caches (aliased), and
  the outputs q and the caches."""
  layer_ref, slot_ref, part_ref, *refs = refs
  b_ref, *refs = refs if bias else (None, *refs)
  cos_ref, sin_ref, _, _, *outs = refs
  _, _, col0 = _head_columns(pl.program_id(0), head["dh"], head["block_h"])
  row_ok = (jnp.arange(MAX_ROWS) < head["rows"])[:, None]
  accs = []
  for start in (col0, col0 + head["dh"] // 2):
    cols = (pl.ds(0, MAX_ROWS), pl.ds(start, head["block_h"]))
    acc = _load(part_ref, (jnp.int32(0), *cols), row_ok)
    for c in range(1, part_ref.shape[0]):
      acc += _load(part_ref, (jnp.int32(c), *cols), row_ok)
    accs.append(acc)
  _finish_head(*accs, layer_ref[0], (slot_ref, b_ref, cos_ref, sin_ref, *outs), **head)


def _head_columns(program, dh, block_h):
  """(head h, c0, col0) of a q|k|v program: it takes columns [c0, c0 + block_h) of each half of head h,
  col0 = h Dh + c0 in q|k|v (q heads, then k heads, then v heads)."""
  per_head = dh // 2 // block_h
  h, part = program // per_head, program % per_head
  c0 = part * block_h
  return h, c0, h * dh + c0


def _finish_head(acc1, acc2, layer, refs, *, rows, t, heads, kv_heads, dh, s, block_h):
  """From the float32 products of a q|k|v program's two column pieces [16, block_h]: adds the bias (where
  there is one), rounds to the model's dtype, rotates q and k heads by RoPE, and writes q, or the key or
  value at each row's slot of the cache. refs: (slot, bias or None, cos, sin, q, k cache, v cache)."""
  slot_ref, b_ref, cos_ref, sin_ref, q_ref, kc_ref, vc_ref = refs
  h, c0, col0 = _head_columns(pl.program_id(0), dh, block_h)
  half = dh // 2
  r = jnp.arange(MAX_ROWS)
  row_ok = r < rows
  if b_ref is not None:  # this program's columns of the bias, the same for every row
    acc1 = acc1 + b_ref[pl.ds(col0, block_h)].astype(jnp.float32)[None, :]
    acc2 = acc2 + b_ref[pl.ds(col0 + half, block_h)].astype(jnp.float32)[None, :]
  # Rounded to the model's dtype before RoPE, as `attention_block`'s projection output is.
  a1 = acc1.astype(q_ref.dtype).astype(jnp.float32)
  a2 = acc2.astype(q_ref.dtype).astype(jnp.float32)
  cs = _load(cos_ref, (pl.ds(0, MAX_ROWS), pl.ds(c0, block_h)), row_ok[:, None])
  sn = _load(sin_ref, (pl.ds(0, MAX_ROWS), pl.ds(c0, block_h)), row_ok[:, None])
  rotate = h < heads + kv_heads  # q and k heads; v heads are not rotated
  cs = jnp.where(rotate, cs, 1.0)
  sn = jnp.where(rotate, sn, 0.0)
  o1 = (a1 * cs - a2 * sn).astype(q_ref.dtype)  # rotate_half: [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]
  o2 = (a2 * cs + a1 * sn).astype(q_ref.dtype)

  @pl.when(h < heads)
  def _():
    mask = row_ok[:, None]
    plgpu.store(q_ref.at[pl.ds(0, MAX_ROWS), pl.ds(col0, block_h)], o1, mask=mask)
    plgpu.store(q_ref.at[pl.ds(0, MAX_ROWS), pl.ds(col0 + half, block_h)], o2, mask=mask)

  def write(cache_ref, head):
    # Each row goes to its own (b, slot): a row is picked out of the tile by a masked sum (Triton
    # tiles cannot be indexed), then stored as two [block_h] vectors; slot S (out of range) is masked off.
    for row in range(rows):
      slot = slot_ref[row]
      ok = jnp.full((block_h,), slot < s)
      pick = (r == row)[:, None]
      for tile, start in ((o1, c0), (o2, c0 + half)):
        vec = jnp.sum(jnp.where(pick, tile.astype(jnp.float32), 0.0), axis=0).astype(cache_ref.dtype)
        plgpu.store(cache_ref.at[layer, jnp.int32(row // t), head, slot, pl.ds(start, block_h)], vec, mask=ok)

  @pl.when((h >= heads) & (h < heads + kv_heads))
  def _():
    write(kc_ref, h - heads)

  @pl.when(h >= heads + kv_heads)
  def _():
    write(vc_ref, h - heads - kv_heads)


def _attention_kernel(*refs, t, group, dh, s, block_s, masked):
  """Head h of row b: softmax(q k^T / sqrt(Dh), visible slots) v over the live slots.

  Refs: layer [1], pos [rows] int32, [with `masked`: mask [rows, S] int8, start [B] int32, tail_len [B]
  int32 and tail [rows, S] int32,] q [rows, H Dh], caches [L, B, Hkv, S, Dh], o [rows, H Dh]. Without a mask a query
  sees the slots s <= its position and the loop runs over the slot blocks up to the row's largest
  position (all S when that is out of range), so a short context reads a short cache. With one (tree
  calls) a query sees the slots its mask row marks: the blocks before start[b] as a chain's query
  does, then its own visible slots from start[b] on in the order `_tree_tails` lists them (`tail`,
  -1 past the last), which puts a node's ancestors where a chain of its path holds them. Each block
  of the tail is one product per row (its own keys), so a node's scores and sums are a chain's bits.
  """
  if masked:
    layer_ref, pos_ref, mask_ref, start_ref, tail_len_ref, tail_ref, q_ref, kc_ref, vc_ref, o_ref = refs
  else:
    layer_ref, pos_ref, q_ref, kc_ref, vc_ref, o_ref = refs
  b, h = pl.program_id(0), pl.program_id(1)
  layer = layer_ref[0]
  hk = h // group
  r = jnp.arange(MAX_ROWS)
  row_ok = r < t
  pos = _load(pos_ref, (pl.ds(b * t, MAX_ROWS),), row_ok)  # [16]; padded rows read 0, see slot 0 only
  q = _load(q_ref, (pl.ds(b * t, MAX_ROWS), pl.ds(h * dh, dh)), row_ok[:, None])  # [16, Dh]
  if masked:
    live = jnp.minimum(start_ref[b], s)  # the blocks before the tail, read as a chain reads them
  else:
    live = jnp.minimum(jnp.max(jnp.where(row_ok, pos, 0)) + 1, s)
  scale = 1.0 / math.sqrt(dh)

  def update(carry, sc, visible, values):
    """The online softmax's step over a block: scores sc [16, bs], their visibility, and values(p, base) =
    base + p @ v, in that form in both loops: Triton folds the add into the product's accumulator, which
    rounds otherwise than an add after it."""
    m, l, acc = carry
    sc = jnp.where(visible, sc, _MASKED)
    m_new = jnp.maximum(m, jnp.max(sc, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(sc - m_new[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    return m_new, l, values(p, acc * alpha[:, None])

  def body(j, carry):
    slots = j * block_s + jnp.arange(block_s)
    s_ok = slots < s
    sl = pl.ds(j * block_s, block_s)
    kt = _load(kc_ref, (layer, b, hk, sl, pl.ds(0, dh)), s_ok[:, None])  # [bs, Dh]
    vt = _load(vc_ref, (layer, b, hk, sl, pl.ds(0, dh)), s_ok[:, None])
    sc = jnp.dot(q, kt.T, preferred_element_type=jnp.float32) * scale  # [16, bs]
    if masked:  # padded rows see nothing: their (unstored) output is 0
      visible = _load(mask_ref, (pl.ds(b * t, MAX_ROWS), sl), row_ok[:, None] & s_ok[None, :]) != 0
    else:
      visible = (slots[None, :] <= pos[:, None]) & s_ok[None, :]
    return update(
      carry, sc, visible, lambda p, base: base + jnp.dot(p.astype(vt.dtype), vt, preferred_element_type=jnp.float32)
    )

  def tail_body(j, carry):
    # Each row its own keys: the same [16, bs] products as a chain's, each row's taken from its own.
    cols = j * block_s + jnp.arange(block_s)
    c_ok = cols < s
    idx = _load(tail_ref, (pl.ds(b * t, MAX_ROWS), pl.ds(j * block_s, block_s)), row_ok[:, None] & c_ok[None, :])
    visible = row_ok[:, None] & c_ok[None, :] & (idx >= 0)

    def row_tile(cache_ref, r):
      """Row r's own [bs, Dh] tile of `cache_ref`: the cache rows of its tail's slots in this block."""
      own = jnp.maximum(_load(tail_ref, (b * t + r, pl.ds(j * block_s, block_s)), c_ok), 0)  # -1 reads slot 0, hidden
      return _load(cache_ref, (layer, b, hk, own[:, None], jnp.arange(dh)[None, :]), c_ok[:, None])

    def rows(product, n):
      """[16, n]: row r of product(r) for each of the call's rows r (rows past t: 0). A loop, not unrolled:
      unrolled, Triton keeps every row's operand tiles in shared memory at once (over the GPU's limit at T=16)."""

      def one(r, out):
        return jnp.where((jnp.arange(MAX_ROWS) == r)[:, None], product(r), out)

      return lax.fori_loop(0, t, one, jnp.zeros((MAX_ROWS, n), jnp.float32))

    sc = rows(lambda r: jnp.dot(q, row_tile(kc_ref, r).T, preferred_element_type=jnp.float32) * scale, block_s)

    def values(p, base):  # the value tiles are read again rather than kept: 16 of them would not fit in registers
      return rows(
        lambda r: (
          base
          + jnp.dot(
            jnp.where((jnp.arange(MAX_ROWS) == r)[:, None], p, 0.0).astype(vc_ref.dtype),
            row_tile(vc_ref, r),
            preferred_element_type=jnp.float32,
          )
        ),
        dh,
      )

    return update(carry, sc, visible, values)

  init = (
    jnp.full((MAX_ROWS,), _MASKED, jnp.float32),
    jnp.zeros((MAX_ROWS,), jnp.float32),
    jnp.zeros((MAX_ROWS, dh), jnp.float32),
  )
  carry = lax.fori_loop(0, pl.cdiv(live, block_s), body, init)
  if masked:
    carry = lax.fori_loop(0, pl.cdiv(jnp.minimum(tail_len_ref[b], s), block_s), tail_body, carry)
  _, l, acc = carry
  out = acc / jnp.maximum(l, 1e-30)[:, None]
  plgpu.store(o_ref.at[pl.ds(b * t, MAX_ROWS), pl.ds(h * dh, dh)], out.astype(o_ref.dtype), mask=row_ok[:, None])


def _tree_tails(mask, slots, s: int, block_s: int):
  """Where a tree call's queries read their keys from the tail on: (start [B], tail_len [B], tail [B*T, S]).

  A chain holds a query's keys in the slots of their positions; a tree call writes its nodes at slots of
  their own, so a node's ancestors sit elsewhere, and an attention that walked the slots in order would
  add them up in another order than a chain of the node's path (and plain decoding) does. The slots before
  `start` (the block holding the call's first write slot; mask-visible context) are walked as a chain walks
  them; from `start` on, each query reads its visible slots in ascending order, packed (`tail` row: the
  slot of each position, -1 past the last), which puts the context's last slots and then the node's
  ancestors, written in topological order, where a chain of its path holds them. `tail_len`: the longest
  row's visible slots from `start` on.
  """
  b, t, _ = mask.shape
  first = jnp.min(jnp.where((slots >= 0) & (slots < s), slots, s), axis=1)  # [B]
  start = (jnp.minimum(first, s) // block_s * block_s).astype(jnp.int32)
  slot = jnp.arange(s, dtype=jnp.int32)
  visible = mask & (slot[None, None, :] >= start[:, None, None])  # [B, T, S]
  tail = jnp.sort(jnp.where(visible, slot, s), axis=-1)  # ascending, the visible first
  tail_len = jnp.max(jnp.sum(visible, axis=-1), axis=1).astype(jnp.int32)  # [B]
  return start, tail_len, jnp.where(tail < s, tail, -1).reshape(b * t, s).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("num_heads", "num_kv_heads", "eps", "interpret", "blocks"))
def fused_attention(
  x,
  norm_weight,
  wqkv,
  wo,
  k_cache,
  v_cache,
  layer,
  positions,
  cos,
  sin,
  *,
  num_heads: int,
  num_kv_heads: int,
  eps: float,
  interpret: bool = False,
  blocks: AttentionBlocks = DEFAULT_BLOCKS,
  prefix=None,
  slots=None,
  mask=None,
  bias=None,
):
  """x + attention(rms_norm(x)) with layer `layer`'s cache write: `attention_block` of a chain call.

  Args:
    x: [B, T, D] residual stream, B*T <= 16; the model's dtype.
    norm_weight: [D] (`p["attn_norm"]`).
    wqkv: [D, (H + 2 Hkv) Dh] fused projection (`p["wqkv"]`: q heads, k heads, v heads).
    wo: [H Dh, D] output projection.
    k_cache, v_cache: [L, B, Hkv, S, Dh], x's dtype; updated in place inside a caller's jit.
    layer: int, which layer of the cache (static or traced; clamped into [0, L)).
    positions: int32 [B, T]: each token's position; its key/value goes to slot `position` (dropped
      outside [0, S)) and its query sees the slots s <= position.
    cos, sin: float32 [B, T, Dh/2]: RoPE's tables at `positions` (the first half of
      `AttentionContext.cos`; both halves are equal).
    num_heads, num_kv_heads: H and Hkv (static).
    eps: RMSNorm epsilon (static).
    interpret: run in Pallas's interpreter (any backend; for tests).
    blocks: tile sizes (`AttentionBlocks`; static).
    prefix: None, or (p [B, T, D], its norm weight [D]): the attention then reads
      concat(rms_norm(p), rms_norm(x)) [2D] through wqkv [2D, ...], each part
      normed on its own (the EAGLE drafter's first block: p is the next token's
      embedding, x the hidden); the residual is still x.
    slots: None (each key/value goes to slot `position`), or int32 [B, T]: the
      slot each token's key/value is written to (dropped outside [0, S)), as
      `Transformer`'s `cache_slots` (trees of drafts).
    mask: None (a query sees the slots s <= its position), or bool [B, T, S]:
      which slots each query sees, as `Transformer`'s `attention_mask`; the
      call's own keys are written first, so a query may see them.
    bias: None (no bias: the kernel as without this argument), or the q|k|v
      bias [(H + 2 Hkv) Dh] (`p["bqkv"]` of a model with `qkv_bias`), x's
      dtype: added to the float32 products before their rounding and RoPE.

  Returns:
    (x + attention [B, T, D], k_cache, v_cache), equal to `attention_block`'s up to rounding.

  Raises:
    ValueError: shapes or dtypes the kernels do not take (see `check_args`).

  Example:
    >>> cos, sin = ctx.cos[:, :, 0, :32], ctx.sin[:, :, 0, :32]  # doctest: +SKIP
    >>> x, kc, vc = fused_attention(x, p["attn_norm"], p["wqkv"], p["wo"], kc, vc, 3, pos, cos, sin,
    ...                             num_heads=9, num_kv_heads=3, eps=1e-5)  # doctest: +SKIP
  """
  px, pnw = (None, None) if prefix is None else prefix
  why = check_args(x, wqkv, wo, k_cache, num_heads, num_kv_heads, px, bias)
  if why:
    raise ValueError(f"fused_attention: {why}")
  if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
    raise ValueError(f"fused_attention: k_cache {k_cache.shape} and v_cache {v_cache.shape} differ")
  if slots is not None and slots.shape != positions.shape:
    raise ValueError(f"fused_attention: slots must have the shape of positions {positions.shape}, got {slots.shape}")
  if mask is not None and mask.shape != (*positions.shape, k_cache.shape[3]):
    raise ValueError(
      f"fused_attention: mask must be [B, T, S] = {(*positions.shape, k_cache.shape[3])}, got {mask.shape}"
    )
  if plgpu is None:  # pragma: no cover
    raise ValueError("fused_attention: jax.experimental.pallas.triton is not importable")
  blocks.validate()
  b, t, d = x.shape
  _, _, hkv, s, dh = k_cache.shape
  rows, half = b * t, dh // 2
  block_h = min(blocks.block_h, half)
  layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, k_cache.shape[0] - 1).reshape(1)
  pos = positions.reshape(rows).astype(jnp.int32)
  slots = pos if slots is None else slots.reshape(rows).astype(jnp.int32)
  slots = jnp.where((slots >= 0) & (slots < s), slots, s)
  x2 = x.reshape(rows, d)
  params = _compiler_params(blocks, interpret)  # num_warps, num_stages of kernels 1 and 2

  split, chunk_tiles = blocks.qkv_chunks(d) if prefix is None else (1, 0)
  programs = (num_heads + 2 * hkv) * (half // block_h)
  head_args = dict(rows=rows, t=t, heads=num_heads, kv_heads=hkv, dh=dh, s=s, block_h=block_h)
  tables = (cos.reshape(rows, half).astype(jnp.float32), sin.reshape(rows, half).astype(jnp.float32))
  biases = () if bias is None else (bias,)
  if split == 1:
    kernel = functools.partial(
      _qkv_kernel,
      d=d,
      eps=float(eps),
      block_k=blocks.block_k,
      prefix=prefix is not None,
      bias=bias is not None,
      **head_args,
    )
    inputs = (x2, norm_weight) if prefix is None else (px.reshape(rows, d), pnw, x2, norm_weight)
    inputs += (wqkv, *biases)
  else:  # the products' partials first, then kernel 1's remaining work on their sum
    parts = pl.pallas_call(
      functools.partial(
        _qkv_part_kernel,
        rows=rows,
        d=d,
        dh=dh,
        eps=float(eps),
        block_k=blocks.block_k,
        block_h=block_h,
        chunk_tiles=chunk_tiles,
      ),
      out_shape=jax.ShapeDtypeStruct((split, rows, wqkv.shape[1]), jnp.float32),
      grid=(programs, split),
      interpret=interpret,
      compiler_params=params,
      name="fused_attention_qkv_parts",
    )(x2, norm_weight, wqkv)
    kernel = functools.partial(_qkv_finish_kernel, bias=bias is not None, **head_args)
    inputs = (parts, *biases)
  q, k_cache, v_cache = pl.pallas_call(
    kernel,
    out_shape=(
      jax.ShapeDtypeStruct((rows, num_heads * dh), x.dtype),
      jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
      jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
    ),
    grid=(programs,),
    # The caches, which come after layer, slots, the inputs, cos and sin, are written in place.
    input_output_aliases={len(inputs) + 4: 1, len(inputs) + 5: 2},
    interpret=interpret,
    compiler_params=params,
    name="fused_attention_qkv",
  )(layer, slots, *inputs, *tables, k_cache, v_cache)

  visibility = ()
  if mask is not None:  # int8 [rows, S] (a Triton load of bool is not portable), and the tails
    visibility = (mask.reshape(rows, s).astype(jnp.int8), *_tree_tails(mask, slots.reshape(b, t), s, blocks.block_s))
  attn = pl.pallas_call(
    functools.partial(
      _attention_kernel, t=t, group=num_heads // hkv, dh=dh, s=s, block_s=blocks.block_s, masked=mask is not None
    ),
    out_shape=jax.ShapeDtypeStruct((rows, num_heads * dh), x.dtype),
    grid=(b, num_heads),
    interpret=interpret,
    compiler_params=params,
    name="fused_attention_core",
  )(layer, pos, *visibility, q, k_cache, v_cache)

  out = project_residual(attn, wo[None], x2, jnp.zeros((1,), jnp.int32), blocks=blocks.out, interpret=interpret)
  return out.reshape(b, t, d), k_cache, v_cache
