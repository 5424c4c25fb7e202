//! Batch normalisation: the training pass (batch statistics) forward and backward, and the
//! inference pass (given statistics) with its input gradient.

use rayon::prelude::*;
use std::mem::MaybeUninit;

use super::act::{backward_one, forward_one};
use crate::kernels::Activation;

/// A channel's `(a, b)` of the normalisation `a·x + b`.
type Affine = (f32, f32);
/// A channel's `(k, c1, c0)` of the input gradient `k·dz + c1·x + c0`.
type GradCoefficients = (f32, f32, f32);

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
    #[cfg(test)]
    fn planes<'a>(&self, data: &'a [f32], c: usize) -> impl Iterator<Item = &'a [f32]> {
        (0..self.batch).map(move |n| &data[(n * self.channels + c) * self.plane..][..self.plane])
    }

    fn count(&self) -> f64 {
        (self.batch * self.plane) as f64
    }

    /// `per_sample(n, out)` for every sample `n` on the pool, filling `out` with sample `n`'s
    /// `R` sums per channel: all the planes' sums, `[batch][channels][R]`. Samples are
    /// contiguous, so each task reads memory in order (a channel's planes are strided apart).
    fn per_sample_sums<const R: usize>(
        &self,
        per_sample: impl Fn(usize, &mut [[f32; R]]) + Sync,
    ) -> Vec<[f32; R]> {
        let mut sums = vec![[0.0f32; R]; self.batch * self.channels];
        sums.par_chunks_mut(self.channels.max(1))
            .enumerate()
            .for_each(|(n, out)| per_sample(n, out));
        sums
    }

    /// Channel `c`'s `Σ_n f64(plane sum r of (n, c))`, in sample order.
    #[cfg(test)]
    fn channel_total<const R: usize>(&self, sums: &[[f32; R]], c: usize, r: usize) -> f64 {
        (0..self.batch)
            .map(|n| f64::from(sums[n * self.channels + c][r]))
            .sum()
    }

    /// Every channel's `Σ_n f64(plane sum r of (n, c))`, each in sample order as `Iterator::sum`
    /// adds (what [`channel_total`](Self::channel_total) computes), sample by sample through
    /// `sums` (a channel's sums lie `channels` apart: read one at a time, each missed the cache).
    fn channel_totals<const R: usize>(&self, sums: &[[f32; R]]) -> [Vec<f64>; R] {
        let mut totals: [Vec<f64>; R] = std::array::from_fn(|_| vec![sum_start(); self.channels]);
        for sample in sums.chunks_exact(self.channels.max(1)) {
            for (c, s) in sample.iter().enumerate() {
                for r in 0..R {
                    totals[r][c] += f64::from(s[r]);
                }
            }
        }
        totals
    }

    /// Sample `n`'s `[channels, plane]` values of `data`.
    fn sample<'a>(&self, data: &'a [f32], n: usize) -> &'a [f32] {
        let len = self.channels * self.plane;
        &data[n * len..][..len]
    }
}

/// The value `Iterator::sum` starts from, so the loops below add exactly as it does.
#[inline(always)]
fn sum_start<T: std::iter::Sum>() -> T {
    std::iter::empty::<T>().sum()
}

/// `R` sums over one plane (`Q` equal-length operand slices), `Σ term(r, values)` for each `r`,
/// each in the order of [`sum`](super::sum): eight interleaved partial sums over the whole
/// chunks of eight, those lanes summed, plus the remainder summed. Plain loops (no iterator
/// adapters), so all of it inlines into the caller's instruction tier.
#[inline(always)]
// Indices run over the Q operands and R sums at once: one index reads them all.
#[allow(clippy::needless_range_loop)]
fn plane_sums<const Q: usize, const R: usize>(
    operands: [&[f32]; Q],
    term: impl Fn(usize, [f32; Q]) -> f32,
) -> [f32; R] {
    let len = operands[0].len();
    let whole = len / 8;
    let mut chunks: [&[[f32; 8]]; Q] = [&[]; Q];
    for q in 0..Q {
        assert_eq!(operands[q].len(), len, "plane lengths");
        chunks[q] = &operands[q].as_chunks::<8>().0[..whole];
    }
    let mut lanes = [[0.0f32; 8]; R];
    // One sweep per sum (the plane is in L1 by the second): in a single sweep the vectoriser
    // packed the sums' lanes together and shuffled.
    for r in 0..R {
        for j in 0..whole {
            for i in 0..8 {
                let mut v = [0.0f32; Q];
                for q in 0..Q {
                    v[q] = chunks[q][j][i];
                }
                lanes[r][i] += term(r, v);
            }
        }
    }
    let mut sums = [0.0f32; R];
    for r in 0..R {
        let mut rest = sum_start::<f32>();
        for k in whole * 8..len {
            let mut v = [0.0f32; Q];
            for q in 0..Q {
                v[q] = operands[q][k];
            }
            rest += term(r, v);
        }
        let mut total = sum_start::<f32>();
        for l in lanes[r] {
            total += l;
        }
        sums[r] = total + rest;
    }
    sums
}

/// Batch normalisation with batch statistics and an activation after it:
/// `y = act(γ (x − μ) / √(σ² + ε) + β)` per channel, returning `(y, μ, σ²)` with the biased
/// variance (what Burn feeds its running statistics). The activation is applied as the
/// normalised value is written (bitwise the two ops, one pass fewer each way).
/// Channel statistics are summed per plane in `f32` and across planes in `f64`, in a fixed order.
pub fn batch_norm_train_forward(
    g: &NormGeometry,
    x: &[f32],
    (gamma, beta): (&[f32], &[f32]),
    epsilon: f64,
    act: Activation,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    // Per plane in f32, across samples in f64 (in sample order): the mean, then the variance.
    let sums = g.per_sample_sums(|n, out| sample_sums(g.plane, g.sample(x, n), out));
    let [sums] = g.channel_totals(&sums);
    let mean: Vec<f32> = sums.iter().map(|s| (s / g.count()) as f32).collect();
    let squares = g.per_sample_sums(|n, out| sample_squares(g.plane, g.sample(x, n), &mean, out));
    let [squares] = g.channel_totals(&squares);
    let var: Vec<f32> = squares.iter().map(|s| (s / g.count()) as f32).collect();
    let y = batch_norm_train_output(g, x, (gamma, beta), (&mean, &var), epsilon, act);
    (y, mean, var)
}

/// The output of [`batch_norm_train_forward`] again from the statistics it returned, bit for
/// bit (the same coefficients and pass): autodiff's gradient checkpointing recomputes it in the
/// backward pass instead of keeping it from the forward pass.
pub fn batch_norm_train_output(
    g: &NormGeometry,
    x: &[f32],
    (gamma, beta): (&[f32], &[f32]),
    (mean, var): (&[f32], &[f32]),
    epsilon: f64,
    act: Activation,
) -> Vec<f32> {
    let affine = affine_coefficients((gamma, beta), (mean, var), epsilon);
    // Written once, not zeroed first (the zeroing pass was 2% of MobileNetV2's step).
    // SAFETY: `x` is whole samples of `channels · plane` floats (empty if `plane` is 0), and
    // `affine_sample` writes every float of each sample's chunk (it asserts the lengths).
    unsafe {
        super::written_whole(x.len(), |y| {
            if g.plane > 0 {
                let sample = g.channels * g.plane;
                y.par_chunks_mut(sample)
                    .zip(x.par_chunks(sample))
                    .for_each(|(y_s, x_s)| affine_sample(g.plane, (&affine, act), x_s, y_s));
            }
        })
    }
}

/// Each channel's `(a, b)` of the normalisation `a·x + b`: `a = γ/√(σ²+ε)`, `b = β − μ·a` (the
/// backward pass recomputes the activation's input from them, bit for bit).
fn affine_coefficients(
    (gamma, beta): (&[f32], &[f32]),
    (mean, var): (&[f32], &[f32]),
    epsilon: f64,
) -> Vec<Affine> {
    (0..gamma.len())
        .map(|c| {
            let a = (gamma[c] as f64 / (var[c] as f64 + epsilon).sqrt()) as f32;
            (a, beta[c] - mean[c] * a)
        })
        .collect()
}

/// Gradients of [`batch_norm_train_forward`] with respect to `x`, `γ` and `β`, given the
/// statistics it returned: with dz the activation's gradient (recomputed from `x`), x̂ =
/// (x − μ)/√(σ²+ε) and M elements per channel, `dβ = Σ dz`, `dγ = Σ dz·x̂`,
/// `dx = γ/√(σ²+ε) · (dz − dβ/M − x̂·dγ/M)`. `grad` holds dy and is overwritten with dx (no
/// new buffer); returns `(dγ, dβ)`.
pub fn batch_norm_train_backward(
    g: &NormGeometry,
    x: &[f32],
    params: TrainParams<'_>,
    epsilon: f64,
    act: Activation,
    grad: &mut [f32],
) -> (Vec<f32>, Vec<f32>) {
    let (coefficients, affine, d_gamma, d_beta) =
        train_backward_coefficients(g, x, params, epsilon, act, grad);
    if g.plane > 0 {
        let sample = g.channels * g.plane;
        grad.par_chunks_mut(sample)
            .zip(x.par_chunks(sample))
            .for_each(|(d_s, x_s)| {
                backward_sample(g.plane, (&coefficients, &affine, act), x_s, d_s)
            });
    }
    (d_gamma, d_beta)
}

/// [`batch_norm_train_backward`] from a gradient that is not this pass's to overwrite (a
/// residual branch's, shared with the shortcut): dx into a new buffer in one pass, instead of
/// a copy and a pass over it. Returns `(dx, dγ, dβ)`, the same values.
pub fn batch_norm_train_backward_into(
    g: &NormGeometry,
    x: &[f32],
    params: TrainParams<'_>,
    epsilon: f64,
    act: Activation,
    dy: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (coefficients, affine, d_gamma, d_beta) =
        train_backward_coefficients(g, x, params, epsilon, act, dy);
    let sample = (g.channels * g.plane).max(1);
    // SAFETY: the chunks cover the buffer, and each sample's is written whole.
    let dx = unsafe {
        super::written_whole(x.len(), |dx| {
            dx.par_chunks_mut(sample)
                .zip(x.par_chunks(sample).zip(dy.par_chunks(sample)))
                .for_each(|(dx_s, (x_s, dy_s))| {
                    backward_into_sample(g.plane, (&coefficients, &affine, act), x_s, dy_s, dx_s)
                })
        })
    };
    (dx, d_gamma, d_beta)
}

/// γ, β, and the means and variances [`batch_norm_train_forward`] returned, per channel.
pub type TrainParams<'a> = (&'a [f32], &'a [f32], &'a [f32], &'a [f32]);

/// The per-channel coefficients of the backward pass (`dx = k·dz + c1·x + c0`), the
/// activation's affine inputs, `dγ` and `dβ`, from `dy`.
fn train_backward_coefficients(
    g: &NormGeometry,
    x: &[f32],
    (gamma, beta, mean, var): TrainParams<'_>,
    epsilon: f64,
    act: Activation,
    dy: &[f32],
) -> (Vec<GradCoefficients>, Vec<Affine>, Vec<f32>, Vec<f32>) {
    assert_eq!(x.len(), dy.len(), "batch norm backward: gradient length");
    let affine = affine_coefficients((gamma, beta), (mean, var), epsilon);
    let inv_std: Vec<f64> = var
        .iter()
        .map(|&v| 1.0 / (v as f64 + epsilon).sqrt())
        .collect();
    // Per channel: Σ dz and Σ dz·(x − μ), in one pass.
    let plane_sums = g.per_sample_sums(|n, out| {
        let operands = (g.sample(dy, n), g.sample(x, n));
        sample_grad_sums(g.plane, operands, (mean, &affine, act), out)
    });
    let mut d_gamma = vec![0.0f32; g.channels];
    let mut d_beta = vec![0.0f32; g.channels];
    // dx = k·dz + c1·x + c0 per channel.
    let mut coefficients = Vec::with_capacity(g.channels);
    let [sums_dy, sums_dy_centred] = g.channel_totals(&plane_sums);
    for c in 0..g.channels {
        let (sum_dy, sum_dy_centred) = (sums_dy[c], sums_dy_centred[c]);
        let m = mean[c] as f64;
        let sum_dy_xhat = sum_dy_centred * inv_std[c];
        d_beta[c] = sum_dy as f32;
        d_gamma[c] = sum_dy_xhat as f32;
        let k = gamma[c] as f64 * inv_std[c];
        let c1 = -k * inv_std[c] * sum_dy_xhat / g.count();
        let c0 = -k * sum_dy / g.count() - c1 * m;
        coefficients.push((k as f32, c1 as f32, c0 as f32));
    }
    (coefficients, affine, d_gamma, d_beta)
}

// The training passes' loops, compiled for the best tier like the other kernels (every sum
// keeps its order on any tier), sample by sample so no plane pays an index division (MobileNets'
// 2×2 and 4×4 planes are a few floats each).

/// Each channel's `Σ x` over one sample's `[channels, plane]`.
#[inline(always)]
fn sample_sums_generic(plane: usize, x: &[f32], out: &mut [[f32; 1]]) {
    for (o, x_p) in out.iter_mut().zip(x.chunks_exact(plane.max(1))) {
        *o = plane_sums([x_p], |_, [v]| v);
    }
}

/// Each channel's `Σ (x − μ)²` over one sample.
#[inline(always)]
fn sample_squares_generic(plane: usize, x: &[f32], mean: &[f32], out: &mut [[f32; 1]]) {
    for ((o, x_p), &m) in out.iter_mut().zip(x.chunks_exact(plane.max(1))).zip(mean) {
        *o = plane_sums([x_p], |_, [v]| (v - m).powi(2));
    }
}

/// Each channel's `Σ dz` and `Σ dz·(x − μ)` over one sample, dz the gradient through `act`
/// at its input `a·x + b`.
#[inline(always)]
fn sample_grad_sums_generic(
    plane: usize,
    (dy, x): (&[f32], &[f32]),
    (mean, affine, act): (&[f32], &[Affine], Activation),
    out: &mut [[f32; 2]],
) {
    let planes = dy
        .chunks_exact(plane.max(1))
        .zip(x.chunks_exact(plane.max(1)));
    per_activation!(act, ACT => {
        for (((o, (d_p, x_p)), &m), &(a, b)) in out.iter_mut().zip(planes).zip(mean).zip(affine) {
            *o = plane_sums([d_p, x_p], |r, [d, v]| {
                let dz = backward_one(ACT, a * v + b, d);
                if r == 0 { dz } else { dz * (v - m) }
            });
        }
    })
}

/// `y = act(a·x + b)` over one sample's `[channels, plane]`, `(a, b)` per channel.
#[inline(always)]
fn affine_sample_generic(
    plane: usize,
    (affine, act): (&[Affine], Activation),
    x: &[f32],
    y: &mut [MaybeUninit<f32>],
) {
    // Every float of `y` is written (the caller's buffer is not initialised otherwise).
    assert!(y.len() == x.len() && x.len() == affine.len() * plane);
    per_activation!(act, ACT => {
        for ((y_p, x_p), &(a, b)) in y
            .chunks_exact_mut(plane)
            .zip(x.chunks_exact(plane))
            .zip(affine)
        {
            for (o, v) in y_p.iter_mut().zip(x_p) {
                o.write(forward_one(ACT, a * v + b));
            }
        }
    })
}

/// `dx = k·dz + c1·x + c0` over one sample, in place over `dy` (dz as in
/// [`sample_grad_sums_generic`]).
#[inline(always)]
fn backward_sample_generic(
    plane: usize,
    (coefficients, affine, act): (&[GradCoefficients], &[Affine], Activation),
    x: &[f32],
    d: &mut [f32],
) {
    assert!(d.len() == x.len() && x.len() == affine.len() * plane);
    per_activation!(act, ACT => {
        for (((d_p, x_p), &(k, c1, c0)), &(a, b)) in d
            .chunks_exact_mut(plane)
            .zip(x.chunks_exact(plane))
            .zip(coefficients)
            .zip(affine)
        {
            for (d, &v) in d_p.iter_mut().zip(x_p) {
                *d = dx_one(ACT, (k, c1, c0), (a, b), v, *d);
            }
        }
    })
}

best_isa! {
    fn sample_sums => sample_sums_generic(plane: usize, x: &[f32], out: &mut [[f32; 1]])
}

best_isa! {
    fn sample_squares => sample_squares_generic(plane: usize, x: &[f32], mean: &[f32], out: &mut [[f32; 1]])
}

best_isa! {
    fn sample_grad_sums => sample_grad_sums_generic(
        plane: usize,
        operands: (&[f32], &[f32]),
        params: (&[f32], &[Affine], Activation),
        out: &mut [[f32; 2]]
    )
}

best_isa! {
    fn affine_sample => affine_sample_generic(
        plane: usize,
        params: (&[Affine], Activation),
        x: &[f32],
        y: &mut [MaybeUninit<f32>]
    )
}

/// One value of the training backward pass, `dx = k·dz + c1·x + c0` with dz the activation's
/// gradient at `a·x + b` (the in-place and the into-a-buffer passes share it).
#[inline(always)]
fn dx_one(act: Activation, (k, c1, c0): GradCoefficients, (a, b): Affine, v: f32, d: f32) -> f32 {
    k * backward_one(act, a * v + b, d) + c1 * v + c0
}

/// [`backward_sample_generic`] from `dy` into `dx` (written whole): the same operations.
#[inline(always)]
fn backward_into_generic(
    plane: usize,
    (coefficients, affine, act): (&[GradCoefficients], &[Affine], Activation),
    x: &[f32],
    dy: &[f32],
    dx: &mut [MaybeUninit<f32>],
) {
    assert!(dy.len() == x.len() && dx.len() == x.len() && x.len() == affine.len() * plane);
    per_activation!(act, ACT => {
        for ((((dx_p, dy_p), x_p), &(k, c1, c0)), &(a, b)) in dx
            .chunks_exact_mut(plane)
            .zip(dy.chunks_exact(plane))
            .zip(x.chunks_exact(plane))
            .zip(coefficients)
            .zip(affine)
        {
            for ((dx, &d), &v) in dx_p.iter_mut().zip(dy_p).zip(x_p) {
                dx.write(dx_one(ACT, (k, c1, c0), (a, b), v, d));
            }
        }
    })
}

best_isa! {
    fn backward_into_sample => backward_into_generic(
        plane: usize,
        params: (&[GradCoefficients], &[Affine], Activation),
        x: &[f32],
        dy: &[f32],
        dx: &mut [MaybeUninit<f32>]
    )
}

best_isa! {
    fn backward_sample => backward_sample_generic(
        plane: usize,
        params: (&[GradCoefficients], &[Affine], Activation),
        x: &[f32],
        d: &mut [f32]
    )
}

/// `((x − mean) / std) · γ + β` over one sample's `[channels, plane]`, in place, each value
/// computed with exactly the operations of Burn's `batch_norm` (so the results are bitwise
/// Burn's).
/// The activation `act` is applied to each value as it is written.
#[inline(always)]
fn inference_generic(plane: usize, x: &mut [f32], (params, act): (Params<'_>, Activation)) {
    let (gamma, beta, mean, std) = params;
    per_activation!(act, ACT => {
        for (c, x) in x.chunks_mut(plane).enumerate() {
            let (m, s, g, b) = (mean[c], std[c], gamma[c], beta[c]);
            for x in x.iter_mut() {
                *x = forward_one(ACT, normalized(*x, m, s, g, b));
            }
        }
    })
}

/// γ, β, the means and the standard deviations of the inference pass, per channel.
type Params<'a> = (&'a [f32], &'a [f32], &'a [f32], &'a [f32]);

/// [`inference_generic`] from `x` into `y` (written whole).
#[inline(always)]
fn inference_into_generic(
    plane: usize,
    x: &[f32],
    y: &mut [MaybeUninit<f32>],
    (params, act): (Params<'_>, Activation),
) {
    assert_eq!(x.len(), y.len(), "batch norm: output length");
    let (gamma, beta, mean, std) = params;
    per_activation!(act, ACT => {
        for (c, (y, x)) in y.chunks_mut(plane).zip(x.chunks(plane)).enumerate() {
            let (m, s, g, b) = (mean[c], std[c], gamma[c], beta[c]);
            for (y, &x) in y.iter_mut().zip(x) {
                y.write(forward_one(ACT, normalized(x, m, s, g, b)));
            }
        }
    })
}

/// One value of the inference pass, as Burn's `batch_norm` composes it.
#[inline(always)]
fn normalized(x: f32, m: f32, s: f32, g: f32, b: f32) -> f32 {
    ((x - m) / s) * g + b
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
        params: (Params<'_>, Activation)
    )
}

best_isa! {
    fn inference_into_sample => inference_into_generic(
        plane: usize,
        x: &[f32],
        y: &mut [MaybeUninit<f32>],
        params: (Params<'_>, Activation)
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

/// Batch normalisation with given statistics (inference, frozen layers), then `act`,
/// overwriting `x`: `std` is `sqrt(var + ε)` as the caller computed it. One pass, samples in
/// parallel, where Burn's composition makes four passes on one thread.
pub fn batch_norm_inference(g: &NormGeometry, x: &mut [f32], params: Params<'_>, act: Activation) {
    let sample = (g.channels * g.plane).max(1);
    x.par_chunks_mut(sample)
        .for_each(|x| inference_sample(g.plane, x, (params, act)));
}

/// [`batch_norm_inference`] of `x` into a new buffer (one pass: for an input something else
/// still holds, which in place would need a copy first).
pub fn batch_norm_inference_into(
    g: &NormGeometry,
    x: &[f32],
    params: Params<'_>,
    act: Activation,
) -> Vec<f32> {
    let sample = (g.channels * g.plane).max(1);
    // SAFETY: the chunks cover the buffer, and each sample's is written whole.
    unsafe {
        super::written_whole(x.len(), |y| {
            y.par_chunks_mut(sample)
                .zip(x.par_chunks(sample))
                .for_each(|(y, x)| inference_into_sample(g.plane, x, y, (params, act)))
        })
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::sum;
    use crate::kernels::cpu::tests::{at_every_isa, values};

    /// A channel's `Σ x` and `Σ (x − m)²` one plane at a time: the order the kernels must keep.
    fn stats_plane_by_plane(g: &NormGeometry, x: &[f32], c: usize, m: f32) -> (f64, f64) {
        let squares = |p: &[f32]| {
            let mut lanes = [0.0f32; 8];
            let chunks = p.chunks_exact(8);
            let rest: f32 = chunks.remainder().iter().map(|v| (v - m).powi(2)).sum();
            for chunk in chunks {
                for i in 0..8 {
                    lanes[i] += (chunk[i] - m).powi(2);
                }
            }
            (lanes.iter().sum::<f32>() + rest) as f64
        };
        let sum = g.planes(x, c).map(|p| sum(p) as f64).sum::<f64>();
        (sum, g.planes(x, c).map(squares).sum::<f64>())
    }

    /// `Σ dy` and `Σ dy·(x − μ)` one plane at a time.
    fn grad_sums_plane_by_plane(
        g: &NormGeometry,
        dy: &[f32],
        x: &[f32],
        c: usize,
        mean: f32,
    ) -> (f64, f64) {
        let dot = |(a, b): (&[f32], &[f32])| {
            let mut lanes = [0.0f32; 8];
            let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
            let rest: f32 = ca
                .remainder()
                .iter()
                .zip(cb.remainder())
                .map(|(d, v)| d * (v - mean))
                .sum();
            for (d, v) in ca.zip(cb) {
                for i in 0..8 {
                    lanes[i] += d[i] * (v[i] - mean);
                }
            }
            (lanes.iter().sum::<f32>() + rest) as f64
        };
        let sum_dy = g.planes(dy, c).map(|p| sum(p) as f64).sum();
        (sum_dy, g.planes(dy, c).zip(g.planes(x, c)).map(dot).sum())
    }

    #[test]
    fn sample_major_channel_sums_keep_the_plane_by_plane_bits() {
        at_every_isa(|isa| {
            for (batch, plane) in [(1, 1), (3, 4), (4, 9), (5, 8), (9, 17), (50, 64), (7, 100)] {
                let g = NormGeometry {
                    batch,
                    channels: 3,
                    plane,
                };
                let len = batch * 3 * plane;
                let (mut x, mut dy) = (values(len, 1), values(len, 2));
                // Channel 2: a constant input and negative gradients, so every product is −0.
                for n in 0..batch {
                    let at = (n * 3 + 2) * plane;
                    x[at..at + plane].fill(0.5);
                    dy[at..at + plane]
                        .iter_mut()
                        .for_each(|d| *d = -d.abs() - 0.25);
                }
                let totals = |sums: &[[f32; 1]]| -> Vec<f64> {
                    (0..3).map(|c| g.channel_total(sums, c, 0)).collect()
                };
                let sums =
                    totals(&g.per_sample_sums(|n, o| sample_sums(plane, g.sample(&x, n), o)));
                let mean: Vec<f32> = sums.iter().map(|s| (s / g.count()) as f32).collect();
                let squares = totals(
                    &g.per_sample_sums(|n, o| sample_squares(plane, g.sample(&x, n), &mean, o)),
                );
                let affine = [(1.0, 0.0); 3];
                let grads = g.per_sample_sums(|n, o| {
                    let operands = (g.sample(&dy, n), g.sample(&x, n));
                    sample_grad_sums(plane, operands, (&mean, &affine, Activation::Identity), o)
                });
                let ones = [1.0; 3];
                let (_, bn_mean, bn_var) =
                    batch_norm_train_forward(&g, &x, (&ones, &ones), 1e-5, Activation::Identity);
                for c in 0..3 {
                    let what = format!("{isa:?} batch {batch} plane {plane} channel {c}");
                    let (s, sq) = stats_plane_by_plane(&g, &x, c, mean[c]);
                    let got = [sums[c], squares[c]].map(f64::to_bits);
                    assert_eq!(got, [s, sq].map(f64::to_bits), "{what}");
                    let want = [(s / g.count()) as f32, (sq / g.count()) as f32];
                    let got = [bn_mean[c], bn_var[c]].map(f32::to_bits);
                    assert_eq!(
                        got,
                        want.map(f32::to_bits),
                        "{what}: the forward's statistics"
                    );
                    let got = [0, 1].map(|r| g.channel_total(&grads, c, r).to_bits());
                    let totals = g.channel_totals(&grads).map(|t| t[c].to_bits());
                    assert_eq!(totals, got, "{what}: the channel totals");
                    let want = grad_sums_plane_by_plane(&g, &dy, &x, c, mean[c]);
                    assert_eq!(got, [want.0, want.1].map(f64::to_bits), "{what}");
                }
            }
        });
    }
}
