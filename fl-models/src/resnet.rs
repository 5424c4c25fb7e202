//! ResNet-20 as published (He et al. 2016) and as the FedMR authors ran it.

use crate::kernels::{
    Activation, adaptive_avg_pool2d_forward, batch_norm_act, batch_norm_forward, conv2d_forward,
    max_pool2d_forward,
};
use crate::kernels::{add, add_relu};
use burn::module::Module;
use burn::nn::conv::Conv2d;
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig, MaxPool2dConfig};
use burn::nn::{BatchNorm, Initializer, Linear, LinearConfig};
use burn::tensor::{Device, Tensor};
use fl_core::layers::BlockSpec;
use fl_core::{BlockForward, Features};

use crate::ModelKind;
use crate::common::{block, bn, check_input, conv, out_size};

/// Configuration of [`ResNet20`] and [`ResNet20Ref`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ResNetConfig {
    /// Input shape `[channels, height, width]`.
    pub input_shape: [usize; 3],
    /// Number of classes.
    pub num_classes: usize,
}

/// One residual unit of [`ResNet20`]: two 3×3 conv + BN, option-A shortcut.
#[derive(Module, Debug)]
pub struct BasicBlock {
    conv1: Conv2d,
    bn1: BatchNorm,
    conv2: Conv2d,
    bn2: BatchNorm,
    /// Zero channels added on each side of a downsampled shortcut (option A).
    #[module(skip)]
    pad_channels: usize,
    #[module(skip)]
    stride: usize,
}

impl BasicBlock {
    fn new(input: usize, planes: usize, stride: usize, device: &Device) -> Self {
        Self {
            conv1: conv([input, planes], 3, stride, 1, 1, false, None, device),
            bn1: bn(planes, device),
            conv2: conv([planes, planes], 3, 1, 1, 1, false, None, device),
            bn2: bn(planes, device),
            pad_channels: (planes - input) / 2,
            stride,
        }
    }

    fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        let out = conv2d_forward(&self.conv1, x.clone());
        let out = batch_norm_act(&self.bn1, out, Activation::Relu);
        let out = batch_norm_forward(&self.bn2, conv2d_forward(&self.conv2, out));
        add_relu(out, self.shortcut(x))
    }

    /// Option A: subsample spatially (`x[:, :, ::s, ::s]`) and zero-pad the new channels, so the
    /// shortcut has no parameters.
    fn shortcut(&self, x: Tensor<4>) -> Tensor<4> {
        if self.stride == 1 && self.pad_channels == 0 {
            return x;
        }
        let x = max_pool2d_forward(
            &MaxPool2dConfig::new([1, 1])
                .with_strides([self.stride, self.stride])
                .init(),
            x,
        );
        let [n, _, h, w] = x.dims();
        let zeros = Tensor::<4>::zeros([n, self.pad_channels, h, w], &x.device());
        Tensor::cat(vec![zeros.clone(), x, zeros], 1)
    }
}

/// The standard CIFAR ResNet-20 (He et al. 2016, §4.2): a 3×3 stem with 16 channels, three
/// stages of three [`BasicBlock`]s with 16/32/64 channels (stride 2 at the start of stages 2
/// and 3), BatchNorm, parameter-free option-A shortcuts, global average pooling and one FC layer:
/// 269,722 parameters at 10 classes. Weights use PyTorch's default initialisation.
///
/// Blocks: `stem`, `unit0` … `unit8`, `head`.
#[derive(Module, Debug)]
pub struct ResNet20 {
    stem_conv: Conv2d,
    stem_bn: BatchNorm,
    units: Vec<BasicBlock>,
    pool: AdaptiveAvgPool2d,
    fc: Linear,
    #[module(skip)]
    block_specs: Vec<BlockSpec>,
}

impl ResNetConfig {
    /// Builds [`ResNet20`] on `device` (weights drawn from the device's RNG: seed it first).
    pub fn init_resnet20(&self, device: &Device) -> ResNet20 {
        check_input(ModelKind::Resnet20, self.input_shape);
        let [c, h, w] = self.input_shape;
        let mut specs = vec![block(
            "stem",
            &["stem_conv".into(), "stem_bn".into()],
            vec![c, h, w],
            vec![16, h, w],
        )];
        let (units, [_, h, w]) = stages([16, h, w], 3, 1, &mut specs, |input, planes, stride| {
            BasicBlock::new(input, planes, stride, device)
        });
        specs.push(block(
            "head",
            &["fc".into()],
            vec![64, h, w],
            vec![self.num_classes],
        ));
        ResNet20 {
            stem_conv: conv([c, 16], 3, 1, 1, 1, false, None, device),
            stem_bn: bn(16, device),
            units,
            pool: AdaptiveAvgPool2dConfig::new([1, 1]).init(),
            fc: LinearConfig::new(64, self.num_classes).init(device),
            block_specs: specs,
        }
    }

    /// Builds [`ResNet20Ref`] on `device` (weights drawn from the device's RNG: seed it first).
    pub fn init_resnet20_ref(&self, device: &Device) -> ResNet20Ref {
        check_input(ModelKind::Resnet20Ref, self.input_shape);
        let [c, h, w] = self.input_shape;
        let mut specs = vec![block(
            "stem",
            &["stem_conv".into()],
            vec![c, h, w],
            vec![16, h, w],
        )];
        let (units, [input, h, w]) =
            stages([16, h, w], 2, 4, &mut specs, |input, planes, stride| {
                PreActBottleneck::new(input, planes, stride, device)
            });
        specs.push(block(
            "head",
            &["final_bn".into(), "fc".into()],
            vec![input, h, w],
            vec![self.num_classes],
        ));
        ResNet20Ref {
            stem_conv: conv([c, 16], 3, 1, 1, 1, false, Some(ref_init(3, 16)), device),
            units,
            final_bn: ref_bn(input, device),
            pool: AdaptiveAvgPool2dConfig::new([1, 1]).init(),
            fc: LinearConfig::new(input, self.num_classes).init(device),
            block_specs: specs,
        }
    }
}

/// The three stages shared by both ResNet-20s: 16/32/64 planes, `per_stage` units each, stride 2
/// at the start of stages 2 and 3, `expansion` output channels per plane. Declares one block per
/// unit (`unitN` = `units.N`) and returns the units with the output shape `[c, h, w]`.
fn stages<U>(
    [mut input, mut h, mut w]: [usize; 3],
    per_stage: usize,
    expansion: usize,
    specs: &mut Vec<BlockSpec>,
    mut unit: impl FnMut(usize, usize, usize) -> U,
) -> (Vec<U>, [usize; 3]) {
    let mut units = Vec::new();
    for (stage, planes) in [16, 32, 64].into_iter().enumerate() {
        for i in 0..per_stage {
            let stride = if stage > 0 && i == 0 { 2 } else { 1 };
            let (h2, w2) = (out_size(h, 3, stride, 1), out_size(w, 3, stride, 1));
            let out = planes * expansion;
            let index = units.len();
            specs.push(block(
                format!("unit{index}"),
                &[format!("units.{index}")],
                vec![input, h, w],
                vec![out, h2, w2],
            ));
            units.push(unit(input, planes, stride));
            (input, h, w) = (out, h2, w2);
        }
    }
    (units, [input, h, w])
}

classifier_from_parts!(ResNet20, pooled);

impl BlockForward for ResNet20 {
    fn inference_chunk(&self, images: &Tensor<4>) -> Option<usize> {
        crate::common::inference_chunk(images)
    }

    /// Blocks `stem`, one per unit, and `head` (global pooling and the FC layer).
    fn forward_block(&self, index: usize, x: Features) -> Features {
        if index == 0 {
            let stem = conv2d_forward(&self.stem_conv, x.into_map());
            return Features::Map(batch_norm_act(&self.stem_bn, stem, Activation::Relu));
        }
        match self.units.get(index - 1) {
            Some(unit) => Features::Map(unit.forward(x.into_map())),
            None => Features::Flat(
                self.classify(adaptive_avg_pool2d_forward(&self.pool, x.into_map()).flatten(1, 3)),
            ),
        }
    }
}

/// The FedMR authors' conv initialisation: N(0, √(2 / (k²·out))).
fn ref_init(k: usize, out: usize) -> Initializer {
    Initializer::Normal {
        mean: 0.0,
        std: (2.0 / (k * k * out) as f64).sqrt(),
    }
}

/// A BatchNorm with the FedMR authors' initialisation (weight 0.5, bias 0).
fn ref_bn(n: usize, device: &Device) -> BatchNorm {
    let mut norm = bn(n, device);
    norm.gamma = Initializer::Constant { value: 0.5 }.init([n], device);
    norm
}

/// One pre-activation bottleneck unit of [`ResNet20Ref`] (expansion 4).
#[derive(Module, Debug)]
pub struct PreActBottleneck {
    bn1: BatchNorm,
    conv1: Conv2d,
    bn2: BatchNorm,
    conv2: Conv2d,
    bn3: BatchNorm,
    conv3: Conv2d,
    /// 1×1 strided convolution when the shape changes.
    shortcut: Option<Conv2d>,
}

impl PreActBottleneck {
    fn new(input: usize, planes: usize, stride: usize, device: &Device) -> Self {
        let out = planes * 4;
        Self {
            bn1: ref_bn(input, device),
            conv1: conv(
                [input, planes],
                1,
                1,
                0,
                1,
                false,
                Some(ref_init(1, planes)),
                device,
            ),
            bn2: ref_bn(planes, device),
            conv2: conv(
                [planes, planes],
                3,
                stride,
                1,
                1,
                false,
                Some(ref_init(3, planes)),
                device,
            ),
            bn3: ref_bn(planes, device),
            conv3: conv(
                [planes, out],
                1,
                1,
                0,
                1,
                false,
                Some(ref_init(1, out)),
                device,
            ),
            shortcut: (stride != 1 || input != out).then(|| {
                conv(
                    [input, out],
                    1,
                    stride,
                    0,
                    1,
                    false,
                    Some(ref_init(1, out)),
                    device,
                )
            }),
        }
    }

    fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        let pre = batch_norm_act(&self.bn1, x.clone(), Activation::Relu);
        // Pre-activation: the projection shortcut sees the normalised input, identity sees x.
        let shortcut = match &self.shortcut {
            Some(proj) => conv2d_forward(proj, pre.clone()),
            None => x,
        };
        let out = conv2d_forward(&self.conv1, pre);
        let out = conv2d_forward(
            &self.conv2,
            batch_norm_act(&self.bn2, out, Activation::Relu),
        );
        let out = conv2d_forward(
            &self.conv3,
            batch_norm_act(&self.bn3, out, Activation::Relu),
        );
        add(out, shortcut)
    }
}

/// ResNet-20 as in the FedMR authors' code (what their ResNet-20 numbers were measured with):
/// pre-activation bottleneck units (expansion 4) in three stages of two units with 16/32/64
/// planes, a stem 3×3 convolution without BatchNorm, 1×1 strided convolution shortcuts, global
/// average pooling and FC 256→C. Their model also owns a final BatchNorm(256) that its forward
/// pass never uses; it is kept (it is part of their state, and FedMR shuffles it), giving
/// 219,482 trainable parameters at 10 classes. Initialisation as theirs: convolutions
/// N(0, √(2/(k²·out))), BatchNorm weight 0.5.
///
/// Blocks: `stem`, `unit0` … `unit5`, `head` (final BN and FC).
#[derive(Module, Debug)]
pub struct ResNet20Ref {
    stem_conv: Conv2d,
    units: Vec<PreActBottleneck>,
    final_bn: BatchNorm,
    pool: AdaptiveAvgPool2d,
    fc: Linear,
    #[module(skip)]
    block_specs: Vec<BlockSpec>,
}

classifier_from_parts!(ResNet20Ref, pooled);

impl BlockForward for ResNet20Ref {
    fn inference_chunk(&self, images: &Tensor<4>) -> Option<usize> {
        crate::common::inference_chunk(images)
    }

    /// Blocks `stem`, one per unit, and `head` (global pooling and the FC layer).
    fn forward_block(&self, index: usize, x: Features) -> Features {
        if index == 0 {
            return Features::Map(conv2d_forward(&self.stem_conv, x.into_map()));
        }
        match self.units.get(index - 1) {
            Some(unit) => Features::Map(unit.forward(x.into_map())),
            None => Features::Flat(
                self.classify(adaptive_avg_pool2d_forward(&self.pool, x.into_map()).flatten(1, 3)),
            ),
        }
    }
}
