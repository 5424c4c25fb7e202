//! Server strategies: which model each sampled client gets, and what the server does with the
//! uploads. A strategy never trains and never touches files; it speaks in [`ParamTable`]s.
//!
//! One algorithm, one file: [`fedavg`], [`fedmr`], [`fedcross`], and the baselines [`fedprox`],
//! [`scaffold`], [`fedavgm`], [`fedexp`], [`fedmut`], [`fedasam`], [`moon`], [`clusamp`],
//! [`fedgen`]; and [`pfedclub`], personalised FL over heterogeneous models, with its own round
//! loop.

pub mod clusamp;
pub mod fedasam;
pub mod fedavg;
pub mod fedavgm;
pub mod fedcross;
pub mod fedexp;
pub mod fedgen;
pub mod fedmr;
pub mod fedmut;
pub mod fedprox;
pub mod moon;
pub mod pfedclub;
pub mod scaffold;

pub use clusamp::{Clusamp, ClusampConfig};
pub use fedasam::{FedAsam, SharpnessAware};
pub use fedavg::FedAvg;
pub use fedavgm::FedAvgM;
pub use fedcross::{FedCross, FedCrossConfig};
pub use fedexp::FedExP;
pub use fedgen::{FedGen, FedGenConfig};
pub use fedmr::{FedMr, FedMrConfig};
pub use fedmut::{FedMut, FedMutConfig};
pub use fedprox::FedProx;
pub use moon::Moon;
pub use scaffold::{Scaffold, ScaffoldConfig};

use std::collections::BTreeMap;
use std::sync::Arc;

use rand_chacha::ChaCha8Rng;

use crate::layers::{LayerError, ParamTable};
use crate::trainer::{LocalObjective, LocalUpdate, TrainConfig};

/// Errors a strategy can report.
#[derive(Debug, thiserror::Error)]
pub enum StrategyError {
    /// A table operation failed.
    #[error(transparent)]
    Layer(#[from] LayerError),
    /// The secure exchange failed.
    #[error(transparent)]
    Secure(#[from] crate::secure::SecureError),
    /// A checkpoint does not hold the state this strategy needs.
    #[error("cannot restore strategy state: {0}")]
    Restore(String),
    /// The strategy was used before [`Strategy::init`].
    #[error("strategy used before init")]
    NotInitialised,
}

/// What a strategy saves in a checkpoint: its server models and any other state as JSON.
#[derive(Debug, Clone, Default)]
pub struct StrategyState {
    /// Server models (all with the model's layout).
    pub tables: Vec<ParamTable>,
    /// Any further state (counters, momentum buffers are tables, ...).
    pub extra: serde_json::Value,
}

/// A federated-learning server algorithm as a small state machine over server models.
pub trait Strategy: Send {
    /// Short name for logs and manifests.
    fn name(&self) -> &'static str;

    /// Sets up the server models from the initial model; `sample` is the number of clients
    /// per round.
    fn init(&mut self, initial: ParamTable, sample: usize);

    /// The model each sampled client starts from this round (`clients` in sampling order; the
    /// result has one table per client, in the same order).
    fn dispatch(
        &mut self,
        round: usize,
        clients: &[usize],
    ) -> Result<Vec<ParamTable>, StrategyError>;

    /// Which clients take part this round, in dispatch order (clustered sampling draws them
    /// itself; a client may appear twice). `client_sizes` are the clients' sample counts and
    /// `rng` the round's sampling generator. `None` (the default) lets the engine draw `sample`
    /// distinct clients uniformly.
    fn select_clients(
        &mut self,
        round: usize,
        client_sizes: &[usize],
        sample: usize,
        rng: &mut ChaCha8Rng,
    ) -> Option<Vec<usize>> {
        let _ = (round, client_sizes, sample, rng);
        None
    }

    /// The clients' local training settings this round, from the run's (FedASAM turns on
    /// sharpness-aware steps). By default, the run's settings.
    fn local_training(&self, base: &TrainConfig) -> TrainConfig {
        base.clone()
    }

    /// The extra local loss term of each sampled client this round (FedProx's proximal term,
    /// SCAFFOLD's drift correction), in the order of `clients`; `None` trains on the plain
    /// loss. Called after [`dispatch`](Self::dispatch). By default, no client has one.
    fn objectives(
        &self,
        _round: usize,
        clients: &[usize],
    ) -> Result<Vec<Option<Arc<dyn LocalObjective>>>, StrategyError> {
        Ok(vec![None; clients.len()])
    }

    /// Turns the uploads (in sampling order) into the new server models. `rng` is the round's
    /// server-side generator. Returns extra per-round metrics (merged into `metrics.jsonl`).
    fn aggregate(
        &mut self,
        round: usize,
        updates: Vec<LocalUpdate>,
        rng: &mut ChaCha8Rng,
    ) -> Result<serde_json::Map<String, serde_json::Value>, StrategyError>;

    /// The deployable global model.
    fn global_model(&self) -> Result<ParamTable, StrategyError>;

    /// The state to checkpoint.
    fn state(&self) -> StrategyState;

    /// Restores what [`state`](Self::state) returned (after [`init`](Self::init)).
    fn restore(&mut self, state: StrategyState) -> Result<(), StrategyError>;
}

/// The single global model, once per sampled client: the dispatch of FedAvg and of every
/// strategy that keeps one server model.
pub fn broadcast(
    global: Option<&ParamTable>,
    clients: &[usize],
) -> Result<Vec<ParamTable>, StrategyError> {
    let global = global.ok_or(StrategyError::NotInitialised)?;
    Ok(vec![global.clone(); clients.len()])
}

/// The K server models of the multi-model strategies (FedMR, FedCross): model i goes to the
/// i-th sampled client, the deployable model is their plain average, and the checkpoint holds
/// all K.
#[derive(Debug, Clone, Default)]
pub struct ModelSlots {
    models: Vec<ParamTable>,
}

impl ModelSlots {
    /// K copies of the initial model (as the authors' code starts).
    pub fn fill(&mut self, initial: ParamTable, k: usize) {
        self.models = vec![initial; k];
    }

    /// The K models.
    pub fn models(&self) -> &[ParamTable] {
        &self.models
    }

    /// Replaces the models (same count).
    pub fn set(&mut self, models: Vec<ParamTable>) {
        debug_assert_eq!(models.len(), self.models.len());
        self.models = models;
    }

    /// Sets every model to `model` (a FedAvg round of the two-stage schedules).
    pub fn set_all(&mut self, model: ParamTable) {
        self.models = vec![model; self.models.len()];
    }

    /// One model per sampled client; `algorithm` names the strategy in errors.
    pub fn dispatch(
        &self,
        algorithm: &str,
        clients: &[usize],
    ) -> Result<Vec<ParamTable>, StrategyError> {
        if self.models.is_empty() {
            return Err(StrategyError::NotInitialised);
        }
        if clients.len() != self.models.len() {
            return Err(StrategyError::Restore(format!(
                "{algorithm} keeps {} models but {} clients were sampled",
                self.models.len(),
                clients.len()
            )));
        }
        Ok(self.models.clone())
    }

    /// The unweighted average of the K models.
    pub fn average(&self) -> Result<ParamTable, StrategyError> {
        if self.models.is_empty() {
            return Err(StrategyError::NotInitialised);
        }
        Ok(ParamTable::average(&self.models, None)?)
    }

    /// Takes back the models of a checkpoint, which must hold K of them.
    pub fn restore(
        &mut self,
        algorithm: &str,
        tables: Vec<ParamTable>,
    ) -> Result<(), StrategyError> {
        if tables.len() != self.models.len() {
            return Err(StrategyError::Restore(format!(
                "{algorithm} keeps {} models, the checkpoint has {}",
                self.models.len(),
                tables.len()
            )));
        }
        self.models = tables;
        Ok(())
    }
}

/// Tables the server keeps per client (MOON's previous models, clustered sampling's updates,
/// SCAFFOLD's control variates). In a checkpoint they follow the strategy's own tables, and
/// `extra["clients"]` lists whose they are.
#[derive(Debug, Clone, Default)]
pub struct ClientTables(BTreeMap<usize, ParamTable>);

impl ClientTables {
    /// Keeps `table` for `client` (replacing an older one).
    pub fn insert(&mut self, client: usize, table: ParamTable) {
        self.0.insert(client, table);
    }

    /// The table of `client`, if it has one.
    pub fn get(&self, client: usize) -> Option<&ParamTable> {
        self.0.get(&client)
    }

    /// The clients with a table and their tables, by client.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &ParamTable)> {
        self.0.iter().map(|(&c, t)| (c, t))
    }

    /// How many clients have a table.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether no client has a table.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Forgets every table.
    pub fn clear(&mut self) {
        self.0.clear();
    }

    /// Appends the tables to `state` and lists their clients in `extra["clients"]`.
    pub fn save_into(&self, state: &mut StrategyState) {
        state.tables.extend(self.0.values().cloned());
        let clients: Vec<usize> = self.0.keys().copied().collect();
        state.extra["clients"] = clients.into();
    }

    /// Splits a checkpoint of `algorithm` into its first `own` tables and the client tables
    /// [`save_into`](Self::save_into) appended.
    pub fn take_from(
        algorithm: &str,
        state: &mut StrategyState,
        own: usize,
    ) -> Result<Self, StrategyError> {
        let clients: Vec<usize> = serde_json::from_value(state.extra["clients"].clone())
            .map_err(|e| StrategyError::Restore(format!("{algorithm} client list: {e}")))?;
        if state.tables.len() != own + clients.len() {
            return Err(StrategyError::Restore(format!(
                "{algorithm} needs {own} + {} tables, the checkpoint has {}",
                clients.len(),
                state.tables.len()
            )));
        }
        let tables = state.tables.split_off(own);
        Ok(Self(clients.into_iter().zip(tables).collect()))
    }
}
