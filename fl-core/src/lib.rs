//! The core of the framework: the record-level layer API, the local trainer, the server
//! strategies and the simulation engine.
//!
//! - [`layers`]: a model as an ordered table of named device tensors grouped into layers and
//!   blocks; average, α-mix, similarity, recombination.
//! - [`trainer`]: local SGD on one client, evaluation.
//! - [`strategy`]: the [`Strategy`] trait (configure a round, aggregate, evaluate) and one file
//!   per algorithm ([`FedAvg`], ..., pFedClub).
//! - [`engine`]: the one round loop for global and personalised FL: parallel clients, metrics,
//!   checkpoints.
//! - [`landscape`]: loss surfaces along filter-normalised random directions.
//! - [`secure`]: FedMR's encrypted client-to-client layer exchange.
//! - [`bayes`]: mean-field Gaussian posteriors over any model (pFedBayes).
//! - [`rng`]: seeded randomness independent of thread scheduling.

pub mod bayes;
pub mod checkpoint;
pub mod engine;
pub mod landscape;
pub mod layers;
mod model;
mod model_file;
pub mod rng;
pub mod secure;
pub mod strategy;
pub mod trainer;

#[cfg(test)]
pub(crate) mod test_model;

pub use engine::{ClientModels, EngineConfig, EngineError, RoundMetrics, RunSummary, Simulation};
pub use layers::{BlockSpec, Granularity, ParamTable};
pub use model::{BlockForward, Classifier, Features, map_in_chunks};
pub use strategy::{Evaluation, Evaluator, FedAvg, RoundContext, RoundPlan, Strategy};
pub use trainer::{LocalObjective, TrainConfig};
