//! The direct kernels' input gradient gathered: each input pixel vector sums its taps in
//! registers, reading a zero-bordered copy of the output gradient, and is stored once.
//!
//! The wide kernels (`scatter_wide` in `direct.rs`) add each tap's sum over `co` (a chain from
//! +0 in channel order) onto a zeroed padded input gradient, tap after tap, and leave out the
//! taps whose output is not in the map. Here every element receives the same chains in the same
//! order; the taps that read the zero border add a chain of zero products, +0 with finite
//! weights, and adding +0 to a total that started at +0 (so is never −0) changes no bit. No
//! padded input gradient, no read-modify-write of it per tap (a sixth of the scatter kernel's
//! time on ResNet-20), and no copy out of it; but every input pixel computes every tap, so
//! [`worth_it`] keeps the scatter where the border is wide (unpadded 5×5 layers).

use super::rows::RowVectors;
use super::{LANES, pack_input_tiles};
use crate::kernels::cpu::{Aligned, Conv2dGeometry};
use rayon::prelude::*;

/// Input channels per register tile of [`input_grad`]. On AVX-512 a tile is these eight
/// channels × two pixel vectors: sixteen tap chains in registers, and sixteen running totals
/// that the compiler keeps partly on the stack (touched once per tap). With one pixel vector
/// (eight chains, each output-gradient load feeding eight multiply-adds and each weight
/// broadcast one) the input gradient ran 8–30% slower on ResNet-20's 32×32 and 16×16 layers,
/// VGG-16's first two blocks and CNN4's 32×32 and 28×28 layers; three vectors fell between
/// (`fl bench --kernels --threads 1`, fifty-second session).
const INPUT_TILE: usize = 8;

/// Whether gathering computes at most a tenth more vector lanes than the scatter would:
/// `scatter_lanes` (its pixel vectors' lanes per channel) times its input channels padded to its
/// tile, `scatter_channels`. On 32×32, 16×16 and 14×14 maps under "same" padding both compute
/// the same lanes, on 28×28 ones the gather 6% more (and runs faster); an unpadded 5×5 layer
/// on 14×14 would gather twice the lanes (measured: 40% slower).
pub(super) fn worth_it(g: &Conv2dGeometry, scatter_lanes: usize, scatter_channels: usize) -> bool {
    let [h, w] = g.input;
    // Counted in 16-lane vectors on both tiers: AVX2's 8-lane ones would gather the 8×8 and
    // 7×7 maps in fewer lanes than the scatter, but ran 15–35% slower there wherever the output
    // gradient's planes outgrow L1 (128 and 256 channels; within noise at 64).
    let lanes = h * w.next_multiple_of(LANES) * g.c_in.next_multiple_of(INPUT_TILE);
    10 * lanes <= 11 * scatter_lanes * scatter_channels
}

/// `Σ_co W[co, ci, ky, kx] · dy[co, pixel − (ky, kx)]` tap by tap for every input pixel, the
/// same contract and bits as the wide kernels' input gradient (see the module doc).
pub(super) fn input_grad(g: &Conv2dGeometry, weight: &[f32], dy: &[f32]) -> Vec<f32> {
    let packed = pack_input_tiles(g, weight, INPUT_TILE);
    let border = Border::new(g);
    let vectors = border.input_vectors(g);
    let fill = |dx: &mut [std::mem::MaybeUninit<f32>]| {
        dx.par_chunks_mut(g.input_len())
            .zip(dy.par_chunks(g.output_len()))
            .for_each_init(
                || Aligned::zeroed(border.len(g.c_out)),
                |bordered, (dx_n, dy_n)| {
                    border.copy(g, dy_n, bordered);
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: `direct::applies` checked the tier; the kernel asserts the
                    // buffers' lengths.
                    unsafe {
                        let args = (g, &border, &bordered[..], &packed[..]);
                        // AVX-512: eight channels × two vectors (see `INPUT_TILE`). AVX2: four
                        // channels × two 8-lane vectors at a time (8 of its 16 registers for
                        // the chains; the running totals wait in memory between taps).
                        if super::avx512() {
                            tiles::gather_avx512::<INPUT_TILE, INPUT_TILE, 2>(args, &vectors, dx_n)
                        } else {
                            tiles::gather_avx2::<INPUT_TILE, 4, 2>(args, &vectors, dx_n)
                        }
                    };
                    #[cfg(not(target_arch = "x86_64"))]
                    unreachable!("direct convolution is only used on x86-64");
                },
            )
    };
    // SAFETY: each sample's chunk is stored whole: the input vectors cover each row of every
    // channel (prefix-masked stores, plain ones on AVX2, which read nothing).
    unsafe { crate::kernels::cpu::written_whole(g.batch * g.input_len(), fill) }
}

/// An output gradient with a zero border: `kh − 1` rows above and below each `[oh, ow]` plane
/// and `kw − 1` columns on each side, so that every tap of every input pixel (and of the lanes
/// past a row's end, which are never stored) reads inside the buffer, zeros where it has no
/// output.
struct Border {
    /// Floats per bordered row.
    stride: usize,
    /// Floats per bordered plane.
    plane: usize,
    /// Where output `(0, 0)` sits in a plane.
    origin: usize,
}

impl Border {
    fn new(g: &Conv2dGeometry) -> Self {
        let ([oh, ow], [kh, kw]) = (g.output, g.kernel);
        let stride = ow + 2 * (kw - 1);
        // An odd number of cache lines per plane: a tap reads the same spot of every plane,
        // and planes a power of two apart (4 KiB on 28×28 maps) would share one L1 set.
        let lines = ((oh + 2 * (kh - 1)) * stride).div_ceil(LANES) | 1;
        Border {
            stride,
            plane: lines * LANES,
            origin: (kh - 1) * stride + kw - 1,
        }
    }

    /// Buffer length for `c_out` planes, with a vector's slack after the last.
    fn len(&self, c_out: usize) -> usize {
        c_out * self.plane + LANES
    }

    /// Copies one sample's output gradient `[c_out, oh, ow]` in. Writes only the values: the
    /// border must already be zero, as in a buffer zeroed once and written only by this.
    fn copy(&self, g: &Conv2dGeometry, dy_n: &[f32], buf: &mut [f32]) {
        let [oh, ow] = g.output;
        for (co, src) in dy_n.chunks_exact(oh * ow).enumerate() {
            for (oy, row) in src.chunks_exact(ow).enumerate() {
                buf[co * self.plane + self.origin + oy * self.stride..][..ow].copy_from_slice(row);
            }
        }
    }

    /// The input's pixel vectors ([`RowVectors`]), each starting where its tap `(0, 0)` reads:
    /// pixel `(iy, ix)` reads output `(iy + ph − ky, ix + pw − kx)` at tap `(ky, kx)`, so tap
    /// `(ky, kx)` reads `ky·stride + kx` floats before.
    fn input_vectors(&self, g: &Conv2dGeometry) -> RowVectors {
        let [ph, pw] = g.pad_begin;
        RowVectors::new(g.input, |iy, x0| {
            self.origin + (iy + ph) * self.stride + x0 + pw
        })
    }
}

#[cfg(target_arch = "x86_64")]
mod tiles {
    use super::{Border, Conv2dGeometry, LANES, RowVectors};
    use crate::kernels::lanes16::Lanes;

    /// [`input_grad`](super::input_grad) for one sample, every input-channel tile of `C`
    /// (`R` channels × `P` pixel vectors at a time, then single vectors): per tap a chain over
    /// the output channels from +0, added onto a running total from +0, then stored masked to
    /// the vector's pixels into `dx` `[c_in, h, w]`, every element of which it writes (prefix
    /// masks: plain stores on AVX2, so nothing uninitialised is read).
    ///
    /// # Safety
    /// The CPU supports `V`'s tier; `R` divides `C`; `packed` is the weights as `input_grad`
    /// packs them for tiles of `C`, `bordered` one sample's output gradient as `border` lays it
    /// out, and `vectors` `border`'s input vectors of `g`, built for `V`'s width.
    #[inline(always)]
    unsafe fn gather<V: Lanes, const C: usize, const R: usize, const P: usize>(
        args: (&Conv2dGeometry, &Border, &[f32], &[f32]),
        vectors: &RowVectors,
        dx: &mut [std::mem::MaybeUninit<f32>],
    ) {
        let (g, border, bordered, packed) = args;
        let ([h, w], [kh, kw], c_out) = (g.input, g.kernel, g.c_out);
        let taps = kh * kw;
        let c_in_padded = g.c_in.next_multiple_of(C);
        assert!(packed.len() >= c_in_padded * taps * c_out && dx.len() >= g.c_in * h * w);
        let furthest = vectors.starts.iter().max().copied().unwrap_or(0);
        let planes = c_out.saturating_sub(1);
        assert!(bordered.len() >= planes * border.plane + furthest + LANES);
        let nearest = vectors.starts.iter().min().copied().unwrap_or(usize::MAX);
        assert!(nearest >= (kh - 1) * border.stride + kw - 1);
        let lanes = |mask: u16| (u16::BITS - mask.leading_zeros()) as usize;
        let stores = vectors.dest.iter().zip(&vectors.masks);
        assert!(stores.clone().all(|(&d, &m)| d + lanes(m) <= h * w));
        // Vectors built for a wider unit would leave lanes unwritten.
        assert_eq!(vectors.unit, V::WIDTH, "row vectors of another width");
        let count = vectors.starts.len();
        let main = count - count % P;
        // SAFETY: the asserts bound every access: tap `(ky, kx)` of a vector reads `V::WIDTH`
        // floats from `co·plane + start − ky·stride − kx >= co·plane`, up to the furthest
        // start plus a vector, within `bordered`; the stores are masked to the vector's pixels,
        // within `h·w`, in channels `< c_in`.
        unsafe {
            for block in 0..c_in_padded / C {
                for first in (0..C).step_by(R) {
                    let channel = block * C + first;
                    if channel >= g.c_in {
                        break;
                    }
                    let tile = (block, first, (g.c_in - channel).min(R));
                    for i in (0..main).step_by(P) {
                        gather_tile::<V, C, R, P>(args, vectors, tile, i, dx);
                    }
                    for i in main..count {
                        gather_tile::<V, C, R, 1>(args, vectors, tile, i, dx);
                    }
                }
            }
        }
    }

    /// One register tile of [`gather`]: channels `first..first + R` of input-channel block
    /// `block` (the first `live` of them stored) at the vectors `i..i + P`.
    ///
    /// # Safety
    /// As [`gather`]'s, whose asserts hold; `i + P <= vectors.starts.len()`.
    #[inline(always)]
    unsafe fn gather_tile<V: Lanes, const C: usize, const R: usize, const P: usize>(
        (g, border, bordered, packed): (&Conv2dGeometry, &Border, &[f32], &[f32]),
        vectors: &RowVectors,
        (block, first, live): (usize, usize, usize),
        i: usize,
        dx: &mut [std::mem::MaybeUninit<f32>],
    ) {
        let ([h, w], [kh, kw], c_out) = (g.input, g.kernel, g.c_out);
        let taps = kh * kw;
        // SAFETY: the caller upholds this function's contract.
        unsafe {
            let (d, out) = (bordered.as_ptr(), dx.as_mut_ptr().cast::<f32>());
            let reads: [usize; P] = std::array::from_fn(|v| vectors.starts[i + v]);
            let mut total = [[V::zero(); P]; R];
            for k in 0..taps {
                let shift = k / kw * border.stride + k % kw;
                let srcs: [*const f32; P] = std::array::from_fn(|v| d.add(reads[v] - shift));
                let wk = packed.as_ptr().add((block * taps + k) * c_out * C + first);
                let mut acc = [[V::zero(); P]; R];
                for co in 0..c_out {
                    let plane = co * border.plane;
                    let dv: [V; P] = std::array::from_fn(|v| V::load(srcs[v].add(plane)));
                    let wc = wk.add(co * C);
                    for (c, a) in acc.iter_mut().enumerate() {
                        let wv = V::splat(*wc.add(c));
                        for v in 0..P {
                            a[v] = wv.mul_add(dv[v], a[v]);
                        }
                    }
                }
                for (t, a) in total.iter_mut().zip(&acc) {
                    for v in 0..P {
                        t[v] = t[v].add(a[v]);
                    }
                }
            }
            let channel = block * C + first;
            for (c, sums) in total.iter().enumerate().take(live) {
                for (v, sum) in sums.iter().enumerate() {
                    let (at, mask) = (vectors.dest[i + v], vectors.masks[i + v]);
                    sum.store_masked(out.add((channel + c) * h * w + at), mask);
                }
            }
        }
    }

    crate::kernels::lanes16::tier_entries! {
        gather_avx512, gather_avx2 as std::arch::x86_64::__m256 =>
            gather<const C, const R, const P>(
                args: (&Conv2dGeometry, &Border, &[f32], &[f32]),
                vectors: &RowVectors,
                dx: &mut [std::mem::MaybeUninit<f32>],
            )
    }
}
