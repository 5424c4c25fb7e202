//! Clustered sampling's settings.

use clap::Args;
use fl_core::Strategy;
use fl_core::strategy::clusamp::{LinkageInput, UpdateDistance};
use fl_core::strategy::{Clusamp, ClusampConfig};
use serde::{Deserialize, Serialize};

use super::{LabelCounts, Settings, defaults_from_flags, parse_name};
use crate::config::RunSettings;

/// Clustered sampling's settings (its `[clusamp]` section).
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusampSettings {
    /// Distance between updates: arccos, l1, l2.
    #[arg(long, value_parser = parse_name::<UpdateDistance>, default_value = "arccos")]
    pub cluster_distance: UpdateDistance,
    /// What Ward's linkage clusters: `rows` of the distance matrix (the authors' code) or the
    /// `distances` themselves.
    #[arg(long, value_parser = parse_name::<LinkageInput>, default_value = "rows")]
    pub linkage: LinkageInput,
}

defaults_from_flags!(ClusampSettings);

impl Settings for ClusampSettings {
    fn strategy(&self, _: &RunSettings, _: LabelCounts<'_>) -> anyhow::Result<Box<dyn Strategy>> {
        Ok(Box::new(Clusamp::new(ClusampConfig {
            distance: self.cluster_distance,
            linkage: self.linkage,
        })))
    }
}
