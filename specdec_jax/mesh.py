"""Mesh axis names and the few sharding helpers every layer shares (pure JAX: no models, no Flax).

The project runs on a `jax.sharding.Mesh` with up to two axes:

  - `DATA_AXIS = "data"`: rows of the batch (prompts, KV caches, the loops' state);
  - `MODEL_AXIS = "model"`: tensor parallelism inside the models and the
    vocabulary axis of logits, `[B, T, V]` as `P("data", None, "model")`.

A program learns the mesh from the ambient `with jax.set_mesh(mesh):` (read at
trace time with `jax.sharding.get_abstract_mesh()`); without one, every helper
here is a no-op, so single-device programs are exactly what they were.

Axis types. Sharding constraints here apply to Auto axes (XLA propagates the
rest). Under a mesh with Explicit axes (`jax.make_mesh`'s default) every array
carries its sharding in its type and an ambiguous op (a matmul contracting a
split axis, a gather from a split table) is an error; `auto_axes_if_explicit`
runs a whole program with the axes made Auto, which is what the decoding loops
do; `sharded_call` runs a per-device program (`jax.shard_map`) under either
kind of mesh, for the layers that combine per-device values themselves (the
samplers' vocabulary split, the models' embedding lookup).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, PartitionSpec

DATA_AXIS = "data"
MODEL_AXIS = "model"
AXIS_NAMES = (DATA_AXIS, MODEL_AXIS)


def ambient_mesh():
  """The mesh of the enclosing `jax.set_mesh` (an `AbstractMesh`, `.empty` without one)."""
  return jax.sharding.get_abstract_mesh()


def axis_size(name: str) -> int:
  """Devices on axis `name` of the ambient mesh (1 without a mesh or without that axis).

  Example:
    >>> with jax.set_mesh(mesh):  # doctest: +SKIP
    ...   rows_split = axis_size(DATA_AXIS) > 1
  """
  mesh = ambient_mesh()
  return 1 if mesh.empty else int(dict(mesh.shape).get(name, 1))


def constrain(x: jax.Array, spec: tuple[str | None, ...]) -> jax.Array:
  """`jax.lax.with_sharding_constraint(x, P(*spec))` under the ambient mesh, where it applies.

  A no-op without an ambient mesh. Axes the mesh lacks, that are not Auto, or
  whose size does not divide x's dimension are left unconstrained (a batch of 3
  rows on 2 data devices stays whole).

  Args:
    x: any array.
    spec: one mesh axis name or None per dimension of x (shorter: the rest None).

  Returns:
    x, constrained.

  Example:
    >>> logits = constrain(logits, (DATA_AXIS, None, MODEL_AXIS))  # [B, T, V]  # doctest: +SKIP
  """
  mesh = ambient_mesh()
  if mesh.empty:
    return x
  sizes = dict(mesh.shape)
  auto = set(mesh.auto_axes)
  spec = tuple(a if a in auto and x.shape[i] % sizes[a] == 0 else None for i, a in enumerate(spec))
  if not any(spec):
    return x
  return jax.lax.with_sharding_constraint(x, PartitionSpec(*spec))


def constrain_rows(x: jax.Array) -> jax.Array:
  """`x` [B, ...] with its rows split over the data axis (see `constrain`)."""
  return constrain(x, (DATA_AXIS,) + (None,) * (x.ndim - 1))


def auto_axes_if_explicit(fn):
  """`fn` run with the ambient mesh's Explicit axes made Auto (`jax.sharding.auto_axes`); `fn` itself otherwise.

  Inside, arrays carry no sharding in their types and XLA places every
  intermediate; the outputs come back replicated (`P()`), which for the
  loops' outputs (tokens [B, N], counts) costs one small gather.

  Example:
    >>> out = auto_axes_if_explicit(loop)(*args)  # doctest: +SKIP
  """
  mesh = ambient_mesh()
  if mesh.empty or not mesh.explicit_axes:
    return fn
  return jax.sharding.auto_axes(fn, axes=tuple(mesh.explicit_axes), out_sharding=PartitionSpec())


def sharded_call(fn, in_specs, out_specs, *, check_vma: bool = True):
  """`fn` as a `jax.shard_map` over the ambient mesh, for any axis types.

  Under a mesh with Explicit axes the call runs with them made Auto
  (`jax.sharding.auto_axes`), so inputs laid out otherwise are moved to
  `in_specs` instead of refused, and the outputs come back as `out_specs`.
  Layers that combine per-device values by hand use it (the samplers' vocabulary
  split, the models' vocabulary-parallel embedding lookup).

  Args:
    fn: the per-device program (sees each input's local block).
    in_specs, out_specs: `PartitionSpec`s, as for `jax.shard_map`.
    check_vma: as for `jax.shard_map` (JAX then tracks which values vary over
      which axes, and transposes collectives correctly under `jax.grad`).

  Example:
    >>> tokens = sharded_call(program, (P("data", "model"),), P("data"))(logits)  # doctest: +SKIP
  """
  program = lambda *args: jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)(*args)
  mesh = ambient_mesh()
  if not mesh.explicit_axes:
    return program
  return jax.sharding.auto_axes(program, axes=tuple(mesh.explicit_axes), out_sharding=out_specs)


def make_mesh(data: int = 1, model: int = 1, *, devices=None) -> jax.sharding.Mesh:
  """A `data` x `model` mesh of the first data*model devices, with Auto axes (XLA propagates shardings).

  Args:
    data: devices on the data axis (rows of the batch).
    model: devices on the model axis (tensor parallelism).
    devices: the devices to use (default `jax.devices()`); exactly data*model of them are taken.

  Returns:
    `jax.sharding.Mesh` with axis names ("data", "model").

  Raises:
    ValueError: a size is not a positive int, or there are fewer than data*model devices.

  Example:
    >>> make_mesh(data=1, model=1).shape  # doctest: +SKIP
    OrderedDict([('data', 1), ('model', 1)])
  """
  for name, value in (("data", data), ("model", model)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"make_mesh: {name} must be a positive int, got {value!r}.")
  devices = list(jax.devices() if devices is None else devices)
  if len(devices) < data * model:
    raise ValueError(
      f"make_mesh: data={data} x model={model} needs {data * model} devices, found {len(devices)} "
      f"(on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N fakes N devices; set it before "
      f"JAX starts)."
    )
  grid = np.asarray(devices[: data * model], dtype=object).reshape(data, model)
  return jax.sharding.Mesh(grid, AXIS_NAMES, axis_types=(AxisType.Auto, AxisType.Auto))
