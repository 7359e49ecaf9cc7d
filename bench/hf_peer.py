"""Hugging Face transformers as the peer: the same model, GPU and prompts, decoded with HF's own recipes.

A standalone torch script: it imports torch, transformers, tokenizers, gguf (through transformers), json and
numpy, and never specdec_jax, so it runs in an environment without JAX.

What it measures (B=1, greedy, one prompt at a time):
  eager           `model.generate` with the default dynamic cache, no compilation.
  static_compile  `cache_implementation="static"`: transformers 5.x then compiles the decode step's forward by
                  itself (`GenerationMixin._valid_auto_compile_criteria` / `get_compiled_call`, a `CompileConfig`,
                  default `mode="reduce-overhead"`, i.e. CUDA graphs); the prefill runs eagerly. `max_cache_len` is
                  fixed to the longest prompt + `--max-new-tokens` so every prompt shares one cache shape, and one
                  compilation. The first call's time is reported as `compile_s` and never enters the figures. Without
                  compilation (CPU, `--quick`, `--no-compile`) it is named `static_eager`.
  prompt_lookup   prompt lookup decoding (`prompt_lookup_num_tokens=`, `max_matching_ngram_size=`) in eager mode.

Each prompt: 1 warm-up call, then `--runs` timed calls (torch.cuda.synchronize around each); the median is kept.
tokens/s = emitted tokens / wall time of the whole `generate` call (prefill included); emitted tokens are the new
tokens `generate` returned, the stopping EOS included. The aggregate is the sum of tokens over the sum of median
times. The eager recipe's tokens are the reference: for the other recipes the JSON says which rows differ and the
first differing position (an index into the generated tokens).

Prompts: from `--prompts` (examples/held_out_prompts.json), `questions` first 2, `code_tasks` first 2,
`edit_tasks` all (6 prompts), each a single user message through the tokenizer's chat template with
`add_generation_prompt=True`. Stop ids: `generation_config.eos_token_id` plus whichever of the usual end-of-turn /
end-of-text tokens the vocabulary has (Qwen2.5: 151645 <|im_end|> and 151643 <|endoftext|>); `--eos-ids`
overrides. (The tokenizer's own `eos_token` is recorded but not used: a GGUF-built tokenizer can name a start
token there, e.g. SmolLM2's <|im_start|>.)

--ours FILE: our bench's JSON (bench/real_target.py). Expected shape, looked for anywhere in the file:

    {"...": [{"prompt": "<user message as in held_out_prompts.json>", "tokens": [int, ...]}, ...]}

i.e. any list of records holding "prompt" (the raw user text, the chat-formatted text, or the prompt's index here)
and token ids under "tokens" (or "token_ids", "generated", "output_tokens", "new_tokens", "ids"). Tokens that
start with the formatted prompt's ids have them stripped; trailing stop ids are ignored on both sides. Each list
found (named by its JSON path; a list whose records all carry "method", "recipe", "mode", "variant" or
"name" is split by that value) is compared with every HF recipe: identical, or the first differing position (a
sequence that is a prefix of the other counts as differing at the shorter length, flagged "prefix"). A record's
"prompt_tokens"/"prompt_ids", if present, is checked against ours too.

Commands (from the repository root):

  # CPU smoke test: 1 prompt, 16 tokens, no compilation
  python bench/hf_peer.py --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf --device cpu --quick --out /tmp/hf_peer
  # GPU
  python bench/hf_peer.py --gguf PATH/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --out $OUT [--ours ours.json]

A run too long for one call splits in two: `--recipes eager,prompt_lookup`, then `--recipes static_compile --resume
FIRST/hf_peer.json` (recipes there are kept, not rerun; prompts, stop ids and settings must match). `--only 4,5`
runs some prompts; `--runs N` changes the number of timed runs.

transformers needs `gguf` and `accelerate` to load a GGUF file. The GPU image has accelerate but not gguf:
bench/hf_peer_wheels.sh downloads gguf's wheel into .whl/ here, and installs it there into /tmp/site:

  bash bench/hf_peer_wheels.sh install && PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 \
    python3 bench/hf_peer.py --gguf PATH/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --out $OUT
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only: the GPU machine has no network
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PROMPTS = os.path.join(REPO, "examples", "held_out_prompts.json")
PROMPT_SETS = (("questions", 2), ("code_tasks", 2), ("edit_tasks", None))
STOP_TOKEN_NAMES = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>", "<end_of_turn>")
TOKEN_KEYS = ("tokens", "token_ids", "generated", "output_tokens", "new_tokens", "ids")
GROUP_KEYS = ("method", "recipe", "mode", "variant", "name")
# generation_config fields that add a logits processor even to greedy decoding (repetition_penalty is overridden).
LOGITS_PROCESSOR_KEYS = (
  "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids", "sequence_bias", "min_length",
  "min_new_tokens", "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id",
  "exponential_decay_length_penalty", "renormalize_logits", "watermarking_config", "forced_decoder_ids",
)  # fmt: skip
PROMPT_TOKEN_KEYS = ("prompt_tokens", "prompt_ids", "prompt_token_ids")


# ---------------------------------------------------------------------------------------------------------------
# Loading


def version(name: str) -> str | None:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


def load(args, dtype):
  """Model and tokenizer from a GGUF file (dequantized by transformers) or a Hugging Face checkpoint directory."""
  t0 = time.perf_counter()
  if args.gguf:
    path = os.path.abspath(args.gguf)
    directory, name = os.path.split(path)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype)
    source = {"gguf": path}
  else:
    directory = os.path.abspath(args.hf_dir)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    source = {"hf_dir": directory}
  model.to(args.device).eval()
  return model, tokenizer, source, time.perf_counter() - t0


def stop_ids(model, tokenizer, override: str | None) -> list[int]:
  if override:
    return [int(x) for x in override.split(",") if x.strip()]
  ids = []
  eos = model.generation_config.eos_token_id
  for e in eos if isinstance(eos, (list, tuple)) else [eos]:
    if e is not None and int(e) not in ids:
      ids.append(int(e))
  vocab = tokenizer.get_vocab()
  for name in STOP_TOKEN_NAMES:
    if name in vocab and vocab[name] not in ids:
      ids.append(int(vocab[name]))
  if not ids:
    raise SystemExit("no stop token id found: pass --eos-ids")
  return ids


def load_prompts(path: str, quick: bool) -> list[dict]:
  with open(path) as f:
    data = json.load(f)
  prompts = []
  for key, count in PROMPT_SETS:
    items = data[key] if count is None else data[key][:count]
    for i, text in enumerate(items):
      prompts.append({"set": key, "index_in_set": i, "text": text})
  return prompts[:1] if quick else prompts  # --quick: the first question only


def format_prompt(tokenizer, text: str) -> tuple[str, list[int]]:
  messages = [{"role": "user", "content": text}]
  formatted = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
  encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
  ids = encoded["input_ids"]
  if ids and isinstance(ids[0], list):
    ids = ids[0]
  return formatted, [int(t) for t in ids]


# ---------------------------------------------------------------------------------------------------------------
# Timing


def sync(device: str):
  if device.startswith("cuda"):
    torch.cuda.synchronize()


def compile_counters() -> dict[str, int]:
  """torch.compile's event counters (dynamo graphs, recompiles, inductor / CUDA graph events), flattened."""
  try:
    from torch._dynamo.utils import counters

    return {f"{cat}.{k}": int(v) for cat, c in counters.items() for k, v in c.items() if isinstance(v, int)}
  except Exception:
    return {}


def counters_diff(before: dict, after: dict) -> dict[str, int]:
  """What changed between two `compile_counters()` snapshots (empty: nothing compiled or recorded)."""
  return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


class ForwardCounter:
  """Counts the model's forward calls (prefill included) while attached; used on untimed warm-up calls only."""

  def __init__(self, model):
    self.model, self.count, self.handle = model, 0, None

  def __enter__(self):
    self.handle = self.model.register_forward_hook(self._hook)
    return self

  def _hook(self, *_):
    self.count += 1

  def __exit__(self, *_):
    self.handle.remove()


def generate(model, ids, device, kwargs) -> tuple[list[int], float]:
  input_ids = torch.tensor([ids], dtype=torch.long, device=device)
  attention_mask = torch.ones_like(input_ids)
  sync(device)
  t0 = time.perf_counter()
  out = model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)  # generate runs under no_grad
  sync(device)
  elapsed = time.perf_counter() - t0
  return [int(t) for t in out[0, len(ids) :].tolist()], elapsed


def run_recipe(name, model, prompts, args, kwargs, count_forwards: bool) -> dict:
  rows = []
  for p in prompts:
    if count_forwards:
      with ForwardCounter(model) as counter:
        warm_tokens, warm_s = generate(model, p["ids"], args.device, kwargs)
      forwards = counter.count
    else:
      warm_tokens, warm_s = generate(model, p["ids"], args.device, kwargs)
      forwards = None
    counters_before = compile_counters()
    times, tokens, runs_agree = [], warm_tokens, True
    for _ in range(args.runs):
      tokens, t = generate(model, p["ids"], args.device, kwargs)
      times.append(t)
      if tokens != warm_tokens:
        runs_agree = False
        print(f"  [{name}] prompt {p['n']}: a timed run's tokens differ from the warm-up's", file=sys.stderr)
    compiled_while_timed = counters_diff(counters_before, compile_counters())
    median = statistics.median(times)
    row = {
      "prompt": p["n"],
      "new_tokens": len(tokens),
      "stopped_at_eos": bool(tokens) and tokens[-1] in args.stop_ids,
      "times_s": times,
      "median_s": median,
      "tok_per_s": len(tokens) / median,
      "warmup_s": warm_s,
      "runs_agree": runs_agree,
      "forwards": forwards,
      "tokens_per_forward": (len(tokens) / forwards) if forwards else None,
      "compile_events_while_timed": compiled_while_timed,  # torch.compile counters that moved during timing
      "tokens": tokens,
    }
    rows.append(row)
    print(
      f"  [{name}] prompt {p['n']} ({p['set']}): {row['new_tokens']} tokens, median {median * 1e3:.1f} ms, "
      f"{row['tok_per_s']:.1f} tok/s" + (f", {forwards} forwards" if forwards else ""),
      flush=True,
    )
  total_tokens = sum(r["new_tokens"] for r in rows)
  total_s = sum(r["median_s"] for r in rows)
  return {
    "kwargs": {
      k: (repr(v) if not isinstance(v, (int, float, str, bool, list, type(None))) else v) for k, v in kwargs.items()
    },
    "per_prompt": rows,
    "total_tokens": total_tokens,
    "total_median_s": total_s,
    "tok_per_s": total_tokens / total_s if total_s else None,
    "mean_tok_per_s": float(np.mean([r["tok_per_s"] for r in rows])) if rows else None,
  }


# ---------------------------------------------------------------------------------------------------------------
# Agreement


def strip_stop(tokens: list[int], stop: list[int]) -> list[int]:
  end = len(tokens)
  while end and tokens[end - 1] in stop:
    end -= 1
  return tokens[:end]


def compare(ref: list[int], other: list[int], stop: list[int]) -> dict:
  a, b = strip_stop(ref, stop), strip_stop(other, stop)
  if a == b:
    return {"identical": True, "first_diff": None}
  n = min(len(a), len(b))
  first = next((i for i in range(n) if a[i] != b[i]), n)
  return {"identical": False, "first_diff": first, "prefix": first == n, "len_ref": len(a), "len_other": len(b)}


def agreement(ref_rows: list[dict], rows: list[dict], stop: list[int]) -> dict:
  """Each prompt that both recipes ran (matched by prompt number): identical tokens, or the first difference."""
  ref = {r["prompt"]: r for r in ref_rows}
  per = [
    dict(prompt=o["prompt"], **compare(ref[o["prompt"]]["tokens"], o["tokens"], stop))
    for o in rows
    if o["prompt"] in ref
  ]
  differing = [p for p in per if not p["identical"]]
  return {
    "rows": len(per),
    "rows_differing": len(differing),
    "first_diffs": {p["prompt"]: p["first_diff"] for p in differing},
    "per_prompt": per,
  }


def find_record_lists(node, path="$"):
  """Every list of dicts holding "prompt" and a token list, with its JSON path."""
  found = []
  if isinstance(node, list):
    recs = [x for x in node if isinstance(x, dict) and "prompt" in x and any(k in x for k in TOKEN_KEYS)]
    if recs:  # a flat list of several methods' records: one group per method
      label = next((k for k in GROUP_KEYS if all(k in r for r in recs)), None)
      if label is None:
        found.append((path, recs))
      else:
        for value in dict.fromkeys(str(r[label]) for r in recs):
          found.append((f"{path}[{label}={value}]", [r for r in recs if str(r[label]) == value]))
    for i, x in enumerate(node):
      if isinstance(x, (dict, list)):
        found += find_record_lists(x, f"{path}[{i}]")
  elif isinstance(node, dict):
    for k, v in node.items():
      found += find_record_lists(v, f"{path}.{k}")
  return found


def record_tokens(rec: dict) -> list[int] | None:
  for k in TOKEN_KEYS:
    v = rec.get(k)
    if isinstance(v, list) and all(isinstance(t, (int, np.integer)) for t in v):
      return [int(t) for t in v]
    if isinstance(v, list) and v and isinstance(v[0], list):  # [[...]]: a batch of one
      return [int(t) for t in v[0]]
  return None


def match_prompt(rec: dict, prompts: list[dict]) -> dict | None:
  key = rec.get("prompt")
  if isinstance(key, int):
    return next((p for p in prompts if p["n"] == key), None)
  if isinstance(key, str):
    for p in prompts:
      if key in (p["text"], p["formatted"]) or key.strip() in (p["text"].strip(), p["formatted"].strip()):
        return p
  return None


def compare_ours(path: str, prompts: list[dict], recipes: dict, stop: list[int]) -> dict:
  with open(path) as f:
    data = json.load(f)
  lists = find_record_lists(data)
  report = {"file": os.path.abspath(path), "lists": {}}
  if not lists:
    report["error"] = f"no list of records with 'prompt' and one of {TOKEN_KEYS}"
    return report
  for json_path, recs in lists:
    out = {"records": len(recs), "matched": 0, "unmatched_prompts": [], "vs": {}}  # unmatched: unknown or not run
    pairs = []
    for rec in recs:
      p, tokens = match_prompt(rec, prompts), record_tokens(rec)
      if p is None or tokens is None:
        out["unmatched_prompts"].append(str(rec.get("prompt"))[:60])
        continue
      if tokens[: len(p["ids"])] == p["ids"]:
        tokens = tokens[len(p["ids"]) :]
      prompt_ids = next((rec[k] for k in PROMPT_TOKEN_KEYS if isinstance(rec.get(k), list)), None)
      pairs.append((p, tokens, None if prompt_ids is None else [int(t) for t in prompt_ids] == p["ids"]))
    out["matched"] = len(pairs)
    out["prompt_ids_agree"] = {p["n"]: same for p, _, same in pairs if same is not None}
    for name, res in recipes.items():
      by_prompt = {r["prompt"]: r for r in res["per_prompt"]}
      per = [
        dict(prompt=p["n"], **compare(by_prompt[p["n"]]["tokens"], t, stop)) for p, t, _ in pairs if p["n"] in by_prompt
      ]
      out["vs"][name] = {
        "rows": len(per),
        "identical": sum(x["identical"] for x in per),
        "first_diffs": {x["prompt"]: x["first_diff"] for x in per if not x["identical"]},
        "per_prompt": per,
      }
    report["lists"][json_path] = out
  return report


# ---------------------------------------------------------------------------------------------------------------
# Main


def update_agreement(result: dict, stop: list[int]):
  recipes = result["recipes"]
  if "eager" in recipes:
    for name, res in recipes.items():
      if name != "eager":
        result["agreement"][name] = agreement(recipes["eager"]["per_prompt"], res["per_prompt"], stop)


def resume(path: str, result: dict):
  """Keep the recipes an earlier hf_peer.json measured (same prompts and settings), so a run can be split in two."""
  with open(path) as f:
    prev = json.load(f)
  for key in ("max_new_tokens", "max_cache_len", "prompt_lookup_num_tokens", "max_matching_ngram_size"):
    if prev["settings"].get(key) != result["settings"][key]:
      raise SystemExit(f"--resume {path}: {key} was {prev['settings'].get(key)}, now {result['settings'][key]}")
  ids = {p["n"]: p["ids"] for p in result["prompts"]}
  if any(ids.get(p["n"], p["ids"]) != p["ids"] for p in prev["prompts"]):
    raise SystemExit(f"--resume {path}: its prompts' token ids differ from these")
  if prev["model"].get("stop_ids") != result["model"]["stop_ids"]:
    raise SystemExit(f"--resume {path}: stop ids {prev['model'].get('stop_ids')}, now {result['model']['stop_ids']}")
  result["recipes"].update(prev["recipes"])
  result["resumed_from"] = {"file": os.path.abspath(path), "env": prev["env"], "recipes": sorted(prev["recipes"])}
  for key in ("compile_s", "compile_events_first_call"):
    if key in prev:
      result[key] = prev[key]
  known = {p["n"] for p in result["prompts"]}
  result["prompts"] += [p for p in prev["prompts"] if p["n"] not in known]
  result["prompts"].sort(key=lambda p: p["n"])


def env_info(args) -> dict:
  dev = args.device
  return {
    "device": torch.cuda.get_device_name(torch.device(dev))
    if dev.startswith("cuda")
    else platform.processor() or "cpu",
    "device_arg": dev,
    "cuda": torch.version.cuda,
    "torch": torch.__version__,
    "transformers": transformers.__version__,
    "tokenizers": version("tokenizers"),
    "gguf": version("gguf"),
    "accelerate": version("accelerate"),
    "numpy": np.__version__,
    "python": platform.python_version(),
    "torch_threads": torch.get_num_threads(),
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "argv": sys.argv,
    "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
  }


def write(out_dir: str, result: dict):
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, "hf_peer.json")
  with open(path + ".tmp", "w") as f:
    json.dump(result, f, indent=1)
  os.replace(path + ".tmp", path)
  return path


def print_table(result: dict):
  recipes = result["recipes"]
  base = recipes.get("eager", {}).get("tok_per_s")
  env, model, settings = result["env"], result["model"], result["settings"]
  print(f"\n{env['device']} | {model['model_type']} | B=1 greedy | max {settings['max_new_tokens']} new tokens")
  print(f"{'recipe':<16} {'tokens':>7} {'median s':>9} {'tok/s':>8} {'x eager':>8}  same tokens as eager")
  for name, res in recipes.items():
    agree = result["agreement"].get(name)
    same = (
      "reference"
      if name == "eager"
      else (
        "all rows"
        if agree and not agree["rows_differing"]
        else f"{agree['rows_differing']}/{agree['rows']} differ, first at {agree['first_diffs']}"
        if agree
        else "-"
      )
    )
    speed = f"{res['tok_per_s'] / base:.2f}" if base else "-"
    print(
      f"{name:<16} {res['total_tokens']:>7} {res['total_median_s']:>9.3f} {res['tok_per_s']:>8.1f} {speed:>8}  {same}"
    )
  moved = {
    f"{name}[{r['prompt']}]": r["compile_events_while_timed"]
    for name, res in recipes.items()
    for r in res["per_prompt"]
    if r["compile_events_while_timed"]
  }
  if moved:
    print(f"torch.compile counters moved during timed runs: {moved}")
  if "compile_s" in result:
    print(f"(static cache compile + first call: {result['compile_s']:.1f} s, not timed)")
  ours = result.get("ours")
  if ours:
    for json_path, rep in ours.get("lists", {}).items():
      for name, v in rep["vs"].items():
        print(f"ours {json_path} vs {name}: {v['identical']}/{v['rows']} identical; first diffs {v['first_diffs']}")
    if "error" in ours:
      print(f"ours: {ours['error']}")


def main(argv=None):
  ap = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  src = ap.add_mutually_exclusive_group(required=True)
  src.add_argument("--gguf", help="GGUF checkpoint (transformers dequantizes it)")
  src.add_argument("--hf-dir", help="Hugging Face checkpoint directory")
  ap.add_argument("--prompts", default=DEFAULT_PROMPTS, help="held-out prompts JSON (default examples/...)")
  ap.add_argument("--only", default=None, help="comma-separated prompt numbers (0-5) to run, e.g. 4,5")
  ap.add_argument("--max-new-tokens", type=int, default=None, help="default 256 (16 with --quick)")
  ap.add_argument(
    "--runs", type=int, default=None, help="timed runs per prompt after 1 warm-up, median kept (3; --quick 1)"
  )
  ap.add_argument("--recipes", default="eager,static_compile,prompt_lookup", help="comma-separated subset")
  ap.add_argument("--prompt-lookup-num-tokens", type=int, default=10)
  ap.add_argument("--max-matching-ngram-size", type=int, default=None, help="transformers' default (2) if unset")
  ap.add_argument("--compile-mode", default="reduce-overhead", help="CompileConfig mode for the static recipe")
  ap.add_argument("--compile-fullgraph", action="store_true", help="CompileConfig(fullgraph=True)")
  ap.add_argument("--no-compile", action="store_true", help="static cache without compilation")
  ap.add_argument("--compile-on-cpu", action="store_true", help="compile the static recipe on CPU too (tests only)")
  ap.add_argument("--eos-ids", default=None, help="comma-separated stop ids (default: generation config + vocab)")
  ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
  ap.add_argument("--device", default="cuda")
  ap.add_argument("--ours", default=None, help="our bench's JSON with per-prompt greedy tokens (see the docstring)")
  ap.add_argument("--resume", default=None, help="an earlier hf_peer.json: keep its recipes, run only the others")
  ap.add_argument("--quick", action="store_true", help="smoke test: 1 prompt, 16 tokens, no compilation")
  ap.add_argument("--out", default=os.path.join(REPO, "bench", "out"), help="output directory")
  args = ap.parse_args(argv)
  if args.max_new_tokens is None:
    args.max_new_tokens = 16 if args.quick else 256
  if args.runs is None:
    args.runs = 1 if args.quick else 3
  compile_on = not (args.quick or args.no_compile or not args.device.startswith("cuda")) or args.compile_on_cpu
  recipes_wanted = [r.strip() for r in args.recipes.split(",") if r.strip()]
  unknown = set(recipes_wanted) - {"eager", "static_compile", "prompt_lookup"}
  if unknown:
    ap.error(f"unknown recipes {sorted(unknown)}")
  if "eager" not in recipes_wanted:
    print("note: without 'eager' there is no reference for token agreement", file=sys.stderr)

  dtype = getattr(torch, args.dtype)
  model, tokenizer, source, load_s = load(args, dtype)
  args.stop_ids = stop_ids(model, tokenizer, args.eos_ids)
  prompts = load_prompts(args.prompts, quick=args.quick and not args.only)
  for n, p in enumerate(prompts):
    p["n"] = n
    p["formatted"], p["ids"] = format_prompt(tokenizer, p["text"])
  # One cache length for every prompt (all of them, even those --only leaves out): one compiled decode step.
  max_cache_len = max(len(p["ids"]) for p in prompts) + args.max_new_tokens
  if args.only:
    keep = {int(x) for x in args.only.split(",")}
    prompts = [p for p in prompts if p["n"] in keep]
  print(
    f"loaded {source} in {load_s:.1f} s: {model.config.model_type}, {args.dtype}, on {args.device}; "
    f"stop ids {args.stop_ids}; {len(prompts)} prompts of {[len(p['ids']) for p in prompts]} tokens",
    flush=True,
  )

  # Plain greedy: a checkpoint's generation_config.json (Qwen2.5's: repetition_penalty 1.1, sampling) must not leak in.
  greedy = dict(
    do_sample=False, temperature=None, top_p=None, top_k=None, repetition_penalty=1.0,
    max_new_tokens=args.max_new_tokens, eos_token_id=args.stop_ids, pad_token_id=args.stop_ids[0],
  )  # fmt: skip
  leaks = {k: v for k, v in model.generation_config.to_dict().items() if k in LOGITS_PROCESSOR_KEYS and v}
  if leaks:
    print(f"WARNING: generation_config sets logits processors that greedy would apply: {leaks}", file=sys.stderr)
  static = dict(greedy, cache_implementation="static", max_cache_len=max_cache_len)
  if compile_on:
    static["compile_config"] = transformers.CompileConfig(mode=args.compile_mode, fullgraph=args.compile_fullgraph)
    static["compile_config"]._compile_all_devices = args.compile_on_cpu or None  # transformers' switch for CPU
  else:
    static["disable_compile"] = True
  lookup = dict(greedy, prompt_lookup_num_tokens=args.prompt_lookup_num_tokens)
  if args.max_matching_ngram_size is not None:
    lookup["max_matching_ngram_size"] = args.max_matching_ngram_size
  static_name = "static_compile" if compile_on else "static_eager"

  result = {
    "about": "HF transformers peer: B=1 greedy; tok/s = emitted tokens / wall time of generate (prefill included), "
    f"median of {args.runs} runs after 1 warm-up; agreement = tokens vs the eager recipe (trailing stop ids ignored)",
    "env": env_info(args),
    "model": {
      **source,
      "model_type": model.config.model_type,
      "params": sum(p.numel() for p in model.parameters()),
      "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
      # transformers 5.x keeps some GGUF architectures' weights packed (GgufLinear); qwen2 and llama are dequantized
      # to --dtype at load time. Non-empty here means the matmuls ran on packed blocks instead.
      "gguf_packed_modules": len(getattr(getattr(model, "hf_quantizer", None), "packed_modules", None) or {}),
      "dtype": args.dtype,
      "attn_implementation": getattr(model.config, "_attn_implementation", None),
      "load_s": load_s,
      "stop_ids": args.stop_ids,
      "tokenizer_eos": [tokenizer.eos_token, tokenizer.eos_token_id],
      "generation_config": model.generation_config.to_diff_dict(),  # the checkpoint's; the recipes' kwargs override
    },
    "settings": {
      "max_new_tokens": args.max_new_tokens,
      "runs": args.runs,
      "prompt_lookup_num_tokens": args.prompt_lookup_num_tokens,
      "max_matching_ngram_size": args.max_matching_ngram_size,
      "compile": compile_on,
      "compile_mode": args.compile_mode if compile_on else None,
      "compile_fullgraph": args.compile_fullgraph if compile_on else None,
      "max_cache_len": max_cache_len,
      "quick": args.quick,
    },
    "prompts": [{k: p[k] for k in ("n", "set", "index_in_set", "text", "formatted", "ids")} for p in prompts],
    "recipes": {},
    "agreement": {},
  }

  plan = {"eager": ("eager", greedy, True), "static_compile": (static_name, static, False)}
  plan["prompt_lookup"] = ("prompt_lookup", lookup, True)
  if args.resume:
    resume(args.resume, result)
  for key in recipes_wanted:
    name, kwargs, count = plan[key]
    if name in result["recipes"]:
      print(f"{name}: kept from {args.resume}", flush=True)
      continue
    print(f"{name}:", flush=True)
    if key == "static_compile" and compile_on:
      c0 = compile_counters()
      _, compile_s = generate(model, prompts[0]["ids"], args.device, kwargs)
      result["compile_s"] = compile_s
      result["compile_events_first_call"] = counters_diff(c0, compile_counters())
      if not any(k.endswith("unique_graphs") for k in result["compile_events_first_call"]):
        print("  WARNING: the first static call compiled nothing: transformers did not auto-compile", file=sys.stderr)
      print(f"  compiled in {compile_s:.1f} s (first call, untimed)", flush=True)
    if args.device.startswith("cuda"):
      torch.cuda.reset_peak_memory_stats()
    result["recipes"][name] = run_recipe(name, model, prompts, args, kwargs, count)
    if args.device.startswith("cuda"):
      result["recipes"][name]["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    update_agreement(result, args.stop_ids)
    write(args.out, result)  # after every recipe: a run cut short keeps what it measured
  update_agreement(result, args.stop_ids)

  if args.ours:
    result["ours"] = compare_ours(args.ours, prompts, result["recipes"], args.stop_ids)
  path = write(args.out, result)
  print_table(result)
  print(f"\nwrote {path}")


if __name__ == "__main__":
  main()
