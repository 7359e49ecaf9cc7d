"""Lowering for a GPU on a machine without one: the Pallas kernels' Triton IR, checked as text."""

import pytest


def cuda_module_text(fn, args) -> str:
  """The StableHLO text of jitted `fn` lowered for a CUDA target at `args` (ShapeDtypeStructs), Pallas kernels
  lowered to Triton IR on the way; skips the test where this jaxlib has no CUDA lowering."""
  export = pytest.importorskip("jax.export")
  try:
    exported = export.export(
      fn, platforms=["cuda"], disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    )(*args)
  except NotImplementedError as e:  # pragma: no cover - a jaxlib built without the GPU lowering
    pytest.skip(f"no CUDA lowering here: {e}")
  return exported.mlir_module()
