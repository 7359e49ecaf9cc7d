"""Tests of the models and loops on a device mesh (specdec_jax/models/sharding.py, specdec_jax/mesh.py).

The checks that need many devices, `tests/support/mesh_worker.py`, run in ONE subprocess
with the samplers' (tests/support/eight_devices.py, started once by tests/conftest.py), with 8 fake CPU devices (`--xla_force_host_platform_device_count=8`,
appended to any XLA_FLAGS): the device count is fixed when JAX starts, and
this process has one device. Each check of the worker becomes one test here,
so a failure names what broke. About 35 s on 2 cores (most of it compiling
the loops for one device and two meshes).

The rest runs in this process: argument checks, the splitting rules, and the
example's flag checks (which fail before any weights load).
"""

from __future__ import annotations

import importlib.util
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax.models import Partitioning, make_mesh, shard
from specdec_jax.models.sharding import relayout
from tests.support.eight_devices import check_result

ROOT = pathlib.Path(__file__).resolve().parents[2]
EIGHT_DEVICE_WORKER = "models"  # tests/support/mesh_worker.py, run by tests/conftest.py's session fixtures

LOOP_RUNS = (
  "generate greedy",
  "generate sampled",
  "speculative greedy, draft model",
  "speculative greedy, prompt lookup",
  "speculative greedy, EAGLE",
  "speculative sampled, draft model",
)
FAST_RUNS = ("generate sampled", "speculative greedy, EAGLE", "speculative sampled, draft model")
# CI runs the worker's fast part (every logits check, one loop of each kind on 2x4); `-m slow` adds the
# other loops on 2x4 and the fast ones on a 1x8 mesh with Explicit axes (about 30 s more on 2 cores).
CHECKS = (
  [f"logits {d}x{m}" for d, m in ((1, 8), (2, 4), (4, 2), (8, 1))]
  + ["logits 2x4 scan_layers", "logits qkv_bias"]
  + [f"loops 2x4: {run}" for run in FAST_RUNS]
  + ["loops 8x1: generate sampled", "8x1: each device decodes its rows, no collective while decoding"]
  + ["2x1: generate inside a caller's shard_map", "2x1: each device's rows take the Pallas blocks"]
  + ["1x1 mesh compiles today's program"]
  + ["embedding lookup: a psum, not a table all-gather", "embedding lookup: bits equal one device's"]
)
MORE_CHECKS = (
  [f"loops 2x4 more: {run}" for run in LOOP_RUNS if run not in FAST_RUNS]
  + [f"loops 1x8 Explicit: {run}" for run in FAST_RUNS]
  + [f"loops 8x1 more: {run}" for run in FAST_RUNS if run != "generate sampled"]
  + ["loops 8x1 Explicit: speculative sampled, draft model"]
  + ["logits qkv_bias scan, 1x8"]
)


@pytest.fixture(scope="module")
def worker_results(eight_device_results) -> dict:
  return eight_device_results[EIGHT_DEVICE_WORKER]


@pytest.fixture(scope="module")
def more_results(eight_device_more_results) -> dict:
  return eight_device_more_results[EIGHT_DEVICE_WORKER]


@pytest.mark.parametrize("name", CHECKS)
def test_on_eight_devices_equals_one_device(worker_results, name):
  check_result(worker_results, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", MORE_CHECKS)
def test_on_eight_devices_more_loops(more_results, name):
  check_result(more_results, name)


def test_worker_runs_no_unlisted_check(worker_results):
  assert set(worker_results) <= set(CHECKS) | {name.split(": ")[0] for name in CHECKS}, sorted(worker_results)


# ----------------------------------------------------------------------------
# One device
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
  "m, expected",
  [
    (1, (False, False, False)),
    (2, (False, True, True)),  # SmolLM2: 9 query / 3 KV heads never divide by 2, 4, 8
    (4, (False, True, True)),
    (8, (False, True, True)),
  ],
)
def test_smollm2_splits_mlp_and_vocabulary_but_not_its_heads(m, expected):
  part = Partitioning.for_shapes(model_size=m, num_heads=9, num_kv_heads=3, d_ff=1536, vocab_size=49152)
  assert (part.heads, part.mlp, part.vocab) == expected


def test_heads_split_only_when_query_and_kv_heads_divide():
  split = Partitioning.for_shapes(model_size=4, num_heads=8, num_kv_heads=4, d_ff=64, vocab_size=64)
  whole = Partitioning.for_shapes(model_size=8, num_heads=8, num_kv_heads=4, d_ff=64, vocab_size=64)
  assert split.heads and split.param_spec("wk") == (None, "model") and split.cache_spec()[2] == "model"
  assert not whole.heads and whole.param_spec("wo") == (None, None) and whole.cache_spec()[2] is None
  assert whole.param_spec("attn_norm") == ()  # norms are never split


def test_q_k_v_biases_split_like_their_projections_columns():
  split = Partitioning.for_shapes(model_size=4, num_heads=8, num_kv_heads=4, d_ff=64, vocab_size=64)
  whole = Partitioning.for_shapes(model_size=8, num_heads=8, num_kv_heads=4, d_ff=64, vocab_size=64)
  for name in ("bq", "bk", "bv"):
    assert split.param_spec(name) == ("model",) and split.param_spec(f"w{name[1]}")[-1] == "model"
    assert whole.param_spec(name) == (None,)
  assert split.param_spec("bqkv") == whole.param_spec("bqkv") == ()  # fused only where heads are whole: replicated


@pytest.mark.parametrize("biases", [False, True])
def test_relayout_splits_and_fuses_exactly(biases):
  rng = np.random.default_rng(0)
  shapes = [("wqkv", (2, 8, 6 + 2 * 3)), ("w_gate_up", (2, 8, 2 * 5)), ("wo", (2, 6, 8))]
  shapes += [("bqkv", (2, 6 + 2 * 3))] if biases else []
  fused = {name: rng.normal(size=shape).astype(np.float32) for name, shape in shapes}
  kw = {"q_width": 6, "kv_width": 3, "d_ff": 5}
  separate = relayout(fused, fuse_attention=False, fuse_mlp=False, **kw)
  assert set(separate) == {"wq", "wk", "wv", "wo", "w_gate", "w_up"} | ({"bq", "bk", "bv"} if biases else set())
  np.testing.assert_array_equal(separate["wk"], fused["wqkv"][..., 6:9])
  if biases:
    np.testing.assert_array_equal(separate["bk"], fused["bqkv"][..., 6:9])
    assert relayout(fused, fuse_attention=True, fuse_mlp=False, **kw)["bqkv"] is fused["bqkv"]
  back = relayout(separate, fuse_attention=True, fuse_mlp=True, **kw)
  assert sorted(back) == sorted(fused)
  for name, value in fused.items():
    np.testing.assert_array_equal(back[name], value)


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_one_device_mesh_keeps_the_layout_and_the_logits(qkv_bias):
  from flax import nnx

  from specdec_jax.models import Transformer, TransformerConfig

  model = Transformer(TransformerConfig.tiny(64, qkv_bias=qkv_bias), rngs=nnx.Rngs(0))
  mesh = make_mesh(1, 1)
  sharded = shard(model, mesh)
  assert sharded.partitioning == Partitioning(model_size=1, heads=False, mlp=False, vocab=False)
  assert model.partitioning is None  # the input model is not modified
  assert sharded.layers.block0.names == model.layers.block0.names  # fused projections stay fused
  tokens = jnp.asarray([[1, 2, 3, 4]], jnp.int32)
  positions = jnp.arange(4, dtype=jnp.int32)[None]
  expected, _ = model(tokens, positions, model.init_cache(1, 8))
  with jax.set_mesh(mesh):
    logits, _ = sharded(tokens, positions, sharded.init_cache(1, 8))
  np.testing.assert_array_equal(logits, expected)


@pytest.mark.parametrize(
  "mesh, match",
  [
    ("not a mesh", "mesh must be a jax.sharding.Mesh"),
    (lambda: jax.make_mesh((1, 1), ("batch", "tp")), r"axis names must be among \('data', 'model'\)"),
  ],
)
def test_shard_rejects_a_bad_mesh(mesh, match):
  from flax import nnx

  from specdec_jax.models import Transformer, TransformerConfig

  model = Transformer(TransformerConfig.tiny(64), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=match):
    shard(model, mesh() if callable(mesh) else mesh)


def test_shard_rejects_a_model_it_does_not_know():
  with pytest.raises(ValueError, match="Transformer or EagleDrafter"):
    shard(object(), make_mesh(1, 1))


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"data": 0}, "data must be a positive int"),
    ({"model": 2.0}, "model must be a positive int"),
    ({"data": 4, "model": 4}, "needs 16 devices.*xla_force_host_platform_device_count"),
  ],
)
def test_make_mesh_rejects_bad_sizes(kwargs, match):
  with pytest.raises(ValueError, match=match):
    make_mesh(**kwargs)


# ----------------------------------------------------------------------------
# examples/sharded_decode.py: flags are checked before anything loads
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo():
  spec = importlib.util.spec_from_file_location("sharded_decode_demo", ROOT / "examples" / "sharded_decode.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--data", "2", "--model", "4"], "8 devices, but JAX sees 1.*xla_force_host_platform_device_count"),
    (["--model", "0"], "--model must be >= 1"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--temperature", "-1"], "--temperature"),
    (["--prompt", " "], "--prompt must not be empty"),
    (["--drafter", "tree"], "--drafter"),
  ],
)
def test_demo_bad_flag_is_one_line_before_loading(demo, monkeypatch, capsys, argv, message):
  def forbidden(*args, **kwargs):
    raise AssertionError("loaded before the flags were checked")

  for name in ("load_smollm2", "load_smollm2_eagle", "smollm2_tokenizer"):
    monkeypatch.setattr(demo, name, forbidden)
  with pytest.raises(SystemExit) as e:
    demo.main(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("sharded_decode.py: error: "), err
  assert re.search(message, err[0]), err[0]
