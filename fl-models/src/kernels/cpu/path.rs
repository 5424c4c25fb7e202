//! Which kernels run a convolution: the one choice the entry points in `mod.rs` make and
//! `fl bench --kernels` prints.

use super::{Conv2dGeometry, direct_wgrad, lanes, narrow, sample_wgrad, single_pixel, strided};

/// The kernels that run a convolution's forward pass and input gradient.
pub(super) enum PassPath {
    /// Vectorised across samples (`lanes.rs`), in the order of the path it replaces.
    AcrossSamples(lanes::Order),
    /// The direct kernels (`direct.rs`, AVX-512 or AVX2).
    Direct,
    /// Stride 2 straight from the planes (`strided.rs`), in the im2col path's order.
    Strided,
    /// im2col + gemm.
    Im2col,
}

impl PassPath {
    /// The path of `g`'s forward pass with `bias`.
    pub(super) fn forward(g: &Conv2dGeometry, bias: Option<&[f32]>) -> Self {
        if lanes::forward_stays_direct(g) {
            return Self::replaced(g);
        }
        Self::across_samples_or_replaced(g, bias)
    }

    /// The path of `g`'s input gradient.
    pub(super) fn input_grad(g: &Conv2dGeometry) -> Self {
        Self::across_samples_or_replaced(g, None)
    }

    /// The kernel across samples where it takes `g` (with `bias`), else the path it replaces.
    fn across_samples_or_replaced(g: &Conv2dGeometry, bias: Option<&[f32]>) -> Self {
        if g.batch > 0
            && g.input_len() > 0
            && let Some(order) = lanes::Order::for_geometry(g, bias)
        {
            return Self::AcrossSamples(order);
        }
        Self::replaced(g)
    }

    /// The path the kernel across samples replaces for `g` (it runs a batch's last few samples
    /// there, `lanes::split`).
    pub(super) fn replaced(g: &Conv2dGeometry) -> Self {
        if g.batch > 0 && g.input_len() > 0 && crate::kernels::direct::applies(g) {
            Self::Direct
        } else if g.input_len() > 0 && strided::applies(g) {
            Self::Strided
        } else {
            Self::Im2col
        }
    }

    /// [`name`](Self::name), and for the kernel across samples the path of the batch's last
    /// few samples where it leaves them to the one it replaces (`lanes::split`): on small maps
    /// with many weights those can take longer than the rest of the batch (gemm packs all of
    /// a layer's weights for them; on VGG-16's 1×1 maps they took most of the layer's time,
    /// which is why those maps now keep every sample across samples).
    fn label(&self, g: &Conv2dGeometry) -> String {
        if let Self::AcrossSamples(order) = self
            && let (_, Some(tail)) = lanes::split(g, *order)
        {
            let replaced = Self::replaced(&tail).name();
            return format!("{} (the last {}: {replaced})", self.name(), tail.batch);
        }
        self.name().to_string()
    }

    fn name(&self) -> &'static str {
        match self {
            Self::AcrossSamples(_) => "across samples",
            Self::Direct => "direct",
            Self::Strided => "stride 2 from the planes",
            Self::Im2col => "im2col + gemm",
        }
    }
}

/// The kernels that run a convolution's weight gradient.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WeightGradPath {
    /// The direct kernels' sums without their zero products (`direct_wgrad.rs`).
    DirectWithoutZeros,
    /// The direct kernels (AVX-512 or AVX2).
    Direct,
    /// The small-map kernel (`narrow.rs`), in gemm's order.
    SmallMap,
    /// The im2col path's sums without its column matrix (`sample_wgrad.rs`).
    WithoutColumns,
    /// One output pixel: the im2col path's sums per channel (`single_pixel.rs`).
    SinglePixel,
    /// Stride 2 from the planes (`strided.rs`), in the im2col path's order.
    Strided,
    /// im2col + one gemm per sample.
    Im2col,
}

impl WeightGradPath {
    pub(super) fn of(g: &Conv2dGeometry) -> Self {
        if direct_wgrad::applies(g) {
            Self::DirectWithoutZeros
        } else if crate::kernels::direct::applies(g) {
            Self::Direct
        } else if narrow::applies(g) {
            Self::SmallMap
        } else if sample_wgrad::applies(g) {
            Self::WithoutColumns
        } else if single_pixel::applies(g) {
            Self::SinglePixel
        } else if strided::weight_grad_applies(g) {
            Self::Strided
        } else {
            Self::Im2col
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Self::DirectWithoutZeros => "direct without zero products",
            Self::Direct => "direct",
            Self::SmallMap => "small-map",
            Self::WithoutColumns => "im2col's sums without the column matrix",
            Self::SinglePixel => "one pixel: im2col's sums per channel",
            Self::Strided => "stride 2 from the planes",
            Self::Im2col => "im2col + gemm",
        }
    }
}

/// The names of the kernels that run `g`'s forward pass, input gradient and weight gradient
/// (`fl bench --kernels`): the same choice the entry points make.
pub(crate) fn kernel_paths(g: &Conv2dGeometry) -> [String; 3] {
    [
        PassPath::forward(g, None).label(g),
        PassPath::input_grad(g).label(g),
        WeightGradPath::of(g).name().to_string(),
    ]
}
