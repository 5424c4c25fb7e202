//! SCAFFOLD (Karimireddy et al., ICML 2020): control variates correct client drift.
//!
//! The server keeps a control variate `c`, every client `i` its own `cᵢ` (zero until it first
//! trains). A client's local gradient is corrected to `g + c − cᵢ`, implemented as the extra loss
//! `Σ (c − cᵢ)·w` (its gradient is exactly the correction, and it composes with momentum and
//! weight decay like a gradient term). After `K` local steps at learning rate `η_l` the client's
//! new variate is option II of the paper, `cᵢ⁺ = cᵢ − c + (x − yᵢ)/(K·η_l)`. The server applies
//! `x ← x + η_g·mean(yᵢ − x)` and `c ← c + (|S|/N)·mean(cᵢ⁺ − cᵢ)`, so `c` stays the mean of all
//! N client variates.
//!
//! Communication doubles (each client downloads `c` and uploads `cᵢ⁺ − cᵢ`): reported as
//! `control_bytes`. Variates cover trainable parameters; BatchNorm statistics take the plain
//! average. Client variates are kept for clients that have trained (memory grows with them).

use super::{Metrics, Result, ServerRound};
use std::sync::Arc;

use burn::tensor::Tensor;

use super::{
    ClientTables, FedAvg, RoundContext, RoundPlan, Strategy, StrategyError, StrategyState,
};
use crate::layers::{ParamKind, ParamTable};
use crate::trainer::{LocalObjective, LocalUpdate};

/// SCAFFOLD's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScaffoldConfig {
    /// Server learning rate η_g (paper: 1).
    pub server_lr: f64,
    /// The clients' local learning rate η_l (for the variate update).
    pub local_lr: f64,
    /// Total number of clients N.
    pub num_clients: usize,
}

/// SCAFFOLD with option-II control variates.
#[derive(Debug, Clone)]
pub struct Scaffold {
    config: ScaffoldConfig,
    global: Option<ParamTable>,
    server_control: Option<ParamTable>,
    client_controls: ClientTables,
}

impl Scaffold {
    /// SCAFFOLD with `config`.
    pub fn new(config: ScaffoldConfig) -> Self {
        Self {
            config,
            global: None,
            server_control: None,
            client_controls: ClientTables::default(),
        }
    }

    /// The server variate `c`.
    pub fn server_control(&self) -> Option<&ParamTable> {
        self.server_control.as_ref()
    }

    /// Client `i`'s variate `cᵢ` (zero if it never trained).
    pub fn client_control(&self, client: usize) -> Result<ParamTable, StrategyError> {
        let c = self
            .server_control
            .as_ref()
            .ok_or(StrategyError::NotInitialised)?;
        Ok(self
            .client_controls
            .get(client)
            .cloned()
            .unwrap_or_else(|| c.zeros_like()))
    }
}

/// The drift correction `Σ (c − cᵢ)·w` over trainable tensors.
#[derive(Debug, Clone)]
pub struct DriftCorrection {
    /// `c − cᵢ` for this client.
    pub correction: ParamTable,
}

impl LocalObjective for DriftCorrection {
    fn extra_loss(&self, params: &ParamTable, _start: &ParamTable) -> Option<Tensor<1>> {
        Some(params.trainable_sum(&self.correction, |w, c| (w * c).sum()))
    }
}

impl Scaffold {
    /// Each client's drift correction `c − cᵢ` as its local objective, in the order of
    /// `clients`.
    pub fn corrections(
        &self,
        clients: &[usize],
    ) -> Result<Vec<Option<Arc<dyn LocalObjective>>>, StrategyError> {
        let c = self
            .server_control
            .as_ref()
            .ok_or(StrategyError::NotInitialised)?;
        clients
            .iter()
            .map(|&i| {
                let correction = c.sub(&self.client_control(i)?)?;
                Ok(Some(Arc::new(DriftCorrection { correction }) as _))
            })
            .collect()
    }
}

impl Strategy for Scaffold {
    fn name(&self) -> &'static str {
        "scaffold"
    }

    fn init(&mut self, initial: ParamTable, _sample: usize) -> Result<(), StrategyError> {
        self.server_control = Some(initial.zeros_like());
        self.global = Some(initial);
        self.client_controls.clear();
        Ok(())
    }

    fn configure_round(&mut self, ctx: &mut RoundContext<'_>) -> Result<RoundPlan> {
        let plan = super::broadcast(self.global.as_ref(), ctx)?;
        let corrections = self.corrections(&plan.client_ids())?;
        Ok(plan.with_objectives(corrections))
    }

    fn aggregate(&mut self, _at: ServerRound<'_>, updates: Vec<LocalUpdate>) -> Result<Metrics> {
        let (Some(x), Some(c)) = (&self.global, &self.server_control) else {
            return Err(StrategyError::NotInitialised);
        };
        let ScaffoldConfig {
            server_lr,
            local_lr,
            num_clients,
        } = self.config;
        let mut control_change = c.zeros_like();
        for u in &updates {
            let ci = self.client_control(u.client)?;
            // cᵢ⁺ = cᵢ − c + (x − yᵢ)/(K·η_l)
            let drift = x
                .sub(&u.table)?
                .scale(1.0 / (u.steps.max(1) as f64 * local_lr));
            let new_ci = ci
                .sub(c)?
                .combine(1.0, &drift, 1.0)?
                .map_kind(ParamKind::Buffer, |v| v.zeros_like());
            control_change = control_change.combine(1.0, &new_ci.sub(&ci)?, 1.0)?;
            self.client_controls.insert(u.client, new_ci);
        }
        let average = FedAvg::average(&updates, false)?;
        let step = x.combine(1.0 - server_lr, &average, server_lr)?;
        let new_global = step.with_buffers_from(&FedAvg::average(&updates, true)?)?;
        let new_c = c.combine(1.0, &control_change, 1.0 / num_clients as f64)?;
        let control_bytes = 2 * updates.len() * c.byte_size();
        self.global = Some(new_global);
        self.server_control = Some(new_c);
        let mut metrics = serde_json::Map::new();
        metrics.insert("control_bytes".into(), control_bytes.into());
        Ok(metrics)
    }

    fn global_model(&self) -> Result<ParamTable, StrategyError> {
        self.global.clone().ok_or(StrategyError::NotInitialised)
    }

    fn state(&self) -> StrategyState {
        let mut state = StrategyState {
            tables: self
                .global
                .iter()
                .chain(&self.server_control)
                .cloned()
                .collect(),
            extra: serde_json::json!({ "server_lr": self.config.server_lr }),
        };
        self.client_controls.save_into(&mut state);
        state
    }

    fn restore(&mut self, mut state: StrategyState) -> Result<(), StrategyError> {
        self.client_controls = ClientTables::take_from("SCAFFOLD", &mut state, 2)?;
        let mut tables = state.tables.into_iter();
        self.global = tables.next();
        self.server_control = tables.next();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::ServerRound;
    use crate::test_model::{close, flat, upload};
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn config(n: usize) -> ScaffoldConfig {
        ScaffoldConfig {
            server_lr: 1.0,
            local_lr: 0.1,
            num_clients: n,
        }
    }

    #[test]
    fn the_server_variate_is_the_mean_of_all_client_variates() {
        let n = 6;
        let mut s = Scaffold::new(config(n));
        s.init(upload(100, 1).table, 3).unwrap();
        for (round, clients) in [[0, 1, 2], [2, 3, 4], [5, 0, 3], [1, 2, 5]]
            .iter()
            .enumerate()
        {
            let round = round + 1;
            let ups = clients
                .iter()
                .map(|&i| LocalUpdate {
                    client: i,
                    steps: 3 + i,
                    ..upload((round * 10 + i) as u64, 10 + i)
                })
                .collect();
            s.aggregate(
                ServerRound::new(round, &mut ChaCha8Rng::seed_from_u64(0)),
                ups,
            )
            .unwrap();
            let all: Vec<ParamTable> = (0..n).map(|i| s.client_control(i).unwrap()).collect();
            let mean = ParamTable::average(&all, None).unwrap();
            assert!(close(
                &flat(s.server_control().unwrap()),
                &flat(&mean),
                1e-4
            ));
        }
        // A checkpoint restores every variate.
        let mut t = Scaffold::new(config(n));
        t.init(upload(100, 1).table, 3).unwrap();
        t.restore(s.state()).unwrap();
        for i in 0..n {
            assert_eq!(
                flat(&t.client_control(i).unwrap()),
                flat(&s.client_control(i).unwrap())
            );
        }
    }

    #[test]
    fn option_two_variate_and_correction() {
        let mut s = Scaffold::new(config(4));
        let x = upload(1, 1).table;
        s.init(x.clone(), 1).unwrap();
        // First round: c = cᵢ = 0, so the correction is zero.
        let objective = s.corrections(&[2]).unwrap().remove(0).unwrap();
        let params = ParamTable::from_module(&crate::test_model::tiny(3));
        let loss = objective.extra_loss(&params, &x).unwrap();
        assert_eq!(loss.into_scalar::<f32>(), 0.0);
        let y = upload(2, 10);
        s.aggregate(
            ServerRound::new(1, &mut ChaCha8Rng::seed_from_u64(0)),
            vec![LocalUpdate {
                client: 2,
                steps: 5,
                ..y.clone()
            }],
        )
        .unwrap();
        // c₂ = (x − y)/(5·0.1) on trainable tensors; the global model moved to y.
        let expected = x.sub(&y.table).unwrap().scale(2.0);
        let got = s.client_control(2).unwrap();
        for ((a, b), info) in flat(&got).iter().zip(flat(&expected)).zip(flat_kinds(&got)) {
            let want = if info == ParamKind::Trainable { b } else { 0.0 };
            assert!((a - want).abs() < 1e-4);
        }
        assert!(close(
            &flat(&s.global_model().unwrap()),
            &flat(&y.table),
            1e-5
        ));
    }

    fn flat_kinds(t: &ParamTable) -> Vec<ParamKind> {
        t.layout()
            .tensors()
            .iter()
            .flat_map(|i| std::iter::repeat_n(i.kind, i.shape.iter().product()))
            .collect()
    }
}
