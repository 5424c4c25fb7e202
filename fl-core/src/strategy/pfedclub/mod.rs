//! pFedClub (Wang et al., NeurIPS 2024): personalised FL over clients that own *different*
//! architectures, by controllable block substitution.
//!
//! Every client keeps its own model across rounds. Each round the sampled clients train their
//! model (cross-entropy plus λ·KL towards the teacher the server last made for them) and upload
//! it; the server then, for each uploaded model,
//! 1. splits all uploaded models into their declared blocks,
//! 2. groups the blocks by function: similarity = CKA(inputs) + CKA(outputs) on public data,
//!    K-means on the similarity rows ([`grouping`]),
//! 3. draws candidate models by controllable search and reassembly ([`cmsr`]),
//! 4. joins each candidate's blocks with stitching layers and fine-tunes only those on the
//!    public data ([`stitch`]),
//! 5. keeps the candidate whose logits agree best (mean cosine) with the client's own model as
//!    the client's next teacher. pFedClub+ (`size_limit = η`) only admits candidates with
//!    |w*| ≤ (1 + η)|w|; φ = (|w*| − |w|)/|w| is reported per client (the paper's Eq. 6).
//!
//! The same strategy runs the paper's comparisons: pFedHR ([`Method::Pfedhr`]), the ablations
//! (anchor, order, completion: [`SearchRules`]), the Table 1 baselines, FedAvg within each
//! architecture, and local training alone. It runs on the one engine
//! ([`Simulation`](crate::Simulation) with [`ClientModels`](crate::engine::ClientModels)):
//! the server keeps every client's model, and [`Strategy::evaluate`] reports the mean accuracy
//! of the clients' own models on their own test portions.

pub mod cmsr;
pub mod grouping;
mod pfedhr_round;
mod reassemble;
mod state;
pub mod stitch;

use crate::strategy::{Result, ServerRound};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use fl_data::{Dataset, Normalization};

use super::{
    ClientInstruction, Evaluation, Evaluator, Metrics, RoundContext, RoundPlan, Strategy,
    StrategyError, StrategyState,
};
use crate::layers::{BlockSpec, ParamKind, ParamTable};
use crate::model::BlockForward;
use crate::rng::{Purpose, derive_seed};
use crate::strategy::fccl::{self, FcclConfig};
use crate::strategy::fedgh::{self, FedGhConfig};
use crate::strategy::fedkemf::{self, FedKemfConfig};
use crate::strategy::fedmd::{self, FedMdConfig};
use crate::strategy::heterofl;
use crate::strategy::pfedhr::PfedhrConfig;
use crate::trainer::{LocalObjective, LocalProcedure, LocalUpdate};
use cmsr::SearchRules;
use stitch::{StitchTraining, Teacher};

/// What the server does with the uploaded models.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Method {
    /// Block substitution with teachers (pFedClub, or its ablations by [`SearchRules`]).
    Reassembly,
    /// pFedHR as published: layer-level reassembly of one shared candidate pool
    /// ([`pfedhr`](crate::strategy::pfedhr), settings in [`ClubConfig::pfedhr`]).
    Pfedhr,
    /// FedAvg among the clients of each architecture (a homogeneous baseline per group).
    FedavgPerArchitecture,
    /// No collaboration: every client trains alone.
    Local,
    /// FlexiFed's layer sharing among architectures of one family
    /// ([`flexifed`](crate::strategy::flexifed)).
    Flexifed(crate::strategy::flexifed::CommonRule),
    /// FedMD's consensus distillation on the public data ([`fedmd`],
    /// settings in [`ClubConfig::fedmd`]).
    FedMd,
    /// FedGH's shared header trained on the clients' prototypes
    /// ([`fedgh`], settings in [`ClubConfig::fedgh`]).
    FedGh,
    /// HeteroFL's width-scaled sub-models of one global model
    /// ([`heterofl`]).
    HeteroFl,
    /// FCCL's cross-correlation learning on unlabeled public data with non-forgetting
    /// distillation ([`fccl`], settings in [`ClubConfig::fccl`]).
    Fccl,
    /// FedKEMF's shared knowledge network, learned mutually with each client's model and fused
    /// on the server ([`fedkemf`], settings in [`ClubConfig::fedkemf`]).
    FedKemf,
}

/// pFedClub's server settings.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ClubConfig {
    /// What the server does.
    pub method: Method,
    /// Candidate search rules (pFedClub's or pFedHR's, or an ablation).
    pub rules: SearchRules,
    /// Number of functional groups K.
    pub groups: usize,
    /// Candidates drawn per client per round.
    pub candidates: usize,
    /// pFedClub+'s η: only candidates with |w*| ≤ (1 + η)|w| (`None`: no limit).
    pub size_limit: Option<f64>,
    /// λ, the weight of the distillation term in local training.
    pub distill_weight: f64,
    /// Public samples used for CKA.
    pub cka_samples: usize,
    /// Public samples used for stitching and matching (`None`: all of them).
    pub public_samples: Option<usize>,
    /// Fine-tuning of the stitching layers.
    pub stitch: StitchTraining,
    /// FedMD's settings (for [`Method::FedMd`]).
    #[serde(default)]
    pub fedmd: FedMdConfig,
    /// FedGH's settings (for [`Method::FedGh`]).
    #[serde(default)]
    pub fedgh: FedGhConfig,
    /// FCCL's settings (for [`Method::Fccl`]).
    #[serde(default)]
    pub fccl: FcclConfig,
    /// FedKEMF's settings (for [`Method::FedKemf`]).
    #[serde(default)]
    pub fedkemf: FedKemfConfig,
    /// pFedHR's settings (for [`Method::Pfedhr`]).
    #[serde(default)]
    pub pfedhr: PfedhrConfig,
}

impl Default for ClubConfig {
    fn default() -> Self {
        Self {
            method: Method::Reassembly,
            rules: SearchRules::PFEDCLUB,
            groups: 4,
            candidates: 4,
            size_limit: None,
            distill_weight: 0.2,
            cka_samples: 256,
            public_samples: None,
            stitch: StitchTraining {
                epochs: 3,
                batch_size: 64,
                lr: 1e-3,
                labeled: true,
                temperature: 0.07,
            },
            fedmd: FedMdConfig::default(),
            fedgh: FedGhConfig::default(),
            fccl: FcclConfig::default(),
            fedkemf: FedKemfConfig::default(),
            pfedhr: PfedhrConfig::default(),
        }
    }
}

impl ClubConfig {
    /// Checks the values a run cannot work with.
    pub fn validate(&self) -> Result<(), String> {
        if self.groups == 0 {
            return Err("the number of groups must be at least 1".into());
        }
        if self.candidates == 0 {
            return Err("the number of candidates must be at least 1".into());
        }
        if let Some(eta) = self.size_limit
            && !(eta.is_finite() && eta > -1.0)
        {
            return Err(format!(
                "the size limit η must be > -1 (teachers of at most (1 + η) times the client's size), got {eta}"
            ));
        }
        if !(self.distill_weight.is_finite() && self.distill_weight >= 0.0) {
            return Err(format!(
                "the distillation weight must be >= 0, got {}",
                self.distill_weight
            ));
        }
        if self.public_samples == Some(0) {
            return Err("the public samples for stitching and matching must be at least 1".into());
        }
        if self.cka_samples < 2 {
            return Err("CKA needs at least 2 public samples".into());
        }
        let s = &self.stitch;
        if s.batch_size == 0 || s.epochs == 0 {
            return Err("stitch epochs and batch size must be at least 1".into());
        }
        if !(s.lr.is_finite() && s.lr > 0.0 && s.temperature.is_finite() && s.temperature > 0.0) {
            return Err("stitch learning rate and temperature must be positive".into());
        }
        // Only the running method's own settings are checked.
        match self.method {
            Method::FedGh => self.fedgh.validate(),
            Method::Fccl => self.fccl.validate(),
            Method::FedKemf => self.fedkemf.validate(),
            Method::Pfedhr => self.pfedhr.validate(),
            Method::FedMd => {
                self.fedmd.validate()?;
                if !s.labeled && self.fedmd.transfer_epochs > 0 {
                    return Err("FedMD's transfer learning needs labeled public data (use labeled public data, or no transfer epochs)".into());
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

/// The server's public data (pFedClub's 8% of all samples): what grouping, stitching and
/// matching run on.
#[derive(Clone, Copy)]
pub struct PublicData<'a> {
    /// The dataset the indices refer to (the pooled samples).
    pub data: &'a Dataset,
    /// Normalisation.
    pub normalization: &'a Normalization,
    /// The public samples.
    pub samples: &'a [usize],
}

/// Per-client results of a run (`clients.json`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ClientSummary {
    /// The client.
    pub client: usize,
    /// Trainable parameters of its model.
    pub params: usize,
    /// Test accuracy of its final model on its own test portion.
    pub test_acc: f64,
    /// Rounds it trained in.
    pub rounds_trained: usize,
    /// Teachers it received.
    pub teachers: usize,
    /// Mean relative size change of its teachers, (|w*| − |w|)/|w| (the paper's φ).
    pub phi: Option<f64>,
}

/// pFedClub's server: every client's model, the teachers it made for them, and the per-client
/// bookkeeping. Client models are built by `build(client)`; at [`init`](Strategy::init) each is
/// initialised from the device's generator seeded per client (Burn's generator is
/// process-wide, so nothing else should build models while a run starts).
pub struct PFedClub<'a, M: BlockForward> {
    club: ClubConfig,
    seed: u64,
    num_clients: usize,
    /// Matching runs the public samples in batches of this size.
    batch_size: usize,
    build: &'a (dyn Fn(usize) -> M + Sync),
    public: PublicData<'a>,
    tables: Vec<ParamTable>,
    specs: Vec<Vec<BlockSpec>>,
    params: Vec<usize>,
    block_params: Vec<Vec<usize>>,
    teachers: Vec<Option<Assigned<M>>>,
    phis: Vec<Vec<f64>>,
    rounds_trained: Vec<usize>,
    /// Each client's (accuracy, loss) on its test portion, `None` once its model changed.
    accuracy: Vec<Option<(f64, f64)>>,
    /// Seconds the round's plan spent on FedMD's scores (reported with the round's metrics).
    plan_seconds: Option<f64>,
    /// The server's own model: FedGH's global header, HeteroFL's global model.
    server: Option<ParamTable>,
    /// The classes in each client's training data (HeteroFL's label split).
    client_classes: Vec<Vec<usize>>,
    /// A second model kept per client: FCCL's intra-domain teacher (its pretrained model).
    kept: BTreeMap<usize, ParamTable>,
}

/// A client's teacher and its size bookkeeping.
struct Assigned<M> {
    teacher: Arc<Teacher<M>>,
    bytes: usize,
    /// The round the teacher was made in and the clients whose uploads its models are (in
    /// the order of `teacher.models`): what a checkpoint needs to rebuild it.
    round: usize,
    sources: Vec<usize>,
    /// Which copy of those uploads: 0 the uploads themselves, `k + 1` pFedHR's tuned copies in
    /// its `k`-th candidate.
    copy: usize,
}

/// The name checkpoints of personalised runs carry.
const CHECKPOINT_NAME: &str = "pfedclub";

/// The server's answer for one uploaded model.
struct Matched<M> {
    teacher: Option<Assigned<M>>,
    phi: Option<f64>,
    candidates: usize,
    /// How many order-valid candidates Algorithm 1 found for the client.
    valid: f64,
    /// Seconds spent on this client's candidate search, stitch fine-tuning and matching.
    seconds: [f64; 3],
}

/// The phases of a round's server step, in seconds: features (every uploaded model's block
/// outputs on the probe batch) and grouping (CKA similarities, K-means), wall clock; then
/// search, stitch fine-tuning and matching summed over the clients (which run in parallel, so
/// these are thread-seconds).
const PHASES: [&str; 5] = ["features", "grouping", "search", "stitching", "matching"];

fn trainable_per_block(table: &ParamTable) -> Vec<usize> {
    table
        .layout()
        .block_sizes(|t| t.kind == ParamKind::Trainable)
}

impl<'a, M: BlockForward> PFedClub<'a, M> {
    /// pFedClub for `num_clients` clients whose models `build` makes, with the server's public
    /// data; `seed` is the run's and `batch_size` the batch of matching. Checks the settings.
    pub fn new(
        club: ClubConfig,
        build: &'a (dyn Fn(usize) -> M + Sync),
        public: PublicData<'a>,
        num_clients: usize,
        seed: u64,
        batch_size: usize,
    ) -> Result<Self, StrategyError> {
        club.validate().map_err(StrategyError::Config)?;
        // The checks below are on the samples the server uses (`--public-samples` of them).
        let samples = match club.public_samples {
            Some(k) => &public.samples[..k.min(public.samples.len())],
            None => public.samples,
        };
        let more = if club.public_samples.is_some() {
            "use a public fraction > 0 and more --public-samples"
        } else {
            "use a public fraction > 0"
        };
        if matches!(club.method, Method::FedMd | Method::Fccl) && samples.is_empty() {
            return Err(StrategyError::Config(format!(
                "FedMD and FCCL need public samples; {more}"
            )));
        }
        if matches!(club.method, Method::Reassembly | Method::Pfedhr) && samples.len() < 2 {
            return Err(StrategyError::Config(format!(
                "block reassembly needs at least 2 public samples; {more}"
            )));
        }
        Ok(Self {
            club,
            seed,
            num_clients,
            batch_size,
            build,
            public: PublicData { samples, ..public },
            tables: Vec::new(),
            specs: Vec::new(),
            params: Vec::new(),
            block_params: Vec::new(),
            teachers: Vec::new(),
            phis: Vec::new(),
            rounds_trained: Vec::new(),
            accuracy: Vec::new(),
            plan_seconds: None,
            server: None,
            client_classes: Vec::new(),
            kept: BTreeMap::new(),
        })
    }

    /// Tells the server the classes in each client's training data (HeteroFL needs them).
    pub fn with_client_classes(mut self, classes: Vec<Vec<usize>>) -> Self {
        self.client_classes = classes;
        self
    }

    /// The server's settings.
    pub fn config(&self) -> &ClubConfig {
        &self.club
    }

    /// Per-client results so far.
    pub fn summaries(&self) -> Vec<ClientSummary> {
        (0..self.num_clients)
            .map(|c| ClientSummary {
                client: c,
                params: self.params[c],
                test_acc: self.accuracy[c].map_or(f64::NAN, |a| a.0),
                rounds_trained: self.rounds_trained[c],
                teachers: self.phis[c].len(),
                phi: (!self.phis[c].is_empty())
                    .then(|| self.phis[c].iter().sum::<f64>() / self.phis[c].len() as f64),
            })
            .collect()
    }
}

impl<M: BlockForward> Strategy for PFedClub<'_, M> {
    fn name(&self) -> &'static str {
        CHECKPOINT_NAME
    }

    /// Each client initialises its own model (seeded per client, sequentially: Burn's weight
    /// initialisation draws from one process-wide generator); `initial` only gives the device.
    fn init(&mut self, initial: ParamTable, _sample: usize) -> Result<(), StrategyError> {
        let device = initial.device().autodiff();
        let n = self.num_clients;
        let (mut tables, mut specs) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for client in 0..n {
            device.seed(derive_seed(self.seed, Purpose::Init, 0, client as u64));
            let model = (self.build)(client);
            let blocks = model.blocks();
            if blocks.is_empty() {
                return Err(StrategyError::Config(
                    "every client model must declare its blocks".into(),
                ));
            }
            tables.push(ParamTable::from_module_with_blocks(&model, blocks.clone())?);
            specs.push(blocks);
        }
        if self.club.method == Method::FedGh {
            // One header for all: every representation must be as wide (the first client's
            // header starts it).
            let first = fedgh::header_shape(&tables[0])?;
            for (c, t) in tables.iter().enumerate() {
                let shape = fedgh::header_shape(t)?;
                if shape != first {
                    return Err(StrategyError::Config(format!(
                        "FedGH shares one header, but client 0's takes {} features and client {c}'s {}; give every model the same representation width",
                        first[0], shape[0]
                    )));
                }
            }
            self.server = Some(fedgh::header_of(&tables[0])?);
        }
        if self.club.method == Method::FedKemf {
            // The knowledge network: the extra architecture `build(n)`, seeded as a client n.
            device.seed(derive_seed(self.seed, Purpose::Init, 0, n as u64));
            self.server = Some(ParamTable::from_module(&(self.build)(n)));
        }
        if self.club.method == Method::HeteroFl {
            if self.client_classes.len() != n {
                return Err(StrategyError::Config(
                    "HeteroFL needs the classes of every client's data".into(),
                ));
            }
            // The global model is the widest client's; everyone starts from its corner.
            let widest = (0..n)
                .max_by_key(|&c| (tables[c].num_trainable(), std::cmp::Reverse(c)))
                .expect("at least one client");
            let global = tables[widest].clone();
            for t in tables.iter_mut() {
                *t = heterofl::slice(&global, t)?;
            }
            self.server = Some(global);
        }
        self.params = tables.iter().map(ParamTable::num_trainable).collect();
        self.block_params = tables.iter().map(trainable_per_block).collect();
        self.tables = tables;
        self.specs = specs;
        self.teachers = (0..n).map(|_| None).collect();
        self.phis = vec![Vec::new(); n];
        self.rounds_trained = vec![0; n];
        self.accuracy = vec![None; n];
        Ok(())
    }

    /// Each sampled client trains its own model, with its teacher's distillation term once it
    /// has one; it receives the teacher (and, for FedAvg per architecture, the averaged model).
    fn configure_round(&mut self, ctx: &mut RoundContext<'_>) -> Result<RoundPlan> {
        if self.tables.is_empty() {
            return Err(StrategyError::NotInitialised);
        }
        let sampled = ctx.sample_uniform();
        let fedmd = match self.club.method {
            Method::FedMd | Method::Fccl => {
                let fccl = self.club.method == Method::Fccl;
                let cfg = match fccl {
                    true => self.club.fccl.communication(),
                    false => self.club.fedmd.clone(),
                };
                let model = |c: usize| Ok(self.tables[c].load_into((self.build)(c))?.valid());
                let fresh =
                    |c: usize| (fccl || cfg.transfer_epochs > 0) && self.rounds_trained[c] == 0;
                let at = (self.seed, ctx.round);
                let (public, batch) = (&self.public, self.batch_size);
                let plan = fedmd::plan(&cfg, at, &sampled, &fresh, &model, public, batch)?;
                self.plan_seconds = Some(plan.seconds);
                let objectives = match fccl {
                    false => plan.objectives(),
                    true => sampled
                        .iter()
                        .zip(&plan.phases)
                        .map(|(&c, phase)| {
                            let Some(phase) = phase else { return Ok(None) };
                            let intra = self.kept.get(&c).ok_or_else(|| {
                                StrategyError::Restore(format!(
                                    "FCCL: client {c} has no pretrained model"
                                ))
                            })?;
                            let teachers =
                                vec![model(c)?, intra.load_into((self.build)(c))?.valid()];
                            let client = fccl::FcclClient {
                                phase: self.club.fccl.collaborative(phase.clone()),
                                teachers,
                            };
                            Ok(Some(Arc::new(client) as Arc<dyn LocalObjective>))
                        })
                        .collect::<Result<_, StrategyError>>()?,
                };
                Some((plan, objectives))
            }
            _ => None,
        };
        let clients = sampled
            .into_iter()
            .enumerate()
            .map(|(i, client)| {
                let teacher = self.teachers[client].as_ref();
                let sends_model = matches!(
                    self.club.method,
                    Method::FedavgPerArchitecture | Method::Flexifed(_)
                );
                let mut instruction = ClientInstruction {
                    client,
                    start: self.tables[client].clone(),
                    objective: teacher.map(|t| t.teacher.clone() as Arc<dyn LocalObjective>),
                    bytes_down: self.tables[client].byte_size() * usize::from(sends_model)
                        + teacher.map_or(0, |t| t.bytes),
                    bytes_up: None,
                    start_architecture: None,
                    state: None,
                };
                if let Some((plan, objectives)) = &fedmd {
                    instruction.objective = objectives[i].clone();
                    instruction.bytes_down = plan.bytes_down[i];
                    instruction.bytes_up = Some(plan.bytes_up[i]);
                }
                if self.club.method == Method::HeteroFl {
                    instruction.objective = Some(Arc::new(heterofl::MaskedLoss));
                    instruction.bytes_down = instruction.start.byte_size();
                }
                if let (Method::FedKemf, Some(network)) = (self.club.method, &self.server) {
                    // The knowledge network goes out; the client's own model stays with it.
                    instruction.state =
                        Some(std::mem::replace(&mut instruction.start, network.clone()));
                    instruction.start_architecture = Some(self.num_clients);
                    instruction.bytes_down = network.byte_size();
                }
                if let (Method::FedGh, Some(header)) = (self.club.method, &self.server) {
                    // FedGH: the global header replaces the client's; prototypes go up.
                    instruction.start = fedgh::with_header(&instruction.start, header)?;
                    instruction.objective = Some(Arc::new(fedgh::ReportPrototypes));
                    instruction.bytes_down = header.byte_size();
                    instruction.bytes_up = Some(0);
                }
                Ok(instruction)
            })
            .collect::<Result<_, StrategyError>>()?;
        let mut train = ctx.train.clone();
        if self.club.method == Method::FedKemf {
            train.procedure = LocalProcedure::Mutual;
        }
        Ok(RoundPlan { clients, train })
    }

    fn aggregate(&mut self, at: ServerRound<'_>, updates: Vec<LocalUpdate>) -> Result<Metrics> {
        let ServerRound { round, rng } = at;
        let clients: Vec<usize> = updates.iter().map(|u| u.client).collect();
        for u in &updates {
            self.rounds_trained[u.client] += 1;
            // FedKEMF uploads the knowledge network; the client's own model is its state.
            let own = match (self.club.method, &u.state) {
                (Method::FedKemf, Some(state)) => state,
                _ => &u.table,
            };
            self.tables[u.client] = self.tables[u.client].with_values(own.values().to_vec())?;
        }
        let mut changed = clients.clone();
        let mut extra = Metrics::new();
        match self.club.method {
            Method::Local => {}
            Method::FedKemf => {
                let timer = Instant::now();
                let uploads: Vec<ParamTable> = updates.iter().map(|u| u.table.clone()).collect();
                let weights: Vec<f64> = updates.iter().map(|u| u.num_samples as f64).collect();
                let template = (self.build)(self.num_clients);
                let cfg = &self.club.fedkemf;
                let fused = fedkemf::fuse(&uploads, &weights, template, &self.public, cfg, rng)?;
                self.server = Some(fused);
                extra.insert(
                    "fusion_seconds".into(),
                    timer.elapsed().as_secs_f64().into(),
                );
            }
            Method::HeteroFl => {
                let global = self.server.as_ref().ok_or(StrategyError::NotInitialised)?;
                let uploads: Vec<heterofl::Upload<'_>> = updates
                    .iter()
                    .map(|u| heterofl::Upload {
                        table: &u.table,
                        classes: &self.client_classes[u.client],
                    })
                    .collect();
                let head = fedgh::header_indices(global)?;
                let global = heterofl::aggregate(global, &uploads, head)?;
                for t in self.tables.iter_mut() {
                    *t = heterofl::slice(&global, t)?;
                }
                self.server = Some(global);
                changed = (0..self.num_clients).collect();
            }
            Method::FedGh => {
                let header = self.server.as_ref().ok_or(StrategyError::NotInitialised)?;
                let uploads: Vec<&_> = updates
                    .iter()
                    .filter_map(|u| u.prototypes.as_ref())
                    .collect();
                let timer = Instant::now();
                self.server = Some(fedgh::train_header(
                    header,
                    &uploads,
                    &self.club.fedgh,
                    rng,
                )?);
                extra.insert(
                    "header_seconds".into(),
                    timer.elapsed().as_secs_f64().into(),
                );
            }
            Method::FedMd | Method::Fccl => {
                // FCCL keeps a client's first model, trained on its own data alone.
                if self.club.method == Method::Fccl {
                    for u in &updates {
                        self.kept.entry(u.client).or_insert_with(|| u.table.clone());
                    }
                }
                let seconds = self.plan_seconds.take().unwrap_or(0.0);
                extra.insert("scores_seconds".into(), seconds.into());
            }
            Method::FedavgPerArchitecture => {
                changed = self.average_per_architecture(&clients, &updates)?;
            }
            Method::Flexifed(rule) => {
                let uploads: Vec<(usize, f64)> = updates
                    .iter()
                    .map(|u| (u.client, u.num_samples as f64))
                    .collect();
                changed = crate::strategy::flexifed::aggregate(&mut self.tables, &uploads, rule)?;
            }
            Method::Reassembly | Method::Pfedhr => {
                let (matched, [features, grouping]) = match self.club.method {
                    Method::Pfedhr => self.pfedhr(round, &clients, rng)?,
                    _ => self.reassemble(round, &clients, rng)?,
                };
                let mut phases = [features, grouping, 0.0, 0.0, 0.0];
                for m in &matched {
                    for (total, s) in phases[2..].iter_mut().zip(m.seconds) {
                        *total += s;
                    }
                }
                let phases: serde_json::Map<String, serde_json::Value> = PHASES
                    .iter()
                    .zip(phases)
                    .map(|(name, s)| (name.to_string(), s.into()))
                    .collect();
                extra.insert("phase_seconds".into(), phases.into());
                let mut round_phi = Vec::new();
                let mut made = 0usize;
                let mut client_phi = Vec::new();
                let mut valid = Vec::new();
                for (&client, m) in clients.iter().zip(matched) {
                    made += m.candidates;
                    client_phi.push(serde_json::Value::from(m.phi));
                    // Counts are integers; past 2^53 (no order rule, deep zoos) a float.
                    valid.push(if m.valid < 9e15 {
                        serde_json::Value::from(m.valid as u64)
                    } else {
                        serde_json::Value::from(m.valid)
                    });
                    if let Some(phi) = m.phi {
                        self.phis[client].push(phi);
                        round_phi.push(phi);
                    }
                    if m.teacher.is_some() {
                        self.teachers[client] = m.teacher;
                    }
                }
                extra.insert("candidates".into(), made.into());
                extra.insert("client_phi".into(), client_phi.into());
                extra.insert("valid_candidates".into(), valid.into());
                if !round_phi.is_empty() {
                    let mean = round_phi.iter().sum::<f64>() / round_phi.len() as f64;
                    extra.insert("phi".into(), mean.into());
                }
            }
        }
        for c in changed {
            self.accuracy[c] = None;
        }
        Ok(extra)
    }

    /// The mean over clients of their own model's accuracy on their own test portion (only
    /// models that changed since they were last evaluated are evaluated again).
    fn evaluate(&mut self, _round: usize, eval: &dyn Evaluator) -> Result<Evaluation> {
        let stale: Vec<(usize, ParamTable)> = (0..self.num_clients)
            .filter(|&c| self.accuracy[c].is_none())
            .map(|c| (c, self.tables[c].clone()))
            .collect();
        for ((c, _), r) in stale.iter().zip(eval.client_tests(&stale)?) {
            self.accuracy[*c] = Some(r);
        }
        let all: Vec<(f64, f64)> = self
            .accuracy
            .iter()
            .map(|a| a.expect("evaluated"))
            .collect();
        let mut extra = Metrics::new();
        extra.insert(
            "client_acc".into(),
            all.iter()
                .map(|a| (a.0 * 1e4).round() / 1e4)
                .collect::<Vec<_>>()
                .into(),
        );
        let n = self.num_clients as f64;
        let mean = |f: fn(&(f64, f64)) -> f64| all.iter().map(f).sum::<f64>() / n;
        Ok(Evaluation {
            acc: mean(|a| a.0),
            loss: mean(|a| a.1),
            extra,
        })
    }

    fn global_model(&self) -> Result<ParamTable, StrategyError> {
        Err(StrategyError::NoGlobalModel(CHECKPOINT_NAME))
    }

    fn client_summary(&self) -> Option<serde_json::Value> {
        Some(serde_json::to_value(self.summaries()).expect("summaries serialise"))
    }

    fn checkpoint_layout(
        &self,
        slot: usize,
        extra: &serde_json::Value,
    ) -> Result<Option<ParamTable>, StrategyError> {
        self.slot_layout(slot, extra).map(Some)
    }

    fn state(&self) -> StrategyState {
        self.save_state()
    }

    fn restore(&mut self, state: StrategyState) -> Result<(), StrategyError> {
        self.restore_state(state)
    }
}

impl<M: BlockForward> PFedClub<'_, M> {
    /// FedAvg within each architecture: the uploads of one architecture are averaged
    /// (weighted by sample counts) and every client of that architecture gets the result.
    /// Returns the clients whose model changed.
    fn average_per_architecture(
        &mut self,
        clients: &[usize],
        updates: &[LocalUpdate],
    ) -> Result<Vec<usize>, StrategyError> {
        let tables = &mut self.tables;
        let arch = |t: &ParamTable| {
            t.layout()
                .tensors()
                .iter()
                .map(|i| (i.name.clone(), i.shape.clone()))
                .collect::<Vec<_>>()
        };
        let mut groups: BTreeMap<Vec<(String, Vec<usize>)>, Vec<usize>> = BTreeMap::new();
        for (k, &c) in clients.iter().enumerate() {
            groups.entry(arch(&tables[c])).or_default().push(k);
        }
        let mut changed = Vec::new();
        for (key, members) in groups {
            let uploads: Vec<ParamTable> = members
                .iter()
                .map(|&k| tables[clients[k]].clone())
                .collect();
            let weights: Vec<f64> = members
                .iter()
                .map(|&k| updates[k].num_samples as f64)
                .collect();
            let average = ParamTable::average(&uploads, Some(&weights))?;
            for (c, table) in tables.iter_mut().enumerate() {
                if arch(table) == key {
                    *table = average.clone();
                    changed.push(c);
                }
            }
        }
        Ok(changed)
    }
}
