"""Shared test helpers: chi-square checks, float64 references, HLO inspection.

Three groups, importable from any test file (`from tests.support.stats import ...`):

* Goodness of fit. `chisquare_gof` compares samples with expected probabilities:
  an outcome of probability 0 that occurs fails outright, bins with an expected
  count below 5 are merged, and `scipy.stats.chisquare` gives the p-value.
  `assert_gof` fails when p < ALPHA = 1e-3. `detectable_deviation` says how
  large a deviation a test of N samples detects at 80% power.
* NumPy float64 references of the contract (docs/api.md "SamplingParams",
  "rejection_sample"), written from the text and sharing no code with
  `specdec_jax`: `reference_probs` (temperature, top-k, top-p with ties kept,
  row by row through tests/support/sampling_reference.py, the one reference of
  the processing step) and `greedy_reference` (greedy verification).
* `HloProgram`: the opcodes and call graph of a compiled program's text, to
  assert that a program holds no exponential, random bits or sort.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import scipy.optimize
import scipy.stats

from tests.support import sampling_reference

# Significance level of every statistical test: a correct sampler fails a given
# check with probability 1e-3 (seeds are fixed, so a passing test stays passing).
ALPHA = 1e-3

# A chi-square bin needs an expected count of at least this many samples.
MIN_EXPECTED = 5.0

# ----------------------------------------------------------------------------
# Chi-square goodness of fit
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GofResult:
  """The outcome of one goodness-of-fit test."""

  pvalue: float
  statistic: float
  num_samples: int
  num_bins: int  # after merging sparse bins
  impossible: int  # samples that landed on outcomes of probability 0
  label: str = ""

  def __str__(self) -> str:
    return (
      f"{self.label}: p={self.pvalue:.3g} chi2={self.statistic:.4g} N={self.num_samples} "
      f"bins={self.num_bins} impossible={self.impossible}"
    )


def merge_sparse_bins(observed, expected, min_expected: float = MIN_EXPECTED):
  """Pools the bins of smallest expected count until each has >= min_expected.

  Bins are taken in increasing order of expected count and pooled until the pool
  reaches `min_expected`; a pool left short at the end joins the smallest
  full bin. Totals are preserved.

  Args:
    observed: counts [n].
    expected: expected counts [n], all > 0.
    min_expected: the smallest expected count a bin may keep.

  Returns:
    (observed, expected) of the merged bins, float64.
  """
  observed = np.asarray(observed, np.float64)
  expected = np.asarray(expected, np.float64)
  order = np.argsort(expected, kind="stable")
  obs, exp = [], []
  pool_o = pool_e = 0.0
  for i in order:
    if expected[i] >= min_expected and pool_e == 0.0:
      obs.append(observed[i])
      exp.append(expected[i])
      continue
    pool_o += observed[i]
    pool_e += expected[i]
    if pool_e >= min_expected:
      obs.append(pool_o)
      exp.append(pool_e)
      pool_o = pool_e = 0.0
  if pool_e > 0.0:
    if obs:
      j = int(np.argmin(exp))
      obs[j] += pool_o
      exp[j] += pool_e
    else:
      obs.append(pool_o)
      exp.append(pool_e)
  return np.asarray(obs), np.asarray(exp)


def chisquare_gof(samples, probs, *, label: str = "", min_expected: float = MIN_EXPECTED) -> GofResult:
  """Chi-square goodness of fit of integer samples to a distribution.

  Args:
    samples: int [N] outcomes in [0, len(probs)).
    probs: [V] expected probabilities (normalised here; they must sum to ~1).
    label: carried into the result for messages.
    min_expected: sparse-bin threshold.

  Returns:
    A GofResult. pvalue is 0 if any sample is out of range or lands on an
    outcome of probability 0; 1 if there are too few samples to test (the
    caller should check `num_bins`).
  """
  probs = np.asarray(probs, np.float64)
  if abs(probs.sum() - 1.0) > 1e-6:
    raise ValueError(f"chisquare_gof: probabilities sum to {probs.sum()}, not 1")
  probs = probs / probs.sum()
  samples = np.asarray(samples).reshape(-1)
  n = samples.size
  out_of_range = int(np.sum((samples < 0) | (samples >= probs.size)))
  if out_of_range:
    return GofResult(0.0, np.inf, n, 0, out_of_range, label)
  counts = np.bincount(samples, minlength=probs.size)
  impossible = int(counts[probs == 0].sum())
  if impossible:
    return GofResult(0.0, np.inf, n, 0, impossible, label)
  obs, exp = merge_sparse_bins(counts[probs > 0], n * probs[probs > 0], min_expected)
  if obs.size < 2:
    return GofResult(1.0, 0.0, n, int(obs.size), 0, label)
  res = scipy.stats.chisquare(obs, exp)
  return GofResult(float(res.pvalue), float(res.statistic), n, int(obs.size), 0, label)


def assert_gof(results, alpha: float = ALPHA, min_bins: int = 2) -> None:
  """Fails unless every result has p >= alpha and at least `min_bins` bins."""
  results = [results] if isinstance(results, GofResult) else list(results)
  bad = [r for r in results if r.pvalue < alpha or r.num_bins < min_bins]
  assert not bad, "chi-square goodness of fit rejected (alpha=%g):\n  %s\nall:\n  %s" % (
    alpha,
    "\n  ".join(map(str, bad)),
    "\n  ".join(map(str, results)),
  )


def detectable_deviation(num_samples: int, num_bins: int, alpha: float = ALPHA, power: float = 0.8):
  """The smallest deviation a chi-square test detects with the given power.

  Under an alternative q, the statistic is approximately noncentral chi-square
  with df = num_bins - 1 and noncentrality lambda = N * w^2, where
  w^2 = sum_i (q_i - p_i)^2 / p_i (Cohen's w). Since TV(p, q) <= w / 2 by
  Cauchy-Schwarz, every alternative with TV >= w_min / 2 is detected with at
  least `power` (smaller TV deviations may be detected too, if concentrated on
  rare outcomes).

  Returns:
    (w_min, tv_min): Cohen's w and the total-variation distance detected at
    `power` by N samples over `num_bins` bins at level `alpha`.
  """
  df = num_bins - 1
  crit = scipy.stats.chi2.isf(alpha, df)
  lam = scipy.optimize.brentq(lambda l: scipy.stats.ncx2.sf(crit, df, l) - power, 1e-9, 1e6)
  w = float(np.sqrt(lam / num_samples))
  return w, w / 2


def chisquare_two_sample(samples_a, samples_b, num_outcomes: int, *, label: str = "") -> GofResult:
  """Chi-square test that two samples come from one distribution.

  Outcomes whose pooled expected count is below 5 in either sample are merged
  (by increasing pooled frequency), then `scipy.stats.chi2_contingency`.
  """
  a = np.bincount(np.asarray(samples_a).reshape(-1), minlength=num_outcomes).astype(np.float64)
  b = np.bincount(np.asarray(samples_b).reshape(-1), minlength=num_outcomes).astype(np.float64)
  na, nb = a.sum(), b.sum()
  pooled = a + b
  keep = pooled > 0
  a, b, pooled = a[keep], b[keep], pooled[keep]
  # Merge on the smaller sample's expected counts so both rows have >= 5 expected.
  scale = min(na, nb) / (na + nb)
  order = np.argsort(pooled, kind="stable")
  rows, pool = [], np.zeros(2)
  pool_e = 0.0
  for i in order:
    pool += (a[i], b[i])
    pool_e += pooled[i] * scale
    if pool_e >= MIN_EXPECTED:
      rows.append(pool.copy())
      pool[:], pool_e = 0.0, 0.0
  if pool_e > 0 and rows:
    rows[-1] += pool
  elif pool_e > 0:
    rows.append(pool.copy())
  table = np.asarray(rows).T
  if table.shape[1] < 2:
    return GofResult(1.0, 0.0, int(na + nb), int(table.shape[1]), 0, label)
  res = scipy.stats.chi2_contingency(table, correction=False)
  return GofResult(float(res.pvalue), float(res.statistic), int(na + nb), int(table.shape[1]), 0, label)


# ----------------------------------------------------------------------------
# Float64 references of the contract
# ----------------------------------------------------------------------------


def reference_probs(logits, temperature: float, top_k: int = 0, top_p: float = 1.0, *, boundary_tol: float = 0.0):
  """The processed target distribution of one random request, in float64, for every row of `logits`.

  The contract's temperature, top-k and top-p (ties with the k-th and with the
  last token of the top-p set kept) come from the one NumPy reference,
  `sampling_reference.filtered_probs`; this applies it row by row.

  Args:
    logits: [..., V] floats (already rounded to the input dtype, e.g. bf16).
    temperature: > 0.
    top_k: int >= 0.
    top_p: in (0, 1].
    boundary_tol: when > 0, also return a bool [...] that marks rows whose
      cumulative top-p mass comes within this distance of top_p, where float32
      rounding could legitimately choose the other set.

  Returns:
    float64 [..., V] probabilities (and the boundary mask if boundary_tol > 0).
  """
  x = np.asarray(logits, np.float64)
  lead, v = x.shape[:-1], x.shape[-1]
  rows = x.reshape(-1, v)
  probs = np.stack(
    [sampling_reference.filtered_probs(row, temperature=temperature, top_k=top_k, top_p=top_p) for row in rows]
  ).reshape(lead + (v,))
  if boundary_tol <= 0:
    return probs
  near = np.zeros(rows.shape[0], bool)
  if top_p < 1.0:
    for r, row in enumerate(rows):  # the mass before top-p, largest first
      top_k_probs = sampling_reference.filtered_probs(row, temperature=temperature, top_k=top_k)
      cum = np.cumsum(np.sort(top_k_probs)[::-1])
      near[r] = bool(np.any(np.abs(cum - np.float32(top_p)) < boundary_tol))
  return probs, near.reshape(lead)


def residual_probs(p, q):
  """normalise(max(p - q, 0)), or p if the residual has no mass."""
  r = np.maximum(np.asarray(p, np.float64) - np.asarray(q, np.float64), 0.0)
  return r / r.sum() if r.sum() > 0 else np.asarray(p, np.float64)


def greedy_reference(draft_token_ids, target_logits, num_draft_tokens=None):
  """Greedy verification in NumPy: (token_ids [B, K+1], num_accepted [B]).

  t_i = argmax(target_logits[b, i]) (first index on ties); emit t_0, t_1, ...
  while draft_token_ids[b, i] == t_i for i < n; the first mismatch or position n
  emits its t_i and ends the row; -1 after.
  """
  draft = np.asarray(draft_token_ids)
  t = np.argmax(np.asarray(target_logits, np.float32), axis=-1)
  b, k = draft.shape
  n = np.full(b, k) if num_draft_tokens is None else np.asarray(num_draft_tokens)
  out = np.full((b, k + 1), -1, np.int64)
  acc = np.zeros(b, np.int64)
  for r in range(b):
    a = 0
    while a < n[r] and draft[r, a] == t[r, a]:
      out[r, a] = draft[r, a]
      a += 1
    out[r, a] = t[r, a]
    acc[r] = a
  return out, acc


# ----------------------------------------------------------------------------
# Compiled-program inspection
# ----------------------------------------------------------------------------

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\([^=]*?\)|\S+)\s+([a-z][\w\-]*)\((.*)$")
_COMP_HEAD = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_CALLEE = re.compile(
  r"\b(calls|to_apply|true_computation|false_computation|condition|body|branch_computations)="
  r"(\{[^}]*\}|%[\w.\-]+)"
)

# Opcodes of random-bit generation: XLA's RNG ops, and the integer mixing
# (xor/shifts) that JAX's threefry lowers to.
RANDOM_OPCODES = frozenset(
  {"rng", "rng-bit-generator", "rng-get-and-update-state", "xor", "shift-left", "shift-right-logical"}
)


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  shape: str  # the result type as printed, e.g. "f32[3,5,37]{2,1,0}" or a tuple
  opcode: str
  rest: str  # operands and attributes

  def callees(self):
    for m in _CALLEE.finditer(self.rest):
      for name in re.findall(r"%([\w.\-]+)", m.group(2)):
        yield m.group(1), name


class HloProgram:
  """Opcodes and call graph of `jax.jit(f).lower(...).compile().as_text()`.

  Example:
    >>> prog = HloProgram(jax.jit(f).lower(x).compile().as_text())
    >>> "exponential" in prog.opcodes()
  """

  def __init__(self, text: str):
    self.text = text
    self.computations: dict[str, list[Instruction]] = {}
    self.entry = None
    current = None
    for line in text.splitlines():
      if current is None:
        m = _COMP_HEAD.match(line)
        if m and not line.startswith("HloModule"):
          current = m.group(2)
          self.computations[current] = []
          if m.group(1):
            self.entry = current
        continue
      if line.strip() == "}":
        current = None
        continue
      m = _INSTR.match(line)
      if m:
        self.computations[current].append(Instruction(*m.groups()))
    if self.entry is None or not any(self.computations.values()):
      raise ValueError("HloProgram: could not parse the program text")

  def reachable(self, root=None, *, through_conditionals: bool = True) -> set[str]:
    """Computations reachable from `root` (default ENTRY) through calls.

    With through_conditionals=False, branches of `conditional` instructions are
    not followed: what remains always runs.
    """
    seen, stack = set(), [root or self.entry]
    while stack:
      c = stack.pop()
      if c in seen:
        continue
      seen.add(c)
      for ins in self.computations[c]:
        if ins.opcode == "conditional" and not through_conditionals:
          continue
        stack.extend(name for _, name in ins.callees())
    return seen

  def instructions(self, computations=None):
    names = self.computations if computations is None else computations
    return [ins for c in names for ins in self.computations[c]]

  def opcodes(self, computations=None) -> set[str]:
    return {ins.opcode for ins in self.instructions(computations)}

  def op_names(self) -> list[str]:
    """The JAX operation paths recorded in the metadata (e.g. ".../threefry2x32")."""
    return re.findall(r'op_name="([^"]*)"', self.text)

  def mentions(self, marker: str) -> bool:
    """Whether any operation path contains `marker` (case-insensitive).

    Only op_name metadata is searched: the stack-frame table also printed with
    the program holds test function names, which may say anything.
    """
    return any(marker.lower() in name.lower() for name in self.op_names())

  def conditionals(self, computations=None):
    """[(instruction, [branch computation names])] of conditional instructions."""
    return [
      (ins, [name for _, name in ins.callees()])
      for ins in self.instructions(computations)
      if ins.opcode == "conditional"
    ]
