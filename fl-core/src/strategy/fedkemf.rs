//! FedKEMF (D. P. Nguyen, S. Yu, J. P. Muñoz and A. Jannesari, "Enhancing Heterogeneous
//! Federated Learning with Knowledge Extraction and Multi-Model Fusion", 2022): clients keep
//! personal models of any architecture and share one small *knowledge network*.
//!
//! - **Knowledge extraction** (client): the received knowledge network and the client's
//!   personal model learn from each other on its data by deep mutual learning
//!   ([`LocalProcedure::Mutual`](crate::trainer::LocalProcedure::Mutual)); the knowledge network
//!   goes back, the personal model stays.
//! - **Multi-model fusion** (server): the uploaded knowledge networks are averaged, then the
//!   average is distilled from their ensemble (mean logits) on the unlabeled public set
//!   ([`fuse`], as FedDF's ensemble distillation).
//!
//! Only the knowledge network travels, which is FedKEMF's communication saving. Runs on
//! pFedClub's per-client machinery (`--variant fedkemf`); clients are evaluated with their
//! personal models.

use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn::tensor::activation::{log_softmax, softmax};
use rand::Rng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

use super::StrategyError;
use super::pfedclub::PublicData;
use crate::layers::ParamTable;
use crate::model::Classifier;
use crate::rng::with_forward_stream;
use crate::trainer::{FusedAdam, make_batch};

/// FedKEMF's server settings.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct FedKemfConfig {
    /// Passes of the ensemble distillation over the public set (0: the plain average).
    pub fusion_epochs: usize,
    /// Its batch size.
    pub fusion_batch: usize,
    /// Its Adam step size.
    pub fusion_lr: f64,
    /// Distillation temperature (the loss is scaled by T²).
    pub temperature: f64,
}

impl Default for FedKemfConfig {
    fn default() -> Self {
        Self {
            fusion_epochs: 1,
            fusion_batch: 64,
            fusion_lr: 1e-3,
            temperature: 1.0,
        }
    }
}

impl FedKemfConfig {
    /// Checks the values a run cannot work with.
    pub fn validate(&self) -> Result<(), String> {
        if self.fusion_batch == 0 {
            return Err("FedKEMF's fusion batch must be at least 1".into());
        }
        let positive = |x: f64| x.is_finite() && x > 0.0;
        if !positive(self.fusion_lr) || !positive(self.temperature) {
            return Err("FedKEMF's fusion learning rate and temperature must be positive".into());
        }
        Ok(())
    }
}

/// KL(softmax(teacher/T) ‖ softmax(student/T))·T², averaged over the batch.
fn distillation(teacher: Tensor<2>, student: Tensor<2>, t: f64) -> Tensor<1> {
    let (teacher, student) = (teacher.div_scalar(t), student.div_scalar(t));
    let p = softmax(teacher.clone(), 1);
    (p * (log_softmax(teacher, 1) - log_softmax(student, 1)))
        .sum_dim(1)
        .mean()
        .mul_scalar(t * t)
}

/// The ensemble's mean logits on `images` (the uploaded networks in inference mode).
fn ensemble<M: Classifier>(members: &[M], images: &Tensor<4>) -> Tensor<2> {
    let n = members.len() as f64;
    members
        .iter()
        .map(|m| m.infer(images.clone().inner()))
        .reduce(|a, b| a + b)
        .expect("at least one member")
        .div_scalar(n)
}

/// Mean distillation loss of `model` (inference) towards the ensemble of `members` over
/// `samples` of the public set: how far the fused network is from what it fuses.
pub fn ensemble_gap<M: Classifier>(
    model: &M,
    members: &[M],
    public: &PublicData<'_>,
    samples: &[usize],
    t: f64,
) -> f64 {
    let device = model.devices().into_iter().next().expect("a device");
    let (images, _) = make_batch(public.data, public.normalization, samples, &device);
    let teacher = ensemble(members, &images);
    distillation(teacher, model.infer(images), t).into_scalar::<f32>() as f64
}

/// The server step: the uploaded knowledge networks averaged (weighted), then the average
/// distilled from their ensemble on the public samples for `cfg.fusion_epochs` passes in an
/// order drawn from `rng`. `template` is the knowledge network on the autodiff device.
pub fn fuse<M: Classifier>(
    uploads: &[ParamTable],
    weights: &[f64],
    template: M,
    public: &PublicData<'_>,
    cfg: &FedKemfConfig,
    rng: &mut ChaCha8Rng,
) -> Result<ParamTable, StrategyError> {
    let average = ParamTable::average(uploads, Some(weights))?;
    if cfg.fusion_epochs == 0 || public.samples.is_empty() {
        return Ok(average);
    }
    let members: Vec<M> = uploads
        .iter()
        .map(|t| Ok(t.load_into(template.clone())?.valid()))
        .collect::<Result<_, StrategyError>>()?;
    let mut student = average.load_into(template)?;
    let device = student.devices().into_iter().next().expect("a device");
    let mut optim = FusedAdam::pytorch(0.0).init();
    let mut order = public.samples.to_vec();
    // The student's dropout draws from a stream of its own: the server's thread is any of the
    // pool's, and an unseeded stream would depend on which.
    let forward_seed: u64 = rng.random();
    let student = with_forward_stream(forward_seed, || {
        for _ in 0..cfg.fusion_epochs {
            order.shuffle(rng);
            for batch in order.chunks(cfg.fusion_batch) {
                let (images, _) = make_batch(public.data, public.normalization, batch, &device);
                let teacher = ensemble(&members, &images);
                let loss = distillation(teacher, student.forward(images), cfg.temperature);
                let grads = GradientsParams::from_grads(loss.backward(), &student);
                student = optim.step(cfg.fusion_lr, student, grads);
            }
        }
        student
    });
    Ok(ParamTable::from_module(&student))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_model::{flat, synthetic_data, tracked};
    use burn::module::Module;
    use rand::SeedableRng;

    #[test]
    fn fusion_starts_from_the_average_and_moves_it_towards_the_ensemble() {
        let (data, norm) = synthetic_data(80, 4);
        let samples: Vec<usize> = (0..80).collect();
        let public = PublicData {
            data: &data,
            normalization: &norm,
            samples: &samples,
        };
        let uploads: Vec<ParamTable> = (1..4)
            .map(|s| ParamTable::from_module(&tracked(s)))
            .collect();
        let weights = [1.0, 2.0, 3.0];
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let none = FedKemfConfig {
            fusion_epochs: 0,
            ..FedKemfConfig::default()
        };
        let average = fuse(&uploads, &weights, tracked(0), &public, &none, &mut rng).unwrap();
        let expected = ParamTable::average(&uploads, Some(&weights)).unwrap();
        assert_eq!(flat(&average), flat(&expected));
        let cfg = FedKemfConfig {
            fusion_epochs: 5,
            fusion_batch: 16,
            ..FedKemfConfig::default()
        };
        let fused = fuse(&uploads, &weights, tracked(0), &public, &cfg, &mut rng).unwrap();
        let members: Vec<_> = uploads
            .iter()
            .map(|t| t.load_into(tracked(0)).unwrap().valid())
            .collect();
        let gap = |t: &ParamTable| {
            let m = t.load_into(tracked(0)).unwrap().valid();
            ensemble_gap(&m, &members, &public, &samples, 1.0)
        };
        assert!(
            gap(&fused) < gap(&average),
            "{} vs {}",
            gap(&fused),
            gap(&average)
        );
    }
}
