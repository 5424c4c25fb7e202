//! Training on the server's public samples before the client's own (FedMD's transfer learning
//! on the labeled public set and its digest of the consensus scores).

use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::GradientsParams;
use burn::tensor::{Tensor, TensorData};
use fl_data::{Dataset, Normalization};
use rand::seq::SliceRandom;

use super::{FusedAdam, TrainError, epoch_sum, make_batch, model_device};
use crate::model::Classifier;
use crate::rng::{Purpose, rng_for};

/// What the model is trained towards on the public samples.
#[derive(Debug, Clone, PartialEq)]
pub enum PublicTarget {
    /// The samples' labels, with cross-entropy (FedMD's transfer learning).
    Labels,
    /// Scores (logits) per sample, row-major `[samples, classes]`, with the mean absolute
    /// error (FedMD's digest of the consensus: Keras' `mean_absolute_error` on the logits).
    Scores(Vec<f32>),
    /// Scores as above, fitted by FCCL's cross-correlation loss
    /// ([`cross_correlation_loss`]).
    CrossCorrelation {
        /// The consensus scores, row-major `[samples, classes]`.
        scores: Vec<f32>,
        /// λ, the weight of the off-diagonal term.
        off_diagonal: f64,
        /// What the off-diagonal entries are pushed towards: 0 (the paper) or −1 (the
        /// authors' code).
        off_target: f64,
    },
}

impl PublicTarget {
    fn scores(&self) -> Option<&[f32]> {
        match self {
            Self::Labels => None,
            Self::Scores(s) | Self::CrossCorrelation { scores: s, .. } => Some(s),
        }
    }
}

/// Each column of `z` (`[batch, classes]`) standardised over the batch (population variance,
/// plus 1e-8 against constant columns).
fn standardise(z: Tensor<2>) -> Tensor<2> {
    let centred = z.clone() - z.mean_dim(0);
    let var = centred.clone().powf_scalar(2.0).mean_dim(0);
    centred / var.add_scalar(1e-8).sqrt()
}

/// FCCL's loss between a batch's logits and the consensus `target` (both `[B, C]`): with
/// M = Z̃ᵀ T̃ / B the cross-correlation of the batch-standardised logits,
/// Σᵢ (1 − Mᵢᵢ)² + λ Σᵢ≠ⱼ (Mᵢⱼ − `off_target`)². Its diagonal part is 0, its minimum, when the
/// logits equal the consensus (Mᵢᵢ ≤ 1 by Cauchy–Schwarz).
pub fn cross_correlation_loss(
    logits: Tensor<2>,
    target: Tensor<2>,
    off_diagonal: f64,
    off_target: f64,
) -> Tensor<1> {
    let [batch, classes] = logits.dims();
    let device = logits.device();
    let m = standardise(logits)
        .transpose()
        .matmul(standardise(target))
        .div_scalar(batch as f64);
    let eye: Vec<f32> = (0..classes * classes)
        .map(|k| f32::from(u8::from(k % (classes + 1) == 0)))
        .collect();
    let eye = Tensor::<2>::from_data(TensorData::new(eye, [classes, classes]), &device);
    let on = (m.clone().sub_scalar(1.0) * eye.clone())
        .powf_scalar(2.0)
        .sum();
    let off = (m.sub_scalar(off_target) * eye.neg().add_scalar(1.0))
        .powf_scalar(2.0)
        .sum();
    on + off.mul_scalar(off_diagonal)
}

/// A phase of Adam steps on public samples that runs before the client's private training.
#[derive(Debug, Clone, PartialEq)]
pub struct PublicPhase {
    /// The public samples (indices into the client's dataset, which holds the pooled samples).
    pub samples: Vec<usize>,
    /// What they are fitted to.
    pub target: PublicTarget,
    /// Passes over the samples.
    pub epochs: usize,
    /// Mini-batch size.
    pub batch_size: usize,
    /// Adam's learning rate (FedMD's Keras models: Adam at 1e-3).
    pub lr: f64,
}

impl PublicPhase {
    /// Checks that the targets fit the samples.
    fn check(&self, classes: usize) -> Result<(), TrainError> {
        if let Some(s) = self.target.scores()
            && s.len() != self.samples.len() * classes
        {
            return Err(TrainError::Public(format!(
                "{} scores for {} samples of {classes} classes",
                s.len(),
                self.samples.len()
            )));
        }
        Ok(())
    }
}

/// Runs `phase` on `model` (client `client` in round `round`, on its own shuffling stream) and
/// returns the model and the phase's mean batch loss. A fresh Adam optimiser is used: the
/// private training that follows starts its own.
pub fn train<M: Classifier>(
    mut model: M,
    phase: &PublicPhase,
    data: &Dataset,
    norm: &Normalization,
    (seed, round, client): (u64, usize, usize),
) -> Result<(M, f64), TrainError> {
    phase.check(data.num_classes())?;
    if phase.samples.is_empty() || phase.epochs == 0 {
        return Ok((model, 0.0));
    }
    let device = model_device(&model);
    let classes = data.num_classes();
    let mut optim = FusedAdam::pytorch(0.0).init();
    let ce = CrossEntropyLossConfig::new().init(&device);
    let mut rng = rng_for(seed, Purpose::Public, round as u64, client as u64);
    // Positions into `samples`, so that score rows follow their samples through the shuffle.
    let mut order: Vec<usize> = (0..phase.samples.len()).collect();
    let (mut sum, mut steps) = (0.0, 0);
    for epoch in 1..=phase.epochs {
        order.shuffle(&mut rng);
        let mut losses = Vec::new();
        for batch in order.chunks(phase.batch_size.max(1)) {
            let indices: Vec<usize> = batch.iter().map(|&p| phase.samples[p]).collect();
            let (images, labels) = make_batch(data, norm, &indices, &device);
            let logits = model.forward(images);
            let target = phase.target.scores().map(|scores| {
                let rows: Vec<f32> = batch
                    .iter()
                    .flat_map(|&p| scores[p * classes..(p + 1) * classes].iter().copied())
                    .collect();
                Tensor::<2>::from_data(TensorData::new(rows, [batch.len(), classes]), &device)
            });
            let loss = match (&phase.target, target) {
                (PublicTarget::Scores(_), Some(target)) => (logits - target).abs().mean(),
                (
                    PublicTarget::CrossCorrelation {
                        off_diagonal,
                        off_target,
                        ..
                    },
                    Some(target),
                ) => {
                    // A correlation needs two samples: a last batch of one is skipped.
                    if batch.len() < 2 {
                        continue;
                    }
                    cross_correlation_loss(logits, target, *off_diagonal, *off_target)
                }
                _ => ce.forward(logits, labels),
            };
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            losses.push(loss.detach());
            model = optim.step(phase.lr, model, grads);
        }
        let (s, n) = epoch_sum(losses, client, epoch)?;
        sum += s;
        steps += n;
    }
    Ok((model, sum / steps as f64))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::ParamTable;
    use crate::test_model::{flat, synthetic_data, tracked};

    fn logits_of<M: Classifier>(model: &M, data: &Dataset, norm: &Normalization) -> Vec<f32> {
        let idx: Vec<usize> = (0..data.len()).collect();
        let inference = model.valid();
        let (images, _) = make_batch(data, norm, &idx, &model_device(&inference));
        inference
            .forward(images)
            .into_data()
            .try_into_vec()
            .unwrap()
    }

    fn distance(a: &[f32], b: &[f32]) -> f64 {
        a.iter().zip(b).map(|(x, y)| (x - y).abs() as f64).sum()
    }

    #[test]
    fn the_digest_moves_the_scores_towards_the_targets_and_labels_train_too() {
        let (data, norm) = synthetic_data(24, 3);
        let samples: Vec<usize> = (0..data.len()).collect();
        let model = tracked(1);
        let target = logits_of(&tracked(2), &data, &norm);
        let before = distance(&logits_of(&model, &data, &norm), &target);
        let phase = PublicPhase {
            samples: samples.clone(),
            target: PublicTarget::Scores(target.clone()),
            epochs: 10,
            batch_size: 4,
            lr: 1e-2,
        };
        let (digested, loss) = train(model.clone(), &phase, &data, &norm, (1, 1, 0)).unwrap();
        let after = distance(&logits_of(&digested, &data, &norm), &target);
        assert!(after < 0.5 * before, "{before} -> {after}");
        assert!(loss.is_finite() && loss > 0.0);
        // Same seed, same result; no epochs, no change.
        let (again, _) = train(model.clone(), &phase, &data, &norm, (1, 1, 0)).unwrap();
        let table = |m: &crate::test_model::TinyNet| flat(&ParamTable::from_module(m));
        assert_eq!(table(&again), table(&digested));
        let none = PublicPhase { epochs: 0, ..phase };
        let (same, _) = train(model.clone(), &none, &data, &norm, (1, 1, 0)).unwrap();
        assert_eq!(table(&same), table(&model));
        let labels = PublicPhase {
            samples,
            target: PublicTarget::Labels,
            epochs: 3,
            batch_size: 4,
            lr: 1e-2,
        };
        assert!(train(model, &labels, &data, &norm, (1, 1, 0)).unwrap().1 > 0.0);
    }

    #[test]
    fn the_cross_correlation_loss_is_minimal_when_the_logits_equal_the_consensus() {
        let d = crate::test_model::device();
        let t = |v: Vec<f32>| Tensor::<2>::from_data(TensorData::new(v, [4, 3]), &d);
        let consensus: Vec<f32> = vec![1., 0., 2., 3., 1., 0., 0., 2., 1., 2., 2., 3.];
        let value = |l: Tensor<1>| l.into_scalar::<f32>();
        // The diagonal term alone: 0 at equality, positive elsewhere.
        let equal = value(cross_correlation_loss(
            t(consensus.clone()),
            t(consensus.clone()),
            0.0,
            0.0,
        ));
        assert!(equal.abs() < 1e-5, "{equal}");
        let other: Vec<f32> = consensus.iter().rev().copied().collect();
        assert!(
            value(cross_correlation_loss(
                t(other),
                t(consensus.clone()),
                0.0,
                0.0
            )) > 0.1
        );
        // Logits that are an affine image of the consensus per class correlate perfectly too.
        let affine: Vec<f32> = consensus.iter().map(|x| 3.0 * x + 1.0).collect();
        assert!(
            value(cross_correlation_loss(
                t(affine),
                t(consensus.clone()),
                0.0,
                0.0
            )) < 1e-5
        );
        // The off-diagonal term counts the classes' cross-correlations, towards 0 or -1.
        let full = value(cross_correlation_loss(
            t(consensus.clone()),
            t(consensus.clone()),
            1.0,
            0.0,
        ));
        let towards = value(cross_correlation_loss(
            t(consensus.clone()),
            t(consensus),
            1.0,
            -1.0,
        ));
        assert!(full > 0.0 && towards != full);
    }

    #[test]
    fn scores_that_do_not_fit_the_samples_are_an_error() {
        let (data, norm) = synthetic_data(4, 3);
        let phase = PublicPhase {
            samples: vec![0, 1],
            target: PublicTarget::Scores(vec![0.0; 3]),
            epochs: 1,
            batch_size: 2,
            lr: 1e-3,
        };
        assert!(matches!(
            train(tracked(1), &phase, &data, &norm, (1, 1, 0)),
            Err(TrainError::Public(_))
        ));
    }
}
