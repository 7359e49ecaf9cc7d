"""Bit-identity check for refactors of the samplers: save outputs on a fixed grid, then compare.

A refactor that must not change results (the sampler issue's "outputs
bit-identical") runs this before and after:

    PYTHONPATH=. python3 bench/golden.py --save /tmp/before.npz     # on the old commit
    PYTHONPATH=. python3 bench/golden.py --check /tmp/before.npz    # on the new one

The grid covers what the sampler's paths branch on: greedy, random and mixed
batches (and the two static flags), with and without draft probabilities,
ragged rows, top-k/top-p, temperatures near 0, non-finite logits (NaN, +-inf,
all-masked positions), a vocabulary that is and one that is not a multiple of
the chunk size, K in {0, 1, 4}, every `logprobs` mode and both verification
methods; plus `sample_tokens` and `process_logits`. Results compare bit for
bit (NaN equal to NaN); the first difference is reported with its case.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from specdec_jax import SamplingParams, rejection_sample  # noqa: E402
from specdec_jax.sampling import penalties, sample


def _inputs(seed, b, k, v, nonfinite):
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(b, k + 1, v)).astype(np.float32) * 3
  if nonfinite:
    logits[0, 0, 3] = np.nan
    logits[1 % b, min(1, k), :] = -np.inf
    logits[2 % b, 0, 5] = np.inf
    logits[3 % b, k, 7] = 3e38
  probs = rng.dirichlet(np.full(v, 0.3), size=(b, k)).astype(np.float32)
  draft = rng.integers(0, v, size=(b, k)).astype(np.int32)
  draft[:, :1] = np.argmax(np.nan_to_num(logits[:, :1], nan=-np.inf), -1)  # some accepted greedy drafts
  n = rng.integers(0, k + 1, size=(b,)).astype(np.int32)
  return logits, probs, draft, n


def _params(kind, b):
  t = {"greedy": np.zeros(b), "random": np.full(b, 0.9), "mixed": np.where(np.arange(b) % 2, 0.0, 1.3),
       "cold": np.full(b, 2e-5)}[kind].astype(np.float32)
  return t


def cases():
  """Yields (name, fn) pairs; fn() returns a dict of arrays."""
  for v, k, nonfinite in [(96, 4, False), (4096, 4, True), (1000, 1, False), (2048, 0, False)]:
    b = 8
    logits, probs, draft, n = _inputs(v + k, b, k, v, nonfinite)
    for kind, filt, with_dp, ragged, lp, method in itertools.product(
        ("greedy", "random", "mixed", "cold"), (False, True), (False, True), (False, True),
        (None, "raw", "processed"), ("token", "block")):
      if kind == "greedy" and (with_dp or method == "block"):
        continue
      if lp is not None and (ragged or filt and with_dp):
        continue
      t = _params(kind, b)
      params = SamplingParams.create(t, top_k=np.where(np.arange(b) % 3 == 0, 5, 0) if filt else None,
                                     top_p=0.8 if filt else None)
      flags = [{}] + ([{"all_greedy": True}] if kind == "greedy" else []) + (
          [{"all_random": True}] if kind in ("random", "cold") else [])
      for fl in flags:
        name = f"rs V={v} K={k} nf={nonfinite} {kind} filt={filt} dp={with_dp} ragged={ragged} lp={lp} {method} {fl}"

        def fn(params=params, with_dp=with_dp, ragged=ragged, lp=lp, method=method, fl=fl):
          # Under jit: the eager input checks would refuse the non-finite cases.
          run = jax.jit(lambda d, x, p, key, dp, nn: rejection_sample(d, x, p, key, draft_probs=dp,
                                                                      num_draft_tokens=nn, logprobs=lp,
                                                                      method=method, **fl))
          out = run(draft, logits, params, None if fl.get("all_greedy") else jax.random.key(7),
                    probs if with_dp else None, n if ragged else None)
          res = {"ids": out.token_ids, "na": out.num_accepted}
          if lp is not None:
            res["lp"] = out.logprobs
          return res

        yield name, fn
    for kind, filt in itertools.product(("greedy", "random", "mixed", "cold"), (False, True)):
      params = SamplingParams.create(_params(kind, b), top_k=5 if filt else None, top_p=0.8 if filt else None)
      x = np.where(np.isnan(logits[:, 0]), 0.0, logits[:, 0])
      x = np.where(np.all(x == -np.inf, -1, keepdims=True), 0.0, x)

      def st(params=params, x=x):
        tok, logp = jax.jit(sample.sample_tokens)(x, params, jax.random.key(3))
        return {"tok": tok, "logp": logp, "proc": jax.jit(sample.process_logits)(logits, params)}

      yield f"sample_tokens V={v} {kind} filt={filt}", st
    if k > 0:
      yield from _option_cases(v, k, b, logits, probs, draft, n)


def _option_cases(v, k, b, logits, probs, draft, n):
  """Bias, penalties and min-p (second-generation options) on both samplers."""
  rng = np.random.default_rng(v)
  prompt = rng.integers(0, v, size=(b, 6)).astype(np.int32)
  state = penalties.PenaltyState.from_prompt(prompt, np.full(b, 6), v).add_tokens(draft[:, ::-1])
  bias = {int(draft[0, 0]): -2.0, 1: 3.0}
  for kind, with_dp, lp, min_p in itertools.product(("greedy", "random", "mixed"), (False, True),
                                                     (None, "processed"), (None, 0.1)):
    if kind == "greedy" and (with_dp or min_p):
      continue
    params = SamplingParams.create(_params(kind, b), repetition_penalty=1.3, frequency_penalty=0.4,
                                   presence_penalty=0.2, logit_bias=bias, min_p=min_p)
    name = f"rs-options V={v} K={k} {kind} dp={with_dp} lp={lp} min_p={min_p}"

    def fn(params=params, with_dp=with_dp, lp=lp, min_p=min_p):
      run = jax.jit(lambda d, x, p, key, dp, st: rejection_sample(d, x, p, key, draft_probs=dp, logprobs=lp,
                                                                  penalty_state=st))
      try:
        out = run(draft, logits, params, jax.random.key(5), probs if with_dp else None, state)
      except ValueError:  # rejection_sample refused min_p before the second generation
        assert min_p is not None
        return {}
      res = {"ids": out.token_ids, "na": out.num_accepted}
      if lp is not None:
        res["lp"] = out.logprobs
      return res

    yield name, fn
    x = np.where(np.isfinite(logits[:, 0]), logits[:, 0], 0.0)

    def st(params=params, lp=lp, x=x):
      res = jax.jit(functools.partial(sample.sample_tokens, logprobs=lp))(x, params, jax.random.key(9),
                                                                            penalty_state=state)
      return dict(zip(("tok", "logp", "lp"), res))

    yield f"sample_tokens-options V={v} {kind} lp={lp} min_p={min_p}", st


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  g = ap.add_mutually_exclusive_group(required=True)
  g.add_argument("--save", help="write the grid's outputs to this .npz")
  g.add_argument("--check", help="compare the grid's outputs with this .npz, bit for bit")
  args = ap.parse_args(argv)
  got = {}
  for name, fn in cases():
    for key, val in fn().items():
      got[f"{name} | {key}"] = np.asarray(val)
  if args.save:
    np.savez(args.save, **got)
    print(f"saved {len(got)} arrays from the grid to {args.save}")
    return 0
  ref = dict(np.load(args.check))
  missing = sorted(set(ref) - set(got))
  bad = [n for n in sorted(set(ref) & set(got))
         if ref[n].shape != got[n].shape or not np.array_equal(ref[n], got[n], equal_nan=True)]
  for n in bad[:10]:
    print("DIFFERS:", n)
  for n in missing[:10]:
    print("MISSING:", n)
  print(f"{len(set(ref) & set(got)) - len(bad)} of {len(ref)} arrays bit-identical; {len(bad)} differ, "
        f"{len(missing)} missing, {len(set(got) - set(ref))} new")
  return 1 if bad or missing else 0


if __name__ == "__main__":
  sys.exit(main())
