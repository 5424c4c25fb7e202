//! The direct kernels' weight gradient on small maps under 5×5 and 3×3 kernels, bit for bit,
//! without most of the products it spends on nothing.
//!
//! `direct.rs` sums `dW[co, k]` over the "wide" output positions `q = oy·Wp + ox` (rows as long
//! as the padded input's, `Wp = ow + kw − 1`) in 16-float vectors: lane `l` chains, sample by
//! sample of an 8-sample chunk, the products at `q ≡ l (mod 16)` in ascending order, and the 16
//! lanes are then added by `_mm512_reduce_add_ps`'s tree (`l` with `l + 8`, then `+ 4`, `+ 2`,
//! `+ 1`). On an 8×8 map under a 5×5 kernel a third of those positions are thrown-away columns
//! (a zero output gradient) and 28% of the rest read the zero padding: half the products are
//! zeros. These kernels compute the same 16 chains per element with the output channels in the
//! vector instead, visiting only real pixels, then add them with the same tree. A zero product
//! added to a chain that starts at +0 (and so is never −0) changes no bit (with finite inputs):
//! the 5×5 kernel also skips the taps that read the padding; the 3×3 kernel reads a zero-padded
//! copy of the input instead, so that its 9 taps per pixel run without a branch.

use super::{Conv2dGeometry, chunk_bias_grad, sum_over_chunks};
use crate::kernels::direct::Wide;
use crate::kernels::isa::{Isa, uses};

/// Output channels per register tile under 5-wide kernels: four vectors.
const CHANNEL_TILE: usize = 64;
/// Output channels per register tile under 3×3 kernels: two vectors (× 9 taps).
const CHANNEL_TILE_3X3: usize = 32;
/// Lanes of the direct kernel's vectors: the number of chains per element.
const LANES: usize = 16;
/// The kernel width this kernel takes: one kernel row of taps per register tile.
const KERNEL_WIDTH: usize = 5;
/// The largest map (16×16).
const MAX_PIXELS: usize = 256;

/// Whether [`weight_grad`] computes `g`'s weight gradient: a layer on the direct kernels with
/// 5-wide kernels (a kernel row of taps per register tile) or 3×3 kernels (all nine taps per
/// tile) on maps up to 16×16, where the wide rows and the padding waste 1.46× (16×16) to 2.08×
/// (8×8) of the products under 5×5 kernels and 1.25× to 1.6× (7×7) under 3×3 ones, and output
/// channels in whole tiles.
pub(super) fn applies(g: &Conv2dGeometry) -> bool {
    let tile = match g.kernel {
        [3, 3] => CHANNEL_TILE_3X3,
        [_, KERNEL_WIDTH] => CHANNEL_TILE,
        _ => return false,
    };
    cfg!(target_arch = "x86_64")
        && crate::kernels::direct::applies(g)
        && g.out_plane() <= MAX_PIXELS
        && g.c_out.is_multiple_of(tile)
        && uses(Isa::Avx512)
}

/// Weight and bias gradients, the same contract and bits as the direct kernels'.
pub(super) fn weight_grad(g: &Conv2dGeometry, x: &[f32], dy: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let [oh, ow] = g.output;
    let wp = ow + g.kernel[1] - 1;
    // Each lane's real output pixels, in ascending wide position.
    let mut classes: Vec<Vec<[usize; 2]>> = vec![Vec::new(); LANES];
    for oy in 0..oh {
        for ox in 0..ow {
            classes[(oy * wp + ox) % LANES].push([oy, ox]);
        }
    }
    // The 3×3 kernel reads zero-padded copies of the inputs, in the direct kernels' layout.
    let wide = (g.kernel == [3, 3]).then(|| Wide::new(g));
    sum_over_chunks(g.batch, |samples| {
        chunk(g, wide.as_ref(), x, dy, &classes, samples)
    })
}

/// The weight and bias gradients of some consecutive samples.
fn chunk(
    g: &Conv2dGeometry,
    wide: Option<&Wide>,
    x: &[f32],
    dy: &[f32],
    classes: &[Vec<[usize; 2]>],
    samples: std::ops::Range<usize>,
) -> (Vec<f32>, Vec<f32>) {
    let (pixels, taps) = (g.out_plane(), g.col_rows());
    let x = &x[samples.start * g.input_len()..samples.end * g.input_len()];
    let dy = &dy[samples.start * g.output_len()..samples.end * g.output_len()];
    // The bias gradient exactly as the direct kernels sum it.
    let db = chunk_bias_grad(dy, g.c_out, pixels);
    let mut dw = vec![0.0f32; g.c_out * taps];
    let count = samples.len();
    let dy_t = match wide {
        Some(_) => class_streams(g, dy, classes, count),
        None => channel_minor(g, dy),
    };
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `applies` checked AVX-512F, a 3×3 or 5-wide kernel and whole channel tiles; the
    // buffers are sized from `g` and `wide` above and below.
    unsafe {
        if let Some(wide) = wide {
            let padded = wide.pad_inputs(x, g.input_len(), count);
            // Per class, the padded-input offset of each (sample, pixel) in chain order.
            let wp = wide.padded[1];
            let reads: Vec<Vec<usize>> = classes
                .iter()
                .map(|class| {
                    (0..count)
                        .flat_map(|n| class.iter().map(move |&[oy, ox]| (n, oy * wp + ox)))
                        .map(|(n, at)| n * wide.input_len + at)
                        .collect()
                })
                .collect();
            let args = avx512::Padded {
                g,
                wide,
                count,
                padded: &padded,
                dy_t: &dy_t,
                reads: &reads,
            };
            // Input channels outermost: a channel's padded planes stay in L1 while the output
            // gradients stream past them.
            for ci in 0..g.c_in {
                for co0 in (0..g.c_out).step_by(CHANNEL_TILE_3X3) {
                    avx512::taps_3x3(&args, [co0, ci], &mut dw);
                }
            }
        } else {
            let args = avx512::Chunk {
                g,
                count,
                x,
                dy_t: &dy_t,
                classes,
            };
            for co0 in (0..g.c_out).step_by(CHANNEL_TILE) {
                for ci in 0..g.c_in {
                    for ky in 0..g.kernel[0] {
                        avx512::kernel_row::<KERNEL_WIDTH>(&args, [co0, ci, ky], &mut dw);
                    }
                }
            }
        }
    }
    (dw, db)
}

/// Output gradients channel-minor, `[sample][pixel][c_out]`: a pixel's channels are vectors.
pub(super) fn channel_minor(g: &Conv2dGeometry, dy: &[f32]) -> Vec<f32> {
    let pixels = g.out_plane();
    let mut dy_t = vec![0.0f32; dy.len()];
    for (src, dst) in dy
        .chunks(g.output_len())
        .zip(dy_t.chunks_mut(g.output_len()))
    {
        for (co, plane) in src.chunks(pixels).enumerate() {
            for (p, &v) in plane.iter().enumerate() {
                dst[p * g.c_out + co] = v;
            }
        }
    }
    dy_t
}

/// Output gradients in the order the 3×3 kernel reads them, one contiguous stream per channel
/// tile and lane class: `[channel tile][class][sample][pixel of the class][32 channels]`.
fn class_streams(
    g: &Conv2dGeometry,
    dy: &[f32],
    classes: &[Vec<[usize; 2]>],
    count: usize,
) -> Vec<f32> {
    let (pixels, ow) = (g.out_plane(), g.output[1]);
    let tile_len = count * pixels * CHANNEL_TILE_3X3;
    let mut streams = vec![0.0f32; dy.len()];
    for (n, src) in dy.chunks(g.output_len()).enumerate() {
        let mut start = 0;
        for class in classes {
            for (j, &[oy, ox]) in class.iter().enumerate() {
                let p = oy * ow + ox;
                let slot = (count * start + n * class.len() + j) * CHANNEL_TILE_3X3;
                for (tile, dst) in streams.chunks_exact_mut(tile_len).enumerate() {
                    let dst = &mut dst[slot..slot + CHANNEL_TILE_3X3];
                    for (c, v) in dst.iter_mut().enumerate() {
                        *v = src[(tile * CHANNEL_TILE_3X3 + c) * pixels + p];
                    }
                }
            }
            start += class.len();
        }
    }
    streams
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx512 {
    use super::{CHANNEL_TILE, CHANNEL_TILE_3X3, Conv2dGeometry, LANES, Wide};
    use std::arch::x86_64::*;

    const VECTORS: usize = CHANNEL_TILE / 16;

    /// One register tile's 16 lane chains: `[lane][channel vector][tap]`.
    type Lanes<const V: usize, const T: usize> = [[[__m512; T]; V]; LANES];

    /// Adds the 16 chains of every element by `_mm512_reduce_add_ps`'s tree: lane `l` with
    /// `l + 8`, then `+ 4`, `+ 2`, `+ 1`, in place; the sums end in `lanes[0]`. (Loops, not
    /// `array::from_fn`: closures the compiler left un-inlined moved every partial tile through
    /// `memcpy`.)
    #[target_feature(enable = "avx512f")]
    fn lane_tree<const V: usize, const T: usize>(lanes: &mut Lanes<V, T>) -> &[[__m512; T]; V] {
        for half in [8, 4, 2, 1] {
            let (low, high) = lanes.split_at_mut(half);
            for (a, b) in low.iter_mut().zip(&high[..half]) {
                for (a, b) in a.iter_mut().zip(b) {
                    for (a, b) in a.iter_mut().zip(b) {
                        *a = _mm512_add_ps(*a, *b);
                    }
                }
            }
        }
        &lanes[0]
    }

    /// Writes a tile's sums (`total[v][t]`: channels `co0 + 16·v ..` at tap `k0 + t`) into the
    /// weight gradient's `[c_out][taps]` layout, a run of `T` taps per channel.
    ///
    /// # Safety
    /// AVX-512F; `(co0 + 16·V) · taps <= dw.len()` and `k0 + T <= taps`.
    #[target_feature(enable = "avx512f")]
    pub(in crate::kernels::cpu) unsafe fn store_tile<const V: usize, const T: usize>(
        total: &[[__m512; T]; V],
        [co0, k0, taps]: [usize; 3],
        dw: &mut [f32],
    ) {
        assert!((co0 + 16 * V) * taps <= dw.len() && k0 + T <= taps);
        let mut sums = [[0.0f32; 16]; T];
        for (v, row) in total.iter().enumerate() {
            for (sum, vector) in sums.iter_mut().zip(row) {
                // SAFETY: `sum` holds 16 floats.
                unsafe { _mm512_storeu_ps(sum.as_mut_ptr(), *vector) };
            }
            for c in 0..16 {
                let run = &mut dw[(co0 + 16 * v + c) * taps + k0..][..T];
                for (value, sum) in run.iter_mut().zip(&sums) {
                    *value = sum[c];
                }
            }
        }
    }

    /// One chunk of samples under a 3×3 kernel: `count` zero-padded inputs in `wide`'s layout,
    /// their output gradients as `class_streams` lays them out, and per lane class the offset
    /// (into `padded`) of each of its pixels' top-left taps, sample by sample.
    pub(super) struct Padded<'a> {
        pub(super) g: &'a Conv2dGeometry,
        pub(super) wide: &'a Wide,
        pub(super) count: usize,
        pub(super) padded: &'a [f32],
        pub(super) dy_t: &'a [f32],
        pub(super) reads: &'a [Vec<usize>],
    }

    /// `dw[co0..co0 + 32, (ci, ky, kx)]` for all nine taps: per lane class, a chain over the
    /// chunk's samples and the class's pixels (padding products included: they add zeros),
    /// then [`lane_tree`].
    ///
    /// # Safety
    /// AVX-512F; `g.kernel == [3, 3]`, `wide` is `g`'s layout, `padded` holds `count` padded
    /// inputs of `wide.input_len` floats, `dy_t` their output gradients in class streams,
    /// `dw` `c_out · c_in·9` floats, `co0` a multiple of 32 with `co0 + 32 <= c_out`,
    /// `ci < c_in`, and `reads` holds `n·input_len + oy·Wp + ox` for every sample `n` and
    /// output pixel `(oy, ox)`, each once.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn taps_3x3(chunk: &Padded, [co0, ci]: [usize; 2], dw: &mut [f32]) {
        const V: usize = CHANNEL_TILE_3X3 / 16;
        let Padded {
            g,
            wide,
            count,
            padded,
            dy_t,
            reads,
        } = *chunk;
        let ([hp, wp], pixels) = (wide.padded, g.out_plane());
        let offsets: [usize; 9] = std::array::from_fn(|t| ci * hp * wp + t / 3 * wp + t % 3);
        assert!(g.kernel == [3, 3] && co0 + CHANNEL_TILE_3X3 <= g.c_out && ci < g.c_in);
        assert!(co0.is_multiple_of(CHANNEL_TILE_3X3));
        assert!(
            reads.len() == LANES && reads.iter().map(Vec::len).sum::<usize>() == count * pixels
        );
        assert!(padded.len() >= count * wide.input_len && dy_t.len() >= count * g.output_len());
        assert!(dw.len() >= g.c_out * g.col_rows() && (ci + 1) * hp * wp <= wide.input_len);
        // SAFETY: the asserts bound every access: sample `n`'s pixel `(oy, ox)` reads
        // `n·input_len + oy·Wp + ox + offsets[t] < n·input_len + (ci + 1)·Hp·Wp`, within the
        // sample's padded input, and
        // the tile's stream `count·pixels·32` floats from `co0·count·pixels`, within
        // `count·c_out·pixels`.
        unsafe {
            // This tile's stream, class after class.
            let mut d = dy_t.as_ptr().add(co0 * count * pixels);
            let x = padded.as_ptr();
            // A loop, not `array::from_fn`: left un-inlined, that closure returned each class's
            // 18-register tile through memory (a `memmove` per class, 10% of this kernel).
            let zero = [[_mm512_setzero_ps(); 9]; V];
            let mut lanes: Lanes<V, 9> = [zero; LANES];
            for (lane, reads) in lanes.iter_mut().zip(reads) {
                let mut acc = zero;
                for &at in reads {
                    let dv: [__m512; V] = std::array::from_fn(|v| _mm512_loadu_ps(d.add(v * 16)));
                    d = d.add(CHANNEL_TILE_3X3);
                    let xp = x.add(at);
                    for (t, &offset) in offsets.iter().enumerate() {
                        let xb = _mm512_set1_ps(*xp.add(offset));
                        for (v, a) in acc.iter_mut().enumerate() {
                            a[t] = _mm512_fmadd_ps(dv[v], xb, a[t]);
                        }
                    }
                }
                *lane = acc;
            }
            store_tile(lane_tree(&mut lanes), [co0, ci * 9, g.col_rows()], dw);
        }
    }

    /// One chunk of samples: `count` inputs, their output gradients `[count][out_plane][c_out]`
    /// and the output pixels of each lane class.
    pub(super) struct Chunk<'a> {
        pub(super) g: &'a Conv2dGeometry,
        pub(super) count: usize,
        pub(super) x: &'a [f32],
        pub(super) dy_t: &'a [f32],
        pub(super) classes: &'a [Vec<[usize; 2]>],
    }

    /// `dw[co0..co0 + 64, (ci, ky, kx)]` for every `kx`: per lane class, a chain over the
    /// chunk's samples and the class's pixels whose tap reads the image, then the 16 chains
    /// added by `_mm512_reduce_add_ps`'s tree.
    ///
    /// # Safety
    /// AVX-512F; `KW == g.kernel[1]`; `x` holds `count` samples, `dy_t` their output gradients
    /// `[count][out_plane][c_out]`, `dw` `c_out · c_in·kh·kw` floats, `co0 + 64 <= c_out`,
    /// `ci < c_in`, `ky < kh`, and `classes` lists pixels inside the output.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn kernel_row<const KW: usize>(
        chunk: &Chunk,
        [co0, ci, ky]: [usize; 3],
        dw: &mut [f32],
    ) {
        let Chunk {
            g,
            count,
            x,
            dy_t,
            classes,
        } = *chunk;
        let ([h, w], [ph, pw], [_, ow]) = (g.input, g.pad_begin, g.output);
        assert!(KW == g.kernel[1] && co0 + CHANNEL_TILE <= g.c_out && ci < g.c_in);
        assert!(x.len() >= count * g.input_len() && dy_t.len() >= count * g.output_len());
        assert!(dw.len() >= g.c_out * g.col_rows());
        // SAFETY: the asserts bound every access; pixels and taps are checked to lie inside
        // the output and the image.
        unsafe {
            let zero = [[_mm512_setzero_ps(); KW]; VECTORS];
            let mut lanes = [zero; LANES];
            for (lane, class) in lanes.iter_mut().zip(classes) {
                let mut acc = zero;
                for n in 0..count {
                    let plane = x.as_ptr().add((n * g.c_in + ci) * h * w);
                    for &[oy, ox] in class {
                        let Some(iy) = (oy + ky).checked_sub(ph).filter(|&iy| iy < h) else {
                            continue;
                        };
                        let pixel = n * g.out_plane() + oy * ow + ox;
                        let d = dy_t.as_ptr().add(pixel * g.c_out + co0);
                        let dv: [__m512; VECTORS] =
                            std::array::from_fn(|v| _mm512_loadu_ps(d.add(v * 16)));
                        for kx in 0..KW {
                            let Some(ix) = (ox + kx).checked_sub(pw).filter(|&ix| ix < w) else {
                                continue;
                            };
                            let xb = _mm512_set1_ps(*plane.add(iy * w + ix));
                            for (v, a) in acc.iter_mut().enumerate() {
                                a[kx] = _mm512_fmadd_ps(dv[v], xb, a[kx]);
                            }
                        }
                    }
                }
                *lane = acc;
            }
            let row = (ci * g.kernel[0] + ky) * KW;
            store_tile(lane_tree(&mut lanes), [co0, row, g.col_rows()], dw);
        }
    }
}
