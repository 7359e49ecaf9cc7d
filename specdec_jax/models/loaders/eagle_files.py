"""EAGLE head files: a head's own weights (safetensors) and its config (JSON beside it), for any target.

A head file holds only the drafter's own weights (`EagleDrafter.to_weights()`):
the token embedding and output head are the target's and come from the target
at load time. The JSON names the target and the head's shape (`num_layers`,
`feature_layers`, `draft_vocab_size`, and `d_ff` when its MLP is narrower than
the target's) plus whatever the trainer recorded (command, data, figures).

Storage: float16 (the default), float32, or int8. An int8 file stores each
matrix `w` [..., in, out] as `round(w / s)` with one float16 scale per output
column (`s = max |w| / 127` over the input axis, key "NAME.scale"); vectors
(norms, biases) stay float16. It halves a float16 file; what it costs in
agreement is measured by the trainer (examples/train_eagle.py reports both).

A block drafter's file (`save_block_drafter`, `read_block_drafter`) is its backbone's head file with format
`BLOCK_FORMAT`, its placeholder hiddens as "block.mask_hidden" (float32 [block_size - 1, D], one per offset in
the block, or [1, D] for a drafter with one shared hidden) and `block_size` in the JSON. Files of the first
format (`specdec_jax.block_drafter.v1`, one hidden [D] shared by every offset) read as a shared one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from specdec_jax.models.block import BlockDrafter
from specdec_jax.models.config import TransformerConfig
from specdec_jax.models.eagle import EagleConfig, EagleDrafter
from specdec_jax.models.loaders.common import (
  damaged_file_error,
  import_optional,
  json_beside,
  read_json,
  read_safetensors,
)

EAGLE_FORMAT = "specdec_jax.eagle.v1"
BLOCK_FORMAT = "specdec_jax.block_drafter.v2"  # an EAGLE head's file, plus "block.mask_hidden" and "block_size"
_BLOCK_FORMATS_READ = ("specdec_jax.block_drafter.v1", BLOCK_FORMAT)  # v1: one placeholder hidden [D]
_MASK_HIDDEN = "block.mask_hidden"
STORAGE_DTYPES = ("float16", "float32", "int8")
_SCALE = ".scale"


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Symmetric int8 with one float16 scale per output column: `w ~= q * scale`.

  Args:
    w: float [..., in, out] (a stack of matrices keeps its leading axes).

  Returns:
    `(q int8 [..., in, out], scale float16 [..., 1, out])`; an all-zero column gets scale 1.

  Example:
    >>> q, s = quantize_int8(np.array([[1.0, -2.0], [0.5, 4.0]], np.float32))
    >>> q.tolist(), s.astype(np.float32).ravel().tolist()
    ([[127, -64], [64, 127]], [0.00787353515625, 0.031494140625])
  """
  w = np.asarray(w, np.float32)
  peak = np.max(np.abs(w), axis=-2, keepdims=True)
  scale = np.where(peak > 0, peak / 127.0, 1.0).astype(np.float16)
  q = np.clip(np.rint(w / scale.astype(np.float32)), -127, 127).astype(np.int8)
  return q, scale


def save_eagle_head(
  drafter: EagleDrafter,
  path: str,
  *,
  target: str,
  metadata: Mapping[str, Any] | None = None,
  storage_dtype: str = "float16",
) -> None:
  """Writes `drafter`'s own weights to `path` (safetensors) and its config to the `.json` beside it.

  Args:
    drafter: an `EagleDrafter` (e.g. from `EagleDrafter.for_target`).
    path: destination `.safetensors`.
    target: the target's file name, recorded so a loader can refuse a head made for another model.
    metadata: extra JSON-serialisable facts (training command, data, figures).
    storage_dtype: "float16" (default), "float32" or "int8" (per-column scales, see the module).

  Raises:
    ValueError: `storage_dtype` is not one of those, or a weight overflows float16.

  Example:
    >>> save_eagle_head(drafter, "/tmp/head.safetensors", target="model.gguf", storage_dtype="int8")  # doctest: +SKIP
  """
  _save(drafter, path, target=target, metadata=metadata, storage_dtype=storage_dtype, fmt=EAGLE_FORMAT)


def save_block_drafter(
  drafter: BlockDrafter,
  path: str,
  *,
  target: str,
  metadata: Mapping[str, Any] | None = None,
  storage_dtype: str = "float16",
) -> None:
  """Writes a `BlockDrafter` as `save_eagle_head` writes its backbone, plus its placeholder hiddens (float32
  [block_size - 1, D]) and `block_size` (format `BLOCK_FORMAT`).

  Args:
    drafter: a `BlockDrafter`.
    path, target, metadata, storage_dtype: as for `save_eagle_head`.

  Example:
    >>> save_block_drafter(drafter, "/tmp/block.safetensors", target="model.gguf")  # doctest: +SKIP
  """
  extra = {_MASK_HIDDEN: np.asarray(drafter.mask_hidden[...], np.float32)}
  meta = {"block_size": drafter.block_size, **(dict(metadata) if metadata else {})}
  _save(
    drafter.backbone, path, target=target, metadata=meta, storage_dtype=storage_dtype, fmt=BLOCK_FORMAT, extra=extra
  )


def _save(drafter: EagleDrafter, path, *, target, metadata, storage_dtype, fmt, extra=None) -> None:
  if storage_dtype not in STORAGE_DTYPES:
    raise ValueError(f"storage_dtype must be one of {STORAGE_DTYPES}, got {storage_dtype!r}")
  save_file = import_optional("safetensors.numpy", "Saving an EAGLE head").save_file
  weights = dict(extra or {})
  for name, w in drafter.to_weights().items():
    weights.update(_encoded(name, np.asarray(w), storage_dtype))
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, path)
  c = drafter.config
  meta = {
    "format": fmt,
    "target": target,
    "num_layers": c.layers.num_layers,
    "feature_layers": list(c.feature_layers),
    "draft_vocab_size": c.draft_vocab_size,
    "d_ff": c.layers.d_ff,
    "storage_dtype": storage_dtype,
    **(dict(metadata) if metadata else {}),
  }
  with open(json_beside(path), "w") as f:
    json.dump(meta, f, indent=2)
    f.write("\n")


def _encoded(name: str, w: np.ndarray, storage_dtype: str) -> dict[str, np.ndarray]:
  """The file's entries for weight `name`: int32 ids, int8 with "NAME.scale" (matrices, under int8), else float."""
  if name == "draft_vocab":
    return {name: w.astype(np.int32)}
  w = w.astype(np.float32)
  if storage_dtype == "int8" and w.ndim >= 2:
    q, scale = quantize_int8(w)
    return {name: q, name + _SCALE: scale}
  stored = w.astype(np.float32 if storage_dtype == "float32" else np.float16)
  if not np.all(np.isfinite(stored)):
    raise ValueError(f"weights[{name!r}] does not fit in {stored.dtype} (max |w| = {np.abs(w).max()})")
  return {name: stored}


def stored_values(w: np.ndarray, storage_dtype: str) -> np.ndarray:
  """float32 `w` as a head file of `storage_dtype` gives it back (float16 rounding, or int8 with its scales).

  Example:
    >>> float(stored_values(np.array([[1.0, -2.0], [0.5, 4.0]]), "int8")[1, 0])  # 64 steps of the column's 1/127
    0.50390625
  """
  return np.asarray(_dequantized(_encoded("w", np.asarray(w), storage_dtype))["w"], np.float32)


def _dequantized(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  # int8 matrices come with "NAME.scale"; everything else is read as it is.
  out = {}
  for name, w in weights.items():
    if name.endswith(_SCALE):
      continue
    scale = weights.get(name + _SCALE)
    out[name] = w if scale is None else w.astype(np.float32) * scale.astype(np.float32)
  return out


def read_eagle_head(
  path: str,
  target: Callable[[], tuple[TransformerConfig, np.ndarray, np.ndarray]],
  *,
  name: str,
  remedy: str,
) -> EagleDrafter:
  """Builds an `EagleDrafter` from a head file for a target.

  Args:
    path: the head's `.safetensors` (its `.json` beside it).
    target: returns `(config, embed, head_rows)`: the target's config with the
      head's dtype and kernels (its widths, heads, RoPE and biases are the head's
      blocks'; `d_ff` comes from the JSON), its embedding and output-head rows
      [V, D]. Called once the files are found (the target may be slow to read).
    name: what the head is, for messages ("SmolLM2 EAGLE head").
    remedy: how to get a good file, appended to every error.

  Raises:
    FileNotFoundError: the weights or the JSON are missing.
    ValueError: the files are not an EAGLE head of this shape (one line naming the file).

  Example:
    >>> head = read_eagle_head(p, lambda: (cfg, e, e), name="my head", remedy="")  # doctest: +SKIP
  """
  head, _, _ = _read(path, target, name=name, remedy=remedy, fmt=EAGLE_FORMAT)
  return head


def read_block_drafter(
  path: str,
  target: Callable[[], tuple[TransformerConfig, np.ndarray, np.ndarray]],
  *,
  name: str,
  remedy: str,
) -> BlockDrafter:
  """Builds a `BlockDrafter` from a file `save_block_drafter` wrote (arguments and errors as `read_eagle_head`).

  Example:
    >>> drafter = read_block_drafter(p, lambda: (cfg, e, e), name="my block drafter", remedy="")  # doctest: +SKIP
  """

  def check(meta):  # before the target is read
    size = meta.get("block_size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
      raise damaged_file_error(json_beside(path), f"{name} config (JSON)", ValueError(f"block_size {size!r}"), remedy)

  backbone, meta, weights = _read(path, target, name=name, remedy=remedy, fmt=_BLOCK_FORMATS_READ, check=check)
  mask_hidden = weights.get(_MASK_HIDDEN)
  if mask_hidden is not None and meta["format"] != BLOCK_FORMAT and mask_hidden.ndim == 1:
    mask_hidden = mask_hidden[None, :]  # v1: the one hidden of every offset
  shared = mask_hidden is not None and mask_hidden.shape[0] == 1
  drafter = BlockDrafter(backbone, block_size=meta["block_size"], rngs=nnx.Rngs(0), shared_placeholder=shared)
  want = drafter.mask_hidden.shape
  if mask_hidden is None or mask_hidden.shape != want:
    got = None if mask_hidden is None else list(mask_hidden.shape)
    raise damaged_file_error(
      path, f"{name} weights", ValueError(f"{_MASK_HIDDEN} {got}, expected {list(want)}"), remedy
    )
  drafter.mask_hidden[...] = jnp.asarray(mask_hidden, backbone.config.layers.dtype)
  return drafter


def _read(path, target, *, name, remedy, fmt, check=None) -> tuple[EagleDrafter, dict, dict]:
  """(the head, its JSON, its dequantized weights): the files (and `check(meta)`, if given) checked before
  `target()` reads the target. fmt: the format, or a tuple of the formats accepted."""
  json_path = json_beside(path)
  for required in (path, json_path):
    if not os.path.isfile(required):
      raise FileNotFoundError(f"{name} not found: no such file: {required}. {remedy}")
  what = f"{name} config (JSON)"
  meta = read_json(json_path, what, remedy)
  formats = fmt if isinstance(fmt, tuple) else (fmt,)
  if meta.get("format") not in formats:
    raise ValueError(
      f"{json_path}: format {meta.get('format')!r}, expected {' or '.join(map(repr, formats))}. {remedy}"
    )
  if check is not None:
    check(meta)
  target_config, embed, head_rows = target()
  try:
    config = EagleConfig(
      layers=target_config.replace(
        num_layers=meta["num_layers"], feature_layers=(), d_ff=int(meta.get("d_ff", target_config.d_ff))
      ),
      feature_layers=tuple(meta["feature_layers"]),
      draft_vocab_size=meta["draft_vocab_size"],
    )
  except (KeyError, TypeError, ValueError) as e:
    raise damaged_file_error(json_path, what, e, remedy) from e
  weights = _dequantized(read_safetensors(path, f"{name} weights (safetensors)", remedy))
  own = {k: v for k, v in weights.items() if not k.startswith("block.")}
  try:
    return EagleDrafter.from_weights(config, own, embed=embed, head_rows=head_rows), meta, weights
  except ValueError as e:
    raise damaged_file_error(path, f"{name} weights matching {json_path}", e, remedy) from e
