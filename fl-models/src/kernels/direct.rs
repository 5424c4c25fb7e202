//! Direct stride-1 convolution with AVX-512 or AVX2 micro-kernels (no column matrix at all).
//!
//! A stride-1 convolution reads, for kernel tap `k = (ci, ky, kx)`, the input plane shifted by
//! `ky` rows and `kx` columns. Laid out "wide" (output rows as long as the padded input rows,
//! the few extra columns computed and thrown away), that shifted plane is one contiguous run
//! of the padded input starting at `offset(k) = ci·Hp·Wp + ky·Wp + kx` (the layout:
//! `direct/wide.rs`). So
//!
//! - forward: `y[co, p] = b[co] + Σ_k W[co, k] · x[offset(k) + p]`: register tiles of 4, 6
//!   or 8 output channels × 16 or 32 pixels, each tap one vector load per 16 pixels and one
//!   broadcast per channel;
//! - weight gradient: `dW[co, k] = Σ_n Σ_p dy[n, co, p] · x[n, offset(k) + p]` (the wide `dy`
//!   holds zeros in the thrown-away columns): register tiles of channels × taps summed over
//!   pixels and a fixed chunk of samples;
//! - input gradient: `dx[ci, offset(ky, kx) + p] += Σ_co W[co, ci, ky, kx] · dy[co, p]`, the
//!   channel sum in registers, added onto the padded input gradient tap by tap (no
//!   multiply-adds with the zero border a transposed convolution would spend).
//!
//! im2col + gemm builds a column matrix `kh·kw` times the input per sample, twice per training
//! step (forward and weight gradient); on the small feature maps of the CIFAR models building
//! it cost more than the multiply-adds. Used on x86-64 CPUs with AVX-512F or with AVX2 and FMA
//! for maps where the wide layout wastes little (see [`applies`]); elsewhere the im2col path in
//! `cpu.rs` runs. The kernels are written once over 16-lane vectors
//! ([`Lanes16`](super::lanes16::Lanes16): one AVX-512 register or two AVX2 ones) and compiled
//! for each tier with register tiles that fit its register file; every lane's sum is the same
//! chain on both, so an AVX2 CPU computes these layers to the same bits as an AVX-512 one.
//! Where each output row's own vectors are no more than the wide length's (16×16 and 32×32
//! maps, 14×14 ones under 5×5 kernels; on AVX2, whose row vectors are 8 lanes, also 8×8 and 7×7
//! ones), the forward pass computes those instead (`direct/rows.rs`); elsewhere the wide
//! layout's vectors store straight into the output, masked to the rows they reach;
//! where it computes about as many lanes as the scatter ("same" padding), the input gradient
//! gathers each input pixel's taps in registers (`direct/gather.rs`). Both keep the wide
//! layout's sums. Sums run in a fixed order, so results do not depend on the thread count.

use super::cpu::{Aligned, ChunkBuffers, Conv2dGeometry, WeightGradArgs};
use rayon::prelude::*;

/// Calls the entry point of the active tier, `$module::$avx512` or `$module::$avx2`, with the
/// register tile of each tier for the packed channel tile `$tile` (`<C, R, P>`: `R` of the `C`
/// channels × `P` vectors of pixels): the forward passes' and the scatter's shapes.
/// AVX-512: all `C` channels, the fastest shapes measured on 8×8 to 32×32 maps (8 × 3 vectors
/// at 72% of the FMA peak, 6–10% above 8 × 2). AVX2 has 16 registers of 8 lanes, not 32 of 16:
/// 4 or 6 channels × one 16-lane vector, or × `$avx2_vectors` vectors where its entry point
/// computes in 8-lane ones (the same registers).
macro_rules! by_channel_tile {
    ($tile:expr, $module:ident :: {$avx512:ident, $avx2:ident} ($($arg:expr),* $(,)?)) => {
        by_channel_tile!($tile, 1, $module::{$avx512, $avx2}($($arg),*))
    };
    ($tile:expr, $avx2_vectors:literal, $module:ident :: {$avx512:ident, $avx2:ident}
        ($($arg:expr),* $(,)?)) => {
        match ($crate::kernels::direct::avx512(), $tile) {
            (true, 8) => $module::$avx512::<8, 8, 3>($($arg),*),
            (true, 6) => $module::$avx512::<6, 6, 4>($($arg),*),
            (true, _) => $module::$avx512::<4, 4, 4>($($arg),*),
            (false, 8) => $module::$avx2::<8, 4, $avx2_vectors>($($arg),*),
            (false, 6) => $module::$avx2::<6, 6, $avx2_vectors>($($arg),*),
            (false, _) => $module::$avx2::<4, 4, $avx2_vectors>($($arg),*),
        }
    };
}

mod gather;
mod pack;
mod rows;
mod wide;
use pack::{channel_tile, pack_input_tiles, pack_weights};
use rows::forward_rows;
use wide::wide_len;
pub(super) use wide::{Wide, forward_lanes};

/// Lanes per vector of the kernels ([`Lanes16`](super::lanes16::Lanes16)): the wide rows are
/// padded to a multiple of it.
const LANES: usize = 16;

/// Whether the kernels run in AVX-512 registers (else AVX2: `applies` allows no other tier).
fn avx512() -> bool {
    super::isa::uses(super::isa::Isa::Avx512)
}

/// Whether the direct kernels handle `g` on this CPU: stride 1, a kernel larger than 1×1 (1×1
/// convolutions need no column matrix and stay with plain gemm), and a feature map large enough
/// that the wide layout computes at most half as many outputs again as it keeps (VGG's 4×4 and
/// 2×2 maps would waste most of the work; gemm on their column matrices is fast).
pub(super) fn applies(g: &Conv2dGeometry) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let [oh, ow] = g.output;
        g.stride == [1, 1]
            && g.kernel != [1, 1]
            && oh > 0
            && ow > 0
            && 2 * wide_len(g) <= 3 * oh * ow
            && super::isa::uses(super::isa::Isa::Avx2)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = g;
        false
    }
}

/// Forward convolution (stride 1), the same contract as `cpu::conv2d_forward`.
pub(super) fn conv2d_forward(
    g: &Conv2dGeometry,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
) -> Vec<f32> {
    forward_in(&Wide::new(g), g, x, weight, bias)
}

/// [`conv2d_forward`] in the layout `wide` (by rows or not).
fn forward_in(
    wide: &Wide,
    g: &Conv2dGeometry,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
) -> Vec<f32> {
    let packed = pack_weights(weight, g.c_out, wide.offsets.len(), wide.channel_tile);
    let mut bias_padded = vec![0.0f32; wide.c_out_padded];
    if let Some(bias) = bias {
        bias_padded[..g.c_out].copy_from_slice(bias);
    }
    let vectors = wide.output_vectors();
    // SAFETY: each sample's chunk is written whole: the vectors cover each row of every
    // channel.
    unsafe {
        super::cpu::written_whole(g.batch * g.output_len(), |y| {
            y.par_chunks_mut(g.output_len())
                .zip(x.par_chunks(g.input_len()))
                .for_each_init(
                    || Aligned::zeroed(wide.input_len),
                    |input, (y_n, x_n)| {
                        wide.pad_input(x_n, input);
                        // Straight into the output: nothing to copy out of the wide layout.
                        forward_rows((wide, input, &packed, &bias_padded), &vectors, g.c_out, y_n);
                    },
                )
        })
    }
}

/// Input gradient (stride 1), the same contract as `cpu::conv2d_input_grad`.
pub(super) fn conv2d_input_grad(g: &Conv2dGeometry, weight: &[f32], dy: &[f32]) -> Vec<f32> {
    input_grad_in(&Wide::new(g), g, weight, dy)
}

/// [`conv2d_input_grad`] in the layout `wide`: gathered where that computes about as many lanes
/// (see `gather.rs`), else scattered over the wide length.
fn input_grad_in(wide: &Wide, g: &Conv2dGeometry, weight: &[f32], dy: &[f32]) -> Vec<f32> {
    if wide.gathers {
        return gather::input_grad(g, weight, dy);
    }
    let tile = channel_tile(g.c_in);
    let c_in_padded = g.c_in.next_multiple_of(tile);
    let taps = g.kernel[0] * g.kernel[1];
    let packed = pack_input_tiles(g, weight, tile);
    let plane = wide.padded[0] * wide.padded[1];
    // Padded input gradient: every channel tile's writes stay inside (the last tap's offset
    // plus the reach of the pixel vectors).
    let padded_len = (c_in_padded - 1) * plane + wide.offsets[taps - 1] + wide.reach;
    let [h, w] = g.input;
    let [ph, pw] = g.pad_begin;
    let wp = wide.padded[1];
    // Inputs outside the padded window (cut off by the output size) get no gradient.
    let (rows, cols) = (
        h.min(wide.padded[0].saturating_sub(ph)),
        w.min(wp.saturating_sub(pw)),
    );
    let mut dx = super::cpu::par_zeroed(g.batch * g.input_len());
    dx.par_chunks_mut(g.input_len())
        .zip(dy.par_chunks(g.output_len()))
        .for_each_init(
            || {
                (
                    Aligned::zeroed(g.c_out * wide.len),
                    Aligned::zeroed(padded_len),
                )
            },
            |(wide_dy, dx_padded), (dx_n, dy_n)| {
                dx_padded.fill(0.0);
                let layout = (wide, g.c_out, tile, c_in_padded);
                wide.widen(dy_n, g.c_out, wide_dy);
                scatter_wide(layout, wide_dy, &packed, dx_padded);
                for ci in 0..g.c_in {
                    for iy in 0..rows {
                        dx_n[(ci * h + iy) * w..][..cols].copy_from_slice(
                            &dx_padded[ci * plane + (iy + ph) * wp + pw..][..cols],
                        );
                    }
                }
            },
        );
    dx
}

/// Weight and bias gradients (stride 1), the same contract as `cpu::conv2d_weight_grad`.
pub(super) fn conv2d_weight_grad(args: WeightGradArgs) -> (Vec<f32>, Vec<f32>) {
    let g = args.0;
    let wide = Wide::new(g);
    // The wide output gradients keep their zeros too (`widen` writes only the values).
    let wide_dy_len = wide.c_out_padded * wide.len;
    super::cpu::sum_over_chunks_with(
        g.batch,
        || ChunkBuffers::for_chunks(g.batch, wide.input_len, wide_dy_len),
        |buffers, samples| weight_grad_chunk(args, &wide, samples, buffers),
    )
}

/// Whether `g` runs by [`RowVectors`](rows::RowVectors).
#[cfg(test)]
pub(super) fn runs_by_rows(g: &Conv2dGeometry) -> bool {
    Wide::new(g).by_rows
}

/// Whether `g`'s input gradient is gathered (`gather.rs`).
#[cfg(test)]
pub(super) fn gathers(g: &Conv2dGeometry) -> bool {
    Wide::new(g).gathers
}

/// `g`'s layout scattering the input gradient over the wide length even where it would gather
/// it, and running the forward pass by the wide layout's vectors: the reference the tests
/// compare the gathered gradient and the row vectors with.
#[cfg(test)]
fn wide_only(g: &Conv2dGeometry) -> Wide {
    let mut wide = Wide::new(g).forward_by_rows(false);
    wide.gathers = false;
    wide
}

/// [`conv2d_forward`] by rows (`by_rows`) or by the wide layout's vectors, whichever `g` would
/// take.
#[cfg(test)]
pub(super) fn forward_by_rows(
    g: &Conv2dGeometry,
    by_rows: bool,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
) -> Vec<f32> {
    forward_in(&Wide::new(g).forward_by_rows(by_rows), g, x, weight, bias)
}

/// [`conv2d_input_grad`] in the wide layout (see [`wide_only`]).
#[cfg(test)]
pub(super) fn wide_input_grad(g: &Conv2dGeometry, weight: &[f32], dy: &[f32]) -> Vec<f32> {
    input_grad_in(&wide_only(g), g, weight, dy)
}

/// The forward kernels' operands: the layout, one padded input, the packed weights and the
/// padded bias.
type ForwardArgs<'a> = (&'a Wide, &'a [f32], &'a [f32], &'a [f32]);

/// The input-gradient kernels' layout: the convolution's, `c_out`, the input-channel tile and
/// the input channels rounded up to it.
type ScatterLayout<'a> = (&'a Wide, usize, usize, usize);

/// Checks the buffers every input-gradient kernel shares.
fn check_scatter(layout: ScatterLayout, packed: &[f32], dx: &[f32]) {
    let (wide, c_out, _, c_in_padded) = layout;
    let taps = wide.offsets.len() / wide.c_in;
    let plane = wide.padded[0] * wide.padded[1];
    assert!(
        packed.len() >= c_in_padded * taps * c_out,
        "direct conv: weights"
    );
    assert!(
        dx.len() >= (c_in_padded - 1) * plane + wide.offsets[taps - 1] + wide.reach,
        "direct conv: input gradient buffer"
    );
}

/// `dx[ci, offset(ky, kx) + p] += Σ_co W[co, ci, ky, kx] · dy[co, p]` for all padded input
/// channels, taps and `p < len`, onto the padded input gradient `dx`.
fn scatter_wide(layout: ScatterLayout, wide_dy: &[f32], packed: &[f32], dx: &mut [f32]) {
    let (wide, c_out, tile, c_in_padded) = layout;
    check_scatter(layout, packed, dx);
    assert!(
        wide_dy.len() >= c_out * wide.len,
        "direct conv: gradient buffer"
    );
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `applies` checked the tier; the asserts above bound every access.
        unsafe {
            // Tiles of C input channels × P vectors of pixels (then single vectors for the
            // rest of the wide length): fewer weight broadcasts per multiply-add the larger P;
            // the sums are the same either way.
            let args = (wide, c_out, c_in_padded, wide_dy, packed);
            by_channel_tile!(tile, tiles::{scatter_tiles_avx512, scatter_tiles_avx2}(args, dx))
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("direct convolution is only used on x86-64");
}

/// The weight and bias gradients of some consecutive samples.
fn weight_grad_chunk(
    (g, x, dy, bias): WeightGradArgs,
    wide: &Wide,
    samples: std::ops::Range<usize>,
    buffers: &mut ChunkBuffers,
) -> (Vec<f32>, Vec<f32>) {
    let count = samples.len();
    let x = &x[samples.start * g.input_len()..samples.end * g.input_len()];
    let inputs = &mut buffers.inputs[..count * wide.input_len];
    wide.pad_inputs(x, g.input_len(), inputs);
    let wide_dy_len = wide.c_out_padded * wide.len;
    let dy = &dy[samples.start * g.output_len()..samples.end * g.output_len()];
    let db = super::cpu::chunk_bias_grad(bias, dy, g.c_out, g.out_plane());
    let grads = &mut buffers.grads[..count * wide_dy_len];
    for (dy_n, buf) in dy
        .chunks_exact(g.output_len())
        .zip(grads.chunks_exact_mut(wide_dy_len))
    {
        wide.widen(dy_n, g.c_out, buf);
    }
    let taps = wide.offsets.len();
    let mut dw = vec![0.0f32; g.c_out * taps];
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `applies` checked the tier (no `Wide` is built otherwise), and the buffers
        // were sized from `wide` just above.
        unsafe {
            // Four channels × six taps for tiles of eight too (two per tile): per multiply-add
            // half the loads of the output gradient, which streams from L2 (17% less time in
            // this kernel on CNN1 and ResNet-20); every sum keeps its order of additions. AVX2:
            // two channels × three taps, 12 of its 16 registers for the sums (2 × 2, 8 chains
            // for two FMA units of 4 cycles' latency, ran 5–30% slower in `fl bench --kernels`,
            // one thread, best of three: VGG-16 block 1 47 → 62 GFLOP/s, ResNet-20 stage 3
            // 36 → 48).
            // Five taps where six would leave a tile's taps partly idle and five fill them (the
            // 5×5 first layers: 25 taps as 5 × 5, not 5 × 6 with 5 dropped; each sum is its own
            // chain, so the tile changes no bit).
            let fives = !taps.is_multiple_of(6) && taps.is_multiple_of(5);
            let (x, d, c, dw) = (&inputs[..], &grads[..], g.c_out, &mut dw[..]);
            match (avx512(), wide.channel_tile) {
                (true, 6) => tiles::weight_grad_avx512::<6, 4>((wide, count, count), x, d, c, dw),
                (true, _) if fives => {
                    tiles::weight_grad_avx512::<4, 5>((wide, count, count), x, d, c, dw)
                }
                (true, _) => tiles::weight_grad_avx512::<4, 6>((wide, count, count), x, d, c, dw),
                (false, _) => {
                    // As many samples per pass as keep a tile's rows (two channels of the
                    // output gradient, an input plane) within 16 KiB of L1: on large maps
                    // they streamed from L2 once per tile, at one load per multiply-add.
                    let plane = wide.padded[0] * wide.padded[1];
                    let pass = 4096 / (2 * wide.len + plane);
                    tiles::weight_grad_avx2::<2, 3>((wide, count, pass), x, d, c, dw)
                }
            }
        }
    }
    (dw, db)
}

/// The kernels, written once over [`Lanes16`](super::lanes16::Lanes16) (the same sums on
/// every tier) and compiled per tier by the entry points at the end.
#[cfg(target_arch = "x86_64")]
mod tiles {
    use super::{LANES, Wide};
    use crate::kernels::lanes16::Lanes16;

    /// [`scatter`] over every input-channel block and tap: tiles of `P` vectors of pixels, then
    /// single vectors for the rest of the wide length. Each element of `dx` receives its taps'
    /// sums in tap order, whatever `R` and `P` (so the result is the same for any tile shape).
    ///
    /// # Safety
    /// As [`scatter`]'s, for the whole wide length.
    #[inline(always)]
    unsafe fn scatter_tiles<V: Lanes16, const C: usize, const R: usize, const P: usize>(
        args: (&Wide, usize, usize, &[f32], &[f32]),
        dx: &mut [f32],
    ) {
        let (wide, _, c_in_padded, _, _) = args;
        let main = wide.len - wide.len % (P * LANES);
        for block in 0..c_in_padded / C {
            for k in 0..wide.offsets.len() / wide.c_in {
                for first in (0..C).step_by(R) {
                    // SAFETY: the caller upholds this function's contract; both ranges are
                    // whole vectors within the wide length.
                    unsafe {
                        scatter::<V, C, R, P>(args, (block, k, first), 0..main, dx);
                        scatter::<V, C, R, 1>(args, (block, k, first), main..wide.len, dx);
                    }
                }
            }
        }
    }

    /// Input-gradient tiles of `R` input channels (from `first`) of a block of `C` and one
    /// tap: for `16·P` pixels of `pixels` at a time, the sum over output channels in
    /// registers, then added onto the padded input gradient at the tap's offset.
    ///
    /// # Safety
    /// The CPU supports `V`'s tier; `R` divides `C`; `pixels` is a range of whole vectors
    /// within `wide.len` whose length is a multiple of `16·P`; `wide_dy` holds `c_out · len`
    /// floats, `packed` `c_in_padded · taps · c_out`, and `dx` reaches the last channel's last
    /// tap offset plus `len`.
    #[inline(always)]
    unsafe fn scatter<V: Lanes16, const C: usize, const R: usize, const P: usize>(
        (wide, c_out, _, wide_dy, packed): (&Wide, usize, usize, &[f32], &[f32]),
        (block, k, first): (usize, usize, usize),
        pixels: std::ops::Range<usize>,
        dx: &mut [f32],
    ) {
        // SAFETY: the caller upholds this function's contract.
        unsafe {
            let taps = wide.offsets.len() / wide.c_in;
            let plane = wide.padded[0] * wide.padded[1];
            let offset = wide.offsets[k];
            let (dy, out) = (wide_dy.as_ptr(), dx.as_mut_ptr());
            let w = packed.as_ptr().add((block * taps + k) * c_out * C + first);
            for p in pixels.step_by(LANES * P) {
                let mut acc = [[V::zero(); P]; R];
                for co in 0..c_out {
                    let src = dy.add(co * wide.len + p);
                    let d: [V; P] = std::array::from_fn(|v| V::load(src.add(v * LANES)));
                    let wc = w.add(co * C);
                    for (c, a) in acc.iter_mut().enumerate() {
                        let weight = V::splat(*wc.add(c));
                        for v in 0..P {
                            a[v] = weight.mul_add(d[v], a[v]);
                        }
                    }
                }
                for (c, a) in acc.iter().enumerate() {
                    let dst = out.add((block * C + first + c) * plane + offset + p);
                    for (v, sum) in a.iter().enumerate() {
                        let at = dst.add(v * LANES);
                        V::load(at).add(*sum).store(at);
                    }
                }
            }
        }
    }

    /// Weight-gradient tiles of `C` channels × `T` taps, summed over the pixels of `count`
    /// samples (in order), then reduced to `dw[co, k]`. The samples go `pass` at a time
    /// through every tile, each tile's sums kept in memory between passes: the same chains,
    /// with a smaller working set per tile when `pass < count`.
    ///
    /// # Safety
    /// The CPU supports `V`'s tier; `C` divides `wide.c_out_padded`; `inputs` holds `count`
    /// padded inputs of `wide.input_len` floats, `grads` `count` wide gradients of
    /// `c_out_padded · len` floats, and `dw` `c_out · taps` floats.
    #[inline(always)]
    unsafe fn weight_grad<V: Lanes16, const C: usize, const T: usize>(
        (wide, count, pass): (&Wide, usize, usize),
        inputs: &[f32],
        grads: &[f32],
        c_out: usize,
        dw: &mut [f32],
    ) {
        // SAFETY: the caller upholds this function's contract.
        unsafe {
            let taps = wide.offsets.len();
            let grad_len = wide.c_out_padded * wide.len;
            assert!(inputs.len() >= count * wide.input_len && grads.len() >= count * grad_len);
            assert!(dw.len() >= c_out * taps && wide.c_out_padded.is_multiple_of(C));
            let (blocks, groups) = (wide.c_out_padded / C, taps.div_ceil(T));
            let pass = pass.clamp(1, count.max(1));
            let passes = count.div_ceil(pass);
            // Sums kept between passes (none with a single pass).
            let mut kept = vec![[[V::zero(); T]; C]; if passes > 1 { blocks * groups } else { 0 }];
            for (i, first) in (0..count).step_by(pass).enumerate() {
                let samples = first..(first + pass).min(count);
                for block in 0..blocks {
                    for group in 0..groups {
                        let (tile, k0) = (block * groups + group, group * T);
                        // Taps past the end repeat the last one; their sums are dropped.
                        let offsets: [usize; T] =
                            std::array::from_fn(|t| wide.offsets[(k0 + t).min(taps - 1)]);
                        let mut acc = if i == 0 {
                            [[V::zero(); T]; C]
                        } else {
                            kept[tile]
                        };
                        for n in samples.clone() {
                            let x = inputs.as_ptr().add(n * wide.input_len);
                            let dy = grads.as_ptr().add(n * grad_len + block * C * wide.len);
                            for p in (0..wide.len).step_by(LANES) {
                                let d: [V; C] =
                                    std::array::from_fn(|c| V::load(dy.add(c * wide.len + p)));
                                for (t, &offset) in offsets.iter().enumerate() {
                                    let xv = V::load(x.add(offset + p));
                                    for c in 0..C {
                                        acc[c][t] = d[c].mul_add(xv, acc[c][t]);
                                    }
                                }
                            }
                        }
                        if i + 1 < passes {
                            kept[tile] = acc;
                            continue;
                        }
                        for (c, row) in acc.iter().enumerate() {
                            let co = block * C + c;
                            if co >= c_out {
                                break;
                            }
                            for (t, v) in row.iter().enumerate() {
                                if k0 + t < taps {
                                    dw[co * taps + k0 + t] = v.reduce_add();
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    crate::kernels::lanes16::tier_entries! {
        scatter_tiles_avx512, scatter_tiles_avx2 =>
            scatter_tiles<const C, const R, const P>(
                args: (&Wide, usize, usize, &[f32], &[f32]),
                dx: &mut [f32],
            )
    }
    crate::kernels::lanes16::tier_entries! {
        weight_grad_avx512, weight_grad_avx2 =>
            weight_grad<const C, const T>(
                layout: (&Wide, usize, usize),
                inputs: &[f32],
                grads: &[f32],
                c_out: usize,
                dw: &mut [f32],
            )
    }
}
