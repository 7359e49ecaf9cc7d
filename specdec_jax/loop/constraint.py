"""Constrained decoding inside the loops: a grammar (a token automaton) and the EOS ids as masks of allowed tokens.

Words used here and in the loops, each for one thing:

  - grammar: the caller's token automaton (`TokenAutomaton`), a pytree whose arrays ride through jit.
  - grammar state: int32 per row; -1 is the dead state (allows nothing, never accepts, stays dead).
  - allowed set of a state s: the tokens of `grammar.mask(s)`, plus the loop's EOS ids where
    `grammar.accepts(s)` (the grammar's masks never hold EOS). A row samples from the target's law over
    its allowed set (`sampling.masks`: the mask acts as a -inf bias before temperature and the filters).
  - a row *ends by the grammar* after a token whose state has an empty allowed set: a complete match with
    nothing more allowed and no EOS id to emit (eos_token_id None), or a dead end of an ill-formed grammar.
    The token is kept; nothing follows it. A row whose initial state has an empty allowed set emits no
    token at all (length 0).

A chain round walks the grammar along its drafts; position i of the verifier scores the token after
d_1 .. d_i, so it reads the allowed set of s_i:

    state:     s_0 --d_1--> s_1 --d_2--> s_2  ...  --d_K--> s_K
    position:   0            1            2                  K
    mask:      allowed(s_0)  allowed(s_1) ...                allowed(s_K)

A draft outside allowed(s_{i-1}) is rejected at position i-1, so the positions after it (dead state) are
never reached; their mask is made all ones (`sampler_masks`) so that no sampler ever sees an empty
position, which it could only answer with token 0. The same holds for any empty allowed set: the token
sampled there is cut by `kept_tokens` (the row ends by the grammar before it).

A *single position* is one whose allowed set holds exactly one token, its *sole token* (an accepting state
whose mask holds one token is not single where an EOS id is allowed too). Drafts that are not drawn from the
masked law (prompt lookup) get each single position's sole token in place of their own draft, and the walk
goes on from it (`walk_sole`): a lookup draft is a deterministic proposal given the context and so is the
sole token (its q a point mass), and the verifier accepts a point-mass draft d with probability p(d), which
is 1 at a single position (the masked target law is a point mass there). Masked drafts (a draft model, EAGLE)
already are the sole token there.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.grammar.automaton import TokenAutomaton
from specdec_jax.sampling.masks import BITS, mask_words

__all__ = ["Constraint", "TokenAutomaton", "check_grammar", "sole_token"]

_METHODS = ("initial_state", "mask", "next_state", "accepts")


def check_grammar(where: str, grammar, vocab_size: int) -> None:
  """Refuses (ValueError, naming `grammar`) what the loops cannot read as a token automaton.

  Checked before tracing: the protocol's methods, an int `vocab_size` equal to the target's V, array
  leaves (the grammar is a jit argument), and the dtypes and shapes of the four members on a state [1].

  Args:
    where: the caller's name, for the message.
    grammar: the object passed as `grammar=`.
    vocab_size: the target's V.

  Example:
    >>> check_grammar("generate", grammar, 64)   # doctest: +SKIP  (None, or a ValueError naming grammar)
  """
  missing = [m for m in _METHODS if not callable(getattr(grammar, m, None))]
  v = getattr(grammar, "vocab_size", None)
  if missing or not isinstance(v, (int, np.integer)) or isinstance(v, bool):
    raise ValueError(
      f"{where}: grammar must be a token automaton with an int vocab_size and the methods initial_state(), "
      f"mask(states), next_state(states, tokens), accepts(states); {type(grammar).__name__} lacks "
      f"{missing or ['an int vocab_size']}"
    )
  if int(v) != int(vocab_size):
    raise ValueError(f"{where}: grammar.vocab_size={int(v)} must equal the target's vocabulary size V={vocab_size}")
  leaves = jax.tree_util.tree_leaves(grammar)
  if not all(isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, bool)) for x in leaves):
    raise ValueError(
      f"{where}: grammar must be a JAX pytree of arrays (e.g. a registered dataclass; its tables ride through "
      f"jit), got {type(grammar).__name__} with leaves of types {sorted({type(x).__name__ for x in leaves})}"
    )
  # The members' shapes depend on the methods, the structure and the leaves' shapes and dtypes alone
  # (eval_shape traces them), so a grammar passed call after call is traced once: tracing costs milliseconds
  # of host time a call, as much as a short generation's device time.
  key = _structure_key(grammar, leaves, int(v))
  if key is not None and key in _MEMBER_ERRORS:
    error = _MEMBER_ERRORS[key]
  else:
    error = _member_error(grammar, int(v))
    if key is not None:
      if len(_MEMBER_ERRORS) >= 256:  # bounded: a long-lived process may see many grammar shapes
        _MEMBER_ERRORS.clear()
      _MEMBER_ERRORS[key] = error
  if error is not None:
    raise ValueError(f"{where}: {error}")


_MEMBER_ERRORS: dict = {}  # structure key -> None (the members have the protocol's shapes) or the message


def _structure_key(grammar, leaves, vocab_size: int):
  """A hashable key of what `_member_error`'s answer depends on, or None where a part is unhashable."""
  avals = tuple((type(x), x) if isinstance(x, (int, float, bool)) else (np.shape(x), str(x.dtype)) for x in leaves)
  # The class's methods belong to the key too: the same structure under other code is another automaton.
  methods = tuple(getattr(type(grammar), m, None) for m in _METHODS)
  key = (jax.tree_util.tree_structure(grammar), avals, vocab_size, methods)
  try:
    hash(key)
  except TypeError:
    return None
  return key


def _member_error(grammar, v: int) -> str | None:
  """None where the four members give the protocol's dtypes and shapes on a state [1], else the message."""
  words = mask_words(v)

  def members(g):
    s = jnp.asarray(g.initial_state())
    states = jnp.reshape(s, (1,))
    return s, g.mask(states), g.next_state(states, jnp.zeros((1,), jnp.int32)), g.accepts(states)

  try:
    got = jax.eval_shape(members, grammar)
  except Exception as e:  # noqa: BLE001 - any failure of the user's methods is reported as a grammar error
    return f"grammar's methods fail on a state [1]: {type(e).__name__}: {e}"
  want = ((), jnp.int32), ((1, words), jnp.int32), ((1,), jnp.int32), ((1,), jnp.bool_)
  names = ("initial_state()", "mask(states [1])", "next_state(states [1], tokens [1])", "accepts(states [1])")
  for name, x, (shape, dtype) in zip(names, got, want):
    if x.shape != shape or x.dtype != dtype:
      return (
        f"grammar.{name} must give {jnp.dtype(dtype).name}{list(shape)} (V={v}: {words} mask "
        f"words), got {x.dtype.name}{list(x.shape)}"
      )
  return None


def _words(ids, vocab_size: int, *, fill: bool = False) -> np.ndarray:
  """int32 [ceil(V/32)] with the bits of `ids` set (fill: of every id < V), a trace-time constant.

  `sampling.masks.pack_bitmask`'s packing in NumPy: this runs while the loop is traced, also inside the
  rows-only path's shard_map, where evaluating `pack_bitmask` eagerly (`ensure_compile_time_eval`) fails on
  the mesh's manual axes.
  """
  bits = np.zeros(mask_words(vocab_size) * BITS, bool)
  bits[np.arange(vocab_size) if fill else list(ids)] = True
  weights = np.left_shift(np.uint64(1), np.arange(BITS, dtype=np.uint64))
  words = (bits.reshape(-1, BITS) * weights[None, :]).sum(axis=1).astype(np.uint32)
  return words.view(np.int32)


@dataclasses.dataclass(frozen=True)
class Constraint:
  """A grammar with the loop's (static) EOS ids, as the loops use it inside the program.

  Attributes:
    grammar: the `TokenAutomaton` (its arrays traced).
    eos: the EOS ids, allowed where a state accepts.
  """

  grammar: TokenAutomaton
  eos: tuple[int, ...]

  @property
  def vocab_size(self) -> int:
    return int(self.grammar.vocab_size)

  def initial(self, b: int) -> jax.Array:
    """int32 [B]: every row's initial state."""
    return jnp.broadcast_to(jnp.asarray(self.grammar.initial_state(), jnp.int32), (b,))

  def allowed(self, states) -> jax.Array:
    """int32 [..., W]: the allowed set of each state (bits of ids >= V cleared)."""
    states = jnp.asarray(states, jnp.int32)
    ones = (1,) * states.ndim
    words = jnp.asarray(self.grammar.mask(states), jnp.int32) & _words((), self.vocab_size, fill=True).reshape(
      ones + (-1,)
    )
    if self.eos:
      # EOS only where the state accepts, also for an automaton whose masks (against the protocol) hold it.
      eos_words = _words(self.eos, self.vocab_size).reshape(ones + (-1,))
      words = words & ~eos_words
      words = jnp.where(jnp.asarray(self.grammar.accepts(states), bool)[..., None], words | eos_words, words)
    return words

  def ends(self, states) -> jax.Array:
    """bool [...]: the state's allowed set is empty (a row ends by the grammar after reaching it)."""
    return ~jnp.any(self.allowed(states) != 0, axis=-1)

  def sampler_masks(self, states, words=None) -> tuple[jax.Array, jax.Array]:
    """(int32 [..., W] masks for a sampler, bool [...] empty): the allowed sets, all ones where empty.

    An empty position is never emitted (a rejected draft's successors, a finished row, or a token the
    row's end cuts), and all ones keeps every sampler's law there well defined. `words`: the states'
    allowed sets where already at hand (`walk_sole`), else None.
    """
    words = self.allowed(states) if words is None else words
    empty = ~jnp.any(words != 0, axis=-1)
    return jnp.where(empty[..., None], jnp.int32(-1), words), empty

  def advance(self, states, tokens) -> jax.Array:
    """int32 [...]: the states after `tokens`; a token outside [0, V) gives the dead state -1."""
    tokens = jnp.asarray(tokens, jnp.int32)
    valid = (tokens >= 0) & (tokens < self.vocab_size)
    nxt = self.grammar.next_state(jnp.asarray(states, jnp.int32), jnp.where(valid, tokens, 0))
    return jnp.where(valid, jnp.asarray(nxt, jnp.int32), -1)

  def emitted_states(self, walk, empty, emitted, num_accepted) -> tuple[jax.Array, jax.Array]:
    """After a chain's verification: the state after each emitted token, and whether it ends the row.

    The accepted drafts' states are the walk's (s_1 .. s_n); the recovered or bonus token x at n moves s_n
    to one more state, the only new one.

    Args:
      walk: int32 [B, K+1] s_0 .. s_K (`walk`); empty: bool [B, K+1] their allowed sets are empty.
      emitted: int32 [B, K+1] d_1 .. d_n, x, then -1; num_accepted: int32 [B] n.

    Returns:
      (int32 [B, K+1] the state after emitted token j, bool [B, K+1] its allowed set is empty); entries
      past n repeat n's.
    """
    n = num_accepted.astype(jnp.int32)[:, None]
    last = jnp.take_along_axis(emitted, n, axis=1)[:, 0]
    s_last = self.advance(jnp.take_along_axis(walk, n, axis=1)[:, 0], last)
    j = jnp.arange(walk.shape[1], dtype=jnp.int32)[None, :]
    after = jnp.where(j < n, jnp.concatenate([walk[:, 1:], walk[:, -1:]], axis=1), s_last[:, None])
    ends = jnp.where(j < n, jnp.concatenate([empty[:, 1:], empty[:, -1:]], axis=1), self.ends(s_last)[:, None])
    return after, ends

  def walk(self, states, tokens) -> jax.Array:
    """int32 [B, K+1]: s_0 = states [B], then the states after each of tokens [B, K] in turn."""
    out = [jnp.asarray(states, jnp.int32)]
    for i in range(tokens.shape[1]):
      out.append(self.advance(out[-1], tokens[:, i]))
    return jnp.stack(out, axis=1)

  def walk_sole(self, states, tokens) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The walk along drafts `tokens` [B, K] with each single position's sole token in place of its draft.

    Draft i+1 is replaced where allowed(s_i) holds exactly one token, and s_{i+1} follows the draft kept
    (module docstring: why this is lossless for drafts not drawn from the masked law).

    Returns:
      (int32 [B, K] the drafts, int32 [B, K+1] s_0 .. s_K along them, int32 [B, K+1, W] allowed(s_0) ..
      allowed(s_K)), the last for `sampler_masks(walk, words)`: the walk reads each allowed set anyway.
    """
    s = jnp.asarray(states, jnp.int32)
    drafts, walk, words = [], [s], []
    for i in range(tokens.shape[1]):
      words.append(self.allowed(s))
      sole, single = sole_token(words[-1])
      drafts.append(jnp.where(single, sole, tokens[:, i].astype(jnp.int32)))
      s = self.advance(s, drafts[-1])
      walk.append(s)
    words.append(self.allowed(s))
    return jnp.stack(drafts, axis=1), jnp.stack(walk, axis=1), jnp.stack(words, axis=1)


def sole_token(words) -> tuple[jax.Array, jax.Array]:
  """(int32 [...] the sole token, bool [...] single) of allowed sets int32 [..., W]; the token is
  meaningless where not single.

  Read from the words alone (no [..., V] array): the set is single where its words hold one bit in all;
  that bit's word is the first nonzero one, and, being the only nonzero word there, the sum of all words
  (a sum, not an OR: on a vocabulary-split mesh the words are split over devices, and XLA's all-reduce
  has no bitwise OR).
  """
  words = jnp.asarray(words, jnp.int32)
  single = jnp.sum(jax.lax.population_count(words), axis=-1) == 1
  word_index = jnp.argmax(words != 0, axis=-1).astype(jnp.int32)
  bit = (BITS - 1) - jax.lax.clz(jnp.sum(words, axis=-1, dtype=jnp.int32))  # -1 for an empty set
  return word_index * BITS + bit, single
