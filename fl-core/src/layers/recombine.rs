//! FedMR's recombination units and layer-wise recombination.

use burn::tensor::Tensor;
use rand::Rng;
use rand::seq::SliceRandom;

use super::{Granularity, LayerError, ParamTable};

impl ParamTable {
    /// The model's layers as the FedMR paper means them: a normalisation layer (one with running
    /// statistics) belongs to the layer before it (its convolution), not to a layer of its own.
    pub fn paper_layers(&self) -> Vec<Vec<usize>> {
        let layout = &self.layout;
        let mut layers: Vec<Vec<usize>> = Vec::new();
        for (_, tensors) in &layout.layers {
            let norm = tensors
                .iter()
                .any(|&t| layout.tensors[t].kind == super::ParamKind::Buffer);
            match layers.last_mut() {
                Some(previous) if norm => previous.extend(tensors),
                _ => layers.push(tensors.clone()),
            }
        }
        layers
    }

    /// Groups of tensor indices that move together at granularity `g`.
    pub fn units(&self, g: Granularity) -> Result<Vec<Vec<usize>>, LayerError> {
        let layout = &self.layout;
        Ok(match g {
            Granularity::Tensor => (0..layout.tensors.len()).map(|i| vec![i]).collect(),
            Granularity::Layer => self.paper_layers(),
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
                // FedMR-px: layer j of N (1-based) goes to segment ⌈j / (x·N)⌉.
                let layers = self.paper_layers();
                let n = layers.len();
                let mut segments: Vec<Vec<usize>> = Vec::new();
                for (j, tensors) in layers.into_iter().enumerate() {
                    if segments.len() < segment_of(j + 1, n, fraction) {
                        segments.push(Vec::new());
                    }
                    segments.last_mut().expect("pushed").extend(tensors);
                }
                segments
            }
        })
    }
}

/// FedMR-px's segment (1-based) of layer `j` (1-based) of `n`: `⌈j / (x·n)⌉`, with a tolerance
/// so that exact quotients do not round up.
pub fn segment_of(j: usize, n: usize, x: f64) -> usize {
    ((j as f64 / (x * n as f64) - 1e-9).ceil() as usize).max(1)
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
