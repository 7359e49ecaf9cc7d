#!/bin/bash
# A training round of Qwen2.5-Coder-1.5B's EAGLE head on a lent machine of N GPUs: one device call a step.
#
# Before the first step: the GGUF in place (bench/gguf_parts.py) and the wheels of gguf, tokenizers and
# safetensors installed (carry .whl; `python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl`).
# Everything goes to $ROUND (default /root/eagle/R), which lasts while the machine stays warm. The head the
# round starts from is the shipped one: carry specdec_jax/weights/qwen2_5_coder_eagle.safetensors.
#
#   bash bench/coder_head_round.sh data N [SECONDS]        # the data: one process a GPU (--data-shard), then joined
#   bash bench/coder_head_round.sh train N STEPS SECONDS   # training on N GPUs; the same line continues it
#   bash bench/coder_head_round.sh pack OUT                # the data and the head into OUT, in parts of 15 MB
#   bash bench/coder_head_round.sh restore DIR             # the data from a carried DIR of pack's parts (.eagle)
#   bash bench/coder_head_round.sh loop OUT [SECONDS]      # the new head in the loop on GPU 0 (bench/real_target.py)
#
# `data` and `train` stop inside SECONDS (default 540) and pick up where they stopped when run again. A later
# session carries pack's data parts (e.g. in .eagle, with data.npz.sha256) and runs `restore .eagle` instead of
# `data`. DATA_FLAGS (default the third round's: --more-questions --self-questions 8 --samples 0,1,1,1,1) and
# TRAIN_FLAGS (default --depth 5 --kind-weights question=2) replace the defaults; the flags are
# examples/train_eagle.py's (a block drafter: TRAIN_FLAGS="--drafter block --block-size 8 --blocks-per-row 8
# --position-decay 3"). LOOP_FLAGS replaces the loop's drafter flags (default: the head, --eagle-ks 4 --trees
# d5x8x32; a block drafter: LOOP_FLAGS="--block $ROUND/head.safetensors --block-ks 8 --eagle-ks 4 --trees=").
#
# Two rounds can share one GPU (on 2026-11-29 the head at 2.27 steps a second and a block drafter at 5.6, run at
# once): give each XLA_PYTHON_CLIENT_MEM_FRACTION=.42, and the second its own ROUND with the data linked in
# (mkdir -p /root/eagle/B && ln -sf /root/eagle/R/data.npz /root/eagle/B/data.npz).
set -euo pipefail
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
R=${ROUND:-/root/eagle/R}
DATA_FLAGS=${DATA_FLAGS:---more-questions --self-questions 8 --samples 0,1,1,1,1}
TRAIN_FLAGS=${TRAIN_FLAGS:---depth 5 --kind-weights question=2}
LOOP_FLAGS=${LOOP_FLAGS:---eagle $R/head.safetensors --eagle-ks 4 --trees d5x8x32}
SHIPPED=specdec_jax/weights/qwen2_5_coder_eagle.safetensors
# shellcheck disable=SC2206  # the flags are words
TE=(python3 examples/train_eagle.py --target qwen2.5-coder-1.5b --data-cache "$R/data.npz" $DATA_FLAGS)
usage() {
  grep '^#   bash' "$0" >&2
  exit 2
}
mkdir -p "$R"
case "${1:-}" in
  data)
    n=${2:?N}
    limit=${3:-540}
    if [ -f "$R/data.npz" ]; then
      echo "$R/data.npz is there already"
      exit 0
    fi
    gen=("${TE[@]}" --data-only --prefill-tokens 65536)
    CUDA_VISIBLE_DEVICES=0 "${gen[@]}" --data-shard "0/$n" --wall-limit-s "$limit" > "$R/shard0.log" 2>&1 &
    first=$!
    case " $DATA_FLAGS " in
      *" --self-questions "*)  # the first process writes the questions every process reads
        while [ ! -f "$R/data.npz.questions.json" ] && kill -0 "$first" 2> /dev/null; do sleep 2; done
        ;;
    esac
    for i in $(seq 1 $((n - 1))); do
      CUDA_VISIBLE_DEVICES=$i "${gen[@]}" --data-shard "$i/$n" --wall-limit-s $((limit - 30)) > "$R/shard$i.log" 2>&1 &
    done
    wait
    for i in $(seq 0 $((n - 1))); do grep "^data shard" "$R/shard$i.log" || tail -n 3 "$R/shard$i.log"; done
    # Joins the shards' files (and generates what they left, within a minute).
    CUDA_VISIBLE_DEVICES=0 "${gen[@]}" --wall-limit-s 80 2>&1 | grep -v "it/s]" | tail -n 4
    ;;
  train)
    n=${2:?N}
    steps=${3:?STEPS}
    limit=${4:-540}
    # shellcheck disable=SC2086
    "${TE[@]}" --init "$SHIPPED" --devices "$n" --batch-size $((16 * n)) --steps "$steps" $TRAIN_FLAGS \
      --state "$R/state.msgpack" --out "$R/head.safetensors" --wall-limit-s "$limit" 2>&1 | grep -v "it/s]" | tail -n 40
    ;;
  pack)
    out=${2:?OUT}
    mkdir -p "$out"
    # A call brings back at most 8 files of 16 MiB, 64 MiB in all: the data (22 MB) and the head (35 MB in
    # int8) go in parts, joined here again with `cat NAME.part* > NAME`.
    for f in data.npz head.safetensors; do split -b 15000000 -d "$R/$f" "$out/$f.part"; done
    sha256sum "$R/data.npz" > "$out/data.npz.sha256"
    cp "$R/head.json" "$out/"
    ls -l "$out"
    ;;
  restore)
    src=${2:?DIR}
    cat "$src"/data.npz.part* > "$R/data.npz"
    if [ -f "$src/data.npz.sha256" ]; then
      want=$(cut -d' ' -f1 "$src/data.npz.sha256")
      got=$(sha256sum "$R/data.npz" | cut -d' ' -f1)
      [ "$want" = "$got" ] || { echo "restore: $R/data.npz has sha256 $got, expected $want" >&2; exit 1; }
    fi
    ls -l "$R/data.npz"
    ;;
  loop)
    out=${2:?OUT}
    limit=${3:-400}
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=0 python3 bench/real_target.py --model qwen2.5-coder-1.5b --kernels pallas --ks= --repeats 2 \
      $LOOP_FLAGS --modes greedy,t1 --budget-s "$limit" --out "$out" 2>&1 | grep -v "it/s]" | tail -n 30
    ;;
  *) usage ;;
esac
