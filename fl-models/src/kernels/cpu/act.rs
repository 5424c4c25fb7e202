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

#[inline(always)]
fn forward_one(act: Activation, x: f32) -> f32 {
    match act {
        Activation::Identity => x,
        // Exactly Burn's flex ReLU (NaN kept, −0 → 0).
        Activation::Relu => {
            if x > 0.0 || x.is_nan() {
                x
            } else {
                0.0
            }
        }
        Activation::Relu6 => x.clamp(0.0, 6.0),
        Activation::HardSwish => x * (ALPHA * x + 0.5).clamp(0.0, 1.0),
    }
}

/// d activation / dx times `g`, given `x`: the output for ReLU and ReLU6, the input for
/// hard-swish (whose clamp passes the gradient on its closed interval, as Burn's masks do).
#[inline(always)]
fn backward_one(act: Activation, x: f32, g: f32) -> f32 {
    match act {
        Activation::Identity => g,
        // Exactly Burn's `relu_backward`; `x` may be the input or the output (both are > 0 or
        // NaN at the same places).
        Activation::Relu => {
            if x > 0.0 || x.is_nan() {
                g
            } else {
                0.0
            }
        }
        // From the output y = clamp(x, 0, 6): 0 < y < 6 exactly where 0 < x < 6. Written
        // out (not `contains`) so that NaN passes its gradient, as Burn's masks do.
        #[allow(clippy::manual_range_contains)]
        Activation::Relu6 => {
            if x <= 0.0 || x >= 6.0 {
                0.0
            } else {
                g
            }
        }
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
    fn forward_in_place_chunk => forward_in_place_generic(act: Activation, x: &mut [f32])
}

best_isa! {
    fn backward_in_place_chunk => backward_in_place_generic(act: Activation, x: &[f32], g: &mut [f32])
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
