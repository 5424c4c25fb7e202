//! Reassembled candidate models: frozen blocks from different models joined by learnable
//! stitching layers (pFedClub, Section 4.2), their fine-tuning on the public data, and their
//! use as a distillation teacher.

use burn::module::{Module, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::optim::GradientsParams;
use burn::tensor::activation::{log_softmax, relu, softmax};
use burn::tensor::module::{adaptive_avg_pool2d, interpolate};
use burn::tensor::ops::{InterpolateMode, InterpolateOptions};
use burn::tensor::{Device, Int, Tensor, TensorData};
use fl_data::{Dataset, Normalization};
use rand::Rng;
use rand::seq::SliceRandom;

use super::cmsr::BlockRef;
use crate::layers::BlockSpec;
use crate::model::{BlockForward, Features, map_in_chunks};
use crate::trainer::{BatchContext, FusedAdam, LocalObjective, make_batch};

/// A stitching layer `ReLU(Wᵀx + b)` that maps one block's output shape to the next block's
/// input shape.
///
/// The paper defines it on vectors; for feature maps we use the equivalent per-pixel form (a
/// 1×1 convolution over channels) after resizing the map to the target's height and width
/// (adaptive average pooling to shrink, nearest-neighbour to grow). A map feeding a flat input
/// is average-pooled over space first, a vector feeding a map is reshaped after the linear map.
/// The layer after the last block (mapping to the logits) has no ReLU.
#[derive(Module, Debug)]
pub struct Stitch {
    linear: Linear,
    #[module(skip)]
    to: Vec<usize>,
    #[module(skip)]
    relu: bool,
}

/// The linear map's input and output widths for a stitch from `from` to `to`.
fn widths(from: &[usize], to: &[usize]) -> (usize, usize) {
    let out = if to.len() == 3 {
        if from.len() == 3 {
            to[0]
        } else {
            to.iter().product()
        }
    } else {
        to[0]
    };
    (from[0], out)
}

impl Stitch {
    /// Trainable parameters of a stitch from shape `from` to `to`.
    pub fn num_params(from: &[usize], to: &[usize]) -> usize {
        let (i, o) = widths(from, to);
        (i + 1) * o
    }

    /// A stitch from per-sample shape `from` to `to`, initialised as PyTorch's `Linear`
    /// (uniform in ±1/√fan-in) from `rng`, so parallel candidates stay deterministic.
    pub fn new<R: Rng>(
        from: &[usize],
        to: &[usize],
        relu: bool,
        rng: &mut R,
        device: &Device,
    ) -> Self {
        let (i, o) = widths(from, to);
        let bound = 1.0 / (i as f32).sqrt();
        let mut draw =
            |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-bound..bound)).collect() };
        let mut linear = LinearConfig::new(i, o).init(device);
        linear.weight = Param::from_tensor(Tensor::from_data(
            TensorData::new(draw(i * o), [i, o]),
            device,
        ));
        linear.bias = Some(Param::from_tensor(Tensor::from_data(
            TensorData::new(draw(o), [o]),
            device,
        )));
        Self {
            linear,
            to: to.to_vec(),
            relu,
        }
    }

    /// Maps features to the target shape.
    pub fn forward(&self, x: Features) -> Features {
        let out = match (x, self.to.as_slice()) {
            (Features::Map(map), &[_, h, w]) => {
                let [_, _, h0, w0] = map.dims();
                let map = if (h0, w0) == (h, w) {
                    map
                } else if h0 >= h && w0 >= w {
                    adaptive_avg_pool2d(map, [h, w])
                } else {
                    interpolate(
                        map,
                        InterpolateOptions::new(InterpolateMode::Nearest).with_output_size([h, w]),
                    )
                };
                // 1×1 convolution = the linear map applied at every pixel (channels last).
                let y = self
                    .linear
                    .forward(map.permute([0, 2, 3, 1]))
                    .permute([0, 3, 1, 2]);
                Features::Map(y)
            }
            (Features::Flat(v), &[c, h, w]) => {
                let n = v.dims()[0];
                Features::Map(self.linear.forward(v).reshape([n, c, h, w]))
            }
            (x, _) => Features::Flat(self.linear.forward(x.pooled())),
        };
        if !self.relu {
            return out;
        }
        match out {
            Features::Map(m) => Features::Map(relu(m)),
            Features::Flat(v) => Features::Flat(relu(v)),
        }
    }
}

/// The stitching layers of one candidate: `layers[k]` goes before part `k` (none when the shapes
/// already agree), `layers[parts]` after the last part (to the logits, if needed).
#[derive(Module, Debug)]
pub struct Stitches {
    layers: Vec<Option<Stitch>>,
}

/// The shapes of a candidate's stitches, before any are built.
pub fn stitch_shapes(
    parts: &[BlockRef],
    specs: &[Vec<BlockSpec>],
    input_shape: &[usize],
    num_classes: usize,
) -> Vec<Option<(Vec<usize>, Vec<usize>)>> {
    let mut shape = input_shape.to_vec();
    let mut out = Vec::with_capacity(parts.len() + 1);
    for part in parts {
        let spec = &specs[part.model][part.block];
        out.push((shape != spec.input_shape).then(|| (shape.clone(), spec.input_shape.clone())));
        shape = spec.output_shape.clone();
    }
    out.push((shape != [num_classes]).then(|| (shape, vec![num_classes])));
    out
}

impl Stitches {
    /// Builds the stitches for `shapes` (from [`stitch_shapes`]).
    pub fn new<R: Rng>(
        shapes: &[Option<(Vec<usize>, Vec<usize>)>],
        rng: &mut R,
        device: &Device,
    ) -> Self {
        let last = shapes.len() - 1;
        let layers = shapes
            .iter()
            .enumerate()
            .map(|(k, s)| {
                s.as_ref()
                    .map(|(from, to)| Stitch::new(from, to, k != last, rng, device))
            })
            .collect();
        Self { layers }
    }

    /// Whether there is anything to train.
    pub fn is_empty(&self) -> bool {
        self.layers.iter().all(Option::is_none)
    }
}

/// Runs a candidate: `models` are the round's models, `parts` the blocks in order.
pub fn forward_candidate<M: BlockForward>(
    models: &[M],
    parts: &[BlockRef],
    stitches: &Stitches,
    images: Tensor<4>,
) -> Tensor<2> {
    let x = run_parts(
        models,
        parts,
        stitches,
        0..parts.len(),
        Features::Map(images),
    );
    to_logits(&stitches.layers[parts.len()], x)
}

/// Parts `range` of a candidate (each after its stitch, if any) on `x`.
fn run_parts<M: BlockForward>(
    models: &[M],
    parts: &[BlockRef],
    stitches: &Stitches,
    range: std::ops::Range<usize>,
    x: Features,
) -> Features {
    range.fold(x, |x, k| {
        let x = match &stitches.layers[k] {
            Some(s) => s.forward(x),
            None => x,
        };
        models[parts[k].model].forward_block(parts[k].block, x)
    })
}

/// The last part's output through `head`, the stitch to the logits (if any).
fn to_logits(head: &Option<Stitch>, x: Features) -> Tensor<2> {
    match head {
        Some(head) => head.forward(x).into_flat(),
        None => x.into_flat(),
    }
}

/// [`forward_candidate`]'s logits bit for bit, faster: where every model it uses allows it
/// ([`BlockForward::inference_chunk`]), the parts whose outputs are feature maps (with the
/// stitches before them, which map each pixel or sample alone) run on chunks of the batch in
/// parallel, each chunk through all of them as one task so that its maps stay in a core's
/// caches, as the models' own [`Classifier::infer`](crate::Classifier::infer) does; the rest
/// runs on the whole batch.
pub fn infer_candidate<M: BlockForward>(
    models: &[M],
    parts: &[BlockRef],
    stitches: &Stitches,
    images: Tensor<4>,
) -> Tensor<2> {
    let n = images.dims()[0];
    let maps = parts
        .iter()
        .take_while(|p| models[p.model].blocks()[p.block].output_shape.len() == 3)
        .count();
    let chunk = parts
        .iter()
        .map(|p| models[p.model].inference_chunk(&images))
        .min()
        .flatten();
    let chunk = match chunk {
        Some(chunk) if maps > 0 && n > chunk => chunk,
        _ => return forward_candidate(models, parts, stitches, images),
    };
    let maps_out = map_in_chunks(images, chunk, |x| {
        run_parts(models, parts, stitches, 0..maps, Features::Map(x)).into_map()
    });
    let x = run_parts(
        models,
        parts,
        stitches,
        maps..parts.len(),
        Features::Map(maps_out),
    );
    to_logits(&stitches.layers[parts.len()], x)
}

/// How stitching layers are fine-tuned on the public data.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StitchTraining {
    /// Passes over the public samples.
    pub epochs: usize,
    /// Mini-batch size.
    pub batch_size: usize,
    /// Adam learning rate.
    pub lr: f64,
    /// Cross-entropy on the public labels (`true`) or NT-Xent between two augmented views
    /// (`false`: the public data is treated as unlabeled).
    pub labeled: bool,
    /// NT-Xent temperature.
    pub temperature: f64,
}

/// A public batch with random augmentations for contrastive learning: each image shifted by up
/// to 2 pixels in each direction (zero fill) and, for colour images, flipped horizontally with
/// probability ½.
pub fn augmented_batch<R: Rng>(
    data: &Dataset,
    norm: &Normalization,
    indices: &[usize],
    rng: &mut R,
    device: &Device,
) -> Tensor<4> {
    let (pixels, _) = data.batch(indices, norm);
    let [c, h, w] = data.image_shape();
    let mut out = vec![0.0f32; pixels.len()];
    for (src, dst) in pixels
        .chunks_exact(c * h * w)
        .zip(out.chunks_exact_mut(c * h * w))
    {
        let (dy, dx) = (rng.random_range(-2i64..=2), rng.random_range(-2i64..=2));
        let flip = c == 3 && rng.random_bool(0.5);
        for ch in 0..c {
            for y in 0..h as i64 {
                for x in 0..w as i64 {
                    let (sy, mut sx) = (y - dy, x - dx);
                    if flip {
                        sx = w as i64 - 1 - sx;
                    }
                    if (0..h as i64).contains(&sy) && (0..w as i64).contains(&sx) {
                        dst[(ch * h + y as usize) * w + x as usize] =
                            src[(ch * h + sy as usize) * w + sx as usize];
                    }
                }
            }
        }
    }
    Tensor::from_data(TensorData::new(out, [indices.len(), c, h, w]), device)
}

/// The NT-Xent loss (SimCLR) of two views' representations `[n, d]` at temperature `tau`: each
/// sample's other view is its positive, the other 2n − 2 samples are negatives.
pub fn nt_xent(z1: Tensor<2>, z2: Tensor<2>, tau: f64) -> Tensor<1> {
    let n = z1.dims()[0];
    let device = z1.device();
    let z = Tensor::cat(vec![z1, z2], 0);
    let norm = z.clone().powf_scalar(2.0).sum_dim(1).sqrt().clamp_min(1e-8);
    let z = z / norm;
    let sim = z.clone().matmul(z.transpose()).div_scalar(tau);
    // A sample is not its own negative: push the diagonal far below every other logit.
    let eye = Tensor::<2>::eye(2 * n, &device);
    let sim = sim - eye.mul_scalar(1e9);
    let targets: Vec<i64> = (0..2 * n).map(|i| ((i + n) % (2 * n)) as i64).collect();
    let targets = Tensor::<1, Int>::from_data(TensorData::new(targets, [2 * n]), &device);
    CrossEntropyLossConfig::new()
        .init(&device)
        .forward(sim, targets)
}

/// A candidate's loss on one public batch: cross-entropy on the labels, or NT-Xent between two
/// augmented views when the public data is unlabeled (`None` for a single sample: NT-Xent needs
/// a negative).
#[allow(clippy::too_many_arguments)]
pub fn public_loss<M: BlockForward, R: Rng>(
    models: &[M],
    parts: &[BlockRef],
    stitches: &Stitches,
    data: &Dataset,
    norm: &Normalization,
    batch: &[usize],
    cfg: &StitchTraining,
    rng: &mut R,
) -> Option<Tensor<1>> {
    let device = stitches
        .devices()
        .into_iter()
        .chain(models.iter().flat_map(Module::devices))
        .next()
        .expect("a device");
    if cfg.labeled {
        let (images, labels) = make_batch(data, norm, batch, &device);
        let logits = forward_candidate(models, parts, stitches, images);
        return Some(
            CrossEntropyLossConfig::new()
                .init(&device)
                .forward(logits, labels),
        );
    }
    if batch.len() < 2 {
        return None;
    }
    let v1 = augmented_batch(data, norm, batch, rng, &device);
    let v2 = augmented_batch(data, norm, batch, rng, &device);
    let z1 = forward_candidate(models, parts, stitches, v1);
    let z2 = forward_candidate(models, parts, stitches, v2);
    Some(nt_xent(z1, z2, cfg.temperature))
}

/// Fine-tunes `stitches` of a candidate on the public samples while every block stays frozen
/// (`models` must be frozen and on an autodiff device). Returns the trained stitches.
#[allow(clippy::too_many_arguments)]
pub fn fit_stitches<M: BlockForward, R: Rng>(
    models: &[M],
    parts: &[BlockRef],
    mut stitches: Stitches,
    data: &Dataset,
    norm: &Normalization,
    public: &[usize],
    cfg: &StitchTraining,
    rng: &mut R,
) -> Stitches {
    if stitches.is_empty() || public.is_empty() {
        return stitches;
    }
    let mut optim = FusedAdam::pytorch(0.0).init();
    let mut order = public.to_vec();
    for _ in 0..cfg.epochs {
        order.shuffle(rng);
        for batch in order.chunks(cfg.batch_size) {
            let Some(loss) = public_loss(models, parts, &stitches, data, norm, batch, cfg, rng)
            else {
                continue;
            };
            let grads = GradientsParams::from_grads(loss.backward(), &stitches);
            stitches = optim.step(cfg.lr, stitches, grads);
        }
    }
    stitches
}

/// The mean cosine similarity between two sets of logits, row by row.
pub fn mean_cosine(a: Tensor<2>, b: Tensor<2>) -> f64 {
    let dot = (a.clone() * b.clone()).sum_dim(1);
    let na = a.powf_scalar(2.0).sum_dim(1).sqrt();
    let nb = b.powf_scalar(2.0).sum_dim(1).sqrt();
    let cos = dot / (na * nb).clamp_min(1e-12);
    cos.mean().into_scalar::<f32>() as f64
}

/// A client's distillation teacher: a fine-tuned candidate, on a device without autodiff.
#[derive(Debug, Clone)]
pub struct Teacher<M> {
    /// The models the candidate's blocks come from (only those it uses).
    pub models: Vec<M>,
    /// The blocks, indexing into `models`.
    pub parts: Vec<BlockRef>,
    /// The trained stitching layers.
    pub stitches: Stitches,
    /// Distillation weight λ.
    pub weight: f64,
}

impl<M: BlockForward> Teacher<M> {
    /// The teacher's logits (no gradient).
    pub fn logits(&self, images: Tensor<4>) -> Tensor<2> {
        infer_candidate(&self.models, &self.parts, &self.stitches, images)
    }
}

impl<M: BlockForward> LocalObjective for Teacher<M> {
    fn uses_parameters(&self) -> bool {
        false
    }

    /// λ · KL(p_teacher ‖ p_student), averaged over the batch.
    fn batch_loss(&self, batch: &BatchContext<'_>) -> Option<Tensor<1>> {
        let teacher = self.logits(batch.images.clone().inner());
        let p = softmax(teacher.clone(), 1);
        let log_p = log_softmax(teacher, 1);
        let log_q = log_softmax(batch.logits.clone(), 1);
        let kl = (p * (log_p - log_q)).sum_dim(1).mean();
        Some(kl.mul_scalar(self.weight))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn stitches_map_every_shape_pair() {
        let d = Device::flex();
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let cases: [(&[usize], &[usize]); 5] = [
            (&[8, 14, 14], &[16, 7, 7]),
            (&[8, 7, 7], &[4, 14, 14]),
            (&[8, 7, 7], &[30]),
            (&[30], &[4, 3, 3]),
            (&[30], &[10]),
        ];
        for (from, to) in cases {
            let s = Stitch::new(from, to, true, &mut rng, &d);
            let x = if from.len() == 3 {
                Features::Map(Tensor::ones([2, from[0], from[1], from[2]], &d))
            } else {
                Features::Flat(Tensor::ones([2, from[0]], &d))
            };
            let y = s.forward(x);
            assert_eq!(y.sample_shape(), to.to_vec(), "{from:?} -> {to:?}");
            let params = crate::ParamTable::from_module(&s).num_trainable();
            assert_eq!(params, Stitch::num_params(from, to));
        }
    }

    #[test]
    fn nt_xent_prefers_matching_views() {
        let d = Device::flex();
        let z = Tensor::<2>::from_data(
            TensorData::new(vec![1.0f32, 0.0, 0.0, 1.0, -1.0, 0.0], [3, 2]),
            &d,
        );
        let aligned = nt_xent(z.clone(), z.clone(), 0.07).into_scalar::<f32>();
        let shuffled = nt_xent(z.clone(), z.clone().flip([0]), 0.07).into_scalar::<f32>();
        assert!(aligned < 0.1, "{aligned}");
        assert!(shuffled > aligned + 1.0, "{shuffled}");
    }
}
