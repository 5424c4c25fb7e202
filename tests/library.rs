//! Workspace-level tests of the library API on the real models and data.

use burn::module::Module;
use burn::tensor::{Device, Tensor};
use federated::core::Classifier;
use federated::core::layers::{Granularity, ParamTable, recombine};
use federated::core::trainer::{LocalObjective, LocalTask, TrainConfig, train_local};
use federated::data::{DatasetKind, FederatedDataset, load_dataset};
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

/// Round-1 training of `client` on `indices` of the Fashion-MNIST training set.
fn client_task<'a, M>(
    data: &'a FederatedDataset,
    template: M,
    start: ParamTable,
    indices: &'a [usize],
    client: usize,
    seed: u64,
    objective: Option<&'a dyn LocalObjective>,
) -> LocalTask<'a, M> {
    LocalTask {
        template,
        start,
        data: &data.train,
        norm: &data.normalization,
        indices,
        client,
        round: 1,
        seed,
        objective,
        state: None,
        personal_template: None,
    }
}

/// A FedProx-style pull towards the received model: with a large weight the client stays closer.
struct Proximal(f64);

impl LocalObjective for Proximal {
    fn extra_loss(&self, params: &ParamTable, start: &ParamTable) -> Option<Tensor<1>> {
        let distance = params.trainable_sum(start, |w, w0| (w - w0).square().sum());
        Some(distance.mul_scalar(self.0 / 2.0))
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
        let task = client_task(
            &data,
            model.clone(),
            start.clone(),
            &indices,
            0,
            5,
            objective,
        );
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
                let task = client_task(
                    &data,
                    model.clone(),
                    start.clone(),
                    &indices,
                    client,
                    9,
                    None,
                );
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

/// Mean cosine similarity between two models' representations of the same images.
fn representation_cosine(
    a: &federated::models::Cnn,
    b: &federated::models::Cnn,
    images: Tensor<4>,
) -> f64 {
    let (za, zb) = (
        a.valid().features(images.clone()).unwrap(),
        b.valid().features(images).unwrap(),
    );
    let dot = (za.clone() * zb.clone()).sum_dim(1);
    let norms = za.square().sum_dim(1).sqrt() * zb.square().sum_dim(1).sqrt();
    (dot / norms.clamp_min(1e-8)).mean().into_scalar::<f32>() as f64
}

/// MOON's term, run through the trainer on a real CNN: it pulls the client's representation
/// towards the global model's (the reference models are loaded and run on every batch).
#[test]
fn moon_pulls_representations_towards_the_global_model() {
    use federated::core::strategy::moon::Contrastive;
    let data = load_dataset(DatasetKind::FashionMnist, None).unwrap();
    let d = Device::flex().autodiff();
    let model = cnn(3, [1, 28, 28], &d);
    let global = ParamTable::from_module(&model);
    let previous = ParamTable::from_module(&cnn(4, [1, 28, 28], &d));
    let indices: Vec<usize> = (0..300).collect();
    let cfg = TrainConfig {
        local_epochs: 2,
        batch_size: 20,
        lr: 0.05,
        ..TrainConfig::default()
    };
    let train = |objective: Option<&dyn LocalObjective>| {
        let task = client_task(
            &data,
            model.clone(),
            global.clone(),
            &indices,
            0,
            5,
            objective,
        );
        train_local(task, &cfg)
            .unwrap()
            .table
            .load_into(model.clone())
            .unwrap()
    };
    let term = Contrastive {
        mu: 5.0,
        tau: 0.5,
        global: global.clone(),
        previous,
    };
    let free = train(None);
    let pulled = train(Some(&term));
    let probe: Vec<usize> = (1000..1200).collect();
    let (images, _) = federated::core::trainer::make_batch(
        &data.train,
        &data.normalization,
        &probe,
        &Device::flex(),
    );
    let start = global
        .load_into(cnn(9, [1, 28, 28], &Device::flex()))
        .unwrap();
    let free_sim = representation_cosine(&free.valid(), &start, images.clone());
    let pulled_sim = representation_cosine(&pulled.valid(), &start, images);
    assert!(
        pulled_sim > free_sim + 0.01,
        "contrastive term had no effect: cos {pulled_sim} vs {free_sim}"
    );
}

/// A model that does not expose its representation fails MOON with a clear error, not a panic.
#[test]
fn a_model_without_features_is_a_clear_error_for_moon() {
    use burn::nn::{Linear, LinearConfig};
    use federated::core::strategy::moon::Contrastive;

    #[derive(Module, Debug)]
    struct Flat {
        fc: Linear,
    }
    impl Classifier for Flat {
        fn forward(&self, images: Tensor<4>) -> Tensor<2> {
            self.fc.forward(images.flatten(1, 3))
        }
    }
    let data = load_dataset(DatasetKind::FashionMnist, None).unwrap();
    let d = Device::flex().autodiff();
    let model = Flat {
        fc: LinearConfig::new(784, 10).init(&d),
    };
    let table = ParamTable::from_module(&model);
    let term = Contrastive {
        mu: 1.0,
        tau: 0.5,
        global: table.clone(),
        previous: table.clone(),
    };
    let indices: Vec<usize> = (0..20).collect();
    let task = client_task(&data, model, table, &indices, 0, 1, Some(&term));
    let err = train_local(task, &TrainConfig::default()).unwrap_err();
    assert!(err.to_string().contains("representation"), "{err}");
}

/// ASAM through the trainer: a vanishing radius is plain SGD, a real one changes the result,
/// and both are deterministic.
#[test]
fn sharpness_aware_steps_reduce_to_sgd_as_rho_vanishes() {
    use federated::core::strategy::SharpnessAware;
    let data = load_dataset(DatasetKind::FashionMnist, None).unwrap();
    let d = Device::flex().autodiff();
    let model = cnn(3, [1, 28, 28], &d);
    let start = ParamTable::from_module(&model);
    let indices: Vec<usize> = (0..200).collect();
    let train = |sharpness: Option<SharpnessAware>| {
        let cfg = TrainConfig {
            local_epochs: 1,
            batch_size: 20,
            lr: 0.05,
            sharpness,
            ..TrainConfig::default()
        };
        let task = client_task(&data, model.clone(), start.clone(), &indices, 0, 5, None);
        train_local(task, &cfg).unwrap().table
    };
    let sgd = train(None);
    let tiny = train(Some(SharpnessAware::asam(1e-7, 0.0)));
    let asam = train(Some(SharpnessAware::asam(0.5, 0.01)));
    let sam = train(Some(SharpnessAware::sam(0.05)));
    let step = sgd.l2_distance(&start).unwrap();
    assert!(sgd.l2_distance(&tiny).unwrap() < 1e-3 * step);
    assert!(sgd.l2_distance(&asam).unwrap() > 1e-2 * step);
    assert!(sgd.l2_distance(&sam).unwrap() > 1e-2 * step);
    assert_eq!(
        asam.to_host().unwrap(),
        train(Some(SharpnessAware::asam(0.5, 0.01)))
            .to_host()
            .unwrap()
    );
}
