//! End-to-end tests of the `fl` binary: bad input, run directories, determinism, resume,
//! reports and tools, on real data.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

#[test]
fn bad_input_is_a_one_line_error_not_a_panic() {
    let dir = tmp();
    let out = dir.path().join("x").display().to_string();
    let cases: &[(&[&str], &str)] = &[
        (
            &["--clients", "5", "--sample", "6"],
            "cannot sample 6 clients per round from 5",
        ),
        (&["--alpha", "0"], "alpha must be a positive number"),
        (&["--alpha=-1"], "alpha must be a positive number"),
        (&["--dataset", "cifar7"], "unknown dataset 'cifar7'"),
        (&["--model", "transformer"], "unknown model 'transformer'"),
        (
            &["--data-dir", "/nonexistent/data"],
            "train-images-idx3-ubyte",
        ),
        (&["--partition", "zipf"], "invalid value 'zipf'"),
        (&["--lr", "0"], "learning rate must be a positive number"),
        (
            &["--lr", "1e9", "--local-epochs", "1"],
            "lower the learning rate",
        ),
        (&["--momentum", "1.5"], "momentum must be in [0, 1)"),
        (
            &["--clients", "9000"],
            "cannot give each of 9000 clients at least 10",
        ),
        (&["--config", "/nonexistent.toml"], "cannot read config"),
        (&["--resume", "/nonexistent-run"], "is not a run directory"),
    ];
    for (extra, expected) in cases {
        let mut args = vec!["fedavg", "--rounds", "1", "--quiet", "--out", &out];
        args.extend_from_slice(extra);
        fails(&args, expected);
    }
}

#[test]
fn run_directory_is_self_describing() {
    let dir = tmp();
    let out = dir.path().join("run");
    run_ok(&small_run(&out, "2", "2"));
    for f in [
        "config.toml",
        "manifest.json",
        "partition.json",
        "metrics.jsonl",
        "checkpoint.safetensors",
        "model.bpk",
    ] {
        assert!(out.join(f).is_file(), "missing {f}");
    }
    let m = metrics(&out);
    assert_eq!(m.len(), 2);
    for (i, line) in m.iter().enumerate() {
        assert_eq!(line["round"], i + 1);
        let acc = line["test_acc"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&acc));
        assert!(line["test_loss"].as_f64().unwrap().is_finite());
        assert!(line["train_loss"].as_f64().unwrap().is_finite());
        assert_eq!(line["clients"].as_array().unwrap().len(), 3);
        // FedAvg sends and receives one 147,146-parameter model per client.
        assert_eq!(line["bytes_down"], 3 * 147_146 * 4);
        assert_eq!(line["bytes_up"], 3 * 147_146 * 4);
    }
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["seed"], 7);
    assert_eq!(manifest["backend"], "flex");
    // Only GPU backends name a device (scripts/check-wgpu.sh checks wgpu's).
    assert!(manifest.get("device").is_none());
    // Running again into the same directory without --resume refuses to overwrite it.
    let args = small_run(&out, "2", "2");
    let o = fl(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("already holds a run"), "{}", stderr(&o));
}

#[test]
fn a_partition_file_is_recorded_by_path_and_hash_and_checked() {
    let dir = tmp();
    let first = dir.path().join("first");
    run_ok(&small_run(&first, "2", "1"));
    // A copy of the first run's partition, used by a second run.
    let file = dir.path().join("partition.json");
    std::fs::copy(first.join("partition.json"), &file).unwrap();
    let second = dir.path().join("second");
    // The file replaces the drawing settings (giving them as well is an error).
    let mut args = small_run(&second, "2", "1");
    let at = args.iter().position(|a| a == "--partition").unwrap();
    args.drain(at..at + 4);
    args.extend(["--partition-file".to_string(), file.display().to_string()]);
    let mut both = args.clone();
    both.extend(["--alpha".to_string(), "0.5".to_string()]);
    let both: Vec<&str> = both.iter().map(String::as_str).collect();
    fails(&both, "--alpha does not apply to --partition file");
    run_ok(&args);
    assert_eq!(
        metrics(&second),
        metrics(&first),
        "same partition, same run"
    );
    let config = std::fs::read_to_string(second.join("config.toml")).unwrap();
    let sha = {
        use sha2::Digest;
        let digest = sha2::Sha256::digest(std::fs::read(&file).unwrap());
        digest
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };
    assert!(config.contains("partition = \"file\""), "{config}");
    assert!(
        config.contains(&format!("partition_sha256 = \"{sha}\"")),
        "{config}"
    );
    assert!(
        !config.contains("alpha ="),
        "unused drawing settings are left out: {config}"
    );
    let manifest = std::fs::read_to_string(second.join("manifest.json")).unwrap();
    assert!(manifest.contains(&sha), "{manifest}");
    // Re-running the config after the file changed is an error, not a different run.
    let text = std::fs::read_to_string(&file).unwrap();
    std::fs::write(&file, text.replacen('[', "[ ", 1)).unwrap();
    let third = dir.path().join("third");
    let cfg = second.join("config.toml").display().to_string();
    let o = fl(&["run", &cfg, "--quiet", "--out", third.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("changed since the run was configured"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn same_seed_gives_identical_results_at_one_and_two_threads() {
    let dir = tmp();
    let (a, b): (PathBuf, PathBuf) = (dir.path().join("t1"), dir.path().join("t2"));
    run_ok(&small_run(&a, "1", "2"));
    run_ok(&small_run(&b, "2", "2"));
    assert_eq!(metrics(&a), metrics(&b));
    assert_eq!(weights(&a), weights(&b));
    // Clients trained one at a time on both threads: the same run.
    let one = dir.path().join("one-at-a-time");
    let mut args = small_run(&one, "2", "2");
    args.extend(["--parallel-clients".into(), "1".into()]);
    run_ok(&args);
    assert_eq!(metrics(&a), metrics(&one));
    assert_eq!(weights(&a), weights(&one));
    // A different seed gives a different run (the comparison above can fail).
    let c = dir.path().join("s8");
    let mut args = small_run(&c, "2", "2");
    let seed = args.iter().position(|s| s == "--seed").unwrap();
    args[seed + 1] = "8".into();
    run_ok(&args);
    assert_ne!(weights(&a), weights(&c));
}

/// Gradient checkpointing recomputes batch-norm outputs in the backward pass: a ResNet's run is
/// the same bits with it and without it (the default for global algorithms).
#[test]
fn gradient_checkpointing_changes_no_results() {
    let dir = tmp();
    let run = |name: &str, checkpointing: &str| {
        let out = dir.path().join(name);
        let line = format!(
            "fedavg --model resnet20 --clients 400 --sample 2 --rounds 1 --local-epochs 1 \
             --batch-size 32 --partition iid --seed 3 --threads 2 --quiet \
             --gradient-checkpointing {checkpointing} --out"
        );
        let mut args: Vec<String> = words(&line).into_iter().map(String::from).collect();
        args.push(out.display().to_string());
        run_ok(&args);
        out
    };
    let (on, off) = (run("on", "true"), run("off", "false"));
    assert_eq!(metrics(&on), metrics(&off));
    assert_eq!(weights(&on), weights(&off));
    let config = std::fs::read_to_string(on.join("config.toml")).unwrap();
    assert!(config.contains("gradient_checkpointing = true"), "{config}");
}

#[test]
fn a_killed_run_resumes_to_the_same_result() {
    let dir = tmp();
    let full = dir.path().join("full");
    run_ok(&small_run(&full, "2", "4"));

    // Start the same run, kill it as soon as it has checkpointed a round, then resume.
    let killed = dir.path().join("killed");
    let args = small_run(&killed, "2", "4");
    let mut child = Command::new(FL).args(&args).spawn().unwrap();
    let metrics_file = killed.join("metrics.jsonl");
    loop {
        let rounds = std::fs::read_to_string(&metrics_file).map_or(0, |t| t.lines().count());
        if rounds >= 1 || child.try_wait().unwrap().is_some() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let _ = child.kill();
    child.wait().unwrap();
    let done = metrics(&killed).len();
    assert!(done <= 4);
    run_ok(&[
        "fedavg".into(),
        "--resume".into(),
        killed.display().to_string(),
        "--quiet".into(),
    ]);
    assert_eq!(metrics(&killed), metrics(&full));
    assert_eq!(weights(&killed), weights(&full));

    // Extending a finished run with --rounds continues it.
    run_ok(&[
        "fedavg".into(),
        "--resume".into(),
        killed.display().to_string(),
        "--rounds".into(),
        "5".into(),
        "--quiet".into(),
    ]);
    assert_eq!(metrics(&killed).len(), 5);
}

#[test]
fn models_lists_parameter_counts_and_blocks() {
    let o = fl(&["models", "--dataset", "fashion-mnist"]);
    assert!(o.status.success());
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("cnn") && text.contains("147146 parameters"),
        "{text}"
    );
    assert!(text.contains("[1, 28, 28] -> [16, 12, 12]"), "{text}");
    let o = fl(&["models", "--dataset", "cifar10"]);
    assert!(o.status.success());
    let text = String::from_utf8_lossy(&o.stdout);
    for (model, params) in [
        ("resnet20", 269_722),
        ("resnet20-ref", 219_482),
        ("vgg16", 33_646_666),
        ("mobilenet-v3", 1_528_106),
    ] {
        let line = format!("{model:<12} {params:>10} parameters");
        assert!(text.contains(&line), "{line} missing from\n{text}");
    }
    assert!(text.contains("unit8"), "{text}");
}

/// Output into a closed pipe (`fl bench --kernels | head -1`) ends `fl` as it ends other Unix
/// tools, by SIGPIPE, with nothing on stderr: not a panic from `println!`.
#[test]
fn a_closed_stdout_pipe_ends_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader); // the reader is gone before `fl` prints its first line
    let o = Command::new(FL)
        .args(["models", "--dataset", "fashion-mnist"])
        .stdout(writer)
        .output()
        .expect("fl runs");
    assert_eq!(
        o.status.signal(),
        Some(libc::SIGPIPE),
        "{:?}: {}",
        o.status,
        stderr(&o)
    );
    assert!(o.stderr.is_empty(), "{}", stderr(&o));
}

/// FedAvg on the real Fashion-MNIST (Debian's dataset-fashion-mnist, installed by CI) learns.
#[test]
fn fedavg_learns_the_real_fashion_mnist() {
    if !Path::new(DEBIAN_FMNIST)
        .join("train-images-idx3-ubyte.gz")
        .is_file()
    {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must install dataset-fashion-mnist"
        );
        eprintln!("skipping: {DEBIAN_FMNIST} not installed");
        return;
    }
    let dir = tmp();
    let out = dir.path().join("real");
    let o = fl_line(
        "fedavg --clients 20 --sample 5 --rounds 3 --local-epochs 1 --partition iid --seed 1 --quiet",
        &[
            "--data-dir",
            DEBIAN_FMNIST,
            "--out",
            &out.display().to_string(),
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let m = metrics(&out);
    let acc: Vec<f64> = m.iter().map(|l| l["test_acc"].as_f64().unwrap()).collect();
    assert!(acc[2] > 0.6, "accuracy after 3 rounds: {acc:?}");
    assert!(acc[2] > acc[0], "no progress: {acc:?}");
    let manifest = std::fs::read_to_string(out.join("manifest.json")).unwrap();
    assert!(manifest.contains("\"train_samples\": 60000"), "{manifest}");
}

#[test]
fn plot_and_compare_summarise_seed_groups() {
    let dir = tmp();
    let data = dir.path().join("mnist");
    std::fs::create_dir(&data).unwrap();
    write_idx_fixture(&data, 400);
    let run = |algorithm: &str, seeds: &str, out: &Path| {
        let line = format!(
            "{algorithm} --dataset mnist --clients 4 --sample 2 --rounds 2 --local-epochs 1 --partition iid --seeds {seeds} --quiet"
        );
        let mut args: Vec<String> = words(&line).iter().map(|s| s.to_string()).collect();
        args.extend(["--data-dir".into(), data.display().to_string()]);
        args.extend(["--out".into(), out.display().to_string()]);
        run_ok(&args);
    };
    // --seeds runs each seed into its own folder.
    let group = dir.path().join("fedavg-seeds");
    run("fedavg", "1,2", &group);
    for seed in [1, 2] {
        let cfg = std::fs::read_to_string(group.join(format!("s{seed}/config.toml"))).unwrap();
        assert!(cfg.contains(&format!("seed = {seed}")), "{cfg}");
    }
    let single = dir.path().join("fedmr-one");
    run("fedmr", "1", &single);
    let single = single.join("s1");
    let (g, s) = (group.display().to_string(), single.display().to_string());

    let png = dir.path().join("curves.png");
    let o = fl_line(
        "plot --title t",
        &[&g, &s, "-o", &png.display().to_string()],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let img = image::open(&png).expect("a decodable PNG");
    assert_eq!((img.width(), img.height()), (1000, 600));
    // Not a blank canvas: the curves and text drew non-white pixels.
    let rgb = img.to_rgb8();
    let ink = rgb.pixels().filter(|p| p.0 != [255, 255, 255]).count();
    assert!(ink > 5_000, "only {ink} non-white pixels");
    let svg = dir.path().join("loss.svg");
    let o = fl_line(
        "plot --metric loss",
        &[&g, "-o", &svg.display().to_string()],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(std::fs::read_to_string(&svg).unwrap().contains("<svg"));

    let o = fl(&["compare", &g, &s, "--target", "0.05"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let table = String::from_utf8_lossy(&o.stdout);
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 4, "{table}");
    assert!(lines[0].starts_with("| run | seeds | rounds |"), "{table}");
    assert!(lines[2].starts_with("| fedavg-seeds | 2 | 2 | "), "{table}");
    assert!(lines[2].contains(" ± "), "{table}");
    assert!(lines[3].starts_with("| s1 | 1 | 2 | "), "{table}");
    // Every run reached 5% accuracy at the first evaluation.
    assert!(
        lines[2].contains("| 1 |") && lines[3].contains("| 1 |"),
        "{table}"
    );
    let o = fl(&["compare", &g, "--format", "csv"]);
    assert!(String::from_utf8_lossy(&o.stdout).starts_with("run,seeds,rounds,"));

    // `fl run FILE` takes the algorithm from the file; flags override its fields.
    let smoke = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/smoke.toml");
    let from_file = dir.path().join("from-file");
    let o = fl_line(
        "run --dataset mnist --rounds 1 --quiet",
        &[
            &smoke.display().to_string(),
            "--data-dir",
            &data.display().to_string(),
            "--out",
            &from_file.display().to_string(),
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(metrics(&from_file)[0]["stage"], "recombine");

    for (args, expected) in [
        (vec!["plot", &g, "-o", "x.gif"], "must end in .png or .svg"),
        (
            vec!["compare", "/nonexistent-runs"],
            "is not a run directory",
        ),
        (
            vec!["plot", &data.display().to_string()],
            "has no metrics.jsonl",
        ),
        (
            vec!["plot", &g, "-o", "/nonexistent-dir/curves.png"],
            "cannot write /nonexistent-dir/curves.png: /nonexistent-dir is not a directory",
        ),
        // An accuracy is a fraction, as metrics.jsonl keeps it: 80 would never be reached.
        (
            vec!["compare", &g, "--target", "80"],
            "'80' is not an accuracy in (0, 1]",
        ),
        (vec!["compare", &g, "--target", "NaN"], "is not an accuracy"),
        // --seeds wrote a directory of runs: each is resumed on its own.
        (
            vec!["fedavg", "--resume", &g],
            "holds 2 runs, not one: resume each, e.g. --resume",
        ),
    ] {
        fails(&args, expected);
    }

    // A group is the seeds of one setting: other settings, or one seed twice, are refused.
    let copy = |from: &Path, to: &Path| {
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        let status = std::process::Command::new("cp")
            .args(["-r", from.to_str().unwrap(), to.to_str().unwrap()])
            .status()
            .unwrap();
        assert!(status.success());
    };
    let (mixed, twice) = (dir.path().join("mixed"), dir.path().join("twice"));
    copy(&group.join("s1"), &mixed.join("s1"));
    copy(&single, &mixed.join("fedmr"));
    copy(&group.join("s1"), &twice.join("a"));
    copy(&group.join("s1"), &twice.join("b"));
    let (mixed, twice) = (mixed.display().to_string(), twice.display().to_string());
    for command in ["compare", "plot"] {
        fails(
            &[command, &mixed],
            "are not seeds of one setting (`algorithm = \"fedmr\"` against `algorithm = \"fedavg\"`)",
        );
        fails(&[command, &twice], "are both seed 1 of one setting");
    }
}

/// `fl landscape` on a short run: a grid of losses with the trained model at (or next to) the
/// lowest point, a PNG heat map and a CSV.
#[test]
fn landscape_has_its_minimum_near_the_trained_model() {
    let dir = tmp();
    let out = dir.path().join("run");
    run_ok(&small_run(&out, "2", "2"));
    let run = out.display().to_string();
    let png = dir.path().join("land.png");
    let o = fl_line(
        "landscape --grid 5 --samples 300",
        &[&run, "-o", &png.display().to_string()],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let img = image::open(&png).expect("a decodable PNG");
    assert_eq!((img.width(), img.height()), (800, 700));
    let csv = std::fs::read_to_string(png.with_extension("csv")).unwrap();
    let rows: Vec<Vec<f64>> = csv
        .lines()
        .skip(1)
        .map(|l| l.split(',').map(|v| v.parse().unwrap()).collect())
        .collect();
    assert_eq!(rows.len(), 25);
    let lowest = rows.iter().min_by(|a, b| a[2].total_cmp(&b[2])).unwrap();
    assert!(
        lowest[0].abs() <= 0.5 && lowest[1].abs() <= 0.5,
        "minimum at {lowest:?}"
    );
    let corners_mean = [0, 4, 20, 24].iter().map(|&i| rows[i][2]).sum::<f64>() / 4.0;
    assert!(
        rows[12][2] < corners_mean,
        "centre {} vs corners {corners_mean}",
        rows[12][2]
    );
    for (args, expected) in [
        (vec!["landscape", &run, "--grid", "4"], "--grid must be odd"),
        (vec!["landscape", &run, "--grid", "100001"], "from 3 to 201"),
        (
            vec!["landscape", &run, "-o", "/nonexistent-dir/l.png"],
            "cannot write /nonexistent-dir/l.png: /nonexistent-dir is not a directory",
        ),
    ] {
        fails(&args, expected);
    }
    let weights = out.join("model.bpk");
    let bytes = std::fs::read(&weights).unwrap();
    std::fs::write(&weights, &bytes[..bytes.len() / 2]).unwrap();
    let png = png.display().to_string();
    fails(
        &["landscape", &run, "--grid", "3", "-o", &png],
        "model.bpk: Record I/O error: ",
    );
}

/// `fl bench --quick` is the CI smoke run of the benchmark (no timing assertions).
#[test]
fn bench_quick_prints_a_row_per_model() {
    let o = fl(&["bench", "--quick", "--models", "cnn,resnet20-ref"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("| cnn | 62006 |"), "{text}");
    assert!(text.contains("| resnet20-ref | 219482 |"), "{text}");
    assert!(text.contains("peak RSS"), "{text}");
    assert!(
        text.contains("(fl-models kernels where they apply)"),
        "{text}"
    );
    let o = fl_line("bench --quick --models cnn --burn-kernels", &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("(Burn's own kernels)") && text.contains("| cnn | 62006 |"),
        "{text}"
    );
    let o = fl(&["bench", "--models", "resnet50"]);
    assert!(
        stderr(&o).starts_with("error: unknown model 'resnet50'"),
        "{}",
        stderr(&o)
    );
    // 1-channel inputs: the models adapt to the input shape.
    let o = fl(&[
        "bench",
        "--quick",
        "--models",
        "cnn1,mobilenet-v3",
        "--input",
        "1x28x28",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("1×28×28 inputs"), "{text}");
    assert!(text.contains("| cnn1 | 1663370 |"), "{text}");
    assert!(text.contains("| mobilenet-v3 | 1527818 |"), "{text}");
    for bad in ["1x8x8", "3x32", "ax32x32", "0x32x32"] {
        let o = fl(&["bench", "--quick", "--input", bad]);
        assert_eq!(o.status.code(), Some(1), "{bad}");
        assert!(stderr(&o).contains("is not CxHxW"), "{bad}: {}", stderr(&o));
    }
    // Thread counts far above the cores only thrash (a pool of 100,000 threads takes minutes
    // to start): the same bounds as a run's, for the model table and the kernel rates.
    for (args, expected) in [
        (
            "bench --quick --threads 0",
            "--threads must be between 1 and",
        ),
        (
            "bench --quick --threads 100000",
            "--threads must be between 1 and",
        ),
        (
            "bench --kernels --threads 100000",
            "--threads must be between 1 and",
        ),
        (
            "bench --quick --models cnn,resnet20,cnn",
            "--models lists cnn twice",
        ),
    ] {
        fails(&words(args), expected);
    }
    // Some kernels off, the others on: the header names them.
    let o = fl_line(
        "bench --quick --models cnn --burn-kernels=max-pool,conv",
        &[],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("(fl-models kernels where they apply, Burn's for conv, max-pool)"),
        "{text}"
    );
    for bad in ["--burn-kernels=pool", "--burn-kernels="] {
        let o = fl(&["bench", "--quick", bad]);
        assert_eq!(o.status.code(), Some(1), "{bad}");
        let err = stderr(&o);
        assert!(err.contains("unknown kernel"), "{bad}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{bad}: {err}");
    }
}

/// `fl bench --kernels --layers` measures only the layers named, fully connected ones too,
/// and refuses names that match none.
#[test]
fn kernel_rates_of_the_layers_named() {
    let o = fl(&[
        "bench",
        "--kernels",
        "--threads",
        "1",
        "--layers",
        "cnn4 fc1",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    let rows: Vec<&str> = text.lines().filter(|l| l.starts_with("| cnn")).collect();
    assert_eq!(rows.len(), 1, "{text}");
    assert!(rows[0].starts_with("| cnn4 fc1 | 2048→512 |"), "{text}");
    assert!(text.contains("| fully connected layer |"), "{text}");
    assert!(
        !text.contains("| layer |"),
        "no convolution was named: {text}"
    );
    let o = fl(&["bench", "--kernels", "--layers", "transformer"]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.contains("no layer of `fl bench --kernels` matches"),
        "{err}"
    );
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
}

/// `fl bench --round CONFIG` times one round of a config's run, pFedClub's server phases too,
/// and refuses a config that is not one.
#[test]
fn bench_round_reports_the_server_phases_and_peak_memory() {
    let dir = tmp();
    let config = dir.path().join("club.toml");
    std::fs::write(
        &config,
        "algorithm = \"pfedclub\"\nclients = 5\nsample = 2\nrounds = 5\nlocal_epochs = 1\n\
         max_samples = 600\n[pfedclub]\nzoo = \"III\"\ncandidates = 1\npublic_samples = 32\n\
         cka_samples = 16\nstitch_epochs = 1\n",
    )
    .unwrap();
    let o = fl(&[
        "bench",
        "--round",
        &config.display().to_string(),
        "--threads",
        "2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    for row in [
        "| local training |",
        "| server step |",
        "| server: features |",
        "| server: stitching |",
        "| server: matching |",
        "| evaluation |",
        "peak RSS",
    ] {
        assert!(text.contains(row), "{row}: {text}");
    }
    std::fs::write(&config, "algorithm = \"fedmr\"\nlocal_epochs = \"many\"\n").unwrap();
    let o = fl(&["bench", "--round", &config.display().to_string()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).starts_with("error: invalid config"),
        "{}",
        stderr(&o)
    );
    assert_eq!(stderr(&o).lines().count(), 1, "{}", stderr(&o));
}

/// `fl partition` draws a fresh pathological partition and a run's own partition.
#[test]
fn partition_heat_map_and_csv() {
    let dir = tmp();
    let png = dir.path().join("p.png");
    let o = fl_line(
        "partition --partition pathological --classes-per-client 2 --clients 20",
        &["-o", &png.display().to_string()],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let img = image::open(&png).expect("a decodable PNG");
    assert_eq!((img.width(), img.height()), (1000, 600));
    let csv = std::fs::read_to_string(png.with_extension("csv")).unwrap();
    let rows: Vec<&str> = csv.lines().skip(1).collect();
    assert_eq!(rows.len(), 20);
    for row in rows {
        let nonzero = row.split(',').skip(1).filter(|v| *v != "0").count();
        assert_eq!(nonzero, 2, "{row}");
    }
    // The balanced Dirichlet split gives 10,000 clients six images each at alpha 0.1.
    let o = fl_line(
        "partition --partition dirichlet-balanced --alpha 0.1 --clients 10000",
        &["-o", &png.display().to_string()],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let summary = String::from_utf8_lossy(&o.stdout);
    assert!(summary.contains("sizes 6–6"), "{summary}");
    let o = fl(&["partition", "--run", "/nonexistent"]);
    assert!(
        stderr(&o).starts_with("error: /nonexistent is not a run directory"),
        "{}",
        stderr(&o)
    );
    // Flags that would be ignored are refused: a run's directory, or a drawing's settings
    // next to --run (which draws the run's own partition).
    fails(
        &["partition", "--out", "p.png"],
        "--out does not apply to fl partition (the image: -o/--image)",
    );
    fails(
        &["partition", "--run", "/nonexistent", "--clients", "5"],
        "--clients does not apply with --run",
    );
}

/// `fl download` reports what cannot be fetched in one line: an unreachable mirror (nothing is
/// left behind), a dataset without a canonical archive, an unknown name.
#[test]
fn download_errors_are_one_line() {
    let dir = tmp();
    let target = dir.path().join("fmnist");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let mirror = format!("http://{addr}");
    let o = fl_line(
        "download fashion-mnist --quiet",
        &["--mirror", &mirror, "--dir", &target.display().to_string()],
    );
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.starts_with("error: download failed") && err.contains(&mirror),
        "{err}"
    );
    assert_eq!(std::fs::read_dir(&target).unwrap().count(), 0);
    // A directory is a mirror too, verified the same: Debian's Fashion-MNIST files are
    // recompressed, so they are not the canonical bytes.
    // (By size or by SHA-256, whichever a package version trips first.)
    let target_s = target.display().to_string();
    let args = [
        "download",
        "fashion-mnist",
        "--quiet",
        "--mirror",
        DEBIAN_FMNIST,
        "--dir",
    ];
    let o = fl(&[&args[..], &[&target_s]].concat());
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.contains(&format!("{DEBIAN_FMNIST}/train-images-idx3-ubyte.gz: "))
            && err.contains("not the canonical"),
        "{err}"
    );
    assert_eq!(std::fs::read_dir(&target).unwrap().count(), 0);
    for (mirror, expected) in [
        (
            "ftp://x",
            "--mirror must be an http://, https:// or file:// URL or a directory",
        ),
        (
            "file:///nonexistent",
            "--mirror file:///nonexistent: no such directory",
        ),
    ] {
        fails(
            &["download", "mnist", "--mirror", mirror, "--dir", &target_s],
            expected,
        );
    }
    for (dataset, expected) in [("femnist", "LEAF"), ("imagenet", "unknown dataset")] {
        let o = fl(&["download", dataset, "--quiet"]);
        assert_eq!(o.status.code(), Some(1));
        assert!(stderr(&o).contains(expected), "{}", stderr(&o));
    }
}
