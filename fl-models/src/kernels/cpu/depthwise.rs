//! Depthwise convolutions (groups = channels, one `kh × kw` filter per channel, any stride and
//! padding): the MobileNets' spatial layers.
//!
//! Each (sample, channel) plane is copied once into a zero-padded buffer split into
//! `sh × sw` phases (phase `(ry, rx)` holds padded pixels `(i·sh + ry, j·sw + rx)`), each phase
//! `width` columns wide. Output `(oy, ox)` then reads, through kernel tap `(ky, kx)`, entry
//! `oy·width + ox + offset(ky, kx)` of phase `(ky mod sh, kx mod sw)`: laid out "wide" (output
//! rows `width` long, the few extra columns computed and dropped), every tap reads one
//! contiguous run for the whole plane. The forward pass sums all taps of a block of 32 outputs
//! in vector registers and stores it once; the input gradient does the same per phase entry
//! (a gather over the taps that reach it, not a scatter tap by tap); the weight gradient sweeps
//! the plane for three taps at a time, sharing each load of the output gradient. Every sum runs
//! in tap order from zero (tests pin it against a plain loop, bit for bit). The forward pass and
//! the input gradient run one plane per task; the weight gradient one group of channels per
//! task, with fixed-width partial sums over all samples, so no result depends on the thread
//! count or on the vector width.

use rayon::prelude::*;

use std::mem::MaybeUninit;

use super::{Conv2dGeometry, depthwise_channels, depthwise_direct};

/// Partial sums per weight-gradient tap (a fixed count, so every tier adds in the same order).
pub(super) const LANES: usize = 32;

/// Outputs per register block of the forward pass and the input gradient: two AVX-512 vectors
/// of sums, kept in registers over all the taps.
const BLOCK: usize = 32;

// The weight gradient sweeps the wide plane, padded to whole blocks, in whole chunks of lanes.
const _: () = assert!(BLOCK.is_multiple_of(LANES));

/// A plane's zero-padded copy split into stride phases, plus the wide output buffer.
struct Phased {
    /// Row and column strides (`sh × sw` phases).
    strides: [usize; 2],
    /// Rows and columns per phase.
    rows: usize,
    width: usize,
    /// The phases, then [`BLOCK`] spare floats (a block's reads may run past the last phase).
    data: Vec<f32>,
    /// One output plane laid out wide (`oh × width`), rounded up to whole blocks: every loop
    /// over it runs on full vectors (a partial tail went through the stack and stalled the
    /// small 4×4 and 2×2 maps on store forwarding).
    wide: Vec<f32>,
    /// `tap_offset` of every tap, in weight order.
    offsets: Vec<usize>,
    /// Per phase, its taps `(k, offset of the tap within the phase)` in ascending `k`.
    phase_taps: Vec<Vec<(usize, usize)>>,
    /// The input gradient's view of the output gradient: `front` zeros, the wide plane, zeros
    /// to cover every block read of every phase row.
    grad: Vec<f32>,
    front: usize,
}

impl Phased {
    fn new(g: &Conv2dGeometry) -> Self {
        let [sh, sw] = g.stride;
        let [kh, kw] = g.kernel;
        let [oh, ow] = g.output;
        // Enough rows and columns for every output: `(o − 1)·s + k` padded, split in phases.
        let rows = ((oh - 1) * sh + kh).div_ceil(sh);
        let width = ((ow - 1) * sw + kw).div_ceil(sw);
        let mut phased = Self {
            strides: [sh, sw],
            rows,
            width,
            // One spare row per phase: the last taps' wide runs reach past the last row.
            data: vec![0.0; sh * sw * (rows + 1) * width + BLOCK],
            wide: vec![0.0; (oh * width).next_multiple_of(BLOCK)],
            offsets: Vec::with_capacity(kh * kw),
            phase_taps: vec![Vec::new(); sh * sw],
            grad: Vec::new(),
            front: ((kh - 1) / sh) * width + (kw - 1) / sw,
        };
        for k in 0..kh * kw {
            let (ky, kx) = (k / kw, k % kw);
            phased.offsets.push(phased.tap_offset(ky, kx));
            let within = (ky / sh) * width + kx / sw;
            phased.phase_taps[(ky % sh) * sw + kx % sw].push((k, within));
        }
        phased.grad = vec![0.0; phased.front + rows * width + BLOCK];
        phased
    }

    fn phase_len(&self) -> usize {
        (self.rows + 1) * self.width
    }

    /// Where tap `(ky, kx)` of output `(0, 0)` reads.
    #[inline(always)]
    fn tap_offset(&self, ky: usize, kx: usize) -> usize {
        let [sh, sw] = self.strides;
        ((ky % sh) * sw + kx % sw) * self.phase_len() + (ky / sh) * self.width + kx / sw
    }

    /// Fills the phases from one input plane. Writes only the plane's values, always at the
    /// same places: everything else (the padding) keeps the zeros the buffer was created with,
    /// so a buffer that only this function writes is zeroed once, not per plane (per-row fills
    /// were a tenth of MobileNetV3's evaluation).
    #[inline(always)]
    fn load(&mut self, g: &Conv2dGeometry, plane: &[f32]) {
        let [h, w] = g.input;
        let [pt, pl] = g.pad_begin;
        let [sh, sw] = self.strides;
        let (width, phase_len) = (self.width, self.phase_len());
        for ry in 0..sh {
            for rx in 0..sw {
                let phase = &mut self.data[(ry * sw + rx) * phase_len..][..phase_len];
                // Phase columns j whose input column j·sw + rx − pl lies in [0, w).
                let j0 = pl.saturating_sub(rx).div_ceil(sw).min(width);
                let j1 = if w + pl > rx {
                    ((w + pl - rx - 1) / sw + 1).min(width)
                } else {
                    0
                }
                .max(j0);
                for (i, dst) in phase.chunks_exact_mut(width).enumerate().take(self.rows) {
                    let iy = (i * sh + ry).wrapping_sub(pt);
                    if iy >= h {
                        continue;
                    }
                    let src = &plane[iy * w..(iy + 1) * w];
                    let x0 = j0 * sw + rx - pl;
                    if sw == 1 {
                        super::copy_short(&mut dst[j0..j1], &src[x0..x0 + (j1 - j0)]);
                    } else if sw == 2 && j1 > j0 {
                        // Every other value: whole pairs, which the compiler turns into
                        // vector shuffles (the chunks below ran one value at a time and were
                        // most of a stride-2 layer's weight gradient), then the last value.
                        let (dst, n) = (&mut dst[j0..j1], j1 - j0);
                        let pairs = src[x0..x0 + 2 * (n - 1)].chunks_exact(2);
                        for (d, pair) in dst.iter_mut().zip(pairs) {
                            *d = pair[0];
                        }
                        dst[n - 1] = src[x0 + 2 * (n - 1)];
                    } else {
                        // One chunk of `sw` per entry: `step_by` recomputed its remaining
                        // length at every element (a sixth of MobileNetV1's depthwise forward
                        // pass in `perf`), a chunk is a pointer bump.
                        for (d, v) in dst[j0..j1].iter_mut().zip(src[x0..].chunks(sw)) {
                            *d = v[0];
                        }
                    }
                }
            }
        }
    }

    /// Writes the phases' entries that lie inside the input to one zeroed input-gradient plane
    /// (the adjoint of [`Phased::load`]; input pixels no output reads keep their zero).
    #[inline(always)]
    fn store(&self, g: &Conv2dGeometry, plane: &mut [f32]) {
        let [h, w] = g.input;
        let [pt, pl] = g.pad_begin;
        let [sh, sw] = self.strides;
        let (width, phase_len) = (self.width, self.phase_len());
        for ry in 0..sh {
            for rx in 0..sw {
                let phase = &self.data[(ry * sw + rx) * phase_len..][..self.rows * width];
                let j0 = pl.saturating_sub(rx).div_ceil(sw).min(width);
                let j1 = if w + pl > rx {
                    ((w + pl - rx - 1) / sw + 1).min(width)
                } else {
                    0
                }
                .max(j0);
                for (i, src) in phase.chunks_exact(width).enumerate() {
                    let iy = (i * sh + ry).wrapping_sub(pt);
                    if iy >= h {
                        continue;
                    }
                    let dst = &mut plane[iy * w..(iy + 1) * w];
                    let x0 = j0 * sw + rx - pl;
                    if sw == 1 {
                        super::copy_short(&mut dst[x0..x0 + (j1 - j0)], &src[j0..j1]);
                    } else if sw == 2 && j1 > j0 {
                        // Whole pairs, then the last value, as in `load`.
                        let (src, n) = (&src[j0..j1], j1 - j0);
                        let pairs = dst[x0..x0 + 2 * (n - 1)].chunks_exact_mut(2);
                        for (pair, v) in pairs.zip(src) {
                            pair[0] = *v;
                        }
                        dst[x0 + 2 * (n - 1)] = src[n - 1];
                    } else {
                        // Chunks, as in `load`.
                        for (d, v) in dst[x0..].chunks_mut(sw).zip(&src[j0..j1]) {
                            d[0] = *v;
                        }
                    }
                }
            }
        }
    }
}

best_isa! {
    fn forward_plane => forward_plane_generic(g: &Conv2dGeometry, w: &[f32], x: &[f32], buf: &mut Phased, y: &mut [MaybeUninit<f32>])
}

best_isa! {
    fn input_grad_plane => input_grad_plane_generic(g: &Conv2dGeometry, w: &[f32], dy: &[f32], buf: &mut Phased, dx: &mut [f32])
}

best_isa! {
    fn weight_grad_channels => weight_grad_channels_generic(g: &Conv2dGeometry, channels: std::ops::Range<usize>, x: &[f32], dy: &[f32], buf: &mut Phased, dw: &mut [f32])
}

fn planes(g: &Conv2dGeometry) -> (usize, usize) {
    (g.input[0] * g.input[1], g.out_plane())
}

/// Which kernels run a depthwise convolution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DepthwisePath {
    /// One (sample, channel) plane at a time (this file).
    Planes,
    /// Small maps, vectorised across channels (`depthwise_channels.rs`).
    Channels,
    /// Stride 1, rows as wide as the input's, stride 2 under 3×3 kernels with rows of at
    /// most 16 outputs, or planes of one vector: straight from the planes with masked loads,
    /// column phases or lane permutations (`depthwise_direct.rs`; the weight gradient on the
    /// channels where they apply, else on the planes).
    Direct,
}

impl DepthwisePath {
    /// The path for `g`: the planes' per-plane costs outweigh their sums on small maps; on
    /// those, planes in one vector need no transposes (3× the channels' speed on 4×4 and 2×2
    /// maps).
    pub(crate) fn of(g: &Conv2dGeometry) -> Self {
        if depthwise_direct::applies(g) && depthwise_direct::single_vector(g) {
            Self::Direct
        } else if depthwise_channels::applies(g) {
            Self::Channels
        } else if depthwise_direct::applies(g) {
            Self::Direct
        } else {
            Self::Planes
        }
    }

    /// What `fl bench --kernels` calls it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Planes => "planes",
            Self::Channels => "channels in lanes",
            Self::Direct => "direct",
        }
    }
}

/// Depthwise forward pass (no bias): `x` is `[batch, c, h, w]`, `weight` `[c, 1, kh, kw]`.
pub fn depthwise_forward(g: &Conv2dGeometry, x: &[f32], weight: &[f32]) -> Vec<f32> {
    forward_by(DepthwisePath::of(g), g, x, weight)
}

/// [`depthwise_forward`] on a given path.
pub(crate) fn forward_by(
    path: DepthwisePath,
    g: &Conv2dGeometry,
    x: &[f32],
    weight: &[f32],
) -> Vec<f32> {
    match path {
        DepthwisePath::Channels => return depthwise_channels::forward(g, x, weight),
        DepthwisePath::Direct => return depthwise_direct::forward(g, x, weight),
        DepthwisePath::Planes => {}
    }
    let (in_plane, out_plane) = planes(g);
    let taps = g.kernel[0] * g.kernel[1];
    // SAFETY: the planes cover the output, and `forward_plane` writes every element of each
    // (it asserts so).
    unsafe {
        super::written_whole(g.batch * g.c_in * out_plane, |y| {
            y.par_chunks_mut(out_plane)
                .zip(x.par_chunks(in_plane))
                .enumerate()
                .for_each_init(
                    || Phased::new(g),
                    |buf, (i, (y, x))| {
                        let c = i % g.c_in;
                        forward_plane(g, &weight[c * taps..(c + 1) * taps], x, buf, y)
                    },
                )
        })
    }
}

#[inline(always)]
fn forward_plane_generic(
    g: &Conv2dGeometry,
    w: &[f32],
    x: &[f32],
    buf: &mut Phased,
    y: &mut [MaybeUninit<f32>],
) {
    let [oh, ow] = g.output;
    // Every row of `y` is written: `wide` holds at least `oh` rows of `width`.
    assert!(y.len() == oh * ow && buf.wide.len() >= oh * buf.width && buf.width >= ow);
    buf.load(g, x);
    let len = buf.wide.len();
    // Each block of outputs sums its taps in registers, in tap order from zero (the order the
    // tests pin down), and is stored once. Reads past the plane stay inside `data` (its spare
    // row per phase and spare block) and only feed outputs that are dropped.
    for start in (0..len).step_by(BLOCK) {
        let mut acc = [0.0f32; BLOCK];
        for (&weight, &offset) in w.iter().zip(&buf.offsets) {
            let input: &[f32; BLOCK] = buf.data[offset + start..][..BLOCK]
                .try_into()
                .expect("a full block");
            for l in 0..BLOCK {
                acc[l] += weight * input[l];
            }
        }
        buf.wide[start..start + BLOCK].copy_from_slice(&acc);
    }
    for (dst, src) in y.chunks_exact_mut(ow).zip(buf.wide.chunks_exact(buf.width)) {
        super::copy_short_uninit(dst, &src[..ow]);
    }
}

/// Gradient of [`depthwise_forward`] with respect to its input.
pub fn depthwise_input_grad(g: &Conv2dGeometry, weight: &[f32], dy: &[f32]) -> Vec<f32> {
    input_grad_by(DepthwisePath::of(g), g, weight, dy)
}

/// [`depthwise_input_grad`] on a given path.
pub(crate) fn input_grad_by(
    path: DepthwisePath,
    g: &Conv2dGeometry,
    weight: &[f32],
    dy: &[f32],
) -> Vec<f32> {
    match path {
        DepthwisePath::Channels => return depthwise_channels::input_grad(g, weight, dy),
        DepthwisePath::Direct => return depthwise_direct::input_grad(g, weight, dy),
        DepthwisePath::Planes => {}
    }
    let (in_plane, out_plane) = planes(g);
    let taps = g.kernel[0] * g.kernel[1];
    let mut dx = super::par_zeroed(g.batch * g.c_in * in_plane);
    dx.par_chunks_mut(in_plane)
        .zip(dy.par_chunks(out_plane))
        .enumerate()
        .for_each_init(
            || Phased::new(g),
            |buf, (i, (dx, dy))| {
                let c = i % g.c_in;
                input_grad_plane(g, &weight[c * taps..(c + 1) * taps], dy, buf, dx)
            },
        );
    dx
}

/// `dy` laid out wide, zeros in the extra columns and the tail (so they add nothing): like
/// [`Phased::load`], writes only the values, so the zeros stay from the buffer's creation in a
/// buffer whose `wide` only this function writes.
#[inline(always)]
fn widen(buf: &mut Phased, ow: usize, dy: &[f32]) {
    for (dst, src) in buf
        .wide
        .chunks_exact_mut(buf.width)
        .zip(dy.chunks_exact(ow))
    {
        super::copy_short(&mut dst[..ow], src);
    }
}

#[inline(always)]
fn input_grad_plane_generic(
    g: &Conv2dGeometry,
    w: &[f32],
    dy: &[f32],
    buf: &mut Phased,
    dx: &mut [f32],
) {
    let ow = g.output[1];
    let (width, front) = (buf.width, buf.front);
    // The output gradient laid out wide after `front` zeros (its extra columns and the tail
    // stay zero from the buffer's creation).
    for (dst, src) in buf.grad[front..]
        .chunks_exact_mut(width)
        .zip(dy.chunks_exact(ow))
    {
        super::copy_short(&mut dst[..ow], src);
    }
    // Gathered rather than scattered: each padded-input entry sums, in registers, what every
    // tap of its phase brings it, in tap order from zero, as the tests pin down. Entries the
    // phase's row count leaves out are never read by `store`. Blocks are stored whole: the
    // last one may spill into the phase's spare row and the next phase's first entries (which
    // that phase overwrites after) or the spare block after the last phase.
    let (phase_len, n) = (buf.phase_len(), buf.rows * width);
    for (phase, taps) in buf.phase_taps.iter().enumerate() {
        let data = &mut buf.data[phase * phase_len..][..n.next_multiple_of(BLOCK)];
        for start in (0..n).step_by(BLOCK) {
            let mut acc = [0.0f32; BLOCK];
            for &(k, within) in taps {
                let weight = w[k];
                let grad: &[f32; BLOCK] = buf.grad[front + start - within..][..BLOCK]
                    .try_into()
                    .expect("a full block");
                for l in 0..BLOCK {
                    acc[l] += weight * grad[l];
                }
            }
            data[start..start + BLOCK].copy_from_slice(&acc);
        }
    }
    buf.store(g, dx);
}

/// Gradient of [`depthwise_forward`] with respect to its weight `[c, 1, kh, kw]`.
pub fn depthwise_weight_grad(g: &Conv2dGeometry, x: &[f32], dy: &[f32]) -> Vec<f32> {
    weight_grad_by(DepthwisePath::of(g), g, x, dy)
}

/// [`depthwise_weight_grad`] on a given path.
pub(crate) fn weight_grad_by(
    path: DepthwisePath,
    g: &Conv2dGeometry,
    x: &[f32],
    dy: &[f32],
) -> Vec<f32> {
    // The direct path leaves the small maps' weight gradient to the channels (1.5–3× the
    // planes' speed there).
    let channels = path == DepthwisePath::Direct && depthwise_channels::applies(g);
    if path == DepthwisePath::Channels || channels {
        return depthwise_channels::weight_grad(g, x, dy);
    }
    let taps = g.kernel[0] * g.kernel[1];
    let mut dw = vec![0.0f32; g.c_in * taps];
    // Up to 8 channels per task, so each sample's planes of the group are one contiguous read
    // (one channel per task read a plane per sample, `c_in` planes apart), while leaving each
    // thread four tasks or more. Each channel's sums are the same in any group.
    let group = (g.c_in / (4 * rayon::current_num_threads())).clamp(1, 8);
    dw.par_chunks_mut(taps * group).enumerate().for_each_init(
        || Phased::new(g),
        |buf, (i, dw)| {
            let channels = i * group..i * group + dw.len() / taps;
            weight_grad_channels(g, channels, x, dy, buf, dw)
        },
    );
    dw
}

#[inline(always)]
fn weight_grad_channels_generic(
    g: &Conv2dGeometry,
    channels: std::ops::Range<usize>,
    x: &[f32],
    dy: &[f32],
    buf: &mut Phased,
    dw: &mut [f32],
) {
    let (in_plane, out_plane) = planes(g);
    let taps = g.kernel[0] * g.kernel[1];
    let len = buf.wide.len();
    // LANES partial sums per tap over every sample, added up once at the end.
    let mut lanes = vec![[0.0f32; LANES]; channels.len() * taps];
    for n in 0..g.batch {
        for (c, lanes) in channels.clone().zip(lanes.chunks_exact_mut(taps)) {
            let plane = n * g.c_in + c;
            buf.load(g, &x[plane * in_plane..(plane + 1) * in_plane]);
            widen(
                buf,
                g.output[1],
                &dy[plane * out_plane..(plane + 1) * out_plane],
            );
            // Taps in groups that share each load of the output gradient, their partial sums
            // in registers while the plane is swept.
            let mut k = 0;
            while k < taps {
                let (offsets, lanes) = (&buf.offsets[k..], &mut lanes[k..]);
                let (data, grad) = (&buf.data[..], &buf.wide[..len]);
                k += match taps - k {
                    3.. => sweep_3_taps(grad, data, offsets, lanes),
                    2 => sweep_2_taps(grad, data, offsets, lanes),
                    _ => sweep_1_tap(grad, data, offsets, lanes),
                };
            }
        }
    }
    for (dw, acc) in dw.iter_mut().zip(&lanes) {
        *dw = super::sum(acc);
    }
}

/// `fn $name(grad, data, offsets, lanes) -> taps`: adds one sample's `Σ_p grad[p] ·
/// data[offset + p]` for as many taps as indices are listed onto their [`LANES`] partial sums
/// (lane `p mod LANES`, in order of `p`), sharing each load of `grad`. The sums are a tuple of
/// arrays, which the compiler keeps in vector registers (an array of arrays went to the stack).
/// `grad` is whole chunks: its zero tail (see [`Phased::wide`]) adds `±0` to lanes no output
/// reaches, which leaves every sum as it is (a sum from `+0` is never `−0`).
macro_rules! sweep_taps {
    ($name:ident, $taps:literal, $($j:tt),+) => {
        #[inline(always)]
        fn $name(grad: &[f32], data: &[f32], offsets: &[usize], lanes: &mut [[f32; LANES]]) -> usize {
            let mut acc = ($(lanes[$j],)+);
            for (chunk, d) in grad.chunks_exact(LANES).enumerate() {
                let d: &[f32; LANES] = d.try_into().expect("a full chunk");
                $(
                    let v: &[f32; LANES] = data[offsets[$j] + chunk * LANES..][..LANES]
                        .try_into()
                        .expect("a full chunk");
                    for l in 0..LANES {
                        acc.$j[l] += d[l] * v[l];
                    }
                )+
            }
            $(lanes[$j] = acc.$j;)+
            $taps
        }
    };
}

sweep_taps!(sweep_3_taps, 3, 0, 1, 2);
sweep_taps!(sweep_2_taps, 2, 0, 1);
sweep_taps!(sweep_1_tap, 1, 0);
