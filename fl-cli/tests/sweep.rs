//! `fl sweep`: expansion, local runs N at a time, restart after a kill, failures and retries,
//! the report.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// A sweep of 2 algorithms × 2 learning rates × 2 seeds plus one explicit cell: 10 small runs
/// (2 of 100 clients per round, 2 rounds) into `out`.
fn spec(dir: &Path, out: &Path, extra: &str) -> PathBuf {
    let path = dir.join("sweep.toml");
    std::fs::write(
        &path,
        format!(
            "seeds = [1, 2]\nout = \"{}\"\n\n[base]\ndataset = \"fashion-mnist\"\nmodel = \"cnn\"\n\
             clients = 100\nsample = 2\nrounds = 2\nlocal_epochs = 1\nbatch_size = 32\n\
             partition = \"dirichlet\"\nalpha = 0.5\nthreads = 1\n\n[base.fedmr]\nfirst_stage = 1\n\n\
             [axes]\nalgorithm = [\"fedavg\", \"fedmr\"]\nlr = [0.01, 0.05]\n\n\
             [[cells]]\nname = \"prox\"\nalgorithm = \"fedprox\"\n\"fedprox.mu\" = 0.1\n{extra}",
            out.display()
        ),
    )
    .unwrap();
    path
}

fn sweep(args: &[&str], spec: &Path) -> std::process::Output {
    let mut all = vec!["sweep", args[0], spec.to_str().unwrap()];
    all.extend(&args[1..]);
    fl(&all)
}

/// Every run directory of a sweep output (cell/sSEED) with its metrics.
fn all_metrics(out: &Path) -> Vec<(String, Vec<serde_json::Value>)> {
    let mut runs = Vec::new();
    let Ok(cells) = std::fs::read_dir(out) else {
        return runs;
    };
    for cell in cells {
        let cell = cell.unwrap().path();
        let Ok(seeds) = std::fs::read_dir(&cell) else {
            continue;
        };
        for run in seeds {
            let run = run.unwrap().path();
            if run.join("metrics.jsonl").is_file() {
                let name = run.strip_prefix(out).unwrap().display().to_string();
                runs.push((name, metrics(&run)));
            }
        }
    }
    runs.sort_by(|a, b| a.0.cmp(&b.0));
    runs
}

#[test]
fn a_sweep_expands_deterministically_and_bad_files_are_one_line_errors() {
    let dir = tmp();
    let path = spec(dir.path(), &dir.path().join("out"), "");
    let o = sweep(&["plan"], &path);
    assert!(o.status.success(), "{}", stderr(&o));
    let plan = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(plan.contains("5 cells × seeds = 10 runs"), "{plan}");
    let names: Vec<&str> = plan
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        .filter(|w| w.contains("/s"))
        .collect();
    assert_eq!(
        names,
        [
            "algorithm-fedavg_lr-0.01/s1",
            "algorithm-fedavg_lr-0.01/s2",
            "algorithm-fedavg_lr-0.05/s1",
            "algorithm-fedavg_lr-0.05/s2",
            "algorithm-fedmr_lr-0.01/s1",
            "algorithm-fedmr_lr-0.01/s2",
            "algorithm-fedmr_lr-0.05/s1",
            "algorithm-fedmr_lr-0.05/s2",
            "prox/s1",
            "prox/s2",
        ]
    );
    assert!(plan.contains("[new]") && plan.contains("work: 40 client-epochs"));
    for (text, expected) in [
        ("[axes]\nalpha = 0.1\n", "axis `alpha` must be a list"),
        ("[base]\nseed = 3\n", "`seed` is the sweep's to set"),
        ("[axes]\nalgorithm = []\n", "axis `algorithm` has no values"),
        (
            "[axes]\nlr = [0.1]\nmodel = [\"nope\"]\n",
            "cell 'lr-0.1_model-nope'",
        ),
        (
            "[[cells]]\nname = \"a\"\n[[cells]]\nname = \"a\"\n",
            "two cells are named 'a'",
        ),
        ("[axes]\nalgorithm = [\"fedavg\"]\nbogus = [1]\n", "bogus"),
        ("seeds = []\n", "`seeds` must list at least one seed"),
        ("seeds = [1, 2, 1]\n", "`seeds` lists 1 twice"),
        (
            "[axes]\nlr = [0.1, -1.0]\n",
            "cell 'lr--1.0': invalid configuration: learning rate must be a positive number",
        ),
    ] {
        let bad = dir.path().join("bad.toml");
        std::fs::write(&bad, text).unwrap();
        fails(&["sweep", "plan", bad.to_str().unwrap()], expected);
    }
    fails(
        &["sweep", "run", path.to_str().unwrap(), "--cell", "10"],
        "has 10 runs (0 to 9), not 10",
    );
    // Bundles set several settings at once, named by their `name` (or their values).
    let bundles = dir.path().join("bundles.toml");
    std::fs::write(
        &bundles,
        "[axes]\nmethod = [{ name = \"fs50\", algorithm = \"fedmr\", \"fedmr.first_stage\" = 50 }, \
         { algorithm = \"fedavg\", lr = 0.05 }]\n",
    )
    .unwrap();
    let o = sweep(&["plan"], &bundles);
    let plan = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(plan.contains("method-fs50/s1  fedmr"), "{plan}");
    assert!(plan.contains("method-fedavg-0.05/s1  fedavg"), "{plan}");
    // Every shipped sweep file expands.
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sweeps");
    for f in std::fs::read_dir(shipped).unwrap() {
        let f = f.unwrap().path();
        let o = fl(&["sweep", "plan", f.to_str().unwrap()]);
        assert!(o.status.success(), "{}: {}", f.display(), stderr(&o));
    }
}

#[test]
fn a_killed_sweep_restarts_where_it_stopped_and_ends_as_an_uninterrupted_one() {
    let dir = tmp();
    let (a_out, b_out) = (dir.path().join("a"), dir.path().join("b"));
    std::fs::create_dir_all(dir.path().join("sa")).unwrap();
    std::fs::create_dir_all(dir.path().join("sb")).unwrap();
    let a = spec(&dir.path().join("sa"), &a_out, "");
    let b = spec(&dir.path().join("sb"), &b_out, "");
    // Uninterrupted, two at a time.
    let o = sweep(&["run", "--jobs", "2", "--quiet"], &a);
    assert!(o.status.success(), "{}", stderr(&o));
    // Killed (SIGTERM) once its first run has finished a round, then started again.
    let mut child = Command::new(FL)
        .args(["sweep", "run", b.to_str().unwrap(), "--quiet"])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while all_metrics(&b_out).is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no round finished"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    assert!(kill.unwrap().success());
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130), "a stopped sweep exits 130");
    let plan = String::from_utf8_lossy(&sweep(&["plan"], &b).stdout).into_owned();
    assert!(plan.contains("[new]"), "the kill left runs to do: {plan}");
    let o = sweep(&["run", "--jobs", "2", "--quiet"], &b);
    assert!(o.status.success(), "{}", stderr(&o));
    let (ra, rb) = (all_metrics(&a_out), all_metrics(&b_out));
    assert_eq!(ra.len(), 10);
    assert_eq!(ra, rb);
    // The report: the pivot of final accuracies and every cell's row, the same for both.
    let report = |s: &Path| {
        String::from_utf8_lossy(&sweep(&["report", "--target", "0.99"], s).stdout).into_owned()
    };
    let (ta, tb) = (report(&a), report(&b));
    assert!(
        ta.contains("| algorithm (final acc %, seeds) | lr=0.01 | lr=0.05 |"),
        "{ta}"
    );
    assert!(ta.contains("| prox | 2 | 2 |"), "{ta}");
    assert_eq!(ta, tb);
    // A finished sweep has nothing left to do.
    let o = sweep(&["run"], &a);
    assert!(
        o.status.success() && stderr(&o).contains("10/10 runs done"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn failed_runs_are_reported_kept_and_retried_on_request() {
    let dir = tmp();
    let out = dir.path().join("out");
    // A learning rate that makes the loss non-finite: each run fails in its first round.
    let path = dir.path().join("fail.toml");
    std::fs::write(
        &path,
        format!(
            "out = \"{}\"\n[base]\nclients = 100\nsample = 2\nrounds = 1\nlocal_epochs = 1\n\
             threads = 1\nlr = 1e12\n[axes]\nmodel = [\"cnn\"]\n",
            out.display()
        ),
    )
    .unwrap();
    fails(
        &["sweep", "run", path.to_str().unwrap(), "--quiet"],
        "1 of 1 runs failed",
    );
    let marker = out.join("model-cnn/s1.failed");
    let why = std::fs::read_to_string(&marker).unwrap();
    assert!(why.contains("loss is"), "{why}");
    let plan = String::from_utf8_lossy(&sweep(&["plan"], &path).stdout).into_owned();
    assert!(plan.contains("[failed]"), "{plan}");
    // Not retried unless asked; retried (and failing again) when asked.
    let o = sweep(&["run"], &path);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("retry with --retry-failed"),
        "{}",
        stderr(&o)
    );
    fails(
        &[
            "sweep",
            "run",
            path.to_str().unwrap(),
            "--retry-failed",
            "--quiet",
        ],
        "1 of 1 runs failed",
    );
}

#[test]
fn a_dry_run_writes_the_slurm_job_array_of_the_unfinished_runs() {
    let dir = tmp();
    let path = spec(dir.path(), &dir.path().join("out"), "");
    let o = sweep(
        &[
            "slurm",
            "--dry-run",
            "--array-limit",
            "3",
            "--time",
            "01:00:00",
        ],
        &path,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let script = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(script.contains("#SBATCH --array=0-9%3"), "{script}");
    assert!(script.contains("#SBATCH --time=01:00:00"), "{script}");
    assert!(script.contains("sweep run") && script.contains("--cell \"$SLURM_ARRAY_TASK_ID\""));
    assert!(dir.path().join("out/slurm/job.sh").is_file());
}

#[test]
fn more_rounds_in_the_sweep_file_extend_its_runs_and_other_changes_are_refused() {
    let dir = tmp();
    let one = |name: &str, rounds: usize, lr: f64| {
        let path = dir.path().join(format!("{name}.toml"));
        std::fs::write(
            &path,
            format!(
                "out = \"{}\"\n[base]\nclients = 100\nsample = 2\nrounds = {rounds}\n\
                 local_epochs = 1\nbatch_size = 32\nthreads = 1\nlr = {lr}\n\
                 [axes]\nmodel = [\"cnn\"]\n",
                dir.path().join(name).display()
            ),
        )
        .unwrap();
        path
    };
    let run = dir.path().join("grown/model-cnn/s1");
    let o = sweep(&["run", "--quiet"], &one("grown", 1, 0.01));
    assert!(o.status.success(), "{}", stderr(&o));
    // Another learning rate would mix two settings in one run: refused, naming the change.
    let o = sweep(&["run", "--quiet"], &one("grown", 2, 0.05));
    assert_eq!(o.status.code(), Some(1));
    let why = std::fs::read_to_string(run.with_extension("failed")).unwrap();
    assert!(
        why.contains("started with other settings (now `lr = 0.05`, was `lr = 0.01`)"),
        "{why}"
    );
    assert_eq!(metrics(&run).len(), 1);
    // More rounds continue it, as a run of that many rounds from the start.
    let o = sweep(
        &["run", "--retry-failed", "--quiet"],
        &one("grown", 2, 0.01),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let o = sweep(&["run", "--quiet"], &one("fresh", 2, 0.01));
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        metrics(&run),
        metrics(&dir.path().join("fresh/model-cnn/s1"))
    );
    let config = std::fs::read_to_string(run.join("config.toml")).unwrap();
    assert!(config.contains("rounds = 2\n"), "{config}");
}
