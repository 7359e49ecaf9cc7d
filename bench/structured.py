"""Structured output's cost and gain: constrained against unconstrained decoding, plain and speculative.

For a real target (`--model`, with its shipped EAGLE head and prompt lookup) and the JSON schema of
`examples/structured_output.py`, with one grammar per `--whitespace` form ("compact": outlines-core's
default, at most a space between JSON tokens; "pretty": newlines and indentation, as the model writes JSON
when unconstrained), at each batch size of `--batch-sizes` (prompts: "describe the <language> programming
language as JSON", one language a row), all greedy:

  - speed: plain `generate` and `speculative_generate` with each drafter, without and with each grammar,
    each run to its natural end (EOS, or the grammar's). Issue goal: each drafter's speed-up over plain
    decoding with a grammar at least its speed-up without one. The texts differ (free text against JSON),
    so only ratios within one grammar are compared.
  - cost: plain `generate` with no EOS for exactly `--cost-steps` m1 and m2 new tokens, without a grammar,
    with a one-state grammar that allows every token (the machinery alone) and with each JSON grammar: the
    time per step is the slope (t(m2) - t(m1)) / (m2 - m1), free of the call's fixed costs, over the same
    number of steps each way, and the m2-token calls' tokens/s (steadier: the slope takes two calls'
    noise). Issue goal: constrained plain decoding within 10% of unconstrained plain decoding.

and checks that every constrained output follows the schema and that constrained speculative decoding
emits constrained plain decoding's tokens. Also the grammars' build times and table sizes. B=1 runs each
prompt alone (tokens and times summed over `--prompts-b1` prompts); a larger B runs one batch.
`--profile` also writes a Perfetto trace of a plain and an EAGLE call at B=1, without and with the
compact grammar.

    PYTHONPATH=.:/tmp/site python3 bench/structured.py --out OUT          # GPU: the coder, bf16, Pallas
    PYTHONPATH=. python bench/structured.py --model smollm2 --batch-sizes 1 --max-new-tokens 48 \\
        --prompts-b1 1 --repeats 1 --cost-steps 4,8 --out /tmp/st         # CPU smoke run

Writes OUT/structured_<model>.json and OUT/structured_<model>.png (tokens/s bars, needs matplotlib).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from bench.decode import run_generation, stats_summary  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LANGUAGES = ("Python", "Rust", "Go", "Java", "C", "Haskell", "Kotlin", "Ruby")


def example_module():
  """examples/structured_output.py (its schema, prompt and schema check), loaded by path."""
  path = os.path.join(REPO, "examples", "structured_output.py")
  spec = importlib.util.spec_from_file_location("structured_output_example", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", choices=["smollm2", "qwen2.5-coder-1.5b"], default="qwen2.5-coder-1.5b")
  ap.add_argument("--kernels", choices=["xla", "pallas"], default=None, help="default: pallas on a GPU in bf16")
  ap.add_argument("--batch-sizes", default="1,8", help=f"comma list, each <= {len(LANGUAGES)} (default 1,8)")
  ap.add_argument("--prompts-b1", type=int, default=3, help="prompts run one at a time at B=1 (default 3)")
  ap.add_argument("--drafters", default="eagle,lookup", help="comma list of eagle, lookup")
  ap.add_argument("--whitespace", default="compact,pretty", help="comma list of compact, pretty (default both)")
  ap.add_argument("-k", type=int, default=4, help="drafts a round (default 4)")
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--cost-steps", default="8,24", help="m1,m2: the cost section's two lengths (default 8,24)")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--sections", default="speed,cost", help="comma list of speed, cost (default both)")
  ap.add_argument("--profile", action="store_true", help="also trace the B=1 calls (Perfetto) under OUT/profile")
  ap.add_argument("--out", required=True)
  args = ap.parse_args(argv)
  try:
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.cost_steps = [int(m) for m in args.cost_steps.split(",")]
  except ValueError:
    ap.error(
      f"--batch-sizes and --cost-steps must be comma lists of ints, got {args.batch_sizes!r}, {args.cost_steps!r}"
    )
  if not args.batch_sizes or not all(1 <= b <= len(LANGUAGES) for b in args.batch_sizes):
    ap.error(f"--batch-sizes must be in [1, {len(LANGUAGES)}], got {args.batch_sizes}")
  if len(args.cost_steps) != 2 or not 1 <= args.cost_steps[0] < args.cost_steps[1]:
    ap.error(f"--cost-steps must be two lengths 1 <= m1 < m2, got {args.cost_steps}")
  args.drafters = [d for d in args.drafters.split(",") if d]
  if set(args.drafters) - {"eagle", "lookup"}:
    ap.error(f"--drafters must be a comma list of eagle, lookup, got {args.drafters}")
  args.sections = [x for x in args.sections.split(",") if x]
  if not args.sections or set(args.sections) - {"speed", "cost"}:
    ap.error(f"--sections must be a comma list of speed, cost, got {args.sections}")
  args.whitespace = [w for w in args.whitespace.split(",") if w]
  if not args.whitespace or set(args.whitespace) - {"compact", "pretty"}:
    ap.error(f"--whitespace must be a comma list of compact, pretty, got {args.whitespace}")
  for flag, value in (("--prompts-b1", args.prompts_b1), ("-k", args.k), ("--repeats", args.repeats)):
    if value < 1:
      ap.error(f"{flag} must be >= 1, got {value}")
  if not 1 <= args.prompts_b1 <= len(LANGUAGES):
    ap.error(f"--prompts-b1 must be in [1, {len(LANGUAGES)}], got {args.prompts_b1}")
  if args.max_new_tokens < 16:
    ap.error(f"--max-new-tokens must be >= 16 (a JSON answer), got {args.max_new_tokens}")
  return args


def build_grammars(ex, args, tokenizer, eos, v, unused):
  """({name: TokenGrammar}, {name: its build time, sizes}): "json" (compact) and/or "json_pretty", and "any"
  (one state allowing every token but the unused ones: what carrying a grammar costs, with no constraint)."""
  from specdec_jax import TokenGrammar

  grammars, info = {}, {}
  for form in args.whitespace:
    name = "json" if form == "compact" else f"json_{form}"
    t0 = time.perf_counter()
    g = TokenGrammar.from_json_schema(
      ex.SCHEMA,
      tokenizer,
      whitespace_pattern=ex.WHITESPACE[form],
      eos_token_ids=eos,
      vocab_size=v,
      exclude_token_ids=unused,
    )
    jax.block_until_ready(g.mask_table)
    grammars[name] = g
    info[name] = {"whitespace_pattern": ex.WHITESPACE[form], "build_s": time.perf_counter() - t0}
  tokens = np.setdiff1d(np.arange(v), np.asarray(list(unused) + list(eos), np.int64))
  grammars["any"] = TokenGrammar.from_tables(
    np.zeros_like(tokens), tokens, np.zeros_like(tokens), [True], vocab_size=v, eos_token_ids=eos
  )
  info["any"] = {"whitespace_pattern": None, "build_s": None}
  for name, g in grammars.items():
    info[name].update(
      states=g.num_states, distinct_masks=g.num_masks, table_bytes=g.table_sizes(), total_bytes=g.size_bytes()
    )
  return grammars, info


def main(argv=None):
  args = parse_args(argv)
  ex = example_module()
  gpu = common.has_gpu()
  dtype = jnp.bfloat16 if gpu else jnp.float32
  kernels = args.kernels or ("pallas" if gpu else "xla")
  from specdec_jax import SamplingParams, generate, speculative_generate
  from specdec_jax.models.loaders.smollm2 import encode_prompts

  t0 = time.perf_counter()
  target, tokenizer, eos, unused, loaded, chat = ex.load(args.model, dtype, args.drafters, kernels)
  drafters = {{"EAGLE head": "eagle", "prompt lookup": "lookup"}[label]: d for label, d in loaded.items()}
  load_s = time.perf_counter() - t0
  grammars, grammar_info = build_grammars(ex, args, tokenizer, eos, target.config.vocab_size, unused)
  report = {
    "info": common.device_info(),
    "model": args.model,
    "dtype": jnp.dtype(dtype).name,
    "kernels": kernels,
    "k": args.k,
    "max_new_tokens": args.max_new_tokens,
    "load_s": load_s,
    "grammars": grammar_info,
    "schema": ex.SCHEMA,
    "rows": [],
    "cost": [],
  }
  for name, info in grammar_info.items():
    print(f"grammar {name}: {json.dumps(info)}")

  def batch(langs):
    texts = [chat(ex.PROMPT.format(lang, ", ".join(ex.PARADIGMS))) for lang in langs]
    tokens, lengths = (jnp.asarray(a) for a in encode_prompts(tokenizer, texts))
    return tokens, lengths, SamplingParams.create([0.0] * len(langs))

  def plain(m, eos_ids):
    return lambda t, n, p, g: generate(
      target, t, n, p, None, grammar=g, max_new_tokens=m, eos_token_id=eos_ids, all_greedy=True
    )

  common_kw = dict(max_new_tokens=args.max_new_tokens, eos_token_id=eos, all_greedy=True)
  methods = {"plain": plain(args.max_new_tokens, eos)}
  for name, d in drafters.items():
    methods[name] = lambda t, n, p, g, d=d: speculative_generate(
      target, d, t, n, p, None, num_speculative_tokens=args.k, grammar=g, **common_kw
    )
  speed_grammars = [None] + [n for n in grammars if n != "any"]
  os.makedirs(args.out, exist_ok=True)
  for b in args.batch_sizes:
    groups = [LANGUAGES[i : i + 1] for i in range(args.prompts_b1)] if b == 1 else [LANGUAGES[:b]]
    plain_tokens = {}
    for name, fn in methods.items() if "speed" in args.sections else ():
      for gname in speed_grammars:
        outs, seconds, firsts = [], 0.0, 0.0
        for langs in groups:
          tokens, lengths, params = batch(langs)
          g = None if gname is None else grammars[gname]
          out, timing = run_generation(lambda: fn(tokens, lengths, params, g), args.repeats)
          outs.append(out)
          seconds += timing["median_s"]
          firsts += timing["first_call_s"]
        s = stats_summary(outs)
        texts_out = [
          ex.decoded(tokenizer, np.asarray(o.tokens)[r, : int(o.lengths[r])], eos)
          for o in outs
          for r in range(o.tokens.shape[0])
        ]
        row = {
          "batch_size": b,
          "method": name,
          "grammar": gname,
          "tokens_per_s": s["tokens"] / seconds,
          "seconds": seconds,
          "first_call_s": firsts,
          "mean_accepted_length": s["mean_accepted_length"],
          "tokens": s["tokens"],
          "valid": None if gname is None else sum(map(ex.follows_schema, texts_out)),
          "outputs": len(texts_out),
          "example_output": texts_out[0],
        }
        toks = [np.asarray(o.tokens) for o in outs]
        if name == "plain":
          plain_tokens[gname] = toks
        else:
          row["same_as_plain"] = all(np.array_equal(a, c) for a, c in zip(toks, plain_tokens[gname]))
        report["rows"].append(row)
        print(
          f"B={b:<2} {name:<7} grammar={str(gname):<12} {row['tokens_per_s']:9.1f} tok/s  {row['tokens']:5d} tokens  "
          f"mean_len {row['mean_accepted_length']:.2f}  valid {row['valid']}  same {row.get('same_as_plain', '-')}"
        )
    tokens, lengths, params = batch(groups[0])
    for gname in [None] + list(grammars) if "cost" in args.sections else ():
      g = None if gname is None else grammars[gname]
      entry = {"batch_size": b, "grammar": gname, "steps": args.cost_steps, "seconds": [], "lengths": []}
      for m in args.cost_steps:
        out, timing = run_generation(lambda: plain(m, None)(tokens, lengths, params, g), args.repeats + 2)
        entry["seconds"].append(timing["median_s"])
        entry["lengths"].append(np.asarray(out.lengths).tolist())
      (m1, m2), (t1, t2) = args.cost_steps, entry["seconds"]
      entry["step_ms"] = 1e3 * (t2 - t1) / (m2 - m1)
      # Only a row that ran every step measures the same work as the unconstrained row.
      entry["every_row_ran_m2"] = all(n == m2 for n in entry["lengths"][1])
      report["cost"].append(entry)
      print(
        f"B={b:<2} cost grammar={str(gname):<12} step {entry['step_ms']:.3f} ms  (ran m2: {entry['every_row_ran_m2']})"
      )
  if args.profile:
    write_profiles(args, methods, batch, grammars)
  summarize(report)
  path = os.path.join(args.out, f"structured_{args.model}.json")
  with open(path, "w") as f:
    json.dump(report, f, indent=1)
  plot(report, os.path.join(args.out, f"structured_{args.model}.png"))
  print(f"wrote {path}")


def write_profiles(args, methods, batch, grammars) -> None:
  """A Perfetto trace of one warm B=1 call of plain decoding and the EAGLE head, without and with the compact grammar (the device
  kernels and their times: where a grammar's step cost goes)."""
  tokens, lengths, params = batch(LANGUAGES[:1])
  for name, fn in methods.items():
    for gname in (None, "json"):
      if name == "lookup" or (gname is not None and gname not in grammars):
        continue
      g = None if gname is None else grammars[gname]
      jax.block_until_ready(fn(tokens, lengths, params, g))
      folder = os.path.join(args.out, "profile", f"{name}_{gname or 'none'}")
      with jax.profiler.trace(folder, create_perfetto_trace=True):
        jax.block_until_ready(fn(tokens, lengths, params, g))
  print(f"wrote {os.path.join(args.out, 'profile')}")


def summarize(report) -> None:
  """The issue's ratios per batch size: each JSON grammar's step against the unconstrained step (the cost
  section), and each drafter's speed-up over plain decoding without and with each grammar."""
  by = {(r["batch_size"], r["method"], r["grammar"]): r["tokens_per_s"] for r in report["rows"]}
  step = {(c["batch_size"], c["grammar"]): c["step_ms"] for c in report["cost"]}
  call = {(c["batch_size"], c["grammar"]): c["seconds"][1] for c in report["cost"]}
  grammars = list(dict.fromkeys(r["grammar"] for r in report["rows"]))
  summary = []
  for b in sorted({r["batch_size"] for r in report["rows"] + report["cost"]}):
    entry = {"batch_size": b}
    for g in [c["grammar"] for c in report["cost"] if c["batch_size"] == b and c["grammar"] is not None]:
      entry[f"step_{g}_over_unconstrained"] = step[(b, g)] / step[(b, None)]
      # The m2-token call's tokens/s against the unconstrained call's: steadier than the slope, which two
      # calls' noise moves.
      entry[f"tokens_per_s_{g}_over_unconstrained"] = call[(b, None)] / call[(b, g)]
    for m in sorted({r["method"] for r in report["rows"]} - {"plain"}):
      for g in grammars:
        entry[f"{m}_speedup_{g or 'unconstrained'}"] = by[(b, m, g)] / by[(b, "plain", g)]
    summary.append(entry)
    print("  " + "  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in entry.items()))
  report["summary"] = summary


def plot(report, path) -> None:
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("(no matplotlib: no plot)")
    return
  sizes = sorted({r["batch_size"] for r in report["rows"]})
  if not sizes:  # the cost section alone: nothing to plot
    return
  grammars = list(dict.fromkeys(r["grammar"] for r in report["rows"]))
  fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 3.8), squeeze=False)
  width = 0.8 / len(grammars)
  for ax, b in zip(axes[0], sizes):
    rows = [r for r in report["rows"] if r["batch_size"] == b]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    x = np.arange(len(methods))
    for j, g in enumerate(grammars):
      vals = [next(r["tokens_per_s"] for r in rows if r["method"] == m and r["grammar"] == g) for m in methods]
      ax.bar(x + (j - (len(grammars) - 1) / 2) * width, vals, width, label=g or "no grammar")
    ax.set_xticks(x, methods)
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{report['model']}, B={b}, greedy, K={report['k']}")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
