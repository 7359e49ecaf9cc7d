"""What the split sampler sends between devices: the collectives of its compiled program, and their bytes.

With the vocabulary split over M devices (a 1 x M mesh, `target_logits` as
P(None, None, "model")), `rejection_sample` reads V/M of every row on each
device and exchanges only partials. This script compiles the program (no run:
the arrays are shapes only, so it works on a CPU with fake devices) and lists
every collective instruction with its result shape and bytes, against the bytes
of one device's slice of the logits. The HLO holds every branch of every
`lax.cond`, so the total counts rarely taken branches too (the overflow redo,
the threshold fallbacks): an upper bound on what one call sends.

Usage (the device count must be set before JAX starts):

    XLA_FLAGS=--xla_force_host_platform_device_count=4 PYTHONPATH=. python3 bench/collectives.py --model-devices 4
    PYTHONPATH=. python3 bench/collectives.py --model-devices 2 --batch 1024 --vocab 151936 --out $OUT   # 2 GPUs

Output: a table per case on stdout and `collectives_M<m>.json` in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402
from specdec_jax import SamplingParams, rejection_sample  # noqa: E402
from specdec_jax.mesh import make_mesh  # noqa: E402

_BYTES = {"f32": 4, "s32": 4, "u32": 4, "f16": 2, "bf16": 2, "pred": 1, "s8": 1, "u8": 1, "s64": 8, "u64": 8}

CASES = {
    "greedy_static": dict(temperature=0.0, all_greedy=True),
    "random_ngram": dict(temperature=1.0),
    "random_draft_probs": dict(temperature=1.0, draft_probs=True),
    "random_topk_topp": dict(temperature=1.0, top_k=50, top_p=0.9),
}


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO result shape: one array `f32[8,5]` or a tuple of them."""
  total = 0
  for dtype, dims in re.findall(r"([a-z]+\d*)\[([^\]]*)\]", shape):
    n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
    total += n * _BYTES.get(dtype, 4)
  return total


def run_case(name, mesh, b, k, v):
  c = CASES[name]
  params = SamplingParams.create(np.full(b, c["temperature"], np.float32), top_k=c.get("top_k"), top_p=c.get("top_p"))
  split = NamedSharding(mesh, P(None, None, "model"))
  logits = jax.ShapeDtypeStruct((b, k + 1, v), jnp.float32, sharding=split)
  probs = jax.ShapeDtypeStruct((b, k, v), jnp.float32, sharding=split) if c.get("draft_probs") else None
  draft = jax.ShapeDtypeStruct((b, k), jnp.int32)
  greedy = c.get("all_greedy", False)

  def fn(d, x, q, key):
    return rejection_sample(d, x, params, key=None if greedy else key, draft_probs=q, all_greedy=greedy)

  with jax.set_mesh(mesh):
    text = jax.jit(fn).lower(draft, logits, probs, jax.random.key(0)).compile().as_text()
  found = common.hlo_collectives(text)
  rows = [{"collective": key, "count": n, "bytes": shape_bytes(key.split(" ", 1)[1]) * n}
          for key, n in sorted(found.items(), key=lambda kv: -shape_bytes(kv[0].split(" ", 1)[1]) * kv[1])]
  slice_bytes = b * (k + 1) * v * 4 // mesh.shape["model"]
  return {"case": name, "collectives": rows, "total_bytes": sum(r["bytes"] for r in rows),
          "slice_bytes": slice_bytes}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model-devices", type=int, default=jax.device_count(), help="M (default: every device)")
  ap.add_argument("--batch", type=int, default=1024)
  ap.add_argument("--k", type=int, default=4)
  ap.add_argument("--vocab", type=int, default=151936)
  ap.add_argument("--cases", default=",".join(CASES), help="comma list of: " + ", ".join(CASES))
  ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
  args = ap.parse_args(argv)
  if not 2 <= args.model_devices <= jax.device_count():
    ap.error(f"--model-devices must be in [2, {jax.device_count()}] (devices present); on a CPU set "
             "XLA_FLAGS=--xla_force_host_platform_device_count=N first")
  cases = [c for c in args.cases.split(",") if c]
  if any(c not in CASES for c in cases):
    ap.error(f"--cases: choose from {list(CASES)}")
  mesh = make_mesh(1, args.model_devices)
  report = {"info": common.device_info(), "config": vars(args), "results": []}
  for name in cases:
    r = run_case(name, mesh, args.batch, args.k, args.vocab)
    report["results"].append(r)
    print(f"\n{name}: B={args.batch} K={args.k} V={args.vocab} over {args.model_devices} devices; "
          f"collectives in the program {r['total_bytes'] / 2**20:.2f} MiB (all branches) "
          f"vs {r['slice_bytes'] / 2**20:.0f} MiB of logits read per device "
          f"({100 * r['total_bytes'] / r['slice_bytes']:.2f}%)")
    for row in r["collectives"]:
      print(f"  {row['count']:>4} x {row['collective']:<60} {row['bytes'] / 2**10:>10.1f} KiB")
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, f"collectives_M{args.model_devices}.json")
  with open(path, "w") as f:
    json.dump(report, f, indent=1, default=str)
  print(f"\nwrote {path}")


if __name__ == "__main__":
  main()
