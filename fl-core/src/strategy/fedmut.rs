//! FedMut (Hu et al., AAAI 2024, "FedMut: Generalized Federated Learning via Stochastic
//! Mutation"): instead of sending one global model, the server mutates it into K models along
//! the last global update and sends model k to the k-th sampled client.
//!
//! After aggregating the uploads into `w` (FedAvg), with `Δ = w − w_previous`, model k is
//! `w + α·sₖ·Δ` tensor by tensor. For every tensor, the K signs come in pairs
//! `(1, −1 + r)` in random order (an odd K leaves the last model unmutated), then shuffled. The
//! pairs' imbalance `r = rate·(1 − min(t/bound, 1))` (authors' code: `mut_acc_rate`,
//! `mut_bound`) pushes the K models slightly forward along Δ early in training and vanishes after
//! `bound` rounds, from which point the K models average exactly back to `w`. Defaults as the
//! authors: radius α = 4, rate 0.3, bound 100. The deployable model is `w`.

use super::{Metrics, Result, ServerRound};
use rand::Rng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

use super::{FedAvg, ModelSlots, RoundContext, RoundPlan, Strategy, StrategyError, StrategyState};
use crate::layers::ParamTable;
use crate::trainer::LocalUpdate;

/// FedMut's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FedMutConfig {
    /// Mutation radius α (default 4.0).
    pub radius: f64,
    /// Initial imbalance of the mutation pairs (default 0.3).
    pub rate: f64,
    /// Rounds over which the imbalance decays to zero (default 100).
    pub bound: usize,
}

impl Default for FedMutConfig {
    fn default() -> Self {
        Self {
            radius: 4.0,
            rate: 0.3,
            bound: 100,
        }
    }
}

/// FedMut: FedAvg aggregation, K mutated models dispatched.
#[derive(Debug, Clone)]
pub struct FedMut {
    config: FedMutConfig,
    global: Option<ParamTable>,
    /// The K mutants, model k for the k-th sampled client.
    mutants: ModelSlots,
}

impl FedMut {
    /// FedMut with `config`.
    pub fn new(config: FedMutConfig) -> Self {
        Self {
            config,
            global: None,
            mutants: ModelSlots::default(),
        }
    }

    /// The pair imbalance r after `round` (1-based) rounds.
    pub fn imbalance(&self, round: usize) -> f64 {
        let progress = (round.saturating_sub(1)) as f64 / self.config.bound.max(1) as f64;
        self.config.rate * (1.0 - progress.min(1.0))
    }

    /// The K mutants of `global` along `delta` (see the module docs).
    pub fn mutate(
        &self,
        global: &ParamTable,
        delta: &ParamTable,
        k: usize,
        imbalance: f64,
        rng: &mut ChaCha8Rng,
    ) -> Result<Vec<ParamTable>, StrategyError> {
        let tensors = global.values().len();
        // signs[t][j]: the coefficient of tensor t in model j (the last model of an odd K: 0).
        let signs: Vec<Vec<f64>> = (0..tensors)
            .map(|_| {
                let mut list = Vec::with_capacity(k);
                for _ in 0..k / 2 {
                    let pair = [1.0, -1.0 + imbalance];
                    if rng.random_bool(0.5) {
                        list.extend(pair);
                    } else {
                        list.extend([pair[1], pair[0]]);
                    }
                }
                list.shuffle(rng);
                list.resize(k, 0.0);
                list
            })
            .collect();
        (0..k)
            .map(|j| {
                let values = global
                    .values()
                    .iter()
                    .zip(delta.values())
                    .zip(&signs)
                    .map(|((w, d), s)| {
                        if s[j] == 0.0 {
                            w.clone()
                        } else {
                            w.clone()
                                .add(d.clone().mul_scalar(self.config.radius * s[j]))
                        }
                    })
                    .collect();
                Ok(global.with_values(values)?)
            })
            .collect()
    }
}

impl Strategy for FedMut {
    fn name(&self) -> &'static str {
        "fedmut"
    }

    fn init(&mut self, initial: ParamTable, sample: usize) -> Result<(), StrategyError> {
        self.mutants.fill(initial.clone(), sample);
        self.global = Some(initial);
        Ok(())
    }

    fn configure_round(&mut self, ctx: &mut RoundContext<'_>) -> Result<RoundPlan> {
        self.mutants.plan("FedMut", ctx)
    }

    fn aggregate(&mut self, at: ServerRound<'_>, updates: Vec<LocalUpdate>) -> Result<Metrics> {
        let ServerRound { round, rng } = at;
        let previous = self.global.as_ref().ok_or(StrategyError::NotInitialised)?;
        let global = FedAvg::average(&updates, true)?;
        let delta = global.sub(previous)?;
        let imbalance = self.imbalance(round);
        let k = self.mutants.models().len();
        self.mutants
            .set(self.mutate(&global, &delta, k, imbalance, rng)?);
        self.global = Some(global);
        let mut metrics = serde_json::Map::new();
        metrics.insert("mutation_imbalance".into(), imbalance.into());
        metrics.insert("update_norm".into(), delta.sq_norm()?.sqrt().into());
        Ok(metrics)
    }

    fn global_model(&self) -> Result<ParamTable, StrategyError> {
        self.global.clone().ok_or(StrategyError::NotInitialised)
    }

    fn state(&self) -> StrategyState {
        StrategyState {
            tables: self
                .global
                .iter()
                .chain(self.mutants.models())
                .cloned()
                .collect(),
            extra: serde_json::json!({
                "radius": self.config.radius,
                "rate": self.config.rate,
                "bound": self.config.bound,
            }),
        }
    }

    fn restore(&mut self, state: StrategyState) -> Result<(), StrategyError> {
        let mut tables = state.tables.into_iter();
        let global = tables
            .next()
            .ok_or_else(|| StrategyError::Restore("FedMut's checkpoint has no model".into()))?;
        self.mutants.restore("FedMut", tables.collect())?;
        self.global = Some(global);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_model::{close, flat, plan, starts, upload};
    use rand::SeedableRng;

    #[test]
    fn mutants_average_back_to_the_global_model() {
        let s = FedMut::new(FedMutConfig::default());
        let w = upload(1, 1).table;
        let delta = upload(2, 1).table.sub(&upload(3, 1).table).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        for k in [2, 5, 10] {
            // Balanced pairs (after `bound` rounds): the mean is exactly w.
            let mutants = s.mutate(&w, &delta, k, 0.0, &mut rng).unwrap();
            assert_eq!(mutants.len(), k);
            let mean = ParamTable::average(&mutants, None).unwrap();
            assert!(close(&flat(&mean), &flat(&w), 1e-5), "k = {k}");
            // Every mutant moved by ±α·Δ on every tensor (except an odd K's last).
            let moved = flat(&mutants[0].sub(&w).unwrap());
            let d = flat(&delta);
            assert!(
                moved
                    .iter()
                    .zip(&d)
                    .all(|(m, d)| (m.abs() - 4.0 * d.abs()).abs() < 1e-4)
            );
            // With imbalance r the mean moves by α·r·⌊K/2⌋/K·Δ.
            let r = 0.3;
            let mutants = s.mutate(&w, &delta, k, r, &mut rng).unwrap();
            let mean = ParamTable::average(&mutants, None).unwrap();
            let shift = 4.0 * r * (k / 2) as f64 / k as f64;
            let expected = w.combine(1.0, &delta, shift).unwrap();
            assert!(close(&flat(&mean), &flat(&expected), 1e-4), "k = {k}");
        }
        assert_eq!(s.imbalance(1), 0.3);
        assert!((s.imbalance(51) - 0.15).abs() < 1e-12);
        assert_eq!(s.imbalance(101), 0.0);
        assert_eq!(s.imbalance(500), 0.0);
    }

    #[test]
    fn rounds_dispatch_mutants_and_deploy_the_average() {
        let mut s = FedMut::new(FedMutConfig::default());
        s.init(upload(0, 1).table, 4).unwrap();
        let first = starts(&plan(&mut s, 1, 10, 4).unwrap());
        assert!(first.iter().all(|t| flat(t) == flat(&upload(0, 1).table)));
        let ups: Vec<LocalUpdate> = (1..=4).map(|k| upload(k, 10)).collect();
        s.aggregate(
            ServerRound::new(1, &mut ChaCha8Rng::seed_from_u64(1)),
            ups.clone(),
        )
        .unwrap();
        let avg = FedAvg::average(&ups, true).unwrap();
        assert_eq!(flat(&s.global_model().unwrap()), flat(&avg));
        let next = starts(&plan(&mut s, 2, 10, 4).unwrap());
        assert!(next.iter().all(|t| flat(t) != flat(&avg)));
        let mut t = FedMut::new(FedMutConfig::default());
        t.init(upload(0, 1).table, 4).unwrap();
        t.restore(s.state()).unwrap();
        assert_eq!(
            starts(&plan(&mut t, 2, 10, 4).unwrap())
                .iter()
                .map(flat)
                .collect::<Vec<_>>(),
            next.iter().map(flat).collect::<Vec<_>>()
        );
        assert!(plan(&mut s, 2, 10, 2).is_err());
    }
}
