//! FedExP's settings.

use clap::Args;
use fl_core::Strategy;
use fl_core::strategy::FedExP;
use serde::{Deserialize, Serialize};

use super::{LabelCounts, Settings, defaults_from_flags, ensure};
use crate::config::RunSettings;

/// FedExP's settings (its `[fedexp]` section).
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FedExpSettings {
    /// ε of the step-size rule.
    #[arg(long, default_value_t = 1e-3)]
    pub epsilon: f64,
}

defaults_from_flags!(FedExpSettings);

impl Settings for FedExpSettings {
    fn strategy(&self, _: &RunSettings, _: LabelCounts<'_>) -> anyhow::Result<Box<dyn Strategy>> {
        ensure(self.epsilon > 0.0, "--epsilon must be > 0")?;
        Ok(Box::new(FedExP::new(self.epsilon)))
    }
}
