"""`TokenAutomaton`, the protocol of a grammar on device, and `TokenGrammar`, its table-driven implementation.

A token automaton reads the generated tokens one at a time. Its state is an int32; the dead state is -1
(a token the grammar does not allow was emitted). In each state it knows:

  - `mask(s)`: the tokens allowed next, as a packed bitmask (`specdec_jax.sampling.masks`), EOS excluded;
  - `accepts(s)`: whether the text so far is a complete match, so EOS may be emitted here (the loop adds
    the EOS bits to the mask itself where this holds);
  - `next_state(s, t)`: the state after token t.

A state that accepts and allows no token means "must stop": only EOS is allowed there.

`TokenGrammar` keeps these tables on device, in a compact form (V = vocabulary size, W = ceil(V / 32),
S = states, E = transitions, M = distinct masks):

    mask_table    int32 [M, W]   the distinct masks of allowed tokens (many states share one)
    mask_id       int32 [S]      row of mask_table for each state
    accepting     bool  [S]
    default_next  int32 [S]      where most of the state's allowed tokens lead
    row_start     int32 [S + 1]  CSR of the exceptions, the allowed tokens that lead elsewhere: state s's
                                 are entries row_start[s] .. row_start[s + 1] - 1 of
    edge_token    int32 [X]      their tokens, increasing within a state
    edge_next     int32 [X]      the state each one leads to

    state 0: row_start[0]=0 --+            state 1: row_start[1]=3 --+
    edge_token  [ 17,  40, 912 | 17, 55 | ... ]
    edge_next   [  1,   1,   4 |  2,  0 | ... ]

`next_state(s, t)` is -1 unless the mask of s allows t; then the exception's state if t is among the
exceptions of s (a binary search of its slice of `edge_token`, a fixed number of steps), else
`default_next[s]`. Inside an unbounded JSON string nearly every token leads back to the same state, so a
state of ~150k allowed tokens keeps only its few exceptions (the quote, the backslash...). A dense [S, V]
table would take S * 151936 * 4 bytes (600 KB a state at Qwen2.5's vocabulary).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.sampling.masks import BITS, mask_words

DEAD_STATE = -1


@runtime_checkable
class TokenAutomaton(Protocol):
  """What the decoding loops need of a grammar: a JAX pytree (its arrays are leaves, so it passes through `jit`
  as an argument) with these members. Every method takes any leading shape `[...]`.

  The dead state is -1: `mask(-1)` is all zeros, `accepts(-1)` is False and `next_state(-1, t)` is -1. The
  methods must be safe for any int32 state in [-1, S) and any token in [0, V) (no out-of-bounds read, no
  NaN), under `jit` and `vmap`; anything else is clipped or guarded.

  Attributes:
    vocab_size: static V (pytree aux data).

  Example:
    >>> isinstance(TokenGrammar.from_tables([0], [7], [0], [True], vocab_size=8), TokenAutomaton)
    True
  """

  vocab_size: int

  def initial_state(self) -> jax.Array:
    """int32 []: the state before any token."""
    ...

  def mask(self, states: jax.Array) -> jax.Array:
    """int32 [...] -> int32 [..., ceil(V / 32)]: the tokens allowed in each state, EOS tokens not included."""
    ...

  def next_state(self, states: jax.Array, tokens: jax.Array) -> jax.Array:
    """int32 [...], int32 [...] -> int32 [...]: the state after emitting `tokens`; -1 for a token not allowed
    in the state, and for any token from the dead state."""
    ...

  def accepts(self, states: jax.Array) -> jax.Array:
    """int32 [...] -> bool [...]: the text so far is a complete match (EOS may be emitted here)."""
    ...


def _leaf(x, dtype) -> jax.Array:
  return jnp.asarray(np.asarray(x, dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenGrammar:
  """A `TokenAutomaton` held as device tables (see the module docstring for the picture).

  Build one with `from_regex`, `from_json_schema` (both with outlines-core) or `from_tables` (your own
  automaton). The arrays are pytree leaves; `vocab_size` and `search_steps` are static.

  Attributes:
    mask_table: int32 [M, ceil(V / 32)]: the distinct masks of allowed tokens.
    mask_id: int32 [S]: each state's row of `mask_table`.
    accepting: bool [S]: the states where the text so far is a complete match.
    default_next: int32 [S]: the state most of s's allowed tokens lead to (-1 where s allows none).
    row_start: int32 [S + 1]: state s's exceptions (allowed tokens not leading to `default_next[s]`) are
      `edge_*[row_start[s]:row_start[s + 1]]`.
    edge_token: int32 [max(X, 1)]: the exceptions' tokens, increasing within each state.
    edge_next: int32 [max(X, 1)]: the state each exception leads to.
    initial: int32 []: the initial state.
    vocab_size: static V.
    search_steps: static number of binary-search steps of `next_state` (enough for the longest exception row).

  Example:
    >>> from outlines_core import Vocabulary
    >>> vocabulary = Vocabulary(3, {"1": [0], "2": [1], "12": [2]})
    >>> g = TokenGrammar.from_regex(r"[12]{2}", vocabulary, vocab_size=4)
    >>> s = g.next_state(g.initial_state(), jnp.int32(2))   # "12"
    >>> bool(g.accepts(s)), g.mask(s).shape                   # a full match; no token may follow
    (True, (1,))
  """

  mask_table: jax.Array  # int32 [M, W]
  mask_id: jax.Array  # int32 [S]
  accepting: jax.Array  # bool [S]
  default_next: jax.Array  # int32 [S]
  row_start: jax.Array  # int32 [S + 1]
  edge_token: jax.Array  # int32 [max(X, 1)]
  edge_next: jax.Array  # int32 [max(X, 1)]
  initial: jax.Array  # int32 []
  vocab_size: int = dataclasses.field(metadata=dict(static=True))
  search_steps: int = dataclasses.field(metadata=dict(static=True))

  # --- The protocol -------------------------------------------------------------------------------------

  def initial_state(self) -> jax.Array:
    """int32 []: the state before any token.

    Example:
      >>> g.initial_state()   # Array(0, dtype=int32) for grammars built from outlines-core
    """
    return self.initial

  def _valid(self, states):
    states = jnp.asarray(states, jnp.int32)
    valid = (states >= 0) & (states < self.num_states)
    return valid, jnp.clip(states, 0, self.num_states - 1)

  def mask(self, states) -> jax.Array:
    """The tokens allowed in each state, EOS excluded; all zeros for the dead state -1 (or any state out of range).

    Args:
      states: int32 [...].

    Returns:
      int32 [..., ceil(V / 32)]: bit v % 32 of word v // 32 set when token v is allowed
      (`specdec_jax.sampling.masks.allowed_tokens` unpacks it).

    Example:
      >>> g.mask(jnp.array([[0, -1]])).shape   # [1, 2, W]
    """
    valid, clipped = self._valid(states)
    rows = self.mask_table[self.mask_id[clipped]]
    return jnp.where(valid[..., None], rows, jnp.zeros((), jnp.int32))

  def accepts(self, states) -> jax.Array:
    """Whether the text so far is a complete match (EOS may be emitted); False for the dead state.

    Args:
      states: int32 [...].

    Returns:
      bool [...].

    Example:
      >>> g.accepts(jnp.array([-1, 0]))
    """
    valid, clipped = self._valid(states)
    return valid & self.accepting[clipped]

  def next_state(self, states, tokens) -> jax.Array:
    """The state after emitting `tokens`: -1 (dead) for a token the state does not allow, a token outside
    [0, V), or any token from the dead state.

    The mask's bit says whether the token is allowed; a binary search of the state's exceptions
    (`search_steps` steps, every element at once) says where it leads, `default_next` if it is none of them.

    Args:
      states: int32 [...].
      tokens: int32 [...], the same shape.

    Returns:
      int32 [...].

    Example:
      >>> g.next_state(jnp.zeros((2, 5), jnp.int32), jnp.ones((2, 5), jnp.int32)).shape
      (2, 5)
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    valid, clipped = self._valid(states)
    if jnp.shape(tokens) != jnp.shape(clipped):
      raise ValueError(
        f"TokenGrammar.next_state: states and tokens must have the same shape, got "
        f"{list(jnp.shape(clipped))} and {list(jnp.shape(tokens))}"
      )
    last = self.edge_token.shape[0] - 1
    lo, hi = self.row_start[clipped], self.row_start[clipped + 1]
    end = hi

    def step(_, bounds):
      # Lower bound: the first entry of [lo, hi) whose token is >= the one searched for.
      lo, hi = bounds
      open_ = lo < hi
      mid = (lo + hi) // 2
      below = self.edge_token[jnp.clip(mid, 0, last)] < tokens
      return jnp.where(open_ & below, mid + 1, lo), jnp.where(open_ & ~below, mid, hi)

    lo, _ = jax.lax.fori_loop(0, self.search_steps, step, (lo, hi), unroll=True)
    at = jnp.clip(lo, 0, last)
    exception = (lo < end) & (self.edge_token[at] == tokens)
    in_vocab = (tokens >= 0) & (tokens < self.vocab_size)
    clipped_tokens = jnp.clip(tokens, 0, self.vocab_size - 1)
    word = self.mask_table[self.mask_id[clipped], clipped_tokens // BITS]
    bit = jax.lax.shift_right_logical(word, clipped_tokens % BITS) & 1
    allowed = valid & in_vocab & (bit == 1)
    following = jnp.where(exception, self.edge_next[at], self.default_next[clipped])
    return jnp.where(allowed, following, jnp.int32(DEAD_STATE))

  # --- Sizes --------------------------------------------------------------------------------------------

  @property
  def num_states(self) -> int:
    """S, the number of states (not counting the dead state)."""
    return self.mask_id.shape[0]

  @property
  def num_exceptions(self) -> int:
    """X, the number of transitions held in the CSR lists (those not leading to their state's `default_next`)."""
    return int(self.row_start[-1])

  @property
  def num_masks(self) -> int:
    """M, the number of distinct masks in `mask_table`."""
    return self.mask_table.shape[0]

  def table_sizes(self) -> dict[str, int]:
    """Bytes of each device table.

    Example:
      >>> g.table_sizes()   # {'mask_table': 2 * 4748 * 4, 'mask_id': ..., ...}
    """
    return {f.name: int(getattr(self, f.name).nbytes) for f in dataclasses.fields(self) if not f.metadata}

  def size_bytes(self) -> int:
    """Bytes of all device tables together.

    Example:
      >>> g.size_bytes() == sum(g.table_sizes().values())
      True
    """
    return sum(self.table_sizes().values())

  # --- One program for many grammars -------------------------------------------------------------------

  def padded(
    self,
    *,
    num_states: int | None = None,
    num_masks: int | None = None,
    num_exceptions: int | None = None,
    search_steps: int | None = None,
  ) -> TokenGrammar:
    """The same automaton in tables of the given sizes, so that grammars padded alike share one compiled loop.

    A jitted loop compiles anew for each new shape of the tables (and each `search_steps`); a server with
    many schemas pads each grammar to a few bucket sizes instead. Padded states allow nothing, never
    accept and lead nowhere (no transition reaches them); they read a mask row of zeros, so padding the
    states needs `num_masks` >= M + 1. Padded exceptions lie past every state's row and are never read.

    Args:
      num_states: S' >= S (None: S).
      num_masks: M' >= M, and >= M + 1 when the states are padded (None: M, or M + 1 then).
      num_exceptions: X' >= the exception arrays' length (None: keep it).
      search_steps: >= this grammar's (None: keep it); enough for the longest row of any grammar sharing
        the program.

    Returns:
      A `TokenGrammar` whose `mask`, `next_state` and `accepts` agree with this one on every state in
      [-1, S) and every token.

    Example:
      >>> a = g1.padded(num_states=64, num_masks=32, num_exceptions=4096, search_steps=13)   # doctest: +SKIP
      >>> b = g2.padded(num_states=64, num_masks=32, num_exceptions=4096, search_steps=13)   # the same program
    """
    where = "TokenGrammar.padded"
    s, m, x = self.num_states, self.num_masks, self.edge_token.shape[0]
    num_states = s if num_states is None else num_states
    grow = num_states > s
    num_masks = (m + 1 if grow else m) if num_masks is None else num_masks
    num_exceptions = x if num_exceptions is None else num_exceptions
    search_steps = self.search_steps if search_steps is None else search_steps
    for name, value, least in (
      ("num_states", num_states, s),
      ("num_masks", num_masks, m + 1 if grow else m),
      ("num_exceptions", num_exceptions, x),
      ("search_steps", search_steps, self.search_steps),
    ):
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < least:
        raise ValueError(f"{where}: {name} must be an int >= {least} for this grammar, got {value!r}")
    extra_s, extra_m, extra_x = num_states - s, num_masks - m, num_exceptions - x
    pad = lambda a, n, value: jnp.concatenate([a, jnp.full((n,) + a.shape[1:], value, a.dtype)])  # noqa: E731
    return TokenGrammar(
      mask_table=pad(self.mask_table, extra_m, 0),
      mask_id=pad(self.mask_id, extra_s, m),  # row m: a padded row of zeros
      accepting=pad(self.accepting, extra_s, False),
      default_next=pad(self.default_next, extra_s, DEAD_STATE),
      row_start=pad(self.row_start, extra_s, self.row_start[-1]),  # empty rows
      edge_token=pad(self.edge_token, extra_x, 0),
      edge_next=pad(self.edge_next, extra_x, DEAD_STATE),
      initial=self.initial,
      vocab_size=self.vocab_size,
      search_steps=int(search_steps),
    )

  # --- Constructors -------------------------------------------------------------------------------------

  @classmethod
  def from_tables(
    cls,
    edge_state,
    edge_token,
    edge_next,
    accepting,
    *,
    vocab_size: int,
    initial_state: int = 0,
    eos_token_ids=(),
  ) -> TokenGrammar:
    """A `TokenGrammar` from the transitions of your own automaton, as NumPy (or list) arrays on the host.

    States are 0 .. S-1 (S = len(accepting)); a state's allowed tokens are exactly those with a
    transition. Transitions on `eos_token_ids` are dropped (the loop allows EOS where `accepting`).

    Args:
      edge_state: int [E]: the state each transition leaves.
      edge_token: int [E]: its token, in [0, vocab_size); at most one transition per (state, token).
      edge_next: int [E]: the state it leads to, in [0, S).
      accepting: bool [S]: the states where the text so far is a complete match.
      vocab_size: V.
      initial_state: the state before any token, in [0, S).
      eos_token_ids: token ids whose transitions are dropped.

    Returns:
      A `TokenGrammar`.

    Raises:
      ValueError: naming the argument, for mismatched lengths, ids out of range or a repeated transition.

    Example:
      >>> # "a" (token 0) then any number of "b" (token 1); vocabulary of 3 tokens, EOS = 2
      >>> g = TokenGrammar.from_tables([0, 1], [0, 1], [1, 1], [False, True], vocab_size=3)
      >>> int(g.next_state(jnp.int32(0), jnp.int32(1)))   # "b" first: dead
      -1
    """
    vocab_size = _check_vocab_size(vocab_size, "TokenGrammar.from_tables")
    accepting = np.asarray(accepting)
    if accepting.ndim != 1 or accepting.shape[0] < 1 or accepting.dtype != np.bool_:
      raise ValueError(
        f"TokenGrammar.from_tables: accepting must be bool [S] with S >= 1, got {accepting.dtype} "
        f"{list(accepting.shape)}"
      )
    num_states = accepting.shape[0]
    edges = [np.asarray(x) for x in (edge_state, edge_token, edge_next)]
    names = ("edge_state", "edge_token", "edge_next")
    for name, x in zip(names, edges):
      if x.ndim != 1 or x.shape != edges[0].shape or not (x.size == 0 or np.issubdtype(x.dtype, np.integer)):
        raise ValueError(
          f"TokenGrammar.from_tables: {name} must be int [E] like edge_state ({list(edges[0].shape)}), got "
          f"{x.dtype} {list(x.shape)}"
        )
    edge_state, edge_token, edge_next = (x.astype(np.int64) for x in edges)
    for name, x, bound in zip(names, (edge_state, edge_token, edge_next), (num_states, vocab_size, num_states)):
      if x.size and (x.min() < 0 or x.max() >= bound):
        raise ValueError(f"TokenGrammar.from_tables: {name} must lie in [0, {bound}), got [{x.min()}, {x.max()}]")
    if not 0 <= int(initial_state) < num_states:
      raise ValueError(f"TokenGrammar.from_tables: initial_state must lie in [0, {num_states}), got {initial_state}")
    eos = np.asarray(eos_token_ids, np.int64).reshape(-1)
    keep = ~np.isin(edge_token, eos)
    edge_state, edge_token, edge_next = edge_state[keep], edge_token[keep], edge_next[keep]

    order = np.lexsort((edge_token, edge_state))
    edge_state, edge_token, edge_next = edge_state[order], edge_token[order], edge_next[order]
    repeated = (edge_state[1:] == edge_state[:-1]) & (edge_token[1:] == edge_token[:-1])
    if np.any(repeated):
      i = int(np.argmax(repeated))
      raise ValueError(
        f"TokenGrammar.from_tables: (edge_state, edge_token) = ({edge_state[i]}, {edge_token[i]}) has more than "
        f"one transition"
      )
    row_start = np.concatenate([[0], np.cumsum(np.bincount(edge_state, minlength=num_states))])
    mask_table, mask_id = _distinct_masks(edge_state, edge_token, row_start, vocab_size)
    default_next = _most_common_next(edge_state, edge_next, num_states)
    exception = edge_next != default_next[edge_state]
    edge_state, edge_token, edge_next = edge_state[exception], edge_token[exception], edge_next[exception]
    counts = np.bincount(edge_state, minlength=num_states)
    row_start = np.concatenate([[0], np.cumsum(counts)])
    # An empty exception list still gets one (never matched) entry, so the search never gathers from an empty array.
    pad = 1 if edge_token.size == 0 else 0
    return cls(
      mask_table=_leaf(mask_table, np.int32),
      mask_id=_leaf(mask_id, np.int32),
      accepting=_leaf(accepting, np.bool_),
      default_next=_leaf(default_next, np.int32),
      row_start=_leaf(row_start, np.int32),
      edge_token=_leaf(np.concatenate([edge_token, np.zeros(pad, np.int64)]), np.int32),
      edge_next=_leaf(np.concatenate([edge_next, np.zeros(pad, np.int64)]), np.int32),
      initial=_leaf(initial_state, np.int32),
      vocab_size=vocab_size,
      search_steps=_search_steps(int(counts.max(initial=0))),
    )

  @classmethod
  def from_regex(cls, pattern: str, vocabulary, **kwargs) -> TokenGrammar:
    """A `TokenGrammar` for the texts that fully match `pattern`, built with outlines-core.

    See `specdec_jax.grammar.outlines.regex_tables` for the arguments (`vocabulary`: an
    `outlines_core.Vocabulary` with `vocab_size=`, or a `tokenizers.Tokenizer` with `eos_token_ids=`).

    Example:
      >>> g = TokenGrammar.from_regex(r"[0-9]+", tokenizer, eos_token_ids=[2])   # doctest: +SKIP
    """
    from specdec_jax.grammar.outlines import regex_tables

    return cls.from_tables(**regex_tables(pattern, vocabulary, **kwargs))

  @classmethod
  def from_json_schema(cls, schema, vocabulary, *, whitespace_pattern: str | None = None, **kwargs) -> TokenGrammar:
    """A `TokenGrammar` for the JSON texts valid under `schema` (a dict or a JSON string), built with
    outlines-core's `json_schema.build_regex_from_schema` and then `from_regex`.

    Args:
      schema: the JSON schema, a dict or a JSON string.
      vocabulary: as for `from_regex`.
      whitespace_pattern: the regex of whitespace allowed between JSON tokens, or None for outlines-core's
        default.
      **kwargs: as for `from_regex` (`vocab_size`, `eos_token_ids`, ...).

    Example:
      >>> schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
      >>> g = TokenGrammar.from_json_schema(schema, tokenizer, eos_token_ids=[2])   # doctest: +SKIP
    """
    from specdec_jax.grammar.outlines import schema_regex

    return cls.from_regex(schema_regex(schema, whitespace_pattern), vocabulary, **kwargs)


def _check_vocab_size(vocab_size, where: str) -> int:
  if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1:
    raise ValueError(f"{where}: vocab_size must be a positive int, got {vocab_size!r}")
  return int(vocab_size)


def _search_steps(longest_row: int) -> int:
  # A lower-bound search over n entries settles in ceil(log2(n + 1)) halvings.
  return max(1, math.ceil(math.log2(longest_row + 1)))


def _most_common_next(edge_state, edge_next, num_states: int):
  """int [S]: per state, the next state of most of its transitions (the smallest on ties; -1 for none)."""
  default_next = np.full(num_states, DEAD_STATE, np.int64)
  if edge_state.size == 0:
    return default_next
  pairs, counts = np.unique(np.stack([edge_state, edge_next], axis=1), axis=0, return_counts=True)
  order = np.lexsort((pairs[:, 1], -counts, pairs[:, 0]))  # by state, then most frequent, then smallest
  first = order[np.concatenate([[True], pairs[order[1:], 0] != pairs[order[:-1], 0]])]
  default_next[pairs[first, 0]] = pairs[first, 1]
  return default_next


def _distinct_masks(edge_state, edge_token, row_start, vocab_size: int):
  """(mask_table int32 [M, W], mask_id [S]) from transitions sorted by (state, token): states with the same
  token set share a row."""
  num_states = row_start.shape[0] - 1
  ids: dict[bytes, int] = {}
  mask_id = np.zeros(num_states, np.int64)
  members = []
  for s in range(num_states):
    key = edge_token[row_start[s] : row_start[s + 1]].tobytes()
    if key not in ids:
      ids[key] = len(ids)
      members.append(s)
    mask_id[s] = ids[key]
  words = np.zeros((len(members), mask_words(vocab_size)), np.uint32)
  for m, s in enumerate(members):
    tokens = edge_token[row_start[s] : row_start[s + 1]]
    np.bitwise_or.at(words[m], tokens // BITS, np.left_shift(np.uint32(1), (tokens % BITS).astype(np.uint32)))
  return words.view(np.int32), mask_id
