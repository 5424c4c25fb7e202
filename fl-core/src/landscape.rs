//! Loss landscapes (Li et al., NeurIPS 2018, "Visualizing the Loss Landscape of Neural Nets"):
//! the loss of a model on the plane `θ + a·δ₁ + b·δ₂` spanned by two random, filter-normalised
//! directions. FedMR's Fig. 7 compares the flatness of FedAvg's and FedMR's global models so.

use burn::tensor::Device;
use fl_data::{Dataset, Normalization};
use rand::Rng;

use crate::layers::{LayerError, ParamKind, ParamTable};
use crate::model::Classifier;
use crate::trainer::evaluate;

/// A Gaussian direction in parameter space with the scale of `center`, filter by filter: for
/// every weight tensor with two or more dimensions, each slice along the first (output)
/// dimension is rescaled to the norm of the same slice of `center`. Biases, BatchNorm
/// parameters and buffers get zero (the paper's "ignore biases and BN" setting), so the plot
/// does not depend on the arbitrary scale of scale-invariant filters.
pub fn filter_normalized_direction<R: Rng>(
    center: &ParamTable,
    rng: &mut R,
    device: &Device,
) -> Result<ParamTable, LayerError> {
    let host = center.named_host()?;
    let directions = host
        .into_iter()
        .zip(center.layout().tensors())
        .map(|(t, info)| {
            if info.kind == ParamKind::Buffer || t.shape.len() < 2 || t.values.is_empty() {
                return vec![0.0; t.values.len()];
            }
            let filter = t.values.len() / t.shape[0];
            let mut d: Vec<f32> = (0..t.values.len()).map(|_| gaussian(rng)).collect();
            for (df, wf) in d.chunks_mut(filter).zip(t.values.chunks(filter)) {
                let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
                let scale = norm(wf) / norm(df).max(1e-12);
                df.iter_mut().for_each(|x| *x *= scale);
            }
            d
        })
        .collect();
    center.from_host(directions, device)
}

/// A standard normal draw (Box–Muller).
fn gaussian<R: Rng>(rng: &mut R) -> f32 {
    let u1: f64 = rng.random_range(f64::MIN_POSITIVE..1.0);
    let u2: f64 = rng.random();
    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
}

/// One evaluated point of a landscape.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct LandscapePoint {
    /// Coefficient of the first direction.
    pub x: f64,
    /// Coefficient of the second direction.
    pub y: f64,
    /// Mean cross-entropy loss on the data.
    pub loss: f64,
    /// Accuracy on the data.
    pub accuracy: f64,
}

/// Evaluates `model` with weights `center + x·d1 + y·d2` for every `(x, y)` in `coords²`
/// (row-major: `y` outer, `x` inner) on `data`.
#[allow(clippy::too_many_arguments)]
pub fn loss_surface<M: Classifier>(
    model: &M,
    center: &ParamTable,
    d1: &ParamTable,
    d2: &ParamTable,
    coords: &[f64],
    data: &Dataset,
    norm: &Normalization,
    batch_size: usize,
) -> Result<Vec<LandscapePoint>, LayerError> {
    let mut points = Vec::with_capacity(coords.len() * coords.len());
    for &y in coords {
        for &x in coords {
            let weights = center.combine(1.0, d1, x)?.combine(1.0, d2, y)?;
            let (accuracy, loss) =
                evaluate(&weights.load_into(model.clone())?, data, norm, batch_size);
            points.push(LandscapePoint {
                x,
                y,
                loss,
                accuracy,
            });
        }
    }
    Ok(points)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_model::{device, tiny};
    use rand::SeedableRng;

    #[test]
    fn directions_match_filter_norms_and_skip_biases_and_buffers() {
        let center = ParamTable::from_module(&tiny(1));
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let d = filter_normalized_direction(&center, &mut rng, &device()).unwrap();
        for (c, (t, info)) in center.named_host().unwrap().iter().zip(
            d.named_host()
                .unwrap()
                .iter()
                .zip(center.layout().tensors()),
        ) {
            if info.kind == ParamKind::Buffer || t.shape.len() < 2 {
                assert!(t.values.iter().all(|&v| v == 0.0), "{}", t.name);
                continue;
            }
            let filter = t.values.len() / t.shape[0];
            for (df, cf) in t.values.chunks(filter).zip(c.values.chunks(filter)) {
                let n = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
                assert!((n(df) - n(cf)).abs() < 1e-4 * n(cf).max(1.0), "{}", t.name);
            }
        }
    }
}
