//! What the engine needs from a model.

use burn::module::Module;
use burn::tensor::Tensor;

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
}
