#!/usr/bin/env bash
# The GPU path end to end: one tiny FedMR run on the `wgpu` backend (Mesa's lavapipe Vulkan
# driver on a machine without a GPU) against the same run on `flex`. Both start from the same
# weights (global models are initialised on the CPU and moved to the run's device), so their
# metrics must agree within a float tolerance: the GPU kernels reduce in other orders, so the
# runs are close, not bit-identical.
#
#   scripts/check-wgpu.sh                    # builds both binaries (about 12 min cold)
#   scripts/check-wgpu.sh FLEX_FL WGPU_FL    # or checks two binaries already built (CI does)
set -euo pipefail
cd "$(dirname "$0")/.."

# Lavapipe is installed only where no Vulkan driver is named (a GPU machine names its own in
# VK_DRIVER_FILES: scripts/gpu-figures.sh), and the dataset only where $FL_DATA_DIR lacks it.
if [ -z "${VK_DRIVER_FILES:-}" ] && ! ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1; then
  apt-get update -qq
  apt-get install -y -qq mesa-vulkan-drivers libvulkan1
fi
data=${FL_DATA_DIR:-/usr/share/datasets/fashion-mnist}
if [ ! -f "$data/train-images-idx3-ubyte" ] && [ ! -f "$data/train-images-idx3-ubyte.gz" ]; then
  apt-get install -y -qq dataset-fashion-mnist
fi

if [ $# -eq 2 ]; then
  flex=$1 wgpu=$2
else
  cargo build --release -p fl-cli
  # opt-level 0 (Cargo.toml's wgpu-check profile): a third of the build time, the same run time.
  cargo build -p fl-cli --features wgpu --profile wgpu-check
  flex=target/release/fl wgpu=target/wgpu-check/fl
fi

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# Vulkan's loader wants a runtime directory; CI shells have none.
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-$out}
args=(fedmr --dataset fashion-mnist --clients 200 --sample 4 --rounds 3 --local-epochs 1
  --batch-size 32 --partition dirichlet --alpha 0.5 --seed 7 --threads 2 --quiet)
"$flex" "${args[@]}" --out "$out/flex"
"$wgpu" "${args[@]}" --out "$out/wgpu"
for backend in flex wgpu; do
  grep -q "\"backend\": *\"$backend\"" "$out/$backend/manifest.json" || {
    echo "the $backend binary did not run on $backend:"; cat "$out/$backend/manifest.json"; exit 1
  }
done

python3 - "$out/flex/metrics.jsonl" "$out/wgpu/metrics.jsonl" <<'EOF'
import json, os, sys
manifests = [json.load(open(os.path.join(os.path.dirname(p), "manifest.json"))) for p in sys.argv[1:3]]
assert "device" not in manifests[0], "flex names no device"
assert manifests[1].get("device"), "the wgpu run names its device in manifest.json"
print("wgpu device:", manifests[1]["device"])
flex, wgpu = ([json.loads(l) for l in open(p)] for p in sys.argv[1:3])
assert len(flex) == len(wgpu) == 3, (len(flex), len(wgpu))
worst = {}
for a, b in zip(flex, wgpu):
    assert a["clients"] == b["clients"], "the same clients are sampled on both backends"
    for key, tol in [("train_loss", 1e-3), ("test_loss", 1e-3), ("test_acc", 0.005)]:
        if a.get(key) is None:
            continue
        diff = abs(a[key] - b[key]) / (max(abs(a[key]), 1.0) if key.endswith("loss") else 1.0)
        worst[key] = max(worst.get(key, 0.0), diff)
        assert diff <= tol, f"round {a['round']} {key}: flex {a[key]} vs wgpu {b[key]}"
print("wgpu matches flex:", ", ".join(f"{k} within {v:.2e}" for k, v in worst.items()))
for a, b in zip(flex, wgpu):
    print(f"  round {a['round']}: acc {a.get('test_acc')} / {b.get('test_acc')}, "
          f"train loss {a['train_loss']:.5f} / {b['train_loss']:.5f}")
EOF
