//! The kernel families' switches: each on by default, off for A/B comparisons against Burn's
//! own ops (`fl bench --burn-kernels`).

use std::sync::atomic::{AtomicU16, Ordering};

/// One family of the CPU kernels, switched on and off on its own for A/B comparisons
/// (`fl bench --burn-kernels=LIST`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// Dense 2-D convolutions (direct and im2col; grouped ones other than depthwise stay Burn's).
    Conv,
    /// Depthwise convolutions (groups = channels).
    Depthwise,
    /// Max-pooling.
    MaxPool,
    /// Global average pooling (bitwise Burn's adaptive average pooling to 1 × 1).
    AvgPool,
    /// BatchNorm, training and inference passes.
    BatchNorm,
    /// ReLU, ReLU6 and hard-swish.
    Activation,
    /// Fully connected layers (bitwise Burn's; only the output copy of flex's product is gone).
    Linear,
    /// The optimiser step: [`fl_core::trainer::FusedSgd`]'s and [`fl_core::trainer::FusedAdam`]'s
    /// one parallel pass per parameter (bitwise Burn's `Sgd` and `Adam`).
    Optimizer,
    /// Evaluation in chunks of the batch, block by block (`common::infer_in_chunks`).
    EvalChunks,
}

impl Kernel {
    /// Every kernel family.
    pub const ALL: [Kernel; 9] = [
        Kernel::Conv,
        Kernel::Depthwise,
        Kernel::MaxPool,
        Kernel::AvgPool,
        Kernel::BatchNorm,
        Kernel::Activation,
        Kernel::Linear,
        Kernel::Optimizer,
        Kernel::EvalChunks,
    ];

    /// The name `fl bench --burn-kernels` takes.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Conv => "conv",
            Kernel::Depthwise => "depthwise",
            Kernel::MaxPool => "max-pool",
            Kernel::AvgPool => "avg-pool",
            Kernel::BatchNorm => "batch-norm",
            Kernel::Activation => "activation",
            Kernel::Linear => "linear",
            Kernel::Optimizer => "optimizer",
            Kernel::EvalChunks => "eval-chunks",
        }
    }

    fn bit(self) -> u16 {
        1 << self as u8
    }
}

impl std::str::FromStr for Kernel {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Kernel::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = Kernel::ALL.iter().map(|k| k.name()).collect();
                format!("unknown kernel '{s}' (known: {}, all)", names.join(", "))
            })
    }
}

impl std::fmt::Display for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The kernel families that are on, one bit each.
static ENABLED: AtomicU16 = AtomicU16::new(u16::MAX);

/// Turns every kernel on (the default) or off for the whole process: off, every function here
/// calls Burn's own op. For A/B comparisons (`fl bench --burn-kernels`); results differ only by
/// floating-point summation order (and ReLU6's gradient at exactly 0 and 6).
pub fn set_enabled(enabled: bool) {
    ENABLED.store(if enabled { u16::MAX } else { 0 }, Ordering::Relaxed);
    fl_core::trainer::set_fused_optimizers(enabled);
}

/// Turns one kernel family on or off for the whole process (see [`set_enabled`]).
pub fn set_kernel_enabled(kernel: Kernel, enabled: bool) {
    if kernel == Kernel::Optimizer {
        fl_core::trainer::set_fused_optimizers(enabled);
    }
    if enabled {
        ENABLED.fetch_or(kernel.bit(), Ordering::Relaxed);
    } else {
        ENABLED.fetch_and(!kernel.bit(), Ordering::Relaxed);
    }
}

/// Whether `kernel` is on; always `false` without the `flex` feature.
pub fn kernel_enabled(kernel: Kernel) -> bool {
    let on = match kernel {
        Kernel::Optimizer => fl_core::trainer::fused_optimizers(),
        _ => ENABLED.load(Ordering::Relaxed) & kernel.bit() != 0,
    };
    cfg!(feature = "flex") && on
}

/// Whether every kernel is on (see [`set_enabled`]); always `false` without the `flex` feature.
pub fn enabled() -> bool {
    Kernel::ALL.into_iter().all(kernel_enabled)
}
