"""Tests of the samplers on a device mesh: `rejection_sample` and `sample_tokens` split over the vocabulary.

The checks, `tests/support/mesh_sampler_worker.py` (its docstring lists them), run in
one subprocess with the models' (tests/support/eight_devices.py, started once by
tests/conftest.py; a second one runs the checks on the meshes 4x2 and 8x1 under
the slow mark), with 8 fake CPU devices
(`--xla_force_host_platform_device_count=8`, appended to any XLA_FLAGS): the
device count is fixed when JAX starts, and this process has one device. Each
check of the worker becomes one test here, so a failure names what broke, and
no check may run that this file does not list. Each compares a mesh run with
the same call on one device (same key): tokens bit for bit, log-probabilities
to 1e-5; planted bugs must be caught; the compiled sharded programs must move
no vocabulary-sized array between devices, and the all_greedy program must
hold no exponential and no random numbers.

The worker's time is mostly compiling (about 40 programs, 1 to 4 s each on 2
cores). The parser of collectives is also tested here, on hand-written HLO.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import jax
import pytest

from specdec_jax.sampling import vocab_parallel
from specdec_jax.sampling.reductions import chunk_size
from tests.support.eight_devices import check_result

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "support" / "mesh_sampler_worker.py"
EIGHT_DEVICE_WORKER = "samplers"  # run by tests/conftest.py's session fixtures

# The worker's tables (tests/support/mesh_sampler_worker.py), written out: a check the worker
# runs must be listed here, and each listed check must have run.
MESHES = ("1x8", "2x4", "4x2", "8x1")
REJECTION = {  # program -> data sets
  "greedy flag": ("greedy",),
  "token, n-gram, logprobs=processed": ("mixed", "random", "greedy rows", "filtered"),
  "token, draft probs": ("mixed", "random", "greedy rows", "filtered"),
  "block, n-gram, min_p field": ("mixed", "min-p", "min-p + top-k"),
  "block, draft probs, logprobs=raw": ("mixed", "random", "filtered"),
  "token, draft probs, no_filters": ("mixed",),
  "token, draft probs, token_bitmask": ("mixed",),
}
FILTERED, FILTERED_MESHES = ("filtered", "min-p", "min-p + top-k"), ("1x8", "2x4")
ON_8X1 = ("greedy flag", "token, n-gram, logprobs=processed", "token, draft probs")
SAMPLE = {
  "sample_tokens greedy flag": ("greedy",),
  "sample_tokens": ("mixed", "filtered"),
  "sample_tokens no_filters": ("mixed",),
}

CHECKS = (
  ["vocabulary sizes"]
  + [
    f"{mesh} {program}: {data}"
    for mesh in MESHES
    for program, sets in REJECTION.items()
    for data in sets
    if (mesh != "8x1" or program in ON_8X1) and (data not in FILTERED or mesh in FILTERED_MESHES)
  ]
  + [f"{mesh} {program}: {data}" for mesh in ("1x8", "2x4") for program, sets in SAMPLE.items() for data in sets]
  + [
    "V=3000 2x4 (sharded) token, draft probs: mixed",
    "V=3000 2x4 (sharded) token, draft probs: filtered",
    "V=3000 1x8 (fallback: not whole chunks) token, draft probs: mixed",
  ]
  + ["explicit 2x4 token, draft probs: mixed", "explicit 2x4 greedy flag: greedy"]
  + [
    "teeth: rolled draft_probs change the outputs",
    "teeth: another key changes the outputs",
    "teeth: dropping any one vocabulary slice changes the outputs (draft probs)",
    "teeth: dropping any one vocabulary slice changes the outputs (greedy flag)",
    "teeth: doubling any one slice's mass moves the logprobs",
    "teeth: doubling any one slice's mass moves sample_tokens' log_probs",
  ]
  + [
    f"HLO {mesh} {what}"
    for mesh in ("2x4", "1x8")
    for what in (
      "token, draft probs: no collective carries the vocabulary",
      "greedy flag: no collective carries the vocabulary",
      "greedy flag: no exponential, no RNG",
    )
  ]
  + ["HLO one device: no collective", "HLO one device greedy flag: no exponential, no RNG"]
  + [
    "split threshold search: every stage exact, each needed",
    "split threshold search, Pallas read: every stage exact, each needed",
    "split threshold search, Pallas read: mixed rows equal one device",
  ]
)


# rejection_sample on the meshes 4x2 and 8x1, and on 1x8 all but the greedy flag, runs under the slow mark
# (CI's budget): 2x4 already splits the vocabulary over 4 devices and the rows over 2 for every program, and 1x8
# the vocabulary over 8 for the greedy flag, sample_tokens and the HLO checks.
MORE_MESHES = ("4x2", "8x1")


def _in_more_meshes_part(check: str) -> bool:
  mesh, program = check.split(" ", 1)
  rejection = program.split(":")[0] in REJECTION
  return rejection and (mesh in MORE_MESHES or (mesh == "1x8" and not program.startswith("greedy flag")))


FAST = [c for c in CHECKS if not _in_more_meshes_part(c)]
SLOW = [c for c in CHECKS if _in_more_meshes_part(c)]


@pytest.fixture(scope="module")
def worker_results(eight_device_results) -> dict:
  return eight_device_results[EIGHT_DEVICE_WORKER]


@pytest.fixture(scope="module")
def more_mesh_results(eight_device_more_results) -> dict:
  return eight_device_more_results[EIGHT_DEVICE_WORKER]


@pytest.mark.parametrize("name", FAST)
def test_on_eight_devices(worker_results, name):
  check_result(worker_results, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_on_eight_devices_more_meshes(more_mesh_results, name):
  check_result(more_mesh_results, name)


def test_worker_runs_no_unlisted_check(worker_results):
  assert set(worker_results) <= set(FAST), sorted(set(worker_results) - set(FAST))


@pytest.mark.slow
def test_more_meshes_part_runs_no_unlisted_check(more_mesh_results):
  assert set(more_mesh_results) <= set(SLOW), sorted(set(more_mesh_results) - set(SLOW))


# ----------------------------------------------------------------------------
# The HLO parser, on hand-written text (this process)
# ----------------------------------------------------------------------------

HLO = """\
HloModule jit_f, entry_computation_layout={(f32[8,4,64]{2,1,0})->f32[8,4,512]{2,1,0}}

%fused_exp (param_0: f32[8,4,64]) -> f32[8,4,64] {
  %param_0 = f32[8,4,64]{2,1,0} parameter(0)
  ROOT %exp.1 = f32[8,4,64]{2,1,0} exponential(%param_0), metadata={op_name="jit(f)/all-gather" source_file="x.py"}
}

ENTRY %main.9 (a: f32[8,4,64]) -> f32[8,4,512] {
  %a = f32[8,4,64]{2,1,0} parameter(0)
  %all-gather.1 = f32[8,4,512]{2,1,0} all-gather(%a), channel_id=1, replica_groups=[1,8]<=[8], dimensions={2}
  %all-reduce.2 = (f32[8,5,32]{2,1,0}, s32[8,5,32]{2,1,0}) all-reduce(%a, %a), channel_id=2, to_apply=%max
  %all-gather-start.3 = ((f32[4,4,8]{2,1,0}), f32[4,4,64]{2,1,0}) all-gather-start(%a), channel_id=3, dimensions={2}
  %all-gather-done.4 = f32[4,4,64]{2,1,0} all-gather-done(%all-gather-start.3)
  %collective-permute.5 = u32[2]{0} collective-permute(%a), channel_id=4, source_target_pairs={{0,1},{1,0}}
  %fusion.6 = f32[8,4,64]{2,1,0} fusion(%a), kind=kLoop, calls=%fused_exp, metadata={op_name="jit(f)/all-reduce"}
  %rng.7 = (u64[2]{0}, u32[8]{0}) rng-bit-generator(%s), algorithm=rng_default
  %all-reduce.9 = (f32[8]{0}, f32[8]{0}, f32[8]{0}, f32[8]{0}, f32[8]{0}, /*index=5*/f32[8,65536]{1,0}) all-reduce(%a)
  ROOT %all-reduce-start.8 = f32[] all-reduce-start(%x), channel_id=5, to_apply=%add
}
"""


@pytest.fixture(scope="module")
def worker_module():
  spec = importlib.util.spec_from_file_location("mesh_sampler_worker", WORKER)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # its dataclasses look their module up
  spec.loader.exec_module(module)
  return module


def test_collectives_reads_plain_tuple_and_async_results(worker_module):
  found = worker_module.collectives(HLO)
  assert [(op, arrays) for op, _, arrays in found] == [
    ("all-gather", ((8, 4, 512),)),
    ("all-reduce", ((8, 5, 32), (8, 5, 32))),
    ("all-gather-start", ((4, 4, 8), (4, 4, 64))),
    ("all-gather-done", ((4, 4, 64),)),
    ("collective-permute", ((2,),)),
    ("all-reduce", ((8,),) * 5 + ((8, 65536),)),  # a long tuple: XLA's /*index=5*/ comment is skipped
    ("all-reduce-start", ((),)),
  ]  # the fusion and the exponential, whose metadata names collectives, are not collectives


def test_random_or_exp_finds_exponentials_and_rng(worker_module):
  assert worker_module.random_or_exp(HLO) == ["exponential", "rng-bit-generator"]
  assert worker_module.random_or_exp(HLO.replace("rng_default", "threefry")) == [
    "exponential",
    "rng-bit-generator",
    "threefry",
  ]
  plain = "\n".join(line for line in HLO.splitlines() if "exponential" not in line and "rng" not in line)
  assert worker_module.random_or_exp(plain) == []
  assert "parameter" in worker_module.opcodes(plain) and "all-gather" in worker_module.opcodes(plain)


# ----------------------------------------------------------------------------
# Which calls take the split path (this process: an abstract mesh is enough)
# ----------------------------------------------------------------------------


def _on(data, model):
  mesh = jax.sharding.AbstractMesh((data, model), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  return jax.sharding.use_abstract_mesh(mesh)


@pytest.mark.parametrize(
  "vocab, model", [(151936, 2), (151936, 4), (151936, 8), (32000, 2), (32000, 4), (32000, 8), (49152, 16)]
)
def test_real_vocabularies_split_into_whole_chunks(vocab, model):
  with _on(1, model):
    shards = vocab_parallel.shards_for(vocab, 8)
  assert shards == vocab_parallel.VocabShards(axis="model", size=model, vocab=vocab, row_axes=())
  assert (vocab // model) % chunk_size(vocab) == 0


def test_split_path_needs_a_model_axis_and_whole_chunks():
  assert vocab_parallel.shards_for(151936, 8) is None  # no mesh
  with _on(8, 1):
    assert vocab_parallel.shards_for(151936, 8) is None  # the vocabulary is not split
  with _on(1, 4):
    assert vocab_parallel.shards_for(151937, 8) is None  # V % m != 0
    assert vocab_parallel.shards_for(4 * 60, 8) is None  # 60 tokens a device, chunks of chunk_size(240) do not fit
  assert 60 % chunk_size(240) != 0


def test_a_token_bitmask_splits_only_where_each_slice_starts_at_a_word():
  """With a token_bitmask the words split with their tokens: V/m must be a multiple of 32 too."""
  with _on(1, 4):
    assert vocab_parallel.shards_for(151936, 8, word_aligned=True) is not None  # 37984 = 32 * 1187 a device
    assert vocab_parallel.shards_for(4 * 1000, 8) is not None  # 1000 tokens a device: whole chunks
    assert vocab_parallel.shards_for(4 * 1000, 8, word_aligned=True) is None  # but 1000 % 32 != 0


def test_rows_split_over_data_only_when_it_divides_the_batch():
  with _on(2, 4):
    assert vocab_parallel.shards_for(32000, 8).row_axes == ("data",)
    assert vocab_parallel.shards_for(32000, 3).row_axes == ()


def test_the_split_search_reads_slices_in_pallas_on_a_gpu_under_auto(monkeypatch):
  """`kernels` picks how the top-k/top-p search reads each slice: the Pallas kernel on a GPU under "auto"."""
  with _on(1, 2):
    assert vocab_parallel.shards_for(151936, 8).search == "xla"  # the default: kernels="xla"
    assert vocab_parallel.shards_for(151936, 8, kernels="auto").search == "xla"  # this process: a CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert vocab_parallel.shards_for(151936, 8, kernels="auto").search == "pallas"
    assert vocab_parallel.shards_for(151936, 8, kernels="xla").search == "xla"
