#!/usr/bin/env bash
# Paired A/B of two `fl` binaries on a shared 2-core machine: both run `fl bench` at once, one
# per core (one thread each, pinned with taskset), swapping cores every repetition, so that a
# noisy neighbour or a frequency drop slows both alike. Prints one line per model and
# repetition: binary, model, train samples/s (two measurements), eval samples/s, for each side.
#
#   bench/paired.sh OLD_BINARY NEW_BINARY MODELS INPUT REPETITIONS [SAMPLES]
#   bench/paired.sh /tmp/fl-old target/release/fl cnn2,cnn3 3x32x32 4
set -euo pipefail
if [ $# -lt 5 ]; then
  echo "usage: $0 OLD_BINARY NEW_BINARY MODELS INPUT REPETITIONS [SAMPLES]" >&2
  exit 1
fi
old=$1 new=$2 models=$3 input=$4 reps=$5 samples=${6:-200}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
run() { # binary core output
  taskset -c "$2" "$1" bench --models "$models" --input "$input" --samples "$samples" \
    --clients 1 --epochs 3 --threads 1 2>/dev/null |
    awk -v b="$(basename "$1")" -F'|' '$2 ~ /[a-z]/ && $3 ~ /[0-9]/ {print b, $2, $4, $5, $6}' >"$3"
}
for r in $(seq 1 "$reps"); do
  a=$((r % 2)) b=$(((r + 1) % 2))
  run "$old" "$a" "$tmp/old" &
  run "$new" "$b" "$tmp/new" &
  wait
  paste -d' ' "$tmp/old" "$tmp/new"
done
