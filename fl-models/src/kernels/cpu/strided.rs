//! Stride-2 convolutions under 3×3 kernels with padding 1 whose output rows fit one vector (the
//! ResNet-20s' layers into their 16×16 and 14×14 stages; the weight gradient also into their
//! 8×8 and 7×7 ones), straight from the planes on AVX-512, bit for bit the im2col path.
//!
//! The im2col path writes a column matrix of 9/4 times the input per sample (295 KB for one
//! sample of `resnet20-ref`'s 32-channel layer), multiplies it by gemm and, where it groups
//! samples, copies the product back out; these layers ran at 45–65% of the FMA peak (`fl bench
//! --kernels --layers stride`; forward pass, input and weight gradient into 16×16 maps 58–64,
//! 54–58 and 52–58 GFLOP/s here, 85–99, 79–87 and 85–91 on this kernel). Here each input row is split once into its column
//! phases: for kernel column `kx`, vector lane `j` holds input column `2j + kx − 1` (zero
//! outside the row), so the inputs of tap `(ky, kx)` for a whole output row `oy` are one vector,
//! that phase of input row `2·oy + ky − 1`. The phases of a sample take 3/2 of its input,
//! written once and read from L2. (`resnet20-ref`'s 1×1 stride-2 shortcuts ran no faster this
//! way than on im2col, whose column matrix is only the input's even pixels: they stay there.)
//!
//! Sums keep the im2col path's order. The forward pass chains each output over the column
//! matrix's rows `(ci, ky, kx)` in gemm's depth blocks, each from +0, and adds each block onto
//! the output (the bias first); the input gradient chains each column entry over the output
//! channels in its depth blocks the same way, then adds a pixel's taps in `(ky, kx)` order onto
//! +0, as col2im does onto the zeroed gradient. The blocks are those gemm takes for the group
//! of samples the im2col path would put the sample in. The weight gradient holds 16 output
//! channels per vector and chains each element over the pixels in gemm's depth blocks, per
//! sample, stored for a chunk's first sample and added for the others, the chunks added in
//! order. Padding taps multiply zeros, as gemm's column matrix does.

use rayon::prelude::*;
use std::mem::MaybeUninit;

use super::columns::transpose;
use super::{
    Aligned, Conv2dGeometry, WeightGradArgs, chunk_bias_grad, gemm_depth_block, sum_over_chunks,
};
use crate::kernels::isa::{Isa, uses};

/// Floats per vector: the widest output row this kernel takes.
const LANES: usize = 16;
/// Output channels per forward register tile.
const CHANNELS: usize = 8;
/// Output rows per forward register tile (2 × [`CHANNELS`] running sums).
const ROWS: usize = 2;
/// Kernel rows and columns.
const TAPS_1D: usize = 3;
/// Taps of the kernel.
const TAPS: usize = TAPS_1D * TAPS_1D;

/// Whether this kernel computes `g`'s forward pass and input gradient: AVX-512, stride 2, a 3×3
/// kernel with padding 1, output rows of at most [`LANES`] pixels from input rows of at most
/// 2·[`LANES`], output channels in whole tiles, and products large enough that gemm takes its
/// general kernels in the im2col path (not its 1–2-deep or one-wide ones).
pub(super) fn applies(g: &Conv2dGeometry) -> bool {
    cfg!(target_arch = "x86_64")
        && uses(Isa::Avx512)
        && g.batch > 0
        && g.stride == [2, 2]
        && g.kernel == [TAPS_1D; 2]
        && g.pad_begin == [1, 1]
        && (1..=LANES).contains(&g.output[1])
        && g.output[0] > 0
        && g.out_plane() > 16
        && g.input[1] <= 2 * LANES
        && g.input[0] > 0
        && g.c_out.is_multiple_of(CHANNELS)
        && g.c_out >= 16
        && g.col_rows() >= 16
}

/// Rows per column phase: input rows `−1 … 2·oh − 1`, zeros outside the image.
fn phase_rows(g: &Conv2dGeometry) -> usize {
    2 * g.output[0] + 1
}

/// gemm's depth block for sample `n` in the im2col path: an `m × width` product over `k`, where
/// `width` is the output pixels of the group of `group` samples holding `n`.
fn depth_block(g: &Conv2dGeometry, n: usize, group: usize, m: usize, k: usize) -> usize {
    let start = n / group * group;
    let width = group.min(g.batch - start) * g.out_plane();
    gemm_depth_block(m, width, k)
}

/// Forward convolution, the same contract and bits as the im2col path's.
pub(super) fn forward(
    g: &Conv2dGeometry,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
) -> Vec<f32> {
    let (rows, kw) = (g.col_rows(), TAPS_1D);
    // The weight as tiles of output channels, `[c_out / CHANNELS][rows][CHANNELS]`: a row's
    // broadcasts are one cache line.
    let mut packed = vec![0.0; weight.len()];
    for (co, w) in weight.chunks_exact(rows).enumerate() {
        let (tile, c) = (co / CHANNELS, co % CHANNELS);
        for (r, &v) in w.iter().enumerate() {
            packed[(tile * rows + r) * CHANNELS + c] = v;
        }
    }
    // Per row `(ci, ky, kx)` of the column matrix, where output row 0's inputs start among the
    // phases (`[ci][kx][phase row][LANES]`).
    let prows = phase_rows(g);
    let offsets: Vec<usize> = (0..rows)
        .map(|r| {
            let (ci, t) = (r / TAPS, r % TAPS);
            ((ci * kw + t % kw) * prows + t / kw) * LANES
        })
        .collect();
    let group = g.group();
    // SAFETY: each task writes its sample's whole output (`tiles::forward_sample`).
    unsafe {
        super::written_whole(g.batch * g.output_len(), |y| {
            y.par_chunks_mut(g.output_len())
                .zip(x.par_chunks(g.input_len()))
                .enumerate()
                .for_each_init(
                    || Aligned::zeroed(g.c_in * kw * prows * LANES),
                    |phases, (n, (y_n, x_n))| {
                        let kc = depth_block(g, n, group, g.c_out, rows);
                        // (Unsafe, in the block above.) `applies` checked AVX-512 and the
                        // shapes the phases and tiles assume.
                        #[cfg(target_arch = "x86_64")]
                        {
                            tiles::phases(g, x_n, phases);
                            tiles::forward_sample(g, phases, &offsets, &packed, bias, kc, y_n);
                        }
                        #[cfg(not(target_arch = "x86_64"))]
                        unreachable!("{n} {y_n:?} {x_n:?} {kc} {phases:?}: AVX-512 only");
                    },
                )
        })
    }
}

/// Gradient of [`forward`] with respect to its input, the same bits as the im2col path's.
pub(super) fn input_grad(g: &Conv2dGeometry, weight: &[f32], dy: &[f32]) -> Vec<f32> {
    let rows = g.col_rows();
    let group = g.input_grad_group();
    // SAFETY: each task writes its sample's whole input gradient (`tiles::input_grad_sample`).
    unsafe {
        super::written_whole(g.batch * g.input_len(), |dx| {
            dx.par_chunks_mut(g.input_len())
                .zip(dy.par_chunks(g.output_len()))
                .enumerate()
                .for_each_init(
                    || Aligned::zeroed(TAPS * g.output[0] * LANES),
                    |cols, (n, (dx_n, dy_n))| {
                        let kc = depth_block(g, n, group, rows, g.c_out);
                        // (Unsafe, in the block above.) As in `forward`.
                        #[cfg(target_arch = "x86_64")]
                        tiles::input_grad_sample(g, weight, dy_n, kc, cols, dx_n);
                        #[cfg(not(target_arch = "x86_64"))]
                        unreachable!("{n} {dx_n:?} {dy_n:?} {kc} {cols:?}: AVX-512 only");
                    },
                )
        })
    }
}

/// Whether [`weight_grad`] computes `g`'s weight gradient: where [`applies`] holds, on any map
/// (its vectors hold output channels, not pixels), with output channels in whole vectors. The
/// caller takes it only where the im2col path would run.
pub(super) fn weight_grad_applies(g: &Conv2dGeometry) -> bool {
    applies(g) && g.c_out.is_multiple_of(LANES)
}

/// Weight and bias gradients, the same contract and bits as the im2col path's: per sample of
/// a chunk, each element a chain over the pixels in gemm's depth blocks from +0, stored (the
/// chunk's first sample's first block) or added on; the chunks added in order.
pub(super) fn weight_grad(args: WeightGradArgs) -> (Vec<f32>, Vec<f32>) {
    let g = args.0;
    let kc = gemm_depth_block(g.c_out, g.col_rows(), g.out_plane());
    let (dw_t, db) = sum_over_chunks(g.batch, |samples| weight_grad_chunk(args, samples, kc));
    // From `[rows, c_out]` (output channels in the vectors) to the weight's `[c_out, rows]`.
    let mut dw = vec![0.0; g.weight_len()];
    transpose([g.col_rows(), g.c_out], &dw_t, &mut dw);
    (dw, db)
}

/// The weight gradient (`[rows, c_out]`) and bias gradient of some consecutive samples.
fn weight_grad_chunk(
    (g, x, dy, bias): WeightGradArgs,
    samples: std::ops::Range<usize>,
    kc: usize,
) -> (Vec<f32>, Vec<f32>) {
    let mut dw_t = vec![0.0; g.weight_len()];
    let mut phases = Aligned::zeroed(g.c_in * TAPS_1D * phase_rows(g) * LANES);
    let mut dy_t = Aligned::zeroed(g.output_len());
    for n in samples.clone() {
        let dy_n = &dy[n * g.output_len()..(n + 1) * g.output_len()];
        transpose([g.c_out, g.out_plane()], dy_n, &mut dy_t);
        // `applies` checked AVX-512 and the shapes the phases and tiles assume.
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as just said; the buffers are sized for `g`.
        unsafe {
            tiles::phases(
                g,
                &x[n * g.input_len()..(n + 1) * g.input_len()],
                &mut phases,
            );
            tiles::weight_grad_sample(g, &phases, &dy_t, kc, n > samples.start, &mut dw_t);
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("{kc} {phases:?}: AVX-512 only");
    }
    let dy = &dy[samples.start * g.output_len()..samples.end * g.output_len()];
    (dw_t, chunk_bias_grad(bias, dy, g.c_out, g.out_plane()))
}

#[cfg(target_arch = "x86_64")]
mod tiles {
    use super::{CHANNELS, Conv2dGeometry, LANES, MaybeUninit, ROWS, TAPS, TAPS_1D, phase_rows};
    use crate::kernels::cpu::first_lanes;
    use crate::kernels::cpu::row_phases::{
        column_phase, load_row, next_lane, row_masks, store_interleaved,
    };
    use std::arch::x86_64::*;

    /// The column phases of one sample (see the module docs), `[ci][kx][phase row][LANES]`;
    /// rows outside the image are left as they are (zeros: `phases` starts zeroed, and no
    /// sample writes them).
    ///
    /// # Safety
    /// AVX-512F; `g` passed [`super::applies`]; `x` is one sample, `phases` holds
    /// `c_in · kw · phase_rows · LANES` floats.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn phases(g: &Conv2dGeometry, x: &[f32], phases: &mut [f32]) {
        let ([h, w], kw, pad) = (g.input, g.kernel[1], g.pad_begin[1]);
        let prows = phase_rows(g);
        assert!(x.len() == g.input_len() && phases.len() == g.c_in * kw * prows * LANES);
        // Per phase, the lane → input column permutation and the lanes inside the row.
        let phase: Vec<(__m512i, u16)> = (0..kw)
            .map(|kx| column_phase(kx as isize - pad as isize))
            .collect();
        let (x, out, row) = (x.as_ptr(), phases.as_mut_ptr(), row_masks(w));
        for ci in 0..g.c_in {
            for iy in 0..h.min(prows - pad) {
                // SAFETY: input row `iy` has `w` floats.
                let (a, b) = unsafe { load_row(x.add((ci * h + iy) * w), row) };
                for (kx, &(idx, inside)) in phase.iter().enumerate() {
                    let v = _mm512_maskz_permutex2var_ps(inside, a, idx, b);
                    let at = ((ci * kw + kx) * prows + iy + pad) * LANES;
                    // SAFETY: `iy + pad < prows`, so the vector lies in `phases`.
                    unsafe { _mm512_storeu_ps(out.add(at), v) };
                }
            }
        }
    }

    /// One sample's forward pass from its phases (see [`super::forward`]).
    ///
    /// # Safety
    /// AVX-512F; `g` passed [`super::applies`]; `phases` is [`phases`]' output, `offsets` and
    /// `packed` are `forward`'s, `y` one sample's output.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn forward_sample(
        g: &Conv2dGeometry,
        phases: &[f32],
        offsets: &[usize],
        packed: &[f32],
        bias: Option<&[f32]>,
        kc: usize,
        y: &mut [MaybeUninit<f32>],
    ) {
        let [oh, ow] = g.output;
        let rows = offsets.len();
        assert!(y.len() == g.output_len() && packed.len() == g.c_out * rows && kc > 0);
        let reach = offsets
            .iter()
            .max()
            .map_or(0, |&o| o + 2 * (oh - 1) * LANES + LANES);
        assert!(reach <= phases.len(), "phases too short");
        let sample = Sample {
            phases: phases.as_ptr(),
            offsets,
            kc,
            ow,
            plane: oh * ow,
            y: y.as_mut_ptr().cast(),
        };
        for tile in 0..g.c_out / CHANNELS {
            let w = &packed[tile * rows * CHANNELS..(tile + 1) * rows * CHANNELS];
            let b = bias.map(|b| &b[tile * CHANNELS..(tile + 1) * CHANNELS]);
            let mut oy = 0;
            while oy + ROWS <= oh {
                // SAFETY: rows `oy … oy + ROWS` exist; the asserts bound the phases read.
                unsafe { sample.tile::<ROWS>(tile, oy, w, b) };
                oy += ROWS;
            }
            if oy < oh {
                // SAFETY: as above, one row.
                unsafe { sample.tile::<1>(tile, oy, w, b) };
            }
        }
    }

    /// What [`forward_sample`]'s register tiles share.
    struct Sample<'a> {
        phases: *const f32,
        offsets: &'a [usize],
        kc: usize,
        ow: usize,
        plane: usize,
        y: *mut f32,
    }

    impl Sample<'_> {
        /// Output rows `oy … oy + R` of the channel tile `tile`, whose packed weights are `w`.
        ///
        /// # Safety
        /// AVX-512F; those rows and channels exist, and every row's phases lie in `phases`.
        #[target_feature(enable = "avx512f")]
        unsafe fn tile<const R: usize>(
            &self,
            tile: usize,
            oy: usize,
            w: &[f32],
            bias: Option<&[f32]>,
        ) {
            let lanes = first_lanes(self.ow);
            let rows = self.offsets.len();
            let mut start = 0;
            while start < rows {
                let end = rows.min(start + self.kc);
                let mut acc = [[_mm512_setzero_ps(); CHANNELS]; R];
                // A plain range (a `Skip` iterator here was a call, which spilled the sums).
                for r in start..end {
                    let offset = self.offsets[r];
                    // SAFETY: the caller's contract: output row `oy + i` reads phase row
                    // `2·(oy + i) + ky` of the row's phase.
                    let inputs: [__m512; R] = std::array::from_fn(|i| unsafe {
                        _mm512_loadu_ps(self.phases.add(offset + 2 * (oy + i) * LANES))
                    });
                    // A fixed-size row: the loops unroll and the sums stay in registers.
                    let w: &[f32; CHANNELS] = w[r * CHANNELS..][..CHANNELS].try_into().unwrap();
                    for c in 0..CHANNELS {
                        let wc = _mm512_set1_ps(w[c]);
                        for i in 0..R {
                            acc[i][c] = _mm512_fmadd_ps(inputs[i], wc, acc[i][c]);
                        }
                    }
                }
                for (i, acc) in acc.iter().enumerate() {
                    for (c, &sum) in acc.iter().enumerate() {
                        let co = tile * CHANNELS + c;
                        let at = self.y.wrapping_add(co * self.plane + (oy + i) * self.ow);
                        // SAFETY: `at` starts output row `oy + i` of channel `co`, whose `ow`
                        // floats the mask keeps to.
                        let v = unsafe {
                            match (start, bias) {
                                (0, None) => sum,
                                (0, Some(b)) => _mm512_add_ps(_mm512_set1_ps(b[c]), sum),
                                _ => _mm512_add_ps(_mm512_maskz_loadu_ps(lanes, at), sum),
                            }
                        };
                        // SAFETY: as just said.
                        unsafe { _mm512_mask_storeu_ps(at, lanes, v) };
                    }
                }
                start = end;
            }
        }
    }

    /// One sample's input gradient (see [`super::input_grad`]): per input channel, its column
    /// entries for every output row into `cols` (`[tap][oy][LANES]`), then its input rows from
    /// them.
    ///
    /// # Safety
    /// AVX-512F; `g` passed [`super::applies`]; `dy` and `dx` are one sample's, `cols` holds
    /// `TAPS · oh · LANES` floats.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn input_grad_sample(
        g: &Conv2dGeometry,
        weight: &[f32],
        dy: &[f32],
        kc: usize,
        cols: &mut [f32],
        dx: &mut [MaybeUninit<f32>],
    ) {
        let [oh, ow] = g.output;
        assert!(dy.len() == g.output_len() && dx.len() == g.input_len());
        assert!(weight.len() == g.weight_len() && cols.len() == TAPS * oh * LANES && kc > 0);
        for ci in 0..g.c_in {
            let mut oy = 0;
            while oy + ROWS <= oh {
                // SAFETY: the asserts above bound every row, tap and channel these read and
                // write.
                unsafe { columns::<ROWS>(g, weight, dy, kc, [ci, oy], cols) };
                oy += ROWS;
            }
            if oy < oh {
                // SAFETY: as above, one row.
                unsafe { columns::<1>(g, weight, dy, kc, [ci, oy], cols) };
            }
            let plane = &mut dx[ci * g.in_plane()..(ci + 1) * g.in_plane()];
            // SAFETY: `cols` holds this channel's entries; `plane` is its gradient.
            unsafe { add_taps(g, cols, plane, ow) };
        }
    }

    /// Column entries `(ci, tap)` of output rows `oy … oy + R` for every tap: chains over the
    /// output channels in depth blocks of `kc`, the first block stored, the others added.
    ///
    /// # Safety
    /// AVX-512F; rows `oy … oy + R` exist, and the slices are [`input_grad_sample`]'s.
    #[target_feature(enable = "avx512f")]
    unsafe fn columns<const R: usize>(
        g: &Conv2dGeometry,
        weight: &[f32],
        dy: &[f32],
        kc: usize,
        [ci, oy]: [usize; 2],
        cols: &mut [f32],
    ) {
        let ([oh, ow], plane) = (g.output, g.out_plane());
        let lanes = first_lanes(ow);
        let (dy, out) = (dy.as_ptr(), cols.as_mut_ptr());
        let mut start = 0;
        while start < g.c_out {
            let end = g.c_out.min(start + kc);
            let mut acc = [[_mm512_setzero_ps(); TAPS]; R];
            for co in start..end {
                // SAFETY: output row `oy + r` of channel `co` has `ow` floats (the mask).
                let grads: [__m512; R] = std::array::from_fn(|r| unsafe {
                    _mm512_maskz_loadu_ps(lanes, dy.add(co * plane + (oy + r) * ow))
                });
                // A fixed-size row: the loops unroll and the sums stay in registers.
                let w: &[f32; TAPS] = weight[(co * g.c_in + ci) * TAPS..][..TAPS]
                    .try_into()
                    .unwrap();
                for t in 0..TAPS {
                    let wt = _mm512_set1_ps(w[t]);
                    for r in 0..R {
                        acc[r][t] = _mm512_fmadd_ps(grads[r], wt, acc[r][t]);
                    }
                }
            }
            for (r, acc) in acc.iter().enumerate() {
                for (t, &sum) in acc.iter().enumerate() {
                    // SAFETY: entry (tap `t`, row `oy + r`) lies in `cols` (`[TAPS][oh][LANES]`).
                    unsafe { store_or_add(out.add((t * oh + oy + r) * LANES), sum, start == 0) };
                }
            }
            start = end;
        }
    }

    /// One sample's weight gradient from its phases and its output gradient pixel-major
    /// (`dy_t`, `[pixel][c_out]`), onto `dw_t` (`[rows][c_out]`): stored where `accumulate` is
    /// false (the chunk's first sample), else added.
    ///
    /// # Safety
    /// AVX-512F; `g` passed [`super::weight_grad_applies`]; `phases` is [`phases`]' output for
    /// the sample.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn weight_grad_sample(
        g: &Conv2dGeometry,
        phases: &[f32],
        dy_t: &[f32],
        kc: usize,
        accumulate: bool,
        dw_t: &mut [f32],
    ) {
        let prows = phase_rows(g);
        assert!(dy_t.len() == g.output_len() && dw_t.len() == g.weight_len() && kc > 0);
        assert!(phases.len() == g.c_in * TAPS_1D * prows * LANES);
        assert!(2 * (g.output[0] - 1) + TAPS_1D <= prows && g.output[1] <= LANES);
        let channels = Channels {
            dy_t: dy_t.as_ptr(),
            dw_t: dw_t.as_mut_ptr(),
            c_out: g.c_out,
            output: g.output,
            kc,
            accumulate,
        };
        for ci in 0..g.c_in {
            // Where tap `(ky, kx)` of output pixel (0, 0) reads its input in the phases.
            let taps: [usize; TAPS] = std::array::from_fn(|t| {
                ((ci * TAPS_1D + t % TAPS_1D) * prows + t / TAPS_1D) * LANES
            });
            let mut co = 0;
            while co < g.c_out {
                // SAFETY: the asserts bound every phase row and channel the tile touches.
                unsafe {
                    if co + 2 * LANES <= g.c_out {
                        channels.tile::<2>(phases.as_ptr(), &taps, ci, co);
                        co += 2 * LANES;
                    } else {
                        channels.tile::<1>(phases.as_ptr(), &taps, ci, co);
                        co += LANES;
                    }
                }
            }
        }
    }

    /// What [`weight_grad_sample`]'s register tiles share.
    struct Channels {
        dy_t: *const f32,
        dw_t: *mut f32,
        c_out: usize,
        output: [usize; 2],
        kc: usize,
        accumulate: bool,
    }

    impl Channels {
        /// Elements `(co … co + 16·V, ci·9 + tap)` for the nine taps: chains over the pixels in
        /// depth blocks of `kc`.
        ///
        /// # Safety
        /// AVX-512F; those channels exist, and every pixel's taps lie in `phases`.
        #[target_feature(enable = "avx512f")]
        unsafe fn tile<const V: usize>(
            &self,
            phases: *const f32,
            taps: &[usize; TAPS],
            ci: usize,
            co: usize,
        ) {
            let [oh, ow] = self.output;
            let pixels = oh * ow;
            let mut start = 0;
            while start < pixels {
                let end = pixels.min(start + self.kc);
                let mut acc = [[_mm512_setzero_ps(); TAPS]; V];
                let (mut oy, mut ox) = (start / ow, start % ow);
                for p in start..end {
                    let row = 2 * oy * LANES + ox;
                    // SAFETY: pixel `p`'s output gradients for these channels, and its taps'
                    // inputs (the caller's contract).
                    unsafe {
                        let grads: [__m512; V] = std::array::from_fn(|v| {
                            _mm512_loadu_ps(self.dy_t.add(p * self.c_out + co + v * LANES))
                        });
                        for t in 0..TAPS {
                            let input = _mm512_set1_ps(*phases.add(taps[t] + row));
                            for v in 0..V {
                                acc[v][t] = _mm512_fmadd_ps(grads[v], input, acc[v][t]);
                            }
                        }
                    }
                    ox += 1;
                    if ox == ow {
                        (oy, ox) = (oy + 1, 0);
                    }
                }
                for (v, acc) in acc.iter().enumerate() {
                    for (t, &sum) in acc.iter().enumerate() {
                        let at = (ci * TAPS + t) * self.c_out + co + v * LANES;
                        let fresh = start == 0 && !self.accumulate;
                        // SAFETY: element row `ci·9 + t`, channels `co + 16v …` lie in `dw_t`.
                        unsafe { store_or_add(self.dw_t.add(at), sum, fresh) };
                    }
                }
                start = end;
            }
        }
    }

    /// `sum` stored at `at` where `fresh` (a chain's first depth block), else added onto what is
    /// there (gemm's later blocks and samples).
    ///
    /// # Safety
    /// AVX-512F; 16 floats at `at` are readable and writable.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn store_or_add(at: *mut f32, sum: __m512, fresh: bool) {
        // SAFETY: the caller's contract.
        unsafe {
            let v = if fresh {
                sum
            } else {
                _mm512_add_ps(_mm512_loadu_ps(at), sum)
            };
            _mm512_storeu_ps(at, v);
        }
    }

    /// One input channel's gradient from its column entries, row by row: the even and the odd
    /// columns each add their taps in `(ky, kx)` order onto +0 (col2im's order), then are
    /// interleaved.
    ///
    /// # Safety
    /// AVX-512F; `cols` is [`columns`]' output for this channel, `plane` its gradient.
    #[target_feature(enable = "avx512f")]
    unsafe fn add_taps(
        g: &Conv2dGeometry,
        cols: &[f32],
        plane: &mut [MaybeUninit<f32>],
        ow: usize,
    ) {
        let ([h, w], [kh, kw], pad) = (g.input, g.kernel, g.pad_begin[0] as isize);
        let oh = g.output[0];
        assert!(plane.len() == h * w && cols.len() == kh * kw * oh * LANES);
        // Output column `j + 1` into lane `j`, for the lanes whose `j + 1` exists.
        let next_lanes = first_lanes(ow - 1);
        let (out, row) = (plane.as_mut_ptr().cast::<f32>(), row_masks(w));
        for iy in 0..h {
            let (mut even, mut odd) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            for ky in 0..kh {
                let u = iy as isize + pad - ky as isize;
                if u < 0 || u % 2 != 0 || u / 2 >= oh as isize {
                    continue;
                }
                let oy = (u / 2) as usize;
                for kx in 0..kw {
                    // SAFETY: (tap, row `oy`) lies in `cols`.
                    let col = unsafe {
                        _mm512_loadu_ps(cols.as_ptr().add(((ky * kw + kx) * oh + oy) * LANES))
                    };
                    // Input column `2·ox + kx − pad`: even at `ox`, odd at `ox` or `ox + 1`.
                    match kx as isize - pad {
                        0 => even = _mm512_add_ps(even, col),
                        1 => odd = _mm512_add_ps(odd, col),
                        _ => odd = _mm512_add_ps(odd, next_lane(next_lanes, col)),
                    }
                }
            }
            // SAFETY: input row `iy` has `w` floats.
            unsafe { store_interleaved(out.add(iy * w), row, even, odd) };
        }
    }
}
