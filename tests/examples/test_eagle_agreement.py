"""bench/eagle_agreement.py on a tiny target: its agreement is train_eagle's definition, and its chain replay is
what `speculative_generate` counts."""

import importlib
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specdec_jax.loop.decoding import generate, speculative_generate
from specdec_jax.models.eagle import EagleDrafter
from specdec_jax.sampling.params import SamplingParams
from tests.support.tiny_lm import make_prompts
from tests.support.tiny_transformers import V, distil, unit_target

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def agree():
  if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
  return importlib.import_module("bench.eagle_agreement")


@pytest.fixture(scope="module")
def target():
  return unit_target()


def _rows(agree, prompts, lengths, out):
  tokens, n = np.asarray(out.tokens), np.asarray(out.lengths)
  rows = []
  for r, pl in enumerate(np.asarray(lengths)):
    ids = np.concatenate([np.asarray(prompts)[r, :pl], tokens[r, : n[r]]]).astype(np.int32)
    rows.append(agree.Row(f"row{r}", "code" if r % 2 else "chat", ids, int(pl), len(ids)))
  return rows


def test_agreement_is_train_eagles_definition(agree, target):
  """top1 and 1-TV per depth, recomputed directly from `unrolled_logits` on the unpadded sequences (a draft
  vocabulary of half the tokens, so the id mapping and the restricted overlap matter): the padding, the masks
  and the token-weighted sums are right."""
  vocab = np.arange(1, V, 2)
  head = EagleDrafter.for_target(target, draft_vocab=vocab, rngs=nnx.Rngs(3))
  rng = np.random.default_rng(0)
  rows = [
    agree.Row(f"r{i}", "chat", rng.integers(0, V, n).astype(np.int32), pl, n)
    for i, (n, pl) in enumerate([(13, 4), (13, 1)])  # one length: one compile of the direct recomputation
  ]
  depth = 3
  padded = agree.measure(target, {"h": head}, rows, depth, bucket=16)["h"]  # both rows padded to 16 tokens
  top1, overlap, count = np.zeros(depth), np.zeros(depth), np.zeros(depth)
  for row in rows:
    x = jnp.asarray(row.tokens)[None]
    s = x.shape[1]
    logits, feats, _ = target(x, jnp.arange(s)[None], target.init_cache(1, s), return_features=True)
    per_depth = head.unrolled_logits(x[:, 1:-1], feats[:, :-2], depth)
    p_t = np.asarray(jax.nn.softmax(logits[0], -1))
    for j in range(depth):
      q = np.asarray(jax.nn.softmax(per_depth[j][0], -1))
      for p in range(j, s - 2):
        if p + 2 < row.p_len:  # only generated tokens are predicted
          continue
        count[j] += 1
        top1[j] += vocab[np.argmax(q[p])] == np.argmax(p_t[p + 1])
        overlap[j] += np.minimum(p_t[p + 1, vocab], q[p]).sum()
  s = agree.summarize(padded, rows, k=2)
  assert s["positions"] == count.astype(int).tolist()
  np.testing.assert_allclose(s["top1"], top1 / count, atol=1e-4)
  np.testing.assert_allclose(s["one_minus_tv"], overlap / count, atol=1e-4)
  assert 0 < min(s["one_minus_tv"]) and max(s["one_minus_tv"]) < 1


@pytest.mark.slow  # 11 s; test_replay_counts_by_hand keeps the replay rule in the fast subset
def test_chain_replay_is_what_the_loop_counts(agree, target):
  """A distilled head: the replayed greedy chain's accepted and reached counts per position and its target calls
  equal `speculative_generate`'s stats on the same prompts (ragged, an EOS inside rounds, max_new_tokens), K = 2, 3."""
  head = distil(target, EagleDrafter.for_target(target, rngs=nnx.Rngs(2)), steps=30)
  prompts, lengths = make_prompts(5, V, [4, 1, 3, 2], 4)
  params = SamplingParams.greedy(4)
  eos = int(
    np.asarray(generate(target, prompts, lengths, params, None, max_new_tokens=15, all_greedy=True).tokens)[2, 6]
  )
  kw = dict(max_new_tokens=15, eos_token_id=eos, all_greedy=True)
  plain = generate(target, prompts, lengths, params, None, **kw)
  rows = _rows(agree, prompts, lengths, plain)
  res = agree.measure(target, {"h": head}, rows, 3, bucket=32)["h"]
  for k in (2, 3):
    spec = speculative_generate(target, head, prompts, lengths, params, None, num_speculative_tokens=k, **kw)
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    s = agree.summarize(res, rows, k)
    stats = jax.tree.map(np.asarray, spec.stats)
    assert s["chain"]["accepted_per_position"] == stats.accepted_per_position.tolist(), k
    assert s["chain"]["reached_per_position"] == stats.reached_per_position.tolist(), k
    assert s["chain"]["target_calls"] == int(stats.target_calls.sum()), k
    assert s["chain"]["tokens"] == int(np.sum(plain.lengths))
    assert s["chain"]["accepted_per_position"][0] > 0  # the head does get drafts accepted
    assert s["target_argmax_is_next_token"] == 1.0  # the plain greedy continuation is the target's argmax
  assert set(agree.grouped(res, rows, 3)) == {"all", "chat", "code"}


def test_replay_counts_by_hand(agree):
  """p_len 2, length 9: the prefill emits x2; round L=3 accepts d(x3), d(x4), rejects x5 -> L=6; round L=6 has room
  for 2 drafts, rejects the first -> L=7; round L=7 has room for 1, accepts it -> L=9."""
  top1 = np.zeros((3, 7), bool)
  top1[0, 1], top1[1, 2] = True, True  # L=3: p = 1, 2 (x3, x4); x5 at depth 2, p=3, stays False
  top1[0, 5] = True  # L=7: x7 at depth 0, p = 5
  out = agree.replay_chain(top1, 2, 9, 3)
  assert out["accepted_per_position"].tolist() == [2, 1, 0]
  assert out["reached_per_position"].tolist() == [3, 1, 1]
  assert out["target_calls"] == 4  # prefill + 3 rounds: 7 tokens = 3 accepted + 4 calls


def test_held_out_rows_are_every_20th_prompt(agree):
  rng = np.random.default_rng(0)
  n_prompts, samples = 45, 2
  p_lens = rng.integers(2, 6, n_prompts)
  g_lens = rng.integers(1, 5, n_prompts * samples)
  data = {
    "prompt_ids": rng.integers(0, 50, p_lens.sum()).astype(np.int32),
    "prompt_offsets": np.concatenate([[0], np.cumsum(p_lens)]),
    "kinds": np.asarray(["chat", "edit", "implement"] * 15),
    "job_prompt": np.repeat(np.arange(n_prompts), samples),
    "job_temperature": np.tile(np.asarray([0.0, 1.0], np.float32), n_prompts),
    "job_done": np.ones(n_prompts * samples, bool),
    "gen_ids": rng.integers(0, 50, g_lens.sum()).astype(np.int32),
    "gen_offsets": np.concatenate([[0], np.cumsum(g_lens)]),
  }
  rows = agree.held_out_rows(data, rows=8, by_kind=False, temps="all", max_len=0)
  assert len(rows) == 6 and {r.name.split(":")[0] for r in rows} == {"prompt0", "prompt20", "prompt40"}
  greedy = agree.held_out_rows(data, rows=8, by_kind=True, temps="greedy", max_len=4)
  assert [r.name for r in greedy] == ["prompt0:chat:T0", "prompt20:implement:T0", "prompt40:edit:T0"]
  assert [r.kind for r in greedy] == ["chat", "code", "code"] and all(r.length <= 4 for r in greedy)
  r = greedy[1]
  assert (
    r.tokens[: r.p_len].tolist() == data["prompt_ids"][data["prompt_offsets"][20] : data["prompt_offsets"][21]].tolist()
  )


def test_flags_are_checked_before_any_model_loads(agree, tmp_path, capsys):
  for argv, msg in [
    ([], "nothing to measure"),
    (["--data", str(tmp_path / "none.npz")], "no such file"),
    (["--real-target-json", __file__, "--k", "6"], "must be <= --depth"),
    (["--real-target-json", __file__, "--head-dtypes", "float64"], "--head-dtypes"),
    (["--real-target-json", __file__], "not bench/real_target.py's JSON"),
  ]:
    with pytest.raises(SystemExit):
      agree.main(argv)
    assert msg in capsys.readouterr().err, argv
