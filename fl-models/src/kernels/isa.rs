//! The vector instructions the hand-written kernels use: the best the CPU has, capped by
//! [`set_max_isa`]. A cap reproduces the code path of a smaller CPU; tests force every path on a
//! CPU that would pick a higher one with a cap of their own thread pool's (`capped`). (The gemm
//! inside im2col convolutions is the `gemm` crate's, which picks its own instructions.)

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

    /// The tier the kernels use: the CPU's, capped by [`set_max_isa`] (in tests, by the cap of
    /// the thread, if it has one: `capped`).
    pub fn active() -> Self {
        #[cfg(test)]
        if let Some(cap) = TEST_CAP.get() {
            return Self::detected().min(cap);
        }
        Self::detected().min(Self::from_u8(CAP.load(Ordering::Relaxed)))
    }
}

#[cfg(test)]
thread_local! {
    /// This thread's cap in tests (see [`capped`]).
    static TEST_CAP: std::cell::Cell<Option<Isa>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` on a thread pool of its own whose threads cap the kernels at `isa` (tests only).
/// Tests run in parallel: a cap on the whole process would change the tier under other tests'
/// kernels between two of their reads of it (a layout built for one tier, run by another's
/// kernel), which failed them now and then.
#[cfg(test)]
pub(crate) fn capped<R: Send>(isa: Isa, f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .start_handler(move |_| TEST_CAP.set(Some(isa)))
        .build()
        .expect("a test thread pool")
        .install(f)
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

/// Serialises the tests that change process-wide switches (the kernel families') with the tests
/// that compare the bits of two runs (a switch flipped between the runs would change their
/// path, and so their bits).
#[cfg(test)]
pub(crate) fn test_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}
