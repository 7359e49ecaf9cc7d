"""XLA compiler flags against the decode step: does any of them cut the B=1 step?

Runs `bench/step_profile.py --variants after` once per flag set, each in its
own process (XLA reads its flags when the backend starts), with the set
*appended* to the XLA_FLAGS already in the environment (replacing the list
drops XLA's defaults, which once made verification 2-2.7x slower). Each run
times a decode step (T=1) and a verification call (T=K+1) at every batch size
and, with --trace, counts the step's kernel launches from a profiler trace.
A flag set that fails to compile or run is recorded with its error, and the
sweep goes on.

    python bench/flag_sweep.py --out /tmp/flags                      # the built-in sets (GPU)
    python bench/flag_sweep.py --out /tmp/flags --sets "a=--xla_cpu_use_xnnpack=true" --tiny   # CPU smoke run

Writes OUT/flag_sweep.json (per set: its flags, step_profile's rows, launches
and kernel time per step) and prints a table of microseconds against the
first set (the baseline, no extra flags).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

# name -> flags appended to XLA_FLAGS. The first set is the baseline.
GPU_SETS = {
  "baseline": "",
  # Keep matrix-vector products as dots (a GEMM library call or a Triton GEMM) instead of the
  # multiply + reduce that XLA rewrites them into at one row.
  "no-strength-red": "--xla_gpu_enable_dot_strength_reduction=false",
  "no-strength-red+cublas": "--xla_gpu_enable_dot_strength_reduction=false --xla_gpu_enable_triton_gemm=false",
  "cublas": "--xla_gpu_enable_triton_gemm=false",
  # Fewer, fatter kernels: every fusion through Triton, Triton multi-output fusions, block-level fusions.
  "all-triton": "--xla_gpu_experimental_all_fusions_with_triton=true",
  "triton-multi-output": "--xla_gpu_unsupported_enable_triton_multi_output_fusion=true",
  "block-level": "--xla_gpu_experimental_enable_fusion_block_level_rewriter=true",
  "heroless": "--xla_gpu_experimental_enable_triton_heroless_priority_fusion=true",
}


def parse_sets(text: str) -> dict[str, str]:
  """`name=flags;name=flags` -> {name: flags} (the first is the baseline)."""
  sets = {}
  for item in filter(None, (s.strip() for s in text.split(";"))):
    name, sep, flags = item.partition("=")
    if not sep or not name:
      raise ValueError(f"--sets: expected name=flags items separated by ';', got {item!r}")
    sets[name] = flags
  if not sets:
    raise ValueError("--sets: no flag set given")
  return sets


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", required=True, help="directory for flag_sweep.json")
  ap.add_argument("--sets", default="", help="name=flags;name=flags ... (default: the built-in GPU sets)")
  ap.add_argument("--batch-sizes", default="1,8")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--trace", action="store_true", help="also count kernel launches per step (profiler trace)")
  ap.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke run)")
  ap.add_argument("--timeout-s", type=float, default=240.0, help="per flag set")
  args = ap.parse_args(argv)
  try:
    sets = parse_sets(args.sets) if args.sets else GPU_SETS
  except ValueError as e:
    ap.error(str(e))
  os.makedirs(args.out, exist_ok=True)
  script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "step_profile.py")
  base_flags = os.environ.get("XLA_FLAGS", "")
  results = {}
  for name, flags in sets.items():
    with tempfile.TemporaryDirectory() as tmp:
      cmd = (
        [
          sys.executable,
          script,
          "--out",
          tmp,
          "--variants",
          "after",
          "--batch-sizes",
          args.batch_sizes,
          "--repeats",
          str(args.repeats),
          "--no-plot",
        ]
        + (["--tiny"] if args.tiny else [])
        + (["--trace", os.path.join(tmp, "trace")] if args.trace else [])
      )
      env = dict(os.environ, XLA_FLAGS=f"{base_flags} {flags}".strip())
      t0 = time.time()
      try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s)
        ok = proc.returncode == 0
        tail = (proc.stdout + proc.stderr)[-1500:]
      except subprocess.TimeoutExpired:
        ok, tail = False, f"timed out after {args.timeout_s} s"
      entry = {"flags": flags, "ok": ok, "seconds": round(time.time() - t0, 1)}
      if ok:
        with open(os.path.join(tmp, "step_profile.json")) as f:
          report = json.load(f)
        entry["rows"] = report["rows"]
        entry["info"] = report["info"]
        kernels = report.get("kernels", {}).get("after")  # step_profile traces `after` by default
        if kernels:
          entry["launches_per_step"] = round(sum(r["per_step"] for r in kernels), 1)
          entry["kernel_us_per_step"] = round(sum(r["us_per_step"] for r in kernels), 1)
          entry["top_kernels"] = kernels[:12]
      else:
        entry["error"] = tail
      results[name] = entry
      figures = " ".join(f"B{r['B']}T{r['T']}={r['us']:.0f}us" for r in entry.get("rows", []))
      print(
        f"{name:24s} {'ok' if ok else 'FAILED'} {entry['seconds']:6.1f}s  {figures}  "
        f"launches {entry.get('launches_per_step', '-')}",
        flush=True,
      )
      if not ok:
        print("   " + tail.strip().splitlines()[-1][:300] if tail.strip() else "", flush=True)
  with open(os.path.join(args.out, "flag_sweep.json"), "w") as f:
    json.dump({"base_xla_flags": base_flags, "sets": results}, f, indent=1)
  base = next(iter(results.values()))
  if base.get("ok"):
    print("\nmicroseconds (x baseline):")
    for name, entry in results.items():
      cells = []
      for r in entry.get("rows", []):
        ref = next((b["us"] for b in base["rows"] if (b["B"], b["T"]) == (r["B"], r["T"])), None)
        cells.append(f"B{r['B']}T{r['T']} {r['us']:.0f} ({r['us'] / ref:.2f})" if ref else f"{r['us']:.0f}")
      print(f"  {name:24s} " + "  ".join(cells))
  print(f"wrote {args.out}/flag_sweep.json")


if __name__ == "__main__":
  main()
