//! Per-client evaluation from the command line: `--personal` (pFedClub's split for any
//! method), `--fine-tune-steps`, and Per-FedAvg.

mod common;

use common::*;

const SPLIT: &str = "--personal --partition pathological --clients 8 --sample 3 --local-epochs 1 \
    --batch-size 32 --max-samples 3000 --seed 4 --quiet";

fn run(algorithm: &str, extra: &str, rounds: usize, out: &std::path::Path) {
    let line = format!("{algorithm} {SPLIT} {extra} --rounds {rounds}");
    let o = fl_line(&line, &["--out", out.to_str().unwrap()]);
    assert!(o.status.success(), "fl {line}: {}", stderr(&o));
}

#[test]
fn global_methods_are_evaluated_on_each_clients_own_test_portion() {
    let dir = tmp();
    let (plain, tuned) = (dir.path().join("plain"), dir.path().join("tuned"));
    run("fedavg", "", 2, &plain);
    run("fedavg", "--fine-tune-steps 3", 2, &tuned);
    assert!(plain.join("split.json").is_file());
    // `fl partition` draws the clients' training portions of the pooled samples, for the run
    // and for the same flags.
    let csv = |name: &str, args: &[&str]| {
        let image = dir.path().join(format!("{name}.png"));
        let o = fl(&[&["partition", "-o", image.to_str().unwrap()], args].concat());
        assert!(o.status.success(), "{}", stderr(&o));
        std::fs::read_to_string(image.with_extension("csv")).unwrap()
    };
    let of_run = csv("of-run", &["--run", plain.to_str().unwrap()]);
    assert_eq!(of_run, csv("of-flags", &words(SPLIT)));
    let split: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(plain.join("split.json")).unwrap()).unwrap();
    let sizes: Vec<usize> = of_run
        .lines()
        .skip(1)
        .map(|l| {
            l.split(',')
                .skip(1)
                .map(|n| n.parse::<usize>().unwrap())
                .sum()
        })
        .collect();
    let train: Vec<usize> = split["train"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_array().unwrap().len())
        .collect();
    assert_eq!(sizes, train);
    let (p, t) = (metrics(&plain), metrics(&tuned));
    for m in &p {
        let accs: Vec<f64> = m["client_acc"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_f64().unwrap())
            .collect();
        assert_eq!(accs.len(), 8);
        let mean = accs.iter().sum::<f64>() / 8.0;
        assert!((mean - m["test_acc"].as_f64().unwrap()).abs() < 1e-3);
    }
    // Fine-tuning changes what is evaluated, not what is trained.
    assert_eq!(p[1]["train_loss"], t[1]["train_loss"]);
    assert_ne!(p[1]["test_acc"], t[1]["test_acc"]);
    assert_eq!(t[1]["fine_tune_steps"], 3);
    // A method with its own evaluation (FedMR) is evaluated per client too.
    let fedmr = dir.path().join("fedmr");
    run("fedmr", "", 1, &fedmr);
    assert_eq!(
        metrics(&fedmr)[0]["client_acc"].as_array().unwrap().len(),
        8
    );
}

#[test]
fn per_fedavg_pfedme_and_pfedbayes_resume_exactly() {
    let dir = tmp();
    for (algorithm, extra) in [
        ("perfedavg", "--hessian-free"),
        ("pfedme", "--inner-steps 2"),
        ("pfedbayes", "--inner-steps 2"),
    ] {
        let full = dir.path().join(format!("{algorithm}-full"));
        let resumed = dir.path().join(format!("{algorithm}-resumed"));
        run(algorithm, extra, 3, &full);
        run(algorithm, extra, 2, &resumed);
        let r = resumed.display().to_string();
        let o = fl(&[algorithm, "--resume", &r, "--rounds", "3", "--quiet"]);
        assert!(o.status.success(), "{}", stderr(&o));
        assert_eq!(metrics(&full), metrics(&resumed), "{algorithm}");
        assert_eq!(weights(&full), weights(&resumed), "{algorithm}");
        let last = &metrics(&full)[2];
        if algorithm == "pfedbayes" {
            // Personalised posteriors, and the global posterior's mean beside them; the
            // uploads are posteriors (μ and ρ).
            assert_eq!(last["client_acc"].as_array().unwrap().len(), 8);
            assert!(last["global_acc"].as_f64().is_some());
            let fedavg = metrics(&dir.path().join("perfedavg-full"));
            let (b, f) = (
                last["bytes_up"].as_u64().unwrap(),
                fedavg[2]["bytes_up"].as_u64().unwrap(),
            );
            assert!(b > f * 19 / 10 && b <= 2 * f, "{b} vs {f}");
        } else {
            assert!(last["fine_tune_steps"].as_u64().unwrap() > 0);
        }
    }
}

#[test]
fn personal_split_settings_are_checked_and_old_configs_still_read() {
    let dir = tmp();
    let out = dir.path().join("x").display().to_string();
    for (line, expected) in [
        (
            "fedavg --max-samples 100",
            "--max-samples applies only with --personal",
        ),
        (
            "fedavg --test-fraction 0.3",
            "--test-fraction applies only with --personal",
        ),
        (
            "fedavg --personal --max-samples 1",
            "--max-samples must be at least 2",
        ),
        (
            "fedavg --personal --partition natural",
            "the personal split is drawn",
        ),
        (
            "perfedavg --personal --fine-tune-steps 2",
            "--fine-tune-steps does not apply",
        ),
        ("perfedavg --inner-lr=-1", "alpha must be >= 0"),
        (
            "perfedavg --hessian-free --hvp-delta 0",
            "delta must be > 0",
        ),
        ("pfedme --lambda 0", "lambda must be > 0"),
        ("pfedme --beta 0", "--beta must be > 0"),
        ("pfedme --inner-steps 0", "inner steps must be at least 1"),
        ("pfedbayes --zeta=-1", "zeta must be >= 0"),
        ("pfedbayes --noise=-0.5", "noise must be >= 0"),
        (
            "pfedbayes --personal-lr 0",
            "personal learning rate must be > 0",
        ),
        (
            "pfedbayes --personal --fine-tune-steps 2",
            "--fine-tune-steps does not apply",
        ),
        (
            "fedmr --personal --eval-models",
            "--eval-models does not apply to --personal",
        ),
    ] {
        fails(
            &[words(line), vec!["--quiet", "--out", &out]].concat(),
            expected,
        );
    }
    // A pFedClub config of an earlier version kept the split's settings in [pfedclub].
    let old = dir.path().join("old.toml");
    std::fs::write(
        &old,
        "algorithm = \"pfedclub\"\nclients = 8\nsample = 2\nrounds = 1\nlocal_epochs = 1\n\
         partition = \"pathological\"\n[pfedclub]\nvariant = \"local\"\nmax_samples = 900\n\
         test_fraction = 0.3\n",
    )
    .unwrap();
    let run = dir.path().join("old-run");
    let o = fl(&[
        "run",
        old.to_str().unwrap(),
        "--quiet",
        "--out",
        run.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let config = std::fs::read_to_string(run.join("config.toml")).unwrap();
    let top = config.split("[pfedclub]").next().unwrap();
    assert!(
        top.contains("max_samples = 900") && top.contains("test_fraction = 0.3"),
        "{config}"
    );
    // A pFedClub run's partition indexes its pooled samples too.
    let image = dir.path().join("club.png");
    let o = fl(&[
        "partition",
        "--run",
        run.to_str().unwrap(),
        "-o",
        image.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let said = String::from_utf8_lossy(&o.stdout);
    assert!(said.starts_with("8 clients:"), "{said}");
    // It has no global model for `fl landscape`; it has finished, though.
    fails(
        &["landscape", run.to_str().unwrap()],
        "is a run of `fl pfedclub` (variant local): its clients keep their own models",
    );
}
