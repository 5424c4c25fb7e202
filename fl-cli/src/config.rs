//! The run configuration: defaults, then a TOML file (`--config`), then command-line flags.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::Args;
use fl_core::secure::SecureExchange;
use fl_core::strategy::clusamp::{LinkageInput, UpdateDistance};
use fl_core::strategy::fedgen::NoiseKind;
use fl_core::strategy::{
    Clusamp, ClusampConfig, FedAsam, FedAvgM, FedCrossConfig, FedExP, FedGen, FedGenConfig,
    FedMrConfig, FedMut, FedMutConfig, FedProx, Moon, Scaffold, ScaffoldConfig, SharpnessAware,
    Strategy,
};
use fl_core::{EngineConfig, TrainConfig};
use fl_data::{DatasetKind, PartitionScheme};
use fl_models::ModelKind;
use serde::{Deserialize, Serialize};

use crate::personal::ClubSettings;

/// Everything that defines a run; written to `config.toml` in the run directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunConfig {
    /// The algorithm (the subcommand).
    pub algorithm: String,
    /// Dataset name.
    pub dataset: String,
    /// Directory with the dataset's files (otherwise resolved automatically).
    pub data_dir: Option<PathBuf>,
    /// Model name.
    pub model: String,
    /// Number of clients.
    pub clients: usize,
    /// Clients sampled per round.
    pub sample: usize,
    /// Sample this fraction of the clients per round instead of `sample` (at least one; the
    /// FedMR authors' `--frac`).
    pub sample_fraction: Option<f64>,
    /// Number of rounds.
    pub rounds: usize,
    /// Local epochs per round.
    pub local_epochs: usize,
    /// Local mini-batch size.
    pub batch_size: usize,
    /// Local learning rate.
    pub lr: f64,
    /// Local SGD momentum.
    pub momentum: f64,
    /// Local weight decay.
    pub weight_decay: f64,
    /// `iid`, `dirichlet`, `dirichlet-balanced`, `pathological` or `natural`.
    pub partition: String,
    /// Dirichlet concentration.
    pub alpha: f64,
    /// Smallest client size for Dirichlet partitions.
    pub min_client_size: usize,
    /// A partition JSON file to use instead of drawing one.
    pub partition_file: Option<PathBuf>,
    /// Run seed.
    pub seed: u64,
    /// Evaluate every this many rounds.
    pub eval_every: usize,
    /// Evaluation batch size.
    pub eval_batch_size: usize,
    /// Worker threads.
    pub threads: usize,
    /// FedAvg: weight uploads by sample counts.
    pub weighted: bool,
    /// FedMR: what is recombined (`tensor`, `layer`, `block`, `segments`).
    pub granularity: String,
    /// FedMR with `segments`: fraction of the layers per segment (FedMR-p*x*).
    pub segment_fraction: f64,
    /// FedMR, FedCross: rounds aggregated with FedAvg before recombination/cross aggregation.
    pub first_stage: usize,
    /// FedMR: recombine by the client-to-client encrypted exchange (paper, Appendix B).
    pub secure: bool,
    /// FedMR with `secure`: exchange passes (each client offers each unit once per pass).
    pub secure_passes: usize,
    /// FedCross: weight α of a model's own upload in its fusion.
    pub cross_alpha: f64,
    /// FedCross: partner selection (`in-order`, `lowest`, `highest`).
    pub select: String,
    /// FedCross: similarity for partner selection (`cosine`, `layer-cosine`, `paper`).
    pub similarity: String,
    /// FedCross: cross-aggregation rounds fused with two in-order propeller partners.
    pub propellers: usize,
    /// FedCross: α schedule `START:END:ROUNDS` replacing `cross_alpha`.
    pub dynamic_alpha: Option<String>,
    /// FedCross: fuse only trainable parameters (keep each model's BatchNorm statistics).
    pub trainable_only: bool,
    /// Pathological partition: distinct classes per client.
    pub classes_per_client: usize,
    /// FedProx: weight μ of the proximal term.
    pub mu: f64,
    /// SCAFFOLD, FedAvgM: server learning rate.
    pub server_lr: f64,
    /// FedAvgM: server momentum β.
    pub server_momentum: f64,
    /// FedExP: ε of the step-size rule.
    pub epsilon: f64,
    /// FedMut: mutation radius α.
    pub mut_radius: f64,
    /// FedMut: initial imbalance of the mutation pairs.
    pub mut_rate: f64,
    /// FedMut: rounds over which the imbalance decays to zero.
    pub mut_bound: usize,
    /// MOON: weight μ of the contrastive term (unset: the MOON paper's value for the dataset,
    /// 1 for CIFAR-100 and FEMNIST, 5 otherwise).
    pub moon_mu: Option<f64>,
    /// MOON: temperature τ.
    pub tau: f64,
    /// FedASAM: neighbourhood radius ρ.
    pub rho: f64,
    /// FedASAM: η of the adaptive scaling |w| + η.
    pub eta: f64,
    /// FedASAM: plain SAM (FedSAM) instead of ASAM.
    pub sam: bool,
    /// Clustered sampling: update distance (`arccos`, `l1`, `l2`).
    pub cluster_distance: String,
    /// Clustered sampling: what Ward's linkage clusters (`rows` of the distance matrix, as the
    /// authors' code, or the `distances` themselves).
    pub linkage: String,
    /// FedGen: generator hidden width.
    pub gen_hidden: usize,
    /// FedGen: generator noise dimension.
    pub gen_noise_dim: usize,
    /// FedGen: noise distribution (`gaussian` as the paper, `uniform` as the authors' code).
    pub gen_noise: String,
    /// FedGen: generator learning rate (unset: the dataset's value, see [`fedgen_defaults`]).
    pub gen_lr: Option<f64>,
    /// FedGen: generator weight decay.
    pub gen_weight_decay: f64,
    /// FedGen: generator steps per round.
    pub gen_steps: usize,
    /// FedGen: generator batch size.
    pub gen_batch: usize,
    /// FedGen: client weight α of the generated-latent cross-entropy (unset: the dataset's).
    pub gen_alpha: Option<f64>,
    /// FedGen: client weight β of the latent KL term (unset: the dataset's).
    pub gen_beta: Option<f64>,
    /// FedGen: generated samples per client step.
    pub gen_client_batch: usize,
    /// Output directory.
    pub out: Option<PathBuf>,
    /// pFedClub and its variants: the `[pfedclub]` section (last: TOML tables follow values).
    pub pfedclub: Option<ClubSettings>,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            algorithm: "fedavg".into(),
            dataset: "fashion-mnist".into(),
            data_dir: None,
            model: "cnn".into(),
            clients: 100,
            sample: 10,
            sample_fraction: None,
            rounds: 50,
            local_epochs: 5,
            batch_size: 50,
            lr: 0.01,
            momentum: 0.5,
            weight_decay: 0.0,
            partition: "dirichlet".into(),
            alpha: 0.5,
            min_client_size: 10,
            partition_file: None,
            seed: 1,
            eval_every: 1,
            eval_batch_size: 500,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            weighted: true,
            granularity: "tensor".into(),
            segment_fraction: 0.5,
            first_stage: 0,
            secure: false,
            secure_passes: 3,
            cross_alpha: 0.99,
            select: "lowest".into(),
            similarity: "cosine".into(),
            propellers: 0,
            dynamic_alpha: None,
            trainable_only: false,
            classes_per_client: 2,
            mu: 0.01,
            server_lr: 1.0,
            server_momentum: 0.9,
            epsilon: 1e-3,
            mut_radius: 4.0,
            mut_rate: 0.3,
            mut_bound: 100,
            moon_mu: None,
            tau: 0.5,
            rho: 0.1,
            eta: 0.0,
            sam: false,
            cluster_distance: "arccos".into(),
            linkage: "rows".into(),
            gen_hidden: 512,
            gen_noise_dim: 100,
            gen_noise: "gaussian".into(),
            gen_lr: None,
            gen_weight_decay: 1e-2,
            gen_steps: 50,
            gen_batch: 128,
            gen_alpha: None,
            gen_beta: None,
            gen_client_batch: 32,
            out: None,
            pfedclub: None,
        }
    }
}

/// Flags shared by every algorithm subcommand. Each overrides the same field of `--config`.
#[derive(Debug, Clone, Default, Args)]
pub struct RunArgs {
    /// TOML file with any of the fields below (flags given on the command line win).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Continue the killed or finished run in DIR (its config.toml is used; `--rounds` may
    /// extend it).
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// Dataset: fashion-mnist, mnist, cifar10, cifar100, cifar100-coarse, femnist, image-folder.
    #[arg(long)]
    pub dataset: Option<String>,
    /// Directory with the dataset files (default: $FL_DATA_DIR, system paths, embedded copy).
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Model (see `fl models`).
    #[arg(long)]
    pub model: Option<String>,
    /// Number of clients.
    #[arg(long)]
    pub clients: Option<usize>,
    /// Clients sampled per round.
    #[arg(long)]
    pub sample: Option<usize>,
    /// Sample this fraction of the clients per round instead of --sample (e.g. 0.1).
    #[arg(long, value_name = "F")]
    pub sample_fraction: Option<f64>,
    /// Number of rounds.
    #[arg(long)]
    pub rounds: Option<usize>,
    /// Local epochs per round.
    #[arg(long)]
    pub local_epochs: Option<usize>,
    /// Local mini-batch size.
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// Local learning rate.
    #[arg(long)]
    pub lr: Option<f64>,
    /// Local SGD momentum (PyTorch semantics, no dampening).
    #[arg(long)]
    pub momentum: Option<f64>,
    /// Local L2 weight decay.
    #[arg(long)]
    pub weight_decay: Option<f64>,
    /// Client partition: iid, dirichlet (per-class Dirichlet shares, as the FedMR code),
    /// dirichlet-balanced (equal sizes, per-client Dirichlet label mix: every client gets
    /// samples, for thousands of clients), pathological (k classes per client), or natural (the
    /// dataset's own: FEMNIST writers).
    #[arg(long)]
    pub partition: Option<String>,
    /// Pathological partition: distinct classes per client (pFedClub: 2).
    #[arg(long, value_name = "K")]
    pub classes_per_client: Option<usize>,
    /// Dirichlet concentration (> 0; small is more skewed).
    #[arg(long)]
    pub alpha: Option<f64>,
    /// Smallest client size a Dirichlet draw must give (redrawn until it does).
    #[arg(long)]
    pub min_client_size: Option<usize>,
    /// Use this partition JSON (as written to a run's partition.json) instead of drawing one.
    #[arg(long, value_name = "FILE")]
    pub partition_file: Option<PathBuf>,
    /// Run seed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Evaluate the global model every N rounds (and after the last).
    #[arg(long)]
    pub eval_every: Option<usize>,
    /// Evaluation batch size.
    #[arg(long)]
    pub eval_batch_size: Option<usize>,
    /// Worker threads (default: all cores). Results do not depend on it.
    #[arg(long)]
    pub threads: Option<usize>,
    /// Output directory (default: runs/ALGORITHM-DATASET-MODEL-sSEED).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// No progress bar or summary (also automatic when stdout is not a terminal).
    #[arg(long)]
    pub quiet: bool,
    /// Run once per seed (comma-separated), each into OUT/sSEED; `fl plot` and `fl compare`
    /// summarise OUT as mean ± std.
    #[arg(long, value_delimiter = ',', value_name = "SEED,...", conflicts_with_all = ["seed", "resume"])]
    pub seeds: Option<Vec<u64>>,
}

macro_rules! override_fields {
    ($cfg:ident, $args:ident, $($field:ident),*) => {
        $( if let Some(v) = $args.$field.clone() { $cfg.$field = v.into(); } )*
    };
}

/// FedMR's flags (override the same fields of `--config`).
#[derive(Debug, Clone, Default, Args)]
pub struct FedMrArgs {
    /// Unit shuffled across models: tensor (authors' code), layer (paper), block, segments.
    #[arg(long)]
    pub granularity: Option<String>,
    /// With `--granularity segments`: fraction of layers per segment (FedMR-px ablation;
    /// 1.0 = whole models, i.e. FedIndep).
    #[arg(long, value_name = "X")]
    pub segment_fraction: Option<f64>,
    /// Aggregate the first R rounds with FedAvg, then recombine (paper: 100 for ResNet/VGG).
    #[arg(long, value_name = "R")]
    pub first_stage: Option<usize>,
    /// Secure recombination: clients exchange HPKE-encrypted layers before upload.
    #[arg(long)]
    pub secure: bool,
    /// Exchange passes per round with `--secure`.
    #[arg(long, value_name = "N")]
    pub secure_passes: Option<usize>,
}

impl FedMrArgs {
    /// Writes the given flags into `cfg`.
    pub fn apply(&self, cfg: &mut RunConfig) {
        override_fields!(
            cfg,
            self,
            granularity,
            segment_fraction,
            first_stage,
            secure_passes
        );
        if self.secure {
            cfg.secure = true;
        }
    }
}

/// FedCross's flags (override the same fields of `--config`).
#[derive(Debug, Clone, Default, Args)]
pub struct FedCrossArgs {
    /// Weight of a model's own upload in its fusion wᵢ = α·vᵢ + (1 − α)·v_co (paper: 0.99).
    #[arg(long, value_name = "ALPHA")]
    pub cross_alpha: Option<f64>,
    /// Partner selection: lowest (paper's choice), highest similarity, or in-order.
    #[arg(long)]
    pub select: Option<String>,
    /// Similarity for partner selection: cosine (whole model), layer-cosine (sum of per-layer
    /// cosines, as the authors' code) or paper (Eq. 5 as printed).
    #[arg(long)]
    pub similarity: Option<String>,
    /// Aggregate the first R rounds with FedAvg, then cross-aggregate.
    #[arg(long, value_name = "R")]
    pub first_stage: Option<usize>,
    /// Fuse each model with two in-order propeller partners for the first N cross rounds.
    #[arg(long, value_name = "N")]
    pub propellers: Option<usize>,
    /// Grow α linearly from START to END over ROUNDS rounds (after any propeller rounds).
    #[arg(long, value_name = "START:END:ROUNDS")]
    pub dynamic_alpha: Option<String>,
    /// Fuse only trainable parameters; keep each model's BatchNorm statistics.
    #[arg(long)]
    pub trainable_only: bool,
}

impl FedCrossArgs {
    /// Writes the given flags into `cfg`.
    pub fn apply(&self, cfg: &mut RunConfig) {
        override_fields!(
            cfg,
            self,
            cross_alpha,
            select,
            similarity,
            first_stage,
            propellers
        );
        if self.dynamic_alpha.is_some() {
            cfg.dynamic_alpha = self.dynamic_alpha.clone();
        }
        if self.trainable_only {
            cfg.trainable_only = true;
        }
    }
}

/// The baselines' flags (each subcommand exposes its own; override the same fields of
/// `--config`).
#[derive(Debug, Clone, Default)]
pub struct BaselineArgs {
    /// FedProx μ.
    pub mu: Option<f64>,
    /// Server learning rate.
    pub server_lr: Option<f64>,
    /// FedAvgM β.
    pub server_momentum: Option<f64>,
    /// FedExP ε.
    pub epsilon: Option<f64>,
    /// FedMut α.
    pub mut_radius: Option<f64>,
    /// FedMut rate.
    pub mut_rate: Option<f64>,
    /// FedMut bound.
    pub mut_bound: Option<usize>,
    /// MOON μ.
    pub moon_mu: Option<f64>,
    /// MOON τ.
    pub tau: Option<f64>,
    /// FedASAM ρ.
    pub rho: Option<f64>,
    /// FedASAM η.
    pub eta: Option<f64>,
    /// FedASAM: plain SAM.
    pub sam: bool,
    /// Clustered sampling distance.
    pub cluster_distance: Option<String>,
    /// Clustered sampling linkage input.
    pub linkage: Option<String>,
    /// FedGen noise.
    pub gen_noise: Option<String>,
    /// FedGen generator lr.
    pub gen_lr: Option<f64>,
    /// FedGen generator steps.
    pub gen_steps: Option<usize>,
    /// FedGen α.
    pub gen_alpha: Option<f64>,
    /// FedGen β.
    pub gen_beta: Option<f64>,
}

impl BaselineArgs {
    /// Writes the given flags into `cfg`.
    pub fn apply(&self, cfg: &mut RunConfig) {
        override_fields!(
            cfg,
            self,
            mu,
            server_lr,
            server_momentum,
            epsilon,
            mut_radius,
            mut_rate,
            mut_bound,
            moon_mu,
            tau,
            rho,
            eta,
            cluster_distance,
            linkage,
            gen_noise,
            gen_lr,
            gen_steps,
            gen_alpha,
            gen_beta
        );
        if self.sam {
            cfg.sam = true;
        }
    }
}

/// FedGen's per-dataset (generator lr, client α, client β), as the FedMR authors ran the
/// baseline: CIFAR-10 (3·10⁻⁴, 0.2, 0.2), CIFAR-100 (10⁻⁴, 10, 1), FEMNIST (3·10⁻⁴, 10, 10);
/// other datasets use FedGen's own MNIST values (3·10⁻⁴, 10, 10).
pub fn fedgen_defaults(dataset: &str) -> (f64, f64, f64) {
    match dataset {
        "cifar10" => (3e-4, 0.2, 0.2),
        d if d.starts_with("cifar100") => (1e-4, 10.0, 1.0),
        _ => (3e-4, 10.0, 10.0),
    }
}

/// The MOON paper's μ for a dataset: 1 for CIFAR-100 (and FEMNIST, by analogy), 5 otherwise.
pub fn moon_default_mu(dataset: &str) -> f64 {
    if dataset.starts_with("cifar100") || dataset == "femnist" {
        1.0
    } else {
        5.0
    }
}

impl RunConfig {
    /// The baseline strategy named by `algorithm`, with its settings checked; `label_counts`
    /// gives the clients' per-class sample counts (FedGen needs them).
    pub fn baseline(
        &self,
        label_counts: impl FnOnce() -> Vec<Vec<usize>>,
    ) -> anyhow::Result<Box<dyn Strategy>> {
        let check = |ok: bool, what: &str| {
            if ok {
                Ok(())
            } else {
                Err(anyhow::anyhow!("{what}"))
            }
        };
        Ok(match self.algorithm.as_str() {
            "fedprox" => {
                check(self.mu.is_finite() && self.mu >= 0.0, "--mu must be >= 0")?;
                Box::new(FedProx::new(self.mu))
            }
            "scaffold" => {
                check(self.server_lr > 0.0, "--server-lr must be > 0")?;
                Box::new(Scaffold::new(ScaffoldConfig {
                    server_lr: self.server_lr,
                    local_lr: self.lr,
                    num_clients: self.clients,
                }))
            }
            "fedavgm" => {
                check(self.server_lr > 0.0, "--server-lr must be > 0")?;
                check(
                    (0.0..1.0).contains(&self.server_momentum),
                    "--server-momentum must be in [0, 1)",
                )?;
                let mut s = FedAvgM::new(self.server_momentum, self.server_lr);
                s.weighted = self.weighted;
                Box::new(s)
            }
            "fedexp" => {
                check(self.epsilon > 0.0, "--epsilon must be > 0")?;
                Box::new(FedExP::new(self.epsilon))
            }
            "fedmut" => {
                check(self.mut_radius >= 0.0, "--mut-radius must be >= 0")?;
                check(
                    (0.0..=1.0).contains(&self.mut_rate),
                    "--mut-rate must be in [0, 1]",
                )?;
                check(self.mut_bound >= 1, "--mut-bound must be >= 1")?;
                Box::new(FedMut::new(FedMutConfig {
                    radius: self.mut_radius,
                    rate: self.mut_rate,
                    bound: self.mut_bound,
                }))
            }
            "moon" => {
                let mu = self
                    .moon_mu
                    .unwrap_or_else(|| moon_default_mu(&self.dataset));
                check(mu.is_finite() && mu >= 0.0, "--moon-mu must be >= 0")?;
                check(self.tau.is_finite() && self.tau > 0.0, "--tau must be > 0")?;
                Box::new(Moon::new(mu, self.tau))
            }
            "fedasam" => {
                let sharpness = if self.sam {
                    SharpnessAware::sam(self.rho)
                } else {
                    SharpnessAware::asam(self.rho, self.eta)
                };
                sharpness
                    .validate()
                    .map_err(|e| anyhow::anyhow!("--rho / --eta: {e}"))?;
                Box::new(FedAsam::new(sharpness))
            }
            "clusamp" => {
                let distance = match self.cluster_distance.as_str() {
                    "arccos" => UpdateDistance::Arccos,
                    "l1" => UpdateDistance::L1,
                    "l2" => UpdateDistance::L2,
                    other => bail!("unknown --cluster-distance '{other}' (known: arccos, l1, l2)"),
                };
                let linkage = match self.linkage.as_str() {
                    "rows" => LinkageInput::Rows,
                    "distances" => LinkageInput::Distances,
                    other => bail!("unknown --linkage '{other}' (known: rows, distances)"),
                };
                Box::new(Clusamp::new(ClusampConfig { distance, linkage }))
            }
            "fedgen" => {
                let noise = match self.gen_noise.as_str() {
                    "gaussian" => NoiseKind::Gaussian,
                    "uniform" => NoiseKind::Uniform,
                    other => bail!("unknown --gen-noise '{other}' (known: gaussian, uniform)"),
                };
                let (lr, alpha, beta) = fedgen_defaults(&self.dataset);
                let config = FedGenConfig {
                    hidden: self.gen_hidden,
                    noise_dim: self.gen_noise_dim,
                    noise,
                    lr: self.gen_lr.unwrap_or(lr),
                    weight_decay: self.gen_weight_decay,
                    steps: self.gen_steps,
                    batch_size: self.gen_batch,
                    alpha: self.gen_alpha.unwrap_or(alpha),
                    beta: self.gen_beta.unwrap_or(beta),
                    client_batch: self.gen_client_batch,
                    local_batch: self.batch_size,
                    seed: self.seed,
                };
                config.validate().map_err(anyhow::Error::msg)?;
                Box::new(FedGen::new(config, label_counts()))
            }
            other => bail!("'{other}' is not a baseline"),
        })
    }

    /// Reads a TOML config file.
    pub fn from_file(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("invalid config {}", path.display()))
    }

    /// Defaults, then `--config`, then flags.
    pub fn resolve(algorithm: &str, args: &RunArgs) -> anyhow::Result<Self> {
        let mut cfg = match &args.config {
            Some(path) => Self::from_file(path)?,
            None => Self::default(),
        };
        cfg.algorithm = algorithm.to_string();
        override_fields!(
            cfg,
            args,
            dataset,
            model,
            clients,
            sample,
            rounds,
            local_epochs,
            batch_size,
            lr,
            momentum,
            weight_decay,
            partition,
            alpha,
            min_client_size,
            classes_per_client,
            seed,
            eval_every,
            eval_batch_size,
            threads
        );
        if let Some(d) = &args.data_dir {
            cfg.data_dir = Some(d.clone());
        }
        if let Some(p) = &args.partition_file {
            cfg.partition_file = Some(p.clone());
        }
        if let Some(f) = args.sample_fraction {
            cfg.sample_fraction = Some(f);
        }
        if let Some(o) = &args.out {
            cfg.out = Some(o.clone());
        }
        // Record MOON's dataset-dependent μ in the run's config.toml.
        if cfg.algorithm == "moon" && cfg.moon_mu.is_none() {
            cfg.moon_mu = Some(moon_default_mu(&cfg.dataset));
        }
        if cfg.algorithm == "fedgen" {
            let (lr, alpha, beta) = fedgen_defaults(&cfg.dataset);
            cfg.gen_lr.get_or_insert(lr);
            cfg.gen_alpha.get_or_insert(alpha);
            cfg.gen_beta.get_or_insert(beta);
        }
        Ok(cfg)
    }

    /// Fixes the client count (`clients = 0` with the natural partition: all of the dataset's
    /// clients) and the per-round sample (`sample_fraction`) once the partition has
    /// `num_clients` clients.
    pub fn settle_clients(&mut self, num_clients: usize) -> anyhow::Result<()> {
        self.clients = num_clients;
        if let Some(f) = self.sample_fraction {
            if !(f > 0.0 && f <= 1.0) {
                bail!("--sample-fraction must be in (0, 1], got {f}");
            }
            self.sample = ((f * num_clients as f64).floor() as usize).max(1);
        }
        Ok(())
    }

    /// The output directory.
    pub fn out_dir(&self) -> PathBuf {
        self.out.clone().unwrap_or_else(|| {
            PathBuf::from("runs").join(format!(
                "{}-{}-{}-s{}",
                self.algorithm, self.dataset, self.model, self.seed
            ))
        })
    }

    /// The dataset kind.
    pub fn dataset_kind(&self) -> anyhow::Result<DatasetKind> {
        Ok(self.dataset.parse()?)
    }

    /// The model kind.
    pub fn model_kind(&self) -> anyhow::Result<ModelKind> {
        Ok(self.model.parse()?)
    }

    /// The partition scheme.
    pub fn partition_scheme(&self) -> anyhow::Result<PartitionScheme> {
        let alpha = || {
            if !(self.alpha.is_finite() && self.alpha > 0.0) {
                bail!("--alpha must be a positive number, got {}", self.alpha);
            }
            Ok(self.alpha)
        };
        match self.partition.as_str() {
            "iid" => Ok(PartitionScheme::Iid),
            "dirichlet" => Ok(PartitionScheme::Dirichlet {
                alpha: alpha()?,
                min_size: self.min_client_size,
            }),
            "dirichlet-balanced" => Ok(PartitionScheme::BalancedDirichlet { alpha: alpha()? }),
            "pathological" => Ok(PartitionScheme::Pathological {
                classes_per_client: self.classes_per_client,
            }),
            "natural" => bail!("the natural partition is not drawn; it comes with the dataset"),
            other => {
                bail!(
                    "unknown partition '{other}' (known: iid, dirichlet, dirichlet-balanced, \
                     pathological, natural)"
                )
            }
        }
    }

    /// FedMR's recombination unit.
    pub fn granularity(&self) -> anyhow::Result<fl_core::Granularity> {
        use fl_core::Granularity;
        Ok(match self.granularity.as_str() {
            "tensor" => Granularity::Tensor,
            "layer" => Granularity::Layer,
            "block" => Granularity::Block,
            "segments" => {
                let fraction = self.segment_fraction;
                if !(fraction > 0.0 && fraction <= 1.0) {
                    bail!("--segment-fraction must be in (0, 1], got {fraction}");
                }
                Granularity::Segments { fraction }
            }
            other => bail!("unknown granularity '{other}' (known: tensor, layer, block, segments)"),
        })
    }

    /// FedCross's settings, checked.
    pub fn fedcross(&self) -> anyhow::Result<FedCrossConfig> {
        let config = FedCrossConfig {
            alpha: self.cross_alpha,
            selection: self.select.parse().map_err(anyhow::Error::msg)?,
            similarity: self.similarity.parse().map_err(anyhow::Error::msg)?,
            first_stage: self.first_stage,
            propeller_rounds: self.propellers,
            dynamic_alpha: self
                .dynamic_alpha
                .as_deref()
                .map(str::parse)
                .transpose()
                .map_err(anyhow::Error::msg)?,
            trainable_only: self.trainable_only,
        };
        config
            .validate()
            .map_err(|e| anyhow::anyhow!("--cross-alpha / --dynamic-alpha: {e}"))?;
        Ok(config)
    }

    /// FedMR's settings, checked.
    pub fn fedmr(&self) -> anyhow::Result<FedMrConfig> {
        if self.secure && self.secure_passes == 0 {
            bail!("--secure-passes must be at least 1");
        }
        Ok(FedMrConfig {
            granularity: self.granularity()?,
            first_stage: self.first_stage,
            secure: self.secure.then_some(SecureExchange {
                passes: self.secure_passes,
            }),
        })
    }

    /// The engine settings.
    pub fn engine(&self) -> EngineConfig {
        EngineConfig {
            sample: self.sample,
            rounds: self.rounds,
            eval_every: self.eval_every,
            seed: self.seed,
            threads: self.threads,
            eval_batch_size: self.eval_batch_size,
            train: TrainConfig {
                local_epochs: self.local_epochs,
                batch_size: self.batch_size,
                lr: self.lr,
                momentum: self.momentum,
                weight_decay: self.weight_decay,
                optimizer: fl_core::trainer::LocalOptimizer::Sgd,
                sharpness: None,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_override_the_file_which_overrides_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("c.toml");
        std::fs::write(&file, "rounds = 7\nlr = 0.1\nalpha = 0.1\n").unwrap();
        let args = RunArgs {
            config: Some(file),
            lr: Some(0.05),
            ..Default::default()
        };
        let cfg = RunConfig::resolve("fedavg", &args).unwrap();
        assert_eq!(
            (cfg.rounds, cfg.lr, cfg.alpha, cfg.clients),
            (7, 0.05, 0.1, 100)
        );
        let text = toml::to_string(&cfg).unwrap();
        assert_eq!(toml::from_str::<RunConfig>(&text).unwrap(), cfg);
    }

    #[test]
    fn unknown_fields_and_bad_values_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("c.toml");
        std::fs::write(&file, "roudns = 7\n").unwrap();
        let e = format!("{:#}", RunConfig::from_file(&file).unwrap_err());
        assert!(e.contains("roudns"), "{e}");
        let cfg = RunConfig {
            alpha: 0.0,
            ..Default::default()
        };
        assert!(cfg.partition_scheme().is_err());
        let cfg = RunConfig {
            partition: "zipf".into(),
            ..Default::default()
        };
        assert!(cfg.partition_scheme().is_err());
    }

    #[test]
    fn every_shipped_config_parses_and_builds_its_strategy() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
        let mut count = 0;
        for dir in [root.clone(), root.join("paper")] {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                if path.extension().is_none_or(|e| e != "toml") {
                    continue;
                }
                let cfg = RunConfig::from_file(&path).unwrap();
                let name = path.display();
                if cfg.partition != "natural" {
                    cfg.partition_scheme().unwrap();
                }
                cfg.dataset_kind().unwrap();
                if let Some(club) = &cfg.pfedclub {
                    club.club.validate().unwrap();
                    assert!(crate::personal::VARIANTS.contains(&cfg.algorithm.as_str()));
                    count += 1;
                    continue;
                }
                cfg.model_kind().unwrap();
                match cfg.algorithm.as_str() {
                    "fedavg" | "fedindep" => {}
                    "fedmr" => drop(cfg.fedmr().unwrap()),
                    "fedcross" => drop(cfg.fedcross().unwrap()),
                    _ => assert!(cfg.baseline(Vec::new).is_ok(), "{name}"),
                }
                count += 1;
            }
        }
        assert!(count >= 70, "{count}");
    }
}
