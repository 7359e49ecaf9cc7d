"""A small token automaton for the loops' grammar tests: a DFA from a dense NumPy table [S, V].

`TableGrammar` follows `specdec_jax.loop.constraint.TokenAutomaton` (a registered pytree: its tables are
leaves, `vocab_size` and the initial state static), so the tests do not depend on `specdec_jax.grammar`.
`host_walk` replays a generated row on the host.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.sampling.masks import pack_bitmask


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TableGrammar:
  """next_table[s, v]: the state after token v in state s, -1 where v is not allowed; accepting[s]; the initial
  state `start` (a leaf too: another start state does not recompile)."""

  next_table: jax.Array  # int32 [S, V]
  accepting: jax.Array  # bool [S]
  vocab_size: int = dataclasses.field(metadata=dict(static=True))
  start: jax.Array = 0  # int32 []

  @classmethod
  def create(cls, next_table, accepting, start=0):
    table = np.asarray(next_table, np.int32)
    return cls(jnp.asarray(table), jnp.asarray(accepting, bool), vocab_size=table.shape[1], start=jnp.int32(start))

  def initial_state(self):
    return jnp.asarray(self.start, jnp.int32)

  def mask(self, states):
    live = states >= 0
    allowed = (self.next_table[jnp.maximum(states, 0)] >= 0) & live[..., None]
    return pack_bitmask(allowed)

  def next_state(self, states, tokens):
    nxt = self.next_table[jnp.maximum(states, 0), tokens]
    return jnp.where(states >= 0, nxt, -1)

  def accepts(self, states):
    return (states >= 0) & self.accepting[jnp.maximum(states, 0)]


def random_grammar(seed, vocab_size, num_states=4, density=0.5, accepting=(1, 3), eos=()) -> TableGrammar:
  """Each state allows a random ~density of the tokens (at least one), each leading to a random state; the `eos`
  ids never (a grammar's masks hold no EOS: the loop allows it where a state accepts)."""
  r = np.random.default_rng(seed)
  table = r.integers(0, num_states, (num_states, vocab_size))
  allowed = r.random((num_states, vocab_size)) < density
  for _ in range(2):
    allowed[np.arange(num_states), r.choice(np.setdiff1d(np.arange(vocab_size), eos), num_states)] = True
  allowed[:, list(eos)] = False
  acc = np.zeros(num_states, bool)
  acc[list(accepting)] = True
  return TableGrammar.create(np.where(allowed, table, -1), acc)


def finite_grammar(vocab_size, length, tokens) -> TableGrammar:
  """Exactly `length` tokens, each from `tokens`; the final state accepts and allows nothing."""
  table = np.full((length + 1, vocab_size), -1)
  for s in range(length):
    table[s, list(tokens)] = s + 1
  acc = np.zeros(length + 1, bool)
  acc[length] = True
  return TableGrammar.create(table, acc)


def host_walk(grammar: TableGrammar, row, eos=()) -> tuple[bool, list[int]]:
  """(every token allowed where it came and EOS only where accepting, the states after each token)."""
  table, acc = np.asarray(grammar.next_table), np.asarray(grammar.accepting)
  s, states = int(grammar.start), []
  for t in row:
    if t in eos:
      if not acc[s]:
        return False, states
      states.append(s)
      continue
    s = int(table[s, t])
    if s < 0:
      return False, states
    states.append(s)
  return True, states


def literal_grammar(vocab_size, choices, literal) -> TableGrammar:
  """Repeats (one of `choices`, then the fixed `literal`): state 0 (accepting) allows the choices, states 1 ..
  len(literal) each allow one token only, the literal's next one, the last leading back to 0."""
  n = len(literal)
  table = np.full((n + 1, vocab_size), -1)
  table[0, list(choices)] = 1
  for i, t in enumerate(literal):
    table[i + 1, t] = (i + 2) % (n + 1)
  acc = np.zeros(n + 1, bool)
  acc[0] = True
  return TableGrammar.create(table, acc)
