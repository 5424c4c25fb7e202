//! Backend-generic Burn models for federated-learning experiments, each declaring its blocks.
//!
//! Models implement [`fl_core::Classifier`]; [`ModelKind`] names them for the command line and
//! [`with_model!`] builds one by kind. Every model works for any input shape the papers use
//! (1×28×28, 3×32×32) and any class count, and declares ordered blocks whose shapes chain.

/// The [`Classifier`](fl_core::Classifier) of a model with `represent` (the input of its final
/// linear layer), `classify` (that layer) and its `block_specs`.
macro_rules! classifier_from_parts {
    // ResNets: the representation is the globally pooled output of every block but the head.
    ($model:ty, pooled) => {
        impl $model {
            /// The globally pooled last feature map (the FC layer's input).
            fn represent(&self, images: burn::tensor::Tensor<4>) -> burn::tensor::Tensor<2> {
                let last = self.block_specs.len() - 1;
                let x = $crate::common::run_blocks(self, 0..last, fl_core::Features::Map(images));
                $crate::kernels::adaptive_avg_pool2d_forward(&self.pool, x.into_map()).flatten(1, 3)
            }

            /// The FC layer.
            fn classify(&self, features: burn::tensor::Tensor<2>) -> burn::tensor::Tensor<2> {
                $crate::kernels::linear(&self.fc, features)
            }
        }
        classifier_from_parts!($model);
    };
    ($model:ty) => {
        impl fl_core::Classifier for $model {
            fn forward(&self, images: burn::tensor::Tensor<4>) -> burn::tensor::Tensor<2> {
                self.classify(self.represent(images))
            }

            fn blocks(&self) -> Vec<fl_core::layers::BlockSpec> {
                self.block_specs.clone()
            }

            fn features(&self, images: burn::tensor::Tensor<4>) -> Option<burn::tensor::Tensor<2>> {
                Some(self.represent(images))
            }

            fn head(&self, features: burn::tensor::Tensor<2>) -> Option<burn::tensor::Tensor<2>> {
                Some(self.classify(features))
            }

            fn infer(&self, images: burn::tensor::Tensor<4>) -> burn::tensor::Tensor<2> {
                $crate::common::infer_in_chunks(self, images)
            }
        }
    };
}

mod club_cnn;
mod cnn;
mod cnn_fedavg;
mod common;
pub mod kernels;
mod mobilenet;
mod resnet;
mod vgg;
mod zoo;

pub use club_cnn::{ConvLayer, ConvLayerSpec, StackedCnn, StackedCnnConfig};
pub use cnn::{Cnn, CnnConfig};
pub use cnn_fedavg::{CnnFedAvg, CnnFedAvgConfig};
pub use common::Dropout;
pub use mobilenet::{Activation, ConvBnAct, MobileNet, MobileNetConfig, MobileUnit, SqueezeExcite};
pub use resnet::{BasicBlock, PreActBottleneck, ResNet20, ResNet20Ref, ResNetConfig};
pub use vgg::{ConvBnUnit, Vgg16, Vgg16Config};
pub use zoo::{FixedRepresentation, ModelZoo, NotInZoo, ZooModel};

use std::str::FromStr;

/// The models this crate provides, by command-line name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ModelKind {
    /// The FedMR/FedCross authors' CNN ([`Cnn`]).
    Cnn,
    /// McMahan et al.'s FedAvg CNN ([`CnnFedAvg`]).
    CnnFedavg,
    /// The standard CIFAR ResNet-20 ([`ResNet20`]).
    Resnet20,
    /// ResNet-20 as in the FedMR authors' code ([`ResNet20Ref`]).
    #[serde(rename = "resnet20-ref")]
    Resnet20Ref,
    /// VGG-16 with BatchNorm ([`Vgg16`]).
    Vgg16,
    /// MobileNetV1 ([`MobileNetConfig::init_v1`]).
    #[serde(rename = "mobilenet-v1")]
    MobilenetV1,
    /// MobileNetV2 ([`MobileNetConfig::init_v2`]).
    #[serde(rename = "mobilenet-v2")]
    MobilenetV2,
    /// MobileNetV3-Small ([`MobileNetConfig::init_v3`]).
    #[serde(rename = "mobilenet-v3")]
    MobilenetV3,
    /// pFedClub's CNN1 ([`StackedCnnConfig::cnn1`]).
    Cnn1,
    /// pFedClub's CNN2 ([`StackedCnnConfig::cnn2`]).
    Cnn2,
    /// pFedClub's CNN3 ([`StackedCnnConfig::cnn3`]).
    Cnn3,
    /// pFedClub's CNN4 ([`StackedCnnConfig::cnn4`]).
    Cnn4,
}

/// The model name is not one this crate knows.
#[derive(Debug, thiserror::Error)]
#[error("unknown model '{0}' (known: {known})", known = known_names())]
pub struct UnknownModel(pub String);

fn known_names() -> String {
    ModelKind::all()
        .iter()
        .map(|m| m.name())
        .collect::<Vec<_>>()
        .join(", ")
}

impl FromStr for ModelKind {
    type Err = UnknownModel;
    fn from_str(s: &str) -> Result<Self, UnknownModel> {
        Self::all()
            .iter()
            .copied()
            .find(|m| m.name() == s)
            .ok_or_else(|| UnknownModel(s.to_string()))
    }
}

/// Images too small for a model: its pooling and strided layers would leave no pixel.
#[derive(Debug, thiserror::Error)]
#[error(
    "{model} needs images of at least {min}×{min} pixels, got {}×{}×{}",
    shape[0], shape[1], shape[2]
)]
pub struct InputTooSmall {
    /// The model.
    pub model: ModelKind,
    /// Its smallest side ([`ModelKind::min_side`]).
    pub min: usize,
    /// The images' `[c, h, w]`.
    pub shape: [usize; 3],
}

impl ModelKind {
    /// The smallest image side (height and width) the model takes: the FedMR and FedAvg CNNs'
    /// unpadded 5×5 convolutions and VGG-16's five pools need 16, the MobileNets' strides and
    /// CNN3's and CNN4's three pools 8, the ResNets and CNN1–CNN2 4 (a test trains every
    /// model at its minimum, on 1 and 3 channels).
    pub fn min_side(self) -> usize {
        match self {
            Self::Cnn | Self::CnnFedavg | Self::Vgg16 => 16,
            Self::MobilenetV1 | Self::MobilenetV2 | Self::MobilenetV3 | Self::Cnn3 | Self::Cnn4 => {
                8
            }
            Self::Resnet20 | Self::Resnet20Ref | Self::Cnn1 | Self::Cnn2 => 4,
        }
    }

    /// Whether images of `shape` (`[c, h, w]`, at least one channel) fit the model.
    pub fn check_input(self, shape: [usize; 3]) -> Result<(), InputTooSmall> {
        let [c, h, w] = shape;
        let min = self.min_side();
        if c > 0 && h >= min && w >= min {
            Ok(())
        } else {
            Err(InputTooSmall {
                model: self,
                min,
                shape,
            })
        }
    }
}

impl std::fmt::Display for ModelKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl ModelKind {
    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Cnn => "cnn",
            Self::CnnFedavg => "cnn-fedavg",
            Self::Resnet20 => "resnet20",
            Self::Resnet20Ref => "resnet20-ref",
            Self::Vgg16 => "vgg16",
            Self::MobilenetV1 => "mobilenet-v1",
            Self::MobilenetV2 => "mobilenet-v2",
            Self::MobilenetV3 => "mobilenet-v3",
            Self::Cnn1 => "cnn1",
            Self::Cnn2 => "cnn2",
            Self::Cnn3 => "cnn3",
            Self::Cnn4 => "cnn4",
        }
    }

    /// Every model, for listings.
    pub fn all() -> &'static [ModelKind] {
        &[
            Self::Cnn,
            Self::CnnFedavg,
            Self::Resnet20,
            Self::Resnet20Ref,
            Self::Vgg16,
            Self::MobilenetV1,
            Self::MobilenetV2,
            Self::MobilenetV3,
            Self::Cnn1,
            Self::Cnn2,
            Self::Cnn3,
            Self::Cnn4,
        ]
    }
}

/// Builds the model `$kind` (a [`ModelKind`]) for images of shape `$shape` (`[c, h, w]`) and
/// `$classes` classes on `$device`, binds it to `$model` and evaluates `$body` with it.
///
/// Models are distinct types, so `$body` is compiled once per architecture; this is how code
/// that is generic over [`fl_core::Classifier`] runs a model chosen at run time:
///
/// ```
/// use burn::module::Module;
/// use fl_models::{ModelKind, with_model};
/// let device = burn::tensor::Device::flex();
/// let params = with_model!(ModelKind::Cnn, [3, 32, 32], 10, &device, |m| m.num_params());
/// assert_eq!(params, 62_006);
/// ```
#[macro_export]
macro_rules! with_model {
    ($kind:expr, $shape:expr, $classes:expr, $device:expr, |$model:ident| $body:expr) => {{
        let (input_shape, num_classes): ([usize; 3], usize) = ($shape, $classes);
        let device = $device;
        match $kind {
            $crate::ModelKind::Cnn => {
                let $model = $crate::CnnConfig {
                    input_shape,
                    num_classes,
                }
                .init(device);
                $body
            }
            $crate::ModelKind::CnnFedavg => {
                let $model = $crate::CnnFedAvgConfig {
                    input_shape,
                    num_classes,
                }
                .init(device);
                $body
            }
            $crate::ModelKind::Resnet20 => {
                let $model = $crate::ResNetConfig {
                    input_shape,
                    num_classes,
                }
                .init_resnet20(device);
                $body
            }
            $crate::ModelKind::Resnet20Ref => {
                let $model = $crate::ResNetConfig {
                    input_shape,
                    num_classes,
                }
                .init_resnet20_ref(device);
                $body
            }
            $crate::ModelKind::Vgg16 => {
                let $model = $crate::Vgg16Config {
                    input_shape,
                    num_classes,
                }
                .init(device);
                $body
            }
            kind @ ($crate::ModelKind::MobilenetV1
            | $crate::ModelKind::MobilenetV2
            | $crate::ModelKind::MobilenetV3) => {
                let cfg = $crate::MobileNetConfig {
                    input_shape,
                    num_classes,
                };
                let $model = match kind {
                    $crate::ModelKind::MobilenetV1 => cfg.init_v1(device),
                    $crate::ModelKind::MobilenetV2 => cfg.init_v2(device),
                    _ => cfg.init_v3(device),
                };
                $body
            }
            kind @ ($crate::ModelKind::Cnn1
            | $crate::ModelKind::Cnn2
            | $crate::ModelKind::Cnn3
            | $crate::ModelKind::Cnn4) => {
                let cfg = match kind {
                    $crate::ModelKind::Cnn1 => $crate::StackedCnnConfig::cnn1,
                    $crate::ModelKind::Cnn2 => $crate::StackedCnnConfig::cnn2,
                    $crate::ModelKind::Cnn3 => $crate::StackedCnnConfig::cnn3,
                    _ => $crate::StackedCnnConfig::cnn4,
                };
                let $model = cfg(input_shape, num_classes).init(device);
                $body
            }
        }
    }};
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::Module;
    use burn::nn::loss::CrossEntropyLossConfig;
    use burn::optim::{GradientsParams, SgdConfig};
    use burn::tensor::{Device, Distribution, Int, Tensor};
    use fl_core::{BlockForward, Classifier, ParamTable};

    /// Trainable parameters at 3×32×32 and 10 classes (the published counts where there are any).
    fn expected_params(kind: ModelKind) -> usize {
        match kind {
            ModelKind::Cnn => 62_006,
            ModelKind::CnnFedavg => 878_538,
            ModelKind::Resnet20 => 269_722,
            ModelKind::Resnet20Ref => 219_482,
            ModelKind::Vgg16 => 33_646_666,
            ModelKind::MobilenetV1 => 3_217_226,
            ModelKind::MobilenetV2 => 2_236_682,
            ModelKind::MobilenetV3 => 1_528_106,
            // Our documented width choices for pFedClub's CNNs (pinned so they do not drift).
            ModelKind::Cnn1 => 2_156_490,
            ModelKind::Cnn2 => 4_458_570,
            ModelKind::Cnn3 => 3_750_986,
            ModelKind::Cnn4 => 1_569_130,
        }
    }

    /// Every model trains and evaluates at its smallest side, on 1 and 3 channels, and one
    /// pixel less is refused before a model is built.
    #[test]
    fn every_model_runs_at_its_smallest_input() {
        for &kind in ModelKind::all() {
            for c in [1, 3] {
                let min = kind.min_side();
                assert!(kind.check_input([c, min, min]).is_ok());
                let e = kind.check_input([c, min - 1, min]).unwrap_err().to_string();
                assert!(e.contains(&format!("at least {min}×{min}")), "{e}");
                let ad = Device::flex().autodiff();
                with_model!(kind, [c, min, min], 10, &ad, |m| {
                    let x = Tensor::<4>::random([2, c, min, min], Distribution::Default, &ad);
                    let _ = m.forward(x).sum().backward();
                });
                let d = Device::flex();
                with_model!(kind, [c, min, min + 3], 10, &d, |m| {
                    let x = Tensor::<4>::random([3, c, min, min + 3], Distribution::Default, &d);
                    assert_eq!(m.forward(x).dims(), [3, 10], "{kind}");
                });
            }
        }
    }

    #[test]
    fn names_round_trip() {
        for &m in ModelKind::all() {
            assert_eq!(m.name().parse::<ModelKind>().unwrap(), m);
            let json = serde_json::to_string(&m).unwrap();
            assert_eq!(json, format!("\"{}\"", m.name()));
        }
        let err = "resnet".parse::<ModelKind>().unwrap_err().to_string();
        assert!(
            err.contains("resnet20-ref") && err.contains("cnn4"),
            "{err}"
        );
    }

    /// Forward shapes for both paper input shapes, block chains, parameter counts, and the
    /// blocks as runnable units: run one at a time, each gives its declared shape and together
    /// they give exactly the logits of `forward`.
    fn check_shapes<M: BlockForward>(kind: ModelKind, shape: [usize; 3], model: M) {
        // Two forward passes compared bit for bit: on the same kernel tier.
        let _tier = crate::kernels::isa::test_lock();
        let d = Device::flex();
        let x = Tensor::<4>::random([2, shape[0], shape[1], shape[2]], Distribution::Default, &d);
        let logits = model.forward(x.clone());
        assert_eq!(logits.dims(), [2, 10], "{kind}");
        // The representation is the last layer's input, and the head maps it to the logits.
        let z = model
            .features(x.clone())
            .expect("every model exposes its representation");
        let [_, dim] = z.dims();
        let split = model.head(z).expect("every model exposes its head");
        let diff: f32 = (split - logits.clone()).abs().max().into_scalar();
        assert!(diff < 1e-4, "{kind}: head(features(x)) differs by {diff}");
        let table = ParamTable::from_module(&model);
        let (_, last_layer) = table.layout().layers().last().unwrap();
        let weight = &table.layout().tensors()[last_layer[0]];
        assert_eq!(
            weight.shape,
            vec![dim, 10],
            "{kind}: last layer is not {dim} -> 10"
        );
        let blocks = model.blocks();
        assert!(blocks.len() >= 3, "{kind}");
        assert_eq!(blocks[0].input_shape, shape.to_vec(), "{kind}");
        for pair in blocks.windows(2) {
            let out: usize = pair[0].output_shape.iter().product();
            let input: usize = pair[1].input_shape.iter().product();
            assert_eq!(out, input, "{kind}: {} -> {}", pair[0].name, pair[1].name);
        }
        assert_eq!(blocks.last().unwrap().output_shape, vec![10], "{kind}");
        let outputs = model.forward_all_blocks(x.clone());
        for (spec, out) in blocks.iter().zip(&outputs) {
            let (got, want) = (out.sample_shape(), &spec.output_shape);
            let size = |s: &[usize]| s.iter().product::<usize>();
            assert_eq!(size(&got), size(want), "{kind}: block {}", spec.name);
        }
        let folded = outputs.last().unwrap().clone().into_flat();
        let bits = |t: Tensor<2>| t.into_data().try_to_vec::<f32>().unwrap();
        assert_eq!(
            bits(folded),
            bits(logits.clone()),
            "{kind}: blocks != forward"
        );
        // The block declaration covers every tensor exactly once.
        ParamTable::from_module_with_blocks(&model, blocks).expect("valid blocks");
        if shape == [3, 32, 32] {
            let expected = expected_params(kind);
            let trainable = ParamTable::from_module(&model).num_trainable();
            println!("{kind}: {trainable} parameters");
            assert_eq!(trainable, expected, "{kind}");
        }
    }

    #[test]
    fn every_model_has_chained_blocks_for_both_input_shapes() {
        let d = Device::flex();
        for &kind in ModelKind::all() {
            for shape in [[1, 28, 28], [3, 32, 32]] {
                with_model!(kind, shape, 10, &d, |m| check_shapes(kind, shape, m));
            }
        }
    }

    /// Evaluation in chunks (`common::infer_in_chunks`) gives `forward`'s logits bit for bit,
    /// for every model at both input shapes on every kernel tier: 40 samples, one full chunk
    /// and a partial one (some layers take other kernels for the partial one and for the whole
    /// batch); and 33, whose last sample joins the full chunk (alone, it made products
    /// narrower than the batch's, which gemm may sum in other depth blocks: `resnet20-ref` at
    /// 1×28×28 differed on every tier, `resnet20` there on CPUs without AVX2); and 63, whose
    /// chunk of 31 made groups of 10, 10, 10 and 1 on `resnet20-ref`'s 7×7 maps before the
    /// im2col path's grouping took a full widest group as its reference.
    #[cfg(feature = "flex")]
    #[test]
    fn chunked_evaluation_gives_the_logits_of_forward() {
        let d = Device::flex();
        let sizes = [
            ([1, 28, 28], 40),
            ([3, 32, 32], 40),
            ([1, 28, 28], 33),
            ([1, 28, 28], 63),
        ];
        crate::kernels::cpu::tests::at_every_isa(|isa| {
            for &kind in ModelKind::all() {
                for (shape, n) in sizes {
                    let [c, h, w] = shape;
                    let x = Tensor::<4>::random([n, c, h, w], Distribution::Default, &d);
                    let bits = |t: Tensor<2>| t.into_data().try_to_vec::<f32>().unwrap();
                    with_model!(kind, shape, 10, &d, |m| assert_eq!(
                        bits(m.infer(x.clone())),
                        bits(m.forward(x)),
                        "{kind} at {shape:?}, {n} samples, {isa:?}"
                    ));
                }
            }
        });
    }

    /// Every weight of a model lies in exactly one of its declared blocks, so the sizes by which
    /// chunked evaluation picks the blocks it runs on the whole batch add up to the model's.
    #[test]
    fn block_weights_add_up_to_the_model() {
        let d = Device::flex();
        for &kind in ModelKind::all() {
            for shape in [[1, 28, 28], [3, 32, 32]] {
                with_model!(kind, shape, 10, &d, |m| {
                    let sizes = crate::common::block_weights(&m, &m.blocks());
                    assert!(
                        sizes.iter().all(|&s| s > 0),
                        "{kind}: a block without weights"
                    );
                    assert_eq!(
                        sizes.iter().sum::<usize>(),
                        m.num_params(),
                        "{kind} at {shape:?}"
                    );
                });
            }
        }
    }

    /// One SGD step on the autodiff CPU backend changes the weights and keeps them finite.
    fn one_step<M: Classifier>(kind: ModelKind, model: M) {
        let d = Device::flex().autodiff();
        let before = ParamTable::from_module(&model).to_host().unwrap();
        let x = Tensor::<4>::random([4, 3, 32, 32], Distribution::Default, &d);
        let y = Tensor::<1, Int>::from_ints([0, 1, 2, 3], &d);
        let loss = CrossEntropyLossConfig::new()
            .init(&d)
            .forward(model.forward(x), y);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let model = SgdConfig::new().init().step(0.1, model, grads);
        let after = ParamTable::from_module(&model).to_host().unwrap();
        assert!(
            after.iter().flatten().all(|v| v.is_finite()),
            "{kind}: non-finite weights"
        );
        assert_ne!(before, after, "{kind}: training changed nothing");
    }

    #[test]
    fn every_model_trains_one_step() {
        let d = Device::flex().autodiff();
        for &kind in ModelKind::all() {
            with_model!(kind, [3, 32, 32], 10, &d, |m| one_step(kind, m));
        }
    }
}
