//! What the engine needs from a model.

use burn::module::Module;
use burn::tensor::Tensor;
use rayon::prelude::*;

use crate::layers::BlockSpec;

/// An image classifier the engine can train, evaluate and take apart (`Sync` so evaluation can
/// share it across threads).
///
/// Implement it for any `#[derive(Module)]` struct to use the engine and strategies with your own
/// architecture; `blocks` is optional and only needed for block-level operations.
pub trait Classifier: Module + Sync + 'static {
    /// Maps a batch of images `[N, C, H, W]` to logits `[N, classes]`.
    fn forward(&self, images: Tensor<4>) -> Tensor<2>;

    /// The model's ordered blocks (module path prefixes with input/output shapes); empty if the
    /// model declares none.
    fn blocks(&self) -> Vec<BlockSpec> {
        Vec::new()
    }

    /// The model's representation of each image `[N, D]`: the input of its final linear layer
    /// (MOON's representation, FedGen's latent space). `None` if the model does not expose it;
    /// a model that does must satisfy `forward(x) == head(features(x))`.
    fn features(&self, images: Tensor<4>) -> Option<Tensor<2>> {
        let _ = images;
        None
    }

    /// The final linear layer applied to representations `[N, D]` from
    /// [`features`](Self::features) (or generated ones, as FedGen does); `None` if the model does
    /// not expose it.
    fn head(&self, features: Tensor<2>) -> Option<Tensor<2>> {
        let _ = features;
        None
    }

    /// Logits for evaluation, where nothing is differentiated: [`forward`](Self::forward)'s
    /// values bit for bit, possibly computed in another order of work (`fl-models`' models run
    /// their feature-map blocks on cache-sized chunks of the batch).
    fn infer(&self, images: Tensor<4>) -> Tensor<2> {
        self.forward(images)
    }
}

/// The activation passed from one block to the next: a feature map `[N, C, H, W]` or a flat
/// vector `[N, D]` per sample.
#[derive(Debug, Clone)]
pub enum Features {
    /// A feature map.
    Map(Tensor<4>),
    /// Flat features (after flattening or pooling).
    Flat(Tensor<2>),
}

impl Features {
    /// The per-sample shape (`[C, H, W]` or `[D]`), as in [`BlockSpec`].
    pub fn sample_shape(&self) -> Vec<usize> {
        match self {
            Self::Map(x) => x.dims()[1..].to_vec(),
            Self::Flat(x) => vec![x.dims()[1]],
        }
    }

    /// The batch size.
    pub fn batch_size(&self) -> usize {
        match self {
            Self::Map(x) => x.dims()[0],
            Self::Flat(x) => x.dims()[0],
        }
    }

    /// The features as a feature map (flat features become `[N, D, 1, 1]`).
    pub fn into_map(self) -> Tensor<4> {
        match self {
            Self::Map(x) => x,
            Self::Flat(x) => {
                let [n, d] = x.dims();
                x.reshape([n, d, 1, 1])
            }
        }
    }

    /// The features flattened to `[N, D]` (a map in C, H, W order, as PyTorch's `flatten`).
    pub fn into_flat(self) -> Tensor<2> {
        match self {
            Self::Map(x) => x.flatten(1, 3),
            Self::Flat(x) => x,
        }
    }

    /// One vector per sample for representation similarity: feature maps are averaged over
    /// space (`[N, C]`), flat features are kept.
    pub fn pooled(self) -> Tensor<2> {
        match self {
            Self::Map(x) => {
                let [n, c, h, w] = x.dims();
                x.reshape([n, c, h * w]).mean_dim(2).reshape([n, c])
            }
            Self::Flat(x) => x,
        }
    }

    /// Detaches the features from the autodiff graph.
    pub fn detach(self) -> Self {
        match self {
            Self::Map(x) => Self::Map(x.detach()),
            Self::Flat(x) => Self::Flat(x.detach()),
        }
    }
}

/// `f` applied in parallel to consecutive chunks of `chunk` samples of `images` (the last one
/// possibly shorter), its outputs concatenated in order: how inference runs feature-map blocks
/// chunk by chunk ([`BlockForward::inference_chunk`]).
///
/// A last chunk of one sample joins the one before it: a lone sample makes matrix products one
/// sample wide, which `gemm` may sum in another order than the same sample among others (a
/// matrix-vector product on a 1×1 map, 512-deep blocks under 64 columns), so its outputs could
/// differ in the last bits from the whole batch's.
///
/// # Panics
/// If `chunk` is 0.
pub fn map_in_chunks<F>(images: Tensor<4>, chunk: usize, f: F) -> Tensor<4>
where
    F: Fn(Tensor<4>) -> Tensor<4> + Sync + Send,
{
    assert!(chunk > 0, "map_in_chunks: chunks of 0 samples");
    let n = images.dims()[0];
    let mut bounds: Vec<usize> = (0..n).step_by(chunk).chain([n]).collect();
    if n > chunk && n % chunk == 1 {
        bounds.remove(bounds.len() - 2);
    }
    let outputs = bounds
        .par_windows(2)
        .map(|w| f(images.clone().narrow(0, w[0], w[1] - w[0])))
        .collect();
    Tensor::cat(outputs, 0)
}

/// A [`Classifier`] whose declared blocks can be run one at a time: what block-level model
/// surgery (pFedClub's reassembly and stitching) needs.
///
/// Running every block in order on the images must give the same logits as
/// [`Classifier::forward`] (and the last block's output is the logits).
pub trait BlockForward: Classifier {
    /// Runs block `index` (of [`Classifier::blocks`]) on `x`, which has that block's input
    /// shape; returns features with its output shape.
    ///
    /// # Panics
    /// If `index` is not a block of the model or `x` has the wrong shape.
    fn forward_block(&self, index: usize, x: Features) -> Features;

    /// Samples per chunk in which inference may run this model's feature-map blocks on
    /// `images` chunk by chunk and still give the whole batch's outputs bit for bit (its
    /// kernels compute each sample alone, in an order that does not depend on the batch), as
    /// its own [`Classifier::infer`] does; `None` (the default) where that does not hold.
    fn inference_chunk(&self, images: &Tensor<4>) -> Option<usize> {
        let _ = images;
        None
    }

    /// Runs the blocks in order and returns every block's output (the inputs of block `i > 0`
    /// are the outputs of block `i − 1`).
    fn forward_all_blocks(&self, images: Tensor<4>) -> Vec<Features> {
        let mut outputs: Vec<Features> = Vec::new();
        let mut x = Features::Map(images);
        for i in 0..self.blocks().len() {
            x = self.forward_block(i, x);
            outputs.push(x.clone());
        }
        outputs
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use burn::tensor::{Device, TensorData};

    use super::*;

    /// Chunks cover the batch in order; a lone last sample joins the chunk before it.
    #[test]
    fn chunks_cover_the_batch_and_never_leave_a_sample_alone() {
        let d = Device::default();
        for (n, expected) in [
            (1, vec![1]),
            (31, vec![31]),
            (32, vec![32]),
            (33, vec![33]),
            (34, vec![32, 2]),
            (65, vec![32, 33]),
            (70, vec![32, 32, 6]),
        ] {
            let values: Vec<f32> = (0..n * 2).map(|i| i as f32).collect();
            let images = Tensor::<4>::from_data(TensorData::new(values.clone(), [n, 2, 1, 1]), &d);
            let sizes = Mutex::new(Vec::new());
            let out = map_in_chunks(images, 32, |x| {
                let first = x.clone().into_data().try_to_vec::<f32>().unwrap()[0] as usize / 2;
                sizes.lock().unwrap().push((first, x.dims()[0]));
                x
            });
            let mut sizes = sizes.into_inner().unwrap();
            sizes.sort();
            let sizes: Vec<usize> = sizes.into_iter().map(|(_, size)| size).collect();
            assert_eq!(sizes, expected, "{n} samples");
            assert_eq!(
                out.into_data().try_to_vec::<f32>().unwrap(),
                values,
                "{n} samples"
            );
        }
    }
}
