//! The wide layout of a stride-1 convolution (see the parent module): the padded input's
//! shape, each tap's offset into it, and which kernels run it.

use super::{LANES, gather, pack::channel_tile, rows};
use crate::kernels::cpu::Conv2dGeometry;

/// Wide output length per channel: `(oh − 1)·Wp + ow` with `Wp = ow + kw − 1`, rounded up to
/// [`LANES`].
pub(super) fn wide_len(g: &Conv2dGeometry) -> usize {
    let [oh, ow] = g.output;
    ((oh - 1) * (ow + g.kernel[1] - 1) + ow).next_multiple_of(LANES)
}

/// Whether the forward pass computes each output row's own vectors
/// ([`RowVectors`](rows::RowVectors)) instead of the wide length `len`, and a row's lanes.
fn by_rows(g: &Conv2dGeometry, len: usize) -> (bool, usize) {
    let [oh, ow] = g.output;
    let row_lanes = ow.next_multiple_of(rows::unit());
    // By rows where that computes no more lanes than the wide length (one store per vector,
    // where a wide vector's pixels may span two or three rows), or where the wide vectors
    // would span more rows than that (`rows::wide_fits`).
    let by_rows = oh * row_lanes <= len || !rows::wide_fits(ow + g.kernel[1] - 1);
    (by_rows, row_lanes)
}

/// The output lanes per channel the direct kernels' forward pass computes for `g`: each row's
/// own vectors or the wide length (what [`Wide::new`] picks, without building the layout).
pub(in crate::kernels) fn forward_lanes(g: &Conv2dGeometry) -> usize {
    let len = wide_len(g);
    match by_rows(g, len) {
        (true, row_lanes) => g.output[0] * row_lanes,
        (false, _) => len,
    }
}

/// The wide layout of one stride-1 convolution.
pub(in crate::kernels) struct Wide {
    pub(super) c_in: usize,
    /// Output channels rounded up to the channel tile.
    pub(super) c_out_padded: usize,
    /// Channels per register tile (4, 6 or 8).
    pub(super) channel_tile: usize,
    pub(super) input: [usize; 2],
    pub(super) pad_begin: [usize; 2],
    /// Padded input rows and columns that valid outputs read: `output + kernel − 1`.
    pub(in crate::kernels) padded: [usize; 2],
    pub(super) output: [usize; 2],
    /// Wide output length per channel: `(oh − 1)·Wp + ow`, rounded up to [`LANES`].
    pub(super) len: usize,
    /// Whether the forward pass computes each output row's own vectors
    /// ([`RowVectors`](rows::RowVectors)) instead of the wide length.
    pub(super) by_rows: bool,
    /// Whether the input gradient is gathered (`gather.rs`) instead of scattered.
    pub(super) gathers: bool,
    /// How far past a tap's offset any kernel reads or writes: `len`, or the end of the last
    /// row's last vector if that is further.
    pub(super) reach: usize,
    /// `offset(k)` for every tap `k = (ci, ky, kx)`, in weight order.
    pub(super) offsets: Vec<usize>,
    /// Padded input buffer length: every read `offset(k) + p`, `p < len`, is inside.
    pub(in crate::kernels) input_len: usize,
}

impl Wide {
    /// The layout of `g`.
    pub(in crate::kernels) fn new(g: &Conv2dGeometry) -> Self {
        let [kh, kw] = g.kernel;
        let [oh, ow] = g.output;
        let padded = [oh + kh - 1, ow + kw - 1];
        let len = wide_len(g);
        let plane = padded[0] * padded[1];
        let mut offsets = Vec::with_capacity(g.c_in * kh * kw);
        for ci in 0..g.c_in {
            for ky in 0..kh {
                for kx in 0..kw {
                    offsets.push(ci * plane + ky * padded[1] + kx);
                }
            }
        }
        // The scatter's lanes: the wide length, input channels in its tiles.
        let scatter_channels = g.c_in.next_multiple_of(channel_tile(g.c_in));
        let gathers = gather::worth_it(g, len, scatter_channels);
        let channel_tile = channel_tile(g.c_out);
        let wide = Wide {
            c_in: g.c_in,
            c_out_padded: g.c_out.next_multiple_of(channel_tile),
            channel_tile,
            input: g.input,
            pad_begin: g.pad_begin,
            padded,
            output: g.output,
            len,
            by_rows: false,
            gathers,
            reach: len,
            offsets,
            input_len: 0,
        };
        wide.forward_by_rows(by_rows(g, len).0)
    }

    /// This layout with its forward pass by rows or by the wide layout's vectors (see
    /// [`RowVectors`](rows::RowVectors)), and the reach and padded input length that takes.
    pub(super) fn forward_by_rows(mut self, by_rows: bool) -> Self {
        let [oh, ow] = self.output;
        let row_lanes = ow.next_multiple_of(rows::unit());
        self.by_rows = by_rows;
        self.reach = if by_rows {
            self.len.max((oh - 1) * self.padded[1] + row_lanes)
        } else {
            self.len
        };
        self.input_len = self.offsets.last().copied().unwrap_or(0) + self.reach;
        self
    }

    /// Copies one sample into the zero-padded input buffer. Writes only the sample's values:
    /// `buf` must hold zeros everywhere else, which a zeroed buffer written only by this
    /// function (for the same layout) does, so per-thread buffers are zeroed once, not per
    /// sample.
    pub(super) fn pad_input(&self, x_n: &[f32], buf: &mut [f32]) {
        let [h, w] = self.input;
        let [hp, wp] = self.padded;
        let [ph, pw] = self.pad_begin;
        let plane = hp * wp;
        if [ph, pw] == [0, 0] && [hp, wp] == [h, w] {
            // Unpadded and nothing cut off: the planes are already laid out as needed.
            let body = self.c_in * plane;
            buf[..body].copy_from_slice(&x_n[..body]);
            return;
        }
        let (rows, cols) = (hp.min(h + ph), w.min(wp.saturating_sub(pw)));
        for ci in 0..self.c_in {
            let src = &x_n[ci * h * w..(ci + 1) * h * w];
            let dst = &mut buf[ci * plane..(ci + 1) * plane];
            for r in ph..rows {
                let row = &src[(r - ph) * w..][..cols];
                dst[r * wp + pw..][..cols].copy_from_slice(row);
            }
        }
    }

    /// Copies consecutive samples (`x`, `sample_len` floats each) into `buf`, one every
    /// `input_len` floats, as [`Wide::pad_input`] does: only the values are written, so `buf`
    /// must hold zeros everywhere else (a zeroed buffer written only by this function for the
    /// same layout does, whatever the number of samples of each call).
    pub(in crate::kernels) fn pad_inputs(&self, x: &[f32], sample_len: usize, buf: &mut [f32]) {
        let count = x.len() / sample_len;
        assert!(
            count * sample_len == x.len() && buf.len() == count * self.input_len,
            "padded inputs: one slot of `input_len` floats per sample"
        );
        for (x_n, slot) in x
            .chunks_exact(sample_len)
            .zip(buf.chunks_exact_mut(self.input_len))
        {
            self.pad_input(x_n, slot);
        }
    }

    /// Spreads one sample's output gradient `[c_out, oh, ow]` into the wide layout. Like
    /// [`Wide::pad_input`], writes only the values: the extra columns, the tail and the padding
    /// channels of `buf` must already be zero.
    pub(super) fn widen(&self, dy_n: &[f32], c_out: usize, buf: &mut [f32]) {
        let [oh, ow] = self.output;
        let wp = self.padded[1];
        for co in 0..c_out {
            for oy in 0..oh {
                let src = &dy_n[(co * oh + oy) * ow..][..ow];
                buf[co * self.len + oy * wp..][..ow].copy_from_slice(src);
            }
        }
    }
}
