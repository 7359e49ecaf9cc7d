"""Shared pytest configuration.

Strict rank promotion, as in equinox's tests/conftest.py: an implicit broadcast
between arrays of different ranks (e.g. [B] against [B, V]) raises instead of
silently lining up the wrong axes. Library code must broadcast explicitly
(`x[:, None]`, reshape). float64 stays off: the library computes in float32 and
the tests check it there.
"""

import os
import pathlib
import shutil
import tempfile
import time

# The suite's time is mostly XLA compiling small programs on the CPU: LLVM at level 0 compiles them
# 16-24% faster in all (measured on 2 cores), skipping LLVM's expensive passes 3-10% more, and XLA:CPU's
# older elemental emitters instead of its fusion emitters about 20% more (tests/models/test_eagle.py: 88 -> 69 s),
# all with the same float semantics (no fast-math either way, so no reassociated sums).
# Read when JAX starts its backend, which no import below does; the subprocess tests inherit it.
for _flag in (
  "--xla_backend_optimization_level=0",
  "--xla_llvm_disable_expensive_passes=true",
  "--xla_cpu_use_fusion_emitters=false",
):
  if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_enable_x64", False)


@pytest.fixture(scope="session")
def tree_models():
  """(target, draft model, untrained EAGLE drafter, distilled EAGLE drafter): tests/support/tiny_transformers.py."""
  from tests.support.tiny_transformers import build_models

  return build_models()


_SHARED_DIR = None
_FAST_PARTS = {}


def _shared_dir() -> pathlib.Path:
  """A folder every pytest process of this run sees: one per pytest-xdist run (its test-run id), or one per
  process without xdist."""
  global _SHARED_DIR
  if _SHARED_DIR is None:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run:
      _SHARED_DIR = pathlib.Path(tempfile.gettempdir()) / f"specdec_jax_tests_{run}"
      _SHARED_DIR.mkdir(exist_ok=True)
    else:
      _SHARED_DIR = pathlib.Path(tempfile.mkdtemp(prefix="specdec_jax_tests_"))
    _remove_stale_shared_dirs(_SHARED_DIR)
  return _SHARED_DIR


def _remove_stale_shared_dirs(keep: pathlib.Path) -> None:
  """Removes earlier runs' shared folders once they are a day old. (No process of a run knows when the others
  are done with its folder, so a run leaves its own behind, and a later run removes it.)"""
  cutoff = time.time() - 24 * 3600
  for folder in keep.parent.glob("specdec_jax_tests_*"):
    try:
      if folder != keep and folder.stat().st_mtime < cutoff:
        shutil.rmtree(folder, ignore_errors=True)
    except OSError:  # removed by another run meanwhile
      pass


# Tests that build the same models or compile the same programs run on one pytest-xdist worker, which builds and
# compiles them once (the other worker would do it all again): the tiny Transformers of
# tests/support/tiny_transformers.py (the session's `tree_models`, the cached sampled-tree case, the greedy case's
# programs), SmolLM2's GGUF file (read and parsed once per process) and the Markdown blocks (tests/test_docs.py).
# Every other file goes whole to whichever worker is free (its tests share module-level programs too). Keys are
# node-id prefixes (a file, or one test of a file).
_XDIST_GROUPS = {
  "tiny_transformers": (
    "tests/models/test_eagle.py::",
    "tests/drafts/test_dynamic_tree.py::",
    "tests/loop/test_tree_round.py::",
    "tests/sampling/test_no_filters.py::test_loops_with_no_filters_keep_greedy_rows_exact",  # tree_models
  ),
  "smollm2_gguf": (
    "tests/models/test_smollm2.py::",
    "tests/examples/test_demo.py::test_context_check_with_the_real_tokenizer",
    "tests/examples/test_demo.py::test_max_context_is_smollm2s",
  ),
  "docs": ("tests/test_docs.py::",),  # one child process runs all blocks of a kind, once per worker that asks
}


def _xdist_group(nodeid: str) -> str | None:
  return next((g for g, prefixes in _XDIST_GROUPS.items() if nodeid.startswith(prefixes)), None)


def pytest_xdist_make_scheduler(config, log):
  """With `-n N` and no `--dist`: the groups above and every other file, each whole on one worker.

  (Not xdist's `--dist loadgroup`: with pytest 9 it no longer groups, since it renames `item._nodeid`, which pytest
  9 no longer reads.) An explicit `--dist` is kept."""
  args = [*config.invocation_params.args, *os.environ.get("PYTEST_ADDOPTS", "").split()]
  if config.option.dist != "load" or any(a == "-d" or a.startswith("--dist") for a in args):
    return None
  from xdist.scheduler import LoadScopeScheduling

  class GroupScheduling(LoadScopeScheduling):
    def _split_scope(self, nodeid):
      return _xdist_group(nodeid) or nodeid.split("::")[0]

  return GroupScheduling(config, log)


def pytest_collection_finish(session):
  """Starts the 8-device subprocess as soon as the tests that read it are known, so that it runs beside them."""
  from tests.support.eight_devices import start_workers, workers_needed

  _FAST_PARTS.update({w: "fast" for w in workers_needed(session, "eight_device_results")})
  start_workers(dict(_FAST_PARTS), _shared_dir())


@pytest.fixture(scope="session")
def eight_device_results():
  """{worker: {check: result}}: the fast part of each 8-device worker the collected tests need, from ONE
  subprocess per run (started after collection, shared by pytest-xdist's workers)."""
  from tests.support.eight_devices import worker_results

  return worker_results(dict(_FAST_PARTS), _shared_dir())


@pytest.fixture(scope="session")
def eight_device_more_results(request):
  """As `eight_device_results`, for the slow-marked parts ("more" loops, "more-meshes")."""
  from tests.support.eight_devices import worker_results, workers_needed

  parts = {"models": "more", "samplers": "more-meshes"}
  needed = {w: parts[w] for w in workers_needed(request.session, "eight_device_more_results")}
  return worker_results(needed, _shared_dir())


@pytest.fixture(autouse=True, scope="session")
def _strict_jax_config():
  """Fails loudly if something switched the configuration back."""
  assert jax.config.jax_numpy_rank_promotion == "raise"
  assert not jax.config.jax_enable_x64
  yield
