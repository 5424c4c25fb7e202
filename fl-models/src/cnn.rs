use crate::kernels::{conv2d_forward, max_pool2d_forward};
use crate::kernels::{linear, relu};
use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Tensor};
use fl_core::layers::BlockSpec;
use fl_core::{BlockForward, Features};

use crate::ModelKind;
use crate::common::{check_input, run_blocks};

/// Configuration of [`Cnn`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CnnConfig {
    /// Input shape `[channels, height, width]`: `[1, 28, 28]` or `[3, 32, 32]` as in the papers.
    pub input_shape: [usize; 3],
    /// Number of classes.
    pub num_classes: usize,
}

/// The CNN of the FedMR/FedCross authors' code.
///
/// - 1 channel (MNIST-like, 28×28): Conv 1→16 k5, max-pool 2, ReLU, Conv 16→32 k5, max-pool 2,
///   ReLU, FC 512→256, ReLU, FC 256→C (160,510 parameters at C = 62).
/// - 3 channels (CIFAR-like, 32×32): Conv 3→6 k5, ReLU, max-pool 2, Conv 6→16 k5, ReLU,
///   max-pool 2, FC 400→120, ReLU, FC 120→84, ReLU, FC 84→C (62,006 parameters at C = 10).
///
/// Other input sizes work as long as both convolutions fit; the first FC layer adapts.
#[derive(Module, Debug)]
pub struct Cnn {
    conv1: Conv2d,
    conv2: Conv2d,
    pool: MaxPool2d,
    fc: Vec<Linear>,
    /// Block list, computed once at construction.
    #[module(skip)]
    block_specs: Vec<BlockSpec>,
}

impl CnnConfig {
    /// Builds the model on `device` (weights drawn from the device's RNG: seed it first).
    pub fn init(&self, device: &Device) -> Cnn {
        check_input(ModelKind::Cnn, self.input_shape);
        let [c, h, w] = self.input_shape;
        let (ch1, ch2, hidden): (usize, usize, &[usize]) = if c == 1 {
            (16, 32, &[256])
        } else {
            (6, 16, &[120, 84])
        };
        let (h1, w1) = ((h - 4) / 2, (w - 4) / 2);
        let (h2, w2) = ((h1 - 4) / 2, (w1 - 4) / 2);
        let flat = ch2 * h2 * w2;
        let mut widths = vec![flat];
        widths.extend_from_slice(hidden);
        widths.push(self.num_classes);
        let fc: Vec<Linear> = widths
            .windows(2)
            .map(|io| LinearConfig::new(io[0], io[1]).init(device))
            .collect();
        let mut block_specs = vec![
            BlockSpec {
                name: "conv1".into(),
                modules: vec!["conv1".into()],
                input_shape: vec![c, h, w],
                output_shape: vec![ch1, h1, w1],
            },
            BlockSpec {
                name: "conv2".into(),
                modules: vec!["conv2".into()],
                input_shape: vec![ch1, h1, w1],
                output_shape: vec![flat],
            },
        ];
        for (i, io) in widths.windows(2).enumerate() {
            block_specs.push(BlockSpec {
                name: format!("fc{}", i + 1),
                modules: vec![format!("fc.{i}")],
                input_shape: vec![io[0]],
                output_shape: vec![io[1]],
            });
        }
        Cnn {
            conv1: Conv2dConfig::new([c, ch1], [5, 5]).init(device),
            conv2: Conv2dConfig::new([ch1, ch2], [5, 5]).init(device),
            pool: MaxPool2dConfig::new([2, 2]).with_strides([2, 2]).init(),
            fc,
            block_specs,
        }
    }
}

classifier_from_parts!(Cnn);

impl Cnn {
    /// Everything up to the last FC layer's input.
    fn represent(&self, images: Tensor<4>) -> Tensor<2> {
        let last = self.block_specs.len() - 1;
        run_blocks(self, 0..last, Features::Map(images)).into_flat()
    }

    /// The last FC layer.
    fn classify(&self, features: Tensor<2>) -> Tensor<2> {
        self.fc
            .last()
            .expect("at least one FC layer")
            .forward(features)
    }
}

impl BlockForward for Cnn {
    fn inference_chunk(&self, images: &Tensor<4>) -> Option<usize> {
        crate::common::inference_chunk(images)
    }

    fn forward_block(&self, index: usize, x: Features) -> Features {
        // ReLU and max-pool commute, so both variants can pool first (less work for the ReLU).
        let conv = |conv, x: Features| {
            relu(max_pool2d_forward(
                &self.pool,
                conv2d_forward(conv, x.into_map()),
            ))
        };
        match index {
            0 => Features::Map(conv(&self.conv1, x)),
            1 => Features::Flat(conv(&self.conv2, x).flatten(1, 3)),
            i if i - 2 + 1 < self.fc.len() => {
                Features::Flat(relu(linear(&self.fc[i - 2], x.into_flat())))
            }
            _ => Features::Flat(self.classify(x.into_flat())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fl_core::Classifier;

    fn device() -> Device {
        Device::flex()
    }

    #[test]
    fn parameter_counts_match_the_papers_code() {
        let d = device();
        let mnist = CnnConfig {
            input_shape: [1, 28, 28],
            num_classes: 62,
        }
        .init(&d);
        assert_eq!(mnist.num_params(), 160_510);
        let cifar = CnnConfig {
            input_shape: [3, 32, 32],
            num_classes: 10,
        }
        .init(&d);
        assert_eq!(cifar.num_params(), 62_006);
    }

    #[test]
    fn forward_shapes_and_blocks_chain() {
        let d = device();
        for (shape, classes) in [([1, 28, 28], 10), ([3, 32, 32], 10)] {
            let m = CnnConfig {
                input_shape: shape,
                num_classes: classes,
            }
            .init(&d);
            let x = Tensor::<4>::zeros([2, shape[0], shape[1], shape[2]], &d);
            assert_eq!(m.forward(x).dims(), [2, classes]);
            let blocks = m.blocks();
            assert_eq!(blocks[0].input_shape, shape.to_vec());
            for pair in blocks.windows(2) {
                assert_eq!(pair[0].output_shape, pair[1].input_shape);
            }
            assert_eq!(blocks.last().unwrap().output_shape, vec![classes]);
        }
    }
}
