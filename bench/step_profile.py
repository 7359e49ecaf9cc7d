"""Where one decode step of a target goes: structure variants and ablations side by side.

Times one target call per iteration of a jitted `fori_loop` (the way the
decoding loops run it: no host round trip between steps), each step's greedy
token feeding the next, at B in --batch-sizes on a cache of --cache-len slots,
for these variants of the same weights (random, drawn in the compute dtype on
the device, of the shape `--shape` names: `smollm2`, SmolLM2-135M's, the
default; `qwen2.5-coder-1.5b`, Qwen2.5-Coder-1.5B's, with q/k/v biases and an
untied LM head; with `--tiny`, a tiny model, with that shape's biases and head):

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
`jax.profiler` trace of 20 one-token steps of each `--trace-variants` (default
`after`) at the first batch size, read from the trace's Chrome-format JSON, and
prints per step: the kernel time summed and the number of kernel launches, the
time from the first kernel's start to the last one's end, the step's timed
figure and the floor (weight bytes one step reads / the device's copy
bandwidth, as bench/real_target.py), that kernel time by category of kernel
name (matmul/gemm, attention/softmax, scatter/cache write, fusion, other;
approximate: a name says what XLA fused, not every op inside), and the 25
kernels that took the most time (microseconds and launches per step, name).
On a CPU the "kernels" are XLA:CPU's operations (thunks) on the host.

    python bench/step_profile.py --out /tmp/step                 # GPU: bf16, B in 1,8,32
    python bench/step_profile.py --shape qwen2.5-coder-1.5b --batch-sizes 1 \
      --variants after,after-attn,after-mlp,after-head,after-bare,pallas --trace $OUT/trace --out $OUT
                                                                 # GPU: Qwen2.5-Coder-1.5B's step, kernel by kernel
    python bench/step_profile.py --tiny --out /tmp/step          # CPU smoke run (tiny model)
    python bench/step_profile.py --tiny --shape qwen2.5-coder-1.5b --out /tmp/step --trace /tmp/trace
                                                                 # CPU smoke run (tiny, biases, untied head)

Writes OUT/step_profile.json (every figure, the shape's name and config,
device, versions, and with --trace the kernel tables and their summary) and
OUT/step_profile.png (step time per variant and batch size, titled by shape;
needs matplotlib, `pip install -e ".[bench]"`, or pass --no-plot). The
Qwen shape's weights are 3.6 GB in bf16; with the model the checks compare
against, a variant's own per-layer copies and a second model inside the
checks, the script holds about 12 GB of GPU memory at its peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
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
  AttentionContext,
  KVCache,
  attention_block,
  fuse_projections,
  linear,
  mlp_block,
  pallas_block,
  rms_norm,
  weight_shapes,
)
from specdec_jax.models.transformer import layer_params as layer_names  # noqa: E402

SMOLLM2 = dict(
  vocab_size=49152, num_layers=30, d_model=576, num_heads=9, num_kv_heads=3, head_dim=64, d_ff=1536, rope_theta=1e5
)
QWEN2_5_CODER_1_5B = dict(
  vocab_size=151936,
  num_layers=28,
  d_model=1536,
  num_heads=12,
  num_kv_heads=2,
  head_dim=128,
  d_ff=8960,
  rope_theta=1e6,
  rms_norm_eps=1e-6,
  qkv_bias=True,
  tie_embeddings=False,
)
SHAPES = {"smollm2": SMOLLM2, "qwen2.5-coder-1.5b": QWEN2_5_CODER_1_5B}
TINY = dict(vocab_size=512, num_layers=4, d_model=64, num_heads=4, num_kv_heads=2, head_dim=32, d_ff=128)
# What `--tiny` keeps of each shape: the structure (biases, untied head), not the sizes.
TINY_FLAGS = {"smollm2": {}, "qwen2.5-coder-1.5b": dict(qkv_bias=True, tie_embeddings=False)}
# The TransformerConfig fields a shape sets (recorded in the JSON).
SHAPE_FIELDS = (*TINY, "rope_theta", "rms_norm_eps", "qkv_bias", "tie_embeddings")

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


def model_config(shape: str, tiny: bool, dtype) -> TransformerConfig:
  """The config of `--shape` (or, `--tiny`, of the tiny model with that shape's biases and head) in `dtype`."""
  return TransformerConfig(**({**TINY, **TINY_FLAGS[shape]} if tiny else SHAPES[shape]), dtype=jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=0)
def random_weights(c: TransformerConfig, key: jax.Array) -> dict[str, jax.Array]:
  """Random weights under the keys of `weight_shapes(c)`, drawn in `c.dtype` on the default device.

  As the Transformer's initialisation (norms 1, the rest normal with std 0.02, the projections into the
  residual stream scaled down by sqrt(2 L)), but each array is drawn in its own dtype: no float32 copy of
  the whole model first (7 GB for the Qwen shape).
  """
  shapes = weight_shapes(c)
  out = {}
  for k, (name, shape) in zip(jax.random.split(key, len(shapes)), shapes.items()):
    if name.endswith("norm"):
      out[name] = jnp.ones(shape, c.dtype)
      continue
    std = 0.02 / np.sqrt(2 * c.num_layers) if name.endswith(("wo", "w_down")) else 0.02
    out[name] = jax.random.normal(k, shape, c.dtype) * jnp.asarray(std, c.dtype)
  return out


def read_bytes(c: TransformerConfig, weights: dict) -> int:
  """Bytes of the weights one step reads: all of them, but of an untied input embedding one row per token."""
  total = sum(int(np.prod(w.shape)) * w.dtype.itemsize for w in weights.values())
  return total - (0 if c.tie_embeddings else weights["embed"].nbytes)


def layer_params(c: TransformerConfig, weights: dict, variant) -> dict | list:
  """Per-layer parameters as `decoder_block` reads them, fused or separate: stacked [L, ...] for a scan, else
  one dict of its own arrays per layer (as the Transformer holds them: slices of a stacked array inside the
  step would be copies). The q/k/v biases of a `qkv_bias` config come along ("bqkv" when fused)."""
  scan, fused = variant[:2]
  stacked = {name: weights[f"layers.{name}"] for name in layer_names(c)}
  stacked = fuse_projections(stacked) if fused else stacked
  if scan:
    return stacked
  return [{name: jnp.array(w[i], copy=True) for name, w in stacked.items()} for i in range(len(stacked["wo"]))]


def pallas_tiles(name: str):
  """PALLAS_TILES[name] as (AttentionBlocks, MlpBlocks) over the models' defaults; (None, None) for "pallas", the
  models' own choice (`pallas_block`'s defaults: tiles by width, XLA's MLP for a wide model)."""
  if name == "pallas":
    return None, None
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
  if head:  # as Transformer.__call__: embed.T when tied, else the model's own lm_head [D, V]
    x = rms_norm(x, weights["final_norm"], c.rms_norm_eps)
    lm_head = weights["embed"].T if c.tie_embeddings else weights["lm_head"]
    out = linear(x, lm_head, preferred_element_type=jnp.float32)
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
  checks += [(name, c) for name in variants if name.startswith("pallas:")]  # every tile set computes the same
  for name, cfg in checks:
    if cfg not in wants:
      wants[cfg] = call(tokens, pos, Transformer.from_weights(cfg, weights))

    def logits(w, t, p, variant=VARIANTS[name]):
      return forward(c, w, layer_params(c, w, variant), t, p, model.init_cache(2, 8), variant)[0]

    # The weights go in as arguments: closed over, they could become constants of the program (GBs of them).
    mine = jax.jit(logits)(weights, tokens, pos)
    diffs[name] = float(jnp.max(jnp.abs(wants[cfg] - mine)))
  # Equal on a CPU in float32; a GPU may fuse the programs differently, or the kernels round differently
  # (bf16), not more.
  # The kernels round each of L blocks' products once in bf16 where XLA rounds differently: over a deep
  # model's random weights that drifts further (0.11 for Qwen's 28 blocks, over 0.02 of the largest logit).
  for name, diff in diffs.items():
    tol = 0.1 if "pallas" in name and c.dtype != jnp.float32 else 0.02
    if diff > tol * float(jnp.max(jnp.abs(ref))):
      raise AssertionError(f"{name}: differs from the Transformer's default call by {diff}")
  return diffs


# Kernel categories by name, for the trace's summary: (category, lower-case name fragments), the first match wins.
# Approximate: a fusion is named after some of its ops (XLA:GPU: "loop_multiply_fusion", "gemm_fusion_dot.3",
# "input_reduce_fusion"; cuBLAS: "sm90_xmma_gemm_...", "nvjet_..."), and attention's own products count as
# matmul/gemm. The Pallas blocks' kernels go by their names: q|k|v and the MLP are products, the core attention.
# NCCL's kernels, and XLA's own collective kernels named after their op (all_reduce_3_fusion, psum_12_0_fusion_1,
# pmax_...; memcpy32_post closes each all-reduce of a tensor-parallel step), count as collectives.
COLLECTIVE_NAMES = (
  "nccl", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "reducescatter", "all_to_all",
  "alltoall", "collective", "sendrecv", "psum", "pmax", "pmin", "memcpy32_post",
)  # fmt: skip
KERNEL_CATEGORIES = (
  ("collective", COLLECTIVE_NAMES),
  ("scatter/cache write", ("scatter", "dynamic_update_slice", "dynamic-update-slice", "update_slice")),
  ("matmul/gemm", ("fused_attention_qkv", "fused_mlp")),
  ("attention/softmax", ("softmax", "exponential", "attention", "fmha", "flash", "cudnn")),
  ("matmul/gemm", ("gemm", "gemv", "dot", "matmul", "cublas", "cutlass", "xmma", "nvjet", "splitk", "wgmma", "ynn")),
  ("fusion", ("fusion", "loop_", "input_", "wrapped_")),
)
CATEGORY_ORDER = ("matmul/gemm", "attention/softmax", "scatter/cache write", "fusion", "collective", "other")
# The kind of a collective kernel (NCCL's names: "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", ...), first match wins.
COLLECTIVE_KINDS = (
  ("all-reduce", ("allreduce", "all_reduce", "psum", "pmax", "pmin", "memcpy32_post")),
  ("all-gather", ("allgather", "all_gather")),
  ("reduce-scatter", ("reducescatter", "reduce_scatter")),
  ("all-to-all", ("alltoall", "all_to_all")),
  ("send/recv", ("sendrecv", "send", "recv", "permute")),
)


def collective_kind(name: str) -> str:
  """The `COLLECTIVE_KINDS` kind of a collective kernel's name ("other collective" when none matches).

  Example:
    >>> collective_kind("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)")
    'all-gather'
  """
  low = name.lower()
  return next((kind for kind, parts in COLLECTIVE_KINDS if any(p in low for p in parts)), "other collective")


def kernel_category(name: str) -> str:
  """The `KERNEL_CATEGORIES` category of a kernel's name ("other" when none matches)."""
  low = name.lower()
  return next((cat for cat, parts in KERNEL_CATEGORIES if any(p in low for p in parts)), "other")


def _trace_events(trace_dir: str) -> list[dict] | None:
  """The events of the newest jax.profiler trace (Chrome-format JSON) under trace_dir, or None if there is none."""
  files = sorted(
    glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    + glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
  )
  if not files:
    return None
  with gzip.open(files[-1], "rt") as f:
    return json.load(f).get("traceEvents", [])


def _innermost(events: list[dict]) -> list[dict]:
  """The events that enclose no other event of their thread (complete events nest on a host thread)."""
  out = []
  by_thread = defaultdict(list)
  for e in events:
    by_thread[(e.get("pid"), e.get("tid"))].append(e)
  for evs in by_thread.values():
    evs.sort(key=lambda e: (e["ts"], -e["dur"]))
    for e, nxt in zip(evs, evs[1:] + [None]):
      if nxt is None or nxt["ts"] >= e["ts"] + e["dur"]:
        out.append(e)
  return out


def kernel_events(events: list[dict], host_fallback: bool = False) -> tuple[list[dict], str]:
  """The kernels of a trace's events (complete "X" events with a duration), and where they ran.

  "device": the device's events (a GPU's). A device has a thread per CUDA stream ("Stream #..."): kernels and
  copies. Its other threads ("XLA Ops", "XLA Modules", ...) repeat the same time under op and program names,
  so they are left out where streams exist. "host" (only with `host_fallback`, and only without device
  events: a CPU): XLA:CPU's operations on the host's XLA threads, the innermost events only (a program's
  while loop and each iteration's executor enclose its operations), without the executor's "end: ..." markers.
  """
  meta = [e for e in events if e.get("ph") == "M"]
  names = {e["pid"]: e.get("args", {}).get("name", "") for e in meta if e.get("name") == "process_name"}
  device_pids = {pid for pid, n in names.items() if "/device:" in n or "GPU" in n or "gpu" in n}
  threads = {
    (e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in meta if e.get("name") == "thread_name"
  }
  streams = {key for key, n in threads.items() if key[0] in device_pids and n.startswith("Stream")}
  complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
  device = [
    e for e in complete if e.get("pid") in device_pids and (not streams or (e.get("pid"), e.get("tid")) in streams)
  ]
  if device or not host_fallback:
    return device, "device"
  xla_threads = {key for key, n in threads.items() if "XLA" in n}
  host = [
    e
    for e in complete
    if (e.get("pid"), e.get("tid")) in xla_threads and not e["name"].startswith(("end: ", "ThreadpoolListener"))
  ]
  return _innermost(host), "host"


def kernel_rows(trace_dir: str, steps: int, host_fallback: bool = False) -> tuple[list[dict], dict]:
  """Every kernel of a trace grouped by name, costliest first, and the totals per step.

  Returns:
    (rows, summary): rows {"kernel", "category", "per_step" (launches), "us_per_step"}; summary {"source"
    ("device" or "host", see `kernel_events`), "kernel_us_per_step" (all kernels' time summed),
    "launches_per_step", "distinct_kernels", "span_us_per_step" (first kernel's start to the last one's end:
    kernel time plus the gaps between kernels), "categories" {category: us per step}, "devices" (devices with
    kernels: every sum adds theirs), "collectives" {`collective_kind`: us per step}}; ([], {}) without a trace.
  """
  events = _trace_events(trace_dir)
  if events is None:
    return [], {}
  kernels, source = kernel_events(events, host_fallback)
  totals, counts = defaultdict(float), defaultdict(int)
  for e in kernels:
    totals[e["name"]] += e["dur"]
    counts[e["name"]] += 1
  rows = [
    {"kernel": k, "category": kernel_category(k), "per_step": counts[k] / steps, "us_per_step": totals[k] / steps}
    for k in totals
  ]
  rows.sort(key=lambda r: -r["us_per_step"])
  categories = dict.fromkeys(CATEGORY_ORDER, 0.0)
  for r in rows:
    categories[r["category"]] += r["us_per_step"]
  span = (max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)) if kernels else 0.0
  collectives = defaultdict(float)
  for r in rows:
    if r["category"] == "collective":
      collectives[collective_kind(r["kernel"])] += r["us_per_step"]
  summary = {
    "devices": len({e.get("pid") for e in kernels}),  # the sums below add every device's kernels
    "source": source,
    "kernel_us_per_step": sum(totals.values()) / steps,
    "launches_per_step": len(kernels) / steps,
    "distinct_kernels": len(rows),
    "span_us_per_step": span / steps,
    "categories": categories,
    "collectives": dict(collectives),
  }
  return rows, summary


def kernel_table(trace_dir: str, steps: int, top: int = 25) -> list[dict]:
  """Per-kernel totals from a jax.profiler trace's Chrome-format JSON: the device events, grouped by name, the
  `top` costliest (`kernel_rows`)."""
  return kernel_rows(trace_dir, steps)[0][:top]


def profile_trace(run, trace_dir: str, steps: int, host_fallback: bool = False) -> tuple[list[dict], dict, str | None]:
  """`kernel_rows` of one profiled `run()` of `steps` steps and None, or ([], {}, repr(error)) if profiling failed.

  The profiler needs CUPTI on a GPU; callers keep their timings either way.
  """
  try:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      jax.block_until_ready(run())
    return (*kernel_rows(trace_dir, steps, host_fallback), None)
  except Exception as e:  # noqa: BLE001  (any profiler or trace-format failure: report it, keep the rest)
    return [], {}, repr(e)


def profile_kernels(run, trace_dir: str, steps: int, top: int) -> tuple[list[dict], str | None]:
  """(`kernel_table` of one profiled `run()` of `steps` steps, None), or ([], repr(error)) if profiling failed."""
  rows, _, error = profile_trace(run, trace_dir, steps)
  return rows[:top], error


def trace_kernels(c, weights, name, cache: KVCache, p0, trace_dir, report, step_us=None, floor=None) -> list[dict]:
  """Profiles 20 one-token steps of variant `name` from a zero `cache` [L, B, Hkv, S, Dh], prints where a step's
  time goes (kernel time and launches, by category, the costliest kernels; against `step_us`, the timed step,
  and `floor` = (bytes read, bytes per second) where given) and returns its 80 costliest kernels. The summary
  goes to report["kernel_summary"][name]."""
  b, cache_len = cache.batch_size, cache.max_length
  layers = layer_params(c, weights, VARIANTS[name])
  loop = common.timed_loop(step_fn(c, VARIANTS[name], 1, p0, max(cache_len - p0 - 1, 1)))
  carry = (cache, jnp.full((b, 1), 7, jnp.int32))
  jax.block_until_ready(loop(0, 4, carry, weights, layers))
  steps = 20
  rows, summary, error = profile_trace(
    lambda: loop(0, steps, carry, weights, layers), trace_dir, steps, host_fallback=True
  )
  if error:
    report["trace_error"] = error
    print(f"trace failed: {error}")
  if not rows:
    print(f"(no kernels read from the trace in {trace_dir})")
    return rows
  what = (
    "device kernels"
    if summary["source"] == "device"
    else "XLA:CPU operations on the host, each slowed by the profiler's own cost"
  )
  kernel_us = summary["kernel_us_per_step"]
  print(f"\none `{name}` step at B={b}, {steps} steps traced ({what}; the trace is in {trace_dir}):")
  print(
    f"  per step: {kernel_us:.1f} us of kernel time in {summary['launches_per_step']:.1f} launches "
    f"({summary['distinct_kernels']} distinct names); first start to last end {summary['span_us_per_step']:.1f} us"
  )
  context = []
  if step_us is not None:
    summary["step_us"] = step_us
    context.append(f"timed step {step_us:.1f} us (kernels busy {kernel_us / step_us:.0%} of it)")
  if floor is not None:
    nbytes, bandwidth = floor
    floor_us = nbytes / bandwidth * 1e6
    summary.update(floor_us=floor_us, read_bytes=nbytes, copy_bytes_per_s=bandwidth)
    context.append(
      f"floor {floor_us:.1f} us = {common.fmt_bytes(nbytes)} of weights read / {bandwidth / 1e9:.0f} GB/s copy "
      f"bandwidth (kernel time {kernel_us / floor_us:.2f}x floor)"
    )
  if context:
    print("  " + "; ".join(context))
  cats = ", ".join(
    f"{cat} {us:.1f} us ({us / max(kernel_us, 1e-9):.0%})" for cat, us in summary["categories"].items() if us
  )
  print(f"  by category (from kernel names, approximate): {cats}")
  print(f"  the {min(25, len(rows))} costliest kernels:  us/step  launches/step  category  name")
  for r in rows[:25]:
    print(f"    {r['us_per_step']:9.1f}  {r['per_step']:6.1f}  {r['category']:<19s}  {r['kernel'][:100]}")
  report.setdefault("kernel_summary", {})[name] = {"B": b, "steps_traced": steps, **summary}
  return rows[:80]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", required=True, help="directory for step_profile.json and step_profile.png")
  ap.add_argument(
    "--shape",
    default="smollm2",
    choices=tuple(SHAPES),
    help="the target's shape (default smollm2); with --tiny, a tiny model with that shape's biases and head",
  )
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

  c = model_config(args.shape, args.tiny, dtype)
  weights = random_weights(c, jax.random.key(0))  # in c.dtype, on the device
  model = Transformer.from_weights(c, weights)  # its init_cache makes every zero cache below
  diffs = check_against_model(model, weights, variants)
  weight_bytes = sum(int(np.prod(w.shape)) * w.dtype.itemsize for w in weights.values())
  print(
    f"{args.shape}{' (tiny)' if args.tiny else ''}: {dtype}, L={c.num_layers}, D={c.d_model}, V={c.vocab_size}, "
    f"qkv_bias={c.qkv_bias}, tied={c.tie_embeddings}, {common.fmt_bytes(weight_bytes)} of weights, "
    f"cache {cache_len} slots; forward checked against the Transformer: {diffs}",
    flush=True,
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
    layers = layer_params(c, weights, variant)
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

    del layers  # (the next variant's per-layer copies take its place)
  report = {
    "info": common.device_info(),
    "config": vars(args),
    "shape": args.shape,
    "tiny": args.tiny,
    "dtype": dtype,
    "cache_len": cache_len,
    "model": {k: getattr(c, k) for k in SHAPE_FIELDS},
    "weight_bytes": weight_bytes,
    "read_bytes": read_bytes(c, weights),
    "forward_check_max_abs_diff": diffs,
    "rows": rows,
  }

  if args.trace:
    report["kernels"] = {}
    bandwidth = common.copy_bandwidth()["bytes_per_s"]  # the floor's denominator, as bench/real_target.py's
    report["copy_bytes_per_s"] = bandwidth
    for name in [v for v in args.trace_variants.split(",") if v]:
      timed = [r["us"] for r in rows if (r["B"], r["T"], r["variant"]) == (batch_sizes[0], 1, name)]
      report["kernels"][name] = trace_kernels(
        c,
        weights,
        name,
        model.init_cache(batch_sizes[0], cache_len),
        p0,
        os.path.join(args.trace, name),
        report,
        step_us=timed[0] if timed else None,
        floor=(report["read_bytes"], bandwidth),
      )

  with open(os.path.join(args.out, "step_profile.json"), "w") as f:
    json.dump(report, f, indent=1)
  if not args.no_plot:
    title = f"{args.shape}{' (tiny)' if args.tiny else ''}, {dtype}, {report['info'].get('device')}"
    plot(rows, batch_sizes, os.path.join(args.out, "step_profile.png"), title)
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
