//! Max-pooling (no padding, no dilation, floor mode) forward and backward.

use std::mem::MaybeUninit;

use rayon::prelude::*;

/// Shapes and options of one max-pooling (no padding, no dilation, floor mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolGeometry {
    /// Batch × channels: the number of independent planes.
    pub planes: usize,
    /// Input height and width.
    pub input: [usize; 2],
    /// Window height and width.
    pub kernel: [usize; 2],
    /// Stride along height and width.
    pub stride: [usize; 2],
    /// Output height and width.
    pub output: [usize; 2],
}

impl PoolGeometry {
    /// The offset (within the plane) of the maximum of window `(oy, ox)`: the first maximum in
    /// row-major order, or the first NaN (which max-pooling propagates).
    #[inline]
    pub(super) fn argmax(&self, plane: &[f32], oy: usize, ox: usize) -> usize {
        let w = self.input[1];
        let (y0, x0) = (oy * self.stride[0], ox * self.stride[1]);
        let mut best = y0 * w + x0;
        let mut best_val = plane[best];
        if best_val.is_nan() {
            return best;
        }
        for ky in 0..self.kernel[0] {
            let row = (y0 + ky) * w + x0;
            for kx in 0..self.kernel[1] {
                let v = plane[row + kx];
                if v > best_val || v.is_nan() {
                    best = row + kx;
                    best_val = v;
                    if v.is_nan() {
                        return best;
                    }
                }
            }
        }
        best
    }
}

/// Whether a plane holds a NaN (a branch-free fold, so it vectorises).
fn has_nan(plane: &[f32]) -> bool {
    plane.iter().fold(false, |acc, v| acc | v.is_nan())
}

/// Whether a plane holds a NaN outside the 2×2/2 windows (the last row or column of an odd
/// size): with the vector kernels' own check of the windows, the same test as [`has_nan`],
/// without a separate pass over the plane.
#[cfg(target_arch = "x86_64")]
fn has_nan_outside_windows(g: &PoolGeometry, plane: &[f32]) -> bool {
    let ([h, w], [oh, ow]) = (g.input, g.output);
    let rows = plane.chunks_exact(w).take(h);
    has_nan(&plane[2 * oh * w..h * w]) || rows.take(2 * oh).any(|row| has_nan(&row[2 * ow..]))
}

/// `planes` planes of `len > 0` floats, `fill(i, plane)` writing plane `i` on the thread pool,
/// each zeroed by its task just before (in the L1 cache, not in a pass over the whole output
/// first).
fn per_plane(planes: usize, len: usize, fill: impl Fn(usize, &mut [f32]) + Sync) -> Vec<f32> {
    let write = |out: &mut [MaybeUninit<f32>]| {
        out.par_chunks_mut(len).enumerate().for_each(|(i, plane)| {
            plane.fill(MaybeUninit::new(0.0));
            // SAFETY: every float of the plane was just written.
            fill(i, unsafe { plane.assume_init_mut() })
        })
    };
    // SAFETY: the planes cover the buffer, and each is written whole above.
    unsafe { super::written_whole(planes * len, write) }
}

/// Max-pooling forward.
pub fn max_pool2d_forward(g: &PoolGeometry, x: &[f32]) -> Vec<f32> {
    let in_plane = g.input[0] * g.input[1];
    let [oh, ow] = g.output;
    if oh * ow == 0 || in_plane == 0 {
        return super::par_zeroed(g.planes * oh * ow);
    }
    let pair = g.kernel == [2, 2] && g.stride == [2, 2];
    per_plane(g.planes, oh * ow, |i, y_p| {
        pool_forward_plane(g, pair, &x[i * in_plane..][..in_plane], y_p)
    })
}

#[inline(never)]
fn pool_forward_plane(g: &PoolGeometry, pair: bool, x_p: &[f32], y_p: &mut [f32]) {
    let (w, ow) = (g.input[1], g.output[1]);
    #[cfg(target_arch = "x86_64")]
    if pair && crate::kernels::isa::uses(crate::kernels::isa::Isa::Avx2) {
        // SAFETY: the tier is present (`uses` never exceeds the detected tier); the functions
        // check the slice lengths they rely on.
        let windows_nan = unsafe {
            if crate::kernels::isa::uses(crate::kernels::isa::Isa::Avx512) {
                avx512_pool::forward_2x2(w, g.output, x_p, y_p)
            } else {
                avx2_pool::forward_2x2(w, g.output, x_p, y_p)
            }
        };
        if !windows_nan && !has_nan_outside_windows(g, x_p) {
            return;
        }
    }
    if g.kernel == [1, 1] {
        // A window of one (ResNet's option-A shortcut subsamples this way): a strided copy.
        let [sy, sx] = g.stride;
        for (oy, out) in y_p.chunks_exact_mut(ow).enumerate() {
            let row = &x_p[oy * sy * w..];
            for (ox, o) in out.iter_mut().enumerate() {
                *o = row[ox * sx];
            }
        }
        return;
    }
    let fast = pair && !has_nan(x_p);
    if fast {
        // The common 2×2/2 case on NaN-free data: plain comparisons, no index bookkeeping.
        for (oy, out) in y_p.chunks_exact_mut(ow).enumerate() {
            let (r0, r1) = (&x_p[2 * oy * w..], &x_p[(2 * oy + 1) * w..]);
            for (ox, o) in out.iter_mut().enumerate() {
                let top = if r0[2 * ox + 1] > r0[2 * ox] {
                    r0[2 * ox + 1]
                } else {
                    r0[2 * ox]
                };
                let bottom = if r1[2 * ox + 1] > r1[2 * ox] {
                    r1[2 * ox + 1]
                } else {
                    r1[2 * ox]
                };
                *o = if bottom > top { bottom } else { top };
            }
        }
        return;
    }
    for (oy, out) in y_p.chunks_exact_mut(ow).enumerate() {
        for (ox, o) in out.iter_mut().enumerate() {
            *o = x_p[g.argmax(x_p, oy, ox)];
        }
    }
}

/// Max-pooling backward: each output's gradient goes to its window's maximum.
pub fn max_pool2d_backward(g: &PoolGeometry, x: &[f32], dy: &[f32]) -> Vec<f32> {
    let in_plane = g.input[0] * g.input[1];
    let [oh, ow] = g.output;
    if oh * ow == 0 || in_plane == 0 {
        return super::par_zeroed(g.planes * in_plane);
    }
    let pair = g.kernel == [2, 2] && g.stride == [2, 2];
    per_plane(g.planes, in_plane, |i, dx_p| {
        let x_p = &x[i * in_plane..][..in_plane];
        pool_backward_plane(g, pair, x_p, &dy[i * oh * ow..][..oh * ow], dx_p)
    })
}

#[inline(never)]
fn pool_backward_plane(g: &PoolGeometry, pair: bool, x_p: &[f32], dy_p: &[f32], dx_p: &mut [f32]) {
    let (w, [oh, ow]) = (g.input[1], g.output);
    #[cfg(target_arch = "x86_64")]
    if pair && crate::kernels::isa::uses(crate::kernels::isa::Isa::Avx2) {
        // SAFETY: the tier is present (`uses` never exceeds the detected tier); the functions
        // check the slice lengths they rely on.
        let windows_nan = unsafe {
            if crate::kernels::isa::uses(crate::kernels::isa::Isa::Avx512) {
                avx512_pool::backward_2x2(w, g.output, x_p, dy_p, dx_p)
            } else {
                avx2_pool::backward_2x2(w, g.output, x_p, dy_p, dx_p)
            }
        };
        if !windows_nan && !has_nan_outside_windows(g, x_p) {
            return;
        }
        // The paths below add onto a zeroed plane.
        dx_p.fill(0.0);
    }
    if g.kernel == [1, 1] {
        // Each output's gradient to its one input, added onto the zeroed plane as below (so a
        // −0 lands as +0).
        let [sy, sx] = g.stride;
        for (oy, grads) in dy_p.chunks_exact(ow).enumerate() {
            let row = &mut dx_p[oy * sy * w..];
            for (ox, &grad) in grads.iter().enumerate() {
                row[ox * sx] += grad;
            }
        }
        return;
    }
    let fast = pair && !has_nan(x_p);
    if fast {
        // Windows do not overlap: each input gets its window's gradient or zero, chosen with
        // comparisons and selects (no data-dependent branches or indices).
        for (oy, grads) in dy_p.chunks_exact(ow).enumerate() {
            let (x0, x1) = (
                &x_p[2 * oy * w..][..2 * ow],
                &x_p[(2 * oy + 1) * w..][..2 * ow],
            );
            let (top, bottom) = dx_p[2 * oy * w..].split_at_mut(w);
            let (d0, d1) = (&mut top[..2 * ow], &mut bottom[..2 * ow]);
            for (ox, &grad) in grads.iter().enumerate() {
                let (i, j) = (2 * ox, 2 * ox + 1);
                let (a, b, c, d) = (x0[i], x0[j], x1[i], x1[j]);
                let top = if b > a { b } else { a };
                let bottom = if d > c { d } else { c };
                let max = if bottom > top { bottom } else { top };
                // The first maximum in row-major order takes the gradient; masks, not branches.
                let at_a = (a == max) as u32;
                let at_b = (b == max) as u32 & !at_a;
                let at_c = (c == max) as u32 & !(at_a | at_b);
                let at_d = 1 & !(at_a | at_b | at_c);
                let g = grad.to_bits();
                d0[i] = f32::from_bits(g & at_a.wrapping_neg());
                d0[j] = f32::from_bits(g & at_b.wrapping_neg());
                d1[i] = f32::from_bits(g & at_c.wrapping_neg());
                d1[j] = f32::from_bits(g & at_d.wrapping_neg());
            }
        }
        return;
    }
    for oy in 0..oh {
        for ox in 0..ow {
            dx_p[g.argmax(x_p, oy, ox)] += dy_p[oy * ow + ox];
        }
    }
}

/// The 2×2, stride-2 max-pool passes on NaN-free windows, 16 windows per step.
#[cfg(target_arch = "x86_64")]
mod avx512_pool {
    use super::super::first_lanes;
    use std::arch::x86_64::*;

    /// The corners of the 16 windows from `(oy, ox)` on, `n` of them real (zeros in the other
    /// lanes): top left, top right, bottom left, bottom right; and the lanes holding a NaN.
    ///
    /// # Safety
    /// AVX-512F; `ox + n <= ow` with `2·ow <= w`, and `x` holds rows `2·oy` and `2·oy + 1` of
    /// width `w`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn corners(
        x: &[f32],
        w: usize,
        [oy, ox]: [usize; 2],
        n: usize,
    ) -> ([__m512; 4], __mmask16) {
        let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
        let (lo, hi) = (first_lanes(2 * n), first_lanes((2 * n).saturating_sub(16)));
        // SAFETY: the loads are masked to the `2·n` floats from `2·ox` of both rows, inside `x`
        // by the contract.
        let [t0, t1, b0, b1] = unsafe {
            let r0 = x.as_ptr().add(2 * oy * w + 2 * ox);
            let r1 = r0.add(w);
            [
                _mm512_maskz_loadu_ps(lo, r0),
                _mm512_maskz_loadu_ps(hi, r0.wrapping_add(16)),
                _mm512_maskz_loadu_ps(lo, r1),
                _mm512_maskz_loadu_ps(hi, r1.wrapping_add(16)),
            ]
        };
        let nan =
            _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(t0, t1) | _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(b0, b1);
        let corners = [
            _mm512_permutex2var_ps(t0, even, t1),
            _mm512_permutex2var_ps(t0, odd, t1),
            _mm512_permutex2var_ps(b0, even, b1),
            _mm512_permutex2var_ps(b0, odd, b1),
        ];
        (corners, nan)
    }

    /// `y` of one plane (row width `w`, `[oh, ow]` windows); returns whether a window held a NaN
    /// (then `y` is not the result). The scalar path's selects, `if b > a { b } else { a }`,
    /// are `vmaxps(b, a)` (it returns its second operand unless the first is greater, so equal
    /// values and zeros of either sign pick the same one).
    ///
    /// # Safety
    /// The CPU supports AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn forward_2x2(
        w: usize,
        [oh, ow]: [usize; 2],
        x: &[f32],
        y: &mut [f32],
    ) -> bool {
        assert!(2 * ow <= w && x.len() >= 2 * oh * w && y.len() >= oh * ow);
        let mut nan: __mmask16 = 0;
        for oy in 0..oh {
            for ox in (0..ow).step_by(16) {
                let n = (ow - ox).min(16);
                // SAFETY: `ox + n <= ow`, and the asserts keep the rows and the `n` outputs
                // from `oy·ow + ox` inside the slices.
                unsafe {
                    let ([a, b, c, d], window_nan) = corners(x, w, [oy, ox], n);
                    let (top, bottom) = (_mm512_max_ps(b, a), _mm512_max_ps(d, c));
                    let out = y.as_mut_ptr().add(oy * ow + ox);
                    _mm512_mask_storeu_ps(out, first_lanes(n), _mm512_max_ps(bottom, top));
                    nan |= window_nan;
                }
            }
        }
        nan != 0
    }

    /// `dx` of one plane (row width `w`, `[oh, ow]` windows; `dx` zero on entry): each window's
    /// gradient goes to its first maximum in row-major order, the other three get zero. Returns
    /// whether a window held a NaN (then `dx` is not the result).
    ///
    /// # Safety
    /// The CPU supports AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn backward_2x2(
        w: usize,
        [oh, ow]: [usize; 2],
        x: &[f32],
        dy: &[f32],
        dx: &mut [f32],
    ) -> bool {
        assert!(2 * ow <= w && x.len() >= 2 * oh * w && dx.len() >= 2 * oh * w);
        assert!(dy.len() >= oh * ow);
        let low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        let high = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
        let mut nan: __mmask16 = 0;
        // SAFETY: every access below is masked to the `2·ow` floats of a row pair, or the `ow`
        // gradients of a window row, which the asserts above keep inside the slices.
        unsafe {
            for oy in 0..oh {
                for ox in (0..ow).step_by(16) {
                    let n = (ow - ox).min(16);
                    let (lo, hi) = (first_lanes(2 * n), first_lanes((2 * n).saturating_sub(16)));
                    let ([a, b, c, d], window_nan) = corners(x, w, [oy, ox], n);
                    nan |= window_nan;
                    let max = _mm512_max_ps(_mm512_max_ps(a, b), _mm512_max_ps(c, d));
                    let at_a = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(a, max);
                    let at_b = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(b, max) & !at_a;
                    let at_c = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(c, max) & !(at_a | at_b);
                    let at_d = !(at_a | at_b | at_c);
                    let grad = _mm512_maskz_loadu_ps(first_lanes(n), dy.as_ptr().add(oy * ow + ox));
                    let (ga, gb) = (
                        _mm512_maskz_mov_ps(at_a, grad),
                        _mm512_maskz_mov_ps(at_b, grad),
                    );
                    let (gc, gd) = (
                        _mm512_maskz_mov_ps(at_c, grad),
                        _mm512_maskz_mov_ps(at_d, grad),
                    );
                    let d0 = dx.as_mut_ptr().add(2 * oy * w + 2 * ox);
                    let d1 = d0.add(w);
                    _mm512_mask_storeu_ps(d0, lo, _mm512_permutex2var_ps(ga, low, gb));
                    _mm512_mask_storeu_ps(
                        d0.wrapping_add(16),
                        hi,
                        _mm512_permutex2var_ps(ga, high, gb),
                    );
                    _mm512_mask_storeu_ps(d1, lo, _mm512_permutex2var_ps(gc, low, gd));
                    _mm512_mask_storeu_ps(
                        d1.wrapping_add(16),
                        hi,
                        _mm512_permutex2var_ps(gc, high, gd),
                    );
                }
            }
        }
        nan != 0
    }
}

/// The same passes as [`avx512_pool`] in AVX2 registers, 8 windows per step: the even and odd
/// columns split with shuffles instead of two-source permutes, masks as all-ones lanes.
#[cfg(target_arch = "x86_64")]
mod avx2_pool {
    use crate::kernels::lanes16::Avx2x2;
    use std::arch::x86_64::*;

    /// The AVX mask of the first `n` lanes of 8.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn first(n: usize) -> __m256i {
        let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        _mm256_cmpgt_epi32(_mm256_set1_epi32(n.min(8) as i32), lanes)
    }

    /// The corners of the 8 windows from `(oy, ox)` on, `n` of them real (zeros in the other
    /// lanes): top left, top right, bottom left, bottom right; and whether one holds a NaN.
    ///
    /// # Safety
    /// AVX2; `ox + n <= ow` with `2·ow <= w`, and `x` holds rows `2·oy` and `2·oy + 1` of
    /// width `w`.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn corners(x: &[f32], w: usize, [oy, ox]: [usize; 2], n: usize) -> ([__m256; 4], bool) {
        // SAFETY: the loads are the `2·n` floats from `2·ox` of both rows (masked unless all
        // 16 are), inside `x` by the contract.
        let [t0, t1, b0, b1] = unsafe {
            let r0 = x.as_ptr().add(2 * oy * w + 2 * ox);
            let r1 = r0.add(w);
            if n == 8 {
                // Masked moves are slow on some CPUs (microcoded stores on AMD's).
                let load = |p: *const f32| _mm256_loadu_ps(p);
                [load(r0), load(r0.add(8)), load(r1), load(r1.add(8))]
            } else {
                let (lo, hi) = (first(2 * n), first((2 * n).saturating_sub(8)));
                [
                    _mm256_maskload_ps(r0, lo),
                    _mm256_maskload_ps(r0.wrapping_add(8), hi),
                    _mm256_maskload_ps(r1, lo),
                    _mm256_maskload_ps(r1.wrapping_add(8), hi),
                ]
            }
        };
        let nan = _mm256_or_ps(
            _mm256_cmp_ps::<_CMP_UNORD_Q>(t0, t1),
            _mm256_cmp_ps::<_CMP_UNORD_Q>(b0, b1),
        );
        // Within each 128-bit half, even (0b10_00_10_00) or odd (0b11_01_11_01) columns of
        // both registers; then the halves' middle quarters swapped into column order.
        let split = |a: __m256, b: __m256| {
            let even = _mm256_shuffle_ps::<0b10_00_10_00>(a, b);
            let odd = _mm256_shuffle_ps::<0b11_01_11_01>(a, b);
            let order = |v: __m256| {
                _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(v)))
            };
            (order(even), order(odd))
        };
        let ((a, b), (c, d)) = (split(t0, t1), split(b0, b1));
        ([a, b, c, d], _mm256_movemask_ps(nan) != 0)
    }

    /// `y` of one plane, as [`super::avx512_pool::forward_2x2`].
    ///
    /// # Safety
    /// The CPU supports AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn forward_2x2(
        w: usize,
        [oh, ow]: [usize; 2],
        x: &[f32],
        y: &mut [f32],
    ) -> bool {
        assert!(2 * ow <= w && x.len() >= 2 * oh * w && y.len() >= oh * ow);
        let mut nan = false;
        for oy in 0..oh {
            for ox in (0..ow).step_by(8) {
                let n = (ow - ox).min(8);
                // SAFETY: `ox + n <= ow`, and the asserts keep the rows and the `n` outputs
                // from `oy·ow + ox` inside the slices.
                unsafe {
                    let ([a, b, c, d], window_nan) = corners(x, w, [oy, ox], n);
                    let (top, bottom) = (_mm256_max_ps(b, a), _mm256_max_ps(d, c));
                    let (out, max) = (y.as_mut_ptr().add(oy * ow + ox), _mm256_max_ps(bottom, top));
                    Avx2x2::store_first(out, max, n);
                    nan |= window_nan;
                }
            }
        }
        nan
    }

    /// `dx` of one plane, as [`super::avx512_pool::backward_2x2`].
    ///
    /// # Safety
    /// The CPU supports AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn backward_2x2(
        w: usize,
        [oh, ow]: [usize; 2],
        x: &[f32],
        dy: &[f32],
        dx: &mut [f32],
    ) -> bool {
        assert!(2 * ow <= w && x.len() >= 2 * oh * w && dx.len() >= 2 * oh * w);
        assert!(dy.len() >= oh * ow);
        let mut nan = false;
        // SAFETY: every access below is to the `2·n` floats of a row pair from `2·ox`, or the
        // `n` gradients from `ox` of a window row (masked unless `n` is 8), which the asserts
        // above keep inside the slices.
        unsafe {
            for oy in 0..oh {
                for ox in (0..ow).step_by(8) {
                    let n = (ow - ox).min(8);
                    let ([a, b, c, d], window_nan) = corners(x, w, [oy, ox], n);
                    nan |= window_nan;
                    let max = _mm256_max_ps(_mm256_max_ps(a, b), _mm256_max_ps(c, d));
                    let at_a = _mm256_cmp_ps::<_CMP_EQ_OQ>(a, max);
                    let at_b = _mm256_andnot_ps(at_a, _mm256_cmp_ps::<_CMP_EQ_OQ>(b, max));
                    let ab = _mm256_or_ps(at_a, at_b);
                    let at_c = _mm256_andnot_ps(ab, _mm256_cmp_ps::<_CMP_EQ_OQ>(c, max));
                    let at_d =
                        _mm256_andnot_ps(_mm256_or_ps(ab, at_c), _mm256_castsi256_ps(first(8)));
                    let grads = dy.as_ptr().add(oy * ow + ox);
                    let grad = if n == 8 {
                        _mm256_loadu_ps(grads)
                    } else {
                        _mm256_maskload_ps(grads, first(n))
                    };
                    let pick = |mask| _mm256_and_ps(mask, grad);
                    // Interleave two windows' columns back: within halves, then across them.
                    let store = |row: *mut f32, left: __m256, right: __m256| {
                        let (l, h) = (
                            _mm256_unpacklo_ps(left, right),
                            _mm256_unpackhi_ps(left, right),
                        );
                        let (first_half, second_half) = (
                            _mm256_permute2f128_ps::<0x20>(l, h),
                            _mm256_permute2f128_ps::<0x31>(l, h),
                        );
                        Avx2x2::store_first(row, first_half, 2 * n);
                        if n > 4 {
                            Avx2x2::store_first(row.add(8), second_half, 2 * n - 8);
                        }
                    };
                    let d0 = dx.as_mut_ptr().add(2 * oy * w + 2 * ox);
                    store(d0, pick(at_a), pick(at_b));
                    store(d0.wrapping_add(w), pick(at_c), pick(at_d));
                }
            }
        }
        nan
    }
}
