//! The kernels against their definitions, on every instruction tier this CPU has.

use super::*;
use crate::kernels::Activation;
use crate::kernels::isa::Isa;

mod grouping;
mod paths;

/// Runs `check` once per instruction tier the CPU supports (lowest first), with the kernels
/// capped at that tier on a thread pool of its own (`isa::capped`: other tests keep theirs),
/// so the paths this CPU would not pick by itself are tested too. Holds the lock of the tests
/// that flip process-wide switches, since its checks compare the bits of two paths.
pub(crate) fn at_every_isa(check: impl Fn(Isa) + Sync) {
    let _guard = crate::kernels::isa::test_lock();
    let tiers = [Isa::Baseline, Isa::Avx2, Isa::Avx512];
    for isa in tiers.into_iter().filter(|&t| t <= Isa::detected()) {
        let run = || crate::kernels::isa::capped(isa, || check(isa));
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run));
        if let Err(panic) = outcome {
            eprintln!("failed with the kernels capped at {isa:?}");
            std::panic::resume_unwind(panic);
        }
    }
    if Isa::detected() < Isa::Avx512 {
        eprintln!(
            "note: this CPU has no AVX-512F; the tiers above {:?} are untested here",
            Isa::detected()
        );
    }
}

/// The convolution by its definition, in f64.
fn naive_conv(g: &Conv2dGeometry, x: &[f32], w: &[f32], b: &[f32]) -> Vec<f32> {
    let [h, wd] = g.input;
    let [kh, kw] = g.kernel;
    let [oh, ow] = g.output;
    let mut y = vec![0.0f32; g.batch * g.output_len()];
    for n in 0..g.batch {
        for o in 0..g.c_out {
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut acc = b[o] as f64;
                    for c in 0..g.c_in {
                        for ky in 0..kh {
                            for kx in 0..kw {
                                let iy = (oy * g.stride[0] + ky) as isize - g.pad_begin[0] as isize;
                                let ix = (ox * g.stride[1] + kx) as isize - g.pad_begin[1] as isize;
                                if iy < 0 || ix < 0 || iy >= h as isize || ix >= wd as isize {
                                    continue;
                                }
                                let xv = x[((n * g.c_in + c) * h + iy as usize) * wd + ix as usize];
                                let wv = w[((o * g.c_in + c) * kh + ky) * kw + kx];
                                acc += xv as f64 * wv as f64;
                            }
                        }
                    }
                    y[((n * g.c_out + o) * oh + oy) * ow + ox] = acc as f32;
                }
            }
        }
    }
    y
}

/// Deterministic pseudo-random values in [−1, 1].
pub(crate) fn values(len: usize, seed: u32) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let v = (i as u32)
                .wrapping_mul(2654435761)
                .wrapping_add(seed.wrapping_mul(97));
            ((v >> 8) % 2001) as f32 / 1000.0 - 1.0
        })
        .collect()
}

fn geometry(
    [batch, c_in, h, w]: [usize; 4],
    [c_out, kh, kw]: [usize; 3],
    stride: [usize; 2],
    pad: [(usize, usize); 2],
) -> Conv2dGeometry {
    let out = |i: usize, k: usize, s: usize, (a, b): (usize, usize)| (i + a + b - k) / s + 1;
    Conv2dGeometry {
        batch,
        c_in,
        input: [h, w],
        c_out,
        kernel: [kh, kw],
        stride,
        pad_begin: [pad[0].0, pad[1].0],
        output: [out(h, kh, stride[0], pad[0]), out(w, kw, stride[1], pad[1])],
    }
}

fn cases() -> Vec<Conv2dGeometry> {
    vec![
        geometry([3, 3, 9, 8], [4, 5, 5], [1, 1], [(0, 0), (0, 0)]),
        geometry([2, 4, 7, 7], [5, 3, 3], [1, 1], [(1, 1), (1, 1)]),
        geometry([2, 3, 8, 9], [2, 3, 3], [2, 2], [(1, 1), (1, 1)]),
        geometry([2, 2, 6, 5], [3, 1, 1], [1, 1], [(0, 0), (0, 0)]),
        geometry([1, 2, 7, 6], [3, 1, 1], [2, 2], [(0, 0), (0, 0)]),
        geometry([2, 2, 5, 6], [2, 3, 2], [1, 2], [(2, 0), (0, 1)]),
        geometry([17, 2, 5, 5], [3, 3, 3], [1, 1], [(1, 1), (1, 1)]),
        // The CIFAR CNN's second convolution, with a batch over two weight-gradient chunks.
        geometry([10, 6, 14, 14], [16, 5, 5], [1, 1], [(0, 0), (0, 0)]),
        geometry([3, 9, 6, 7], [7, 3, 3], [1, 1], [(1, 1), (1, 1)]),
        // Wide lengths of five, three and seven vectors (ResNet-20's 8×8 maps: five), with
        // channel tiles of eight, six and four.
        geometry([2, 5, 8, 8], [16, 3, 3], [1, 1], [(1, 1), (1, 1)]),
        geometry([2, 5, 8, 8], [6, 3, 3], [1, 1], [(1, 1), (1, 1)]),
        geometry([2, 3, 9, 8], [6, 5, 5], [1, 1], [(0, 0), (0, 0)]),
        geometry([2, 3, 8, 8], [4, 3, 3], [1, 1], [(1, 1), (1, 1)]),
        geometry([2, 3, 9, 9], [8, 3, 3], [1, 1], [(1, 1), (1, 1)]),
    ]
}

#[test]
fn direct_and_im2col_convolutions_agree() {
    for g in cases() {
        if !super::super::direct::applies(&g) {
            continue;
        }
        let x = values(g.batch * g.input_len(), 1);
        let w = values(g.weight_len(), 2);
        let b = values(g.c_out, 3);
        let dy = values(g.batch * g.output_len(), 4);
        close(
            &conv2d_forward(&g, &x, &w, Some(&b)),
            &im2col_conv2d_forward(&g, &x, &w, Some(&b)),
        );
        close(
            &conv2d_input_grad(&g, &w, &dy),
            &im2col_conv2d_input_grad(&g, &w, &dy),
        );
        let (dw, db) = conv2d_weight_grad(&g, &x, &dy);
        let (dw_ref, db_ref) = im2col_conv2d_weight_grad((&g, &x, &dy, true));
        close(&dw, &dw_ref);
        close(&db, &db_ref);
    }
}

/// The first index where `a` and `b` differ in any bit (`None`: bitwise equal where both have
/// elements; callers compare the lengths too).
fn first_difference(a: &[f32], b: &[f32]) -> Option<usize> {
    a.iter()
        .zip(b)
        .position(|(x, y)| x.to_bits() != y.to_bits())
}

/// Asserts that `got` and `want` have the same length and the same bits, naming `what`.
fn assert_same_bits(got: &[f32], want: &[f32], what: impl std::fmt::Display) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    assert_eq!(first_difference(got, want), None, "{what}");
}

fn close(a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
            "at {i}: {x} vs {y}"
        );
    }
}

#[test]
fn forward_matches_the_definition() {
    at_every_isa(|_| {
        for g in cases() {
            let x = values(g.batch * g.input_len(), 1);
            let w = values(g.weight_len(), 2);
            let b = values(g.c_out, 3);
            let expected = naive_conv(&g, &x, &w, &b);
            close(&conv2d_forward(&g, &x, &w, Some(&b)), &expected);
            let zeros = vec![0.0; g.c_out];
            let expected = naive_conv(&g, &x, &w, &zeros);
            close(&conv2d_forward(&g, &x, &w, None), &expected);
        }
    });
}

/// The gradients are the adjoints of the forward map: ⟨dy, conv(x)⟩ is linear in x and in w,
/// so ⟨dx, x'⟩ = ⟨dy, conv_w(x')⟩ and ⟨dW, w'⟩ = ⟨dy, conv_{w'}(x)⟩ for any x', w'.
#[test]
fn gradients_are_the_adjoints_of_the_forward_map() {
    at_every_isa(|_| {
        let dot = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .map(|(x, y)| *x as f64 * *y as f64)
                .sum::<f64>()
        };
        for g in cases() {
            let x = values(g.batch * g.input_len(), 4);
            let w = values(g.weight_len(), 5);
            let dy = values(g.batch * g.output_len(), 6);
            let probe_x = values(x.len(), 7);
            let probe_w = values(w.len(), 8);
            let dx = conv2d_input_grad(&g, &w, &dy);
            let lhs = dot(&dx, &probe_x);
            let rhs = dot(&dy, &conv2d_forward(&g, &probe_x, &w, None));
            assert!(
                (lhs - rhs).abs() < 1e-3 * (1.0 + rhs.abs()),
                "{g:?}: dx {lhs} vs {rhs}"
            );
            let (dw, db) = conv2d_weight_grad(&g, &x, &dy);
            let lhs = dot(&dw, &probe_w);
            let rhs = dot(&dy, &conv2d_forward(&g, &x, &probe_w, None));
            assert!(
                (lhs - rhs).abs() < 1e-3 * (1.0 + rhs.abs()),
                "{g:?}: dW {lhs} vs {rhs}"
            );
            let out_plane = g.output[0] * g.output[1];
            for (o, b) in db.iter().enumerate() {
                let sum: f64 = (0..g.batch)
                    .flat_map(|n| dy[(n * g.c_out + o) * out_plane..][..out_plane].iter())
                    .map(|v| *v as f64)
                    .sum();
                assert!((*b as f64 - sum).abs() < 1e-3, "{g:?}: db");
            }
        }
    });
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    // Both runs on the same instruction tier: other tests cap it while they hold this lock.
    let _guard = crate::kernels::isa::test_lock();
    let g = geometry([37, 3, 12, 12], [6, 5, 5], [1, 1], [(0, 0), (0, 0)]);
    let x = values(g.batch * g.input_len(), 9);
    let dy = values(g.batch * g.output_len(), 10);
    let run = |threads| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| conv2d_weight_grad(&g, &x, &dy))
    };
    assert_eq!(run(1), run(3));
}

#[test]
fn max_pool_fast_paths_follow_the_first_maximum_rule() {
    at_every_isa(|_| {
        // Rows of 39 (19 windows: a full 16-window step and a masked one), values on a coarse
        // grid so that ties are frequent, zeros of both signs among them (compared by bits).
        let g = PoolGeometry {
            planes: 3,
            input: [7, 39],
            kernel: [2, 2],
            stride: [2, 2],
            output: [3, 19],
        };
        let coarse: Vec<f32> = values(3 * 7 * 39, 5)
            .iter()
            .map(|v| (v * 3.0).round())
            .collect();
        // Mostly zeros of both signs: windows whose maximum is a tie between +0 and −0.
        let zeros: Vec<f32> = values(3 * 7 * 39, 7)
            .iter()
            .map(|v| [-0.0, 0.0, -0.0, 0.0, -1.0][((v + 1.0) * 1000.0) as usize % 5])
            .collect();
        let dy = values(3 * 3 * 19, 6);
        for x in [coarse, zeros] {
            let (y, dx) = (max_pool2d_forward(&g, &x), max_pool2d_backward(&g, &x, &dy));
            let mut expected = vec![0.0f32; x.len()];
            for p in 0..3 {
                let plane = &x[p * 273..(p + 1) * 273];
                for oy in 0..3 {
                    for ox in 0..19 {
                        let at = g.argmax(plane, oy, ox);
                        assert_eq!(y[p * 57 + oy * 19 + ox].to_bits(), plane[at].to_bits());
                        expected[p * 273 + at] += dy[p * 57 + oy * 19 + ox];
                    }
                }
            }
            assert_eq!(dx, expected);
        }
    });
}

#[test]
fn max_pool_of_one_pixel_windows_matches_the_general_rule() {
    // ResNet's option-A shortcut: 1×1 windows, strides that skip rows and columns.
    for stride in [[2, 2], [3, 2], [1, 1]] {
        let input = [7, 9];
        let output = [(7 - 1) / stride[0] + 1, (9 - 1) / stride[1] + 1];
        let g = PoolGeometry {
            planes: 3,
            input,
            kernel: [1, 1],
            stride,
            output,
        };
        let mut x = values(3 * 63, 21);
        x[0] = f32::NAN;
        let mut dy = values(3 * output[0] * output[1], 22);
        dy[1] = -0.0;
        let (y, dx) = (max_pool2d_forward(&g, &x), max_pool2d_backward(&g, &x, &dy));
        let mut expected = vec![0.0f32; x.len()];
        let out_plane = output[0] * output[1];
        for p in 0..3 {
            let plane = &x[p * 63..(p + 1) * 63];
            for oy in 0..output[0] {
                for ox in 0..output[1] {
                    let (o, at) = (p * out_plane + oy * output[1] + ox, g.argmax(plane, oy, ox));
                    assert_eq!(y[o].to_bits(), plane[at].to_bits(), "{stride:?}");
                    expected[p * 63 + at] += dy[o];
                }
            }
        }
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&dx), bits(&expected), "{stride:?}");
    }
}

#[test]
fn max_pool_picks_the_first_maximum_and_routes_its_gradient() {
    at_every_isa(|_| {
        let g = PoolGeometry {
            planes: 2,
            input: [4, 5],
            kernel: [2, 2],
            stride: [2, 2],
            output: [2, 2],
        };
        let mut x = values(40, 11);
        x[0] = 5.0;
        x[1] = 5.0; // a tie: the first one wins
        x[27] = f32::NAN;
        let y = max_pool2d_forward(&g, &x);
        assert_eq!(y[0], 5.0);
        assert!(y[4 + 1].is_nan(), "NaN propagates: {y:?}");
        let general = PoolGeometry {
            kernel: [2, 2],
            ..g
        };
        for p in 0..2 {
            for oy in 0..2 {
                for ox in 0..2 {
                    let plane = &x[p * 20..(p + 1) * 20];
                    let m = plane[general.argmax(plane, oy, ox)];
                    let got = y[p * 4 + oy * 2 + ox];
                    assert!(m == got || (m.is_nan() && got.is_nan()));
                }
            }
        }
        let dy: Vec<f32> = (1..=8).map(|v| v as f32).collect();
        let dx = max_pool2d_backward(&g, &x, &dy);
        assert_eq!(dx[0], 1.0);
        assert_eq!(dx[1], 0.0);
        assert_eq!(dx.iter().sum::<f32>(), dy.iter().sum::<f32>());
        assert_eq!(dx[27], 6.0, "the NaN takes its window's gradient");
        // Column 4 is never in a window (floor mode).
        assert!((0..4).all(|r| dx[r * 5 + 4] == 0.0));
        // A NaN there still sends its plane down the general path, as a NaN anywhere does,
        // where a −0 gradient lands as 0 + (−0) = +0.
        let mut x = values(40, 12);
        (x[4], x[0]) = (f32::NAN, 9.0);
        let mut dy = vec![1.0f32; 8];
        dy[0] = -0.0;
        let dx = max_pool2d_backward(&g, &x, &dy);
        assert_eq!(dx[0].to_bits(), 0.0f32.to_bits());
    });
}

/// On the im2col path the tiers below AVX-512 differ only in how the copy loops move data, so
/// their results are bit-identical (a run on an AVX2 machine and a capped run elsewhere agree
/// exactly). (Stride-1 layers run the direct kernels from AVX2 up: their own test pins them.)
#[test]
fn baseline_and_avx2_paths_give_identical_bits() {
    let g = geometry([5, 3, 11, 10], [4, 3, 3], [2, 2], [(1, 1), (1, 1)]);
    let x = values(g.batch * g.input_len(), 12);
    let w = values(g.weight_len(), 13);
    let dy = values(g.batch * g.output_len(), 14);
    let results = std::sync::Mutex::new(Vec::new());
    at_every_isa(|isa| {
        if isa <= Isa::Avx2 {
            results.lock().unwrap().push((
                conv2d_forward(&g, &x, &w, None),
                conv2d_input_grad(&g, &w, &dy),
                conv2d_weight_grad(&g, &x, &dy),
            ));
        }
    });
    let results = results.into_inner().unwrap();
    assert!(results.windows(2).all(|p| p[0] == p[1]));
}

/// Depthwise convolutions: (batch, channels, h, w), (kh, kw), stride, padding.
fn depthwise_cases() -> Vec<Conv2dGeometry> {
    let dw = |[n, c, h, w]: [usize; 4], [kh, kw]: [usize; 2], s: [usize; 2], p| {
        geometry([n, c, h, w], [c, kh, kw], s, p)
    };
    vec![
        dw([2, 3, 8, 8], [3, 3], [1, 1], [(1, 1), (1, 1)]),
        dw([2, 4, 9, 8], [3, 3], [2, 2], [(1, 1), (1, 1)]),
        // MobileNetV3's 5×5 stride-2 units; an odd map whose last row and column no output reads.
        dw([3, 2, 11, 11], [5, 5], [2, 2], [(2, 2), (2, 2)]),
        dw([2, 3, 8, 8], [3, 3], [2, 2], [(0, 0), (0, 0)]),
        // Asymmetric padding, unequal strides, a kernel wider than the stride's phases.
        dw([2, 2, 7, 10], [2, 4], [1, 3], [(1, 0), (0, 2)]),
        dw([1, 5, 2, 2], [3, 3], [1, 1], [(1, 1), (1, 1)]),
        // Channels over two weight-gradient groups and part of a third.
        dw([3, 19, 6, 6], [3, 3], [1, 1], [(1, 1), (1, 1)]),
        // The MobileNets' small maps (`depthwise_channels.rs`): 4×4 and 2×2, 7 → 4 at stride 2,
        // channels over a block and part of another, an 8×8 map whose wide plane wraps the 32
        // partial sums twice, 5×5 at stride 2, and the asymmetric case.
        dw([3, 20, 4, 4], [3, 3], [1, 1], [(1, 1), (1, 1)]),
        dw([2, 32, 2, 2], [3, 3], [1, 1], [(1, 1), (1, 1)]),
        dw([2, 16, 7, 7], [3, 3], [2, 2], [(1, 1), (1, 1)]),
        dw([2, 16, 8, 8], [3, 3], [1, 1], [(1, 1), (1, 1)]),
        dw([2, 24, 11, 11], [5, 5], [2, 2], [(2, 2), (2, 2)]),
        dw([2, 17, 7, 10], [2, 4], [1, 3], [(1, 0), (0, 2)]),
        // `depthwise_direct.rs`'s maps: stride 1, rows as wide as the input's (16×16, 14×14
        // and 7×7: planes over a block of vectors, and partial vectors; 5×5 kernels; a map
        // narrower than a vector; asymmetric padding; fewer output rows than input rows).
        dw([2, 3, 16, 16], [3, 3], [1, 1], [(1, 1), (1, 1)]),
        dw([2, 3, 14, 14], [3, 3], [1, 1], [(1, 1), (1, 1)]),
        dw([3, 5, 7, 7], [3, 3], [1, 1], [(1, 1), (1, 1)]),
        dw([2, 3, 9, 9], [5, 5], [1, 1], [(2, 2), (2, 2)]),
        dw([2, 3, 3, 5], [3, 3], [1, 1], [(1, 1), (1, 1)]),
        dw([2, 3, 6, 11], [2, 4], [1, 1], [(1, 0), (2, 1)]),
        dw([2, 3, 9, 12], [3, 3], [1, 1], [(0, 0), (1, 1)]),
        // Its stride-2 maps under 3×3 kernels: 32×32 → 16×16 (MobileNetV1's and V2's), odd
        // sizes whose last output row or column reads the padding, a row of 31 inputs.
        dw([2, 3, 32, 32], [3, 3], [2, 2], [(1, 1), (1, 1)]),
        dw([2, 3, 15, 13], [3, 3], [2, 2], [(1, 1), (1, 1)]),
        dw([2, 2, 12, 31], [3, 3], [2, 2], [(1, 1), (1, 1)]),
        // Its single-vector planes: MobileNetV3's 5×5 kernels on 4×4 maps, and an asymmetric
        // kernel and padding on a 3×4 map (the 4×4 and 3×5 cases above are others).
        dw([2, 17, 4, 4], [5, 5], [1, 1], [(2, 2), (2, 2)]),
        dw([2, 4, 3, 4], [2, 4], [1, 1], [(1, 0), (2, 1)]),
        // Four samples' 2×2 planes per vector: five samples (a partial vector) and six
        // channels (a partial pass of four), into 1×1 maps at stride 2.
        dw([5, 6, 2, 2], [3, 3], [2, 2], [(1, 1), (1, 1)]),
        dw([5, 6, 2, 2], [3, 3], [1, 1], [(1, 1), (1, 1)]),
    ]
}

fn naive_depthwise(g: &Conv2dGeometry, x: &[f32], w: &[f32]) -> Vec<f32> {
    let mut full = vec![0.0f32; g.c_in * g.c_in * g.kernel[0] * g.kernel[1]];
    let taps = g.kernel[0] * g.kernel[1];
    for c in 0..g.c_in {
        // The depthwise filter as a dense one that reads only its own channel.
        full[(c * g.c_in + c) * taps..][..taps].copy_from_slice(&w[c * taps..][..taps]);
    }
    naive_conv(g, x, &full, &vec![0.0; g.c_out])
}

/// Depthwise forward and input gradient as sums over the taps in ascending `(ky, kx)` order,
/// each starting from zero: the order of the kernels' additions, so they must match bit for bit.
fn tap_ordered_depthwise(g: &Conv2dGeometry, x: &[f32], w: &[f32], dy: &[f32]) -> [Vec<f32>; 2] {
    let ([h, wd], [oh, ow], [kh, kw]) = (g.input, g.output, g.kernel);
    let ([sh, sw], [pt, pl]) = (g.stride, g.pad_begin);
    let mut y = vec![0.0f32; g.batch * g.output_len()];
    let mut dx = vec![0.0f32; g.batch * g.input_len()];
    for plane in 0..g.batch * g.c_in {
        let c = plane % g.c_in;
        let w = &w[c * kh * kw..][..kh * kw];
        for oy in 0..oh {
            for ox in 0..ow {
                let mut acc = 0.0f32;
                for (k, wk) in w.iter().enumerate() {
                    let (iy, ix) = (oy * sh + k / kw, ox * sw + k % kw);
                    if (pt..pt + h).contains(&iy) && (pl..pl + wd).contains(&ix) {
                        acc += wk * x[(plane * h + iy - pt) * wd + ix - pl];
                    }
                }
                y[(plane * oh + oy) * ow + ox] = acc;
            }
        }
        for iy in 0..h {
            for ix in 0..wd {
                let mut acc = 0.0f32;
                for (k, wk) in w.iter().enumerate() {
                    // The output (py / sh, px / sw) whose tap k reads this input, if any.
                    let py = (iy + pt).wrapping_sub(k / kw);
                    let px = (ix + pl).wrapping_sub(k % kw);
                    if py % sh == 0 && px % sw == 0 && py / sh < oh && px / sw < ow {
                        acc += wk * dy[(plane * oh + py / sh) * ow + px / sw];
                    }
                }
                dx[(plane * h + iy) * wd + ix] = acc;
            }
        }
    }
    [y, dx]
}

/// The depthwise weight gradient in the kernel's order: 32 partial sums per tap (lane = the
/// output's position in the wide plane, `oy · width + ox`, mod 32), each over the samples in
/// order and the positions in order, then added up with `sum`.
fn tap_ordered_depthwise_weight_grad(g: &Conv2dGeometry, x: &[f32], dy: &[f32]) -> Vec<f32> {
    let ([h, wd], [oh, ow], [kh, kw]) = (g.input, g.output, g.kernel);
    let ([sh, sw], [pt, pl]) = (g.stride, g.pad_begin);
    let width = ((ow - 1) * sw + kw).div_ceil(sw);
    let mut dw = Vec::new();
    for c in 0..g.c_in {
        let mut lanes = vec![[0.0f32; 32]; kh * kw];
        for n in 0..g.batch {
            let plane = n * g.c_in + c;
            for (k, lanes) in lanes.iter_mut().enumerate() {
                for oy in 0..oh {
                    for ox in 0..ow {
                        let (iy, ix) = (oy * sh + k / kw, ox * sw + k % kw);
                        if (pt..pt + h).contains(&iy) && (pl..pl + wd).contains(&ix) {
                            let d = dy[(plane * oh + oy) * ow + ox];
                            let v = x[(plane * h + iy - pt) * wd + ix - pl];
                            lanes[(oy * width + ox) % 32] += d * v;
                        }
                    }
                }
            }
        }
        dw.extend(lanes.iter().map(|l| sum(l)));
    }
    dw
}

#[test]
fn depthwise_sums_run_in_tap_order() {
    use depthwise::{DepthwisePath, forward_by, input_grad_by, weight_grad_by};
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    at_every_isa(|isa| {
        for g in depthwise_cases() {
            let taps = g.kernel[0] * g.kernel[1];
            let x = values(g.batch * g.input_len(), 31);
            let w = values(g.c_in * taps, 32);
            let dy = values(g.batch * g.output_len(), 33);
            let [y, dx] = tap_ordered_depthwise(&g, &x, &w, &dy);
            let dw = tap_ordered_depthwise_weight_grad(&g, &x, &dy);
            // Every path on every case it can take, whichever `DepthwisePath::of` picks.
            let direct = depthwise_direct::applies(&g);
            let stride_two = g.stride == [2, 2]
                && g.kernel == [3, 3]
                && g.pad_begin == [1, 1]
                && g.input[1] <= 32;
            let slot = g.in_plane().max(g.out_plane());
            let single_vector = g.in_plane() <= 16 && (g.out_plane() > 8 || slot <= 8);
            assert_eq!(
                direct,
                isa == Isa::Avx512
                    && ((g.stride == [1, 1] && g.output[1] == g.input[1])
                        || stride_two
                        || single_vector),
                "{g:?}"
            );
            let paths = [
                DepthwisePath::Planes,
                DepthwisePath::Channels,
                DepthwisePath::Direct,
            ];
            for path in paths
                .into_iter()
                .filter(|&p| direct || p != DepthwisePath::Direct)
            {
                let at = format!("{isa:?} {path:?} {g:?}");
                assert_eq!(bits(&forward_by(path, &g, &x, &w)), bits(&y), "{at}: y");
                assert_eq!(
                    bits(&input_grad_by(path, &g, &w, &dy)),
                    bits(&dx),
                    "{at}: dx"
                );
                assert_eq!(
                    bits(&weight_grad_by(path, &g, &x, &dy)),
                    bits(&dw),
                    "{at}: dw"
                );
            }
        }
    });
}

#[test]
fn depthwise_convolution_matches_the_definition_and_its_adjoints() {
    let dot = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| *x as f64 * *y as f64)
            .sum::<f64>()
    };
    at_every_isa(|isa| {
        for g in depthwise_cases() {
            let taps = g.kernel[0] * g.kernel[1];
            let x = values(g.batch * g.input_len(), 21);
            let w = values(g.c_in * taps, 22);
            close(&depthwise_forward(&g, &x, &w), &naive_depthwise(&g, &x, &w));
            let dy = values(g.batch * g.output_len(), 23);
            let probe_x = values(x.len(), 24);
            let probe_w = values(w.len(), 25);
            let lhs = dot(&depthwise_input_grad(&g, &w, &dy), &probe_x);
            let rhs = dot(&dy, &depthwise_forward(&g, &probe_x, &w));
            assert!(
                (lhs - rhs).abs() < 1e-3 * (1.0 + rhs.abs()),
                "{isa:?} {g:?}: dx"
            );
            let lhs = dot(&depthwise_weight_grad(&g, &x, &dy), &probe_w);
            let rhs = dot(&dy, &depthwise_forward(&g, &x, &probe_w));
            assert!(
                (lhs - rhs).abs() < 1e-3 * (1.0 + rhs.abs()),
                "{isa:?} {g:?}: dW"
            );
        }
    });
}

/// Every tier runs the same additions in the same order: bitwise the same results, on any
/// number of threads.
#[test]
fn depthwise_and_activation_bits_do_not_depend_on_tier_or_threads() {
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    // 40 channels: weight-gradient tasks of 8 channels on one thread, 3 on three.
    let g = geometry([19, 40, 9, 9], [40, 3, 3], [2, 2], [(1, 1), (1, 1)]);
    let x = values(g.batch * g.input_len(), 31);
    let w = values(g.c_in * 9, 32);
    let dy = values(g.batch * g.output_len(), 33);
    // A 4×4 output: the channels-in-lanes path, over two blocks of channels and part of a third.
    let small = geometry([19, 40, 7, 7], [40, 3, 3], [2, 2], [(1, 1), (1, 1)]);
    assert_eq!(
        depthwise::DepthwisePath::of(&small),
        depthwise::DepthwisePath::Channels
    );
    let small_x = values(small.batch * small.input_len(), 36);
    let small_dy = values(small.batch * small.output_len(), 37);
    // The masks' edges too (NaN, ±0, 6, infinities), and a length that leaves tails of
    // every vector width.
    let edges = [
        f32::NAN,
        -0.0,
        0.0,
        6.0,
        -6.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
    ];
    let act_x: Vec<f32> = (values(40_000, 34).iter().map(|v| v * 8.0))
        .chain(edges)
        .collect();
    let act_dy = values(act_x.len(), 35);
    let run = |threads: usize| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| {
                let mut out = vec![
                    bits(depthwise_forward(&g, &x, &w)),
                    bits(depthwise_input_grad(&g, &w, &dy)),
                    bits(depthwise_weight_grad(&g, &x, &dy)),
                    bits(depthwise_forward(&small, &small_x, &w)),
                    bits(depthwise_input_grad(&small, &w, &small_dy)),
                    bits(depthwise_weight_grad(&small, &small_x, &small_dy)),
                ];
                for act in [Activation::Relu, Activation::Relu6, Activation::HardSwish] {
                    let (y, dx) = (
                        activation_forward(act, &act_x),
                        activation_backward(act, &act_x, &act_dy),
                    );
                    // In place (a tensor nothing else holds): the same values.
                    let (mut y_in_place, mut dx_in_place) = (act_x.clone(), act_dy.clone());
                    activation_forward_in_place(act, &mut y_in_place);
                    activation_backward_in_place(act, &act_x, &mut dx_in_place);
                    assert_eq!(bits(y_in_place), bits(y.clone()), "{act:?} in place");
                    assert_eq!(bits(dx_in_place), bits(dx.clone()), "{act:?} in place");
                    out.push(bits(y));
                    out.push(bits(dx));
                }
                out
            })
    };
    let reference = run(1);
    at_every_isa(|isa| {
        for threads in [1, 3] {
            assert!(run(threads) == reference, "{isa:?}, {threads} threads");
        }
    });
}

#[test]
fn aligned_buffers_are_zeros_from_a_cache_line() {
    for len in [0, 1, 17, 1000, 100_000] {
        let mut a = Aligned::zeroed(len);
        assert_eq!(a.len(), len);
        assert!(a.iter().all(|v| v.to_bits() == 0));
        assert_eq!(a.as_ptr() as usize % 64, 0, "{len} floats");
        a.iter_mut().for_each(|v| *v = 1.0);
        assert_eq!(a.iter().sum::<f32>(), len as f32);
    }
}

/// The blocked transposes (16 × 16 blocks in registers, partial blocks at the edges) move every
/// element where the plain loop does, on every tier.
#[test]
fn transposes_match_the_plain_loop() {
    at_every_isa(|isa| {
        for [rows, cols] in [
            [1, 1],
            [1, 37],
            [37, 1],
            [16, 16],
            [37, 23],
            [64, 48],
            [5, 100],
        ] {
            let src = values(rows * cols, 71);
            let mut dst = vec![f32::NAN; rows * cols];
            columns::transpose([rows, cols], &src, &mut dst);
            for r in 0..rows {
                for c in 0..cols {
                    assert_eq!(
                        dst[c * rows + r].to_bits(),
                        src[r * cols + c].to_bits(),
                        "{isa:?} {rows}×{cols} at ({r}, {c})"
                    );
                }
            }
        }
    });
}
