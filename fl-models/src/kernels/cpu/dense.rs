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

use super::gemm_depth_block;
use crate::kernels::isa::{Isa, uses};

/// Weight rows per register tile.
const ROWS: usize = 6;
/// The most samples (four vectors of 16).
const MAX_SAMPLES: usize = 64;

/// Whether [`input_grad`] computes `dy (m × k) · Wᵀ` for an `n × k` weight: on AVX-512, for
/// 2–64 samples, where gemm runs its blocked product (its `k ≤ 2`, `m·n ≤ 256` and
/// single-row special cases sum in other orders).
pub(crate) fn applies(m: usize, n: usize, k: usize) -> bool {
    cfg!(target_arch = "x86_64")
        && (2..=MAX_SAMPLES).contains(&m)
        && n >= 2
        && k > 2
        && m * n > 256
        && uses(Isa::Avx512)
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
    // `[k][lanes]`, the samples past `m` zero.
    let mut dy_t = vec![0.0f32; k * lanes];
    for (b, row) in dy.chunks(dy_rs).take(m).enumerate() {
        for (o, &v) in row[..k].iter().enumerate() {
            dy_t[o * lanes + b] = v;
        }
    }
    // gemm sees this product swapped (its output is written column-major): n × m over k.
    let kc = gemm_depth_block(n, m, k);
    // `[n][lanes]`: each task a run of weight rows.
    let mut out_t = vec![0.0f32; n * lanes];
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
                // SAFETY: `applies` checked AVX-512F; `w` holds `rows` rows of `k` at stride
                // `w_rs` (asserted above), `dy_t` `k · lanes` floats and `out` `rows · lanes`.
                unsafe {
                    let args = (w, w_rs, &dy_t[..], kc, k);
                    match (vectors, rows) {
                        (1, ROWS) => avx512::tile::<1, ROWS>(args, out),
                        (2, ROWS) => avx512::tile::<2, ROWS>(args, out),
                        (3, ROWS) => avx512::tile::<3, ROWS>(args, out),
                        (4, ROWS) => avx512::tile::<4, ROWS>(args, out),
                        (v, _) => {
                            for (r, out) in out.chunks_mut(lanes).enumerate() {
                                let args = (&w[r * w_rs..], w_rs, &dy_t[..], kc, k);
                                match v {
                                    1 => avx512::tile::<1, 1>(args, out),
                                    2 => avx512::tile::<2, 1>(args, out),
                                    3 => avx512::tile::<3, 1>(args, out),
                                    _ => avx512::tile::<4, 1>(args, out),
                                }
                            }
                        }
                    }
                }
            }
        });
    let mut dx = vec![0.0f32; m * n];
    dx.par_chunks_mut(n).enumerate().for_each(|(b, row)| {
        for (i, v) in row.iter_mut().enumerate() {
            *v = out_t[i * lanes + b];
        }
    });
    dx
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// `out[r][lanes] = Σ_o w[r, o] · dy_t[o][lanes]` for `R` weight rows and `V` vectors of
    /// samples: per depth block of `kc` a chain of multiply-adds from +0, added onto the
    /// output block by block (the first block stored).
    ///
    /// # Safety
    /// AVX-512F; `w` holds `R` rows of `k` floats at stride `w_rs`, `dy_t` `k · 16V` floats
    /// and `out` `R · 16V`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn tile<const V: usize, const R: usize>(
        (w, w_rs, dy_t, kc, k): (&[f32], usize, &[f32], usize, usize),
        out: &mut [f32],
    ) {
        let lanes = 16 * V;
        assert!(w.len() >= (R - 1) * w_rs + k && dy_t.len() >= k * lanes);
        assert!(out.len() >= R * lanes && kc > 0);
        // SAFETY: the asserts bound every access.
        unsafe {
            let (w, d, o) = (w.as_ptr(), dy_t.as_ptr(), out.as_mut_ptr());
            for k0 in (0..k).step_by(kc) {
                let mut acc = [[_mm512_setzero_ps(); V]; R];
                for depth in k0..(k0 + kc).min(k) {
                    let dv: [__m512; V] =
                        std::array::from_fn(|v| _mm512_loadu_ps(d.add(depth * lanes + 16 * v)));
                    for (r, a) in acc.iter_mut().enumerate() {
                        let wb = _mm512_set1_ps(*w.add(r * w_rs + depth));
                        for (v, a) in a.iter_mut().enumerate() {
                            *a = _mm512_fmadd_ps(wb, dv[v], *a);
                        }
                    }
                }
                for (r, a) in acc.iter().enumerate() {
                    for (v, a) in a.iter().enumerate() {
                        let at = o.add(r * lanes + 16 * v);
                        let sum = if k0 == 0 {
                            *a
                        } else {
                            _mm512_add_ps(_mm512_loadu_ps(at), *a)
                        };
                        _mm512_storeu_ps(at, sum);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::tests::values;
    use crate::kernels::isa::test_lock;

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
        let _guard = test_lock();
        for (m, n, k, dy_pad, w_pad) in shapes {
            let (dy_rs, w_rs) = (k + dy_pad, k + w_pad);
            let dy = values(m * dy_rs, 1);
            let w = values(n * w_rs, 2);
            if !applies(m, n, k) {
                assert!(Isa::active() < Isa::Avx512, "{m}×{n}×{k}: applies");
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
        // gemm's other routines: one sample, small products, shallow products; and batches
        // past four vectors.
        for (m, n, k) in [(1, 500, 500), (8, 32, 500), (50, 500, 2), (65, 500, 500)] {
            assert!(!applies(m, n, k), "{m}×{n}×{k}");
        }
    }
}
