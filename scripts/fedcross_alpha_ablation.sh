#!/usr/bin/env bash
# FedCross α ablation (the paper's Table 2 at a smaller scale): α ∈ {0.5, 0.9, 0.99, 0.999} ×
# selection ∈ {in-order, highest, lowest} on full Fashion-MNIST, cnn, 100 clients Dirichlet
# α=0.1, 10 per round, 1 local epoch, 30 rounds. Writes runs/ablation/<select>-a<alpha>/ and
# prints the `fl compare` table. Usage: scripts/fedcross_alpha_ablation.sh [FL_BINARY]
set -euo pipefail
FL=${1:-target/release/fl}
OUT=runs/ablation
mkdir -p "$OUT"
for select in in-order highest lowest; do
  for a in 0.5 0.9 0.99 0.999; do
    dir="$OUT/$select-a$a"
    [ -f "$dir/model.bpk" ] && continue                           # finished
    if [ -f "$dir/config.toml" ]; then "$FL" fedcross --resume "$dir" --quiet; continue; fi
    "$FL" fedcross --select "$select" --cross-alpha "$a" --clients 100 --sample 10 \
      --rounds 30 --local-epochs 1 --lr 0.01 --momentum 0.5 --partition dirichlet --alpha 0.1 \
      --eval-every 10 --seed 1 --quiet --out "$dir" ${FL_THREADS:+--threads $FL_THREADS}
  done
done
"$FL" compare "$OUT"/*/ --target 0.6
