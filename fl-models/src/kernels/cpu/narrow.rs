//! Weight gradients of convolutions on small feature maps (3 to 16 output pixels: VGG-16's 4×4
//! and 2×2 maps, CNN3's 3×3, the MobileNets' last pointwise layers), bit for bit the per-sample
//! gemm they replace.
//!
//! The im2col path sums a chunk's weight gradient as one gemm per sample, `dW += dy[n] ·
//! cols[n]ᵀ`, whose inner dimension is the map's few pixels: every product reads and writes the
//! whole gradient (2.4 M floats on VGG-16's 512-channel layers) for 4–16 multiply-adds per
//! element, so it runs at memory speed (15–45% of the FMA peak, `fl bench --kernels`). gemm's
//! micro-kernel computes each element as an FMA chain over the pixels starting from zero, then
//! stores it (first sample) or adds it to the element (`fma(1, sum, dW)`, one rounding: an
//! add); the chunks' partial gradients are then added in chunk order. This kernel does exactly
//! that per element, pixel by pixel, sample by sample and chunk by chunk, with register tiles
//! of the running sums held across the whole batch: no partial-gradient buffers (9.4 MB per
//! chunk on VGG-16's 512-channel layers), no pass adding them up. Threads split the output
//! channels, so the result does not depend on their number.
//!
//! It applies only where gemm would take that micro-kernel: at least 3 pixels (gemm sums 1 or 2
//! another way), a product of more than 16×16 elements (smaller ones go to a horizontal kernel),
//! and an AVX-512 CPU or one with AVX2 and FMA (gemm's micro-kernels run the same fused
//! multiply-add chains on both; the register tiles here are smaller on AVX2).

use rayon::prelude::*;

use super::{Conv2dGeometry, WEIGHT_GRAD_CHUNK, WeightGradArgs, chunked_bias_grad};
use crate::kernels::isa::{Isa, uses};

/// Floats per vector ([`Lanes16`](crate::kernels::lanes16::Lanes16): one AVX-512 register or
/// two AVX2 ones).
const LANES: usize = 16;
/// Rows (the weight's `c_in·kh·kw` axis) per register tile: two vectors.
const ROW_TILE: usize = 2 * LANES;
/// Output channels per register tile (and per tile of the transposed output gradients) on
/// AVX-512: 4 × 2 sums each for the sample, the chunk and the batch, plus 2 loads and a
/// broadcast, fill 27 of the 32 vector registers.
const CHANNEL_TILE: usize = 4;
/// Output channels per register tile on AVX2 (16 registers of 8 lanes): 2 × 2 × 2 registers of
/// the sample's sums, 4 of loads and a broadcast; the chunk's and batch's sums, added once per
/// sample and per chunk, may live on the stack.
const CHANNEL_TILE_AVX2: usize = 2;
/// Output channels per task: a task streams the column matrices once, so fewer, larger tasks
/// read less (the rows of one tile for every sample stay in L2 across its channels).
const CHANNELS_PER_TASK: usize = 64;
/// The largest map this kernel takes; bigger ones keep gemm, which is efficient there.
const MAX_PIXELS: usize = 16;

/// Whether [`weight_grad`] computes `g`'s weight gradient (see the module docs).
pub(super) fn applies(g: &Conv2dGeometry) -> bool {
    let pixels = g.out_plane();
    cfg!(target_arch = "x86_64")
        && g.batch > 0
        && (3..=MAX_PIXELS).contains(&pixels)
        && g.c_out >= 2
        && g.col_rows() >= 2
        && g.c_out * g.col_rows() > 16 * 16
        && uses(Isa::Avx2)
}

/// The weight gradient `[c_out, c_in·kh·kw]` and the bias gradient: the same bits as
/// `cpu::im2col_conv2d_weight_grad`.
pub(super) fn weight_grad((g, x, dy, bias): WeightGradArgs) -> (Vec<f32>, Vec<f32>) {
    let (rows, pixels) = (g.col_rows(), g.out_plane());
    let stride = rows.next_multiple_of(ROW_TILE);
    let layout = Layout::new(g);
    // The column matrices transposed and cut into row tiles, tile-major,
    // `[stride / ROW_TILE][batch][pixels][ROW_TILE]`: a pixel's rows of one tile are two whole
    // vectors (zeros past `rows`), and one tile of the whole batch is one contiguous stream,
    // which the kernel walks once per channel tile (sample-major, it jumped a page or more per
    // sample); tap-major rows (`tap · c_in + ci`) where the layout says so. Each value is
    // gathered straight from the input, as im2col would have copied it.
    let (sources, offsets) = (layout.sources(g), &layout.offsets);
    let plane = g.input[0] * g.input[1];
    let mut cols_t = super::Aligned::zeroed(g.batch * pixels * stride);
    cols_t
        .par_chunks_mut(g.batch * pixels * ROW_TILE)
        .enumerate()
        .for_each(|(tile, dst)| {
            let sources = &sources[tile * ROW_TILE..rows.min((tile + 1) * ROW_TILE)];
            // The tile's (position in a sample's block, input offset) pairs that read the
            // image, found once for every sample: a lookup and a branch per value took about a
            // third of this weight gradient's time on VGG-16's and CNN3's smallest maps.
            let reads: Vec<[usize; 2]> = (0..pixels)
                .flat_map(|p| {
                    sources
                        .iter()
                        .enumerate()
                        .filter_map(move |(v, &(ci, tap))| {
                            let at = offsets[tap][p]?;
                            Some([p * ROW_TILE + v, ci * plane + at])
                        })
                })
                .collect();
            for (x_n, dst) in x
                .chunks_exact(g.input_len())
                .zip(dst.chunks_exact_mut(pixels * ROW_TILE))
            {
                for &[to, from] in &reads {
                    dst[to] = x_n[from];
                }
            }
        });
    // The bias gradient through the im2col path's own chunking.
    let db = chunked_bias_grad(bias, dy, g.batch, g.c_out, pixels);
    // The output gradients in the same way, `[c_out / CHANNEL_TILE][batch][pixels]
    // [CHANNEL_TILE]` (zeros past `c_out`): a channel tile's values, one stream.
    let tiles = g.c_out.div_ceil(CHANNEL_TILE);
    let mut dy_t = super::Aligned::zeroed(tiles * g.batch * pixels * CHANNEL_TILE);
    dy_t.par_chunks_exact_mut(g.batch * pixels * CHANNEL_TILE)
        .enumerate()
        .for_each(|(tile, dst)| {
            let channels = tile * CHANNEL_TILE..g.c_out.min((tile + 1) * CHANNEL_TILE);
            for (dy_n, dst) in dy
                .chunks_exact(g.output_len())
                .zip(dst.chunks_exact_mut(pixels * CHANNEL_TILE))
            {
                for (j, co) in channels.clone().enumerate() {
                    for (p, &v) in dy_n[co * pixels..][..pixels].iter().enumerate() {
                        dst[p * CHANNEL_TILE + j] = v;
                    }
                }
            }
        });
    let mut dw = super::par_zeroed(g.c_out * rows);
    let shape = Shape {
        c_out: g.c_out,
        rows,
        stride,
        pixels,
        batch: g.batch,
    };
    dw.par_chunks_mut(CHANNELS_PER_TASK * rows)
        .enumerate()
        .for_each(|(task, out)| {
            let first = task * CHANNELS_PER_TASK;
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `applies` checked the tier; `Shape` and `layout` describe the buffers
            // built above.
            unsafe {
                let channels = first..first + out.len() / rows;
                if uses(Isa::Avx512) {
                    tiles::channels_avx512::<CHANNEL_TILE>(
                        &shape, &layout, channels, &dy_t, &cols_t, out,
                    );
                } else {
                    tiles::channels_avx2::<CHANNEL_TILE_AVX2>(
                        &shape, &layout, channels, &dy_t, &cols_t, out,
                    );
                }
            }
            layout.to_weight_order(out, rows);
        });
    (dw, db)
}

/// The row order of the transposed column matrices, and which pixels each register tile sums.
///
/// Rows come in the weight's order (`ci · taps + tap`) unless every input channel run of a tap
/// fills whole tiles (`c_in` a multiple of [`ROW_TILE`], and some tap reads padding): then
/// tap-major (`tap · c_in + ci`), so every tile belongs to one kernel tap and skips the pixels
/// where that tap reads the zero padding. Those products are zeros added to sums that start at
/// +0 and so never are −0: skipping them changes no bit (with finite gradients). On VGG-16's
/// 2×2 maps that is 56% of the multiply-adds, on its 4×4 maps 31%.
pub(super) struct Layout {
    /// Tap-major rows.
    pub(super) tap_major: bool,
    c_in: usize,
    taps: usize,
    /// Per tap (one list for all in the weight order), the pixels whose input it reads.
    pixels: Vec<Vec<usize>>,
    /// Per tap and output pixel, the input (within a channel's plane) it reads, or `None` for
    /// the padding.
    offsets: Vec<Vec<Option<usize>>>,
}

impl Layout {
    pub(super) fn new(g: &Conv2dGeometry) -> Self {
        let [kh, kw] = g.kernel;
        let [oh, ow] = g.output;
        let [h, w] = g.input;
        let input = |o: usize, k: usize, s: usize, pad: usize, size: usize| {
            (o * s + k).checked_sub(pad).filter(|&i| i < size)
        };
        let offsets: Vec<Vec<Option<usize>>> = (0..kh * kw)
            .map(|t| {
                let (ky, kx) = (t / kw, t % kw);
                (0..oh * ow)
                    .map(|p| {
                        let iy = input(p / ow, ky, g.stride[0], g.pad_begin[0], h)?;
                        let ix = input(p % ow, kx, g.stride[1], g.pad_begin[1], w)?;
                        Some(iy * w + ix)
                    })
                    .collect()
            })
            .collect();
        let per_tap: Vec<Vec<usize>> = offsets
            .iter()
            .map(|tap| (0..oh * ow).filter(|&p| tap[p].is_some()).collect())
            .collect();
        let skips = per_tap.iter().any(|p| p.len() < oh * ow);
        let tap_major = skips && g.c_in.is_multiple_of(ROW_TILE);
        Layout {
            tap_major,
            c_in: g.c_in,
            taps: kh * kw,
            pixels: if tap_major {
                per_tap
            } else {
                vec![(0..oh * ow).collect()]
            },
            offsets,
        }
    }

    /// The (input channel, tap) each row of the transposed column matrices holds.
    fn sources(&self, g: &Conv2dGeometry) -> Vec<(usize, usize)> {
        let mut sources = vec![(0, 0); g.col_rows()];
        for ci in 0..self.c_in {
            for tap in 0..self.taps {
                sources[self.row(ci, tap)] = (ci, tap);
            }
        }
        sources
    }

    /// Where the weight's row of input channel `ci` and tap `tap` lives in the transposed
    /// column matrices.
    fn row(&self, ci: usize, tap: usize) -> usize {
        if self.tap_major {
            tap * self.c_in + ci
        } else {
            ci * self.taps + tap
        }
    }

    /// The pixels a tile starting at row `r0` sums over.
    fn tile_pixels(&self, r0: usize) -> &[usize] {
        if self.tap_major {
            &self.pixels[r0 / self.c_in]
        } else {
            &self.pixels[0]
        }
    }

    /// Puts each `rows`-long channel row of `out` back into the weight's order.
    fn to_weight_order(&self, out: &mut [f32], rows: usize) {
        if !self.tap_major {
            return;
        }
        let mut tmp = vec![0.0f32; rows];
        for row in out.chunks_exact_mut(rows) {
            tmp.copy_from_slice(row);
            for (ci, taps) in row.chunks_exact_mut(self.taps).enumerate() {
                for (tap, v) in taps.iter_mut().enumerate() {
                    *v = tmp[tap * self.c_in + ci];
                }
            }
        }
    }
}

/// The sizes the kernel needs.
struct Shape {
    c_out: usize,
    rows: usize,
    /// Rows per sample and pixel in the transposed column matrices: `rows` rounded up to
    /// [`ROW_TILE`].
    stride: usize,
    pixels: usize,
    batch: usize,
}

/// The kernel, written once over [`Lanes16`](crate::kernels::lanes16::Lanes16) and compiled
/// for each tier.
#[cfg(target_arch = "x86_64")]
mod tiles {
    use super::super::first_lanes;
    use super::{CHANNEL_TILE, LANES, Layout, ROW_TILE, Shape, WEIGHT_GRAD_CHUNK};
    use crate::kernels::lanes16::{Lanes16, tier_entries};

    tier_entries!(channels_avx512, channels_avx2 =>
        channel_rows<const CT>(s: &Shape, layout: &Layout, channels: std::ops::Range<usize>,
            dy: &[f32], cols_t: &[f32], out: &mut [f32]));

    /// `out[co − first, r] = Σ_chunks Σ_n∈chunk (Σ_p dy[n, co, p] · cols_t[n, r, p])` for the
    /// output channels `channels`, rows in `layout`'s order: each pixel sum an FMA chain from
    /// zero in pixel order over the tile's pixels, each chunk's sum left to right from its first
    /// sample's, the chunks' sums left to right. Register tiles of `CT` channels (dividing
    /// [`CHANNEL_TILE`]) × [`ROW_TILE`] rows.
    ///
    /// # Safety
    /// `L`'s tier; `dy` holds `c_out.div_ceil(CHANNEL_TILE) · batch · pixels · CHANNEL_TILE`
    /// floats (laid out `[c_out / CHANNEL_TILE][batch][pixels][CHANNEL_TILE]`), `channels`
    /// starts at a multiple of [`CHANNEL_TILE`], `cols_t` `batch · pixels · stride` (laid out
    /// `[stride / ROW_TILE][batch][pixels][ROW_TILE]`) with `stride` a multiple of
    /// [`ROW_TILE`] and at least `rows`, `channels` lies within `c_out`, `out` holds
    /// `channels.len() · rows` floats, and `layout`'s pixels are below `pixels`.
    #[inline(always)]
    unsafe fn channel_rows<L: Lanes16, const CT: usize>(
        s: &Shape,
        layout: &Layout,
        channels: std::ops::Range<usize>,
        dy: &[f32],
        cols_t: &[f32],
        out: &mut [f32],
    ) {
        let Shape {
            c_out,
            rows,
            stride,
            pixels,
            batch,
        } = *s;
        let tiles = c_out.div_ceil(CHANNEL_TILE);
        assert!(dy.len() >= tiles * batch * pixels * CHANNEL_TILE);
        assert!(cols_t.len() >= batch * pixels * stride);
        assert!(channels.start.is_multiple_of(CHANNEL_TILE) && CHANNEL_TILE.is_multiple_of(CT));
        assert!(stride % ROW_TILE == 0 && stride >= rows && channels.end <= c_out);
        assert!(out.len() >= channels.len() * rows);
        let add = |a: [[L; 2]; CT], b: &[[L; 2]; CT]| {
            // SAFETY: the tier is the caller's.
            std::array::from_fn(|j| unsafe { [a[j][0].add(b[j][0]), a[j][1].add(b[j][1])] })
        };
        // SAFETY: the asserts bound every load; stores are masked to `rows` and `channels`.
        unsafe {
            let zero = [[L::zero(); 2]; CT];
            for r0 in (0..rows).step_by(ROW_TILE) {
                let tile_pixels = layout.tile_pixels(r0);
                // Lanes of each vector that are real rows (the rest are padding).
                let masks: [u16; 2] =
                    std::array::from_fn(|v| first_lanes(rows.saturating_sub(r0 + v * LANES)));
                for co0 in channels.clone().step_by(CHANNEL_TILE) {
                    // A partial channel tile reads zeros; its sums are dropped.
                    let tile = dy
                        .as_ptr()
                        .add(co0 / CHANNEL_TILE * batch * pixels * CHANNEL_TILE);
                    for sub in (0..CHANNEL_TILE).step_by(CT) {
                        if co0 + sub >= channels.end {
                            break;
                        }
                        let mut batch_sum = zero;
                        for c0 in (0..batch).step_by(WEIGHT_GRAD_CHUNK) {
                            let mut chunk_sum = zero;
                            for n in c0..(c0 + WEIGHT_GRAD_CHUNK).min(batch) {
                                let mut acc = zero;
                                let d = tile.add(n * pixels * CHANNEL_TILE + sub);
                                for &p in tile_pixels {
                                    let c = cols_t
                                        .as_ptr()
                                        .add(((r0 / ROW_TILE * batch + n) * pixels + p) * ROW_TILE);
                                    let v = [L::load(c), L::load(c.add(LANES))];
                                    for (j, a) in acc.iter_mut().enumerate() {
                                        let w = L::splat(*d.add(p * CHANNEL_TILE + j));
                                        a[0] = w.mul_add(v[0], a[0]);
                                        a[1] = w.mul_add(v[1], a[1]);
                                    }
                                }
                                chunk_sum = if n == c0 { acc } else { add(chunk_sum, &acc) };
                            }
                            batch_sum = if c0 == 0 {
                                chunk_sum
                            } else {
                                add(batch_sum, &chunk_sum)
                            };
                        }
                        let first = channels.start;
                        let count = (channels.end - co0 - sub).min(CT);
                        for (j, t) in batch_sum.iter().enumerate().take(count) {
                            let dst = out.as_mut_ptr().add((co0 + sub - first + j) * rows + r0);
                            t[0].store_masked(dst, masks[0]);
                            t[1].store_masked(dst.add(LANES), masks[1]);
                        }
                    }
                }
            }
        }
    }
}
