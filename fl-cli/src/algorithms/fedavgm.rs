//! FedAvgM's settings.

use clap::Args;
use fl_core::Strategy;
use fl_core::strategy::FedAvgM;
use serde::{Deserialize, Serialize};

use super::{LabelCounts, Settings, defaults_from_flags, ensure};
use crate::config::RunSettings;

/// FedAvgM's settings (its `[fedavgm]` section).
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FedAvgMSettings {
    /// Server momentum β.
    #[arg(long, default_value_t = 0.9)]
    pub server_momentum: f64,
    /// Server learning rate.
    #[arg(long, default_value_t = 1.0)]
    pub server_lr: f64,
    /// Weight uploads by the clients' sample counts (`--unweighted`: equal weights).
    #[arg(long = "unweighted", action = clap::ArgAction::SetFalse)]
    pub weighted: bool,
}

defaults_from_flags!(FedAvgMSettings);

impl Settings for FedAvgMSettings {
    fn strategy(&self, _: &RunSettings, _: LabelCounts<'_>) -> anyhow::Result<Box<dyn Strategy>> {
        ensure(self.server_lr > 0.0, "--server-lr must be > 0")?;
        ensure(
            (0.0..1.0).contains(&self.server_momentum),
            "--server-momentum must be in [0, 1)",
        )?;
        let mut s = FedAvgM::new(self.server_momentum, self.server_lr);
        s.server.weighted = self.weighted;
        Ok(Box::new(s))
    }
}
