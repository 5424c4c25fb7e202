//! Workspace-level tests of the library API on the real models and data.

use burn::tensor::{Device, Tensor};
use federated::core::Classifier;
use federated::core::layers::{Granularity, ParamTable, recombine};
use federated::core::trainer::{LocalObjective, LocalTask, TrainConfig, train_local};
use federated::data::{DatasetKind, load_dataset};
use federated::models::CnnConfig;
use rand::SeedableRng;

fn cnn(seed: u64, shape: [usize; 3], device: &Device) -> federated::models::Cnn {
    device.seed(seed);
    CnnConfig {
        input_shape: shape,
        num_classes: 10,
    }
    .init(device)
}

/// The sum of every value of every table (recombination must preserve it).
fn sum(tables: &[ParamTable]) -> f64 {
    tables
        .iter()
        .flat_map(|t| t.to_host().unwrap())
        .flatten()
        .map(|v| v as f64)
        .sum()
}

#[test]
fn block_recombination_of_real_cnns_preserves_the_sum() {
    let d = Device::flex();
    for shape in [[1, 28, 28], [3, 32, 32]] {
        let models: Vec<ParamTable> = (0..5)
            .map(|s| {
                let m = cnn(s, shape, &d);
                ParamTable::from_module_with_blocks(&m, m.blocks()).unwrap()
            })
            .collect();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let r = recombine(&models, Granularity::Block, &mut rng).unwrap();
        assert_eq!(r.sources.len(), models[0].layout().blocks().len());
        assert!((sum(&models) - sum(&r.models)).abs() < 1e-3);
        // Round trip through a real module is exact.
        let loaded = r.models[0].load_into(cnn(99, shape, &d)).unwrap();
        assert_eq!(
            ParamTable::from_module(&loaded).to_host().unwrap(),
            r.models[0].to_host().unwrap()
        );
    }
}

/// A FedProx-style pull towards the received model: with a large weight the client stays closer.
struct Proximal(f64);

impl LocalObjective for Proximal {
    fn extra_loss(&self, params: &ParamTable, start: &ParamTable) -> Option<Tensor<1>> {
        let device = params.device();
        let terms: Vec<Tensor<1>> = params
            .values()
            .iter()
            .zip(start.values())
            .map(|(w, w0)| (w.clone() - w0.clone().to_device(&device)).square().sum())
            .collect();
        Some(Tensor::cat(terms, 0).sum().mul_scalar(self.0 / 2.0))
    }
}

#[test]
fn the_loss_hook_changes_local_training() {
    let data = load_dataset(DatasetKind::FashionMnist, None).unwrap();
    let d = Device::flex().autodiff();
    let model = cnn(3, [1, 28, 28], &d);
    let start = ParamTable::from_module(&model);
    let indices: Vec<usize> = (0..200).collect();
    let cfg = TrainConfig {
        local_epochs: 1,
        batch_size: 20,
        lr: 0.05,
        ..TrainConfig::default()
    };
    let distance = |objective: Option<&dyn LocalObjective>| {
        let task = LocalTask {
            template: model.clone(),
            start: start.clone(),
            data: &data.train,
            norm: &data.normalization,
            indices: &indices,
            client: 0,
            round: 1,
            seed: 5,
            objective,
        };
        let update = train_local(task, &cfg).unwrap();
        update.table.l2_distance(&start).unwrap()
    };
    let free = distance(None);
    let pulled = distance(Some(&Proximal(10.0)));
    assert!(free > 0.0);
    assert!(
        pulled < 0.8 * free,
        "proximal term had no effect: {pulled} vs {free}"
    );
    // Without a hook, training is a pure function of its inputs.
    assert_eq!(distance(None), free);
}

/// Dropout and BatchNorm models train deterministically per client, whichever thread runs them,
/// and block-level recombination of trained ResNets keeps every block and the sum.
#[test]
fn zoo_models_train_deterministically_in_parallel_and_recombine() {
    use federated::models::{ModelKind, with_model};
    let data = load_dataset(DatasetKind::FashionMnist, None).unwrap();
    let d = Device::flex().autodiff();
    let cfg = TrainConfig {
        local_epochs: 1,
        batch_size: 16,
        lr: 0.05,
        ..TrainConfig::default()
    };
    for kind in [ModelKind::Cnn1, ModelKind::Resnet20] {
        d.seed(11);
        with_model!(kind, [1, 28, 28], 10, &d, |model| {
            let start = ParamTable::from_module(&model);
            let train = |client: usize| {
                let indices: Vec<usize> = (client * 64..client * 64 + 64).collect();
                let task = LocalTask {
                    template: model.clone(),
                    start: start.clone(),
                    data: &data.train,
                    norm: &data.normalization,
                    indices: &indices,
                    client,
                    round: 1,
                    seed: 9,
                    objective: None,
                };
                train_local(task, &cfg).unwrap().table.to_host().unwrap()
            };
            let sequential: Vec<_> = (0..3).map(train).collect();
            let parallel: Vec<_> = std::thread::scope(|s| {
                let handles: Vec<_> = (0..3).map(|c| s.spawn(move || train(c))).collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            assert_eq!(sequential, parallel, "{kind}: thread-dependent training");
            assert_ne!(sequential[0], sequential[1]);
            let tables: Vec<ParamTable> = sequential
                .into_iter()
                .map(|host| {
                    ParamTable::from_module_with_blocks(&model, model.blocks())
                        .unwrap()
                        .from_host(host, &Device::flex())
                        .unwrap()
                })
                .collect();
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(2);
            let r = recombine(&tables, Granularity::Block, &mut rng).unwrap();
            assert_eq!(r.sources.len(), model.blocks().len());
            assert!((sum(&tables) - sum(&r.models)).abs() < 1e-2);
        });
    }
}
