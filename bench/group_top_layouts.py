"""`thresholds.group_top`'s pass over the logits by group size and layout, on one device.

The split top-k/top-p search reads each device's slice of V/m tokens for its
candidates; the group size must divide the slice (V/2 = 75968 = 64 x 1187 for
Qwen's vocabulary), and a reduction's cost per token depends on it. This
times, per call inside one jitted loop (bench/common.py), over f32 [ROWS, V]
for V in (151936, 75968, 37984) (one device's vocabulary, half, a quarter):

    argmax       jnp.argmax (one read; the reference)
    contigG      group_top with contiguous groups of G tokens, with the group masses
    stridedG     the same 4 largest per group, groups strided over the row (token
                 i in group i mod V/G): a column reduction instead of a row reduction

Usage (from the repository root; ROWS=5120 is B=1024 at K=4):
    ROWS=5120 OUT=$OUT PYTHONPATH=. python3 bench/group_top_layouts.py

Output: a line per (V, method) and OUT/gtop.json.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common
from specdec_jax.sampling import thresholds
from specdec_jax.sampling.reductions import _lse_combine


def strided_top(x, n, per_group=4):
  """The `per_group` largest of the groups {i, i + V/n, ...} of x [R, V] (n tokens each), with their masses."""
  g = x.shape[-1] // n
  xg = x.reshape(x.shape[:-1] + (n, g))
  operands = (xg,) + (jnp.full_like(xg, -jnp.inf),) * (per_group - 1) + (jnp.ones_like(xg),)
  init = tuple(np.float32(-np.inf) for _ in range(per_group)) + (np.float32(0),)

  def combine(a, b):
    return thresholds._merge_top(a[:per_group], b[:per_group]) + (_lse_combine(a[0], a[-1], b[0], b[-1])[1],)

  out = jax.lax.reduce(operands, init, combine, (xg.ndim - 2,))
  return jnp.stack(out[:per_group], -1), out[-1]


def main():
  rows = int(os.environ.get("ROWS", 5120))
  out_dir = os.environ.get("OUT", "bench/out")
  os.makedirs(out_dir, exist_ok=True)
  results = []
  for v in (151936, 75968, 37984):
    x = jnp.stack([2.0 * jax.random.normal(jax.random.key(i), (rows, v), jnp.float32) for i in range(2)])
    methods = {"argmax": lambda a: jnp.argmax(a, -1).astype(jnp.float32)}
    for gs in (32, 64, 128):
      if v % gs == 0:
        methods[f"contig{gs}"] = lambda a, gs=gs: sum(
          t.reshape(t.shape[0], -1)[:, 0] for t in thresholds.group_top(a, gs, with_sumexp=True)
        )
        methods[f"strided{gs}"] = lambda a, gs=gs: sum(t.reshape(t.shape[0], -1)[:, 0] for t in strided_top(a, gs))
    for name, fn in methods.items():

      def step(i, carry, stack, fn=fn):
        return carry + jnp.sum(fn(stack[i % 2])) * 1e-9

      r = common.time_per_iter(common.timed_loop(step), jnp.float32(0), (x,), target_s=0.2, repeats=5)
      ms = r["per_iter_s"] * 1e3
      results.append({"V": v, "rows": rows, "method": name, "ms": ms})
      print(f"V={v:6d} {name:10s} {ms:8.3f} ms", flush=True)
    del x
  with open(os.path.join(out_dir, "gtop.json"), "w") as f:
    json.dump({"device": common.device_info(), "rows": results}, f, indent=1, default=str)


if __name__ == "__main__":
  main()
