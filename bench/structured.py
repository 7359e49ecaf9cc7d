"""Structured output's cost and gain: constrained against unconstrained decoding, plain and speculative.

For a real target (`--model`, with its shipped EAGLE head and prompt lookup) and the JSON schema of
`examples/structured_output.py`, at each batch size of `--batch-sizes` (prompts: "describe the <language>
programming language as JSON", one language a row), it times, greedy:

  - plain `generate` without and with the grammar: the grammar's own cost (issue goal: within 10%);
  - `speculative_generate` with each drafter, without and with the grammar: the speed-up over plain
    decoding of the same kind (goal: the constrained speed-up at least the unconstrained one);

and checks that every constrained output follows the schema and that constrained speculative decoding
emits constrained plain decoding's tokens. Also the grammar's build time and table sizes. B=1 runs each
prompt alone (tokens and times summed over `--prompts-b1` prompts); a larger B runs one batch.

    PYTHONPATH=.:/tmp/site python3 bench/structured.py --out OUT          # GPU: the coder, bf16, Pallas
    PYTHONPATH=. python bench/structured.py --model smollm2 --batch-sizes 1 --max-new-tokens 48 \\
        --prompts-b1 1 --repeats 1 --out /tmp/st                          # CPU smoke run

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
  ap.add_argument("-k", type=int, default=4, help="drafts a round (default 4)")
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--out", required=True)
  args = ap.parse_args(argv)
  try:
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
  except ValueError:
    ap.error(f"--batch-sizes must be a comma list of ints, got {args.batch_sizes!r}")
  if not args.batch_sizes or not all(1 <= b <= len(LANGUAGES) for b in args.batch_sizes):
    ap.error(f"--batch-sizes must be in [1, {len(LANGUAGES)}], got {args.batch_sizes}")
  args.drafters = [d for d in args.drafters.split(",") if d]
  if set(args.drafters) - {"eagle", "lookup"}:
    ap.error(f"--drafters must be a comma list of eagle, lookup, got {args.drafters}")
  for flag, value in (("--prompts-b1", args.prompts_b1), ("-k", args.k), ("--repeats", args.repeats)):
    if value < 1:
      ap.error(f"{flag} must be >= 1, got {value}")
  if not 1 <= args.prompts_b1 <= len(LANGUAGES):
    ap.error(f"--prompts-b1 must be in [1, {len(LANGUAGES)}], got {args.prompts_b1}")
  if args.max_new_tokens < 16:
    ap.error(f"--max-new-tokens must be >= 16 (a JSON answer), got {args.max_new_tokens}")
  return args


def main(argv=None):
  args = parse_args(argv)
  ex = example_module()
  gpu = common.has_gpu()
  dtype = jnp.bfloat16 if gpu else jnp.float32
  kernels = args.kernels or ("pallas" if gpu else "xla")
  from specdec_jax import SamplingParams, TokenGrammar, generate, speculative_generate
  from specdec_jax.models.loaders.smollm2 import encode_prompts

  t0 = time.perf_counter()
  target, tokenizer, eos, unused, loaded, chat = ex.load(args.model, dtype, args.drafters, kernels)
  drafters = {{"EAGLE head": "eagle", "prompt lookup": "lookup"}[label]: d for label, d in loaded.items()}
  load_s = time.perf_counter() - t0
  v = target.config.vocab_size
  t0 = time.perf_counter()
  grammar = TokenGrammar.from_json_schema(
    ex.SCHEMA, tokenizer, eos_token_ids=eos, vocab_size=v, exclude_token_ids=unused
  )
  jax.block_until_ready(grammar.mask_table)
  report = {
    "info": common.device_info(),
    "model": args.model,
    "dtype": jnp.dtype(dtype).name,
    "kernels": kernels,
    "k": args.k,
    "max_new_tokens": args.max_new_tokens,
    "load_s": load_s,
    "grammar": {
      "build_s": time.perf_counter() - t0,
      "states": grammar.num_states,
      "distinct_masks": grammar.num_masks,
      "table_bytes": grammar.table_sizes(),
      "total_bytes": grammar.size_bytes(),
    },
    "schema": ex.SCHEMA,
    "rows": [],
  }
  print(f"{args.model} {report['dtype']} kernels={kernels}; grammar {json.dumps(report['grammar'])}")
  common_kw = dict(max_new_tokens=args.max_new_tokens, eos_token_id=eos, all_greedy=True)
  methods = {"plain": lambda t, n, p, g: generate(target, t, n, p, None, grammar=g, **common_kw)}
  for name, d in drafters.items():
    methods[name] = lambda t, n, p, g, d=d: speculative_generate(
      target, d, t, n, p, None, num_speculative_tokens=args.k, grammar=g, **common_kw
    )
  os.makedirs(args.out, exist_ok=True)
  for b in args.batch_sizes:
    groups = [LANGUAGES[i : i + 1] for i in range(args.prompts_b1)] if b == 1 else [LANGUAGES[:b]]
    plain_tokens = {}
    for name, fn in methods.items():
      for constrained in (False, True):
        outs, seconds, firsts = [], 0.0, 0.0
        for langs in groups:
          texts = [chat(ex.PROMPT.format(lang, ", ".join(ex.PARADIGMS))) for lang in langs]
          tokens, lengths = (jnp.asarray(a) for a in encode_prompts(tokenizer, texts))
          params = SamplingParams.create([0.0] * len(langs))
          g = grammar if constrained else None
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
          "grammar": constrained,
          "tokens_per_s": s["tokens"] / seconds,
          "seconds": seconds,
          "first_call_s": firsts,
          "mean_accepted_length": s["mean_accepted_length"],
          "tokens": s["tokens"],
          "valid": sum(map(ex.follows_schema, texts_out)) if constrained else None,
          "outputs": len(texts_out),
        }
        key = (constrained,)
        toks = [np.asarray(o.tokens) for o in outs]
        if name == "plain":
          plain_tokens[key] = toks
        else:
          row["same_as_plain"] = all(np.array_equal(a, c) for a, c in zip(toks, plain_tokens[key]))
        report["rows"].append(row)
        print(
          f"B={b:<2} {name:<7} grammar={str(constrained):<5} {row['tokens_per_s']:9.1f} tok/s  "
          f"mean_len {row['mean_accepted_length']:.2f}  valid {row['valid']}  same {row.get('same_as_plain', '-')}"
        )
  summarize(report)
  path = os.path.join(args.out, f"structured_{args.model}.json")
  with open(path, "w") as f:
    json.dump(report, f, indent=1)
  plot(report, os.path.join(args.out, f"structured_{args.model}.png"))
  print(f"wrote {path}")


def summarize(report) -> None:
  """The issue's two ratios per batch size: the grammar's cost on plain decoding, and each drafter's
  speed-up over plain decoding with and without the grammar."""
  by = {(r["batch_size"], r["method"], r["grammar"]): r["tokens_per_s"] for r in report["rows"]}
  summary = []
  for b in sorted({r["batch_size"] for r in report["rows"]}):
    entry = {"batch_size": b, "plain_constrained_over_unconstrained": by[(b, "plain", True)] / by[(b, "plain", False)]}
    for m in sorted({r["method"] for r in report["rows"]} - {"plain"}):
      entry[f"{m}_speedup"] = by[(b, m, False)] / by[(b, "plain", False)]
      entry[f"{m}_speedup_constrained"] = by[(b, m, True)] / by[(b, "plain", True)]
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
  fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 3.6), squeeze=False)
  for ax, b in zip(axes[0], sizes):
    rows = [r for r in report["rows"] if r["batch_size"] == b]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    x = np.arange(len(methods))
    for j, constrained in enumerate((False, True)):
      vals = [
        next(r["tokens_per_s"] for r in rows if r["method"] == m and r["grammar"] == constrained) for m in methods
      ]
      ax.bar(x + (j - 0.5) * 0.38, vals, 0.38, label="JSON schema" if constrained else "no grammar")
    ax.set_xticks(x, methods)
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{report['model']}, B={b}, greedy, K={report['k']}")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
