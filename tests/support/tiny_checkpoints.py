"""Tiny random checkpoints of the Llama family, written as GGUF files and Hugging Face directories.

The loaders' tests read these back and compare logits with `numpy_llama` (GGUF)
or with each other. Writing goes through the `gguf` package's writer and
quantizers and `safetensors`: the code under test (`specdec_jax.models.loaders`)
only reads.

`write_gguf` lays weights out as llama.cpp's converter does: `[out, in]`, the Q/K
rows (and biases) of "llama" files permuted for interleaved RoPE, "qwen2" files in
Hugging Face's order. The tokenizer is byte-level BPE over the 256 byte symbols,
a few merges and ChatML's control tokens.
"""

from __future__ import annotations

import json
import os

import numpy as np

from specdec_jax.models.config import TransformerConfig
from specdec_jax.models.loaders.gguf import permute_qk_rows
from specdec_jax.models.transformer import weight_shapes

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = ("Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "r e")
CHAT_TEMPLATE = (
  "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_symbols() -> list[str]:
  # GPT-2's byte -> printable-character table, in byte order.
  printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
  extra = 0
  table = {}
  for b in range(256):
    if b in printable:
      table[b] = chr(b)
    else:
      table[b] = chr(256 + extra)
      extra += 1
  return [table[b] for b in range(256)]


def vocabulary() -> list[str]:
  """Token strings: 256 byte symbols, the merges' results, then the control tokens."""
  tokens = _byte_symbols()
  tokens += ["".join(m.split(" ")) for m in MERGES]
  return tokens + list(SPECIALS)


def tiny_config(arch: str, **overrides) -> TransformerConfig:
  """A 2-block model over `vocabulary()`: "qwen2" has q/k/v biases and an untied head, "llama" neither."""
  qwen = arch == "qwen2"
  fields = dict(
    vocab_size=len(vocabulary()),
    num_layers=2,
    d_model=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    d_ff=96,
    rope_theta=10000.0 if not qwen else 1e6,
    rms_norm_eps=1e-6 if qwen else 1e-5,
    tie_embeddings=not qwen,
    qkv_bias=qwen,
    max_length=128,
  )
  return TransformerConfig(**{**fields, **overrides})


def random_weights(config: TransformerConfig, seed: int = 0) -> dict[str, np.ndarray]:
  """float32 weights of `weight_shapes(config)`: norms near 1, biases and matrices of a scale that keeps logits varied."""
  rng = np.random.default_rng(seed)
  weights = {}
  for name, shape in weight_shapes(config).items():
    if name.endswith("norm"):
      weights[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    elif name.startswith("layers.b"):
      weights[name] = (0.5 * rng.standard_normal(shape)).astype(np.float32)
    else:
      weights[name] = (rng.standard_normal(shape) / np.sqrt(shape[-2])).astype(np.float32)
  return weights


def write_gguf(path: str, arch: str, config: TransformerConfig, weights, quant: dict[str, str] | None = None) -> str:
  """Writes `weights` (`Transformer.from_weights` layout) as a GGUF file of architecture `arch`.

  Args:
    quant: GGML type name per GGUF tensor-name suffix (e.g. {"attn_q.weight": "Q8_0"}); default F32.
  """
  import gguf

  quant = quant or {}
  w = gguf.GGUFWriter(path, arch)
  w.add_block_count(config.num_layers)
  w.add_context_length(config.max_length)
  w.add_embedding_length(config.d_model)
  w.add_feed_forward_length(config.d_ff)
  w.add_head_count(config.num_heads)
  w.add_head_count_kv(config.num_kv_heads)
  w.add_rope_freq_base(config.rope_theta)
  w.add_layer_norm_rms_eps(config.rms_norm_eps)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "gpt-2")
  tokens = vocabulary()
  w.add_token_list(tokens)
  w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
  w.add_token_merges(list(MERGES))
  w.add_eos_token_id(tokens.index("<|im_end|>"))
  w.add_bos_token_id(tokens.index("<|endoftext|>"))
  w.add_add_bos_token(False)
  w.add_chat_template(CHAT_TEMPLATE)

  def add(name: str, array: np.ndarray) -> None:
    qtype = getattr(gguf.GGMLQuantizationType, next((t for s, t in quant.items() if name.endswith(s)), "F32"))
    array = np.ascontiguousarray(array, np.float32)
    if qtype == gguf.GGMLQuantizationType.F32:
      w.add_tensor(name, array)
    elif qtype == gguf.GGMLQuantizationType.F16:
      w.add_tensor(name, array.astype(np.float16))
    else:
      w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)

  permute = arch == "llama"
  heads = {"q": config.num_heads, "k": config.num_kv_heads}
  add("token_embd.weight", weights["embed"])
  add("output_norm.weight", weights["final_norm"])
  if not config.tie_embeddings:
    add("output.weight", weights["lm_head"].T)
  names = {
    "attn_norm": "attn_norm.weight",
    "wq": "attn_q.weight",
    "wk": "attn_k.weight",
    "wv": "attn_v.weight",
    "wo": "attn_output.weight",
    "mlp_norm": "ffn_norm.weight",
    "w_gate": "ffn_gate.weight",
    "w_up": "ffn_up.weight",
    "w_down": "ffn_down.weight",
    "bq": "attn_q.bias",
    "bk": "attn_k.bias",
    "bv": "attn_v.bias",
  }
  for layer in range(config.num_layers):
    for ours, theirs in names.items():
      if f"layers.{ours}" not in weights:
        continue
      x = weights[f"layers.{ours}"][layer]
      x = x.T if x.ndim == 2 else x  # [out, in] as llama.cpp stores linears
      if permute and ours[1:] in heads:
        x = permute_qk_rows(x, heads[ours[1:]])
      add(f"blk.{layer}.{theirs}", x)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def tokenizer_json(pre: str = "qwen2") -> str:
  """The tiny vocabulary as a `tokenizer.json` string (built like the GGUF loader builds it)."""
  import tokenizers

  tokens = vocabulary()
  tok = tokenizers.Tokenizer(
    tokenizers.models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in MERGES])
  )
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  tok.add_special_tokens([tokenizers.AddedToken(s, special=True, normalized=False) for s in SPECIALS])
  return tok.to_str()


def write_hf(directory: str, model_type: str, config: TransformerConfig, weights, dtype=np.float32) -> str:
  """Writes `weights` as a Hugging Face checkpoint directory (`model_type` "llama" or "qwen2")."""
  from safetensors.numpy import save_file

  os.makedirs(directory, exist_ok=True)
  hf = {
    "architectures": ["Qwen2ForCausalLM" if model_type == "qwen2" else "LlamaForCausalLM"],
    "model_type": model_type,
    "vocab_size": config.vocab_size,
    "hidden_size": config.d_model,
    "intermediate_size": config.d_ff,
    "num_hidden_layers": config.num_layers,
    "num_attention_heads": config.num_heads,
    "num_key_value_heads": config.num_kv_heads,
    "rope_theta": config.rope_theta,
    "rms_norm_eps": config.rms_norm_eps,
    "tie_word_embeddings": config.tie_embeddings,
    "max_position_embeddings": config.max_length,
    "hidden_act": "silu",
    "rope_scaling": None,
    "torch_dtype": np.dtype(dtype).name,
  }
  if model_type == "llama":
    hf["attention_bias"] = config.qkv_bias
  else:
    hf["use_sliding_window"] = False
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(hf, f, indent=2)
  names = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
    "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias",
  }
  tensors = {"model.embed_tokens.weight": weights["embed"], "model.norm.weight": weights["final_norm"]}
  if not config.tie_embeddings:
    tensors["lm_head.weight"] = weights["lm_head"].T
  for layer in range(config.num_layers):
    for ours, theirs in names.items():
      if f"layers.{ours}" in weights:
        x = weights[f"layers.{ours}"][layer]
        tensors[f"model.layers.{layer}.{theirs}"] = x.T if x.ndim == 2 else x
  save_file(
    {k: np.ascontiguousarray(v.astype(dtype)) for k, v in tensors.items()}, os.path.join(directory, "model.safetensors")
  )
  with open(os.path.join(directory, "tokenizer.json"), "w") as f:
    f.write(tokenizer_json())
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>"}, f)
  return directory
