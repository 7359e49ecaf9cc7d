"""The many-device checks, run by tests/models/test_sharding.py in a subprocess with 8 fake CPU devices.

The device count of the CPU backend is fixed when JAX starts, so these checks
cannot run inside the ordinary pytest process (which has one device). The
parent sets `XLA_FLAGS=--xla_force_host_platform_device_count=8` (and a low
LLVM optimisation level, which halves the compile time) and runs its part
through tests/support/eight_devices.py (or alone, to debug:

    python tests/support/mesh_worker.py [--part all|fast|more])

which prints one JSON object on its last line: {check name: {"ok": bool,
"detail": str}}. Each check compares a run on a mesh with the same run on one
device (no mesh):

  - logits: a tiny float32 Transformer on meshes 1x8, 2x4, 4x2 and 8x1
    (data x model), and with `scan_layers` on 2x4, gives the unsharded logits
    to float32 rounding, its parameters really are split (their
    `.sharding.spec`), and `to_weights` returns the same arrays; so does one
    with q/k/v biases and an untied head (Qwen2's kind) on 2x4 (biases split
    by heads, unrolled and scanned; and its EAGLE head's) and 1x8 (heads whole:
    `bqkv` fused, replicated);
  - loops: `generate` and `speculative_generate` (draft model, prompt lookup,
    EAGLE drafter) give the same greedy tokens, and sampled runs the same
    tokens for the same key, on a 2x4 mesh (heads split) and a 1x8 mesh (heads
    replicated: 4 KV heads do not divide by 8), and on an 8x1 mesh (rows only:
    each device runs the one-device loop on its rows; Auto and Explicit axes);
  - 8x1: the compiled `generate` holds no collective and `speculative_generate`
    only the all-reduce of its [K] per-position sums (no collective while
    decoding);
  - 2x1: a target on the Pallas kernels (in the interpreter) takes them on each
    device's rows inside the loop's shard_map, with one device's tokens;
  - a mesh with Explicit axes (`jax.make_mesh`'s default) gives the same tokens too;
  - a 1x1 mesh compiles exactly the unsharded programs (op and shape, in order);
  - the vocabulary-parallel embedding lookup (Transformer and EAGLE, 2x4 and
    1x2 at B=1, T=1) is a shard_map whose one psum of [B/d, T, D] is the
    program's only explicit collective, with no all-gather of the [V, D]
    table; it returns one device's rows bit for bit (out-of-range ids, Auto
    and Explicit meshes, a batch that "data" does not divide), gradient too.
"""

from __future__ import annotations

import functools
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from specdec_jax import SamplingParams, generate, speculative_generate
from specdec_jax.drafts.lookup import PromptLookupDrafter
from specdec_jax.loop.decoding import _generate_jit, _speculative_jit, _split
from specdec_jax.mesh import make_mesh
from specdec_jax.models import EagleDrafter, Transformer, TransformerConfig
from specdec_jax.models.sharding import Partitioning, embed_lookup, shard
from tests.support.eight_devices import exit_unless_devices, part_arg, run_checks

jax.config.update("jax_numpy_rank_promotion", "raise")  # as tests/conftest.py

NUM_DEVICES = 8
# H=8 query and Hkv=4 KV heads: split over a model axis of 2 or 4, replicated over 8.
CONFIG = TransformerConfig.tiny(64, num_heads=8, num_kv_heads=4, feature_layers=(0, 1))
B, P_LEN, NEW, K = 8, 6, 10, 3
# Logits of a sharded model differ from one device's only by the order of float32
# sums (the all-reduce after wo and w_down adds m partial sums): a few ulps of
# values of size ~1, so 1e-5 leaves room and still catches any real error (a
# wrong head or vocabulary slice moves logits by ~1e-2).
LOGITS_ATOL = 1e-5


def rows(mesh, x):
  """x [B, ...] placed with its rows split over the data axis."""
  return jax.device_put(x, NamedSharding(mesh, P("data", *([None] * (np.ndim(x) - 1)))))


def build():
  target = Transformer(CONFIG, rngs=nnx.Rngs(0))
  # An untied output head, so the loops cover `lm_head` [D, V] split by columns too.
  draft = Transformer(CONFIG.replace(num_layers=1, feature_layers=(), tie_embeddings=False), rngs=nnx.Rngs(1))
  eagle = EagleDrafter.for_target(target, rngs=nnx.Rngs(2))
  rng = np.random.default_rng(0)
  # Repetitive prompts, so prompt lookup finds matches and accepts some drafts.
  prompts = np.tile(rng.integers(0, CONFIG.vocab_size, (B, 3)), (1, 2)).astype(np.int32)
  lengths = rng.integers(3, P_LEN + 1, B).astype(np.int32)
  return target, draft, eagle, prompts, lengths


TARGET, DRAFT, EAGLE, PROMPTS, LENGTHS = build()
GREEDY = SamplingParams.greedy(B)
SAMPLED = SamplingParams.create([1.0, 0.7, 0.0, 1.3] * (B // 4), top_p=[1.0, 0.9, 1.0, 0.8] * (B // 4))
KEY = jax.random.key(7)


def runs(target, draft, eagle, place, names=None):
  """Loop configurations (all, or `names`): name -> tokens (NumPy), with inputs placed by `place`."""
  prompts, lengths = place(PROMPTS), place(LENGTHS)
  greedy, sampled = jax.tree.map(place, GREEDY), jax.tree.map(place, SAMPLED)
  common = {"max_new_tokens": NEW}
  spec = dict(common, num_speculative_tokens=K)
  calls = {
    "generate greedy": lambda: generate(target, prompts, lengths, greedy, None, all_greedy=True, **common),
    "generate sampled": lambda: generate(target, prompts, lengths, sampled, KEY, **common),
    "speculative greedy, draft model": lambda: speculative_generate(
      target, draft, prompts, lengths, greedy, None, all_greedy=True, **spec
    ),
    "speculative greedy, prompt lookup": lambda: speculative_generate(
      target, PromptLookupDrafter(2), prompts, lengths, greedy, None, all_greedy=True, **spec
    ),
    "speculative greedy, EAGLE": lambda: speculative_generate(
      target, eagle, prompts, lengths, greedy, None, all_greedy=True, **spec
    ),
    "speculative sampled, draft model": lambda: speculative_generate(
      target, draft, prompts, lengths, sampled, KEY, **spec
    ),
  }
  return {name: np.asarray(calls[name]().tokens) for name in (names or calls)}


_REFERENCE: dict = {}


def reference(names) -> dict:
  """The runs `names` on one device (no mesh), each computed once."""
  missing = [name for name in names if name not in _REFERENCE]
  if missing:
    _REFERENCE.update(runs(TARGET, DRAFT, EAGLE, lambda x: x, missing))
  return _REFERENCE


def forward(model, tokens):
  """(logits, cache) of one call on [B, T] tokens at positions 0..T-1 (jit it)."""
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  return model(tokens, positions, model.init_cache(tokens.shape[0], 16))


def sharded_logits(model, mesh):
  """(sharded model, its logits and cache on `mesh`, max |logits - one device's|)."""
  tokens = jnp.asarray(PROMPTS)
  expected, _ = jax.jit(forward)(model, tokens)
  sharded = shard(model, mesh)
  with jax.set_mesh(mesh):
    logits, cache = jax.jit(forward)(sharded, rows(mesh, tokens))
  err = float(jnp.max(jnp.abs(logits - expected)))
  assert err <= LOGITS_ATOL, f"max |logits - one device| = {err:.3g} > {LOGITS_ATOL}"
  return sharded, logits, cache, err


def padded(spec, ndim):
  """A PartitionSpec as a tuple of ndim entries (JAX drops trailing Nones)."""
  return tuple(spec) + (None,) * (ndim - len(spec))


def check_logits(data, model):
  sharded, logits, cache, err = sharded_logits(TARGET, make_mesh(data, model))
  part, block = sharded.partitioning, sharded.layers.block0
  m = "model" if model > 1 else None
  d = "data" if data > 1 else None
  spec = {
    "embed": sharded.embed[...].sharding.spec,
    "logits": logits.sharding.spec,
    "cache.k": cache.k.sharding.spec,
    "w_down": block.w_down[...].sharding.spec,
  }
  assert spec["embed"] == P(m, None), spec  # vocabulary-parallel
  assert padded(spec["logits"], 3) == (d, None, m), spec  # rows over data, vocabulary over model
  assert part.heads == (model > 1 and CONFIG.num_kv_heads % model == 0), part
  assert padded(spec["cache.k"], 5)[1:3] == (d, "model" if part.heads else None), spec
  if part.heads:
    assert block.wk[...].sharding.spec == P(None, "model") and block.wo[...].sharding.spec == P("model", None)
  else:  # attention replicated, its projections still fused
    assert block.wqkv[...].sharding.spec == P(None, None), block.wqkv[...].sharding.spec
  if m:
    assert spec["w_down"] == P("model", None) and block.w_gate[...].sharding.spec == P(None, "model"), spec
  annotated = nnx.get_partition_spec(nnx.state(sharded))  # Flax's view of the annotations
  assert annotated["embed"].get_value() == spec["embed"], annotated["embed"]
  # The weights interface does not see the layout: the same named arrays come back.
  expected_weights, weights = TARGET.to_weights(), sharded.to_weights()
  assert weights.keys() == expected_weights.keys()
  assert all(np.array_equal(weights[n], expected_weights[n]) for n in weights), "to_weights changed"
  return f"max err {err:.2g}, {part}, {spec}"


def check_scan_logits():
  # The scanned layout holds [L, ...] arrays: the layer axis stays whole, the rest splits as unrolled.
  sharded, _, _, err = sharded_logits(Transformer(CONFIG.replace(scan_layers=True), rngs=nnx.Rngs(0)), make_mesh(2, 4))
  assert sharded.layers.wk[...].sharding.spec == P(None, None, "model"), sharded.layers.wk[...].sharding.spec
  assert sharded.layers.w_down[...].sharding.spec == P(None, "model", None), sharded.layers.w_down[...].sharding
  return f"max err {err:.2g}"


def check_bias_logits(cases=(((2, 4), False),), with_eagle: bool = True):
  # q/k/v biases follow their projections: split by whole heads with wq/wk/wv's columns, or fused and replicated.
  config = CONFIG.replace(qkv_bias=True, tie_embeddings=False)
  details = []
  for mesh_shape, scan in cases:
    model = Transformer(config.replace(scan_layers=scan), rngs=nnx.Rngs(3))
    sharded, _, _, err = sharded_logits(model, make_mesh(*mesh_shape))
    layers = sharded.layers if scan else sharded.layers.block0
    lead = (None,) if scan else ()
    if sharded.partitioning.heads:
      for name in ("bq", "bk", "bv"):
        spec = getattr(layers, name)[...].sharding.spec
        assert padded(spec, len(lead) + 1) == (*lead, "model"), (name, spec)
    else:
      spec = layers.bqkv[...].sharding.spec
      assert padded(spec, len(lead) + 1) == (*lead, None), spec
    expected_weights, weights = model.to_weights(), sharded.to_weights()
    assert weights.keys() == expected_weights.keys() and "layers.bq" in weights
    assert all(np.array_equal(weights[n], expected_weights[n]) for n in weights), "to_weights changed"
    details.append(f"{mesh_shape}{' scan' if scan else ''}: max err {err:.2g}")
  if not with_eagle:
    return "; ".join(details)
  # An EAGLE head for the biased target has biased blocks (first, and a stacked rest): split the same way.
  mesh = make_mesh(2, 4)
  target = Transformer(config, rngs=nnx.Rngs(3))
  eagle = EagleDrafter.for_target(target, num_layers=2, rngs=nnx.Rngs(4))
  tokens = jnp.asarray(PROMPTS)
  hidden = jax.random.normal(jax.random.key(5), (*tokens.shape, config.d_model))
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  call = jax.jit(lambda d, t, h, p: d(t, h, p, d.init_cache(t.shape[0], 16))[0])
  expected = call(eagle, tokens, hidden, positions)
  sharded = shard(eagle, mesh)
  assert padded(sharded.first.bk[...].sharding.spec, 1) == ("model",), sharded.first.bk[...].sharding.spec
  assert padded(sharded.rest.bv[...].sharding.spec, 2) == (None, "model"), sharded.rest.bv[...].sharding.spec
  with jax.set_mesh(mesh):
    logits = call(sharded, rows(mesh, tokens), rows(mesh, hidden), rows(mesh, positions))
  err = float(jnp.max(jnp.abs(logits - expected)))
  assert err <= LOGITS_ATOL, f"EAGLE head: max |logits - one device| = {err:.3g} > {LOGITS_ATOL}"
  assert sharded.to_weights().keys() == eagle.to_weights().keys()
  return ", ".join([*details, f"EAGLE (2, 4): max err {err:.2g}"])


def check_loops(mesh, names) -> dict[str, tuple[bool, str]]:
  """One result per loop configuration in `names`: its tokens on `mesh` equal one device's."""
  expected = reference(names)
  target, draft, eagle = shard(TARGET, mesh), shard(DRAFT, mesh), shard(EAGLE, mesh)
  with jax.set_mesh(mesh):
    got = runs(target, draft, eagle, lambda x: rows(mesh, x) if np.ndim(x) else x, names)
  return {
    name: (
      np.array_equal(expected[name], got[name]),
      "tokens equal"
      if np.array_equal(expected[name], got[name])
      else f"tokens differ: one device {expected[name].tolist()}, mesh {got[name].tolist()}",
    )
    for name in got
  }


def check_rows_only_program():
  """On a mesh that splits rows only (8x1), each device runs the one-device loop on its rows: the compiled
  `generate` holds no collective, `speculative_generate` one all-reduce of the two [K] per-position sums
  (a whole-batch loop would all-reduce "any row left" every iteration)."""
  from specdec_jax.loop.decoding import _generate_jit, _speculative_jit, _split  # noqa: PLC0415

  mesh = make_mesh(8, 1)
  target = shard(TARGET, mesh)
  target_def, target_arrays = _split(target, "target")
  static = {"max_new_tokens": NEW, "eos": (), "all_greedy": False, "logprobs": None}
  with jax.set_mesh(mesh):
    args = (rows(mesh, PROMPTS), rows(mesh, LENGTHS), jax.tree.map(lambda x: rows(mesh, x), SAMPLED), KEY)
    # None: no grammar (the programs' positional after the models' arrays).
    plain = _generate_jit.lower(target_arrays, None, *args, target_def=target_def, **static).compile().as_text()
    spec = (
      _speculative_jit.lower(
        target_arrays,
        None,
        None,
        *args,
        target_def=target_def,
        draft_def=PromptLookupDrafter(2),
        drafter="lookup",
        num_speculative_tokens=K,
        tree=None,
        **static,
      )
      .compile()
      .as_text()
    )
  found = {"generate": collective_shapes(plain), "speculative": collective_shapes(spec)}
  assert found["generate"] == [], f"generate on 8x1 holds collectives {found['generate']}"
  assert found["speculative"] and all(s == f"(s32[{K}], s32[{K}])" or s == f"s32[{K}]" for s in found["speculative"]), (
    f"speculative_generate on 8x1 holds collectives other than the [K] sums: {found['speculative']}"
  )
  return f"generate: none; speculative_generate: {found['speculative']}"


def check_inside_callers_shard_map():
  """`generate` called inside a caller's own shard_map over "data" (each device its rows already: a Manual axis)
  runs the one-device program there, and its tokens equal one device's. On 2x1 each device's 4 rows would
  split over "data" again if the loop did not see that the axis is Manual."""
  mesh = make_mesh(2, 1)
  graphdef, arrays = nnx.split(TARGET)

  def per_device(arrays, prompts, lengths):
    model = nnx.merge(graphdef, arrays)
    params = SamplingParams.greedy(prompts.shape[0])
    return generate(model, prompts, lengths, params, None, max_new_tokens=NEW, all_greedy=True).tokens

  with jax.set_mesh(mesh):
    fn = jax.shard_map(per_device, in_specs=(P(), P("data"), P("data")), out_specs=P("data"), check_vma=False)
    got = np.asarray(jax.jit(fn)(arrays, PROMPTS, LENGTHS))
  want = reference(["generate greedy"])["generate greedy"]
  assert np.array_equal(got, want), f"tokens differ: one device {want.tolist()}, inside shard_map {got.tolist()}"
  return "tokens equal"


def check_rows_only_kernels():
  """On a rows-only mesh each device runs the one-device program, the Pallas blocks included: a target with
  kernels="pallas_interpret" takes them inside the loop's shard_map (its traced calls counted) and its greedy
  tokens equal one device's bit for bit. Outside a shard_map the same sharded model keeps XLA's blocks
  (`runs_locally` is False): XLA cannot split a Pallas call over devices."""
  from specdec_jax.models import transformer  # noqa: PLC0415
  from specdec_jax.models.sharding import runs_locally  # noqa: PLC0415

  # Heads of 32 (the kernels need head_dim / 2 a power of two >= 16).
  model = Transformer(
    CONFIG.replace(num_heads=2, num_kv_heads=1, head_dim=32, kernels="pallas_interpret"), rngs=nnx.Rngs(3)
  )
  calls, original = [], transformer.pallas_block

  def counted(c, x, *args, **kwargs):
    calls.append(x.shape[0] * x.shape[1])
    return original(c, x, *args, **kwargs)

  run = lambda m, place: (
    generate(
      m, place(PROMPTS), place(LENGTHS), jax.tree.map(place, GREEDY), None, max_new_tokens=NEW, all_greedy=True
    ).tokens
  )
  transformer.pallas_block = counted
  try:
    want = np.asarray(run(model, lambda x: x))
    on_one = len(calls)
    mesh = make_mesh(2, 1)
    sharded = shard(model, mesh)
    calls.clear()
    with jax.set_mesh(mesh):
      got = np.asarray(run(sharded, lambda x: rows(mesh, x) if np.ndim(x) else x))
      outside = runs_locally(sharded.partitioning)
  finally:
    transformer.pallas_block = original
  assert on_one > 0, "the one-device program took no Pallas block: the check would prove nothing"
  assert calls and max(calls) <= B // 2, f"the devices' programs took no Pallas block on their rows: {calls}"
  assert not outside, "runs_locally is True for a sharded model outside a shard_map"
  assert np.array_equal(got, want), f"tokens differ: one device {want.tolist()}, 2x1 {got.tolist()}"
  return f"Pallas blocks traced {len(calls)} times on {max(calls)} rows a device; tokens equal"


def collective_shapes(text) -> list[str]:
  """The result shape (layouts dropped) of every collective instruction of compiled HLO text."""
  ops = "all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter|collective-broadcast"
  found = re.findall(rf"^\s*(?:ROOT )?%\S+ = (.+?) (?:{ops})(?:-start)?\(", text, flags=re.MULTILINE)
  return [re.sub(r"\{[^}]*\}", "", shape) for shape in found]


def program_ops(text):
  """(shape, opcode) of every instruction of compiled HLO text: names and metadata left out."""
  return re.findall(r"^\s*(?:ROOT )?%\S+ = (\S+?) ([a-z][\w-]*)\(", text, flags=re.MULTILINE)


def check_one_device_mesh():
  # On a 1-device mesh nothing is split, so the program must be the unsharded one,
  # instruction by instruction: the sharded code path costs nothing there.
  mesh = make_mesh(1, 1)
  prompts, lengths = jnp.asarray(PROMPTS), jnp.asarray(LENGTHS)

  def programs(target, draft):
    t_def, t_arrays = _split(target, "target")
    d_def, d_arrays = _split(draft, "draft")
    static = {"max_new_tokens": NEW, "eos": (), "all_greedy": True, "logprobs": None}
    plain = _generate_jit.lower(t_arrays, None, prompts, lengths, GREEDY, None, target_def=t_def, **static)
    spec = _speculative_jit.lower(
      t_arrays,
      d_arrays,
      None,  # no grammar
      prompts,
      lengths,
      GREEDY,
      None,
      target_def=t_def,
      draft_def=d_def,
      drafter="model",
      num_speculative_tokens=K,
      tree=None,
      **static,
    )
    return [program_ops(p.compile().as_text()) for p in (plain, spec)]

  expected = programs(TARGET, DRAFT)
  with jax.set_mesh(mesh):
    got = programs(shard(TARGET, mesh), shard(DRAFT, mesh))
  assert all(expected), "no instructions parsed from the HLO text"
  assert got == expected, "the 1x1-mesh programs differ from the unsharded ones"
  return f"{sum(map(len, got))} instructions equal"


# A collective instruction of compiled HLO text: (result shape or tuple, opcode, the rest of the line).
COLLECTIVE = re.compile(
  r"^\s*(?:ROOT )?%\S+ = (.+?) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\((.*)$",
  flags=re.MULTILINE,
)


def dims(shape: str) -> list[list[int]]:
  """The dimensions of each array in an HLO shape ("f32[4,6,32]{2,1,0}" or a tuple of them)."""
  return [[int(n) for n in found.split(",") if n] for found in re.findall(r"\w+\[([\d,]*)\]", shape)]


def embedding_programs(mesh, tokens):
  """{model: (lowered StableHLO text, compiled HLO text)} of the target's and the EAGLE drafter's calls on `mesh`."""
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  hidden = jnp.zeros((*tokens.shape, CONFIG.d_model), CONFIG.dtype)
  eagle_call = lambda d, t, h, p: d(t, h, p, d.init_cache(t.shape[0], 16))[0]
  calls = {
    "Transformer": (forward, shard(TARGET, mesh), (tokens,)),
    "EAGLE": (eagle_call, shard(EAGLE, mesh), (tokens, hidden, positions)),
  }
  out = {}
  with jax.set_mesh(mesh):
    for name, (fn, model, args) in calls.items():
      placed = [rows(mesh, a) if a.shape[0] % dict(mesh.shape)["data"] == 0 else a for a in args]
      lowered = jax.jit(fn).lower(model, *placed)
      out[name] = (lowered.as_text(), lowered.compile().as_text())
  return out


def check_embedding_program():
  # The vocabulary-parallel lookup is an explicit shard_map: each device reads its own rows [V/m, D] and one
  # psum of [B/d, T, D] combines them. XLA left to itself all-gathered the whole [V, D] table every call on GPU
  # (the CPU partitioner happens to pick the per-device lookup, so the compiled CPU program alone cannot tell the
  # two apart; the lowered program, before XLA partitions it, can: it holds no collective without the shard_map).
  v, d_model = CONFIG.vocab_size, CONFIG.d_model
  decode = np.asarray([[5]], np.int32)  # one token of one row: the case measured slow on GPU
  details = []
  for (d, m), tokens in (((2, 4), PROMPTS), ((1, 2), decode)):
    mesh = make_mesh(d, m)
    b, t = tokens.shape
    local_rows = b // d if b % d == 0 else b
    for name, (lowered, compiled) in embedding_programs(mesh, jnp.asarray(tokens)).items():
      where = f"{name} on {d}x{m}, B={b} T={t}"
      assert lowered.count("stablehlo.all_reduce") == 1, f"{where}: one explicit all-reduce expected (the lookup's)"
      assert f"tensor<{v // m}x{d_model}x" in lowered, f"{where}: no per-device [V/m, D] = [{v // m}, {d_model}] table"
      found = COLLECTIVE.findall(compiled)
      gathered = [shape for shape, op, _ in found if op in ("all-gather", "all-to-all") and [v, d_model] in dims(shape)]
      assert not gathered, f"{where}: the [V, D] table is gathered: {gathered}"
      lookup = [dims(shape) for shape, op, rest in found if op == "all-reduce" and "shard_map" in rest]
      assert lookup == [[[local_rows, t, d_model]]], f"{where}: the lookup's all-reduces {lookup}"
      details.append(f"{where}: psum of [{local_rows}, {t}, {d_model}], {len(found)} collectives")
  # Without a model axis the embedding is whole: the plain lookup, no shard_map, no collective of its own.
  for name, (lowered, _) in embedding_programs(make_mesh(8, 1), jnp.asarray(PROMPTS)).items():
    assert "stablehlo.all_reduce" not in lowered, f"{name} on 8x1: an explicit all-reduce"
  return "; ".join(details)


def check_embedding_bits():
  # The split lookup returns one device's rows bit for bit (ids out of range clipped, as on one device), on
  # Auto and Explicit meshes, rows split over "data" or not (B=3 does not divide), and its gradient is the
  # one-device gradient (the shard_map's psum transposes to a per-device scatter-add, counted once).
  v, d_model = CONFIG.vocab_size, CONFIG.d_model
  table = jax.random.normal(jax.random.key(11), (v, d_model)).astype(jnp.bfloat16)
  ids = np.asarray([[3, -1, v, 3 * v, v - 1, 0], [v // 2, 3, 7, v // 4 + 1, -5, 31]] * 4, np.int32)  # [8, 6]
  reference = lambda tab, x: jnp.take(tab, jnp.clip(x, 0, v - 1), axis=0)
  weight = jnp.arange(d_model, dtype=jnp.float32)[None, None]  # whole numbers: sums of them are exact in any order
  meshes = {
    "2x4": make_mesh(2, 4),
    "1x8": make_mesh(1, 8),
    "4x2 Explicit": jax.make_mesh((4, 2), ("data", "model")),
  }
  details = []
  for name, mesh in meshes.items():
    m = dict(mesh.shape)["model"]
    part = Partitioning.for_shapes(model_size=m, num_heads=8, num_kv_heads=4, d_ff=64, vocab_size=v)
    placed = jax.device_put(table, NamedSharding(mesh, P("model", None)))
    for tokens in (ids, ids[:3]):
      expected = np.asarray(reference(table, tokens)).view(np.uint16)
      with jax.set_mesh(mesh):
        got = np.asarray(jax.jit(lambda tab, x: embed_lookup(tab, x, part))(placed, tokens)).view(np.uint16)
      assert np.array_equal(got, expected), f"{name}, B={len(tokens)}: the lookup differs from one device's"
    loss = lambda tab, lookup: jnp.sum(lookup(tab, ids).astype(jnp.float32) * weight)
    expected = jax.grad(loss)(table.astype(jnp.float32), reference)
    with jax.set_mesh(mesh):
      got = jax.jit(jax.grad(loss), static_argnums=1)(placed.astype(jnp.float32), lambda t, x: embed_lookup(t, x, part))
    assert np.array_equal(np.asarray(got), np.asarray(expected)), f"{name}: the gradient differs from one device's"
    details.append(name)
  return "bits and gradients equal on " + ", ".join(details)


LOOP_RUNS = (
  "generate greedy",
  "generate sampled",
  "speculative greedy, draft model",
  "speculative greedy, prompt lookup",
  "speculative greedy, EAGLE",
  "speculative sampled, draft model",
)
# One configuration of each kind: a sampled plain loop, a greedy feature drafter, a sampled model drafter.
FAST_RUNS = ("generate sampled", "speculative greedy, EAGLE", "speculative sampled, draft model")


def checks(part: str = "all") -> dict:
  """name -> check (returns a detail string, ok, or raises; a "loops" check returns {run: (ok, detail)}).

  `part`: "fast" (CI: every logits check, FAST_RUNS on 2x4, the 1x1 program), "more" (the other loops on
  2x4, and FAST_RUNS again on a 1x8 mesh with Explicit axes, jax.make_mesh's default, heads replicated)
  or "all". Each loop compiles its program twice (one device, mesh): the loops are most of the time.
  """
  fast = {
    **{f"logits {d}x{m}": functools.partial(check_logits, d, m) for d, m in ((1, 8), (2, 4), (4, 2), (8, 1))},
    "logits 2x4 scan_layers": check_scan_logits,
    "logits qkv_bias": check_bias_logits,
    "loops 2x4": lambda: check_loops(make_mesh(2, 4), FAST_RUNS),
    "loops 8x1": lambda: check_loops(make_mesh(8, 1), ["generate sampled"]),
    "8x1: each device decodes its rows, no collective while decoding": check_rows_only_program,
    "2x1: generate inside a caller's shard_map": check_inside_callers_shard_map,
    "2x1: each device's rows take the Pallas blocks": check_rows_only_kernels,
    "1x1 mesh compiles today's program": check_one_device_mesh,
    "embedding lookup: a psum, not a table all-gather": check_embedding_program,
    "embedding lookup: bits equal one device's": check_embedding_bits,
  }
  more = {
    "loops 2x4 more": lambda: check_loops(make_mesh(2, 4), [r for r in LOOP_RUNS if r not in FAST_RUNS]),
    "loops 1x8 Explicit": lambda: check_loops(jax.make_mesh((1, 8), ("data", "model")), FAST_RUNS),
    "loops 8x1 more": lambda: check_loops(make_mesh(8, 1), [r for r in FAST_RUNS if r != "generate sampled"]),
    "loops 8x1 Explicit": lambda: check_loops(
      jax.make_mesh((8, 1), ("data", "model")), ["speculative sampled, draft model"]
    ),
    "logits qkv_bias scan, 1x8": functools.partial(
      check_bias_logits, cases=(((2, 4), True), ((1, 8), False)), with_eagle=False
    ),
  }
  return {"fast": fast, "more": more, "all": {**fast, **more}}[part]


def main(part: str = "all") -> dict[str, dict]:
  return run_checks(checks(part))


if __name__ == "__main__":
  exit_unless_devices(NUM_DEVICES)
  print(json.dumps(main(part_arg(sys.argv[1:]))))
