//! FedMR's recombination units and layer-wise recombination.

use burn::tensor::Tensor;
use rand::Rng;
use rand::seq::SliceRandom;

use super::{Granularity, LayerError, ParamTable};

impl ParamTable {
    /// Groups of tensor indices that move together at granularity `g`.
    pub fn units(&self, g: Granularity) -> Result<Vec<Vec<usize>>, LayerError> {
        let layout = &self.layout;
        Ok(match g {
            Granularity::Tensor => (0..layout.tensors.len()).map(|i| vec![i]).collect(),
            Granularity::Layer => layout.layers.iter().map(|(_, t)| t.clone()).collect(),
            Granularity::Block => {
                if layout.blocks.is_empty() {
                    return Err(LayerError::BadGranularity(
                        "block granularity needs a model that declares its blocks".into(),
                    ));
                }
                layout.blocks.iter().map(|(_, t)| t.clone()).collect()
            }
            Granularity::Segments { fraction } => {
                if !(fraction > 0.0 && fraction <= 1.0) {
                    return Err(LayerError::BadGranularity(format!(
                        "segment fraction must be in (0, 1], got {fraction}"
                    )));
                }
                let layers = layout.layers.len();
                let count = ((1.0 / fraction).ceil() as usize).clamp(1, layers);
                (0..count)
                    .map(|s| {
                        let (start, end) = (s * layers / count, (s + 1) * layers / count);
                        layout.layers[start..end]
                            .iter()
                            .flat_map(|(_, t)| t.iter().copied())
                            .collect()
                    })
                    .collect()
            }
        })
    }
}

/// The result of [`recombine`]: new models and, for each unit, which source model each new model
/// took it from (`sources[unit][new_model] = old_model`).
#[derive(Debug, Clone)]
pub struct Recombination {
    /// The recombined models.
    pub models: Vec<ParamTable>,
    /// Per unit, the permutation used.
    pub sources: Vec<Vec<usize>>,
}

/// FedMR's recombination: for every unit at granularity `g`, an independent random permutation
/// decides which source model gives that unit to each new model. Every source unit is used by
/// exactly one new model, so the multiset of tensors (and their sum) is preserved.
pub fn recombine<R: Rng>(
    models: &[ParamTable],
    g: Granularity,
    rng: &mut R,
) -> Result<Recombination, LayerError> {
    let first = models.first().ok_or(LayerError::Empty)?;
    for m in &models[1..] {
        first.check_same(m)?;
    }
    let units = first.units(g)?;
    let k = models.len();
    let mut values: Vec<Vec<Tensor<1>>> = models.iter().map(|m| m.values.clone()).collect();
    let mut sources = Vec::with_capacity(units.len());
    for unit in &units {
        let mut perm: Vec<usize> = (0..k).collect();
        perm.shuffle(rng);
        for (new, &old) in perm.iter().enumerate() {
            for &t in unit {
                values[new][t] = models[old].values[t].clone();
            }
        }
        sources.push(perm);
    }
    Ok(Recombination {
        models: values
            .into_iter()
            .map(|v| ParamTable {
                layout: first.layout.clone(),
                values: v,
            })
            .collect(),
        sources,
    })
}
