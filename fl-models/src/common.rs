//! Building blocks shared by the models: convolution helpers, a deterministic dropout, shape
//! arithmetic and block declarations.

use burn::module::{Flag, Module, Param};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{BatchNorm, BatchNormConfig, Initializer, Linear, LinearConfig, PaddingConfig2d};
use burn::tensor::{Device, Tensor, TensorData};
use fl_core::layers::BlockSpec;
use fl_core::rng::forward_bernoulli;
use fl_core::{BlockForward, Features, ParamTable, map_in_chunks};

use crate::ModelKind;

/// Runs blocks `blocks` of `model` in order on `x`.
pub(crate) fn run_blocks<M: BlockForward>(
    model: &M,
    blocks: std::ops::Range<usize>,
    x: Features,
) -> Features {
    blocks.fold(x, |x, i| model.forward_block(i, x))
}

/// Samples per chunk in [`infer_in_chunks`]: of 8, 16, 32 and 64 the fastest overall, on the
/// whole test set and on single small batches, at both input shapes (docs/performance.md); two
/// full vectors of the kernels across samples.
const EVAL_CHUNK: usize = 32;

/// [`infer_in_chunks`] runs a feature-map block on the whole batch, with the blocks after it,
/// once its weights outnumber this many times its inputs in a chunk: VGG-16's 512-channel
/// layers on 3×3 and 1×1 maps (16× at 1×28×28), CNN3's last map block (22×), the
/// MobileNets' last units. With 1 instead of 4 (VGG-16 from its 7×7 maps, 1.5×), MobileNetV1's
/// 512-channel units (1.03×) went too and its evaluation came out 3% slower (1.02–1.04), where
/// VGG-16's and CNN3's ran the same (`bench/ab.py` of the two rules, two quads each).
const WHOLE_BATCH_WEIGHTS: usize = 4;

/// [`BlockForward::inference_chunk`] for this crate's models: [`EVAL_CHUNK`] samples where
/// evaluation runs on the CPU kernels, whose feature-map blocks compute each sample alone.
pub(crate) fn inference_chunk(images: &Tensor<4>) -> Option<usize> {
    crate::kernels::chunked_inference(images).then_some(EVAL_CHUNK)
}

/// [`fl_core::Classifier::infer`] for this crate's models. On the CPU kernels, the blocks whose
/// outputs are feature maps run on chunks of [`EVAL_CHUNK`] samples in parallel, each chunk
/// through all of them as one task, so a chunk's maps stay in a core's caches from layer to
/// layer instead of the whole batch's streaming through memory at every layer (ResNet-20's
/// first maps are 33 MB for the 500-sample evaluation batch); the blocks after them (pooling
/// and the classifier) run on the whole batch, as in `forward`. So do the map blocks from the
/// first one with [`WHOLE_BATCH_WEIGHTS`] times more weights than a chunk has inputs: the
/// kernels pack a layer's weights on every call, and once per chunk that packing outweighed
/// the small maps' traffic (VGG-16's 512-channel layers on 3×3 and 1×1 maps; the packing was
/// 7.7% of its evaluation at 1×28×28 in `perf`). The logits are `forward`'s bit for bit: those
/// kernels compute each sample alone, in an order that does not depend on the batch (a test
/// checks every model on every instruction tier). The flat blocks are kept whole because that
/// does not hold for them: with its classifier block run per chunk, MobileNetV2's evaluation
/// loss after a FedAvg round changed in the last bits.
pub(crate) fn infer_in_chunks<M: BlockForward>(model: &M, images: Tensor<4>) -> Tensor<2> {
    let specs = model.blocks();
    let maps = specs
        .iter()
        .take_while(|b| b.output_shape.len() == 3)
        .count();
    let n = images.dims()[0];
    let chunk = match inference_chunk(&images) {
        Some(chunk) if maps > 0 && n > chunk => chunk,
        _ => return model.forward(images),
    };
    let weights = block_weights(model, &specs);
    let inputs = |b: &BlockSpec| chunk * b.input_shape.iter().product::<usize>();
    let chunked = (0..maps)
        .find(|&i| weights[i] > WHOLE_BATCH_WEIGHTS * inputs(&specs[i]))
        .unwrap_or(maps);
    if chunked == 0 {
        return model.forward(images);
    }
    let maps_out = map_in_chunks(images, chunk, |x| {
        run_blocks(model, 0..chunked, Features::Map(x)).into_map()
    });
    run_blocks(model, chunked..specs.len(), Features::Map(maps_out)).into_flat()
}

/// The number of weights (float tensors' elements, buffers included) in each of `model`'s
/// blocks `specs` (all of them: the layout checks that they cover every tensor), as
/// [`ParamTable`]'s layout assigns tensors to blocks by their module prefixes.
pub(crate) fn block_weights<M: Module>(model: &M, specs: &[BlockSpec]) -> Vec<usize> {
    ParamTable::from_module_with_blocks(model, specs.to_vec())
        .expect("a model's declared blocks name its modules")
        .layout()
        .block_sizes(|_| true)
}

/// A square convolution `in → out` with kernel `k`, `stride`, symmetric zero `padding` and
/// `groups`; `bias` as in the original architecture (false before a BatchNorm).
#[allow(clippy::too_many_arguments)]
pub(crate) fn conv(
    channels: [usize; 2],
    k: usize,
    stride: usize,
    padding: usize,
    groups: usize,
    bias: bool,
    init: Option<Initializer>,
    device: &Device,
) -> Conv2d {
    let mut cfg = Conv2dConfig::new(channels, [k, k])
        .with_stride([stride, stride])
        .with_padding(PaddingConfig2d::Explicit(
            padding, padding, padding, padding,
        ))
        .with_groups(groups)
        .with_bias(bias);
    if let Some(init) = init {
        cfg = cfg.with_initializer(init);
    }
    cfg.init(device)
}

/// A BatchNorm over `n` channels with PyTorch's defaults (ε = 1e-5, momentum 0.1).
pub(crate) fn bn(n: usize, device: &Device) -> BatchNorm {
    BatchNormConfig::new(n).init(device)
}

/// Output size of a convolution or pooling window along one axis (floor mode, as PyTorch).
pub(crate) fn out_size(n: usize, k: usize, stride: usize, padding: usize) -> usize {
    (n + 2 * padding).saturating_sub(k) / stride + 1
}

/// A block declaration.
/// The fully connected blocks `fc1, fc2, …` (modules `fc.0, fc.1, …`) of a classifier whose
/// layers have the given `widths` (inputs of the first, then each layer's outputs); the first
/// block takes `input_shape` (the FC layer may flatten or globally pool it). Their specs are
/// appended to `specs`.
pub(crate) fn fc_stack(
    input_shape: Vec<usize>,
    widths: &[usize],
    specs: &mut Vec<BlockSpec>,
    device: &Device,
) -> Vec<Linear> {
    let mut input_shape = input_shape;
    widths
        .windows(2)
        .enumerate()
        .map(|(i, io)| {
            let inputs = std::mem::replace(&mut input_shape, vec![io[1]]);
            specs.push(block(
                format!("fc{}", i + 1),
                &[format!("fc.{i}")],
                inputs,
                vec![io[1]],
            ));
            LinearConfig::new(io[0], io[1]).init(device)
        })
        .collect()
}

pub(crate) fn block(
    name: impl Into<String>,
    modules: &[String],
    input_shape: Vec<usize>,
    output_shape: Vec<usize>,
) -> BlockSpec {
    BlockSpec {
        name: name.into(),
        modules: modules.to_vec(),
        input_shape,
        output_shape,
    }
}

/// Panics unless images of `[c, h, w]` fit `model` ([`ModelKind::check_input`], which callers
/// with user data check first).
pub(crate) fn check_input(model: ModelKind, shape: [usize; 3]) {
    if let Err(e) = model.check_input(shape) {
        panic!("{e}");
    }
}

/// Dropout whose masks come from the local trainer's per-client stream
/// ([`fl_core::rng::with_forward_stream`]), so parallel clients stay deterministic.
///
/// Like Burn's `Dropout`, it is active only on an autodiff device (local training) and the
/// identity at evaluation and once [frozen](Module::freeze). Surviving activations are scaled
/// by `1 / (1 − p)`.
#[derive(Module, Debug)]
pub struct Dropout {
    /// Probability of zeroing an activation.
    #[module(skip)]
    pub prob: f64,
    /// Cleared by [`Module::freeze`] (a frozen block must be a fixed function).
    pub training: Param<Flag>,
}

impl Dropout {
    /// A dropout layer with drop probability `prob` in `[0, 1)`.
    pub fn new(prob: f64) -> Self {
        assert!(
            (0.0..1.0).contains(&prob),
            "dropout probability must be in [0, 1), got {prob}"
        );
        Self {
            prob,
            training: Param::from_bool(true),
        }
    }

    /// Applies the mask during training; the identity otherwise.
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        let device = input.device();
        if self.prob == 0.0 || !device.is_autodiff() || !self.training.is_enabled() {
            return input;
        }
        let shape = input.shape();
        let keep = 1.0 - self.prob;
        let mask = forward_bernoulli(shape.num_elements(), keep);
        let mask = Tensor::<D>::from_data(TensorData::new(mask, shape), &device);
        input * mask.mul_scalar(1.0 / keep)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fl_core::rng::with_forward_stream;

    #[test]
    fn dropout_is_seeded_and_identity_at_evaluation() {
        let d = Device::flex();
        let drop = Dropout::new(0.5);
        let x = Tensor::<2>::ones([4, 64], &d);
        let eval = drop
            .forward(x.clone())
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        assert!(eval.iter().all(|&v| v == 1.0));
        let ad = d.clone().autodiff();
        let run = |seed| {
            with_forward_stream(seed, || {
                drop.forward(Tensor::<2>::ones([4, 64], &ad))
                    .into_data()
                    .try_to_vec::<f32>()
                    .unwrap()
            })
        };
        let (a, b, c) = (run(3), run(3), run(4));
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.iter().all(|&v| v == 0.0 || v == 2.0));
        let kept = a.iter().filter(|&&v| v > 0.0).count();
        assert!((64..192).contains(&kept), "kept {kept} of 256");
    }
}
