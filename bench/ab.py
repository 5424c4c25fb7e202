#!/usr/bin/env python3
"""A/B of two `fl` binaries on one run: its timings side by side, and whether its results match.

Runs the same `fl` command line with binary A and binary B in ABBA quads (A, B, B, A; each in a
fresh run directory), so that a drift of the machine's speed within a quad hits both sides
alike, and reports for every timing of `metrics.jsonl` (`*_seconds`, pFedClub's `phase_seconds`,
summed over the rounds) and the process's wall time each side's median and the median and range
of the quads' B/A ratios. Then it checks that every run gave the same results as A's first:
`metrics.jsonl` without its timings, and the bytes of `checkpoint.safetensors` and `model.bpk`
(what "refactors change no results" asks of a change), so one command both times a change and
shows it changes nothing, or where it does.

    bench/ab.py /tmp/fl-old target/release/fl --quads 4 -- fedavg --dataset fashion-mnist \\
        --model resnet20 --clients 100 --sample 1 --rounds 1 --local-epochs 3 --seed 7 --threads 2
    bench/ab.py OLD NEW --require-identical -- pfedclub --zoo III --rounds 1 --seed 1

`--out` and `--quiet` are added to the command line. Exit status 1 if a run fails, or with
`--require-identical` if the results differ; single runs on a shared machine move by 10-30%,
so read ratios from several quads.
"""

import argparse
import hashlib
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

COMPARED_FILES = ("checkpoint.safetensors", "model.bpk")


def is_timing(key):
    return key.endswith("_seconds")


def timings(records, wall):
    """Each timing of the run summed over its rounds, and the process's wall time."""
    out = {"wall": wall}
    for r in records:
        for k, v in r.items():
            if k == "phase_seconds" and isinstance(v, dict):
                for phase, s in v.items():
                    out[f"phase:{phase}"] = out.get(f"phase:{phase}", 0.0) + s
            elif is_timing(k) and isinstance(v, (int, float)):
                out[k] = out.get(k, 0.0) + v
    return out


def digest(path):
    """SHA-256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def results(run_dir):
    """What the run computed: its metrics without timings, and its result files' bytes."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    metrics = [{k: v for k, v in r.items() if not is_timing(k)} for r in records]
    # Digests, not the bytes: a VGG-16 checkpoint is 134 MB, and every run's are kept.
    files = {name: digest(run_dir / name) for name in COMPARED_FILES if (run_dir / name).exists()}
    return records, metrics, files


def first_difference(a, b):
    """Where run b's results first differ from run a's, or None."""
    (ma, fa), (mb, fb) = a, b
    if len(ma) != len(mb):
        return f"{len(mb)} rounds of metrics against {len(ma)}"
    for ra, rb in zip(ma, mb):
        for key in sorted(set(ra) | set(rb)):
            if ra.get(key) != rb.get(key):
                return (f"round {ra.get('round')}: {key} = {json.dumps(rb.get(key))[:60]} "
                        f"against {json.dumps(ra.get(key))[:60]}")
    for name in sorted(set(fa) | set(fb)):
        if fa.get(name) != fb.get(name):
            return f"{name} differs"
    return None


def run(binary, args, out):
    begin = time.perf_counter()
    done = subprocess.run([binary, *args, "--quiet", "--out", str(out)],
                          capture_output=True, text=True)
    wall = time.perf_counter() - begin
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        sys.exit(f"error: {binary} exited with {done.returncode}: {tail}")
    return wall


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", help="binary A (the baseline)")
    p.add_argument("b", help="binary B (the change)")
    p.add_argument("--quads", type=int, default=3, help="ABBA quads (default 3: 12 runs)")
    p.add_argument("--require-identical", action="store_true",
                   help="exit 1 if any run's results differ from A's first run's")
    p.usage = "%(prog)s A B [--quads N] [--require-identical] -- FL_SUBCOMMAND [FLAGS...]"
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = p.parse_args(argv[:cut])
    fl_args = argv[cut + 1:]
    if a.quads < 1:
        p.error(f"--quads {a.quads}: must be at least 1")
    if not fl_args:
        p.error("no fl command line: give it after `--`, e.g. -- fedavg --rounds 1")
    if any(f in fl_args for f in ("--out", "--resume")):
        p.error("--out and --resume are set by ab.py (a fresh run directory per run)")
    for binary in (a.a, a.b):
        if not pathlib.Path(binary).is_file():
            p.error(f"{binary}: no such file")

    print(f"A: {a.a}\nB: {a.b}\n{a.quads} quads (A B B A): fl {' '.join(fl_args)}\n")
    side = {"A": a.a, "B": a.b}
    runs = []  # (side, timings, results)
    with tempfile.TemporaryDirectory(prefix="fl-ab-") as tmp:
        for q in range(a.quads):
            for i, s in enumerate("ABBA"):
                out = pathlib.Path(tmp) / f"q{q}-{i}"
                wall = run(side[s], fl_args, out)
                records, metrics, files = results(out)
                runs.append((s, timings(records, wall), (metrics, files)))
                print(f"  quad {q + 1} {s}: wall {wall:.2f} s", file=sys.stderr, flush=True)

    keys = list(dict.fromkeys(k for _, t, _ in runs for k in t))
    print("| timing (s, summed over rounds) | A median | B median | B/A (median of quads) "
          "| B/A range |\n|---|---|---|---|---|")
    for k in keys:
        va = [t[k] for s, t, _ in runs if s == "A" and k in t]
        vb = [t[k] for s, t, _ in runs if s == "B" and k in t]
        ratios = []
        for q in range(a.quads):
            quad = runs[4 * q:4 * q + 4]
            sa = sum(t.get(k, 0.0) for s, t, _ in quad if s == "A")
            sb = sum(t.get(k, 0.0) for s, t, _ in quad if s == "B")
            if sa > 0:
                ratios.append(sb / sa)
        if not va or not vb or not ratios:
            continue
        print(f"| {k} | {statistics.median(va):.4g} | {statistics.median(vb):.4g} | "
              f"{statistics.median(ratios):.3f} | {min(ratios):.3f}-{max(ratios):.3f} |")

    reference = runs[0][2]
    differences = [(n, s, d) for n, (s, _, r) in enumerate(runs)
                   if (d := first_difference(reference, r)) is not None]
    compared = "metrics.jsonl without timings" + "".join(
        f", {name}" for name in COMPARED_FILES if name in reference[1])
    if not differences:
        print(f"\nresults: identical in all {len(runs)} runs ({compared})")
        return
    print(f"\nresults: {len(differences)} of {len(runs)} runs differ from A's first "
          f"({compared}):")
    for n, s, d in differences:
        print(f"  run {n + 1} ({s}): {d}")
    if a.require_identical:
        sys.exit(1)


if __name__ == "__main__":
    main()
