"""Tree calls on the Pallas kernels, on a GPU: each node's logits against one-token steps along its path, and cost.

A tree call writes its nodes at slots of their own and reads each node's keys in a chain's order
(`specdec_jax.kernels.attention._tree_tails`), so greedy trees give plain greedy decoding's tokens only if
every node's logits are the bits of one-token steps along its path. The CPU test checks this in Pallas's
interpreter on a tiny model; this script checks it where Triton compiles the kernels, on random weights of a
real model's shape (`--layers` blocks: the attention kernel is the same program in every block), and times a
tree call against a chain call of as many tokens.

Per tree (`--trees`: static branchings such as 2x2x1x1, or `randomN.D`: N nodes of depth at most D, parents
drawn at random) and per call's context lengths (`--contexts`: one row a call by default; `37,121` is a call of
two rows whose trees start in different slot blocks): the nodes whose logits equal the steps' bits, the largest difference, argmax flips,
and ms per call of the tree call and of a chain call of T = nodes + 1 tokens (median of `--repeats` loops
of `--loops` calls, the cache not advanced). Only calls of at most 16 rows (B*T) take the kernels; larger
ones run on XLA's blocks and are not expected to match the steps' bits (the one-token steps take the kernels).

    PYTHONPATH=. python3 bench/tree_kernels.py --out $OUT                                   # GPU
    PYTHONPATH=. python3 bench/tree_kernels.py --kernels pallas_interpret --tiny --layers 1 --trees 2x1 \
        --contexts 14,21 --loops 2 --repeats 1 --out /tmp/tk                               # CPU smoke

Writes OUT/tree_kernels.json (every number, the device, versions, the command line).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import device_info, has_gpu
from specdec_jax.drafts import DraftTree
from specdec_jax.drafts.dynamic_tree import tree_ancestors
from specdec_jax.drafts.static_tree import tree_attention_mask

_CALL = jax.jit(lambda m, t, p, c: m(t, p, c))
_TREE = jax.jit(lambda m, t, p, c, s, a: m(t, p, c, cache_slots=s, attention_mask=a))


def parse_args(argv=None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="a shape of bench/step_profile.py's SHAPES")
  ap.add_argument("--layers", type=int, default=2, help="blocks of random weights (default 2)")
  ap.add_argument("--tiny", action="store_true", help="the tiny model with the shape's biases (CPU smoke)")
  ap.add_argument("--kernels", default="pallas", help="pallas (GPU) or pallas_interpret (CPU smoke)")
  ap.add_argument("--trees", default="2x2x1x1,3x1x1x1x1,random15.5,2x2x2x1", help="comma-separated trees")
  ap.add_argument(
    "--contexts", default="37;121;250;301", help="';'-separated calls' context lengths, one per row (default one row)"
  )
  ap.add_argument("--loops", type=int, default=100)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", required=True)
  args = ap.parse_args(argv)
  try:
    args.tree_list = [(spec, tree_parents(spec, args.seed)) for spec in args.trees.split(",") if spec]
    args.context_pairs = [tuple(int(n) for n in pair.split(",")) for pair in args.contexts.split(";") if pair]
  except ValueError as e:
    ap.error(f"--trees/--contexts: {e}")
  if not args.tree_list or not args.context_pairs or any(min(p) < 1 for p in args.context_pairs):
    ap.error("--trees must name a tree and --contexts calls of lengths >= 1, such as 37;121 or 37,121;250,301")
  if args.kernels == "pallas" and not has_gpu():
    ap.error("--kernels pallas needs a GPU; use --kernels pallas_interpret on a CPU")
  return args


def tree_parents(spec: str, seed: int) -> list[int]:
  """The call's rows' parents: row 0 the root (the last accepted token, parent -1), then the drafts in
  topological order, each row's parent a row before it."""
  if spec.startswith("random"):
    n, d = (int(v) for v in spec[len("random") :].split("."))
    rng = np.random.default_rng(seed)
    parents, depth = [-1], [0]
    for i in range(1, n + 1):
      parent = int(rng.choice([j for j in range(i) if depth[j] < d]))
      parents.append(parent)
      depth.append(depth[parent] + 1)
    return parents
  tree = DraftTree(tuple(int(k) for k in spec.split("x")))
  return [-1] + [int(p) + 1 for p in tree.parents]


def ancestors(parents: list[int]) -> np.ndarray:
  """bool [T, T]: row i sees row j iff j is i or one of its ancestors (the library's `tree_ancestors`; the root,
  row 0, is its parent-less node)."""
  anc, _ = tree_ancestors(jnp.asarray([parents], jnp.int32), max_depth=len(parents))
  return np.asarray(anc[0])


def paths(anc: np.ndarray) -> list[list[int]]:
  """Each row's path from the root, from `ancestors`: [0, ..., i] for row i (its ancestors in order, then
  itself: a parent's row comes before its children's)."""
  return [np.flatnonzero(row).tolist() for row in anc]


def timed(fn, loops: int, repeats: int) -> float:
  """Median over `repeats` of the mean ms of `fn()` over `loops` calls (compiled first)."""
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(loops):
      out = fn()
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / loops * 1e3)
  return float(np.median(times))


def check_tree(model, parents, starts, s_len, rng, loops, repeats) -> dict:
  """One tree on a call of len(starts) rows, row r after a context of starts[r] tokens: each node's bits
  against one-token steps along its path, and the tree call's cost against a chain call's."""
  b, t = len(starts), len(parents)
  context = rng.integers(0, model.config.vocab_size, (b, max(starts))).astype(np.int32)
  ar = np.arange(max(starts))[None]
  pos = np.where(ar < np.asarray(starts)[:, None], ar, s_len)  # pads: nowhere
  _, cache = _CALL(model, jnp.asarray(context), jnp.asarray(pos, jnp.int32), model.init_cache(b, s_len))
  tokens = rng.integers(0, model.config.vocab_size, (b, t)).astype(np.int32)
  anc = ancestors(parents)
  node_paths = paths(anc)
  context_end = jnp.asarray(starts, jnp.int32)
  mask = tree_attention_mask(context_end, context_end, anc, s_len)
  tree_tokens = jnp.asarray(tokens)
  depth = np.asarray([len(p) - 1 for p in node_paths])
  node_pos = jnp.asarray(np.asarray(starts)[:, None] + depth[None], jnp.int32)
  node_slots = jnp.asarray(np.asarray(starts)[:, None] + np.arange(t)[None], jnp.int32)
  got, _ = _TREE(model, tree_tokens, node_pos, cache, node_slots, mask)
  got = np.asarray(got.astype(jnp.float32))
  flips, worst, differing = 0, 0.0, []
  for i, path in enumerate(node_paths):
    c = cache
    for k, j in enumerate(path):  # one-token steps along the path, both rows at once
      want, c = _CALL(
        model, jnp.asarray(tokens[:, j : j + 1]), jnp.asarray(np.asarray(starts)[:, None] + k, jnp.int32), c
      )
    want = np.asarray(want.astype(jnp.float32))[:, 0]
    if not np.array_equal(got[:, i], want):
      differing.append(i)
    flips += int(np.any(got[:, i].argmax(-1) != want.argmax(-1)))
    worst = max(worst, float(np.max(np.abs(got[:, i] - want))))
  tree_ms = timed(lambda: _TREE(model, tree_tokens, node_pos, cache, node_slots, mask), loops, repeats)
  # A chain of as many tokens: token j at position starts + j, the slots the tree's rows were written at.
  chain_ms = timed(lambda: _CALL(model, tree_tokens, node_slots, cache), loops, repeats)
  return {
    "contexts": list(starts),
    "rows_per_call": b * t,
    "nodes_same_bits": t - len(differing),
    "nodes": t,
    "differing_nodes": differing,
    "argmax_flips": flips,
    "max_abs_diff": worst,
    "tree_ms": tree_ms,
    "chain_ms": chain_ms,
    "tree_over_chain": tree_ms / chain_ms,
  }


def main(argv=None):
  args = parse_args(argv)
  from bench.step_profile import model_config, random_weights  # noqa: PLC0415
  from specdec_jax.models import Transformer  # noqa: PLC0415

  dtype = "bfloat16" if has_gpu() else "float32"
  c = model_config(args.model, args.tiny, dtype).replace(num_layers=args.layers, kernels=args.kernels)
  model = Transformer.from_weights(c, random_weights(c, jax.random.key(args.seed)))
  rng = np.random.default_rng(args.seed)
  s_len = max(max(p) for p in args.context_pairs) + max(len(p) for _, p in args.tree_list) + 16
  report = {"info": device_info(), "command": " ".join(sys.argv), "args": vars(args) | {"tree_list": None}, "rows": []}
  print(f"{args.model} x{args.layers} blocks, {dtype}, kernels={args.kernels}, cache {s_len} slots", flush=True)
  for spec, parents in args.tree_list:
    for starts in args.context_pairs:
      row = {"tree": spec, **check_tree(model, parents, starts, s_len, rng, args.loops, args.repeats)}
      report["rows"].append(row)
      print(
        f"{spec:12s} rows={row['rows_per_call']:2d} contexts {starts}: nodes with the steps' bits "
        f"{row['nodes_same_bits']}/{row['nodes']} (differ: {row['differing_nodes']}), argmax flips {row['argmax_flips']}, max |diff| "
        f"{row['max_abs_diff']:.3g}; tree {row['tree_ms']:.4f} ms, chain {row['chain_ms']:.4f} ms "
        f"({row['tree_over_chain']:.2f}x)",
        flush=True,
      )
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "tree_kernels.json"), "w") as f:
    json.dump(report, f, indent=1)
  print(f"wrote {args.out}/tree_kernels.json")


if __name__ == "__main__":
  main()
