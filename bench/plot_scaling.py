"""Plots scaling over devices: the sampler's (`bench/sampler.py` JSONs) or the decoding loops' (`bench/mesh.py`).

Sampler: each input is one `sampler.json` (or a renamed copy) from the same
machine, run with a different --model-devices; the plot shows each case's time
per call against the number of devices the vocabulary is split over, beside the
ideal (one device's time / M), and the fraction of each device's floor.

    python bench/plot_scaling.py --out bench/results/multi_gpu_sampler.png \\
        bench/results/multi_gpu_sampler_1dev.json bench/results/multi_gpu_sampler_2dev.json

Loops (`--loops`): each input is a `bench/mesh.py` JSON (`--per-device` runs); one
panel per model, tokens/s on the mesh over one device's against the rows per
device, a line per split (DATAxMODEL) and call, with the ideal of data
parallelism (the number of data devices) dotted.

    python bench/plot_scaling.py --loops --out bench/results/mesh_scaling_h200x2.png \\
        bench/results/mesh_smollm2_real_b1_b8_h200x2.json bench/results/mesh_smollm2_real_b64_h200x2.json ...

Needs matplotlib (`pip install -e ".[bench]"`).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def load_rows(paths: list[str], cases: set[str] | None = None) -> dict[str, dict[int, dict]]:
  """{case: {M: row}} over the inputs (only `cases`, if given); raises ValueError if two inputs give one (case, M)."""
  rows: dict[str, dict[int, dict]] = defaultdict(dict)
  for path in paths:
    with open(path) as f:
      report = json.load(f)
    for r in report["results"]:
      if cases is not None and r["case"] not in cases:
        continue
      m = int(r.get("model_devices", 1))
      if m in rows[r["case"]]:
        raise ValueError(f"{path}: case {r['case']} with {m} device(s) is in two inputs")
      rows[r["case"]][m] = r
  return dict(rows)


def load_loop_rows(paths: list[str]) -> dict[str, dict[tuple[str, str], dict[int, float]]]:
  """{model title: {(split, call): {rows per device B: tokens/s on the mesh / one device's}}} over mesh.py JSONs.

  Raises ValueError if two inputs give one (model, split, call, B).
  """
  out: dict[str, dict[tuple[str, str], dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
  for path in paths:
    with open(path) as f:
      report = json.load(f)
    a = report["args"]
    model = ("tiny" if a.get("tiny") else a["shape"]) + (" (real weights)" if a.get("real") else " (random weights)")
    for row in report["rows"]:
      for split, res in row["splits"].items():
        for call, ratio in res["throughput_ratio"].items():
          line = out[model][(split, call)]
          if row["batch"] in line:
            raise ValueError(f"{path}: {model} {split} {call} at B={row['batch']} is in two inputs")
          line[row["batch"]] = ratio
  return {m: dict(lines) for m, lines in out.items()}


def plot_loops(paths: list[str], out: str) -> None:
  """The `--loops` figure (see the module docstring) into `out`."""
  models = load_loop_rows(paths)
  import matplotlib  # noqa: PLC0415  (a bench extra)

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
  styles = {"generate": "o-", "speculative (lookup)": "s--", "speculative (eagle)": "^-."}
  for ax, (model, lines) in zip(axes[0], sorted(models.items())):
    colours = {}
    for (split, call), by_b in sorted(lines.items()):
      bs = sorted(by_b)
      colour = colours.setdefault(split, f"C{len(colours)}")
      label = f"{split} ({'data' if split.endswith('x1') else 'model'} parallel) {call}"
      ax.plot(bs, [by_b[b] for b in bs], styles.get(call, "o:"), color=colour, label=label)
    for split in colours:
      ax.axhline(int(split.split("x")[0]), color=colours[split], linestyle=":", linewidth=1)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({b for by_b in lines.values() for b in by_b}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    top = max([int(split.split("x")[0]) for split in colours] + [max(max(b.values()) for b in lines.values())])
    ax.set(xlabel="rows per device (B)", ylabel="tokens/s over one GPU's", title=model, ylim=(0, 1.1 * top))
    ax.legend(fontsize=7, loc="lower right")
  fig.tight_layout()
  fig.savefig(out, dpi=100)
  plt.close(fig)
  print(f"wrote {out}")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("inputs", nargs="+", help="sampler.json files (one per --model-devices), or mesh.py JSONs")
  ap.add_argument("--loops", action="store_true", help="the inputs are bench/mesh.py JSONs: plot the loops")
  ap.add_argument("--out", required=True, help="the PNG to write")
  ap.add_argument("--cases", help="comma list: plot only these sampler cases (default: every case in the inputs)")
  args = ap.parse_args(argv)
  if args.loops:
    plot_loops(args.inputs, args.out)
    return
  rows = load_rows(args.inputs, None if args.cases is None else set(args.cases.split(",")))
  if not rows:
    ap.error(f"no sampler rows of the cases {args.cases} in the inputs")
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
