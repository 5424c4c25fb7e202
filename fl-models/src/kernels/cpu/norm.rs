//! Batch normalisation: the training pass (batch statistics) forward and backward, and the
//! inference pass (given statistics) with its input gradient.

use rayon::prelude::*;

use super::sum;

/// Shapes of one batch normalisation over `[batch, channels, plane]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NormGeometry {
    /// Batch size.
    pub batch: usize,
    /// Channels (one mean and variance each).
    pub channels: usize,
    /// Elements per channel per sample (height × width).
    pub plane: usize,
}

impl NormGeometry {
    /// The planes of channel `c`, one per sample.
    fn planes<'a>(&self, data: &'a [f32], c: usize) -> impl Iterator<Item = &'a [f32]> {
        (0..self.batch).map(move |n| &data[(n * self.channels + c) * self.plane..][..self.plane])
    }

    fn count(&self) -> f64 {
        (self.batch * self.plane) as f64
    }
}

/// `Σ a·(b − shift)`, in eight interleaved partial sums.
#[inline(always)]
fn dot_centred(a: &[f32], b: &[f32], shift: f32) -> f32 {
    let mut lanes = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let rest: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * (y - shift))
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            lanes[i] += x[i] * (y[i] - shift);
        }
    }
    lanes.iter().sum::<f32>() + rest
}

/// Batch normalisation with batch statistics: `y = γ (x − μ) / √(σ² + ε) + β` per channel,
/// returning `(y, μ, σ²)` with the biased variance (what Burn feeds its running statistics).
/// Channel statistics are summed per plane in `f32` and across planes in `f64`, in a fixed order.
pub fn batch_norm_train_forward(
    g: &NormGeometry,
    x: &[f32],
    gamma: &[f32],
    beta: &[f32],
    epsilon: f64,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let stats: Vec<(f32, f32)> = (0..g.channels)
        .into_par_iter()
        .map(|c| channel_stats(g, x, c))
        .collect();
    // y = a·x + b with a = γ/√(σ²+ε), b = β − μ·a.
    let affine: Vec<(f32, f32)> = stats
        .iter()
        .zip(gamma.iter().zip(beta))
        .map(|(&(m, v), (&gm, &bt))| {
            let a = (gm as f64 / (v as f64 + epsilon).sqrt()) as f32;
            (a, bt - m * a)
        })
        .collect();
    let mut y = super::par_zeroed(x.len());
    if g.plane > 0 {
        let sample = g.channels * g.plane;
        y.par_chunks_mut(sample)
            .zip(x.par_chunks(sample))
            .for_each(|(y_s, x_s)| affine_sample(g.plane, &affine, x_s, y_s));
    }
    let (mean, var) = stats.into_iter().unzip();
    (y, mean, var)
}

/// Gradients of [`batch_norm_train_forward`] with respect to `x`, `γ` and `β`, given the
/// statistics it returned: with x̂ = (x − μ)/√(σ²+ε) and M elements per channel,
/// `dβ = Σ dy`, `dγ = Σ dy·x̂`, `dx = γ/√(σ²+ε) · (dy − dβ/M − x̂·dγ/M)`. `grad` holds dy and
/// is overwritten with dx (no new buffer); returns `(dγ, dβ)`.
pub fn batch_norm_train_backward(
    g: &NormGeometry,
    x: &[f32],
    (gamma, mean, var): (&[f32], &[f32], &[f32]),
    epsilon: f64,
    grad: &mut [f32],
) -> (Vec<f32>, Vec<f32>) {
    assert_eq!(x.len(), grad.len(), "batch norm backward: gradient length");
    let dy = &*grad;
    let inv_std: Vec<f64> = var
        .iter()
        .map(|&v| 1.0 / (v as f64 + epsilon).sqrt())
        .collect();
    // Per channel: Σ dy and Σ dy·(x − μ).
    let sums: Vec<(f64, f64)> = (0..g.channels)
        .into_par_iter()
        .map(|c| channel_grad_sums(g, dy, x, c, mean[c]))
        .collect();
    let mut d_gamma = vec![0.0f32; g.channels];
    let mut d_beta = vec![0.0f32; g.channels];
    // dx = k·dy + c1·x + c0 per channel.
    let mut coefficients = Vec::with_capacity(g.channels);
    for c in 0..g.channels {
        let (sum_dy, sum_dy_centred) = sums[c];
        let m = mean[c] as f64;
        let sum_dy_xhat = sum_dy_centred * inv_std[c];
        d_beta[c] = sum_dy as f32;
        d_gamma[c] = sum_dy_xhat as f32;
        let k = gamma[c] as f64 * inv_std[c];
        let c1 = -k * inv_std[c] * sum_dy_xhat / g.count();
        let c0 = -k * sum_dy / g.count() - c1 * m;
        coefficients.push((k as f32, c1 as f32, c0 as f32));
    }
    if g.plane > 0 {
        let sample = g.channels * g.plane;
        grad.par_chunks_mut(sample)
            .zip(x.par_chunks(sample))
            .for_each(|(d_s, x_s)| backward_sample(g.plane, &coefficients, x_s, d_s));
    }
    (d_gamma, d_beta)
}

// The training passes' loops, compiled for the best tier like the other kernels (every sum
// keeps its order on any tier), sample by sample so no plane pays an index division (MobileNets'
// 2×2 and 4×4 planes are a few floats each).

/// Channel `c`'s batch mean and biased variance: per plane in `f32` ([`sum`], eight
/// interleaved partial sums), across planes in `f64`, in sample order.
#[inline(always)]
fn channel_stats_generic(g: &NormGeometry, x: &[f32], c: usize) -> (f32, f32) {
    let mean = g.planes(x, c).map(|p| sum(p) as f64).sum::<f64>() / g.count();
    let m = mean as f32;
    let var = g
        .planes(x, c)
        .map(|p| {
            let centred = |v: &f32| v - m;
            let mut lanes = [0.0f32; 8];
            let chunks = p.chunks_exact(8);
            let rest: f32 = chunks.remainder().iter().map(|v| centred(v).powi(2)).sum();
            for chunk in chunks {
                for i in 0..8 {
                    lanes[i] += centred(&chunk[i]).powi(2);
                }
            }
            (lanes.iter().sum::<f32>() + rest) as f64
        })
        .sum::<f64>()
        / g.count();
    (m, var as f32)
}

/// Channel `c`'s `Σ dy` and `Σ dy·(x − μ)`.
#[inline(always)]
fn channel_grad_sums_generic(
    g: &NormGeometry,
    dy: &[f32],
    x: &[f32],
    c: usize,
    mean: f32,
) -> (f64, f64) {
    let sum_dy: f64 = g.planes(dy, c).map(|p| sum(p) as f64).sum();
    let sum_dy_centred: f64 = g
        .planes(dy, c)
        .zip(g.planes(x, c))
        .map(|(d, v)| dot_centred(d, v, mean) as f64)
        .sum();
    (sum_dy, sum_dy_centred)
}

/// `y = a·x + b` over one sample's `[channels, plane]`, `(a, b)` per channel.
#[inline(always)]
fn affine_sample_generic(plane: usize, affine: &[(f32, f32)], x: &[f32], y: &mut [f32]) {
    for ((y_p, x_p), &(a, b)) in y
        .chunks_exact_mut(plane)
        .zip(x.chunks_exact(plane))
        .zip(affine)
    {
        for (o, v) in y_p.iter_mut().zip(x_p) {
            *o = a * v + b;
        }
    }
}

/// `dx = k·dy + c1·x + c0` over one sample, in place over `dy`.
#[inline(always)]
fn backward_sample_generic(
    plane: usize,
    coefficients: &[(f32, f32, f32)],
    x: &[f32],
    d: &mut [f32],
) {
    for ((d_p, x_p), &(k, c1, c0)) in d
        .chunks_exact_mut(plane)
        .zip(x.chunks_exact(plane))
        .zip(coefficients)
    {
        for (d, v) in d_p.iter_mut().zip(x_p) {
            *d = k * *d + c1 * v + c0;
        }
    }
}

best_isa! {
    fn channel_stats => channel_stats_generic(g: &NormGeometry, x: &[f32], c: usize) -> (f32, f32)
}

best_isa! {
    fn channel_grad_sums => channel_grad_sums_generic(g: &NormGeometry, dy: &[f32], x: &[f32], c: usize, mean: f32) -> (f64, f64)
}

best_isa! {
    fn affine_sample => affine_sample_generic(plane: usize, affine: &[(f32, f32)], x: &[f32], y: &mut [f32])
}

best_isa! {
    fn backward_sample => backward_sample_generic(plane: usize, coefficients: &[(f32, f32, f32)], x: &[f32], d: &mut [f32])
}

/// `((x − mean) / std) · γ + β` over one sample's `[channels, plane]`, in place, each value
/// computed with exactly the operations of Burn's `batch_norm` (so the results are bitwise
/// Burn's).
#[inline(always)]
fn inference_generic(plane: usize, x: &mut [f32], params: (&[f32], &[f32], &[f32], &[f32])) {
    let (gamma, beta, mean, std) = params;
    for (c, x) in x.chunks_mut(plane).enumerate() {
        let (m, s, g, b) = (mean[c], std[c], gamma[c], beta[c]);
        for x in x.iter_mut() {
            *x = ((*x - m) / s) * g + b;
        }
    }
}

/// `(dy · γ) · (1 / std)` over one sample, in place: the input gradient as Burn's autodiff
/// computes it through that composition.
#[inline(always)]
fn inference_backward_generic(plane: usize, grad: &mut [f32], gamma: &[f32], std: &[f32]) {
    for (c, grad) in grad.chunks_mut(plane).enumerate() {
        let (g, inv) = (gamma[c], 1.0 / std[c]);
        for d in grad.iter_mut() {
            *d = (*d * g) * inv;
        }
    }
}

best_isa! {
    fn inference_sample => inference_generic(
        plane: usize,
        x: &mut [f32],
        params: (&[f32], &[f32], &[f32], &[f32])
    )
}

best_isa! {
    fn inference_backward_sample => inference_backward_generic(
        plane: usize,
        grad: &mut [f32],
        gamma: &[f32],
        std: &[f32]
    )
}

/// Batch normalisation with given statistics (inference, frozen layers), overwriting `x`:
/// `std` is `sqrt(var + ε)` as the caller computed it. One pass, samples in parallel, where
/// Burn's composition makes four passes on one thread.
pub fn batch_norm_inference(
    g: &NormGeometry,
    x: &mut [f32],
    (gamma, beta, mean, std): (&[f32], &[f32], &[f32], &[f32]),
) {
    let sample = (g.channels * g.plane).max(1);
    x.par_chunks_mut(sample)
        .for_each(|x| inference_sample(g.plane, x, (gamma, beta, mean, std)));
}

/// The input gradient of [`batch_norm_inference`], overwriting the output gradient in `grad`.
pub fn batch_norm_inference_backward(
    g: &NormGeometry,
    grad: &mut [f32],
    gamma: &[f32],
    std: &[f32],
) {
    let sample = (g.channels * g.plane).max(1);
    grad.par_chunks_mut(sample)
        .for_each(|grad| inference_backward_sample(g.plane, grad, gamma, std));
}
