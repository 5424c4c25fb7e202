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
//! The same loop runs the paper's comparisons: pFedHR-style random reassembly
//! ([`SearchRules::PFEDHR`]), the ablations (anchor, order, completion), FedAvg within each
//! architecture, and local training alone. It is not a [`Strategy`](super::Strategy): those
//! keep server models of one architecture and evaluate one global model, while here the
//! metric is the mean accuracy of the clients' own models on their own test data.

pub mod cmsr;
pub mod grouping;
pub mod stitch;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use burn::module::Module;
use burn::tensor::Tensor;
use fl_data::{Dataset, Normalization, PersonalSplit};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use crate::engine::{EngineConfig, EngineError, RoundMetrics, files};
use crate::layers::{ParamKind, ParamTable};
use crate::model::BlockForward;
use crate::rng::{Purpose, derive_seed, rng_for};
use crate::trainer::{LocalObjective, LocalTask, evaluate_on, make_batch, train_local};
use cmsr::{BlockGroups, BlockRef, SearchRules};
use grouping::{BlockGrams, centred_gram, kmeans, similarity_matrix};
use stitch::{StitchTraining, Stitches, Teacher, fit_stitches, mean_cosine, stitch_shapes};

/// What the server does with the uploaded models.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Method {
    /// Block substitution with teachers (pFedClub; pFedHR with [`SearchRules::PFEDHR`]).
    Reassembly,
    /// FedAvg among the clients of each architecture (a homogeneous baseline per group).
    FedavgPerArchitecture,
    /// No collaboration: every client trains alone.
    Local,
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
                epochs: 1,
                batch_size: 64,
                lr: 1e-3,
                labeled: true,
                temperature: 0.07,
            },
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
            && !(eta.is_finite() && eta >= 0.0)
        {
            return Err(format!("the size limit must be >= 0, got {eta}"));
        }
        if !(self.distill_weight.is_finite() && self.distill_weight >= 0.0) {
            return Err(format!(
                "the distillation weight must be >= 0, got {}",
                self.distill_weight
            ));
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
        Ok(())
    }
}

/// The data of a personalised run: one pooled dataset and its split.
pub struct PersonalData<'a> {
    /// All samples (clients' train and test portions and the public set index into it).
    pub data: &'a Dataset,
    /// Normalisation.
    pub normalization: &'a Normalization,
    /// Who holds which samples.
    pub split: &'a PersonalSplit,
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

/// What a finished personalised run returns.
#[derive(Debug, Clone)]
pub struct PersonalSummary {
    /// Every round's metrics (`test_acc` = mean client accuracy).
    pub rounds: Vec<RoundMetrics>,
    /// Per-client results.
    pub clients: Vec<ClientSummary>,
}

/// One personalised simulation. `make_model(client)` builds client `client`'s architecture on
/// an autodiff device (its weights are replaced, except at initialisation).
///
/// Client models are initialised from the device's generator seeded per client; Burn's
/// generator is process-wide, so nothing else should build models while [`run`](Self::run)
/// starts. After that, results do not depend on the thread count.
pub struct PersonalSimulation<'a, M: BlockForward> {
    /// Builds a client's model.
    pub make_model: &'a (dyn Fn(usize) -> M + Sync),
    /// Data and split.
    pub data: PersonalData<'a>,
    /// Loop settings (sampling, rounds, seed, threads, local training).
    pub config: EngineConfig,
    /// Server settings.
    pub club: ClubConfig,
    /// Where to write `metrics.jsonl` and `clients.json` (`None`: nothing is written).
    pub out_dir: Option<PathBuf>,
}

/// A client's teacher and its size bookkeeping.
struct Assigned<M> {
    teacher: Arc<Teacher<M>>,
    bytes: usize,
    /// The round the teacher was made in and the clients whose uploads its models are (in
    /// the order of `teacher.models`): what a checkpoint needs to rebuild it.
    round: usize,
    sources: Vec<usize>,
}

/// The loop's state between rounds, as saved in a checkpoint (tables separately).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct SavedState {
    rounds_trained: Vec<usize>,
    phis: Vec<Vec<f64>>,
    accuracy: Vec<Option<(f64, f64)>>,
    /// The distinct teacher source models, as (round, client) of their upload.
    sources: Vec<(usize, usize)>,
    /// Per client: indices into `sources` and the parts of its teacher, if any.
    teachers: Vec<Option<(Vec<usize>, Vec<BlockRef>)>>,
}

/// The name checkpoints of personalised runs carry.
const CHECKPOINT_NAME: &str = "pfedclub";

/// The server's answer for one uploaded model.
struct Matched<M> {
    teacher: Option<Assigned<M>>,
    phi: Option<f64>,
    candidates: usize,
}

fn trainable_per_block(table: &ParamTable) -> Vec<usize> {
    let tensors = table.layout().tensors();
    table
        .layout()
        .blocks()
        .iter()
        .map(|(_, members)| {
            members
                .iter()
                .map(|&t| &tensors[t])
                .filter(|t| t.kind == ParamKind::Trainable)
                .map(|t| t.shape.iter().product::<usize>())
                .sum()
        })
        .collect()
}

impl<M: BlockForward> PersonalSimulation<'_, M> {
    fn validate(&self) -> Result<(), EngineError> {
        let c = &self.config;
        let split = self.data.split;
        let n = split.num_clients();
        let bad = |m: String| Err(EngineError::Config(m));
        if c.sample == 0 || c.sample > n {
            return bad(format!(
                "cannot sample {} clients per round from {n} clients",
                c.sample
            ));
        }
        if c.rounds == 0 || c.eval_every == 0 || c.threads == 0 {
            return bad("rounds, eval-every and threads must be at least 1".into());
        }
        c.train.validate().map_err(EngineError::Config)?;
        self.club.validate().map_err(EngineError::Config)?;
        if self.club.method == Method::Reassembly && split.public.len() < 2 {
            return bad(
                "block reassembly needs at least 2 public samples; use a public fraction > 0"
                    .into(),
            );
        }
        Ok(())
    }

    /// Runs the simulation (or, with `resume`, continues it from the checkpoint in `out_dir`);
    /// `on_round` sees every round's metrics.
    pub fn run(
        &self,
        resume: bool,
        on_round: &mut dyn FnMut(&RoundMetrics),
    ) -> Result<PersonalSummary, EngineError> {
        self.validate()?;
        let cfg = &self.config;
        let split = self.data.split;
        let n = split.num_clients();

        // Each client initialises its own model (seeded per client, sequentially: Burn's
        // weight initialisation draws from one process-wide generator).
        let device = (self.make_model)(0)
            .devices()
            .into_iter()
            .next()
            .expect("a device");
        let (mut tables, mut specs) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for client in 0..n {
            device.seed(derive_seed(cfg.seed, Purpose::Init, 0, client as u64));
            let model = (self.make_model)(client);
            let blocks = model.blocks();
            if blocks.is_empty() {
                return Err(EngineError::Config(
                    "every client model must declare its blocks".into(),
                ));
            }
            tables.push(ParamTable::from_module_with_blocks(&model, blocks.clone())?);
            specs.push(blocks);
        }
        let params: Vec<usize> = tables.iter().map(ParamTable::num_trainable).collect();
        let block_params: Vec<Vec<usize>> = tables.iter().map(trainable_per_block).collect();

        let mut teachers: Vec<Option<Assigned<M>>> = (0..n).map(|_| None).collect();
        let mut phis: Vec<Vec<f64>> = vec![Vec::new(); n];
        let mut rounds_trained = vec![0usize; n];
        let mut accuracy: Vec<Option<(f64, f64)>> = vec![None; n];
        let mut history = Vec::new();
        let mut start_round = 1;
        if let Some(dir) = &self.out_dir {
            std::fs::create_dir_all(dir).map_err(|source| EngineError::Io {
                path: dir.clone(),
                source,
            })?;
            let ckpt = dir.join(files::CHECKPOINT);
            if resume && ckpt.exists() {
                let (round, state) =
                    self.restore(&ckpt, &mut tables, &mut teachers, &specs, &block_params)?;
                (rounds_trained, phis, accuracy) =
                    (state.rounds_trained, state.phis, state.accuracy);
                start_round = round + 1;
                history = crate::engine::read_metrics(&dir.join(files::METRICS), round)?;
            }
            crate::engine::rewrite_metrics(&dir.join(files::METRICS), &history)?;
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(cfg.threads)
            .build()
            .map_err(|e| EngineError::Config(format!("thread pool: {e}")))?;

        let public = match self.club.public_samples {
            Some(k) => &split.public[..k.min(split.public.len())],
            None => &split.public[..],
        };

        for round in start_round..=cfg.rounds {
            let mut rng = rng_for(cfg.seed, Purpose::Sampling, round as u64, 0);
            let clients = rand::seq::index::sample(&mut rng, n, cfg.sample).into_vec();
            let bytes_down: usize = clients
                .iter()
                .map(|&c| {
                    tables[c].byte_size()
                        * usize::from(self.club.method == Method::FedavgPerArchitecture)
                        + teachers[c].as_ref().map_or(0, |t| t.bytes)
                })
                .sum();

            // 1. Local training of the sampled clients, in parallel.
            let timer = Instant::now();
            let tasks: Vec<(usize, LocalTask<'_, M>)> = clients
                .iter()
                .map(|&client| {
                    let objective = teachers[client]
                        .as_ref()
                        .map(|t| t.teacher.as_ref() as &dyn LocalObjective);
                    let task = LocalTask {
                        template: (self.make_model)(client),
                        start: tables[client].clone(),
                        data: self.data.data,
                        norm: self.data.normalization,
                        indices: &split.train[client],
                        client,
                        round,
                        seed: cfg.seed,
                        objective,
                    };
                    (client, task)
                })
                .collect();
            let updates = pool.install(|| {
                tasks
                    .into_par_iter()
                    .map(|(_, task)| train_local(task, &cfg.train))
                    .collect::<Result<Vec<_>, _>>()
            })?;
            let train_seconds = timer.elapsed().as_secs_f64();
            let samples: usize = updates.iter().map(|u| u.num_samples).sum();
            let train_loss = updates
                .iter()
                .map(|u| u.train_loss * u.num_samples as f64)
                .sum::<f64>()
                / samples as f64;
            let bytes_up = updates.iter().map(|u| u.table.byte_size()).sum();
            let mut changed: Vec<usize> = clients.clone();
            for u in &updates {
                rounds_trained[u.client] += 1;
                tables[u.client] = tables[u.client].with_values(u.table.values().to_vec())?;
            }

            // 2. The server's answer.
            let timer = Instant::now();
            let mut extra = serde_json::Map::new();
            match self.club.method {
                Method::Local => {}
                Method::FedavgPerArchitecture => {
                    changed = self.average_per_architecture(&clients, &updates, &mut tables)?;
                }
                Method::Reassembly => {
                    let matched = pool.install(|| {
                        self.reassemble(
                            round,
                            &clients,
                            &tables,
                            &specs,
                            &block_params,
                            &params,
                            public,
                        )
                    })?;
                    let mut round_phi = Vec::new();
                    let mut made = 0usize;
                    for (&client, m) in clients.iter().zip(matched) {
                        made += m.candidates;
                        if let Some(phi) = m.phi {
                            phis[client].push(phi);
                            round_phi.push(phi);
                        }
                        if m.teacher.is_some() {
                            teachers[client] = m.teacher;
                        }
                    }
                    extra.insert("candidates".into(), made.into());
                    if !round_phi.is_empty() {
                        let mean = round_phi.iter().sum::<f64>() / round_phi.len() as f64;
                        extra.insert("phi".into(), mean.into());
                    }
                }
            }
            let aggregate_seconds = timer.elapsed().as_secs_f64();

            // 3. Evaluation of every client's own model on its own test data (only models
            // that changed since they were last evaluated are evaluated again).
            let timer = Instant::now();
            for &c in &changed {
                accuracy[c] = None;
            }
            let (test_acc, test_loss) = if round % cfg.eval_every == 0 || round == cfg.rounds {
                let stale: Vec<usize> = (0..n).filter(|&c| accuracy[c].is_none()).collect();
                let results = pool.install(|| {
                    stale
                        .iter()
                        .map(|&c| {
                            let model = tables[c].load_into((self.make_model)(c))?;
                            Ok(evaluate_on(
                                &model,
                                self.data.data,
                                self.data.normalization,
                                &split.test[c],
                                cfg.eval_batch_size,
                            ))
                        })
                        .collect::<Result<Vec<_>, EngineError>>()
                })?;
                for (&c, r) in stale.iter().zip(results) {
                    accuracy[c] = Some(r);
                }
                let all: Vec<(f64, f64)> = accuracy.iter().map(|a| a.expect("evaluated")).collect();
                extra.insert(
                    "client_acc".into(),
                    all.iter()
                        .map(|a| (a.0 * 1e4).round() / 1e4)
                        .collect::<Vec<_>>()
                        .into(),
                );
                let mean = |f: fn(&(f64, f64)) -> f64| all.iter().map(f).sum::<f64>() / n as f64;
                (Some(mean(|a| a.0)), Some(mean(|a| a.1)))
            } else {
                (None, None)
            };
            let metrics = RoundMetrics {
                round,
                test_acc,
                test_loss,
                train_loss,
                clients,
                bytes_down,
                bytes_up,
                train_seconds,
                aggregate_seconds,
                eval_seconds: timer.elapsed().as_secs_f64(),
                extra,
            };
            if let Some(dir) = &self.out_dir {
                crate::engine::append_metrics(&dir.join(files::METRICS), &metrics)?;
                let state = SavedState {
                    rounds_trained: rounds_trained.clone(),
                    phis: phis.clone(),
                    accuracy: accuracy.clone(),
                    sources: Vec::new(),
                    teachers: Vec::new(),
                };
                self.save(
                    &dir.join(files::CHECKPOINT),
                    round,
                    &tables,
                    &teachers,
                    state,
                )?;
            }
            on_round(&metrics);
            history.push(metrics);
        }

        let summaries: Vec<ClientSummary> = (0..n)
            .map(|c| ClientSummary {
                client: c,
                params: params[c],
                test_acc: accuracy[c].map_or(f64::NAN, |a| a.0),
                rounds_trained: rounds_trained[c],
                teachers: phis[c].len(),
                phi: (!phis[c].is_empty())
                    .then(|| phis[c].iter().sum::<f64>() / phis[c].len() as f64),
            })
            .collect();
        if let Some(dir) = &self.out_dir {
            let path = dir.join("clients.json");
            let json = serde_json::to_string_pretty(&summaries).expect("summaries serialise");
            std::fs::write(&path, json).map_err(|source| EngineError::Io { path, source })?;
        }
        Ok(PersonalSummary {
            rounds: history,
            clients: summaries,
        })
    }

    /// Writes the clients' models, their teachers and the loop state after `round`.
    fn save(
        &self,
        path: &std::path::Path,
        round: usize,
        tables: &[ParamTable],
        teachers: &[Option<Assigned<M>>],
        mut state: SavedState,
    ) -> Result<(), EngineError> {
        let mut slots: Vec<ParamTable> = tables.to_vec();
        let mut source_tables = Vec::new();
        let mut stitch_tables = Vec::new();
        for t in teachers {
            let Some(t) = t else {
                state.teachers.push(None);
                continue;
            };
            let mut indices = Vec::new();
            for (model, &client) in t.teacher.models.iter().zip(&t.sources) {
                let key = (t.round, client);
                let i = match state.sources.iter().position(|&s| s == key) {
                    Some(i) => i,
                    None => {
                        state.sources.push(key);
                        source_tables.push(ParamTable::from_module(model));
                        state.sources.len() - 1
                    }
                };
                indices.push(i);
            }
            stitch_tables.push(ParamTable::from_module(&t.teacher.stitches));
            state
                .teachers
                .push(Some((indices, t.teacher.parts.clone())));
        }
        slots.extend(source_tables);
        slots.extend(stitch_tables);
        let extra = serde_json::to_value(&state).expect("state serialises");
        let state = super::StrategyState {
            tables: slots,
            extra,
        };
        crate::checkpoint::save(path, round, CHECKPOINT_NAME, &state)?;
        Ok(())
    }

    /// Reads a checkpoint written by [`save`](Self::save): replaces `tables` and `teachers`,
    /// returns the round and the loop state.
    fn restore(
        &self,
        path: &std::path::Path,
        tables: &mut [ParamTable],
        teachers: &mut [Option<Assigned<M>>],
        specs: &[Vec<crate::layers::BlockSpec>],
        block_params: &[Vec<usize>],
    ) -> Result<(usize, SavedState), EngineError> {
        let n = tables.len();
        let device = tables[0].device();
        let shape = self.data.data.image_shape().to_vec();
        let classes = self.data.data.num_classes();
        let parse = |extra: &serde_json::Value| {
            serde_json::from_value::<SavedState>(extra.clone()).map_err(|e| e.to_string())
        };
        let stitch_shapes_of = |state: &SavedState, t: usize| {
            let (indices, parts) = state.teachers.iter().flatten().nth(t).expect("teacher");
            let source_specs: Vec<_> = indices
                .iter()
                .map(|&i| specs[state.sources[i].1].clone())
                .collect();
            stitch_shapes(parts, &source_specs, &shape, classes)
        };
        let mut rng: ChaCha8Rng = rand::SeedableRng::seed_from_u64(0);
        let layout = |slot: usize, extra: &serde_json::Value| -> Result<ParamTable, String> {
            if slot < n {
                return Ok(tables[slot].clone());
            }
            let state = parse(extra)?;
            let s = slot - n;
            if let Some(&(_, client)) = state.sources.get(s) {
                return Ok(ParamTable::from_module(&(self.make_model)(client)));
            }
            let t = s - state.sources.len();
            let shapes = stitch_shapes_of(&state, t);
            let mut rng: ChaCha8Rng = rand::SeedableRng::seed_from_u64(0);
            Ok(ParamTable::from_module(&Stitches::new(
                &shapes, &mut rng, &device,
            )))
        };
        let ckpt = crate::checkpoint::load_with(path, &device, &layout)?;
        if ckpt.strategy != CHECKPOINT_NAME {
            return Err(EngineError::Config(format!(
                "checkpoint is from strategy '{}', not '{CHECKPOINT_NAME}'",
                ckpt.strategy
            )));
        }
        let state = parse(&ckpt.state.extra)
            .map_err(|e| EngineError::Config(format!("checkpoint state: {e}")))?;
        let mut slots = ckpt.state.tables.into_iter();
        for table in tables.iter_mut() {
            *table = slots.next().expect("client slots");
        }
        let sources: Vec<M> = state
            .sources
            .iter()
            .map(|&(_, client)| {
                let table = slots.next().expect("source slots");
                Ok(table.load_into((self.make_model)(client))?.valid())
            })
            .collect::<Result<_, EngineError>>()?;
        let mut t = 0;
        for (client, saved) in state.teachers.iter().enumerate() {
            let Some((indices, parts)) = saved else {
                continue;
            };
            let shapes = stitch_shapes_of(&state, t);
            t += 1;
            let stitches = slots
                .next()
                .expect("stitch slots")
                .load_into(Stitches::new(&shapes, &mut rng, &device))?
                .valid();
            let size: usize = parts
                .iter()
                .map(|p| block_params[state.sources[indices[p.model]].1][p.block])
                .sum::<usize>()
                + shapes
                    .iter()
                    .flatten()
                    .map(|(a, b)| stitch::Stitch::num_params(a, b))
                    .sum::<usize>();
            teachers[client] = Some(Assigned {
                teacher: Arc::new(Teacher {
                    models: indices.iter().map(|&i| sources[i].clone()).collect(),
                    parts: parts.clone(),
                    stitches,
                    weight: self.club.distill_weight,
                }),
                bytes: 4 * size,
                round: state.sources[indices[0]].0,
                sources: indices.iter().map(|&i| state.sources[i].1).collect(),
            });
        }
        Ok((ckpt.round, state))
    }

    /// FedAvg within each architecture: the uploads of one architecture are averaged
    /// (weighted by sample counts) and every client of that architecture gets the result.
    /// Returns the clients whose model changed.
    fn average_per_architecture(
        &self,
        clients: &[usize],
        updates: &[crate::trainer::LocalUpdate],
        tables: &mut [ParamTable],
    ) -> Result<Vec<usize>, EngineError> {
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

    /// Steps 1–5 of the server update for the round's uploaded models (in `clients` order).
    #[allow(clippy::too_many_arguments)]
    fn reassemble(
        &self,
        round: usize,
        clients: &[usize],
        tables: &[ParamTable],
        specs: &[Vec<crate::layers::BlockSpec>],
        block_params: &[Vec<usize>],
        params: &[usize],
        public: &[usize],
    ) -> Result<Vec<Matched<M>>, EngineError> {
        let club = &self.club;
        let data = self.data.data;
        let norm = self.data.normalization;
        // The uploaded models, frozen on the training device (for stitching) and for inference.
        let frozen: Vec<M> = clients
            .iter()
            .map(|&c| Ok(tables[c].load_into((self.make_model)(c))?.freeze()))
            .collect::<Result<_, EngineError>>()?;
        let inference: Vec<M> = frozen.iter().map(Module::valid).collect();
        let round_specs: Vec<Vec<_>> = clients.iter().map(|&c| specs[c].clone()).collect();
        let round_block_params: Vec<&Vec<usize>> =
            clients.iter().map(|&c| &block_params[c]).collect();
        let base = inference[0].devices().into_iter().next().expect("a device");

        // Functional grouping: CKA of block inputs and outputs on a public batch.
        let probe = &public[..club.cka_samples.min(public.len())];
        let (images, _) = make_batch(data, norm, probe, &base);
        let grams: Vec<Vec<BlockGrams>> = inference
            .par_iter()
            .map(|m| {
                let outputs = m.forward_all_blocks(images.clone());
                let mut input = centred_gram(images.clone().flatten::<2>(1, 3));
                outputs
                    .into_iter()
                    .map(|o| {
                        let output = centred_gram(o.pooled());
                        let g = BlockGrams {
                            input: std::mem::take(&mut input),
                            output: output.clone(),
                        };
                        input = output;
                        g
                    })
                    .collect()
            })
            .collect();
        let index: Vec<BlockRef> = grams
            .iter()
            .enumerate()
            .flat_map(|(model, g)| (0..g.len()).map(move |block| BlockRef { model, block }))
            .collect();
        let flat: Vec<BlockGrams> = grams.into_iter().flatten().collect();
        let sim = similarity_matrix(&flat);
        let mut server_rng = rng_for(self.config.seed, Purpose::Server, round as u64, 0);
        let assignment = kmeans(&sim, club.groups, &mut server_rng);
        let mut group_of: Vec<Vec<usize>> = round_specs.iter().map(|s| vec![0; s.len()]).collect();
        for (b, g) in index.iter().zip(&assignment) {
            group_of[b.model][b.block] = *g;
        }
        let groups = BlockGroups { group_of };
        let position = |b: BlockRef| index.iter().position(|&x| x == b).expect("known block");
        let similarity = |a: BlockRef, b: BlockRef| sim[position(a)][position(b)];

        let input_shape = data.image_shape().to_vec();
        let classes = data.num_classes();
        let size_of = |parts: &[BlockRef]| -> usize {
            let blocks: usize = parts
                .iter()
                .map(|p| round_block_params[p.model][p.block])
                .sum();
            let stitches: usize = stitch_shapes(parts, &round_specs, &input_shape, classes)
                .iter()
                .flatten()
                .map(|(from, to)| stitch::Stitch::num_params(from, to))
                .sum();
            blocks + stitches
        };
        // Matching compares logits on the public samples, batch by batch.
        let match_batches: Vec<Tensor<4>> = public
            .chunks(self.config.eval_batch_size.max(1))
            .map(|b| make_batch(data, norm, b, &base).0)
            .collect();
        let score = |candidate: &dyn Fn(Tensor<4>) -> Tensor<2>, own: &[Tensor<2>]| -> f64 {
            let mut total = 0.0;
            for (images, own) in match_batches.iter().zip(own) {
                let rows = images.dims()[0] as f64;
                total += rows * mean_cosine(candidate(images.clone()), own.clone());
            }
            total / public.len() as f64
        };

        // Candidates, stitching and matching for each uploaded model, in parallel.
        (0..clients.len())
            .into_par_iter()
            .map(|own| -> Result<Matched<M>, EngineError> {
                let client = clients[own];
                let mut rng: ChaCha8Rng = rng_for(
                    self.config.seed,
                    Purpose::Server,
                    round as u64,
                    1 + client as u64,
                );
                let own_size = params[client] as f64;
                let keep = |parts: &[BlockRef]| match club.size_limit {
                    Some(eta) => size_of(parts) as f64 <= (1.0 + eta) * own_size,
                    None => true,
                };
                let found = cmsr::candidates(
                    own,
                    &groups,
                    &similarity,
                    club.rules,
                    club.candidates,
                    &keep,
                    &mut rng,
                );
                let own_logits: Vec<Tensor<2>> = match_batches
                    .iter()
                    .map(|images| inference[own].forward(images.clone()))
                    .collect();
                let mut best: Option<(f64, Vec<BlockRef>, Stitches)> = None;
                for parts in &found {
                    let shapes = stitch_shapes(parts, &round_specs, &input_shape, classes);
                    let train_device = frozen[own].devices().into_iter().next().expect("a device");
                    let stitches = Stitches::new(&shapes, &mut rng, &train_device);
                    let stitches = fit_stitches(
                        &frozen,
                        parts,
                        stitches,
                        data,
                        norm,
                        public,
                        &club.stitch,
                        &mut rng,
                    )
                    .valid();
                    let run =
                        |images| stitch::forward_candidate(&inference, parts, &stitches, images);
                    let score = score(&run, &own_logits);
                    if best.as_ref().is_none_or(|(s, _, _)| score > *s) {
                        best = Some((score, parts.clone(), stitches));
                    }
                }
                let Some((_, parts, stitches)) = best else {
                    return Ok(Matched {
                        teacher: None,
                        phi: None,
                        candidates: 0,
                    });
                };
                let size = size_of(&parts);
                // The teacher keeps only the models its blocks come from.
                let mut used: Vec<usize> = parts.iter().map(|p| p.model).collect();
                used.sort_unstable();
                used.dedup();
                let parts = parts
                    .iter()
                    .map(|p| BlockRef {
                        model: used.iter().position(|&u| u == p.model).expect("used"),
                        block: p.block,
                    })
                    .collect();
                let teacher = Teacher {
                    models: used.iter().map(|&u| inference[u].clone()).collect(),
                    parts,
                    stitches,
                    weight: club.distill_weight,
                };
                Ok(Matched {
                    teacher: Some(Assigned {
                        teacher: Arc::new(teacher),
                        bytes: 4 * size,
                        round,
                        sources: used.iter().map(|&u| clients[u]).collect(),
                    }),
                    phi: Some((size as f64 - own_size) / own_size),
                    candidates: found.len(),
                })
            })
            .collect()
    }
}
