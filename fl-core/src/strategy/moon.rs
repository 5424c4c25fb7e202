//! MOON (Li, He and Song, CVPR 2021): model-contrastive federated learning. FedAvg whose
//! clients add `μ · ℓ_con` to their loss, where for a sample's representation `z`
//!
//! `ℓ_con = −log( e^{cos(z, z_glob)/τ} / (e^{cos(z, z_glob)/τ} + e^{cos(z, z_prev)/τ}) )`
//!
//! pulls `z` towards the global model's representation of the same image and away from the
//! client's previous local model's. Paper defaults: τ = 0.5, μ = 5 (CIFAR-10) or 1 (CIFAR-100,
//! Tiny-ImageNet).
//!
//! Our choices where the paper leaves room: the representation is the input of the model's
//! final linear layer ([`Classifier::features`](crate::Classifier::features), as PFLlib's port;
//! the paper's models add a 2-layer projection head, which ours do not have). A client's
//! "previous model" is the model it uploaded the last time it trained; before its first
//! training it is the initial global model (PFLlib's choice; MOON's own code uses a separate
//! random initialisation per client). The server keeps one table per client that has trained,
//! in the checkpoint too.

use std::sync::Arc;

use burn::tensor::Tensor;
use rand_chacha::ChaCha8Rng;

use super::fedavg_with::{ClientRule, FedAvgWith};
use super::{ClientTables, Metrics, StrategyError, StrategyState};
use crate::layers::ParamTable;
use crate::trainer::{BatchContext, LocalObjective, LocalUpdate};

/// FedAvg aggregation plus the model-contrastive term on every client.
pub type Moon = FedAvgWith<MoonRule>;

impl Moon {
    /// MOON with contrastive weight `mu` and temperature `tau`, sample-weighted averaging.
    pub fn new(mu: f64, tau: f64) -> Self {
        Self::with_rule(MoonRule {
            mu,
            tau,
            initial: None,
            previous: ClientTables::default(),
        })
    }

    /// The number of clients whose previous model the server holds.
    pub fn stored_models(&self) -> usize {
        self.rule.previous.len()
    }
}

/// MOON's client side: the contrastive term against the global model and each client's
/// previous local model, which the server keeps.
#[derive(Debug, Clone)]
pub struct MoonRule {
    /// Weight μ of the contrastive term (μ = 0 is FedAvg).
    pub mu: f64,
    /// Temperature τ.
    pub tau: f64,
    initial: Option<ParamTable>,
    previous: ClientTables,
}

/// `μ · ℓ_con` over a batch, against the representations of the global model and the client's
/// previous model.
#[derive(Debug, Clone)]
pub struct Contrastive {
    /// Weight μ.
    pub mu: f64,
    /// Temperature τ.
    pub tau: f64,
    /// The global model the client received.
    pub global: ParamTable,
    /// The client's previous local model.
    pub previous: ParamTable,
}

/// Row-wise cosine similarity, with PyTorch's guard `max(‖a‖·‖b‖, 1e-8)`.
fn cosine(a: &Tensor<2>, b: &Tensor<2>) -> Tensor<2> {
    let dot = (a.clone() * b.clone()).sum_dim(1);
    let norms = a.clone().square().sum_dim(1).sqrt() * b.clone().square().sum_dim(1).sqrt();
    dot / norms.clamp_min(1e-8)
}

impl LocalObjective for Contrastive {
    fn uses_parameters(&self) -> bool {
        false
    }

    fn uses_features(&self) -> bool {
        true
    }

    fn reference_models(&self) -> Vec<ParamTable> {
        vec![self.global.clone(), self.previous.clone()]
    }

    fn batch_loss(&self, batch: &BatchContext<'_>) -> Option<Tensor<1>> {
        let z = batch.features?;
        let [z_glob, z_prev] = batch.reference_features else {
            return None;
        };
        let positive = cosine(z, z_glob);
        let negative = cosine(z, z_prev);
        // −log(e^p / (e^p + e^n)) = log(1 + e^{n − p}), with p, n scaled by 1/τ.
        let loss = ((negative - positive).div_scalar(self.tau).exp())
            .log1p()
            .mean();
        Some(loss.mul_scalar(self.mu))
    }
}

impl ClientRule for MoonRule {
    fn name(&self) -> &'static str {
        "moon"
    }

    fn init(&mut self, initial: &ParamTable) -> Result<(), StrategyError> {
        self.initial = Some(initial.clone());
        self.previous.clear();
        Ok(())
    }

    fn objectives(
        &self,
        _round: usize,
        clients: &[usize],
        global: &ParamTable,
    ) -> Result<Vec<Option<Arc<dyn LocalObjective>>>, StrategyError> {
        if self.mu == 0.0 {
            return Ok(vec![None; clients.len()]);
        }
        let initial = self.initial.as_ref().ok_or(StrategyError::NotInitialised)?;
        Ok(clients
            .iter()
            .map(|c| {
                let term = Contrastive {
                    mu: self.mu,
                    tau: self.tau,
                    global: global.clone(),
                    previous: self.previous.get(*c).unwrap_or(initial).clone(),
                };
                Some(Arc::new(term) as Arc<dyn LocalObjective>)
            })
            .collect())
    }

    fn observe(
        &mut self,
        _round: usize,
        _global: &ParamTable,
        updates: &[LocalUpdate],
        _rng: &mut ChaCha8Rng,
    ) -> Result<Metrics, StrategyError> {
        for u in updates {
            self.previous.insert(u.client, u.table.clone());
        }
        let mut extra = Metrics::new();
        extra.insert("stored_models".into(), self.previous.len().into());
        Ok(extra)
    }

    fn save(&self, state: &mut StrategyState) {
        state.tables.extend(self.initial.iter().cloned());
        self.previous.save_into(state);
        state.extra["mu"] = self.mu.into();
        state.extra["tau"] = self.tau.into();
    }

    fn load(&mut self, state: &mut StrategyState) -> Result<(), StrategyError> {
        self.previous = ClientTables::take_from("MOON", state, 2)?;
        self.initial = state.tables.pop();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::ServerRound;
    use crate::strategy::Strategy;
    use crate::test_model::{device, tiny, upload};
    use burn::tensor::{Int, TensorData};
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn features(rows: &[[f32; 3]]) -> Tensor<2> {
        let flat: Vec<f32> = rows.iter().flatten().copied().collect();
        Tensor::from_data(TensorData::new(flat, [rows.len(), 3]), &device())
    }

    fn loss_of(z: &Tensor<2>, glob: Tensor<2>, prev: Tensor<2>, mu: f64, tau: f64) -> f32 {
        let table = ParamTable::from_module(&tiny(1));
        let term = Contrastive {
            mu,
            tau,
            global: table.clone(),
            previous: table,
        };
        let d = device();
        let [n, _] = z.dims();
        let images = Tensor::<4>::zeros([n, 1, 8, 8], &d);
        let labels = Tensor::<1, Int>::zeros([n], &d);
        let logits = Tensor::<2>::zeros([n, 10], &d);
        let head = |x: Tensor<2>| x;
        let batch = BatchContext {
            images: &images,
            labels: &labels,
            logits: &logits,
            features: Some(z),
            reference_features: &[glob, prev],
            head: &head,
        };
        term.batch_loss(&batch).unwrap().into_scalar::<f32>()
    }

    /// ℓ_con against hand-computed values: log 2 when both references agree, small when z
    /// matches the global representation and is orthogonal to the previous one.
    #[test]
    fn contrastive_loss_matches_the_formula() {
        let z = features(&[[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]]);
        let same = loss_of(&z, z.clone(), z.clone(), 1.0, 0.5);
        assert!((same - 2f32.ln()).abs() < 1e-6, "{same}");
        let orthogonal = features(&[[0.0, 1.0, 0.0], [0.0, 0.0, 3.0]]);
        let pulled = loss_of(&z, z.clone(), orthogonal, 5.0, 0.5);
        // cos(z, z_glob) = 1, cos(z, z_prev) = 0: 5 · log(1 + e^{−2}).
        let expected = 5.0 * (1.0 + (-2.0f32).exp()).ln();
        assert!((pulled - expected).abs() < 1e-5, "{pulled} vs {expected}");
    }

    #[test]
    fn previous_models_are_kept_per_client_and_restored() {
        let mut moon = Moon::new(5.0, 0.5);
        let initial = ParamTable::from_module(&tiny(1));
        moon.init(initial.clone(), 2).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        // Before training, the previous model is the initial one.
        let first = moon.rule.objectives(1, &[3], &initial).unwrap();
        assert_eq!(first.len(), 1);
        let mut a = upload(2, 10);
        a.client = 3;
        let mut b = upload(4, 30);
        b.client = 7;
        moon.aggregate(ServerRound::new(1, &mut rng), vec![a.clone(), b])
            .unwrap();
        assert_eq!(moon.stored_models(), 2);
        assert_eq!(
            crate::test_model::flat(moon.rule.previous.get(3).unwrap()),
            crate::test_model::flat(&a.table)
        );
        let mut restored = Moon::new(5.0, 0.5);
        restored.init(ParamTable::from_module(&tiny(1)), 2).unwrap();
        restored.restore(moon.state()).unwrap();
        assert_eq!(restored.stored_models(), 2);
        assert_eq!(
            crate::test_model::flat(&restored.global_model().unwrap()),
            crate::test_model::flat(&moon.global_model().unwrap())
        );
        // μ = 0 adds no term: FedAvg.
        let none = Moon::new(0.0, 0.5)
            .rule
            .objectives(1, &[1, 2], &initial)
            .unwrap();
        assert!(none.iter().all(Option::is_none));
    }
}
