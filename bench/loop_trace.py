"""SmolLM2 + the EAGLE head, T=1, B=1: plain and speculative decoding with and without `no_filters`, over compiles.

The same program timed after two compiles can differ by 5-15% on a GPU (bench/
RESULTS.md), more than many differences worth
measuring. So every program here is compiled `--compiles` times afresh
(`jax.clear_caches`), each compile timed with the programs interleaved
(`--repeats` calls, median), and the figure is the median over compiles. With
`--trace`, one call of each program is profiled: its costliest kernels and its
device-to-host copies per round.

Usage (GPU, the GGUF joined as for bench/smollm2.py):
    PYTHONPATH=.:/tmp/site python3 bench/loop_trace.py --out $OUT/loop --drafts 2,3x3x1x1 \
        --kernels xla,pallas --compiles 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402
from bench.smollm2 import B1_ORDER, build_prompts, encode, parse_tree  # noqa: E402
from bench.step_profile import kernel_table  # noqa: E402
from specdec_jax import SamplingParams  # noqa: E402
from specdec_jax.loop.decoding import generate, speculative_generate  # noqa: E402
from specdec_jax.models import load_smollm2, load_smollm2_eagle  # noqa: E402
from specdec_jax.models.loaders.smollm2 import SMOLLM2_EOS_IDS  # noqa: E402


def _programs(target, eagle, drafts, n, eos):
  """{name: fn(tokens, lengths, params, key)}: plain decoding and the head's drafts, each with and without
  no_filters. drafts: {label: K (a chain) or a DraftTree / DynamicTree}."""
  out = {}
  for nf in (False, True):
    tag = "no_filters" if nf else "default"
    out[f"plain/{tag}"] = lambda t, l, p, key, nf=nf: generate(
      target, t, l, p, key, max_new_tokens=n, eos_token_id=eos, no_filters=nf
    )
    for label, d in drafts.items():
      k, tree = (d, None) if isinstance(d, int) else (d.depth, d)
      out[f"eagle[{label}]/{tag}"] = lambda t, l, p, key, nf=nf, k=k, tree=tree: speculative_generate(
        target,
        eagle,
        t,
        l,
        p,
        key,
        max_new_tokens=n,
        num_speculative_tokens=k,
        eos_token_id=eos,
        draft_tree=tree,
        no_filters=nf,
      )
  return out


def plot(rows, path, title):
  """Bars: tokens/s of plain and EAGLE decoding, default against no_filters, per kernels and K."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  groups = [(r["kernels"], r["program"].split("/")[0]) for r in rows if r["program"].endswith("/default")]
  fig, ax = plt.subplots(figsize=(1.8 + 1.8 * len(groups), 4))
  width = 0.38
  for j, tag in enumerate(("default", "no_filters")):
    vals = [
      next(r["tok_s"] for r in rows if (r["kernels"], r["program"]) == (kern, f"{prog}/{tag}")) for kern, prog in groups
    ]
    bars = ax.bar([i + (j - 0.5) * width for i in range(len(groups))], vals, width, label=tag)
    ax.bar_label(bars, fmt="%.0f", fontsize=7)
  ax.set_xticks(range(len(groups)), [f"{kern}\n{prog}" for kern, prog in groups], fontsize=7)
  ax.set_ylabel("tokens/s (median over compiles)")
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=7, loc="upper left")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", required=True)
  ap.add_argument(
    "--drafts",
    default="2",
    help="comma list: K for a chain of K, or a tree as bench/smollm2.py names it (3x3x1x1, d4x3x30:sampled); default 2",
  )
  ap.add_argument("--kernels", default="xla,pallas", help="comma list of xla, pallas")
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--prompts", type=int, default=4, help="held-out prompts run one after another (B=1)")
  ap.add_argument("--repeats", type=int, default=5, help="timed calls per program and compile (median)")
  ap.add_argument("--compiles", type=int, default=3, help="fresh compiles of every program (jax.clear_caches)")
  ap.add_argument("--trace", help="profile one call of each program (first compile) into this directory")
  ap.add_argument("--plot-only", help="redraw the plot of an earlier loop_trace.json into --out, then stop")
  args = ap.parse_args(argv)
  if args.plot_only:
    with open(args.plot_only) as f:
      report = json.load(f)
    os.makedirs(args.out, exist_ok=True)
    plot(report["rows"], os.path.join(args.out, "loop_trace.png"), _title(report["info"]))
    return
  os.makedirs(args.out, exist_ok=True)
  prompts = build_prompts()
  rows = []
  for kern in args.kernels.split(","):
    target, tokenizer = load_smollm2(jnp.bfloat16, kernels=kern)
    eagle = load_smollm2_eagle(jnp.bfloat16, kernels=kern)
    names = B1_ORDER[: args.prompts]
    toks, lens = encode(tokenizer, [prompts[x] for x in names])
    calls = [(jnp.asarray(toks[i : i + 1]), jnp.asarray(lens[i : i + 1])) for i in range(len(names))]
    params, key = SamplingParams.create(jnp.ones((1,), jnp.float32)), jax.random.key(0)
    drafts = {x: (int(x) if x.isdigit() else parse_tree(x)) for x in args.drafts.split(",")}
    programs = _programs(target, eagle, drafts, args.max_new_tokens, SMOLLM2_EOS_IDS)
    run = lambda fn: [fn(t, l, params, key) for t, l in calls]
    medians = {name: [] for name in programs}
    outs = {}
    for c in range(args.compiles):
      jax.clear_caches()  # a fresh compile (and autotuning) of every program
      times = {name: [] for name in programs}
      for name, fn in programs.items():
        outs[name] = jax.block_until_ready(run(fn))
      for _ in range(args.repeats):  # interleaved: drift hits every program alike
        for name, fn in programs.items():
          t0 = time.perf_counter()
          jax.block_until_ready(run(fn))
          times[name].append(time.perf_counter() - t0)
      for name in programs:
        medians[name].append(statistics.median(times[name]))
      print(f"{kern} compile {c}: " + ", ".join(f"{n} {m[-1] * 1e3:.1f} ms" for n, m in medians.items()), flush=True)
    for name, fn in programs.items():
      tokens = sum(int(o.lengths.sum()) for o in outs[name])
      rounds = sum(int(o.stats.target_calls.sum()) - 1 for o in outs[name])  # the prefill is a target call too
      row = {
        "kernels": kern,
        "program": name,
        "median_s": statistics.median(medians[name]),
        "per_compile_s": medians[name],
        "tokens": tokens,
        "rounds": rounds,
      }
      row["tok_s"] = tokens / row["median_s"]
      row["us_per_round"] = row["median_s"] / rounds * 1e6
      row["mean_accepted_length"] = tokens / rounds if name.startswith("eagle") else None
      if args.trace:
        d = os.path.join(args.trace, f"{kern}_{name.replace('/', '_')}")
        with jax.profiler.trace(d, create_perfetto_trace=True):
          jax.block_until_ready(run(fn))
        row["kernels_top"] = kernel_table(d, rounds, top=30)
        row["d2h_per_round"] = sum(r["per_step"] for r in row["kernels_top"] if "D2H" in r["kernel"])
      rows.append(row)
    for r in rows:
      if r["kernels"] == kern and r["program"].startswith("eagle"):
        tag = r["program"].split("/")[1]
        plain = next(p for p in rows if p["kernels"] == kern and p["program"] == f"plain/{tag}")
        r["speedup"] = r["tok_s"] / plain["tok_s"]
        print(
          f"{kern} {r['program']:32s} {r['tok_s']:7.1f} tok/s (x{r['speedup']:.2f} plain {plain['tok_s']:.1f});"
          f" per-compile ms {[round(x * 1e3, 1) for x in r['per_compile_s']]}; D2H/round "
          f"{r.get('d2h_per_round', '-')}",
          flush=True,
        )
  info = {**common.device_info(), "xla_flags": os.environ.get("XLA_FLAGS", "")}
  with open(os.path.join(args.out, "loop_trace.json"), "w") as f:
    json.dump({"info": info, "config": vars(args), "rows": rows}, f, indent=1)
  plot(rows, os.path.join(args.out, "loop_trace.png"), _title(info))


def _title(info):
  return f"SmolLM2-135M + EAGLE head, T=1, B=1, bf16, {info.get('device')}: default vs no_filters"


if __name__ == "__main__":
  main()
