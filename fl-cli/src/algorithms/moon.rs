//! MOON's settings.

use clap::Args;
use fl_core::Strategy;
use fl_core::strategy::Moon;
use serde::{Deserialize, Serialize};

use super::{LabelCounts, Settings, defaults_from_flags, ensure};
use crate::config::RunSettings;

/// MOON's settings (its `[moon]` section).
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MoonSettings {
    /// Weight μ of the contrastive term (default: the MOON paper's value for the dataset, 1
    /// for CIFAR-100 and FEMNIST, 5 otherwise).
    #[arg(long)]
    pub moon_mu: Option<f64>,
    /// Temperature τ.
    #[arg(long, default_value_t = 0.5)]
    pub tau: f64,
}

defaults_from_flags!(MoonSettings);

/// The MOON paper's μ for a dataset: 1 for CIFAR-100 (and FEMNIST, by analogy), 5 otherwise.
pub fn default_mu(dataset: &str) -> f64 {
    if dataset.starts_with("cifar100") || dataset == "femnist" {
        1.0
    } else {
        5.0
    }
}

impl Settings for MoonSettings {
    fn settle(&mut self, run: &mut RunSettings) {
        self.moon_mu.get_or_insert_with(|| default_mu(&run.dataset));
    }

    fn strategy(&self, run: &RunSettings, _: LabelCounts<'_>) -> anyhow::Result<Box<dyn Strategy>> {
        let mu = self.moon_mu.unwrap_or_else(|| default_mu(&run.dataset));
        ensure(mu.is_finite() && mu >= 0.0, "--moon-mu must be >= 0")?;
        ensure(self.tau.is_finite() && self.tau > 0.0, "--tau must be > 0")?;
        Ok(Box::new(Moon::new(mu, self.tau)))
    }
}
