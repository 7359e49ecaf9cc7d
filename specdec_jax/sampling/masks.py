"""Masks of allowed tokens (structured output): packed bitmasks, read inside the samplers' passes.

A bitmask holds one bit per token, packed in int32 words: bit `v % 32` of word
`v // 32` is set when token v is allowed (the convention of xgrammar and
vLLM), so a position's mask is `ceil(V / 32)` words. Bits of ids >= V in the
last word are ignored.

The samplers apply a mask like a -inf logit bias, after steps 1-3 (bias and
penalties) and before temperature and the filters: the target's law at a
position becomes its law over the allowed tokens, renormalised; greedy takes
the argmax over allowed tokens. The mask is a `LogitsView` transform: each
pass over the logits reads the words it needs and masks as it reads, so no
masked copy of the logits is written.

Example:
  >>> words = pack_bitmask(jnp.array([[True, False, True]]))   # int32 [1, 1]: bits 0 and 2
  >>> allowed_tokens(words, 3)                                  # [[True, False, True]]
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.sampling.params import _is_concrete
from specdec_jax.sampling.reductions import LogitsView

BITS = 32


def mask_words(vocab_size: int) -> int:
  """ceil(V / 32), the int32 words a position's bitmask holds.

  Example:
    >>> mask_words(151936)
    4748
  """
  return -(-vocab_size // BITS)


def pack_bitmask(allowed) -> jax.Array:
  """bool [..., V] -> int32 [..., ceil(V / 32)]: bit v % 32 of word v // 32 set where allowed[..., v].

  Example:
    >>> pack_bitmask(jnp.arange(40) % 2 == 0).shape
    (2,)
  """
  allowed = jnp.asarray(allowed, jnp.bool_)
  v = allowed.shape[-1]
  w = mask_words(v)
  bits = jnp.pad(allowed, [(0, 0)] * (allowed.ndim - 1) + [(0, w * BITS - v)]).reshape(allowed.shape[:-1] + (w, BITS))
  weights = jnp.left_shift(jnp.uint32(1), jnp.arange(BITS, dtype=jnp.uint32)).reshape((1,) * (bits.ndim - 1) + (BITS,))
  words = jnp.sum(jnp.where(bits, weights, jnp.uint32(0)), axis=-1, dtype=jnp.uint32)
  return jax.lax.bitcast_convert_type(words, jnp.int32)


def allowed_tokens(bitmask, vocab_size: int) -> jax.Array:
  """int32 [..., W] -> bool [..., V]: token v allowed iff bit v % 32 of word v // 32 is set (elementwise in v,
  so it fuses into the reader that asks).

  Example:
    >>> allowed_tokens(jnp.array([5], jnp.int32), 4)   # bits 0 and 2: [True, False, True, False]
  """
  bitmask = jnp.asarray(bitmask)
  w = bitmask.shape[-1]
  words = jax.lax.bitcast_convert_type(bitmask.astype(jnp.int32), jnp.uint32)
  repeated = jnp.broadcast_to(words[..., None], words.shape + (BITS,)).reshape(words.shape[:-1] + (w * BITS,))
  shift = (jnp.arange(w * BITS, dtype=jnp.uint32) % BITS).reshape((1,) * (words.ndim - 1) + (w * BITS,))
  bits = jnp.right_shift(repeated, shift) & jnp.uint32(1)
  return bits[..., :vocab_size] == 1


@dataclasses.dataclass(frozen=True)
class _Masked:
  """The `LogitsView` transform (static, hashable): the inner view's values (or raw's), -inf where the
  bitmask disallows the token. `inner`: the transform of the view the mask goes over, or None."""

  inner: Callable | None

  def __call__(self, raw, inner_args, bitmask):
    x = raw.astype(jnp.float32) if self.inner is None else self.inner(raw, *inner_args)
    allowed = allowed_tokens(bitmask, x.shape[-1])
    allowed = allowed.reshape(allowed.shape[:1] + (1,) * (x.ndim - allowed.ndim) + allowed.shape[1:])
    return jnp.where(allowed, x, -jnp.inf)


def masked_view(logits, bitmask) -> LogitsView:
  """`logits` (an array or a `LogitsView`) with the tokens the bitmask disallows at -inf, as a view.

  Args:
    logits: [B, ..., V] (this device's slice of the vocabulary inside the samplers' shard_map, which then
      starts at a multiple of 32), or a `LogitsView` of it (the bias and penalties: the mask applies after them).
    bitmask: int32 [B, ..., ceil(V / 32)] with logits' leading axes ([B, W] broadcasts over middle axes).

  Example:
    >>> view = masked_view(logits, bitmask)      # then sampling.reductions.values(view) inside a reader
  """
  if isinstance(logits, LogitsView):
    return LogitsView(raw=logits.raw, args=(logits.args, bitmask), fn=_Masked(logits.fn))
  return LogitsView(raw=logits, args=((), bitmask), fn=_Masked(None))


def check_bitmask(bitmask, lead: tuple[int, ...], vocab_size: int, where: str, used=None, logits=None):
  """The bitmask as an int32 array, checked: shape lead + (ceil(V / 32),), an integer dtype; concrete masks
  with a used position that allows no token are refused (under jit such a position emits token 0, as a
  position whose logits are all -inf does).

  Args:
    bitmask: int32 (or uint32) [*lead, W].
    lead: the leading shape it must have ((B,) or (B, K+1)).
    vocab_size: V.
    where: the function's name for messages.
    used: bool [*lead] or None (every position): the positions whose emptiness is an error.
    logits: float [*lead, V] or None: when concrete, a used position must also allow a token whose logit is
      above -inf (else its masked law is empty too).

  Raises:
    ValueError: a wrong shape or dtype, or a concrete used position with no allowed token.

  Example:
    >>> check_bitmask(jnp.full((2, 3), -1, jnp.int32), (2,), 96, "sample_tokens")
  """
  w = mask_words(vocab_size)
  shape = tuple(np.shape(bitmask))
  if shape != tuple(lead) + (w,):
    raise ValueError(
      f"{where}: token_bitmask must be int32 {list(lead) + [w]} (ceil(V / 32) = {w} words a position, "
      f"V = {vocab_size}), got shape {list(shape)}"
    )
  dtype = jnp.dtype(bitmask.dtype if hasattr(bitmask, "dtype") else np.asarray(bitmask).dtype)
  if dtype not in (jnp.dtype(jnp.int32), jnp.dtype(jnp.uint32)):
    raise ValueError(f"{where}: token_bitmask must be int32 (or uint32) words, got dtype {dtype}")
  bitmask = jnp.asarray(bitmask)
  if dtype == jnp.dtype(jnp.uint32):
    bitmask = jax.lax.bitcast_convert_type(bitmask, jnp.int32)
  if not _is_concrete(bitmask, *(() if used is None else (used,))):
    return bitmask
  allowed = allowed_tokens(bitmask, vocab_size)
  checks = [("no token", allowed)]
  if logits is not None and _is_concrete(logits):
    checks.append(("no token with a logit above -inf", allowed & (jnp.asarray(logits) > -jnp.inf)))
  for what, kept in checks:
    empty = ~np.asarray(jnp.any(kept, axis=-1))
    if used is not None:
      empty = empty & np.asarray(used)
    if np.any(empty):
      at = [tuple(int(i) for i in ix) for ix in np.argwhere(empty)[:4]]
      raise ValueError(f"{where}: token_bitmask allows {what} at position(s) {at} (index {list(lead)})")
  return bitmask
