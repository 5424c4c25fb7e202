//! Backend-generic Burn models for federated-learning experiments, each declaring its blocks.
//!
//! Models implement [`fl_core::Classifier`]; [`ModelKind`] names them for the command line.

mod cnn;
mod cnn_fedavg;

pub use cnn::{Cnn, CnnConfig};
pub use cnn_fedavg::{CnnFedAvg, CnnFedAvgConfig};

use std::str::FromStr;

/// The models this crate provides, by command-line name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ModelKind {
    /// The FedMR/FedCross authors' CNN ([`Cnn`]).
    Cnn,
    /// McMahan et al.'s FedAvg CNN ([`CnnFedAvg`]).
    CnnFedavg,
}

/// The model name is not one this crate knows.
#[derive(Debug, thiserror::Error)]
#[error("unknown model '{0}' (known: cnn, cnn-fedavg)")]
pub struct UnknownModel(pub String);

impl FromStr for ModelKind {
    type Err = UnknownModel;
    fn from_str(s: &str) -> Result<Self, UnknownModel> {
        match s {
            "cnn" => Ok(Self::Cnn),
            "cnn-fedavg" => Ok(Self::CnnFedavg),
            _ => Err(UnknownModel(s.to_string())),
        }
    }
}

impl ModelKind {
    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Cnn => "cnn",
            Self::CnnFedavg => "cnn-fedavg",
        }
    }

    /// Every model, for listings.
    pub fn all() -> &'static [ModelKind] {
        &[Self::Cnn, Self::CnnFedavg]
    }
}
