//! The direct kernels' forward pass by output rows: each row's own pixel vectors instead of the
//! wide length, for maps where that computes fewer (see [`RowVectors`]).

use std::mem::MaybeUninit;

use super::{ForwardArgs, LANES, Wide};
use crate::kernels::cpu::first_lanes;

/// The pixel vectors of each row of a `[rows, width]` plane ([`unit()`] lanes each), a row's last
/// vector possibly partial: the forward pass's output rows, for maps where they are fewer than the wide
/// layout's (rows 16 or 32 wide, or short rows under wide kernels: on 16×16 maps the wide layout
/// computes 20 vectors per channel under 5×5 kernels, 18 under 3×3, for 16 of outputs), and the
/// gathered input gradient's input rows (`gather.rs`); or the wide layout's own vectors
/// ([`RowVectors::wide`]), which run on past a row's end into the next rows. Every output is
/// the same sum in the same order as in the wide layout, so results are the wide layout's bit
/// for bit (a test compares them).
pub(super) struct RowVectors {
    /// Where each vector's taps read (tap `(0, 0)`, or the first tap's offset).
    pub(super) starts: Vec<usize>,
    /// Where its lane 0 goes in a channel's `[rows, width]` plane (for a wide vector starting
    /// past its row's last column, where that row would continue).
    pub(super) dest: Vec<usize>,
    /// Its lanes that are pixels of that row.
    pub(super) masks: Vec<u16>,
    /// Its lanes that are pixels of the next row and of the one after (wide vectors only): lane
    /// `l` of the `s`-th next row goes to `dest + l − s·wrap`.
    pub(super) next: Vec<[u16; 2]>,
    /// The columns a wide vector skips between one row's last pixel and the next row's first.
    pub(super) wrap: usize,
    /// The rows the vectors reach at most: 1, or 2 or 3 for wide vectors (a masked store each).
    pub(super) parts: usize,
    /// Lanes per vector ([`unit()`] when built): the kernels' vector width must match it.
    pub(super) unit: usize,
}

/// Lanes per [`RowVectors`] vector: one register of the tier, 16 on AVX-512 and 8 on AVX2.
/// Each output is its own chain, so the width changes no bit, only how many lanes a row takes:
/// an 8-wide row (the 8×8 maps of ResNet-20's third stage, VGG-16's and CNN4's) is one AVX2
/// register, not half of a 16-lane pair, and 7-wide rows lose one lane in eight, not nine in
/// sixteen.
pub(super) fn unit() -> usize {
    if super::avx512() { LANES } else { LANES / 2 }
}

impl RowVectors {
    /// The [`unit()`]-wide vectors of a `[rows, width]` plane, the one starting at column `x0` of
    /// row `r` reading from `start(r, x0)`.
    pub(super) fn new([rows, width]: [usize; 2], start: impl Fn(usize, usize) -> usize) -> Self {
        let unit = unit();
        let mut v = RowVectors {
            starts: Vec::new(),
            dest: Vec::new(),
            masks: Vec::new(),
            next: Vec::new(),
            wrap: 0,
            parts: 1,
            unit,
        };
        for r in 0..rows {
            for x0 in (0..width).step_by(unit) {
                v.starts.push(start(r, x0));
                v.dest.push(r * width + x0);
                v.masks.push(first_lanes((width - x0).min(unit)));
                v.next.push([0; 2]);
            }
        }
        v
    }

    /// The wide layout's [`unit()`]-wide vectors over `len` positions of rows `stride` apart, of
    /// which the first `width` of each of the `rows` rows are pixels: each vector stores its
    /// pixels straight into a `[rows, width]` plane, so nothing is copied out of the wide
    /// layout.
    ///
    /// # Panics
    /// Unless [`wide_fits`]`(stride)` and `width <= stride`.
    pub(super) fn wide([rows, width]: [usize; 2], stride: usize, len: usize) -> Self {
        let unit = unit();
        assert!(
            wide_fits(stride) && width <= stride,
            "wide vectors: rows too narrow"
        );
        let mut v = RowVectors {
            starts: Vec::new(),
            dest: Vec::new(),
            masks: Vec::new(),
            next: Vec::new(),
            wrap: stride - width,
            parts: 1,
            unit,
        };
        for p in (0..len).step_by(unit) {
            let (row, column) = (p / stride, p % stride);
            // Lane `l`'s pixel, if any: its row after `row` and its column.
            let pixel = |l: usize| {
                let (r, x) = ((p + l) / stride, (p + l) % stride);
                (r < rows && x < width).then_some(r - row)
            };
            let mut masks = [0u16; 3];
            for l in 0..unit {
                if let Some(s) = pixel(l) {
                    masks[s] |= 1 << l;
                }
            }
            v.starts.push(p);
            v.dest.push(row * width + column);
            v.masks.push(masks[0]);
            v.next.push([masks[1], masks[2]]);
            v.parts = v
                .parts
                .max(1 + masks.iter().rposition(|&m| m != 0).unwrap_or(0));
        }
        v
    }
}

/// Whether [`RowVectors::wide`] takes rows `stride` apart: rows (with their extra columns) at
/// least half a vector wide, so that a vector reaches at most three of them.
pub(super) fn wide_fits(stride: usize) -> bool {
    2 * stride >= unit()
}

impl Wide {
    /// The vectors of the forward pass: each output row's own, reading the padded input, or
    /// the wide layout's (see [`RowVectors`]).
    pub(super) fn output_vectors(&self) -> RowVectors {
        if self.by_rows {
            return RowVectors::new(self.output, |oy, x0| oy * self.padded[1] + x0);
        }
        RowVectors::wide(self.output, self.padded[1], self.len)
    }
}

/// The forward pass's sums `out[co, p] = bias[co] + Σ_k W[co, k] · input[offset(k) + p]`, by
/// [`RowVectors`], into one sample's output `[c_out, oh, ow]`, every element of which it writes
/// (so `out` may start uninitialised).
pub(super) fn forward_rows(
    args: ForwardArgs,
    rows: &RowVectors,
    c_out: usize,
    out: &mut [MaybeUninit<f32>],
) {
    let (wide, input, packed, bias) = args;
    let taps = wide.offsets.len();
    assert!(input.len() >= wide.input_len, "direct conv: input buffer");
    assert!(out.len() >= c_out * wide.output[0] * wide.output[1]);
    assert!(packed.len() >= wide.c_out_padded * taps && bias.len() >= wide.c_out_padded);
    assert!(c_out > wide.c_out_padded - wide.channel_tile && c_out <= wide.c_out_padded);
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `applies` checked the tier (no `Wide` is built otherwise); the asserts above
        // bound the weights and bias, `Wide::reach` the vectors' loads, and the stores are
        // masked to each row's pixels and to the `c_out` channels.
        unsafe {
            // The tiles of `by_channel_tile!`; on AVX2 in 8-lane vectors, two per 16 lanes.
            by_channel_tile!(
                wide.channel_tile,
                2,
                tiles::{forward_rows_avx512, forward_rows_avx2}(args, rows, c_out, out)
            )
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("direct convolution is only used on x86-64");
}

#[cfg(target_arch = "x86_64")]
mod tiles {
    use super::{RowVectors, Wide};
    use crate::kernels::lanes16::Lanes;
    use std::mem::MaybeUninit;

    /// The forward sums by [`RowVectors`]: tiles of `R` of a packed block's `C` channels × `P`
    /// vectors (then pairs of vectors, then single ones), stored masked to each row into `out`
    /// `[c_out, oh, ow]` (whose every element the vectors' masks cover; masked stores read
    /// nothing, so nothing uninitialised is read).
    ///
    /// # Safety
    /// The CPU supports `V`'s tier; `C` is `wide.channel_tile`, `R` divides it, and `c_out`
    /// rounds up to `wide.c_out_padded`; `rows` is `wide`'s; `input.len() >= wide.input_len`,
    /// `out` holds `c_out · oh · ow` floats, `packed` `c_out_padded · taps` and `bias`
    /// `c_out_padded`.
    #[inline(always)]
    unsafe fn forward_rows<V: Lanes, const C: usize, const R: usize, const P: usize>(
        args: (&Wide, &[f32], &[f32], &[f32]),
        rows: &RowVectors,
        c_out: usize,
        out: &mut [MaybeUninit<f32>],
    ) {
        let count = rows.starts.len();
        // Vectors built for a wider unit would leave lanes unwritten.
        assert_eq!(rows.unit, V::WIDTH, "row vectors of another width");
        let main = count - count % P;
        // The vectors left over go two at a time, then one: a tile of one vector has only `R`
        // chains, too few for two FMA ports of four cycles' latency (on 14×14 maps two of
        // every channel's 14 vectors were left over). With `P` ≤ 2 no pair is left over.
        let pairs = count - (count - main) % 2;
        let parts = [0..main, main..pairs, pairs..count];
        // SAFETY: the caller upholds this function's contract.
        unsafe {
            // As many stores per vector as the vectors reach rows.
            match rows.parts {
                1 => forward_row_parts::<V, C, R, P, 1>(args, rows, parts, c_out, out),
                2 => forward_row_parts::<V, C, R, P, 2>(args, rows, parts, c_out, out),
                _ => forward_row_parts::<V, C, R, P, 3>(args, rows, parts, c_out, out),
            }
        }
    }

    /// [`forward_row_tiles`] over `parts`: vectors in tiles of `P`, of two, and of one.
    ///
    /// # Safety
    /// As [`forward_rows`]'s; each part holds a multiple of its tile's vectors.
    #[inline(always)]
    unsafe fn forward_row_parts<
        V: Lanes,
        const C: usize,
        const R: usize,
        const P: usize,
        const S: usize,
    >(
        args: (&Wide, &[f32], &[f32], &[f32]),
        rows: &RowVectors,
        [by_p, by_two, by_one]: [std::ops::Range<usize>; 3],
        c_out: usize,
        out: &mut [MaybeUninit<f32>],
    ) {
        // SAFETY: the caller upholds this function's contract.
        unsafe {
            forward_row_tiles::<V, C, R, P, S>(args, rows, by_p, c_out, out);
            forward_row_tiles::<V, C, R, 2, S>(args, rows, by_two, c_out, out);
            forward_row_tiles::<V, C, R, 1, S>(args, rows, by_one, c_out, out);
        }
    }

    /// [`forward_rows`] over the row vectors `vectors` (a multiple of `P` of them), each stored
    /// in `S` masked parts ([`RowVectors::parts`]): its own row's pixels, then (wide vectors)
    /// the next rows' (a part may be empty: a masked store of no lanes writes nothing). `S` is
    /// a constant so that the stores unroll: a loop over a vector's parts spilled the sums (the
    /// forward pass 8% slower on 3×32×32 inputs' first layers).
    ///
    /// # Safety
    /// As [`forward_rows`]'s.
    #[inline(always)]
    unsafe fn forward_row_tiles<
        V: Lanes,
        const C: usize,
        const R: usize,
        const P: usize,
        const S: usize,
    >(
        (wide, input, packed, bias): (&Wide, &[f32], &[f32], &[f32]),
        rows: &RowVectors,
        vectors: std::ops::Range<usize>,
        c_out: usize,
        out: &mut [MaybeUninit<f32>],
    ) {
        // SAFETY: the caller upholds this function's contract.
        unsafe {
            let taps = wide.offsets.len();
            let plane = wide.output[0] * wide.output[1];
            let (x, o) = (input.as_ptr(), out.as_mut_ptr().cast::<f32>());
            for block in 0..wide.c_out_padded / C {
                for first in (0..C).step_by(R) {
                    let channel = block * C + first;
                    if channel >= c_out {
                        break;
                    }
                    let w = packed.as_ptr().add(block * taps * C + first);
                    let live = (c_out - channel).min(R);
                    for i in vectors.clone().step_by(P) {
                        let starts: [usize; P] = std::array::from_fn(|v| rows.starts[i + v]);
                        let mut acc = [[V::zero(); P]; R];
                        for (c, a) in acc.iter_mut().enumerate() {
                            *a = [V::splat(bias[channel + c]); P];
                        }
                        for (k, &offset) in wide.offsets.iter().enumerate() {
                            let src = x.add(offset);
                            let xv: [V; P] = std::array::from_fn(|v| V::load(src.add(starts[v])));
                            let wk = w.add(k * C);
                            for (c, a) in acc.iter_mut().enumerate() {
                                let wc = V::splat(*wk.add(c));
                                for v in 0..P {
                                    a[v] = wc.mul_add(xv[v], a[v]);
                                }
                            }
                        }
                        for (c, a) in acc.iter().enumerate().take(live) {
                            let dst = o.add((channel + c) * plane);
                            for (v, value) in a.iter().enumerate() {
                                let lane0 = dst.wrapping_add(rows.dest[i + v]);
                                value.store_masked(lane0, rows.masks[i + v]);
                                for s in 1..S {
                                    // A wide vector's lanes on the `s`-th next row.
                                    let at = lane0.wrapping_sub(s * rows.wrap);
                                    value.store_masked(at, rows.next[i + v][s - 1]);
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    crate::kernels::lanes16::tier_entries! {
        forward_rows_avx512, forward_rows_avx2 as std::arch::x86_64::__m256 =>
            forward_rows<const C, const R, const P>(
                args: (&Wide, &[f32], &[f32], &[f32]),
                rows: &RowVectors,
                c_out: usize,
                out: &mut [std::mem::MaybeUninit<f32>],
            )
    }
}
