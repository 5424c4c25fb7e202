//! FedProx's settings.

use clap::Args;
use fl_core::Strategy;
use fl_core::strategy::FedProx;
use serde::{Deserialize, Serialize};

use super::{LabelCounts, Settings, defaults_from_flags, ensure};
use crate::config::RunSettings;

/// FedProx's settings (its `[fedprox]` section).
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FedProxSettings {
    /// Proximal weight μ (papers: 0.01 CIFAR-10, 0.001 CIFAR-100, 0.1 FEMNIST).
    #[arg(long, default_value_t = 0.01)]
    pub mu: f64,
}

defaults_from_flags!(FedProxSettings);

impl Settings for FedProxSettings {
    fn strategy(&self, _: &RunSettings, _: LabelCounts<'_>) -> anyhow::Result<Box<dyn Strategy>> {
        ensure(self.mu.is_finite() && self.mu >= 0.0, "--mu must be >= 0")?;
        Ok(Box::new(FedProx::new(self.mu)))
    }
}
