"""Qwen2.5-Coder-1.5B-Instruct, the real 1.5B target: config, tokenizer, chat template, greedy answers.

Slow and `real_model`: they need the 1.1 GB GGUF in the cache folder (run
`python -m specdec_jax.models.loaders.qwen2_5_coder` once; the tests never
download it) and load the model once, in float32 (7 GB). On a 2-core CPU the
module takes a few minutes.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from specdec_jax import PromptLookupDrafter, SamplingParams, generate, speculative_generate  # noqa: E402
from specdec_jax.models.loaders import gguf, qwen2_5_coder  # noqa: E402
from specdec_jax.models.loaders.common import cache_dir  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

PATH = os.path.join(cache_dir(), qwen2_5_coder.QWEN2_5_CODER_FILE)
if not os.path.isfile(PATH):
  pytest.skip(
    f"no {PATH}: fetch it first with python -m specdec_jax.models.loaders.qwen2_5_coder", allow_module_level=True
  )


@pytest.fixture(scope="module")
def qwen():
  return qwen2_5_coder.load_qwen2_5_coder(jnp.float32, progress=False)


def _generate(model, tokenizer, text: str, max_new_tokens: int, draft=None) -> np.ndarray:
  ids = tokenizer.encode(qwen2_5_coder.chat_prompt(text)).ids
  tokens, lengths = jnp.asarray([ids], jnp.int32), jnp.asarray([len(ids)], jnp.int32)
  common = dict(max_new_tokens=max_new_tokens, eos_token_id=qwen2_5_coder.QWEN2_5_CODER_EOS_IDS, all_greedy=True)
  if draft is None:
    out = generate(model, tokens, lengths, SamplingParams.greedy(1), None, **common)
  else:
    out = speculative_generate(
      model, draft, tokens, lengths, SamplingParams.greedy(1), None, num_speculative_tokens=4, **common
    )
  return np.asarray(out.tokens[0, : int(out.lengths[0])])


def test_config_is_qwen2_5_coder_1_5b(qwen):
  c = qwen[0].config
  assert (c.num_layers, c.d_model, c.num_heads, c.num_kv_heads, c.head_dim, c.d_ff) == (28, 1536, 12, 2, 128, 8960)
  assert (c.vocab_size, c.max_length, c.rope_theta) == (151936, 32768, 1e6)
  assert c.qkv_bias and not c.tie_embeddings
  assert c.rms_norm_eps == pytest.approx(1e-6)


def test_tokenizer_ids_are_the_gguf_ones(qwen):
  tokenizer = qwen[1]
  assert tokenizer.encode("Hello world").ids == [9707, 1879]
  assert tokenizer.token_to_id("<|im_end|>") == qwen2_5_coder.QWEN2_5_CODER_EOS_IDS[0] == 151645
  assert tokenizer.token_to_id("<|endoftext|>") == 151643
  assert tokenizer.encode("<|im_start|>user").ids == [151644, 872]
  text = "def f(x):\n    return x ** 2  # naïve 東京\n"
  assert tokenizer.decode(tokenizer.encode(text).ids) == text


@pytest.mark.parametrize(
  "messages",
  [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
  ],
)
def test_chat_template_matches_the_stored_jinja(messages):
  stored = gguf.render_chat_template(gguf.gguf_chat_template(PATH), messages)
  assert qwen2_5_coder.apply_chat_template(messages) == stored


def test_greedy_answers_are_sensible(qwen):
  model, tokenizer = qwen
  answer = tokenizer.decode(
    _generate(model, tokenizer, "What is the capital of France? Answer in one word.", 8).tolist()
  )
  assert "Paris" in answer
  code = tokenizer.decode(
    _generate(model, tokenizer, "Write a Python function that returns the square of a number. Code only.", 48).tolist()
  )
  assert "def " in code and "return" in code, code


def test_prompt_lookup_greedy_equals_plain_greedy_in_float32(qwen):
  model, tokenizer = qwen
  text = "Repeat this code exactly:\n\ndef add(a, b):\n    total = a + b\n    return total\n"
  plain = _generate(model, tokenizer, text, 40)
  lookup = _generate(model, tokenizer, text, 40, draft=PromptLookupDrafter(ngram_size=(3, 2)))
  np.testing.assert_array_equal(lookup, plain)
  assert "return total" in tokenizer.decode(plain.tolist())


def test_the_shipped_eagle_head_drafts_losslessly_and_is_accepted(qwen):
  """The shipped head in float32 on the float32 target: greedy speculative decoding equals plain greedy decoding,
  and the head's drafts are accepted (more than one token per target call on a coding answer)."""
  from specdec_jax.models import load_qwen2_5_coder_eagle  # noqa: PLC0415

  model, tokenizer = qwen
  head = load_qwen2_5_coder_eagle(jnp.float32)
  assert head.config.feature_layers == model.config.feature_layers == (2, 14, 25)
  text = "Write a Python function that returns the sum of the squares of a list of numbers. Code only."
  ids = tokenizer.encode(qwen2_5_coder.chat_prompt(text)).ids
  tokens, lengths = jnp.asarray([ids], jnp.int32), jnp.asarray([len(ids)], jnp.int32)
  common = dict(max_new_tokens=32, eos_token_id=qwen2_5_coder.QWEN2_5_CODER_EOS_IDS, all_greedy=True)
  plain = generate(model, tokens, lengths, SamplingParams.greedy(1), None, **common)
  spec = speculative_generate(
    model, head, tokens, lengths, SamplingParams.greedy(1), None, num_speculative_tokens=4, **common
  )
  n = int(plain.lengths[0])
  assert int(spec.lengths[0]) == n
  np.testing.assert_array_equal(np.asarray(spec.tokens[0, :n]), np.asarray(plain.tokens[0, :n]))
  assert float(spec.stats.mean_accepted_length) > 1.5
