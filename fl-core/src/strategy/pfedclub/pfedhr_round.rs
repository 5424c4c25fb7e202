//! pFedHR's server step on the personalised engine: the algorithm's parts live in
//! [`crate::strategy::pfedhr`]; this runs them on the round's uploads and hands out teachers.

use std::sync::Arc;
use std::time::Instant;

use burn::module::Module;
use burn::tensor::Tensor;
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use super::cmsr::BlockRef;
use super::reassemble::{agreement, used_models};
use super::stitch::{Stitch, Stitches, Teacher, stitch_shapes};
use super::{Assigned, Matched, PFedClub};
use crate::layers::BlockSpec;
use crate::model::{BlockForward, Features};
use crate::rng::{Purpose, rng_for};
use crate::strategy::StrategyError;
use crate::strategy::pfedhr::{self, Layer, LayerFeatures, Matrix};
use crate::trainer::make_batch;

/// A tuned candidate of the round's pool, shared by the clients matched to it.
struct Tuned<M> {
    teacher: Arc<Teacher<M>>,
    /// The clients whose uploads its layers come from.
    sources: Vec<usize>,
    /// Trainable parameters (layers and stitches).
    size: usize,
}

impl<M: BlockForward> PFedClub<'_, M> {
    /// pFedHR's server step for the round's uploaded models (in `clients` order); the round's
    /// server generator `server_rng` draws the K-means centres and the candidate pool. The
    /// pool's search and tuning are shared: their seconds are reported with the first client.
    pub(super) fn pfedhr(
        &self,
        round: usize,
        clients: &[usize],
        server_rng: &mut ChaCha8Rng,
    ) -> Result<(Vec<Matched<M>>, [f64; 2]), StrategyError> {
        let timer = Instant::now();
        let (club, cfg) = (&self.club, &self.club.pfedhr);
        let (data, norm, public) = (
            self.public.data,
            self.public.normalization,
            self.public.samples,
        );
        let load = |c: usize| -> Result<M, StrategyError> {
            Ok(self.tables[c].load_into((self.build)(c))?)
        };
        let inference: Vec<M> = clients
            .iter()
            .map(|&c| Ok(load(c)?.valid()))
            .collect::<Result<_, StrategyError>>()?;
        let base = inference[0].devices().into_iter().next().expect("a device");
        let specs: Vec<&Vec<BlockSpec>> = clients.iter().map(|&c| &self.specs[c]).collect();

        // 1–2. Every model's layers, grouped by the function they compute on a public probe.
        let probe = &public[..club.cka_samples.min(public.len())];
        let (images, _) = make_batch(data, norm, probe, &base);
        let features: Vec<Vec<LayerFeatures>> = inference
            .par_iter()
            .map(|m| {
                let mut input = Matrix::from_tensor(Features::Map(images.clone()).pooled());
                m.forward_all_blocks(images.clone())
                    .into_iter()
                    .map(|o| {
                        let output = Matrix::from_tensor(o.pooled());
                        let input = std::mem::replace(&mut input, output.clone());
                        LayerFeatures { input, output }
                    })
                    .collect()
            })
            .collect();
        let features_seconds = timer.elapsed().as_secs_f64();
        let timer = Instant::now();
        let at: Vec<BlockRef> = features
            .iter()
            .enumerate()
            .flat_map(|(model, f)| (0..f.len()).map(move |block| BlockRef { model, block }))
            .collect();
        let flat: Vec<LayerFeatures> = features.into_iter().flatten().collect();
        let groups = pfedhr::group_layers(&flat, club.groups, cfg.iterations, server_rng);
        let is_fc = |b: &BlockSpec| b.output_shape.len() == 1;
        let layers: Vec<Layer> = at
            .iter()
            .zip(groups)
            .map(|(&at, group)| {
                let model = specs[at.model];
                let fc = is_fc(&model[at.block]);
                let depth = model[..at.block].iter().filter(|b| is_fc(b) == fc).count();
                Layer {
                    at,
                    fc,
                    depth,
                    group,
                }
            })
            .collect();
        let grouping = timer.elapsed().as_secs_f64();

        // 3. One pool of candidates for every client.
        let timer = Instant::now();
        let pool = pfedhr::sample_candidates(&layers, cfg, club.candidates, server_rng)
            .map_err(StrategyError::Config)?;
        let search = timer.elapsed().as_secs_f64();

        // 4. Each candidate stitched and tuned whole on the public data, in parallel.
        let timer = Instant::now();
        let input_shape = data.image_shape().to_vec();
        let classes = data.num_classes();
        let tuned: Vec<Tuned<M>> = pool
            .par_iter()
            .enumerate()
            .map(|(k, parts)| -> Result<Tuned<M>, StrategyError> {
                let mut rng: ChaCha8Rng =
                    rng_for(self.seed, Purpose::Server, round as u64, 1 + k as u64);
                let (used, parts) = used_models(parts);
                let used_specs: Vec<Vec<BlockSpec>> =
                    used.iter().map(|&u| specs[u].clone()).collect();
                let shapes = stitch_shapes(&parts, &used_specs, &input_shape, classes);
                let models: Vec<M> = used
                    .iter()
                    .map(|&u| load(clients[u]))
                    .collect::<Result<_, _>>()?;
                let device = models[0].devices().into_iter().next().expect("a device");
                let stitches = Stitches::new(&shapes, &mut rng, &device);
                let (models, stitches) = pfedhr::tune_candidate(
                    models,
                    &parts,
                    stitches,
                    data,
                    norm,
                    public,
                    &club.stitch,
                    &mut rng,
                );
                let size = parts
                    .iter()
                    .map(|p| self.block_params[clients[used[p.model]]][p.block])
                    .sum::<usize>()
                    + shapes
                        .iter()
                        .flatten()
                        .map(|(from, to)| Stitch::num_params(from, to))
                        .sum::<usize>();
                let teacher = Teacher {
                    models: models.iter().map(Module::valid).collect(),
                    parts,
                    stitches: stitches.valid(),
                    weight: club.distill_weight,
                };
                Ok(Tuned {
                    teacher: Arc::new(teacher),
                    sources: used.iter().map(|&u| clients[u]).collect(),
                    size,
                })
            })
            .collect::<Result<_, _>>()?;
        let stitching = timer.elapsed().as_secs_f64();

        // 5. Each client's best match by the agreement of logits on the public data.
        let batches: Vec<Tensor<4>> = public
            .chunks(self.batch_size.max(1))
            .map(|b| make_batch(data, norm, b, &base).0)
            .collect();
        let matched = (0..clients.len())
            .into_par_iter()
            .map(|own| -> Result<Matched<M>, StrategyError> {
                let timer = Instant::now();
                let client = clients[own];
                let model = match cfg.tune_own {
                    false => inference[own].clone(),
                    true => {
                        // The authors' code first tunes (a copy of) the client's model too.
                        let stream = 1 + (pool.len() + client) as u64;
                        let mut rng: ChaCha8Rng =
                            rng_for(self.seed, Purpose::Server, round as u64, stream);
                        let parts: Vec<BlockRef> = (0..specs[own].len())
                            .map(|block| BlockRef { model: 0, block })
                            .collect();
                        let none = Stitches::new(&vec![None; parts.len() + 1], &mut rng, &base);
                        let (tuned, _) = pfedhr::tune_candidate(
                            vec![load(client)?],
                            &parts,
                            none,
                            data,
                            norm,
                            public,
                            &club.stitch,
                            &mut rng,
                        );
                        tuned.into_iter().next().expect("one model").valid()
                    }
                };
                let logits: Vec<Tensor<2>> =
                    batches.iter().map(|b| model.infer(b.clone())).collect();
                let mut best: Option<(f64, usize)> = None;
                for (k, t) in tuned.iter().enumerate() {
                    let score = agreement(&batches, &logits, &|x| t.teacher.logits(x));
                    if best.is_none_or(|(s, _)| score > s) {
                        best = Some((score, k));
                    }
                }
                let (_, k) = best.expect("a non-empty pool");
                let own_size = self.params[client] as f64;
                let shared = if own == 0 {
                    [search, stitching]
                } else {
                    [0.0; 2]
                };
                Ok(Matched {
                    teacher: Some(Assigned {
                        teacher: tuned[k].teacher.clone(),
                        bytes: 4 * tuned[k].size,
                        round,
                        sources: tuned[k].sources.clone(),
                        copy: k + 1,
                    }),
                    phi: Some((tuned[k].size as f64 - own_size) / own_size),
                    candidates: if own == 0 { pool.len() } else { 0 },
                    valid: pool.len() as f64,
                    seconds: [shared[0], shared[1], timer.elapsed().as_secs_f64()],
                })
            })
            .collect::<Result<_, _>>()?;
        Ok((matched, [features_seconds, grouping]))
    }
}
