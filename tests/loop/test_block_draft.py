"""Tests of the block drafter in the loop (`specdec_jax.models.BlockDrafter`, `specdec_jax.loop.draft_kinds.BlockDraft`).

A block drafter gives all K drafts' logits from one call. The drafters here are tiny and either random or distilled
for 80 steps on the tiny target's greedy continuations (`distil_block`), so that rounds accept some of their drafts
and reject the rest (ragged acceptance).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specdec_jax.drafts.dynamic_tree import DynamicTree
from specdec_jax.loop import draft_kinds
from specdec_jax.loop.decoding import generate, speculative_generate
from specdec_jax.models import BlockDrafter, EagleDrafter
from specdec_jax.sampling.params import SamplingParams
from tests.loop.grammar_fixtures import host_walk, random_grammar
from tests.support.compiles import count_compiles
from tests.support.lossless import assert_first_tokens_follow, assert_sampled_tree_follows, first_tokens_run
from tests.support.planted import accept_first_children
from tests.support.tiny_lm import check_output, make_prompts
from tests.support.tiny_transformers import V, distil_block, greedy_case, sampled_tree_case, unit_target


@functools.cache
def _models():
  """(target, an untrained block drafter, one distilled for K=4), built once per process."""
  target = unit_target()
  untrained = BlockDrafter.for_target(target, block_size=4, rngs=nnx.Rngs(1))
  trained = distil_block(target, BlockDrafter.for_target(target, block_size=4, rngs=nnx.Rngs(3)), k=4)
  return target, untrained, trained


@pytest.mark.parametrize("k", [1, 3, 4])
def test_greedy_block_drafter_equals_generate(k):
  """Ragged prompts, an EOS inside rounds, max_new_tokens cutting a round: plain greedy decoding's tokens, with
  an untrained drafter (nearly every draft rejected) and a distilled one (rounds accept some drafts, reject the
  rest)."""
  target, untrained, trained = _models()
  prompts, lengths, params, kw, plain = greedy_case(target)
  accepted = []
  for drafter in (untrained, trained):
    out = speculative_generate(target, drafter, prompts, lengths, params, None, num_speculative_tokens=k, **kw)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    np.testing.assert_array_equal(out.lengths, plain.lengths)
    check_output(out, 15, k, eos=(kw["eos_token_id"],))
    accepted.append(np.asarray(out.stats.accepted_per_position))
  assert accepted[1].sum() > accepted[0].sum(), accepted
  if k > 1:  # ragged: later positions are reached and accepted less often than the first
    assert 0 < accepted[1][-1] < accepted[1][0], accepted[1]


def test_a_distilled_block_drafter_accepts_several_drafts_a_round():
  """The one call's K logits are the right positions' (a drafter whose placeholders were misplaced by one
  position would agree with the target at the first draft only)."""
  target, _, trained = _models()
  prompts, lengths = make_prompts(1, V, [6, 3, 1, 4], 6)
  params = SamplingParams.greedy(4)
  out = speculative_generate(
    target, trained, prompts, lengths, params, None, max_new_tokens=20, num_speculative_tokens=4, all_greedy=True
  )
  per_position = np.asarray(out.stats.accepted_per_position)
  assert float(out.stats.mean_accepted_length) > 2.0, per_position
  assert per_position[2] > 0 and per_position[3] > 0, per_position


@functools.cache
def _sampled_case():
  """The sampled tree tests' case (N_ROWS copies of one prompt, T=0.8, top-k 6, the exact joint law of the first
  3 tokens) with a block drafter distilled for its target."""
  target, _, prompts, lengths, params, joint = sampled_tree_case("model")
  drafter = distil_block(target, BlockDrafter.for_target(target, block_size=2, rngs=nnx.Rngs(5)), k=2)
  return target, drafter, prompts, lengths, params, joint


def _rolled_q_propose(self, carry, state, keys, params, **kw):
  """A planted bug: the drafts are drawn from each position's law, but the verifier is told the next
  position's law as q (the block's logits read one entry off)."""
  drafts = draft_kinds.BlockDraft.__dict__["_correct_propose"](self, carry, state, keys, params, **kw)
  return drafts._replace(probs=None if drafts.probs is None else jnp.roll(drafts.probs, 1, axis=1))


def test_sampled_block_drafter_is_lossless(monkeypatch):
  """The first 3 tokens of N rows follow the target's exact joint, with the block drafter's probabilities in
  play (K=2, max_new_tokens=4: the third token comes from the first round or from a second round's window);
  alpha = 1e-3, a fixed seed, power asserted by `assert_first_tokens_follow`. A planted loop that tells the
  verifier the wrong position's law as q is rejected."""
  target, drafter, prompts, lengths, params, joint = _sampled_case()

  run = first_tokens_run(target, drafter, prompts, lengths, params, 7, max_new_tokens=4)

  monkeypatch.setattr(draft_kinds.BlockDraft, "_correct_propose", draft_kinds.BlockDraft.propose_chain, raising=False)
  out = assert_first_tokens_follow(
    run,
    joint,
    monkeypatch,
    "block drafter speculative_generate, first 3 tokens",
    planted=(draft_kinds.BlockDraft, "propose_chain", _rolled_q_propose),
  )
  check_output(out, 4, 2)
  assert 0.05 < float(out.stats.usable_acceptance_rate) < 0.95  # drafts are accepted and rejected


def test_no_recompilation_for_new_prompts_and_keys():
  target, _, trained = _models()

  def call(seed):
    prompts, lengths = make_prompts(seed, V, [4, 1, 3, 2], 4)
    params = SamplingParams.create(jnp.asarray([0.0, 1.0, 0.7, 1.0], jnp.float32))
    out = speculative_generate(
      target, trained, prompts, lengths, params, jax.random.key(seed), max_new_tokens=8, num_speculative_tokens=3
    )
    check_output(out, 8, 3)

  call(0)
  with count_compiles("_speculative_jit") as compiled:
    for seed in (1, 2):
      call(seed)
  assert not compiled, compiled


@pytest.mark.parametrize("tree", [(2, 2, 1), DynamicTree(3, 3, 6)], ids=["static", "dynamic"])
def test_greedy_block_drafter_trees_equal_generate(tree):
  """DDTree: every node of depth i drafts its children from position i's logits, static and dynamic trees, one
  drafter call a round. Ragged prompts, an EOS inside rounds, max_new_tokens cutting a round: plain greedy
  decoding's tokens; the distilled drafter's trees are accepted beyond the first depth."""
  target, _, trained = _models()
  prompts, lengths, params, kw, plain = greedy_case(target)
  k = len(tree) if isinstance(tree, tuple) else tree.depth
  out = speculative_generate(
    target, trained, prompts, lengths, params, None, num_speculative_tokens=k, draft_tree=tree, **kw
  )
  np.testing.assert_array_equal(out.tokens, plain.tokens)
  np.testing.assert_array_equal(out.lengths, plain.lengths)
  check_output(out, 15, k, eos=(kw["eos_token_id"],))
  assert float(out.stats.mean_accepted_length) > 1.5, float(out.stats.mean_accepted_length)


@pytest.mark.slow  # the chain's sampled test above stays in the fast subset
def test_sampled_block_drafter_tree_is_lossless(monkeypatch):
  """The first 3 tokens of N rows follow the target's exact joint with a sampled (3, 2) tree of block drafts
  (siblings drawn without replacement from each position's law and verified with it); accepting the first
  child at every depth is rejected."""
  assert_sampled_tree_follows(
    _sampled_case(), (3, 2), monkeypatch, "block drafter tree (3, 2), first 3 tokens", accept_first_children
  )


def test_block_drafter_refuses_bad_arguments():
  target, _, _ = _models()
  with pytest.raises(ValueError, match="block_size must be an int >= 1"):
    BlockDrafter(EagleDrafter.for_target(target, rngs=nnx.Rngs(0)), block_size=0, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="backbone must be an EagleDrafter"):
    BlockDrafter(target, block_size=4, rngs=nnx.Rngs(0))


def test_constrained_greedy_block_drafter_equals_constrained_generate():
  """With a grammar every row follows it, and greedy constrained speculative decoding with the block drafter
  emits constrained plain decoding's tokens (each draft is drawn under the state its earlier drafts reach)."""
  target, _, trained = _models()
  grammar = random_grammar(2, V, num_states=5, density=0.6)
  prompts, lengths = make_prompts(3, V, [4, 1, 3, 2], 4)
  params = SamplingParams.greedy(4)
  kw = dict(max_new_tokens=10, all_greedy=True, grammar=grammar)
  plain = generate(target, prompts, lengths, params, None, **kw)
  out = speculative_generate(target, trained, prompts, lengths, params, None, num_speculative_tokens=3, **kw)
  np.testing.assert_array_equal(out.tokens, plain.tokens)
  np.testing.assert_array_equal(out.lengths, plain.lengths)
  for row, n in zip(np.asarray(out.tokens), np.asarray(out.lengths)):
    assert host_walk(grammar, list(row[:n]), ())[0], row[:n]


def test_each_placeholder_reads_the_hidden_of_its_offset():
  """Placeholder j reads `mask_hidden[j]`: changing row j moves the logits of drafts j+2 onward (placeholder j
  and those after it, which see it) and leaves the drafts before them, so offsets are told apart by their
  input and not by RoPE alone. The loop's layout (offsets from the run) and explicit offsets agree."""
  target, untrained, _ = _models()
  seqs = jnp.asarray(np.random.default_rng(1).integers(0, V, (2, 10)), jnp.int32)
  s = seqs.shape[1]
  _, feats, _ = target(seqs, jnp.broadcast_to(jnp.arange(s), (2, s)), target.init_cache(2, s), return_features=True)
  ends = jnp.asarray([4, 6], jnp.int32)
  before = np.asarray(untrained.block_logits(seqs[:, 1:], feats[:, :-1], ends, 4))  # [B, 4, V]
  drafter = nnx.clone(untrained)
  drafter.mask_hidden[1] = drafter.mask_hidden[1] + 0.5
  after = np.asarray(drafter.block_logits(seqs[:, 1:], feats[:, :-1], ends, 4))
  np.testing.assert_array_equal(after[:, :2], before[:, :2])  # the context's draft and placeholder 0's
  assert np.all(np.abs(after[:, 2:] - before[:, 2:]).max(axis=-1) > 1e-4)
  t = s - 1
  pos = jnp.broadcast_to(jnp.arange(t), (2, t))
  ph = pos >= ends[:, None]

  def call(**kw):
    return drafter(seqs[:, 1:], drafter.fuse(feats[:, :-1]), pos, drafter.init_cache(2, t), placeholders=ph, **kw)[0]

  np.testing.assert_array_equal(np.asarray(call()), np.asarray(call(placeholder_offsets=pos - ends[:, None])))


def test_several_blocks_in_one_training_call_equal_one_block_a_call():
  """`block_logits` with several blocks a row (one call: shared context, each block's placeholders masked from
  the others) gives each block's logits as a call with that block alone (a contiguous, causal call like the
  loop's), to float32 rounding."""
  target, _, trained = _models()
  seqs = jnp.asarray(np.random.default_rng(0).integers(0, V, (2, 14)), jnp.int32)
  s = seqs.shape[1]
  _, feats, _ = target(seqs, jnp.broadcast_to(jnp.arange(s), (2, s)), target.init_cache(2, s), return_features=True)
  ends = jnp.asarray([[1, 5, 9], [3, 4, 10]], jnp.int32)
  together = trained.block_logits(seqs[:, 1:], feats[:, :-1], ends, 4)
  assert together.shape == (2, 3, 4, V)
  for i in range(ends.shape[1]):
    # One block alone, as the first slice wrote it: placeholders in place of the entries from the end on.
    t = s - 1
    pos = jnp.broadcast_to(jnp.arange(t), (2, t))
    alone, _, _ = trained(
      seqs[:, 1:],
      trained.fuse(feats[:, :-1]),
      pos,
      trained.init_cache(2, t),
      placeholders=pos >= ends[:, i : i + 1],
      logits_at=(ends[:, i] - 1)[:, None] + jnp.arange(4)[None, :],
    )
    np.testing.assert_allclose(np.asarray(together[:, i]), np.asarray(alone), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(
    np.asarray(trained.block_logits(seqs[:, 1:], feats[:, :-1], ends[:, 1], 4)), np.asarray(together[:, 1]), atol=1e-5
  )


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--model", "smollm2", "--block", __file__], "--block: block drafters load for --model qwen2.5-coder-1.5b"),
    (["--model", "qwen2.5-coder-1.5b", "--block", "/nonexistent.safetensors"], "--block /nonexistent.safetensors"),
    (
      ["--model", "qwen2.5-coder-1.5b", "--block", __file__, "--block-trees", "2x2,2xq"],
      "--block-trees: bad tree '2xq'",
    ),
    (["--model", "qwen2.5-coder-1.5b", "--block", __file__, "--block-trees", "d5x4"], "--block-trees: bad tree 'd5x4'"),
  ],
)
def test_the_real_target_bench_refuses_a_bad_block_flag_before_loading(capsys, monkeypatch, argv, message):
  bench = _real_target_bench(monkeypatch)
  with pytest.raises(SystemExit) as e:
    bench.parse_args([*argv, "--quick", "--out", "/nonexistent"])
  assert e.value.code == 2 and message in capsys.readouterr().err.strip().splitlines()[-1]


def _real_target_bench(monkeypatch):
  """bench/real_target.py as a module (bench/ is no package of the library)."""
  import importlib.util
  import pathlib
  import sys

  path = pathlib.Path(__file__).resolve().parents[2] / "bench" / "real_target.py"
  spec = importlib.util.spec_from_file_location("real_target_bench", path)
  bench = importlib.util.module_from_spec(spec)
  monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclasses look their module up there
  spec.loader.exec_module(bench)
  return bench


def test_the_real_target_bench_runs_block_trees_and_times_the_block_draft_phase(monkeypatch):
  """--block-trees rows run like the EAGLE tree rows (greedy: plain's tokens), and the step section's block phase
  rows give the drafter's call in target steps and in EAGLE head calls, with the tiny target in place of the
  coder (whose weights a CPU test does not load)."""
  import types

  from bench import decode as bd

  bench = _real_target_bench(monkeypatch)
  args = bench.parse_args(
    ["--model", "qwen2.5-coder-1.5b", "--block", __file__, "--block-ks", "3", "--block-trees", "2x1,d2x2x3"]
    + ["--ks", "", "--quick", "--max-new-tokens", "8", "--target-ms", "2", "--step-repeats", "1", "--out", "/x"]
  )
  assert args.block_trees == ("2x1", "d2x2x3")
  target, untrained, trained = _models()
  eagle = EagleDrafter.for_target(target, rngs=nnx.Rngs(4))
  report = {"step": [], "generate": [], "errors": []}
  budget = bd.Budget(0)
  bench.block_phase_rows(trained, eagle, "xla", args, 6, 32, 1e-3, report, lambda: None, budget)
  (phase,) = report["block_phase"]
  assert phase["K"] == 3 and phase["ms"] > 0 and phase["over_head_call"] > 0, phase
  assert phase["over_step"] == pytest.approx(phase["ms"])  # t_step 1 ms

  prompts, lengths = make_prompts(2, V, [5, 3], 5)
  tokenizer = types.SimpleNamespace(decode=lambda ids: " ".join(map(str, ids)))
  data = {"names": ["a", "b"], "tokens": np.asarray(prompts), "lengths": np.asarray(lengths), "tokenizer": tokenizer}
  spec = types.SimpleNamespace(eos_ids=(0,))
  bench.generate_mode(target, None, "xla", spec, args, data, report, lambda: None, budget, "greedy", untrained)
  rows = {r["config"]: r for r in report["generate"]}
  assert list(rows) == ["plain", "block K=3", "block 2x1", "block d2x2x3"], list(rows)
  for name in ("block 2x1", "block d2x2x3"):
    assert rows[name]["drafter"] == "block" and rows[name]["K"] == 2, rows[name]
    assert rows[name]["divergence"]["identical"], rows[name]["divergence"]
  assert not report["errors"], report["errors"]
