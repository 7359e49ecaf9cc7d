"""Steps 1-3 of the processing order: logit bias, repetition, frequency and presence penalties.

`PenaltyState` is what the penalties know of each row's context (prompt mask
and counts of generated tokens); `apply_penalties` adds the round's drafts
position by position.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.sampling.params import SamplingParams, _is_concrete, check_bias_ids, check_params, static_int
from specdec_jax.sampling.reductions import LogitsView, _bcast

_F32_MAX = np.float32(np.finfo(np.float32).max)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PenaltyState:
  """What the penalties know of each row's context: a pytree of two [B, V] arrays.

  Dense over the vocabulary, so that the penalties are elementwise operations
  that fuse into the consumers of the logits (no gather or scatter per position).

  Attributes:
    prompt_mask: bool[B, V]; the token occurs in the row's prompt.
    output_counts: int32[B, V]; how often the token occurs among the row's
      generated tokens so far (the prompt is not counted).

  Example:
    >>> state = PenaltyState.from_prompt(jnp.array([[5, 2, 5, 0]]), jnp.array([3]), vocab_size=8)
    >>> state = state.add_tokens(jnp.array([[2, 7]]), jnp.array([[True, True]]))
    >>> int(state.output_counts[0, 2]), bool(state.prompt_mask[0, 0])   # token 0 was padding
    (1, False)
  """

  prompt_mask: jax.Array  # bool[B, V]
  output_counts: jax.Array  # int32[B, V]

  @classmethod
  def from_prompt(cls, prompt_tokens, prompt_lengths, vocab_size: int) -> "PenaltyState":
    """The state of rows that have generated nothing yet.

    Works under jit (vocab_size is static).

    Args:
      prompt_tokens: int[B, P] right-padded prompts.
      prompt_lengths: int[B] in [0, P]; only the first prompt_lengths[b] tokens of row b count
        (checked when concrete).
      vocab_size: V, a static int >= 1.

    Returns:
      A PenaltyState with prompt_mask set for the prompt tokens (ids outside
      [0, V) are ignored) and all output counts 0.

    Example:
      >>> PenaltyState.from_prompt(jnp.array([[3, 3, 1]]), jnp.array([2]), 4).prompt_mask   # [[F, F, F, T]]
    """
    v = static_int(vocab_size, "PenaltyState.from_prompt: vocab_size", minimum=1)
    tokens = jnp.asarray(prompt_tokens)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(
        f"PenaltyState.from_prompt: prompt_tokens must be an integer [B, P] array, got "
        f"{tokens.dtype}{list(tokens.shape)}"
      )
    b, p = tokens.shape
    lengths = jnp.asarray(prompt_lengths)
    if lengths.shape != (b,):
      raise ValueError(f"PenaltyState.from_prompt: prompt_lengths must have shape [B]=({b},), got {lengths.shape}")
    if _is_concrete(lengths):
      bad = (np.asarray(lengths) < 0) | (np.asarray(lengths) > p)
      if np.any(bad):
        raise ValueError(
          f"PenaltyState.from_prompt: prompt_lengths must be in [0, P={p}], got "
          f"{np.asarray(lengths)[bad][:8].tolist()} at rows {np.flatnonzero(bad)[:8].tolist()}"
        )
    used = jnp.arange(p, dtype=jnp.int32)[None, :] < lengths[:, None]
    rows, idx = _scatter_index(tokens, used, v)
    mask = jnp.zeros((b, v), jnp.bool_).at[rows, idx].set(True, mode="drop")
    return cls(prompt_mask=mask, output_counts=jnp.zeros((b, v), jnp.int32))

  def add_tokens(self, tokens, valid=None) -> "PenaltyState":
    """A new state with `tokens` counted as generated.

    Args:
      tokens: int[B, T] (or int[B], one token a row).
      valid: bool of the shape of `tokens`, or None for all; invalid entries,
        negative ids (-1 placeholders) and ids >= V are not counted.

    Returns:
      A PenaltyState with output_counts incremented (prompt_mask unchanged).

    Example:
      >>> state = state.add_tokens(out.token_ids, out.token_ids >= 0)   # after a round of rejection_sample
    """
    b, v = self.output_counts.shape
    tokens = jnp.asarray(tokens)
    if tokens.ndim == 1:
      tokens = tokens[:, None]
      valid = None if valid is None else jnp.asarray(valid)[:, None]
    if tokens.ndim != 2 or tokens.shape[0] != b or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(
        f"PenaltyState.add_tokens: tokens must be an integer [B]=({b},) or [B, T] array, got "
        f"{tokens.dtype}{list(tokens.shape)}"
      )
    valid = jnp.ones(tokens.shape, jnp.bool_) if valid is None else jnp.asarray(valid)
    if valid.shape != tokens.shape:
      raise ValueError(
        f"PenaltyState.add_tokens: valid must have the shape of tokens {tokens.shape}, got {valid.shape}"
      )
    rows, idx = _scatter_index(tokens, valid.astype(jnp.bool_), v)
    return dataclasses.replace(self, output_counts=self.output_counts.at[rows, idx].add(1, mode="drop"))

  @property
  def vocab_size(self) -> int:
    return self.output_counts.shape[-1]


def _scatter_index(tokens, used, v):
  """(rows, ids) for a scatter into [B, V]; unused or out-of-range ids become V, which mode="drop" skips.

  (A negative index would wrap around to the end of the row instead of being dropped.)
  """
  t = tokens.astype(jnp.int32)
  idx = jnp.where(used & (t >= 0) & (t < v), t, v)
  rows = jnp.broadcast_to(jnp.arange(t.shape[0], dtype=jnp.int32)[:, None], t.shape)
  return rows, idx


def _saturate(y, finite_inputs):
  """y, with +-inf results of finite inputs clipped to the float32 range: a finite logit stays finite."""
  return jnp.where(finite_inputs, jnp.clip(y, -_F32_MAX, _F32_MAX), y)


def apply_penalties(
  logits: jax.Array, params: SamplingParams, state: PenaltyState | None = None, draft_tokens: jax.Array | None = None
) -> jax.Array:
  """Steps 1-3 of the processing order: logit bias, repetition penalty, frequency and presence penalties.

  For position i of a speculative round, the context is the prompt, the tokens
  generated before the round (`state`) and the drafts d_0 .. d_{i-1}:

      x = logits + bias
      x = x / r if x > 0 else x * r            for tokens in the context (prompt included)
      x = x - f * n - p * (n > 0)               n = count among generated tokens and earlier drafts

  Elementwise (the draft counts are K comparisons against the broadcast drafts),
  with no exponential and no random numbers, so it fuses into whatever reads the
  result. Only the options present in `params` (see `SamplingParams`) are
  computed; rows at the neutral values (bias 0, r = 1, f = p = 0) come back
  bit for bit. NaN stays NaN (a masked token), +-inf stays +-inf, and finite
  values stay finite (saturating at the float32 limit).

  Args:
    logits: [B, V] (one position) or [B, K+1, V] (a round), any float dtype.
    params: SamplingParams of batch B.
    state: PenaltyState of batch B and vocabulary V; may be None only when
      `params` has no penalty fields (a logit bias alone needs no state).
    draft_tokens: None, or int[B, K] with [B, K+1, V] logits: the round's drafts;
      ids outside [0, V) (e.g. -1 placeholders) are in no context.

  Returns:
    f32 logits of the shape of `logits`.

  Raises:
    ValueError: for bad shapes, params or a missing state (at trace time).

  Example:
    >>> params = SamplingParams.create(1.0, repetition_penalty=2.0, presence_penalty=0.5)
    >>> state = PenaltyState.from_prompt(jnp.array([[1]]), jnp.array([1]), 3).add_tokens(jnp.array([2]))
    >>> apply_penalties(jnp.array([[1.0, 1.0, -1.0]]), params, state)   # [[1., 0.5, -2.5]]
  """
  _check_penalty_args(logits.shape, params, state, draft_tokens, "apply_penalties")
  return _penalize(logits, params, state, draft_tokens)


def _check_penalty_args(shape, params, state, draft_tokens, where):
  """Trace-time checks of `apply_penalties`' arguments (logits given by their shape)."""
  if len(shape) not in (2, 3):
    raise ValueError(f"{where}: logits must be [B, V] or [B, K+1, V], got shape {shape}")
  b, v = shape[0], shape[-1]
  check_params(params, b, where)
  if draft_tokens is not None:
    if len(shape) != 3 or jnp.shape(draft_tokens) != (b, shape[1] - 1):
      raise ValueError(
        f"{where}: draft_tokens must be [B, K] for logits [B, K+1, V]; got {jnp.shape(draft_tokens)} for logits {shape}"
      )
    if not jnp.issubdtype(jnp.result_type(draft_tokens), jnp.integer):
      raise ValueError(f"{where}: draft_tokens must be an integer array, got {jnp.result_type(draft_tokens)}")
  if params.has_penalties:
    if state is None:
      raise ValueError(
        f"{where}: params carry penalties (repetition/frequency/presence_penalty), so a PenaltyState (state) is needed"
      )
    _check_state(state, b, v, where, "state")


def penalized_view(
  logits: jax.Array,
  params: SamplingParams,
  state: PenaltyState | None = None,
  draft_tokens: jax.Array | None = None,
  vocab_offset: jax.Array | None = None,
) -> LogitsView:
  """`apply_penalties` as a `LogitsView`: each reader applies steps 1-3 itself, fused into its read.

  Same arguments (checked here, at trace time) and values as `apply_penalties`.
  With `vocab_offset` (int32 scalar), `logits` and the state hold the slice of
  the vocabulary that starts at that id (inside the samplers' shard_map).

  Example:
    >>> view = penalized_view(logits, params, state, draft)      # then sampling.values(view) inside a reader
  """
  _check_penalty_args(logits.shape, params, state, draft_tokens, "penalized_view")
  if vocab_offset is not None:
    return LogitsView(raw=logits, args=(params, state, draft_tokens, vocab_offset), fn=_penalize)
  return LogitsView(raw=logits, args=(params, state, draft_tokens), fn=_penalize)


# Up to this many bias slots are added by comparison (fused into the reader); more
# go through one [B, V] scatter.
_MAX_COMPARED_BIAS = 16


def _penalize(logits, params, state, draft_tokens, offset=0):
  """The body of `apply_penalties`, without its checks; logits hold tokens offset .. offset + V - 1."""
  b, v = logits.shape[0], logits.shape[-1]
  x = logits.astype(jnp.float32)
  m = 0 if not params.has_logit_bias else params.logit_bias_ids.shape[1]
  if 0 < m <= _MAX_COMPARED_BIAS:
    # M comparisons against the token id (repeated ids add up): elementwise, so
    # it fuses into the reader instead of writing a [B, V] array.
    vocab = jax.lax.broadcasted_iota(jnp.int32, (1, v), 1) + offset
    ids, vals = params.logit_bias_ids.astype(jnp.int32), params.logit_bias_values.astype(jnp.float32)
    bias = sum(jnp.where(ids[:, j : j + 1] == vocab, vals[:, j : j + 1], np.float32(0)) for j in range(m))
    bias = bias.reshape((b,) + (1,) * (x.ndim - 2) + (v,))
    x = _saturate(x + bias, jnp.isfinite(x) & jnp.isfinite(bias))
  elif m > 0:
    # One [B, V] scatter of the M slots (repeated ids add up), broadcast over positions.
    rows, idx = _scatter_index(params.logit_bias_ids - offset, jnp.ones(params.logit_bias_ids.shape, jnp.bool_), v)
    bias = jnp.zeros((b, v), jnp.float32).at[rows, idx].add(params.logit_bias_values.astype(jnp.float32), mode="drop")
    bias = bias.reshape((b,) + (1,) * (x.ndim - 2) + (v,))
    x = _saturate(x + bias, jnp.isfinite(x) & jnp.isfinite(bias))
  if not params.has_penalties:
    return x

  lead = (b,) + (1,) * (x.ndim - 2)
  n = state.output_counts.astype(jnp.int32).reshape(lead + (v,))
  if draft_tokens is not None:
    # Position i also counts drafts 0..i-1: K comparisons of broadcast values, no scatter.
    d = jnp.asarray(draft_tokens).astype(jnp.int32)
    vocab = jax.lax.broadcasted_iota(jnp.int32, (1, 1, v), 2) + offset
    pos = jax.lax.broadcasted_iota(jnp.int32, (1, x.shape[1], 1), 1)
    for j in range(d.shape[1]):
      n = n + ((d[:, j].reshape(b, 1, 1) == vocab) & (pos > j)).astype(jnp.int32)
  finite = jnp.isfinite(x)
  if params.repetition_penalty is not None:
    r = _bcast(params.repetition_penalty.astype(jnp.float32), x)
    seen = state.prompt_mask.reshape(lead + (v,)) | (n > 0)
    # NaN takes the x * r branch and stays NaN; +-inf stay +-inf for a finite r > 0.
    x = jnp.where(seen, _saturate(jnp.where(x > 0, x / r, x * r), finite), x)
  if params.frequency_penalty is not None or params.presence_penalty is not None:
    terms = []
    if params.frequency_penalty is not None:
      terms.append(_bcast(params.frequency_penalty.astype(jnp.float32), x) * n.astype(jnp.float32))
    if params.presence_penalty is not None:
      terms.append(_bcast(params.presence_penalty.astype(jnp.float32), x))  # only where n > 0, below
    pen = terms[0] if len(terms) == 1 else terms[0] + terms[1]
    # Clipped so that +inf - pen stays +inf; tokens with count 0 are left alone (no 0 * inf).
    pen = jnp.clip(pen, -_F32_MAX, _F32_MAX)
    x = jnp.where(n > 0, _saturate(x - pen, finite), x)
  return x


def _modifies_logits(params: SamplingParams, vocab_size: int) -> jax.Array | None:
  """bool[B]: rows whose steps 1-3 may change a logit; None when params has no such field (statically)."""
  if not (params.has_logit_bias or params.has_penalties):
    return None
  on = jnp.zeros((params.batch_size,), jnp.bool_)
  if params.has_logit_bias:
    ids = params.logit_bias_ids
    on = on | jnp.any((ids >= 0) & (ids < vocab_size) & (params.logit_bias_values != 0), axis=-1)
  if params.repetition_penalty is not None:
    on = on | (params.repetition_penalty != 1.0)
  for pen in (params.frequency_penalty, params.presence_penalty):
    if pen is not None:
      on = on | (pen != 0.0)
  return on


def penalty_params(
  params: SamplingParams, penalty_state: PenaltyState | None, batch_size: int, vocab_size: int, where: str
) -> SamplingParams:
  """A sampler's checks of its options against V and its penalty state; returns the params to sample with.

  Raises (eagerly, for concrete values) on logit-bias ids >= V, and on penalties
  without a state unless they are concrete and neutral (r = 1, f = p = 0):
  those fields are then dropped, so that `apply_penalties` needs no state.
  Traced penalties need a state. A given state must be a PenaltyState of
  [batch_size, vocab_size] arrays (checked at trace time).

  Args:
    params: SamplingParams of batch `batch_size`.
    penalty_state: PenaltyState or None.
    batch_size, vocab_size: B and V of the logits.
    where: the caller's name for messages.

  Returns:
    params, or params without its (neutral) penalty fields.

  Raises:
    ValueError: naming logit_bias or penalty_state.

  Example:
    >>> params = penalty_params(params, state, b, v, "my_sampler")
    >>> x = apply_penalties(logits, params, state) if params.has_penalties or params.has_logit_bias else logits
  """
  check_params(params, batch_size, where)
  check_bias_ids(params, vocab_size, where)
  if not params.has_penalties:
    return params
  if penalty_state is None:
    _check_neutral_penalties(params, where)
    return dataclasses.replace(params, repetition_penalty=None, frequency_penalty=None, presence_penalty=None)
  _check_state(penalty_state, batch_size, vocab_size, where, "penalty_state")
  return params


def _check_state(state, b: int, v: int, where: str, name: str) -> None:
  """Trace-time check that `state` (the argument called `name`) is a PenaltyState of [b, v] arrays."""
  if not isinstance(state, PenaltyState):
    raise ValueError(f"{where}: {name} must be a PenaltyState, got {type(state).__name__}")
  for field in ("prompt_mask", "output_counts"):
    shape = jnp.shape(getattr(state, field))
    if shape != (b, v):
      raise ValueError(f"{where}: {name}.{field} must have shape [B, V]=({b}, {v}), got {shape}")


def _check_neutral_penalties(params: SamplingParams, where: str) -> None:
  """Raises unless every penalty field of params is concrete and neutral (then no state is needed)."""
  for name, neutral in (("repetition_penalty", 1.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0)):
    value = getattr(params, name)
    if value is None:
      continue
    if not _is_concrete(value):
      raise ValueError(f"{where}: params.{name} is set (traced), so penalty_state (a PenaltyState) is needed")
    if bool(np.any(np.asarray(value) != neutral)):
      raise ValueError(
        f"{where}: params.{name} = {np.asarray(value)} needs penalty_state (a PenaltyState of the "
        "rows' prompts and generated tokens)"
      )
