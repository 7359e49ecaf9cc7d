"""How close does the rejection sampler get to its memory-traffic floor?

The sampler is memory-bound (docs/sampler.md, "how the sampler spends memory
traffic"): the floor is one read of `target_logits` [B, K+1, V]. This script
times `rejection_sample` for several sampling mixes, plus reference kernels,
and reports each against that floor:

    floor_ms = bytes(target_logits) / copy bandwidth measured in the same run
    frac     = floor_ms / ms     (1.0 = at the floor; higher is better)
    x_floor  = ms / floor_ms
    all_frac = the same with draft_probs [B, K, V] added to the bytes (cases
               that take draft probabilities; the sampler gathers only a few
               entries of them, so this is the looser of the two floors)

Cases:
    greedy_static       all_greedy=True (static flag: argmax-only program)
    greedy_runtime      all temperatures 0, no flag (run-time lax.cond)
    random_draft_probs  T=1 on every row, draft_probs given
    random_ngram        T=1, draft_probs=None (n-gram drafts)
    mixed               odd rows T=0, even rows T=1, draft_probs given (at B=1
                        the one row is random)
    random_topk_topp    T=1, top_k=50, top_p=0.9, draft_probs given
    block_ngram         random_ngram with method="block" (block verification)
    block_draft_probs   random_draft_probs with method="block" (one more pass
                        over positions 1..K-1 of logits and draft probs)
    softmax_baseline    jnp.argmax(jax.nn.softmax(logits)): greedy done the
                        "always softmax" way
    argmax_only         jnp.argmax over [B, K+1, V] (reference kernel)
    onepass_rows        one variadic reduce: (max, sum of exps, argmax) per row
    onepass_chunks      the same per chunk of about 1024 tokens (what the
                        unfiltered random path does)
    logsumexp_only      jax.nn.logsumexp over [B, K+1, V] (reference kernel)

How it times (see bench/common.py): N iterations run inside ONE jitted
`lax.fori_loop` (no dispatch overhead). Each iteration runs the case once on
each of n (2 to 32) separate preallocated logits buffers (and draft probs),
together well above the 50 MB L2 of an H100 where memory allows
(`--rotate-mb`), so inputs come from HBM, not from cache; the reported time is
per sampler call. The buffers are separate arguments (materialised, like a
real target's logits), not slices of one stack: a slice entering a `lax.cond`
gets copied, which would add two passes a real decoding loop does not pay.
Each sampler call depends on the previous one: the previous output (a
checksum of the emitted tokens) is folded into the draft ids and the PRNG key,
and the loop returns it, so XLA can neither delete the work nor hoist it out of
the loop. Sampling parameters are jit arguments, not
constants, so run-time branches stay run-time. Per case the script records the
ops in the optimised HLO (exponential, sort, ...) and checks them against what
the case must contain, lists the arrays of [B, K, V] elements or more that the
program may write to memory (column `big`; XLA on CPU copies the loop's buffer
slice before some reductions, an artefact that is flagged), and checks that 2N
iterations take about twice as long as N. Result: median over repeats of
(loop time / N).

Run (GPU: full grid; CPU without a GPU: the quick grid, 1-2 minutes, mostly compilation):

    PYTHONPATH=. python3 bench/sampler.py --out bench/out
    PYTHONPATH=. python3 bench/sampler.py --quick
    PYTHONPATH=. python3 bench/sampler.py --batch-sizes 1024 --vocab-sizes 151936 \\
        --cases greedy_static,random_ngram,argmax_only

Writes OUT/sampler.json (all numbers, device, versions, date, command line)
and OUT/sampler.png (fraction of the floor per case, grouped by B, largest V).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import math
import os
import sys
import warnings
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402
from specdec_jax.sampling.params import SamplingParams
from specdec_jax.sampling.penalties import PenaltyState
from specdec_jax.sampling.reductions import chunk_size, max_and_sumexp
from specdec_jax.sampling.thresholds import group_top, threshold_and_lse
from specdec_jax.verify.chain import rejection_sample  # noqa: E402

FULL_BATCH_SIZES = (1, 32, 256, 1024)
FULL_VOCAB_SIZES = (32000, 151936)
QUICK_BATCH_SIZES = (1, 32)
QUICK_VOCAB_SIZES = (32000,)
SENTINEL = np.iinfo(np.int32).min  # a checksum value that (almost) never occurs


# ----------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------


def _checksum(out) -> jax.Array:
  """int32 scalar that depends on every emitted token (and its log-probability, when asked for)."""
  total = jnp.sum(out.token_ids) + jnp.sum(out.num_accepted)
  if out.logprobs is not None:
    total = total + jax.lax.bitcast_convert_type(jnp.sum(out.logprobs), jnp.int32)
  return total


@dataclasses.dataclass(frozen=True)
class Case:
  """One benchmarked computation.

  fn(logits [B,K+1,V], draft [B,K], draft_probs [B,K,V] or None, params, key) -> int32 scalar.
  """

  fn: Callable
  temperature: Callable[[int], np.ndarray]  # B -> f32[B]
  top_k: int = 0
  top_p: float = 1.0
  draft_probs: bool = False
  min_p: float = 0.0  # 0 = off (the params then carry no min_p field)
  penalties: bool = False  # repetition/frequency/presence penalties and a logit bias, with a [B, V] state
  must_have: tuple = ()  # HLO ops the optimised program must contain
  must_not_have: tuple = ()  # ... and must not


def _zeros(b):
  return np.zeros((b,), np.float32)


def _ones(b):
  return np.ones((b,), np.float32)


def _half(b):
  return np.where(np.arange(b) % 2 == 1, 0.0, 1.0).astype(np.float32)  # B=1: one random row


# Set from --kernels before any case is traced: which program `rejection_sample` runs.
OPTIONS = {"kernels": "auto"}


def _sample(**flags):
  def fn(logits, draft, dp, params, key):
    return _checksum(
      rejection_sample(
        draft_token_ids=draft,
        target_logits=logits,
        params=params,
        key=None if flags.get("all_greedy") else key,
        draft_probs=dp,
        kernels=OPTIONS["kernels"],
        **flags,
      )
    )

  return fn


def _sample_penalized(**flags):
  def fn(logits, draft, dp, params_and_state, key):
    params, state = params_and_state
    return _checksum(
      rejection_sample(
        draft_token_ids=draft,
        target_logits=logits,
        params=params,
        key=key,
        draft_probs=dp,
        penalty_state=state,
        **flags,
      )
    )

  return fn


def _penalty_state(b, v):
  """A PenaltyState as a long request would have it: some prompt tokens, small output counts."""
  k1, k2 = jax.random.split(jax.random.key(3))
  return PenaltyState(
    prompt_mask=jax.random.bernoulli(k1, 0.002, (b, v)),
    output_counts=jax.random.poisson(k2, 0.002, (b, v)).astype(jnp.int32),
  )


def _threshold_checksum(x, d, params, full):
  x = jnp.where(d[0, 0] == -1, 0.0, x)  # never true (d >= 0), but ties each call to the last: no hoisting
  if full:
    thr, lse = threshold_and_lse(x, params.temperature, params.top_k, params.top_p)
    return jax.lax.bitcast_convert_type(jnp.sum(thr) + jnp.sum(lse), jnp.int32)
  tops, mass = group_top(x, with_sumexp=True)
  return jax.lax.bitcast_convert_type(jnp.sum(tops[..., -1]) + jnp.sum(mass), jnp.int32)


def _stats_checksum(x, d, c):
  x = jnp.where(d[0, 0] == -1, 0.0, x)  # never true (d >= 0), but ties each call to the last: no hoisting
  if c is not None:
    x = x.reshape(x.shape[:-1] + (x.shape[-1] // c, c))
  m, s, i = max_and_sumexp(x, with_argmax=True)
  return jnp.sum(i) + jax.lax.bitcast_convert_type(jnp.sum(m + jnp.log(s)), jnp.int32)


CASES: dict[str, Case] = {
  "greedy_static": Case(
    _sample(all_greedy=True), _zeros, must_have=("reduce",), must_not_have=("exponential", "sort", "threefry")
  ),
  "greedy_runtime": Case(_sample(), _zeros, must_have=("reduce", "conditional")),
  "random_draft_probs": Case(_sample(), _ones, draft_probs=True, must_have=("reduce", "exponential")),
  "random_ngram": Case(_sample(), _ones, must_have=("reduce", "exponential", "threefry")),
  "mixed": Case(_sample(), _half, draft_probs=True, must_have=("reduce", "exponential")),
  "random_topk_topp": Case(
    _sample(), _ones, top_k=50, top_p=0.9, draft_probs=True, must_have=("reduce", "exponential")
  ),
  # Log-probabilities of the emitted tokens (issue goal: at most +10% on the random path).
  "logprobs_processed": Case(_sample(logprobs="processed"), _ones, must_have=("reduce", "exponential")),
  "logprobs_raw": Case(_sample(logprobs="raw"), _ones, must_have=("reduce", "exponential")),
  # Block verification (issue goal: within 10% of token verification, the random_* cases).
  "block_ngram": Case(_sample(method="block"), _ones, must_have=("reduce", "exponential", "threefry")),
  "block_draft_probs": Case(_sample(method="block"), _ones, draft_probs=True, must_have=("reduce", "exponential")),
  # Second-generation options (issue goals: min-p at most +10% on the random path,
  # penalties within 1.5x of it; the penalty state's [B, V] bytes count in the floor).
  "min_p": Case(_sample(), _ones, min_p=0.05, must_have=("reduce", "exponential")),
  "min_p_draft_probs": Case(_sample(), _ones, min_p=0.05, draft_probs=True, must_have=("reduce", "exponential")),
  "penalties_ngram": Case(_sample_penalized(), _ones, penalties=True, must_have=("reduce", "exponential")),
  "penalties_draft_probs": Case(
    _sample_penalized(), _ones, penalties=True, draft_probs=True, must_have=("reduce", "exponential")
  ),
  "penalties_greedy": Case(
    _sample_penalized(all_greedy=True),
    _zeros,
    penalties=True,
    must_have=("reduce",),
    must_not_have=("exponential", "threefry"),
  ),
  "logprobs_greedy": Case(
    _sample(all_greedy=True, logprobs="processed"),
    _zeros,
    must_have=("reduce", "exponential"),
    must_not_have=("threefry",),
  ),
  "softmax_baseline": Case(
    lambda x, d, dp, p, k: jnp.sum(jnp.argmax(jax.nn.softmax(x, axis=-1), axis=-1)),
    _zeros,
    must_have=("reduce", "exponential"),
  ),
  "argmax_only": Case(
    lambda x, d, dp, p, k: jnp.sum(jnp.argmax(x, axis=-1)),
    _zeros,
    must_have=("reduce",),
    must_not_have=("exponential",),
  ),
  # The one pass over the logits that the random path makes, alone: row-level
  # (max, sum of exps, argmax) and per chunk of `chunk_size(V)` tokens.
  "onepass_rows": Case(lambda x, d, dp, p, k: _stats_checksum(x, d, None), _ones, must_have=("reduce", "exponential")),
  "onepass_chunks": Case(
    lambda x, d, dp, p, k: _stats_checksum(x, d, chunk_size(x.shape[-1])), _ones, must_have=("reduce", "exponential")
  ),
  # The top-k/top-p threshold search alone, and its first stage (the group top-4 pass) alone.
  "threshold_search": Case(
    lambda x, d, dp, p, k: _threshold_checksum(x, d, p, full=True),
    _ones,
    top_k=50,
    top_p=0.9,
    must_have=("reduce", "sort"),
  ),
  "group_top_pass": Case(lambda x, d, dp, p, k: _threshold_checksum(x, d, p, full=False), _ones, must_have=("reduce",)),
  "logsumexp_only": Case(
    lambda x, d, dp, p, k: jax.lax.bitcast_convert_type(jnp.sum(jax.nn.logsumexp(x, axis=-1)), jnp.int32),
    _zeros,
    must_have=("reduce", "exponential"),
  ),
}
DRAFT_PROB_CASES = tuple(n for n, c in CASES.items() if c.draft_probs)
# The cases, batch sizes and vocabularies of the vLLM peer's harness (`--peer`; ../shared/peer in the guide).
PEER_CASES = (
  "greedy_static",
  "random_draft_probs",
  "random_ngram",
  "random_topk_topp",
  "block_ngram",
  "block_draft_probs",
)
PEER_BATCH_SIZES = (1024, 64, 8, 1)
PEER_VOCAB_SIZES = (151936, 49152)


def make_step(case: Case, n_buf: int, vocab: int):
  """Loop body: one sampler call on each of the n buffers, each chained to the last.

  The buffers are separate jit arguments, i.e. materialised arrays, as a real
  target's logits are (the output of its lm_head matmul). Slicing them out of
  one stacked array instead would hand the sampler an unmaterialised slice,
  which XLA copies when it enters a `lax.cond`: two extra passes that a real
  decoding loop does not pay.
  """

  def step(i, carry, logits_bufs, dp_bufs, draft0, params, key0):
    for j in range(n_buf):
      draft = (draft0 + carry) % vocab  # the previous output picks the draft tokens
      key = jax.random.fold_in(key0, carry)  # ... and the random numbers
      carry = carry + case.fn(logits_bufs[j], draft, None if dp_bufs is None else dp_bufs[j], params, key)
    return carry

  return step


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _make_buffer(key, b, k, v, with_dp):
  k1, k2 = jax.random.split(key)
  logits = 2.0 * jax.random.normal(k1, (b, k + 1, v), jnp.float32)
  dp = jax.nn.softmax(2.0 * jax.random.normal(k2, (b, k, v), jnp.float32), axis=-1) if with_dp else None
  return logits, dp


def make_inputs(key, n_buf, b, k, v, with_dp, mesh=None):
  """n_buf separate logits [B, K+1, V] and draft probs [B, K, V] (or None), draft ids [B, K].

  With a mesh, the logits and draft probs are split over its "model" axis on V.
  """
  bufs = [_make_buffer(jax.random.fold_in(key, j), b, k, v, with_dp) for j in range(n_buf)]
  if mesh is not None:
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, "model"))
    bufs = [jax.device_put(pair, split) for pair in bufs]
  draft = jax.random.randint(jax.random.fold_in(key, n_buf), (b, k), 0, v, jnp.int32)
  return tuple(x for x, _ in bufs), (tuple(d for _, d in bufs) if with_dp else None), draft


# ----------------------------------------------------------------------------
# Running the grid
# ----------------------------------------------------------------------------


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  ints = lambda s: tuple(int(x) for x in s.split(",") if x)
  p.add_argument("--batch-sizes", type=ints, help=f"comma list (default {FULL_BATCH_SIZES}; quick {QUICK_BATCH_SIZES})")
  p.add_argument("--vocab-sizes", type=ints, help=f"comma list (default {FULL_VOCAB_SIZES}; quick {QUICK_VOCAB_SIZES})")
  p.add_argument(
    "--cases",
    type=lambda s: tuple(x for x in s.split(",") if x),
    help="comma list of (default all): " + ", ".join(CASES),
  )
  p.add_argument("--k", type=int, default=4, help="draft tokens per row, K (default 4)")
  p.add_argument(
    "--kernels",
    choices=("auto", "xla", "pallas"),
    default="auto",
    help="rejection_sample's kernels= (default auto: the Pallas program on a GPU where it covers the case)",
  )
  p.add_argument(
    "--peer",
    action="store_true",
    help=f"the peer harness's grid: cases {','.join(PEER_CASES)}, B {PEER_BATCH_SIZES}, V {PEER_VOCAB_SIZES} "
    "(explicit --cases/--batch-sizes/--vocab-sizes still win)",
  )
  p.add_argument("--iters", type=int, help="iterations per timed loop (default: about --target-ms per loop)")
  p.add_argument("--repeats", type=int, help="timed loops per case; the median is reported (default 5, quick 3)")
  p.add_argument(
    "--target-ms", type=float, help="aim of one timed loop when --iters is not given (default 100, quick 30)"
  )
  p.add_argument(
    "--rotate-mb",
    type=float,
    help="rotate among logits buffers totalling at least this much (default 4x the 50 MB L2; quick 64)",
  )
  p.add_argument("--copy-mb", type=float, help="buffer for the bandwidth measurement (default 2048 on GPU, 256 on CPU)")
  p.add_argument("--quick", action="store_true", help="tiny grid for CPU (the default when no GPU is present)")
  p.add_argument("--dump-hlo", action="store_true", help="write each case's optimised HLO to OUT/hlo_CASE_B_V.txt")
  p.add_argument(
    "--model-devices",
    type=int,
    default=1,
    help="split the vocabulary over this many devices (a 1 x M mesh; the floor is then one device's "
    "slice over its bandwidth) (default 1: no mesh)",
  )
  p.add_argument(
    "--trace",
    help="also profile each case (jax.profiler, 10 loop iterations) into this folder and record its kernels per call",
  )
  p.add_argument(
    "--out",
    default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"),
    help="output directory (default bench/out)",
  )
  args = p.parse_args(argv)
  if args.peer:
    args.cases = args.cases or PEER_CASES
    args.batch_sizes = args.batch_sizes or PEER_BATCH_SIZES
    args.vocab_sizes = args.vocab_sizes or PEER_VOCAB_SIZES
  args.cases = args.cases or tuple(CASES)
  if args.model_devices < 1 or args.model_devices > jax.device_count():
    p.error(f"--model-devices must be in [1, {jax.device_count()}] (the devices present), got {args.model_devices}")
  unknown = [c for c in args.cases if c not in CASES]
  if unknown:
    p.error(f"unknown case(s) {unknown}; choose from {list(CASES)}")
  if not args.quick and not common.has_gpu() and args.batch_sizes is None and args.vocab_sizes is None:
    print("No GPU found: running the --quick grid (pass --batch-sizes/--vocab-sizes to override).")
    args.quick = True
  q = args.quick
  args.batch_sizes = args.batch_sizes or (QUICK_BATCH_SIZES if q else FULL_BATCH_SIZES)
  args.vocab_sizes = args.vocab_sizes or (QUICK_VOCAB_SIZES if q else FULL_VOCAB_SIZES)
  args.repeats = args.repeats or (3 if q else 5)
  args.target_ms = args.target_ms or (30.0 if q else 100.0)
  if args.rotate_mb is None:
    args.rotate_mb = 64.0 if q else 4 * common.GPU_L2_BYTES / 2**20
  args.copy_mb = args.copy_mb or common.default_copy_bytes() / 2**20
  return args


def run_case(name, b, v, args, inputs, bandwidth):
  """Compiles and times one (case, B, V); returns a result row."""
  case = CASES[name]
  logits_stack, dp_stack, draft0 = inputs
  n_buf = len(logits_stack)
  params = SamplingParams.create(
    jnp.asarray(case.temperature(b)), top_k=case.top_k, top_p=case.top_p, min_p=case.min_p or None
  )
  if case.penalties:
    params = (
      SamplingParams.create(
        jnp.asarray(case.temperature(b)),
        top_k=case.top_k,
        top_p=case.top_p,
        repetition_penalty=1.1,
        frequency_penalty=0.3,
        presence_penalty=0.2,
        logit_bias={5: -1.0, 17: 2.0},
      ),
      _penalty_state(b, v),
    )
  operands = (logits_stack, dp_stack if case.draft_probs else None, draft0, params, jax.random.key(1))
  loop = common.timed_loop(make_step(case, n_buf, v))
  carry = jnp.int32(0)
  compiled, compile_s = common.compile_loop(loop, carry, operands)
  hlo = compiled.as_text()
  if args.dump_hlo:
    with open(os.path.join(args.out, f"hlo_{name}_B{b}_V{v}.txt"), "w") as f:
      f.write(hlo)
  ops = common.hlo_ops(hlo)
  # Arrays of [B, K, V] elements or more that the loop may write to memory (all cond branches).
  materialized = common.hlo_materialized(hlo, b * args.k * v)
  # The Pallas program's exponentials and random bits are inside its kernels, not HLO ops.
  pallas = "sampler_block_partials" in hlo  # the Pallas program's first kernel (verify.fused)
  missing = [op for op in case.must_have if not ops.get(op) and not (pallas and op in ("exponential", "threefry"))]
  unexpected = [op for op in case.must_not_have if ops.get(op)]
  r = common.time_per_iter(
    compiled, carry, operands, iters=args.iters, target_s=args.target_ms / 1e3, repeats=args.repeats
  )
  logit_bytes = b * (args.k + 1) * v * 4  # float32
  if case.penalties:  # the state (bool mask, int32 counts) is read too: it belongs to the floor
    logit_bytes += b * v * 5
  all_bytes = logit_bytes + (b * args.k * v * 4 if case.draft_probs else 0)
  ms = r["per_iter_s"] * 1e3 / n_buf  # one loop iteration runs the sampler once per buffer
  # Split over M devices, each reads its slice at its own bandwidth: the floor is one slice's read.
  m = args.model_devices
  floor_ms = logit_bytes / m / bandwidth * 1e3
  all_floor_ms = all_bytes / m / bandwidth * 1e3
  warns = []
  if missing or unexpected:
    warns.append(f"HLO: missing {missing}, unexpected {unexpected}")
  if r["scale"] < 1.5:
    warns.append(f"t(2N)/t(N) = {r['scale']:.2f}: work may not run every iteration")
  if any("dynamic_slice" in m for m in materialized):
    warns.append("the benchmark's buffer slice is copied: time includes an extra read+write of the inputs")
  if n_buf * logit_bytes < 2 * common.GPU_L2_BYTES and common.has_gpu():
    warns.append("all buffers together are under 2x L2: inputs may partly come from cache")
  if ms < 0.8 * floor_ms:
    warns.append("faster than the floor: inputs may be cached")
  trace = (
    trace_case(compiled, carry, operands, n_buf, os.path.join(args.trace, f"{name}_B{b}_V{v}")) if args.trace else None
  )
  return {
    "case": name,
    "B": b,
    "K": args.k,
    "V": v,
    "dtype": "float32",
    "model_devices": m,
    "kernels": args.kernels,
    "pallas": pallas,
    "collectives": common.hlo_collectives(hlo),
    "ms": ms,
    "floor_ms": floor_ms,
    "frac": floor_ms / ms,
    "x_floor": ms / floor_ms,
    "all_inputs_floor_ms": all_floor_ms,
    "all_inputs_frac": all_floor_ms / ms,
    "logits_bytes": logit_bytes,
    "all_inputs_bytes": all_bytes,
    "iters": r["iters"],
    "repeats_ms": [t / r["iters"] / n_buf * 1e3 for t in r["times_s"]],
    "scale_2n": r["scale"],
    "buffers": n_buf,
    "compile_s": compile_s,
    "hlo_ops": ops,
    "hlo_ok": not (missing or unexpected),
    "materialized": materialized,
    "warnings": warns,
    **({"trace": trace} if trace else {}),
  }


TRACE_ITERS = 10


def trace_case(compiled, carry, operands, n_buf: int, trace_dir: str) -> dict:
  """The kernels of one sampler call: a jax.profiler trace of TRACE_ITERS loop iterations (n_buf calls each),
  grouped by kernel name, per call (summed over the devices of a split call; `per_call["devices"]` says how
  many). The loop's own ops (the checksum, the key fold) are included."""
  from bench.step_profile import profile_trace  # the trace reader (imports the model code: only when asked)

  calls = TRACE_ITERS * n_buf
  rows, summary, error = profile_trace(lambda: compiled(0, TRACE_ITERS, carry, *operands), trace_dir, calls)
  if error:
    tqdm.write(f"  trace failed: {error}")
    return {"error": error}
  for r in rows[:8]:
    tqdm.write(f"  {r['per_step']:4.1f} x {r['us_per_step'] / max(r['per_step'], 1e-9):7.2f} us  {r['kernel'][:90]}")
  devices = max(1, summary.get("devices", 1))  # a split call's kernels run on every device: sums over them
  collectives = ", ".join(f"{k} {v / devices:.1f} us" for k, v in summary.get("collectives", {}).items())
  tqdm.write(
    f"  per call and device: {summary['launches_per_step'] / devices:.1f} kernels, "
    f"{summary['kernel_us_per_step'] / devices:.1f} us in kernels (collectives: {collectives or 'none'}), "
    f"{summary['span_us_per_step']:.1f} us first start to last end"
  )
  return {"per_call": summary, "kernels": rows[:20]}


def ratios(results):
  """Per (B, V): each case's time over greedy_static's and over argmax_only's."""
  out = {}
  for r in results:
    out.setdefault((r["B"], r["V"]), {})[r["case"]] = r["ms"]
  rows = []
  for (b, v), ms in out.items():
    for case, t in ms.items():
      rows.append(
        {
          "B": b,
          "V": v,
          "case": case,
          "ms": t,
          "vs_greedy_static": t / ms["greedy_static"] if "greedy_static" in ms else None,
          "vs_argmax_only": t / ms["argmax_only"] if "argmax_only" in ms else None,
        }
      )
  return rows


# ----------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------


def print_table(results):
  head = f"{'case':<20}{'B':>6}{'V':>8}{'ms':>10}{'floor ms':>10}{'frac':>7}{'x_floor':>8}{'all_frac':>9}{'iters':>7}{'2N/N':>6}{'big':>4}"
  print(head)
  print("-" * len(head))
  for r in results:
    print(
      f"{r['case']:<20}{r['B']:>6}{r['V']:>8}{r['ms']:>10.4f}{r['floor_ms']:>10.4f}{r['frac']:>7.2f}"
      f"{r['x_floor']:>8.2f}{r['all_inputs_frac']:>9.2f}{r['iters']:>7}{r['scale_2n']:>6.2f}"
      f"{len(r['materialized']):>4}" + ("  ! " + "; ".join(r["warnings"]) if r["warnings"] else "")
    )


def print_ratios(rows):
  print("\nRatios: time / greedy_static time, time / argmax_only time")
  head = f"{'B':>6}{'V':>8}  {'case':<20}{'ms':>10}{'/greedy_static':>16}{'/argmax_only':>14}"
  print(head)
  print("-" * len(head))
  fmt = lambda x: f"{x:.2f}" if x is not None else "-"
  last = None
  for r in rows:
    if last is not None and (r["B"], r["V"]) != last:
      print()
    last = (r["B"], r["V"])
    print(
      f"{r['B']:>6}{r['V']:>8}  {r['case']:<20}{r['ms']:>10.4f}{fmt(r['vs_greedy_static']):>16}"
      f"{fmt(r['vs_argmax_only']):>14}"
    )


def plot(results, path):
  """Grouped bars: fraction of the floor per case, one group per B, largest V."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    warnings.warn("matplotlib is not installed: no plot written")
    return None
  if not results:
    return None
  v = max(r["V"] for r in results)
  rows = [r for r in results if r["V"] == v]
  bs = sorted({r["B"] for r in rows})
  cases = [c for c in CASES if any(r["case"] == c for r in rows)]
  width = 0.8 / len(cases)
  fig, ax = plt.subplots(figsize=(max(7, 1.6 * len(bs) + 5), 4.5))
  for ci, c in enumerate(cases):
    ys = [next((r["frac"] for r in rows if r["B"] == b and r["case"] == c), np.nan) for b in bs]
    ax.bar(np.arange(len(bs)) + (ci - (len(cases) - 1) / 2) * width, ys, width, label=c)
  ax.axhline(1.0, color="k", lw=0.8, ls="--")
  ax.set_xticks(np.arange(len(bs)), [f"B={b}" for b in bs])
  ax.set_ylabel("fraction of floor (floor ms / ms)")
  dev = jax.devices()[0].device_kind
  ax.set_title(
    f"rejection_sample vs. one read of the logits, V={v}, K={rows[0]['K']}, {rows[0]['dtype']}, {dev}", fontsize=9
  )
  ax.set_ylim(0, max(1.1, 1.05 * np.nanmax([r["frac"] for r in rows])))
  ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def main(argv=None):
  args = parse_args(argv)
  OPTIONS["kernels"] = args.kernels
  os.makedirs(args.out, exist_ok=True)
  info = common.device_info()
  print(f"{info['device']} ({info['platform']}), jax {info['jax']}, python {info['python']}")
  bw = common.copy_bandwidth(int(args.copy_mb * 2**20), repeats=args.repeats)
  bandwidth = bw["bytes_per_s"]
  print(
    f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s (read + write of {common.fmt_bytes(bw['buffer_bytes'])}, "
    f"t(2N)/t(N) = {bw['scale']:.2f})"
  )
  mem = common.device_memory_bytes()

  report = {
    "info": info,
    "config": {k: v for k, v in vars(args).items()},
    "copy_bandwidth": bw,
    "results": [],
    "skipped": [],
  }
  json_path = os.path.join(args.out, "sampler.json")

  def skip(msg, n):
    tqdm.write("skip " + msg)
    report["skipped"].append(msg)
    bar.update(n)

  def save():
    report["ratios"] = ratios(report["results"])
    with open(json_path, "w") as f:
      json.dump(report, f, indent=1, default=str)

  grid = [(b, v) for v in args.vocab_sizes for b in args.batch_sizes]
  mesh = None
  if args.model_devices > 1:
    from specdec_jax.mesh import make_mesh

    mesh = make_mesh(1, args.model_devices)
    print(f"vocabulary split over {args.model_devices} devices: {mesh}")
  with_dp = any(c in DRAFT_PROB_CASES for c in args.cases)
  # Progress bar on a terminal; one line per case always (readable in captured logs).
  bar = tqdm(total=len(grid) * len(args.cases), desc="sampler", unit="case", disable=not sys.stderr.isatty())
  for b, v in grid:
    buf_bytes = b * (args.k + 1) * v * 4
    # Separate buffers, unrolled in each iteration: at most 32 (compile time), so that small batches
    # too read from memory, not from L2.
    n_buf = min(32, max(2, math.ceil(args.rotate_mb * 2**20 / buf_bytes)))
    stack_bytes = n_buf * (buf_bytes + (b * args.k * v * 4 if with_dp else 0))
    need = stack_bytes + 8 * buf_bytes  # the stacks, plus room for sort/softmax temporaries
    if mem is not None and need > 0.85 * mem:
      skip(f"B={b} V={v}: needs ~{common.fmt_bytes(need)}, device has {common.fmt_bytes(mem)}", len(args.cases))
      continue
    try:
      inputs = jax.block_until_ready(make_inputs(jax.random.key(0), n_buf, b, args.k, v, with_dp, mesh))
    except Exception as e:  # e.g. out of memory: skip this (B, V), keep going
      skip(f"B={b} V={v}: making inputs failed: {type(e).__name__}: {str(e)[:300]}", len(args.cases))
      continue
    for name in args.cases:
      bar.set_postfix_str(f"{name} B={b} V={v}")
      try:
        with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
          r = run_case(name, b, v, args, inputs, bandwidth)
      except Exception as e:
        skip(f"{name} B={b} V={v}: {type(e).__name__}: {str(e)[:300]}", 1)
        continue
      report["results"].append(r)
      tqdm.write(
        f"{name:<20} B={b:<5} V={v:<7} {r['ms']:9.4f} ms  frac {r['frac']:.2f}"
        + ("  ! " + "; ".join(r["warnings"]) if r["warnings"] else "")
      )
      bar.update(1)
      gc.collect()
    del inputs
    gc.collect()
    save()  # partial results survive a timeout
  bar.close()

  print()
  print(
    f"floor = bytes of target_logits [B, K+1, V] read once / {bandwidth / 1e9:.1f} GB/s; "
    "all_frac adds draft_probs [B, K, V] for the cases that take them"
  )
  print_table(report["results"])
  save()
  print_ratios(report["ratios"])
  png = plot(report["results"], os.path.join(args.out, "sampler.png"))
  print(f"\nwrote {json_path}" + (f" and {png}" if png else ""))
  bad = [r for r in report["results"] if r["warnings"]]
  if bad:
    print(f"{len(bad)} result(s) carry warnings (see '!' above)")


if __name__ == "__main__":
  main()
