"""Where one decode step of a SmolLM2-shaped target goes: structure variants and ablations side by side.

Times one target call per iteration of a jitted `fori_loop` (the way the
decoding loops run it: no host round trip between steps), each step's greedy
token feeding the next, at B in --batch-sizes on a cache of --cache-len slots,
for these variants of the same weights (random, SmolLM2-135M's shape):

    before        layers under lax.scan, separate q/k/v and gate/up matmuls (the model until this script)
    scan+fused    lax.scan, one q|k|v and one gate|up matmul   (TransformerConfig(scan_layers=True))
    unrolled      straight-line layers, separate matmuls
    after         straight-line layers, fused matmuls           (the Transformer's default)
    after-attn    `after` without attention (q/k/v, RoPE, cache write, attention and output projection)
    after-mlp     `after` without the MLP
    after-head    `after` without the final norm and LM head (the step's token comes from the residual)
    after-bare    `after` with neither attention nor MLP: embedding, norms, head and the per-layer glue
    pallas        `after` with each block as Pallas kernels      (TransformerConfig(kernels="pallas"); GPU, bf16)

and one verification call of K+1 tokens (`--k`) for `before`, `after` and `pallas`. The
variants are this script's own forward pass over `decoder_block` and friends;
`after` is checked equal to `Transformer.__call__` (and `scan+fused` to
`scan_layers=True`) before anything is timed. `--trace DIR` also records a
`jax.profiler` trace of a few `after` steps at the first batch size and prints
the kernels that took the most time (name, count per step, microseconds per
step), read from the trace's Chrome-format JSON.

    python bench/step_profile.py --out /tmp/step                 # GPU: bf16, B in 1,8,32
    python bench/step_profile.py --tiny --out /tmp/step          # CPU smoke run (tiny model)

Writes OUT/step_profile.json (every figure, device, versions) and
OUT/step_profile.png (step time per variant and batch size; needs matplotlib,
`pip install -e ".[bench]"`, or pass --no-plot).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import gzip
import json
import os
import sys
import time
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402
from specdec_jax.kernels import attention as pallas_attention
from specdec_jax.kernels import mlp as pallas_mlp
from specdec_jax.kernels.mlp import MAX_ROWS  # noqa: E402
from specdec_jax.models import Transformer, TransformerConfig  # noqa: E402
from specdec_jax.models.transformer import (
  _LAYER_PARAMS,
  AttentionContext,
  KVCache,
  attention_block,
  fuse_projections,
  mlp_block,
  pallas_block,
  rms_norm,
)

SMOLLM2 = dict(
  vocab_size=49152, num_layers=30, d_model=576, num_heads=9, num_kv_heads=3, head_dim=64, d_ff=1536, rope_theta=1e5
)
TINY = dict(vocab_size=512, num_layers=4, d_model=64, num_heads=4, num_kv_heads=2, head_dim=32, d_ff=128)

# name -> (scan, fused, attention, mlp, head, pallas)
VARIANTS = {
  "before": (True, False, True, True, True, False),
  "scan+fused": (True, True, True, True, True, False),
  "unrolled": (False, False, True, True, True, False),
  "after": (False, True, True, True, True, False),
  "after-attn": (False, True, False, True, True, False),
  "after-mlp": (False, True, True, False, True, False),
  "after-head": (False, True, True, True, False, False),
  "after-bare": (False, True, False, False, True, False),
  "pallas": (False, True, True, True, True, "pallas"),
}
# Tile sizes of the pallas variant, and others to compare ("pallas:NAME" in --variants): NAME -> (AttentionBlocks
# fields, MlpBlocks fields) over the defaults the models use, which are "pallas" (= the sweep's "h16k64s4").
# Names measured in bench/archive/RESULTS_HISTORY.md's sweep spell out every attention field that differs from today's defaults
# (the sweep's first runs were over older defaults, FIRST).
FIRST = {"block_h": 32, "block_k": 128, "num_stages": 2}
PALLAS_TILES = {
  "pallas": ({}, {}),
  "first": (FIRST, {}),
  "h16": ({**FIRST, "block_h": 16}, {}),
  "w2": ({**FIRST, "num_warps": 2}, {}),
  "h16w2": ({**FIRST, "block_h": 16, "num_warps": 2}, {}),
  "h16k64s4": ({}, {}),
  "k1024w8": ({**FIRST, "block_k": 1024, "num_warps": 8}, {}),
  "h16k1024w4": ({**FIRST, "block_h": 16, "block_k": 1024}, {}),
  "mk1024w8": (FIRST, {"block_k1": 1024, "num_warps": 8}),
  "mk1024w4f32": (FIRST, {"block_f": 32, "block_k1": 1024, "num_warps": 4}),
  "mk64s4": (FIRST, {"block_k1": 64, "block_k2": 64, "num_stages": 4, "split_k": 8}),
  "s32": ({**FIRST, "block_s": 32}, {}),
  "k64s4": ({"block_h": 32}, {}),
  "h16k32s4": ({"block_k": 32}, {}),
  "h16k64s5w2": ({"num_stages": 5, "num_warps": 2}, {}),
  "q+m64s4": ({}, {"block_k1": 64, "block_k2": 64, "num_stages": 4}),
  "q+m64s4w4": ({}, {"block_k1": 64, "block_k2": 64, "num_stages": 4, "num_warps": 4}),
  "q+m32s4": ({}, {"block_k1": 32, "block_k2": 32, "num_stages": 4}),
  "q+o64s4": ({"out": {"block_k2": 64, "num_stages": 4}}, {}),
  "q+all64s4": ({"out": {"block_k2": 64, "num_stages": 4}}, {"block_k1": 64, "block_k2": 64, "num_stages": 4}),
}
for _name in PALLAS_TILES:
  if _name != "pallas":
    VARIANTS[f"pallas:{_name}"] = (False, True, True, True, True, _name)


def layer_params(weights: dict, variant) -> dict | list:
  """Per-layer parameters as `decoder_block` reads them, fused or separate: stacked [L, ...] for a scan, else
  one dict of its own arrays per layer (as the Transformer holds them: slices of a stacked array inside the
  step would be copies)."""
  scan, fused = variant[:2]
  stacked = {name: weights[f"layers.{name}"] for name in _LAYER_PARAMS}
  stacked = fuse_projections(stacked) if fused else stacked
  if scan:
    return stacked
  return [{name: jnp.array(w[i], copy=True) for name, w in stacked.items()} for i in range(len(stacked["wo"]))]


def pallas_tiles(name: str):
  """PALLAS_TILES[name] as (AttentionBlocks, MlpBlocks) over the models' defaults."""
  attn, mlp_tiles = dict(PALLAS_TILES[name][0]), PALLAS_TILES[name][1]
  if "out" in attn:  # the output projection's tiles, over the default ones
    attn["out"] = dataclasses.replace(pallas_attention.DEFAULT_BLOCKS.out, **attn["out"])
  return (
    dataclasses.replace(pallas_attention.DEFAULT_BLOCKS, **attn),
    dataclasses.replace(pallas_mlp.BEST_BLOCKS, **mlp_tiles),
  )


def forward(c: TransformerConfig, weights: dict, layers: dict, tokens, positions, cache: KVCache, variant):
  """The Transformer's forward pass with parts switched off: logits [B, T, V] (or the residual) and the cache."""
  scan, _, attention, mlp, head, pallas = variant
  x = jnp.take(weights["embed"], jnp.clip(tokens, 0, c.vocab_size - 1), axis=0)
  ctx = AttentionContext.create(positions, cache.max_length, c)

  if pallas:
    attn_blocks, mlp_blocks = pallas_tiles(pallas)

  def block(carry, layer):
    x, k_cache, v_cache = carry
    p, i = layer
    if pallas and x.shape[0] * x.shape[1] <= MAX_ROWS:  # as kernels="pallas" ("pallas_interpret" off a GPU)
      return pallas_block(
        c,
        x,
        p,
        k_cache,
        v_cache,
        i,
        positions,
        ctx,
        interpret=not common.has_gpu(),
        attn_blocks=attn_blocks,
        mlp_blocks=mlp_blocks,
      ), None
    if attention:
      x, k_cache, v_cache = attention_block(
        c, x, rms_norm(x, p["attn_norm"], c.rms_norm_eps), p, k_cache, v_cache, i, ctx
      )
    if mlp:
      x = mlp_block(c, x, p)
    if not (attention or mlp):  # the per-layer glue alone: two norms' worth of elementwise work
      x = x + rms_norm(x, p["attn_norm"], c.rms_norm_eps) + rms_norm(x, p["mlp_norm"], c.rms_norm_eps)
    return (x, k_cache, v_cache), None

  carry = (x, cache.k, cache.v)
  if scan:
    carry, _ = jax.lax.scan(block, carry, (layers, jnp.arange(c.num_layers, dtype=jnp.int32)))
  else:
    for i in range(c.num_layers):
      carry, _ = block(carry, (layers[i], i))
  x, k_cache, v_cache = carry
  if head:
    x = rms_norm(x, weights["final_norm"], c.rms_norm_eps)
    out = jnp.einsum("btd,vd->btv", x, weights["embed"], preferred_element_type=jnp.float32)
  else:
    out = x.astype(jnp.float32)
  return out, KVCache(k=k_cache, v=v_cache)


def step_fn(c: TransformerConfig, variant, t: int, p0: int, span: int):
  """Loop body: one call of T tokens at a position that moves with i; its argmax feeds the next call."""

  def step(i, carry, weights, layers):
    cache, tokens = carry
    b = tokens.shape[0]
    pos = jnp.broadcast_to(p0 + i % span + jnp.arange(t, dtype=jnp.int32), (b, t))
    out, cache = forward(c, weights, layers, tokens, pos, cache, variant)
    nxt = jnp.argmax(out[:, -1], axis=-1).astype(jnp.int32) % c.vocab_size
    return cache, jnp.broadcast_to(nxt[:, None], (b, t))

  return step


def check_against_model(model: Transformer, weights: dict, variants) -> dict:
  """This script's `after` equals the Transformer's default call, `scan+fused` its scan_layers=True call, and
  `pallas` (when asked for) the default call as well, while the Transformer's kernels="pallas" call is checked to
  lower to Triton kernels ("pallas_interpret" without a GPU) and to agree too (max |diff| each). `model` holds
  `weights` under the default config."""
  c = model.config
  tokens = jnp.asarray(np.arange(10, dtype=np.int32).reshape(2, 5) % c.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
  call = jax.jit(lambda t, p, m: m(t, p, m.init_cache(2, 8))[0])
  ref = call(tokens, pos, model)
  wants = {c: ref}  # the Transformer's logits per config, each computed once
  diffs = {}
  checks = [("after", c), ("scan+fused", c.replace(scan_layers=True))]
  if "pallas" in variants:
    kernels = "pallas" if common.has_gpu() else "pallas_interpret"
    pallas_model = Transformer.from_weights(c.replace(kernels=kernels), weights)
    if kernels == "pallas" and "xla.gpu.triton" not in call.lower(tokens, pos, pallas_model).as_text():
      raise AssertionError("kernels='pallas' did not take the Pallas path for this call")
    diffs["model(kernels=pallas)"] = float(jnp.max(jnp.abs(ref - call(tokens, pos, pallas_model))))
    checks.append(("pallas", c))
  for name, cfg in checks:
    if cfg not in wants:
      wants[cfg] = call(tokens, pos, Transformer.from_weights(cfg, weights))
    mine = jax.jit(
      lambda t, p, n=name: forward(
        c, weights, layer_params(weights, VARIANTS[n]), t, p, model.init_cache(2, 8), VARIANTS[n]
      )[0]
    )(tokens, pos)
    diffs[name] = float(jnp.max(jnp.abs(wants[cfg] - mine)))
  # Equal on a CPU in float32; a GPU may fuse the programs differently, or the kernels round differently
  # (bf16), not more.
  for name, diff in diffs.items():
    if diff > 0.02 * float(jnp.max(jnp.abs(ref))):
      raise AssertionError(f"{name}: differs from the Transformer's default call by {diff}")
  return diffs


def kernel_table(trace_dir: str, steps: int, top: int = 25) -> list[dict]:
  """Per-kernel totals from a jax.profiler trace's Chrome-format JSON: the device events, grouped by name."""
  files = sorted(
    glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    + glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
  )
  if not files:
    return []
  with gzip.open(files[-1], "rt") as f:
    trace = json.load(f)
  events = trace.get("traceEvents", [])
  # Device (GPU) events live under processes whose name mentions the device; host threads are the rest.
  names = {
    e["pid"]: e.get("args", {}).get("name", "")
    for e in events
    if e.get("ph") == "M" and e.get("name") == "process_name"
  }
  device_pids = {pid for pid, n in names.items() if "/device:" in n or "GPU" in n or "gpu" in n}
  # A device has a thread per CUDA stream ("Stream #..."): kernels and copies. Its other threads ("XLA Ops",
  # "XLA Modules", ...) repeat the same time under op and program names, so they are left out where streams exist.
  threads = {
    (e["pid"], e.get("tid")): e.get("args", {}).get("name", "")
    for e in events
    if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("pid") in device_pids
  }
  streams = {key for key, n in threads.items() if n.startswith("Stream")}
  totals, counts = defaultdict(float), defaultdict(int)
  for e in events:
    key = (e.get("pid"), e.get("tid"))
    if streams and key not in streams:
      continue
    if e.get("ph") == "X" and e.get("pid") in device_pids and "dur" in e:
      totals[e["name"]] += e["dur"]
      counts[e["name"]] += 1
  rows = [{"kernel": k, "per_step": counts[k] / steps, "us_per_step": totals[k] / steps} for k in totals]
  rows.sort(key=lambda r: -r["us_per_step"])
  return rows[:top]


def profile_kernels(run, trace_dir: str, steps: int, top: int) -> tuple[list[dict], str | None]:
  """(`kernel_table` of one profiled `run()` of `steps` steps, None), or ([], repr(error)) if profiling failed.

  The profiler needs CUPTI on a GPU; callers keep their timings either way.
  """
  try:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      jax.block_until_ready(run())
    return kernel_table(trace_dir, steps, top=top), None
  except Exception as e:  # noqa: BLE001  (any profiler or trace-format failure: report it, keep the rest)
    return [], repr(e)


def trace_kernels(c, weights, name, cache: KVCache, p0, trace_dir, report) -> list[dict]:
  """Profiles 20 one-token steps of variant `name` from a zero `cache` [L, B, Hkv, S, Dh] and prints its
  costliest kernels."""
  b, cache_len = cache.batch_size, cache.max_length
  layers = layer_params(weights, VARIANTS[name])
  loop = common.timed_loop(step_fn(c, VARIANTS[name], 1, p0, max(cache_len - p0 - 1, 1)))
  carry = (cache, jnp.full((b, 1), 7, jnp.int32))
  jax.block_until_ready(loop(0, 4, carry, weights, layers))
  steps = 20
  table, error = profile_kernels(lambda: loop(0, steps, carry, weights, layers), trace_dir, steps, top=80)
  if error:
    report["trace_error"] = error
    print(f"trace failed: {error}")
  if table:
    print(f"\nkernels of one `{name}` step at B={b} (top 25 by time), from the trace in {trace_dir}:")
    for r in table[:25]:
      print(f"  {r['us_per_step']:8.1f} us  x{r['per_step']:5.1f}  {r['kernel'][:100]}")
    print(
      f"  all device kernels: {sum(r['per_step'] for r in table):.0f} launches (top {len(table)} names), "
      f"{sum(r['us_per_step'] for r in table):.0f} us per step"
    )
  else:
    print(f"(no device kernels read from the trace in {trace_dir})")
  return table


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", required=True, help="directory for step_profile.json and step_profile.png")
  ap.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke run)")
  ap.add_argument("--batch-sizes", default=None, help="comma list (default 1,8,32; tiny 1,2)")
  ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list of: " + ", ".join(VARIANTS))
  ap.add_argument(
    "--ablations-at",
    default="first",
    choices=("first", "all"),
    help="run the after-* ablations at the first batch size only (default) or at all",
  )
  ap.add_argument("--cache-len", type=int, default=None, help="cache slots (default 320; tiny 32)")
  ap.add_argument("--k", type=int, default=4, help="verification calls score K+1 tokens (default 4)")
  ap.add_argument("--dtype", choices=("bfloat16", "float32"), help="default bfloat16 on GPU, float32 on CPU")
  ap.add_argument("--target-ms", type=float, default=50.0, help="length of one timing loop")
  ap.add_argument("--repeats", type=int, default=5, help="timing loops per figure (median)")
  ap.add_argument("--no-plot", action="store_true", help="skip the PNG (matplotlib is a bench extra)")
  ap.add_argument(
    "--trace", default="", help="also write a jax.profiler trace of each --trace-variants here and print its kernels"
  )
  ap.add_argument("--trace-variants", default="after", help="comma list of variants to trace (default after)")
  args = ap.parse_args(argv)
  variants = [v for v in args.variants.split(",") if v]
  for flag, names in (("--variants", variants), ("--trace-variants", args.trace_variants.split(","))):
    bad = [v for v in names if v and v not in VARIANTS]
    if bad:
      ap.error(f"{flag}: unknown {bad}; choose from {list(VARIANTS)}")
  try:
    batch_sizes = [int(b) for b in (args.batch_sizes or ("1,2" if args.tiny else "1,8,32")).split(",")]
  except ValueError:
    ap.error(f"--batch-sizes must be a comma list of ints, got {args.batch_sizes!r}")
  cache_len = args.cache_len or (32 if args.tiny else 320)
  if min(batch_sizes) < 1 or cache_len < args.k + 2 or args.k < 1:
    ap.error("--batch-sizes >= 1, --k >= 1 and --cache-len >= k + 2 are required")
  dtype = args.dtype or ("bfloat16" if common.has_gpu() else "float32")
  os.makedirs(args.out, exist_ok=True)

  c = TransformerConfig(**(TINY if args.tiny else SMOLLM2), dtype=jnp.dtype(dtype))
  model = Transformer(c, rngs=__import__("flax").nnx.Rngs(0))  # its init_cache makes every zero cache below
  weights = {k: jnp.asarray(v) for k, v in model.to_weights().items()}
  diffs = check_against_model(model, weights, variants)
  print(
    f"{dtype}, L={c.num_layers}, D={c.d_model}, V={c.vocab_size}, cache {cache_len} slots; "
    f"forward checked against the Transformer: {diffs}"
  )

  p0 = cache_len // 4
  rows = []
  jobs = [
    (b, v, 1)
    for b in batch_sizes
    for v in variants
    if not v.startswith("after-") or args.ablations_at == "all" or b == batch_sizes[0]
  ]
  jobs += [
    (b, v, args.k + 1) for b in batch_sizes for v in variants if v in ("before", "after") or v.startswith("pallas")
  ]
  for b, name, t in jobs:
    variant = VARIANTS[name]
    layers = layer_params(weights, variant)
    step = step_fn(c, variant, t, p0, max(cache_len - p0 - t, 1))
    carry = (model.init_cache(b, cache_len), jnp.full((b, t), 7, jnp.int32))
    r = common.time_per_iter(
      common.timed_loop(step), carry, (weights, layers), target_s=args.target_ms / 1e3, repeats=args.repeats
    )
    r.pop("compiled")
    rows.append(
      {
        "B": b,
        "T": t,
        "variant": name,
        "us": r["per_iter_s"] * 1e6,
        "compile_s": r["compile_s"],
        "scale": r["scale"],
        "iters": r["iters"],
      }
    )
    print(
      f"B={b:3d} T={t} {name:11s} {rows[-1]['us']:9.1f} us   (compile {r['compile_s']:.1f}s, "
      f"t(2N)/t(N) {r['scale']:.2f})",
      flush=True,
    )

  weight_bytes = sum(int(np.prod(w.shape)) * w.dtype.itemsize for w in weights.values())
  report = {
    "info": common.device_info(),
    "config": vars(args),
    "dtype": dtype,
    "cache_len": cache_len,
    "model": {k: getattr(c, k) for k in SMOLLM2},
    "weight_bytes": weight_bytes,
    "forward_check_max_abs_diff": diffs,
    "rows": rows,
  }

  if args.trace:
    report["kernels"] = {}
    for name in [v for v in args.trace_variants.split(",") if v]:
      report["kernels"][name] = trace_kernels(
        c, weights, name, model.init_cache(batch_sizes[0], cache_len), p0, os.path.join(args.trace, name), report
      )

  with open(os.path.join(args.out, "step_profile.json"), "w") as f:
    json.dump(report, f, indent=1)
  if not args.no_plot:
    plot(rows, batch_sizes, os.path.join(args.out, "step_profile.png"), f"{dtype}, {report['info'].get('device')}")
  print(f"wrote {args.out}/step_profile.json" + ("" if args.no_plot else " and step_profile.png"))
  return report


def plot(rows, batch_sizes, path, title):
  import matplotlib  # noqa: PLC0415  (only for the picture)

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  steps = [r for r in rows if r["T"] == 1]
  names = list(dict.fromkeys(r["variant"] for r in steps))
  fig, ax = plt.subplots(figsize=(9, 4))
  width = 0.8 / max(len(batch_sizes), 1)
  for j, b in enumerate(batch_sizes):
    us = [next((r["us"] for r in steps if r["variant"] == n and r["B"] == b), np.nan) for n in names]
    ax.bar(np.arange(len(names)) + j * width, us, width, label=f"B={b}")
  ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names, rotation=20)
  ax.set_ylabel("us per decode step")
  ax.set_title(f"one target step by structure ({title})")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


if __name__ == "__main__":
  t0 = time.time()
  main()
  print(f"total {time.time() - t0:.0f}s")
