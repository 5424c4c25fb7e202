//! Global average pooling (adaptive average pooling to 1 × 1: the MobileNets' squeeze-and-
//! excitation and the models' heads), bit for bit burn-flex's adaptive average pooling, which
//! runs every plane as its own task on the thread pool: on MobileNetV3's squeeze-and-excitation
//! blocks (up to 576 planes of 1–16 pixels per sample) that scheduling was a tenth of its
//! evaluation time.

use std::mem::MaybeUninit;

use rayon::prelude::*;

/// Planes per task: enough pixels per task that scheduling costs little next to them.
const PLANES_PER_TASK: usize = 512;

/// The mean of each plane of `plane` floats in `x`, as burn-flex computes it: the values added
/// in order onto +0, the sum divided by their count.
pub fn global_avg_pool_forward(plane: usize, x: &[f32]) -> Vec<f32> {
    assert!(
        plane > 0 && x.len().is_multiple_of(plane),
        "global average pooling: whole planes"
    );
    let count = plane as f32;
    // SAFETY: the chunks cover the output, and every element is written.
    unsafe {
        super::written_whole(x.len() / plane, |y| {
            y.par_chunks_mut(PLANES_PER_TASK)
                .zip(x.par_chunks(PLANES_PER_TASK * plane))
                .for_each(|(y, x)| {
                    for (y, p) in y.iter_mut().zip(x.chunks_exact(plane)) {
                        y.write(p.iter().fold(0.0f32, |sum, &v| sum + v) / count);
                    }
                })
        })
    }
}

/// The input gradient of [`global_avg_pool_forward`] from the output gradient `grad` (one
/// value per plane): each pixel receives `+0 + grad / count`, as burn-flex adds the share onto
/// a zeroed gradient (which turns a −0 share into +0).
pub fn global_avg_pool_backward(plane: usize, grad: &[f32]) -> Vec<f32> {
    let count = plane as f32;
    // SAFETY: the chunks cover the input gradient, and every element is written.
    unsafe {
        super::written_whole(grad.len() * plane, |dx| {
            dx.par_chunks_mut(PLANES_PER_TASK * plane)
                .zip(grad.par_chunks(PLANES_PER_TASK))
                .for_each(|(dx, grad)| {
                    for (dx, &g) in dx.chunks_exact_mut(plane).zip(grad) {
                        dx.fill(MaybeUninit::new(0.0 + g / count));
                    }
                })
        })
    }
}
