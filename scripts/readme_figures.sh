#!/usr/bin/env bash
# Re-creates the README's 200-round comparisons: runs the configs (skipping finished runs,
# resuming interrupted ones) and writes docs/fmnist-dir{0.1,0.5}-200.png plus the compare tables.
# Usage: scripts/readme_figures.sh [FL_BINARY]   (about 25 CPU-minutes per run on this machine)
set -euo pipefail
FL=${1:-target/release/fl}
mkdir -p docs runs
run() { # run NAME ALGORITHM
  local dir=runs/fmnist-cnn-$1
  [ -f "$dir/model.bpk" ] && return
  if [ -f "$dir/config.toml" ]; then "$FL" "$2" --resume "$dir" --quiet; return; fi
  "$FL" run "configs/fmnist-cnn-$1.toml" --quiet --out "$dir"
}
for alg in fedavg fedmr fedcross; do run "dir0.1-$alg" "$alg"; run "dir0.5-$alg" "$alg"; done
run dir0.1-fedmr-fs50 fedmr
"$FL" plot runs/fmnist-cnn-dir0.1-{fedavg,fedmr,fedmr-fs50,fedcross} -o docs/fmnist-dir0.1-200.png \
  --title "Fashion-MNIST, cnn, 100 clients, Dirichlet 0.1"
"$FL" plot runs/fmnist-cnn-dir0.5-{fedavg,fedmr,fedcross} -o docs/fmnist-dir0.5-200.png \
  --title "Fashion-MNIST, cnn, 100 clients, Dirichlet 0.5"
"$FL" compare runs/fmnist-cnn-dir0.1-{fedavg,fedmr,fedmr-fs50,fedcross} --target 0.75
"$FL" compare runs/fmnist-cnn-dir0.5-{fedavg,fedmr,fedcross} --target 0.8
