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
//! `depthwise.rs`'s planes.

use rayon::prelude::*;
use std::mem::MaybeUninit;

use super::Conv2dGeometry;
use crate::kernels::isa::{Isa, uses};

/// Floats per vector.
const LANES: usize = 16;
/// Vectors of sums per block: independent add chains, so each add's latency is hidden.
const BLOCK: usize = 4;

/// Whether this path computes depthwise convolution `g`'s forward pass and input gradient:
/// AVX-512, stride 1 and output rows as wide as the input rows.
pub(super) fn applies(g: &Conv2dGeometry) -> bool {
    cfg!(target_arch = "x86_64")
        && uses(Isa::Avx512)
        && g.batch > 0
        && g.stride == [1, 1]
        && g.output[1] == g.input[1]
        && g.out_plane() > 0
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
    let (offsets, masks) = gather_taps(&shifts(g), g.output, g.input);
    gather(g, x, weight, g.in_plane(), g.out_plane(), &offsets, &masks)
}

/// Gradient of [`forward`] with respect to its input, the same bits as
/// `depthwise::input_grad_by`: each input pixel gathers the outputs that read it, through the
/// mirrored shifts.
pub(super) fn input_grad(g: &Conv2dGeometry, weight: &[f32], dy: &[f32]) -> Vec<f32> {
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
    let taps = offsets.len();
    assert!(src.len() == g.batch * g.c_in * src_plane && weight.len() == g.c_in * taps);
    // Planes per task: a plane is a few hundred cycles on these maps.
    let per_task = (2048 / dst_plane).max(1);
    // SAFETY: the tasks' planes cover the output, and `tiles::plane` writes each of their
    // elements; its own contract is checked where it is called.
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
                        let w = &weight[c * taps..(c + 1) * taps];
                        // (Unsafe, in the block above.) `applies` checked AVX-512; the masks
                        // were built for these planes' shapes and offsets.
                        #[cfg(target_arch = "x86_64")]
                        tiles::plane(src, dst, w, offsets, masks);
                        #[cfg(not(target_arch = "x86_64"))]
                        unreachable!("{dst:?} {src:?} {w:?} {offsets:?} {masks:?}: AVX-512 only");
                    }
                })
        })
    }
}

#[cfg(target_arch = "x86_64")]
mod tiles {
    use super::{BLOCK, LANES, MaybeUninit};
    use std::arch::x86_64::*;

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
}
