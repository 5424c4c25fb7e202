//! The `gemm` crate's products as the kernels call them, and the depth blocks that fix their
//! order of additions.

use std::mem::MaybeUninit;

/// Rows of gemm's register tile for `f32`, which its depth blocks depend on: 4 vectors of 16
/// where the CPU has AVX-512F (`gemm` is built with `x86-v4`, and picks its kernel from the CPU,
/// not from [`crate::kernels::isa`]'s cap), else 2 vectors of 8 (its FMA kernel).
fn gemm_mr() -> usize {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        return 64;
    }
    16
}
/// Columns of that register tile (both kernels).
const GEMM_NR: usize = 6;

/// The depth block [`matmul`]'s gemm uses for an `m × n` product over `k` (`gemm-common`'s
/// `gemm_basic_generic`: small products take blocks of 512, others `kernel_params`'s). Each
/// output is a chain over one block, added onto the output block by block: two products with
/// the same depth blocks sum every output in the same order.
pub(super) fn gemm_depth_block(m: usize, n: usize, k: usize) -> usize {
    if m <= 64 && n <= 64 {
        k.min(512)
    } else {
        gemm_common::cache::kernel_params(m, n, k, gemm_mr(), GEMM_NR, size_of::<f32>()).kc
    }
}

/// The depth block of `m × n` products over `k` for every width `n` in `widths`, if it is the
/// same for all of them (then they sum every output in the same order), else `None`. Also
/// `None` where one of them is a product gemm does not run in depth blocks: one column or row
/// wide (its matrix-vector kernels) or at most 2 deep.
pub(super) fn common_depth_block(m: usize, widths: &[usize], k: usize) -> Option<usize> {
    if m <= 1 || k <= 2 || widths.iter().any(|&n| n <= 1) {
        return None;
    }
    let kc = gemm_depth_block(m, *widths.first()?, k);
    widths
        .iter()
        .all(|&n| gemm_depth_block(m, n, k) == kc)
        .then_some(kc)
}

/// `dst (m×n) = [dst +] lhs (m×k) · rhs (k×n)`, each matrix given as (slice, row stride, column
/// stride), so transposes are free. Single-threaded: callers parallelise over samples.
///
/// gemm wants the output's contiguous dimension to be m and the left operand contiguous along m
/// too, and otherwise packs (copies) it; callers orient their products so that the large
/// operand (the column matrix) never needs packing.
pub(super) fn matmul(
    dims: [usize; 3],
    (dst, dst_rs, dst_cs): (&mut [f32], usize, usize),
    accumulate: bool,
    lhs: (&[f32], usize, usize),
    rhs: (&[f32], usize, usize),
) {
    // SAFETY: `MaybeUninit<f32>` has `f32`'s layout, `dst` is initialised (what accumulating
    // reads), and only `f32` values are written through the view.
    let dst = unsafe { &mut *(dst as *mut [f32] as *mut [MaybeUninit<f32>]) };
    // SAFETY: as just said.
    unsafe { gemm_into(dims, (dst, dst_rs, dst_cs), accumulate, lhs, rhs) }
}

/// [`matmul`] into uninitialised memory: `dst (m×n) = lhs · rhs`, every element of it written
/// (an output not zeroed first).
pub(super) fn matmul_uninit(
    dims: [usize; 3],
    dst: (&mut [MaybeUninit<f32>], usize, usize),
    lhs: (&[f32], usize, usize),
    rhs: (&[f32], usize, usize),
) {
    // SAFETY: not accumulating, gemm reads nothing of `dst`.
    unsafe { gemm_into(dims, dst, false, lhs, rhs) }
}

/// The product of [`matmul`] and [`matmul_uninit`].
///
/// # Safety
/// When `accumulate`, the `m × n` elements of `dst` are initialised.
unsafe fn gemm_into(
    [m, n, k]: [usize; 3],
    (dst, dst_rs, dst_cs): (&mut [MaybeUninit<f32>], usize, usize),
    accumulate: bool,
    (lhs, lhs_rs, lhs_cs): (&[f32], usize, usize),
    (rhs, rhs_rs, rhs_cs): (&[f32], usize, usize),
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    dst[i * dst_rs + j * dst_cs].write(0.0);
                }
            }
        }
        return;
    }
    // The largest element each operand's strides reach must lie inside its slice: this is the
    // whole safety argument for the raw-pointer call below.
    assert!(
        (m - 1) * dst_rs + (n - 1) * dst_cs < dst.len(),
        "matmul: dst too short"
    );
    assert!(
        (m - 1) * lhs_rs + (k - 1) * lhs_cs < lhs.len(),
        "matmul: lhs too short"
    );
    assert!(
        (k - 1) * rhs_rs + (n - 1) * rhs_cs < rhs.len(),
        "matmul: rhs too short"
    );
    // SAFETY: the asserts above bound every index gemm computes from these strides; `dst` is an
    // exclusive borrow, and the operands are shared borrows that do not alias it. gemm reads
    // `dst` only when accumulating (`read_dst`), where the caller guarantees it initialised,
    // and stores only `f32` values.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr().cast::<f32>(),
            dst_cs as isize,
            dst_rs as isize,
            accumulate,
            lhs.as_ptr(),
            lhs_cs as isize,
            lhs_rs as isize,
            rhs.as_ptr(),
            rhs_cs as isize,
            rhs_rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}
