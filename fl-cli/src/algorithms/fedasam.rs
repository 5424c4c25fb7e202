//! FedASAM's settings.

use clap::Args;
use fl_core::Strategy;
use fl_core::strategy::{FedAsam, SharpnessAware};
use serde::{Deserialize, Serialize};

use super::{LabelCounts, Settings, defaults_from_flags};
use crate::config::RunSettings;

/// FedASAM's settings (its `[fedasam]` section).
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FedAsamSettings {
    /// Neighbourhood radius ρ.
    #[arg(long, default_value_t = 0.1)]
    pub rho: f64,
    /// η of the adaptive scaling |w| + η.
    #[arg(long, default_value_t = 0.0)]
    pub eta: f64,
    /// Plain SAM (FedSAM) instead of ASAM.
    #[arg(long)]
    pub sam: bool,
}

defaults_from_flags!(FedAsamSettings);

impl Settings for FedAsamSettings {
    fn strategy(&self, _: &RunSettings, _: LabelCounts<'_>) -> anyhow::Result<Box<dyn Strategy>> {
        let sharpness = if self.sam {
            SharpnessAware::sam(self.rho)
        } else {
            SharpnessAware::asam(self.rho, self.eta)
        };
        sharpness
            .validate()
            .map_err(|e| anyhow::anyhow!("--rho / --eta: {e}"))?;
        Ok(Box::new(FedAsam::new(sharpness)))
    }
}
