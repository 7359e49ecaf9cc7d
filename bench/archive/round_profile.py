"""Where a speculative round's time goes, per draft shape: a `jax.profiler` trace of SmolLM2 with the EAGLE head.

For each shape (a chain K, a static tree "3x3x1x1", a dynamic tree "d5x8x48")
one prompt is generated at B=1 (after a compile call), then generated again
under the profiler. The device kernels of the trace are summed per round
(rounds = target calls): the busy time, the launches, and the wall time per
round, whose difference from the busy time is the device sitting idle between
kernels. The kernels are also grouped by the program phase they come from
when XLA names them after it (the trace's names are fusions, so most are not).

    PYTHONPATH=.:/tmp/site python3 bench/round_profile.py --out $OUT/profile --shapes 4,3x3x1x1,d4x4x16,d5x8x48

Writes round_profile.json (per shape: wall and busy us per round, launches,
top kernels). Needs the GGUF (bench/gguf_parts.py) and a GPU with CUPTI.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from bench.smollm2 import build_prompts, encode, parse_tree  # noqa: E402
from bench.step_profile import kernel_table  # noqa: E402
from specdec_jax import speculative_generate  # noqa: E402
from specdec_jax.models import load_smollm2, load_smollm2_eagle  # noqa: E402
from specdec_jax.models.loaders import smollm2
from specdec_jax.sampling.params import SamplingParams  # noqa: E402


def parse_shape(s: str):
  """"4" -> (4, None): a chain; a tree name of bench/smollm2.py ("3x3x1x1", "d5x8x48") -> (its depth, the tree)."""
  if s.isdigit():
    return int(s), None
  tree = parse_tree(s)
  return tree.depth, tree


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--shapes", default="4,3x3x1x1,d4x4x16,d5x8x48", help="comma list: K, a static tree or dKxkxN")
  ap.add_argument("--prompt", default="chat0", help="a prompt name of bench/smollm2.py")
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--mode", choices=("greedy", "t1"), default="greedy")
  ap.add_argument("--top", type=int, default=15, help="kernels listed per shape")
  args = ap.parse_args(argv)
  shapes = [(s, *parse_shape(s)) for s in args.shapes.split(",") if s]
  os.makedirs(args.out, exist_ok=True)
  info = common.device_info()
  dtype = jnp.bfloat16 if common.has_gpu() else jnp.float32
  target, tokenizer = load_smollm2(dtype)
  eagle = load_smollm2_eagle(dtype)
  tokens, lengths = encode(tokenizer, [build_prompts()[args.prompt]])
  greedy = args.mode == "greedy"
  params = SamplingParams.greedy(1) if greedy else SamplingParams.create([1.0])
  key = None if greedy else jax.random.key(0)
  kw = dict(max_new_tokens=args.max_new_tokens, eos_token_id=smollm2.SMOLLM2_EOS_IDS, all_greedy=greedy)
  report = {"info": info, "args": vars(args), "shapes": []}
  for name, k, tree in shapes:
    def call():
      return speculative_generate(target, eagle, jnp.asarray(tokens), jnp.asarray(lengths), params, key,
                                  num_speculative_tokens=k, draft_tree=tree, **kw)

    jax.block_until_ready(call())  # compile
    t0 = time.perf_counter()
    out = jax.block_until_ready(call())
    wall = time.perf_counter() - t0
    rounds = int(np.sum(out.stats.target_calls)) - 1  # the first call is the prefill
    trace_dir = tempfile.mkdtemp(prefix="round_profile_")
    with jax.profiler.trace(trace_dir):
      jax.block_until_ready(call())
    table = kernel_table(trace_dir, max(rounds, 1), top=100_000)
    busy = sum(r["us_per_step"] for r in table)
    launches = sum(r["per_step"] for r in table)
    row = {"shape": name, "K": k, "rounds": rounds, "tokens": int(np.sum(out.lengths)),
           "mean_accepted_length": float(out.stats.mean_accepted_length),
           "wall_us_per_round": 1e6 * wall / max(rounds, 1), "busy_us_per_round": busy,
           "launches_per_round": launches, "kernels": table[:args.top]}
    report["shapes"].append(row)
    print(f"{name:>10}: {rounds} rounds, mean accepted length {row['mean_accepted_length']:.2f}, "
          f"wall {row['wall_us_per_round']:.0f} us/round, device busy {busy:.0f} us/round, "
          f"{launches:.0f} launches/round")
    for r in table[:args.top]:
      print(f"      {r['us_per_step']:8.1f} us  x{r['per_step']:5.1f}  {r['kernel'][:90]}")
  with open(os.path.join(args.out, "round_profile.json"), "w") as f:
    json.dump(report, f, indent=1)
  print(f"wrote {args.out}/round_profile.json")
  return report


if __name__ == "__main__":
  main()
