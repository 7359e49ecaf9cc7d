"""Trains an EAGLE-style head for a target: SmolLM2-135M-Instruct (the shipped `smollm2_eagle`, the default) or
Qwen2.5-Coder-1.5B-Instruct (`--target qwen2.5-coder-1.5b`, read by `load_qwen2_5_coder_eagle`).

The head reads the target's features (outputs of blocks 2, 15 and 27) and the
next token, and predicts the token after it (`specdec_jax.models.EagleDrafter`).
Everything it learns from is what the target itself says and computes:

1. **Data.** The target continues offline prompts (chat questions:
   templates x topics, `--more-prompts` for more; `--code-questions`: questions
   about documented functions of this Python's standard library;
   `--self-questions`: questions the target writes itself about the topics;
   code: function heads from the standard library, completed raw; "repeat
   this text" requests built from stdlib docstrings), greedily and at T=1
   (several samples each, `--samples`), with `specdec_jax.generate`.
   Held-out: every 20th prompt.
2. **Draft vocabulary.** The `--draft-vocab` most frequent tokens of those
   continuations (EOS included): the head scores only them, which makes a
   draft step cheap on a CPU, and the report gives their coverage.
3. **Training-time test** (EAGLE-3). Each step runs the target (no gradient)
   on a batch of whole sequences for its features and logits, then the head
   unrolled `--depth` steps on its own hiddens
   (`EagleDrafter.unrolled_logits`, which attends exactly as the decoding loop
   does), with a soft cross-entropy to the target's next-token distribution
   (restricted to the draft vocabulary) at every depth, on generated tokens
   only. AdamW with warm-up and cosine decay, gradient clipping, a fixed seed.
   `--drafter block` trains a `BlockDrafter` (K = `--block-size` drafts from one
   call) on the same data instead: each step puts `--blocks-per-row` blocks in
   every sequence (`BlockDrafter.block_logits`: the context up to a random point
   of the generated text, then K-1 placeholders) and scores each block
   position's logits against the target's law of that token; `--init` starts
   its backbone from an EAGLE head's file. The report's "depths" are then the
   block's positions.
4. **Report.** Teacher-forced agreement on the held-out continuations at every
   depth: `top1` = the head's argmax equals the target's (what greedy
   acceptance needs), `1-TV` = sum_v min(p_v, q_v) at T=1.

The shipped head (2 blocks, draft vocabulary 8192) was made on one H100 (JAX
0.11.2) in 18 minutes: 4148 prompts (the code prompts come from the running
Python's standard library, 3.12 there), 15 continuations each, 12.2 M
generated tokens in 218 s, then 8826 training steps of a 9000-step schedule in
816 s. It took two 10-minute commands (the second resumed the first with
`--data-cache` and `--state`, see below); in one go the same head is

    python examples/train_eagle.py --more-prompts --code-questions 6 --code-files 400 --code-per-file 6 \
        --self-questions 8 --samples 0,1,1,1,1,1,1,1,1,1,1,0.7,0.7,0.7,0.7 --gen-batch 1024 \
        --steps 9000 --stop-at-step 8826 --b1 0 --weight-decay 1e-4 \
        --out specdec_jax/weights/smollm2_eagle.safetensors

`--b1 0 --weight-decay 1e-4` reproduce an accident. Until 2026-11-25 the script
called `optax.adamw(schedule, 0.0)`, meaning weight decay 0, but optax's second
positional argument is b1. So both shipped heads trained without
first-moment momentum and with optax's default weight decay. The defaults are
now AdamW's usual b1 = 0.9 and weight decay 0. Continuing the shipped head for
2050 steps with them gained only 0.5-1.0 points of held-out agreement
(bench/archive/RESULTS_HISTORY.md, "Continued training with momentum"), so the shipped head stays.

(its `.json` records the commands as run, data size, times and held-out
figures). Without the data flags the script makes the first, smaller head
(953 prompts, 1.2 M tokens: `--steps 5000 --stop-at-step 3979 --b1 0 --weight-decay 1e-4`).

Continued training starts from a head instead of random weights, with a fresh
schedule (`--init specdec_jax/weights/smollm2_eagle.safetensors`).
`--top1-weight W` adds W times the cross-entropy of the target's argmax to each
depth's loss, since greedy rows accept only the argmax.

A long run fits the lent GPU's 10-minute commands by spanning several runs:
`--data-cache` keeps the generated data and `--state` the training state
(weights, optimiser, step, data order) between them, and the result is the same
as one uninterrupted run (checked on a CPU). `--wall-limit-s` ends each command
in time (data generation included); a command that stops before the schedule's
end saves the state and writes no report or head (the one that ends it does;
the head's JSON lists every command and the steps it ran). The shipped head's
two commands were the one above with `--stop-at-step` replaced by

    --wall-limit-s 520 --data-cache /root/eagle/data.npz --state /root/eagle/state.msgpack

On the lent GPU, copy the head to `$OUT` in parts in the same command (e.g.
`split -b 9M`): the 17 MB head is over the 16 MiB a file may be to come back,
and the machine does not wait long for a second command.

A smoke run on a CPU: `python examples/train_eagle.py --quick --out /tmp/eagle.safetensors`.

**The coder target** (`--target qwen2.5-coder-1.5b`) changes the defaults: a head
of 1 block with a 4096-wide MLP (the target's is 8960), a 32768-token draft
vocabulary, 16 sequences a step, int8 storage (per-column scales; the report
also measures float16), and prompts from examples/coder_prompts.py: functions
to implement from their docstrings, raw completions of standard-library
functions, edits and refactors, tests, and chat questions on the same topics
and everyday ones (the benchmark's prompts in held_out_prompts.json left out),
continued greedily and at T=1 four times (`--samples 0,1,1,1,1`), up to 384
prompt tokens. On a large vocabulary the prefill's logits ([B, width, V]
float32) limit a generate call, so prompts go into width buckets of 96, 192
and 384 tokens, with at most `--prefill-tokens` prompt tokens a call.

`--more-questions` appends 275 general-knowledge questions (comparisons, how
things work, why things happen, ideas: the prose the shipped head agreed with
least; kind "question", reported with chat), after the other prompts, so the
data made without them extends; `--kind-weights question=4` draws their rows
four times as often in training. `--self-questions N` asks the coder itself
for N questions (T=0.8) about each of `coder_prompts.self_question_topics()`
(about 260 general topics) and appends the ones that name none of the
benchmark's subjects, kind "question", after those.

`--devices N` trains data parallel on the first N devices: every device holds
the target and the head, each batch's `--batch-size` sequences are split over
them, and the gradients are summed across them, so a step of N devices and N
times the batch takes about the time one device takes for one batch. The
result is the head one device would train with the same batch, to rounding
(checked on two CPU devices).

The data are saved compressed (prompt ids once, continuations ragged; 22 MB
for 18.7 M generated tokens). Generation is resumable: with `--data-cache D`
and `--wall-limit-s`, finished batches go to D.partial.npz every minute and
when the time is up, and the same command continues them. A finished D copied
to E.partial.npz and run with `--data-cache E` and more `--samples` (the old
list a prefix) keeps its continuations and generates only the new ones. On a
machine of several GPUs, `--data-shard I/N` lets N processes (one a GPU:
`CUDA_VISIBLE_DEVICES=I`) generate the data together: each generates the
continuations of prompts I, I+N, ... into D.shardIofN.partial.npz, and the
same command without `--data-shard` then joins the files into D. With
`--self-questions`, start one process first: the questions it writes go to
D.questions.json, which the others read (bench/coder_head_round.sh does this). The
coder's data (one H200, 2026-11-27: 17,473 prompts, 87,365 continuations,
18,677,220 generated tokens, about 11 minutes over two commands) came from

    python examples/train_eagle.py --target qwen2.5-coder-1.5b --data-cache /root/eagle/data.npz \
        --data-only --prefill-tokens 65536 --wall-limit-s 555
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import math
import os
import sys
import sysconfig
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, serialization
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from specdec_jax import SamplingParams, generate
from specdec_jax.models.block import BlockDrafter
from specdec_jax.models.eagle import EagleDrafter
from specdec_jax.models.loaders import eagle_files, qwen2_5_coder, smollm2

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import coder_prompts  # noqa: E402  (the coder target's prompts)
from train_draft import CHAT_QUESTIONS, TEMPLATES, TOPICS  # noqa: E402  (the draft model's prompt lists)

MORE_TEMPLATES = [
  "Can you tell me about {t}?",
  "Write a list of five questions a student might ask about {t}.",
  "What is a common misconception about {t}?",
  "Describe {t} in one paragraph for a newspaper.",
]


# --more-prompts: more topics and requests (off for the shipped head, so its command reproduces it).
EXTRA_TOPICS = [
  "the Industrial Revolution",
  "photosynthesis in the ocean",
  "the history of the bicycle",
  "rain forests",
  "the stock exchange",
  "volunteering",
  "first aid",
  "the solar system",
  "electricity at home",
  "bees and flowers",
  "ancient Egypt",
  "the Olympic Games",
  "cloud computing",
  "password security",
  "composting",
  "chess openings",
  "knitting",
  "the history of jazz",
  "deserts",
  "glaciers",
  "the human brain",
  "nutrition labels",
  "podcasts",
  "public libraries",
  "city planning",
  "trains",
  "airplanes",
  "submarines",
  "the Silk Road",
  "vaccination history",
  "the periodic table",
  "probability",
  "prime numbers",
  "linear regression",
  "spreadsheets",
  "touch typing",
  "writing a resume",
  "negotiation",
  "saving money",
  "learning to swim",
  "yoga",
  "running shoes",
  "board games",
  "origami",
  "photography",
  "film editing",
  "birdwatching",
  "coral reefs",
  "whales",
  "wolves",
  "mushrooms",
  "volcanic islands",
  "the water supply",
  "recycling plastic",
  "wind turbines",
  "batteries",
  "3D printing",
  "open source software",
  "the command line",
  "regular expressions",
]
EXTRA_TEMPLATES = [
  "Write step-by-step instructions related to {t}.",
  "Explain {t} using an analogy.",
  "What would a beginner need to know about {t}?",
  "Write a short dialogue between two friends about {t}.",
]


def code_prompts(max_files: int, per_file: int, rng) -> list[str]:
  """Raw-completion prompts from top-level stdlib modules: a few lines of context ending at a `def` line.

  (bench/smollm2.py's held-out code prompts come from stdlib sub-packages.)
  """
  files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
  prompts = []
  for path in files[:max_files]:
    with open(path, encoding="utf-8", errors="replace") as f:
      lines = f.read().splitlines()
    defs = [i for i, line in enumerate(lines) if line.lstrip().startswith("def ")]
    for i in rng.permutation(defs)[:per_file]:
      prompts.append("\n".join(lines[max(0, i - 8) : i + 1]) + "\n")
  return prompts


def repeat_prompts(max_files: int, rng) -> list[str]:
  """Chat requests to repeat or lightly rewrite a paragraph (a module docstring of the stdlib)."""
  files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
  asks = [
    "Repeat the following text exactly:",
    "Rewrite the following text in plain English:",
    "Copy this paragraph, then summarise it in one sentence:",
  ]
  prompts = []
  for n, path in enumerate(files[:max_files]):
    try:
      with open(path, encoding="utf-8", errors="replace") as f:
        doc = ast.get_docstring(ast.parse(f.read()))
    except (SyntaxError, ValueError):
      continue
    if doc and 80 <= len(doc) <= 800:
      prompts.append(smollm2.chat_prompt(f"{asks[n % len(asks)]}\n\n{doc.strip()}"))
  return prompts


CODE_QUESTION_TEMPLATES = [
  "Write a Python function `{name}` that does this: {summary}",
  "In Python's `{module}` module, what does `{name}` do? Give an example.",
  'Explain this line from Python\'s documentation in simple words: "{summary}"',
  "How can I use `{module}.{name}` in my own code?",
]
# Held-out benchmark prompts must not be trained on: bench/smollm2.py asks how to read a CSV file.
CODE_QUESTION_SKIP = ("csv.py",)


def code_questions(max_files: int, per_file: int, rng) -> list[str]:
  """Chat questions about public functions of top-level stdlib modules, from the first line of their docstrings.

  (Free-form programming questions, worded by the templates above; bench/smollm2.py's held-out code prompts are
  raw completions from stdlib sub-packages.)
  """
  files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
  prompts = []
  for path in files[:max_files]:
    if os.path.basename(path) in CODE_QUESTION_SKIP or os.path.basename(path).startswith("_"):
      continue
    try:
      with open(path, encoding="utf-8", errors="replace") as f:
        tree = ast.parse(f.read())
    except (SyntaxError, ValueError):
      continue
    found = []
    for node in ast.walk(tree):
      if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
        doc = ast.get_docstring(node)
        summary = doc.strip().split("\n")[0].strip() if doc else ""
        if 20 <= len(summary) <= 200:
          found.append((node.name, summary))
    module = os.path.splitext(os.path.basename(path))[0]
    for n, i in enumerate(rng.permutation(len(found))[:per_file]):
      name, summary = found[i]
      tpl = CODE_QUESTION_TEMPLATES[(len(prompts) + n) % len(CODE_QUESTION_TEMPLATES)]
      prompts.append(smollm2.chat_prompt(tpl.format(name=name, module=module, summary=summary)))
  return prompts


SELF_QUESTION_ASK = (
  "Write one question that a curious person might ask an AI assistant about {t}. Reply with the question only."
)


def self_questions(
  target, tokenizer, topics, *, samples, seed, batch_size, chat=smollm2.chat_prompt, eos=smollm2.SMOLLM2_EOS_IDS
) -> list[str]:
  """Questions the target itself writes about each topic (T=0.8, `samples` per topic), as chat prompts
  (`chat(text)`: the target's chat template), sorted, the benchmark's prompts left out.

  Self-instruct in miniature: the assistant's own wording of questions widens the chat prompts beyond the
  templates above. Only answers that end in a question mark on their first line are kept.

  Example:
    >>> self_questions(target, tokenizer, ["tea"], samples=2, seed=0, batch_size=8)
    ['<|im_start|>system ... What is the best way to brew green tea?<|im_end|>\n<|im_start|>assistant\n']
  """
  asks = [chat(SELF_QUESTION_ASK.format(t=t)) for t in topics for _ in range(samples)]
  ids = [tokenizer.encode(a).ids for a in asks]
  questions = []
  for start in tqdm(range(0, len(asks), batch_size), desc="self-written questions"):
    chunk = ids[start : start + batch_size]
    gen, n = generate_padded(
      target,
      chunk,
      [0.8] * len(chunk),
      width=max(map(len, ids)),
      batch_size=batch_size,
      key=jax.random.key(seed + 7919 + start),
      max_new_tokens=48,
      eos=eos,
    )
    for r in range(len(chunk)):
      text = tokenizer.decode(gen[r, : n[r]].tolist()).strip().split("\n")[0].strip().strip('"')
      if 15 <= len(text) <= 200 and text.endswith("?"):
        questions.append(text)
  with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "held_out_prompts.json")) as f:
    held_out = set(json.load(f)["questions"])  # the benchmark's prompts stay held out
  unique = sorted({q for q in questions if q not in held_out})
  return [chat(q) for q in unique]


def all_prompts(
  quick: bool,
  seed: int,
  more: bool = False,
  code_questions_per_file: int = 0,
  extra: list[str] | None = None,
  code_files: int = 60,
  code_per_file: int = 3,
) -> list[str]:
  rng = np.random.default_rng(seed)
  chats = [smollm2.chat_prompt(q) for q in CHAT_QUESTIONS]
  chats += [smollm2.chat_prompt(tpl.format(t=t)) for t in TOPICS for tpl in TEMPLATES + MORE_TEMPLATES]
  if more:
    chats += [smollm2.chat_prompt(tpl.format(t=t)) for t in TOPICS + EXTRA_TOPICS for tpl in EXTRA_TEMPLATES]
    chats += [smollm2.chat_prompt(tpl.format(t=t)) for t in EXTRA_TOPICS for tpl in TEMPLATES + MORE_TEMPLATES]
  prompts = chats + code_prompts(code_files if not quick else 2, code_per_file, rng)
  prompts += repeat_prompts(400 if not quick else 20, rng)
  if code_questions_per_file:  # drawn after the lists above, so those stay what they were without the flag
    prompts += code_questions(400 if not quick else 20, code_questions_per_file, rng)
  prompts += list(extra or [])
  prompts = [prompts[i] for i in rng.permutation(len(prompts))]
  return prompts[:8] if quick else prompts


def generate_padded(target, id_rows, temperatures, *, width, batch_size, key, max_new_tokens, eos):
  """`generate` on up to batch_size prompts, right-padded to [batch_size, width] (the last row repeated), so every
  call has one shape and one compiled program. Returns NumPy (tokens, lengths) of the real rows."""
  pad = batch_size - len(id_rows)
  id_rows, temperatures = list(id_rows) + [id_rows[-1]] * pad, list(temperatures) + [temperatures[-1]] * pad
  x = np.zeros((batch_size, width), np.int32)
  for r, row in enumerate(id_rows):
    x[r, : len(row)] = row
  out = generate(
    target,
    jnp.asarray(x),
    jnp.asarray([len(r) for r in id_rows], jnp.int32),
    SamplingParams.create(temperatures),
    key,
    max_new_tokens=max_new_tokens,
    eos_token_id=eos,
  )
  real = batch_size - pad
  return np.asarray(out.tokens)[:real], np.asarray(out.lengths)[:real]


# ---------------------------------------------------------------------------- targets


class Target(NamedTuple):
  """What the script needs of a target model, and its defaults."""

  name: str
  file: str  # recorded in the head's JSON
  vocab_size: int
  eos: tuple[int, ...]
  load: Callable  # dtype -> (model, tokenizer); the model's feature_layers are the head's
  chat: Callable[[str], str]
  load_head: Callable  # (dtype, path) -> EagleDrafter
  defaults: dict


TARGETS = {
  "smollm2": Target(
    name="smollm2",
    file=smollm2.SMOLLM2_GGUF_FILE,
    vocab_size=49152,
    eos=smollm2.SMOLLM2_EOS_IDS,
    load=smollm2.load_smollm2,
    chat=smollm2.chat_prompt,
    load_head=lambda dtype, path: smollm2.load_smollm2_eagle(dtype, path=path),
    defaults={
      "out": "specdec_jax/weights/smollm2_eagle.safetensors",
      "num_layers": 2,
      "draft_vocab": 8192,
      "head_d_ff": 0,
      "samples": "0,1,1,1,1,0.7,0.7",
      "prompt_len": 128,
      "gen_batch": 256,
      "prefill_tokens": 0,
      "batch_size": 32,
      "storage_dtype": "float16",
      "eval_rows": 0,
    },
  ),
  "qwen2.5-coder-1.5b": Target(
    name="qwen2.5-coder-1.5b",
    file=qwen2_5_coder.QWEN2_5_CODER_FILE,
    vocab_size=151936,
    eos=qwen2_5_coder.QWEN2_5_CODER_EOS_IDS,
    load=lambda dtype: qwen2_5_coder.load_qwen2_5_coder(dtype),
    chat=qwen2_5_coder.chat_prompt,
    load_head=lambda dtype, path: qwen2_5_coder.load_qwen2_5_coder_eagle(dtype, path=path),
    defaults={
      "out": "specdec_jax/weights/qwen2_5_coder_eagle.safetensors",
      "num_layers": 1,
      "draft_vocab": 32768,
      "head_d_ff": 4096,
      "samples": "0,1,1,1,1",
      "prompt_len": 384,
      "gen_batch": 512,
      "prefill_tokens": 32768,
      "batch_size": 16,
      "storage_dtype": "int8",
      "eval_rows": 1024,
    },
  ),
}
CODE_KINDS = ("implement", "complete", "edit", "tests")


def written_questions(spec: Target, args, tokenizer, target, topics, drop=lambda q: False) -> list[str]:
  """--self-questions: `self_questions` about `topics` (the first 4 with --quick) in the target's chat template,
  less those `drop` names; prints how many were kept and a few. With --data-cache D they are kept in
  D.questions.json and read from there by later runs, so that the processes of `--data-shard` (and a run that
  joins them) share one list of prompts."""
  cache = args.data_cache + ".questions.json" if args.data_cache else ""
  if cache and os.path.isfile(cache):
    with open(cache) as f:
      written = json.load(f)
    print(f"self-written questions: read {len(written)} from {cache}")
  else:
    written = self_questions(
      target,
      tokenizer,
      topics[:4] if args.quick else topics,
      samples=args.self_questions,
      seed=args.seed,
      batch_size=args.gen_batch,
      chat=spec.chat,
      eos=spec.eos,
    )
    if cache:
      os.makedirs(os.path.dirname(os.path.abspath(cache)), exist_ok=True)
      with open(cache + ".tmp", "w") as f:
        json.dump(written, f)
      os.replace(cache + ".tmp", cache)
  kept = [q for q in written if not drop(q)]
  shown = [q.split("user\n")[-1].split("<|im_end|>")[0] for q in kept[:3]]
  print(f"self-written questions: {len(kept)} kept of {len(written)}, e.g. " + " | ".join(shown))
  return kept


def target_prompts(spec: Target, args, tokenizer, target) -> tuple[list[str], list[str]]:
  """(prompts, kinds) for the target: SmolLM2's chat and code lists, or the coder's (examples/coder_prompts.py)."""
  if spec.name == "qwen2.5-coder-1.5b":
    pairs = coder_prompts.coder_prompts(spec.chat, seed=args.seed, max_functions=12 if args.quick else 0)
    pairs = pairs[:8] if args.quick else pairs
    if args.more_questions:  # appended: data made without them is a prefix of the data with them
      pairs += coder_prompts.general_questions(spec.chat)[: 4 if args.quick else None]
    if args.self_questions:  # appended after those, for the same reason
      topics = coder_prompts.self_question_topics()
      kept = written_questions(spec, args, tokenizer, target, topics, drop=coder_prompts.about_the_benchmark)
      pairs += [("question", q) for q in kept]
    return [p for _, p in pairs], [k for k, _ in pairs]
  extra = []
  if args.self_questions:
    extra = written_questions(spec, args, tokenizer, target, TOPICS + EXTRA_TOPICS if args.more_prompts else TOPICS)
  prompts = all_prompts(
    args.quick,
    args.seed,
    more=args.more_prompts,
    code_questions_per_file=args.code_questions,
    extra=extra,
    code_files=args.code_files,
    code_per_file=args.code_per_file,
  )
  return prompts, ["chat" if p.startswith("<|im_start|>") else "complete" for p in prompts]


# ---------------------------------------------------------------------------- data


BUCKET_WIDTHS = (96, 192, 384, 768)


def loss_weights(depth: int, decay: float) -> list[float]:
  """The weights of the depths' (or block positions') losses, summing to 1: exp(-j / decay), or equal for 0.

  Example:
    >>> [round(w, 3) for w in loss_weights(3, 0.0)], [round(w, 3) for w in loss_weights(3, 1.0)]
    ([0.333, 0.333, 0.333], [0.665, 0.245, 0.09])
  """
  raw = [math.exp(-j / decay) if decay > 0 else 1.0 for j in range(depth)]
  return [w / sum(raw) for w in raw]


def block_target_logits(logits: jax.Array, ends: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """The target's logits of each block's k drafts: (float [B, NB, k, V], their positions int32 [B, NB, k]).

  Block c's draft j is the token at c+1+j, whose law is the target's logits at position c+j. A block near the
  sequence's end reaches past it; the caller masks those positions, and the gather is clamped to the last
  position because an out-of-bounds gather fills with NaN, which a zero weight does not cancel.
  """
  at = ends[:, :, None] + jnp.arange(k, dtype=ends.dtype)[None, None, :]
  inside = jnp.minimum(at, logits.shape[1] - 1).reshape(at.shape[0], -1)
  t_all = jnp.take_along_axis(logits, inside[..., None], axis=1)
  return t_all.reshape(at.shape + logits.shape[-1:]), at


def generation_batches(p_lens, samples, *, prompt_len, batch_size, prefill_tokens, done=None):
  """The continuations (prompt index, temperature) in batches: (first job index, job indices, width, batch size).

  Without `prefill_tokens` every batch has width `prompt_len` and `batch_size` rows (the shipped SmolLM2 head's
  data). With it, prompts go into a few width buckets and a batch holds at most `prefill_tokens` prompt tokens:
  the prefill's logits ([B, width, V] float32) are what limit a batch on a large vocabulary. Jobs marked in
  `done` ([jobs] bool) are left out: a run cut off after its first batches gets the same remaining batches (and
  keys), and a run extended with more samples generates only the new ones.
  """
  jobs = np.arange(len(p_lens) * len(samples))
  if done is not None:
    jobs = jobs[~done]
  if not prefill_tokens:
    return [(int(jobs[s]), jobs[s : s + batch_size], prompt_len, batch_size) for s in range(0, len(jobs), batch_size)]
  widths = [w for w in BUCKET_WIDTHS if w < prompt_len] + [prompt_len]
  job_width = np.asarray([next(w for w in widths if p_lens[j // len(samples)] <= w) for j in jobs])
  out = []
  for w in widths:
    mine = jobs[job_width == w]
    b = max(1, min(batch_size, prefill_tokens // w))
    out += [(int(mine[s]), mine[s : s + b], w, b) for s in range(0, len(mine), b)]
  return out


def save_data(path, data: dict) -> None:
  """The generated data, compressed and ragged (prompt ids once per prompt, generated ids per continuation)."""
  tmp = path + ".tmp.npz"
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  np.savez_compressed(tmp, **data)
  os.replace(tmp, path)


def padded_data(data: dict, prompt_len: int, gen_tokens: int):
  """[N, prompt_len + gen_tokens] right-padded tokens, prompt lengths, lengths, prompt index of the finished jobs."""
  done = np.flatnonzero(data["job_done"])
  p_off, g_off = data["prompt_offsets"], data["gen_offsets"]
  tokens = np.zeros((len(done), prompt_len + gen_tokens), np.int32)
  p_lens, lens = np.zeros(len(done), np.int32), np.zeros(len(done), np.int32)
  prompt_of = data["job_prompt"][done]
  for r, j in enumerate(done):
    i = prompt_of[r]
    prompt = data["prompt_ids"][p_off[i] : p_off[i + 1]]
    gen = data["gen_ids"][g_off[j] : g_off[j + 1]]
    tokens[r, : len(prompt)] = prompt
    tokens[r, len(prompt) : len(prompt) + len(gen)] = gen
    p_lens[r], lens[r] = len(prompt), len(prompt) + len(gen)
  return tokens, p_lens, lens, prompt_of


def generate_data(target, spec, prompt_ids, kinds, samples, args, *, deadline, partial_path, resume=(), shard=None):
  """Target continuations of every prompt at every temperature of `samples`, resumable.

  Returns the data dict (see `save_data`), complete or not (`job_done`): with a `partial_path`, finished batches are
  saved there every minute and when `deadline` (a time.time()) passes, and a later run continues from them (and
  from the other partial files in `resume`, such as the shards' of `--data-shard`). `shard` (i, n): generate only
  the continuations of prompts i, i + n, i + 2n, ... (their batches, and so their keys, are not an unsharded
  run's).
  """
  n_jobs = len(prompt_ids) * len(samples)
  p_lens = np.asarray([len(p) for p in prompt_ids])
  data = {
    "prompt_ids": np.concatenate(prompt_ids).astype(np.int32),
    "prompt_offsets": np.concatenate([[0], np.cumsum(p_lens)]).astype(np.int64),
    "kinds": np.asarray(kinds),
    "job_prompt": np.repeat(np.arange(len(prompt_ids)), len(samples)),
    "job_temperature": np.tile(np.asarray(samples, np.float32), len(prompt_ids)),
    "job_done": np.zeros(n_jobs, bool),
    "gen_ids": np.zeros(0, np.int32),
    "gen_offsets": np.zeros(n_jobs + 1, np.int64),
  }
  gen = [np.zeros(0, np.int32)] * n_jobs
  for path in dict.fromkeys(p for p in (partial_path, *resume) if p and os.path.isfile(p)):
    with np.load(path) as old:
      # Its prompts may be the first of these (more prompts appended) and its --samples a prefix of these: its
      # continuations keep their place, the new ones are generated.
      old_p_off = old["prompt_offsets"]
      n_old = len(old_p_off) - 1
      same = n_old <= len(prompt_ids) and np.array_equal(old_p_off, data["prompt_offsets"][: n_old + 1])
      if not (same and np.array_equal(old["prompt_ids"], data["prompt_ids"][: old_p_off[-1]])):
        raise SystemExit(f"{path} was made from other prompts; delete it to start again")
      old_done, old_temps = old["job_done"], old["job_temperature"]
      per_prompt = len(old_done) // max(n_old, 1)
      if per_prompt * n_old != len(old_done) or list(old_temps[:per_prompt]) != list(samples[:per_prompt]):
        raise SystemExit(f"{path} was made with --samples {old_temps[:per_prompt].tolist()}, not a prefix of {samples}")
      old_ids, old_offsets = old["gen_ids"], old["gen_offsets"]  # an NpzFile reads a key anew at each access
      for j_old in np.flatnonzero(old_done):
        i, t = divmod(int(j_old), per_prompt)
        j = i * len(samples) + t
        data["job_done"][j] = True
        gen[j] = old_ids[old_offsets[j_old] : old_offsets[j_old + 1]]
    print(f"data: resumed {path}: {int(data['job_done'].sum())} of {n_jobs} continuations done")

  def pack():
    lengths = np.asarray([len(g) for g in gen])
    data["gen_offsets"] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    data["gen_ids"] = np.concatenate(gen).astype(np.int32) if n_jobs else np.zeros(0, np.int32)
    return data

  batches = generation_batches(
    p_lens,
    samples,
    prompt_len=args.prompt_len,
    batch_size=args.gen_batch,
    prefill_tokens=args.prefill_tokens,
    # A shard takes the prompts i, i + n, ...: its jobs do not depend on what the other shards have done.
    done=data["job_done"] if shard is None else data["job_done"] | (data["job_prompt"] % shard[1] != shard[0]),
  )
  last_save = time.time()
  for first, jobs, width, b in tqdm(batches, desc="target continuations", mininterval=10):
    if deadline and time.time() > deadline:
      break
    rows, temps = data["job_prompt"][jobs], data["job_temperature"][jobs]
    tokens, n = generate_padded(
      target,
      [prompt_ids[i] for i in rows],
      temps.tolist(),
      width=width,
      batch_size=b,
      key=jax.random.key(args.seed + first),
      max_new_tokens=args.gen_tokens,
      eos=spec.eos,
    )
    for r, j in enumerate(jobs):
      gen[j] = tokens[r, : n[r]].astype(np.int32)
    data["job_done"][jobs] = True
    if partial_path and time.time() - last_save > 60:
      save_data(partial_path, pack())
      last_save = time.time()
  pack()
  if partial_path and not data["job_done"].all():
    save_data(partial_path, data)
  return data


def draft_vocabulary(tokens, p_lens, lens, size, must_have) -> np.ndarray:
  """The `size` most frequent generated tokens (plus `must_have`), sorted ids."""
  counts = np.zeros(int(tokens.max()) + 1, np.int64)
  for row, pl, n in zip(tokens, p_lens, lens):
    np.add.at(counts, row[pl:n], 1)
  order = [int(t) for t in np.argsort(-counts, kind="stable") if t not in must_have]
  return np.sort(np.asarray(list(must_have) + order[: size - len(must_have)], np.int32))


def parse_shard(text: str) -> tuple[int, int]:
  """ "1/4" -> (1, 4); argparse's error for anything but I/N with 0 <= I < N."""
  i, _, n = text.partition("/")
  try:
    shard = int(i), int(n)
  except ValueError:
    shard = (-1, 0)
  if not 0 <= shard[0] < shard[1]:
    raise argparse.ArgumentTypeError(f"a shard is I/N with 0 <= I < N, e.g. 0/4; got {text!r}")
  return shard


def parse_kind_weights(text: str) -> dict[str, float]:
  """ "question=4,chat=2" -> {"question": 4.0, "chat": 2.0}; ValueError naming the bad entry."""
  out = {}
  for item in (x for x in text.split(",") if x):
    kind, _, value = item.partition("=")
    try:
      weight = float(value)
    except ValueError:
      weight = -1.0
    if not kind or not (math.isfinite(weight) and weight > 0):
      raise ValueError(f"--kind-weights: {item!r} is not KIND=WEIGHT with a weight > 0")
    out[kind] = weight
  return out


def kind_probabilities(kinds, weights: dict[str, float]):
  """Each training row's probability of being drawn, its kind's weight (1 if unnamed) over the total; None
  without weights (uniform draws, as before the option). SystemExit if a named kind has no row."""
  if not weights:
    return None
  present = set(kinds.tolist())
  missing = sorted(set(weights) - present)
  if missing:
    raise SystemExit(f"--kind-weights: no training rows of kind {missing} (kinds: {sorted(present)})")
  w = np.asarray([weights.get(k, 1.0) for k in kinds.tolist()], np.float64)
  return w / w.sum()


def save_state(path, drafter, optimizer, rng, step, history, commands, init_report=None) -> None:
  """Everything a run needs to continue exactly: weights, optimiser, next step, the data order's RNG, history,
  the commands of the runs so far and the --init head's held-out report (the head's JSON records them all)."""
  arrays = {
    "drafter": nnx.to_pure_dict(nnx.state(drafter, nnx.Param)),
    "optimizer": nnx.to_pure_dict(nnx.state(optimizer)),
  }
  state = {
    **jax.tree.map(np.asarray, arrays),
    "step": step,
    "rng": json.dumps(rng.bit_generator.state),
    "history": json.dumps(history),
    "commands": json.dumps(commands),
    "init_report": json.dumps(init_report),
  }
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(serialization.msgpack_serialize(state))
  os.replace(tmp, path)


def load_state(path, drafter, optimizer, rng) -> tuple[int, list, list, dict | None]:
  """Restores `save_state`'s file into drafter, optimizer and rng (in place); returns (next step, history,
  the earlier runs' commands, the --init head's report made by the first run or None)."""
  with open(path, "rb") as f:
    state = serialization.msgpack_restore(f.read())
  params = nnx.state(drafter, nnx.Param)
  nnx.replace_by_pure_dict(params, state["drafter"])
  nnx.update(drafter, params)
  opt = nnx.state(optimizer)
  nnx.replace_by_pure_dict(opt, state["optimizer"])
  nnx.update(optimizer, opt)
  rng.bit_generator.state = json.loads(state["rng"])
  return (
    int(state["step"]),
    json.loads(state["history"]),
    json.loads(state.get("commands", "[]")),
    json.loads(state.get("init_report", "null")),
  )


def build_drafter(target, *, num_layers, d_ff, vocab, seed, target_rows=None) -> EagleDrafter:
  """An untrained float32 head for `target` (`EagleDrafter.for_target` with dtype float32), holding `target_rows`
  = (embedding, head rows) [V, D] each when given, else float32 copies of the target's own (for a bf16 target: its
  bf16 values, which is what the head sees at inference on a GPU)."""
  drafter = EagleDrafter.for_target(
    target, num_layers=num_layers, draft_vocab=vocab, d_ff=d_ff or None, dtype=jnp.float32, rngs=nnx.Rngs(seed)
  )
  if target_rows is not None:
    drafter.set_target_weights(*target_rows, vocab)
  return drafter


def grow_head(init: EagleDrafter, extra: int, build: Callable[[int], EagleDrafter]) -> EagleDrafter:
  """`init` with `extra` blocks after its own: `build(n)` makes an n-block head of init's shape and draft
  vocabulary; init's weights go in, and the new blocks' output projections (attention's `wo`, the MLP's
  `w_down`) are zero, so each new block adds nothing to the residual stream and the grown head computes what
  init computes until training moves them.

  Example:
    >>> grown = grow_head(head, 1, lambda n: build_drafter(target, num_layers=n, d_ff=4096, vocab=ids, seed=0))
  """
  old = init.config.layers.num_layers
  grown = build(old + extra)
  grown.fc[...] = init.fc[...]
  grown.final_norm[...] = init.final_norm[...]
  for name in grown.first.names:
    getattr(grown.first, name)[...] = getattr(init.first, name)[...]
  for name in grown.rest.names:
    w = getattr(grown.rest, name)[...]
    if old > 1:
      w = w.at[: old - 1].set(getattr(init.rest, name)[...])
    if name in ("wo", "w_down"):
      w = w.at[old - 1 :].set(0)
    getattr(grown.rest, name)[...] = w
  return grown


def quantized_copy(drafter: EagleDrafter, storage_dtype: str) -> EagleDrafter:
  """The head as a file of `storage_dtype` loads it: float16 rounding, or int8 with one scale per output column.

  The file's own rule (`eagle_files.stored_values`) on the head's parameters. The fused projections (q|k|v,
  gate|up) are their separate matrices side by side on the output axis, so quantizing their columns is what
  `eagle_files.save_eagle_head` does to the separate ones (a test compares).
  """
  copy = nnx.clone(drafter)
  params = nnx.state(copy, nnx.Param)
  nnx.update(copy, jax.tree.map(lambda w: jnp.asarray(eagle_files.stored_values(np.asarray(w), storage_dtype)), params))
  return copy


class DataParallel:
  """Where a training step's arrays live (`--devices N`): with one device, where JAX puts them; with N, each
  batch's sequences split over the first N devices and everything else (the target, the head, the optimiser)
  replicated on them. jit then runs the step on every device at once, and its sums over the batch (the masked
  means, hence the loss and the gradients) become sums across the devices; the updated head stays replicated.

  Example:
    >>> parallel = DataParallel(2)
    >>> batch = parallel.rows(tokens[r])              # [B, S], B / 2 rows on each device
    >>> parallel.replicate_module(drafter)            # in place
  """

  def __init__(self, devices: int):
    self.devices = devices
    if devices > 1:
      mesh = Mesh(np.asarray(jax.devices()[:devices]), ("data",))
      self._rows, self._whole = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())

  def rows(self, x):
    """A batch's array [B, ...], split over the devices on its first axis."""
    return jnp.asarray(x) if self.devices == 1 else jax.device_put(x, self._rows)

  def replicate(self, tree):
    """A pytree of arrays, a copy on every device."""
    return tree if self.devices == 1 else jax.device_put(tree, self._whole)

  def replicate_module(self, module):
    """An nnx module (head, optimiser) with its state replicated, in place; returns it."""
    if self.devices > 1:
      nnx.update(module, self.replicate(nnx.state(module)))
    return module


# ---------------------------------------------------------------------------- main


def parse_args(argv):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--target", default="smollm2", choices=sorted(TARGETS), help="the model the head drafts for")
  ap.add_argument("--out", default=None, help="the head's .safetensors (default: the target's shipped path)")
  ap.add_argument("--steps", type=int, default=5000, help="length of the learning-rate schedule")
  ap.add_argument(
    "--stop-at-step",
    type=int,
    default=0,
    help="stop after this many steps (the schedule still spans --steps; 0 = run them all)",
  )
  ap.add_argument("--batch-size", type=int, default=None, help="sequences per step (smollm2 32, qwen 16)")
  ap.add_argument(
    "--devices",
    type=int,
    default=1,
    help="data parallel over the first N devices: each holds the target, the head and --batch-size / N of the "
    "sequences, and the gradients are summed across them (default 1)",
  )
  ap.add_argument("--depth", type=int, default=6, help="unrolled steps (training-time test), >= the K shipped for")
  ap.add_argument(
    "--drafter",
    choices=["eagle", "block"],
    default="eagle",
    help="eagle: the head (default); block: a BlockDrafter (K drafts from one call) on the same data",
  )
  ap.add_argument("--block-size", type=int, default=8, help="block: K, the drafts of one call (default 8)")
  ap.add_argument("--blocks-per-row", type=int, default=8, help="block: blocks a sequence holds a step (default 8)")
  ap.add_argument(
    "--shared-placeholder",
    action="store_true",
    help="block: one learned hidden for every placeholder instead of one per offset (the first drafters' design)",
  )
  ap.add_argument("--lr", type=float, default=1e-3)
  ap.add_argument(
    "--b1",
    type=float,
    default=0.9,
    help="AdamW's first-moment decay (default 0.9). The shipped heads were trained with 0: the "
    "script passed 0.0 as optax.adamw's second positional argument, meaning weight decay",
  )
  ap.add_argument(
    "--weight-decay",
    type=float,
    default=0.0,
    help="AdamW's weight decay (default 0; the shipped heads had optax's default, 1e-4)",
  )
  ap.add_argument("--num-layers", type=int, default=None, help="decoder blocks of the head (smollm2 2, qwen 1)")
  ap.add_argument(
    "--head-d-ff", type=int, default=None, help="MLP width of the head's blocks (0 = the target's; qwen 4096)"
  )
  ap.add_argument(
    "--draft-vocab", type=int, default=None, help="tokens the head scores (0 = all; smollm2 8192, qwen 32768)"
  )
  ap.add_argument(
    "--loss",
    default="ce",
    choices=("ce", "tv", "tv_ce"),
    help="per-depth loss: soft cross-entropy to the target restricted to the draft vocabulary (ce), total "
    "variation to the target's full distribution (tv: 1 - acceptance at T=1), or 0.9 tv + 0.1 ce",
  )
  ap.add_argument("--samples", default=None, help="temperatures of the continuations generated per prompt (0 = greedy)")
  ap.add_argument("--gen-tokens", type=int, default=256)
  ap.add_argument("--prompt-len", type=int, default=None, help="longest prompt, tokens (smollm2 128, qwen 384)")
  ap.add_argument("--gen-batch", type=int, default=None, help="rows of a generate call (smollm2 256, qwen 512)")
  ap.add_argument(
    "--prefill-tokens",
    type=int,
    default=None,
    help="bucket prompts by length and cap a generate call's prompt tokens (batch x width) at this; prompts "
    "over --prompt-len are then dropped instead of cut (0 = one width; smollm2 0, qwen 32768)",
  )
  ap.add_argument(
    "--eval-rows", type=int, default=None, help="held-out continuations in each report (0 = all; smollm2 0, qwen 1024)"
  )
  ap.add_argument(
    "--storage-dtype",
    default=None,
    choices=eagle_files.STORAGE_DTYPES,
    help="the saved head's weights (float16 default; int8: per-column scales); both are measured",
  )
  ap.add_argument(
    "--checkpoint-every",
    type=int,
    default=1000,
    help="save OUT_checkpoint.safetensors (float16) every N steps and when training stops (0 = never)",
  )
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument(
    "--time-limit-s",
    type=float,
    default=0.0,
    help="stop training after this many seconds of training steps (0 = no limit; the steps done are recorded)",
  )
  ap.add_argument(
    "--wall-limit-s",
    type=float,
    default=0.0,
    help="stop once this many seconds have passed since the start (0 = no limit), data generation included "
    "(it is saved to --data-cache's .partial.npz and resumed by the next run), to end inside a lent "
    "machine's command limit",
  )
  ap.add_argument(
    "--data-cache", default="", help="an .npz of the generated data: loaded if it exists, else written after generating"
  )
  ap.add_argument("--data-only", action="store_true", help="stop once the data is generated (and saved)")
  ap.add_argument(
    "--data-shard",
    type=parse_shard,
    help="I/N: generate only the continuations of prompts I, I+N, I+2N, ... (0 <= I < N), save them to "
    "--data-cache's .shardIofN.partial.npz and stop: N processes, one a GPU, generate the data together; the same "
    "command without it joins their files (and generates anything they left)",
  )
  ap.add_argument(
    "--state",
    default="",
    help="a training-state file (weights, optimiser, step, data order): resumed from if it exists, "
    "written when the run stops, so a long schedule can span several runs",
  )
  ap.add_argument(
    "--more-prompts",
    action="store_true",
    help="smollm2: about 2.2x the chat prompts (extra topics and requests); off for the shipped head",
  )
  ap.add_argument(
    "--code-files",
    type=int,
    default=60,
    help="smollm2: top-level stdlib modules whose function heads become raw code-completion prompts",
  )
  ap.add_argument("--code-per-file", type=int, default=3, help="smollm2: code-completion prompts per such module")
  ap.add_argument(
    "--code-questions",
    type=int,
    default=0,
    help="smollm2: chat questions per top-level stdlib module about its documented functions (0 = none, "
    "as for the shipped head)",
  )
  ap.add_argument(
    "--self-questions",
    type=int,
    default=0,
    help="questions the target writes itself per topic (T=0.8), added as chat prompts (0 = none); the coder: "
    "about coder_prompts.self_question_topics(), kind question, after --more-questions' prompts",
  )
  ap.add_argument(
    "--init",
    default="",
    help="start from this head (.safetensors from this script, e.g. the shipped one) instead of random "
    "weights, with a fresh schedule: continued training. Its blocks and draft vocabulary are "
    "kept (--num-layers, --head-d-ff and --draft-vocab are then ignored)",
  )
  ap.add_argument(
    "--top1-weight",
    type=float,
    default=0.0,
    help="add this weight times the cross-entropy of the target's argmax (where the draft "
    "vocabulary has it) to each depth's loss: greedy rows accept only the argmax (default 0)",
  )
  ap.add_argument(
    "--grow-layers",
    type=int,
    default=0,
    help="with --init: add this many blocks after the head's own, their output projections zero, so the grown "
    "head starts as the head it grew from (more capacity for a block drafter's later positions; default 0)",
  )
  ap.add_argument(
    "--position-decay",
    type=float,
    default=0.0,
    help="weight depth (or block position) j's loss by exp(-j / G), G this value, so the early drafts, which "
    "every accepted run passes through, count most (default 0: equal weights)",
  )
  ap.add_argument(
    "--more-questions",
    action="store_true",
    help="qwen: append general-knowledge questions (coder_prompts.general_questions) to the prompts; data made "
    "without them extends (copy it to --data-cache's .partial.npz)",
  )
  ap.add_argument(
    "--kind-weights",
    default="",
    help="draw training rows of these prompt kinds more (or less) often, e.g. question=4 (the general questions "
    "of --more-questions); unnamed kinds weigh 1 (default: uniform)",
  )
  ap.add_argument("--quick", action="store_true", help="tiny smoke run (CPU)")
  args = ap.parse_args(argv)
  spec = TARGETS[args.target]
  for name, value in spec.defaults.items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  for name in ("code_files", "code_per_file", "code_questions", "self_questions", "prefill_tokens", "eval_rows"):
    if getattr(args, name) < 0:
      ap.error(f"--{name.replace('_', '-')} must be >= 0")
  for name in (
    "steps",
    "batch_size",
    "depth",
    "num_layers",
    "gen_tokens",
    "prompt_len",
    "gen_batch",
    "block_size",
    "blocks_per_row",
  ):
    if getattr(args, name) < 1:
      ap.error(f"--{name.replace('_', '-')} must be >= 1")
  if args.head_d_ff < 0:
    ap.error(f"--head-d-ff must be >= 0 (0 = the target's), got {args.head_d_ff}")
  if not 0 <= args.draft_vocab <= spec.vocab_size:
    ap.error(f"--draft-vocab must be in [0, {spec.vocab_size}]")
  if args.steps < 2:
    ap.error(f"--steps must be >= 2 (the schedule warms up, then decays), got {args.steps}")
  if not 0 <= args.b1 < 1:
    ap.error(f"--b1 must be in [0, 1), got {args.b1}")
  if not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
    ap.error(f"--weight-decay must be a finite number >= 0, got {args.weight_decay}")
  if not (math.isfinite(args.position_decay) and args.position_decay >= 0):
    ap.error(f"--position-decay must be a finite number >= 0, got {args.position_decay}")
  if not (math.isfinite(args.top1_weight) and args.top1_weight >= 0):
    ap.error(f"--top1-weight must be a finite number >= 0, got {args.top1_weight}")
  if args.init and not os.path.isfile(args.init):
    ap.error(f"--init {args.init}: no such file (a .safetensors head written by this script)")
  if args.grow_layers < 0 or (args.grow_layers and not args.init):
    ap.error(f"--grow-layers needs --init (the head to grow) and a count >= 0, got {args.grow_layers}")
  try:
    args.samples = [float(t) for t in args.samples.split(",")]
  except ValueError:
    ap.error(f"--samples must be comma-separated temperatures, got {args.samples!r}")
  if not args.samples or any(not (math.isfinite(t) and t >= 0) for t in args.samples):
    ap.error(f"--samples must be temperatures >= 0, got {args.samples}")
  try:
    args.kind_weights = parse_kind_weights(args.kind_weights)
  except ValueError as e:
    ap.error(str(e))
  if args.more_questions and spec.name != "qwen2.5-coder-1.5b":
    ap.error("--more-questions is for --target qwen2.5-coder-1.5b (SmolLM2 has --more-prompts)")
  if args.data_only and not args.data_cache:
    ap.error("--data-only needs --data-cache (where the data goes)")
  if args.data_shard and not args.data_cache:
    ap.error("--data-shard needs --data-cache (where the shard's file goes)")
  if args.devices < 1 or args.devices > len(jax.devices()):
    ap.error(f"--devices must be in [1, {len(jax.devices())}] (the devices JAX sees), got {args.devices}")
  if args.quick:
    args.steps, args.batch_size, args.gen_tokens, args.prompt_len, args.gen_batch = min(args.steps, 4), 2, 8, 64, 8
    args.depth, args.samples, args.draft_vocab = min(args.depth, 3), [0.0, 1.0], min(args.draft_vocab, 512)
    args.prefill_tokens = min(args.prefill_tokens, 8 * 64)
    args.block_size, args.blocks_per_row = min(args.block_size, 3), min(args.blocks_per_row, 2)
  if args.batch_size % args.devices:
    ap.error(f"--batch-size must be a multiple of --devices {args.devices}, got {args.batch_size}")
  return spec, args


def load_or_generate_data(spec, args, target, tokenizer, deadline):
  """The data of --data-cache if it exists, else the target's continuations of the prompts (saved there);
  None when --wall-limit-s stopped the generation (what was done is in the cache's .partial.npz)."""
  if args.data_cache and os.path.isfile(args.data_cache):
    with np.load(args.data_cache) as f:
      data = {k: f[k] for k in f.files}
    print(f"data: read {args.data_cache}")
    return data
  prompts, kinds = target_prompts(spec, args, tokenizer, target)
  ids = [tokenizer.encode(p).ids for p in prompts]
  if args.prefill_tokens:  # bucketed: prompts that do not fit are dropped, not cut
    keep = [i for i, x in enumerate(ids) if 0 < len(x) <= args.prompt_len]
    print(f"prompts: {len(keep)} of {len(ids)} fit in {args.prompt_len} tokens")
    ids, kinds = [ids[i] for i in keep], [kinds[i] for i in keep]
  else:
    ids = [x[-args.prompt_len :] for x in ids]
  main_partial = args.data_cache + ".partial.npz" if args.data_cache else ""
  shards = sorted(glob.glob(glob.escape(args.data_cache) + ".shard*of*.partial.npz")) if args.data_cache else []
  partial = main_partial
  if args.data_shard:
    i, n = args.data_shard
    partial = f"{args.data_cache}.shard{i}of{n}.partial.npz"
  data = generate_data(
    target,
    spec,
    ids,
    kinds,
    args.samples,
    args,
    deadline=deadline,
    partial_path=partial,
    resume=(main_partial, *shards),
    shard=args.data_shard,
  )
  if args.data_shard:
    save_data(partial, data)
    print(
      f"data shard {args.data_shard[0]} of {args.data_shard[1]}: {int(data['job_done'].sum())} of "
      f"{len(data['job_done'])} continuations done (with the files it resumed), saved to {partial}; once every "
      "shard is done, the same command without --data-shard joins them"
    )
    return None
  if not data["job_done"].all():
    print(
      f"wall-clock limit: {int(data['job_done'].sum())} of {len(data['job_done'])} continuations generated, "
      f"saved to {partial}; run the same command again to continue"
    )
    return None
  if args.data_cache:
    save_data(args.data_cache, data)
    for path in (main_partial, *shards):
      if os.path.isfile(path):
        os.remove(path)
  return data


def main(argv=None):
  spec, args = parse_args(argv)
  samples = args.samples
  t_start = time.time()
  deadline = t_start + args.wall_limit_s - 20 if args.wall_limit_s else 0.0  # 20 s to save what was done
  on_gpu = jax.default_backend() == "gpu"
  target_dtype = jnp.bfloat16 if on_gpu else jnp.float32
  target, tokenizer = spec.load(target_dtype)
  vocab_size = target.config.vocab_size

  data = load_or_generate_data(spec, args, target, tokenizer, deadline)
  if data is None:
    return None
  tokens, p_lens, lens, prompt_of = padded_data(data, args.prompt_len, args.gen_tokens)
  num_prompts = len(data["prompt_offsets"]) - 1
  kinds = data["kinds"][prompt_of]
  held = (prompt_of % 20 == 0) if not args.quick else (np.arange(len(tokens)) % 2 == 0)
  train = ~held
  gen_count = int(np.sum(lens - p_lens))
  print(
    f"data: {num_prompts} prompts, {len(tokens)} continuations, {gen_count} generated tokens "
    f"({time.time() - t_start:.0f}s so far)"
  )
  if args.data_only:
    return None

  vocab = None
  coverage = 1.0
  init = None
  if args.init:  # continued training: the head's own blocks and draft vocabulary
    init = spec.load_head(jnp.float32, args.init)
    args.num_layers = init.config.layers.num_layers
    args.head_d_ff = init.config.layers.d_ff
    args.draft_vocab = init.config.draft_vocab_size
    vocab = np.asarray(init.draft_vocab[...]) if args.draft_vocab else None
    print(f"init: {args.init} ({args.num_layers} blocks, draft vocabulary {args.draft_vocab or 'all'})")
  if args.draft_vocab and vocab is None:
    vocab = draft_vocabulary(tokens[train], p_lens[train], lens[train], args.draft_vocab, spec.eos)
  if vocab is not None:
    in_vocab = np.zeros(vocab_size, bool)
    in_vocab[vocab] = True
    held_tokens = np.concatenate([r[pl:n] for r, pl, n in zip(tokens[held], p_lens[held], lens[held])])
    coverage = float(np.mean(in_vocab[held_tokens])) if held_tokens.size else 1.0
    print(f"draft vocabulary: {len(vocab)} tokens cover {coverage:.3f} of the held-out generated tokens")

  def new_head(num_layers):
    """A new head, in float32 on float32 copies of the target's embedding and head: SmolLM2's float32 weights
    are at hand (the shipped head trained on them); the coder's bf16 ones are used."""
    rows = (smollm2.smollm2_weights()["embed"],) * 2 if spec.name == "smollm2" else None
    return build_drafter(
      target, num_layers=num_layers, d_ff=args.head_d_ff, vocab=vocab, seed=args.seed, target_rows=rows
    )

  if init is not None and args.grow_layers:
    drafter = grow_head(init, args.grow_layers, new_head)
    print(f"grown: {args.grow_layers} block(s) after the --init head's {init.config.layers.num_layers}")
  else:
    drafter = init if init is not None else new_head(args.num_layers)
  del init
  block = args.drafter == "block"
  if block:  # the backbone: a new head, or the --init head to start from
    drafter = BlockDrafter(
      drafter, block_size=args.block_size, rngs=nnx.Rngs(args.seed + 1), shared_placeholder=args.shared_placeholder
    )
  # The positions reported and trained: the unrolled depths of the head, or the block's K drafts.
  depth = args.block_size if block else args.depth
  position_weights = loss_weights(depth, args.position_decay)

  def block_ends(p_len, length, rng):
    """int32 [B, blocks]: context ends c whose first draft (position c+1) is generated text."""
    lo = np.maximum(p_len - 1, 1)
    span = np.maximum(length - 1 - lo, 1)
    u = rng.random((len(p_len), args.blocks_per_row))
    return jnp.asarray(lo[:, None] + np.floor(u * span[:, None]).astype(np.int64), jnp.int32)

  schedule = optax.warmup_cosine_decay_schedule(
    0.0, args.lr, min(200, args.steps // 10 + 1), args.steps, args.lr * 0.05
  )
  adamw = optax.adamw(schedule, b1=args.b1, weight_decay=args.weight_decay)
  optimizer = nnx.Optimizer(drafter, optax.chain(optax.clip_by_global_norm(1.0), adamw), wrt=nnx.Param)
  t_graph, t_state = nnx.split(target)
  parallel = DataParallel(args.devices)
  t_state = parallel.replicate(t_state)
  parallel.replicate_module(drafter)
  parallel.replicate_module(optimizer)
  vocab_ids = jnp.asarray(vocab if vocab is not None else np.arange(vocab_size), jnp.int32)
  # Where each token sits in the draft vocabulary (-1: outside it), for the --top1-weight term.
  vocab_pos = jnp.full((vocab_size,), -1, jnp.int32).at[vocab_ids].set(jnp.arange(vocab_ids.shape[0], dtype=jnp.int32))

  def target_pass(t_state, batch):
    model = nnx.merge(t_graph, t_state)
    b, s = batch.shape
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    logits, features, _ = model(batch, pos, model.init_cache(b, s), return_features=True)
    return jax.lax.stop_gradient(logits), jax.lax.stop_gradient(features)

  def positions(drafter, logits, features, batch, p_len, length, ends):
    """Per trained position: (drafter logits [..., Vd], the target's logits of the same token [..., V], mask)."""
    if ends is not None:
      # Block c's draft j is the token at c+1+j; the target's law of it is its logits at position c+j.
      q_all = drafter.block_logits(batch[:, 1:], features[:, :-1], ends, depth, draft_vocab=True)  # [B, NB, K, Vd]
      t_all, at = block_target_logits(logits, ends, depth)
      ok = (at + 1 >= p_len[:, None, None]) & (at + 1 < length[:, None, None])
      return [(q_all[:, :, j], t_all[:, :, j], ok[:, :, j]) for j in range(depth)]
    # Entry p reads (f_p, x_{p+1}) and predicts x_{p+2}, whose target distribution is logits[p+1].
    per_depth = drafter.unrolled_logits(batch[:, 1:-1], features[:, :-2], depth)
    p = jnp.arange(batch.shape[1] - 2)[None, :]
    predicted = p + 2  # position of the predicted token
    gen = (predicted >= p_len[:, None]) & (predicted < length[:, None])
    return [(q, logits[:, 1:-1], gen & (p >= j)) for j, q in enumerate(per_depth)]

  def losses(drafter, t_state, batch, p_len, length, ends=None):
    """Per-depth (or block position) loss (--loss), teacher-forced agreement and 1-TV on generated tokens."""
    logits, features = target_pass(t_state, batch)
    out, target_laws = [], {}
    for q_logits, t_logits, valid in positions(drafter, logits, features, batch, p_len, length, ends):
      if id(t_logits) not in target_laws:  # the head's depths share one array: its laws are computed once
        t_lse = jax.nn.logsumexp(t_logits, axis=-1, keepdims=True)
        t_draft = t_logits[..., vocab_ids]  # [..., Vd]
        target_laws[id(t_logits)] = (
          jax.nn.softmax(t_draft, axis=-1),  # restricted to the draft vocabulary, renormalised
          jnp.exp(t_draft - t_lse),  # mass the sampler gives these tokens
          jnp.argmax(t_logits, axis=-1),
        )
      t_p, t_full_p, t_top = target_laws[id(t_logits)]
      n = jnp.maximum(jnp.sum(valid.astype(jnp.float32)), 1.0)
      q_logp = jax.nn.log_softmax(q_logits, axis=-1)
      ce = -jnp.sum(t_p * q_logp, axis=-1)
      overlap = jnp.sum(jnp.minimum(t_full_p, jnp.exp(q_logp)), axis=-1)
      loss = {"ce": ce, "tv": 1.0 - overlap, "tv_ce": 0.9 * (1.0 - overlap) + 0.1 * ce}[args.loss]
      if args.top1_weight:  # the target's argmax, where the draft vocabulary has it
        pos_top = vocab_pos[t_top]
        ce_top = -jnp.take_along_axis(q_logp, jnp.maximum(pos_top, 0)[..., None], axis=-1)[..., 0]
        loss = loss + args.top1_weight * jnp.where(pos_top >= 0, ce_top, 0.0)
      top1 = (vocab_ids[jnp.argmax(q_logits, axis=-1)] == t_top).astype(jnp.float32)
      # where, not a product: one non-finite value at a masked position must not reach the sums or gradients.
      masked_mean = lambda x: jnp.sum(jnp.where(valid, x, 0.0)) / n  # noqa: E731
      out.append((masked_mean(loss), masked_mean(top1), masked_mean(overlap), masked_mean(ce)))
    return out

  @nnx.jit
  def train_step(drafter, optimizer, t_state, batch, p_len, length, ends):
    def loss_fn(drafter):
      per_depth = losses(drafter, t_state, batch, p_len, length, ends)
      return sum(w * d[0] for w, d in zip(position_weights, per_depth)), per_depth

    (loss, per_depth), grads = nnx.value_and_grad(loss_fn, has_aux=True)(drafter)
    optimizer.update(drafter, grads)
    return loss, per_depth

  @nnx.jit
  def eval_step(drafter, t_state, batch, p_len, length, ends):
    return losses(drafter, t_state, batch, p_len, length, ends)

  def held_out_report(head, rows=None):
    rows = np.flatnonzero(held) if rows is None else rows
    parallel.replicate_module(head)  # a stored copy (quantized_copy) starts on one device
    if args.eval_rows:
      rows = rows[: args.eval_rows]
    sums = np.zeros((depth, 3))
    batches = 0
    eval_rng = np.random.default_rng(12345)  # the same blocks for every head reported
    for s in range(0, len(rows) - args.batch_size + 1, args.batch_size):
      r = rows[s : s + args.batch_size]
      ends = block_ends(p_lens[r], lens[r], eval_rng) if block else None
      ends = None if ends is None else parallel.rows(ends)
      res = eval_step(head, t_state, parallel.rows(tokens[r]), parallel.rows(p_lens[r]), parallel.rows(lens[r]), ends)
      sums += np.asarray([[float(d[3]), float(d[1]), float(d[2])] for d in res])
      batches += 1
    m = sums / max(batches, 1)
    return {
      "rows": int(batches * args.batch_size),
      "ce": m[:, 0].round(4).tolist(),
      "top1": m[:, 1].round(4).tolist(),
      "one_minus_tv": m[:, 2].round(4).tolist(),
    }

  def reports(head) -> dict:
    """Held-out agreement over all kinds, and over code and chat prompts apart (a target with both)."""
    out = {"all": held_out_report(head)}
    code = np.isin(kinds, CODE_KINDS)
    if code.any() and (~code).any():
      out["code"] = held_out_report(head, np.flatnonzero(held & code))
      out["chat"] = held_out_report(head, np.flatnonzero(held & ~code))
    return out

  def print_report(report, title):
    print(title)
    for part, r in report.items():
      for j in range(depth):
        print(f"  {part:4s} depth {j}: top1 {r['top1'][j]:.3f}  1-TV {r['one_minus_tv'][j]:.3f}  CE {r['ce'][j]:.3f}")

  def save(head, path, **kw):
    writer = eagle_files.save_block_drafter if block else eagle_files.save_eagle_head
    writer(head, path, target=spec.file, **kw)

  init_report = None
  if args.init and not (args.state and os.path.isfile(args.state)):
    # The starting head on the same held-out split: the baseline that continued training must beat.
    init_report = reports(drafter)
    print_report(init_report, "held-out teacher-forced agreement of the --init head, before training:")
  rng = np.random.default_rng(args.seed)
  train_rows = np.flatnonzero(train)
  row_p = kind_probabilities(kinds[train_rows], args.kind_weights)
  history, commands = [], []
  first = 0
  if args.state and os.path.isfile(args.state):
    first, history, commands, init_report = load_state(args.state, drafter, optimizer, rng)
    parallel.replicate_module(drafter)
    parallel.replicate_module(optimizer)
    print(f"resumed {args.state} at step {first}")
  checkpoint = os.path.splitext(args.out)[0] + "_checkpoint.safetensors"
  bar = tqdm(range(first, args.steps), desc="training (TTT)", initial=first, total=args.steps, mininterval=10)
  t_train = time.time()
  step = first - 1
  for step in bar:
    r = rng.choice(train_rows, args.batch_size, replace=len(train_rows) < args.batch_size, p=row_p)
    ends = parallel.rows(block_ends(p_lens[r], lens[r], rng)) if block else None  # rng: in --state, so resumable
    loss, per_depth = train_step(
      drafter, optimizer, t_state, parallel.rows(tokens[r]), parallel.rows(p_lens[r]), parallel.rows(lens[r]), ends
    )
    if step % 50 == 0 or step == args.steps - 1:
      top1 = [round(float(d[1]), 3) for d in per_depth]
      if not math.isfinite(float(loss)):  # stop before minutes of NaN steps and a checkpoint that cannot be saved
        raise SystemExit(f"training diverged: loss {float(loss)} at step {step}")
      history.append({"step": step, "loss": round(float(loss), 4), "top1": top1})
      bar.set_postfix(loss=f"{float(loss):.3f}", top1_d0=top1[0], top1_last=top1[-1])
    if args.stop_at_step and step + 1 >= args.stop_at_step:
      break
    if args.time_limit_s and time.time() - t_train > args.time_limit_s:
      print(f"time limit: stopping after {step + 1} of {args.steps} steps")
      break
    # The margin: the state and checkpoint (a run with --state continues in the next command), else also the
    # reports (their compile) and the head.
    if deadline and time.time() > deadline - (30 if args.state else 120):
      print(f"wall-clock limit: stopping after {step + 1} of {args.steps} steps")
      break
    if args.checkpoint_every and step and step % args.checkpoint_every == 0:
      save(drafter, checkpoint, metadata={"step": step})
  train_seconds = time.time() - t_train
  command = "python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:]))
  commands = commands + [{"command": command, "steps": [first, step + 1], "train_seconds": round(train_seconds, 1)}]
  if args.state:
    save_state(args.state, drafter, optimizer, rng, step + 1, history, commands, init_report)
  if args.checkpoint_every:  # float16 whatever --storage-dtype: what a later --init continues from
    save(drafter, checkpoint, metadata={"step": step + 1})
  if args.state and deadline and (step + 1 < (args.stop_at_step or args.steps) or time.time() > deadline - 100):
    # The reports and the head come in the command that ends the schedule with time to spare for them.
    print(f"state saved at step {step + 1} of {args.steps} in {args.state}: run the same command to continue")
    return None
  report = reports(drafter)
  print_report(report, "held-out teacher-forced agreement by depth:")
  stored = {}
  for storage in ("float16", "int8"):  # what each stored form costs in agreement
    stored[storage] = held_out_report(quantized_copy(drafter, storage))
  print(" ".join(f"{k}: top1 {v['top1']} 1-TV {v['one_minus_tv']}" for k, v in stored.items()))
  meta = {
    "command": command,
    "commands": commands,  # every run of a schedule that spanned several (--state), with its steps
    "device": jax.devices()[0].device_kind,
    "jax": jax.__version__,
    "date": time.strftime("%Y-%m-%d"),
    "seed": args.seed,
    "steps": args.steps,
    "steps_done": step + 1,
    "batch_size": args.batch_size,
    "devices": args.devices,
    "depth": depth,
    "drafter": args.drafter,
    "block_size": args.block_size if block else None,
    "blocks_per_row": args.blocks_per_row if block else None,
    "shared_placeholder": args.shared_placeholder if block else None,
    "lr": args.lr,
    "b1": args.b1,
    "weight_decay": args.weight_decay,
    "loss": args.loss,
    "top1_weight": args.top1_weight,
    "position_decay": args.position_decay,
    "grow_layers": args.grow_layers,
    "init": args.init or None,
    "prompts": num_prompts,
    "continuations": int(len(tokens)),
    "generated_tokens": gen_count,
    "samples": samples,
    "gen_tokens": args.gen_tokens,
    "draft_vocab_coverage": round(coverage, 4),
    "train_seconds": round(sum(c["train_seconds"] for c in commands), 1),
    "total_seconds": round(time.time() - t_start, 1),
    "held_out": report["all"],
    "held_out_by_kind": {k: v for k, v in report.items() if k != "all"},
    "held_out_stored": stored,
    "init_held_out": None if init_report is None else init_report["all"],
    "init_held_out_by_kind": None if init_report is None else {k: v for k, v in init_report.items() if k != "all"},
    "history": history,
  }
  save(drafter, args.out, metadata=meta, storage_dtype=args.storage_dtype)
  print(f"saved {args.out} in {time.time() - t_start:.0f}s (training {train_seconds:.0f}s)")
  return meta


if __name__ == "__main__":
  main()
