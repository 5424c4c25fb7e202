//! The simulation loop shared by every strategy.
//!
//! Each round: sample clients (without replacement) → [`Strategy::dispatch`] → local training of
//! the sampled clients in parallel → [`Strategy::aggregate`] → evaluation of
//! [`Strategy::global_model`] → one line of `metrics.jsonl` and a checkpoint.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use fl_data::{FederatedDataset, Partition};
use rayon::prelude::*;

use crate::checkpoint::{self, CheckpointError};
use crate::layers::{LayerError, ParamTable};
use crate::model::Classifier;
use crate::rng::{Purpose, rng_for};
use crate::strategy::{Strategy, StrategyError};
use crate::trainer::{LocalObjective, LocalTask, TrainConfig, TrainError, evaluate, train_local};

/// File names inside a run directory.
pub mod files {
    /// One JSON object per round.
    pub const METRICS: &str = "metrics.jsonl";
    /// The latest checkpoint.
    pub const CHECKPOINT: &str = "checkpoint.safetensors";
    /// The final global model as a Burn record (burnpack).
    pub const MODEL: &str = "model.bpk";
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
    /// Batch size for evaluation.
    pub eval_batch_size: usize,
    /// Local training.
    pub train: TrainConfig,
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
    /// A copy without wall-clock timings, for comparing runs.
    pub fn without_timings(&self) -> Self {
        Self {
            train_seconds: 0.0,
            aggregate_seconds: 0.0,
            eval_seconds: 0.0,
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
    /// The final global model.
    pub global: ParamTable,
}

/// One simulation: a model, data split among clients, and the loop settings.
pub struct Simulation<'a, M: Classifier> {
    /// The initial model, on an autodiff device (clients train copies of it).
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
}

impl<M: Classifier> Simulation<'_, M> {
    /// Checks the settings against the data.
    pub fn validate(&self) -> Result<(), EngineError> {
        let c = &self.config;
        let n = self.partition.num_clients();
        let bad = |m: String| Err(EngineError::Config(m));
        if c.sample == 0 || c.sample > n {
            return bad(format!(
                "cannot sample {} clients per round from {n} clients",
                c.sample
            ));
        }
        if c.rounds == 0 {
            return bad("rounds must be at least 1".into());
        }
        if c.eval_every == 0 {
            return bad("eval-every must be at least 1".into());
        }
        if c.threads == 0 {
            return bad("threads must be at least 1".into());
        }
        c.train.validate().map_err(EngineError::Config)?;
        self.partition
            .validate(self.data.train.len())
            .map_err(|e| EngineError::Config(e.to_string()))
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
        strategy.init(initial.clone(), cfg.sample);

        let mut history = Vec::new();
        let mut start_round = 1;
        if let Some(dir) = &self.out_dir {
            std::fs::create_dir_all(dir).map_err(io_err(dir))?;
            let ckpt = dir.join(files::CHECKPOINT);
            if resume && ckpt.exists() {
                let restored = checkpoint::load(&ckpt, &initial, &device)?;
                if restored.strategy != strategy.name() {
                    return Err(EngineError::Config(format!(
                        "checkpoint is from strategy '{}', not '{}'",
                        restored.strategy,
                        strategy.name()
                    )));
                }
                strategy.restore(restored.state)?;
                start_round = restored.round + 1;
                history = read_metrics(&dir.join(files::METRICS), restored.round)?;
                tracing::info!(round = restored.round, "resumed from checkpoint");
            }
            rewrite_metrics(&dir.join(files::METRICS), &history)?;
        }

        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(cfg.threads)
            .build()
            .map_err(|e| EngineError::Config(format!("thread pool: {e}")))?;
        let num_clients = self.partition.num_clients();
        let client_sizes: Vec<usize> = self.partition.clients.iter().map(Vec::len).collect();
        let eval_model = self.model.valid();

        for round in start_round..=cfg.rounds {
            let mut rng = rng_for(cfg.seed, Purpose::Sampling, round as u64, 0);
            let clients = match strategy.select_clients(round, &client_sizes, cfg.sample, &mut rng)
            {
                Some(chosen) => check_selection(strategy.name(), chosen, num_clients)?,
                None => rand::seq::index::sample(&mut rng, num_clients, cfg.sample).into_vec(),
            };
            let train_cfg = strategy.local_training(&cfg.train);
            train_cfg.validate().map_err(EngineError::Config)?;
            let starts = strategy.dispatch(round, &clients)?;
            let bytes_down = starts.iter().map(ParamTable::byte_size).sum();

            let objectives = strategy.objectives(round, &clients)?;
            if objectives.len() != clients.len() {
                return Err(EngineError::Config(format!(
                    "{} gave {} local objectives for {} clients",
                    strategy.name(),
                    objectives.len(),
                    clients.len()
                )));
            }

            let timer = Instant::now();
            let tasks: Vec<LocalTask<'_, M>> = clients
                .iter()
                .zip(starts)
                .zip(&objectives)
                .map(|((&client, start), objective)| LocalTask {
                    template: self.model.clone(),
                    start,
                    data: &self.data.train,
                    norm: &self.data.normalization,
                    indices: &self.partition.clients[client],
                    client,
                    round,
                    seed: cfg.seed,
                    // The strategy's own term (FedProx, SCAFFOLD) wins over the simulation's.
                    objective: objective.as_deref().or(self.objective),
                })
                .collect();
            let updates = pool.install(|| {
                tasks
                    .into_par_iter()
                    .map(|task| train_local(task, &train_cfg))
                    .collect::<Result<Vec<_>, _>>()
            })?;
            let train_seconds = timer.elapsed().as_secs_f64();
            let bytes_up = updates.iter().map(|u| u.table.byte_size()).sum();
            let samples: usize = updates.iter().map(|u| u.num_samples).sum();
            let train_loss = updates
                .iter()
                .map(|u| u.train_loss * u.num_samples as f64)
                .sum::<f64>()
                / samples as f64;

            let timer = Instant::now();
            let mut server_rng = rng_for(cfg.seed, Purpose::Server, round as u64, 0);
            let extra = strategy.aggregate(round, updates, &mut server_rng)?;
            let aggregate_seconds = timer.elapsed().as_secs_f64();

            let timer = Instant::now();
            let (test_acc, test_loss) = if round % cfg.eval_every == 0 || round == cfg.rounds {
                let global = strategy.global_model()?.load_into(eval_model.clone())?;
                let (test, norm, batch) = (
                    &self.data.test,
                    &self.data.normalization,
                    cfg.eval_batch_size,
                );
                let (acc, loss) = pool.install(move || evaluate(&global, test, norm, batch));
                (Some(acc), Some(loss))
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

        let global = strategy.global_model()?;
        if let Some(dir) = &self.out_dir {
            let model = global.load_into(eval_model)?;
            model
                .save_file(dir.join(files::MODEL))
                .map_err(|e| EngineError::Record(format!("{e:?}")))?;
        }
        Ok(RunSummary {
            rounds: history,
            global,
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

/// Reads `metrics.jsonl`, keeping rounds up to `last_round`.
pub fn read_metrics(path: &Path, last_round: usize) -> Result<Vec<RoundMetrics>, EngineError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(path)(e)),
    };
    let mut rounds = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let m: RoundMetrics = serde_json::from_str(line).map_err(|e| EngineError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("line {}: {e}", i + 1),
            ),
        })?;
        if m.round <= last_round {
            rounds.push(m);
        }
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
