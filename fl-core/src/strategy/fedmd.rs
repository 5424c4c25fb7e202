//! FedMD (D. Li and J. Wang, "FedMD: Heterogenous Federated Learning via Model Distillation",
//! 2019): clients with different architectures collaborate through class scores on a labeled
//! public set, never through weights.
//!
//! - **Transfer learning**: a client first trains on the labeled public set (then on its own
//!   data, as every round ends).
//! - Each round: **communicate**: every participating client computes its scores (logits) on
//!   a fresh random alignment subset of the public set; the server averages them into the
//!   **consensus**; **digest**: each client trains its logits towards the consensus (mean
//!   absolute error, Adam, as the authors' Keras code); **revisit**: it trains on its own data
//!   (the run's local training).
//!
//! In this simulation the server keeps every client's model (pFedClub's per-client machinery,
//! `--variant fedmd`), so a sampled client's scores are computed from its kept model at the
//! start of the round; what travels is counted as FedMD's payload: the scores up, the
//! consensus and the alignment indices down, no weights either way.

use std::sync::Arc;
use std::time::Instant;

use rand::seq::index::sample;
use rayon::prelude::*;

use super::StrategyError;
use super::pfedclub::PublicData;
use crate::model::Classifier;
use crate::rng::{Purpose, rng_for};
use crate::trainer::{LocalObjective, PublicPhase, PublicTarget, make_batch};

/// FedMD's settings (defaults: the authors' CIFAR configuration, with transfer learning
/// shortened to a fixed number of epochs instead of early stopping).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct FedMdConfig {
    /// Public samples drawn per round for the consensus (the authors' `N_alignment`: 5000;
    /// all of them when the public set is smaller).
    pub alignment: usize,
    /// Epochs of the digest (`N_logits_matching_round`: 1).
    pub digest_epochs: usize,
    /// Batch size of the digest (`logits_matching_batchsize`: 256).
    pub digest_batch: usize,
    /// Epochs of transfer learning on the labeled public set in a client's first round (the
    /// authors train up to 20 with early stopping; 0 skips it).
    pub transfer_epochs: usize,
    /// Batch size of transfer learning (the authors': 128).
    pub transfer_batch: usize,
    /// Adam's learning rate of both public phases (the authors': 1e-3).
    pub lr: f64,
}

impl Default for FedMdConfig {
    fn default() -> Self {
        Self {
            alignment: 5000,
            digest_epochs: 1,
            digest_batch: 256,
            transfer_epochs: 5,
            transfer_batch: 128,
            lr: 1e-3,
        }
    }
}

impl FedMdConfig {
    /// Checks the values a run cannot work with.
    pub fn validate(&self) -> Result<(), String> {
        if self.alignment == 0 || self.digest_epochs == 0 {
            return Err("FedMD needs at least 1 alignment sample and 1 digest epoch".into());
        }
        if self.digest_batch == 0 || self.transfer_batch == 0 {
            return Err("FedMD's batch sizes must be at least 1".into());
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(format!(
                "FedMD's learning rate must be positive, got {}",
                self.lr
            ));
        }
        Ok(())
    }
}

/// A client's phase on public samples as its local objective (no other loss term).
pub struct OnPublic(pub PublicPhase);

impl LocalObjective for OnPublic {
    fn public_phase(&self) -> Option<&PublicPhase> {
        Some(&self.0)
    }

    fn uses_parameters(&self) -> bool {
        false
    }
}

/// The logits of `model` (in inference mode) on `samples`, row-major `[samples, classes]`,
/// computed in batches of `batch`.
pub fn scores<M: Classifier>(
    model: &M,
    public: &PublicData<'_>,
    samples: &[usize],
    batch: usize,
) -> Vec<f32> {
    let device = model.devices().into_iter().next().expect("a device");
    samples
        .chunks(batch.max(1))
        .flat_map(|chunk| {
            let (images, _) = make_batch(public.data, public.normalization, chunk, &device);
            let logits: Vec<f32> = model
                .infer(images)
                .into_data()
                .try_into_vec()
                .expect("f32 logits");
            logits
        })
        .collect()
}

/// The consensus: the element-wise mean of the uploaded scores (every client counts equally,
/// as in the paper). `None` without uploads.
pub fn consensus(uploads: &[Vec<f32>]) -> Option<Vec<f32>> {
    let first = uploads.first()?;
    let mut mean = vec![0.0f64; first.len()];
    for scores in uploads {
        debug_assert_eq!(scores.len(), mean.len());
        for (m, &s) in mean.iter_mut().zip(scores) {
            *m += s as f64;
        }
    }
    let n = uploads.len() as f64;
    Some(mean.into_iter().map(|m| (m / n) as f32).collect())
}

/// What each sampled client does in a FedMD round, in dispatch order.
pub struct RoundPlan {
    /// Its public phase: transfer learning (first round) or the digest.
    pub phases: Vec<Option<PublicPhase>>,
    /// Bytes it receives (consensus and alignment indices).
    pub bytes_down: Vec<usize>,
    /// Bytes it sends (its scores).
    pub bytes_up: Vec<usize>,
    /// Seconds spent computing the scores (the clients' communicate step).
    pub seconds: f64,
}

impl RoundPlan {
    /// The phases as the clients' local objectives.
    pub fn objectives(&self) -> Vec<Option<Arc<dyn LocalObjective>>> {
        self.phases
            .iter()
            .map(|p| {
                p.clone()
                    .map(|p| Arc::new(OnPublic(p)) as Arc<dyn LocalObjective>)
            })
            .collect()
    }
}

/// Plans round `round` for the `sampled` clients: a `fresh` one does not communicate and
/// starts with transfer learning on the labeled public set (when `transfer_epochs > 0`,
/// otherwise with nothing); every other one uploads its scores on the round's alignment subset
/// (drawn from the server's generator for FedMD) and digests their consensus. `model(c)` is
/// client `c`'s current model for inference. FedMD's fresh clients are those that never
/// trained, when there is transfer learning; FCCL's those that never trained.
pub fn plan<M: Classifier>(
    cfg: &FedMdConfig,
    (seed, round): (u64, usize),
    sampled: &[usize],
    fresh: &dyn Fn(usize) -> bool,
    model: &(dyn Fn(usize) -> Result<M, StrategyError> + Sync),
    public: &PublicData<'_>,
    batch: usize,
) -> Result<RoundPlan, StrategyError> {
    let timer = Instant::now();
    let mut rng = rng_for(seed, Purpose::Public, round as u64, u64::MAX);
    let n = cfg.alignment.min(public.samples.len());
    let mut alignment: Vec<usize> = sample(&mut rng, public.samples.len(), n)
        .into_iter()
        .map(|i| public.samples[i])
        .collect();
    alignment.sort_unstable();
    let communicating: Vec<usize> = sampled.iter().copied().filter(|&c| !fresh(c)).collect();
    let uploads: Vec<Vec<f32>> = communicating
        .par_iter()
        .map(|&c| Ok(scores(&model(c)?, public, &alignment, batch)))
        .collect::<Result<_, StrategyError>>()?;
    let consensus = consensus(&uploads).map(Arc::new);
    let score_bytes = 4 * alignment.len() * public.data.num_classes();
    let mut out = RoundPlan {
        phases: Vec::new(),
        bytes_down: Vec::new(),
        bytes_up: Vec::new(),
        seconds: timer.elapsed().as_secs_f64(),
    };
    for &c in sampled {
        let (phase, down, up) = match (&consensus, fresh(c)) {
            (_, true) => (
                (cfg.transfer_epochs > 0).then(|| PublicPhase {
                    samples: public.samples.to_vec(),
                    target: PublicTarget::Labels,
                    epochs: cfg.transfer_epochs,
                    batch_size: cfg.transfer_batch,
                    lr: cfg.lr,
                }),
                0,
                0,
            ),
            (Some(consensus), false) => (
                Some(PublicPhase {
                    samples: alignment.clone(),
                    target: PublicTarget::Scores(consensus.to_vec()),
                    epochs: cfg.digest_epochs,
                    batch_size: cfg.digest_batch,
                    lr: cfg.lr,
                }),
                score_bytes + 4 * alignment.len(),
                score_bytes,
            ),
            (None, false) => unreachable!("a communicating client makes a consensus"),
        };
        out.phases.push(phase);
        out.bytes_down.push(down);
        out.bytes_up.push(up);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_model::{synthetic_data, tiny};

    #[test]
    fn the_consensus_is_the_mean_of_the_uploaded_scores() {
        let (data, norm) = synthetic_data(12, 5);
        let samples: Vec<usize> = (0..12).collect();
        let public = PublicData {
            data: &data,
            normalization: &norm,
            samples: &samples,
        };
        let uploads: Vec<Vec<f32>> = (0..3)
            .map(|s| scores(&tiny(s), &public, &samples[2..9], 3))
            .collect();
        assert_eq!(uploads[0].len(), 7 * 10);
        // Batching does not change the scores.
        assert_eq!(uploads[1], scores(&tiny(1), &public, &samples[2..9], 100));
        let mean = consensus(&uploads).unwrap();
        for i in 0..mean.len() {
            let expected = (uploads[0][i] + uploads[1][i] + uploads[2][i]) / 3.0;
            assert!((mean[i] - expected).abs() < 1e-6);
        }
        assert_eq!(consensus(&uploads[..1]).unwrap(), uploads[0]);
        assert!(consensus(&[]).is_none());
    }

    #[test]
    fn new_clients_transfer_and_the_others_digest_the_consensus_of_the_communicating() {
        let (data, norm) = synthetic_data(20, 6);
        let samples: Vec<usize> = (4..20).collect();
        let public = PublicData {
            data: &data,
            normalization: &norm,
            samples: &samples,
        };
        let cfg = FedMdConfig {
            alignment: 6,
            ..FedMdConfig::default()
        };
        let model = |c: usize| Ok(tiny(c as u64));
        let fresh = |c: usize| c == 3;
        let round = plan(&cfg, (1, 2), &[3, 1, 2], &fresh, &model, &public, 4).unwrap();
        let objectives = round.objectives();
        let phase = |i: usize| objectives[i].as_ref().unwrap().public_phase().unwrap();
        assert_eq!(phase(0).target, PublicTarget::Labels);
        assert_eq!(phase(0).samples, samples);
        assert_eq!((round.bytes_down[0], round.bytes_up[0]), (0, 0));
        let alignment = phase(1).samples.clone();
        assert_eq!(alignment.len(), 6);
        assert!(alignment.iter().all(|s| samples.contains(s)));
        let expected = consensus(&[
            scores(&tiny(1), &public, &alignment, 4),
            scores(&tiny(2), &public, &alignment, 4),
        ])
        .unwrap();
        assert_eq!(phase(1).target, PublicTarget::Scores(expected.clone()));
        assert_eq!(phase(2), phase(1));
        assert_eq!(round.bytes_up[1], 4 * 6 * 10);
        assert_eq!(round.bytes_down[2], 4 * 6 * 10 + 4 * 6);
        // The same round draws the same subset; another round another one.
        let again = plan(&cfg, (1, 2), &[1], &fresh, &model, &public, 4).unwrap();
        assert_eq!(again.phases[0].as_ref().unwrap().samples, alignment);
        let next = plan(&cfg, (1, 3), &[1], &fresh, &model, &public, 4).unwrap();
        assert_ne!(next.phases[0].as_ref().unwrap().samples, alignment);
        // Without transfer learning a fresh client starts with nothing.
        let none = FedMdConfig {
            transfer_epochs: 0,
            ..cfg
        };
        let round = plan(&none, (1, 2), &[3, 1], &fresh, &model, &public, 4).unwrap();
        assert!(round.phases[0].is_none());
        assert!(matches!(
            round.phases[1].as_ref().unwrap().target,
            PublicTarget::Scores(_)
        ));
    }
}
