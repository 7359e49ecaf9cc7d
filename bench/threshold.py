"""Top-k/top-p threshold search alone: full sort vs the sort-free candidate search.

The design asks to measure the sort-based threshold first, then a sort-free one,
and keep the faster. This times, on f32 logits [B, K+1, V] with top_k=50 and
top_p=0.9 (and top-p alone), per iteration inside one jitted fori_loop:

    sorted     thresholds.sorted_threshold: descending sort of the vocabulary
    candidate  thresholds.top_k_top_p_threshold: per-group top-4 (one fused
               variadic reduction) + a sort of V/32 candidates, exact, with a
               sort fallback when its exactness check fails
    group_top  thresholds.group_top alone (the one pass over the logits)
    argmax     jnp.argmax, the one-read reference

Logits are drawn like a language model's (a few large, a long Gaussian tail),
so the candidate path's exactness check is the realistic one; the JSON records
whether it held.

    PYTHONPATH=. python3 bench/threshold.py --out bench/out [--batch-sizes 32,1024]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from specdec_jax.sampling import thresholds


def lm_like_logits(key, shape):
  """Gaussian tail (std 2) plus a few tokens lifted well above it, like an LM."""
  k1, k2 = jax.random.split(key)
  x = 2.0 * jax.random.normal(k1, shape, jnp.float32)
  boost = jnp.where(jax.random.uniform(k2, shape) < 2e-4, 8.0, 0.0)
  return x + boost


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--batch-sizes", default="32,1024")
  ap.add_argument("--vocab-size", type=int, default=151936)
  ap.add_argument("--k", type=int, default=4)
  ap.add_argument("--out", default="bench/out")
  args = ap.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  bw = common.copy_bandwidth()
  results = {"device": common.device_info(), "copy_bandwidth": bw, "rows": []}
  gbps = bw["bytes_per_s"] / 1e9
  print(f"copy bandwidth {gbps:.0f} GB/s on {results['device']}")
  for b in [int(x) for x in args.batch_sizes.split(",")]:
    shape = (b, args.k + 1, args.vocab_size)
    stack = jnp.stack([lm_like_logits(jax.random.key(i), shape) for i in range(2)])
    floor_ms = stack[0].size * 4 / (gbps * 1e9) * 1e3
    for label, top_k, top_p in (("top_k=50,top_p=0.9", 50, 0.9), ("top_p=0.9", 0, 0.9)):
      tk = jnp.full((b,), top_k, jnp.int32)
      tp = jnp.full((b,), top_p, jnp.float32)
      fns = {
        "sorted": lambda x: thresholds.sorted_threshold(x, tk, tp),
        "candidate": lambda x: thresholds.top_k_top_p_threshold(x, tk, tp),
        "group_top": lambda x: thresholds.group_top(x)[..., 0, 0],
        "argmax": lambda x: jnp.argmax(x, -1).astype(jnp.float32),
      }
      exact = np.asarray(
        thresholds.top_k_top_p_threshold(stack[0], tk, tp) == thresholds.sorted_threshold(stack[0], tk, tp)
      )
      for name, fn in fns.items():

        def step(i, carry, stack, fn=fn):
          x = stack[(i + (carry == jnp.float32(-1e30)).astype(jnp.int32)) % stack.shape[0]]
          return carry + jnp.sum(jnp.where(jnp.isfinite(fn(x)), fn(x), 0.0)) * 1e-9

        loop = common.timed_loop(step)
        r = common.time_per_iter(loop, jnp.float32(0), (stack,), target_s=0.2, repeats=5)
        ms = r["per_iter_s"] * 1e3
        r = {k: v for k, v in r.items() if k != "compiled"}
        row = {
          "B": b,
          "V": args.vocab_size,
          "filter": label,
          "method": name,
          "ms": ms,
          "floor_ms": floor_ms,
          "x_floor": ms / floor_ms,
          "candidate_equals_sorted": bool(exact.all()),
          "timing": r,
        }
        results["rows"].append(row)
        print(
          f"B={b:5d} {label:20s} {name:10s} {ms:9.3f} ms  {ms / floor_ms:7.2f}x floor"
          f"  (candidate==sorted: {bool(exact.all())})",
          flush=True,
        )
    del stack
  with open(os.path.join(args.out, "threshold.json"), "w") as f:
    json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
  main()
