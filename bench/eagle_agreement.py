"""Teacher-forced agreement of an EAGLE head with its target, per depth, and the greedy chain it implies.

What: for each sequence (a prompt and the target's continuation) the target runs once on the whole sequence
(`model(tokens, positions, cache, return_features=True)`), and the head runs unrolled on its features
(`EagleDrafter.unrolled_logits(tokens[:, 1:-1], features[:, :-2], depth)`), exactly as examples/train_eagle.py's
`losses` does. On generated positions only (the predicted token x_{p+2} is past the prompt), at each depth j
(positions p >= j):

  - `top1`: the head's argmax (mapped through its draft vocabulary) is the target's argmax;
  - `one_minus_tv`: sum over the draft vocabulary of min(p_target, q_head), p_target the target's full softmax
    (the mass the sampler gives those tokens): acceptance at T=1.

Figures are token-weighted over all rows of a group (train_eagle averages per-batch means instead).

The chain replay: in a greedy chain whose drafts d_1 .. d_j were all accepted, those drafts are the target's own
tokens, so draft d_{j+1} of a round with context length L is exactly depth j of `unrolled_logits` at position
p = L - 2 + j (tests/models/test_eagle.py checks the cached path equals the unrolled one). Walking the sequence
round by round (first round at L = prompt + 1, a round accepts the leading correct drafts among the usable ones,
then the target adds one token) gives what `speculative_generate` with K (`--k`) greedy drafts reports:
acceptance per draft position (accepted / reached, as `DecodeStats`) and the mean accepted length (tokens per
target call, the prefill counted). Unlike `top1` at depth 0, which counts every position, position 0 of the chain
is scored only where a round starts, and rounds start right after a rejection, where the text is harder.

Sequences:
  - `--data FILE.npz`: train_eagle's data (its `padded_data`), the held-out split (prompt index % 20 == 0, as
    train_eagle holds out), `--rows N` rows spread evenly over it (`--by-kind`: N code rows and N chat rows;
    `--temps greedy|sampled|all` picks continuations by temperature). Reported overall and by kind (code = train_eagle's
    CODE_KINDS, chat = the rest).
  - `--real-target-json FILE` (bench/real_target.py's JSON): each prompt's `ids` followed by the plain greedy
    continuation (`greedy_ids` of the row with drafter "plain", mode "greedy"); per prompt and by kind (the prompt's
    name without its digits: question, code, edit). The loop's own chain figures in that JSON are copied beside.

How: one sequence at a time, right-padded to a multiple of `--bucket` tokens (one compile per width); the
target's logits [1, S, V] float32 are freed before the next sequence. Heads: `--head-dtypes` (each loads the head
file in that dtype with `load_qwen2_5_coder_eagle`); target: `load_qwen2_5_coder(--target-dtype)` (float32 on a CPU,
bfloat16 on a GPU by default). Also reported: how often the target's argmax is the sequence's own next token (the
continuations came from another run, e.g. bf16 on a GPU).

Run (CPU, the shipped head, float32 target: 266 s on 2 cores, 14 sequences of up to 429 tokens; the process peaks
at 17.4 GB while the float32 target loads, then holds about 12 GB; MALLOC_ARENA_MAX=2 keeps glibc from holding
freed memory):

    MALLOC_ARENA_MAX=2 PYTHONPATH=. python bench/eagle_agreement.py --data .eagle/qwen_data.npz --rows 8 \\
      --real-target-json bench/results/qwen_eagle_h200.json --head-dtypes float32,bfloat16 --depth 5 \\
      --max-len 512 --out /tmp/agree

Writes OUT/eagle_agreement.json: every figure (per group, per head dtype; per prompt), the rows used, the device,
versions, date and command.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import time
from typing import NamedTuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench import common  # noqa: E402
from specdec_jax.models.loaders.common import json_beside  # noqa: E402

HEAD_DTYPES = ("float32", "bfloat16", "float16")
EXAMPLES = os.path.join(REPO, "examples")


class Row(NamedTuple):
  """One sequence: its prompt, then the target's continuation."""

  name: str
  kind: str  # "code" or "chat" (held-out data), or the benchmark prompt's kind (question, code, edit)
  tokens: np.ndarray  # int32 [S]
  p_len: int
  length: int  # tokens[:length] are real (after --max-len)


def train_eagle_module():
  """examples/train_eagle.py as a module (examples/ on sys.path while it imports its prompt lists)."""
  sys.path.insert(0, EXAMPLES)
  try:
    spec = importlib.util.spec_from_file_location("examples_train_eagle", os.path.join(EXAMPLES, "train_eagle.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  finally:
    sys.path.remove(EXAMPLES)
  return module


# ---------------------------------------------------------------------------- sequences


def held_out_rows(data: dict, *, rows: int, by_kind: bool, temps: str, max_len: int, train=None) -> list[Row]:
  """`rows` held-out continuations (prompt index % 20 == 0) of train_eagle's data, spread evenly over the split.

  With `by_kind`, `rows` code rows and `rows` chat rows. `temps`: "greedy" (temperature 0), "sampled" (> 0), "all".
  """
  train = train or train_eagle_module()
  done = np.flatnonzero(data["job_done"])
  prompt_of = data["job_prompt"][done]
  temp = data["job_temperature"][done]
  keep = prompt_of % 20 == 0
  if temps == "greedy":
    keep &= temp == 0
  elif temps == "sampled":
    keep &= temp > 0
  code = np.isin(data["kinds"][prompt_of], train.CODE_KINDS)
  pools = [("code", keep & code), ("chat", keep & ~code)] if by_kind else [(None, keep)]
  chosen = []
  for _, pool in pools:
    idx = np.flatnonzero(pool)
    if len(idx):
      chosen += idx[np.unique(np.linspace(0, len(idx) - 1, min(rows, len(idx))).round().astype(int))].tolist()
  chosen = sorted(chosen)
  sub = {**data, "job_done": np.zeros_like(data["job_done"])}
  sub["job_done"][done[chosen]] = True
  tokens, p_lens, lens, prompts = train.padded_data(sub, int(p_lens_max(data)), int(gen_max(data)))
  out = []
  for r in range(len(tokens)):
    kind = "code" if data["kinds"][prompts[r]] in train.CODE_KINDS else "chat"
    length = int(min(lens[r], max_len)) if max_len else int(lens[r])
    name = f"prompt{int(prompts[r])}:{data['kinds'][prompts[r]]}:T{float(data['job_temperature'][done[chosen[r]]]):g}"
    out.append(Row(name, kind, tokens[r, :length], int(p_lens[r]), length))
  return out


def p_lens_max(data: dict) -> int:
  return int(np.max(np.diff(data["prompt_offsets"])))


def gen_max(data: dict) -> int:
  return int(np.max(np.diff(data["gen_offsets"])))


def benchmark_rows(report: dict, *, max_len: int) -> tuple[list[Row], dict]:
  """The benchmark's prompts and their plain greedy continuations; the loop's own greedy chain rows beside."""
  plain = [g for g in report["generate"] if g.get("drafter") == "plain" and g.get("mode") == "greedy"]
  plain = [g for g in plain if "greedy_ids" in g]
  if not plain:
    raise ValueError("no generate row with drafter 'plain', mode 'greedy' and greedy_ids")
  greedy = plain[0]["greedy_ids"]
  rows = []
  for p in report["prompts"]:
    if p["name"] not in greedy:
      continue
    ids = np.asarray(list(p["ids"]) + list(greedy[p["name"]]), np.int32)
    length = int(min(len(ids), max_len)) if max_len else len(ids)
    rows.append(Row(p["name"], re.sub(r"\d+$", "", p["name"]), ids[:length], len(p["ids"]), length))
  loop = {}
  for g in report["generate"]:
    if g.get("drafter") == "eagle" and g.get("mode") == "greedy":
      loop[g["config"]] = {
        k: g.get(k) for k in ("K", "tree", "tokens", "target_calls", "acceptance_per_position", "mean_accepted_length")
      }
  return rows, loop


# ---------------------------------------------------------------------------- measurement


@nnx.jit
def target_pass(model, tokens):
  """The target on one padded sequence [1, S]: (logits float32 [1, S, V], features [1, S, F])."""
  b, s = tokens.shape
  pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  logits, features, _ = model(tokens, pos, model.init_cache(b, s), return_features=True)
  return logits, features


@nnx.jit(static_argnums=(6,))
def head_pass(head, tokens, logits, features, p_len, length, depth):
  """Per position p (predicting x_{p+2}) and depth: top1, 1-TV overlap, mask; train_eagle's `losses` definitions.

  Returns (top1 bool [depth, S-2], overlap float32 [depth, S-2], mask bool [depth, S-2], target argmax is the
  sequence's next token bool [S-2]).
  """
  per_depth = head.unrolled_logits(tokens[:, 1:-1], features[:, :-2], depth)
  vocab_ids = head.draft_vocab[...] if head.config.draft_vocab_size else jnp.arange(head.vocab_size, dtype=jnp.int32)
  t_logits = logits[:, 1:-1]  # [1, S-2, V]: position p predicts x_{p+2}
  t_lse = jax.nn.logsumexp(t_logits, axis=-1, keepdims=True)
  t_full_p = jnp.exp(t_logits[..., vocab_ids] - t_lse)
  t_top = jnp.argmax(t_logits, axis=-1)
  p = jnp.arange(tokens.shape[1] - 2)[None, :]
  predicted = p + 2
  gen = (predicted >= p_len) & (predicted < length)
  top1, overlap, mask = [], [], []
  for j, q_logits in enumerate(per_depth):
    q = jax.nn.softmax(q_logits, axis=-1)
    top1.append(vocab_ids[jnp.argmax(q_logits, axis=-1)] == t_top)
    overlap.append(jnp.sum(jnp.minimum(t_full_p, q), axis=-1))
    mask.append(gen & (p >= j))
  follows = t_top == tokens[:, 2:]
  return jnp.stack(top1)[:, 0], jnp.stack(overlap)[:, 0], jnp.stack(mask)[:, 0], follows[0]


def measure(target, heads: dict, rows: list[Row], depth: int, *, bucket: int = 128, log=None) -> dict:
  """Per head name, per row: {"top1", "overlap", "mask" [depth, S-2], "follows" [S-2]} as NumPy arrays.

  The target runs once per row (right-padded to a multiple of `bucket`; causal, so the padding changes nothing
  before `length`), then every head on its logits and features.
  """
  out = {name: [] for name in heads}
  for i, row in enumerate(rows):
    t0 = time.perf_counter()
    width = -(-row.length // bucket) * bucket
    x = np.zeros((1, width), np.int32)
    x[0, : row.length] = row.tokens[: row.length]
    x = jnp.asarray(x)
    logits, features = target_pass(target, x)
    p_len, length = jnp.asarray(row.p_len, jnp.int32), jnp.asarray(row.length, jnp.int32)
    for name, head in heads.items():
      top1, overlap, mask, follows = head_pass(head, x, logits, features, p_len, length, depth)
      n = row.length - 2  # positions past the padding are masked out anyway
      out[name].append(
        {
          "top1": np.asarray(top1)[:, :n],
          "overlap": np.asarray(overlap)[:, :n],
          "mask": np.asarray(mask)[:, :n],
          "follows": np.asarray(follows)[:n],
        }
      )
    del logits, features
    if log:
      log(
        f"  {row.name}: {row.length} tokens ({row.length - row.p_len} generated) in {time.perf_counter() - t0:.1f}s"
        f"{rss_note()}"
      )
  return out


def rss_note() -> str:
  """ ", RSS x GB (peak y)" from /proc/self/status where there is one (the run's memory, for --max-len choices)."""
  try:
    with open("/proc/self/status") as f:
      kb = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
    return f", RSS {int(kb['VmRSS'].split()[0]) / 2**20:.1f} GB (peak {int(kb['VmHWM'].split()[0]) / 2**20:.1f})"
  except (OSError, KeyError, ValueError):
    return ""


def replay_chain(top1: np.ndarray, p_len: int, length: int, k: int) -> dict:
  """A greedy K-draft chain over one sequence from its teacher-forced `top1` [depth >= k, length - 2].

  Rounds as `speculative_generate` counts them (`DecodeStats`): the prefill emits x_{p_len}; a round at context
  length L may emit min(K, L_end - L - 1) drafts (the last token a row can emit is the target's own), accepts the
  leading drafts whose depth-j top1 at p = L - 2 + j holds, then the target adds one token.
  """
  accepted, reached = np.zeros(k, np.int64), np.zeros(k, np.int64)
  cur, rounds = p_len + 1, 0
  while cur < length:
    rounds += 1
    n = 0
    for j in range(min(k, length - cur - 1)):
      reached[j] += 1
      if not top1[j, cur - 2 + j]:
        break
      accepted[j] += 1
      n += 1
    cur += n + 1
  return {"accepted_per_position": accepted, "reached_per_position": reached, "target_calls": rounds + 1}


def summarize(results: list[dict], rows: list[Row], k: int) -> dict:
  """Token-weighted agreement per depth over rows, and the replayed chain's totals."""
  depth = results[0]["top1"].shape[0]
  n = np.zeros(depth)
  top1 = np.zeros(depth)
  overlap = np.zeros(depth)
  follows = gen = 0
  accepted, reached = np.zeros(k, np.int64), np.zeros(k, np.int64)
  calls = tokens = 0
  for res, row in zip(results, rows):
    m = res["mask"]
    n += m.sum(1)
    top1 += (res["top1"] & m).sum(1)
    overlap += np.where(m, res["overlap"], 0.0).sum(1)
    follows += int(res["follows"][m[0]].sum())
    gen += int(m[0].sum())
    chain = replay_chain(res["top1"], row.p_len, row.length, k)
    accepted += chain["accepted_per_position"]
    reached += chain["reached_per_position"]
    calls += chain["target_calls"]
    tokens += row.length - row.p_len
  safe = np.maximum(n, 1)
  return {
    "rows": len(rows),
    "positions": n.astype(int).tolist(),
    "top1": (top1 / safe).round(4).tolist(),
    "one_minus_tv": (overlap / safe).round(4).tolist(),
    "target_argmax_is_next_token": round(follows / max(gen, 1), 4),
    "chain": {
      "k": k,
      "acceptance_per_position": (accepted / np.maximum(reached, 1)).round(4).tolist(),
      "accepted_per_position": accepted.tolist(),
      "reached_per_position": reached.tolist(),
      "tokens": int(tokens),
      "target_calls": int(calls),
      "mean_accepted_length": round(tokens / max(calls, 1), 4),
    },
  }


def grouped(results: list[dict], rows: list[Row], k: int) -> dict:
  """ "all", then one group per kind."""
  out = {"all": summarize(results, rows, k)}
  for kind in sorted({r.kind for r in rows}):
    pick = [i for i, r in enumerate(rows) if r.kind == kind]
    out[kind] = summarize([results[i] for i in pick], [rows[i] for i in pick], k)
  return out


# ---------------------------------------------------------------------------- main


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--data", default="", help="train_eagle's data .npz (its held-out split is measured)")
  ap.add_argument("--rows", type=int, default=8, help="held-out rows of --data (per kind with --by-kind)")
  ap.add_argument("--by-kind", action="store_true", help="--rows code rows and --rows chat rows")
  ap.add_argument("--temps", default="all", choices=("all", "greedy", "sampled"), help="continuations of --data")
  ap.add_argument("--real-target-json", default="", help="bench/real_target.py's JSON: its prompts + plain greedy")
  ap.add_argument("--head", default="", help="the head's .safetensors (default: the shipped Qwen2.5-Coder head)")
  ap.add_argument("--head-dtypes", default="float32,bfloat16", help=f"comma-separated, of {HEAD_DTYPES}")
  ap.add_argument("--target-dtype", default="", help="float32 or bfloat16 (default: bfloat16 on a GPU, else float32)")
  ap.add_argument("--depth", type=int, default=5, help="unrolled depths measured")
  ap.add_argument("--k", type=int, default=4, help="drafts per round of the replayed greedy chain (<= --depth)")
  ap.add_argument("--max-len", type=int, default=0, help="cut each sequence to this many tokens (0 = whole)")
  ap.add_argument("--bucket", type=int, default=128, help="pad sequences to a multiple of this (one compile each)")
  ap.add_argument("--out", default="", help="write OUT/eagle_agreement.json")
  args = ap.parse_args(argv)
  if not args.data and not args.real_target_json:
    ap.error("give --data FILE.npz and/or --real-target-json FILE: nothing to measure")
  for flag, path in (("--data", args.data), ("--real-target-json", args.real_target_json), ("--head", args.head)):
    if path and not os.path.isfile(path):
      ap.error(f"{flag} {path}: no such file")
  if args.head and not os.path.isfile(json_beside(args.head)):
    ap.error(f"--head {args.head}: its .json (written beside it by examples/train_eagle.py) is missing")
  for name in ("rows", "depth", "k", "bucket"):
    if getattr(args, name) < 1:
      ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
  if args.k > args.depth:
    ap.error(f"--k ({args.k}) must be <= --depth ({args.depth}): draft j of the chain is depth j")
  if args.max_len and args.max_len < 3:
    ap.error(f"--max-len must be 0 (whole sequences) or >= 3, got {args.max_len}")
  args.head_dtypes = [d.strip() for d in args.head_dtypes.split(",") if d.strip()]
  bad = [d for d in args.head_dtypes if d not in HEAD_DTYPES]
  if bad or not args.head_dtypes or len(set(args.head_dtypes)) != len(args.head_dtypes):
    ap.error(f"--head-dtypes must be distinct names of {HEAD_DTYPES}, got {args.head_dtypes}")
  if args.target_dtype and args.target_dtype not in ("float32", "bfloat16"):
    ap.error(f"--target-dtype must be float32 or bfloat16, got {args.target_dtype!r}")
  return ap, args


def load_sequences(ap, args) -> tuple[list[Row], list[Row], dict]:
  """(held-out rows, benchmark rows, the loop's own chain rows), read before any model loads."""
  held, bench_rows, loop = [], [], {}
  if args.data:
    try:
      with np.load(args.data) as f:
        data = {k: f[k] for k in f.files}
    except (OSError, ValueError) as e:
      ap.error(f"--data {args.data}: not an .npz ({e})")
    need = {"prompt_ids", "prompt_offsets", "kinds", "job_prompt", "job_temperature", "job_done", "gen_ids"}
    if need - data.keys():
      ap.error(f"--data {args.data}: not train_eagle's data (missing {sorted(need - data.keys())})")
    held = held_out_rows(data, rows=args.rows, by_kind=args.by_kind, temps=args.temps, max_len=args.max_len)
    held = [r for r in held if r.length > r.p_len]
    if not held:
      ap.error(f"--data {args.data}: no held-out row with generated tokens (--temps {args.temps}, --max-len)")
  if args.real_target_json:
    try:
      with open(args.real_target_json) as f:
        report = json.load(f)
      bench_rows, loop = benchmark_rows(report, max_len=args.max_len)
    except (OSError, ValueError, KeyError, TypeError) as e:
      ap.error(f"--real-target-json {args.real_target_json}: not bench/real_target.py's JSON with greedy ids ({e})")
    bench_rows = [r for r in bench_rows if r.length > r.p_len]
    if not bench_rows:
      ap.error(f"--real-target-json {args.real_target_json}: no prompt with generated tokens within --max-len")
  return held, bench_rows, loop


def print_table(title: str, groups: dict) -> None:
  print(title)
  for dtype, by_group in groups.items():
    for part, s in by_group.items():
      c = s["chain"]
      print(
        f"  head {dtype:8s} {part:9s} top1 {' '.join(f'{v:.3f}' for v in s['top1'])} | "
        f"1-TV {' '.join(f'{v:.3f}' for v in s['one_minus_tv'])} | chain K={c['k']} acc/pos "
        f"{' '.join(f'{v:.3f}' for v in c['acceptance_per_position'])} mean len {c['mean_accepted_length']:.2f} "
        f"(tgt=seq {s['target_argmax_is_next_token']:.3f}, {s['positions'][0]} pos)"
      )


def main(argv=None) -> dict:
  ap, args = parse_args(argv)
  held, bench_rows, loop = load_sequences(ap, args)
  from specdec_jax.models import load_qwen2_5_coder, load_qwen2_5_coder_eagle  # noqa: PLC0415
  from specdec_jax.models.loaders.qwen2_5_coder import QWEN2_5_CODER_EAGLE_PATH  # noqa: PLC0415

  t_start = time.perf_counter()
  info = common.device_info()
  target_dtype = args.target_dtype or ("bfloat16" if common.has_gpu() else "float32")
  print(f"{info['device']} ({info['platform']}), jax {info['jax']}; target {target_dtype}", flush=True)
  target, _ = load_qwen2_5_coder(jnp.dtype(target_dtype))
  heads = {d: load_qwen2_5_coder_eagle(jnp.dtype(d), args.head or None) for d in args.head_dtypes}
  head_path = args.head or QWEN2_5_CODER_EAGLE_PATH
  with open(json_beside(head_path)) as f:
    head_meta = json.load(f)
  print(f"loaded in {time.perf_counter() - t_start:.0f}s{rss_note()}", flush=True)
  report = {
    "info": info,
    "command": " ".join(["python", "bench/eagle_agreement.py", *(sys.argv[1:] if argv is None else argv)]),
    "config": {**vars(args), "target_dtype": target_dtype},
    "head": {"path": os.path.relpath(head_path, REPO), "held_out_at_training": head_meta.get("held_out")},
    "loop_greedy_chains": loop,
  }
  for label, rows in (("held_out", held), ("benchmark", bench_rows)):
    if not rows:
      continue
    print(f"{label}: {len(rows)} rows", flush=True)
    t0 = time.perf_counter()
    res = measure(target, heads, rows, args.depth, bucket=args.bucket, log=lambda s: print(s, flush=True))
    report[label] = {
      "rows": [{"name": r.name, "kind": r.kind, "prompt": r.p_len, "length": r.length} for r in rows],
      "seconds": round(time.perf_counter() - t0, 1),
      "by_head_dtype": {d: grouped(res[d], rows, args.k) for d in heads},
    }
    if label == "benchmark":  # per prompt: depth-0 top1 and the chain's position-0 acceptance
      report[label]["per_prompt"] = {
        d: {r.name: summarize([x], [r], args.k) for x, r in zip(res[d], rows)} for d in heads
      }
    print_table(f"{label} (top1 and 1-TV by depth):", report[label]["by_head_dtype"])
  report["elapsed_s"] = round(time.perf_counter() - t_start, 1)
  if "benchmark" in report:
    print("benchmark per prompt (depth-0 top1, chain position-0 acceptance):")
    for d, per in report["benchmark"]["per_prompt"].items():
      print(
        f"  head {d:8s} "
        + "  ".join(f"{n} {s['top1'][0]:.3f}/{s['chain']['acceptance_per_position'][0]:.3f}" for n, s in per.items())
      )
  for config, row in loop.items():
    print(
      f"loop ({config}): acceptance per position {row['acceptance_per_position']}, mean {row['mean_accepted_length']}"
    )
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "eagle_agreement.json")
    with open(path, "w") as f:
      json.dump(report, f, indent=1)
    print(f"wrote {path} ({report['elapsed_s']:.0f}s)")
  return report


if __name__ == "__main__":
  main()
