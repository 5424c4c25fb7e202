//! FedAvg (McMahan et al., 2017): every sampled client starts from the global model; the new
//! global model is the average of the uploads, weighted by local sample counts (or unweighted).

use rand_chacha::ChaCha8Rng;

use super::{Strategy, StrategyError, StrategyState};
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

    fn init(&mut self, initial: ParamTable, _sample: usize) {
        self.global = Some(initial);
    }

    fn dispatch(
        &mut self,
        _round: usize,
        clients: &[usize],
    ) -> Result<Vec<ParamTable>, StrategyError> {
        let global = self.global.as_ref().ok_or(StrategyError::NotInitialised)?;
        Ok(vec![global.clone(); clients.len()])
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
