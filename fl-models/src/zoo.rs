//! pFedClub's heterogeneous model zoos: one Rust type ([`ZooModel`]) for clients that own
//! different architectures, and the paper's assignment of architectures to clients
//! ([`ModelZoo`]).

use burn::module::Module;
use burn::tensor::{Device, Tensor};
use fl_core::layers::BlockSpec;
use fl_core::{BlockForward, Classifier, Features};

use crate::{MobileNet, MobileNetConfig, ModelKind, StackedCnn, StackedCnnConfig};

/// A model from pFedClub's zoos (CNN1–CNN4, MobileNetV1–V3). One enum type lets code that is
/// generic over a single [`Classifier`] hold clients with different architectures.
///
/// Tensor paths carry the variant name (`Stacked.convs.0.conv.weight`), as Burn's enum modules
/// do; [`blocks`](Classifier::blocks) accounts for it.
// Burn's enum modules need the variants inline (no `Box`); the size difference is harmless.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum ZooModel {
    /// CNN1–CNN4.
    Stacked(StackedCnn),
    /// MobileNetV1–V3.
    Mobile(MobileNet),
}

/// The architecture is not one of pFedClub's zoo models.
#[derive(Debug, thiserror::Error)]
#[error("'{0}' is not a model-zoo architecture (cnn1-cnn4, mobilenet-v1/v2/v3)")]
pub struct NotInZoo(pub ModelKind);

/// A zoo model whose widths cannot be set: only CNN1–CNN4 can be scaled (HeteroFL) or have a
/// hidden FC layer before the head (FedGH); MobileNetV1/V2 end in their pooled channels.
#[derive(Debug, thiserror::Error)]
#[error(
    "'{0}' has no hidden FC layer before its head whose width could be set, and no width scaling (only cnn1-cnn4 do)"
)]
pub struct FixedRepresentation(pub ModelKind);

/// The configuration of CNN1–CNN4 (`None` for other architectures).
fn stacked_config(
    kind: ModelKind,
    input_shape: [usize; 3],
    num_classes: usize,
) -> Option<StackedCnnConfig> {
    let preset = match kind {
        ModelKind::Cnn1 => StackedCnnConfig::cnn1,
        ModelKind::Cnn2 => StackedCnnConfig::cnn2,
        ModelKind::Cnn3 => StackedCnnConfig::cnn3,
        ModelKind::Cnn4 => StackedCnnConfig::cnn4,
        _ => return None,
    };
    Some(preset(input_shape, num_classes))
}

impl ZooModel {
    /// Builds a zoo model of architecture `kind` (weights from the device's RNG).
    pub fn new(
        kind: ModelKind,
        input_shape: [usize; 3],
        num_classes: usize,
        device: &Device,
    ) -> Result<Self, NotInZoo> {
        if let Some(cfg) = stacked_config(kind, input_shape, num_classes) {
            return Ok(Self::Stacked(cfg.init(device)));
        }
        let mobile = MobileNetConfig {
            input_shape,
            num_classes,
        };
        Ok(match kind {
            ModelKind::MobilenetV1 => Self::Mobile(mobile.init_v1(device)),
            ModelKind::MobilenetV2 => Self::Mobile(mobile.init_v2(device)),
            ModelKind::MobilenetV3 => Self::Mobile(mobile.init_v3(device)),
            other => return Err(NotInZoo(other)),
        })
    }

    /// Like [`new`](Self::new), every hidden layer `rate` times as wide and HeteroFL's scaler
    /// (a width-`rate` sub-model of the full architecture). CNN1–CNN4 only.
    pub fn scaled(
        kind: ModelKind,
        input_shape: [usize; 3],
        num_classes: usize,
        rate: f64,
        device: &Device,
    ) -> Result<Self, FixedRepresentation> {
        let cfg =
            stacked_config(kind, input_shape, num_classes).ok_or(FixedRepresentation(kind))?;
        Ok(Self::Stacked(
            cfg.scaled(rate).init(device).with_scaler(rate),
        ))
    }

    /// Like [`new`](Self::new), with the representation (the head's input, the last hidden FC
    /// layer) `width` wide: what FedGH's shared header needs of every client. CNN1–CNN4 only.
    pub fn with_representation(
        kind: ModelKind,
        input_shape: [usize; 3],
        num_classes: usize,
        width: usize,
        device: &Device,
    ) -> Result<Self, FixedRepresentation> {
        let cfg =
            stacked_config(kind, input_shape, num_classes).ok_or(FixedRepresentation(kind))?;
        let mut hidden = cfg.hidden.clone();
        *hidden.last_mut().expect("CNN1-CNN4 have a hidden layer") = width.max(1);
        Ok(Self::Stacked(cfg.with_hidden(hidden).init(device)))
    }
}

impl Classifier for ZooModel {
    fn infer(&self, images: Tensor<4>) -> Tensor<2> {
        match self {
            Self::Stacked(m) => m.infer(images),
            Self::Mobile(m) => m.infer(images),
        }
    }

    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        match self {
            Self::Stacked(m) => m.forward(images),
            Self::Mobile(m) => m.forward(images),
        }
    }

    fn blocks(&self) -> Vec<BlockSpec> {
        let (variant, blocks) = match self {
            Self::Stacked(m) => ("Stacked", m.blocks()),
            Self::Mobile(m) => ("Mobile", m.blocks()),
        };
        blocks
            .into_iter()
            .map(|mut b| {
                for module in &mut b.modules {
                    *module = format!("{variant}.{module}");
                }
                b
            })
            .collect()
    }

    fn features(&self, images: Tensor<4>) -> Option<Tensor<2>> {
        match self {
            Self::Stacked(m) => m.features(images),
            Self::Mobile(m) => m.features(images),
        }
    }

    fn head(&self, features: Tensor<2>) -> Option<Tensor<2>> {
        match self {
            Self::Stacked(m) => m.head(features),
            Self::Mobile(m) => m.head(features),
        }
    }
}

impl BlockForward for ZooModel {
    fn inference_chunk(&self, images: &Tensor<4>) -> Option<usize> {
        crate::common::inference_chunk(images)
    }

    fn forward_block(&self, index: usize, x: Features) -> Features {
        match self {
            Self::Stacked(m) => m.forward_block(index, x),
            Self::Mobile(m) => m.forward_block(index, x),
        }
    }
}

/// pFedClub's model zoos (Section 5.1): which architecture each client owns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ModelZoo {
    /// Zoo I: CNN1–CNN4 and MobileNetV1–V3 (CNN1 on 8 of 50 clients, the others on 7 each).
    I,
    /// Zoo II: MobileNetV1 on 16 of 50 clients, V2 and V3 on 17 each.
    #[serde(rename = "II")]
    Ii,
    /// Zoo III: CNN1, CNN2, CNN3 on 12 of 50 clients each, CNN4 on 14.
    #[serde(rename = "III")]
    Iii,
}

impl std::str::FromStr for ModelZoo {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_uppercase().as_str() {
            "I" | "1" => Ok(Self::I),
            "II" | "2" => Ok(Self::Ii),
            "III" | "3" => Ok(Self::Iii),
            _ => Err(format!("unknown model zoo '{s}' (known: I, II, III)")),
        }
    }
}

impl ModelZoo {
    /// The zoo's architectures and the paper's client counts for 50 clients.
    pub fn members(self) -> &'static [(ModelKind, usize)] {
        use ModelKind::*;
        match self {
            Self::I => &[
                (Cnn1, 8),
                (Cnn2, 7),
                (Cnn3, 7),
                (Cnn4, 7),
                (MobilenetV1, 7),
                (MobilenetV2, 7),
                (MobilenetV3, 7),
            ],
            Self::Ii => &[(MobilenetV1, 16), (MobilenetV2, 17), (MobilenetV3, 17)],
            Self::Iii => &[(Cnn1, 12), (Cnn2, 12), (Cnn3, 12), (Cnn4, 14)],
        }
    }

    /// The architecture of each of `num_clients` clients, in client order: the paper's counts
    /// for 50 clients; otherwise as equal as possible (the first architectures get the
    /// remainder). Clients of one architecture are consecutive; the data partition is random,
    /// so this does not correlate architecture with data.
    pub fn assign(self, num_clients: usize) -> Vec<ModelKind> {
        let members = self.members();
        let counts: Vec<usize> = if num_clients == 50 {
            members.iter().map(|&(_, n)| n).collect()
        } else {
            let k = members.len();
            (0..k)
                .map(|i| num_clients / k + usize::from(i < num_clients % k))
                .collect()
        };
        members
            .iter()
            .zip(counts)
            .flat_map(|(&(kind, _), n)| std::iter::repeat_n(kind, n))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Distribution;
    use fl_core::ParamTable;

    #[test]
    fn zoos_assign_the_papers_counts() {
        for zoo in [ModelZoo::I, ModelZoo::Ii, ModelZoo::Iii] {
            assert_eq!(zoo.assign(50).len(), 50);
            assert_eq!(zoo.assign(10).len(), 10);
        }
        let iii = ModelZoo::Iii.assign(50);
        assert_eq!(iii.iter().filter(|&&k| k == ModelKind::Cnn4).count(), 14);
        assert_eq!(ModelZoo::Ii.assign(7), {
            use ModelKind::*;
            vec![
                MobilenetV1,
                MobilenetV1,
                MobilenetV1,
                MobilenetV2,
                MobilenetV2,
                MobilenetV3,
                MobilenetV3,
            ]
        });
        assert_eq!("iii".parse::<ModelZoo>().unwrap(), ModelZoo::Iii);
        assert!("iv".parse::<ModelZoo>().is_err());
    }

    /// Running the blocks one by one gives the model's logits, for every zoo architecture and
    /// both input shapes; the prefixed block declaration still covers every tensor.
    #[test]
    fn blockwise_forward_equals_forward() {
        let d = Device::flex();
        for &(kind, _) in ModelZoo::I.members() {
            for shape in [[1, 28, 28], [3, 32, 32]] {
                let model = ZooModel::new(kind, shape, 10, &d).unwrap();
                ParamTable::from_module_with_blocks(&model, model.blocks()).expect("blocks");
                let x = Tensor::<4>::random(
                    [3, shape[0], shape[1], shape[2]],
                    Distribution::Default,
                    &d,
                );
                let outputs = model.forward_all_blocks(x.clone());
                for (out, spec) in outputs.iter().zip(model.blocks()) {
                    assert_eq!(
                        out.sample_shape(),
                        spec.output_shape,
                        "{kind} {}",
                        spec.name
                    );
                }
                let blockwise = outputs.last().unwrap().clone().into_flat();
                let direct = model.forward(x);
                let (a, b) = (
                    blockwise.into_data().try_to_vec::<f32>().unwrap(),
                    direct.into_data().try_to_vec::<f32>().unwrap(),
                );
                assert_eq!(a, b, "{kind} {shape:?}");
            }
        }
        assert!(ZooModel::new(ModelKind::Vgg16, [3, 32, 32], 10, &d).is_err());
    }

    /// A candidate's chunked inference (`infer_candidate`, pFedClub's matching and teachers)
    /// gives `forward_candidate`'s logits bit for bit on every kernel tier: blocks of CNNs and
    /// MobileNets joined by stitches of every kind (a map shrunk by pooling, one grown by
    /// interpolation, a map to a vector, a vector to a map, vectors), on 40 samples (a full
    /// chunk and a partial one).
    #[cfg(feature = "flex")]
    #[test]
    fn chunked_candidates_give_the_logits_of_forward() {
        use ModelKind::*;
        use fl_core::strategy::pfedclub::cmsr::BlockRef;
        use fl_core::strategy::pfedclub::stitch::{
            Stitches, forward_candidate, infer_candidate, stitch_shapes,
        };
        use rand::SeedableRng;
        let d = Device::flex();
        let kinds = [Cnn1, Cnn3, MobilenetV2, Cnn4, MobilenetV3];
        let models: Vec<ZooModel> = kinds
            .iter()
            .map(|&k| ZooModel::new(k, [1, 28, 28], 10, &d).unwrap())
            .collect();
        let specs: Vec<Vec<BlockSpec>> = models.iter().map(|m| m.blocks()).collect();
        let last = |m: usize| specs[m].len() - 1;
        let candidates = [
            // Shrinking maps, then a map into an FC layer and the logits.
            vec![(0, 0), (1, 1), (2, 3), (3, last(3) - 1), (3, last(3))],
            // A map grown back to 28×28, a vector reshaped into a map.
            vec![
                (4, 0),
                (0, 0),
                (2, 2),
                (1, last(1) - 1),
                (2, 1),
                (4, last(4)),
            ],
            // One model's own blocks: no stitch.
            (0..=last(3)).map(|b| (3, b)).collect(),
        ];
        let x = Tensor::<4>::random([40, 1, 28, 28], Distribution::Default, &d);
        let bits = |t: Tensor<2>| t.into_data().try_to_vec::<f32>().unwrap();
        for (i, parts) in candidates.iter().enumerate() {
            let parts: Vec<BlockRef> = parts
                .iter()
                .map(|&(model, block)| BlockRef { model, block })
                .collect();
            let shapes = stitch_shapes(&parts, &specs, &[1, 28, 28], 10);
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(i as u64);
            let stitches = Stitches::new(&shapes, &mut rng, &d);
            crate::kernels::cpu::tests::at_every_isa(|isa| {
                assert_eq!(
                    bits(infer_candidate(&models, &parts, &stitches, x.clone())),
                    bits(forward_candidate(&models, &parts, &stitches, x.clone())),
                    "candidate {i}, {isa:?}"
                );
            });
        }
    }

    /// A frozen model is a fixed function even on the training device: no dropout, BatchNorm
    /// on running statistics.
    #[test]
    fn frozen_models_are_deterministic_on_the_autodiff_device() {
        let d = Device::flex().autodiff();
        for kind in [ModelKind::Cnn4, ModelKind::MobilenetV3] {
            let model = ZooModel::new(kind, [1, 28, 28], 10, &d).unwrap().freeze();
            let x = Tensor::<4>::random([4, 1, 28, 28], Distribution::Default, &d);
            let a = model
                .forward(x.clone())
                .into_data()
                .try_to_vec::<f32>()
                .unwrap();
            let b = model.forward(x).into_data().try_to_vec::<f32>().unwrap();
            assert_eq!(a, b, "{kind}");
        }
    }
}
