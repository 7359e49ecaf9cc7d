"""The chain verifier's plan (`verify.plan`): every combination of the static switches, enumerated.

Invariants of the plans (not of XLA's instruction selection): the greedy-only
program holds no random path; the no-filters promise compiles no filter pass,
no overflow redo and no branch on filters; every path of the table is held by
some plan, and every plan's paths are in the table. Plus: the plan a call makes
is the one `rejection_sample` traces with, and the position-statistics plan
matches the passes `position_stats` runs.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import SamplingParams, rejection_sample
from specdec_jax.sampling import stats as stats_module
from specdec_jax.verify import chain, plan

VOCABS = (96, 4096, 1000)  # below one chunk, a multiple of the chunk size, not a multiple


def _params(min_p, options, no_filters):
  p = SamplingParams.create(1.0, min_p=0.1 if min_p else None, repetition_penalty=1.2 if options else None)
  return p.promise_no_filters() if no_filters else p


def all_plans():
  """(switches, plan) for every combination of the static switches."""
  for (
    all_greedy,
    all_random,
    no_filters,
    min_p,
    options,
    draft_probs,
    logprobs,
    method,
    v,
    sharded,
    kernels,
  ) in itertools.product(
    (False, True),
    (False, True),
    (False, True),
    (False, True),
    (False, True),
    (False, True),
    (None, "raw", "processed"),
    ("token", "block"),
    VOCABS,
    (False, True),
    ("xla", "pallas"),
  ):
    if all_greedy and all_random:
      continue
    if sharded and v % 2048:  # shards_for splits only vocabularies of whole chunks per device
      continue
    switches = dict(
      all_greedy=all_greedy,
      all_random=all_random,
      no_filters=no_filters,
      min_p=min_p,
      options=options,
      draft_probs=draft_probs,
      logprobs=logprobs,
      method=method,
      v=v,
      sharded=sharded,
      kernels=kernels,
    )
    make = lambda: plan.chain_plan(
      _params(min_p, options, no_filters),
      vocab=v,
      local_vocab=v // 2 if sharded else v,
      draft_probs=draft_probs,
      all_greedy=all_greedy,
      all_random=all_random,
      logprobs=logprobs,
      method=method,
      sharded=sharded,
      kernels=kernels,
    )
    if kernels == "pallas" and plan.pallas_uncovered(
      _params(min_p, options, no_filters), logprobs, sharded, greedy=all_greedy
    ):
      with pytest.raises(ValueError, match="kernels='pallas' does not cover"):
        make()
      continue
    yield switches, make()


PLANS = list(all_plans())
TABLE = {p.name for p in plan.sampler_paths()}


def test_the_table_is_data_with_distinct_names():
  rows = plan.sampler_paths()
  assert len({r.name for r in rows}) == len(rows)
  assert all(r.taken_when and r.reads for r in rows)


def test_every_plan_path_is_in_the_table_and_every_table_path_is_reachable():
  held = set()
  for _, p in PLANS:
    assert set(p.paths()) <= TABLE, p
    held |= set(p.paths())
  assert held == TABLE, TABLE - held


def test_plans_are_hashable_and_equal_for_equal_switches():
  for (sw, p), (_, q) in zip(PLANS, all_plans()):
    assert p == q and hash(p) == hash(q), sw


@pytest.mark.parametrize("switches, p", PLANS[::7])
def test_plan_invariants(switches, p):
  names = set(p.paths())
  if switches["kernels"] == "pallas":
    # The Pallas programs: one greedy program, or the fused one, with the filter search unless promised away.
    if switches["all_greedy"]:
      assert names == {"pallas greedy"} and not p.uses_random_numbers
    else:
      assert names == ({"pallas"} if switches["no_filters"] else {"pallas", "pallas threshold search"})
    return
  if switches["all_greedy"]:
    # The greedy program: no exponential, no random numbers, no statistics pass, no draw.
    assert p.verifier == plan.GREEDY_VERIFIER and not p.uses_random_numbers
    assert p.stats is None and p.draw is None
    assert names <= {"greedy", "bias / penalties", "logprobs raw", "logprobs processed"}
  else:
    assert p.uses_random_numbers and "general" in names
  if switches["all_random"]:
    assert "greedy" not in names and not p.argmax
  if switches["no_filters"] and p.stats is not None:
    assert p.stats.passes == (stats_module.NO_FILTERS_PASS,)
    assert not names & {"threshold search", "min-p only", "plain pass", "overflow redo"}
    assert p.draw in (plan.CHUNK_DRAW, plan.ROW_DRAW_WITH_FALLBACK, plan.ROW_DRAW)
  if switches["draft_probs"] and p.draw is not None:
    assert p.draw in (plan.ROW_DRAW, plan.ROW_DRAW_WITH_FALLBACK)
  if not switches["min_p"]:
    assert "min-p only" not in names
  assert ("bias / penalties" in names) == switches["options"]
  assert ("block residual pass" in names) == (
    switches["method"] == "block" and switches["draft_probs"] and not switches["all_greedy"]
  )


def test_every_plan_in_the_enumeration_is_checked():
  # The parametrised invariants sample the plans; here every plan gets the cheap ones.
  for switches, p in PLANS:
    if switches["all_greedy"]:
      assert not p.uses_random_numbers and p.paths()[0] == ("greedy" if p.kernels == "xla" else "pallas greedy")
    if switches["no_filters"] and p.stats is not None:
      assert "threshold search" not in p.paths() and "overflow redo" not in p.paths()


@pytest.mark.parametrize(
  "flags",
  [dict(all_greedy=True), dict(all_random=True), {}, dict(no_filters=True), dict(method="block", logprobs="raw")],
)
def test_rejection_sample_traces_with_the_plan_chain_plan_makes(monkeypatch, flags):
  seen = []
  original = chain._program

  def spy(*args, plan, shards):
    seen.append(plan)
    return original(*args, plan=plan, shards=shards)

  monkeypatch.setattr(chain, "_program", spy)
  chain._rejection_sample.clear_cache()  # traced again: the spy sees the plan (the other jits keep their programs)
  b, k, v = 2, 2, 96
  params = SamplingParams.greedy(b) if flags.get("all_greedy") else SamplingParams.create([1.0, 0.5])
  key = None if flags.get("all_greedy") else jax.random.key(0)
  logits = np.random.default_rng(0).normal(size=(b, k + 1, v)).astype(np.float32)
  rejection_sample(jnp.zeros((b, k), jnp.int32), logits, params, key, **flags)
  want_params = params.promise_no_filters() if flags.get("no_filters") else params
  flags.pop("no_filters", None)
  assert seen == [plan.chain_plan(want_params, vocab=v, local_vocab=v, **flags)]


@pytest.mark.parametrize("min_p, no_filters", [(False, False), (True, False), (False, True)])
def test_position_stats_holds_the_passes_its_plan_names(monkeypatch, min_p, no_filters):
  ran = []
  for name, fn in list(stats_module._PASSES.items()):
    monkeypatch.setitem(
      stats_module._PASSES, name, lambda raw, _fn=fn, _name=name, **kw: (ran.append(_name), _fn(raw, **kw))[1]
    )
  params = _params(min_p, False, no_filters)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 96)).astype(np.float32))
  stats_module.position_stats(x, params)
  want = stats_module.stats_plan(params, 96, greedy_rows=False, argmax=False, chunks=False).passes
  # lax.cond and lax.switch trace every branch once.
  assert sorted(ran) == ([] if no_filters else sorted(want)), ran
