//! FedGen (Zhu, Hong and Zhou, ICML 2021): data-free knowledge distillation. Each round the
//! server trains a small generator `G(y, ε)` that maps a label to a point in the models' latent
//! space (the input of their final linear layer) on which the ensemble of the uploaded heads
//! agrees with the label; clients then regularise their local training with it.
//!
//! Server, after collecting the uploads and before averaging them (the authors' order):
//! `steps` Adam steps on `α·Σ_u mean_b[w(y_b, u)·CE(head_u(G(y_b, ε_b)), y_b)] + η·L_div`,
//! where `w(y, u)` is client u's share of label y among this round's clients, labels are drawn
//! uniformly from those some client holds more than one sample of, and
//! `L_div = exp(−mean_{ij} ‖ε_i − ε_j‖²_mean · |G_i − G_j|_mean)` keeps outputs diverse.
//! Heads are read from the uploads' last layer (a linear layer: every model of `fl-models`).
//!
//! Client, from round 2 on (the generator is trained after round 1), added to cross-entropy:
//! `β_t·KL(softmax(head(G(y))) ‖ p(x))` on the batch's own labels, plus
//! `(B_gen/B)·α_t·CE(head(G(ŷ)), ŷ)` on `B_gen` labels drawn from the client's own label set;
//! `α_t, β_t = max(10⁻⁴, init·0.98^(t−1))`.
//!
//! Defaults ([`FedGenConfig::default`]) are the FedGen authors' MNIST settings with the
//! generator size of the FedMR authors' FedGen baseline: hidden 512, noise 100, generator lr
//! 3·10⁻⁴, weight decay 10⁻², 50 generator steps of batch 128 per round (a fresh Adam each
//! round, as the FedMR authors' port), α = β = 10, B_gen = 32, ensemble weights 1 (teacher) and
//! 1 (diversity). `fl fedgen` picks α, β and the lr per dataset as the FedMR authors did.
//! Where the paper and code differ: the paper draws ε ~ N(0, I) (our default), the FedGen code
//! `torch.rand` (uniform on [0, 1): [`NoiseKind::Uniform`]). The FedMR authors' port also
//! drops the α, β decay, draws ŷ from all classes with B_gen = 128 and ratio 1; we follow the
//! FedGen authors' client loss.

use std::sync::{Arc, Mutex};

use burn::module::Module;
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
use burn::optim::GradientsParams;
use burn::tensor::activation::{log_softmax, relu, softmax};
use burn::tensor::{Device, Tensor, TensorData};
use rand::Rng;
use rand::seq::IndexedRandom;
use rand_chacha::ChaCha8Rng;
use rand_distr::StandardNormal;

use super::fedavg_with::{ClientRule, FedAvgWith};
use super::{Metrics, StrategyError, StrategyState};
use crate::layers::{LayerError, ParamTable};
use crate::rng::{Purpose, rng_for};
use crate::trainer::{BatchContext, FusedAdam, LocalObjective, LocalUpdate};

/// The distribution of the generator's noise input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NoiseKind {
    /// Standard normal (the paper).
    Gaussian,
    /// Uniform on [0, 1) (the authors' code).
    Uniform,
}

/// Settings of FedGen.
#[derive(Debug, Clone, PartialEq)]
pub struct FedGenConfig {
    /// Generator hidden width.
    pub hidden: usize,
    /// Noise dimension.
    pub noise_dim: usize,
    /// Noise distribution.
    pub noise: NoiseKind,
    /// Generator learning rate (Adam).
    pub lr: f64,
    /// Generator weight decay.
    pub weight_decay: f64,
    /// Generator steps per round (the authors' ensemble epochs).
    pub steps: usize,
    /// Generator batch size on the server.
    pub batch_size: usize,
    /// Client regulariser weight α (teacher loss on generated latents), before decay.
    pub alpha: f64,
    /// Client regulariser weight β (latent KL on the batch's labels), before decay.
    pub beta: f64,
    /// Generated samples per client step.
    pub client_batch: usize,
    /// The clients' local batch size (for the ratio B_gen / B).
    pub local_batch: usize,
    /// Run seed (the clients' generator draws derive from it).
    pub seed: u64,
}

impl Default for FedGenConfig {
    fn default() -> Self {
        Self {
            hidden: 512,
            noise_dim: 100,
            noise: NoiseKind::Gaussian,
            lr: 3e-4,
            weight_decay: 1e-2,
            steps: 50,
            batch_size: 128,
            alpha: 10.0,
            beta: 10.0,
            client_batch: 32,
            local_batch: 50,
            seed: 1,
        }
    }
}

impl FedGenConfig {
    /// Checks the values FedGen cannot work with.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("generator hidden width", self.hidden),
            ("generator noise dimension", self.noise_dim),
            ("generator batch size", self.batch_size),
            ("generated samples per client step", self.client_batch),
            ("local batch size", self.local_batch),
        ];
        if let Some((what, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(format!("FedGen {what} must be at least 1"));
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(format!("FedGen generator lr must be > 0, got {}", self.lr));
        }
        for (what, v) in [
            ("weight decay", self.weight_decay),
            ("alpha", self.alpha),
            ("beta", self.beta),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("FedGen {what} must be >= 0, got {v}"));
            }
        }
        Ok(())
    }
}

/// The label-conditioned generator: `[ε, onehot(y)] → FC → BatchNorm → ReLU → FC → latent`.
#[derive(Module, Debug)]
pub struct Generator {
    fc: Linear,
    bn: BatchNorm,
    out: Linear,
    #[module(skip)]
    noise_dim: usize,
    #[module(skip)]
    classes: usize,
}

impl Generator {
    /// A generator for `classes` labels and `latent` outputs (weights replaced by
    /// [`FedGen`] from its seeded stream).
    pub fn new(noise_dim: usize, classes: usize, hidden: usize, latent: usize, d: &Device) -> Self {
        Self {
            fc: LinearConfig::new(noise_dim + classes, hidden).init(d),
            bn: BatchNormConfig::new(hidden).init(d),
            out: LinearConfig::new(hidden, latent).init(d),
            noise_dim,
            classes,
        }
    }

    /// Latents `[N, D]` for `labels` with noise `[N, noise_dim]`.
    pub fn forward(&self, labels: &[usize], noise: Tensor<2>) -> Tensor<2> {
        let n = labels.len();
        let mut onehot = vec![0.0f32; n * self.classes];
        for (i, &y) in labels.iter().enumerate() {
            onehot[i * self.classes + y] = 1.0;
        }
        let device = noise.device();
        let onehot = Tensor::from_data(TensorData::new(onehot, [n, self.classes]), &device);
        let x = Tensor::cat(vec![noise, onehot], 1);
        self.out.forward(relu(self.bn.forward(self.fc.forward(x))))
    }

    /// `n` noise vectors from `rng`.
    pub fn noise(&self, kind: NoiseKind, n: usize, rng: &mut ChaCha8Rng, d: &Device) -> Tensor<2> {
        let values: Vec<f32> = (0..n * self.noise_dim)
            .map(|_| match kind {
                NoiseKind::Gaussian => rng.sample::<f32, _>(StandardNormal),
                NoiseKind::Uniform => rng.random::<f32>(),
            })
            .collect();
        Tensor::from_data(TensorData::new(values, [n, self.noise_dim]), d)
    }
}

/// A model's head (its last layer, linear): weight `[D, C]` and bias `[C]`.
fn head_of(table: &ParamTable) -> Result<(Tensor<2>, Tensor<1>), LayerError> {
    let layout = table.layout();
    let (name, tensors) = layout
        .layers()
        .last()
        .ok_or_else(|| LayerError::LayoutMismatch("empty model".into()))?;
    let shapes: Vec<&Vec<usize>> = tensors
        .iter()
        .map(|&i| &layout.tensors()[i].shape)
        .collect();
    match shapes.as_slice() {
        [w, b] if w.len() == 2 && b.len() == 1 && w[1] == b[0] => {
            let weight = table.values()[tensors[0]].clone().reshape([w[0], w[1]]);
            let bias = table.values()[tensors[1]].clone();
            Ok((weight, bias))
        }
        _ => Err(LayerError::LayoutMismatch(format!(
            "FedGen needs a model whose last layer is linear with a bias; '{name}' has tensors {shapes:?}"
        ))),
    }
}

/// `x·W + b`.
fn apply_head(head: &(Tensor<2>, Tensor<1>), x: Tensor<2>) -> Tensor<2> {
    x.matmul(head.0.clone()) + head.1.clone().unsqueeze_dim(0)
}

/// FedGen's diversity loss: `exp(−mean_ij(noise_dist · latent_dist))` with the mean squared
/// distance between noise vectors and the mean absolute distance between outputs.
fn diversity_loss(noise: Tensor<2>, latent: Tensor<2>) -> Tensor<1> {
    let pairwise = |x: Tensor<2>| x.clone().unsqueeze_dim::<3>(1) - x.unsqueeze_dim::<3>(0);
    let noise_dist = pairwise(noise).square().mean_dim(2);
    let latent_dist = pairwise(latent).abs().mean_dim(2);
    (noise_dist * latent_dist).neg().mean().exp()
}

/// FedAvg plus a server-side generator that regularises the clients.
pub type FedGen = FedAvgWith<FedGenRule>;

impl FedGen {
    /// FedGen for clients with the given per-class sample counts (`label_counts[client][class]`).
    pub fn new(config: FedGenConfig, label_counts: Vec<Vec<usize>>) -> Self {
        Self::with_rule(FedGenRule {
            config,
            label_counts,
            generator: None,
        })
    }
}

/// FedGen's client side (the generated-latent teacher) and the generator the server trains on
/// the uploads' heads.
pub struct FedGenRule {
    config: FedGenConfig,
    /// `label_counts[client][class]`.
    label_counts: Vec<Vec<usize>>,
    generator: Option<Generator>,
}

impl std::fmt::Debug for FedGenRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FedGen")
            .field("config", &self.config)
            .field("clients", &self.label_counts.len())
            .finish()
    }
}

impl FedGenRule {
    /// Whether clients are regularised this round (the generator is first trained after
    /// round 1).
    fn uses_generator(&self, round: usize) -> bool {
        round >= 2 && (self.config.alpha > 0.0 || self.config.beta > 0.0)
    }

    fn classes(&self) -> usize {
        self.label_counts.first().map_or(0, Vec::len)
    }

    /// Trains the generator against the uploads' heads; returns (teacher loss, diversity).
    fn train_generator(
        &mut self,
        updates: &[LocalUpdate],
        rng: &mut ChaCha8Rng,
    ) -> Result<(f64, f64), StrategyError> {
        let classes = self.classes();
        let heads = updates
            .iter()
            .map(|u| head_of(&u.table))
            .collect::<Result<Vec<_>, _>>()?;
        // w(y, u): client u's share of label y among this round's clients.
        let mut shares = vec![vec![0.0f32; updates.len()]; classes];
        let mut qualified = Vec::new();
        for (y, row) in shares.iter_mut().enumerate() {
            let counts: Vec<usize> = updates
                .iter()
                .map(|u| self.label_counts[u.client][y])
                .collect();
            let total: usize = counts.iter().sum();
            if counts.iter().any(|&c| c > 1) {
                qualified.push(y);
            }
            for (w, c) in row.iter_mut().zip(&counts) {
                *w = if total > 0 {
                    *c as f32 / total as f32
                } else {
                    0.0
                };
            }
        }
        if qualified.is_empty() {
            return Ok((0.0, 0.0));
        }
        let mut generator = self.generator.take().ok_or(StrategyError::NotInitialised)?;
        let device = heads[0].0.device().autodiff();
        let mut optim = FusedAdam::pytorch(self.config.weight_decay).init();
        let b = self.config.batch_size;
        let (mut teacher_sum, mut diversity_sum) = (0.0, 0.0);
        for _ in 0..self.config.steps {
            let labels: Vec<usize> = (0..b)
                .map(|_| *qualified.choose(rng).expect("non-empty"))
                .collect();
            let noise = generator.noise(self.config.noise, b, rng, &device);
            let latent = generator.forward(&labels, noise.clone());
            let mut onehot = vec![0.0f32; b * classes];
            for (i, &y) in labels.iter().enumerate() {
                onehot[i * classes + y] = 1.0;
            }
            let onehot: Tensor<2> =
                Tensor::from_data(TensorData::new(onehot, [b, classes]), &device);
            let mut teacher: Option<Tensor<1>> = None;
            for (u, head) in heads.iter().enumerate() {
                let weights: Vec<f32> = labels.iter().map(|&y| shares[y][u]).collect();
                let weights: Tensor<2> =
                    Tensor::from_data(TensorData::new(weights, [b, 1]), &device);
                let nll = (log_softmax(apply_head(head, latent.clone()), 1) * onehot.clone())
                    .sum_dim(1)
                    .neg();
                let term = (nll * weights).mean();
                teacher = Some(match teacher {
                    Some(t) => t + term,
                    None => term,
                });
            }
            let teacher = teacher.expect("at least one upload");
            let diversity = diversity_loss(noise, latent);
            let loss = teacher.clone() + diversity.clone();
            teacher_sum += teacher.into_scalar::<f32>() as f64;
            diversity_sum += diversity.into_scalar::<f32>() as f64;
            let grads = GradientsParams::from_grads(loss.backward(), &generator);
            generator = optim.step(self.config.lr, generator, grads);
        }
        self.generator = Some(generator);
        let steps = self.config.steps.max(1) as f64;
        Ok((teacher_sum / steps, diversity_sum / steps))
    }
}

/// The client's FedGen regulariser (see the [module docs](self)).
pub struct GeneratorTeacher {
    generator: Generator,
    noise: NoiseKind,
    alpha: f64,
    beta: f64,
    /// Labels the client holds.
    labels: Vec<usize>,
    client_batch: usize,
    gen_ratio: f64,
    rng: Mutex<ChaCha8Rng>,
}

impl LocalObjective for GeneratorTeacher {
    fn uses_parameters(&self) -> bool {
        false
    }

    fn uses_features(&self) -> bool {
        true
    }

    fn batch_loss(&self, batch: &BatchContext<'_>) -> Option<Tensor<1>> {
        let device = self.generator.devices().into_iter().next()?;
        let mut rng = self
            .rng
            .lock()
            .expect("one client's objective is used by one thread");
        // β·KL(p_gen ‖ p_model) on the batch's own labels.
        let labels: Vec<usize> = batch
            .labels
            .clone()
            .into_data()
            .iter::<i64>()
            .map(|y| y as usize)
            .collect();
        let noise = self
            .generator
            .noise(self.noise, labels.len(), &mut rng, &device);
        let target = softmax(
            (batch.head)(self.generator.forward(&labels, noise)).inner(),
            1,
        );
        let log_q = log_softmax(batch.logits.clone(), 1);
        let [n, _] = target.dims();
        let kl = (target.clone() * (target.clamp_min(1e-12).log() - log_q))
            .sum()
            .div_scalar(n as f64);
        // α·CE(head(G(ŷ)), ŷ) on labels drawn from the client's own.
        let sampled: Vec<usize> = (0..self.client_batch)
            .map(|_| {
                *self
                    .labels
                    .choose(&mut *rng)
                    .expect("a client holds a label")
            })
            .collect();
        let noise = self
            .generator
            .noise(self.noise, sampled.len(), &mut rng, &device);
        let log_p = log_softmax((batch.head)(self.generator.forward(&sampled, noise)), 1);
        let [m, classes] = log_p.dims();
        let mut onehot = vec![0.0f32; m * classes];
        for (i, &y) in sampled.iter().enumerate() {
            onehot[i * classes + y] = 1.0;
        }
        let onehot: Tensor<2> = Tensor::from_data(TensorData::new(onehot, [m, classes]), &device);
        let ce = (log_p * onehot).sum().neg().div_scalar(m as f64);
        Some(kl.mul_scalar(self.beta) + ce.mul_scalar(self.alpha * self.gen_ratio))
    }
}

impl ClientRule for FedGenRule {
    fn name(&self) -> &'static str {
        "fedgen"
    }

    fn init(&mut self, initial: &ParamTable) -> Result<(), StrategyError> {
        self.generator = None;
        let Ok((weight, _)) = head_of(initial) else {
            return Ok(()); // reported by dispatch/aggregate through head_of
        };
        let [latent, _] = weight.dims();
        let device = initial.device().autodiff();
        let generator = Generator::new(
            self.config.noise_dim,
            self.classes(),
            self.config.hidden,
            latent,
            &device,
        );
        // PyTorch's default init (uniform ±1/√fan_in) from a seeded stream, not Burn's
        // process-wide generator: runs are reproducible whatever else draws from it.
        let table = ParamTable::from_module(&generator);
        let mut rng = rng_for(self.config.seed, Purpose::Init, 0, 1);
        let host = table
            .named_host()
            .expect("host copy of a new module")
            .into_iter()
            .map(|t| {
                if t.name.starts_with("bn.") {
                    return t.values;
                }
                let fan_in = if t.name.starts_with("fc.") {
                    self.config.noise_dim + self.classes()
                } else {
                    self.config.hidden
                };
                let bound = 1.0 / (fan_in as f32).sqrt();
                t.values
                    .iter()
                    .map(|_| rng.random_range(-bound..bound))
                    .collect()
            })
            .collect();
        let values = table
            .from_host(host, &initial.device())
            .expect("same layout");
        self.generator = Some(values.load_into(generator).expect("same module"));
        Ok(())
    }

    fn objectives(
        &self,
        round: usize,
        clients: &[usize],
        global: &ParamTable,
    ) -> Result<Vec<Option<Arc<dyn LocalObjective>>>, StrategyError> {
        head_of(global)?;
        if let Some(&bad) = clients.iter().find(|&&c| c >= self.label_counts.len()) {
            return Err(StrategyError::Restore(format!(
                "FedGen knows the labels of {} clients, not client {bad}",
                self.label_counts.len()
            )));
        }
        if !self.uses_generator(round) {
            return Ok(vec![None; clients.len()]);
        }
        let generator = self
            .generator
            .as_ref()
            .ok_or(StrategyError::NotInitialised)?
            .valid();
        let decay = |init: f64| (init * 0.98f64.powi(round as i32 - 1)).max(1e-4);
        Ok(clients
            .iter()
            .map(|&c| {
                let labels: Vec<usize> = (0..self.classes())
                    .filter(|&y| self.label_counts[c][y] > 0)
                    .collect();
                let teacher = GeneratorTeacher {
                    generator: generator.clone(),
                    noise: self.config.noise,
                    alpha: decay(self.config.alpha),
                    beta: decay(self.config.beta),
                    labels,
                    client_batch: self.config.client_batch,
                    gen_ratio: self.config.client_batch as f64 / self.config.local_batch as f64,
                    rng: Mutex::new(rng_for(
                        self.config.seed,
                        Purpose::Objective,
                        round as u64,
                        c as u64,
                    )),
                };
                Some(Arc::new(teacher) as Arc<dyn LocalObjective>)
            })
            .collect())
    }

    fn observe(
        &mut self,
        round: usize,
        _global: &ParamTable,
        updates: &[LocalUpdate],
        rng: &mut ChaCha8Rng,
    ) -> Result<Metrics, StrategyError> {
        // The clients of this round received the generator with the model (from round 2 on).
        let generator_bytes = match &self.generator {
            Some(g) if self.uses_generator(round) => {
                ParamTable::from_module(g).byte_size() * updates.len()
            }
            _ => 0,
        };
        let (teacher, diversity) = self.train_generator(updates, rng)?;
        let mut extra = Metrics::new();
        extra.insert("generator_loss".into(), teacher.into());
        extra.insert("diversity_loss".into(), diversity.into());
        extra.insert("generator_bytes_down".into(), generator_bytes.into());
        Ok(extra)
    }

    fn save(&self, state: &mut StrategyState) {
        if let Some(g) = &self.generator {
            let host = ParamTable::from_module(g).to_host().ok();
            state.extra["generator"] = serde_json::to_value(host).expect("floats serialise");
        }
    }

    fn load(&mut self, state: &mut StrategyState) -> Result<(), StrategyError> {
        let host: Option<Vec<Vec<f32>>> = serde_json::from_value(state.extra["generator"].clone())
            .map_err(|e| StrategyError::Restore(format!("FedGen generator: {e}")))?;
        let generator = self.generator.take().ok_or(StrategyError::NotInitialised)?;
        let host = host.ok_or_else(|| StrategyError::Restore("no FedGen generator".into()))?;
        let table = ParamTable::from_module(&generator);
        let values = table.from_host(host, &table.device())?;
        self.generator = Some(values.load_into(generator)?);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::Strategy;
    use crate::test_model::{device, tiny, upload};
    use rand::SeedableRng;

    fn counts(clients: usize) -> Vec<Vec<usize>> {
        (0..clients)
            .map(|c| {
                (0..10)
                    .map(|y| if y % 2 == c % 2 { 20 } else { 0 })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn diversity_is_one_for_identical_outputs_and_smaller_otherwise() {
        let d = device();
        let noise = Tensor::<2>::from_data([[0.0f32, 1.0], [1.0, 0.0]], &d);
        let same = Tensor::<2>::from_data([[1.0f32, 2.0], [1.0, 2.0]], &d);
        let apart = Tensor::<2>::from_data([[1.0f32, 2.0], [3.0, 0.0]], &d);
        let one: f32 = diversity_loss(noise.clone(), same).into_scalar();
        let less: f32 = diversity_loss(noise, apart).into_scalar();
        assert!((one - 1.0).abs() < 1e-6);
        // mean over the 4 pairs of ‖ε‖²_mean·|G|_mean = 2·(1·2)/4 = 1: exp(−1).
        assert!((less - (-1.0f32).exp()).abs() < 1e-6, "{less}");
    }

    /// The generator learns: the uploads' heads classify its latents better after training,
    /// the run is deterministic, and the state round-trips.
    #[test]
    fn generator_training_lowers_the_teacher_loss_and_restores() {
        let config = FedGenConfig {
            steps: 30,
            batch_size: 32,
            lr: 1e-2,
            ..FedGenConfig::default()
        };
        let run = || {
            let mut s = FedGen::new(config.clone(), counts(4));
            s.init(ParamTable::from_module(&tiny(1)), 2).unwrap();
            let mut rng = ChaCha8Rng::seed_from_u64(3);
            let ups = vec![upload(2, 40), upload(3, 40)];
            let first = s.rule.train_generator(&ups, &mut rng).unwrap();
            let second = s.rule.train_generator(&ups, &mut rng).unwrap();
            (s, first, second)
        };
        let (s, first, second) = run();
        assert!(second.0 < first.0, "teacher loss {first:?} -> {second:?}");
        let (again, ..) = run();
        let host =
            |s: &FedGen| ParamTable::from_module(s.rule.generator.as_ref().unwrap()).to_host();
        assert_eq!(host(&s).unwrap(), host(&again).unwrap());
        let mut restored = FedGen::new(config, counts(4));
        restored.init(ParamTable::from_module(&tiny(1)), 2).unwrap();
        restored.restore(s.state()).unwrap();
        assert_eq!(host(&restored).unwrap(), host(&s).unwrap());
    }

    #[test]
    fn clients_get_a_teacher_from_round_two_with_their_own_labels() {
        let mut s = FedGen::new(FedGenConfig::default(), counts(3));
        s.init(ParamTable::from_module(&tiny(1)), 2).unwrap();
        let global = ParamTable::from_module(&tiny(1));
        assert!(
            s.rule
                .objectives(1, &[0, 1], &global)
                .unwrap()
                .iter()
                .all(Option::is_none)
        );
        assert!(
            s.rule
                .objectives(2, &[0, 1], &global)
                .unwrap()
                .iter()
                .all(Option::is_some)
        );
        assert!(s.rule.objectives(2, &[5], &global).is_err());
        let bad = FedGenConfig {
            noise_dim: 0,
            ..FedGenConfig::default()
        };
        assert!(bad.validate().is_err());
    }
}
