"""How the decoding loops carry a model through `jax.jit`, whatever the model is made of.

A jitted program takes arrays as arguments and everything else as static
structure. `split_model` cuts a model into the two, and `merge_model` puts it
back together inside the program, so new weights of the same structure reuse
the compiled program:

  - a Flax NNX module: `nnx.split` into its GraphDef (static) and State (arrays);
  - any other pytree holding arrays: its treedef and non-array leaves (static)
    and its arrays;
  - anything else (no arrays): the object itself, closed over as a constant.

This module imports Flax only when it meets an NNX module (a model of that kind
means Flax is already imported), so `specdec_jax.loop.decoding` and the sampler work
without Flax.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import jax
import numpy as np

_VALUE_TYPES = (bool, int, float, complex, str, bytes, type(None), np.dtype)


class Static:
  """Wraps a non-array object so it can ride in a jit's static arguments.

  Plain values (numbers, strings, dtypes, tuples of them) compare by type and
  value, so an equal value reuses the compiled program. Anything else compares
  by identity: a user's own `__eq__` may ignore the weights the program bakes
  in. The jit cache keeps the object alive, so its id cannot be reused.
  """

  __slots__ = ("obj", "key")

  def __init__(self, obj):
    self.obj = obj
    self.key = (type(obj), obj) if _is_plain_value(obj) else None

  def __hash__(self):
    return id(self.obj) if self.key is None else hash(self.key)

  def __eq__(self, other):
    if not isinstance(other, Static):
      return False
    if self.key is None or other.key is None:
      return self.obj is other.obj
    return self.key == other.key


def _is_plain_value(obj) -> bool:
  if isinstance(obj, tuple):
    return all(_is_plain_value(x) for x in obj)
  return isinstance(obj, _VALUE_TYPES)


@dataclasses.dataclass(frozen=True)
class ModelDef:
  """The static half of a model: how to rebuild it inside jit from its arrays.

  kind "nnx": structure is the nnx GraphDef (arrays = its State);
  kind "pytree": structure is (treedef, its non-array leaves as `Static`);
  kind "closed": structure is the model as `Static` (no arrays).
  """

  kind: str
  structure: Any


def _nnx():
  """flax.nnx if it is already imported (an NNX model implies it is), else None."""
  return sys.modules.get("flax.nnx")


def split_model(model) -> tuple[ModelDef, Any]:
  """Splits a model into (static definition, arrays to pass through jit).

  Example:
    >>> model_def, arrays = split_model(model)  # doctest: +SKIP
    >>> same_model = merge_model(model_def, arrays)  # inside the jitted program  # doctest: +SKIP
  """
  nnx = _nnx()
  if nnx is not None and isinstance(model, nnx.Module):
    # One graph traversal per call, outside jit; the program merges it back.
    graphdef, state = nnx.split(model)
    return ModelDef("nnx", graphdef), state
  leaves, treedef = jax.tree_util.tree_flatten(model)
  is_array = [isinstance(x, (jax.Array, np.ndarray)) for x in leaves]
  if not any(is_array):
    return ModelDef("closed", Static(model)), None
  static = tuple(None if a else Static(x) for x, a in zip(leaves, is_array))
  arrays = [x for x, a in zip(leaves, is_array) if a]
  return ModelDef("pytree", (treedef, static)), arrays


def merge_model(model_def: ModelDef, arrays):
  """Inverse of `split_model`, called inside the jitted program."""
  if model_def.kind == "nnx":
    return _nnx().merge(model_def.structure, arrays)
  if model_def.kind == "closed":
    return model_def.structure.obj
  treedef, static = model_def.structure
  it = iter(arrays)
  leaves = [next(it) if s is None else s.obj for s in static]
  return jax.tree_util.tree_unflatten(treedef, leaves)
