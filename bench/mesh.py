"""The sharded code paths against one device: the same program on a 1-device mesh, the speed-up on several.

`specdec_jax.models.shard` and the mesh support in the loops add sharding
constraints and (for a split model) a different parameter layout. On a
1-device mesh nothing is split, so the compiled program should be today's;
on more devices this benchmark measures what each split buys.

What: a random-weight model shaped like SmolLM2-135M (V=49152, L=30, D=576, 9
query / 3 KV heads of 64, F=1536) or, `--shape qwen2.5-coder-1.5b`, like
Qwen2.5-Coder-1.5B (bench/step_profile.py's SHAPES), bf16 on GPU, f32 on CPU,
and a 2-layer draft of the same shape. With `--real` the model itself
(`bench/real_target.py`'s loaders; the GGUF must be in place) with its shipped
EAGLE head, on the held-out prompts (examples/held_out_prompts.json, in the
chat template, cycled to B rows). Paths, the same calls:

    today   the models as built, no mesh (what every other benchmark measures);
    DxM     shard(model, make_mesh(D, M)) for target and drafts, called under
            `with jax.set_mesh(mesh):`, inputs placed by rows
            (NamedSharding P("data", ...)); one path per `--splits` entry
            (default: `--data` x `--model`).

Measured, per batch size B (default 1, 8, 32):
  - same_program (a 1-device mesh only): the two compiled programs
    (`generate`, and `speculative_generate` with the draft model) hold the
    same instructions (opcode and shape, in order; names and metadata ignored).
  - collectives: on a mesh, the collective instructions of one step and
    one verification call (e.g. a split model's all-reduces), by shape.
  - step / verify: one target call on T=1 and T=K+1 tokens (cache of
    P + max_new_tokens + K + 1 slots), N calls in one jitted fori_loop
    (bench/common.py `time_per_iter`, median of 5 loops); on a mesh that
    splits rows only, each device's call on its rows inside a shard_map
    (what the loops run there). With `--trace DIR`,
    a jax.profiler trace of each: kernel time per call by category, the
    collectives (NCCL kernels) by kind, per device.
  - whole calls, greedy, max_new_tokens each row, no EOS (`--drafters`):
    `generate`; `speculative_generate` with prompt lookup (lookup), the 2-layer
    draft model (draft_model) or the EAGLE head (eagle, `--real` only), K
    drafts a round: wall time of one call, median of --repeats after a compile
    call, tokens/s, and whether the tokens equal today's.
  `--forced-accepts A`: every round accepts A drafts (`speculative_generate_forced`,
  a benchmark knob, NOT lossless), so random weights time the rounds of a
  drafter whose mean accepted length is A + 1.
  `--per-device`: B rows per device of the data axis, so a DxM path decodes
  B x D rows against today's B (throughput); otherwise both decode B.
  Each row prints time DxM/today and tokens/s DxM/today.

Usage (from the repository root; a CPU run is a smoke test, not a figure):
    PYTHONPATH=. python3 bench/mesh.py --out $OUT                                   # one GPU: 1x1 mesh vs no mesh
    PYTHONPATH=. python3 bench/mesh.py --out $OUT --batch 1 8 64 --splits 2x1 1x2 --per-device --trace $OUT/tr
    PYTHONPATH=.:/tmp/site python3 bench/mesh.py --out $OUT --shape qwen2.5-coder-1.5b --real \
        --batch 1 8 64 --splits 2x1 1x2 --per-device          # the GGUF in place (bench/gguf_parts.py)
    PYTHONPATH=. python3 bench/mesh.py --tiny --batch 2 --max-new-tokens 8 --repeats 1   # CPU smoke test, ~20 s

`--kernels pallas` loads the models on the Pallas blocks (a GPU; on a mesh that splits rows only, each
device's program takes them as one device's does).

Output: a table on stdout and JSON, `mesh_<shape>[_real]_<splits>[_per_device][_pallas].json`
in --out (default bench/out/), written after every batch size.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import device_info, has_gpu, hlo_collectives, time_per_iter, timed_loop
from bench.decode import run_generation
from bench.step_profile import SHAPES
from specdec_jax import SamplingParams, generate, speculative_generate
from specdec_jax.drafts.lookup import PromptLookupDrafter
from specdec_jax.loop.decoding import _generate_jit, _speculative_jit, _split
from specdec_jax.loop.forced import speculative_generate_forced
from specdec_jax.mesh import axis_size
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


DRAFTERS = ("lookup", "draft_model", "eagle")


def parse_split(text: str) -> tuple[int, int]:
  """ "2x1" -> (data=2, model=1)."""
  try:
    d, m = (int(x) for x in text.lower().split("x"))
  except ValueError:
    raise argparse.ArgumentTypeError(f"a split is DATAxMODEL, e.g. 2x1 or 1x2; got {text!r}") from None
  if d < 1 or m < 1:
    raise argparse.ArgumentTypeError(f"a split's sizes must be >= 1, got {text!r}")
  return d, m


def parse_args(argv=None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32], help="batch sizes B (default 1 8 32)")
  ap.add_argument("--data", type=int, default=1, help="data axis of the mesh (default 1; see --splits)")
  ap.add_argument("--model", type=int, default=1, help="model axis of the mesh (default 1; see --splits)")
  ap.add_argument(
    "--splits", type=parse_split, nargs="+", help="meshes DATAxMODEL to time against today (default --data x --model)"
  )
  ap.add_argument("-k", type=int, default=4, help="K, drafts per round (default 4)")
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--repeats", type=int, default=5, help="timed whole calls per configuration (default 5)")
  ap.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: bfloat16 on GPU, float32 on CPU")
  ap.add_argument(
    "--shape", choices=tuple(SHAPES), default="smollm2", help="the random model's shape (default smollm2)"
  )
  ap.add_argument("--tiny", action="store_true", help="a 4-layer model (smoke test), not --shape's sizes")
  ap.add_argument(
    "--kernels",
    choices=("xla", "pallas"),
    default="xla",
    help="the models' blocks (TransformerConfig.kernels; default xla): on a mesh that splits rows only each "
    "device's program takes the Pallas blocks too",
  )
  ap.add_argument("--real", action="store_true", help="the real model of --shape and its EAGLE head, real prompts")
  ap.add_argument(
    "--drafters",
    help=f"comma list of {', '.join(DRAFTERS)} (default lookup,draft_model; with --real lookup,eagle)",
  )
  ap.add_argument(
    "--per-device",
    action="store_true",
    help="B rows per device of the data axis: the mesh runs B x data rows against one device's B (throughput)",
  )
  ap.add_argument("--trace", help="directory for jax.profiler traces of the step and verification calls")
  ap.add_argument("--trace-batches", type=int, nargs="+", help="trace only these batch sizes (default: every --batch)")
  ap.add_argument(
    "--forced-accepts",
    type=int,
    help="every speculative round accepts this many drafts (speculative_generate_forced: a benchmark knob, NOT "
    "lossless), so random weights time the rounds of a drafter that accepts that many; tokens are not compared",
  )
  ap.add_argument(
    "--out",
    default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"),
    help="directory for the JSON (default bench/out, git-ignored)",
  )
  args = ap.parse_args(argv)
  if any(b < 1 for b in args.batch) or args.data < 1 or args.model < 1 or args.k < 1 or args.repeats < 1:
    ap.error("--batch, --data, --model, -k and --repeats must be >= 1")
  if args.real and args.tiny:
    ap.error("--real loads --shape's model; --tiny is a random 4-layer one")
  args.splits = args.splits or [(args.data, args.model)]
  for d, m in args.splits:
    if d * m > jax.device_count():
      ap.error(f"split {d}x{m} needs {d * m} devices, JAX sees {jax.device_count()}")
    bad = [] if args.per_device else [b for b in args.batch if b % d]
    if bad:
      ap.error(f"every --batch must be a multiple of the data axis {d} (or use --per-device), got {bad}")
  args.drafters = tuple(
    x for x in (args.drafters or ("lookup,eagle" if args.real else "lookup,draft_model")).split(",") if x
  )
  unknown = [x for x in args.drafters if x not in DRAFTERS]
  if unknown:
    ap.error(f"--drafters: unknown {unknown}; choose from {', '.join(DRAFTERS)}")
  if "eagle" in args.drafters and not args.real:
    ap.error("--drafters eagle needs --real (a head of random weights accepts nothing)")
  if args.forced_accepts is not None and not 0 <= args.forced_accepts <= args.k:
    ap.error(f"--forced-accepts must be in [0, K={args.k}], got {args.forced_accepts}")
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


def cycled(base: tuple[np.ndarray, np.ndarray], b: int) -> tuple[np.ndarray, np.ndarray]:
  """b rows of the prompts `base` ([N, P] tokens, [N] lengths), cycling from the first."""
  rows = np.arange(b) % len(base[0])
  return base[0][rows], base[1][rows]


def real_models(shape: str, dtype, kernels: str = "xla"):
  """(target, EAGLE head, (tokens [6, P], lengths [6])): `bench/real_target.py`'s model of `shape` on `kernels`."""
  from bench import real_target as rt  # noqa: PLC0415  (imports the loaders: only with --real)
  from bench import smollm2 as bs  # noqa: PLC0415

  spec = rt.MODELS[shape]()
  target, tokenizer = spec.load(dtype, kernels)
  eagle = spec.load_eagle(dtype, kernels) if spec.shipped_eagle else None
  texts = [spec.chat_prompt(t) for t in rt.held_out_prompts(rt.PROMPT_NAMES).values()]
  return target, eagle, bs.encode(tokenizer, texts)


def model_step_loop(model, b: int, t: int, max_length: int, prompt_len: int = PROMPT_LEN, rows_only: int = 1):
  """`time_per_iter` arguments timing one model call on [B, T] tokens per iteration.

  `rows_only` = d > 1 (a mesh that splits rows only): each of the d devices calls the model on its B/d rows
  inside a shard_map, the program the loops run there (`generate` on such a mesh), with no collective.
  """
  graphdef, state = nnx.split(model)

  def step(i, carry, state):
    cache, acc = carry
    m = nnx.merge(graphdef, state)
    rows = cache.k.shape[1]  # this device's rows inside the shard_map
    tokens = jnp.full((rows, t), i % 7, jnp.int32)  # depends on i: the call cannot be hoisted
    positions = jnp.broadcast_to(prompt_len + jnp.arange(t, dtype=jnp.int32), (rows, t))
    logits, cache = m(tokens, positions, cache)
    return cache, acc + jnp.max(logits[:, -1, :8])

  cache = model.init_cache(b, max_length)
  if rows_only == 1:
    return timed_loop(step), (cache, jnp.float32(0)), (state,)
  cache_spec = jax.tree.map(lambda _: P(None, "data"), cache)  # [L, B, Hkv, S, Dh]: rows on axis 1
  carry_spec = (cache_spec, P("data"))  # one accumulator a device

  def per_device(i, carry, state):
    def body(c, st):  # this device's rows; its accumulator is a [1] slice of the [d] one
      cache, acc = step(i, (c[0], c[1][0]), st)
      return cache, acc[None]

    return jax.shard_map(body, in_specs=(carry_spec, P()), out_specs=carry_spec, check_vma=False)(carry, state)

  return timed_loop(per_device), (cache, jnp.zeros((rows_only,), jnp.float32)), (state,)


def trace_loop(r: dict, carry, operands, trace_dir: str) -> dict:
  """Kernel time of one call of a `time_per_iter` result `r`'s loop, from a jax.profiler trace: per device
  (summed over devices / their number), by category, and the collectives (NCCL kernels) by kind."""
  from bench.step_profile import profile_trace  # noqa: PLC0415  (the trace reader: only when asked)

  n = max(1, min(int(r["iters"]), 50))
  rows, summary, error = profile_trace(lambda: r["compiled"](0, n, carry, *operands), trace_dir, n)
  if error:
    return {"error": error}
  devices = max(1, summary.get("devices", 1))
  per_device = lambda us: us / devices
  return {
    "devices": devices,
    "kernel_us": per_device(summary["kernel_us_per_step"]),
    "span_us": summary["span_us_per_step"],
    "launches": summary["launches_per_step"] / devices,
    "categories_us": {k: per_device(v) for k, v in summary["categories"].items()},
    "collectives_us": {k: per_device(v) for k, v in summary.get("collectives", {}).items()},
    "top": [dict(row, us_per_step=per_device(row["us_per_step"])) for row in rows[:12]],
  }


def measure(path: str, target, drafts: dict, mesh, b: int, args, base_prompts) -> tuple[dict, dict]:
  """Timings of one path ("today" or a split) at batch b; (results, tokens of each whole call)."""
  tokens, lengths = cycled(base_prompts, b)
  if mesh is None:
    place = jnp.asarray
  else:

    def place(a):
      return jax.device_put(a, NamedSharding(mesh, P("data", *([None] * (np.ndim(a) - 1)))))

  x, n, params = place(tokens), place(lengths), jax.tree.map(place, SamplingParams.greedy(b))
  common = {"max_new_tokens": args.max_new_tokens, "all_greedy": True}
  calls = {"generate": lambda: generate(target, x, n, params, None, **common)}
  spec = dict(common, num_speculative_tokens=args.k)
  if args.forced_accepts is not None:
    spec_fn = functools.partial(speculative_generate_forced, forced_accepts=args.forced_accepts)
  else:
    spec_fn = speculative_generate
  for name, drafter in drafts.items():
    calls[f"speculative ({name})"] = lambda d=drafter: spec_fn(target, d, x, n, params, None, **spec)
  out = {}
  p = int(tokens.shape[1])
  max_length = p + args.max_new_tokens + args.k + 1
  rows_only = axis_size("data") if mesh is not None and axis_size("model") == 1 else 1
  for name, t in (("step", 1), ("verify", args.k + 1)):
    loop, carry, operands = model_step_loop(target, b, t, max_length, p, rows_only)
    r = time_per_iter(loop, carry, operands)
    out[name] = {"s": r["per_iter_s"], "scale": r["scale"]}
    if mesh is not None:  # what crosses devices in one call (a split model's all-reduces, say)
      out[name]["collectives"] = hlo_collectives(r["compiled"].as_text())
    if args.trace and (args.trace_batches is None or b in args.trace_batches):
      out[name]["trace"] = trace_loop(r, carry, operands, os.path.join(args.trace, f"{path}_B{b}_{name}"))
  tokens_out = {}
  for name, fn in calls.items():
    result, timing = run_generation(fn, args.repeats)
    tokens_out[name] = np.asarray(result.tokens)
    emitted = float(np.sum(result.lengths))
    out[name] = {
      "s": timing["median_s"],
      "times_s": timing["times_s"],
      "tokens_per_s": emitted / timing["median_s"],
      "mean_accepted_length": float(result.stats.mean_accepted_length),
    }
  print(f"  {path:5s} B={b:3d}  " + "  ".join(f"{k} {v['s'] * 1e3:8.2f} ms" for k, v in out.items()), flush=True)
  for name in ("step", "verify"):
    if out[name].get("collectives"):
      c = out[name]["collectives"]
      print(f"        {name}: {sum(c.values())} collectives per call ({', '.join(f'{k} x{n}' for k, n in c.items())})")
    tr = out[name].get("trace")
    if tr and "error" not in tr:
      coll = ", ".join(f"{k} {v:.1f} us" for k, v in tr["collectives_us"].items()) or "none"
      print(f"        {name} trace: {tr['kernel_us']:.1f} us in kernels a device; collectives: {coll}")
  return out, tokens_out


def compiled_programs(target, draft, mesh, b: int, args) -> dict[str, list]:
  """The instructions (see `program_ops`) of the compiled `generate` and `speculative_generate` (draft model)."""
  tokens, lengths = jnp.asarray(prompts(b, target.config.vocab_size)[0]), jnp.full((b,), PROMPT_LEN, jnp.int32)
  params = SamplingParams.greedy(b)
  target_def, target_arrays = _split(target, "target")
  draft_def, draft_arrays = _split(draft, "draft")
  static = {"max_new_tokens": args.max_new_tokens, "eos": (), "all_greedy": True, "logprobs": None}

  def lower():
    plain = _generate_jit.lower(target_arrays, None, tokens, lengths, params, None, target_def=target_def, **static)
    spec = _speculative_jit.lower(
      target_arrays,
      draft_arrays,
      None,  # no grammar
      tokens,
      lengths,
      params,
      None,
      target_def=target_def,
      draft_def=draft_def,
      drafter="model",
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


def split_name(split: tuple[int, int]) -> str:
  return f"{split[0]}x{split[1]}"


def main(argv=None):
  args = parse_args(argv)
  name = "tiny" if args.tiny else args.shape
  if args.real:
    target, eagle, base_prompts = real_models(args.shape, jnp.dtype(args.dtype), args.kernels)
    config = target.config
    if "eagle" in args.drafters and eagle is None:
      raise SystemExit(f"--drafters eagle: no EAGLE head is shipped for {args.shape}")
  else:
    config = TransformerConfig(
      **(TINY if args.tiny else SHAPES[args.shape]), dtype=jnp.dtype(args.dtype), kernels=args.kernels
    )
    target, eagle = Transformer(config, rngs=nnx.Rngs(0)), None
    base_prompts = prompts(max(args.batch) * max(d for d, _ in args.splits), config.vocab_size)
  drafts = {}
  for d in args.drafters:
    if d == "lookup":
      drafts[d] = PromptLookupDrafter((3, 2))
    elif d == "draft_model":
      drafts[d] = Transformer(config.replace(num_layers=2), rngs=nnx.Rngs(1))
    else:
      drafts[d] = eagle
  meshes = {split_name(sp): make_mesh(*sp) for sp in args.splits}
  sharded = {
    k: (shard(target, mesh), {d: m if d == "lookup" else shard(m, mesh) for d, m in drafts.items()})
    for k, mesh in meshes.items()
  }
  info = device_info()
  print(
    f"{info['device']} x{info['num_devices']}, jax {info['jax']}; splits {', '.join(meshes)}; {name} "
    f"{'(real weights)' if args.real else 'shape'}, {args.dtype}; drafters {', '.join(drafts)}; "
    + "; ".join(f"{k}: {t.partitioning}" for k, (t, _) in sharded.items())
  )
  rows = []
  os.makedirs(args.out, exist_ok=True)
  suffix = ("_real" if args.real else "") + "_" + "_".join(meshes) + ("_per_device" if args.per_device else "")
  suffix += "_pallas" if args.kernels == "pallas" else ""
  path = os.path.join(args.out, f"mesh_{name}{suffix}.json")
  for b in args.batch:
    today, today_tokens = measure("today", target, drafts, None, b, args, base_prompts)
    row = {"batch": b, "today": today, "splits": {}}
    for k, mesh in meshes.items():
      data, model = mesh.shape["data"], mesh.shape["model"]
      mesh_b = b * data if args.per_device else b
      with jax.set_mesh(mesh):
        on_mesh, mesh_tokens = measure(k, *sharded[k], mesh, mesh_b, args, base_prompts)
      # Only a 1-device mesh can compile to today's program; on more devices the check would cost
      # four more compilations (minutes on a GPU) to say False.
      same_program = None
      if data * model == 1 and "draft_model" in drafts:
        mesh_target, mesh_drafts = sharded[k]
        same_program = compiled_programs(target, drafts["draft_model"], None, b, args) == compiled_programs(
          mesh_target, mesh_drafts["draft_model"], mesh, b, args
        )
      same_tokens = {c: bool(np.array_equal(today_tokens[c], mesh_tokens[c][:b])) for c in today_tokens}
      if args.forced_accepts is not None:  # forced rounds emit drafts, not the target's choices
        same_tokens = {c: v for c, v in same_tokens.items() if not c.startswith("speculative")}
      ratios = {c: on_mesh[c]["s"] / today[c]["s"] for c in today}
      # Tokens/s on the mesh over one device's (with --per-device the mesh decodes data x more rows).
      throughput = {
        c: on_mesh[c]["tokens_per_s"] / today[c]["tokens_per_s"] for c in today if "tokens_per_s" in today[c]
      }
      print(
        f"  B={b:3d} {k}{f' (mesh {mesh_b})' if mesh_b != b else ''} time mesh/today "
        + "  ".join(f"{c} {r:5.3f}" for c, r in ratios.items())
        + "  tokens/s mesh/today "
        + "  ".join(f"{c} {r:5.2f}" for c, r in throughput.items())
        + f"  same_program {same_program}  same_tokens {all(same_tokens.values())}",
        flush=True,
      )
      row["splits"][k] = {
        "data": data,
        "model": model,
        "mesh_batch": mesh_b,
        "mesh": on_mesh,
        "ratio": ratios,
        "throughput_ratio": throughput,
        "same_program": same_program,
        "same_tokens": same_tokens,
      }
    rows.append(row)
    result = {
      "info": info,
      "args": {k: (v if k != "splits" else [split_name(x) for x in v]) for k, v in vars(args).items()},
      "config": {k: str(v) for k, v in vars(config).items()},
      "partitioning": {k: str(t.partitioning) for k, (t, _) in sharded.items()},
      "rows": rows,
    }
    with open(path, "w") as f:  # after every batch size: a run cut short keeps what it measured
      json.dump(result, f, indent=1)
  print(f"wrote {path}")
  return result


if __name__ == "__main__":
  main()
