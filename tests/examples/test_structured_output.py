"""Tests of examples/structured_output.py: flag checks before anything loads, the schema check, and (slow) a run.

The run is the example's own claim on SmolLM2: every constrained output parses and follows the schema, and
greedy constrained speculative decoding emits exactly constrained plain decoding's tokens (it exits non-zero
otherwise).
"""

import importlib.util
import json
import pathlib

import pytest

_SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "structured_output.py"


@pytest.fixture(scope="module")
def demo():
  spec = importlib.util.spec_from_file_location("structured_output_demo", _SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize(
  "argv, flag",
  [
    (["--drafter", "lookup,tree"], "--drafter"),
    (["-k", "0"], "-k"),
    (["--max-tokens", "4"], "--max-tokens"),
    (["--repeats", "0"], "--repeats"),
    (["--model", "llama"], "--model"),
    (["--whitespace", "tabs"], "--whitespace"),
  ],
)
def test_bad_flag_is_one_line_before_loading(demo, monkeypatch, capsys, argv, flag):
  def forbidden(*args, **kwargs):
    raise AssertionError("loaded before the flags were checked")

  monkeypatch.setattr(demo, "load", forbidden)
  with pytest.raises(SystemExit) as e:
    demo.main(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert flag in err[-1] and len([line for line in err if "error" in line]) == 1


def test_the_schema_check_takes_valid_objects_and_refuses_the_rest(demo):
  good = {"name": "Go", "first_release_year": 2009, "statically_typed": True, "paradigms": ["concurrent"]}
  assert demo.follows_schema(json.dumps(good))
  bad = [
    "not json",
    json.dumps([good]),
    json.dumps({k: v for k, v in good.items() if k != "paradigms"}),  # a required field missing
    json.dumps(dict(good, extra=1)),
    json.dumps(dict(good, first_release_year=True)),  # a bool is not an integer
    json.dumps(dict(good, first_release_year=2009.5)),
    json.dumps(dict(good, statically_typed="yes")),
    json.dumps(dict(good, paradigms=["logic"])),  # outside the enum
    json.dumps(dict(good, paradigms=["functional"] * 4)),  # over maxItems
    json.dumps(dict(good, name=3)),
  ]
  assert not any(demo.follows_schema(text) for text in bad)


@pytest.mark.slow
@pytest.mark.real_model
def test_the_example_runs_on_smollm2_valid_and_identical(demo, capsys):
  pytest.importorskip("outlines_core")
  demo.main(["--model", "smollm2", "--dtype", "float32", "--repeats", "1"])  # pretty JSON, up to 96 tokens
  out = capsys.readouterr().out
  rows = [line.split() for line in out.splitlines() if line.strip().startswith(("plain", "prompt", "EAGLE"))]
  constrained = [r for r in rows if "grammar" not in r]
  assert len(constrained) == 3 and all("3/3" in r for r in constrained)
  assert sum(r[-1] == "yes" for r in constrained) == 2


@pytest.mark.parametrize(
  "argv, flag",
  [
    (["--batch-sizes", "1,9"], "--batch-sizes"),
    (["--batch-sizes", "x"], "--batch-sizes"),
    (["--drafters", "eagle,tree"], "--drafters"),
    (["--prompts-b1", "0"], "--prompts-b1"),
    (["--max-new-tokens", "8"], "--max-new-tokens"),
    (["--whitespace", "compact,tabs"], "--whitespace"),
    (["--cost-steps", "8"], "--cost-steps"),
    (["--cost-steps", "24,8"], "--cost-steps"),
  ],
)
def test_the_bench_refuses_bad_flags_in_one_line(capsys, argv, flag):
  spec = importlib.util.spec_from_file_location("structured_bench", _SCRIPT.parents[1] / "bench" / "structured.py")
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  with pytest.raises(SystemExit) as e:
    bench.parse_args([*argv, "--out", "/nonexistent"])
  assert e.value.code == 2 and flag in capsys.readouterr().err.strip().splitlines()[-1]
