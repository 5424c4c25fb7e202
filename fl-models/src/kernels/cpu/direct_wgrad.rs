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
//! added to a chain that starts at +0 (and so is never −0) changes no bit (with finite inputs).
//! Both kernels read a zero-padded copy of the input, so that a pixel's taps run without a
//! branch per tap (a check per tap made the 5-wide kernel's loop twice as long as its
//! multiply-adds: 10–25% slower in `fl bench --kernels` than adding the padding's zeros); the
//! 5-wide kernel still skips a pixel's kernel row where the whole row reads the padding, from
//! per-row lists of the pixels that read the image (`kernel_rows`: a branch, two index loads
//! and a multiplication per pixel made its loop three times as long as its ten multiply-adds
//! on AVX2; with the lists and streams of one vector of channels there, CNN2 trains 15–20%
//! faster on one thread, `fl bench`, best of three alternating runs).

use super::{ChunkBuffers, Conv2dGeometry, WeightGradArgs, chunk_bias_grad, sum_over_chunks_with};
use crate::kernels::direct::Wide;
use crate::kernels::isa::{Isa, uses};

/// Output channels per register tile under 5-wide kernels: four vectors.
const CHANNEL_TILE: usize = 64;
/// Output channels per register tile under 5-wide kernels on AVX-512 where `c_out` is a
/// multiple of it but not of [`CHANNEL_TILE`]: two vectors (the FedMR CNN's 32-channel layer on
/// 1×28×28 inputs, whose direct kernels waste a third of their lanes on its unpadded 8×8 map).
const HALF_TILE: usize = 32;
/// Output channels per register tile under 3×3 kernels: two vectors (× 9 taps).
const CHANNEL_TILE_3X3: usize = 32;
/// Output channels per stream tile under 3×3 kernels where `c_out` is a multiple of it: four
/// vectors, in two register tiles (taps 0–4, then 5–8). Each broadcast input then feeds four
/// multiply-adds, not two: the broadcasts competed with them (8×8 and 7×7 maps +3–6%, `fl
/// bench --kernels`, one thread, two alternating runs).
const WIDE_TILE_3X3: usize = 64;
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
/// channels in whole tiles. 5-wide kernels from AVX2 up (one vector of channels × 5 taps per
/// register tile there: CNN3's 8×8 layer 31 → 51 GFLOP/s, `fl bench --kernels`, one thread,
/// best of three), 3×3 ones on AVX-512 only: AVX2's 16 registers hold a fifth of the tile, and
/// its parts ran 20% slower than the direct kernels on 16×16 maps and no faster on 8×8 ones.
pub(super) fn applies(g: &Conv2dGeometry) -> bool {
    let tile = match g.kernel {
        [3, 3] => CHANNEL_TILE_3X3,
        [_, KERNEL_WIDTH] if uses(Isa::Avx512) && !g.c_out.is_multiple_of(CHANNEL_TILE) => {
            HALF_TILE
        }
        [_, KERNEL_WIDTH] => CHANNEL_TILE,
        _ => return false,
    };
    cfg!(target_arch = "x86_64")
        && crate::kernels::direct::applies(g)
        && g.out_plane() <= MAX_PIXELS
        && g.c_out.is_multiple_of(tile)
        && uses(if tile == CHANNEL_TILE {
            Isa::Avx2
        } else {
            Isa::Avx512
        })
}

/// Weight and bias gradients, the same contract and bits as the direct kernels'.
pub(super) fn weight_grad((g, x, dy, bias): WeightGradArgs) -> (Vec<f32>, Vec<f32>) {
    let [oh, ow] = g.output;
    let wp = ow + g.kernel[1] - 1;
    // Each lane's real output pixels, in ascending wide position; the lanes in the order the
    // tree adds them (see `tiles::LaneTree`): lane `l` at position `bit_reverse(l)`.
    let mut classes: Vec<Vec<[usize; 2]>> = vec![Vec::new(); LANES];
    for oy in 0..oh {
        for ox in 0..ow {
            let lane = (oy * wp + ox) % LANES;
            classes[lane.reverse_bits() >> (usize::BITS - LANES.ilog2())].push([oy, ox]);
        }
    }
    // The kernels read zero-padded copies of the inputs, in the direct kernels' layout.
    let wide = Wide::new(g);
    // The output gradients go into class streams, written whole by every chunk.
    sum_over_chunks_with(
        g.batch,
        || ChunkBuffers::for_chunks(g.batch, wide.input_len, g.output_len()),
        |buffers, samples| chunk((g, x, dy, bias), &wide, &classes, samples, buffers),
    )
}

/// The weight and bias gradients of some consecutive samples.
fn chunk(
    (g, x, dy, bias): WeightGradArgs,
    wide: &Wide,
    classes: &[Vec<[usize; 2]>],
    samples: std::ops::Range<usize>,
    buffers: &mut ChunkBuffers,
) -> (Vec<f32>, Vec<f32>) {
    let (pixels, taps) = (g.out_plane(), g.col_rows());
    let x = &x[samples.start * g.input_len()..samples.end * g.input_len()];
    let dy = &dy[samples.start * g.output_len()..samples.end * g.output_len()];
    // The bias gradient exactly as the direct kernels sum it.
    let db = chunk_bias_grad(bias, dy, g.c_out, pixels);
    let mut dw = vec![0.0f32; g.c_out * taps];
    let count = samples.len();
    let three = g.kernel == [3, 3];
    // Channels per stream tile: all of a register tile's on AVX-512 (4 vectors under 5-wide
    // kernels), one vector on AVX2, whose register tile holds one: its passes then stream
    // contiguous memory, not a quarter of each pixel's 256 bytes.
    let tile = match (three, uses(Isa::Avx512)) {
        (true, _) if g.c_out.is_multiple_of(WIDE_TILE_3X3) => WIDE_TILE_3X3,
        (true, _) => CHANNEL_TILE_3X3,
        (false, true) if g.c_out.is_multiple_of(CHANNEL_TILE) => CHANNEL_TILE,
        (false, true) => HALF_TILE,
        (false, false) => 16,
    };
    let dy_t = &mut buffers.grads[..dy.len()];
    class_streams(g, dy, classes, count, tile, dy_t);
    let padded = &mut buffers.inputs[..count * wide.input_len];
    wide.pad_inputs(x, g.input_len(), padded);
    let (dy_t, padded) = (&*dy_t, &*padded);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `applies` checked the tier, a 3×3 or 5-wide kernel and whole channel tiles; the
    // buffers are sized from `g` and `wide` above and below.
    unsafe {
        if three {
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
            let args = tiles::Padded {
                g,
                wide,
                count,
                padded,
                dy_t,
                tile,
                reads: &reads,
            };
            // Input channels outermost: a channel's padded planes stay in L1 while the output
            // gradients stream past them.
            for ci in 0..g.c_in {
                for co0 in (0..g.c_out).step_by(tile) {
                    tiles::taps_3x3_avx512(&args, [co0, ci], &mut dw);
                }
            }
        } else {
            let rows = KernelRows::new(g, wide, classes, count, tile);
            let args = tiles::Chunk {
                g,
                wide,
                count,
                padded,
                dy_t,
                rows: &rows,
            };
            for co0 in (0..g.c_out).step_by(tile) {
                for ci in 0..g.c_in {
                    for ky in 0..g.kernel[0] {
                        let at = [co0, ci, ky];
                        if tile == CHANNEL_TILE {
                            tiles::kernel_row_avx512::<KERNEL_WIDTH, 4>(&args, at, &mut dw);
                        } else if tile == HALF_TILE {
                            tiles::kernel_row_avx512::<KERNEL_WIDTH, 2>(&args, at, &mut dw);
                        } else {
                            tiles::kernel_row_avx2::<KERNEL_WIDTH, 1>(&args, at, &mut dw);
                        }
                    }
                }
            }
        }
    }
    (dw, db)
}

/// Per kernel row `ky` and lane class, the reads of the pixels whose kernel row reads the image
/// (the others read only the padding: their products are zeros, skipped), sample after sample
/// of a chunk of `count`, in the class's order: (offset of the pixel in a channel tile's class
/// stream, offset of the row's first tap in the chunk's padded inputs, from channel 0's plane).
/// One list per class, not one per sample: the kernel's loop then runs the class's whole chain
/// (CNN2's 8×8 layer: about 24 pixels, against 3 per sample, whose loop exits the branch
/// predictor missed).
pub(super) struct KernelRows {
    /// `reads[ky][class]`.
    reads: Vec<Vec<Vec<[usize; 2]>>>,
    /// The largest stream offset, plus one.
    stream_end: usize,
    /// The largest padded-input offset, plus one.
    input_end: usize,
}

impl KernelRows {
    fn new(
        g: &Conv2dGeometry,
        wide: &Wide,
        classes: &[Vec<[usize; 2]>],
        count: usize,
        tile: usize,
    ) -> Self {
        let ([h, ph], wp) = ([g.input[0], g.pad_begin[0]], wide.padded[1]);
        let (mut stream_end, mut input_end) = (0, 0);
        let reads = (0..g.kernel[0])
            .map(|ky| {
                let mut start = 0;
                classes
                    .iter()
                    .map(|class| {
                        let mut list = Vec::new();
                        for n in 0..count {
                            for (j, [oy, ox]) in class.iter().enumerate() {
                                if (ph..h + ph).contains(&(oy + ky)) {
                                    let d = (count * start + n * class.len() + j) * tile;
                                    let at = n * wide.input_len + (oy + ky) * wp + ox;
                                    stream_end = stream_end.max(d + 1);
                                    input_end = input_end.max(at + 1);
                                    list.push([d, at]);
                                }
                            }
                        }
                        start += class.len();
                        list
                    })
                    .collect()
            })
            .collect();
        KernelRows {
            reads,
            stream_end,
            input_end,
        }
    }
}

/// Output gradients channel-minor, `[sample][pixel][c_out]` (a pixel's channels are vectors),
/// into `dy_t`, every float of it written.
pub(super) fn channel_minor(g: &Conv2dGeometry, dy: &[f32], dy_t: &mut [f32]) {
    let pixels = g.out_plane();
    assert_eq!(
        dy_t.len(),
        dy.len(),
        "channel-minor gradients: one float per output gradient"
    );
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
}

/// Output gradients in the order the kernels read them, one contiguous stream per channel tile
/// of `tile` channels and lane class: `[channel tile][class][sample][pixel of the class][tile]`,
/// every float of `streams` (as long as `dy`) written.
fn class_streams(
    g: &Conv2dGeometry,
    dy: &[f32],
    classes: &[Vec<[usize; 2]>],
    count: usize,
    tile: usize,
    streams: &mut [f32],
) {
    let (pixels, ow) = (g.out_plane(), g.output[1]);
    let tile_len = count * pixels * tile;
    assert_eq!(
        streams.len(),
        dy.len(),
        "class streams: one float per output gradient"
    );
    for (n, src) in dy.chunks(g.output_len()).enumerate() {
        let mut start = 0;
        for class in classes {
            for (j, &[oy, ox]) in class.iter().enumerate() {
                let p = oy * ow + ox;
                let slot = (count * start + n * class.len() + j) * tile;
                for (t, dst) in streams.chunks_exact_mut(tile_len).enumerate() {
                    let dst = &mut dst[slot..slot + tile];
                    for (c, v) in dst.iter_mut().enumerate() {
                        *v = src[(t * tile + c) * pixels + p];
                    }
                }
            }
            start += class.len();
        }
    }
}

/// The kernels, written once over [`Lanes16`](crate::kernels::lanes16::Lanes16) and compiled
/// for each tier. A register tile is `V` vectors of 16 output channels × `T` taps of the
/// streams' channel tile: all of it on AVX-512, a part at a time on AVX2 (16 registers of 8
/// lanes); each element's chains are the same either way.
#[cfg(target_arch = "x86_64")]
pub(super) mod tiles {
    use super::{Conv2dGeometry, KernelRows, LANES, Wide};
    use crate::kernels::lanes16::{Lanes16, tier_entries};
    use std::mem::MaybeUninit;

    /// One register tile: `[channel vector][tap]`.
    pub(in crate::kernels::cpu) type Tile<L, const V: usize, const T: usize> = [[L; T]; V];

    /// [`taps_3x3`] with AVX-512F: a 32-channel tile's 32 channels × 9 taps in registers, a
    /// 64-channel tile's 64 × 5 and then 64 × 4 (AVX2 keeps the direct kernels under 3×3
    /// kernels: see [`super::applies`]).
    ///
    /// # Safety
    /// The CPU supports AVX-512F; `taps_3x3`'s contract holds.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn taps_3x3_avx512(chunk: &Padded, [co0, ci]: [usize; 2], dw: &mut [f32]) {
        use std::arch::x86_64::__m512;
        // SAFETY: the caller upholds the contract.
        unsafe {
            if chunk.tile == super::WIDE_TILE_3X3 {
                taps_3x3::<__m512, 4, 5>(chunk, [co0, ci, 0, 0], dw);
                taps_3x3::<__m512, 4, 4>(chunk, [co0, ci, 0, 5], dw);
            } else {
                taps_3x3::<__m512, 2, 9>(chunk, [co0, ci, 0, 0], dw);
            }
        }
    }
    tier_entries!(kernel_row_avx512, kernel_row_avx2 =>
        kernel_row<const KW, const V>(chunk: &Chunk, at: [usize; 3], dw: &mut [f32]));

    /// The 16 lane chains of a register tile, added by `_mm512_reduce_add_ps`'s tree (lane `l`
    /// with `l + 8`, then `+ 4`, `+ 2`, `+ 1`) as they arrive: the lanes come in the tree's
    /// order (lane `l` at position `bit_reverse(l)`: 0, 8, 4, 12, 2, …), and each pair is added
    /// once both of its halves are known, the earlier one as the first operand, exactly the
    /// tree's additions. At most one partial tile per level waits in memory, where the whole
    /// tree kept (and zeroed) sixteen.
    struct LaneTree<L, const V: usize, const T: usize> {
        /// `partials[level]`: the sum of the last `2^level` lanes, waiting for its pair;
        /// `partials[4]`: the total.
        partials: [MaybeUninit<Tile<L, V, T>>; 5],
        /// Lanes added so far.
        position: usize,
    }

    impl<L: Lanes16, const V: usize, const T: usize> LaneTree<L, V, T> {
        /// No lanes yet.
        fn new() -> Self {
            Self {
                partials: [const { MaybeUninit::uninit() }; 5],
                position: 0,
            }
        }

        /// Adds the next lane's chains.
        ///
        /// # Safety
        /// `L`'s tier.
        #[inline(always)]
        unsafe fn push(&mut self, mut sum: Tile<L, V, T>) {
            assert!(self.position < LANES, "lane tree: more than 16 lanes");
            let mut level = 0;
            while self.position >> level & 1 == 1 {
                // SAFETY: bit `level` of `position` is set, so the lane at `position − 2^level`
                // (a smaller position with `level` trailing ones) wrote this level and no
                // lane has read it since.
                let earlier = unsafe { self.partials[level].assume_init_read() };
                for (s, e) in sum.iter_mut().zip(&earlier) {
                    for (s, e) in s.iter_mut().zip(e) {
                        // SAFETY: the tier is the caller's.
                        *s = unsafe { e.add(*s) };
                    }
                }
                level += 1;
            }
            self.partials[level].write(sum);
            self.position += 1;
        }

        /// The tree's total, after sixteen lanes.
        fn total(&self) -> &Tile<L, V, T> {
            assert_eq!(self.position, LANES, "lane tree: lanes missing");
            // SAFETY: the sixteenth lane (position 15, four trailing ones) wrote level 4.
            unsafe { self.partials[4].assume_init_ref() }
        }
    }

    /// Writes a tile's sums (`total[v][t]`: channels `co0 + 16·v ..` at tap `k0 + t`) into the
    /// weight gradient's `[c_out][taps]` layout, a run of `T` taps per channel.
    ///
    /// # Safety
    /// `L`'s tier; `(co0 + 16·V) · taps <= dw.len()` and `k0 + T <= taps` (checked).
    #[inline(always)]
    pub(in crate::kernels::cpu) unsafe fn store_tile<L: Lanes16, const V: usize, const T: usize>(
        total: &Tile<L, V, T>,
        [co0, k0, taps]: [usize; 3],
        dw: &mut [f32],
    ) {
        assert!((co0 + 16 * V) * taps <= dw.len() && k0 + T <= taps);
        let mut sums = [[0.0f32; 16]; T];
        for (v, row) in total.iter().enumerate() {
            for (sum, vector) in sums.iter_mut().zip(row) {
                // SAFETY: `sum` holds 16 floats; the tier is the caller's.
                unsafe { vector.store(sum.as_mut_ptr()) };
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
        /// Channels per stream tile.
        pub(super) tile: usize,
        pub(super) reads: &'a [Vec<usize>],
    }

    /// `dw[co0 + 16·v0 .. + 16·V, (ci, t0 .. t0 + T)]` (taps `t = 3·ky + kx`): per lane class,
    /// a chain over the chunk's samples and the class's pixels (padding products included:
    /// they add zeros), then [`LaneTree`].
    ///
    /// # Safety
    /// `L`'s tier; `g.kernel == [3, 3]`, `wide` is `g`'s layout, `padded` holds `count` padded
    /// inputs of `wide.input_len` floats, `dy_t` their output gradients in class streams,
    /// `dw` `c_out · c_in·9` floats, `co0` a multiple of `tile` with `co0 + tile <= c_out`,
    /// `16·(v0 + V) <= tile`, `t0 + T <= 9`, `ci < c_in`, and `reads` holds
    /// `n·input_len + oy·Wp + ox` for every sample `n` and output pixel `(oy, ox)`, each once.
    #[inline(always)]
    unsafe fn taps_3x3<L: Lanes16, const V: usize, const T: usize>(
        chunk: &Padded,
        [co0, ci, v0, t0]: [usize; 4],
        dw: &mut [f32],
    ) {
        let Padded {
            g,
            wide,
            count,
            padded,
            dy_t,
            tile,
            reads,
        } = *chunk;
        let ([hp, wp], pixels) = (wide.padded, g.out_plane());
        assert!(16 * (v0 + V) <= tile && t0 + T <= 9);
        let offsets: [usize; T] =
            std::array::from_fn(|t| ci * hp * wp + (t0 + t) / 3 * wp + (t0 + t) % 3);
        assert!(g.kernel == [3, 3] && co0 + tile <= g.c_out && ci < g.c_in);
        assert!(co0.is_multiple_of(tile) && tile % 16 == 0);
        assert!(
            reads.len() == LANES && reads.iter().map(Vec::len).sum::<usize>() == count * pixels
        );
        assert!(padded.len() >= count * wide.input_len && dy_t.len() >= count * g.output_len());
        assert!(dw.len() >= g.c_out * g.col_rows() && (ci + 1) * hp * wp <= wide.input_len);
        // SAFETY: the asserts bound every access: sample `n`'s pixel `(oy, ox)` reads
        // `n·input_len + oy·Wp + ox + offsets[t] < n·input_len + (ci + 1)·Hp·Wp`, within the
        // sample's padded input, and
        // the tile's stream `count·pixels·tile` floats from `co0·count·pixels`, within
        // `count·c_out·pixels`.
        unsafe {
            // This tile's stream, class after class, at the register tile's channels.
            let mut d = dy_t.as_ptr().add(co0 * count * pixels + 16 * v0);
            let x = padded.as_ptr();
            let zero: Tile<L, V, T> = [[L::zero(); T]; V];
            let mut tree = LaneTree::<L, V, T>::new();
            for reads in reads {
                let mut acc = zero;
                for &at in reads {
                    let dv: [L; V] = std::array::from_fn(|v| L::load(d.add(v * 16)));
                    d = d.add(tile);
                    let xp = x.add(at);
                    for (t, &offset) in offsets.iter().enumerate() {
                        let xb = L::splat(*xp.add(offset));
                        for (v, a) in acc.iter_mut().enumerate() {
                            a[t] = dv[v].mul_add(xb, a[t]);
                        }
                    }
                }
                tree.push(acc);
            }
            store_tile(tree.total(), [co0 + 16 * v0, ci * 9 + t0, g.col_rows()], dw);
        }
    }

    /// One chunk of samples: `count` zero-padded inputs (`wide`'s layout), their output
    /// gradients as `class_streams` lays them out for tiles of `16·V` channels, and per kernel
    /// row and lane class (in tree order) the reads of the pixels whose kernel row reads the
    /// image ([`KernelRows`]).
    pub(super) struct Chunk<'a> {
        pub(super) g: &'a Conv2dGeometry,
        pub(super) wide: &'a Wide,
        pub(super) count: usize,
        pub(super) padded: &'a [f32],
        pub(super) dy_t: &'a [f32],
        pub(super) rows: &'a KernelRows,
    }

    /// `dw[co0 .. co0 + 16·V, (ci, ky, kx)]` for every `kx`: per lane class, a chain over the
    /// chunk's samples and the class's pixels whose kernel row reads the image (the columns
    /// on the padding add zeros: no branch per tap), then the 16 chains added by
    /// [`LaneTree`].
    ///
    /// # Safety
    /// `L`'s tier; `KW == g.kernel[1]`; `wide` is `g`'s layout, `padded` holds `count` padded
    /// inputs of `wide.input_len` floats, `dy_t` their output gradients in class streams of
    /// `16·V` channels, `dw` `c_out · c_in·kh·kw` floats, `co0` a multiple of `16·V` with
    /// `co0 + 16·V <= c_out`, `ci < c_in`, `ky < kh`, and `rows` is [`KernelRows::new`]'s for
    /// `g`, `wide`, `count` and tiles of `16·V`.
    #[inline(always)]
    unsafe fn kernel_row<L: Lanes16, const KW: usize, const V: usize>(
        chunk: &Chunk,
        [co0, ci, ky]: [usize; 3],
        dw: &mut [f32],
    ) {
        let Chunk {
            g,
            wide,
            count,
            padded,
            dy_t,
            rows,
        } = *chunk;
        let tile = 16 * V;
        let (pixels, [hp, wp]) = (g.out_plane(), wide.padded);
        assert!(KW == g.kernel[1] && co0 + tile <= g.c_out && ci < g.c_in);
        assert!(co0.is_multiple_of(tile) && ky < g.kernel[0] && rows.reads.len() == g.kernel[0]);
        let reads = &rows.reads[ky];
        assert!(padded.len() >= count * wide.input_len && dy_t.len() >= count * g.output_len());
        assert!(
            (ci + 1) * hp * wp <= wide.input_len
                && [hp, wp] == [g.output[0] + g.kernel[0] - 1, g.output[1] + KW - 1]
        );
        assert!(reads.len() == LANES && dw.len() >= g.c_out * g.col_rows());
        assert!(
            rows.stream_end + tile <= count * pixels * tile + 1
                && ci * hp * wp + rows.input_end + KW <= padded.len() + 1
        );
        // SAFETY: the asserts bound every access: a read's taps `at .. at + KW` from channel
        // `ci`'s plane lie in `padded`, and its pixel's `tile` floats at `d` in the tile's
        // stream of `count·pixels·tile` floats from `co0·count·pixels`, within
        // `count·c_out·pixels`.
        unsafe {
            let stream = dy_t.as_ptr().add(co0 * count * pixels);
            let plane = padded.as_ptr().add(ci * hp * wp);
            let zero: Tile<L, V, KW> = [[L::zero(); KW]; V];
            let mut tree = LaneTree::<L, V, KW>::new();
            for reads in reads {
                let mut acc = zero;
                for &[d, at] in reads {
                    let pixel = stream.add(d);
                    let dv: [L; V] = std::array::from_fn(|v| L::load(pixel.add(v * 16)));
                    let xp = plane.add(at);
                    for kx in 0..KW {
                        let xb = L::splat(*xp.add(kx));
                        for (v, a) in acc.iter_mut().enumerate() {
                            a[kx] = dv[v].mul_add(xb, a[kx]);
                        }
                    }
                }
                tree.push(acc);
            }
            let row = (ci * g.kernel[0] + ky) * KW;
            store_tile(tree.total(), [co0, row, g.col_rows()], dw);
        }
    }
}
