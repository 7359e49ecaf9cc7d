"""Read llama-architecture GGUF files: config, float32 weights and tokenizer.

GGUF is llama.cpp's single-file format. This module turns one into

* a `TransformerConfig` plus a dict of float32 NumPy weights in the layout
  `Transformer.from_weights` takes (`x @ W` orientation, layers stacked on a
  leading axis), and
* a `tokenizers.Tokenizer` rebuilt from the vocabulary and merges stored in the
  file.

Two details of llama.cpp's converter matter:

1. Tensor shapes. ggml lists dimensions fastest first (`ne`); NumPy's are the
   reverse, so a linear layer's weight reads as `[out, in]` (PyTorch's
   orientation) and is transposed here to `[in, out]`.
2. Q/K row order. `convert_hf_to_gguf.py` permutes the output rows of Q and K so
   that llama.cpp can rotate *adjacent* pairs (2i, 2i+1); our model rotates pairs
   (i, i + Dh/2) like Hugging Face ("rotate_half"). `unpermute_qk_rows` undoes
   the permutation. Within one head the converter maps HF row `c*Dh/2 + j` to
   file row `2j + c`:

     HF rows of a head:   x0 x1 ... x31 | y0 y1 ... y31     (rotate_half pairs xi, yi)
     file rows:           x0 y0 x1 y1 ... x31 y31           (interleaved pairs)

`gguf` (parsing, dequantizing) and `tokenizers` are imported on first use, so
importing this module does not need them; a missing one raises an ImportError
that names the install command (`import_optional`). A truncated or corrupted
file raises a `DamagedFileError` (a ValueError) that names the file
(`damaged_file_error`); `loaders.smollm2` uses both helpers for its own files too.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
from collections.abc import Sequence

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


def _import_gguf():
  return import_optional("gguf", "Reading GGUF files")


def _import_tokenizers():
  return import_optional("tokenizers", "Building a tokenizer from GGUF")


@functools.lru_cache(maxsize=4)
def open_gguf(path: str):
  """A `gguf.GGUFReader` of `path`, cached per path.

  Parsing the metadata (49k token strings and 49k merges for SmolLM2) takes
  seconds; the tensor data stays a read-only memmap, so keeping readers is cheap.

  Raises:
    FileNotFoundError: no file at `path`.
    DamagedFileError: the file is truncated or not a GGUF file (a ValueError naming `path`).
  """
  if not os.path.isfile(path):
    raise FileNotFoundError(f"GGUF file not found: {path!r}")
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


def gguf_llama_config(path: str) -> TransformerConfig:
  """Reads a llama GGUF file's hyper-parameters into a `TransformerConfig`.

  Args:
    path: path of a `.gguf` file.

  Returns:
    The config, float32 dtype, `tie_embeddings` true when the file has no
    `output.weight` (the LM head reuses the token embedding).

  Raises:
    ValueError: the architecture is not llama, or uses a feature the model
      lacks (partial rotary, RoPE scaling).
  """
  reader = open_gguf(path)
  arch = _field(reader, "general.architecture")
  if arch != "llama":
    raise ValueError(f"{path}: general.architecture is {arch!r}; only 'llama' is supported")

  def meta(key, default=None):
    value = _field(reader, f"llama.{key}", default)
    if value is None:
      raise ValueError(f"{path}: metadata key 'llama.{key}' is missing")
    return value

  tensors = {t.name: t for t in reader.tensors}
  d_model = int(meta("embedding_length"))
  num_heads = int(meta("attention.head_count"))
  head_dim = int(meta("attention.key_length", d_model // num_heads))
  rope_dims = int(meta("rope.dimension_count", head_dim))
  if rope_dims != head_dim:
    raise ValueError(f"{path}: partial rotary ({rope_dims} of {head_dim} dims) is not supported")
  scaling = _field(reader, "llama.rope.scaling.type")
  if scaling not in (None, "none"):
    raise ValueError(f"{path}: RoPE scaling {scaling!r} is not supported")
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
    max_length=int(meta("context_length")),
  )


def read_gguf_llama(path: str) -> tuple[TransformerConfig, dict[str, np.ndarray]]:
  """Reads a llama GGUF file into a config and float32 weights.

  Quantized tensors (Q4_1, Q8_0, K-quants, ...) are dequantized with
  `gguf.quants.dequantize`; Q and K rows are un-permuted (see module docstring).

  Args:
    path: path of a `.gguf` file.

  Returns:
    `(config, weights)`. With L layers, D = d_model, H heads of size Dh, Hkv kv
    heads, F = d_ff, V = vocab, `weights` holds float32 arrays
      "embed" [V, D], "final_norm" [D], "lm_head" [D, V] (only if untied),
      "layers.attn_norm" [L, D], "layers.wq" [L, D, H*Dh],
      "layers.wk" [L, D, Hkv*Dh], "layers.wv" [L, D, Hkv*Dh],
      "layers.wo" [L, H*Dh, D], "layers.mlp_norm" [L, D],
      "layers.w_gate" [L, D, F], "layers.w_up" [L, D, F], "layers.w_down" [L, F, D]
    in `x @ W` orientation.

  Example:
    >>> config, weights = read_gguf_llama(smollm2_gguf_path())  # doctest: +SKIP
    >>> weights["layers.wq"].shape  # doctest: +SKIP
    (30, 576, 576)
  """
  gguf = _import_gguf()
  config = gguf_llama_config(path)
  reader = open_gguf(path)
  tensors = {t.name: t for t in reader.tensors}

  def load(name: str) -> np.ndarray:
    if name not in tensors:
      raise ValueError(f"{path}: tensor {name!r} is missing")
    t = tensors[name]
    # dequantize returns NumPy order (ggml ne reversed): [out, in] for linears.
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)

  num_layers = config.num_layers
  weights: dict[str, np.ndarray] = {
    "embed": load("token_embd.weight"),  # [V, D]: already row-per-token.
    "final_norm": load("output_norm.weight"),
  }
  if not config.tie_embeddings:
    weights["lm_head"] = np.ascontiguousarray(load("output.weight").T)

  # (our name, file name, rows to un-permute by this many heads or None, transpose?)
  per_layer = [
    ("attn_norm", "attn_norm", None, False),
    ("wq", "attn_q", config.num_heads, True),
    ("wk", "attn_k", config.num_kv_heads, True),
    ("wv", "attn_v", None, True),
    ("wo", "attn_output", None, True),
    ("mlp_norm", "ffn_norm", None, False),
    ("w_gate", "ffn_gate", None, True),
    ("w_up", "ffn_up", None, True),
    ("w_down", "ffn_down", None, True),
  ]
  for ours, theirs, unpermute_heads, transpose in per_layer:
    stacked = None
    for layer in range(num_layers):
      w = load(f"blk.{layer}.{theirs}.weight")
      if unpermute_heads is not None:
        w = unpermute_qk_rows(w, unpermute_heads)
      if transpose:
        w = w.T
      if stacked is None:
        stacked = np.empty((num_layers, *w.shape), np.float32)
      stacked[layer] = w
    weights[f"layers.{ours}"] = stacked
  _check_shapes(config, weights)
  return config, weights


def _check_shapes(config: TransformerConfig, weights: dict[str, np.ndarray]) -> None:
  # Fail here, naming the file's layout, rather than later in from_weights.
  expected = weight_shapes(config)
  if expected.keys() != weights.keys():
    raise ValueError(f"weights have keys {sorted(weights)}, expected {sorted(expected)}")
  for name, shape in expected.items():
    if weights[name].shape != shape:
      raise ValueError(f"weight {name!r} has shape {weights[name].shape}, expected {shape}")


# ---------------------------------------------------------------------------- tokenizer

# llama.cpp token types (llama_token_type): 3 = control, 4 = user defined.
_CONTROL_TOKEN, _USER_DEFINED_TOKEN = 3, 4


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


def _pre_tokenizer(pre: str | None):
  pre_tokenizers = _import_tokenizers().pre_tokenizers
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre == "smollm":
    # SmolLM's tokenizer.json: every digit is its own pre-token, then GPT-2's
    # byte-level regex split. llama.cpp names this "smollm" but stores no regex.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
  if pre in (None, "default", "gpt-2", "gpt2"):
    return byte_level
  raise ValueError(f"tokenizer.ggml.pre={pre!r} is not supported; known: 'smollm', 'gpt-2', 'default'")


@functools.lru_cache(maxsize=4)
def _tokenizer_json(path: str) -> str:
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
