//! FedCross's settings.

use clap::Args;
use fl_core::Strategy;
use fl_core::strategy::fedcross::{DynamicAlpha, PartnerSelection, SimilarityMeasure};
use fl_core::strategy::{FedCross, FedCrossConfig};
use serde::{Deserialize, Serialize};

use super::{LabelCounts, Settings, defaults_from_flags};
use crate::config::RunSettings;

/// FedCross's settings (its `[fedcross]` section).
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FedCrossSettings {
    /// Weight of a model's own upload in its fusion wᵢ = α·vᵢ + (1 − α)·v_co (paper: 0.99).
    #[arg(long, value_name = "ALPHA", default_value_t = 0.99)]
    pub cross_alpha: f64,
    /// Partner selection: lowest (the paper's choice), highest similarity, or in-order.
    #[arg(long, default_value = "lowest")]
    pub select: PartnerSelection,
    /// Similarity for partner selection: cosine (whole model), layer-cosine (sum of per-layer
    /// cosines, as the authors' code) or paper (Eq. 5 as printed).
    #[arg(long, default_value = "cosine")]
    pub similarity: SimilarityMeasure,
    /// Aggregate the first R rounds with FedAvg, then cross-aggregate.
    #[arg(long, value_name = "R", default_value_t = 0)]
    pub first_stage: usize,
    /// Fuse each model with two in-order propeller partners for the first N cross rounds.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub propellers: usize,
    /// Grow α linearly from START to END over ROUNDS rounds (after any propeller rounds).
    #[arg(long, value_name = "START:END:ROUNDS")]
    #[serde(with = "as_text", skip_serializing_if = "Option::is_none")]
    pub dynamic_alpha: Option<DynamicAlpha>,
    /// Fuse only trainable parameters; keep each model's BatchNorm statistics.
    #[arg(long)]
    pub trainable_only: bool,
}

defaults_from_flags!(FedCrossSettings);

impl Settings for FedCrossSettings {
    fn strategy(&self, _: &RunSettings, _: LabelCounts<'_>) -> anyhow::Result<Box<dyn Strategy>> {
        let config = FedCrossConfig {
            alpha: self.cross_alpha,
            selection: self.select,
            similarity: self.similarity,
            first_stage: self.first_stage,
            propeller_rounds: self.propellers,
            dynamic_alpha: self.dynamic_alpha,
            trainable_only: self.trainable_only,
        };
        config
            .validate()
            .map_err(|e| anyhow::anyhow!("--cross-alpha / --dynamic-alpha: {e}"))?;
        Ok(Box::new(FedCross::new(config)))
    }
}

/// The α schedule as its flag's text (`START:END:ROUNDS`) in `config.toml`.
mod as_text {
    use fl_core::strategy::fedcross::DynamicAlpha;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &Option<DynamicAlpha>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(a) => s.serialize_str(&format!("{}:{}:{}", a.start, a.end, a.rounds)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<DynamicAlpha>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|text| text.parse().map_err(serde::de::Error::custom))
            .transpose()
    }
}
