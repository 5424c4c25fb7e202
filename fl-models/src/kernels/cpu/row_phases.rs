//! The AVX-512 row moves the stride-2 kernels share (`strided.rs`, `depthwise_direct.rs`): an
//! input row of at most 32 floats as two vectors, its column phases, and a row rebuilt from its
//! even and odd columns.

use std::arch::x86_64::*;

use super::first_lanes;

/// Floats per vector.
const LANES: usize = 16;

/// The masks of the first `n` floats (at most 32) of a row held as two vectors, for
/// [`load_row`] and [`store_interleaved`] (computed once per plane: per row they cost as much
/// as a depthwise row's own work).
pub(super) fn row_masks(n: usize) -> [u16; 2] {
    [first_lanes(n), first_lanes(n.saturating_sub(LANES))]
}

/// The floats of a row at `row` that `masks` ([`row_masks`]) lets through, as two vectors,
/// zeros elsewhere.
///
/// # Safety
/// AVX-512F; the floats the masks let through are readable (none are read with `[0, 0]`).
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) unsafe fn load_row(row: *const f32, [lo, hi]: [u16; 2]) -> (__m512, __m512) {
    // SAFETY: the masks read only the floats the caller vouches for.
    unsafe {
        (
            _mm512_maskz_loadu_ps(lo, row),
            _mm512_maskz_loadu_ps(hi, row.wrapping_add(LANES)),
        )
    }
}

/// The column phase `2j + shift` of a row: the permutation that takes lane `j` from column
/// `2j + shift` of [`load_row`]'s two vectors, and the lanes whose column is not left of the
/// row (`_mm512_maskz_permutex2var_ps(inside, a, index, b)`).
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) fn column_phase(shift: isize) -> (__m512i, u16) {
    // A few vector operations: the depthwise kernels call this per plane of a few rows.
    let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let columns = _mm512_add_epi32(even, _mm512_set1_epi32(shift as i32));
    let index = _mm512_and_si512(columns, _mm512_set1_epi32(31));
    // Lanes `j` with `2j + shift < 0`: the first `⌈−shift / 2⌉`.
    let left = (-shift).max(0).unsigned_abs().div_ceil(2);
    (index, !first_lanes(left))
}

/// `v` one lane down: lane `j` takes lane `j + 1` where `lanes` lets it through, else zero.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) fn next_lane(lanes: u16, v: __m512) -> __m512 {
    let next = _mm512_setr_epi32(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0);
    _mm512_maskz_permutexvar_ps(lanes, next, v)
}

/// Stores the floats `masks` ([`row_masks`]) lets through of the row whose even columns are
/// `even`'s lanes and odd ones `odd`'s.
///
/// # Safety
/// AVX-512F; the floats the masks let through at `row` are writable.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) unsafe fn store_interleaved(
    row: *mut f32,
    [lo, hi]: [u16; 2],
    even: __m512,
    odd: __m512,
) {
    // Lane 2i takes even lane `half + i`, lane 2i + 1 odd lane `half + i`.
    let first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    let second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    // SAFETY: the masks write only the floats the caller vouches for.
    unsafe {
        _mm512_mask_storeu_ps(row, lo, _mm512_permutex2var_ps(even, first, odd));
        _mm512_mask_storeu_ps(
            row.wrapping_add(LANES),
            hi,
            _mm512_permutex2var_ps(even, second, odd),
        );
    }
}
