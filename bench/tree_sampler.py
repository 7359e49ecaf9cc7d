"""Tree verification (`tree_rejection_sample`) against the chain of the same depth, and against its floor.

What: for trees of N nodes in {8, 16, 32, 64} at depth 4 (N/4 branches at the
root, each followed to depth 4: the shape `DraftTree((N // 4, 1, 1, 1))`; the
walk's cost depends on N, through the one statistics pass over all N+1 rows,
and on the depth), each at B in {1, 32, 256} and V in {49152, 151936}, float32:

    tree_greedy_static   all_greedy=True
    tree_random_probs    T=1, draft_probs [B, N+1, V] given (recursive rejection sampling)
    tree_random_ngram    T=1, no draft probabilities (deterministic children)
    chain_*              the same three through `rejection_sample` with K=4 (the
                         chain of the same depth; its logits are [B, 5, V])

Floor: one read of the case's own target_logits ([B, N+1, V] or [B, 5, V]) at
the copy bandwidth measured in the same run; frac = floor / time (1.0 = at the
floor). `tree/chain` compares the tree with the chain case of the same mode:
the price of scoring N nodes instead of 4.

Timing as bench/sampler.py (whose loop and buffers this reuses): each call
inside one jitted fori_loop, chained to the previous one's output, rotating
separate buffers larger than the L2 where memory allows.

Run:

    PYTHONPATH=. python3 bench/tree_sampler.py --out $OUT                 # GPU, the full grid
    PYTHONPATH=. python3 bench/tree_sampler.py --quick                    # CPU smoke run

Writes OUT/tree_sampler.json and OUT/tree_sampler.png (fraction of the floor vs N).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402
from bench.sampler import _checksum  # noqa: E402
from specdec_jax.drafts.static_tree import DraftTree  # noqa: E402
from specdec_jax.sampling.params import SamplingParams  # noqa: E402
from specdec_jax.verify.chain import rejection_sample  # noqa: E402
from specdec_jax.verify.tree import tree_rejection_sample  # noqa: E402

DEPTH = 4
MODES = {"greedy_static": (0.0, False, True), "random_probs": (1.0, True, False), "random_ngram": (1.0, False, False)}


def _tree_checksum(out) -> jax.Array:
  return jnp.sum(out.token_ids) + jnp.sum(out.num_accepted) + jnp.sum(out.accepted_nodes)


def make_step(kind: str, mode: str, n_buf: int, vocab: int, parents):
  """One sampler call per buffer per iteration, each chained to the previous one's checksum."""
  _, with_dp, all_greedy = MODES[mode]

  def step(i, carry, logits_bufs, dp_bufs, draft0, params, key0):
    for j in range(n_buf):
      draft = (draft0 + carry) % vocab
      key = None if all_greedy else jax.random.fold_in(key0, carry)
      dp = dp_bufs[j] if with_dp else None
      if kind == "tree":
        out = tree_rejection_sample(
          draft_token_ids=draft,
          parents=parents,
          target_logits=logits_bufs[j],
          params=params,
          key=key,
          draft_probs=dp,
          all_greedy=all_greedy,
        )
        carry = carry + _tree_checksum(out)
      else:
        out = rejection_sample(
          draft_token_ids=draft,
          target_logits=logits_bufs[j],
          params=params,
          key=key,
          draft_probs=dp,
          all_greedy=all_greedy,
        )
        carry = carry + _checksum(out)
    return carry

  return step


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _make_buffer(key, b, rows, dp_rows, v, with_dp):
  k1, k2 = jax.random.split(key)
  logits = 2.0 * jax.random.normal(k1, (b, rows, v), jnp.float32)
  dp = jax.nn.softmax(2.0 * jax.random.normal(k2, (b, dp_rows, v), jnp.float32), axis=-1) if with_dp else None
  return logits, dp


def run(kind, mode, b, v, n, args, bandwidth, mem):
  """Times one configuration; None when it does not fit in memory."""
  temp, with_dp, _ = MODES[mode]
  tree = DraftTree((n // DEPTH,) + (1,) * (DEPTH - 1)) if kind == "tree" else None
  drafts = n if kind == "tree" else DEPTH
  rows = drafts + 1
  dp_rows = rows if kind == "tree" else DEPTH
  buf_bytes = b * rows * v * 4 + (b * dp_rows * v * 4 if with_dp else 0)
  n_buf = min(8, max(2, math.ceil(args.rotate_mb * 2**20 / buf_bytes)))
  if mem is not None and (n_buf + 4) * buf_bytes > 0.85 * mem:
    return None
  bufs = [_make_buffer(jax.random.key(j), b, rows, dp_rows, v, with_dp) for j in range(n_buf)]
  logits = tuple(x for x, _ in bufs)
  dps = tuple(d for _, d in bufs) if with_dp else None
  draft0 = jax.random.randint(jax.random.key(99), (b, drafts), 0, v, jnp.int32)
  params = SamplingParams.create(jnp.full((b,), temp, jnp.float32))
  loop = common.timed_loop(make_step(kind, mode, n_buf, v, None if tree is None else tree.parents))
  carry = jnp.int32(0)
  operands = (logits, dps, draft0, params, jax.random.key(1))
  compiled, compile_s = common.compile_loop(loop, carry, operands)
  r = common.time_per_iter(compiled, carry, operands, target_s=args.target_ms / 1e3, repeats=args.repeats)
  ms = r["per_iter_s"] * 1e3 / n_buf
  floor_ms = b * rows * v * 4 / bandwidth * 1e3
  del bufs, logits, dps
  gc.collect()
  return {
    "kind": kind,
    "mode": mode,
    "B": b,
    "V": v,
    "N": n if kind == "tree" else DEPTH,
    "depth": DEPTH,
    "tree": None if tree is None else list(tree.branching),
    "ms": ms,
    "floor_ms": floor_ms,
    "frac": floor_ms / ms,
    "scale_2n": r["scale"],
    "compile_s": compile_s,
    "buffers": n_buf,
  }


def plot(results, path):
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  trees = [r for r in results if r["kind"] == "tree"]
  if not trees:
    return None
  vs = sorted({r["V"] for r in trees})
  fig, axes = plt.subplots(1, len(vs), figsize=(6 * len(vs), 4.2), squeeze=False)
  for ax, v in zip(axes[0], vs):
    for mode in MODES:
      for b in sorted({r["B"] for r in trees}):
        pts = sorted((r["N"], r["frac"]) for r in trees if r["V"] == v and r["B"] == b and r["mode"] == mode)
        if pts:
          ax.plot(*zip(*pts), marker="o", label=f"{mode} B={b}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree nodes N (depth 4)")
    ax.set_ylabel("fraction of floor (one read of [B, N+1, V])")
    ax.set_ylim(0, 1.1)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_title(f"tree_rejection_sample, V={v}, f32, {jax.devices()[0].device_kind}", fontsize=9)
    ax.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ints = lambda s: tuple(int(x) for x in s.split(",") if x)
  p.add_argument("--batch-sizes", type=ints)
  p.add_argument("--vocab-sizes", type=ints)
  p.add_argument("--nodes", type=ints, help="tree sizes N, multiples of 4 (default 8,16,32,64)")
  p.add_argument("--modes", type=lambda s: tuple(s.split(",")), default=tuple(MODES))
  p.add_argument("--quick", action="store_true", help="a tiny CPU grid")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--target-ms", type=float, default=100.0)
  p.add_argument("--rotate-mb", type=float, default=4 * common.GPU_L2_BYTES / 2**20)
  p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
  args = p.parse_args(argv)
  bad = [m for m in args.modes if m not in MODES]
  if bad:
    p.error(f"unknown mode(s) {bad}; choose from {list(MODES)}")
  args.nodes = args.nodes or ((8, 16) if args.quick else (8, 16, 32, 64))
  if any(n % DEPTH or n < DEPTH for n in args.nodes):
    p.error(f"--nodes must be multiples of {DEPTH}")
  args.batch_sizes = args.batch_sizes or ((1, 8) if args.quick else (1, 32, 256))
  args.vocab_sizes = args.vocab_sizes or ((4096,) if args.quick else (49152, 151936))
  if args.quick:
    args.repeats, args.target_ms, args.rotate_mb = 3, 20.0, 16.0
  os.makedirs(args.out, exist_ok=True)
  info = common.device_info()
  print(f"{info['device']} ({info['platform']}), jax {info['jax']}")
  bw = common.copy_bandwidth(common.default_copy_bytes(), repeats=3)
  mem = common.device_memory_bytes()
  report = {"info": info, "config": vars(args), "copy_bandwidth": bw, "results": [], "skipped": []}
  path = os.path.join(args.out, "tree_sampler.json")
  grid = [
    (kind, mode, b, v, n)
    for v in args.vocab_sizes
    for b in args.batch_sizes
    for mode in args.modes
    for kind, n in [("chain", DEPTH)] + [("tree", n) for n in args.nodes]
  ]
  for kind, mode, b, v, n in tqdm(grid, desc="tree sampler", unit="case", mininterval=2.0, file=sys.stdout):
    try:
      r = run(kind, mode, b, v, n, args, bw["bytes_per_s"], mem)
    except Exception as e:  # noqa: BLE001 - e.g. out of memory: record, keep going
      report["skipped"].append(f"{kind} {mode} B={b} V={v} N={n}: {type(e).__name__}: {str(e)[:200]}")
      continue
    if r is None:
      report["skipped"].append(f"{kind} {mode} B={b} V={v} N={n}: does not fit in memory")
      continue
    chain = next(
      (c for c in report["results"] if c["kind"] == "chain" and c["mode"] == mode and c["B"] == b and c["V"] == v), None
    )
    r["vs_chain"] = r["ms"] / chain["ms"] if chain and kind == "tree" else None
    report["results"].append(r)
    tqdm.write(
      f"{kind:<5} {mode:<14} B={b:<4} V={v:<7} N={r['N']:<3} {r['ms']:8.4f} ms  frac {r['frac']:.2f}"
      + (f"  tree/chain {r['vs_chain']:.2f}" if r["vs_chain"] else "")
    )
    with open(path, "w") as f:
      json.dump(report, f, indent=1, default=str)
  png = plot(report["results"], os.path.join(args.out, "tree_sampler.png"))
  with open(path, "w") as f:
    json.dump(report, f, indent=1, default=str)
  print(f"wrote {path}" + (f" and {png}" if png else ""))
  for s in report["skipped"]:
    print("skipped:", s)


if __name__ == "__main__":
  main()
