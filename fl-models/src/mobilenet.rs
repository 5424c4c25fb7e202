//! MobileNetV1, V2 and V3-Small with CIFAR-sized strides (32×32 inputs keep a useful map size).

use crate::kernels::{adaptive_avg_pool2d_forward, batch_norm_act, conv2d_forward};
use crate::kernels::{linear, relu};
use burn::module::Module;
use burn::nn::conv::Conv2d;
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig};
use burn::nn::{BatchNorm, Linear};
use burn::tensor::activation::hard_sigmoid;
use burn::tensor::{Device, Tensor};
use fl_core::layers::BlockSpec;
use fl_core::{BlockForward, Classifier, Features};

use crate::ModelKind;
use crate::common::{Dropout, block, bn, check_input, conv, fc_stack, out_size};

/// Configuration of the MobileNets ([`MobileNetConfig::init_v1`], [`MobileNetConfig::init_v2`],
/// [`MobileNetConfig::init_v3`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MobileNetConfig {
    /// Input shape `[channels, height, width]`.
    pub input_shape: [usize; 3],
    /// Number of classes.
    pub num_classes: usize,
}

pub use crate::kernels::Activation;

/// Convolution (no bias) + BatchNorm + activation.
#[derive(Module, Debug)]
pub struct ConvBnAct {
    conv: Conv2d,
    bn: BatchNorm,
    #[module(skip)]
    act: Activation,
}

impl ConvBnAct {
    /// A k×k convolution with "same"-style padding k/2.
    fn new(
        channels: [usize; 2],
        k: usize,
        stride: usize,
        groups: usize,
        act: Activation,
        device: &Device,
    ) -> Self {
        Self {
            conv: conv(channels, k, stride, k / 2, groups, false, None, device),
            bn: bn(channels[1], device),
            act,
        }
    }

    fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        batch_norm_act(&self.bn, conv2d_forward(&self.conv, x), self.act)
    }
}

/// Squeeze-and-excitation (MobileNetV3): global pool, 1×1 conv down + ReLU, 1×1 conv up +
/// hard-sigmoid, channel-wise scale.
#[derive(Module, Debug)]
pub struct SqueezeExcite {
    pool: AdaptiveAvgPool2d,
    down: Conv2d,
    up: Conv2d,
}

impl SqueezeExcite {
    fn new(channels: usize, device: &Device) -> Self {
        let squeezed = make_divisible(channels / 4);
        Self {
            pool: AdaptiveAvgPool2dConfig::new([1, 1]).init(),
            down: conv([channels, squeezed], 1, 1, 0, 1, true, None, device),
            up: conv([squeezed, channels], 1, 1, 0, 1, true, None, device),
        }
    }

    fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        let scale = relu(conv2d_forward(
            &self.down,
            adaptive_avg_pool2d_forward(&self.pool, x.clone()),
        ));
        let scale = hard_sigmoid(conv2d_forward(&self.up, scale), 1.0 / 6.0, 0.5);
        x * scale
    }
}

/// Rounds to a multiple of 8, never below 8 or 10% under `v` (the MobileNet papers' rule).
fn make_divisible(v: usize) -> usize {
    let rounded = ((v + 4) / 8 * 8).max(8);
    if (rounded as f64) < 0.9 * v as f64 {
        rounded + 8
    } else {
        rounded
    }
}

/// One MobileNet unit: an optional 1×1 expansion, a k×k depthwise convolution, optional
/// squeeze-and-excitation and a 1×1 projection, with a residual connection when the shape is
/// kept (V2/V3). A MobileNetV1 depthwise-separable unit is the same with no expansion, no
/// residual and an activated projection.
#[derive(Module, Debug)]
pub struct MobileUnit {
    expand: Option<ConvBnAct>,
    depthwise: ConvBnAct,
    se: Option<SqueezeExcite>,
    project: ConvBnAct,
    #[module(skip)]
    residual: bool,
}

impl MobileUnit {
    fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        let mut out = match &self.expand {
            Some(expand) => expand.forward(x.clone()),
            None => x.clone(),
        };
        out = self.depthwise.forward(out);
        if let Some(se) = &self.se {
            out = se.forward(out);
        }
        out = self.project.forward(out);
        if self.residual { out + x } else { out }
    }
}

/// How one unit is built.
struct UnitSpec {
    kernel: usize,
    expanded: usize,
    out: usize,
    se: bool,
    act: Activation,
    stride: usize,
}

/// A MobileNet: stem, units, an optional 1×1 head convolution, global average pooling and a
/// classifier of one or two FC layers. Built by [`MobileNetConfig::init_v1`], `init_v2` or
/// `init_v3`; its blocks are `stem`, `unit0` …, `head` (if any) and `fc1` (`fc2`).
#[derive(Module, Debug)]
pub struct MobileNet {
    stem: ConvBnAct,
    units: Vec<MobileUnit>,
    head: Option<ConvBnAct>,
    pool: AdaptiveAvgPool2d,
    fc: Vec<Linear>,
    dropout: Dropout,
    #[module(skip)]
    hidden_act: Activation,
    #[module(skip)]
    block_specs: Vec<BlockSpec>,
}

/// Parts of a MobileNet that differ between versions.
struct Recipe {
    stem: (usize, Activation),
    units: Vec<UnitSpec>,
    /// Depthwise-separable V1 units: no residual, activated projection.
    v1: bool,
    head: Option<(usize, Activation)>,
    classifier_hidden: Option<usize>,
    dropout: f64,
}

impl MobileNetConfig {
    /// MobileNetV1 (Howard et al. 2017) for 32×32 inputs, as in the common CIFAR port: stem 3×3
    /// conv 32 with stride 1, then 13 depthwise-separable units
    /// 64, 128/2, 128, 256/2, 256, 512/2, 512 ×5, 1024/2, 1024; FC 1024→C
    /// (3,217,226 parameters at 10 classes).
    pub fn init_v1(&self, device: &Device) -> MobileNet {
        let widths = [
            (64, 1),
            (128, 2),
            (128, 1),
            (256, 2),
            (256, 1),
            (512, 2),
            (512, 1),
            (512, 1),
            (512, 1),
            (512, 1),
            (512, 1),
            (1024, 2),
            (1024, 1),
        ];
        let units = widths
            .into_iter()
            .map(|(out, stride)| UnitSpec {
                kernel: 3,
                expanded: 0,
                out,
                se: false,
                act: Activation::Relu,
                stride,
            })
            .collect();
        self.build(
            ModelKind::MobilenetV1,
            Recipe {
                stem: (32, Activation::Relu),
                units,
                v1: true,
                head: None,
                classifier_hidden: None,
                dropout: 0.0,
            },
            device,
        )
    }

    /// MobileNetV2 (Sandler et al. 2018) for 32×32 inputs: stem 3×3 conv 32 with stride 1 and
    /// the second bottleneck stage at stride 1 (the CIFAR adaptation), inverted residual units
    /// (t, c, n, s) = (1,16,1,1), (6,24,2,1), (6,32,3,2), (6,64,4,2), (6,96,3,1), (6,160,3,2),
    /// (6,320,1,1), ReLU6, residual connections where the shape is kept, head 1×1 conv 1280,
    /// dropout 0.2, FC 1280→C (2,236,682 parameters at 10 classes).
    pub fn init_v2(&self, device: &Device) -> MobileNet {
        let stages = [
            (1, 16, 1, 1),
            (6, 24, 2, 1),
            (6, 32, 3, 2),
            (6, 64, 4, 2),
            (6, 96, 3, 1),
            (6, 160, 3, 2),
            (6, 320, 1, 1),
        ];
        let mut units = Vec::new();
        let mut input = 32;
        for (t, out, n, s) in stages {
            for i in 0..n {
                units.push(UnitSpec {
                    kernel: 3,
                    expanded: input * t,
                    out,
                    se: false,
                    act: Activation::Relu6,
                    stride: if i == 0 { s } else { 1 },
                });
                input = out;
            }
        }
        self.build(
            ModelKind::MobilenetV2,
            Recipe {
                stem: (32, Activation::Relu6),
                units,
                v1: false,
                head: Some((1280, Activation::Relu6)),
                classifier_hidden: None,
                dropout: 0.2,
            },
            device,
        )
    }

    /// MobileNetV3-Small (Howard et al. 2019) for 32×32 inputs: the paper's Table 2 with the
    /// stem at stride 1 instead of 2 (the only change), squeeze-and-excitation with hard-sigmoid,
    /// hard-swish, head 1×1 conv 576, classifier 576→1024 (hard-swish, dropout 0.2) →C
    /// (1,528,106 parameters at 10 classes).
    pub fn init_v3(&self, device: &Device) -> MobileNet {
        use Activation::{HardSwish as HS, Relu as RE};
        let table = [
            (3, 16, 16, true, RE, 2),
            (3, 72, 24, false, RE, 2),
            (3, 88, 24, false, RE, 1),
            (5, 96, 40, true, HS, 2),
            (5, 240, 40, true, HS, 1),
            (5, 240, 40, true, HS, 1),
            (5, 120, 48, true, HS, 1),
            (5, 144, 48, true, HS, 1),
            (5, 288, 96, true, HS, 2),
            (5, 576, 96, true, HS, 1),
            (5, 576, 96, true, HS, 1),
        ];
        let units = table
            .into_iter()
            .map(|(kernel, expanded, out, se, act, stride)| UnitSpec {
                kernel,
                expanded,
                out,
                se,
                act,
                stride,
            })
            .collect();
        self.build(
            ModelKind::MobilenetV3,
            Recipe {
                stem: (16, HS),
                units,
                v1: false,
                head: Some((576, HS)),
                classifier_hidden: Some(1024),
                dropout: 0.2,
            },
            device,
        )
    }

    fn build(&self, kind: ModelKind, recipe: Recipe, device: &Device) -> MobileNet {
        check_input(kind, self.input_shape);
        let [c, mut h, mut w] = self.input_shape;
        let (stem_width, stem_act) = recipe.stem;
        let mut specs = vec![block(
            "stem",
            &["stem".into()],
            vec![c, h, w],
            vec![stem_width, h, w],
        )];
        let (mut units, mut input) = (Vec::new(), stem_width);
        for (i, u) in recipe.units.iter().enumerate() {
            let (h2, w2) = (
                out_size(h, u.kernel, u.stride, u.kernel / 2),
                out_size(w, u.kernel, u.stride, u.kernel / 2),
            );
            specs.push(block(
                format!("unit{i}"),
                &[format!("units.{i}")],
                vec![input, h, w],
                vec![u.out, h2, w2],
            ));
            let hidden = if u.expanded == 0 { input } else { u.expanded };
            let project_act = if recipe.v1 {
                u.act
            } else {
                Activation::Identity
            };
            units.push(MobileUnit {
                expand: (hidden != input)
                    .then(|| ConvBnAct::new([input, hidden], 1, 1, 1, u.act, device)),
                depthwise: ConvBnAct::new(
                    [hidden, hidden],
                    u.kernel,
                    u.stride,
                    hidden,
                    u.act,
                    device,
                ),
                se: u.se.then(|| SqueezeExcite::new(hidden, device)),
                project: ConvBnAct::new([hidden, u.out], 1, 1, 1, project_act, device),
                residual: !recipe.v1 && u.stride == 1 && input == u.out,
            });
            (input, h, w) = (u.out, h2, w2);
        }
        let head = recipe.head.map(|(width, act)| {
            specs.push(block(
                "head",
                &["head".into()],
                vec![input, h, w],
                vec![width, h, w],
            ));
            let head = ConvBnAct::new([input, width], 1, 1, 1, act, device);
            input = width;
            head
        });
        // The globally pooled map enters the first FC block.
        let widths = [
            &[input][..],
            recipe.classifier_hidden.as_slice(),
            &[self.num_classes],
        ]
        .concat();
        let fc = fc_stack(vec![input, h, w], &widths, &mut specs, device);
        MobileNet {
            stem: ConvBnAct::new([c, stem_width], 3, 1, 1, stem_act, device),
            units,
            head,
            pool: AdaptiveAvgPool2dConfig::new([1, 1]).init(),
            fc,
            dropout: Dropout::new(recipe.dropout),
            hidden_act: recipe.stem.1,
            block_specs: specs,
        }
    }
}

impl Classifier for MobileNet {
    fn infer(&self, images: Tensor<4>) -> Tensor<2> {
        crate::common::infer_in_chunks(self, images)
    }

    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        (0..self.num_blocks())
            .fold(Features::Map(images), |x, i| self.forward_block(i, x))
            .into_flat()
    }

    fn blocks(&self) -> Vec<BlockSpec> {
        self.block_specs.clone()
    }

    /// The input of the last FC layer: the globally pooled last map when that layer is FC1.
    fn features(&self, images: Tensor<4>) -> Option<Tensor<2>> {
        let last = self.num_blocks() - 1;
        let x = (0..last).fold(Features::Map(images), |x, i| self.forward_block(i, x));
        Some(match x {
            Features::Map(map) => adaptive_avg_pool2d_forward(&self.pool, map).flatten(1, 3),
            Features::Flat(x) => x,
        })
    }

    fn head(&self, features: Tensor<2>) -> Option<Tensor<2>> {
        let last = self.num_blocks() - 1;
        Some(
            self.forward_block(last, Features::Flat(features))
                .into_flat(),
        )
    }
}

impl MobileNet {
    /// Stem, units, head (if any) and FC layers.
    fn num_blocks(&self) -> usize {
        1 + self.units.len() + usize::from(self.head.is_some()) + self.fc.len()
    }
}

impl BlockForward for MobileNet {
    fn inference_chunk(&self, images: &Tensor<4>) -> Option<usize> {
        crate::common::inference_chunk(images)
    }

    fn forward_block(&self, index: usize, x: Features) -> Features {
        // Blocks: stem, units…, head (if any), fc1 (with the global pooling), fc2…
        if index == 0 {
            return Features::Map(self.stem.forward(x.into_map()));
        }
        let mut i = index - 1;
        if let Some(unit) = self.units.get(i) {
            return Features::Map(unit.forward(x.into_map()));
        }
        i -= self.units.len();
        if let Some(head) = &self.head {
            if i == 0 {
                return Features::Map(head.forward(x.into_map()));
            }
            i -= 1;
        }
        let mut x = match x {
            Features::Map(map) if i == 0 => {
                adaptive_avg_pool2d_forward(&self.pool, map).flatten(1, 3)
            }
            x => x.into_flat(),
        };
        let last = self.fc.len() - 1;
        if i == last {
            x = self.dropout.forward(x);
        }
        x = linear(&self.fc[i], x);
        if i < last {
            x = self.hidden_act.apply(x);
        }
        Features::Flat(x)
    }
}
