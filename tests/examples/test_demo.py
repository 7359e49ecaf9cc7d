"""Tests of examples/speculative_decode.py: flag checks before anything loads, and the report's formatting.

The flag tests call `main([...])` in-process with every loader replaced by one
that fails the test, so they prove the check happens before the model (or the
tokenizer, for the flags that do not need it) is loaded.
"""

import dataclasses
import importlib.util
import pathlib

import jax
import numpy as np
import pytest

_SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "speculative_decode.py"


@pytest.fixture(scope="module")
def demo():
  spec = importlib.util.spec_from_file_location("speculative_decode_demo", _SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _forbid(name):
  def loader(*args, **kwargs):
    raise AssertionError(f"{name} was called before the flags were checked")

  return loader


@pytest.fixture
def no_loading(demo, monkeypatch):
  """Every loader of the demo fails the test if called."""
  for name in ("load_smollm2", "load_smollm2_draft", "load_eagle_head", "smollm2_tokenizer", "load_qwen2_5_coder"):
    monkeypatch.setattr(demo, name, _forbid(name))
  return demo


def _error_line(capsys, demo, argv):
  with pytest.raises(SystemExit) as e:
    demo.main(argv)
  assert e.value.code == 2
  captured = capsys.readouterr()
  assert captured.out == ""
  lines = captured.err.splitlines()
  assert len(lines) == 1, captured.err
  assert lines[0].startswith("speculative_decode.py: error: ")
  return lines[0]


@pytest.mark.parametrize(
  "argv, flag",
  [
    (["--temperature", "-1"], "--temperature"),
    (["--temperature", "nan"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"),
    (["--top-k", "-5"], "--top-k"),
    (["-k", "0"], "--num-speculative-tokens"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--repeats", "0"], "--repeats"),
    (["--prompt", ""], "--prompt"),
    (["--prompt", "hi", "--prompt", "  "], "--prompt"),
    (["--seed", "-1"], "--seed"),
    (["--max-tokens", "9000"], "--max-tokens"),
    (["--drafter", "tree"], "--drafter"),
    (["--max-tokens", "many"], "--max-tokens"),
    (["--model", "llama"], "--model"),
    (["--model", "qwen2.5-coder-1.5b", "--drafter", "model"], "--drafter model"),
    (["--model", "qwen2.5-coder-1.5b", "--max-tokens", "40000"], "Qwen2.5-Coder-1.5B's context of 32768"),
  ],
)
def test_bad_flag_is_one_line_before_loading(no_loading, capsys, argv, flag):
  line = _error_line(capsys, no_loading, argv)
  assert flag in line


class _FakeTokenizer:
  """One token per character."""

  def encode(self, text):
    return type("Encoding", (), {"ids": list(range(len(text)))})()


def test_context_overflow_is_one_line_before_the_weights(no_loading, capsys, monkeypatch):
  demo = no_loading
  monkeypatch.setattr(demo, "smollm2_tokenizer", _FakeTokenizer)
  prompt = "x" * 8000
  line = _error_line(capsys, demo, ["--prompt", prompt, "--max-tokens", "200"])
  p = len(demo.chat_prompt(prompt))
  assert f"({p} tokens)" in line and f"{p + 200} tokens exceeds" in line and "8192" in line
  # The loops' rule, P + max_new_tokens <= max_length: exactly full passes the check (and then reaches the
  # forbidden weight loader); K+1 more slots are the cache's headroom, not context.
  room = demo.MAX_CONTEXT - p
  with pytest.raises(AssertionError, match="load_smollm2 was called"):
    demo.main(["--prompt", prompt, "--max-tokens", str(room)])


def test_coder_drafts_with_its_head_and_prompt_lookup(demo):
  ap = demo.build_parser()
  assert demo.parse_args(ap, ["--model", "qwen2.5-coder-1.5b"]).drafter == ("eagle", "lookup")
  assert demo.parse_args(ap, ["--model", "qwen2.5-coder-1.5b", "--drafter", "all"]).drafter == ("eagle", "lookup")
  assert demo.parse_args(ap, ["--model", "qwen2.5-coder-1.5b", "--drafter", "lookup"]).drafter == ("lookup",)


def test_a_gpu_demos_the_coder_in_bfloat16_and_a_cpu_smollm2_in_float32(demo, monkeypatch):
  ap = demo.build_parser()
  cpu = demo.parse_args(ap, [])
  assert (cpu.model, cpu.dtype) == ("smollm2", "float32")
  monkeypatch.setattr(demo.jax, "default_backend", lambda: "gpu")
  gpu = demo.parse_args(ap, [])
  assert (gpu.model, gpu.dtype, gpu.drafter) == ("qwen2.5-coder-1.5b", "bfloat16", ("eagle", "lookup"))
  assert demo.parse_args(ap, ["--model", "smollm2", "--dtype", "float32"]).model == "smollm2"


def test_drafter_choice(demo):
  ap = demo.build_parser()
  assert demo.parse_args(ap, []).drafter == demo.DEFAULT_DRAFTERS
  assert demo.parse_args(ap, ["--drafter", "all"]).drafter == ("eagle", "model", "lookup")
  assert demo.parse_args(ap, ["--drafter", "lookup", "--drafter", "model", "--drafter", "lookup"]).drafter == (
    "lookup",
    "model",
  )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _FakeStats:
  """The fields and properties of DecodeStats the demo prints."""

  target_calls: np.ndarray
  accepted: np.ndarray
  usable_drafted: np.ndarray
  accepted_per_position: np.ndarray
  reached_per_position: np.ndarray

  @property
  def mean_accepted_length(self):
    calls = np.sum(self.target_calls)
    return (np.sum(self.accepted) + calls) / max(calls, 1)

  @property
  def acceptance_per_position(self):
    reached = self.reached_per_position
    return np.where(reached > 0, self.accepted_per_position / np.maximum(reached, 1), 0.0)

  @property
  def usable_acceptance_rate(self):
    return np.sum(self.accepted) / max(np.sum(self.usable_drafted), 1)


def test_acceptance_is_summed_over_runs_then_formatted(demo):
  # Run 1: 3 calls, 5 accepted (positions 0,0,1,1,2 reached 3,2,1,...); run 2: 2 calls, nothing accepted.
  a = _FakeStats(np.array([3]), np.array([5]), np.array([8]), np.array([2, 2, 1, 0]), np.array([3, 2, 2, 1]))
  b = _FakeStats(np.array([2]), np.array([0]), np.array([4]), np.array([0, 0, 0, 0]), np.array([1, 0, 0, 0]))
  total = demo.sum_stats([a, b])
  np.testing.assert_array_equal(total.reached_per_position, [4, 2, 2, 1])
  line = demo.format_acceptance(total)
  # (5 + 5 calls) / 5 calls; positions: 2/4, 2/2, 1/2, 0/1; 5 of 12 usable drafts.
  assert "mean accepted length 2.00" in line
  assert "acceptance by draft position [0.50 1.00 0.50 0.00]" in line
  assert "usable drafts accepted 0.42" in line
  # A position no round reached shows as "-", not as 0.
  c = dataclasses.replace(a, reached_per_position=np.array([3, 2, 0, 0]), accepted_per_position=np.array([2, 1, 0, 0]))
  assert "[0.67 0.50   -    - ]" in demo.format_acceptance(c)


@dataclasses.dataclass
class _FakeOut:
  lengths: np.ndarray
  tokens: np.ndarray = None
  stats: object = None


def test_rates_are_medians_over_repeats_and_speedups_use_medians(demo, capsys):
  runs = {
    "plain generate": [(_FakeOut(np.array([10])), [1.0, 2.0, 5.0]), (_FakeOut(np.array([30])), [1.0, 1.0, 1.0])],
  }
  n, rs = demo.rates(runs["plain generate"], [0, 1])
  assert n == 40 and rs == [20.0, 40 / 3, 40 / 6]
  assert "10 tokens     5.0 tokens/s (2.0-10.0)" in demo.format_rate(*demo.rates(runs["plain generate"], [0]))


def test_one_prompt_has_no_all_prompts_block(demo, monkeypatch, capsys):
  """With one prompt only its own block is printed (main, with the model parts faked)."""
  stats = _FakeStats(np.array([2]), np.array([2]), np.array([4]), np.array([1, 1]), np.array([2, 1]))
  out = _FakeOut(np.array([4]), np.array([[5, 6, 7, 8]]), stats)
  monkeypatch.setattr(demo, "smollm2_tokenizer", _FakeTokenizer)
  monkeypatch.setattr(demo, "load_smollm2", lambda dtype, kernels: (object(), None))
  monkeypatch.setattr(demo, "load_drafters", lambda names, dtype, kernels, model: {"prompt lookup": object()})
  monkeypatch.setattr(demo, "measure_costs", lambda target, drafters, k, s: (0.01, 1.5, {}))
  monkeypatch.setattr(demo, "run_all", lambda methods, *a: {m: [(out, [1.0, 1.0, 1.0])] for m in methods})
  monkeypatch.setattr(demo, "decoded_text", lambda *a: "some text")
  demo.main(["--prompt", "Hi", "--drafter", "lookup", "-k", "2"])
  printed = capsys.readouterr().out
  assert "[prompt 0: Hi]" in printed and "all 1 prompts" not in printed and printed.count("  [") == 1
  assert "costs 1.50 steps on this cpu" in printed
  assert "JAX platform" in printed and "CPU cores" in printed


@pytest.mark.parametrize(
  "plain, drafter, word",
  [
    ([10.0, 11.0, 12.0], [13.0, 14.0, 15.0], "faster than plain decoding"),  # 13 / 12 > 1
    ([10.0, 11.0, 12.0], [7.0, 8.0, 9.9], "slower than plain decoding"),  # 9.9 / 10 < 1
    ([10.0, 11.0, 12.0], [11.5, 13.0, 14.0], "within this machine's run-to-run noise"),  # 11.5 / 12 < 1 < 14 / 10
    ([10.0, 10.0], [10.0, 10.0], "within this machine's run-to-run noise"),  # exactly 1 is not faster
    ([10.0], [20.0], "no verdict"),  # one repeat: no noise measured
  ],
)
def test_speed_verdict_rule(demo, plain, drafter, word):
  verdict = demo.speed_verdict(plain, drafter)
  assert verdict.startswith(word), verdict
  if len(plain) > 1:
    assert f"between {min(drafter) / max(plain):.2f}x and {max(drafter) / min(plain):.2f}x" in verdict


def _fake_main(demo, monkeypatch, argv, drafter_seconds):
  """main() on one prompt with the model parts faked: plain takes 1 s per run, the drafter `drafter_seconds`."""
  stats = _FakeStats(np.array([2]), np.array([2]), np.array([4]), np.array([1, 1]), np.array([2, 1]))
  out = _FakeOut(np.array([4]), np.array([[5, 6, 7, 8]]), stats)
  monkeypatch.setattr(demo, "smollm2_tokenizer", _FakeTokenizer)
  monkeypatch.setattr(demo, "load_smollm2", lambda dtype, kernels: (object(), None))
  monkeypatch.setattr(demo, "load_drafters", lambda names, dtype, kernels, model: {"prompt lookup": object()})
  monkeypatch.setattr(demo, "measure_costs", lambda target, drafters, k, s: (0.01, 1.5, {}))
  monkeypatch.setattr(
    demo,
    "run_all",
    lambda methods, *a: {m: [(out, [1.0, 1.1, 0.9] if m == "plain generate" else drafter_seconds)] for m in methods},
  )
  monkeypatch.setattr(demo, "decoded_text", lambda *a: "some text")
  demo.main(["--prompt", "Hi", "--drafter", "lookup", "-k", "2", *argv])


def test_report_gives_a_verdict_per_drafter(demo, monkeypatch, capsys):
  _fake_main(demo, monkeypatch, [], [0.5, 0.55, 0.6])  # twice as fast, far beyond the repeats' spread
  printed = capsys.readouterr().out
  assert "verdict: faster than plain decoding" in printed
  assert "prompt lookup: prompt 0: faster than plain decoding" in printed
  assert "verdict: from the repeats" in printed  # the rule is printed with the summary
  assert "differs by design" not in printed  # greedy: outputs are compared instead
  _fake_main(demo, monkeypatch, [], [1.0, 0.95, 1.05])
  assert "verdict: within this machine's run-to-run noise" in capsys.readouterr().out


def test_sampled_run_says_outputs_differ_by_design(demo, monkeypatch, capsys):
  _fake_main(demo, monkeypatch, ["--temperature", "0.8"], [2.0, 2.1, 2.2])
  printed = capsys.readouterr().out
  assert "differ from plain decoding's by design" in printed and "correct sample" in printed
  assert "output: another sample (differs by design)" in printed and "identical" not in printed
  assert "verdict: slower than plain decoding" in printed


@pytest.mark.real_model
def test_context_check_with_the_real_tokenizer(demo, monkeypatch, capsys):
  """The SmolLM2 tokenizer (GGUF metadata only) measures the prompt; the weights are never loaded."""
  pytest.importorskip("tokenizers")
  for name in ("load_smollm2", "load_smollm2_draft", "load_eagle_head"):
    monkeypatch.setattr(demo, name, _forbid(name))
  line = _error_line(capsys, demo, ["--prompt", "hello world " * 5000, "--max-tokens", "100"])
  assert "exceeds SmolLM2's context of 8192" in line


def test_run_all_round_robin_and_compiles_first(demo):
  """Every method compiles (one untimed call) before any timed run; timed runs alternate methods."""
  calls = []

  def method(label):
    return lambda x, n, key: calls.append((label, int(x[0, 0]))) or _FakeOut(np.array([1]))

  methods = {"a": method("a"), "b": method("b")}
  bar = type("Bar", (), {"update": lambda self, n: None})()
  runs = demo.run_all(methods, np.array([[7], [8]]), np.array([1, 1]), jax.random.key(0), 2, bar)
  assert calls == [("a", 7), ("b", 7)] + [("a", 7), ("a", 8), ("b", 7), ("b", 8)] * 2
  assert [len(s) for _, s in runs["a"]] == [2, 2]


def test_explain_predicts_speedup_from_measured_costs(demo):
  stats = _FakeStats(np.array([4]), np.array([8]), np.array([16]), np.array([4, 2, 1, 1]), np.array([4, 4, 2, 1]))
  runs = {
    "plain generate": [(_FakeOut(np.array([12])), [1.0, 1.0, 1.0])],
    "draft model": [(_FakeOut(np.array([12]), stats=stats), [0.5, 0.4, 0.6])],
    "prompt lookup": [(_FakeOut(np.array([12]), stats=stats), [1.0, 1.0, 1.0])],
  }
  text = "\n".join(demo.explain(0.05, 1.2, {"draft model": 0.2}, 4, runs, ["chat"]))
  assert "one target step 50.0 ms" in text and "costs 1.20 steps" in text
  # mean accepted length (8 + 4) / 4 = 3; round: 1.2 + 4 x 0.2 = 2.0 steps; measured: median rate 24 vs 12.
  assert "draft model     chat       3.00 / 2.00 -> expected 1.50x, measured 2.00x" in text
  assert "prompt lookup   chat       3.00 / 1.20 -> expected 2.50x, measured 1.00x" in text


@pytest.mark.real_model
@pytest.mark.slow  # 10 s: times the real model; the cost formula is tested on fakes above
def test_costs_on_smollm2(demo):
  """Smoke test: the measurement runs on SmolLM2 and its draft (timings are too load-dependent to assert ratios)."""
  import jax.numpy as jnp

  target, _ = demo.load_smollm2(jnp.float32)
  drafters = {"draft model": demo.load_smollm2_draft(jnp.float32), "prompt lookup": demo.PromptLookupDrafter()}
  step_s, verify_cost, draft_cost = demo.measure_costs(target, drafters, 4, 64, repeats=3, calls=2)
  assert step_s > 0 and verify_cost > 0 and list(draft_cost) == ["draft model"] and draft_cost["draft model"] > 0


@pytest.mark.real_model
def test_max_context_is_smollm2s(demo):
  """The demo's context limit (needed before the weights load) is the one the GGUF declares."""
  from specdec_jax.models.loaders.smollm2 import smollm2_config

  assert demo.MAX_CONTEXT == smollm2_config().max_length
