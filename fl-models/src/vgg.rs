//! VGG-16 with BatchNorm for small images.

use crate::kernels::{Activation, batch_norm_act, conv2d_forward, max_pool2d_forward};
use crate::kernels::{linear, relu};
use burn::module::Module;
use burn::nn::conv::Conv2d;
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{BatchNorm, Linear, LinearConfig};
use burn::tensor::{Device, Tensor};
use fl_core::layers::BlockSpec;
use fl_core::{BlockForward, Features};

use crate::ModelKind;
use crate::common::{Dropout, block, bn, check_input, conv, run_blocks};

/// Configuration of [`Vgg16`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Vgg16Config {
    /// Input shape `[channels, height, width]`.
    pub input_shape: [usize; 3],
    /// Number of classes.
    pub num_classes: usize,
}

/// VGG-16's convolution widths; `0` marks a 2×2 max-pool.
const LAYOUT: [usize; 18] = [
    64, 64, 0, 128, 128, 0, 256, 256, 256, 0, 512, 512, 512, 0, 512, 512, 512, 0,
];

/// One 3×3 convolution + BatchNorm + ReLU, optionally followed by a 2×2 max-pool.
#[derive(Module, Debug)]
pub struct ConvBnUnit {
    conv: Conv2d,
    bn: BatchNorm,
    #[module(skip)]
    pool: bool,
}

/// VGG-16 with BatchNorm for 32×32 inputs: 13 conv 3×3 + BN + ReLU layers
/// (64, 64, M, 128, 128, M, 256 ×3, M, 512 ×3, M, 512 ×3, M) and the classifier
/// 512 → 4096 → 4096 → C with ReLU and dropout 0.5 after each hidden layer
/// (33,646,666 parameters at 10 classes). For inputs smaller than 32×32 (e.g. 28×28), a
/// max-pool that would shrink a 1×1 map is skipped, so the classifier still sees 512 features.
///
/// Blocks: `conv0` … `conv12` (each with its pool), `fc1`, `fc2`, `fc3`.
#[derive(Module, Debug)]
pub struct Vgg16 {
    features: Vec<ConvBnUnit>,
    pool: MaxPool2d,
    fc1: Linear,
    fc2: Linear,
    fc3: Linear,
    dropout: Dropout,
    #[module(skip)]
    block_specs: Vec<BlockSpec>,
}

impl Vgg16Config {
    /// Builds the model on `device` (weights drawn from the device's RNG: seed it first).
    pub fn init(&self, device: &Device) -> Vgg16 {
        check_input(ModelKind::Vgg16, self.input_shape);
        let [c, mut h, mut w] = self.input_shape;
        let (mut features, mut specs, mut input) = (Vec::new(), Vec::new(), c);
        let widths: Vec<(usize, bool)> = LAYOUT
            .iter()
            .enumerate()
            .filter(|&(_, &width)| width > 0)
            .map(|(i, &width)| (width, LAYOUT.get(i + 1) == Some(&0)))
            .collect();
        for (i, (width, pool)) in widths.into_iter().enumerate() {
            let pool = pool && h >= 2 && w >= 2;
            let (h2, w2) = if pool { (h / 2, w / 2) } else { (h, w) };
            let shape_out = if i == 12 {
                vec![width * h2 * w2]
            } else {
                vec![width, h2, w2]
            };
            specs.push(block(
                format!("conv{i}"),
                &[format!("features.{i}")],
                vec![input, h, w],
                shape_out,
            ));
            features.push(ConvBnUnit {
                conv: conv([input, width], 3, 1, 1, 1, true, None, device),
                bn: bn(width, device),
                pool,
            });
            (input, h, w) = (width, h2, w2);
        }
        let flat = input * h * w;
        specs.push(block("fc1", &["fc1".into()], vec![flat], vec![4096]));
        specs.push(block("fc2", &["fc2".into()], vec![4096], vec![4096]));
        specs.push(block(
            "fc3",
            &["fc3".into()],
            vec![4096],
            vec![self.num_classes],
        ));
        Vgg16 {
            features,
            pool: MaxPool2dConfig::new([2, 2]).with_strides([2, 2]).init(),
            fc1: LinearConfig::new(flat, 4096).init(device),
            fc2: LinearConfig::new(4096, 4096).init(device),
            fc3: LinearConfig::new(4096, self.num_classes).init(device),
            dropout: Dropout::new(0.5),
            block_specs: specs,
        }
    }
}

classifier_from_parts!(Vgg16);

impl Vgg16 {
    /// Everything up to FC3's input.
    fn represent(&self, images: Tensor<4>) -> Tensor<2> {
        let last = self.block_specs.len() - 1;
        run_blocks(self, 0..last, Features::Map(images)).into_flat()
    }

    /// FC3.
    fn classify(&self, features: Tensor<2>) -> Tensor<2> {
        linear(&self.fc3, features)
    }
}

impl BlockForward for Vgg16 {
    fn inference_chunk(&self, images: &Tensor<4>) -> Option<usize> {
        crate::common::inference_chunk(images)
    }

    /// Blocks `conv0` … `conv12` (the last one flattens its map), `fc1`, `fc2`, `fc3`.
    fn forward_block(&self, index: usize, x: Features) -> Features {
        if let Some(unit) = self.features.get(index) {
            let conv = conv2d_forward(&unit.conv, x.into_map());
            let mut x = batch_norm_act(&unit.bn, conv, Activation::Relu);
            if unit.pool {
                x = max_pool2d_forward(&self.pool, x);
            }
            return if index + 1 == self.features.len() {
                Features::Flat(x.flatten(1, 3))
            } else {
                Features::Map(x)
            };
        }
        let x = x.into_flat();
        Features::Flat(match index - self.features.len() {
            0 => self.dropout.forward(relu(linear(&self.fc1, x))),
            1 => self.dropout.forward(relu(linear(&self.fc2, x))),
            _ => self.classify(x),
        })
    }
}
