"""Tokens/s of `generate` vs `speculative_generate`: measured, and predicted from parts.

What: random-weight Llama-style models of realistic size (target shaped like
SmolLM2-135M: V=49152, L=30, D=576, 9 query / 3 kv heads of 64, F=1536,
rope_theta=1e5, bf16 on GPU; draft: the same with L=2). Random weights make the
acceptance meaningless as a quality figure, so this benchmark measures the
*overhead side* of speculation and checks it against a cost model: for every
configuration it reports the acceptance it got and what that acceptance should
buy.

Grid: B in {1, 8, 32}, K in {2, 4, 8}, mode greedy (all_greedy=True) and T=1,
drafter "model" (the 2-layer draft) and "lookup" (PromptLookupDrafter((3, 2))),
plus plain `generate` per (B, mode). Prompts: P=64 tokens per row, a random
16-token segment repeated with one token changed per copy (so prompt lookup
has something to match); no EOS, so every row emits exactly max_new_tokens=128.

Measured: tokens/s = sum(lengths) / wall time of one whole call (after a compile
call; median of 3 calls; jax.block_until_ready). speedup = tok/s spec / tok/s plain.

Predicted (each part timed ALONE, N iterations inside one jitted fori_loop with a
data dependency from one iteration to the next; bench/common.py):

    predicted = mean_accepted_length * t_target_step / t_round
    t_round   = t_draft_round + t_verify + t_sampler

    t_target_step  target call, T=1, B rows, cache of the plain loop's length
                   (P + max_new_tokens + 1), plus the token sampling of the plain
                   loop (argmax for greedy, sample_tokens for T=1)
    t_draft_round  model drafter: K * t_draft_step, where t_draft_step = one draft
                   call T=1 (cache of the speculative loop's length P + N + K + 1)
                   plus its sample_tokens (and exp(log_probs) for T=1);
                   lookup drafter: one PromptLookupDrafter.propose of K tokens
                   (it proposes all K at once, so its "draft step" is that / K)
    t_verify       target call with T=K+1 tokens, same cache; its logits are
                   consumed by one max-reduction (needed so XLA computes them)
    t_sampler      rejection_sample on f32 [B, K+1, V] logits (all_greedy=True for
                   greedy; T=1 with draft_probs [B, K, V] for the model drafter,
                   without for lookup), two logits buffers rotated
    mean_accepted_length = DecodeStats.mean_accepted_length of the measured run
                   = tokens per target pass, the prefill counted as a pass

`pred_trips` replaces the mean by the loop trip counts: a batch runs until its
slowest row ends, so plain generate makes max_b(lengths_b) target passes and
the speculative loop max_b(target_calls_b); pred_trips = (tokens spec / tokens
plain) * trips_plain * t_target_step / (trips_spec * t_round). At B=1 it equals
`pred`; at B=32 it shows what the slowest row costs.

Loop overhead: per (B, K, drafter) the script builds the speculative loop's
carry (token buffer, lengths, done flags, both KV caches, stats; for plain the
buffer and target cache) and runs a trivial body (one-element in-place update
of every carry array) in (a) a `lax.while_loop` whose condition is
`jnp.any(~done)`, like the decoding loops, (b) a `lax.fori_loop` with run-time
bounds (what the component timings above run in), (c) a `lax.fori_loop` with a
static trip count. Per-iteration = (t(2N) - t(N)) / N. `while_frac` = (a) /
t_round (plain: / t_target_step). Each component time above includes one (b).

`--draft-init target` gives the draft the target's embedding and first layers
instead (far higher acceptance: a second operating point for the same check).

Run:

    PYTHONPATH=. python3 bench/decode.py --quick                      # CPU, tiny models, < 2 min
    PYTHONPATH=. python3 bench/decode.py --out $OUT --batch-sizes 8   # GPU: one B per call
    PYTHONPATH=. python3 bench/decode.py --out $OUT                   # GPU, full grid (long)

--budget-s (default 450) stops starting configurations after that many seconds,
so a run under a command time limit still prints its tables and saves its JSON.

Writes OUT/decode.json (every number, device, versions, command line, errors)
and OUT/decode.png (speedup vs K per B: measured solid, predicted dashed).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
import warnings
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402
from specdec_jax import (
  PromptLookupDrafter,
  SamplingParams,
  generate,
  rejection_sample,
  sample_tokens,
  speculative_generate,
)
from specdec_jax.models import Transformer, TransformerConfig  # noqa: E402

MODES = ("greedy", "t1")  # T=0 with all_greedy=True; T=1 on every row
DRAFTERS = ("model", "lookup")
LOOKUP_NGRAMS = (3, 2)
SENTINEL = np.iinfo(np.int32).min  # a checksum value that (almost) never occurs

FULL = dict(
  batch_sizes=(1, 8, 32),
  ks=(2, 4, 8),
  max_new_tokens=128,
  prompt_len=64,
  vocab=49152,
  layers=30,
  draft_layers=2,
  d_model=576,
  heads=9,
  kv_heads=3,
  head_dim=64,
  d_ff=1536,
  rope_theta=1e5,
)
QUICK = dict(
  batch_sizes=(1, 2),
  ks=(2,),
  max_new_tokens=32,
  prompt_len=16,
  vocab=512,
  layers=2,
  draft_layers=1,
  d_model=64,
  heads=4,
  kv_heads=2,
  head_dim=16,
  d_ff=128,
  rope_theta=1e5,
)


# ----------------------------------------------------------------------------
# Setup shared with bench/smollm2.py
# ----------------------------------------------------------------------------


FAST_CPU_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def fast_cpu_compiles(argv=None) -> bool:
  """For --quick without a CUDA build of JAX: turn XLA's CPU backend optimisation down.

  On a small CPU a --quick run is dominated by compilation (dozens of programs),
  and LLVM's optimisation is most of it; this roughly halves the run. The
  timings then describe unoptimised CPU code: a smoke test, not a measurement.
  Must run before JAX creates its backends (the first array or device query).
  `--keep-xla-opt` or an XLA_FLAGS that already sets the option leaves it alone.
  Returns whether the flags were added.
  """
  import importlib.metadata

  argv = sys.argv[1:] if argv is None else argv
  if "--quick" not in argv or "--keep-xla-opt" in argv:
    return False
  if "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", ""):
    return False
  names = {(d.metadata["Name"] or "").lower().replace("_", "-") for d in importlib.metadata.distributions()}
  if any(n.startswith(("jax-cuda", "jax-rocm", "libtpu")) for n in names):
    return False
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FAST_CPU_XLA_FLAGS).strip()
  return True


def enable_compilation_cache(cache_dir: str | None) -> None:
  """JAX's persistent compilation cache in `cache_dir` (every program cached); '' turns it off."""
  if not cache_dir:
    return
  os.makedirs(cache_dir, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


class Budget:
  """Stops new work from starting once `seconds` have passed since creation (0 or None = no limit).

  A command limit kills a run without its final tables; with a budget the script
  skips the remaining configurations (recorded) and still prints and saves.
  """

  def __init__(self, seconds: float | None):
    self.t0, self.seconds, self.skipped = time.perf_counter(), seconds, []

  def elapsed(self) -> float:
    return time.perf_counter() - self.t0

  def over(self, what: str) -> bool:
    if self.seconds and self.elapsed() > self.seconds:
      self.skipped.append(what)
      tqdm.write(f"skip {what}: time budget of {self.seconds:.0f}s spent (--budget-s)")
      return True
    return False


def mode_setup(mode: str, b: int, seed: int = 0):
  """(params, key, all_greedy) for a batch of b rows in `mode` ('greedy' or 't1')."""
  if mode == "greedy":
    return SamplingParams.greedy(b), None, True
  if mode == "t1":
    return SamplingParams.create(jnp.ones((b,), jnp.float32)), jax.random.key(seed), False
  raise ValueError(f"unknown mode {mode!r}")


def loop_lengths(p: int, max_new_tokens: int, k: int | None) -> int:
  """Cache length the decoding loop allocates: P + N + 1 (generate) or P + N + K + 1."""
  return p + max_new_tokens + 1 + (k or 0)


def run_generation(fn: Callable, repeats: int) -> tuple[object, dict]:
  """Calls fn() once (compile + warm-up), then `repeats` timed calls; returns (output, timing)."""
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn())
  first = time.perf_counter() - t0
  times = common.time_call(fn, repeats=repeats)
  return out, {"first_call_s": first, "times_s": times, "median_s": statistics.median(times)}


def stats_summary(outs) -> dict:
  """Totals over one or more GenerateOutputs (host numpy): tokens, passes, trips, acceptance."""
  outs = outs if isinstance(outs, (list, tuple)) else [outs]
  lengths = [np.asarray(o.lengths) for o in outs]
  calls = [np.asarray(o.stats.target_calls) for o in outs]
  drafted = sum(int(np.asarray(o.stats.drafted).sum()) for o in outs)
  accepted = sum(int(np.asarray(o.stats.accepted).sum()) for o in outs)
  tokens = sum(int(x.sum()) for x in lengths)
  passes = sum(int(x.sum()) for x in calls)
  summary = {
    "tokens": tokens,
    "target_calls": passes,
    "drafted": drafted,
    "accepted": accepted,
    "acceptance": accepted / drafted if drafted else None,
    "mean_accepted_length": tokens / passes if passes else None,
    # Loop trips: a batch runs until its slowest row ends (summed over calls).
    "trips": sum(int(x.max()) for x in calls),
    "accepted_per_position": (
      np.sum([np.asarray(o.stats.accepted_per_position) for o in outs], axis=0).tolist() if drafted else []
    ),
    "reached_per_position": (
      np.sum([np.asarray(o.stats.reached_per_position) for o in outs], axis=0).tolist() if drafted else []
    ),
    "usable_drafted": sum(int(np.asarray(o.stats.usable_drafted).sum()) for o in outs),
  }
  reached = np.asarray(summary["reached_per_position"], float)
  summary["acceptance_per_position"] = (
    (np.asarray(summary["accepted_per_position"]) / np.maximum(reached, 1)).round(4).tolist() if drafted else []
  )
  return summary


def predict(row: dict, comp: dict, plain: dict | None) -> None:
  """Adds pred, pred_trips, meas/pred to a result row, from component times `comp`."""
  t_round = comp["t_round_s"]
  mal = row["mean_accepted_length"]
  row["pred"] = mal * comp["t_target_step_s"] / t_round if mal else None
  row["pred_trips"] = None
  if plain is not None and row["trips"]:
    row["pred_trips"] = (
      (row["tokens"] / plain["tokens"]) * plain["trips"] * comp["t_target_step_s"] / (row["trips"] * t_round)
    )
  row["meas_over_pred"] = row["speedup"] / row["pred"] if row.get("speedup") and row["pred"] else None
  # What one round cost inside the real loop: wall time / trips (the prefill included).
  row["round_s_measured"] = row["spec_s"] / row["trips"] if row["trips"] else None
  if plain is not None and plain["trips"]:
    row["plain_step_s_measured"] = plain["median_s"] / plain["trips"]


# ----------------------------------------------------------------------------
# Component timings: each part alone, N iterations in one jitted loop
# ----------------------------------------------------------------------------


def _model_step_fn(graphdef, t: int, p0: int, span: int, vocab: int, all_greedy: bool, with_probs: bool):
  """Loop body: one model call of T tokens at a position that moves with i, chained to the last output."""

  def step(i, carry, state, params, key0):
    cache, tokens = carry
    b = tokens.shape[0]
    model = nnx.merge(graphdef, state)
    pos = p0 + i % span + jnp.arange(t, dtype=jnp.int32)
    logits, cache = model(tokens, jnp.broadcast_to(pos, (b, t)).astype(jnp.int32), cache)
    if t == 1:  # a decode step: sample the next token from it (as the loops do)
      key = None if all_greedy else jax.random.fold_in(key0, i)
      nxt, log_probs = sample_tokens(logits[:, 0], params, key, all_greedy=all_greedy)
      if with_probs:  # the draft keeps exp(log_probs) [B, V] for the rejection sampler: compute all of it
        nxt = nxt + (jnp.sum(jnp.exp(log_probs), axis=-1) > 2.0)
      tokens = (nxt % vocab)[:, None].astype(jnp.int32)
    else:  # verification: consume every logit once (else XLA would skip the LM head)
      mx = jnp.max(logits, axis=(1, 2))
      tokens = ((tokens + (mx > 1e30)[:, None]) % vocab).astype(jnp.int32)
    return cache, tokens

  return step


def _sampler_step_fn(k: int, vocab: int, all_greedy: bool, with_probs: bool):
  """Loop body: one rejection_sample on buffer i mod 2, drafts and key chained to the last output."""

  def step(i, carry, logits_stack, dp_stack, draft0, params, key0):
    j = (i + (carry == SENTINEL).astype(jnp.int32)) % logits_stack.shape[0]
    logits = jax.lax.dynamic_index_in_dim(logits_stack, j, 0, keepdims=False)
    dp = jax.lax.dynamic_index_in_dim(dp_stack, j, 0, keepdims=False) if with_probs else None
    draft = (draft0 + carry) % vocab
    key = None if all_greedy else jax.random.fold_in(key0, carry)
    out = rejection_sample(
      draft_token_ids=draft, target_logits=logits, params=params, key=key, draft_probs=dp, all_greedy=all_greedy
    )
    return carry + jnp.sum(out.token_ids) + jnp.sum(out.num_accepted)

  return step


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _sampler_inputs(key, b, k, v, with_probs):
  k1, k2, k3 = jax.random.split(key, 3)
  logits = 2.0 * jax.random.normal(k1, (2, b, k + 1, v), jnp.float32)
  dp = jax.nn.softmax(2.0 * jax.random.normal(k2, (2, b, k, v), jnp.float32), axis=-1) if with_probs else None
  return logits, dp, jax.random.randint(k3, (b, k), 0, v, jnp.int32)


def _touch(x, c):
  """x with its first element nudged by c (0 or 1): an in-place one-element update."""
  idx = (0,) * x.ndim
  if x.dtype == jnp.bool_:
    return x.at[idx].set(x[idx] ^ (c > 0))
  return x.at[idx].set(x[idx] + c.astype(x.dtype))


def _first_elements(tree):
  return [x.reshape(-1)[0] for x in jax.tree_util.tree_leaves(tree)]


@functools.lru_cache(maxsize=None)
def _overhead_loops():
  """Three jitted loops with a trivial body over a carry (lengths [B], done [B], rest)."""

  def body(state, n):
    length, _, rest = state
    length = length + 1
    c = length[0] & 1
    return length, length >= n, jax.tree_util.tree_map(lambda x: _touch(x, c), rest)

  def init(rest):
    b = jax.tree_util.tree_leaves(rest)[0].shape[0]
    return jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool), rest

  @jax.jit
  def while_any(rest, n):
    s = jax.lax.while_loop(lambda s: jnp.any(~s[1]), lambda s: body(s, n), init(rest))
    return s[0], _first_elements(s[2])

  @jax.jit
  def fori_dynamic(rest, n):
    s = jax.lax.fori_loop(0, n, lambda i, s: body(s, n), init(rest))
    return s[0], _first_elements(s[2])

  @functools.partial(jax.jit, static_argnums=1)
  def fori_static(rest, n):
    s = jax.lax.fori_loop(0, n, lambda i, s: body(s, n), init(rest))
    return s[0], _first_elements(s[2])

  return {"while_any": while_any, "fori_dynamic": fori_dynamic, "fori_static": fori_static}


def loop_overhead(rest, *, target_s: float = 0.05, repeats: int = 5) -> dict:
  """Seconds per iteration of a trivial-body loop over `rest` (a pytree with leading dim B).

  Each kind is timed with N and 2N iterations (fixed costs such as copying the
  carry in cancel): per_iter = (median t(2N) - median t(N)) / N.
  """
  out, n = {}, None
  for name, fn in _overhead_loops().items():
    run = lambda n: jax.block_until_ready(fn(rest, n))  # noqa: E731
    t0 = time.perf_counter()
    if n is None:  # pick N once, from the while loop (the other kinds reuse it: fori_static compiles per N)
      run(64)
      est = max(min(common.time_call(run, 64, repeats=2)) / 64, 1e-7)
      n = int(min(max(64, target_s / est), 200_000))
    run(n), run(2 * n)  # compile (static trip counts) and warm up
    compile_s = time.perf_counter() - t0
    t_n = statistics.median(common.time_call(run, n, repeats=repeats))
    t_2n = statistics.median(common.time_call(run, 2 * n, repeats=repeats))
    per = (t_2n - t_n) / n
    out[name] = {"per_iter_s": per if per > 0 else t_n / n, "iters": n, "scale": t_2n / t_n, "warmup_s": compile_s}
  return out


class ComponentTimer:
  """Times the parts of a decoding round alone; each result is memoised by its key.

  Args:
    target: the target model (an NNX module following the model protocol).
    draft: the draft model, or None (only the lookup drafter then).
    target_s / repeats: how long one timed loop should take, and how many loops (median).
  """

  def __init__(self, target, draft, *, target_s: float = 0.05, repeats: int = 5, seed: int = 0):
    self.target, self.draft = target, draft
    self.vocab = target.config.vocab_size
    self.target_s, self.repeats, self.seed = target_s, repeats, seed
    self.memo: dict = {}
    self.records: dict = {}  # key string -> full timing record (for the JSON)

  def _memo(self, key, fn):
    if key not in self.memo:
      r = fn()
      self.memo[key] = r
      self.records["/".join(map(str, key))] = r
    return self.memo[key]

  def _time_loop(self, step, carry, operands) -> dict:
    r = common.time_per_iter(common.timed_loop(step), carry, operands, target_s=self.target_s, repeats=self.repeats)
    r.pop("compiled", None)
    if r["scale"] < 1.5:
      warnings.warn(f"t(2N)/t(N) = {r['scale']:.2f}: the timed work may not run every iteration")
    return r

  def model_step(self, which: str, b: int, t: int, cache_len: int, p0: int, mode: str) -> dict:
    """One call of the target/draft with T tokens at B rows on a cache of cache_len slots."""
    model = self.target if which == "target" else self.draft
    all_greedy = mode == "greedy"
    with_probs = which == "draft" and not all_greedy

    def run():
      graphdef, state = nnx.split(model)
      params, key, _ = mode_setup(mode, b, self.seed)
      key = jax.random.key(self.seed) if key is None else key
      span = max(cache_len - p0 - t, 1)
      step = _model_step_fn(graphdef, t, p0, span, self.vocab, all_greedy, with_probs)
      tokens = jnp.full((b, t), 7, jnp.int32)
      carry = (model.init_cache(b, cache_len), tokens)
      return self._time_loop(step, carry, (state, params, key))

    return self._memo((which, b, t, cache_len, mode if t == 1 else "-"), run)

  def sampler(self, b: int, k: int, mode: str, with_probs: bool) -> dict:
    all_greedy = mode == "greedy"
    with_probs = with_probs and not all_greedy  # greedy rejection ignores draft probabilities

    def run():
      params, key, _ = mode_setup(mode, b, self.seed)
      key = jax.random.key(self.seed) if key is None else key
      logits, dp, draft0 = jax.block_until_ready(_sampler_inputs(jax.random.key(1), b, k, self.vocab, with_probs))
      step = _sampler_step_fn(k, self.vocab, all_greedy, with_probs)
      r = self._time_loop(step, jnp.int32(0), (logits, dp, draft0, params, key))
      del logits, dp
      return r

    return self._memo(("sampler", b, k, mode, with_probs), run)

  def propose(self, drafter: PromptLookupDrafter, buf: jax.Array, length0: int, k: int) -> dict:
    """PromptLookupDrafter.propose of K tokens over a [B, S] buffer; lengths move with i."""
    b, s = buf.shape
    span = max(s - length0 - k - 1, 1)

    def step(i, carry, buf):
      lengths = jnp.full((b,), length0, jnp.int32) + (i + carry) % span
      return carry + jnp.sum(drafter.propose(buf, lengths, k)) % 3

    return self._memo(("propose", drafter.ngram_size, b, s, k), lambda: self._time_loop(step, jnp.int32(0), (buf,)))

  def overhead(self, b: int, cache_len: int, k: int | None, drafter: str | None) -> dict:
    """Per-iteration cost of the three loop kinds over the decoding loop's carry."""

    def run():
      rest = {"buf": jnp.zeros((b, cache_len), jnp.int32), "t_cache": self.target.init_cache(b, cache_len)}
      if k is not None:
        if drafter == "model":
          rest["d_cache"] = self.draft.init_cache(b, cache_len)
        rest["stats"] = [jnp.zeros((b,), jnp.int32) for _ in range(3)]
      r = loop_overhead(rest, target_s=self.target_s, repeats=self.repeats)
      del rest
      return r

    return self._memo(("loops", b, cache_len, k, drafter), run)

  def round(self, *, b: int, k: int, mode: str, drafter, p: int, max_new_tokens: int, buf=None) -> dict:
    """All parts of one speculative round and the plain step; returns seconds and their sum.

    drafter: "model" or a PromptLookupDrafter. `buf` [B, S] is the lookup's token
    buffer (S = the speculative loop's cache length).
    """
    s_plain = loop_lengths(p, max_new_tokens, None)
    s_spec = loop_lengths(p, max_new_tokens, k)
    p0 = p  # decode positions start after the prompt
    t_target = self.model_step("target", b, 1, s_plain, p0, mode)["per_iter_s"]
    t_verify = self.model_step("target", b, k + 1, s_spec, p0, mode)["per_iter_s"]
    is_model = drafter == "model"
    if is_model:
      t_draft_step = self.model_step("draft", b, 1, s_spec, p0, mode)["per_iter_s"]
      t_draft_round = k * t_draft_step
    else:
      t_draft_round = self.propose(drafter, buf, p, k)["per_iter_s"]
      t_draft_step = t_draft_round / k
    t_sampler = self.sampler(b, k, mode, with_probs=is_model)["per_iter_s"]
    t_round = t_draft_round + t_verify + t_sampler
    loops = self.overhead(b, s_spec, k, "model" if is_model else "lookup")
    plain_loops = self.overhead(b, s_plain, None, None)
    return {
      "t_target_step_s": t_target,
      "t_draft_step_s": t_draft_step,
      "t_draft_round_s": t_draft_round,
      "t_verify_s": t_verify,
      "t_sampler_s": t_sampler,
      "t_round_s": t_round,
      "while_iter_s": loops["while_any"]["per_iter_s"],
      "fori_dynamic_iter_s": loops["fori_dynamic"]["per_iter_s"],
      "fori_static_iter_s": loops["fori_static"]["per_iter_s"],
      "while_frac_of_round": loops["while_any"]["per_iter_s"] / t_round,
      "plain_while_iter_s": plain_loops["while_any"]["per_iter_s"],
      "plain_while_frac_of_step": plain_loops["while_any"]["per_iter_s"] / t_target,
      "cache_len_plain": s_plain,
      "cache_len_spec": s_spec,
    }


# ----------------------------------------------------------------------------
# Tables and plots shared with bench/smollm2.py
# ----------------------------------------------------------------------------


def _fmt(x, spec):
  if x is None or (isinstance(x, float) and not math.isfinite(x)):
    return "-"
  return format(x, spec)


def print_table(rows, columns, title=None):
  """columns: (header, key or callable, width, format spec)."""
  if title:
    print(f"\n{title}")
  head = "".join(f"{h:>{w}}" for h, _, w, _ in columns)
  print(head)
  print("-" * len(head))
  for r in rows:
    cells = []
    for _, key, w, spec in columns:
      v = key(r) if callable(key) else r.get(key)
      cells.append(f"{_fmt(v, spec) if not isinstance(v, str) else v:>{w}}")
    print("".join(cells))


US = lambda k: lambda r: r[k] * 1e6 if r.get(k) is not None else None  # noqa: E731

COMPONENT_COLUMNS = [
  ("B", "B", 4, "d"),
  ("K", "K", 3, "d"),
  ("mode", "mode", 7, "s"),
  ("drafter", "drafter", 8, "s"),
  ("target us", US("t_target_step_s"), 11, ".1f"),
  ("draft rnd us", US("t_draft_round_s"), 13, ".1f"),
  ("verify us", US("t_verify_s"), 11, ".1f"),
  ("sampler us", US("t_sampler_s"), 11, ".1f"),
  ("round us", US("t_round_s"), 10, ".1f"),
  ("meas rnd us", US("round_s_measured"), 12, ".1f"),
  ("while us", US("while_iter_s"), 10, ".2f"),
  ("fori us", US("fori_static_iter_s"), 9, ".2f"),
  ("while/rnd", "while_frac_of_round", 10, ".3f"),
  ("while/step", "plain_while_frac_of_step", 11, ".3f"),
]

RESULT_COLUMNS = [
  ("B", "B", 4, "d"),
  ("K", "K", 3, "d"),
  ("mode", "mode", 7, "s"),
  ("drafter", "drafter", 8, "s"),
  ("plain tok/s", "plain_tok_s", 12, ".0f"),
  ("spec tok/s", "spec_tok_s", 11, ".0f"),
  ("speedup", "speedup", 8, ".2f"),
  ("pred", "pred", 6, ".2f"),
  ("meas/pred", "meas_over_pred", 10, ".2f"),
  ("pred_trips", "pred_trips", 11, ".2f"),
  ("accept", "acceptance", 7, ".2f"),
  ("mean_len", "mean_accepted_length", 9, ".2f"),
]


def plot_speedup(rows, path, title):
  """Speedup vs K, one panel per (mode, drafter), one colour per B: measured solid, predicted dashed."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    warnings.warn("matplotlib is not installed: no plot written")
    return None
  rows = [r for r in rows if r.get("speedup") is not None]
  if not rows:
    return None
  drafters = sorted({r["drafter"] for r in rows})
  panels = [(m, d) for m in MODES for d in drafters if any(r["mode"] == m and r["drafter"] == d for r in rows)]
  fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False, sharey=True)
  bs = sorted({r["B"] for r in rows})
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for ax, (m, d) in zip(axes[0], panels):
    for ci, b in enumerate(bs):
      sel = sorted((r for r in rows if r["mode"] == m and r["drafter"] == d and r["B"] == b), key=lambda r: r["K"])
      if not sel:
        continue
      ks = [r["K"] for r in sel]
      c = colors[ci % len(colors)]
      ax.plot(ks, [r["speedup"] for r in sel], "o-", color=c, label=f"B={b} measured")
      ax.plot(
        ks,
        [r.get("pred") if r.get("pred") is not None else np.nan for r in sel],
        "s--",
        color=c,
        alpha=0.7,
        label=f"B={b} predicted",
      )
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_title(f"{'greedy' if m == 'greedy' else 'T=1'}, {d} drafter", fontsize=9)
    ax.set_xlabel("K (draft tokens per round)")
    ax.set_xticks(sorted({r["K"] for r in rows}))
  axes[0][0].set_ylabel("speedup (tok/s spec / tok/s plain)")
  axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


# ----------------------------------------------------------------------------
# This benchmark: random-weight models
# ----------------------------------------------------------------------------


def model_configs(args) -> tuple[TransformerConfig, TransformerConfig]:
  target = TransformerConfig(
    vocab_size=args.vocab,
    num_layers=args.layers,
    d_model=args.d_model,
    num_heads=args.heads,
    num_kv_heads=args.kv_heads,
    head_dim=args.head_dim,
    d_ff=args.d_ff,
    rope_theta=args.rope_theta,
    dtype=args.dtype,
  )
  return target, target.replace(num_layers=args.draft_layers)


def make_draft(args, target: Transformer, d_cfg: TransformerConfig) -> Transformer:
  """The 2-layer draft: random weights of its own (`--draft-init random`), or the target's
  embedding, first layers and final norm (`--draft-init target`: agrees with the target far more often)."""
  if args.draft_init == "random":
    return Transformer(d_cfg, rngs=nnx.Rngs(args.seed + 1))
  weights = target.to_weights()
  weights = {name: (w[: d_cfg.num_layers] if name.startswith("layers.") else w) for name, w in weights.items()}
  return Transformer.from_weights(d_cfg, weights)


def make_prompts(b: int, p: int, vocab: int, seed: int) -> np.ndarray:
  """[B, P] int32: a random 16-token segment per row, repeated, one token changed in each copy."""
  rng = np.random.default_rng(seed + 1000 * b)
  seg_len = min(16, p)
  out = np.zeros((b, p), np.int32)
  for r in range(b):
    seg = rng.integers(0, vocab, seg_len)
    row = np.resize(seg, p).copy()
    for start in range(seg_len, p, seg_len):  # a small edit per copy
      row[start + int(rng.integers(0, min(seg_len, p - start)))] = rng.integers(0, vocab)
    out[r] = row
  return out


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  ints = lambda s: tuple(int(x) for x in s.split(",") if x)  # noqa: E731
  strs = lambda s: tuple(x for x in s.split(",") if x)  # noqa: E731
  p.add_argument(
    "--quick",
    action="store_true",
    help="tiny models and grid for a CPU (V=512, L=2, D=64; B 1,2; K 2; 32 tokens); the default without a GPU",
  )
  p.add_argument("--batch-sizes", type=ints, help="comma list (default 1,8,32; quick 1,2)")
  p.add_argument("--ks", type=ints, help="comma list of K (default 2,4,8; quick 2)")
  p.add_argument("--modes", type=strs, default=MODES, help="comma list of: greedy, t1 (default both)")
  p.add_argument("--drafters", type=strs, default=DRAFTERS, help="comma list of: model, lookup (default both)")
  p.add_argument("--max-new-tokens", type=int, help="tokens per row (default 128; quick 32)")
  p.add_argument("--prompt-len", type=int, help="P (default 64; quick 16)")
  for name, help_ in (
    ("vocab", "V"),
    ("layers", "target L"),
    ("draft-layers", "draft L"),
    ("d-model", "D"),
    ("heads", "H"),
    ("kv-heads", "Hkv"),
    ("head-dim", "Dh"),
    ("d-ff", "F"),
  ):
    p.add_argument(
      f"--{name}",
      type=int,
      help=f"{help_} (default {FULL[name.replace('-', '_')]}; quick {QUICK[name.replace('-', '_')]})",
    )
  p.add_argument("--rope-theta", type=float, help="default 1e5")
  p.add_argument(
    "--draft-init",
    choices=("random", "target"),
    default="random",
    help="draft weights: its own random ones (default; acceptance near 0), or the target's "
    "embedding and first layers (high acceptance: a second operating point)",
  )
  p.add_argument("--dtype", choices=("bfloat16", "float32"), help="default bfloat16 on GPU, float32 on CPU")
  p.add_argument("--repeats", type=int, default=3, help="timed generation calls per config (median; default 3)")
  p.add_argument("--target-ms", type=float, help="length of one component timing loop (default 50; quick 20)")
  p.add_argument("--component-repeats", type=int, help="component timing loops (median; default 5; quick 3)")
  p.add_argument("--no-components", action="store_true", help="skip the component timings (no prediction)")
  p.add_argument(
    "--budget-s",
    type=float,
    default=450.0,
    help="start no new configuration after this many seconds (default 450; 0 = no limit)",
  )
  p.add_argument("--seed", type=int, default=0)
  p.add_argument(
    "--keep-xla-opt",
    action="store_true",
    help="with --quick on a CPU-only JAX: keep XLA's full CPU optimisation (slower compiles)",
  )
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
  base = QUICK if args.quick else FULL
  for name, value in base.items():
    attr = "ks" if name == "ks" else name
    if getattr(args, attr, None) is None:
      setattr(args, attr, value)
  args.dtype = args.dtype or ("bfloat16" if common.has_gpu() else "float32")
  args.target_ms = args.target_ms or (20.0 if args.quick else 50.0)
  args.component_repeats = args.component_repeats or (3 if args.quick else 5)
  return args


def main(argv=None):
  fast = fast_cpu_compiles(argv)  # before anything touches a device
  args = parse_args(argv)
  budget = Budget(args.budget_s)
  enable_compilation_cache(args.cache_dir)
  os.makedirs(args.out, exist_ok=True)
  info = common.device_info()
  info["xla_flags"] = os.environ.get("XLA_FLAGS", "")
  if fast:
    print(f"--quick on CPU: XLA_FLAGS += {FAST_CPU_XLA_FLAGS} (compile-bound smoke run; --keep-xla-opt to keep it)")
  print(f"{info['device']} ({info['platform']}), jax {info['jax']}, python {info['python']}")

  t_cfg, d_cfg = model_configs(args)
  t0 = time.perf_counter()
  target = Transformer(t_cfg, rngs=nnx.Rngs(args.seed))
  draft = make_draft(args, target, d_cfg) if "model" in args.drafters else None
  print(
    f"target {t_cfg}\ndraft L={d_cfg.num_layers} (--draft-init {args.draft_init}); "
    f"built in {time.perf_counter() - t0:.1f}s"
  )
  lookup = PromptLookupDrafter(LOOKUP_NGRAMS)
  timer = ComponentTimer(target, draft, target_s=args.target_ms / 1e3, repeats=args.component_repeats, seed=args.seed)

  report = {
    "info": info,
    "config": {k: v for k, v in vars(args).items()},
    "target_config": str(t_cfg),
    "draft_config": str(d_cfg),
    "plain": [],
    "results": [],
    "errors": [],
  }
  json_path = os.path.join(args.out, "decode.json")

  def save():
    report["components"] = timer.records
    report["skipped_for_time_budget"] = budget.skipped
    report["elapsed_s"] = budget.elapsed()
    with open(json_path, "w") as f:
      json.dump(report, f, indent=1, default=str)

  n_spec = len(args.ks) * len(args.drafters)
  bar = tqdm(
    total=len(args.batch_sizes) * len(args.modes) * (1 + n_spec),
    desc="decode",
    unit="run",
    file=sys.stdout,
    mininterval=2.0,
    disable=None,
  )

  def error(what, e):
    msg = f"{what}: {type(e).__name__}: {str(e)[:400]}"
    tqdm.write("ERROR " + msg)
    report["errors"].append({"what": what, "error": msg, "traceback": traceback.format_exc()[-3000:]})

  n = args.max_new_tokens
  for b in args.batch_sizes:
    prompts = jnp.asarray(make_prompts(b, args.prompt_len, args.vocab, args.seed))
    lengths = jnp.full((b,), args.prompt_len, jnp.int32)
    for mode in args.modes:
      params, key, all_greedy = mode_setup(mode, b, args.seed)
      common_kw = dict(max_new_tokens=n, eos_token_id=None, all_greedy=all_greedy)
      bar.set_postfix_str(f"B={b} {mode} plain")
      plain, plain_tokens = None, None
      if budget.over(f"B={b} {mode}"):
        bar.update(1 + n_spec)
        continue
      try:
        out, timing = run_generation(lambda: generate(target, prompts, lengths, params, key, **common_kw), args.repeats)
        plain = {"B": b, "mode": mode, **stats_summary(out), **timing}
        plain["tok_s"] = plain["tokens"] / plain["median_s"]
        report["plain"].append(plain)
        tqdm.write(
          f"B={b:<3} {mode:<6} plain            {plain['tok_s']:10.0f} tok/s  "
          f"(first call {timing['first_call_s']:.1f}s)"
        )
        plain_tokens = np.asarray(out.tokens)
      except Exception as e:  # noqa: BLE001 - record and continue
        error(f"plain B={b} {mode}", e)
        plain_tokens = None
      bar.update(1)
      for k in args.ks:
        for dname in args.drafters:
          bar.set_postfix_str(f"B={b} {mode} K={k} {dname}")
          drafter = draft if dname == "model" else lookup
          what = f"B={b} K={k} {mode} {dname}"
          if budget.over(what):
            bar.update(1)
            continue
          try:
            out, timing = run_generation(
              lambda: speculative_generate(
                target, drafter, prompts, lengths, params, key, num_speculative_tokens=k, **common_kw
              ),
              args.repeats,
            )
            row = {
              "B": b,
              "K": k,
              "mode": mode,
              "drafter": dname,
              **stats_summary(out),
              "spec_s": timing["median_s"],
              "spec_times_s": timing["times_s"],
              "spec_first_call_s": timing["first_call_s"],
            }
            row["spec_tok_s"] = row["tokens"] / row["spec_s"]
            row["plain_tok_s"] = plain["tok_s"] if plain else None
            row["speedup"] = row["spec_tok_s"] / plain["tok_s"] if plain else None
            if mode == "greedy" and plain_tokens is not None:
              row["tokens_differ_from_plain"] = int(np.sum(np.asarray(out.tokens) != plain_tokens))
            spec_buf = None
            if dname == "lookup":  # the lookup's buffer: prompt, then generated tokens
              s = loop_lengths(args.prompt_len, n, k)
              spec_buf = jnp.zeros((b, s), jnp.int32).at[:, : args.prompt_len].set(prompts)
              spec_buf = spec_buf.at[:, args.prompt_len : args.prompt_len + n].set(jnp.maximum(out.tokens, 0))
          except Exception as e:  # noqa: BLE001
            error(what, e)
            bar.update(1)
            continue
          if not args.no_components:
            try:
              comp = timer.round(
                b=b,
                k=k,
                mode=mode,
                drafter="model" if dname == "model" else lookup,
                p=args.prompt_len,
                max_new_tokens=n,
                buf=spec_buf,
              )
              row.update(comp)
              predict(row, comp, plain)
            except Exception as e:  # noqa: BLE001
              error(what + " components", e)
          report["results"].append(row)
          tqdm.write(
            f"B={b:<3} {mode:<6} K={k} {dname:<7} {row['spec_tok_s']:10.0f} tok/s  "
            f"x{_fmt(row['speedup'], '.2f')} (pred {_fmt(row.get('pred'), '.2f')})  "
            f"accept {_fmt(row['acceptance'], '.2f')}  mean_len {_fmt(row['mean_accepted_length'], '.2f')}"
            f"  (first call {timing['first_call_s']:.1f}s)"
          )
          bar.update(1)
          save()
          gc.collect()
    save()
  bar.close()
  save()

  png = plot_speedup(
    report["results"],
    os.path.join(args.out, "decode.png"),
    f"random-weight target L={t_cfg.num_layers} D={t_cfg.d_model} V={t_cfg.vocab_size} "
    f"{args.dtype}, draft L={d_cfg.num_layers}, {n} new tokens, {info['device']}",
  )
  print(f"\nwrote {json_path}" + (f" and {png}" if png else ""))
  if report["errors"]:
    print(f"{len(report['errors'])} error(s): " + "; ".join(e["error"][:120] for e in report["errors"]))
  if budget.skipped:
    print(f"skipped for the time budget ({args.budget_s:.0f}s): {', '.join(budget.skipped)}")
  print(f"total {budget.elapsed():.0f}s")
  rows = report["results"]
  if not args.no_components:
    print_table(
      rows,
      COMPONENT_COLUMNS,
      "Components, each timed alone (us; round = draft round + verify + sampler; meas rnd = spec wall / "
      "trips; while/fori = us per iteration of a trivial loop over the same carry)",
    )
  print_table(
    rows,
    RESULT_COLUMNS,
    f"tokens/s, {args.dtype}, P={args.prompt_len}, {n} new tokens per row "
    "(pred = mean_len * t_target / t_round; pred_trips uses the slowest row's trips)",
  )


if __name__ == "__main__":
  main()
