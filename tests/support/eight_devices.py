"""Runs the many-device checks in ONE subprocess with 8 fake CPU devices (the device count is fixed
when JAX starts, so such checks cannot run in the ordinary pytest process).

Two workers hold the checks: tests/support/mesh_worker.py (models and loops, "models") and
tests/support/mesh_sampler_worker.py (the samplers split over the vocabulary, "samplers"). Each
has parts ("fast", and the slow-marked "more" / "more-meshes"). `start_workers` starts one process
that runs the asked parts one after the other:

    python -m tests.support.eight_devices models=fast samplers=fast

which prints one JSON object on its last line, {worker: {check name: {"ok": bool, "detail": str}}}.
tests/conftest.py starts it after collection and its session fixtures read it (`worker_results`), once per
run, pytest-xdist's workers included.
"""

from __future__ import annotations

import fcntl
import importlib
import json
import os
import pathlib
import subprocess
import sys
import threading
import time
import traceback

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Compiling dominates a worker's time, most of it in XLA's CPU code generation for small
# programs: LLVM at level 0 halves it, and the older elemental emitters (instead of the
# fusion emitters) save a quarter to a half more. One-device and mesh runs in a worker
# share the flags, so every comparison is like for like.
FLAGS = (
  "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
)


def exit_unless_devices(n: int) -> None:
  """In a worker: report a setup failure (the JSON line worker_results reads) and exit unless JAX sees n devices."""
  import jax  # (the worker's XLA_FLAGS are read when JAX starts: not at this module's import)

  if len(jax.devices()) != n:
    print(
      json.dumps(
        {
          "setup": {
            "ok": False,
            "detail": f"expected {n} devices (XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}), got {len(jax.devices())}",
          }
        }
      )
    )
    sys.exit(1)


def run_checks(checks: dict) -> dict[str, dict]:
  """In a worker: runs each check on its own, {name: {"ok", "detail"}} (what worker_results reads).

  A check returns a detail string, or {run: (ok, detail)} for several runs, reported as "name: run".
  An exception fails the check, traceback in its detail, and the next check runs.
  """
  results = {}
  for name, fn in checks.items():
    start = time.perf_counter()
    try:
      out = fn()
    except Exception as e:  # noqa: BLE001 (reported to the parent test, which fails on it)
      results[name] = {"ok": False, "detail": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"}
      continue
    seconds = f" ({time.perf_counter() - start:.1f} s)"
    if isinstance(out, dict):
      results.update({f"{name}: {run}": {"ok": ok, "detail": detail + seconds} for run, (ok, detail) in out.items()})
    else:
      results[name] = {"ok": True, "detail": out + seconds}
  return results


def part_arg(argv: list[str]) -> str:
  """In a worker: the part named by `--part NAME` (its only argument), else "all"."""
  return argv[1] if argv[:1] == ["--part"] and len(argv) == 2 else "all"


WORKERS = {"models": "tests.support.mesh_worker", "samplers": "tests.support.mesh_sampler_worker"}


def _command(parts: dict[str, str]) -> tuple[list[str], dict[str, str]]:
  """The subprocess's argv and environment for `parts` (worker -> part)."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {FLAGS}".strip()
  env["JAX_PLATFORMS"] = "cpu"  # fake devices are CPU devices, also on a machine with a GPU
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
  args = [f"{worker}={part}" for worker, part in sorted(parts.items())]
  return [sys.executable, "-m", "tests.support.eight_devices", *args], env


def _parse(parts: dict[str, str], returncode: int, stdout: str, stderr: str) -> dict[str, dict]:
  lines = stdout.strip().splitlines()
  if returncode != 0 or not lines:
    pytest.fail(f"the 8-device workers ({parts}) exited with {returncode}:\n{stdout[-3000:]}\n{stderr[-5000:]}")
  return json.loads(lines[-1])


def _files(parts: dict[str, str], shared_dir: pathlib.Path) -> dict[str, pathlib.Path]:
  name = "_".join(f"{w}-{p}" for w, p in sorted(parts.items()))
  return {k: shared_dir / f"eight_devices_{name}.{k}" for k in ("lock", "out", "err", "done")}


def start_workers(parts: dict[str, str], shared_dir: pathlib.Path) -> None:
  """Starts the subprocess of `parts` in the background, once per `shared_dir` (the first pytest process to ask
  starts it; pytest-xdist's other workers find it started), so that it compiles while the tests run."""
  if not parts:
    return
  files = _files(parts, shared_dir)
  with open(files["lock"], "a") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    if files["out"].exists():
      return
    argv, env = _command(parts)
    out, err = open(files["out"], "w"), open(files["err"], "w")  # noqa: SIM115 (closed by `wait`)
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out, stderr=err, text=True)

  def wait():
    code = proc.wait(timeout=1800)
    out.close()
    err.close()
    files["done"].write_text(str(code))  # written last: its presence says the output is complete

  threading.Thread(target=wait, daemon=True).start()


def worker_results(parts: dict[str, str], shared_dir: pathlib.Path) -> dict[str, dict]:
  """The results of the subprocess `start_workers` started for `parts` (starting it now if nobody has)."""
  files = _files(parts, shared_dir)
  start_workers(parts, shared_dir)
  deadline = time.monotonic() + 1800
  while not files["done"].exists():
    if time.monotonic() > deadline:
      pytest.fail(f"the 8-device workers ({parts}) did not finish in 30 minutes")
    time.sleep(0.2)
  return _parse(parts, int(files["done"].read_text()), files["out"].read_text(), files["err"].read_text())


def workers_needed(session, fixture_name: str) -> set[str]:
  """The workers (a test module's EIGHT_DEVICE_WORKER) of the collected tests that use `fixture_name`."""
  return {item.module.EIGHT_DEVICE_WORKER for item in session.items if fixture_name in item.fixturenames}


def check_result(results: dict, name: str) -> None:
  """Fails unless the worker ran check `name` and it passed. A check that returns several runs ("name: run")
  and failed as a whole is reported under its own name, which is looked up too."""
  result = results.get(name) or results.get(name.split(": ")[0])
  assert result is not None, f"the worker did not run {name!r}; it ran {sorted(results)}"
  assert result["ok"], result["detail"]


def main(argv: list[str]) -> dict[str, dict]:
  """In the subprocess: runs each `worker=part` of argv, in order."""
  exit_unless_devices(8)
  out = {}
  for arg in argv:
    worker, part = arg.split("=")
    start = time.perf_counter()
    out[worker] = importlib.import_module(WORKERS[worker]).main(part)
    print(f"{worker}={part}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
  return out


if __name__ == "__main__":
  print(json.dumps(main(sys.argv[1:])))
