//! Weight gradients of convolutions with a single output pixel (VGG-16's last block on 1×28×28
//! inputs, MobileNetV3's squeeze-and-excitation layers at 1×1), bit for bit the im2col path's.
//!
//! With one output pixel the im2col path's per-sample product `dy_n · cols_nᵀ` has depth 1,
//! which gemm runs as its `gevv` loop: the chunk's first sample stores `dy · x`, each later one
//! computes `dy · x + dW` (a multiply and an add, two roundings), each a pass over the whole
//! gradient (2.4 M floats on VGG-16's 512-channel layers) for one multiply-add per element; the
//! chunks' sums are then added in chunk order. This kernel runs the same operations per output
//! channel, vectorised over the input channels of one kernel tap, and writes the gradient once.
//! Taps that read the padding see x = +0 for every sample, so all of a channel's padding rows
//! hold the one value that chain gives with x = +0 (±0, NaN for a non-finite gradient),
//! computed once per channel. Results are the im2col path's bit for bit (a test compares them).

use rayon::prelude::*;

use super::{Conv2dGeometry, WEIGHT_GRAD_CHUNK, WeightGradArgs, chunked_bias_grad};

/// Output channels per parallel task.
const CHANNELS_PER_TASK: usize = 16;

/// Whether [`weight_grad`] computes `g`'s weight gradient: one output pixel and a product of more
/// than 16 × 16 elements (gemm's horizontal kernels take smaller ones and sum another way).
pub(super) fn applies(g: &Conv2dGeometry) -> bool {
    g.batch > 0 && g.out_plane() == 1 && g.c_in > 0 && g.c_out * g.col_rows() > 16 * 16
}

/// Weight and bias gradients, the same contract and bits as the im2col path's.
pub(super) fn weight_grad((g, x, dy, bias): WeightGradArgs) -> (Vec<f32>, Vec<f32>) {
    let (batch, c_in, c_out) = (g.batch, g.c_in, g.c_out);
    let ([kh, kw], [h, w]) = (g.kernel, g.input);
    let (taps, rows) = (kh * kw, g.col_rows());
    // The output pixel reads input (ky − pad, kx − pad) through tap (ky, kx), where that is
    // inside the image.
    let reads = |k: usize, pad: usize, size: usize| k.checked_sub(pad).filter(|&i| i < size);
    let inside: Vec<(usize, usize)> = (0..taps)
        .filter_map(|t| {
            let iy = reads(t / kw, g.pad_begin[0], h)?;
            let ix = reads(t % kw, g.pad_begin[1], w)?;
            Some((t, iy * w + ix))
        })
        .collect();
    // Each inside tap's inputs, `[batch][c_in]`.
    let mut xs = vec![0.0f32; inside.len() * batch * c_in];
    for (dst, &(_, offset)) in xs.chunks_exact_mut(batch * c_in).zip(&inside) {
        for (d_n, x_n) in dst
            .chunks_exact_mut(c_in)
            .zip(x.chunks_exact(g.input_len()))
        {
            for (d, x_c) in d_n.iter_mut().zip(x_n.chunks_exact(h * w)) {
                *d = x_c[offset];
            }
        }
    }
    // The output gradients channel-major, `[c_out][batch]`.
    let mut dys = vec![0.0f32; c_out * batch];
    for (n, dy_n) in dy.chunks_exact(c_out).take(batch).enumerate() {
        for (co, &v) in dy_n.iter().enumerate() {
            dys[co * batch + n] = v;
        }
    }
    let zeros = vec![0.0f32; batch];
    // The bias gradient in the im2col path's chunks.
    let db = chunked_bias_grad(bias, dy, batch, c_out, 1);
    let mut dw = vec![0.0f32; c_out * rows];
    dw.par_chunks_mut(CHANNELS_PER_TASK * rows)
        .zip(dys.par_chunks(CHANNELS_PER_TASK * batch))
        .for_each(|(out, dys)| {
            let (mut total, mut part) = (vec![0.0f32; c_in], vec![0.0f32; c_in]);
            for (out_co, d) in out.chunks_exact_mut(rows).zip(dys.chunks_exact(batch)) {
                let mut pad = ([0.0f32], [0.0f32]);
                chain(d, &zeros, &mut pad.0, &mut pad.1);
                out_co.fill(pad.0[0]);
                for (v, &(t, _)) in inside.iter().enumerate() {
                    let x_t = &xs[v * batch * c_in..(v + 1) * batch * c_in];
                    chain(d, x_t, &mut total, &mut part);
                    for (o, &s) in out_co.iter_mut().skip(t).step_by(taps).zip(&total) {
                        *o = s;
                    }
                }
            }
        });
    (dw, db)
}

best_isa! {
    fn chain => chain_generic(d: &[f32], x: &[f32], total: &mut [f32], part: &mut [f32])
}

/// `total[i] = Σ_chunks (d[n₀]·x[n₀][i], then d[n]·x[n][i] + that for the chunk's later
/// samples)`, the chunks' sums added left to right: gemm's `gevv` order (see the module docs).
/// `x` holds `d.len()` rows of `total.len()` values; `part` is scratch of the same length.
#[inline(always)]
fn chain_generic(d: &[f32], x: &[f32], total: &mut [f32], part: &mut [f32]) {
    let len = total.len();
    for (c, (d_c, x_c)) in d
        .chunks(WEIGHT_GRAD_CHUNK)
        .zip(x.chunks(WEIGHT_GRAD_CHUNK * len))
        .enumerate()
    {
        let mut rows = d_c.iter().zip(x_c.chunks_exact(len));
        let (&d0, x0) = rows.next().expect("a chunk has a sample");
        part.iter_mut().zip(x0).for_each(|(p, &v)| *p = d0 * v);
        for (&d_n, x_n) in rows {
            part.iter_mut().zip(x_n).for_each(|(p, &v)| *p += d_n * v);
        }
        if c == 0 {
            total.copy_from_slice(part);
        } else {
            total.iter_mut().zip(&*part).for_each(|(t, &p)| *t += p);
        }
    }
}
