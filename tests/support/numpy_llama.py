"""An independent float64 NumPy forward pass of a llama or qwen2 GGUF file, for tests.

This module shares no code with `specdec_jax`, so agreeing with it means
something:

* it dequantizes the GGUF blocks (F32, F16, Q8_0, Q4_0, Q4_1) by hand instead of
  calling `gguf.quants.dequantize` (the `gguf` package is used only to locate
  tensors and metadata in the file);
* it keeps the Q and K weights in the file's row order (llama.cpp's converter
  permuted them) and applies RoPE in llama.cpp's own *interleaved* convention,
  rotating dimension pairs (2i, 2i+1). The JAX model un-permutes the rows and
  rotates pairs (i, i + Dh/2) ("rotate_half"); the two agree only if the
  un-permutation is right;
* "qwen2" files are not permuted (llama.cpp rotates them NEOX-style, pairs
  (i, i + Dh/2)); this reference then rotates that way, adds the q/k/v biases,
  and uses `output.weight` when the file has one (untied head);
* it keeps weights in ggml's `y = W x` orientation (`x @ W.T` here), and computes
  everything in float64, streaming one layer's weights at a time so that peak
  memory stays near the size of the embedding table.

Example:
  >>> logits = numpy_llama_forward(path, [504, 3575, 282])  # doctest: +SKIP
  >>> logits.shape
  (3, 49152)
"""

from __future__ import annotations

import numpy as np

# ggml block layouts: (elements per block, bytes per block).
_BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20)}


def dequantize_tensor(tensor, rows: int | None = None) -> np.ndarray:
  """Dequantizes one `gguf.ReaderTensor` by hand into float64.

  Args:
    tensor: a tensor of a `gguf.GGUFReader`.
    rows: only the first `rows` rows (outermost NumPy axis); None for all.

  Returns:
    float64 array in NumPy order: ggml's `ne` reversed, so a linear layer's
    weight is `[out_features, in_features]`.
  """
  shape = tuple(int(n) for n in reversed(tensor.shape))
  kind = tensor.tensor_type.name
  raw = np.asarray(tensor.data)  # quantized: [rows, bytes per row] of uint8
  if rows is not None:
    raw, shape = raw[:rows], (min(rows, shape[0]), *shape[1:])
  if kind == "F32":
    return raw.astype(np.float64).reshape(shape)
  if kind == "F16":
    return raw.astype(np.float64).reshape(shape)
  if kind not in _BLOCKS:
    raise NotImplementedError(f"numpy_llama: no hand dequantizer for {kind} ({tensor.name})")
  block_elems, block_bytes = _BLOCKS[kind]
  blocks = raw.reshape(-1).view(np.uint8).reshape(-1, block_bytes)
  # Every block starts with a little-endian float16 scale d.
  scale = blocks[:, 0:2].copy().view("<f2").astype(np.float64)  # [N, 1]
  if kind == "Q8_0":
    quants = blocks[:, 2:].copy().view(np.int8).astype(np.float64)  # [N, 32]
    values = scale * quants
  else:
    if kind == "Q4_1":
      minimum = blocks[:, 2:4].copy().view("<f2").astype(np.float64)  # [N, 1]
      packed = blocks[:, 4:]
    else:  # Q4_0: symmetric, offset 8, no minimum.
      minimum = None
      packed = blocks[:, 2:]
    # Low nibbles hold elements 0..15 of the block, high nibbles 16..31.
    nibbles = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float64)
    if minimum is None:
      values = scale * (nibbles - 8.0)
    else:
      values = scale * nibbles + minimum
  assert values.shape[1] == block_elems
  return values.reshape(shape)


class NumpyLlama:
  """Reads a llama GGUF file; runs float64 forward passes on it.

  Args:
    path: path of a `.gguf` file with `general.architecture == "llama"`.
    reader: an already open `gguf.GGUFReader` of `path`, to skip re-parsing
      its metadata (seconds for a 49k-token vocabulary).
  """

  def __init__(self, path: str, reader=None):
    import gguf  # Only to parse the container; never its dequantizers.

    self.reader = gguf.GGUFReader(path) if reader is None else reader
    self.tensors = {t.name: t for t in self.reader.tensors}
    arch = self._meta("general.architecture")
    assert arch in ("llama", "qwen2"), arch
    self.interleaved = arch == "llama"
    self.num_layers = int(self._meta(f"{arch}.block_count"))
    self.d_model = int(self._meta(f"{arch}.embedding_length"))
    self.num_heads = int(self._meta(f"{arch}.attention.head_count"))
    self.num_kv_heads = int(self._meta(f"{arch}.attention.head_count_kv"))
    self.head_dim = self.d_model // self.num_heads
    self.rope_theta = float(self._meta(f"{arch}.rope.freq_base"))
    self.eps = float(self._meta(f"{arch}.attention.layer_norm_rms_epsilon"))

  def _meta(self, key):
    return self.reader.fields[key].contents()

  def weight(self, name: str) -> np.ndarray:
    """Dequantized float64 tensor by its GGUF name, `[out, in]` for linears."""
    return dequantize_tensor(self.tensors[name])

  def _rms_norm(self, x, weight):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * weight

  def _rope_interleaved(self, x, positions):
    # llama.cpp "normal" RoPE: pairs (2i, 2i+1) share frequency theta^(-2i/Dh).
    half = self.head_dim // 2
    inv_freq = self.rope_theta ** (-2.0 * np.arange(half) / self.head_dim)  # [Dh/2]
    angle = positions[:, None, None] * inv_freq  # [T, 1, Dh/2]
    cos, sin = np.cos(angle), np.sin(angle)
    even, odd = x[..., 0::2], x[..., 1::2]  # [T, heads, Dh/2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out

  def _rope_neox(self, x, positions):
    # NEOX / Hugging Face "rotate_half": pairs (i, i + Dh/2).
    half = self.head_dim // 2
    inv_freq = self.rope_theta ** (-2.0 * np.arange(half) / self.head_dim)
    angle = positions[:, None, None] * inv_freq
    cos, sin = np.cos(angle), np.sin(angle)
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)

  def _rope(self, x, positions):
    return self._rope_interleaved(x, positions) if self.interleaved else self._rope_neox(x, positions)

  def forward(self, tokens) -> np.ndarray:
    """Logits of one sequence, float64.

    Args:
      tokens: int token ids, `[T]`, at positions `0..T-1`.

    Returns:
      float64 logits `[T, V]`.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    num_tokens = tokens.shape[0]
    positions = np.arange(num_tokens, dtype=np.float64)
    h, hkv, dh = self.num_heads, self.num_kv_heads, self.head_dim
    group = h // hkv
    embed = self.weight("token_embd.weight")  # [V, D]
    x = embed[tokens]  # [T, D]
    causal = np.tril(np.ones((num_tokens, num_tokens), dtype=bool))
    for layer in range(self.num_layers):
      w = lambda name: self.weight(f"blk.{layer}.{name}.weight")  # noqa: E731
      a = self._rms_norm(x, w("attn_norm"))
      q, k, v = (a @ w(f"attn_{n}").T for n in "qkv")
      if f"blk.{layer}.attn_q.bias" in self.tensors:
        q, k, v = (y + self.weight(f"blk.{layer}.attn_{n}.bias") for y, n in zip((q, k, v), "qkv"))
      q = self._rope(q.reshape(num_tokens, h, dh), positions)
      k = self._rope(k.reshape(num_tokens, hkv, dh), positions)
      v = v.reshape(num_tokens, hkv, dh)
      heads = []
      for head in range(h):
        kv = head // group  # GQA: consecutive query heads share a kv head.
        scores = q[:, head] @ k[:, kv].T / np.sqrt(dh)  # [T, T]
        scores = np.where(causal, scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        heads.append(probs @ v[:, kv])  # [T, Dh]
      x = x + np.concatenate(heads, axis=-1) @ w("attn_output").T
      m = self._rms_norm(x, w("ffn_norm"))
      gate = m @ w("ffn_gate").T
      up = m @ w("ffn_up").T
      x = x + (gate / (1.0 + np.exp(-gate)) * up) @ w("ffn_down").T
    x = self._rms_norm(x, self.weight("output_norm.weight"))
    head = self.weight("output.weight") if "output.weight" in self.tensors else embed
    return x @ head.T


def numpy_llama_forward(path: str, tokens) -> np.ndarray:
  """float64 logits `[T, V]` of `tokens` `[T]` under the GGUF model at `path`."""
  return NumpyLlama(path).forward(tokens)
