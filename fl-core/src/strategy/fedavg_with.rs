//! "FedAvg plus a client-side rule": FedProx, FedASAM, MOON and FedGen keep FedAvg's server and
//! change only what the clients do (an extra loss term, sharpness-aware steps), so each is a
//! [`ClientRule`] composed with FedAvg by [`FedAvgWith`] instead of a copy of FedAvg.

use std::sync::Arc;

use rand_chacha::ChaCha8Rng;

use super::{
    FedAvg, Metrics, RoundContext, RoundPlan, Strategy, StrategyError, StrategyState, broadcast,
};
use crate::layers::ParamTable;
use crate::trainer::{LocalObjective, LocalUpdate, TrainConfig};

/// What a method adds to FedAvg on the client side. Every method has a do-nothing default.
pub trait ClientRule: Send {
    /// The method's name (logs, checkpoints).
    fn name(&self) -> &'static str;

    /// Sets up from the initial model (MOON keeps it, FedGen sizes its generator by it).
    fn init(&mut self, initial: &ParamTable) -> Result<(), StrategyError> {
        let _ = initial;
        Ok(())
    }

    /// The clients' local training settings, from the run's.
    fn train(&self, base: &TrainConfig) -> TrainConfig {
        base.clone()
    }

    /// Each sampled client's extra loss term this round (in the order of `clients`), given the
    /// global model they receive; `None` trains on the plain loss.
    fn objectives(
        &self,
        round: usize,
        clients: &[usize],
        global: &ParamTable,
    ) -> Result<Vec<Option<Arc<dyn LocalObjective>>>, StrategyError> {
        let _ = (round, global);
        Ok(vec![None; clients.len()])
    }

    /// Sees the uploads before FedAvg averages them (MOON stores them, FedGen trains its
    /// generator on them); returns extra metrics.
    fn observe(
        &mut self,
        round: usize,
        updates: &[LocalUpdate],
        rng: &mut ChaCha8Rng,
    ) -> Result<Metrics, StrategyError> {
        let _ = (round, updates, rng);
        Ok(Metrics::new())
    }

    /// Adds the rule's state to FedAvg's checkpoint state.
    fn save(&self, state: &mut StrategyState) {
        let _ = state;
    }

    /// Takes the rule's state back out of a checkpoint (leaving FedAvg's).
    fn load(&mut self, state: &mut StrategyState) -> Result<(), StrategyError> {
        let _ = state;
        Ok(())
    }
}

/// FedAvg's server (sample-weighted averaging of one global model) with a [`ClientRule`].
#[derive(Debug, Clone)]
pub struct FedAvgWith<R> {
    avg: FedAvg,
    /// The client-side rule.
    pub rule: R,
}

impl<R: ClientRule> FedAvgWith<R> {
    /// The rule on sample-weighted FedAvg.
    pub fn with_rule(rule: R) -> Self {
        Self {
            avg: FedAvg::weighted(),
            rule,
        }
    }
}

impl<R: ClientRule> Strategy for FedAvgWith<R> {
    fn name(&self) -> &'static str {
        self.rule.name()
    }

    fn init(&mut self, initial: ParamTable, sample: usize) -> Result<(), StrategyError> {
        self.rule.init(&initial)?;
        self.avg.init(initial, sample)
    }

    fn configure_round(
        &mut self,
        round: usize,
        ctx: &mut RoundContext<'_>,
    ) -> Result<RoundPlan, StrategyError> {
        let global = self.avg.global_model()?;
        let mut plan = broadcast(Some(&global), ctx)?;
        plan.train = self.rule.train(ctx.train);
        let objectives = self.rule.objectives(round, &plan.client_ids(), &global)?;
        Ok(plan.with_objectives(objectives))
    }

    fn aggregate(
        &mut self,
        round: usize,
        updates: Vec<LocalUpdate>,
        rng: &mut ChaCha8Rng,
    ) -> Result<Metrics, StrategyError> {
        let mut metrics = self.rule.observe(round, &updates, rng)?;
        metrics.extend(self.avg.aggregate(round, updates, rng)?);
        Ok(metrics)
    }

    fn global_model(&self) -> Result<ParamTable, StrategyError> {
        self.avg.global_model()
    }

    fn state(&self) -> StrategyState {
        let mut state = self.avg.state();
        self.rule.save(&mut state);
        state
    }

    fn restore(&mut self, mut state: StrategyState) -> Result<(), StrategyError> {
        self.rule.load(&mut state)?;
        self.avg.restore(state)
    }
}
