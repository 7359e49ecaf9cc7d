"""Building from outlines-core: JSON schemas (random walks give valid JSON), the vocabulary of a
`tokenizers.Tokenizer` (token strings back to bytes, special tokens never allowed), and bad input."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax.grammar import TokenGrammar, outlines_vocabulary, schema_regex, token_bytes
from specdec_jax.sampling.masks import allowed_tokens

oc = pytest.importorskip("outlines_core")
tokenizers = pytest.importorskip("tokenizers")

# A small JSON vocabulary: characters and a few longer tokens; EOS is the id after the last.
TEXTS = [*'{}[]":, -.0123456789', *"abgnmetrufloks", '{"', '":', '",', "true", "false", '"name"', '"age"', "null", "12"]
EOS = len(TEXTS)
V = EOS + 1
SCHEMA = {
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 4},
    "age": {"type": "integer"},
    "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
  },
  "required": ["name", "age"],
}


def _vocabulary():
  return oc.Vocabulary(EOS, {text: [i] for i, text in enumerate(TEXTS)})


def _valid(value) -> bool:
  """The schema, checked by hand."""
  if not isinstance(value, dict) or not {"name", "age"} <= set(value) <= {"name", "age", "ok", "tags"}:
    return False
  tags = value.get("tags", [])
  return (
    isinstance(value["name"], str)
    and len(value["name"]) <= 4
    and type(value["age"]) is int
    and type(value.get("ok", True)) is bool
    and isinstance(tags, list)
    and len(tags) <= 2
    and all(t in ("a", "b") for t in tags)
  )


@jax.jit
def _random_walks(grammar, key):
  """64 walks of at most 96 tokens: each step draws uniformly among the allowed tokens and EOS where the
  state accepts (EOS: the walk stops). Returns (tokens [64, 96], -1 after the end; ended [64])."""
  num_walks, steps = 64, 96

  def step(carry, key):
    states, ended = carry
    allowed = allowed_tokens(grammar.mask(states), grammar.vocab_size)
    allowed = allowed.at[:, EOS].set(grammar.accepts(states))
    token = jax.random.categorical(key, jnp.where(allowed, 0.0, -jnp.inf))
    stop = ended | (token == EOS)
    states = jnp.where(stop, states, grammar.next_state(states, token))
    return (states, stop), jnp.where(stop, -1, token)

  init = (jnp.full((num_walks,), grammar.initial_state()), jnp.zeros((num_walks,), bool))
  (_, ended), tokens = jax.lax.scan(step, init, jax.random.split(key, steps))
  return tokens.T, ended


def test_json_schema_random_walks_give_valid_json():
  g = TokenGrammar.from_json_schema(SCHEMA, _vocabulary(), vocab_size=V)
  tokens, ended = (np.asarray(x) for x in _random_walks(g, jax.random.key(0)))
  assert ended.mean() > 0.5, "too few walks reached EOS: the check would be weak"
  texts = ["".join(TEXTS[t] for t in row if t >= 0) for row, done in zip(tokens, ended) if done]
  for text in texts:
    assert _valid(json.loads(text)), text
  assert len(set(texts)) > 10, texts


def test_json_schema_walk_of_a_known_text():
  """A text tokenized by hand walks to an accepting state; one more token is refused."""
  g = TokenGrammar.from_json_schema(json.dumps(SCHEMA), _vocabulary(), vocab_size=V)
  pieces = ['{"', "name", '":', '"', "a", "b", '",', '"age"', ":", "12", "}"]
  ids = [TEXTS.index(p) if p in TEXTS else None for p in pieces]
  ids = [i for p, i in zip(pieces, ids) for i in ([i] if i is not None else [TEXTS.index(c) for c in p])]
  state = g.initial_state()
  for i in ids:
    assert bool(allowed_tokens(g.mask(state), V)[i]), TEXTS[i]
    state = g.next_state(state, jnp.int32(i))
  assert bool(g.accepts(state)) and not bool(jnp.any(g.mask(state) != 0))
  assert int(g.next_state(state, jnp.int32(TEXTS.index("}")))) == -1


def _byte_level_tokenizer():
  """A byte-level BPE tokenizer: "Ġ" stands for a space, "Ċ" for a newline; two special tokens."""
  vocab = {c: i for i, c in enumerate(["a", "b", "Ġ", "Ċ", "Ġa", "ab", "<", "|", ">", "é"])}
  vocab.update({"Ã": 10, "©": 11, "Ġab": 12})
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[("Ġ", "a"), ("a", "b"), ("Ġ", "ab")]))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  tok.add_special_tokens([tokenizers.AddedToken(s, special=True) for s in ["<|end|>", "<|im_start|>"]])
  return tok


def test_token_bytes_of_byte_level_bpe():
  tok = _byte_level_tokenizer()
  got = token_bytes(tok)
  assert got[2] == b" " and got[3] == b"\n" and got[4] == b" a" and got[12] == b" ab"
  assert got[10] == b"\xc3" and got[11] == b"\xa9"  # the two bytes of "é" in GPT-2's alphabet
  assert 13 not in got and 14 not in got  # special tokens are left out


def test_token_bytes_of_sentencepiece_style_vocabulary():
  vocab = {"<unk>": 0, "▁a": 1, "<0x0A>": 2, "b": 3, "<0xC3>": 4}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tok.decoder = tokenizers.decoders.Sequence(
    [tokenizers.decoders.Replace("▁", " "), tokenizers.decoders.ByteFallback(), tokenizers.decoders.Fuse()]
  )
  got = token_bytes(tok)
  assert got[1] == b" a" and got[2] == b"\n" and got[3] == b"b" and got[4] == b"\xc3"


def test_special_tokens_never_allowed():
  """A pattern that the special tokens' text would match still never allows them; bytes split over tokens
  ("é" as two tokens) are followed."""
  tok = _byte_level_tokenizer()
  g = TokenGrammar.from_regex(r"[ a-z<|>é\n]{1,8}", tok, eos_token_ids=[13])
  allowed = np.asarray(allowed_tokens(g.mask(jnp.arange(g.num_states)), g.vocab_size))
  # Alone, "é" (byte 0xE9 in GPT-2's alphabet) and "©" (0xA9) are not UTF-8: all other tokens may start.
  assert g.vocab_size == 15 and not allowed[:, 13:].any() and np.flatnonzero(~allowed[0, :13]).tolist() == [9, 11]
  state = g.next_state(g.initial_state(), jnp.int32(10))  # "Ã" = byte 0xC3: the first half of "é"
  assert np.flatnonzero(np.asarray(allowed_tokens(g.mask(state), 15))).tolist() == [11]


@pytest.mark.parametrize(
  "call,match",
  [
    (lambda v: TokenGrammar.from_regex("(ab", v, vocab_size=V), "cannot compile pattern"),
    (lambda v: TokenGrammar.from_regex("z+", v, vocab_size=V), "cannot (compile pattern|spell)"),
    (lambda v: TokenGrammar.from_regex(5, v, vocab_size=V), "pattern must be a str"),
    (lambda v: TokenGrammar.from_regex("a", v), "vocab_size is required"),
    (lambda v: TokenGrammar.from_regex("a", v, vocab_size=3), r"EOS id must lie in \[0, 3\)"),
    (lambda v: TokenGrammar.from_regex("a", {"a": [0]}, vocab_size=V), "vocabulary must be"),
    (lambda v: TokenGrammar.from_regex("a+", oc.Vocabulary(0, {"a": [9]}), vocab_size=5), "vocab_size 5"),
    (lambda v: TokenGrammar.from_json_schema([1], v, vocab_size=V), "schema must be a dict or a JSON string"),
    (lambda v: TokenGrammar.from_json_schema("{oops", v, vocab_size=V), "schema is a str but not JSON"),
    (lambda v: TokenGrammar.from_json_schema({"type": "foo"}, v, vocab_size=V), "cannot turn schema"),
    (lambda v: TokenGrammar.from_regex("a", _byte_level_tokenizer()), "eos_token_ids is required"),
    (lambda v: outlines_vocabulary(_byte_level_tokenizer(), eos_token_ids=[99]), r"eos_token_ids must lie in"),
    (lambda v: outlines_vocabulary(v, eos_token_ids=[0]), "tokenizer must be a tokenizers.Tokenizer"),
  ],
)
def test_bad_input(call, match):
  with pytest.raises(ValueError, match=match):
    call(_vocabulary())


def test_schema_regex():
  assert schema_regex({"type": "boolean"}) == schema_regex('{"type": "boolean"}')


# --- Real tokenizers (slow: building a tokenizer from a GGUF file takes seconds) -----------------------------

QWEN_GGUF = os.path.expanduser("~/.cache/specdec_jax/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")


def _gguf_path(name):
  if name == "qwen":
    if not os.path.exists(QWEN_GGUF):
      pytest.skip(f"{QWEN_GGUF} is not cached")
    return QWEN_GGUF
  from specdec_jax.models.loaders.smollm2 import smollm2_gguf_path

  try:
    return smollm2_gguf_path()
  except (FileNotFoundError, ImportError) as e:
    pytest.skip(str(e))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen", "smollm2"])
def test_real_tokenizer_json_grammar(name):
  """At the real vocabulary: the tokenizer's own encoding of a valid text walks to acceptance, special and
  unused tokens are never allowed, and the tables stay small."""
  from specdec_jax.models.loaders.gguf import read_gguf_tokenizer_metadata, tokenizer_from_gguf

  path = _gguf_path(name)
  meta = read_gguf_tokenizer_metadata(path)
  tok = tokenizer_from_gguf(path)
  vocab_size = len(meta.tokens)
  barred = [i for i, kind in enumerate(meta.token_types) if kind != 1]  # control, user-defined, unused...
  schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}}
  g = TokenGrammar.from_json_schema(
    schema, tok, vocab_size=vocab_size, eos_token_ids=[meta.eos_token_id], exclude_token_ids=barred
  )
  assert g.vocab_size == vocab_size
  allowed = np.asarray(allowed_tokens(g.mask(jnp.arange(g.num_states)), vocab_size))
  assert not allowed[:, barred].any()
  assert allowed.sum(axis=1).max() > vocab_size // 2  # inside a string nearly every token is allowed
  ids = tok.encode('{"name": "Zoë \\"Z\\"", "n": -42}', add_special_tokens=False).ids
  state = g.initial_state()
  for i in ids:
    state = g.next_state(state, jnp.int32(i))
    assert int(state) >= 0, tok.decode([i])
  assert bool(g.accepts(state))
  assert g.size_bytes() < 8 * 2**20, g.table_sizes()
