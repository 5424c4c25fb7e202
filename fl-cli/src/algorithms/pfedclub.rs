//! pFedClub's settings, and its run set-up: the pooled split, the clients' zoo models and the
//! server (the run itself goes through the engine like every other algorithm's).

use anyhow::bail;
use clap::{Args, ValueEnum};
use fl_core::strategy::fccl::FcclConfig;
use fl_core::strategy::fedgh::FedGhConfig;
use fl_core::strategy::fedkemf::FedKemfConfig;
use fl_core::strategy::fedmd::FedMdConfig;
use fl_core::strategy::flexifed::CommonRule;
use fl_core::strategy::pfedclub::cmsr::{Anchor, SearchRules};
use fl_core::strategy::pfedclub::stitch::StitchTraining;
use fl_core::strategy::pfedclub::{ClubConfig, Method, PFedClub, PublicData};
use fl_core::strategy::pfedhr::PfedhrConfig;
use fl_core::{ClientModels, Simulation, Strategy};
use fl_data::FederatedDataset;
use fl_models::{ModelKind, ModelZoo, ZooModel};
use serde::{Deserialize, Serialize};

use super::{LabelCounts, Settings, defaults_from_flags, parse_name};
use crate::backend;
use crate::config::{RunConfig, RunSettings};
use crate::personal::{PersonalData, personal_data, write_split};
use crate::run::simulate;
use crate::rundir::{RunDir, write_run_files};

/// Which server algorithm a pFedClub run uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Variant {
    /// pFedClub: controllable search (order constraint, completion) and stitching.
    Pfedclub,
    /// pFedHR as published: layer-level disassembly, functional grouping, one shared pool of
    /// candidates by the authors' rules, whole-candidate tuning on the public data, matching.
    Pfedhr,
    /// pFedClub's search without its rules (no order constraint, no completion): the
    /// pFedHR-style ablation (`--variant pfedhr` before pFedHR itself existed).
    ClubNoRules,
    /// FedAvg among the clients of each architecture.
    Fedavg,
    /// Local training only.
    Local,
    /// FlexiFed Basic-Common: the layers common to every architecture averaged over all.
    FlexifedBasic,
    /// FlexiFed Clustered-Common: whole models averaged within each architecture.
    FlexifedClustered,
    /// FlexiFed Max-Common: each layer averaged over every client sharing the prefix up to it.
    FlexifedMax,
    /// FedMD: transfer learning on the labeled public set, then consensus distillation of the
    /// clients' scores on it every round.
    Fedmd,
    /// FedGH: one global header over the clients' own feature extractors, trained on their
    /// per-class mean representations.
    Fedgh,
    /// HeteroFL: width-scaled sub-models of one architecture (`--model cnn1..cnn4`,
    /// `--rates`), every parameter averaged over the clients holding it.
    Heterofl,
    /// FCCL: cross-correlation learning on the (unlabeled) public set, then private training
    /// with non-forgetting distillation.
    Fccl,
    /// FedKEMF: a shared knowledge network learned mutually with each client's model, fused on
    /// the server by ensemble distillation on the (unlabeled) public set.
    Fedkemf,
}

impl Variant {
    /// The variant's name in run directories and summaries.
    pub fn label(self) -> &'static str {
        match self {
            Self::Pfedclub => "pfedclub",
            Self::Pfedhr => "pfedhr",
            Self::ClubNoRules => "club-no-rules",
            Self::Fedavg => "fedavg-per-arch",
            Self::Local => "local",
            Self::FlexifedBasic => "flexifed-basic",
            Self::FlexifedClustered => "flexifed-clustered",
            Self::FlexifedMax => "flexifed-max",
            Self::Fedmd => "fedmd",
            Self::Fedgh => "fedgh",
            Self::Heterofl => "heterofl",
            Self::Fccl => "fccl",
            Self::Fedkemf => "fedkemf",
        }
    }
}

/// Whether the server's public data has labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Public {
    /// Stitching layers are fine-tuned with cross-entropy.
    Labeled,
    /// Stitching layers are fine-tuned with NT-Xent on augmented views.
    Unlabeled,
}

/// pFedClub's settings (its `[pfedclub]` section); the shared run settings set the data,
/// clients, rounds and local training, and `model`: `zoo` (the default: `--zoo`'s mix of
/// architectures) or one zoo architecture for every client (the homogeneous setting).
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PfedclubSettings {
    /// Model zoo: I (CNN1-4 + MobileNetV1-3), II (MobileNetV1-3), III (CNN1-4).
    #[arg(long, default_value = "III")]
    pub zoo: ModelZoo,
    /// Server algorithm.
    #[arg(long, value_enum, default_value = "pfedclub")]
    pub variant: Variant,
    /// Anchor rule: random (the paper), min (the smallest block index, Table 3's ablation),
    /// most-similar or least-similar (extra ablations).
    #[arg(long, value_parser = parse_name::<Anchor>, default_value = "random")]
    pub anchor: Anchor,
    /// Drop the order constraint (ablation).
    #[arg(long)]
    pub no_order: bool,
    /// Drop block completion (ablation).
    #[arg(long)]
    pub no_completion: bool,
    /// pFedClub+: keep only candidates with |w*| <= (1 + ETA)|w|, ETA > -1 (the paper used 0.1;
    /// -0.2: teachers at least 20% smaller).
    #[arg(long, value_name = "ETA", allow_negative_numbers = true)]
    pub size_limit: Option<f64>,
    /// Number of functional groups K.
    #[arg(long, default_value_t = 4)]
    pub groups: usize,
    /// Candidates per client per round (pFedHR: in the round's one shared pool).
    #[arg(long, default_value_t = 4)]
    pub candidates: usize,
    /// pFedHR: fewest layers in a candidate (the authors' 4).
    #[arg(long, default_value_t = 4)]
    pub min_layers: usize,
    /// pFedHR: most layers in a candidate (the authors' 6).
    #[arg(long, default_value_t = 6)]
    pub max_layers: usize,
    /// pFedHR: also tune a copy of each client's model on the public data before matching, as
    /// the authors' code does (the paper matches the uploaded model).
    #[arg(long)]
    pub authors_tune_own: bool,
    /// λ, the weight of the distillation term.
    #[arg(long = "lambda", default_value_t = 0.2)]
    pub distill_weight: f64,
    /// Public data labeled (cross-entropy stitching) or unlabeled (NT-Xent, τ = 0.07).
    #[arg(long, value_enum, default_value = "labeled")]
    pub public: Public,
    /// Use only this many public samples for stitching and matching (default: all).
    #[arg(long, value_name = "N")]
    pub public_samples: Option<usize>,
    /// Public samples for CKA.
    #[arg(long, default_value_t = 256)]
    pub cka_samples: usize,
    /// Epochs of stitching-layer fine-tuning (paper §4.1: 3).
    #[arg(long, default_value_t = 3)]
    pub stitch_epochs: usize,
    /// FedMD and FCCL: public samples drawn per round for the consensus (the authors' 5000).
    #[arg(long, default_value_t = 5000)]
    pub alignment: usize,
    /// FedMD: epochs of the digest (training the scores towards the consensus).
    #[arg(long, default_value_t = 1)]
    pub digest_epochs: usize,
    /// FedMD: batch size of the digest.
    #[arg(long, default_value_t = 256)]
    pub digest_batch: usize,
    /// FedMD: epochs of transfer learning on the labeled public set in a client's first
    /// round (0: none).
    #[arg(long, default_value_t = 5)]
    pub transfer_epochs: usize,
    /// FedMD: batch size of transfer learning.
    #[arg(long, default_value_t = 128)]
    pub transfer_batch: usize,
    /// FedMD: Adam's learning rate on the public set.
    #[arg(long, default_value_t = 1e-3)]
    pub fedmd_lr: f64,
    /// Width of CNN1-CNN4's last hidden layer, the representation their head reads (FedGH's
    /// shared header needs one width; default for --variant fedgh: 512, CNN1/CNN2's own).
    #[arg(long, value_name = "D")]
    pub representation: Option<usize>,
    /// FedGH: passes of the server over the round's prototypes.
    #[arg(long, default_value_t = 1)]
    pub header_epochs: usize,
    /// FedGH: SGD step size of the server's header training.
    #[arg(long, default_value_t = 0.01)]
    pub header_lr: f64,
    /// HeteroFL: the width rates of the clients' sub-models, given to equal contiguous shares
    /// of the clients (the paper's levels a-e: 1, 1/2, 1/4, 1/8, 1/16).
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "R,...",
        default_value = "1,0.5,0.25,0.125,0.0625"
    )]
    pub rates: Vec<f64>,
    /// FCCL: passes of the collaborative update over the round's public draw (--alignment).
    #[arg(long, default_value_t = 1)]
    pub col_epochs: usize,
    /// FCCL: batch size of the collaborative update.
    #[arg(long, default_value_t = 256)]
    pub col_batch: usize,
    /// FCCL: Adam's step size in the collaborative update.
    #[arg(long, default_value_t = 1e-3)]
    pub col_lr: f64,
    /// FCCL: λ, the weight of the off-diagonal cross-correlations.
    #[arg(long, default_value_t = 0.0051)]
    pub off_diagonal: f64,
    /// FCCL: push off-diagonal correlations towards -1 as the authors' code does (the paper: 0).
    #[arg(long)]
    pub authors_off_diagonal: bool,
    /// FedKEMF: the knowledge network's architecture (a zoo model, small: it is what travels).
    #[arg(long, value_parser = parse_name::<ModelKind>, default_value = "cnn1")]
    pub knowledge_net: ModelKind,
    /// FedKEMF: passes of the server's ensemble distillation over the public set (0: average).
    #[arg(long, default_value_t = 1)]
    pub fusion_epochs: usize,
    /// FedKEMF: batch size of the ensemble distillation.
    #[arg(long, default_value_t = 64)]
    pub fusion_batch: usize,
    /// FedKEMF: Adam's step size in the ensemble distillation.
    #[arg(long, default_value_t = 1e-3)]
    pub fusion_lr: f64,
}

defaults_from_flags!(PfedclubSettings);

impl PfedclubSettings {
    /// The server configuration these settings describe.
    pub fn club(&self) -> ClubConfig {
        let defaults = ClubConfig::default();
        let (method, mut rules) = match self.variant {
            Variant::Pfedclub => (Method::Reassembly, SearchRules::PFEDCLUB),
            Variant::Pfedhr => (Method::Pfedhr, SearchRules::PFEDCLUB),
            Variant::ClubNoRules => (Method::Reassembly, SearchRules::NO_RULES),
            Variant::Fedavg => (Method::FedavgPerArchitecture, SearchRules::PFEDCLUB),
            Variant::Local => (Method::Local, SearchRules::PFEDCLUB),
            Variant::FlexifedBasic => (Method::Flexifed(CommonRule::Basic), SearchRules::PFEDCLUB),
            Variant::FlexifedClustered => (
                Method::Flexifed(CommonRule::Clustered),
                SearchRules::PFEDCLUB,
            ),
            Variant::FlexifedMax => (Method::Flexifed(CommonRule::Max), SearchRules::PFEDCLUB),
            Variant::Fedmd => (Method::FedMd, SearchRules::PFEDCLUB),
            Variant::Fedgh => (Method::FedGh, SearchRules::PFEDCLUB),
            Variant::Heterofl => (Method::HeteroFl, SearchRules::PFEDCLUB),
            Variant::Fccl => (Method::Fccl, SearchRules::PFEDCLUB),
            Variant::Fedkemf => (Method::FedKemf, SearchRules::PFEDCLUB),
        };
        rules.anchor = self.anchor;
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
            stitch: StitchTraining {
                epochs: self.stitch_epochs,
                labeled: self.public == Public::Labeled,
                ..defaults.stitch
            },
            fedmd: FedMdConfig {
                alignment: self.alignment,
                digest_epochs: self.digest_epochs,
                digest_batch: self.digest_batch,
                transfer_epochs: self.transfer_epochs,
                transfer_batch: self.transfer_batch,
                lr: self.fedmd_lr,
            },
            fedgh: FedGhConfig {
                server_epochs: self.header_epochs,
                server_lr: self.header_lr,
            },
            fccl: FcclConfig {
                alignment: self.alignment,
                epochs: self.col_epochs,
                batch: self.col_batch,
                lr: self.col_lr,
                off_diagonal: self.off_diagonal,
                authors_off_diagonal: self.authors_off_diagonal,
            },
            fedkemf: FedKemfConfig {
                fusion_epochs: self.fusion_epochs,
                fusion_batch: self.fusion_batch,
                fusion_lr: self.fusion_lr,
                ..FedKemfConfig::default()
            },
            pfedhr: PfedhrConfig {
                min_layers: self.min_layers,
                max_layers: self.max_layers,
                tune_own: self.authors_tune_own,
                ..PfedhrConfig::default()
            },
        }
    }
}

impl PfedclubSettings {
    /// The zoo's name as a run's `model` (`zoo-iii`).
    fn zoo_name(&self) -> String {
        format!("zoo-{:?}", self.zoo).to_lowercase()
    }

    /// The representation width CNN1-CNN4 are built with (`None`: their own).
    pub fn representation(&self) -> Option<usize> {
        self.representation
            .or((self.variant == Variant::Fedgh).then_some(512))
    }

    /// Each client's width rate (HeteroFL; 1 otherwise): `--rates` in equal contiguous shares.
    pub fn rate_of(&self, client: usize, clients: usize) -> f64 {
        if self.variant != Variant::Heterofl || self.rates.is_empty() {
            return 1.0;
        }
        self.rates[client * self.rates.len() / clients.max(1)]
    }

    /// Every client's architecture (checked against `--representation` and HeteroFL's needs).
    pub fn architectures(&self, run: &RunSettings) -> anyhow::Result<Vec<ModelKind>> {
        let kinds = self.zoo_architectures(run)?;
        if self.variant == Variant::Fedkemf
            && !ModelZoo::I
                .members()
                .iter()
                .any(|&(k, _)| k == self.knowledge_net)
        {
            bail!(
                "--knowledge-net must be a zoo architecture (cnn1-cnn4, mobilenet-v1/v2/v3), not {}",
                self.knowledge_net.name()
            );
        }
        if self.variant == Variant::Heterofl {
            if !kinds
                .iter()
                .all(|k| *k == kinds[0] && k.name().starts_with("cnn"))
            {
                bail!(
                    "HeteroFL scales one architecture: give --model cnn1, cnn2, cnn3 or cnn4 (not --model {})",
                    run.model
                );
            }
            if self.rates.is_empty() || self.rates.iter().any(|r| !(*r > 0.0 && *r <= 1.0)) {
                bail!("--rates must be width rates in (0, 1], e.g. 1,0.5,0.25");
            }
            if self.representation.is_some() {
                bail!("--representation does not combine with HeteroFL's width rates");
            }
        }
        if let Some(width) = self.representation() {
            if width == 0 {
                bail!("--representation must be at least 1");
            }
            if let Some(&k) = kinds.iter().find(|k| !k.name().starts_with("cnn")) {
                bail!(
                    "{}; FedGH and --representation need zoo III or one of cnn1-cnn4",
                    fl_models::FixedRepresentation(k)
                );
            }
        }
        Ok(kinds)
    }

    /// Every client's architecture: the zoo's mix (`model = "zoo"` or the zoo's name), or one
    /// architecture for all (`--model cnn2`: the paper's homogeneous setting, Table 2).
    fn zoo_architectures(&self, run: &RunSettings) -> anyhow::Result<Vec<ModelKind>> {
        if run.model.starts_with("zoo") {
            if run.model != self.zoo_name() {
                bail!(
                    "--model {} contradicts --zoo {:?} (give --model zoo, or one zoo architecture for every client)",
                    run.model,
                    self.zoo
                );
            }
            return Ok(self.zoo.assign(run.clients));
        }
        let kind = run.model_kind()?;
        if !ModelZoo::I.members().iter().any(|&(k, _)| k == kind) {
            bail!(
                "pFedClub's clients need zoo architectures (cnn1-cnn4, mobilenet-v1/v2/v3), not --model {}",
                run.model
            );
        }
        Ok(vec![kind; run.clients])
    }
}

impl Settings for PfedclubSettings {
    fn settle(&mut self, run: &mut RunSettings) {
        if run.model == "zoo" {
            run.model = self.zoo_name();
        }
    }

    /// The paper's setting: 50 clients, 5 per round, 10 local epochs of Adam at lr 0.001,
    /// batch 64, 2 classes per client.
    fn run_defaults(&self) -> toml::Table {
        toml::toml! {
            model = "zoo"
            clients = 50
            sample = 5
            local_epochs = 10
            lr = 0.001
            batch_size = 64
            partition = "pathological"
            classes_per_client = 2
        }
    }

    fn strategy(&self, _: &RunSettings, _: LabelCounts<'_>) -> anyhow::Result<Box<dyn Strategy>> {
        bail!("pfedclub is set up with its clients' models (see run_one)")
    }

    fn check(&self, run: &RunSettings) -> anyhow::Result<()> {
        self.architectures(run)?;
        crate::personal::check(run)?;
        self.club().validate().map_err(anyhow::Error::msg)
    }
}

/// One pFedClub run on the engine (new, or continued with `resume`): pools the training and
/// test sets, splits them among clients and the server's public set (pFedClub's 72/20/8),
/// builds each client's zoo model and pFedClub's server.
pub fn run_one(
    cfg: &RunConfig,
    setup: &PfedclubSettings,
    data: &FederatedDataset,
    resume: bool,
    quiet: bool,
) -> anyhow::Result<()> {
    let run = &cfg.run;
    let PersonalData {
        pooled,
        split,
        data: personal,
        partition,
    } = personal_data(run, data)?;
    let kinds = setup.architectures(run)?;
    // On unless turned off: the zoos' MobileNets train side by side (README "Speed").
    let ad = backend::training_device(run.gradient_checkpointing.unwrap_or(true));
    let (shape, classes) = (pooled.image_shape(), pooled.num_classes());
    let knowledge = (setup.variant == Variant::Fedkemf).then_some(setup.knowledge_net);
    for kind in kinds.iter().copied().chain(knowledge) {
        kind.check_input(shape)?;
    }
    let width = setup.representation();
    let heterofl = setup.variant == Variant::Heterofl;
    let knowledge_net = setup.knowledge_net;
    let build = |client: usize| match width {
        // FedKEMF's knowledge network is the extra architecture after the clients'.
        _ if client >= kinds.len() => {
            ZooModel::new(knowledge_net, shape, classes, &ad).expect("checked by architectures()")
        }
        Some(w) => ZooModel::with_representation(kinds[client], shape, classes, w, &ad)
            .expect("checked by architectures()"),
        None if heterofl => {
            let rate = setup.rate_of(client, kinds.len());
            ZooModel::scaled(kinds[client], shape, classes, rate, &ad)
                .expect("checked by architectures()")
        }
        None => ZooModel::new(kinds[client], shape, classes, &ad).expect("zoo architectures only"),
    };
    let client_classes = partition
        .clients
        .iter()
        .map(|own| pooled.classes_of(own))
        .collect();
    let mut strategy = PFedClub::new(
        setup.club(),
        &build,
        PublicData {
            data: &pooled,
            normalization: &data.normalization,
            samples: &split.public,
        },
        run.clients,
        run.seed,
        run.eval_batch_size,
    )?
    .with_client_classes(client_classes);
    let dir = RunDir::open(cfg, resume, &partition, personal.train.len())?;
    let out = dir.path.clone();
    if !resume {
        let mut extra = serde_json::Map::new();
        extra.insert("pooled_samples".into(), pooled.len().into());
        extra.insert(
            "architectures".into(),
            kinds.iter().map(|k| k.name()).collect::<Vec<_>>().into(),
        );
        if heterofl {
            let rates: Vec<f64> = (0..kinds.len())
                .map(|c| setup.rate_of(c, kinds.len()))
                .collect();
            extra.insert("rates".into(), rates.into());
        }
        write_run_files(cfg, &out, &personal, &partition, extra)?;
        write_split(&out, &split)?;
    }

    let mut engine = run.engine();
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
            fine_tune: None,
        }),
        stop: Some(crate::interrupt::flag()),
    };
    simulate(&sim, cfg, resume, quiet, &mut strategy)
}
