//! Depthwise convolutions at stride 1 whose output rows are as wide as the input's (the
//! MobileNets' "same" layers on 32×32 to 7×7 maps), straight from the planes on AVX-512.
//!
//! `depthwise.rs` copies each plane into a zero-padded buffer, sums its taps over a wide
//! layout and copies the result back out; on these maps the copies and the loop overheads cost
//! several times the nine multiply-adds (the planes ran at 10–25 GFLOP/s, `fl bench --kernels
//! --layers dw`). Here vector `v` of a plane holds outputs `16v … 16v + 15` in row-major order.
//! At stride 1 with rows as wide as the input's, tap `(ky, kx)` of every output reads the input
//! at one fixed offset from it, `(ky − pt)·w + kx − pl`, so the tap's 16 inputs are one load
//! from the unpadded plane, masked to the lanes whose input lies inside it (the others read as
//! the padding's zeros: the same products `depthwise.rs` computes, so the same bits). The input
//! gradient is the same gather through the mirrored offsets, its masks keeping the outputs that
//! exist. Both sum their taps in ascending order from zero with a multiply and an add, as
//! `depthwise.rs` does (and the tests pin); a tap whose mask is empty adds `±0` there, which
//! leaves a sum from `+0` as it is, so it is skipped. The weight gradient stays on
//! `depthwise.rs`'s planes (or, on small maps, on `depthwise_channels.rs`).
//!
//! Stride-2 layers under 3×3 kernels with padding 1 whose output rows fit one vector (the
//! MobileNets' downsampling layers into 16×16 and 8×8 maps) run here too: an input row's two
//! vectors, permuted, give the row's three column phases (lane `j` of phase `kx` holding input
//! column `2j + kx − 1`, zero outside the row), so output row `oy` sums, per tap, one phase of
//! input row `2·oy + ky − 1`; the input gradient adds, on the even and the odd columns of each
//! input row, the taps whose output exists, then interleaves them. Both keep the planes' tap
//! order and products, padding zeros included.
//!
//! Maps whose input and output planes each fit one vector take one or more planes per vector:
//! a 4×4 plane, or four samples' 2×2 planes of a channel, each in its slot of lanes. Per tap,
//! a permutation of the loaded planes onto the outputs that tap reaches (zeros elsewhere), a
//! multiply and an add, in tap order, for four channels at once (four independent chains);
//! the input gradient likewise gathers, per input pixel, the outputs that read it. The planes
//! need no copies, where `depthwise_channels.rs` transposes each sample to channels-in-lanes
//! and back (3× slower on the MobileNets' 4×4 and 2×2 stages). Their weight gradient stays on
//! that path, and so does a 4×4 input into a 2×2 output (a quarter of a vector).

use rayon::prelude::*;
use std::mem::MaybeUninit;

use super::Conv2dGeometry;
use crate::kernels::isa::{Isa, uses};

/// Floats per vector.
const LANES: usize = 16;
/// Vectors of sums per block: independent add chains, so each add's latency is hidden.
const BLOCK: usize = 4;

/// Whether this path computes depthwise convolution `g`'s forward pass and input gradient:
/// AVX-512, stride 1 and output rows as wide as the input rows, [`strided`] or
/// [`single_vector`].
pub(super) fn applies(g: &Conv2dGeometry) -> bool {
    cfg!(target_arch = "x86_64")
        && uses(Isa::Avx512)
        && g.batch > 0
        && g.out_plane() > 0
        && ((g.stride == [1, 1] && g.output[1] == g.input[1]) || strided(g) || single_vector(g))
}

/// An input plane and an output plane of at most [`LANES`] pixels each: several samples' planes
/// of a channel per vector where they fit (2×2 maps: four), else one plane filling more than
/// half of it (a 4×4 input into a 2×2 output stays with 16 channels in the lanes).
pub(super) fn single_vector(g: &Conv2dGeometry) -> bool {
    g.in_plane() <= LANES && (g.out_plane() > LANES / 2 || slot(g) <= LANES / 2)
}

/// The lanes each sample's planes take in a vector: the larger of the two planes.
fn slot(g: &Conv2dGeometry) -> usize {
    g.in_plane().max(g.out_plane())
}

/// Per tap in weight order, for each lane of a vector of destination planes ([`slot`] lanes
/// apart), the lane of the source planes it takes (`source(dst pixel, tap)`), and the lanes
/// that have one.
fn lane_taps(
    g: &Conv2dGeometry,
    [dst, src]: [[usize; 2]; 2],
    source: impl Fn([usize; 2], [usize; 2]) -> Option<[usize; 2]>,
) -> Vec<([i32; LANES], u16)> {
    let [kh, kw] = g.kernel;
    let slot = slot(g);
    let mut taps = vec![([0i32; LANES], 0u16); kh * kw];
    for (k, (index, lanes)) in taps.iter_mut().enumerate() {
        for p in 0..dst[0] * dst[1] {
            let pixel = [p / dst[1], p % dst[1]];
            if let Some([y, x]) = source(pixel, [k / kw, k % kw]) {
                for first in (0..LANES / slot).map(|j| j * slot) {
                    index[first + p] = (first + y * src[1] + x) as i32;
                    *lanes |= 1 << (first + p);
                }
            }
        }
    }
    taps
}

/// [`single_vector`] planes: `dst[p] = Σ_k w[k] · src[index_k[p]]` over the lanes each tap
/// lets through, for [`slot`]-spaced planes of a channel's samples per vector.
fn vector_planes(
    g: &Conv2dGeometry,
    src: &[f32],
    weight: &[f32],
    [src_plane, dst_plane]: [usize; 2],
    taps: &[([i32; LANES], u16)],
) -> Vec<f32> {
    assert!(src.len() == g.batch * g.c_in * src_plane && weight.len() == g.c_in * taps.len());
    // Samples per vector, and per task (a vector of planes is a few dozen cycles).
    let group = LANES / slot(g);
    let per_task = group * (2048 / (g.c_in * group)).max(1);
    let sample = g.c_in * dst_plane;
    // SAFETY: the tasks' samples cover the output, and `vector_planes` writes each of them.
    unsafe {
        super::written_whole(g.batch * sample, |dst| {
            dst.par_chunks_mut(sample * per_task)
                .enumerate()
                .for_each(|(task, dst)| {
                    let samples = task * per_task..task * per_task + dst.len() / sample;
                    // SAFETY: `applies` checked AVX-512; the planes fit their slots.
                    #[cfg(target_arch = "x86_64")]
                    tiles::vector_planes(
                        g,
                        src,
                        dst,
                        weight,
                        [src_plane, dst_plane],
                        samples,
                        taps,
                    );
                    #[cfg(not(target_arch = "x86_64"))]
                    unreachable!("{dst:?} {samples:?}: AVX-512 only");
                })
        })
    }
}

/// Stride 2 under a 3×3 kernel with padding 1, output rows of at most [`LANES`] pixels from
/// input rows of at most 2·[`LANES`].
fn strided(g: &Conv2dGeometry) -> bool {
    g.stride == [2, 2]
        && g.kernel == [3, 3]
        && g.pad_begin == [1, 1]
        && g.output[1] <= LANES
        && g.input[1] <= 2 * LANES
        && g.in_plane() > 0
}

/// Per tap `(ky, kx)` in weight order, the shift from an output pixel to the input pixel it
/// reads: `(ky − pt, kx − pl)`.
fn shifts(g: &Conv2dGeometry) -> Vec<[isize; 2]> {
    let [kh, kw] = g.kernel;
    let [pt, pl] = g.pad_begin.map(|p| p as isize);
    (0..kh * kw)
        .map(|k| [(k / kw) as isize - pt, (k % kw) as isize - pl])
        .collect()
}

/// The gather of `dst[p] = Σ_k w[k] · src[p + d_k]` over `[rows, cols]` planes as wide as each
/// other: per tap, `d_k` (`shifts[k]` flattened), and per vector of a `dst` plane (rounded up
/// to whole blocks, the extra ones empty) and tap, the lanes whose source pixel lies in `src`.
fn gather_taps(shifts: &[[isize; 2]], dst: [usize; 2], src: [usize; 2]) -> (Vec<isize>, Vec<u16>) {
    let (taps, cols) = (shifts.len(), dst[1]);
    let offsets = shifts.iter().map(|&[y, x]| y * cols as isize + x).collect();
    let pixels = dst[0] * cols;
    let mut masks = vec![0u16; pixels.div_ceil(LANES).next_multiple_of(BLOCK) * taps];
    for (k, &[sy, sx]) in shifts.iter().enumerate() {
        for p in 0..pixels {
            let (y, x) = ((p / cols) as isize + sy, (p % cols) as isize + sx);
            if (0..src[0] as isize).contains(&y) && (0..src[1] as isize).contains(&x) {
                masks[(p / LANES) * taps + k] |= 1 << (p % LANES);
            }
        }
    }
    (offsets, masks)
}

/// Depthwise forward pass (no bias), the same bits as `depthwise::forward_by`.
pub(super) fn forward(g: &Conv2dGeometry, x: &[f32], weight: &[f32]) -> Vec<f32> {
    if single_vector(g) {
        let ([pt, pl], [sh, sw]) = (g.pad_begin, g.stride);
        let taps = lane_taps(g, [g.output, g.input], |[oy, ox], [ky, kx]| {
            let [iy, ix] = [
                (oy * sh + ky).wrapping_sub(pt),
                (ox * sw + kx).wrapping_sub(pl),
            ];
            (iy < g.input[0] && ix < g.input[1]).then_some([iy, ix])
        });
        return vector_planes(g, x, weight, [g.in_plane(), g.out_plane()], &taps);
    }
    if strided(g) {
        // SAFETY (in `each_plane`'s call): `applies` checked AVX-512 and `strided` the shapes.
        #[cfg(target_arch = "x86_64")]
        return each_plane(
            g,
            x,
            weight,
            g.in_plane(),
            g.out_plane(),
            |src, dst, w| unsafe { tiles::stride_two_forward(g, src, dst, w) },
        );
    }
    let (offsets, masks) = gather_taps(&shifts(g), g.output, g.input);
    gather(g, x, weight, g.in_plane(), g.out_plane(), &offsets, &masks)
}

/// Gradient of [`forward`] with respect to its input, the same bits as
/// `depthwise::input_grad_by`: each input pixel gathers the outputs that read it, through the
/// mirrored shifts.
pub(super) fn input_grad(g: &Conv2dGeometry, weight: &[f32], dy: &[f32]) -> Vec<f32> {
    if single_vector(g) {
        let ([pt, pl], [sh, sw]) = (g.pad_begin, g.stride);
        let taps = lane_taps(g, [g.input, g.output], |[iy, ix], [ky, kx]| {
            // The output whose tap `(ky, kx)` reads this pixel, if any.
            let [py, px] = [(iy + pt).wrapping_sub(ky), (ix + pl).wrapping_sub(kx)];
            let [oy, ox] = [py / sh, px / sw];
            (py % sh == 0 && px % sw == 0 && oy < g.output[0] && ox < g.output[1])
                .then_some([oy, ox])
        });
        return vector_planes(g, dy, weight, [g.out_plane(), g.in_plane()], &taps);
    }
    if strided(g) {
        // SAFETY (in `each_plane`'s call): as in `forward`.
        #[cfg(target_arch = "x86_64")]
        return each_plane(
            g,
            dy,
            weight,
            g.out_plane(),
            g.in_plane(),
            |src, dst, w| unsafe { tiles::stride_two_input_grad(g, src, dst, w) },
        );
    }
    let mirrored: Vec<[isize; 2]> = shifts(g).iter().map(|&[y, x]| [-y, -x]).collect();
    let (offsets, masks) = gather_taps(&mirrored, g.input, g.output);
    gather(g, dy, weight, g.out_plane(), g.in_plane(), &offsets, &masks)
}

/// `dst[p] = Σ_k w[k] · src[p + offsets[k]]` over the taps `masks` lets through, per plane.
fn gather(
    g: &Conv2dGeometry,
    src: &[f32],
    weight: &[f32],
    src_plane: usize,
    dst_plane: usize,
    offsets: &[isize],
    masks: &[u16],
) -> Vec<f32> {
    each_plane(g, src, weight, src_plane, dst_plane, |src, dst, w| {
        // (Unsafe, in `each_plane`'s call.) `applies` checked AVX-512; the masks were built for
        // these planes' shapes and offsets.
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as just said.
        unsafe {
            tiles::plane(src, dst, w, offsets, masks)
        };
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("{dst:?} {src:?} {w:?} {offsets:?} {masks:?}: AVX-512 only");
    })
}

/// `plane(src, dst, w)` for every (sample, channel) plane, `w` the channel's taps; `plane`
/// writes all of `dst`.
fn each_plane(
    g: &Conv2dGeometry,
    src: &[f32],
    weight: &[f32],
    src_plane: usize,
    dst_plane: usize,
    plane: impl Fn(&[f32], &mut [MaybeUninit<f32>], &[f32]) + Sync,
) -> Vec<f32> {
    let taps = g.kernel[0] * g.kernel[1];
    assert!(src.len() == g.batch * g.c_in * src_plane && weight.len() == g.c_in * taps);
    // Planes per task: a plane is a few hundred cycles on these maps.
    let per_task = (2048 / dst_plane).max(1);
    // SAFETY: the tasks' planes cover the output, and `plane` writes each of their elements.
    unsafe {
        super::written_whole(g.batch * g.c_in * dst_plane, |dst| {
            dst.par_chunks_mut(dst_plane * per_task)
                .zip(src.par_chunks(src_plane * per_task))
                .enumerate()
                .for_each(|(task, (dst, src))| {
                    let planes = dst
                        .chunks_exact_mut(dst_plane)
                        .zip(src.chunks_exact(src_plane));
                    for (i, (dst, src)) in planes.enumerate() {
                        let c = (task * per_task + i) % g.c_in;
                        plane(src, dst, &weight[c * taps..(c + 1) * taps]);
                    }
                })
        })
    }
}

#[cfg(target_arch = "x86_64")]
mod tiles {
    use super::{BLOCK, Conv2dGeometry, LANES, MaybeUninit};
    use crate::kernels::cpu::first_lanes;
    use crate::kernels::cpu::row_phases::{
        column_phase, load_row, next_lane, row_masks, store_interleaved,
    };
    use std::arch::x86_64::*;

    /// Channels per pass of [`vector_planes`].
    const CHAINS: usize = 4;

    /// One plane of [`super::gather`].
    ///
    /// # Safety
    /// AVX-512F; `masks` holds `taps` masks per vector of `dst` (whole blocks), each letting
    /// through only lanes `l` of vector `v` with `16v + l < dst.len()` whose source
    /// `16v + l + offsets[k]` lies in `src`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn plane(
        src: &[f32],
        dst: &mut [MaybeUninit<f32>],
        w: &[f32],
        offsets: &[isize],
        masks: &[u16],
    ) {
        let taps = offsets.len();
        let pixels = dst.len();
        let (src, out) = (src.as_ptr(), dst.as_mut_ptr().cast::<f32>());
        for first in (0..pixels.div_ceil(LANES)).step_by(BLOCK) {
            let mut acc = [_mm512_setzero_ps(); BLOCK];
            let masks = &masks[first * taps..(first + BLOCK) * taps];
            for (k, (&weight, &offset)) in w.iter().zip(offsets).enumerate() {
                let weight = _mm512_set1_ps(weight);
                for (j, acc) in acc.iter_mut().enumerate() {
                    let mask = masks[j * taps + k];
                    if mask == 0 {
                        continue;
                    }
                    let at = ((first + j) * LANES) as isize + offset;
                    // SAFETY: the mask lets through only lanes inside `src` (the contract);
                    // the others are not read.
                    let v = unsafe { _mm512_maskz_loadu_ps(mask, src.wrapping_offset(at)) };
                    *acc = _mm512_add_ps(*acc, _mm512_mul_ps(weight, v));
                }
            }
            for (j, acc) in acc.into_iter().enumerate() {
                let start = (first + j) * LANES;
                if start >= pixels {
                    break;
                }
                let lanes = super::super::first_lanes(pixels - start);
                // SAFETY: the first `pixels − start` floats from `start` lie in `dst`.
                unsafe { _mm512_mask_storeu_ps(out.wrapping_add(start), lanes, acc) };
            }
        }
    }

    /// One plane of a stride-2 3×3 depthwise forward pass (see the module docs): per output
    /// row, the taps in weight order from zero, each a multiply and an add.
    ///
    /// # Safety
    /// AVX-512F; `g` passed `strided`, `src` is one input plane, `dst` one output plane, `w`
    /// the channel's nine taps.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn stride_two_forward(
        g: &Conv2dGeometry,
        src: &[f32],
        dst: &mut [MaybeUninit<f32>],
        w: &[f32],
    ) {
        let ([h, iw], [oh, ow]) = (g.input, g.output);
        assert!(src.len() == h * iw && dst.len() == oh * ow && w.len() == 9);
        // Lane `j` of phase `kx`: input column `2j + kx − 1` (lane 0 of phase 0 is padding).
        let phases = [column_phase(-1), column_phase(0), column_phase(1)];
        let row = row_masks(iw);
        let (src, out) = (src.as_ptr(), dst.as_mut_ptr().cast::<f32>());
        for oy in 0..oh {
            let mut acc = _mm512_setzero_ps();
            for ky in 0..3 {
                // Input row `2·oy + ky − 1`; outside the plane it reads as zeros.
                let iy = (2 * oy + ky).wrapping_sub(1);
                let inside = if iy < h { row } else { [0, 0] };
                // SAFETY: input row `iy` has `iw` floats (none are read outside the plane).
                let (a, b) = unsafe { load_row(src.wrapping_add(iy.wrapping_mul(iw)), inside) };
                for kx in 0..3 {
                    let (index, lanes) = phases[kx];
                    let v = _mm512_maskz_permutex2var_ps(lanes, a, index, b);
                    let wk = _mm512_set1_ps(w[ky * 3 + kx]);
                    acc = _mm512_add_ps(acc, _mm512_mul_ps(wk, v));
                }
            }
            // SAFETY: output row `oy` has `ow` floats (the mask).
            unsafe { _mm512_mask_storeu_ps(out.add(oy * ow), first_lanes(ow), acc) };
        }
    }

    /// One plane of [`stride_two_forward`]'s input gradient: each input pixel adds, in weight
    /// order from zero, the taps of the outputs that read it (zeros for outputs outside the
    /// map, as the planes' padded gradient holds).
    ///
    /// # Safety
    /// AVX-512F; `g` passed `strided`, `src` is one output-gradient plane, `dst` one input
    /// plane, `w` the channel's nine taps.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn stride_two_input_grad(
        g: &Conv2dGeometry,
        src: &[f32],
        dst: &mut [MaybeUninit<f32>],
        w: &[f32],
    ) {
        let ([h, iw], [oh, ow]) = (g.input, g.output);
        assert!(src.len() == oh * ow && dst.len() == h * iw && w.len() == 9);
        // Output column `j + 1` into lane `j`, where it exists.
        let (lanes, next_lanes) = (first_lanes(ow), first_lanes(ow.saturating_sub(1)));
        let row = row_masks(iw);
        let (src, out) = (src.as_ptr(), dst.as_mut_ptr().cast::<f32>());
        for iy in 0..h {
            let (mut even, mut odd) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            for ky in 0..3 {
                // Output row `(iy + 1 − ky) / 2`, for the kernel rows of the right parity.
                let u = iy + 1;
                if u < ky || (u - ky) % 2 != 0 {
                    continue;
                }
                let oy = (u - ky) / 2;
                let inside = if oy < oh { lanes } else { 0 };
                // SAFETY: the mask keeps the load inside output row `oy` (none outside).
                let grad = unsafe { _mm512_maskz_loadu_ps(inside, src.wrapping_add(oy * ow)) };
                let tap = |kx: usize| _mm512_set1_ps(w[ky * 3 + kx]);
                // Input column `2·ox + kx − 1`: odd from `ox + 1` (kx 0) and `ox` (kx 2), even
                // from `ox` (kx 1); each pixel's taps stay in weight order.
                let shifted = next_lane(next_lanes, grad);
                odd = _mm512_add_ps(odd, _mm512_mul_ps(tap(0), shifted));
                even = _mm512_add_ps(even, _mm512_mul_ps(tap(1), grad));
                odd = _mm512_add_ps(odd, _mm512_mul_ps(tap(2), grad));
            }
            // SAFETY: input row `iy` has `iw` floats.
            unsafe { store_interleaved(out.add(iy * iw), row, even, odd) };
        }
    }

    /// Samples `samples` of [`super::vector_planes`] (`dst` is theirs), `LANES / slot` of
    /// them per vector, channel by channel.
    ///
    /// # Safety
    /// AVX-512F; `g` passed `single_vector`, `src` holds every sample's planes of
    /// `src_plane` floats, and `taps` index only lanes of the vector's source planes.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn vector_planes(
        g: &Conv2dGeometry,
        src: &[f32],
        dst: &mut [MaybeUninit<f32>],
        weight: &[f32],
        [src_plane, dst_plane]: [usize; 2],
        samples: std::ops::Range<usize>,
        taps: &[([i32; LANES], u16)],
    ) {
        let (c_in, slot) = (g.c_in, super::slot(g));
        assert!(src_plane.max(dst_plane) == slot && slot <= LANES);
        assert!(src.len() == g.batch * c_in * src_plane && samples.end <= g.batch);
        assert!(dst.len() == samples.len() * c_in * dst_plane && weight.len() == c_in * taps.len());
        let (load, store) = (first_lanes(src_plane), first_lanes(dst_plane));
        let (src, out) = (src.as_ptr(), dst.as_mut_ptr().cast::<f32>());
        for first in samples.clone().step_by(LANES / slot) {
            let count = (samples.end - first).min(LANES / slot);
            // Four channels at a time: four independent chains of adds (one chain per vector
            // waited on each add's latency, 10% slower on 4×4 maps).
            for c0 in (0..c_in).step_by(CHAINS) {
                let channels = (c_in - c0).min(CHAINS);
                // Sample `first + j`'s plane of channel `c0 + b` in lanes `j·slot ..` of `x[b]`.
                let mut x = [_mm512_setzero_ps(); CHAINS];
                for (b, x) in x.iter_mut().enumerate().take(channels) {
                    for j in 0..count {
                        let at = ((first + j) * c_in + c0 + b) * src_plane;
                        // SAFETY: the lanes read the `src_plane` floats at `at`.
                        *x = unsafe {
                            _mm512_mask_loadu_ps(
                                *x,
                                load << (j * slot),
                                src.add(at).wrapping_sub(j * slot),
                            )
                        };
                    }
                }
                let mut acc = [_mm512_setzero_ps(); CHAINS];
                for (k, (index, lanes)) in taps.iter().enumerate() {
                    if *lanes == 0 {
                        continue;
                    }
                    // SAFETY: 16 readable `i32`s.
                    let index = unsafe { _mm512_loadu_si512(index.as_ptr().cast()) };
                    for (b, (acc, x)) in acc.iter_mut().zip(x).enumerate() {
                        // Missing channels (past `c_in`) compute on zeros, never stored.
                        let wk = weight[(c0 + b).min(c_in - 1) * taps.len() + k];
                        let v = _mm512_maskz_permutexvar_ps(*lanes, index, x);
                        *acc = _mm512_add_ps(*acc, _mm512_mul_ps(_mm512_set1_ps(wk), v));
                    }
                }
                for (b, acc) in acc.into_iter().enumerate().take(channels) {
                    for j in 0..count {
                        let at = ((first + j - samples.start) * c_in + c0 + b) * dst_plane;
                        // SAFETY: the lanes write the `dst_plane` floats at `at`, in `dst`.
                        unsafe {
                            _mm512_mask_storeu_ps(
                                out.add(at).wrapping_sub(j * slot),
                                store << (j * slot),
                                acc,
                            )
                        };
                    }
                }
            }
        }
    }
}
