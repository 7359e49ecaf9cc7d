"""Read GGUF files of the Llama family ("llama", "qwen2"): config, weights, tokenizer, chat template.

GGUF is llama.cpp's single-file format. This module turns one into

* a `TransformerConfig` plus a dict of NumPy weights in the layout
  `Transformer.from_weights` takes (`x @ W` orientation, layers stacked on a
  leading axis; `read_gguf`), cached per file and dtype (`read_gguf_cached`),
* a `tokenizers.Tokenizer` rebuilt from the vocabulary and merges stored in the
  file (`tokenizer_from_gguf`), and its chat template (`gguf_chat_template`);
  `load_gguf` returns the model and the tokenizer.

Two details of llama.cpp's converter matter:

1. Tensor shapes. ggml lists dimensions fastest first (`ne`); NumPy's are the
   reverse, so a linear layer's weight reads as `[out, in]` (PyTorch's
   orientation) and is transposed here to `[in, out]`.
2. Q/K row order. For "llama" files `convert_hf_to_gguf.py` permutes the output
   rows of Q and K (and their biases) so that llama.cpp can rotate *adjacent*
   pairs (2i, 2i+1); our model rotates pairs (i, i + Dh/2) like Hugging Face
   ("rotate_half"). `unpermute_qk_rows` undoes the permutation. Within one head
   the converter maps HF row `c*Dh/2 + j` to file row `2j + c`:

     HF rows of a head:   x0 x1 ... x31 | y0 y1 ... y31     (rotate_half pairs xi, yi)
     file rows:           x0 y0 x1 y1 ... x31 y31           (interleaved pairs)

   "qwen2" files keep Hugging Face's order (llama.cpp rotates them NEOX-style).

`gguf` (parsing, dequantizing) and `tokenizers` are imported on first use, so
importing this module does not need them; a missing one raises an ImportError
that names the install command (`common.import_optional`). A truncated or
corrupted file raises a `DamagedFileError` (a ValueError) that names the file.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import json
import os
import shutil
import warnings
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from specdec_jax.models.config import TransformerConfig, check_kernels
from specdec_jax.models.loaders.common import (
  cache_dir,
  check_weight_shapes,
  damaged_file_error,
  file_sha256,
  import_optional,
  model_dtype,
  progress_bar,
  require_model_extras,
)
from specdec_jax.models.transformer import Transformer


def _import_gguf():
  return import_optional("gguf", "Reading GGUF files")


def _import_tokenizers():
  return import_optional("tokenizers", "Building a tokenizer from GGUF")


def open_gguf(path: str):
  """A `gguf.GGUFReader` of `path`, cached per path, size and modification time.

  Parsing the metadata (152k token strings and merges for Qwen2.5) takes
  seconds; the tensor data stays a read-only memmap, so keeping readers is
  cheap. A file replaced at the same path gets a new reader.

  Raises:
    FileNotFoundError: no file at `path`.
    DamagedFileError: the file is truncated or not a GGUF file (a ValueError naming `path`).
  """
  if not os.path.isfile(path):
    raise FileNotFoundError(f"GGUF file not found: {path!r}")
  stat = os.stat(path)
  return _open_gguf(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open_gguf(path: str, size: int, mtime_ns: int):
  gguf = _import_gguf()
  try:
    return gguf.GGUFReader(path)
  except (ValueError, IndexError, KeyError, TypeError, OverflowError, EOFError) as e:
    # The reader maps the whole file and slices it by the sizes in the header, so
    # a truncated copy fails here with a bare reshape/view/IndexError.
    raise damaged_file_error(path, "GGUF file", e) from e


def _field(reader, key: str, default=None):
  field = reader.fields.get(key)
  return default if field is None else field.contents()


def unpermute_qk_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
  """Undoes llama.cpp's Q/K row permutation (file order -> HF "rotate_half" order).

  Args:
    weight: `[num_heads * Dh, in]` Q or K weight in NumPy (`[out, in]`) order,
      rows as stored in the GGUF file.
    num_heads: heads of this projection (`head_count` for Q, `head_count_kv` for K).

  Returns:
    The same weight with rows reordered so that, in each head, rows `j` and
    `j + Dh/2` form a RoPE pair.

  Example:
    >>> w = np.arange(8)[:, None]          # one head, Dh=8, rows x0 y0 x1 y1 ...
    >>> unpermute_qk_rows(w, 1)[:, 0].tolist()
    [0, 2, 4, 6, 1, 3, 5, 7]
  """
  rows = weight.shape[0]
  if rows % (2 * num_heads):
    raise ValueError(f"weight rows ({rows}) must be a multiple of 2 * num_heads ({num_heads})")
  rest = weight.shape[1:]
  # File layout per head is [Dh/2, 2]; HF's is [2, Dh/2]: swap those axes.
  return weight.reshape(num_heads, rows // num_heads // 2, 2, *rest).swapaxes(1, 2).reshape(weight.shape)


def permute_qk_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
  """llama.cpp's converter permutation (HF order -> file order); inverse of `unpermute_qk_rows`."""
  rows = weight.shape[0]
  rest = weight.shape[1:]
  return weight.reshape(num_heads, 2, rows // num_heads // 2, *rest).swapaxes(1, 2).reshape(weight.shape)


# What differs between the architectures this loader reads. llama.cpp's converter
# permutes the Q/K rows (and biases) of "llama" files for its interleaved RoPE;
# "qwen2" files keep Hugging Face's order (llama.cpp rotates them NEOX-style).
_PERMUTED_QK = {"llama": True, "qwen2": False}
ARCHITECTURES = tuple(_PERMUTED_QK)


def _quant_types(gguf) -> set:
  # Every type `gguf.quants.dequantize` reads in the installed version.
  return {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, *gguf.quants._type_traits}


def gguf_config(path: str) -> TransformerConfig:
  """Reads a GGUF file's hyper-parameters into a `TransformerConfig` (architectures "llama" and "qwen2").

  Args:
    path: path of a `.gguf` file.

  Returns:
    The config, float32 dtype; `tie_embeddings` is true when the file has no
    `output.weight` (the LM head reuses the token embedding), `qkv_bias` when
    it has `blk.0.attn_q.bias`.

  Raises:
    ValueError: the architecture is not one of `ARCHITECTURES`, a metadata key
      is missing, or the model uses a feature the `Transformer` lacks (partial
      rotary, RoPE scaling); one line naming the file.

  Example:
    >>> gguf_config(smollm2_gguf_path()).num_layers  # doctest: +SKIP
    30
  """
  reader = open_gguf(path)
  arch = _field(reader, "general.architecture")
  if arch not in _PERMUTED_QK:
    raise ValueError(
      f"{path}: general.architecture is {arch!r}; the loader reads {', '.join(map(repr, ARCHITECTURES))} "
      "(Llama-family decoders). Use a GGUF file of one of those."
    )

  def meta(key, default=None):
    value = _field(reader, f"{arch}.{key}", default)
    if value is None:
      raise ValueError(f"{path}: metadata key '{arch}.{key}' is missing; the file is not a complete {arch} GGUF")
    return value

  tensors = {t.name: t for t in reader.tensors}
  d_model = int(meta("embedding_length"))
  num_heads = int(meta("attention.head_count"))
  head_dim = int(meta("attention.key_length", d_model // num_heads))
  rope_dims = int(meta("rope.dimension_count", head_dim))
  if rope_dims != head_dim:
    raise ValueError(f"{path}: partial rotary ({rope_dims} of {head_dim} dims) is not supported")
  scaling = _field(reader, f"{arch}.rope.scaling.type")
  if scaling not in (None, "none") or "rope_freqs.weight" in tensors:
    raise ValueError(f"{path}: RoPE scaling ({scaling or 'rope_freqs.weight'}) is not supported")
  # The embedding's row count is the truth; `vocab_size` metadata is optional.
  if "token_embd.weight" not in tensors:
    raise ValueError(f"{path}: tensor 'token_embd.weight' is missing")
  vocab_size = int(tensors["token_embd.weight"].shape[-1])
  return TransformerConfig(
    vocab_size=vocab_size,
    num_layers=int(meta("block_count")),
    d_model=d_model,
    num_heads=num_heads,
    num_kv_heads=int(meta("attention.head_count_kv", num_heads)),
    head_dim=head_dim,
    d_ff=int(meta("feed_forward_length")),
    rope_theta=float(meta("rope.freq_base", 10000.0)),
    rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
    tie_embeddings="output.weight" not in tensors,
    qkv_bias="blk.0.attn_q.bias" in tensors,
    max_length=int(meta("context_length")),
  )


def read_gguf(path: str, dtype=np.float32, progress: bool = False) -> tuple[TransformerConfig, dict[str, np.ndarray]]:
  """Reads a GGUF file ("llama" or "qwen2") into a config and NumPy weights.

  Every tensor is dequantized with `gguf.quants.dequantize` (F32, F16, BF16,
  Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants and the other types the installed
  `gguf` reads) and cast to `dtype` at once, so peak memory stays near the
  result's size; the Q and K rows of "llama" files are un-permuted (see the
  module docstring). Every tensor's type is checked before any is read.

  Args:
    path: path of a `.gguf` file.
    dtype: NumPy dtype of the result: float32, or `ml_dtypes.bfloat16` /
      float16 for a half-size copy.
    progress: show a tqdm bar over the tensors.

  Returns:
    `(config, weights)`. With L layers, D = d_model, H heads of size Dh, Hkv kv
    heads, F = d_ff, V = vocab, `weights` holds
      "embed" [V, D], "final_norm" [D], "lm_head" [D, V] (only if untied),
      "layers.attn_norm" [L, D], "layers.wq" [L, D, H*Dh],
      "layers.wk" [L, D, Hkv*Dh], "layers.wv" [L, D, Hkv*Dh],
      "layers.bq" [L, H*Dh], "layers.bk", "layers.bv" [L, Hkv*Dh] (only with `qkv_bias`),
      "layers.wo" [L, H*Dh, D], "layers.mlp_norm" [L, D],
      "layers.w_gate" [L, D, F], "layers.w_up" [L, D, F], "layers.w_down" [L, F, D]
    in `x @ W` orientation.

  Raises:
    ValueError: an architecture, feature or tensor type the loader does not
      know, or a tensor missing; one line naming the file.

  Example:
    >>> config, weights = read_gguf(smollm2_gguf_path())  # doctest: +SKIP
    >>> weights["layers.wq"].shape  # doctest: +SKIP
    (30, 576, 576)
  """
  gguf = _import_gguf()
  config = gguf_config(path)
  reader = open_gguf(path)
  tensors = {t.name: t for t in reader.tensors}
  known = _quant_types(gguf)
  for t in reader.tensors:
    if t.tensor_type not in known:
      raise ValueError(
        f"{path}: tensor {t.name!r} is of type {t.tensor_type.name}, which gguf {_gguf_version()} cannot dequantize. "
        "Upgrade it (pip install -U gguf) or requantize the file to Q8_0, Q4_K or Q6_K with llama.cpp."
      )
  permuted = _PERMUTED_QK[_field(reader, "general.architecture")]
  np_dtype = np.dtype(dtype)

  def load(name: str) -> np.ndarray:
    if name not in tensors:
      raise ValueError(f"{path}: tensor {name!r} is missing")
    t = tensors[name]
    # dequantize returns NumPy order (ggml ne reversed): [out, in] for linears.
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)

  # (our name, file name, rows to un-permute by this many heads or None, transpose?)
  heads = {"wq": config.num_heads, "wk": config.num_kv_heads, "bq": config.num_heads, "bk": config.num_kv_heads}
  per_layer = [
    ("attn_norm", "attn_norm.weight"),
    ("wq", "attn_q.weight"),
    ("wk", "attn_k.weight"),
    ("wv", "attn_v.weight"),
    ("wo", "attn_output.weight"),
    ("mlp_norm", "ffn_norm.weight"),
    ("w_gate", "ffn_gate.weight"),
    ("w_up", "ffn_up.weight"),
    ("w_down", "ffn_down.weight"),
  ]
  if config.qkv_bias:
    per_layer += [("bq", "attn_q.bias"), ("bk", "attn_k.bias"), ("bv", "attn_v.bias")]
  steps = 2 + (not config.tie_embeddings) + len(per_layer) * config.num_layers
  bar = progress_bar(steps, f"dequantizing {os.path.basename(path)}", progress)
  weights: dict[str, np.ndarray] = {}
  with bar:
    weights["embed"] = load("token_embd.weight").astype(np_dtype)  # [V, D]: already row-per-token.
    weights["final_norm"] = load("output_norm.weight").astype(np_dtype)
    bar.update(2)
    if not config.tie_embeddings:
      weights["lm_head"] = np.ascontiguousarray(load("output.weight").T.astype(np_dtype))
      bar.update(1)
    for ours, theirs in per_layer:
      stacked = None
      for layer in range(config.num_layers):
        w = load(f"blk.{layer}.{theirs}")
        if permuted and ours in heads:
          w = unpermute_qk_rows(w, heads[ours])
        if w.ndim == 2:
          w = w.T
        if stacked is None:
          stacked = np.empty((config.num_layers, *w.shape), np_dtype)
        stacked[layer] = w
        bar.update(1)
      weights[f"layers.{ours}"] = stacked
  check_weight_shapes(config, weights, path)
  return config, weights


def _gguf_version() -> str:
  try:
    return importlib.metadata.version("gguf")
  except importlib.metadata.PackageNotFoundError:  # pragma: no cover
    return "(unknown version)"


# ---------------------------------------------------------------------------- tokenizer

# llama.cpp token types (llama_token_type): 3 = control, 4 = user defined.
_CONTROL_TOKEN, _USER_DEFINED_TOKEN, _UNUSED_TOKEN = 3, 4, 5


@dataclasses.dataclass(frozen=True, kw_only=True)
class GGUFTokenizerMetadata:
  """The tokenizer part of a GGUF file's metadata.

  Attributes:
    model: `tokenizer.ggml.model`, e.g. "gpt2" for byte-level BPE.
    pre: `tokenizer.ggml.pre`, the name of llama.cpp's pre-tokenizer (e.g. "smollm").
    tokens: the vocabulary, token id -> string.
    token_types: llama.cpp token types per id (1 normal, 3 control, ...).
    merges: BPE merges, "left right" strings, highest priority first.
    bos_token_id, eos_token_id, unknown_token_id, padding_token_id: ids or None.
    add_bos_token: whether llama.cpp prepends BOS when encoding.
    chat_template: the Jinja chat template string, or None.
  """

  model: str
  pre: str | None
  tokens: tuple[str, ...]
  token_types: tuple[int, ...]
  merges: tuple[str, ...]
  bos_token_id: int | None
  eos_token_id: int | None
  unknown_token_id: int | None
  padding_token_id: int | None
  add_bos_token: bool
  chat_template: str | None

  @property
  def unused_token_ids(self) -> tuple[int, ...]:
    """Ids of llama.cpp's "unused" type (e.g. Qwen2.5's "[PAD...]" fillers): no grammar should allow them.

    Example:
      >>> read_gguf_tokenizer_metadata(path).unused_token_ids[:2]   # doctest: +SKIP
      (151665, 151666)
    """
    return tuple(i for i, kind in enumerate(self.token_types) if kind == _UNUSED_TOKEN)

  @property
  def special_tokens(self) -> tuple[str, ...]:
    """Control and user-defined tokens: they must encode as one id each."""
    return tuple(
      tok for tok, kind in zip(self.tokens, self.token_types) if kind in (_CONTROL_TOKEN, _USER_DEFINED_TOKEN)
    )


def read_gguf_tokenizer_metadata(path: str) -> GGUFTokenizerMetadata:
  """Reads the `tokenizer.*` metadata of a GGUF file.

  Args:
    path: path of a `.gguf` file.

  Returns:
    A `GGUFTokenizerMetadata`.
  """
  reader = open_gguf(path)

  def get(key, default=None):
    return _field(reader, f"tokenizer.{key}", default)

  def optional_int(key):
    value = get(key)
    return None if value is None else int(value)

  tokens = get("ggml.tokens")
  if tokens is None:
    raise ValueError(f"{path}: no tokenizer.ggml.tokens in metadata")
  return GGUFTokenizerMetadata(
    model=get("ggml.model"),
    pre=get("ggml.pre"),
    tokens=tuple(tokens),
    token_types=tuple(int(t) for t in get("ggml.token_type", [1] * len(tokens))),
    merges=tuple(get("ggml.merges", [])),
    bos_token_id=optional_int("ggml.bos_token_id"),
    eos_token_id=optional_int("ggml.eos_token_id"),
    unknown_token_id=optional_int("ggml.unknown_token_id"),
    padding_token_id=optional_int("ggml.padding_token_id"),
    add_bos_token=bool(get("ggml.add_bos_token", False)),
    chat_template=get("chat_template"),
  )


# The split regexes of llama.cpp's pre-tokenizers (llama-vocab.cpp), as the
# models' own tokenizer.json files give them. "qwen2" isolates every digit,
# "llama-bpe" (Llama 3) runs of up to three.
_QWEN2_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
PRE_TOKENIZERS = ("smollm", "gpt-2", "default", "qwen2", "llama-bpe")


def _pre_tokenizer(pre: str | None):
  tokenizers = _import_tokenizers()
  pre_tokenizers = tokenizers.pre_tokenizers
  if pre in ("qwen2", "llama-bpe"):
    split = pre_tokenizers.Split(
      tokenizers.Regex(_QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT), behavior="isolated", invert=False
    )
    return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre == "smollm":
    # SmolLM's tokenizer.json: every digit is its own pre-token, then GPT-2's
    # byte-level regex split. llama.cpp names this "smollm" but stores no regex.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
  if pre in (None, "default", "gpt-2", "gpt2"):
    return byte_level
  raise ValueError(f"tokenizer.ggml.pre={pre!r} is not supported; known: {', '.join(map(repr, PRE_TOKENIZERS))}")


def _tokenizer_json(path: str) -> str:
  stat = os.stat(path)
  return _tokenizer_json_of(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _tokenizer_json_of(path: str, size: int, mtime_ns: int) -> str:
  # The built tokenizer is mutable (padding, truncation...), so the cache keeps
  # its JSON and every caller gets a fresh object.
  tokenizers = _import_tokenizers()
  meta = read_gguf_tokenizer_metadata(path)
  if meta.model != "gpt2":
    raise ValueError(f"{path}: tokenizer.ggml.model={meta.model!r}; only byte-level BPE ('gpt2') is supported")
  vocab = {tok: i for i, tok in enumerate(meta.tokens)}
  merges = [tuple(m.split(" ", 1)) for m in meta.merges]
  unk = None if meta.unknown_token_id is None else meta.tokens[meta.unknown_token_id]
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=False))
  tok.pre_tokenizer = _pre_tokenizer(meta.pre)
  if meta.pre == "qwen2":  # Qwen2's tokenizer.json composes accents first
    tok.normalizer = tokenizers.normalizers.NFC()
  tok.decoder = tokenizers.decoders.ByteLevel()
  # Special tokens are matched before BPE, so "<|im_start|>" is one id, and
  # decode(skip_special_tokens=True) drops them.
  tok.add_special_tokens([tokenizers.AddedToken(s, special=True, normalized=False) for s in meta.special_tokens])
  if meta.add_bos_token and meta.bos_token_id is not None:
    bos = meta.tokens[meta.bos_token_id]
    tok.post_processor = tokenizers.processors.TemplateProcessing(
      single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, meta.bos_token_id)]
    )
  return tok.to_str()


def tokenizer_from_gguf(path: str):
  """Builds a `tokenizers.Tokenizer` from a GGUF file's byte-level BPE vocabulary.

  Adds a BOS token only if the file's `tokenizer.ggml.add_bos_token` says so
  (SmolLM2's does not). Control tokens such as `<|im_start|>` are registered as
  special tokens, so they encode to a single id.

  Args:
    path: path of a `.gguf` file whose `tokenizer.ggml.model` is "gpt2".

  Returns:
    A new `tokenizers.Tokenizer` (each call returns an independent object).

  Example:
    >>> tok = tokenizer_from_gguf(smollm2_gguf_path())  # doctest: +SKIP
    >>> tok.encode("<|im_start|>user").ids  # doctest: +SKIP
    [1, 4093]
  """
  return _import_tokenizers().Tokenizer.from_str(_tokenizer_json(path))


def render_chat_template(
  template: str, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True, **extra
) -> str:
  """Renders a stored Jinja chat template with `jinja2` (optional dependency).

  Used to check hand-written templates against the file's own text.

  Args:
    template: the `tokenizer.chat_template` string.
    messages: [{"role": ..., "content": ...}, ...].
    add_generation_prompt: append the assistant turn header.
    **extra: further template variables (e.g. `bos_token`).

  Returns:
    The rendered prompt string.
  """
  sandbox = import_optional("jinja2.sandbox", "Rendering a chat template")
  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  return env.from_string(template).render(messages=list(messages), add_generation_prompt=add_generation_prompt, **extra)


def gguf_chat_template(path: str) -> str | None:
  """The Jinja chat template stored in a GGUF file's `tokenizer.chat_template`, or None.

  Render it with `render_chat_template` (jinja2), or use a model's own formatter
  (`loaders.qwen2_5_coder.chat_prompt`, `loaders.smollm2.chat_prompt`).

  Example:
    >>> "<|im_start|>" in gguf_chat_template(fetch_qwen2_5_coder())  # doctest: +SKIP
    True
  """
  return read_gguf_tokenizer_metadata(path).chat_template


# ---------------------------------------------------------------------------- loading, with a cache
# Dequantizing 1.1 GB of k-quants takes NumPy about a minute and parsing a
# 152k-token vocabulary seconds, so the first load of a file writes what it
# produced (the weights in the requested dtype, the tokenizer, the config) under
# cache_dir()/gguf/<sha256 of the file>/ and later loads read only that.

_CACHE_FORMAT = "specdec_jax.gguf_cache.v1"


def _cache_folder(path: str) -> str:
  return os.path.join(cache_dir(), "gguf", file_sha256(path)[:16])


# safetensors dtype names -> NumPy dtypes, for the cache's own files.
_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16, "F64": np.float64}


def map_safetensors(path: str) -> dict[str, np.ndarray]:
  """The tensors of a safetensors file as read-only NumPy views of a memory map (no copy).

  `safetensors.numpy.load_file` copies every tensor into memory; for 7 GB of
  float32 weights that copy and the model's own would not fit beside each
  other on a 24 GB machine, so the cache is mapped instead: the format is an
  8-byte header length, a JSON header of dtypes, shapes and byte offsets, then
  the data.

  Raises:
    ValueError: the header is not a safetensors header, names an unknown dtype,
      or points past the end of the file.

  Example:
    >>> map_safetensors("weights-float32.safetensors")["embed"].shape  # doctest: +SKIP
    (151936, 1536)
  """
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    (header_len,) = np.frombuffer(f.read(8), np.uint64) if size >= 8 else (0,)
    if not 0 < header_len <= size - 8:
      raise ValueError(f"{path}: not a safetensors file (header length {header_len})")
    header = json.loads(f.read(int(header_len)))
  start = 8 + int(header_len)
  data = np.memmap(path, np.uint8, mode="r", offset=start, shape=(size - start,))
  tensors = {}
  for name, entry in header.items():
    if name == "__metadata__":
      continue
    begin, end = entry["data_offsets"]
    if entry["dtype"] not in _SAFETENSORS_DTYPES or not 0 <= begin <= end <= data.size:
      raise ValueError(f"{path}: tensor {name!r} has dtype {entry['dtype']} and bytes [{begin}, {end})")
    tensors[name] = data[begin:end].view(_SAFETENSORS_DTYPES[entry["dtype"]]).reshape(entry["shape"])
  return tensors


def _read_cache(folder: str, dtype_name: str):
  weights_file = os.path.join(folder, f"weights-{dtype_name}.safetensors")
  meta_file, tokenizer_file = os.path.join(folder, "meta.json"), os.path.join(folder, "tokenizer.json")
  if not all(os.path.isfile(f) for f in (weights_file, meta_file, tokenizer_file)):
    return None
  try:
    with open(meta_file, encoding="utf-8") as f:
      meta = json.load(f)
    if meta.get("format") != _CACHE_FORMAT:
      return None
    config = TransformerConfig(**meta["config"])
    weights = map_safetensors(weights_file)
    with open(tokenizer_file, encoding="utf-8") as f:
      tokenizer_json = f.read()
    check_weight_shapes(config, weights, weights_file)
  except Exception as e:  # a damaged cache is rebuilt, never used
    warnings.warn(f"ignoring the damaged cache {folder} ({type(e).__name__}: {e}); rebuilding it", stacklevel=3)
    return None
  return config, weights, tokenizer_json


def _write_cache(folder: str, dtype_name: str, path: str, config, weights, tokenizer_json: str) -> bool:
  save_file = import_optional("safetensors.numpy", "Caching dequantized weights").save_file
  need = sum(w.nbytes for w in weights.values())
  os.makedirs(folder, exist_ok=True)
  if shutil.disk_usage(folder).free < need + (1 << 30):
    warnings.warn(f"not caching {path}'s weights: {folder} has less than {need / 1e9:.1f} GB free", stacklevel=3)
    return False
  meta = {
    "format": _CACHE_FORMAT,
    "source": os.path.abspath(path),
    "config": config.architecture(),
  }
  # Written under temporary names and renamed, so an interrupted run leaves no half file.
  for name, write in (
    (f"weights-{dtype_name}.safetensors", lambda tmp: save_file(weights, tmp)),
    ("tokenizer.json", lambda tmp: open(tmp, "w", encoding="utf-8").write(tokenizer_json)),
    ("meta.json", lambda tmp: open(tmp, "w", encoding="utf-8").write(json.dumps(meta, indent=2))),
  ):
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, os.path.join(folder, name))
  return True


def read_gguf_cached(path: str, dtype=np.float32, *, cache: bool = True, progress: bool = True):
  """`read_gguf` and the tokenizer's JSON, through the cache: `(config, weights, tokenizer_json)`.

  The first call for a file (by its sha256) and dtype dequantizes and writes
  `cache_dir()/gguf/<hash>/weights-<dtype>.safetensors`, `tokenizer.json` and
  `meta.json`; later calls map those (`map_safetensors`: seconds, no copy in
  memory) and never parse the GGUF. A damaged cache is rebuilt with a warning.

  Args:
    path: path of a `.gguf` file.
    dtype: NumPy dtype of the weights (float32, float16 or bfloat16).
    cache: False reads the GGUF and writes nothing.
    progress: tqdm bars while hashing and dequantizing.

  Example:
    >>> config, weights, tokenizer_json = read_gguf_cached(path, jnp.bfloat16)  # doctest: +SKIP
  """
  dtype_name = np.dtype(dtype).name
  if cache:
    folder = _cache_folder(path)
    hit = _read_cache(folder, dtype_name)
    if hit is not None:
      return hit
  config, weights = read_gguf(path, dtype, progress=progress)
  tokenizer_json = _tokenizer_json(path)
  if cache and _write_cache(folder, dtype_name, path, config, weights, tokenizer_json):
    del weights  # read back as a memory map: the model's copy need not sit beside this one
    return _read_cache(folder, dtype_name)
  return config, weights, tokenizer_json


def load_gguf(
  path: str,
  dtype: Any = jnp.float32,
  kernels: str = "xla",
  *,
  feature_layers: tuple[int, ...] = (),
  cache: bool = True,
  progress: bool = True,
):
  """Loads a GGUF checkpoint of the Llama family ("llama", "qwen2") as a `Transformer` and its tokenizer.

  Dequantizes every type the `gguf` package reads; the first load of a file
  caches the result (see `read_gguf_cached`), so later loads take seconds.

  Args:
    path: path of a `.gguf` file.
    dtype: parameter, activation and KV-cache dtype: float32, bfloat16 or
      float16 (float64 only with `jax_enable_x64`); logits are float32 either way.
    kernels: `TransformerConfig.kernels`: "xla" (default) or "pallas".
    feature_layers: `TransformerConfig.feature_layers`, the blocks whose outputs
      an EAGLE-style head reads (default none).
    cache: False skips the cache (reads the GGUF, writes nothing).
    progress: tqdm bars on a cold load.

  Returns:
    `(model, tokenizer)`: a `Transformer` (config from the file's metadata, with
    `max_length` its context length) and a `tokenizers.Tokenizer` (byte-level
    BPE with the file's pre-tokenizer; control tokens encode as one id).

  Raises:
    ValueError: `dtype` or `kernels` is not one of the above; the file's
      architecture, a feature or a tensor type is unknown (one line naming the file).
    FileNotFoundError: no file at `path`.
    ImportError: `gguf`, `tokenizers` or `safetensors` is missing (message: `pip install 'specdec-jax[models]'`).
    DamagedFileError: the file is truncated or not a GGUF file (a ValueError naming it).

  Example:
    >>> model, tokenizer = load_gguf("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", jnp.bfloat16)  # doctest: +SKIP
    >>> model.config.qkv_bias, model.config.vocab_size  # doctest: +SKIP
    (True, 151936)
  """
  dtype = model_dtype(dtype)
  check_kernels(kernels, "kernels")
  require_model_extras("gguf", "tokenizers", *(("safetensors",) if cache else ()), purpose="Loading a GGUF file")
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"GGUF file not found: {path!r}")
  config, weights, tokenizer_json = read_gguf_cached(path, dtype, cache=cache, progress=progress)
  config = config.replace(dtype=dtype, kernels=kernels, feature_layers=tuple(feature_layers))
  model = Transformer.from_weights(config, weights)
  return model, _import_tokenizers().Tokenizer.from_str(tokenizer_json)
