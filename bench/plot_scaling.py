"""Plots the sampler's scaling over devices from `bench/sampler.py` JSONs run with different --model-devices.

Each input is one `sampler.json` (or a renamed copy) from the same machine; the
plot shows each case's time per call against the number of devices the
vocabulary is split over, beside the ideal (one device's time / M), and the
fraction of each device's floor.

    python bench/plot_scaling.py --out bench/results/multi_gpu_sampler.png \\
        bench/results/multi_gpu_sampler_1dev.json bench/results/multi_gpu_sampler_2dev.json

Needs matplotlib (`pip install -e ".[bench]"`).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def load_rows(paths: list[str]) -> dict[str, dict[int, dict]]:
  """{case: {M: row}} over the inputs; raises ValueError if two inputs give one (case, M)."""
  rows: dict[str, dict[int, dict]] = defaultdict(dict)
  for path in paths:
    with open(path) as f:
      report = json.load(f)
    for r in report["results"]:
      m = int(r.get("model_devices", 1))
      if m in rows[r["case"]]:
        raise ValueError(f"{path}: case {r['case']} with {m} device(s) is in two inputs")
      rows[r["case"]][m] = r
  return dict(rows)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("inputs", nargs="+", help="sampler.json files (one per --model-devices)")
  ap.add_argument("--out", required=True, help="the PNG to write")
  args = ap.parse_args(argv)
  rows = load_rows(args.inputs)
  import matplotlib  # noqa: PLC0415  (a bench extra)

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  fig, (ax_ms, ax_frac) = plt.subplots(1, 2, figsize=(11, 4))
  for case, by_m in sorted(rows.items()):
    ms = sorted(by_m)
    (line,) = ax_ms.plot(ms, [by_m[m]["ms"] for m in ms], "o-", label=case)
    if 1 in by_m:
      ax_ms.plot(ms, [by_m[1]["ms"] / m for m in ms], ":", color=line.get_color())
    ax_frac.plot(ms, [by_m[m]["frac"] for m in ms], "o-", color=line.get_color(), label=case)
  any_row = next(iter(next(iter(rows.values())).values()))
  title = f"B={any_row['B']}, K={any_row['K']}, V={any_row['V']}, f32"
  ax_ms.set(xlabel="devices (vocabulary split)", ylabel="ms per call", title=f"time per call ({title}; dotted: ideal)")
  ax_frac.set(
    xlabel="devices (vocabulary split)",
    ylabel="fraction of each device's floor",
    ylim=(0, 1.05),
    title="fraction of the floor",
  )
  for ax in (ax_ms, ax_frac):
    ax.set_xticks(sorted({m for by_m in rows.values() for m in by_m}))
  ax_ms.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(args.out, dpi=100)
  plt.close(fig)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
