//! FedCross (Hu et al., "FedCross: Towards Accurate Federated Learning via Multi-Model Cross
//! Aggregation", ICDE 2024).
//!
//! The server keeps K middleware models. Each round model i goes to the i-th sampled client
//! (sampling order is random, so this is the paper's shuffle); after local training each upload
//! vᵢ is fused with one collaborative model v_co chosen among the other uploads:
//! wᵢ = α·vᵢ + (1 − α)·v_co. The deployable global model is the plain average of the K models.
//!
//! Partner selection ([`PartnerSelection`]):
//! - in order: in round r (0-based) model i takes model (i + (r mod (K − 1)) + 1) mod K, so
//!   every other model is visited once every K − 1 rounds;
//! - lowest / highest similarity: argmin / argmax over j ≠ i of sim(vᵢ, vⱼ) (ties: lowest j).
//!
//! Similarity ([`SimilarityMeasure`]): `Cosine` (default) is x·y / (‖x‖·‖y‖) over the whole
//! model; `LayerCosine` sums each layer's cosine similarity, which is what the authors' code
//! actually computes (a sum of cosines over consecutive weight/bias tensor pairs); `Paper` is
//! Eq. 5 as printed, x·y / (‖x‖ + ‖y‖). The paper's form grows with the norms, so it ranks
//! pairs differently when norms differ; the two cosine forms differ in how much each layer
//! counts (by its size, or equally). All run over every tensor, BatchNorm statistics included.
//!
//! Training acceleration (§3.2.4; in no public code, built from the paper's text):
//! - propellers: for the first n cross-aggregation rounds each model is fused with **two**
//!   partners taken in order (the in-order partners of rounds r and r + 1), with weights
//!   wᵢ = α·vᵢ + (1 − α)/2·(v_a + v_b). We keep the total collaborator weight at 1 − α so α
//!   means the same thing in every round; the speed-up comes from knowledge of two models
//!   spreading per round instead of one;
//! - dynamic α: α grows linearly from `start` (first round) to `end` (after `rounds` rounds)
//!   and stays there; with propellers (PM-DA) the schedule starts when the propellers stop.
//!
//! The first `first_stage` rounds can aggregate with FedAvg (all K models set to the
//! sample-weighted average) before cross aggregation starts.

use super::{Metrics, Result, ServerRound};
use std::str::FromStr;

use serde_json::{Map, json};

use super::{FedAvg, ModelSlots, RoundContext, RoundPlan, Strategy, StrategyError, StrategyState};
use crate::layers::{ParamTable, sum_products};
use crate::trainer::LocalUpdate;

/// How each model's collaborative partner is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PartnerSelection {
    /// A fixed rotation that visits every other model once every K − 1 rounds.
    InOrder,
    /// The least similar other upload (the paper's recommendation).
    Lowest,
    /// The most similar other upload.
    Highest,
}

impl FromStr for PartnerSelection {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "in-order" => Ok(Self::InOrder),
            "lowest" => Ok(Self::Lowest),
            "highest" => Ok(Self::Highest),
            _ => Err(format!(
                "unknown partner selection '{s}' (known: in-order, lowest, highest)"
            )),
        }
    }
}

/// The similarity used by [`PartnerSelection::Lowest`] and [`PartnerSelection::Highest`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SimilarityMeasure {
    /// x·y / (‖x‖·‖y‖) over the whole model.
    Cosine,
    /// Sum over layers of each layer's cosine similarity: what the authors' code computes
    /// (it sums cosines of consecutive weight/bias pairs).
    LayerCosine,
    /// x·y / (‖x‖ + ‖y‖), the paper's Eq. 5 as printed.
    Paper,
}

impl FromStr for SimilarityMeasure {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cosine" => Ok(Self::Cosine),
            "layer-cosine" => Ok(Self::LayerCosine),
            "paper" => Ok(Self::Paper),
            _ => Err(format!(
                "unknown similarity '{s}' (known: cosine, layer-cosine, paper)"
            )),
        }
    }
}

/// A linear α schedule: `start` in its first round, `end` from round `rounds` on.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DynamicAlpha {
    /// α in the first scheduled round.
    pub start: f64,
    /// α from round `rounds` of the schedule on.
    pub end: f64,
    /// Length of the ramp in rounds (≥ 1).
    pub rounds: usize,
}

impl DynamicAlpha {
    /// α in round `step` (1-based) of the schedule.
    pub fn at(&self, step: usize) -> f64 {
        if self.rounds <= 1 {
            return self.end;
        }
        let progress = (step.max(1) - 1).min(self.rounds - 1) as f64 / (self.rounds - 1) as f64;
        self.start + (self.end - self.start) * progress
    }
}

impl FromStr for DynamicAlpha {
    type Err = String;
    /// Parses `START:END:ROUNDS`, e.g. `0.5:0.99:100`.
    fn from_str(s: &str) -> Result<Self, String> {
        let parts: Vec<&str> = s.split(':').collect();
        let bad =
            || format!("dynamic alpha must be START:END:ROUNDS (e.g. 0.5:0.99:100), got '{s}'");
        if parts.len() != 3 {
            return Err(bad());
        }
        Ok(Self {
            start: parts[0].trim().parse().map_err(|_| bad())?,
            end: parts[1].trim().parse().map_err(|_| bad())?,
            rounds: parts[2].trim().parse().map_err(|_| bad())?,
        })
    }
}

/// Settings of [`FedCross`].
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FedCrossConfig {
    /// Weight of a model's own upload in its fusion (paper default 0.99).
    pub alpha: f64,
    /// How partners are chosen.
    pub selection: PartnerSelection,
    /// Similarity for the similarity-based selections.
    pub similarity: SimilarityMeasure,
    /// Rounds aggregated with FedAvg before cross aggregation starts.
    pub first_stage: usize,
    /// Cross-aggregation rounds (counted after the first stage) that use two in-order propeller
    /// partners instead of one selected partner; 0 disables them.
    pub propeller_rounds: usize,
    /// Replace the fixed α by a schedule (starting after the propeller rounds).
    pub dynamic_alpha: Option<DynamicAlpha>,
    /// Fuse only trainable parameters; BatchNorm statistics stay each model's own.
    pub trainable_only: bool,
}

impl Default for FedCrossConfig {
    fn default() -> Self {
        Self {
            alpha: 0.99,
            selection: PartnerSelection::Lowest,
            similarity: SimilarityMeasure::Cosine,
            first_stage: 0,
            propeller_rounds: 0,
            dynamic_alpha: None,
            trainable_only: false,
        }
    }
}

impl FedCrossConfig {
    /// Checks ranges: every α in [0, 1], a ramp of at least one round.
    pub fn validate(&self) -> Result<(), String> {
        let in_unit = |a: f64| (0.0..=1.0).contains(&a);
        if !in_unit(self.alpha) {
            return Err(format!("alpha must be in [0, 1], got {}", self.alpha));
        }
        if let Some(d) = self.dynamic_alpha {
            if !in_unit(d.start) || !in_unit(d.end) {
                return Err(format!(
                    "dynamic alpha START and END must be in [0, 1], got {}:{}",
                    d.start, d.end
                ));
            }
            if d.rounds == 0 {
                return Err("dynamic alpha ROUNDS must be at least 1".into());
            }
        }
        Ok(())
    }
}

/// How one round fuses the uploads.
#[derive(Debug, Clone, PartialEq)]
pub struct CrossPlan {
    /// α of this round.
    pub alpha: f64,
    /// `partners[i]`: the uploads model i is fused with (one, or two propellers).
    pub partners: Vec<Vec<usize>>,
}

/// FedCross's server: K middleware models, cross-aggregated every round.
#[derive(Debug, Clone)]
pub struct FedCross {
    config: FedCrossConfig,
    models: ModelSlots,
}

/// In-order partner of model `i` among `k` in 0-based round `r`.
pub fn in_order_partner(i: usize, r: usize, k: usize) -> usize {
    if k < 2 {
        return i;
    }
    (i + (r % (k - 1)) + 1) % k
}

impl FedCross {
    /// FedCross with the given settings (check them with [`FedCrossConfig::validate`]).
    pub fn new(config: FedCrossConfig) -> Self {
        Self {
            config,
            models: ModelSlots::default(),
        }
    }

    /// The settings.
    pub fn config(&self) -> &FedCrossConfig {
        &self.config
    }

    /// The K middleware models.
    pub fn models(&self) -> &[ParamTable] {
        self.models.models()
    }

    /// Whether `round` (1-based) aggregates with FedAvg.
    pub fn in_first_stage(&self, round: usize) -> bool {
        round <= self.config.first_stage
    }

    /// α and partners for `round` (1-based, after the first stage) given the pairwise
    /// similarity matrix of the uploads (only read by similarity-based selection).
    pub fn plan(&self, round: usize, similarity: &[Vec<f64>]) -> CrossPlan {
        let k = similarity.len();
        let r = round - 1;
        let step = round.saturating_sub(self.config.first_stage).max(1);
        let propellers = step <= self.config.propeller_rounds;
        let alpha = match self.config.dynamic_alpha {
            Some(d) if propellers => d.start,
            Some(d) => d.at(step - self.config.propeller_rounds),
            None => self.config.alpha,
        };
        let partners = (0..k)
            .map(|i| {
                if k < 2 {
                    return Vec::new();
                }
                if propellers {
                    let a = in_order_partner(i, r, k);
                    let b = in_order_partner(i, r + 1, k);
                    return if a == b { vec![a] } else { vec![a, b] };
                }
                let pick = match self.config.selection {
                    PartnerSelection::InOrder => in_order_partner(i, r, k),
                    PartnerSelection::Lowest => extreme(&similarity[i], i, |a, b| a < b),
                    PartnerSelection::Highest => extreme(&similarity[i], i, |a, b| a > b),
                };
                vec![pick]
            })
            .collect();
        CrossPlan { alpha, partners }
    }

    /// Pairwise similarity of the uploads under the configured measure, plus the mean pairwise
    /// cosine similarity (reported as a diversity metric whatever the measure).
    fn similarities(&self, uploads: &[ParamTable]) -> Result<(Vec<Vec<f64>>, f64), StrategyError> {
        let k = uploads.len();
        let mut sim = vec![vec![0.0; k]; k];
        let (mut cos_sum, mut pairs) = (0.0, 0usize);
        for i in 0..k {
            for j in i + 1..k {
                // One host read per pair serves every measure.
                let layers = uploads[i].layer_products(&uploads[j])?;
                let cos = |[dot, xx, yy]: [f64; 3]| dot / (xx * yy).sqrt().max(f64::MIN_POSITIVE);
                let [dot, xx, yy] = sum_products(&layers);
                let cosine = cos([dot, xx, yy]);
                let s = match self.config.similarity {
                    SimilarityMeasure::Cosine => cosine,
                    SimilarityMeasure::LayerCosine => layers.iter().map(|&l| cos(l)).sum(),
                    SimilarityMeasure::Paper => {
                        dot / (xx.sqrt() + yy.sqrt()).max(f64::MIN_POSITIVE)
                    }
                };
                sim[i][j] = s;
                sim[j][i] = s;
                cos_sum += cosine;
                pairs += 1;
            }
        }
        let mean_cosine = if pairs == 0 {
            1.0
        } else {
            cos_sum / pairs as f64
        };
        Ok((sim, mean_cosine))
    }

    /// Applies `plan` to the uploads: wᵢ = α·vᵢ + (1 − α)/p·Σ partners.
    pub fn fuse(
        &self,
        uploads: &[ParamTable],
        plan: &CrossPlan,
    ) -> Result<Vec<ParamTable>, StrategyError> {
        uploads
            .iter()
            .zip(&plan.partners)
            .map(|(own, partners)| {
                if partners.is_empty() || plan.alpha >= 1.0 {
                    return Ok(own.clone());
                }
                let share = (1.0 - plan.alpha) / partners.len() as f64;
                let tables: Vec<ParamTable> = std::iter::once(own)
                    .chain(partners.iter().map(|&p| &uploads[p]))
                    .cloned()
                    .collect();
                let weights: Vec<f64> = std::iter::once(plan.alpha)
                    .chain(partners.iter().map(|_| share))
                    .collect();
                let fused = ParamTable::average(&tables, Some(&weights))?;
                Ok(if self.config.trainable_only {
                    fused.with_buffers_from(own)?
                } else {
                    fused
                })
            })
            .collect()
    }
}

/// Index j ≠ `me` whose value wins `better` (first one on ties).
fn extreme(row: &[f64], me: usize, better: impl Fn(f64, f64) -> bool) -> usize {
    let mut best: Option<usize> = None;
    for (j, &v) in row.iter().enumerate() {
        if j == me {
            continue;
        }
        if best.is_none_or(|b| better(v, row[b])) {
            best = Some(j);
        }
    }
    best.unwrap_or(me)
}

impl Strategy for FedCross {
    fn name(&self) -> &'static str {
        "fedcross"
    }

    fn init(&mut self, initial: ParamTable, sample: usize) -> Result<(), StrategyError> {
        self.models.fill(initial, sample);
        Ok(())
    }

    fn configure_round(&mut self, ctx: &mut RoundContext<'_>) -> Result<RoundPlan> {
        self.models.plan("FedCross", ctx)
    }

    fn aggregate(&mut self, at: ServerRound<'_>, updates: Vec<LocalUpdate>) -> Result<Metrics> {
        let round = at.round;
        let uploads: Vec<ParamTable> = updates.iter().map(|u| u.table.clone()).collect();
        let (similarity, mean_cosine) = self.similarities(&uploads)?;
        let mut m = Map::new();
        m.insert("mean_pairwise_cosine".into(), json!(mean_cosine));
        if self.in_first_stage(round) {
            let avg = FedAvg::average(&updates, true)?;
            self.models.set_all(avg);
            m.insert("stage".into(), json!("fedavg"));
            return Ok(m);
        }
        let plan = self.plan(round, &similarity);
        self.models.set(self.fuse(&uploads, &plan)?);
        let propellers = plan.partners.iter().any(|p| p.len() > 1);
        m.insert(
            "stage".into(),
            json!(if propellers { "propellers" } else { "cross" }),
        );
        m.insert("alpha".into(), json!(plan.alpha));
        m.insert("partners".into(), json!(plan.partners));
        Ok(m)
    }

    fn global_model(&self) -> Result<ParamTable, StrategyError> {
        self.models.average()
    }

    fn state(&self) -> StrategyState {
        StrategyState {
            tables: self.models.models().to_vec(),
            extra: json!({ "config": self.config }),
        }
    }

    fn restore(&mut self, state: StrategyState) -> Result<(), StrategyError> {
        self.models.restore("FedCross", state.tables)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::ServerRound;
    use crate::test_model::upload as update;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn host(t: &ParamTable) -> Vec<Vec<f32>> {
        t.to_host().unwrap()
    }

    fn started(config: FedCrossConfig, k: usize) -> FedCross {
        let mut s = FedCross::new(config);
        s.init(update(0, 1).table, k).unwrap();
        s
    }

    #[test]
    fn in_order_schedule_visits_every_other_model_within_k_minus_1_rounds() {
        for k in 2..9 {
            for i in 0..k {
                let mut seen: Vec<usize> = (0..k - 1).map(|r| in_order_partner(i, r, k)).collect();
                seen.sort();
                let others: Vec<usize> = (0..k).filter(|&j| j != i).collect();
                assert_eq!(seen, others, "k={k} i={i}");
            }
        }
    }

    #[test]
    fn similarity_selection_never_picks_self_and_finds_the_extremes() {
        let sim = vec![
            vec![1.0, 0.2, 0.9, 0.5],
            vec![0.2, 1.0, 0.1, 0.7],
            vec![0.9, 0.1, 1.0, 0.3],
            vec![0.5, 0.7, 0.3, 1.0],
        ];
        let lowest = started(FedCrossConfig::default(), 4).plan(1, &sim);
        assert_eq!(lowest.partners, vec![vec![1], vec![2], vec![1], vec![2]]);
        let highest = started(
            FedCrossConfig {
                selection: PartnerSelection::Highest,
                ..Default::default()
            },
            4,
        )
        .plan(1, &sim);
        // Self-similarity is the largest entry of each row, yet never chosen.
        assert_eq!(highest.partners, vec![vec![2], vec![3], vec![0], vec![1]]);
    }

    #[test]
    fn alpha_one_keeps_models_and_alpha_half_makes_pairs_symmetric() {
        let ups: Vec<ParamTable> = (1..=3).map(|i| update(i, 1).table).collect();
        let s = started(FedCrossConfig::default(), 3);
        let keep = CrossPlan {
            alpha: 1.0,
            partners: vec![vec![1], vec![2], vec![0]],
        };
        let out = s.fuse(&ups, &keep).unwrap();
        for (a, b) in out.iter().zip(&ups) {
            assert_eq!(host(a), host(b));
        }
        let half = CrossPlan {
            alpha: 0.5,
            partners: vec![vec![1], vec![0], vec![0]],
        };
        let out = s.fuse(&ups, &half).unwrap();
        // Models 0 and 1 took each other: both are the midpoint.
        for (x, y) in host(&out[0]).iter().zip(host(&out[1])) {
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() <= 1e-6 * (1.0 + a.abs()), "{a} vs {b}");
            }
        }
        assert_ne!(host(&out[0]), host(&ups[0]));
    }

    #[test]
    fn dynamic_alpha_hits_its_endpoints_and_follows_propellers() {
        let d: DynamicAlpha = "0.5:0.99:11".parse().unwrap();
        assert_eq!(d.at(1), 0.5);
        assert!((d.at(6) - 0.745).abs() < 1e-12);
        assert_eq!(d.at(11), 0.99);
        assert_eq!(d.at(500), 0.99);
        assert!("0.5:0.99".parse::<DynamicAlpha>().is_err());
        let s = started(
            FedCrossConfig {
                first_stage: 2,
                propeller_rounds: 3,
                dynamic_alpha: Some(d),
                ..Default::default()
            },
            4,
        );
        let sim = vec![vec![0.0; 4]; 4];
        // Rounds 3..=5 are propeller rounds at the schedule's start α, two distinct partners.
        for round in 3..=5 {
            let p = s.plan(round, &sim);
            assert_eq!(p.alpha, 0.5);
            for (i, pair) in p.partners.iter().enumerate() {
                assert_eq!(pair.len(), 2);
                assert!(!pair.contains(&i) && pair[0] != pair[1]);
            }
        }
        // Then one partner each, α ramping from the start.
        let p = s.plan(6, &sim);
        assert!(p.partners.iter().all(|x| x.len() == 1));
        assert_eq!(p.alpha, 0.5);
        assert_eq!(s.plan(16, &sim).alpha, 0.99);
    }

    #[test]
    fn trainable_only_keeps_each_models_own_batchnorm_statistics() {
        // Shift every tensor per model so no two models share a value (fresh models all have
        // the same BatchNorm statistics and affine parameters).
        use crate::layers::ParamKind;
        let ups: Vec<ParamTable> = (1..=2)
            .map(|i| {
                let shift = move |t: burn::tensor::Tensor<1>| t.add_scalar(i as f64);
                update(i, 1)
                    .table
                    .map_kind(ParamKind::Buffer, shift)
                    .map_kind(ParamKind::Trainable, shift)
            })
            .collect();
        let s = started(
            FedCrossConfig {
                trainable_only: true,
                ..Default::default()
            },
            2,
        );
        let plan = CrossPlan {
            alpha: 0.5,
            partners: vec![vec![1], vec![0]],
        };
        let out = s.fuse(&ups, &plan).unwrap();
        let layout = ups[0].layout();
        let (mut buffers, mut trainable) = (0, 0);
        for (t, info) in layout.tensors().iter().enumerate() {
            let same = host(&out[0])[t] == host(&ups[0])[t];
            match info.kind {
                ParamKind::Buffer => {
                    buffers += 1;
                    assert!(same, "{} was mixed", info.name)
                }
                ParamKind::Trainable => {
                    trainable += 1;
                    assert!(!same, "{} was not mixed", info.name)
                }
            }
        }
        assert!(buffers > 0 && trainable > 0);
    }

    #[test]
    fn aggregation_is_deterministic_and_state_round_trips() {
        let run = || {
            let mut s = started(FedCrossConfig::default(), 3);
            let mut rng = ChaCha8Rng::seed_from_u64(0);
            let mut metrics = Vec::new();
            for round in 1..=3u64 {
                let ups = (0..3).map(|i| update(10 * round + i, 5)).collect();
                metrics.push(
                    s.aggregate(ServerRound::new(round as usize, &mut rng), ups)
                        .unwrap(),
                );
            }
            (s, metrics)
        };
        let (a, ma) = run();
        let (b, mb) = run();
        assert_eq!(ma, mb);
        assert_eq!(
            host(&a.global_model().unwrap()),
            host(&b.global_model().unwrap())
        );
        let mut c = started(FedCrossConfig::default(), 3);
        c.restore(a.state()).unwrap();
        assert_eq!(
            host(&c.global_model().unwrap()),
            host(&a.global_model().unwrap())
        );
        assert!(ma[2]["partners"].as_array().unwrap().len() == 3);
    }

    #[test]
    fn the_three_similarity_measures_follow_their_formulas() {
        let base = update(1, 1).table;
        let constant = |c: f32| {
            let host = base
                .to_host()
                .unwrap()
                .into_iter()
                .map(|t| vec![c; t.len()])
                .collect();
            base.from_host(host, &base.device()).unwrap()
        };
        let (a, b) = (constant(1.0), constant(2.0));
        let n = base.num_elements() as f64;
        let layers = base.layout().layers().len() as f64;
        for (measure, expected) in [
            (SimilarityMeasure::Cosine, 1.0),
            (SimilarityMeasure::LayerCosine, layers),
            (
                SimilarityMeasure::Paper,
                2.0 * n / (n.sqrt() + 2.0 * n.sqrt()),
            ),
        ] {
            let s = started(
                FedCrossConfig {
                    similarity: measure,
                    ..Default::default()
                },
                2,
            );
            let (sim, mean_cos) = s.similarities(&[a.clone(), b.clone()]).unwrap();
            assert!(
                (sim[0][1] - expected).abs() < 1e-4 * expected,
                "{measure:?}: {}",
                sim[0][1]
            );
            assert_eq!(sim[0][1], sim[1][0]);
            assert!((mean_cos - 1.0).abs() < 1e-6);
        }
    }

    #[test]
    fn config_validation_rejects_out_of_range_alphas() {
        let bad = FedCrossConfig {
            alpha: 1.5,
            ..Default::default()
        };
        assert!(bad.validate().is_err());
        let bad = FedCrossConfig {
            dynamic_alpha: Some(DynamicAlpha {
                start: -0.1,
                end: 0.9,
                rounds: 3,
            }),
            ..Default::default()
        };
        assert!(bad.validate().is_err());
        assert!(FedCrossConfig::default().validate().is_ok());
    }
}
