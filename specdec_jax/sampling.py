"""Per-request sampling parameters and plain (non-speculative) token sampling.

Processing order for a row (docs/api.md); steps 1-3 only when the request sets
them, and for greedy rows too:

    1. logits + logit_bias
    2. repetition penalty on every token of the context (prompt, generated
       tokens, earlier drafts of the round): x / r where x > 0, else x * r
    3. x -= frequency_penalty * count + presence_penalty * (count > 0), count of
       the token among the generated tokens (and earlier drafts; not the prompt)
    4. greedy: argmax. Random:
       logits / temperature -> keep top_k largest -> renormalise
                            -> keep the smallest most-likely set with mass >= top_p
                            -> renormalise
                            -> keep tokens with probability >= min_p * the largest
                            -> renormalise

All three filters are *threshold* filters: a token is kept iff its scaled logit
is >= a per-row threshold, so tokens tied with the last kept token are kept too.
Renormalising keeps probability ratios, so min-p's cut is `x / T >= max + log(min_p)`
on the scaled logits, and the kept set is `x / T >= max(top-k/top-p threshold, that)`.
Greedy requests (temperature below `GREEDY_TEMPERATURE`) use `argmax` of the
logits after steps 1-3, first index on ties.

Values outside the ordinary range, the same rule on every path (greedy, random,
filtered or not, alone or in any batch; a row never depends on its neighbours):

* NaN logits are masked tokens (as -inf): never emitted, never the argmax.
* +inf logits mean "this token": a row with +inf logits puts all its mass,
  uniformly, on them (after top-k/top-p, which keep all of them as a tie);
  greedy takes the first.
* A row with no logit above -inf (all masked or NaN) has no distribution:
  `process_logits` gives it all -inf, and the samplers emit token 0 there
  (greedy, random and mixed alike). Eager calls of `sample_tokens` raise instead.
* Finite logits never overflow: `logits / temperature` is computed as
  `(logits - row max) / temperature` for any row where the plain quotient is not
  finite (a temperature near 0, or logits near the float32 limit), so a
  temperature near 0 behaves like greedy for every finite logit. The shifted
  recomputation runs under a run-time `lax.cond`, only for batches that need it;
  other rows keep the one-pass results bit for bit.
* Steps 1-3 (`apply_penalties`) keep these classes: NaN stays NaN, +-inf stays
  +-inf (with finite biases and penalties), and a finite logit stays finite (a
  result beyond the float32 range saturates at +-3.4e38 instead of turning into
  "this token" or "masked").

Everything here is pure `jax.numpy` and works under `jit`; a "row" is one request
and every function broadcasts the per-request parameters over any middle axes.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Temperatures below this are greedy. Dividing by a smaller temperature would only
# sharpen the distribution towards the argmax anyway, and this keeps `x / T` finite.
GREEDY_TEMPERATURE = 1e-5


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Per-request sampling parameters, a pytree of `[B]` arrays (and one `[B, M]` pair).

  The first three fields are always present. The others default to None, which
  means "absent, off": a None field holds no leaf, so the pytree structure says
  statically which options a batch may use, and requests that use none of them
  compile to the same programs as three-field parameters. `create` leaves a field
  None unless its argument is given.

  Attributes:
    temperature: f32[B]; 0 means greedy.
    top_k: i32[B]; 0 (or >= vocabulary size) means off.
    top_p: f32[B]; 1.0 means off.
    min_p: f32[B] or None; keep tokens whose probability is >= min_p times the
      largest one (after temperature, top-k and top-p); 0 means off.
    repetition_penalty: f32[B] or None; > 0, 1 means off.
    frequency_penalty: f32[B] or None; 0 means off.
    presence_penalty: f32[B] or None; 0 means off.
    logit_bias_ids: i32[B, M] or None; token ids whose logits are biased, -1 (any
      negative id) for an unused slot. Ids >= V are ignored under jit.
    logit_bias_values: f32[B, M] or None; the bias of each slot (repeated ids add up).

  Example:
    >>> params = SamplingParams.create([0.0, 0.7], top_k=[0, 50], top_p=0.9, min_p=0.05)
    >>> params.batch_size, params.has_min_p, params.has_penalties
    (2, True, False)
  """

  temperature: jax.Array  # [B]
  top_k: jax.Array  # [B]
  top_p: jax.Array  # [B]
  min_p: jax.Array | None = None  # [B]
  repetition_penalty: jax.Array | None = None  # [B]
  frequency_penalty: jax.Array | None = None  # [B]
  presence_penalty: jax.Array | None = None  # [B]
  logit_bias_ids: jax.Array | None = None  # [B, M]
  logit_bias_values: jax.Array | None = None  # [B, M]

  @classmethod
  def greedy(cls, batch_size: int) -> "SamplingParams":
    """All-greedy parameters for `batch_size` (an int >= 0) requests."""
    try:
      n = operator.index(batch_size)
    except TypeError:
      raise ValueError(f"SamplingParams.greedy: batch_size must be an int >= 0, got {batch_size!r}") from None
    if n < 0:
      raise ValueError(f"SamplingParams.greedy: batch_size must be an int >= 0, got {n}")
    return cls.create(np.zeros((n,), np.float32))

  @classmethod
  def create(cls, temperature, top_k=None, top_p=None, *, min_p=None, repetition_penalty=None,
             frequency_penalty=None, presence_penalty=None, logit_bias=None) -> "SamplingParams":
    """Builds parameters from scalars or sequences, broadcast to one batch.

    Concrete values are validated; traced values (inside `jit`) only by dtype.
    The keyword-only options stay None (absent, see the class docstring) unless
    given.

    Args:
      temperature: scalar or [B] real numbers; >= 0 and finite (as float32), 0 means greedy.
      top_k: None, scalar or [B] integers (integral floats are accepted) in [0, 2**31); 0 means off.
        Values >= the vocabulary size are off too.
      top_p: None, scalar or [B] real numbers in (0, 1]; 1 means off.
      min_p: None, scalar or [B] real numbers in [0, 1]; 0 means off.
      repetition_penalty: None, scalar or [B] real numbers > 0 and finite; 1 means off.
      frequency_penalty: None, scalar or [B] finite real numbers; 0 means off.
      presence_penalty: None, scalar or [B] finite real numbers; 0 means off.
      logit_bias: None, one mapping {token_id: bias} for every row, or a sequence
        of B mappings (one per row). Ids are ints >= 0 (ids >= V are rejected
        by the samplers, which know V), biases finite real numbers. Padded to
        the longest mapping, M, with id -1 and bias 0 (M = 0 for empty mappings).
        Concrete values only; under jit build `logit_bias_ids`/`logit_bias_values`
        directly.

    Returns:
      A `SamplingParams` with float32/int32 arrays of one shared batch size.

    Raises:
      ValueError: naming the argument, for values that are not real numbers (None,
        strings, complex, bool, ragged sequences), a negative or non-finite
        temperature (1e39 overflows float32 to inf), a top_k that is negative,
        not an integer or does not fit int32, a top_p outside (0, 1], a min_p
        outside [0, 1], a repetition_penalty <= 0 or not finite, a non-finite
        frequency or presence penalty or bias, a bias id that is not an integer
        >= 0, or sizes that do not broadcast to one batch.

    Example:
      >>> SamplingParams.create([0.0, 0.8], top_k=40).top_k   # [40, 40]
      >>> SamplingParams.create(1.0, repetition_penalty=1.2, logit_bias=[{7: -5.0}, {}]).logit_bias_ids
      ... # [[7], [-1]]
    """
    temperature = _param_array("temperature", temperature, integer=False)
    top_k = _param_array("top_k", 0 if top_k is None else top_k, integer=True)
    top_p = _param_array("top_p", 1.0 if top_p is None else top_p, integer=False)
    for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
      if value.ndim > 1:
        raise ValueError(f"SamplingParams.create: {name} must be a scalar or 1-D [B], got shape {value.shape}")
    try:
      shape = jnp.broadcast_shapes(temperature.shape, top_k.shape, top_p.shape)
    except ValueError as e:
      raise ValueError(
          "SamplingParams.create: temperature, top_k and top_p must broadcast to one batch size, got shapes "
          f"{temperature.shape}, {top_k.shape}, {top_p.shape}") from e
    # The options join the batch one at a time, so a size error names the option.
    options = {}
    for name, value in (("min_p", min_p), ("repetition_penalty", repetition_penalty),
                        ("frequency_penalty", frequency_penalty), ("presence_penalty", presence_penalty)):
      if value is None:
        continue
      arr = _param_array(name, value, integer=False)
      if arr.ndim > 1:
        raise ValueError(f"SamplingParams.create: {name} must be a scalar or 1-D [B], got shape {arr.shape}")
      shape = _join_batch(shape, arr.shape, name)
      options[name] = arr
    if logit_bias is not None:
      ids, values = _logit_bias_arrays(logit_bias)
      shape = _join_batch(shape, ids.shape[:1], "logit_bias")
      options["logit_bias_ids"], options["logit_bias_values"] = ids, values
    if shape == ():
      shape = (1,)
    if _is_concrete(temperature):
      t = np.asarray(temperature)
      if bool(np.any(t < 0)):
        raise ValueError(f"SamplingParams.create: temperature must be >= 0, got {t}")
      if not bool(np.all(np.isfinite(t))):
        raise ValueError(f"SamplingParams.create: temperature must be finite as a float32 (< 3.4e38), got {t}")
    if _is_concrete(top_p):
      p = np.asarray(top_p)
      if bool(np.any(~((p > 0) & (p <= 1)))):
        raise ValueError(f"SamplingParams.create: top_p must be in (0, 1] (1 = off), got {p}")
    _check_option_values(options)
    batched = {name: jnp.broadcast_to(a, shape + a.shape[1:]) for name, a in options.items()}
    return cls(
        temperature=jnp.broadcast_to(temperature, shape),
        top_k=jnp.broadcast_to(top_k, shape),
        top_p=jnp.broadcast_to(top_p, shape),
        **batched,
    )

  @property
  def batch_size(self) -> int:
    return self.temperature.shape[0]

  @property
  def is_greedy(self) -> jax.Array:
    """bool[B]: rows sampled by argmax."""
    return self.temperature < GREEDY_TEMPERATURE

  @property
  def has_min_p(self) -> bool:
    """Static: whether min-p may be on for some row (the field is present)."""
    return self.min_p is not None

  @property
  def has_penalties(self) -> bool:
    """Static: whether any of the repetition, frequency and presence penalties is present."""
    return any(p is not None for p in (self.repetition_penalty, self.frequency_penalty, self.presence_penalty))

  @property
  def has_logit_bias(self) -> bool:
    """Static: whether a logit bias is present (it may still have M = 0 slots)."""
    return self.logit_bias_ids is not None or self.logit_bias_values is not None


def _join_batch(shape: tuple, other: tuple, name: str) -> tuple:
  try:
    return jnp.broadcast_shapes(shape, other)
  except ValueError as e:
    raise ValueError(f"SamplingParams.create: {name} must broadcast to the batch size of the other arguments, got "
                     f"shape {other} against {shape}") from e


def _check_option_values(options: dict) -> None:
  """Range checks of `create`'s concrete options (traced ones pass: their values are not known)."""
  rules = {
      "min_p": (lambda a: (a >= 0) & (a <= 1), "must be in [0, 1] (0 = off)"),
      "repetition_penalty": (lambda a: (a > 0) & np.isfinite(a), "must be > 0 and finite (1 = off)"),
      "frequency_penalty": (np.isfinite, "must be finite as a float32 (0 = off)"),
      "presence_penalty": (np.isfinite, "must be finite as a float32 (0 = off)"),
  }
  for name, (ok, want) in rules.items():
    if name in options and _is_concrete(options[name]):
      a = np.asarray(options[name])
      if not bool(np.all(ok(a))):
        raise ValueError(f"SamplingParams.create: {name} {want}, got {a}")


def _logit_bias_arrays(logit_bias):
  """`create`'s logit_bias as (int32[R, M] ids, float32[R, M] biases), R = 1 for one shared mapping.

  Built in NumPy: the ids are dictionary keys, so they are concrete anyway.
  """
  where = "SamplingParams.create: logit_bias"
  if isinstance(logit_bias, Mapping):
    rows = [logit_bias]
  elif isinstance(logit_bias, (list, tuple)) and all(isinstance(r, Mapping) for r in logit_bias):
    rows = list(logit_bias)
  else:
    raise ValueError(f"{where} must be a mapping {{token_id: bias}} or a sequence of B such mappings, got "
                     f"{logit_bias!r}")
  m = max((len(r) for r in rows), default=0)
  ids = np.full((len(rows), m), -1, np.int32)
  values = np.zeros((len(rows), m), np.float32)
  for r, mapping in enumerate(rows):
    for j, (tid, bias) in enumerate(mapping.items()):
      try:
        tid_a, bias_a = np.asarray(tid), np.asarray(bias)
      except (TypeError, ValueError, jax.errors.TracerArrayConversionError) as e:
        raise ValueError(f"{where} must hold concrete numbers (under jit, build logit_bias_ids and "
                         f"logit_bias_values directly), got {tid!r}: {bias!r}") from e
      if tid_a.ndim != 0 or tid_a.dtype.kind not in "iu":
        raise ValueError(f"{where}: token ids must be integers >= 0, got {tid!r}")
      if int(tid_a) < 0 or int(tid_a) > np.iinfo(np.int32).max:
        raise ValueError(f"{where}: token ids must be integers >= 0 that fit int32, got {int(tid_a)}")
      if bias_a.ndim != 0 or bias_a.dtype.kind not in "iuf":
        raise ValueError(f"{where}: biases must be real numbers, got {bias!r} for token {int(tid_a)}")
      with np.errstate(over="ignore", invalid="ignore"):
        b32 = bias_a.astype(np.float32)
      if not np.isfinite(b32):
        raise ValueError(f"{where}: biases must be finite as a float32, got {bias!r} for token {int(tid_a)}")
      ids[r, j], values[r, j] = int(tid_a), b32
  return jnp.asarray(ids), jnp.asarray(values)


def _param_array(name: str, value, *, integer: bool) -> jax.Array:
  """One field of `SamplingParams.create` as an int32 or float32 array.

  Concrete values are converted through NumPy first, so that nothing wraps
  (int64 2**32 + 3 would become int32 3) and bad values are reported by name.
  """
  where = "SamplingParams.create"
  want = "integers" if integer else "real numbers"
  if isinstance(value, jax.core.Tracer):
    ok = jnp.issubdtype(value.dtype, jnp.integer) or (not integer and jnp.issubdtype(value.dtype, jnp.floating))
    if not ok or value.dtype == jnp.bool_:
      raise ValueError(f"{where}: {name} must hold {want}, got a traced array of dtype {value.dtype}")
    return value.astype(jnp.int32 if integer else jnp.float32)
  try:
    arr = np.asarray(value)
  except (ValueError, TypeError) as e:  # ragged sequences and the like
    raise ValueError(f"{where}: {name} must be a scalar or a 1-D sequence [B] of {want}, got {value!r}") from e
  if arr.dtype.kind not in "iuf":
    raise ValueError(f"{where}: {name} must be a scalar or a 1-D sequence [B] of {want}, got {value!r} "
                     f"(dtype {arr.dtype})")
  if not integer:
    with np.errstate(over="ignore", invalid="ignore"):
      return jnp.asarray(arr.astype(np.float32))
  if arr.dtype.kind == "f":
    if not bool(np.all(np.isfinite(arr) & (arr == np.round(arr)))):
      raise ValueError(f"{where}: top_k must hold integers (0 = off), got {arr}")
  if bool(np.any(arr < 0)):
    raise ValueError(f"{where}: top_k must be >= 0 (0 = off), got {arr}")
  if bool(np.any(arr > np.iinfo(np.int32).max)):
    raise ValueError(f"{where}: top_k must fit in int32 (< 2**31; 0 = off), got {arr}")
  return jnp.asarray(arr.astype(np.int32))


def check_params(params: SamplingParams, batch_size: int, where: str) -> None:
  """Raises ValueError unless `params` holds [batch_size] arrays of the right kinds.

  temperature, top_p and the present float options must be float arrays, top_k
  an integer array, and a logit bias an integer [B, M] and a float [B, M] array
  (a directly constructed `SamplingParams` skips `create`'s conversions).
  Checked at trace time, from shapes and dtypes only.

  Example:
    >>> check_params(SamplingParams.create([0.0, 1.0]), 2, "my_sampler")   # passes
  """
  if not isinstance(params, SamplingParams):
    raise ValueError(f"{where}: params must be a SamplingParams, got {type(params).__name__}")
  fields = [("temperature", "float", jnp.floating), ("top_k", "integer", jnp.integer), ("top_p", "float", jnp.floating)]
  fields += [(name, "float", jnp.floating) for name in _FLOAT_OPTIONS if getattr(params, name) is not None]
  for name, kind, dtype in fields:
    value = getattr(params, name)
    shape = jnp.shape(value)
    if shape != (batch_size,):
      raise ValueError(f"{where}: params.{name} must have shape [B]=({batch_size},), got {shape}")
    _check_kind(value, f"params.{name}", kind, dtype, where)
  ids, values = params.logit_bias_ids, params.logit_bias_values
  if (ids is None) != (values is None):
    raise ValueError(f"{where}: params.logit_bias_ids and params.logit_bias_values must both be arrays or both None")
  if ids is not None:
    if len(jnp.shape(ids)) != 2 or jnp.shape(ids)[0] != batch_size:
      raise ValueError(f"{where}: params.logit_bias_ids must have shape [B, M] with B={batch_size}, got "
                       f"{jnp.shape(ids)}")
    if jnp.shape(values) != jnp.shape(ids):
      raise ValueError(f"{where}: params.logit_bias_values must have the shape of params.logit_bias_ids "
                       f"{jnp.shape(ids)}, got {jnp.shape(values)}")
    _check_kind(ids, "params.logit_bias_ids", "integer", jnp.integer, where)
    _check_kind(values, "params.logit_bias_values", "float", jnp.floating, where)


_FLOAT_OPTIONS = ("min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


def _check_kind(value, name: str, kind: str, dtype, where: str) -> None:
  if not jnp.issubdtype(jnp.result_type(value), dtype):
    raise ValueError(f"{where}: {name} must be a{'n' if kind == 'integer' else ''} {kind} array, got dtype "
                     f"{jnp.result_type(value)} (SamplingParams.create converts)")


def check_bias_ids(params: SamplingParams, vocab_size: int, where: str) -> None:
  """Eager check (skipped for traced ids): every logit-bias id is < vocab_size.

  `create` cannot know V; under jit an id >= V is ignored, eagerly it is an error.

  Args:
    params: SamplingParams (with or without a logit bias).
    vocab_size: V.
    where: the caller's name for the message.

  Raises:
    ValueError: naming logit_bias, with the offending ids.

  Example:
    >>> check_bias_ids(SamplingParams.create(1.0, logit_bias={5: 1.0}), 4, "f")   # ValueError: id 5 >= V=4
  """
  ids = params.logit_bias_ids
  if ids is None or not _is_concrete(ids):
    return
  ids = np.asarray(ids)
  bad = ids >= vocab_size
  if bool(np.any(bad)):
    raise ValueError(f"{where}: logit_bias holds token ids >= the vocabulary size V={vocab_size}: "
                     f"{sorted(set(ids[bad].tolist()))[:8]} (under jit they would be ignored)")


# ----------------------------------------------------------------------------
# Keys
# ----------------------------------------------------------------------------


def row_keys(key, batch_size: int, where: str = "key") -> jax.Array:
  """One typed PRNG key per row.

  A single key gives row b `fold_in(key, b)`; a batch of B keys gives row b
  exactly `key[b]`, so a row never depends on its neighbours. Raw `uint32[2]`
  keys (and batches `uint32[B, 2]`) are accepted.

  Args:
    key: typed key [] or [B], or raw uint32 [2] or [B, 2].
    batch_size: B.
    where: argument name used in error messages.

  Returns:
    A typed key array of shape [B].

  Example:
    >>> keys = row_keys(jax.random.key(0), 4)   # keys.shape == (4,)
  """
  key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    typed = key
  elif key.dtype == jnp.uint32 and key.ndim >= 1 and key.shape[-1] == 2:
    typed = jax.random.wrap_key_data(key)
  else:
    raise ValueError(
        f"{where} must be a typed PRNG key (jax.random.key) or a raw uint32[2] key, "
        f"or a batch of B of either; got dtype {key.dtype}, shape {key.shape}")
  if typed.ndim == 0:  # int32 row ids also under jax_enable_x64, so keys do not change with it
    return jax.vmap(lambda b: jax.random.fold_in(typed, b))(jnp.arange(batch_size, dtype=jnp.int32))
  if typed.shape == (batch_size,):
    return typed
  raise ValueError(f"{where}: expected one key or a batch of B={batch_size} keys, got key batch shape {typed.shape}")


# ----------------------------------------------------------------------------
# One-pass reductions over the vocabulary
# ----------------------------------------------------------------------------


def _lse_combine(m1, s1, m2, s2):
  """Merges two (max, sum of exp(x - max)) pairs with a single exponential.

  The larger max survives and only the other side's sum is rescaled. A side
  whose max is -inf carries no mass (and exp(-inf - -inf) would be NaN).
  """
  first = m1 >= m2
  hi, lo = jnp.where(first, m1, m2), jnp.where(first, m2, m1)
  s_hi, s_lo = jnp.where(first, s1, s2), jnp.where(first, s2, s1)
  return hi, s_hi + jnp.where(lo == -jnp.inf, 0.0, s_lo * jnp.exp(lo - hi))


def max_and_sumexp(x: jax.Array, *, with_argmax: bool = False):
  """One pass: (max, sum exp(x - max)[, first argmax]) over the last axis.

  XLA's logsumexp makes two passes (max, then sum); a variadic reduce whose
  combiner rescales the running sum reads x once, and carrying the argmax index
  too costs no extra read. The combiner needs one exponential per element.
  Rows that are all -inf give (-inf, 0).

  Args:
    x: f32[..., V].
    with_argmax: also return the first index of the maximum.

  Returns:
    (m f32[...], s f32[...]) with logsumexp(x) = m + log(s), and
    argmax int32[...] as a third element when `with_argmax`.

  Example:
    >>> m, s = max_and_sumexp(jnp.log(jnp.array([[1., 3.]])))   # m + log(s) == log(4)
  """

  def combine(a, b):
    m, s = _lse_combine(a[0], a[1], b[0], b[1])
    if not with_argmax:
      return m, s
    i = jnp.where(a[0] > b[0], a[2], jnp.where(b[0] > a[0], b[2], jnp.minimum(a[2], b[2])))
    return m, s, i

  operands, init = (x, jnp.ones_like(x)), (np.float32(-np.inf), np.float32(0))
  if with_argmax:
    operands += (jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1),)
    init += (np.int32(np.iinfo(np.int32).max),)
  return jax.lax.reduce(operands, init, combine, (x.ndim - 1,))


# ----------------------------------------------------------------------------
# Logit bias and penalties (steps 1-3 of the processing order)
# ----------------------------------------------------------------------------

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
      prompt_lengths: int[B]; only the first prompt_lengths[b] tokens of row b count.
      vocab_size: V, a static int >= 1.

    Returns:
      A PenaltyState with prompt_mask set for the prompt tokens (ids outside
      [0, V) are ignored) and all output counts 0.

    Example:
      >>> PenaltyState.from_prompt(jnp.array([[3, 3, 1]]), jnp.array([2]), 4).prompt_mask   # [[F, F, F, T]]
    """
    try:
      v = operator.index(vocab_size)
    except TypeError:
      raise ValueError(f"PenaltyState.from_prompt: vocab_size must be a static int >= 1, got {vocab_size!r}") from None
    if v < 1:
      raise ValueError(f"PenaltyState.from_prompt: vocab_size must be >= 1, got {v}")
    tokens = jnp.asarray(prompt_tokens)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"PenaltyState.from_prompt: prompt_tokens must be an integer [B, P] array, got "
                       f"{tokens.dtype}{list(tokens.shape)}")
    b, p = tokens.shape
    lengths = jnp.asarray(prompt_lengths)
    if lengths.shape != (b,):
      raise ValueError(f"PenaltyState.from_prompt: prompt_lengths must have shape [B]=({b},), got {lengths.shape}")
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
      raise ValueError(f"PenaltyState.add_tokens: tokens must be an integer [B]=({b},) or [B, T] array, got "
                       f"{tokens.dtype}{list(tokens.shape)}")
    valid = jnp.ones(tokens.shape, jnp.bool_) if valid is None else jnp.asarray(valid)
    if valid.shape != tokens.shape:
      raise ValueError(f"PenaltyState.add_tokens: valid must have the shape of tokens {tokens.shape}, got "
                       f"{valid.shape}")
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


def apply_penalties(logits: jax.Array, params: SamplingParams, state: PenaltyState | None = None,
                    draft_tokens: jax.Array | None = None) -> jax.Array:
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
  where = "apply_penalties"
  if logits.ndim not in (2, 3):
    raise ValueError(f"{where}: logits must be [B, V] or [B, K+1, V], got shape {logits.shape}")
  b, v = logits.shape[0], logits.shape[-1]
  check_params(params, b, where)
  if draft_tokens is not None:
    if logits.ndim != 3 or jnp.shape(draft_tokens) != (b, logits.shape[1] - 1):
      raise ValueError(f"{where}: draft_tokens must be [B, K] for logits [B, K+1, V]; got {jnp.shape(draft_tokens)} "
                       f"for logits {logits.shape}")
    if not jnp.issubdtype(jnp.result_type(draft_tokens), jnp.integer):
      raise ValueError(f"{where}: draft_tokens must be an integer array, got {jnp.result_type(draft_tokens)}")
  if params.has_penalties:
    if state is None:
      raise ValueError(f"{where}: params carry penalties (repetition/frequency/presence_penalty), so a "
                       "PenaltyState (state) is needed")
    if not isinstance(state, PenaltyState):
      raise ValueError(f"{where}: state must be a PenaltyState, got {type(state).__name__}")
    for name in ("prompt_mask", "output_counts"):
      if jnp.shape(getattr(state, name)) != (b, v):
        raise ValueError(f"{where}: state.{name} must have shape [B, V]=({b}, {v}), got "
                         f"{jnp.shape(getattr(state, name))}")
  x = logits.astype(jnp.float32)
  if params.has_logit_bias and params.logit_bias_ids.shape[1] > 0:
    # One [B, V] scatter of the M slots (repeated ids add up), broadcast over positions.
    rows, idx = _scatter_index(params.logit_bias_ids, jnp.ones(params.logit_bias_ids.shape, jnp.bool_), v)
    bias = jnp.zeros((b, v), jnp.float32).at[rows, idx].add(params.logit_bias_values.astype(jnp.float32),
                                                            mode="drop")
    bias = bias.reshape((b,) + (1,) * (x.ndim - 2) + (v,))
    x = _saturate(x + bias, jnp.isfinite(x) & jnp.isfinite(bias))
  if not params.has_penalties:
    return x

  lead = (b,) + (1,) * (x.ndim - 2)
  n = state.output_counts.astype(jnp.int32).reshape(lead + (v,))
  if draft_tokens is not None:
    # Position i also counts drafts 0..i-1: K comparisons of broadcast values, no scatter.
    d = jnp.asarray(draft_tokens).astype(jnp.int32)
    vocab = jax.lax.broadcasted_iota(jnp.int32, (1, 1, v), 2)
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


# ----------------------------------------------------------------------------
# Logit processing
# ----------------------------------------------------------------------------


def _bcast(row_values: jax.Array, x: jax.Array) -> jax.Array:
  """Reshapes per-row values [B] to broadcast against x [B, ..., V]."""
  return row_values.reshape(row_values.shape + (1,) * (x.ndim - 1))


def scale_logits(logits: jax.Array, temperature: jax.Array, shift: jax.Array | None = None) -> jax.Array:
  """float32 (logits - shift) / temperature, with greedy rows left at temperature 1.

  NaN results (NaN logits) become -inf: a NaN logit is a masked token. With a
  `shift` (the row max, see `shift_non_finite_rows`), a logit equal to it maps
  to 0, which also makes +inf - +inf a 0 (the +inf tokens share the mass).

  Args:
    logits: [B, ..., V], any float dtype.
    temperature: f32[B].
    shift: f32[B, ...] or None (no shift, the plain quotient).

  Returns:
    f32[B, ..., V].

  Example:
    >>> scale_logits(jnp.array([[2.0, jnp.nan]]), jnp.array([0.5]))   # [[4., -inf]]
  """
  x = logits.astype(jnp.float32)
  t = _bcast(jnp.where(temperature < GREEDY_TEMPERATURE, 1.0, temperature).astype(jnp.float32), x)
  if shift is None:
    y = x / t
  else:
    s = shift.astype(jnp.float32)[..., None]
    y = jnp.where(x == s, 0.0, (x - s) / t)
  return jnp.where(jnp.isnan(y), -jnp.inf, y)


def greedy_argmax(logits: jax.Array):
  """First index of the largest logit, NaN counted as -inf; 0 for a row with none above -inf.

  A single variadic reduction (like `jnp.argmax`, which would pick a NaN): the
  NaN rule lives in the combiner, so no masked copy of the logits is formed.

  Args:
    logits: [..., V], any float dtype.

  Returns:
    (int32[...] indices, [...] the max in the logits' dtype; -inf for a row without
    a usable logit).

  Example:
    >>> greedy_argmax(jnp.array([[1.0, jnp.nan, 3.0]]))[0]   # [2]
  """
  x = jnp.asarray(logits)
  neg_inf = np.array(-np.inf, x.dtype)

  def combine(a, b):
    av, bv = jnp.where(jnp.isnan(a[0]), neg_inf, a[0]), jnp.where(jnp.isnan(b[0]), neg_inf, b[0])
    take_b = (bv > av) | ((bv == av) & (b[1] < a[1]))
    return jnp.where(take_b, bv, av), jnp.where(take_b, b[1], a[1])

  iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  best, idx = jax.lax.reduce((x, iota), (neg_inf, np.int32(np.iinfo(np.int32).max)), combine, (x.ndim - 1,))
  # Every entry -inf or NaN: the index is the first one, 0.
  return idx.astype(jnp.int32), best


def shift_non_finite_rows(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                          thr: jax.Array, lse: jax.Array, *, min_p: jax.Array | None = None):
  """Redoes (thr, lse) of the rows whose log-normaliser `lse` is not finite.

  The one-pass reductions compute `logits / T`, which overflows for a small
  temperature or logits near the float32 limit (or meets a +inf logit, or finds
  no finite logit at all); then lse is +-inf or NaN. For those rows only, this
  subtracts the row's max before dividing (`scale_logits` with a shift): every
  value is then <= 0, and an overflow can only give -inf, i.e. a probability
  that rounds to 0 anyway. It sorts the batch, an extra pass or two, run only
  under a `lax.cond` when some row needs it; other rows keep shift 0, so their
  values are those of the one pass.

  Args:
    logits: [B, ..., V], any float dtype (raw).
    temperature, top_k, top_p: [B] sampling parameters.
    thr, lse: f32[B, ...] from the one-pass search (`threshold_and_lse` or
      `max_and_sumexp`).
    min_p: f32[B] or None (off), as given to `threshold_and_lse`.

  Returns:
    (shift, thr, lse), each f32[B, ...]: scale with `scale_logits(logits,
    temperature, shift)`; lse is -inf exactly for rows with no logit above -inf
    (no NaN anywhere).

  Example:
    >>> shift, thr, lse = shift_non_finite_rows(logits, t, k, p, *threshold_and_lse(logits, t, k, p))
  """
  redo = ~jnp.isfinite(lse)

  def fix(raw):
    x = raw.astype(jnp.float32)
    m = jnp.max(jnp.where(jnp.isnan(x), -jnp.inf, x), axis=-1)  # only here: a second read of the logits
    empty = redo & (m == -jnp.inf)
    shift = jnp.where(redo & ~empty, m, 0.0)
    new_thr, new_lse = _sorted_threshold_and_lse(scale_logits(raw, temperature, shift), top_k, top_p, min_p=min_p)
    return shift, jnp.where(redo, new_thr, thr), jnp.where(empty, -jnp.inf, jnp.where(redo, new_lse, lse))

  return jax.lax.cond(jnp.any(redo), fix, lambda raw: (jnp.zeros_like(lse), thr, lse), logits)


def filter_active(params: SamplingParams, vocab_size: int, *, min_p: jax.Array | None = None) -> jax.Array:
  """bool[B]: random rows whose top-k, top-p or min-p may remove tokens.

  Args:
    params: SamplingParams of batch B.
    vocab_size: V (top_k >= V is off).
    min_p: f32[B] to use instead of `params.min_p`; None reads `params.min_p`,
      which is itself None (off) unless the request set it.

  Example:
    >>> filter_active(SamplingParams.create([1.0, 1.0, 0.0], top_k=[0, 5, 5], min_p=[0.1, 0.0, 0.0]), 100)
    ... # [True, True, False]
  """
  k_on = (params.top_k > 0) & (params.top_k < vocab_size)
  on = k_on | (params.top_p < 1.0)
  min_p = params.min_p if min_p is None else min_p
  if min_p is not None:
    on = on | (min_p > 0)
  return on & ~params.is_greedy


def sorted_threshold(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, *,
                     min_p: jax.Array | None = None) -> jax.Array:
  """Top-k/top-p(/min-p) threshold by a full descending sort of the vocabulary.

  The reference method: exact, but a sort of [B, ..., V] costs tens of passes
  over the logits. `top_k_top_p_threshold` uses it only as a fallback.

  Args:
    scaled: f32[B, ..., V] temperature-scaled logits.
    top_k: i32[B], 0 or >= V means off.
    top_p: f32[B], 1 means off.
    min_p: f32[B] or None; 0 (or None) means off.

  Returns:
    f32[B, ...] thresholds (-inf where nothing is filtered): keep iff x >= it.

  Example:
    >>> sorted_threshold(jnp.log(jnp.array([[0.5, 0.3, 0.2]])), jnp.array([0]), jnp.array([0.7]))   # [log 0.3]
  """
  return _sorted_threshold_and_lse(scaled, top_k, top_p, min_p=min_p)[0]


def _sorted_threshold_and_lse(scaled, top_k, top_p, *, min_p=None):
  xs = -jnp.sort(-scaled, axis=-1)
  thr, _, mass = _threshold_from_sorted(xs, top_k, top_p, scaled.shape[-1], min_p=min_p)
  return thr, xs[..., 0] + jnp.log(mass)


def _threshold_from_sorted(xs, top_k, top_p, v, total_mass=None, m=None, *, min_p=None):
  """Threshold from values sorted descending along the last axis.

  xs may hold only the largest candidates of each row; then `total_mass` (sum of
  exp(x - m) over the whole row) and `m` (the row max) must be given, and the
  caller checks for which rows the candidates sufficed (see
  `top_k_top_p_threshold`). With the full sorted row, both are computed here.
  min_p (f32[B] or None) raises the threshold to m + log(min_p) where it is > 0.

  Returns:
    (thr, kth, kept_mass), each f32[B, ...]: the threshold (-inf when nothing is
    filtered), the top-k value (-inf when top-k is off) and the mass of the
    kept set, sum of exp(x - m) over x >= thr.
  """
  c = xs.shape[-1]
  m = xs[..., 0] if m is None else m
  k_on = _bcast((top_k > 0) & (top_k < v), xs[..., 0])
  p_on = _bcast(top_p < 1.0, xs[..., 0])
  k = _bcast(jnp.clip(top_k, 1, c), xs[..., 0])
  kth = jnp.where(k_on, jnp.take_along_axis(xs, (k - 1)[..., None], axis=-1)[..., 0], -jnp.inf)
  e = jnp.exp(xs - m[..., None])
  kept_k = xs >= kth[..., None]
  cum = jnp.cumsum(jnp.where(kept_k, e, 0.0), axis=-1)
  row_mass = cum[..., -1] if total_mass is None else total_mass  # all tokens (top-k off)
  # Mass of the top-k set: from the candidates when top-k is on (all kept tokens
  # are among them), else the whole row's mass.
  z = jnp.where(k_on, cum[..., -1], row_mass)
  p = _bcast(top_p, kth)
  # First sorted position whose cumulative mass reaches top_p, clipped into the
  # kept set (rounding can leave the total a hair under top_p).
  first = jnp.sum(cum < (p * z)[..., None], axis=-1)
  first = jnp.minimum(first, jnp.sum(kept_k, axis=-1) - 1)
  pth = jnp.take_along_axis(xs, first[..., None], axis=-1)[..., 0]
  thr = jnp.where(p_on, jnp.maximum(kth, pth), kth)
  on = k_on | p_on
  if min_p is not None:
    # Top-k and top-p keep the max and renormalising keeps probability ratios, so
    # "p >= min_p * p_max" is x >= m + log(min_p) whatever they removed.
    mp_on = _bcast(min_p > 0, thr)
    mth = jnp.where(mp_on, m + jnp.log(jnp.where(mp_on, _bcast(min_p, thr), 1.0)), -jnp.inf)
    thr = jnp.maximum(thr, mth)
    on = on | mp_on
  kept_mass = jnp.where(on, jnp.sum(jnp.where(xs >= thr[..., None], e, 0.0), axis=-1), row_mass)
  return thr, kth, kept_mass


# The sort-free threshold search keeps the _PER_GROUP largest values of each
# group of tokens; about _NUM_GROUPS groups per row make it rare that a row's
# kept set puts more than _PER_GROUP tokens into one group (odds about
# C(k, 4) / G^3 for top-k: 2e-4 at k=50). Up to _MAX_SORTED_ROWS rows that
# still fail are sorted individually.
_PER_GROUP = 4
_NUM_GROUPS = 1024
_MAX_SORTED_ROWS = 64


def _group_size(v: int) -> int:
  """About V / 1024 tokens a group, in [16, 128]; a divisor of V if one is near
  (a padded copy of the logits would cost a write and a read)."""
  want = int(np.clip(v // _NUM_GROUPS, 16, 128))
  divisors = [g for g in range(16, 129) if v % g == 0 and want / 2 <= g <= 2 * want]
  return min(divisors, key=lambda g: abs(g - want)) if divisors else want


def _merge_top(a, b):
  """Largest len(a) of two descending lists (tuples of arrays), multiset-wise.

  The i-th largest of the union is max_j min(a_j, b_{i-j}) with a_0 = b_0 = +inf.
  """
  n = len(a)
  inf = jnp.full_like(a[0], jnp.inf)
  aa, bb = (inf,) + tuple(a), (inf,) + tuple(b)
  out = []
  for i in range(1, n + 1):
    best = jnp.minimum(aa[0], bb[i])
    for j in range(1, i + 1):
      best = jnp.maximum(best, jnp.minimum(aa[j], bb[i - j]))
    out.append(best)
  return tuple(out)


def group_top(x: jax.Array, group_size: int | None = None, per_group: int = _PER_GROUP, *,
              with_sumexp: bool = False):
  """The `per_group` largest values of every `group_size` block of the last axis.

  One fused variadic reduction (a single read of x): each element enters as the
  list (x, -inf, ..., -inf) and lists are merged by `_merge_top`.

  Args:
    x: f32[..., V].
    group_size: tokens per group (default: about V / 1024, in [16, 128]).
    per_group: values kept per group.
    with_sumexp: also return each group's sum of exp(x - group max), from the
      same pass (the whole row's mass then needs no second read).

  Returns:
    f32[..., ceil(V / group_size), per_group], descending within each group;
    with `with_sumexp`, a pair (that, f32[..., G] sums).

  Example:
    >>> tops = group_top(jnp.arange(64.0)[None], group_size=16, per_group=2)  # [[[15, 14], [31, 30], ...]]
  """
  v = x.shape[-1]
  group_size = _group_size(v) if group_size is None else group_size
  g = -(-v // group_size)
  xg = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, g * group_size - v)], constant_values=-jnp.inf)
  xg = xg.reshape(x.shape[:-1] + (g, group_size))
  fill = jnp.full_like(xg, -jnp.inf)
  operands = (xg,) + (fill,) * (per_group - 1)
  init = tuple(np.float32(-np.inf) for _ in range(per_group))
  if with_sumexp:
    operands, init = operands + (jnp.ones_like(xg),), init + (np.float32(0),)

  def combine(a, b):
    top = _merge_top(a[:per_group], b[:per_group])
    if not with_sumexp:
      return top
    return top + (_lse_combine(a[0], a[-1], b[0], b[-1])[1],)

  out = jax.lax.reduce(operands, init, combine, (xg.ndim - 1,))
  tops = jnp.stack(out[:per_group], axis=-1)
  return (tops, out[-1]) if with_sumexp else tops


def top_k_top_p_threshold(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array,
                          *, group_size: int | None = None, min_p: jax.Array | None = None) -> jax.Array:
  """Per-row-and-position threshold on scaled logits: keep iff x >= threshold.

  The top-k threshold is the k-th largest value; the top-p threshold is the value
  of the first token, in descending order, at which the cumulative mass (within
  the top-k set) reaches top_p. Tokens tied with a threshold are kept.

  Sort-free over the vocabulary: one pass keeps the 4 largest values of every
  group of tokens (about 1024 groups) and each group's mass, and only those
  candidates are sorted. Any token outside the candidates is <= its group's 4th
  largest, so a row's answer is exact whenever its threshold exceeds every
  group's 4th largest value (for language-model logits: top-k up to about 100,
  and top-p sets of similar size). Rows where that fails (e.g. top-p over a
  flat distribution) are sorted individually, up to 64 of them; beyond that a
  `lax.switch` sorts the whole batch. The result is always exact.

  Args:
    scaled: f32[B, ..., V] temperature-scaled logits.
    top_k: i32[B], 0 or >= V means off.
    top_p: f32[B], 1 means off.
    group_size: static group size of the candidate search (default: about V/1024).
    min_p: f32[B] or None; also keep only x >= max + log(min_p) (0 or None: off).

  Returns:
    f32[B, ...] thresholds (-inf where nothing is filtered).

  Example:
    >>> thr = top_k_top_p_threshold(x, jnp.array([50]), jnp.array([0.9]))  # x: [1, V]
  """
  return threshold_and_lse(scaled, None, top_k, top_p, group_size=group_size, min_p=min_p)[0]


def threshold_and_lse(logits: jax.Array, temperature: jax.Array | None, top_k: jax.Array, top_p: jax.Array,
                      *, group_size: int | None = None, min_p: jax.Array | None = None):
  """Top-k/top-p(/min-p) threshold and the log-normaliser of the kept set, sort-free.

  Like `top_k_top_p_threshold`, but on raw logits with the temperature applied
  inside every consumer (so a lazily scaled copy is never written to memory,
  not even as a branch operand), and it also returns
  lse = logsumexp(x over x >= thr), read off the candidates: the log-probability
  of a kept token is then x - lse, with no further pass over the vocabulary.

  With min_p, the threshold is max(top-k/top-p threshold, max + log(min_p)) and
  lse that of the final kept set. A row is exact from the candidates when that
  final threshold exceeds every group's 4th largest value (and, when top-k and
  top-p are both on, the top-k value does too, as top-p's mass is that of the
  top-k set); other rows are sorted, as without min_p.

  Args:
    logits: [B, ..., V], any float dtype (already scaled if temperature is None).
    temperature: f32[B] or None.
    top_k: i32[B], 0 or >= V means off.
    top_p: f32[B], 1 means off.
    group_size: static group size of the candidate search (default: about V/1024).
    min_p: f32[B] in [0, 1] or None; 0 or None means off (None compiles exactly
      the program without min-p).

  Returns:
    (thr, lse), each f32[B, ...].

  Example:
    >>> thr, lse = threshold_and_lse(logits, params.temperature, params.top_k, params.top_p)
  """
  scale = (lambda x: x.astype(jnp.float32)) if temperature is None else (lambda x: scale_logits(x, temperature))
  v = logits.shape[-1]
  group_size = _group_size(v) if group_size is None else group_size
  if v <= 2 * group_size * _PER_GROUP:  # small vocabularies: a sort is cheap
    return _sorted_threshold_and_lse(scale(logits), top_k, top_p, min_p=min_p)
  tops, group_mass = group_top(scale(logits), group_size, with_sumexp=True)  # [..., G, 4], [..., G]
  cand = -jnp.sort(-tops.reshape(tops.shape[:-2] + (-1,)), axis=-1)  # [..., 4G]
  floor = jnp.max(tops[..., -1], axis=-1)  # tokens outside the candidates are <= this
  m = cand[..., 0]
  total = jnp.sum(jnp.where(group_mass > 0, group_mass * jnp.exp(tops[..., 0] - m[..., None]), 0.0), axis=-1)
  thr, kth, kept_mass = _threshold_from_sorted(cand, top_k, top_p, v, total, m, min_p=min_p)
  k_on = _bcast((top_k > 0) & (top_k < v), thr)
  p_on = _bcast(top_p < 1.0, thr)
  kth_exact = (_bcast(top_k, thr) <= cand.shape[-1]) & (kth > floor)
  if min_p is None:
    exact = jnp.where(k_on, kth_exact, jnp.where(p_on, thr > floor, True))
  else:
    # A candidate top-k (top-p) value <= floor means the true one is <= floor too,
    # so a final threshold above the floor is the true one; but top-p's cut
    # depends on the top-k set's mass, which needs an exact top-k value.
    mp_on = _bcast(min_p > 0, thr)
    exact = jnp.where(k_on | p_on | mp_on, (thr > floor) & (kth_exact | ~(k_on & p_on)), True)
  lse = m + jnp.log(kept_mass)

  # Rows whose candidates did not suffice: sort just those (a fixed number of
  # them, so shapes stay static), or the whole batch if there are too many.
  # Branches take the raw logits (an operand, not a closure over a scaled copy).
  rows = thr.size
  row_batch = jnp.broadcast_to(jnp.arange(logits.shape[0]).reshape((-1,) + (1,) * (thr.ndim - 1)), thr.shape)
  n_fix = min(_MAX_SORTED_ROWS, rows)
  bad = jnp.nonzero(~exact.reshape(-1), size=n_fix, fill_value=rows)[0]  # [n_fix], `rows` = unused slot
  safe = jnp.minimum(bad, rows - 1)

  def fix_rows(thr, lse, raw):
    b_of = row_batch.reshape(-1)[safe]
    sub = raw.reshape(-1, v)[safe].astype(jnp.float32)
    if temperature is not None:
      sub = scale_logits(sub, temperature[b_of])
    fixed_thr, fixed_lse = _sorted_threshold_and_lse(sub, top_k[b_of], top_p[b_of],
                                                     min_p=None if min_p is None else min_p[b_of])
    put = lambda a, new: a.reshape(-1).at[bad].set(new, mode="drop").reshape(a.shape)
    return put(thr, fixed_thr), put(lse, fixed_lse)

  num_bad = jnp.sum(~exact)
  return jax.lax.switch(
      jnp.where(num_bad == 0, 0, jnp.where(num_bad <= n_fix, 1, 2)),
      [lambda thr, lse, raw: (thr, lse), fix_rows,
       lambda thr, lse, raw: _sorted_threshold_and_lse(scale(raw), top_k, top_p, min_p=min_p)],
      thr, lse, logits)


def process_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """Log-probabilities after temperature, top-k, top-p and min-p (every row as random).

  Step 4 of the processing order only: the logit bias and the penalties
  (`apply_penalties`) are the caller's, before this. min-p is read from
  `params.min_p` (None: off, and the program is the one without min-p).
  Greedy rows are processed at temperature 1; callers pick argmax for them.
  NaN logits count as -inf, +inf logits share all the mass, and a row with no
  logit above -inf comes out all -inf (see the module docstring).

  Args:
    logits: [B, ..., V], any float dtype.
    params: SamplingParams of batch B.

  Returns:
    f32[B, ..., V] normalised log-probabilities, -inf for removed tokens.

  Example:
    >>> logp = process_logits(jnp.zeros((2, 5)), SamplingParams.create(1.0, top_k=2))
  """
  t = params.temperature
  min_p = params.min_p

  def unfiltered(raw):
    m, s = max_and_sumexp(scale_logits(raw, t))
    return jnp.full(raw.shape[:-1], -jnp.inf, jnp.float32), m + jnp.log(s)

  # The threshold search is the costliest step: skip it at run time when no row
  # filters anything. (The raw logits go into the cond, so scaling stays fusible.)
  thr, lse = jax.lax.cond(jnp.any(filter_active(params, logits.shape[-1])),
                          lambda raw: threshold_and_lse(raw, t, params.top_k, params.top_p, min_p=min_p),
                          unfiltered, logits)
  shift, thr, lse = shift_non_finite_rows(logits, t, params.top_k, params.top_p, thr, lse, min_p=min_p)
  scaled = scale_logits(logits, t, shift)
  keep = (scaled >= thr[..., None]) & (lse[..., None] > -jnp.inf)
  return jnp.where(keep, scaled - lse[..., None], -jnp.inf)


# ----------------------------------------------------------------------------
# Drawing one token from unnormalised weights
# ----------------------------------------------------------------------------


def log_softmax_stats(logits: jax.Array):
  """(shift, thr, lse) of the unmodified distribution, softmax(logits) at temperature 1, for `token_log_probs`.

  One pass over the logits (`max_and_sumexp`); rows whose normaliser is not
  finite (+inf logits, overflow, nothing above -inf) are redone as in
  `process_logits`, so +inf tokens share the mass and NaN counts as -inf.

  Args:
    logits: [B, ..., V], any float dtype.

  Returns:
    (shift, thr, lse), each f32[B, ...]; thr is -inf (nothing filtered).

  Example:
    >>> stats = log_softmax_stats(logits)   # then token_log_probs(logits, tokens, ones, *stats)
  """
  b = logits.shape[0]
  t = jnp.ones((b,), jnp.float32)
  m, s = max_and_sumexp(scale_logits(logits, t))
  thr = jnp.full(logits.shape[:-1], -jnp.inf, jnp.float32)
  return shift_non_finite_rows(logits, t, jnp.zeros((b,), jnp.int32), jnp.ones((b,), jnp.float32), thr,
                               m + jnp.log(s))


def token_log_probs(logits: jax.Array, tokens: jax.Array, temperature: jax.Array, shift: jax.Array, thr: jax.Array,
                    lse: jax.Array) -> jax.Array:
  """log p(token) under the distribution that (shift, thr, lse) describe, reading one logit per token.

  Args:
    logits: [B, ..., V], any float dtype.
    tokens: int [B, ...]; ids outside [0, V) read id 0 (callers mask them).
    temperature: f32[B] (greedy rows count as temperature 1, as in `scale_logits`).
    shift, thr, lse: f32[B, ...] from `log_softmax_stats`, or the sampler's own
      (temperature, top-k, top-p) statistics.

  Returns:
    f32[B, ...]: x - lse where the token is kept (x >= thr), -inf otherwise or
    where the position has no logit above -inf.

  Example:
    >>> lp = token_log_probs(logits, tokens, jnp.ones(b), *log_softmax_stats(logits))
  """
  safe = jnp.clip(tokens, 0, logits.shape[-1] - 1)
  x = scale_logits(jnp.take_along_axis(logits, safe[..., None], axis=-1), temperature, shift)[..., 0]
  return jnp.where((x >= thr) & (lse > -jnp.inf), x - lse, -jnp.inf)


def requested_log_probs(logits: jax.Array, tokens: jax.Array, params: SamplingParams, processed: jax.Array,
                        mode: str, greedy: jax.Array) -> jax.Array:
  """The log-probabilities `mode` asks for ("raw" or "processed"), given the sampled distribution's.

  `processed` holds log p(token) under the distribution each row samples from
  (bias, penalties, temperature, top-k, top-p, min-p). Random rows keep those
  values for "processed", and for "raw" too where they are the raw ones
  (temperature 1, nothing filtered, no bias or penalty: e.g. RL rollouts). The
  other rows, greedy rows included, get `log_softmax` of `logits`: one more pass
  over them, run only when some row needs it.

  Args:
    logits: [B, ..., V] the target's logits: the raw ones for "raw"; for
      "processed", those after the logit bias and penalties (`apply_penalties`),
      which greedy rows read (they are the raw ones when params has neither).
    tokens: int [B, ...] the emitted tokens.
    params: SamplingParams of batch B.
    processed: f32[B, ...] log p(token) under the sampled distribution.
    mode: "raw" or "processed" (static).
    greedy: bool[B] rows that count as greedy.

  Returns:
    f32[B, ...].

  Example:
    >>> lp = requested_log_probs(logits, tokens, params, processed, "raw", params.is_greedy)
  """
  b = logits.shape[0]
  own = ~greedy
  if mode == "raw":
    own = own & (params.temperature == 1.0) & ~filter_active(params, logits.shape[-1])
    modified = _modifies_logits(params, logits.shape[-1])
    if modified is not None:
      own = own & ~modified
  ones = jnp.ones((b,), jnp.float32)
  other = jax.lax.cond(jnp.any(~own), lambda: token_log_probs(logits, tokens, ones, *log_softmax_stats(logits)),
                       lambda: jnp.zeros(tokens.shape, jnp.float32))
  return jnp.where(_bcast(own, processed), processed, other)


def chunk_size(v: int) -> int:
  """Tokens per chunk when a pass over the vocabulary is split into chunks.

  Real vocabularies (V >= 8192) get a divisor of V near 1024 (512 to 8192) that
  is a multiple of 4 (so loads can be vectorised). Measured on an H100 (bench/
  RESULTS.md), one pass of (max, sum of exps, argmax) over [1024, 5, 151936]
  took 1.04x the memory floor in chunks of 4748 tokens, 1.21x over whole rows,
  and about 1.5x in chunks of 128 or of 1187 (a prime) tokens; over V=32000,
  chunks of 1000 took 1.23x and whole rows 1.36x. The few dozen chunk totals and
  one chunk's tokens are then cheap to sample from. Otherwise a size near
  sqrt(V), preferring a divisor (no padded copy); tiny test vocabularies get
  chunks of 2 or more, so that they exercise the same paths.

  Example:
    >>> chunk_size(151936), chunk_size(32000), chunk_size(49152)
    (4748, 1000, 1024)
  """
  if v >= 8192:
    divisors = [c for c in range(512, 8193, 4) if v % c == 0]
    if divisors:
      return min(divisors, key=lambda c: abs(np.log(c / 1024)))
  root = int(np.ceil(np.sqrt(v)))
  smallest = 16 if v >= 1024 else 2
  for c in sorted(range(max(1, root // 4), 4 * root + 1), key=lambda c: abs(c - root)):
    if v % c == 0 and c >= smallest:
      return c
  return root


def categorical_from_log_weights(key: jax.Array, log_w: jax.Array) -> jax.Array:
  """Draws one index per row with probability proportional to exp(log_w).

  Exact two-stage Gumbel-max: pick a chunk of the vocabulary (`chunk_size`) by
  its total weight, then a token inside it. It draws a few hundred to a few
  thousand Gumbels per row instead of V, reads log_w once for the chunk masses,
  and needs no normalised distribution.

  Args:
    key: typed keys [B] (one per row).
    log_w: f32[B, V] unnormalised log-weights; -inf = impossible. A row must
      have at least one finite entry.

  Returns:
    int32[B] indices in [0, V).

  Example:
    >>> tok = categorical_from_log_weights(row_keys(jax.random.key(0), 2), jnp.log(jnp.array([[1., 3.], [1., 0.]])))
  """
  return categorical_with_empty(key, log_w)[0]


def categorical_with_empty(key: jax.Array, log_w: jax.Array):
  """`categorical_from_log_weights`, plus bool[B]: rows with no finite weight.

  An empty row's index is meaningless; the flag comes from the chunk masses
  the draw computes anyway, so checking costs no extra pass over log_w.

  Args:
    key: typed keys [B] (one per row).
    log_w: f32[B, V] unnormalised log-weights; -inf = impossible.

  Returns:
    (int32[B] indices in [0, V), bool[B] empty-row flags).

  Example:
    >>> tok, empty = categorical_with_empty(row_keys(jax.random.key(0), 1), jnp.full((1, 4), -jnp.inf))
    >>> empty   # [True]: redraw that row from another distribution
  """
  b, v = log_w.shape
  c = chunk_size(v)
  n = -(-v // c)
  if n * c != v:
    log_w = jnp.pad(log_w, ((0, 0), (0, n * c - v)), constant_values=-jnp.inf)
  chunks = log_w.reshape(b, n, c)
  m, s = max_and_sumexp(chunks)
  chunk_logw = jnp.where(s > 0, m + jnp.log(s), -jnp.inf)  # [B, n]
  tok = draw_from_chunks(key, chunk_logw, lambda ch: jnp.take_along_axis(chunks, ch[:, None, None], axis=1)[:, 0])
  return tok, jnp.all(chunk_logw == -jnp.inf, axis=-1)


def draw_from_chunks(key: jax.Array, chunk_log_mass: jax.Array, chunk_log_weights) -> jax.Array:
  """Two-stage Gumbel-max: a chunk by its mass, then a token inside that chunk.

  Exact when `chunk_log_mass` holds each chunk's total weight; only the chosen
  chunk's weights are ever built, so a caller that knows the chunk masses
  already (from an earlier pass) reads just c tokens per row.

  Args:
    key: typed keys [B] (one per row).
    chunk_log_mass: f32[B, n] log of each chunk's total weight.
    chunk_log_weights: function from the chosen chunks int32[B] to their
      unnormalised log-weights f32[B, c] (chunk j covers tokens j*c .. j*c+c-1).

  Returns:
    int32[B] token indices, chunk * c + position inside it.

  Example:
    >>> w = jnp.log(jnp.array([[1., 3., 0., 4.]]))            # V=4 in 2 chunks of 2
    >>> draw_from_chunks(row_keys(jax.random.key(0), 1), jnp.log(jnp.array([[4., 4.]])),
    ...                  lambda ch: w.reshape(1, 2, 2)[0, ch])  # 0, 1, 3 w.p. 1/8, 3/8, 1/2
  """
  n = chunk_log_mass.shape[-1]
  k_chunk, k_tok = jax.vmap(lambda k: tuple(jax.random.split(k)), out_axes=(0, 0))(key)
  g_chunk = jax.vmap(lambda k: jax.random.gumbel(k, (n,), jnp.float32))(k_chunk)
  chunk = jnp.argmax(chunk_log_mass + g_chunk, axis=-1)
  inside = chunk_log_weights(chunk)
  g_tok = jax.vmap(lambda k: jax.random.gumbel(k, (inside.shape[-1],), jnp.float32))(k_tok)
  return (chunk * inside.shape[-1] + jnp.argmax(inside + g_tok, axis=-1)).astype(jnp.int32)


def sample_tokens(logits: jax.Array, params: SamplingParams, key, *, all_greedy: bool = False,
                  penalty_state: PenaltyState | None = None, logprobs: str | None = None):
  """Plain sampling of one token per row, plus the distribution it came from.

  When params carry a logit bias or penalties, each row's logits first go
  through `apply_penalties` (steps 1-3, context = `penalty_state`). Greedy rows
  then take the argmax (first index on ties); random rows draw from the
  processed (temperature, top-k, top-p, min-p) distribution.

  Under jit, NaN logits count as -inf on every path, and a row with no logit
  above -inf emits token 0 (greedy or random) with an all -inf log_probs row.
  Called eagerly with concrete logits, either raises a ValueError instead.

  Args:
    logits: [B, V], any float dtype.
    params: SamplingParams of batch B.
    key: one PRNG key or a batch of B keys (see `row_keys`).
    all_greedy: static promise that every row is greedy: argmax only, no
      softmax and no random numbers for the token (log_probs is one-hot).
    penalty_state: PenaltyState of batch B and vocabulary V (the rows' prompts
      and generated tokens). Needed when params carry penalties, unless they
      are concrete and all neutral (r = 1, f = p = 0).
    logprobs: static; None (default), "raw" or "processed": also return the
      log-probability of each sampled token, "raw" under log_softmax of the
      unmodified logits, "processed" under the distribution it was drawn from
      (for greedy rows: log_softmax of the logits after steps 1-3).

  Returns:
    (tokens int32[B], log_probs f32[B, V]): log_probs is the log of the
    distribution each row's token was drawn from (log one-hot for greedy rows).
    With `logprobs`, a third value f32[B]: the tokens' log-probabilities.

  Raises:
    ValueError: for a bad shape, params or logprobs mode, penalties without a
      penalty_state, concrete logit-bias ids >= V, and for concrete logits
      holding a NaN or a row with no logit above -inf.

  Example:
    >>> tok, logp = sample_tokens(logits, SamplingParams.create([0.0, 1.0]), jax.random.key(0))
    >>> params = SamplingParams.create(0.8, min_p=0.05, repetition_penalty=1.1)
    >>> tok, logp, lp = sample_tokens(logits, params, key, penalty_state=state, logprobs="processed")
  """
  where = "sample_tokens"
  if logits.ndim != 2:
    raise ValueError(f"{where}: logits must be [B, V], got shape {logits.shape}")
  b, v = logits.shape
  check_params(params, b, where)
  if logprobs not in (None, "raw", "processed"):
    raise ValueError(f"{where}: logprobs must be None, 'raw' or 'processed', got {logprobs!r}")
  check_logits_values(logits, None, f"{where}: logits")
  steps = penalty_params(params, penalty_state, b, v, where)
  # Without bias and penalty fields, x is the caller's array: the program is the plain one.
  x = apply_penalties(logits, steps, penalty_state) if steps.has_logit_bias or steps.has_penalties else logits
  greedy_tok, best = greedy_argmax(x)
  # float32 constants: weakly typed Python floats would make it float64 under jax_enable_x64.
  one_hot = jnp.where(jax.nn.one_hot(greedy_tok, v, dtype=jnp.bool_) & (best > -jnp.inf)[:, None], np.float32(0),
                      np.float32(-np.inf))
  if all_greedy:
    if logprobs is None:
      return greedy_tok, one_hot
    every = jnp.ones((b,), jnp.bool_)
    lp = requested_log_probs(logits if logprobs == "raw" else x, greedy_tok, params, jnp.zeros((b,), jnp.float32),
                             logprobs, every)
    return greedy_tok, one_hot, lp
  keys = row_keys(key, b)
  logp = process_logits(x, params)
  # A row of all -inf draws index 0 (every Gumbel-perturbed weight is -inf), as greedy does.
  tok = categorical_from_log_weights(keys, logp)
  greedy = params.is_greedy
  tokens, dist = jnp.where(greedy, greedy_tok, tok), jnp.where(greedy[:, None], one_hot, logp)
  if logprobs is None:
    return tokens, dist
  processed = jnp.take_along_axis(logp, tokens[:, None], axis=1)[:, 0]
  lp = requested_log_probs(logits if logprobs == "raw" else x, tokens, params, processed, logprobs, greedy)
  return tokens, dist, lp


def penalty_params(params: SamplingParams, penalty_state: PenaltyState | None, batch_size: int, vocab_size: int,
                   where: str) -> SamplingParams:
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
  if not isinstance(penalty_state, PenaltyState):
    raise ValueError(f"{where}: penalty_state must be a PenaltyState, got {type(penalty_state).__name__}")
  for name in ("prompt_mask", "output_counts"):
    shape = jnp.shape(getattr(penalty_state, name))
    if shape != (batch_size, vocab_size):
      raise ValueError(f"{where}: penalty_state.{name} must have shape [B, V]=({batch_size}, {vocab_size}), got "
                       f"{shape}")
  return params


def _check_neutral_penalties(params: SamplingParams, where: str) -> None:
  """Raises unless every penalty field of params is concrete and neutral (then no state is needed)."""
  for name, neutral in (("repetition_penalty", 1.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0)):
    value = getattr(params, name)
    if value is None:
      continue
    if not _is_concrete(value):
      raise ValueError(f"{where}: params.{name} is set (traced), so penalty_state (a PenaltyState) is needed")
    if bool(np.any(np.asarray(value) != neutral)):
      raise ValueError(f"{where}: params.{name} = {np.asarray(value)} needs penalty_state (a PenaltyState of the "
                       "rows' prompts and generated tokens)")


def check_logits_values(logits: jax.Array, used: jax.Array | None, where: str) -> None:
  """Eager check (skipped for tracers): no NaN logit, and some logit above -inf at every used position.

  Runs as a device reduction; only a flag comes back to the host.

  Args:
    logits: [..., V] float logits.
    used: bool[...] positions that matter, or None for all.
    where: the argument's name for the message.
  """
  if not _is_concrete(logits):
    return
  x = jnp.asarray(logits)
  has_nan = jnp.any(jnp.isnan(x), axis=-1)
  empty = ~jnp.any(x > -jnp.inf, axis=-1)
  if used is not None:
    has_nan, empty = has_nan & used, empty & used
  if bool(jnp.any(has_nan)):
    raise ValueError(f"{where} holds NaN at positions {np.argwhere(np.asarray(has_nan))[:8].tolist()}; under jit "
                     "a NaN logit counts as -inf")
  if bool(jnp.any(empty)):
    raise ValueError(f"{where} has no value above -inf (every token masked) at positions "
                     f"{np.argwhere(np.asarray(empty))[:8].tolist()}; under jit token 0 would be emitted there")


def check_probs_values(probs: jax.Array, used, where: str, positions: str) -> None:
  """Eager check (skipped for tracers): probabilities finite and >= 0 at every used position.

  Args:
    probs: [..., V] draft probabilities.
    used: bool[...] positions that matter.
    where: the argument's name for the message.
    positions: which positions are checked, in words, for the message.
  """
  if not _is_concrete(probs):
    return
  bad = np.asarray(jnp.any(~jnp.isfinite(probs) | (probs < 0), axis=-1) & used)
  if bool(np.any(bad)):
    raise ValueError(f"{where} must be finite and >= 0 {positions}; got NaN, +-inf or negative entries at "
                     f"{np.argwhere(bad)[:8].tolist()}; under jit they would count as 0")


def valid_probs(probs: jax.Array) -> jax.Array:
  """Draft probabilities as float32, with NaN, +-inf and negative entries counted as 0 (the rule under jit).

  Example:
    >>> valid_probs(jnp.array([0.5, jnp.nan, -1.0]))   # [0.5, 0., 0.]
  """
  q = probs.astype(jnp.float32)
  return jnp.where(jnp.isfinite(q) & (q > 0), q, 0.0)
