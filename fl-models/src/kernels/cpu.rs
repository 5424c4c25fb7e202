//! The CPU kernels themselves, on plain `f32` slices in NCHW layout.
//!
//! Stride-1 convolutions go to the direct AVX-512 kernels of `direct.rs` where the CPU has
//! AVX-512F. Every other convolution is im2col + one gemm per sample, written straight into (or read straight from) the
//! NCHW tensor, so nothing is converted to channels-last and no batch-sized column matrix is ever
//! built. Samples run in parallel on the rayon pool; the weight gradient sums fixed chunks of
//! samples and adds the chunk sums in order, so results do not depend on the thread count.

use rayon::prelude::*;

/// Samples per partial sum of the weight gradient (fixed, so the summation order, and hence the
/// result, is the same with any number of threads).
const WEIGHT_GRAD_CHUNK: usize = 8;

/// Shapes and options of one 2-D convolution (groups 1, dilation 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv2dGeometry {
    /// Batch size.
    pub batch: usize,
    /// Input channels.
    pub c_in: usize,
    /// Input height and width.
    pub input: [usize; 2],
    /// Output channels.
    pub c_out: usize,
    /// Kernel height and width.
    pub kernel: [usize; 2],
    /// Stride along height and width.
    pub stride: [usize; 2],
    /// Zero padding before the first row and column (the padding after only shortens or lengthens
    /// the output, which `output` already says).
    pub pad_begin: [usize; 2],
    /// Output height and width.
    pub output: [usize; 2],
}

impl Conv2dGeometry {
    fn in_plane(&self) -> usize {
        self.input[0] * self.input[1]
    }
    pub(super) fn out_plane(&self) -> usize {
        self.output[0] * self.output[1]
    }
    /// Rows of the column matrix: one per (input channel, kernel row, kernel column).
    fn col_rows(&self) -> usize {
        self.c_in * self.kernel[0] * self.kernel[1]
    }
    /// A 1×1 convolution with stride 1 and no padding needs no column matrix at all.
    fn is_pointwise(&self) -> bool {
        self.kernel == [1, 1] && self.stride == [1, 1] && self.pad_begin == [0, 0]
    }
    /// Input elements per sample.
    pub fn input_len(&self) -> usize {
        self.c_in * self.in_plane()
    }
    /// Output elements per sample.
    pub fn output_len(&self) -> usize {
        self.c_out * self.out_plane()
    }
    /// Weight elements.
    pub fn weight_len(&self) -> usize {
        self.c_out * self.col_rows()
    }

    /// The output columns `[lo, hi)` whose input column `ox * stride + kx - pad` is inside the
    /// image, for kernel column `kx`.
    fn valid_columns(&self, kx: usize) -> (usize, usize) {
        let (w, sw, pw, ow) = (
            self.input[1],
            self.stride[1],
            self.pad_begin[1],
            self.output[1],
        );
        let lo = (pw.saturating_sub(kx)).div_ceil(sw).min(ow);
        // Largest ox with ox * sw + kx - pw <= w - 1.
        let hi = if w + pw > kx {
            ((w + pw - kx - 1) / sw + 1).min(ow)
        } else {
            0
        };
        (lo, hi.max(lo))
    }
}

/// `dst.copy_from_slice(src)` for the short rows of small feature maps: whole 8-float blocks
/// compile to single vector moves instead of a `memcpy` call per row.
#[inline(always)]
fn copy_short(dst: &mut [f32], src: &[f32]) {
    let mut d = dst.chunks_exact_mut(8);
    let mut s = src.chunks_exact(8);
    for (d, s) in (&mut d).zip(&mut s) {
        let block: [f32; 8] = s.try_into().expect("8-float block");
        d.copy_from_slice(&block);
    }
    for (d, s) in d.into_remainder().iter_mut().zip(s.remainder()) {
        *d = *s;
    }
}

/// `Σ values`, in eight interleaved partial sums (so it vectorises; the order is fixed).
#[inline]
pub(super) fn sum(values: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let chunks = values.chunks_exact(8);
    let rest: f32 = chunks.remainder().iter().sum();
    for chunk in chunks {
        for (l, v) in lanes.iter_mut().zip(chunk) {
            *l += v;
        }
    }
    lanes.iter().sum::<f32>() + rest
}

/// Calls `$generic` compiled for AVX2 when the CPU has it (the copy loops of im2col and col2im
/// move whole 256-bit registers then), and as compiled for the baseline target otherwise.
macro_rules! avx2_dispatch {
    ($(#[$doc:meta])* fn $name:ident => $generic:ident($($arg:ident: $ty:ty),*)) => {
        $(#[$doc])*
        fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2")]
                fn avx2($($arg: $ty),*) {
                    $generic($($arg),*)
                }
                if std::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU supports AVX2, checked just above.
                    return unsafe { avx2($($arg),*) };
                }
            }
            $generic($($arg),*)
        }
    };
}

avx2_dispatch! {
    /// Copies one sample's receptive fields into `col` (`col_rows × out_plane`, row-major).
    fn im2col => im2col_generic(g: &Conv2dGeometry, x: &[f32], col: &mut [f32])
}

avx2_dispatch! {
    /// Adds the column matrix `col` back onto one sample's input gradient (the adjoint of
    /// [`im2col`]).
    fn col2im_add => col2im_add_generic(g: &Conv2dGeometry, col: &[f32], dx: &mut [f32])
}

#[inline(always)]
fn im2col_generic(g: &Conv2dGeometry, x: &[f32], col: &mut [f32]) {
    let [h, w] = g.input;
    let [kh, kw] = g.kernel;
    let [sh, sw] = g.stride;
    let [ph, pw] = g.pad_begin;
    let [oh, ow] = g.output;
    let out_plane = g.out_plane();
    for c in 0..g.c_in {
        let plane = &x[c * h * w..(c + 1) * h * w];
        for ky in 0..kh {
            for kx in 0..kw {
                let row = &mut col[((c * kh + ky) * kw + kx) * out_plane..][..out_plane];
                let (lo, hi) = g.valid_columns(kx);
                for oy in 0..oh {
                    let dst = &mut row[oy * ow..(oy + 1) * ow];
                    let iy = (oy * sh + ky).wrapping_sub(ph);
                    if iy >= h {
                        dst.fill(0.0);
                        continue;
                    }
                    let src = &plane[iy * w..(iy + 1) * w];
                    dst[..lo].fill(0.0);
                    dst[hi..].fill(0.0);
                    if sw == 1 {
                        let start = lo + kx - pw;
                        copy_short(&mut dst[lo..hi], &src[start..start + (hi - lo)]);
                    } else {
                        for (ox, d) in dst[lo..hi].iter_mut().enumerate() {
                            *d = src[(lo + ox) * sw + kx - pw];
                        }
                    }
                }
            }
        }
    }
}

#[inline(always)]
fn col2im_add_generic(g: &Conv2dGeometry, col: &[f32], dx: &mut [f32]) {
    let [h, w] = g.input;
    let [kh, kw] = g.kernel;
    let [sh, sw] = g.stride;
    let [ph, pw] = g.pad_begin;
    let [oh, ow] = g.output;
    let out_plane = g.out_plane();
    for c in 0..g.c_in {
        let plane = &mut dx[c * h * w..(c + 1) * h * w];
        for ky in 0..kh {
            for kx in 0..kw {
                let row = &col[((c * kh + ky) * kw + kx) * out_plane..][..out_plane];
                let (lo, hi) = g.valid_columns(kx);
                for oy in 0..oh {
                    let iy = (oy * sh + ky).wrapping_sub(ph);
                    if iy >= h {
                        continue;
                    }
                    let src = &row[oy * ow..(oy + 1) * ow];
                    let dst = &mut plane[iy * w..(iy + 1) * w];
                    if sw == 1 {
                        let start = lo + kx - pw;
                        for (d, s) in dst[start..start + (hi - lo)].iter_mut().zip(&src[lo..hi]) {
                            *d += s;
                        }
                    } else {
                        for ox in lo..hi {
                            dst[ox * sw + kx - pw] += src[ox];
                        }
                    }
                }
            }
        }
    }
}

/// `dst (m×n) = [dst +] lhs (m×k) · rhs (k×n)`, each matrix given as (slice, row stride, column
/// stride), so transposes are free. Single-threaded: callers parallelise over samples.
///
/// gemm wants the output's contiguous dimension to be m and the left operand contiguous along m
/// too, and otherwise packs (copies) it; callers orient their products so that the large
/// operand (the column matrix) never needs packing.
fn matmul(
    [m, n, k]: [usize; 3],
    (dst, dst_rs, dst_cs): (&mut [f32], usize, usize),
    accumulate: bool,
    (lhs, lhs_rs, lhs_cs): (&[f32], usize, usize),
    (rhs, rhs_rs, rhs_cs): (&[f32], usize, usize),
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    dst[i * dst_rs + j * dst_cs] = 0.0;
                }
            }
        }
        return;
    }
    // The largest element each operand's strides reach must lie inside its slice: this is the
    // whole safety argument for the raw-pointer call below.
    assert!(
        (m - 1) * dst_rs + (n - 1) * dst_cs < dst.len(),
        "matmul: dst too short"
    );
    assert!(
        (m - 1) * lhs_rs + (k - 1) * lhs_cs < lhs.len(),
        "matmul: lhs too short"
    );
    assert!(
        (k - 1) * rhs_rs + (n - 1) * rhs_cs < rhs.len(),
        "matmul: rhs too short"
    );
    // SAFETY: the asserts above bound every index gemm computes from these strides; `dst` is an
    // exclusive borrow, and the operands are shared borrows that do not alias it.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            dst_cs as isize,
            dst_rs as isize,
            accumulate,
            lhs.as_ptr(),
            lhs_cs as isize,
            lhs_rs as isize,
            rhs.as_ptr(),
            rhs_cs as isize,
            rhs_rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

impl Conv2dGeometry {
    /// Whether to accumulate the weight gradient transposed (`[rows, c_out]`, column-major).
    /// gemm wants its output contiguous along m and its left operand too: in the weight
    /// gradient `dy · colsᵀ` neither is, so it packs one of them. Transposed, it packs the small
    /// `dy` rather than the column matrix, but then m = c_out, and fewer output channels than a
    /// 16-float register leave the multiply-add units idle; small layers keep the plain order.
    fn transposed_weight_grad(&self) -> bool {
        self.c_out >= 16
    }

    /// A scratch column matrix for one sample (empty for pointwise convolutions, which read the
    /// input directly).
    fn col_buffer(&self) -> Vec<f32> {
        let len = if self.is_pointwise() {
            0
        } else {
            self.col_rows() * self.out_plane()
        };
        vec![0.0; len]
    }
}

/// Forward convolution: `y[n] = W · im2col(x[n]) + b`. `x` is `[batch, c_in, h, w]`, `weight`
/// `[c_out, c_in, kh, kw]`, the result `[batch, c_out, oh, ow]`.
pub fn conv2d_forward(
    g: &Conv2dGeometry,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
) -> Vec<f32> {
    if g.batch > 0 && g.input_len() > 0 && super::direct::applies(g) {
        return super::direct::conv2d_forward(g, x, weight, bias);
    }
    im2col_conv2d_forward(g, x, weight, bias)
}

/// [`conv2d_forward`] by im2col + gemm.
fn im2col_conv2d_forward(
    g: &Conv2dGeometry,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
) -> Vec<f32> {
    let mut y = vec![0.0f32; g.batch * g.output_len()];
    if g.output_len() == 0 || g.input_len() == 0 {
        return y;
    }
    y.par_chunks_mut(g.output_len())
        .zip(x.par_chunks(g.input_len()))
        .for_each_init(
            || g.col_buffer(),
            |col, (y_n, x_n)| forward_sample(g, x_n, weight, bias, col, y_n),
        );
    y
}

#[inline(never)]
fn forward_sample(
    g: &Conv2dGeometry,
    x_n: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    col: &mut [f32],
    y_n: &mut [f32],
) {
    let (rows, out_plane) = (g.col_rows(), g.out_plane());
    if let Some(bias) = bias {
        for (plane, &b) in y_n.chunks_mut(out_plane).zip(bias) {
            plane.fill(b);
        }
    }
    let cols: &[f32] = if g.is_pointwise() {
        x_n
    } else {
        im2col(g, x_n, col);
        col
    };
    matmul(
        [g.c_out, out_plane, rows],
        (y_n, out_plane, 1),
        bias.is_some(),
        (weight, rows, 1),
        (cols, out_plane, 1),
    );
}

/// Input gradient: `dx[n] = col2im(Wᵀ · dy[n])`.
pub fn conv2d_input_grad(g: &Conv2dGeometry, weight: &[f32], dy: &[f32]) -> Vec<f32> {
    if g.batch > 0 && g.input_len() > 0 && super::direct::applies(g) {
        return super::direct::conv2d_input_grad(g, weight, dy);
    }
    im2col_conv2d_input_grad(g, weight, dy)
}

/// [`conv2d_input_grad`] by gemm + col2im.
fn im2col_conv2d_input_grad(g: &Conv2dGeometry, weight: &[f32], dy: &[f32]) -> Vec<f32> {
    let mut dx = vec![0.0f32; g.batch * g.input_len()];
    if g.input_len() == 0 || g.output_len() == 0 {
        return dx;
    }
    dx.par_chunks_mut(g.input_len())
        .zip(dy.par_chunks(g.output_len()))
        .for_each_init(
            || g.col_buffer(),
            |col, (dx_n, dy_n)| input_grad_sample(g, weight, dy_n, col, dx_n),
        );
    dx
}

#[inline(never)]
fn input_grad_sample(
    g: &Conv2dGeometry,
    weight: &[f32],
    dy_n: &[f32],
    col: &mut [f32],
    dx_n: &mut [f32],
) {
    let (rows, out_plane) = (g.col_rows(), g.out_plane());
    // Wᵀ is W read with swapped strides; a pointwise convolution's columns are the input itself.
    let pointwise = g.is_pointwise();
    let dst = if pointwise { &mut *dx_n } else { &mut *col };
    matmul(
        [rows, out_plane, g.c_out],
        (dst, out_plane, 1),
        false,
        (weight, 1, rows),
        (dy_n, out_plane, 1),
    );
    if !pointwise {
        col2im_add(g, col, dx_n);
    }
}

/// Weight and bias gradients: `dW = Σₙ dy[n] · im2col(x[n])ᵀ`, `db = Σₙ Σ_pixels dy[n]`.
pub fn conv2d_weight_grad(g: &Conv2dGeometry, x: &[f32], dy: &[f32]) -> (Vec<f32>, Vec<f32>) {
    if g.batch == 0 || g.output_len() == 0 || g.input_len() == 0 {
        return (vec![0.0; g.weight_len()], vec![0.0; g.c_out]);
    }
    if super::direct::applies(g) {
        return super::direct::conv2d_weight_grad(g, x, dy);
    }
    im2col_conv2d_weight_grad(g, x, dy)
}

/// Weight and bias gradients summed over the batch deterministically: `chunk` computes the
/// partial sums of fixed runs of [`WEIGHT_GRAD_CHUNK`] samples (in parallel), which are then
/// added in order, so the result does not depend on the thread count.
pub(super) fn sum_over_chunks<F>(batch: usize, chunk: F) -> (Vec<f32>, Vec<f32>)
where
    F: Fn(std::ops::Range<usize>) -> (Vec<f32>, Vec<f32>) + Sync,
{
    let partials: Vec<(Vec<f32>, Vec<f32>)> = (0..batch.div_ceil(WEIGHT_GRAD_CHUNK))
        .into_par_iter()
        .map(|c| chunk(c * WEIGHT_GRAD_CHUNK..((c + 1) * WEIGHT_GRAD_CHUNK).min(batch)))
        .collect();
    let mut parts = partials.into_iter();
    let (mut dw, mut db) = parts.next().expect("at least one chunk");
    for (pw, pb) in parts {
        dw.iter_mut().zip(&pw).for_each(|(a, b)| *a += b);
        db.iter_mut().zip(&pb).for_each(|(a, b)| *a += b);
    }
    (dw, db)
}

/// [`conv2d_weight_grad`] by im2col + gemm.
fn im2col_conv2d_weight_grad(g: &Conv2dGeometry, x: &[f32], dy: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (dw_t, db) = sum_over_chunks(g.batch, |samples| weight_grad_chunk(g, x, dy, samples));
    if !g.transposed_weight_grad() {
        return (dw_t, db);
    }
    // Back from [rows, c_out] to the weight's [c_out, rows].
    let rows = g.col_rows();
    let mut dw = vec![0.0f32; g.weight_len()];
    for (r, grads) in dw_t.chunks_exact(g.c_out).enumerate() {
        for (o, v) in grads.iter().enumerate() {
            dw[o * rows + r] = *v;
        }
    }
    (dw, db)
}

/// The weight and bias gradients of some consecutive samples.
#[inline(never)]
fn weight_grad_chunk(
    g: &Conv2dGeometry,
    x: &[f32],
    dy: &[f32],
    samples: std::ops::Range<usize>,
) -> (Vec<f32>, Vec<f32>) {
    let (rows, out_plane) = (g.col_rows(), g.out_plane());
    let mut dw_t = vec![0.0f32; g.weight_len()];
    let mut db = vec![0.0f32; g.c_out];
    let mut col = g.col_buffer();
    let first = samples.start;
    for n in samples {
        let x_n = &x[n * g.input_len()..(n + 1) * g.input_len()];
        let dy_n = &dy[n * g.output_len()..(n + 1) * g.output_len()];
        let cols: &[f32] = if g.is_pointwise() {
            x_n
        } else {
            im2col(g, x_n, &mut col);
            &col
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
            (dy_n, out_plane, 1),
            (cols, 1, out_plane),
        );
        for (b, plane) in db.iter_mut().zip(dy_n.chunks(out_plane)) {
            *b += sum(plane);
        }
    }
    (dw_t, db)
}

/// Shapes and options of one max-pooling (no padding, no dilation, floor mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolGeometry {
    /// Batch × channels: the number of independent planes.
    pub planes: usize,
    /// Input height and width.
    pub input: [usize; 2],
    /// Window height and width.
    pub kernel: [usize; 2],
    /// Stride along height and width.
    pub stride: [usize; 2],
    /// Output height and width.
    pub output: [usize; 2],
}

impl PoolGeometry {
    /// The offset (within the plane) of the maximum of window `(oy, ox)`: the first maximum in
    /// row-major order, or the first NaN (which max-pooling propagates).
    #[inline]
    fn argmax(&self, plane: &[f32], oy: usize, ox: usize) -> usize {
        let w = self.input[1];
        let (y0, x0) = (oy * self.stride[0], ox * self.stride[1]);
        let mut best = y0 * w + x0;
        let mut best_val = plane[best];
        if best_val.is_nan() {
            return best;
        }
        for ky in 0..self.kernel[0] {
            let row = (y0 + ky) * w + x0;
            for kx in 0..self.kernel[1] {
                let v = plane[row + kx];
                if v > best_val || v.is_nan() {
                    best = row + kx;
                    best_val = v;
                    if v.is_nan() {
                        return best;
                    }
                }
            }
        }
        best
    }
}

/// Whether a plane holds a NaN (a branch-free fold, so it vectorises).
fn has_nan(plane: &[f32]) -> bool {
    plane.iter().fold(false, |acc, v| acc | v.is_nan())
}

/// Max-pooling forward.
pub fn max_pool2d_forward(g: &PoolGeometry, x: &[f32]) -> Vec<f32> {
    let in_plane = g.input[0] * g.input[1];
    let [oh, ow] = g.output;
    let mut y = vec![0.0f32; g.planes * oh * ow];
    if oh * ow == 0 || in_plane == 0 {
        return y;
    }
    let pair = g.kernel == [2, 2] && g.stride == [2, 2];
    y.par_chunks_mut(oh * ow)
        .zip(x.par_chunks(in_plane))
        .for_each(|(y_p, x_p)| pool_forward_plane(g, pair, x_p, y_p));
    y
}

#[inline(never)]
fn pool_forward_plane(g: &PoolGeometry, pair: bool, x_p: &[f32], y_p: &mut [f32]) {
    let (w, ow) = (g.input[1], g.output[1]);
    if pair && !has_nan(x_p) {
        // The common 2×2/2 case on NaN-free data: plain comparisons, no index bookkeeping.
        for (oy, out) in y_p.chunks_exact_mut(ow).enumerate() {
            let (r0, r1) = (&x_p[2 * oy * w..], &x_p[(2 * oy + 1) * w..]);
            for (ox, o) in out.iter_mut().enumerate() {
                let top = if r0[2 * ox + 1] > r0[2 * ox] {
                    r0[2 * ox + 1]
                } else {
                    r0[2 * ox]
                };
                let bottom = if r1[2 * ox + 1] > r1[2 * ox] {
                    r1[2 * ox + 1]
                } else {
                    r1[2 * ox]
                };
                *o = if bottom > top { bottom } else { top };
            }
        }
        return;
    }
    for (oy, out) in y_p.chunks_exact_mut(ow).enumerate() {
        for (ox, o) in out.iter_mut().enumerate() {
            *o = x_p[g.argmax(x_p, oy, ox)];
        }
    }
}

/// Max-pooling backward: each output's gradient goes to its window's maximum.
pub fn max_pool2d_backward(g: &PoolGeometry, x: &[f32], dy: &[f32]) -> Vec<f32> {
    let in_plane = g.input[0] * g.input[1];
    let [oh, ow] = g.output;
    let mut dx = vec![0.0f32; g.planes * in_plane];
    if oh * ow == 0 || in_plane == 0 {
        return dx;
    }
    let pair = g.kernel == [2, 2] && g.stride == [2, 2];
    dx.par_chunks_mut(in_plane)
        .zip(x.par_chunks(in_plane).zip(dy.par_chunks(oh * ow)))
        .for_each(|(dx_p, (x_p, dy_p))| pool_backward_plane(g, pair, x_p, dy_p, dx_p));
    dx
}

#[inline(never)]
fn pool_backward_plane(g: &PoolGeometry, pair: bool, x_p: &[f32], dy_p: &[f32], dx_p: &mut [f32]) {
    let (w, [oh, ow]) = (g.input[1], g.output);
    let fast = pair && !has_nan(x_p);
    #[cfg(target_arch = "x86_64")]
    if fast && std::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F is present; the function checks the slice lengths it relies on.
        unsafe { avx512_pool::backward_2x2(w, g.output, x_p, dy_p, dx_p) };
        return;
    }
    if fast {
        // Windows do not overlap: each input gets its window's gradient or zero, chosen with
        // comparisons and selects (no data-dependent branches or indices).
        for (oy, grads) in dy_p.chunks_exact(ow).enumerate() {
            let (x0, x1) = (
                &x_p[2 * oy * w..][..2 * ow],
                &x_p[(2 * oy + 1) * w..][..2 * ow],
            );
            let (top, bottom) = dx_p[2 * oy * w..].split_at_mut(w);
            let (d0, d1) = (&mut top[..2 * ow], &mut bottom[..2 * ow]);
            for (ox, &grad) in grads.iter().enumerate() {
                let (i, j) = (2 * ox, 2 * ox + 1);
                let (a, b, c, d) = (x0[i], x0[j], x1[i], x1[j]);
                let top = if b > a { b } else { a };
                let bottom = if d > c { d } else { c };
                let max = if bottom > top { bottom } else { top };
                // The first maximum in row-major order takes the gradient; masks, not branches.
                let at_a = (a == max) as u32;
                let at_b = (b == max) as u32 & !at_a;
                let at_c = (c == max) as u32 & !(at_a | at_b);
                let at_d = 1 & !(at_a | at_b | at_c);
                let g = grad.to_bits();
                d0[i] = f32::from_bits(g & at_a.wrapping_neg());
                d0[j] = f32::from_bits(g & at_b.wrapping_neg());
                d1[i] = f32::from_bits(g & at_c.wrapping_neg());
                d1[j] = f32::from_bits(g & at_d.wrapping_neg());
            }
        }
        return;
    }
    for oy in 0..oh {
        for ox in 0..ow {
            dx_p[g.argmax(x_p, oy, ox)] += dy_p[oy * ow + ox];
        }
    }
}

/// The 2×2, stride-2 max-pool backward pass on NaN-free planes, 16 windows per step.
#[cfg(target_arch = "x86_64")]
mod avx512_pool {
    use std::arch::x86_64::*;

    /// `dx` of one plane (row width `w`, `[oh, ow]` windows; `dx` zero on entry): each window's
    /// gradient goes to its first maximum in row-major order, the other three get zero.
    ///
    /// # Safety
    /// The CPU supports AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn backward_2x2(
        w: usize,
        [oh, ow]: [usize; 2],
        x: &[f32],
        dy: &[f32],
        dx: &mut [f32],
    ) {
        assert!(2 * ow <= w && x.len() >= 2 * oh * w && dx.len() >= 2 * oh * w);
        assert!(dy.len() >= oh * ow);
        let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
        let low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        let high = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
        let bits = |n: usize| -> __mmask16 { ((1u32 << n.min(16)) - 1) as __mmask16 };
        // SAFETY: every access below is masked to the `2·ow` floats of a row pair, or the `ow`
        // gradients of a window row, which the asserts above keep inside the slices.
        unsafe {
            for oy in 0..oh {
                for ox in (0..ow).step_by(16) {
                    let n = (ow - ox).min(16);
                    let (lo, hi) = (bits(2 * n), bits((2 * n).saturating_sub(16)));
                    let r0 = x.as_ptr().add(2 * oy * w + 2 * ox);
                    let r1 = r0.add(w);
                    let (t0, t1) = (
                        _mm512_maskz_loadu_ps(lo, r0),
                        _mm512_maskz_loadu_ps(hi, r0.wrapping_add(16)),
                    );
                    let (b0, b1) = (
                        _mm512_maskz_loadu_ps(lo, r1),
                        _mm512_maskz_loadu_ps(hi, r1.wrapping_add(16)),
                    );
                    let a = _mm512_permutex2var_ps(t0, even, t1);
                    let b = _mm512_permutex2var_ps(t0, odd, t1);
                    let c = _mm512_permutex2var_ps(b0, even, b1);
                    let d = _mm512_permutex2var_ps(b0, odd, b1);
                    let max = _mm512_max_ps(_mm512_max_ps(a, b), _mm512_max_ps(c, d));
                    let at_a = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(a, max);
                    let at_b = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(b, max) & !at_a;
                    let at_c = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(c, max) & !(at_a | at_b);
                    let at_d = !(at_a | at_b | at_c);
                    let grad = _mm512_maskz_loadu_ps(bits(n), dy.as_ptr().add(oy * ow + ox));
                    let (ga, gb) = (
                        _mm512_maskz_mov_ps(at_a, grad),
                        _mm512_maskz_mov_ps(at_b, grad),
                    );
                    let (gc, gd) = (
                        _mm512_maskz_mov_ps(at_c, grad),
                        _mm512_maskz_mov_ps(at_d, grad),
                    );
                    let d0 = dx.as_mut_ptr().add(2 * oy * w + 2 * ox);
                    let d1 = d0.add(w);
                    _mm512_mask_storeu_ps(d0, lo, _mm512_permutex2var_ps(ga, low, gb));
                    _mm512_mask_storeu_ps(
                        d0.wrapping_add(16),
                        hi,
                        _mm512_permutex2var_ps(ga, high, gb),
                    );
                    _mm512_mask_storeu_ps(d1, lo, _mm512_permutex2var_ps(gc, low, gd));
                    _mm512_mask_storeu_ps(
                        d1.wrapping_add(16),
                        hi,
                        _mm512_permutex2var_ps(gc, high, gd),
                    );
                }
            }
        }
    }
}

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
#[inline]
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
        .map(|c| {
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
        })
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
    let mut y = vec![0.0f32; x.len()];
    if g.plane > 0 {
        y.par_chunks_mut(g.plane)
            .zip(x.par_chunks(g.plane))
            .enumerate()
            .for_each(|(i, (y_p, x_p))| {
                let (a, b) = affine[i % g.channels];
                for (o, v) in y_p.iter_mut().zip(x_p) {
                    *o = a * v + b;
                }
            });
    }
    let (mean, var) = stats.into_iter().unzip();
    (y, mean, var)
}

/// Gradients of [`batch_norm_train_forward`] with respect to `x`, `γ` and `β`, given the
/// statistics it returned: with x̂ = (x − μ)/√(σ²+ε) and M elements per channel,
/// `dβ = Σ dy`, `dγ = Σ dy·x̂`, `dx = γ/√(σ²+ε) · (dy − dβ/M − x̂·dγ/M)`.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_train_backward(
    g: &NormGeometry,
    x: &[f32],
    gamma: &[f32],
    mean: &[f32],
    var: &[f32],
    epsilon: f64,
    dy: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let inv_std: Vec<f64> = var
        .iter()
        .map(|&v| 1.0 / (v as f64 + epsilon).sqrt())
        .collect();
    // Per channel: Σ dy and Σ dy·(x − μ).
    let sums: Vec<(f64, f64)> = (0..g.channels)
        .into_par_iter()
        .map(|c| {
            let sum_dy: f64 = g.planes(dy, c).map(|p| sum(p) as f64).sum();
            let sum_dy_centred: f64 = g
                .planes(dy, c)
                .zip(g.planes(x, c))
                .map(|(d, v)| dot_centred(d, v, mean[c]) as f64)
                .sum();
            (sum_dy, sum_dy_centred)
        })
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
    let mut dx = vec![0.0f32; x.len()];
    if g.plane > 0 {
        dx.par_chunks_mut(g.plane)
            .zip(x.par_chunks(g.plane).zip(dy.par_chunks(g.plane)))
            .enumerate()
            .for_each(|(i, (dx_p, (x_p, dy_p)))| {
                let (k, c1, c0) = coefficients[i % g.channels];
                for ((o, v), d) in dx_p.iter_mut().zip(x_p).zip(dy_p) {
                    *o = k * d + c1 * v + c0;
                }
            });
    }
    (dx, d_gamma, d_beta)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The convolution by its definition, in f64.
    fn naive_conv(g: &Conv2dGeometry, x: &[f32], w: &[f32], b: &[f32]) -> Vec<f32> {
        let [h, wd] = g.input;
        let [kh, kw] = g.kernel;
        let [oh, ow] = g.output;
        let mut y = vec![0.0f32; g.batch * g.output_len()];
        for n in 0..g.batch {
            for o in 0..g.c_out {
                for oy in 0..oh {
                    for ox in 0..ow {
                        let mut acc = b[o] as f64;
                        for c in 0..g.c_in {
                            for ky in 0..kh {
                                for kx in 0..kw {
                                    let iy =
                                        (oy * g.stride[0] + ky) as isize - g.pad_begin[0] as isize;
                                    let ix =
                                        (ox * g.stride[1] + kx) as isize - g.pad_begin[1] as isize;
                                    if iy < 0 || ix < 0 || iy >= h as isize || ix >= wd as isize {
                                        continue;
                                    }
                                    let xv =
                                        x[((n * g.c_in + c) * h + iy as usize) * wd + ix as usize];
                                    let wv = w[((o * g.c_in + c) * kh + ky) * kw + kx];
                                    acc += xv as f64 * wv as f64;
                                }
                            }
                        }
                        y[((n * g.c_out + o) * oh + oy) * ow + ox] = acc as f32;
                    }
                }
            }
        }
        y
    }

    fn values(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| {
                let v = (i as u32)
                    .wrapping_mul(2654435761)
                    .wrapping_add(seed.wrapping_mul(97));
                ((v >> 8) % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    fn geometry(
        [batch, c_in, h, w]: [usize; 4],
        [c_out, kh, kw]: [usize; 3],
        stride: [usize; 2],
        pad: [(usize, usize); 2],
    ) -> Conv2dGeometry {
        let out = |i: usize, k: usize, s: usize, (a, b): (usize, usize)| (i + a + b - k) / s + 1;
        Conv2dGeometry {
            batch,
            c_in,
            input: [h, w],
            c_out,
            kernel: [kh, kw],
            stride,
            pad_begin: [pad[0].0, pad[1].0],
            output: [out(h, kh, stride[0], pad[0]), out(w, kw, stride[1], pad[1])],
        }
    }

    fn cases() -> Vec<Conv2dGeometry> {
        vec![
            geometry([3, 3, 9, 8], [4, 5, 5], [1, 1], [(0, 0), (0, 0)]),
            geometry([2, 4, 7, 7], [5, 3, 3], [1, 1], [(1, 1), (1, 1)]),
            geometry([2, 3, 8, 9], [2, 3, 3], [2, 2], [(1, 1), (1, 1)]),
            geometry([2, 2, 6, 5], [3, 1, 1], [1, 1], [(0, 0), (0, 0)]),
            geometry([1, 2, 7, 6], [3, 1, 1], [2, 2], [(0, 0), (0, 0)]),
            geometry([2, 2, 5, 6], [2, 3, 2], [1, 2], [(2, 0), (0, 1)]),
            geometry([17, 2, 5, 5], [3, 3, 3], [1, 1], [(1, 1), (1, 1)]),
            // The CIFAR CNN's second convolution, with a batch over two weight-gradient chunks.
            geometry([10, 6, 14, 14], [16, 5, 5], [1, 1], [(0, 0), (0, 0)]),
            geometry([3, 9, 6, 7], [7, 3, 3], [1, 1], [(1, 1), (1, 1)]),
        ]
    }

    #[test]
    fn direct_and_im2col_convolutions_agree() {
        for g in cases() {
            if !super::super::direct::applies(&g) {
                continue;
            }
            let x = values(g.batch * g.input_len(), 1);
            let w = values(g.weight_len(), 2);
            let b = values(g.c_out, 3);
            let dy = values(g.batch * g.output_len(), 4);
            close(
                &conv2d_forward(&g, &x, &w, Some(&b)),
                &im2col_conv2d_forward(&g, &x, &w, Some(&b)),
            );
            close(
                &conv2d_input_grad(&g, &w, &dy),
                &im2col_conv2d_input_grad(&g, &w, &dy),
            );
            let (dw, db) = conv2d_weight_grad(&g, &x, &dy);
            let (dw_ref, db_ref) = im2col_conv2d_weight_grad(&g, &x, &dy);
            close(&dw, &dw_ref);
            close(&db, &db_ref);
        }
    }

    fn close(a: &[f32], b: &[f32]) {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
                "at {i}: {x} vs {y}"
            );
        }
    }

    #[test]
    fn forward_matches_the_definition() {
        for g in cases() {
            let x = values(g.batch * g.input_len(), 1);
            let w = values(g.weight_len(), 2);
            let b = values(g.c_out, 3);
            let expected = naive_conv(&g, &x, &w, &b);
            close(&conv2d_forward(&g, &x, &w, Some(&b)), &expected);
            let zeros = vec![0.0; g.c_out];
            let expected = naive_conv(&g, &x, &w, &zeros);
            close(&conv2d_forward(&g, &x, &w, None), &expected);
        }
    }

    /// The gradients are the adjoints of the forward map: ⟨dy, conv(x)⟩ is linear in x and in w,
    /// so ⟨dx, x'⟩ = ⟨dy, conv_w(x')⟩ and ⟨dW, w'⟩ = ⟨dy, conv_{w'}(x)⟩ for any x', w'.
    #[test]
    fn gradients_are_the_adjoints_of_the_forward_map() {
        let dot = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .map(|(x, y)| *x as f64 * *y as f64)
                .sum::<f64>()
        };
        for g in cases() {
            let x = values(g.batch * g.input_len(), 4);
            let w = values(g.weight_len(), 5);
            let dy = values(g.batch * g.output_len(), 6);
            let probe_x = values(x.len(), 7);
            let probe_w = values(w.len(), 8);
            let dx = conv2d_input_grad(&g, &w, &dy);
            let lhs = dot(&dx, &probe_x);
            let rhs = dot(&dy, &conv2d_forward(&g, &probe_x, &w, None));
            assert!(
                (lhs - rhs).abs() < 1e-3 * (1.0 + rhs.abs()),
                "{g:?}: dx {lhs} vs {rhs}"
            );
            let (dw, db) = conv2d_weight_grad(&g, &x, &dy);
            let lhs = dot(&dw, &probe_w);
            let rhs = dot(&dy, &conv2d_forward(&g, &x, &probe_w, None));
            assert!(
                (lhs - rhs).abs() < 1e-3 * (1.0 + rhs.abs()),
                "{g:?}: dW {lhs} vs {rhs}"
            );
            let out_plane = g.output[0] * g.output[1];
            for (o, b) in db.iter().enumerate() {
                let sum: f64 = (0..g.batch)
                    .flat_map(|n| dy[(n * g.c_out + o) * out_plane..][..out_plane].iter())
                    .map(|v| *v as f64)
                    .sum();
                assert!((*b as f64 - sum).abs() < 1e-3, "{g:?}: db");
            }
        }
    }

    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        let g = geometry([37, 3, 12, 12], [6, 5, 5], [1, 1], [(0, 0), (0, 0)]);
        let x = values(g.batch * g.input_len(), 9);
        let dy = values(g.batch * g.output_len(), 10);
        let run = |threads| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(|| conv2d_weight_grad(&g, &x, &dy))
        };
        assert_eq!(run(1), run(3));
    }

    #[test]
    fn max_pool_fast_paths_follow_the_first_maximum_rule() {
        // Rows of 39 (19 windows: a full 16-window step and a masked one), values on a coarse
        // grid so that ties are frequent.
        let g = PoolGeometry {
            planes: 3,
            input: [7, 39],
            kernel: [2, 2],
            stride: [2, 2],
            output: [3, 19],
        };
        let x: Vec<f32> = values(3 * 7 * 39, 5)
            .iter()
            .map(|v| (v * 3.0).round())
            .collect();
        let dy = values(3 * 3 * 19, 6);
        let (y, dx) = (max_pool2d_forward(&g, &x), max_pool2d_backward(&g, &x, &dy));
        let mut expected = vec![0.0f32; x.len()];
        for p in 0..3 {
            let plane = &x[p * 273..(p + 1) * 273];
            for oy in 0..3 {
                for ox in 0..19 {
                    let at = g.argmax(plane, oy, ox);
                    assert_eq!(y[p * 57 + oy * 19 + ox], plane[at]);
                    expected[p * 273 + at] += dy[p * 57 + oy * 19 + ox];
                }
            }
        }
        assert_eq!(dx, expected);
    }

    #[test]
    fn max_pool_picks_the_first_maximum_and_routes_its_gradient() {
        let g = PoolGeometry {
            planes: 2,
            input: [4, 5],
            kernel: [2, 2],
            stride: [2, 2],
            output: [2, 2],
        };
        let mut x = values(40, 11);
        x[0] = 5.0;
        x[1] = 5.0; // a tie: the first one wins
        x[27] = f32::NAN;
        let y = max_pool2d_forward(&g, &x);
        assert_eq!(y[0], 5.0);
        assert!(y[4 + 1].is_nan(), "NaN propagates: {y:?}");
        let general = PoolGeometry {
            kernel: [2, 2],
            ..g
        };
        for p in 0..2 {
            for oy in 0..2 {
                for ox in 0..2 {
                    let plane = &x[p * 20..(p + 1) * 20];
                    let m = plane[general.argmax(plane, oy, ox)];
                    let got = y[p * 4 + oy * 2 + ox];
                    assert!(m == got || (m.is_nan() && got.is_nan()));
                }
            }
        }
        let dy: Vec<f32> = (1..=8).map(|v| v as f32).collect();
        let dx = max_pool2d_backward(&g, &x, &dy);
        assert_eq!(dx[0], 1.0);
        assert_eq!(dx[1], 0.0);
        assert_eq!(dx.iter().sum::<f32>(), dy.iter().sum::<f32>());
        assert_eq!(dx[27], 6.0, "the NaN takes its window's gradient");
        // Column 4 is never in a window (floor mode).
        assert!((0..4).all(|r| dx[r * 5 + 4] == 0.0));
    }
}
