//! The CPU kernels themselves, on plain `f32` slices in NCHW layout.
//!
//! Stride-1 convolutions go to the direct kernels of `direct.rs` where the CPU has AVX-512F or
//! AVX2 with FMA (and [`super::isa`] allows it). Every other convolution is im2col + one gemm per
//! sample (per few samples on small maps, [`Conv2dGeometry::group`]), written straight into (or
//! read straight from) the NCHW tensor, so nothing is converted to channels-last and no
//! batch-sized column matrix is ever built. Samples run in parallel on the rayon pool; the weight gradient sums fixed chunks of
//! samples and adds the chunk sums in order, so results do not depend on the thread count.

use rayon::prelude::*;
use std::mem::MaybeUninit;

/// `fn $name(args) -> R` calling `$generic` compiled for the best tier the kernels may use (the
/// loops are plain Rust; wider registers change no results, as every sum keeps its order).
macro_rules! best_isa {
    (fn $name:ident => $generic:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)?) => {
        fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                fn avx512($($arg: $ty),*) $(-> $ret)? {
                    $generic($($arg),*)
                }
                #[target_feature(enable = "avx2")]
                fn avx2($($arg: $ty),*) $(-> $ret)? {
                    $generic($($arg),*)
                }
                if $crate::kernels::isa::uses($crate::kernels::isa::Isa::Avx512) {
                    // SAFETY: the CPU has AVX-512F (`uses` never exceeds the detected tier).
                    return unsafe { avx512($($arg),*) };
                }
                if $crate::kernels::isa::uses($crate::kernels::isa::Isa::Avx2) {
                    // SAFETY: as above, for AVX2.
                    return unsafe { avx2($($arg),*) };
                }
            }
            $generic($($arg),*)
        }
    };
}

/// `$body` with `$a` bound to `$act` as a constant, one arm per activation: each arm's loops are
/// compiled for that activation alone (no per-element match).
macro_rules! per_activation {
    ($act:expr, $a:ident => $body:expr) => {
        match $act {
            $crate::kernels::Activation::Identity => {
                const $a: $crate::kernels::Activation = $crate::kernels::Activation::Identity;
                $body
            }
            $crate::kernels::Activation::Relu => {
                const $a: $crate::kernels::Activation = $crate::kernels::Activation::Relu;
                $body
            }
            $crate::kernels::Activation::Relu6 => {
                const $a: $crate::kernels::Activation = $crate::kernels::Activation::Relu6;
                $body
            }
            $crate::kernels::Activation::HardSwish => {
                const $a: $crate::kernels::Activation = $crate::kernels::Activation::HardSwish;
                $body
            }
        }
    };
}

mod act;
mod avg_pool;
mod columns;
pub(super) mod dense;
mod depthwise;
mod depthwise_channels;
mod depthwise_direct;
mod direct_wgrad;
mod gemm;
mod lanes;
mod narrow;
mod norm;
mod path;
mod pool;
#[cfg(target_arch = "x86_64")]
mod row_phases;
mod sample_wgrad;
mod single_pixel;
mod strided;
#[cfg(test)]
pub(crate) mod tests;
mod weight_grad;

pub use act::{
    activation_backward, activation_backward_in_place, activation_forward,
    activation_forward_in_place, add_activation, add_activation_in_place,
};
pub use avg_pool::{global_avg_pool_backward, global_avg_pool_forward};
use columns::{col2im_add, col2im_add_strided, im2col, im2col_strided};
pub(crate) use depthwise::{DepthwisePath, forward_by, input_grad_by, weight_grad_by};
pub use depthwise::{depthwise_forward, depthwise_input_grad, depthwise_weight_grad};
use gemm::{common_depth_block, gemm_depth_block, matmul, matmul_uninit};
pub use norm::{
    NormGeometry, batch_norm_inference, batch_norm_inference_backward, batch_norm_inference_into,
    batch_norm_train_backward, batch_norm_train_backward_into, batch_norm_train_forward,
    batch_norm_train_output,
};
pub(crate) use path::kernel_paths;
use path::{PassPath, WeightGradPath};
pub use pool::{PoolGeometry, max_pool2d_backward, max_pool2d_forward};
pub(super) use weight_grad::{
    ChunkBuffers, WeightGradArgs, chunk_bias_grad, chunked_bias_grad, sum_over_chunks,
    sum_over_chunks_with,
};
pub use weight_grad::{conv2d_weight_grad, conv2d_weight_grad_of};
#[cfg(test)]
use weight_grad::{im2col_conv2d_weight_grad, weight_grad_chunk};

/// Samples per partial sum of the weight gradient (fixed, so the summation order, and hence the
/// result, is the same with any number of threads).
pub(super) const WEIGHT_GRAD_CHUNK: usize = 8;

/// Output pixels per gemm the im2col path aims for on small maps ([`Conv2dGeometry::group`]).
const GROUP_PIXELS: usize = 512;
/// At most this many samples per gemm (bounds the column buffer).
const MAX_GROUP: usize = 32;

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
    /// A 1×1 convolution with stride 1 and no padding needs no column matrix at all (its input
    /// planes are the rows).
    fn is_pointwise(&self) -> bool {
        self.kernel == [1, 1]
            && self.stride == [1, 1]
            && self.pad_begin == [0, 0]
            && self.output == self.input
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
    // SAFETY: `MaybeUninit<f32>` has `f32`'s layout, and only initialised values are written
    // through the view.
    let dst = unsafe { &mut *(dst as *mut [f32] as *mut [MaybeUninit<f32>]) };
    copy_short_uninit(dst, src);
}

/// [`copy_short`] into uninitialised memory (an output written whole, never zeroed first).
#[inline(always)]
fn copy_short_uninit(dst: &mut [MaybeUninit<f32>], src: &[f32]) {
    let mut d = dst.chunks_exact_mut(8);
    let mut s = src.chunks_exact(8);
    for (d, s) in (&mut d).zip(&mut s) {
        let block: [f32; 8] = s.try_into().expect("8-float block");
        d.write_copy_of_slice(&block);
    }
    for (d, s) in d.into_remainder().iter_mut().zip(s.remainder()) {
        d.write(*s);
    }
}

/// The mask of a 16-float vector's first `n` lanes (all of them from 16 on): the AVX-512
/// kernels' partial loads and stores.
pub(in crate::kernels) fn first_lanes(n: usize) -> u16 {
    ((1u32 << n.min(16)) - 1) as u16
}

/// Elements per task of [`par_zeroed`] and [`par_copy`].
const FILL_CHUNK: usize = 1 << 14;

/// A zeroed output buffer, zeroed on the thread pool: `vec![0.0; len]` zeroes it on the calling
/// thread, a serial pass that at two threads held up every kernel's parallel work (a tenth of a
/// ResNet-20 training step).
pub(crate) fn par_zeroed(len: usize) -> Vec<f32> {
    // SAFETY: the chunks cover the `len` elements, and each is written.
    unsafe {
        written_whole(len, |out| {
            out.par_chunks_mut(FILL_CHUNK)
                .for_each(|chunk| chunk.iter_mut().for_each(|v| _ = v.write(0.0)))
        })
    }
}

/// A buffer of `len` floats that `fill` writes whole into its uninitialised capacity: the
/// outputs whose every element a kernel stores are not zeroed first (a pass over their memory).
///
/// # Safety
/// `fill` writes every one of the `len` elements it is given.
pub(crate) unsafe fn written_whole(
    len: usize,
    fill: impl FnOnce(&mut [MaybeUninit<f32>]),
) -> Vec<f32> {
    // SAFETY: the caller's contract.
    unsafe { written_whole_with_spare(len, 0, fill) }
}

/// [`written_whole`] with room for `spare` more floats (for a caller that appends them).
///
/// # Safety
/// `fill` writes every one of the `len` elements it is given.
pub(crate) unsafe fn written_whole_with_spare(
    len: usize,
    spare: usize,
    fill: impl FnOnce(&mut [MaybeUninit<f32>]),
) -> Vec<f32> {
    let mut out = Vec::with_capacity(len + spare);
    fill(&mut out.spare_capacity_mut()[..len]);
    // SAFETY: the caller's contract: `fill` wrote all `len` elements.
    unsafe { out.set_len(len) };
    out
}

/// A zeroed scratch buffer whose first float starts a 64-byte cache line, so the kernels' whole
/// vector loads at multiples of 16 floats never straddle two lines. The allocator aligns to 16
/// bytes, which split three such loads in four: an Intel core with two FMA ports spends a second
/// load on each (`fl bench --kernels`: 5–25% on the direct weight gradients).
pub(crate) struct Aligned {
    buf: Vec<f32>,
    start: usize,
    len: usize,
}

impl Aligned {
    /// Floats before and after the aligned start, so that it fits in the buffer.
    const SPARE: usize = 64 / std::mem::size_of::<f32>() - 1;

    /// Where the first cache line starts in a buffer at `ptr` (`align_offset` may give up,
    /// `usize::MAX`: the buffer is then only unaligned).
    fn start(ptr: *const f32) -> usize {
        ptr.align_offset(64).min(Self::SPARE)
    }

    /// `len` zeros (zeroed on the thread pool, like [`par_zeroed`]).
    pub(crate) fn zeroed(len: usize) -> Self {
        let buf = par_zeroed(len + Self::SPARE);
        let start = Self::start(buf.as_ptr());
        Self { buf, start, len }
    }

    /// `len` floats that `fill` writes whole, not zeroed first (see [`written_whole`]).
    ///
    /// # Safety
    /// `fill` writes every one of the `len` elements it is given.
    pub(crate) unsafe fn written_whole(
        len: usize,
        fill: impl FnOnce(&mut [MaybeUninit<f32>]),
    ) -> Self {
        let mut start = 0;
        let whole = |all: &mut [MaybeUninit<f32>]| {
            start = Self::start(all.as_ptr().cast());
            let (head, rest) = all.split_at_mut(start);
            let (body, tail) = rest.split_at_mut(len);
            head.fill(MaybeUninit::new(0.0));
            tail.fill(MaybeUninit::new(0.0));
            fill(body);
        };
        // SAFETY: the head and tail are zeroed above, the body written by `fill` (the caller's
        // contract).
        let buf = unsafe { written_whole(len + Self::SPARE, whole) };
        Self { buf, start, len }
    }
}

impl std::ops::Deref for Aligned {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.buf[self.start..self.start + self.len]
    }
}

impl std::ops::DerefMut for Aligned {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.buf[self.start..self.start + self.len]
    }
}

/// A copy of `values`, copied on the thread pool (see [`par_zeroed`]).
pub(crate) fn par_copy(values: &[f32]) -> Vec<f32> {
    // SAFETY: the chunks cover the `values.len()` elements, and each is written.
    unsafe {
        written_whole(values.len(), |out| {
            out.par_chunks_mut(FILL_CHUNK)
                .zip(values.par_chunks(FILL_CHUNK))
                .for_each(|(dst, src)| _ = dst.write_copy_of_slice(src))
        })
    }
}

/// `Σ values`, in eight interleaved partial sums (so it vectorises; the order is fixed).
#[inline(always)]
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

impl Conv2dGeometry {
    /// Whether to accumulate the weight gradient transposed (`[rows, c_out]`, column-major).
    /// gemm wants its output contiguous along m and its left operand too: in the weight
    /// gradient `dy · colsᵀ` neither is, so it packs one of them. Transposed, it packs the small
    /// `dy` rather than the column matrix, but then m = c_out, and fewer output channels than a
    /// 16-float register leave the multiply-add units idle; small layers keep the plain order.
    fn transposed_weight_grad(&self) -> bool {
        self.c_out >= 16
    }

    /// Samples per gemm on the im2col path. A small map makes a narrow product whose weight
    /// packing and partial register tiles cost more than its multiply-adds, so maps under
    /// [`GROUP_PIXELS`] / 2 pixels are batched into products about that wide. Each output is
    /// the same sum in the same order whatever the product's width, so grouping changes no bit
    /// (tested); groups are fixed runs of samples, so neither does the thread count.
    ///
    /// A batch of two or more samples makes at least two groups, all of one size but the last,
    /// sized so that two threads finish together: of the sizes from the widest down to half of
    /// it, the one whose groups split most evenly in two ([`two_way_load`]), the wider on a tie.
    /// On 4×4 and 2×2 maps FedMR's 50 samples made groups of 32 and 18, and evaluation's chunks
    /// of 32 one group, so on two threads one sat idle for a third or all of MobileNetV1's
    /// pointwise layers there; now 25 + 25 and 16 + 16. On 7×7 maps five groups of 10 left one
    /// thread a third idle; now ten of 5 (and on 8×8 maps ten of 5, not six of 8 and one of 2).
    /// Only where gemm splits the depth into the same blocks for all these widths as for a full
    /// widest group (so every sample gets the bits it gets in a full widest group); where no
    /// size does, the widest groups.
    fn group(&self) -> usize {
        let widest = (GROUP_PIXELS / self.out_plane().max(1)).clamp(1, MAX_GROUP);
        if self.batch < 2 {
            return widest;
        }
        // Every product must sum in the depth blocks of a full widest group's. gemm sums one of
        // at most 64 × 64 in 512-deep blocks, a larger one in `kernel_params`' blocks and one a
        // column wide as a matrix-vector product, so a narrow last group (the widest groups'
        // own included) could give its samples other bits than the batch's others.
        let reference = widest.min(self.batch) * self.out_plane();
        let same_blocks = |size: usize| {
            let mut widths = self.group_widths(size);
            widths.push(reference);
            [(self.c_out, self.col_rows()), (self.col_rows(), self.c_out)]
                .into_iter()
                .all(|(m, k)| common_depth_block(m, &widths, k).is_some())
        };
        let most = widest.min(self.batch.div_ceil(2));
        let mut sizes: Vec<usize> = (most.div_ceil(2)..=most).collect();
        sizes.sort_by_key(|&size| (two_way_load(self.batch, size), std::cmp::Reverse(size)));
        sizes
            .into_iter()
            .find(|&size| same_blocks(size))
            .unwrap_or(widest)
    }

    /// Samples per gemm of the im2col input gradient. A pointwise convolution's per-sample gemm
    /// writes the gradient itself, but on small maps its few columns fill gemm's register tiles
    /// poorly (a quarter of them on 2×2 maps), so it runs in groups too where gemm splits the
    /// depth (`c_out`) into the same blocks either way: then every output keeps its bits (its
    /// chain and block sums are the same, and adding a gemm result, never −0, onto the zeroed
    /// gradient changes nothing). Not on maps under 4 pixels or under 16 input channels: a
    /// product one column or row wide takes another gemm routine, which sums in another order
    /// (MobileNetV3's squeeze-and-excitation layers on 1×1 maps, 576 deep, differed).
    fn input_grad_group(&self) -> usize {
        let group = self.group();
        if !self.is_pointwise() || group == 1 {
            return group;
        }
        if self.out_plane() < 4 || self.c_in < 16 {
            return 1;
        }
        let mut widths = self.group_widths(group);
        widths.push(self.out_plane());
        match common_depth_block(self.col_rows(), &widths, self.c_out) {
            Some(_) => group,
            None => 1,
        }
    }

    /// The widths (`samples · out_plane`) of the gemms the im2col path runs in groups of
    /// `group` samples: a full group and, if the batch does not divide, the narrower last one.
    fn group_widths(&self, group: usize) -> Vec<usize> {
        let mut widths = vec![group.min(self.batch) * self.out_plane()];
        if self.batch > group && !self.batch.is_multiple_of(group) {
            widths.push(self.batch % group * self.out_plane());
        }
        widths
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

/// The samples the busier of two threads computes when `batch` samples run as groups of
/// `size` (the last one shorter), with the groups split between the threads as evenly as they
/// go.
fn two_way_load(batch: usize, size: usize) -> usize {
    let (whole, rest) = (batch / size, batch % size);
    whole.div_ceil(2) * size + if whole.is_multiple_of(2) { rest } else { 0 }
}

/// Forward convolution: `y[n] = W · im2col(x[n]) + b`. `x` is `[batch, c_in, h, w]`, `weight`
/// `[c_out, c_in, kh, kw]`, the result `[batch, c_out, oh, ow]`.
pub fn conv2d_forward(
    g: &Conv2dGeometry,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
) -> Vec<f32> {
    forward_on(PassPath::forward(g, bias), g, x, weight, bias)
}

/// [`conv2d_forward`] on `path`.
fn forward_on(
    path: PassPath,
    g: &Conv2dGeometry,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
) -> Vec<f32> {
    match path {
        PassPath::AcrossSamples(order) => lanes::forward(g, x, weight, bias, order),
        PassPath::Direct => super::direct::conv2d_forward(g, x, weight, bias),
        PassPath::Strided => strided::forward(g, x, weight, bias),
        PassPath::Im2col => im2col_conv2d_forward(g, x, weight, bias),
    }
}

/// [`conv2d_forward`] by im2col + gemm.
fn im2col_conv2d_forward(
    g: &Conv2dGeometry,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
) -> Vec<f32> {
    im2col_conv2d_forward_grouped(g, x, weight, bias, g.group())
}

/// [`im2col_conv2d_forward`] with `group` samples per gemm.
fn im2col_conv2d_forward_grouped(
    g: &Conv2dGeometry,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    group: usize,
) -> Vec<f32> {
    if g.output_len() == 0 || g.input_len() == 0 {
        return par_zeroed(g.batch * g.output_len());
    }
    let width = group * g.out_plane();
    // SAFETY: each sample's (or group's) output is written whole: bias then the accumulated
    // product, or the product alone, or the group's product copied out plane by plane.
    unsafe {
        written_whole(g.batch * g.output_len(), |y| {
            if group == 1 {
                y.par_chunks_mut(g.output_len())
                    .zip(x.par_chunks(g.input_len()))
                    .for_each_init(
                        || g.col_buffer(),
                        |col, (y_n, x_n)| forward_sample(g, x_n, weight, bias, col, y_n),
                    );
                return;
            }
            y.par_chunks_mut(group * g.output_len())
                .zip(x.par_chunks(group * g.input_len()))
                .for_each_init(
                    || (vec![0.0; g.col_rows() * width], vec![0.0; g.c_out * width]),
                    |(col, out), (y_g, x_g)| forward_group(g, x_g, weight, bias, col, out, y_g),
                );
        })
    }
}

/// The forward pass of a few samples as one gemm: their column matrices side by side
/// (`col_rows × samples·out_plane`), then the `[c_out, samples·out_plane]` product spread back
/// to NCHW.
#[inline(never)]
fn forward_group(
    g: &Conv2dGeometry,
    x_g: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    col: &mut [f32],
    out: &mut [f32],
    y_g: &mut [MaybeUninit<f32>],
) {
    let (rows, plane) = (g.col_rows(), g.out_plane());
    let width = x_g.len() / g.input_len() * plane;
    let (col, out) = (&mut col[..rows * width], &mut out[..g.c_out * width]);
    for (j, x_n) in x_g.chunks_exact(g.input_len()).enumerate() {
        im2col_strided(g, x_n, &mut col[j * plane..], width);
    }
    if let Some(bias) = bias {
        for (row, &b) in out.chunks_exact_mut(width).zip(bias) {
            row.fill(b);
        }
    }
    matmul(
        [g.c_out, width, rows],
        (out, width, 1),
        bias.is_some(),
        (weight, rows, 1),
        (col, width, 1),
    );
    for (j, y_n) in y_g.chunks_exact_mut(g.output_len()).enumerate() {
        for (o, dst) in y_n.chunks_exact_mut(plane).enumerate() {
            copy_short_uninit(dst, &out[o * width + j * plane..][..plane]);
        }
    }
}

#[inline(never)]
fn forward_sample(
    g: &Conv2dGeometry,
    x_n: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    col: &mut [f32],
    y_n: &mut [MaybeUninit<f32>],
) {
    let (rows, out_plane) = (g.col_rows(), g.out_plane());
    let cols: &[f32] = if g.is_pointwise() {
        x_n
    } else {
        im2col(g, x_n, col);
        col
    };
    let (dims, lhs, rhs) = (
        [g.c_out, out_plane, rows],
        (weight, rows, 1),
        (cols, out_plane, 1),
    );
    let Some(bias) = bias else {
        return matmul_uninit(dims, (y_n, out_plane, 1), lhs, rhs);
    };
    for (plane, &b) in y_n.chunks_mut(out_plane).zip(bias) {
        plane.fill(MaybeUninit::new(b));
    }
    // SAFETY: every element was just written (the bias of its channel).
    let y_n = unsafe { &mut *(y_n as *mut [MaybeUninit<f32>] as *mut [f32]) };
    matmul(dims, (y_n, out_plane, 1), true, lhs, rhs);
}

/// Input gradient: `dx[n] = col2im(Wᵀ · dy[n])`.
pub fn conv2d_input_grad(g: &Conv2dGeometry, weight: &[f32], dy: &[f32]) -> Vec<f32> {
    input_grad_on(PassPath::input_grad(g), g, weight, dy)
}

/// [`conv2d_input_grad`] on `path`.
fn input_grad_on(path: PassPath, g: &Conv2dGeometry, weight: &[f32], dy: &[f32]) -> Vec<f32> {
    match path {
        PassPath::AcrossSamples(order) => lanes::input_grad(g, weight, dy, order),
        PassPath::Direct => super::direct::conv2d_input_grad(g, weight, dy),
        PassPath::Strided => strided::input_grad(g, weight, dy),
        PassPath::Im2col => im2col_conv2d_input_grad(g, weight, dy),
    }
}

/// [`conv2d_input_grad`] by gemm + col2im.
fn im2col_conv2d_input_grad(g: &Conv2dGeometry, weight: &[f32], dy: &[f32]) -> Vec<f32> {
    im2col_conv2d_input_grad_grouped(g, weight, dy, g.input_grad_group())
}

/// [`im2col_conv2d_input_grad`] with `group` samples per gemm.
fn im2col_conv2d_input_grad_grouped(
    g: &Conv2dGeometry,
    weight: &[f32],
    dy: &[f32],
    group: usize,
) -> Vec<f32> {
    let mut dx = par_zeroed(g.batch * g.input_len());
    if g.input_len() == 0 || g.output_len() == 0 {
        return dx;
    }
    if group == 1 {
        dx.par_chunks_mut(g.input_len())
            .zip(dy.par_chunks(g.output_len()))
            .for_each_init(
                || g.col_buffer(),
                |col, (dx_n, dy_n)| input_grad_sample(g, weight, dy_n, col, dx_n),
            );
        return dx;
    }
    let width = group * g.out_plane();
    dx.par_chunks_mut(group * g.input_len())
        .zip(dy.par_chunks(group * g.output_len()))
        .for_each_init(
            || (vec![0.0; g.col_rows() * width], vec![0.0; g.c_out * width]),
            |(col, gathered), (dx_g, dy_g)| input_grad_group(g, weight, dy_g, col, gathered, dx_g),
        );
    dx
}

/// The input gradient of a few samples as one gemm: their output gradients side by side
/// (`[c_out, samples·out_plane]`), `Wᵀ` times that, then each sample's columns added back.
#[inline(never)]
fn input_grad_group(
    g: &Conv2dGeometry,
    weight: &[f32],
    dy_g: &[f32],
    col: &mut [f32],
    gathered: &mut [f32],
    dx_g: &mut [f32],
) {
    let (rows, plane) = (g.col_rows(), g.out_plane());
    let width = dy_g.len() / g.output_len() * plane;
    let (col, gathered) = (&mut col[..rows * width], &mut gathered[..g.c_out * width]);
    for (j, dy_n) in dy_g.chunks_exact(g.output_len()).enumerate() {
        for (o, src) in dy_n.chunks_exact(plane).enumerate() {
            copy_short(&mut gathered[o * width + j * plane..][..plane], src);
        }
    }
    matmul(
        [rows, width, g.c_out],
        (col, width, 1),
        false,
        (weight, 1, rows),
        (gathered, width, 1),
    );
    for (j, dx_n) in dx_g.chunks_exact_mut(g.input_len()).enumerate() {
        col2im_add_strided(g, &col[j * plane..], dx_n, width);
    }
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
