//! FedAvg (McMahan et al., 2017): every sampled client starts from the global model; the new
//! global model is the average of the uploads, weighted by local sample counts (or unweighted).

use rand_chacha::ChaCha8Rng;

use super::{RoundContext, RoundPlan, Strategy, StrategyError, StrategyState};
use crate::layers::ParamTable;
use crate::trainer::LocalUpdate;

/// Federated averaging with one server model.
#[derive(Debug, Clone, Default)]
pub struct FedAvg {
    global: Option<ParamTable>,
    /// Weight uploads by their clients' sample counts (the paper's rule) or equally.
    pub weighted: bool,
}

impl FedAvg {
    /// FedAvg weighted by sample counts.
    pub fn weighted() -> Self {
        Self {
            global: None,
            weighted: true,
        }
    }

    /// FedAvg with equal weights.
    pub fn unweighted() -> Self {
        Self {
            global: None,
            weighted: false,
        }
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

impl Strategy for FedAvg {
    fn name(&self) -> &'static str {
        "fedavg"
    }

    fn init(&mut self, initial: ParamTable, _sample: usize) -> Result<(), StrategyError> {
        self.global = Some(initial);
        Ok(())
    }

    fn configure_round(
        &mut self,
        _round: usize,
        ctx: &mut RoundContext<'_>,
    ) -> Result<RoundPlan, StrategyError> {
        super::broadcast(self.global.as_ref(), ctx)
    }

    fn aggregate(
        &mut self,
        _round: usize,
        updates: Vec<LocalUpdate>,
        _rng: &mut ChaCha8Rng,
    ) -> Result<serde_json::Map<String, serde_json::Value>, StrategyError> {
        self.global = Some(Self::average(&updates, self.weighted)?);
        Ok(Default::default())
    }

    fn global_model(&self) -> Result<ParamTable, StrategyError> {
        self.global.clone().ok_or(StrategyError::NotInitialised)
    }

    fn state(&self) -> StrategyState {
        StrategyState {
            tables: self.global.iter().cloned().collect(),
            extra: serde_json::json!({ "weighted": self.weighted }),
        }
    }

    fn restore(&mut self, state: StrategyState) -> Result<(), StrategyError> {
        let [global] = <[ParamTable; 1]>::try_from(state.tables).map_err(|t| {
            StrategyError::Restore(format!("FedAvg keeps 1 model, checkpoint has {}", t.len()))
        })?;
        self.global = Some(global);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_model::{flat as host, plan, starts, upload as update};
    use rand::SeedableRng;

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
            s.aggregate(1, ups.clone(), &mut ChaCha8Rng::seed_from_u64(0))
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
            1,
            vec![update(1, 5), update(2, 5)],
            &mut ChaCha8Rng::seed_from_u64(0),
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
