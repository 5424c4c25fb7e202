//! FedAvg's and FedIndep's settings.

use clap::Args;
use fl_core::strategy::FedMr;
use fl_core::{FedAvg, Strategy};
use serde::{Deserialize, Serialize};

use super::{LabelCounts, Settings, defaults_from_flags};
use crate::config::RunSettings;

/// FedAvg's settings (its `[fedavg]` section).
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FedAvgSettings {
    /// Weight uploads by the clients' sample counts (`--unweighted`: equal weights).
    #[arg(long = "unweighted", action = clap::ArgAction::SetFalse)]
    pub weighted: bool,
}

/// FedIndep's settings (its `[fedindep]` section).
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FedIndepSettings {
    /// Also evaluate each of the K models (`model_acc` in metrics.jsonl; `fl plot --models`).
    #[arg(long)]
    pub eval_models: bool,
}

defaults_from_flags!(FedAvgSettings, FedIndepSettings);

impl Settings for FedAvgSettings {
    fn strategy(&self, _: &RunSettings, _: LabelCounts<'_>) -> anyhow::Result<Box<dyn Strategy>> {
        Ok(Box::new(if self.weighted {
            FedAvg::weighted()
        } else {
            FedAvg::unweighted()
        }))
    }
}

impl Settings for FedIndepSettings {
    fn strategy(&self, _: &RunSettings, _: LabelCounts<'_>) -> anyhow::Result<Box<dyn Strategy>> {
        Ok(Box::new(
            FedMr::fedindep().with_model_evaluation(self.eval_models),
        ))
    }
}
