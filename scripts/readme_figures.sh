#!/usr/bin/env bash
# Re-creates the README's 200-round comparison: runs the three configs (skipping finished runs)
# and writes docs/fmnist-dir0.1-200.png plus the compare table.
# Usage: scripts/readme_figures.sh [FL_BINARY]   (about 25 CPU-minutes per run on this machine)
set -euo pipefail
FL=${1:-target/release/fl}
mkdir -p docs runs
for alg in fedavg fedmr fedcross; do
  dir=runs/fmnist-cnn-dir0.1-$alg
  [ -f "$dir/model.bpk" ] && continue
  if [ -f "$dir/checkpoint.safetensors" ]; then "$FL" "$alg" --resume "$dir" --quiet; continue; fi
  "$FL" run "configs/fmnist-cnn-dir0.1-$alg.toml" --quiet --out "$dir"
done
"$FL" plot runs/fmnist-cnn-dir0.1-{fedavg,fedmr,fedcross} -o docs/fmnist-dir0.1-200.png \
  --title "Fashion-MNIST, cnn, 100 clients, Dirichlet 0.1"
"$FL" compare runs/fmnist-cnn-dir0.1-{fedavg,fedmr,fedcross} --target 0.75
