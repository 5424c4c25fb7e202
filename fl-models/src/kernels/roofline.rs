//! What bounds training speed on this CPU (`fl bench --kernels`): the multiply-add peak of the
//! thread pool, measured, and the dense convolutions' throughput against it on the models'
//! shapes. A model's training cost in FLOPs divided by the peak is the fastest any
//! implementation doing the same arithmetic can train it (README "Speed").

use std::time::Instant;

use rayon::prelude::*;

use super::cpu::{self, Conv2dGeometry};

/// Multiply-add peak of the current rayon pool in GFLOP/s (a fused multiply-add counts 2 FLOPs
/// per lane): independent FMA chains, enough to cover the instruction's latency, run for about
/// `seconds` on every thread of the pool at once, the rates summed. AVX-512 where the kernels
/// use it, else AVX2; `None` off x86-64 or without AVX2 and FMA.
pub fn fma_peak_gflops(seconds: f64) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        let wide = super::isa::uses(super::isa::Isa::Avx512);
        let fma = std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma");
        if !(wide || fma) {
            return None;
        }
        let rates = rayon::broadcast(|_| {
            // Calibrate on a short run, then time one of about `seconds`.
            let mut iters = 1 << 16;
            loop {
                let begin = Instant::now();
                let flops = fma::chains(wide, iters);
                let elapsed = begin.elapsed().as_secs_f64();
                if elapsed >= seconds || iters >= 1 << 34 {
                    return flops / elapsed / 1e9;
                }
                iters = (iters as f64 * (seconds / elapsed.max(1e-6)).clamp(2.0, 100.0)) as u64;
            }
        });
        Some(rates.iter().sum())
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = seconds;
        None
    }
}

#[cfg(target_arch = "x86_64")]
mod fma {
    use std::arch::x86_64::*;
    use std::hint::black_box;

    /// Twelve independent chains: with a 4-cycle latency, enough for two FMA pipes.
    const CHAINS: usize = 12;

    /// Runs `iters` rounds of [`CHAINS`] FMAs; returns the FLOPs done.
    pub(super) fn chains(wide: bool, iters: u64) -> f64 {
        // SAFETY: the caller checked AVX-512F (`wide`) or AVX2 and FMA.
        let sink = unsafe { if wide { avx512(iters) } else { avx2(iters) } };
        black_box(sink);
        let lanes = if wide { 16 } else { 8 };
        (iters as usize * CHAINS * lanes * 2) as f64
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn avx512(iters: u64) -> f32 {
        let (a, b) = (
            _mm512_set1_ps(black_box(0.999)),
            _mm512_set1_ps(black_box(1e-3)),
        );
        let mut acc = [_mm512_setzero_ps(); CHAINS];
        for _ in 0..iters {
            for r in acc.iter_mut() {
                *r = _mm512_fmadd_ps(*r, a, b);
            }
        }
        acc.iter().map(|&r| _mm512_reduce_add_ps(r)).sum()
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2(iters: u64) -> f32 {
        let (a, b) = (
            _mm256_set1_ps(black_box(0.999)),
            _mm256_set1_ps(black_box(1e-3)),
        );
        let mut acc = [_mm256_setzero_ps(); CHAINS];
        for _ in 0..iters {
            for r in acc.iter_mut() {
                *r = _mm256_fmadd_ps(*r, a, b);
            }
        }
        let mut out = [0.0f32; 8];
        let sum = acc
            .iter()
            .fold(_mm256_setzero_ps(), |s, &r| _mm256_add_ps(s, r));
        // SAFETY: `out` holds eight floats.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), sum) };
        out.iter().sum()
    }
}

/// A dense convolution for [`conv_rates`]: square input and kernel, zero padding `padding` on
/// every side, the same stride along both axes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvShape {
    /// Input channels.
    pub c_in: usize,
    /// Output channels.
    pub c_out: usize,
    /// Input height and width.
    pub size: usize,
    /// Kernel height and width.
    pub kernel: usize,
    /// Zero padding on each side.
    pub padding: usize,
    /// Stride along both axes.
    pub stride: usize,
}

impl ConvShape {
    fn geometry(&self, batch: usize) -> Conv2dGeometry {
        let out = (self.size + 2 * self.padding - self.kernel) / self.stride + 1;
        Conv2dGeometry {
            batch,
            c_in: self.c_in,
            input: [self.size; 2],
            c_out: self.c_out,
            kernel: [self.kernel; 2],
            stride: [self.stride; 2],
            pad_begin: [self.padding; 2],
            output: [out; 2],
        }
    }

    /// Multiply-adds of one pass over one sample (each of forward, input and weight gradient),
    /// dense: taps that read the zero padding count too, as the rates' usual convention.
    pub fn macs(&self) -> usize {
        self.c_in * self.c_out * self.kernel * self.kernel * self.geometry(1).out_plane()
    }

    /// The share of [`ConvShape::macs`] whose tap reads the input, not the zero padding: the
    /// work a kernel that skips products with padding zeros does (the training table's
    /// "GFLOP/sample" counts these).
    pub fn valid_share(&self) -> f64 {
        let out = self.geometry(1).output[0];
        // (output index, tap) pairs along one axis whose input index lies inside the image.
        let axis = (0..out)
            .flat_map(|o| (0..self.kernel).map(move |k| o * self.stride + k))
            .filter(|&i| (self.padding..self.padding + self.size).contains(&i))
            .count();
        (axis * axis) as f64 / (out * self.kernel).pow(2) as f64
    }
}

/// Throughput of the kernels on one [`ConvShape`], in GFLOP/s of the convolution's dense
/// multiply-adds ([`ConvShape::macs`]; the direct kernels' wasted columns and im2col's copies
/// count as time, not work).
#[derive(Debug, Clone)]
pub struct ConvRate {
    /// The shape measured.
    pub shape: ConvShape,
    /// The kernels that ran the forward pass: `direct`, `im2col + gemm`, `across samples` or
    /// `stride 2 from the planes`; for the kernel across samples, also the path that ran the
    /// batch's last few samples, if another did (`across samples (the last 2: im2col + gemm)`).
    pub path: String,
    /// The kernels that ran the input gradient (the same names).
    pub input_grad_path: String,
    /// The kernels that ran the weight gradient: `direct`, `direct without zero products`,
    /// `small-map` or `im2col + gemm`.
    pub weight_grad_path: String,
    /// Forward pass.
    pub forward: f64,
    /// Input gradient.
    pub input_grad: f64,
    /// Weight and bias gradients.
    pub weight_grad: f64,
}

/// Timing windows per pass of [`conv_rates`].
const WINDOWS: u32 = 5;

/// `n` deterministic values in [−0.5, 0.5) (a different sequence per `salt`): the timed
/// passes' operands.
fn fill(n: usize, salt: usize) -> Vec<f32> {
    (0..n)
        .into_par_iter()
        .map(|i| ((i * 7919 + salt) % 1009) as f32 / 1009.0 - 0.5)
        .collect()
}

/// GFLOP/s of `pass` (doing `flops` each run), the best of [`WINDOWS`] windows of about
/// `seconds` in all: on a shared machine a neighbour's burst slows whole windows, and the best
/// one is the kernel's own speed.
fn best_rate(flops: f64, seconds: f64, pass: &dyn Fn()) -> f64 {
    pass();
    (0..WINDOWS)
        .map(|_| {
            let (mut runs, begin) = (0u32, Instant::now());
            while runs == 0 || begin.elapsed().as_secs_f64() < seconds / WINDOWS as f64 {
                pass();
                runs += 1;
            }
            flops * runs as f64 / begin.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

/// Times the forward pass and both gradients of `shape` on a batch of `batch` samples, each
/// repeated for about `seconds` (the best of five windows), on the current rayon pool (the
/// same entry points the models call, so buffer copies and zeroing count).
pub fn conv_rates(shape: ConvShape, batch: usize, seconds: f64) -> ConvRate {
    let g = shape.geometry(batch);
    let x = fill(g.input_len() * batch, 1);
    let w = fill(g.weight_len(), 2);
    let dy = fill(g.output_len() * batch, 3);
    let flops = 2.0 * (shape.macs() * batch) as f64;
    let rate = |pass: &dyn Fn()| best_rate(flops, seconds, pass);
    let [path, input_grad_path, weight_grad_path] = cpu::kernel_paths(&g);
    ConvRate {
        shape,
        path,
        input_grad_path,
        weight_grad_path,
        forward: rate(&|| drop(std::hint::black_box(cpu::conv2d_forward(&g, &x, &w, None)))),
        input_grad: rate(&|| drop(std::hint::black_box(cpu::conv2d_input_grad(&g, &w, &dy)))),
        weight_grad: rate(&|| drop(std::hint::black_box(cpu::conv2d_weight_grad(&g, &x, &dy)))),
    }
}

/// A depthwise convolution for [`depthwise_rates`]: `channels` square maps, a square kernel
/// with "same" padding (`kernel / 2`), stride `stride` (the MobileNets' spatial layers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DepthwiseShape {
    /// Channels (one filter each).
    pub channels: usize,
    /// Input height and width.
    pub size: usize,
    /// Kernel height and width.
    pub kernel: usize,
    /// Stride along both axes.
    pub stride: usize,
}

impl DepthwiseShape {
    fn geometry(&self, batch: usize) -> Conv2dGeometry {
        let pad = self.kernel / 2;
        let out = (self.size + 2 * pad - self.kernel) / self.stride + 1;
        Conv2dGeometry {
            batch,
            c_in: self.channels,
            input: [self.size; 2],
            c_out: self.channels,
            kernel: [self.kernel; 2],
            stride: [self.stride; 2],
            pad_begin: [pad; 2],
            output: [out; 2],
        }
    }

    /// Multiply-adds of one pass over one sample (taps that read the padding count too).
    pub fn macs(&self) -> usize {
        self.channels * self.kernel * self.kernel * self.geometry(1).out_plane()
    }
}

/// Throughput of a depthwise convolution's three passes (GFLOP/s of [`DepthwiseShape::macs`]):
/// on the path the models take, and on the per-plane path, the one for large maps.
#[derive(Debug, Clone, Copy)]
pub struct DepthwiseRate {
    /// The path the models take: `planes` or `channels in lanes`.
    pub path: &'static str,
    /// Forward pass, input gradient and weight gradient on `path`.
    pub chosen: [f64; 3],
    /// The same on the per-plane path.
    pub planes: [f64; 3],
}

/// Times a depthwise convolution's forward pass and gradients on a batch of `batch` samples,
/// on its path and on the per-plane one, each repeated for about `seconds` (the best of five
/// windows), on the current rayon pool.
pub fn depthwise_rates(shape: DepthwiseShape, batch: usize, seconds: f64) -> DepthwiseRate {
    let g = shape.geometry(batch);
    let x = fill(g.input_len() * batch, 1);
    let w = fill(shape.channels * shape.kernel * shape.kernel, 2);
    let dy = fill(g.output_len() * batch, 3);
    let flops = 2.0 * (shape.macs() * batch) as f64;
    let rates = |path: cpu::DepthwisePath| {
        let rate = |pass: &dyn Fn()| best_rate(flops, seconds, pass);
        [
            rate(&|| drop(std::hint::black_box(cpu::forward_by(path, &g, &x, &w)))),
            rate(&|| drop(std::hint::black_box(cpu::input_grad_by(path, &g, &w, &dy)))),
            rate(&|| drop(std::hint::black_box(cpu::weight_grad_by(path, &g, &x, &dy)))),
        ]
    };
    let path = cpu::DepthwisePath::of(&g);
    let chosen = rates(path);
    DepthwiseRate {
        path: path.name(),
        chosen,
        // Timed once where the layer takes the per-plane path anyway.
        planes: match path {
            cpu::DepthwisePath::Planes => chosen,
            cpu::DepthwisePath::Channels | cpu::DepthwisePath::Direct => {
                rates(cpu::DepthwisePath::Planes)
            }
        },
    }
}

/// Throughput of a fully connected layer's three products (GFLOP/s of `batch · d_in · d_out`
/// multiply-adds each), through the same entry points as training: the forward pass
/// `x · W + b`, the input gradient `dy · Wᵀ` and the weight gradient `xᵀ · dy`.
#[derive(Debug, Clone, Copy)]
pub struct LinearRate {
    /// Forward pass.
    pub forward: f64,
    /// Input gradient.
    pub input_grad: f64,
    /// Weight gradient.
    pub weight_grad: f64,
}

/// Times a `d_in → d_out` fully connected layer on a batch of `batch` samples, each product
/// repeated for about `seconds` (the best of five windows), on the current rayon pool.
pub fn linear_rates(d_in: usize, d_out: usize, batch: usize, seconds: f64) -> LinearRate {
    use super::flex_linear::LinearKernelOps;
    use burn::backend::{Backend, Flex};
    use burn::tensor::TensorData;
    use burn_flex::FlexTensor;
    let tensor = |shape: [usize; 2], salt: usize| {
        FlexTensor::from_data(TensorData::new(fill(shape[0] * shape[1], salt), shape))
    };
    let (x, w, dy) = (
        tensor([batch, d_in], 1),
        tensor([d_in, d_out], 2),
        tensor([batch, d_out], 3),
    );
    let b = FlexTensor::from_data(TensorData::new(vec![0.0f32; d_out], [d_out]));
    // The view Burn's backward pass hands the product (no copy).
    fn transpose<B: Backend>(
        t: burn::backend::tensor::FloatTensor<B>,
    ) -> burn::backend::tensor::FloatTensor<B> {
        B::float_swap_dims(t, 0, 1)
    }
    let flops = 2.0 * (batch * d_in * d_out) as f64;
    let rate = |pass: &dyn Fn()| best_rate(flops, seconds, pass);
    LinearRate {
        forward: rate(&|| {
            drop(std::hint::black_box(Flex::fl_linear(
                x.clone(),
                w.clone(),
                b.clone(),
            )))
        }),
        input_grad: rate(&|| {
            let wt = transpose::<Flex>(w.clone());
            drop(std::hint::black_box(Flex::fl_matmul(dy.clone(), wt)))
        }),
        weight_grad: rate(&|| {
            let xt = transpose::<Flex>(x.clone());
            drop(std::hint::black_box(Flex::fl_matmul(xt, dy.clone())))
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_count_their_work() {
        let s = ConvShape {
            c_in: 16,
            c_out: 32,
            size: 8,
            kernel: 3,
            padding: 1,
            stride: 1,
        };
        assert_eq!(s.macs(), 16 * 32 * 9 * 64);
        assert_eq!(s.geometry(2).output, [8, 8]);
        // Per axis 22 of the 24 (pixel, tap) pairs read the image (the border pixels lose one).
        assert_eq!(s.valid_share(), (22.0 * 22.0) / (24.0 * 24.0));
        // VGG-16's 1×1 maps under 3×3 kernels: only the centre tap; unpadded: every tap.
        let centre = ConvShape { size: 1, ..s };
        assert_eq!(centre.valid_share(), 1.0 / 9.0);
        assert_eq!(ConvShape { padding: 0, ..s }.valid_share(), 1.0);
        // Stride 2 on 8×8: 4×4 outputs; per axis the first output's first tap reads the padding.
        let strided = ConvShape { stride: 2, ..s };
        assert_eq!(strided.geometry(1).output, [4, 4]);
        assert_eq!(strided.valid_share(), (11.0 * 11.0) / (12.0 * 12.0));
        let rate = conv_rates(s, 2, 0.0);
        assert!(rate.forward > 0.0 && rate.input_grad > 0.0 && rate.weight_grad > 0.0);
        let fc = linear_rates(300, 40, 3, 0.0);
        assert!(fc.forward > 0.0 && fc.input_grad > 0.0 && fc.weight_grad > 0.0);
        if let Some(peak) = fma_peak_gflops(0.001) {
            assert!(peak > 0.0);
        }
    }
}
