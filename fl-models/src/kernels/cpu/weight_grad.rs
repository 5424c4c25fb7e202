//! Convolution weight gradients: the dispatch to the kernel that runs each layer's, the sums
//! over fixed chunks of samples that make the result independent of the thread count, and the
//! im2col + gemm path the faster kernels are tested against.

use rayon::prelude::*;

use super::{
    Aligned, Conv2dGeometry, FILL_CHUNK, WEIGHT_GRAD_CHUNK, WeightGradPath, direct_wgrad, im2col,
    matmul, narrow, par_zeroed, sample_wgrad, single_pixel, strided, sum,
};

/// Weight and bias gradients: `dW = Σₙ dy[n] · im2col(x[n])ᵀ`, `db = Σₙ Σ_pixels dy[n]`.
pub fn conv2d_weight_grad(g: &Conv2dGeometry, x: &[f32], dy: &[f32]) -> (Vec<f32>, Vec<f32>) {
    conv2d_weight_grad_of(g, x, dy, true)
}

/// [`conv2d_weight_grad`] for a layer with a bias (`bias`) or without one: then the bias
/// gradient, a pass over `dy` that every path makes alongside the weight gradient, is skipped
/// and comes back empty. The weight gradient is the same either way.
pub fn conv2d_weight_grad_of(
    g: &Conv2dGeometry,
    x: &[f32],
    dy: &[f32],
    bias: bool,
) -> (Vec<f32>, Vec<f32>) {
    if g.batch == 0 || g.output_len() == 0 || g.input_len() == 0 {
        return (
            vec![0.0; g.weight_len()],
            vec![0.0; if bias { g.c_out } else { 0 }],
        );
    }
    let args = (g, x, dy, bias);
    match WeightGradPath::of(g) {
        WeightGradPath::DirectWithoutZeros => direct_wgrad::weight_grad(args),
        WeightGradPath::Direct => crate::kernels::direct::conv2d_weight_grad(args),
        WeightGradPath::SmallMap => narrow::weight_grad(args),
        WeightGradPath::WithoutColumns => sample_wgrad::weight_grad(args),
        WeightGradPath::SinglePixel => single_pixel::weight_grad(args),
        WeightGradPath::Strided => strided::weight_grad(args),
        WeightGradPath::Im2col => im2col_conv2d_weight_grad(args),
    }
}

/// A weight-gradient call's operands: the geometry, the inputs, the output gradients and
/// whether the layer has a bias (whose gradient is summed only then).
pub(in crate::kernels) type WeightGradArgs<'a> = (&'a Conv2dGeometry, &'a [f32], &'a [f32], bool);

/// The bias gradient of some consecutive samples' output gradients `[samples, c_out, pixels]`:
/// per sample, each channel's plane summed by [`sum`] and added on in sample order (the order
/// every convolution path's chunks use); empty for a layer without a bias (`!bias`).
pub(in crate::kernels) fn chunk_bias_grad(
    bias: bool,
    dy: &[f32],
    c_out: usize,
    pixels: usize,
) -> Vec<f32> {
    if !bias {
        return Vec::new();
    }
    let mut db = vec![0.0f32; c_out];
    for dy_n in dy.chunks(c_out * pixels) {
        for (b, plane) in db.iter_mut().zip(dy_n.chunks(pixels)) {
            *b += sum(plane);
        }
    }
    db
}

/// The bias gradient alone of output gradients `[batch, c_out, pixels]`, summed in
/// [`sum_over_chunks`]'s chunks (the paths that sum their weight gradients otherwise keep the
/// im2col path's order for it this way); empty, with no pass at all, for a layer without a bias.
pub(in crate::kernels) fn chunked_bias_grad(
    bias: bool,
    dy: &[f32],
    batch: usize,
    c_out: usize,
    pixels: usize,
) -> Vec<f32> {
    if !bias {
        return Vec::new();
    }
    let sample = c_out * pixels;
    let (_, db) = sum_over_chunks(batch, |s| {
        let dy_chunk = &dy[s.start * sample..s.end * sample];
        (Vec::new(), chunk_bias_grad(bias, dy_chunk, c_out, pixels))
    });
    db
}

/// Weight and bias gradients summed over the batch deterministically: `chunk` computes the
/// partial sums of fixed runs of [`WEIGHT_GRAD_CHUNK`] samples (in parallel), which are then
/// added in order, so the result does not depend on the thread count.
pub(in crate::kernels) fn sum_over_chunks<F>(batch: usize, chunk: F) -> (Vec<f32>, Vec<f32>)
where
    F: Fn(std::ops::Range<usize>) -> (Vec<f32>, Vec<f32>) + Sync + Send,
{
    sum_over_chunks_with(batch, || (), |_, samples| chunk(samples))
}

/// [`sum_over_chunks`] with a scratch value that `init` makes per task of the pool and the
/// chunks a task runs share: buffers whose zeros the chunks leave in place (padded copies
/// written only where the values go) are zeroed once per task instead of once per chunk.
pub(in crate::kernels) fn sum_over_chunks_with<T, I, F>(
    batch: usize,
    init: I,
    chunk: F,
) -> (Vec<f32>, Vec<f32>)
where
    I: Fn() -> T + Sync + Send,
    F: Fn(&mut T, std::ops::Range<usize>) -> (Vec<f32>, Vec<f32>) + Sync + Send,
{
    let partials: Vec<(Vec<f32>, Vec<f32>)> = (0..batch.div_ceil(WEIGHT_GRAD_CHUNK))
        .into_par_iter()
        .map_init(init, |scratch, c| {
            chunk(
                scratch,
                c * WEIGHT_GRAD_CHUNK..((c + 1) * WEIGHT_GRAD_CHUNK).min(batch),
            )
        })
        .collect();
    let mut parts = partials.into_iter();
    let (mut dw, mut db) = parts.next().expect("at least one chunk");
    let rest: Vec<(Vec<f32>, Vec<f32>)> = parts.collect();
    // Each element still adds the partials in chunk order; only the element ranges are split
    // across threads (VGG-16's 2.4M-float weight gradients made this serial pass 4% of a step).
    dw.par_chunks_mut(FILL_CHUNK)
        .enumerate()
        .for_each(|(i, out)| {
            for (pw, _) in &rest {
                let part = &pw[i * FILL_CHUNK..][..out.len()];
                out.iter_mut().zip(part).for_each(|(a, b)| *a += b);
            }
        });
    for (_, pb) in &rest {
        db.iter_mut().zip(pb).for_each(|(a, b)| *a += b);
    }
    (dw, db)
}

/// A pool task's scratch for the weight gradients that copy each chunk into their own layout
/// ([`sum_over_chunks_with`]'s `init`): the chunk's zero-padded inputs and its output gradients.
/// Every chunk writes only values into them, at the same places (or every float), so the zeros
/// around the values are written once per task, not once per chunk; a shorter last chunk uses
/// the front of each buffer.
pub(in crate::kernels) struct ChunkBuffers {
    /// Zero-padded inputs, `input_len` floats per sample.
    pub(in crate::kernels) inputs: Aligned,
    /// Output gradients in the kernel's layout, `grads_len` floats per sample.
    pub(in crate::kernels) grads: Aligned,
}

impl ChunkBuffers {
    /// Zeroed buffers for chunks of up to [`WEIGHT_GRAD_CHUNK`] samples of a batch of `batch`.
    pub(in crate::kernels) fn for_chunks(batch: usize, input_len: usize, grads_len: usize) -> Self {
        let samples = WEIGHT_GRAD_CHUNK.min(batch);
        Self {
            inputs: Aligned::zeroed(samples * input_len),
            grads: Aligned::zeroed(samples * grads_len),
        }
    }
}

/// [`conv2d_weight_grad`] by im2col + gemm.
pub(super) fn im2col_conv2d_weight_grad(args: WeightGradArgs) -> (Vec<f32>, Vec<f32>) {
    let g = args.0;
    let (dw_t, db) = sum_over_chunks(g.batch, |samples| weight_grad_chunk(args, samples));
    if !g.transposed_weight_grad() {
        return (dw_t, db);
    }
    // Back from [rows, c_out] to the weight's [c_out, rows], one output channel per task.
    let rows = g.col_rows();
    let mut dw = par_zeroed(g.weight_len());
    dw.par_chunks_mut(rows).enumerate().for_each(|(o, dw_o)| {
        for (r, v) in dw_o.iter_mut().enumerate() {
            *v = dw_t[r * g.c_out + o];
        }
    });
    (dw, db)
}

/// The weight and bias gradients of some consecutive samples.
#[inline(never)]
pub(super) fn weight_grad_chunk(
    (g, x, dy, bias): WeightGradArgs,
    samples: std::ops::Range<usize>,
) -> (Vec<f32>, Vec<f32>) {
    let (rows, out_plane) = (g.col_rows(), g.out_plane());
    let mut dw_t = vec![0.0f32; g.weight_len()];
    let mut db = vec![0.0f32; if bias { g.c_out } else { 0 }];
    let mut col = g.col_buffer();
    let first = samples.start;
    // The transposed product takes its output gradient pixel-major, copied by blocks in
    // registers: gemm packed it one float at a time, in strides of a channel plane, which cost
    // more than its multiply-adds on MobileNetV2's pointwise layers. gemm's main kernels sum
    // the same way whatever the operands' strides (tested); its dot-product kernel for
    // products of at most 16 × 16 and its matrix-vector ones (one column row) are chosen by
    // the strides, so those layers keep them.
    let pixel_major = g.transposed_weight_grad() && g.c_out * rows > 16 * 16 && rows > 1;
    let mut dy_t = vec![0.0f32; if pixel_major { g.output_len() } else { 0 }];
    for n in samples {
        let x_n = &x[n * g.input_len()..(n + 1) * g.input_len()];
        let dy_n = &dy[n * g.output_len()..(n + 1) * g.output_len()];
        let cols: &[f32] = if g.is_pointwise() {
            x_n
        } else {
            im2col(g, x_n, &mut col);
            &col
        };
        let lhs = if pixel_major {
            super::columns::transpose([g.c_out, out_plane], dy_n, &mut dy_t);
            (&dy_t[..], 1, g.c_out)
        } else {
            (dy_n, out_plane, 1)
        };
        // colsᵀ is cols read with swapped strides.
        let dst = if g.transposed_weight_grad() {
            (&mut dw_t[..], 1, g.c_out)
        } else {
            (&mut dw_t[..], rows, 1)
        };
        matmul(
            [g.c_out, rows, out_plane],
            dst,
            n > first,
            lhs,
            (cols, 1, out_plane),
        );
        for (b, plane) in db.iter_mut().zip(dy_n.chunks(out_plane)) {
            *b += sum(plane);
        }
    }
    (dw_t, db)
}
