"""The EAGLE head's draft phase alone: XLA's blocks (projections separate or fused) against the Pallas kernels.

A draft phase is what `speculative_generate` runs each round before the
target verifies: the head's catch-up call on K+1 entries (logits of one),
then K-1 one-entry calls, each followed by `sample_tokens` (greedy: an
argmax; T=1: a draw, and the [B, V] probabilities the loop keeps for the
rejection sampler). The loop body is `bench/smollm2.py`'s component
(`_eagle_round_fn`); the weights are random bf16 ones of the shipped
SmolLM2 head's shape (2 blocks, D=576, a draft vocabulary of 8192 of 49152
tokens) or, with `--shape qwen2.5-coder-1.5b`, of a head for that target (D=1536,
V=151936; the shipped one: `--num-layers 1 --d-ff 4096 --draft-vocab 32768`):
the time does not depend on their values, so no GGUF is needed. `--draft-vocab`
takes a comma list, one set of rows per size (what the output layer costs).

Variants:
    xla-separate   XLA's blocks with q, k, v and gate, up as separate matrices
                   (the drafter's layout before it fused them; what a sharded
                   head still holds where a projection is split)
    xla            XLA's blocks, q|k|v and gate|up fused (one matmul each)
    pallas         TransformerConfig(kernels="pallas"): each call of at most 16
                   rows as Pallas kernels (GPU, bf16)

Usage (GPU):
    PYTHONPATH=. python3 bench/eagle_draft.py --out $OUT/draft --ks 2,3 --modes greedy,t1 --trace /tmp/trace
    PYTHONPATH=. python3 bench/eagle_draft.py --out $OUT/draft --shape qwen2.5-coder-1.5b --num-layers 1 \
        --d-ff 4096 --draft-vocab 32768,16384,8192 --variants pallas --ks 4 --modes greedy

Writes eagle_draft.json (and eagle_draft.png): microseconds per draft phase
and per head call, and with --trace each variant's costliest kernels (the
first mode, the first K).

`--minimal-sampler` (a bound, not a fix): T=1 draws with `log_softmax` and
`jax.random.categorical` instead of `sample_tokens`, whose run-time branches
(any greedy row? any filter? any non-finite row?) each cost a device-to-host
copy on a GPU. For temperature-only parameters it draws from the same
distribution; what it saves is what a sampler that knew statically that no
row filters could save.

`--no-filters`: the library's answer to that bound, `sample_tokens(...,
no_filters=True)` (one overflow-safe pass, no run-time branch).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402
from bench import decode as bd  # noqa: E402
from bench.smollm2 import _eagle_round_fn  # noqa: E402
from bench.step_profile import SHAPES, profile_kernels  # noqa: E402
from specdec_jax.models import EagleDrafter, Transformer, TransformerConfig  # noqa: E402
from specdec_jax.models.eagle import _Params, _separate  # noqa: E402
from specdec_jax.sampling.sample import sample_tokens  # noqa: E402

VARIANTS = ("xla-separate", "xla", "pallas")
FEATURE_LAYERS = {"smollm2": (2, 15, 27), "qwen2.5-coder-1.5b": (2, 14, 25)}  # the shipped heads'


def build_heads(
  dtype, num_layers: int, draft_vocab: int, variants, *, shape: str = "smollm2", d_ff: int = 0
) -> dict[str, EagleDrafter]:
  """{variant: head}, all with the same random weights (see the module docstring), for a target of `shape`
  (bench/step_profile.py's SHAPES) with an MLP of d_ff (0: the target's)."""
  dims, layers = SHAPES[shape], FEATURE_LAYERS[shape]
  target_config = TransformerConfig(**{**dims, "num_layers": max(layers) + 1}, dtype=dtype, feature_layers=layers)
  target = nnx.eval_shape(lambda: Transformer(target_config, rngs=nnx.Rngs(0)))  # only its embedding is used
  target.embed = nnx.Param(0.02 * jax.random.normal(jax.random.key(1), (dims["vocab_size"], dims["d_model"]), dtype))
  head_rows = target.embed[...]
  if not dims.get("tie_embeddings", True):  # an output head of its own [D, V]
    target.lm_head = nnx.Param(
      0.02 * jax.random.normal(jax.random.key(3), (dims["d_model"], dims["vocab_size"]), dtype)
    )
    head_rows = target.lm_head[...].T
  vocab = np.random.default_rng(0).permutation(dims["vocab_size"])[:draft_vocab] if draft_vocab else None
  base = EagleDrafter.for_target(target, num_layers=num_layers, draft_vocab=vocab, d_ff=d_ff or None, rngs=nnx.Rngs(2))
  weights, embed = base.to_weights(), target.embed[...]
  heads = {}
  for name in variants:
    config = base.config
    if name == "pallas":
      config = dataclasses.replace(config, layers=config.layers.replace(kernels="pallas"))
    head = EagleDrafter.from_weights(config, weights, embed=embed, head_rows=head_rows)
    if name == "xla-separate":
      head.first = _Params(_separate(head.first.values(), config.layers))
      if num_layers > 1:
        head.rest = _Params(_separate(head.rest.values(), config.layers))
    heads[name] = head
  return heads


def minimal_sample_tokens(logits, params, key, *, all_greedy=False):
  """`sample_tokens` for temperature-only rows, with no run-time branch: (tokens int32 [B], log_probs [B, V])."""
  if all_greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), jnp.zeros(logits.shape, jnp.float32)
  log_probs = jax.nn.log_softmax(logits / params.temperature[:, None], axis=-1)
  keys = jax.random.split(key, logits.shape[0])
  return jax.vmap(jax.random.categorical)(keys, log_probs).astype(jnp.int32), log_probs


def draft_phase(
  head,
  *,
  b: int,
  k: int,
  mode: str,
  p0: int,
  cache_len: int,
  target_s: float,
  repeats: int,
  trace_dir: str | None = None,
  sample=None,
) -> dict:
  """Times one draft phase per loop iteration (median of `repeats` loops); with trace_dir, profiles 20 of them."""
  graphdef, state = nnx.split(head)
  params, key, _ = bd.mode_setup(mode, b, 0)
  key = jax.random.key(0) if key is None else key
  feats = jnp.ones((b, k + 1, head.config.feature_size), head.config.layers.dtype)
  step = _eagle_round_fn(
    graphdef, k, p0, max(cache_len - p0 - 2 * k - 2, 1), mode == "greedy", mode != "greedy", sample
  )
  carry = (head.init_cache(b, cache_len), jnp.full((b,), 7, jnp.int32))
  loop = common.timed_loop(step)
  r = common.time_per_iter(loop, carry, (state, feats, params, key), target_s=target_s, repeats=repeats)
  r.pop("compiled", None)
  if trace_dir:
    steps = 20
    table, error = profile_kernels(lambda: loop(0, steps, carry, state, feats, params, key), trace_dir, steps, top=40)
    r.update({"trace_error": error} if error else {"kernels": table})
  return r


def _block_round_fn(graphdef, k: int, p0: int, span: int):
  """Loop body: one block drafter's greedy draft phase of a chain round, as `BlockDraft` runs it: one call of 2K
  entries (the first `fresh` the verified context's, the rest placeholders; logits at the last context entry
  and the K-1 placeholders after it), then the argmax of each of the K positions."""
  width = 2 * k

  def step(i, carry, state, feats):
    cache, token = carry
    b = token.shape[0]
    drafter = nnx.merge(graphdef, state)
    base = p0 + i % span
    # fresh in 1 .. K+1 (K+1 when a round accepted every draft), traced as in the loop: i = 0 gives K+1
    fresh = jnp.full((b,), 1 + (i + k) % (k + 1), jnp.int32)
    entry = jnp.arange(width, dtype=jnp.int32)
    pos = jnp.broadcast_to(base + entry, (b, width))
    nxt = jnp.broadcast_to(token[:, None], (b, width))
    at = (fresh - 1)[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
    logits, _, cache = drafter(
      nxt, drafter.fuse(feats), pos, cache, placeholders=entry[None, :] >= fresh[:, None], logits_at=at
    )
    drafts = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, K]
    # Every position's argmax feeds the next iteration, so none is sliced away.
    return cache, drafts[:, -1] + (jnp.sum(drafts, axis=-1) < 0).astype(jnp.int32)

  return step


def block_draft_phase(drafter, *, b: int, k: int, p0: int, cache_len: int, target_s: float, repeats: int) -> dict:
  """`draft_phase`'s sibling for a `BlockDrafter` (greedy): times one draft phase (`_block_round_fn`) per loop
  iteration, median of `repeats` loops, on a cache whose windows start at p0 and move one slot an iteration."""
  graphdef, state = nnx.split(drafter)
  feats = jnp.ones((b, 2 * k, drafter.config.feature_size), drafter.config.layers.dtype)
  step = _block_round_fn(graphdef, k, p0, max(cache_len - p0 - 2 * k - 2, 1))
  carry = (drafter.init_cache(b, cache_len), jnp.full((b,), 7, jnp.int32))
  r = common.time_per_iter(common.timed_loop(step), carry, (state, feats), target_s=target_s, repeats=repeats)
  r.pop("compiled", None)
  return r


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True, help="directory for eagle_draft.json and .png")
  ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {VARIANTS}")
  ap.add_argument("--ks", default="2,3", help="comma list of K (draft tokens per round; default 2,3)")
  ap.add_argument("--modes", default="greedy,t1", help="comma list of greedy, t1 (default both)")
  ap.add_argument("--batch-size", type=int, default=1)
  ap.add_argument("--num-layers", type=int, default=2, help="the head's blocks (default 2, the shipped head's)")
  ap.add_argument("--shape", choices=tuple(SHAPES), default="smollm2", help="the target's shape (default smollm2)")
  ap.add_argument("--d-ff", type=int, default=0, help="the head's MLP width (0 = the target's)")
  ap.add_argument(
    "--draft-vocab", default="8192", help="comma list of draft vocabulary sizes (0 = the whole; default 8192)"
  )
  ap.add_argument("--cache-len", type=int, default=320)
  ap.add_argument("--dtype", choices=("bfloat16", "float32"), help="default bfloat16 on a GPU, float32 elsewhere")
  ap.add_argument("--target-ms", type=float, default=50.0, help="length of one timed loop")
  ap.add_argument("--repeats", type=int, default=5, help="timed loops per cell (median)")
  ap.add_argument("--trace", help="profile each variant's first cell (first mode, first K) into this directory")
  ap.add_argument(
    "--minimal-sampler",
    action="store_true",
    help="T=1 rows drawn without sample_tokens' run-time branches (a bound; see the docstring)",
  )
  ap.add_argument("--no-filters", action="store_true", help="T=1 rows drawn by sample_tokens(..., no_filters=True)")
  ap.add_argument("--no-plot", action="store_true")
  args = ap.parse_args(argv)
  args.variants = [v for v in args.variants.split(",") if v]
  args.modes = [m for m in args.modes.split(",") if m]
  bad = [v for v in args.variants if v not in VARIANTS] + [m for m in args.modes if m not in ("greedy", "t1")]
  if bad:
    ap.error(f"unknown variant(s) or mode(s) {bad}: variants {VARIANTS}, modes greedy, t1")
  try:
    args.ks = [int(k) for k in args.ks.split(",")]
  except ValueError:
    ap.error(f"--ks must be a comma list of ints, got {args.ks!r}")
  try:
    args.draft_vocab = [int(n) for n in str(args.draft_vocab).split(",")]
  except ValueError:
    ap.error(f"--draft-vocab must be a comma list of ints, got {args.draft_vocab!r}")
  v = SHAPES[args.shape]["vocab_size"]
  if min(args.ks) < 1 or args.batch_size < 1 or args.num_layers < 1 or args.d_ff < 0:
    ap.error("--ks >= 1, --batch-size >= 1, --num-layers >= 1 and --d-ff >= 0 are required")
  if not all(0 <= n <= v for n in args.draft_vocab):
    ap.error(f"--draft-vocab sizes must be in [0, {v}] (the {args.shape} vocabulary), got {args.draft_vocab}")
  if args.cache_len < 4 * max(args.ks) + 8:
    ap.error(f"--cache-len must be at least 4 K + 8 = {4 * max(args.ks) + 8}")
  return args


def main(argv=None) -> dict:
  args = parse_args(argv)
  dtype = jnp.dtype(args.dtype or ("bfloat16" if common.has_gpu() else "float32"))
  if "pallas" in args.variants and (not common.has_gpu() or dtype == jnp.float32):
    print("pallas: the kernels need a GPU and bf16; that variant runs XLA's blocks here")
  os.makedirs(args.out, exist_ok=True)
  p0 = args.cache_len // 4
  rows, kernels = [], {}
  for draft_vocab in args.draft_vocab:
    heads = build_heads(dtype, args.num_layers, draft_vocab, args.variants, shape=args.shape, d_ff=args.d_ff)
    rows += _time_heads(args, heads, p0, kernels, draft_vocab)
  return _report(args, dtype, rows, kernels)


def _time_heads(args, heads, p0, kernels, draft_vocab) -> list[dict]:
  """The rows of one draft vocabulary's heads: every mode, K and variant."""
  rows = []
  for mode in args.modes:
    for k in args.ks:
      for name in args.variants:
        first = mode == args.modes[0] and k == args.ks[0] and draft_vocab == args.draft_vocab[0]
        trace = os.path.join(args.trace, name) if args.trace and first else None
        r = draft_phase(
          heads[name],
          b=args.batch_size,
          k=k,
          mode=mode,
          p0=p0,
          cache_len=args.cache_len,
          target_s=args.target_ms / 1e3,
          repeats=args.repeats,
          trace_dir=trace,
          sample=(
            minimal_sample_tokens
            if args.minimal_sampler
            else functools.partial(sample_tokens, no_filters=True)
            if args.no_filters
            else None
          ),
        )
        if "kernels" in r:
          kernels[name] = r.pop("kernels")
        rows.append(
          {
            "variant": name,
            "mode": mode,
            "K": k,
            "draft_vocab": draft_vocab,
            "us": r["per_iter_s"] * 1e6,
            "us_per_call": r["per_iter_s"] * 1e6 / k,
            "compile_s": r["compile_s"],
            "scale": r["scale"],
            **({"trace_error": r["trace_error"]} if "trace_error" in r else {}),
          }
        )
        print(
          f"{mode:6s} K={k} draft vocabulary {draft_vocab:6d} {name:13s} {rows[-1]['us']:8.1f} us per draft phase "
          f"({rows[-1]['us_per_call']:.1f} per head call; compile {r['compile_s']:.1f}s)",
          flush=True,
        )
  return rows


def _report(args, dtype, rows, kernels) -> dict:
  """Writes eagle_draft.json (and the plot); returns the report."""
  report = {
    "info": {**common.device_info(), "xla_flags": os.environ.get("XLA_FLAGS", "")},
    "config": vars(args),
    "dtype": str(dtype),
    "rows": rows,
    "kernels": kernels,
  }
  with open(os.path.join(args.out, "eagle_draft.json"), "w") as f:
    json.dump(report, f, indent=1)
  if not args.no_plot:
    plot(
      rows,
      os.path.join(args.out, "eagle_draft.png"),
      f"EAGLE draft phase, B={args.batch_size}, {dtype}, {report['info'].get('device')}",
    )
  print(f"wrote {args.out}/eagle_draft.json")
  return report


def plot(rows, path, title):
  import matplotlib  # noqa: PLC0415  (only for the picture)

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  cells = list(dict.fromkeys((r["mode"], r["K"], r["draft_vocab"]) for r in rows))
  names = list(dict.fromkeys(r["variant"] for r in rows))
  fig, ax = plt.subplots(figsize=(8, 4))
  width = 0.8 / len(names)
  for j, name in enumerate(names):
    us = [
      next((r["us"] for r in rows if r["variant"] == name and (r["mode"], r["K"], r["draft_vocab"]) == c), 0)
      for c in cells
    ]
    ax.bar(np.arange(len(cells)) + j * width, us, width, label=name)
  labels = [f"{m} K={k}" + (f"\nVd={n}" if len({c[2] for c in cells}) > 1 else "") for m, k, n in cells]
  ax.set_xticks(np.arange(len(cells)) + width * (len(names) - 1) / 2, labels)
  ax.set_ylabel("us per draft phase")
  ax.set_title(title, fontsize=9)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  main()
