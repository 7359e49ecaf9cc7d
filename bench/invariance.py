"""Batch invariance on a real target: a token's logits from one-token steps against a verification call.

Greedy speculation equals plain greedy decoding only if the target computes a token's logits to the same
bits in a one-token step and inside a call of K+1 tokens. On Qwen2.5-Coder-1.5B's Pallas path the EAGLE
head's greedy outputs parted from plain greedy's on 2 of 6 prompts while prompt lookup's did not; what the
EAGLE loop does differently is ask the target for its features (`return_features=True`). This script
compares the logits of the next T tokens of a held-out prompt's plain greedy continuation computed four ways:
T one-token steps and one T-token call, each with and without features, from the same cache (one prefill of
the prompt, then the earlier offsets' T-token calls).

Per kernels value (`--kernels`, default pallas,xla; bf16 on a GPU) it prints and saves, for each pair of
ways, whether the logits are the same bits, their largest difference, and the first position whose
argmax differs. Two ways that should agree for greedy speculation to be lossless token for token:
"steps" (plain `generate`) against "call+features" (the EAGLE loop's verification) and "call" (prompt
lookup's).

    PYTHONPATH=.:/tmp/site python3 bench/invariance.py --out $OUT          # GPU, the GGUF in place
    PYTHONPATH=. python3 bench/invariance.py --model smollm2 --kernels xla --tokens 4 --out /tmp/inv  # CPU smoke
    PYTHONPATH=. python3 bench/invariance.py --random-layers 28 --kernels pallas --per-layer --kernel-configs \
        --variants barrier,no-barrier --out $OUT    # GPU, random weights of the model's shape, no GGUF

Where they differ, `--per-layer` compares every block's output (the model's feature layers set to all
blocks) and reports the first block whose output differs. `--kernel-configs` also saves, per variant, the
compiled one-token and T-token programs' matrix-product kernels (XLA's Triton and cuBLAS fusions, with the
tile sizes and reduction split autotuning chose) and whether the two programs chose alike. `--variants`:
`barrier` is the code as it is; `no-barrier` runs the Pallas path's fixed-row XLA products
(`transformer.on_fixed_rows`) without their optimization barriers, as before 2026-11-28.

Writes OUT/invariance_<model>.json (and, with `--kernel-configs`, OUT/kernel_configs_<model>.json).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import device_info, has_gpu
from specdec_jax.kernels import mlp
from specdec_jax.models import transformer

_ORIGINAL_FIXED_ROWS = transformer.on_fixed_rows

WAYS = ("steps", "steps+features", "call", "call+features")
VARIANTS = ("barrier", "no-barrier")
# The lines of compiled HLO that run a matrix product on XLA's kernels: Triton GEMM fusions and cuBLAS calls.
_GEMM_LINE = re.compile(r"(__triton_gemm|__cublas\$gemm|__cublas\$lt\$matmul|kTritonGemmFusion|__triton_nested_gemm)")


def _fixed_rows_without_barriers(fn, x):
  """`transformer.on_fixed_rows` as it was before its optimization barriers (the `no-barrier` variant)."""
  b, t, d = x.shape
  rows = jnp.zeros((1, mlp.MAX_ROWS, d), x.dtype).at[0, : b * t].set(x.reshape(b * t, d))
  return fn(rows)[0, : b * t].reshape(b, t, -1)


def use_variant(variant: str) -> None:
  """Installs the variant's `on_fixed_rows` (the model reads the module's name at trace time)."""
  transformer.on_fixed_rows = _ORIGINAL_FIXED_ROWS if variant == "barrier" else _fixed_rows_without_barriers
  jax.clear_caches()  # programs traced under the other variant must not be reused


def kernel_choices(hlo: str) -> list[str]:
  """The compiled program's matrix-product kernels: each such line without instruction names, sorted."""
  out = []
  for line in hlo.splitlines():
    if _GEMM_LINE.search(line) and "=" in line:
      line = re.sub(r"metadata=\{[^}]*\}", "", line)  # where it came from, not what it runs
      line = re.sub(r"%[\w.\-]+", "%", line)  # instruction names differ between programs
      out.append(re.sub(r"^\s*(ROOT\s+)?%?\s*=\s*", "", line.strip())[:800])
  return sorted(out)


def program_kernels(model, cache, t: int, start: int, features: bool) -> list[str]:
  """`kernel_choices` of the compiled program of a T-token call (with features or not) on this cache."""
  fn = _CALL_FEATURES if features else _CALL
  x = jnp.zeros((1, t), jnp.int32)
  pos = start + jnp.arange(t, dtype=jnp.int32)[None]
  return kernel_choices(fn.lower(model, x, pos, cache).compile().as_text())


def parse_args(argv=None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", choices=("qwen2.5-coder-1.5b", "smollm2"), default="qwen2.5-coder-1.5b")
  ap.add_argument("--kernels", default="pallas,xla", help="comma list of xla, pallas (default pallas,xla)")
  ap.add_argument(
    "--prompts",
    default="question0,question1,code0",
    help="comma list of held-out prompt names of examples/held_out_prompts.json (question<i>, code<i>, edit<i>)",
  )
  ap.add_argument("--tokens", type=int, default=5, help="T, the verification call's tokens (default 5: K=4)")
  ap.add_argument("--offsets", type=int, default=8, help="calls per prompt, T tokens apart (default 8)")
  ap.add_argument("--dtype", choices=("bfloat16", "float32"), help="default bfloat16 on GPU, float32 on CPU")
  ap.add_argument(
    "--random-layers",
    type=int,
    default=0,
    help="N > 0: random weights of the model's shape with N blocks and random prompts (no GGUF, no tokenizer)",
  )
  ap.add_argument("--per-layer", action="store_true", help="find the first block whose output differs")
  ap.add_argument("--kernel-configs", action="store_true", help="save and compare the products' kernel choices")
  ap.add_argument("--variants", default="barrier", help="comma list of barrier, no-barrier (default barrier)")
  ap.add_argument(
    "--time-calls", action="store_true", help="also time a one-token and a T-token call per variant (GPU figures)"
  )
  ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
  args = ap.parse_args(argv)
  args.kernels = [k for k in args.kernels.split(",") if k]
  bad = [k for k in args.kernels if k not in ("xla", "pallas")]
  if bad or not args.kernels:
    ap.error(f"--kernels: a comma list of xla, pallas; got {bad or args.kernels}")
  if args.tokens < 1 or args.offsets < 1:
    ap.error("--tokens and --offsets must be >= 1")
  if args.random_layers < 0:
    ap.error("--random-layers must be >= 0")
  args.variants = [v for v in args.variants.split(",") if v]
  bad = [v for v in args.variants if v not in VARIANTS]
  if bad or not args.variants:
    ap.error(f"--variants: a comma list of {', '.join(VARIANTS)}; got {bad or args.variants}")
  args.dtype = args.dtype or ("bfloat16" if has_gpu() else "float32")
  return args


# Compiled once a shape: a call's program depends on T and the cache's length, not on the offset or prompt.
_CALL = jax.jit(lambda m, t, p, c: m(t, p, c))
_CALL_FEATURES = jax.jit(lambda m, t, p, c: m(t, p, c, return_features=True))


def four_ways(model, cache, cont, start: int) -> tuple[dict[str, np.ndarray], object]:
  """Logits [T, V] of the tokens `cont` [T] at positions start.. after `cache` (the context so far), computed
  the four `WAYS` (and, under "steps+features!" and "call+features!", the features [T, F] of the two ways
  with features); and the cache after the T-token call (the next offset's context)."""
  x = jnp.asarray(cont)[None]
  pos = start + jnp.arange(len(cont), dtype=jnp.int32)[None]
  logits, after = _CALL(model, x, pos, cache)
  with_features = _CALL_FEATURES(model, x, pos, cache)
  out = {"call": np.asarray(logits[0]), "call+features": np.asarray(with_features[0][0])}
  out["call+features!"] = np.asarray(with_features[1][0].astype(jnp.float32))  # the features themselves
  for name, fn in (("steps", _CALL), ("steps+features", _CALL_FEATURES)):
    c, rows, feats = cache, [], []
    for j in range(len(cont)):
      res = fn(model, x[:, j : j + 1], pos[:, j : j + 1], c)
      rows.append(np.asarray(res[0][0, 0]))
      if len(res) == 3:
        feats.append(np.asarray(res[1][0, 0].astype(jnp.float32)))
      c = res[-1]
    out[name] = np.stack(rows)
    if feats:
      out[name + "!"] = np.stack(feats)
  return out, after


def compare(a: np.ndarray, b: np.ndarray) -> dict:
  diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
  argmax_differs = np.nonzero(np.argmax(a, -1) != np.argmax(b, -1))[0]
  return {
    "same_bits": bool(np.array_equal(a, b)),
    "max_abs_diff": float(diff.max()),
    "positions_differing": int(np.sum(np.any(a != b, axis=-1))),
    "first_argmax_differing": int(argmax_differs[0]) if len(argmax_differs) else None,
  }


def first_layer_differing(a: np.ndarray, b: np.ndarray, d: int) -> int | None:
  """The first block whose output differs between features a and b [T, L*D] (every block a feature), or None."""
  for layer in range(a.shape[-1] // d):
    if not np.array_equal(a[:, layer * d : (layer + 1) * d], b[:, layer * d : (layer + 1) * d]):
      return layer
  return None


def real_case(args, kernels: str):
  """The GGUF model and, per held-out prompt, its tokens and plain greedy continuation [P + span]."""
  from bench import real_target as rt  # noqa: PLC0415  (the loaders)
  from bench import smollm2 as bs  # noqa: PLC0415
  from specdec_jax import SamplingParams, generate  # noqa: PLC0415

  spec = rt.MODELS[args.model]()
  texts = {n: spec.chat_prompt(t) for n, t in rt.held_out_prompts(args.prompts.split(",")).items()}
  model, tokenizer = spec.load(jnp.dtype(args.dtype), kernels)
  span = args.tokens * args.offsets
  sequences = {}
  for name, text in texts.items():
    ids, n = bs.encode(tokenizer, [text], multiple=1)
    out = generate(
      model, jnp.asarray(ids), jnp.asarray(n), SamplingParams.greedy(1), None, max_new_tokens=span, all_greedy=True
    )
    p = int(n[0])
    sequences[name] = (np.concatenate([ids[0, :p], np.asarray(out.tokens)[0, :span]]), p)
  return model, sequences


def random_case(args, kernels: str):
  """Random weights of the model's shape with `--random-layers` blocks; three random prompts (lengths 37, 121,
  250) and random continuations: invariance concerns the arithmetic, not what the tokens mean."""
  from bench.step_profile import model_config, random_weights  # noqa: PLC0415
  from specdec_jax.models import Transformer  # noqa: PLC0415

  n = args.random_layers
  c = model_config(args.model, False, args.dtype).replace(
    num_layers=n, kernels=kernels, feature_layers=tuple(sorted({0, n // 2, n - 1}))
  )
  model = Transformer.from_weights(c, random_weights(c, jax.random.key(0)))
  rng = np.random.default_rng(0)
  span = args.tokens * args.offsets
  return model, {f"random{p}": (rng.integers(0, c.vocab_size, p + span), p) for p in (37, 121, 250)}


def time_calls(model, cache, t: int, start: int, loops: int = 200, repeats: int = 5) -> float:
  """Median over `repeats` of the mean ms of a T-token call (`_CALL`, the cache not advanced) over `loops` calls."""
  import time  # noqa: PLC0415

  x = jnp.zeros((1, t), jnp.int32)
  pos = start + jnp.arange(t, dtype=jnp.int32)[None]
  jax.block_until_ready(_CALL(model, x, pos, cache))  # compile
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(loops):
      out = _CALL(model, x, pos, cache)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / loops * 1e3)
  return float(np.median(times))


def main(argv=None):
  args = parse_args(argv)
  report = {"info": device_info(), "args": vars(args), "results": {}, "kernel_configs": {}, "timing_ms": {}}
  span = args.tokens * args.offsets
  for variant, kernels in itertools.product(args.variants, args.kernels):
    use_variant(variant)
    model, sequences = (random_case if args.random_layers else real_case)(args, kernels)
    c = model.config
    if args.per_layer:
      model.config = c = c.replace(feature_layers=tuple(range(c.num_layers)))
    if not c.feature_layers:
      raise SystemExit(f"{args.model} has no feature_layers: nothing to compare with features")
    label = f"{variant} {kernels}"
    results = report["results"][label] = {}
    max_length = max(p for _, p in sequences.values()) + span + 1  # one cache length: one program a way
    if args.kernel_configs:
      cache = model.init_cache(1, max_length)
      step, call = (program_kernels(model, cache, t, 0, True) for t in (1, args.tokens))
      report["kernel_configs"][label] = {"step": step, "call": call, "same": step == call}
      print(
        f"{label}: the products' kernels of a one-token step and a {args.tokens}-token call are "
        f"{'the same' if step == call else 'DIFFERENT'} ({len(step)} / {len(call)} lines)",
        flush=True,
      )
    if args.time_calls:
      cache = model.init_cache(1, max_length)
      ms = {f"T={t}": time_calls(model, cache, t, max_length // 2) for t in (1, args.tokens)}
      report["timing_ms"][label] = ms
      print(f"{label}: " + ", ".join(f"{k} {v:.4f} ms" for k, v in ms.items()), flush=True)
    for name, (full, p) in sequences.items():
      _, cache = _CALL(
        model, jnp.asarray(full[:p])[None], jnp.arange(p, dtype=jnp.int32)[None], model.init_cache(1, max_length)
      )
      rows = []
      for _ in range(args.offsets):
        ways, cache = four_ways(model, cache, full[p : p + args.tokens], p)
        row = {f"{a} vs {b}": compare(ways[a], ways[b]) for a, b in itertools.combinations(WAYS, 2)}
        if args.per_layer:
          row["first_block_differing"] = first_layer_differing(
            ways["steps+features!"], ways["call+features!"], c.d_model
          )
        rows.append(row)
        p += args.tokens
      pairs = [k for k in rows[0] if " vs " in k]
      summary = {
        pair: {
          "calls_same_bits": sum(r[pair]["same_bits"] for r in rows),
          "calls": len(rows),
          "max_abs_diff": max(r[pair]["max_abs_diff"] for r in rows),
          "argmax_flips": sum(r[pair]["first_argmax_differing"] is not None for r in rows),
        }
        for pair in pairs
      }
      if args.per_layer:
        summary["first_block_differing"] = [r["first_block_differing"] for r in rows]
      results[name] = {"summary": summary, "calls": rows}
      print(f"{label} {name}:", flush=True)
      for pair in pairs:
        s = summary[pair]
        print(
          f"  {pair:32s} same bits {s['calls_same_bits']}/{s['calls']}  max |diff| {s['max_abs_diff']:.3g}  "
          f"argmax flips {s['argmax_flips']}",
          flush=True,
        )
      if args.per_layer:
        print(f"  first block differing, per call: {summary['first_block_differing']}", flush=True)
    del model
  use_variant("barrier")
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, f"invariance_{args.model}.json")
  configs = report.pop("kernel_configs")
  with open(path, "w") as f:
    json.dump(report, f, indent=1)
  print(f"wrote {path}")
  if configs:
    with open(os.path.join(args.out, f"kernel_configs_{args.model}.json"), "w") as f:
      json.dump(configs, f, indent=1)
  return report


if __name__ == "__main__":
  main()
