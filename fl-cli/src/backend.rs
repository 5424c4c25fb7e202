//! The compute device, chosen at build time by cargo feature.
//!
//! When several backend features are enabled (e.g. `--features cuda` on top of the default
//! `flex`), the most specific one wins: cuda, then wgpu, then ndarray, then flex.

use burn::tensor::Device;

/// The backend's name, as printed at start and written to the manifest.
pub fn name() -> &'static str {
    if cfg!(feature = "cuda") {
        "cuda"
    } else if cfg!(feature = "wgpu") {
        "wgpu"
    } else if cfg!(feature = "ndarray") {
        "ndarray"
    } else {
        "flex"
    }
}

/// The backend's name with the device's own where the backend reports one (GPU backends, e.g.
/// `wgpu (llvmpipe (LLVM 15.0.6, 256 bits))` on Mesa's lavapipe), as printed at start and by
/// `fl bench`.
pub fn label() -> String {
    match device_name() {
        Some(device) => format!("{} ({device})", name()),
        None => name().to_string(),
    }
}

/// The device's own name, as its driver reports it; `None` on the CPU backends. Opens the
/// device.
#[allow(unreachable_code)]
pub fn device_name() -> Option<String> {
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    return device().identity().map(|identity| identity.name);
    None
}

/// The device to run on (without autodiff).
#[allow(unreachable_code, deprecated)]
pub fn device() -> Device {
    #[cfg(feature = "cuda")]
    return Device::cuda(0);
    #[cfg(feature = "wgpu")]
    return Device::wgpu(burn::tensor::DeviceKind::DefaultDevice);
    #[cfg(feature = "ndarray")]
    return Device::ndarray();
    #[cfg(feature = "flex")]
    return Device::flex();
    #[cfg(not(any(
        feature = "cuda",
        feature = "wgpu",
        feature = "ndarray",
        feature = "flex"
    )))]
    compile_error!("enable one backend feature: flex, ndarray, wgpu or cuda");
}

/// The autodiff device clients train on: with Burn's balanced gradient checkpointing where
/// `checkpointing` (a training batch norm's output is recomputed in the backward pass instead
/// of kept; the same results bit for bit, less memory), else keeping every activation.
pub fn training_device(checkpointing: bool) -> Device {
    let device = device().autodiff();
    if checkpointing {
        device.gradient_checkpointing()
    } else {
        device
    }
}

/// The device global models are initialised on: the CPU's `flex` wherever it is built in (the
/// default), so that a seed gives the same initial weights on every backend (each backend has
/// its own generator); the weights then move to [`device`].
#[allow(unreachable_code)]
pub fn init_device() -> Device {
    #[cfg(feature = "flex")]
    return Device::flex();
    device()
}
