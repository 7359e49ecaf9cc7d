"""Per-request sampling parameters, their validation, per-row keys, and the input-value rules.

`SamplingParams` is the pytree every sampler takes (one value per request;
options absent are `None` and compile out). The checks here run eagerly on
concrete values and at trace time on shapes and dtypes; under jit nothing is
checked and the value rules of `specdec_jax.sampling` apply instead.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

# Temperatures below this are greedy. Dividing by a smaller temperature would only
# sharpen the distribution towards the argmax anyway, and this keeps `x / T` finite.
GREEDY_TEMPERATURE = 1e-5


def _is_concrete(*arrays) -> bool:
  """True unless one of `arrays` is a tracer (under jit, values are unknown and their checks are skipped)."""
  return not any(isinstance(a, jax.core.Tracer) for a in arrays)


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
    no_filters: static bool (pytree metadata, not a leaf), default False. True
      promises that no row uses top-k, top-p or min-p: they are ignored, and
      the samplers compile no run-time branch on them (see `sample_tokens`).
      Set by the `no_filters=True` flags of the samplers and loops
      (`promise_no_filters`); every function that samples reads it, so the
      promise reaches a loop's draft sampling and its verifier alike.

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
  no_filters: bool = dataclasses.field(default=False, metadata=dict(static=True))

  def promise_no_filters(self) -> "SamplingParams":
    """These parameters with the static promise that no row filters (`no_filters`).

    Example:
      >>> SamplingParams.create(1.0).promise_no_filters().no_filters
      True
    """
    return dataclasses.replace(self, no_filters=True)

  @classmethod
  def greedy(cls, batch_size: int) -> "SamplingParams":
    """All-greedy parameters for `batch_size` (an int >= 0) requests."""
    n = static_int(batch_size, "SamplingParams.greedy: batch_size", minimum=0)
    return cls.create(np.zeros((n,), np.float32))

  @classmethod
  def create(
    cls,
    temperature,
    top_k=None,
    top_p=None,
    *,
    min_p=None,
    repetition_penalty=None,
    frequency_penalty=None,
    presence_penalty=None,
    logit_bias=None,
  ) -> "SamplingParams":
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
        f"{temperature.shape}, {top_k.shape}, {top_p.shape}"
      ) from e
    # The options join the batch one at a time, so a size error names the option.
    options = {}
    for name, value in (
      ("min_p", min_p),
      ("repetition_penalty", repetition_penalty),
      ("frequency_penalty", frequency_penalty),
      ("presence_penalty", presence_penalty),
    ):
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


def check_promises(
  where: str,
  params: SamplingParams,
  vocab_size: int,
  *,
  all_greedy: bool = False,
  all_random: bool = False,
  no_filters: bool = False,
) -> None:
  """Concrete params that contradict the no-filters promise raise; traced ones are the caller's promise (unchecked).

  all_greedy and all_random are checked only against each other: DESIGN.md
  defines them for any temperature (every row is then treated as greedy, or as
  random), so a temperature does not contradict them.

  Args:
    where: the function's name, for the messages.
    params: SamplingParams of batch B.
    vocab_size: V (a top_k >= V is off).
    all_greedy, all_random: the samplers' static flags.
    no_filters: the promise that no random row uses top-k, top-p or min-p
      (a greedy row's filters are ignored, so they contradict nothing).

  Raises:
    ValueError: naming the flag and the offending field.

  Example:
    >>> check_promises("f", SamplingParams.create(1.0, top_k=5), 100, no_filters=True)   # raises: top_k
  """
  if all_greedy and all_random:
    raise ValueError(f"{where}: all_greedy and all_random cannot both be True")
  if not no_filters or all_greedy or not _is_concrete(params.temperature):
    return
  random_rows = np.asarray(params.temperature) >= GREEDY_TEMPERATURE
  if all_random:
    random_rows = np.ones_like(random_rows)
  fields = (
    ("top_k", params.top_k, lambda a: (a > 0) & (a < vocab_size)),
    ("top_p", params.top_p, lambda a: a < 1.0),
    ("min_p", params.min_p, lambda a: a > 0),
  )
  for name, value, on in fields:
    if value is None or not _is_concrete(value):
      continue
    a = np.asarray(value)
    bad = on(a) & random_rows
    if np.any(bad):
      raise ValueError(
        f"{where}: no_filters=True promises no row uses top-k, top-p or min-p, but {name} is "
        f"{a[bad][:8].tolist()} at rows {np.flatnonzero(bad)[:8].tolist()}"
      )


def static_int(value, name: str, *, minimum: int) -> int:
  """`value` as a Python int >= minimum, or a ValueError naming `name` (a static size, never a traced array).

  Example:
    >>> static_int(np.int64(4), "f: vocab_size", minimum=1)   # 4
  """
  try:
    n = operator.index(value)
  except TypeError:
    raise ValueError(f"{name} must be an int >= {minimum} (static: not an array), got {value!r}") from None
  if n < minimum:
    raise ValueError(f"{name} must be an int >= {minimum}, got {n}")
  return n


def _join_batch(shape: tuple, other: tuple, name: str) -> tuple:
  try:
    return jnp.broadcast_shapes(shape, other)
  except ValueError as e:
    raise ValueError(
      f"SamplingParams.create: {name} must broadcast to the batch size of the other arguments, got "
      f"shape {other} against {shape}"
    ) from e


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
    raise ValueError(
      f"{where} must be a mapping {{token_id: bias}} or a sequence of B such mappings, got {logit_bias!r}"
    )
  m = max((len(r) for r in rows), default=0)
  ids = np.full((len(rows), m), -1, np.int32)
  values = np.zeros((len(rows), m), np.float32)
  for r, mapping in enumerate(rows):
    for j, (tid, bias) in enumerate(mapping.items()):
      try:
        tid_a, bias_a = np.asarray(tid), np.asarray(bias)
      except (TypeError, ValueError, jax.errors.TracerArrayConversionError) as e:
        raise ValueError(
          f"{where} must hold concrete numbers (under jit, build logit_bias_ids and "
          f"logit_bias_values directly), got {tid!r}: {bias!r}"
        ) from e
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
    raise ValueError(
      f"{where}: {name} must be a scalar or a 1-D sequence [B] of {want}, got {value!r} (dtype {arr.dtype})"
    )
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
      raise ValueError(
        f"{where}: params.logit_bias_ids must have shape [B, M] with B={batch_size}, got {jnp.shape(ids)}"
      )
    if jnp.shape(values) != jnp.shape(ids):
      raise ValueError(
        f"{where}: params.logit_bias_values must have the shape of params.logit_bias_ids "
        f"{jnp.shape(ids)}, got {jnp.shape(values)}"
      )
    _check_kind(ids, "params.logit_bias_ids", "integer", jnp.integer, where)
    _check_kind(values, "params.logit_bias_values", "float", jnp.floating, where)


_FLOAT_OPTIONS = ("min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


def _check_kind(value, name: str, kind: str, dtype, where: str) -> None:
  if not jnp.issubdtype(jnp.result_type(value), dtype):
    raise ValueError(
      f"{where}: {name} must be a{'n' if kind == 'integer' else ''} {kind} array, got dtype "
      f"{jnp.result_type(value)} (SamplingParams.create converts)"
    )


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
    raise ValueError(
      f"{where}: logit_bias holds token ids >= the vocabulary size V={vocab_size}: "
      f"{sorted(set(ids[bad].tolist()))[:8]} (under jit they would be ignored)"
    )


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
  typed = _typed_key(key, where)
  if typed.ndim == 0:  # int32 row ids also under jax_enable_x64, so keys do not change with it
    return jax.vmap(lambda b: jax.random.fold_in(typed, b))(jnp.arange(batch_size, dtype=jnp.int32))
  if typed.shape == (batch_size,):
    return typed
  raise ValueError(f"{where}: expected one key or a batch of B={batch_size} keys, got key batch shape {typed.shape}")


def _typed_key(key, where: str) -> jax.Array:
  """`key` as a typed key array (raw uint32 [..., 2] keys wrapped); ValueError naming `where` for anything else."""
  key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key
  if key.dtype == jnp.uint32 and key.ndim >= 1 and key.shape[-1] == 2:
    return jax.random.wrap_key_data(key)
  raise ValueError(
    f"{where} must be a typed PRNG key (jax.random.key) or a raw uint32[2] key, "
    f"or a batch of B of either; got dtype {key.dtype}, shape {key.shape}"
  )


def single_key(key) -> jax.Array | None:
  """The typed key of a call given one key (typed, or raw uint32[2]); None for a batch of keys.

  Called after `row_keys` has checked the key (the same conversion, and the same ValueError otherwise).

  The Pallas samplers fold one key with each row index inside their kernels
  (as `row_keys` does), which saves a kernel at small batch.

  Example:
    >>> single_key(jax.random.key(0)).shape, single_key(jax.random.split(jax.random.key(0), 4))
    ((), None)
  """
  typed = _typed_key(key, "key")
  return typed if typed.ndim == 0 else None


# ----------------------------------------------------------------------------
# Input checks (eager) and the value rule for draft probabilities (under jit)
# ----------------------------------------------------------------------------


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
    raise ValueError(
      f"{where} holds NaN at positions {np.argwhere(np.asarray(has_nan))[:8].tolist()}; under jit "
      "a NaN logit counts as -inf"
    )
  if bool(jnp.any(empty)):
    raise ValueError(
      f"{where} has no value above -inf (every token masked) at positions "
      f"{np.argwhere(np.asarray(empty))[:8].tolist()}; under jit token 0 would be emitted there"
    )


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
    raise ValueError(
      f"{where} must be finite and >= 0 {positions}; got NaN, +-inf or negative entries at "
      f"{np.argwhere(bad)[:8].tolist()}; under jit they would count as 0"
    )


def valid_probs(probs: jax.Array) -> jax.Array:
  """Draft probabilities as float32, with NaN, +-inf and negative entries counted as 0 (the rule under jit).

  Example:
    >>> valid_probs(jnp.array([0.5, jnp.nan, -1.0]))   # [0.5, 0., 0.]
  """
  q = probs.astype(jnp.float32)
  return jnp.where(jnp.isfinite(q) & (q > 0), q, 0.0)
