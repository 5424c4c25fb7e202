//! Server strategies: which clients train what, what the server does with the uploads, and
//! how the result is evaluated. A strategy never trains and never touches files; it speaks in
//! [`ParamTable`]s, and the one engine ([`Simulation`](crate::Simulation)) runs them all.
//!
//! One algorithm, one file: [`fedavg`], [`fedmr`], [`fedcross`], and the baselines [`fedprox`],
//! [`scaffold`], [`fedavgm`], [`fedexp`], [`fedmut`], [`fedasam`], [`moon`], [`clusamp`],
//! [`fedgen`]; the personalised baselines [`perfedavg`], [`pfedme`], [`pfedbayes`]; and
//! [`pfedclub`], personalised FL over heterogeneous models, with its heterogeneous baselines
//! [`flexifed`], [`heterofl`], [`fedmd`], [`fedgh`], [`fccl`] and [`fedkemf`]. Methods that
//! are FedAvg plus a client-side rule compose it with [`fedavg_with::FedAvgWith`]; the K-model
//! methods (FedMR, FedCross, FedMut) share [`ModelSlots`].

pub mod clusamp;
pub mod fccl;
pub mod fedasam;
pub mod fedavg;
pub mod fedavg_with;
pub mod fedavgm;
pub mod fedcross;
pub mod fedexp;
pub mod fedgen;
pub mod fedgh;
pub mod fedkemf;
pub mod fedmd;
pub mod fedmr;
pub mod fedmut;
pub mod fedprox;
pub mod flexifed;
pub mod heterofl;
pub mod moon;
pub mod perfedavg;
pub mod personal;
pub mod pfedbayes;
pub mod pfedclub;
pub mod pfedhr;
pub mod pfedme;
pub mod scaffold;

pub use clusamp::{Clusamp, ClusampConfig, ClusteredSampling};
pub use fedasam::{FedAsam, SharpnessAware};
pub use fedavg::{Average, FedAvg};
pub use fedavg_with::{ClientRule, FedAvgWith, Plain, ServerStep};
pub use fedavgm::{FedAvgM, ServerMomentum};
pub use fedcross::{FedCross, FedCrossConfig};
pub use fedexp::{Extrapolation, FedExP};
pub use fedgen::{FedGen, FedGenConfig, FedGenRule};
pub use fedmr::{FedMr, FedMrConfig};
pub use fedmut::{FedMut, FedMutConfig};
pub use fedprox::{FedProx, Proximal};
pub use moon::{Moon, MoonRule};
pub use perfedavg::{MetaLearning, PerFedAvg};
pub use pfedbayes::PFedBayes;
pub use pfedclub::PFedClub;
pub use pfedme::{BetaMix, MoreauEnvelope, PFedMe};
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
    /// A personalised strategy was asked for a global model.
    #[error("{0} keeps one model per client, not a global model")]
    NoGlobalModel(&'static str),
    /// The strategy's settings or the run's setup do not fit together.
    #[error("{0}")]
    Config(String),
}

/// A strategy's result.
pub type Result<T, E = StrategyError> = std::result::Result<T, E>;

/// What a strategy saves in a checkpoint: its server models and any other state as JSON.
#[derive(Debug, Clone, Default)]
pub struct StrategyState {
    /// Server models (all with the model's layout).
    pub tables: Vec<ParamTable>,
    /// Any further state (counters, momentum buffers are tables, ...).
    pub extra: serde_json::Value,
}

/// Everything a strategy may use to plan a round: who the clients are, how many to sample, the
/// run's local training settings, and the round's sampling generator.
pub struct RoundContext<'a> {
    /// The round (from 1).
    pub round: usize,
    /// The clients' training sample counts (their number is the number of clients).
    pub client_sizes: &'a [usize],
    /// Clients to sample per round.
    pub sample: usize,
    /// The run's local training settings.
    pub train: &'a TrainConfig,
    /// The round's sampling generator (derived from the seed and the round).
    pub rng: &'a mut ChaCha8Rng,
}

impl RoundContext<'_> {
    /// `sample` distinct clients drawn uniformly: the engine's default selection.
    pub fn sample_uniform(&mut self) -> Vec<usize> {
        rand::seq::index::sample(self.rng, self.client_sizes.len(), self.sample).into_vec()
    }
}

/// What the server may use when it aggregates a round: the round and its server-side generator
/// (derived from the seed and the round).
pub struct ServerRound<'a> {
    /// The round (from 1).
    pub round: usize,
    /// The round's server-side generator.
    pub rng: &'a mut ChaCha8Rng,
}

impl<'a> ServerRound<'a> {
    /// Round `round` with generator `rng`.
    pub fn new(round: usize, rng: &'a mut ChaCha8Rng) -> Self {
        Self { round, rng }
    }
}

/// What one sampled client is told to do this round.
#[derive(Clone)]
pub struct ClientInstruction {
    /// The client (its index in the partition).
    pub client: usize,
    /// The model it starts from.
    pub start: ParamTable,
    /// Its extra local loss term, if any (FedProx's proximal term, a teacher, ...).
    pub objective: Option<Arc<dyn LocalObjective>>,
    /// Bytes the server sends it (by default the start model's size).
    pub bytes_down: usize,
    /// Bytes the client sends back, when that is not its trained model (FedMD uploads class
    /// scores on the public samples); `None`: the trained model's size. Reported prototypes
    /// (FedGH) are counted on top.
    pub bytes_up: Option<usize>,
    /// The client whose architecture `start` has, when not this client's own (FedKEMF's
    /// knowledge network: the extra architecture `build(num_clients)`); `None`: its own.
    pub start_architecture: Option<usize>,
    /// What the client kept from its last round, which the strategy holds on its behalf
    /// (pFedBayes' personalised posterior); it never travels, so it is not in `bytes_down`.
    pub state: Option<ParamTable>,
}

/// A round's plan: which clients train, from which models, with which objective and settings
/// (Flower's `configure_fit`).
#[derive(Clone)]
pub struct RoundPlan {
    /// The sampled clients' instructions, in dispatch order (a client may appear twice).
    pub clients: Vec<ClientInstruction>,
    /// Local training settings of this round.
    pub train: TrainConfig,
}

impl RoundPlan {
    /// Client `clients[i]` starts from `starts[i]` on the plain loss with `train`.
    pub fn new(train: &TrainConfig, clients: &[usize], starts: Vec<ParamTable>) -> Self {
        debug_assert_eq!(clients.len(), starts.len());
        let clients = clients
            .iter()
            .zip(starts)
            .map(|(&client, start)| ClientInstruction {
                client,
                bytes_down: start.byte_size(),
                start,
                objective: None,
                bytes_up: None,
                start_architecture: None,
                state: None,
            })
            .collect();
        Self {
            clients,
            train: train.clone(),
        }
    }

    /// Gives the clients their local objectives (in dispatch order).
    pub fn with_objectives(mut self, objectives: Vec<Option<Arc<dyn LocalObjective>>>) -> Self {
        debug_assert_eq!(objectives.len(), self.clients.len());
        for (c, o) in self.clients.iter_mut().zip(objectives) {
            c.objective = o;
        }
        self
    }

    /// Gives the clients their own kept state (in dispatch order).
    pub fn with_states(mut self, states: Vec<Option<ParamTable>>) -> Self {
        debug_assert_eq!(states.len(), self.clients.len());
        for (c, s) in self.clients.iter_mut().zip(states) {
            c.state = s;
        }
        self
    }

    /// The sampled clients, in dispatch order.
    pub fn client_ids(&self) -> Vec<usize> {
        self.clients.iter().map(|c| c.client).collect()
    }
}

/// Personalisation before a per-client evaluation: `steps` plain SGD steps at `lr` on the
/// client's own training samples, from the model it is evaluated with (Per-FedAvg's evaluation;
/// optional for global methods evaluated per client).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FineTune {
    /// SGD steps (mini-batches of the run's batch size; 0: none).
    pub steps: usize,
    /// Their step size.
    pub lr: f64,
    /// λ of a proximal term `(λ/2)‖θ − w‖²` to the model being personalised (pFedMe's
    /// personalised model); `None`: plain steps.
    #[serde(default)]
    pub proximal: Option<f64>,
}

/// Evaluation services the engine offers a strategy (it knows the models, the data and the
/// thread pool).
pub trait Evaluator: Sync {
    /// Accuracy and mean cross-entropy of `table` (the run's architecture) on the test set.
    fn test_set(&self, table: &ParamTable) -> Result<(f64, f64), StrategyError>;

    /// Accuracy and mean cross-entropy of each `(client, model)` on that client's own test
    /// portion, in order (personalised FL).
    fn client_tests(
        &self,
        models: &[(usize, ParamTable)],
    ) -> Result<Vec<(f64, f64)>, StrategyError>;

    /// How many clients have their own test portion (0: the run has one shared test set).
    fn client_count(&self) -> usize;

    /// The run's personalisation before a per-client evaluation of a global model, when the
    /// strategy has none of its own.
    fn client_fine_tune(&self) -> Option<FineTune>;

    /// Each `(client, model)` after `tune` on that client's training samples, in order.
    fn fine_tune(
        &self,
        round: usize,
        models: &[(usize, ParamTable)],
        tune: &FineTune,
    ) -> Result<Vec<ParamTable>, StrategyError>;
}

/// What an evaluation reports: the round's headline accuracy and loss (the global model's, or
/// the mean over clients of their own models') and any further metrics.
#[derive(Debug, Clone, Default)]
pub struct Evaluation {
    /// Accuracy in `[0, 1]`.
    pub acc: f64,
    /// Mean cross-entropy.
    pub loss: f64,
    /// Further metrics (merged into `metrics.jsonl`).
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// Metrics a strategy adds to a round's line of `metrics.jsonl`.
pub type Metrics = serde_json::Map<String, serde_json::Value>;

/// A federated-learning server algorithm as a small state machine over server state, shaped
/// like Flower's `Strategy`: [`configure_round`](Self::configure_round) says who trains what,
/// [`aggregate`](Self::aggregate) turns the uploads into the new state,
/// [`evaluate`](Self::evaluate) reports how good the state is. It never trains and never
/// touches files; the engine ([`Simulation`](crate::Simulation)) does both for every strategy.
pub trait Strategy: Send {
    /// Short name for logs and checkpoints.
    fn name(&self) -> &'static str;

    /// Sets up the server state from the initial model; `sample` is the number of clients
    /// per round.
    fn init(&mut self, initial: ParamTable, sample: usize) -> Result<(), StrategyError>;

    /// This round's plan: which clients train (by default `ctx.sample_uniform()`), the model
    /// each starts from, its local objective and the training settings.
    fn configure_round(&mut self, ctx: &mut RoundContext<'_>) -> Result<RoundPlan>;

    /// Turns the uploads (in dispatch order) into the new server state. Returns extra
    /// per-round metrics.
    fn aggregate(&mut self, at: ServerRound<'_>, updates: Vec<LocalUpdate>) -> Result<Metrics>;

    /// Evaluates the server state. By default: the [global model](Self::global_model) on the
    /// test set, or, when clients have their own test portions, on each of them after the
    /// strategy's [`fine_tune`](Self::fine_tune) (the mean over clients, as pFedClub's Table 2
    /// reports FedAvg and Per-FedAvg); personalised strategies evaluate each client's own model.
    fn evaluate(&mut self, round: usize, eval: &dyn Evaluator) -> Result<Evaluation> {
        let global = self.global_model()?;
        if eval.client_count() > 0 {
            let tune = self.fine_tune().or(eval.client_fine_tune());
            return personal::evaluate_global(round, eval, &global, tune);
        }
        let (acc, loss) = eval.test_set(&global)?;
        Ok(Evaluation {
            acc,
            loss,
            extra: Metrics::new(),
        })
    }

    /// The personalisation a per-client evaluation of the global model starts with (`None`:
    /// none).
    fn fine_tune(&self) -> Option<FineTune> {
        None
    }

    /// The deployable global model ([`StrategyError::NoGlobalModel`] for personalised
    /// strategies, whose clients each keep their own).
    fn global_model(&self) -> Result<ParamTable, StrategyError>;

    /// Per-client results to write as `clients.json` at the end of a run (personalised
    /// strategies); `None` by default.
    fn client_summary(&self) -> Option<serde_json::Value> {
        None
    }

    /// The layout of checkpoint slot `slot` when it differs from the initial model's
    /// (personalised strategies keep models of several architectures); `extra` is the saved
    /// [`StrategyState::extra`]. `None` (the default): the initial model's layout.
    fn checkpoint_layout(
        &self,
        slot: usize,
        extra: &serde_json::Value,
    ) -> Result<Option<ParamTable>, StrategyError> {
        let _ = (slot, extra);
        Ok(None)
    }

    /// The state to checkpoint.
    fn state(&self) -> StrategyState;

    /// Restores what [`state`](Self::state) returned (after [`init`](Self::init)).
    fn restore(&mut self, state: StrategyState) -> Result<(), StrategyError>;
}

/// The plan of FedAvg and of every strategy that keeps one server model: `ctx.sample` clients
/// drawn uniformly, each starting from the global model.
pub fn broadcast(
    global: Option<&ParamTable>,
    ctx: &mut RoundContext<'_>,
) -> Result<RoundPlan, StrategyError> {
    let global = global.ok_or(StrategyError::NotInitialised)?;
    let clients = ctx.sample_uniform();
    let starts = vec![global.clone(); clients.len()];
    Ok(RoundPlan::new(ctx.train, &clients, starts))
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

    /// The round's plan: `ctx.sample` clients drawn uniformly, model i going to the i-th;
    /// `algorithm` names the strategy in errors.
    pub fn plan(
        &self,
        algorithm: &str,
        ctx: &mut RoundContext<'_>,
    ) -> Result<RoundPlan, StrategyError> {
        let clients = ctx.sample_uniform();
        let starts = self.dispatch(algorithm, &clients)?;
        Ok(RoundPlan::new(ctx.train, &clients, starts))
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
