//! Every algorithm end to end on real Fashion-MNIST: its defining metric, equivalences
//! (FedProx with μ = 0 is FedAvg), exact resume, and one-line errors for bad flags.

mod common;

use std::path::Path;

use common::*;

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

    for (bad, expected) in [
        ("fedprox --mu -1", "--mu must be >= 0"),
        (
            "fedavgm --server-momentum 1.5",
            "--server-momentum must be in [0, 1)",
        ),
        ("fedmut --mut-rate 2", "--mut-rate must be in [0, 1]"),
        ("fedexp --epsilon 0", "--epsilon must be > 0"),
    ] {
        fails(&words(&format!("{bad} --rounds 1 --quiet")), expected);
    }
}

/// pFedClub's small setting: 5 clients of zoo III on 1,000 pooled samples.
const CLUB: &str = "pfedclub --clients 5 --sample 2 --rounds 2 --local-epochs 1 \
    --max-samples 1000 --cka-samples 32 --candidates 2 --public-samples 48 --quiet";

#[test]
fn pfedclub_variants_run_on_fashion_mnist_and_bad_flags_are_errors() {
    let dir = tmp();
    let base = |out: &Path, extra: &[&str]| -> Vec<String> {
        words(CLUB)
            .into_iter()
            .chain(extra.iter().copied())
            .map(String::from)
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
    // The server step's phases, timed (metrics() leaves timings out: read the file).
    let raw = std::fs::read_to_string(club.join("metrics.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(raw.lines().last().unwrap()).unwrap();
    let phases = last["phase_seconds"].as_object().unwrap();
    for phase in ["features", "grouping", "search", "stitching", "matching"] {
        assert!(phases[phase].as_f64().unwrap() >= 0.0, "{phase}");
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
    let o = fl_line(
        "pfedclub --rounds 3 --quiet",
        &["--resume", club.to_str().unwrap()],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(metrics(&club).len(), 3);
    assert_eq!(metrics(&club)[..2], rounds[..]);
    // φ per architecture over rounds (the paper's Fig. 6): one curve per zoo member.
    let svg = dir.path().join("phi.svg");
    let o = fl(&[
        "plot",
        club.to_str().unwrap(),
        "--metric",
        "phi",
        "--out",
        svg.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let drawn = std::fs::read_to_string(&svg).unwrap();
    assert!(
        drawn.contains("club cnn1") && drawn.contains("club cnn4"),
        "{drawn}"
    );
    for variant in ["club-no-rules", "local"] {
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
        let args = base(&dir.path().join("bad"), &flags);
        fails(
            &args.iter().map(String::as_str).collect::<Vec<_>>(),
            message,
        );
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

    for (bad, expected) in [
        ("moon --tau 0", "--tau must be > 0"),
        ("moon --moon-mu -1", "--moon-mu must be >= 0"),
        ("fedasam --rho 0", "rho must be > 0"),
        ("fedasam --eta -0.1", "eta must be >= 0"),
        (
            "clusamp --cluster-distance cosine2",
            "invalid value 'cosine2'",
        ),
        ("clusamp --linkage single", "invalid value 'single'"),
        ("fedgen --gen-noise pink", "invalid value 'pink'"),
        ("fedgen --gen-lr 0", "generator lr must be > 0"),
    ] {
        fails(&words(&format!("{bad} --rounds 1 --quiet")), expected);
    }
}

#[test]
fn flexifed_shares_the_layers_its_rule_names() {
    let dir = tmp();
    let run = |variant: &str| {
        let out = dir.path().join(variant);
        let line = format!(
            "pfedclub --variant {variant} --zoo III --clients 8 --sample 8 --rounds 1 \
             --local-epochs 1 --max-samples 1200 --quiet"
        );
        let o = fl_line(&line, &["--out", out.to_str().unwrap()]);
        assert!(o.status.success(), "{line}: {}", stderr(&o));
        weights(&out)
    };
    // Zoo III's clients: 0-1 CNN1, 2-3 CNN2, 4-5 CNN3, 6-7 CNN4 (BatchNorm from its first layer).
    let conv1 = |w: &std::collections::BTreeMap<String, Vec<u8>>, c: usize| {
        w[&format!("{c}/Stacked.convs.0.conv.weight")].clone()
    };
    let max = run("flexifed-max");
    assert!(
        (1..6).all(|c| conv1(&max, c) == conv1(&max, 0)),
        "CNN1-3 share conv1"
    );
    assert_ne!(conv1(&max, 6), conv1(&max, 0));
    let head = |w: &std::collections::BTreeMap<String, Vec<u8>>, c: usize| {
        w[&format!("{c}/Stacked.fc.1.weight")].clone()
    };
    assert_eq!(
        head(&max, 0),
        head(&max, 1),
        "one architecture shares everything"
    );
    // Nothing is common to all four architectures: Basic-Common leaves every model local.
    let basic = run("flexifed-basic");
    assert_ne!(conv1(&basic, 0), conv1(&basic, 1));
    let clustered = run("flexifed-clustered");
    assert_eq!(conv1(&clustered, 0), conv1(&clustered, 1));
    assert_ne!(conv1(&clustered, 0), conv1(&clustered, 2));
}

#[test]
fn fedmd_collaborates_through_scores_only_and_resumes_exactly() {
    let dir = tmp();
    let line = "pfedclub --variant fedmd --zoo III --clients 6 --sample 3 --local-epochs 1 \
        --max-samples 1500 --alignment 64 --transfer-epochs 1 --quiet";
    let (m, _w) = runs_and_resumes_exactly(dir.path(), line);
    // Round 1: every client is new and only learns from the public set; no bytes travel.
    assert_eq!(
        (m[0]["bytes_up"].as_u64(), m[0]["bytes_down"].as_u64()),
        (Some(0), Some(0))
    );
    // Later rounds: 64 scores of 10 classes up per communicating client, never a model.
    let scores = 4 * 64 * 10;
    assert!(m[1..].iter().any(|l| l["bytes_up"].as_u64().unwrap() > 0));
    for l in &m {
        assert_eq!(l["bytes_up"].as_u64().unwrap() % scores, 0, "{l}");
        assert_eq!(
            l["bytes_down"].as_u64().unwrap() % (scores + 4 * 64),
            0,
            "{l}"
        );
        assert!(l["client_acc"].as_array().is_some_and(|a| a.len() == 6));
    }
    for (bad, expected) in [
        ("--public unlabeled", "needs labeled public data"),
        ("--alignment 0", "at least 1 alignment sample"),
        ("--public-fraction 0", "FedMD and FCCL need public samples"),
        (
            "--public-samples 0",
            "public samples for stitching and matching must be at least 1",
        ),
    ] {
        fails(
            &words(&format!(
                "pfedclub --variant fedmd {bad} --rounds 1 --quiet"
            )),
            expected,
        );
    }
    // The server's samples are checked after --public-samples takes its share of them.
    fails(
        &words("pfedclub --public-samples 1 --rounds 1 --quiet"),
        "needs at least 2 public samples; use a public fraction > 0 and more --public-samples",
    );
}

#[test]
fn fedgh_shares_a_header_trained_on_prototypes_and_resumes_exactly() {
    let dir = tmp();
    let line = "pfedclub --variant fedgh --zoo III --clients 6 --sample 3 --local-epochs 1 \
        --max-samples 1500 --representation 64 --quiet";
    let (m, _w) = runs_and_resumes_exactly(dir.path(), line);
    // Down: the header (64 × 10 + 10 floats) per client; up: a 64-float prototype and its
    // label per class a client holds (2 classes per client, pathological).
    for l in &m {
        assert_eq!(
            l["bytes_down"].as_u64().unwrap(),
            3 * 4 * (64 * 10 + 10),
            "{l}"
        );
        let up = l["bytes_up"].as_u64().unwrap();
        assert!(
            up % (4 * 64 + 4) == 0 && up > 0 && up <= 3 * 2 * (4 * 64 + 4),
            "{l}"
        );
    }
    for (bad, expected) in [
        ("--zoo I", "has no hidden FC layer"),
        ("--header-lr 0", "server learning rate must be positive"),
        ("--representation 0", "--representation must be at least 1"),
    ] {
        fails(
            &words(&format!(
                "pfedclub --variant fedgh {bad} --rounds 1 --quiet"
            )),
            expected,
        );
    }
}

#[test]
fn heterofl_clients_hold_corners_of_one_global_model_and_resume_exactly() {
    let dir = tmp();
    let line = "pfedclub --variant heterofl --model cnn2 --clients 6 --sample 3 --local-epochs 1 \
        --max-samples 1500 --rates 1,0.5,0.25 --quiet";
    let (_m, w) = runs_and_resumes_exactly(dir.path(), line);
    // Clients 0-1 at rate 1, 2-3 at 1/2, 4-5 at 1/4: conv1 has 32, 16 and 8 filters of 1×5×5,
    // and every client's are the first of the global model's (client 0's, after the round).
    let conv1 = |c: usize| w[&format!("{c}/Stacked.convs.0.conv.weight")].clone();
    for (c, filters) in [(0, 32), (1, 32), (2, 16), (3, 16), (4, 8), (5, 8)] {
        let own = conv1(c);
        assert_eq!(own.len(), filters * 25 * 4, "client {c}");
        assert_eq!(own, conv1(0)[..own.len()], "client {c}");
    }
    for (bad, expected) in [
        ("--model zoo", "HeteroFL scales one architecture"),
        (
            "--model cnn2 --rates 1,0",
            "--rates must be width rates in (0, 1]",
        ),
        ("--model mobilenet-v2", "HeteroFL scales one architecture"),
    ] {
        fails(
            &words(&format!(
                "pfedclub --variant heterofl {bad} --rounds 1 --quiet"
            )),
            expected,
        );
    }
}

#[test]
fn fccl_learns_from_public_scores_without_labels_and_resumes_exactly() {
    let dir = tmp();
    let line = "pfedclub --variant fccl --public unlabeled --zoo III --clients 6 --sample 3 \
        --local-epochs 1 --max-samples 1500 --alignment 64 --col-batch 32 --quiet";
    let (m, _w) = runs_and_resumes_exactly(dir.path(), line);
    // Round 1 is every client's pretraining; later, scores travel, never a model.
    assert_eq!(m[0]["bytes_up"], 0);
    let scores = 4 * 64 * 10;
    assert!(m[1..].iter().any(|l| l["bytes_up"].as_u64().unwrap() > 0));
    for l in &m {
        assert_eq!(l["bytes_up"].as_u64().unwrap() % scores, 0, "{l}");
    }
    // The authors' off-diagonal target changes the run.
    let authors = dir.path().join("authors");
    let o = fl_line(
        line,
        &[
            "--out",
            authors.to_str().unwrap(),
            "--rounds",
            "3",
            "--authors-off-diagonal",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let a = metrics(&authors);
    assert_eq!(a[0], m[0]);
    if m[1]["bytes_up"].as_u64().unwrap() > 0 {
        assert_ne!(a[1]["train_loss"], m[1]["train_loss"]);
    }
    for (bad, expected) in [
        ("--col-batch 1", "at least 2 samples"),
        ("--off-diagonal -1", "off-diagonal weight must be >= 0"),
    ] {
        fails(
            &words(&format!("pfedclub --variant fccl {bad} --rounds 1 --quiet")),
            expected,
        );
    }
}

#[test]
fn fedkemf_shares_only_a_knowledge_network_and_resumes_exactly() {
    let dir = tmp();
    let line = "pfedclub --variant fedkemf --public unlabeled --zoo III --clients 6 --sample 3 \
        --local-epochs 1 --max-samples 1500 --fusion-batch 32 --quiet";
    let (m, w) = runs_and_resumes_exactly(dir.path(), line);
    // Only the knowledge network (a CNN1) travels, both ways, whatever the client's model.
    let cnn1_bytes: usize = w
        .iter()
        .filter(|(k, _)| k.starts_with("0/"))
        .map(|(_, v)| v.len())
        .sum();
    for l in &m {
        assert_eq!(
            l["bytes_down"].as_u64().unwrap() as usize,
            3 * cnn1_bytes,
            "{l}"
        );
        assert_eq!(
            l["bytes_up"].as_u64().unwrap() as usize,
            3 * cnn1_bytes,
            "{l}"
        );
        assert!(l["client_acc"].as_array().is_some_and(|a| a.len() == 6));
    }
    for (bad, expected) in [
        (
            "--knowledge-net resnet20",
            "--knowledge-net must be a zoo architecture",
        ),
        (
            "--fusion-lr 0",
            "fusion learning rate and temperature must be positive",
        ),
    ] {
        fails(
            &words(&format!(
                "pfedclub --variant fedkemf {bad} --rounds 1 --quiet"
            )),
            expected,
        );
    }
}

/// `line` run for 3 rounds, and for 2 then resumed to 3, under `dir`: the metrics and weights of
/// both, asserted equal.
fn runs_and_resumes_exactly(
    dir: &std::path::Path,
    line: &str,
) -> (
    Vec<serde_json::Value>,
    std::collections::BTreeMap<String, Vec<u8>>,
) {
    let (full, resumed) = (dir.join("full"), dir.join("resumed"));
    for (out, rounds) in [(&full, "3"), (&resumed, "2")] {
        let o = fl_line(line, &["--out", out.to_str().unwrap(), "--rounds", rounds]);
        assert!(o.status.success(), "{line}: {}", stderr(&o));
    }
    let r = resumed.display().to_string();
    let o = fl(&["pfedclub", "--resume", &r, "--rounds", "3", "--quiet"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (m, w) = (metrics(&full), weights(&full));
    assert_eq!(m, metrics(&resumed), "{line}");
    assert_eq!(w, weights(&resumed), "{line}");
    (m, w)
}

#[test]
fn pfedhr_tunes_one_shared_pool_of_layer_candidates_and_resumes_exactly() {
    let dir = tmp();
    let line = "pfedclub --variant pfedhr --zoo III --clients 6 --sample 3 --local-epochs 1 \
        --max-samples 1500 --candidates 3 --cka-samples 64 --public-samples 96 --quiet";
    let (m, w) = runs_and_resumes_exactly(dir.path(), line);
    for l in &m {
        // One pool of 3 candidates a round, every client matched to one of them.
        assert_eq!(l["candidates"].as_u64(), Some(3), "{l}");
        let valid = l["valid_candidates"].as_array().unwrap();
        assert!(valid.len() == 3 && valid.iter().all(|v| v == 3), "{l}");
        let phi = l["client_phi"].as_array().unwrap();
        assert!(phi.iter().all(serde_json::Value::is_f64), "{l}");
    }
    // The teachers' layers are copies of the round's uploads tuned on the public data: each
    // differs from the upload it was copied from (pFedClub's frozen blocks would not).
    let bytes = std::fs::read(dir.path().join("full/checkpoint.safetensors")).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let stamped: serde_json::Value =
        serde_json::from_str(&meta.metadata().as_ref().unwrap()["fl"]).unwrap();
    let extra = &stamped["header"]["extra"];
    let sources = extra["sources"].as_array().unwrap();
    assert!(!sources.is_empty());
    let copies = extra["copies"].as_array().unwrap();
    assert!(
        copies.iter().all(|c| c.as_u64().unwrap() >= 1),
        "{copies:?}"
    );
    for (i, s) in sources.iter().enumerate() {
        let (round, client) = (s[0].as_u64().unwrap(), s[1].as_u64().unwrap());
        if round != 3 {
            continue; // older uploads differ from the client's model anyway
        }
        let slot = format!("{}/", 6 + i);
        let changed = w
            .iter()
            .filter(|(k, _)| k.starts_with(&slot))
            .any(|(k, v)| w[&format!("{client}/{}", &k[slot.len()..])] != *v);
        assert!(
            changed,
            "source {i} (client {client}) is the untuned upload"
        );
    }
    fails(
        &words("pfedclub --variant pfedhr --min-layers 7 --rounds 1 --quiet"),
        "min layers <= max layers",
    );
}
