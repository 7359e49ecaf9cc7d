"""`optimized(fn, **static)`: `fn` jitted with LLVM's optimisations back on, for programs whose run dominates.

tests/conftest.py compiles every program with LLVM at level 0 (XLA_FLAGS), which compiles the suite's many small
programs faster. The Pallas interpreter's programs are the exception: each runs its kernel's grid as an XLA while
loop, one program instance a step, over 1000-row batches, and at level 0 that loop runs about 9x slower
(tests/verify/test_fused.py's two-stage draw over 1000 rows: 16.2 s at level 0, 1.8 s at level 2, for 1 s more
of compiling; the same tokens). `compiler_options` sets the level for one program only (XLA's per-compile
overrides of its debug options), with the same float semantics (no fast-math at either level).

The wrapped call is the library's own jitted function inlined into this jit: the same operations on the same
inputs (arrays stay arguments, not constants; `static` holds what the library takes as static arguments).
"""

import functools

import jax

OPTIMIZED = {"xla_backend_optimization_level": 2, "xla_llvm_disable_expensive_passes": False}

_JITTED = {}


def optimized(fn, **static):
  """`fn` with `static` bound, jitted at LLVM level 2; one jitted function per (fn, static), so calls share it.
  Its other arguments (positional or keyword: arrays, pytrees, None) are traced."""
  key = (fn, tuple(sorted(static.items())))
  if key not in _JITTED:
    _JITTED[key] = jax.jit(functools.partial(fn, **static), compiler_options=OPTIMIZED)
  return _JITTED[key]
