#!/usr/bin/env bash
# The wheel that bench/hf_peer.py needs on the offline GPU machine, and its install there.
#
#   bash bench/hf_peer_wheels.sh            # here (network): download into .whl/ (git-ignored; `carry` it to the GPU)
#   bash bench/hf_peer_wheels.sh install    # on the GPU machine: install into /tmp/site, offline; then run the
#                                           # script with PYTHONPATH=/tmp/site
#
# transformers loads a GGUF file through two packages:
#   gguf 0.19.0        dequantizes the tensors. NOT on the GPU image: carried here as a wheel. Pure Python
#                      (py3-none-any). Requires-Dist: numpy, pyyaml, tqdm, requests; all on the GPU image (requests is
#                      imported only inside gguf's remote-file helpers anyway), so --no-deps is enough.
#   accelerate         from_pretrained(gguf_file=...) refuses to run without it ("accelerate is required when loading
#                      a GGUF file"). On the GPU image (1.15.0, with psutil); `install` checks it.
#   sentencepiece is not needed: transformers builds the Qwen2 and SmolLM2 (llama) tokenizers from the GGUF's
#   vocabulary with `tokenizers` alone (checked with sentencepiece and requests made unimportable).
set -euo pipefail
cd "$(dirname "$0")/.."
GGUF_VERSION=0.19.0

case "${1:-download}" in
  download)
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .whl "gguf==${GGUF_VERSION}"
    echo "gguf-${GGUF_VERSION} needs:"
    unzip -p .whl/gguf-"${GGUF_VERSION}"-py3-none-any.whl '*/METADATA' | grep '^Requires-Dist' | grep -v 'extra =='
    ;;
  install)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/gguf-"${GGUF_VERSION}"-py3-none-any.whl
    PYTHONPATH=/tmp/site python3 -c "import gguf, accelerate, psutil, transformers, torch
print('gguf', gguf.__file__, '| accelerate', accelerate.__version__, '| transformers', transformers.__version__,
      '| torch', torch.__version__)" || {
      echo "missing a package: accelerate (and psutil) must be there too; download their wheels like gguf's" >&2
      exit 1
    }
    ;;
  *)
    echo "usage: $0 [download|install]" >&2
    exit 2
    ;;
esac
