//! Reliability of the `fl` binary (README "Reliability"): hostile input is a one-line error
//! before anything is written, a run directory is never shared, damaged run files are caught,
//! Ctrl-C stops cleanly, and a run's files are byte-identical at any thread count.

mod common;

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;

use common::*;

/// Writes an IDX split `prefix` of `count` images of `side`×`side`.
fn write_idx(dir: &Path, prefix: &str, count: usize, side: usize) {
    let write = |name: String, magic: u32, dims: &[u32], payload: &[u8]| {
        let mut bytes = magic.to_be_bytes().to_vec();
        dims.iter()
            .for_each(|d| bytes.extend_from_slice(&d.to_be_bytes()));
        bytes.extend_from_slice(payload);
        std::fs::write(dir.join(name), bytes).unwrap();
    };
    let pixels: Vec<u8> = (0..count * side * side).map(|i| (i % 251) as u8).collect();
    let labels: Vec<u8> = (0..count).map(|i| (i % 10) as u8).collect();
    let n = count as u32;
    let s = side as u32;
    write(
        format!("{prefix}-images-idx3-ubyte"),
        0x803,
        &[n, s, s],
        &pixels,
    );
    write(format!("{prefix}-labels-idx1-ubyte"), 0x801, &[n], &labels);
}

#[test]
fn images_of_another_size_are_an_error_not_a_panic() {
    for (train, test, expected) in [
        (
            32,
            28,
            "training images are 1×32×32 but test images are 1×28×28",
        ),
        (
            28,
            20,
            "training images are 1×28×28 but test images are 1×20×20",
        ),
        (
            32,
            32,
            "fashion-mnist images are 1×28×28, but these are 1×32×32",
        ),
    ] {
        let dir = tmp();
        write_idx(dir.path(), "train", 40, train);
        write_idx(dir.path(), "t10k", 10, test);
        let data = dir.path().display().to_string();
        let out = dir.path().join("run").display().to_string();
        let line = "fedavg --clients 4 --sample 2 --rounds 1 --local-epochs 1 --quiet";
        let args = [words(line), vec!["--data-dir", &data, "--out", &out]].concat();
        fails(&args, expected);
        assert!(!Path::new(&out).exists(), "{out} was created");
    }
}

#[test]
fn bad_settings_are_refused_before_the_run_directory_exists() {
    let dir = tmp();
    let out = dir.path().join("x");
    let out_s = out.display().to_string();
    let cases: &[(&str, &str)] = &[
        ("--batch-size 0", "batch size must be at least 1"),
        ("--rounds 0", "rounds must be at least 1"),
        (
            "--clients 5 --sample 6",
            "cannot sample 6 clients per round from 5",
        ),
        ("--lr nan", "learning rate must be a positive number"),
        ("--threads 0", "threads must be between 1 and"),
        ("--threads 1000", "threads must be between 1 and"),
        (
            "--parallel-clients 0",
            "parallel-clients must be at least 1",
        ),
        ("--eval-batch-size 0", "eval-batch-size must be at least 1"),
        ("--eval-every 0", "eval-every must be at least 1"),
        (
            "--partition dirichlet-balanced --min-client-size 5",
            "--min-client-size does not apply to --partition dirichlet-balanced",
        ),
        (
            "--partition iid --alpha 0.1",
            "--alpha does not apply to --partition iid",
        ),
        (
            "--classes-per-client 3",
            "--classes-per-client does not apply to --partition dirichlet",
        ),
        (
            "--seeds 1,2,1",
            "--seeds lists 1 twice: both runs would share one directory",
        ),
        // A tiny α is printed as written, not as 300 digits.
        (
            "--alpha 1e-300 --clients 50 --min-client-size 1000",
            "alpha=1e-300",
        ),
    ];
    for (extra, expected) in cases {
        let mut args = words("fedavg --local-epochs 1 --quiet");
        args.extend(words(extra));
        args.extend(["--out", &out_s]);
        fails(&args, expected);
        assert!(!out.exists(), "fl {args:?} created {out_s}");
    }
    let fedmr = "fedmr --rounds 1 --segment-fraction 0.3 --quiet --out";
    fails(
        &[words(fedmr), vec![&out_s]].concat(),
        "--segment-fraction applies only with --granularity segments",
    );
    // A cause is said once, not repeated after its own message.
    let o = fl(&[
        "fedavg",
        "--partition-file",
        "/nonexistent/p.json",
        "--out",
        &out_s,
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        stderr(&o).matches("No such file").count(),
        1,
        "{}",
        stderr(&o)
    );
    assert!(!out.exists());
}

/// Starts a long FedAvg run into `out` and returns once it has finished a round.
fn start_long_run(out: &Path) -> Child {
    let args = small_run(out, "2", "200");
    let mut child = Command::new(FL)
        .args(&args)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    while std::fs::read_to_string(out.join("metrics.jsonl")).map_or(0, |t| t.lines().count()) == 0 {
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

#[test]
fn a_run_directory_is_never_shared_and_ctrl_c_stops_cleanly() {
    let dir = tmp();
    let out = dir.path().join("run");
    let out_s = out.display().to_string();
    let child = start_long_run(&out);
    let holder = format!("in use by process {}", child.id());
    // A second run into the same directory, even with another seed, and a resume of it while
    // it runs: both refused, naming the holder.
    let mut second = small_run(&out, "2", "3");
    let seed = second.iter().position(|a| a == "--seed").unwrap();
    second[seed + 1] = "8".into();
    fails(
        &second.iter().map(String::as_str).collect::<Vec<_>>(),
        &holder,
    );
    fails(&["fedavg", "--resume", &out_s, "--quiet"], &holder);

    // Ctrl-C: the round under way finishes, then the process stops with 130 and says how to go on.
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(130));
    let said = String::from_utf8_lossy(&o.stderr);
    assert!(
        said.contains(&format!("continue with: fl fedavg --resume {out_s}")),
        "{said}"
    );
    let done = metrics(&out).len();
    assert!((1..200).contains(&done), "{done} rounds");
    let last = std::fs::read(out.join("checkpoint.safetensors")).unwrap();
    assert!(!last.is_empty());
    // It resumes exactly where it stopped (and the lock went with the process).
    let config = || std::fs::read_to_string(out.join("config.toml")).unwrap();
    let before = config();
    let more = (done + 1).to_string();
    run_ok(&[
        "fedavg".into(),
        "--resume".into(),
        out_s.clone(),
        "--rounds".into(),
        more.clone(),
        "--quiet".into(),
    ]);
    assert_eq!(metrics(&out).len(), done + 1);
    // config.toml now holds the new round count, and only that changed: resuming as the
    // interrupt message says (without --rounds) finds the run finished, not 200 rounds long.
    let after = config();
    let changed: Vec<(&str, &str)> = before
        .lines()
        .zip(after.lines())
        .filter(|(a, b)| a != b)
        .collect();
    assert_eq!(changed, [("rounds = 200", &*format!("rounds = {more}"))]);
    let o = fl(&["fedavg", "--resume", &out_s, "--quiet"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains(&format!("already finished its {more} rounds")),
        "{}",
        stderr(&o)
    );
    assert_eq!(config(), after);
}

#[test]
fn a_lock_held_by_another_process_is_respected() {
    let dir = tmp();
    let out = dir.path().join("run");
    std::fs::create_dir_all(&out).unwrap();
    let mut lock = File::create(out.join(".lock")).unwrap();
    lock.try_lock().unwrap();
    writeln!(lock, "4242").unwrap();
    let args = small_run(&out, "2", "1");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    fails(&args, "is in use by process 4242");
    assert!(!out.join("config.toml").exists());
    drop(lock);
    run_ok(&small_run(&out, "2", "1"));
}

#[test]
fn damaged_run_files_are_caught_on_resume() {
    let dir = tmp();
    let out = dir.path().join("run");
    let out_s = out.display().to_string();
    run_ok(&small_run(&out, "2", "2"));
    let resume = |rounds: &str| fl(&["fedavg", "--resume", &out_s, "--rounds", rounds, "--quiet"]);
    // --rounds below what is done cannot extend it; resuming a finished run says so.
    fails(
        &["fedavg", "--resume", &out_s, "--rounds", "1", "--quiet"],
        "has finished 2 rounds; --rounds 1 would not extend it",
    );
    let o = fl(&["fedavg", "--resume", &out_s, "--quiet"]);
    assert!(o.status.success());
    assert!(
        stderr(&o).contains("already finished its 2 rounds"),
        "{}",
        stderr(&o)
    );
    assert!(!stderr(&o).contains("was started by fl at commit"));
    // A run started by another commit's binary resumes with a warning (where the commit is known).
    let manifest = out.join("manifest.json");
    let text = std::fs::read_to_string(&manifest).unwrap();
    let other = text.replace(
        &format!("\"git_hash\": \"{}\"", env!("FL_GIT_HASH")),
        "\"git_hash\": \"0123456789ab\"",
    );
    if env!("FL_GIT_HASH") != "unknown" {
        assert_ne!(other, text);
        std::fs::write(&manifest, &other).unwrap();
        let o = fl(&["fedavg", "--resume", &out_s, "--quiet"]);
        assert!(
            stderr(&o)
                .contains("was started by fl at commit 0123456789ab; this binary is of commit"),
            "{}",
            stderr(&o)
        );
        std::fs::write(&manifest, &text).unwrap();
    }

    // 4 KB of garbage in the middle of the checkpoint.
    let ckpt = out.join("checkpoint.safetensors");
    let good = std::fs::read(&ckpt).unwrap();
    let mut bad = good.clone();
    let mid = bad.len() / 2;
    bad[mid..mid + 4096]
        .iter_mut()
        .enumerate()
        .for_each(|(i, b)| *b = i as u8);
    std::fs::write(&ckpt, &bad).unwrap();
    fails(
        &["fedavg", "--resume", &out_s, "--rounds", "3", "--quiet"],
        "checkpoint.safetensors is corrupt",
    );
    std::fs::write(&ckpt, &good).unwrap();

    // A torn last line (a crash while appending) and a round past the checkpoint are dropped.
    let metrics_file = out.join("metrics.jsonl");
    let text = std::fs::read_to_string(&metrics_file).unwrap();
    let second = text
        .lines()
        .nth(1)
        .unwrap()
        .replace("\"round\":2", "\"round\":3");
    std::fs::write(
        &metrics_file,
        format!("{text}{second}\n{{\"round\":4,\"test_a"),
    )
    .unwrap();
    let o = resume("3");
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("torn last line"), "{}", stderr(&o));
    assert!(stderr(&o).contains("dropped 1 round(s)"), "{}", stderr(&o));
    let rounds: Vec<u64> = metrics(&out)
        .iter()
        .map(|m| m["round"].as_u64().unwrap())
        .collect();
    assert_eq!(rounds, [1, 2, 3]);

    // Without its checkpoint a run that had finished rounds cannot continue exactly.
    std::fs::remove_file(&ckpt).unwrap();
    fails(
        &["fedavg", "--resume", &out_s, "--rounds", "4", "--quiet"],
        "the checkpoint was lost",
    );

    // A run stopped between round 1's metrics line and its first checkpoint starts over,
    // and ends as an uninterrupted run.
    let (once, fresh) = (dir.path().join("once"), dir.path().join("fresh"));
    run_ok(&small_run(&once, "2", "1"));
    run_ok(&small_run(&fresh, "2", "2"));
    std::fs::remove_file(once.join("checkpoint.safetensors")).unwrap();
    let o = fl(&[
        "fedavg",
        "--resume",
        once.to_str().unwrap(),
        "--rounds",
        "2",
        "--quiet",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("round 1 was never checkpointed"),
        "{}",
        stderr(&o)
    );
    assert_eq!(metrics(&once), metrics(&fresh));
}

#[test]
fn a_model_with_batch_norm_is_saved_byte_identically() {
    // Burn draws a random id for every BatchNorm running statistic, and its record stores it.
    let dir = tmp();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    for (out, threads) in [(&a, "1"), (&b, "2")] {
        let mut args = small_run(out, threads, "1");
        args.extend(["--model", "mobilenet-v3"].map(String::from));
        run_ok(&args);
    }
    let read = |d: &Path| std::fs::read(d.join("model.bpk")).unwrap();
    assert!(read(&a) == read(&b), "model.bpk differs");
}

#[test]
fn a_run_directory_is_byte_identical_at_any_thread_count() {
    let dir = tmp();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    run_ok(&small_run(&a, "1", "2"));
    run_ok(&small_run(&b, "2", "2"));
    for file in ["checkpoint.safetensors", "model.bpk", "partition.json"] {
        let (x, y) = (
            std::fs::read(a.join(file)).unwrap(),
            std::fs::read(b.join(file)).unwrap(),
        );
        assert!(x == y, "{file} differs");
    }
    assert_eq!(metrics(&a), metrics(&b));
    // config.toml differs only in the thread count and the directory.
    let config = |d: &Path| -> Vec<String> {
        std::fs::read_to_string(d.join("config.toml"))
            .unwrap()
            .lines()
            .filter(|l| !l.starts_with("threads") && !l.starts_with("out"))
            .map(String::from)
            .collect()
    };
    assert_eq!(config(&a), config(&b));
}

#[test]
fn a_new_run_needs_a_new_or_empty_directory() {
    let dir = tmp();
    // Someone's files are neither overwritten nor mixed with a run's, and no lock is left.
    let notes = dir.path().join("notes");
    std::fs::create_dir_all(&notes).unwrap();
    std::fs::write(notes.join("config.toml"), "mine").unwrap();
    let args = small_run(&notes, "2", "1");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    fails(&args, "already holds a run; continue it with --resume");
    std::fs::remove_file(notes.join("config.toml")).unwrap();
    std::fs::write(notes.join("todo.txt"), "mine").unwrap();
    fails(&args, "is not empty (it holds todo.txt)");
    let left: Vec<_> = std::fs::read_dir(&notes)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["todo.txt"]);
    assert_eq!(
        std::fs::read_to_string(notes.join("todo.txt")).unwrap(),
        "mine"
    );

    // A run stopped before its first checkpoint is a run: continued, not overwritten.
    let out = dir.path().join("run");
    run_ok(&small_run(&out, "2", "1"));
    std::fs::remove_file(out.join("checkpoint.safetensors")).unwrap();
    let args = small_run(&out, "2", "1");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    fails(&args, "already holds a run");
    // An empty directory is fine.
    let empty = dir.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    run_ok(&small_run(&empty, "2", "1"));
}

#[test]
fn a_run_whose_training_data_changed_does_not_resume() {
    let dir = tmp();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    write_idx(&data, "train", 40, 28);
    write_idx(&data, "t10k", 10, 28);
    let (data_s, out) = (
        data.display().to_string(),
        dir.path().join("run").display().to_string(),
    );
    let line = "fedavg --clients 4 --sample 2 --rounds 1 --local-epochs 1 --seed 3 --quiet";
    run_ok(
        &[words(line), vec!["--data-dir", &data_s, "--out", &out]]
            .concat()
            .iter()
            .map(|s| s.to_string())
            .collect::<Vec<_>>(),
    );
    // The same files resume; more training images would put other samples under the clients.
    let resume = ["fedavg", "--resume", &out, "--rounds", "2", "--quiet"];
    write_idx(&data, "train", 48, 28);
    fails(
        &resume,
        "its partition.json (4 clients, 40 samples) differs from the partition its settings draw now (4 clients, 48 samples)",
    );
    write_idx(&data, "train", 40, 28);
    let o = fl(&resume);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(metrics(Path::new(&out)).len(), 2);
}
