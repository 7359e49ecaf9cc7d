"""The MLP half of a decoder block at B*T <= 16: XLA's `mlp_block` against the Pallas kernels of `fused_mlp`.

For SmolLM2-135M's shapes (D=576, F=1536, bf16) at rows in --rows (1: a
decode step at batch 1; 5: a verification of K+1=5 tokens; 16), times

    xla      jax.jit(mlp_block): what the model runs today
    pallas:<config>   fused_mlp with the tile sizes of one entry of CONFIGS

one model's worth of MLP calls per iteration of a jitted `lax.fori_loop`: the
body runs the --layers (30) layers unrolled, each with its own weight arrays
(as the unrolled model holds them; 30 x 5.3 MB = 159 MB, far above the 50 MB
L2, so every layer's weights come from HBM), each call's output feeding the
next (nothing hoisted or deleted). Reported per layer call, in microseconds,
with:
  - `net_us`: the same less the loop's own cost per iteration (a while loop on
    a GPU syncs its predicate with the host each trip; measured with a one-add
    body and divided by the layers);
  - `floor_us`: the MLP's weight bytes / the copy bandwidth measured in this
    run (bytes read + written per second of a large elementwise pass);
  - `kernels`: kernel-launching instructions in the optimised HLO of ONE layer
    call (fusions, custom calls (Pallas kernels are `__gpu$xla.gpu.triton`
    custom calls), and any other op outside a fusion), by opcode.
Before timing, every variant is checked against the float32 truth and XLA's
bf16 result on layer 0 (and layer L-1) of the same inputs, with the tolerance
of tests/test_pallas_mlp.py: |a - b| <= 2^-6 (|ref| + max |ref - x|). A variant
that fails is recorded, not timed, and the script exits 1 at the end.

    PYTHONPATH=. python3 bench/pallas_mlp.py --out $OUT/pallas          # GPU (H100)
    PYTHONPATH=. python3 bench/pallas_mlp.py --interpret --quick --out /tmp/pm   # CPU smoke run

Writes OUT/pallas_mlp.json (every figure, device, versions) and prints a table.
On the GPU each Pallas config costs a compile of 2 x --layers Triton kernels
(seconds); --configs picks fewer.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402
from specdec_jax.kernels.mlp import MlpBlocks, fused_mlp  # noqa: E402
from specdec_jax.models.config import TransformerConfig  # noqa: E402
from specdec_jax.models.transformer import mlp_block  # noqa: E402

D, F, EPS = 576, 1536, 1e-5  # SmolLM2-135M

# Programs per kernel at D=576, F=1536: kernel 1 = F / block_f; kernel 2 = cdiv(D, block_d) * split_k.
CONFIGS = {
    "default": MlpBlocks(),  # 96 | 18 x 4 = 72 programs, 3 kernels (split partials + XLA sum)
    "f32": MlpBlocks(block_f=32),  # 48 programs of kernel 1, 64-byte weight rows instead of 32
    "bigk": MlpBlocks(block_k1=256, block_k2=256, split_k=2),  # longer loads per iteration; 36 programs of kernel 2
    "split8": MlpBlocks(block_k2=64, split_k=8),  # 144 programs of kernel 2
    "k64": MlpBlocks(block_k1=64, block_k2=64),  # smaller tiles, more pipelined iterations
    "nosplit": MlpBlocks(block_d=16, block_k2=128, split_k=1),  # 2 kernels: 36 programs of kernel 2
    "warps2": MlpBlocks(num_warps=2),
    "stages1": MlpBlocks(num_stages=1),  # no software pipelining of the K loops
}

# Instructions that launch no kernel of their own.
_NO_KERNEL = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "conditional", "call",
              "opt-barrier", "after-all", "partition-id", "replica-id", "add-dependency"}


def count_kernels(hlo_text: str) -> dict[str, int]:
  """Kernel-launching instructions of optimised HLO text, by opcode (and "total").

  Counts instructions outside fused computations and reducers (computations reached through a
  fusion's `calls=` or a reduce-like op's `to_apply=`; a `call`'s `to_apply=` body, such as a command
  buffer, is counted), skipping ops that only pass buffers along.
  """
  inner = set()
  for line in hlo_text.splitlines():
    op = re.search(r"= \S.*? ([a-z][\w\-]*)\(", line)
    if not op:
      continue
    if op.group(1) == "fusion":
      inner.update(re.findall(r"calls=%([\w.\-]+)", line))
    elif op.group(1) not in ("call", "while", "conditional", "async-start"):
      inner.update(re.findall(r"to_apply=%([\w.\-]+)", line))
  counts: dict[str, int] = {}
  skip = False
  for line in hlo_text.splitlines():
    head = re.match(r"^(?:ENTRY\s+)?%([\w.\-]+) .*\{\s*$", line)
    if head:
      skip = head.group(1) in inner
      continue
    m = re.match(r"^\s*(?:ROOT\s+)?%[\w.\-]+ = .+? ([a-z][\w\-]*)\(", line)
    if skip or not m or m.group(1) in _NO_KERNEL:
      continue
    counts[m.group(1)] = counts.get(m.group(1), 0) + 1
  counts["total"] = sum(counts.values())
  return counts


def make_weights(layers: int, seed: int = 0):
  """Per-layer lists of bf16 weights (separate device arrays) with O(1) activations."""
  keys = jax.random.split(jax.random.key(seed), 3 * layers)
  norm, wgu, wd = [], [], []
  for i in range(layers):
    k0, k1, k2 = keys[3 * i:3 * i + 3]
    norm.append((1 + 0.1 * jax.random.normal(k0, (D,))).astype(jnp.bfloat16))
    wgu.append((jax.random.normal(k1, (D, 2 * F)) / math.sqrt(D)).astype(jnp.bfloat16))
    wd.append((jax.random.normal(k2, (F, D)) / math.sqrt(F)).astype(jnp.bfloat16))
  return norm, wgu, wd


def xla_mlp(x, norm, wgu, wd):
  d, f = x.shape[-1], wd.shape[0]
  cfg = TransformerConfig(vocab_size=8, num_layers=1, d_model=d, num_heads=1, num_kv_heads=1, head_dim=d, d_ff=f,
                          rms_norm_eps=EPS, dtype=x.dtype)
  return mlp_block(cfg, x, {"mlp_norm": norm, "w_gate_up": wgu, "w_down": wd})


def variant_fn(name: str, interpret: bool):
  """(x, norm, w_gate_up, w_down) -> x + MLP(x), for "xla" or "pallas:<config>"."""
  if name == "xla":
    return xla_mlp
  blocks = CONFIGS[name.split(":", 1)[1]]
  return lambda x, n, a, b: fused_mlp(x, n, a, b, EPS, interpret=interpret, blocks=blocks)


def check(fn, x, weights, layer: int) -> dict:
  """Compares fn on one layer with the float32 truth and XLA's bf16; the tolerance of the tests."""
  norm, wgu, wd = (w[layer] for w in weights)
  out = np.asarray(jax.jit(fn)(x, norm, wgu, wd), np.float32)
  with jax.default_matmul_precision("highest"):  # a float32 truth, not TF32's 10-bit mantissas
    args32 = [a.astype(jnp.float32) for a in (x, norm, wgu, wd)]
    truth = np.asarray(jax.jit(xla_mlp)(*args32), np.float32)
  ref = np.asarray(jax.jit(xla_mlp)(x, norm, wgu, wd), np.float32)
  scale = np.abs(ref) + np.abs(ref - np.asarray(x, np.float32)).max()
  ratio_ref = float((np.abs(out - ref) / (2**-6 * scale)).max())
  ratio_truth = float((np.abs(out - truth) / (2**-6 * scale)).max())
  return {"layer": layer, "max_abs_diff_vs_xla": float(np.abs(out - ref).max()),
          "max_abs_diff_vs_f32": float(np.abs(out - truth).max()),
          "tol_ratio_vs_xla": ratio_ref, "tol_ratio_vs_f32": ratio_truth,
          "ok": bool(ratio_ref <= 1.0 and np.isfinite(out).all())}


def time_variant(fn, x, weights, layers: int, args) -> dict:
  """Microseconds per layer call of fn, `layers` unrolled calls per loop iteration."""

  def step(i, x, *flat):
    del i
    for j in range(layers):
      x = fn(x, flat[j], flat[layers + j], flat[2 * layers + j])
    return x

  operands = tuple(weights[0]) + tuple(weights[1]) + tuple(weights[2])
  loop = common.timed_loop(step)
  t0 = time.perf_counter()
  res = common.time_per_iter(loop, x, operands, iters=args.iters, target_s=args.target_ms / 1e3,
                             repeats=args.repeats)
  return {"per_iter_us": res["per_iter_s"] * 1e6, "us_per_layer": res["per_iter_s"] * 1e6 / layers,
          "iters": res["iters"], "scale": res["scale"], "compile_s": res["compile_s"],
          "wall_s": time.perf_counter() - t0}


def loop_overhead(x, args) -> float:
  """Microseconds per iteration of a loop whose body is one tiny add (the while loop's own cost)."""
  res = common.time_per_iter(common.timed_loop(lambda i, x: x + jnp.ones((), x.dtype)), x, (), iters=args.iters,
                             target_s=args.target_ms / 1e3, repeats=args.repeats)
  return res["per_iter_s"] * 1e6


def one_layer_kernels(fn, x, weights) -> dict:
  norm, wgu, wd = (w[0] for w in weights)
  return count_kernels(jax.jit(fn).lower(x, norm, wgu, wd).compile().as_text())


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", default="bench/out", help="directory for pallas_mlp.json (default bench/out)")
  ap.add_argument("--rows", default="1,5,16", help="comma list of B*T rows (x is [1, rows, D]; at most 16)")
  ap.add_argument("--configs", default=",".join(CONFIGS), help="comma list of: " + ", ".join(CONFIGS))
  ap.add_argument("--layers", type=int, default=None, help="layers per loop iteration (default 30; quick 2)")
  ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU smoke run)")
  ap.add_argument("--quick", action="store_true",
                  help="one config, 2 layers, tiny repeat counts: a smoke run (2 layers of weights fit in L2)")
  ap.add_argument("--target-ms", type=float, default=50.0, help="length of one timing loop")
  ap.add_argument("--repeats", type=int, default=None, help="timing loops per figure (median; default 5)")
  args = ap.parse_args(argv)

  if not common.has_gpu() and not args.interpret:
    ap.error("no GPU: the Pallas Triton kernels need one; pass --interpret (with --quick) for a CPU smoke run")
  layers = args.layers or (2 if args.quick else 30)
  args.repeats = args.repeats or (1 if args.quick else 5)
  args.iters = 1 if args.quick else None
  rows_list = [int(r) for r in args.rows.split(",")]
  names = ["default"] if args.quick else [c for c in args.configs.split(",") if c]
  for c in names:
    if c not in CONFIGS:
      ap.error(f"unknown config {c!r}; known: {', '.join(CONFIGS)}")
  variants = ["xla"] + [f"pallas:{c}" for c in names]

  info = common.device_info()
  print(f"{info['device']} ({info['platform']}), jax {info['jax']}; layers per iteration: {layers}", flush=True)
  bw = common.copy_bandwidth(16 * 2**20 if args.quick else None, repeats=args.repeats)
  weight_bytes = (D * 2 * F + F * D + D) * 2
  floor_us = weight_bytes / bw["bytes_per_s"] * 1e6
  print(f"copy bandwidth {common.fmt_bytes(bw['bytes_per_s'])}/s; MLP weights {common.fmt_bytes(weight_bytes)} "
        f"per layer -> floor {floor_us:.2f} us per layer", flush=True)

  weights = make_weights(layers)
  report = {"device": info, "shape": {"d_model": D, "d_ff": F, "dtype": "bfloat16", "layers_per_iter": layers},
            "configs": {c: vars(CONFIGS[c]) for c in names}, "copy_bandwidth": bw,
            "weight_bytes_per_layer": weight_bytes,
            "floor_us_per_layer": floor_us, "interpret": args.interpret, "rows": {}}
  failed = []
  for rows in rows_list:
    x = (2 * jax.random.normal(jax.random.key(100 + rows), (1, rows, D))).astype(jnp.bfloat16)
    overhead = loop_overhead(x, args)
    entry = {"loop_overhead_us_per_iter": overhead, "variants": {}}
    report["rows"][str(rows)] = entry
    print(f"\nrows={rows}: loop overhead {overhead:.1f} us per iteration ({overhead / layers:.2f} us per layer)")
    print(f"  {'variant':18s} {'us/layer':>9s} {'net us':>8s} {'x floor':>8s} {'kernels':>8s} {'scale':>6s} "
          f"{'tol ratio':>9s}  kernel kinds")
    for name in variants:
      fn = variant_fn(name, args.interpret)
      v = {}
      entry["variants"][name] = v
      try:
        v["check"] = [check(fn, x, weights, layer) for layer in sorted({0, layers - 1})]
        if not all(c["ok"] for c in v["check"]):
          failed.append(f"rows={rows} {name}: {v['check']}")
          print(f"  {name:18s} FAILED the equality check: {v['check']}", flush=True)
          continue
        v["kernels"] = one_layer_kernels(fn, x, weights)
        v.update(time_variant(fn, x, weights, layers, args))
      except Exception as e:  # noqa: BLE001 - a config the Triton compiler rejects should not end the run
        v["error"] = f"{type(e).__name__}: {e}"[:4000]
        failed.append(f"rows={rows} {name}: {v['error'][:300]}")
        print(f"  {name:18s} ERROR {v['error'][:300]}", flush=True)
        traceback.print_exc()
        continue
      v["net_us_per_layer"] = v["us_per_layer"] - overhead / layers
      v["x_floor"] = v["net_us_per_layer"] / floor_us
      kinds = ", ".join(f"{k} {n}" for k, n in v["kernels"].items() if k != "total")
      ratio = max(c["tol_ratio_vs_xla"] for c in v["check"])
      print(f"  {name:18s} {v['us_per_layer']:9.2f} {v['net_us_per_layer']:8.2f} {v['x_floor']:8.1f} "
            f"{v['kernels']['total']:8d} {v['scale']:6.2f} {ratio:9.2f}  {kinds}", flush=True)
    timed = {n: v for n, v in entry["variants"].items() if "net_us_per_layer" in v}
    pallas = {n: v for n, v in timed.items() if n != "xla"}
    if "xla" in timed and pallas:
      best = min(pallas, key=lambda n: pallas[n]["net_us_per_layer"])
      entry["best"] = best
      entry["speedup_best_vs_xla"] = timed["xla"]["net_us_per_layer"] / pallas[best]["net_us_per_layer"]
      saved = (timed["xla"]["net_us_per_layer"] - pallas[best]["net_us_per_layer"]) * 30
      entry["saved_us_per_30_layer_step"] = saved
      print(f"  best: {best}, {entry['speedup_best_vs_xla']:.2f}x XLA; {saved:.0f} us less per 30-layer step")

  report["failed"] = failed
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "pallas_mlp.json")
  with open(path, "w") as f:
    json.dump(report, f, indent=1, default=str)
  print(f"\nwrote {path}")
  if failed:
    print("FAILED:\n  " + "\n  ".join(failed))
    sys.exit(1)


if __name__ == "__main__":
  main()
