//! pFedBayes (Zhang, Li, Li, Wang, Ni, ICML 2022): personalised FL by variational Bayesian
//! inference. The server keeps a global posterior `z` (mean-field Gaussian, [`Posterior`]);
//! each client keeps its own personalised posterior and trains it towards its data under a KL
//! pull to `z` ([`BayesStep`]), and uploads its updated copy of `z`; the server mixes the
//! uploads' sample-weighted average in with β, `z ← (1 − β)z + β·avg` (μ and ρ alike, as the
//! authors' code averages both). Each client is evaluated on the mean of its personalised
//! posterior; `global_acc` reports the global posterior's mean on the same test portions.
//!
//! Choices (README "Algorithm notes"): a client's personalised posterior starts as the global
//! posterior it first receives (the authors' code starts every client from the initial model,
//! the same thing in round 1), and a client that never trained is evaluated on the global one.

use super::pfedme::BetaMix;
use super::{
    ClientTables, Evaluation, Evaluator, Metrics, Result, RoundContext, RoundPlan, ServerRound,
    ServerStep, Strategy, StrategyError, StrategyState,
};
use crate::bayes::Posterior;
use crate::layers::ParamTable;
use crate::trainer::{BayesStep, LocalProcedure, LocalUpdate, TrainConfig};

/// pFedBayes' server: the global posterior and the clients' personalised ones.
#[derive(Debug, Clone)]
pub struct PFedBayes {
    step: BayesStep,
    rho: f64,
    mix: BetaMix,
    /// The model's own layout (to read posteriors).
    model: Option<ParamTable>,
    /// The global posterior, packed.
    global: Option<ParamTable>,
    /// Each trained client's personalised posterior, packed (kept on the client in a real
    /// deployment; the strategy holds it so runs checkpoint and resume exactly).
    personal: ClientTables,
}

impl PFedBayes {
    /// pFedBayes with the clients' `step`, initial `ρ = rho` (σ = softplus(ρ)) and the
    /// server's `beta` (1: plain averaging).
    pub fn new(step: BayesStep, rho: f64, beta: f64) -> Self {
        Self {
            step,
            rho,
            mix: BetaMix { beta },
            model: None,
            global: None,
            personal: ClientTables::default(),
        }
    }

    fn model(&self) -> Result<&ParamTable> {
        self.model.as_ref().ok_or(StrategyError::NotInitialised)
    }

    fn global(&self) -> Result<&ParamTable> {
        self.global.as_ref().ok_or(StrategyError::NotInitialised)
    }

    /// The mean of a packed posterior: the model it is evaluated with.
    fn mean(&self, packed: &ParamTable) -> Result<ParamTable> {
        Ok(Posterior::unpack(packed, self.model()?)?.mean)
    }

    /// Mean and per-client accuracies of `models` on each client's test portion.
    fn per_client(
        eval: &dyn Evaluator,
        models: Vec<(usize, ParamTable)>,
    ) -> Result<(f64, f64, Vec<f64>)> {
        let n = models.len() as f64;
        let results = eval.client_tests(&models)?;
        let acc = results.iter().map(|r| r.0).sum::<f64>() / n;
        let loss = results.iter().map(|r| r.1).sum::<f64>() / n;
        let each = results.iter().map(|r| (r.0 * 1e4).round() / 1e4).collect();
        Ok((acc, loss, each))
    }
}

impl Strategy for PFedBayes {
    fn name(&self) -> &'static str {
        "pfedbayes"
    }

    fn init(&mut self, initial: ParamTable, _sample: usize) -> Result<()> {
        self.global = Some(Posterior::new(initial.clone(), self.rho).pack());
        self.model = Some(initial);
        self.personal.clear();
        Ok(())
    }

    fn configure_round(&mut self, ctx: &mut RoundContext<'_>) -> Result<RoundPlan> {
        let global = self.global()?.clone();
        let clients = ctx.sample_uniform();
        let states = clients
            .iter()
            .map(|&c| self.personal.get(c).cloned())
            .collect();
        let train = TrainConfig {
            procedure: LocalProcedure::PFedBayes(self.step),
            ..ctx.train.clone()
        };
        let starts = vec![global; clients.len()];
        Ok(RoundPlan::new(&train, &clients, starts).with_states(states))
    }

    fn aggregate(
        &mut self,
        _at: ServerRound<'_>,
        mut updates: Vec<LocalUpdate>,
    ) -> Result<Metrics> {
        for u in &mut updates {
            let state = u.state.take().ok_or_else(|| {
                StrategyError::Config(format!("client {} returned no posterior", u.client))
            })?;
            self.personal.insert(u.client, state);
        }
        let global = self.global()?.clone();
        let (global, metrics) = self.mix.step(&global, &updates)?;
        self.global = Some(global);
        Ok(metrics)
    }

    fn evaluate(&mut self, _round: usize, eval: &dyn Evaluator) -> Result<Evaluation> {
        let global = self.mean(self.global()?)?;
        let n = eval.client_count();
        if n == 0 {
            let (acc, loss) = eval.test_set(&global)?;
            return Ok(Evaluation {
                acc,
                loss,
                extra: Metrics::new(),
            });
        }
        let personal = (0..n)
            .map(|c| match self.personal.get(c) {
                Some(p) => Ok((c, self.mean(p)?)),
                None => Ok((c, global.clone())),
            })
            .collect::<Result<Vec<_>>>()?;
        let (acc, loss, each) = Self::per_client(eval, personal)?;
        let (global_acc, _, _) =
            Self::per_client(eval, (0..n).map(|c| (c, global.clone())).collect())?;
        let mut extra = Metrics::new();
        extra.insert("client_acc".into(), each.into());
        extra.insert("global_acc".into(), global_acc.into());
        Ok(Evaluation { acc, loss, extra })
    }

    fn global_model(&self) -> Result<ParamTable> {
        self.mean(self.global()?)
    }

    fn checkpoint_layout(
        &self,
        _slot: usize,
        _extra: &serde_json::Value,
    ) -> Result<Option<ParamTable>> {
        // Every slot is a packed posterior.
        Ok(Some(self.global()?.clone()))
    }

    fn state(&self) -> StrategyState {
        let mut state = StrategyState {
            tables: self.global.iter().cloned().collect(),
            extra: serde_json::json!({}),
        };
        self.personal.save_into(&mut state);
        state.extra["zeta"] = self.step.zeta.into();
        state
    }

    fn restore(&mut self, mut state: StrategyState) -> Result<()> {
        self.personal = ClientTables::take_from("pfedbayes", &mut state, 1)?;
        self.global = state.tables.pop();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_model::{flat, tiny, upload};

    #[test]
    fn the_server_averages_posteriors_and_keeps_each_clients_own() {
        let mut s = PFedBayes::new(
            BayesStep {
                zeta: 1.0,
                personal_lr: 0.001,
                inner_steps: 1,
                noise: 1.0,
            },
            -3.0,
            1.0,
        );
        s.init(ParamTable::from_module(&tiny(1)), 2).unwrap();
        let post = |seed| Posterior::new(ParamTable::from_module(&tiny(seed)), -2.0).pack();
        let up = |client, seed, samples| LocalUpdate {
            client,
            table: post(seed),
            state: Some(post(seed + 10)),
            prototypes: None,
            ..upload(seed, samples)
        };
        let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(0);
        s.aggregate(
            ServerRound::new(1, &mut rng),
            vec![up(3, 2, 30), up(5, 4, 10)],
        )
        .unwrap();
        // z is the sample-weighted average of the uploaded posteriors (μ and ρ).
        let expected = ParamTable::average(&[post(2), post(4)], Some(&[30.0, 10.0])).unwrap();
        assert!(crate::test_model::close(
            &flat(s.global().unwrap()),
            &flat(&expected),
            1e-6
        ));
        // Each client's personalised posterior is kept, and checkpoints round-trip.
        assert_eq!(flat(s.personal.get(5).unwrap()), flat(&post(14)));
        let mut back = PFedBayes::new(s.step, -3.0, 1.0);
        back.init(ParamTable::from_module(&tiny(1)), 2).unwrap();
        back.restore(s.state()).unwrap();
        assert_eq!(flat(back.global().unwrap()), flat(s.global().unwrap()));
        assert_eq!(flat(back.personal.get(3).unwrap()), flat(&post(12)));
        assert!(back.personal.get(4).is_none());
    }
}
