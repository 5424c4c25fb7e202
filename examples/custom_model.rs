//! Federated training of your own Burn module with the library API (no CLI): FedAvg and FedMR
//! (layer-wise recombination) on a model that is not part of `fl-models`.
//!
//! Run with `cargo run --release -p federated --example custom_model`.
//! Any `#[derive(Module)]` type becomes trainable by implementing `Classifier::forward`.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};
use federated::core::rng::{Purpose, derive_seed};
use federated::core::strategy::{FedMr, FedMrConfig, Strategy};
use federated::core::trainer::TrainConfig;
use federated::core::{Classifier, EngineConfig, FedAvg, Granularity, Simulation};
use federated::data::{DatasetKind, Partition, PartitionScheme, load_dataset};

/// A two-layer perceptron: not one of `fl-models`, defined right here.
#[derive(Module, Debug)]
struct Mlp {
    hidden: Linear,
    out: Linear,
}

impl Classifier for Mlp {
    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        self.out
            .forward(relu(self.hidden.forward(images.flatten(1, 3))))
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let seed = 1;
    // The system copy of Fashion-MNIST if installed, else the embedded 10k images.
    let data = load_dataset(DatasetKind::FashionMnist, None)?;
    let partition = Partition::new(
        &PartitionScheme::Dirichlet {
            alpha: 0.5,
            min_size: 10,
        },
        data.train.labels(),
        10,
        20,
        derive_seed(seed, Purpose::Partition, 0, 0),
    )?;
    let device = Device::flex().autodiff();
    device.seed(seed);
    let model = Mlp {
        hidden: LinearConfig::new(28 * 28, 128).init(&device),
        out: LinearConfig::new(128, 10).init(&device),
    };
    let sim = Simulation {
        model,
        data: &data,
        partition: &partition,
        config: EngineConfig {
            sample: 5,
            rounds: 5,
            eval_every: 1,
            seed,
            threads: 2,
            parallel_clients: None,
            eval_batch_size: 500,
            train: TrainConfig {
                local_epochs: 1,
                ..TrainConfig::default()
            },
        },
        out_dir: None,
        objective: None,
        clients: None,
        stop: None,
    };
    let fedmr = FedMr::new(FedMrConfig {
        granularity: Granularity::Layer,
        ..Default::default()
    });
    let strategies: Vec<Box<dyn Strategy>> = vec![Box::new(FedAvg::weighted()), Box::new(fedmr)];
    for mut strategy in strategies {
        let name = strategy.name();
        let summary = sim.run(strategy.as_mut(), false, &mut |m| {
            let acc = 100.0 * m.test_acc.unwrap_or(0.0);
            println!("{name} round {}: test accuracy {acc:.2}%", m.round);
        })?;
        println!(
            "{name}: final model has {} parameters",
            summary.global.map_or(0, |g| g.num_elements())
        );
    }
    Ok(())
}
