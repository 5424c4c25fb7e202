//! FedExP (Jhunjhunwala et al., ICLR 2023): FedAvg with an adaptive server step size from
//! extrapolation, `η_g = max(1, Σᵢ‖Δᵢ‖² / (2M·(‖Δ̄‖² + ε)))`, where `Δᵢ = x − yᵢ` are the M
//! client pseudo-gradients and `Δ̄` their (unweighted) mean; then `x ← x − η_g·Δ̄`.
//!
//! When clients agree (`Δᵢ` all equal) the ratio is ½ and FedExP is FedAvg; the more their
//! updates cancel out, the further the server extrapolates. BatchNorm running statistics take
//! the plain average. The paper also reports the average of the last two iterates for
//! evaluation; we deploy the last iterate.

use super::fedavg_with::{FedAvgWith, Plain, ServerStep};
use super::{Metrics, StrategyError, StrategyState};
use crate::layers::{ParamKind, ParamTable};
use crate::trainer::LocalUpdate;

/// FedAvg with FedExP's extrapolated server step.
pub type FedExP = FedAvgWith<Plain, Extrapolation>;

impl FedExP {
    /// FedExP with the given ε.
    pub fn new(epsilon: f64) -> Self {
        Self::compose(Plain, Extrapolation { epsilon })
    }
}

/// FedExP's server step: the averaged pseudo-gradient, extrapolated.
#[derive(Debug, Clone, Copy)]
pub struct Extrapolation {
    /// ε of the step-size rule (paper: 10⁻³).
    pub epsilon: f64,
}

impl Extrapolation {
    /// The server step size for client pseudo-gradients with `Σ‖Δᵢ‖² = sum_sq` over `m`
    /// clients whose mean has squared norm `mean_sq`.
    pub fn step_size(sum_sq: f64, mean_sq: f64, m: usize, epsilon: f64) -> f64 {
        (sum_sq / (2.0 * m as f64 * (mean_sq + epsilon))).max(1.0)
    }
}

impl ServerStep for Extrapolation {
    fn name(&self) -> Option<&'static str> {
        Some("fedexp")
    }

    fn step(
        &mut self,
        global: &ParamTable,
        updates: &[LocalUpdate],
    ) -> Result<(ParamTable, Metrics), StrategyError> {
        let uploads: Vec<ParamTable> = updates.iter().map(|u| u.table.clone()).collect();
        let average = ParamTable::average(&uploads, None)?;
        let deltas = uploads
            .iter()
            .map(|y| global.sub(y))
            .collect::<Result<Vec<_>, _>>()?;
        // Norms over trainable tensors only (BatchNorm statistics zeroed).
        let trainable = |t: &ParamTable| t.map_kind(ParamKind::Buffer, |v| v.zeros_like());
        let sum_sq = deltas
            .iter()
            .map(|d| trainable(d).sq_norm())
            .sum::<Result<f64, _>>()?;
        let mean_delta = global.sub(&average)?;
        let mean_sq = trainable(&mean_delta).sq_norm()?;
        let eta = Self::step_size(sum_sq, mean_sq, uploads.len(), self.epsilon);
        let stepped = global.combine(1.0, &mean_delta, -eta)?;
        let mut metrics = Metrics::new();
        metrics.insert("server_lr".into(), eta.into());
        Ok((stepped.with_buffers_from(&average)?, metrics))
    }

    fn save(&self, state: &mut StrategyState) {
        state.extra["epsilon"] = self.epsilon.into();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::ServerRound;
    use crate::strategy::Strategy;
    use crate::test_model::{close, flat, upload};
    use proptest::prelude::{ProptestConfig, prop_assert, proptest};
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn aggregate(s: &mut FedExP, seeds: &[u64]) -> f64 {
        let ups = seeds.iter().map(|&k| upload(k, 10)).collect();
        let m = s
            .aggregate(ServerRound::new(1, &mut ChaCha8Rng::seed_from_u64(0)), ups)
            .unwrap();
        m["server_lr"].as_f64().unwrap()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(16))]
        #[test]
        fn the_step_size_is_at_least_one(seeds in proptest::collection::vec(0u64..1000, 1..6)) {
            let mut s = FedExP::new(1e-3);
            s.init(upload(9999, 1).table, seeds.len()).unwrap();
            prop_assert!(aggregate(&mut s, &seeds) >= 1.0);
        }
    }

    #[test]
    fn agreeing_clients_give_fedavg_and_disagreeing_ones_extrapolate() {
        let mut s = FedExP::new(1e-3);
        s.init(upload(0, 1).table, 3).unwrap();
        assert_eq!(aggregate(&mut s, &[4, 4, 4]), 1.0);
        assert!(close(
            &flat(&s.global_model().unwrap()),
            &flat(&upload(4, 1).table),
            1e-5
        ));
        // Two clients moving in nearly opposite directions: their mean is a small step in the
        // common direction, which FedExP lengthens.
        let x = upload(0, 1).table;
        let d = upload(1, 1).table.sub(&x).unwrap();
        let mut s = FedExP::new(1e-3);
        s.init(x.clone(), 2).unwrap();
        let ups = [0.5, -0.4]
            .map(|k| LocalUpdate {
                table: x.combine(1.0, &d, k).unwrap(),
                state: None,
                prototypes: None,
                ..upload(0, 10)
            })
            .to_vec();
        let m = s
            .aggregate(ServerRound::new(1, &mut ChaCha8Rng::seed_from_u64(0)), ups)
            .unwrap();
        let eta = m["server_lr"].as_f64().unwrap();
        assert!(eta > 10.0, "eta {eta}");
        assert_eq!(Extrapolation::step_size(10.0, 0.0, 1, 1.0), 5.0);
    }
}
