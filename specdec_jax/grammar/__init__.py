"""Structured output: grammars as token automata on device (docs/structured.md).

  - `automaton`: `TokenAutomaton`, the protocol the decoding loops read a grammar through, and
    `TokenGrammar`, its implementation as compact device tables (`from_tables` for your own automaton).
  - `outlines`: building those tables from a regex or a JSON schema with outlines-core, and the
    outlines-core vocabulary of a `tokenizers.Tokenizer` (`TokenGrammar.from_regex` / `from_json_schema`).

`import specdec_jax.grammar` does not import outlines-core; building from a regex or a schema does.
"""

from specdec_jax.grammar.automaton import DEAD_STATE, TokenAutomaton, TokenGrammar
from specdec_jax.grammar.outlines import outlines_vocabulary, schema_regex, token_bytes

__all__ = ["DEAD_STATE", "TokenAutomaton", "TokenGrammar", "outlines_vocabulary", "schema_regex", "token_bytes"]
