//! Forward passes and input gradients of convolutions on small feature maps (at most 8×8
//! outputs: CNN2–CNN4's 8×8, 7×7, 4×4 and 3×3 maps, VGG-16's 4×4 and 2×2, and on 1×28×28
//! inputs ResNet-20's and VGG-16's 7×7; on AVX-512 also the 14×14 maps of 1×28×28 inputs and
//! CNN1–CNN4's 16×16 maps under 5×5 kernels), vectorised across
//! 16 samples instead of across pixels, bit for bit the path they replace.
//!
//! On a small map most border pixels read the zero padding with many of their taps: a 5×5
//! kernel on a 7×7 map spends 31% of its multiply-adds on it, on 3×3 64%, a 3×3 kernel on 2×2
//! 56%; the direct kernels' wide rows add a third to a half more on 8×8 maps, and an eighth on
//! 14×14 ones (rows of 14 in vectors of 16). Sixteen samples at
//! one pixel read the padding with the same taps, so a vector of them skips exactly those, and
//! no product is spent on thrown-away columns or column matrices.
//!
//! Each sum keeps the order of additions of the path the layer would otherwise take:
//! - the direct kernels (`direct.rs`): the forward pass an FMA chain from the bias over the taps
//!   in weight order; the input gradient, tap by tap in (ky, kx) order, a chain over the output
//!   channels from zero added onto the gradient;
//! - im2col + gemm: gemm splits its inner dimension into depth blocks (`kc`, sized from the L1
//!   cache: `gemm_common::cache::kernel_params`, which [`Order::for_geometry`] calls too), chains
//!   each block from zero and adds it onto the output (the forward pass's bias first, the input
//!   gradient's column entries from zero); col2im then adds a pixel's taps in (ky, kx) order.
//!
//! A batch that does not fill its last vector to more than half leaves those samples to the
//! path this kernel replaces, run alongside ([`split`]).
//!
//! A skipped product is a zero added to a sum that is never −0 (chains start at +0, or at the
//! bias: a bias holding −0 keeps the direct kernel), so skipping it changes no bit (with finite
//! weights). Threads split samples and channels; no sum crosses a task, so the result does not
//! depend on their number.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use super::{Aligned, Conv2dGeometry, PassPath, common_depth_block, written_whole_with_spare};
use crate::kernels::direct;
use crate::kernels::isa::{Isa, uses};

/// Samples per vector ([`Lanes16`](crate::kernels::lanes16::Lanes16): one AVX-512 register or two AVX2 ones).
const LANES: usize = 16;
/// Channels per packed weight tile (one cache line of a tap's weights) and per task.
const TILE: usize = 16;
/// Channels per register tile on AVX-512: a task runs its tile's two halves one after the
/// other, each with 8 × [`PAIR`] running sums, so each weight broadcast feeds two vectors of
/// samples (one broadcast per multiply-add kept two load ports as busy as the two FMA ports).
const PART: usize = 8;
/// Channels per register tile on AVX2 (16 registers of 8 lanes): 6 × one group of samples,
/// 12 registers of running sums (with 4, 8 chains were just enough to cover the FMA latency
/// and the loop left the FMA ports idle a third of the time); the tile's last part is
/// [`REST_AVX2`] channels.
const PART_AVX2: usize = 6;
/// The last part of a tile on AVX2: 16 = 6 + 6 + 4.
const REST_AVX2: usize = TILE % PART_AVX2;
/// Groups of samples per task (two vectors of samples per register tile).
const PAIR: usize = 2;
/// The forward pass's input channels per chunk read about this many bytes of input (the L1
/// cache holds them and the chunk's weights while every output pixel reads them).
const CHUNK_BYTES: usize = 32 << 10;
/// [`CHUNK_BYTES`] on AVX2, where a chunk's planes are one group's, not two: half as many
/// bytes, so that CNN3's 8×8 layer under 5×5 kernels holds 16 KiB of inputs and 6 KiB of
/// weights per chunk, not 32 and 13 (more than a 32 KiB L1; forward 5–20% faster across
/// CNN3's and VGG-16's small maps, `fl bench --kernels`, one thread, best of four).
const CHUNK_BYTES_AVX2: usize = 16 << 10;
/// The largest map this kernel takes for its padding alone (8×8); bigger maps waste little on
/// padding.
const MAX_PIXELS: usize = 64;
/// The largest map this kernel takes on AVX-512 where the direct kernels also waste lanes on
/// rows narrower than their vectors (14×14 under 3×3 kernels, 14×14 and 16×16 under 5×5: see
/// [`takes_map`]). On 28×28 and 32×32 maps a chunk holds one input channel, and the running
/// sums' loads and stores per channel made it 10–25% slower than the direct kernels.
const MAX_PIXELS_WIDE: usize = 256;
/// On those maps, the share of the direct kernels' products that read the input (`fl bench
/// --kernels`, one thread, AVX-512) at or below which this kernel takes the map: 79% on 14×14
/// maps under 3×3 kernels (forward 8–10%, input gradient 9–14% faster here on Zen 4; the
/// forward pass now stays direct, [`forward_stays_direct`]), 73% and 86% on
/// 14×14 and 16×16 maps under 5×5 kernels (25% and 8–10%); 92% on 16×16 maps under 3×3 kernels
/// stays direct (5–11% slower across samples).
const WIDE_USEFUL_PERCENT: usize = 88;

/// The order of additions to reproduce (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Order {
    /// The forward chain starts from the bias (direct kernels) rather than adding it first.
    from_bias: bool,
    /// Forward depth block over `c_in·kh·kw` (the whole depth for the direct kernels).
    forward_kc: usize,
    /// Input-gradient depth block over `c_out`.
    input_kc: usize,
}

impl Order {
    /// The order of the path `g` takes without this kernel, or `None` where this kernel does
    /// not apply (see [`applies`]) or cannot reproduce it: gemm blocks that differ between the
    /// im2col path's sample groups, or a bias holding −0 on the direct path.
    pub(super) fn for_geometry(g: &Conv2dGeometry, bias: Option<&[f32]>) -> Option<Self> {
        if !applies(g) {
            return None;
        }
        let rows = g.col_rows();
        if crate::kernels::direct::applies(g) {
            let negative_zero = bias.is_some_and(|b| b.iter().any(|v| v.to_bits() == 1 << 31));
            return (!negative_zero).then_some(Order {
                from_bias: true,
                forward_kc: rows,
                input_kc: g.c_out,
            });
        }
        // The im2col path runs one gemm per group of samples; the last group may be narrower.
        let widths = g.group_widths(g.group());
        let blocks = |m: usize, k: usize| common_depth_block(m, &widths, k);
        Some(Order {
            from_bias: false,
            forward_kc: blocks(g.c_out, rows)?,
            input_kc: blocks(rows, g.c_out)?,
        })
    }
}

/// Whether this kernel takes `g`: an AVX-512 CPU or one with AVX2 and FMA, a map [`takes_map`]
/// takes (on AVX-512 also some 14×14 and 16×16 maps), that is, for small maps, one of at most
/// [`MAX_PIXELS`] outputs whose taps read the padding at least 15% of the time (`fl bench
/// --kernels`, one thread, AVX-512: 7×7 maps under 3×3 kernels, 18% padding, run 9–16% faster
/// here than on the direct kernels; 8×8 ones, 16%, 10–18% faster since the layout copies run
/// in registers; 16×16 ones, 8%, stay on the direct kernels; AVX2 and strides: see
/// [`takes_map`]),
/// enough samples to fill three quarters of the vectors, and enough channels to fill three
/// quarters of the tiles.
fn applies(g: &Conv2dGeometry) -> bool {
    let full = |n: usize, width: usize| n > 0 && 4 * n >= 3 * n.next_multiple_of(width);
    cfg!(target_arch = "x86_64")
        && takes_map(g)
        && full(g.batch, LANES)
        && full(g.c_out, TILE)
        && full(g.c_in, TILE)
        && uses(Isa::Avx2)
}

/// On AVX-512, a stride-1 map of at most [`MAX_PIXELS_WIDE`] outputs where few enough of the
/// direct kernels' products read the input ([`WIDE_USEFUL_PERCENT`]; the FedAvg CNN's unpadded
/// 8×8 layer on 1×28×28 inputs, 67%, runs its forward pass and input gradient 40% faster here
/// and trains 13–17% faster). Otherwise also a map of at
/// most [`MAX_PIXELS`] outputs whose taps read the padding at least 15% of the
/// time (25% on AVX2), or any such map of a strided convolution (whose other path is im2col,
/// not the direct kernels: ResNet-20's stride-2 layer into its 8×8 stage, 8% padding, trains
/// about 1% faster and evaluates 6% faster this way). AVX2's register tiles are 6 channels ×
/// one vector of samples, not 8 × 2: there the direct kernels stay as fast on 8×8 and 7×7 maps
/// under 3×3 kernels (16% and 18% padding: with these tiles, ResNet-20's, VGG-16's and CNN4's
/// 8×8 layers ran 0–20% slower across samples, `fl bench --kernels`, best of three; with tiles
/// of 4 the forward pass ran at 35–40% of the FMA peak against 45–55% direct), while 8×8 maps
/// under 5×5 kernels (28%) and the smaller maps gain.
fn takes_map(g: &Conv2dGeometry) -> bool {
    let kernel_taps = g.kernel[0] * g.kernel[1];
    // The direct kernels' wide rows waste lanes on small unpadded maps too (the FedAvg CNN's
    // 8×8 layer on 1×28×28 inputs: 64 of 96 lanes), so on AVX-512 their share is checked on
    // every map up to `MAX_PIXELS_WIDE`, not only past `MAX_PIXELS`.
    let wide_wastes = || {
        uses(Isa::Avx512)
            && g.stride == [1, 1]
            && g.kernel.iter().all(|&k| k > 1)
            && 100 * valid_taps_total(g)
                <= WIDE_USEFUL_PERCENT * direct::forward_lanes(g) * kernel_taps
    };
    if (MAX_PIXELS + 1..=MAX_PIXELS_WIDE).contains(&g.out_plane()) {
        return wide_wastes();
    }
    let valid_percent = if uses(Isa::Avx512) { 85 } else { 75 };
    (1..=MAX_PIXELS).contains(&g.out_plane())
        && (g.stride != [1, 1]
            || 100 * valid_taps_total(g) <= valid_percent * g.out_plane() * kernel_taps
            || wide_wastes())
}

/// Whether `g`'s forward pass stays on the direct kernels although this kernel takes its map
/// (its input gradient still runs here): on AVX-512, a stride-1 3×3 layer on a map past
/// [`MAX_PIXELS`] (the 14×14 maps of 1×28×28 inputs). Measured on an Intel Xeon with two
/// 512-bit FMA ports (`fl bench --kernels --threads 1`, three alternating runs, share of the
/// peak): ResNet-20's 32 → 32 layer forward 72–75% direct against 56–66% here, input gradient
/// 61–62% against 66–72%; VGG-16's 128 → 128 forward 70–75% against 66–74%, input gradient
/// 50–56% against 70–78%. Both paths sum in the same order, so the choice changes no bit.
/// (On Zen 4 this kernel ran ResNet-20's forward pass there 8–10% faster; on the 16×16 maps
/// under 5×5 kernels it stays faster on the Xeon too, forward 92–98% against 89–93%.)
pub(super) fn forward_stays_direct(g: &Conv2dGeometry) -> bool {
    uses(Isa::Avx512)
        && g.kernel == [3, 3]
        && g.stride == [1, 1]
        && g.out_plane() > MAX_PIXELS
        && crate::kernels::direct::applies(g)
}

/// The (pixel, tap) pairs of one channel whose tap reads the input, not the padding.
fn valid_taps_total(g: &Conv2dGeometry) -> usize {
    let axis = |a: usize| -> usize {
        (0..g.output[a])
            .map(|o| {
                let (lo, hi) = valid_taps(o, g.kernel[a], g.stride[a], g.pad_begin[a], g.input[a]);
                hi - lo
            })
            .sum()
    };
    axis(0) * axis(1)
}

/// `[batch, channels, pixels]` as `[groups][channels][pixels][LANES]` (or `[pixels][channels]`
/// with `pixel_major`), zeros for the missing samples of the last group. A group per task,
/// 16 × 16 blocks transposed in registers (one scalar store per value was most of the time).
fn to_lanes(
    values: &[f32],
    batch: usize,
    channels: usize,
    pixels: usize,
    pixel_major: bool,
) -> Aligned {
    let per_sample = channels * pixels;
    let fill = |out: &mut [MaybeUninit<f32>]| {
        out.par_chunks_mut(per_sample * LANES)
            .zip(values.par_chunks(per_sample * LANES))
            .for_each(|(dst, src)| {
                let at = |i: usize| {
                    if pixel_major {
                        (i % pixels) * channels + i / pixels
                    } else {
                        i
                    }
                };
                to_lanes_group(src, per_sample, dst, at);
            })
    };
    // SAFETY: `at` maps the `per_sample` values onto all of a group's vectors, and
    // `to_lanes_group` writes each (zeros in the missing samples' lanes).
    unsafe { Aligned::written_whole(batch.div_ceil(LANES) * per_sample * LANES, fill) }
}

/// The forward pass, the same contract and bits as `cpu::conv2d_forward` (with `order` from
/// [`Order::for_geometry`]).
pub(super) fn forward(
    g: &Conv2dGeometry,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    order: Order,
) -> Vec<f32> {
    let (head, tail) = split(g, order);
    let Some(tail) = tail else {
        return forward_head(g, x, weight, bias, order, 0);
    };
    let at = head.batch * g.input_len();
    let (mut y, rest) = rayon::join(
        || {
            forward_head(
                &head,
                &x[..at],
                weight,
                bias,
                order,
                tail.batch * g.output_len(),
            )
        },
        || super::forward_on(PassPath::replaced(&tail), &tail, &x[at..], weight, bias),
    );
    y.extend_from_slice(&rest);
    y
}

/// [`forward`] on whole vectors of samples, its result with room for `spare` more floats.
fn forward_head(
    g: &Conv2dGeometry,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    order: Order,
    spare: usize,
) -> Vec<f32> {
    let rows = g.col_rows();
    let tiles = g.c_out.div_ceil(TILE);
    // Weights as [tiles][rows][TILE]: a tap's broadcasts read one cache line. The output
    // channels are the "samples" of `to_lanes`, transposed 16 × 16 in registers.
    let packed = to_lanes(weight, g.c_out, rows, 1, false);
    let mut bias_padded = vec![0.0f32; tiles * TILE];
    if let Some(b) = bias {
        bias_padded[..g.c_out].copy_from_slice(b);
    }
    let xs = to_lanes(x, g.batch, g.c_in, g.in_plane(), false);
    let task = |group: usize, tile: usize, dst: &mut [MaybeUninit<f32>]| {
        let len = g.input_len() * LANES;
        let x_group = |i: usize| &xs[(group + i) * len..][..len];
        let w_tile = &packed[tile * rows * TILE..][..rows * TILE];
        let b_tile = &bias_padded[tile * TILE..][..TILE];
        if dst.len() == PAIR * g.out_plane() * TILE * LANES {
            forward_groups(g, order, [x_group(0), x_group(1)], w_tile, b_tile, dst);
        } else {
            forward_groups(g, order, [x_group(0)], w_tile, b_tile, dst);
        }
    };
    // SAFETY: `forward_tile` stores every output of its groups' tile.
    unsafe { per_tile([g.batch, g.c_out, g.out_plane()], spare, task) }
}

/// One group of [`to_lanes`] on the active tier (see `tiles::to_lanes_group`).
fn to_lanes_group(
    src: &[f32],
    per_sample: usize,
    dst: &mut [MaybeUninit<f32>],
    at: impl Fn(usize) -> usize,
) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: this kernel runs only where `applies` checked the tier; `to_lanes_group` checks
    // the lengths.
    unsafe {
        if uses(Isa::Avx512) {
            tiles::to_lanes_avx512(src, per_sample, dst, at);
        } else {
            tiles::to_lanes_avx2(src, per_sample, dst, at);
        }
    }
}

/// `tiles::forward_tile` for `V` groups of samples on the active tier: at once on AVX-512,
/// one after the other on AVX2 (whose registers hold [`PART_AVX2`] × one group of sums).
fn forward_groups<const V: usize>(
    g: &Conv2dGeometry,
    order: Order,
    x: [&[f32]; V],
    w: &[f32],
    bias: &[f32],
    out: &mut [MaybeUninit<f32>],
) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `applies` checked the tier; the callers' slices have the lengths `forward_tile`
    // requires, `out` `V` groups' outputs.
    unsafe {
        if uses(Isa::Avx512) {
            tiles::forward_avx512::<V, PART, 0>(g, order, x, w, bias, out);
        } else {
            for (x, out) in x.into_iter().zip(out.chunks_exact_mut(out.len() / V)) {
                tiles::forward_avx2::<1, PART_AVX2, REST_AVX2>(g, order, [x], w, bias, out);
            }
        }
    }
}

/// `tiles::input_grad_tile` for `V` groups of samples on the active tier, as
/// [`forward_groups`].
fn input_grad_groups<const V: usize>(
    g: &Conv2dGeometry,
    order: Order,
    dy: [&[f32]; V],
    w: &[f32],
    out: &mut [MaybeUninit<f32>],
) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: as in `forward_groups`, for `input_grad_tile`.
    unsafe {
        if uses(Isa::Avx512) {
            tiles::input_grad_avx512::<V, PART, 0>(g, order, dy, w, out);
        } else {
            for (dy, out) in dy.into_iter().zip(out.chunks_exact_mut(out.len() / V)) {
                tiles::input_grad_avx2::<1, PART_AVX2, REST_AVX2>(g, order, [dy], w, out);
            }
        }
    }
}

/// Runs `task(group, tile, out)` on the thread pool for every pair of groups of [`LANES`]
/// samples (the last one alone where their count is odd) and tile of `channels`, each writing
/// the whole of a `[groups][pixels][TILE][LANES]` block (one or two groups of samples) into
/// its thread's scratch, which the same task then transposes into its samples' tile of
/// channels of the result `[batch, channels, pixels]` (with room for `spare` more floats).
///
/// Transposing in the task, from a block still in cache, spares a pass over a tiled copy of
/// the whole result and a parallel region (whose three tasks for batches of 50, on two
/// threads, left one waiting for a third of it).
///
/// # Safety
/// `task` writes every float of the block it is given.
unsafe fn per_tile(
    [batch, channels, pixels]: [usize; 3],
    spare: usize,
    task: impl Fn(usize, usize, &mut [MaybeUninit<f32>]) + Sync,
) -> Vec<f32> {
    let (groups, tiles) = (batch.div_ceil(LANES), channels.div_ceil(TILE));
    let pairs = groups.div_ceil(PAIR);
    let group_len = pixels * TILE * LANES;
    let fill = |out: &mut [MaybeUninit<f32>]| {
        if out.is_empty() {
            return;
        }
        // Each task's parts of the result, tile-major: its tile's channels of each sample of
        // its groups.
        let mut parts: Vec<Vec<&mut [MaybeUninit<f32>]>> = (0..tiles * pairs)
            .map(|_| Vec::with_capacity(PAIR * LANES))
            .collect();
        for (sample, planes) in out.chunks_mut(channels * pixels).enumerate() {
            for (tile, part) in planes.chunks_mut(TILE * pixels).enumerate() {
                parts[tile * pairs + sample / (PAIR * LANES)].push(part);
            }
        }
        parts
            .into_par_iter()
            .enumerate()
            .for_each(|(i, mut parts)| {
                let (tile, group) = (i / pairs, PAIR * (i % pairs));
                let len = (groups - group).min(PAIR) * group_len;
                with_scratch(len, |block| {
                    task(group, tile, &mut *block);
                    // SAFETY: `block` is initialised memory (see `with_scratch`), which `task`
                    // wrote whole with `f32` values.
                    let block: &[f32] =
                        unsafe { &*(block as *const [MaybeUninit<f32>] as *const [f32]) };
                    for (src, samples) in block.chunks(group_len).zip(parts.chunks_mut(LANES)) {
                        #[cfg(target_arch = "x86_64")]
                        // SAFETY: this kernel runs only where `applies` checked the tier; `src`
                        // is one group's block of the tile, `samples` that group's parts.
                        unsafe {
                            if uses(Isa::Avx512) {
                                tiles::from_lanes_avx512(src, pixels, samples);
                            } else {
                                tiles::from_lanes_avx2(src, pixels, samples);
                            }
                        }
                    }
                })
            })
    };
    // SAFETY: the parts cover the result, and each task writes every float of its parts
    // (`from_lanes_tile`).
    unsafe { written_whole_with_spare(batch * channels * pixels, spare, fill) }
}

thread_local! {
    /// This thread's scratch for [`per_tile`]'s blocks, kept between calls (a fresh one each
    /// time would take its page faults again).
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` on `len` floats of this thread's scratch, starting at a cache line (a fresh
/// buffer where the scratch is in use further up this thread's stack). The floats are
/// initialised memory holding earlier values: `f` may only write `f32` values into them.
fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [MaybeUninit<f32>]) -> R) -> R {
    let run = |buf: &mut Vec<f32>| {
        let spare = 64 / size_of::<f32>();
        if buf.len() < len + spare {
            buf.resize(len + spare, 0.0);
        }
        let start = buf.as_ptr().align_offset(64).min(spare - 1);
        let window = &mut buf[start..start + len];
        // SAFETY: `MaybeUninit<f32>` has `f32`'s layout; the floats are initialised, and `f`
        // writes only `f32` values (the contract above).
        f(unsafe { &mut *(window as *mut [f32] as *mut [MaybeUninit<f32>]) })
    };
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => run(&mut buf),
        Err(_) => run(&mut Vec::new()),
    })
}

/// The input gradient, the same contract and bits as `cpu::conv2d_input_grad`.
pub(super) fn input_grad(g: &Conv2dGeometry, weight: &[f32], dy: &[f32], order: Order) -> Vec<f32> {
    let (head, tail) = split(g, order);
    let Some(tail) = tail else {
        return input_grad_head(g, weight, dy, order, 0);
    };
    let at = head.batch * g.output_len();
    let (mut dx, rest) = rayon::join(
        || input_grad_head(&head, weight, &dy[..at], order, tail.batch * g.input_len()),
        || super::input_grad_on(PassPath::replaced(&tail), &tail, weight, &dy[at..]),
    );
    dx.extend_from_slice(&rest);
    dx
}

/// [`input_grad`] on whole vectors of samples, its result with room for `spare` more floats.
fn input_grad_head(
    g: &Conv2dGeometry,
    weight: &[f32],
    dy: &[f32],
    order: Order,
    spare: usize,
) -> Vec<f32> {
    let taps = g.kernel[0] * g.kernel[1];
    let tiles = g.c_in.div_ceil(TILE);
    // Weights as [tiles][taps][c_out][TILE]: per output channel, a tap's input channels in one
    // cache line. A tile per task; per output channel, its tile's taps are one contiguous
    // `[TILE][taps]` block, transposed in registers (VGG-16's 9.4 MB weights at each call).
    let pack = |packed: &mut [MaybeUninit<f32>]| {
        packed
            .par_chunks_mut(taps * g.c_out * TILE)
            .enumerate()
            .for_each(|(tile, dst)| {
                let count = (g.c_in - tile * TILE).min(TILE);
                for o in 0..g.c_out {
                    let src = &weight[(o * g.c_in + tile * TILE) * taps..][..count * taps];
                    // Tap `k` goes to vector `k · c_out + o` of `dst`.
                    to_lanes_group(src, taps, dst, |k| k * g.c_out + o);
                }
            })
    };
    // SAFETY: the output channels `o` and taps `k` cover a tile's `taps · c_out` vectors,
    // each written (zeros in the lanes past the last tile's channels).
    let packed = unsafe { Aligned::written_whole(tiles * taps * g.c_out * TILE, pack) };
    // Output gradients pixel-major, so a pixel's channels are consecutive vectors.
    let dys = to_lanes(dy, g.batch, g.c_out, g.out_plane(), true);
    let task = |group: usize, tile: usize, dst: &mut [MaybeUninit<f32>]| {
        let len = g.output_len() * LANES;
        let dy_group = |i: usize| &dys[(group + i) * len..][..len];
        let w_tile = &packed[tile * taps * g.c_out * TILE..][..taps * g.c_out * TILE];
        if dst.len() == PAIR * g.in_plane() * TILE * LANES {
            input_grad_groups(g, order, [dy_group(0), dy_group(1)], w_tile, dst);
        } else {
            input_grad_groups(g, order, [dy_group(0)], w_tile, dst);
        }
    };
    // SAFETY: `input_grad_tile` zeroes and then sums every input pixel of its groups' tile.
    unsafe { per_tile([g.batch, g.c_in, g.in_plane()], spare, task) }
}

/// The batch as whole vectors of samples and, where the samples after the last whole vector
/// would fill at most half of one, those samples (`None` otherwise): the path this kernel
/// replaces runs them, alongside, when it sums them in the order this kernel reproduces (the
/// direct kernels always; gemm where their products take the same depth blocks:
/// [`common_depth_block`]). With FedMR's batches of 50, a fourth vector held 2 samples and 14
/// zeros: a fifth of the multiply-adds of CNN3's, CNN4's and VGG-16's small maps. Not on 1×1
/// maps, where a vector costs little (one tap of nine reads the input) and gemm would pack the
/// whole weight for those few columns (VGG-16's 9.4 MB at 1×28×28: its input gradient ran at
/// about half the rate with the last 2 samples on gemm). Either way the sums are the same.
pub(super) fn split(g: &Conv2dGeometry, order: Order) -> (Conv2dGeometry, Option<Conv2dGeometry>) {
    let rest = g.batch % LANES;
    let head = Conv2dGeometry {
        batch: g.batch - rest,
        ..*g
    };
    let tail = Conv2dGeometry { batch: rest, ..*g };
    let same_order = || {
        if order.from_bias {
            return matches!(PassPath::replaced(&tail), PassPath::Direct);
        }
        let (rows, forward, input) = (g.col_rows(), tail.group(), tail.input_grad_group());
        common_depth_block(g.c_out, &tail.group_widths(forward), rows) == Some(order.forward_kc)
            && common_depth_block(rows, &tail.group_widths(input), g.c_out) == Some(order.input_kc)
    };
    if rest == 0 || head.batch == 0 || 2 * rest > LANES || g.out_plane() == 1 || !same_order() {
        return (*g, None);
    }
    (head, Some(tail))
}

/// The taps `[lo, hi)` along one axis whose input `o·stride + k − pad` lies inside `0..size`.
fn valid_taps(o: usize, kernel: usize, stride: usize, pad: usize, size: usize) -> (usize, usize) {
    let start = o * stride;
    let lo = pad.saturating_sub(start).min(kernel);
    let hi = (size + pad).saturating_sub(start).min(kernel);
    (lo, hi.max(lo))
}

/// The kernels, written once over [`Lanes16`](crate::kernels::lanes16::Lanes16) and compiled for each tier (`tier_entries!`).
#[cfg(target_arch = "x86_64")]
mod tiles;
