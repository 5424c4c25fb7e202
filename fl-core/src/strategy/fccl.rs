//! FCCL (W. Huang, M. Ye and B. Du, "Learn from Others and Be Yourself in Heterogeneous
//! Federated Learning", CVPR 2022): clients with different architectures learn from each other
//! on *unlabeled* public data, and distil to avoid forgetting.
//!
//! - **Federated cross-correlation learning**: on a public batch, the cross-correlation matrix
//!   M of the client's batch-standardised logits and the batch-standardised average logits of
//!   all participants should be the identity: Σᵢ (1 − Mᵢᵢ)² + λ Σᵢ≠ⱼ Mᵢⱼ²
//!   ([`cross_correlation_loss`](crate::trainer::cross_correlation_loss)).
//! - **Federated non-forgetting distillation**: then, on its private data, cross-entropy plus
//!   KL(teacher ‖ model) towards two teachers: the *inter-domain* one, its model before this
//!   round's collaborative update (the end of its last round), and the *intra-domain* one, its
//!   model pretrained on its own data.
//!
//! Communication is FedMD's ([`fedmd::plan`](super::fedmd::plan)): the sampled clients' scores on a fresh
//! alignment draw of the public set, averaged by the server (computed from their kept models
//! at the start of the round, where the authors average batch by batch as the models move). A
//! client's first round is its pretraining (plain local training); its result is kept as its
//! intra-domain teacher. Runs on pFedClub's per-client machinery (`--variant fccl`).

use burn::tensor::Tensor;
use burn::tensor::activation::{log_softmax, softmax};

use super::fedmd::FedMdConfig;
use crate::model::Classifier;
use crate::trainer::{BatchContext, LocalObjective, PublicPhase, PublicTarget};

/// FCCL's settings (defaults: the authors' best arguments for digits).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct FcclConfig {
    /// Public samples drawn per round (the authors' `public_len`: 5000).
    pub alignment: usize,
    /// Passes of the collaborative update over them (`public_epoch`: 1).
    pub epochs: usize,
    /// Its batch size (`public_batch_size`: 256).
    pub batch: usize,
    /// Its Adam step size (`public_lr`: 0.001).
    pub lr: f64,
    /// λ, the off-diagonal weight (`off_diag_weight`: 0.0051).
    pub off_diagonal: f64,
    /// Push off-diagonal correlations towards −1, as the authors' code does (`(c + 1)²`),
    /// instead of the paper's 0.
    pub authors_off_diagonal: bool,
}

impl Default for FcclConfig {
    fn default() -> Self {
        Self {
            alignment: 5000,
            epochs: 1,
            batch: 256,
            lr: 1e-3,
            off_diagonal: 0.0051,
            authors_off_diagonal: false,
        }
    }
}

impl FcclConfig {
    /// Checks the values a run cannot work with.
    pub fn validate(&self) -> Result<(), String> {
        if self.batch < 2 {
            return Err("FCCL's public batch needs at least 2 samples (a correlation)".into());
        }
        if !(self.off_diagonal.is_finite() && self.off_diagonal >= 0.0) {
            return Err(format!(
                "FCCL's off-diagonal weight must be >= 0, got {}",
                self.off_diagonal
            ));
        }
        self.communication().validate()
    }

    /// The communication it shares with FedMD (no transfer learning: the public data is
    /// unlabeled).
    pub fn communication(&self) -> FedMdConfig {
        FedMdConfig {
            alignment: self.alignment,
            digest_epochs: self.epochs,
            digest_batch: self.batch,
            transfer_epochs: 0,
            transfer_batch: 1,
            lr: self.lr,
        }
    }

    /// FedMD's digest of the consensus turned into FCCL's collaborative update.
    pub fn collaborative(&self, digest: PublicPhase) -> PublicPhase {
        let target = match digest.target {
            PublicTarget::Scores(scores) => PublicTarget::CrossCorrelation {
                scores,
                off_diagonal: self.off_diagonal,
                off_target: if self.authors_off_diagonal { -1.0 } else { 0.0 },
            },
            other => other,
        };
        PublicPhase { target, ..digest }
    }
}

/// A client's FCCL round after its first: the collaborative update on public data, then
/// private training with KL(teacher ‖ model) towards each teacher (inter- and intra-domain).
pub struct FcclClient<M> {
    /// The collaborative update.
    pub phase: PublicPhase,
    /// The teachers, in inference mode.
    pub teachers: Vec<M>,
}

impl<M: Classifier> LocalObjective for FcclClient<M> {
    fn uses_parameters(&self) -> bool {
        false
    }

    fn public_phase(&self) -> Option<&PublicPhase> {
        Some(&self.phase)
    }

    /// Σ over the teachers of KL(p_teacher ‖ p_model), averaged over the batch (PyTorch's
    /// `KLDivLoss(reduction='batchmean')`, as the authors').
    fn batch_loss(&self, batch: &BatchContext<'_>) -> Option<Tensor<1>> {
        let log_q = log_softmax(batch.logits.clone(), 1);
        self.teachers
            .iter()
            .map(|t| {
                let logits = t.infer(batch.images.clone().inner());
                let p = softmax(logits.clone(), 1);
                (p * (log_softmax(logits, 1) - log_q.clone()))
                    .sum_dim(1)
                    .mean()
            })
            .reduce(|a, b| a + b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_collaborative_update_replaces_the_digest_loss_only() {
        let digest = PublicPhase {
            samples: vec![1, 2, 3],
            target: PublicTarget::Scores(vec![0.5; 30]),
            epochs: 1,
            batch_size: 256,
            lr: 1e-3,
        };
        let cfg = FcclConfig::default();
        let phase = cfg.collaborative(digest.clone());
        assert_eq!(
            (phase.samples.clone(), phase.epochs),
            (digest.samples.clone(), 1)
        );
        assert_eq!(
            phase.target,
            PublicTarget::CrossCorrelation {
                scores: vec![0.5; 30],
                off_diagonal: 0.0051,
                off_target: 0.0
            }
        );
        let authors = FcclConfig {
            authors_off_diagonal: true,
            ..cfg
        };
        assert!(matches!(
            authors.collaborative(digest).target,
            PublicTarget::CrossCorrelation { off_target, .. } if off_target == -1.0
        ));
        assert_eq!(authors.communication().transfer_epochs, 0);
        assert!(
            FcclConfig {
                batch: 1,
                ..FcclConfig::default()
            }
            .validate()
            .is_err()
        );
    }
}
