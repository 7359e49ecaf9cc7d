"""The package's folders are its layers: an AST walk of every import fails on an edge against their order.

Allowed (DESIGN.md's table): mesh <- sampling <- verify <- drafts <- loop, and
kernels <- models, with `mesh` a leaf that every layer may read. `loop` never
imports `models` or `kernels` (a model reaches it through its call protocol),
and `models` never imports the speculative layers.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "specdec_jax"

# layer -> the layers it may import (itself always allowed)
ALLOWED = {
  "mesh": set(),
  "sampling": {"mesh"},
  # Grammars as token automata on device: their masks are the sampler's bitmasks.
  "grammar": {"sampling", "mesh"},
  "verify": {"sampling", "mesh"},
  "drafts": {"verify", "sampling", "mesh"},
  "loop": {"drafts", "verify", "sampling", "grammar", "mesh"},
  "kernels": set(),
  "models": {"kernels", "mesh"},
  # The package root re-exports the public names of the speculative layers only.
  "__init__": {"mesh", "sampling", "grammar", "verify", "drafts", "loop"},
}


def _layer(module: str) -> str | None:
  """`specdec_jax.verify.chain` -> "verify"; None for modules outside the package."""
  parts = module.split(".")
  if parts[0] != "specdec_jax":
    return None
  return parts[1] if len(parts) > 1 else "__init__"


def _file_layer(path: pathlib.Path) -> str:
  rel = path.relative_to(PACKAGE)
  return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.name != "__init__.py" else "__init__"


def _imports(path: pathlib.Path):
  """(line, imported module) for every import in the file, function-level ones included."""
  package = ".".join(("specdec_jax",) + path.relative_to(PACKAGE).parent.parts)
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield node.lineno, alias.name
    elif isinstance(node, ast.ImportFrom):
      if node.level:  # relative import
        base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        module = f"{base}.{node.module}" if node.module else base
      else:
        module = node.module or ""
      yield node.lineno, module
      for alias in node.names:  # `from specdec_jax import verify` names a layer too
        if module == "specdec_jax":
          yield node.lineno, f"specdec_jax.{alias.name}"
    elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args:
      arg = node.args[0]
      if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        yield node.lineno, arg.value


def _edges():
  for path in sorted(PACKAGE.rglob("*.py")):
    source = _file_layer(path)
    for line, module in _imports(path):
      target = _layer(module)
      if target is not None:
        yield path.relative_to(PACKAGE.parent), line, source, target


def _violations(edges):
  return [
    f"{path}:{line}: {source} imports {target}"
    for path, line, source, target in edges
    if target != source and target != "__init__" and target not in ALLOWED[source]
  ]


def test_every_file_belongs_to_a_known_layer():
  layers = {_file_layer(p) for p in PACKAGE.rglob("*.py")}
  assert layers <= set(ALLOWED), f"files outside the known layers: {sorted(layers - set(ALLOWED))}"
  for folder in ("sampling", "grammar", "verify", "drafts", "loop", "kernels", "models"):
    assert (PACKAGE / folder / "__init__.py").is_file(), folder


def test_imports_follow_the_layers():
  edges = list(_edges())
  assert len(edges) > 50, "the walk found too few imports to be reading the package"
  assert _violations(edges) == []


def test_no_layer_imports_the_package_root():
  # `from specdec_jax import X` inside the package would import every layer through __init__.
  bad = [f"{p}:{line}" for p, line, source, target in _edges() if target == "__init__" and source != "__init__"]
  assert bad == []


@pytest.mark.parametrize(
  "edge, wrong",
  [
    (("specdec_jax/loop/x.py", 1, "loop", "models"), True),
    (("specdec_jax/loop/x.py", 1, "loop", "kernels"), True),
    (("specdec_jax/models/x.py", 1, "models", "sampling"), True),
    (("specdec_jax/sampling/x.py", 1, "sampling", "verify"), True),
    (("specdec_jax/verify/x.py", 1, "verify", "drafts"), True),
    (("specdec_jax/mesh.py", 1, "mesh", "sampling"), True),
    (("specdec_jax/drafts/x.py", 1, "drafts", "verify"), False),
    (("specdec_jax/models/x.py", 1, "models", "kernels"), False),
  ],
)
def test_the_check_rejects_a_planted_edge(edge, wrong):
  assert bool(_violations([edge])) == wrong


def test_the_loop_imports_no_flax():
  """The sampler and the loops need no Flax (models are adapted only when one is passed)."""
  import subprocess
  import sys

  code = (
    "import sys, specdec_jax; from specdec_jax import rejection_sample, generate, speculative_generate; "
    "import specdec_jax.loop.adapter; "
    "assert 'flax' not in sys.modules, sorted(m for m in sys.modules if 'flax' in m)"
  )
  subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)
