//! Local training of one client: SGD with cross-entropy over the client's samples.

use burn::nn::loss::{CrossEntropyLoss, CrossEntropyLossConfig};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::{Device, Int, Tensor, TensorData};
use fl_data::{Dataset, Normalization};
use rand::seq::SliceRandom;

use crate::layers::{LayerError, ParamTable};
use crate::model::Classifier;
use crate::rng::{Purpose, derive_seed, rng_for, with_forward_stream};

mod bayes;
mod meta;
mod mutual;
mod optim;
mod pfedme;
mod prototypes;
mod public;
mod sam;
pub use bayes::BayesStep;
pub use meta::{LocalProcedure, MetaStep, combine, hessian_vector_product};
pub use optim::{
    AdamMoments, FusedAdam, FusedSgd, SgdVelocity, fused_optimizers, set_fused_optimizers,
};
pub use pfedme::MoreauStep;
pub use prototypes::Prototypes;
pub use public::{PublicPhase, PublicTarget, cross_correlation_loss};
pub use sam::SharpnessAware;

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
    /// Sharpness-aware steps (SAM / ASAM, FedASAM's local optimiser): every step takes the
    /// gradient at an adversarially perturbed point. `None` trains plainly.
    #[serde(default)]
    pub sharpness: Option<SharpnessAware>,
    /// How each local step is taken: a plain gradient step, Per-FedAvg's meta step, pFedMe's
    /// Moreau-envelope step or pFedBayes' variational steps.
    #[serde(default)]
    pub procedure: LocalProcedure,
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
            sharpness: None,
            procedure: LocalProcedure::Sgd,
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
        if let Some(sam) = &self.sharpness {
            sam.validate()?;
        }
        match &self.procedure {
            LocalProcedure::Sgd => {}
            LocalProcedure::PerFedAvg(meta) => meta.validate()?,
            LocalProcedure::PFedMe(moreau) => moreau.validate()?,
            LocalProcedure::PFedBayes(bayes) => bayes.validate()?,
            LocalProcedure::Mutual => {}
        }
        if self.procedure != LocalProcedure::Sgd && self.sharpness.is_some() {
            return Err("sharpness-aware steps combine only with plain local steps".into());
        }
        Ok(())
    }
}

/// What a batch-level loss term sees of one local step.
pub struct BatchContext<'a> {
    /// The mini-batch `[N, C, H, W]` (on the training device).
    pub images: &'a Tensor<4>,
    /// Its labels `[N]`.
    pub labels: &'a Tensor<1, Int>,
    /// The model's (tracked) logits on it.
    pub logits: &'a Tensor<2>,
    /// The model's (tracked) representation `[N, D]` (see [`Classifier::features`]), when the
    /// objective [`uses_features`](LocalObjective::uses_features).
    pub features: Option<&'a Tensor<2>>,
    /// The representations of the objective's
    /// [`reference_models`](LocalObjective::reference_models) on the batch, in their order
    /// (inference mode, no gradient).
    pub reference_features: &'a [Tensor<2>],
    /// The model's (tracked) head, for representations that do not come from the batch (FedGen's
    /// generated ones); available when the objective uses features.
    pub head: &'a dyn Fn(Tensor<2>) -> Tensor<2>,
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

    /// A term that depends on the batch, e.g. a distillation loss against a teacher or MOON's
    /// contrastive loss. `None` adds nothing.
    fn batch_loss(&self, batch: &BatchContext<'_>) -> Option<Tensor<1>> {
        let _ = batch;
        None
    }

    /// Whether [`extra_loss`](Self::extra_loss) is used (it needs the parameters as a table at
    /// every step, which has a cost).
    fn uses_parameters(&self) -> bool {
        true
    }

    /// Whether [`batch_loss`](Self::batch_loss) needs the model's representation and head
    /// ([`Classifier::features`], [`Classifier::head`]); training fails with a clear error for
    /// a model that does not expose them.
    fn uses_features(&self) -> bool {
        false
    }

    /// Whether the logits of classes absent from the client's data are set to 0 before the
    /// cross-entropy (HeteroFL's masked loss).
    fn masks_absent_classes(&self) -> bool {
        false
    }

    /// Whether the client reports its per-class mean representations after training (FedGH's
    /// prototypes, in [`LocalUpdate::prototypes`]).
    fn reports_prototypes(&self) -> bool {
        false
    }

    /// Training on the server's public samples before the client's own (FedMD's transfer
    /// learning and digest); `None` (the default): none.
    fn public_phase(&self) -> Option<&PublicPhase> {
        None
    }

    /// Models (in the client's architecture) whose representations of every batch
    /// [`batch_loss`](Self::batch_loss) compares against, e.g. MOON's global and previous local
    /// model. The trainer loads each once per client, in inference mode.
    fn reference_models(&self) -> Vec<ParamTable> {
        Vec::new()
    }
}

/// What a client sends back after local training.
#[derive(Debug, Clone)]
pub struct LocalUpdate {
    /// The client's index in the partition.
    pub client: usize,
    /// The trained model.
    pub table: ParamTable,
    /// What the client keeps for its next round ([`LocalTask::state`]; pFedBayes' personalised
    /// posterior). Never counted as communication.
    pub state: Option<ParamTable>,
    /// Its per-class mean representations after training, when its objective
    /// [`reports_prototypes`](LocalObjective::reports_prototypes).
    pub prototypes: Option<Prototypes>,
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
    /// A phase on public samples does not fit the data.
    #[error("public-data phase: {0}")]
    Public(String),
    /// The local objective needs a representation the model does not expose.
    #[error(
        "this method needs the model's representation and head (Classifier::features and Classifier::head), which the model does not expose"
    )]
    NoFeatures,
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
    /// What the client kept from its last round (pFedBayes' personalised posterior, FedKEMF's
    /// personal model), held by the strategy on its behalf; `None` for stateless clients.
    pub state: Option<ParamTable>,
    /// The client's own architecture on the autodiff device, when `start` is another one
    /// (FedKEMF: the knowledge network starts, the personal model is the state).
    pub personal_template: Option<M>,
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
    with_forward_stream(forward_seed, || match &cfg.procedure {
        LocalProcedure::PFedBayes(step) => bayes::train(task, step, cfg),
        LocalProcedure::Mutual => mutual::train(task, cfg),
        _ => train_steps(task, cfg),
    })
}

/// The run's local optimiser (SGD with momentum, dampening 0 as PyTorch, or Adam), fresh: Burn's
/// `Sgd` / `Adam` bit for bit, each step one parallel pass per parameter ([`FusedSgd`],
/// [`FusedAdam`]).
fn local_optimizer(cfg: &TrainConfig) -> ModuleOptimizer {
    match cfg.optimizer {
        LocalOptimizer::Sgd => FusedSgd::new(cfg.momentum, 0.0, false, cfg.weight_decay).init(),
        LocalOptimizer::Adam => FusedAdam::pytorch(cfg.weight_decay).init(),
    }
}

/// The body of [`train_local`], run with the client's forward-pass stream installed.
fn train_steps<M: Classifier>(
    task: LocalTask<'_, M>,
    cfg: &TrainConfig,
) -> Result<LocalUpdate, TrainError> {
    let mut model = task.start.load_into(task.template)?;
    if let Some(phase) = task.objective.and_then(|o| o.public_phase()) {
        let at = (task.seed, task.round, task.client);
        model = public::train(model, phase, task.data, task.norm, at)?.0;
    }
    let device = model_device(&model);
    let mut optim = local_optimizer(cfg);
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    let references: Vec<M> = match task.objective {
        Some(objective) => objective
            .reference_models()
            .iter()
            .map(|table| table.load_into(model.valid()))
            .collect::<Result<_, _>>()?,
        None => Vec::new(),
    };
    let present = match task.objective {
        Some(o) if o.masks_absent_classes() => {
            let present = task.data.classes_of(task.indices);
            let mask: Vec<f32> = (0..task.data.num_classes())
                .map(|c| f32::from(u8::from(present.contains(&c))))
                .collect();
            let classes = mask.len();
            Some(Tensor::from_data(
                TensorData::new(mask, [1, classes]),
                &device,
            ))
        }
        _ => None,
    };
    let step = StepLoss {
        loss_fn: &loss_fn,
        objective: task.objective,
        start: &task.start,
        present,
    };
    let mut rng = rng_for(
        task.seed,
        Purpose::Shuffle,
        task.round as u64,
        task.client as u64,
    );
    let mut order = task.indices.to_vec();
    let (mut loss_sum, mut steps) = (0.0f64, 0usize);
    let mut personal: Option<M> = None;
    for epoch in 1..=cfg.local_epochs {
        order.shuffle(&mut rng);
        // Losses are summed on the device and read once per epoch (one host sync, not one per step).
        let mut epoch_losses: Vec<Tensor<1>> = Vec::new();
        let batches: Vec<&[usize]> = order.chunks(cfg.batch_size).collect();
        for (i, batch) in batches.iter().enumerate() {
            let (images, labels) = make_batch(task.data, task.norm, batch, &device);
            let features_of = |images: &Tensor<4>| {
                references
                    .iter()
                    .map(|m| {
                        m.features(images.clone().inner())
                            .ok_or(TrainError::NoFeatures)
                    })
                    .collect::<Result<Vec<_>, _>>()
            };
            let reference_features = features_of(&images)?;
            let (loss, mut grads) = match &cfg.procedure {
                LocalProcedure::Sgd => {
                    let loss = step.loss(&model, &images, &labels, &reference_features)?;
                    let grads = GradientsParams::from_grads(loss.backward(), &model);
                    (loss, grads)
                }
                LocalProcedure::PerFedAvg(meta) => {
                    // The step's batch D, then the next ones (cyclically) as D' and D''.
                    let loss_at = |m: &M, k: usize| {
                        if k == 0 {
                            return step.loss(m, &images, &labels, &reference_features);
                        }
                        let other = batches[(i + k) % batches.len()];
                        let (x, y) = make_batch(task.data, task.norm, other, &device);
                        step.loss(m, &x, &y, &features_of(&x)?)
                    };
                    meta.gradients(&model, &loss_at)?
                }
                LocalProcedure::PFedMe(moreau) => {
                    // θ starts at the received model and lives for the round (authors' code);
                    // w moves towards it, not along a gradient.
                    let w = ParamTable::from_module(&model);
                    let theta = personal.take().unwrap_or_else(|| model.clone());
                    let loss_at = |m: &M| step.loss(m, &images, &labels, &reference_features);
                    let (theta, loss) = moreau.personalise(theta, &w, &loss_at)?;
                    let pulled = moreau.pull(&w, &ParamTable::from_module(&theta), cfg.lr)?;
                    model = pulled.load_into(model)?;
                    personal = Some(theta);
                    epoch_losses.push(loss);
                    continue;
                }
                LocalProcedure::PFedBayes(_) | LocalProcedure::Mutual => {
                    unreachable!("train_local runs pFedBayes' and mutual learning's own loops")
                }
            };
            epoch_losses.push(loss.detach());
            if let Some(sam) = &cfg.sharpness {
                // The descent gradient is taken at the perturbed weights, then applied to the
                // unperturbed model (the perturbed copy keeps the parameter ids).
                let perturbed = sam.perturb(model.clone(), &grads);
                let loss = step.loss(&perturbed, &images, &labels, &reference_features)?;
                grads = GradientsParams::from_grads(loss.backward(), &perturbed);
            }
            model = optim.step(cfg.lr, model, grads);
        }
        let (sum, n) = epoch_sum(epoch_losses, task.client, epoch)?;
        loss_sum += sum;
        steps += n;
    }
    let prototypes = match task.objective {
        Some(o) if o.reports_prototypes() => Some(Prototypes::of(
            &model.valid(),
            task.data,
            task.norm,
            task.indices,
            cfg.batch_size,
        )?),
        _ => None,
    };
    Ok(LocalUpdate {
        client: task.client,
        table: ParamTable::from_module(&model),
        state: None,
        prototypes,
        num_samples: task.indices.len(),
        train_loss: loss_sum / steps as f64,
        steps,
    })
}

/// The sum and count of an epoch's step losses, read from the device at once (one host sync
/// per epoch); a non-finite sum is [`TrainError::NonFiniteLoss`].
fn epoch_sum(
    losses: Vec<Tensor<1>>,
    client: usize,
    epoch: usize,
) -> Result<(f64, usize), TrainError> {
    let n = losses.len();
    let sum = Tensor::cat(losses, 0).sum().into_scalar::<f32>() as f64;
    if !sum.is_finite() {
        return Err(TrainError::NonFiniteLoss {
            client,
            epoch,
            loss: sum / n as f64,
        });
    }
    Ok((sum, n))
}

/// `steps` plain SGD steps (no momentum) at `lr` on mini-batches of the client's shuffled
/// samples, cycling through them as often as needed, with `(λ/2)‖θ − start‖²` added for
/// `proximal = Some(λ)`: the personalisation before a per-client evaluation (Per-FedAvg
/// evaluates after one plain step of size α, pFedMe its proximal personalised model). Seeded by the client and
/// round like local training, on its own streams.
pub fn fine_tune<M: Classifier>(
    task: LocalTask<'_, M>,
    steps: usize,
    lr: f64,
    proximal: Option<f64>,
    batch_size: usize,
) -> Result<ParamTable, TrainError> {
    if steps == 0 {
        return Ok(task.start);
    }
    if task.indices.is_empty() {
        return Err(TrainError::NoSamples(task.client));
    }
    let (round, client) = (task.round as u64, task.client as u64);
    let forward_seed = derive_seed(task.seed, Purpose::FineTune, round, client);
    with_forward_stream(forward_seed, || {
        let mut model = task.start.load_into(task.template)?;
        let device = model_device(&model);
        let loss_fn = CrossEntropyLossConfig::new().init(&device);
        let mut optim = FusedSgd::plain().init();
        let mut rng = rng_for(task.seed, Purpose::FineTune, round, client);
        let mut order = task.indices.to_vec();
        let mut done = 0;
        while done < steps {
            order.shuffle(&mut rng);
            for batch in order.chunks(batch_size.max(1)).take(steps - done) {
                let (images, labels) = make_batch(task.data, task.norm, batch, &device);
                let mut loss = loss_fn.forward(model.forward(images), labels);
                if let Some(lambda) = proximal {
                    let params = ParamTable::from_module_tracked(&model);
                    let prox = params.trainable_sum(&task.start, |t, w| (t - w).square().sum());
                    loss = loss + prox.mul_scalar(lambda / 2.0);
                }
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                model = optim.step(lr, model, grads);
                done += 1;
            }
        }
        Ok(ParamTable::from_module(&model))
    })
}

/// The loss of one local step: cross-entropy plus the objective's terms.
struct StepLoss<'a> {
    loss_fn: &'a CrossEntropyLoss,
    objective: Option<&'a dyn LocalObjective>,
    start: &'a ParamTable,
    /// `[1, classes]`, 1 for the client's classes: the logits are multiplied by it (HeteroFL).
    present: Option<Tensor<2>>,
}

impl StepLoss<'_> {
    fn loss<M: Classifier>(
        &self,
        model: &M,
        images: &Tensor<4>,
        labels: &Tensor<1, Int>,
        reference_features: &[Tensor<2>],
    ) -> Result<Tensor<1>, TrainError> {
        let Some(objective) = self.objective else {
            return Ok(self
                .loss_fn
                .forward(model.forward(images.clone()), labels.clone()));
        };
        let (logits, features) = if objective.uses_features() {
            let z = model
                .features(images.clone())
                .ok_or(TrainError::NoFeatures)?;
            let logits = model.head(z.clone()).ok_or(TrainError::NoFeatures)?;
            (logits, Some(z))
        } else {
            (model.forward(images.clone()), None)
        };
        let logits = match &self.present {
            Some(mask) => logits * mask.clone(),
            None => logits,
        };
        let mut loss = self.loss_fn.forward(logits.clone(), labels.clone());
        if objective.uses_parameters() {
            let params = ParamTable::from_module_tracked(model);
            if let Some(extra) = objective.extra_loss(&params, self.start) {
                loss = loss + extra;
            }
        }
        let head = |z: Tensor<2>| model.head(z).expect("checked when computing the logits");
        let batch = BatchContext {
            images,
            labels,
            logits: &logits,
            features: features.as_ref(),
            reference_features,
            head: &head,
        };
        if let Some(extra) = objective.batch_loss(&batch) {
            loss = loss + extra;
        }
        Ok(loss)
    }
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
            let logits = model.infer(images);
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
