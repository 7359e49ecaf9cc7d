"""The samplers on a device mesh, run by tests/sampling/test_vocab_parallel.py in a subprocess with 8 fake CPU devices.

`rejection_sample` and `sample_tokens` called under `with jax.set_mesh(mesh):`
(axes "data" x "model") with target_logits [B, K+1, V] and draft_probs [B, K, V]
placed as P("data", None, "model") (sample_tokens' logits [B, V] as
P("data", "model")) must give what the same call gives on one device with no
mesh, for the same key. When the model axis m > 1 splits V into whole chunks
(`qualifies(V, m)`: V % m == 0 and (V / m) % chunk_size(V) == 0) the sampler
reduces each device's slice of the vocabulary itself and only small partials
cross devices; otherwise the ordinary program runs (and XLA may gather). The
parent sets `XLA_FLAGS=--xla_force_host_platform_device_count=8` (plus flags
that halve the compile time, the same for every run) and runs its part
through tests/support/eight_devices.py (or alone, to debug:

    python tests/support/mesh_sampler_worker.py [--part all|fast|more-meshes])

(`fast`: everything but the `rejection_sample` checks on the meshes 4x2 and
8x1 and all but the greedy flag's on 1x8, which `more-meshes` runs alone; the
parent runs those under the slow mark)
which prints one JSON object on its last line: {check name: {"ok": bool,
"detail": str}}. Every check runs on its own: a failure, traceback included,
goes to "detail" and the next check runs (a program that fails to compile fails
each check that needs it, compiled once). The references are computed outside
any mesh, on device 0, by the same jitted functions. The checks:

  - "<mesh> <program>: <data>": `rejection_sample` on meshes 1x8, 2x4, 4x2 and
    8x1 (data x model), V = 4096 (chunk_size 64: 64 chunks, 8 to 32 a device),
    B = 8, K = 3; per-row arrays (drafts, counts, params) split over "data".
    Programs (static choices): the all_greedy flag; method "token" with n-gram
    drafts (draft_probs=None) and logprobs="processed"; "token" with
    draft_probs; "block" with n-gram drafts and params carrying a min_p field;
    "block" with draft_probs and logprobs="raw". Data (run-time choices, the
    same compiled program): "mixed" greedy and random rows at temperatures
    0.5, 1.0 and 1.7 with ragged num_draft_tokens (0 and K among both kinds);
    "random" rows only; "greedy rows" (temperature 0 everywhere without the
    flag: the run-time greedy branch); "filtered": top-k and top-p rows among
    unfiltered and greedy ones, one of them top_p 0.95 over flat logits
    ~ N(0, 0.1), more tokens than the candidate search can vouch for (the
    exact sorted fallback); "min-p" rows alone; "min-p + top-k". The filtered
    data run on 1x8 and 2x4 (FILTERED_MESHES); 8x1 (model axis 1: the ordinary
    program, rows split) runs the greedy and token programs (ON_8X1).
    token_ids, num_accepted and num_emitted must be equal, bit for bit, and
    logprobs within LOGPROBS_ATOL. The one-device results must include a
    rejected draft and an all-accepted row (so the recovered and the bonus
    draws are both exercised).
  - "<mesh> sample_tokens...": the all_greedy flag; greedy and random rows;
    top-k / top-p rows; on 1x8 and 2x4: the same tokens, and log_probs [B, V]
    with the same non-finite entries and the rest within LOGPROBS_ATOL.
  - "... no_filters": `rejection_sample` (with draft_probs) and `sample_tokens`
    with the static no_filters promise, "mixed" data: its one overflow-safe
    pass gathers per-chunk partials, so the outputs must equal one device's.
  - "V=3000 ...": 60 chunks of 50 tokens, split into whole chunks over 4
    devices (2x4: sharded, 15 chunks a device) but not over 8 (1x8: 375 tokens
    a device, the ordinary program); per-row arrays replicated.
  - "explicit 2x4 ...": a mesh with Explicit axes (`jax.make_mesh`'s default).
  - "teeth: ...": planted bugs showing that the comparisons can fail. The 1x8
    programs run on wrong inputs (draft_probs rolled by one token, another key,
    one device's slice of the vocabulary dropped to -inf or its mass doubled)
    and must differ from the one-device results of the right inputs, for each
    of the 8 slices: a sharded path that lost or double-counted any slice
    would be caught. (Row b's position-0 favourite, a clear argmax, lies in
    slice b of 8.)
  - "HLO ...": compiled programs, `jax.jit(f).lower(*args).compile().as_text()`.
    Collectives are found by a regex over that text (`collectives`): an
    instruction line `%name = SHAPE OPCODE(...` whose OPCODE is all-gather,
    all-reduce, all-to-all, collective-permute, reduce-scatter,
    collective-broadcast or ragged-all-to-all, plain or async (-start, -done),
    after dropping `/*...*/` comments (XLA writes `/*index=5*/` into long tuples).
    SHAPE is one array, `f32[8,4,64]{2,1,0}`, or a tuple of arrays,
    `(f32[8,5,32]{..}, s32[8,5,32]{..})`, nested for the async forms
    (`all-gather-start` returns `((f32[..]), f32[..])`); every `dtype[dims]`
    in it is read. SHAPE may not contain "=", and the opcode must follow
    whitespace and precede "(", so an op name inside metadata
    (`op_name="jit(f)/all-gather"`) never matches. The HLO text holds every
    branch of every `lax.cond` / `lax.switch`, so rarely taken paths (the
    exact fallback, overflow redo) are checked too. On the sharded programs
    (token with draft_probs, whose program holds the top-k/top-p search; the
    all_greedy program) at V_HLO = 65536 on 2x4 and 1x8: at least one
    collective exists (so the search sees them), and no array a collective
    returns has a dimension >= V/m: neither V nor V/m nor a reshaped piece of
    the vocabulary ([B*(K+1), V/4] would pass a test for == V/m on 8
    devices). V_HLO is large so that the legitimate partials (64 chunk totals,
    4 x 1024 threshold candidates a position) stay well below V/m (8192 on 8
    devices). The one-device programs hold no collective at all. The
    all_greedy programs (one device, 2x4, 1x8) have no `exponential` or
    `exponential-minus-one` instruction, no `rng*` instruction and no
    "threefry" anywhere in the text (JAX's PRNG names every random op so in
    the metadata, and in custom-call targets on GPU); the random program on the
    same mesh (or device) must show both, so the search would see them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from specdec_jax import SamplingParams, rejection_sample, sample_tokens
from specdec_jax.mesh import make_mesh
from specdec_jax.sampling.masks import pack_bitmask
from specdec_jax.sampling.reductions import chunk_size
from tests.support.eight_devices import exit_unless_devices, part_arg, run_checks

jax.config.update("jax_numpy_rank_promotion", "raise")  # as tests/conftest.py

NUM_DEVICES = 8
B, K = 8, 3
V = 4096  # chunk_size 64: whole chunks on every model axis (2, 4, 8)
V_SMALL = 3000  # chunk_size 50: 750 tokens a device over 4 (15 chunks), 375 over 8 (not whole chunks)
V_HLO = 65536  # chunk_size 1024: V/m >= 8192, far above every partial's size
MESHES = {"1x8": (1, 8), "2x4": (2, 4), "4x2": (4, 2), "8x1": (8, 1)}
# Two sums of the same float32 numbers in another order differ by a few ulps of
# values of size <= ~30 (log-probabilities): ~1e-6. A wrong normaliser moves
# them by far more (dropping or doubling one device's slice: >= 1e-3 here).
LOGPROBS_ATOL = 1e-5
NUM_DRAFTS = np.array([3, 0, 3, 3, 2, 1, 0, 3], np.int32)  # ragged: 0 and K among greedy and random rows
KEY_SEED, OTHER_KEY_SEED = 7, 8


def qualifies(v: int, m: int) -> bool:
  """The sampler's condition for its sharded path: V/m is a whole number of chunks (and m > 1)."""
  return m > 1 and v % m == 0 and (v // m) % chunk_size(v) == 0


# ----------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Data:
  logits: np.ndarray  # f32 [B, K+1, V]
  ngram_drafts: np.ndarray  # i32 [B, K]: each position's favourite token
  probs: np.ndarray  # f32 [B, K, V]
  prob_drafts: np.ndarray  # i32 [B, K]: drawn from probs


_DATA: dict[int, Data] = {}


def data(v: int) -> Data:
  """Logits with one favourite token a position (a bonus of 0, 6, 10 or 14 over ~N(0, 2) logits).

  Row b's favourite at position i lies in slice (b + i) % 8 of the vocabulary
  split 8 ways; at position 0 it is always the clear argmax. Row 3 is flat,
  ~N(0, 0.1) (its favourite only 1.0 above): top_p 0.95 there keeps thousands
  of tokens, more than the candidate search can vouch for.
  """
  if v in _DATA:
    return _DATA[v]
  rng = np.random.default_rng(v)
  width = v // 8
  x = 2.0 * rng.standard_normal((B, K + 1, v))
  x[3] = 0.1 * rng.standard_normal((K + 1, v))
  fav = np.array([[((b + i) % 8) * width + rng.integers(width) for i in range(K + 1)] for b in range(B)])
  bonus = rng.choice([0.0, 6.0, 10.0, 14.0], size=(B, K + 1))
  bonus[:, 0] = np.maximum(bonus[:, 0], 10.0)
  bonus[3] = 1.0
  np.put_along_axis(x, fav[..., None], np.take_along_axis(x, fav[..., None], axis=-1) + bonus[..., None], axis=-1)
  q = x[:, :K] + rng.standard_normal((B, K, v))
  q = np.exp(q - q.max(-1, keepdims=True))
  q /= q.sum(-1, keepdims=True)
  prob_drafts = np.array([[rng.choice(v, p=q[b, i]) for i in range(K)] for b in range(B)])
  _DATA[v] = Data(
    logits=x.astype(np.float32),
    ngram_drafts=fav[:, :K].astype(np.int32),
    probs=q.astype(np.float32),
    prob_drafts=prob_drafts.astype(np.int32),
  )
  return _DATA[v]


MIXED_T = [0.0, 0.5, 1.0, 1.7, 0.0, 1.0, 1.7, 0.5]
RANDOM_T = [0.5, 1.0, 1.7, 1.0, 0.7, 1.3, 1.0, 0.5]
FILTER_T = [1.0, 0.7, 1.0, 1.0, 0.0, 1.3, 1.0, 0.9]
TOP_K = [0, 5, 0, 0, 3, 40, 0, 2]  # row 4 is greedy: its filters are ignored
TOP_P = [1.0, 1.0, 0.9, 0.95, 1.0, 0.8, 1.0, 1.0]  # row 3: wide top-p over flat logits
MIN_P = [0.0, 0.1, 0.0, 0.3, 0.0, 0.05, 0.5, 0.0]


def params_for(dataset: str, min_p_field: bool = False) -> SamplingParams:
  """The sampling parameters of a data set (a min_p field of zeros where the program has one)."""
  zeros = [0.0] * B if min_p_field else None
  greedy = [0.0] * B
  table = {  # temperature, top_k, top_p, min_p
    "mixed": (MIXED_T, None, None, zeros),
    "random": (RANDOM_T, None, None, zeros),
    "greedy rows": (greedy, None, None, zeros),
    "greedy": (greedy, None, None, zeros),
    "filtered": (FILTER_T, TOP_K, TOP_P, zeros),
    "min-p": (MIXED_T, None, None, MIN_P),
    "min-p + top-k": (FILTER_T, TOP_K, None, [0.0, 0.0, 0.1, 0.0, 0.0, 0.05, 0.2, 0.0]),
  }
  temperature, top_k, top_p, min_p = table[dataset]
  return SamplingParams.create(temperature, top_k, top_p, min_p=min_p)


# ----------------------------------------------------------------------------
# Programs: one jitted function each, compiled once per (placement, V)
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Program:
  kind: str  # "rejection" or "sample"
  fn: object  # jitted; rejection: (drafts, logits, params, key, probs, n), sample: (logits, params, key)
  probs: bool = False  # rejection: draft_probs given
  greedy_flag: bool = False
  min_p_field: bool = False
  logprobs: str | None = None


def token_mask(v: int) -> np.ndarray:
  """int32 [B, K+1, V/32]: a fifth of the tokens disallowed (another fifth at each position and row), each
  position's favourite token of `data(v)` allowed (so some rows still accept every draft)."""
  allowed = (np.arange(v)[None, None, :] * 7 + np.arange(K + 1)[None, :, None] * 3 + np.arange(B)[:, None, None]) % 5
  allowed = allowed != 0
  favourite = np.argmax(data(v).logits, axis=-1)
  allowed[np.arange(B)[:, None], np.arange(K + 1)[None, :], favourite] = True
  with jax.ensure_compile_time_eval():  # called while tracing: pack now, a constant of the program
    return np.asarray(pack_bitmask(allowed))


def _rejection(method="token", probs=False, logprobs=None, greedy_flag=False, no_filters=False, masked=False):
  def fn(drafts, logits, params, key, draft_probs, n):
    return rejection_sample(
      drafts,
      logits,
      params,
      None if greedy_flag else key,
      draft_probs if probs else None,
      n,
      all_greedy=greedy_flag,
      logprobs=logprobs,
      method=method,
      no_filters=no_filters,
      token_bitmask=token_mask(logits.shape[-1]) if masked else None,
    )

  return jax.jit(fn)


PROGRAMS = {
  "greedy flag": Program("rejection", _rejection(greedy_flag=True), greedy_flag=True),
  "token, n-gram, logprobs=processed": Program("rejection", _rejection(logprobs="processed"), logprobs="processed"),
  "token, draft probs": Program("rejection", _rejection(probs=True), probs=True),
  "block, n-gram, min_p field": Program("rejection", _rejection(method="block"), min_p_field=True),
  "block, draft probs, logprobs=raw": Program(
    "rejection", _rejection(method="block", probs=True, logprobs="raw"), probs=True, logprobs="raw"
  ),
  "sample_tokens greedy flag": Program(
    "sample", jax.jit(lambda x, p, k: sample_tokens(x, p, None, all_greedy=True)), greedy_flag=True
  ),
  "sample_tokens": Program("sample", jax.jit(lambda x, p, k: sample_tokens(x, p, k))),
  # The no_filters programs: one overflow-safe pass (reductions.shifted_chunk_stats) whose partials are gathered.
  "token, draft probs, no_filters": Program("rejection", _rejection(probs=True, no_filters=True), probs=True),
  # A token_bitmask ([B, K+1, V/32] words, split over "model" like the tokens they cover).
  "token, draft probs, token_bitmask": Program("rejection", _rejection(probs=True, masked=True), probs=True),
  "sample_tokens no_filters": Program("sample", jax.jit(lambda x, p, k: sample_tokens(x, p, k, no_filters=True))),
}
DATASETS = {
  "greedy flag": ("greedy",),
  "token, n-gram, logprobs=processed": ("mixed", "random", "greedy rows", "filtered"),
  "token, draft probs": ("mixed", "random", "greedy rows", "filtered"),
  "block, n-gram, min_p field": ("mixed", "min-p", "min-p + top-k"),
  "block, draft probs, logprobs=raw": ("mixed", "random", "filtered"),
  "sample_tokens greedy flag": ("greedy",),
  "sample_tokens": ("mixed", "filtered"),
  "token, draft probs, no_filters": ("mixed",),
  "sample_tokens no_filters": ("mixed",),
  "token, draft probs, token_bitmask": ("mixed",),
}
# The data sets with top-k, top-p or min-p run on these meshes only (each top-p run costs seconds on 8 CPU devices).
FILTERED = ("filtered", "min-p", "min-p + top-k")
FILTERED_MESHES = ("1x8", "2x4")
# A model axis of 1 runs the ordinary program with rows split: the token programs only (the block ones would
# add two compiles, ~5 s, for no sharded code).
ON_8X1 = ("greedy flag", "token, n-gram, logprobs=processed", "token, draft probs")
REJECTION = [name for name, p in PROGRAMS.items() if p.kind == "rejection"]
SAMPLE = [name for name, p in PROGRAMS.items() if p.kind == "sample"]


def inputs(program: Program, dataset: str, v: int, *, key_seed=KEY_SEED, logits=None, probs=None):
  """The program's arguments (NumPy / one-device arrays) for a data set; logits/probs override the data's."""
  d = data(v)
  params = params_for(dataset, program.min_p_field)
  key = None if program.greedy_flag else jax.random.key(key_seed)
  x = d.logits if logits is None else logits
  if program.kind == "sample":
    return (x[:, 0], params, key)
  q = (d.probs if probs is None else probs) if program.probs else None
  drafts = d.prob_drafts if program.probs else d.ngram_drafts
  return (drafts, x, params, key, q, NUM_DRAFTS)


def placed(program: Program, args, mesh, *, rows: bool):
  """`inputs` put on `mesh`: logits and draft_probs with rows over "data" and the vocabulary over "model";
  per-row arrays (drafts, counts, params) split over "data" (`rows`) or replicated; the key replicated.
  Without a mesh: on device 0."""
  if mesh is None:
    dev = jax.devices()[0]
    return jax.tree.map(lambda a: jax.device_put(a, dev), args)
  row = lambda a: P("data", *([None] * (np.ndim(a) - 1))) if rows else P()
  vocab = lambda a: P("data", *([None] * (np.ndim(a) - 2)), "model")
  replicated = lambda a: P()
  # One spec rule per argument: rejection (drafts, logits, params, key, probs, n); sample (logits, params, key).
  rules = (row, vocab, row, replicated, vocab, row) if program.kind == "rejection" else (vocab, row, replicated)
  return tuple(
    jax.tree.map(lambda a, r=rule: jax.device_put(a, NamedSharding(mesh, r(a))), arg)
    for rule, arg in zip(rules, args, strict=True)
  )


class _Memo:
  """A cache that also keeps failures: a program that fails to compile fails every check using it once."""

  def __init__(self):
    self.store = {}

  def get(self, key, make):
    if key not in self.store:
      try:
        self.store[key] = (True, make())
      except Exception as e:  # noqa: BLE001 (re-raised to each check that needs it)
        self.store[key] = (False, e)
    ok, value = self.store[key]
    if not ok:
      raise value
    return value


_COMPILED, _REFERENCE = _Memo(), _Memo()
COMPILE_SECONDS: dict = {}


def compiled(name: str, mesh_name: str | None, v: int, args, mesh, *, rows: bool = True):
  """The program compiled for args placed on `mesh` (None: one device), once per (name, mesh, V, placement)."""

  def make():
    start = time.perf_counter()
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
      c = PROGRAMS[name].fn.lower(*placed(PROGRAMS[name], args, mesh, rows=rows)).compile()
    COMPILE_SECONDS[(name, mesh_name, v, rows)] = time.perf_counter() - start
    return c

  return _COMPILED.get((name, mesh_name, v, rows), make)


def run(name, mesh_name, v, args, mesh, *, rows=True):
  """Outputs (NumPy) of the compiled program on args placed on `mesh` (run under it)."""
  c = compiled(name, mesh_name, v, args, mesh, rows=rows)
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    out = c(*placed(PROGRAMS[name], args, mesh, rows=rows))
  return jax.tree.map(np.asarray, out)


def reference(name, dataset, v):
  """The one-device (no mesh) outputs of a program on a data set, computed once."""
  return _REFERENCE.get((name, dataset, v), lambda: run(name, None, v, inputs(PROGRAMS[name], dataset, v), None))


# ----------------------------------------------------------------------------
# Comparisons
# ----------------------------------------------------------------------------


def _close(a, b):
  """(ok, max error): same non-finite entries, finite ones within LOGPROBS_ATOL."""
  a, b = np.asarray(a), np.asarray(b)
  fa, fb = np.isfinite(a), np.isfinite(b)
  if not np.array_equal(fa, fb) or not np.array_equal(a[~fa], b[~fb]):
    return False, float("inf")
  err = float(np.max(np.abs(a[fa] - b[fb]), initial=0.0))
  return err <= LOGPROBS_ATOL, err


def differences(name, expected, got) -> list[str]:
  """What differs between two outputs of program `name` (empty: equal under the contract)."""
  out = []
  if PROGRAMS[name].kind == "sample":
    (t0, lp0), (t1, lp1) = expected[:2], got[:2]
    if not np.array_equal(t0, t1):
      out.append(f"tokens differ: one device {t0.tolist()}, mesh {t1.tolist()}")
    ok, err = _close(lp0, lp1)
    if not ok:
      out.append(
        f"log_probs differ (max |err| {err:.3g}, -inf pattern equal: "
        f"{np.array_equal(np.isfinite(lp0), np.isfinite(lp1))})"
      )
    return out
  for field in ("token_ids", "num_accepted", "num_emitted"):
    a, b = getattr(expected, field), getattr(got, field)
    if not np.array_equal(a, b):
      out.append(f"{field} differ: one device {a.tolist()}, mesh {b.tolist()}")
  if PROGRAMS[name].logprobs:
    ok, err = _close(expected.logprobs, got.logprobs)
    if not ok:
      out.append(f"logprobs differ: max |err| {err:.3g} > {LOGPROBS_ATOL}")
  return out


def coverage(name, dataset, ref) -> str:
  """The reference's accepted counts; raises unless they include a rejection and an all-accepted row."""
  if PROGRAMS[name].kind == "sample":
    return f"tokens {ref[0].tolist()}"
  acc = ref.num_accepted
  rejected = bool(np.any(acc < NUM_DRAFTS))
  full = bool(np.any((acc == NUM_DRAFTS) & (NUM_DRAFTS > 0)))
  assert rejected and full, (
    f"the data do not cover both a rejection and an all-accepted row: accepted {acc.tolist()} of {NUM_DRAFTS.tolist()}"
  )
  return f"accepted {acc.tolist()} of {NUM_DRAFTS.tolist()}"


def check_equal(name, dataset, mesh_name, *, v=V, mesh=None, rows=True):
  mesh = mesh if mesh is not None else make_mesh(*MESHES[mesh_name])
  expected = reference(name, dataset, v)
  covered = coverage(name, dataset, expected)
  got = run(name, mesh_name, v, inputs(PROGRAMS[name], dataset, v), mesh, rows=rows)
  diff = differences(name, expected, got)
  assert not diff, "; ".join(diff)
  m = dict(mesh.shape)["model"]
  extra = ""
  if PROGRAMS[name].logprobs or PROGRAMS[name].kind == "sample":
    lp = (expected.logprobs, got.logprobs) if PROGRAMS[name].kind == "rejection" else (expected[1], got[1])
    extra = f", max |logprob err| {_close(*lp)[1]:.2g}"
  return f"equal ({covered}; sharded path expected: {qualifies(v, m)}{extra})"


# ----------------------------------------------------------------------------
# Planted bugs: wrong inputs on the 1x8 mesh must differ from the one-device results
# ----------------------------------------------------------------------------


def _differs(name, dataset, **overrides):
  mesh = make_mesh(1, 8)
  got = run(name, "1x8", V, inputs(PROGRAMS[name], dataset, V, **overrides), mesh)
  return differences(name, reference(name, dataset, V), got)


def _each_slice(name, dataset, change):
  """For each of the 8 vocabulary slices j (one per device on 1x8): the logits changed by change(slice) differ."""
  width, caught = V // 8, []
  for j in range(8):
    x = data(V).logits.copy()
    x[..., j * width : (j + 1) * width] = change(x[..., j * width : (j + 1) * width])
    diff = _differs(name, dataset, logits=x)
    assert diff, f"slice {j} changed, yet {name!r} on {dataset!r} gives the one-device outputs"
    caught.append(re.split(r"[:(]", diff[0])[0].strip())
  return f"caught for all 8 slices ({', '.join(caught)})"


def teeth_rolled_probs():
  diff = _differs("token, draft probs", "mixed", probs=np.roll(data(V).probs, 1, axis=-1))
  assert diff, "draft_probs rolled by one token give the same outputs"
  return "; ".join(diff)[:300]


def teeth_other_key():
  diff = _differs("token, draft probs", "mixed", key_seed=OTHER_KEY_SEED)
  assert diff, "another key gives the same outputs"
  return "; ".join(diff)[:300]


# ----------------------------------------------------------------------------
# The compiled programs
# ----------------------------------------------------------------------------

_COLLECTIVE_OPS = (
  "all-gather",
  "all-reduce",
  "all-to-all",
  "collective-permute",
  "reduce-scatter",
  "collective-broadcast",
  "ragged-all-to-all",
)
_COLLECTIVE = re.compile(
  r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>[^=]*?)\s+"
  r"(?P<op>(?:" + "|".join(map(re.escape, _COLLECTIVE_OPS)) + r")(?:-start|-done)?)\(",
  re.MULTILINE,
)
_ARRAY = re.compile(r"\b(?P<dtype>pred|token|[a-z]+\d+(?:e\d+m\d+\w*)?)\[(?P<dims>[^\]]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*[^=]*?\s+(?P<op>[a-z][\w\-]*)\(", re.MULTILINE)


def collectives(hlo_text: str) -> list[tuple[str, str, tuple[tuple[int, ...], ...]]]:
  """(opcode, shape text, dimensions of every array in the shape) of each collective instruction of HLO text.

  Handles one-array results `f32[8,4,64]{2,1,0}`, tuples `(f32[8,5,32]{..}, s32[8,5,32]{..})` and the async
  forms (`all-gather-start` with its nested tuple `((f32[..]), f32[..])`, `all-reduce-done`).
  """
  found = []
  # XLA writes "/*index=5*/" inside long tuples (combined all-reduces): drop such comments first.
  for m in _COLLECTIVE.finditer(_COMMENT.sub("", hlo_text)):
    arrays = tuple(tuple(int(d) for d in re.findall(r"\d+", a.group("dims"))) for a in _ARRAY.finditer(m["shape"]))
    found.append((m["op"], m["shape"].strip(), arrays))
  return found


def opcodes(hlo_text: str) -> list[str]:
  """The opcode of every instruction of HLO text (fused computations included)."""
  return _INSTRUCTION.findall(_COMMENT.sub("", hlo_text))


def random_or_exp(hlo_text: str) -> list[str]:
  """What in the HLO text shows exponentials or random numbers (empty: none)."""
  ops = set(opcodes(hlo_text))
  found = sorted(op for op in ops if op in ("exponential", "exponential-minus-one") or op.startswith("rng"))
  if "threefry" in hlo_text.lower():
    found.append("threefry")
  return found


def _hlo(name, mesh_name, v=V_HLO):
  """Compiled HLO text of a rejection program at V (V_HLO: zeros of the right shapes), on a mesh or one device."""
  prog = PROGRAMS[name]
  probs = np.zeros((B, K, v), np.float32) if prog.probs else None
  x = np.zeros((B, K + 1, v), np.float32)
  args = (
    np.zeros((B, K), np.int32),
    x,
    params_for("filtered", prog.min_p_field),
    None if prog.greedy_flag else jax.random.key(0),
    probs,
    NUM_DRAFTS,
  )
  mesh = None if mesh_name is None else make_mesh(*MESHES[mesh_name])
  return compiled(name, mesh_name, v, args, mesh).as_text()


def _describe(found, limit=12):
  shapes = sorted({f"{op} {shape}" for op, shape, _ in found})
  return f"{len(found)} collectives, e.g. {shapes[:limit]}"


def check_no_vocab_collective(name, mesh_name, v=V_HLO):
  text = _hlo(name, mesh_name, v)
  m = MESHES[mesh_name][1]
  found = collectives(text)
  assert opcodes(text), "no instruction parsed from the HLO text"
  if m > 1:
    assert found, "no collective found in a sharded program: the search does not see them"
  local = v // m
  bad = [(op, shape) for op, shape, arrays in found if any(d >= local for dims in arrays for d in dims)]
  assert not bad, f"collectives carrying >= V/m = {local} entries on one axis (V = {v}): {sorted(set(bad))[:8]}"
  return f"none with a dimension >= V/m = {local}; {_describe(found)}"


def check_one_device_no_collective():
  texts = {name: _hlo(name, None, V) for name in ("token, draft probs", "greedy flag")}
  for name, text in texts.items():
    assert opcodes(text), f"{name}: no instruction parsed from the HLO text"
    assert not collectives(text), f"{name} on one device holds collectives: {_describe(collectives(text))}"
  return "no collective in " + ", ".join(f"{n} ({len(opcodes(t))} instructions)" for n, t in texts.items())


def check_greedy_no_random(mesh_name, v=V_HLO):
  greedy = _hlo("greedy flag", mesh_name, v)
  random = _hlo("token, draft probs", mesh_name, v)
  control = random_or_exp(random)
  assert "exponential" in control and "threefry" in control, (
    f"the random program shows {control}: the search would not see exponentials and RNG"
  )
  found = random_or_exp(greedy)
  assert not found, f"the all_greedy program holds {found}"
  return f"none ({len(opcodes(greedy))} instructions); the random program shows {control}"


# ----------------------------------------------------------------------------
# The split threshold search, stage by stage
# ----------------------------------------------------------------------------

V_STAGES = 65536  # 8192 tokens a device on 1x8: groups of 64, 512 candidates, narrowed per 128 of them


def stage_logits() -> tuple[np.ndarray, np.ndarray]:
  """Rows [R, V_STAGES] whose top-k sets the split search settles at each of its stages, and their k.

  Noise ~N(0, 1) everywhere (below 6); the top tokens score 20 - 0.01 i (i-th of the row's k), all in
  device 0's slice of 8192 tokens, groups of 64 tokens, candidates narrowed per 32 groups (2048 tokens):
    0: k=50 spread over the whole vocabulary: the 8 largest of every 128 candidates settle it;
    1: k=20 at a stride of 128 tokens: 16 in one run of 32 groups, so it needs the 32 largest;
    2: k=40 at a stride of 32, two per group, all in one run: the 32 largest miss 8: bisection;
    3: k=10 in one group of 64 (which keeps 4 candidates): bisection.
  Rows 4.. repeat row 1 (70 rows in all, so that more than 64 rows need the second stage: its
  whole-batch branch runs too).
  """
  rng = np.random.default_rng(11)
  rows = 70
  x = rng.standard_normal((rows, V_STAGES)).astype(np.float32)
  layout = {0: (50, 1301), 1: (20, 128), 2: (40, 32), 3: (10, 1)}
  ks = np.empty(rows, np.int32)
  for r in range(rows):
    k, stride = layout[min(r, 1) if r > 3 else r]
    x[r, np.arange(k) * stride] = 20.0 - 0.01 * np.arange(k)
    ks[r] = k
  return x, ks


def _split_search(x, ks, mesh, search="xla", t=None, p=None, min_p=None):
  from specdec_jax.sampling import thresholds
  from specdec_jax.sampling.vocab_parallel import VocabShards, sharded_call

  shards = VocabShards("model", MESHES["1x8"][1], x.shape[-1], search=search)
  ones = jnp.ones(len(ks))
  t, p = ones if t is None else jnp.asarray(t), ones if p is None else jnp.asarray(p)
  k = jnp.asarray(ks)  # arrays: the search indexes them by traced rows
  with jax.set_mesh(mesh):
    fn = sharded_call(
      lambda a: thresholds.threshold_and_lse(a, t, k, p, shards=shards, min_p=min_p),
      (P(*[None] * (x.ndim - 1), "model"),),
      (P(), P()),
    )
    return [np.asarray(o) for o in jax.jit(fn)(x)]


@functools.cache
def _stage_sort() -> tuple[np.ndarray, np.ndarray]:
  """A full sort's thresholds and one device's log-normalisers of all of `stage_logits`' rows, computed once.

  Both stage checks compare with them (the Pallas one also on the first 10 rows): each row's values depend on
  that row alone, so the first R rows' are the first R of these. Computed eagerly, each costs seconds on 2
  cores (its `lax.cond`s compile at every call), so sharing them saves ~10 s of the worker."""
  from specdec_jax.sampling import thresholds

  x, ks = stage_logits()
  ones = jnp.ones(len(ks))
  want_thr = np.asarray(thresholds.sorted_threshold(x, jnp.asarray(ks), ones))
  want_lse = np.asarray(thresholds.threshold_and_lse(x, None, jnp.asarray(ks), ones)[1])
  return want_thr, want_lse


def _assert_split_search_equals_a_sort(rows, mesh, search="xla", label=""):
  """Asserts that the split search (`search`) of `stage_logits`' first `rows` rows with their top-k gives a full
  sort's thresholds and, to `_close`, its log-normalisers; returns the sort's thresholds (what a planted error is
  compared with)."""
  x_all, ks_all = stage_logits()
  x, ks = x_all[:rows], ks_all[:rows]
  want_thr, want_lse = (a[:rows] for a in _stage_sort())
  thr, lse = _split_search(x, ks, mesh, search=search)
  assert np.array_equal(thr, want_thr), f"{label}thresholds differ in rows {np.nonzero(thr != want_thr)[0][:8]}"
  ok, err = _close(lse, want_lse)
  assert ok, f"{label}log-normalisers differ by {err}"
  return want_thr


@contextlib.contextmanager
def _planted(**replacements):
  """`thresholds`' functions named in `replacements` replaced (a deliberately wrong search) inside the block;
  every compiled program is dropped on the way in and out, so that none mixes the wrong code with the right."""
  from specdec_jax.sampling import thresholds

  saved = {name: getattr(thresholds, name) for name in replacements}
  for name, fn in replacements.items():
    setattr(thresholds, name, fn)
  try:
    jax.clear_caches()
    yield
  finally:
    for name, fn in saved.items():
      setattr(thresholds, name, fn)
    jax.clear_caches()


def check_threshold_stages():
  """The split search's thresholds equal a full sort's at every stage, and each stage is needed."""
  from specdec_jax.sampling import thresholds

  x, ks = stage_logits()
  mesh = make_mesh(*MESHES["1x8"])
  want_thr = _assert_split_search_equals_a_sort(len(ks), mesh)
  # Teeth: without the redo stages only row 0 is right; without the last (bisection over the logits,
  # the redo whose operand is the device's whole slice) rows 1 and 4.. are still right: the second stage
  # settled them.
  redo = thresholds._redo_rows
  local = V_STAGES // MESHES["1x8"][1]
  planted = {}
  for name, skip in (("no redo", lambda op: True), ("no bisection", lambda op: op.shape[-1] == local)):
    with _planted(
      _redo_rows=lambda ok, results, op, *args, skip=skip, **kw: (
        results if skip(op) else redo(ok, results, op, *args, **kw)
      )
    ):
      planted[name] = _split_search(x, ks, mesh)[0] != want_thr
  wrong = planted["no redo"]
  assert not wrong[0] and wrong[1:].all(), f"no redo: rows wrong {np.nonzero(wrong)[0][:8]}"
  wrong = planted["no bisection"]
  assert wrong[2:4].all() and not wrong[:2].any() and not wrong[4:].any(), (
    f"no bisection: rows wrong {np.nonzero(wrong)[0][:8]}"
  )
  return f"{len(ks)} rows equal a sort; planted: no redo wrongs rows 1.., no bisection rows 2-3 only"


def check_threshold_stages_pallas():
  """The split search reading each slice with the Pallas kernel (interpreter): thresholds equal a sort's.

  Blocks of 2048 tokens keep 16 candidates each (32 blocks in all), so of `stage_logits`' rows 0 (spread) and
  3 (ten in one block) settle from the candidates, and rows 1, 2 and 4.. (more than 16 in block 0) do not. Their
  slices are read again as XLA's program reads them (groups of 64 keeping 4, narrowed to 32 of every 128),
  which settles rows 1 and 4.. but not row 2 (40 in one run of 32 groups): the bisection does. On all 70 rows
  (68 failing, more than the 64 the re-read takes one by one) the re-read leaves them all to the bisection's
  whole-batch branch; on the first 10 (8 failing) both take their rows one by one. Planted, on the 10 rows:
  without the bisection only row 2 is wrong (so the re-read settled rows 1 and 4..); with the re-read's
  thresholds off by one, rows 1 and 4.. are wrong (so its answers are used); without any redo, row 2 is wrong
  (rows 1 and 4.. happen to be right: their 20 tokens are all candidates, though these cannot vouch for it).
  """
  from specdec_jax.sampling import thresholds

  x_all, ks_all = stage_logits()
  mesh = make_mesh(*MESHES["1x8"])
  for rows in (70, 10):
    x, ks = x_all[:rows], ks_all[:rows]
    want_thr = _assert_split_search_equals_a_sort(rows, mesh, "pallas_interpret", label=f"{rows} rows: ")

  redo, reread = thresholds._redo_rows, thresholds._reread_rows

  def off_by_one(*args, **kw):
    thr, lse, exact = reread(*args, **kw)
    return thr + 1.0, lse, exact

  no_bisection = lambda ok, results, op, some, *a, **kw: (
    results if getattr(some, "__name__", "") == "bisect_rows" else redo(ok, results, op, some, *a, **kw)
  )
  planted = {}
  for name, patch in (
    ("no bisection", {"_redo_rows": no_bisection}),
    ("re-read off by one", {"_reread_rows": off_by_one}),
    ("no redo", {"_redo_rows": lambda ok, results, op, *args, **kw: results}),
  ):
    with _planted(**patch):
      planted[name] = _split_search(x, ks, mesh, search="pallas_interpret")[0] != want_thr
  expect = {
    "no bisection": [2],
    "re-read off by one": [1] + list(range(4, 10)),
    "no redo": [2],
  }
  for name, rows_wrong in expect.items():
    got = np.nonzero(planted[name])[0].tolist()
    assert got == rows_wrong, f"{name}: rows wrong {got}, expected {rows_wrong}"
  return "70 and 10 rows equal a sort; planted: no bisection wrongs row 2, a wrong re-read rows 1 and 4.."


def check_threshold_pallas_mixed_rows():
  """The Pallas-read split search against one device on rows that mix every filter and temperature.

  Language-model-like logits (a Gaussian tail, a few lifted tokens, some NaN); per row top-k (off, 40, and
  one between a slice's width and V, which only the whole vocabulary makes a filter), top-p, min-p and
  temperatures from greedy to 2; two flat rows whose top-p (and top-k 3000) keep thousands of tokens, which
  only the bisection settles. Thresholds equal one device's search bit for bit, normalisers to 1e-5.
  """
  from specdec_jax.sampling import thresholds

  rng = np.random.default_rng(5)
  rows = 14
  x = (2.0 * rng.standard_normal((rows, 3, V_STAGES))).astype(np.float32)
  x[rng.random(x.shape) < 3e-4] += 9.0
  x[rng.random(x.shape) < 1e-4] = np.nan
  x[12:] = (0.01 * rng.standard_normal(x[12:].shape)).astype(np.float32)  # flat: only the bisection settles these
  ks = np.array([0, 40, 40, 0, 9000, 40, 0, 0, 1, 40, 0, 65536, 0, 3000], np.int32)
  ps = np.array([1.0, 1.0, 0.9, 0.8, 1.0, 0.95, 1.0, 1.0, 1.0, 0.5, 0.9, 1.0, 0.5, 0.7], np.float32)
  mp = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.05, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], np.float32)
  ts = np.array([1.0, 0.7, 1.0, 2.0, 1.0, 1.0, 0.5, 0.0, 1.0, 1.3, 0.0, 1.0, 1.0, 0.8], np.float32)
  args = (jnp.asarray(ts), jnp.asarray(ks), jnp.asarray(ps))
  want_thr, want_lse = (np.asarray(a) for a in thresholds.threshold_and_lse(x, *args, min_p=jnp.asarray(mp)))
  mesh = make_mesh(*MESHES["1x8"])
  thr, lse = _split_search(x, ks, mesh, search="pallas_interpret", t=ts, p=ps, min_p=jnp.asarray(mp))
  same = (thr == want_thr) | (np.isnan(thr) & np.isnan(want_thr))
  assert same.all(), f"thresholds differ at {np.argwhere(~same)[:6].tolist()}"
  ok, err = _close(lse, want_lse)
  assert ok, f"log-normalisers differ by {err}"
  filtered = int(np.isfinite(want_thr).sum())
  assert filtered >= 15, f"only {filtered} of {want_thr.size} positions filter: the rows test too little"
  return f"{want_thr.size} positions ({filtered} filtered) equal one device's"


# ----------------------------------------------------------------------------
# The checks
# ----------------------------------------------------------------------------


def _explicit_mesh():
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  assert all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types), mesh.axis_types
  return mesh


def check_sizes():
  assert all(qualifies(V, m) and qualifies(V_HLO, m) for m in (2, 4, 8)), "V or V_HLO does not qualify"
  assert qualifies(V_SMALL, 4) and not qualifies(V_SMALL, 8), "V_SMALL must qualify on 4 devices, not on 8"
  return f"chunk_size: {V} -> {chunk_size(V)}, {V_SMALL} -> {chunk_size(V_SMALL)}, {V_HLO} -> {chunk_size(V_HLO)}"


MORE_MESHES = ("4x2", "8x1")  # `--part more-meshes`; `--part fast` leaves them out


def in_more_meshes_part(mesh_name: str, name: str) -> bool:
  """Whether the rejection_sample check (mesh, program) belongs to `--part more-meshes`: every program on 4x2
  and 8x1, and on 1x8 all but the greedy flag (2x4 runs every program in the fast part, its rows split too)."""
  return mesh_name in MORE_MESHES or (mesh_name == "1x8" and name != "greedy flag")


def checks(part: str = "all") -> dict:
  """name -> function returning a detail string (ok) or raising; `part` as in the module docstring."""
  out = {"vocabulary sizes": check_sizes} if part != "more-meshes" else {}
  for mesh_name in MESHES:
    for name in REJECTION:
      if mesh_name == "8x1" and name not in ON_8X1:
        continue
      if part != "all" and in_more_meshes_part(mesh_name, name) != (part == "more-meshes"):
        continue
      for dataset in DATASETS[name]:
        if dataset in FILTERED and mesh_name not in FILTERED_MESHES:
          continue
        out[f"{mesh_name} {name}: {dataset}"] = lambda n=name, d=dataset, mn=mesh_name: check_equal(n, d, mn)
  if part == "more-meshes":
    return out
  for mesh_name in ("1x8", "2x4"):
    for name in SAMPLE:
      for dataset in DATASETS[name]:
        out[f"{mesh_name} {name}: {dataset}"] = lambda n=name, d=dataset, mn=mesh_name: check_equal(n, d, mn)
  for mesh_name, label, sets in (
    ("2x4", "sharded", ("mixed", "filtered")),
    ("1x8", "fallback: not whole chunks", ("mixed",)),
  ):
    for dataset in sets:
      out[f"V={V_SMALL} {mesh_name} ({label}) token, draft probs: {dataset}"] = lambda d=dataset, mn=mesh_name: (
        check_equal("token, draft probs", d, mn, v=V_SMALL, rows=False)
      )
  for name, dataset in (("token, draft probs", "mixed"), ("greedy flag", "greedy")):
    out[f"explicit 2x4 {name}: {dataset}"] = lambda n=name, d=dataset: check_equal(
      n, d, "explicit 2x4", mesh=_explicit_mesh()
    )
  out.update(
    {
      "teeth: rolled draft_probs change the outputs": teeth_rolled_probs,
      "teeth: another key changes the outputs": teeth_other_key,
      "teeth: dropping any one vocabulary slice changes the outputs (draft probs)": lambda: _each_slice(
        "token, draft probs", "mixed", lambda s: np.full_like(s, -np.inf)
      ),
      "teeth: dropping any one vocabulary slice changes the outputs (greedy flag)": lambda: _each_slice(
        "greedy flag", "greedy", lambda s: np.full_like(s, -np.inf)
      ),
      "teeth: doubling any one slice's mass moves the logprobs": lambda: _each_slice(
        "token, n-gram, logprobs=processed", "mixed", lambda s: s + np.float32(np.log(2))
      ),
      "teeth: doubling any one slice's mass moves sample_tokens' log_probs": lambda: _each_slice(
        "sample_tokens", "mixed", lambda s: s + np.float32(np.log(2))
      ),
    }
  )
  for mesh_name in ("2x4", "1x8"):
    for name in ("token, draft probs", "greedy flag"):
      out[f"HLO {mesh_name} {name}: no collective carries the vocabulary"] = lambda n=name, mn=mesh_name: (
        check_no_vocab_collective(n, mn)
      )
    out[f"HLO {mesh_name} greedy flag: no exponential, no RNG"] = lambda mn=mesh_name: check_greedy_no_random(mn)
  out["split threshold search: every stage exact, each needed"] = check_threshold_stages
  out["split threshold search, Pallas read: every stage exact, each needed"] = check_threshold_stages_pallas
  out["split threshold search, Pallas read: mixed rows equal one device"] = check_threshold_pallas_mixed_rows
  out["HLO one device: no collective"] = check_one_device_no_collective
  out["HLO one device greedy flag: no exponential, no RNG"] = lambda: check_greedy_no_random(None, V)
  return out


def main(part: str = "all") -> dict[str, dict]:
  return run_checks(checks(part))


if __name__ == "__main__":
  exit_unless_devices(NUM_DEVICES)
  begin = time.perf_counter()
  res = main(part_arg(sys.argv[1:]))
  compile_total = sum(COMPILE_SECONDS.values())
  print(
    f"mesh_sampler_worker: {time.perf_counter() - begin:.1f} s, {len(COMPILE_SECONDS)} compiles "
    f"({compile_total:.1f} s)",
    file=sys.stderr,
  )
  print(json.dumps(res))
