"""Grammars from outlines-core: a regex or a JSON schema, compiled against a vocabulary into `TokenGrammar` tables.

outlines-core (`pip install 'specdec-jax[grammar]'`) compiles a regex into a token-level index: per state,
the tokens whose bytes keep the text a prefix of some match, and the state each one leads to. Its states are
arbitrary u32 ids, its final states carry an EOS self-transition, and its index may hold states the
initial state cannot reach. `regex_tables` turns it into `TokenGrammar.from_tables` arguments: it drops the
EOS transitions (acceptance says where EOS may go), keeps only the states reachable from the initial state
from which a complete match is still reachable (so an allowed token never leads into a dead end), and
renumbers them 0 .. S-1 in breadth-first order from the initial state (0).

outlines-core matches bytes: a vocabulary maps each token's *bytes* to its ids. `outlines_vocabulary`
builds that map from a `tokenizers.Tokenizer`, undoing the tokenizer's encoding of bytes into token strings
(GPT-2's byte-to-unicode characters such as "Ġ" for a space in byte-level BPE; "▁" and "<0x0A>" tokens in
SentencePiece-style vocabularies). Special tokens (EOS, chat-template tokens such as "<|im_start|>") are
left out, so a grammar never allows them.
"""

from __future__ import annotations

import collections
import importlib
import json

import numpy as np

from specdec_jax.grammar.automaton import _check_vocab_size


def _import_outlines_core():
  try:
    import outlines_core
  except ImportError as e:
    raise ImportError(
      "specdec_jax.grammar needs outlines-core to build grammars from a regex or a JSON schema: "
      "pip install 'specdec-jax[grammar]' (or pip install outlines-core)"
    ) from e
  return outlines_core


# --- Token strings -> bytes ---------------------------------------------------------------------------------


def _byte_level_chars() -> dict[str, int]:
  """GPT-2's byte-level alphabet, character -> byte: printable Latin-1 bytes stand for themselves, the other
  bytes (controls, space, 0x7F-0xA0, 0xAD) take the characters U+0100, U+0101, ... in byte order."""
  printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
  chars = {chr(b): b for b in printable}
  shifted = (b for b in range(256) if b not in set(printable))
  chars.update({chr(0x100 + i): b for i, b in enumerate(shifted)})
  return chars


def _decoder_types(tokenizer) -> set[str]:
  """The types of the tokenizer's decoder and of the decoders inside a `Sequence` decoder."""
  if tokenizer.decoder is None:
    return set()
  spec = json.loads(tokenizer.decoder.__getstate__())
  found = set()
  stack = [spec]
  while stack:
    item = stack.pop()
    found.add(item.get("type"))
    stack.extend(item.get("decoders") or [])
  return found


def token_bytes(tokenizer) -> dict[int, bytes]:
  """The bytes each token of a `tokenizers.Tokenizer` stands for, special tokens left out.

  Byte-level BPE (a `ByteLevel` decoder: GPT-2, Qwen2.5, SmolLM2, Llama 3) maps its token strings back
  through GPT-2's byte-to-unicode table ("Ġ{" -> b" {"); SentencePiece-style vocabularies (a `ByteFallback`
  or `Metaspace` decoder) turn "▁" into a space and "<0xNN>" into the byte NN; other tokenizers' strings
  are taken as UTF-8 text. Added tokens that are not special stand for their content.

  Args:
    tokenizer: a `tokenizers.Tokenizer`.

  Returns:
    {token id: bytes} for every token except the special ones.

  Example:
    >>> token_bytes(tokenizer)[4093]   # SmolLM2's "user"  # doctest: +SKIP
    b'user'
  """
  kinds = _decoder_types(tokenizer)
  added = tokenizer.get_added_tokens_decoder()
  byte_chars = _byte_level_chars() if "ByteLevel" in kinds else None
  sentencepiece = bool(kinds & {"ByteFallback", "Metaspace"})
  out = {}
  for text, token_id in tokenizer.get_vocab(with_added_tokens=True).items():
    if token_id in added:
      if not added[token_id].special:
        out[token_id] = added[token_id].content.encode("utf-8")
      continue
    if byte_chars is not None and all(c in byte_chars for c in text):
      out[token_id] = bytes(byte_chars[c] for c in text)
    elif sentencepiece and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
      out[token_id] = bytes([int(text[3:5], 16)])
    elif sentencepiece:
      out[token_id] = text.replace("\u2581", " ").encode("utf-8")
    else:
      out[token_id] = text.encode("utf-8")
  return out


def outlines_vocabulary(tokenizer, *, eos_token_ids, vocab_size: int | None = None, exclude_token_ids=()):
  """An `outlines_core.Vocabulary` (token bytes -> ids) of a `tokenizers.Tokenizer`.

  Left out: the special tokens, `eos_token_ids`, `exclude_token_ids` (e.g. a GGUF file's unused "[PAD...]"
  tokens, token type 5) and ids >= `vocab_size`. outlines-core's vocabulary needs one EOS id; it gets
  `eos_token_ids[0]` (the loop, not the grammar, decides where EOS goes).

  Args:
    tokenizer: a `tokenizers.Tokenizer` (the project's GGUF loaders return one).
    eos_token_ids: int or sequence of ints: the ids that end a sequence, in [0, vocab_size).
    vocab_size: the model's V (its logits' size), or None for the tokenizer's size with added tokens.
    exclude_token_ids: more ids the grammar must never allow.

  Returns:
    An `outlines_core.Vocabulary`.

  Example:
    >>> vocabulary = outlines_vocabulary(tokenizer, eos_token_ids=[151645, 151643])   # doctest: +SKIP
  """
  oc = _import_outlines_core()
  where = "outlines_vocabulary"
  if not (hasattr(tokenizer, "get_vocab") and hasattr(tokenizer, "get_added_tokens_decoder")):
    raise ValueError(f"{where}: tokenizer must be a tokenizers.Tokenizer, got {type(tokenizer).__name__}")
  if vocab_size is None:
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
  vocab_size = _check_vocab_size(vocab_size, where)
  eos = _check_ids(eos_token_ids, vocab_size, "eos_token_ids", where)
  if not eos:
    raise ValueError(f"{where}: eos_token_ids must name at least one id, got {eos_token_ids!r}")
  left_out = set(eos) | set(_check_ids(exclude_token_ids, vocab_size, "exclude_token_ids", where))
  by_bytes = collections.defaultdict(list)
  for token_id, text in token_bytes(tokenizer).items():
    if token_id < vocab_size and token_id not in left_out and text:
      by_bytes[text].append(token_id)
  return oc.Vocabulary(eos[0], dict(by_bytes))


def _check_ids(ids, vocab_size: int, name: str, where: str) -> list[int]:
  flat = np.asarray(ids).reshape(-1)
  if flat.size and not np.issubdtype(flat.dtype, np.integer):
    raise ValueError(f"{where}: {name} must be token ids (ints), got {ids!r}")
  if flat.size and (flat.min() < 0 or flat.max() >= vocab_size):
    raise ValueError(f"{where}: {name} must lie in [0, {vocab_size}) (vocab_size), got {ids!r}")
  return [int(i) for i in flat]


# --- Schema -> regex -> tables ------------------------------------------------------------------------------


def schema_regex(schema, whitespace_pattern: str | None = None) -> str:
  """The regex of the JSON texts valid under `schema`, by outlines-core's `build_regex_from_schema`.

  Args:
    schema: a JSON schema, as a dict or a JSON string.
    whitespace_pattern: the regex of the whitespace allowed between JSON tokens; None for outlines-core's
      default (at most one space).

  Example:
    >>> schema_regex({"type": "boolean"})
    '(true|false)'
  """
  _import_outlines_core()
  if isinstance(schema, dict):
    text = json.dumps(schema)
  elif isinstance(schema, str):
    try:
      json.loads(schema)
    except json.JSONDecodeError as e:
      raise ValueError(f"from_json_schema: schema is a str but not JSON ({e})") from None
    text = schema
  else:
    raise ValueError(f"from_json_schema: schema must be a dict or a JSON string, got {type(schema).__name__}")
  json_schema = importlib.import_module("outlines_core.json_schema")  # a submodule before 0.2.14, an attribute since
  try:
    return json_schema.build_regex_from_schema(text, whitespace_pattern)
  except (ValueError, TypeError) as e:
    raise ValueError(f"from_json_schema: outlines-core cannot turn schema into a regex: {e}") from None


def regex_tables(
  pattern: str, vocabulary, *, vocab_size: int | None = None, eos_token_ids=None, exclude_token_ids=()
) -> dict:
  """The `TokenGrammar.from_tables` arguments of the texts that fully match `pattern`, by outlines-core's Index.

  Args:
    pattern: the regex (outlines-core's syntax: Rust's `regex` crate, matched against the whole text).
    vocabulary: an `outlines_core.Vocabulary` (then `vocab_size` is required; its EOS id is an EOS id), or a
      `tokenizers.Tokenizer` (then `eos_token_ids` is required; see `outlines_vocabulary`).
    vocab_size: the model's V.
    eos_token_ids: int or ints: EOS ids; with an outlines-core vocabulary, extra ones beside its own.
    exclude_token_ids: with a tokenizer, ids the grammar must never allow.

  Returns:
    {edge_state, edge_token, edge_next, accepting, vocab_size, initial_state, eos_token_ids}: states
    renumbered from 0 (the initial state) and pruned to those on the way to a complete match.

  Raises:
    ValueError: an invalid regex, a vocabulary that cannot spell any match, a token id >= vocab_size...

  Example:
    >>> tables = regex_tables(r"a+", outlines_core.Vocabulary(1, {"a": [0]}), vocab_size=2)
    >>> tables["accepting"]   # [False, True]
  """
  oc = _import_outlines_core()
  where = "from_regex"
  if not isinstance(pattern, str):
    raise ValueError(f"{where}: pattern must be a str (a regex), got {type(pattern).__name__}")
  if isinstance(vocabulary, oc.Vocabulary):
    if vocab_size is None:
      raise ValueError(f"{where}: vocab_size is required with an outlines_core.Vocabulary (the model's V)")
    vocab_size = _check_vocab_size(vocab_size, where)
    extra = [] if eos_token_ids is None else _check_ids(eos_token_ids, vocab_size, "eos_token_ids", where)
    eos = _check_ids([vocabulary.get_eos_token_id()], vocab_size, "the vocabulary's EOS id", where) + extra
  elif hasattr(vocabulary, "get_vocab") and hasattr(vocabulary, "get_added_tokens_decoder"):
    if eos_token_ids is None:
      raise ValueError(f"{where}: eos_token_ids is required with a tokenizers.Tokenizer vocabulary")
    vocab_size = vocabulary.get_vocab_size(with_added_tokens=True) if vocab_size is None else vocab_size
    vocabulary = outlines_vocabulary(
      vocabulary, eos_token_ids=eos_token_ids, vocab_size=vocab_size, exclude_token_ids=exclude_token_ids
    )
    eos = _check_ids(eos_token_ids, vocab_size, "eos_token_ids", where)
  else:
    raise ValueError(
      f"{where}: vocabulary must be an outlines_core.Vocabulary or a tokenizers.Tokenizer, got "
      f"{type(vocabulary).__name__}"
    )
  try:
    index = oc.Index(pattern, vocabulary)
  except ValueError as e:
    raise ValueError(
      f"{where}: outlines-core cannot compile pattern {_short(pattern)} on this vocabulary: {e}"
    ) from None
  tables = _index_tables(index, set(eos), where)
  if tables["edge_token"].size and tables["edge_token"].max() >= vocab_size:
    raise ValueError(
      f"{where}: the vocabulary has token id {tables['edge_token'].max()} >= vocab_size {vocab_size}; "
      f"the vocabulary does not match the model"
    )
  return dict(tables, vocab_size=vocab_size, eos_token_ids=eos)


def _short(pattern: str) -> str:
  return repr(pattern if len(pattern) <= 80 else pattern[:77] + "...")


def _index_tables(index, eos: set[int], where: str) -> dict:
  """outlines-core's index -> edges of its useful states, renumbered (the initial state is 0)."""
  transitions = index.get_transitions()  # {state: {token: next state}}
  finals = set(index.get_final_states())
  initial = index.get_initial_state()
  src, tok, dst = [], [], []
  for state, row in transitions.items():
    src.append(np.full(len(row), state, np.int64))
    tok.append(np.fromiter(row.keys(), np.int64, len(row)))
    dst.append(np.fromiter(row.values(), np.int64, len(row)))
  src, tok, dst = (np.concatenate(x) if x else np.zeros(0, np.int64) for x in (src, tok, dst))
  keep = ~np.isin(tok, list(eos))
  src, tok, dst = src[keep], tok[keep], dst[keep]

  # The states on the way to a complete match: reachable from the initial state, and a final state reachable.
  pairs = np.unique(np.stack([src, dst], axis=1), axis=0) if src.size else np.zeros((0, 2), np.int64)
  forward, backward = collections.defaultdict(list), collections.defaultdict(list)
  for a, b in pairs.tolist():
    forward[a].append(b)
    backward[b].append(a)
  order = _breadth_first([initial], forward)
  useful = set(_breadth_first(sorted(finals), backward))
  if initial not in useful:
    raise ValueError(f"{where}: the vocabulary cannot spell any text that matches the pattern")
  order = [s for s in order if s in useful]
  old_ids = np.asarray(order, np.int64)
  by_id = np.argsort(old_ids)

  def renumber(x):  # old id -> position in `order`, -1 for a dropped state
    at = np.clip(np.searchsorted(old_ids[by_id], x), 0, old_ids.size - 1)
    return np.where(old_ids[by_id][at] == x, by_id[at], -1)

  new_src, new_dst = renumber(src), renumber(dst)
  keep = (new_src >= 0) & (new_dst >= 0)
  return dict(
    edge_state=new_src[keep],
    edge_token=tok[keep],
    edge_next=new_dst[keep],
    accepting=np.array([s in finals for s in order], np.bool_),
    initial_state=0,
  )


def _breadth_first(start: list[int], neighbours) -> list[int]:
  seen = dict.fromkeys(start)
  queue = collections.deque(start)
  while queue:
    for n in neighbours.get(queue.popleft(), ()):
      if n not in seen:
        seen[n] = None
        queue.append(n)
  return list(seen)
