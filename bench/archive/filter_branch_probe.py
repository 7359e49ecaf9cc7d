"""What the top-k/top-p filters cost `rejection_sample(kernels="pallas")` at B=1 and 8 when no row filters.

Times the default program, the same with `no_filters=True`, and a top-k 50 / top-p 0.9 batch (K=4,
V=151936, T=1, draft probabilities), four sampler calls per loop iteration on separate logits:

    PYTHONPATH=. python3 bench/archive/filter_branch_probe.py      # GPU; writes $OUT/filter_branch_probe.json

The archived `bench/results/sampler_filter_branch_probe_h100.json` (2026-11-27) also holds rows
"sort_free=True", a threshold-search variant that was tried in the working tree and not kept; its
"sort_free=False" rows are the committed program of that day (c8f8639), where the filters were a
run-time `lax.cond` around the XLA threshold search.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
from bench import common  # noqa: E402
from specdec_jax import SamplingParams, rejection_sample  # noqa: E402


def per_call_us(b, v, k, filters, flags):
  logits = [jax.random.normal(jax.random.key(i), (b, k + 1, v), jnp.float32) * 3 for i in range(4)]
  q = jax.nn.softmax(jax.random.normal(jax.random.key(9), (b, k, v)) * 3, -1)
  draft = jax.random.randint(jax.random.key(2), (b, k), 0, v, jnp.int32)
  params = SamplingParams.create(jnp.ones((b,), jnp.float32), top_k=50 if filters else 0, top_p=0.9 if filters else 1.0)

  def step(i, acc, logits, draft, params, key, q):
    for x in logits:
      out = rejection_sample((draft + acc) % v, x, params, jax.random.fold_in(key, acc), draft_probs=q, **flags)
      acc = acc + out.token_ids.sum()
    return acc

  r = common.time_per_iter(
    common.timed_loop(step), jnp.int32(0), (logits, draft, params, jax.random.key(0), q), target_s=0.03, repeats=3
  )
  return r["per_iter_s"] * 1e6 / len(logits)


def main():
  out = {}
  for b in (1, 8):
    for filters, name, flags in (
      (False, "default", {}),
      (False, "no_filters", {"no_filters": True}),
      (True, "default", {}),
    ):
      key = f"B={b} topk={filters} {name}"
      out[key] = round(per_call_us(b, 151936, 4, filters, dict(kernels="pallas", **flags)), 1)
      print(key, out[key], flush=True)
  with open(os.path.join(os.environ.get("OUT", "/tmp"), "filter_branch_probe.json"), "w") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
