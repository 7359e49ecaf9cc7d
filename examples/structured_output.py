"""Structured output with speculative decoding: JSON that follows a schema, plain against speculative decoding.

The grammar (a JSON schema compiled by outlines-core into a token automaton,
`specdec_jax.TokenGrammar`) runs inside the decoding loop: each row carries its
automaton state, every token is drawn from the tokens its state allows, and a
speculative round walks the automaton along its drafts to mask each verified
position. Constrained speculative decoding stays lossless: greedily it emits
exactly the tokens of constrained plain decoding.

For each built-in prompt (describe a programming language as JSON) it runs
plain decoding without the grammar (the reference speed), plain decoding with
it, and speculative decoding with it for each drafter, then checks that every
constrained output parses and follows the schema and that the greedy outputs
are identical. `--model smollm2` (the default without a GPU) drafts with
prompt lookup and SmolLM2's EAGLE head; `--model qwen2.5-coder-1.5b` (the
default on a GPU) with the coder's EAGLE head and prompt lookup.

Usage:

    python examples/structured_output.py
    python examples/structured_output.py --model qwen2.5-coder-1.5b --max-tokens 128
    python examples/structured_output.py --drafter lookup --repeats 3 --whitespace compact

Needs `pip install -e ".[models,grammar]"` (outlines-core builds the automaton).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import SamplingParams, TokenGrammar, generate, speculative_generate
from specdec_jax.drafts.lookup import PromptLookupDrafter
from specdec_jax.sampling.masks import allowed_tokens

LANGUAGES = ("Python", "Rust", "Go")
PARADIGMS = ["object-oriented", "functional", "procedural", "concurrent", "generic", "imperative"]
SCHEMA = {
  "type": "object",
  "properties": {
    "name": {"type": "string"},
    "first_release_year": {"type": "integer"},
    "statically_typed": {"type": "boolean"},
    "paradigms": {"type": "array", "items": {"type": "string", "enum": PARADIGMS}, "maxItems": 3},
  },
  "required": ["name", "first_release_year", "statically_typed", "paradigms"],
}
# Between JSON tokens: the newlines and indentation of pretty-printed JSON, as the models write it unasked
# (bounded, so that no row can spend its tokens on whitespace), or outlines-core's default (None: a space at
# most). Pretty keeps the target on its own distribution, and with it the drafters' acceptance.
WHITESPACE = {"pretty": r"[\n ]{0,12}", "compact": None}
PROMPT = (
  "Describe the {} programming language as a JSON object with the fields name, first_release_year, "
  "statically_typed and paradigms (at most three of: {}). Answer with the JSON only."
)


def build_parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", choices=["smollm2", "qwen2.5-coder-1.5b"], default=None, help="default: coder on GPU")
  ap.add_argument("--drafter", default="lookup,eagle", help="comma list of lookup, eagle (default both)")
  ap.add_argument(
    "--whitespace", choices=list(WHITESPACE), default="pretty", help="between JSON tokens (default pretty)"
  )
  ap.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
  ap.add_argument("--max-tokens", type=int, default=96, help="new tokens at most (default 96)")
  ap.add_argument("--repeats", type=int, default=2, help="timed runs of each method (default 2)")
  ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: bf16 on GPU, else f32")
  return ap


def parse_args(argv=None) -> argparse.Namespace:
  """Checks every flag before anything is loaded (one line, exit code 2)."""
  ap = build_parser()
  args = ap.parse_args(argv)
  gpu = jax.default_backend() == "gpu"
  args.model = args.model or ("qwen2.5-coder-1.5b" if gpu else "smollm2")
  args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
  args.drafter = [d.strip() for d in args.drafter.split(",") if d.strip()]
  if not args.drafter or set(args.drafter) - {"lookup", "eagle"}:
    ap.error(f"--drafter must be a comma list of lookup, eagle; got {','.join(args.drafter)!r}")
  for flag, value, low in (("-k", args.num_speculative_tokens, 1), ("--max-tokens", args.max_tokens, 8)):
    if value < low:
      ap.error(f"{flag} must be >= {low}, got {value}")
  if args.repeats < 1:
    ap.error(f"--repeats must be >= 1, got {args.repeats}")
  return args


def load(model: str, dtype, drafter_names, kernels: str | None = None):
  """(target, tokenizer, EOS ids, ids no grammar may allow, {label: drafter}, chat_prompt).

  `kernels`: "xla" or "pallas"; None: Pallas for the coder on a GPU in bfloat16, XLA's blocks otherwise.
  """
  from specdec_jax import models
  from specdec_jax.models.loaders import qwen2_5_coder, smollm2
  from specdec_jax.models.loaders.gguf import read_gguf_tokenizer_metadata

  if kernels is None:
    gpu_bf16 = jax.default_backend() == "gpu" and dtype == jnp.bfloat16
    kernels = "pallas" if gpu_bf16 and model != "smollm2" else "xla"
  head = None
  if model == "smollm2":
    target, tokenizer = models.load_smollm2(dtype, kernels=kernels)
    path, eos, chat = smollm2.smollm2_gguf_path(), smollm2.SMOLLM2_EOS_IDS, smollm2.chat_prompt
    if "eagle" in drafter_names:
      head = models.load_smollm2_eagle(dtype, kernels=kernels)
  else:
    target, tokenizer = models.load_qwen2_5_coder(dtype, kernels=kernels)
    path, eos, chat = (
      qwen2_5_coder.fetch_qwen2_5_coder(),
      qwen2_5_coder.QWEN2_5_CODER_EOS_IDS,
      qwen2_5_coder.chat_prompt,
    )
    head = models.load_qwen2_5_coder_eagle(dtype, kernels=kernels) if "eagle" in drafter_names else None
  drafters = {}
  if "lookup" in drafter_names:
    drafters["prompt lookup"] = PromptLookupDrafter(ngram_size=(3, 2))
  if head is not None:
    drafters["EAGLE head"] = head
  unused = read_gguf_tokenizer_metadata(path).unused_token_ids
  return target, tokenizer, tuple(eos), unused, drafters, chat


def follows_schema(text: str) -> bool:
  """Whether `text` is one JSON object valid under SCHEMA (checked by hand: the schema is small)."""
  try:
    obj = json.loads(text)
  except json.JSONDecodeError:
    return False
  if not isinstance(obj, dict) or set(obj) - set(SCHEMA["properties"]) or set(SCHEMA["required"]) - set(obj):
    return False
  years, typed, paradigms = obj["first_release_year"], obj["statically_typed"], obj["paradigms"]
  return (
    isinstance(obj["name"], str)
    and isinstance(years, int)
    and not isinstance(years, bool)
    and isinstance(typed, bool)
    and isinstance(paradigms, list)
    and len(paradigms) <= 3
    and all(p in PARADIGMS for p in paradigms)
  )


def decoded(tokenizer, ids, eos) -> str:
  """A row's text, its closing EOS left out."""
  return tokenizer.decode([int(i) for i in ids if int(i) not in eos])


def run(fn, tokens, lengths, repeats):
  """(output of the compile call, median seconds of `repeats` timed calls)."""
  out = fn(tokens, lengths)
  jax.block_until_ready(out.tokens)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(tokens, lengths).tokens)
    times.append(time.perf_counter() - t0)
  return out, statistics.median(times)


def main(argv=None):
  args = parse_args(argv)
  dtype, k = jnp.dtype(args.dtype), args.num_speculative_tokens
  t0 = time.perf_counter()
  target, tokenizer, eos, unused, drafters, chat = load(args.model, dtype, args.drafter)
  v = target.config.vocab_size
  print(f"{args.model} ({args.dtype}) and {', '.join(drafters)} loaded in {time.perf_counter() - t0:.1f}s")

  t0 = time.perf_counter()
  grammar = TokenGrammar.from_json_schema(
    SCHEMA,
    tokenizer,
    whitespace_pattern=WHITESPACE[args.whitespace],
    eos_token_ids=eos,
    vocab_size=v,
    exclude_token_ids=unused,
  )
  compile_s = time.perf_counter() - t0
  first = int(jnp.sum(allowed_tokens(grammar.mask(grammar.initial_state()), v)))
  print(
    f"grammar: {grammar.num_states} states, {grammar.size_bytes() / 1e6:.2f} MB of device tables, "
    f"built in {compile_s:.2f}s ({args.whitespace} whitespace); {first} of {v} tokens may start the answer"
  )

  from specdec_jax.models.loaders.smollm2 import encode_prompts

  texts = [chat(PROMPT.format(lang, ", ".join(PARADIGMS))) for lang in LANGUAGES]
  tokens, lengths = (jnp.asarray(a) for a in encode_prompts(tokenizer, texts))
  params = SamplingParams.create([0.0] * len(texts))
  common = dict(max_new_tokens=args.max_tokens, eos_token_id=eos, all_greedy=True)
  methods = {"plain, no grammar": lambda t, n: generate(target, t, n, params, None, **common)}
  methods["plain"] = lambda t, n: generate(target, t, n, params, None, grammar=grammar, **common)
  for label, drafter in drafters.items():
    methods[label] = lambda t, n, d=drafter: speculative_generate(
      target, d, t, n, params, None, num_speculative_tokens=k, grammar=grammar, **common
    )
  results = {}
  for label, fn in methods.items():
    results[label] = run(fn, tokens, lengths, args.repeats)
    print(f"  ran {label}")

  plain_out = results["plain"][0]
  print(f"\n=== greedy, K={k}, up to {args.max_tokens} new tokens, {len(texts)} prompts in one batch")
  print(f"  {'method':<18} {'tokens/s':>9} {'vs plain':>9} {'accepted':>9}  valid  same as plain")
  base = None
  for label, (out, seconds) in results.items():
    n = np.asarray(out.lengths)
    rate = float(n.sum()) / seconds
    base = rate if label == "plain" else base
    texts_out = [decoded(tokenizer, np.asarray(out.tokens)[r, : n[r]], eos) for r in range(len(texts))]
    valid = "-" if label == "plain, no grammar" else f"{sum(map(follows_schema, texts_out))}/{len(texts)}"
    same = "-" if label.startswith("plain") else ("yes" if np.array_equal(out.tokens, plain_out.tokens) else "NO")
    mal = float(out.stats.mean_accepted_length) if label not in ("plain", "plain, no grammar") else 1.0
    results[label] = (out, seconds, rate, texts_out, valid, same, mal)
  for label, (_, _, rate, _, valid, same, mal) in results.items():
    print(f"  {label:<18} {rate:9.1f} {rate / base:8.2f}x {mal:9.2f}  {valid:>5}  {same}")
  print()
  for lang, text in zip(LANGUAGES, results["plain"][3]):
    print(f"  {lang}: {text}")
  constrained = [r for label, r in results.items() if label != "plain, no grammar"]
  if not all(r[4] == f"{len(texts)}/{len(texts)}" for r in constrained) or any(r[5] == "NO" for r in constrained):
    raise SystemExit("an output broke the schema or differed from plain decoding's")


if __name__ == "__main__":
  main()
