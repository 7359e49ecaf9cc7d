"""examples/train_eagle.py's data pipeline: bucketed generation batches, resumable generation, the padded data."""

import functools
import importlib.util
import pathlib
import sys
import types

import numpy as np
import pytest

from tests.support.tiny_transformers import CONFIG, V, unit_target

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def train():
  sys.path.insert(0, str(EXAMPLES))  # train_eagle imports coder_prompts and train_draft's prompt lists
  try:
    spec = importlib.util.spec_from_file_location("examples_train_eagle", EXAMPLES / "train_eagle.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  finally:
    sys.path.remove(str(EXAMPLES))
  return module


def test_bucketed_batches_hold_every_continuation_once_and_respect_the_token_cap(train):
  p_lens = np.random.default_rng(0).integers(1, 385, size=300)
  samples = [0.0, 1.0, 1.0]
  batches = train.generation_batches(p_lens, samples, prompt_len=384, batch_size=512, prefill_tokens=8192)
  jobs = np.concatenate([j for _, j, _, _ in batches])
  assert np.array_equal(np.sort(jobs), np.arange(len(p_lens) * len(samples)))
  for first, j, width, b in batches:
    assert first == j[0] and len(j) <= b and b * width <= 8192
    assert np.all(p_lens[j // len(samples)] <= width) and width in (96, 192, 384)
  assert {w for _, _, w, _ in batches} == {96, 192, 384}
  # Without a cap: the shipped SmolLM2 head's batches (consecutive jobs, one width).
  plain = train.generation_batches(p_lens, samples, prompt_len=128, batch_size=256, prefill_tokens=0)
  assert [(f, list(j), w, b) for f, j, w, b in plain] == [
    (s, list(range(s, min(s + 256, 900))), 128, 256) for s in range(0, 900, 256)
  ]


def _setup(train, tmp_path):
  target = unit_target(CONFIG)
  rng = np.random.default_rng(1)
  prompts = [list(rng.integers(0, V, size=n)) for n in (3, 8, 5, 2, 7)]
  kinds = ["chat", "edit", "chat", "tests", "complete"]
  spec = types.SimpleNamespace(eos=(3,))
  args = types.SimpleNamespace(prompt_len=8, gen_tokens=6, gen_batch=4, prefill_tokens=16, seed=0)
  return target, prompts, kinds, spec, args


def test_generation_resumes_where_it_stopped(train, tmp_path):
  target, prompts, kinds, spec, args = _setup(train, tmp_path)
  samples = [0.0, 1.0]
  whole = train.generate_data(target, spec, prompts, kinds, samples, args, deadline=0.0, partial_path="")
  assert whole["job_done"].all()
  partial = str(tmp_path / "data.partial.npz")
  # A deadline already past: nothing is generated, and the (empty) progress is saved.
  none = train.generate_data(target, spec, prompts, kinds, samples, args, deadline=1.0, partial_path=partial)
  assert not none["job_done"].any() and pathlib.Path(partial).is_file()
  # Half done (the first batches), as a cut-off run leaves it: the rest is generated with the same keys.
  half = dict(whole)
  done = np.zeros(len(whole["job_done"]), bool)
  done[:4] = True
  g = whole["gen_offsets"]
  half["job_done"] = done
  half["gen_ids"] = whole["gen_ids"][: g[4]]
  half["gen_offsets"] = np.concatenate([g[:5], np.full(len(g) - 5, g[4])])
  train.save_data(partial, half)
  resumed = train.generate_data(target, spec, prompts, kinds, samples, args, deadline=0.0, partial_path=partial)
  for key in whole:
    np.testing.assert_array_equal(resumed[key], whole[key], err_msg=key)
  # The padded view: each row is its prompt, then its continuation (EOS 3 included), then zeros.
  tokens, p_lens, lens, prompt_of = train.padded_data(whole, args.prompt_len, args.gen_tokens)
  assert tokens.shape == (10, 14) and list(prompt_of) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
  for r in range(10):
    assert list(tokens[r, : p_lens[r]]) == prompts[prompt_of[r]]
    gen = whole["gen_ids"][whole["gen_offsets"][r] : whole["gen_offsets"][r + 1]]
    assert list(tokens[r, p_lens[r] : lens[r]]) == list(gen) and not tokens[r, lens[r] :].any()
    assert 1 <= len(gen) <= args.gen_tokens and (3 not in gen[:-1])
  assert whole["job_temperature"].tolist() == [0.0, 1.0] * 5  # job j: prompt j // 2 at samples[j % 2]


def test_a_partial_file_of_other_prompts_is_refused(train, tmp_path):
  target, prompts, kinds, spec, args = _setup(train, tmp_path)
  partial = str(tmp_path / "data.partial.npz")
  train.generate_data(target, spec, prompts, kinds, [0.0], args, deadline=1.0, partial_path=partial)
  with pytest.raises(SystemExit, match="other prompts"):
    train.generate_data(target, spec, prompts[::-1], kinds, [0.0], args, deadline=0.0, partial_path=partial)


def test_shards_generate_their_own_prompts_and_a_run_without_one_joins_them(train, tmp_path):
  """`--data-shard i/n`: each of n processes generates the continuations of prompts i, i + n, ...; the same
  command without it reads every shard's file and generates nothing they hold (greedy rows equal one run's)."""
  target, prompts, kinds, spec, args = _setup(train, tmp_path)
  samples = [0.0, 1.0]
  whole = train.generate_data(target, spec, prompts, kinds, samples, args, deadline=0.0, partial_path="")
  files = []
  for i in range(2):
    path = str(tmp_path / f"d.npz.shard{i}of2.partial.npz")
    part = train.generate_data(
      target, spec, prompts, kinds, samples, args, deadline=0.0, partial_path=path, shard=(i, 2)
    )
    assert part["job_done"].tolist() == [p % 2 == i for p in part["job_prompt"]]
    train.save_data(path, part)
    files.append(path)
  # A deadline already past: the join generates nothing, so everything it holds came from the shards' files.
  joined = train.generate_data(
    target, spec, prompts, kinds, samples, args, deadline=1.0, partial_path="", resume=tuple(files)
  )
  assert joined["job_done"].all()
  g, w = joined["gen_offsets"], whole["gen_offsets"]
  for j in np.flatnonzero(joined["job_temperature"] == 0.0):
    np.testing.assert_array_equal(joined["gen_ids"][g[j] : g[j + 1]], whole["gen_ids"][w[j] : w[j + 1]])
  assert all(1 <= g[j + 1] - g[j] <= args.gen_tokens for j in range(len(g) - 1))


def test_bad_arguments_are_refused_before_loading(train):
  for argv in (
    ["--target", "qwen2.5-coder-1.5b", "--draft-vocab", "200000"],
    ["--samples", "0,x"],
    ["--samples", "-1"],
    ["--data-only"],
    ["--head-d-ff", "-1"],
    ["--loss", "kl"],
    ["--more-questions"],  # SmolLM2's prompts have --more-prompts
    ["--kind-weights", "question"],
    ["--kind-weights", "question=0"],
    ["--kind-weights", "=2"],
    ["--position-decay", "-1"],
    ["--grow-layers", "1"],  # nothing to grow without --init
    ["--position-decay", "nan"],
    ["--devices", "0"],
    ["--devices", "4096"],  # more than JAX sees
    ["--target", "qwen2.5-coder-1.5b", "--batch-size", "3", "--devices", "2"],
    ["--data-shard", "2/2", "--data-cache", "d.npz"],
    ["--data-shard", "0/2"],  # a shard's file needs --data-cache
    ["--data-shard", "x", "--data-cache", "d.npz"],
  ):
    with pytest.raises(SystemExit):
      train.parse_args(argv)
  spec, args = train.parse_args(["--target", "qwen2.5-coder-1.5b"])
  assert (args.num_layers, args.draft_vocab, args.head_d_ff, args.storage_dtype) == (1, 32768, 4096, "int8")
  assert args.out.endswith("qwen2_5_coder_eagle.safetensors") and args.samples == [0.0, 1.0, 1.0, 1.0, 1.0]
  _, block = train.parse_args(["--drafter", "block", "--shared-placeholder", "--position-decay", "3"])
  assert block.shared_placeholder and block.position_decay == 3.0 and not args.shared_placeholder
  assert train.parse_args(["--data-shard", "1/4", "--data-cache", "d.npz"])[1].data_shard == (1, 4)


def _count_generated_rows(train, monkeypatch) -> list:
  """The temperatures of the rows each later generate call is given (generate_padded, counted)."""
  rows = []
  real = train.generate_padded

  def counting(target, prompts, temps, **kw):
    rows.extend(temps)
    return real(target, prompts, temps, **kw)

  monkeypatch.setattr(train, "generate_padded", counting)
  return rows


def _gen(data, j) -> list:
  """Continuation j's generated ids."""
  return data["gen_ids"][data["gen_offsets"][j] : data["gen_offsets"][j + 1]].tolist()


def test_more_samples_extend_a_finished_run(train, tmp_path, monkeypatch):
  """A finished run's data, resumed with --samples extended, keeps its continuations and generates only the new."""
  target, prompts, kinds, spec, args = _setup(train, tmp_path)
  two = train.generate_data(target, spec, prompts, kinds, [0.0, 1.0], args, deadline=0.0, partial_path="")
  partial = str(tmp_path / "more.partial.npz")
  train.save_data(partial, two)
  rows = _count_generated_rows(train, monkeypatch)
  three = train.generate_data(target, spec, prompts, kinds, [0.0, 1.0, 1.0], args, deadline=0.0, partial_path=partial)
  assert three["job_done"].all() and len(three["job_done"]) == 15
  assert rows == [1.0] * 5  # only the new sample of each prompt is generated

  for i in range(5):
    assert [_gen(three, 3 * i + t) for t in (0, 1)] == [_gen(two, 2 * i + t) for t in (0, 1)]
    assert three["job_prompt"][3 * i + 2] == i and three["job_temperature"][3 * i + 2] == 1.0
  with pytest.raises(SystemExit, match="not a prefix"):
    train.generate_data(target, spec, prompts, kinds, [1.0, 1.0], args, deadline=0.0, partial_path=partial)


def test_more_prompts_extend_a_finished_run(train, tmp_path, monkeypatch):
  """Data of the first prompts, resumed with prompts appended (and a sample more): the old continuations keep their
  place and only the new jobs are generated; a file of prompts that are not the first ones is refused."""
  target, prompts, kinds, spec, args = _setup(train, tmp_path)
  first = train.generate_data(target, spec, prompts[:3], kinds[:3], [0.0, 1.0], args, deadline=0.0, partial_path="")
  partial = str(tmp_path / "more.partial.npz")
  train.save_data(partial, first)
  rows = _count_generated_rows(train, monkeypatch)
  more = train.generate_data(target, spec, prompts, kinds, [0.0, 1.0, 1.0], args, deadline=0.0, partial_path=partial)
  assert more["job_done"].all() and len(more["job_done"]) == 15
  assert sorted(rows) == [0.0] * 2 + [1.0] * 7  # 3 old prompts' new sample, and 3 samples of 2 new prompts

  for i in range(3):
    assert [_gen(more, 3 * i + t) for t in (0, 1)] == [_gen(first, 2 * i + t) for t in (0, 1)]
  with pytest.raises(SystemExit, match="other prompts"):
    train.generate_data(target, spec, prompts[1:], kinds[1:], [0.0, 1.0], args, deadline=0.0, partial_path=partial)


def test_general_questions_are_fixed_and_leave_the_benchmark_out(train, monkeypatch):
  coder = train.coder_prompts
  chat = lambda text: f"<user>{text}</user>"  # noqa: E731
  questions = coder.general_questions(chat)
  assert questions == coder.general_questions(chat) and len(questions) > 200
  assert {k for k, _ in questions} == {"question"} and len({p for _, p in questions}) == len(questions)
  assert "question" not in train.CODE_KINDS  # reported with chat
  question = sorted(coder.held_out_texts())[0]
  monkeypatch.setattr(coder, "WHY_QUESTIONS", [question, "Why is grass green?"])
  texts = [p for _, p in coder.general_questions(chat)]
  assert chat("Why is grass green?") in texts and chat(question) not in texts


def test_kind_weights_draw_a_kind_more_often(train):
  """question=4: a question row is drawn 4 times as often as another row (binomial counts, fixed seed, 5 sigma);
  no weights: None (the uniform draw the shipped heads used); a named kind without rows is refused."""
  assert train.parse_kind_weights("question=4,chat=0.5") == {"question": 4.0, "chat": 0.5}
  kinds = np.asarray(["chat"] * 60 + ["question"] * 20 + ["edit"] * 20)
  assert train.kind_probabilities(kinds, {}) is None
  p = train.kind_probabilities(kinds, {"question": 4.0})
  np.testing.assert_allclose(p.sum(), 1.0)
  draws = np.random.default_rng(0).choice(len(kinds), 200_000, p=p)
  share = np.mean(kinds[draws] == "question")  # expected 80 / 160 = 0.5 (uniform: 0.2)
  assert abs(share - 0.5) < 5 * np.sqrt(0.25 / 200_000)
  with pytest.raises(SystemExit, match="no training rows"):
    train.kind_probabilities(kinds, {"tests": 2.0})


@pytest.mark.parametrize("storage", ["float16", "int8"])
def test_the_measured_stored_head_is_the_one_its_file_loads(train, tmp_path, storage):
  """quantized_copy (what the report measures) gives the logits of the head read back from its file."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  from specdec_jax.models.loaders import eagle_files  # noqa: PLC0415

  target = unit_target(CONFIG.replace(qkv_bias=True, tie_embeddings=False))
  head = train.build_drafter(target, num_layers=2, d_ff=24, vocab=np.asarray([0, 2, 5, 7, 11, 13]), seed=3)
  path = str(tmp_path / "head.safetensors")
  eagle_files.save_eagle_head(head, path, target="tiny.gguf", storage_dtype=storage)
  source = lambda: (target.config.replace(dtype=jnp.float32), target.embed[...], target.lm_head[...].T)  # noqa: E731
  loaded = eagle_files.read_eagle_head(path, source, name="tiny head", remedy="")
  measured = train.quantized_copy(head, storage)
  tokens = jax.random.randint(jax.random.key(1), (2, 6), 0, V)
  features = jax.random.normal(jax.random.key(2), (2, 6, head.config.feature_size))
  a, b, c = (m.unrolled_logits(tokens, features, 2) for m in (measured, loaded, head))
  for x, y, z in zip(a, b, c):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    finite = np.isfinite(np.asarray(z))
    assert storage == "float16" or np.abs(np.asarray(x)[finite] - np.asarray(z)[finite]).max() > 1e-5


def test_coder_prompts_are_deterministic_and_leave_the_benchmark_out(train, monkeypatch):
  coder = train.coder_prompts
  # Every 8th file of the standard library (72 of 579): the same parse and prompt kinds, a few hundred functions
  # to draw from, in a second instead of ~6 s for all 579 (a cache of its own: the module's stays the whole one).
  files = coder._stdlib_files()[::8]
  monkeypatch.setattr(coder, "_stdlib_files", lambda: files)
  monkeypatch.setattr(coder, "stdlib_functions", functools.cache(coder.stdlib_functions.__wrapped__))
  assert len(coder.stdlib_functions()) > 300
  chat = lambda text: f"<user>{text}</user>"  # noqa: E731
  first = coder.coder_prompts(chat, seed=0, max_functions=30)
  assert (
    first == coder.coder_prompts(chat, seed=0, max_functions=30) != coder.coder_prompts(chat, seed=1, max_functions=30)
  )
  assert {k for k, _ in first} == set(coder.KINDS)
  assert all(p.startswith("<user>") for k, p in first if k != "complete")
  assert all(not p.startswith("<user>") and "def " in p for k, p in first if k == "complete")
  # A template that happens to produce a benchmark prompt: it is dropped.
  question = sorted(coder.held_out_texts())[0]
  monkeypatch.setattr(coder, "EVERYDAY_TOPICS", [question, "tea"])
  monkeypatch.setattr(coder, "EVERYDAY_TEMPLATES", ["{t}"])
  texts = [p for _, p in coder.coder_prompts(chat, seed=0, max_functions=5)]
  assert chat("tea") in texts and chat(question) not in texts


def test_block_targets_near_the_sequence_end_are_finite_and_in_place(train):
  """A block whose drafts reach past the padded sequence (training draws its ends anywhere in the generated
  text) gathers finite logits there, to be masked: an out-of-bounds gather fills with NaN, which turned the
  first real run's loss into NaN. Inside the sequence each draft reads the target's logits at c+j."""
  import jax.numpy as jnp

  s, v, k = 10, 7, 4
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, s, v)), jnp.float32)
  ends = jnp.asarray([[2, 8], [9, 5]], jnp.int32)  # 8+3 and 9+1.. reach past position s-1 = 9
  t_all, at = train.block_target_logits(logits, ends, k)
  assert t_all.shape == (2, 2, k, v) and at.shape == (2, 2, k)
  assert np.isfinite(np.asarray(t_all)).all()
  for b in range(2):
    for n in range(2):
      for j in range(k):
        assert int(at[b, n, j]) == int(ends[b, n]) + j
        if at[b, n, j] < s:
          assert np.array_equal(np.asarray(t_all[b, n, j]), np.asarray(logits[b, int(at[b, n, j])]))


def test_position_weights_sum_to_one_and_decay_by_position(train):
  """--position-decay G: depth j's loss weighs exp(-j / G), normalised; 0 gives every depth the same weight."""
  assert train.loss_weights(4, 0.0) == [0.25] * 4
  w = train.loss_weights(8, 3.0)
  assert abs(sum(w) - 1.0) < 1e-12 and all(a > b for a, b in zip(w, w[1:]))
  np.testing.assert_allclose([b / a for a, b in zip(w, w[1:])], np.exp(-1 / 3.0))


@pytest.mark.parametrize("layers", [1, 2])
def test_a_grown_head_starts_as_the_head_it_grew_from(train, layers):
  """--grow-layers: the new blocks' output projections are zero, so the grown head's logits are the --init
  head's; the old blocks keep their weights and the new ones are there to train."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from specdec_jax.models import EagleDrafter

  target = unit_target()
  head = EagleDrafter.for_target(target, num_layers=layers, rngs=nnx.Rngs(1))
  grown = train.grow_head(head, 1, lambda n: EagleDrafter.for_target(target, num_layers=n, rngs=nnx.Rngs(2)))
  assert grown.config.layers.num_layers == layers + 1
  b, t = 2, 5
  tokens = jax.random.randint(jax.random.key(0), (b, t), 0, V)
  feats = jax.random.normal(jax.random.key(1), (b, t, head.config.feature_size))
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))

  def logits(d):
    return np.asarray(d(tokens, d.fuse(feats), pos, d.init_cache(b, 8))[0])

  np.testing.assert_allclose(logits(grown), logits(head), rtol=1e-6, atol=1e-6)
  assert np.abs(np.asarray(grown.rest.w_gate_up[...][layers - 1])).max() > 0  # the new block's own weights
  grown.rest.w_down[...] = grown.rest.w_down[...] + 0.01  # once trained, the new block changes the output
  assert np.abs(logits(grown) - logits(head)).max() > 1e-4


def test_the_coder_self_written_questions_come_last_and_leave_the_benchmark_out(train, monkeypatch):
  """--self-questions for the coder: the questions go after --more-questions' (so data made without them extends),
  as kind "question"; one naming a benchmark subject is dropped; no topic asked about names one."""
  import json  # noqa: PLC0415

  coder = train.coder_prompts
  benchmark = json.load(open(EXAMPLES / "held_out_prompts.json"))["questions"]
  assert all(coder.about_the_benchmark(q) for q in benchmark)
  assert not any(coder.about_the_benchmark(t) for t in coder.self_question_topics())
  assert not coder.about_the_benchmark("How do catapults and petrol engines work?")  # words, not substrings
  spec, args = train.parse_args(["--target", "qwen2.5-coder-1.5b", "--more-questions", "--self-questions", "2"])
  written = [spec.chat("How do owls see at night?"), spec.chat("Are dogs smarter than wolves?")]
  asked = {}

  def fake_self_questions(target, tokenizer, topics, **kw):
    asked.update(topics=topics, **kw)
    return written

  monkeypatch.setattr(train, "self_questions", fake_self_questions)
  monkeypatch.setattr(coder, "coder_prompts", lambda chat, **kw: [("edit", chat("Rename x."))])
  prompts, kinds = train.target_prompts(spec, args, None, None)
  general = coder.general_questions(spec.chat)
  assert prompts == [spec.chat("Rename x.")] + [p for _, p in general] + written[:1]
  assert kinds == ["edit"] + ["question"] * (len(general) + 1)
  assert asked["samples"] == 2 and asked["chat"] is spec.chat and asked["eos"] == spec.eos
  assert asked["topics"] == coder.self_question_topics()


def test_self_written_questions_are_kept_beside_the_data_and_read_back(train, monkeypatch, tmp_path):
  """With --data-cache D the questions go to D.questions.json, and a later run (another --data-shard process,
  or the run that joins them) reads them instead of writing new ones: every process has the same prompts."""
  cache = str(tmp_path / "d.npz")
  spec, args = train.parse_args(
    ["--target", "qwen2.5-coder-1.5b", "--self-questions", "2", "--data-cache", cache, "--data-shard", "0/2"]
  )
  calls = []

  def fake_self_questions(target, tokenizer, topics, **kw):
    calls.append(len(calls))
    return [spec.chat(f"Question {len(calls)}: why do owls hoot?")]

  monkeypatch.setattr(train, "self_questions", fake_self_questions)
  first = train.written_questions(spec, args, None, None, ["owls"])
  again = train.written_questions(spec, args, None, None, ["owls"])
  assert calls == [0] and first == again == [spec.chat("Question 1: why do owls hoot?")]
  assert (tmp_path / "d.npz.questions.json").is_file()
