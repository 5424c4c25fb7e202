//! The vector instructions the hand-written kernels use: the best the CPU has, capped by
//! [`set_max_isa`]. Tests force every path this way on a CPU that would pick a higher one, and a
//! cap reproduces the code path of a smaller CPU. (The gemm inside im2col convolutions is the
//! `gemm` crate's, which picks its own instructions.)

use std::sync::atomic::{AtomicU8, Ordering};

/// An instruction tier of the kernels, lowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// The target's baseline (SSE2 on x86-64): the portable fallback.
    Baseline,
    /// AVX2 with FMA: the hand-written kernels in pairs of 256-bit registers with smaller
    /// register tiles (the same sums as on AVX-512): direct stride-1 convolutions, the kernels
    /// across samples, the small-map and 5-wide weight gradients, the dense input gradient, the
    /// 2×2 max-pool; and the im2col / col2im copy loops.
    Avx2,
    /// AVX-512F: the same kernels in 512-bit registers, and the 3×3 weight gradients without
    /// their zero products.
    Avx512,
}

static CAP: AtomicU8 = AtomicU8::new(Isa::Avx512 as u8);

impl Isa {
    fn from_u8(v: u8) -> Self {
        match v {
            0 => Self::Baseline,
            1 => Self::Avx2,
            _ => Self::Avx512,
        }
    }

    /// The highest tier this CPU supports.
    pub fn detected() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx512f") {
                return Self::Avx512;
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                return Self::Avx2;
            }
        }
        Self::Baseline
    }

    /// The tier the kernels use: the CPU's, capped by [`set_max_isa`].
    pub fn active() -> Self {
        Self::detected().min(Self::from_u8(CAP.load(Ordering::Relaxed)))
    }
}

/// Caps the kernels' tier for the whole process (the default cap is the highest tier); returns
/// the previous cap. Never raises the tier above what the CPU has.
pub fn set_max_isa(isa: Isa) -> Isa {
    Isa::from_u8(CAP.swap(isa as u8, Ordering::Relaxed))
}

/// Whether the kernels may use `isa` now (the CPU has it and the cap allows it).
#[inline]
#[cfg_attr(not(feature = "flex"), allow(dead_code))]
pub(crate) fn uses(isa: Isa) -> bool {
    Isa::active() >= isa
}

/// Serialises the tests that change the cap with the tests that compare the bits of two runs
/// (a cap changed between the runs would change their path, and so their bits).
#[cfg(test)]
pub(crate) fn test_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}
