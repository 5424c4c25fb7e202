//! FedAvgM (Hsu et al. 2019): FedAvg with server momentum. The average client change is a
//! pseudo-gradient `Δ = x − avg(yᵢ)`; the server keeps `v ← β·v + Δ` and steps `x ← x − η·v`.
//! BatchNorm running statistics are not optimised: they take the plain average.

use super::fedavg_with::{FedAvgWith, Plain, ServerStep};
use super::{FedAvg, Metrics, StrategyError, StrategyState};
use crate::layers::ParamTable;
use crate::trainer::LocalUpdate;

/// FedAvg with server momentum.
pub type FedAvgM = FedAvgWith<Plain, ServerMomentum>;

impl FedAvgM {
    /// FedAvgM with server momentum `momentum` and learning rate `server_lr`.
    pub fn new(momentum: f64, server_lr: f64) -> Self {
        Self::compose(
            Plain,
            ServerMomentum {
                velocity: None,
                momentum,
                server_lr,
                weighted: true,
            },
        )
    }
}

/// FedAvgM's server step: a momentum step along the averaged pseudo-gradient.
#[derive(Debug, Clone)]
pub struct ServerMomentum {
    velocity: Option<ParamTable>,
    /// Server momentum β (default 0.9).
    pub momentum: f64,
    /// Server learning rate η (default 1).
    pub server_lr: f64,
    /// Weight uploads by sample counts.
    pub weighted: bool,
}

impl ServerStep for ServerMomentum {
    fn name(&self) -> Option<&'static str> {
        Some("fedavgm")
    }

    fn init(&mut self, initial: &ParamTable) -> Result<(), StrategyError> {
        self.velocity = Some(initial.zeros_like());
        Ok(())
    }

    fn step(
        &mut self,
        global: &ParamTable,
        updates: &[LocalUpdate],
    ) -> Result<(ParamTable, Metrics), StrategyError> {
        let velocity = self
            .velocity
            .as_ref()
            .ok_or(StrategyError::NotInitialised)?;
        let average = FedAvg::average(updates, self.weighted)?;
        let pseudo_gradient = global.sub(&average)?;
        let velocity = velocity.combine(self.momentum, &pseudo_gradient, 1.0)?;
        let stepped = global.combine(1.0, &velocity, -self.server_lr)?;
        let mut metrics = Metrics::new();
        metrics.insert("velocity_norm".into(), velocity.sq_norm()?.sqrt().into());
        self.velocity = Some(velocity);
        Ok((stepped.with_buffers_from(&average)?, metrics))
    }

    fn save(&self, state: &mut StrategyState) {
        state.tables.extend(self.velocity.iter().cloned());
        state.extra["momentum"] = self.momentum.into();
        state.extra["server_lr"] = self.server_lr.into();
    }

    fn load(&mut self, state: &mut StrategyState) -> Result<(), StrategyError> {
        if state.tables.len() != 2 {
            return Err(StrategyError::Restore(format!(
                "FedAvgM keeps a model and a velocity, the checkpoint has {} tables",
                state.tables.len()
            )));
        }
        self.velocity = state.tables.pop();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::ServerRound;
    use crate::strategy::Strategy;
    use crate::test_model::{close, flat, upload};
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn round(s: &mut impl Strategy, r: usize, seeds: [u64; 2]) -> Vec<f32> {
        let ups = vec![upload(seeds[0], 10), upload(seeds[1], 30)];
        s.aggregate(ServerRound::new(r, &mut ChaCha8Rng::seed_from_u64(0)), ups)
            .unwrap();
        flat(&s.global_model().unwrap())
    }

    #[test]
    fn without_momentum_it_is_fedavg() {
        let (mut m, mut a) = (FedAvgM::new(0.0, 1.0), FedAvg::weighted());
        m.init(upload(0, 1).table, 2).unwrap();
        a.init(upload(0, 1).table, 2).unwrap();
        for r in 1..=3 {
            let seeds = [r as u64, 10 + r as u64];
            assert!(close(
                &round(&mut m, r, seeds),
                &round(&mut a, r, seeds),
                1e-5
            ));
        }
    }

    #[test]
    fn momentum_accumulates_the_pseudo_gradient() {
        // Clients always return model 5: Δ₁ = x₀ − y, x₁ = y; Δ₂ = 0, but v₂ = β·Δ₁, so
        // x₂ = y − β·(x₀ − y) overshoots past y, away from x₀.
        let beta = 0.9;
        let mut m = FedAvgM::new(beta, 1.0);
        let x0 = flat(&upload(0, 1).table);
        m.init(upload(0, 1).table, 2).unwrap();
        let y = flat(&upload(5, 1).table);
        assert!(close(&round(&mut m, 1, [5, 5]), &y, 1e-5));
        let x2 = round(&mut m, 2, [5, 5]);
        let expected: Vec<f32> = y
            .iter()
            .zip(&x0)
            .map(|(y, x0)| y - beta as f32 * (x0 - y))
            .collect();
        // BatchNorm statistics are averaged, not stepped: compare the trainable prefix only
        // through the tolerance on every value they share.
        let table = m.global_model().unwrap();
        let trainable: Vec<bool> = table
            .layout()
            .tensors()
            .iter()
            .flat_map(|t| {
                std::iter::repeat_n(
                    t.kind == crate::layers::ParamKind::Trainable,
                    t.shape.iter().product(),
                )
            })
            .collect();
        for ((got, want), (yv, tr)) in x2.iter().zip(&expected).zip(y.iter().zip(&trainable)) {
            let want = if *tr { *want } else { *yv };
            assert!((got - want).abs() < 1e-4, "{got} vs {want}");
        }
        // Checkpoint round trip.
        let mut r = FedAvgM::new(beta, 1.0);
        r.init(upload(0, 1).table, 2).unwrap();
        r.restore(m.state()).unwrap();
        assert_eq!(round(&mut r, 3, [7, 8]), round(&mut m, 3, [7, 8]));
    }
}
