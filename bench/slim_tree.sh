#!/bin/bash
# Keeps the shipped weights (66 MB, over the lent GPU's 64 MiB a call) and the benchmarks' records (bench/results
# and bench/archive, 5 MB) from travelling with device calls.
#
# A device call copies the tracked files and the untracked ones git does not ignore. `slim_tree.sh on` takes
# specdec_jax/weights/*.safetensors, bench/results and bench/archive out of the index (the files stay on disk)
# and ignores them in .git/info/exclude, so they stay behind and a 60 MB part of bench/gguf_parts.py fits beside
# the repository (3 MB); `carry` can still take a file along by name. `off` puts them back in the index from
# HEAD and drops the exclusions; files new in bench/results are then untracked, to be added by name. Between
# the two, commit only named paths (`git commit PATHS`): a plain `git commit` would record them all as deleted. `status` says which state the tree is in.
#
#   bash bench/slim_tree.sh on      # before the device calls (then: gguf_parts.py parts of 60 MB travel)
#   bash bench/slim_tree.sh off     # after them
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude=.git/info/exclude
mark="# slim_tree.sh: weights kept off device calls"
kept=("/specdec_jax/weights/*.safetensors" "/bench/results/" "/bench/archive/")
case "${1:-status}" in
  on)
    grep -qxF "$mark" "$exclude" 2>/dev/null || printf '%s\n' "$mark" "${kept[@]}" >> "$exclude"
    git rm -r -q --cached --ignore-unmatch specdec_jax/weights/*.safetensors bench/results bench/archive
    echo "slim: the weights and bench/results, bench/archive are out of the index (on disk still); run" \
      "'bash bench/slim_tree.sh off' before a plain commit"
    ;;
  off)
    if grep -qxF "$mark" "$exclude" 2>/dev/null; then
      grep -vxF -e "$mark" "${kept[@]/#/-e}" "$exclude" > "$exclude.tmp" || true
      mv "$exclude.tmp" "$exclude"
    fi
    git reset -q HEAD -- specdec_jax/weights bench/results bench/archive
    echo "whole: the weights and bench/results, bench/archive are back in the index"
    ;;
  status)
    if grep -qxF "$mark" "$exclude" 2>/dev/null; then echo "slim (weights stay behind)"; else echo "whole"; fi
    git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -n 1 | awk '{printf "tracked files on disk: %.1f MB\n", $1 / 1e6}'
    ;;
  *)
    echo "usage: bash bench/slim_tree.sh on|off|status" >&2
    exit 2
    ;;
esac
