"""A real target on the GPU: its decode step against the memory floor, and greedy tokens/s with speculation.

Models (`--model`, a small registry below; the Qwen loader is imported only when chosen):
  smollm2             SmolLM2-135M-Instruct (`load_smollm2`), with its shipped EAGLE head
  qwen2.5-coder-1.5b  Qwen2.5-Coder-1.5B-Instruct (`load_qwen2_5_coder`), with its shipped EAGLE head

Everything runs once per `--kernels` value (`TransformerConfig.kernels`, xla and/or pallas; pallas_xla_trees is
pallas with `tree_kernels=False` on the target and the head: tree calls on XLA's blocks), bf16 on a
GPU, float32 on a CPU (`--dtype`); the step section at B=1, the generate section at `--batch-size` rows a call (1).

Section `step`: the target's T=1 decode step (with its greedy sampling) and its verification calls of T
tokens (`--step-ts`, default 3,5,8,16; every logit consumed) on a cache of P + max_new_tokens + 16 slots,
decoding from position P (`--step-prompt-len`, default 256). Each is N calls inside one jitted
`fori_loop`, every call's output feeding the next (`bench/decode.py`'s `ComponentTimer.model_step`, timed by
`common.time_per_iter`: median of loops, t(2N)/t(N) checked). Reported: ms per call, verify/step ratio,
the weight bytes a call reads (every parameter, less an untied input embedding, of which it reads one
row), the KV cache's bytes, and the floor = weight bytes read / the device's copy bandwidth, measured in
the same run (`common.copy_bandwidth`: bytes read + written per second of `x = x + 1` over 2 GB), with
step/floor. With kernels=pallas on a GPU it also records whether each call lowers to Triton kernels. With an
EAGLE head: its greedy draft phase of a chain round per K of `--eagle-ks` (`bench/eagle_draft.py`'s
`draft_phase`), in ms and in target steps. With `--block PATH`: the block drafter's greedy draft phase of a chain
round per K of `--block-ks` (`block_draft_phase`: its one call of 2K entries, context and placeholders, then the
argmax of each of the K positions), in ms, in target steps and in EAGLE head calls (one head call = the head's
draft phase of a K=1 chain: its call on 2 entries and the argmax; only with an EAGLE head).

Section `generate`: `--modes` greedy (`all_greedy=True`, the default), t1, t1_no_filters or mixed (even rows
greedy, odd rows T=1; B >= 2), `--batch-size` rows a call (the prompts in groups, the last group filled by
cycling from the first prompt), on the held-out prompts of examples/held_out_prompts.json
(`questions` 0-1, `code_tasks` 0-1, `edit_tasks` 0-1, in the model's chat template, padded to one P so
each configuration compiles once), `--max-new-tokens` (256), eos = the model's EOS ids. Configurations
per kernels value: plain `generate`; `speculative_generate` with `PromptLookupDrafter((3, 2))` at K in
`--ks` (2,4,8); with an EAGLE head, chains at K in `--eagle-ks` (2) and trees `--trees` (3x2x1, K = its
depth), the head on the target's blocks or on `--eagle-kernels`; with `--block PATH` (a block drafter's file, the coder), chains at K in `--block-ks` (8) and trees
`--block-trees` (none; the `--trees` syntax, K = its depth). Per configuration: tokens/s = emitted tokens of
the prompts, run one after the other / wall time (median of `--repeats` (3) sweeps after one compile sweep),
speed-up over the BEST plain generate of all kernels values (and over the same kernels value's), mean accepted
length (tokens per target pass), acceptance, the speed-up the component costs predict (mean accepted length / (verification of the round's
N+1 tokens + the draft phase), in target steps from the step section (the EAGLE head's and the block drafter's
draft phases; prompt lookup's drafting counted as free); none for trees), and whether the tokens equal plain greedy's of the same kernels value: the rows (prompts)
that differ, the divergence rate (rows that differ / rows) and each differing row's first differing
position. In bf16 a T=1 step and a T=K+1 verification round differently, so near-ties may flip, and
everything after a flip differs. Plain greedy's rows also keep, per prompt, the token ids (to compare
with Hugging Face transformers elsewhere) and the first 300 characters of the decoded text.

Run (from the repository root):

    PYTHONPATH=. python3 bench/real_target.py --model smollm2 --quick --out /tmp/rt       # CPU smoke, ~2 min
    PYTHONPATH=.:/tmp/site python3 bench/real_target.py --model smollm2 --out $OUT         # GPU

    # Qwen, after bench/gguf_parts.py's calls (the GGUF in ~/.cache/specdec_jax there); carry [".whl"] (gguf):
    pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=.:/tmp/site python3 \\
        bench/real_target.py --model qwen2.5-coder-1.5b --kernels xla --out /root/rt; cp /root/rt/* $OUT/
    PYTHONPATH=.:/tmp/site python3 bench/real_target.py --model qwen2.5-coder-1.5b --kernels pallas \\
        --out /root/rt --resume; cp /root/rt/* $OUT/

The GGUF must be where the loader looks (bench/gguf_parts.py puts it there; the `gguf` wheel in /tmp/site).
One command is limited to 10 minutes: `--budget-s` (default 540) starts no new configuration after that
many seconds, so the JSON and plots are still written; `--resume` adds to the JSON already in --out
(rows of the same kernels value, section and configuration are replaced), so the kernels values (or the
sections) can run in separate commands. A device call empties $OUT before its command, hence /root/rt above
(it lasts as long as the machine stays warm). Compiled programs go to the persistent cache `--cache-dir`
(/tmp/jax_cache).

Writes OUT/real_target.json (every number, prompts and their ids, device, versions, date, command
lines), OUT/real_target_tokens.png (tokens/s per configuration and kernels value) and
OUT/real_target_step.png (ms per call against T, with the floor) and OUT/real_target_acceptance.png
(acceptance by draft position of each speculative row).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import shlex
import sys
import time
import traceback
import warnings
from typing import Callable

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from bench import common  # noqa: E402
from bench import decode as bd  # noqa: E402
from bench import smollm2 as bs  # noqa: E402
from specdec_jax import PromptLookupDrafter, SamplingParams, generate, speculative_generate  # noqa: E402
from specdec_jax.models import Transformer  # noqa: E402

# ----------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """What the benchmark needs of a model; `load` takes (dtype, kernels), `load_eagle` (dtype, kernels, path=None)."""

  name: str
  title: str
  load: Callable  # -> (Transformer, tokenizers.Tokenizer)
  chat_prompt: Callable[[str], str]
  eos_ids: tuple[int, ...]
  load_eagle: Callable | None = None  # -> EagleDrafter (path None: the shipped head)
  shipped_eagle: bool = True  # whether path=None finds a head
  load_block: Callable | None = None  # (dtype, path) -> BlockDrafter
  note: str | None = None


def _smollm2() -> ModelSpec:
  from specdec_jax.models import load_smollm2, load_smollm2_eagle  # noqa: PLC0415
  from specdec_jax.models.loaders import smollm2  # noqa: PLC0415

  return ModelSpec(
    name="smollm2",
    title="SmolLM2-135M-Instruct",
    load=lambda dtype, kernels: load_smollm2(dtype, kernels=kernels),
    chat_prompt=smollm2.chat_prompt,
    eos_ids=tuple(smollm2.SMOLLM2_EOS_IDS),
    load_eagle=lambda dtype, kernels, path=None: load_smollm2_eagle(dtype, path=path, kernels=kernels),
  )


def _qwen2_5_coder() -> ModelSpec:
  from specdec_jax import models  # noqa: PLC0415
  from specdec_jax.models.loaders import qwen2_5_coder  # noqa: PLC0415

  shipped = os.path.isfile(qwen2_5_coder.QWEN2_5_CODER_EAGLE_PATH)
  return ModelSpec(
    name="qwen2.5-coder-1.5b",
    title="Qwen2.5-Coder-1.5B-Instruct",
    load=lambda dtype, kernels: models.load_qwen2_5_coder(dtype, kernels=kernels),
    chat_prompt=qwen2_5_coder.chat_prompt,
    eos_ids=tuple(qwen2_5_coder.QWEN2_5_CODER_EOS_IDS),
    load_eagle=lambda dtype, kernels, path=None: models.load_qwen2_5_coder_eagle(dtype, path, kernels),
    shipped_eagle=shipped,
    load_block=lambda dtype, path: models.load_qwen2_5_coder_block_drafter(dtype, path),
    note=None if shipped else "no EAGLE head is shipped for Qwen2.5-Coder-1.5B (--eagle PATH names one)",
  )


MODELS: dict[str, Callable[[], ModelSpec]] = {"smollm2": _smollm2, "qwen2.5-coder-1.5b": _qwen2_5_coder}

# ----------------------------------------------------------------------------
# Prompts
# ----------------------------------------------------------------------------

PROMPT_NAMES = ("question0", "question1", "code0", "code1", "edit0", "edit1")
QUICK_PROMPTS = ("question0", "edit0")
_SOURCES = {"question": "questions", "code": "code_tasks", "edit": "edit_tasks"}


def held_out_prompts(names) -> dict[str, str]:
  """name ("question0", "code1", "edit0", ...) -> the raw request from examples/held_out_prompts.json."""
  with open(os.path.join(REPO, "examples", "held_out_prompts.json")) as f:
    data = json.load(f)
  out = {}
  for name in names:
    kind, idx = name.rstrip("0123456789"), name[len(name.rstrip("0123456789")) :]
    if kind not in _SOURCES or not idx or int(idx) >= len(data[_SOURCES[kind]]):
      raise SystemExit(f"unknown prompt {name!r}: question<i>, code<i> or edit<i> of examples/held_out_prompts.json")
    out[name] = data[_SOURCES[kind]][int(idx)]
  return out


# ----------------------------------------------------------------------------
# Step section
# ----------------------------------------------------------------------------


def weight_bytes(model) -> dict:
  """Bytes of the model's parameters, and those one call reads (an untied input embedding: one row only)."""
  total = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  embed = model.embed[...].nbytes
  tied = bool(getattr(model.config, "tie_embeddings", True))
  return {
    "weight_bytes": total,
    "embed_bytes": embed,
    "tied_embeddings": tied,
    "read_bytes": total - (0 if tied else embed),
  }


def cache_bytes(model, cache_len: int) -> int:
  shapes = jax.eval_shape(lambda: model.init_cache(1, cache_len))
  return sum(math.prod(s.shape) * s.dtype.itemsize for s in jax.tree.leaves(shapes))


def pallas_path(model, t: int, cache_len: int) -> bool:
  """Whether a call of T tokens lowers to Triton kernels (lowering only, no compile)."""
  tokens = jnp.zeros((1, t), jnp.int32)
  pos = jnp.arange(t, dtype=jnp.int32)[None]
  call = jax.jit(lambda m, x, p: m(x, p, m.init_cache(1, cache_len))[0])
  return "xla.gpu.triton" in call.lower(model, tokens, pos).as_text()


def step_section(model, kernels: str, args, bandwidth: float, report, save, budget, eagle=None, block=None) -> None:
  p, n = args.step_prompt_len, args.max_new_tokens
  cache_len = p + n + 16
  wb = weight_bytes(model)
  kv = cache_bytes(model, cache_len)
  floor_s = wb["read_bytes"] / bandwidth
  report["weights"][kernels] = {**wb, "kv_cache_bytes": kv, "cache_len": cache_len}
  timer = bd.ComponentTimer(model, None, target_s=args.target_ms / 1e3, repeats=args.step_repeats, seed=args.seed)
  check_pallas = KERNEL_VALUES[kernels][0] == "pallas" and common.has_gpu()
  t_step = None
  for t in (1, *args.step_ts):
    if budget.over(f"step kernels={kernels} T={t}"):
      continue
    try:
      r = timer.model_step("target", 1, t, cache_len, p, "greedy")
    except Exception as e:  # noqa: BLE001 - record and go on
      error(report, f"step kernels={kernels} T={t}", e)
      continue
    s = r["per_iter_s"]
    t_step = s if t == 1 else t_step
    row = {
      "kernels": kernels,
      "T": t,
      "ms": s * 1e3,
      "verify_over_step": s / t_step if t_step else None,
      "floor_ms": floor_s * 1e3,
      "over_floor": s / floor_s,
      "floor_with_cache_ms": (wb["read_bytes"] + kv) / bandwidth * 1e3,
      "copy_bytes_per_s": bandwidth,
      "iters": r["iters"],
      "scale": r["scale"],
      "compile_s": r["compile_s"],
      "times_s": r["times_s"],
      "pallas_path": pallas_path(model, t, cache_len) if check_pallas else None,
    }
    upsert(report["step"], row, ("kernels", "T"))
    print(
      f"step kernels={kernels:<6} T={t:<3} {row['ms']:8.3f} ms  x{bd._fmt(row['verify_over_step'], '.2f')} of T=1  "
      f"{row['over_floor']:.2f}x floor ({row['floor_ms']:.3f} ms)  t(2N)/t(N) {r['scale']:.2f}  "
      f"(compile {r['compile_s']:.1f}s)" + ("" if row["pallas_path"] is None else f"  triton {row['pallas_path']}"),
      flush=True,
    )
    save()
  if eagle is not None and t_step:
    draft_phase_rows(eagle, kernels, args, p, cache_len, t_step, report, save, budget)
  if block is not None and t_step:
    block_phase_rows(block, eagle, kernels, args, p, cache_len, t_step, report, save, budget)


def draft_phase_rows(eagle, kernels, args, p, cache_len, t_step, report, save, budget) -> None:
  """The EAGLE head's greedy draft phase of a chain round (catch-up call, then K-1 one-entry calls, each with its
  argmax: `bench/eagle_draft.py`'s `draft_phase`), per K of --eagle-ks, in target steps: a component of the
  predicted speed-ups (`finish`)."""
  from bench.eagle_draft import draft_phase  # noqa: PLC0415

  for k in args.eagle_ks:
    if budget.over(f"draft phase kernels={kernels} K={k}"):
      continue
    try:
      r = draft_phase(
        eagle,
        b=1,
        k=k,
        mode="greedy",
        p0=p,
        cache_len=cache_len,
        target_s=args.target_ms / 1e3,
        repeats=args.step_repeats,
      )
    except Exception as e:  # noqa: BLE001 - record and go on
      error(report, f"draft phase kernels={kernels} K={k}", e)
      continue
    row = {"kernels": kernels, "K": k, "ms": r["per_iter_s"] * 1e3, "over_step": r["per_iter_s"] / t_step}
    upsert(report.setdefault("draft_phase", []), row, ("kernels", "K"))
    print(f"draft phase kernels={kernels:<6} K={k:<3} {row['ms']:8.3f} ms  x{row['over_step']:.2f} of a step")
    save()


def block_phase_rows(block, eagle, kernels, args, p, cache_len, t_step, report, save, budget) -> None:
  """The block drafter's greedy draft phase of a chain round (`bench/eagle_draft.py`'s `block_draft_phase`), per
  K of --block-ks, in target steps and in EAGLE head calls: issue 33 asks for a call at K=8 of at most 1.5 head
  calls. One head call = the head's draft phase of a K=1 chain (its call on 2 entries, then the argmax), timed
  once per kernels value; None without a head. The block drafter runs XLA's blocks whatever `kernels` is."""
  from bench.eagle_draft import block_draft_phase, draft_phase  # noqa: PLC0415

  timing = dict(p0=p, cache_len=cache_len, target_s=args.target_ms / 1e3, repeats=args.step_repeats)
  head_s = None
  if eagle is not None and not budget.over(f"head call kernels={kernels}"):
    try:
      head_s = draft_phase(eagle, b=1, k=1, mode="greedy", **timing)["per_iter_s"]
    except Exception as e:  # noqa: BLE001 - record and go on
      error(report, f"head call kernels={kernels}", e)
  for k in args.block_ks:
    if budget.over(f"block phase kernels={kernels} K={k}"):
      continue
    try:
      r = block_draft_phase(block, b=1, k=k, **timing)
    except Exception as e:  # noqa: BLE001 - record and go on
      error(report, f"block phase kernels={kernels} K={k}", e)
      continue
    s = r["per_iter_s"]
    row = {
      "kernels": kernels,
      "K": k,
      "ms": s * 1e3,
      "over_step": s / t_step,
      "head_call_ms": None if head_s is None else head_s * 1e3,
      "over_head_call": None if head_s is None else s / head_s,
      "head_call": "the EAGLE head's greedy draft phase of a K=1 chain (one call on 2 entries, then the argmax)",
      "scale": r["scale"],
      "compile_s": r["compile_s"],
    }
    upsert(report.setdefault("block_phase", []), row, ("kernels", "K"))
    print(
      f"block phase kernels={kernels:<6} K={k:<3} {row['ms']:8.3f} ms  x{row['over_step']:.2f} of a step  "
      + (
        "(no EAGLE head call to compare)"
        if head_s is None
        else f"x{row['over_head_call']:.2f} of a head call ({row['head_call_ms']:.3f} ms)"
      ),
      flush=True,
    )
    save()


# ----------------------------------------------------------------------------
# Generate section
# ----------------------------------------------------------------------------


def configurations(args, has_eagle: bool, has_block: bool = False) -> list[dict]:
  """The generate section's rows for one kernels value: plain first (the reference of the others)."""
  out = [{"config": "plain", "drafter": "plain", "K": None, "tree": None}]
  if has_block:
    out += [{"config": f"block K={k}", "drafter": "block", "K": k, "tree": None} for k in args.block_ks]
    out += [
      {"config": f"block {t}", "drafter": "block", "K": bs.parse_tree(t).depth, "tree": t} for t in args.block_trees
    ]
  out += [{"config": f"lookup K={k}", "drafter": "lookup", "K": k, "tree": None} for k in args.ks]
  if has_eagle:
    out += [{"config": f"eagle K={k}", "drafter": "eagle", "K": k, "tree": None} for k in args.eagle_ks]
    out += [{"config": f"eagle {t}", "drafter": "eagle", "K": bs.parse_tree(t).depth, "tree": t} for t in args.trees]
  return out


def divergence(outs, plain_outs, groups, rows_compared=None) -> dict:
  """Rows whose greedy tokens differ from plain decoding's, and each one's first differing position.

  outs, plain_outs: one GenerateOutput per call; groups: each call's row labels; rows_compared: the row
  indices (within a call) to compare (default all; a mixed batch compares its greedy rows).
  """
  first, rows, positions = {}, 0, 0
  for o, p, labels in zip(outs, plain_outs, groups):
    s, q = np.asarray(o.tokens), np.asarray(p.tokens)
    for r, label in enumerate(labels):
      if rows_compared is not None and r not in rows_compared:
        continue
      rows += 1
      d = s[r] != q[r]
      positions += int(d.sum())
      if d.any():
        first[label] = int(np.argmax(d))
  return {
    "identical": not first,
    "rows": rows,
    "rows_differ": len(first),
    "rate": len(first) / rows if rows else 0.0,
    "first_diff": first,
    "positions_differ": positions,
  }


def batch_groups(names, b: int) -> list[list[int]]:
  """The prompts in calls of b rows: consecutive prompts, the last call filled by cycling from the first."""
  n = len(names)
  return [[(start + r) % n for r in range(b)] for start in range(0, n, b)]


def row_labels(names, group) -> list[str]:
  """A call's row labels: the prompt's name, with "#2", "#3" ... where a prompt fills a row again."""
  seen, out = {}, []
  for i in group:
    seen[i] = seen.get(i, 0) + 1
    out.append(names[i] if seen[i] == 1 else f"{names[i]}#{seen[i]}")
  return out


# --modes: how the rows sample. T=1 rows take the default sampler program, or promise no_filters.
MODES = {
  "greedy": ("greedy", {"all_greedy": True}),
  "t1": ("t1", {}),
  "t1_no_filters": ("t1", {"no_filters": True}),
  "mixed": ("mixed", {}),  # even rows greedy, odd rows T=1 (needs --batch-size >= 2)
}


def mode_params(setup: str, b: int, seed: int):
  """(SamplingParams, key) of a call of b rows."""
  if setup == "mixed":
    return SamplingParams.create([0.0 if r % 2 == 0 else 1.0 for r in range(b)]), jax.random.key(seed)
  params, key, _ = bd.mode_setup(setup, b, seed)
  return params, key


def generate_section(model, eagle, kernels: str, spec: ModelSpec, args, prompts, report, save, budget, block=None):
  for mode in args.modes:
    generate_mode(model, eagle, kernels, spec, args, prompts, report, save, budget, mode, block)


def generate_mode(model, eagle, kernels: str, spec: ModelSpec, args, prompts, report, save, budget, mode, block=None):
  names = list(prompts["names"])
  index_groups = batch_groups(names, args.batch_size)
  groups = [row_labels(names, g) for g in index_groups]
  calls = [(jnp.asarray(prompts["tokens"][g]), jnp.asarray(prompts["lengths"][g])) for g in index_groups]
  setup, flags = MODES[mode]
  params, key = mode_params(setup, args.batch_size, args.seed)
  # Greedy rows must equal plain greedy decoding's: every row in greedy mode, the even rows of a mixed batch.
  compared = None if mode == "greedy" else set(range(0, args.batch_size, 2)) if mode == "mixed" else set()
  kw = dict(max_new_tokens=args.max_new_tokens, eos_token_id=spec.eos_ids, **flags)
  lookup = PromptLookupDrafter(bd.LOOKUP_NGRAMS)
  plain_outs = None
  for cfg in configurations(args, eagle is not None, block is not None):
    label = f"kernels={kernels} {mode} {cfg['config']}"
    if budget.over(f"generate {label}"):
      continue
    if cfg["drafter"] == "plain":
      fn = lambda: [generate(model, t, l, params, key, **kw) for t, l in calls]  # noqa: E731
    else:
      drafter = {"lookup": lookup, "eagle": eagle, "block": block}[cfg["drafter"]]
      tree = bs.parse_tree(cfg["tree"]) if cfg["tree"] else None
      fn = lambda d=drafter, k=cfg["K"], tr=tree: [  # noqa: E731
        speculative_generate(model, d, t, l, params, key, num_speculative_tokens=k, draft_tree=tr, **kw)
        for t, l in calls
      ]
    try:
      outs, timing = bd.run_generation(fn, args.repeats)
    except Exception as e:  # noqa: BLE001
      error(report, f"generate {label}", e)
      continue
    stats = bd.stats_summary(outs)
    row = {"kernels": kernels, "mode": mode, **cfg, **stats, **timing, "tok_s": stats["tokens"] / timing["median_s"]}
    row["batch_size"] = args.batch_size
    if cfg["drafter"] == "plain" and compared != set():
      plain_outs = outs
      if mode == "greedy":
        row["greedy_ids"], row["texts"] = {}, {}
        for labels, o in zip(groups, outs):
          for r, label in enumerate(labels):
            ids = np.asarray(o.tokens)[r, : int(np.asarray(o.lengths)[r])].tolist()
            row["greedy_ids"][label] = ids
            row["texts"][label] = prompts["tokenizer"].decode(ids)[:300]
    elif plain_outs is not None:
      row["divergence"] = divergence(outs, plain_outs, groups, compared)
    upsert(report["generate"], row, ("kernels", "mode", "config", "batch_size"))
    finish(report)
    d = row.get("divergence")
    print(
      f"generate kernels={kernels:<6} {mode:<13} {cfg['config']:<14} {row['tok_s']:9.1f} tok/s  {row['tokens']} tokens  "
      f"mean_len {bd._fmt(row['mean_accepted_length'], '.2f')}"
      + (f"  differ {d['rows_differ']}/{d['rows']} {d['first_diff'] or ''}" if d else "")
      + f"  (first sweep {timing['first_call_s']:.1f}s)",
      flush=True,
    )
    save()
    gc.collect()


# ----------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------


def upsert(rows: list, row: dict, key) -> None:
  """Replaces the row with the same values of `key` (a re-run or --resume), else appends."""
  for i, r in enumerate(rows):
    if all(r.get(k) == row.get(k) for k in key):
      rows[i] = row
      return
  rows.append(row)


def error(report, what: str, e: Exception) -> None:
  msg = f"{what}: {type(e).__name__}: {str(e)[:400]}"
  print("ERROR " + msg, flush=True)
  report["errors"].append({"what": what, "error": msg, "traceback": traceback.format_exc()[-3000:]})


def finish(report) -> None:
  """Speed-ups over the best plain generate of all kernels values, and over the same kernels value's (both in
  the row's mode and batch size; rows of runs before --modes are greedy, before --batch-size B=1)."""
  mode = lambda r: r.get("mode", "greedy") + ("" if r.get("batch_size", 1) == 1 else f" B={r['batch_size']}")  # noqa: E731
  plains = {(r["kernels"], mode(r)): r["tok_s"] for r in report["generate"] if r["drafter"] == "plain"}
  best_of = {}
  for (kernels, m), tok_s in plains.items():
    if tok_s > best_of.get(m, (None, 0.0))[1]:
      best_of[m] = (kernels, tok_s)
  best_greedy = best_of.get("greedy")
  report["best_plain"] = {"kernels": best_greedy[0], "tok_s": best_greedy[1]} if best_greedy else None
  report["best_plain_by_mode"] = {m: {"kernels": k, "tok_s": t} for m, (k, t) in best_of.items()}
  summary = {}
  for r in report["generate"]:
    best = best_of.get(mode(r), (None, None))[1]
    r["speedup"] = r["tok_s"] / best if best else None
    same = plains.get((r["kernels"], mode(r)))
    r["speedup_same_kernels"] = r["tok_s"] / same if same else None
    if r.get("divergence"):
      s = summary.setdefault(r["kernels"], {"rows": 0, "rows_differ": 0})
      s["rows"] += r["divergence"]["rows"]
      s["rows_differ"] += r["divergence"]["rows_differ"]
  for s in summary.values():
    s["rate"] = s["rows_differ"] / s["rows"]
  report["divergence_summary"] = summary  # over every speculative configuration of a kernels value
  for r in report["generate"]:
    rows = len(batch_groups(report.get("prompts", []), r.get("batch_size", 1))) * r.get("batch_size", 1)
    r["predicted_speedup"] = predicted_speedup(r, report, n_prefills=rows)


def predicted_speedup(r, report, n_prefills: int):
  """Mean accepted length / (verification of N+1 tokens + the draft phase), both in target steps (the step
  section's figures, interpolated in T; prompt lookup's draft cost taken as 0): the speed-up over plain decoding
  of the same kernels that the component costs predict. None where a cost is missing (a tree's draft
  phase is not timed; the step section times B=1 only, so rows of a larger batch) or for plain rows."""
  mal = r.get("mean_accepted_length")
  rounds = r.get("target_calls", 0) - n_prefills  # each row's prefill is a target call too
  if r["drafter"] == "plain" or r.get("batch_size", 1) != 1 or not mal or rounds <= 0:
    return None
  steps = sorted((s["T"], s["verify_over_step"]) for s in report["step"] if s["kernels"] == r["kernels"])
  t = r["drafted"] / rounds + 1  # tokens a verification call reads: the round's drafts and the last token
  if len(steps) < 2 or not steps[0][0] <= t <= steps[-1][0]:
    return None
  verify = float(np.interp(t, [a for a, _ in steps], [b for _, b in steps]))
  draft = 0.0
  if r["drafter"] in ("eagle", "block"):
    section = "draft_phase" if r["drafter"] == "eagle" else "block_phase"
    phases = {d["K"]: d["over_step"] for d in report.get(section, []) if d["kernels"] == r["kernels"]}
    if r.get("tree") or r["K"] not in phases:
      return None
    draft = phases[r["K"]]
  return mal / (verify + draft)


def differ_cell(r):
  d = r.get("divergence")
  if d is None:  # plain rows are the reference; sampled rows have none
    return "-" if r["drafter"] == "plain" or r.get("mode", "greedy") != "greedy" else "?"
  if d["identical"]:
    return "none"
  return f"{d['rows_differ']}/{d['rows']}@" + ",".join(f"{k}:{v}" for k, v in d["first_diff"].items())


STEP_COLUMNS = [
  ("kernels", "kernels", 8, "s"),
  ("T", "T", 4, "d"),
  ("ms", "ms", 9, ".3f"),
  ("/T=1", "verify_over_step", 7, ".2f"),
  ("floor ms", "floor_ms", 9, ".3f"),
  ("x floor", "over_floor", 8, ".2f"),
  ("2N/N", "scale", 6, ".2f"),
  ("triton", lambda r: "-" if r["pallas_path"] is None else str(r["pallas_path"]), 7, "s"),
]
GENERATE_COLUMNS = [
  ("kernels", "kernels", 8, "s"),
  ("mode", lambda r: r.get("mode", "greedy"), 14, "s"),
  ("config", "config", 14, "s"),
  ("tok/s", "tok_s", 9, ".1f"),
  ("speedup", "speedup", 8, ".2f"),
  ("same-k", "speedup_same_kernels", 7, ".2f"),
  ("pred", "predicted_speedup", 6, ".2f"),
  ("mean_len", "mean_accepted_length", 9, ".2f"),
  ("accept", "acceptance", 7, ".2f"),
  ("tokens", "tokens", 7, "d"),
  ("differ", differ_cell, 40, "s"),
]


def _pyplot():
  try:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except ImportError:
    warnings.warn("matplotlib is not installed: no plot written")
    return None
  return plt


def plot_tokens(report, path, title):
  """Bars of tokens/s per configuration, one colour per kernels value; the best plain as a line."""
  rows = report["generate"]
  plt = _pyplot() if rows else None
  if plt is None:
    return None
  label = lambda r: r["config"] if r.get("mode", "greedy") == "greedy" else f"{r['config']} ({r['mode']})"  # noqa: E731
  configs = list(dict.fromkeys(label(r) for r in rows))
  kernels = list(dict.fromkeys(r["kernels"] for r in rows))
  width = 0.8 / len(kernels)
  fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(configs) + 3), 4))
  for j, k in enumerate(kernels):
    ys = [next((r["tok_s"] for r in rows if r["kernels"] == k and label(r) == c), np.nan) for c in configs]
    ax.bar(np.arange(len(configs)) + (j - (len(kernels) - 1) / 2) * width, ys, width, label=f"kernels={k}")
  if report.get("best_plain"):
    ax.axhline(report["best_plain"]["tok_s"], color="k", lw=0.8, ls="--", label="best plain")
  ax.set_xticks(np.arange(len(configs)), configs, rotation=30, ha="right")
  ax.set_ylabel(f"tokens/s (B={report.get('runs', [{}])[-1].get('config', {}).get('batch_size', 1)})")
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def plot_acceptance(report, path, title):
  """Acceptance by draft position (accepted / reached) of every speculative row, one panel per mode."""
  rows = [r for r in report["generate"] if r.get("acceptance_per_position")]
  plt = _pyplot() if rows else None
  if plt is None:
    return None
  modes = list(dict.fromkeys(r.get("mode", "greedy") for r in rows))
  fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 4), squeeze=False)
  for ax, mode in zip(axes[0], modes):
    for r in (r for r in rows if r.get("mode", "greedy") == mode):
      reached = np.asarray(r["reached_per_position"])
      shown = np.flatnonzero(reached >= 10)  # positions a row reached at least 10 times
      if shown.size:
        ys = np.asarray(r["acceptance_per_position"])[shown]
        ax.plot(shown + 1, ys, marker="o", label=f"{r['config']} ({r['kernels']}, len {r['mean_accepted_length']:.2f})")
    ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / reached")
    ax.set_ylim(0, 1)
    ax.set_title(f"{mode}: {title}", fontsize=8)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def plot_step(report, path, title):
  """ms per call against T, one line per kernels value, the floor dashed."""
  rows = report["step"]
  plt = _pyplot() if rows else None
  if plt is None:
    return None
  fig, ax = plt.subplots(figsize=(6, 4))
  for k in dict.fromkeys(r["kernels"] for r in rows):
    sel = sorted((r for r in rows if r["kernels"] == k), key=lambda r: r["T"])
    ax.plot([r["T"] for r in sel], [r["ms"] for r in sel], "o-", label=f"kernels={k}")
  ax.axhline(rows[0]["floor_ms"], color="k", lw=0.8, ls="--", label="floor: weights / copy bandwidth")
  ax.set_xlabel("tokens per call (T=1: decode step; T>1: verification)")
  ax.set_ylabel("ms per call (B=1)")
  ax.set_ylim(0, None)
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------


# A --kernels value: the models' TransformerConfig.kernels and tree_kernels.
KERNEL_VALUES = {"xla": ("xla", True), "pallas": ("pallas", True), "pallas_xla_trees": ("pallas", False)}


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  strs = lambda s: tuple(x for x in s.split(",") if x)  # noqa: E731
  ints = lambda s: tuple(int(x) for x in s.split(",") if x)  # noqa: E731
  ap.add_argument("--model", choices=tuple(MODELS), default="smollm2")
  ap.add_argument("--dtype", choices=("bfloat16", "float32"), help="default bfloat16 on GPU, float32 on CPU")
  ap.add_argument(
    "--kernels", type=strs, help="comma list of xla, pallas, pallas_xla_trees (default xla,pallas; quick xla)"
  )
  ap.add_argument("--sections", type=strs, default=("step", "generate"), help="comma list of step, generate")
  ap.add_argument(
    "--modes",
    type=strs,
    default=("greedy",),
    help=f"generate section: comma list of {', '.join(MODES)} (default greedy)",
  )
  ap.add_argument("--max-new-tokens", type=int, help="default 256; quick 16")
  ap.add_argument(
    "--batch-size",
    type=int,
    default=1,
    help="generate section: rows per call (the prompts in groups, the last filled by cycling; default 1)",
  )
  ap.add_argument("--quick", action="store_true", help="CPU smoke run: tiny sizes (the default without a GPU)")
  ap.add_argument("--prompts", type=strs, help=f"comma list of {', '.join(PROMPT_NAMES)} (default all; quick 2)")
  ap.add_argument("--ks", type=ints, help="prompt lookup K (default 2,4,8; quick 2)")
  ap.add_argument("--eagle-ks", type=ints, help="EAGLE chain K (default 2)")
  ap.add_argument("--eagle", default="", help="an EAGLE head file for the model instead of the shipped one")
  ap.add_argument(
    "--eagle-kernels",
    choices=("same", "xla", "pallas"),
    default="same",
    help="the EAGLE head's blocks: the target's --kernels value (same, the default), or xla / pallas",
  )
  ap.add_argument("--block", default="", help="a block drafter's file (the coder; chains at --block-ks)")
  ap.add_argument("--block-ks", type=ints, help="block drafter chain K (default 8)")
  ap.add_argument("--trees", type=strs, help="EAGLE trees, branching factors joined by x (default 3x2x1)")
  ap.add_argument(
    "--block-trees",
    type=strs,
    help="block drafter trees, as --trees (2x2x1x1, d5x4x15; K = the depth; default none; needs --block)",
  )
  ap.add_argument("--repeats", type=int, help="timed sweeps per configuration, median (default 3; quick 1)")
  ap.add_argument("--step-ts", type=ints, help="verification T of the step section (default 3,5,8,16; quick 3)")
  ap.add_argument("--step-prompt-len", type=int, help="P of the step section (default 256; quick 32)")
  ap.add_argument("--step-repeats", type=int, help="timing loops per step figure, median (default 5; quick 3)")
  ap.add_argument("--target-ms", type=float, help="length of one step timing loop (default 100; quick 20)")
  ap.add_argument("--copy-mb", type=int, help="buffer of the bandwidth measurement (default 2048 on GPU, 64 on CPU)")
  ap.add_argument("--budget-s", type=float, default=540.0, help="start nothing new after this (default 540; 0 = none)")
  ap.add_argument("--resume", action="store_true", help="add to OUT/real_target.json (same model and dtype)")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--cache-dir", default="/tmp/jax_cache", help="persistent compilation cache ('' = off)")
  ap.add_argument("--out", default=os.path.join(REPO, "bench", "out"), help="output directory (default bench/out)")
  args = ap.parse_args(argv)
  gpu = common.has_gpu()
  if not args.quick and not gpu:
    print("No GPU found: running the --quick configuration.")
    args.quick = True
  q = args.quick
  defaults = dict(
    dtype="bfloat16" if gpu else "float32",
    kernels=("xla",) if q else ("xla", "pallas"),
    max_new_tokens=16 if q else 256,
    prompts=QUICK_PROMPTS if q else PROMPT_NAMES,
    ks=(2,) if q else (2, 4, 8),
    eagle_ks=(2,),
    block_ks=(8,),
    trees=("3x2x1",),
    block_trees=(),
    repeats=1 if q else 3,
    step_ts=(3,) if q else (3, 5, 8, 16),
    step_prompt_len=32 if q else 256,
    step_repeats=3 if q else 5,
    target_ms=20.0 if q else 100.0,
    copy_mb=2048 if gpu else 64,
  )
  for name, value in defaults.items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  for flag, values, allowed in (
    ("--kernels", args.kernels, tuple(KERNEL_VALUES)),
    ("--modes", args.modes, tuple(MODES)),
    ("--sections", args.sections, ("step", "generate")),
  ):
    bad = [v for v in values if v not in allowed]
    if bad or not values:
      ap.error(f"{flag}: unknown {bad}; choose from {allowed}")
  for flag, names in (("--trees", args.trees), ("--block-trees", args.block_trees)):
    for t in names:
      try:
        bs.parse_tree(t)  # fails early on a bad name, before any weight is read
      except (ValueError, TypeError) as e:
        ap.error(f"{flag}: bad tree {t!r} ({e}); e.g. 3x2x1, 2x2x1x1:iid, d5x4x15 or d3x4x36:sampled")
  if args.batch_size < 1:
    ap.error(f"--batch-size must be >= 1, got {args.batch_size}")
  if "mixed" in args.modes and args.batch_size < 2:
    ap.error("--modes mixed needs --batch-size >= 2 (even rows greedy, odd rows T=1)")
  if args.block and args.model != "qwen2.5-coder-1.5b":
    ap.error(f"--block: block drafters load for --model qwen2.5-coder-1.5b only, got {args.model}")
  if args.block and not os.path.isfile(args.block):
    ap.error(f"--block {args.block}: no such file (a .safetensors written by eagle_files.save_block_drafter)")
  return args


def main(argv=None):
  args = parse_args(argv)
  budget = bd.Budget(args.budget_s)
  bd.enable_compilation_cache(args.cache_dir)
  os.makedirs(args.out, exist_ok=True)
  json_path = os.path.join(args.out, "real_target.json")
  try:
    spec = MODELS[args.model]()
  except ImportError as e:
    raise SystemExit(f"--model {args.model}: its loader is not importable in this checkout ({e})") from e
  info = common.device_info()
  info.update(flax=flax.__version__, xla_flags=os.environ.get("XLA_FLAGS", ""), command=shlex.join(sys.argv))
  print(
    f"{spec.title} {args.dtype}, kernels {','.join(args.kernels)}; {info['device']} ({info['platform']}), "
    f"jax {info['jax']}, flax {info['flax']}",
    flush=True,
  )

  report = None
  if args.resume and os.path.isfile(json_path):
    with open(json_path) as f:
      report = json.load(f)
    if (report.get("model"), report.get("dtype")) != (args.model, args.dtype):
      raise SystemExit(f"--resume: {json_path} is of {report.get('model')} {report.get('dtype')}, not this run's")
    print(f"resuming {json_path}: {len(report['step'])} step rows, {len(report['generate'])} generate rows")
  if report is None:
    report = {"model": args.model, "dtype": args.dtype, "step": [], "generate": [], "weights": {}, "errors": []}
  report.setdefault("runs", []).append({"info": info, "config": vars(args)})
  report.update(info=info, model_title=spec.title, eos_ids=list(spec.eos_ids), notes=[n for n in [spec.note] if n])
  report["eagle"] = args.eagle or None
  report["block"] = args.block or None

  def save():
    report["skipped_for_time_budget"] = budget.skipped
    report["elapsed_s"] = budget.elapsed()
    with open(json_path, "w") as f:
      json.dump(report, f, indent=1, default=str)

  bandwidth = None
  if "step" in args.sections:
    bw = common.copy_bandwidth(args.copy_mb * 2**20)
    bandwidth = bw["bytes_per_s"]
    report["copy_bandwidth"] = report["runs"][-1]["copy_bandwidth"] = bw
    print(
      f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + written, {common.fmt_bytes(bw['buffer_bytes'])} buffer)",
      flush=True,
    )

  prompts, host_weights, tokenizer = None, None, None
  for i, kernels in enumerate(args.kernels):
    if budget.over(f"kernels={kernels}"):
      continue
    t0 = time.perf_counter()
    try:
      base, tree_kernels = KERNEL_VALUES[kernels]
      if host_weights is None:
        model, tokenizer = spec.load(jnp.dtype(args.dtype), base)
        if i < len(args.kernels) - 1:  # the next kernels value: the same weights, no second dequantisation
          host_weights, first_config = model.to_weights(), model.config
      else:
        model = Transformer.from_weights(first_config.replace(kernels=base), host_weights)
      model.config = model.config.replace(tree_kernels=tree_kernels)
      eagle = None
      if spec.load_eagle and (spec.shipped_eagle or args.eagle):
        head_kernels = base if args.eagle_kernels == "same" else args.eagle_kernels
        eagle = spec.load_eagle(jnp.dtype(args.dtype), head_kernels, args.eagle or None)
        layers = eagle.config.layers.replace(tree_kernels=tree_kernels)
        eagle.config = dataclasses.replace(eagle.config, layers=layers)
      block = spec.load_block(jnp.dtype(args.dtype), args.block) if args.block else None
    except Exception as e:  # noqa: BLE001
      error(report, f"load kernels={kernels}", e)
      save()
      continue
    report.setdefault("load_s", {})[kernels] = time.perf_counter() - t0
    c = model.config
    report["model_config"] = {f.name: str(getattr(c, f.name)) for f in dataclasses.fields(c)}
    print(
      f"loaded kernels={kernels} in {time.perf_counter() - t0:.1f}s: L={c.num_layers} D={c.d_model} "
      f"V={c.vocab_size}" + (" + EAGLE head" if eagle is not None else ""),
      flush=True,
    )
    if prompts is None:
      texts = {n: spec.chat_prompt(t) for n, t in held_out_prompts(args.prompts).items()}
      tokens, lengths = bs.encode(tokenizer, list(texts.values()))
      prompts = {"names": list(texts), "tokens": tokens, "lengths": lengths, "tokenizer": tokenizer}
      report["prompt_len_padded"] = int(tokens.shape[1])
      report["prompts"] = [
        {"name": n, "text": t, "length": int(lengths[j]), "ids": tokens[j, : lengths[j]].tolist()}
        for j, (n, t) in enumerate(texts.items())
      ]
      print(f"prompts {prompts['names']}, lengths {lengths.tolist()}, padded to P={tokens.shape[1]}", flush=True)
    if "step" in args.sections:
      step_section(model, kernels, args, bandwidth, report, save, budget, eagle, block)
    if "generate" in args.sections:
      generate_section(model, eagle, kernels, spec, args, prompts, report, save, budget, block)
    del model, eagle, block
    gc.collect()

  finish(report)
  save()
  title = f"{spec.title} {args.dtype}, B={args.batch_size}, {args.max_new_tokens} new tokens, {info['device']}"
  pngs = [
    plot_tokens(report, os.path.join(args.out, "real_target_tokens.png"), title),
    plot_step(report, os.path.join(args.out, "real_target_step.png"), title),
    plot_acceptance(report, os.path.join(args.out, "real_target_acceptance.png"), title),
  ]
  if report["step"]:
    bd.print_table(
      report["step"],
      STEP_COLUMNS,
      f"Target calls at B=1 ({spec.title} {args.dtype}; floor = weight bytes read / copy bandwidth)",
    )
  if report["generate"]:
    bd.print_table(
      report["generate"],
      GENERATE_COLUMNS,
      f"Tokens/s at B={args.batch_size} over {len(report['prompts'])} prompts (speedup: over the best plain of the mode; same-k: over "
      "plain of the same kernels; differ: prompts whose tokens differ from plain's @ first differing position)",
    )
  for k, s in report["divergence_summary"].items():
    print(f"divergence from plain greedy, kernels={k}: {s['rows_differ']}/{s['rows']} rows ({s['rate']:.1%})")
  for note in report["notes"]:
    print("NOTE: " + note)
  if report["errors"]:
    print(f"{len(report['errors'])} error(s): " + "; ".join(e["error"][:160] for e in report["errors"]))
  if budget.skipped:
    print(f"skipped for the time budget ({args.budget_s:.0f}s): {', '.join(budget.skipped)}")
  print(f"wrote {json_path}" + "".join(f" and {p}" for p in pngs if p) + f"; total {budget.elapsed():.0f}s")
  return report


if __name__ == "__main__":
  main()
