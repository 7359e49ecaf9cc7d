"""What every loader shares: optional packages, dtype checks, damaged files, the cache folder.

Every loader checks its dtype with `model_dtype`, its optional packages with
`require_model_extras`, and reads files through `read_json` / `read_safetensors` /
`damaged_file_remedy`, so that a user's mistake fails at once, in one line that
names the argument or the file and the fix. Slow results (dequantized weights,
joined downloads) go under `cache_dir()`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.models.config import TransformerConfig
from specdec_jax.models.transformer import weight_shapes

MODELS_EXTRA_INSTALL = "pip install 'specdec-jax[models]'"


def import_optional(module: str, purpose: str):
  """Imports an optional dependency of the `[models]` extra, or says how to install it.

  Args:
    module: the module to import, e.g. "gguf" or "safetensors.numpy"; its
      top-level package is also the pip package's name.
    purpose: what needs it, starting with a capital, e.g. "Loading the SmolLM2 draft".

  Returns:
    The imported module.

  Raises:
    ImportError: the package is not installed. One line naming the package and
      `pip install 'specdec-jax[models]'`.

  Example:
    >>> import_optional("numpy", "Reading weights").__name__
    'numpy'
  """
  package = module.partition(".")[0]
  message = f"{purpose} needs the `{package}` package, which is not installed. Install it with: {MODELS_EXTRA_INSTALL}"
  # find_spec first: it answers None (no exception to chain) for a package that
  # is absent or blocked with sys.modules[package] = None.
  if importlib.util.find_spec(package) is None:
    raise ImportError(message, name=package)
  try:
    return importlib.import_module(module)
  except ImportError as e:  # e.g. a broken install, or its own dependency missing
    raise ImportError(f"{message} ({type(e).__name__}: {e})", name=package) from e


class DamagedFileError(ValueError):
  """A file exists but cannot be read as what it should be: truncated, corrupted or of another format."""


def damaged_file_error(path: str, what: str, cause: BaseException | str, remedy: str = "") -> DamagedFileError:
  """A one-line `DamagedFileError` naming the file, what went wrong, and how to get a good copy.

  Raise it `from` the parser's exception: the message alone explains the problem.

  Args:
    path: the damaged file.
    what: what the file should be, e.g. "GGUF file" or "draft config (JSON)".
    cause: the parser's exception (its type and first line are quoted) or a description.
    remedy: how to get a good file, e.g. a reinstall command; appended as is.

  Returns:
    The error, to raise.

  Example:
    >>> print(damaged_file_error("/m.gguf", "GGUF file", ValueError("bad magic"), "Get a new one."))
    /m.gguf is damaged (truncated or corrupted): cannot read it as a GGUF file (ValueError: bad magic). Get a new one.
  """
  if isinstance(cause, BaseException):
    lines = str(cause).strip().splitlines()
    cause = f"{type(cause).__name__}: {lines[0]}" if lines else type(cause).__name__
  if len(cause) > 300:  # e.g. a KeyError quoting a whole dict: keep the message one readable line
    cause = cause[:297] + "..."
  message = f"{path} is damaged (truncated or corrupted): cannot read it as a {what} ({cause.rstrip('.')})."
  return DamagedFileError(f"{message} {remedy}" if remedy else message)


# Parameter dtypes a loaded model may use; float64 too when jax_enable_x64 is on.
MODEL_DTYPES = ("float32", "bfloat16", "float16")


def model_dtype(dtype: Any) -> jnp.dtype:
  """Checks a loader's `dtype` argument; returns it as a `jnp.dtype`.

  Without this check `dtype=None` (float64 to NumPy) or float64 with x64 off
  loads fine, and `generate` fails much later on the KV cache's dtype.

  Raises:
    ValueError: `dtype` is not one of `MODEL_DTYPES` (or float64 with x64 on).
  """
  accepted = MODEL_DTYPES + (("float64",) if jax.config.jax_enable_x64 else ())
  try:
    normalized = None if dtype is None else jnp.dtype(dtype)
  except (TypeError, ValueError):  # e.g. "bf16": not a dtype name
    normalized = None
  if normalized is None or normalized.name not in accepted:
    x64 = "" if "float64" in accepted else " (float64 only with jax.config.update('jax_enable_x64', True))"
    raise ValueError(f"dtype must be one of {', '.join(accepted)}{x64}; got {dtype!r}")
  return normalized


def require_model_extras(*modules: str, purpose: str) -> None:
  # Checked before any slow read, so a missing package fails at once, with the
  # install command (`pip install 'specdec-jax[models]'`).
  for module in modules:
    import_optional(module, purpose)


@contextlib.contextmanager
def damaged_file_remedy(remedy: str) -> Iterator[None]:
  """Appends `remedy` (how to get a good copy) to a `DamagedFileError` raised inside."""
  try:
    yield
  except DamagedFileError as e:
    # Chain to the parser's own error, not to the same message without the remedy.
    raise DamagedFileError(f"{e} {remedy}") from (e.__cause__ or e)


def json_beside(path: str) -> str:
  """The JSON config beside a weights file: `path` with its extension replaced by `.json`.

  Example:
    >>> json_beside("weights/head.safetensors")
    'weights/head.json'
  """
  return os.path.splitext(path)[0] + ".json"


def read_json(path: str, what: str, remedy: str) -> dict[str, Any]:
  """Reads a JSON object from `path`; unparseable text raises a `DamagedFileError` naming it."""
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
    raise damaged_file_error(path, what, e, remedy) from e
  if not isinstance(data, dict):
    raise damaged_file_error(path, what, f"holds a JSON {type(data).__name__}, not an object", remedy)
  return data


def read_safetensors(path: str, what: str, remedy: str) -> dict[str, np.ndarray]:
  """Reads a safetensors file as NumPy arrays; a truncated one raises a `DamagedFileError` naming it."""
  numpy_io = import_optional("safetensors.numpy", f"Reading {what}")
  safetensor_error = import_optional("safetensors", f"Reading {what}").SafetensorError
  try:
    return dict(numpy_io.load_file(path))
  except (safetensor_error, ValueError) as e:
    raise damaged_file_error(path, what, e, remedy) from e


def chatml(messages: Sequence[Mapping[str, str]], default_system: str, add_generation_prompt: bool) -> str:
  """A conversation in ChatML, the chat format of SmolLM2 and Qwen2.5, as their Jinja templates write it.

  Each turn is `<|im_start|>{role}\\n{content}<|im_end|>\\n`; a conversation whose first message is not a
  system message gets `default_system` first; `add_generation_prompt` appends `<|im_start|>assistant\\n`.

  Raises:
    ValueError: a message lacks a string "role" or "content".

  Example:
    >>> chatml([{"role": "user", "content": "Hi"}], "Be brief.", True).splitlines()[1]
    'Be brief.<|im_end|>'
  """
  parts = []
  for i, message in enumerate(messages):
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not isinstance(content, str):
      raise ValueError(f"messages[{i}] must have string 'role' and 'content', got {message!r}")
    if i == 0 and role != "system":
      parts.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
    parts.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
  if add_generation_prompt:
    parts.append("<|im_start|>assistant\n")
  return "".join(parts)


# ---------------------------------------------------------------------------- cache

CACHE_ENV = "SPECDEC_JAX_CACHE"


def cache_dir() -> str:
  """The folder for joined downloads and dequantized weights: `$SPECDEC_JAX_CACHE`, else `~/.cache/specdec_jax`.

  Created when missing.

  Example:
    >>> os.path.isdir(cache_dir())
    True
  """
  path = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "specdec_jax")
  os.makedirs(path, exist_ok=True)
  return path


def file_sha256(path: str, progress: bool = False) -> str:
  """The sha256 of a file (hex), remembered under `cache_dir()/hashes` while its size and mtime stay the same.

  Hashing 1.1 GB takes seconds; the note makes later calls instant. A cache
  folder that cannot be written only loses the note.

  Args:
    path: a file.
    progress: show a tqdm bar while hashing.

  Returns:
    64 lowercase hex digits.

  Example:
    >>> file_sha256(path)  # doctest: +SKIP
    'cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046'
  """
  stat = os.stat(path)
  try:
    with open(_hash_note(path), encoding="utf-8") as f:
      saved = json.load(f)
    if isinstance(saved, dict) and saved.get("size") == stat.st_size and saved.get("mtime_ns") == stat.st_mtime_ns:
      return str(saved["sha256"])
  except (OSError, ValueError, KeyError):
    pass
  digest = hashlib.sha256()
  with open(path, "rb") as f, progress_bar(stat.st_size, f"sha256 {os.path.basename(path)}", progress, unit="B") as bar:
    while chunk := f.read(1 << 24):
      digest.update(chunk)
      bar.update(len(chunk))
  return remember_sha256(path, digest.hexdigest())


def remember_sha256(path: str, sha256: str) -> str:
  """Notes `sha256` as the hash of the file at `path` as it is now (size, mtime), for `file_sha256`; returns it.

  For a file whose hash the caller has just computed (e.g. while writing it), so it is not read again.
  """
  stat = os.stat(path)
  note = _hash_note(path)
  with contextlib.suppress(OSError):  # an unwritable cache folder only loses the note
    os.makedirs(os.path.dirname(note), exist_ok=True)
    with open(note, "w", encoding="utf-8") as f:
      json.dump({"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256}, f)
  return sha256


def _hash_note(path: str) -> str:
  name = hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:24]
  return os.path.join(cache_dir(), "hashes", f"{name}.json")


def progress_bar(total: int, desc: str, enabled: bool, unit: str = "it"):
  """A tqdm bar of the loaders' slow steps, removed when done; `unit="B"` counts bytes (scaled to kB, MB, ...)."""
  import tqdm

  return tqdm.tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", disable=not enabled, leave=False)


def check_weight_shapes(config: TransformerConfig, weights: Mapping[str, np.ndarray], where: str) -> None:
  """Raises a ValueError naming `where` unless `weights` has exactly `weight_shapes(config)`'s names and shapes.

  A loader checks its result here, naming the file whose layout is wrong, rather than later in
  `Transformer.from_weights`.
  """
  expected = weight_shapes(config)
  if expected.keys() != weights.keys():
    raise ValueError(f"{where}: weights have keys {sorted(weights)}, expected {sorted(expected)}")
  for name, shape in expected.items():
    if weights[name].shape != shape:
      raise ValueError(f"{where}: weight {name!r} has shape {weights[name].shape}, expected {shape}")
