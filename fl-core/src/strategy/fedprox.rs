//! FedProx (Li et al., MLSys 2020): FedAvg whose clients minimise
//! `loss + (μ/2)·‖w − w_global‖²`, which limits how far heterogeneous clients drift.
//!
//! Paper defaults for μ: 0.01 on CIFAR-10, 0.001 on CIFAR-100, 0.1 on FEMNIST. The term covers
//! trainable parameters only (BatchNorm running statistics get no gradient).

use std::sync::Arc;

use burn::tensor::Tensor;

use super::fedavg_with::{ClientRule, FedAvgWith};
use super::{StrategyError, StrategyState};
use crate::layers::ParamTable;
use crate::trainer::LocalObjective;

/// FedAvg aggregation plus the proximal term on every client.
pub type FedProx = FedAvgWith<Proximal>;

impl FedProx {
    /// FedProx with proximal weight `mu` and sample-weighted averaging.
    pub fn new(mu: f64) -> Self {
        Self::with_rule(Proximal { mu })
    }
}

/// `(μ/2)·‖w − w₀‖²` over the trainable tensors, `w₀` being the model the client received.
#[derive(Debug, Clone, Copy)]
pub struct Proximal {
    /// The weight μ.
    pub mu: f64,
}

impl LocalObjective for Proximal {
    fn extra_loss(&self, params: &ParamTable, start: &ParamTable) -> Option<Tensor<1>> {
        let distance = params.trainable_sum(start, |w, w0| (w - w0).square().sum());
        Some(distance.mul_scalar(self.mu / 2.0))
    }
}

impl ClientRule for Proximal {
    fn name(&self) -> &'static str {
        "fedprox"
    }

    fn objectives(
        &self,
        _round: usize,
        clients: &[usize],
        _global: &ParamTable,
    ) -> Result<Vec<Option<Arc<dyn LocalObjective>>>, StrategyError> {
        // μ = 0 adds nothing, so FedProx(0) is FedAvg bit for bit.
        let term: Option<Arc<dyn LocalObjective>> = (self.mu > 0.0).then(|| Arc::new(*self) as _);
        Ok(vec![term; clients.len()])
    }

    fn save(&self, state: &mut StrategyState) {
        state.extra["mu"] = self.mu.into();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::ParamKind;
    use crate::test_model::{TinyNet, device, tiny};
    use burn::optim::{GradientsParams, SgdConfig};

    #[test]
    fn the_proximal_gradient_is_mu_times_the_distance() {
        let ad = device().autodiff();
        let model = ParamTable::from_module(&tiny(1))
            .load_into(TinyNet::new(&ad))
            .unwrap();
        let start = ParamTable::from_module(&tiny(2));
        let params = ParamTable::from_module_tracked(&model);
        let loss = Proximal { mu: 0.5 }.extra_loss(&params, &start).unwrap();
        // One plain SGD step of size 1 on the term alone: w' = w − μ·(w − w₀) on trainable
        // tensors; buffers do not move.
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let w = ParamTable::from_module(&model);
        let stepped = ParamTable::from_module(&SgdConfig::new().init().step(1.0, model, grads));
        for (i, info) in w.layout().tensors().iter().enumerate() {
            let host = |t: &ParamTable| t.values()[i].clone().into_data().try_to_vec::<f32>();
            let (w, w0, w1) = (
                host(&w).unwrap(),
                host(&start).unwrap(),
                host(&stepped).unwrap(),
            );
            for ((w, w0), w1) in w.iter().zip(&w0).zip(&w1) {
                let expected = match info.kind {
                    ParamKind::Trainable => w - 0.5 * (w - w0),
                    ParamKind::Buffer => *w,
                };
                assert!(
                    (w1 - expected).abs() < 1e-5,
                    "{}: {w1} vs {expected}",
                    info.name
                );
            }
        }
    }

    #[test]
    fn mu_zero_adds_no_term_and_aggregates_as_fedavg() {
        let global = ParamTable::from_module(&tiny(1));
        let objectives = FedProx::new(0.0)
            .rule
            .objectives(1, &[3, 4], &global)
            .unwrap();
        assert!(objectives.iter().all(Option::is_none));
        let objectives = FedProx::new(0.01)
            .rule
            .objectives(1, &[3, 4], &global)
            .unwrap();
        assert!(objectives.iter().all(Option::is_some));
    }
}
