//! im2col and col2im: a sample's receptive fields copied into (and its column gradients added
//! back from) the column matrix that the im2col path's gemm multiplies, straight in NCHW.

use super::{Conv2dGeometry, copy_short};

/// Calls `$generic` compiled for AVX2 when the kernels may use it ([`crate::kernels::isa`]) (the copy loops of im2col and col2im
/// move whole 256-bit registers then), and as compiled for the baseline target otherwise.
macro_rules! avx2_dispatch {
    ($(#[$doc:meta])* $vis:vis fn $name:ident => $generic:ident($($arg:ident: $ty:ty),*)) => {
        $(#[$doc])*
        $vis fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2")]
                fn avx2($($arg: $ty),*) {
                    $generic($($arg),*)
                }
                if $crate::kernels::isa::uses($crate::kernels::isa::Isa::Avx2) {
                    // SAFETY: the CPU supports AVX2 (`uses` never exceeds the detected tier).
                    return unsafe { avx2($($arg),*) };
                }
            }
            $generic($($arg),*)
        }
    };
}

avx2_dispatch! {
    /// Copies one sample's receptive fields into `col` (`col_rows × out_plane`, row-major, rows
    /// `stride` floats apart: a sample's columns inside a group's column matrix).
    pub(super) fn im2col_strided => im2col_generic(g: &Conv2dGeometry, x: &[f32], col: &mut [f32], stride: usize)
}

avx2_dispatch! {
    /// Adds the column matrix `col` (rows `stride` floats apart) back onto one sample's input
    /// gradient (the adjoint of [`im2col_strided`]).
    pub(super) fn col2im_add_strided => col2im_add_generic(g: &Conv2dGeometry, col: &[f32], dx: &mut [f32], stride: usize)
}

/// [`im2col_strided`] into one sample's own column matrix.
pub(super) fn im2col(g: &Conv2dGeometry, x: &[f32], col: &mut [f32]) {
    im2col_strided(g, x, col, g.out_plane());
}

/// [`col2im_add_strided`] from one sample's own column matrix.
pub(super) fn col2im_add(g: &Conv2dGeometry, col: &[f32], dx: &mut [f32]) {
    col2im_add_strided(g, col, dx, g.out_plane());
}

#[inline(always)]
fn im2col_generic(g: &Conv2dGeometry, x: &[f32], col: &mut [f32], stride: usize) {
    let [h, w] = g.input;
    let [kh, kw] = g.kernel;
    let [sh, sw] = g.stride;
    let [ph, pw] = g.pad_begin;
    let [oh, ow] = g.output;
    let out_plane = g.out_plane();
    if g.is_pointwise() {
        // A pointwise column matrix is the input itself: whole planes, not rows of a few floats.
        for (c, plane) in x.chunks_exact(out_plane).enumerate() {
            copy_short(&mut col[c * stride..][..out_plane], plane);
        }
        return;
    }
    for c in 0..g.c_in {
        let plane = &x[c * h * w..(c + 1) * h * w];
        for ky in 0..kh {
            for kx in 0..kw {
                let row = &mut col[((c * kh + ky) * kw + kx) * stride..][..out_plane];
                let (lo, hi) = g.valid_columns(kx);
                for oy in 0..oh {
                    let dst = &mut row[oy * ow..(oy + 1) * ow];
                    let iy = (oy * sh + ky).wrapping_sub(ph);
                    if iy >= h {
                        dst.fill(0.0);
                        continue;
                    }
                    let src = &plane[iy * w..(iy + 1) * w];
                    dst[..lo].fill(0.0);
                    dst[hi..].fill(0.0);
                    // `hi > lo`: on a map narrower than the padding no column is inside, and
                    // `lo + kx - pw` would wrap.
                    if sw == 1 && hi > lo {
                        let start = lo + kx - pw;
                        copy_short(&mut dst[lo..hi], &src[start..start + (hi - lo)]);
                    } else if sw == 2 && hi > lo {
                        // Every second input as the first of each pair, which vectorises into
                        // shuffles (an indexed load per value did not); the last one alone, as
                        // its pair may end past the row.
                        let (start, last) = (lo * 2 + kx - pw, hi - 1);
                        let pairs = src[start..start + 2 * (last - lo)].chunks_exact(2);
                        for (d, pair) in dst[lo..last].iter_mut().zip(pairs) {
                            *d = pair[0];
                        }
                        dst[last] = src[last * 2 + kx - pw];
                    } else {
                        for (ox, d) in dst[lo..hi].iter_mut().enumerate() {
                            *d = src[(lo + ox) * sw + kx - pw];
                        }
                    }
                }
            }
        }
    }
}

#[inline(always)]
fn col2im_add_generic(g: &Conv2dGeometry, col: &[f32], dx: &mut [f32], stride: usize) {
    let [h, w] = g.input;
    let [kh, kw] = g.kernel;
    let [sh, sw] = g.stride;
    let [ph, pw] = g.pad_begin;
    let [oh, ow] = g.output;
    let out_plane = g.out_plane();
    if g.is_pointwise() {
        for (c, plane) in dx.chunks_exact_mut(out_plane).enumerate() {
            for (d, s) in plane.iter_mut().zip(&col[c * stride..][..out_plane]) {
                *d += s;
            }
        }
        return;
    }
    for c in 0..g.c_in {
        let plane = &mut dx[c * h * w..(c + 1) * h * w];
        for ky in 0..kh {
            for kx in 0..kw {
                let row = &col[((c * kh + ky) * kw + kx) * stride..][..out_plane];
                let (lo, hi) = g.valid_columns(kx);
                for oy in 0..oh {
                    let iy = (oy * sh + ky).wrapping_sub(ph);
                    if iy >= h {
                        continue;
                    }
                    let src = &row[oy * ow..(oy + 1) * ow];
                    let dst = &mut plane[iy * w..(iy + 1) * w];
                    if sw == 1 && hi > lo {
                        let start = lo + kx - pw;
                        for (d, s) in dst[start..start + (hi - lo)].iter_mut().zip(&src[lo..hi]) {
                            *d += s;
                        }
                    } else if sw == 2 && hi > lo {
                        // As in im2col: pairs, the last value alone.
                        let (start, last) = (lo * 2 + kx - pw, hi - 1);
                        let pairs = dst[start..start + 2 * (last - lo)].chunks_exact_mut(2);
                        for (pair, s) in pairs.zip(&src[lo..last]) {
                            pair[0] += s;
                        }
                        dst[last * 2 + kx - pw] += src[last];
                    } else {
                        for ox in lo..hi {
                            dst[ox * sw + kx - pw] += src[ox];
                        }
                    }
                }
            }
        }
    }
}

/// `src` `[rows][cols]` transposed into `dst` `[cols][rows]`: gemm's operands with the depth
/// (`rows`) outermost, where it would otherwise pack them one float at a time.
pub(super) fn transpose([rows, cols]: [usize; 2], src: &[f32], dst: &mut [f32]) {
    assert!(src.len() >= rows * cols && dst.len() >= rows * cols);
    if rows == 0 || cols == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        use crate::kernels::isa::{Isa, uses};
        // SAFETY (both): the CPU supports the tier; the lengths are checked above.
        if uses(Isa::Avx512) {
            return unsafe { blocks::transpose_avx512([rows, cols], src, dst) };
        }
        if uses(Isa::Avx2) {
            // On AVX2 the element-by-element loop below took 4.5% of MobileNetV2's training.
            return unsafe { blocks::transpose_avx2([rows, cols], src, dst) };
        }
    }
    for (r, row) in src.chunks_exact(cols).take(rows).enumerate() {
        for (c, &v) in row.iter().enumerate() {
            dst[c * rows + r] = v;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod blocks {
    use super::super::first_lanes;
    use crate::kernels::lanes16::Lanes16;

    /// [`super::transpose`] by 16 × 16 blocks in registers, masked at the edges.
    ///
    /// # Safety
    /// The CPU supports `V`'s tier; `src` and `dst` hold `rows · cols` floats.
    #[inline(always)]
    unsafe fn transpose<V: Lanes16>([rows, cols]: [usize; 2], src: &[f32], dst: &mut [f32]) {
        assert!(src.len() >= rows * cols && dst.len() >= rows * cols);
        for r0 in (0..rows).step_by(16) {
            let height = (rows - r0).min(16);
            for c0 in (0..cols).step_by(16) {
                let width = (cols - c0).min(16);
                // SAFETY: register operations of the caller's tier.
                let mut block = [unsafe { V::zero() }; 16];
                for (i, v) in block.iter_mut().enumerate().take(height) {
                    let from = src[(r0 + i) * cols + c0..].as_ptr();
                    // SAFETY: the masked floats `(r0 + i)·cols + c0 .. + width` lie in `src`.
                    *v = unsafe { V::load_masked(from, first_lanes(width)) };
                }
                // SAFETY: register shuffles of the caller's tier.
                unsafe { V::transpose(&mut block) };
                for (j, v) in block.iter().enumerate().take(width) {
                    let to = &mut dst[(c0 + j) * rows + r0..][..height];
                    // SAFETY: the masked floats are `to`'s `height`.
                    unsafe { v.store_masked(to.as_mut_ptr(), first_lanes(height)) };
                }
            }
        }
    }

    crate::kernels::lanes16::tier_entries! {
        transpose_avx512, transpose_avx2 =>
            transpose<>(shape: [usize; 2], src: &[f32], dst: &mut [f32])
    }
}
