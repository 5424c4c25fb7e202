#!/usr/bin/env bash
# `fl sweep slurm` against a real Slurm: installs Debian's slurm-wlm and munge if missing,
# starts a single-node cluster (munged, slurmctld, slurmd on this host) from a minimal
# slurm.conf, submits a small sweep as a job array, waits for it, and checks that every run
# finished and equals the same sweep run locally (metrics without timings). Needs root (CI).
#
#   scripts/check-slurm.sh [path/to/fl]      (default: target/debug/fl, built if missing)
set -euo pipefail
cd "$(dirname "$0")/.."
FL=$(realpath "${1:-target/debug/fl}")
[ -x "$FL" ] || { cargo build -p fl-cli; FL=$(realpath target/debug/fl); }

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
fi

WORK=$(mktemp -d /tmp/fl-slurm.XXXXXX)
chmod 755 "$WORK"
cleanup() {
  [ -f "$WORK/slurmd.pid" ] && kill "$(cat "$WORK/slurmd.pid")" 2>/dev/null || true
  [ -f "$WORK/slurmctld.pid" ] && kill "$(cat "$WORK/slurmctld.pid")" 2>/dev/null || true
  [ -f "$WORK/munged.pid" ] && kill "$(cat "$WORK/munged.pid")" 2>/dev/null || true
  if [ -f "$WORK/passed" ]; then sleep 1; rm -rf "$WORK" || true; else echo "kept $WORK (logs)"; fi
}
trap cleanup EXIT

# munge: a key of our own and a daemon on our own socket.
mkdir -p "$WORK/munge"
chown munge:munge "$WORK/munge" && chmod 711 "$WORK/munge"
mungekey --create --keyfile="$WORK/munge/munge.key" --force
chown munge:munge "$WORK/munge/munge.key"
SOCKET="$WORK/munge/munge.socket"
runuser -u munge -- munged --key-file="$WORK/munge/munge.key" --socket="$SOCKET" \
  --pid-file="$WORK/munge/munged.pid" --log-file="$WORK/munge/munged.log" \
  --seed-file="$WORK/munge/munged.seed"
cp "$WORK/munge/munged.pid" "$WORK/munged.pid"

HOST=$(hostname -s)
CPUS=$(nproc)
MEM=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 512 ))
export SLURM_CONF="$WORK/slurm.conf"
mkdir -p "$WORK/state" "$WORK/spool"
cat > "$SLURM_CONF" <<EOF
ClusterName=fl-check
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$SOCKET
CredType=cred/munge
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd.pid
SlurmctldLogFile=$WORK/slurmctld.log
SlurmdLogFile=$WORK/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF" -N "$HOST"
for _ in $(seq 60); do
  sinfo -h -o %t 2>/dev/null | grep -q idle && break
  sleep 1
done
sinfo -h -o %t | grep -q idle || { echo "slurm did not come up"; tail -20 "$WORK"/slurm*.log; exit 1; }

# A small sweep: 2 algorithms × 2 seeds, 2 rounds of 2 of 100 clients.
spec() {
  cat <<EOF
seeds = [1, 2]
out = "$1"
[base]
dataset = "fashion-mnist"
model = "cnn"
clients = 100
sample = 2
rounds = 2
local_epochs = 1
partition = "dirichlet"
alpha = 0.5
threads = 1
[axes]
algorithm = ["fedavg", "fedmr"]
EOF
}
spec "$WORK/slurm-out" > "$WORK/slurm.toml"
spec "$WORK/local-out" > "$WORK/local.toml"
cd "$WORK"
wait_array() {
  for _ in $(seq 600); do
    [ -z "$(squeue -h -n fl-slurm)" ] && return 0
    sleep 1
  done
  echo "the job array did not finish"; squeue; exit 1
}
"$FL" sweep slurm slurm.toml --cpus-per-task 1 --time 00:20:00
wait_array
# Submitted again, only what did not finish runs: here one run whose directory was lost.
rm -r slurm-out/algorithm-fedmr/s1
"$FL" sweep slurm slurm.toml --cpus-per-task 1 | tee resubmit.txt
grep -q "1 of 4 runs (array 2)" resubmit.txt
wait_array
"$FL" sweep slurm slurm.toml | grep -q "every run of slurm.toml has finished"
"$FL" sweep plan slurm.toml
if "$FL" sweep plan slurm.toml | grep -q -v -e '\[done\]' -e 'runs into' -e '^work:'; then
  echo "not every run finished on Slurm:"; cat slurm-out/logs/*.log; exit 1
fi
"$FL" sweep run local.toml --jobs 2 --quiet
python3 - "$WORK/slurm-out" "$WORK/local-out" <<'EOF'
import json, pathlib, sys
def runs(root):
    out = {}
    for m in sorted(pathlib.Path(root).glob("*/s*/metrics.jsonl")):
        lines = [json.loads(l) for l in m.read_text().splitlines()]
        for l in lines:
            for k in [k for k in l if k.endswith("_seconds")]:
                del l[k]
        out[str(m.relative_to(root))] = lines
    return out
a, b = runs(sys.argv[1]), runs(sys.argv[2])
assert len(a) == 4 and a == b, (len(a), len(b))
print(f"slurm: {len(a)} runs equal the local sweep (metrics without timings)")
EOF
touch "$WORK/passed"
