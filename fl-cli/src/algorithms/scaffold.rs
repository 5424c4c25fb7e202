//! SCAFFOLD's settings.

use clap::Args;
use fl_core::Strategy;
use fl_core::strategy::{Scaffold, ScaffoldConfig};
use serde::{Deserialize, Serialize};

use super::{LabelCounts, Settings, defaults_from_flags, ensure};
use crate::config::RunSettings;

/// SCAFFOLD's settings (its `[scaffold]` section).
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScaffoldSettings {
    /// Server learning rate η_g.
    #[arg(long, default_value_t = 1.0)]
    pub server_lr: f64,
}

defaults_from_flags!(ScaffoldSettings);

impl Settings for ScaffoldSettings {
    fn strategy(&self, run: &RunSettings, _: LabelCounts<'_>) -> anyhow::Result<Box<dyn Strategy>> {
        ensure(self.server_lr > 0.0, "--server-lr must be > 0")?;
        Ok(Box::new(Scaffold::new(ScaffoldConfig {
            server_lr: self.server_lr,
            local_lr: run.lr,
            num_clients: run.clients,
        })))
    }
}
