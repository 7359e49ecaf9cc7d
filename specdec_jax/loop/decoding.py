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
    draft kind:   proposes d1 .. dK (how depends on the draft kind, below)
    target:              [t     d1     d2    ...  dK]  -> K+1 distributions (T=K+1)
    rejection:           accepts d1..dn, then one recovered/bonus token x
    buffer after:        t      d1 ... dn    x          (L += n + 1)

Three draft kinds share the round (`specdec_jax.loop.draft_kinds.DraftKind`), one per kind of drafter:

* `ModelDraft`: a draft model must have processed every accepted token before it
  proposes again. Its K calls process u, t, d1 .. d_{K-1} but never dK, so after a
  round that accepts all K drafts the draft model is missing slot L'-2 of the next round.
  Every round therefore starts by feeding it the last TWO tokens [u, t] at
  [L-2, L-1]: after a fully accepted round this fills the hole, otherwise it
  rewrites slot L-2 with what is already there (`prompt_lengths >= 1` makes
  L >= 2 from the first round on).
* `LookupDraft`: prompt lookup reads the token buffer and keeps no state.
* `FeatureDraft`: a feature drafter (EAGLE) reads the target's features. The verification pass
  returns them for t, d1 .. dK; the next round first *catches up* on the n+1
  verified tokens (entries (f_p, x_{p+1}) at p = L_prev-1 .. L-2, one call of
  K+1 entries, the rest junk), which also yields d1; then it drafts d2 .. dK
  from its own hiddens (see `specdec_jax.models.eagle`).

On a mesh (`with jax.set_mesh(mesh):`, axes "data" and "model"), the loop
splits its row-major state (token buffer, lengths, flags) over "data", the
sharded models split their caches and weights themselves, and a mesh with
Explicit axes is made Auto for the program (`specdec_jax.mesh`). A mesh that
splits the rows only (data parallelism) instead runs the one-device program on
each device's rows (`_on_each_data_device`): every device its own while loop,
and nothing crosses devices until the outputs.

Nothing is donated: the caches, the token buffer and the statistics are born
inside the program (XLA updates the while-loop carry in place), and every
argument belongs to the caller (weights, prompts, parameters, keys).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from specdec_jax.drafts.dynamic_tree import DynamicTree
from specdec_jax.drafts.lookup import PromptLookupDrafter
from specdec_jax.drafts.static_tree import DraftTree
from specdec_jax.loop.adapter import ModelDef, merge_model, split_model
from specdec_jax.loop.chain_round import chain_round
from specdec_jax.loop.constraint import Constraint, check_grammar
from specdec_jax.loop.draft_kinds import BlockDraft, DraftKind, FeatureDraft, LookupDraft, ModelDraft
from specdec_jax.loop.round import RoundSetup, commit, kept_tokens, round_keys
from specdec_jax.loop.state import (
  DecodeStats,
  GenerateOutput,
  LoopState,
  arange32,
  clip_lengths,
  gather_rows,
  is_eos,
  loop_outputs,
  position_keys,
  run_loop,
  sample_next,
  start_loop,
)
from specdec_jax.loop.tree_round import tree_round
from specdec_jax.mesh import DATA_AXIS, MODEL_AXIS, ambient_mesh, auto_axes_if_explicit, axis_size, sharded_call
from specdec_jax.sampling.params import SamplingParams, check_bias_ids, check_params, row_keys
from specdec_jax.verify.chain import LOGPROBS_MODES, METHODS

__all__ = ["DecodeStats", "GenerateOutput", "generate", "speculative_generate"]

_INT32_MAX = np.iinfo(np.int32).max


# ----------------------------------------------------------------------------
# Models inside the program
# ----------------------------------------------------------------------------


def _split(model, name: str, *, feature_drafter: bool = False) -> tuple[ModelDef, Any]:
  if feature_drafter:
    ok = all(hasattr(model, a) for a in ("init_cache", "fuse", "feature_layers")) and callable(model)
    protocol = (
      "init_cache(batch_size, max_length), fuse(features), feature_layers and "
      "__call__(tokens, hidden, positions, cache, *, logits_at) -> (logits, hidden, cache)"
    )
  else:
    ok = hasattr(model, "init_cache") and callable(model)
    protocol = "init_cache(batch_size, max_length) and __call__(tokens, positions, cache) -> (logits, cache)"
  if not ok:
    raise TypeError(f"{name} must follow the model protocol: {protocol}; got {type(model).__name__}")
  return split_model(model)


def _checked_logits(logits, tokens, name):
  if logits.ndim != 3 or logits.shape[:2] != tokens.shape:
    raise ValueError(
      f"{name} must return logits [B, T, V] = ({tokens.shape[0]}, {tokens.shape[1]}, V) "
      f"for tokens {tokens.shape}, got {logits.shape}"
    )
  return logits


def _model_fns(model_def: ModelDef, arrays, name: str, batch_size: int):
  """(init_cache(max_length), apply(tokens, positions, cache, **kw)) for use inside jit.

  `_copy_slots(model_def, arrays)` gives the tree extension's `copy_cache_slots` the same way.

  `apply` merges the model at every call site (trace-time work only), so an NNX
  module is always created inside the trace that uses it (while/scan bodies).
  """

  def init_cache(max_length):
    return merge_model(model_def, arrays).init_cache(batch_size, max_length)

  def apply(tokens, positions, cache, **kw):
    out = merge_model(model_def, arrays)(tokens, positions, cache, **kw)
    _checked_logits(out[0], tokens, name)
    return out

  return init_cache, apply


def _copy_slots(model_def: ModelDef, arrays):
  """copy_cache_slots(cache, src, dst) of the model, for use inside jit (trees of drafts)."""

  def copy(cache, src, dst):
    return merge_model(model_def, arrays).copy_cache_slots(cache, src, dst)

  return copy


# ----------------------------------------------------------------------------
# Argument checks (at the API boundary, with the argument's name)
# ----------------------------------------------------------------------------


def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


class _Inputs(NamedTuple):
  """The checked request: prompts and lengths as int32, max_new_tokens as an int, EOS ids as a tuple."""

  prompt_tokens: jax.Array  # int32 [B, P]
  prompt_lengths: jax.Array  # int32 [B]
  max_new_tokens: int
  eos: tuple[int, ...]


def _check_inputs(
  where, prompt_tokens, prompt_lengths, params, key, max_new_tokens, eos_token_id, all_greedy, extra_slots=1
):
  prompt_tokens = jnp.asarray(prompt_tokens)
  prompt_lengths = jnp.asarray(prompt_lengths)
  if prompt_tokens.ndim != 2 or not jnp.issubdtype(prompt_tokens.dtype, jnp.integer):
    raise ValueError(
      f"{where}: prompt_tokens must be an integer array [B, P], got {prompt_tokens.dtype} {prompt_tokens.shape}"
    )
  b, p = prompt_tokens.shape
  if p < 1 or b < 1:
    raise ValueError(
      f"{where}: prompt_tokens must have B >= 1 rows and P >= 1 columns, got shape {prompt_tokens.shape}"
    )
  if prompt_lengths.shape != (b,) or not jnp.issubdtype(prompt_lengths.dtype, jnp.integer):
    raise ValueError(
      f"{where}: prompt_lengths must be an integer array [B]=({b},), got {prompt_lengths.dtype} {prompt_lengths.shape}"
    )
  if not isinstance(prompt_lengths, jax.core.Tracer):
    pl = np.asarray(prompt_lengths)
    if np.any((pl < 1) | (pl > p)):
      raise ValueError(f"{where}: prompt_lengths must be in [1, P={p}], got {pl}")
  check_params(params, b, where)
  if not _is_int(max_new_tokens) or max_new_tokens < 1:
    raise ValueError(f"{where}: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
  # Positions are int32: the whole buffer (prompt, new tokens, draft headroom) must fit.
  if p + int(max_new_tokens) + extra_slots > _INT32_MAX:
    raise ValueError(
      f"{where}: max_new_tokens={max_new_tokens} is too large: P + max_new_tokens + "
      f"{extra_slots} must fit in int32 (< 2**31)"
    )
  if key is None and not all_greedy:
    raise ValueError(f"{where}: key is required unless all_greedy=True")
  if eos_token_id is None:
    eos = ()
  elif _is_int(eos_token_id):
    eos = (eos_token_id,)
  elif isinstance(eos_token_id, (tuple, list)) and all(_is_int(e) for e in eos_token_id):
    eos = tuple(eos_token_id)
  else:
    raise ValueError(f"{where}: eos_token_id must be None, an int or a tuple of ints, got {eos_token_id!r}")
  if any(not 0 <= e <= _INT32_MAX for e in eos):
    raise ValueError(f"{where}: eos_token_id must be token ids in [0, V) (int32), got {eos_token_id!r}")
  return _Inputs(
    prompt_tokens.astype(jnp.int32), prompt_lengths.astype(jnp.int32), int(max_new_tokens), tuple(int(e) for e in eos)
  )


def _check_context(where, models, p, max_new_tokens):
  """Refuses a generation longer than a model's declared `max_length` (its context)."""
  for name, model in models:
    limit = getattr(model, "max_length", None)
    if _is_int(limit) and p + max_new_tokens > limit:
      raise ValueError(
        f"{where}: prompt_tokens width P={p} + max_new_tokens={max_new_tokens} = "
        f"{p + max_new_tokens} positions exceed {name}.max_length={limit} (the model's context); "
        f"lower max_new_tokens to at most {limit - p}"
      )


def _target_vocab(target, prompt_tokens) -> int:
  """The target's V: its `config.vocab_size`, or else the shape of one traced call (nothing runs)."""
  v = getattr(getattr(target, "config", None), "vocab_size", None)
  if v is None:
    b = prompt_tokens.shape[0]
    one = jnp.zeros((b, 1), jnp.int32)
    v = jax.eval_shape(lambda: target(one, one, target.init_cache(b, 2))[0]).shape[-1]
  return int(v)


def _check_bias_vocab(where, target, params, prompt_tokens):
  """Concrete logit-bias ids must be < V, as `sample_tokens` and `rejection_sample` require eagerly.

  Inside the loop's jit they would be ignored silently, so V is found here (`_target_vocab`).
  """
  ids = params.logit_bias_ids
  if ids is None or isinstance(ids, jax.core.Tracer):
    return
  check_bias_ids(params, _target_vocab(target, prompt_tokens), where)


# ----------------------------------------------------------------------------
# generate
# ----------------------------------------------------------------------------


def generate(
  target,
  prompt_tokens,
  prompt_lengths,
  params: SamplingParams,
  key,
  *,
  max_new_tokens: int,
  eos_token_id=None,
  all_greedy: bool = False,
  logprobs: str | None = None,
  no_filters: bool = False,
  grammar=None,
) -> GenerateOutput:
  """Plain autoregressive decoding: one target call per token, in one jitted loop.

  Many devices: under `with jax.set_mesh(mesh):` (mesh axes "data" and
  "model", see `specdec_jax.models.shard`) the loop keeps its per-row state
  split over "data" and a sharded model splits itself over "model"; with
  Explicit mesh axes the program runs under `jax.sharding.auto_axes`. A mesh
  that splits rows only ("model" of 1 device, "data" dividing B) runs the
  one-device program on each device's rows, with no communication while
  decoding. Tokens are those of one device (float32 greedy: identical).

  Args:
    target: a model: `init_cache(batch_size, max_length)` and
      `__call__(tokens [B, T], positions [B, T], cache) -> (logits [B, T, V], cache)`,
      optionally a `max_length` attribute (its context; longer generations are
      refused). An NNX module is split once per call and merged inside the
      program (new weights of the same structure do not recompile); another
      pytree passes its arrays through jit; any other object is closed over as
      a constant (a new object compiles anew, and the compiled program keeps it
      alive).
    prompt_tokens: int[B, P] right-padded prompts.
    prompt_lengths: int[B] in [1, P] (checked when concrete; under an outer
      jit, values outside are clipped into [1, P]).
    params: SamplingParams of batch B (temperature 0 = greedy).
    key: one PRNG key (row b uses fold_in(key, b)) or a batch of B keys (row b
      uses key[b]); typed or raw uint32. May be None with all_greedy=True.
    max_new_tokens: static int >= 1; P + max_new_tokens must not exceed the
      target's `max_length`, if it has one.
    eos_token_id: None, an int or a tuple of ints in [0, V) (static). A row ends
      after emitting one (included).
    all_greedy: static promise that every row is greedy (argmax-only program).
    logprobs: static; None, "raw" or "processed": also return each generated
      token's log-probability under the target, as `rejection_sample` defines
      them ("raw": log_softmax of the logits; "processed": under the
      distribution the row samples from, log_softmax for greedy rows).
    no_filters: static promise that no row uses top-k, top-p or min-p (they
      are then ignored; `SamplingParams.promise_no_filters`): sampling
      compiles one overflow-safe softmax pass and no run-time branch, which on
      a GPU saves a device-to-host copy per branch and step. The same
      distribution; draws may differ from the default program's where
      rounding ties two candidates.
    grammar: None, or a token automaton (structured output;
      `specdec_jax.TokenAutomaton`: a pytree with a static
      `vocab_size` equal to the target's V, `initial_state()` int32 [],
      `mask(states)` int32 [..., ceil(V/32)] of allowed tokens without EOS,
      `next_state(states, tokens)` int32 [...] (-1: dead), `accepts(states)`
      bool [...]). Each row keeps its grammar state in the loop and samples
      every token, the first included, from the target's law restricted to
      its state's allowed set (the mask, plus the EOS ids where the state
      accepts; applied before temperature and the filters) and renormalised;
      the state then follows the token. A row whose allowed set becomes
      empty ends after the token that got it there (a complete match with
      eos_token_id None); one whose initial state allows nothing emits no
      token (length 0). "processed" logprobs are under the restricted law.
      Its arrays ride through jit (new tables of the same shapes do not
      recompile); on a mesh they are replicated.

  Returns:
    GenerateOutput(tokens int32[B, max_new_tokens] with -1 after each row's end,
    lengths int32[B], stats, logprobs f32[B, max_new_tokens] or None) where
    stats.target_calls == lengths and nothing is drafted (the per-position
    counts have shape [0]).

  Raises:
    ValueError: on shapes, dtypes, out-of-range values, a generation longer
      than the target's `max_length`, or a grammar without the automaton's
      methods or of another vocabulary size.

  Example:
    >>> out = generate(model, prompts, prompt_lengths, SamplingParams.create([0.0, 0.8]),
    ...                jax.random.key(0), max_new_tokens=32, eos_token_id=2)
    >>> out.tokens[0, :out.lengths[0]]
    >>> out = generate(model, prompts, prompt_lengths, params, key, max_new_tokens=32, eos_token_id=2,
    ...                grammar=token_grammar)        # every row's text matches the grammar
  """
  where = "generate"
  _check_logprobs(where, logprobs)
  prompt_tokens, prompt_lengths, max_new_tokens, eos = _check_inputs(
    where, prompt_tokens, prompt_lengths, params, key, max_new_tokens, eos_token_id, all_greedy
  )
  _check_context(where, [("target", target)], prompt_tokens.shape[1], max_new_tokens)
  _check_bias_vocab(where, target, params, prompt_tokens)
  if grammar is not None:
    check_grammar(where, grammar, _target_vocab(target, prompt_tokens))
  if no_filters:
    params = params.promise_no_filters()  # static: every sampling call below reads it
  target_def, target_arrays = _split(target, "target")
  return _generate_jit(
    target_arrays,
    grammar,
    prompt_tokens,
    prompt_lengths,
    params,
    None if all_greedy else key,
    target_def=target_def,
    max_new_tokens=max_new_tokens,
    eos=eos,
    all_greedy=bool(all_greedy),
    logprobs=logprobs,
  )


def _jit(program, name: str):
  """`program(*arrays, **static)` under one jit whose static arguments are its keyword-only ones.

  Under a mesh with Explicit axes the program runs with them made Auto (see `specdec_jax.mesh`). `name`
  names the jitted function (compile counts and lowered modules go by it).
  """
  static = tuple(p.name for p in inspect.signature(program).parameters.values() if p.kind is p.KEYWORD_ONLY)

  def run(*arrays, **options):
    fn = functools.partial(program, **options)
    if _rows_only_split(arrays):
      return _on_each_data_device(fn, arrays, with_logprobs=options.get("logprobs") is not None)
    return auto_axes_if_explicit(fn)(*arrays)

  run.__name__ = run.__qualname__ = name
  return jax.jit(run, static_argnames=static)


def _rows_only_split(arrays) -> bool:
  """Whether the ambient mesh splits the rows only ("data" over d > 1 devices, no "model" axis above 1) and d
  divides the batch; `arrays` are a loop program's (models..., prompt_tokens, prompt_lengths, params, key).

  Not inside a caller's own shard_map over "data" (a Manual axis): there the program already sees one
  device's rows."""
  d = axis_size(DATA_AXIS)
  manual = DATA_AXIS in ambient_mesh().manual_axes
  return d > 1 and not manual and axis_size(MODEL_AXIS) == 1 and arrays[-4].shape[0] % d == 0


def _on_each_data_device(fn, arrays, *, with_logprobs: bool) -> GenerateOutput:
  """A loop program `fn(models..., prompt_tokens, prompt_lengths, params, key)` with each device of the "data"
  axis decoding its own rows as a one-device program (`sharded_call`, a shard_map).

  Data parallelism needs no communication while decoding: each device runs the program one device would run
  on its B/d rows, with its own `while_loop` (it stops when its rows are done), the models replicated; only
  the per-position sums of the statistics are added over the devices at the end. Left to XLA's partitioner,
  the whole-batch loop stopped every device at each step to agree on "any row left" and compiled other
  fusions than one device's. A single key becomes its per-row keys here (`row_keys`: row b gets
  `fold_in(key, b)` by its global index), so every row draws what it draws on one device.
  """
  *models, tokens, lengths, params, key = arrays
  keys = None if key is None else row_keys(key, tokens.shape[0])
  rows = P(DATA_AXIS)

  def local(models, tokens, lengths, params, keys):
    out = fn(*models, tokens, lengths, params, keys)
    stats = dataclasses.replace(
      out.stats,
      accepted_per_position=jax.lax.psum(out.stats.accepted_per_position, DATA_AXIS),
      reached_per_position=jax.lax.psum(out.stats.reached_per_position, DATA_AXIS),
    )
    return dataclasses.replace(out, stats=stats)

  stats_spec = DecodeStats(
    target_calls=rows,
    drafted=rows,
    accepted=rows,
    accepted_per_position=P(),
    usable_drafted=rows,
    reached_per_position=P(),
  )
  out_specs = GenerateOutput(tokens=rows, lengths=rows, stats=stats_spec, logprobs=rows if with_logprobs else None)
  in_specs = (P(), rows, rows, rows, None if keys is None else rows)
  return sharded_call(local, in_specs, out_specs, check_vma=False)(models, tokens, lengths, params, keys)


def _check_logprobs(where, logprobs):
  if logprobs not in LOGPROBS_MODES:
    raise ValueError(f"{where}: logprobs must be one of {LOGPROBS_MODES}, got {logprobs!r}")


def _generate_program(
  target_arrays,
  grammar,
  prompt_tokens,
  prompt_lengths,
  params,
  key,
  *,
  target_def,
  max_new_tokens,
  eos,
  all_greedy,
  logprobs,
):
  b, p = prompt_tokens.shape
  constraint = None if grammar is None else Constraint(grammar, eos)
  max_length = p + max_new_tokens + 1
  prompt_lengths = clip_lengths(prompt_lengths, p)
  t_init, t_apply = _model_fns(target_def, target_arrays, "target", b)
  start = start_loop(
    t_init,
    t_apply,
    prompt_tokens,
    prompt_lengths,
    params,
    key,
    max_new_tokens=max_new_tokens,
    eos=eos,
    max_length=max_length,
    all_greedy=all_greedy,
    with_features=False,
    where="generate",
    logprobs=logprobs,
    constraint=constraint,
  )
  rows = arange32(b)

  def body(s: LoopState) -> LoopState:
    # Each row feeds its last token at its own position: rows advance independently.
    last = gather_rows(s.tokens, s.length - 1)
    logits, cache = t_apply(last[:, None], (s.length - 1)[:, None], s.target_cache)
    allowed = None if constraint is None else constraint.sampler_masks(s.grammar_state)[0]  # live rows: not empty
    token, _, token_lp = sample_next(
      logits[:, 0], params, position_keys(start.keys, s.length), all_greedy, s.penalties, logprobs, allowed
    )
    live = ~s.done
    # Finished rows write nowhere (index max_length is dropped) and stay put.
    slot = jnp.where(live, s.length, max_length)
    buf = s.tokens.at[rows, slot].set(token, mode="drop")
    lp = s.logprobs
    if lp is not None:
      lp = lp.at[rows, slot].set(token_lp, mode="drop")
    penalties = None if s.penalties is None else s.penalties.add_tokens(token[:, None], live[:, None])
    length = s.length + live
    done = s.done | (live & (is_eos(token, eos) | (length - prompt_lengths >= max_new_tokens)))
    stats = dataclasses.replace(s.stats, target_calls=s.stats.target_calls + live)
    grammar_state = None
    if constraint is not None:  # the state follows the token; a row ends where its allowed set is empty
      grammar_state = jnp.where(live, constraint.advance(s.grammar_state, token), s.grammar_state)
      done = done | (live & constraint.ends(grammar_state))
    return dataclasses.replace(
      s,
      tokens=buf,
      length=length,
      done=done,
      target_cache=cache,
      stats=stats,
      logprobs=lp,
      penalties=penalties,
      grammar_state=grammar_state,
    )

  return loop_outputs(run_loop(body, start.state), prompt_lengths, max_new_tokens, start.empty_start)


# ----------------------------------------------------------------------------
# speculative_generate
# ----------------------------------------------------------------------------


_generate_jit = _jit(_generate_program, "_generate_jit")


def speculative_generate(
  target,
  draft,
  prompt_tokens,
  prompt_lengths,
  params: SamplingParams,
  key,
  *,
  max_new_tokens: int,
  num_speculative_tokens: int,
  eos_token_id=None,
  all_greedy: bool = False,
  logprobs: str | None = None,
  draft_tree: tuple[int, ...] | DraftTree | DynamicTree | None = None,
  verification: str = "token",
  no_filters: bool = False,
  grammar=None,
) -> GenerateOutput:
  """Speculative decoding: draft K tokens, verify them in one target call, repeat.

  Lossless: the tokens are distributed exactly as `generate(target, ...)`'s (and
  with all_greedy=True and float32 models they are the same tokens). The whole
  generation is one jitted `lax.while_loop`. Row b advances by its own number
  of emitted tokens each round (1 .. K+1), ends after `max_new_tokens` tokens or
  an EOS, and nothing follows its end, even inside a round. It runs on a mesh
  as `generate` does (shard a draft model or EAGLE drafter like the target).

  Args:
    target: the model whose distribution is sampled (see `generate` for the
      model protocol). With a feature drafter it must also take
      `return_features=True` and return (logits, features [B, T, F], cache).
    draft: one of
      - a model with the same vocabulary (sampled with the same SamplingParams;
        its probabilities go to the rejection sampler);
      - a `PromptLookupDrafter` (no model, no draft probabilities);
      - a feature drafter such as `specdec_jax.models.EagleDrafter` (anything
        with `fuse` and `feature_layers`), whose `feature_layers` must equal the
        target's `config.feature_layers`;
      - a block drafter, `specdec_jax.models.BlockDrafter` (a feature drafter
        with `block_size`): all K drafts' logits from one call (a tree's depth
        i drafts from position i's logits: one call for any tree).
    prompt_tokens: int[B, P] right-padded prompts.
    prompt_lengths: int[B] in [1, P] (clipped into it under an outer jit).
    params: SamplingParams of batch B.
    key: one PRNG key or a batch of B keys (row b depends only on its own key);
      may be None with all_greedy=True.
    max_new_tokens: static int >= 1; P + max_new_tokens must not exceed the
      `max_length` of the target or the draft model, where they declare one.
      No model is called at a position >= P + max_new_tokens: a round's drafts
      past a row's end (which are never emitted) are fed at position
      P + max_new_tokens - 1 instead.
    num_speculative_tokens: K, static int >= 1: draft tokens per round.
    eos_token_id: None, an int or a tuple of ints in [0, V) (static).
    all_greedy: static promise that every row is greedy; reaches the draft's
      sampler and `rejection_sample`, so the program holds no softmax and no RNG.
    logprobs: static; None, "raw" or "processed", as in `generate`: the target's
      log-probabilities of the tokens, from the verification calls (for the
      same tokens, the same values as `generate` up to float rounding).
    draft_tree: static; None (a chain of K drafts) or a tuple of K branching
      factors (k_1, ..., k_K): each round drafts a tree in which every node at
      depth i-1 has k_i children (greedy rows: the draft's top-k_i tokens;
      random rows: k_i draws without replacement, whose probabilities the
      verifier uses; pass a `DraftTree(branching, sibling_draws="iid")`
      instead of the tuple for i.i.d. draws),
      N = k_1 + k_1 k_2 + ... nodes in all, verified in one target call by
      `tree_rejection_sample` (`specdec_jax.drafts.static_tree` shows the layout).
      `(1,) * K` is the chain. The target (and a draft model) must offer the
      tree extension of the model protocol (`cache_slots`, `attention_mask`,
      `copy_cache_slots`; see `Transformer`); prompt lookup takes trees
      (m, 1, ..., 1): the continuations of m different earlier matches.
      A `dynamic_tree.DynamicTree(depth=K, top_k=k, num_nodes=N)` lets a model
      or EAGLE drafter choose the tree each round by its own confidence
      (EAGLE-2): the N likeliest of the top-k children of the k likeliest nodes
      per depth, verified without draft probabilities (deterministic children).
      With `sampled=True`, random rows draw those children without replacement
      from the drafter's processed q and verify every candidate with q
      (recursive rejection), which accepts more at high temperature.
    verification: static; "token" (default) or "block": how random rows of a
      chain verify their drafts (`rejection_sample`'s `method`). Block
      verification is as lossless and accepts at least as many drafts in
      expectation; greedy rows are unaffected. Chains only (a tree's walk is
      its own verifier).
    no_filters: static promise that no row uses top-k, top-p or min-p (they
      are then ignored; `SamplingParams.promise_no_filters`): the draft's
      sampling (chain or tree) and the verifier compile no run-time branch on
      the filters, the overflow redo or an empty residual. On a GPU each such
      branch costs a device-to-host copy, several per round; at T=1 on an
      H200 the flag took SmolLM2 with the EAGLE head (K=2) from 1350 to 1632
      tokens/s. The same distribution; draws may differ from the default
      program's where rounding ties two candidates.
    grammar: None, or a token automaton, as in `generate` (the same law:
      lossless under the constraint too; all_greedy float32: the same tokens
      as `generate(..., grammar=)`). Chains only for now. Each round walks the
      row's grammar state along the drafts, s_i after d_1 .. d_i, and verifies
      position i under the allowed set of s_i (a draft the grammar disallows
      is rejected); the state then follows the emitted tokens. A draft model
      and a feature drafter draw each draft from their law over the allowed
      set (renormalised), which is the q the verifier reads; prompt lookup
      proposes unmasked drafts.

  Returns:
    GenerateOutput(tokens int32[B, max_new_tokens], lengths int32[B], stats,
    logprobs f32[B, max_new_tokens] or None) with stats.accepted_per_position
    and reached_per_position of shape [K] (accepted depths, for a tree) and
    `drafted` counting N nodes per round.

  Raises:
    ValueError: on shapes, dtypes, out-of-range values, mismatched vocabularies
      or feature layers, a generation longer than a model's `max_length`, or a
      grammar with a tree of drafts, without the automaton's methods or of
      another vocabulary size.

  Example:
    >>> out = speculative_generate(target, draft, prompts, prompt_lengths, SamplingParams.greedy(B),
    ...                            None, max_new_tokens=64, num_speculative_tokens=4,
    ...                            eos_token_id=2, all_greedy=True)
    >>> float(out.stats.mean_accepted_length), out.stats.acceptance_per_position
    >>> out = speculative_generate(target, draft, prompts, prompt_lengths, params, key, max_new_tokens=64,
    ...                            num_speculative_tokens=4, eos_token_id=2, grammar=token_grammar)
  """
  return _speculative_generate(
    "speculative_generate",
    target,
    draft,
    prompt_tokens,
    prompt_lengths,
    params,
    key,
    max_new_tokens=max_new_tokens,
    num_speculative_tokens=num_speculative_tokens,
    eos_token_id=eos_token_id,
    all_greedy=all_greedy,
    logprobs=logprobs,
    draft_tree=draft_tree,
    verification=verification,
    no_filters=no_filters,
    grammar=grammar,
  )


def _speculative_generate(
  where: str,
  target,
  draft,
  prompt_tokens,
  prompt_lengths,
  params,
  key,
  *,
  max_new_tokens,
  num_speculative_tokens,
  eos_token_id,
  all_greedy,
  logprobs,
  draft_tree,
  verification,
  no_filters,
  forced_accepts: int | None = None,
  grammar=None,
) -> GenerateOutput:
  """`speculative_generate`'s checks and program call, named `where` in errors.

  `forced_accepts` is the benchmark knob of `specdec_jax.loop.forced` (NOT
  LOSSLESS), which checks it and calls this; `speculative_generate` never passes it.
  """
  _check_logprobs(where, logprobs)
  k = num_speculative_tokens
  if not _is_int(k) or k < 1:
    raise ValueError(f"{where}: num_speculative_tokens must be an int >= 1, got {k!r}")
  if verification not in METHODS:
    raise ValueError(f"{where}: verification must be one of {METHODS}, got {verification!r}")
  tree = _check_tree(where, draft_tree, k, target, draft, verification, grammar)
  if tree is not None and isinstance(params, SamplingParams) and (params.has_penalties or params.has_logit_bias):
    raise ValueError(
      f"{where}: draft_tree={draft_tree} with penalties or a logit bias in params is not supported "
      "yet (each node's context is its own root path); use a chain (draft_tree=None)"
    )
  if grammar is not None and forced_accepts is not None:
    raise ValueError(f"{where}: grammar is not supported by the forced-acceptance benchmark entry")
  prompt_tokens, prompt_lengths, max_new_tokens, eos = _check_inputs(
    where,
    prompt_tokens,
    prompt_lengths,
    params,
    key,
    max_new_tokens,
    eos_token_id,
    all_greedy,
    extra_slots=_slots_per_round(tree, k) + 1,
  )
  drafter = drafter_kind(draft)
  checked = [("target", target)] + ([("draft", draft)] if drafter == "model" else [])
  _check_context(where, checked, prompt_tokens.shape[1], max_new_tokens)
  _check_bias_vocab(where, target, params, prompt_tokens)
  if grammar is not None:
    check_grammar(where, grammar, _target_vocab(target, prompt_tokens))
  if no_filters:
    params = params.promise_no_filters()  # static: the draft's sampler and the verifier read it
  target_def, target_arrays = _split(target, "target")
  if drafter == "lookup":
    draft_def, draft_arrays = draft, None
  else:
    if drafter in FEATURE_DRAFTERS:
      target_layers = getattr(getattr(target, "config", None), "feature_layers", None)
      if tuple(draft.feature_layers) != tuple(target_layers or ()):
        raise ValueError(
          f"{where}: the drafter reads feature_layers {tuple(draft.feature_layers)}, but the "
          f"target's config.feature_layers are {target_layers}; build the target with the "
          f"drafter's feature_layers"
        )
    draft_def, draft_arrays = _split(draft, "draft", feature_drafter=drafter in FEATURE_DRAFTERS)
  return _speculative_jit(
    target_arrays,
    draft_arrays,
    grammar,
    prompt_tokens,
    prompt_lengths,
    params,
    None if all_greedy else key,
    target_def=target_def,
    draft_def=draft_def,
    drafter=drafter,
    num_speculative_tokens=int(k),
    max_new_tokens=max_new_tokens,
    eos=eos,
    all_greedy=bool(all_greedy),
    logprobs=logprobs,
    tree=tree,
    method=verification,
    forced_accepts=forced_accepts,
  )


def _slots_per_round(tree, k) -> int:
  """Cache slots past the context that one round may write: K, N, or a dynamic tree's frontiers if more."""
  if tree is None:
    return int(k)
  return max(tree.num_nodes, tree.frontier_slots) if isinstance(tree, DynamicTree) else tree.num_nodes


def _check_tree(
  where, draft_tree, k, target, draft, verification="token", grammar=None
) -> DraftTree | DynamicTree | None:
  """The `DraftTree` or `DynamicTree` of `draft_tree`, None for a chain; refuses a tree the models cannot serve,
  and any tree with a grammar."""
  if draft_tree is None:
    return None
  if isinstance(draft_tree, list):
    draft_tree = tuple(draft_tree)
  try:
    tree = draft_tree if isinstance(draft_tree, (DraftTree, DynamicTree)) else DraftTree(draft_tree)
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None
  if isinstance(tree, DynamicTree):
    if tree.depth != k:
      raise ValueError(f"{where}: draft_tree={tree} must have depth num_speculative_tokens={k}")
    if isinstance(draft, PromptLookupDrafter):
      raise ValueError(
        f"{where}: a DynamicTree is chosen by a model's or EAGLE drafter's confidence; prompt "
        "lookup has none (use a DraftTree (m, 1, ..., 1))"
      )
  elif tree.depth != k:
    raise ValueError(
      f"{where}: draft_tree must have num_speculative_tokens={k} entries (one branching factor "
      f"per depth), got {tree.branching!r}"
    )
  if tree.is_chain:
    return None
  if grammar is not None:
    raise ValueError(
      f"{where}: grammar with draft_tree={draft_tree} is not supported yet; use a chain (draft_tree=None)"
    )
  if verification != "token":
    raise ValueError(
      f"{where}: verification={verification!r} verifies chains; draft_tree={draft_tree} is verified "
      "by tree_rejection_sample (use verification='token' or a chain)"
    )
  models = [("target", target)] + ([] if isinstance(draft, PromptLookupDrafter) else [("draft", draft)])
  for name, model in models:
    if not callable(getattr(model, "copy_cache_slots", None)):
      raise ValueError(
        f"{where}: draft_tree={draft_tree} needs the tree extension of the model protocol, which the "
        f"{name} ({type(model).__name__}) lacks: __call__(..., cache_slots=, attention_mask=) and "
        f"copy_cache_slots(cache, src, dst) (see Transformer)"
      )
  if isinstance(draft, PromptLookupDrafter) and any(b != 1 for b in tree.branching[1:]):
    raise ValueError(
      f"{where}: prompt lookup drafts trees (m, 1, ..., 1) only (m earlier matches, each followed "
      f"to depth K), got draft_tree={draft_tree}"
    )
  return tree


def _speculative_program(
  target_arrays,
  draft_arrays,
  grammar,
  prompt_tokens,
  prompt_lengths,
  params,
  key,
  *,
  target_def,
  draft_def,
  drafter,
  num_speculative_tokens,
  max_new_tokens,
  eos,
  all_greedy,
  logprobs,
  tree,
  method="token",
  forced_accepts=None,
):
  """The body of `speculative_generate`'s jit: models, start, rounds until every row ends, outputs.

  Args:
    target_arrays, draft_arrays: the models' arrays (`split_model`); draft_arrays is None for prompt lookup.
    grammar: a token automaton (`specdec_jax.loop.constraint`; chains only), or None.
    prompt_tokens: int32 [B, P]; prompt_lengths: int32 [B] (clipped into [1, P] here).
    params: SamplingParams of batch B; key: a key or [B] keys, None when all_greedy.
    target_def, draft_def: the models' static halves (draft_def is the `PromptLookupDrafter` itself for lookup).
    drafter: what drafts (`drafter_kind`): "lookup", "model", "features" (a feature drafter: EAGLE) or "block"
      (a block drafter, `BlockDraft`: all K drafts' logits from one call).
    num_speculative_tokens, max_new_tokens, eos, all_greedy, logprobs, tree, method: as `speculative_generate`
      checked them (tree None for a chain).
    forced_accepts: None, or the benchmark knob of `specdec_jax.loop.forced` (NOT LOSSLESS).

  Returns:
    GenerateOutput, as `speculative_generate` documents it.

  The round, chain or tree alike (`specdec_jax.loop.round`):

      keys -> propose -> verify -> commit -> count
              (chain_round or tree_round)
  """
  b, p = prompt_tokens.shape
  k = num_speculative_tokens
  prompt_lengths = clip_lengths(prompt_lengths, p)
  # The caches and the buffer: a live row writes slots up to L+N-1 <= P + max_new_tokens + N - 1 (a dynamic
  # tree's drafter: up to L + (K-1)*k - 1). Positions stay below P + max_new_tokens (`clamp_positions`).
  max_length = p + max_new_tokens + _slots_per_round(tree, k) + 1
  constraint = None if grammar is None else Constraint(grammar, eos)

  # Models, as functions inside the program.
  t_init, t_apply = _model_fns(target_def, target_arrays, "target", b)
  kind = _draft_kind(draft_def, draft_arrays, drafter=drafter, b=b, k=k, tree=tree)
  setup = RoundSetup(
    kind=kind,
    target_apply=t_apply,
    target_copy=None if tree is None else _copy_slots(target_def, target_arrays),
    params=params,
    k=k,
    tree=tree,
    all_greedy=all_greedy,
    logprobs=logprobs,
    method=method,
    max_length=max_length,
    end=p + max_new_tokens,
    forced_accepts=forced_accepts,
    constraint=constraint,
  )
  propose_and_verify = chain_round if tree is None else tree_round

  # Start: the target's prefill and first token, then the draft kind's own start.
  start = start_loop(
    t_init,
    t_apply,
    prompt_tokens,
    prompt_lengths,
    params,
    key,
    max_new_tokens=max_new_tokens,
    eos=eos,
    max_length=max_length,
    all_greedy=all_greedy,
    with_features=kind.needs_features,
    where="speculative_generate",
    logprobs=logprobs,
    constraint=constraint,
  )
  zeros_k = jnp.zeros((k,), jnp.int32)
  state = dataclasses.replace(
    start.state,
    draft=kind.start(start, prompt_tokens, max_length),
    stats=dataclasses.replace(start.state.stats, accepted_per_position=zeros_k, reached_per_position=zeros_k),
  )

  def speculative_round(s: LoopState) -> LoopState:
    keys = round_keys(start.keys, s.length, all_greedy)
    verified = propose_and_verify(s, keys, setup)
    kept = kept_tokens(s, verified, prompt_lengths, eos=eos, max_new_tokens=max_new_tokens)
    return commit(s, verified, kept, setup, prompt_lengths, eos=eos, max_new_tokens=max_new_tokens)  # and count

  return loop_outputs(run_loop(speculative_round, state), prompt_lengths, max_new_tokens, start.empty_start)


_speculative_jit = _jit(_speculative_program, "_speculative_jit")


FEATURE_DRAFTERS = ("features", "block")  # the drafters that read the target's features


def drafter_kind(draft) -> str:
  """What drafts for `speculative_generate`: "lookup" (a `PromptLookupDrafter`), "block" (a block drafter:
  K drafts from one call), "features" (a feature drafter such as `EagleDrafter`: it reads the target's
  features) or "model" (a small language model).

  Example:
    >>> drafter_kind(PromptLookupDrafter(2))   # 'lookup'
  """
  if isinstance(draft, PromptLookupDrafter):
    return "lookup"
  if hasattr(draft, "fuse") and hasattr(draft, "feature_layers"):
    return "block" if hasattr(draft, "block_size") else "features"
  return "model"


def _draft_kind(draft_def, draft_arrays, *, drafter, b, k, tree) -> DraftKind:
  """The draft kind that drives the drafter (`drafter_kind`'s name): `LookupDraft`, `BlockDraft`,
  `FeatureDraft` or `ModelDraft`."""
  if drafter == "lookup":
    return LookupDraft(draft_def, k)
  if drafter == "block":
    return BlockDraft(draft_def, draft_arrays, b, k)
  if drafter == "features":
    return FeatureDraft(draft_def, draft_arrays, b, k)
  return ModelDraft(
    *_model_fns(draft_def, draft_arrays, "draft", b),
    k,
    copy=None if tree is None else _copy_slots(draft_def, draft_arrays),
  )
