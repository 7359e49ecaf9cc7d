"""Checks the sampler's Pallas program on a GPU, where the tests cannot: the compiled kernels against Pallas's
interpreter, the in-kernel top-k/top-p search against the XLA search, and chi-square runs through
`rejection_sample(kernels="pallas")` and `sample_tokens(kernels="pallas")`.

The tests run the same kernel code in the interpreter on a CPU, and lower it to
Triton for a CUDA target; only a GPU compiles and runs it. Run this first on a
GPU after changing `specdec_jax/verify/fused.py`, `specdec_jax/sampling/fused_sample.py` or
`specdec_jax/sampling/block_stats.py`:

    PYTHONPATH=. python3 bench/sampler_gpu_check.py --out $OUT
    PYTHONPATH=. python3 bench/sampler_gpu_check.py --quick        # CPU: small shapes, the same checks

Checks (each a line in OUT/sampler_gpu_check.json; the script exits 1 if one fails):
  compiled_vs_interpreter  the same tokens, row for row, for token and block verification, with and
                           without draft probabilities and filters (same keys, same inputs)
  kept_sets                `block_thresholds` keeps the tokens `thresholds.threshold_and_lse` keeps
                           (top-k 50 and top-p 0.9; top-p alone; a flat row whose top-p set the candidates
                           cannot settle; top-k 1000), every row, up to tokens within rounding of a threshold
  greedy_vs_xla            all_greedy=True on the Pallas program gives the XLA program's tokens, row for row
  chisquare                the lossless cases of tests/verify/test_chain.py (alpha 1e-3 per position)
  sample_tokens            `sample_tokens(kernels="pallas")` compiled against the interpreter (tokens row for
                           row, log-probabilities within 1e-5), and its groups of tests/sampling/test_sample.py
                           by chi-square (alpha 1e-3)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from specdec_jax import SamplingParams, rejection_sample
from specdec_jax.sampling.block_stats import block_partials, block_thresholds, scaled
from specdec_jax.sampling.fused_sample import fused_sample_tokens
from specdec_jax.sampling.params import row_keys
from specdec_jax.sampling.sample import sample_tokens
from specdec_jax.sampling.thresholds import threshold_and_lse
from specdec_jax.verify.fused import fused_chain

K = 4
# Off a GPU (--quick) the "compiled" side is the interpreter too: the script then checks only itself.
ON_GPU = jax.default_backend() == "gpu"


def compiled_vs_interpreter(v: int, b: int, seeds: int, greedy_rows=("per_row",)):
  """{label: "equal/rows"} over token/block x draft probabilities x filters (x greedy_rows: "none" is
  all_random=True, where the rows at temperature 0 sample too)."""
  rng = np.random.default_rng(2)
  logits = jnp.asarray(rng.normal(size=(b, K + 1, v)) * 3, jnp.float32)
  q = jax.nn.softmax(jnp.asarray(rng.normal(size=(b, K, v)) * 3, jnp.float32), -1)
  p = jax.nn.softmax(logits[:, :K], -1)
  draft = jnp.argmax(jnp.log(p) + jnp.asarray(rng.gumbel(size=p.shape)), -1).astype(jnp.int32)  # drafts from p
  n = jnp.asarray(rng.integers(0, K + 1, b), jnp.int32)
  t = np.where(np.arange(b) % 3 == 0, 0.0, 1.0).astype(np.float32)  # a third of the rows greedy
  out = {}
  for method, rows_kind in ((m, g) for m in ("token", "block") for g in greedy_rows):
    for with_q in (False, True):
      for top_k, top_p in ((0, 1.0), (50, 0.9), (0, 0.8)):
        params = SamplingParams.create(t, top_k=top_k, top_p=top_p)
        equal = 0
        for seed in range(seeds):
          keys = row_keys(jax.random.key(seed), b)
          run = lambda interpret: fused_chain(
            draft,
            logits,
            params,
            keys,
            q if with_q else None,
            n,
            greedy_rows=rows_kind,
            no_filters=False,
            method=method,
            interpret=interpret,
          )[0]
          equal += int(np.sum(np.all(np.asarray(run(not ON_GPU)) == np.asarray(run(True)), -1)))
        label = f"{method} draft_probs={with_q} top_k={top_k} top_p={top_p} B={b} V={v}"
        label += " all_random" if rows_kind == "none" else ""
        out[label] = (equal, seeds * b)
        print("compiled_vs_interpreter", label, f"{equal}/{seeds * b}", flush=True)
  return out


def kept_sets(v: int, b: int):
  """{label: (rows whose kept set equals the XLA search's, rows)}."""
  out = {}
  for scale, top_k, top_p, label in (
    (3.0, 50, 0.9, "top_k 50, top_p 0.9"),
    (3.0, 0, 0.9, "top_p 0.9"),
    (0.05, 0, 0.95, "flat row, top_p 0.95 (the whole-row search)"),
    (3.0, 1000, 1.0, "top_k 1000 (the whole-row search)"),
  ):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(b * (K + 1), v)) * scale, jnp.float32)
    t = jnp.asarray(np.linspace(0.5, 1.5, b), jnp.float32)
    k, p = jnp.full((b,), top_k, jnp.int32), jnp.full((b,), top_p, jnp.float32)
    m, mass, _, cand = block_partials(x, t, None, (k, p), positions=K + 1, candidates=8, interpret=not ON_GPU)
    thresholds, _, _ = block_thresholds(x, t, k, p, m, mass, cand, positions=K + 1, interpret=not ON_GPU)
    rows = np.repeat(np.arange(b), K + 1)
    ref_thr, _ = threshold_and_lse(x, t[rows], k[rows], p[rows])
    s = scaled(x, t[rows][:, None], thresholds[:, :1])
    kept = s >= thresholds[:, 1:]
    ref = x / t[rows][:, None] >= ref_thr[:, None]
    # A token whose scaled value is within rounding of either threshold may fall on either side: the kernels
    # divide in their own arithmetic (consistently among themselves), not XLA's.
    near = lambda a, thr: jnp.abs(a - thr) <= 1e-5 * jnp.maximum(1.0, jnp.abs(thr))
    tie = near(s, thresholds[:, 1:]) | near(x / t[rows][:, None], ref_thr[:, None])
    equal = int(jnp.sum(jnp.all((kept == ref) | tie, -1)))
    out[f"{label}, V={v}"] = (equal, b * (K + 1))
    print("kept_sets", label, f"{equal}/{b * (K + 1)}", flush=True)
  return out


def greedy_vs_xla(v: int, b: int):
  """{label: (rows whose tokens equal the XLA greedy program's, rows)}: `fused_greedy` compiled, with NaN logits,
  a position with nothing above -inf, ragged draft counts and rows that accept every draft (bonus rows read)."""
  rng = np.random.default_rng(4)
  x = rng.normal(size=(b, K + 1, v)).astype(np.float32)
  x[0, 1, 5] = np.nan
  x[1, 2] = -np.inf
  x = jnp.asarray(x)
  best = np.asarray(jnp.argmax(jnp.where(jnp.isnan(x), -jnp.inf, x), -1))[:, :K]
  draft = np.where((np.arange(b) % 2 == 0)[:, None], best, rng.integers(0, v, (b, K))).astype(np.int32)
  n = jnp.asarray(rng.integers(0, K + 1, b), jnp.int32)
  params = SamplingParams.create(jnp.zeros((b,), jnp.float32))
  # Under jit: an eager call rejects NaN logits, a jitted one counts them as -inf.
  sample = lambda kernels, d, x, n: (
    rejection_sample(d, x, params, jax.random.key(0), num_draft_tokens=n, all_greedy=True, kernels=kernels).token_ids
  )
  run = lambda kernels: jax.jit(functools.partial(sample, kernels))(jnp.asarray(draft), x, n)
  equal = int(np.sum(np.all(np.asarray(run("xla")) == np.asarray(run("pallas" if ON_GPU else "xla")), -1)))
  print("greedy_vs_xla", f"B={b} V={v}", f"{equal}/{b}", flush=True)
  return {f"B={b} V={v}": (equal, b)}


def chisquare(rows: int):
  """{case: (smallest p-value, positions tested)} through rejection_sample(kernels="pallas")."""
  import tests.verify.test_chain as tc

  run = tc._run
  tc._run = lambda *a, **kw: run(*a, kernels="pallas", **kw)
  out = {}
  try:
    for name in ("temperature_top_k_top_p_ties", "draft_probs", "ngram_no_draft_probs", "ragged_rows_mixed_batch"):
      results = tc._check_case(tc.CASES[name], *tc._run_case(name, rows, seed=3))
      out[name] = (min(r.pvalue for r in results), len(results))
      print("chisquare", name, out[name], flush=True)
  finally:
    tc._run = run
  return out


def sample_tokens_checks(v: int, b: int, rows: int):
  """{label: (passed, of)}: compiled against interpreted `fused_sample_tokens` (greedy, filtering, NaN and empty
  rows), and the chi-square groups of tests/sampling/test_sample.py through `sample_tokens(kernels="pallas")`."""
  import tests.sampling.test_sample as ts

  rng = np.random.default_rng(6)
  x = rng.normal(size=(b, v)).astype(np.float32) * 3
  x[0, 7] = np.nan
  x[1] = -np.inf
  x = jnp.asarray(x)
  t = np.where(np.arange(b) % 3 == 0, 0.0, np.linspace(0.5, 1.5, b)).astype(np.float32)
  out = {}
  for top_k, top_p in ((0, 1.0), (50, 0.9), (0, 0.8)):
    params = SamplingParams.create(t, top_k=top_k, top_p=top_p)
    run = lambda interpret: fused_sample_tokens(x, params, jax.random.key(0), no_filters=False, interpret=interpret)
    (tok_c, lp_c), (tok_i, lp_i) = run(not ON_GPU), run(True)
    same = np.all(np.isclose(np.asarray(lp_c), np.asarray(lp_i), atol=1e-5), -1)  # (-inf equals -inf)
    equal = int(np.sum((np.asarray(tok_c) == np.asarray(tok_i)) & same))
    label = f"compiled vs interpreter top_k={top_k} top_p={top_p} B={b} V={v}"
    out[label] = (equal, b)
    print("sample_tokens", label, f"{equal}/{b}", flush=True)
  sample = ts.sample_tokens_jit
  ts.sample_tokens_jit = jax.jit(functools.partial(sample_tokens, kernels="pallas"), static_argnames=("all_greedy",))
  try:
    results = ts._check_sample_groups(rows, seed=4)
    passed = sum(r.pvalue >= 1e-3 for r in results)
  except AssertionError as e:
    print("sample_tokens chisquare failed:", e, flush=True)
    passed, results = 0, [None] * 3
  finally:
    ts.sample_tokens_jit = sample
  out[f"chisquare groups, {rows} rows each"] = (passed, len(results))
  print("sample_tokens chisquare", f"{passed}/{len(results)}", flush=True)
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="small shapes (CPU)")
  p.add_argument("--out", default="bench/out", help="folder for sampler_gpu_check.json")
  args = p.parse_args(argv)
  quick = args.quick or not ON_GPU
  t0 = time.time()
  shapes = ((300, 4),) if quick else ((151936, 8), (49152, 8))
  report = {"info": {**common.device_info(), "command": " ".join(sys.argv)}}
  report["compiled_vs_interpreter"] = {}
  report["kept_sets"] = {}
  report["greedy_vs_xla"] = {}
  for v, b in shapes:
    report["greedy_vs_xla"].update(greedy_vs_xla(v, b))
    report["compiled_vs_interpreter"].update(compiled_vs_interpreter(v, b, seeds=1 if quick else 3))
    report["kept_sets"].update(kept_sets(v, b))
  # B=1: few (row, block) programs (block verification's residual then takes one position per program);
  # all_random too
  report["compiled_vs_interpreter"].update(
    compiled_vs_interpreter(shapes[0][0], 1, seeds=2 if quick else 12, greedy_rows=("per_row", "none"))
  )
  report["chisquare"] = chisquare(1500 if quick else 200_000)
  report["sample_tokens"] = {}
  for v, b in shapes:
    report["sample_tokens"].update(sample_tokens_checks(v, b * 4, rows=3000 if quick else 200_000))
  failed = [f"compiled_vs_interpreter {k}" for k, (e, n) in report["compiled_vs_interpreter"].items() if e != n]
  failed += [f"kept_sets {k}" for k, (e, n) in report["kept_sets"].items() if e != n]
  failed += [f"greedy_vs_xla {k}" for k, (e, n) in report["greedy_vs_xla"].items() if e != n]
  failed += [f"chisquare {k}" for k, (pv, _) in report["chisquare"].items() if pv < 1e-3]
  failed += [f"sample_tokens {k}" for k, (e, n) in report["sample_tokens"].items() if e != n]
  report["failed"] = failed
  report["seconds"] = round(time.time() - t0, 1)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "sampler_gpu_check.json"), "w") as f:
    json.dump(report, f, indent=1)
  print("failed:", failed or "none", f"({report['seconds']} s)")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
