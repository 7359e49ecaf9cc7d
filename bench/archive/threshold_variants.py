"""Experiment: ways to cut the candidate sort of the top-k/top-p threshold search (H100).

    PYTHONPATH=. python3 bench/threshold_variants.py --out $OUT/thr

Times `thresholds.threshold_and_lse` at B rows x (K+1) positions x V (default top-k 50,
top-p 0.9, T=1; LM-like logits from bench/threshold.py) for each variant of the candidate stage, next to the group
top-4 pass alone and a plain (max, sum of exps) pass, and checks that every
variant gives the reference thresholds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from threshold import lm_like_logits  # noqa: E402

from specdec_jax.sampling import thresholds
from specdec_jax.sampling.reductions import max_and_sumexp  # noqa: E402

VARIANTS = {"sort_all": dict(_NARROW_GROUP=0),
            "narrow_128x8": dict(_NARROW_GROUP=128, _NARROW_PER_GROUP=8),
            "narrow_64x8": dict(_NARROW_GROUP=64, _NARROW_PER_GROUP=8)}
DEFAULTS = dict(_NARROW_GROUP=thresholds._NARROW_GROUP, _NARROW_PER_GROUP=thresholds._NARROW_PER_GROUP)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--batch", type=int, default=1024)
  ap.add_argument("--k", type=int, default=4)
  ap.add_argument("--vocab", type=int, default=151936)
  ap.add_argument("--buffers", type=int, default=3)
  ap.add_argument("--top-k", type=int, default=50)
  ap.add_argument("--top-p", type=float, default=0.9)
  ap.add_argument("--out", default="/tmp/thr")
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  b, k1, v = args.batch, args.k + 1, args.vocab
  keys = jax.random.split(jax.random.key(0), args.buffers)
  bufs = [lm_like_logits(kk, (b, k1, v)) for kk in keys]
  t = jnp.ones((b,), jnp.float32)
  top_k = jnp.full((b,), args.top_k, jnp.int32)
  top_p = jnp.full((b,), args.top_p, jnp.float32)
  floor_ms = b * k1 * v * 4 / common.copy_bandwidth()["bytes_per_s"] * 1e3 if common.has_gpu() else None
  rows = []

  def run(name, fn):
    def step(i, carry, bufs):
      for x in bufs:
        x = jnp.where(carry == -12345, 0.0, x)  # ties each call to the last: no hoisting
        carry = carry + fn(x)
      return carry
    loop = common.timed_loop(step)
    r = common.time_per_iter(loop, jnp.int32(0), (tuple(bufs),), target_s=0.3)
    ms = r["per_iter_s"] * 1e3 / len(bufs)
    rows.append({"variant": name, "ms": ms, "x_floor": None if floor_ms is None else ms / floor_ms})
    print(f"{name:16s} {ms:9.3f} ms" + ("" if floor_ms is None else f"  {ms / floor_ms:6.2f}x floor"), flush=True)

  checksum = lambda a: jax.lax.bitcast_convert_type(jnp.sum(a), jnp.int32)
  run("onepass", lambda x: checksum(sum(max_and_sumexp(x))))
  run("group_top4", lambda x: checksum(thresholds.group_top(x, with_sumexp=True)[0][..., -1]))
  run("group_top4_no_mass", lambda x: checksum(thresholds.group_top(x)[..., -1]))
  ref = None
  for name, consts in VARIANTS.items():
    for c, val in {**DEFAULTS, **consts}.items():
      setattr(thresholds, c, val)
    thr, lse = jax.jit(thresholds.threshold_and_lse)(bufs[0][:64], t[:64], top_k[:64], top_p[:64])
    if ref is None:
      ref = (thr, lse)
    same = bool(jnp.all(thr == ref[0])) and float(jnp.max(jnp.abs(lse - ref[1]))) < 1e-4
    print(f"{name}: thresholds equal to sort_all: {same}")
    run(name, lambda x: checksum(sum(thresholds.threshold_and_lse(x, t, top_k, top_p))))
    rows[-1]["same_as_sort_all"] = same
  for c, val in DEFAULTS.items():
    setattr(thresholds, c, val)
  with open(os.path.join(args.out, f"threshold_variants_k{args.top_k}_p{args.top_p}.json"), "w") as f:
    json.dump({"device": common.device_info(), "top_k": args.top_k, "top_p": args.top_p, "B": b, "K+1": k1, "V": v,
               "floor_ms": floor_ms, "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
