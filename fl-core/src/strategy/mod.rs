//! Server strategies: which model each sampled client gets, and what the server does with the
//! uploads. A strategy never trains and never touches files; it speaks in [`ParamTable`]s.
//!
//! One algorithm, one file: [`fedavg`], [`fedmr`], [`fedcross`].

pub mod fedavg;
pub mod fedcross;
pub mod fedmr;

pub use fedavg::FedAvg;
pub use fedcross::{FedCross, FedCrossConfig};
pub use fedmr::{FedMr, FedMrConfig};

use rand_chacha::ChaCha8Rng;

use crate::layers::{LayerError, ParamTable};
use crate::trainer::LocalUpdate;

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
