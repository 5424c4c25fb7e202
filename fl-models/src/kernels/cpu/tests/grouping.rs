//! The im2col path's groups of samples per gemm: grouped products keep the bits of one sample
//! per gemm where gemm sums both in the same depth blocks, and on 1×1 maps no batch leaves a
//! lone sample to a one-column product.

use super::*;

#[test]
fn grouping_samples_into_one_gemm_changes_no_bits() {
    let mut shapes = cases();
    // CNN3's 7×7 and 3×3 convolutions (pFedClub's Zoo III on Fashion-MNIST), a batch that
    // leaves a partial group.
    shapes.push(geometry(
        [13, 16, 7, 7],
        [24, 5, 5],
        [1, 1],
        [(2, 2), (2, 2)],
    ));
    shapes.push(geometry(
        [37, 12, 3, 3],
        [20, 5, 5],
        [1, 1],
        [(2, 2), (2, 2)],
    ));
    // MobileNetV1's pointwise layers on 4×4 and 2×2 maps, whose input gradients run in groups
    // (gemm splits their 512- and 1024-deep sums into the same blocks either way), and a batch
    // that leaves a partial group.
    // Their batches split into at least two groups of one size (training's 50 samples, an
    // evaluation chunk of 32), which keep the widest groups' bits; on 7×7 maps (MobileNetV1's
    // on 1×28×28 inputs) ten groups of 5, not five of 10, so that two threads share them evenly.
    let pointwise = [
        geometry([50, 512, 4, 4], [512, 1, 1], [1, 1], [(0, 0), (0, 0)]),
        geometry([45, 1024, 2, 2], [1024, 1, 1], [1, 1], [(0, 0), (0, 0)]),
        geometry([32, 512, 4, 4], [512, 1, 1], [1, 1], [(0, 0), (0, 0)]),
        geometry([50, 256, 7, 7], [256, 1, 1], [1, 1], [(0, 0), (0, 0)]),
    ];
    for g in &pointwise {
        assert!(g.input_grad_group() > 1, "{g:?}");
    }
    let groups: Vec<usize> = pointwise.iter().map(|g| g.group()).collect();
    assert_eq!(groups, [25, 23, 16, 5]);
    shapes.extend(pointwise);
    // No batch gives a sample other depth blocks than the others: not a lone sample on a 1×1
    // map (VGG-16's and the MobileNets' last layers on 1×28×28 inputs; gemm runs a one-column
    // product as a matrix-vector product), nor a last group of ResNet-20's 64-channel 7×7 and
    // 8×8 layers narrow enough for gemm's 512-deep blocks (31 samples were groups of 10, 10,
    // 10 and 1, whose last product was 49 columns wide).
    let layers = [
        ([48, 1], [48, 3, 3]),
        ([512, 1], [512, 3, 3]),
        ([320, 1], [1280, 1, 1]),
        ([64, 7], [64, 3, 3]),
        ([64, 8], [64, 3, 3]),
    ];
    for ([c_in, size], [c_out, kh, kw]) in layers {
        for batch in 2..=600 {
            let pad = (kh / 2, kw / 2);
            let g = geometry(
                [batch, c_in, size, size],
                [c_out, kh, kw],
                [1, 1],
                [pad, pad],
            );
            let widths = g.group_widths(g.group());
            for (m, k) in [(g.c_out, g.col_rows()), (g.col_rows(), g.c_out)] {
                assert!(
                    common_depth_block(m, &widths, k).is_some(),
                    "{g:?}: {widths:?}"
                );
            }
        }
    }
    // MobileNetV3's squeeze-and-excitation layers on 1×1 maps: a one-column product sums in
    // another order, so these stay one gemm per sample (grouped, they differed).
    let squeeze = geometry([50, 16, 1, 1], [576, 1, 1], [1, 1], [(0, 0), (0, 0)]);
    assert_eq!(squeeze.input_grad_group(), 1);
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    at_every_isa(|isa| {
        for g in &shapes {
            let x = values(g.batch * g.input_len(), 11);
            let w = values(g.weight_len(), 12);
            let b = values(g.c_out, 13);
            let dy = values(g.batch * g.output_len(), 14);
            for group in [3, g.group().max(2), MAX_GROUP] {
                for bias in [None, Some(&b[..])] {
                    assert_eq!(
                        bits(im2col_conv2d_forward_grouped(g, &x, &w, bias, 1)),
                        bits(im2col_conv2d_forward_grouped(g, &x, &w, bias, group)),
                        "{isa:?} {g:?}: forward in groups of {group}"
                    );
                }
                // Pointwise input gradients group only where the depth blocks agree.
                let group = if g.is_pointwise() {
                    g.input_grad_group()
                } else {
                    group
                };
                assert_eq!(
                    bits(im2col_conv2d_input_grad_grouped(g, &w, &dy, 1)),
                    bits(im2col_conv2d_input_grad_grouped(g, &w, &dy, group)),
                    "{isa:?} {g:?}: input gradient in groups of {group}"
                );
            }
        }
    });
}
