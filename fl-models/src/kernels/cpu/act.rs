//! Elementwise activations with their derivatives, fused: one pass forward, one backward, split
//! over the thread pool (Burn composes ReLU6 and hard-swish of clamps and masks, several passes
//! and a branchy mask fill each, and runs its elementwise ops on one thread). Values follow
//! Burn's definitions exactly, boundaries included; ReLU is bitwise Burn's. The backward passes
//! of ReLU and ReLU6 read the output (ReLU6's gradient then passes on the open interval
//! 0 < x < 6, PyTorch's rule; Burn's masks pass it at 0 and 6 too).

use rayon::prelude::*;

use crate::kernels::Activation;

/// Elements per parallel task.
const CHUNK: usize = 1 << 14;
/// Hard-sigmoid's slope, as Burn's `hard_swish` passes it.
const ALPHA: f32 = (1.0 / 6.0) as f32;

/// `v` where `pass`, else +0: a bit mask, no branch.
#[inline(always)]
fn keep_if(pass: bool, v: f32) -> f32 {
    f32::from_bits(v.to_bits() & u32::from(pass).wrapping_neg())
}

#[inline(always)]
pub(super) fn forward_one(act: Activation, x: f32) -> f32 {
    match act {
        Activation::Identity => x,
        // Exactly Burn's flex ReLU (NaN kept, −0 → 0).
        Activation::Relu => keep_if(x > 0.0 || x.is_nan(), x),
        Activation::Relu6 => x.clamp(0.0, 6.0),
        Activation::HardSwish => x * (ALPHA * x + 0.5).clamp(0.0, 1.0),
    }
}

/// d activation / dx times `g`, given `x`: the input or the output for ReLU and ReLU6 (0 < y
/// exactly where 0 < x, y < 6 where x < 6, NaN where NaN), the input for hard-swish (whose
/// clamp passes the gradient on its closed interval, as Burn's masks do).
#[inline(always)]
pub(super) fn backward_one(act: Activation, x: f32, g: f32) -> f32 {
    match act {
        Activation::Identity => g,
        // Exactly Burn's `relu_backward`; `x` may be the input or the output (both are > 0 or
        // NaN at the same places).
        Activation::Relu => keep_if(x > 0.0 || x.is_nan(), g),
        // From the output y = clamp(x, 0, 6): 0 < y < 6 exactly where 0 < x < 6. Written
        // out (not `contains`) so that NaN passes its gradient, as Burn's masks do.
        Activation::Relu6 => keep_if(!(x <= 0.0 || x >= 6.0), g),
        Activation::HardSwish => {
            let t = ALPHA * x + 0.5;
            let slope = if (0.0..=1.0).contains(&t) {
                x * ALPHA
            } else {
                0.0
            };
            g * (t.clamp(0.0, 1.0) + slope)
        }
    }
}

#[inline(always)]
fn forward_generic(act: Activation, x: &[f32], y: &mut [f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y = forward_one(act, *x);
    }
}

#[inline(always)]
fn backward_generic(act: Activation, x: &[f32], dy: &[f32], dx: &mut [f32]) {
    for ((d, x), g) in dx.iter_mut().zip(x).zip(dy) {
        *d = backward_one(act, *x, *g);
    }
}

#[inline(always)]
fn forward_in_place_generic(act: Activation, x: &mut [f32]) {
    for v in x {
        *v = forward_one(act, *v);
    }
}

#[inline(always)]
fn backward_in_place_generic(act: Activation, x: &[f32], g: &mut [f32]) {
    for (g, x) in g.iter_mut().zip(x) {
        *g = backward_one(act, *x, *g);
    }
}

/// `act(a + b)` into `a`: the sum rounded to `f32`, then the activation, as the two ops
/// compute it.
#[inline(always)]
fn add_in_place_generic(act: Activation, a: &mut [f32], b: &[f32]) {
    for (a, b) in a.iter_mut().zip(b) {
        *a = forward_one(act, *a + *b);
    }
}

/// `act(a + b)` into `y`.
#[inline(always)]
fn add_generic(act: Activation, a: &[f32], b: &[f32], y: &mut [f32]) {
    for ((y, a), b) in y.iter_mut().zip(a).zip(b) {
        *y = forward_one(act, *a + *b);
    }
}

best_isa! {
    fn add_in_place_chunk => add_in_place_generic(act: Activation, a: &mut [f32], b: &[f32])
}

best_isa! {
    fn add_chunk => add_generic(act: Activation, a: &[f32], b: &[f32], y: &mut [f32])
}

best_isa! {
    fn forward_chunk => forward_generic(act: Activation, x: &[f32], y: &mut [f32])
}

best_isa! {
    fn backward_chunk => backward_generic(act: Activation, x: &[f32], dy: &[f32], dx: &mut [f32])
}

best_isa! {
    fn forward_in_place_any => forward_in_place_generic(act: Activation, x: &mut [f32])
}

best_isa! {
    fn backward_in_place_any => backward_in_place_generic(act: Activation, x: &[f32], g: &mut [f32])
}

/// [`forward_in_place_generic`] on the best tier; ReLU by [`avx2_masks`] on AVX2.
fn forward_in_place_chunk(act: Activation, x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if act == Activation::Relu && avx2_masks::applies() {
        // SAFETY: `applies` checked AVX2.
        return unsafe { avx2_masks::relu_in_place(x) };
    }
    forward_in_place_any(act, x)
}

/// [`backward_in_place_generic`] on the best tier; ReLU's and ReLU6's by [`avx2_masks`] on
/// AVX2.
fn backward_in_place_chunk(act: Activation, x: &[f32], g: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if matches!(act, Activation::Relu | Activation::Relu6) && avx2_masks::applies() {
        // SAFETY: `applies` checked AVX2.
        return unsafe { avx2_masks::backward_in_place(act == Activation::Relu6, x, g) };
    }
    backward_in_place_any(act, x, g)
}

/// The in-place passes that zero some elements and keep the others, on AVX2. Written as plain
/// loops, LLVM stores only the zeros, with AVX's masked store (`vmaskmovps`), which AMD's cores
/// run several times slower than a plain store: ReLU6's backward pass took 6% of MobileNetV2's
/// training step on Zen 3, nearly all of it in those stores. Here each vector goes through an
/// empty `asm!` statement before a plain store, so LLVM cannot tell it is the old value or
/// zero. (AVX-512's masked stores are fast; that tier keeps the plain loops.)
#[cfg(target_arch = "x86_64")]
mod avx2_masks {
    use super::{Activation, backward_one, forward_one};
    use std::arch::x86_64::*;

    /// Whether these kernels run: the tier in use is AVX2 (not AVX-512, not scalar).
    pub(super) fn applies() -> bool {
        use crate::kernels::isa::{Isa, uses};
        uses(Isa::Avx2) && !uses(Isa::Avx512)
    }

    /// `v`, opaque to the optimiser.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn opaque(mut v: __m256) -> __m256 {
        // SAFETY: an empty statement; it reads and writes only the register it is given.
        unsafe {
            std::arch::asm!(
                "/* {0} */",
                inout(ymm_reg) v,
                options(pure, nomem, nostack, preserves_flags)
            );
        }
        v
    }

    /// Lanes where `x > 0` or `x` is NaN (ReLU keeps them: Burn's rule).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn relu_keeps(x: __m256) -> __m256 {
        _mm256_cmp_ps::<_CMP_NLE_UQ>(x, _mm256_setzero_ps())
    }

    /// ReLU over `x`, in place (the same bits as `forward_one`).
    ///
    /// # Safety
    /// The CPU supports AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn relu_in_place(x: &mut [f32]) {
        let mut chunks = x.chunks_exact_mut(8);
        for v in &mut chunks {
            // SAFETY: eight floats in `v`.
            unsafe {
                let xv = _mm256_loadu_ps(v.as_ptr());
                let kept = _mm256_and_ps(xv, relu_keeps(xv));
                _mm256_storeu_ps(v.as_mut_ptr(), opaque(kept));
            }
        }
        for v in chunks.into_remainder() {
            *v = forward_one(Activation::Relu, *v);
        }
    }

    /// The ReLU (or, with `relu6`, ReLU6) gradient over `g` in place, from the activation's
    /// output `x` (the same bits as `backward_one`).
    ///
    /// # Safety
    /// The CPU supports AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn backward_in_place(relu6: bool, x: &[f32], g: &mut [f32]) {
        assert_eq!(x.len(), g.len());
        let (mut gs, mut xs) = (g.chunks_exact_mut(8), x.chunks_exact(8));
        let six = _mm256_set1_ps(6.0);
        for (gv, xv) in (&mut gs).zip(&mut xs) {
            // SAFETY: eight floats in `gv` and in `xv`.
            unsafe {
                let x = _mm256_loadu_ps(xv.as_ptr());
                let mut pass = relu_keeps(x);
                if relu6 {
                    // And x < 6 or NaN: ReLU6 passes on 0 < y < 6 (and NaN).
                    pass = _mm256_and_ps(pass, _mm256_cmp_ps::<_CMP_NGE_UQ>(x, six));
                }
                let kept = _mm256_and_ps(_mm256_loadu_ps(gv.as_ptr()), pass);
                _mm256_storeu_ps(gv.as_mut_ptr(), opaque(kept));
            }
        }
        let act = if relu6 {
            Activation::Relu6
        } else {
            Activation::Relu
        };
        for (g, x) in gs.into_remainder().iter_mut().zip(xs.remainder()) {
            *g = backward_one(act, *x, *g);
        }
    }
}

/// The activation of every element of `x`.
pub fn activation_forward(act: Activation, x: &[f32]) -> Vec<f32> {
    let mut y = super::par_zeroed(x.len());
    y.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(y, x)| forward_chunk(act, x, y));
    y
}

/// The gradient of [`activation_forward`] with respect to its input, given the output gradient
/// `dy` and `x`: the activation's output for ReLU and ReLU6, its input for hard-swish.
pub fn activation_backward(act: Activation, x: &[f32], dy: &[f32]) -> Vec<f32> {
    let mut dx = super::par_zeroed(x.len());
    dx.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK).zip(dy.par_chunks(CHUNK)))
        .for_each(|(dx, (x, dy))| backward_chunk(act, x, dy, dx));
    dx
}

/// [`activation_forward`] overwriting its input (a tensor nothing else holds): no new buffer,
/// the same values.
pub fn activation_forward_in_place(act: Activation, x: &mut [f32]) {
    x.par_chunks_mut(CHUNK)
        .for_each(|x| forward_in_place_chunk(act, x));
}

/// [`activation_backward`] overwriting the output gradient `g` with the input gradient.
pub fn activation_backward_in_place(act: Activation, x: &[f32], g: &mut [f32]) {
    assert_eq!(x.len(), g.len(), "activation backward: gradient length");
    g.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(g, x)| backward_in_place_chunk(act, x, g));
}

/// `act(a + b)` elementwise (a residual connection and its activation), overwriting `a` (a
/// tensor nothing else holds): one parallel pass for what was an addition on one thread, then
/// the activation.
pub fn add_activation_in_place(act: Activation, a: &mut [f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "residual addition: operand lengths");
    a.par_chunks_mut(CHUNK)
        .zip(b.par_chunks(CHUNK))
        .for_each(|(a, b)| add_in_place_chunk(act, a, b));
}

/// [`add_activation_in_place`] into a new buffer.
pub fn add_activation(act: Activation, a: &[f32], b: &[f32]) -> Vec<f32> {
    assert_eq!(a.len(), b.len(), "residual addition: operand lengths");
    let mut y = super::par_zeroed(a.len());
    y.par_chunks_mut(CHUNK)
        .zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK)))
        .for_each(|(y, (a, b))| add_chunk(act, a, b, y));
    y
}
