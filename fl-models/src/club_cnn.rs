//! pFedClub's custom CNNs (CNN1–CNN4), as one configurable stack of conv and FC layers.

use crate::kernels::{Activation, batch_norm_act, conv2d_forward, max_pool2d_forward};
use crate::kernels::{linear, relu};
use burn::module::Module;
use burn::nn::conv::Conv2d;
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{BatchNorm, Linear};
use burn::tensor::{Device, Tensor};
use fl_core::layers::BlockSpec;
use fl_core::{BlockForward, Classifier, Features};

use crate::common::{Dropout, block, bn, conv, fc_stack};

/// One convolution layer of a [`StackedCnn`]: k×k conv with padding k/2 ("same", so every
/// preset builds for 1×28×28 and 3×32×32 inputs), optional BatchNorm, ReLU, optional 2×2
/// max-pool, optional dropout.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ConvLayerSpec {
    /// Output channels.
    pub channels: usize,
    /// Kernel size (square).
    pub kernel: usize,
    /// BatchNorm after the convolution.
    pub batch_norm: bool,
    /// 2×2 max-pool after the activation.
    pub pool: bool,
    /// Dropout after the layer (CNN4's Conv4).
    #[serde(default)]
    pub dropout: bool,
}

/// Configuration of a [`StackedCnn`]; [`StackedCnnConfig::cnn1`] … `cnn4` are pFedClub's models.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StackedCnnConfig {
    /// Input shape `[channels, height, width]`.
    pub input_shape: [usize; 3],
    /// Number of classes.
    pub num_classes: usize,
    /// The convolution layers, in order.
    pub convs: Vec<ConvLayerSpec>,
    /// Widths of the hidden FC layers (FC1 … FC(n−1)); the last FC maps to the classes.
    pub hidden: Vec<usize>,
    /// Dropout probability after FC1 (per mille, so the config stays `Eq`).
    pub dropout_per_mille: u16,
}

/// pFedClub Appendix B gives CNN1–CNN4's kernel sizes, pools, BatchNorm and dropout positions
/// but not the widths; these are ours (documented in the README): conv widths 32 → 64 → 128 →
/// 256, FC widths 512 → 256 → 128, dropout 0.5.
fn layer(channels: usize, kernel: usize, batch_norm: bool, pool: bool) -> ConvLayerSpec {
    ConvLayerSpec {
        channels,
        kernel,
        batch_norm,
        pool,
        dropout: false,
    }
}

impl StackedCnnConfig {
    /// CNN1: Conv1 5×5 32 + pool, Conv2 5×5 64 + pool, FC1 512, dropout 0.5, FC2 C.
    pub fn cnn1(input_shape: [usize; 3], num_classes: usize) -> Self {
        Self {
            input_shape,
            num_classes,
            convs: vec![layer(32, 5, false, true), layer(64, 5, false, true)],
            hidden: vec![512],
            dropout_per_mille: 500,
        }
    }

    /// CNN2: CNN1 with a third convolution before FC1, Conv3 5×5 128 (no pool).
    pub fn cnn2(input_shape: [usize; 3], num_classes: usize) -> Self {
        let mut cfg = Self::cnn1(input_shape, num_classes);
        cfg.convs.push(layer(128, 5, false, false));
        cfg
    }

    /// CNN3: five 5×5 convolutions with pools after Conv1, Conv2 and Conv4 (32 + pool,
    /// 64 + pool, 128, 128 + pool, 256), FC1 512 (dropout 0.5), FC2 256, FC3 128, FC4 C.
    pub fn cnn3(input_shape: [usize; 3], num_classes: usize) -> Self {
        Self {
            input_shape,
            num_classes,
            convs: vec![
                layer(32, 5, false, true),
                layer(64, 5, false, true),
                layer(128, 5, false, false),
                layer(128, 5, false, true),
                layer(256, 5, false, false),
            ],
            hidden: vec![512, 256, 128],
            dropout_per_mille: 500,
        }
    }

    /// CNN4: six convolutions, kernels 5, 3, 3, 5, 3, 3, BatchNorm in Conv1, Conv3 and Conv5,
    /// pools after Conv2, Conv4 and Conv6, dropout after Conv4 (32 BN, 32 + pool, 64 BN,
    /// 64 + pool + dropout, 128 BN, 128 + pool), FC1 512 (dropout 0.5), FC2 256, FC3 128, FC4 C.
    pub fn cnn4(input_shape: [usize; 3], num_classes: usize) -> Self {
        Self {
            input_shape,
            num_classes,
            convs: vec![
                layer(32, 5, true, false),
                layer(32, 3, false, true),
                layer(64, 3, true, false),
                ConvLayerSpec {
                    dropout: true,
                    ..layer(64, 5, false, true)
                },
                layer(128, 3, true, false),
                layer(128, 3, false, true),
            ],
            hidden: vec![512, 256, 128],
            dropout_per_mille: 500,
        }
    }

    /// Replaces the convolution widths (one per layer), e.g. to scale a model down.
    pub fn with_conv_widths(mut self, widths: &[usize]) -> Self {
        assert_eq!(widths.len(), self.convs.len(), "one width per convolution");
        for (layer, &w) in self.convs.iter_mut().zip(widths) {
            layer.channels = w;
        }
        self
    }

    /// Replaces the hidden FC widths.
    pub fn with_hidden(mut self, hidden: Vec<usize>) -> Self {
        self.hidden = hidden;
        self
    }

    /// Every convolution and hidden FC layer `rate` times as wide (rounded up, as HeteroFL
    /// slices its sub-models); the input and the classes stay.
    pub fn scaled(self, rate: f64) -> Self {
        let scale = |w: usize| ((rate * w as f64).ceil() as usize).max(1);
        let widths: Vec<usize> = self.convs.iter().map(|l| scale(l.channels)).collect();
        let hidden = self.hidden.iter().map(|&h| scale(h)).collect();
        self.with_conv_widths(&widths).with_hidden(hidden)
    }

    /// Builds the model on `device` (weights drawn from the device's RNG: seed it first).
    ///
    /// # Panics
    /// If the pools shrink the input below 1×1 or a width is zero.
    pub fn init(&self, device: &Device) -> StackedCnn {
        let [c, mut h, mut w] = self.input_shape;
        let (mut convs, mut specs, mut input) = (Vec::new(), Vec::new(), c);
        for (i, l) in self.convs.iter().enumerate() {
            assert!(l.channels > 0 && l.kernel % 2 == 1, "bad conv layer {l:?}");
            let (h2, w2) = if l.pool { (h / 2, w / 2) } else { (h, w) };
            assert!(
                h2 > 0 && w2 > 0,
                "input {:?} is too small for {} pools",
                self.input_shape,
                self.convs.iter().filter(|l| l.pool).count()
            );
            let out_shape = vec![l.channels, h2, w2];
            specs.push(block(
                format!("conv{}", i + 1),
                &[format!("convs.{i}")],
                vec![input, h, w],
                out_shape,
            ));
            convs.push(ConvLayer {
                conv: conv(
                    [input, l.channels],
                    l.kernel,
                    1,
                    l.kernel / 2,
                    1,
                    true,
                    None,
                    device,
                ),
                bn: l.batch_norm.then(|| bn(l.channels, device)),
                pool: l.pool,
                dropout: l.dropout,
            });
            (input, h, w) = (l.channels, h2, w2);
        }
        let widths = [&[input * h * w][..], &self.hidden, &[self.num_classes]].concat();
        let fc = fc_stack(vec![input, h, w], &widths, &mut specs, device);
        StackedCnn {
            convs,
            pool: MaxPool2dConfig::new([2, 2]).with_strides([2, 2]).init(),
            fc,
            dropout: Dropout::new(f64::from(self.dropout_per_mille) / 1000.0),
            block_specs: specs,
            scaler: 1.0,
        }
    }
}

/// One convolution layer of a [`StackedCnn`].
#[derive(Module, Debug)]
pub struct ConvLayer {
    conv: Conv2d,
    bn: Option<BatchNorm>,
    #[module(skip)]
    pool: bool,
    #[module(skip)]
    dropout: bool,
}

/// A plain CNN: conv layers (conv, optional BN, ReLU, optional pool), then FC layers with ReLU
/// and dropout after FC1. pFedClub's CNN1–CNN4 are presets of [`StackedCnnConfig`].
///
/// Blocks: `conv1` …, `fc1` … (one per layer, as pFedClub decomposes them).
#[derive(Module, Debug)]
pub struct StackedCnn {
    convs: Vec<ConvLayer>,
    pool: MaxPool2d,
    fc: Vec<Linear>,
    dropout: Dropout,
    #[module(skip)]
    block_specs: Vec<BlockSpec>,
    /// HeteroFL's scaler: hidden outputs are divided by this rate while training (1: none).
    #[module(skip)]
    scaler: f64,
}

impl StackedCnn {
    /// The model with HeteroFL's scaler for a sub-model of width `rate`: while training, every
    /// convolution's and hidden FC layer's output is divided by `rate`, so that sub-models of
    /// different widths produce activations of the full model's scale.
    pub fn with_scaler(mut self, rate: f64) -> Self {
        self.scaler = rate;
        self
    }

    fn scale<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let training = x.device().is_autodiff() && self.dropout.training.is_enabled();
        if self.scaler == 1.0 || !training {
            return x;
        }
        x.div_scalar(self.scaler)
    }
}

impl Classifier for StackedCnn {
    fn infer(&self, images: Tensor<4>) -> Tensor<2> {
        crate::common::infer_in_chunks(self, images)
    }

    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let blocks = self.convs.len() + self.fc.len();
        (0..blocks)
            .fold(Features::Map(images), |x, i| self.forward_block(i, x))
            .into_flat()
    }

    fn blocks(&self) -> Vec<BlockSpec> {
        self.block_specs.clone()
    }

    /// The input of the last FC layer (a flattened map when there is only one FC layer).
    fn features(&self, images: Tensor<4>) -> Option<Tensor<2>> {
        let last = self.convs.len() + self.fc.len() - 1;
        let x = (0..last).fold(Features::Map(images), |x, i| self.forward_block(i, x));
        Some(x.into_flat())
    }

    fn head(&self, features: Tensor<2>) -> Option<Tensor<2>> {
        let last = self.convs.len() + self.fc.len() - 1;
        Some(
            self.forward_block(last, Features::Flat(features))
                .into_flat(),
        )
    }
}

impl BlockForward for StackedCnn {
    fn inference_chunk(&self, images: &Tensor<4>) -> Option<usize> {
        crate::common::inference_chunk(images)
    }

    fn forward_block(&self, index: usize, x: Features) -> Features {
        if let Some(layer) = self.convs.get(index) {
            let mut x = self.scale(conv2d_forward(&layer.conv, x.into_map()));
            x = match (&layer.bn, layer.pool) {
                (Some(bn), pool) => {
                    let x = batch_norm_act(bn, x, Activation::Relu);
                    if pool {
                        max_pool2d_forward(&self.pool, x)
                    } else {
                        x
                    }
                }
                // ReLU and max-pool commute, bit for bit both ways: pooling first leaves the
                // ReLU a quarter of the values.
                (None, true) => relu(max_pool2d_forward(&self.pool, x)),
                (None, false) => relu(x),
            };
            if layer.dropout {
                x = self.dropout.forward(x);
            }
            return Features::Map(x);
        }
        let i = index - self.convs.len();
        let last = self.fc.len() - 1;
        let mut x = linear(&self.fc[i], x.into_flat());
        if i < last {
            x = relu(self.scale(x));
        }
        if i == 0 && last > 0 {
            x = self.dropout.forward(x);
        }
        Features::Flat(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (kernel, BatchNorm, pool, dropout) of each convolution, and the FC count.
    fn layout(cfg: StackedCnnConfig) -> (Vec<(usize, bool, bool, bool)>, usize) {
        let convs = cfg
            .convs
            .iter()
            .map(|l| (l.kernel, l.batch_norm, l.pool, l.dropout))
            .collect();
        (convs, cfg.hidden.len() + 1)
    }

    #[test]
    fn presets_follow_appendix_b() {
        let s = [3, 32, 32];
        let (f, t) = (false, true);
        let plain = |k, pool| (k, f, pool, f);
        assert_eq!(
            layout(StackedCnnConfig::cnn1(s, 10)),
            (vec![plain(5, t), plain(5, t)], 2)
        );
        assert_eq!(
            layout(StackedCnnConfig::cnn2(s, 10)),
            (vec![plain(5, t), plain(5, t), plain(5, f)], 2)
        );
        // CNN3: all kernels 5×5, pools after convs 1, 2 and 4.
        assert_eq!(
            layout(StackedCnnConfig::cnn3(s, 10)),
            (
                vec![
                    plain(5, t),
                    plain(5, t),
                    plain(5, f),
                    plain(5, t),
                    plain(5, f)
                ],
                4
            )
        );
        // CNN4: kernels 5, 3, 3, 5, 3, 3; BatchNorm in 1, 3, 5; pools after 2, 4, 6; dropout
        // after 4.
        assert_eq!(
            layout(StackedCnnConfig::cnn4(s, 10)),
            (
                vec![
                    (5, t, f, f),
                    (3, f, t, f),
                    (3, t, f, f),
                    (5, f, t, t),
                    (3, t, f, f),
                    (3, f, t, f)
                ],
                4
            )
        );
    }
}
