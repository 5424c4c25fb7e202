//! pFedHR (Wang et al., NeurIPS 2023): personalised FL over heterogeneous models by
//! *layer-level* model reassembly, as published. It runs as a server method of the
//! personalised engine ([`Method::Pfedhr`](super::pfedclub::Method::Pfedhr): every client keeps
//! its model and distills from the teacher the server matched to it, as in pFedClub). Each
//! round the server
//! 1. disassembles every uploaded model into its layers (CNN1–CNN4: each convolution and each
//!    fully connected layer with its activation and pooling; other models: their blocks, the
//!    smallest units they can run),
//! 2. groups the layers by function with K-means whose centres are mean input and output
//!    features on the public data: a layer joins the centre with the highest
//!    CKA(inputs) + CKA(outputs) ([`group_layers`]),
//! 3. samples *one* pool of candidates for all clients ([`sample_candidates`]): a layer from
//!    every group, then random layers up to a depth in `[min_layers, max_layers]`;
//!    convolutional layers before fully connected ones, each kind in its original depth order;
//!    a candidate needs both kinds,
//! 4. stitches each candidate's layers and fine-tunes the *whole* candidate (layers and
//!    stitches) on the public data ([`tune_candidate`]; labeled: cross-entropy, unlabeled:
//!    NT-Xent between augmented views),
//! 5. gives each client the candidate whose logits agree best (mean cosine) with its model's on
//!    the public data.
//!
//! pFedClub's critique is what this method lacks: no order rule across models, no completion,
//! candidates not built around the client's own model. Where the authors' code differs from the
//! paper, README's "Algorithm notes" says which one this follows.

use burn::optim::GradientsParams;
use fl_data::{Dataset, Normalization};
use rand::Rng;
use rand::seq::SliceRandom;

use super::pfedclub::cmsr::BlockRef;
use super::pfedclub::grouping::cka;
use super::pfedclub::stitch::{StitchTraining, Stitches, public_loss};
use crate::model::BlockForward;
use crate::rng::with_forward_stream;
use crate::trainer::FusedAdam;

/// pFedHR's own settings (the rest are shared with pFedClub: groups K, pool size, stitch
/// training, λ).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct PfedhrConfig {
    /// Fewest layers in a candidate (the authors' 4).
    pub min_layers: usize,
    /// Most layers in a candidate (the authors' 6).
    pub max_layers: usize,
    /// K-means update steps after the first assignment (the authors' 10).
    pub iterations: usize,
    /// Fine-tune (a copy of) each client's model on the public data before matching, as the
    /// authors' code does; the paper matches against the uploaded model (the default).
    pub tune_own: bool,
}

impl Default for PfedhrConfig {
    fn default() -> Self {
        Self {
            min_layers: 4,
            max_layers: 6,
            iterations: 10,
            tune_own: false,
        }
    }
}

impl PfedhrConfig {
    /// Checks the values a run cannot work with.
    pub fn validate(&self) -> Result<(), String> {
        if self.min_layers < 2 || self.min_layers > self.max_layers {
            return Err(format!(
                "pFedHR's candidates need 2 <= min layers <= max layers, got {} and {}",
                self.min_layers, self.max_layers
            ));
        }
        Ok(())
    }
}

/// Per-sample features `[rows, cols]`, row-major, on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct Matrix {
    /// Samples.
    pub rows: usize,
    /// Features per sample.
    pub cols: usize,
    /// The values.
    pub data: Vec<f64>,
}

impl Matrix {
    /// Features of a tensor `[n, d]`.
    pub fn from_tensor(x: burn::tensor::Tensor<2>) -> Self {
        let [rows, cols] = x.dims();
        let data = x
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .expect("f32 data")
            .into_iter()
            .map(f64::from)
            .collect();
        Self { rows, cols, data }
    }

    /// The same rows with columns of ones appended up to `cols` (the authors' padding, so that
    /// layers of different widths have a common mean).
    fn padded(&self, cols: usize) -> Self {
        let mut data = Vec::with_capacity(self.rows * cols);
        for row in self.data.chunks_exact(self.cols.max(1)).take(self.rows) {
            data.extend_from_slice(row);
            data.resize(data.len() + cols - self.cols, 1.0);
        }
        Self {
            rows: self.rows,
            cols,
            data,
        }
    }

    /// The centred linear Gram matrix (columns centred, then `X̄ X̄ᵀ`), `rows × rows`.
    fn gram(&self) -> Vec<f64> {
        let (n, d) = (self.rows, self.cols);
        let mut x = self.data.clone();
        for j in 0..d {
            let mean = (0..n).map(|i| x[i * d + j]).sum::<f64>() / n as f64;
            (0..n).for_each(|i| x[i * d + j] -= mean);
        }
        let mut g = vec![0.0; n * n];
        for i in 0..n {
            for k in i..n {
                let v: f64 = (0..d).map(|j| x[i * d + j] * x[k * d + j]).sum();
                g[i * n + k] = v;
                g[k * n + i] = v;
            }
        }
        g
    }
}

/// One layer's pooled input and output features on the public probe.
#[derive(Debug, Clone)]
pub struct LayerFeatures {
    /// Its inputs (feature maps averaged over space).
    pub input: Matrix,
    /// Its outputs.
    pub output: Matrix,
}

/// Groups layers by function: K-means over the layers' (padded) input and output features,
/// centres initialised at `k` random layers, each layer assigned to the centre with the highest
/// CKA(inputs) + CKA(outputs), centres moved to their members' mean, for `iterations` steps or
/// until nothing moves. A centre left without members drops out. Returns each layer's group,
/// numbered `0..` in order of first appearance.
pub fn group_layers<R: Rng>(
    layers: &[LayerFeatures],
    k: usize,
    iterations: usize,
    rng: &mut R,
) -> Vec<usize> {
    let n = layers.len();
    if n == 0 {
        return Vec::new();
    }
    let width_in = layers.iter().map(|l| l.input.cols).max().unwrap_or(0);
    let width_out = layers.iter().map(|l| l.output.cols).max().unwrap_or(0);
    let padded: Vec<(Matrix, Matrix)> = layers
        .iter()
        .map(|l| (l.input.padded(width_in), l.output.padded(width_out)))
        .collect();
    // Padding adds constant columns, which centring zeroes: a layer's own Gram is unchanged.
    let grams: Vec<(Vec<f64>, Vec<f64>)> =
        padded.iter().map(|(i, o)| (i.gram(), o.gram())).collect();
    let mut centres: Vec<Option<(Matrix, Matrix)>> = rand::seq::index::sample(rng, n, k.min(n))
        .into_iter()
        .map(|i| Some(padded[i].clone()))
        .collect();
    let assign = |centres: &[Option<(Matrix, Matrix)>]| -> Vec<usize> {
        let centre_grams: Vec<Option<(Vec<f64>, Vec<f64>)>> = centres
            .iter()
            .map(|c| c.as_ref().map(|(i, o)| (i.gram(), o.gram())))
            .collect();
        grams
            .iter()
            .map(|(gi, go)| {
                let mut best = (f64::NEG_INFINITY, 0);
                for (c, g) in centre_grams.iter().enumerate() {
                    if let Some((ci, co)) = g {
                        let s = cka(gi, ci) + cka(go, co);
                        if s > best.0 {
                            best = (s, c);
                        }
                    }
                }
                best.1
            })
            .collect()
    };
    let mut assignment = assign(&centres);
    for _ in 0..iterations {
        for (c, centre) in centres.iter_mut().enumerate() {
            let members: Vec<&(Matrix, Matrix)> = padded
                .iter()
                .zip(&assignment)
                .filter(|&(_, &a)| a == c)
                .map(|(p, _)| p)
                .collect();
            *centre = (!members.is_empty()).then(|| {
                let mean = |part: fn(&(Matrix, Matrix)) -> &Matrix| {
                    let first = part(members[0]);
                    let mut data = vec![0.0; first.data.len()];
                    for m in &members {
                        data.iter_mut()
                            .zip(&part(m).data)
                            .for_each(|(a, b)| *a += b / members.len() as f64);
                    }
                    Matrix { data, ..*first }
                };
                (mean(|p| &p.0), mean(|p| &p.1))
            });
        }
        let next = assign(&centres);
        if next == assignment {
            break;
        }
        assignment = next;
    }
    let mut ids: Vec<usize> = Vec::new();
    assignment
        .into_iter()
        .map(|a| match ids.iter().position(|&x| x == a) {
            Some(i) => i,
            None => {
                ids.push(a);
                ids.len() - 1
            }
        })
        .collect()
}

/// A layer of the round's models as candidate sampling sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layer {
    /// Where it is.
    pub at: BlockRef,
    /// A fully connected layer (flat output) rather than a convolutional one.
    pub fc: bool,
    /// Its depth among its model's layers of the same kind.
    pub depth: usize,
    /// Its functional group.
    pub group: usize,
}

/// Samples `count` candidates from the round's layers, as the authors do: for each depth from
/// `min_layers` to `max_layers` in turn, one random layer of every group plus random other
/// layers up to that depth; convolutional layers first, then fully connected ones, each in
/// depth order; a draw without both kinds starts over from `min_layers`.
pub fn sample_candidates<R: Rng>(
    layers: &[Layer],
    cfg: &PfedhrConfig,
    count: usize,
    rng: &mut R,
) -> Result<Vec<Vec<BlockRef>>, String> {
    if !(layers.iter().any(|l| l.fc) && layers.iter().any(|l| !l.fc)) {
        return Err(
            "pFedHR's candidates need both convolutional and fully connected layers; \
             the round's models do not have both"
                .into(),
        );
    }
    let groups = layers.iter().map(|l| l.group).max().map_or(0, |g| g + 1);
    let members: Vec<Vec<usize>> = (0..groups)
        .map(|g| {
            (0..layers.len())
                .filter(|&i| layers[i].group == g)
                .collect()
        })
        .filter(|m: &Vec<usize>| !m.is_empty())
        .collect();
    let mut out = Vec::with_capacity(count);
    // Each draw has both kinds with positive probability; the cap only guards the loop.
    for _attempt in 0..10_000 * count.max(1) {
        for depth in cfg.min_layers..=cfg.max_layers {
            let mut chosen: Vec<usize> = members
                .iter()
                .map(|m| m[rng.random_range(0..m.len())])
                .collect();
            let rest: Vec<usize> = (0..layers.len()).filter(|i| !chosen.contains(i)).collect();
            let extra = depth.saturating_sub(chosen.len()).min(rest.len());
            chosen.extend(
                rand::seq::index::sample(rng, rest.len(), extra)
                    .into_iter()
                    .map(|i| rest[i]),
            );
            let (mut fc, mut conv): (Vec<usize>, Vec<usize>) =
                chosen.into_iter().partition(|&i| layers[i].fc);
            if fc.is_empty() || conv.is_empty() {
                break;
            }
            conv.sort_by_key(|&i| layers[i].depth);
            fc.sort_by_key(|&i| layers[i].depth);
            out.push(conv.into_iter().chain(fc).map(|i| layers[i].at).collect());
            if out.len() == count {
                return Ok(out);
            }
        }
    }
    Err("pFedHR could not draw candidates with both layer kinds".into())
}

/// Fine-tunes a whole candidate (the copies of its source `models`, which must be trainable on
/// an autodiff device, and its `stitches`) on the public samples with Adam. Returns both.
#[allow(clippy::too_many_arguments)]
pub fn tune_candidate<M: BlockForward, R: Rng>(
    mut models: Vec<M>,
    parts: &[BlockRef],
    mut stitches: Stitches,
    data: &Dataset,
    norm: &Normalization,
    public: &[usize],
    cfg: &StitchTraining,
    rng: &mut R,
) -> (Vec<M>, Stitches) {
    let adam = || FusedAdam::pytorch(0.0);
    let mut model_optims: Vec<_> = models.iter().map(|_| adam().init()).collect();
    let mut stitch_optim = adam().init();
    let mut order = public.to_vec();
    // The layers' dropout draws from a stream of its own: candidates are tuned on any of the
    // pool's threads, and an unseeded stream would depend on which (and on a resume).
    let forward_seed: u64 = rng.random();
    with_forward_stream(forward_seed, || {
        for _ in 0..cfg.epochs {
            order.shuffle(rng);
            for batch in order.chunks(cfg.batch_size) {
                let Some(loss) =
                    public_loss(&models, parts, &stitches, data, norm, batch, cfg, rng)
                else {
                    continue;
                };
                let mut grads = loss.backward();
                models = models
                    .into_iter()
                    .zip(model_optims.iter_mut())
                    .map(|(m, optim)| {
                        let g = GradientsParams::from_module(&mut grads, &m);
                        optim.step(cfg.lr, m, g)
                    })
                    .collect();
                let g = GradientsParams::from_module(&mut grads, &stitches);
                stitches = stitch_optim.step(cfg.lr, stitches, g);
            }
        }
        (models, stitches)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn random(rows: usize, cols: usize, rng: &mut ChaCha8Rng) -> Matrix {
        let data = (0..rows * cols)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        Matrix { rows, cols, data }
    }

    fn scaled(m: &Matrix, by: f64) -> Matrix {
        let data = m.data.iter().map(|v| v * by).collect();
        Matrix { data, ..m.clone() }
    }

    #[test]
    fn padding_leaves_a_layers_own_similarity_unchanged() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let m = random(6, 3, &mut rng);
        let (a, b) = (m.gram(), m.padded(5).gram());
        assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-12));
    }

    #[test]
    fn layers_computing_the_same_function_share_a_group() {
        // Two functions (x and y features); layers of one function differ only in scale and
        // width (padding), which CKA ignores.
        let mut data = ChaCha8Rng::seed_from_u64(7);
        let (x_in, x_out) = (random(24, 4, &mut data), random(24, 6, &mut data));
        let (y_in, y_out) = (random(24, 8, &mut data), random(24, 3, &mut data));
        let layers: Vec<LayerFeatures> = [1.0, 2.0, 0.5]
            .iter()
            .flat_map(|&s| {
                [
                    LayerFeatures {
                        input: scaled(&x_in, s),
                        output: scaled(&x_out, s),
                    },
                    LayerFeatures {
                        input: scaled(&y_in, s),
                        output: scaled(&y_out, s),
                    },
                ]
            })
            .collect();
        let mut separated = 0;
        for seed in 0..20 {
            let g = group_layers(&layers, 2, 10, &mut ChaCha8Rng::seed_from_u64(seed));
            assert_eq!(g.len(), 6);
            assert_eq!((g[0], g[2], g[4]), (g[0], g[0], g[0]), "seed {seed}: {g:?}");
            assert_eq!((g[1], g[3], g[5]), (g[1], g[1], g[1]), "seed {seed}: {g:?}");
            assert_eq!(g[0], 0, "groups are numbered by first appearance");
            // Random initial centres (no k-means++): when both start on one function, the
            // other centre is never nearer and drops out. Otherwise the functions separate.
            let init = rand::seq::index::sample(&mut ChaCha8Rng::seed_from_u64(seed), 6, 2);
            let apart = init.index(0) % 2 != init.index(1) % 2;
            assert_eq!(g[0] != g[1], apart, "seed {seed}: {g:?}");
            separated += usize::from(apart);
        }
        assert!(separated > 0);
    }

    fn zoo() -> Vec<Layer> {
        // Two models: 2 conv + 2 fc, and 3 conv + 1 fc; groups by kind and depth.
        let mut layers = Vec::new();
        for (model, (convs, fcs)) in [(2, 2), (3, 1)].into_iter().enumerate() {
            for block in 0..convs + fcs {
                let fc = block >= convs;
                let depth = if fc { block - convs } else { block };
                let group = if fc { 2 } else { depth.min(1) };
                let at = BlockRef { model, block };
                layers.push(Layer {
                    at,
                    fc,
                    depth,
                    group,
                });
            }
        }
        layers
    }

    #[test]
    fn candidates_follow_the_authors_rules() {
        let layers = zoo();
        let of = |b: &BlockRef| *layers.iter().find(|l| l.at == *b).expect("a layer");
        let cfg = PfedhrConfig {
            min_layers: 3,
            max_layers: 5,
            ..PfedhrConfig::default()
        };
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let pool = sample_candidates(&layers, &cfg, 40, &mut rng).unwrap();
        assert_eq!(pool.len(), 40);
        for c in &pool {
            let info: Vec<Layer> = c.iter().map(of).collect();
            assert!((3..=5).contains(&c.len()), "{c:?}");
            for g in 0..3 {
                assert!(
                    info.iter().any(|l| l.group == g),
                    "group {g} missing: {c:?}"
                );
            }
            let split = info.iter().position(|l| l.fc).expect("an fc layer");
            assert!(split > 0 && info[split..].iter().all(|l| l.fc), "{c:?}");
            for kind in [&info[..split], &info[split..]] {
                assert!(kind.windows(2).all(|w| w[0].depth <= w[1].depth), "{c:?}");
            }
            let mut seen = c.clone();
            seen.sort_by_key(|b| (b.model, b.block));
            seen.dedup();
            assert_eq!(seen.len(), c.len(), "a layer twice: {c:?}");
        }
        // Every depth is drawn in turn.
        let lengths: Vec<usize> = pool.iter().map(Vec::len).collect();
        assert!((3..=5).all(|d| lengths.contains(&d)), "{lengths:?}");
        let again = sample_candidates(&layers, &cfg, 40, &mut ChaCha8Rng::seed_from_u64(3));
        assert_eq!(again.unwrap(), pool, "seeded");
    }

    #[test]
    fn candidates_need_both_layer_kinds() {
        let convs: Vec<Layer> = zoo().into_iter().filter(|l| !l.fc).collect();
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let err = sample_candidates(&convs, &PfedhrConfig::default(), 2, &mut rng).unwrap_err();
        assert!(err.contains("both"), "{err}");
        assert!(
            PfedhrConfig {
                min_layers: 5,
                max_layers: 4,
                ..PfedhrConfig::default()
            }
            .validate()
            .is_err()
        );
    }
}
