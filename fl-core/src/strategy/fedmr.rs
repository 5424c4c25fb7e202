//! FedMR (Hu et al., KDD 2024, "Is Aggregation the Only Choice? Federated Learning via
//! Layer-wise Model Recombination").
//!
//! The server keeps K intermediate models instead of one global model. Each round model i goes
//! to the i-th sampled client; after local training the server **recombines** the K uploads:
//! every unit (tensor, layer, block or segment) gets its own random permutation across the K
//! models, so each uploaded unit is used by exactly one new model. The deployable global model
//! is the plain average of the K models.
//!
//! Defaults follow the authors' code: tensor-level shuffling (each weight, bias and BatchNorm
//! statistic independently). `Granularity::Layer` is the paper's description (a BatchNorm moves
//! with its convolution's layer); `Segments` with fraction x is the paper's FedMR-p*x* ablation
//! (layer j of N in segment ⌈j/(x·N)⌉), and fraction 1.0 (whole models re-dispatched,
//! nothing recombined) is FedIndep. With `first_stage = R` the first R rounds aggregate like
//! FedAvg (all K models set to the sample-weighted average) — the paper's two-stage training,
//! used with R = 100 for ResNet-20 and VGG-16. With `secure` the clients recombine among
//! themselves by an encrypted exchange ([`crate::secure`], the paper's Appendix B) and the
//! server only decrypts the result; the recombination invariants are the same.

use super::{Evaluation, Evaluator, Metrics, Result, ServerRound};
use std::time::Instant;

use serde_json::{Map, json};

use super::{FedAvg, ModelSlots, RoundContext, RoundPlan, Strategy, StrategyError, StrategyState};
use crate::layers::{Granularity, ParamTable, cosine, recombine};
use crate::secure::{SecureExchange, ServerKeys};
use crate::trainer::LocalUpdate;

/// Settings of [`FedMr`].
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FedMrConfig {
    /// What is shuffled across models.
    pub granularity: Granularity,
    /// Number of initial rounds aggregated with FedAvg before recombination starts.
    pub first_stage: usize,
    /// Recombine by the clients' encrypted exchange ([`crate::secure`]) instead of on the server.
    pub secure: Option<SecureExchange>,
}

impl Default for FedMrConfig {
    fn default() -> Self {
        Self {
            granularity: Granularity::Tensor,
            first_stage: 0,
            secure: None,
        }
    }
}

/// FedMR's server: K models, recombined every round.
#[derive(Debug, Clone)]
pub struct FedMr {
    config: FedMrConfig,
    models: ModelSlots,
    name: &'static str,
    evaluate_models: bool,
}

impl FedMr {
    /// FedMR with the given settings.
    pub fn new(config: FedMrConfig) -> Self {
        Self {
            config,
            models: ModelSlots::default(),
            name: "fedmr",
            evaluate_models: false,
        }
    }

    /// FedIndep: K models trained independently, only re-dispatched to random clients
    /// (FedMR with one whole-model segment).
    pub fn fedindep() -> Self {
        Self {
            config: FedMrConfig {
                granularity: Granularity::Segments { fraction: 1.0 },
                first_stage: 0,
                secure: None,
            },
            models: ModelSlots::default(),
            name: "fedindep",
            evaluate_models: false,
        }
    }

    /// With `on`, also evaluates each of the K models on the test set (`model_acc`,
    /// `model_loss` in `metrics.jsonl`; FedMR's Fig. 5 plots them next to the averaged model).
    pub fn with_model_evaluation(mut self, on: bool) -> Self {
        self.evaluate_models = on;
        self
    }

    /// The settings.
    pub fn config(&self) -> &FedMrConfig {
        &self.config
    }

    /// The K intermediate models.
    pub fn models(&self) -> &[ParamTable] {
        self.models.models()
    }

    /// Whether `round` (1-based) aggregates with FedAvg instead of recombining.
    pub fn in_first_stage(&self, round: usize) -> bool {
        round <= self.config.first_stage
    }
}

/// Mean cosine similarity over all pairs of `models` (the paper's Fig. 6 diversity measure).
pub fn mean_pairwise_cosine(models: &[ParamTable]) -> Result<f64, StrategyError> {
    // One Gram matrix (one host readback) instead of a readback per pair.
    let g = ParamTable::gram(models)?;
    let mut sum = 0.0;
    let mut pairs = 0usize;
    for i in 0..models.len() {
        for j in i + 1..models.len() {
            sum += cosine([g[i][j], g[i][i], g[j][j]]);
            pairs += 1;
        }
    }
    Ok(if pairs == 0 { 1.0 } else { sum / pairs as f64 })
}

impl Strategy for FedMr {
    fn name(&self) -> &'static str {
        self.name
    }

    fn init(&mut self, initial: ParamTable, sample: usize) -> Result<(), StrategyError> {
        // All K models start from one initial model, as in the authors' code.
        self.models.fill(initial, sample);
        Ok(())
    }

    fn configure_round(&mut self, ctx: &mut RoundContext<'_>) -> Result<RoundPlan> {
        self.models.plan("FedMR", ctx)
    }

    fn aggregate(&mut self, at: ServerRound<'_>, updates: Vec<LocalUpdate>) -> Result<Metrics> {
        let ServerRound { round, rng } = at;
        let uploads: Vec<ParamTable> = updates.iter().map(|u| u.table.clone()).collect();
        let similarity = mean_pairwise_cosine(&uploads)?;
        let timer = Instant::now();
        let mut m = Map::new();
        let stage = if self.in_first_stage(round) {
            let avg = FedAvg::average(&updates, true)?;
            self.models.set_all(avg);
            "fedavg"
        } else if let Some(exchange) = self.config.secure {
            // A fresh server key per round; the clients recombine, the server only decrypts.
            let keys = ServerKeys::generate();
            let outcome = exchange.run(&uploads, self.config.granularity, &keys, rng)?;
            self.models.set(outcome.models);
            m.insert(
                "secure_exchange_bytes".into(),
                json!(outcome.exchange_bytes),
            );
            m.insert("secure_upload_bytes".into(), json!(outcome.upload_bytes));
            "secure-recombine"
        } else {
            self.models
                .set(recombine(&uploads, self.config.granularity, rng)?.models);
            "recombine"
        };
        m.insert("stage".into(), json!(stage));
        m.insert("mean_pairwise_cosine".into(), json!(similarity));
        m.insert(
            "recombine_seconds".into(),
            json!(timer.elapsed().as_secs_f64()),
        );
        Ok(m)
    }

    fn global_model(&self) -> Result<ParamTable, StrategyError> {
        self.models.average()
    }

    fn evaluate(&mut self, round: usize, eval: &dyn Evaluator) -> Result<Evaluation> {
        if eval.client_count() > 0 {
            // Per-client evaluation (`--personal`) of the averaged model.
            return super::personal::evaluate_global(
                round,
                eval,
                &self.global_model()?,
                eval.client_fine_tune(),
            );
        }
        let (acc, loss) = eval.test_set(&self.global_model()?)?;
        let mut extra = super::Metrics::new();
        if self.evaluate_models {
            let scores = self
                .models
                .models()
                .iter()
                .map(|m| eval.test_set(m))
                .collect::<Result<Vec<_>, _>>()?;
            let (accs, losses): (Vec<f64>, Vec<f64>) = scores.into_iter().unzip();
            extra.insert("model_acc".into(), accs.into());
            extra.insert("model_loss".into(), losses.into());
        }
        Ok(super::Evaluation { acc, loss, extra })
    }

    fn state(&self) -> StrategyState {
        StrategyState {
            tables: self.models.models().to_vec(),
            extra: json!({ "config": self.config }),
        }
    }

    fn restore(&mut self, state: StrategyState) -> Result<(), StrategyError> {
        self.models.restore("FedMR", state.tables)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::ServerRound;
    use crate::test_model::tiny;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn update(seed: u64, samples: usize) -> LocalUpdate {
        let m = tiny(seed);
        LocalUpdate {
            steps: 1,
            client: seed as usize,
            table: ParamTable::from_module_with_blocks(&m, crate::Classifier::blocks(&m)).unwrap(),
            state: None,
            prototypes: None,
            num_samples: samples,
            train_loss: 1.0,
        }
    }

    fn host(t: &ParamTable) -> Vec<Vec<f32>> {
        t.to_host().unwrap()
    }

    #[test]
    fn first_stage_averages_then_recombination_starts() {
        let mut s = FedMr::new(FedMrConfig {
            granularity: Granularity::Layer,
            first_stage: 2,
            secure: None,
        });
        s.init(update(0, 1).table, 3).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for round in 1..=3 {
            let ups: Vec<LocalUpdate> = (0..3).map(|i| update(10 * round + i, 10)).collect();
            let m = s
                .aggregate(ServerRound::new(round as usize, &mut rng), ups.clone())
                .unwrap();
            let models: Vec<_> = s.models().iter().map(host).collect();
            if round <= 2 {
                assert_eq!(m["stage"], "fedavg");
                assert!(
                    models.iter().all(|x| x == &models[0]),
                    "round {round}: models differ"
                );
            } else {
                assert_eq!(m["stage"], "recombine");
                // Every model is made of uploaded layers; the multiset of layers is preserved.
                assert_same_layers(&models, &ups);
            }
            assert!(m["mean_pairwise_cosine"].as_f64().unwrap() <= 1.0 + 1e-9);
        }
    }

    #[test]
    fn secure_recombination_keeps_every_layer_and_counts_its_bytes() {
        let mut s = FedMr::new(FedMrConfig {
            granularity: Granularity::Layer,
            first_stage: 0,
            secure: Some(SecureExchange { passes: 2 }),
        });
        s.init(update(0, 1).table, 3).unwrap();
        let ups: Vec<LocalUpdate> = (1..=3).map(|i| update(i, 5)).collect();
        let m = s
            .aggregate(
                ServerRound::new(1, &mut ChaCha8Rng::seed_from_u64(4)),
                ups.clone(),
            )
            .unwrap();
        assert_eq!(m["stage"], "secure-recombine");
        let payload = 3 * ups[0].table.byte_size() as u64;
        assert!(m["secure_upload_bytes"].as_u64().unwrap() > payload);
        assert!(m["secure_exchange_bytes"].as_u64().unwrap() > 0);
        let models: Vec<_> = s.models().iter().map(host).collect();
        assert_same_layers(&models, &ups);
    }

    /// Every layer position holds the same multiset of layers as the uploads.
    fn assert_same_layers(models: &[Vec<Vec<f32>>], ups: &[LocalUpdate]) {
        let up: Vec<_> = ups.iter().map(|u| host(&u.table)).collect();
        for t in 0..models[0].len() {
            let mut a: Vec<_> = models.iter().map(|x| x[t].clone()).collect();
            let mut b: Vec<_> = up.iter().map(|x| x[t].clone()).collect();
            a.sort_by(|x, y| x.partial_cmp(y).unwrap());
            b.sort_by(|x, y| x.partial_cmp(y).unwrap());
            assert_eq!(a, b);
        }
    }

    #[test]
    fn fedindep_only_permutes_whole_models() {
        let mut s = FedMr::fedindep();
        s.init(update(0, 1).table, 4).unwrap();
        let ups: Vec<LocalUpdate> = (1..=4).map(|i| update(i, 5)).collect();
        s.aggregate(
            ServerRound::new(1, &mut ChaCha8Rng::seed_from_u64(3)),
            ups.clone(),
        )
        .unwrap();
        let mut got: Vec<_> = s.models().iter().map(host).collect();
        let mut want: Vec<_> = ups.iter().map(|u| host(&u.table)).collect();
        got.sort_by(|a, b| a[0].partial_cmp(&b[0]).unwrap());
        want.sort_by(|a, b| a[0].partial_cmp(&b[0]).unwrap());
        assert_eq!(got, want);
    }

    #[test]
    fn global_model_is_the_plain_average_and_state_round_trips() {
        let mut s = FedMr::new(FedMrConfig::default());
        s.init(update(0, 1).table, 2).unwrap();
        s.aggregate(
            ServerRound::new(1, &mut ChaCha8Rng::seed_from_u64(0)),
            vec![update(1, 1), update(2, 100)],
        )
        .unwrap();
        let avg = ParamTable::average(s.models(), None).unwrap();
        assert_eq!(host(&s.global_model().unwrap()), host(&avg));
        let state = s.state();
        let mut t = FedMr::new(FedMrConfig::default());
        t.init(update(0, 1).table, 2).unwrap();
        t.restore(state).unwrap();
        assert_eq!(host(&t.global_model().unwrap()), host(&avg));
        let mut wrong = FedMr::new(FedMrConfig::default());
        wrong.init(update(0, 1).table, 3).unwrap();
        assert!(wrong.restore(s.state()).is_err());
    }
}
