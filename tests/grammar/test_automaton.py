"""`TokenGrammar.from_tables` (a hand-made automaton): packing, the dead state, ids out of range, jit and vmap,
and the errors of bad tables."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax.grammar import TokenAutomaton, TokenGrammar
from specdec_jax.sampling.masks import allowed_tokens, mask_words, pack_bitmask

V = 70  # three mask words; tokens 31 and 63 use the sign bit of their word


def _random_tables(seed=0, num_states=6):
  """A random deterministic automaton: (edge_state, edge_token, edge_next, accepting), and its dense [S, V]
  table of next states (-1 where no transition)."""
  rng = np.random.default_rng(seed)
  dense = np.full((num_states, V), -1)
  for s in range(num_states - 1):  # the last state allows nothing
    tokens = rng.choice(V, size=rng.integers(1, V), replace=False)
    dense[s, tokens] = rng.choice(num_states, size=tokens.size, p=[0.6] + [0.4 / (num_states - 1)] * (num_states - 1))
  dense[0, [31, 63, 69]] = 1
  edge_state, edge_token = np.nonzero(dense >= 0)
  perm = rng.permutation(edge_state.size)  # from_tables sorts
  accepting = np.arange(num_states) % 2 == 1
  return (edge_state[perm], edge_token[perm], dense[edge_state, edge_token][perm], accepting), dense


def test_tables_match_dense_automaton():
  (es, et, en, acc), dense = _random_tables()
  g = TokenGrammar.from_tables(es, et, en, acc, vocab_size=V)
  assert isinstance(g, TokenAutomaton)
  states = jnp.arange(-1, dense.shape[0] + 2, dtype=jnp.int32)  # the dead state and two states out of range
  tokens = jnp.array([-5, *range(V), V, 2**31 - 1], jnp.int32)
  grid_s, grid_t = jnp.meshgrid(states, tokens, indexing="ij")
  got = np.asarray(jax.jit(TokenGrammar.next_state)(g, grid_s, grid_t))
  expect = np.full(got.shape, -1)
  expect[1 : 1 + dense.shape[0], 1 : 1 + V] = dense
  np.testing.assert_array_equal(got, expect)
  # The packed masks follow sampling.masks' convention, bit for bit.
  allowed = np.zeros((states.shape[0], V), bool)
  allowed[1 : 1 + dense.shape[0]] = dense >= 0
  np.testing.assert_array_equal(np.asarray(g.mask(states)), np.asarray(pack_bitmask(allowed)))
  np.testing.assert_array_equal(np.asarray(allowed_tokens(g.mask(states), V)), allowed)
  np.testing.assert_array_equal(np.asarray(g.accepts(states)), np.r_[False, acc, False, False])
  assert g.mask(states).shape == (states.shape[0], mask_words(V)) and g.mask(states).dtype == jnp.int32
  # Most of state 0's tokens lead to one state: only the others are stored as exceptions.
  assert g.num_exceptions < len(es) and int(g.default_next[0]) == 0


def test_jit_vmap_leading_shapes():
  """[B, K+1] states and tokens, under jit of vmap, equal the per-element eager calls; the grammar is a jit
  argument (a pytree whose arrays are leaves)."""
  (es, et, en, acc), dense = _random_tables(seed=1)
  g = TokenGrammar.from_tables(es, et, en, acc, vocab_size=V)
  rng = np.random.default_rng(2)
  states = jnp.asarray(rng.integers(-1, dense.shape[0], size=(3, 5)), jnp.int32)
  tokens = jnp.asarray(rng.integers(0, V, size=(3, 5)), jnp.int32)

  @jax.jit
  def step(grammar, s, t):
    row = jax.vmap(lambda s, t: (grammar.next_state(s, t), grammar.mask(s), grammar.accepts(s)))
    return row(s, t)

  nxt, mask, acc_ = step(g, states, tokens)
  assert nxt.shape == (3, 5) and mask.shape == (3, 5, mask_words(V)) and acc_.shape == (3, 5)
  for i, j in np.ndindex(3, 5):
    s, t = int(states[i, j]), int(tokens[i, j])
    assert int(nxt[i, j]) == (dense[s, t] if s >= 0 else -1)
    np.testing.assert_array_equal(np.asarray(mask[i, j]), np.asarray(g.mask(jnp.int32(s))))
  assert int(g.initial_state()) == 0 and g.initial_state().dtype == jnp.int32
  leaves, _ = jax.tree_util.tree_flatten(g)
  assert len(leaves) == 8 and all(isinstance(x, jax.Array) for x in leaves)


def test_grammar_without_transitions():
  """A grammar of the empty text only: must stop at once; every token is dead."""
  g = TokenGrammar.from_tables([], [], [], [True], vocab_size=5)
  assert bool(g.accepts(g.initial_state())) and not bool(jnp.any(g.mask(g.initial_state()) != 0))
  assert (np.asarray(g.next_state(jnp.zeros(5, jnp.int32), jnp.arange(5, dtype=jnp.int32))) == -1).all()


def test_eos_transitions_are_dropped_and_sizes_add_up():
  g = TokenGrammar.from_tables([0, 0, 1], [0, 2, 2], [1, 0, 1], [False, True], vocab_size=3, eos_token_ids=[2])
  assert np.asarray(allowed_tokens(g.mask(jnp.arange(2)), 3)).tolist() == [[True, False, False], [False] * 3]
  assert int(g.next_state(jnp.int32(0), jnp.int32(2))) == -1
  assert g.size_bytes() == sum(g.table_sizes().values()) > 0 and g.num_states == 2


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(edge_token=[0, 1]), "edge_token must be int"),
    (dict(edge_token=[5]), r"edge_token must lie in \[0, 4\)"),
    (dict(edge_next=[2]), r"edge_next must lie in \[0, 2\)"),
    (dict(edge_state=[-1]), r"edge_state must lie in \[0, 2\)"),
    (dict(edge_state=[0, 0], edge_token=[1, 1], edge_next=[0, 1]), "more than one transition"),
    (dict(accepting=[0, 1]), "accepting must be bool"),
    (dict(accepting=[]), "accepting must be bool"),
    (dict(vocab_size=0), "vocab_size must be a positive int"),
    (dict(initial_state=2), r"initial_state must lie in \[0, 2\)"),
  ],
)
def test_from_tables_bad_input(kwargs, match):
  args = dict(edge_state=[0], edge_token=[1], edge_next=[1], accepting=[False, True], vocab_size=4)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    TokenGrammar.from_tables(**args)


def test_next_state_shape_mismatch():
  g = TokenGrammar.from_tables([0], [1], [1], [False, True], vocab_size=4)
  with pytest.raises(ValueError, match="same shape"):
    g.next_state(jnp.zeros(3, jnp.int32), jnp.zeros(2, jnp.int32))


def test_padded_tables_are_the_same_automaton_and_padded_states_are_dead():
  (es, et, en, acc), dense = _random_tables()
  g = TokenGrammar.from_tables(es, et, en, acc, vocab_size=V)
  p = g.padded(num_states=g.num_states + 5, num_masks=g.num_masks + 3, num_exceptions=400, search_steps=12)
  assert (p.num_states, p.num_masks, p.edge_token.shape[0], p.search_steps) == (
    g.num_states + 5,
    g.num_masks + 3,
    400,
    12,
  )
  states = jnp.arange(-1, g.num_states, dtype=jnp.int32)
  tokens = jnp.array([-5, *range(V), V], jnp.int32)
  grid_s, grid_t = jnp.meshgrid(states, tokens, indexing="ij")
  for method in ("mask", "accepts"):
    np.testing.assert_array_equal(np.asarray(getattr(p, method)(states)), np.asarray(getattr(g, method)(states)))
  np.testing.assert_array_equal(np.asarray(p.next_state(grid_s, grid_t)), np.asarray(g.next_state(grid_s, grid_t)))
  extra = jnp.arange(g.num_states, p.num_states, dtype=jnp.int32)  # the padded states: dead in all but name
  assert not np.any(np.asarray(p.mask(extra))) and not np.any(np.asarray(p.accepts(extra)))
  ex_s, ex_t = jnp.meshgrid(extra, jnp.arange(V, dtype=jnp.int32), indexing="ij")
  assert np.all(np.asarray(p.next_state(ex_s, ex_t)) == -1)


def test_grammars_padded_alike_share_one_compiled_loop():
  from specdec_jax import SamplingParams, generate
  from tests.support.compiles import count_compiles
  from tests.support.tiny_lm import TinyLM, make_prompts

  sizes = dict(num_states=16, num_masks=16, num_exceptions=512, search_steps=10)
  a = TokenGrammar.from_tables(*_random_tables(1)[0], vocab_size=V)
  b = TokenGrammar.from_tables(*_random_tables(2, num_states=4)[0], vocab_size=V)
  assert (a.num_states, a.edge_token.shape) != (b.num_states, b.edge_token.shape)
  target = TinyLM.create(0, V)
  prompts, lengths = make_prompts(0, V, [3, 2], 4)
  params = SamplingParams.create([0.0, 1.0])
  run = lambda g: generate(target, prompts, lengths, params, jax.random.key(0), max_new_tokens=3, grammar=g)  # noqa: E731
  run(a.padded(**sizes))
  with count_compiles("_generate_jit") as compiled:
    run(b.padded(**sizes))
  assert not compiled, compiled
  with count_compiles("_generate_jit") as compiled:  # the control: b's own shapes compile anew
    run(b)
  assert compiled


@pytest.mark.parametrize(
  "sizes, match",
  [
    (dict(num_states=2), r"num_states must be an int >= 6"),
    (dict(num_states=8, num_masks=1), r"num_masks must be an int >= "),
    (dict(num_exceptions=0), r"num_exceptions must be an int >= "),
    (dict(search_steps=0), r"search_steps must be an int >= "),
    (dict(num_states=7.5), r"num_states must be an int"),
  ],
)
def test_padded_refuses_sizes_below_the_grammars(sizes, match):
  g = TokenGrammar.from_tables(*_random_tables()[0], vocab_size=V)
  with pytest.raises(ValueError, match=f"TokenGrammar.padded: {match}"):
    g.padded(**sizes)
