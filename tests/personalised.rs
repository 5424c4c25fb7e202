//! Global methods evaluated per client (pFedClub's Table 2: the mean over clients of the global
//! model on each client's own test portion) and Per-FedAvg, on the engine with real data.

use burn::tensor::Device;
use federated::core::strategy::{FedAvg, PFedMe, PerFedAvg, Strategy};
use federated::core::trainer::{MetaStep, MoreauStep, TrainConfig};
use federated::core::{ClientModels, EngineConfig, RoundMetrics, Simulation};
use federated::data::{DatasetKind, FederatedDataset, Partition, load_dataset};
use federated::models::{Cnn, CnnConfig};

const CLIENTS: usize = 4;

fn data() -> FederatedDataset {
    load_dataset(DatasetKind::FashionMnist, None).unwrap()
}

/// Two rounds over 4 clients of 200 training images each; `tests`: each client's test portion
/// (`None`: the shared test set only).
fn run(
    data: &FederatedDataset,
    strategy: &mut dyn Strategy,
    tests: Option<&[Vec<usize>]>,
    threads: usize,
) -> Vec<RoundMetrics> {
    // The device's generator is shared by the tests running in parallel (and parameters are
    // drawn lazily): one run at a time, so every run starts from the same weights.
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let device = Device::flex().autodiff();
    device.seed(3);
    let model: Cnn = CnnConfig {
        input_shape: [1, 28, 28],
        num_classes: 10,
    }
    .init(&device);
    let partition = Partition {
        clients: (0..CLIENTS)
            .map(|c| (c * 200..(c + 1) * 200).collect())
            .collect(),
    };
    let build = |_: usize| model.clone();
    let sim = Simulation {
        model: model.clone(),
        data,
        partition: &partition,
        config: EngineConfig {
            sample: 2,
            rounds: 2,
            eval_every: 1,
            seed: 5,
            threads,
            parallel_clients: None,
            eval_batch_size: 250,
            train: TrainConfig {
                local_epochs: 1,
                batch_size: 20,
                lr: 0.05,
                ..TrainConfig::default()
            },
        },
        out_dir: None,
        objective: None,
        clients: tests.map(|tests| ClientModels {
            build: &build,
            tests,
            fine_tune: None,
        }),
        stop: None,
    };
    sim.run(strategy, false, &mut |_| {}).unwrap().rounds
}

#[test]
fn per_client_evaluation_on_the_whole_test_set_is_the_global_evaluation() {
    let data = data();
    let everything: Vec<Vec<usize>> = vec![(0..data.test.len()).collect(); CLIENTS];
    let global = run(&data, &mut FedAvg::weighted(), None, 2);
    let per_client = run(&data, &mut FedAvg::weighted(), Some(&everything), 2);
    for (g, p) in global.iter().zip(&per_client) {
        assert_eq!(g.clients, p.clients);
        let (ga, pa) = (g.test_acc.unwrap(), p.test_acc.unwrap());
        assert!((ga - pa).abs() < 1e-12, "{ga} vs {pa}");
        assert!((g.test_loss.unwrap() - p.test_loss.unwrap()).abs() < 1e-9);
        assert_eq!(p.extra["client_acc"].as_array().unwrap().len(), CLIENTS);
    }
}

#[test]
fn per_fedavg_evaluates_each_client_after_its_personalisation_step() {
    let data = data();
    // Each client's test portion: 100 test images of its own.
    let tests: Vec<Vec<usize>> = (0..CLIENTS)
        .map(|c| (c * 100..(c + 1) * 100).collect())
        .collect();
    let fo = MetaStep {
        alpha: 0.02,
        hessian_free: None,
    };
    let hf = MetaStep {
        hessian_free: Some(1e-4),
        ..fo
    };
    let a = run(&data, &mut PerFedAvg::new(fo, 1), Some(&tests), 2);
    let b = run(&data, &mut PerFedAvg::new(fo, 1), Some(&tests), 1);
    let strip = |r: &[RoundMetrics]| r.iter().map(|m| m.without_timings()).collect::<Vec<_>>();
    assert_eq!(strip(&a), strip(&b), "same seed, any thread count");
    for m in &a {
        assert_eq!(m.extra["fine_tune_steps"], 1);
        let accs = m.extra["client_acc"].as_array().unwrap();
        let mean = accs.iter().map(|v| v.as_f64().unwrap()).sum::<f64>() / CLIENTS as f64;
        assert!((mean - m.test_acc.unwrap()).abs() < 1e-3);
    }
    // The personalisation step is part of what is evaluated, and HF is not FO.
    let untuned = run(&data, &mut PerFedAvg::new(fo, 0), Some(&tests), 2);
    assert_ne!(untuned[1].test_acc, a[1].test_acc);
    assert_eq!(untuned[1].train_loss, a[1].train_loss);
    let h = run(&data, &mut PerFedAvg::new(hf, 1), Some(&tests), 2);
    assert_ne!(h[1].train_loss, a[1].train_loss);
    assert!(a.iter().chain(&h).all(|m| m.train_loss.is_finite()));
}

#[test]
fn pfedme_trains_evaluates_personalised_models_and_mixes_with_beta() {
    let data = data();
    let tests: Vec<Vec<usize>> = (0..CLIENTS)
        .map(|c| (c * 100..(c + 1) * 100).collect())
        .collect();
    let step = MoreauStep {
        lambda: 15.0,
        personal_lr: 0.05,
        inner_steps: 3,
    };
    let a = run(&data, &mut PFedMe::new(step, 1.0), Some(&tests), 2);
    let b = run(&data, &mut PFedMe::new(step, 1.0), Some(&tests), 1);
    let strip = |r: &[RoundMetrics]| r.iter().map(|m| m.without_timings()).collect::<Vec<_>>();
    assert_eq!(strip(&a), strip(&b), "same seed, any thread count");
    for m in &a {
        assert!(m.train_loss.is_finite());
        assert_eq!(m.extra["fine_tune_steps"], 3);
        assert!((0.0..=1.0).contains(&m.test_acc.unwrap()));
    }
    // β changes the server's step, hence round 2's training.
    let c = run(&data, &mut PFedMe::new(step, 2.0), Some(&tests), 2);
    assert_eq!(a[0].train_loss, c[0].train_loss);
    assert_ne!(a[1].train_loss, c[1].train_loss);
}
