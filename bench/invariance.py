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

Writes OUT/invariance_<model>.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import device_info, has_gpu

WAYS = ("steps", "steps+features", "call", "call+features")


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
  ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
  args = ap.parse_args(argv)
  args.kernels = [k for k in args.kernels.split(",") if k]
  bad = [k for k in args.kernels if k not in ("xla", "pallas")]
  if bad or not args.kernels:
    ap.error(f"--kernels: a comma list of xla, pallas; got {bad or args.kernels}")
  if args.tokens < 1 or args.offsets < 1:
    ap.error("--tokens and --offsets must be >= 1")
  args.dtype = args.dtype or ("bfloat16" if has_gpu() else "float32")
  return args


# Compiled once a shape: a call's program depends on T and the cache's length, not on the offset or prompt.
_CALL = jax.jit(lambda m, t, p, c: m(t, p, c))
_CALL_FEATURES = jax.jit(lambda m, t, p, c: m(t, p, c, return_features=True))


def four_ways(model, cache, cont, start: int) -> tuple[dict[str, np.ndarray], object]:
  """Logits [T, V] of the tokens `cont` [T] at positions start.. after `cache` (the context so far), computed
  the four `WAYS`; and the cache after the T-token call (the next offset's context)."""
  x = jnp.asarray(cont)[None]
  pos = start + jnp.arange(len(cont), dtype=jnp.int32)[None]
  logits, after = _CALL(model, x, pos, cache)
  out = {"call": np.asarray(logits[0]), "call+features": np.asarray(_CALL_FEATURES(model, x, pos, cache)[0][0])}
  for name, fn in (("steps", _CALL), ("steps+features", _CALL_FEATURES)):
    c, rows = cache, []
    for j in range(len(cont)):
      res = fn(model, x[:, j : j + 1], pos[:, j : j + 1], c)
      rows.append(np.asarray(res[0][0, 0]))
      c = res[-1]
    out[name] = np.stack(rows)
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


def main(argv=None):
  args = parse_args(argv)
  from bench import real_target as rt  # noqa: PLC0415  (the loaders)
  from bench import smollm2 as bs  # noqa: PLC0415
  from specdec_jax import SamplingParams, generate  # noqa: PLC0415

  spec = rt.MODELS[args.model]()
  texts = {n: spec.chat_prompt(t) for n, t in rt.held_out_prompts(args.prompts.split(",")).items()}
  report = {"info": device_info(), "args": vars(args), "results": {}}
  span = args.tokens * args.offsets
  for kernels in args.kernels:
    model, tokenizer = spec.load(jnp.dtype(args.dtype), kernels)
    if not model.config.feature_layers:
      raise SystemExit(f"{args.model} has no feature_layers: nothing to compare with features")
    results = report["results"][kernels] = {}
    encoded = {name: bs.encode(tokenizer, [text], multiple=1) for name, text in texts.items()}
    max_length = max(int(n[0]) for _, n in encoded.values()) + span + 1  # one cache length: one program a way
    for name, (ids, n) in encoded.items():
      out = generate(
        model, jnp.asarray(ids), jnp.asarray(n), SamplingParams.greedy(1), None, max_new_tokens=span, all_greedy=True
      )
      p = int(n[0])
      full = np.concatenate([ids[0, :p], np.asarray(out.tokens)[0, :span]])
      _, cache = _CALL(
        model, jnp.asarray(full[:p])[None], jnp.arange(p, dtype=jnp.int32)[None], model.init_cache(1, max_length)
      )
      rows = []
      for _ in range(args.offsets):
        ways, cache = four_ways(model, cache, full[p : p + args.tokens], p)
        rows.append({f"{a} vs {b}": compare(ways[a], ways[b]) for a, b in itertools.combinations(WAYS, 2)})
        p += args.tokens
      summary = {
        pair: {
          "calls_same_bits": sum(r[pair]["same_bits"] for r in rows),
          "calls": len(rows),
          "max_abs_diff": max(r[pair]["max_abs_diff"] for r in rows),
          "argmax_flips": sum(r[pair]["first_argmax_differing"] is not None for r in rows),
        }
        for pair in rows[0]
      }
      results[name] = {"summary": summary, "calls": rows}
      print(f"{kernels} {name}:", flush=True)
      for pair, s in summary.items():
        print(
          f"  {pair:32s} same bits {s['calls_same_bits']}/{s['calls']}  max |diff| {s['max_abs_diff']:.3g}  "
          f"argmax flips {s['argmax_flips']}",
          flush=True,
        )
    del model
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, f"invariance_{args.model}.json")
  with open(path, "w") as f:
    json.dump(report, f, indent=1)
  print(f"wrote {path}")
  return report


if __name__ == "__main__":
  main()
