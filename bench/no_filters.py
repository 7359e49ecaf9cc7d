"""The samplers with and without the static `no_filters` promise, alone: microseconds per call.

Times `sample_tokens` on [B, V] and `rejection_sample` on [B, K+1, V] (with and
without draft probabilities), T=1 rows, inside a jitted `fori_loop` (no
dispatch in the figure): the default program on rows that filter nothing and
on rows with top-k 50 / top-p 0.9, `no_filters=True`, and `no_filters=True,
all_random=True`, under each of `--kernels` (XLA's program has run-time
branches on the filters, the overflow redo, an empty residual and an
all-greedy batch; the Pallas programs decide inside their kernels). With
`--trace DIR`, each cell's costliest kernels.

Usage (GPU):
    PYTHONPATH=. python3 bench/no_filters.py --out $OUT/nf --batch-sizes 1,8 --ks 2,3 --kernels xla,pallas
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402
from bench.step_profile import profile_kernels  # noqa: E402
from specdec_jax import SamplingParams, rejection_sample  # noqa: E402
from specdec_jax.sampling.sample import sample_tokens  # noqa: E402

PROGRAMS = {
  "default": {},
  "default, top-k 50 / top-p 0.9": {"filtering": True},  # the same program; its rows filter
  "no_filters": {"no_filters": True},
  "no_filters+all_random": {"no_filters": True, "all_random": True},
}


# Set per cell from --kernels: which program the samplers run.
OPTIONS = {"kernels": "auto"}


def _rejection_step(k, with_probs, flags):
  def step(i, acc, logits, probs, draft, params, key):
    out = rejection_sample(
      draft,
      logits,
      params,
      jax.random.fold_in(key, i),
      draft_probs=probs if with_probs else None,
      kernels=OPTIONS["kernels"],
      **flags,
    )
    return acc + out.token_ids.sum()

  return step


def _sample_step(flags):
  flags = {n: f for n, f in flags.items() if n != "all_random"}  # sample_tokens has no all_random

  def step(i, acc, logits, probs, draft, params, key):
    key = jax.random.fold_in(key, i)
    return acc + sample_tokens(logits[:, 0], params, key, kernels=OPTIONS["kernels"], **flags)[0].sum()

  return step


def cell(kind, b, k, v, with_probs, flags, *, target_s, repeats, trace_dir=None):
  key = jax.random.key(0)
  logits = jax.random.normal(key, (b, k + 1, v), jnp.float32) * 3
  probs = jax.nn.softmax(jax.random.normal(jax.random.key(1), (b, k, v)) * 3, axis=-1)
  draft = jax.random.randint(jax.random.key(2), (b, k), 0, v, jnp.int32)
  flags = dict(flags)
  filtering = flags.pop("filtering", False)
  params = SamplingParams.create(jnp.ones((b,), jnp.float32), *((50, 0.9) if filtering else ()))
  step = _sample_step(flags) if kind == "sample_tokens" else _rejection_step(k, with_probs, flags)
  loop = common.timed_loop(step)
  ops = (logits, probs, draft, params, key)
  r = common.time_per_iter(loop, jnp.int32(0), ops, target_s=target_s, repeats=repeats)
  row = {"us": r["per_iter_s"] * 1e6, "scale": r["scale"], "compile_s": r["compile_s"]}
  if trace_dir:
    table, error = profile_kernels(lambda: r["compiled"](0, 20, jnp.int32(0), *ops), trace_dir, 20, top=25)
    row.update({"trace_error": error} if error else {"kernels": table})
  return row


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", required=True)
  ap.add_argument("--batch-sizes", default="1,8")
  ap.add_argument("--ks", default="2,3")
  ap.add_argument("--vocab", default="49152", help="a comma list of vocabulary sizes")
  ap.add_argument("--target-ms", type=float, default=50.0)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--trace", help="profile every cell into this directory (kernels in the JSON)")
  ap.add_argument("--kernels", default="auto", help="the samplers' kernels=, a comma list of auto, xla, pallas")
  ap.add_argument("--no-sample-tokens", action="store_true", help="time rejection_sample only")
  ap.add_argument("--no-rejection-sample", action="store_true", help="time sample_tokens only")
  args = ap.parse_args(argv)
  kernel_sets = args.kernels.split(",")
  if not set(kernel_sets) <= {"auto", "xla", "pallas"}:
    ap.error(f"--kernels: a comma list of auto, xla, pallas; got {args.kernels!r}")
  os.makedirs(args.out, exist_ok=True)
  rows = []
  for v, b in ((v, b) for v in map(int, args.vocab.split(",")) for b in map(int, args.batch_sizes.split(","))):
    cells = [] if args.no_sample_tokens else [("sample_tokens", 1, False)]
    if not args.no_rejection_sample:
      cells += [("rejection_sample", k, wp) for k in map(int, args.ks.split(",")) for wp in (True, False)]
    for kind, k, with_probs in cells:
      for kernels, (name, flags) in ((kn, p) for kn in kernel_sets for p in PROGRAMS.items()):
        if kind == "sample_tokens" and name == "no_filters+all_random":
          continue
        OPTIONS["kernels"] = kernels
        tag = f"{kind}_v{v}_b{b}_k{k}_{with_probs}_{kernels}_{name}".replace(" ", "").replace("/", "")
        trace = os.path.join(args.trace, tag) if args.trace else None
        r = cell(
          kind,
          b,
          k,
          v,
          with_probs,
          flags,
          target_s=args.target_ms / 1e3,
          repeats=args.repeats,
          trace_dir=trace,
        )
        rows.append(
          {
            "kind": kind,
            "V": v,
            "B": b,
            "K": k if kind != "sample_tokens" else None,
            "draft_probs": with_probs,
            "program": name,
            "kernels": kernels,
            **r,
          }
        )
        print(
          f"V={v} B={b} {kind:16s} K={k} probs={with_probs!s:5s} {kernels:6s} {name:30s} {r['us']:8.1f} us", flush=True
        )
  with open(os.path.join(args.out, "no_filters.json"), "w") as f:
    json.dump(
      {
        "info": {**common.device_info(), "xla_flags": os.environ.get("XLA_FLAGS", "")},
        "config": vars(args),
        "rows": rows,
      },
      f,
      indent=1,
    )
  print(f"wrote {args.out}/no_filters.json")


if __name__ == "__main__":
  main()
