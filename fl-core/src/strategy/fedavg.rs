//! FedAvg (McMahan et al., 2017): every sampled client starts from the global model; the new
//! global model is the average of the uploads, weighted by local sample counts (or unweighted).

use super::fedavg_with::{FedAvgWith, Plain, ServerStep};
use super::{Metrics, StrategyError, StrategyState};
use crate::layers::ParamTable;
use crate::trainer::LocalUpdate;

/// Federated averaging with one server model.
pub type FedAvg = FedAvgWith<Plain, Average>;

impl FedAvg {
    /// FedAvg weighted by sample counts.
    pub fn weighted() -> Self {
        Self::compose(Plain, Average { weighted: true })
    }

    /// FedAvg with equal weights.
    pub fn unweighted() -> Self {
        Self::compose(Plain, Average { weighted: false })
    }

    /// Averages `updates` the FedAvg way.
    pub fn average(updates: &[LocalUpdate], weighted: bool) -> Result<ParamTable, StrategyError> {
        let tables: Vec<ParamTable> = updates.iter().map(|u| u.table.clone()).collect();
        let weights: Vec<f64> = updates.iter().map(|u| u.num_samples as f64).collect();
        Ok(ParamTable::average(
            &tables,
            weighted.then_some(weights.as_slice()),
        )?)
    }
}

/// FedAvg's server step: the next global model is the average of the uploads.
#[derive(Debug, Clone, Copy)]
pub struct Average {
    /// Weight uploads by their clients' sample counts (the paper's rule) or equally.
    pub weighted: bool,
}

impl ServerStep for Average {
    fn step(
        &mut self,
        _global: &ParamTable,
        updates: &[LocalUpdate],
    ) -> Result<(ParamTable, Metrics), StrategyError> {
        Ok((FedAvg::average(updates, self.weighted)?, Metrics::new()))
    }

    fn save(&self, state: &mut StrategyState) {
        state.extra["weighted"] = self.weighted.into();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::ServerRound;
    use crate::strategy::Strategy;
    use crate::test_model::{flat as host, plan, starts, upload as update};
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn blend(a: &[f32], b: &[f32], wa: f32) -> Vec<f32> {
        a.iter()
            .zip(b)
            .map(|(x, y)| wa * x + (1.0 - wa) * y)
            .collect()
    }

    fn close(a: &[f32], b: &[f32]) -> bool {
        a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-6)
    }

    #[test]
    fn weighted_by_samples_or_equally() {
        let ups = vec![update(1, 10), update(2, 30)];
        let (a, b) = (host(&ups[0].table), host(&ups[1].table));
        for (mut s, wa) in [(FedAvg::weighted(), 0.25), (FedAvg::unweighted(), 0.5)] {
            s.init(update(0, 1).table, 2).unwrap();
            let sent = starts(&plan(&mut s, 1, 10, 2).unwrap());
            assert_eq!(sent.len(), 2);
            s.aggregate(
                ServerRound::new(1, &mut ChaCha8Rng::seed_from_u64(0)),
                ups.clone(),
            )
            .unwrap();
            let global = host(&s.global_model().unwrap());
            assert!(close(&global, &blend(&a, &b, wa)), "weight {wa}");
            // The next round dispatches the new global model to every client.
            let next = starts(&plan(&mut s, 2, 10, 3).unwrap());
            assert!(next.iter().all(|t| host(t) == global));
        }
    }

    #[test]
    fn state_restores_the_global_model() {
        let mut s = FedAvg::weighted();
        s.init(update(0, 1).table, 2).unwrap();
        s.aggregate(
            ServerRound::new(1, &mut ChaCha8Rng::seed_from_u64(0)),
            vec![update(1, 5), update(2, 5)],
        )
        .unwrap();
        let mut t = FedAvg::weighted();
        t.init(update(0, 1).table, 2).unwrap();
        t.restore(s.state()).unwrap();
        assert_eq!(
            host(&t.global_model().unwrap()),
            host(&s.global_model().unwrap())
        );
        assert!(t.restore(StrategyState::default()).is_err());
        assert!(FedAvg::weighted().global_model().is_err());
    }
}
