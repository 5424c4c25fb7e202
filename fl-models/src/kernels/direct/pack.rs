//! The packed weight layouts of the direct kernels and the channel tile they are packed in.

use super::avx512;
use crate::kernels::cpu::Conv2dGeometry;

/// The channel tile that wastes the fewest padding channels (the larger on a tie). On AVX2, 6
/// wherever it wastes at most 4% (64, 128, 256, 512 channels): a tile of 8 runs there as two
/// register tiles of 4 channels, 8 chains for two FMA units of 4 cycles' latency, a tile of 6
/// as one of 6, 12 chains (`fl bench --kernels`, one thread, best of three: VGG-16 block 3
/// forward 56 → 71 GFLOP/s, CNN3 conv2 at 1×28×28 56 → 72 in one A/B, within the noise in a
/// second; docs/performance.md). The sums per output are the same either way.
pub(super) fn channel_tile(c_out: usize) -> usize {
    if !avx512() && 100 * c_out.next_multiple_of(6) <= 104 * c_out {
        return 6;
    }
    [8, 6, 4]
        .into_iter()
        .min_by_key(|&t| c_out.next_multiple_of(t))
        .expect("three candidates")
}

/// Weights `[c_out, K]` as `[c_out_padded / tile][K][tile]` (zeros for the padding channels),
/// so a tile's broadcasts read consecutive floats.
pub(super) fn pack_weights(weight: &[f32], c_out: usize, taps: usize, tile: usize) -> Vec<f32> {
    let mut packed = vec![0.0f32; c_out.next_multiple_of(tile) * taps];
    for co in 0..c_out {
        let (block, lane) = (co / tile, co % tile);
        for k in 0..taps {
            packed[(block * taps + k) * tile + lane] = weight[co * taps + k];
        }
    }
    packed
}

/// Weights `[c_out, c_in, kh·kw]` tiled over input channels for the input gradient:
/// `[c_in_padded / tile][kh·kw][c_out][tile]` (zeros for the padding channels), so a tap's
/// broadcasts read consecutive floats.
pub(super) fn pack_input_tiles(g: &Conv2dGeometry, weight: &[f32], tile: usize) -> Vec<f32> {
    let taps = g.kernel[0] * g.kernel[1];
    let mut packed = vec![0.0f32; g.c_in.next_multiple_of(tile) * taps * g.c_out];
    for co in 0..g.c_out {
        for ci in 0..g.c_in {
            for k in 0..taps {
                packed[(((ci / tile) * taps + k) * g.c_out + co) * tile + ci % tile] =
                    weight[(co * g.c_in + ci) * taps + k];
            }
        }
    }
    packed
}
