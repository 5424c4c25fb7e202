#!/usr/bin/env bash
# README's GPU figures in one call of a lent GPU machine (the `device` tool), which has no
# network, no Rust and no apt: everything it needs is built here and carried there.
#
#   scripts/gpu-figures.sh prepare   # here: release `flex` and `wgpu` binaries and Fashion-MNIST
#                                    # into .gpu/, the Vulkan loader's package into .gl/
#   scripts/gpu-figures.sh run       # there (carry .gpu and .gl): the wgpu check against flex,
#                                    # `fl bench` of every model on wgpu, FedMR rounds on both
#                                    # backends, `fl bench` on flex; output under $OUT (or
#                                    # target/gpu-figures)
#
# `run` also works on a machine without a GPU (wgpu then runs on Mesa's lavapipe), which is how
# it is tried before a GPU is spent on it. Each step has its own time limit in seconds, from the
# environment: GPU_CHECK_S (default 120), GPU_BENCH_S (per model, 90), GPU_ROUND_S (120); and
# GPU_TOTAL_S (480) bounds the whole run, after which the remaining steps are skipped, so that it
# ends inside one device call and a slow step costs only its own figures. GPU_MODELS picks the
# models (default: every model of the three papers), GPU_THREADS the flex runs' threads (default:
# every core).
set -uo pipefail
cd "$(dirname "$0")/.."

prepare() {
  set -e
  cargo build --release -p fl-cli
  local wgpu_target=${WGPU_TARGET_DIR:-target/wgpu}
  cargo build --release -p fl-cli --features wgpu --target-dir "$wgpu_target"
  rm -rf .gpu .gl
  mkdir -p .gpu/fashion-mnist .gl
  # A device call carries 64 MiB with the working tree (about 9): stripped and xz-compressed,
  # the two binaries (about 200 MiB as built) and Fashion-MNIST's training set take about 50.
  # Its test set travels anyway (fl-data/data).
  local bin
  for bin in fl:target/release/fl fl-wgpu:"$wgpu_target"/release/fl; do
    strip -o ".gpu/${bin%%:*}" "${bin#*:}"
    xz -9e -T0 -f ".gpu/${bin%%:*}"
  done
  local data=${FL_DATA_DIR:-/usr/share/datasets/fashion-mnist} file
  if [ ! -f "$data/train-images-idx3-ubyte.gz" ]; then
    apt-get install -y -qq dataset-fashion-mnist
    data=/usr/share/datasets/fashion-mnist
  fi
  for file in train-images-idx3-ubyte train-labels-idx1-ubyte; do
    gzip -dc "$data/$file.gz" | xz -9e -T0 >".gpu/fashion-mnist/$file.xz"
  done
  # The Vulkan loader, for a machine without one (unpacked there by `run`).
  local lists=/tmp/gpu-figures-apt o
  mkdir -p "$lists/partial"
  o=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists="$lists"
    -oAPT::Sandbox::User=root)
  apt-get "${o[@]}" update -qq
  (cd .gl && rm -f ./*.deb && apt-get "${o[@]}" download libvulkan1)
  local exclude dir
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  for dir in /.gpu/ /.gl/; do
    grep -qx "$dir" "$exclude" 2>/dev/null || echo "$dir" >>"$exclude"
  done
  du -sh .gpu .gl
}

# Runs "$@" under a limit of $1 seconds (cut to what is left of GPU_TOTAL_S), its output
# appended to $out/$2 and shown. A step that fails or runs over is reported, never fatal.
step() {
  local limit=$1 log=$2 left rc
  shift 2
  left=$((deadline - SECONDS))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 10 ]; then
    echo "== skipped (GPU_TOTAL_S spent): $*" | tee -a "$out/$log"
    return 0
  fi
  echo "== $*" | tee -a "$out/$log"
  timeout --kill-after=5 "$limit" "$@" 2>&1 | tee -a "$out/$log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then
    echo "== exit $rc$([ "$rc" -eq 124 ] && echo " (over $limit s)")" | tee -a "$out/$log"
  fi
  return 0
}

# The metrics of the FedMR runs, one line per round.
summarise() {
  python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
for backend in ("wgpu", "flex"):
    run = os.path.join(out, f"run-{backend}")
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.exists(path):
        print(f"fedmr {backend}: no metrics")
        continue
    device = json.load(open(os.path.join(run, "manifest.json"))).get("device", "CPU")
    for line in open(path):
        r = json.loads(line)
        secs = sum(r.get(k) or 0.0 for k in ("train_seconds", "aggregate_seconds", "eval_seconds"))
        print(f"fedmr {backend} ({device}) round {r['round']}: {secs:.2f} s (train "
              f"{r['train_seconds']:.2f}, eval {r['eval_seconds']:.2f}), acc {r.get('test_acc')}")
PY
}

run() {
  # A device call brings back at most 8 files: machine.txt, check-wgpu.txt, bench-wgpu.txt,
  # fedmr.txt (the runs' output), summary.txt, bench-flex.txt.
  out=${OUT:-target/gpu-figures}
  deadline=$((SECONDS + ${GPU_TOTAL_S:-480}))
  mkdir -p "$out"
  rm -rf "$out"/*.txt "$out"/run-*
  local flex=.gpu/fl wgpu=.gpu/fl-wgpu bin
  # What is unpacked here is removed at the end, so that .gpu stays small enough to carry.
  trap 'rm -f .gpu/fl .gpu/fl-wgpu .gpu/fashion-mnist/*-ubyte .gpu/fashion-mnist/*.gz' EXIT
  for bin in "$flex".xz "$wgpu".xz .gpu/fashion-mnist/{train-images-idx3-ubyte,train-labels-idx1-ubyte}.xz; do
    if [ ! -f "$bin" ]; then
      echo "error: no $bin: run 'scripts/gpu-figures.sh prepare' first"
      exit 1
    fi
    # Python's lzma: a machine may lack the xz tool.
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
      "$bin" "${bin%.xz}"
  done
  chmod +x "$flex" "$wgpu"
  cp fl-data/data/t10k-*-ubyte.gz .gpu/fashion-mnist/
  export FL_DATA_DIR=$PWD/.gpu/fashion-mnist
  export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-$(mktemp -d)}
  if ! ldconfig -p | grep -q 'libvulkan\.so\.1' && ls .gl/*.deb >/dev/null 2>&1; then
    for bin in .gl/*.deb; do dpkg -x "$bin" /; done
    ldconfig
  fi
  # The NVIDIA driver's Vulkan manifest sits outside the loader's search path on those machines.
  local icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f "$icd" ]; then export VK_DRIVER_FILES=$icd; fi

  {
    date -u
    uname -srm
    echo "$(nproc) cores"
    if command -v nvidia-smi >/dev/null; then
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    fi
    echo "VK_DRIVER_FILES=${VK_DRIVER_FILES:-}"
    git log -1 --format='commit %H' 2>/dev/null || true
  } 2>&1 | tee "$out/machine.txt"

  local threads=${GPU_THREADS:-$(nproc)} model backend
  local models=${GPU_MODELS:-cnn,cnn-fedavg,resnet20,resnet20-ref,vgg16,mobilenet-v1,mobilenet-v2,mobilenet-v3,cnn1,cnn2,cnn3,cnn4}
  local bench=(bench --clients 2 --epochs 1 --samples 200 --input 3x32x32)

  # 1. Correctness: the same 3-round FedMR on both backends, metrics within tolerance.
  step "${GPU_CHECK_S:-120}" check-wgpu.txt scripts/check-wgpu.sh "$flex" "$wgpu"

  # 2. Speed on the GPU: README's `fl bench` settings, one model per call so that a slow one
  # costs only itself ("threads" only sets how many clients train at once there).
  for model in ${models//,/ }; do
    step "${GPU_BENCH_S:-90}" bench-wgpu.txt "$wgpu" "${bench[@]}" --models "$model" --threads 2
  done

  # 3. Three FedMR rounds at the paper's client settings (10 clients × 5 epochs, batch 50) on
  # Fashion-MNIST, on the GPU and on flex with every core.
  for backend in wgpu flex; do
    bin=$([ "$backend" = wgpu ] && echo "$wgpu" || echo "$flex")
    rm -rf "$out/run-$backend"  # left by an earlier, stopped call
    step "${GPU_ROUND_S:-120}" fedmr.txt "$bin" fedmr --dataset fashion-mnist --model cnn \
      --clients 100 --sample 10 --rounds 3 --local-epochs 5 --batch-size 50 \
      --partition dirichlet --alpha 0.1 --seed 1 --threads "$threads" --quiet --out "$out/run-$backend"
  done
  summarise | tee "$out/summary.txt"
  rm -rf "$out"/run-*

  # 4. The same benchmarks on this machine's CPU, last: they matter least.
  for model in ${models//,/ }; do
    step "${GPU_BENCH_S:-90}" bench-flex.txt "$flex" "${bench[@]}" --models "$model" --threads "$threads"
  done
  echo "done in $SECONDS s" | tee -a "$out/summary.txt"
}

case "${1:-}" in
  prepare) prepare ;;
  run) run ;;
  *)
    echo "usage: scripts/gpu-figures.sh prepare|run"
    exit 1
    ;;
esac
