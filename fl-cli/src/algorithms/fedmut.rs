//! FedMut's settings.

use clap::Args;
use fl_core::Strategy;
use fl_core::strategy::{FedMut, FedMutConfig};
use serde::{Deserialize, Serialize};

use super::{LabelCounts, Settings, defaults_from_flags, ensure};
use crate::config::RunSettings;

/// FedMut's settings (its `[fedmut]` section).
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FedMutSettings {
    /// Mutation radius α.
    #[arg(long, default_value_t = 4.0)]
    pub mut_radius: f64,
    /// Initial imbalance of the mutation pairs, decaying to 0 over --mut-bound rounds.
    #[arg(long, default_value_t = 0.3)]
    pub mut_rate: f64,
    /// Rounds over which the imbalance decays.
    #[arg(long, default_value_t = 100)]
    pub mut_bound: usize,
}

defaults_from_flags!(FedMutSettings);

impl Settings for FedMutSettings {
    fn strategy(&self, _: &RunSettings, _: LabelCounts<'_>) -> anyhow::Result<Box<dyn Strategy>> {
        ensure(self.mut_radius >= 0.0, "--mut-radius must be >= 0")?;
        ensure(
            (0.0..=1.0).contains(&self.mut_rate),
            "--mut-rate must be in [0, 1]",
        )?;
        ensure(self.mut_bound >= 1, "--mut-bound must be >= 1")?;
        Ok(Box::new(FedMut::new(FedMutConfig {
            radius: self.mut_radius,
            rate: self.mut_rate,
            bound: self.mut_bound,
        })))
    }
}
