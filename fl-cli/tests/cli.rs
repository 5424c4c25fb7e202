//! End-to-end tests of the `fl` binary: real data, real training, real files.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const FL: &str = env!("CARGO_BIN_EXE_fl");
const DEBIAN_FMNIST: &str = "/usr/share/datasets/fashion-mnist";

fn fl(args: &[&str]) -> Output {
    Command::new(FL).args(args).output().expect("fl runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A small FedAvg run: 3 of 40 clients per round, so a round trains on about 4,500 images of the
/// full Fashion-MNIST (or 600 of the embedded copy where the Debian package is missing).
fn small_run(out: &Path, threads: &str, rounds: &str) -> Vec<String> {
    [
        "fedavg",
        "--clients",
        "40",
        "--sample",
        "3",
        "--rounds",
        rounds,
        "--local-epochs",
        "1",
        "--batch-size",
        "32",
        "--partition",
        "dirichlet",
        "--alpha",
        "0.5",
        "--seed",
        "7",
        "--threads",
        threads,
        "--quiet",
        "--out",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([out.display().to_string()])
    .collect()
}

fn run_ok(args: &[String]) {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = fl(&args);
    assert!(o.status.success(), "fl {args:?} failed: {}", stderr(&o));
}

/// metrics.jsonl without wall-clock fields.
fn metrics(dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            let m = v.as_object_mut().unwrap();
            for k in ["train_seconds", "aggregate_seconds", "eval_seconds"] {
                assert!(m.remove(k).is_some(), "metrics line lacks {k}");
            }
            v
        })
        .collect()
}

/// The checkpoint's tensors, by name (the file's byte order of metadata is not fixed).
fn weights(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let bytes = std::fs::read(dir.join("checkpoint.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, view)| (name, view.data().to_vec()))
        .collect()
}

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

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
        let o = fl(&args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{extra:?}: {err}");
        assert!(
            err.contains(expected),
            "{extra:?}: expected '{expected}' in: {err}"
        );
        assert!(!err.contains("panicked"), "{extra:?} panicked: {err}");
        let error_lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error")).collect();
        assert_eq!(error_lines.len(), 1, "{extra:?}: {err}");
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
    let mut args = small_run(&second, "2", "1");
    args.extend(["--partition-file".to_string(), file.display().to_string()]);
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
    // A different seed gives a different run (the comparison above can fail).
    let c = dir.path().join("s8");
    let mut args = small_run(&c, "2", "2");
    let seed = args.iter().position(|s| s == "--seed").unwrap();
    args[seed + 1] = "8".into();
    run_ok(&args);
    assert_ne!(weights(&a), weights(&c));
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
    let o = fl(&[
        "fedavg",
        "--data-dir",
        DEBIAN_FMNIST,
        "--clients",
        "20",
        "--sample",
        "5",
        "--rounds",
        "3",
        "--local-epochs",
        "1",
        "--partition",
        "iid",
        "--seed",
        "1",
        "--quiet",
        "--out",
        &out.display().to_string(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let m = metrics(&out);
    let acc: Vec<f64> = m.iter().map(|l| l["test_acc"].as_f64().unwrap()).collect();
    assert!(acc[2] > 0.6, "accuracy after 3 rounds: {acc:?}");
    assert!(acc[2] > acc[0], "no progress: {acc:?}");
    let manifest = std::fs::read_to_string(out.join("manifest.json")).unwrap();
    assert!(manifest.contains("\"train_samples\": 60000"), "{manifest}");
}

#[test]
fn fedmr_two_stage_and_fedindep_run_end_to_end() {
    let dir = tmp();
    let out = dir.path().join("fedmr");
    let mut args = small_run(&out, "2", "3");
    args[0] = "fedmr".into();
    args.extend(["--granularity", "layer", "--first-stage", "1"].map(String::from));
    run_ok(&args);
    let m = metrics(&out);
    let stages: Vec<&str> = m.iter().map(|l| l["stage"].as_str().unwrap()).collect();
    assert_eq!(stages, ["fedavg", "recombine", "recombine"]);
    for l in &m {
        let cos = l["mean_pairwise_cosine"].as_f64().unwrap();
        assert!(cos > 0.0 && cos <= 1.0 + 1e-9, "{cos}");
    }
    // The checkpoint holds the K = 3 intermediate models.
    let slots: std::collections::BTreeSet<String> = weights(&out)
        .keys()
        .map(|k| k.split('/').next().unwrap().to_string())
        .collect();
    assert_eq!(slots.len(), 3);

    // Secure recombination: same stages, extra bytes reported.
    let secure = dir.path().join("secure");
    let mut args = small_run(&secure, "2", "2");
    args[0] = "fedmr".into();
    args.push("--secure".into());
    run_ok(&args);
    let m = metrics(&secure);
    assert_eq!(m[1]["stage"], "secure-recombine");
    assert!(m[1]["secure_exchange_bytes"].as_u64().unwrap() > 0);

    // FedIndep with each of its K = 3 models evaluated (FedMR's Fig. 5), drawn by `fl plot`.
    let indep = dir.path().join("fedindep");
    let mut args = small_run(&indep, "2", "2");
    args[0] = "fedindep".into();
    args.push("--eval-models".into());
    run_ok(&args);
    let m = metrics(&indep);
    assert_eq!(m.len(), 2);
    for l in &m {
        let accs = l["model_acc"].as_array().unwrap();
        assert_eq!(accs.len(), 3);
        assert!(
            accs.iter()
                .all(|a| (0.0..=1.0).contains(&a.as_f64().unwrap()))
        );
        assert_eq!(l["model_loss"].as_array().unwrap().len(), 3);
    }
    // FedIndep's models never mix, so the first round's models differ from each other.
    assert_ne!(m[0]["model_loss"][0], m[0]["model_loss"][1]);
    let png = dir.path().join("models.png");
    run_ok(&[
        "plot".to_string(),
        indep.display().to_string(),
        "--models".into(),
        "--out".into(),
        png.display().to_string(),
    ]);
    assert!(std::fs::metadata(&png).unwrap().len() > 1000);

    let mut args = small_run(&dir.path().join("bad"), "2", "1");
    args[0] = "fedmr".into();
    args.extend(["--granularity", "neuron"].map(String::from));
    let o = fl(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("invalid value 'neuron' for '--granularity"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn fedcross_stages_partners_and_bad_flags() {
    let dir = tmp();
    let out = dir.path().join("fedcross");
    let mut args = small_run(&out, "2", "3");
    args[0] = "fedcross".into();
    args.extend(
        [
            "--first-stage",
            "1",
            "--propellers",
            "1",
            "--dynamic-alpha",
            "0.5:0.9:2",
        ]
        .map(String::from),
    );
    run_ok(&args);
    let m = metrics(&out);
    let stages: Vec<&str> = m.iter().map(|l| l["stage"].as_str().unwrap()).collect();
    assert_eq!(stages, ["fedavg", "propellers", "cross"]);
    assert_eq!(m[1]["alpha"], 0.5);
    assert_eq!(m[2]["alpha"], 0.5);
    for l in &m[1..] {
        for (i, partners) in l["partners"].as_array().unwrap().iter().enumerate() {
            let partners = partners.as_array().unwrap();
            assert!(!partners.is_empty() && !partners.contains(&serde_json::json!(i)));
        }
    }
    for (flags, expected) in [
        (&["--cross-alpha", "1.5"][..], "alpha must be in [0, 1]"),
        (
            &["--select", "random"][..],
            "unknown partner selection 'random'",
        ),
        (&["--similarity", "l1"][..], "unknown similarity 'l1'"),
        (&["--dynamic-alpha", "0.5"][..], "START:END:ROUNDS"),
    ] {
        let mut args = small_run(&dir.path().join("bad"), "2", "1");
        args[0] = "fedcross".into();
        args.extend(flags.iter().map(|s| s.to_string()));
        let o = fl(&args.iter().map(String::as_str).collect::<Vec<_>>());
        assert_eq!(o.status.code(), Some(1), "{flags:?}");
        assert!(stderr(&o).contains(expected), "{flags:?}: {}", stderr(&o));
    }
}

/// Writes an MNIST-format (IDX) dataset of `n` train and `n / 4` test images, class = row band.
fn write_idx_fixture(dir: &Path, n: usize) {
    let write = |name: &str, magic: u32, dims: &[u32], payload: &[u8]| {
        let mut bytes = magic.to_be_bytes().to_vec();
        dims.iter()
            .for_each(|d| bytes.extend_from_slice(&d.to_be_bytes()));
        bytes.extend_from_slice(payload);
        std::fs::write(dir.join(name), bytes).unwrap();
    };
    for (prefix, count) in [("train", n), ("t10k", n / 4)] {
        let labels: Vec<u8> = (0..count).map(|i| (i % 10) as u8).collect();
        let mut pixels = vec![0u8; count * 28 * 28];
        for (i, &l) in labels.iter().enumerate() {
            // A bright horizontal band whose position encodes the label: learnable, not trivial.
            let row = 2 + 2 * l as usize;
            for x in 0..28 {
                pixels[i * 784 + row * 28 + x] = 200 + (i % 50) as u8;
            }
        }
        write(
            &format!("{prefix}-images-idx3-ubyte"),
            0x803,
            &[count as u32, 28, 28],
            &pixels,
        );
        write(
            &format!("{prefix}-labels-idx1-ubyte"),
            0x801,
            &[count as u32],
            &labels,
        );
    }
}

#[test]
fn mnist_from_a_data_dir_and_corrupt_files() {
    let dir = tmp();
    let data = dir.path().join("mnist");
    std::fs::create_dir(&data).unwrap();
    write_idx_fixture(&data, 400);
    let out = dir.path().join("run").display().to_string();
    let data_arg = data.display().to_string();
    let base = [
        "fedavg",
        "--dataset",
        "mnist",
        "--data-dir",
        &data_arg,
        "--clients",
        "4",
        "--sample",
        "2",
        "--rounds",
        "2",
        "--local-epochs",
        "2",
        "--partition",
        "iid",
        "--lr",
        "0.05",
        "--quiet",
        "--out",
        &out,
    ];
    let o = fl(&base);
    assert!(o.status.success(), "{}", stderr(&o));
    let m = metrics(Path::new(&out));
    assert!(
        m[1]["test_acc"].as_f64().unwrap() > 0.5,
        "fixture not learned: {m:?}"
    );

    // Truncate the training images: a clear error naming the file.
    let images = data.join("train-images-idx3-ubyte");
    let bytes = std::fs::read(&images).unwrap();
    std::fs::write(&images, &bytes[..bytes.len() - 10]).unwrap();
    let out2 = dir.path().join("run2").display().to_string();
    let mut args = base.to_vec();
    *args.last_mut().unwrap() = &out2;
    let o = fl(&args);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("train-images-idx3-ubyte") && err.contains("payload"),
        "{err}"
    );
}

#[test]
fn plot_and_compare_summarise_seed_groups() {
    let dir = tmp();
    let data = dir.path().join("mnist");
    std::fs::create_dir(&data).unwrap();
    write_idx_fixture(&data, 400);
    let run = |algorithm: &str, seeds: &str, out: &Path| {
        let args: Vec<String> = [
            algorithm,
            "--dataset",
            "mnist",
            "--data-dir",
            &data.display().to_string(),
            "--clients",
            "4",
            "--sample",
            "2",
            "--rounds",
            "2",
            "--local-epochs",
            "1",
            "--partition",
            "iid",
            "--seeds",
            seeds,
            "--quiet",
            "--out",
            &out.display().to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
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
    let o = fl(&[
        "plot",
        &g,
        &s,
        "-o",
        &png.display().to_string(),
        "--title",
        "t",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let img = image::open(&png).expect("a decodable PNG");
    assert_eq!((img.width(), img.height()), (1000, 600));
    // Not a blank canvas: the curves and text drew non-white pixels.
    let rgb = img.to_rgb8();
    let ink = rgb.pixels().filter(|p| p.0 != [255, 255, 255]).count();
    assert!(ink > 5_000, "only {ink} non-white pixels");
    let svg = dir.path().join("loss.svg");
    let o = fl(&[
        "plot",
        &g,
        "--metric",
        "loss",
        "-o",
        &svg.display().to_string(),
    ]);
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
    let o = fl(&[
        "run",
        &smoke.display().to_string(),
        "--dataset",
        "mnist",
        "--data-dir",
        &data.display().to_string(),
        "--rounds",
        "1",
        "--quiet",
        "--out",
        &from_file.display().to_string(),
    ]);
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
    ] {
        let o = fl(&args);
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        assert!(stderr(&o).contains(expected), "{args:?}: {}", stderr(&o));
    }
}

/// Writes a CIFAR-10 binary fixture (`cifar-10-batches-bin/`): class k images are bright in
/// channel k mod 3 and dark elsewhere, so the task is learnable.
fn write_cifar10_fixture(root: &Path, per_batch: usize) {
    let dir = root.join("cifar-10-batches-bin");
    std::fs::create_dir_all(&dir).unwrap();
    let files: Vec<String> = (1..=5)
        .map(|b| format!("data_batch_{b}.bin"))
        .chain(["test_batch.bin".to_string()])
        .collect();
    for f in files {
        let mut bytes = Vec::new();
        for i in 0..per_batch {
            let label = (i % 10) as u8;
            bytes.push(label);
            for c in 0..3 {
                let v = if c == label as usize % 3 {
                    200
                } else {
                    20 + label * 5
                };
                bytes.extend(std::iter::repeat_n(v, 1024));
            }
        }
        std::fs::write(dir.join(f), bytes).unwrap();
    }
}

/// Writes a LEAF FEMNIST fixture with `writers` writers, writer `w` with `per_writer(w)` samples
/// in each split.
fn write_femnist_fixture(root: &Path, writers: usize, per_writer: impl Fn(usize) -> usize) {
    for split in ["train", "test"] {
        let dir = root.join("data").join(split);
        std::fs::create_dir_all(&dir).unwrap();
        let users: Vec<String> = (0..writers).map(|w| format!("w{w:04}")).collect();
        let mut user_data = serde_json::Map::new();
        for (w, u) in users.iter().enumerate() {
            let y: Vec<usize> = (0..per_writer(w)).map(|s| (w + s) % 62).collect();
            let x: Vec<Vec<f32>> = y
                .iter()
                .map(|&l| {
                    (0..784)
                        .map(|p| if p / 28 == l % 28 { 1.0 } else { 0.0 })
                        .collect()
                })
                .collect();
            user_data.insert(u.clone(), serde_json::json!({ "x": x, "y": y }));
        }
        let json = serde_json::json!({ "users": users, "user_data": user_data });
        std::fs::write(dir.join("all_data_0.json"), json.to_string()).unwrap();
    }
}

/// One FedAvg round of 2 of 4 IID clients on `dataset` read from `data_dir`.
fn one_round_on(dataset: &str, data_dir: &Path, out: &Path) -> Output {
    fl(&[
        "fedavg",
        "--dataset",
        dataset,
        "--data-dir",
        &data_dir.display().to_string(),
        "--clients",
        "4",
        "--sample",
        "2",
        "--rounds",
        "1",
        "--local-epochs",
        "1",
        "--partition",
        "iid",
        "--quiet",
        "--out",
        &out.display().to_string(),
    ])
}

#[test]
fn cifar10_svhn_and_femnist_run_from_their_native_formats() {
    let dir = tmp();
    let cifar = dir.path().join("cifar");
    write_cifar10_fixture(&cifar, 40);
    let out = dir.path().join("cifar-run");
    let o = one_round_on("cifar10", &cifar, &out);
    assert!(o.status.success(), "{}", stderr(&o));
    let m = metrics(&out);
    // The 3-channel cnn: 62,006 parameters per model, 2 clients each way.
    assert_eq!(m[0]["bytes_down"], 2 * 62_006 * 4);

    // CIFAR-100's binary files (coarse label, fine label, pixels), trained on the 20 coarse
    // classes as the FedMR/FedCross code does: the cnn's head has 20 outputs.
    let c100 = dir.path().join("c100").join("cifar-100-binary");
    std::fs::create_dir_all(&c100).unwrap();
    for (file, n) in [("train.bin", 40u8), ("test.bin", 10)] {
        let bytes: Vec<u8> = (0..n)
            .flat_map(|i| {
                let mut r = vec![i % 20, (i * 3) % 100];
                r.extend(std::iter::repeat_n(i * 6, 3072));
                r
            })
            .collect();
        std::fs::write(c100.join(file), bytes).unwrap();
    }
    let out = dir.path().join("c100-run");
    let o = one_round_on("cifar100-coarse", &dir.path().join("c100"), &out);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(metrics(&out)[0]["bytes_down"], 2 * (62_006 + 85 * 10) * 4);

    // SVHN's MATLAB files (compressed, as distributed), found in an `svhn/` subfolder.
    let svhn = dir.path().join("data").join("svhn");
    std::fs::create_dir_all(&svhn).unwrap();
    for (file, n) in [("train_32x32.mat", 40), ("test_32x32.mat", 10)] {
        let images: Vec<Vec<u8>> = (0..n)
            .map(|i| (0..3072).map(|p| ((p * 13 + i * 29) % 256) as u8).collect())
            .collect();
        let labels: Vec<f64> = (0..n).map(|i| (i % 10 + 1) as f64).collect();
        fl_data::svhn::write_fixture(&svhn.join(file), &images, &labels, true).unwrap();
    }
    let out = dir.path().join("svhn-run");
    let o = one_round_on("svhn", &dir.path().join("data"), &out);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(metrics(&out).len(), 1);

    let femnist = dir.path().join("leaf");
    write_femnist_fixture(&femnist, 6, |_| 5);
    let run = |clients: &str, partition: &str, out: &Path| {
        fl(&[
            "fedmr",
            "--dataset",
            "femnist",
            "--data-dir",
            &femnist.display().to_string(),
            "--clients",
            clients,
            "--sample",
            "2",
            "--rounds",
            "1",
            "--local-epochs",
            "1",
            "--partition",
            partition,
            "--quiet",
            "--out",
            &out.display().to_string(),
        ])
    };
    let out = dir.path().join("femnist-run");
    let o = run("6", "natural", &out);
    assert!(o.status.success(), "{}", stderr(&o));
    // One client per writer, 5 samples each; the 62-class cnn has 160,510 parameters.
    let partition: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("partition.json")).unwrap())
            .unwrap();
    let sizes: Vec<usize> = partition["clients"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_array().unwrap().len())
        .collect();
    assert_eq!(sizes, vec![5; 6]);
    assert_eq!(metrics(&out)[0]["bytes_up"], 2 * 160_510 * 4);
    let o = run("7", "natural", &dir.path().join("too-many"));
    assert!(
        stderr(&o).contains("more than the 6 writers"),
        "{}",
        stderr(&o)
    );
    // `--clients 0`: every writer; `--sample-fraction`: the FedMR authors' `--frac`.
    let all = dir.path().join("all-writers");
    let o = fl(&[
        "fedavg",
        "--dataset",
        "femnist",
        "--data-dir",
        &femnist.display().to_string(),
        "--clients",
        "0",
        "--sample-fraction",
        "0.5",
        "--partition",
        "natural",
        "--rounds",
        "1",
        "--local-epochs",
        "1",
        "--quiet",
        "--out",
        &all.display().to_string(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(metrics(&all)[0]["clients"].as_array().unwrap().len(), 3);
    let config = std::fs::read_to_string(all.join("config.toml")).unwrap();
    assert!(
        config.contains("clients = 6") && config.contains("sample = 3"),
        "{config}"
    );
    // Only writers with enough samples (the FedMR paper's LEAF `-k 100`, here 6): writers of
    // 3..8 samples leave the three with 6, 7 and 8.
    let uneven = dir.path().join("leaf-uneven");
    write_femnist_fixture(&uneven, 6, |w| 3 + w);
    let kept = dir.path().join("kept-writers");
    let o = fl(&[
        "fedavg",
        "--dataset",
        "femnist",
        "--data-dir",
        &uneven.display().to_string(),
        "--clients",
        "0",
        "--sample",
        "2",
        "--partition",
        "natural",
        "--min-writer-samples",
        "6",
        "--rounds",
        "1",
        "--local-epochs",
        "1",
        "--quiet",
        "--out",
        &kept.display().to_string(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let partition: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(kept.join("partition.json")).unwrap())
            .unwrap();
    let sizes: Vec<usize> = partition["clients"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_array().unwrap().len())
        .collect();
    assert_eq!(sizes, [6, 7, 8]);
    let o = fl(&[
        "fedavg",
        "--partition",
        "natural",
        "--rounds",
        "1",
        "--quiet",
        "--out",
        &dir.path().join("no-natural").display().to_string(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("needs a dataset with its own client split"),
        "{}",
        stderr(&o)
    );
}

/// Every baseline runs end to end with its defining metric; FedProx with μ = 0 is FedAvg bit
/// for bit; SCAFFOLD's client variates survive a resume.
#[test]
fn baselines_run_end_to_end() {
    let dir = tmp();
    let with = |alg: &str, name: &str, rounds: &str, extra: &[&str]| {
        let out = dir.path().join(name);
        let mut args = small_run(&out, "2", rounds);
        args[0] = alg.into();
        args.extend(extra.iter().map(|s| s.to_string()));
        (out, args)
    };
    let (avg, args) = with("fedavg", "fedavg", "2", &[]);
    run_ok(&args);
    let (prox0, args) = with("fedprox", "prox0", "2", &["--mu", "0"]);
    run_ok(&args);
    assert_eq!(metrics(&avg), metrics(&prox0));
    let log = std::fs::read_to_string(avg.join("log.txt")).unwrap();
    assert!(
        log.contains("run started") && log.contains("run finished"),
        "{log}"
    );
    assert_eq!(log.matches("round done").count(), 2, "{log}");
    assert_eq!(weights(&avg), weights(&prox0));

    let (prox, args) = with("fedprox", "prox", "2", &["--mu", "0.5"]);
    run_ok(&args);
    assert_ne!(metrics(&avg), metrics(&prox));

    let (avgm, args) = with("fedavgm", "avgm", "2", &[]);
    run_ok(&args);
    assert!(metrics(&avgm)[1]["velocity_norm"].as_f64().unwrap() > 0.0);

    let (exp, args) = with("fedexp", "exp", "2", &["--epsilon", "0.001"]);
    run_ok(&args);
    for l in metrics(&exp) {
        assert!(l["server_lr"].as_f64().unwrap() >= 1.0);
    }

    let (mutated, args) = with("fedmut", "mut", "2", &["--mut-bound", "2"]);
    run_ok(&args);
    let m = metrics(&mutated);
    assert_eq!(m[0]["mutation_imbalance"], 0.3);
    assert_eq!(m[1]["mutation_imbalance"], 0.15);

    // SCAFFOLD: 2 rounds then a resume to 3 equals 3 uninterrupted rounds.
    let (full, args) = with("scaffold", "scaffold-full", "3", &[]);
    run_ok(&args);
    let (split, args) = with("scaffold", "scaffold-split", "2", &[]);
    run_ok(&args);
    let dir_arg = split.display().to_string();
    run_ok(&["scaffold", "--resume", &dir_arg, "--rounds", "3", "--quiet"].map(String::from));
    assert_eq!(metrics(&full), metrics(&split));
    assert!(metrics(&full)[0]["control_bytes"].as_u64().unwrap() > 0);
    for acc in metrics(&full)
        .iter()
        .map(|l| l["test_acc"].as_f64().unwrap())
    {
        assert!(acc > 0.2, "SCAFFOLD accuracy {acc}");
    }

    for bad in [
        vec!["fedprox", "--mu", "-1"],
        vec!["fedavgm", "--server-momentum", "1.5"],
        vec!["fedmut", "--mut-rate", "2"],
        vec!["fedexp", "--epsilon", "0"],
    ] {
        let o = fl(&[bad.as_slice(), &["--rounds", "1", "--quiet"]].concat());
        assert!(!o.status.success());
        let err = stderr(&o);
        assert!(
            err.starts_with("error: ") && !err.contains("panicked"),
            "{err}"
        );
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
    let o = fl(&[
        "landscape",
        &run,
        "--grid",
        "5",
        "--samples",
        "300",
        "-o",
        &png.display().to_string(),
    ]);
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
    let o = fl(&["landscape", &run, "--grid", "4"]);
    assert!(
        stderr(&o).starts_with("error: --grid must be odd"),
        "{}",
        stderr(&o)
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
    let o = fl(&["bench", "--quick", "--models", "cnn", "--burn-kernels"]);
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
}

/// `fl partition` draws a fresh pathological partition and a run's own partition.
#[test]
fn partition_heat_map_and_csv() {
    let dir = tmp();
    let png = dir.path().join("p.png");
    let o = fl(&[
        "partition",
        "--partition",
        "pathological",
        "--classes-per-client",
        "2",
        "--clients",
        "20",
        "-o",
        &png.display().to_string(),
    ]);
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
    let o = fl(&[
        "partition",
        "--partition",
        "dirichlet-balanced",
        "--alpha",
        "0.1",
        "--clients",
        "10000",
        "-o",
        &png.display().to_string(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let summary = String::from_utf8_lossy(&o.stdout);
    assert!(summary.contains("sizes 6–6"), "{summary}");
    let o = fl(&["partition", "--run", "/nonexistent"]);
    assert!(
        stderr(&o).starts_with("error: /nonexistent is not a run directory"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn pfedclub_variants_run_on_fashion_mnist_and_bad_flags_are_errors() {
    let dir = tmp();
    let base = |out: &Path, extra: &[&str]| -> Vec<String> {
        [
            "pfedclub",
            "--clients",
            "5",
            "--sample",
            "2",
            "--rounds",
            "2",
            "--local-epochs",
            "1",
            "--max-samples",
            "1000",
            "--cka-samples",
            "32",
            "--candidates",
            "2",
            "--public-samples",
            "48",
            "--quiet",
        ]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .chain(["--out".to_string(), out.display().to_string()])
        .collect()
    };
    let club = dir.path().join("club");
    run_ok(&base(
        &club,
        &["--size-limit", "0.5", "--public", "unlabeled"],
    ));
    let rounds = metrics(&club);
    assert_eq!(rounds.len(), 2);
    for m in &rounds {
        let acc = m["test_acc"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&acc));
        assert_eq!(m["client_acc"].as_array().unwrap().len(), 5);
    }
    let clients: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(club.join("clients.json")).unwrap()).unwrap();
    for c in clients.as_array().unwrap() {
        if let Some(phi) = c["phi"].as_f64() {
            assert!(phi <= 0.5 + 1e-9, "size limit violated: {phi}");
        }
    }
    let manifest = std::fs::read_to_string(club.join("manifest.json")).unwrap();
    assert!(manifest.contains("\"cnn4\""), "{manifest}");
    let log = std::fs::read_to_string(club.join("log.txt")).unwrap();
    assert!(
        log.contains("run started") && log.contains("run finished"),
        "{log}"
    );
    // `fl run` takes a pFedClub run's config.toml back and reproduces the run.
    let again = dir.path().join("again");
    run_ok(&[
        "run".to_string(),
        club.join("config.toml").display().to_string(),
        "--quiet".into(),
        "--out".into(),
        again.display().to_string(),
    ]);
    assert_eq!(metrics(&again), rounds);
    // Continue the run for one more round from its checkpoint and setup.
    let o = fl(&[
        "pfedclub",
        "--resume",
        club.to_str().unwrap(),
        "--rounds",
        "3",
        "--quiet",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(metrics(&club).len(), 3);
    assert_eq!(metrics(&club)[..2], rounds[..]);
    for variant in ["pfedhr", "local"] {
        let out = dir.path().join(variant);
        run_ok(&base(&out, &["--variant", variant]));
        assert_eq!(metrics(&out).len(), 2, "{variant}");
    }
    // The homogeneous setting (the paper's Table 2): one architecture for every client.
    let same = dir.path().join("cnn2");
    run_ok(&base(&same, &["--model", "cnn2"]));
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(same.join("manifest.json")).unwrap())
            .unwrap();
    assert_eq!(
        manifest["architectures"],
        serde_json::json!(vec!["cnn2"; 5])
    );
    let config = std::fs::read_to_string(same.join("config.toml")).unwrap();
    assert!(config.contains("model = \"cnn2\""), "{config}");
    // Two seeds of the FedAvg-per-architecture baseline, one folder each.
    run_ok(&base(
        &dir.path().join("fedavg"),
        &["--variant", "fedavg", "--seeds", "1,2"],
    ));
    for seed in ["s1", "s2"] {
        assert_eq!(metrics(&dir.path().join("fedavg").join(seed)).len(), 2);
    }
    // `fl compare` reads personalised runs like any other.
    let o = fl(&[
        "compare",
        club.to_str().unwrap(),
        dir.path().join("fedavg").to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));

    for (flags, message) in [
        (vec!["--size-limit=-1"], "size limit"),
        (vec!["--groups", "0"], "groups"),
        (vec!["--zoo", "IV"], "zoo"),
        (vec!["--model", "cnn"], "need zoo architectures"),
        (vec!["--model", "zoo-ii"], "contradicts --zoo"),
        (vec!["--classes-per-client", "1"], "cover"),
        (vec!["--public-fraction", "1.5"], "fraction"),
    ] {
        let o = fl(&base(&dir.path().join("bad"), &flags)
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>());
        assert!(!o.status.success(), "{flags:?} should fail");
        let err = stderr(&o);
        assert!(err.contains(message), "{flags:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// MOON, FedASAM, clustered sampling and FedGen end to end: MOON with μ = 0 is FedAvg bit for
/// bit; FedGen's first round (before its generator is used) is FedAvg's; clustered sampling
/// and FedGen resume to the uninterrupted result; bad flags are one-line errors. 200 clients,
/// so a round of 3 trains on about 900 images.
#[test]
fn moon_fedasam_clusamp_and_fedgen_run_end_to_end() {
    let dir = tmp();
    let with = |alg: &str, name: &str, rounds: &str, extra: &[&str]| {
        let out = dir.path().join(name);
        let mut args = small_run(&out, "2", rounds);
        args[0] = alg.into();
        let clients = args.iter().position(|a| a == "--clients").unwrap() + 1;
        args[clients] = "200".into();
        args.extend(extra.iter().map(|s| s.to_string()));
        (out, args)
    };
    let resumes_exactly = |alg: &str, extra: &[&str]| {
        let (full, args) = with(alg, &format!("{alg}-full"), "3", extra);
        run_ok(&args);
        let (split, args) = with(alg, &format!("{alg}-split"), "2", extra);
        run_ok(&args);
        let dir_arg = split.display().to_string();
        run_ok(&[alg, "--resume", &dir_arg, "--rounds", "3", "--quiet"].map(String::from));
        assert_eq!(metrics(&full), metrics(&split), "{alg}");
        assert_eq!(weights(&full), weights(&split), "{alg}");
        metrics(&full)
    };
    let (avg, args) = with("fedavg", "fedavg", "2", &[]);
    run_ok(&args);

    let (moon0, args) = with("moon", "moon0", "2", &["--moon-mu", "0"]);
    run_ok(&args);
    assert_eq!(
        metrics(&avg),
        metrics(&moon0)
            .iter()
            .map(|l| {
                let mut l = l.clone();
                l.as_object_mut().unwrap().remove("stored_models");
                l
            })
            .collect::<Vec<_>>()
    );
    let (moon, args) = with("moon", "moon", "2", &[]);
    run_ok(&args);
    let m = metrics(&moon);
    assert_eq!(m[0]["stored_models"], 3);
    assert_ne!(m[1]["test_loss"], metrics(&avg)[1]["test_loss"]);
    let config = std::fs::read_to_string(moon.join("config.toml")).unwrap();
    assert!(config.contains("moon_mu = 5.0"), "{config}");

    let (asam, args) = with("fedasam", "asam", "2", &["--rho", "0.5"]);
    run_ok(&args);
    assert_ne!(
        metrics(&asam)[0]["test_loss"],
        metrics(&avg)[0]["test_loss"]
    );

    let m = resumes_exactly("clusamp", &[]);
    for l in &m {
        assert_eq!(l["clients"].as_array().unwrap().len(), 3);
        assert!(l["clusters"].as_u64().unwrap() >= 3, "{l}");
        assert!(l["test_loss"].as_f64().unwrap().is_finite());
    }

    let m = resumes_exactly("fedgen", &["--gen-steps", "5"]);
    assert_eq!(m[0]["test_loss"], metrics(&avg)[0]["test_loss"]);
    assert_ne!(m[1]["test_loss"], metrics(&avg)[1]["test_loss"]);
    for l in &m {
        assert!(l["generator_loss"].as_f64().unwrap().is_finite(), "{l}");
    }
    assert_eq!(m[0]["generator_bytes_down"], 0);
    assert!(m[1]["generator_bytes_down"].as_u64().unwrap() > 0);

    for bad in [
        vec!["moon", "--tau", "0"],
        vec!["moon", "--moon-mu", "-1"],
        vec!["fedasam", "--rho", "0"],
        vec!["fedasam", "--eta", "-0.1"],
        vec!["clusamp", "--cluster-distance", "cosine2"],
        vec!["clusamp", "--linkage", "single"],
        vec!["fedgen", "--gen-noise", "pink"],
        vec!["fedgen", "--gen-lr", "0"],
    ] {
        let o = fl(&[bad.as_slice(), &["--rounds", "1", "--quiet"]].concat());
        assert!(!o.status.success(), "{bad:?}");
        let err = stderr(&o);
        assert!(
            err.starts_with("error: ") && !err.contains("panicked"),
            "{err}"
        );
    }
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
    let o = fl(&[
        "download",
        "fashion-mnist",
        "--mirror",
        &mirror,
        "--dir",
        &target.display().to_string(),
        "--quiet",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.starts_with("error: download failed") && err.contains(&mirror),
        "{err}"
    );
    assert_eq!(std::fs::read_dir(&target).unwrap().count(), 0);
    for (dataset, expected) in [("femnist", "LEAF"), ("imagenet", "unknown dataset")] {
        let o = fl(&["download", dataset, "--quiet"]);
        assert_eq!(o.status.code(), Some(1));
        assert!(stderr(&o).contains(expected), "{}", stderr(&o));
    }
}
