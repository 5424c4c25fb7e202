//! `fl pfedclub`: personalised FL over heterogeneous model zoos.

use std::io::IsTerminal;

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use fl_core::RoundMetrics;
use fl_core::rng::{Purpose, derive_seed};
use fl_core::strategy::pfedclub::cmsr::{Anchor, SearchRules};
use fl_core::strategy::pfedclub::{ClubConfig, Method, PersonalData, PersonalSimulation};
use fl_data::{PersonalSplit, load_dataset};
use fl_models::{ModelZoo, ZooModel};

use crate::backend;
use crate::config::{RunArgs, RunConfig};

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

/// Everything about a personalised run that is not in `config.toml` (saved as `setup.json`,
/// read back by `--resume`).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Setup {
    variant: Variant,
    zoo: ModelZoo,
    club: ClubConfig,
    public_fraction: f64,
    test_fraction: f64,
    max_samples: Option<usize>,
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

/// `fl pfedclub`: one run, or one per seed of `--seeds` (each into `OUT/sSEED`, so `fl plot`
/// and `fl compare` summarise OUT as mean ± std).
pub fn pfedclub(args: &RunArgs, flags: &ClubArgs) -> anyhow::Result<()> {
    let Some(seeds) = &args.seeds else {
        return run_one(args, flags);
    };
    let base = match &args.out {
        Some(out) => out.clone(),
        None => std::path::Path::new("runs")
            .join(format!("pfedclub-{:?}-zoo-{:?}", flags.variant, flags.zoo).to_lowercase()),
    };
    for &seed in seeds {
        let one = RunArgs {
            seed: Some(seed),
            seeds: None,
            out: Some(base.join(format!("s{seed}"))),
            ..args.clone()
        };
        run_one(&one, flags)?;
    }
    Ok(())
}

/// One personalised run (new, or continued with `--resume`).
fn run_one(args: &RunArgs, flags: &ClubArgs) -> anyhow::Result<()> {
    let read = |dir: &std::path::Path, name: &str| {
        let path = dir.join(name);
        std::fs::read_to_string(&path)
            .with_context(|| format!("{} is not a pfedclub run directory", dir.display()))
    };
    let (cfg, setup) = if let Some(dir) = &args.resume {
        let mut cfg: RunConfig = toml::from_str(&read(dir, "config.toml")?)
            .with_context(|| format!("invalid {}", dir.join("config.toml").display()))?;
        let setup: Setup = serde_json::from_str(&read(dir, "setup.json")?)
            .with_context(|| format!("invalid {}", dir.join("setup.json").display()))?;
        if let Some(rounds) = args.rounds {
            cfg.rounds = rounds;
        }
        cfg.out = Some(dir.clone());
        (cfg, setup)
    } else {
        let mut cfg = RunConfig::resolve("pfedclub", &with_paper_defaults(args))?;
        cfg.algorithm = match flags.variant {
            Variant::Pfedclub => "pfedclub",
            Variant::Pfedhr => "pfedhr",
            Variant::Fedavg => "fedavg-per-arch",
            Variant::Local => "local",
        }
        .into();
        cfg.model = format!("zoo-{:?}", flags.zoo).to_lowercase();
        let setup = Setup {
            variant: flags.variant,
            zoo: flags.zoo,
            club: flags.club(),
            public_fraction: flags.public_fraction,
            test_fraction: flags.test_fraction,
            max_samples: flags.max_samples,
        };
        (cfg, setup)
    };
    let resume = args.resume.is_some();
    let club = setup.club.clone();
    club.validate().map_err(anyhow::Error::msg)?;

    let data = load_dataset(cfg.dataset_kind()?, cfg.data_dir.as_deref())?;
    // pFedClub splits all samples (training and test sets pooled) 72/20/8.
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
    let out = cfg.out_dir();
    std::fs::create_dir_all(&out).with_context(|| format!("cannot create {}", out.display()))?;
    if !resume && out.join(fl_core::engine::files::METRICS).exists() {
        bail!(
            "{} already holds a run; continue it with --resume {} or choose another --out",
            out.display(),
            out.display()
        );
    }
    if !resume {
        let write = |name: &str, text: String| {
            let path = out.join(name);
            std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))
        };
        write(
            "config.toml",
            toml::to_string(&cfg).context("serialising the config")?,
        )?;
        write(
            "setup.json",
            serde_json::to_string_pretty(&setup).expect("json"),
        )?;
        let manifest = serde_json::json!({
            "fl_version": env!("CARGO_PKG_VERSION"),
            "git_hash": option_env!("FL_GIT_HASH").unwrap_or("unknown"),
            "backend": backend::name(),
            "seed": cfg.seed,
            "dataset": data.name,
            "dataset_origin": data.origin,
            "pooled_samples": pooled.len(),
            "architectures": kinds.iter().map(|k| k.name()).collect::<Vec<_>>(),
            "command": std::env::args().collect::<Vec<_>>(),
        });
        write(
            "manifest.json",
            serde_json::to_string_pretty(&manifest).expect("json"),
        )?;
        write("split.json", serde_json::to_string(&split).expect("json"))?;
    }

    let device = backend::device();
    eprintln!("backend: {} ({:?})", backend::name(), device);
    let ad = device.autodiff();
    let (shape, classes) = (pooled.image_shape(), pooled.num_classes());
    let make_model = |client: usize| {
        ZooModel::new(kinds[client], shape, classes, &ad).expect("zoo architectures only")
    };
    let mut engine = cfg.engine();
    engine.train.optimizer = fl_core::trainer::LocalOptimizer::Adam;
    let sim = PersonalSimulation {
        make_model: &make_model,
        data: PersonalData {
            data: &pooled,
            normalization: &data.normalization,
            split: &split,
        },
        config: engine,
        club,
        out_dir: Some(out.clone()),
    };
    let quiet = args.quiet || !std::io::stdout().is_terminal();
    let bar = crate::run::round_bar(cfg.rounds, quiet);
    let mut on_round = |m: &RoundMetrics| {
        bar.set_position(m.round as u64);
        if let Some(acc) = m.test_acc {
            bar.set_message(format!("mean client acc {:.2}%", 100.0 * acc));
        }
        tracing::info!(round = m.round, test_acc = ?m.test_acc, "round done");
    };
    let summary = sim.run(resume, &mut on_round)?;
    bar.finish_and_clear();
    if !quiet && let Some(last) = summary.rounds.iter().rev().find_map(|m| m.test_acc) {
        println!(
            "{}: mean client accuracy {:.2}% after {} rounds; results in {}",
            cfg.algorithm,
            100.0 * last,
            cfg.rounds,
            out.display()
        );
    }
    Ok(())
}
