"""One GPU: the sharded code path on a 1-device mesh costs no more than today's.

`specdec_jax.models.shard` and the mesh support in the loops add sharding
constraints and (for a split model) a different parameter layout. On a
1-device mesh nothing is split, so the compiled program should be today's;
this benchmark checks that it is, and times it.

What: a random-weight model shaped like SmolLM2-135M (V=49152, L=30, D=576, 9
query / 3 KV heads of 64, F=1536) or, `--shape qwen2.5-coder-1.5b`, like
Qwen2.5-Coder-1.5B (bench/step_profile.py's SHAPES), bf16 on GPU, f32 on CPU,
and a 2-layer draft of the same shape. Two paths, the same calls:

    today   the models as built, no mesh (what every other benchmark measures);
    mesh    shard(model, make_mesh(--data, --model)) for target and draft,
            called under `with jax.set_mesh(mesh):`, inputs placed by rows
            (NamedSharding P("data", ...)).

Measured, per batch size B (default 1, 8, 32):
  - same_program: the two compiled programs (`generate`, and
    `speculative_generate` with the draft model) hold the same instructions
    (opcode and shape, in order; names and metadata ignored).
    True means equal cost by construction; on a 1-device mesh it should be.
    (Checked on a 1-device mesh only: a split program differs by design.)
  - collectives: on the mesh, the collective instructions of one step and
    one verification call (e.g. a split model's all-reduces), by shape.
  - step / verify: one target call on T=1 and T=K+1 tokens (cache of
    P + max_new_tokens + K + 1 slots), N calls in one jitted fori_loop
    (bench/common.py `time_per_iter`, median of 5 loops).
  - generate, speculative (prompt lookup), speculative (draft model): greedy,
    wall time of one whole call, median of --repeats calls after a compile call.
  Each row prints mesh/today; the claim holds where every ratio is <= 1.02
  (run-to-run noise of whole calls is about 1%).

Usage (from the repository root; a CPU run is a smoke test, not a figure):
    PYTHONPATH=. python3 bench/mesh.py --out $OUT                                   # one GPU: 1x1 mesh vs no mesh
    PYTHONPATH=. python3 bench/mesh.py --out $OUT --batch 8 --data 1 --model 2      # 2 GPUs: TP=2 vs one GPU
    PYTHONPATH=. python3 bench/mesh.py --out $OUT --batch 64 --data 2 --per-device  # 2 GPUs: 2 x 64 rows vs 64
    PYTHONPATH=. python3 bench/mesh.py --tiny --batch 2 --max-new-tokens 8 --repeats 1   # CPU smoke test, ~20 s

Output: a table on stdout and JSON, `mesh_<shape>_<data>x<model>.json` in --out
(default bench/out/).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import device_info, has_gpu, hlo_collectives, time_call, time_per_iter, timed_loop
from bench.step_profile import SHAPES
from specdec_jax import SamplingParams, generate, speculative_generate
from specdec_jax.drafts.lookup import PromptLookupDrafter
from specdec_jax.loop.decoding import _generate_jit, _speculative_jit, _split
from specdec_jax.models import Transformer, TransformerConfig, make_mesh, shard

TINY = {
  "vocab_size": 512,
  "num_layers": 4,
  "d_model": 64,
  "num_heads": 4,
  "num_kv_heads": 2,
  "head_dim": 16,
  "d_ff": 128,
}
PROMPT_LEN = 64


def parse_args(argv=None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32], help="batch sizes B (default 1 8 32)")
  ap.add_argument("--data", type=int, default=1, help="data axis of the mesh (default 1)")
  ap.add_argument("--model", type=int, default=1, help="model axis of the mesh (default 1)")
  ap.add_argument("-k", type=int, default=4, help="K, drafts per round (default 4)")
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--repeats", type=int, default=5, help="timed whole calls per configuration (default 5)")
  ap.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: bfloat16 on GPU, float32 on CPU")
  ap.add_argument(
    "--shape", choices=tuple(SHAPES), default="smollm2", help="the random model's shape (default smollm2)"
  )
  ap.add_argument("--tiny", action="store_true", help="a 4-layer model (smoke test), not --shape's sizes")
  ap.add_argument(
    "--per-device",
    action="store_true",
    help="B rows per device of the data axis: the mesh runs B x data rows against one device's B (throughput)",
  )
  ap.add_argument(
    "--out",
    default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"),
    help="directory for mesh_<data>x<model>.json (default bench/out, git-ignored)",
  )
  args = ap.parse_args(argv)
  if any(b < 1 for b in args.batch) or args.data < 1 or args.model < 1 or args.k < 1 or args.repeats < 1:
    ap.error("--batch, --data, --model, -k and --repeats must be >= 1")
  if args.data * args.model > jax.device_count():
    ap.error(
      f"--data {args.data} x --model {args.model} needs {args.data * args.model} devices, JAX sees {jax.device_count()}"
    )
  bad = [] if args.per_device else [b for b in args.batch if b % args.data]
  if bad:
    ap.error(f"every --batch must be a multiple of --data {args.data}, got {bad}")
  args.dtype = args.dtype or ("bfloat16" if has_gpu() else "float32")
  return args


def program_ops(text: str) -> list[tuple[str, str]]:
  """(shape, opcode) of every instruction of compiled HLO text, in order: names and metadata left out."""
  return re.findall(r"^\s*(?:ROOT )?%\S+ = (\S+?) ([a-z][\w-]*)\(", text, flags=re.MULTILINE)


def prompts(b: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
  """[B, P] int32 repeating a random 16-token segment (prompt lookup finds matches), lengths [B] = P."""
  rng = np.random.default_rng(0)  # row r is the same for every B (--per-device compares the first rows)
  seg = rng.integers(0, vocab, (b, 16))
  tokens = np.tile(seg, (1, PROMPT_LEN // 16)).astype(np.int32)
  return tokens, np.full((b,), PROMPT_LEN, np.int32)


def model_step_loop(model, b: int, t: int, max_length: int):
  """`time_per_iter` arguments timing one model call on [B, T] tokens per iteration."""
  graphdef, state = nnx.split(model)

  def step(i, carry, state):
    cache, acc = carry
    m = nnx.merge(graphdef, state)
    tokens = jnp.full((b, t), i % 7, jnp.int32)  # depends on i: the call cannot be hoisted
    positions = jnp.broadcast_to(PROMPT_LEN + jnp.arange(t, dtype=jnp.int32), (b, t))
    logits, cache = m(tokens, positions, cache)
    return cache, acc + jnp.max(logits[:, -1, :8])

  cache = model.init_cache(b, max_length)
  return timed_loop(step), (cache, jnp.float32(0)), (state,)


def measure(path: str, target, draft, mesh, b: int, args) -> dict:
  """Timings of one path ("today" or "mesh") at batch b."""
  tokens, lengths = prompts(b, target.config.vocab_size)
  if mesh is None:
    place = jnp.asarray
  else:

    def place(a):
      return jax.device_put(a, NamedSharding(mesh, P("data", *([None] * (np.ndim(a) - 1)))))

  x, n, params = place(tokens), place(lengths), jax.tree.map(place, SamplingParams.greedy(b))
  common = {"max_new_tokens": args.max_new_tokens, "all_greedy": True}
  calls = {
    "generate": lambda: generate(target, x, n, params, None, **common),
    "speculative (prompt lookup)": lambda: speculative_generate(
      target, PromptLookupDrafter((3, 2)), x, n, params, None, num_speculative_tokens=args.k, **common
    ),
    "speculative (draft model)": lambda: speculative_generate(
      target, draft, x, n, params, None, num_speculative_tokens=args.k, **common
    ),
  }
  out = {}
  max_length = PROMPT_LEN + args.max_new_tokens + args.k + 1
  for name, t in (("step", 1), ("verify", args.k + 1)):
    r = time_per_iter(*model_step_loop(target, b, t, max_length))
    out[name] = {"s": r["per_iter_s"], "scale": r["scale"]}
    if mesh is not None:  # what crosses devices in one call (a split model's all-reduces, say)
      out[name]["collectives"] = hlo_collectives(r["compiled"].as_text())
  tokens_out = {}
  for name, fn in calls.items():
    result = jax.block_until_ready(fn())  # compile
    times = time_call(fn, repeats=args.repeats)
    tokens_out[name] = np.asarray(result.tokens)
    out[name] = {
      "s": statistics.median(times),
      "times_s": times,
      "tokens_per_s": float(np.sum(result.lengths)) / statistics.median(times),
    }
  print(f"  {path:5s} B={b:3d}  " + "  ".join(f"{k} {v['s'] * 1e3:8.2f} ms" for k, v in out.items()), flush=True)
  for name in ("step", "verify"):
    if out[name].get("collectives"):
      c = out[name]["collectives"]
      print(f"        {name}: {sum(c.values())} collectives per call ({', '.join(f'{k} x{n}' for k, n in c.items())})")
  return out, tokens_out


def compiled_programs(target, draft, mesh, b: int, args) -> dict[str, list]:
  """The instructions (see `program_ops`) of the compiled `generate` and `speculative_generate` (draft model)."""
  tokens, lengths = jnp.asarray(prompts(b, target.config.vocab_size)[0]), jnp.full((b,), PROMPT_LEN, jnp.int32)
  params = SamplingParams.greedy(b)
  target_def, target_arrays = _split(target, "target")
  draft_def, draft_arrays = _split(draft, "draft")
  static = {"max_new_tokens": args.max_new_tokens, "eos": (), "all_greedy": True, "logprobs": None}

  def lower():
    plain = _generate_jit.lower(target_arrays, tokens, lengths, params, None, target_def=target_def, **static)
    spec = _speculative_jit.lower(
      target_arrays,
      draft_arrays,
      tokens,
      lengths,
      params,
      None,
      target_def=target_def,
      draft_def=draft_def,
      feature_draft=False,
      num_speculative_tokens=args.k,
      tree=None,
      **static,
    )
    return {
      "generate": program_ops(plain.compile().as_text()),
      "speculative (draft model)": program_ops(spec.compile().as_text()),
    }

  if mesh is None:
    return lower()
  with jax.set_mesh(mesh):
    return lower()


def main(argv=None):
  args = parse_args(argv)
  shape = TINY if args.tiny else SHAPES[args.shape]
  config = TransformerConfig(**shape, dtype=jnp.dtype(args.dtype))
  target = Transformer(config, rngs=nnx.Rngs(0))
  draft = Transformer(config.replace(num_layers=2), rngs=nnx.Rngs(1))
  mesh = make_mesh(args.data, args.model)
  sharded_target, sharded_draft = shard(target, mesh), shard(draft, mesh)
  info = device_info()
  print(
    f"{info['device']} x{info['num_devices']}, jax {info['jax']}; mesh data={args.data} x model={args.model}; "
    f"{'tiny' if args.tiny else args.shape} shape, {args.dtype}; target split: {sharded_target.partitioning}"
  )
  rows = []
  os.makedirs(args.out, exist_ok=True)
  suffix = "_per_device" if args.per_device else ""
  path = os.path.join(args.out, f"mesh_{'tiny' if args.tiny else args.shape}_{args.data}x{args.model}{suffix}.json")
  for b in args.batch:
    mesh_b = b * args.data if args.per_device else b
    today, today_tokens = measure("today", target, draft, None, b, args)
    with jax.set_mesh(mesh):
      on_mesh, mesh_tokens = measure("mesh", sharded_target, sharded_draft, mesh, mesh_b, args)
    # Only a 1-device mesh can compile to today's program; on more devices the check would cost
    # four more compilations (minutes on a GPU) to say False.
    same_program = (
      None
      if args.data * args.model > 1
      else (
        compiled_programs(target, draft, None, b, args)
        == compiled_programs(sharded_target, sharded_draft, mesh, b, args)
      )
    )
    same_tokens = all(np.array_equal(today_tokens[k], mesh_tokens[k][:b]) for k in today_tokens)
    ratios = {k: on_mesh[k]["s"] / today[k]["s"] for k in today}
    # Tokens/s on the mesh over one device's (with --per-device the mesh decodes data x more rows).
    throughput = {k: on_mesh[k]["tokens_per_s"] / today[k]["tokens_per_s"] for k in today if "tokens_per_s" in today[k]}
    print(
      f"  B={b:3d}{f' (mesh {mesh_b})' if mesh_b != b else ''} time mesh/today "
      + "  ".join(f"{k} {r:5.3f}" for k, r in ratios.items())
      + "  tokens/s mesh/today "
      + "  ".join(f"{k} {r:5.2f}" for k, r in throughput.items())
      + f"  same_program {same_program}  same_tokens {same_tokens}",
      flush=True,
    )
    rows.append(
      {
        "batch": b,
        "mesh_batch": mesh_b,
        "throughput_ratio": throughput,
        "today": today,
        "mesh": on_mesh,
        "ratio": ratios,
        "same_program": same_program,
        "same_tokens": same_tokens,
        "no_more_cost": all(r <= 1.02 for r in ratios.values()),
      }
    )
    result = {
      "info": info,
      "args": vars(args),
      "config": {k: str(v) for k, v in vars(config).items()},
      "partitioning": str(sharded_target.partitioning),
      "rows": rows,
    }
    with open(path, "w") as f:  # after every batch size: a run cut short keeps what it measured
      json.dump(result, f, indent=1)
  print(f"wrote {path}")
  return result


if __name__ == "__main__":
  main()
