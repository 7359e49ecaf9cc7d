"""Tokens/s of `speculative_generate` against mean accepted length, acceptance forced (NOT LOSSLESS: timing only).

What: `specdec_jax.loop.forced.speculative_generate_forced`, the benchmark knob
that makes every round accept exactly `a` drafts (then the target's own token),
times the speculative loop at every accepted length a + 1 = 1 .. K+1 for a draft
kind and K, independently of how good the drafter is (vLLM's "synthetic"
acceptance). Each round does a real round's work: the drafter proposes K drafts
(or a tree), the target verifies all K+1 positions, the verifier runs. The
tokens are NOT samples of the target; only the times mean anything.

Models: random weights of the shape `--shape` names (bench/step_profile.py's
SHAPES: `smollm2`, SmolLM2-135M's, the default; `qwen2.5-coder-1.5b`), bf16 on a
GPU, float32 on a CPU, or with `--quick` a tiny model (V=512, L=2, D=64; K=2,
B=1).
Drafters (`--drafters`): `lookup` (`PromptLookupDrafter((3, 2))`), `model` (the
target's shape with `--draft-layers` layers, random weights) and `eagle`
(`EagleDrafter.for_target`, random weights, reading the target's layers
`--feature-layers`). `--tree-width M` also times the tree (M, 1, ..., 1) per K
(its first-child path is the one forced; prompt lookup's trees have this shape).

Grid: drafter x K (`--ks`) x a in 0..K x B (`--batch-sizes`); per (drafter, K,
B) also the real, unforced `speculative_generate` (the acceptance the random
drafter really gets) and per B plain `generate` (mean accepted length 1).
Prompts: P tokens per row, a random 16-token segment repeated; no EOS, so every
row emits exactly `--max-new-tokens` (121 = 1 + 120, and 120 is a multiple of
every a + 1 up to 6, so no forced round is cut; quick: 25). `--mode greedy` (`all_greedy=True`, the
default) or `t1` (temperature 1 on every row).

Measured: tokens/s = sum(lengths) / wall time of one whole jitted call, median
of `--repeats` calls after a compile call (`bench.common.time_call`,
`jax.block_until_ready`). The x axis is `DecodeStats.mean_accepted_length`
(tokens per target pass, the prefill counted as a pass), as real runs report it;
`tokens_per_round` (the prefill left out) is a + 1 exactly when no round is cut.

    PYTHONPATH=. python3 bench/forced_acceptance.py --quick             # CPU smoke run, < 1 min
    PYTHONPATH=. python3 bench/forced_acceptance.py --out $OUT          # GPU: smollm2 shape, K 2,4, B 1,8
    PYTHONPATH=. python3 bench/forced_acceptance.py --shape qwen2.5-coder-1.5b --ks 4 --batch-sizes 1 \\
      --drafters lookup,eagle --tree-width 2 --eagle-d-ff 4096 --eagle-draft-vocab 32768 --out $OUT

Writes OUT/forced_acceptance.json (every figure, the device, versions, date and
command line) and OUT/forced_acceptance.png (tokens/s against mean accepted
length, one panel per B, one line per drafter and K; real runs as stars, plain
`generate` dashed); the plot needs matplotlib (`pip install -e ".[bench]"`) and
is skipped with a message without it, or with --no-plot.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench import common  # noqa: E402
from bench.decode import FAST_CPU_XLA_FLAGS, enable_compilation_cache, fast_cpu_compiles, run_generation  # noqa: E402
from bench.step_profile import SHAPES  # noqa: E402
from specdec_jax.drafts.lookup import PromptLookupDrafter  # noqa: E402
from specdec_jax.loop.decoding import generate, speculative_generate  # noqa: E402
from specdec_jax.loop.forced import speculative_generate_forced  # noqa: E402
from specdec_jax.models import Transformer, TransformerConfig  # noqa: E402
from specdec_jax.models.eagle import EagleDrafter  # noqa: E402
from specdec_jax.sampling.params import SamplingParams  # noqa: E402

QUICK_SHAPE = dict(vocab_size=512, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16, d_ff=128)
LOOKUP_NGRAMS = (3, 2)
DRAFTERS = ("lookup", "model", "eagle")
SEGMENT = 16  # prompts repeat a random segment of this many tokens


def _ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x]


def parse_args(argv=None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--shape", choices=tuple(SHAPES), default="smollm2", help="the random target's shape")
  ap.add_argument("--drafters", default=",".join(DRAFTERS), help=f"comma-separated, of {DRAFTERS}")
  ap.add_argument("--ks", type=_ints, help="K values, e.g. 2,4 (default 2,4; quick 2)")
  ap.add_argument("--accepts", type=_ints, help="forced accepted counts (default every a in 0..K; > K skipped)")
  ap.add_argument("--batch-sizes", type=_ints, help="B values (default 1,8; quick 1)")
  ap.add_argument("--tree-width", type=int, default=1, help="M > 1: also the tree (M, 1, ..., 1) per K")
  ap.add_argument("--mode", choices=("greedy", "t1"), default="greedy", help="all_greedy=True, or T=1 on every row")
  ap.add_argument("--max-new-tokens", type=int, help="tokens per row (default 121; quick 25)")
  ap.add_argument("--prompt-len", type=int, help="P (default 64; quick 16)")
  ap.add_argument("--draft-layers", type=int, default=2, help="layers of the `model` drafter (default 2)")
  ap.add_argument("--feature-layers", type=_ints, help="target layers EAGLE reads (default first, middle, last)")
  ap.add_argument("--eagle-d-ff", type=int, default=0, help="the EAGLE head's MLP width (0 = the target's)")
  ap.add_argument(
    "--eagle-draft-vocab", type=int, default=0, help="the EAGLE head's draft vocabulary size (0 = the whole)"
  )
  ap.add_argument("--repeats", type=int, help="timed calls per configuration, median reported (default 5; quick 2)")
  ap.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: bfloat16 on GPU, float32 on CPU")
  ap.add_argument("--quick", action="store_true", help="tiny model, K=2, B=1, 25 tokens: a CPU smoke run")
  ap.add_argument("--keep-xla-opt", action="store_true", help="with --quick on a CPU: keep XLA's optimisation")
  ap.add_argument("--cache-dir", default="", help="JAX persistent compilation cache ('' = off, the default)")
  ap.add_argument("--no-plot", action="store_true", help="write no PNG")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument(
    "--out",
    default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"),
    help="output directory (default bench/out, git-ignored)",
  )
  args = ap.parse_args(argv)
  quick = args.quick
  args.ks = args.ks or ([2] if quick else [2, 4])
  args.batch_sizes = args.batch_sizes or ([1] if quick else [1, 8])
  # 1 + a multiple of every a + 1 up to 6 (quick: 4): no round is cut by the token limit, every forced round counts.
  args.max_new_tokens = args.max_new_tokens or (25 if quick else 121)
  args.prompt_len = args.prompt_len or (SEGMENT if quick else 64)
  args.repeats = args.repeats or (2 if quick else 5)
  args.drafters = [d for d in args.drafters.split(",") if d]
  bad = [d for d in args.drafters if d not in DRAFTERS]
  if bad:
    ap.error(f"--drafters: unknown {bad}; choose from {DRAFTERS}")
  if min(args.ks) < 1 or min(args.batch_sizes) < 1 or args.tree_width < 1 or args.repeats < 1:
    ap.error("--ks, --batch-sizes, --tree-width and --repeats must be >= 1")
  if args.accepts is not None and min(args.accepts) < 0:
    ap.error("--accepts must be >= 0")
  if args.max_new_tokens < 2 or args.prompt_len < 1 or args.draft_layers < 1:
    ap.error("--max-new-tokens must be >= 2, --prompt-len and --draft-layers >= 1")
  if args.eagle_d_ff < 0 or args.eagle_draft_vocab < 0:
    ap.error("--eagle-d-ff and --eagle-draft-vocab must be >= 0 (0: the target's)")
  args.dtype = args.dtype or ("bfloat16" if common.has_gpu() else "float32")
  return args


def target_config(args) -> TransformerConfig:
  """The target's config: `--shape` (or the quick shape), with the layers an EAGLE drafter reads."""
  shape = QUICK_SHAPE if args.quick else SHAPES[args.shape]
  n = shape["num_layers"]
  layers = tuple(args.feature_layers) if args.feature_layers else tuple(sorted({0, n // 2, n - 1}))
  return TransformerConfig(**shape, dtype=jnp.dtype(args.dtype), feature_layers=layers)


def build_drafters(args, target: Transformer) -> dict:
  """name -> drafter, random weights (acceptance is forced, so their quality does not matter)."""
  out = {}
  for name in args.drafters:
    if name == "lookup":
      out[name] = PromptLookupDrafter(LOOKUP_NGRAMS)
    elif name == "model":
      config = target.config.replace(num_layers=args.draft_layers, feature_layers=())
      out[name] = Transformer(config, rngs=nnx.Rngs(args.seed + 1))
    else:
      v = target.config.vocab_size
      vocab = None  # the head's draft vocabulary: any ids will do for timing
      if args.eagle_draft_vocab:
        vocab = np.random.default_rng(args.seed).permutation(v)[: args.eagle_draft_vocab]
      out[name] = EagleDrafter.for_target(
        target, draft_vocab=vocab, d_ff=args.eagle_d_ff or None, rngs=nnx.Rngs(args.seed + 2)
      )
  return out


def prompts(b: int, p: int, vocab: int, seed: int):
  """int32 [B, P] repeating a random segment (prompt lookup finds matches), lengths [B] = P."""
  rng = np.random.default_rng(seed + b)
  segment = rng.integers(0, vocab, (b, SEGMENT))
  tokens = np.tile(segment, (1, -(-p // SEGMENT)))[:, :p].astype(np.int32)
  return jnp.asarray(tokens), jnp.full((b,), p, jnp.int32)


def timed(fn, repeats: int) -> dict:
  """Compile call, then `repeats` timed calls (`bench.decode.run_generation`): median seconds, tokens/s and the
  stats of the compile call's output (every call computes the same)."""
  out, timing = run_generation(fn, repeats)
  s = timing["median_s"]
  st = jax.tree.map(np.asarray, out.stats)
  lengths, calls = np.asarray(out.lengths), st.target_calls
  rounds = int(calls.sum() - len(lengths))  # the prefill's pass is not a round
  return {
    "s": s,
    "times_s": timing["times_s"],
    "compile_s": timing["first_call_s"],
    "tokens": int(lengths.sum()),
    "tokens_per_s": float(lengths.sum()) / s,
    "mean_accepted_length": float(out.stats.mean_accepted_length),
    "tokens_per_round": float(lengths.sum() - len(lengths)) / rounds if rounds else None,
    "acceptance_rate": float(out.stats.acceptance_rate) if st.drafted.sum() else None,
    "accepted_per_position": st.accepted_per_position.tolist(),
  }


def configurations(args, drafters: dict):
  """(drafter name, K, tree or None, accepts or None for the real run): the grid, trees only where they run."""
  for name in drafters:
    for k in args.ks:
      trees = [None] + ([(args.tree_width,) + (1,) * (k - 1)] if args.tree_width > 1 else [])
      for tree in trees:
        accepts = [a for a in (args.accepts if args.accepts is not None else range(k + 1)) if a <= k]
        for a in [None, *accepts]:
          yield name, k, tree, a


def run(args, report: dict, save) -> None:
  """Times every configuration into `report["rows"]`, calling `save()` after each (a run cut short keeps its rows)."""
  config = target_config(args)
  report["target_config"] = str(config)
  t0 = time.perf_counter()
  target = Transformer(config, rngs=nnx.Rngs(args.seed))
  drafters = build_drafters(args, target)
  shape_name = "quick" if args.quick else args.shape
  print(f"target {shape_name} ({config.dtype.name}, L={config.num_layers}, V={config.vocab_size}); ", end="")
  print(f"drafters {list(drafters)} built in {time.perf_counter() - t0:.1f}s", flush=True)
  greedy = args.mode == "greedy"
  rows = report["rows"]
  for b in args.batch_sizes:
    tokens, lengths = prompts(b, args.prompt_len, config.vocab_size, args.seed)
    params = SamplingParams.greedy(b) if greedy else SamplingParams.create([1.0] * b)
    key = None if greedy else jax.random.key(args.seed)
    common_kw = dict(max_new_tokens=args.max_new_tokens, all_greedy=greedy)
    row = {"kind": "generate", "drafter": None, "k": None, "tree": None, "accepts": None, "b": b}
    row.update(timed(lambda: generate(target, tokens, lengths, params, key, **common_kw), args.repeats))
    rows.append(row)
    _print_row(row)
    save()
    for name, k, tree, a in configurations(args, drafters):
      kw = dict(common_kw, num_speculative_tokens=k, draft_tree=tree)
      draft = drafters[name]
      if a is None:
        kind, fn = "real", lambda: speculative_generate(target, draft, tokens, lengths, params, key, **kw)
      else:
        kind = "forced"
        fn = lambda: speculative_generate_forced(  # noqa: E731
          target, draft, tokens, lengths, params, key, forced_accepts=a, **kw
        )
      row = {"kind": kind, "drafter": name, "k": k, "tree": list(tree) if tree else None, "accepts": a, "b": b}
      row.update(timed(fn, args.repeats))
      rows.append(row)
      _print_row(row)
      save()


def _print_row(r: dict) -> None:
  what = (
    "generate"
    if r["kind"] == "generate"
    else f"{r['drafter']} K={r['k']}" + (f" tree={r['tree']}" if r["tree"] else "")
  )
  a = "real" if r["kind"] == "real" else ("-" if r["accepts"] is None else f"a={r['accepts']}")
  print(
    f"  B={r['b']:<4d} {what:28s} {a:6s} {r['tokens_per_s']:10.1f} tok/s  mean_len {r['mean_accepted_length']:5.2f}  "
    f"{r['s'] * 1e3:8.1f} ms  (compile {r['compile_s']:.1f}s)",
    flush=True,
  )


def plot(report: dict, path: str) -> str | None:
  """tokens/s against mean accepted length: one panel per B, a line per (drafter, K, tree); None without matplotlib."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib is not installed: no plot written (pip install -e '.[bench]')")
    return None
  rows = report["rows"]
  bs = sorted({r["b"] for r in rows})
  fig, axes = plt.subplots(1, len(bs), figsize=(5.5 * len(bs), 4.2), squeeze=False)
  for ax, b in zip(axes[0], bs):
    at_b = [r for r in rows if r["b"] == b]
    for r in at_b:
      if r["kind"] == "generate":
        ax.axhline(r["tokens_per_s"], color="gray", linestyle="--", label="generate")
    lines = sorted({(r["drafter"], r["k"], tuple(r["tree"] or ())) for r in at_b if r["kind"] != "generate"})
    for i, (name, k, tree) in enumerate(lines):
      color = f"C{i % 10}"
      label = f"{name} K={k}" + (f" tree {tree}" if tree else "")
      same = [r for r in at_b if (r["drafter"], r["k"], tuple(r["tree"] or ())) == (name, k, tree)]
      forced = sorted((r for r in same if r["kind"] == "forced"), key=lambda r: r["accepts"])
      ax.plot(
        [r["mean_accepted_length"] for r in forced], [r["tokens_per_s"] for r in forced], "o-", color=color, label=label
      )
      for r in (r for r in same if r["kind"] == "real"):
        ax.plot(r["mean_accepted_length"], r["tokens_per_s"], "*", color=color, markersize=12)
    ax.set_title(f"B={b}")
    ax.set_xlabel("mean accepted length (tokens per target pass)")
    ax.set_ylabel("tokens/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  info = report["info"]
  shape = "quick" if report["config"]["quick"] else report["config"]["shape"]
  fig.suptitle(  # two lines: one panel is too narrow for the whole title on one
    f"forced acceptance (not lossless; stars: real acceptance)\n{shape}, {report['config']['dtype']}, "
    f"{report['config']['mode']}, {info['device']}",
    fontsize=9,
  )
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def main(argv=None) -> dict:
  fast = fast_cpu_compiles(argv)  # before anything touches a device
  args = parse_args(argv)
  if fast:
    print(f"--quick on CPU: XLA_FLAGS += {FAST_CPU_XLA_FLAGS} (compile-bound smoke run; --keep-xla-opt to keep it)")
  enable_compilation_cache(args.cache_dir)
  os.makedirs(args.out, exist_ok=True)
  info = common.device_info()
  info["xla_flags"] = os.environ.get("XLA_FLAGS", "")
  print(f"{info['device']} ({info['platform']}), jax {info['jax']}, python {info['python']}", flush=True)
  report = {
    "info": info,
    "command": " ".join(["python", "bench/forced_acceptance.py", *(sys.argv[1:] if argv is None else argv)]),
    "config": dict(vars(args)),
    "rows": [],
  }
  path = os.path.join(args.out, "forced_acceptance.json")
  t0 = time.perf_counter()

  def save():
    report["elapsed_s"] = time.perf_counter() - t0
    with open(path, "w") as f:
      json.dump(report, f, indent=1)

  run(args, report, save)
  print(f"wrote {path} ({report['elapsed_s']:.0f} s)")
  if not args.no_plot:
    png = plot(report, os.path.join(args.out, "forced_acceptance.png"))
    if png:
      print(f"wrote {png}")
  return report


if __name__ == "__main__":
  main()
