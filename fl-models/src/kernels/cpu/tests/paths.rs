//! Each fast path against the path it replaces, bit for bit: the small-map, across-samples,
//! direct, by-rows, gathered, pixel-major and single-pixel kernels, on the shapes that pick them.

use super::*;

#[test]
fn small_map_weight_gradients_are_gemms_bits() {
    // 2×2, 3×3 and 4×4 outputs (VGG-16's last blocks, CNN3, a strided and a pointwise layer),
    // channel counts that leave partial tiles both ways, batches over several chunks, and both
    // orientations of the gemm they replace (c_out below and above 16), two channel tasks.
    let shapes = [
        geometry([19, 37, 2, 2], [40, 3, 3], [1, 1], [(1, 1), (1, 1)]),
        geometry([9, 12, 3, 3], [20, 5, 5], [1, 1], [(2, 2), (2, 2)]),
        geometry([11, 8, 4, 4], [7, 3, 3], [1, 1], [(1, 1), (1, 1)]),
        geometry([5, 6, 7, 7], [33, 3, 3], [2, 2], [(0, 0), (0, 0)]),
        geometry([10, 21, 4, 4], [70, 1, 1], [1, 1], [(0, 0), (0, 0)]),
        // Input channels in whole row tiles: tap-major rows, padding taps skipped (a strided
        // layer and asymmetric padding too).
        geometry([11, 32, 2, 2], [40, 3, 3], [1, 1], [(1, 1), (1, 1)]),
        geometry([9, 64, 3, 3], [20, 5, 5], [1, 1], [(2, 2), (2, 2)]),
        geometry([5, 32, 5, 6], [18, 3, 3], [2, 2], [(1, 1), (0, 2)]),
    ];
    at_every_isa(|isa| {
        for g in &shapes {
            assert_eq!(narrow::applies(g), isa >= Isa::Avx2, "{g:?}: small map");
            assert_eq!(
                narrow::Layout::new(g).tap_major,
                g.c_in % 32 == 0,
                "{g:?}: row order"
            );
            let x = values(g.batch * g.input_len(), 21);
            let dy = values(g.batch * g.output_len(), 22);
            let (dw, db) = conv2d_weight_grad(g, &x, &dy);
            let (dw_ref, db_ref) = im2col_conv2d_weight_grad((g, &x, &dy, true));
            assert_same_bits(&dw, &dw_ref, format!("{g:?}: weight gradient"));
            assert_same_bits(&db, &db_ref, format!("{g:?}: bias gradient"));
        }
    });
}

#[test]
fn small_map_convolutions_across_samples_keep_their_paths_bits() {
    // The small maps of CNN3, CNN4, ResNet-20 and VGG-16: the direct kernels' order (8×8),
    // gemm's with several depth blocks (7×7 and 3×3 under 5×5 kernels: 3,200 rows), a strided
    // layer with asymmetric padding, input gradients over two blocks of output channels (600),
    // batches that leave part of the last vector empty. With each, whether AVX2 takes it too.
    let shapes = [
        (
            geometry([40, 64, 8, 8], [128, 5, 5], [1, 1], [(2, 2), (2, 2)]),
            true,
        ),
        // ResNet-20's 8×8 stage and CNN4's Conv5: 3×3 kernels on 8×8 maps, direct order
        // (16% padding: AVX2 keeps the direct kernels).
        (
            geometry([37, 64, 8, 8], [64, 3, 3], [1, 1], [(1, 1), (1, 1)]),
            false,
        ),
        (
            geometry([40, 64, 8, 8], [128, 3, 3], [1, 1], [(1, 1), (1, 1)]),
            false,
        ),
        (
            geometry([40, 128, 7, 7], [128, 5, 5], [1, 1], [(2, 2), (2, 2)]),
            true,
        ),
        (
            geometry([16, 128, 3, 3], [256, 5, 5], [1, 1], [(2, 2), (2, 2)]),
            true,
        ),
        (
            geometry([45, 32, 4, 4], [48, 3, 3], [1, 1], [(1, 1), (1, 1)]),
            true,
        ),
        (
            geometry([40, 16, 4, 4], [32, 5, 5], [2, 2], [(2, 1), (1, 2)]),
            true,
        ),
        (
            geometry([24, 16, 2, 2], [600, 3, 3], [1, 1], [(1, 1), (1, 1)]),
            true,
        ),
        // 64 channels on 2×2 maps: groups of 32 and 16 samples made products whose gemm
        // blocks differed (the last one small enough for gemm's fixed 512-deep blocks), which
        // kept this kernel off; now two groups of 24 sum in the same blocks.
        (
            geometry([48, 64, 2, 2], [64, 3, 3], [1, 1], [(1, 1), (1, 1)]),
            true,
        ),
        // ResNet-20's stride-2 layer into its 8×8 stage: little padding, but strided layers
        // would otherwise take im2col.
        (
            geometry([40, 32, 16, 16], [64, 3, 3], [2, 2], [(1, 1), (1, 1)]),
            true,
        ),
        // Batches of 50 (FedMR's): the last 2 samples take the replaced path alongside, on
        // the direct kernels (CNN3's Conv3) and on gemm (CNN3's Conv5 on 4×4 and 3×3 maps).
        (
            geometry([50, 64, 8, 8], [128, 5, 5], [1, 1], [(2, 2), (2, 2)]),
            true,
        ),
        (
            geometry([50, 128, 4, 4], [256, 5, 5], [1, 1], [(2, 2), (2, 2)]),
            true,
        ),
        (
            geometry([50, 128, 3, 3], [256, 5, 5], [1, 1], [(2, 2), (2, 2)]),
            true,
        ),
        // VGG-16's 1×1 maps on 1×28×28 inputs, with 2, 1 and 3 samples after the last whole
        // vector, all in this kernel's vectors (on gemm, a lone sample's one-column product
        // would be a matrix-vector product, another order of additions).
        (
            geometry([50, 64, 1, 1], [64, 3, 3], [1, 1], [(1, 1), (1, 1)]),
            true,
        ),
        (
            geometry([49, 64, 1, 1], [64, 3, 3], [1, 1], [(1, 1), (1, 1)]),
            true,
        ),
        (
            geometry([51, 64, 1, 1], [64, 3, 3], [1, 1], [(1, 1), (1, 1)]),
            true,
        ),
        // On AVX-512 only, maps where the direct kernels' rows waste lanes: ResNet-20's 14×14
        // stage on 1×28×28 inputs (batch 50: a tail on the direct kernels), CNN1's and CNN2's
        // 16×16 layer under 5×5 kernels, CNN4's 14×14 one, and the FedAvg CNN's unpadded 8×8
        // one on 1×28×28 inputs.
        (
            geometry([50, 32, 14, 14], [32, 3, 3], [1, 1], [(1, 1), (1, 1)]),
            false,
        ),
        (
            geometry([24, 16, 16, 16], [32, 5, 5], [1, 1], [(2, 2), (2, 2)]),
            false,
        ),
        (
            geometry([24, 32, 14, 14], [32, 5, 5], [1, 1], [(2, 2), (2, 2)]),
            false,
        ),
        (
            geometry([50, 32, 12, 12], [64, 5, 5], [1, 1], [(0, 0), (0, 0)]),
            false,
        ),
    ];
    at_every_isa(|isa| {
        for (g, on_avx2) in &shapes {
            let direct = crate::kernels::direct::applies(g);
            let order = lanes::Order::for_geometry(g, None);
            let expected = match isa {
                Isa::Baseline => false,
                Isa::Avx2 => *on_avx2,
                Isa::Avx512 => true,
            };
            assert_eq!(order.is_some(), expected, "{g:?}");
            // Samples after the last whole vector that would fill at most half of one run on
            // the replaced path (here in the same order: direct, or equal gemm blocks), except
            // on 1×1 maps.
            if let Some(order) = order {
                let (head, tail) = lanes::split(g, order);
                let rest = g.batch % 16;
                let split = (1..=8).contains(&rest) && g.batch > 16 && g.out_plane() > 1;
                assert_eq!(tail.map(|t| t.batch), split.then_some(rest), "{g:?}");
                assert_eq!(head.batch + tail.map_or(0, |t| t.batch), g.batch);
            }
            let x = values(g.batch * g.input_len(), 31);
            let w = values(g.weight_len(), 32);
            let b = values(g.c_out, 33);
            let dy = values(g.batch * g.output_len(), 34);
            for bias in [Some(&b[..]), None] {
                let y = conv2d_forward(g, &x, &w, bias);
                let y_ref = if direct {
                    crate::kernels::direct::conv2d_forward(g, &x, &w, bias)
                } else {
                    im2col_conv2d_forward(g, &x, &w, bias)
                };
                assert_eq!(y.len(), y_ref.len());
                assert_eq!(first_difference(&y, &y_ref), None, "{g:?}: forward");
            }
            close(
                &conv2d_forward(g, &x, &w, Some(&b)),
                &naive_conv(g, &x, &w, &b),
            );
            let dx = conv2d_input_grad(g, &w, &dy);
            let dx_ref = if direct {
                crate::kernels::direct::conv2d_input_grad(g, &w, &dy)
            } else {
                im2col_conv2d_input_grad(g, &w, &dy)
            };
            assert_eq!(dx.len(), dx_ref.len());
            assert_eq!(
                first_difference(&dx, &dx_ref),
                None,
                "{g:?}: input gradient"
            );
        }
        if isa == Isa::Baseline {
            return;
        }
        // A direct-path bias holding −0 would be turned into +0 by the padding products this
        // kernel skips: it keeps the old path.
        let g = &shapes[0].0;
        let mut b = values(g.c_out, 35);
        b[3] = -0.0;
        assert_eq!(lanes::Order::for_geometry(g, Some(&b)), None);
        // 16×16 maps under 3×3 kernels (8% padding, whole rows of 16) stay on the direct
        // kernels, as do 28×28 maps.
        let g = geometry([40, 32, 16, 16], [32, 3, 3], [1, 1], [(1, 1), (1, 1)]);
        assert_eq!(lanes::Order::for_geometry(&g, None), None);
        let g = geometry([40, 32, 28, 28], [32, 3, 3], [1, 1], [(1, 1), (1, 1)]);
        assert_eq!(lanes::Order::for_geometry(&g, None), None);
    });
}

#[test]
fn direct_weight_gradients_without_their_zero_products_keep_their_bits() {
    // 8×8, 14×14 and 16×16 maps under 5×5 kernels (CNN1–CNN4's), a 3×5 kernel on a map that
    // is not square, one and two channel tiles, batches over several chunks with a partial
    // last one, asymmetric padding; 3×3 kernels on 7×7, 8×8 and 16×16 maps (ResNet-20's,
    // VGG-16's, CNN4's), unpadded, cut off and on a map that is not square.
    let shapes = [
        geometry([21, 16, 8, 8], [64, 5, 5], [1, 1], [(2, 2), (2, 2)]),
        geometry([9, 7, 8, 8], [128, 5, 5], [1, 1], [(2, 2), (2, 2)]),
        geometry([17, 5, 7, 8], [64, 3, 5], [1, 1], [(2, 1), (2, 2)]),
        geometry([10, 4, 14, 14], [64, 5, 5], [1, 1], [(2, 2), (2, 2)]),
        geometry([8, 3, 16, 16], [64, 5, 5], [1, 1], [(1, 3), (2, 2)]),
        geometry([19, 6, 7, 7], [64, 3, 3], [1, 1], [(1, 1), (1, 1)]),
        geometry([9, 5, 8, 8], [96, 3, 3], [1, 1], [(1, 1), (1, 1)]),
        geometry([5, 3, 16, 16], [32, 3, 3], [1, 1], [(1, 1), (1, 1)]),
        geometry([10, 4, 10, 9], [32, 3, 3], [1, 1], [(0, 0), (2, 0)]),
        geometry([9, 2, 9, 12], [64, 3, 3], [1, 1], [(2, 1), (1, 2)]),
        // The FedMR CNN's unpadded 8×8 map on 1×28×28 inputs: 32 channels, half a tile.
        geometry([21, 16, 12, 12], [32, 5, 5], [1, 1], [(0, 0), (0, 0)]),
    ];
    at_every_isa(|isa| {
        for g in &shapes {
            // 5-wide kernels from AVX2 up (on AVX2 in whole 64-channel tiles), 3×3 ones on
            // AVX-512.
            let takes = isa == Isa::Avx512
                || (isa == Isa::Avx2 && g.kernel[1] == 5 && g.c_out.is_multiple_of(64));
            assert_eq!(direct_wgrad::applies(g), takes, "{g:?}: applies");
            if isa < Isa::Avx2 {
                continue;
            }
            let x = values(g.batch * g.input_len(), 41);
            let dy = values(g.batch * g.output_len(), 42);
            let (dw, db) = conv2d_weight_grad(g, &x, &dy);
            let (dw_ref, db_ref) = crate::kernels::direct::conv2d_weight_grad((g, &x, &dy, true));
            assert_same_bits(&dw, &dw_ref, format!("{g:?}: weight gradient"));
            assert_same_bits(&db, &db_ref, format!("{g:?}: bias gradient"));
        }
    });
}

#[test]
fn weight_gradients_without_the_column_matrix_keep_the_im2col_bits() {
    // CNN3's 7×7 layer on 1×28×28 inputs, a 5×5 map, a 3×5 kernel on a map that is not
    // square, asymmetric padding, one and two channel tiles, partial last chunks.
    let shapes = [
        geometry([19, 6, 7, 7], [128, 5, 5], [1, 1], [(2, 2), (2, 2)]),
        geometry([9, 4, 5, 5], [64, 5, 5], [1, 1], [(2, 2), (2, 2)]),
        geometry([10, 3, 6, 9], [64, 3, 5], [1, 1], [(1, 1), (0, 2)]),
        geometry([3, 2, 8, 7], [64, 5, 5], [1, 1], [(3, 1), (2, 2)]),
    ];
    at_every_isa(|isa| {
        for g in &shapes {
            assert_eq!(
                matches!(WeightGradPath::of(g), WeightGradPath::WithoutColumns),
                isa >= Isa::Avx2,
                "{g:?}: path"
            );
            let x = values(g.batch * g.input_len(), 43);
            let dy = values(g.batch * g.output_len(), 44);
            let (dw, db) = conv2d_weight_grad(g, &x, &dy);
            let (dw_ref, db_ref) = im2col_conv2d_weight_grad((g, &x, &dy, true));
            assert_same_bits(&dw, &dw_ref, format!("{g:?}: weight gradient"));
            assert_same_bits(&db, &db_ref, format!("{g:?}: bias gradient"));
        }
    });
}

/// Asserts that `g`'s direct input gradient has the wide scatter's bits, for `dy` and for
/// gradients all negative: a gathered tap that reads the border adds a chain of zero products
/// (−0 or +0 by weight).
fn input_grad_keeps_the_wide_bits(g: &Conv2dGeometry, w: &[f32], dy: &[f32]) {
    use crate::kernels::direct;
    let dy_neg: Vec<f32> = dy.iter().map(|v| -v.abs() - 0.5).collect();
    for dy in [dy, &dy_neg] {
        let dx = direct::conv2d_input_grad(g, w, dy);
        let dx_ref = direct::wide_input_grad(g, w, dy);
        assert_same_bits(&dx, &dx_ref, format!("{g:?}: input gradient"));
    }
}

#[test]
fn direct_kernels_by_rows_keep_the_wide_bits() {
    // By rows: 16×16 and 32×32 maps under 3×3 and 5×5 kernels (one and two vectors per row),
    // 14×14 and 12×30 ones (a partial last vector per row), asymmetric padding; channel counts
    // that leave a partial channel tile on both sides (13: tile 8), several samples.
    let by_rows = [
        geometry([3, 5, 16, 16], [13, 3, 3], [1, 1], [(1, 1), (1, 1)]),
        geometry([2, 9, 16, 16], [16, 5, 5], [1, 1], [(2, 2), (2, 2)]),
        geometry([2, 3, 32, 32], [12, 3, 3], [1, 1], [(1, 1), (1, 1)]),
        geometry([3, 6, 14, 14], [20, 5, 5], [1, 1], [(2, 2), (2, 2)]),
        geometry([2, 8, 12, 30], [6, 5, 5], [1, 1], [(2, 2), (1, 3)]),
    ];
    // By the wide layout's vectors, stored straight into the output across two or three rows
    // (on AVX2, in 8-lane vectors, where rows are no wider in whole vectors, by rows): ResNet-20's
    // 28×28 stage (848 wide lanes per channel against 896 by rows), the FedAvg CNN's first layer
    // on 1×28×28 inputs (24×24 of rows 28 apart; 576 lanes by rows on AVX2), the FedMR CNN's
    // second (10×10, rows 14 apart; on 1×28×28 inputs 8×8, rows 12 apart: some vectors start
    // past a row's end and reach two more rows).
    let wide = [
        (
            geometry([2, 16, 28, 28], [16, 3, 3], [1, 1], [(1, 1), (1, 1)]),
            false,
        ),
        (
            geometry([3, 1, 28, 28], [32, 5, 5], [1, 1], [(0, 0), (0, 0)]),
            true,
        ),
        (
            geometry([2, 6, 14, 14], [16, 5, 5], [1, 1], [(0, 0), (0, 0)]),
            false,
        ),
        (
            geometry([3, 6, 12, 12], [13, 5, 5], [1, 1], [(0, 0), (0, 0)]),
            true,
        ),
    ];
    // 8×8 and 7×7 maps: by rows in AVX2's 8-lane vectors (one per row, against 80 and 64
    // lanes per channel wide), wide in AVX-512's 16-lane ones (7×7: rows 9 apart, three per
    // vector).
    let short_rows = [
        geometry([3, 13, 8, 8], [20, 3, 3], [1, 1], [(1, 1), (1, 1)]),
        geometry([2, 9, 7, 7], [16, 3, 3], [1, 1], [(1, 1), (1, 1)]),
    ];
    use crate::kernels::direct;
    at_every_isa(|isa| {
        if isa < Isa::Avx2 {
            return;
        }
        let avx2 = isa == Isa::Avx2;
        let paths = by_rows.iter().map(|g| (g, true));
        let paths = paths.chain(wide.iter().map(|(g, on_avx2)| (g, avx2 && *on_avx2)));
        for (g, by_rows) in paths.chain(short_rows.iter().map(|g| (g, avx2))) {
            let x = values(g.batch * g.input_len(), 61);
            let w = values(g.weight_len(), 62);
            let b = values(g.c_out, 63);
            let dy = values(g.batch * g.output_len(), 64);
            assert_eq!(direct::runs_by_rows(g), by_rows, "{g:?}: runs by rows");
            for bias in [Some(&b[..]), None] {
                let y = direct::conv2d_forward(g, &x, &w, bias);
                let y_rows = direct::forward_by_rows(g, true, &x, &w, bias);
                let y_wide = direct::forward_by_rows(g, false, &x, &w, bias);
                assert_same_bits(&y, &y_rows, format!("{g:?}: forward by rows"));
                assert_same_bits(&y, &y_wide, format!("{g:?}: forward wide"));
            }
            input_grad_keeps_the_wide_bits(g, &w, &dy);
            close(
                &direct::conv2d_forward(g, &x, &w, Some(&b)),
                &naive_conv(g, &x, &w, &b),
            );
        }
    });
}

#[test]
fn gathered_input_gradients_keep_the_scatter_bits() {
    // Wide layouts the input gradient gathers (28×28, 15×15 and 14×14 maps under "same" 3×3
    // kernels; a partial channel tile; asymmetric padding; 15 rows of one vector, an odd count,
    // so that a tile of one vector ends each channel on AVX-512), and one it scatters (an
    // unpadded 5×5 layer: every input pixel would gather 25 taps for a 10×10 map).
    let gathered = [
        geometry([2, 13, 28, 28], [8, 3, 3], [1, 1], [(1, 1), (1, 1)]),
        geometry([2, 16, 15, 15], [12, 3, 3], [1, 1], [(1, 1), (1, 1)]),
        geometry([3, 16, 14, 14], [24, 3, 3], [1, 1], [(1, 1), (1, 1)]),
        geometry([2, 8, 11, 30], [9, 3, 3], [1, 1], [(2, 0), (0, 2)]),
    ];
    let scattered = geometry([2, 6, 14, 14], [16, 5, 5], [1, 1], [(0, 0), (0, 0)]);
    use crate::kernels::direct;
    let _guard = crate::kernels::isa::test_lock();
    if Isa::active() < Isa::Avx2 {
        return;
    }
    let shapes = gathered.iter().map(|g| (g, true));
    for (g, gathers) in shapes.chain([(&scattered, false)]) {
        assert_eq!(direct::gathers(g), gathers, "{g:?}: gathers");
        let w = values(g.weight_len(), 71);
        let dy = values(g.batch * g.output_len(), 72);
        input_grad_keeps_the_wide_bits(g, &w, &dy);
    }
}

#[test]
fn weight_gradients_pixel_major_keep_gemms_bits() {
    // Transposed im2col products that take their output gradient pixel-major: 1×1 layers with
    // channels off the 16-float blocks on maps from 32×32 down to one and two pixels (gemm's
    // shortest depths), a strided 3×3 layer; and products gemm runs by other kernels (at most
    // 16 × 16; one column row), which keep the channel-major output gradient.
    let shapes = [
        geometry([2, 16, 32, 32], [96, 1, 1], [1, 1], [(0, 0), (0, 0)]),
        geometry([3, 24, 8, 8], [144, 1, 1], [1, 1], [(0, 0), (0, 0)]),
        geometry([4, 40, 4, 4], [16, 1, 1], [1, 1], [(0, 0), (0, 0)]),
        geometry([5, 19, 2, 2], [33, 1, 1], [1, 1], [(0, 0), (0, 0)]),
        geometry([3, 20, 1, 2], [24, 1, 1], [1, 1], [(0, 0), (0, 0)]),
        geometry([3, 20, 1, 1], [16, 1, 1], [1, 1], [(0, 0), (0, 0)]),
        geometry([2, 5, 15, 15], [24, 3, 3], [2, 2], [(1, 1), (1, 1)]),
        geometry([2, 7, 3, 5], [20, 1, 1], [1, 1], [(0, 0), (0, 0)]),
        geometry([2, 1, 4, 4], [300, 1, 1], [1, 1], [(0, 0), (0, 0)]),
    ];
    at_every_isa(|_| {
        for g in &shapes {
            let x = values(g.batch * g.input_len(), 81);
            let dy = values(g.batch * g.output_len(), 82);
            let (dw_t, db) = weight_grad_chunk((g, &x, &dy, true), 0..g.batch);
            // gemm on the channel-major output gradient.
            let mut want = vec![0.0f32; g.weight_len()];
            let mut col = g.col_buffer();
            for n in 0..g.batch {
                let x_n = &x[n * g.input_len()..(n + 1) * g.input_len()];
                let cols = if g.is_pointwise() {
                    x_n
                } else {
                    im2col(g, x_n, &mut col);
                    &col
                };
                matmul(
                    [g.c_out, g.col_rows(), g.out_plane()],
                    (&mut want[..], 1, g.c_out),
                    n > 0,
                    (&dy[n * g.output_len()..], g.out_plane(), 1),
                    (cols, 1, g.out_plane()),
                );
            }
            assert_same_bits(&dw_t, &want, format!("{g:?}: weight gradient"));
            assert_eq!(db.len(), g.c_out);
        }
    });
}

#[test]
fn single_pixel_weight_gradients_keep_the_im2col_bits() {
    // VGG-16's 1×1 maps under 3×3 kernels (c_out above and below 16: both orientations of the
    // gemm replaced), a squeeze-and-excitation 1×1 layer, a strided layer whose one pixel reads
    // part of a 2×3 input, asymmetric padding; batches over several chunks and a partial one.
    let shapes = [
        geometry([19, 40, 1, 1], [24, 3, 3], [1, 1], [(1, 1), (1, 1)]),
        geometry([9, 33, 1, 1], [10, 3, 3], [1, 1], [(1, 1), (1, 1)]),
        geometry([17, 72, 1, 1], [40, 1, 1], [1, 1], [(0, 0), (0, 0)]),
        geometry([8, 20, 2, 3], [18, 3, 3], [2, 2], [(1, 0), (1, 0)]),
        geometry([3, 12, 2, 2], [5, 5, 3], [3, 3], [(2, 1), (1, 0)]),
    ];
    at_every_isa(|isa| {
        for g in &shapes {
            assert!(
                matches!(WeightGradPath::of(g), WeightGradPath::SinglePixel),
                "{g:?}: path"
            );
            let x = values(g.batch * g.input_len(), 51);
            let dy = values(g.batch * g.output_len(), 52);
            // Also channels whose gradients are all negative (their padding rows are −0),
            // and a non-finite gradient.
            let mut dy_neg: Vec<f32> = dy.iter().map(|v| -v.abs() - 0.5).collect();
            dy_neg[g.c_out + 1] = f32::INFINITY;
            for dy in [&dy, &dy_neg] {
                let (dw, db) = conv2d_weight_grad(g, &x, dy);
                let (dw_ref, db_ref) = im2col_conv2d_weight_grad((g, &x, dy, true));
                assert_same_bits(&dw, &dw_ref, format!("{isa:?} {g:?}: weight gradient"));
                assert_same_bits(&db, &db_ref, format!("{isa:?} {g:?}: bias gradient"));
            }
        }
    });
}

/// The direct kernels' sums, spelled out in scalar code: the forward pass an FMA chain from the
/// bias over the taps in weight order; the input gradient, per input pixel, each tap's chain
/// over the output channels from +0 added in tap order onto +0; the weight gradient 16 chains
/// per element, lane `l` taking the wide positions `≡ l (mod 16)` sample by sample, added by the
/// tree `l + 8`, `+ 4`, `+ 2`, `+ 1`, and the 8-sample chunks added in order. On every tier
/// that runs the direct kernels (AVX2 in pairs of registers, AVX-512), so both give these bits.
#[test]
fn direct_kernels_compute_their_documented_chains() {
    use crate::kernels::direct;
    // Wide, by rows, gathered and scattered layouts; wide vectors reaching two and three rows
    // (24×24, rows 28 apart; 8×8, rows 12 apart; 7×7, rows 9 apart); channel tiles of 8, 6
    // and 4 with partial ones; 5×5 and 3×3 kernels, 25 and 75 taps (weight-gradient tiles of
    // five taps), asymmetric padding; two weight-gradient chunks.
    let shapes = [
        geometry([3, 1, 28, 28], [32, 5, 5], [1, 1], [(0, 0), (0, 0)]),
        geometry([2, 3, 20, 20], [8, 5, 5], [1, 1], [(0, 0), (0, 0)]),
        geometry([3, 6, 12, 12], [13, 5, 5], [1, 1], [(0, 0), (0, 0)]),
        geometry([2, 9, 7, 7], [16, 3, 3], [1, 1], [(1, 1), (1, 1)]),
        geometry([3, 5, 16, 16], [13, 3, 3], [1, 1], [(1, 1), (1, 1)]),
        geometry([2, 16, 28, 28], [16, 3, 3], [1, 1], [(1, 1), (1, 1)]),
        geometry([10, 6, 14, 14], [16, 5, 5], [1, 1], [(0, 0), (0, 0)]),
        geometry([2, 7, 8, 8], [12, 3, 3], [1, 1], [(1, 1), (1, 1)]),
        geometry([3, 9, 12, 12], [6, 5, 5], [1, 1], [(2, 1), (0, 2)]),
        geometry([2, 4, 10, 12], [20, 3, 3], [1, 1], [(2, 0), (1, 1)]),
    ];
    at_every_isa(|isa| {
        for g in &shapes {
            if !direct::applies(g) {
                assert!(isa < Isa::Avx2, "{g:?}: the direct kernels apply from AVX2");
                continue;
            }
            let x = values(g.batch * g.input_len(), 81);
            let w = values(g.weight_len(), 82);
            let b = values(g.c_out, 83);
            let dy = values(g.batch * g.output_len(), 84);
            let what = |pass: &str| format!("{isa:?} {g:?}: {pass}");
            let chains = Chains::new(g, &x, &w, &dy);
            assert_same_bits(
                &direct::conv2d_forward(g, &x, &w, Some(&b)),
                &chains.forward(&b),
                what("forward"),
            );
            assert_same_bits(
                &direct::conv2d_input_grad(g, &w, &dy),
                &chains.input_grad(),
                what("input gradient"),
            );
            let (dw, _) = direct::conv2d_weight_grad((g, &x, &dy, true));
            assert_same_bits(&dw, &chains.weight_grad(), what("weight gradient"));
        }
    });
}

/// Scalar versions of the direct kernels' sums (see the test above).
struct Chains<'a> {
    g: &'a Conv2dGeometry,
    x: &'a [f32],
    w: &'a [f32],
    dy: &'a [f32],
}

impl<'a> Chains<'a> {
    fn new(g: &'a Conv2dGeometry, x: &'a [f32], w: &'a [f32], dy: &'a [f32]) -> Self {
        Chains { g, x, w, dy }
    }

    /// Input `x[n, ci]` at padded position `(r, c)` (0 in the padding).
    fn padded(&self, n: usize, ci: usize, r: usize, c: usize) -> f32 {
        let ([h, w], [ph, pw]) = (self.g.input, self.g.pad_begin);
        let (Some(iy), Some(ix)) = (r.checked_sub(ph), c.checked_sub(pw)) else {
            return 0.0;
        };
        if iy >= h || ix >= w {
            return 0.0;
        }
        self.x[((n * self.g.c_in + ci) * h + iy) * w + ix]
    }

    fn weight(&self, co: usize, ci: usize, ky: usize, kx: usize) -> f32 {
        let [kh, kw] = self.g.kernel;
        self.w[((co * self.g.c_in + ci) * kh + ky) * kw + kx]
    }

    fn grad(&self, n: usize, co: usize, oy: usize, ox: usize) -> f32 {
        let [oh, ow] = self.g.output;
        self.dy[((n * self.g.c_out + co) * oh + oy) * ow + ox]
    }

    fn forward(&self, bias: &[f32]) -> Vec<f32> {
        let g = self.g;
        let ([oh, ow], [kh, kw]) = (g.output, g.kernel);
        let mut y = Vec::with_capacity(g.batch * g.output_len());
        for n in 0..g.batch {
            for (co, &b) in bias.iter().enumerate().take(g.c_out) {
                for oy in 0..oh {
                    for ox in 0..ow {
                        let mut acc = b;
                        for ci in 0..g.c_in {
                            for ky in 0..kh {
                                for kx in 0..kw {
                                    let xv = self.padded(n, ci, oy + ky, ox + kx);
                                    acc = self.weight(co, ci, ky, kx).mul_add(xv, acc);
                                }
                            }
                        }
                        y.push(acc);
                    }
                }
            }
        }
        y
    }

    fn input_grad(&self) -> Vec<f32> {
        let g = self.g;
        let ([h, w], [oh, ow], [kh, kw], [ph, pw]) = (g.input, g.output, g.kernel, g.pad_begin);
        let mut dx = Vec::with_capacity(g.batch * g.input_len());
        for n in 0..g.batch {
            for ci in 0..g.c_in {
                for iy in 0..h {
                    for ix in 0..w {
                        let mut total = 0.0f32;
                        for ky in 0..kh {
                            for kx in 0..kw {
                                // The output this tap feeds; taps with none add +0.
                                let (Some(oy), Some(ox)) =
                                    ((iy + ph).checked_sub(ky), (ix + pw).checked_sub(kx))
                                else {
                                    continue;
                                };
                                if oy >= oh || ox >= ow {
                                    continue;
                                }
                                let mut chain = 0.0f32;
                                for co in 0..g.c_out {
                                    let d = self.grad(n, co, oy, ox);
                                    chain = self.weight(co, ci, ky, kx).mul_add(d, chain);
                                }
                                total += chain;
                            }
                        }
                        dx.push(total);
                    }
                }
            }
        }
        dx
    }

    fn weight_grad(&self) -> Vec<f32> {
        let g = self.g;
        let ([oh, ow], [kh, kw]) = (g.output, g.kernel);
        let wp = ow + kw - 1;
        let mut dw = vec![0.0f32; g.weight_len()];
        for chunk in (0..g.batch).collect::<Vec<_>>().chunks(WEIGHT_GRAD_CHUNK) {
            for co in 0..g.c_out {
                for ci in 0..g.c_in {
                    for ky in 0..kh {
                        for kx in 0..kw {
                            let mut lanes = [0.0f32; 16];
                            for &n in chunk {
                                for oy in 0..oh {
                                    for ox in 0..ow {
                                        let lane = &mut lanes[(oy * wp + ox) % 16];
                                        let xv = self.padded(n, ci, oy + ky, ox + kx);
                                        *lane = self.grad(n, co, oy, ox).mul_add(xv, *lane);
                                    }
                                }
                            }
                            let eight: Vec<f32> = (0..8).map(|l| lanes[l] + lanes[l + 8]).collect();
                            let four: Vec<f32> = (0..4).map(|l| eight[l] + eight[l + 4]).collect();
                            let sum = (four[0] + four[2]) + (four[1] + four[3]);
                            let at = ((co * g.c_in + ci) * kh + ky) * kw + kx;
                            dw[at] = if chunk[0] == 0 { sum } else { dw[at] + sum };
                        }
                    }
                }
            }
        }
        dw
    }
}

#[test]
fn stride_two_convolutions_from_the_planes_keep_the_im2col_bits() {
    // The ResNet-20s' layers into their 16×16 and 14×14 stages (one sample per gemm or two),
    // odd input sizes (the last output reads the padding, or the last input is never read),
    // 576 rows (two gemm depth blocks on the forward pass), a batch whose last group is
    // narrower, an odd number of output rows, 600 output channels (two depth blocks on the
    // input gradient).
    let shapes = [
        geometry([5, 16, 32, 32], [32, 3, 3], [2, 2], [(1, 1), (1, 1)]),
        geometry([3, 32, 28, 28], [32, 3, 3], [2, 2], [(1, 1), (1, 1)]),
        geometry([2, 64, 29, 31], [16, 3, 3], [2, 2], [(1, 1), (1, 1)]),
        geometry([2, 64, 12, 12], [16, 3, 3], [2, 2], [(1, 1), (1, 1)]),
        geometry([3, 16, 18, 10], [144, 3, 3], [2, 2], [(1, 1), (1, 1)]),
        geometry([2, 16, 12, 12], [600, 3, 3], [2, 2], [(1, 1), (1, 1)]),
    ];
    at_every_isa(|isa| {
        for g in &shapes {
            assert_eq!(
                matches!(PassPath::input_grad(g), PassPath::Strided),
                isa == Isa::Avx512,
                "{g:?}: path"
            );
            let x = values(g.batch * g.input_len(), 51);
            let w = values(g.weight_len(), 52);
            let b = values(g.c_out, 53);
            let dy = values(g.batch * g.output_len(), 54);
            for bias in [Some(&b[..]), None] {
                let y = conv2d_forward(g, &x, &w, bias);
                let y_ref = im2col_conv2d_forward(g, &x, &w, bias);
                assert_same_bits(&y, &y_ref, format!("{g:?}: forward"));
            }
            close(
                &conv2d_forward(g, &x, &w, Some(&b)),
                &naive_conv(g, &x, &w, &b),
            );
            let dx = conv2d_input_grad(g, &w, &dy);
            let dx_ref = im2col_conv2d_input_grad(g, &w, &dy);
            assert_same_bits(&dx, &dx_ref, format!("{g:?}: input gradient"));
        }
        // The weight gradient on any map whose rows fit a vector (its vectors hold output
        // channels): the layers above, the ResNet-20s' stride-2 layers into their 8×8 and 7×7
        // stages (whose forward passes run across samples), a batch over two chunks and a
        // partial third, 48 channels (a tile of two vectors and one of one), 600 pixels (two
        // gemm depth blocks).
        let more = [
            geometry([20, 32, 16, 16], [64, 3, 3], [2, 2], [(1, 1), (1, 1)]),
            geometry([9, 32, 14, 14], [48, 3, 3], [2, 2], [(1, 1), (1, 1)]),
            geometry([3, 16, 80, 30], [64, 3, 3], [2, 2], [(1, 1), (1, 1)]),
        ];
        for g in shapes.iter().chain(&more) {
            let wide_rows = g.output[1] > 16;
            assert_eq!(
                matches!(WeightGradPath::of(g), WeightGradPath::Strided),
                isa == Isa::Avx512 && !wide_rows && g.c_out % 16 == 0,
                "{g:?}: weight gradient path"
            );
            let x = values(g.batch * g.input_len(), 55);
            let dy = values(g.batch * g.output_len(), 56);
            let (dw, db) = conv2d_weight_grad(g, &x, &dy);
            let (dw_ref, db_ref) = im2col_conv2d_weight_grad((g, &x, &dy, true));
            assert_same_bits(&dw, &dw_ref, format!("{g:?}: weight gradient"));
            assert_same_bits(&db, &db_ref, format!("{g:?}: bias gradient"));
        }
        // `resnet20-ref`'s 1×1 shortcut stays on im2col, as do rows wider than a vector.
        for g in [
            geometry([3, 64, 32, 32], [128, 1, 1], [2, 2], [(0, 0), (0, 0)]),
            geometry([3, 16, 40, 40], [32, 3, 3], [2, 2], [(1, 1), (1, 1)]),
        ] {
            assert!(
                matches!(PassPath::input_grad(&g), PassPath::Im2col),
                "{g:?}"
            );
        }
    });
}

#[test]
fn weight_gradients_without_a_bias_skip_only_its_sums() {
    // A layer of each weight-gradient path (on AVX-512; fewer take their own path below it),
    // batches with a short last chunk: without a bias, the same weight gradient bit for bit
    // and no bias gradient.
    let shapes = [
        geometry([10, 16, 8, 8], [32, 3, 3], [1, 1], [(1, 1), (1, 1)]),
        geometry([10, 16, 32, 32], [16, 3, 3], [1, 1], [(1, 1), (1, 1)]),
        geometry([11, 32, 2, 2], [40, 3, 3], [1, 1], [(1, 1), (1, 1)]),
        geometry([9, 128, 7, 7], [128, 5, 5], [1, 1], [(2, 2), (2, 2)]),
        geometry([9, 16, 1, 1], [32, 3, 3], [1, 1], [(1, 1), (1, 1)]),
        geometry([9, 16, 32, 32], [32, 3, 3], [2, 2], [(1, 1), (1, 1)]),
        geometry([10, 24, 8, 8], [48, 1, 1], [1, 1], [(0, 0), (0, 0)]),
    ];
    at_every_isa(|isa| {
        let mut paths = Vec::new();
        for g in &shapes {
            let path = WeightGradPath::of(g);
            if !paths.contains(&path) {
                paths.push(path);
            }
            let x = values(g.batch * g.input_len(), 31);
            let dy = values(g.batch * g.output_len(), 32);
            let (dw, db) = conv2d_weight_grad(g, &x, &dy);
            let (dw_alone, db_alone) = conv2d_weight_grad_of(g, &x, &dy, false);
            assert_eq!(db.len(), g.c_out, "{g:?}: bias gradient");
            assert!(
                db_alone.is_empty(),
                "{g:?} ({path:?}): no bias, no bias gradient"
            );
            assert_same_bits(&dw_alone, &dw, format!("{g:?} ({path:?}): weight gradient"));
        }
        if isa == Isa::Avx512 {
            assert_eq!(paths.len(), 7, "one layer per path: {paths:?}");
        }
    });
}

#[test]
fn kernel_paths_name_where_a_batch_s_last_samples_run() {
    // A batch of 50 under 5×5 kernels on 3×3 maps (as CNN3's): 48 samples across samples, the
    // last 2 on the path that kernel replaces; a batch of 48 has none left over, nor has one
    // on a 1×1 map.
    let g = geometry([50, 16, 3, 3], [48, 5, 5], [1, 1], [(2, 2), (2, 2)]);
    let whole = Conv2dGeometry { batch: 48, ..g };
    let one_pixel = geometry([50, 32, 1, 1], [48, 3, 3], [1, 1], [(1, 1), (1, 1)]);
    at_every_isa(|isa| {
        let [forward, input_grad, _] = kernel_paths(&g);
        if isa == Isa::Baseline {
            assert_eq!(forward, "im2col + gemm");
            return;
        }
        assert_eq!(forward, "across samples (the last 2: im2col + gemm)");
        assert_eq!(input_grad, forward);
        assert_eq!(kernel_paths(&whole)[0], "across samples");
        assert_eq!(kernel_paths(&one_pixel)[0], "across samples");
    });
}
