//! The direct kernels' weight gradient under 5×5 kernels on maps up to 16×16 (CNN1–CNN3's
//! 16×16, 14×14 and 8×8 maps, CNN4's 14×14), bit for bit, without the products it spends on
//! nothing.
//!
//! `direct.rs` sums `dW[co, k]` over the "wide" output positions `q = oy·Wp + ox` (rows as long
//! as the padded input's, `Wp = ow + kw − 1`) in 16-float vectors: lane `l` chains, sample by
//! sample of an 8-sample chunk, the products at `q ≡ l (mod 16)` in ascending order, and the 16
//! lanes are then added by `_mm512_reduce_add_ps`'s tree (`l` with `l + 8`, then `+ 4`, `+ 2`,
//! `+ 1`). On an 8×8 map under a 5×5 kernel a third of those positions are thrown-away columns
//! (a zero output gradient) and 28% of the rest read the zero padding: half the products are
//! zeros. This kernel computes the same 16 chains per element with the output channels in the
//! vector instead, visiting only real pixels whose tap reads the image, then adds them with the
//! same tree. A skipped product is a zero added to a chain that starts at +0 and so is never −0:
//! skipping it changes no bit (with finite inputs).

use super::{Conv2dGeometry, chunk_bias_grad, sum_over_chunks};
use crate::kernels::isa::{Isa, uses};

/// Output channels per register tile: four vectors.
const CHANNEL_TILE: usize = 64;
/// Lanes of the direct kernel's vectors: the number of chains per element.
const LANES: usize = 16;
/// The kernel width this kernel takes: one kernel row of taps per register tile.
const KERNEL_WIDTH: usize = 5;
/// The largest map (16×16).
const MAX_PIXELS: usize = 256;

/// Whether [`weight_grad`] computes `g`'s weight gradient: a layer on the direct kernels with
/// 5-wide kernels (a kernel row of taps per register tile) on maps up to 16×16, where the wide
/// rows and the padding waste 1.46× (16×16) to 2.08× (8×8) of the products, and output channels
/// in whole tiles. Under 3×3 kernels (1.25–1.49× on 8×8 to 16×16 maps) the direct kernel is
/// faster (`fl bench --kernels`, one thread: 56–70 against 73–94 GFLOP/s).
pub(super) fn applies(g: &Conv2dGeometry) -> bool {
    cfg!(target_arch = "x86_64")
        && crate::kernels::direct::applies(g)
        && g.kernel[1] == KERNEL_WIDTH
        && g.out_plane() <= MAX_PIXELS
        && g.c_out.is_multiple_of(CHANNEL_TILE)
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
    sum_over_chunks(g.batch, |samples| chunk(g, x, dy, &classes, samples))
}

/// The weight and bias gradients of some consecutive samples.
fn chunk(
    g: &Conv2dGeometry,
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
    // Output gradients channel-minor, `[sample][pixel][c_out]`: a pixel's channels are vectors.
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
    // `[tap][c_out]`, then back to the weight's `[c_out][tap]`.
    let mut dw_t = vec![0.0f32; taps * g.c_out];
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `applies` checked AVX-512F, a 5-wide kernel and whole channel tiles; the
    // buffers are sized from `g` above.
    unsafe {
        let args = avx512::Chunk {
            g,
            count: samples.len(),
            x,
            dy_t: &dy_t,
            classes,
        };
        for co0 in (0..g.c_out).step_by(CHANNEL_TILE) {
            for ci in 0..g.c_in {
                for ky in 0..g.kernel[0] {
                    avx512::kernel_row::<KERNEL_WIDTH>(&args, [co0, ci, ky], &mut dw_t);
                }
            }
        }
    }
    let mut dw = vec![0.0f32; taps * g.c_out];
    for (co, row) in dw.chunks_exact_mut(taps).enumerate() {
        for (k, v) in row.iter_mut().enumerate() {
            *v = dw_t[k * g.c_out + co];
        }
    }
    (dw, db)
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{CHANNEL_TILE, Conv2dGeometry, LANES};
    use std::arch::x86_64::*;

    const VECTORS: usize = CHANNEL_TILE / 16;

    /// One chunk of samples: `count` inputs, their output gradients `[count][out_plane][c_out]`
    /// and the output pixels of each lane class.
    pub(super) struct Chunk<'a> {
        pub(super) g: &'a Conv2dGeometry,
        pub(super) count: usize,
        pub(super) x: &'a [f32],
        pub(super) dy_t: &'a [f32],
        pub(super) classes: &'a [Vec<[usize; 2]>],
    }

    /// `dw_t[(ci, ky, kx), co0..co0 + 64]` for every `kx`: per lane class, a chain over the
    /// chunk's samples and the class's pixels whose tap reads the image, then the 16 chains
    /// added by `_mm512_reduce_add_ps`'s tree.
    ///
    /// # Safety
    /// AVX-512F; `KW == g.kernel[1]`; `x` holds `count` samples, `dy_t` their output gradients
    /// `[count][out_plane][c_out]`, `dw_t` `c_in·kh·kw · c_out` floats, `co0 + 64 <= c_out`,
    /// `ci < c_in`, `ky < kh`, and `classes` lists pixels inside the output.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn kernel_row<const KW: usize>(
        chunk: &Chunk,
        [co0, ci, ky]: [usize; 3],
        dw_t: &mut [f32],
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
        assert!(dw_t.len() >= g.col_rows() * g.c_out);
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
            // The lanes' tree, for every vector of channels and tap at once.
            let add = |a: &[[__m512; KW]; VECTORS], b: &[[__m512; KW]; VECTORS]| {
                std::array::from_fn(|v| std::array::from_fn(|t| _mm512_add_ps(a[v][t], b[v][t])))
            };
            let s: [[[__m512; KW]; VECTORS]; 8] =
                std::array::from_fn(|i| add(&lanes[i], &lanes[i + 8]));
            let s: [[[__m512; KW]; VECTORS]; 4] = std::array::from_fn(|i| add(&s[i], &s[i + 4]));
            let s: [[[__m512; KW]; VECTORS]; 2] = std::array::from_fn(|i| add(&s[i], &s[i + 2]));
            let total = add(&s[0], &s[1]);
            let row = (ci * g.kernel[0] + ky) * KW;
            for (v, taps) in total.iter().enumerate() {
                for (kx, sum) in taps.iter().enumerate() {
                    let at = (row + kx) * g.c_out + co0 + v * 16;
                    _mm512_storeu_ps(dw_t.as_mut_ptr().add(at), *sum);
                }
            }
        }
    }
}
