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

/// Configuration of [`CnnFedAvg`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CnnFedAvgConfig {
    /// Input shape `[channels, height, width]`.
    pub input_shape: [usize; 3],
    /// Number of classes.
    pub num_classes: usize,
}

/// McMahan et al.'s FedAvg CNN: Conv 5×5 32, ReLU, max-pool 2, Conv 5×5 64, ReLU, max-pool 2,
/// FC 512, ReLU, FC C (valid convolutions: 878,538 parameters for 3×32×32 and 10 classes,
/// 582,026 for 1×28×28).
#[derive(Module, Debug)]
pub struct CnnFedAvg {
    conv1: Conv2d,
    conv2: Conv2d,
    pool: MaxPool2d,
    fc1: Linear,
    fc2: Linear,
    #[module(skip)]
    block_specs: Vec<BlockSpec>,
}

impl CnnFedAvgConfig {
    /// Builds the model on `device` (weights drawn from the device's RNG: seed it first).
    pub fn init(&self, device: &Device) -> CnnFedAvg {
        check_input(ModelKind::CnnFedavg, self.input_shape);
        let [c, h, w] = self.input_shape;
        let (h1, w1) = ((h - 4) / 2, (w - 4) / 2);
        let (h2, w2) = ((h1 - 4) / 2, (w1 - 4) / 2);
        let flat = 64 * h2 * w2;
        let block = |name: &str, i: Vec<usize>, o: Vec<usize>| BlockSpec {
            name: name.into(),
            modules: vec![name.into()],
            input_shape: i,
            output_shape: o,
        };
        CnnFedAvg {
            conv1: Conv2dConfig::new([c, 32], [5, 5]).init(device),
            conv2: Conv2dConfig::new([32, 64], [5, 5]).init(device),
            pool: MaxPool2dConfig::new([2, 2]).with_strides([2, 2]).init(),
            fc1: LinearConfig::new(flat, 512).init(device),
            fc2: LinearConfig::new(512, self.num_classes).init(device),
            block_specs: vec![
                block("conv1", vec![c, h, w], vec![32, h1, w1]),
                block("conv2", vec![32, h1, w1], vec![flat]),
                block("fc1", vec![flat], vec![512]),
                block("fc2", vec![512], vec![self.num_classes]),
            ],
        }
    }
}

classifier_from_parts!(CnnFedAvg);

impl CnnFedAvg {
    /// Everything up to FC2's input.
    fn represent(&self, images: Tensor<4>) -> Tensor<2> {
        run_blocks(self, 0..3, Features::Map(images)).into_flat()
    }

    /// FC2.
    fn classify(&self, features: Tensor<2>) -> Tensor<2> {
        linear(&self.fc2, features)
    }
}

impl BlockForward for CnnFedAvg {
    fn inference_chunk(&self, images: &Tensor<4>) -> Option<usize> {
        crate::common::inference_chunk(images)
    }

    fn forward_block(&self, index: usize, x: Features) -> Features {
        // ReLU and max-pool commute, bit for bit both ways: pooling first leaves the ReLU a
        // quarter of the values.
        let conv = |conv, x: Features| {
            relu(max_pool2d_forward(
                &self.pool,
                conv2d_forward(conv, x.into_map()),
            ))
        };
        match index {
            0 => Features::Map(conv(&self.conv1, x)),
            1 => Features::Flat(conv(&self.conv2, x).flatten(1, 3)),
            2 => Features::Flat(relu(linear(&self.fc1, x.into_flat()))),
            _ => Features::Flat(self.classify(x.into_flat())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fl_core::Classifier;

    #[test]
    fn parameter_counts_and_shapes() {
        let d = Device::flex();
        for (shape, params) in [([3, 32, 32], 878_538), ([1, 28, 28], 582_026)] {
            let m = CnnFedAvgConfig {
                input_shape: shape,
                num_classes: 10,
            }
            .init(&d);
            assert_eq!(m.num_params(), params);
            let x = Tensor::<4>::zeros([2, shape[0], shape[1], shape[2]], &d);
            assert_eq!(m.forward(x).dims(), [2, 10]);
            for pair in m.blocks().windows(2) {
                assert_eq!(pair[0].output_shape, pair[1].input_shape);
            }
        }
    }
}
