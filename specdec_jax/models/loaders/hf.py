"""Read a Hugging Face checkpoint directory of the Llama family into a `Transformer`.

The directory is what `save_pretrained` writes and the Hub serves:
`config.json` (`model_type` "llama" or "qwen2"), the weights as
`model.safetensors` or shards listed in `model.safetensors.index.json`, and
`tokenizer.json` (plus `tokenizer_config.json` with the chat template). Linear
weights are stored `[out, in]` and transposed to the model's `x @ W`; Q and K
keep Hugging Face's row order, which is the model's ("rotate_half" RoPE).
"""

from __future__ import annotations

import os
from typing import Any

import jax.numpy as jnp
import numpy as np

from specdec_jax.models.config import TransformerConfig, check_kernels
from specdec_jax.models.loaders.common import (
  check_weight_shapes,
  damaged_file_error,
  import_optional,
  model_dtype,
  read_json,
  require_model_extras,
)
from specdec_jax.models.transformer import Transformer

HF_MODEL_TYPES = ("llama", "qwen2")
_REMEDY = "Download the checkpoint again (e.g. huggingface-cli download <repo> --local-dir <dir>)."

# (our stacked name, Hugging Face's per-layer name)
_LAYER_NAMES = (
  ("attn_norm", "input_layernorm.weight"),
  ("wq", "self_attn.q_proj.weight"),
  ("wk", "self_attn.k_proj.weight"),
  ("wv", "self_attn.v_proj.weight"),
  ("wo", "self_attn.o_proj.weight"),
  ("mlp_norm", "post_attention_layernorm.weight"),
  ("w_gate", "mlp.gate_proj.weight"),
  ("w_up", "mlp.up_proj.weight"),
  ("w_down", "mlp.down_proj.weight"),
)
_BIAS_NAMES = (("bq", "self_attn.q_proj.bias"), ("bk", "self_attn.k_proj.bias"), ("bv", "self_attn.v_proj.bias"))


def hf_config(directory: str) -> TransformerConfig:
  """Reads `config.json` of a Llama or Qwen2 checkpoint into a `TransformerConfig`.

  Args:
    directory: the checkpoint directory.

  Returns:
    The config (float32 dtype): biases on q/k/v for Qwen2 (and Llama with
    `attention_bias`), `tie_embeddings` from `tie_word_embeddings`, `max_length`
    from `max_position_embeddings`.

  Raises:
    ValueError: another `model_type`, a feature the `Transformer` lacks (RoPE
      scaling, sliding windows, MLP biases, another activation) or a missing
      field; one line naming the file.

  Example:
    >>> hf_config("Qwen2.5-Coder-1.5B-Instruct").num_kv_heads  # doctest: +SKIP
    2
  """
  path = os.path.join(directory, "config.json")
  c = read_json(path, "Hugging Face config (JSON)", _REMEDY)
  model_type = c.get("model_type")
  if model_type not in HF_MODEL_TYPES:
    raise ValueError(
      f"{path}: model_type is {model_type!r}; the loader reads {', '.join(map(repr, HF_MODEL_TYPES))} checkpoints"
    )
  unsupported = [
    (c.get("rope_scaling") not in (None, {}), f"rope_scaling {c.get('rope_scaling')!r}"),
    (bool(c.get("use_sliding_window", False)), "use_sliding_window"),
    (bool(c.get("mlp_bias", False)), "mlp_bias"),
    (c.get("hidden_act", "silu") != "silu", f"hidden_act {c.get('hidden_act')!r}"),
  ]
  for bad, what in unsupported:
    if bad:
      raise ValueError(f"{path}: {what} is not supported by the Transformer")
  try:
    num_heads = int(c["num_attention_heads"])
    d_model = int(c["hidden_size"])
    return TransformerConfig(
      vocab_size=int(c["vocab_size"]),
      num_layers=int(c["num_hidden_layers"]),
      d_model=d_model,
      num_heads=num_heads,
      num_kv_heads=int(c.get("num_key_value_heads") or num_heads),
      head_dim=int(c.get("head_dim") or d_model // num_heads),
      d_ff=int(c["intermediate_size"]),
      rope_theta=float(c.get("rope_theta", 10000.0)),
      rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(c.get("tie_word_embeddings", model_type == "llama")),
      qkv_bias=model_type == "qwen2" or bool(c.get("attention_bias", False)),
      max_length=c.get("max_position_embeddings"),
    )
  except KeyError as e:
    raise ValueError(f"{path}: field {e.args[0]!r} is missing") from None


def _safetensors_files(directory: str) -> list[str]:
  index = os.path.join(directory, "model.safetensors.index.json")
  if os.path.isfile(index):
    weight_map = read_json(index, "safetensors index (JSON)", _REMEDY).get("weight_map", {})
    return [os.path.join(directory, f) for f in sorted(set(weight_map.values()))]
  single = os.path.join(directory, "model.safetensors")
  if os.path.isfile(single):
    return [single]
  raise FileNotFoundError(
    f"{directory}: no model.safetensors or model.safetensors.index.json; "
    "load_hf reads safetensors checkpoints (convert .bin ones with save_pretrained(safe_serialization=True))"
  )


def read_hf(directory: str, dtype=np.float32) -> tuple[TransformerConfig, dict[str, np.ndarray]]:
  """Reads a Hugging Face Llama/Qwen2 checkpoint into a config and NumPy weights (`Transformer.from_weights` layout).

  Args:
    directory: the checkpoint directory.
    dtype: NumPy dtype of the result (float32, float16 or bfloat16).

  Returns:
    `(config, weights)` with the names and shapes of `gguf.read_gguf`.

  Raises:
    FileNotFoundError: no config or safetensors files.
    ValueError: an unsupported config, or a tensor missing or of the wrong shape (naming it).

  Example:
    >>> config, weights = read_hf("Qwen2.5-Coder-1.5B-Instruct")  # doctest: +SKIP
  """
  safe_open = import_optional("safetensors", "Reading a Hugging Face checkpoint").safe_open
  config = hf_config(directory)
  tensors: dict[str, tuple[str, Any]] = {}
  files = _safetensors_files(directory)
  np_dtype = np.dtype(dtype)
  handles = []
  try:
    for f in files:
      try:
        handle = safe_open(f, framework="numpy")
      except Exception as e:  # SafetensorError: truncated or not safetensors
        raise damaged_file_error(f, "safetensors file", e, _REMEDY) from e
      handles.append(handle)
      for name in handle.keys():
        tensors[name] = handle

    def load(name: str, transpose: bool = False) -> np.ndarray:
      if name not in tensors:
        raise ValueError(f"{directory}: tensor {name!r} is missing from {', '.join(map(os.path.basename, files))}")
      w = tensors[name].get_tensor(name)
      return np.ascontiguousarray((w.T if transpose else w).astype(np_dtype))

    weights = {"embed": load("model.embed_tokens.weight"), "final_norm": load("model.norm.weight")}
    if not config.tie_embeddings:
      weights["lm_head"] = load("lm_head.weight", transpose=True)
    for ours, theirs in _LAYER_NAMES + (_BIAS_NAMES if config.qkv_bias else ()):
      weights[f"layers.{ours}"] = np.stack(
        [load(f"model.layers.{i}.{theirs}", transpose=theirs.endswith("proj.weight")) for i in range(config.num_layers)]
      )
  finally:
    handles.clear()
  check_weight_shapes(config, weights, f"{directory} (shapes from config.json)")
  return config, weights


def hf_chat_template(directory: str) -> str | None:
  """The Jinja chat template of a checkpoint (`tokenizer_config.json`'s `chat_template`), or None."""
  path = os.path.join(directory, "tokenizer_config.json")
  if not os.path.isfile(path):
    return None
  template = read_json(path, "tokenizer config (JSON)", _REMEDY).get("chat_template")
  return template if isinstance(template, str) else None


def load_hf(directory: str, dtype: Any = jnp.float32, kernels: str = "xla"):
  """Loads a Hugging Face checkpoint directory (Llama or Qwen2) as a `Transformer` and its tokenizer.

  Args:
    directory: holds `config.json`, `model.safetensors` (or shards and their
      index) and `tokenizer.json`.
    dtype: parameter, activation and KV-cache dtype: float32, bfloat16 or float16.
    kernels: `TransformerConfig.kernels`: "xla" (default) or "pallas".

  Returns:
    `(model, tokenizer)`: a `Transformer` and the checkpoint's `tokenizers.Tokenizer`.

  Raises:
    ValueError: `dtype` or `kernels` is not one of the above; an unsupported
      config; a tensor missing or of the wrong shape (one line naming the file).
    FileNotFoundError: the directory or one of its files is missing.
    ImportError: `safetensors` or `tokenizers` is missing (message: `pip install 'specdec-jax[models]'`).

  Example:
    >>> model, tokenizer = load_hf("Qwen2.5-Coder-1.5B-Instruct", jnp.bfloat16)  # doctest: +SKIP
    >>> tokenizer.encode("Hello world").ids  # doctest: +SKIP
    [9707, 1879]
  """
  dtype = model_dtype(dtype)
  check_kernels(kernels, "kernels")
  require_model_extras("safetensors", "tokenizers", purpose="Loading a Hugging Face checkpoint")
  directory = os.fspath(directory)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"checkpoint directory not found: {directory!r}")
  tokenizer_path = os.path.join(directory, "tokenizer.json")
  if not os.path.isfile(tokenizer_path):
    raise FileNotFoundError(f"{directory}: no tokenizer.json (the fast tokenizer file that load_hf reads)")
  config, weights = read_hf(directory, dtype)
  model = Transformer.from_weights(config.replace(dtype=dtype, kernels=kernels), weights)
  tokenizers = import_optional("tokenizers", "Loading a Hugging Face checkpoint")
  try:
    tokenizer = tokenizers.Tokenizer.from_file(tokenizer_path)
  except Exception as e:  # a tokenizers.Exception: damaged or another format
    raise damaged_file_error(tokenizer_path, "tokenizer.json", e, _REMEDY) from e
  return model, tokenizer
