"""The decoding loops: plain `generate` and `speculative_generate`.

Each is ONE jitted program: prefill, every round and the stopping test live in a
single `lax.while_loop` that runs until every row has ended, with no Python
round-trip per round. The loop owns each row's context length `L` (prompt plus
generated tokens) and tells the models everything through `positions`; the KV
caches are opaque. A rejected draft is rolled back by length arithmetic alone:
its cache slots sit past the row's length and the next round overwrites them
before any query can see them.

One speculative round for a row with context length L whose last token is t
(slot = position in the caches and in the loop's token buffer):

    slot:         L-2    L-1    L      L+1   ...  L+K-1
    buffer:       u      t      .      .          .
    draft call 0: [u     t]  -> d1               (T=2: re-feeds u, see below)
    draft call i:               [d_i] -> d_{i+1}  (T=1, i = 1 .. K-1)
    target:              [t     d1     d2    ...  dK]  -> K+1 distributions (T=K+1)
    rejection:           accepts d1..dn, then one recovered/bonus token
    buffer after:        t      d1 ... dn    x          (L += n + 1)

Draft-cache bookkeeping: the draft must have processed every accepted token
before it proposes again. Its K calls process u, t, d1 .. d_{K-1} but never dK,
so after a round that accepts all K drafts (plus the bonus) the draft is missing
slot L'-2 of the next round. Every round therefore starts by feeding the draft
the last TWO tokens [u, t] at [L-2, L-1]: when the previous round accepted all
drafts this fills the hole, otherwise it rewrites slot L-2 with the token that
is already there. The first call is the same shape for every row (no per-row
branch), and `prompt_lengths >= 1` makes L >= 2 from the first round on.

Nothing is donated: the caches, the token buffer and the statistics are born
inside the program (XLA updates the while-loop carry in place), and every
argument belongs to the caller (weights, prompts, parameters, keys).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specdec_jax.drafters import PromptLookupDrafter
from specdec_jax.rejection import PLACEHOLDER_TOKEN_ID, rejection_sample
from specdec_jax.sampling import SamplingParams, check_params, row_keys, sample_tokens

__all__ = ["DecodeStats", "GenerateOutput", "generate", "speculative_generate"]


# ----------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeStats:
  """Per-row counts of one generation, taken after truncation (EOS / max_new_tokens).

  Attributes:
    target_calls: int32[B] target forward passes that emitted tokens for the row,
      the prefill included.
    drafted: int32[B] draft tokens proposed for the row (K per round it took part in).
    accepted: int32[B] emitted tokens that were accepted drafts. In a round cut
      short by EOS or `max_new_tokens`, the last kept token counts as the target
      pass's own token, so `lengths == accepted + target_calls` always holds.
    accepted_per_position: int32[K] accepted drafts at draft position i, summed
      over rows and rounds (shape [0] for `generate`).

  Example:
    >>> out.stats.acceptance_rate, out.stats.mean_accepted_length
  """

  target_calls: jax.Array  # [B]
  drafted: jax.Array  # [B]
  accepted: jax.Array  # [B]
  accepted_per_position: jax.Array  # [K]

  @property
  def acceptance_rate(self) -> jax.Array:
    """sum(accepted) / sum(drafted), a scalar (0 when nothing was drafted)."""
    drafted = jnp.sum(self.drafted)
    return jnp.sum(self.accepted) / jnp.maximum(drafted, 1)

  @property
  def mean_accepted_length(self) -> jax.Array:
    """Tokens emitted per target pass: sum(lengths) / sum(target_calls), a scalar."""
    calls = jnp.sum(self.target_calls)
    return (jnp.sum(self.accepted) + calls) / jnp.maximum(calls, 1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GenerateOutput:
  """What `generate` and `speculative_generate` return.

  Attributes:
    tokens: int32[B, max_new_tokens] generated tokens (the prompt excluded), then
      PLACEHOLDER_TOKEN_ID (-1) after the row's end.
    lengths: int32[B] generated tokens per row (an EOS that ended the row included).
    stats: DecodeStats.
  """

  tokens: jax.Array  # [B, max_new_tokens]
  lengths: jax.Array  # [B]
  stats: DecodeStats


# ----------------------------------------------------------------------------
# Models through jit
# ----------------------------------------------------------------------------


_VALUE_TYPES = (bool, int, float, complex, str, bytes, type(None), np.dtype)


class _Static:
  """Wraps a non-array object so it can ride in a jit's static arguments.

  Plain values (numbers, strings, dtypes, tuples of them) compare by type and
  value, so an equal value reuses the compiled program. Anything else compares
  by identity: a user's own `__eq__` may ignore the weights the program bakes
  in. The jit cache keeps the object alive, so its id cannot be reused.
  """

  __slots__ = ("obj", "key")

  def __init__(self, obj):
    self.obj = obj
    self.key = (type(obj), obj) if _is_plain_value(obj) else None

  def __hash__(self):
    return id(self.obj) if self.key is None else hash(self.key)

  def __eq__(self, other):
    if not isinstance(other, _Static):
      return False
    if self.key is None or other.key is None:
      return self.obj is other.obj
    return self.key == other.key


def _is_plain_value(obj) -> bool:
  if isinstance(obj, tuple):
    return all(_is_plain_value(x) for x in obj)
  return isinstance(obj, _VALUE_TYPES)


@dataclasses.dataclass(frozen=True)
class _ModelDef:
  """The static half of a model: how to rebuild it inside jit from its arrays.

  kind "nnx": structure is the nnx GraphDef (arrays = its State);
  kind "pytree": structure is (treedef, its non-array leaves as `_Static`);
  kind "closed": structure is the model as `_Static` (no arrays), for models
  that are not pytrees (or hold no arrays): the program closes over them.
  """

  kind: str
  structure: Any


def _split_model(model, name: str) -> tuple[_ModelDef, Any]:
  """Splits a model into (static definition, arrays passed through jit)."""
  if not (hasattr(model, "init_cache") and callable(model)):
    raise TypeError(f"{name} must follow the model protocol: init_cache(batch_size, max_length) and "
                    f"__call__(tokens, positions, cache) -> (logits, cache); got {type(model).__name__}")
  if isinstance(model, nnx.Module):
    # One graph traversal per call, outside jit; the program merges it back.
    graphdef, state = nnx.split(model)
    return _ModelDef("nnx", graphdef), state
  leaves, treedef = jax.tree_util.tree_flatten(model)
  is_array = [isinstance(x, (jax.Array, np.ndarray)) for x in leaves]
  if not any(is_array):
    return _ModelDef("closed", _Static(model)), None
  static = tuple(None if a else _Static(x) for x, a in zip(leaves, is_array))
  arrays = [x for x, a in zip(leaves, is_array) if a]
  return _ModelDef("pytree", (treedef, static)), arrays


def _merge_model(model_def: _ModelDef, arrays):
  """Inverse of `_split_model`, called inside the jitted program."""
  if model_def.kind == "nnx":
    return nnx.merge(model_def.structure, arrays)
  if model_def.kind == "closed":
    return model_def.structure.obj
  treedef, static = model_def.structure
  it = iter(arrays)
  leaves = [next(it) if s is None else s.obj for s in static]
  return jax.tree_util.tree_unflatten(treedef, leaves)


def _model_fns(model_def: _ModelDef, arrays, name: str, batch_size: int):
  """(init_cache(max_length), apply(tokens, positions, cache)) for use inside jit.

  `apply` merges the model at every call site (trace-time work only), so an NNX
  module is always created inside the trace that uses it (while/scan bodies).
  """

  def init_cache(max_length):
    return _merge_model(model_def, arrays).init_cache(batch_size, max_length)

  def apply(tokens, positions, cache):
    logits, cache = _merge_model(model_def, arrays)(tokens, positions, cache)
    if logits.ndim != 3 or logits.shape[:2] != tokens.shape:
      raise ValueError(f"{name} must return logits [B, T, V] = ({tokens.shape[0]}, {tokens.shape[1]}, V) "
                       f"for tokens {tokens.shape}, got {logits.shape}")
    return logits, cache

  return init_cache, apply


# ----------------------------------------------------------------------------
# Argument checks (at the API boundary, with the argument's name)
# ----------------------------------------------------------------------------


def _check_inputs(where, prompt_tokens, prompt_lengths, params, key, max_new_tokens, eos_token_id, all_greedy):
  prompt_tokens = jnp.asarray(prompt_tokens)
  prompt_lengths = jnp.asarray(prompt_lengths)
  if prompt_tokens.ndim != 2 or not jnp.issubdtype(prompt_tokens.dtype, jnp.integer):
    raise ValueError(f"{where}: prompt_tokens must be an integer array [B, P], got {prompt_tokens.dtype} "
                     f"{prompt_tokens.shape}")
  b, p = prompt_tokens.shape
  if p < 1:
    raise ValueError(f"{where}: prompt_tokens must have P >= 1 columns, got shape {prompt_tokens.shape}")
  if prompt_lengths.shape != (b,) or not jnp.issubdtype(prompt_lengths.dtype, jnp.integer):
    raise ValueError(f"{where}: prompt_lengths must be an integer array [B]=({b},), got {prompt_lengths.dtype} "
                     f"{prompt_lengths.shape}")
  if not isinstance(prompt_lengths, jax.core.Tracer):
    pl = np.asarray(prompt_lengths)
    if np.any((pl < 1) | (pl > p)):
      raise ValueError(f"{where}: prompt_lengths must be in [1, P={p}], got {pl}")
  check_params(params, b, where)
  if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
    raise ValueError(f"{where}: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
  if key is None and not all_greedy:
    raise ValueError(f"{where}: key is required unless all_greedy=True")
  if eos_token_id is None:
    eos = ()
  elif isinstance(eos_token_id, (int, np.integer)) and not isinstance(eos_token_id, bool):
    eos = (int(eos_token_id),)
  elif isinstance(eos_token_id, (tuple, list)) and all(
      isinstance(e, (int, np.integer)) and not isinstance(e, bool) for e in eos_token_id):
    eos = tuple(int(e) for e in eos_token_id)
  else:
    raise ValueError(f"{where}: eos_token_id must be None, an int or a tuple of ints, got {eos_token_id!r}")
  return prompt_tokens.astype(jnp.int32), prompt_lengths.astype(jnp.int32), int(max_new_tokens), eos


# ----------------------------------------------------------------------------
# Pieces of the program shared by both loops
# ----------------------------------------------------------------------------


def _is_eos(tokens, eos: tuple[int, ...]):
  """bool, same shape as tokens: token is one of the (static) EOS ids."""
  hit = jnp.zeros(tokens.shape, bool)
  for e in eos:
    hit |= tokens == e
  return hit


def _position_keys(keys, positions):
  """Row b's key for the step that writes slot positions[b]: fold_in(keys[b], pos).

  A row's slots only grow while it is live, so no subkey is ever used twice, and
  the key does not depend on the other rows of the batch.
  """
  if keys is None:
    return None
  return jax.vmap(jax.random.fold_in)(keys, positions)


def _gather_rows(x, idx):
  """x[b, idx[b]] for x [B, S] and idx [B]."""
  return jnp.take_along_axis(x, idx[:, None], axis=1)[:, 0]


def _prefill(apply, cache, prompt_tokens, prompt_lengths):
  """Feeds the padded prompt at positions arange(P); returns the logits at prompt_lengths - 1.

      slot:   0    1    2    3    4          row b with P_b = 3, P = 5
      tokens: p0   p1   p2   0    0          padding writes junk slots 3, 4,
                        ^ logits -> first new token; overwritten before read
  """
  b, p = prompt_tokens.shape
  pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
  # The caller's pad ids may lie outside the vocabulary: feed 0 instead.
  tokens = jnp.where(pos < prompt_lengths[:, None], prompt_tokens, 0)
  logits, cache = apply(tokens, pos, cache)
  last = jnp.take_along_axis(logits, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, V]
  return last, cache


def _init_state(prompt_tokens, prompt_lengths, first_token, max_new_tokens, eos, max_length):
  """Token buffer [B, max_length] with the prompt and the first new token; lengths; done."""
  b, p = prompt_tokens.shape
  slot = jnp.arange(max_length)[None, :]
  padded = jnp.pad(prompt_tokens, ((0, 0), (0, max_length - p)))
  buf = jnp.where(slot < prompt_lengths[:, None], padded, PLACEHOLDER_TOKEN_ID)
  buf = jnp.where(slot == prompt_lengths[:, None], first_token[:, None], buf).astype(jnp.int32)
  length = prompt_lengths + 1  # context length: prompt plus generated tokens
  done = _is_eos(first_token, eos) | (max_new_tokens <= 1)
  return buf, length, done


def _outputs(buf, length, prompt_lengths, max_new_tokens, stats):
  """Cuts the generated tokens out of the buffer; -1 after each row's end."""
  s = buf.shape[1]
  i = jnp.arange(max_new_tokens)[None, :]
  gen = jnp.take_along_axis(buf, jnp.minimum(prompt_lengths[:, None] + i, s - 1), axis=1)
  lengths = length - prompt_lengths
  tokens = jnp.where(i < lengths[:, None], gen, PLACEHOLDER_TOKEN_ID).astype(jnp.int32)
  return GenerateOutput(tokens=tokens, lengths=lengths.astype(jnp.int32), stats=stats)


# ----------------------------------------------------------------------------
# generate
# ----------------------------------------------------------------------------


def generate(target, prompt_tokens, prompt_lengths, params: SamplingParams, key, *, max_new_tokens: int,
             eos_token_id=None, all_greedy: bool = False) -> GenerateOutput:
  """Plain autoregressive decoding: one target call per token, in one jitted loop.

  Args:
    target: a model: `init_cache(batch_size, max_length)` and
      `__call__(tokens [B, T], positions [B, T], cache) -> (logits [B, T, V], cache)`.
      An NNX module is split once per call and merged inside the program (new
      weights of the same structure do not recompile); another pytree passes
      its arrays through jit; any other object is closed over as a constant
      (a new object compiles anew, and the compiled program keeps it alive).
    prompt_tokens: int[B, P] right-padded prompts.
    prompt_lengths: int[B] in [1, P].
    params: SamplingParams of batch B (temperature 0 = greedy).
    key: one PRNG key (row b uses fold_in(key, b)) or a batch of B keys (row b
      uses key[b]); typed or raw uint32. May be None with all_greedy=True.
    max_new_tokens: static int >= 1.
    eos_token_id: None, an int or a tuple of ints (static). A row ends after
      emitting one (included).
    all_greedy: static promise that every row is greedy (argmax-only program).

  Returns:
    GenerateOutput(tokens int32[B, max_new_tokens] with -1 after each row's end,
    lengths int32[B], stats) where stats.target_calls == lengths and nothing is
    drafted (accepted_per_position has shape [0]).

  Example:
    >>> out = generate(model, prompts, prompt_lengths, SamplingParams.create([0.0, 0.8]),
    ...                jax.random.key(0), max_new_tokens=32, eos_token_id=2)
    >>> out.tokens[0, :out.lengths[0]]
  """
  where = "generate"
  prompt_tokens, prompt_lengths, max_new_tokens, eos = _check_inputs(
      where, prompt_tokens, prompt_lengths, params, key, max_new_tokens, eos_token_id, all_greedy)
  target_def, target_arrays = _split_model(target, "target")
  return _generate_jit(target_arrays, prompt_tokens, prompt_lengths, params, None if all_greedy else key,
                       target_def=target_def, max_new_tokens=max_new_tokens, eos=eos, all_greedy=bool(all_greedy))


@functools.partial(jax.jit, static_argnames=("target_def", "max_new_tokens", "eos", "all_greedy"))
def _generate_jit(target_arrays, prompt_tokens, prompt_lengths, params, key, *, target_def, max_new_tokens, eos,
                  all_greedy):
  b, p = prompt_tokens.shape
  max_length = p + max_new_tokens + 1
  init_cache, apply = _model_fns(target_def, target_arrays, "target", b)
  keys = None if all_greedy else row_keys(key, b)
  rows = jnp.arange(b)

  logits, cache = _prefill(apply, init_cache(max_length), prompt_tokens, prompt_lengths)
  first, _ = sample_tokens(logits, params, _position_keys(keys, prompt_lengths), all_greedy=all_greedy)
  buf, length, done = _init_state(prompt_tokens, prompt_lengths, first, max_new_tokens, eos, max_length)

  def body(state):
    buf, length, done, cache = state
    # Each row feeds its last token at its own position: rows advance independently.
    last = _gather_rows(buf, length - 1)
    logits, cache = apply(last[:, None], (length - 1)[:, None], cache)
    token, _ = sample_tokens(logits[:, 0], params, _position_keys(keys, length), all_greedy=all_greedy)
    live = ~done
    # Finished rows write nowhere (index max_length is dropped) and stay put.
    buf = buf.at[rows, jnp.where(live, length, max_length)].set(token, mode="drop")
    length = length + live
    done = done | (live & (_is_eos(token, eos) | (length - prompt_lengths >= max_new_tokens)))
    return buf, length, done, cache

  buf, length, done, cache = jax.lax.while_loop(lambda s: jnp.any(~s[2]), body, (buf, length, done, cache))
  lengths = (length - prompt_lengths).astype(jnp.int32)
  zeros = jnp.zeros((b,), jnp.int32)
  stats = DecodeStats(target_calls=lengths, drafted=zeros, accepted=zeros,
                      accepted_per_position=jnp.zeros((0,), jnp.int32))
  return _outputs(buf, length, prompt_lengths, max_new_tokens, stats)


# ----------------------------------------------------------------------------
# speculative_generate
# ----------------------------------------------------------------------------


def speculative_generate(target, draft, prompt_tokens, prompt_lengths, params: SamplingParams, key, *,
                         max_new_tokens: int, num_speculative_tokens: int, eos_token_id=None,
                         all_greedy: bool = False) -> GenerateOutput:
  """Speculative decoding: draft K tokens, verify them in one target call, repeat.

  Lossless: the tokens are distributed exactly as `generate(target, ...)`'s (and
  with all_greedy=True and float32 models they are the same tokens). The whole
  generation is one jitted `lax.while_loop`. Row b advances by its own number
  of emitted tokens each round (1 .. K+1), ends after `max_new_tokens` tokens or
  an EOS, and nothing follows its end, even inside a round.

  Args:
    target: the model whose distribution is sampled (see `generate` for the
      model protocol).
    draft: a model with the same vocabulary (sampled with the same
      SamplingParams; its probabilities go to the rejection sampler), or a
      `PromptLookupDrafter` (no model, no draft probabilities).
    prompt_tokens: int[B, P] right-padded prompts.
    prompt_lengths: int[B] in [1, P].
    params: SamplingParams of batch B.
    key: one PRNG key or a batch of B keys (row b depends only on its own key);
      may be None with all_greedy=True.
    max_new_tokens: static int >= 1.
    num_speculative_tokens: K, static int >= 1: draft tokens per round.
    eos_token_id: None, an int or a tuple of ints (static).
    all_greedy: static promise that every row is greedy; reaches the draft's
      sampler and `rejection_sample`, so the program holds no softmax and no RNG.

  Returns:
    GenerateOutput(tokens int32[B, max_new_tokens], lengths int32[B], stats)
    with stats.accepted_per_position of shape [K].

  Example:
    >>> out = speculative_generate(target, draft, prompts, prompt_lengths, SamplingParams.greedy(B),
    ...                            None, max_new_tokens=64, num_speculative_tokens=4,
    ...                            eos_token_id=2, all_greedy=True)
    >>> float(out.stats.acceptance_rate), float(out.stats.mean_accepted_length)
  """
  where = "speculative_generate"
  prompt_tokens, prompt_lengths, max_new_tokens, eos = _check_inputs(
      where, prompt_tokens, prompt_lengths, params, key, max_new_tokens, eos_token_id, all_greedy)
  k = num_speculative_tokens
  if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 1:
    raise ValueError(f"{where}: num_speculative_tokens must be an int >= 1, got {k!r}")
  target_def, target_arrays = _split_model(target, "target")
  if isinstance(draft, PromptLookupDrafter):
    draft_def, draft_arrays = draft, None
  else:
    draft_def, draft_arrays = _split_model(draft, "draft")
  return _speculative_jit(target_arrays, draft_arrays, prompt_tokens, prompt_lengths, params,
                          None if all_greedy else key, target_def=target_def, draft_def=draft_def,
                          num_speculative_tokens=int(k), max_new_tokens=max_new_tokens, eos=eos,
                          all_greedy=bool(all_greedy))


@functools.partial(jax.jit, static_argnames=("target_def", "draft_def", "num_speculative_tokens", "max_new_tokens",
                                             "eos", "all_greedy"))
def _speculative_jit(target_arrays, draft_arrays, prompt_tokens, prompt_lengths, params, key, *, target_def,
                     draft_def, num_speculative_tokens, max_new_tokens, eos, all_greedy):
  b, p = prompt_tokens.shape
  k = num_speculative_tokens
  # Headroom: a live row writes slots up to L+K-1 <= P + max_new_tokens + K - 1.
  max_length = p + max_new_tokens + k + 1
  rows = jnp.arange(b)
  keys = None if all_greedy else row_keys(key, b)

  t_init, t_apply = _model_fns(target_def, target_arrays, "target", b)
  logits, t_cache = _prefill(t_apply, t_init(max_length), prompt_tokens, prompt_lengths)
  vocab_size = logits.shape[-1]
  first, _ = sample_tokens(logits, params, _position_keys(keys, prompt_lengths), all_greedy=all_greedy)
  buf, length, done = _init_state(prompt_tokens, prompt_lengths, first, max_new_tokens, eos, max_length)

  lookup = isinstance(draft_def, PromptLookupDrafter)
  if lookup:
    d_apply, d_cache = None, None
  else:
    d_init, d_apply = _model_fns(draft_def, draft_arrays, "draft", b)
    d_logits, d_cache = _prefill(d_apply, d_init(max_length), prompt_tokens, prompt_lengths)
    if d_logits.shape[-1] != vocab_size:
      raise ValueError(f"speculative_generate: draft and target must share the vocabulary, got draft V="
                       f"{d_logits.shape[-1]} and target V={vocab_size}")

  def sample_draft(logits, step_keys):
    token, log_probs = sample_tokens(logits, params, step_keys, all_greedy=all_greedy)
    # Greedy rejection ignores draft probabilities: do not build [B, K, V] for it.
    return token, None if all_greedy else jnp.exp(log_probs)

  def propose(buf, length, d_cache, draft_keys):
    """K draft tokens [B, K] and their distributions [B, K, V] (or None)."""
    if lookup:
      return draft_def.propose(buf, length, k), None, d_cache
    # Call 0 feeds [u, t] at [L-2, L-1] (module docstring: fills the slot of dK
    # after a fully accepted round; otherwise rewrites an identical slot).
    two = jnp.stack([_gather_rows(buf, length - 2), _gather_rows(buf, length - 1)], axis=1)
    logits, d_cache = d_apply(two, jnp.stack([length - 2, length - 1], axis=1), d_cache)
    d1, q1 = sample_draft(logits[:, -1], _position_keys(draft_keys, jnp.zeros_like(length)))
    if k == 1:
      return d1[:, None], None if q1 is None else q1[:, None], d_cache

    def step(carry, i):
      d_cache, token = carry
      logits, d_cache = d_apply(token[:, None], (length - 1 + i)[:, None], d_cache)
      nxt, q = sample_draft(logits[:, 0], _position_keys(draft_keys, jnp.full_like(length, i)))
      return (d_cache, nxt), (nxt, q)

    (d_cache, _), (ds, qs) = jax.lax.scan(step, (d_cache, d1), jnp.arange(1, k))
    tokens = jnp.concatenate([d1[:, None], ds.T], axis=1)
    probs = None if q1 is None else jnp.concatenate([q1[:, None], jnp.moveaxis(qs, 0, 1)], axis=1)
    return tokens, probs, d_cache

  def body(state):
    buf, length, done, t_cache, d_cache, stats = state
    live = ~done
    if all_greedy:
      draft_keys = reject_keys = None
    else:
      # One fresh key per row and round (L grows every round), split in two.
      round_keys = jax.vmap(jax.random.split)(_position_keys(keys, length))
      draft_keys, reject_keys = round_keys[:, 0], round_keys[:, 1]

    draft_tokens, draft_probs, d_cache = propose(buf, length, d_cache, draft_keys)  # [B, K], [B, K, V]
    last = _gather_rows(buf, length - 1)
    verify = jnp.concatenate([last[:, None], draft_tokens], axis=1)  # [B, K+1]: t, d1 .. dK
    target_logits, t_cache = t_apply(verify, (length - 1)[:, None] + jnp.arange(k + 1)[None, :], t_cache)
    out = rejection_sample(draft_token_ids=draft_tokens, target_logits=target_logits, params=params,
                           key=reject_keys, draft_probs=draft_probs, all_greedy=all_greedy)

    # Truncation inside the round: keep tokens up to the first EOS (included)
    # and up to max_new_tokens; finished rows keep nothing.
    j = jnp.arange(k + 1)[None, :]
    emitted = out.token_ids  # [B, K+1], -1 after num_emitted
    eos_hit = _is_eos(emitted, eos) & (j < out.num_emitted[:, None])
    first_eos = jnp.min(jnp.where(eos_hit, j, k + 1), axis=1)
    room = max_new_tokens - (length - prompt_lengths)
    kept = jnp.minimum(jnp.minimum(out.num_emitted, room), first_eos + 1)
    kept = jnp.where(live, kept, 0)
    buf = buf.at[rows[:, None], jnp.where(j < kept[:, None], length[:, None] + j, max_length)].set(
        emitted, mode="drop")
    length = length + kept
    done = done | (live & ((first_eos < kept) | (length - prompt_lengths >= max_new_tokens)))

    # Every live row keeps >= 1 token; its last kept token is the pass's own.
    acc = jnp.maximum(kept - 1, 0)
    stats = DecodeStats(
        target_calls=stats.target_calls + (kept > 0),
        drafted=stats.drafted + k * live,
        accepted=stats.accepted + acc,
        accepted_per_position=stats.accepted_per_position
        + jnp.sum(jnp.arange(k)[None, :] < acc[:, None], axis=0, dtype=jnp.int32))
    return buf, length, done, t_cache, d_cache, stats

  zeros = jnp.zeros((b,), jnp.int32)
  stats = DecodeStats(target_calls=jnp.ones((b,), jnp.int32), drafted=zeros, accepted=zeros,
                      accepted_per_position=jnp.zeros((k,), jnp.int32))
  state = (buf, length, done, t_cache, d_cache, stats)
  buf, length, done, _, _, stats = jax.lax.while_loop(lambda s: jnp.any(~s[2]), body, state)
  return _outputs(buf, length, prompt_lengths, max_new_tokens, stats)
