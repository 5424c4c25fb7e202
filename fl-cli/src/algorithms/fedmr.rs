//! FedMR's settings.

use anyhow::bail;
use clap::{Args, ValueEnum};
use fl_core::secure::SecureExchange;
use fl_core::strategy::{FedMr, FedMrConfig};
use fl_core::{Granularity, Strategy};
use serde::{Deserialize, Serialize};

use super::{LabelCounts, Settings, defaults_from_flags};
use crate::config::RunSettings;

/// The unit FedMR shuffles across models.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Unit {
    /// Every tensor on its own (the authors' code).
    Tensor,
    /// All tensors of a layer together (the paper).
    Layer,
    /// All tensors of a declared block together.
    Block,
    /// Contiguous segments of layers (`--segment-fraction`).
    Segments,
}

/// FedMR's settings (its `[fedmr]` section).
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FedMrSettings {
    /// Unit shuffled across models.
    #[arg(long, value_enum, default_value = "tensor")]
    pub granularity: Unit,
    /// With `--granularity segments`: fraction of layers per segment (FedMR-px ablation;
    /// 1.0 = whole models, i.e. FedIndep).
    #[arg(long, value_name = "X", default_value_t = 0.5)]
    pub segment_fraction: f64,
    /// Aggregate the first R rounds with FedAvg, then recombine (paper: 100 for ResNet/VGG).
    #[arg(long, value_name = "R", default_value_t = 0)]
    pub first_stage: usize,
    /// Secure recombination: clients exchange HPKE-encrypted layers before upload.
    #[arg(long)]
    pub secure: bool,
    /// Exchange passes per round with `--secure`.
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub secure_passes: usize,
    /// Also evaluate each of the K models (`model_acc` in metrics.jsonl; `fl plot --models`).
    #[arg(long)]
    pub eval_models: bool,
}

defaults_from_flags!(FedMrSettings);

impl FedMrSettings {
    /// FedMR's configuration, checked.
    pub fn config(&self) -> anyhow::Result<FedMrConfig> {
        if self.secure && self.secure_passes == 0 {
            bail!("--secure-passes must be at least 1");
        }
        let granularity = match self.granularity {
            Unit::Tensor => Granularity::Tensor,
            Unit::Layer => Granularity::Layer,
            Unit::Block => Granularity::Block,
            Unit::Segments => {
                let fraction = self.segment_fraction;
                if !(fraction > 0.0 && fraction <= 1.0) {
                    bail!("--segment-fraction must be in (0, 1], got {fraction}");
                }
                Granularity::Segments { fraction }
            }
        };
        Ok(FedMrConfig {
            granularity,
            first_stage: self.first_stage,
            secure: self.secure.then_some(SecureExchange {
                passes: self.secure_passes,
            }),
        })
    }
}

impl Settings for FedMrSettings {
    fn strategy(&self, _: &RunSettings, _: LabelCounts<'_>) -> anyhow::Result<Box<dyn Strategy>> {
        Ok(Box::new(
            FedMr::new(self.config()?).with_model_evaluation(self.eval_models),
        ))
    }
}
