//! Depthwise convolutions on small maps (the MobileNets' 4×4 and 2×2 stages), vectorised across
//! channels instead of along each channel's plane.
//!
//! `depthwise.rs` runs one (sample, channel) plane at a time. On a 4×4 or 2×2 map a plane holds
//! 16 or 4 outputs, so its copies, loops and one partly used block of sums cost several times
//! its nine multiply-adds (three quarters of the depthwise forward pass in MobileNetV1's
//! profile), and such planes are 88% of MobileNetV1's depthwise planes. Here each
//! sample is transposed once into a channel-minor frame (`[row][column][channel]`, zero border,
//! channels padded to whole vectors), every output sums its taps for [`LANES`] channels at a
//! time, and the result is transposed back.
//!
//! Every sum runs in the order `depthwise.rs` uses (and the tests pin): the forward pass and the
//! input gradient add the taps in ascending order from zero; the weight gradient keeps 32 partial
//! sums per tap, lane = the output's position in `depthwise.rs`'s wide plane mod 32, each over
//! the samples and positions in order, then added up with `sum`. Products with the zero border
//! add `±0`, which leaves a finite sum as it is (a sum from `+0` is never `−0`), as in
//! `depthwise.rs`. The forward pass and the input gradient run a few samples per task, the
//! weight gradient one block of channels per task: no result depends on the thread count or on
//! the vector width.

use rayon::prelude::*;
use std::mem::MaybeUninit;

use super::Conv2dGeometry;

/// Channels per block of sums: one AVX-512 vector, two AVX2 ones.
const LANES: usize = 16;
/// The largest output map (pixels) this path takes; bigger ones keep `depthwise.rs`'s planes,
/// which were as fast or faster on 8×8 and 7×7 maps (`fl bench --kernels --layers dw`).
const MAX_PIXELS: usize = 16;

/// Whether the small-map path computes depthwise convolution `g` (see the module docs).
pub(super) fn applies(g: &Conv2dGeometry) -> bool {
    g.batch > 0 && (1..=MAX_PIXELS).contains(&g.out_plane()) && g.c_in >= LANES
}

/// A sample's channel-minor frame: `rows × cols` pixels of `channels` floats (the real channels
/// padded to whole blocks), the sample's `h × w` pixels at `origin`, zeros elsewhere.
struct Frame {
    cols: usize,
    channels: usize,
    origin: [usize; 2],
    data: Vec<f32>,
}

impl Frame {
    fn new(channels: usize, [rows, cols]: [usize; 2], origin: [usize; 2]) -> Self {
        Self {
            cols,
            channels,
            origin,
            data: vec![0.0; rows * cols * channels],
        }
    }

    /// `g`'s channels padded to whole blocks.
    fn all_channels(g: &Conv2dGeometry) -> usize {
        g.c_in.next_multiple_of(LANES)
    }

    /// The padded input's frame: every pixel a tap reads, and every input pixel.
    fn input(g: &Conv2dGeometry, channels: usize) -> Self {
        let ([h, w], [oh, ow], [kh, kw]) = (g.input, g.output, g.kernel);
        let ([sh, sw], [pt, pl]) = (g.stride, g.pad_begin);
        let rows = ((oh - 1) * sh + kh).max(pt + h);
        let cols = ((ow - 1) * sw + kw).max(pl + w);
        Self::new(channels, [rows, cols], [pt, pl])
    }

    /// The output's frame, without a border.
    fn output(g: &Conv2dGeometry, channels: usize) -> Self {
        Self::new(channels, g.output, [0, 0])
    }

    /// The output gradient's frame for the input gradient: a border of zeros wide enough that
    /// every tap of every padded-input pixel reads inside it (output `(oy, ox)` at
    /// `(oy + by, ox + bx)`, `b = (k − 1) / s`).
    fn output_grad(g: &Conv2dGeometry, channels: usize) -> Self {
        let ([h, w], [oh, ow], [kh, kw]) = (g.input, g.output, g.kernel);
        let ([sh, sw], [pt, pl]) = (g.stride, g.pad_begin);
        let [by, bx] = [(kh - 1) / sh, (kw - 1) / sw];
        let rows = by + oh.max((pt + h - 1) / sh + 1);
        let cols = bx + ow.max((pl + w - 1) / sw + 1);
        Self::new(channels, [rows, cols], [by, bx])
    }

    /// Offset of pixel `(y, x)` of the frame.
    #[inline(always)]
    fn at(&self, y: usize, x: usize) -> usize {
        (y * self.cols + x) * self.channels
    }

    /// Where each tap of a `kernel` reads, from where the output's first tap reads.
    fn tap_offsets(&self, [kh, kw]: [usize; 2]) -> Vec<usize> {
        (0..kh * kw).map(|k| self.at(k / kw, k % kw)).collect()
    }

    /// Writes one sample's `[c][h][w]` planes into the frame at its origin (only those pixels:
    /// the border keeps the zeros it was created with).
    #[inline(always)]
    fn load(&mut self, planes: &[f32], c: usize, dims: [usize; 2]) {
        assert!(planes.len() >= c * dims[0] * dims[1] && c <= self.channels);
        #[cfg(target_arch = "x86_64")]
        {
            use crate::kernels::isa::{Isa, uses};
            // SAFETY (both): the CPU supports the tier; the lengths are checked above.
            if uses(Isa::Avx512) {
                return unsafe { blocks::load_avx512(self, planes, c, dims) };
            }
            if uses(Isa::Avx2) {
                return unsafe { blocks::load_avx2(self, planes, c, dims) };
            }
        }
        let [oy, ox] = self.origin;
        for (ch, plane) in planes.chunks_exact(dims[0] * dims[1]).enumerate().take(c) {
            for (y, row) in plane.chunks_exact(dims[1]).enumerate() {
                for (x, &v) in row.iter().enumerate() {
                    let at = self.at(oy + y, ox + x) + ch;
                    self.data[at] = v;
                }
            }
        }
    }

    /// Reads the frame's `h × w` pixels at its origin back into `[c][h][w]` planes.
    #[inline(always)]
    fn store(&self, planes: &mut [MaybeUninit<f32>], c: usize, dims: [usize; 2]) {
        assert!(planes.len() >= c * dims[0] * dims[1] && c <= self.channels);
        #[cfg(target_arch = "x86_64")]
        {
            use crate::kernels::isa::{Isa, uses};
            // SAFETY (both): as in `load`.
            if uses(Isa::Avx512) {
                return unsafe { blocks::store_avx512(self, planes, c, dims) };
            }
            if uses(Isa::Avx2) {
                return unsafe { blocks::store_avx2(self, planes, c, dims) };
            }
        }
        let [oy, ox] = self.origin;
        for (ch, plane) in planes
            .chunks_exact_mut(dims[0] * dims[1])
            .enumerate()
            .take(c)
        {
            for (y, row) in plane.chunks_exact_mut(dims[1]).enumerate() {
                for (x, v) in row.iter_mut().enumerate() {
                    v.write(self.data[self.at(oy + y, ox + x) + ch]);
                }
            }
        }
    }
}

/// The frames' transposes by blocks of 16 channels × 16 consecutive pixels in registers (an
/// element at a time, their strided stores were a third of the forward pass).
#[cfg(target_arch = "x86_64")]
mod blocks {
    use super::super::first_lanes;
    use super::Frame;
    use crate::kernels::lanes16::Lanes16;
    use std::mem::MaybeUninit;

    /// The frame offsets of pixels `p0 .. p0 + n` of an `h × w` plane placed at `origin`.
    #[inline(always)]
    fn pixels(frame: &Frame, w: usize, p0: usize, n: usize) -> impl Iterator<Item = usize> {
        let [oy, ox] = frame.origin;
        (p0..p0 + n).map(move |p| frame.at(oy + p / w, ox + p % w))
    }

    /// [`Frame::load`].
    ///
    /// # Safety
    /// The CPU supports `V`'s tier; `planes` holds `c · h · w` floats, `c ≤ frame.channels`.
    #[inline(always)]
    unsafe fn load<V: Lanes16>(frame: &mut Frame, planes: &[f32], c: usize, dims: [usize; 2]) {
        let len = dims[0] * dims[1];
        for c0 in (0..c).step_by(16) {
            for p0 in (0..len).step_by(16) {
                let width = (len - p0).min(16);
                // SAFETY: register operations of the caller's tier.
                let mut block = [unsafe { V::zero() }; 16];
                for (i, v) in block.iter_mut().enumerate().take(c - c0) {
                    let from = planes[(c0 + i) * len + p0..][..width].as_ptr();
                    // SAFETY: the masked floats are `from`'s `width`.
                    *v = unsafe { V::load_masked(from, first_lanes(width)) };
                }
                // SAFETY: register shuffles of the caller's tier.
                unsafe { V::transpose(&mut block) };
                let at: [usize; 16] = {
                    let mut at = [0; 16];
                    at.iter_mut()
                        .zip(pixels(frame, dims[1], p0, width))
                        .for_each(|(a, p)| *a = p);
                    at
                };
                for (v, &at) in block.iter().zip(&at).take(width) {
                    // Whole blocks: the frame's channels are padded to them.
                    let to = frame.data[at + c0..][..16].as_mut_ptr();
                    // SAFETY: `to` holds sixteen floats.
                    unsafe { v.store(to) };
                }
            }
        }
    }

    /// [`Frame::store`].
    ///
    /// # Safety
    /// As [`load`].
    #[inline(always)]
    unsafe fn store<V: Lanes16>(
        frame: &Frame,
        planes: &mut [MaybeUninit<f32>],
        c: usize,
        dims: [usize; 2],
    ) {
        let len = dims[0] * dims[1];
        for c0 in (0..c).step_by(16) {
            for p0 in (0..len).step_by(16) {
                let width = (len - p0).min(16);
                // SAFETY: register operations of the caller's tier.
                let mut block = [unsafe { V::zero() }; 16];
                for (v, at) in block.iter_mut().zip(pixels(frame, dims[1], p0, width)) {
                    // SAFETY: the frame's channels are padded to whole blocks of sixteen.
                    *v = unsafe { V::load(frame.data[at + c0..][..16].as_ptr()) };
                }
                // SAFETY: register shuffles of the caller's tier.
                unsafe { V::transpose(&mut block) };
                for (i, v) in block.iter().enumerate().take(c - c0) {
                    let to = planes[(c0 + i) * len + p0..][..width].as_mut_ptr().cast();
                    // SAFETY: the masked floats are `to`'s `width`.
                    unsafe { v.store_masked(to, first_lanes(width)) };
                }
            }
        }
    }

    crate::kernels::lanes16::tier_entries! {
        load_avx512, load_avx2 =>
            load<>(frame: &mut Frame, planes: &[f32], c: usize, dims: [usize; 2])
    }

    crate::kernels::lanes16::tier_entries! {
        store_avx512, store_avx2 =>
            store<>(frame: &Frame, planes: &mut [MaybeUninit<f32>], c: usize, dims: [usize; 2])
    }
}

/// The weight `[c, 1, kh, kw]` tap-major, `[tap][channel]`, channels padded with zeros.
fn taps_by_channel(g: &Conv2dGeometry, weight: &[f32]) -> Vec<f32> {
    let taps = g.kernel[0] * g.kernel[1];
    let channels = Frame::all_channels(g);
    let mut out = vec![0.0; taps * channels];
    for (c, w) in weight.chunks_exact(taps).enumerate() {
        for (k, &v) in w.iter().enumerate() {
            out[k * channels + c] = v;
        }
    }
    out
}

/// One block of [`LANES`] floats at `offset`.
#[inline(always)]
fn block(data: &[f32], offset: usize) -> &[f32; LANES] {
    data[offset..offset + LANES]
        .try_into()
        .expect("a whole block")
}

best_isa! {
    fn forward_sample => forward_sample_generic(g: &Conv2dGeometry, w: &[f32], offsets: &[usize], x: &[f32], frames: &mut (Frame, Frame), y: &mut [MaybeUninit<f32>])
}

/// Depthwise forward pass (no bias) on a small map: `x` is `[batch, c, h, w]`, `weight`
/// `[c, 1, kh, kw]`; the same bits as `depthwise.rs`.
pub(super) fn forward(g: &Conv2dGeometry, x: &[f32], weight: &[f32]) -> Vec<f32> {
    let w = taps_by_channel(g, weight);
    let channels = Frame::all_channels(g);
    let offsets = Frame::input(g, channels).tap_offsets(g.kernel);
    let init = || (Frame::input(g, channels), Frame::output(g, channels));
    each_sample(
        g,
        [g.input_len(), g.output_len()],
        x,
        init,
        |frames, x, y| forward_sample(g, &w, &offsets, x, frames, y),
    )
}

/// The output of `f(frames, sample's input, sample's output)` over the batch, whose samples'
/// inputs are `len[0]` floats and outputs `len[1]`, each of which `f` writes whole. The samples
/// run in a few tasks per thread, each with its own frames (zeroed once per task).
fn each_sample<S>(
    g: &Conv2dGeometry,
    [in_len, out_len]: [usize; 2],
    input: &[f32],
    init: impl Fn() -> S + Sync,
    f: impl Fn(&mut S, &[f32], &mut [MaybeUninit<f32>]) + Sync,
) -> Vec<f32> {
    let per_task = g.batch.div_ceil(4 * rayon::current_num_threads()).max(1);
    // SAFETY: the tasks cover the batch, and `f` writes each sample's output whole.
    unsafe {
        super::written_whole(g.batch * out_len, |out| {
            out.par_chunks_mut(per_task * out_len)
                .zip(input.par_chunks(per_task * in_len))
                .for_each(|(out, input)| {
                    let mut frames = init();
                    for (out, input) in out.chunks_mut(out_len).zip(input.chunks(in_len)) {
                        f(&mut frames, input, out);
                    }
                })
        })
    }
}

#[inline(always)]
fn forward_sample_generic(
    g: &Conv2dGeometry,
    w: &[f32],
    offsets: &[usize],
    x: &[f32],
    (input, output): &mut (Frame, Frame),
    y: &mut [MaybeUninit<f32>],
) {
    let ([oh, ow], [sh, sw]) = (g.output, g.stride);
    input.load(x, g.c_in, g.input);
    let channels = input.channels;
    for oy in 0..oh {
        for ox in 0..ow {
            let base = input.at(oy * sh, ox * sw);
            let out = output.at(oy, ox);
            for c in (0..channels).step_by(LANES) {
                // The taps in ascending order from zero, as `depthwise.rs` adds them.
                let mut acc = [0.0f32; LANES];
                for (k, &offset) in offsets.iter().enumerate() {
                    let (wk, xk) = (
                        block(w, k * channels + c),
                        block(&input.data, base + offset + c),
                    );
                    for l in 0..LANES {
                        acc[l] += wk[l] * xk[l];
                    }
                }
                output.data[out + c..out + c + LANES].copy_from_slice(&acc);
            }
        }
    }
    output.store(y, g.c_in, g.output);
}

best_isa! {
    fn input_grad_sample => input_grad_sample_generic(g: &Conv2dGeometry, w: &[f32], phase_taps: &[Vec<(usize, usize)>], dy: &[f32], frames: &mut (Frame, Frame), dx: &mut [MaybeUninit<f32>])
}

/// Gradient of [`forward`] with respect to its input: the same bits as `depthwise.rs`.
pub(super) fn input_grad(g: &Conv2dGeometry, weight: &[f32], dy: &[f32]) -> Vec<f32> {
    let ([sh, sw], [kh, kw]) = (g.stride, g.kernel);
    let w = taps_by_channel(g, weight);
    // Per stride phase of the padded input pixel, the taps that reach it, in ascending order,
    // each with how far back (in output-gradient frame pixels) it reads.
    let channels = Frame::all_channels(g);
    let frame = Frame::output_grad(g, channels);
    let mut phase_taps = vec![Vec::new(); sh * sw];
    for k in 0..kh * kw {
        let (ky, kx) = (k / kw, k % kw);
        let back = (ky / sh) * frame.cols + kx / sw;
        phase_taps[(ky % sh) * sw + kx % sw].push((k, back * frame.channels));
    }
    let init = || {
        let out = Frame::new(channels, g.input, [0, 0]);
        (Frame::output_grad(g, channels), out)
    };
    each_sample(
        g,
        [g.output_len(), g.input_len()],
        dy,
        init,
        |frames, dy, dx| input_grad_sample(g, &w, &phase_taps, dy, frames, dx),
    )
}

#[inline(always)]
fn input_grad_sample_generic(
    g: &Conv2dGeometry,
    w: &[f32],
    phase_taps: &[Vec<(usize, usize)>],
    dy: &[f32],
    (grad, out): &mut (Frame, Frame),
    dx: &mut [MaybeUninit<f32>],
) {
    let ([h, wd], [sh, sw], [pt, pl]) = (g.input, g.stride, g.pad_begin);
    grad.load(dy, g.c_in, g.output);
    let [by, bx] = grad.origin;
    let channels = grad.channels;
    for iy in 0..h {
        for ix in 0..wd {
            // Padded pixel (py, px) hears tap (ky, kx) from output ((py − ky) / sh, (px − kx) /
            // sw) when the phases agree: frame pixel (py / sh + by − ky / sh, …).
            let (py, px) = (iy + pt, ix + pl);
            let base = grad.at(py / sh + by, px / sw + bx);
            let taps = &phase_taps[(py % sh) * sw + px % sw];
            let dst = out.at(iy, ix);
            for c in (0..channels).step_by(LANES) {
                let mut acc = [0.0f32; LANES];
                for &(k, back) in taps {
                    let (wk, dk) = (
                        block(w, k * channels + c),
                        block(&grad.data, base - back + c),
                    );
                    for l in 0..LANES {
                        acc[l] += wk[l] * dk[l];
                    }
                }
                out.data[dst + c..dst + c + LANES].copy_from_slice(&acc);
            }
        }
    }
    out.store(dx, g.c_in, g.input);
}

best_isa! {
    fn weight_grad_block => weight_grad_block_generic(g: &Conv2dGeometry, c: usize, x: &[f32], dy: &[f32], dw: &mut [f32])
}

/// Gradient of [`forward`] with respect to its weight `[c, 1, kh, kw]`: the same bits as
/// `depthwise.rs`.
pub(super) fn weight_grad(g: &Conv2dGeometry, x: &[f32], dy: &[f32]) -> Vec<f32> {
    let taps = g.kernel[0] * g.kernel[1];
    let mut dw = vec![0.0f32; g.c_in * taps];
    dw.par_chunks_mut(LANES * taps)
        .enumerate()
        .for_each(|(i, dw)| weight_grad_block(g, i * LANES, x, dy, dw));
    dw
}

/// The weight gradient of channels `c ..` (as many as `dw` holds, at most [`LANES`]): sample
/// by sample, the block's channels are transposed into frames of one block, and every
/// (output, tap) product is added to its partial sum, all of which (32 per tap) stay in L1.
#[inline(always)]
fn weight_grad_block_generic(g: &Conv2dGeometry, c: usize, x: &[f32], dy: &[f32], dw: &mut [f32]) {
    const WIDE_LANES: usize = super::depthwise::LANES;
    let ([oh, ow], [kh, kw], [sh, sw]) = (g.output, g.kernel, g.stride);
    let (taps, channels) = (kh * kw, dw.len() / (kh * kw));
    let (mut xf, mut dyf) = (Frame::input(g, LANES), Frame::output(g, LANES));
    let offsets = xf.tap_offsets(g.kernel);
    // Every output in order: where it reads its output gradient and its first tap's input in
    // the frames, and its partial sums, by its position in `depthwise.rs`'s wide plane.
    let width = ((ow - 1) * sw + kw).div_ceil(sw);
    let mut outputs = Vec::with_capacity(oh * ow);
    for oy in 0..oh {
        for ox in 0..ow {
            let lane = (oy * width + ox) % WIDE_LANES;
            outputs.push([dyf.at(oy, ox), xf.at(oy * sh, ox * sw), lane * taps]);
        }
    }
    // Per (wide lane, tap), the block's partial sums over the samples and outputs in order.
    let mut partial = vec![[0.0f32; LANES]; WIDE_LANES * taps];
    let (in_plane, out_plane) = (g.input[0] * g.input[1], g.out_plane());
    for (x, dy) in x
        .chunks_exact(g.input_len())
        .zip(dy.chunks_exact(g.output_len()))
    {
        xf.load(&x[c * in_plane..], channels, g.input);
        dyf.load(&dy[c * out_plane..], channels, g.output);
        for &[at_dy, at_x, sums] in &outputs {
            let d = block(&dyf.data, at_dy);
            for (acc, &offset) in partial[sums..sums + taps].iter_mut().zip(&offsets) {
                let v = block(&xf.data, at_x + offset);
                // Through a local copy: summed in place, the lanes went one by one.
                let mut sum = *acc;
                for l in 0..LANES {
                    sum[l] += d[l] * v[l];
                }
                *acc = sum;
            }
        }
    }
    for (ch, dw) in dw.chunks_exact_mut(taps).enumerate() {
        for (k, dw) in dw.iter_mut().enumerate() {
            let lanes: [f32; WIDE_LANES] = std::array::from_fn(|l| partial[l * taps + k][ch]);
            *dw = super::sum(&lanes);
        }
    }
}
