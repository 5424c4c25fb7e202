//! A fully connected layer's input gradient `dx = dy · Wᵀ` in gemm's order, without packing
//! the weight.
//!
//! `W` is stored `[d_in, d_out]`, so `Wᵀ` is a column-major operand. gemm (after swapping the
//! product to write its output column-major) packs it as a row-major left-hand side: a
//! transposing gather over the whole weight, once per product, which took more time than the
//! multiply-adds (the FedAvg CNN's 3136→512 layer: 4.6 ms of a 50-sample step, VGG-16's
//! 4096→4096 layer 63 ms where the product itself needs about 17).
//!
//! Here each output `dx[b, i]` is the same chain as gemm's: over the depth (`d_out`) in gemm's
//! depth blocks, each block a sequence of fused multiply-adds from +0 in ascending order, the
//! blocks added onto the output one by one. The vectors run across samples instead: a row of
//! `W` is read in place, one broadcast per weight, against the output gradient transposed to
//! `[d_out][samples]` (a small copy). Results are gemm's bit for bit (a test compares them).

use rayon::prelude::*;
use std::mem::MaybeUninit;

use super::gemm_depth_block;
use crate::kernels::isa::{Isa, uses};

/// Weight rows per register tile.
const ROWS: usize = 6;
/// The most samples (four vectors of 16).
const MAX_SAMPLES: usize = 64;

/// Whether [`input_grad`] computes `dy (m × k) · Wᵀ` for an `n × k` weight: on AVX-512 or
/// AVX2 with FMA (gemm's micro-kernels chain the same fused multiply-adds on both), for
/// 2–64 samples, where gemm runs its blocked product (its `k ≤ 2`, `m·n ≤ 256` and
/// single-row special cases sum in other orders).
pub(crate) fn applies(m: usize, n: usize, k: usize) -> bool {
    cfg!(target_arch = "x86_64")
        && (2..=MAX_SAMPLES).contains(&m)
        && n >= 2
        && k > 2
        && m * n > 256
        && uses(Isa::Avx2)
}

/// `dy · Wᵀ` as a row-major `m × n` matrix: `dy` is `m × k` with row stride `dy_rs` (columns
/// contiguous), `w` is `n × k` with row stride `w_rs` (columns contiguous).
///
/// # Panics
/// If [`applies`] is false or a row reaches past its slice.
pub(crate) fn input_grad(
    (dy, dy_rs): (&[f32], usize),
    (w, w_rs): (&[f32], usize),
    [m, n, k]: [usize; 3],
) -> Vec<f32> {
    assert!(applies(m, n, k), "dense kernel: unsupported shape");
    assert!(dy.len() >= (m - 1) * dy_rs + k && w.len() >= (n - 1) * w_rs + k);
    let vectors = m.div_ceil(16);
    let lanes = vectors * 16;
    // `[vectors][k][16]`, the samples past `m` zero: a tile reads each vector's depths as one
    // sequential stream (a stride of `lanes` floats reused a quarter of the L1 cache's sets).
    let mut dy_t = vec![0.0f32; k * lanes];
    for (b, row) in dy.chunks(dy_rs).take(m).enumerate() {
        let (v, l) = (b / 16, b % 16);
        for (o, &x) in row[..k].iter().enumerate() {
            dy_t[(v * k + o) * 16 + l] = x;
        }
    }
    // gemm sees this product swapped (its output is written column-major): n × m over k.
    let kc = gemm_depth_block(n, m, k);
    // `[n][lanes]`: each task a run of weight rows. Neither it nor `dx` is zeroed first (a
    // serial pass over each that, on two threads, left one idle for a third of this product).
    // SAFETY: the tiles cover every row and lane of each task's chunk, and store each before
    // they read it (their first depth block is stored, the others added on).
    let out_t = unsafe {
        super::written_whole(n * lanes, |out_t| {
            out_t
                .par_chunks_mut(ROWS * 8 * lanes)
                .enumerate()
                .for_each(|(task, out)| {
                    let first = task * ROWS * 8;
                    for (tile, out) in out.chunks_mut(ROWS * lanes).enumerate() {
                        let i0 = first + tile * ROWS;
                        let rows = out.len() / lanes;
                        let w = &w[i0 * w_rs..];
                        #[cfg(target_arch = "x86_64")]
                        tile_rows((w, w_rs, &dy_t[..], kc, k), [rows, vectors], out);
                    }
                })
        })
    };
    // SAFETY: each row of `dx` is written whole.
    unsafe {
        super::written_whole(m * n, |dx| {
            dx.par_chunks_mut(n).enumerate().for_each(|(b, row)| {
                for (i, v) in row.iter_mut().enumerate() {
                    v.write(out_t[i * lanes + b]);
                }
            })
        })
    }
}

/// `out[r][lanes] = Σ_o w[r, o] · dy_t[v][o][16]` for one tile of `rows ≤ ROWS` weight rows
/// and all `vectors` vectors of samples, on the active tier: AVX-512 in one register tile of
/// `rows` × `vectors` (at most 24 of its 32 registers), AVX2 (16 registers of 8 lanes) one
/// vector at a time in tiles of `ROWS` rows.
///
/// `w` holds `rows` rows of `k` at stride `w_rs`, `dy_t` `k · lanes` floats and `out`
/// `rows · lanes`, `lanes = 16 · vectors` (the tile checks them).
#[cfg(target_arch = "x86_64")]
fn tile_rows(
    (w, w_rs, dy_t, kc, k): (&[f32], usize, &[f32], usize, usize),
    [rows, vectors]: [usize; 2],
    out: &mut [MaybeUninit<f32>],
) {
    let lanes = 16 * vectors;
    let args = |r: usize, v: usize| (&w[r * w_rs..], w_rs, &dy_t[16 * k * v..], kc, k, lanes);
    // SAFETY: `applies` checked the tier; `tiles::tile` asserts its slices' lengths.
    unsafe {
        if uses(Isa::Avx512) {
            match (vectors, rows) {
                (1, ROWS) => tiles::tile_avx512::<1, ROWS>(args(0, 0), out),
                (2, ROWS) => tiles::tile_avx512::<2, ROWS>(args(0, 0), out),
                (3, ROWS) => tiles::tile_avx512::<3, ROWS>(args(0, 0), out),
                (4, ROWS) => tiles::tile_avx512::<4, ROWS>(args(0, 0), out),
                (v, _) => {
                    for (r, out) in out.chunks_mut(lanes).enumerate() {
                        match v {
                            1 => tiles::tile_avx512::<1, 1>(args(r, 0), out),
                            2 => tiles::tile_avx512::<2, 1>(args(r, 0), out),
                            3 => tiles::tile_avx512::<3, 1>(args(r, 0), out),
                            _ => tiles::tile_avx512::<4, 1>(args(r, 0), out),
                        }
                    }
                }
            }
            return;
        }
        // One vector of samples at a time, `ROWS` rows: 12 accumulators, the vector's two
        // halves and a broadcast fit AVX2's sixteen registers (a tile of two vectors by three
        // rows needs seventeen, and LLVM kept two of its totals on the stack: 27% of the peak).
        for v in 0..vectors {
            let mut r = 0;
            while r < rows {
                let out = &mut out[r * lanes + 16 * v..];
                if rows - r >= ROWS {
                    tiles::tile_avx2::<1, ROWS>(args(r, v), out);
                    r += ROWS;
                } else {
                    tiles::tile_avx2::<1, 1>(args(r, v), out);
                    r += 1;
                }
            }
        }
    }
}

/// The kernel, written once over [`Lanes16`](crate::kernels::lanes16::Lanes16) and compiled
/// for each tier.
#[cfg(target_arch = "x86_64")]
mod tiles {
    use crate::kernels::lanes16::{Lanes16, tier_entries};

    use std::mem::MaybeUninit;

    tier_entries!(tile_avx512, tile_avx2 =>
        tile<const V, const R>(args: (&[f32], usize, &[f32], usize, usize, usize),
            out: &mut [MaybeUninit<f32>]));

    /// `out[r·lanes + 16v + l] = Σ_o w[r, o] · dy_t[(v·k + o)·16 + l]` for `R` weight rows and
    /// `V` vectors of samples (of `lanes` per depth): per depth block of `kc` a chain of
    /// multiply-adds from +0, added onto the output block by block (the first block stored, so
    /// `out` need not be initialised: each output it reads it has stored).
    ///
    /// # Safety
    /// `L`'s tier (the lengths are checked).
    #[inline(always)]
    unsafe fn tile<L: Lanes16, const V: usize, const R: usize>(
        (w, w_rs, dy_t, kc, k, lanes): (&[f32], usize, &[f32], usize, usize, usize),
        out: &mut [MaybeUninit<f32>],
    ) {
        assert!(w.len() >= (R - 1) * w_rs + k && dy_t.len() >= 16 * k * V);
        assert!(out.len() >= (R - 1) * lanes + 16 * V && kc > 0 && 16 * V <= lanes);
        // SAFETY: the asserts bound every access.
        unsafe {
            let (w, d, o) = (w.as_ptr(), dy_t.as_ptr(), out.as_mut_ptr().cast::<f32>());
            for k0 in (0..k).step_by(kc) {
                let mut acc = [[L::zero(); V]; R];
                for depth in k0..(k0 + kc).min(k) {
                    let dv: [L; V] = std::array::from_fn(|v| L::load(d.add((v * k + depth) * 16)));
                    for (r, a) in acc.iter_mut().enumerate() {
                        let wb = L::splat(*w.add(r * w_rs + depth));
                        for (v, a) in a.iter_mut().enumerate() {
                            *a = wb.mul_add(dv[v], *a);
                        }
                    }
                }
                for (r, a) in acc.iter().enumerate() {
                    for (v, a) in a.iter().enumerate() {
                        let at = o.add(r * lanes + 16 * v);
                        let sum = if k0 == 0 { *a } else { L::load(at).add(*a) };
                        sum.store(at);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::tests::at_every_isa;
    use crate::kernels::cpu::tests::values;

    #[test]
    fn input_gradients_are_gemms_bits() {
        // The FedAvg CNN's and VGG-16's shapes (several depth blocks), one to four vectors of
        // samples with partial ones, weight rows past the last whole tile, rows with strides
        // longer than the row, and products gemm splits into depth blocks of other sizes.
        let shapes = [
            (50, 512, 3136, 0, 0),
            (50, 100, 4096, 0, 0),
            (2, 200, 300, 0, 0),
            (17, 131, 700, 3, 5),
            (64, 100, 1030, 0, 1),
            (33, 48, 5000, 2, 0),
            (16, 17, 2000, 0, 0),
        ];
        at_every_isa(|isa| {
            for (m, n, k, dy_pad, w_pad) in shapes {
                let (dy_rs, w_rs) = (k + dy_pad, k + w_pad);
                let dy = values(m * dy_rs, 1);
                let w = values(n * w_rs, 2);
                if !applies(m, n, k) {
                    assert!(isa < Isa::Avx2, "{m}×{n}×{k}: applies");
                    continue;
                }
                let fast = input_grad((&dy, dy_rs), (&w, w_rs), [m, n, k]);
                let mut gemm = vec![0.0f32; m * n];
                super::super::matmul(
                    [m, n, k],
                    (&mut gemm, n, 1),
                    false,
                    (&dy, dy_rs, 1),
                    (&w, 1, w_rs),
                );
                let first = fast
                    .iter()
                    .zip(&gemm)
                    .position(|(a, b)| a.to_bits() != b.to_bits());
                assert_eq!(first, None, "{m}×{n}×{k}");
            }
        });
        // gemm's other routines: one sample, small products, shallow products; and batches
        // past four vectors.
        for (m, n, k) in [(1, 500, 500), (8, 32, 500), (50, 500, 2), (65, 500, 500)] {
            assert!(!applies(m, n, k), "{m}×{n}×{k}");
        }
    }
}
