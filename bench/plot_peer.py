"""Plots the sampler against vLLM's MRV2 sampler: ms per call by batch size, one panel per case.

Inputs: `bench/sampler.py` JSONs (ours; the newest row of a (case, B, V) wins) and
the peer harness's `peer.jsonl` (its "summary" rows, MRV2's whole call). Both
sides must come from one machine (bench/RESULTS.md says which).

    python bench/plot_peer.py --peer bench/results/sampler_peer_mrv2_h100.jsonl \\
        --out bench/results/sampler_vs_mrv2_h100.png \\
        bench/results/sampler_pallas_h100_small_batch.json bench/results/sampler_pallas_h100_151936.json

Needs matplotlib (`pip install -e ".[bench]"`).
"""

from __future__ import annotations

import argparse
import json

CASES = ("greedy_static", "random_ngram", "random_draft_probs", "random_topk_topp", "block_ngram", "block_draft_probs")


def load(ours_paths: list[str], peer_path: str, vocab: int):
  """({case: {B: ms}} ours, {case: {B: ms}} MRV2's whole call) at vocabulary `vocab`."""
  ours: dict[str, dict[int, float]] = {}
  for path in ours_paths:
    with open(path) as f:
      for r in json.load(f)["results"]:
        if r["V"] == vocab:
          ours.setdefault(r["case"], {})[r["B"]] = r["ms"]
  peer: dict[str, dict[int, float]] = {}
  with open(peer_path) as f:
    for line in f:
      r = json.loads(line)
      if r.get("type") == "summary" and r["V"] == vocab and r.get("mrv2_full"):
        peer.setdefault(r["ours_case"], {})[r["B"]] = r["mrv2_full"]
  return ours, peer


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("ours", nargs="+", help="bench/sampler.py JSONs")
  ap.add_argument("--peer", required=True, help="the peer harness's peer.jsonl")
  ap.add_argument("--vocab", type=int, default=151936)
  ap.add_argument("--out", required=True, help="PNG path")
  args = ap.parse_args(argv)
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  ours, peer = load(args.ours, args.peer, args.vocab)
  cases = [c for c in CASES if c in ours or c in peer]
  fig, axes = plt.subplots(1, len(cases), figsize=(3.2 * len(cases), 3.2), squeeze=False)
  for ax, case in zip(axes[0], cases):
    for label, data, style in (("specdec_jax", ours.get(case, {}), "o-"), ("vLLM MRV2", peer.get(case, {}), "s--")):
      bs = sorted(data)
      ax.plot(bs, [data[b] * 1e3 for b in bs], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(case, fontsize=9)
    ax.set_xlabel("batch B")
    ax.grid(True, which="both", alpha=0.3)
  axes[0][0].set_ylabel("us per call")
  axes[0][0].legend(fontsize=8)
  fig.suptitle(f"rejection sampler, K=4, V={args.vocab}, float32 (one machine)", fontsize=10)
  fig.tight_layout()
  fig.savefig(args.out, dpi=120)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
