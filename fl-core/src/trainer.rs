//! Local training of one client: SGD with cross-entropy over the client's samples.

use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, GradientsParams, SgdConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};
use fl_data::{Dataset, Normalization};
use rand::seq::SliceRandom;

use crate::layers::{LayerError, ParamTable};
use crate::model::Classifier;
use crate::rng::{Purpose, derive_seed, rng_for, with_forward_stream};

/// Hyper-parameters of local training.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TrainConfig {
    /// Passes over the client's data per round.
    pub local_epochs: usize,
    /// Mini-batch size (the last batch of an epoch may be smaller, as in PyTorch's default).
    pub batch_size: usize,
    /// Learning rate.
    pub lr: f64,
    /// SGD momentum (0 disables it). Dampening is 0, as in PyTorch (Burn's default is 0.1).
    pub momentum: f64,
    /// L2 weight decay added to the gradient (0 disables it).
    pub weight_decay: f64,
    /// The local optimiser (SGD unless a method says otherwise, e.g. pFedClub's Adam).
    #[serde(default)]
    pub optimizer: LocalOptimizer,
}

/// Which optimiser local training uses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LocalOptimizer {
    /// SGD with [`TrainConfig::momentum`] (dampening 0, as PyTorch).
    #[default]
    Sgd,
    /// Adam with PyTorch's defaults (β = 0.9, 0.999, ε = 1e-8); `momentum` is ignored.
    Adam,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            local_epochs: 5,
            batch_size: 50,
            lr: 0.01,
            momentum: 0.5,
            weight_decay: 0.0,
            optimizer: LocalOptimizer::Sgd,
        }
    }
}

impl TrainConfig {
    /// Checks the values a run cannot work with.
    pub fn validate(&self) -> Result<(), String> {
        if self.local_epochs == 0 {
            return Err("local epochs must be at least 1".into());
        }
        if self.batch_size == 0 {
            return Err("batch size must be at least 1".into());
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(format!(
                "learning rate must be a positive number, got {}",
                self.lr
            ));
        }
        if !(0.0..1.0).contains(&self.momentum) {
            return Err(format!("momentum must be in [0, 1), got {}", self.momentum));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(format!(
                "weight decay must be >= 0, got {}",
                self.weight_decay
            ));
        }
        Ok(())
    }
}

/// An extra term added to a client's loss at every step (FedProx's proximal term, MOON's
/// contrastive term, distillation, ...).
pub trait LocalObjective: Send + Sync {
    /// The term to add for the model whose (autodiff-tracked) parameters are `params`;
    /// `start` is the table the client received this round. `None` adds nothing.
    fn extra_loss(&self, params: &ParamTable, start: &ParamTable) -> Option<Tensor<1>> {
        let _ = (params, start);
        None
    }

    /// A term that depends on the batch: `images` is the mini-batch and `logits` the model's
    /// (tracked) output on it, e.g. a distillation loss against a teacher. `None` adds nothing.
    fn batch_loss(&self, images: &Tensor<4>, logits: &Tensor<2>) -> Option<Tensor<1>> {
        let _ = (images, logits);
        None
    }

    /// Whether [`extra_loss`](Self::extra_loss) is used (it needs the parameters as a table at
    /// every step, which has a cost).
    fn uses_parameters(&self) -> bool {
        true
    }
}

/// What a client sends back after local training.
#[derive(Debug, Clone)]
pub struct LocalUpdate {
    /// The client's index in the partition.
    pub client: usize,
    /// The trained model.
    pub table: ParamTable,
    /// Number of local training samples (FedAvg's weight).
    pub num_samples: usize,
    /// Mean mini-batch loss over all local steps.
    pub train_loss: f64,
    /// Number of optimiser steps taken (SCAFFOLD's K).
    pub steps: usize,
}

/// Errors of local training and evaluation.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The loss became NaN or infinite (learning rate too high, bad data, ...).
    #[error("client {client}: loss is {loss} in local epoch {epoch}; lower the learning rate")]
    NonFiniteLoss {
        /// The client.
        client: usize,
        /// The 1-based local epoch.
        epoch: usize,
        /// The offending mean loss.
        loss: f64,
    },
    /// A client without samples was asked to train.
    #[error("client {0} has no training samples")]
    NoSamples(usize),
    /// The model and the table do not fit together.
    #[error(transparent)]
    Layer(#[from] LayerError),
}

/// The device a model's parameters live on.
fn model_device<M: Classifier>(model: &M) -> Device {
    model
        .devices()
        .into_iter()
        .next()
        .expect("a model has a device")
}

/// Gathers `indices` into a device batch of images and labels.
pub fn make_batch(
    data: &Dataset,
    norm: &Normalization,
    indices: &[usize],
    device: &Device,
) -> (Tensor<4>, Tensor<1, Int>) {
    let (pixels, labels) = data.batch(indices, norm);
    let [c, h, w] = data.image_shape();
    let images = Tensor::from_data(TensorData::new(pixels, [indices.len(), c, h, w]), device);
    let labels = Tensor::from_data(TensorData::new(labels, [indices.len()]), device);
    (images, labels)
}

/// Everything one client's local training needs.
pub struct LocalTask<'a, M> {
    /// A model of the right architecture on an autodiff device (its values are replaced).
    pub template: M,
    /// The model the client starts from.
    pub start: ParamTable,
    /// The shared training set.
    pub data: &'a Dataset,
    /// Normalisation of the shared training set.
    pub norm: &'a Normalization,
    /// This client's sample indices.
    pub indices: &'a [usize],
    /// The client's index (for seeding and messages).
    pub client: usize,
    /// The round (for seeding).
    pub round: usize,
    /// The run seed.
    pub seed: u64,
    /// Optional extra loss term.
    pub objective: Option<&'a dyn LocalObjective>,
}

/// Trains a model on one client's samples and returns the result as a table.
///
/// A fresh optimiser is created for every call: Burn keys optimiser state by parameter id, and
/// every client round starts from a new model.
pub fn train_local<M: Classifier>(
    task: LocalTask<'_, M>,
    cfg: &TrainConfig,
) -> Result<LocalUpdate, TrainError> {
    if task.indices.is_empty() {
        return Err(TrainError::NoSamples(task.client));
    }
    let forward_seed = derive_seed(
        task.seed,
        Purpose::Forward,
        task.round as u64,
        task.client as u64,
    );
    with_forward_stream(forward_seed, || train_steps(task, cfg))
}

/// The body of [`train_local`], run with the client's forward-pass stream installed.
fn train_steps<M: Classifier>(
    task: LocalTask<'_, M>,
    cfg: &TrainConfig,
) -> Result<LocalUpdate, TrainError> {
    let mut model = task.start.load_into(task.template)?;
    let device = model_device(&model);
    let decay = (cfg.weight_decay > 0.0).then(|| WeightDecayConfig::new(cfg.weight_decay as f32));
    let mut optim = match cfg.optimizer {
        LocalOptimizer::Sgd => SgdConfig::new()
            .with_momentum((cfg.momentum > 0.0).then(|| {
                MomentumConfig::new()
                    .with_momentum(cfg.momentum)
                    .with_dampening(0.0)
            }))
            .with_weight_decay(decay)
            .init(),
        LocalOptimizer::Adam => AdamConfig::new()
            .with_epsilon(1e-8)
            .with_weight_decay(decay)
            .init(),
    };
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    let mut rng = rng_for(
        task.seed,
        Purpose::Shuffle,
        task.round as u64,
        task.client as u64,
    );
    let mut order = task.indices.to_vec();
    let (mut loss_sum, mut steps) = (0.0f64, 0usize);
    for epoch in 1..=cfg.local_epochs {
        order.shuffle(&mut rng);
        // Losses are summed on the device and read once per epoch (one host sync, not one per step).
        let mut epoch_losses: Vec<Tensor<1>> = Vec::new();
        for batch in order.chunks(cfg.batch_size) {
            let (images, labels) = make_batch(task.data, task.norm, batch, &device);
            let logits = model.forward(images.clone());
            let mut loss = loss_fn.forward(logits.clone(), labels);
            if let Some(objective) = task.objective {
                if objective.uses_parameters() {
                    let params = ParamTable::from_module_tracked(&model);
                    if let Some(extra) = objective.extra_loss(&params, &task.start) {
                        loss = loss + extra;
                    }
                }
                if let Some(extra) = objective.batch_loss(&images, &logits) {
                    loss = loss + extra;
                }
            }
            epoch_losses.push(loss.clone().detach());
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(cfg.lr, model, grads);
        }
        let n = epoch_losses.len();
        let sum: f64 = Tensor::cat(epoch_losses, 0).sum().into_scalar::<f32>() as f64;
        if !sum.is_finite() {
            return Err(TrainError::NonFiniteLoss {
                client: task.client,
                epoch,
                loss: sum / n as f64,
            });
        }
        loss_sum += sum;
        steps += n;
    }
    Ok(LocalUpdate {
        client: task.client,
        table: ParamTable::from_module(&model),
        num_samples: task.indices.len(),
        train_loss: loss_sum / steps as f64,
        steps,
    })
}

/// Test accuracy (in `[0, 1]`) and mean cross-entropy of `model` on all of `data`.
///
/// Batches are evaluated in parallel on the current rayon pool (each on one thread), and the
/// per-batch sums are added in batch order, so the result does not depend on the thread count.
pub fn evaluate<M: Classifier>(
    model: &M,
    data: &Dataset,
    norm: &Normalization,
    batch_size: usize,
) -> (f64, f64) {
    let all: Vec<usize> = (0..data.len()).collect();
    evaluate_on(model, data, norm, &all, batch_size)
}

/// Accuracy and mean cross-entropy of `model` on the samples `indices` of `data` (a client's
/// own test portion in personalised FL); see [`evaluate`].
pub fn evaluate_on<M: Classifier>(
    model: &M,
    data: &Dataset,
    norm: &Normalization,
    indices: &[usize],
    batch_size: usize,
) -> (f64, f64) {
    use rayon::prelude::*;
    let model = model.valid();
    let device = model_device(&model);
    let per_batch: Vec<(f64, i64)> = indices
        .par_chunks(batch_size.max(1))
        .map(|batch| {
            let loss_fn = CrossEntropyLossConfig::new().init(&device);
            let (images, labels) = make_batch(data, norm, batch, &device);
            let logits = model.forward(images);
            let loss = loss_fn
                .forward(logits.clone(), labels.clone())
                .into_scalar::<f32>() as f64;
            let predicted = logits.argmax(1).squeeze_dim::<1>(1);
            let correct = predicted.equal(labels).int().sum().into_scalar::<i64>();
            (loss * batch.len() as f64, correct)
        })
        .collect();
    let n = indices.len().max(1) as f64;
    let loss: f64 = per_batch.iter().map(|(l, _)| l).sum();
    let correct: i64 = per_batch.iter().map(|(_, c)| c).sum();
    (correct as f64 / n, loss / n)
}
