//! A small real Burn model with a convolution, BatchNorm and two linear layers, for unit tests.

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};

use crate::layers::{BlockSpec, ParamTable};
use crate::model::Classifier;

#[derive(Module, Debug)]
pub struct TinyNet {
    pub conv: Conv2d,
    pub bn: BatchNorm,
    pub fc1: Linear,
    pub fc2: Linear,
}

impl TinyNet {
    /// 1×8×8 input, 10 classes.
    pub fn new(device: &Device) -> Self {
        Self {
            conv: Conv2dConfig::new([1, 4], [3, 3]).init(device),
            bn: BatchNormConfig::new(4).init(device),
            fc1: LinearConfig::new(4 * 6 * 6, 16).init(device),
            fc2: LinearConfig::new(16, 10).init(device),
        }
    }
}

impl Classifier for TinyNet {
    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        self.fc2.forward(self.represent(images))
    }

    fn features(&self, images: Tensor<4>) -> Option<Tensor<2>> {
        Some(self.represent(images))
    }

    fn head(&self, features: Tensor<2>) -> Option<Tensor<2>> {
        Some(self.fc2.forward(features))
    }

    fn blocks(&self) -> Vec<BlockSpec> {
        let b = |name: &str, modules: &[&str], i: Vec<usize>, o: Vec<usize>| BlockSpec {
            name: name.into(),
            modules: modules.iter().map(|m| m.to_string()).collect(),
            input_shape: i,
            output_shape: o,
        };
        vec![
            b("features", &["conv", "bn"], vec![1, 8, 8], vec![144]),
            b("fc1", &["fc1"], vec![144], vec![16]),
            b("fc2", &["fc2"], vec![16], vec![10]),
        ]
    }
}

impl TinyNet {
    fn represent(&self, images: Tensor<4>) -> Tensor<2> {
        let x = relu(self.bn.forward(self.conv.forward(images)));
        relu(self.fc1.forward(x.flatten(1, 3)))
    }
}

pub fn device() -> Device {
    Device::flex()
}

/// A TinyNet with weights drawn from `seed`.
///
/// Convolution and linear weights come from a ChaCha RNG seeded with `seed`, not from the
/// device RNG: that one is shared by the whole process, and tests running in parallel would
/// race on it. BatchNorm keeps its initial values.
pub fn tiny(seed: u64) -> TinyNet {
    use rand::{Rng, SeedableRng};
    let d = device();
    let model = TinyNet::new(&d);
    let table = ParamTable::from_module(&model);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let host: Vec<Vec<f32>> = table
        .named_host()
        .expect("host copy")
        .into_iter()
        .map(|t| {
            if t.name.starts_with("bn.") {
                t.values
            } else {
                let bound = 1.0 / (t.values.len() as f32).sqrt().max(1.0) + 0.1;
                t.values
                    .iter()
                    .map(|_| rng.random_range(-bound..bound))
                    .collect()
            }
        })
        .collect();
    table
        .from_host(host, &d)
        .expect("same layout")
        .load_into(model)
        .expect("same model")
}

/// `tiny(seed)` on the autodiff device, ready to train.
pub fn tracked(seed: u64) -> TinyNet {
    ParamTable::from_module(&tiny(seed))
        .load_into(TinyNet::new(&device().autodiff()))
        .expect("same model")
}

/// A client upload whose model is `tiny(seed)`.
pub fn upload(seed: u64, num_samples: usize) -> crate::trainer::LocalUpdate {
    crate::trainer::LocalUpdate {
        client: seed as usize,
        table: ParamTable::from_module(&tiny(seed)),
        state: None,
        prototypes: None,
        num_samples,
        train_loss: 0.0,
        steps: 10,
    }
}

/// All values of a table, flattened.
pub fn flat(t: &crate::layers::ParamTable) -> Vec<f32> {
    t.to_host().expect("host copy").concat()
}

/// Element-wise closeness.
pub fn close(a: &[f32], b: &[f32], tol: f32) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= tol)
}

/// A strategy's plan for a round over `clients` clients (10 samples each) sampling `sample`,
/// with a fixed sampling generator.
pub fn plan(
    s: &mut dyn crate::Strategy,
    round: usize,
    clients: usize,
    sample: usize,
) -> Result<crate::RoundPlan, crate::strategy::StrategyError> {
    use rand::SeedableRng;
    let sizes = vec![10; clients];
    let train = crate::TrainConfig::default();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(round as u64);
    let mut ctx = crate::RoundContext {
        round,
        client_sizes: &sizes,
        sample,
        train: &train,
        rng: &mut rng,
    };
    s.configure_round(&mut ctx)
}

/// The start models of a plan.
pub fn starts(plan: &crate::RoundPlan) -> Vec<ParamTable> {
    plan.clients.iter().map(|c| c.start.clone()).collect()
}

/// Trainable values of a table (BatchNorm's running statistics left out: they see every forward
/// pass, so procedures with extra forward passes differ there by design).
pub fn trainable(t: &ParamTable) -> Vec<f32> {
    t.named_host()
        .expect("host copy")
        .into_iter()
        .filter(|t| !t.name.contains("running"))
        .flat_map(|t| t.values)
        .collect()
}

/// `n` synthetic 1×8×8 images of 10 classes (TinyNet's input), with a fixed normalisation.
pub fn synthetic_data(n: usize, seed: u64) -> (fl_data::Dataset, fl_data::Normalization) {
    let norm = fl_data::Normalization {
        mean: vec![0.5],
        std: vec![0.25],
    };
    (fl_data::source::synthetic(n, [1, 8, 8], 10, seed), norm)
}
