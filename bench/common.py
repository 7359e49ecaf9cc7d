"""Timing helpers shared by the benchmarks in bench/.

What is here:
  - `device_info()`: device name, platform, JAX/Python versions, date, argv.
  - `device_memory_bytes()`: how much memory the first device can hold.
  - `timed_loop(step)`: jit a `lax.fori_loop` of `step` with a run-time start
    and trip count, so N iterations run in ONE dispatch (no per-call overhead).
  - `time_call(fn, *args)`: wall times of repeated calls of `fn(*args)`,
    synchronised with `jax.block_until_ready`.
  - `time_per_iter(loop, carry, operands)`: picks N, times N-iteration loops,
    checks that the time scales with N (2N should take about twice as long).
  - `copy_bandwidth()`: device-to-device bandwidth (bytes read + written per
    second) of an elementwise pass over a large buffer, in a timed loop too.
  - `hlo_ops()`: which op kinds (exponential, sort, reduce, ...) optimised HLO
    text holds; `hlo_materialized()`: which large arrays it writes to memory
    (outside fusions).

Two traps a loop benchmark must avoid, and how `timed_loop` users avoid them:
  - Dead code: XLA deletes work whose result reaches no output. The loop carry
    must be computed from each iteration's output.
  - Hoisting: XLA moves loop-invariant work out of the loop (it would then run
    once, not N times). The inputs of iteration i must depend on i or on the
    carry, e.g. rotate among several preallocated buffers (which also keeps
    them out of the L2 cache when their total is much larger than it).
`time_per_iter` keeps the iteration index running across calls (each loop
starts where the last one stopped), so rotation continues from loop to loop
and a short loop does not re-read buffers the previous loop left in cache.
"""

from __future__ import annotations

import datetime
import math
import platform
import re
import statistics
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp

GPU_L2_BYTES = 50 * 2**20  # H100: 50 MB of L2; rotated inputs should total well above it.


def has_gpu() -> bool:
  return jax.default_backend() == "gpu"


def device_info() -> dict:
  """Where and when a benchmark ran."""
  dev = jax.devices()[0]
  try:
    import jaxlib

    jaxlib_version = jaxlib.__version__
  except Exception:  # pragma: no cover - jaxlib always exists with jax
    jaxlib_version = None
  return {
    "device": dev.device_kind,
    "platform": dev.platform,
    "num_devices": jax.device_count(),
    "jax": jax.__version__,
    "jaxlib": jaxlib_version,
    "python": platform.python_version(),
    "host_cpu": platform.processor() or platform.machine(),
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "argv": sys.argv,
  }


def device_memory_bytes() -> int | None:
  """Bytes the first device can allocate (GPU), or available RAM (CPU)."""
  try:
    stats = jax.devices()[0].memory_stats()
    if stats and "bytes_limit" in stats:
      return int(stats["bytes_limit"])
  except Exception:
    pass
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def timed_loop(step: Callable) -> Callable:
  """Jits `loop(start, n, carry, *operands)`: `carry = step(i, carry, *operands)`
  for i in [start, start + n).

  `start` and `n` are run-time ints (no recompilation for new values). Pass
  large arrays as operands, never as closed-over constants: constants get
  folded and baked into the program.
  """

  @jax.jit
  def loop(start, n, carry, *operands):
    return jax.lax.fori_loop(start, start + n, lambda i, c: step(i, c, *operands), carry)

  return loop


def compile_loop(loop: Callable, carry, operands):
  """Ahead-of-time compiles a `timed_loop`; returns (compiled, seconds)."""
  t0 = time.perf_counter()
  compiled = loop.lower(0, 1, carry, *operands).compile()
  return compiled, time.perf_counter() - t0


def time_call(fn: Callable, *args, repeats: int = 5) -> list[float]:
  """Wall seconds of `fn(*args)` (blocked until ready) for each of `repeats` calls."""
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return times


def time_per_iter(
  loop: Callable,
  carry,
  operands,
  *,
  iters: int | None = None,
  max_iters: int = 100_000,
  target_s: float = 0.1,
  repeats: int = 5,
) -> dict:
  """Seconds per iteration of a `timed_loop`, without dispatch overhead.

  Compiles (unless `loop` is already compiled), runs one iteration to warm up
  and one more to estimate the time of an iteration, picks N so that one
  loop takes about `target_s` (or uses `iters`), then returns the median over
  `repeats` loops of N iterations divided by N. One extra loop of 2N
  iterations checks that the work really runs once per iteration:
  `scale` = t(2N) / min t(N) should be close to 2 (about 1 means the work was
  hoisted out of the loop or deleted).

  Returns:
    dict(per_iter_s, iters, times_s, scale, compile_s, compiled).
  """
  compile_s = 0.0
  if hasattr(loop, "lower"):
    loop, compile_s = compile_loop(loop, carry, operands)
  start = 0

  def run(n):
    nonlocal start
    t0 = time.perf_counter()
    jax.block_until_ready(loop(start, n, carry, *operands))
    start += n
    return time.perf_counter() - t0

  run(1)  # warm-up: the first call after compiling pays one-off costs
  est = run(1)
  if iters is None:
    iters = int(min(max(math.ceil(target_s / max(est, 1e-9)), 1), max_iters))
  times = [run(iters) for _ in range(repeats)]
  t_2n = run(2 * iters)
  return {
    "per_iter_s": statistics.median(times) / iters,
    "iters": iters,
    "times_s": times,
    "scale": t_2n / min(times),
    "compile_s": compile_s,
    "compiled": loop,
  }


def default_copy_bytes() -> int:
  return 2 * 2**30 if has_gpu() else 256 * 2**20


def copy_bandwidth(nbytes: int | None = None, *, repeats: int = 5, target_s: float = 0.2) -> dict:
  """Device memory bandwidth of an elementwise pass, bytes read + written per second.

  Each loop iteration computes `x = x + 1` over a float32 buffer of `nbytes`
  (2 GB on GPU, 256 MB on CPU by default): one read and one write of the
  buffer, the traffic of a device-to-device copy. (A plain copy inside a jitted
  loop would be elided by XLA; the add cannot be.) The loop's fixed cost
  (allocating the output, page faults on CPU) is removed by timing loops of N
  and 2N iterations: per iteration = (median t(2N) - median t(N)) / N.

  Returns:
    dict(bytes_per_s, buffer_bytes, per_iter_s, iters, scale).
  """
  nbytes = nbytes or default_copy_bytes()
  n = nbytes // 4
  x = jnp.zeros((n,), jnp.float32)
  loop, _ = compile_loop(timed_loop(lambda i, c: c + 1.0), x, ())
  jax.block_until_ready(loop(0, 1, x))
  est = min(time_call(loop, 0, 2, x, repeats=2)) / 2
  iters = max(3, math.ceil(target_s / est))
  t_n = statistics.median(time_call(loop, 0, iters, x, repeats=repeats))
  t_2n = statistics.median(time_call(loop, 0, 2 * iters, x, repeats=repeats))
  per_iter = (t_2n - t_n) / iters
  if per_iter <= 0:  # hopelessly noisy: fall back to the plain estimate
    per_iter = t_n / iters
  del x
  return {
    "bytes_per_s": 2 * n * 4 / per_iter,
    "buffer_bytes": n * 4,
    "per_iter_s": per_iter,
    "iters": iters,
    "scale": t_2n / t_n,
  }


HLO_OPS = ("exponential", "log", "sort", "reduce", "rng-bit-generator", "conditional", "while", "dynamic-slice", "copy")


def hlo_ops(text: str, ops=HLO_OPS) -> dict[str, int]:
  """How many times each op kind appears in HLO text (fused computations included).

  Also "threefry": instructions whose JAX op_name mentions JAX's default PRNG
  (random bits are ordinary integer ops or a custom call, not one op kind).
  """
  counts = {op: len(re.findall(rf"(?<![\w-]){re.escape(op)}\(", text)) for op in ops}
  counts["threefry"] = len(re.findall(r'op_name="[^"]*threefry', text))
  return counts


_COLLECTIVE = re.compile(
  r"= (\([^()]*\)|\S+) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)"
  r"(?:-start)?\("
)


def hlo_collectives(text: str) -> dict[str, int]:
  """Collective instructions in HLO text, counted by "opcode result-shape" (async -start forms included).

  Example:
    >>> hlo_collectives("%x = f32[8,32]{1,0} all-gather(f32[8,8]{1,0} %p), dimensions={1}")
    {'all-gather f32[8,32]': 1}
  """
  found = {}
  for shape, op in _COLLECTIVE.findall(text):
    key = op + " " + re.sub(r"{[^}]*}|/\*.*?\*/", "", shape)  # no layouts, no /*index=5*/ comments
    found[key] = found.get(key, 0) + 1
  return found


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (.+?) ([a-z][\w\-]*)\(")
_PASS_THROUGH = {
  "parameter",
  "get-tuple-element",
  "tuple",
  "bitcast",
  "constant",
  "while",
  "conditional",
  "call",
  "opt-barrier",
}


def hlo_materialized(text: str, min_elements: int) -> list[str]:
  """Arrays of at least `min_elements` that the program writes to memory.

  Looks at instructions outside fused computations (inside a fusion, values
  stay in registers); skips ones that only pass buffers along (parameter,
  tuple, while, ...). Every branch of a conditional is included, so this lists
  what the program *may* write. Returns "opcode dtype[dims] (jax op)" strings,
  one per instruction; "jax op" is the tail of the instruction's op_name.
  """
  fused = set(re.findall(r"\bfusion\(.*?calls=%([\w.\-]+)", text))
  out, in_fused = [], False
  for line in text.splitlines():
    head = re.match(r"^(?:ENTRY\s+)?%([\w.\-]+) .*\{$", line)
    if head:
      in_fused = head.group(1) in fused
      continue
    m = _INSTR.match(line)
    if not m or in_fused or m.group(3) in _PASS_THROUGH:
      continue
    for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(2)):
      if math.prod(int(d) for d in dims.split(",") if d) >= min_elements:
        op_name = re.search(r'op_name="([^"]*)"', line)
        where = "/".join(op_name.group(1).split("/")[-2:]) if op_name else "?"
        out.append(f"{m.group(3)} {dtype}[{dims}] ({where})")
  return out


def fmt_bytes(n: float) -> str:
  for unit in ("B", "KB", "MB", "GB", "TB"):
    if abs(n) < 1000 or unit == "TB":
      return f"{n:.3g} {unit}"
    n /= 1000
  return f"{n} B"
