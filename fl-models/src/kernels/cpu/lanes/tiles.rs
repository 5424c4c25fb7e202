//! The kernels across samples, written once over
//! [`Lanes16`](crate::kernels::lanes16::Lanes16) and compiled for each tier (`tier_entries!`).

use std::mem::MaybeUninit;

use super::super::first_lanes;
use super::{CHUNK_BYTES, CHUNK_BYTES_AVX2, Conv2dGeometry, LANES, Order, TILE, valid_taps};
use crate::kernels::isa::{Isa, uses};
use crate::kernels::lanes16::{Lanes16, tier_entries};

/// `PART` channels × `V` vectors of samples.
type Sums<L, const V: usize, const PART: usize> = [[L; V]; PART];

tier_entries!(to_lanes_avx512, to_lanes_avx2 =>
    to_lanes_group<>(src: &[f32], per_sample: usize, dst: &mut [MaybeUninit<f32>],
        at: impl Fn(usize) -> usize));
tier_entries!(from_lanes_avx512, from_lanes_avx2 =>
    from_lanes_tile<>(src: &[f32], pixels: usize, dst: &mut [&mut [MaybeUninit<f32>]]));
tier_entries!(forward_avx512, forward_avx2 =>
    forward_tile<const V, const PART, const REST>(g: &Conv2dGeometry, order: Order, x: [&[f32]; V],
        w: &[f32], bias: &[f32], out: &mut [MaybeUninit<f32>]));
tier_entries!(input_grad_avx512, input_grad_avx2 =>
    input_grad_tile<const V, const PART, const REST>(g: &Conv2dGeometry, order: Order,
        dy: [&[f32]; V], w: &[f32], out: &mut [MaybeUninit<f32>]));

/// One group of [`super::to_lanes`]: `src` holds 1–16 samples of `per_sample` floats; value
/// `i` of sample `lane` goes to `dst[at(i) · LANES + lane]`, zeros in the missing lanes (so
/// `dst` is written whole where `at` maps onto all its vectors).
///
/// # Safety
/// `L`'s tier; `src.len()` a multiple of `per_sample` of at most 16 samples (checked, as
/// is `at(i) < dst.len() / LANES` for every `i < per_sample`).
#[inline(always)]
unsafe fn to_lanes_group<L: Lanes16>(
    src: &[f32],
    per_sample: usize,
    dst: &mut [MaybeUninit<f32>],
    at: impl Fn(usize) -> usize,
) {
    let count = src.len() / per_sample;
    assert!(count <= LANES && count * per_sample == src.len());
    for i0 in (0..per_sample).step_by(16) {
        let len = (per_sample - i0).min(16);
        let mask = first_lanes(len);
        // SAFETY: the tier is the caller's; register operations only.
        let mut rows = [unsafe { L::zero() }; 16];
        for (lane, row) in rows.iter_mut().enumerate().take(count) {
            // SAFETY: the masked floats `lane · per_sample + i0 .. + len` lie in `src`.
            *row = unsafe { L::load_masked(src.as_ptr().add(lane * per_sample + i0), mask) };
        }
        // SAFETY: as above.
        unsafe { L::transpose(&mut rows) };
        for (k, row) in rows.iter().enumerate().take(len) {
            let to = at(i0 + k);
            assert!(to < dst.len() / LANES);
            // SAFETY: `to < dst.len() / LANES`, so the vector lies in `dst`.
            unsafe { row.store(dst.as_mut_ptr().add(to * LANES).cast()) };
        }
    }
}

/// One group's tile of [`super::per_tile`]: `src` holds the group's `[pixels][TILE][LANES]`
/// block of the tile, `dst` one part per sample (1–16 of them), each the tile's 1–16 channels
/// `[channels][pixels]`; each float written once (the result is not zeroed first).
///
/// # Safety
/// `L`'s tier; the lengths are checked.
#[inline(always)]
unsafe fn from_lanes_tile<L: Lanes16>(
    src: &[f32],
    pixels: usize,
    dst: &mut [&mut [MaybeUninit<f32>]],
) {
    let per_sample = dst.first().map_or(0, |d| d.len());
    let channels = per_sample / pixels.max(1);
    assert!((1..=LANES).contains(&dst.len()) && (1..=TILE).contains(&channels));
    assert!(dst.iter().all(|d| d.len() == channels * pixels));
    assert!(src.len() >= pixels * TILE * LANES);
    for c in 0..channels {
        // Channel `c`'s vectors of samples, one per pixel.
        let lines = src[c * LANES..].as_ptr();
        for p0 in (0..pixels).step_by(16) {
            let len = (pixels - p0).min(16);
            let mask = first_lanes(len);
            // SAFETY: the tier is the caller's; register operations only.
            let mut rows = [unsafe { L::zero() }; 16];
            for (k, row) in rows.iter_mut().enumerate().take(len) {
                // SAFETY: pixel `p0 + k < pixels` of channel `c < TILE` lies in `src`.
                *row = unsafe { L::load(lines.add((p0 + k) * TILE * LANES)) };
            }
            // SAFETY: as above.
            unsafe { L::transpose(&mut rows) };
            for (row, part) in rows.iter().zip(dst.iter_mut()) {
                // SAFETY: the masked floats `c · pixels + p0 ..` `+ len ≤ channels · pixels`
                // lie in `part`.
                unsafe { row.store_masked(part.as_mut_ptr().add(c * pixels + p0).cast(), mask) };
            }
        }
    }
}

/// Adds `sums` onto the `PART` × `V` vectors at `dst(v) + t · LANES`.
///
/// # Safety
/// `L`'s tier; each `dst(v)` points at `PART · LANES` writable floats.
#[inline(always)]
unsafe fn add_onto<L: Lanes16, const V: usize, const PART: usize>(
    dst: &[*mut f32; V],
    sums: &Sums<L, V, PART>,
) {
    for (t, s) in sums.iter().enumerate() {
        for (d, s) in dst.iter().zip(s) {
            // SAFETY: the caller upholds this function's contract.
            unsafe {
                let at = d.add(t * LANES);
                L::load(at).add(*s).store(at);
            }
        }
    }
}

/// Stores `sums` at the `PART` × `V` vectors `dst(v) + t · LANES`.
///
/// # Safety
/// `L`'s tier; each `dst(v)` points at `PART · LANES` writable floats.
#[inline(always)]
unsafe fn store<L: Lanes16, const V: usize, const PART: usize>(
    dst: &[*mut f32; V],
    sums: &Sums<L, V, PART>,
) {
    for (t, s) in sums.iter().enumerate() {
        for (d, s) in dst.iter().zip(s) {
            // SAFETY: the caller upholds this function's contract.
            unsafe { s.store(d.add(t * LANES)) };
        }
    }
}

/// The `PART` × `V` vectors at `dst(v) + t · LANES`, as [`store`] writes them.
///
/// # Safety
/// `L`'s tier; each `dst(v)` points at `PART · LANES` readable floats.
#[inline(always)]
unsafe fn load<L: Lanes16, const V: usize, const PART: usize>(
    dst: &[*mut f32; V],
) -> Sums<L, V, PART> {
    // SAFETY: the caller upholds this function's contract.
    std::array::from_fn(|t| std::array::from_fn(|v| unsafe { L::load(dst[v].add(t * LANES)) }))
}

/// One channel tile of `V` groups of samples: `out[v][p][t][lane]` for every output pixel
/// `p`, in parts of `PART` channels of the tile (and a last one of `REST` where `PART` does
/// not divide [`TILE`]), over the input channels in chunks whose inputs stay in the L1
/// cache: each output's chain pauses at a chunk's end (its running sums kept in `out` for the
/// direct order, in a state with the depth block's index for gemm's) and resumes at the next,
/// the same chain as without chunks.
///
/// # Safety
/// `L`'s tier; each `x[v]` holds a group's input `[c_in][h][w][LANES]`, `w` the tile's
/// weights `[c_in·kh·kw][TILE]`, `bias` [`TILE`] floats and `out`
/// `V · out_plane · TILE · LANES` (written whole: each float stored before it is read).
#[inline(always)]
unsafe fn forward_tile<L: Lanes16, const V: usize, const PART: usize, const REST: usize>(
    g: &Conv2dGeometry,
    order: Order,
    x: [&[f32]; V],
    w: &[f32],
    bias: &[f32],
    out: &mut [MaybeUninit<f32>],
) {
    // SAFETY: the same contract.
    unsafe {
        if order.from_bias {
            forward_chains::<L, V, PART, REST, false>(g, order, x, w, bias, out);
        } else {
            forward_chains::<L, V, PART, REST, true>(g, order, x, w, bias, out);
        }
    }
}

/// The parts of a tile: `PART` channels each, then `REST` (none where `REST == 0`).
const fn parts(part: usize, rest: usize) -> usize {
    assert!(part > 0 && rest < part && rest <= TILE && (TILE - rest).is_multiple_of(part));
    (TILE - rest) / part
}

/// [`forward_tile`], with the depth-block checks of gemm's order (`BLOCKED`) or without
/// them (the direct order's one chain): the inner loop then holds only the multiply-adds
/// and two pointer bumps.
///
/// # Safety
/// As [`forward_tile`], with `BLOCKED == !order.from_bias`.
#[inline(always)]
unsafe fn forward_chains<
    L: Lanes16,
    const V: usize,
    const PART: usize,
    const REST: usize,
    const BLOCKED: bool,
>(
    g: &Conv2dGeometry,
    order: Order,
    x: [&[f32]; V],
    w: &[f32],
    bias: &[f32],
    out: &mut [MaybeUninit<f32>],
) {
    assert_eq!(BLOCKED, !order.from_bias);
    let whole = parts(PART, REST);
    let ([h, wd], [kh, kw], [oh, ow]) = (g.input, g.kernel, g.output);
    assert!(x.iter().all(|x| x.len() >= g.c_in * h * wd * LANES));
    assert!(w.len() >= g.c_in * kh * kw * TILE && bias.len() >= TILE);
    assert!(out.len() >= V * oh * ow * TILE * LANES);
    // Input channels per chunk: the chunk's planes of all `V` groups in about the budget.
    let budget = if uses(Isa::Avx512) {
        CHUNK_BYTES
    } else {
        CHUNK_BYTES_AVX2
    };
    let chunk = (budget / (V * h * wd * LANES * 4)).max(1);
    // Per part of the tile and pixel: the running sums of the current depth block and its index
    // (gemm order; the direct order's one chain pauses in `out` itself).
    let states = if BLOCKED { oh * ow } else { 0 };
    // SAFETY: the tier is the caller's.
    let mut state = vec![(unsafe { zeros::<L, V, PART>() }, 0usize); whole * states];
    let mut rest = vec![(unsafe { zeros::<L, V, REST>() }, 0usize); states];
    for c0 in (0..g.c_in).step_by(chunk) {
        let channels = [c0, (c0 + chunk).min(g.c_in)];
        // SAFETY: the contract is the caller's; each part lies in the tile.
        unsafe {
            for p in 0..whole {
                let tile = Part {
                    g,
                    order,
                    x,
                    w,
                    bias,
                    half: p * PART,
                    channels,
                };
                let state = &mut state[p * states..][..states];
                forward_part::<L, V, PART, BLOCKED>(&tile, state, out);
            }
            if REST > 0 {
                let tile = Part {
                    g,
                    order,
                    x,
                    w,
                    bias,
                    half: whole * PART,
                    channels,
                };
                forward_part::<L, V, REST, BLOCKED>(&tile, &mut rest, out);
            }
        }
    }
}

/// `P` channels × `V` vectors of `+0`.
///
/// # Safety
/// `L`'s tier.
#[inline(always)]
unsafe fn zeros<L: Lanes16, const V: usize, const P: usize>() -> Sums<L, V, P> {
    // SAFETY: the caller's tier.
    [[unsafe { L::zero() }; V]; P]
}

/// One part of a channel tile and one chunk of input channels in [`forward_chains`].
struct Part<'a, const V: usize> {
    g: &'a Conv2dGeometry,
    order: Order,
    x: [&'a [f32]; V],
    w: &'a [f32],
    bias: &'a [f32],
    /// The part's first channel in the tile.
    half: usize,
    /// The chunk's input channels `[c0, c1)`.
    channels: [usize; 2],
}

/// The chains of `P` channels of the tile from `tile.half` over the chunk's input channels,
/// for every output pixel (`state`: gemm order's running sums per pixel, empty otherwise).
///
/// # Safety
/// As [`forward_chains`], with `tile.half + P <= TILE`, `c0 < c1 <= c_in`, the direct order's
/// chains up to `c0` in `out` and gemm's in `state`.
#[inline(always)]
unsafe fn forward_part<L: Lanes16, const V: usize, const P: usize, const BLOCKED: bool>(
    tile: &Part<V>,
    state: &mut [(Sums<L, V, P>, usize)],
    out: &mut [MaybeUninit<f32>],
) {
    let Part {
        g,
        order,
        x,
        w,
        bias,
        half,
        channels: [c0, c1],
    } = *tile;
    let ([h, wd], [kh, kw], [oh, ow]) = (g.input, g.kernel, g.output);
    assert!(half + P <= TILE && c0 < c1 && c1 <= g.c_in);
    assert!(!BLOCKED || state.len() == oh * ow);
    let kc = order.forward_kc;
    let blocks = (g.c_in * kh * kw).div_ceil(kc);
    // SAFETY: the asserts and the caller's bound every access: taps come from `valid_taps`,
    // so every input read lies inside the image.
    unsafe {
        let zero = zeros::<L, V, P>();
        let bias: Sums<L, V, P> = std::array::from_fn(|t| [L::splat(bias[half + t]); V]);
        for oy in 0..oh {
            let (ky_lo, ky_hi) = valid_taps(oy, kh, g.stride[0], g.pad_begin[0], h);
            for ox in 0..ow {
                let (kx_lo, kx_hi) = valid_taps(ox, kw, g.stride[1], g.pad_begin[1], wd);
                let pixel = (oy * ow + ox) * TILE + half;
                let out = out.as_mut_ptr().cast::<f32>();
                let dst: [*mut f32; V] =
                    std::array::from_fn(|v| out.add((v * oh * ow * TILE + pixel) * LANES));
                let (mut sums, mut block) = if !BLOCKED {
                    // One chain from the bias, paused in `out` between chunks.
                    (if c0 == 0 { bias } else { load(&dst) }, 0)
                } else {
                    state[oy * ow + ox]
                };
                if c0 == 0 && BLOCKED {
                    // The output starts at the bias and takes each block's chain.
                    store(&dst, &bias);
                }
                // The first block that ends after the chain's position.
                let mut next = (block + 1) * kc;
                let ix0 = ox * g.stride[1] + kx_lo - g.pad_begin[1];
                for c in c0..c1 {
                    for ky in ky_lo..ky_hi {
                        let iy = oy * g.stride[0] + ky - g.pad_begin[0];
                        let k0 = (c * kh + ky) * kw + kx_lo;
                        let at = ((c * h + iy) * wd + ix0) * LANES;
                        let mut xp: [*const f32; V] =
                            std::array::from_fn(|v| x[v].as_ptr().add(at));
                        let mut wk = w.as_ptr().add(k0 * TILE + half);
                        for k in k0..k0 + (kx_hi - kx_lo) {
                            while BLOCKED && k >= next {
                                add_onto(&dst, &sums);
                                sums = zero;
                                block += 1;
                                next += kc;
                            }
                            let xv: [L; V] = std::array::from_fn(|v| L::load(xp[v]));
                            for (t, s) in sums.iter_mut().enumerate() {
                                let wt = L::splat(*wk.add(t));
                                for (s, xv) in s.iter_mut().zip(&xv) {
                                    *s = wt.mul_add(*xv, *s);
                                }
                            }
                            xp = std::array::from_fn(|v| xp[v].add(LANES));
                            wk = wk.add(TILE);
                        }
                    }
                }
                if !BLOCKED {
                    store(&dst, &sums);
                } else if c1 == g.c_in {
                    while block < blocks {
                        add_onto(&dst, &sums);
                        sums = zero;
                        block += 1;
                    }
                } else {
                    state[oy * ow + ox] = (sums, block);
                }
            }
        }
    }
}

/// One input-channel tile of `V` groups of samples: `out[v][q][t][lane]` for every input
/// pixel `q`, its taps in (ky, kx) order, each a chain over the output channels (in depth
/// blocks) for `PART` channels of the tile at a time (and a last part of `REST`, as
/// [`forward_tile`]).
///
/// # Safety
/// `L`'s tier; each `dy[v]` holds a group's output gradient `[out_plane][c_out][LANES]`,
/// `w` the tile's weights `[kh·kw][c_out][TILE]` and `out` `V · h · w · TILE · LANES`
/// floats (written whole: each pixel's vectors are zeroed before its first tap adds onto
/// them, in the L1 cache, not in a pass over the whole output first).
#[inline(always)]
unsafe fn input_grad_tile<L: Lanes16, const V: usize, const PART: usize, const REST: usize>(
    g: &Conv2dGeometry,
    order: Order,
    dy: [&[f32]; V],
    w: &[f32],
    out: &mut [MaybeUninit<f32>],
) {
    let whole = parts(PART, REST);
    let ([h, wd], [kh, kw], [oh, ow]) = (g.input, g.kernel, g.output);
    let [sh, sw] = g.stride;
    let [ph, pw] = g.pad_begin;
    assert!(dy.iter().all(|dy| dy.len() >= oh * ow * g.c_out * LANES));
    assert!(w.len() >= kh * kw * g.c_out * TILE);
    assert!(out.len() >= V * h * wd * TILE * LANES);
    // The output index `o` that tap `k` of input index `i` comes from, if any.
    let source = |i: usize, k: usize, s: usize, pad: usize, size: usize| {
        let t = (i + pad).checked_sub(k)?;
        (t % s == 0 && t / s < size).then_some(t / s)
    };
    // SAFETY: the asserts bound every access (`source` yields pixels inside the output).
    unsafe {
        let (plane, out) = (h * wd * TILE * LANES, out.as_mut_ptr().cast::<f32>());
        for iy in 0..h {
            for ix in 0..wd {
                let dst = out.add((iy * wd + ix) * TILE * LANES);
                for v in 0..V {
                    for t in 0..TILE {
                        L::zero().store(dst.add(v * plane + t * LANES));
                    }
                }
                for ky in 0..kh {
                    let Some(oy) = source(iy, ky, sh, ph, oh) else {
                        continue;
                    };
                    for kx in 0..kw {
                        let Some(ox) = source(ix, kx, sw, pw, ow) else {
                            continue;
                        };
                        let dy: [*const f32; V] = std::array::from_fn(|v| {
                            dy[v].as_ptr().add((oy * ow + ox) * g.c_out * LANES)
                        });
                        let wt = w.as_ptr().add((ky * kw + kx) * g.c_out * TILE);
                        // The tile's parts in turn, the later ones reading the same
                        // output gradients and weight lines from the L1 cache.
                        for p in 0..whole {
                            let at = [p * PART, g.c_out, order.input_kc, plane];
                            input_grad_part::<L, V, PART>(dy, wt, at, dst);
                        }
                        if REST > 0 {
                            let at = [whole * PART, g.c_out, order.input_kc, plane];
                            input_grad_part::<L, V, REST>(dy, wt, at, dst);
                        }
                    }
                }
            }
        }
    }
}

/// One tap's contribution to one input pixel for `P` channels of the tile from `half`: per
/// channel, the chain over the `c_out` output channels in depth blocks of `kc`, added onto
/// `dst(v) = dst + v · plane`.
///
/// # Safety
/// `L`'s tier; each `dy[v]` points at the output pixel's `c_out` vectors of samples, `wt` at
/// the tap's weights `[c_out][TILE]`, `dst + v · plane` at the input pixel's `TILE` vectors of
/// group `v`; `half + P <= TILE`.
#[inline(always)]
unsafe fn input_grad_part<L: Lanes16, const V: usize, const P: usize>(
    dy: [*const f32; V],
    wt: *const f32,
    [half, c_out, kc, plane]: [usize; 4],
    dst: *mut f32,
) {
    assert!(half + P <= TILE && kc > 0);
    // SAFETY: the caller's contract bounds every access.
    unsafe {
        let zero = zeros::<L, V, P>();
        let dst: [*mut f32; V] = std::array::from_fn(|v| dst.add(v * plane + half * LANES));
        let wt = wt.add(half);
        let mut column = zero;
        for o0 in (0..c_out).step_by(kc) {
            let mut sums = zero;
            for o in o0..(o0 + kc).min(c_out) {
                let dv: [L; V] = std::array::from_fn(|v| L::load(dy[v].add(o * LANES)));
                let wo = wt.add(o * TILE);
                for (t, s) in sums.iter_mut().enumerate() {
                    let wb = L::splat(*wo.add(t));
                    for (s, dv) in s.iter_mut().zip(&dv) {
                        *s = wb.mul_add(*dv, *s);
                    }
                }
            }
            column = if o0 == 0 {
                sums
            } else {
                std::array::from_fn(|t| std::array::from_fn(|v| column[t][v].add(sums[t][v])))
            };
        }
        add_onto(&dst, &column);
    }
}
