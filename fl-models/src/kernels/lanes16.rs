//! Sixteen `f32` lanes, the unit the direct kernels compute in: one AVX-512 register, or two
//! AVX2 registers side by side.
//!
//! Every operation is lane-wise (a fused multiply-add per lane, an addition per lane) except
//! [`Lanes16::reduce_add`], which adds the lanes by the same tree on both tiers (`l` with `l + 8`,
//! then `+ 4`, `+ 2`, `+ 1`, as `_mm512_reduce_add_ps`). So a kernel written once over
//! [`Lanes16`] computes the same sums in the same order on either tier: its results are the same
//! bits on an AVX2 CPU as on an AVX-512 one (a test compares the AVX2 kernels with scalar chains
//! in that order). The methods are `#[inline(always)]` and carry no target features of their
//! own: they are compiled into the kernel that calls them, which enables its tier's features.
//!
//! Kernels whose every output is its own chain (no sum across lanes: the direct forward pass by
//! rows, the gathered input gradient) are written over [`Lanes`], the lane-wise part, and run in
//! one register of either tier: 16 lanes on AVX-512, 8 on AVX2 (`__m256`).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// `f32` lanes in registers, operated on lane by lane: what kernels whose every output is its
/// own chain (the forward pass, the gathered input gradient) need, at any width.
///
/// # Safety
/// Every method needs the CPU features of the implementing tier, and pointers valid for the
/// [`Lanes::WIDTH`] floats (or, for [`Lanes::store_masked`], the masked ones) it reads or writes.
pub(crate) trait Lanes: Copy {
    /// Lanes per value.
    const WIDTH: usize;
    /// All lanes `+0`.
    unsafe fn zero() -> Self;
    /// All lanes `v`.
    unsafe fn splat(v: f32) -> Self;
    /// [`Lanes::WIDTH`] floats from `p` (unaligned).
    unsafe fn load(p: *const f32) -> Self;
    /// [`Lanes::WIDTH`] floats to `p` (unaligned).
    unsafe fn store(self, p: *mut f32);
    /// The lanes whose bit is set in `mask` (bit `l` for lane `l < WIDTH`) to `p + l`.
    unsafe fn store_masked(self, p: *mut f32, mask: u16);
    /// `self · b + c` per lane, rounded once.
    unsafe fn mul_add(self, b: Self, c: Self) -> Self;
    /// `self + b` per lane.
    unsafe fn add(self, b: Self) -> Self;
}

/// Sixteen `f32` lanes in registers, with the operations across lanes whose order the kernels
/// fix on every tier.
///
/// # Safety
/// As [`Lanes`].
pub(crate) trait Lanes16: Lanes {
    /// The floats at `p + l` whose bit `l` is set in `mask`, zeros in the other lanes (their
    /// addresses are not read).
    unsafe fn load_masked(p: *const f32, mask: u16) -> Self;
    /// The sum of the lanes: `l` with `l + 8`, then `+ 4`, `+ 2`, `+ 1`.
    unsafe fn reduce_add(self) -> f32;
    /// Transposes sixteen vectors in registers: lane `j` of `rows[i]` becomes lane `i` of
    /// `rows[j]` (layout changes between samples-in-lanes and plain NCHW).
    unsafe fn transpose(rows: &mut [Self; 16]);
}

#[cfg(target_arch = "x86_64")]
impl Lanes for __m512 {
    const WIDTH: usize = 16;
    #[inline(always)]
    unsafe fn zero() -> Self {
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> Self {
        unsafe { _mm512_set1_ps(v) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        unsafe { _mm512_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        unsafe { _mm512_storeu_ps(p, self) }
    }
    #[inline(always)]
    unsafe fn store_masked(self, p: *mut f32, mask: u16) {
        unsafe { _mm512_mask_storeu_ps(p, mask, self) }
    }
    #[inline(always)]
    unsafe fn mul_add(self, b: Self, c: Self) -> Self {
        unsafe { _mm512_fmadd_ps(self, b, c) }
    }
    #[inline(always)]
    unsafe fn add(self, b: Self) -> Self {
        unsafe { _mm512_add_ps(self, b) }
    }
}

#[cfg(target_arch = "x86_64")]
impl Lanes16 for __m512 {
    #[inline(always)]
    unsafe fn load_masked(p: *const f32, mask: u16) -> Self {
        unsafe { _mm512_maskz_loadu_ps(mask, p) }
    }
    #[inline(always)]
    unsafe fn reduce_add(self) -> f32 {
        unsafe { _mm512_reduce_add_ps(self) }
    }
    #[inline(always)]
    unsafe fn transpose(rows: &mut [Self; 16]) {
        unsafe {
            // Pairs of rows interleaved by 32 bits, then by 64, then 128-bit blocks twice.
            let mut t = [_mm512_setzero_ps(); 16];
            for i in 0..8 {
                t[2 * i] = _mm512_unpacklo_ps(rows[2 * i], rows[2 * i + 1]);
                t[2 * i + 1] = _mm512_unpackhi_ps(rows[2 * i], rows[2 * i + 1]);
            }
            let pd = _mm512_castps_pd;
            for i in 0..4 {
                let (a, b, c, d) = (t[4 * i], t[4 * i + 1], t[4 * i + 2], t[4 * i + 3]);
                rows[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(a), pd(c)));
                rows[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(a), pd(c)));
                rows[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(b), pd(d)));
                rows[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(b), pd(d)));
            }
            for half in 0..2 {
                for j in 0..4 {
                    let (a, b) = (rows[8 * half + j], rows[8 * half + 4 + j]);
                    t[8 * half + j] = _mm512_shuffle_f32x4::<0x88>(a, b);
                    t[8 * half + 4 + j] = _mm512_shuffle_f32x4::<0xdd>(a, b);
                }
            }
            for j in 0..8 {
                rows[j] = _mm512_shuffle_f32x4::<0x88>(t[j], t[8 + j]);
                rows[8 + j] = _mm512_shuffle_f32x4::<0xdd>(t[j], t[8 + j]);
            }
        }
    }
}

/// Sixteen lanes as two AVX2 registers: lanes 0–7, then 8–15.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(crate) struct Avx2x2(__m256, __m256);

#[cfg(target_arch = "x86_64")]
impl Avx2x2 {
    /// The first `n` lanes of `v` (any `n`, at most 8 written) to `p`, by plain stores of 4, 2
    /// and 1 floats. AVX's masked store (`vmaskmovps`) runs several times slower than a plain
    /// store on AMD's cores (Zen 3: 4–6 ns per 8-lane store in a loop of them, against under
    /// 1 ns for a load, `and` and plain store), and the kernels' partial stores (the last
    /// vector of each row of odd-width maps) are all of first lanes.
    ///
    /// # Safety
    /// AVX; `p` valid for writing `min(n, 8)` floats.
    #[inline(always)]
    pub(crate) unsafe fn store_first(p: *mut f32, v: __m256, n: usize) {
        unsafe {
            if n >= 8 {
                return _mm256_storeu_ps(p, v);
            }
            let (mut p, mut n, mut part) = (p, n, _mm256_castps256_ps128(v));
            if n >= 4 {
                _mm_storeu_ps(p, part);
                (p, n, part) = (p.add(4), n - 4, _mm256_extractf128_ps::<1>(v));
            }
            if n >= 2 {
                _mm_storel_epi64(p.cast(), _mm_castps_si128(part));
                (p, n, part) = (p.add(2), n - 2, _mm_movehl_ps(part, part));
            }
            if n == 1 {
                _mm_store_ss(p, part);
            }
        }
    }

    /// The lanes of `v` whose bit is set in `bits` to `p + l`: plain stores where the lanes
    /// are the first ones ([`Avx2x2::store_first`]), else AVX's masked store.
    ///
    /// # Safety
    /// AVX; `p + l` valid for writing for every set bit `l`.
    #[inline(always)]
    unsafe fn store_half(p: *mut f32, v: __m256, bits: u8) {
        unsafe {
            match bits {
                0 => {}
                _ if bits & bits.wrapping_add(1) == 0 => {
                    Self::store_first(p, v, bits.trailing_ones() as usize)
                }
                _ => _mm256_maskstore_ps(p, Self::mask(bits), v),
            }
        }
    }

    /// The AVX mask of the eight lanes of `bits` (bit `l` for lane `l`).
    #[inline(always)]
    unsafe fn mask(bits: u8) -> __m256i {
        unsafe {
            let select = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
            let set = _mm256_and_si256(_mm256_set1_epi32(bits as i32), select);
            _mm256_cmpeq_epi32(set, select)
        }
    }

    /// Transposes eight vectors of eight floats: interleaved by 32 bits, then by 64, then
    /// 128-bit halves exchanged.
    #[inline(always)]
    unsafe fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
        unsafe {
            let t: [__m256; 8] = std::array::from_fn(|i| {
                let (a, b) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
                if i % 2 == 0 {
                    _mm256_unpacklo_ps(a, b)
                } else {
                    _mm256_unpackhi_ps(a, b)
                }
            });
            // `s[i]`: columns `i` and `i + 4` of rows 0–3 (`i < 4`) or 4–7, in 128-bit halves.
            let s: [__m256; 8] = std::array::from_fn(|i| {
                let (q, c) = (i / 4 * 4, i % 4);
                let (a, b) = (t[q + c / 2], t[q + c / 2 + 2]);
                if c % 2 == 0 {
                    _mm256_shuffle_ps::<0x44>(a, b)
                } else {
                    _mm256_shuffle_ps::<0xee>(a, b)
                }
            });
            std::array::from_fn(|j| {
                let (a, b) = (s[j % 4], s[j % 4 + 4]);
                if j < 4 {
                    _mm256_permute2f128_ps::<0x20>(a, b)
                } else {
                    _mm256_permute2f128_ps::<0x31>(a, b)
                }
            })
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl Lanes for Avx2x2 {
    const WIDTH: usize = 16;
    #[inline(always)]
    unsafe fn zero() -> Self {
        unsafe { Avx2x2(_mm256_setzero_ps(), _mm256_setzero_ps()) }
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> Self {
        unsafe {
            let v = _mm256_set1_ps(v);
            Avx2x2(v, v)
        }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        unsafe { Avx2x2(_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))) }
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        unsafe {
            _mm256_storeu_ps(p, self.0);
            _mm256_storeu_ps(p.add(8), self.1);
        }
    }
    #[inline(always)]
    unsafe fn store_masked(self, p: *mut f32, mask: u16) {
        unsafe {
            let (low, high) = (mask as u8, (mask >> 8) as u8);
            Self::store_half(p, self.0, low);
            Self::store_half(p.wrapping_add(8), self.1, high);
        }
    }
    #[inline(always)]
    unsafe fn mul_add(self, b: Self, c: Self) -> Self {
        unsafe {
            Avx2x2(
                _mm256_fmadd_ps(self.0, b.0, c.0),
                _mm256_fmadd_ps(self.1, b.1, c.1),
            )
        }
    }
    #[inline(always)]
    unsafe fn add(self, b: Self) -> Self {
        unsafe { Avx2x2(_mm256_add_ps(self.0, b.0), _mm256_add_ps(self.1, b.1)) }
    }
}

#[cfg(target_arch = "x86_64")]
impl Lanes16 for Avx2x2 {
    #[inline(always)]
    unsafe fn load_masked(p: *const f32, mask: u16) -> Self {
        unsafe {
            let (low, high) = (mask as u8, (mask >> 8) as u8);
            let half = |p: *const f32, bits: u8| match bits {
                0 => _mm256_setzero_ps(),
                0xff => _mm256_loadu_ps(p),
                _ => _mm256_maskload_ps(p, Self::mask(bits)),
            };
            Avx2x2(half(p, low), half(p.add(8), high))
        }
    }
    #[inline(always)]
    unsafe fn reduce_add(self) -> f32 {
        unsafe {
            // l + 8, then l + 4, l + 2 and l + 1: `_mm512_reduce_add_ps`'s tree.
            let eight = _mm256_add_ps(self.0, self.1);
            let four = _mm_add_ps(
                _mm256_castps256_ps128(eight),
                _mm256_extractf128_ps::<1>(eight),
            );
            let two = _mm_add_ps(four, _mm_movehl_ps(four, four));
            _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)))
        }
    }
    #[inline(always)]
    unsafe fn transpose(rows: &mut [Self; 16]) {
        unsafe {
            // Four 8 × 8 blocks: rows 0–7 or 8–15, lanes 0–7 (`.0`) or 8–15 (`.1`).
            let block = |r0: usize, high: bool| -> [__m256; 8] {
                let b = std::array::from_fn(|i| {
                    let row = rows[r0 + i];
                    if high { row.1 } else { row.0 }
                });
                Self::transpose8(b)
            };
            let (top_low, bottom_low) = (block(0, false), block(8, false));
            let (top_high, bottom_high) = (block(0, true), block(8, true));
            for j in 0..8 {
                rows[j] = Avx2x2(top_low[j], bottom_low[j]);
                rows[8 + j] = Avx2x2(top_high[j], bottom_high[j]);
            }
        }
    }
}

/// Eight lanes in one AVX2 register: the AVX2 unit of the kernels whose every output is its own
/// chain (the direct forward pass by rows, the gathered input gradient), which can compute in
/// any width: in eight-lane units a register tile holds half as many pixels per channel, so
/// twice the channels or vectors fit in AVX2's sixteen registers.
#[cfg(target_arch = "x86_64")]
impl Lanes for __m256 {
    const WIDTH: usize = 8;
    #[inline(always)]
    unsafe fn zero() -> Self {
        unsafe { _mm256_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> Self {
        unsafe { _mm256_set1_ps(v) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        unsafe { _mm256_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        unsafe { _mm256_storeu_ps(p, self) }
    }
    #[inline(always)]
    unsafe fn store_masked(self, p: *mut f32, mask: u16) {
        unsafe { Avx2x2::store_half(p, self, mask as u8) }
    }
    #[inline(always)]
    unsafe fn mul_add(self, b: Self, c: Self) -> Self {
        unsafe { _mm256_fmadd_ps(self, b, c) }
    }
    #[inline(always)]
    unsafe fn add(self, b: Self) -> Self {
        unsafe { _mm256_add_ps(self, b) }
    }
}

/// The two entry points of a kernel written over [`Lanes16`] (or [`Lanes`]): `$avx512`
/// compiles it with AVX-512F and `__m512` lanes, `$avx2` with AVX2 and FMA and [`Avx2x2`]
/// lanes, or those named after `as` (the kernel and the lane methods are `#[inline(always)]`,
/// so both are compiled into the entry point with its tier's instructions). Each entry point's
/// safety contract is the kernel's, plus the tier.
macro_rules! tier_entries {
    ($avx512:ident, $avx2:ident =>
        $kernel:ident<$(const $c:ident),*>($($arg:ident: $ty:ty),* $(,)?)) => {
        $crate::kernels::lanes16::tier_entries! {
            $avx512, $avx2 as $crate::kernels::lanes16::Avx2x2 =>
                $kernel<$(const $c),*>($($arg: $ty),*)
        }
    };
    ($avx512:ident, $avx2:ident as $lanes:ty =>
        $kernel:ident<$(const $c:ident),*>($($arg:ident: $ty:ty),* $(,)?)) => {
        /// The kernel of the same name, with AVX-512F.
        ///
        /// # Safety
        /// The CPU supports AVX-512F; the kernel's contract holds.
        #[target_feature(enable = "avx512f")]
        pub(super) unsafe fn $avx512<$(const $c: usize),*>($($arg: $ty),*) {
            // SAFETY: the caller upholds the contract.
            unsafe { $kernel::<std::arch::x86_64::__m512, $($c),*>($($arg),*) }
        }
        /// The kernel of the same name, with AVX2 and FMA.
        ///
        /// # Safety
        /// The CPU supports AVX2 and FMA; the kernel's contract holds.
        #[target_feature(enable = "avx2,fma")]
        pub(super) unsafe fn $avx2<$(const $c: usize),*>($($arg: $ty),*) {
            // SAFETY: the caller upholds the contract.
            unsafe { $kernel::<$lanes, $($c),*>($($arg),*) }
        }
    };
}
#[cfg(target_arch = "x86_64")]
pub(crate) use tier_entries;

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    #[target_feature(enable = "avx2,fma")]
    fn avx2_reduce(v: &[f32; 16]) -> f32 {
        // SAFETY: the caller checked AVX2 and FMA; `v` holds sixteen floats.
        unsafe { Avx2x2::load(v.as_ptr()).reduce_add() }
    }

    #[target_feature(enable = "avx2,fma")]
    fn avx2_masked(v: &[f32; 16], mask: u16) -> [f32; 16] {
        let mut out = [-1.0f32; 16];
        // SAFETY: as above; `out` holds sixteen floats.
        unsafe { Avx2x2::load(v.as_ptr()).store_masked(out.as_mut_ptr(), mask) };
        out
    }

    #[target_feature(enable = "avx2,fma")]
    fn avx2_transpose(m: &[f32; 256], mask: u16) -> [f32; 256] {
        let mut out = [0.0f32; 256];
        // SAFETY: as above; each row of `m` and `out` holds sixteen floats.
        unsafe {
            let mut rows: [Avx2x2; 16] =
                std::array::from_fn(|i| Avx2x2::load_masked(m[16 * i..].as_ptr(), mask));
            Avx2x2::transpose(&mut rows);
            for (i, row) in rows.iter().enumerate() {
                row.store(out[16 * i..].as_mut_ptr());
            }
        }
        out
    }

    #[test]
    fn avx2_lanes_transpose_and_load_masked() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            return;
        }
        let m: [f32; 256] = std::array::from_fn(|i| i as f32);
        for mask in [0xffffu16, 0x0001, 0x00ff, 0x1ff, 0x7fff] {
            // SAFETY: AVX2 and FMA checked above.
            let got = unsafe { avx2_transpose(&m, mask) };
            for (i, j) in (0..16).flat_map(|i| (0..16).map(move |j| (i, j))) {
                let want = if mask >> j & 1 == 1 {
                    m[16 * i + j]
                } else {
                    0.0
                };
                assert_eq!(got[16 * j + i], want, "mask {mask:#x} row {i} lane {j}");
            }
        }
    }

    /// The tree, spelled out: lanes whose sums round differently in any other order.
    #[test]
    fn avx2_lanes_reduce_and_store_as_avx512() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            return;
        }
        // Lanes 1 and 9 cancel in the tree's first step; added in any order that does not pair
        // them first, lane 0's 1 is lost against 2^24.
        let mut v: [f32; 16] = std::array::from_fn(|l| l as f32 * 0.25);
        (v[0], v[1], v[9]) = (1.0, 16_777_216.0, -16_777_216.0);
        let eight: Vec<f32> = (0..8).map(|l| v[l] + v[l + 8]).collect();
        let four: Vec<f32> = (0..4).map(|l| eight[l] + eight[l + 4]).collect();
        let two = [four[0] + four[2], four[1] + four[3]];
        // SAFETY: AVX2 and FMA checked above.
        let got = unsafe { avx2_reduce(&v) };
        assert_eq!(got.to_bits(), (two[0] + two[1]).to_bits());
        let sequential: f32 = v.iter().sum();
        assert_ne!(
            got.to_bits(),
            sequential.to_bits(),
            "the test cannot tell orders apart"
        );
        // Every run of first lanes (plain stores of 4, 2 and 1 floats per half), first lanes
        // of the upper half alone, and masks with gaps (AVX's masked store).
        let first = (0..=16).map(|n| ((1u32 << n) - 1) as u16);
        for mask in first.chain([0x0f0f, 0xff00, 0x0300, 0x7f00, 0x8001, 0x00f6]) {
            // SAFETY: AVX2 and FMA checked above.
            let out = unsafe { avx2_masked(&v, mask) };
            for l in 0..16 {
                let want = if mask >> l & 1 == 1 { v[l] } else { -1.0 };
                assert_eq!(out[l], want, "mask {mask:#x} lane {l}");
            }
        }
    }
}
