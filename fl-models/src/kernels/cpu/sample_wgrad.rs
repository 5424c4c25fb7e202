//! Weight gradients of 5-wide kernels on maps the direct kernels leave to im2col (CNN3's 7×7
//! layer on 1×28×28 inputs), in gemm's order without the column matrix.
//!
//! The im2col path adds, sample by sample of an 8-sample chunk, one gemm product
//! `dy_n · cols_nᵀ` onto the weight gradient. On maps up to 256 pixels each output of that
//! product is a single chain of fused multiply-adds over the pixels in ascending order, from
//! +0 (one gemm depth block; no special routine takes these shapes), stored for the chunk's
//! first sample and added onto the running sum for the others. This kernel runs the same
//! chains with 64 output channels in four vectors × one kernel row of taps per register tile,
//! reading a zero-padded copy of the input instead of a column matrix. It skips the pixels whose
//! kernel row reads only the padding (17% of the products on CNN3's 7×7 layer): a zero product
//! added to a chain that starts at +0 (and so is never −0) changes no bit with finite inputs,
//! and the padding columns within a row add their zeros as gemm does. Results are the im2col
//! path's bit for bit (a test compares them).

use super::direct_wgrad::channel_minor;
use super::{ChunkBuffers, Conv2dGeometry, WeightGradArgs, chunk_bias_grad, sum_over_chunks_with};
use crate::kernels::direct::Wide;
use crate::kernels::isa::{Isa, uses};

/// Output channels per register tile: four vectors.
const CHANNEL_TILE: usize = 64;
/// The kernel width this kernel takes: one kernel row of taps per register tile.
const KERNEL_WIDTH: usize = 5;
/// The largest map: products at most this deep are one gemm depth block.
const MAX_PIXELS: usize = 256;

/// Whether [`weight_grad`] computes `g`'s weight gradient in the im2col path's order: stride-1
/// convolutions with 5-wide kernels on 17–256-pixel maps, output channels in whole tiles. The
/// caller takes it only where the im2col path would run (neither direct kernel applies).
pub(super) fn applies(g: &Conv2dGeometry) -> bool {
    cfg!(target_arch = "x86_64")
        && g.batch > 0
        && g.stride == [1, 1]
        && g.kernel[1] == KERNEL_WIDTH
        && (17..=MAX_PIXELS).contains(&g.out_plane())
        && g.c_in > 0
        && g.c_out.is_multiple_of(CHANNEL_TILE)
        && uses(Isa::Avx2)
}

/// Weight and bias gradients, the same contract and bits as the im2col path's.
pub(super) fn weight_grad((g, x, dy, bias): WeightGradArgs) -> (Vec<f32>, Vec<f32>) {
    let wide = Wide::new(g);
    // The output gradients go channel-minor, written whole by every chunk.
    sum_over_chunks_with(
        g.batch,
        || ChunkBuffers::for_chunks(g.batch, wide.input_len, g.output_len()),
        |buffers, samples| chunk((g, x, dy, bias), &wide, samples, buffers),
    )
}

/// The weight and bias gradients of some consecutive samples.
fn chunk(
    (g, x, dy, bias): WeightGradArgs,
    wide: &Wide,
    samples: std::ops::Range<usize>,
    buffers: &mut ChunkBuffers,
) -> (Vec<f32>, Vec<f32>) {
    let x = &x[samples.start * g.input_len()..samples.end * g.input_len()];
    let dy = &dy[samples.start * g.output_len()..samples.end * g.output_len()];
    let db = chunk_bias_grad(bias, dy, g.c_out, g.out_plane());
    let dy_t = &mut buffers.grads[..dy.len()];
    channel_minor(g, dy, dy_t);
    let count = samples.len();
    let padded = &mut buffers.inputs[..count * wide.input_len];
    wide.pad_inputs(x, g.input_len(), padded);
    let (dy_t, padded) = (&*dy_t, &*padded);
    let mut dw = vec![0.0f32; g.c_out * g.col_rows()];
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `applies` checked the tier, a 5-wide kernel, stride 1 and whole channel tiles;
    // the buffers are sized from `g` and `wide` above.
    unsafe {
        let args = tiles::Chunk {
            g,
            wide,
            count,
            padded,
            dy_t,
        };
        if uses(Isa::Avx512) {
            tiles::chunk_sums_avx512::<{ CHANNEL_TILE / 16 }>(&args, &mut dw);
        } else {
            // One vector of channels per register tile (16 registers of 8 lanes).
            tiles::chunk_sums_avx2::<1>(&args, &mut dw);
        }
    }
    (dw, db)
}

/// The kernel, written once over [`Lanes16`](crate::kernels::lanes16::Lanes16) and compiled
/// for each tier.
#[cfg(target_arch = "x86_64")]
mod tiles {
    use super::super::direct_wgrad::tiles::{Tile, store_tile};
    use super::{CHANNEL_TILE, Conv2dGeometry, KERNEL_WIDTH, Wide};
    use crate::kernels::lanes16::{Lanes16, tier_entries};

    tier_entries!(chunk_sums_avx512, chunk_sums_avx2 =>
        chunk_sums<const V>(chunk: &Chunk, dw: &mut [f32]));

    /// One chunk of samples: `count` zero-padded inputs in `wide`'s layout and their output
    /// gradients `[count][out_plane][c_out]`.
    pub(super) struct Chunk<'a> {
        pub(super) g: &'a Conv2dGeometry,
        pub(super) wide: &'a Wide,
        pub(super) count: usize,
        pub(super) padded: &'a [f32],
        pub(super) dy_t: &'a [f32],
    }

    /// The chunk's whole weight gradient into `dw` (`c_out · c_in·kh·5` floats): sample by
    /// sample (so a sample's output gradients stay in the L1 cache while every tile reads
    /// them), each tile's chain over the pixels stored for the first sample and added onto
    /// the tile's sum, kept in memory, for the others. Register tiles of `V` vectors of 16
    /// channels (dividing [`CHANNEL_TILE`]) × 5 taps.
    ///
    /// # Safety
    /// `L`'s tier; as [`kernel_row`], for every tile of `g`.
    #[inline(always)]
    unsafe fn chunk_sums<L: Lanes16, const V: usize>(chunk: &Chunk, dw: &mut [f32]) {
        let (g, kh) = (chunk.g, chunk.g.kernel[0]);
        assert!(V > 0 && CHANNEL_TILE.is_multiple_of(16 * V));
        let tiles = g.c_out / (16 * V);
        // In the order the loops below visit them, so the sums stream through the caches.
        // SAFETY: the tier is the caller's.
        let zero: Tile<L, V, KERNEL_WIDTH> = [[unsafe { L::zero() }; KERNEL_WIDTH]; V];
        let mut sums = vec![zero; tiles * g.c_in * kh];
        for n in 0..chunk.count {
            let mut tile = sums.iter_mut();
            for co in 0..tiles {
                // The register tile's first channel, as its stream tile and vector in it.
                let first = co * 16 * V;
                let (co0, v0) = (
                    first / CHANNEL_TILE * CHANNEL_TILE,
                    first % CHANNEL_TILE / 16,
                );
                for ci in 0..g.c_in {
                    for ky in 0..kh {
                        let sum = tile.next().expect("one tile per (co, ci, ky)");
                        // SAFETY: the caller upholds `kernel_row`'s contract for these indices.
                        unsafe { kernel_row(chunk, n, [co0, ci, ky, v0], sum) };
                    }
                }
            }
        }
        for (i, sum) in sums.iter().enumerate() {
            let (co, row) = (i / (g.c_in * kh), i % (g.c_in * kh));
            let at = [co * 16 * V, row * KERNEL_WIDTH, g.col_rows()];
            // SAFETY: `(co + 1)·16·V <= c_out` and the tile's 5 taps lie in the row.
            unsafe { store_tile(sum, at, dw) };
        }
    }

    /// Sample `n`'s chain over the pixels for `dw[co0 + 16·v0 .. + 16·V, (ci, ky, kx)]` and every
    /// `kx`, in ascending pixel order from +0 (skipping the output rows whose kernel row reads
    /// only padding): stored into `sum` for the chunk's first sample, added onto it for the
    /// others.
    ///
    /// # Safety
    /// `L`'s tier; `g.kernel[1] == 5`, stride 1, `wide` is `g`'s layout, `padded` holds
    /// `count` padded inputs of `wide.input_len` floats, `dy_t` their output gradients
    /// `[count][out_plane][c_out]`, `n < count`, `co0 + 64 <= c_out`, `16·(v0 + V) <= 64`,
    /// `ci < c_in` and `ky < kh`.
    #[inline(always)]
    unsafe fn kernel_row<L: Lanes16, const V: usize>(
        chunk: &Chunk,
        n: usize,
        [co0, ci, ky, v0]: [usize; 4],
        sum: &mut Tile<L, V, KERNEL_WIDTH>,
    ) {
        let Chunk {
            g,
            wide,
            count,
            padded,
            dy_t,
        } = *chunk;
        let ([hp, wp], [oh, ow]) = (wide.padded, g.output);
        // The output rows whose kernel row `ky` reads the image (padded rows `ph..ph + h`).
        let (h, ph) = (g.input[0], g.pad_begin[0]);
        let rows = ph.saturating_sub(ky)..(ph + h).saturating_sub(ky).min(oh);
        assert!(g.kernel[1] == KERNEL_WIDTH && ky < g.kernel[0] && g.stride == [1, 1]);
        assert!(co0 + CHANNEL_TILE <= g.c_out && ci < g.c_in && n < count);
        assert!(16 * (v0 + V) <= CHANNEL_TILE);
        assert!(padded.len() >= count * wide.input_len && dy_t.len() >= count * g.output_len());
        assert!((ci + 1) * hp * wp <= wide.input_len && hp == oh + g.kernel[0] - 1);
        // SAFETY: the asserts bound every access: pixel `(oy, ox)` reads the padded input at
        // `ci·Hp·Wp + (oy + ky)·Wp + ox + kx < (ci + 1)·Hp·Wp` (`oy + ky < Hp`,
        // `ox + kx < Wp`) and the output gradient at `pixel·c_out + co0 + 64 <= output_len`.
        unsafe {
            let x = padded
                .as_ptr()
                .add(n * wide.input_len + ci * hp * wp + ky * wp);
            let dy = dy_t.as_ptr().add(n * g.output_len() + co0 + 16 * v0);
            let mut acc = [[L::zero(); KERNEL_WIDTH]; V];
            for oy in rows {
                for ox in 0..ow {
                    let d = dy.add((oy * ow + ox) * g.c_out);
                    let dv: [L; V] = std::array::from_fn(|v| L::load(d.add(v * 16)));
                    let xp = x.add(oy * wp + ox);
                    for kx in 0..KERNEL_WIDTH {
                        let xb = L::splat(*xp.add(kx));
                        for (v, a) in acc.iter_mut().enumerate() {
                            a[kx] = dv[v].mul_add(xb, a[kx]);
                        }
                    }
                }
            }
            for (s, a) in sum.iter_mut().zip(&acc) {
                for (s, a) in s.iter_mut().zip(a) {
                    *s = if n == 0 { *a } else { s.add(*a) };
                }
            }
        }
    }
}
