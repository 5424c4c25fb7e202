//! `fl pfedclub`: personalised FL over heterogeneous model zoos, set up for the one engine
//! (the run itself goes through [`crate::run`] like every other algorithm's).

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use fl_core::rng::{Purpose, derive_seed};
use fl_core::strategy::pfedclub::cmsr::{Anchor, SearchRules};
use fl_core::strategy::pfedclub::{ClubConfig, Method, PFedClub, PublicData};
use fl_core::{ClientModels, Simulation};
use fl_data::{FederatedDataset, Partition, PersonalSplit};
use fl_models::{ModelZoo, ZooModel};

use crate::backend;
use crate::config::{RunArgs, RunConfig};
use crate::run::{prepare_out_dir, simulate, write_run_files};

/// The algorithm names a personalised run's `config.toml` may carry (one per [`Variant`]).
pub const VARIANTS: [&str; 4] = ["pfedclub", "pfedhr", "fedavg-per-arch", "local"];

/// Which server algorithm `fl pfedclub` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Variant {
    /// pFedClub: controllable search (order constraint, completion) and stitching.
    Pfedclub,
    /// pFedHR-style random reassembly (no order constraint, no completion, no size control).
    Pfedhr,
    /// FedAvg among the clients of each architecture.
    Fedavg,
    /// Local training only.
    Local,
}

/// Whether the server's public data has labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Public {
    /// Stitching layers are fine-tuned with cross-entropy.
    Labeled,
    /// Stitching layers are fine-tuned with NT-Xent on augmented views.
    Unlabeled,
}

/// The anchor rule, as a flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AnchorArg {
    /// At random from the group of the client's first block (the paper).
    Random,
    /// Most similar block of the other models (ablation).
    Max,
    /// Least similar block of the other models (ablation).
    Min,
}

/// pFedClub's own flags (the shared run flags set data, clients, rounds, local training).
#[derive(Debug, Clone, Args)]
pub struct ClubArgs {
    /// Model zoo: I (CNN1-4 + MobileNetV1-3), II (MobileNetV1-3), III (CNN1-4).
    #[arg(long, default_value = "III")]
    pub zoo: ModelZoo,
    /// Server algorithm.
    #[arg(long, value_enum, default_value = "pfedclub")]
    pub variant: Variant,
    /// Anchor rule (ablation).
    #[arg(long, value_enum, default_value = "random")]
    pub anchor: AnchorArg,
    /// Drop the order constraint (ablation).
    #[arg(long)]
    pub no_order: bool,
    /// Drop block completion (ablation).
    #[arg(long)]
    pub no_completion: bool,
    /// pFedClub+: keep only candidates with |w*| <= (1 + ETA)|w| (the paper used 0.1).
    #[arg(long, value_name = "ETA")]
    pub size_limit: Option<f64>,
    /// Number of functional groups K.
    #[arg(long, default_value_t = 4)]
    pub groups: usize,
    /// Candidates per client per round.
    #[arg(long, default_value_t = 4)]
    pub candidates: usize,
    /// λ, the weight of the distillation term.
    #[arg(long = "lambda", default_value_t = 0.2)]
    pub distill_weight: f64,
    /// Public data labeled (cross-entropy stitching) or unlabeled (NT-Xent, τ = 0.07).
    #[arg(long, value_enum, default_value = "labeled")]
    pub public: Public,
    /// Fraction of all samples held by the server as public data.
    #[arg(long, default_value_t = 0.08)]
    pub public_fraction: f64,
    /// Fraction of all samples that form the clients' test portions.
    #[arg(long, default_value_t = 0.2)]
    pub test_fraction: f64,
    /// Use only this many public samples for stitching and matching (default: all).
    #[arg(long, value_name = "N")]
    pub public_samples: Option<usize>,
    /// Public samples for CKA.
    #[arg(long, default_value_t = 256)]
    pub cka_samples: usize,
    /// Use a random subset of this many samples of the pooled data (for quick studies).
    #[arg(long, value_name = "N")]
    pub max_samples: Option<usize>,
    /// Epochs of stitching-layer fine-tuning.
    #[arg(long, default_value_t = 1)]
    pub stitch_epochs: usize,
}

impl ClubArgs {
    /// The server configuration these flags describe.
    pub fn club(&self) -> ClubConfig {
        let defaults = ClubConfig::default();
        let (method, rules) = match self.variant {
            Variant::Pfedclub => (Method::Reassembly, SearchRules::PFEDCLUB),
            Variant::Pfedhr => (Method::Reassembly, SearchRules::PFEDHR),
            Variant::Fedavg => (Method::FedavgPerArchitecture, SearchRules::PFEDCLUB),
            Variant::Local => (Method::Local, SearchRules::PFEDCLUB),
        };
        let mut rules = rules;
        rules.anchor = match self.anchor {
            AnchorArg::Random => Anchor::Random,
            AnchorArg::Max => Anchor::Max,
            AnchorArg::Min => Anchor::Min,
        };
        rules.ordered &= !self.no_order;
        rules.complete &= !self.no_completion;
        ClubConfig {
            method,
            rules,
            groups: self.groups,
            candidates: self.candidates,
            size_limit: self.size_limit,
            distill_weight: self.distill_weight,
            cka_samples: self.cka_samples,
            public_samples: self.public_samples,
            stitch: fl_core::strategy::pfedclub::stitch::StitchTraining {
                epochs: self.stitch_epochs,
                labeled: self.public == Public::Labeled,
                ..defaults.stitch
            },
        }
    }
}

/// pFedClub's settings in a run's `config.toml` (its `[pfedclub]` section): the server
/// algorithm, the model zoo, the server's settings and the pooled split.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClubSettings {
    /// The server algorithm.
    pub variant: Variant,
    /// The model zoo.
    pub zoo: ModelZoo,
    /// Fraction of all samples held by the server as public data.
    pub public_fraction: f64,
    /// Fraction of all samples that form the clients' test portions.
    pub test_fraction: f64,
    /// A random subset of this many pooled samples (quick studies).
    pub max_samples: Option<usize>,
    /// The server's settings.
    pub club: ClubConfig,
}

impl ClubArgs {
    /// The `[pfedclub]` section these flags describe.
    fn settings(&self) -> ClubSettings {
        ClubSettings {
            variant: self.variant,
            zoo: self.zoo,
            public_fraction: self.public_fraction,
            test_fraction: self.test_fraction,
            max_samples: self.max_samples,
            club: self.club(),
        }
    }
}

/// The algorithm name of a variant.
fn variant_name(v: Variant) -> &'static str {
    match v {
        Variant::Pfedclub => VARIANTS[0],
        Variant::Pfedhr => VARIANTS[1],
        Variant::Fedavg => VARIANTS[2],
        Variant::Local => VARIANTS[3],
    }
}

/// The shared flags with pFedClub's defaults where the user gave none: 50 clients, 5 per round,
/// 10 local epochs of Adam at lr 0.001, 2 classes per client.
fn with_paper_defaults(args: &RunArgs) -> RunArgs {
    let mut a = args.clone();
    if args.config.is_none() {
        a.clients.get_or_insert(50);
        a.sample.get_or_insert(5);
        a.local_epochs.get_or_insert(10);
        a.lr.get_or_insert(0.001);
        a.batch_size.get_or_insert(64);
        a.partition.get_or_insert_with(|| "pathological".into());
        a.classes_per_client.get_or_insert(2);
    }
    a
}

/// `fl pfedclub`: one run, or one per seed of `--seeds` (each into `OUT/sSEED`).
pub fn pfedclub(args: &RunArgs, flags: &ClubArgs) -> anyhow::Result<()> {
    let name = variant_name(flags.variant);
    let (cfg, resume) = if args.resume.is_some() {
        crate::run::resolve(name, args)?
    } else {
        let mut cfg = RunConfig::resolve(name, &with_paper_defaults(args))?;
        cfg.model = format!("zoo-{:?}", flags.zoo).to_lowercase();
        cfg.pfedclub = Some(flags.settings());
        if args.seeds.is_some() && cfg.out.is_none() {
            cfg.out =
                Some(std::path::Path::new("runs").join(
                    format!("pfedclub-{:?}-zoo-{:?}", flags.variant, flags.zoo).to_lowercase(),
                ));
        }
        (cfg, false)
    };
    crate::run::run(&cfg, resume, args, &no_strategy)
}

/// `fl run FILE` for a personalised config (it must have a `[pfedclub]` section).
pub fn from_file(algorithm: &str, args: &RunArgs) -> anyhow::Result<()> {
    let (cfg, resume) = crate::run::resolve(algorithm, args)?;
    if cfg.pfedclub.is_none() {
        bail!(
            "a '{}' config needs a [pfedclub] section (variant, zoo, fractions, server settings); see configs/pfedclub-zoo3-fmnist.toml",
            cfg.algorithm
        );
    }
    crate::run::run(&cfg, resume, args, &no_strategy)
}

/// Personalised strategies are built in [`run_one`], where the client models are known.
fn no_strategy(
    cfg: &RunConfig,
    _: &FederatedDataset,
    _: &Partition,
) -> anyhow::Result<Box<dyn fl_core::Strategy>> {
    bail!("{} is set up by its own client models", cfg.algorithm)
}

/// One personalised run on the engine (new, or continued with `resume`): pools the training
/// and test sets, splits them among clients and the server's public set (pFedClub's 72/20/8),
/// builds each client's zoo model and pFedClub's server.
pub fn run_one(
    cfg: &RunConfig,
    data: &FederatedDataset,
    resume: bool,
    quiet: bool,
) -> anyhow::Result<()> {
    let setup = cfg
        .pfedclub
        .as_ref()
        .context("a personalised run needs a [pfedclub] section")?;
    setup.club.validate().map_err(anyhow::Error::msg)?;
    let mut pooled = data.train.concat(&data.test)?;
    if let Some(max) = setup.max_samples {
        if max < 2 {
            bail!("--max-samples must be at least 2");
        }
        if max < pooled.len() {
            use rand::SeedableRng;
            use rand::seq::SliceRandom;
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(derive_seed(
                cfg.seed,
                Purpose::Partition,
                0,
                1,
            ));
            let mut keep: Vec<usize> = (0..pooled.len()).collect();
            keep.shuffle(&mut rng);
            keep.truncate(max);
            keep.sort_unstable();
            pooled = pooled.subset(&keep);
        }
    }
    let split = PersonalSplit::new(
        &cfg.partition_scheme()?,
        pooled.labels(),
        pooled.num_classes(),
        cfg.clients,
        setup.public_fraction,
        setup.test_fraction,
        cfg.seed,
    )?;
    let kinds = setup.zoo.assign(cfg.clients);
    // The engine trains on the clients' training portions and evaluates each client on its
    // own test portion, both indices into the pooled samples.
    let personal = FederatedDataset {
        train: pooled.clone(),
        test: pooled.clone(),
        natural_clients: None,
        ..data.clone()
    };
    let partition = Partition {
        clients: split.train.clone(),
    };
    let out = prepare_out_dir(cfg, resume)?;
    if !resume {
        let mut extra = serde_json::Map::new();
        extra.insert("pooled_samples".into(), pooled.len().into());
        extra.insert(
            "architectures".into(),
            kinds.iter().map(|k| k.name()).collect::<Vec<_>>().into(),
        );
        write_run_files(cfg, &out, &personal, &partition, extra)?;
        let path = out.join("split.json");
        std::fs::write(&path, serde_json::to_string(&split).expect("json"))
            .with_context(|| format!("cannot write {}", path.display()))?;
    }

    let ad = backend::device().autodiff();
    let (shape, classes) = (pooled.image_shape(), pooled.num_classes());
    let build = |client: usize| {
        ZooModel::new(kinds[client], shape, classes, &ad).expect("zoo architectures only")
    };
    let mut strategy = PFedClub::new(
        setup.club.clone(),
        &build,
        PublicData {
            data: &pooled,
            normalization: &data.normalization,
            samples: &split.public,
        },
        cfg.clients,
        cfg.seed,
        cfg.eval_batch_size,
    )?;
    let mut engine = cfg.engine();
    engine.train.optimizer = fl_core::trainer::LocalOptimizer::Adam;
    let sim = Simulation {
        model: build(0),
        data: &personal,
        partition: &partition,
        config: engine,
        out_dir: Some(out),
        objective: None,
        clients: Some(ClientModels {
            build: &build,
            tests: &split.test,
        }),
    };
    simulate(&sim, cfg, resume, quiet, &mut strategy)
}
