//! pFedClub on the real model zoo: stitched candidates, frozen blocks, the size limit, and
//! whole personalised runs.

use burn::module::Module;
use burn::tensor::Device;
use federated::core::engine::EngineConfig;
use federated::core::layers::ParamTable;
use federated::core::strategy::pfedclub::cmsr::BlockRef;
use federated::core::strategy::pfedclub::stitch::{
    StitchTraining, Stitches, fit_stitches, forward_candidate, stitch_shapes,
};
use federated::core::strategy::pfedclub::{ClientSummary, ClubConfig, PFedClub, PublicData};
use federated::core::trainer::{LocalOptimizer, TrainConfig, make_batch};
use federated::core::{Classifier, ClientModels, RoundMetrics, RunSummary, Simulation};
use federated::data::source::synthetic;
use federated::data::{FederatedDataset, Normalization, Partition, PartitionScheme, PersonalSplit};
use federated::models::{ModelKind, ModelZoo, ZooModel};
use rand::SeedableRng;

/// Burn's weight initialisation draws from one process-wide generator: tests that build models
/// take turns, so each run's seeded initialisation is its own.
static GLOBAL_RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn norm() -> Normalization {
    Normalization {
        mean: vec![0.5],
        std: vec![0.25],
    }
}

#[test]
fn stitched_candidates_run_and_only_the_stitches_train() {
    let _turn = GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
    let d = Device::flex().autodiff();
    d.seed(3);
    let shape = [1, 28, 28];
    let models: Vec<ZooModel> = [ModelKind::Cnn1, ModelKind::Cnn4, ModelKind::MobilenetV3]
        .into_iter()
        .map(|k| ZooModel::new(k, shape, 10, &d).unwrap().freeze())
        .collect();
    let specs: Vec<_> = models.iter().map(|m| m.blocks()).collect();
    let r = |model, block| BlockRef { model, block };
    // A CNN1-deep candidate from three architectures: every kind of stitch (map → map with a
    // resize, map → flat, flat → flat) and a head.
    let parts = vec![r(1, 0), r(0, 1), r(2, specs[2].len() - 2), r(1, 9)];
    let shapes = stitch_shapes(&parts, &specs, &shape, 10);
    assert!(
        shapes.iter().filter(|s| s.is_some()).count() >= 3,
        "{shapes:?}"
    );
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let stitches = Stitches::new(&shapes, &mut rng, &d);
    let data = synthetic(96, shape, 10, 5);
    let public: Vec<usize> = (0..96).collect();
    let (images, _) = make_batch(&data, &norm(), &public[..8], &d);
    assert_eq!(
        forward_candidate(&models, &parts, &stitches, images.clone()).dims(),
        [8, 10]
    );

    let blocks_before: Vec<_> = models
        .iter()
        .map(|m| ParamTable::from_module(m).to_host().unwrap())
        .collect();
    let stitches_before = ParamTable::from_module(&stitches).to_host().unwrap();
    for labeled in [true, false] {
        let cfg = StitchTraining {
            epochs: 1,
            batch_size: 32,
            lr: 1e-2,
            labeled,
            temperature: 0.07,
        };
        let trained = fit_stitches(
            &models,
            &parts,
            stitches.clone(),
            &data,
            &norm(),
            &public,
            &cfg,
            &mut rng,
        );
        assert_ne!(
            ParamTable::from_module(&trained).to_host().unwrap(),
            stitches_before,
            "the stitches train (labeled: {labeled})"
        );
        let blocks_after: Vec<_> = models
            .iter()
            .map(|m| ParamTable::from_module(m).to_host().unwrap())
            .collect();
        assert_eq!(blocks_before, blocks_after, "frozen blocks must not change");
    }
}

/// A small personalised run on synthetic data with Model Zoo III.
fn run(club: ClubConfig, seed: u64, threads: usize) -> (Vec<RoundMetrics>, Vec<Option<f64>>) {
    let summary = simulate(club, seed, threads, 2, None, false);
    let rounds = summary
        .rounds
        .iter()
        .map(RoundMetrics::without_timings)
        .collect();
    let clients: Vec<ClientSummary> = serde_json::from_value(summary.clients.unwrap()).unwrap();
    (rounds, clients.iter().map(|c| c.phi).collect())
}

fn simulate(
    club: ClubConfig,
    seed: u64,
    threads: usize,
    rounds: usize,
    out_dir: Option<std::path::PathBuf>,
    resume: bool,
) -> RunSummary {
    let shape = [1, 28, 28];
    let data = synthetic(640, shape, 10, 7);
    let split = PersonalSplit::new(
        &PartitionScheme::Pathological {
            classes_per_client: 2,
        },
        data.labels(),
        10,
        5,
        0.1,
        0.2,
        seed,
    )
    .unwrap();
    let kinds = ModelZoo::Iii.assign(5);
    let d = Device::flex().autodiff();
    let build = |c: usize| ZooModel::new(kinds[c], shape, 10, &d).unwrap();
    let normalization = norm();
    let federated = FederatedDataset {
        name: "synthetic".into(),
        origin: "generated".into(),
        train: data.clone(),
        test: data.clone(),
        normalization: normalization.clone(),
        natural_clients: None,
    };
    let partition = Partition {
        clients: split.train.clone(),
    };
    let config = EngineConfig {
        sample: 3,
        rounds,
        eval_every: 1,
        seed,
        threads,
        parallel_clients: None,
        eval_batch_size: 64,
        train: TrainConfig {
            local_epochs: 1,
            batch_size: 32,
            lr: 1e-3,
            optimizer: LocalOptimizer::Adam,
            ..TrainConfig::default()
        },
    };
    let mut strategy = PFedClub::new(
        ClubConfig {
            cka_samples: 32,
            candidates: 2,
            ..club
        },
        &build,
        PublicData {
            data: &data,
            normalization: &normalization,
            samples: &split.public,
        },
        5,
        seed,
        config.eval_batch_size,
    )
    .unwrap();
    let sim = Simulation {
        model: build(0),
        data: &federated,
        partition: &partition,
        config,
        out_dir,
        objective: None,
        clients: Some(ClientModels {
            build: &build,
            tests: &split.test,
            fine_tune: None,
        }),
        stop: None,
    };
    sim.run(&mut strategy, resume, &mut |_| {}).unwrap()
}

#[test]
fn personalised_runs_are_deterministic_and_respect_the_size_limit() {
    let _turn = GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
    let (a, phi) = run(ClubConfig::default(), 1, 2);
    let (b, _) = run(ClubConfig::default(), 1, 1);
    assert_eq!(a, b, "same seed, same run, whatever the thread count");
    assert!(
        a.iter()
            .all(|m| m.test_acc.is_some_and(|x| (0.0..=1.0).contains(&x)))
    );
    assert!(phi.iter().any(Option::is_some), "some client got a teacher");
    // Per round, per client: φ of the teacher found (or null) and the count of valid candidates.
    for m in &a[1..] {
        for key in ["client_phi", "valid_candidates"] {
            let values = m.extra[key].as_array().unwrap();
            assert_eq!(values.len(), m.clients.len(), "{key}");
        }
        assert!(
            m.extra["valid_candidates"]
                .as_array()
                .unwrap()
                .iter()
                .all(|v| v.as_u64().unwrap() >= 1)
        );
    }
    assert!(
        a[1].bytes_down > 0 || a[0].extra.contains_key("phi"),
        "teachers are sent"
    );

    let eta = 0.1;
    let limited = ClubConfig {
        size_limit: Some(eta),
        ..ClubConfig::default()
    };
    let (_, phi) = run(limited, 1, 2);
    for p in phi.into_iter().flatten() {
        assert!(p <= eta + 1e-12, "pFedClub+ teacher grew by {p}");
    }

    // A negative η asks for smaller teachers: η = -0.5, at most half the client's size.
    let eta = -0.5;
    let smaller = ClubConfig {
        size_limit: Some(eta),
        ..ClubConfig::default()
    };
    let (_, phi) = run(smaller.clone(), 1, 2);
    assert!(
        phi.iter().any(Option::is_some),
        "some teacher is small enough"
    );
    for p in phi.into_iter().flatten() {
        assert!(p <= eta + 1e-12, "teacher of relative size {p} > {eta}");
    }
    let bad = ClubConfig {
        size_limit: Some(-1.0),
        ..smaller
    };
    assert!(bad.validate().unwrap_err().contains("must be > -1"));
}

#[test]
fn a_stopped_personalised_run_resumes_to_the_same_result() {
    let _turn = GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
    let root = std::env::temp_dir().join(format!("fl-pfedclub-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let strip = |s: RunSummary| -> Vec<RoundMetrics> {
        s.rounds.iter().map(RoundMetrics::without_timings).collect()
    };
    let whole = strip(simulate(
        ClubConfig::default(),
        4,
        2,
        3,
        Some(root.join("a")),
        false,
    ));
    simulate(ClubConfig::default(), 4, 2, 2, Some(root.join("b")), false);
    let resumed = simulate(ClubConfig::default(), 4, 2, 3, Some(root.join("b")), true);
    assert_eq!(resumed.rounds.len(), 3, "history kept");
    assert_eq!(whole, strip(resumed));
    let _ = std::fs::remove_dir_all(&root);
}
