"""EAGLE head files (`loaders.eagle_files`): float16 and int8 storage, a narrower MLP, and the loaders' errors."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specdec_jax.models.eagle import EagleDrafter
from specdec_jax.models.loaders import eagle_files
from tests.support.tiny_transformers import CONFIG, V, unit_target

pytest.importorskip("safetensors")

# A Qwen2-like tiny target: q/k/v biases and an untied output head.
QWEN_LIKE = CONFIG.replace(qkv_bias=True, tie_embeddings=False)


def _head(d_ff=24, vocab=(0, 3, 5, 7, 9, 11, 15)):
  target = unit_target(QWEN_LIKE, seed=1)
  head = EagleDrafter.for_target(target, num_layers=1, d_ff=d_ff, draft_vocab=np.asarray(vocab), rngs=nnx.Rngs(2))
  return target, head


def _logits(head):
  tokens = jax.random.randint(jax.random.key(3), (2, 5), 0, V)
  hidden = head.fuse(jax.random.normal(jax.random.key(4), (2, 5, head.config.feature_size)))
  pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
  return np.asarray(head(tokens, hidden, pos, head.init_cache(2, 8))[0])


def _source(target, calls):
  def source():
    calls.append(1)
    return target.config, np.asarray(target.embed[...]), np.asarray(target.lm_head[...]).T

  return source


def test_quantize_int8_is_within_half_a_step_per_column():
  w = np.random.default_rng(0).standard_normal((3, 40, 6)).astype(np.float32)
  w[1, :, 2] = 0.0  # an all-zero column
  q, scale = eagle_files.quantize_int8(w)
  assert q.dtype == np.int8 and scale.shape == (3, 1, 6) and scale.dtype == np.float16
  s = scale.astype(np.float32)
  err = np.abs(q.astype(np.float32) * s - w)
  assert np.all(err <= s / 2 + 1e-6)
  assert np.all(np.abs(q).max(axis=-2) == np.where(np.abs(w).max(axis=-2) > 0, 127, 0))


@pytest.mark.parametrize("storage", ["float16", "int8"])
def test_a_narrow_head_round_trips_through_its_file(tmp_path, storage):
  target, head = _head()
  assert head.config.layers.d_ff == 24 != QWEN_LIKE.d_ff
  path = str(tmp_path / "head.safetensors")
  eagle_files.save_eagle_head(head, path, target="tiny.gguf", metadata={"steps": 3}, storage_dtype=storage)
  meta = json.load(open(tmp_path / "head.json"))
  assert meta["d_ff"] == 24 and meta["storage_dtype"] == storage and meta["steps"] == 3
  calls = []
  loaded = eagle_files.read_eagle_head(path, _source(target, calls), name="tiny head", remedy="")
  assert calls == [1] and loaded.config == head.config
  np.testing.assert_array_equal(loaded.draft_vocab[...], head.draft_vocab[...])
  a, b = _logits(head), _logits(loaded)
  finite = np.isfinite(a)
  assert np.array_equal(finite, np.isfinite(b))  # the same draft vocabulary
  # float16 rounds each weight by 2^-11 relative; int8 by up to half a step of 1/127 of a column's largest.
  tol = 2e-2 if storage == "float16" else 0.25
  np.testing.assert_allclose(b[finite], a[finite], atol=tol)
  assert storage == "float16" or np.abs(b[finite] - a[finite]).max() > 1e-4  # int8 is really quantized


def test_int8_halves_the_file(tmp_path):
  _, head = _head(d_ff=256)
  sizes = {}
  for storage in ("float16", "int8"):
    path = tmp_path / f"{storage}.safetensors"
    eagle_files.save_eagle_head(head, str(path), target="tiny.gguf", storage_dtype=storage)
    sizes[storage] = path.stat().st_size
  assert sizes["int8"] < 0.6 * sizes["float16"]


def test_missing_or_foreign_files_fail_before_the_target_is_read(tmp_path):
  target, head = _head()
  calls = []
  with pytest.raises(FileNotFoundError, match="no such file"):
    eagle_files.read_eagle_head(str(tmp_path / "none.safetensors"), _source(target, calls), name="h", remedy="")
  path = str(tmp_path / "head.safetensors")
  eagle_files.save_eagle_head(head, path, target="tiny.gguf")
  meta = json.load(open(tmp_path / "head.json"))
  json.dump({**meta, "format": "other"}, open(tmp_path / "head.json", "w"))
  with pytest.raises(ValueError, match="expected 'specdec_jax.eagle.v1'"):
    eagle_files.read_eagle_head(path, _source(target, calls), name="h", remedy="")
  assert calls == []
  with pytest.raises(ValueError, match="storage_dtype"):
    eagle_files.save_eagle_head(head, path, target="tiny.gguf", storage_dtype="bfloat16")


def test_qwen_head_loader_refuses_a_missing_file_at_once(tmp_path):
  pytest.importorskip("gguf")
  pytest.importorskip("tokenizers")
  from specdec_jax.models import load_qwen2_5_coder_eagle  # noqa: PLC0415

  with pytest.raises(FileNotFoundError, match="Qwen2.5-Coder EAGLE head not found"):
    load_qwen2_5_coder_eagle(path=str(tmp_path / "none.safetensors"))
  with pytest.raises(ValueError, match="dtype"):
    load_qwen2_5_coder_eagle(dtype="bf16")
  with pytest.raises(ValueError, match="kernels"):
    load_qwen2_5_coder_eagle(kernels="triton")


def test_for_target_refuses_a_bad_mlp_width():
  target = unit_target(QWEN_LIKE)
  for bad in (0, -4, 2.5, True):
    with pytest.raises(ValueError, match="d_ff"):
      EagleDrafter.for_target(target, d_ff=bad, rngs=nnx.Rngs(0))


def test_for_target_builds_a_float32_head_for_a_bf16_target():
  target = unit_target(QWEN_LIKE.replace(dtype=jnp.bfloat16))
  head = EagleDrafter.for_target(target, d_ff=24, dtype=jnp.float32, rngs=nnx.Rngs(0))
  assert head.config.layers.dtype == jnp.float32 and head.config.layers.d_ff == 24
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(head, nnx.Param)))
  np.testing.assert_array_equal(head.embed[...], target.embed[...].astype(jnp.float32))
  np.testing.assert_array_equal(head.head[...], target.lm_head[...].T.astype(jnp.float32))
  assert EagleDrafter.for_target(target, rngs=nnx.Rngs(0)).config.layers.dtype == jnp.bfloat16


def test_the_shipped_coder_head_is_a_small_int8_file_with_its_recipe():
  """The shipped Qwen2.5-Coder head (no GGUF needed): at most 40 MB, int8 with per-column scales, one block of the
  target's width with a 4096-wide MLP, a sorted draft vocabulary of 32768 distinct target ids, and the JSON
  records how it was made (the commands of every run, the seed, the data, the held-out agreement)."""
  from safetensors.numpy import load_file  # noqa: PLC0415

  from specdec_jax.models.loaders.common import json_beside  # noqa: PLC0415
  from specdec_jax.models.loaders.qwen2_5_coder import QWEN2_5_CODER_EAGLE_PATH  # noqa: PLC0415

  assert os.path.getsize(QWEN2_5_CODER_EAGLE_PATH) <= 40_000_000
  with open(json_beside(QWEN2_5_CODER_EAGLE_PATH)) as f:
    meta = json.load(f)
  assert meta["format"] == eagle_files.EAGLE_FORMAT and meta["storage_dtype"] == "int8"
  assert (meta["num_layers"], meta["d_ff"], meta["draft_vocab_size"]) == (1, 4096, 32768)
  assert meta["feature_layers"] == [2, 14, 25] and meta["seed"] == 0 and meta["steps_done"] == meta["steps"]
  # A head continued from an earlier one (`--init`) keeps that head's record: the data of the whole lineage count.
  lineage = [meta]
  while "init_record" in lineage[-1]:
    lineage.append(lineage[-1]["init_record"])
  assert lineage[-1]["init"] is None and max(m["generated_tokens"] for m in lineage) >= 20_000_000
  for m in lineage:
    assert all("train_eagle.py" in c["command"] for c in m["commands"])
    assert [c["steps"][0] for c in m["commands"]] == [0] + [c["steps"][1] for c in m["commands"][:-1]]
  assert len(meta["held_out"]["top1"]) == meta["depth"] >= 4
  w = load_file(QWEN2_5_CODER_EAGLE_PATH)
  d, f_ = 1536, meta["d_ff"]
  assert w["fc"].shape == (3 * d, d) and w["fc"].dtype == np.int8 and w["fc.scale"].shape == (1, d)
  assert w["first.w_gate"].shape == (d, f_) and w["first.w_down"].shape == (f_, d)
  assert all(w[k].dtype == np.int8 for k in w if k.startswith(("fc", "first.w")) and not k.endswith(".scale"))
  vocab = w["draft_vocab"]
  assert vocab.shape == (32768,) and np.all(np.diff(vocab) > 0) and 0 <= vocab[0] and vocab[-1] < 151936


@pytest.mark.parametrize("storage", ["float16", "int8"])
def test_a_block_drafter_round_trips_through_its_file(tmp_path, storage):
  """`save_block_drafter` / `read_block_drafter`: the backbone as a head file, the placeholder hidden and the
  block size beside it; the read drafter's block logits are the stored weights' (float16 or int8 rounding)."""
  from specdec_jax.models import BlockDrafter

  target, head = _head()
  drafter = BlockDrafter(head, block_size=3, rngs=nnx.Rngs(5))
  shape = drafter.mask_hidden.shape  # [block_size - 1, D]: one hidden per offset
  drafter.mask_hidden[...] = jnp.linspace(-1.0, 1.0, np.prod(shape)).reshape(shape).astype(drafter.mask_hidden.dtype)
  path = str(tmp_path / "block.safetensors")
  eagle_files.save_block_drafter(drafter, path, target="tiny.gguf", metadata={"steps": 3}, storage_dtype=storage)
  meta = json.load(open(tmp_path / "block.json"))
  assert meta["format"] == eagle_files.BLOCK_FORMAT and meta["block_size"] == 3 and meta["steps"] == 3
  calls = []
  read = eagle_files.read_block_drafter(path, _source(target, calls), name="tiny block drafter", remedy="")
  assert isinstance(read, BlockDrafter) and read.block_size == 3 and calls == [1]
  np.testing.assert_array_equal(np.asarray(read.mask_hidden[...]), np.asarray(drafter.mask_hidden[...]))
  seqs = jax.random.randint(jax.random.key(6), (2, 9), 0, V)
  feats = jax.random.normal(jax.random.key(7), (2, 8, head.config.feature_size))
  ends = jnp.asarray([[2, 5], [1, 6]], jnp.int32)
  got = np.asarray(read.block_logits(seqs[:, 1:], feats, ends, 3))
  want = np.asarray(drafter.block_logits(seqs[:, 1:], feats, ends, 3))
  assert np.all(np.isneginf(got) == np.isneginf(want))  # the same draft vocabulary
  finite = np.isfinite(want)
  np.testing.assert_allclose(got[finite], want[finite], atol=0.05 if storage == "int8" else 0.01)
  # An EAGLE head's file is not a block drafter's, and the other way round: refused before the target is read.
  eagle_files.save_eagle_head(head, str(tmp_path / "head.safetensors"), target="tiny.gguf")
  with pytest.raises(ValueError, match="expected 'specdec_jax.block_drafter.v1' or 'specdec_jax.block_drafter.v2'"):
    eagle_files.read_block_drafter(str(tmp_path / "head.safetensors"), _source(target, calls), name="x", remedy="")
  with pytest.raises(ValueError, match="expected 'specdec_jax.eagle.v1'"):
    eagle_files.read_eagle_head(path, _source(target, calls), name="x", remedy="")
  assert calls == [1]


def test_a_first_format_block_drafter_reads_with_its_one_hidden_at_every_offset(tmp_path):
  """A v1 file (one placeholder hidden [D]) reads as a shared-hidden drafter, whose logits are those of a
  per-offset one with that hidden at every offset: the drafter it was. A hidden of another shape, or a bad
  block_size (refused before the target is read), is a clear error."""
  safetensors_numpy = pytest.importorskip("safetensors.numpy")

  from specdec_jax.models import BlockDrafter

  target, head = _head()
  drafter = BlockDrafter(head, block_size=4, rngs=nnx.Rngs(5))
  path = str(tmp_path / "block.safetensors")
  eagle_files.save_block_drafter(drafter, path, target="tiny.gguf", storage_dtype="float32")
  weights, meta = safetensors_numpy.load_file(path), json.load(open(tmp_path / "block.json"))
  one = np.linspace(-1.0, 1.0, weights["block.mask_hidden"].shape[1]).astype(np.float32)
  safetensors_numpy.save_file({**weights, "block.mask_hidden": one}, path)
  json.dump({**meta, "format": "specdec_jax.block_drafter.v1"}, open(tmp_path / "block.json", "w"))
  calls = []
  read = eagle_files.read_block_drafter(path, _source(target, calls), name="v1 drafter", remedy="")
  np.testing.assert_array_equal(np.asarray(read.mask_hidden[...]), one[None, :])  # a shared hidden
  drafter.mask_hidden[...] = jnp.broadcast_to(jnp.asarray(one), drafter.mask_hidden.shape)  # every offset holds it
  seqs = jax.random.randint(jax.random.key(6), (2, 9), 0, V)
  feats = jax.random.normal(jax.random.key(7), (2, 8, head.config.feature_size))
  ends = jnp.asarray([[2, 5], [1, 4]], jnp.int32)
  np.testing.assert_allclose(
    np.asarray(read.block_logits(seqs[:, 1:], feats, ends, 4)),
    np.asarray(drafter.block_logits(seqs[:, 1:], feats, ends, 4)),
    rtol=1e-6,
    atol=1e-6,
  )
  # A shared drafter of this format round-trips as one.
  shared = BlockDrafter(head, block_size=4, rngs=nnx.Rngs(8), shared_placeholder=True)
  assert shared.mask_hidden.shape == (1, one.shape[0])
  eagle_files.save_block_drafter(shared, str(tmp_path / "shared.safetensors"), target="t", storage_dtype="float32")
  back = eagle_files.read_block_drafter(str(tmp_path / "shared.safetensors"), _source(target, []), name="s", remedy="")
  np.testing.assert_array_equal(np.asarray(back.mask_hidden[...]), np.asarray(shared.mask_hidden[...]))
  # The same [D] tensor in a v2 file is damaged: v2 holds one hidden per offset.
  json.dump({**meta}, open(tmp_path / "block.json", "w"))
  with pytest.raises(ValueError, match=r"block.mask_hidden \[\d+\], expected \[3, \d+\]"):
    eagle_files.read_block_drafter(path, _source(target, calls), name="v2 drafter", remedy="")
  json.dump({**meta, "block_size": 0}, open(tmp_path / "block.json", "w"))
  with pytest.raises(ValueError, match="block_size 0"):
    eagle_files.read_block_drafter(path, _source(target, calls), name="bad", remedy="")
  assert calls == [1, 1]  # the bad block_size was refused before the target was read


def test_the_coder_block_drafter_loader_names_the_missing_file_before_reading_the_target(tmp_path):
  from specdec_jax.models import load_qwen2_5_coder_block_drafter

  with pytest.raises(FileNotFoundError, match="Qwen2.5-Coder block drafter not found.*No block drafter ships"):
    load_qwen2_5_coder_block_drafter()
  with pytest.raises(FileNotFoundError, match="nope.safetensors.*save_block_drafter"):
    load_qwen2_5_coder_block_drafter(path=str(tmp_path / "nope.safetensors"))
