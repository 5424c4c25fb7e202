//! The simulation loop shared by every strategy.
//!
//! One loop for every algorithm, global or personalised. Each round: [`Strategy::configure_round`]
//! (who trains, from which model, with which objective) → local training of the planned clients
//! in parallel → [`Strategy::aggregate`] → [`Strategy::evaluate`] (the global model on the test
//! set, or each client's own model on its own test portion) → one line of `metrics.jsonl` and a
//! checkpoint.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use fl_data::{FederatedDataset, Partition};
use rayon::prelude::*;

use crate::checkpoint::{self, CheckpointError};
use crate::layers::{LayerError, ParamTable};
use crate::model::Classifier;
use crate::model_file::save_model;
use crate::rng::{Purpose, rng_for};
use crate::strategy::{Evaluator, FineTune, RoundContext, ServerRound, Strategy, StrategyError};
use crate::trainer::{
    LocalObjective, LocalTask, TrainConfig, TrainError, evaluate, evaluate_on, fine_tune,
    train_local,
};

/// File names inside a run directory.
pub mod files {
    /// One JSON object per round.
    pub const METRICS: &str = "metrics.jsonl";
    /// The latest checkpoint.
    pub const CHECKPOINT: &str = "checkpoint.safetensors";
    /// The final global model as a Burn record (burnpack).
    pub const MODEL: &str = "model.bpk";
    /// Per-client results of personalised runs.
    pub const CLIENTS: &str = "clients.json";
}

/// Settings of the simulation loop.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EngineConfig {
    /// Clients sampled per round.
    pub sample: usize,
    /// Number of rounds.
    pub rounds: usize,
    /// Evaluate the global model every this many rounds (and after the last round).
    pub eval_every: usize,
    /// Run seed: every random decision derives from it.
    pub seed: u64,
    /// Worker threads for training clients in parallel.
    pub threads: usize,
    /// At most this many clients train at once (default: as many as the pool runs). Each
    /// training client holds its model's activations for the backward pass, so 1 bounds the
    /// memory of local training at one client's (the kernels then use every thread); results
    /// do not depend on it.
    #[serde(default)]
    pub parallel_clients: Option<usize>,
    /// Batch size for evaluation.
    pub eval_batch_size: usize,
    /// Local training.
    pub train: TrainConfig,
}

/// Checks a worker-thread count against this machine: counts far above its cores only thrash
/// (and a pool of thousands takes minutes to start), so at most four per core, or 8. The error
/// reads after the option's name ("must be between 1 and 8 on this machine (2 cores), got 0").
pub fn check_threads(threads: usize) -> Result<(), String> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let most = (4 * cores).max(8);
    if threads == 0 || threads > most {
        return Err(format!(
            "must be between 1 and {most} on this machine ({cores} cores), got {threads}; results do not depend on it"
        ));
    }
    Ok(())
}

impl EngineConfig {
    /// Checks the settings for `num_clients` clients on this machine (thread counts: see
    /// [`check_threads`]).
    pub fn validate(&self, num_clients: usize) -> Result<(), EngineError> {
        let bad = |m: String| Err(EngineError::Config(m));
        if self.sample == 0 || self.sample > num_clients {
            return bad(format!(
                "cannot sample {} clients per round from {num_clients} clients",
                self.sample
            ));
        }
        if self.rounds == 0 {
            return bad("rounds must be at least 1".into());
        }
        if self.eval_every == 0 {
            return bad("eval-every must be at least 1".into());
        }
        if self.eval_batch_size == 0 {
            return bad("eval-batch-size must be at least 1".into());
        }
        if let Err(m) = check_threads(self.threads) {
            return bad(format!("threads {m}"));
        }
        if self.parallel_clients == Some(0) {
            return bad("parallel-clients must be at least 1".into());
        }
        self.train.validate().map_err(EngineError::Config)
    }
}

/// The metrics of one round, one line of `metrics.jsonl`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RoundMetrics {
    /// 1-based round number.
    pub round: usize,
    /// Test accuracy of the global model in `[0, 1]` (null on rounds without evaluation).
    pub test_acc: Option<f64>,
    /// Mean test cross-entropy of the global model (null on rounds without evaluation).
    pub test_loss: Option<f64>,
    /// Mean local training loss of this round's clients, weighted by their sample counts.
    pub train_loss: f64,
    /// The sampled clients, in dispatch order.
    pub clients: Vec<usize>,
    /// Bytes sent from server to clients this round.
    pub bytes_down: usize,
    /// Bytes sent from clients to the server this round.
    pub bytes_up: usize,
    /// Wall-clock seconds of local training (all clients).
    pub train_seconds: f64,
    /// Wall-clock seconds of server-side aggregation.
    pub aggregate_seconds: f64,
    /// Wall-clock seconds of evaluation.
    pub eval_seconds: f64,
    /// Strategy-specific metrics.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl RoundMetrics {
    /// A copy without wall-clock timings (strategy metrics named `*_seconds` included), for
    /// comparing runs.
    pub fn without_timings(&self) -> Self {
        let mut extra = self.extra.clone();
        extra.retain(|k, _| !k.ends_with("_seconds"));
        Self {
            train_seconds: 0.0,
            aggregate_seconds: 0.0,
            eval_seconds: 0.0,
            extra,
            ..self.clone()
        }
    }
}

/// Errors of a simulation run.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// An impossible setting.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// Local training failed.
    #[error(transparent)]
    Train(#[from] TrainError),
    /// The strategy failed.
    #[error(transparent)]
    Strategy(#[from] StrategyError),
    /// A table operation failed.
    #[error(transparent)]
    Layer(#[from] LayerError),
    /// Writing outputs failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Checkpoint problem.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// Saving the final model failed.
    #[error("saving the final model: {0}")]
    Record(String),
    /// The run directory cannot be continued.
    #[error("cannot resume: {0}")]
    Resume(String),
    /// [`Simulation::stop`] was set: the run stopped after checkpointing this round.
    #[error("interrupted after round {0}")]
    Interrupted(usize),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> EngineError + '_ {
    move |source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// What a finished run returns.
#[derive(Debug, Clone)]
pub struct RunSummary {
    /// Every round's metrics (including rounds restored from a checkpoint's metrics file).
    pub rounds: Vec<RoundMetrics>,
    /// The final global model (`None` for personalised strategies).
    pub global: Option<ParamTable>,
    /// Per-client results of personalised strategies (also written as `clients.json`).
    pub clients: Option<serde_json::Value>,
}

/// Clients that own models of their own (personalised / heterogeneous FL): how each client's
/// model is built and where its own test portion is.
#[derive(Clone, Copy)]
pub struct ClientModels<'a, M> {
    /// Builds client `c`'s model on the autodiff device (architectures may differ per client;
    /// the weights are replaced by the strategy's tables).
    pub build: &'a (dyn Fn(usize) -> M + Sync),
    /// Each client's test portion: indices into the simulation's test set.
    pub tests: &'a [Vec<usize>],
    /// The personalisation before a per-client evaluation of a global model (a strategy's own,
    /// [`Strategy::fine_tune`], wins).
    pub fine_tune: Option<FineTune>,
}

/// One simulation: a model, data split among clients, and the loop settings. The same loop
/// runs every [`Strategy`], global or personalised.
pub struct Simulation<'a, M: Classifier> {
    /// The initial model, on an autodiff device (clients train copies of it). With
    /// [`clients`](Self::clients) it only gives the device and the global layout.
    pub model: M,
    /// Training set (split by `partition`) and test set.
    pub data: &'a FederatedDataset,
    /// Client index lists into `data.train`.
    pub partition: &'a Partition,
    /// Loop settings.
    pub config: EngineConfig,
    /// Where to write metrics, checkpoints and the final model (`None`: nothing is written).
    pub out_dir: Option<PathBuf>,
    /// Extra local loss term (FedProx, ...).
    pub objective: Option<&'a dyn LocalObjective>,
    /// Per-client models and test portions (personalised FL); `None`: every client trains
    /// `model`'s architecture.
    pub clients: Option<ClientModels<'a, M>>,
    /// Set (by a Ctrl-C handler, say) to stop cleanly after the round under way, with
    /// [`EngineError::Interrupted`]; the run resumes exactly from its checkpoint.
    pub stop: Option<&'a AtomicBool>,
}

/// What the engine offers [`Strategy::evaluate`]: the test set, the clients' own test portions
/// and the thread pool.
struct EngineEvaluator<'s, 'a, M: Classifier> {
    sim: &'s Simulation<'a, M>,
    eval_model: &'s M,
    pool: &'s rayon::ThreadPool,
}

impl<M: Classifier> Evaluator for EngineEvaluator<'_, '_, M> {
    fn client_count(&self) -> usize {
        self.sim.clients.as_ref().map_or(0, |c| c.tests.len())
    }

    fn client_fine_tune(&self) -> Option<FineTune> {
        self.sim.clients.as_ref().and_then(|c| c.fine_tune)
    }

    fn fine_tune(
        &self,
        round: usize,
        models: &[(usize, ParamTable)],
        tune: &FineTune,
    ) -> Result<Vec<ParamTable>, StrategyError> {
        let sim = self.sim;
        let batch = sim.config.train.batch_size;
        let task = |client: usize, start: ParamTable| LocalTask {
            template: sim.template(client),
            start,
            data: &sim.data.train,
            norm: &sim.data.normalization,
            indices: &sim.partition.clients[client],
            client,
            round,
            seed: sim.config.seed,
            objective: None,
            state: None,
            personal_template: None,
        };
        self.pool.install(|| {
            models
                .par_iter()
                .map(|(client, table)| {
                    let task = task(*client, table.clone());
                    fine_tune(task, tune.steps, tune.lr, tune.proximal, batch)
                        .map_err(|e| StrategyError::Config(e.to_string()))
                })
                .collect()
        })
    }

    fn test_set(&self, table: &ParamTable) -> Result<(f64, f64), StrategyError> {
        if self.client_count() > 0 {
            // The "test set" of a per-client run is every pooled sample, training ones too.
            return Err(StrategyError::Config(
                "this run evaluates per client; it has no shared test set".into(),
            ));
        }
        let model = table.load_into(self.eval_model.clone())?;
        let (test, norm, batch) = (
            &self.sim.data.test,
            &self.sim.data.normalization,
            self.sim.config.eval_batch_size,
        );
        Ok(self
            .pool
            .install(move || evaluate(&model, test, norm, batch)))
    }

    fn client_tests(
        &self,
        models: &[(usize, ParamTable)],
    ) -> Result<Vec<(f64, f64)>, StrategyError> {
        let sim = self.sim;
        let n = sim.partition.num_clients();
        let tests = sim.clients.as_ref().map(|c| c.tests);
        self.pool.install(|| {
            models
                .iter()
                .map(|(client, table)| {
                    let model = match &sim.clients {
                        Some(c) => table.load_into((c.build)(*client))?,
                        None => table.load_into(self.eval_model.clone())?,
                    };
                    let indices = match tests {
                        Some(t) if *client < t.len() => &t[*client],
                        _ => {
                            return Err(StrategyError::Config(format!(
                                "client {client} of {n} has no test portion (per-client evaluation needs one per client)"
                            )));
                        }
                    };
                    Ok(evaluate_on(
                        &model,
                        &sim.data.test,
                        &sim.data.normalization,
                        indices,
                        sim.config.eval_batch_size,
                    ))
                })
                .collect()
        })
    }
}

impl<M: Classifier> Simulation<'_, M> {
    /// Checks the settings against the data.
    pub fn validate(&self) -> Result<(), EngineError> {
        let n = self.partition.num_clients();
        self.config.validate(n)?;
        let bad = |m: String| Err(EngineError::Config(m));
        if let Some(clients) = &self.clients
            && clients.tests.len() != n
        {
            return bad(format!(
                "{} client test portions for {n} clients",
                clients.tests.len()
            ));
        }
        self.partition
            .validate(self.data.train.len())
            .map_err(|e| EngineError::Config(e.to_string()))
    }

    /// A model of client `client`'s architecture on the autodiff device, to train or tune.
    fn template(&self, client: usize) -> M {
        match &self.clients {
            Some(models) => (models.build)(client),
            None => self.model.clone(),
        }
    }

    /// The initial model as a table, with the model's blocks when it declares them.
    pub fn initial_table(&self) -> Result<ParamTable, LayerError> {
        let blocks = self.model.blocks();
        if blocks.is_empty() {
            Ok(ParamTable::from_module(&self.model))
        } else {
            ParamTable::from_module_with_blocks(&self.model, blocks)
        }
    }

    /// Runs (or, with `resume`, continues from the checkpoint in `out_dir`) the simulation.
    /// `on_round` sees every round's metrics as soon as they are written.
    ///
    /// Each round: [`Strategy::configure_round`] → local training of the planned clients in
    /// parallel → [`Strategy::aggregate`] → [`Strategy::evaluate`] (every `eval_every` rounds
    /// and after the last) → one line of `metrics.jsonl` and a checkpoint.
    pub fn run(
        &self,
        strategy: &mut dyn Strategy,
        resume: bool,
        on_round: &mut dyn FnMut(&RoundMetrics),
    ) -> Result<RunSummary, EngineError> {
        self.validate()?;
        let cfg = &self.config;
        let initial = self.initial_table()?;
        let device = initial.device();
        strategy.init(initial.clone(), cfg.sample)?;

        let mut history = Vec::new();
        let mut start_round = 1;
        if let Some(dir) = &self.out_dir {
            std::fs::create_dir_all(dir).map_err(io_err(dir))?;
            let ckpt = dir.join(files::CHECKPOINT);
            let metrics = dir.join(files::METRICS);
            if resume && ckpt.exists() {
                let layout = |slot: usize, extra: &serde_json::Value| match strategy
                    .checkpoint_layout(slot, extra)
                {
                    Ok(Some(table)) => Ok(table),
                    Ok(None) => Ok(initial.clone()),
                    Err(e) => Err(e.to_string()),
                };
                let restored = checkpoint::load_with(&ckpt, &device, &layout)?;
                if restored.strategy != strategy.name() {
                    return Err(EngineError::Config(format!(
                        "checkpoint is from strategy '{}', not '{}'",
                        restored.strategy,
                        strategy.name()
                    )));
                }
                if restored.round > cfg.rounds {
                    return Err(EngineError::Resume(format!(
                        "{} has finished {} rounds; --rounds {} would not extend it (give more than {})",
                        dir.display(),
                        restored.round,
                        cfg.rounds,
                        restored.round
                    )));
                }
                strategy.restore(restored.state)?;
                start_round = restored.round + 1;
                history = read_metrics(&metrics, restored.round)?;
                tracing::info!(round = restored.round, "resumed from checkpoint");
            } else if resume {
                // Without a checkpoint only a run that never checkpointed a round starts over:
                // its metrics reach at most round 1 (stopped between round 1's metrics line and
                // its checkpoint, which follows it).
                match read_metrics(&metrics, usize::MAX)?.last() {
                    Some(last) if last.round > 1 => {
                        return Err(EngineError::Resume(format!(
                            "{} has no {} but its metrics reach round {}: the checkpoint was lost, so the run cannot continue exactly; start afresh in another directory",
                            dir.display(),
                            files::CHECKPOINT,
                            last.round
                        )));
                    }
                    Some(_) => tracing::warn!(
                        "round 1 was never checkpointed (the run stopped while saving it): starting from round 1"
                    ),
                    None => tracing::warn!("no round had finished: starting from round 1"),
                }
            }
            rewrite_metrics(&metrics, &history)?;
        }

        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(cfg.threads)
            .build()
            .map_err(|e| EngineError::Config(format!("thread pool: {e}")))?;
        let num_clients = self.partition.num_clients();
        let client_sizes: Vec<usize> = self.partition.clients.iter().map(Vec::len).collect();
        let eval_model = self.model.valid();
        let evaluator = EngineEvaluator {
            sim: self,
            eval_model: &eval_model,
            pool: &pool,
        };

        for round in start_round..=cfg.rounds {
            if self.stop.is_some_and(|s| s.load(Ordering::SeqCst)) {
                return Err(EngineError::Interrupted(round - 1));
            }
            let mut rng = rng_for(cfg.seed, Purpose::Sampling, round as u64, 0);
            let mut ctx = RoundContext {
                round,
                client_sizes: &client_sizes,
                sample: cfg.sample,
                train: &cfg.train,
                rng: &mut rng,
            };
            // In the pool: a plan may compute (FedMD's scores) on the run's threads.
            let plan = pool.install(|| strategy.configure_round(&mut ctx))?;
            let clients = check_selection(strategy.name(), plan.client_ids(), num_clients)?;
            plan.train.validate().map_err(EngineError::Config)?;
            let bytes_down = plan.clients.iter().map(|c| c.bytes_down).sum();
            let uploads: Vec<Option<usize>> = plan.clients.iter().map(|c| c.bytes_up).collect();

            let timer = Instant::now();
            let objectives: Vec<_> = plan.clients.iter().map(|c| c.objective.clone()).collect();
            let tasks: Vec<LocalTask<'_, M>> = plan
                .clients
                .into_iter()
                .zip(&objectives)
                .map(|(c, objective)| LocalTask {
                    template: self.template(c.start_architecture.unwrap_or(c.client)),
                    personal_template: c.start_architecture.map(|_| self.template(c.client)),
                    start: c.start,
                    data: &self.data.train,
                    norm: &self.data.normalization,
                    indices: &self.partition.clients[c.client],
                    client: c.client,
                    round,
                    seed: cfg.seed,
                    // The strategy's own term (FedProx, SCAFFOLD) wins over the simulation's.
                    objective: objective.as_deref().or(self.objective),
                    state: c.state,
                })
                .collect();
            let train_cfg = plan.train;
            // Clients in dispatch order, at most `parallel_clients` of them training at a time.
            let at_once = cfg.parallel_clients.unwrap_or(usize::MAX);
            let mut updates = Vec::with_capacity(tasks.len());
            let mut tasks = tasks.into_iter();
            loop {
                let batch: Vec<_> = tasks.by_ref().take(at_once).collect();
                if batch.is_empty() {
                    break;
                }
                updates.extend(pool.install(|| {
                    batch
                        .into_par_iter()
                        .map(|task| train_local(task, &train_cfg))
                        .collect::<Result<Vec<_>, _>>()
                })?);
            }
            let train_seconds = timer.elapsed().as_secs_f64();
            let bytes_up = updates
                .iter()
                .zip(&uploads)
                .map(|(u, bytes)| {
                    bytes.unwrap_or_else(|| u.table.byte_size())
                        + u.prototypes.as_ref().map_or(0, |p| p.byte_size())
                })
                .sum();
            let samples: usize = updates.iter().map(|u| u.num_samples).sum();
            let train_loss = updates
                .iter()
                .map(|u| u.train_loss * u.num_samples as f64)
                .sum::<f64>()
                / samples as f64;

            let timer = Instant::now();
            let mut server_rng = rng_for(cfg.seed, Purpose::Server, round as u64, 0);
            let at = ServerRound {
                round,
                rng: &mut server_rng,
            };
            let mut extra = pool.install(|| strategy.aggregate(at, updates))?;
            let aggregate_seconds = timer.elapsed().as_secs_f64();

            let timer = Instant::now();
            let (test_acc, test_loss) = if round % cfg.eval_every == 0 || round == cfg.rounds {
                let evaluation = strategy.evaluate(round, &evaluator)?;
                extra.extend(evaluation.extra);
                (Some(evaluation.acc), Some(evaluation.loss))
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
                append_metrics(&dir.join(files::METRICS), &metrics)?;
                checkpoint::save(
                    &dir.join(files::CHECKPOINT),
                    round,
                    strategy.name(),
                    &strategy.state(),
                )?;
            }
            on_round(&metrics);
            history.push(metrics);
        }

        let global = match strategy.global_model() {
            Ok(global) => Some(global),
            Err(StrategyError::NoGlobalModel(_)) => None,
            Err(e) => return Err(e.into()),
        };
        let clients = strategy.client_summary();
        if let Some(dir) = &self.out_dir {
            if let Some(global) = &global {
                let model = global.load_into(eval_model)?;
                save_model(model, &dir.join(files::MODEL)).map_err(EngineError::Record)?;
            }
            if let Some(summary) = &clients {
                let path = dir.join(files::CLIENTS);
                let json = serde_json::to_string_pretty(summary).expect("summaries serialise");
                std::fs::write(&path, json).map_err(io_err(&path))?;
            }
        }
        Ok(RunSummary {
            rounds: history,
            global,
            clients,
        })
    }
}

/// A strategy's own client selection, checked: at least one client, every index in range.
fn check_selection(
    strategy: &str,
    chosen: Vec<usize>,
    num_clients: usize,
) -> Result<Vec<usize>, EngineError> {
    if chosen.is_empty() {
        return Err(EngineError::Config(format!(
            "{strategy} selected no clients"
        )));
    }
    if let Some(bad) = chosen.iter().find(|&&c| c >= num_clients) {
        return Err(EngineError::Config(format!(
            "{strategy} selected client {bad}, but there are {num_clients} clients"
        )));
    }
    Ok(chosen)
}

/// Appends one round's line to `metrics.jsonl`.
pub fn append_metrics(path: &Path, m: &RoundMetrics) -> Result<(), EngineError> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(io_err(path))?;
    let line = serde_json::to_string(m).expect("metrics serialise");
    writeln!(f, "{line}").map_err(io_err(path))
}

/// Reads `metrics.jsonl`, keeping rounds up to `last_round`. Lines past it (rounds written after
/// the last checkpoint) and a torn last line (a crash while appending) are dropped with a
/// warning; a malformed line before the last is an error.
pub fn read_metrics(path: &Path, last_round: usize) -> Result<Vec<RoundMetrics>, EngineError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(path)(e)),
    };
    let lines: Vec<(usize, &str)> = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .collect();
    let mut rounds = Vec::new();
    let (mut past, mut torn) = (0, false);
    for (k, &(i, line)) in lines.iter().enumerate() {
        match serde_json::from_str::<RoundMetrics>(line) {
            Ok(m) if m.round <= last_round => rounds.push(m),
            Ok(_) => past += 1,
            Err(_) if k + 1 == lines.len() => torn = true,
            Err(e) => {
                return Err(EngineError::Io {
                    path: path.to_path_buf(),
                    source: std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("line {}: {e}", i + 1),
                    ),
                });
            }
        }
    }
    if torn {
        tracing::warn!(
            "{}: dropped its torn last line (a write was interrupted)",
            path.display()
        );
    }
    if past > 0 {
        tracing::warn!(
            "{}: dropped {past} round(s) written after the checkpoint of round {last_round}",
            path.display()
        );
    }
    Ok(rounds)
}

/// Rewrites `metrics.jsonl` with `rounds` (the kept history of a resumed run).
pub fn rewrite_metrics(path: &Path, rounds: &[RoundMetrics]) -> Result<(), EngineError> {
    let mut text = String::new();
    for m in rounds {
        text.push_str(&serde_json::to_string(m).expect("metrics serialise"));
        text.push('\n');
    }
    std::fs::write(path, text).map_err(io_err(path))
}
