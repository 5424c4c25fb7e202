//! FedGH (L. Yi et al., "FedGH: Heterogeneous Federated Learning with Generalized Global
//! Header", ACM MM 2023): clients keep their own feature extractors (any architecture) and
//! share one prediction header, a linear layer over a representation of the same width.
//!
//! Each round a sampled client replaces its header with the global one, trains its whole
//! model on its data, and uploads its per-class mean representations (prototypes,
//! [`Prototypes`]); the server trains the global header on the uploaded (prototype, class)
//! pairs with cross-entropy, one SGD step per prototype.
//!
//! Two departures from the authors' code, both towards the paper: their server step calls
//! the clients' optimiser, not one over the header's parameters, so their global header never
//! changes from its initialisation; and their prototypes are means of per-batch means, here
//! the mean over all of a class's samples. Runs on pFedClub's per-client machinery
//! (`--variant fedgh`).

use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::optim::GradientsParams;
use burn::tensor::{Int, Tensor, TensorData};
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

use super::StrategyError;
use crate::layers::ParamTable;
use crate::trainer::{FusedSgd, LocalObjective, Prototypes};

/// FedGH's server settings.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct FedGhConfig {
    /// Passes over the round's prototypes (the paper: one).
    pub server_epochs: usize,
    /// SGD step size of the header's training.
    pub server_lr: f64,
}

impl Default for FedGhConfig {
    fn default() -> Self {
        Self {
            server_epochs: 1,
            server_lr: 0.01,
        }
    }
}

impl FedGhConfig {
    /// Checks the values a run cannot work with.
    pub fn validate(&self) -> Result<(), String> {
        if self.server_epochs == 0 {
            return Err("FedGH needs at least 1 server epoch".into());
        }
        if !(self.server_lr.is_finite() && self.server_lr > 0.0) {
            return Err(format!(
                "FedGH's server learning rate must be positive, got {}",
                self.server_lr
            ));
        }
        Ok(())
    }
}

/// The client side of FedGH: plain local training, then the prototypes.
pub struct ReportPrototypes;

impl LocalObjective for ReportPrototypes {
    fn reports_prototypes(&self) -> bool {
        true
    }

    fn uses_parameters(&self) -> bool {
        false
    }
}

/// The indices of a client model's header (weight `[D, C]`, bias `[C]`): its last block, which
/// must be one linear layer.
pub fn header_indices(table: &ParamTable) -> Result<(usize, usize), StrategyError> {
    let tensors = table.layout().tensors();
    let bad = |why: &str| StrategyError::Config(format!("FedGH needs a linear header: {why}"));
    let (spec, members) = table
        .layout()
        .blocks()
        .last()
        .ok_or_else(|| bad("the model declares no blocks"))?;
    let find = |leaf: &str| {
        members
            .iter()
            .copied()
            .find(|&t| tensors[t].name.ends_with(leaf))
            .ok_or_else(|| bad(&format!("its last block {} has no {leaf}", spec.name)))
    };
    let (w, b) = (find(".weight")?, find(".bias")?);
    let ok = members.len() == 2
        && tensors[w].shape.len() == 2
        && tensors[b].shape == [tensors[w].shape[1]];
    if !ok {
        return Err(bad(&format!("its last block {} is not one", spec.name)));
    }
    Ok((w, b))
}

/// The `[D, C]` shape of a client model's header.
pub fn header_shape(table: &ParamTable) -> Result<[usize; 2], StrategyError> {
    let (w, _) = header_indices(table)?;
    let shape = &table.layout().tensors()[w].shape;
    Ok([shape[0], shape[1]])
}

/// A standalone header (a `Linear` table) holding a client model's header values.
pub fn header_of(table: &ParamTable) -> Result<ParamTable, StrategyError> {
    let (w, b) = header_indices(table)?;
    let [d, c] = header_shape(table)?;
    let linear = LinearConfig::new(d, c).init(&table.device());
    let values = vec![table.values()[w].clone(), table.values()[b].clone()];
    Ok(ParamTable::from_module(&linear).with_values(values)?)
}

/// The `[D, C]` shape of a standalone header.
fn dims(header: &ParamTable) -> [usize; 2] {
    let classes = header.values()[1].dims()[0];
    [header.values()[0].dims()[0] / classes, classes]
}

/// `table` with its header replaced by `header`.
pub fn with_header(table: &ParamTable, header: &ParamTable) -> Result<ParamTable, StrategyError> {
    let (w, b) = header_indices(table)?;
    if header_shape(table)? != dims(header) {
        return Err(StrategyError::Config(
            "FedGH needs every client's representation to have the header's width".into(),
        ));
    }
    let mut values = table.values().to_vec();
    values[w] = header.values()[0].clone();
    values[b] = header.values()[1].clone();
    Ok(table.with_values(values)?)
}

/// The server step: `header` trained with cross-entropy on the uploaded prototypes, one SGD
/// step per prototype, `cfg.server_epochs` passes in an order drawn from `rng`.
pub fn train_header(
    header: &ParamTable,
    uploads: &[&Prototypes],
    cfg: &FedGhConfig,
    rng: &mut ChaCha8Rng,
) -> Result<ParamTable, StrategyError> {
    let pairs: Vec<(usize, &[f32])> = uploads
        .iter()
        .flat_map(|p| p.classes.iter().map(|(c, _, mean)| (*c, mean.as_slice())))
        .collect();
    if pairs.is_empty() {
        return Ok(header.clone());
    }
    let [width, classes] = dims(header);
    let device = header.device().autodiff();
    let mut linear: Linear = header.load_into(LinearConfig::new(width, classes).init(&device))?;
    let ce = CrossEntropyLossConfig::new().init(&device);
    let mut optim = FusedSgd::plain().init();
    let mut order: Vec<usize> = (0..pairs.len()).collect();
    for _ in 0..cfg.server_epochs {
        order.shuffle(rng);
        for &i in &order {
            let (class, mean) = pairs[i];
            if mean.len() != width {
                return Err(StrategyError::Config(format!(
                    "FedGH: a prototype of width {} for a header of width {width}",
                    mean.len()
                )));
            }
            let x = Tensor::<2>::from_data(TensorData::new(mean.to_vec(), [1, width]), &device);
            let y = Tensor::<1, Int>::from_data(TensorData::new(vec![class as i64], [1]), &device);
            let loss = ce.forward(linear.forward(x), y);
            let grads = GradientsParams::from_grads(loss.backward(), &linear);
            linear = optim.step(cfg.server_lr, linear, grads);
        }
    }
    Ok(ParamTable::from_module(&linear))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Classifier;
    use crate::test_model::{flat, tiny};
    use rand::SeedableRng;

    fn table(seed: u64) -> ParamTable {
        let m = tiny(seed);
        ParamTable::from_module_with_blocks(&m, m.blocks()).unwrap()
    }

    #[test]
    fn the_header_is_the_last_linear_block_and_can_be_swapped() {
        let (a, b) = (table(1), table(2));
        assert_eq!(header_shape(&a).unwrap(), [16, 10]);
        let h = header_of(&b).unwrap();
        let swapped = with_header(&a, &h).unwrap();
        let (w, bias) = header_indices(&a).unwrap();
        for t in 0..a.values().len() {
            let from = if t == w || t == bias { &b } else { &a };
            assert_eq!(
                swapped.values()[t].clone().into_data(),
                from.values()[t].clone().into_data()
            );
        }
        assert_eq!(flat(&header_of(&swapped).unwrap()), flat(&h));
    }

    #[test]
    fn a_header_trained_on_two_separated_classes_separates_them() {
        let header = header_of(&table(3)).unwrap();
        let proto = |class: usize, centre: f32| Prototypes {
            classes: vec![(
                class,
                10,
                (0..16).map(|k| centre + 0.01 * k as f32).collect(),
            )],
        };
        let (a, b) = (proto(2, 1.0), proto(7, -1.0));
        let cfg = FedGhConfig {
            server_epochs: 50,
            server_lr: 0.1,
        };
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let trained = train_header(&header, &[&a, &b], &cfg, &mut rng).unwrap();
        let linear: Linear = trained
            .load_into(LinearConfig::new(16, 10).init(&trained.device()))
            .unwrap();
        for (p, class) in [(&a, 2), (&b, 7)] {
            let x = Tensor::<2>::from_data(
                TensorData::new(p.classes[0].2.clone(), [1, 16]),
                &trained.device(),
            );
            let predicted: Vec<i64> = linear
                .forward(x)
                .argmax(1)
                .into_data()
                .convert::<i64>()
                .try_into_vec()
                .unwrap();
            assert_eq!(predicted, vec![class]);
        }
        // No prototypes, no change; the same generator, the same header.
        assert_eq!(
            flat(&train_header(&header, &[], &cfg, &mut rng).unwrap()),
            flat(&header)
        );
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let again = train_header(&header, &[&a, &b], &cfg, &mut rng).unwrap();
        assert_eq!(flat(&again), flat(&trained));
    }
}
