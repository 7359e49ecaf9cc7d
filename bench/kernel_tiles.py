"""The Pallas blocks' tiles for one model shape, searched kernel by kernel, beside XLA's block halves.

Times each half of a decoder block alone, `L` layers of it per iteration of a
jitted `fori_loop` (each layer its own weights, so no weight is read from L2;
each layer's output feeds the next), at B*T rows (default 1), for the shape
`--shape` names (as bench/step_profile.py), and prints microseconds per layer
beside the floor (the layer's weight bytes over the device's copy bandwidth):

    mlp   `fused_mlp` (gate|up kernel, down kernel, their partial sums) against
          `mlp_block` on XLA's blocks at the same rows and padded to 16 rows
          (how the model runs a GPU call of few rows, `_invariant_length`)
    attn  `fused_attention` (q|k|v kernel, attention kernel, output product)
          against `attention_block`, likewise, on a cache of --cache-len slots

The search is coordinate descent from the models' current tiles: one group of
fields at a time over the values in GROUPS, keeping the fastest, then the next
group; every candidate is checked against XLA's block (max |diff| within 5% of the
largest output; bf16 over 28 layers drifts) before it is timed. The fastest tile sets
are what `MlpBlocks`/`AttentionBlocks` defaults should become for the shape.

    python bench/kernel_tiles.py --shape qwen2.5-coder-1.5b --out $OUT      # GPU
    python bench/kernel_tiles.py --tiny --out /tmp/kt --rounds 1             # CPU smoke run (interpreter)

Writes OUT/kernel_tiles.json (every candidate's time, device, versions).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from bench.step_profile import SHAPES, TINY, TINY_FLAGS, VARIANTS, layer_params, random_weights  # noqa: E402
from specdec_jax.kernels import attention as attention_kernels  # noqa: E402
from specdec_jax.kernels import mlp as pallas_mlp  # noqa: E402
from specdec_jax.models.config import TransformerConfig  # noqa: E402
from specdec_jax.models.transformer import (  # noqa: E402
  AttentionContext,
  attention_block,
  mlp_block,
  pallas_attention,
  rms_norm,
)

# Fields searched together, in this order, and the values tried (the current value is always kept as a candidate).
GROUPS = {
  "mlp": [
    {"block_f": (16, 32, 64, 128), "block_k1": (64, 128, 256)},
    {"num_warps": (2, 4, 8), "num_stages": (2, 3, 4, 5)},
    {"block_d": (32, 64, 128), "block_k2": (64, 128, 256), "split_k": (2, 4, 8, 16)},
  ],
  "attn": [
    {"block_h": (16, 32, 64), "block_k": (64, 128, 256), "split_k": (1, 2, 3, 6)},
    {"num_warps": (2, 4, 8), "num_stages": (2, 3, 4)},
    {"out.block_d": (32, 64), "out.block_k2": (64, 128), "out.split_k": (4, 8, 16)},
  ],
}


def replace(blocks, field: str, value):
  """blocks with `field` (or `out.field`, the attention's output-product tiles) set to value."""
  if field.startswith("out."):
    return dataclasses.replace(blocks, out=dataclasses.replace(blocks.out, **{field[4:]: value}))
  return dataclasses.replace(blocks, **{field: value})


def candidates(blocks, group: dict) -> list:
  """Every combination of the group's values over `blocks` (valid ones only), the current blocks first."""
  out = [blocks]
  combos = [blocks]
  for field, values in group.items():
    combos = [replace(b, field, v) for b in combos for v in values]
  for b in combos:
    try:
      b.validate()
    except ValueError:
      continue
    if b not in out:
      out.append(b)
  return out


def half_fn(c: TransformerConfig, half: str, impl, rows: int, pad: int | None, interpret: bool):
  """One call of L layers of `half` (x [1, rows, D], cache, start position -> x, cache): impl is a tile set
  (the Pallas kernels) or "xla" (XLA's block, on the rows padded to `pad` when given)."""

  def run(x, cache, p0, layers):
    k_cache, v_cache = cache
    t = x.shape[1] if pad is None or impl != "xla" else pad
    positions = p0 + jnp.arange(t, dtype=jnp.int32)[None, :]
    if t > x.shape[1]:  # the padding rows sit past the cache: they write nothing
      x = jnp.pad(x, ((0, 0), (0, t - x.shape[1]), (0, 0)))
      positions = positions.at[:, rows:].set(k_cache.shape[3])
    ctx = AttentionContext.create(positions, k_cache.shape[3], c)
    for i, p in enumerate(layers):
      if half == "mlp":
        x = (
          mlp_block(c, x, p)
          if impl == "xla"
          else pallas_mlp.fused_mlp(
            x, p["mlp_norm"], p["w_gate_up"], p["w_down"], c.rms_norm_eps, interpret=interpret, blocks=impl
          )
        )
        continue
      if impl == "xla":
        x, k_cache, v_cache = attention_block(
          c, x, rms_norm(x, p["attn_norm"], c.rms_norm_eps), p, k_cache, v_cache, i, ctx
        )
        continue
      x, k_cache, v_cache = pallas_attention(
        c, x, p, k_cache, v_cache, i, positions, ctx, interpret=interpret, blocks=impl
      )
    return x[:, :rows], (k_cache, v_cache)

  return run


def layer_bytes(c: TransformerConfig, half: str) -> int:
  """Weight bytes one layer of `half` reads."""
  item = jnp.dtype(c.dtype).itemsize
  d, f, n = c.d_model, c.d_ff, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
  if half == "mlp":
    return item * (d * 2 * f + f * d + d)
  return item * (d * n + c.num_heads * c.head_dim * d + d + (n if c.qkv_bias else 0))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", required=True)
  ap.add_argument("--shape", default="qwen2.5-coder-1.5b", choices=tuple(SHAPES))
  ap.add_argument("--tiny", action="store_true", help="a tiny model in the interpreter (CPU smoke run)")
  ap.add_argument("--halves", default="mlp,attn", help="comma list of mlp, attn")
  ap.add_argument("--rows", type=int, default=1, help="B*T rows of the call (B=1; default 1)")
  ap.add_argument("--cache-len", type=int, default=320)
  ap.add_argument("--rounds", type=int, default=2, help="passes of the coordinate descent over the groups")
  ap.add_argument("--target-ms", type=float, default=30.0)
  ap.add_argument("--repeats", type=int, default=3)
  args = ap.parse_args(argv)
  halves = [h for h in args.halves.split(",") if h]
  if any(h not in GROUPS for h in halves) or not 1 <= args.rows <= pallas_mlp.MAX_ROWS:
    ap.error(f"--halves from {list(GROUPS)}; --rows in 1..{pallas_mlp.MAX_ROWS}")
  interpret = not common.has_gpu()
  shape = {**TINY, **TINY_FLAGS[args.shape]} if args.tiny else SHAPES[args.shape]
  c = TransformerConfig(**shape, dtype=jnp.bfloat16)
  if args.tiny:
    c = c.replace(num_layers=2)
  # step_profile's random weights, one dict of fused per-layer arrays each (as the Transformer holds them).
  layers = layer_params(c, random_weights(c, jax.random.key(0)), VARIANTS["after"])
  bandwidth = common.copy_bandwidth()["bytes_per_s"] if common.has_gpu() else None
  os.makedirs(args.out, exist_ok=True)
  x0 = jax.random.normal(jax.random.key(1), (1, args.rows, c.d_model), jnp.float32).astype(c.dtype)
  cache0 = tuple(jnp.zeros((c.num_layers, 1, c.num_kv_heads, args.cache_len, c.head_dim), c.dtype) for _ in range(2))
  p0 = args.cache_len // 2
  report = {"info": common.device_info(), "config": vars(args), "model": shape, "copy_bytes_per_s": bandwidth}
  t_start = time.time()

  for half in halves:
    floor = layer_bytes(c, half) / bandwidth * 1e6 if bandwidth else None
    ref_out = jax.jit(half_fn(c, half, "xla", args.rows, None, interpret))(x0, cache0, p0, layers)[0]
    scale = float(jnp.max(jnp.abs(ref_out.astype(jnp.float32))))

    def time_impl(impl, pad=None):
      fn = half_fn(c, half, impl, args.rows, pad, interpret)
      out = jax.jit(fn)(x0, cache0, p0, layers)[0]
      diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref_out.astype(jnp.float32))))

      def step(i, carry, layers):
        x, cache = carry
        return fn(x, cache, p0 + i % 8, layers)

      r = common.time_per_iter(
        common.timed_loop(step), (x0, cache0), (layers,), target_s=args.target_ms / 1e3, repeats=args.repeats
      )
      return r["per_iter_s"] * 1e6 / c.num_layers, diff

    rows = []
    for name, pad in (("xla", None), ("xla padded to 16", pallas_mlp.MAX_ROWS)):
      us, diff = time_impl("xla", pad)
      rows.append({"impl": name, "us_per_layer": us, "max_abs_diff": diff})
      print(f"{half} {name:24s} {us:8.2f} us/layer  (floor {floor or 0:.2f})", flush=True)
    best = attention_kernels.blocks_for(c.d_model) if half == "attn" else pallas_mlp.BEST_BLOCKS
    best_us, _ = time_impl(best)
    seen = {best: best_us}
    for rnd in range(args.rounds):
      for group in GROUPS[half]:
        for blocks in candidates(best, group):
          if blocks in seen:
            continue
          try:
            us, diff = time_impl(blocks)
          except Exception as e:  # a tile set the compiler rejects (shared memory, registers): noted, skipped
            rows.append({"impl": repr(blocks), "error": str(e).splitlines()[0][:200]})
            seen[blocks] = float("inf")
            continue
          seen[blocks] = us
          ok = diff <= 0.05 * scale
          rows.append({"impl": repr(blocks), "us_per_layer": us, "max_abs_diff": diff, "ok": ok})
          if ok and us < best_us:
            best, best_us = blocks, us
            print(f"{half} round {rnd} {us:8.2f} us/layer  {blocks}", flush=True)
    print(f"{half} best {best_us:.2f} us/layer (floor {floor or 0:.2f}): {best}  [{time.time() - t_start:.0f}s]")
    report[half] = {"rows": rows, "best": repr(best), "best_us_per_layer": best_us, "floor_us_per_layer": floor}
    with open(os.path.join(args.out, "kernel_tiles.json"), "w") as f:  # after each half: a cut-off run keeps it
      json.dump(report, f, indent=1)
  print(f"wrote {args.out}/kernel_tiles.json")


if __name__ == "__main__":
  main()
