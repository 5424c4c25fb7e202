//! Personalised FL over heterogeneous models with your own Burn module: pFedClub's block
//! substitution on clients that own perceptrons of two different widths, run by the same engine
//! as every global algorithm (no CLI).
//!
//! Run with `cargo run --release -p federated --example personalised`.
//! A model takes part in block-level surgery by declaring its blocks (`Classifier::blocks`) and
//! running them one at a time (`BlockForward::forward_block`).

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};
use federated::core::layers::BlockSpec;
use federated::core::strategy::pfedclub::{ClubConfig, PFedClub, PublicData};
use federated::core::trainer::{LocalOptimizer, TrainConfig};
use federated::core::{
    BlockForward, Classifier, ClientModels, EngineConfig, Features, Simulation, Strategy,
};
use federated::data::{DatasetKind, PartitionScheme, PersonalSplit, load_dataset};

/// A two-block perceptron whose hidden width differs between clients.
#[derive(Module, Debug)]
struct Mlp {
    hidden: Linear,
    out: Linear,
    #[module(skip)]
    width: usize,
}

impl Mlp {
    fn new(width: usize, device: &Device) -> Self {
        Self {
            hidden: LinearConfig::new(28 * 28, width).init(device),
            out: LinearConfig::new(width, 10).init(device),
            width,
        }
    }
}

impl Classifier for Mlp {
    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        self.out
            .forward(relu(self.hidden.forward(images.flatten(1, 3))))
    }

    fn blocks(&self) -> Vec<BlockSpec> {
        let block = |name: &str, input: Vec<usize>, output: Vec<usize>| BlockSpec {
            name: name.into(),
            modules: vec![name.into()],
            input_shape: input,
            output_shape: output,
        };
        vec![
            block("hidden", vec![1, 28, 28], vec![self.width]),
            block("out", vec![self.width], vec![10]),
        ]
    }
}

impl BlockForward for Mlp {
    fn forward_block(&self, index: usize, x: Features) -> Features {
        match index {
            0 => Features::Flat(relu(self.hidden.forward(x.into_flat()))),
            _ => Features::Flat(self.out.forward(x.into_flat())),
        }
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (seed, clients) = (1, 10);
    let data = load_dataset(DatasetKind::FashionMnist, None)?;
    // pFedClub's split of the pooled samples: client train / client test / server public.
    let pooled = data.train.concat(&data.test)?;
    let keep: Vec<usize> = (0..pooled.len()).step_by(10).collect();
    let pooled = pooled.subset(&keep);
    let split = PersonalSplit::new(
        &PartitionScheme::Pathological {
            classes_per_client: 2,
        },
        pooled.labels(),
        10,
        clients,
        0.08,
        0.2,
        seed,
    )?;
    let (personal, partition) = split.engine_data(&data, &pooled);
    let device = Device::flex().autodiff();
    // Even clients own a narrow perceptron, odd ones a wide one.
    let build = |client: usize| Mlp::new(if client.is_multiple_of(2) { 64 } else { 128 }, &device);
    let config = EngineConfig {
        sample: 4,
        rounds: 5,
        eval_every: 1,
        seed,
        threads: 2,
        parallel_clients: None,
        eval_batch_size: 256,
        train: TrainConfig {
            local_epochs: 2,
            batch_size: 64,
            lr: 1e-3,
            optimizer: LocalOptimizer::Adam,
            ..TrainConfig::default()
        },
    };
    let mut strategy = PFedClub::new(
        ClubConfig {
            groups: 2,
            ..ClubConfig::default()
        },
        &build,
        PublicData {
            data: &pooled,
            normalization: &data.normalization,
            samples: &split.public,
        },
        clients,
        seed,
        config.eval_batch_size,
    )?;
    let sim = Simulation {
        model: build(0),
        data: &personal,
        partition: &partition,
        config,
        out_dir: None,
        objective: None,
        clients: Some(ClientModels {
            build: &build,
            tests: &split.test,
            fine_tune: None,
        }),
        stop: None,
    };
    let name = strategy.name();
    sim.run(&mut strategy, false, &mut |m| {
        let acc = 100.0 * m.test_acc.unwrap_or(0.0);
        println!("{name} round {}: mean client accuracy {acc:.2}%", m.round);
    })?;
    for c in strategy.summaries() {
        println!(
            "client {}: {} parameters, accuracy {:.2}% on its own test data",
            c.client,
            c.params,
            100.0 * c.test_acc
        );
    }
    Ok(())
}
