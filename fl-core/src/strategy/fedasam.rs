//! FedASAM (Caldarola et al., ECCV 2022): FedAvg whose clients train with ASAM, adaptive
//! sharpness-aware minimisation (Kwon et al., ICML 2021), which steers them to flat minima.
//!
//! The steps themselves are the trainer's ([`SharpnessAware`]); FedASAM is FedAvg whose clients
//! take them. Paper defaults: ρ = 0.1, η = 0.

use super::StrategyState;
use super::fedavg_with::{ClientRule, FedAvgWith};
pub use crate::trainer::SharpnessAware;
use crate::trainer::TrainConfig;

/// FedAvg with ASAM (or SAM) local training.
pub type FedAsam = FedAvgWith<SharpnessAware>;

impl FedAsam {
    /// FedASAM with sample-weighted averaging.
    pub fn new(sharpness: SharpnessAware) -> Self {
        Self::with_rule(sharpness)
    }
}

impl ClientRule for SharpnessAware {
    fn name(&self) -> &'static str {
        "fedasam"
    }

    fn train(&self, base: &TrainConfig) -> TrainConfig {
        TrainConfig {
            sharpness: Some(*self),
            ..base.clone()
        }
    }

    fn save(&self, state: &mut StrategyState) {
        state.extra["sharpness"] = serde_json::to_value(self).expect("settings serialise");
    }
}
