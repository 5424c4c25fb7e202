//! Tests of the configuration: files, flags, sections, the shipped configs.
use super::*;
use crate::algorithms::pfedclub::Public;
use fl_core::strategy::pfedclub::cmsr::Anchor;

fn write(dir: &Path, text: &str) -> PathBuf {
    let file = dir.join("c.toml");
    std::fs::write(&file, text).unwrap();
    file
}

#[test]
fn flags_override_the_file_which_overrides_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path(), "rounds = 7\nlr = 0.1\nalpha = 0.1\n");
    let mut args = RunArgs {
        config: Some(file),
        given: vec!["lr".into()],
        ..Default::default()
    };
    args.settings.lr = 0.05;
    // Not given on the command line: the flag's default does not override the file.
    args.settings.rounds = 3;
    let cfg = RunConfig::resolve(None, &args).unwrap();
    let r = &cfg.run;
    assert_eq!((r.rounds, r.lr, r.alpha, r.clients), (7, 0.05, 0.1, 100));
    let dir2 = tempfile::tempdir().unwrap();
    let back = RunConfig::from_file(&write(dir2.path(), &cfg.to_toml())).unwrap();
    assert_eq!(back, cfg);
}

#[test]
fn algorithm_settings_live_in_their_section_or_flat() {
    let dir = tempfile::tempdir().unwrap();
    let sectioned = RunConfig::from_file(&write(
        dir.path(),
        "algorithm = \"fedmr\"\nrounds = 3\n[fedmr]\ngranularity = \"layer\"\n",
    ))
    .unwrap();
    let flat = RunConfig::from_file(&write(
        dir.path(),
        "algorithm = \"fedmr\"\nrounds = 3\ngranularity = \"layer\"\n",
    ))
    .unwrap();
    assert_eq!(sectioned, flat);
    let Algorithm::Fedmr(s) = &flat.algorithm else {
        panic!("{flat:?}")
    };
    assert_eq!(s.granularity, crate::algorithms::fedmr::Unit::Layer);
    assert!(flat.to_toml().contains("[fedmr]\ngranularity = \"layer\""));
    // Another algorithm's settings: ignored at their defaults, an error otherwise.
    let legacy = "algorithm = \"fedavg\"\nweighted = true\ngranularity = \"tensor\"\n";
    RunConfig::from_file(&write(dir.path(), legacy)).unwrap();
    let wrong = "algorithm = \"fedavg\"\ngranularity = \"layer\"\n";
    let e = format!(
        "{:#}",
        RunConfig::from_file(&write(dir.path(), wrong)).unwrap_err()
    );
    assert!(e.contains("`granularity` is a fedmr setting"), "{e}");
    let e = format!(
        "{:#}",
        RunConfig::from_file(&write(dir.path(), "[fedcross]\ncross_alpha = 0.5\n")).unwrap_err()
    );
    assert!(e.contains("[fedcross] section does not apply"), "{e}");
}

#[test]
fn unknown_fields_and_bad_values_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    for (text, expected) in [
        ("roudns = 7\n", "roudns"),
        (
            "algorithm = \"fedmr\"\n[fedmr]\ngranularty = \"layer\"\n",
            "granularty",
        ),
        ("partition = \"zipf\"\n", "zipf"),
        ("algorithm = \"fedsgd\"\n", "unknown algorithm 'fedsgd'"),
    ] {
        let e = format!(
            "{:#}",
            RunConfig::from_file(&write(dir.path(), text)).unwrap_err()
        );
        assert!(e.contains(expected), "{text}: {e}");
    }
    let run = RunSettings {
        alpha: 0.0,
        ..Default::default()
    };
    assert!(run.partition_scheme().is_err());
}

#[test]
fn every_shipped_config_parses_and_checks() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
    let mut count = 0;
    for dir in [root.clone(), root.join("paper")] {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_none_or(|e| e != "toml") {
                continue;
            }
            let cfg = RunConfig::from_file(&path).unwrap();
            let name = path.display();
            cfg.run.partition_scheme().unwrap();
            cfg.run.dataset_kind().unwrap();
            if !matches!(cfg.algorithm, Algorithm::Pfedclub(_)) {
                cfg.run.model_kind().unwrap();
            }
            // The papers' momentum: FedCross §4.1 says 0.5, FedMR's paper 0.9 (pFedClub
            // trains with Adam).
            if dir.ends_with("paper") {
                match cfg.algorithm {
                    Algorithm::Fedcross(_) => assert_eq!(cfg.run.momentum, 0.5, "{name}"),
                    Algorithm::Fedmr(_) => assert_eq!(cfg.run.momentum, 0.9, "{name}"),
                    _ => {}
                }
            }
            let check = cfg.algorithm.settings().check(&cfg.run);
            assert!(check.is_ok(), "{name}: {check:?}");
            count += 1;
        }
    }
    assert!(count >= 125, "{count}");
}

/// Every cell of pFedClub's Tables 1, 2, 3 and 5 has a config with the paper's settings.
#[test]
fn pfedclub_paper_configs_cover_its_tables() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/paper");
    let load = |name: &str| {
        let cfg = RunConfig::from_file(&dir.join(format!("pfedclub-{name}.toml")))
            .unwrap_or_else(|e| panic!("{name}: {e:#}"));
        let Algorithm::Pfedclub(club) = &cfg.algorithm else {
            panic!("{name}: not pfedclub")
        };
        let r = &cfg.run;
        assert_eq!(
            (r.clients, r.sample, r.local_epochs, r.batch_size, r.lr),
            (50, 5, 10, 64, 0.001),
            "{name}"
        );
        assert_eq!((club.stitch_epochs, club.candidates), (3, 4), "{name}");
        assert_eq!(
            (club.distill_weight, cfg.run.public_fraction),
            (0.2, 0.08),
            "{name}"
        );
        (cfg.run.clone(), club.clone())
    };
    let mut cells = 0;
    for (zoo, roman) in [("zoo1", "I"), ("zoo2", "II"), ("zoo3", "III")] {
        for dataset in ["mnist", "svhn", "cifar10"] {
            for (partition, classes) in [("iid", None), ("noniid", Some(2))] {
                for public in ["labeled", "unlabeled"] {
                    let (run, club) = load(&format!("{zoo}-{dataset}-{partition}-{public}"));
                    assert_eq!(run.dataset, dataset);
                    assert_eq!(run.model, format!("zoo-{}", roman.to_lowercase()));
                    assert_eq!(club.zoo, roman.parse().unwrap());
                    assert_eq!(club.public == Public::Labeled, public == "labeled");
                    match classes {
                        None => assert_eq!(run.partition, PartitionKind::Iid),
                        Some(c) => {
                            assert_eq!(run.partition, PartitionKind::Pathological);
                            assert_eq!(run.classes_per_client, c);
                        }
                    }
                    assert_eq!(club.groups, 4);
                    cells += 1;
                }
            }
        }
    }
    for model in ["cnn2", "mobilenet-v2"] {
        for dataset in ["mnist", "svhn", "cifar10"] {
            for partition in ["iid", "noniid"] {
                let (run, club) = load(&format!("{model}-{dataset}-{partition}-labeled"));
                assert_eq!(
                    club.architectures(&run).unwrap(),
                    vec![run.model_kind().unwrap(); 50]
                );
                cells += 1;
            }
        }
    }
    let ablation = "zoo1-cifar10-noniid-labeled";
    let (_, c) = load(&format!("{ablation}-anchor-min"));
    assert_eq!(
        (c.anchor, c.no_order, c.no_completion),
        (Anchor::Min, false, false)
    );
    let (_, c) = load(&format!("{ablation}-no-order"));
    assert_eq!(
        (c.anchor, c.no_order, c.no_completion),
        (Anchor::Random, true, false)
    );
    let (_, c) = load(&format!("{ablation}-no-completion"));
    assert_eq!(
        (c.anchor, c.no_order, c.no_completion),
        (Anchor::Random, false, true)
    );
    for k in [2, 3, 5, 6] {
        assert_eq!(load(&format!("{ablation}-k{k}")).1.groups, k);
    }
    cells += 7;
    let shipped = std::fs::read_dir(&dir)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("pfedclub-")
        })
        .count();
    assert_eq!(shipped, cells);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 128, ..Default::default() })]

    /// A damaged config file (bytes flipped, cut, grown) is read or refused, never a panic.
    #[test]
    fn damaged_config_files_never_panic(
        algorithm in proptest::sample::select(crate::algorithms::NAMES),
        at in proptest::prelude::any::<usize>(),
        noise in proptest::collection::vec(proptest::prelude::any::<u8>(), 1..32),
        cut in proptest::prelude::any::<bool>(),
    ) {
        let mut bytes = RunConfig {
            run: RunSettings::default(),
            algorithm: Algorithm::with_defaults(algorithm).unwrap(),
        }
        .to_toml()
        .into_bytes();
        let n = bytes.len();
        if cut {
            bytes.truncate(at % n);
        } else {
            let at = at % n;
            bytes.splice(at..at, noise.iter().copied());
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.toml");
        std::fs::write(&path, &bytes).unwrap();
        match RunConfig::from_file(&path) {
            Ok(cfg) => drop(cfg.to_toml()),
            Err(e) => proptest::prop_assert!(!format!("{e:#}").contains('\n'), "{e:#}"),
        }
    }
}

#[test]
fn table2_baseline_configs_match_pfedclubs_cells() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/paper");
    let mut cells = 0;
    for (method, algorithm) in [
        ("fedavg", "fedavg"),
        ("fedprox", "fedprox"),
        ("perfedavg", "perfedavg"),
        ("perfedavg-hf", "perfedavg"),
        ("pfedme", "pfedme"),
        ("pfedbayes", "pfedbayes"),
    ] {
        for model in ["cnn2", "mobilenet-v2"] {
            for dataset in ["mnist", "svhn", "cifar10"] {
                for partition in ["iid", "noniid"] {
                    let name = format!("table2-{method}-{model}-{dataset}-{partition}");
                    let cfg = RunConfig::from_file(&dir.join(format!("{name}.toml")))
                        .unwrap_or_else(|e| panic!("{name}: {e:#}"));
                    let r = &cfg.run;
                    assert_eq!(cfg.algorithm.name(), algorithm, "{name}");
                    assert!(r.personal, "{name}");
                    assert_eq!((r.model.as_str(), r.dataset.as_str()), (model, dataset));
                    // The same split and seed as pFedClub's Table 2 cell.
                    let club = RunConfig::from_file(&dir.join(format!(
                        "pfedclub-{model}-{dataset}-{partition}-labeled.toml"
                    )))
                    .unwrap();
                    let c = &club.run;
                    assert_eq!(
                        (
                            r.clients,
                            r.sample,
                            r.rounds,
                            r.local_epochs,
                            r.batch_size,
                            r.seed
                        ),
                        (
                            c.clients,
                            c.sample,
                            c.rounds,
                            c.local_epochs,
                            c.batch_size,
                            c.seed
                        ),
                        "{name}"
                    );
                    assert_eq!(
                        (r.partition, r.classes_per_client),
                        (c.partition, c.classes_per_client)
                    );
                    assert_eq!(
                        (r.public_fraction, r.test_fraction, r.max_samples),
                        (c.public_fraction, c.test_fraction, c.max_samples)
                    );
                    if let Algorithm::Perfedavg(s) = &cfg.algorithm {
                        assert_eq!(s.hessian_free, method.ends_with("-hf"), "{name}");
                    }
                    let check = cfg.algorithm.settings().check(&cfg.run);
                    assert!(check.is_ok(), "{name}: {check:?}");
                    cells += 1;
                }
            }
        }
    }
    let shipped = std::fs::read_dir(&dir)
        .unwrap()
        .filter(|e| {
            let name = e.as_ref().unwrap().file_name();
            name.to_string_lossy().starts_with("table2-")
        })
        .count();
    assert_eq!(shipped, cells);
}
