"""Per-kernel device times of one sampler call, for Nsight Compute (ncu).

Compiles and warms up one `bench/sampler.py` case outside the profiled region,
then runs it once between cuProfilerStart/Stop, so that

    ncu --profile-from-start off --metrics gpu__time_duration.sum --csv \\
        python3 bench/kernels.py --case random_ngram --batch-size 1024 --vocab-size 151936

lists exactly the kernels of one call (XLA names them after their fusions, the
same names the optimised HLO shows: `python3 bench/sampler.py --dump-hlo`).
`python3 bench/kernels.py --summarize FILE.csv` prints them sorted by time.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.sampler import CASES, make_inputs  # noqa: E402
from specdec_jax.sampling import SamplingParams  # noqa: E402


def summarize(path, top=25):
  """Kernel name, microseconds: sorted, with the total, from an ncu --csv file."""
  with open(path) as f:
    rows = [r for r in csv.reader(line for line in f if line.startswith('"'))]
  head, body = rows[0], rows[1:]
  name, value = head.index("Kernel Name"), head.index("Metric Value")
  times = [(r[name], float(r[value].replace(",", "")) / 1e3) for r in body]  # ns -> us
  total = sum(t for _, t in times)
  print(f"{os.path.basename(path)}: {len(times)} kernels, {total:.1f} us")
  for n, t in sorted(times, key=lambda x: -x[1])[:top]:
    print(f"  {t:9.1f} us  {100 * t / total:5.1f}%  {n[:90]}")


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--case", default="random_ngram", choices=list(CASES))
  p.add_argument("--batch-size", type=int, default=1024)
  p.add_argument("--vocab-size", type=int, default=151936)
  p.add_argument("--k", type=int, default=4)
  p.add_argument("--summarize", nargs="*", help="ncu csv files to summarise instead of running")
  args = p.parse_args()
  if args.summarize:
    for path in args.summarize:
      summarize(path)
    return
  case = CASES[args.case]
  b, v = args.batch_size, args.vocab_size
  (logits,), dps, draft = make_inputs(jax.random.key(0), 1, b, args.k, v, case.draft_probs)
  dp = dps[0] if case.draft_probs else None
  params = SamplingParams.create(jnp.asarray(case.temperature(b)), top_k=case.top_k, top_p=case.top_p)
  fn = jax.jit(case.fn)
  for _ in range(2):
    jax.block_until_ready(fn(logits, draft, dp, params, jax.random.key(1)))
  cuda = ctypes.CDLL("libcuda.so.1")
  cuda.cuProfilerStart()
  jax.block_until_ready(fn(logits, draft, dp, params, jax.random.key(2)))
  cuda.cuProfilerStop()


if __name__ == "__main__":
  main()
